"""OTLP detail levels (DESIGN §3) with the SDK's in-memory exporter, and endpoint parsing."""

from __future__ import annotations

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.messages import StepRecord
from tracing.config import TracingConfig
from tracing.otlp import OtlpExport, otlp_endpoint
from tracing.spans import RequestTrace, StepVisit, build_spans


def _request() -> RequestTrace:
    req = RequestTrace("cmpl-1", arrival_ns=1_000, child_ids=["cmpl-1"], stream=True)
    req.sent_ns, req.received_ns = 2_000, {0: 3_000}
    for step in range(3):
        base = 10_000 * (step + 1)
        record = StepRecord(step, base, base + 100, base + 200, base + 900, base + 950,
                            *[0] * 10)  # fmt: skip
        req.visits.append(StepVisit(0, record, 5 if step == 0 else 1))
        req.first_steps.setdefault(0, record.schedule_start_ns)
        req.emit_steps.append(step)
        req.emit_received.append(base + 960)
        req.emit_delivered.append(base + 990)
    req.status, req.finish_reason = "ok", "length"
    req.close(40_000)
    return req


@pytest.mark.parametrize(("detail", "count"), [("request", 1), ("boundary", 8), ("step", 16)])
def test_detail_levels(detail: str, count: int) -> None:
    memory = InMemorySpanExporter()
    export = OtlpExport(memory, detail)
    rows = build_spans(_request(), "run")
    export.export(rows)
    export.shutdown(5)
    spans = memory.get_finished_spans()
    assert len(spans) == count
    root = next(s for s in spans if s.name == "llm_request")
    assert all(s.parent.span_id == root.context.span_id for s in spans if s is not root)
    if detail == "boundary":
        schedule = next(s for s in spans if s.name == "core.schedule")
        # First to last occurrence, with the count and summed time.
        assert (schedule.start_time, schedule.end_time) == (10_000, 30_100)
        assert schedule.attributes["lumen.occurrences"] == 3
        assert schedule.attributes["lumen.total_duration_s"] == pytest.approx(300 / 1e9)
        # Waiting for the first step is core.queue, never scheduler time.
        queue = next(s for s in spans if s.name == "core.queue")
        assert (queue.start_time, queue.end_time) == (3_000, 10_000)
    assert export.num_dropped == 0


def test_a_full_queue_is_counted_not_waited_for() -> None:
    export = OtlpExport(InMemorySpanExporter(), "step", max_queue=4)
    export.export(build_spans(_request(), "run"))  # 16 spans, room for 4
    assert export.num_dropped == 12
    export.shutdown(5)


def test_endpoints(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT",
                "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)
    assert otlp_endpoint(TracingConfig()) is None
    cfg = TracingConfig(otlp_traces_endpoint="http://collector:4318")
    assert otlp_endpoint(cfg) == ("http/protobuf", "http://collector:4318/v1/traces")
    cfg = TracingConfig(otlp_traces_endpoint="grpc://collector:4317")
    assert otlp_endpoint(cfg) == ("grpc", "collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://c:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    assert otlp_endpoint(TracingConfig()) == ("grpc", "c:4317")
    with pytest.raises(ValueError, match="OTLP endpoint"):
        otlp_endpoint(TracingConfig(otlp_traces_endpoint="ftp://x"))
    with pytest.raises(ValueError, match="otlp_detail"):
        TracingConfig(otlp_detail="everything")
