"""`replay export --format otel-jsonl`: a run's spans as one OTLP-style JSON object a line, for
other replay and analysis tools."""

from __future__ import annotations

import json
from pathlib import Path

from tracing.store import latest_run, open_db


def export_otel_jsonl(db: str, out: str | Path, run_id: str | None = None) -> int:
    """Write every span of the run (default: the latest); returns how many."""
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        rows = con.execute(
            "SELECT s.trace_id, s.span_id, s.parent_span_id, s.name, s.start_ns, s.end_ns, "
            "s.attributes, s.request_id, s.step_id FROM spans s WHERE s.run_id = ? "
            "ORDER BY s.start_ns, s.span_id",
            [run_id],
        ).fetchall()
    with Path(out).open("w") as f:
        for trace_id, span_id, parent, name, start, end, attrs, rid, step in rows:
            attributes = json.loads(attrs) if attrs else {}
            attributes["lumen.request_id"] = rid
            if step is not None:
                attributes["lumen.step_id"] = step
            f.write(json.dumps({
                "traceId": trace_id,
                "spanId": span_id,
                "parentSpanId": parent or "",
                "name": name,
                "kind": "SPAN_KIND_SERVER" if name == "llm_request" else "SPAN_KIND_INTERNAL",
                "startTimeUnixNano": str(start),
                "endTimeUnixNano": str(end),
                "attributes": attributes,
                "resource": {"service.name": "lumen", "lumen.run_id": run_id},
            }, sort_keys=True) + "\n")  # fmt: skip
    return len(rows)
