"""The engine's warm-up before READY: what the first real steps run, then a few timed shapes
that give the diagnosis its prior price of a step."""

from __future__ import annotations

import time

import numpy as np

from engine.config import EngineConfig
from engine.executor import Executor
from engine.sampling_params import SamplingParams
from engine.worker.messages import NewRequestData, SchedulerOutput

WARMUP_PROMPT_TOKENS = (32, 80)  # a greedy request and a sampled one, of two lengths
WARMUP_DECODE_STEPS = 2


def warm_up(
    executor: Executor, config: EngineConfig, num_blocks: int, max_model_len: int
) -> tuple[float, list[float]]:
    """What the first real steps run, through the real executor, before READY.

    The first forward of each path pays one-time costs (kernel selection, allocator growth,
    lazy init) that would otherwise land on the first requests as a cold first step. Two
    requests: A, greedy (the greedy head), and B, sampled with temperature, top-k, top-p and
    logprobs (full logits and the sampler), of another prompt length. The steps: A's prefill
    alone; B's prefill beside A's decode row (a mixed step); WARMUP_DECODE_STEPS decodes of
    both (a batch); one decode of A alone. It bypasses the scheduler: its blocks are free ones
    the KV cache manager hands out later (their stale contents are overwritten before any
    read), and the runner forgets the requests at the end.

    Then, warm, it times a few shapes for the diagnosis's prior price of a step (``_prior``).
    Every sequence stays within ``max_model_len`` (prompts are cut to fit). Returns the
    seconds it all took, and the prior ([] where the KV cache or the context is too small).
    """
    started = time.monotonic()
    steps = WARMUP_DECODE_STEPS + 2
    lengths = [min(n, max_model_len - steps - 1) for n in WARMUP_PROMPT_TOKENS]
    needed = [-(-(n + steps) // config.block_size) for n in lengths]
    # Block 0 is left alone: a model with sliding windows keeps it as the null block, which is
    # never written (engine/core/kv_cache_manager.py).
    if min(lengths) < 1 or 1 + sum(needed) > num_blocks:
        return 0.0, []
    ids = ("lumen-warmup-greedy", "lumen-warmup-sampled")
    tables = [list(range(1, 1 + needed[0])), list(range(1 + needed[0], 1 + sum(needed)))]
    prompts = [[1 + (i * 7 + j) % 100 for j in range(n)] for i, n in enumerate(lengths)]
    params = [
        SamplingParams(temperature=0.0, max_tokens=steps + 1),
        SamplingParams(temperature=0.7, top_k=50, top_p=0.9, logprobs=2, max_tokens=steps + 1),
    ]
    new = [NewRequestData(rid, p, sp, frozenset()) for rid, p, sp in zip(ids, prompts, params)]
    positions = [len(p) for p in prompts]
    last = [1, 1]

    def run(rows: list[int], new_rows: list[int]) -> None:
        """One step: the rows in ``new_rows`` prefill their prompt, the others decode one."""
        tokens = [prompts[i] if i in new_rows else [last[i]] for i in rows]
        out = executor.execute_model(
            SchedulerOutput(
                -1, [new[i] for i in new_rows], [ids[i] for i in rows], tokens,
                [0 if i in new_rows else positions[i] for i in rows], [tables[i] for i in rows],
                [True] * len(rows),
                num_prefill_tokens=sum(len(prompts[i]) for i in new_rows),
                num_decode_tokens=len(rows) - len(new_rows),
            )
        )  # fmt: skip
        for i in rows:
            if i not in new_rows:
                positions[i] += 1
            if ids[i] in out.req_ids:
                last[i] = out.sampled_token_ids[out.req_ids.index(ids[i])]

    run([0], [0])
    run([0, 1], [1])
    for _ in range(WARMUP_DECODE_STEPS):
        run([0, 1], [])
    run([0], [])
    executor.execute_model(SchedulerOutput(-1, finished_req_ids=list(ids)))
    free = range(1 + sum(needed), num_blocks)
    prior = _prior(executor, config, list(free), max_model_len)
    return time.monotonic() - started, prior


PRIOR_PREFILLS = (16, 128)  # prompt lengths the prior times, each alone
PRIOR_ROWS = (1, 2)  # decode batches it times, each PRIOR_REPEATS times
PRIOR_REPEATS = 3


def _prior(
    executor: Executor, config: EngineConfig, blocks: list[int], max_model_len: int
) -> list[float]:
    """[a, b, c, f] ns of execute = a + b * prefill tokens + c * rows + f * full rows, fitted
    to warm steps of a few shapes: what the diagnosis prices a step by where the run itself has
    too few steps, or too few long prompts, or steps of one path only, to price one
    (tracing.step_fit). Greedy steps take the fused head; the same decode batches sampled
    (temperature 1) take the full logits and the sampler, whose own time (the output's
    sample_ns) is left out, as the run's fit leaves it out: f is what the full logits cost the
    forward, a row. Each timing is the executor's whole call, as the step record's execute is:
    each prefill is the faster of PRIOR_REPEATS (a new shape's first run may be cold), each
    decode batch counts PRIOR_REPEATS times."""
    steps = 2 * PRIOR_REPEATS * len(PRIOR_ROWS) + 1
    cap = min(config.max_num_batched_tokens, max_model_len) - steps - 1  # the second prefills
    lengths = [min(n, cap) for n in PRIOR_PREFILLS]
    if lengths[0] == lengths[1] or lengths[0] < 1:
        return []  # two lengths are what price a prefill token
    bs = config.block_size
    needed = [-(-(n + steps) // bs) for n in lengths]
    if sum(needed) > len(blocks):
        return []
    ids = [f"lumen-warmup-prior-{n}" for n in lengths]
    tables = [blocks[: needed[0]], blocks[needed[0] : sum(needed)]]
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    position, last = list(lengths), [1, 1]
    shapes: list[tuple[int, int, int]] = []  # prefill tokens, rows, full rows
    times: list[int] = []

    def timed(sched: SchedulerOutput, rows: list[int]) -> int:
        start = time.perf_counter_ns()
        out = executor.execute_model(sched)
        took = time.perf_counter_ns() - start
        for i in rows:
            if ids[i] in out.req_ids:
                last[i] = out.sampled_token_ids[out.req_ids.index(ids[i])]
        return took - out.sample_ns

    for i, n in enumerate(lengths):
        prompt = [1 + (j * 13 + i) % 100 for j in range(n)]
        new = NewRequestData(ids[i], prompt, params, frozenset())
        best = 0
        for repeat in range(PRIOR_REPEATS):  # the same prompt into the same blocks, anew
            if repeat:
                executor.execute_model(SchedulerOutput(-1, finished_req_ids=[ids[i]]))
            took = timed(SchedulerOutput(-1, [new], [ids[i]], [prompt], [0], [tables[i]], [True],
                                         num_prefill_tokens=n), [i])  # fmt: skip
            best = took if not best else min(best, took)
        shapes.append((n, 1, 0))
        times.append(best)

    def decodes(full: bool) -> None:
        for _ in range(PRIOR_REPEATS):
            for k in PRIOR_ROWS:
                rows = list(range(k))
                sched = SchedulerOutput(
                    -1, [], [ids[i] for i in rows], [[last[i]] for i in rows],
                    [position[i] for i in rows], [tables[i] for i in rows], [True] * k,
                    num_decode_tokens=k,
                )  # fmt: skip
                times.append(timed(sched, rows))
                shapes.append((0, k, k if full else 0))
                for i in rows:
                    position[i] += 1

    decodes(full=False)
    # The same batches sampled: a request's parameters are read when it is added, so the two
    # come back as new requests whose prompts fill the same blocks to the same positions.
    executor.execute_model(SchedulerOutput(-1, finished_req_ids=ids))
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 1)
    ids = [f"lumen-warmup-prior-sampled-{n}" for n in lengths]
    for i in range(2):
        executor.execute_model(SchedulerOutput(
            -1, [NewRequestData(ids[i], [1] * position[i], sampled, frozenset())], [ids[i]],
            [[1] * position[i]], [0], [tables[i]], [True], num_prefill_tokens=position[i],
        ))  # fmt: skip
    decodes(full=True)
    executor.execute_model(SchedulerOutput(-1, finished_req_ids=ids))
    x = np.array([[1.0, p, r, f] for p, r, f in shapes])
    y = np.array(times, dtype=float)
    while True:  # a negative price: that term out, the rest refitted
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        worst = int(np.argmin(coef))
        # A column already out can come back a hair under 0 (-1e-20): that ends it too.
        if coef[worst] >= 0 or not x[:, worst].any():
            return [float(v) for v in np.clip(coef, 0.0, None)]
        x[:, worst] = 0.0
