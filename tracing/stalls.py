"""What of a step was not its compute: the core stalling (stopped, starved, stuck in a long
call), the API process's pauses inside a stall, and the API process's CPU beside a step that
ran slow for its shape (numpy over ``tracing.shares.StepTimes``, per step; ``member_shares``
splits each share between the step's rows)."""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.spec_config import MAX_SPECULATIVE_TOKENS
from tracing.pauses import Intervals, Pauses
from tracing.shares import Memberships, StepTimes, full_rows, gc_inside, out_end
from tracing.step_fit import MIN_CAUSE_NS, OUTLIER_FACTOR, FloatArray, IntArray, StepWeights

# A long prompt's attention grows past the linear price of a prefill token (a 962-token Gemma 3
# step of 878 ms, priced at 272 ms by a run whose other prompts were short): a step's prefill is
# priced at up to this many times the fit's price before the step is the core stalling.
PREFILL_SLACK = 2.0
# A row of more tokens than a verifying row's (1 + the most drafts) after a request's first
# decode is a recompute after a preemption: its next decode joins the mirror again.
RECOMPUTE_TOKENS = MAX_SPECULATIVE_TOKENS + 1


def stall_limit(expected: Any, prefill: Any) -> Any:
    """The forward time past which a step is the core stalling, not computing: OUTLIER_FACTOR
    times its expected time with its prefill (``prefill``: its tokens at the fit's price) priced
    at PREFILL_SLACK times. The slack is the prefill's alone: a 16-token chunk priced at 22 ms
    in a 60 ms step does not excuse a 330 ms step (a stopped core read as that chunk's stall)."""
    return OUTLIER_FACTOR * (expected + (PREFILL_SLACK - 1.0) * prefill)


def join_tokens(step_ids: IntArray, members: Memberships) -> IntArray:
    """Per step, the context of the rows that decode in it for the first time since their
    prompt (or their recompute after a preemption) was computed: on CPU a row's context is
    copied into the decode mirror then (engine/worker/decode_cache.py), a cost of its
    prefill's that no fit of a step's shape prices (1,027 tokens joining cost a SmolLM2 step
    60 ms, 3x its time, after the 1.4 s step that prefilled them)."""
    out: IntArray = np.zeros(len(step_ids), dtype=np.int64)
    if not len(members.step_id):
        return out
    index = {int(sid): i for i, sid in enumerate(step_ids)}
    done: dict[str, int] = {}  # request -> its tokens so far
    joining: set[str] = set()  # requests whose context is computed and not yet mirrored
    for sid, rid, n in zip(members.step_id.tolist(), members.request_id, members.tokens.tolist()):
        before = done.get(rid, 0)
        if n == 1 and rid in joining:
            joining.discard(rid)
            if (i := index.get(sid)) is not None:
                out[i] += before
        elif n > RECOMPUTE_TOKENS or not before:
            joining.add(rid)  # a prompt's chunk, or a recompute's (past a verifying row's)
        done[rid] = before + n
    return out


def stall_excess(steps: StepTimes, weights: StepWeights, core_gc: Intervals) -> FloatArray:
    """Per step, the share of its forward that was the core stalling, not computing (0 for
    most): in a step whose forward (less the sampler, logprobs and the core's GC inside it) took
    OUTLIER_FACTOR x its expected time and MIN_CAUSE_NS over it, the part past its expected time
    (the core stopped, was starved of CPU, or was stuck in a long call). A step whose rows join
    the decode mirror (``steps.join_tokens``) has their context priced as prefill in the limit
    alone: its excess is their prefill's, not a stall."""
    if not len(steps.step_id) or not weights.fitted:
        return np.zeros(len(steps.step_id))
    gc = gc_inside(steps, core_gc)[1]
    forward = (steps.execute_end_ns - steps.execute_start_ns - steps.sample_ns
               - steps.logprobs_ns - steps.spec_ns - gc)  # fmt: skip
    prefill = weights.b * steps.prefill_tokens
    expected = weights.a + prefill + weights.c * steps.rows + weights.full_extra(full_rows(steps))
    joined = prefill + weights.b * steps.join_tokens
    slow = (forward >= stall_limit(expected, joined)) & (forward - expected >= MIN_CAUSE_NS)
    excess: FloatArray = np.where(slow, 1.0 - expected / np.maximum(forward, 1), 0.0)
    return excess


def api_taken(steps: StepTimes, excess: FloatArray, api: Pauses) -> FloatArray:
    """Per stalled step, the shares of its excess (stall_excess) that the API process's GC
    (row 0), event-loop lag (row 1) and busy CPU (row 2) took: where it paused inside the
    step's forward for at least half the excess, the core lost its CPU to that pause (a GC
    pause is CPU work; the client, the API process and the core share the machine's cores),
    split between the two by their time in it; else where it was busy (its ``cpu`` rows) for
    half the excess, to its CPU. The rule slow_steps names such a step's cause by."""
    out: FloatArray = np.zeros((3, len(steps.step_id)))
    forward = (steps.execute_end_ns - steps.execute_start_ns - steps.sample_ns
               - steps.logprobs_ns - steps.spec_ns)  # fmt: skip
    for i in np.flatnonzero(excess > 0):
        a, b = int(steps.execute_start_ns[i]), int(steps.execute_end_ns[i])
        gc, lag = api.gc.within(a, b), api.lag.within(a, b)
        if 2 * (gc + lag) >= excess[i] * forward[i]:
            out[:2, i] = (gc / (gc + lag), lag / (gc + lag))
        elif 2 * api.busy.within(a, b) >= excess[i] * forward[i]:
            out[2, i] = 1.0
    return out


def phase_stalls(steps: StepTimes, core_gc: Intervals) -> FloatArray:
    """Per step, the share of its schedule phase (row 0: to the forward's start, less the core's
    GC and the grammar masks in it) and of its output phase (row 1: to its outputs' send, less
    GC) that was the core stalling (0 for most): a phase that took OUTLIER_FACTOR x the run's
    median of it and MIN_CAUSE_NS over it, the part past the median. A stopped core stops in
    whichever phase it was in; a slow scheduler or output path is slow in most steps, which the
    median holds."""
    out: FloatArray = np.zeros((2, len(steps.step_id)))
    busy = (steps.prefill_tokens + steps.decode_tokens) > 0
    if not busy.any():
        return out
    gs, _, go = gc_inside(steps, core_gc)
    masks = np.where(steps.grammar_mask_ns > 0, steps.execute_start_ns - steps.schedule_end_ns, 0)
    sched = np.maximum(steps.execute_start_ns - steps.schedule_start_ns - gs - masks, 0)
    output = np.maximum(out_end(steps) - steps.execute_end_ns - go, 0)
    for row, phase in enumerate((sched, output)):
        typical = float(np.median(phase[busy]))
        slow = busy & (phase >= OUTLIER_FACTOR * typical) & (phase - typical >= MIN_CAUSE_NS)
        out[row] = np.where(slow, 1.0 - typical / np.maximum(phase, 1), 0.0)
    return out


def api_contention(
    steps: StepTimes, weights: StepWeights, core_gc: Intervals, api: Pauses, excess: FloatArray,
) -> FloatArray:  # fmt: skip
    """Per step, the shares of its forward that were the API process's CPU (row 0) and its GC
    (row 1; 0 for most): a step that is no stall (``excess`` 0) but ran past its expected
    forward while the API process was busy (its stretches of at least half a core, the pauses
    table's ``cpu`` rows) lost that excess to it, pro rata to the time the API process was busy
    in its forward. The API process and the core share the machine's cores: parsing a 7 MB body
    slows the steps beside it, and every request in them. Where the API process was collecting
    garbage in that time, that part is its GC's (a collection is CPU work, and is named as GC)."""
    out: FloatArray = np.zeros((2, len(steps.step_id)))
    if not len(steps.step_id) or not weights.fitted or not len(api.busy.starts):
        return out
    gc = gc_inside(steps, core_gc)[1]
    sampler = steps.sample_ns + steps.logprobs_ns + steps.spec_ns
    forward = np.maximum(steps.execute_end_ns - steps.execute_start_ns - sampler - gc, 1)
    expected = (weights.a + weights.b * steps.prefill_tokens + weights.c * steps.rows
                + weights.full_extra(full_rows(steps)))  # fmt: skip
    a, b = steps.execute_start_ns, steps.execute_end_ns - sampler
    inside = api.busy.before(b) - api.busy.before(a)
    collecting = np.minimum(api.gc.before(b) - api.gc.before(a), inside)
    over = (forward > expected) & (excess == 0) & (inside > 0)
    share = (1.0 - expected / forward) * np.minimum(inside / forward, 1.0)
    of_gc = collecting / np.maximum(inside, 1)
    out[0, over] = (share * (1.0 - of_gc))[over]
    out[1, over] = (share * of_gc)[over]
    return out
