"""A data-parallel run split per engine: each engine's steps, requests, restarts and pauses,
and when the other engines had room (``tracing.diagnose`` decomposes each engine's requests
over its own steps, and names queue time while another engine had room ``imbalance``)."""

from __future__ import annotations

from dataclasses import fields, replace

import numpy as np
import numpy.typing as npt

from tracing.diagnose_load import RunFacts
from tracing.shares import Memberships, StepTimes
from tracing.step_fit import IntArray

BoolArray = npt.NDArray[np.bool_]

STEP_RANK_SHIFT = 56  # engine r numbers its steps from r << 56 (engine/core/engine_core_proc.py)


def by_engine(facts: RunFacts) -> list[RunFacts]:
    """The run as each data-parallel engine saw it: its steps, the requests it served, its
    restarts; the run itself where it had one engine. Each engine's steps are a sequence of
    their own, so a request's wait is decomposed over its engine's steps only."""
    step_engine = facts.step_times.step_id >> STEP_RANK_SHIFT
    engines = sorted({int(e) for e in step_engine} | {r.engine or 0 for r in facts.requests})
    if len(engines) <= 1:
        return [facts]
    room = {e: _room(facts, e) for e in engines}
    out = []
    for engine in engines:
        keep = step_engine == engine
        times = StepTimes(**{f.name: _kept(getattr(facts.step_times, f.name), keep)
                             for f in fields(StepTimes)})  # fmt: skip
        mine = f"engine {engine}"
        pauses = [
            p._replace(process="server") if p.process == mine else p
            for p in facts.pauses
            if not p.process.startswith("engine ") or p.process == mine
        ]
        out.append(replace(
            facts,
            requests=[r for r in facts.requests if (r.engine or 0) == engine],
            steps=[s for s in facts.steps if s.step_id >> STEP_RANK_SHIFT == engine],
            step_times=times,
            members=_of_engine(facts.members, engine),
            preempted=_of_engine(facts.preempted, engine),
            pauses=pauses,
            lifecycle=[r for r in facts.lifecycle if r.engine is None or r.engine == engine],
            others_room=[span for e, spans in room.items() if e != engine for span in spans],
        ))  # fmt: skip
    return out


def _kept(column: IntArray, keep: BoolArray) -> IntArray:
    """A step column's entries for one engine's steps (a column not filled in yet, empty,
    stays so)."""
    return column[keep] if len(column) else column


def _room(facts: RunFacts, engine: int) -> list[tuple[int, int, int]]:
    """When ``engine`` had room for one more request: from each of its steps whose record had
    nobody waiting and fewer running than max_num_seqs to its next step, and around its steps
    (before the first, after the last: idle)."""
    limit = facts.max_num_seqs or 0
    steps = [s for s in facts.steps if s.step_id >> STEP_RANK_SHIFT == engine]
    if not steps:
        return [(0, 1 << 62, engine)]
    spans = [(0, steps[0].start_ns, engine)]
    for step, after in zip(steps, [*steps[1:], None]):
        if step.waiting == 0 and (not limit or step.running < limit):
            spans.append((step.start_ns, after.start_ns if after else 1 << 62, engine))
    return spans


def _of_engine(members: Memberships, engine: int) -> Memberships:
    keep = (members.step_id >> STEP_RANK_SHIFT) == engine
    return Memberships(
        members.step_id[keep],
        [rid for rid, k in zip(members.request_id, keep) if k],
        members.tokens[keep],
    )
