"""`lumen trace why ID`: one request's time in sentences, against its run (the same parts,
words and rule as the run's verdict: ``tracing.judge`` calls its parts)."""

from __future__ import annotations

import numpy as np

from tracing import verdict_steps
from tracing.diagnosis import MIN_CAUSE_NS, RequestDiagnosis, RunDiagnosis
from tracing.judge import request_calls, slow_delivery_ns
from tracing.verdict import describe, neighbour_names
from tracing.words import WHAT, count, ms, tokens_of


def explain(req: RequestDiagnosis, run: RunDiagnosis) -> list[str]:
    """Sentences on one request: its TTFT against the run's, who cost it time, its worst gaps."""
    out = [_opening(req, run)]
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


def _opening(req: RequestDiagnosis, run: RunDiagnosis) -> str:
    """Its TTFT against the run's percentiles (the numbers `replay report` prints)."""
    if req.ttft_ns is None:
        how = " (cancelled)" if req.status == "aborted" else ""
        return f"{req.request_id} ({req.status}) ended after {ms(req.e2e_ns)}{how}, before a token."

    def against(value: int, key: str) -> str:
        pct = run.summary.get(key)
        return (
            f"{ms(value)} (the run's p50 {ms(pct['p50'] * 1e9)}, p99 {ms(pct['p99'] * 1e9)})"
            if pct
            else ms(value)
        )

    said = f"{req.request_id} ({req.status}): TTFT {against(req.ttft_ns, 'ttft_s')}"
    if req.delivered_ttft_ns is not None:
        said += f", delivered TTFT {against(req.delivered_ttft_ns, 'delivered_ttft_s')}"
    return said + "."


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
    if phase == "ttft" and not beyond:
        out.insert(
            0,
            "Its time to first token was no worse than the run's median request's; what it "
            "paid, the median request paid too:"
            if shared
            else "Nothing stands out in its time to first token.",
        )
    return out


def _worst_gaps(req: RequestDiagnosis, run: RunDiagnosis, limit: int = 3) -> list[str]:
    """Its longest token gaps (at least twice the median gap and MIN_CAUSE_NS over it), each
    with the step that ended it."""
    if not req.gaps_ns:
        return []
    median = float(np.median(req.gaps_ns))
    worst = sorted(zip(req.gaps_ns, req.gap_step_ids), key=lambda g: -g[0])
    long = [(g, s) for g, s in worst if g >= 2 * median and g - median >= MIN_CAUSE_NS][:limit]
    if not long:
        return [f"Its token gaps were even: median {ms(median)}, the longest {ms(worst[0][0])}."]
    by_id = {s.step_id: s for s in run.steps}
    said = []
    for gap, step_id in long:
        s = by_id.get(step_id) if step_id is not None else None
        if s is None:
            said.append(ms(gap))
            continue
        carried = f", carrying {verdict_steps.prefill_of(run, s)}" if s.prefill_tokens else ""
        said.append(
            f"{ms(gap)} ending with step {s.step_id} (execute {ms(s.execute_ns)}, "
            f"{count(s.rows or s.running, 'request')}{carried})"
        )
    return [f"Its worst token gaps (median {ms(median)}): " + "; ".join(said) + "."]
