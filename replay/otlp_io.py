"""A trace store to OTLP JSON and back, and any source of Lumen's store-detail spans (an OTLP
JSON file, a ClickHouse table: replay/clickhouse.py) into a new trace store.

`replay export --format otlp-json` writes what a Lumen server sends at ``--otlp-detail store``
(tracing/otlp_records.py), as the Collector's file exporter writes it; `replay import --format
otlp-json` reads such a file, the exporter's own or the Collector's, back into a store on which
`lumen trace why`, `replay report` and `replay run` work as on the original.
"""

from __future__ import annotations

import json
import os
import re
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import duckdb
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.util.instrumentation import InstrumentationScope

from engine.version import __version__
from tracing import otlp_json
from tracing.otlp import readable
from tracing.otlp_records import (
    SERVICE,
    WINDOW_NS,
    RecordSpan,
    engine_spans,
    request_record_spans,
    resource_attributes,
    rows_of,
)
from tracing.spans import ROOT
from tracing.store import latest_run, open_db, write_new
from tracing.store_schema import TABLES

BATCH = 512  # spans per line, as the Collector's batch processor sends them
TABLE_INDEX = {c: i for i, c in enumerate(TABLES["requests"])}


def store_records(con: duckdb.DuckDBPyConnection, run_id: str) -> list[RecordSpan]:
    """Every row of the run as the spans ``--otlp-detail store`` sends."""
    present = {
        (t, c)
        for t, c in con.execute(
            "SELECT table_name, column_name FROM information_schema.columns"
        ).fetchall()
    }

    def rows(table: str, order: str = "") -> list[tuple[Any, ...]]:
        if not any(t == table for t, _ in present):
            return []
        cols = ", ".join(c if (table, c) in present else "NULL" for c in TABLES[table])
        return con.execute(
            f"SELECT {cols} FROM {table} WHERE run_id = ? {order}", [run_id]
        ).fetchall()

    children: dict[str, list[tuple[Any, ...]]] = {}
    request_of: dict[str, str] = {}
    for child in rows("request_children"):
        children.setdefault(child[2], []).append(child)
        request_of[child[1]] = child[2]
    steps = rows("steps")
    i_members = list(TABLES["steps"]).index("request_ids")
    parents = [
        [request_of.get(m, m) for m in s[i_members] or ()]
        if any(m in request_of for m in s[i_members] or ()) else None
        for s in steps
    ]  # fmt: skip
    out = engine_spans(run_id, "steps", steps, parents)
    for table in ("pauses", "lifecycle"):
        out += engine_spans(run_id, table, rows(table))
    # The run's record in its own window and in every engine trace, as the server sends it.
    run = rows("runs")
    windows = {s.start_ns // WINDOW_NS: s.start_ns for s in out}
    if run:
        windows.pop(run[0][1] // WINDOW_NS, None)  # its own window has it already
    out = engine_spans(run_id, "runs", run) + out
    for at in windows.values():
        out += engine_spans(run_id, "runs", run, at_ns=at)
    roots = dict(con.execute(
        "SELECT request_id, attributes FROM spans WHERE run_id = ? AND name = ?", [run_id, ROOT]
    ).fetchall())  # fmt: skip
    stored: dict[str, list[tuple[Any, ...]]] = {}
    for span in rows("span_rows"):
        stored.setdefault(span[1], []).append(span)
    for request in rows("requests", "ORDER BY arrival_ns"):
        rid = request[1]
        root = {k: v for k, v in json.loads(roots.get(rid) or "{}").items() if v is not None}
        out += request_record_spans(request, root, stored.get(rid, ()), children.get(rid, ()))
    return out


def export_otlp_json(db: str | Path, out: str | Path, run_id: str | None = None) -> int:
    """Write the run (default: the latest) as OTLP JSON lines; returns how many spans."""
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
        found = con.execute("SELECT replica FROM runs WHERE run_id = ?", [run_id]).fetchall()
        if not found:
            raise ValueError(f"{db} has no run {run_id}")
        records = store_records(con, run_id)
    resource = Resource.create(resource_attributes(run_id, found[0][0] or ""))
    scope = InstrumentationScope("lumen.tracing", __version__)
    with _replacing(Path(out)) as tmp, tmp.open("w") as f:
        for i in range(0, len(records), BATCH):
            batch = [readable(r, resource, scope) for r in records[i : i + BATCH]]
            f.write(otlp_json.to_json(encode_spans(batch)) + "\n")
    return len(records)


class _replacing:
    """``with _replacing(path) as tmp:`` write tmp; it becomes ``path`` only if the block
    succeeds (nothing half-written is ever left at ``path``)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.tmp.unlink(missing_ok=True)
        return self.tmp

    def __exit__(self, exc_type: object, *exc: object) -> None:
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            self.tmp.unlink(missing_ok=True)
        Path(f"{self.tmp}.wal").unlink(missing_ok=True)  # DuckDB's, where a write failed


def import_records(
    spans: Iterable[tuple[dict[str, Any], RecordSpan]], out: str | Path, source: str
) -> str:
    """Write the store rows ``spans`` carry into a new trace store at ``out``; returns what was
    written, in words. Raises ValueError, writing nothing, when ``spans`` hold no store."""
    out = Path(out)
    if out.exists():
        raise ValueError(f"{out} exists: replay import writes a new trace db")
    services: Counter[str] = Counter()

    def counted() -> Iterator[tuple[dict[str, Any], RecordSpan]]:
        for resource, span in spans:
            services[str(resource.get("service.name"))] += 1
            yield resource, span

    rebuilt = rows_of(counted())
    if not services:
        raise ValueError(f"{source} holds no span")
    if not services[SERVICE]:
        found = ", ".join(f"{s} ({n})" for s, n in services.most_common(5))
        raise ValueError(f"{source} holds no span of service {SERVICE!r}, only: {found}")
    rows = rebuilt.rows
    if not rebuilt.num_spans:
        raise ValueError(f"{source} holds {services[SERVICE]} Lumen spans but no store record: "
                         "record with --otlp-detail store")  # fmt: skip
    runs = {r[0] for r in rows["runs"]}
    for table, table_rows in rows.items():
        if missing := {r[0] for r in table_rows} - runs:
            raise ValueError(f"{source}: run {sorted(missing)[0]} has {table} but no lumen.run "
                             "record (none of its engine traces was kept)")  # fmt: skip
    sampling = weigh_sampled(rows, rebuilt.kept, rebuilt.parents)
    with _replacing(out) as tmp:
        write_new(tmp, rows)
    counts = {t: len(r) for t, r in rows.items()}
    said = (f"{len(runs)} run(s), {counts['requests']} requests, {counts['steps']} steps, "
            f"{counts['pauses']} pauses, {counts['lifecycle']} lifecycle records -> "
            f"{out}")  # fmt: skip
    for run, (num_kept, num_total) in sampling.items():
        said += (f"\nrun {run}: a sampled window: {num_kept} of about {num_total} requests kept "
                 "(each kept one weighs the requests it stands for)")  # fmt: skip
        i_weight = TABLE_INDEX["sample_weight"]
        if all(r[i_weight] == 1.0 for r in rows["requests"] if r[0] == run):
            said += "; none but the failed and slow ones was kept: nothing weighs for the rest"
    return said


def weigh_sampled(
    rows: dict[str, list[tuple[Any, ...]]],
    kept: set[tuple[str, str]],
    parents: Mapping[tuple[str, str], str],
) -> dict[str, tuple[int, int]]:
    """Set ``sample_weight`` on the requests of runs that lost some to sampling; returns
    {run: (requests kept, requests in all)} for those runs.

    A run's steps name every engine request that took part in them, kept or not, and the
    request each belongs to (``parents``: the steps' ``lumen.step.request_of``). A collector
    kept every request marked ``lumen.sample.keep`` (errors, slow ones) and some share of the
    rest. Each other kept request weighs (the run's requests - the marked ones) / (the kept
    unmarked ones): percentiles over the weights estimate the whole run's. A request not kept
    counts only if its last step ended before the last kept request did (one still in flight
    at the window's end had sent no record yet, sampled or not), unless the run's drain closes
    it: a run that drained has nothing in flight."""
    i_weight = TABLE_INDEX["sample_weight"]
    steps = {c: i for i, c in enumerate(TABLES["steps"])}
    by_run: dict[str, set[str]] = {}
    horizon: dict[str, int] = {}
    for r in rows["requests"]:
        by_run.setdefault(r[0], set()).add(r[1])
        end = r[TABLE_INDEX["arrival_ns"]] + (r[TABLE_INDEX["e2e_ns"]] or 0)
        horizon[r[0]] = max(horizon.get(r[0], 0), end)
    lifecycle = {c: i for i, c in enumerate(TABLES["lifecycle"])}
    for row in rows["lifecycle"]:
        if row[lifecycle["kind"]] == "drain":
            horizon[row[0]] = 1 << 62  # every request of a drained run finished
    child = {(c[0], c[1]): c[2] for c in rows["request_children"]}
    last_end: dict[tuple[str, str], int] = {}
    for s in rows["steps"]:
        run = s[0]
        end = s[steps["output_ns"]] or s[steps["schedule_end_ns"]] or 0
        for core in s[steps["request_ids"]] or ():
            request = (parents.get((run, core)) or child.get((run, core))
                       or _parent_of(core, by_run.get(run, set())))  # fmt: skip
            last_end[run, request] = max(last_end.get((run, request), 0), end)
    weights: dict[str, float] = {}
    out = {}
    for run, requests in by_run.items():
        gone = {rid for (r, rid), end in last_end.items()
                if r == run and rid not in requests and end < horizon[run]}  # fmt: skip
        if not gone:
            continue
        marked = {rid for rid in requests if (run, rid) in kept}
        rest_kept = len(requests) - len(marked)
        total = len(requests) + len(gone)
        weights[run] = (total - len(marked)) / rest_kept if rest_kept else 1.0
        out[run] = (len(requests), total)
    rows["requests"] = [
        (*r[:i_weight], 1.0 if (r[0], r[1]) in kept else weights[r[0]], *r[i_weight + 1 :])
        if r[0] in weights else r
        for r in rows["requests"]
    ]  # fmt: skip
    return out


def _parent_of(core_id: str, requests: set[str]) -> str:
    """The request a core id belongs to where no record says: ``ID-i`` (a prompt or a sample,
    ``ID-i-j`` a prompt's sample) is ``ID``'s, as engine/request_ids.py names them."""
    if core_id in requests:
        return core_id
    m = re.fullmatch(r"(.+?-[0-9a-f]{16})(?:-[0-9]+)+", core_id)
    return m.group(1) if m else core_id


def import_otlp_json(path: str | Path, out: str | Path) -> str:
    return import_records(otlp_json.read(path), out, str(path))
