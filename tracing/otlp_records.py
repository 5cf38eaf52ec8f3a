"""The trace store's rows as OTLP spans and back (DESIGN §3, ``--otlp-detail store``).

A store exported this way can be rebuilt whole from what a collector kept, so that `lumen trace
why`, `replay report` and `replay run` work on a fleet's traces as on the replica's own store:

- a request is its root span ``llm_request``, in its own trace, carrying its ``requests`` row
  (and its ``request_children``) as attributes; the per-sequence spans the store keeps as rows
  (``span_rows``) are its child spans;
- an engine step is one span ``lumen.step`` carrying its ``steps`` row, members included (the
  core request ids and their scheduled tokens, as arrays); ``lumen.pause`` and
  ``lumen.lifecycle`` carry the other engine-side rows, and ``lumen.run`` the run's row and
  engine configuration. These go in traces of their own, one per run and ``WINDOW_NS`` of time,
  so a collector that samples requests never drops a step a kept request shared.

A row's columns travel as attributes ``lumen.row.<column>`` (NULL: absent); the table as
``lumen.record``; the run as the resource attribute ``lumen.run_id``. A failed request's root
has status ERROR and ``lumen.sample.keep=error``, a slow one's ``lumen.sample.keep=slow``: the
requests a collector's tail sampling keeps whatever its share of the rest (dashboards/otel),
so that an import can weigh the rest by what they stand for. Decoding is typed by the
store's schema (tracing/store_schema.py) and takes either native OTLP values or the strings a
ClickHouse ``Map(String, String)`` keeps (ints, ``true``/``false``, JSON arrays).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from tracing.spans import ROOT
from tracing.store_schema import TABLES

PREFIX = "lumen.row."
RECORD = "lumen.record"
# On a request's root: why a collector's tail sampling must keep its trace (error | slow).
KEEP = "lumen.sample.keep"
KEEP_SLOWER_THAN_S = 5.0
RUN_ID = "lumen.run_id"  # resource attribute
SERVICE = "lumen"
WINDOW_NS = 10 * 10**9  # one engine trace per run and 10 s
# The engine-side tables and the span that carries each of their rows: (name, start, end).
ENGINE_RECORDS = {
    "runs": ("lumen.run", "started_ns", "started_ns"),
    "steps": ("lumen.step", "schedule_start_ns", "output_ns"),
    "pauses": ("lumen.pause", "start_ns", "duration_ns"),
    "lifecycle": ("lumen.lifecycle", "start_ns", "end_ns"),
}
# Columns a span carries in its own fields, not as attributes.
_REQUEST_OWN = ("run_id", "trace_id", "root_span_id", "parent_span_id")
_SPAN_OWN = ("run_id", "trace_id", "span_id", "parent_span_id", "name", "start_ns", "end_ns")
_CHILDREN = "lumen.children."  # request_children, as one array per column on the root


class RecordSpan(NamedTuple):
    """A span as Lumen exports it, before the SDK or a JSON file (ids in lowercase hex)."""

    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str | None = None  # the status: ERROR with this message; None: unset


def resource_attributes(run_id: str, replica: str) -> dict[str, Any]:
    attrs = {"service.name": SERVICE, RUN_ID: run_id}
    if replica:
        attrs["service.instance.id"] = replica
    return attrs


def _hex(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def window_trace_id(run_id: str, ns: int) -> str:
    """The engine trace of ``run_id`` that holds the instant ``ns``."""
    return _hex(f"{run_id}/{ns // WINDOW_NS}", 16)


def _attrs(table: str, row: tuple[Any, ...], skip: tuple[str, ...]) -> dict[str, Any]:
    return {
        PREFIX + col: list(v) if isinstance(v, tuple) else v
        for col, v in zip(TABLES[table], row)
        if v is not None and col not in skip
    }


def engine_spans(run_id: str, table: str, rows: Iterable[tuple[Any, ...]]) -> list[RecordSpan]:
    """Spans of rows of runs, steps, pauses or lifecycle (run_id is the resource's)."""
    name, start_col, end_col = ENGINE_RECORDS[table]
    cols = list(TABLES[table])
    i_start, i_end = cols.index(start_col), cols.index(end_col)
    out = []
    for row in rows:
        start = row[i_start] or 0
        end = row[i_end] or start
        if table == "pauses":
            end = start + end
        elif table == "steps" and not row[i_end]:  # no output: ends with its schedule
            end = row[cols.index("schedule_end_ns")] or start
        attrs = _attrs(table, row, ("run_id",))
        attrs[RECORD] = table
        span_id = _hex(f"{run_id}/{table}/{row[1]}/{start}", 8)
        out.append(RecordSpan(window_trace_id(run_id, start), span_id, None, name, start,
                              max(start, end), attrs))  # fmt: skip
    return out


def request_record_spans(
    request: tuple[Any, ...],
    root_attributes: Mapping[str, Any],
    span_rows: Iterable[tuple[Any, ...]] = (),
    children: Iterable[tuple[Any, ...]] = (),
    *,
    slow_ns: int = int(KEEP_SLOWER_THAN_S * 1e9),
) -> list[RecordSpan]:
    """The request's root span (its row as attributes beside ``root_attributes``, the GenAI
    ones) and its stored per-sequence spans; ``slow_ns``: from this e2e on it is kept."""
    r = dict(zip(TABLES["requests"], request))
    attrs = dict(root_attributes)
    attrs.update(_attrs("requests", request, _REQUEST_OWN))
    attrs[RECORD] = "requests"
    child_cols = [c for c in TABLES["request_children"] if c not in ("run_id", "request_id")]
    kids = sorted(children, key=lambda c: c[3])
    if kids:
        for i, col in enumerate(TABLES["request_children"]):
            if col in child_cols:
                attrs[_CHILDREN + col] = [k[i] for k in kids]
    start = min(r["http_start_ns"] or r["arrival_ns"], r["arrival_ns"])
    end = r["arrival_ns"] + (r["e2e_ns"] or 0)
    error = (r["error"] or "error") if r["status"] == "error" else None
    if error is not None:
        attrs[KEEP] = "error"
    elif (r["e2e_ns"] or 0) >= slow_ns:
        attrs[KEEP] = "slow"
    out = [RecordSpan(r["trace_id"], r["root_span_id"], r["parent_span_id"], ROOT, start,
                      max(start, end), attrs, error)]  # fmt: skip
    for s in span_rows:
        span = dict(zip(TABLES["span_rows"], s))
        attrs = _attrs("span_rows", s, _SPAN_OWN)
        attrs[RECORD] = "span_rows"
        out.append(RecordSpan(span["trace_id"], span["span_id"], span["parent_span_id"],
                              span["name"], span["start_ns"], span["end_ns"], attrs))  # fmt: skip
    return out


# -- back to rows ----------------------------------------------------------------------------


def _value(kind: str, v: Any) -> Any:
    """An attribute's value as the column ``kind`` holds it: native OTLP values pass, the
    strings of a ClickHouse map are parsed."""
    if kind in ("VARCHAR", "JSON"):
        return v if isinstance(v, str) else json.dumps(v)
    if isinstance(v, str):
        if kind.endswith("[]"):
            return json.loads(v)
        if kind == "BOOLEAN":
            return v == "true"
        return float(v) if kind == "DOUBLE" else int(v)
    if kind.endswith("[]"):
        return list(v)
    return v


def _column(table: str, col: str, attrs: Mapping[str, Any]) -> Any:
    v = attrs.get(PREFIX + col)
    return None if v is None else _value(TABLES[table][col], v)


class Rebuilt(NamedTuple):
    """Rows decoded from spans, by table (tuples in the store's column order)."""

    rows: dict[str, list[tuple[Any, ...]]]
    num_spans: int  # Lumen's record spans decoded
    num_other: int  # spans of Lumen that carry no row (another --otlp-detail)
    kept: set[tuple[str, str]]  # (run, request) marked lumen.sample.keep


def rows_of(spans: Iterable[tuple[Mapping[str, Any], RecordSpan]]) -> Rebuilt:
    """The store rows that (resource attributes, span) pairs carry. Spans of other services and
    Lumen spans without a record are skipped (counted); a row seen twice is kept once."""
    rows: dict[str, list[tuple[Any, ...]]] = {t: [] for t in TABLES}
    seen: set[tuple[str, str, str]] = set()
    kept: set[tuple[str, str]] = set()
    num_spans = num_other = 0
    for resource, span in spans:
        table = span.attributes.get(RECORD)
        if resource.get("service.name") != SERVICE:
            continue
        run_id = resource.get(RUN_ID)
        if table not in TABLES or not run_id:
            num_other += 1
            continue
        key = (table, span.trace_id, span.span_id)
        if key in seen:
            continue
        seen.add(key)
        num_spans += 1
        attrs = span.attributes
        if table == "requests":
            own = {"run_id": run_id, "trace_id": span.trace_id, "root_span_id": span.span_id,
                   "parent_span_id": span.parent_span_id}  # fmt: skip
            rows["requests"].append(_row("requests", attrs, own))
            request_id = _column("requests", "request_id", attrs)
            if attrs.get(KEEP):
                kept.add((run_id, request_id))
            cores = attrs.get(_CHILDREN + "core_id")
            if cores is not None:
                seqs = _value("INTEGER[]", attrs.get(_CHILDREN + "seq", "[]"))
                for core_id, seq in zip(_value("VARCHAR[]", cores), seqs):
                    rows["request_children"].append((run_id, core_id, request_id, seq))
        elif table == "span_rows":
            own = {"run_id": run_id, "trace_id": span.trace_id, "span_id": span.span_id,
                   "parent_span_id": span.parent_span_id, "name": span.name,
                   "start_ns": span.start_ns, "end_ns": span.end_ns}  # fmt: skip
            rows["span_rows"].append(_row("span_rows", attrs, own))
        else:
            rows[table].append(_row(table, attrs, {"run_id": run_id}))
    return Rebuilt(rows, num_spans, num_other, kept)


def _row(table: str, attrs: Mapping[str, Any], own: Mapping[str, Any]) -> tuple[Any, ...]:
    return tuple(own[col] if col in own else _column(table, col, attrs) for col in TABLES[table])
