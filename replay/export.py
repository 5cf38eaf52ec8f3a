"""`replay export`: a run's spans for other tools, as OTLP-style JSON lines (otel-jsonl), as a
Chrome trace-event file that ui.perfetto.dev and chrome://tracing open (perfetto), or as OTLP
JSON that `replay import` rebuilds the store from (otlp-json: replay/otlp_io.py)."""

from __future__ import annotations

import heapq
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb

from tracing.spans import BOUNDARIES, ROOT
from tracing.store import latest_run, open_db

# Tracks of the perfetto export, top to bottom; span names not listed follow, sorted.
BOUNDARY_TRACKS = (ROOT, *BOUNDARIES)
STEP_TRACK = "engine steps"
# A step's slice is named by its kind, not its id: Perfetto colours slices by name.
STEP_KINDS = {(True, True): "prefill + decode", (True, False): "prefill", (False, True): "decode",
              (False, False): "idle"}  # fmt: skip
PID = 1  # one process: the run


def export(db: str | Path, out: str | Path, fmt: str, run_id: str | None = None) -> str:
    """Write the run (default: the latest) in ``fmt``; returns what was written, in words."""
    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {', '.join(FORMATS)}, not {fmt!r}")
    return FORMATS[fmt](db, out, run_id)


def export_otel_jsonl(db: str | Path, out: str | Path, run_id: str | None = None) -> int:
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


def export_perfetto(db: str | Path, out: str | Path, run_id: str | None = None) -> int:
    """Write the run as Chrome trace events (ts and dur in microseconds from the run's first
    recorded instant); returns how many events.

    A track (thread) shows slices that nest or follow each other, so where requests overlap a
    boundary's spans are spread over as many lanes ("core.queue", "core.queue #2", ...) as were
    in it at once. Engine steps are one track, with counters of running, waiting and KV blocks.
    """
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        spans = con.execute(
            "SELECT name, start_ns, end_ns, request_id, step_id FROM spans WHERE run_id = ? "
            "ORDER BY start_ns, end_ns DESC",
            [run_id],
        ).fetchall()
        steps = con.execute(
            "SELECT step_id, schedule_start_ns, coalesce(output_ns, schedule_end_ns), "
            "num_prefill_tokens, num_decode_tokens, num_running, num_waiting, kv_blocks_used, "
            "kv_blocks_total, num_preemptions FROM steps WHERE run_id = ? "
            "ORDER BY schedule_start_ns",
            [run_id],
        ).fetchall()
        pauses = _pauses(con, run_id)
        [(first_arrival,)] = con.execute(
            "SELECT min(arrival_ns) FROM requests WHERE run_id = ?", [run_id]
        ).fetchall()
    starts = [s[1] for s in spans] + [s[1] for s in steps] + [p[2] for p in pauses]
    if first_arrival is not None:
        starts.append(first_arrival)
    if not starts:
        raise ValueError(f"run {run_id} has no span, step or pause to export")
    t0 = min(starts)

    def us(ns: int) -> float:
        return round((ns - t0) / 1000, 3)

    tracks = _Tracks()
    events: list[dict[str, Any]] = []
    order = {name: i for i, name in enumerate(BOUNDARY_TRACKS)}
    for name, start, end, rid, step in sorted(spans, key=lambda s: (order.get(s[0], 99), s[0])):
        args = {"request_id": rid} if step is None else {"request_id": rid, "step_id": step}
        tid = tracks.place(name, start, end)
        events.append(_slice(name, tid, us(start), (end - start) / 1000, args))
    for step_id, start, end, prefill, decode, running, waiting, used, total, preempt in steps:
        end = max(end or start, start)
        args = {"step_id": step_id, "prefill_tokens": prefill, "decode_tokens": decode,
                "running": running, "waiting": waiting, "kv_blocks_used": used,
                "kv_blocks_total": total, "preemptions": preempt}  # fmt: skip
        name = STEP_KINDS[prefill > 0, decode > 0]
        tid = tracks.place(STEP_TRACK, start, end)
        events.append(_slice(name, tid, us(start), (end - start) / 1000, args))
        events.append(_counter("requests", us(start), {"running": running, "waiting": waiting}))
        events.append(_counter("KV blocks", us(start), {"used": used}))
    for process, kind, start, duration in pauses:
        tid = tracks.place(f"pauses: {process}", start, start + duration)
        events.append(_slice(kind, tid, us(start), duration / 1000, {"process": process}))
    meta = [_meta("process_name", 0, {"name": f"lumen run {run_id}"})]
    for tid, track in tracks.names.items():
        meta.append(_meta("thread_name", tid, {"name": track}))
        meta.append(_meta("thread_sort_index", tid, {"sort_index": tid}))
    with Path(out).open("w") as f:
        json.dump({"traceEvents": meta + events, "displayTimeUnit": "ms",
                   "otherData": {"run_id": run_id, "t0_unix_ns": t0}}, f)  # fmt: skip
    return len(events)


class _Tracks:
    """Lanes (thread ids) per track, so no two slices on one lane overlap without nesting."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self._lanes: dict[str, list[int]] = {}  # track -> its tids, in lane order
        self._busy: dict[str, list[tuple[int, int]]] = {}  # track -> heap of (end_ns, lane)
        self._free: dict[str, list[int]] = {}  # track -> heap of free lanes

    def place(self, track: str, start: int, end: int) -> int:
        """The lowest free lane of ``track`` at ``start``; call in order of start."""
        busy = self._busy.setdefault(track, [])
        free = self._free.setdefault(track, [])
        while busy and busy[0][0] <= start:
            heapq.heappush(free, heapq.heappop(busy)[1])
        lanes = self._lanes.setdefault(track, [])
        if free:
            lane = heapq.heappop(free)
        else:
            lane = len(lanes)
            lanes.append(self._new_tid(track if lane == 0 else f"{track} #{lane + 1}"))
        heapq.heappush(busy, (max(end, start), lane))
        return lanes[lane]

    def _new_tid(self, name: str) -> int:
        tid = len(self.names) + 1
        self.names[tid] = name
        return tid


def _pauses(con: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[str, str, int, int]]:
    # Older trace dbs (before migration 2) have no pauses table.
    [(exists,)] = con.execute(
        "SELECT count(*) FROM information_schema.tables WHERE table_name = 'pauses'"
    ).fetchall()
    if not exists:
        return []
    return con.execute(
        "SELECT process, kind, start_ns, duration_ns FROM pauses WHERE run_id = ? "
        "ORDER BY start_ns",
        [run_id],
    ).fetchall()


def _slice(name: str, tid: int, ts: float, dur: float, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "X", "pid": PID, "tid": tid, "ts": ts, "dur": round(dur, 3),
            "args": args}  # fmt: skip


def _counter(name: str, ts: float, values: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "C", "pid": PID, "tid": 0, "ts": ts, "args": values}


def _meta(name: str, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": PID, "tid": tid, "args": args}


def _describe(count: Callable[..., int], what: str) -> Callable[..., str]:
    return lambda db, out, run_id: f"{count(db, out, run_id)} {what} -> {out}"


def export_otlp_json(db: str | Path, out: str | Path, run_id: str | None = None) -> int:
    from replay.otlp_io import export_otlp_json as export  # loads the OTLP SDK

    return export(db, out, run_id)


FORMATS: dict[str, Callable[[str | Path, str | Path, str | None], str]] = {
    "otlp-json": _describe(export_otlp_json, "spans"),
    "otel-jsonl": _describe(export_otel_jsonl, "spans"),
    "perfetto": _describe(export_perfetto, "trace events"),
}
