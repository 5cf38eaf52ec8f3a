"""The ``draft_model`` proposer: a second checkpoint of the target's tokenizer (or the target's
own, quantized on load: the self-draft), run by the driver beside the target.

The draft keeps KV of its own in a pool of as many blocks as the target's, addressed by the
target's block tables: position p of a request lies in the same block id and place in both
pools, so the scheduler's tables serve it and nothing else is allocated per request (the
scheduler gives a speculating step's rows k slots past their tokens for the draft's, the
``needs_kv`` lookahead). A request's draft KV is valid up to ``known[request]``:

- after the target sampled the request's token at position L, the draft runs the tokens it has
  not seen (the whole prompt on its first step; then 1, or 2 when every draft was kept) and
  takes its token as d1, then k - 1 steps of one row (d1 at L + 1, ...) for d2 .. dk;
- the target keeps a of the drafts: positions up to L + a hold tokens the draft fed itself, so
  ``known`` falls back to the new last position, whose token the next round feeds.

The self-draft (the target's own checkpoint, quantized on load) shares the target's pool
instead: it reads the target's exact KV before the last token and writes its own only past it.

Its tokens: for a greedy request, one with a seed (its output must not depend on the draft
runner's shared generator) or one under a grammar (draft_params), the draft's argmax, a
proposal with all its mass on it; for a
request that samples, a draw from the draft's own distribution q under the request's
temperature, top-k, top-p and min-p (no penalties: q may be any distribution), kept with q for
verification, which keeps a draft with probability min(1, p/q) and draws a refused one's
replacement from max(p - q, 0) (engine/worker/spec_decode.py). Either way each token is the
target's distribution exactly; drafts from q are kept more often at a temperature (a greedy
draft is refused whenever the target's p of it is low, however likely q found it). Rows run
the draft runner's own decode path (its decode mirror and fused layers on CPU), as a decode
batch of its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.worker.messages import NewRequestData, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=1)
# A catch-up of at most this many tokens (one, or two after every draft was kept) runs as decode
# rows of the request's slot in the draft's decode mirror; more (a prompt) as a prefill chunk.
CATCH_UP_ROWS = 4


def draft_params(row: Any) -> SamplingParams:
    """How the draft proposes for a request (the module docstring): its argmax, or a draw
    under the request's temperature and truncation. A request under a grammar drafts argmaxes:
    the core cuts its drafts at the first the grammar refuses and samples that position from
    the target's p, which keeps p only for a proposal whose draft is certain (one drawn from q
    and cut would need the refusal judged by min(1, p/q) instead)."""
    p = row.params
    if p.greedy or row.generator is not None or p.structured_outputs is not None:
        return GREEDY
    return SamplingParams(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p,
                          min_p=p.min_p, max_tokens=1)  # fmt: skip


class DraftProposer:
    def __init__(self, runner: Any, shared: bool) -> None:
        """``runner``: the draft's ModelRunner, its weights loaded (``check`` gives its config);
        ``shared``: it reads and writes the target's KV pool (the self-draft)."""
        self.runner = runner
        self.shared = shared
        self.known: dict[str, int] = {}  # request -> positions whose draft KV is valid
        self._step = 0
        # request -> q at each of its last drafts (a request that samples: draft_params)
        self.q: dict[str, list[torch.Tensor]] = {}
        runner.sampler.keep_probs = True

    @staticmethod
    def check(spec: SpeculativeConfig, layout: KVLayout) -> tuple[ModelConfig, KVLayout]:
        """The draft's config and KV layout, where it can draft for a target of ``layout``: its
        KV is addressed by the target's block tables, so it has the same KV groups (their
        windows), whatever its depth."""
        assert spec.model is not None
        cfg = ModelConfig.from_path(spec.model)
        own = KVLayout.of(cfg, len(layout.windows) > 1)
        if own.windows != layout.windows:
            raise ValueError(
                f"--speculative-config: the draft's KV layout (sliding windows {own.windows}) is "
                f"not the target's ({layout.windows}): its KV shares the target's block tables"
            )
        return cfg, own  # (its vocabulary and tokenizer: spec_config.check_draft, at start)

    @staticmethod
    def shares_pool(spec: SpeculativeConfig, target: ModelConfig, tensor_parallel: int) -> bool:
        """The target's own checkpoint (quantized or not): its KV has the target's shape, so it
        reads the target's pool, whose positions the target computed are exact, and writes its
        drafts' KV at the positions past them, which the target's verifying pass writes over.
        No pool of its own, no prompt to run again: it feeds each request's last token. (Under
        tensor parallelism the driver's pool holds its share of the heads: the draft, unsharded,
        keeps a pool of its own.)"""
        assert spec.model is not None
        same = Path(spec.model).resolve() == Path(target.path).resolve()
        return same and tensor_parallel == 1

    def block_bytes(self) -> int:
        return 0 if self.shared else self.runner.block_bytes()

    def init_kv_cache(
        self, num_blocks: int, target: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> None:
        self.runner.init_kv_cache(num_blocks, target if self.shared else None)

    def release_kv_cache(self) -> None:
        self.runner.release_kv_cache()

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.known[req_id] = 0

    def drop(self, finished: list[str], preempted: list[str] = ()) -> None:  # type: ignore[assignment]
        """Finished requests leave; preempted ones lose their blocks (so their draft KV)."""
        for r in finished:
            self.known.pop(r, None)
            self.q.pop(r, None)
        for r in preempted:
            if r in self.known:
                self.known[r] = 0
        if finished or preempted:
            self.runner.execute_model(
                SchedulerOutput(
                    step_id=-1, finished_req_ids=list(finished), preempted_req_ids=list(preempted)
                )
            )

    def propose(
        self, req_ids: list[str], rows: dict[str, Any], k: int, sched: SchedulerOutput
    ) -> dict[str, list[int]]:
        """k drafts for each of ``req_ids`` (rows the target sampled this step), from their
        tokens so far (``rows``: the target's SamplingRow of each) and the step's block tables."""
        at = {rid: i for i, rid in enumerate(sched.req_ids)}
        out: dict[str, list[int]] = {}
        first = SchedulerOutput(step_id=self._next())
        last: dict[str, int] = {}  # request -> its last position
        for rid in req_ids:
            row = rows.get(rid)
            i = at.get(rid)
            if row is None or i is None:
                continue
            if rid not in self.runner.rows:
                first.new_requests.append(
                    NewRequestData(rid, row.prompt_token_ids, draft_params(row), frozenset())
                )
            n_prompt = len(row.prompt_token_ids)
            end = n_prompt + len(row.output_token_ids)  # the tokens known; the last at end - 1
            if end >= self.runner.max_model_len:
                continue  # no position left for a draft
            start = end - 1 if self.shared else min(self.known.get(rid, 0), end - 1)
            if start < n_prompt:
                tokens = row.prompt_token_ids[start:] + row.output_token_ids
            else:
                tokens = row.output_token_ids[start - n_prompt :]
            self._row(first, sched, i, rid, tokens, start)
            last[rid] = end - 1
        if not first.req_ids:
            return out
        for rid in first.req_ids:
            self.q.pop(rid, None)
        drafts = self._run(first)
        for rid, token in drafts.items():
            out[rid] = [token]
            self.known[rid] = last[rid] + 1
        for j in range(1, k):
            step = SchedulerOutput(step_id=self._next())
            for rid in out:
                # A draft's position is in the context: draft j lies at last + j + 1.
                if last[rid] + j + 1 < self.runner.max_model_len:
                    self._row(step, sched, at[rid], rid, [out[rid][-1]], last[rid] + j)
            if not step.req_ids:
                break
            for rid, token in self._run(step).items():
                out[rid].append(token)
                self.known[rid] = last[rid] + j + 1
        return out

    def _row(
        self, step: SchedulerOutput, sched: SchedulerOutput, i: int, rid: str, tokens: list[int],
        start: int,
    ) -> None:  # fmt: skip
        step.req_ids.append(rid)
        step.token_ids.append(tokens)
        if 1 < len(tokens) <= CATCH_UP_ROWS:  # a few tokens: as decode rows of its slot
            step.spec_token_ids[rid] = tokens[1:]
            step.spec_catch_up = True
        step.num_computed_tokens.append(start)
        step.block_tables.append(sched.block_tables[i])
        if sched.group_block_tables:
            step.group_block_tables.append(sched.group_block_tables[i])
        step.sample.append(True)
        if len(tokens) > 1:
            step.num_prefill_tokens += len(tokens)
        else:
            step.num_decode_tokens += 1

    def draft_probs(self, req_id: str, n: int) -> torch.Tensor | None:
        """q at the request's first ``n`` drafts ([n, V]), where they were drawn from it; None
        where they are the draft's argmaxes."""
        q = self.q.get(req_id)
        if not n or not q:
            return None
        # One q a draft it drew (_run); the scheduler only cuts the drafts short.
        assert len(q) >= n, (req_id, len(q), n)
        return torch.stack(q[:n])

    def _run(self, step: SchedulerOutput) -> dict[str, int]:
        sampler = self.runner.sampler
        sampler.probs = None  # the greedy head does not call the sampler
        result = self.runner.execute_model(step)
        for rid in result.req_ids:  # the draft's rows read no tokens of theirs (no penalties)
            self.runner.rows[rid].output_token_ids.clear()
        if sampler.probs is not None:
            for i, rid in enumerate(result.req_ids):
                if not self.runner.rows[rid].params.greedy:
                    self.q.setdefault(rid, []).append(sampler.probs[i])
        return dict(zip(result.req_ids, result.sampled_token_ids))

    def _next(self) -> int:
        self._step += 1
        return self._step
