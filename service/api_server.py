"""The OpenAI-compatible HTTP server: FastAPI routes, the front-door middleware, Hypercorn."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import signal
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import __version__
from engine.async_llm import AsyncLLM
from engine.background import in_background
from engine.config import EngineConfig
from engine.gc_pauses import gc_setting, settle_heap
from engine.launch import STARTUP_TIMEOUT_S, CoreProcess, launch_core
from engine.model_files import served_name
from engine.processor import start_loading_tokenizer
from engine.request_ids import new_request_id
from service import http_timing
from service.admission import Admission
from service.config import ServerConfig
from service.context import RequestContext, attach, context_of
from service.errors import APIError
from service.lifecycle import READY, Door, Lifecycle, LifecycleOptions, hang_timeout
from service.metrics import ServerMetrics
from service.monitor import watch_api_process
from service.protocol import ChatCompletionRequest, CompletionRequest
from service.serving import Serving
from tracing.config import TracingConfig
from tracing.recorder import Tracer
from tracing.store import prepare_appends

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)
_ID_KINDS = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}
# The routes FrontDoor serves itself for a valid body (``FrontDoor._complete``): the schema and
# the Serving method that prepares it. Their FastAPI routes answer every other body.
_COMPLETION_ROUTES: dict[str, tuple[type[ChatCompletionRequest | CompletionRequest], str]] = {
    "/v1/chat/completions": (ChatCompletionRequest, "prepare_chat"),
    "/v1/completions": (CompletionRequest, "prepare_completion"),
}


class FrontDoor:
    """Pure ASGI middleware, first in line for every request.

    Gives the request its id (echoed in ``x-request-id`` on every response,
    errors included), its arrival instant and the instant its first byte was
    read, checks the API key on /v1 routes (constant-time), and reads the body
    up to the size limit (413). It times every write of the response (how long
    the client's socket took to accept it) and, once the last byte is
    accepted, closes the traces of the engine requests the response started.
    What it learns and what the route tells it back travel in the request's
    one ``RequestContext`` (service/context.py).
    """

    def __init__(self, app: ASGIApp, serving: Serving, config: ServerConfig) -> None:
        self.app = app
        self.serving = serving
        self.api_key = config.api_key.encode() if config.api_key else None
        self.protected = ("/v1", "/health", "/metrics") if config.protect_probes else ("/v1",)
        self.max_body = config.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival_ns = time.time_ns()
        client = scope.get("client")
        http_start_ns = http_timing.request_started(client) or arrival_ns
        kind = _ID_KINDS.get(scope["path"], "req")
        headers = dict(scope["headers"])
        ctx = RequestContext(
            new_request_id(kind), kind, arrival_ns, min(http_start_ns, arrival_ns),
            _header(headers, b"x-request-id", 256), _header(headers, b"traceparent", 128),
        )  # fmt: skip
        attach(scope, ctx)
        facts = ctx.http
        id_header = (b"x-request-id", ctx.request_id.encode())
        lifecycle = self.serving.lifecycle
        status = 0

        chunk: http_timing.ChunkWriter | None = None  # set by a chunked response

        async def deliver(message: Message) -> None:
            """A body message, straight to the server, its delivery measured."""
            started = time.time_ns()
            body = message.get("body", b"")
            if chunk is not None and body:
                if message.get("more_body", False):
                    await chunk(body)  # the transport took it (a slow reader blocks it)
                else:  # the last chunk goes out with the body's end: one write
                    chunk.hold(body)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)  # likewise
            ended = time.time_ns()
            facts.send_wait_ns += ended - started
            facts.bytes_sent += len(body)
            facts.last_delivered_ns = ended
            if not facts.first_delivered_ns and ctx.stream is False:
                facts.first_delivered_ns = ended  # a whole response: one write

        def deliver_now(body: bytes) -> bool:
            """A stream's chunk written now if the connection takes it without a wait (False:
            nothing written; ``deliver`` it then)."""
            if chunk is None or not chunk.write_now(body):
                return False
            facts.bytes_sent += len(body)
            facts.last_delivered_ns = time.time_ns()
            return True

        async def send_with_id(message: Message) -> None:
            nonlocal status, chunk
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), id_header]
                if _chunked(scope, status, headers):
                    chunk = http_timing.chunk_writer(client)
                    if chunk is not None and ctx.hold_head:
                        chunk.hold_head()
                if lifecycle.closing:
                    headers.append((b"connection", b"close"))  # the client reconnects elsewhere
                message = {**message, "headers": headers}
                await send(message)
                return
            await deliver(message)

        # A stream's events skip the app's middleware on the way out (streaming.EventStream):
        # they only look at the response's start.
        ctx.deliver, ctx.deliver_now = deliver, deliver_now
        try:
            await self._handle(scope, receive, send_with_id, headers, ctx)
        finally:
            http_timing.request_ended(client)
            self._close_traces(scope["path"], ctx, status)

    def _close_traces(self, path: str, ctx: RequestContext, status: int) -> None:
        """The response is written (or abandoned): every engine request it started ends here."""
        tracer = self.serving.tracer
        if tracer is None:
            return
        if ctx.traced_ids:
            now_ns = time.time_ns()
            for rid in ctx.traced_ids:
                tracer.closed(rid, now_ns, ctx.http)
        elif ctx.kind != "req" and status >= 400:
            # A completion request the engine never saw (invalid, unauthorized, too big...).
            tracer.start(ctx.trace_start(ctx.request_id, path, self.serving.model_name, False))
            error = ctx.error or f"HTTP {status}"
            tracer.rejected(ctx.request_id, time.time_ns(), error, ctx.http)

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send_with_id: Send,
        headers: dict[bytes, bytes],
        ctx: RequestContext,
    ) -> None:
        if scope["path"].startswith(self.protected) and not self._authorized(headers):
            error = APIError(401, "invalid or missing API key", code="invalid_api_key")
            ctx.error = error.message
            await error.response()(scope, receive, send_with_id)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(headers, receive)
            if body is None:
                error = APIError(413, f"the request body is over {self.max_body} bytes")
                ctx.error = error.message
                await error.response()(scope, receive, send_with_id)
                return
            ctx.body_read_ns, ctx.body_bytes = time.time_ns(), len(body)
            receive = _replay(body, receive)
            if (route := _COMPLETION_ROUTES.get(scope["path"])) is not None and (
                await self._complete(route, scope, receive, send_with_id, headers, body, ctx)
            ):
                return
        await self.app(scope, receive, send_with_id)

    async def _complete(
        self,
        route: tuple[type[ChatCompletionRequest | CompletionRequest], str],
        scope: Scope,
        receive: Receive,
        send_with_id: Send,
        headers: dict[bytes, bytes],
        body: bytes,
        ctx: RequestContext,
    ) -> bool:
        """Serve a completion request whose body is valid JSON of its schema, as its FastAPI
        route would but without FastAPI's layers (about 120 us a request on 2 busy cores);
        False, having done nothing, for any other body: the route answers it, with FastAPI's
        own errors."""
        model, prepare = route
        content_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
        if scope["method"] != "POST" or not (  # FastAPI's JSON types: application/json, .../*+json
            content_type == b"application/json"
            or (content_type.startswith(b"application/") and content_type.endswith(b"+json"))
        ):
            return False
        try:  # what FastAPI does with a JSON body: Starlette's json.loads, then validation
            parsed = model.model_validate(json.loads(body), from_attributes=True)
        except Exception:  # a bad body: its route says why, as ever
            return False
        try:
            prep = getattr(self.serving, prepare)(parsed, ctx, scope["path"])
            response = await self.serving.respond(prep, Request(scope, receive))
        except APIError as e:  # as the app's APIError handler answers
            ctx.error = e.message
            response = e.response()
        except Exception:  # as its handler of the unexpected
            logger.exception("unexpected error in %s", scope["path"])
            response = APIError(500, "internal server error").response()
        await response(scope, receive, send_with_id)
        return True

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes | None:
        """The whole body, or None when it is over the limit (read no further than that)."""
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _header(headers: dict[bytes, bytes], name: bytes, max_len: int) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")[:max_len]


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect

    return replayed


def build_app(serving: Serving) -> FastAPI:
    app = FastAPI(title="Lumen", version=__version__, description="OpenAI-compatible LLM server")

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError) -> Response:
        context_of(request.scope).error = e.message
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError) -> Response:
        context_of(request.scope).error = message = _describe(e.errors())
        return APIError(400, message).response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> Response:
        return APIError(e.status_code, str(e.detail), headers=e.headers).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception) -> Response:
        logger.exception("unexpected error in %s", request.url.path)
        return APIError(500, "internal server error").response()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        prep = serving.prepare_chat(body, context_of(request.scope), request.url.path)
        return await serving.respond(prep, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        prep = serving.prepare_completion(body, context_of(request.scope), request.url.path)
        return await serving.respond(prep, request)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(serving)]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        serving.check_model(model)
        return _model_card(serving)

    @app.get("/health")
    async def health() -> Response:
        """Readiness, as vLLM's probes use it: 200 only while a request would be served now."""
        lifecycle = serving.lifecycle
        ok = lifecycle.state == READY and serving.engine.is_alive
        headers = None if ok else {"Retry-After": "1"}
        return JSONResponse(lifecycle.describe(), 200 if ok else 503, headers=headers)

    @app.get("/livez")
    async def livez() -> Response:
        """Liveness: 200 while the process is up and its event loop answers, in every state."""
        return JSONResponse(serving.lifecycle.describe())

    @app.get("/metrics")
    async def metrics() -> Response:
        engine, m = serving.engine, serving.metrics
        if engine.is_alive:
            with contextlib.suppress(Exception):
                async with asyncio.timeout(2.0):
                    stats = await engine.get_stats()
                m.set_engine_stats(stats, engine.num_backpressure)
        if (tracer := serving.tracer) is not None:
            m.set_tracer_stats(tracer.stats())
        m.num_admitted.set(serving.admission.num_in_flight)
        m.num_admission_waiting.set(serving.admission.num_waiting)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


def _chunked(scope: Scope, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether h11 frames this response's body in chunks: HTTP/1.1, a body, and neither a
    length nor a transfer coding of the app's own."""
    if scope.get("http_version") != "1.1" or scope.get("method") == "HEAD":
        return False
    if status < 200 or status in (204, 304):
        return False
    return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)


def _model_card(serving: Serving) -> dict[str, Any]:
    return {
        "id": serving.model_name,
        "object": "model",
        "created": 0,
        "owned_by": "lumen",
        "root": serving.model_name,
        "max_model_len": serving.engine.max_model_len,
    }


def _describe(errors: Any) -> str:
    parts = []
    for err in list(errors)[:5]:
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        parts.append(f"{loc}: {err.get('msg', 'invalid')}" if loc else str(err.get("msg")))
    return "; ".join(parts) or "invalid request"


async def serve(
    engine_config: EngineConfig,
    config: ServerConfig,
    tracing: TracingConfig | None = None,
    core: CoreProcess | None = None,
) -> int:
    """Run until a stop signal's drain ends (exit 0) or a crash loop (exit 1): see
    service/lifecycle.py. ``core``: the core process, already launched for ``engine_config``
    (``launch_core(..., supervised=True)``). The port is bound at once: while the core loads
    and warms up, /health answers 503 naming the phase and /livez 200."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    gc_setting()  # a bad LUMEN_GC fails here, before the engine starts (if not launched)
    model_name = config.served_model_name or served_name(engine_config.model)
    if core is None:
        core = launch_core(engine_config, supervised=True)
    # Loaded while the core starts (about 1 s of a 2-core machine after READY otherwise).
    tokenizer = start_loading_tokenizer(core.config.tokenizer or core.model_path)
    if tracing is not None and tracing.db_path is not None:  # what the trace writer will need
        in_background(prepare_appends, name="lumen-trace-appends")
    door = Door(lambda: core.phase)
    hc = Config()
    hc.bind = [f"{config.host}:{config.port}"]
    hc.accesslog = None
    # The drain happened before Hypercorn is told to stop: this is only for the last bytes of
    # the responses it ended, and idle keep-alive connections.
    hc.graceful_timeout = 2.0
    stopped = asyncio.Event()
    server = asyncio.create_task(
        hypercorn_serve(door, hc, shutdown_trigger=stopped.wait),  # type: ignore[arg-type]
        name="hypercorn",
    )
    if not await _started(core, server, stopped):
        return 0  # stopped by a signal before the engine was ready
    try:
        return await _serve_ready(
            engine_config, config, tracing, core, tokenizer, model_name, door, stopped
        )
    finally:
        stopped.set()
        await server


async def _started(core: CoreProcess, server: asyncio.Task[None], stopped: asyncio.Event) -> bool:
    """Wait for the core's READY while Hypercorn answers the probes; False if a stop signal
    came first (the core is stopped). A core that fails to start, or a port that cannot be
    bound, raises (after both are stopped)."""
    loop = asyncio.get_running_loop()
    signalled: list[str] = []

    def stop(name: str) -> None:
        logger.info("%s while starting: stopping", name)
        signalled.append(name)
        # Nothing was admitted; its wait_ready raises. (A SIGTERM it would pass back to us.)
        core.proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        loop.add_signal_handler(sig, stop, sig.name)
    ready = asyncio.create_task(asyncio.to_thread(core.wait_ready, STARTUP_TIMEOUT_S))
    await asyncio.wait({ready, server}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # Hypercorn ended first: it could not bind
        await asyncio.to_thread(core.close, 0)
        with contextlib.suppress(BaseException):
            await ready
        server.result()  # raises why
        raise RuntimeError("the HTTP server stopped before the engine was ready")
    try:
        ready.result()
    except BaseException:
        stopped.set()
        await server
        if signalled:
            return False
        raise
    return True


async def _serve_ready(
    engine_config: EngineConfig,
    config: ServerConfig,
    tracing: TracingConfig | None,
    core: CoreProcess,
    tokenizer: Future[PreTrainedTokenizerBase],
    model_name: str,
    door: Door,
    stopped: asyncio.Event,
) -> int:
    # The core is READY: this takes its config and info, and the tokenizer loaded meanwhile.
    engine = AsyncLLM(
        engine_config, stall_timeout=config.stream_stall_timeout, core=core, supervised=True,
        tokenizer=tokenizer,
    )  # fmt: skip
    metrics = ServerMetrics(model_name, engine.max_model_len)
    engine.add_stat_logger(metrics)
    # Always a tracer, even with no store or collector: it feeds /metrics' boundary histograms.
    tracer = Tracer(
        tracing or TracingConfig(no_trace_db=True), engine.info,
        engine_config=engine_config, observe_boundary=metrics.observe_boundary,
        observe_delivery=metrics.observe_delivery, host=config.host, port=config.port,
    )  # fmt: skip
    engine.observe(tracer)
    if tracer.store is not None:
        logger.info("recording traces in %s", tracer.store.path)
    admission = Admission(config.max_concurrent_requests, config.max_queue_wait)
    options = LifecycleOptions(
        shutdown_timeout=config.shutdown_timeout,
        max_restarts=config.max_restarts,
        restart_window=config.restart_window,
        hang_timeout=hang_timeout(
            engine.config, engine.info.step_prior, config.engine_hang_timeout
        ),
        exit_grace_period=config.exit_grace_period,
    )
    lifecycle = Lifecycle(engine, admission, metrics, tracer, options, stopped)
    serving = Serving(
        engine,
        metrics,
        admission,
        lifecycle,
        model_name=model_name,
        stall_timeout=config.stream_stall_timeout,
        tracer=tracer,
        reasoning_parser=config.reasoning_parser,
    )
    http_timing.install()
    monitor = asyncio.create_task(watch_api_process(metrics, tracer), name="api-monitor")
    settle_heap()  # the engine is up and the app built: what lives now lives for good
    door.app = FrontDoor(build_app(serving), serving, config)
    lifecycle.start()
    logger.info(
        "serving %s on http://%s:%d (%s; engine hang timeout %.0f s)",
        model_name,
        config.host,
        config.port,
        "API key required" if config.api_key else "no API key",
        options.hang_timeout,
    )
    try:
        await stopped.wait()
    finally:
        await lifecycle.close()
        monitor.cancel()
        await engine.shutdown()
        await asyncio.to_thread(tracer.shutdown)
    logger.info("stopped (exit code %d)", lifecycle.exit_code)
    return lifecycle.exit_code
