"""Small real OTLP receivers (HTTP and gRPC): decode ExportTraceServiceRequest, keep spans;
the HTTP one also takes /v1/metrics (ExportMetricsServiceRequest) and keeps histogram points.

For tests and benchmarks (a stand-in collector on loopback); ``delay`` makes it
a slow collector, ``status`` a failing one (it then keeps nothing).
"""

from __future__ import annotations

import gzip
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass
class ReceivedSpan:
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    start_ns: int
    end_ns: int
    attributes: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReceivedHistogram:
    """One data point of a histogram metric, with its resource's attributes."""

    name: str
    unit: str
    bounds: list[float]
    counts: list[int]
    count: int
    sum: float
    attributes: dict[str, Any]
    resource: dict[str, Any]


def decode_metrics(request: ExportMetricsServiceRequest) -> list[ReceivedHistogram]:
    out = []
    for rm in request.resource_metrics:
        resource = {a.key: _value(a.value) for a in rm.resource.attributes}
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.WhichOneof("data") != "histogram":
                    continue
                for p in m.histogram.data_points:
                    out.append(ReceivedHistogram(
                        m.name, m.unit, list(p.explicit_bounds), list(p.bucket_counts), p.count,
                        p.sum, {a.key: _value(a.value) for a in p.attributes}, resource,
                    ))  # fmt: skip
    return out


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` serves on ``r.endpoint`` (…/v1/traces) until the block ends."""

    def __init__(self, *, delay: float = 0.0, status: int = 200, keep: bool = False) -> None:
        """``keep``: also keep each request as received (``write_otlp_json``)."""
        self.spans: list[ReceivedSpan] = []
        self.requests: list[ExportTraceServiceRequest] = []
        self.keep = keep
        self.num_bytes = 0  # OTLP/HTTP request bodies received, as sent (compressed or not)
        self.metrics: list[ReceivedHistogram] = []
        self.delay = delay
        self.status = status
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    receiver.num_bytes += len(body)
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if receiver.delay:
                    time.sleep(receiver.delay)
                if self.path.endswith("/v1/metrics"):
                    if receiver.status == 200:
                        points = decode_metrics(ExportMetricsServiceRequest.FromString(body))
                        with receiver._lock:
                            receiver.metrics.extend(points)
                    reply = ExportMetricsServiceResponse().SerializeToString()
                else:
                    if receiver.status == 200:
                        receiver._accept(ExportTraceServiceRequest.FromString(body))
                    reply = ExportTraceServiceResponse().SerializeToString()
                try:
                    self.send_response(receiver.status)
                    self.send_header("Content-Type", "application/x-protobuf")
                    self.send_header("Content-Length", str(len(reply)))
                    self.end_headers()
                    self.wfile.write(reply)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the exporter gave up waiting (a slow collector is the point)

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        base = f"http://127.0.0.1:{self._server.server_address[1]}"
        self.endpoint = f"{base}/v1/traces"
        self.metrics_endpoint = f"{base}/v1/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def _accept(self, request: ExportTraceServiceRequest) -> None:
        spans = decode(request)
        with self._lock:
            self.spans.extend(spans)
            if self.keep:
                self.requests.append(request)

    def write_otlp_json(self, path: str) -> int:
        """What was received, as the Collector's file exporter writes it; returns the lines."""
        from tracing.otlp_json import to_json

        with self._lock, open(path, "w") as f:
            for request in self.requests:
                f.write(to_json(request) + "\n")
            return len(self.requests)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()


class GrpcOtlpReceiver:
    """The gRPC flavour: ``with GrpcOtlpReceiver() as r:`` listens on ``r.endpoint``
    (grpc://127.0.0.1:PORT)."""

    def __init__(self) -> None:
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as service

        self.spans: list[ReceivedSpan] = []
        receiver = self

        class Servicer(service.TraceServiceServicer):
            def Export(self, request: Any, context: Any) -> Any:
                receiver.spans.extend(decode(request))
                return ExportTraceServiceResponse()

        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        service.add_TraceServiceServicer_to_server(Servicer(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"grpc://127.0.0.1:{port}"

    def __enter__(self) -> GrpcOtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)


def decode(request: ExportTraceServiceRequest) -> list[ReceivedSpan]:
    return [
        ReceivedSpan(
            name=s.name,
            trace_id=s.trace_id.hex(),
            span_id=s.span_id.hex(),
            parent_span_id=s.parent_span_id.hex() or None,
            start_ns=s.start_time_unix_nano,
            end_ns=s.end_time_unix_nano,
            attributes={a.key: _value(a.value) for a in s.attributes},
        )
        for rs in request.resource_spans
        for ss in rs.scope_spans
        for s in ss.spans
    ]
