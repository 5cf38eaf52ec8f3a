"""Each request's share of the steps it took part in: the run's step-cost fit and every formula
that splits a step's time between its rows (numpy over the facts ``tracing.diagnose_load``
reads).

The fit (fit_step_shape, on the run's busy steps after the first COLD_STEPS)::

    execute_ns = a + b * prefill tokens + c * rows

least squares, refitted without the steps more than 3 robust deviations from its median residual
(except steps with MIN_PRICED_PREFILL prefill tokens: they alone price a token); no coefficient
below 0; b never above c (a prefill token is the same matmul work as a row, batched); where no step
carried MIN_PRICED_PREFILL prefill tokens or b is within 3 standard errors of 0, b is the prior's
(as measured, not capped by c) or else 0, and a, c are fitted the same robust way to the rest.

The prior: the warm-up's own fit over a few timed shapes (engine.core.warmup, the runs row's
step_prior). Where the run cannot price a prefill token (no step carried MIN_PRICED_PREFILL,
or the price is within noise), b is the prior's and a, c are fitted to what it leaves; with
fewer than MIN_FIT_STEPS steps, the prior is the fit. The fit's ``source`` says which.

The fallback (step_weights, where the run recorded no prior): with fewer than MIN_FIT_STEPS
steps to fit (or a fit that is all 0), plain token shares (a = c = 0, b = d = 1); and if no
step carried MIN_PRICED_PREFILL prefill tokens, rows share alike (a = b = d = 0, c = 1).

A step's cost, and one row's share of it (d prices decode tokens; only the fallback sets it)::

    cost(step)  = max(a + b * prefill tokens + c * rows + d * decode tokens, 1e-9)
    per_row     = a / max(rows, 1) + c
    own         = net * min((b * its tokens + per_row) / cost, 1)          (TTFT phase only)
    own_row     = min(net * per_row / cost, own)    (of own: its row's share of the fixed cost;
                  a prefill in k chunks counts (k - 1) / k of it, and of the batch's other
                  rows in its steps, as the split's: chunk_wait)
    neighbours  = min(net * min((b * other prefill tokens
                                 + per_row * other prefill rows) / cost, 1), net - own)
    decode      = net - own - neighbours     (the batch's decode rows; its own decode)

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
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from tracing.pauses import Intervals

MIN_CAUSE_NS = 20_000_000  # the verdict's absolute bar (tracing.diagnosis describes the rule)
OUTLIER_FACTOR = 3.0  # a step this many times its shape's expected time is an outlier
COLD_STEPS = 3  # the first steps, judged against a fit of the others
MIN_FIT_STEPS = 8  # fewer steps than this: no fit (no cold or outlier verdict, token shares)
MIN_PRICED_PREFILL = 64  # prefill tokens some step must carry before a token gets its own price

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StepWeights:
    """The run's price of a step: fixed a, b per prefill token, c per row, d per decode token."""

    a: float
    b: float
    c: float
    d: float
    fitted: bool = False  # a, b, c are ns from the fit (else the fallback's unitless shares)


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
    decode: float
    schedule: float
    output: float
    gc: float
    grammar_mask: float
    sampling: float
    logprobs: float
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


class StepFit(NamedTuple):
    """[a, b, c] of execute = a + b * prefill tokens + c * rows, and where the prices come from:
    "run" (its own steps), "prior" (the warm-up's price of a prefill token: the run's prefills
    are too few or too short to price one) or "prior-all" (every price: too few steps)."""

    coef: FloatArray
    source: str


def fit_step_shape(
    prefill: npt.ArrayLike,
    rows: npt.ArrayLike,
    execute: npt.ArrayLike,
    prior: list[float] | None = None,
) -> StepFit | None:
    """The run's StepFit (the module docstring): with fewer than MIN_FIT_STEPS steps after the
    first COLD_STEPS, the prior (None without one).

    A step slowed by contention or a pause must not set the price of a token, hence the refit
    without outliers; but in a run of decodes the few long prefills are the only steps that
    price a prefill token, and the first fit (which the decodes dominate) misses exactly them:
    dropped, every long prefill would read as contention."""
    x = np.column_stack([np.ones(len(np.asarray(prefill))), prefill, rows]).astype(float)
    x = x[COLD_STEPS:]
    y = np.asarray(execute, dtype=float)[COLD_STEPS:]
    if len(y) < MIN_FIT_STEPS:
        return None if prior is None else StepFit(np.array(prior, dtype=float), "prior-all")

    def unpriced() -> StepFit:
        """The run cannot price a prefill token (no step can, or its price is within noise):
        the prior's price, or none."""
        price = float(prior[1]) if prior is not None else 0.0
        return StepFit(_robust_fit(x, y, price)[0], "prior" if price > 0 else "run")

    if x[:, 1].max() < MIN_PRICED_PREFILL:
        return unpriced()
    coef, kept = _robust_fit(x, y)
    if not _beyond_noise(x[kept], y[kept], coef, 1):
        return unpriced()
    a, b, c = coef
    return StepFit(np.array([a, min(b, c) if c > 0 else b, c]), "run")


def _robust_fit(
    x: FloatArray, y: FloatArray, price: float | None = None
) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
    """The fit, refitted without the steps it misses by more than 3 robust deviations (steps
    with MIN_PRICED_PREFILL prefill tokens are always kept), and the steps it kept; with
    ``price``, b is fixed to it and a, c are fitted to what the prefill leaves."""
    tokens = x[:, 1]
    if price is not None:
        y = y - price * tokens
        x = x.copy()
        x[:, 1] = 0.0
    coef = _nonnegative_fit(x, y)
    # Distance from the median residual: slow steps pull the first fit, so the others' residuals
    # sit off 0 together.
    deviation = np.abs((y - x @ coef) - np.median(y - x @ coef))
    spread = 1.4826 * float(np.median(deviation)) or 1.0
    kept: npt.NDArray[np.bool_] = (deviation <= 3 * spread) | (tokens >= MIN_PRICED_PREFILL)
    if kept.sum() >= MIN_FIT_STEPS:
        coef = _nonnegative_fit(x[kept], y[kept])
    else:
        kept = np.ones(len(y), dtype=bool)
    if price is not None:
        coef[1] = price
    return coef, kept


def _nonnegative_fit(x: FloatArray, y: FloatArray) -> FloatArray:
    """Least squares with no negative coefficient: a column whose coefficient comes out
    negative is dropped and the rest refitted (clipping alone would leave the others fitted
    against it: rows nearly constant across a run give a = 94 ms and c = -22 ms per row)."""
    x = x.copy()
    while True:
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        worst = int(np.argmin(coef))
        if coef[worst] >= 0 or not x[:, worst].any():
            return np.clip(coef, 0.0, None)
        x[:, worst] = 0.0


def _beyond_noise(x: FloatArray, y: FloatArray, coef: FloatArray, i: int) -> bool:
    """Whether coefficient i is at least 3 standard errors above 0, in the model the fit
    kept: a column _nonnegative_fit dropped (coefficient 0) does not count. Counted, a rows
    column that only varies on the long-prefill steps (4 rows everywhere else) would share
    their variance with the prefill price and call a 12 us/token price noise."""
    used = (coef > 0) | (np.arange(len(coef)) == i)
    x, coef, i = x[:, used], coef[used], int(np.count_nonzero(used[:i]))
    dof = len(y) - x.shape[1]
    if dof < 1 or not x[:, i].any():
        return False
    sigma2 = float(np.sum((y - x @ coef) ** 2)) / dof
    cov = sigma2 * np.linalg.pinv(x.T @ x)
    return bool(coef[i] > 3 * np.sqrt(max(cov[i, i], 0.0)))


def step_weights(
    prefill: IntArray, rows: IntArray, execute: IntArray, prior: list[float] | None = None
) -> StepWeights:
    """The run's StepWeights from its busy steps' shapes and forward times: the fit (with the
    warm-up's prior where the run cannot price a step), else the fallback (module docstring)."""
    fit = fit_step_shape(prefill, rows, execute, prior)
    coef = None if fit is None else fit.coef
    if coef is not None and coef.sum() > 0:
        return StepWeights(float(coef[0]), float(coef[1]), float(coef[2]), 0.0, fitted=True)
    if int(prefill.max(initial=0)) < MIN_PRICED_PREFILL:
        return StepWeights(0.0, 0.0, 1.0, 0.0)
    return StepWeights(0.0, 1.0, 0.0, 1.0)


def outlier(execute_ns: npt.ArrayLike, expected_ns: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Steps slow for their shape: OUTLIER_FACTOR times their expected execute time, and
    MIN_CAUSE_NS over it."""
    execute, expected = np.asarray(execute_ns, float), np.asarray(expected_ns, float)
    slow: npt.NDArray[np.bool_] = (execute >= OUTLIER_FACTOR * expected) & (
        execute - expected >= MIN_CAUSE_NS
    )
    return slow


class InFlight:
    """How long a request sent to the core waited for the step in flight: all of it, unless
    that step was itself an outlier for its shape; then up to what it was expected to take.
    The step in flight is the last to begin before the core took the request: one that began
    a moment after the send holds it too (the core had read its input just before).

    The core takes new requests between steps, so a request sent while a step runs waits for
    it: expected, in every step-based server, whatever the step's length (a long step is named
    for itself, as a prefill stall or by its shape). A step's expected execute time is the
    fit's a + b * prefill tokens + c * rows, or without a fit the median busy step's. An
    outlier step (``outlier``) is expected to end at its start plus its own schedule and output
    time plus that expected execute time; the wait beyond stays IPC, and the verdict names the
    step in flight."""

    def __init__(self, steps: StepTimes, weights: StepWeights) -> None:
        busy = (steps.prefill_tokens + steps.decode_tokens) > 0
        sampler = steps.sample_ns + steps.logprobs_ns  # named on their own, not an outlier
        executed = np.maximum(steps.execute_end_ns - steps.execute_start_ns - sampler, 0)
        if weights.fitted:
            expected = weights.a + weights.b * steps.prefill_tokens + weights.c * steps.rows
        else:
            typical = float(np.median(executed[busy])) if busy.any() else 0.0
            expected = np.full(len(executed), typical)
        self.start = steps.schedule_start_ns
        self.end = out_end(steps) if len(steps.step_id) else steps.output_ns
        cpu = (steps.execute_start_ns - steps.schedule_start_ns) + (self.end - steps.execute_end_ns)
        capped = self.start + np.maximum(cpu, 0) + sampler + expected.astype(np.int64)
        self.expected_end = np.where(busy & outlier(executed, expected), capped, self.end)

    def __call__(self, sent: int, received: int) -> int:
        """The wait inside [sent, received] for the last step that began before the core took
        the request (it began just after the send, too: the core had read its input already),
        up to that step's expected end."""
        i = int(np.searchsorted(self.start, received, side="left")) - 1
        if i < 0 or self.end[i] <= sent:
            return 0
        lo = max(sent, int(self.start[i]))
        return max(0, min(received, int(self.end[i]), int(self.expected_end[i])) - lo)


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


def _gc_inside(steps: StepTimes, gc: Intervals) -> list[IntArray]:
    """The core's GC pauses inside each step's schedule, execute and output intervals."""
    bounds = [steps.schedule_start_ns, steps.execute_start_ns, steps.execute_end_ns]
    bounds.append(steps.output_ns)
    return [np.maximum(gc.before(b) - gc.before(a), 0) for a, b in itertools.pairwise(bounds)]


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
) -> dict[tuple[str, str], StepShare]:
    """(request id, phase) -> its StepShare, by the formulas of the module docstring."""
    if not len(placed.step):
        return {}
    r, ttft = placed.request, placed.ttft
    lo = np.where(ttft, windows.start[r], windows.ttft_end[r])
    hi = np.where(ttft, windows.ttft_end[r], windows.end[r])
    per_member, total = member_shares(members.tokens, placed.step, ttft, lo, hi, steps, weights,
                                      core_gc)  # fmt: skip
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
) -> tuple[dict[str, FloatArray], IntArray]:
    """Per membership (its tokens, its step's index ``s``, whether its row is in its request's
    TTFT phase), its parts of the step inside its window [lo, hi] (the module docstring's
    formulas), and the clipped schedule, execute and output time they share out."""
    s0, s1 = steps.schedule_start_ns[s], steps.schedule_end_ns[s]
    e0, e1, o1 = steps.execute_start_ns[s], steps.execute_end_ns[s], out_end(steps)[s]

    def clipped(a: IntArray, b: IntArray) -> IntArray:
        inside: IntArray = np.maximum(0, np.minimum(b, hi) - np.maximum(a, lo))
        return inside

    sched, exe, outp = clipped(s0, e0), clipped(e0, e1), clipped(e1, o1)
    gram = np.where(steps.grammar_mask_ns[s] > 0, clipped(s1, e0), 0)
    sg, eg, og = (g[s] for g in _gc_inside(steps, core_gc))
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
    net = net_all - sampling - logprobs
    own = np.where(ttft, net * np.minimum((weights.b * tokens + per_row) / cost, 1), 0.0)
    own_row = np.where(ttft, np.minimum(net * per_row / cost, own), 0.0)
    # A row is a prefill row in its TTFT phase, or with more than one token (a recompute after
    # a preemption): the scheduler's own split of prefill and decode tokens.
    prefill_row = ttft | (tokens > 1)
    others = np.maximum(prefill - np.where(ttft, tokens, 0), 0)
    other_rows = np.maximum(rows - steps.decode_tokens[s] - prefill_row, 0)
    nb_cost = weights.b * others + per_row * other_rows
    nb = np.minimum(net * np.minimum(nb_cost / cost, 1), net - own)
    per_member = {
        "own_prefill": own,
        "own_row": own_row,
        "neighbour_prefill": nb,
        "decode": net - own - nb,
        "schedule": np.maximum(sched - gs - gram, 0),
        "output": outp - go,
        "gc": gs + ge + go,
        "grammar_mask": np.minimum(gram, sched - gs),
        "sampling": sampling,
        "logprobs": logprobs,
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
