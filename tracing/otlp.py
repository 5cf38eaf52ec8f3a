"""OTLP export through the OpenTelemetry SDK's batch processor, at the detail DESIGN §3 defines.

Spans are built from the trace writer's rows as SDK ``ReadableSpan`` objects with
the same ids as the DuckDB store, so a span found in a collector is found by
SQL too. The batch processor exports on its own thread; a collector that is
down or slow costs dropped spans (counted), never serving time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any
from urllib.parse import urlparse

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags

from engine.version import __version__
from tracing.config import TracingConfig
from tracing.otlp_records import RecordSpan, resource_attributes
from tracing.spans import ROOT

logger = logging.getLogger(__name__)
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)


def otlp_endpoint(config: TracingConfig) -> tuple[str, str] | None:
    """(protocol, endpoint) of the spans: the flag, else the standard OTEL_* variables."""
    return otlp_target(config.otlp_traces_endpoint, "traces")


def otlp_target(url: str | None, signal: str) -> tuple[str, str] | None:
    """(protocol, endpoint) for ``signal`` (traces, metrics): ``url``, else
    $OTEL_EXPORTER_OTLP_{SIGNAL}_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT (+ /v1/signal)."""
    protocol = None
    if not url:
        name = f"OTEL_EXPORTER_OTLP_{signal.upper()}"
        url = os.environ.get(f"{name}_ENDPOINT")
        if not url and (base := os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
            url = base
        protocol = os.environ.get(f"{name}_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL"))
    if not url:
        return None
    parsed = urlparse(url)
    if parsed.scheme == "grpc" or protocol == "grpc":
        return "grpc", parsed.netloc or url
    if parsed.scheme not in ("http", "https"):
        raise ValueError(f"OTLP endpoint must be http(s)://... or grpc://host:port, not {url!r}")
    if parsed.path in ("", "/"):
        url = url.rstrip("/") + f"/v1/{signal}"
    return "http/protobuf", url


def make_exporter(config: TracingConfig, replica: str = "", run_id: str = "") -> OtlpExport | None:
    target = otlp_endpoint(config)
    if target is None:
        return None
    protocol, endpoint = target
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter: SpanExporter = OTLPSpanExporter(endpoint=endpoint, insecure=True, timeout=5)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HTTPSpanExporter,
        )

        exporter = HTTPSpanExporter(endpoint=endpoint, timeout=5)
    logger.info("exporting spans over OTLP (%s) to %s, detail %s", protocol, endpoint,
                config.otlp_detail)  # fmt: skip
    return OtlpExport(exporter, config.otlp_detail, replica=replica, run_id=run_id)


class _Counting(SpanExporter):
    """Counts what reaches the exporter and what it fails to deliver."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.num_attempted = 0
        self.num_failed = 0

    def export(self, spans: Any) -> SpanExportResult:
        self.num_attempted += len(spans)
        try:
            result = self.inner.export(spans)
        except Exception:
            result = SpanExportResult.FAILURE
        if result != SpanExportResult.SUCCESS:
            self.num_failed += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class OtlpExport:
    """Rows in, SDK spans out. Only the trace writer thread calls ``export``."""

    def __init__(
        self,
        exporter: SpanExporter,
        detail: str,
        *,
        max_queue: int = 8192,
        replica: str = "",
        run_id: str = "",
    ) -> None:
        self.detail = detail
        self.max_queue = max_queue
        self._exporter = _Counting(exporter)
        self._processor = BatchSpanProcessor(
            self._exporter,
            max_queue_size=max_queue,
            schedule_delay_millis=500,
            # A store span carries a whole row (a request's can be KBs): smaller batches stay
            # under a collector's request size limit (4 MiB on gRPC by default).
            max_export_batch_size=min(128 if detail == "store" else 512, max_queue),
        )
        # service.instance.id: the replica (tracing.config.replica_id), as the store keeps it.
        self._resource = Resource.create(resource_attributes(run_id, replica))
        self._scope = InstrumentationScope("lumen.tracing", __version__)
        self._num_submitted = 0
        self._num_refused = 0

    @property
    def num_dropped(self) -> int:
        return self._num_refused + self._exporter.num_failed

    def export(self, rows: list[tuple[Any, ...]]) -> None:
        """A request's spans (tracing.spans.Span rows, root first), at this detail."""
        self.export_records([_record(r) for r in self._select(rows)])

    def export_records(self, records: list[RecordSpan]) -> None:
        spans = [readable(r, self._resource, self._scope) for r in records]
        # Never overfill the processor's queue (it would drop silently, warning per span). At
        # the store detail a call's spans go whole or not at all (a request and its rows).
        room = self.max_queue - (self._num_submitted - self._exporter.num_attempted)
        if len(spans) > room:
            keep = 0 if self.detail == "store" else max(room, 0)
            self._num_refused += len(spans) - keep
            spans = spans[:keep]
        for span in spans:
            self._processor.on_end(span)
        self._num_submitted += len(spans)

    def shutdown(self, timeout: float) -> None:
        self._processor.force_flush(int(timeout * 1000))
        self._processor.shutdown()

    def _select(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        if self.detail == "step":
            return rows
        root = rows[0]
        if self.detail == "request":
            return [root]
        # boundary: one span per boundary, first start to last end, with count and summed time.
        merged: dict[str, list[Any]] = {}
        for r in rows[1:]:
            m = merged.get(r[5])
            if m is None:
                merged[r[5]] = [
                    *r[:8],
                    None,
                    {"lumen.occurrences": 1, "lumen.total_duration_s": (r[7] - r[6]) / 1e9},
                ]
            else:  # fmt: skip
                m[6], m[7] = min(m[6], r[6]), max(m[7], r[7])
                m[9]["lumen.occurrences"] += 1
                m[9]["lumen.total_duration_s"] += (r[7] - r[6]) / 1e9
        return [root, *(tuple(m) for m in merged.values())]


def _record(row: tuple[Any, ...]) -> RecordSpan:
    _, request_id, trace_id, span_id, parent_id, name, start, end, step_id, attrs = row
    attributes = json.loads(attrs) if isinstance(attrs, str) else dict(attrs)
    attributes["lumen.request_id"] = request_id
    if step_id is not None:
        attributes["lumen.step_id"] = step_id
    error = None
    if name == ROOT and attributes.get("lumen.status") == "error":
        error = attributes.get("lumen.error") or "error"
    return RecordSpan(trace_id, span_id, parent_id, name, start, end, attributes, error)


def readable(r: RecordSpan, resource: Resource, scope: InstrumentationScope) -> ReadableSpan:
    """The SDK span of a RecordSpan (a root's parent from an incoming traceparent is remote)."""
    tid = int(r.trace_id, 16)
    parent = None
    if r.parent_span_id is not None:
        parent = SpanContext(tid, int(r.parent_span_id, 16), is_remote=r.name == ROOT,
                             trace_flags=_SAMPLED)  # fmt: skip
    return ReadableSpan(
        name=r.name,
        context=SpanContext(tid, int(r.span_id, 16), is_remote=False, trace_flags=_SAMPLED),
        parent=parent,
        resource=resource,
        attributes=r.attributes,
        kind=SpanKind.SERVER if r.name == ROOT else SpanKind.INTERNAL,
        start_time=r.start_ns,
        end_time=r.end_ns,
        instrumentation_scope=scope,
        status=Status(StatusCode.ERROR, r.error) if r.error is not None else Status(),
    )
