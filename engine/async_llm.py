"""AsyncLLM: the server's engine. One output stream per request over the AsyncMPClient."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.errors import (
    CLIENT,
    ENGINE_DEAD,
    ENGINE_RESTARTED,
    SHUTDOWN,
    STALLED,
    EngineDeadError,
    EngineHandOverError,
    EngineRestartingError,
    RequestAbortedError,
)
from engine.frontend import Frontend, FrontendObserver
from engine.lora import LoRARequest
from engine.messages import EngineCoreRequest, EngineInfo, EngineStats, UtilityMethod
from engine.model_files import resolve_config
from engine.mp_client import STARTUP_TIMEOUT_S, AsyncMPClient, CoreProcess
from engine.output_stream import OutputStream, Submission
from engine.outputs import RequestOutput
from engine.processor import InputProcessor, PreparedPrompt, PromptType, start_loading_tokenizer
from engine.request_ids import new_request_id
from engine.sampling_params import SamplingParams
from engine.stats import StatLogger

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


class StreamStalledError(RuntimeError):
    """The caller stopped reading a stream for longer than the stall timeout."""


class AsyncLLM:
    """Create inside a running event loop (the core process starts here, unless ``core`` is
    one ``launch_core`` started for the same config).

    ``generate`` yields delta RequestOutputs until the request finishes
    (``generate_prepared`` for a prompt ``prepare`` already checked).
    Leaving the iteration early (a client that disconnects, a cancelled
    task) aborts the request in the core, freeing its KV blocks. When the
    engine dies, every open stream raises EngineDeadError.

    ``supervised``: a server owns this engine. Its cores tell it of a SIGTERM
    (it conducts the stop), open streams of a dead core raise
    EngineRestartingError, and ``restart`` starts the next core. ``resubmit_timeout`` (with
    ``supervised``; a server passes --max-queue-wait): a request that has sent its caller no
    output when its core dies (a stream: no delta taken; otherwise always, as its output is one
    whole response) is not failed but sent again to the next core, if that core is ready within
    this many seconds.

    ``tokenizer``: its load, started by ``start_loading_tokenizer`` beside ``launch_core`` so
    that it overlaps the core's start instead of following its READY. ``processor``: another
    engine's, shared (a data-parallel group's engines prepare prompts alike).

    ``hand_over`` (with ``supervised``; set by ``engine.data_parallel.EngineGroup``): a request
    that has sent no output when its core dies is not kept for this engine's next core but
    handed back to its caller (``EngineHandOverError``), which sends it to another engine.
    """

    def __init__(
        self,
        config: EngineConfig,
        *,
        stall_timeout: float = 60.0,
        stat_loggers: tuple[StatLogger, ...] = (),
        core: CoreProcess | None = None,
        supervised: bool = False,
        tokenizer: Future[PreTrainedTokenizerBase] | None = None,
        resubmit_timeout: float = 0.0,
        processor: InputProcessor | None = None,
    ) -> None:
        # A core launched ahead (launch_core) resolved the model and its tokenizer already.
        path, config = (
            (core.model_path, core.config) if core is not None else resolve_config(config)
        )
        self.config, self.model_path, self.supervised = config, path, supervised
        if tokenizer is None and processor is None:  # while the core starts
            tokenizer = start_loading_tokenizer(config.tokenizer or path)
        if core is None and supervised:
            core = CoreProcess(config, path, notify_pid=os.getpid())
        self.client = AsyncMPClient(config, path, core=core)
        self.processor = processor or InputProcessor.for_model(
            path, self.client.info, tokenizer, config.sampling_defaults(path)
        )
        self.tokenizer = self.processor.tokenizer
        self.frontend = Frontend(
            self.processor, self.client.state, stat_loggers, config.stream_interval
        )
        self.frontend.engine = self.client.core.dp_rank
        self.stall_timeout = stall_timeout
        self.dead_error: EngineDeadError | None = None
        self.num_failed = 0  # requests failed with a dead engine, ever (a supervisor counts)
        self._dead = asyncio.Event()  # set when the output loop fails for good
        self._streams: dict[str, OutputStream] = {}
        # Requests a failed core left before they sent anything, waiting for the next core, for
        # at most resubmit_timeout seconds; 0: they fail with it.
        self._orphans: dict[str, OutputStream] = {}
        self.resubmit_timeout = resubmit_timeout if supervised else 0.0
        self.hand_over = False
        self.responsive = True  # the server's watchdog: False while its core looks hung
        self._wake = asyncio.Event()
        self.client.on_output = self._wake.set
        self._task = asyncio.create_task(self._output_loop(), name="async-llm-output")

    @property
    def is_alive(self) -> bool:
        return self.dead_error is None and self.client.core.dead_reason is None

    @property
    def rank(self) -> int:
        """Its data-parallel rank (0 alone)."""
        return self.client.core.dp_rank

    @property
    def members(self) -> tuple[AsyncLLM, ...]:
        """The engines a supervisor watches: this one (a group has several)."""
        return (self,)

    @property
    def num_open(self) -> int:
        """Requests open here, and those waiting for its next core."""
        return len(self._streams) + len(self._orphans)

    async def wait_dead(self) -> str:
        """Returns (why) once the engine cannot serve: the core or a worker died, or the
        output loop failed."""
        waits = [asyncio.ensure_future(e.wait()) for e in (self.client.dead_event, self._dead)]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        return self.client.core.dead_reason or str(self.dead_error or "engine died")

    def observe(self, observer: FrontendObserver) -> None:
        """Report every request's events to ``observer`` (the tracer)."""
        self.frontend.observe(observer)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        self.frontend.stat_loggers = (*self.frontend.stat_loggers, stat_logger)

    @property
    def info(self) -> EngineInfo:
        """What the core reported when it started (model, KV blocks, dtype, device...)."""
        return self.client.info

    @property
    def max_model_len(self) -> int:
        return self.client.info.max_model_len

    @property
    def num_backpressure(self) -> int:
        """How many times the core's output socket was full (the frontend read too slowly)."""
        return self.client.core.num_backpressure

    # Input processing, for callers that check a request before they generate (the server
    # answers 400 before it admits anything, then hands the PreparedPrompt to generate_prepared).
    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.processor.tokenize(prompt)

    def apply_chat_template(self, messages: list[dict], **options: Any) -> list[int]:
        return self.processor.apply_chat_template(messages, **options)

    def prepare(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> PreparedPrompt:
        """Tokenize and validate (ValueError): the one check a prepared prompt gets."""
        return self.processor.prepare(prompt, params, lora_request)

    async def generate(
        self,
        prompt: PromptType,
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_ns: int | None = None,
        stream: bool = True,
        close_trace: bool = True,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Validate ``prompt`` with ``params`` (ValueError), then as ``generate_prepared``."""
        arrival_ns = arrival_ns or time.time_ns()  # before tokenizing, which is the frontend's
        self._check_alive()
        prepared = self.processor.prepare(prompt, params)
        outputs = self.generate_prepared(
            prepared, request_id=request_id, priority=priority, arrival_ns=arrival_ns,
            stream=stream, close_trace=close_trace,
        )  # fmt: skip
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    async def generate_prepared(
        self,
        prompt: PreparedPrompt,
        *,
        request_id: str | None = None,
        priority: int = 0,
        arrival_ns: int | None = None,
        stream: bool = True,
        close_trace: bool = True,
        direct: Callable[[RequestOutput], bool] | None = None,
        hold_last: bool = False,
        attempt: int = 0,
        routed: str | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Run a prompt ``prepare`` checked, as it is (no second tokenize or validation).

        ``arrival_ns``: when the frontend received the request (default: now).
        ``stream=False`` tells the tracer that the caller delivers one whole
        response at the end (one frontend.emit), not each delta as it comes.
        ``close_trace=False``: the caller reports the request closed once its
        response is written (the server does, to time the last write).
        ``direct`` (with ``stream``): the caller's delivery of an output where it can deliver
        it at once, called by the output loop while the caller waits for the next output.
        True: it delivered the output, which is then not yielded; the caller must have
        delivered all it was yielded before it asks for more (a server writes each event
        before it reads the next). False: it delivered nothing, and the output is yielded.
        A stream then costs no task switch per token where its connection keeps up.
        ``hold_last`` (with ``stream`` and ``close_trace=False``): the caller writes the last
        output with the end of its response, so the trace marks it delivered at the close.
        ``attempt``: how many engines failed the request before it had sent output (a group
        hands it to this one after ``EngineHandOverError``: ``hand_over``). ``routed``: why
        a data-parallel group sent it to this engine (engine.data_parallel's Routed).
        """
        arrival_ns = arrival_ns or time.time_ns()
        self._check_alive()
        request_id = request_id or new_request_id()
        frontend = self.frontend
        stream_state = OutputStream(
            direct if stream else None, Submission(prompt, priority, arrival_ns, stream, routed)
        )
        stream_state.attempt = attempt
        requests = self._add(request_id, stream_state)  # raises if the id is in use
        self._streams[request_id] = stream_state
        finished = handed = False
        try:
            await self._send(requests)
            while not finished:
                try:
                    out = await stream_state.get()
                except EngineHandOverError:
                    handed = True  # its group sends it on, or fails it (handed_over)
                    raise
                finished = out.finished
                stream_state.sent = stream
                yield out
                if stream and not (finished and hold_last and not close_trace):
                    frontend.delivered(request_id)  # the caller took it
        finally:
            if not finished and not handed:
                await self.abort(request_id)
            if close_trace and not handed:
                frontend.closed(request_id)

    def _add(self, request_id: str, stream: OutputStream) -> list[EngineCoreRequest]:
        """Register the request with the frontend (again, for a new core: ``stream.attempt``);
        returns its core requests. A streamed request gets a delta after every step; any other,
        its whole output once."""
        sub = stream.submission
        assert sub is not None
        prompt = sub.prompt
        return self.frontend.add(
            request_id, prompt.text, prompt.prompt_token_ids, prompt.params,
            priority=sub.priority, arrival_ns=sub.arrival_ns, stream=sub.stream,
            stream_deltas=sub.stream, attempt=stream.attempt, routed=sub.routed,
            lora_request=prompt.lora_request,
        )  # fmt: skip

    async def _send(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            await self.client.add_request(request)
        self._wake.set()

    def _check_alive(self) -> None:
        if not self.is_alive:
            raise self.dead_error or EngineDeadError(self.client.core.dead_reason)

    async def abort(self, request_id: str, code: str = CLIENT) -> None:
        """Stop a request; its stream (if still read) ends with no more outputs. ``code``: who
        stopped it (engine.errors.END_CODES)."""
        self._streams.pop(request_id, None)
        self._orphans.pop(request_id, None)
        child_ids = self.frontend.abort(request_id, code)
        if child_ids and self.dead_error is None and not self.client.state.closed:
            with contextlib.suppress(EngineDeadError):
                await self.client.abort_requests(child_ids)

    async def get_stats(self) -> EngineStats:
        return await self.client.call_utility(UtilityMethod.GET_STATS)  # type: ignore[return-value]

    async def _output_loop(self) -> None:
        try:
            await self._pump_outputs()
        except asyncio.CancelledError:
            raise
        except Exception as e:
            # Whatever ends this loop ends every open stream with it, never a hang.
            if not isinstance(e, EngineDeadError):
                logger.exception("output loop failed")
                e = EngineDeadError(f"output loop failed: {e}")
            if self.supervised:
                e = EngineRestartingError(
                    f"the engine core failed ({e}) and is restarting: retry the request"
                )
            self._fail_all(e, resubmit=self.supervised)
            self._dead.set()

    async def _pump_outputs(self) -> None:
        last_stall_check = time.monotonic()
        frontend = self.frontend
        while True:
            if not self._streams and not self.client.has_pending():
                self._wake.clear()
                await self._wake.wait()
                continue
            results, to_abort = self.frontend.process(await self.client.get_output())
            if to_abort:
                await self.client.abort_requests(to_abort)
            delivered: list[tuple[str, int]] = []  # what the streams' readers wrote here
            for result in results:
                stream = self._streams.get(result.request_id)
                if stream is not None:
                    try:
                        if stream.deliver_directly(result):
                            delivered.append((result.request_id, time.time_ns()))
                            continue
                    except Exception:
                        logger.exception("direct delivery of %s failed", result.request_id)
                        stream.direct = None  # its reader gets this output and the rest
                    stream.put(result)
                    if result.finished:
                        del self._streams[result.request_id]
            if delivered:
                frontend.delivered_many(delivered)
            now = time.monotonic()
            if now - last_stall_check > 1.0:
                last_stall_check = now
                await self._abort_stalled(now)

    async def _abort_stalled(self, now: float) -> None:
        stalled = [
            (rid, s)
            for rid, s in self._streams.items()
            if s.pending is not None and now - s.pending_since > self.stall_timeout
        ]
        for request_id, stream in stalled:
            logger.warning(
                "aborting %s: its reader stalled for %.0fs", request_id, self.stall_timeout
            )
            await self.abort(request_id, STALLED)
            stream.fail(StreamStalledError(f"request {request_id} was not read in time"))

    def _fail_all(self, error: EngineDeadError, *, resubmit: bool = False) -> None:
        """Every open request fails with ``error``; with ``resubmit`` (a core failed and a
        supervisor starts the next), those that have sent their caller nothing wait for the
        next core instead, up to ``resubmit_timeout`` (``restart`` sends them again)."""
        self.dead_error = error
        code = ENGINE_RESTARTED if isinstance(error, EngineRestartingError) else ENGINE_DEAD
        for request_id, stream in self._streams.items():
            if resubmit and self.hand_over and not stream.sent and stream.submission:
                stream.fail(EngineHandOverError(str(error)))  # its group sends it on
                continue
            if resubmit and self.resubmit_timeout > 0 and not stream.sent and stream.submission:
                stream.orphan()
                self._orphans[request_id] = stream
                continue
            self.num_failed += 1
            stream.fail(error)
            self.frontend.failed(request_id, str(error), code)
        self._streams.clear()
        if self._orphans:
            logger.warning(
                "%d requests had sent no output: they wait up to %g s for the next engine core",
                len(self._orphans), self.resubmit_timeout,
            )  # fmt: skip
            loop = asyncio.get_running_loop()
            loop.call_later(self.resubmit_timeout, self._expire_orphans, error)

    def _expire_orphans(self, error: EngineDeadError) -> None:
        """Fail the requests that have waited for a new core ``resubmit_timeout`` or longer."""
        now = time.monotonic()
        late = [rid for rid, s in self._orphans.items()
                if now - s.orphaned_at >= self.resubmit_timeout - 1e-3]  # fmt: skip
        for request_id in late:
            stream = self._orphans.pop(request_id)
            self.num_failed += 1
            stream.fail(error)
            self.frontend.failed(request_id, str(error), ENGINE_RESTARTED)

    def handed_over(self, request_id: str, error: EngineDeadError | None = None) -> None:
        """A request ``EngineHandOverError`` handed back: another engine took it (forgotten
        here: that engine records it again), or, with ``error``, none could (failed here)."""
        if error is None:
            self.frontend.forget(request_id)
            return
        self.num_failed += 1
        self.frontend.failed(request_id, str(error), ENGINE_RESTARTED)

    async def _resubmit_orphans(self) -> None:
        """Send the requests a failed core left with nothing sent to the new core, each as a
        new attempt of itself (its trace keeps the time the failure cost it)."""
        orphans, self._orphans = self._orphans, {}
        for request_id, stream in orphans.items():
            self.frontend.forget(request_id)
            stream.attempt += 1
            requests = self._add(request_id, stream)
            self._streams[request_id] = stream
            await self._send(requests)
        if orphans:
            logger.info("sent %d requests again to engine core %d", len(orphans), self.epoch)

    async def abort_all(self, message: str) -> int:
        """End every open request now (a drain past its timeout): each stream gives what it
        has, then raises RequestAbortedError(message); the core frees their KV blocks.
        Returns how many were open."""
        streams = [*self._streams.items(), *self._orphans.items()]
        for request_id, stream in streams:
            await self.abort(request_id, SHUTDOWN)
            stream.fail(RequestAbortedError(message))
        return len(streams)

    async def restart(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        """Replace a dead core (or one the caller killed) with a new one for the same config,
        the next epoch; returns once it is warm and ready (or raises why it did not start)."""
        old = self.client
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        reason = old.core.dead_reason or "the engine core was replaced"
        self._fail_all(
            EngineRestartingError(reason) if self.supervised else EngineDeadError(reason),
            resubmit=self.supervised,
        )
        await old.shutdown()
        epoch = old.core.epoch + 1
        core = await asyncio.to_thread(
            CoreProcess, self.config, self.model_path, epoch=epoch, notify_pid=os.getpid(),
            dp_rank=old.core.dp_rank, dp_size=old.core.dp_size,
        )  # fmt: skip
        await asyncio.to_thread(core.wait_ready, timeout)
        client = AsyncMPClient(self.config, self.model_path, core=core)
        client.state.keep_acks = old.state.keep_acks
        client.on_output = self._wake.set
        self.client = client
        self.frontend.state = client.state
        self.dead_error = None
        self._dead = asyncio.Event()
        self._task = asyncio.create_task(self._output_loop(), name="async-llm-output")
        await self._resubmit_orphans()

    @property
    def epoch(self) -> int:
        """How many cores were started before the one serving now."""
        return self.client.core.epoch

    async def shutdown(self) -> None:
        self._streams.update(self._orphans)
        self._orphans.clear()
        self._fail_all(EngineDeadError("the engine is shutting down"))
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        await self.client.shutdown()
