"""The engine's warm-up before READY: what the first real steps run, then a few timed shapes
that give the diagnosis its prior price of a step."""

from __future__ import annotations

import time

import numpy as np

from engine.config import EngineConfig
from engine.executor import Executor
from engine.least_squares import nonnegative_fit
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
PRIOR_ROWS = (1, 4)  # decode batches it times, each PRIOR_REPEATS times on each path
PRIOR_REPEATS = 3


def _prior(
    executor: Executor, config: EngineConfig, blocks: list[int], max_model_len: int
) -> list[float]:
    """[a, b, c, f, g] ns of execute = a + b * prefill tokens + c * rows, plus f * rows + g on
    a step that takes the full logits: what the diagnosis prices a step by where the run itself
    has too few steps, or too few long prompts, or steps of one path only, to price one
    (tracing.step_fit).

    a, b, c are fitted to warm greedy steps (the greedy head): two prompt lengths, each the
    faster of PRIOR_REPEATS prefills (a new shape's first run may be cold), and decode batches
    of PRIOR_ROWS rows, each counted PRIOR_REPEATS times. f and g are what the full logits (a
    sampled row: temperature 1) cost the forward over the greedy head: the same batches of
    twin requests, sampled, each timed right after its greedy twin, so both see the machine in
    the same state; per batch size, the faster of its repeats on each path, their difference
    (never below 0) a line through the two sizes: g a step, f a row. The difference is mostly
    a step's, not a row's: the two heads read the same weight once a step, and differ in their
    kernels (on SmolLM2, 1.5 ms at 1 row and 2.2 ms at 16; priced per row at 1 and 2 rows it
    read 5 ms at 5 rows where the run's steps differed by 1-2 ms). The sampler's own time (the
    output's sample_ns) is left out, as the run's fit leaves it out. Each timing is the
    executor's whole call, as the step record's execute is."""
    steps = PRIOR_REPEATS * len(PRIOR_ROWS) + 1
    cap = min(config.max_num_batched_tokens, max_model_len - steps - 1)
    lengths = [min(n, cap) for n in PRIOR_PREFILLS]
    if lengths[0] == lengths[1] or lengths[0] < 1:
        return []  # two lengths are what price a prefill token
    width = max(PRIOR_ROWS)
    # Requests 0..width-1 greedy (0 and 1 of the two lengths, the rest of the first), their
    # sampled twins after them.
    sizes = [*lengths, *[lengths[0]] * (width - len(lengths))] * 2
    bs = config.block_size
    needed = [-(-(n + steps) // bs) for n in sizes]
    if sum(needed) > len(blocks):
        return []
    ids = [f"lumen-warmup-prior-{i}" for i in range(width)]
    ids += [f"{rid}-sampled" for rid in ids]
    ends = np.cumsum([0, *needed])
    tables = [blocks[ends[i] : ends[i + 1]] for i in range(len(ids))]
    greedy = SamplingParams(temperature=0.0, max_tokens=steps + 1)
    sampled = SamplingParams(temperature=1.0, seed=0, max_tokens=steps + 1)
    position, last = list(sizes), [1] * len(ids)
    shapes: list[tuple[int, int]] = []  # greedy steps: prefill tokens, rows
    times: list[int] = []

    def timed(sched: SchedulerOutput, rows: list[int]) -> int:
        start = time.perf_counter_ns()
        out = executor.execute_model(sched)
        took = time.perf_counter_ns() - start
        for i in rows:
            if ids[i] in out.req_ids:
                last[i] = out.sampled_token_ids[out.req_ids.index(ids[i])]
        return took - out.sample_ns

    def prefill(i: int, params: SamplingParams) -> int:
        n = sizes[i]
        prompt = [1 + (j * 13 + i % 2) % 100 for j in range(n)]
        new = NewRequestData(ids[i], prompt, params, frozenset())
        return timed(SchedulerOutput(-1, [new], [ids[i]], [prompt], [0], [tables[i]], [True],
                                     num_prefill_tokens=n), [i])  # fmt: skip

    for i in range(width):
        if i < 2:  # the two lengths, timed: they price a prefill token
            best = 0
            for repeat in range(PRIOR_REPEATS):  # the same prompt into the same blocks, anew
                if repeat:
                    executor.execute_model(SchedulerOutput(-1, finished_req_ids=[ids[i]]))
                took = prefill(i, greedy)
                best = took if not best else min(best, took)
            shapes.append((sizes[i], 1))
            times.append(best)
        else:
            prefill(i, greedy)
        prefill(width + i, sampled)

    def decode(rows: list[int]) -> int:
        sched = SchedulerOutput(
            -1, [], [ids[i] for i in rows], [[last[i]] for i in rows],
            [position[i] for i in rows], [tables[i] for i in rows], [True] * len(rows),
            num_decode_tokens=len(rows),
        )  # fmt: skip
        took = timed(sched, rows)
        for i in rows:
            position[i] += 1
        return took

    fastest: dict[tuple[int, bool], int] = {}
    for _ in range(PRIOR_REPEATS):
        for k in PRIOR_ROWS:
            took = decode(list(range(k)))
            shapes.append((0, k))
            times.append(took)
            full = decode([width + i for i in range(k)])
            for key, value in (((k, False), took), ((k, True), full)):
                fastest[key] = min(fastest.get(key, value), value)
    executor.execute_model(SchedulerOutput(-1, finished_req_ids=ids))
    x = np.array([[1.0, p, r] for p, r in shapes])
    y = np.array(times, dtype=float)
    (k0, k1), diff = PRIOR_ROWS, [max(fastest[k, True] - fastest[k, False], 0) for k in PRIOR_ROWS]
    f = max((diff[1] - diff[0]) / (k1 - k0), 0.0)
    g = max(diff[0] - f * k0, 0.0)
    return [*(float(v) for v in nonnegative_fit(x, y)), float(f), float(g)]
