"""DESIGN §5 on real `lumen serve` processes and real signals: one drain whatever the stop
signal, a supervisor that restarts a crashed or hung engine core, /health that tells the
truth, and each of them a row in the trace store."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

from replay.report import render_text
from service.cli import main
from tests.helpers.load import Streams, WholeResponses, server_idle, wait_until
from tests.helpers.procs import live_children, pid_alive
from tests.helpers.server import ROOT, LumenServer, ServerPool, free_port, metric
from tracing.store import open_db

SHORT, LONG = 100, 1900  # tokens: the short streams fit in the shutdown timeout, the long not
SHUTDOWN_TIMEOUT = "5"  # a short stream takes 2 s at most on a loaded 2-core machine
# Each step sleeps 4 ms in the scheduler: a long stream takes 7.6 s or more on any machine, a
# short one 0.4 s or more (it is still in flight at the signal).
SLOW_STEPS = {"LUMEN_DEBUG_DELAY": "schedule=0.004"}


def _start(tmp_path: Path, model: Path, *args: str) -> LumenServer:
    # A session of its own: a signal to its group reaches no test process.
    tmp_path.mkdir(parents=True, exist_ok=True)
    return LumenServer(
        model, *args, log_path=tmp_path / "serve.log", env=SLOW_STEPS, start_new_session=True
    )


def _family(server: LumenServer) -> list[int]:
    return [p.pid for p in live_children(server.proc.pid)]


def _health(server: LumenServer) -> tuple[int, str]:
    r = server.http.get(server.url("/health"), timeout=2)
    return r.status_code, r.json()["status"]


# How each stop arrives: a signal to the server (`docker stop` and the kubelet signal PID 1, then
# KILL after their grace: the test kills the group if the server outlives its wait), to its
# process group (systemd's KillMode=control-group, kill -TERM -PGID, Ctrl-C: twice), or to the
# core alone. A signal to the group reaches the server and the core at once, so the core's word
# may come first: "core_then_group" makes that order sure, and it must not count as a second
# signal.
STOPS = ("term", "int", "group_term", "group_int_twice", "core_term", "core_then_group")
# make test drains on a signal to the server and one to its core; the other ways, in make test-e2e.
SUITE_STOPS = ("term", "core_term")
CAUSES = {
    "term": ("SIGTERM",), "int": ("SIGINT",), "group_int_twice": ("SIGINT",),
    "core_term": ("SIGTERM to the engine core",),
    "core_then_group": ("SIGTERM to the engine core",),
    # the server's own SIGTERM, or the core's word of its own: the same drain either way
    "group_term": ("SIGTERM", "SIGTERM to the engine core"),
}  # fmt: skip


@pytest.fixture(scope="module")
def stop_servers(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    """A fresh server for each stop: the next one starts while a test signals the last."""
    root = tmp_path_factory.mktemp("stops")
    pool = ServerPool(
        lambda i: _start(root / str(i), tiny_model_path, "--shutdown-timeout", SHUTDOWN_TIMEOUT),
        len(STOPS),
    )
    yield pool
    pool.close()


@pytest.mark.parametrize(
    "how", [pytest.param(h, marks=[] if h in SUITE_STOPS else [pytest.mark.e2e]) for h in STOPS]
)
def test_every_stop_signal_drains(stop_servers: ServerPool, how: str) -> None:
    server = stop_servers.take()
    family = _family(server)
    longs = Streams(server, [LONG] * 4)
    wait_until(longs.started, 30)
    shorts = Streams(server, [SHORT] * 4)
    wait_until(shorts.started, 30)  # all 8 in flight
    pid, core = server.proc.pid, server.core_pid()
    signalled = time.monotonic()
    if how == "term":
        os.kill(pid, signal.SIGTERM)
    elif how == "int":
        os.kill(pid, signal.SIGINT)
    elif how == "group_term":
        os.killpg(pid, signal.SIGTERM)
    elif how == "group_int_twice":
        os.killpg(pid, signal.SIGINT)
    elif how in ("core_term", "core_then_group"):
        os.kill(core, signal.SIGTERM)
    to_drain = wait_until(lambda: _health(server) == (503, "draining"), 5)
    if how == "core_then_group":
        os.killpg(pid, signal.SIGTERM)
    try:
        refused = server.http.post(
            server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, timeout=5
        )
    except httpx.ConnectError as e:  # seen once in a full run on a slow machine: say when
        pytest.fail(f"{e} {time.monotonic() - signalled:.1f} s after the signal (draining "
                    f"after {to_drain:.1f} s):\n{server.log()}")  # fmt: skip
    shorts.join(15)
    if how == "group_int_twice":  # Ctrl-C again: what is left is aborted at once
        os.killpg(pid, signal.SIGINT)
    longs.join(15)
    try:
        code = server.proc.wait(30)
    except Exception:
        os.killpg(pid, signal.SIGKILL)  # docker stop's KILL after its grace
        pytest.fail(f"the server did not exit after the drain:\n{server.log()}")
    took = time.monotonic() - signalled
    print(f"\n{how}: draining after {to_drain:.2f} s; exit {code} {took:.1f} s after the signal; "
          f"shorts {shorts.summary()[0]}, "
          f"longs {longs.summary()[0]}")  # fmt: skip
    assert code == 0, server.log()
    assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
    assert refused.headers["connection"] == "close"
    assert refused.json()["error"]["code"] == "shutting_down"
    assert all(shorts.whole(i) for i in range(4)), shorts.summary()
    # The long ones end cleanly: finish_reason abort, then an error event the client raises.
    assert all(f == "abort" and e == "shutting_down" for _, _, f, e in longs.summary()), (
        longs.summary()
    )
    assert all(0 < n < LONG for n in longs.tokens), longs.tokens
    assert [p for p in family if pid_alive(p)] == []
    with open_db(server.trace_db) as con:
        kind, cause, start_ns, finished, failed = con.execute(
            "SELECT kind, cause, start_ns, num_finished, num_failed FROM lifecycle"
        ).fetchone()
    # The record counts what was in flight when the drain began. A short stream that a loaded
    # machine started late may have ended by then: the client's end time says which did, but
    # for one that ended within a moment of the drain's start.
    ends = [shorts.ended_ns[i] - start_ns for i in range(4)]
    surely, maybe = sum(e > 100_000_000 for e in ends), sum(e > -100_000_000 for e in ends)
    print(f"shorts ended {[round(e / 1e6) for e in ends]} ms after the drain began; "
          f"recorded finished {finished}")  # fmt: skip
    assert (kind, failed) == ("drain", 4)
    assert surely <= finished <= maybe, (ends, finished)
    assert cause in CAUSES[how]
    # A second Ctrl-C cut the wait short; otherwise the long ones were aborted at the timeout.
    assert ("SIGINT again" in server.log()) == (how == "group_int_twice")
    server.stop()


@pytest.mark.serial  # deadlines: open streams fail within 1 s, /health 503 within the bound
def test_a_crashed_or_hung_core_is_restarted_until_a_crash_loop(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    server = _start(
        tmp_path, tiny_model_path, "--max-restarts", "2", "--engine-hang-timeout", "1.5",
        "--max-queue-wait", "30", "--exit-grace-period", "1",
    )  # fmt: skip
    try:
        _crash_hang_and_crash_loop(server)
    finally:
        server.stop(timeout=10, drain=1)  # a no-op once it exited


def _crash_hang_and_crash_loop(server: LumenServer) -> None:
    family = set(_family(server))  # every process the server ever had: none may outlive it

    # kill -9 of the core under 16 streams, and 2 whole (non-streamed) responses in flight
    streams = Streams(server, [LONG] * 16)
    wait_until(streams.started, 30)
    posters = WholeResponses(server, 2, {"prompt": "hi", "max_tokens": 300, "ignore_eos": True})
    wait_until(lambda: metric(server.metrics(), "lumen:num_requests_running") == 18, 10)
    killed = time.monotonic()
    os.kill(server.core_pid(), signal.SIGKILL)
    streams.join(10)
    failed_within = max(streams.ended) - killed
    assert {e for _, _, _, e in streams.summary()} == {"engine_restarted"}, streams.summary()
    # The whole responses had sent nothing: they were sent again to the new core and served.
    whole = posters.join(60)
    assert [r.status_code for r in whole] == [200, 200], [r.text for r in whole]
    assert [r.json()["usage"]["completion_tokens"] for r in whole] == [300, 300]
    resent = [r.headers["x-request-id"] for r in whole]
    # Requests sent during the restart wait for the new core (--max-queue-wait) or get a 503.
    during: list[httpx.Response] = []
    senders = [
        threading.Thread(target=lambda: during.append(server.http.post(
            server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 4}, timeout=60,
        )))
        for _ in range(3)
    ]  # fmt: skip
    for t in senders:
        t.start()
    wait_until(lambda: _health(server) == (200, "ready"), 60)
    ready_after = time.monotonic() - killed
    for t in senders:
        t.join(60)
    statuses = [r.status_code for r in during]
    print(
        f"\nkill -9: 16 streams failed within {failed_within * 1000:.0f} ms; ready again "
        f"{ready_after:.1f} s after the kill; requests during the restart: {statuses}"
    )
    assert failed_within < 1.0 + 1.5  # DESIGN: 1 s, with a loaded-machine margin
    assert len(statuses) == 3 and set(statuses) <= {200, 503}
    ok = server.http.post(server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 4})
    assert ok.status_code == 200, ok.text
    wait_until(lambda: server_idle(server), 10)  # KV, running and admission back to zero
    m = server.metrics()
    assert metric(m, "lumen:engine_restarts_total") == 1
    assert metric(m, "lumen:engine_state", state="ready") == 1
    # The server failed the streams: errors, not its clients' aborts.
    assert metric(m, "lumen:request_success_total", finished_reason="error") == 16
    assert metric(m, "lumen:request_success_total", finished_reason="abort") == 0

    # A hung core (SIGSTOP): /health turns 503 within the bound, then it is restarted.
    family |= set(_family(server))
    hung = server.core_pid()
    os.kill(hung, signal.SIGSTOP)
    stopped = time.monotonic()
    unhealthy = wait_until(lambda: _health(server)[0] == 503, 10)
    wait_until(lambda: _health(server) == (200, "ready"), 60)
    back = time.monotonic() - stopped
    print(f"SIGSTOP: /health 503 after {unhealthy:.2f} s (bound 1.5 s), ready again after "
          f"{back:.1f} s")  # fmt: skip
    assert unhealthy < 1.5 + 1.5  # the bound, with a loaded-machine margin
    assert not pid_alive(hung)

    # A third failure within the window is a crash loop: the server exits non-zero.
    family |= set(_family(server))
    os.kill(server.core_pid(), signal.SIGKILL)
    code = server.proc.wait(30)
    assert code == 1, server.log()
    assert [p for p in family if pid_alive(p)] == []
    with open_db(server.trace_db) as con:
        rows = con.execute(
            "SELECT kind, cause, epoch, num_failed FROM lifecycle ORDER BY start_ns"
        ).fetchall()
        epochs = con.execute("SELECT DISTINCT step_id >> 40 FROM steps ORDER BY 1").fetchall()
    print(rows)
    assert [r[0] for r in rows] == ["restart", "restart", "crash_loop"]
    assert rows[0][2:] == (1, 16) and "died" in rows[0][1]
    assert rows[1][1].startswith("hung") and rows[1][2] == 2
    assert [e for (e,) in epochs] == [0, 1]  # the steps of each core (the third ran none)
    with open_db(server.trace_db) as con:
        rows = con.execute(
            "SELECT status, end_code, resent_ns > sent_ns FROM requests WHERE request_id IN "
            "(?, ?)", resent,
        ).fetchall()  # fmt: skip
        ended = con.execute(
            "SELECT DISTINCT end_code FROM requests WHERE status = 'error'"
        ).fetchall()
    assert rows == [("ok", None, True)] * 2, rows
    assert ended == [("engine_restarted",)], ended
    # A request that waited for the new core is told so (one sent again to it surely did), and
    # the run's report names it.
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["trace", "why", resent[0], "--db", str(server.trace_db)]) == 0
    print(out.getvalue())
    assert "waiting for the engine core to restart" in out.getvalue()
    report = " ".join(render_text(str(server.trace_db)).split())  # unwrapped
    causes = report[report.index("Causes") : report.index("Drains and engine restarts")]
    assert "waiting for the engine core to restart" in causes, report  # named as a cause
    assert "16 requests failed with it, and a new core (epoch 1) was ready" in report, report


def test_health_names_the_phase_while_the_engine_starts(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """The port is bound at once: /health answers 503 `starting`, then `warming_up` (the
    model is loaded), then 200 `ready`; /livez answers 200 all along; a request that comes
    meanwhile gets a 503 with Retry-After."""
    slow_warmup = {"LUMEN_DEBUG_DELAY": "schedule=0.02"}  # the warm-up steps: 0.5 s more
    server = LumenServer(
        tiny_model_path, "--no-trace-db", log_path=tmp_path / "serve.log", env=slow_warmup,
        wait=False,
    )  # fmt: skip
    seen: list[tuple[int, str]] = []
    live: set[int] = set()
    early: httpx.Response | None = None
    deadline = time.monotonic() + 120
    while (not seen or seen[-1][1] != "ready") and time.monotonic() < deadline:
        try:
            r = server.http.get(server.url("/health"), timeout=2)
            live.add(server.http.get(server.url("/livez"), timeout=2).status_code)
            if early is None and r.status_code == 503:
                early = server.http.post(server.url("/v1/completions"), json={"prompt": "hi"})
        except httpx.TransportError:
            time.sleep(0.02)  # not bound yet
            continue
        state = (r.status_code, r.json()["status"])
        if not seen or seen[-1] != state:
            seen.append(state)
        time.sleep(0.02)
    print(f"\n/health during the start: {seen}")
    server.stop()
    assert seen == [(503, "starting"), (503, "warming_up"), (200, "ready")], seen
    assert live == {200}
    assert early is not None and early.status_code == 503, early
    assert early.headers["retry-after"] == "1" and early.json()["error"]["code"] == "starting"


def test_a_stop_signal_while_the_engine_starts_exits_cleanly(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """SIGTERM to the group while the model loads: the core is stopped, the server exits 0."""
    server = LumenServer(
        tiny_model_path, "--no-trace-db", log_path=tmp_path / "serve.log",
        env={"LUMEN_DEBUG_DELAY": "schedule=0.02"}, start_new_session=True, wait=False,
    )  # fmt: skip
    try:
        wait_until(lambda: _starting(server), 60, interval=0.02)
        family = _family(server)
        os.killpg(server.proc.pid, signal.SIGTERM)
        code = server.proc.wait(15)
    finally:
        server.stop(timeout=10, drain=1)
    log = server.log_path.read_text()
    assert code == 0, log
    assert "SIGTERM while starting" in log
    assert [p for p in family if pid_alive(p)] == []


def _starting(server: LumenServer) -> bool:
    try:
        return server.http.get(server.url("/health"), timeout=1).status_code == 503
    except httpx.TransportError:
        return False


def test_the_documented_probes_answer_on_a_running_server(tiny_server: LumenServer) -> None:
    """The Dockerfile's and compose's health checks, and the Kubernetes probes of
    docs/deploy.md, run against a real server (no orchestrator runs here)."""
    port = str(tiny_server.port)
    dockerfile = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    [check] = re.findall(r"^HEALTHCHECK .*? CMD (\[.*\])$", dockerfile, re.M)
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    for cmd in (json.loads(check), compose["services"]["lumen"]["healthcheck"]["test"][1:]):
        cmd = [sys.executable if c == "python" else c.replace(":8000/", f":{port}/") for c in cmd]
        assert subprocess.run(cmd, timeout=30).returncode == 0, cmd
    manifest = re.search(r"```yaml\n(.*?)```", (ROOT / "docs/deploy.md").read_text(), re.S)
    assert manifest is not None
    [container] = yaml.safe_load(manifest[1])["spec"]["template"]["spec"]["containers"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = container[probe]["httpGet"]["path"]
        assert tiny_server.http.get(tiny_server.url(path)).status_code == 200, probe
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"  # never /health


def test_health_and_liveness_name_the_state(tiny_server: LumenServer) -> None:
    health = tiny_server.http.get(tiny_server.url("/health"))
    live = tiny_server.http.get(tiny_server.url("/livez"))
    assert health.status_code == live.status_code == 200
    assert health.json()["status"] == live.json()["status"] == "ready"
    assert metric(tiny_server.metrics(), "lumen:engine_state", state="ready") == 1
    assert httpx.get(tiny_server.url("/livez")).json()["engine_epoch"] >= 0


def test_an_engine_that_fails_to_start_fails_lumen_serve(tiny_model_path: Path) -> None:
    """The core's start error is the server's one-line error and exit status 2. Here the core
    exited before its error was read, and the server died of "engine core exited with code 1"
    (a traceback, exit 1); with SmolLM2, whose teardown is slower, the frontend's close reached
    it first, it passed that SIGTERM on as a drain signal, and the server stopped as if asked
    to (exit 0)."""
    env = {**os.environ, "LUMEN_CPU_MATMUL": "blas", "HF_HUB_OFFLINE": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", str(tiny_model_path), "--port",
         str(free_port())],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    print(f"lumen serve exited {done.returncode} in {time.monotonic() - started:.1f} s")
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("lumen: error: LUMEN_CPU_MATMUL must be one of auto"), last
    assert "while starting: stopping" not in done.stderr
