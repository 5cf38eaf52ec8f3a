"""What `tracing.diagnose` reads from a trace db, as typed facts: the requests, the steps, who
took part in each step and whom each step preempted, and the pauses. No arithmetic on them here:
``tracing.shares`` and ``tracing.step_members`` compute from these.

Older dbs (migration 1 only) lack the columns of migration 2 and the pauses table: they read as
NULL, and the spans stand in where they can (sent, received, first and last delivery).
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

import duckdb
import numpy as np

from engine.request_ids import CHILD_SUFFIX, OLD_SAMPLE_PREFIX
from tracing.diagnosis import LifecycleRow, StepFacts
from tracing.pauses import PauseRow
from tracing.shares import Memberships, StepTimes
from tracing.stalls import join_tokens


@dataclass
class RequestFacts:
    """One request row, with the spans standing in for instants an older db lacks."""

    request_id: str
    status: str | None
    error: str | None
    arrival_ns: int
    prompt_tokens: int | None
    cached_tokens: int | None
    output_tokens: int | None
    ttft_ns: int | None
    e2e_ns: int | None
    num_preemptions: int | None
    stream: bool | None
    http_start_ns: int | None
    handler_ns: int | None
    sent_ns: int | None
    received_ns: int | None
    first_scheduled_ns: int | None
    admission_wait_ns: int | None
    first_delivered_ns: int | None
    last_delivered_ns: int | None
    delivered_ttft_ns: int | None
    send_wait_ns: int | None
    bytes_sent: int | None
    kv_freed_ns: int | None
    grammar_ready_ns: int | None
    body_bytes: int | None
    body_read_ns: int | None  # the body read whole; decoded and validated until handler_ns
    sample_weight: float | None  # the requests it stands for (a sampled import; NULL: 1)
    last_emit_start_ns: int | None  # the last frontend.emit span began
    emit_ends_ns: list[int] | None  # each frontend.emit span's end, in order
    emit_step_ids: list[int | None] | None  # the step each frontend.emit span came from
    emit_starts_ns: list[int] | None  # each frontend.emit span's start: the frontend received it
    end_code: str | None  # what ended it where it did not finish (migration 8)
    resent_ns: int | None  # sent again to a new engine core (migration 8)
    grammar: str | None  # its structured output's kind (migration 4)
    params: str | None  # its sampling parameters (JSON)
    engine: int | None = None  # the data-parallel engine that served it (migration 10)
    routed: str | None = None  # why it went to that engine (migration 11)
    lora_name: str | None = None  # its LoRA adapter (migration 13)


@dataclass
class RunFacts:
    requests: list[RequestFacts]
    steps: list[StepFacts]  # in step order, idle records too
    step_times: StepTimes  # the same steps, as arrays of instants
    members: Memberships
    preempted: Memberships  # (step, request) for each request a step preempted; tokens 0
    pauses: list[PauseRow]
    step_prior: list[float] | None = None  # the warm-up's [a, b, c, f, g] (tracing.step_fit)
    lifecycle: list[LifecycleRow] = field(default_factory=list)  # drains, restarts
    stream_interval: int = 1  # tokens a write took (lumen serve --stream-interval)
    replica: str | None = None  # the replica that recorded the run (runs.replica)
    max_num_seqs: int | None = None  # each engine's limit on running requests
    # One data-parallel engine's part of a run (engine_split.by_engine): when another engine
    # had room (its last step had nobody waiting and fewer running than max_num_seqs), and
    # which engine.
    others_room: list[tuple[int, int, int]] = field(default_factory=list)  # start, end, engine


def load_step_prior(con: duckdb.DuckDBPyConnection, run_id: str) -> list[float] | None:
    """The run's warm-up prior, where its db and its engine recorded one."""
    if "step_prior" not in _columns(con, "runs"):
        return None
    row = con.execute("SELECT step_prior FROM runs WHERE run_id = ?", [run_id]).fetchone()
    prior = list(row[0]) if row and row[0] else []
    return prior if len(prior) in (3, 4, 5) else None  # [a, b, c(, f(, g))]


def load_max_num_seqs(con: duckdb.DuckDBPyConnection, run_id: str) -> int | None:
    """Each engine's --max-num-seqs in the run, where its configuration was recorded."""
    row = con.execute(
        "SELECT TRY_CAST(json_extract(engine_config, '$.max_num_seqs') AS INTEGER) "
        "FROM runs WHERE run_id = ?",
        [run_id],
    ).fetchone()
    return int(row[0]) if row and row[0] else None


def load_stream_interval(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    """The tokens a write took in the run (--stream-interval), 1 where it recorded none."""
    row = con.execute(
        "SELECT TRY_CAST(json_extract(engine_config, '$.stream_interval') AS INTEGER) "
        "FROM runs WHERE run_id = ?",
        [run_id],
    ).fetchone()
    return row[0] if row and row[0] and row[0] > 1 else 1


def _columns(con: duckdb.DuckDBPyConnection, table: str) -> set[str]:
    rows = con.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]
    ).fetchall()
    return {c for (c,) in rows}


def _select(have: set[str], names: list[str], alias: str) -> str:
    return ", ".join(f"{alias}.{n}" if n in have else f"NULL AS {n}" for n in names)


def _records(cur: duckdb.DuckDBPyConnection) -> list[dict[str, Any]]:
    names = [d[0] for d in cur.description or []]
    return [dict(zip(names, row)) for row in cur.fetchall()]


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
    "body_bytes",
    "body_read_ns",
    "sample_weight",
    "end_code",
    "resent_ns",
    "grammar",
    "engine",
    "routed",
    "lora_name",
]
STEP_COLUMNS = [
    "step_id",
    "schedule_start_ns",
    "schedule_end_ns",
    "execute_start_ns",
    "execute_end_ns",
    "output_ns",
    "num_running",
    "num_waiting",
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
    "sample_ns",
    "logprobs_ns",
    "logprobs_rows",
    "max_logprobs",
    "spec_tokens",
]


def load_requests(con: duckdb.DuckDBPyConnection, run_id: str) -> list[RequestFacts]:
    """The run's request rows, in arrival order; spans stand in for instants an older db lacks."""
    have = _columns(con, "requests")
    cur = con.execute(
        f"""
        WITH request_spans AS (
            SELECT request_id, trace_id,
                max(end_ns) FILTER (WHERE name = 'frontend.enqueue') AS enqueue_end_ns,
                min(end_ns) FILTER (WHERE name = 'core.receive') AS receive_end_ns,
                min(end_ns) FILTER (WHERE name = 'frontend.emit') AS first_emit_end_ns,
                max(start_ns) FILTER (WHERE name = 'frontend.emit') AS last_emit_start_ns,
                max(end_ns) FILTER (WHERE name = 'frontend.emit') AS last_emit_end_ns,
                -- by step too: one write can carry two steps' tokens (a frontend behind
                -- its core), and their emits then end at the same instant
                list(end_ns ORDER BY end_ns, step_id) FILTER (WHERE name = 'frontend.emit')
                    AS emit_ends_ns,
                list(step_id ORDER BY end_ns, step_id) FILTER (WHERE name = 'frontend.emit')
                    AS emit_step_ids,
                list(start_ns ORDER BY end_ns, step_id) FILTER (WHERE name = 'frontend.emit')
                    AS emit_starts_ns
            FROM spans WHERE run_id = $run GROUP BY ALL
        )
        SELECT r.request_id, r.status, r.error, r.arrival_ns, r.prompt_tokens, r.cached_tokens,
            r.output_tokens,
            r.ttft_ns, r.e2e_ns, r.num_preemptions, r.params,
            {_select(have, NEW_REQUEST_COLUMNS, "r")},
            sp.enqueue_end_ns, sp.receive_end_ns, sp.first_emit_end_ns, sp.last_emit_start_ns,
            sp.last_emit_end_ns, sp.emit_ends_ns, sp.emit_step_ids, sp.emit_starts_ns
        FROM requests r LEFT JOIN request_spans sp ON sp.request_id = r.request_id
            AND (r.trace_id IS NULL OR sp.trace_id = r.trace_id)
        WHERE r.run_id = $run ORDER BY r.arrival_ns, r.request_id
        """,
        {"run": run_id},
    )
    names = {f.name for f in fields(RequestFacts)}
    out = []
    for row in _records(cur):
        row["sent_ns"] = row["sent_ns"] or row["enqueue_end_ns"]
        row["received_ns"] = row["received_ns"] or row["receive_end_ns"]
        if row["stream"] is not False:
            row["first_delivered_ns"] = row["first_delivered_ns"] or row["first_emit_end_ns"]
        row["last_delivered_ns"] = row["last_delivered_ns"] or row["last_emit_end_ns"]
        out.append(RequestFacts(**{k: v for k, v in row.items() if k in names}))
    return out


def _step_rows(con: duckdb.DuckDBPyConnection, run_id: str) -> list[dict[str, Any]]:
    have = _columns(con, "steps")
    # Speculative decoding thrown away, inside execute: the refused drafts' share of the forward
    # (their tokens over the step's) and of the proposer's time that made the step's drafts
    # (their count over the drafts'). Kept drafts' cost is decode's: it bought their tokens.
    spec, drafts = "0", "0 AS drafted, 0 AS kept"
    if "num_drafted" in have:
        drafts = ("coalesce(list_sum(s.num_drafted), 0) AS drafted, "
                  "coalesce(list_sum(s.num_accepted), 0) AS kept")  # fmt: skip
        spec = """coalesce((coalesce(list_sum(s.num_drafted), 0)
                           - coalesce(list_sum(s.num_accepted), 0))
            * ((s.execute_end_ns - s.execute_start_ns - coalesce(s.sample_ns, 0)
                - coalesce(s.logprobs_ns, 0) - coalesce(s.propose_ns, 0))
               / greatest(s.num_scheduled_tokens, 1)
               + coalesce(s.propose_ns, 0) / greatest(list_sum(s.num_drafted), 1)), 0)"""
    cur = con.execute(
        f"""
        SELECT {_select(have, STEP_COLUMNS, "s")}, coalesce(len(s.request_ids), 0) AS num_rows,
            ({spec})::BIGINT AS spec_ns, {drafts}
        FROM steps s WHERE s.run_id = ? ORDER BY s.step_id, s.schedule_start_ns
        """,
        [run_id],
    )
    return _records(cur)


def _step_facts(s: dict[str, Any], join_tokens: int) -> StepFacts:
    return StepFacts(
        step_id=s["step_id"],
        start_ns=s["schedule_start_ns"],
        end_ns=s["output_ns"],
        schedule_ns=s["execute_start_ns"] - s["schedule_start_ns"],
        execute_ns=s["execute_end_ns"] - s["execute_start_ns"],
        output_ns=s["output_ns"] - s["execute_end_ns"],
        prefill_tokens=s["num_prefill_tokens"] or 0,
        decode_tokens=s["num_decode_tokens"] or 0,
        running=s["num_running"] or 0,
        waiting=s["num_waiting"] or 0,
        preemptions=s["num_preemptions"] or 0,
        kv_blocks_used=s["kv_blocks_used"] or 0,
        kv_blocks_total=s["kv_blocks_total"] or 0,
        idle=bool(s["idle"]),
        wait_reason=s["wait_reason"] or None,
        rows=s["num_rows"],
        build_ns=None if s["update_end_ns"] is None else s["update_end_ns"] - s["execute_end_ns"],
        gc_pause_ns=s["gc_pause_ns"] or 0,
        grammar_mask_ns=s["grammar_mask_ns"] or 0,
        sample_ns=s["sample_ns"] or 0,
        logprobs_ns=s["logprobs_ns"] or 0,
        spec_ns=s["spec_ns"] or 0,
        drafted=s["drafted"] or 0,
        kept=s["kept"] or 0,
        spec_tokens=-1 if s["spec_tokens"] is None else s["spec_tokens"],
        logprobs_rows=s["logprobs_rows"] or 0,
        max_logprobs=s["max_logprobs"] or 0,
        join_tokens=join_tokens,
    )


def _step_times(rows: list[dict[str, Any]], members: Memberships) -> StepTimes:
    def col(name: str) -> np.ndarray:
        return np.array([r[name] or 0 for r in rows], dtype=np.int64)

    step_id = col("step_id")
    return StepTimes(
        step_id=step_id,
        schedule_start_ns=col("schedule_start_ns"),
        schedule_end_ns=col("schedule_end_ns"),
        execute_start_ns=col("execute_start_ns"),
        execute_end_ns=col("execute_end_ns"),
        output_ns=col("output_ns"),
        prefill_tokens=col("num_prefill_tokens"),
        decode_tokens=col("num_decode_tokens"),
        rows=col("num_rows"),
        grammar_mask_ns=col("grammar_mask_ns"),
        sample_ns=col("sample_ns"),
        logprobs_ns=col("logprobs_ns"),
        spec_ns=col("spec_ns"),
        join_tokens=join_tokens(step_id, members),
    )


# A core id is the request id itself, or "{id}-{i}" for sample i of an n > 1 request ("{i}_{id}"
# in trace dbs recorded before engine/request_ids.py): the first of the three that names one of
# the run's request rows. Ids that name none are left out.
_REQUEST_OF_CORE_ID = """
    SELECT ids.*, coalesce(exact.request_id, child.request_id, old.request_id) AS request_id
    FROM {ids} ids
    LEFT JOIN run_requests exact ON exact.request_id = ids.core_id
    LEFT JOIN run_requests child ON child.request_id = regexp_replace(ids.core_id, $child, '')
    LEFT JOIN run_requests old ON old.request_id = regexp_replace(ids.core_id, $old_sample, '')
"""


def _memberships(con: duckdb.DuckDBPyConnection, run_id: str, column: str) -> Memberships:
    """Per step and request row: the tokens it was scheduled (``request_ids``; a row verifying
    drafts counts its one token, as the decode row it is: its drafts are its decode's cost), or
    the rows the step preempted (``preempted_request_ids``, tokens 0); in the step's own order."""
    tokens = "unnest(num_scheduled)" if column == "request_ids" else "0"
    drafted = "0"
    if column == "request_ids" and "num_drafted" in _columns(con, "steps"):
        drafted = "unnest(num_drafted)"
    cur = con.execute(
        f"""
        WITH run_requests AS (SELECT DISTINCT request_id FROM requests WHERE run_id = $run),
        step_core_ids AS (
            SELECT step_id, unnest({column}) AS core_id,
                {tokens} - coalesce({drafted}, 0) AS tokens,
                unnest(range(len({column}))) AS position
            FROM steps WHERE run_id = $run AND len({column}) > 0
        ),
        step_requests AS ({_REQUEST_OF_CORE_ID.format(ids="step_core_ids")})
        SELECT step_id, request_id, sum(coalesce(tokens, 0))::BIGINT AS tokens
        FROM step_requests WHERE request_id IS NOT NULL
        GROUP BY step_id, request_id ORDER BY step_id, min(position)
        """,
        {"run": run_id, "child": CHILD_SUFFIX, "old_sample": OLD_SAMPLE_PREFIX},
    )
    rows = _records(cur)
    return Memberships(
        step_id=np.array([r["step_id"] for r in rows], dtype=np.int64),
        request_id=[r["request_id"] for r in rows],
        tokens=np.array([r["tokens"] for r in rows], dtype=np.int64),
    )


def load_pauses(con: duckdb.DuckDBPyConnection, run_id: str) -> list[PauseRow]:
    """The run's pauses, and its engine restarts as pauses of the server (process "server",
    kind "restart": found dead or hung to the new core ready); none where the db predates
    the pauses table (or the lifecycle table)."""
    rows: list[PauseRow] = []
    if have := _columns(con, "pauses"):
        cpu = "cpu_ns" if "cpu_ns" in have else "NULL AS cpu_ns"  # migration 14
        cur = con.execute(
            f"SELECT process, kind, start_ns, duration_ns, {cpu} FROM pauses WHERE run_id = ? "
            "AND duration_ns > 0 ORDER BY start_ns",
            [run_id],
        )
        rows = [PauseRow(**r) for r in _records(cur)]
    if have := _columns(con, "lifecycle"):
        # One engine's restart, where the run had several: "engine N" (engine_split keeps it
        # for that engine's requests only).
        process = (
            "CASE WHEN engine IS NULL THEN 'server' ELSE 'engine ' || engine END"
            if ("engine" in have and _data_parallel_size(con, run_id) > 1)
            else "'server'"
        )
        cur = con.execute(
            f"SELECT {process} AS process, 'restart' AS kind, start_ns, "
            "end_ns - start_ns AS duration_ns FROM lifecycle WHERE run_id = ? "
            "AND kind IN ('restart', 'crash_loop') AND end_ns > start_ns ORDER BY start_ns",
            [run_id],
        )
        rows += [PauseRow(**r) for r in _records(cur)]
    return rows


def load_lifecycle(con: duckdb.DuckDBPyConnection, run_id: str) -> list[LifecycleRow]:
    """The run's drains, engine restarts and crash loop; none where the db predates them."""
    if not (have := _columns(con, "lifecycle")):
        return []
    engine = "engine" if "engine" in have else "NULL AS engine"
    cur = con.execute(
        "SELECT kind, cause, start_ns, end_ns, epoch, num_finished, num_failed, "
        f"{engine} FROM lifecycle WHERE run_id = ? ORDER BY start_ns",
        [run_id],
    )
    return [LifecycleRow(**r) for r in _records(cur)]


def _data_parallel_size(con: duckdb.DuckDBPyConnection, run_id: str) -> int:
    if "data_parallel_size" not in _columns(con, "runs"):
        return 1
    row = con.execute("SELECT data_parallel_size FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return int(row[0]) if row and row[0] else 1


def load_replica(con: duckdb.DuckDBPyConnection, run_id: str) -> str | None:
    """The replica that recorded the run (a fleet's view names every store's runs), where its
    db keeps one."""
    if "replica" not in _columns(con, "runs"):
        return None
    row = con.execute("SELECT replica FROM runs WHERE run_id = ?", [run_id]).fetchone()
    return str(row[0]) if row and row[0] else None


def load_run(con: duckdb.DuckDBPyConnection, run_id: str) -> RunFacts:
    steps = _step_rows(con, run_id)
    preempted = (
        _memberships(con, run_id, "preempted_request_ids")
        if "preempted_request_ids" in _columns(con, "steps")
        else Memberships(np.zeros(0, np.int64), [], np.zeros(0, np.int64))
    )
    requests = load_requests(con, run_id)
    members = _after_resend(_memberships(con, run_id, "request_ids"), requests, steps)
    times = _step_times(steps, members)
    return RunFacts(
        requests=requests,
        steps=[_step_facts(s, j) for s, j in zip(steps, times.join_tokens.tolist())],
        step_times=times,
        members=members,
        preempted=preempted,
        pauses=load_pauses(con, run_id),
        step_prior=load_step_prior(con, run_id),
        lifecycle=load_lifecycle(con, run_id),
        stream_interval=load_stream_interval(con, run_id),
        replica=load_replica(con, run_id),
        max_num_seqs=load_max_num_seqs(con, run_id),
    )


def _after_resend(
    members: Memberships, requests: list[RequestFacts], steps: list[dict[str, Any]]
) -> Memberships:
    """Without the steps a request took part in on a core that failed before it was sent
    again (they began before its resent_ns): lost work, inside its wait for the new core."""
    resent = {r.request_id: r.resent_ns for r in requests if r.resent_ns}
    if not resent:
        return members
    started = {s["step_id"]: s["schedule_start_ns"] for s in steps}
    keep = np.array([
        started.get(int(step), 0) >= resent.get(rid, 0)
        for step, rid in zip(members.step_id, members.request_id)
    ], dtype=bool)  # fmt: skip
    return Memberships(
        members.step_id[keep],
        [rid for rid, k in zip(members.request_id, keep) if k],
        members.tokens[keep],
    )


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
    return str(row[0]) if row else None
