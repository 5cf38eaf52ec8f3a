"""Tracing options, declared once: the fields are `lumen serve` flags and `LLM(...)` keywords."""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass, field

TRACE_PROMPTS = ("hashes", "tokens", "none")
OTLP_DETAILS = ("request", "boundary", "step", "store")


@dataclass(frozen=True)
class TracingConfig:
    trace_db: str = field(
        default="traces/trace.db",
        metadata={
            "help": "DuckDB trace store to append to; a folder (an existing one, or a path "
            "ending in /): REPLICA.db in it, one store per replica (--service-instance-id), "
            "read as one fleet by lumen trace and replay"
        },
    )
    no_trace_db: bool = field(default=False, metadata={"help": "record no trace db"})
    trace_prompts: str = field(
        default="hashes",
        metadata={
            "help": "what replay may re-create prompts from: hashes (length and per-block "
            "hashes), tokens (exact ids) or none; prompt text is never stored"
        },
    )
    otlp_traces_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "export spans over OTLP to this URL (http(s)://... for OTLP/HTTP, "
            "grpc://host:port for gRPC; default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)"
        },
    )
    otlp_metrics_endpoint: str | None = field(
        default=None,
        metadata={
            "help": "send the OpenTelemetry GenAI server metrics (TTFT, time per output token, "
            "request duration) over OTLP to this URL (http(s)://... or grpc://host:port; "
            "default: $OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else $OTEL_EXPORTER_OTLP_ENDPOINT)"
        },
    )
    otlp_detail: str = field(
        default="boundary",
        metadata={
            "help": "request (root span), boundary (one per boundary), step (all) or store "
            "(the trace store's rows: one span per request and per engine step, enough for "
            "replay import to rebuild the store the diagnosis reads)"
        },
    )
    otlp_keep_slower_than: float = field(
        default=5.0,
        metadata={
            "help": "at --otlp-detail store, mark requests that took this long (seconds, "
            "arrival to finish), and every failed one, lumen.sample.keep: a collector's tail "
            "sampling keeps them all, and replay import weighs the sampled rest"
        },
    )
    trace_flush_interval: float = field(
        default=1.0,
        metadata={
            "help": "seconds between trace db flushes; under load they spread out, up to 10x "
            "this, until flushing costs about 0.5%% of a core; a pause in traffic flushes at once"
        },
    )
    service_instance_id: str | None = field(
        default=None,
        metadata={
            "help": "this replica's name in a fleet's traces (OpenTelemetry's "
            "service.instance.id: keep it across restarts); default: the service.instance.id "
            "of $OTEL_RESOURCE_ATTRIBUTES, else HOST:PORT (HOST for the offline LLM)"
        },
    )

    def __post_init__(self) -> None:
        if self.trace_prompts not in TRACE_PROMPTS:
            raise ValueError(
                f"trace_prompts must be one of {', '.join(TRACE_PROMPTS)}, "
                f"not {self.trace_prompts!r}"
            )
        if self.otlp_detail not in OTLP_DETAILS:
            raise ValueError(
                f"otlp_detail must be one of {', '.join(OTLP_DETAILS)}, not {self.otlp_detail!r}"
            )
        if self.otlp_keep_slower_than <= 0:
            raise ValueError("otlp_keep_slower_than must be positive")
        if self.trace_flush_interval <= 0:
            raise ValueError("trace_flush_interval must be positive")

    @property
    def db_path(self) -> str | None:
        return None if self.no_trace_db or not self.trace_db else self.trace_db


def store_path(config: TracingConfig, replica: str) -> str | None:
    """The replica's trace store: --trace-db, or REPLICA.db in it when it names a folder."""
    db = config.db_path
    if db is None or not (db.endswith(("/", os.sep)) or os.path.isdir(db)):
        return db
    return os.path.join(db, re.sub(r"[^A-Za-z0-9._-]", "_", replica) + ".db")


def replica_id(config: TracingConfig, port: int | None = None) -> str:
    """This process's replica name (service.instance.id): the flag, else the one in
    $OTEL_RESOURCE_ATTRIBUTES, else HOST:PORT (HOST without a port)."""
    if config.service_instance_id:
        return config.service_instance_id
    for item in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, _, value = item.partition("=")
        if key.strip() == "service.instance.id" and value.strip():
            return value.strip()
    host = socket.gethostname()
    return f"{host}:{port}" if port is not None else host
