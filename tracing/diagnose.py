"""Why a request, or a run, was slow: each request's time broken into causes, judged against what
the time should be, and put into words (`replay report`, `lumen trace why`).

A request's life has two phases, each cut into parts that sum to it (interval arithmetic over
the store's instants; what no record covers is kept in ``unattributed``, never spread):

    TTFT    first byte read -> first chunk delivered (non-streamed: -> first token at the
            frontend, the final write belongs to the decode phase)
    decode  the end of the TTFT phase -> the response's last byte accepted

Steps a request took part in are split by the run's own step-cost model (diagnose_load.
fit_step_shape): its own prefill and row, other requests' prefill (its "neighbours", named),
and the batch's other rows. Pauses (GC, event-loop lag) are carved out
of the parts of their process that they overlap. Columns an older trace lacks, or a request
never reached, count as 0 or fall back to the spans. The run verdict and the words live in
``tracing.verdict``; its rule is described there (MIN_CAUSE_NS, MIN_CAUSE_SHARE in
``tracing.diagnosis``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from tracing import diagnose_load as load
from tracing import render, verdict, why
from tracing.diagnosis import (
    DECODE_PARTS,
    EXPECTED_PARTS,
    MIN_CAUSE_NS,
    MIN_CAUSE_SHARE,
    TAIL_PERCENTILE,
    TTFT_PARTS,
    Finding,
    PartStat,
    RequestDiagnosis,
    RunDiagnosis,
    StepFacts,
    percentiles,
    summarize,
)
from tracing.store import latest_run, open_db

__all__ = [
    "DECODE_PARTS", "EXPECTED_PARTS", "MIN_CAUSE_NS", "MIN_CAUSE_SHARE", "TAIL_PERCENTILE",
    "TTFT_PARTS", "Finding", "PartStat", "RequestDiagnosis", "RunDiagnosis", "StepFacts",
    "diagnose_run", "explain_request", "find_request_ids", "percentiles", "render_request",
    "render_run", "summarize",
]  # fmt: skip


def diagnose_run(db_path: str | Path, run_id: str | None = None) -> RunDiagnosis:
    """Every request of a run decomposed, the steps, the percentiles and the verdict."""
    with open_db(db_path, timeout=10) as con:
        run_id = run_id or latest_run(con)
        loaded = load.load_run(con, run_id, _window)
    requests = [_decompose(row, loaded) for row in loaded.requests]
    statuses = [r.status for r in requests]
    run = RunDiagnosis(
        run_id=run_id,
        requests=requests,
        steps=[StepFacts(*row) for row in loaded.steps],
        summary=summarize(requests),
        findings=[],
        num_ok=statuses.count("ok"),
        num_aborted=statuses.count("aborted"),
        num_error=statuses.count("error"),
        prefill_members=loaded.prefill_members,
        pauses=loaded.pause_rows,
    )
    verdict.judge(run)
    return run


def find_request_ids(db_path: str | Path, request_id: str) -> list[str]:
    """The request rows an id names: itself, or a completion's per-prompt ID-0, ID-1, ..."""
    with open_db(db_path, timeout=10) as con:
        ids = load.matching_ids(con, request_id)
    if not ids:
        raise ValueError(f"request {request_id!r} is not in {db_path}")
    return ids


def explain_request(db_path: str | Path, request_id: str) -> tuple[RequestDiagnosis, list[str]]:
    """One request decomposed, and sentences on its TTFT and worst token gaps, against its run."""
    with open_db(db_path, timeout=10) as con:
        run_id = load.run_of(con, request_id)
    if run_id is None:
        raise ValueError(f"request {request_id!r} is not in {db_path}")
    run = diagnose_run(db_path, run_id)
    req = next(r for r in run.requests if r.request_id == request_id)
    req.run_medians = {
        phase: {part: stat.median_ns for part, stat in stats.items()}
        for phase, stats in run.parts.items()
    }
    return req, why.explain(req, run)


def render_run(diag: RunDiagnosis) -> str:
    """The text `replay report` prints."""
    return render.render_run(diag)


def render_request(req: RequestDiagnosis, sentences: list[str]) -> str:
    """The text `lumen trace why` prints: the sentences, and its parts against the run's."""
    return render.render_request(req, sentences)


# -- one request's decomposition -------------------------------------------------------------


def _window(row: dict[str, Any]) -> load.Window:
    arrival, ttft = row["arrival_ns"], row["ttft_ns"]
    first_token = arrival + ttft if ttft is not None else None
    start = row["http_start_ns"] or arrival
    end = row["last_delivered_ns"] or arrival + (row["e2e_ns"] or 0)
    if first_token is None:
        ttft_end = end  # it never got a token: its whole life is the TTFT phase
    elif row["stream"] is not False:
        ttft_end = row["first_delivered_ns"] or first_token
    else:
        ttft_end = first_token  # the one write of the final response ends the decode phase
    ttft_end = max(ttft_end, start)
    return load.Window(start, first_token, ttft_end, max(end, ttft_end))


def _decompose(row: dict[str, Any], run: load.LoadedRun) -> RequestDiagnosis:
    rid = row["request_id"]
    start, first_token, ttft_end, end = _window(row)
    stream = row["stream"] is not False
    req = RequestDiagnosis(
        request_id=rid,
        status=row["status"] or "error",
        arrival_ns=row["arrival_ns"],
        start_ns=start,
        prompt_tokens=row["prompt_tokens"] or 0,
        output_tokens=row["output_tokens"] or 0,
        ttft_ns=row["ttft_ns"],
        delivered_ttft_ns=_delivered_ttft(row, start, stream),
        e2e_ns=row["e2e_ns"] or 0,
        num_preemptions=row["num_preemptions"] or 0,
        stream=stream,
        end_ns=end,
        send_wait_ns=row["send_wait_ns"],
        bytes_sent=row["bytes_sent"],
        kv_freed_ns=row["kv_freed_ns"],
        wait_reason=run.wait_reasons.get(rid),
    )
    steps_t = run.step_parts.get((rid, "ttft"))
    steps_d = run.step_parts.get((rid, "decode"))
    req.ttft = _ttft_parts(row, run, start, ttft_end, steps_t, steps_d)
    if first_token is not None and end > ttft_end:
        req.decode = _decode_parts(row, run, ttft_end, end, steps_d)
    emits = [e for e in row["emit_ends"] or [] if e is not None]
    req.gaps_ns = [int(g) for g in np.diff(emits)] if len(emits) > 1 else []
    req.gap_step_ids = list(row["emit_steps"] or [])[1 : len(emits)]
    for phase in ("ttft", "decode"):
        if found := run.neighbours.get((rid, phase)):
            req.neighbour_steps[phase] = found
            for other, (n, _) in found.items():
                req.neighbours[other] = req.neighbours.get(other, 0) + n
    mine = [*(steps_t or {}).get("step_ids", []), *(steps_d or {}).get("step_ids", [])]
    req.step_ids = sorted(set(mine))
    return req


def _delivered_ttft(row: dict[str, Any], start: int, stream: bool) -> int | None:
    """Streams only: a whole response's one write is not a first token its client saw."""
    if not stream:
        return None
    if row["delivered_ttft_ns"] is not None:
        return row["delivered_ttft_ns"]
    if stream and row["first_delivered_ns"] is not None and row["ttft_ns"] is not None:
        return row["first_delivered_ns"] - start
    return None


def _ttft_parts(
    row: dict[str, Any],
    run: load.LoadedRun,
    lo: int,
    hi: int,
    steps: dict[str, Any] | None,
    later: dict[str, Any] | None,
) -> dict[str, int]:
    parts = dict.fromkeys(TTFT_PARTS, 0)
    api, core = run.pauses
    handler = row["handler_ns"] if row["http_start_ns"] else lo  # offline: no HTTP part
    sent, received = row["sent_ns"], row["received_ns"]
    first_step = (steps or later or {}).get("first_start")
    # Its first step began; a request that never ran waited in the queue to its end.
    never_ran = received and row["ttft_ns"] is None and first_step is None
    scheduled = first_step or row["first_scheduled_ns"] or (hi if never_ran else None)
    # Without step records its prefill's end is unknown: that time stays unattributed.
    last_out = steps["last_output"] if steps else (scheduled if never_ran else None)

    def span(a: int | None, b: int | None) -> tuple[int, int] | None:
        return None if a is None or b is None else (max(a, lo), max(min(b, hi), a, lo))

    for part, window in (("http", span(lo, handler)), ("frontend", span(handler, sent))):
        if window:
            parts[part] = api.carve(parts, *window)
    admission = min(row["admission_wait_ns"] or 0, parts["frontend"])
    parts["admission"], parts["frontend"] = admission, parts["frontend"] - admission
    if window := span(sent, received):
        parts["ipc"] = window[1] - window[0]
    if window := span(received, scheduled):
        # Structured outputs: until its grammar compiled it was not in the queue at all.
        ready = row.get("grammar_ready_ns")
        cut = min(max(ready, window[0]), window[1]) if ready else window[0]
        parts["grammar_compile"] = core.carve(parts, window[0], cut)
        parts["queue"] = core.carve(parts, cut, window[1])
    if steps and (window := span(scheduled, last_out)):
        keys = ("own_prefill", "neighbour_prefill", "decode", "schedule", "output", "gc")
        for key in (*keys, "grammar_mask"):
            parts[key] += round(steps[key])
        gap = window[1] - window[0] - round(steps["total"])
        gap_gc = min(max(gap, 0), max(core.within(*window) - round(steps["gc"]), 0))
        parts["gc"] += gap_gc
        parts["chunk_wait"] = gap - gap_gc
    if window := span(last_out, hi):
        tail = window[1] - window[0]
        writes = len(row["emit_ends"] or []) or max(row["output_tokens"] or 0, 1)
        delivery = (
            min(tail, (row["send_wait_ns"] or 0) // writes) if row["stream"] is not False else 0
        )
        parts["emit"] = api.carve(parts, window[0], window[1] - delivery)
        parts["delivery"] = api.carve(parts, window[1] - delivery, window[1])
    parts["unattributed"] = (hi - lo) - sum(parts.values())
    return parts


def _decode_parts(
    row: dict[str, Any], run: load.LoadedRun, lo: int, hi: int, steps: dict[str, Any] | None
) -> dict[str, int]:
    parts = dict.fromkeys(DECODE_PARTS, 0)
    api, core = run.pauses
    tail_start = min(max(steps["last_output"], lo), hi) if steps else lo
    # The last token reached the frontend, then waited on the client's socket.
    reached = row["last_emit_start"]
    reached = hi if reached is None else min(max(reached, tail_start), hi)
    if not steps and (row["output_tokens"] or 0) >= 2:
        tail_start = reached  # no step records of its decode: that time stays unattributed
    if steps:
        for key in ("decode", "neighbour_prefill", "schedule", "output", "gc", "grammar_mask"):
            parts[key] += round(steps[key])
        gap = tail_start - lo - round(steps["total"])
        preempted = sum(
            max(0, min(b, tail_start) - max(a, lo))
            for a, b in run.preemptions.get(row["request_id"], [])
        )
        parts["preempted"] = min(max(gap, 0), preempted)
        gap_gc = min(
            max(gap - parts["preempted"], 0),
            max(core.within(lo, tail_start) - round(steps["gc"]), 0),
        )
        parts["gc"] += gap_gc
        parts["between_steps"] = gap - parts["preempted"] - gap_gc
    parts["emit"] = api.carve(parts, tail_start, reached)
    parts["delivery"] = api.carve(parts, reached, hi)
    parts["unattributed"] = (hi - lo) - sum(parts.values())
    return parts
