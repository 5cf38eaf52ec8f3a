"""The OpenAI-compatible HTTP server: FastAPI routes and Hypercorn (the front door in front of
them: service/front_door.py)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, PlainTextResponse, Response

from engine import __version__, chat_templates, faults
from engine.async_llm import AsyncLLM
from engine.background import in_background
from engine.config import EngineConfig
from engine.data_parallel import EngineGroup
from engine.gc_pauses import gc_setting, settle_heap
from engine.launch import STARTUP_TIMEOUT_S, CoreProcess, launch_cores
from engine.model_files import served_name
from engine.processor import start_loading_tokenizer
from service import http_timing
from service.admission import Admission
from service.config import ServerConfig
from service.context import context_of
from service.errors import APIError
from service.front_door import FrontDoor
from service.lifecycle import READY, Door, Lifecycle, LifecycleOptions, hang_timeout
from service.lora_adapters import LoraAdapters, runtime_updating
from service.metrics import ServerMetrics
from service.monitor import watch_api_process
from service.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
)
from service.serving import Serving
from tracing.config import TracingConfig
from tracing.recorder import Tracer
from tracing.store import prepare_appends

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def build_app(serving: Serving, runtime_lora_updating: bool = False) -> FastAPI:
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
        return {"object": "list", "data": [_model_card(serving), *serving.adapters.cards()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> dict[str, Any]:
        if serving.check_model(model) is None:
            return _model_card(serving)
        return next(c for c in serving.adapters.cards() if c["id"] == model)

    if runtime_lora_updating:

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            """vLLM's route: check the folder against the model, then serve it by its name."""
            serving.adapters.load(body.lora_name, body.lora_path, body.base_model_name)
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' added successfully."
            )

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            """vLLM's route: requests naming it get a 404 from now; those running finish."""
            serving.adapters.unload(body.lora_name or "")
            return PlainTextResponse(
                f"Success: LoRA adapter '{body.lora_name}' removed successfully."
            )

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
        every = []
        for member in engine.members:
            if member.is_alive:
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(2.0):
                        stats = await member.get_stats()
                    m.set_engine_stats(stats, member.rank)
                    every.append(stats)
        m.set_lora_info(every)
        m.set_backpressure(engine.num_backpressure)
        if (tracer := serving.tracer) is not None:
            m.set_tracer_stats(tracer.stats())
        m.num_admitted.set(serving.admission.num_in_flight)
        m.num_admission_waiting.set(serving.admission.num_waiting)
        return Response(m.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


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
    cores: list[CoreProcess] | None = None,
    adapters: LoraAdapters | None = None,
) -> int:
    """Run until a stop signal's drain ends (exit 0) or a crash loop (exit 1): see
    service/lifecycle.py. ``cores``: the core processes, one per data-parallel engine, already
    launched for ``engine_config`` (``launch_cores``). ``adapters``: the LoRA adapters served
    (service/lora_adapters.py ``start``; None: none, and none may be loaded). The port is
    bound at once: while the cores load and warm up, /health answers 503 naming the phase and
    /livez 200."""
    from hypercorn.asyncio import serve as hypercorn_serve
    from hypercorn.config import Config

    gc_setting()  # a bad LUMEN_GC fails here, before the engine starts (if not launched)
    model_name = config.served_model_name or served_name(engine_config.model)
    if cores is None:
        cores = launch_cores(engine_config, config.data_parallel_size)
    core = cores[0]
    # Loaded while the core starts (about 1 s of a 2-core machine after READY otherwise).
    tokenizer = start_loading_tokenizer(core.config.tokenizer or core.model_path)
    if tracing is not None and tracing.db_path is not None:  # what the trace writer will need
        in_background(prepare_appends, name="lumen-trace-appends")
    door = Door(lambda: _phase(cores))
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
    if not await _started(cores, server, stopped):
        return 0  # stopped by a signal before the engine was ready
    try:
        return await _serve_ready(
            engine_config, config, tracing, cores, tokenizer, model_name, door, stopped, adapters
        )
    finally:
        stopped.set()
        await server


async def _started(
    cores: list[CoreProcess], server: asyncio.Task[None], stopped: asyncio.Event
) -> bool:
    """Wait for every core's READY while Hypercorn answers the probes; False if a stop signal
    came first (the cores are stopped). A core that fails to start, or a port that cannot be
    bound, raises (after all are stopped)."""
    loop = asyncio.get_running_loop()
    signalled: list[str] = []

    def stop(name: str) -> None:
        logger.info("%s while starting: stopping", name)
        signalled.append(name)
        # Nothing was admitted; its wait_ready raises. (A SIGTERM it would pass back to us.)
        for core in cores:
            core.proc.kill()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        loop.add_signal_handler(sig, stop, sig.name)
    ready = asyncio.create_task(_all_ready(cores))
    await asyncio.wait({ready, server}, return_when=asyncio.FIRST_COMPLETED)
    if not ready.done():  # Hypercorn ended first: it could not bind
        await asyncio.gather(*(asyncio.to_thread(core.close, 0) for core in cores))
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


def _phase(cores: list[CoreProcess]) -> str:
    """The start-up phase of the engines: the earliest any of them is in."""
    order = ("starting", "warming_up", "ready")
    return min((core.phase for core in cores), key=lambda p: order.index(p) if p in order else 0)


async def _all_ready(cores: list[CoreProcess]) -> None:
    """Every core READY; the first that fails to start stops the others and raises why."""
    waits = [asyncio.to_thread(core.wait_ready, STARTUP_TIMEOUT_S) for core in cores]
    try:
        await asyncio.gather(*waits)
    except BaseException:
        await asyncio.gather(*(asyncio.to_thread(core.close, 2) for core in cores))
        raise


async def _serve_ready(
    engine_config: EngineConfig,
    config: ServerConfig,
    tracing: TracingConfig | None,
    cores: list[CoreProcess],
    tokenizer: Future[PreTrainedTokenizerBase],
    model_name: str,
    door: Door,
    stopped: asyncio.Event,
    adapters: LoraAdapters | None = None,
) -> int:
    # The cores are READY: this takes their config and info, and the tokenizer loaded meanwhile.
    engine: AsyncLLM | EngineGroup
    if len(cores) == 1:
        engine = AsyncLLM(
            engine_config, stall_timeout=config.stream_stall_timeout, core=cores[0],
            supervised=True, tokenizer=tokenizer, resubmit_timeout=config.max_queue_wait,
        )  # fmt: skip
    else:
        engine = EngineGroup.start(
            engine_config, cores, stall_timeout=config.stream_stall_timeout, supervised=True,
            tokenizer=tokenizer, resubmit_timeout=config.max_queue_wait,
            prefix_affinity=config.data_parallel_prefix_affinity,
        )  # fmt: skip
    _chat_template(engine, config)
    metrics = ServerMetrics(model_name, engine.max_model_len)
    if engine_config.enable_lora:
        metrics.enable_lora(engine_config.max_loras)
    metrics.describe_cache(
        engine.info.block_size, engine.info.num_kv_blocks, engine.max_model_len,
        engine_config.kv_cache_dtype, engine_config.enable_prefix_caching,
        engine.info.kv_windows, engine.info.kv_group_size, len(cores),
    )  # fmt: skip
    for member in engine.members:
        member.add_stat_logger(metrics.for_engine(member.rank))
    # Always a tracer, even with no store or collector: it feeds /metrics' boundary histograms.
    tracer = Tracer(
        tracing or TracingConfig(no_trace_db=True), engine.info,
        engine_config=engine_config, observe_boundary=metrics.observe_boundary,
        observe_delivery=metrics.observe_delivery, host=config.host, port=config.port,
        data_parallel_size=len(cores),
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
        per_request_metrics=config.enable_per_request_metrics,
        spec_metrics=config.per_request_spec_decode_metrics,
        trust_request_chat_template=config.trust_request_chat_template,
        adapters=adapters,
    )
    http_timing.install()
    monitor = asyncio.create_task(watch_api_process(metrics, tracer), name="api-monitor")
    settle_heap()  # the engine is up and the app built: what lives now lives for good
    faults.arm_gc_pause("api")
    runtime_lora = runtime_updating(config.allow_runtime_lora_updating)
    door.app = FrontDoor(build_app(serving, runtime_lora), serving, config)
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


def _chat_template(engine: AsyncLLM | EngineGroup, config: ServerConfig) -> None:
    """--chat-template over the model's own; a model left with none is said at start (its
    chat requests get a 400 that names the flag)."""
    if config.chat_template is not None:
        engine.processor.chat_template = chat_templates.resolve(config.chat_template)
        logger.info("chat template: %s", chat_templates.describe(config.chat_template))
    elif engine.processor.chat_template is None:
        logger.warning(
            "the model has no chat template: /v1/chat/completions answers 400 until the server "
            "is started with --chat-template (%s)", chat_templates.HOW,
        )  # fmt: skip
