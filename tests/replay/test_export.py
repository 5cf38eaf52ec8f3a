"""`replay export`: Chrome trace-event JSON for Perfetto, OTLP-style JSON lines, clean errors."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import duckdb
import pytest

from replay.cli import main
from replay.export import BOUNDARY_TRACKS, STEP_TRACK
from tests.helpers.trace_db import MS, REQUESTS, STEPS, build_trace_db


def _perfetto(tmp_path: Path, db: Path) -> dict:
    out = tmp_path / "trace.json"
    assert main(["export", str(db), "--format", "perfetto", "--out", str(out)]) == 0
    return json.loads(out.read_text())


def _tracks(events: list[dict]) -> dict[int, str]:
    """tid -> track name, a lane's "#n" suffix dropped."""
    return {
        e["tid"]: re.sub(r" #\d+$", "", e["args"]["name"])
        for e in events
        if e["ph"] == "M" and e["name"] == "thread_name"
    }


def test_perfetto_has_boundary_step_and_pause_tracks(tmp_path: Path) -> None:
    trace = _perfetto(tmp_path, build_trace_db(tmp_path / "t.db"))
    events = trace["traceEvents"]
    tracks = _tracks(events)
    slices = [e for e in events if e["ph"] == "X"]
    by_track = defaultdict(list)
    for e in slices:
        by_track[tracks[e["tid"]]].append(e)
    # Every boundary a request crossed has its track, each request's spans on it.
    for name in BOUNDARY_TRACKS:
        assert {e["args"]["request_id"] for e in by_track[name]} == set(REQUESTS), name
    execute = by_track["worker.execute"]
    assert len(execute) == sum(len(s[6]) for s in STEPS)
    assert all("step_id" in e["args"] for e in execute)
    # One slice per engine step, with the batch's facts.
    steps = sorted(by_track[STEP_TRACK], key=lambda e: e["ts"])
    assert [e["args"]["step_id"] for e in steps] == [s[0] for s in STEPS]
    assert steps[0]["args"]["prefill_tokens"] == 4000 and steps[0]["args"]["waiting"] == 2
    assert steps[0]["name"] == "prefill" and steps[1]["name"] == "prefill + decode"
    assert {e["name"] for e in by_track["pauses: core"]} == {"gc"}
    assert {e["name"] for e in by_track["pauses: api"]} == {"loop_lag"}
    counters = [e for e in events if e["ph"] == "C"]
    assert {e["name"] for e in counters} == {"requests", "KV blocks"}
    assert {"running", "waiting"} <= set(counters[0]["args"])
    assert any(e["name"] == "process_name" for e in events)


def test_perfetto_times_are_microseconds_from_the_run_start(tmp_path: Path) -> None:
    events = _perfetto(tmp_path, build_trace_db(tmp_path / "t.db"))["traceEvents"]
    timed = [e for e in events if e["ph"] in ("X", "C")]
    assert min(e["ts"] for e in timed) == 0
    last_step_ms = STEPS[-1][1]
    assert last_step_ms * 1000 <= max(e["ts"] for e in timed) < (last_step_ms + 100) * 1000
    tracks = _tracks(events)
    long_execute = [
        e for e in events
        if e["ph"] == "X" and tracks[e["tid"]] == "worker.execute" and e["args"]["step_id"] == 0
    ]  # fmt: skip
    assert [e["dur"] for e in long_execute] == [400 * MS / 1000]  # the 400 ms prefill step


def test_perfetto_slices_on_one_track_nest_or_follow(tmp_path: Path) -> None:
    """Overlapping requests go to separate lanes: a viewer draws each lane's slices as a stack."""
    events = _perfetto(tmp_path, build_trace_db(tmp_path / "t.db"))["traceEvents"]
    lanes = defaultdict(list)
    for e in events:
        if e["ph"] == "X":
            lanes[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    assert any(len(v) > 1 for v in lanes.values())
    for spans in lanes.values():
        spans.sort(key=lambda s: (s[0], -s[1]))
        open_ends: list[float] = []
        for start, end in spans:
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], spans  # inside, not across
            open_ends.append(end)


def test_perfetto_reads_a_db_without_pauses(tmp_path: Path) -> None:
    db = build_trace_db(tmp_path / "t.db", with_pauses=False)
    con = duckdb.connect(str(db))
    con.execute("DROP TABLE pauses")  # as in a trace db from before migration 2
    con.close()
    tracks = set(_tracks(_perfetto(tmp_path, db)["traceEvents"]).values())
    assert STEP_TRACK in tracks and not any(t.startswith("pauses") for t in tracks)


def test_otel_jsonl_still_one_span_a_line(tmp_path: Path) -> None:
    db = build_trace_db(tmp_path / "t.db")
    out = tmp_path / "spans.jsonl"
    assert main(["export", str(db), "--out", str(out)]) == 0
    spans = [json.loads(line) for line in out.read_text().splitlines()]
    with duckdb.connect(str(db), read_only=True) as con:
        [(num_spans,)] = con.execute("SELECT count(*) FROM spans").fetchall()
    assert len(spans) == num_spans
    assert {s["attributes"]["lumen.request_id"] for s in spans} == set(REQUESTS)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--format", "svg"], "--format must be one of otlp-json, otel-jsonl, perfetto, not 'svg'"),
        (["--format", "perfetto", "--run", "nope"], "run nope has no span, step or pause"),
    ],
)
def test_user_errors_are_one_line(tmp_path: Path, capsys, args: list[str], message: str) -> None:
    db = build_trace_db(tmp_path / "t.db")
    assert main(["export", str(db), *args, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and "Traceback" not in err


def test_a_missing_db_is_one_line(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "missing.db"
    assert main(["export", str(missing), "--format", "perfetto", "--out", "x.json"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"replay: error: no trace db at {missing}"
