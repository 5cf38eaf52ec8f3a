"""A request's long token gaps, each cut into parts that sum to it (the conservation the phases
keep, down to one gap between two writes its client saw).

A gap runs from one write's end (its bytes accepted by the client's socket) to the next's. It is
long when it is at least MIN_CAUSE_NS and GAP_FACTOR times the request's median gap; only long
gaps are cut (a run holds many thousands of gaps). The cut::

    c           the write's first token left the core: the output of the step that made it
                (with --stream-interval N > 1, of the step that completed its N tokens)
    [a, c]      the core: the request's own steps inside it, shared out as the phases share
                them (tracing.shares.member_shares: its decode, other requests' prefill, the
                scheduler, masks, sampler, logprobs, output, GC); the part of a step past
                OUTLIER_FACTOR x its expected forward time (stalls.stall_excess), and time no
                step ran while it waited, is ``core_stall`` (the core stopped, starved of CPU,
                or stuck in a long call); other steps running without it are ``between_steps``
                (it sat out), of which the time after a preemption is ``preempted``; core GC between
                steps is ``gc``
    [c, b]      the frontend: the API process's pauses (``gc``, ``loop_lag``), then the
                core's GC before the frontend received the token (``gc``: it holds the core's
                output thread), then the core stalling meanwhile (``core_stall``: a step
                far past its time, as above, while the token waited to leave the core; the
                core's output thread stops with it, SIGSTOP or a call holding the GIL), then
                the writes' waits on the client's socket (``delivery``, up to what the
                request's send_wait_ns has left), the rest ``emit`` (IPC back, detokenize,
                write)

and ``unattributed`` is what is left (no step record covers it). The gap's named part is its
largest; a verdict names it when it is not expected compute.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from tracing.parts import EXPECTED_PARTS, phase_labels
from tracing.pauses import Intervals, Pauses, minus
from tracing.shares import (
    MemberPhases,
    Memberships,
    StepTimes,
    member_shares,
    out_end,
    stall_spans,
)
from tracing.stalls import api_contention, api_taken, phase_stalls, stall_excess
from tracing.step_fit import MIN_CAUSE_NS, IntArray, StepWeights

GAP_FACTOR = 4.0  # a gap is long at this many times its request's median gap (and MIN_CAUSE_NS)
MAX_GAPS = 20  # long gaps cut per request, longest first
DECODE_PARTS = phase_labels("decode")  # a gap's parts are the decode phase's
_STEP_PARTS = ("decode", "neighbour_prefill", "recompute", "preempted", "core_stall", "schedule",
               "output", "gc", "grammar_mask", "sampling", "logprobs", "speculation", "loop_lag",
               "api_cpu")  # fmt: skip


@dataclass
class Gap:
    """One long gap of a request, cut into parts (ns, DECODE_PARTS keys) summing to it."""

    start_ns: int
    end_ns: int
    step_id: int | None  # the step that made the write's first token
    parts: dict[str, int] = field(default_factory=dict)

    @property
    def ns(self) -> int:
        return self.end_ns - self.start_ns

    @property
    def largest(self) -> tuple[str, int]:
        return max(self.parts.items(), key=lambda kv: kv[1], default=("unattributed", 0))

    @property
    def named(self) -> str | None:
        """Its largest part, where that is not expected compute."""
        part, _ = self.largest
        return None if part in EXPECTED_PARTS else part


@dataclass(frozen=True)
class Write:
    """One write a client saw: when its bytes were accepted, and the steps of its first and
    last token (None: not recorded) with when the frontend received each."""

    end_ns: int
    first_step: int | None
    last_step: int | None
    first_received_ns: int | None
    last_received_ns: int | None


class GapCutter:
    """What cutting a run's gaps reads: its steps, who took part in each, the fit's expected
    forward time of each step, the pauses, the preemptions, --stream-interval."""

    def __init__(
        self,
        steps: StepTimes,
        members: Memberships,
        placed: MemberPhases,
        weights: StepWeights,
        pauses: tuple[Pauses, Pauses],
        preemptions: dict[str, list[tuple[int, int]]],
        stream_interval: int,
    ) -> None:
        self.steps, self.members, self.placed, self.weights = steps, members, placed, weights
        self.api, self.core = pauses
        self.preemptions, self.interval = preemptions, stream_interval
        self.ends = out_end(steps) if len(steps.step_id) else steps.output_ns
        self.index = {int(s): i for i, s in enumerate(steps.step_id)}
        busy = (steps.prefill_tokens + steps.decode_tokens) > 0
        self.busy = Intervals([(int(a), int(b)) for a, b, k in
                               zip(steps.schedule_start_ns, self.ends, busy) if k])  # fmt: skip
        # The forward's share past its expected time, where a step is an outlier for its shape
        # (stalls.stall_excess); as instants, the core stalled (all its threads), but where the
        # API process paused meanwhile: that is its pause (carved first).
        self.excess = stall_excess(steps, weights, self.core.gc)
        # ... and its schedule or output phase far past the run's median (stalls.phase_stalls).
        self.phases = phase_stalls(steps, self.core.gc)
        self.taken = api_taken(steps, self.excess, self.api)
        self.contended = api_contention(steps, weights, self.core.gc, self.api, self.excess)
        # (A step whose excess the API process's busy CPU took is no stall of the core.)
        stalls = stall_spans(steps, np.where(self.taken[2] > 0, 0.0, self.excess), self.phases)
        self.stalls = Intervals(minus(stalls, sorted(self.api.gc.spans() + self.api.lag.spans())))
        order = np.argsort(placed.request, kind="stable")
        counts = np.bincount(placed.request) if len(placed.request) else np.zeros(0, np.int64)
        self.rows_of = np.split(order, np.cumsum(counts)[:-1]) if len(counts) else []

    def cut(self, index: int, request_id: str, writes: Sequence[Write], send_wait_ns: int
            ) -> list[Gap]:  # fmt: skip
        """The request's long gaps (its ``index`` in the run's requests), longest first."""
        if len(writes) < 3:
            return []
        ends = np.array([w.end_ns for w in writes], dtype=np.int64)
        gaps = np.diff(ends)
        median = float(np.median(gaps))
        long = np.flatnonzero((gaps >= MIN_CAUSE_NS) & (gaps >= GAP_FACTOR * median))
        long = long[np.argsort(-gaps[long], kind="stable")][:MAX_GAPS]
        rows = self.rows_of[index] if index < len(self.rows_of) else np.zeros(0, np.int64)
        budget = send_wait_ns
        out = []
        for k in long.tolist():
            gap = self._one(request_id, int(ends[k]), writes[k + 1], rows, budget)
            budget -= gap.parts["delivery"]
            out.append(gap)
        return out

    def _one(self, rid: str, a: int, write: Write, rows: IntArray, budget: int) -> Gap:
        b = write.end_ns
        step = write.first_step if self.interval == 1 else write.last_step
        received = write.first_received_ns if self.interval == 1 else write.last_received_ns
        if step is not None and step in self.index:
            c = int(self.ends[self.index[step]])
        else:
            c = received if received is not None else a
        c = min(max(c, a), b)
        parts = dict.fromkeys(DECODE_PARTS, 0)
        mine = self._core(rows, a, c, parts)
        covered = self.busy.within(a, c)
        sat_out = max(covered - mine, 0)
        held = sum(max(0, min(y, c) - max(x, a)) for x, y in self.preemptions.get(rid, []))
        parts["preempted"] += min(sat_out, held)
        parts["between_steps"] = sat_out - min(sat_out, held)
        idle = max((c - a) - max(covered, mine), 0)
        gc_between = min(idle, max(self.core.within(a, c) - parts["gc"], 0))
        parts["gc"] += gc_between
        parts["core_stall"] += idle - gc_between
        front = self.api.carve(parts, c, b)
        if received is not None and received > c:  # the token had not left the core
            # The core's GC holds its output thread too (the GIL), and so does a stall.
            held = min(self.core.gc.within(c, min(received, b)), front)
            parts["gc"] += held
            front -= held
            stalled = min(self.stalls.within(c, min(received, b)), front)
            parts["core_stall"] += stalled
            front -= stalled
        parts["delivery"] = min(front, max(budget, 0))
        parts["emit"] = front - parts["delivery"]
        parts["unattributed"] = (b - a) - sum(v for k, v in parts.items() if k != "unattributed")
        return Gap(a, b, step, parts)

    def _core(self, rows: IntArray, a: int, c: int, parts: dict[str, int]) -> int:
        """Its own steps' parts inside [a, c], into ``parts``; their clipped time in all."""
        if not len(rows) or c <= a:
            return 0
        s = self.placed.step[rows]
        inside = (self.steps.schedule_start_ns[s] < c) & (self.ends[s] > a)
        rows, s = rows[inside], s[inside]
        if not len(rows):
            return 0
        n = len(rows)
        lo, hi = np.full(n, a, dtype=np.int64), np.full(n, c, dtype=np.int64)
        shares, total = member_shares(self.members.tokens[rows], s, np.zeros(n, dtype=bool), lo, hi,
                                      self.steps, self.weights, self.core.gc,
                                      self.excess, self.phases, self.taken,
                                      self.contended)  # fmt: skip
        for key in _STEP_PARTS:
            parts[key] += round(float(shares[key].sum()))
        return int(total.sum())
