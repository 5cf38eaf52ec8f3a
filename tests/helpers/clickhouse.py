"""The Collector ClickHouse exporter's side, for tests on chdb (embedded ClickHouse, no server):
spans written into its ``otel_traces`` table as the exporter writes them (the rules of its
exporter_traces.go and pdata's ``Value.AsString``: every attribute value as text, arrays as
compact JSON, ``Server``/``Internal`` kinds, ``Error``/``Unset`` status codes)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from replay.clickhouse import OTEL_TRACES_DDL, quote
from tracing.otlp_records import RecordSpan

BATCH = 200


def as_string(v: Any) -> str:
    """pcommon.Value.AsString: strings as they are, bools and ints in Go's spelling, doubles in
    their shortest form (1.0 -> "1"), arrays and maps as compact JSON."""
    if isinstance(v, str):
        return v
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return str(int(v)) if v.is_integer() and abs(v) < 1e21 else repr(v)
    if isinstance(v, list | dict):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _map(attrs: dict[str, Any]) -> str:
    items = ", ".join(f"{quote(k)}, {quote(as_string(attrs[k]))}" for k in sorted(attrs))
    return f"map({items})"


def _row(resource: dict[str, Any], s: RecordSpan) -> str:
    values = [
        f"fromUnixTimestamp64Nano(toInt64({s.start_ns}))", quote(s.trace_id), quote(s.span_id),
        quote(s.parent_span_id or ""), "''", quote(s.name),
        "'Server'" if s.name == "llm_request" else "'Internal'",
        quote(str(resource.get("service.name", ""))), _map(resource), "'lumen.tracing'", "''",
        _map(s.attributes), str(max(0, s.end_ns - s.start_ns)),
        "'Error'" if s.error is not None else "'Unset'", quote(s.error or ""),
        "[]", "[]", "[]", "[]", "[]", "[]", "[]",
    ]  # fmt: skip
    return "(" + ", ".join(values) + ")"


def chdb_session(folder: Path) -> Any:
    chdb = pytest.importorskip("chdb.session", reason="chdb (embedded ClickHouse) not installed")
    return chdb.Session(str(folder))


def write_otel_traces(
    folder: Path, spans: Iterable[tuple[dict[str, Any], RecordSpan]], table: str = "otel_traces"
) -> int:
    """Create the exporter's table in a chdb folder and insert ``spans``; returns how many."""
    session = chdb_session(folder)
    try:
        session.query(OTEL_TRACES_DDL.format(table=table))
        rows = [_row(r, s) for r, s in spans]
        for i in range(0, len(rows), BATCH):
            session.query(f"INSERT INTO {table} VALUES " + ", ".join(rows[i : i + BATCH]))
    finally:
        session.close()
    return len(rows)


def tail_sample(
    spans: list[tuple[dict[str, Any], RecordSpan]],
    config: dict[str, Any],
    picked: Callable[[str], bool],
) -> list[tuple[dict[str, Any], RecordSpan]]:
    """The collector's tail_sampling processor, as configured in ``config`` (a collector
    config), over whole traces: a trace is kept when any policy keeps it. ``probabilistic``
    keeps the trace ids ``picked`` says (the collector's share, made repeatable)."""
    traces: dict[str, list[tuple[dict[str, Any], RecordSpan]]] = {}
    for resource, span in spans:
        traces.setdefault(span.trace_id, []).append((resource, span))
    policies = config["processors"]["tail_sampling"]["policies"]

    def keeps(policy: dict[str, Any], trace: list[tuple[dict[str, Any], RecordSpan]]) -> bool:
        kind = policy["type"]
        if kind == "status_code":
            return "ERROR" in policy["status_code"]["status_codes"] and any(
                s.error is not None for _, s in trace
            )
        if kind == "string_attribute":
            key, values = policy["string_attribute"]["key"], policy["string_attribute"]["values"]
            return any({**r, **s.attributes}.get(key) in values for r, s in trace)
        if kind == "probabilistic":
            return picked(trace[0][1].trace_id)
        raise AssertionError(f"no emulation of the {kind} policy: the import's weights assume "
                             "only these policies")  # fmt: skip

    return [pair for trace in traces.values() if any(keeps(p, trace) for p in policies)
            for pair in trace]  # fmt: skip
