"""`replay report`: latency percentiles of a recorded run and the verdict on where its time went,
from ``tracing.diagnose`` (the same numbers and words as `lumen trace why`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tracing.diagnose import (
    TTFT_PARTS,
    RequestDiagnosis,
    diagnose_run,
    percentiles,
    render_run,
)
from tracing.store import DbPath, latest_run, open_db

__all__ = [
    "PARTS",
    "RequestTimes",
    "load_times",
    "percentiles",
    "render_text",
]

# What a request's time to its first delivered token is made of (ns per part; see diagnose).
PARTS = TTFT_PARTS


@dataclass
class RequestTimes:
    """One served request's latencies, as `replay diff` and the HTML page read them."""

    request_id: str
    ttft_ns: int
    e2e_ns: int
    output_tokens: int
    parts: dict[str, int] = field(default_factory=dict)
    arrival_ns: int = 0
    emit_ends_ns: list[int] = field(default_factory=list)
    prefill_steps: int = 0
    preemptions: int = 0
    itls_ns: list[int] = field(default_factory=list)

    @property
    def tpot_ns(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_ns - self.ttft_ns) / (self.output_tokens - 1)

    @classmethod
    def of(cls, r: RequestDiagnosis) -> RequestTimes:
        assert r.ttft_ns is not None
        return cls(
            r.request_id,
            r.ttft_ns,
            r.e2e_ns,
            r.output_tokens,
            parts=dict(r.ttft),
            arrival_ns=r.arrival_ns,
            preemptions=r.num_preemptions,
            itls_ns=list(r.gaps_ns),
        )


def load_times(db: DbPath, run_id: str | None = None) -> tuple[str, list[RequestTimes]]:
    """The run's finished requests that got a token (by default the latest run that has one)."""
    if run_id is None:
        with open_db(db, timeout=10) as con:
            run_id = latest_run(con, served_only=True)
    run = diagnose_run(db, run_id)
    served = [r for r in run.requests if r.status == "ok" and r.ttft_ns is not None]
    return run.run_id, [RequestTimes.of(r) for r in served]


@dataclass(frozen=True)
class RunRow:
    """One run of a store (or a fleet of stores): what the runs list of a report shows."""

    run_id: str
    replica: str | None
    started_ns: int
    num_requests: int


def list_runs(db: DbPath) -> list[RunRow]:
    """Every run the store (or fleet) holds, oldest first, with its replica and requests."""
    with open_db(db, timeout=10) as con:
        cols = {c for (c,) in con.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_name = 'runs'"
        ).fetchall()}  # fmt: skip
        replica = "r.replica" if "replica" in cols else "NULL"
        rows = con.execute(
            f"SELECT r.run_id, {replica}, r.started_ns, count(q.request_id) FROM runs r "
            "LEFT JOIN requests q ON q.run_id = r.run_id GROUP BY ALL ORDER BY r.started_ns"
        ).fetchall()
    return [RunRow(str(a), b, int(c or 0), int(d)) for a, b, c, d in rows]


def render_text(db: DbPath, run_id: str | None = None) -> str:
    """The report of ``run_id``; without one, of every run with requests in a fleet (several
    stores, or a folder), else of the store's latest; always saying which runs it covers."""
    runs = list_runs(db)
    served = [r for r in runs if r.num_requests]
    if run_id is not None or len(served) <= 1:
        chosen = run_id or (latest_of(db) if served else None)
        text = render_run(diagnose_run(db, chosen))
        return _runs_note(runs, chosen, fleet=False) + text if len(runs) > 1 else text
    if not _is_fleet(db):
        chosen = latest_of(db)
        return _runs_note(runs, chosen, fleet=False) + render_run(diagnose_run(db, chosen))
    parts = [_runs_note(runs, None, fleet=True)]
    for r in served:
        where = f"replica {r.replica}, " if r.replica else ""
        parts.append(f"=== {where}run {r.run_id} ===\n" + render_run(diagnose_run(db, r.run_id)))
    return "\n\n".join(parts)


def latest_of(db: DbPath) -> str:
    with open_db(db, timeout=10) as con:
        return latest_run(con)


def _is_fleet(db: DbPath) -> bool:
    from pathlib import Path

    return not isinstance(db, str | Path) or Path(db).is_dir()


def _runs_note(runs: list[RunRow], chosen: str | None, *, fleet: bool) -> str:
    """The runs the store holds, and which this report covers (`replay report --run ID`)."""
    replicas = {r.replica for r in runs if r.replica}
    head = (
        f"{len(runs)} runs in {len(replicas)} replicas' stores; this report covers each run "
        "with requests, one after another:"
        if fleet
        else f"{len(runs)} runs in this store; this report covers run {chosen} (the latest "
        "with requests unless --run names another):"
    )
    lines = [head]
    for r in runs:
        mark = "*" if (fleet and r.num_requests) or r.run_id == chosen else " "
        where = f"  replica {r.replica}" if r.replica else ""
        lines.append(f" {mark} {r.run_id}{where}  {r.num_requests:,} requests")
    lines.append("   (replay report DB --run ID reports one)")
    return "\n".join(lines) + "\n\n"
