"""The DuckDB trace store: batched appends, patient readers; its schema by numbered migrations
(tracing/store_migrations.py).

DuckDB lets one process write a file and no other open it meanwhile. So the
writer never holds the file between flushes: each flush attaches it to the
writer's in-memory connection (a few ms; a fresh connection costs ~10x
more), appends every buffered row in one transaction, and detaches it. A reader (a user's SQL,
`lumen trace`, `replay`) that holds the file makes a flush fail; the rows stay
in a bounded buffer for the next flush, and what overflows is counted, never
waited for. Readers retry briefly when a flush holds the file.

A kill -9 mid-flush rolls that transaction back when the file is next opened,
so the store never holds part of a request. Except in one window: DuckDB's checkpoint rewrites
a metadata block in place, and a SIGKILL during that write can tear it (Linux stops a write
between pages for a fatal signal), which leaves the file unreadable. A writer that finds its
file so sets it aside (``NAME.corrupt-<ns>``) and starts a new one; readers say what it is.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import duckdb

from tracing import fleet
from tracing.emit_columns import EMIT_INDEX, emit_arrays, with_emit_lists
from tracing.store_migrations import migrate
from tracing.store_schema import TABLES

logger = logging.getLogger(__name__)
T = TypeVar("T")
BLOCK_SIZE = 65536  # bytes per storage block of a store this writer creates (16 and 32 KiB
# blocks store integers uncompressed in DuckDB 2.0)
# A flush adds a row group to each table it writes, and DuckDB's checkpoint merges a table's
# small row groups into fewer ("vacuum"). Left on at every flush, it merged the recent ones
# again and again, like a binary counter's carries: half the checkpoints took 2-25x the
# cheapest. Never merged, 65 flushes' row groups made the file 1.5x larger and the spans view
# 1.7x slower to scan. So the writer merges every MERGE_EVERY flushes and at its last: 96
# flushes of a recorded run's rows (41k tokens each) took 40 ms each, not 53 (30 unmerged).
MERGE_EVERY = 32


def row(table: str, **values: Any) -> tuple[Any, ...]:
    """A row of ``table`` in column order, by column name (columns not named are NULL)."""
    unknown = set(values) - set(TABLES[table])
    if unknown:
        raise ValueError(f"{table} has no column {', '.join(sorted(unknown))}")
    return tuple(values.get(column) for column in TABLES[table])


# What DuckDB says of a file with a torn block (a checksum), or torn metadata.
_CORRUPT = ("corrupt database file", "no more data remaining in metadatareader")


class CorruptStore(ValueError):
    """A store DuckDB cannot open because a block of it is torn."""


def is_corrupt(e: BaseException) -> bool:
    """Whether DuckDB refused a file because a block of it is torn."""
    return any(words in str(e).lower() for words in _CORRUPT)


@contextlib.contextmanager
def _naming_torn(where: str) -> Iterator[None]:
    """DuckDB's refusal of a torn file, raised as a CorruptStore that says what to do."""
    try:
        yield
    except duckdb.Error as e:
        if not is_corrupt(e):
            raise
        raise CorruptStore(
            f"a trace db is corrupt ({where}: {str(e).splitlines()[0]}). A writer killed while "
            "DuckDB rewrote one of its blocks can leave it so; the next server to write it "
            "sets it aside as NAME.corrupt-<ns> and records into a new file"
        ) from None


def set_aside(path: Path) -> Path:
    """Move a corrupt store (and its WAL) out of the way, kept for salvage; its new name."""
    aside = path.with_name(f"{path.name}.corrupt-{time.time_ns()}")
    os.replace(path, aside)
    wal = path.with_name(path.name + ".wal")
    if wal.exists():
        os.replace(wal, aside.with_name(aside.name + ".wal"))
    return aside


# One trace store, several (read as one fleet), or a folder of them.
DbPath = str | Path | Sequence[str | Path]


@contextlib.contextmanager
def open_db(
    path: DbPath, *, read_only: bool = True, timeout: float = 5.0
) -> Iterator[duckdb.DuckDBPyConnection]:
    """Open the store, retrying while a writer's flush holds the file (it holds it briefly).
    Several stores, or a folder of them, open read-only as one fleet (tracing.fleet)."""
    if not isinstance(path, str | Path) or Path(path).is_dir():
        paths = fleet.store_paths(path)
        if len(paths) > 1 or isinstance(path, str | Path):  # several, or a folder
            if not read_only:
                raise ValueError("a fleet of trace dbs opens read-only")
            con = duckdb.connect(":memory:")
            try:
                with _naming_torn(", ".join(map(str, paths))):
                    fleet.attach(con, paths, lambda attach: _while_locked(attach, timeout))
                yield con
            finally:
                con.close()
            return
        path = paths[0]
    path = Path(path)
    if read_only and not path.exists():
        raise ValueError(f"no trace db at {path}")
    with _naming_torn(str(path)):
        con = _while_locked(lambda: duckdb.connect(str(path), read_only=read_only), timeout)
    try:
        yield con
    finally:
        con.close()


@dataclass
class _Buffer:
    """Rows waiting for the next flush, one list of tuples per table, and how many in all."""

    rows: dict[str, list[tuple[Any, ...]]] = field(default_factory=lambda: {t: [] for t in TABLES})
    num_rows: int = 0

    def __len__(self) -> int:
        return self.num_rows


class TraceStore:
    """The writer's side. Not thread-safe: one writer thread calls ``add`` and ``flush``."""

    def __init__(self, path: str | Path, *, max_buffered_rows: int = 200_000) -> None:
        self.path = Path(path)
        self.max_buffered_rows = max_buffered_rows
        self.num_dropped_rows = 0
        self.num_failed_flushes = 0
        self._buffer = _Buffer()
        # One thread: a flush must not compete with the engine for cores. And none of DuckDB's 8
        # async I/O threads (for remote files), which idle for ever: the traced API process had
        # 17 threads against the untraced one's 8.
        self._con = duckdb.connect(":memory:", config={
            "threads": 1, "async_threads": 0,
            # A commit checkpoints at once and writes no WAL (the checkpoint at DETACH read it
            # back and dropped it): 10% less a flush. Still one transaction: a kill -9
            # mid-checkpoint leaves the file's previous header, without any of it.
            "checkpoint_threshold": "0B", "auto_checkpoint_skip_wal_threshold": 0,
        })  # fmt: skip
        # This connection only appends whole Arrow tables: planning an INSERT ... SELECT * has
        # nothing to optimise, and the optimiser's passes were 0.15-0.2 ms of each insert.
        self._con.execute("PRAGMA disable_optimizer")
        self._vacuum = True  # DuckDB's default: a checkpoint merges small row groups
        self.num_unmerged_flushes = 0  # written since the last that merged row groups
        self._migrated = False
        try:
            self._migrate()
        except (duckdb.Error, OSError) as e:
            # A read-only or full disk must not stop serving: rows wait (bounded), we retry.
            logger.error("trace db %s is not writable (%s): traces are buffered, then dropped "
                         "and counted (lumen:trace_rows_dropped_total)", self.path, e)  # fmt: skip

    def _migrate(self, timeout: float = 30.0) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.path.exists():
            _create_file(self.path)
        try:
            with open_db(self.path, read_only=False, timeout=timeout) as con:
                migrate(con)
        except CorruptStore as e:  # kept for salvage; the server records into a new file
            aside = set_aside(self.path)
            logger.error("%s. Set aside as %s; recording into a new %s", e, aside.name,
                         self.path.name)  # fmt: skip
            _create_file(self.path)
            with open_db(self.path, read_only=False, timeout=timeout) as con:
                migrate(con)
        self._migrated = True

    @property
    def num_buffered_rows(self) -> int:
        return len(self._buffer)

    def add(self, table: str, rows: Sequence[tuple[Any, ...]]) -> None:
        self.add_all({table: rows})

    def add_all(self, rows_by_table: Mapping[str, Sequence[tuple[Any, ...]]]) -> None:
        """Buffer rows of several tables together: all kept, or all dropped and counted."""
        num = sum(len(r) for r in rows_by_table.values())
        if len(self._buffer) + num > self.max_buffered_rows:
            if not self.num_dropped_rows:
                logger.error(
                    "trace db %s: buffer full (%d rows), dropping rows; counted in "
                    "lumen:trace_rows_dropped_total",
                    self.path,
                    len(self._buffer),
                )
            self.num_dropped_rows += num
            return
        buffered = self._buffer.rows
        for table, rows in rows_by_table.items():
            buffered[table].extend(rows)
        self._buffer.num_rows += num

    def flush(self, *, last: bool = False) -> bool:
        """Append everything buffered in one transaction; False (rows kept) if the file is busy.
        Every MERGE_EVERY-th flush, and the ``last``, merge the tables' small row groups."""
        if not len(self._buffer):
            return True
        con = self._con
        merge = last or self.num_unmerged_flushes + 1 >= MERGE_EVERY
        if merge != self._vacuum:  # read by the checkpoint at COMMIT (a SET: 0.2-1 ms)
            con.execute("RESET max_vacuum_tasks" if merge else "SET max_vacuum_tasks = 0")
            self._vacuum = merge
        try:
            if not self._migrated:
                self._migrate(timeout=0.2)  # the writer thread never waits long
            _while_locked(lambda: con.execute("ATTACH ? AS store", [str(self.path)]), 0.2)
        except (duckdb.Error, OSError) as e:
            self.num_failed_flushes += 1
            logger.debug("trace flush deferred: %s", e)
            if is_corrupt(e):  # torn by something else meanwhile: the next flush starts anew
                self._migrated = False
            return False
        try:
            con.execute("BEGIN TRANSACTION")
            for table, rows in self._buffer.rows.items():
                if rows:
                    _append(con, table, f"store.{table}", rows)
            con.execute("COMMIT")
        except (duckdb.Error, ValueError) as e:
            con.execute("ROLLBACK")
            self.num_failed_flushes += 1
            if self.num_failed_flushes in (1, 10, 100) or self.num_failed_flushes % 1000 == 0:
                logger.error("trace db flush failed (%s); rows kept for the next flush", e)
            return False
        finally:
            con.execute("DETACH store")
        self._buffer = _Buffer()
        self.num_unmerged_flushes = 0 if merge else self.num_unmerged_flushes + 1
        return True

    def close(self) -> None:
        """Close; a file that is mostly free blocks is compacted first (``compact``)."""
        self._con.close()
        if self._migrated and len(self._buffer) == 0:
            try:
                compact(self.path)
            except (duckdb.Error, OSError) as e:  # a reader holds it, or a full disk: keep it
                logger.debug("trace db %s not compacted: %s", self.path, e)


# A file whose free blocks are at least this share of it is rewritten at close.
COMPACT_FREE_SHARE = 0.25


def compact(path: Path) -> bool:
    """Rewrite the store into a fresh file when free blocks are ``COMPACT_FREE_SHARE`` of it
    or more; True if it did.

    The flushes that merge row groups (MERGE_EVERY) rewrite the small ones, and the blocks
    they free are reused only by later checkpoints. In a short run those can be a large share
    of the file; in a long one they are a small share, and the copy is skipped.
    """
    con = duckdb.connect(":memory:", config={"threads": 1})
    try:
        _while_locked(lambda: con.execute("ATTACH ? AS store", [str(path)]), 1.0)
        size = con.execute(
            "SELECT total_blocks, free_blocks FROM pragma_database_size() "
            "WHERE database_name = 'store'"
        ).fetchone()  # fmt: skip
        assert size is not None, "an attached database has a size"
        total, free = size
        if not total or free < COMPACT_FREE_SHARE * total:
            return False
        fresh = path.with_name(path.name + ".compacting")
        fresh.unlink(missing_ok=True)
        con.execute(f"ATTACH ? AS fresh (BLOCK_SIZE {BLOCK_SIZE})", [str(fresh)])
        con.execute("COPY FROM DATABASE store TO fresh")
        con.execute("DETACH fresh")
        con.execute("DETACH store")
        os.replace(fresh, path)
        return True
    finally:
        con.close()


def _create_file(path: Path) -> None:
    """A new store in BLOCK_SIZE blocks: DuckDB's default 256 KiB blocks, several of them
    partly used per table and column, cost a short run more than its rows do (`lumen bench
    overhead`'s 49,152 tokens: 4.0 MiB at 256 KiB, 1.3 MiB at 64 KiB)."""
    con = duckdb.connect(":memory:")
    try:
        con.execute(f"ATTACH ? AS new_store (BLOCK_SIZE {BLOCK_SIZE})", [str(path)])
        con.execute("DETACH new_store")
    finally:
        con.close()


def _while_locked(action: Callable[[], T], timeout: float) -> T:
    """``action()``, retried while another process holds the file's lock (up to timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return action()
        except duckdb.IOException as e:
            if "lock" not in str(e).lower() or time.monotonic() > deadline:
                raise
            time.sleep(0.02)


_ARROW_TYPES = {"BIGINT": "int64", "INTEGER": "int32", "DOUBLE": "float64", "BOOLEAN": "bool_",
                "VARCHAR": "string", "JSON": "string"}  # fmt: skip


@functools.cache
def _arrow_schema(table: str) -> Any:
    import pyarrow as pa  # the writer's and imports' only: readers never load it

    def arrow_type(sql: str) -> Any:
        scalar = getattr(pa, _ARROW_TYPES[sql.removesuffix("[]")])()
        return pa.list_(scalar) if sql.endswith("[]") else scalar

    return pa.schema([(name, arrow_type(sql)) for name, sql in TABLES[table].items()])


def prepare_appends() -> None:
    """Load pyarrow and convert once: ~0.4 s of CPU the first time, with the GIL held (its
    first conversion imports pandas). The server does it while the core loads the model, so
    that no request waits on it."""
    import pyarrow as pa

    for table in TABLES:
        _arrow_schema(table)
    pa.array([], type=pa.int64())


def _append(
    con: duckdb.DuckDBPyConnection, table: str, into: str, rows: list[tuple[Any, ...]]
) -> None:
    """Insert ``rows`` of ``table`` into ``into`` as one Arrow table, typed by the schema.

    executemany is ~1 ms a row. A registered dict of numpy object columns is ~1000x faster, but
    DuckDB converts its every value on its own: Arrow builds each column in C, and a flush of
    the tiny model's 6,500 tokens (~280 rows) takes 12.5 ms to insert, not 21.
    A value Arrow cannot convert is a ValueError naming the column."""
    import pyarrow as pa

    schema = _arrow_schema(table)
    values_of = list(zip(*rows))
    built: dict[int, Any] = {}
    if table == "requests":  # the trace writer's rows hold their emits as recorded
        arrays = emit_arrays(values_of[EMIT_INDEX[0]], [schema[i].type for i in EMIT_INDEX])
        if arrays is not None:
            built = dict(zip(EMIT_INDEX, arrays))
        else:  # an import's plain lists, perhaps beside recorded emits: every row as lists
            values_of = list(zip(*map(with_emit_lists, rows)))
    columns = []
    for i, (column, values) in enumerate(zip(schema, values_of)):
        if i in built:
            columns.append(built[i])
            continue
        try:
            columns.append(pa.array(values, type=column.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as e:
            raise ValueError(f"{table}.{column.name}: {e}") from None
    # Read by DuckDB's replacement scan of this frame's locals: registering and unregistering a
    # view costs ~0.9 ms more a table, per flush.
    _lumen_rows = pa.Table.from_arrays(columns, schema=schema)
    con.execute(f"INSERT INTO {into} SELECT * FROM _lumen_rows")


def write_new(path: Path, rows_by_table: Mapping[str, Sequence[tuple[Any, ...]]]) -> None:
    """A new store at ``path`` holding ``rows_by_table``, in one transaction, unbounded (an
    import's, not the serving path's: TraceStore buffers a bounded number of rows). A row
    DuckDB refuses is a ValueError with DuckDB's own words."""
    _create_file(path)
    with open_db(path, read_only=False, timeout=5) as con:
        migrate(con)
        try:
            con.execute("BEGIN TRANSACTION")
            for table, rows in rows_by_table.items():
                if rows:
                    _append(con, table, table, list(rows))
            con.execute("COMMIT")
        except (duckdb.Error, ValueError) as e:
            con.execute("ROLLBACK")
            raise ValueError(f"a {table} row was refused: {str(e).splitlines()[0]}") from None


def latest_run(con: duckdb.DuckDBPyConnection, *, served_only: bool = False) -> str:
    """The run whose requests arrived last (``served_only``: requests that got a token)."""
    where = "WHERE ttft_ns IS NOT NULL" if served_only else ""
    found = con.execute(
        f"SELECT run_id FROM requests {where} GROUP BY run_id ORDER BY max(arrival_ns) DESC LIMIT 1"
    ).fetchone()
    if found is None:
        raise ValueError("the trace db holds no " + ("served " if served_only else "") + "request")
    return str(found[0])
