"""One generated run through a real `lumen serve`: a fresh server with the run's flags and
environment, its speed probed (one stream alone, client.probe), its requests sent and timed by
the client, its actions done to the server at their moments (kill -9 or SIGSTOP of the core, a
GC pause), then a drain, so the trace db holds it all.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from bench.diagnose.client import Seen, encode_all, probe, send_all
from bench.diagnose.scenarios import Action, Run
from bench.server import LumenServer, metric

# Every run records its own trace db, flushed often so the drain at the end has little to write.
COMMON_FLAGS = ("--trace-flush-interval", "0.2", "--num-kv-blocks", "2048")
START_DELAY_S = 0.05  # from the server's ready to the run's first request


@dataclass
class Recorded:
    """A run as the client saw it, and where the server recorded it."""

    db: Path
    seen: list[Seen]
    log: str
    error: str | None = None  # the run could not be done (the server did not start, ...)
    speed_s: float | None = None  # the probe's median gap (client.probe)


def record(model: Path, run: Run, db: Path, timeout_s: float = 120.0) -> Recorded:
    """Run ``run`` on a fresh server writing ``db``; every request answered (or failed), the
    server drained and stopped."""
    flags = list(COMMON_FLAGS)
    if "--num-kv-blocks" in run.flags:  # the run's own KV pool replaces the default
        i = flags.index("--num-kv-blocks")
        del flags[i : i + 2]
    log = db.with_suffix(".log")
    try:
        server = LumenServer(
            model, *flags, *run.flags, log_path=log, trace_db=db, env=run.env or None,
            start_new_session=True,
        )  # fmt: skip
    except RuntimeError as e:
        return Recorded(db, [], log.read_text(errors="replace")[-3000:], f"no server: {e}")
    try:
        speed = probe(server.port)
        payloads = encode_all(run.asks)
        t0 = time.monotonic() + START_DELAY_S
        actor = threading.Thread(target=_act, args=(server, run.actions, t0), daemon=True)
        actor.start()
        seen = send_all(server.port, run.asks, payloads, t0)
        actor.join(timeout_s)
        _settle(server)
        if run.actions:  # a restarted core: the run ends once it is ready (and recorded so)
            _ready(server)
    finally:
        code = server.stop(timeout=30, drain=10)
    text = log.read_text(errors="replace")
    error = None if code in (0, None) else f"the server exited with {code}"
    return Recorded(db, seen, text[-3000:], error, speed)


def _act(server: LumenServer, actions: list[Action], t0: float) -> None:
    for action in sorted(actions, key=lambda a: a.at_s):
        delay = t0 + action.at_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        with contextlib.suppress(ProcessLookupError, AssertionError):
            if action.kind == "kill_core":
                os.kill(_core_pid(server), signal.SIGKILL)
            elif action.kind == "stop_core":
                pid = _core_pid(server)
                os.kill(pid, signal.SIGSTOP)
                time.sleep(action.seconds)
                os.kill(pid, signal.SIGCONT)
            elif action.kind == "gc_api":
                os.kill(server.proc.pid, signal.SIGUSR2)
            elif action.kind == "gc_core":
                os.kill(_core_pid(server), signal.SIGUSR2)


def _core_pid(server: LumenServer) -> int:
    """The engine core: the server's one spawned child (of two engines, the first started)."""
    import psutil

    from engine.background import is_engine_core

    kids = [
        p.pid
        for p in psutil.Process(server.proc.pid).children()
        if is_engine_core(p.cmdline()) and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert kids, "the server has no engine core process"
    return min(kids)


def _settle(server: LumenServer, timeout: float = 30.0) -> None:
    """Until the server holds no request (aborted ones free their slots a moment later)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            m = server.metrics()
            if metric(m, "lumen:num_requests_admitted") == 0:
                return
        time.sleep(0.05)


def _ready(server: LumenServer, timeout: float = 60.0) -> None:
    """Until /health answers 200 with every engine ready (a new engine core, after a crash or
    a hang, is warm)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(Exception):
            health = server.http.get(server.url("/health"), timeout=2)
            engines = health.json().get("engines", [])
            if health.status_code == 200 and all(e["status"] == "ready" for e in engines):
                return
        time.sleep(0.1)
