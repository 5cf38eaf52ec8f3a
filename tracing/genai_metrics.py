"""The OpenTelemetry GenAI model-server metrics, sent over OTLP beside Prometheus' /metrics.

Three histograms, as open-telemetry/semantic-conventions-genai (status Development) defines
them, with its explicit bucket boundaries:

- ``gen_ai.server.time_to_first_token`` (s): successful requests, arrival to first token;
- ``gen_ai.server.time_per_output_token`` (s): successful requests with two tokens or more,
  (last token - first token) / (tokens - 1);
- ``gen_ai.server.request.duration`` (s): every request, arrival to its end, with
  ``error.type`` (``error`` or ``aborted``) when it did not succeed.

Attributes: ``gen_ai.operation.name`` (``chat`` or ``text_completion``),
``gen_ai.provider.name`` (``lumen``: a self-hosted server is its own provider; no
well-known value names one), ``gen_ai.request.model`` and ``gen_ai.response.model`` (the
served model name), ``server.address`` and ``server.port`` (the server's). The resource
carries ``service.name`` and ``service.instance.id`` (the replica). Recorded by the trace
writer thread as each request closes, never on the serving path; the SDK exports every
``OTEL_METRIC_EXPORT_INTERVAL`` ms (60 s by default) and at shutdown.
"""

from __future__ import annotations

from typing import Any

from tracing.config import TracingConfig
from tracing.otlp import otlp_target
from tracing.spans import RequestTrace

PROVIDER = "lumen"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0)  # fmt: skip
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
DURATION_BUCKETS = (0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12, 10.24,
                    20.48, 40.96, 81.92)  # fmt: skip
HISTOGRAMS = {  # name -> (buckets, description)
    "gen_ai.server.time_to_first_token": (
        TTFT_BUCKETS,
        "Time to generate first token for successful responses.",
    ),
    "gen_ai.server.time_per_output_token": (
        TPOT_BUCKETS,
        "Time per output token generated after the first token for successful responses.",
    ),
    "gen_ai.server.request.duration": (
        DURATION_BUCKETS,
        "Generative AI server request duration such as time-to-last byte or last output token.",
    ),
}


class GenAIMetrics:
    """The three histograms on their own MeterProvider, exporting to ``endpoint``."""

    def __init__(
        self,
        protocol: str,
        endpoint: str,
        replica: str,
        model: str,
        host: str | None,
        port: int | None,
    ) -> None:
        """``model``: the name for requests that carry none (the offline LLM's)."""
        self.model = model
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
        from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
        from opentelemetry.sdk.resources import Resource

        exporter: Any
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

            exporter = OTLPMetricExporter(endpoint=endpoint, insecure=True, timeout=5)
        else:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
                OTLPMetricExporter as HTTPMetricExporter,
            )

            exporter = HTTPMetricExporter(endpoint=endpoint, timeout=5)
        views = [
            View(instrument_name=name, aggregation=ExplicitBucketHistogramAggregation(buckets))
            for name, (buckets, _) in HISTOGRAMS.items()
        ]
        self._provider = MeterProvider(
            metric_readers=[PeriodicExportingMetricReader(exporter)],
            resource=Resource.create({"service.name": "lumen", "service.instance.id": replica}),
            views=views,
        )
        meter = self._provider.get_meter("lumen.genai")
        self._histograms = {
            name: meter.create_histogram(name, unit="s", description=description)
            for name, (_, description) in HISTOGRAMS.items()
        }
        self._server: dict[str, Any] = {}
        if host is not None and port is not None:
            self._server = {"server.address": host, "server.port": port}

    def record(self, req: RequestTrace) -> None:
        """One closed request (the trace writer thread)."""
        attrs: dict[str, Any] = {
            "gen_ai.operation.name": "chat" if "chat" in req.endpoint else "text_completion",
            "gen_ai.provider.name": PROVIDER,
            "gen_ai.request.model": req.model or self.model,
            "gen_ai.response.model": req.model or self.model,
            **self._server,
        }
        end = req.finished_ns or req.last_token_ns
        h = self._histograms
        if req.status == "ok":
            if req.first_token_ns:
                ttft = (req.first_token_ns - req.arrival_ns) / 1e9
                h["gen_ai.server.time_to_first_token"].record(ttft, attrs)
            if req.output_tokens > 1 and req.last_token_ns > req.first_token_ns:
                tpot = (req.last_token_ns - req.first_token_ns) / 1e9 / (req.output_tokens - 1)
                h["gen_ai.server.time_per_output_token"].record(tpot, attrs)
        else:
            attrs["error.type"] = req.status or "_OTHER"
        if end:
            h["gen_ai.server.request.duration"].record((end - req.arrival_ns) / 1e9, attrs)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._provider.shutdown(timeout_millis=timeout * 1000)


def make_genai_metrics(
    config: TracingConfig,
    replica: str,
    model: str,
    host: str | None = None,
    port: int | None = None,
) -> GenAIMetrics | None:
    target = otlp_target(config.otlp_metrics_endpoint, "metrics")
    return None if target is None else GenAIMetrics(*target, replica, model, host, port)
