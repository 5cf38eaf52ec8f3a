"""DESIGN §5 on a real server: kill -9 the engine core; open requests fail fast, /health
answers 503, the server exits non-zero after its grace period and leaves no process."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.helpers.load import wait_until
from tests.helpers.procs import live_children, pid_alive
from tests.helpers.server import LumenServer, metric

LONG = {
    "messages": [{"role": "user", "content": "Go on forever."}],
    "max_tokens": 1800,
    "temperature": 0,
    "ignore_eos": True,
}


@pytest.mark.serial  # a deadline: open requests fail within 2.5 s
def test_engine_death_fails_open_requests_then_the_server_exits(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    server = LumenServer(
        tiny_model_path, "--exit-grace-period", "3", log_path=tmp_path / "serve.log"
    )
    url = server.url("/v1/chat/completions")
    ended: dict[str, float] = {}
    last_events: dict[str, str] = {}
    started = threading.Barrier(4)

    def stream(name: str) -> None:
        with httpx.stream("POST", url, json={**LONG, "stream": True}, timeout=30) as r:
            started.wait()
            last = ""
            for line in r.iter_lines():
                last = line or last
        ended[name], last_events[name] = time.monotonic(), last

    def blocking(name: str) -> None:
        started.wait()
        r = httpx.post(url, json=LONG, timeout=30)
        ended[name], last_events[name] = time.monotonic(), f"{r.status_code} {r.text}"

    threads = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(2)]
    threads.append(threading.Thread(target=blocking, args=("b",)))
    for t in threads:
        t.start()
    started.wait()
    # all three are generating
    wait_until(lambda: metric(server.metrics(), "lumen:num_requests_running") == 3, 10)
    server_pid = server.proc.pid
    children = [p.pid for p in live_children(server_pid)]
    assert children
    killed_at = time.monotonic()
    os.kill(server.core_pid(), signal.SIGKILL)
    for t in threads:
        t.join(10)
    delays = {k: v - killed_at for k, v in ended.items()}
    print(
        f"\nopen requests ended {', '.join(f'{k}: {v * 1000:.0f} ms' for k, v in delays.items())}"
    )
    assert set(delays) == {"s0", "s1", "b"}
    assert max(delays.values()) < 1.0 + 1.5  # DESIGN: 1 s, with a loaded-machine margin
    for name in ("s0", "s1"):
        event = json.loads(last_events[name].removeprefix("data: "))
        assert event["error"]["code"] == "engine_dead", last_events[name]
    assert last_events["b"].startswith("503 ") and "engine_dead" in last_events["b"]

    health = httpx.get(server.url("/health"), timeout=5)
    assert health.status_code == 503
    refused = httpx.post(url, json=LONG, timeout=5)
    assert refused.status_code == 503
    try:
        code = server.proc.wait(timeout=30)
    except Exception:
        server.stop()
        pytest.fail(f"server did not exit after the engine died:\n{server.log()}")
    exited_after = time.monotonic() - killed_at
    print(f"server exited with {code} {exited_after:.1f} s after the kill (grace 3 s)")
    assert code == 1
    assert exited_after >= 3.0
    assert not pid_alive(server_pid)
    assert [pid for pid in children if pid_alive(pid)] == []
    server.stop()
