"""A fleet's traces rebuilt from OTLP: two replicas, each on its own port with its own store,
export at --otlp-detail store to one collector (a real OTLP receiver); what it received, and
each store exported as OTLP JSON or written into the ClickHouse exporter's table (chdb),
imports back into a store on which `lumen trace why`, `replay report` and `replay run`'s
workload are the original's. Bad input is a one-line error that writes nothing."""

from __future__ import annotations

import contextlib
import io
import json
import re
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from replay.cli import main as replay
from replay.workload import load_workload
from service.cli import main as lumen
from tests.helpers.clickhouse import chdb_session, tail_sample, write_otel_traces
from tests.helpers.load import SlowReader, stream_chat, wait_until
from tests.helpers.server import ROOT, LumenServer, metric
from tracing import otlp_json
from tracing.diagnosis import percentiles
from tracing.otlp_records import KEEP
from tracing.receiver import OtlpReceiver
from tracing.store import open_db
from tracing.store_schema import TABLES

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip


def _post(server: LumenServer, body: dict, path: str = "/v1/completions") -> str:
    r = httpx.post(server.url(path), json=body, headers=server.headers(), timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-request-id"]


def _provoke(server: LumenServer) -> dict[str, str]:
    """A noisy neighbour, a queue held by KV blocks, a slow reader, a cancellation and a
    grammar request, on one replica; returns the request ids to explain."""
    ids: dict[str, str] = {}

    def decoder() -> None:
        # Long enough to be seen running on the fastest CPU (60 tokens were over before the
        # first poll on a Zen 5); their blocks make the long prompt below wait for KV blocks.
        ids["victim"] = _post(server, {"prompt": "Go", "max_tokens": 300, "ignore_eos": True})

    threads = [threading.Thread(target=decoder) for _ in range(2)]
    for t in threads:
        t.start()
    wait_until(lambda: metric(server.metrics(), "lumen:num_requests_running") >= 2, 30)
    # 119 blocks of 128 for the long prompt: while it runs, the first chunk of neither prompt
    # after it fits, and they wait for KV blocks whatever order they came in. (With 94 blocks,
    # a prompt that came last was admitted on the token budget the long prompt's last chunk
    # left, then preempted: on a loaded machine no step waited for blocks.)
    bodies = [{"prompt": [100] * 1900, "max_tokens": 20, "ignore_eos": True},
              *({"prompt": [200 + i] * 600, "max_tokens": 4} for i in range(2))]  # fmt: skip
    held = [threading.Thread(target=_post, args=(server, b)) for b in bodies]
    for t in held:
        t.start()
    reader = SlowReader(server, {"prompt": "Read", "max_tokens": 30, "ignore_eos": True},
                        stall_s=0.5)  # fmt: skip
    slow = threading.Thread(target=reader.run)
    slow.start()
    stream_chat(server, {"messages": [{"role": "user", "content": "Talk"}], "max_tokens": 200,
                         "ignore_eos": True}, stop_after=3)  # fmt: skip
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    ids["grammar"] = _post(server, {"messages": [{"role": "user", "content": "A number"}],
                                    "max_tokens": 12, "response_format": rf},
                           "/v1/chat/completions")  # fmt: skip
    # A request refused before the engine: traced as an error, marked to be kept.
    bad = httpx.post(server.url("/v1/completions"), json={"prompt": "x", "max_tokens": -1},
                     headers=server.headers(), timeout=30)  # fmt: skip
    assert 400 <= bad.status_code < 500, bad.text
    for t in [*threads, *held, slow]:
        t.join()
    ids["slow_reader"] = reader.request_id
    return ids


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    folder = tmp_path_factory.mktemp("otlp-fleet")
    stores = folder / "stores"
    with OtlpReceiver(keep=True) as receiver:
        # Only failed requests are marked for a collector's tail sampling to keep (how slow a
        # request is depends on the machine).
        args = ("--num-kv-blocks", "128", "--max-num-batched-tokens", "512",
                "--trace-flush-interval", "0.2", "--otlp-detail", "store",
                "--otlp-traces-endpoint", receiver.endpoint,
                "--otlp-keep-slower-than", "1000")  # fmt: skip
        servers = [
            LumenServer(tiny_model_path, *args, "--service-instance-id", name, wait=False,
                        log_path=folder / f"{name}.log", trace_db=stores / f"{name}.db")
            for name in ("replica-a", "replica-b")
        ]  # fmt: skip
        try:
            for server in servers:
                server.wait_healthy()
            ids = _provoke(servers[0])
            ids["other"] = _post(servers[1], {"prompt": "Hello", "max_tokens": 8})
        finally:
            for server in servers:
                server.stop(drain=5)  # the drain flushes the store and OTLP
        received = folder / "collector.jsonl"
        assert receiver.write_otlp_json(str(received)) > 0
    return folder, stores, received, ids


def _out(cli, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(argv) == 0, argv
    return out.getvalue()


def _rows(db: Path | list[Path]) -> dict[str, list[tuple]]:
    """Every table's rows, sorted, the replica column left out."""
    with open_db(db) as con:
        return {
            t: con.execute(f"SELECT {', '.join(cols)} FROM {t} ORDER BY ALL").fetchall()
            for t, cols in TABLES.items()
        }


def _same_as_original(rebuilt: Path, originals: list[Path], ids: dict[str, str]) -> None:
    assert _rows(rebuilt) == _rows(originals)
    for key in ("victim", "slow_reader", "grammar"):
        alone = _out(lumen, ["trace", "why", ids[key], "--db", str(originals[0])])
        assert _out(lumen, ["trace", "why", ids[key], "--db", str(rebuilt)]) == alone
    with open_db(originals[0]) as con:
        [(run,)] = con.execute("SELECT run_id FROM runs").fetchall()
    report = _out(replay, ["report", str(originals[0])])
    # A store rebuilt from both replicas lists both runs first.
    assert _out(replay, ["report", str(rebuilt), "--run", run]).endswith(report)


def test_the_recording_has_what_the_round_trips_must_keep(fleet) -> None:
    _, stores, _, ids = fleet
    with open_db(stores / "replica-a.db") as con:
        facts = con.execute(
            "SELECT count(*) FILTER (status = 'aborted'), count(grammar), "
            "max(send_wait_ns) FILTER (request_id = ?) FROM requests",
            [ids["slow_reader"]],
        ).fetchone()
        reasons = {r for (r,) in con.execute("SELECT DISTINCT wait_reason FROM steps").fetchall()}
        spans = con.execute("SELECT count(*) FROM spans").fetchone()[0]
    print("aborted, grammar, slow reader's send wait:", facts, "wait reasons:", reasons)
    assert facts[0] >= 1 and facts[1] == 1 and facts[2] > 0
    assert "kv_blocks" in reasons
    assert spans > 500


def test_what_the_collector_received_rebuilds_both_stores(fleet, tmp_path: Path) -> None:
    _, stores, received, ids = fleet
    rebuilt = tmp_path / "rebuilt.db"
    said = _out(replay, ["import", str(received), "--format", "otlp-json", "--out", str(rebuilt)])
    print(said)
    assert said.startswith("2 run(s)")
    _same_as_original(rebuilt, [stores / "replica-a.db", stores / "replica-b.db"], ids)
    # replay run's input: the same workload from either store.
    vocab = np.arange(1000)
    original = load_workload(str(stores / "replica-a.db"), vocab=vocab)
    with open_db(stores / "replica-a.db") as con:
        [(run,)] = con.execute("SELECT run_id FROM runs").fetchall()
    assert load_workload(str(rebuilt), vocab=vocab, run_id=run) == original


def test_store_to_otlp_json_to_store(fleet, tmp_path: Path) -> None:
    _, stores, _, ids = fleet
    exported = tmp_path / "a.jsonl"
    print(_out(replay, ["export", str(stores / "replica-a.db"), "--format", "otlp-json",
                        "--out", str(exported)]))  # fmt: skip
    first = json.loads(exported.read_text().splitlines()[0])
    assert {"resource", "scopeSpans"} <= set(first["resourceSpans"][0])
    rebuilt = tmp_path / "rebuilt.db"
    _out(replay, ["import", str(exported), "--format", "otlp-json", "--out", str(rebuilt)])
    _same_as_original(rebuilt, [stores / "replica-a.db"], ids)


def test_store_to_clickhouse_to_store(fleet, tmp_path: Path) -> None:
    _, stores, received, ids = fleet
    chdb = tmp_path / "chdb"
    chdb.mkdir()
    print(write_otel_traces(chdb, otlp_json.read(received)), "rows in otel_traces")
    window = tmp_path / "window.db"
    print(_out(replay, ["import", f"chdb:{chdb}", "--format", "clickhouse", "--since", "0",
                        "--until", str(time.time()), "--out", str(window)]))  # fmt: skip
    _same_as_original(window, [stores / "replica-a.db", stores / "replica-b.db"], ids)
    # One request and its run around it: explained as on its own replica's store.
    one = tmp_path / "one.db"
    print(_out(replay, ["import", f"chdb:{chdb}", "--format", "clickhouse", "--request",
                        ids["slow_reader"], "--out", str(one)]))  # fmt: skip
    why = _out(lumen, ["trace", "why", ids["slow_reader"], "--db", str(one)])
    print(why)
    assert why == _out(lumen, ["trace", "why", ids["slow_reader"], "--db",
                               str(stores / "replica-a.db")])  # fmt: skip


def test_two_replicas_read_as_one_fleet(fleet) -> None:
    _, stores, _, ids = fleet
    for key, own in (("other", "replica-b.db"), ("victim", "replica-a.db")):
        alone = _out(lumen, ["trace", "why", ids[key], "--db", str(stores / own)])
        assert _out(lumen, ["trace", "why", ids[key], "--db", str(stores)]) == alone
    print(alone)


def _fails(argv: list[str], said: str, out: Path, capsys) -> None:
    assert replay(argv) == 2
    err = capsys.readouterr().err
    print(err)
    assert said in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists() and not list(out.parent.glob(f".{out.name}*"))


def test_bad_input_is_one_line_and_writes_nothing(fleet, tmp_path: Path, capsys) -> None:
    _, _, received, _ = fleet
    out = tmp_path / "out.db"
    truncated = tmp_path / "truncated.jsonl"
    text = received.read_text()
    truncated.write_text(text[: len(text) // 2])
    _fails(["import", str(truncated), "--format", "otlp-json", "--out", str(out)],
           "cut short", out, capsys)  # fmt: skip
    other = tmp_path / "other.jsonl"
    doc = json.loads(text.splitlines()[0])
    for rs in doc["resourceSpans"]:
        for attr in rs["resource"]["attributes"]:
            if attr["key"] == "service.name":
                attr["value"] = {"stringValue": "checkout"}
    other.write_text(json.dumps(doc) + "\n")
    _fails(["import", str(other), "--format", "otlp-json", "--out", str(out)],
           "no span of service 'lumen'", out, capsys)  # fmt: skip
    chdb = tmp_path / "chdb"
    chdb.mkdir()
    session = chdb_session(chdb)
    session.query("CREATE TABLE thin (Timestamp DateTime64(9), TraceId String, SpanName String) "
                  "ENGINE = MergeTree ORDER BY Timestamp")  # fmt: skip
    session.close()
    _fails(["import", f"chdb:{chdb}", "--format", "clickhouse", "--table", "thin", "--since", "0",
            "--out", str(out)], "lacks the columns SpanId", out, capsys)  # fmt: skip
    write_otel_traces(chdb, otlp_json.read(received))
    _fails(["import", f"chdb:{chdb}", "--format", "clickhouse", "--since", "2001-01-01",
            "--until", "2001-01-02", "--out", str(out)], "no Lumen span in otel_traces",
           out, capsys)  # fmt: skip


def test_a_sampled_window_is_weighed_back(fleet, tmp_path: Path) -> None:
    """The compose stack's collector policies over what the replicas sent, its probabilistic
    share keeping every other unmarked request: every marked request and engine trace
    survives, the import weighs the rest by the requests they stand for, and the report says
    so with weighted percentiles."""
    _, stores, received, _ = fleet
    config = yaml.safe_load((ROOT / "dashboards/otel-collector/config.yaml").read_text())
    spans = list(otlp_json.read(received))
    roots = sorted((s for _, s in spans if s.name == "llm_request"), key=lambda s: s.start_ns)
    marked = [s for s in roots if KEEP in s.attributes]
    unmarked = [s.trace_id for s in roots if KEEP not in s.attributes]
    assert [s.error is not None for s in marked] == [True] and len(unmarked) >= 4
    kept = tail_sample(spans, config, picked=set(unmarked[::2]).__contains__)
    assert {s.span_id for _, s in kept if KEEP in s.attributes} == {s.span_id for s in marked}
    assert sum(s.name == "lumen.step" for _, s in kept) == sum(
        s.name == "lumen.step" for _, s in spans
    )
    chdb = tmp_path / "chdb"
    chdb.mkdir()
    write_otel_traces(chdb, kept)
    out = tmp_path / "sampled.db"
    said = _out(replay, ["import", f"chdb:{chdb}", "--format", "clickhouse", "--since", "0",
                         "--until", str(time.time()), "--out", str(out)])  # fmt: skip
    print(said)
    with open_db(stores / "replica-a.db") as con:
        [(run, total)] = con.execute(
            "SELECT run_id, (SELECT count(*) FROM requests) FROM runs"
        ).fetchall()
    with open_db(out) as con:
        rows = con.execute(
            "SELECT request_id, sample_weight, ttft_ns FROM requests WHERE run_id = ?", [run]
        ).fetchall()
    kept_ids = {r[0] for r in rows}
    num_marked = sum(s.attributes["gen_ai.request.id"] in kept_ids for s in marked)
    assert len(rows) < total
    assert f"run {run}: a sampled window: {len(rows)} of about {total} requests kept" in said
    rest = (total - num_marked) / (len(rows) - num_marked)
    assert sorted(w for _, w, _ in rows) == sorted(
        [1.0] * num_marked + [rest] * (len(rows) - num_marked)
    )
    report = _out(replay, ["report", str(out), "--run", run])
    print(report)
    assert "A sampled window" in " ".join(report.split())
    served = [(t / 1e9, w) for _, w, t in rows if t is not None]
    p90 = percentiles([v for v, _ in served], [w for _, w in served])["p90"]
    assert f"{p90 * 1e3:,.1f}" in report  # as the report writes it: 1,619.5


def test_weighing_counts_requests_not_their_prompts_and_not_those_in_flight() -> None:
    """A step's members are core ids: prompts and samples of one request count once (the
    step's request_of says whose they are), and a request whose steps go on past the last kept
    request's end was in flight, not sampled out."""
    from replay.otlp_io import weigh_sampled
    from tracing.store import row

    def request(rid: str, arrival: int, e2e: int) -> tuple:
        return row("requests", run_id="r", request_id=rid, arrival_ns=arrival, e2e_ns=e2e)

    def step(i: int, start: int, members: list[str]) -> tuple:
        return row("steps", run_id="r", step_id=i, schedule_start_ns=start,
                   schedule_end_ns=start + 1, output_ns=start + 2, request_ids=members)  # fmt: skip

    rid = "cmpl-0123456789abcdef"
    rows = {t: [] for t in TABLES}
    rows["requests"] = [request("cmpl-aaaaaaaaaaaaaaaa", 0, 100), request("slow", 0, 90)]
    rows["steps"] = [
        step(0, 10, [f"{rid}-0-0", f"{rid}-0-1", f"{rid}-1-0", "cmpl-aaaaaaaaaaaaaaaa"]),
        step(1, 20, [f"{rid}-1-1", "slow"]),
        step(2, 150, ["in-flight"]),  # after the last kept request ended: still running
    ]
    parents = {("r", f"{rid}-0-0"): rid, ("r", f"{rid}-0-1"): rid}  # one step's request_of
    said = weigh_sampled(rows, {("r", "slow")}, parents)
    assert said == {"r": (2, 3)}  # the two kept, and the multi-prompt one not kept
    weight = list(TABLES["requests"]).index("sample_weight")
    weights = {r[1]: r[weight] for r in rows["requests"]}
    assert weights == {"cmpl-aaaaaaaaaaaaaaaa": 2.0, "slow": 1.0}


def test_weighted_percentiles() -> None:
    assert percentiles([3.0, 1.0, 2.0], [8.0, 1.0, 1.0]) == {
        "p50": 3.0, "p90": 3.0, "p99": 3.0, "max": 3.0,
    }  # fmt: skip
    assert percentiles([1.0, 2.0, 3.0, 4.0], [5.0, 1.0, 1.0, 1.0])["p50"] == 1.0
    assert percentiles([1.0, 2.0], [1.0, 1.0]) == percentiles([1.0, 2.0])


# The ClickHouse source's macros, as grafana/clickhouse-datasource expands them (pkg/macros).
def _expand(sql: str, start_s: int, end_s: int, interval_s: int, variables: dict) -> str:
    sql = re.sub(
        r"\$__timeFilter\((\w+)\)",
        rf"\1 >= toDateTime({start_s}) AND \1 <= toDateTime({end_s})",
        sql,
    )
    sql = re.sub(
        r"\$__timeInterval\((\w+)\)",
        rf"toStartOfInterval(toDateTime(\1), INTERVAL {interval_s} second)",
        sql,
    )
    for name, value in variables.items():
        sql = sql.replace(f"${name}", value)
    assert "$" not in sql, sql
    return sql


def test_the_fleet_dashboard_queries_run_on_clickhouse(fleet, tmp_path: Path) -> None:
    """Every panel of the fleet dashboard, its macros expanded, on the exporter's table."""
    _, _, received, _ = fleet
    chdb = tmp_path / "chdb"
    chdb.mkdir()
    write_otel_traces(chdb, otlp_json.read(received))
    board = json.loads((ROOT / "dashboards/grafana/dashboards/lumen-fleet.json").read_text())
    variables = {v["name"]: v["query"] for v in board["templating"]["list"]}
    now = int(time.time())
    session = chdb_session(chdb)
    try:
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                sql = _expand(target["rawSql"], now - 3600, now + 60, 10, variables)
                result = json.loads(session.query(sql, "JSONCompact").bytes())
                print(panel["title"], result["rows"], "rows:", result["data"][:2])
                assert result["rows"] > 0, panel["title"]
                if panel["title"].startswith("Slowest"):
                    replicas = {row[1] for row in result["data"]}
                    assert replicas == {"replica-a", "replica-b"}  # every request: 10 < 20
                    assert all(row[-1] for row in result["data"] if row[-2] == "ok")
    finally:
        session.close()
