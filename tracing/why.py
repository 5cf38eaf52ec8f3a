"""`lumen trace why ID`: one request's time in sentences, against its run (the same parts,
words and rule as the run's verdict: ``tracing.judge`` calls its parts)."""

from __future__ import annotations

import numpy as np

from tracing import verdict_steps
from tracing.diagnosis import RequestDiagnosis, RunDiagnosis
from tracing.gaps import Gap
from tracing.judge import request_calls, slow_delivery_ns
from tracing.verdict import describe, neighbour_names
from tracing.words import WHAT, count, ms, step_name, tokens_of

GAP_PART_NS = 1_000_000  # a gap's parts listed from this size


def explain(req: RequestDiagnosis, run: RunDiagnosis) -> list[str]:
    """Sentences on one request: its TTFT against the run's, who cost it time, its worst gaps."""
    out = [_opening(req, run)]
    if req.resent_ns:
        out.append(
            "It had sent no output when its engine core failed: it was sent again to the new "
            f"core, and lost {ms(req.ttft.get('engine_restart', 0))} to the failure (its time on "
            "the failed core and the wait for the new one)."
        )
    out += _beyond_median(req, run, "ttft")
    if req.ttft.get("own_prefill"):
        out.append(
            f"Its own prefill ({count(req.prompt_tokens, 'prompt token')}) took "
            f"{ms(req.ttft['own_prefill'])} of compute: expected."
        )
    if req.neighbours:
        out.append(f"Other requests' prefill shared its steps: {neighbour_names([req], None, 5)}.")
    out += _worst_gaps(req, run)
    out += _beyond_median(req, run, "decode")
    out += _delivery(req)
    if req.status != "ok" and req.kv_freed_ns:
        freed = req.kv_freed_ns - (req.arrival_ns + req.e2e_ns)
        out.append(f"Its KV blocks were freed {ms(max(freed, 0))} after it ended.")
    return out


def _delivery(req: RequestDiagnosis) -> list[str]:
    waited = (
        f"the server's writes waited {ms(req.send_wait_ns or 0)} on its socket, "
        f"{tokens_of(req.bytes_sent or 0)} bytes sent"
    )
    if (delivery := slow_delivery_ns(req)) is not None:
        return [
            f"It was delivered late: {ms(delivery)} after the engine had produced its output "
            f"({waited}): the client read slowly (a slow reader)."
        ]
    return []


# Why the balancing sent a request to its engine (requests.routed), as its opening says it.
ROUTED_SHORT = {"load": "by load", "prefix": "by prefix affinity",
                "pinned": "pinned by X-data-parallel-rank",
                "handed": "sent again after an engine failed it"}  # fmt: skip


def _opening(req: RequestDiagnosis, run: RunDiagnosis) -> str:
    """Its replica, what ended it where it did not finish, and its TTFT against the run's
    percentiles (the numbers `replay report` prints)."""
    places = [f"replica {run.replica}"] if run.replica else []
    if req.engine is not None and len({r.engine for r in run.requests} - {None}) > 1:
        # One of several data-parallel engines, and the rule that sent it there.
        how = ROUTED_SHORT.get(req.routed or "")
        places.append(f"engine {req.engine}" + (f", {how}" if how else ""))
    where = f" on {', '.join(places)}" if places else ""
    if req.lora_name is not None:
        where += f" with LoRA adapter {req.lora_name}"
    failed = ""
    if req.failure is not None:
        sent = (
            f"after {count(req.output_tokens, 'token')}" if req.output_tokens else "before a token"
        )
        failed = f" It {req.failure.words}, {ms(req.e2e_ns)} after it arrived, {sent}."
    if req.ttft_ns is None:
        return f"{req.request_id}{where} ({req.status}) ended after {ms(req.e2e_ns)}." + failed

    def against(value: int, key: str) -> str:
        pct = run.summary.get(key)
        return (
            f"{ms(value)} (the run's p50 {ms(pct['p50'] * 1e9)}, p99 {ms(pct['p99'] * 1e9)})"
            if pct
            else ms(value)
        )

    said = f"{req.request_id}{where} ({req.status}): TTFT {against(req.ttft_ns, 'ttft_s')}"
    if req.delivered_ttft_ns is not None:
        said += f", delivered TTFT {against(req.delivered_ttft_ns, 'delivered_ttft_s')}"
    return said + "." + failed


def _beyond_median(req: RequestDiagnosis, run: RunDiagnosis, phase: str) -> list[str]:
    """Its parts called beyond the run's median for the same part; then large parts it shares
    with the median request (tracing.judge.request_calls)."""
    stats = run.parts.get(phase)
    mine = req.ttft if phase == "ttft" else req.decode
    if not stats or not mine:
        return []
    n = max(req.output_tokens - 1, 1) if phase == "decode" else 1
    when = "Before its first token" if phase == "ttft" else f"Over its {n} decode tokens"
    beyond, shared = [], []
    for call in request_calls(req, run, phase):
        part = call.part
        value, median = mine.get(part, 0), stats[part].median_ns * n
        what, action = WHAT[part]
        detail, action = describe(run, phase, part, [req], action, call.ns)
        if call.beyond:
            said = f"({ms(value - median)} more than the run's median request){detail}"
            beyond.append((value - median, f"{when} it spent {ms(value)} in {what} {said}", action))
        else:
            said = f"{detail} (the run's median request: {ms(median)})"
            shared.append((value, f"{when} it spent {ms(value)} in {what}{said}", action))
    out = [f"{text}: {action}." if action else f"{text}." for _, text, action in
           sorted(beyond, reverse=True)[:3] + sorted(shared, reverse=True)[:2]]  # fmt: skip
    if phase == "ttft" and not beyond and req.failure is None:
        out.insert(
            0,
            "Its time to first token was no worse than the run's median request's; what it "
            "paid, the median request paid too:"
            if shared
            else "Nothing stands out in its time to first token.",
        )
    return out


def _worst_gaps(req: RequestDiagnosis, run: RunDiagnosis, limit: int = 3) -> list[str]:
    """Its longest token gaps (tracing.gaps: over GAP_FACTOR x its median gap and
    MIN_CAUSE_NS), each with the parts it is made of, largest first."""
    if not req.gaps_ns:
        return []
    median = float(np.median(req.gaps_ns))
    if not req.long_gaps:
        worst = max(req.gaps_ns)
        return [f"Its token gaps were even: median {ms(median)}, the longest {ms(worst)}."]
    said = [_gap_words(gap, run) for gap in req.long_gaps[:limit]]
    more = len(req.long_gaps) - limit
    tail = f" ({count(more, 'more long gap')})" if more > 0 else ""
    return [f"Its longest token gaps (median {ms(median)}): " + "; ".join(said) + tail + "."]


def _gap_words(gap: Gap, run: RunDiagnosis) -> str:
    """'2,845.0 ms: delivery to the client 2,840.1 ms, emit 3.2 ms (its write's first token
    from step 1234, execute 1.1 ms)'."""
    parts = sorted(((v, k) for k, v in gap.parts.items() if v >= GAP_PART_NS), reverse=True)
    listed = ", ".join(f"{WHAT[k][0]} {ms(v)}" for v, k in parts[:3]) or "no part over 1 ms"
    step = next((s for s in run.steps if s.step_id == gap.step_id), None)
    if step is None:
        return f"{ms(gap.ns)}: {listed}"
    carried = f", carrying {verdict_steps.prefill_of(run, step)}" if step.prefill_tokens else ""
    rows = count(step.rows or step.running, "request")
    return (f"{ms(gap.ns)}: {listed} (its first token from {step_name(step.step_id)}, execute "
            f"{ms(step.execute_ns)}, {rows}{carried})")  # fmt: skip
