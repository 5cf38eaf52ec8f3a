"""Who shared each request's steps, and what held or preempted it: the neighbours a diagnosis
names, each step's prefilling requests, the limit that held a request in the queue, and the
intervals after its preemptions (from the memberships ``tracing.diagnose_load`` reads and the
phases ``tracing.shares.place`` gives them)."""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from tracing.diagnosis import StepFacts
from tracing.shares import MemberPhases, Memberships, StepShare, StepTimes, Windows

# (request id, phase) -> other request prefilling in its steps -> (its tokens there, step ids)
Neighbours = dict[tuple[str, str], dict[str, tuple[int, list[int]]]]


def prefill_members(members: Memberships, placed: MemberPhases) -> dict[int, list[tuple[str, int]]]:
    """Step id -> the requests in their TTFT phase in it and their tokens, most tokens first;
    of equal chunks the one the step took last first (it is the one that lengthened it)."""
    out: dict[int, list[tuple[str, int]]] = {}
    for i in np.flatnonzero(placed.ttft):
        step = int(members.step_id[i])
        out.setdefault(step, []).append((members.request_id[i], int(members.tokens[i])))
    for found in out.values():
        found.reverse()
        found.sort(key=lambda m: -m[1])
    return out


def neighbours(members: Memberships, placed: MemberPhases) -> Neighbours:
    """Per request and phase, the other requests in their TTFT phase in the steps it took part
    in: their tokens there, summed, and those steps."""
    by_step: dict[int, list[int]] = defaultdict(list)
    for i, step in enumerate(members.step_id):
        by_step[int(step)].append(i)
    tokens: dict[tuple[str, str], Counter[str]] = defaultdict(Counter)
    steps: dict[tuple[str, str, str], set[int]] = defaultdict(set)
    for step, rows in by_step.items():
        prefilling = [j for j in rows if placed.ttft[j]]
        for i in rows:
            mine = (members.request_id[i], "ttft" if placed.ttft[i] else "decode")
            for j in prefilling:
                other = members.request_id[j]
                if other != mine[0]:
                    tokens[mine][other] += int(members.tokens[j])
                    steps[(*mine, other)].add(step)
    return {
        key: {other: (n, sorted(steps[(*key, other)])) for other, n in found.items()}
        for key, found in tokens.items()
    }


def wait_reasons(
    received: list[int | None],
    scheduled: list[int | None],
    windows: Windows,
    shares: dict[tuple[str, str], StepShare],
    steps: list[StepFacts],
) -> dict[str, str]:
    """Request id -> the limit most of the steps it waited through recorded (steps.wait_reason),
    from its receipt to its first step (or its end where it never ran)."""
    starts = np.array([s.start_ns for s in steps], dtype=np.int64)
    out: dict[str, str] = {}
    for i, rid in enumerate(windows.request_id):
        since = received[i]
        if not since:
            continue
        firsts = [shares[(rid, p)].first_start for p in ("ttft", "decode") if (rid, p) in shares]
        until = scheduled[i] or (min(firsts) if firsts else int(windows.end[i]))
        during = np.flatnonzero((starts >= since) & (starts < until))
        held = Counter(r for k in during if (r := steps[k].wait_reason))
        if held:
            out[rid] = held.most_common(1)[0][0]
    return out


def preemptions(
    preempted: Memberships,
    members: Memberships,
    placed: MemberPhases,
    times: StepTimes,
    windows: Windows,
) -> dict[str, list[tuple[int, int]]]:
    """Request id -> (the preempting step began, its next step began or it ended) per
    preemption."""
    if not preempted.request_id:
        return {}
    start_of = dict(zip(times.step_id.tolist(), times.schedule_start_ns.tolist()))
    end_of = dict(zip(windows.request_id, windows.end.tolist()))
    ran: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for i, rid in enumerate(members.request_id):
        step = int(members.step_id[i])
        ran[rid].append((step, int(times.schedule_start_ns[placed.step[i]])))
    out: dict[str, list[tuple[int, int]]] = {}
    for step_id, rid in zip(preempted.step_id.tolist(), preempted.request_id):
        later = [start for step, start in ran[rid] if step > step_id]
        out.setdefault(rid, []).append((start_of[step_id], min(later, default=end_of[rid])))
    return out
