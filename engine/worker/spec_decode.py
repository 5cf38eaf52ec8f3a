"""Verifying drafts: which of a row's proposed tokens the target keeps, and the token after them.

A row with drafts d_0 .. d_{k-1} ran the target over its last token and the drafts, so it has
the target's logits at k + 1 positions: position j gives the distribution p_j of the token after
d_{j-1}. Verification walks the positions in order:

- greedy: d_j is kept while it is p_j's argmax; the first position whose argmax differs gives
  that argmax instead, and ends the row; all k kept, position k's argmax follows them. The
  tokens are those of decoding without drafts, always.
- sampling (Leviathan et al. 2023): d_j, drawn from the proposer's q_j, is kept with
  probability min(1, p_j(d_j) / q_j(d_j)); on a refusal the token is drawn from the normalised
  max(p_j - q_j, 0), and the row ends; all k kept, a token is drawn from p_k. A proposer that
  puts all its mass on its draft (prompt lookup, a greedy draft model) has a one-hot q_j: d_j is
  kept with probability p_j(d_j), and a refused one's replacement is drawn from p_j without it.
  A draft model that samples gives its q (engine/worker/draft.py). Each token is distributed
  exactly as the target's, whatever the drafts.

p_j is the target's distribution after everything the sampler applies (penalties, counted over
the output and the drafts before j; min_tokens; temperature, top-k, top-p, min-p). Logprobs are
the target's, at the positions of the tokens kept.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from engine.messages import Logprobs
from engine.worker.sampler import (
    Sampler,
    SamplingRow,
    argmax,
    plain_greedy,
    top_k_top_p_min_p,
)


def greedy(targets: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """The kept tokens of each row: ``targets`` holds each row's argmaxes, ``len(d) + 1`` for a
    row with drafts ``d``, rows in order."""
    out, at = [], 0
    for d in drafts:
        t = targets[at : at + len(d) + 1]
        kept = 0
        while kept < len(d) and t[kept] == d[kept]:
            kept += 1
        out.append(t[: kept + 1])
        at += len(d) + 1
    return out


def kept_tokens(
    model: Any,
    sampler: Sampler,
    hidden: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    grammar: tuple[list[str], list[str], bytes] | None,
    q: list[torch.Tensor | None] | None = None,
) -> tuple[list[list[int]], list[Logprobs | None]]:
    """Each row's kept tokens and logprobs, from the model's final hidden states at every
    position the rows sample (``len(d) + 1`` a row): plain greedy rows through the model's
    greedy head (no logits), the others through ``verify``."""
    if grammar is None and plain_greedy(rows):
        sampler.sample_ns = sampler.logprobs_ns = 0
        return greedy(model.greedy_tokens(hidden).tolist(), drafts), [None] * len(rows)
    return verify(sampler, model.logits(hidden), rows, drafts, grammar, q)


def verify(
    sampler: Sampler,
    logits: torch.Tensor,
    rows: list[SamplingRow],
    drafts: list[list[int]],
    grammar: tuple[list[str], list[str], bytes] | None = None,
    q: list[torch.Tensor | None] | None = None,
) -> tuple[list[list[int]], list[Logprobs | None]]:
    """Kept tokens and logprobs per row. ``logits``: [sum(len(d) + 1), V], each row's
    positions in order; ``grammar`` as the sampler's, with a mask at each position of a row
    under a grammar; ``q``: each row's proposal distributions at its drafts ([len(d), V]), or
    None for drafts with all their mass on them."""
    start = time.perf_counter_ns()
    expanded: list[SamplingRow] = []
    for row, d in zip(rows, drafts):
        expanded.append(row)
        p = row.params
        counted = p.has_penalties or len(row.output_token_ids) < p.min_tokens
        for j in range(len(d)):  # position j + 1 sees the drafts before it as output
            if counted:
                seen = row.output_token_ids + d[: j + 1]
                expanded.append(
                    SamplingRow(p, row.generator, row.prompt_token_ids, seen, row.eos_token_ids)
                )
            else:
                expanded.append(row)
    raw = logits
    if grammar is not None:
        logits = _masked(sampler, logits, drafts, *grammar)
    logits = sampler.apply_penalties(logits, expanded)
    best = argmax(logits).tolist()
    probs = None
    if not all(r.params.greedy for r in rows):
        temps = torch.tensor([1.0 if r.params.greedy else r.params.temperature for r in expanded],
                             device=logits.device)  # fmt: skip
        probs = top_k_top_p_min_p(logits / temps.unsqueeze(1), expanded).softmax(dim=-1)
    out: list[list[int]] = []
    at = 0
    for i, (row, d) in enumerate(zip(rows, drafts)):
        if row.params.greedy:
            out.extend(greedy(best[at : at + len(d) + 1], [d]))
        else:
            assert probs is not None
            generator = row.generator or sampler.generator
            out.append(_rejection(probs[at : at + len(d) + 1], d, generator,
                                  q[i] if q is not None else None))  # fmt: skip
        at += len(d) + 1
    sampled_at = time.perf_counter_ns()
    sampler.sample_ns = sampled_at - start
    logprobs = _logprobs(sampler, raw, expanded, drafts, out)
    sampler.logprobs_ns = time.perf_counter_ns() - sampled_at
    return out, logprobs


def _masked(
    sampler: Sampler, logits: torch.Tensor, drafts: list[list[int]], req_ids: list[str],
    grammar_ids: list[str], bitmask: bytes,
) -> torch.Tensor:  # fmt: skip
    """The logits under the grammar masks: a grammar row's ``len(d) + 1`` masks, one a
    position, in order (its id repeated in ``grammar_ids``: EngineCore._grammar_masks)."""
    first: dict[str, int] = {}
    for j, rid in enumerate(grammar_ids):
        first.setdefault(rid, j)
    positions: list[int] = []
    masks: list[int] = []
    at = 0
    for rid, d in zip(req_ids, drafts):
        if rid in first:
            positions.extend(range(at, at + len(d) + 1))
            masks.extend(range(first[rid], first[rid] + len(d) + 1))
        at += len(d) + 1
    return sampler.mask_rows(logits, positions, masks, bitmask, len(grammar_ids))


def _rejection(
    probs: torch.Tensor, drafts: list[int], generator: torch.Generator,
    q: torch.Tensor | None = None,
) -> list[int]:  # fmt: skip
    """Tokens of one sampling row: ``probs`` [len(drafts) + 1, V], the target's at each
    position; ``q`` [len(drafts), V], the proposal's at each draft (None: one-hot)."""
    kept: list[int] = []  # (a draft shares the target's vocabulary: spec_config.check_draft)
    for j, d in enumerate(drafts):
        p = probs[j]
        u = torch.rand((), generator=generator, device=p.device)
        if q is None:
            if u < p[d]:
                kept.append(d)
                continue
            residual = p.clone()
            residual[d] = 0.0
        else:
            qj = q[j].to(p.device)
            if u * qj[d] < p[d]:  # u < p / q, without dividing by a q of 0
                kept.append(d)
                continue
            residual = (p - qj).clamp_(min=0.0)
            if not float(residual.sum()) > 0.0:  # p is q here: nothing to correct
                residual = p
        kept.append(int(torch.multinomial(residual, 1, generator=generator)))
        return kept
    kept.append(int(torch.multinomial(probs[len(drafts)], 1, generator=generator)))
    return kept


def _logprobs(
    sampler: Sampler,
    raw: torch.Tensor,
    expanded: list[SamplingRow],
    drafts: list[list[int]],
    tokens: list[list[int]],
) -> list[Logprobs | None]:
    """Each row's logprobs (where it asked) at the positions of its kept tokens, one entry a
    token, as a step without drafts gives one."""
    where: list[int] = []
    sampled: list[int] = []
    at = 0
    for d, kept in zip(drafts, tokens):
        if expanded[at].params.logprobs is not None:
            where.extend(range(at, at + len(kept)))
            sampled.extend(kept)
        at += len(d) + 1
    out: list[Logprobs | None] = [None] * len(drafts)
    if not where:
        return out
    each = sampler.logprobs_of(raw[where], [expanded[i] for i in where],
                             torch.tensor(sampled, device=raw.device))  # fmt: skip
    at = i = 0
    for r, (d, kept) in enumerate(zip(drafts, tokens)):
        if expanded[at].params.logprobs is not None:
            parts = [lp for lp in each[i : i + len(kept)] if lp is not None]
            out[r] = Logprobs([x for lp in parts for x in lp.token_ids],
                              [x for lp in parts for x in lp.logprobs],
                              [x for lp in parts for x in lp.ranks])  # fmt: skip
            i += len(kept)
        at += len(d) + 1
    return out
