"""The trace store's rows as OTLP spans and back (DESIGN §3, ``--otlp-detail store``).

A store exported this way can be rebuilt whole from what a collector kept, so that `lumen trace
why`, `replay report` and `replay run` work on a fleet's traces as on the replica's own store:

- a request is its root span ``llm_request``, in its own trace, carrying its ``requests`` row
  (and its ``request_children``) beside the GenAI attributes every detail level sends; the
  per-sequence spans the store keeps as rows (``span_rows``) are its child spans;
- an engine step is one span ``lumen.step`` carrying its ``steps`` row, its members (the core
  request ids and their scheduled tokens) as array attributes of their own; ``lumen.pause`` and
  ``lumen.lifecycle`` carry the other engine-side rows, and ``lumen.run`` the run's row and
  engine configuration. These go in traces of their own, one per run and ``WINDOW_NS`` of time,
  so a collector that samples requests never drops a step a kept request shared.

A row travels packed, as one attribute ``lumen.row``: a JSON array of its columns in the
store's order at schema version ``lumen.schema`` (a resource attribute, with ``lumen.run_id``),
less those the span carries itself (ids, names, times): a step is one compact span, not forty
attributes (the keys alone would cost more than the values). The table is ``lumen.record``.
Readers need only these; dashboards read the readable GenAI attributes. A failed request's root
has status ERROR and ``lumen.sample.keep=error``, a slow one's ``lumen.sample.keep=slow``: the
requests a collector's tail sampling keeps whatever its share of the rest (dashboards/otel),
so that an import can weigh the rest by what they stand for. Decoding is typed by the
store's schema (tracing/store_schema.py); arrays and the packed row arrive as native OTLP
values or as the JSON text a ClickHouse ``Map(String, String)`` keeps them as.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

import msgspec

from tracing.spans import ROOT
from tracing.store_schema import SCHEMA_VERSION, TABLES, columns_at

ROW = "lumen.row"  # the packed row: a JSON array
RECORD = "lumen.record"
# On a request's root: why a collector's tail sampling must keep its trace (error | slow).
KEEP = "lumen.sample.keep"
KEEP_SLOWER_THAN_S = 5.0
RUN_ID = "lumen.run_id"  # resource attributes
SCHEMA = "lumen.schema"
SERVICE = "lumen"
WINDOW_NS = 10 * 10**9  # one engine trace per run and 10 s
# The engine-side tables and the span that carries each of their rows: (name, start, end).
ENGINE_RECORDS = {
    "runs": ("lumen.run", "started_ns", "started_ns"),
    "steps": ("lumen.step", "schedule_start_ns", "output_ns"),
    "pauses": ("lumen.pause", "start_ns", "duration_ns"),
    "lifecycle": ("lumen.lifecycle", "start_ns", "end_ns"),
}
# Columns a span carries in its own fields (or its resource), not in the packed row; and
# columns that travel as array attributes of their own, readable where the spans are stored.
_OWN = {
    "requests": ("run_id", "trace_id", "root_span_id", "parent_span_id"),
    "span_rows": ("run_id", "trace_id", "span_id", "parent_span_id", "name", "start_ns",
                  "end_ns"),
}  # fmt: skip
_APART = {"steps": ("request_ids", "num_scheduled", "preempted_request_ids")}
_MEMBER = "lumen.step."  # + request_ids, num_scheduled, preempted_request_ids
# On a step: the request each member (a core id) belongs to, where one differs from its id
# (prompts of a completion, samples of n > 1), so an import can count requests it did not keep.
REQUEST_OF = "lumen.step.request_of"
CHILDREN = "lumen.children"  # request_children on the root: [[core id, seq], ...]
_encode = msgspec.json.encode


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
    attrs: dict[str, Any] = {"service.name": SERVICE, RUN_ID: run_id, SCHEMA: SCHEMA_VERSION}
    if replica:
        attrs["service.instance.id"] = replica
    return attrs


def _hex(text: str, size: int) -> str:
    return hashlib.blake2b(text.encode(), digest_size=size).hexdigest()


def window_trace_id(run_id: str, ns: int) -> str:
    """The engine trace of ``run_id`` that holds the instant ``ns``."""
    return _hex(f"{run_id}/{ns // WINDOW_NS}", 16)


def _packed(table: str, row: tuple[Any, ...]) -> dict[str, Any]:
    """The row's attributes: the packed row, and its columns that travel apart."""
    skip, apart = _OWN.get(table, ("run_id",)), _APART.get(table, ())
    values = []
    attrs: dict[str, Any] = {RECORD: table}
    for col, v in zip(TABLES[table], row):
        if col in apart:
            if v is not None:
                attrs[_MEMBER + col] = list(v)
        elif col not in skip:
            values.append(v)
    attrs[ROW] = _encode(values).decode()
    return attrs


def engine_spans(
    run_id: str,
    table: str,
    rows: Iterable[tuple[Any, ...]],
    request_of: Sequence[Sequence[str] | None] = (),
    *,
    at_ns: int | None = None,
) -> list[RecordSpan]:
    """Spans of rows of runs, steps, pauses or lifecycle (run_id is the resource's);
    ``request_of``: per step, its members' requests (or None: each is its own); ``at_ns``:
    a run record sent again into the engine trace of that instant (every window has one)."""
    name, start_col, end_col = ENGINE_RECORDS[table]
    cols = list(TABLES[table])
    i_start, i_end = cols.index(start_col), cols.index(end_col)
    out = []
    for i, row in enumerate(rows):
        start = row[i_start] or 0
        end = row[i_end] or start
        if table == "pauses":
            end = start + end
        elif table == "steps" and not row[i_end]:  # no output: ends with its schedule
            end = row[cols.index("schedule_end_ns")] or start
        span_id = _hex(f"{run_id}/{table}/{row[1]}/{start}", 8)
        attrs = _packed(table, row)
        if i < len(request_of) and (parents := request_of[i]) is not None:
            attrs[REQUEST_OF] = list(parents)
        trace = window_trace_id(run_id, start if at_ns is None else at_ns)
        out.append(RecordSpan(trace, span_id, None, name, start, max(start, end), attrs))
    return out


def request_record_spans(
    request: tuple[Any, ...],
    root_attributes: Mapping[str, Any],
    span_rows: Iterable[tuple[Any, ...]] = (),
    children: Iterable[tuple[Any, ...]] = (),
    *,
    slow_ns: int = int(KEEP_SLOWER_THAN_S * 1e9),
) -> list[RecordSpan]:
    """The request's root span (its row packed beside ``root_attributes``, the GenAI ones) and
    its stored per-sequence spans; ``slow_ns``: from this e2e on it is marked to be kept."""
    r = dict(zip(TABLES["requests"], request))
    attrs = dict(root_attributes)
    attrs.update(_packed("requests", request))
    if kids := sorted((c[1], c[3]) for c in children):
        attrs[CHILDREN] = _encode(kids).decode()
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
        out.append(RecordSpan(span["trace_id"], span["span_id"], span["parent_span_id"],
                              span["name"], span["start_ns"], span["end_ns"],
                              _packed("span_rows", s)))  # fmt: skip
    return out


# -- back to rows ----------------------------------------------------------------------------


def _json(v: Any) -> Any:
    """An array or packed value: native (OTLP) or the JSON text ClickHouse keeps."""
    return json.loads(v) if isinstance(v, str) else v


def _typed(kind: str, v: Any) -> Any:
    if v is None:
        return None
    if kind == "JSON":
        return v if isinstance(v, str) else json.dumps(v)
    if kind.endswith("[]"):
        return list(_json(v))
    return v


class Rebuilt(NamedTuple):
    """Rows decoded from spans, by table (tuples in the store's column order)."""

    rows: dict[str, list[tuple[Any, ...]]]
    num_spans: int  # Lumen's record spans decoded
    num_other: int  # spans of Lumen that carry no row (another --otlp-detail)
    kept: set[tuple[str, str]]  # (run, request) marked lumen.sample.keep
    parents: dict[tuple[str, str], str]  # (run, core id) -> its request, from the steps


def rows_of(spans: Iterable[tuple[Mapping[str, Any], RecordSpan]]) -> Rebuilt:
    """The store rows that (resource attributes, span) pairs carry. Spans of other services and
    Lumen spans without a record are skipped (counted); a row seen twice is kept once. A
    ValueError says what is wrong with a record that cannot be read."""
    rows: dict[str, list[tuple[Any, ...]]] = {t: [] for t in TABLES}
    seen: set[tuple[str, str, str]] = set()
    kept: set[tuple[str, str]] = set()
    parents: dict[tuple[str, str], str] = {}
    num_spans = num_other = 0
    for resource, span in spans:
        if resource.get("service.name") != SERVICE:
            continue
        attrs = span.attributes
        table, run_id = attrs.get(RECORD), resource.get(RUN_ID)
        if table not in TABLES or not run_id or ROW not in attrs:
            num_other += 1
            continue
        # A run record comes again in each engine trace: one row per run.
        key = (table, run_id, "") if table == "runs" else (table, span.trace_id, span.span_id)
        if key in seen:
            continue
        seen.add(key)
        num_spans += 1
        try:
            version = int(resource.get(SCHEMA, SCHEMA_VERSION))
        except (TypeError, ValueError):
            raise ValueError(f"run {run_id}: lumen.schema is not a number: "
                             f"{resource.get(SCHEMA)!r}") from None  # fmt: skip
        if version > SCHEMA_VERSION:
            raise ValueError(f"run {run_id} was recorded by a newer Lumen (trace store schema "
                             f"{version}; this one reads up to {SCHEMA_VERSION})")  # fmt: skip
        own: dict[str, Any] = {"run_id": run_id}
        if table == "requests":
            own.update(trace_id=span.trace_id, root_span_id=span.span_id,
                       parent_span_id=span.parent_span_id)  # fmt: skip
        elif table == "span_rows":
            own.update(trace_id=span.trace_id, span_id=span.span_id,
                       parent_span_id=span.parent_span_id, name=span.name,
                       start_ns=span.start_ns, end_ns=span.end_ns)  # fmt: skip
        for col in _APART.get(table, ()):
            own[col] = attrs.get(_MEMBER + col)
        try:
            row = _row(table, version, _json(attrs[ROW]), own, span)
            if REQUEST_OF in attrs:
                members = _json(attrs.get(_MEMBER + "request_ids", "[]"))
                for core, request in zip(members, _json(attrs[REQUEST_OF])):
                    parents[run_id, core] = request
            children = _json(attrs.get(CHILDREN, "[]"))
            kids = [(str(core_id), int(seq)) for core_id, seq in children]
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise ValueError(f"span {span.span_id} ({span.name}, run {run_id}): its "
                             f"{table} record cannot be read: {e}") from None  # fmt: skip
        rows[table].append(row)
        if table == "requests":
            request_id = row[1]
            if attrs.get(KEEP):
                kept.add((run_id, request_id))
            for core_id, seq in kids:
                rows["request_children"].append((run_id, core_id, request_id, seq))
    return Rebuilt(rows, num_spans, num_other, kept, parents)


def _row(
    table: str, version: int, packed: list[Any], own: Mapping[str, Any], span: RecordSpan
) -> tuple[Any, ...]:
    names = [c for c in columns_at(table, version) if c not in own]
    if len(packed) != len(names):
        raise ValueError(f"span {span.span_id} ({span.name}): its {table} row has "
                         f"{len(packed)} values, schema {version} has {len(names)}")  # fmt: skip
    values = dict(zip(names, packed))
    kinds = TABLES[table]
    return tuple(_typed(kinds[c], own[c] if c in own else values.get(c)) for c in TABLES[table])
