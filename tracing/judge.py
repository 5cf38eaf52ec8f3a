"""One judgement of a part, for a run and for one request, and the part that dominated a
request: what `replay report`, `lumen trace top` and `lumen trace why` all print.

The bars (``passes``): a time is named only when it is at least MIN_CAUSE_NS (times ``scale``,
the tokens it was paid over; or what was paid, where that is known: the tail's, over each of its
requests' own tokens) and at least MIN_CAUSE_SHARE of the phase time it is set against.
``call_part`` applies them the same way to a run (the tail's extra over the median request,
and the median itself, against the median request's phase) and to one request (its excess over
the run's median, against the run's median phase; and its own time, against its own phase).
Parts in EXPECTED_PARTS (the model doing the request's own work) are never called; delivery is
judged apart, per request.
Neighbours' prefill is called only where a neighbour carried a prefill a fit could price
(MIN_PRICED_PREFILL tokens, ``priced_neighbours``): a step slowed by contention that happened to
hold a few short prompts is an outlier step, and capping the chunk size would not help.

The dominant part of a request (``dominant_part``): of its parts called beyond the run's median
in either phase, and its delivery where that passes the bars against its own life, the one with
the most time beyond the reference; where none is called, the largest part of its time.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tracing.diagnosis import (
    EXPECTED_PARTS,
    MIN_CAUSE_NS,
    MIN_CAUSE_SHARE,
    Dominant,
    PartStat,
    RequestDiagnosis,
    RunDiagnosis,
)
from tracing.parts import BY_KEY
from tracing.step_fit import MIN_PRICED_PREFILL

JUDGED_APART = {"delivery"}  # per request: a slow reader is one client


def passes(
    value_ns: float, phase_median_ns: float, scale: float = 1.0, paid_ns: float | None = None
) -> bool:
    """The two bars: large in absolute terms (``paid_ns``, else the value over ``scale``
    tokens) and against the phase."""
    paid = value_ns * scale if paid_ns is None else paid_ns
    return paid >= MIN_CAUSE_NS and value_ns >= MIN_CAUSE_SHARE * phase_median_ns


@dataclass(frozen=True)
class Call:
    """A part named: ``beyond`` its reference (the tail over the median request, or a request
    over the run's median), or else large in itself (paid by every request, or shared with the
    run's median request). ``ns`` is the amount that passed."""

    part: str
    beyond: bool
    ns: float


def call_part(
    part: str,
    extra_ns: float,
    own_ns: float,
    extra_phase_ns: float,
    own_phase_ns: float,
    scale: float = 1.0,
    has_reference: bool = True,
    priced: bool = True,
    tail_paid_ns: float | None = None,
) -> Call | None:
    """The one rule: beyond the reference where the extra passes, else large where its own
    time passes, else nothing (``tail_paid_ns``: what the extra came to, where it is not the
    extra over ``scale`` tokens; and never an expected or per-request part, nor neighbours'
    prefill that no neighbour carried enough of to price: ``priced``)."""
    if part in EXPECTED_PARTS or part in JUDGED_APART:
        return None
    if part == "neighbour_prefill" and not priced:
        return None
    if has_reference and passes(extra_ns, extra_phase_ns, scale, tail_paid_ns):
        return Call(part, True, extra_ns)
    if passes(own_ns, own_phase_ns, scale):
        return Call(part, False, own_ns)
    return None


def request_calls(req: RequestDiagnosis, run: RunDiagnosis, phase: str) -> list[Call]:
    """One request's parts in a phase, each against the run's median request for it (the
    decode phase over as many tokens as it had)."""
    stats = run.parts.get(phase)
    mine = req.ttft if phase == "ttft" else req.decode
    if not stats or not mine:
        return []
    n = max(req.output_tokens - 1, 1) if phase == "decode" else 1
    total = seen_ns(req, phase, sum(mine.values()))
    reference = seen_ns(req, phase, run.phase_median_ns[phase] * n)
    calls = []
    for part, stat in stats.items():
        value = mine.get(part, 0)
        extra = value - stat.median_ns * n
        found = call_part(
            part, extra, value, reference, total, priced=priced_neighbours([req], phase),
        )  # fmt: skip
        if found is not None:
            calls.append(found)
    group = [k for k in API_PROCESS if k in stats]
    if group and not any(c.part in group for c in calls):
        value = sum(mine.get(k, 0) for k in group)
        extra = value - sum(stats[k].median_ns for k in group) * n
        largest = max(group, key=lambda k: mine.get(k, 0))
        found = call_part(largest, extra, value, reference, total)
        if found is not None:
            calls.append(found)
    return calls


def seen_ns(req: RequestDiagnosis, phase: str, phase_ns: float) -> float:
    """The phase time a part of ``req`` is judged against: ``phase_ns``, but for a request
    that was not streamed, whose client sees no first token, only the whole response: its
    TTFT parts against its life (a 26 ms parse in a 1.3 s response is 2% of what its client
    waited, however large against the time to its first token)."""
    if phase != "ttft" or req.stream:
        return phase_ns
    return max(phase_ns, req.ttft_phase_ns + req.decode_phase_ns)


def witnessed(reqs: Sequence[RequestDiagnosis], medians: dict[str, float], phase_ns: float,
              phase: str) -> bool:  # fmt: skip
    """Whether a request of ``reqs`` (a phase's slow tail) paid the parts of ``medians`` (each
    part's median) beyond them past the bars of what its client saw (``phase_ns``, the median
    phase time, as seen_ns judges it): a tail of responses that were not streamed, slow to
    their first token but not to their end, names nothing."""
    if phase != "ttft":
        return True
    return any(
        r.stream or passes(sum(r.ttft.get(k, 0) - m for k, m in medians.items()),
                           seen_ns(r, phase, phase_ns))
        for r in reqs
    )  # fmt: skip


# The API process's parts: its one event loop receives and decodes bodies, templates and
# tokenizes, and emits. A cost spread over them, each part under the bars and their sum over
# them, is that process's CPU: called as a whole, by its largest part (call_group).
API_PROCESS = ("http", "parse", "frontend", "loop_lag", "api_cpu", "emit")


def call_group(
    stats: dict[str, PartStat], called: set[str], phase_median_ns: float, scale: float,
    has_reference: bool,
) -> tuple[Call, list[str]] | None:  # fmt: skip
    """The API process's parts judged together, where none was called alone: the call (by
    the largest part) and the parts, largest first."""
    group = [k for k in API_PROCESS if k in stats]
    if not group or called.intersection(group):
        return None
    extra = sum(stats[k].tail_extra_ns for k in group)
    median = sum(stats[k].median_ns for k in group)
    paid = sum(stats[k].tail_paid_ns for k in group)
    found = call_part(group[0], extra, median, phase_median_ns, phase_median_ns, scale,
                      has_reference, tail_paid_ns=paid)  # fmt: skip
    if found is None:
        return None

    def amount(k: str) -> float:
        return stats[k].tail_extra_ns if found.beyond else stats[k].median_ns

    order = sorted(group, key=lambda k: -amount(k))
    return Call(order[0], found.beyond, found.ns), order


def priced_neighbours(reqs: list[RequestDiagnosis], phase: str) -> bool:
    """Whether a neighbour in these requests' steps of a phase carried a prefill a fit could
    price (MIN_PRICED_PREFILL tokens)."""
    return any(
        n >= MIN_PRICED_PREFILL for r in reqs for n, _ in r.neighbour_steps.get(phase, {}).values()
    )


# A token gap's part this long is a stall its reader sees, however long the stream: named
# whatever its share of the request's life (a 46 ms stop of the core in a 630 ms stream was 7%).
# 1.5 bars, the generator's "surely past the bar": in 204 healthy control runs of `lumen bench
# diagnose` (three models), a long gap's largest part (event-loop lag, GC) was at most 22 ms.
STALL_GAP_NS = int(1.5 * MIN_CAUSE_NS)


def gap_calls(req: RequestDiagnosis) -> dict[str, int]:
    """The parts that named a request's long token gaps (each gap's largest, where that is not
    expected compute), each with its time in the gaps it named, where that time passes the bars
    against the request's life, or is STALL_GAP_NS: one 20 ms lag in a 1 s stream is the
    machine's jitter, as the pauses' rule has it (verdict_steps), and is listed by `lumen trace
    why`, not named."""
    got: dict[str, int] = {}
    for gap in req.long_gaps:
        if gap.named is not None:
            got[gap.named] = got.get(gap.named, 0) + gap.parts[gap.named]
    life = req.ttft_phase_ns + req.decode_phase_ns
    return {k: v for k, v in got.items() if v >= STALL_GAP_NS or passes(v, life)}


# A slow reader fell behind the token rate by at least this many tokens' worth of time (its
# own time per output token), besides passing the two bars: a busy machine's write waits of a
# few ms per chunk are not a slow reader.
SLOW_READER_TOKENS = 4


def slow_delivery_ns(req: RequestDiagnosis) -> int | None:
    """Its delivery where it is a slow reader, else None: the time its bytes waited on the
    client's socket after the engine had produced them passes the bars against its own life,
    and is at least SLOW_READER_TOKENS times its time per output token."""
    delivery = req.ttft.get("delivery", 0) + req.decode.get("delivery", 0)
    per_token = 0.0
    if req.ttft_ns is not None and req.output_tokens >= 2:
        per_token = (req.e2e_ns - req.ttft_ns) / (req.output_tokens - 1)
    if delivery < SLOW_READER_TOKENS * per_token:
        return None
    return delivery if passes(delivery, req.ttft_phase_ns + req.decode_phase_ns) else None


def dominant_part(req: RequestDiagnosis, run: RunDiagnosis) -> Dominant:
    """The part that dominated the request (the module docstring's rule)."""
    judged = [
        (call.ns, phase, call.part)
        for phase in ("ttft", "decode")
        for call in request_calls(req, run, phase)
        if call.beyond
    ]
    if (delivery := slow_delivery_ns(req)) is not None:
        phase = "decode" if req.decode.get("delivery", 0) else "ttft"
        judged.append((float(delivery), phase, "delivery"))
    if judged:
        _, phase, part = max(judged, key=lambda j: j[0])
        mine = req.ttft if phase == "ttft" else req.decode
        ns = req.ttft.get(part, 0) + req.decode.get(part, 0) if part == "delivery" else mine[part]
        return Dominant(part, phase, ns, judged=True)
    largest = [(ns, phase, part) for phase, mine in (("ttft", req.ttft), ("decode", req.decode))
               for part, ns in mine.items()]  # fmt: skip
    ns, phase, part = max(largest, key=lambda j: j[0], default=(0, "ttft", "unattributed"))
    return Dominant(part, phase, ns, judged=False)


def dominant_words(req: RequestDiagnosis) -> str:
    """'queue in core.queue (85%)': the part, the span `trace show` draws it in, its share of
    the request's recorded life. What all three commands print."""
    d = req.dominant
    if d is None:
        return "-"
    life = max(req.ttft_phase_ns + req.decode_phase_ns, 1)
    span = BY_KEY[d.part].span
    where = f" in {span}" if span else ""
    return f"{d.part}{where} ({d.ns / life:.0%})"
