"""The DuckDB trace store: migrations, batched appends, and a reader in another process."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.messages import EngineInfo
from tests.helpers.load import wait_until
from tracing import recorder
from tracing.config import TracingConfig
from tracing.events import Pause
from tracing.store import (
    MERGE_EVERY,
    CorruptStore,
    TraceStore,
    compact,
    open_db,
    write_new,
)
from tracing.store_migrations import MIGRATIONS
from tracing.store_schema import TABLES

HOLD = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1], read_only=True)
print("open", flush=True)
time.sleep(float(sys.argv[2]))
"""

# Flushes 3,000 span rows at a time, for ever (until killed), saying so after each.
FLUSH_FOREVER = """
import sys
from tracing.store import TraceStore
store = TraceStore(sys.argv[1])
while True:
    store.add("span_rows", [("run", f"r{i}", "t" * 32, f"{i:016x}", None, "llm_request", i, i + 1,
                             None, "{}") for i in range(3000)])
    store.flush()
    print("flushed", flush=True)
"""


def _span(i: int) -> tuple:
    return ("run", f"r{i}", "t" * 32, f"{i:016x}", None, "llm_request", i, i + 1, None, "{}")


def test_migrations_run_once(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    TraceStore(db)
    TraceStore(db)
    with open_db(db) as con:
        versions = con.execute("SELECT version FROM schema_migrations").fetchall()
        tables = {
            t for (t,) in con.execute("SELECT table_name FROM information_schema.tables").fetchall()
        }
    assert versions == [(v,) for v, _, _ in MIGRATIONS]
    assert {"runs", "requests", "spans", "steps"} <= tables


def test_an_old_file_migrates_and_keeps_its_spans(tmp_path: Path) -> None:
    """A store written before migration 3 (spans a table) opens at the latest version: its span
    rows are in the spans view, alongside what a new run writes."""
    import duckdb

    db = tmp_path / "old.db"
    con = duckdb.connect(str(db))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_ns BIGINT)")
    for version, name, apply in MIGRATIONS[:2]:
        apply(con)
        con.execute("INSERT INTO schema_migrations VALUES (?, ?, 0)", [version, name])
    con.executemany("INSERT INTO spans VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    [_span(i) for i in range(3)])  # fmt: skip
    con.close()
    TraceStore(db)
    with open_db(db) as con:
        latest = MIGRATIONS[-1][0]
        assert con.execute("SELECT max(version) FROM schema_migrations").fetchone() == (latest,)
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (3,)
        kind = con.execute(
            "SELECT table_type FROM information_schema.tables WHERE table_name = 'spans'"
        ).fetchone()
    assert kind == ("VIEW",)


@pytest.mark.serial  # a deadline: the busy flush gives up within 1 s
def test_a_reader_in_another_process_defers_a_flush_without_losing_rows(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    store = TraceStore(db)
    store.add("span_rows", [_span(i) for i in range(100)])
    reader = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(db), "1.5"], stdout=subprocess.PIPE, text=True
    )
    assert reader.stdout.readline().strip() == "open"
    start = time.monotonic()
    assert store.flush() is False  # the file is busy: the rows wait
    print(f"\nbusy flush gave up after {(time.monotonic() - start) * 1000:.0f} ms")
    assert time.monotonic() - start < 1.0
    reader.wait()
    store.add("span_rows", [_span(i) for i in range(100, 150)])
    assert store.flush() is True
    with open_db(db) as con:
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (150,)
    assert store.num_failed_flushes == 1 and store.num_dropped_rows == 0


def test_a_full_buffer_drops_and_counts(tmp_path: Path) -> None:
    store = TraceStore(tmp_path / "t.db", max_buffered_rows=10)
    store.add("span_rows", [_span(i) for i in range(8)])
    store.add("span_rows", [_span(i) for i in range(8, 16)])  # would overflow: dropped whole
    assert store.num_dropped_rows == 8
    assert store.flush()
    with open_db(tmp_path / "t.db") as con:
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (8,)


def _num_threads() -> int:
    return len(os.listdir(f"/proc/{os.getpid()}/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_the_writer_starts_no_duckdb_threads(tmp_path: Path) -> None:
    """A DuckDB database starts 8 async I/O threads (for remote files) that idle for ever; the
    writer's connection starts none, so a traced API process keeps the threads it had."""
    warm = TraceStore(tmp_path / "warm.db")  # pyarrow's own threads start at its first flush
    warm.add("span_rows", [_span(0)])
    assert warm.flush()
    warm.close()
    before = _num_threads()
    store = TraceStore(tmp_path / "t.db")
    store.add("span_rows", [_span(i) for i in range(8)])
    assert store.flush()
    during = _num_threads()
    store.close()
    print(f"\nthreads: {before} before the store, {during} with it open")
    assert during <= before  # (another test's thread may have ended meanwhile)


@pytest.mark.serial  # a wait measured on the wall clock
def test_readers_wait_for_a_flush_to_release_the_file(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    TraceStore(db)
    writer = subprocess.Popen(
        [sys.executable, "-c", HOLD.replace("read_only=True", "read_only=False"), str(db), "0.5"],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert writer.stdout.readline().strip() == "open"
    start = time.monotonic()
    with open_db(db, timeout=10) as con:
        waited = time.monotonic() - start
        assert con.execute("SELECT count(*) FROM requests").fetchone() == (0,)
    writer.wait()
    print(f"\nreader waited {waited * 1000:.0f} ms for the writer")
    assert waited >= 0.2


def test_a_kill_9_at_any_moment_leaves_whole_flushes(tmp_path: Path) -> None:
    """A flush commits by checkpointing the file, without a WAL: a writer killed at a random
    moment leaves every flush whole or absent. One window is DuckDB's: its checkpoint rewrites
    a metadata block in place, and a kill inside that write can tear it (rare: none in 440
    kills of a writer that only flushes, once in a run of the suite). The reader is then told
    the file is corrupt, and the next writer sets it aside and records into a new one."""
    db = tmp_path / "t.db"
    rng = random.Random(7)
    counts: list[int | None] = []
    for _ in range(8):
        writer = subprocess.Popen(
            [sys.executable, "-c", FLUSH_FOREVER, str(db)], stdout=subprocess.PIPE, text=True,
            cwd=Path(__file__).parents[2],
        )  # fmt: skip
        assert writer.stdout is not None and writer.stdout.readline().strip() == "flushed"
        time.sleep(rng.uniform(0.0, 0.1))  # ~10 ms a flush: killed at any point of one
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
        try:
            with open_db(db) as con:
                counts.append(con.execute("SELECT count(*) FROM span_rows").fetchone()[0])
        except CorruptStore:
            counts.append(None)
    torn = counts[:-1].count(None)  # each set aside by the writer after it
    print(f"\nrows after each kill (None: torn): {counts}")
    assert all(n is None or n % 3000 == 0 for n in counts) and any(counts)
    aside = [p for p in tmp_path.glob("t.db.corrupt-*") if p.suffix != ".wal"]  # its WAL too
    assert len(aside) == torn


def test_a_torn_store_is_named_to_readers_and_set_aside_by_the_writer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    """A store with a torn block (what a kill inside DuckDB's in-place metadata write leaves):
    readers get one clear line, not a traceback; the next writer keeps the file under another
    name, byte for byte, and records into a new one."""
    from service.cli import main

    db = tmp_path / "t.db"
    store = TraceStore(db)
    store.add("span_rows", [_span(i) for i in range(3000)])
    assert store.flush()
    store.close()
    with open(db, "r+b") as f:  # the first block after the headers: metadata, read at open
        f.seek(3 * 4096 + 1000)
        f.write(b"\xff" * 64)
    torn = db.read_bytes()
    with pytest.raises(CorruptStore, match="corrupt"), open_db(db):
        pass
    assert main(["trace", "top", "--db", str(db)]) == 2
    err = capsys.readouterr().err
    print(err)
    assert err.startswith("lumen: error: a trace db is corrupt") and "set" in err
    whole = tmp_path / "whole.db"
    TraceStore(whole).close()
    with pytest.raises(CorruptStore, match="corrupt"), open_db([whole, db]):  # as a fleet
        pass
    with caplog.at_level(logging.ERROR, logger="tracing.store"):
        store = TraceStore(db)
    (aside,) = tmp_path.glob("t.db.corrupt-*")
    assert aside.read_bytes() == torn and aside.name in caplog.text
    store.add("span_rows", [_span(i) for i in range(10)])
    assert store.flush()
    with open_db(db) as con:
        assert con.execute("SELECT count(*) FROM span_rows").fetchone() == (10,)


def test_a_file_of_mostly_free_blocks_is_compacted_at_close(tmp_path: Path) -> None:
    """Many small flushes, merged at the MERGE_EVERY-th, leave the blocks the merge rewrote
    free; close rewrites such a file into a fresh one with the same rows, schema and spans
    view."""
    db = tmp_path / "t.db"
    store = TraceStore(db)
    for flush in range(40):
        store.add("span_rows", [_span(i) for i in range(flush * 500, (flush + 1) * 500)])
        assert store.flush()
    with open_db(db) as con:
        total, free = con.execute(
            "SELECT total_blocks, free_blocks FROM pragma_database_size()"
        ).fetchone()  # fmt: skip
    before = db.stat().st_size
    store.close()
    after = db.stat().st_size
    print(f"\n{total} blocks, {free} free: {before:,} bytes before close, {after:,} after")
    assert free >= 0.25 * total and after < before
    with open_db(db) as con:
        assert con.execute("SELECT count(*), max(start_ns) FROM spans").fetchone() == (
            20_000,
            19_999,
        )
        versions = con.execute("SELECT version FROM schema_migrations").fetchall()
    assert versions == [(v,) for v, _, _ in MIGRATIONS]
    store = TraceStore(db)  # it opens and appends as before
    store.add("span_rows", [_span(20_000)])
    assert store.flush()
    store.close()
    with open_db(db) as con:
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (20_001,)


def test_flushes_leave_earlier_rows_in_place_until_a_merge(tmp_path: Path) -> None:
    """Each flush's rows are a row group of their own, which later flushes leave as they are;
    every MERGE_EVERY-th flush, and the writer's last, merge them (DuckDB's checkpoint, left to
    merge at every flush, rewrote the recent ones again and again)."""
    db = tmp_path / "t.db"
    store = TraceStore(db)
    spans = iter(range(10**6))

    def flush(*, last: bool = False) -> int:
        store.add("span_rows", [_span(next(spans)) for _ in range(300)])
        assert store.flush(last=last)
        with open_db(db) as con:
            return con.execute(
                "SELECT count(DISTINCT row_group_id) FROM pragma_storage_info('span_rows')"
            ).fetchone()[0]  # fmt: skip

    assert [flush() for _ in range(5)] == [1, 2, 3, 4, 5]
    assert flush(last=True) == 1  # the writer's last: merged
    groups = [flush() for _ in range(MERGE_EVERY)]
    assert groups[:3] == [2, 3, 4] and groups[-1] == 1, groups  # merged at the MERGE_EVERY-th
    with open_db(db) as con:
        assert con.execute("SELECT count(*), count(DISTINCT span_id) FROM spans").fetchone() == (
            300 * (MERGE_EVERY + 6),
            300 * (MERGE_EVERY + 6),
        )


def test_a_file_of_mostly_used_blocks_is_left_as_it_is(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    store = TraceStore(db)
    store.add("span_rows", [_span(i) for i in range(20_000)])
    assert store.flush()
    assert compact(db) is False


def test_a_value_its_column_cannot_hold_keeps_the_flush_whole_and_is_named(
    tmp_path: Path,
) -> None:
    db = tmp_path / "t.db"
    store = TraceStore(db)
    bad = ("run", "r9", "t" * 32, f"{9:016x}", None, "llm_request", "soon", 10, None, "{}")
    store.add("span_rows", [_span(0), bad])
    assert store.flush() is False  # nothing of it lands; the rows wait, counted
    assert store.num_failed_flushes == 1 and store.num_buffered_rows == 2
    with open_db(db) as con:
        assert con.execute("SELECT count(*) FROM spans").fetchone() == (0,)
    with pytest.raises(ValueError, match=r"span_rows\.start_ns"):
        write_new(tmp_path / "import.db", {"span_rows": [_span(1), bad]})


def test_every_column_type_round_trips(tmp_path: Path) -> None:
    """Lists (with NULLs in them), JSON, booleans, doubles and NULLs come back as written."""
    steps = {name: None for name in TABLES["steps"]}
    steps.update(run_id="run", step_id=1, schedule_start_ns=2**62, request_ids=["a", "b"],
                 num_scheduled=[3, None], preempted_request_ids=[], idle=True)  # fmt: skip
    requests = {name: None for name in TABLES["requests"]}
    requests.update(run_id="run", request_id="r", params='{"n": 2}', sample_weight=0.25,
                    prompt_block_hashes=[-(2**63), 2**63 - 1], emit_received_us=[1, 2],
                    stream=False)  # fmt: skip
    assert set(steps) == set(TABLES["steps"]) and set(requests) == set(TABLES["requests"])
    rows = {"steps": [tuple(steps.values())], "requests": [tuple(requests.values())]}
    store = TraceStore(tmp_path / "t.db")
    store.add_all(rows)
    assert store.flush()
    with open_db(tmp_path / "t.db") as con:
        for table, [written] in rows.items():
            read = con.execute(f"SELECT {', '.join(TABLES[table])} FROM {table}").fetchone()
            assert read == written, table


def test_flushes_spread_out_under_load_and_a_pause_flushes_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's schedule (tracing.recorder.flush_wait): while events keep coming, a flush
    waits until its CPU is FLUSH_CPU_SHARE of the time since (here a share so small that
    every wait is the longest, 10 intervals); once traffic pauses, what waits is flushed."""
    monkeypatch.setattr(recorder, "FLUSH_CPU_SHARE", 1e-6)
    interval = 0.1
    config = TracingConfig(trace_db=str(tmp_path / "t.db"), trace_flush_interval=interval)
    info = EngineInfo("tiny", 64, 16, 16, "float32", "cpu", "0")
    tracer = recorder.Tracer(config, info)
    try:
        start = time.monotonic()
        while tracer.stats().num_flushes < 3 and time.monotonic() - start < 10:
            tracer.pause(Pause("api", "loop_lag", time.time_ns(), 1000))  # steady traffic
            time.sleep(0.002)
        took = time.monotonic() - start
        print(f"\n3 flushes of steady events at a {interval} s interval took {took:.2f} s")
        assert took > 1.5  # at 0.1 s, 1.1 s and 2.1 s; not at 0.1, 0.2 and 0.3
        tracer.pause(Pause("api", "loop_lag", time.time_ns(), 1000))  # then traffic pauses
        last = time.monotonic()
        wait_until(lambda: tracer.stats().num_flushes > 3, 5)
        waited = time.monotonic() - last
        print(f"the last event was flushed {waited * 1000:.0f} ms after it came")
        assert waited < 0.6  # the quiet flush; the stretched one would come 1 s after the last
    finally:
        tracer.shutdown()
    with open_db(tmp_path / "t.db") as con:
        count = con.execute("SELECT count(*) FROM pauses").fetchone()
    assert count is not None and count[0] > 500 and tracer.stats().num_dropped_rows == 0


def _steady_pauses(tracer: recorder.Tracer, seconds: float) -> None:
    """Events every 2 ms for ``seconds``: traffic, as the writer sees it."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tracer.pause(Pause("api", "loop_lag", time.time_ns(), 1000))
        time.sleep(0.002)


def test_load_after_a_quiet_spell_waits_as_the_load_before_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A quiet spell, however long, does not end the stretched wait that load set: the next
    burst shorter than that wait is flushed once, when it pauses, not an interval into it (a
    flush's cost is mostly fixed). Here every flush under load sets the longest wait."""
    monkeypatch.setattr(recorder, "FLUSH_CPU_SHARE", 1e-6)
    interval = 0.1
    config = TracingConfig(trace_db=str(tmp_path / "t.db"), trace_flush_interval=interval)
    tracer = recorder.Tracer(config, EngineInfo("tiny", 64, 16, 16, "float32", "cpu", "0"))
    try:
        _steady_pauses(tracer, 2 * interval)  # flushed an interval in: under load
        wait_until(lambda: tracer.stats().num_flushes == 2, 5)  # and once it pauses
        time.sleep((recorder.MAX_FLUSH_STRETCH + 3) * interval)  # quiet, past any wait
        _steady_pauses(tracer, 4 * interval)  # a burst, shorter than the stretched wait
        during = tracer.stats().num_flushes
        flushed = wait_until(lambda: tracer.stats().num_flushes > 2, 5)
        print(f"\nthe burst was flushed {flushed * 1000:.0f} ms after it ended")
        time.sleep(2 * interval)
        assert during == 2 and tracer.stats().num_flushes == 3  # once, whole
    finally:
        tracer.shutdown()


def test_a_quiet_spell_keeps_the_wait_that_load_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wait between flushes under load follows what the last flush under load cost; a
    flush in a quiet spell (a few rows, cheap) does not shorten the wait of the load after it.
    Here a flush under load sets the longest wait, every other one the interval."""
    waits = iter([10.0])
    monkeypatch.setattr(recorder, "flush_wait", lambda interval, cpu: next(waits, 1.0) * interval)
    interval = 0.1
    config = TracingConfig(trace_db=str(tmp_path / "t.db"), trace_flush_interval=interval)
    tracer = recorder.Tracer(config, EngineInfo("tiny", 64, 16, 16, "float32", "cpu", "0"))
    try:
        _steady_pauses(tracer, 2 * interval)  # flushed at its first interval: the wait is 10
        wait_until(lambda: tracer.stats().num_flushes == 2, 5)  # and once quiet
        _steady_pauses(tracer, 5 * interval)  # within the 10-interval wait: no flush
        assert tracer.stats().num_flushes == 2
        wait_until(lambda: tracer.stats().num_flushes == 3, 5)  # until it pauses
    finally:
        tracer.shutdown()


def test_the_flush_wait_follows_the_flush_cost() -> None:
    assert recorder.flush_wait(1.0, 0.002) == 1.0  # cheap: every interval
    assert recorder.flush_wait(1.0, 0.04) == pytest.approx(0.04 / recorder.FLUSH_CPU_SHARE)
    assert recorder.flush_wait(1.0, 5.0) == recorder.MAX_FLUSH_STRETCH  # never past 10 intervals
