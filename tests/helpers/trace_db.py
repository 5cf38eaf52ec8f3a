"""A small hand-made trace db (a long prefill, then a burst after an idle gap) and its diagnosis,
for the tests of what reads a trace db: the HTML report and the exports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tracing.diagnose import Finding, RequestDiagnosis, RunDiagnosis, StepFacts
from tracing.store import TraceStore, row

RUN = "run-a"
T0 = 1_700_000_000_000_000_000  # a realistic Unix-epoch start, so relative times are tested
MS = 1_000_000
# (step id, start ms, prefill tokens, decode tokens, running, waiting, request ids scheduled)
STEPS = [
    (0, 0, 4000, 0, 1, 2, ["r0"]),  # one long prefill holds everyone else back
    (1, 410, 600, 1, 3, 0, ["r0", "r1", "r2"]),
    (2, 470, 0, 3, 3, 0, ["r0", "r1", "r2"]),
    (3, 500, 0, 3, 3, 0, ["r0", "r1", "r2"]),
    (4, 5000, 300, 0, 1, 0, ["r3"]),  # after 4.5 s without a request
    (5, 5060, 0, 1, 1, 0, ["r3"]),
]
# request id -> arrival ms, prompt tokens, output tokens, ttft ms, e2e ms
REQUESTS = {
    "r0": (0, 4000, 4, 420, 540),
    "r1": (5, 300, 3, 475, 535),
    "r2": (8, 300, 3, 475, 535),
    "r3": (4995, 300, 2, 70, 100),
}


def _step_row(step_id: int, start_ms: int, prefill: int, decode: int, running: int,
              waiting: int, rids: list[str]) -> tuple[Any, ...]:  # fmt: skip
    start = T0 + start_ms * MS
    execute_ms = 400 if prefill >= 4000 else 25
    return row(
        "steps", run_id=RUN, step_id=step_id, schedule_start_ns=start, schedule_end_ns=start + MS,
        execute_start_ns=start + MS, execute_end_ns=start + (1 + execute_ms) * MS,
        output_ns=start + (2 + execute_ms) * MS, num_running=running, num_waiting=waiting,
        num_scheduled_tokens=prefill + decode, num_prefill_tokens=prefill,
        num_decode_tokens=decode, num_preemptions=0, kv_blocks_used=10 * running,
        kv_blocks_total=512, request_ids=rids, num_scheduled=[1] * len(rids), idle=False,
    )  # fmt: skip


def _spans(rid: str) -> list[tuple[Any, ...]]:
    arrival_ms = REQUESTS[rid][0]
    first = next(s for s in STEPS if rid in s[6])
    spans = [
        ("llm_request", arrival_ms, arrival_ms + REQUESTS[rid][4], None),
        ("frontend.enqueue", arrival_ms, arrival_ms + 1, None),
        ("core.receive", arrival_ms + 1, arrival_ms + 2, None),
        ("core.queue", arrival_ms + 2, first[1], None),
    ]
    for step_id, start, prefill, *_, rids in STEPS:
        if rid in rids:
            execute_ms = 400 if prefill >= 4000 else 25
            spans += [
                ("core.schedule", start, start + 1, step_id),
                ("worker.execute", start + 1, start + 1 + execute_ms, step_id),
                ("core.output", start + 1 + execute_ms, start + 2 + execute_ms, step_id),
                ("frontend.emit", start + 2 + execute_ms, start + 3 + execute_ms, step_id),
            ]
    return [
        row("span_rows", run_id=RUN, request_id=rid, trace_id=f"{rid:0>32}",
            span_id=f"{rid}{i:014x}", parent_span_id=None if name == "llm_request" else f"{rid}0",
            name=name, start_ns=T0 + a * MS, end_ns=T0 + b * MS, step_id=step, attributes="{}")
        for i, (name, a, b, step) in enumerate(spans)
    ]  # fmt: skip


def build_trace_db(path: Path, *, with_pauses: bool = True) -> Path:
    store = TraceStore(path)
    store.add("runs", [row("runs", run_id=RUN, started_ns=T0 - 60_000 * MS, model="tiny")])
    store.add("requests", [
        row("requests", run_id=RUN, request_id=rid, arrival_ns=T0 + a * MS, prompt_tokens=p,
            output_tokens=o, status="ok", ttft_ns=ttft * MS, e2e_ns=e2e * MS)
        for rid, (a, p, o, ttft, e2e) in REQUESTS.items()
    ])  # fmt: skip
    store.add("span_rows", [s for rid in REQUESTS for s in _spans(rid)])
    store.add("steps", [_step_row(*s) for s in STEPS])
    if with_pauses:
        store.add("pauses", [
            row("pauses", run_id=RUN, process="core", kind="gc", start_ns=T0 + 200 * MS,
                duration_ns=12 * MS, detail="2"),
            row("pauses", run_id=RUN, process="api", kind="loop_lag", start_ns=T0 + 30 * MS,
                duration_ns=5 * MS),
        ])  # fmt: skip
    assert store.flush()
    store.close()
    return path


def make_diagnosis() -> RunDiagnosis:
    """What diagnose_run would say of build_trace_db's run: the long prefill made r1/r2 queue."""
    requests = []
    for rid, (a, p, o, ttft, e2e) in REQUESTS.items():
        queue = {"r1": 400, "r2": 400}.get(rid, 0)
        parts = {"frontend": 1, "ipc": 1, "queue": queue, "own_prefill": 50 if rid != "r0" else 400,
                 "decode": 0, "output": 2, "emit": 1}  # fmt: skip
        parts["neighbour_prefill"] = ttft - sum(parts.values())
        requests.append(RequestDiagnosis(
            request_id=rid, status="ok", arrival_ns=T0 + a * MS, start_ns=T0 + a * MS,
            prompt_tokens=p, output_tokens=o, ttft_ns=ttft * MS, delivered_ttft_ns=(ttft + 1) * MS,
            e2e_ns=e2e * MS, ttft={k: v * MS for k, v in parts.items()},
            gaps_ns=[30 * MS] * (o - 1),
        ))  # fmt: skip
    steps = [
        StepFacts(
            step_id=i, start_ns=T0 + s * MS, end_ns=T0 + (s + (402 if pf >= 4000 else 27)) * MS,
            schedule_ns=MS, execute_ns=(400 if pf >= 4000 else 25) * MS, output_ns=MS,
            prefill_tokens=pf, decode_tokens=d, running=run, waiting=w, preemptions=0,
            kv_blocks_used=10 * run, kv_blocks_total=512, idle=False, wait_reason=None,
        )
        for i, s, pf, d, run, w, _ in STEPS
    ]  # fmt: skip
    pct = {"p50": 0.475, "p90": 0.475, "p99": 0.475, "max": 0.475}
    return RunDiagnosis(
        run_id=RUN, requests=requests, steps=steps,
        summary={"ttft_s": {**pct, "p50": 0.42}, "e2e_s": pct, "itl_s": pct},
        findings=[Finding("cause", "r1 and r2 waited 400 ms in the queue behind r0's 4,000-token "
                          "prefill.", ms=400.0, part="queue", request_ids=["r1", "r2"])],
        num_ok=4,
    )  # fmt: skip
