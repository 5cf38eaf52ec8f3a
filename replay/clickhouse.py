"""`replay import --format clickhouse`: a window of a fleet's traces, or one request and its run
around it, out of the OpenTelemetry Collector ClickHouse exporter's traces table into a local
trace store, on which `lumen trace why` then explains a request served anywhere in the fleet.

The replicas must export at ``--otlp-detail store`` (tracing/otlp_records.py). The table is
the exporter's ``otel_traces``: one row per span, ``Timestamp`` its start (DateTime64(9)),
``Duration`` in ns, ``SpanAttributes`` and ``ResourceAttributes`` as ``Map(String, String)``
(every value as text: ints, ``true``/``false``, JSON arrays), ``StatusCode`` ``Error`` on
failure. ``chdb:FOLDER`` reads an embedded ClickHouse (chdb); ``http(s)://HOST:PORT`` a server
(``clickhouse-connect``).
"""

from __future__ import annotations

import datetime as dt
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from replay.otlp_io import import_records
from tracing.otlp_records import RUN_ID, SERVICE, RecordSpan

# The columns read, as the exporter's documented schema names and types them (the exporter
# writes more: TraceState, SpanKind, ScopeName, ScopeVersion, Events.*, Links.*).
COLUMNS = {
    "Timestamp": "DateTime64(9)",
    "TraceId": "String",
    "SpanId": "String",
    "ParentSpanId": "String",
    "SpanName": "LowCardinality(String)",
    "ServiceName": "LowCardinality(String)",
    "ResourceAttributes": "Map(LowCardinality(String), String)",
    "SpanAttributes": "Map(LowCardinality(String), String)",
    "Duration": "UInt64",
    "StatusCode": "LowCardinality(String)",
    "StatusMessage": "String",
}
# The whole table, for a ClickHouse the exporter does not create it in (create_schema: false),
# and for tests on chdb: the exporter's schema, without its full-text indexes.
OTEL_TRACES_DDL = """
CREATE TABLE IF NOT EXISTS {table} (
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1
) ENGINE = MergeTree()
PARTITION BY toDate(Timestamp)
ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)
"""
SETTLE_S = 30.0  # --until's default: this long ago (the compose collector decides after 10 s)
SLACK_NS = 3600 * 10**9  # no Lumen span is longer than this
_SELECT = (
    "SELECT toUnixTimestamp64Nano(Timestamp), TraceId, SpanId, ParentSpanId, SpanName, "
    "ResourceAttributes, SpanAttributes, Duration, StatusCode, StatusMessage FROM {table} "
    f"WHERE ServiceName = '{SERVICE}'"
)


class Client:
    """One query interface over chdb (``chdb:FOLDER``) and a server (``http(s)://…``)."""

    def __init__(self, source: str) -> None:
        self.source = source
        if source.startswith("chdb:"):
            try:
                from chdb.session import Session
            except ImportError:
                raise ValueError("chdb: sources need the chdb package (pip install chdb)") from None
            folder = source.removeprefix("chdb:")
            if not Path(folder).is_dir():
                raise ValueError(f"no chdb folder at {folder}")
            self._chdb: Any = Session(folder)
            self._server: Any = None
        elif source.startswith(("http://", "https://")):
            try:
                import clickhouse_connect
            except ImportError:
                raise ValueError("a ClickHouse server needs clickhouse-connect (pip install "
                                 "clickhouse-connect)") from None  # fmt: skip
            self._chdb = None
            try:
                self._server = clickhouse_connect.get_client(dsn=source)
            except Exception as e:  # the driver's own error types
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                raise ValueError(f"cannot reach ClickHouse at {source}: {first[:300]}") from None
        else:
            raise ValueError(f"a ClickHouse source is http(s)://HOST:PORT or chdb:FOLDER, "
                             f"not {source!r}")  # fmt: skip

    def query(self, sql: str) -> list[list[Any]]:
        """The rows of ``sql``; the driver's errors as one line (ValueError)."""
        try:
            if self._server is not None:
                return [list(r) for r in self._server.query(sql).result_rows]
            result = self._chdb.query(sql, "JSONCompact")
            text = result.bytes() if hasattr(result, "bytes") else bytes(result)
        except Exception as e:  # each driver has its own error types
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ValueError(f"ClickHouse at {self.source}: {first[:300]}") from None
        return json.loads(text)["data"] if text.strip() else []

    def close(self) -> None:
        if self._chdb is not None:
            self._chdb.close()
        if self._server is not None:
            self._server.close()


def quote(text: str) -> str:
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def table_name(table: str) -> str:
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)?", table):
        raise ValueError(f"--table must be NAME or DATABASE.NAME, not {table!r}")
    return table


def parse_instant(text: str) -> int:
    """Unix ns of ISO 8601 (UTC unless it names a zone) or Unix seconds."""
    try:
        seconds = float(text)
    except ValueError:
        pass
    else:
        if not 0 <= seconds < 1e11:
            raise ValueError(f"not a time: {text!r} (Unix seconds from 0)")
        return int(seconds * 1e9)
    try:
        t = dt.datetime.fromisoformat(text)
    except ValueError:
        raise ValueError(f"not a time: {text!r} (ISO 8601, or Unix seconds)") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=dt.UTC)
    return int(t.timestamp() * 1e9)


def check_columns(client: Client, table: str) -> None:
    described = client.query(f"DESCRIBE TABLE {table}")
    have = {row[0] for row in described}
    if missing := [c for c in COLUMNS if c not in have]:
        raise ValueError(f"table {table} lacks the columns {', '.join(missing)} of the Collector "
                         "ClickHouse exporter's traces table")  # fmt: skip


def _spans(client: Client, table: str, where: str) -> Iterator[tuple[dict[str, Any], RecordSpan]]:
    for start, tid, sid, parent, name, resource, attrs, duration, code, message in client.query(
        _SELECT.format(table=table) + " AND " + where
    ):
        start = int(start)
        error = (message or "error") if code == "Error" else None
        yield (
            dict(resource),
            RecordSpan(
                tid, sid, parent or None, name, start, start + int(duration), dict(attrs), error
            ),
        )


def import_clickhouse(
    source: str,
    out: str | Path,
    *,
    table: str = "otel_traces",
    since: str | None = None,
    until: str | None = None,
    request: str | None = None,
    margin_s: float = 10.0,
) -> str:
    """Rebuild a trace store at ``out`` from a window of ``table`` (``since`` to ``until``), or
    from one request's run over its life +- ``margin_s``; returns what was written, in words."""
    table = table_name(table)
    if request is None and since is None:
        raise ValueError("say what to import: --since (and --until), or --request ID")
    if request is not None and (since is not None or until is not None):
        raise ValueError("--request takes its own window (--margin): not --since or --until")
    if Path(out).exists():
        raise ValueError(f"{out} exists: replay import writes a new trace db")
    client = Client(source)
    try:
        check_columns(client, table)
        run_filter = ""
        if request is not None:
            found = client.query(
                f"SELECT ResourceAttributes[{quote(RUN_ID)}], toUnixTimestamp64Nano(Timestamp), "
                f"Duration FROM {table} WHERE ServiceName = '{SERVICE}' AND SpanName = "
                f"'llm_request' AND SpanAttributes['gen_ai.request.id'] = {quote(request)} "
                "LIMIT 1"
            )
            if not found:
                raise ValueError(f"no request {request} in {table} (sampled out, or recorded "
                                 "below --otlp-detail store)")  # fmt: skip
            run_id, start, duration = found[0]
            margin = int(margin_s * 1e9)
            lo, hi = int(start) - margin, int(start) + int(duration) + margin
            run_filter = f" AND ResourceAttributes[{quote(RUN_ID)}] = {quote(run_id)}"
            what = f"request {request} and its run {run_id} +- {margin_s:g} s"
        else:
            assert since is not None
            lo = parse_instant(since)
            # A request still in flight has sent no record yet: by default the window ends
            # before the collector's decision wait.
            hi = parse_instant(until) if until else time.time_ns() - int(SETTLE_S * 1e9)
            if hi <= lo:
                raise ValueError("--until must be after --since")
            what = f"{_iso(lo)} to {_iso(hi)}"
            if not until:
                what += f" (--until defaults to {SETTLE_S:g} s ago)"
        spans = list(_spans(client, table, _overlapping(lo, hi) + run_filter))
        if not spans:
            raise ValueError(f"no Lumen span in {table} from {what}")
        spans += _around(client, table, spans)
    finally:
        client.close()
    return import_records(spans, out, f"{table} ({what})")


def _overlapping(lo: int, hi: int) -> str:
    """Spans that overlap [lo, hi] ns; the first term lets ClickHouse skip older partitions
    (no span of Lumen's lasts longer than the slack)."""
    return (f"Timestamp >= fromUnixTimestamp64Nano(toInt64({lo - SLACK_NS})) AND "
            f"Timestamp <= fromUnixTimestamp64Nano(toInt64({hi})) AND "
            f"toUnixTimestamp64Nano(Timestamp) + toInt64(Duration) >= {lo}")  # fmt: skip


def _around(
    client: Client, table: str, spans: list[tuple[dict[str, Any], RecordSpan]]
) -> list[tuple[dict[str, Any], RecordSpan]]:
    """What the window's requests need from outside it: each run's record wherever its
    start lies, the engine records over each kept request's whole life, and its child spans."""
    roots = [(r, s) for r, s in spans if s.name == "llm_request"]
    runs = sorted({r.get(RUN_ID, "") for r, _ in spans} - {""})
    if not runs:
        return []
    ids = ", ".join(quote(r) for r in runs)
    of_runs = f"ResourceAttributes[{quote(RUN_ID)}] IN ({ids})"
    more = list(_spans(client, table, f"SpanName = 'lumen.run' AND {of_runs}"))
    if roots:
        lo = min(s.start_ns for _, s in roots)
        hi = max(s.end_ns for _, s in roots)
        engine = "', '".join(("lumen.step", "lumen.pause", "lumen.lifecycle"))
        more += _spans(client, table, f"SpanName IN ('{engine}') AND {of_runs} AND "
                       + _overlapping(lo, hi))  # fmt: skip
        traces = ", ".join(quote(s.trace_id) for _, s in roots)
        more += _spans(client, table, f"SpanName != 'llm_request' AND TraceId IN ({traces})")
    return more


def _iso(ns: int) -> str:
    return dt.datetime.fromtimestamp(ns / 1e9, dt.UTC).isoformat(timespec="seconds")
