"""OTLP JSON files as the OpenTelemetry Collector's ``file`` exporter writes them: one
``ExportTraceServiceRequest`` per line (``{"resourceSpans": [{"resource": …, "scopeSpans":
[{"scope": …, "spans": […]}]}]}``), in the OTLP/JSON encoding: trace and span ids as lowercase
hex (not protobuf JSON's base64), enums as integers, 64-bit integers as strings.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from tracing.otlp_records import RecordSpan

_IDS = ("traceId", "spanId", "parentSpanId")


def _spans_of(doc: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for rs in doc.get("resourceSpans", ()):
        for ss in rs.get("scopeSpans", ()):
            for span in ss.get("spans", ()):
                yield span
                yield from span.get("links", ())


def to_json(request: ExportTraceServiceRequest) -> str:
    """One line of the file."""
    doc = json_format.MessageToDict(request, use_integers_for_enums=True)
    for item in _spans_of(doc):
        for key in _IDS:
            if key in item:
                item[key] = base64.b64decode(item[key]).hex()
    return json.dumps(doc, separators=(",", ":"))


def from_json(doc: dict[str, Any]) -> ExportTraceServiceRequest:
    for item in _spans_of(doc):
        for key in _IDS:
            if item.get(key):
                item[key] = base64.b64encode(bytes.fromhex(item[key])).decode()
    request = ExportTraceServiceRequest()
    json_format.ParseDict(doc, request, ignore_unknown_fields=True)
    return request


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in v.kvlist_value.values}
    return getattr(v, kind) if kind else None


def decode(request: ExportTraceServiceRequest) -> Iterator[tuple[dict[str, Any], RecordSpan]]:
    """(resource attributes, span) for every span of the request."""
    for rs in request.resource_spans:
        resource = {a.key: _value(a.value) for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                error = s.status.message or "error" if s.status.code == 2 else None
                yield resource, RecordSpan(
                    s.trace_id.hex(), s.span_id.hex(), s.parent_span_id.hex() or None, s.name,
                    s.start_time_unix_nano, s.end_time_unix_nano,
                    {a.key: _value(a.value) for a in s.attributes}, error,
                )  # fmt: skip


def read(path: str | Path) -> Iterator[tuple[dict[str, Any], RecordSpan]]:
    """The spans of an OTLP JSON file: JSON lines (the Collector's file exporter), or one JSON
    document (an OTLP/HTTP JSON body). A line that is not an OTLP request is a ValueError that
    names it."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no OTLP JSON file at {path}")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not OTLP JSON (not UTF-8 text)") from None
    try:
        docs = [(1, json.loads(text))]
    except json.JSONDecodeError:
        docs = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                docs.append((number, json.loads(line)))
            except json.JSONDecodeError as e:
                last = number == len(text.splitlines())
                why = "cut short (a truncated file?)" if last else f"not JSON ({e.msg})"
                raise ValueError(f"{path}, line {number}: {why}") from None
    for number, doc in docs:
        if not isinstance(doc, dict) or not isinstance(doc.get("resourceSpans"), list):
            raise ValueError(f"{path}, line {number}: not an OTLP traces request "
                             "(no resourceSpans list)")  # fmt: skip
        try:
            request = from_json(doc)
        except (json_format.ParseError, ValueError, TypeError, AttributeError) as e:
            raise ValueError(f"{path}, line {number}: not OTLP JSON ({e})") from None
        yield from decode(request)
