"""What `tracing.diagnose` reads from a trace db: requests, steps and who took part in each, per
request the steps' parts by the run's step-cost model (in SQL), neighbours, queue limits and
pauses.

Older dbs (migration 1 only) lack the columns of migration 2 and the pauses table: they read as
NULL, and the spans stand in where they can (sent, received, first and last delivery).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import duckdb
import numpy as np

from engine.request_ids import CHILD_SUFFIX, OLD_SAMPLE_PREFIX
from tracing.pauses import Intervals, Pauses, no_pauses

COLD_STEPS = 3  # the first steps, judged against a fit of the others
MIN_FIT_STEPS = 8  # fewer steps than this: no fit (no cold or outlier verdict, token shares)
MIN_PRICED_PREFILL = 64  # prefill tokens some step must carry before a token gets its own price


class Window(NamedTuple):
    """A request's phases: TTFT [start, ttft_end], decode [ttft_end, end] (instants, ns)."""

    start: int
    first_token: int | None  # arrival + ttft: the first token reached the frontend
    ttft_end: int
    end: int


@dataclass
class LoadedRun:
    requests: list[dict[str, Any]]
    steps: list[tuple[Any, ...]]  # StepFacts' fields, in step order
    step_parts: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    # (request id, phase) -> other request prefilling in its steps -> (tokens, step ids)
    neighbours: dict[tuple[str, str], dict[str, tuple[int, list[int]]]] = field(
        default_factory=dict
    )
    wait_reasons: dict[str, str] = field(default_factory=dict)
    preemptions: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    prefill_members: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    pauses: tuple[Pauses, Pauses] = field(default_factory=lambda: (no_pauses(), no_pauses()))
    pause_rows: list[tuple[str, str, int, int]] = field(default_factory=list)


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]
    ).fetchall()
    return {c for (c,) in rows}


def _select(have: set[str], names: list[str], alias: str) -> str:
    return ", ".join(f"{alias}.{n}" if n in have else f"NULL AS {n}" for n in names)


NEW_REQUEST_COLUMNS = [
    "stream",
    "http_start_ns",
    "handler_ns",
    "sent_ns",
    "received_ns",
    "first_scheduled_ns",
    "admission_wait_ns",
    "first_delivered_ns",
    "last_delivered_ns",
    "delivered_ttft_ns",
    "send_wait_ns",
    "bytes_sent",
    "kv_freed_ns",
    "grammar_ready_ns",
]
STEP_FIELDS = [
    "step_id",
    "schedule_start_ns",
    "schedule_end_ns",
    "execute_start_ns",
    "execute_end_ns",
    "output_ns",
    "num_running",
    "num_waiting",
    "num_scheduled_tokens",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_preemptions",
    "kv_blocks_used",
    "kv_blocks_total",
    "update_end_ns",
    "wait_reason",
    "idle",
    "gc_pause_ns",
    "grammar_mask_ns",
]


def load_requests(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    """One dict per request row; spans stand in for instants an older db lacks."""
    have = _columns(con, "requests")
    cur = con.execute(
        f"""
        WITH sp AS (
            SELECT request_id, trace_id,
                max(end_ns) FILTER (WHERE name = 'frontend.enqueue') AS enqueue_end,
                min(end_ns) FILTER (WHERE name = 'core.receive') AS receive_end,
                min(end_ns) FILTER (WHERE name = 'frontend.emit') AS first_emit_end,
                max(start_ns) FILTER (WHERE name = 'frontend.emit') AS last_emit_start,
                max(end_ns) FILTER (WHERE name = 'frontend.emit') AS last_emit_end,
                list(end_ns ORDER BY end_ns) FILTER (WHERE name = 'frontend.emit') AS emit_ends,
                list(step_id ORDER BY end_ns) FILTER (WHERE name = 'frontend.emit') AS emit_steps
            FROM spans WHERE run_id = $run GROUP BY ALL
        )
        SELECT r.request_id, r.status, r.arrival_ns, r.prompt_tokens, r.output_tokens,
            r.ttft_ns, r.e2e_ns, r.num_preemptions, {_select(have, NEW_REQUEST_COLUMNS, "r")},
            sp.enqueue_end, sp.receive_end, sp.first_emit_end, sp.last_emit_start,
            sp.last_emit_end, sp.emit_ends, sp.emit_steps
        FROM requests r LEFT JOIN sp ON sp.request_id = r.request_id
            AND (r.trace_id IS NULL OR sp.trace_id = r.trace_id)
        WHERE r.run_id = $run ORDER BY r.arrival_ns, r.request_id
        """,
        {"run": run_id},
    )
    names = [d[0] for d in cur.description]
    rows = [dict(zip(names, row)) for row in cur.fetchall()]
    for row in rows:
        row["sent_ns"] = row["sent_ns"] or row["enqueue_end"]
        row["received_ns"] = row["received_ns"] or row["receive_end"]
        if row["stream"] is not False:
            row["first_delivered_ns"] = row["first_delivered_ns"] or row["first_emit_end"]
        row["last_delivered_ns"] = row["last_delivered_ns"] or row["last_emit_end"]
    return rows


def load_steps(con: duckdb.DuckDBPyConnection, run_id: str) -> list[tuple[Any, ...]]:
    """One tuple per step (idle records too), in the order of StepFacts' fields."""
    have = _columns(con, "steps")
    return con.execute(
        f"""
        SELECT step_id, schedule_start_ns, output_ns, execute_start_ns - schedule_start_ns,
            execute_end_ns - execute_start_ns, output_ns - execute_end_ns,
            coalesce(num_prefill_tokens, 0), coalesce(num_decode_tokens, 0),
            coalesce(num_running, 0), coalesce(num_waiting, 0), coalesce(num_preemptions, 0),
            coalesce(kv_blocks_used, 0), coalesce(kv_blocks_total, 0), coalesce(idle, false),
            nullif(wait_reason, ''), coalesce(len(request_ids), 0),
            update_end_ns - execute_end_ns, coalesce(gc_pause_ns, 0),
            coalesce(grammar_mask_ns, 0)
        FROM (SELECT {_select(have, STEP_FIELDS, "s")}, s.request_ids FROM steps s
              WHERE s.run_id = ?)
        ORDER BY step_id, schedule_start_ns
        """,
        [run_id],
    ).fetchall()


def load_pauses(
    con: duckdb.DuckDBPyConnection, run_id: str
) -> tuple[tuple[Pauses, Pauses], list[tuple[str, str, int, int]]]:
    """(api, core) pauses, and the rows; none where the db predates the pauses table."""
    if not _columns(con, "pauses"):
        return (no_pauses(), no_pauses()), []
    rows = con.execute(
        "SELECT process, kind, start_ns, duration_ns FROM pauses WHERE run_id = ? "
        "AND duration_ns > 0 ORDER BY start_ns",
        [run_id],
    ).fetchall()

    def of(process: str, kind: str) -> Intervals:
        return Intervals([(s, s + d) for p, k, s, d in rows if p == process and k == kind])

    api = Pauses(of("api", "gc"), of("api", "loop_lag"))
    return (api, Pauses(of("core", "gc"), Intervals([]))), rows


def load_run(
    con: duckdb.DuckDBPyConnection, run_id: str, windows: Callable[[dict[str, Any]], Window]
) -> LoadedRun:
    run = LoadedRun(load_requests(con, run_id), load_steps(con, run_id))
    run.pauses, run.pause_rows = load_pauses(con, run_id)
    if not run.requests:
        return run
    wins = [windows(r) for r in run.requests]
    con.register(
        "_lumen_w",
        {
            "request_id": np.array([r["request_id"] for r in run.requests], dtype=object),
            "ft": np.array(
                [-1 if w.first_token is None else w.first_token for w in wins], np.int64
            ),
            "t_lo": np.array([w.start for w in wins], np.int64),
            "t_hi": np.array([w.ttft_end for w in wins], np.int64),
            "d_hi": np.array([w.end for w in wins], np.int64),
            "received": np.array([r["received_ns"] or -1 for r in run.requests], np.int64),
            "scheduled": np.array([r["first_scheduled_ns"] or -1 for r in run.requests], np.int64),
        },
    )
    con.register("_lumen_g", _step_gc(run.steps, run.pauses[1].gc))
    try:
        _load_memberships(con, run_id, run)
    finally:
        con.unregister("_lumen_w")
        con.unregister("_lumen_g")
    return run


def _step_gc(steps: list[tuple[Any, ...]], gc: Intervals) -> dict[str, np.ndarray]:
    """The core's GC pauses inside each step's schedule, execute and output intervals."""
    cols = np.array([s[1:6] for s in steps], dtype=np.int64).reshape(-1, 5)
    start, out, sched, exe = cols[:, 0], cols[:, 1], cols[:, 2], cols[:, 3]
    bounds = [start, start + sched, start + sched + exe, out]
    inside = [np.maximum(gc.before(b) - gc.before(a), 0) for a, b in itertools.pairwise(bounds)]
    ids = np.array([s[0] for s in steps], dtype=np.int64)
    return {"step_id": ids, "sg": inside[0], "eg": inside[1], "og": inside[2]}


# Who took part in each step, mapped to request rows (one row per request and step): a core id
# is the request id itself, or "{id}-{i}" for sample i of an n > 1 request ("{i}_{id}" in trace
# dbs recorded before engine/request_ids.py). A row is in its
# TTFT phase until the step whose output reached the frontend as its first token.
_MEMBERS = """
WITH m0 AS (
    SELECT step_id, unnest(request_ids) AS core_id, unnest(num_scheduled) AS tokens
    FROM steps WHERE run_id = $run AND request_ids IS NOT NULL
),
m AS (
    SELECT m0.step_id, coalesce(a.request_id, b.request_id, c.request_id) AS request_id,
        sum(coalesce(m0.tokens, 0)) AS tokens
    FROM m0 LEFT JOIN _lumen_w a ON a.request_id = m0.core_id
    LEFT JOIN _lumen_w b ON b.request_id = regexp_replace(m0.core_id, $child, '')
    LEFT JOIN _lumen_w c ON c.request_id = regexp_replace(m0.core_id, $old_sample, '')
    GROUP BY ALL
),
st AS (
    -- Outputs still leaving the core when the next step began overlap that step: cut there.
    SELECT *, least(output_ns, coalesce(lead(schedule_start_ns) OVER (ORDER BY step_id),
        output_ns)) AS out_end, __GMASK__ AS gmask
    FROM steps WHERE run_id = $run
),
j AS (
    SELECT m.request_id, m.tokens, s.*, g.sg, g.eg, g.og,
        CASE WHEN w.ft < 0 OR s.output_ns <= w.ft THEN 'ttft' ELSE 'decode' END AS phase,
        CASE WHEN w.ft < 0 OR s.output_ns <= w.ft THEN w.t_lo ELSE w.t_hi END AS lo,
        CASE WHEN w.ft < 0 OR s.output_ns <= w.ft THEN w.t_hi ELSE w.d_hi END AS hi,
        -- The step's cost in the run's own units (step_weights): its fixed and per-row cost
        -- shared by its rows, its prefill tokens, and (token shares) its decode tokens.
        greatest($a + $b * s.num_prefill_tokens + $c * len(s.request_ids)
            + $d * s.num_decode_tokens, 1e-9) AS nst,
        $a / greatest(len(s.request_ids), 1) + $c AS per_row
    FROM m JOIN st s ON s.step_id = m.step_id
    JOIN _lumen_w w ON w.request_id = m.request_id
    LEFT JOIN _lumen_g g ON g.step_id = s.step_id
),
c AS (
    SELECT *,
        greatest(0, least(execute_start_ns, hi) - greatest(schedule_start_ns, lo)) AS sched,
        -- Structured outputs' token masks: between the scheduler's decision and the execute.
        CASE WHEN gmask > 0 THEN greatest(0, least(execute_start_ns, hi)
            - greatest(schedule_end_ns, lo)) ELSE 0 END AS gram,
        greatest(0, least(execute_end_ns, hi) - greatest(execute_start_ns, lo)) AS exe,
        greatest(0, least(out_end, hi) - greatest(execute_end_ns, lo)) AS outp,
        greatest(execute_start_ns - schedule_start_ns, 1) AS sched_full,
        greatest(execute_end_ns - execute_start_ns, 1) AS exe_full,
        greatest(out_end - execute_end_ns, 1) AS out_full
    FROM j
),
p AS (
    SELECT *, coalesce(sg, 0) * sched / sched_full AS gs, coalesce(eg, 0) * exe / exe_full AS ge,
        coalesce(og, 0) * outp / out_full AS go
    FROM c
),
q AS (
    SELECT *, exe - ge AS net,
        CASE WHEN phase = 'ttft' THEN (exe - ge) * least(($b * tokens + per_row) / nst, 1)
            ELSE 0 END AS own,
        (exe - ge) * least(($b * greatest(num_prefill_tokens
            - CASE WHEN phase = 'ttft' THEN tokens ELSE 0 END, 0)) / nst, 1) AS nb
    FROM p
)
"""


def members_sql(con: duckdb.DuckDBPyConnection) -> str:
    """_MEMBERS for this db: a store from before migration 4 has no grammar masks."""
    have = _columns(con, "steps")
    mask = "coalesce(grammar_mask_ns, 0)" if "grammar_mask_ns" in have else "0"
    return _MEMBERS.replace("__GMASK__", mask)


def fit_step_shape(prefill: np.ndarray, rows: np.ndarray, execute: np.ndarray) -> np.ndarray | None:
    """Execute time = a + b * prefill tokens + c * rows, fitted on a run's busy steps after the
    first COLD_STEPS (None with fewer than MIN_FIT_STEPS).

    Least squares, then again without the steps it misses by more than 3 robust deviations
    (a step slowed by contention or a pause must not set the price of a token), except steps
    that carried MIN_PRICED_PREFILL prefill tokens: in a run of decodes the few long prefills
    are the only steps that price a prefill token, and the first fit (which the decodes
    dominate) misses exactly them; dropped, every long prefill would read as contention.
    No coefficient is negative (_nonnegative_fit), and a prefill token is never priced above a
    whole row (it is the same matmul work, batched). Where no step carried MIN_PRICED_PREFILL
    prefill tokens, or the price is within 3 standard errors of 0, a prefill token's own price
    cannot be told from noise: b is 0 and steps cost by their rows."""
    x = np.column_stack([np.ones(len(prefill)), prefill, rows]).astype(float)[COLD_STEPS:]
    y = np.asarray(execute, dtype=float)[COLD_STEPS:]
    if len(y) < MIN_FIT_STEPS:
        return None
    if x[:, 1].max() < MIN_PRICED_PREFILL:
        x[:, 1] = 0.0
    coef = _nonnegative_fit(x, y)
    residual = y - x @ coef
    spread = 1.4826 * float(np.median(np.abs(residual - np.median(residual)))) or 1.0
    keep = (np.abs(residual) <= 3 * spread) | (x[:, 1] >= MIN_PRICED_PREFILL)
    if keep.sum() >= MIN_FIT_STEPS:
        x, y = x[keep], y[keep]
        coef = _nonnegative_fit(x, y)
    if not _beyond_noise(x, y, coef, 1):  # a price the steps cannot tell from noise: none
        x[:, 1] = 0.0
        coef = _nonnegative_fit(x, y)
    a, b, c = coef
    return np.array([a, min(b, c) if c > 0 else b, c])


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with no negative coefficient: a column whose coefficient comes out
    negative is dropped and the rest refitted (clipping alone would leave the others fitted
    against it: rows nearly constant across a run give a = 94 ms and c = -22 ms per row)."""
    x = x.copy()
    while True:
        coef = np.linalg.lstsq(x, y, rcond=None)[0]
        worst = int(np.argmin(coef))
        if coef[worst] >= 0 or not x[:, worst].any():
            return np.clip(coef, 0.0, None)
        x[:, worst] = 0.0


def _beyond_noise(x: np.ndarray, y: np.ndarray, coef: np.ndarray, i: int) -> bool:
    """Whether coefficient i is at least 3 standard errors above 0, in the model the fit
    kept: a column _nonnegative_fit dropped (coefficient 0) does not count. Counted, a rows
    column that only varies on the long-prefill steps (4 rows everywhere else) would share
    their variance with the prefill price and call a 12 us/token price noise."""
    used = (coef > 0) | (np.arange(len(coef)) == i)
    x, coef, i = x[:, used], coef[used], int(np.count_nonzero(used[:i]))
    dof = len(y) - x.shape[1]
    if dof < 1 or not x[:, i].any():
        return False
    sigma2 = float(np.sum((y - x @ coef) ** 2)) / dof
    cov = sigma2 * np.linalg.pinv(x.T @ x)
    return coef[i] > 3 * np.sqrt(max(cov[i, i], 0.0))


def step_weights(steps: list[tuple[Any, ...]]) -> dict[str, float]:
    """What a step's execute time is made of (fit_step_shape on the run's busy steps). A
    request's share of a step is then its tokens at b against the whole, so a few prefill
    tokens in a step that is mostly fixed cost take little of it. No fit: plain token shares
    (b = d = 1), unless no step carried MIN_PRICED_PREFILL prefill tokens: then, as in the fit,
    a prefill token cannot be priced and steps cost by their rows (a step slowed by contention
    must not be blamed on the few prompt tokens it happened to carry)."""
    busy = [s for s in steps if not s[13] and s[4] is not None]
    coef = fit_step_shape(
        np.array([s[6] for s in busy]), np.array([s[15] for s in busy]),
        np.array([s[4] for s in busy]),
    )  # fmt: skip
    if coef is not None and coef.sum() > 0:
        return {"a": float(coef[0]), "b": float(coef[1]), "c": float(coef[2]), "d": 0.0}
    if max((s[6] or 0 for s in busy), default=0) < MIN_PRICED_PREFILL:
        return {"a": 0.0, "b": 0.0, "c": 1.0, "d": 0.0}
    return {"a": 0.0, "b": 1.0, "c": 0.0, "d": 1.0}


def _load_memberships(con: duckdb.DuckDBPyConnection, run_id: str, run: LoadedRun) -> None:
    params: dict[str, Any] = {
        "run": run_id, "child": CHILD_SUFFIX, "old_sample": OLD_SAMPLE_PREFIX,
        **step_weights(run.steps),
    }  # fmt: skip
    members = members_sql(con)
    parts = con.execute(
        members
        + """
        SELECT request_id, phase, sum(own), sum(least(nb, net - own)),
            sum(net - own - least(nb, net - own)), sum(greatest(sched - gs - gram, 0)),
            sum(outp - go), sum(gs + ge + go), sum(sched + exe + outp), min(schedule_start_ns),
            max(out_end), list(DISTINCT step_id), sum(least(gram, sched - gs))
        FROM q GROUP BY request_id, phase
        """,
        params,
    ).fetchall()
    keys = (
        "own_prefill",
        "neighbour_prefill",
        "decode",
        "schedule",
        "output",
        "gc",
        "total",
        "first_start",
        "last_output",
        "step_ids",
        "grammar_mask",
    )
    for rid, phase, *values in parts:
        run.step_parts[(rid, phase)] = dict(zip(keys, values))
    _load_neighbours(con, params, run, members)
    _load_queue_and_preemptions(con, params, run, members)


def _load_neighbours(
    con: duckdb.DuckDBPyConnection, params: dict[str, str], run: LoadedRun, members: str
) -> None:
    rows = con.execute(
        members + "SELECT step_id, request_id, sum(tokens) FROM j WHERE phase = 'ttft' "
        "GROUP BY ALL ORDER BY step_id, sum(tokens) DESC",
        params,
    ).fetchall()
    for step_id, rid, tokens in rows:
        run.prefill_members.setdefault(step_id, []).append((rid, int(tokens)))
    pairs = con.execute(
        members
        + """
        , mine AS (SELECT DISTINCT request_id, step_id, phase FROM j)
        SELECT a.request_id, a.phase, b.request_id, sum(b.tokens), list(DISTINCT b.step_id)
        FROM mine a JOIN j b ON a.step_id = b.step_id AND a.request_id <> b.request_id
        WHERE b.phase = 'ttft' GROUP BY ALL
        """,
        params,
    ).fetchall()
    for rid, phase, other, tokens, step_ids in pairs:
        run.neighbours.setdefault((rid, phase), {})[other] = (int(tokens), sorted(step_ids))


def _load_queue_and_preemptions(
    con: duckdb.DuckDBPyConnection, params: dict[str, str], run: LoadedRun, members: str
) -> None:
    if "wait_reason" in _columns(con, "steps"):
        held = con.execute(
            members
            + """
            , firsts AS (SELECT request_id, min(schedule_start_ns) AS first FROM j GROUP BY ALL)
            SELECT w.request_id, mode(s.wait_reason)
            FROM _lumen_w w LEFT JOIN firsts f USING (request_id)
            JOIN steps s ON s.run_id = $run AND s.schedule_start_ns >= w.received
                AND s.schedule_start_ns < coalesce(nullif(w.scheduled, -1), f.first, w.d_hi)
            WHERE w.received >= 0 AND coalesce(s.wait_reason, '') <> ''
            GROUP BY w.request_id
            """,
            params,
        ).fetchall()
        run.wait_reasons = dict(held)
    preempted = con.execute(
        members
        + """
        , p0 AS (
            SELECT step_id, schedule_start_ns AS t0, unnest(preempted_request_ids) AS core_id
            FROM steps WHERE run_id = $run AND len(preempted_request_ids) > 0
        ),
        pr AS (
            SELECT p0.step_id, p0.t0,
                coalesce(a.request_id, b.request_id, c.request_id) AS request_id
            FROM p0 LEFT JOIN _lumen_w a ON a.request_id = p0.core_id
            LEFT JOIN _lumen_w b ON b.request_id = regexp_replace(p0.core_id, $child, '')
            LEFT JOIN _lumen_w c ON c.request_id = regexp_replace(p0.core_id, $old_sample, '')
        )
        SELECT pr.request_id, pr.t0,
            coalesce(min(j.schedule_start_ns) FILTER (WHERE j.step_id > pr.step_id),
                any_value(w.d_hi))
        FROM pr JOIN _lumen_w w ON w.request_id = pr.request_id
        LEFT JOIN j ON j.request_id = pr.request_id
        GROUP BY pr.request_id, pr.step_id, pr.t0
        """,
        params,
    ).fetchall()
    for rid, t0, t1 in preempted:
        run.preemptions.setdefault(rid, []).append((t0, t1))


def matching_ids(con: duckdb.DuckDBPyConnection, request_id: str) -> list[str]:
    rows = con.execute(
        "SELECT DISTINCT request_id FROM requests WHERE request_id = ? "
        "OR (starts_with(request_id, ?) AND regexp_full_match(substr(request_id, ?), '[0-9]+')) "
        "ORDER BY request_id",
        [request_id, request_id + "-", len(request_id) + 2],
    ).fetchall()
    return [r for (r,) in rows]


def run_of(con: duckdb.DuckDBPyConnection, request_id: str) -> str | None:
    """The latest run holding the request."""
    row = con.execute(
        "SELECT run_id FROM requests WHERE request_id = ? ORDER BY arrival_ns DESC LIMIT 1",
        [request_id],
    ).fetchone()
    return row[0] if row else None
