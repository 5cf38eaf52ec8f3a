"""Reliability: failing trace sinks, hostile input, and who may get in."""

from __future__ import annotations

import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import API_KEY
from tests.helpers.load import stream_chat, wait_until
from tests.helpers.server import ROOT, LumenServer, metric
from tracing.receiver import OtlpReceiver
from tracing.store import open_db

MESSAGES = [{"role": "user", "content": "Say something."}]
BODY = {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def _serve_a_few(server: LumenServer, n: int = 4) -> float:
    """Seconds for n streamed requests, which must all complete."""
    start = time.monotonic()
    for _ in range(n):
        r = stream_chat(server, BODY)
        assert r.events[-1] == "[DONE]" and '"finish_reason":"length"' in r.events[-2]
    return time.monotonic() - start


@pytest.mark.serial  # a deadline: 4 requests within 4 s
# The two heaviest exports: every step span, and the store's rows (--otlp-detail store).
@pytest.mark.parametrize(("mode", "detail"), [("slow", "store"), ("failing", "step")])
def test_a_bad_collector_never_slows_serving(
    tmp_path: Path, tiny_model_path: Path, mode: str, detail: str
) -> None:
    with OtlpReceiver(delay=5.0 if mode == "slow" else 0.0,
                      status=500 if mode == "failing" else 200) as collector:  # fmt: skip
        args = ["--otlp-traces-endpoint", collector.endpoint, "--otlp-detail", detail]
        with LumenServer(tiny_model_path, *args, log_path=tmp_path / "serve.log") as server:
            took = _serve_a_few(server)
            if mode == "failing":
                wait_until(
                    lambda: metric(server.metrics(), "lumen:otlp_spans_dropped_total") > 0, 60
                )
            print(f"\n{mode} collector ({detail}): 4 requests in {took:.2f} s")
            assert took < 4.0  # a 5 s export stall would show here
            # Healed, so the exit's flush need not wait out the fault (nothing times the exit).
            collector.delay, collector.status = 0.0, 200


def _fsize_limit(limit: int):
    def apply() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past it fail with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_a_full_disk_costs_trace_rows_not_requests(tmp_path: Path, tiny_model_path: Path) -> None:
    args = ["--trace-flush-interval", "0.2"]
    with LumenServer(
        # An empty store is 140 KiB; its first rows need a few more 64 KiB blocks.
        tiny_model_path,
        *args,
        log_path=tmp_path / "serve.log",
        preexec_fn=_fsize_limit(1 << 18),
    ) as server:
        took = _serve_a_few(server, 12)
        print(f"\nfile size limit 256 KiB: 12 requests in {took:.2f} s")
        try:  # the failure shows at a flush (every 0.2 s)
            wait_until(lambda: _reports_a_failed_write(server.log()), 10)
        except AssertionError:
            pytest.fail(f"no failed trace db write in the log:\n{server.log()[-2000:]}")
        assert httpx.get(server.url("/health")).status_code == 200


def _reports_a_failed_write(log: str) -> bool:
    return "trace db" in log and ("not writable" in log or "flush failed" in log)


def test_a_read_only_trace_db_costs_trace_rows_not_requests(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to run the server as an unprivileged user")
    # The venv's interpreter may live in root's private home; the system one of the same
    # version, with the venv's packages on its path, is open to nobody.
    python = _python_for_nobody()
    if python is None:
        pytest.skip("no Python of this version that user nobody can run")
    site = [p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir()]
    # The server runs as nobody: its model copy is readable, its trace folder is not
    # writable. (pytest's own temp folder is private to root, so this one is not in it.)
    shared = Path(tempfile.mkdtemp(prefix="lumen-nobody-"))
    try:
        shutil.copytree(tiny_model_path, shared / "model")
        (shared / "traces").mkdir()
        home = shared / "home"
        home.mkdir()
        for p in [shared, *shared.rglob("*")]:
            p.chmod(0o755 if p.is_dir() else 0o644)
        home.chmod(0o777)
        env = {"HOME": str(home), "TMPDIR": str(home), "PYTHONPATH": ":".join([*site, str(ROOT)])}
        with LumenServer(
            shared / "model", log_path=tmp_path / "serve.log",
            trace_db=shared / "traces" / "trace.db", user="nobody", env=env, python=python,
        ) as server:  # fmt: skip
            took = _serve_a_few(server)
            print(f"\nread-only trace folder (server as nobody): 4 requests in {took:.2f} s")
            assert "not writable" in server.log()
        assert not (shared / "traces" / "trace.db").exists()
        assert stat.S_IMODE((shared / "traces").stat().st_mode) == 0o755
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _python_for_nobody() -> str | None:
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for candidate in (sys.executable, shutil.which(version) or "", f"/usr/bin/{version}"):
        if not candidate:
            continue
        try:
            subprocess.run([candidate, "-c", "pass"], user="nobody", check=True, timeout=30)
        except (OSError, subprocess.SubprocessError):
            continue
        return candidate
    return None


@pytest.fixture(scope="module")
def guarded_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    """A server with its probes behind the key and a trace db it cannot create (a file stands
    where its folder should be): two independent faults, one server start."""
    tmp = tmp_path_factory.mktemp("guarded")
    blocker = tmp / "not-a-folder"
    blocker.write_text("a file where the trace folder should be")
    with LumenServer(
        tiny_model_path, "--protect-probes", log_path=tmp / "serve.log",
        trace_db=blocker / "trace.db", api_key="probe-key",
    ) as server:  # fmt: skip
        yield server


def test_an_uncreatable_trace_db_costs_trace_rows_not_requests(
    guarded_server: LumenServer,
) -> None:
    took = _serve_a_few(guarded_server)
    print(f"\nuncreatable trace db: 4 requests in {took:.2f} s")
    assert "not writable" in guarded_server.log()
    assert not guarded_server.trace_db.parent.is_dir()


HOSTILE = [
    ("huge max_tokens", {"messages": MESSAGES, "max_tokens": 10**12}),
    ("negative n", {"messages": MESSAGES, "n": -1}),
    ("NaN temperature", b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}'),
    ("Infinity top_p", b'{"messages": [{"role": "user", "content": "x"}], "top_p": Infinity}'),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'),
    ("10 MB body", {"messages": MESSAGES, "user": "x" * (10 << 20)}),
    ("deeply nested", b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("wrong content type", b"messages=hello"),
    ("thousands of stop strings", {"messages": MESSAGES, "max_tokens": 4,
                                   "stop": [f"s{i}" for i in range(5000)]}),
    ("null everything", {"messages": None, "model": None, "max_tokens": None}),
    ("huge seed", {"messages": MESSAGES, "seed": 2**70}),
    ("token ids out of range", None),
    ("empty prompt list", None),
]  # fmt: skip


@pytest.mark.parametrize(("name", "body"), HOSTILE, ids=[h[0] for h in HOSTILE])
def test_hostile_input_gets_a_4xx(tiny_server: LumenServer, name: str, body) -> None:
    headers = tiny_server.headers()
    path = "/v1/chat/completions"
    if name == "token ids out of range":
        path, body = "/v1/completions", {"prompt": [10**9, -5], "max_tokens": 2}
    elif name == "empty prompt list":
        path, body = "/v1/completions", {"prompt": [], "max_tokens": 2}
    if isinstance(body, bytes):
        ctype = "text/plain" if name == "wrong content type" else "application/json"
        r = httpx.post(tiny_server.url(path), content=body,
                       headers={**headers, "content-type": ctype}, timeout=60)  # fmt: skip
    else:
        r = httpx.post(tiny_server.url(path), json=body, headers=headers, timeout=60)
    print(f"\n{name}: {r.status_code} {r.text[:120]}")
    if name == "thousands of stop strings":
        assert r.status_code in (200, 400)  # allowed, and it must not break anything
    else:
        assert 400 <= r.status_code < 500
    assert httpx.get(tiny_server.url("/health")).status_code == 200


def test_every_v1_route_needs_the_key(tiny_server: LumenServer) -> None:
    routes = [("GET", "/v1/models"), ("GET", "/v1/models/x"), ("POST", "/v1/completions"),
              ("POST", "/v1/chat/completions"), ("GET", "/v1/unknown")]  # fmt: skip
    for method, path in routes:
        r = httpx.request(method, tiny_server.url(path), json={})
        assert r.status_code == 401, (method, path)
        r = httpx.request(method, tiny_server.url(path), json={},
                          headers={"Authorization": "Bearer " + API_KEY[:-1]})  # fmt: skip
        assert r.status_code == 401, (method, path)


def test_probes_can_be_protected_too(guarded_server: LumenServer) -> None:
    for path in ("/health", "/metrics"):
        url = guarded_server.url(path)
        assert httpx.get(url).status_code == 401
        assert httpx.get(url, headers=guarded_server.headers()).status_code == 200


def _stored(db: Path, request_id: str) -> bool:
    with open_db(db, timeout=10) as con:
        return bool(
            con.execute("SELECT 1 FROM requests WHERE request_id = ?", [request_id]).fetchall()
        )


def test_prompts_and_completions_stay_out_of_logs_and_traces(tiny_server: LumenServer) -> None:
    marker = "zebra-quartz-7781"
    body = {"messages": [{"role": "user", "content": f"Repeat {marker} {marker}"}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    r = httpx.post(tiny_server.url("/v1/chat/completions"), json=body,
                   headers=tiny_server.headers())  # fmt: skip
    completion = r.json()["choices"][0]["message"]["content"]
    wait_until(lambda: _stored(tiny_server.trace_db, r.headers["x-request-id"]), 30)  # a flush
    stored = tiny_server.trace_db.read_bytes()
    wal = tiny_server.trace_db.with_suffix(".db.wal")
    if wal.exists():
        stored += wal.read_bytes()
    log = tiny_server.log()
    assert marker not in log and marker.encode() not in stored
    if len(completion) > 8:
        assert completion not in log and completion.encode() not in stored
