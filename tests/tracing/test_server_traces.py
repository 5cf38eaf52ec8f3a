"""Spans of a real server, in the DuckDB store and at a real OTLP/HTTP receiver (DESIGN §3)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from collections import defaultdict
from pathlib import Path

import httpx
import psutil
import pytest

from tests.helpers.load import stream_chat, wait_until
from tests.helpers.procs import pid_alive
from tests.helpers.server import ROOT, LumenServer, metric
from tracing.receiver import GrpcOtlpReceiver, OtlpReceiver
from tracing.spans import BOUNDARIES, GRAMMAR_SPAN
from tracing.store import open_db

MESSAGES = [{"role": "user", "content": "Count to ten."}]
TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def _rows(db: Path, sql: str, *params) -> list[tuple]:
    with open_db(db, timeout=10) as con:
        return con.execute(sql, list(params)).fetchall()


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    """A server exporting every per-step span to a receiver, after a mixed run of requests."""
    tmp = tmp_path_factory.mktemp("traced")
    with OtlpReceiver() as receiver:
        args = ["--otlp-traces-endpoint", receiver.endpoint, "--otlp-detail", "step"]
        args += ["--trace-flush-interval", "0.2", "--num-kv-blocks", "512"]
        with LumenServer(tiny_model_path, *args, log_path=tmp / "serve.log") as server:
            ids = _mixed_run(server)
            wait_until(
                lambda: len(_rows(server.trace_db, "SELECT 1 FROM requests")) >= len(ids), 30
            )
            wait_until(
                lambda: (
                    {s.attributes.get("lumen.request_id") for s in receiver.spans}
                    >= set(ids.values())
                ),
                30,
            )
            yield server, receiver, ids


def _mixed_run(server: LumenServer) -> dict[str, str]:
    """One of each kind; returns kind -> request id."""
    url = server.url("/v1/chat/completions")
    body = {"messages": MESSAGES, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    ids = {}
    r = httpx.post(url, json=body, headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    ids["plain"] = r.headers["x-request-id"]
    with httpx.stream("POST", url, json={**body, "stream": True}) as r:
        ids["stream"] = r.headers["x-request-id"]
        r.read()
    r = httpx.post(server.url("/v1/completions"), json={"prompt": "Once upon", "max_tokens": 6})
    ids["completion"] = r.headers["x-request-id"]
    r = httpx.post(url, json={**body, "n": 2, "temperature": 1.0, "seed": 3})
    ids["n2"] = r.headers["x-request-id"]
    r = httpx.post(server.url("/v1/completions"), json={"prompt": ["A", "B"], "max_tokens": 3})
    ids["batch-0"] = r.headers["x-request-id"] + "-0"  # one engine request per prompt
    ids["batch-1"] = r.headers["x-request-id"] + "-1"
    with httpx.stream("POST", url, json={**body, "max_tokens": 1500, "stream": True}) as r:
        ids["aborted"] = r.headers["x-request-id"]
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    r = httpx.post(url, json={**body, "temperature": -3})
    assert r.status_code == 400
    ids["invalid"] = r.headers["x-request-id"]
    so = {"regex": "[a-z]{3,5}"}  # structured outputs: a grammar to compile and mask with
    r = httpx.post(url, json={**body, "ignore_eos": False, "structured_outputs": so})
    ids["grammar"] = r.headers["x-request-id"]
    return ids


def test_every_request_has_its_row_and_status(traced) -> None:
    server, _, ids = traced
    rows = dict(_rows(server.trace_db, "SELECT request_id, status FROM requests"))
    expected = {"plain": "ok", "stream": "ok", "completion": "ok", "n2": "ok"}
    expected |= {"batch-0": "ok", "batch-1": "ok"}
    expected |= {"aborted": "aborted", "invalid": "error", "grammar": "ok"}
    assert {kind: rows.get(rid) for kind, rid in ids.items()} == expected
    [(error, params, hashes)] = _rows(
        server.trace_db,
        "SELECT error, params, prompt_block_hashes FROM requests WHERE request_id = ?",
        ids["invalid"],
    )
    assert "temperature" in error and params is None and hashes is None
    # Prompt text is never stored; per-block hashes are (the default --trace-prompts).
    [(hashes, tokens, n_in)] = _rows(
        server.trace_db,
        "SELECT prompt_block_hashes, prompt_token_ids, prompt_tokens FROM requests "
        "WHERE request_id = ?",
        ids["plain"],
    )
    assert tokens is None and len(hashes) == -(-n_in // 16)


def test_boundaries_are_whole_and_in_clock_order(traced) -> None:
    server, _, ids = traced
    spans = defaultdict(list)
    for rid, name, start, end, step in _rows(
        server.trace_db, "SELECT request_id, name, start_ns, end_ns, step_id FROM spans"
    ):
        spans[rid, name].append((start, end, step))
    for kind in ("plain", "stream", "completion", "n2", "aborted", "grammar"):
        rid = ids[kind]
        names = {n for (r, n) in spans if r == rid}
        extra = {GRAMMAR_SPAN} if kind == "grammar" else set()
        assert names == {"llm_request", *BOUNDARIES, *extra}, (kind, names)
        enqueue_end = spans[rid, "frontend.enqueue"][0][1]
        receive_end = min(e for _, e, _ in spans[rid, "core.receive"])
        first_schedule_end = min(e for _, e, _ in spans[rid, "core.schedule"])
        assert enqueue_end <= receive_end <= first_schedule_end, kind
        root_start, root_end, _ = spans[rid, "llm_request"][0]
        for (r, _name), items in spans.items():
            if r == rid:
                assert all(root_start <= s <= e <= root_end for s, e, _ in items), (kind, _name)
    # Non-streamed: one emit (the final response); streamed: one per step with output.
    assert len(spans[ids["plain"], "frontend.emit"]) == 1
    assert len(spans[ids["stream"], "frontend.emit"]) > 1
    assert {n for (r, n) in spans if r == ids["invalid"]} == {"llm_request", "frontend.enqueue"}


def test_steps_satisfy_the_token_identity(traced) -> None:
    server, _, ids = traced
    scheduled = defaultdict(int)
    for req_ids, counts in _rows(server.trace_db, "SELECT request_ids, num_scheduled FROM steps"):
        for rid, n in zip(req_ids, counts):
            scheduled[rid] += n
    for kind in ("plain", "stream", "completion"):
        [(n_in, n_out, cached, preempted)] = _rows(
            server.trace_db,
            "SELECT prompt_tokens, output_tokens, cached_tokens, num_preemptions FROM requests "
            "WHERE request_id = ?",
            ids[kind],
        )
        assert preempted == 0
        # DESIGN §3: prompt - prefix hits + recomputed (none here) + output - 1.
        assert scheduled[ids[kind]] == n_in - cached + n_out - 1, kind
    print(f"\nidentity holds; one plain request was scheduled {scheduled[ids['plain']]} tokens")


def test_otlp_receives_the_same_spans(traced) -> None:
    server, receiver, ids = traced
    got = defaultdict(list)
    for s in receiver.spans:
        got[s.attributes["lumen.request_id"]].append(s)
    for kind, rid in ids.items():
        spans = got[rid]
        [root] = [s for s in spans if s.name == "llm_request"]
        assert root.attributes["gen_ai.request.id"] == rid
        children = [s for s in spans if s is not root]
        assert children and all(s.parent_span_id == root.span_id for s in children), kind
        assert all(s.trace_id == root.trace_id for s in spans)
        db_ids = {
            span_id
            for (span_id,) in _rows(
                server.trace_db, "SELECT span_id FROM spans WHERE request_id = ?", rid
            )
        }
        assert {s.span_id for s in spans} == db_ids, kind  # the same spans, the same ids
    [grammar] = [s for s in got[ids["grammar"]] if s.name == GRAMMAR_SPAN]
    [root] = [s for s in got[ids["grammar"]] if s.name == "llm_request"]
    assert grammar.attributes["lumen.grammar"] == root.attributes["lumen.grammar"] == "regex"
    assert grammar.attributes["lumen.grammar.compile_ns"] > 0
    assert root.attributes["lumen.grammar.mask_s"] > 0
    [root] = [s for s in got[ids["plain"]] if s.name == "llm_request"]
    assert (root.trace_id, root.parent_span_id) == (TRACE_ID, PARENT_ID)  # traceparent honoured
    # The GenAI conventions' names, and the deprecated ones beside them for one release.
    assert root.attributes["gen_ai.usage.output_tokens"] == 12
    assert root.attributes["gen_ai.usage.completion_tokens"] == 12
    assert root.attributes["gen_ai.usage.input_tokens"] == root.attributes[
        "gen_ai.usage.prompt_tokens"] > 0  # fmt: skip
    assert root.attributes["lumen.slowest_phase"] in ("frontend", "queue", "prefill", "decode")
    assert root.attributes["gen_ai.latency.time_to_first_token"] > 0


def test_boundary_latency_metric_and_lumen_trace(traced) -> None:
    server, _, ids = traced
    m = server.metrics()
    for boundary in BOUNDARIES:
        assert metric(m, "lumen:boundary_latency_seconds_count", boundary=boundary) > 0
    lumen = [sys.executable, "-m", "service.cli", "trace"]
    show = subprocess.run(
        [*lumen, "show", ids["stream"], "--db", str(server.trace_db)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    print("\n" + show.stdout)
    assert all(b in show.stdout for b in BOUNDARIES) and "slowest boundary" in show.stdout
    top = subprocess.run(
        [*lumen, "top", "--db", str(server.trace_db)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert ids["aborted"] in top.stdout and "dominated by" in top.stdout
    batch = subprocess.run(
        [*lumen, "show", ids["batch-0"][:-2], "--db", str(server.trace_db)],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert ids["batch-0"] in batch.stdout and ids["batch-1"] in batch.stdout


def _thread_names(pid: int) -> set[str]:
    return {(task / "comm").read_text().strip() for task in Path(f"/proc/{pid}/task").iterdir()}


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="thread names are read from /proc")
def test_the_store_counts_its_flushes_and_the_threads_have_names(traced) -> None:
    """What tracing costs is on /metrics and in `top -H`: the writer's flushes and their CPU,
    and each thread by its name (lumen bench overhead reads the trace writer's CPU by it), and
    the engine core process by its own."""
    server, _, _ = traced
    m = server.metrics()
    flushes, cpu = (
        metric(m, "lumen:trace_flushes_total"),
        metric(m, "lumen:trace_flush_cpu_seconds_total"),
    )
    print(f"\n{flushes:.0f} flushes, {cpu * 1000:.0f} ms of CPU in them")
    assert flushes >= 1 and cpu > 0
    assert {"trace-writer", "client-reader"} <= _thread_names(server.proc.pid)
    assert {"core-input", "core-output"} <= _thread_names(server.core_pid())
    # The core process is named as vLLM names its own: `ps -ef` shows the title, `top` the comm.
    core = psutil.Process(server.core_pid())
    assert "EngineCore_DP0" in _thread_names(core.pid)
    assert core.cmdline()[0] == "lumen::EngineCore_DP0", core.cmdline()


def test_otlp_over_grpc_with_request_detail(tmp_path: Path, tiny_model_path: Path) -> None:
    with GrpcOtlpReceiver() as receiver:
        args = ["--otlp-traces-endpoint", receiver.endpoint, "--otlp-detail", "request"]
        with LumenServer(
            tiny_model_path, *args, "--no-trace-db", log_path=tmp_path / "serve.log"
        ) as server:
            ids = [stream_chat(server, {"messages": MESSAGES, "max_tokens": 4}) for _ in range(3)]
            assert all(r.events[-1] == "[DONE]" for r in ids)
            wait_until(lambda: len(receiver.spans) >= 3, 30)
            # No trace db, yet /metrics has every boundary and the delivery lag.
            m = server.metrics()
            for boundary in BOUNDARIES:
                assert metric(m, "lumen:boundary_latency_seconds_count", boundary=boundary) > 0
            assert metric(m, "lumen:delivery_lag_seconds_count") == 3
            assert metric(m, "lumen:delivery_wait_seconds_count") == 3
    # request detail: the root span only, one per request.
    assert {s.name for s in receiver.spans} == {"llm_request"}
    assert len({s.attributes["gen_ai.request.id"] for s in receiver.spans}) == 3


def test_a_dead_collector_costs_spans_not_requests(tmp_path: Path, tiny_model_path: Path) -> None:
    with OtlpReceiver() as gone:
        endpoint = gone.endpoint  # a port nobody listens on once the block ends
    args = ["--otlp-traces-endpoint", endpoint, "--no-trace-db"]
    with LumenServer(tiny_model_path, *args, log_path=tmp_path / "serve.log") as server:
        for _ in range(3):
            r = stream_chat(server, {"messages": MESSAGES, "max_tokens": 8})
            assert r.num_chunks >= 1
        dropped = wait_until(
            lambda: metric(server.metrics(), "lumen:otlp_spans_dropped_total") > 0, 60
        )
        print(f"\nspans counted as dropped {dropped:.1f} s later; requests all served")


def test_kill_9_leaves_whole_requests(tmp_path: Path, tiny_model_path: Path) -> None:
    args = ["--trace-flush-interval", "0.2", "--num-kv-blocks", "512"]
    server = LumenServer(tiny_model_path, *args, log_path=tmp_path / "serve.log")
    body = {"messages": MESSAGES, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            try:
                stream_chat(server, body, timeout=5)
            except Exception:
                return

    threads = [threading.Thread(target=load) for _ in range(4)]
    for t in threads:
        t.start()
    # Kill mid-load once a few requests are in the file (flushed every 0.2 s).
    wait_until(lambda: len(_rows(server.trace_db, "SELECT 1 FROM requests")) >= 8, 60)
    core = server.core_pid()
    os.kill(server.proc.pid, signal.SIGKILL)
    stop.set()
    for t in threads:
        t.join(10)
    server.proc.wait(10)
    rows = _rows(server.trace_db, "SELECT request_id, status, output_tokens FROM requests")
    assert rows, "no request was flushed before the kill"
    span_names = defaultdict(set)
    for rid, name in _rows(server.trace_db, "SELECT request_id, name FROM spans"):
        span_names[rid].add(name)
    assert set(span_names) == {rid for rid, _, _ in rows}  # no orphan spans, no bare rows
    for rid, status, n_out in rows:
        assert status == "ok" and n_out == 40
        assert span_names[rid] == {"llm_request", *BOUNDARIES}, rid
    print(f"\n{len(rows)} whole requests survived the kill -9")
    server.stop()
    wait_until(lambda: not pid_alive(core), 10)  # the orphaned core notices its parent is gone
    assert json.dumps(rows)
