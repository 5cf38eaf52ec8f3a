"""--data-parallel-size on real `lumen serve` processes: two engine cores behind one API
process, each request sent by vLLM's rule, one engine's crash leaving the other serving, and
every engine in /metrics, /health and the trace store."""

from __future__ import annotations

import contextlib
import io
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from engine import cpu_share
from replay.cli import main as replay
from replay.report import render_text
from service.cli import main
from tests.helpers.load import Streams, WholeResponses, at_once, server_idle, wait_until
from tests.helpers.procs import live_children
from tests.helpers.server import LumenServer, metric
from tracing.store import open_db

PROMPTS = [f"Request {i}: tell me about the number {i * 7}." for i in range(24)]
# Each step sleeps 4 ms in the scheduler, so a long stream is still running when its core dies.
SLOW_STEPS = {"LUMEN_DEBUG_DELAY": "schedule=0.004"}
needs_two_cpus = pytest.mark.skipif(
    cpu_share.usable_cpus() < 2, reason="two engines need two CPUs this process may use"
)


def _start(tmp_path: Path, model: Path, *args: str, env: dict[str, str] | None = None):
    tmp_path.mkdir(parents=True, exist_ok=True)
    return LumenServer(
        model, "--data-parallel-size", "2", "--num-kv-blocks", "256", *args,
        log_path=tmp_path / "serve.log", env=env, start_new_session=True,
    )  # fmt: skip


def _core_pids(server: LumenServer) -> dict[int, int]:
    """Engine rank -> its core's pid, by the process titles (lumen::EngineCore_DP<rank>)."""
    pids = {}
    for p in live_children(server.proc.pid):
        with contextlib.suppress(Exception):
            line = " ".join(p.cmdline())
            for rank in (0, 1):
                if f"lumen::EngineCore_DP{rank}" in line:
                    pids[rank] = p.pid
    return pids


def _complete(server: LumenServer, prompt: str | list[int], **extra: object) -> httpx.Response:
    return server.http.post(
        server.url("/v1/completions"), headers=server.headers(), timeout=60,
        json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **extra},
    )  # fmt: skip


@needs_two_cpus
@pytest.mark.e2e  # two engines, loaded: 18 s
def test_two_engines_serve_as_one(
    tmp_path: Path, tiny_model_path: Path, tiny_server: LumenServer
) -> None:
    # Prefix affinity on: prompts under one KV block (these) go by the load rule alone.
    server = _start(tmp_path, tiny_model_path, "--max-num-seqs", "4",
                    "--data-parallel-prefix-affinity", "64")  # fmt: skip
    try:
        assert set(_core_pids(server)) == {0, 1}, "each engine core names its rank"
        log = server.log()
        for rank in (0, 1):
            assert f"engine {rank} of 2: CPUs" in log, log  # its share, in its start-up log
        texts = at_once([lambda p=p: _complete(server, p).json()["choices"][0]["text"]
                         for p in PROMPTS])  # fmt: skip
        answers = dict(zip(PROMPTS, texts))
        # Greedy answers as one engine gives them.
        alone = {p: _complete(tiny_server, p).json()["choices"][0]["text"] for p in PROMPTS}
        assert answers == alone
        # vLLM's header pins a request to an engine (a replay of a recorded split): eight at
        # once on engine 1, which runs four at a time, while engine 0 has room.
        pinned = at_once([lambda: server.http.post(
            server.url("/v1/completions"), timeout=60, headers={"X-data-parallel-rank": "1"},
            json={"prompt": "pinned", "max_tokens": 160, "ignore_eos": True})] * 8)  # fmt: skip
        assert [r.status_code for r in pinned] == [200] * 8
        # Prefix affinity: a prompt of four full blocks, then eight at once that share them.
        # Within 64 of the other engine's load, all go where the first went, and queue there
        # (four run at a time) while the other engine has room.
        shared = list(range(100, 164))
        first = _complete(server, [*shared, 7])
        hot = at_once([lambda i=i: _complete(server, [*shared, 200 + i], max_tokens=160,
                                             ignore_eos=True) for i in range(8)])  # fmt: skip
        assert [r.status_code for r in [first, *hot]] == [200] * 9
        bad = server.http.post(server.url("/v1/completions"), headers={"X-data-parallel-rank": "2"},
                               json={"prompt": "pinned", "max_tokens": 4})  # fmt: skip
        assert bad.status_code == 400 and "X-data-parallel-rank" in bad.text, bad.text
        wait_until(lambda: server_idle(server), 10)
        m = server.metrics()
        for name in ("vllm:num_requests_running", "lumen:kv_cache_usage_perc",
                     "vllm:cache_config_info"):  # fmt: skip
            engines = {k.split('engine="')[1].split('"')[0] for k in m if k.startswith(name + "{")}
            assert engines == {"0", "1"}, (name, engines)
        health = server.http.get(server.url("/health")).json()
        assert [(e["engine"], e["status"]) for e in health["engines"]] == [
            (0, "ready"),
            (1, "ready"),
        ]
    finally:
        assert server.stop(timeout=30) == 0
    with open_db(server.trace_db) as con:
        split = dict(
            con.execute(
                "SELECT engine, count(*) FROM requests WHERE engine IS NOT NULL GROUP BY engine"
            ).fetchall()
        )
        step_engines = con.execute("SELECT DISTINCT step_id >> 56 FROM steps ORDER BY 1").fetchall()
        size = con.execute("SELECT data_parallel_size FROM runs").fetchone()
        first_id, hot_ids = first.headers["x-request-id"], [r.headers["x-request-id"] for r in hot]
        hot_rows = con.execute(
            "SELECT engine, routed, cached_tokens FROM requests WHERE list_contains(?, request_id) "
            "ORDER BY ttft_ns DESC", [hot_ids],
        ).fetchall()  # fmt: skip
        (first_engine,) = con.execute(
            "SELECT engine FROM requests WHERE request_id = ?", [first_id]
        ).fetchone()
        ids = [r.headers["x-request-id"] for r in pinned]
        pinned_to = con.execute(
            "SELECT DISTINCT engine FROM requests WHERE list_contains(?, request_id)", [ids]
        ).fetchall()
        most_queued, queued = (
            con.execute(
                "SELECT request_id FROM requests WHERE list_contains(?, request_id) "
                "ORDER BY ttft_ns DESC LIMIT 1", [group],
            ).fetchone()[0]
            for group in (hot_ids, ids)
        )  # fmt: skip
    print(f"\n{len(PROMPTS)} concurrent requests over 2 engines: {split}")
    assert pinned_to == [(1,)]
    print(f"prefix affinity: the first on engine {first_engine}, the 8 sharing it: {hot_rows}")
    assert {(e, routed) for e, routed, _ in hot_rows} == {(first_engine, "prefix")}
    assert all(cached >= 64 for _, _, cached in hot_rows), hot_rows  # its blocks were there
    split[1] -= len(pinned)
    split[first_engine] -= 1 + len(hot)
    assert sum(split.values()) == len(PROMPTS) and set(split) == {0, 1}
    # The rule spreads them: neither engine took more than three quarters.
    assert max(split.values()) <= len(PROMPTS) * 3 // 4, split
    assert [e for (e,) in step_engines] == [0, 1] and size == (2,)
    # The run reads as one: its report and a request's story.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "why", queued, "--db", str(server.trace_db)]) == 0
    why = " ".join(out.getvalue().split())
    print(why)
    # Its engine, and the wait the pinning cost it while the other engine had room.
    assert "engine 1, pinned by X-data-parallel-rank" in why, why
    assert "another engine had room" in why, why
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "why", most_queued, "--db", str(server.trace_db)]) == 0
    why = " ".join(out.getvalue().split())
    print(why)
    assert "by prefix affinity" in why and "another engine had room" in why, why
    assert "prefix affinity sent it" in why, why
    report = " ".join(render_text(str(server.trace_db)).split())
    assert "engine steps" in report, report
    # `replay run` of the recording: a server of two engines, each request on its recorded one.
    replayed = tmp_path / "replay.db"
    with contextlib.redirect_stdout(io.StringIO()):
        assert replay(["run", str(server.trace_db), "--out", str(replayed)]) == 0
    with open_db(replayed) as con:
        again = dict(con.execute(
            "SELECT engine, count(*) FROM requests WHERE engine IS NOT NULL GROUP BY engine"
        ).fetchall())  # fmt: skip
    split[1] += len(pinned)
    split[first_engine] += 1 + len(hot)
    print(f"replayed split: {again} (recorded {split})")
    assert again == split


@needs_two_cpus
@pytest.mark.e2e  # two engines, one killed: 19 s
@pytest.mark.serial  # deadlines: the dead engine's streams fail within 1 s
def test_a_dead_engine_leaves_the_other_serving(tmp_path: Path, tiny_model_path: Path) -> None:
    server = _start(tmp_path, tiny_model_path, "--max-queue-wait", "30", env=SLOW_STEPS)
    try:
        streams = Streams(server, [1500] * 8)
        wait_until(streams.started, 30)
        # Whole (non-streamed) responses in flight: those of the dead engine had sent nothing.
        body = {"prompt": "hi", "max_tokens": 200, "ignore_eos": True}
        posters = WholeResponses(server, 4, body)
        wait_until(lambda: metric(server.metrics(), "lumen:num_requests_running") == 12, 10)
        killed = time.monotonic()
        os.kill(_core_pids(server)[1], signal.SIGKILL)
        # Requests sent while engine 1 restarts go to engine 0 at once.
        during = [_complete(server, f"during {i}") for i in range(3)]
        assert [r.status_code for r in during] == [200] * 3, [r.text for r in during]
        served_during = time.monotonic() - killed
        streams.join(60)
        whole = posters.join(60)
        errors = [e for e in streams.error if e is not None]
        print(
            f"\nkill -9 of engine 1: {len(errors)} of 8 streams failed, the others finished; "
            f"3 new requests served {served_during:.1f} s after the kill"
        )
        assert set(errors) == {"engine_restarted"} and 0 < len(errors) < 8, streams.summary()
        assert [s for s, e in zip(streams.usage, streams.error) if e is None] == [1500] * (
            8 - len(errors)
        )
        assert [r.status_code for r in whole] == [200] * 4, [r.text for r in whole]
        assert [r.json()["usage"]["completion_tokens"] for r in whole] == [200] * 4
        wait_until(lambda: _engines_ready(server), 60)
        wait_until(lambda: server_idle(server), 10)
        assert metric(server.metrics(), "lumen:engine_restarts_total") == 1
    finally:
        server.stop(timeout=30, drain=2)
    with open_db(server.trace_db) as con:
        rows = con.execute("SELECT kind, engine, num_failed FROM lifecycle").fetchall()
        resent = con.execute(
            "SELECT engine, status FROM requests WHERE resent_ns IS NOT NULL"
        ).fetchall()
    assert rows[0] == ("restart", 1, len(errors)), rows
    # Every whole response engine 1 held went to engine 0 and was served there.
    assert resent and set(resent) == {(0, "ok")}, resent


def _engines_ready(server: LumenServer) -> bool:
    health = server.http.get(server.url("/health"), timeout=2).json()
    return [e["status"] for e in health.get("engines", [])] == ["ready", "ready"]


def test_an_impossible_split_is_refused_before_anything_starts(
    tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for size in ("0", "100000"):
        started = time.monotonic()
        assert main(["serve", str(tiny_model_path), "--data-parallel-size", size]) == 2
        err = capsys.readouterr().err.strip()
        print(f"--data-parallel-size {size}: {err} ({time.monotonic() - started:.2f} s)")
        assert err.startswith("lumen: error:") and len(err.splitlines()) == 1
        assert "data_parallel_size" in err or "--data-parallel-size" in err


def test_each_engine_gets_its_own_cpus(tmp_path: Path) -> None:
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cpu_share.cgroup_quota_cpus(quota) == 1.5
    quota.write_text("max 100000\n")
    assert cpu_share.cgroup_quota_cpus(quota) is None
    usable = cpu_share.usable_cpus()
    shares = [cpu_share.share(r, usable) for r in range(usable)]
    cpus = [c for s in shares for c in s.cpus]
    assert len(cpus) == len(set(cpus)) == usable  # disjoint, one each
    assert all(s.threads == 1 for s in shares)
