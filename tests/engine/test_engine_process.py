"""The EngineCore in its own process: handshake, startup errors, kill -9, shutdown, transports."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.ipc import Endpoints
from engine.mp_client import SyncMPClient
from tests.helpers.clients import AsyncAdapter
from tests.helpers.factories import make_core_request as req
from tests.helpers.procs import live_children, pid_alive, wait_no_children

CONFIG = EngineConfig(num_kv_blocks=64)


def test_handshake_reports_the_engine(tiny_model_path: Path) -> None:
    client = SyncMPClient(EngineConfig(num_kv_blocks=40, block_size=8), str(tiny_model_path))
    try:
        info = client.info
        assert (info.num_kv_blocks, info.block_size, info.max_model_len) == (40, 8, 320)
        assert (info.dtype, info.device, info.model) == ("float32", "cpu", str(tiny_model_path))
        assert info.version
    finally:
        client.shutdown()
    assert wait_no_children() == []


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (EngineConfig(max_model_len=10**6), "exceeds the model's context length"),
        (EngineConfig(num_kv_blocks=2, max_model_len=512), "KV cache holds 32 tokens"),
    ],
)
def test_startup_failure_is_a_clear_error_and_leaves_no_process(
    config: EngineConfig, match: str, tiny_model_path: Path
) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=match):
        SyncMPClient(config, str(tiny_model_path), startup_timeout=120)
    print(f"startup failure reported in {time.monotonic() - started:.2f}s")
    assert wait_no_children() == []


def test_startup_failure_of_a_missing_model(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"no config\.json"):
        SyncMPClient(CONFIG, str(tmp_path), startup_timeout=120)
    assert wait_no_children() == []


@pytest.mark.serial
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_kill_9_of_the_core_fails_open_requests_within_1s(kind: str, tiny_model_path: Path) -> None:
    client = (
        SyncMPClient(CONFIG, str(tiny_model_path))
        if kind == "sync"
        else AsyncAdapter(CONFIG, str(tiny_model_path))
    )
    core = client.core if kind == "sync" else client.client.core
    client.add_request(req("long", list(range(10, 60)), max_tokens=1000))
    client.get_output(timeout=30)
    os.kill(core.proc.pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDeadError, match="died"):
        while True:
            client.get_output(timeout=5)
    elapsed = time.monotonic() - killed
    print(f"{kind}: EngineDeadError {elapsed * 1000:.0f} ms after kill -9")
    assert elapsed < 1.0
    again = time.monotonic()
    with pytest.raises(EngineDeadError):
        client.add_request(req("later", [1, 2, 3]))
    assert time.monotonic() - again < 0.1
    client.shutdown()
    assert wait_no_children() == []


def test_malformed_messages_are_rejected_and_the_core_keeps_serving(
    tiny_model_path: Path,
) -> None:
    client = SyncMPClient(CONFIG, str(tiny_model_path))
    try:
        sock = client.core.in_sock
        sock.send_multipart([b"\x00", b"not msgpack at all"])
        sock.send_multipart([b"\x00", b"\x93\x01\x02\x03"])  # msgpack, wrong shape
        sock.send_multipart([b"\x7f", b"unknown type"])
        sock.send_multipart([b"\x01"])  # one frame
        client.add_request(req("ok", [4, 5, 6], max_tokens=3))
        got = []
        while len(got) < 3:
            got += [t for o in client.get_output(timeout=30).outputs for t in o.new_token_ids]
        assert client.core.proc.is_alive()
    finally:
        client.shutdown()


def test_tcp_transport(tiny_model_path: Path) -> None:
    client = SyncMPClient(EngineConfig(num_kv_blocks=64, transport="tcp"), str(tiny_model_path))
    try:
        assert client.core.endpoints.input.startswith("tcp://127.0.0.1:")
        client.add_request(req("t", [4, 5, 6], max_tokens=2))
        outs = []
        while not outs or outs[-1].finish_reason is None:
            outs += client.get_output(timeout=30).outputs
        assert sum(len(o.new_token_ids) for o in outs) == 2
    finally:
        client.shutdown()


def test_ipc_sockets_live_in_a_private_folder() -> None:
    endpoints = Endpoints("ipc")
    try:
        assert endpoints.folder is not None
        assert stat.S_IMODE(endpoints.folder.stat().st_mode) == 0o700
    finally:
        endpoints.cleanup()


def test_llm_in_core_process_matches_inproc_and_cleans_up(tiny_model_path: Path) -> None:
    prompts = [{"prompt_token_ids": [5 + i, 77, 300 + i, 12]} for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=6)
    inproc = LLM(str(tiny_model_path), num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in inproc.generate(prompts, params, use_tqdm=False)]
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with LLM(str(tiny_model_path), num_kv_blocks=64, core_process=True) as llm:
        assert len(live_children()) >= 1
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        # A library: the caller's signal handlers are its own (DESIGN §5).
        assert {sig: signal.getsignal(sig) for sig in handlers} == handlers
    assert got == expected
    assert wait_no_children() == []


def test_sigterm_to_the_parent_leaves_no_core_process(tiny_model_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        import time
        from engine import LLM
        if __name__ == "__main__":
            llm = LLM({str(tiny_model_path)!r}, num_kv_blocks=16, core_process=True)
            print(llm.client.core.proc.pid, flush=True)
            time.sleep(600)
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        core_pid = int(parent.stdout.readline())  # type: ignore[union-attr]
        parent.send_signal(signal.SIGTERM)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 5
        while pid_alive(core_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pid_alive(core_pid), "the core outlived its parent"
    finally:
        parent.kill()


@pytest.mark.serial
def test_kill_9_of_a_tp_worker_fails_open_requests_within_1s(tiny_model_path: Path) -> None:
    client = SyncMPClient(
        EngineConfig(num_kv_blocks=64, tensor_parallel_size=2), str(tiny_model_path)
    )
    workers = [p for p in live_children(client.core.proc.pid) if pid_alive(p.pid)]
    assert len(workers) >= 2
    client.add_request(req("long", list(range(10, 60)), max_tokens=1000))
    client.get_output(timeout=30)
    os.kill(workers[-1].pid, signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(EngineDeadError):
        while True:
            client.get_output(timeout=5)
    elapsed = time.monotonic() - killed
    print(f"tp=2: EngineDeadError {elapsed * 1000:.0f} ms after kill -9 of a worker")
    assert elapsed < 1.0
    client.shutdown()
    assert wait_no_children() == []
