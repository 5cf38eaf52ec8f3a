"""Steps slow for their shape, against a fitted cost (a + b x prefill tokens + c x rows, and on
the full logits f x rows + g): one of the first steps past its reference and the later steps'
noise is a cold start; any other past OUTLIER_FACTOR x its expectation stalled, in the core
(contention, a stopped process, a kernel compiled for a new shape) or, where the API process
paused in it for half its excess, in that pause, which took its CPU."""

from __future__ import annotations

import numpy as np

from tracing.diagnosis import Finding, RunDiagnosis, StepFacts
from tracing.judge import passes
from tracing.pauses import Intervals
from tracing.step_fit import COLD_STEPS, OUTLIER_FACTOR, outlier
from tracing.words import WHAT, count, ms, step_name, tokens_of

COLD_NOISE = 3.0  # a cold first step exceeds its reference by this many robust deviations
PAUSE_WORDS = {"gc": "garbage collection", "loop_lag": "event-loop lag"}


def expected_ns(coef: np.ndarray, s: StepFacts) -> float:
    full = s.full_rows
    return float(coef @ np.array([1.0, s.prefill_tokens, s.rows or s.running, full, full > 0]))


def _slow_for_shape(s: StepFacts, coef: np.ndarray) -> bool:
    """OUTLIER_FACTOR x its expected time, the context its rows copy into the decode mirror
    (``join_tokens``) priced as prefill: the cost of their prompt's, not the core stalling."""
    return bool(outlier(s.forward_ns, expected_ns(coef, s) + coef[1] * s.join_tokens))


def _comparable(s: StepFacts, other: StepFacts) -> bool:
    """Steps of about the same shape: prefill tokens and rows each within a factor of 2."""

    def near(a: int, b: int) -> bool:
        return a == b or (a > 0 and b > 0 and max(a, b) <= 2 * min(a, b))

    return near(s.prefill_tokens, other.prefill_tokens) and near(
        s.rows or s.running, other.rows or other.running
    )


def _cold_reference(s: StepFacts, rest: list[StepFacts], coef: np.ndarray) -> tuple[float, float]:
    """What one of the first steps should have taken, and the noise around it.

    The reference is the fit's expectation; for a prefill step where the fit has no price per
    prefill token (its prompts were too short to price one), the larger of that and the median
    of the later steps of about its shape: such a fit expects a decode's time of a prefill. The
    noise is 1.4826 x the median absolute deviation of the residuals, against the reference, of
    the later steps of about its shape (of all later steps where fewer than 3 are)."""
    fitted = expected_ns(coef, s)
    alike = [o for o in rest if _comparable(s, o)]
    if len(alike) < 3:
        alike = rest
    times = np.array([o.forward_ns for o in alike], dtype=float)
    if not len(times):
        return fitted, 0.0
    expected = np.array([expected_ns(coef, o) for o in alike], dtype=float)
    want = fitted
    if s.prefill_tokens and coef[1] == 0 and alike is not rest:
        want = max(fitted, float(np.median(times)))
        expected = np.full(len(times), want)
    residual = times - expected
    return want, 1.4826 * float(np.median(np.abs(residual - np.median(residual))))


def _cold(s: StepFacts, rest: list[StepFacts], coef: np.ndarray) -> bool:
    """One of the first steps slow for its shape (``outlier``) beyond the noise: by more than
    COLD_NOISE robust deviations of the steps it is set against."""
    want, noise = _cold_reference(s, rest, coef)
    return bool(outlier(s.forward_ns, want)) and s.forward_ns - want > COLD_NOISE * noise


def step_finding(
    text: str, ms_: float, part: str | None = None, ids: list[str] | None = None
) -> Finding:
    return Finding("step", text, ms=ms_, part=part, request_ids=ids or [], section="steps")


def _api_pauses(run: RunDiagnosis, kind: str | None = None) -> Intervals:
    """When the API process paused (``kind``: gc or loop_lag; None: either): what it took of
    the CPU the core's steps shared with it."""
    return Intervals([(a, a + d) for p, k, a, d in run.pauses
                      if p == "api" and kind in (None, k)])  # fmt: skip


def cold_and_outliers(
    run: RunDiagnosis, busy: list[StepFacts], coef: np.ndarray | None, stalled: set[int]
) -> list[Finding]:
    if coef is None:
        return []
    out = []
    rest = busy[COLD_STEPS:]
    api = _api_pauses(run)
    # A first step the API process paused in (GC, event-loop lag) for at least half its excess
    # shared the CPU with it: contention is as likely as a cold start, so it is judged as any
    # later step.
    contended = [
        s
        for s in busy[:COLD_STEPS]
        if 2 * api.within(s.start_ns, s.end_ns) >= s.forward_ns - _cold_reference(s, rest, coef)[0]
    ]
    cold = [s for s in busy[:COLD_STEPS] if s not in contended and _cold(s, rest, coef)]
    if cold:
        first, want = cold[0], _cold_reference(cold[0], rest, coef)[0]
        shape = (
            f"{tokens_of(first.prefill_tokens)} prefill tokens, "
            f"{count(first.rows or first.running, 'request')}"
        )
        took = "; ".join(
            f"{step_name(s.step_id)}: {ms(s.forward_ns)} against "
            f"{ms(_cold_reference(s, rest, coef)[0])}"
            for s in cold
        )
        text = (
            f"Cold start: the first step took {ms(first.forward_ns)} against {ms(want)} "
            f"expected for its shape ({shape})"
            + (f" ({took})" if len(cold) > 1 else "")
            + ": send a warm-up request before taking traffic (the first step compiles and "
            "allocates; lumen serve warms up unless --no-warmup)."
        )
        out.append(step_finding(text, (first.forward_ns - want) / 1e6))
    late = [s for s in contended + rest if s.step_id not in stalled and _slow_for_shape(s, coef)]
    # A slow step the API process paused in for at least half its excess lost its CPU to that
    # pause (a GC pause is CPU work; two processes on two cores with a client beside them):
    # the pause is its cause, not the core.
    excess = {s.step_id: s.forward_ns - expected_ns(coef, s) for s in late}
    by_api = [s for s in late if 2 * api.within(s.start_ns, s.end_ns) >= excess[s.step_id]]
    # ... or was busy on CPU for half of it (tracing.stalls.api_taken).
    cpu = Intervals(run.api_busy)
    by_cpu = [s for s in late if s not in by_api
              and 2 * cpu.within(s.start_ns, s.end_ns) >= excess[s.step_id]]  # fmt: skip
    own = [s for s in late if s not in by_api and s not in by_cpu]
    if own:
        out.append(_slow_steps(run, own, excess, coef, None, 0))
    if by_cpu:
        on_cpu = sum(cpu.within(s.start_ns, s.end_ns) for s in by_cpu)
        out.append(_slow_steps(run, by_cpu, excess, coef, "api_cpu", on_cpu))
    if by_api:
        paused = sum(api.within(s.start_ns, s.end_ns) for s in by_api)
        kind = _api_pause_kind(run, by_api)
        out.append(_slow_steps(run, by_api, excess, coef, kind, paused))
    return out


def _slow_steps(
    run: RunDiagnosis, late: list[StepFacts], excess: dict[int, float], coef: np.ndarray,
    api_pause: str | None, paused: int,
) -> Finding:  # fmt: skip
    """Steps slow for their shape: the core stalled in them, or (``api_pause``) the API
    process's pause of that kind (or ``api_cpu``: its busy stretches), ``paused`` ns in them,
    took their CPU."""
    worst = max(late, key=lambda s: excess[s.step_id])
    want = expected_ns(coef, worst)
    mine = {s.step_id for s in late}
    paid = [(sum(excess[i] for i in r.step_ids if i in mine), r) for r in run.requests]
    met = sum(p > 0 for p, _ in paid)
    head = (
        f"{count(len(late), 'step')} took at least {OUTLIER_FACTOR:g}x the time expected "
        f"for their shape (worst: {step_name(worst.step_id)}, {ms(worst.forward_ns)} against "
        f"{ms(want)}; GC inside them aside), met by {count(met, 'request')}: "
    )
    if api_pause is None:
        text = head + (
            "the core stalled in them (CPU contention from other processes, a stopped "
            "process) or a kernel compiled for a new shape."
        )
    elif api_pause == "api_cpu":
        text = head + (
            f"the API process was busy on CPU in them ({ms(paused)}), taking the CPU the core "
            f"needed: {WHAT[api_pause][1]}."
        )
    else:
        text = head + (
            f"the API process paused in them for {PAUSE_WORDS[api_pause]} ({ms(paused)}), "
            "taking the CPU the core needed (few cores for the API process, the core and "
            f"their neighbours): {WHAT[api_pause][1]}."
        )
    finding = step_finding(text, (worst.forward_ns - want) / 1e6, api_pause or "core_stall")
    # Named only where it cost a request more than the rule's bars against its life;
    # otherwise listed, within the run's noise.
    if not any(passes(p, r.ttft_phase_ns + r.decode_phase_ns) for p, r in paid):
        finding.kind = "info"
    return finding


def _api_pause_kind(run: RunDiagnosis, steps: list[StepFacts]) -> str:
    """gc or loop_lag: the API process's pause that overlapped these steps. A GC pause is also
    a loop lag of its length (the loop waits it out): GC where it overlapped half as much."""
    overlap = {}
    for kind in PAUSE_WORDS:
        spans = _api_pauses(run, kind)
        overlap[kind] = sum(spans.within(s.start_ns, s.end_ns) for s in steps)
    return "gc" if 2 * overlap["gc"] >= overlap["loop_lag"] else "loop_lag"
