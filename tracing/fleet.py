"""Many trace stores read as one fleet: each file attached read-only to one in-memory DuckDB,
and every table a view over all of them with a ``replica`` column (the run's
service.instance.id, or the file's name for a store recorded before replicas were kept).

Run ids are random per server start, so a fleet's runs never collide; the diagnosis reads a
fleet's views exactly as it reads one store's tables, which is why a request's `lumen trace
why` on the fleet equals the one on its own replica's store.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from pathlib import Path

import duckdb

from tracing.store_schema import TABLES
from tracing.store_views import SPANS_VIEW_7

# The spans view over the fleet's tables: the store's own view (its stored span rows and the
# spans derived from steps and request rows), with each span's replica.
_SPANS = "\n".join(
    line.replace("SELECT * FROM span_rows", "SELECT * EXCLUDE (replica) FROM span_rows")
    for line in SPANS_VIEW_7.strip().splitlines()[1:]  # the SELECT, not its CREATE VIEW
)
FLEET_SPANS = (
    f"CREATE TEMP VIEW spans AS SELECT s.*, runs.replica FROM ({_SPANS}) s JOIN runs USING (run_id)"
)


def store_paths(spec: str | Path | Sequence[str | Path]) -> list[Path]:
    """The stores ``spec`` names: one file, several, or a folder (its ``*.db`` files)."""
    items = [spec] if isinstance(spec, str | Path) else list(spec)
    paths: list[Path] = []
    for item in map(Path, items):
        if item.is_dir():
            found = sorted(item.glob("*.db"))
            if not found:
                raise ValueError(f"no trace db (*.db) in the folder {item}")
            paths += found
        elif item.exists():
            paths.append(item)
        else:
            raise ValueError(f"no trace db at {item}")
    if len(set(paths)) != len(paths):
        raise ValueError("a trace db is named twice")
    return paths


def attach(
    con: duckdb.DuckDBPyConnection,
    paths: list[Path],
    retry: Callable[[Callable[[], object]], object] = lambda attach: attach(),
) -> None:
    """Attach ``paths`` read-only and create the fleet's views in ``con``; ``retry`` runs each
    attach (the store retries while a writer's flush holds a file)."""
    for i, path in enumerate(paths):
        retry(functools.partial(con.execute, f"ATTACH '{_quoted(path)}' AS s{i} (READ_ONLY)"))
    for table in TABLES:
        parts = [
            _select(con, f"s{i}", table, path.stem)
            for i, path in enumerate(paths)
            if _columns(con, f"s{i}", table)
        ]
        if parts:
            con.execute(f"CREATE TEMP VIEW {table} AS " + " UNION ALL BY NAME ".join(parts))
    # The stores' own spans views would bind their tables to the fleet's views (the names
    # resolve in this connection): the fleet's spans view is the same SQL over them.
    con.execute(FLEET_SPANS)


def _select(con: duckdb.DuckDBPyConnection, db: str, table: str, stem: str) -> str:
    fallback = f"'{_quoted(stem)}'"
    has_replica = "replica" in _columns(con, db, "runs")
    if table == "runs":
        if has_replica:
            return f"SELECT * REPLACE (coalesce(replica, {fallback}) AS replica) FROM {db}.runs"
        return f"SELECT *, {fallback} AS replica FROM {db}.runs"
    replica = f"coalesce(r.replica, {fallback})" if has_replica else fallback
    runs = f"(SELECT run_id, {'replica' if has_replica else 'NULL AS replica'} FROM {db}.runs)"
    return (
        f"SELECT t.*, {replica} AS replica FROM {db}.{table} t "
        f"LEFT JOIN {runs} r ON t.run_id = r.run_id"
    )


def _columns(con: duckdb.DuckDBPyConnection, db: str, table: str) -> set[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns "
        "WHERE table_catalog = ? AND table_name = ?",
        [db, table],
    ).fetchall()
    return {c for (c,) in rows}


def _quoted(value: object) -> str:
    return str(value).replace("'", "''")
