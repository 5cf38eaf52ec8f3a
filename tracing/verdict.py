"""The verdict on a diagnosed run, in sentences an operator acts on.

The rule. Per phase (TTFT; decode per output token) and part: what every request pays is the
median over the phase's requests; what the tail pays extra is the mean over the requests at or
above the phase's TAIL_PERCENTILE (90) minus that median. A part is named

- as a cause when the tail's extra time is at least MIN_CAUSE_NS (20 ms) and at least
  MIN_CAUSE_SHARE (10%) of the median request's phase time;
- as paid by every request when its median passes the same two bars.

In the decode phase the values are per output token, and the absolute bar applies to what was
paid over whole decodes: what every request pays, times the median request's number of decode
tokens; what the tail pays extra, each tail request's extra times its own decode tokens (their
mean: PartStat.tail_paid_ns).
Parts in EXPECTED_PARTS (the model doing the request's own work) are reported as expected
compute, never as a cause. Delivery is judged per request (a slow reader is one client): named
when a request's delivery passes both bars against its own time.

Down to each gap: a token gap is explained part by part (``tracing.gaps``, whose parts sum to
it) when it is at least MIN_CAUSE_NS and GAP_FACTOR (4) times its request's median gap; its
largest part is named, or its remainder (``unattributed``) where that is the largest. A request's
life likewise: what no record explains of it is named when it passes both bars against its life
(a failed request's remainder is its failure, named apart). Failures come first: what ended each
request that did not finish (``tracing.failures``), counted in the headline. Steps, pauses and
cancellations have their own checks (``tracing.verdict_steps``); a step slow for its shape is
named only where it cost a request both bars against its life, else listed.

"Nothing stands out" is said only when no request failed (of the server's making), and no part,
no gap, no remainder and no step passes the rule; it comes with the run's expected compute.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from tracing import settings, verdict_requests, verdict_steps
from tracing.diagnosis import (
    DECODE_PARTS,
    MIN_CAUSE_NS,
    MIN_CAUSE_SHARE,
    TAIL_PERCENTILE,
    TTFT_PARTS,
    Finding,
    PartStat,
    RequestDiagnosis,
    RunDiagnosis,
    StepFacts,
)
from tracing.failures import SERVER_KINDS, count_words
from tracing.gaps import GAP_FACTOR
from tracing.judge import (
    API_PROCESS,
    JUDGED_APART,
    STALL_GAP_NS,
    call_group,
    call_part,
    dominant_part,
    passes,
    priced_neighbours,
    slow_delivery_ns,
    witnessed,
)
from tracing.pauses import Intervals
from tracing.words import QUEUE_LIMITS, WHAT, count, ms, step_name, tokens_of

__all__ = ["JUDGED_APART", "describe", "headline", "judge", "neighbour_names", "passes"]

PHASE_PARTS = {"ttft": TTFT_PARTS, "decode": DECODE_PARTS}
# The kinds of finding that name what made requests slow, or failed them.
NAMED = ("cause", "paid", "step", "failure", "gap")


def phase_requests(run: RunDiagnosis, phase: str) -> list[RequestDiagnosis]:
    if phase == "ttft":
        return [r for r in run.requests if r.ttft_ns is not None and r.ttft_phase_ns > 0]
    return [
        r
        for r in run.requests
        if r.status == "ok" and r.output_tokens >= 2 and r.decode_phase_ns > 0
    ]


def part_matrix(reqs: list[RequestDiagnosis], phase: str) -> np.ndarray:
    """Requests x parts, ns; the decode phase per output token."""
    keys = list(PHASE_PARTS[phase])
    if phase == "ttft":
        return np.array([[r.ttft.get(k, 0) for k in keys] for r in reqs], dtype=float)
    per = np.array([max(r.output_tokens - 1, 1) for r in reqs], dtype=float)[:, None]
    per_token: np.ndarray = (
        np.array([[r.decode.get(k, 0) for k in keys] for r in reqs], float) / per
    )
    return per_token


def part_stats(
    matrix: np.ndarray, keys: list[str], tokens: np.ndarray | None = None
) -> tuple[dict[str, PartStat], float, np.ndarray]:
    """Per part the median and the tail's extra (and what the tail paid over ``tokens``, each
    request's in the phase: 1 for TTFT); the median phase time; the tail's rows."""
    totals = matrix.sum(axis=1)
    tail = totals >= np.percentile(totals, TAIL_PERCENTILE)
    median = np.median(matrix, axis=0)
    extra = matrix[tail].mean(axis=0) - median
    n = np.ones(len(matrix)) if tokens is None else tokens
    paid = ((matrix[tail] - median) * n[tail][:, None]).mean(axis=0)
    stats = {k: PartStat(float(m), float(e), float(p))
             for k, m, e, p in zip(keys, median, extra, paid)}  # fmt: skip
    return stats, float(np.median(totals)), tail


def judge(run: RunDiagnosis) -> None:
    """Fill run.parts, run.phase_median_ns, run.findings and each request's dominant part."""
    findings: list[Finding] = []
    for phase in ("ttft", "decode"):
        reqs = phase_requests(run, phase)
        if not reqs:
            continue
        keys = list(PHASE_PARTS[phase])
        tokens = np.array([max(r.output_tokens - 1, 1) if phase == "decode" else 1 for r in reqs],
                          dtype=float)  # fmt: skip
        stats, median, tail = part_stats(part_matrix(reqs, phase), keys, tokens)
        run.parts[phase], run.phase_median_ns[phase] = stats, median
        scale = float(np.median([r.output_tokens - 1 for r in reqs])) if phase == "decode" else 1.0
        tail_reqs = [r for r, t in zip(reqs, tail) if t]
        found = _part_findings(run, phase, reqs, tail_reqs, scale)
        findings += found + _api_process(run, phase, reqs, tail_reqs, scale, found)
    findings.sort(key=lambda f: (f.kind != "cause", -f.ms))  # the largest cause first
    if not any(f.part == "unattributed" for f in findings):
        findings += verdict_requests.remainder_findings(run)
    findings = verdict_requests.failure_findings(run) + findings  # failures first
    findings += _slow_readers(run)
    findings += verdict_requests.gap_findings(run)
    findings += verdict_steps.step_findings(run, findings)
    findings += verdict_steps.cancellations(run)
    findings += lifecycle_findings(run)
    findings += _expected(run, findings)
    run.findings = findings
    for r in run.requests:
        r.dominant = dominant_part(r, run)


def _part_findings(
    run: RunDiagnosis,
    phase: str,
    reqs: list[RequestDiagnosis],
    tail: list[RequestDiagnosis],
    scale: float,
) -> list[Finding]:
    """A cause where the tail pays extra; else paid, where every request pays."""
    out = []
    stats, median = run.parts[phase], run.phase_median_ns[phase]
    for part, stat in stats.items():
        # A slow tail names a part only where a request of it paid it past what its client saw.
        reference = len(tail) < len(reqs) and witnessed(tail, {part: stat.median_ns}, median,
                                                        phase)  # fmt: skip
        called = call_part(
            part, stat.tail_extra_ns, stat.median_ns, median, median, scale,
            reference, priced_neighbours(reqs, phase), stat.tail_paid_ns,
        )  # fmt: skip
        if called is None:
            continue
        what, action = WHAT[part]
        paid = passes(stat.median_ns, median, scale)
        if called.beyond:
            detail, action = describe(run, phase, part, tail, action, stat.tail_paid_ns)
            text = _tail_text(phase, stat.tail_extra_ns, stat.tail_paid_ns, what + detail)
            if paid:
                every = _amount(phase, stat.median_ns, stat.median_ns * scale)
                text += f", on top of the {every} every request paid"
            out.append(
                Finding(
                    "cause",
                    f"{text}: {action}.",
                    ms=stat.tail_paid_ns / 1e6,
                    part=part,
                    request_ids=[r.request_id for r in tail],
                    phase=phase,
                )
            )
        else:
            detail, action = describe(run, phase, part, reqs, action, stat.median_ns * scale)
            text = _paid_text(phase, stat.median_ns, scale, median, what + detail)
            out.append(
                Finding(
                    "paid",
                    f"{text}: {action}.",
                    ms=stat.median_ns * scale / 1e6,
                    part=part,
                    section="paid",
                    phase=phase,
                )
            )
    return out


def _api_process(
    run: RunDiagnosis, phase: str, reqs: list[RequestDiagnosis], tail: list[RequestDiagnosis],
    scale: float, found: list[Finding],
) -> list[Finding]:  # fmt: skip
    """The API process's parts together, where each is under the bars (judge.call_group)."""
    stats = run.parts[phase]
    group = {k: stats[k].median_ns for k in API_PROCESS if k in stats}
    reference = len(tail) < len(reqs) and witnessed(tail, group, run.phase_median_ns[phase],
                                                    phase)  # fmt: skip
    got = call_group(stats, {f.part for f in found if f.part}, run.phase_median_ns[phase],
                     scale, reference)  # fmt: skip
    if got is None:
        return []
    call, order = got
    values = {k: (stats[k].tail_extra_ns, stats[k].tail_paid_ns) if call.beyond
              else (stats[k].median_ns, stats[k].median_ns * scale) for k in order}  # fmt: skip
    listed = ", ".join(f"{WHAT[k][0]} {_amount(phase, *v)}" for k, v in values.items()
                       if abs(v[1]) >= 50_000)  # fmt: skip
    paid = sum(v[1] for v in values.values())
    who = (f"The slowest {100 - TAIL_PERCENTILE}% of requests spent" if call.beyond
           else "Every request spent")  # fmt: skip
    more = "more than the median request " if call.beyond else ""
    text = (
        f"{who} {_amount(phase, call.ns, paid)} {more}in the API process, each part under "
        f"the bars and together over them ({listed}): its one event loop receives and decodes "
        f"the bodies, templates, tokenizes and emits: {WHAT[order[0]][1]}."
    )
    kind, section = ("cause", "causes") if call.beyond else ("paid", "paid")
    return [Finding(kind, text, ms=paid / 1e6, part=order[0], section=section,
                    label="the API process", phase=phase)]  # fmt: skip


def _amount(phase: str, v: float, paid: float) -> str:
    """``v`` a request (TTFT) or per output token, which came to ``paid`` over the decode."""
    return ms(v) if phase == "ttft" else f"{ms(v)} per token ({ms(paid)})"


def _paid_text(phase: str, v: float, scale: float, median: float, what: str) -> str:
    if phase == "ttft":
        return (
            f"Every request spent {ms(v)} ({v / median:.0%} of the median time to first "
            f"delivered token) in {what}"
        )
    return (
        f"Every request spent {ms(v)} per output token ({ms(v * scale)} over the median "
        f"request's {scale:.0f} decode tokens) in {what}"
    )


def _tail_text(phase: str, v: float, paid: float, what: str) -> str:
    if phase == "ttft":
        return (
            f"The slowest {100 - TAIL_PERCENTILE}% of requests by time to first token spent "
            f"{ms(v)} more than the median request in {what}"
        )
    return (
        f"The slowest {100 - TAIL_PERCENTILE}% of requests by time per output token spent "
        f"{ms(v)} per token more than the median ({ms(paid)} a request over its decode) "
        f"in {what}"
    )


def describe(
    run: RunDiagnosis, phase: str, part: str, reqs: list[RequestDiagnosis], action: str,
    amount_ns: float,
) -> tuple[str, str]:  # fmt: skip
    """What the words add for these requests: the limit, the neighbours, the step in flight
    (named when it explains at least half of ``amount_ns``)."""
    step = None
    if part in ("queue", "ipc", "between_steps"):
        step = verdict_steps.longest_step_during(run, reqs, phase)
        step = step if step is not None and step.execute_ns >= amount_ns / 2 else None
    if part == "queue":
        held = Counter(r.wait_reason for r in reqs if r.ttft.get("queue", 0) > 0)
        limit = held.most_common(1)[0][0] if held else None
        words, action = QUEUE_LIMITS.get(limit, QUEUE_LIMITS[None])
        return f", held by {words}" + (_busy(run, step) if step and not limit else ""), action
    if part == "admission":
        return ", held by the admission limit (--max-concurrent-requests)", action
    if part == "imbalance":
        pairs = Counter((r.engine, r.routed) for r in reqs if r.ttft.get("imbalance", 0) > 0)
        engine, routed = pairs.most_common(1)[0][0] if pairs else (None, None)
        where = f"engine {engine}, " if engine is not None else ""
        return f" ({where}{ROUTED_WORDS.get(routed, ROUTED_WORDS[None])})", action
    if part == "loop_lag":
        return _lag_work(run, action)
    if part in ("logprobs", "sampling"):
        said = verdict_steps.sampler_words(verdict_steps.busy_steps(run), part)
        paid = _settings_paid(run, reqs) if part == "sampling" else ""
        return (f" ({'; '.join(x for x in (paid, said) if x)})" if paid or said else ""), action
    if part == "neighbour_prefill":
        names = neighbour_names(reqs, phase)
        return (f", mostly {names}" if names else ""), action
    if step is not None:
        return _busy(run, step), action
    return "", action


# Why the balancing sent a request to its engine (requests.routed): engine.data_parallel's Routed.
ROUTED_WORDS = {
    "load": "where the balancing sent it: the lowest 4 x waiting + running",
    "prefix": "where prefix affinity sent it: its prompt's leading blocks were sent there, and "
    "its load was within --data-parallel-prefix-affinity of the least loaded engine's",
    "pinned": "where its X-data-parallel-rank header sent it",
    "handed": "where it was sent again after an engine failed it before output",
    None: "where the balancing sent it: the lowest 4 x waiting + running, or an "
    "X-data-parallel-rank header",
}


def _settings_paid(run: RunDiagnosis, reqs: list[RequestDiagnosis]) -> str:
    """'for rows with a grammar (json_schema) in 24 requests': the settings of the requests
    that shared these requests' steps where the sampler ran (their own included)."""
    sampled = {s.step_id for s in run.steps if s.sample_ns}
    steps = {i for r in reqs for i in r.step_ids if i in sampled}
    sharing = [r.settings for r in run.requests if steps.intersection(r.step_ids)]
    words = settings.named(sharing)
    return f"for rows with {words}" if words else ""


def lifecycle_findings(run: RunDiagnosis) -> list[Finding]:
    """One sentence per drain, engine restart and crash loop of the run (service/lifecycle.py)."""
    out = []
    for row in run.lifecycle:
        took = ms(row.end_ns - row.start_ns)
        if row.kind == "drain":
            text = (
                f"Drained on {row.cause}: {count(row.num_finished, 'request')} in flight "
                f"finished, {row.num_failed} aborted at the shutdown timeout ({took})."
            )
        elif row.kind == "restart":
            text = (
                f"The engine core failed ({row.cause}); {count(row.num_failed, 'request')} "
                f"failed with it, and a new core (epoch {row.epoch}) was ready {took} later."
            )
        else:
            text = f"Crash loop: the engine core failed again ({row.cause}); the server exited."
        out.append(Finding("info", text, section="lifecycle"))
    return out


def _lag_work(run: RunDiagnosis, action: str) -> tuple[str, str]:
    """What the API process was doing while its event loop lagged, where one kind of work
    overlapped at least half the lag: decoding and validating request bodies, or chat
    templates and tokenizing."""
    lags = Intervals([(s, s + d) for p, k, s, d in run.pauses if p == "api" and k == "loop_lag"])
    total = int(lags.cum[-1]) if len(lags.cum) else 0
    if not total:
        return "", action
    bodies = [r for r in run.requests if r.parse_span is not None and lags.within(*r.parse_span)]
    parse = sum(lags.within(a, b) for a, b in _merged([r.parse_span for r in bodies]))
    front = sum(lags.within(a, b) for a, b in _merged([r.frontend_span for r in run.requests]))
    if max(parse, front) < total / 2:
        return "", action
    if parse >= front:
        largest = max(r.body_bytes or 0 for r in bodies)
        n = count(len(bodies), "body", "bodies")
        return (
            f", while it decoded and validated request bodies ({n}, "
            f"up to {largest / 1e3:,.0f} KB; {ms(parse)} of the {ms(total)} of lag)",
            WHAT["parse"][1],
        )
    return (
        f", while it ran chat templates and the tokenizer ({ms(front)} of the {ms(total)} of lag)",
        WHAT["frontend"][1],
    )


def _merged(spans: Sequence[tuple[int, int] | None]) -> list[tuple[int, int]]:
    merged = Intervals([s for s in spans if s is not None])
    return list(zip(merged.starts.tolist(), merged.ends.tolist()))


def _busy(run: RunDiagnosis, step: StepFacts) -> str:
    carried = f" with {verdict_steps.prefill_of(run, step)}" if step.prefill_tokens else ""
    return (
        f", while the core was busy in {step_name(step.step_id)} for {ms(step.execute_ns)}{carried}"
    )


def neighbour_names(reqs: list[RequestDiagnosis], phase: str | None = None, limit: int = 3) -> str:
    """The requests whose prefill shared these requests' steps (in a phase), most tokens first."""
    tokens: Counter[str] = Counter()
    steps: dict[str, set[int]] = {}
    for r in reqs:
        for ph, found in r.neighbour_steps.items():
            if phase not in (None, ph):
                continue
            for other, (n, step_ids) in found.items():
                tokens[other] = max(tokens[other], n)
                steps.setdefault(other, set()).update(step_ids)

    def steps_of(rid: str) -> str:
        ids = sorted(steps[rid])
        more = f" and {len(ids) - 4} more" if len(ids) > 4 else ""
        return f"step{'s' if len(ids) > 1 else ''} " + ", ".join(map(str, ids[:4])) + more

    named = ", ".join(
        f"{rid} with {tokens_of(n)} prefill tokens in {steps_of(rid)}"
        for rid, n in tokens.most_common(limit)
    )
    return named + (f" (of {count(len(tokens), 'request')})" if len(tokens) > limit else "")


def _slow_readers(run: RunDiagnosis) -> list[Finding]:
    slow = [(d, r) for r in run.requests if (d := slow_delivery_ns(r)) is not None]
    if not slow:
        return []
    slow.sort(key=lambda x: -x[0])
    listed = "; ".join(
        f"{r.request_id} {ms(d)} (the server's writes waited {ms(r.send_wait_ns or 0)} on its "
        f"socket, {tokens_of(r.bytes_sent or 0)} bytes sent)"
        for d, r in slow[:5]
    )
    n = len(slow)
    text = (
        f"{count(n, 'request')} {'was' if n == 1 else 'were'} delivered late to a slow reader "
        f"after the engine had produced the output: {listed}. The client reads slowly (its "
        "network or a busy consumer); the engine is not the cause."
    )
    return [
        Finding(
            "cause",
            text,
            ms=slow[0][0] / 1e6,
            part="delivery",
            request_ids=[r.request_id for _, r in slow],
        )
    ]


def _expected(run: RunDiagnosis, findings: list[Finding]) -> list[Finding]:
    said = []
    if (prefill := run.parts.get("ttft", {}).get("own_prefill")) and prefill.median_ns > 0:
        said.append(f"a request's own prefill took {ms(prefill.median_ns)} at the median")
    if (decode := run.parts.get("decode", {}).get("decode")) and decode.median_ns > 0:
        said.append(f"decode took {ms(decode.median_ns)} per output token at the median")
    out = []
    failed = any(r.failure is not None and r.failure.kind in SERVER_KINDS for r in run.requests)
    if not failed and not any(f.kind in NAMED for f in findings):
        out.append(
            Finding(
                "info",
                "Nothing stands out: no request failed; no part of any request's time, no token "
                f"gap, no cost every request pays and no step passes {ms(MIN_CAUSE_NS)} and "
                f"{MIN_CAUSE_SHARE:.0%} of the phase (a gap: {GAP_FACTOR:g}x its request's "
                f"median, or {ms(STALL_GAP_NS)} whatever the phase), up to the client's kernel "
                "(a response that fits in the socket buffers, about 80 KiB and the client's "
                "receive buffer, is accepted whole whether or not the client reads it).",
            )
        )
    if said:
        out.append(Finding("expected", "Expected compute: " + "; ".join(said) + "."))
    return out


def headline(run: RunDiagnosis) -> str:
    """The percentiles the text quotes: the same numbers as the table."""
    s = run.summary
    said = []
    for key, label in (
        ("ttft_s", "TTFT"),
        ("delivered_ttft_s", "delivered TTFT"),
        ("tpot_s", "TPOT"),
        ("itl_s", "ITL"),
    ):
        if s.get(key):
            said.append(f"{label} p50 {ms(s[key]['p50'] * 1e9)}, p99 {ms(s[key]['p99'] * 1e9)}")
    failed = [r.failure for r in run.requests if r.failure is not None]
    first = count_words(failed, len(run.requests)) + " " if failed else ""
    if not said:
        return first + "No request got a token."
    n = run.stream_interval
    held = (f" The server sent tokens {n} at a time (--stream-interval {n}): ITL is the gap "
            "between writes.") if n > 1 and s.get("itl_s") else ""  # fmt: skip
    return first + "; ".join(said) + "." + held
