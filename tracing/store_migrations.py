"""The trace store's schema by numbered migrations: each runs once per file, in order,
recorded in its schema_migrations table (the columns each adds: store_schema.ADDED_IN)."""

from __future__ import annotations

import time
from collections.abc import Callable

import duckdb

from tracing.store_schema import ADDED_IN, SCHEMA_VERSION, TABLES
from tracing.store_views import SPANS_VIEW, SPANS_VIEW_4, SPANS_VIEW_7


def _create(table: str, name: str | None = None) -> str:
    """The table as its creating migration made it (named ``name``, default its own): without
    the columns later ones add."""
    later = {n for added in ADDED_IN.values() for n in added.get(table, [])}
    cols = ", ".join(f"{col} {typ}" for col, typ in TABLES[table].items() if col not in later)
    return f"CREATE TABLE {name or table} ({cols})"


def _m001_initial(con: duckdb.DuckDBPyConnection) -> None:
    for table, name in (("runs", "runs"), ("requests", "requests"), ("span_rows", "spans"),
                        ("steps", "steps")):  # fmt: skip
        con.execute(_create(table, name))


def _add_columns(con: duckdb.DuckDBPyConnection, version: int) -> None:
    for table, names in ADDED_IN[version].items():
        for name in names:
            con.execute(f"ALTER TABLE {table} ADD COLUMN {name} {TABLES[table][name]}")


def _m002_whole_life(con: duckdb.DuckDBPyConnection) -> None:
    _add_columns(con, 2)
    con.execute(_create("pauses"))


def _m003_compact(con: duckdb.DuckDBPyConnection) -> None:
    con.execute("ALTER TABLE spans RENAME TO span_rows")
    _add_columns(con, 3)
    con.execute(_create("request_children"))
    con.execute(SPANS_VIEW)


def _m006_lifecycle(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(_create("lifecycle"))
    _add_columns(con, 6)


def _m004_grammar(con: duckdb.DuckDBPyConnection) -> None:
    _add_columns(con, 4)
    con.execute(SPANS_VIEW_4.replace("CREATE VIEW", "CREATE OR REPLACE VIEW", 1))


def _m007_sampled(con: duckdb.DuckDBPyConnection) -> None:
    _add_columns(con, 7)
    con.execute(SPANS_VIEW_7.replace("CREATE VIEW", "CREATE OR REPLACE VIEW", 1))


# Ordered; each runs once per file, recorded in schema_migrations.
MIGRATIONS: list[tuple[int, str, Callable[[duckdb.DuckDBPyConnection], None]]] = [
    (1, "runs, requests, spans and steps", _m001_initial),
    (2, "a request's whole life, KV frees, idle steps and pauses", _m002_whole_life),
    (3, "per-step facts once per step, emits in the request row: spans a view", _m003_compact),
    (4, "structured outputs: grammar compile per request, token masks per step", _m004_grammar),
    (
        5,
        "sampler and logprobs per step, the warm-up's step prior, request bodies",
        lambda c: _add_columns(c, 5),
    ),
    (6, "the server's drains and engine restarts; each run's replica", _m006_lifecycle),
    (7, "sampled imports' request weights; GenAI usage names of today", _m007_sampled),
    (
        8,
        "what ended a request, and its second send after an engine failure",
        lambda c: _add_columns(c, 8),
    ),
    (9, "the KV cache's groups and windows, and what it held", lambda c: _add_columns(c, 9)),
    (10, "data-parallel engines: each request's and restart's", lambda c: _add_columns(c, 10)),
    (11, "why the balancing sent a request to its engine", lambda c: _add_columns(c, 11)),
    (12, "speculative decoding: drafts verified and kept per step", lambda c: _add_columns(c, 12)),
    (13, "LoRA: each request's adapter, each step's", lambda c: _add_columns(c, 13)),
    (14, "the API process's busy stretches and their CPU time", lambda c: _add_columns(c, 14)),
]
assert MIGRATIONS[-1][0] == SCHEMA_VERSION


def migrate(con: duckdb.DuckDBPyConnection) -> None:
    con.execute(
        "CREATE TABLE IF NOT EXISTS schema_migrations "
        "(version INTEGER, name VARCHAR, applied_ns BIGINT)"
    )
    done = {v for (v,) in con.execute("SELECT version FROM schema_migrations").fetchall()}
    for version, name, apply in MIGRATIONS:
        if version in done:
            continue
        con.execute("BEGIN TRANSACTION")
        apply(con)
        con.execute(
            "INSERT INTO schema_migrations VALUES (?, ?, ?)", [version, name, time.time_ns()]
        )
        con.execute("COMMIT")
