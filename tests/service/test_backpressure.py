"""Disconnects, stalled readers and admission control on a real server (DESIGN §6)."""

from __future__ import annotations

import contextlib
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.helpers.load import (
    SlowReader,
    StalledClient,
    server_idle,
    stream_chat,
    wait_until,
)
from tests.helpers.server import LumenServer, metric

MESSAGES = [{"role": "user", "content": "Tell me a long story."}]
LONG = {"messages": MESSAGES, "max_tokens": 1800, "temperature": 0, "ignore_eos": True}


def _delta(before: dict, after: dict, name: str, **labels: str) -> float:
    return metric(after, name, **labels) - metric(before, name, **labels)


def test_disconnected_clients_free_their_kv_blocks(tiny_server: LumenServer) -> None:
    before = tiny_server.metrics()
    with ThreadPoolExecutor(4) as pool:
        hung_up = list(pool.map(lambda _: stream_chat(tiny_server, LONG, stop_after=5), range(4)))
    assert all(r.num_chunks == 5 for r in hung_up)
    # A non-streaming client that gives up waiting.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            tiny_server.url("/v1/chat/completions"),
            json=LONG,
            headers=tiny_server.headers(),
            timeout=httpx.Timeout(30, read=0.5),
        )
    elapsed = wait_until(lambda: server_idle(tiny_server), timeout=10)
    after = tiny_server.metrics()
    print(f"\nKV blocks back to zero {elapsed:.2f} s after the last client left")
    assert _delta(before, after, "lumen:client_disconnects_total") == 5
    assert _delta(before, after, "lumen:request_success_total", finished_reason="abort") == 5
    # Far fewer tokens than the 5 x 1800 the requests asked for.
    assert _delta(before, after, "lumen:generation_tokens_total") < 5 * 1800 / 2


def _running(server: LumenServer) -> bool:
    return metric(server.metrics(), "lumen:num_requests_running") > 0


@pytest.mark.serial  # a ratio of rates on the wall clock
def test_a_stalled_reader_does_not_slow_the_others(tiny_server: LumenServer) -> None:
    body = {**LONG, "max_tokens": 200}
    heavy = {**LONG, "n": 8}

    def three_readers() -> float:
        with ThreadPoolExecutor(3) as pool:
            return statistics.mean(
                r.rate for r in pool.map(lambda _: stream_chat(tiny_server, body), range(3))
            )

    # Baseline: the fourth client is just as heavy but reads, for as long as the three do
    # (a stalled one keeps its eight sequences decoding throughout).
    done = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        fourth = pool.submit(stream_chat, tiny_server, heavy, until=done.is_set)
        wait_until(lambda: _running(tiny_server), timeout=30)
        normal = three_readers()
        done.set()
        fourth.result()
    with StalledClient(tiny_server, heavy):
        wait_until(lambda: _running(tiny_server), timeout=30)
        stalled = three_readers()
    ratio = stalled / normal
    print(
        f"\nothers' rate: {normal:.0f} chunks/s beside a reader, {stalled:.0f} beside a stalled one"
    )
    print(f"ratio {ratio:.2f}")
    assert ratio > 0.5
    wait_until(lambda: server_idle(tiny_server), timeout=30)


def test_a_slow_reader_gets_the_whole_stream(tiny_server: LumenServer) -> None:
    """A reader that stops reading until its whole completion is generated, then reads it:
    its stream says what a fast reader's does, every token once and in order, in fewer events
    (what waited was merged, not buffered). Streamed text is written straight from the
    engine's output loop while a connection takes it at once, and by the request's own task
    once it does not."""
    body = {"prompt": "Read slowly", "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    whole = httpx.post(
        tiny_server.url("/v1/completions"), json=body, headers=tiny_server.headers(), timeout=60
    ).json()["choices"][0]["text"]
    before = metric(tiny_server.metrics(), "lumen:generation_tokens_total")

    def generated() -> bool:  # all of it, while the reader did not read
        return metric(tiny_server.metrics(), "lumen:generation_tokens_total") >= before + 1000

    reader = SlowReader(tiny_server, body, stall_s=0.2, until=generated).run()
    texts = reader.texts()
    print(f"\nslow reader: 1000 tokens in {len(texts)} events, {reader.num_bytes:,} bytes")
    assert "".join(texts) == whole
    assert len(texts) < 900


@pytest.fixture(scope="module")
def tight_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path):
    log = tmp_path_factory.mktemp("tight") / "serve.log"
    args = [
        "--max-concurrent-requests",
        "2",
        "--max-queue-wait",
        "1",
        "--stream-stall-timeout",
        "2",
    ]
    args += ["--served-model-name", "tight", "--enable-per-request-metrics"]
    # 2 ms more a step: a long stream outlasts the 2 s stall timeout on the fastest CPU (a Zen 5
    # generated all 8 x 1,800 tokens before the stall was noticed).
    slow = {"LUMEN_DEBUG_DELAY": "schedule=0.002"}
    with LumenServer(tiny_model_path, *args, "--num-kv-blocks", "512", log_path=log, env=slow) as s:
        yield s


def test_admission_refuses_early_with_retry_after(tight_server: LumenServer) -> None:
    url = tight_server.url("/v1/chat/completions")
    before = tight_server.metrics()
    short = {"model": "tight", "messages": MESSAGES, "max_tokens": 2}
    assert [m.id for m in tight_server.client().models.list().data] == ["tight"]
    with contextlib.ExitStack() as stack:
        # Two open streams hold both slots while the others arrive. (Their line
        # iterators are kept: a dropped one would close its connection.)
        held = []
        for _ in range(2):
            r = stack.enter_context(httpx.stream("POST", url, json={**LONG, "stream": True}))
            assert r.status_code == 200
            held.append(r.iter_lines())
            next(held[-1])
        with ThreadPoolExecutor(4) as pool:
            refused = list(pool.map(lambda _: httpx.post(url, json=short, timeout=30), range(4)))
    statuses = sorted(r.status_code for r in refused)
    print(f"\nstatuses while full: {statuses}")
    assert statuses == [429, 429, 503, 503]
    for r in refused:
        assert r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] in ("queue_full", "queue_timeout")
    wait_until(lambda: server_idle(tight_server), timeout=10)
    assert httpx.post(url, json=short, timeout=30).status_code == 200
    after = tight_server.metrics()
    assert _delta(before, after, "lumen:admission_rejections_total", reason="queue_full") == 2
    assert _delta(before, after, "lumen:admission_rejections_total", reason="queue_timeout") == 2


def test_a_stalled_stream_is_aborted_after_the_timeout(tight_server: LumenServer) -> None:
    before = tight_server.metrics()
    with StalledClient(tight_server, {**LONG, "n": 8}):
        elapsed = wait_until(
            lambda: _delta(before, tight_server.metrics(), "lumen:stream_stall_aborts_total") == 1,
            timeout=60,
        )
        print(f"\nstalled stream aborted after {elapsed:.1f} s (timeout 2 s)")
        wait_until(lambda: server_idle(tight_server), timeout=10)
    after = tight_server.metrics()
    assert _delta(before, after, "lumen:request_success_total", finished_reason="abort") == 1


def test_the_server_flag_gives_every_response_its_metrics(tight_server: LumenServer) -> None:
    """--enable-per-request-metrics (vLLM's flag): a response carries `metrics` unasked."""
    r = httpx.post(tight_server.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 3})
    m = r.json()["metrics"]
    assert m["time_to_first_token_ms"] > 0 and m["ttft_parts_ms"]["prefill"] > 0
