"""Each request's share of the steps it took part in: the run's step-cost fit and every formula
that splits a step's time between its rows (numpy over the facts ``tracing.diagnose_load``
reads).

The fit that prices a step (``tracing.step_fit``): a, b, c of execute = a + b * prefill tokens
+ c * rows, and the full-logits path's extra over the greedy head, f a row and g a step (its
docstring states it).

A step's cost, and one row's share of it (d prices decode tokens; only the fallback sets it;
full rows are the step's rows where it took the full logits, 0 where it took the greedy head)::

    cost(step)  = max(a + b * prefill tokens + c * rows + d * decode tokens, 1e-9)
    extra       = f * full rows + g * (full rows > 0)
    head        = net * min(extra / (cost + extra), 1)       (into sampling: every row of a
                  step on the full logits waits for the extra)
    per_row     = a / max(rows, 1) + c
    own         = net * min((b * its tokens + per_row) / cost, 1)          (TTFT phase only)
    own_row     = min(net * per_row / cost, own)    (of own: its row's share of the fixed cost;
                  a prefill in k chunks counts (k - 1) / k of it, and of the batch's other
                  rows in its steps, as the split's: chunk_wait)
    neighbours  = min(net * min((b * other prefill tokens
                                 + per_row * other prefill rows) / cost, 1), net - own)
    recompute   = neighbours * min(b * others' recompute tokens / neighbours' cost, 1)
                  (of neighbours: rows recomputing after a preemption, recompute_tokens;
                  neighbour_prefill is the rest)
    preempted   = min(net * min((b * its recompute tokens + per_row) / cost, 1),
                      net - own - neighbours)      (its own recompute: not its neighbours')
    decode      = net - own - neighbours - preempted  (the batch's decode rows; its own decode)

A step's prefill rows are its rows less its decode rows (one decode token each); the row itself
is a prefill row in its TTFT phase or with more than one token (a recompute). So the per-row
cost of other prefill rows is the neighbours' prefill, never decode: a step of prefills alone
files nothing under decode, under the fit and under either fallback.

where ``net`` is the forward: the execute time inside the row's output window, less the core
GC inside it, less the row's sampling and logprobs (the step's sample_ns and logprobs_ns, times
the row's share of the step's execute: they run at the end of execute, every row waits for
them). The fit prices the forward too: execute_ns less sample_ns and logprobs_ns.

The output window: a row is in its request's TTFT phase while the step's output instant is at
or before the request's first token (or it never got one), else in its decode phase; its
window is the phase's ``[lo, hi]`` (tracing.diagnose's Window). Each interval of the step --
schedule [schedule_start, execute_start], grammar masks [schedule_end, execute_start] (where the
step computed any), execute [execute_start, execute_end], output [execute_end, out_end] -- is
clipped to that window; ``out_end`` is the output instant, cut at the next step's start
(outputs still leaving the core overlap the next step). The core's GC pauses inside each full
interval are shared pro rata to the clipped part: ``gc = pause * clipped / max(full, 1)``.
Per row then: schedule = max(clipped schedule - its GC - masks, 0), grammar mask =
min(masks, clipped schedule - its GC), output = clipped output - its GC, gc = the three GC
shares, total = the three clipped intervals. Sums per (request, phase) are StepShare.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import numpy.typing as npt

from tracing.pauses import Intervals
from tracing.step_fit import (
    MIN_CAUSE_NS,
    FloatArray,
    IntArray,
    StepWeights,
)


@dataclass(frozen=True)
class StepTimes:
    """Every step of a run (idle records too), by step id: its instants and its shape."""

    step_id: IntArray
    schedule_start_ns: IntArray
    schedule_end_ns: IntArray
    execute_start_ns: IntArray
    execute_end_ns: IntArray
    output_ns: IntArray  # the instant its outputs were sent
    prefill_tokens: IntArray
    decode_tokens: IntArray
    rows: IntArray  # requests scheduled in it
    grammar_mask_ns: IntArray
    sample_ns: IntArray  # inside execute: the sampler, then logprobs; the rest is the forward
    logprobs_ns: IntArray
    # Inside execute too: speculative decoding's proposer and refused drafts (diagnose_load).
    spec_ns: IntArray
    # The context of its rows that decode for the first time since their prompt was computed
    # (tracing.stalls.join_tokens): on CPU, copied into the decode mirror in this step.
    join_tokens: IntArray
    # Of its prefill tokens, those of rows recomputing after a preemption (recompute_tokens:
    # known once rows are placed in their phases; empty until then).
    recompute_tokens: IntArray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))


@dataclass(frozen=True)
class Memberships:
    """Who took part in each step: one entry per (step, request row), tokens scheduled; by step,
    then in the order the step listed them."""

    step_id: IntArray
    request_id: list[str]
    tokens: IntArray


@dataclass(frozen=True)
class Windows:
    """Per request (in request order): its TTFT phase [start, ttft_end], its decode phase
    [ttft_end, end], its first token (-1: it got none), and the prompt tokens the core had to
    compute before it (its prompt less its prefix-cache hits; 0: not recorded)."""

    request_id: list[str]
    first_token: IntArray
    start: IntArray
    ttft_end: IntArray
    end: IntArray
    need: IntArray | None = None


@dataclass
class StepShare:
    """A request's share of its steps in one phase (ns; see the module docstring)."""

    own_prefill: float
    own_row: float  # of own_prefill: its row's share of each step's fixed cost
    neighbour_prefill: float
    recompute: float  # other requests' recompute after a preemption in its steps
    preempted: float  # its own recompute after a preemption
    decode: float
    schedule: float
    output: float
    gc: float
    grammar_mask: float
    sampling: float
    logprobs: float
    speculation: float  # speculative decoding's proposer and refused drafts in its steps
    core_stall: float  # its share of its steps' forward past their time (stall_excess)
    loop_lag: float  # ... where the API process's event loop lagged meanwhile (api_taken)
    api_cpu: float  # its share of its steps' forward past their time, the API process busy
    total: int  # the clipped schedule, execute and output intervals
    first_start: int  # the first of its steps began
    last_output: int  # the last of its steps' outputs left the core
    step_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class MemberPhases:
    """Per membership: its request's index in Windows, its step's index in StepTimes, and
    whether the row was in its request's TTFT phase."""

    request: IntArray
    step: IntArray
    ttft: npt.NDArray[np.bool_]


def place(members: Memberships, steps: StepTimes, windows: Windows) -> MemberPhases:
    """Each membership's request, step and phase (memberships of unknown requests are gone
    already: diagnose_load maps core ids to request rows)."""
    row_of = {rid: i for i, rid in enumerate(windows.request_id)}
    step_of = {int(s): i for i, s in enumerate(steps.step_id)}
    req = np.array([row_of[r] for r in members.request_id], dtype=np.int64)
    step = np.array([step_of[int(s)] for s in members.step_id], dtype=np.int64)
    ft = windows.first_token[req]
    ttft = (ft < 0) | (steps.output_ns[step] <= ft)
    if windows.need is not None and len(req):
        # A row is in its TTFT phase while it computes its prompt: up to the step whose tokens
        # complete it, which makes its first token, however late the frontend takes that
        # token (later steps are its decode, even before the token reached the frontend).
        order = np.lexsort((step, req))
        r, tokens = req[order], members.tokens[order]
        cum = np.cumsum(tokens)
        first = np.r_[0, np.flatnonzero(np.diff(r)) + 1]
        before = cum - tokens - np.repeat(cum[first] - tokens[first], np.diff(np.r_[first, len(r)]))
        need = windows.need[r]
        prefill = np.empty(len(req), dtype=bool)
        prefill[order] = before < need
        ttft = np.where(windows.need[req] > 0, prefill, ttft)
    return MemberPhases(req, step, ttft)


def recompute_tokens(tokens: IntArray, placed: MemberPhases, steps: StepTimes) -> IntArray:
    """Per step, the prefill tokens of rows recomputing after a preemption: a row past its
    request's TTFT phase with more than one token, up to the step's prefill tokens that no
    TTFT row took (a row verifying drafts has several tokens too, but they are decode tokens)."""
    n = len(steps.step_id)
    again = ~placed.ttft & (tokens > 1)
    fresh = np.bincount(placed.step[placed.ttft], weights=tokens[placed.ttft], minlength=n)
    rows = np.bincount(placed.step[again], weights=tokens[again], minlength=n)
    out: IntArray = np.clip(np.minimum(rows, steps.prefill_tokens - fresh), 0, None).astype(
        np.int64
    )
    return out


def gc_inside(steps: StepTimes, gc: Intervals) -> list[IntArray]:
    """The core's GC pauses inside each step's schedule, execute and output intervals."""
    bounds = [steps.schedule_start_ns, steps.execute_start_ns, steps.execute_end_ns]
    bounds.append(steps.output_ns)
    return [np.maximum(gc.before(b) - gc.before(a), 0) for a, b in itertools.pairwise(bounds)]


def stall_spans(
    steps: StepTimes, excess: FloatArray, phases: FloatArray | None = None
) -> list[tuple[int, int]]:
    """Each stalled step's forward past its expected time, and (``phases``, phase_stalls) its
    schedule and output phases past their median, as instants (each at its phase's end)."""
    forward = (steps.execute_end_ns - steps.execute_start_ns - steps.sample_ns
               - steps.logprobs_ns - steps.spec_ns)  # fmt: skip
    past = steps.execute_start_ns + (forward * (1.0 - excess)).astype(np.int64)
    ended = steps.execute_start_ns + forward
    spans = [(int(x), int(y)) for x, y, k in zip(past, ended, excess > 0) if k]
    if phases is not None:
        ends = (steps.execute_start_ns, out_end(steps))
        lengths = (steps.execute_start_ns - steps.schedule_start_ns, ends[1] - steps.execute_end_ns)
        for share, end, length in zip(phases, ends, lengths):
            stalled = (length * share).astype(np.int64)
            spans += [(int(e - n), int(e)) for e, n, k in zip(end, stalled, share > 0) if k]
    return sorted(spans)


def idle_spans(steps: StepTimes, ends: IntArray) -> list[tuple[int, int]]:
    """Stretches of MIN_CAUSE_NS or more between one busy step's output and the next's start:
    inside a request's life (it had a step to run) the core was not running."""
    busy = np.flatnonzero((steps.prefill_tokens + steps.decode_tokens) > 0)
    if len(busy) < 2:
        return []
    after, before = ends[busy[:-1]], steps.schedule_start_ns[busy[1:]]
    long = before - after >= MIN_CAUSE_NS
    return [(int(a), int(b)) for a, b in zip(after[long], before[long])]


def full_rows(steps: StepTimes) -> IntArray:
    """Each step's rows where it took the full logits (the sampler ran), else 0."""
    on_full: IntArray = np.where(steps.sample_ns > 0, steps.rows, 0)
    return on_full


def out_end(steps: StepTimes) -> IntArray:
    """A step's outputs end when they are sent, or when the next step begins if earlier."""
    nxt = np.append(steps.schedule_start_ns[1:], steps.output_ns[-1:])
    return np.minimum(steps.output_ns, nxt)


def step_shares(
    members: Memberships,
    placed: MemberPhases,
    steps: StepTimes,
    windows: Windows,
    weights: StepWeights,
    core_gc: Intervals,
    excess: FloatArray | None = None,
    phases: FloatArray | None = None,
    taken: FloatArray | None = None,
    contended: FloatArray | None = None,
) -> dict[tuple[str, str], StepShare]:
    """(request id, phase) -> its StepShare, by the formulas of the module docstring
    (``excess``: each step's stall_excess; ``phases``: its phase_stalls; ``taken``: its
    api_taken; ``contended``: its api_contention; tracing.stalls)."""
    if not len(placed.step):
        return {}
    r, ttft = placed.request, placed.ttft
    lo = np.where(ttft, windows.start[r], windows.ttft_end[r])
    hi = np.where(ttft, windows.ttft_end[r], windows.end[r])
    per_member, total = member_shares(members.tokens, placed.step, ttft, lo, hi, steps, weights,
                                      core_gc, excess, phases, taken, contended)  # fmt: skip
    s = placed.step
    return _by_request_phase(
        per_member, total, steps.schedule_start_ns[s], out_end(steps)[s], placed, steps, windows
    )


def member_shares(
    tokens: IntArray,
    s: IntArray,
    ttft: npt.NDArray[np.bool_],
    lo: IntArray,
    hi: IntArray,
    steps: StepTimes,
    weights: StepWeights,
    core_gc: Intervals,
    excess: FloatArray | None = None,
    phases: FloatArray | None = None,
    taken: FloatArray | None = None,
    contended: FloatArray | None = None,
) -> tuple[dict[str, FloatArray], IntArray]:
    """Per membership (its tokens, its step's index ``s``, whether its row is in its request's
    TTFT phase), its parts of the step inside its window [lo, hi] (the module docstring's
    formulas), and the clipped schedule, execute and output time they share out. ``excess``:
    each step's stall_excess, the share of its forward that is ``core_stall``; ``phases``:
    phase_stalls, the shares of its schedule and output phases that are; ``taken``:
    api_taken, the shares of that forward's excess that are the API process's ``gc``,
    ``loop_lag`` and ``api_cpu`` instead; ``contended``: api_contention, the shares of a step's
    forward that the API process's CPU (``api_cpu``) and its GC (``gc``) took."""
    s0, s1 = steps.schedule_start_ns[s], steps.schedule_end_ns[s]
    e0, e1, o1 = steps.execute_start_ns[s], steps.execute_end_ns[s], out_end(steps)[s]

    def clipped(a: IntArray, b: IntArray) -> IntArray:
        inside: IntArray = np.maximum(0, np.minimum(b, hi) - np.maximum(a, lo))
        return inside

    sched, exe, outp = clipped(s0, e0), clipped(e0, e1), clipped(e1, o1)
    gram = np.where(steps.grammar_mask_ns[s] > 0, clipped(s1, e0), 0)
    sg, eg, og = (g[s] for g in gc_inside(steps, core_gc))
    gs = sg * sched / np.maximum(e0 - s0, 1)
    ge = eg * exe / np.maximum(e1 - e0, 1)
    go = og * outp / np.maximum(o1 - e1, 1)
    prefill, rows = steps.prefill_tokens[s], steps.rows[s]
    cost = weights.a + weights.b * prefill + weights.c * rows + weights.d * steps.decode_tokens[s]
    cost = np.maximum(cost, 1e-9)
    per_row = weights.a / np.maximum(rows, 1) + weights.c
    # The sampler and logprobs run at the end of execute: each row's share of them is its
    # share of the step's execute; the forward is the rest.
    full = np.maximum(e1 - e0, 1)
    net_all = exe - ge
    sampling = net_all * np.minimum(steps.sample_ns[s] / full, 1.0)
    logprobs = np.minimum(
        net_all * np.minimum(steps.logprobs_ns[s] / full, 1.0), net_all - sampling
    )
    # Speculative decoding's proposer and refused drafts (diagnose_load's spec_ns): every row's.
    speculation = np.minimum(
        net_all * np.minimum(steps.spec_ns[s] / full, 1.0), net_all - sampling - logprobs
    )
    net = net_all - sampling - logprobs - speculation
    # A step on the full logits: what they cost its forward over the greedy head, every row's.
    extra = weights.full_extra(full_rows(steps)[s])
    head = net * np.minimum(extra / (cost + extra), 1.0)
    sampling, net = sampling + head, net - head
    # A step far past its expected forward time: that excess is the core stalling.
    stall = net * excess[s] if excess is not None else np.zeros(len(s))
    net = net - stall
    # A step past its time beside the API process's busy CPU: that excess is the API's.
    api_cpu, api_gc_cpu = (net * contended[:, s] if contended is not None
                           else np.zeros((2, len(s))))  # fmt: skip
    net = net - api_cpu - api_gc_cpu
    # ... and a stall's, where the API process paused or was busy in it (api_taken).
    api_gc, api_lag, api_busy = stall * (
        taken[:, s] if taken is not None else np.zeros((3, len(s)))
    )
    stall, api_cpu = stall - api_gc - api_lag - api_busy, api_cpu + api_busy
    sched_net, out_net = np.maximum(sched - gs - gram, 0), outp - go
    if phases is not None:
        sched_stall, out_stall = sched_net * phases[0][s], out_net * phases[1][s]
        sched_net, out_net = sched_net - sched_stall, out_net - out_stall
        stall = stall + sched_stall + out_stall
    own = np.where(ttft, net * np.minimum((weights.b * tokens + per_row) / cost, 1), 0.0)
    own_row = np.where(ttft, np.minimum(net * per_row / cost, own), 0.0)
    # A row is a prefill row in its TTFT phase, or with more than one token (a recompute after
    # a preemption): the scheduler's own split of prefill and decode tokens.
    prefill_row = ttft | (tokens > 1)
    # A row past its TTFT phase with several prefill tokens recomputes after a preemption: its
    # own time there is the preemption's (``preempted``), not its neighbours' prefill.
    own_again = np.where(~ttft & (tokens > 1), tokens, 0)
    if len(steps.recompute_tokens):
        own_again = np.minimum(own_again, steps.recompute_tokens[s])
    else:
        own_again = np.zeros_like(own_again)
    others = np.maximum(prefill - np.where(ttft, tokens, own_again), 0)
    other_rows = np.maximum(rows - steps.decode_tokens[s] - prefill_row, 0)
    nb_cost = weights.b * others + per_row * other_rows
    nb = np.minimum(net * np.minimum(nb_cost / cost, 1), net - own)
    # Of the neighbours' prefill, the recompute of rows a preemption sent back: KV blocks' cost.
    if len(steps.recompute_tokens):
        again = np.maximum(steps.recompute_tokens[s] - own_again, 0)
        recompute = nb * np.minimum(weights.b * again / np.maximum(nb_cost, 1e-9), 1.0)
    else:
        recompute = np.zeros(len(s))
    nb = nb - recompute
    redo = np.where(own_again > 0, weights.b * own_again + per_row, 0.0)
    preempted = np.minimum(net * np.minimum(redo / cost, 1), net - own - nb - recompute)
    per_member = {
        "own_prefill": own,
        "own_row": own_row,
        "neighbour_prefill": nb,
        "recompute": recompute,
        "preempted": preempted,
        "decode": net - own - nb - recompute - preempted,
        "schedule": sched_net,
        "output": out_net,
        "gc": gs + ge + go + api_gc + api_gc_cpu,
        "grammar_mask": np.minimum(gram, sched - gs),
        "sampling": sampling,
        "logprobs": logprobs,
        "speculation": speculation,
        "core_stall": stall,
        "loop_lag": api_lag,
        "api_cpu": api_cpu,
    }
    total: IntArray = sched + exe + outp
    return per_member, total


def _by_request_phase(
    per_member: dict[str, FloatArray],
    total: IntArray,
    starts: IntArray,
    ends: IntArray,
    placed: MemberPhases,
    steps: StepTimes,
    windows: Windows,
) -> dict[tuple[str, str], StepShare]:
    group = placed.request * 2 + (~placed.ttft).astype(np.int64)
    keys, inverse = np.unique(group, return_inverse=True)
    n = len(keys)
    sums = {k: np.bincount(inverse, weights=v, minlength=n) for k, v in per_member.items()}
    totals = np.zeros(n, dtype=np.int64)
    np.add.at(totals, inverse, total)
    first = np.full(n, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first, inverse, starts)
    last = np.full(n, np.iinfo(np.int64).min, dtype=np.int64)
    np.maximum.at(last, inverse, ends)
    order = np.argsort(inverse, kind="stable")
    split = np.split(steps.step_id[placed.step][order], np.cumsum(np.bincount(inverse))[:-1])
    out = {}
    for i, key in enumerate(keys):
        rid = windows.request_id[int(key) // 2]
        phase = "decode" if key % 2 else "ttft"
        out[(rid, phase)] = StepShare(
            **{k: float(v[i]) for k, v in sums.items()},
            total=int(totals[i]),
            first_start=int(first[i]),
            last_output=int(last[i]),
            step_ids=sorted({int(x) for x in split[i]}),
        )
    return out
