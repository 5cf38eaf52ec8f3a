"""The DuckDB trace store: migrations, batched appends, and a reader in another process."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from tracing.store import MIGRATIONS, TraceStore, compact, open_db

HOLD = """
import sys, time, duckdb
con = duckdb.connect(sys.argv[1], read_only=True)
print("open", flush=True)
time.sleep(float(sys.argv[2]))
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


def test_a_file_of_mostly_free_blocks_is_compacted_at_close(tmp_path: Path) -> None:
    """Many small flushes each rewrite the last row group, leaving free blocks behind; close
    rewrites such a file into a fresh one with the same rows, schema and spans view."""
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


def test_a_file_of_mostly_used_blocks_is_left_as_it_is(tmp_path: Path) -> None:
    db = tmp_path / "t.db"
    store = TraceStore(db)
    store.add("span_rows", [_span(i) for i in range(20_000)])
    assert store.flush()
    assert compact(db) is False
