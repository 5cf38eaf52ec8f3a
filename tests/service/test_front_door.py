"""The front door in-process: one typed context per request, the Hypercorn hook's version check,
and a served prompt validated once."""

from __future__ import annotations

import asyncio
import importlib.metadata
import logging
import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hypercorn.asyncio.run as hc_run
import pytest
from hypercorn.asyncio import serve
from hypercorn.config import Config

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from service import http_timing
from service.config import ServerConfig
from service.context import RequestContext, context_of
from service.front_door import FrontDoor
from service.protocol import CompletionRequest
from service.serving import Serving

DELAY_S = 0.2  # between the request's first bytes and the rest of its headers


@pytest.fixture
def fresh_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """``install`` runs anew in this test; Hypercorn's own class comes back after it."""
    monkeypatch.setattr(hc_run, "TCPServer", hc_run.TCPServer)
    monkeypatch.setattr(http_timing, "_installed", None)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _app(scope: dict[str, Any], receive: Any, send: Any, seen: list[RequestContext]) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    seen.append(context_of(scope))
    headers = [(b"content-length", b"2")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": b"ok"})


async def _request_slowly() -> tuple[RequestContext, bytes]:
    """One request through Hypercorn and the front door, its headers sent in two parts."""
    seen: list[RequestContext] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await _app(scope, receive, send, seen)

    serving = SimpleNamespace(tracer=None, model_name="m", lifecycle=SimpleNamespace(closing=False))
    door = FrontDoor(app, serving, ServerConfig())  # type: ignore[arg-type]
    port = _free_port()
    config = Config()
    config.bind = [f"127.0.0.1:{port}"]
    config.accesslog = None
    config.graceful_timeout = 1.0
    stop = asyncio.Event()
    server = asyncio.create_task(serve(door, config, shutdown_trigger=stop.wait))  # type: ignore[arg-type]
    try:
        for _ in range(100):
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                break
            except OSError:
                await asyncio.sleep(0.05)
        writer.write(b"GET /other HTTP/1.1\r\nhost: a\r\n")
        await writer.drain()
        await asyncio.sleep(DELAY_S)
        writer.write(b"x-request-id: mine\r\nconnection: close\r\n\r\n")
        await writer.drain()
        response = await asyncio.wait_for(reader.read(), 10)
        writer.close()
    finally:
        stop.set()
        await asyncio.wait_for(server, 10)
    assert len(seen) == 1
    return seen[0], response


def test_on_the_hooked_hypercorn_a_request_starts_at_its_first_byte(
    fresh_hook: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    installed = importlib.metadata.version("hypercorn")
    monkeypatch.setattr(http_timing, "HOOKED_HYPERCORN_VERSION", installed)
    assert http_timing.install()
    ctx, response = asyncio.run(_request_slowly())
    assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"ok")
    assert f"x-request-id: {ctx.request_id}".encode() in response
    assert (ctx.kind, ctx.client_request_id) == ("req", "mine")
    assert ctx.arrival_ns - ctx.http_start_ns >= 0.8 * DELAY_S * 1e9


def test_a_written_response_lets_go_of_the_front_doors_closures(fresh_hook: None) -> None:
    """The front door's write closures point at the request's context, which holds them:
    once the response is written the context lets go of them, so reference counting frees a
    request's objects (the server's own among them), not the garbage collector. Left to it,
    the API process's passes took 11-17 ms each, about 2 us a token at 64 streams."""
    ctx, response = asyncio.run(_request_slowly())
    assert response.startswith(b"HTTP/1.1 200")
    assert ctx.deliver is None and ctx.deliver_now is None


def test_another_hypercorn_falls_back_to_the_app_arrival_with_one_warning(
    fresh_hook: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(http_timing, "HOOKED_HYPERCORN_VERSION", "0.0.0")
    original = hc_run.TCPServer
    with caplog.at_level(logging.WARNING, logger=http_timing.__name__):
        assert not http_timing.install()
        assert not http_timing.install()  # a second call (another app) says nothing more
        ctx, response = asyncio.run(_request_slowly())
    assert hc_run.TCPServer is original
    warnings = [r for r in caplog.records if r.name == http_timing.__name__]
    assert len(warnings) == 1 and "0.0.0" in warnings[0].getMessage()
    assert response.startswith(b"HTTP/1.1 200")
    assert ctx.http_start_ns == ctx.arrival_ns  # the app's own instant


def test_a_served_prompt_is_validated_once_and_a_direct_one_still_is(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        llm = AsyncLLM(EngineConfig(model=str(tiny_model_path), num_kv_blocks=64))
        calls: list[list[int]] = []
        validate = llm.processor.validate

        def counting(ids: list[int], params: SamplingParams) -> None:
            calls.append(ids)
            validate(ids, params)

        monkeypatch.setattr(llm.processor, "validate", counting)
        serving = Serving(llm, None, None, None, model_name="m", stall_timeout=5.0)  # type: ignore[arg-type]
        try:
            ctx = RequestContext("cmpl-1", "cmpl", 1, 1)
            body = CompletionRequest(prompt=[[5, 6, 7], [8, 9]], max_tokens=3, ignore_eos=True)
            prep = serving.prepare_completion(body, ctx, "/v1/completions")
            assert calls == [[5, 6, 7], [8, 9]] and ctx.stream is False
            outs = [out async for _, out in serving._generate(prep)]
            assert sum(len(c.token_ids) for o in outs for c in o.outputs) == 6
            assert len(calls) == 2  # the engine ran the prepared prompts as they were
            # AsyncLLM.generate, called directly, still checks what it is given.
            with pytest.raises(ValueError, match="outside the vocabulary"):
                async for _ in llm.generate({"prompt_token_ids": [10**9]}, SamplingParams()):
                    pass
            assert len(calls) == 3
        finally:
            await llm.shutdown()

    asyncio.run(main())
