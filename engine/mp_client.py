"""EngineCore in its own process: spawn, ready handshake, liveness, and the two ZMQ clients."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import multiprocessing
import multiprocessing.connection
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from engine.background import name_os_thread
from engine.client import ClientState
from engine.config import EngineConfig
from engine.core.engine_core_proc import run_engine_core
from engine.errors import EngineDeadError
from engine.ipc import Endpoints
from engine.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    OutputType,
    ReadyMessage,
    RequestType,
    UtilityMethod,
    UtilityRequest,
    UtilityResult,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
SHUTDOWN_TIMEOUT_S = 10.0
_DEAD = object()


class CoreProcess:
    """The core's process and the frontend's end of its sockets.

    A reader thread decodes outputs and hands them to ``deliver``; a monitor
    thread waits on the process sentinel and calls ``deliver(_DEAD)`` the
    moment the process ends, so a kill -9 is noticed at once, not by timeout.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        *,
        epoch: int = 0,
        notify_pid: int | None = None,
        dp_rank: int = 0,
        dp_size: int = 1,
    ) -> None:
        """Spawns the process; ``wait_ready`` waits for its READY (the caller may do its own
        start-up meanwhile: `lumen serve` imports the server while the core loads).
        ``epoch``: how many cores were started before this one for the same engine (its
        outputs carry it; others are dropped). ``notify_pid``: the process the core tells of
        a SIGTERM (SIGUSR1), instead of exiting: the server that conducts the stop.
        ``dp_rank`` of ``dp_size``: which data-parallel engine it is."""
        self.config, self.model_path = config, model_path
        self.epoch = epoch
        self.dp_rank, self.dp_size, self.notify_pid = dp_rank, dp_size, notify_pid
        self.info: EngineInfo | None = None
        self.phase = "starting"  # then "warming_up" (the core's PROGRESS), then "ready"
        # The watchdog's view: when the core was last heard from, and how long its loop had
        # been busy in one iteration at that moment (a heartbeat's busy_ns).
        self.last_heard = time.monotonic()
        self.last_busy_s = 0.0
        self.ctx = zmq.Context()
        self.endpoints = Endpoints(config.transport)
        self.in_sock, self.out_sock = self.endpoints.bind(self.ctx)
        self.send_lock = threading.Lock()
        self.num_backpressure = 0
        self.dead_reason: str | None = None
        self._closed = False
        self._reader_started = False
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(
            target=run_engine_core,
            args=(
                config,
                model_path,
                self.endpoints.input,
                self.endpoints.output,
                epoch,
                notify_pid,
                dp_rank,
                dp_size,
            ),
            name=f"lumen-engine-core-dp{dp_rank}",
        )
        self.proc.start()
        self._finalizer = weakref.finalize(self, _kill, self.proc, self.endpoints)

    def wait_ready(self, timeout: float) -> EngineInfo:
        if self.info is not None:
            return self.info
        try:
            self.info = self._wait_ready(timeout)
        except BaseException:
            self.close(timeout=2)  # a core that failed is exiting already: let it
            raise
        return self.info

    def _wait_ready(self, timeout: float) -> EngineInfo:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.out_sock.poll(100):
                kind, payload = self.out_sock.recv_multipart()
                if kind == OutputType.PROGRESS.value:
                    self.phase = payload.decode()
                    continue
                if kind != OutputType.READY.value:
                    raise RuntimeError("engine core spoke before it was ready")
                ready = msgspec.msgpack.decode(payload, type=ReadyMessage)
                if ready.info is not None:
                    self.last_heard = time.monotonic()
                    self.phase = "ready"
                    return ready.info
                error = ValueError if ready.error_type == "ValueError" else RuntimeError
                raise error(ready.error)
            # A core that failed says why, then exits: its last word may land just after the
            # poll above, so a dead core's socket is read once more before its exit code is.
            if not self.proc.is_alive() and not self.out_sock.poll(500):
                raise RuntimeError(
                    f"engine core exited with code {self.proc.exitcode} while starting"
                )
        raise TimeoutError(f"engine core not ready after {timeout:.0f}s")

    def stuck_for(self) -> float:
        """Seconds the core has gone without finishing a loop iteration, as far as this side
        can tell: silence since it was last heard, plus the busy time it reported then."""
        return time.monotonic() - self.last_heard + self.last_busy_s

    def start(self, deliver: Any) -> None:
        decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        epoch = self.epoch

        def read() -> None:
            name_os_thread()
            # The reader owns out_sock from here on; it closes it when the context ends.
            try:
                while True:
                    _, payload = self.out_sock.recv_multipart(copy=False)
                    outs = decoder.decode(payload.buffer)
                    self.last_heard = time.monotonic()
                    if outs.epoch != epoch:
                        continue  # a late message of a core that is gone
                    if outs.busy_ns is not None:
                        self.last_busy_s = outs.busy_ns / 1e9
                        continue
                    self.last_busy_s = 0.0
                    if outs.engine_error is not None:
                        self.dead_reason = f"engine core failed: {outs.engine_error}"
                        deliver(_DEAD)
                        return
                    deliver(outs)
            except zmq.ContextTerminated:
                pass
            finally:
                self.out_sock.close(linger=0)

        def monitor() -> None:
            multiprocessing.connection.wait([self.proc.sentinel])
            self.proc.join(0.5)  # the sentinel fires a moment before the exit code is reaped
            if not self._closed:
                self.dead_reason = self.dead_reason or (
                    f"engine core process died (exit code {self.proc.exitcode})"
                )
                deliver(_DEAD)

        self._reader_started = True
        threading.Thread(target=read, name="client-reader", daemon=True).start()
        threading.Thread(target=monitor, name="client-monitor", daemon=True).start()

    def send(self, kind: RequestType, obj: Any, *, block: bool = True) -> bool:
        """Send one message; with block=False, False means the socket pushed back."""
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self._closed:
            raise EngineDeadError("the engine client is shut down")
        frames = (kind.value, msgspec.msgpack.encode(obj))
        with self.send_lock:
            try:
                self.in_sock.send_multipart(frames, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                self.num_backpressure += 1
                if not block:
                    return False
            # Pushed back: wait for room, but never past the core's death.
            while not self.in_sock.poll(100, zmq.POLLOUT):
                if self.dead_reason is not None:
                    raise EngineDeadError(self.dead_reason)
            self.in_sock.send_multipart(frames)
            return True

    def close(self, timeout: float = SHUTDOWN_TIMEOUT_S) -> None:
        """Ask the core to stop, wait for it, then make sure it is gone."""
        if self._closed:
            return
        self._closed = True
        if self.proc.is_alive() and timeout > 0:
            try:
                with self.send_lock:
                    self.in_sock.send_multipart((RequestType.SHUTDOWN.value, b""), zmq.NOBLOCK)
                self.proc.join(timeout)
            except zmq.ZMQError:
                pass
        self._finalizer()
        # Each socket is closed by the thread that uses it; term() then wakes
        # the reader's blocking recv with ContextTerminated.
        with self.send_lock:
            self.in_sock.close(linger=0)
        if not self._reader_started:
            self.out_sock.close(linger=0)
        self.ctx.term()


def _kill(proc: multiprocessing.process.BaseProcess, endpoints: Endpoints) -> None:
    if proc.is_alive():
        proc.terminate()
        proc.join(2)
    if proc.is_alive():
        proc.kill()
        proc.join(2)
    endpoints.cleanup()


class _MPClient:
    """What the two MP clients share: the process, request state, utility calls in flight."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        startup_timeout: float,
        core: CoreProcess | None = None,
    ) -> None:
        self.core = core if core is not None else CoreProcess(config, model_path)
        self.info = self.core.wait_ready(startup_timeout)
        self.state = ClientState()
        self._calls: dict[int, Any] = {}  # call id -> future of its UtilityResult
        self._call_ids = itertools.count()

    def _route(self, item: Any) -> bool:
        """Settle utility futures (or fail them all on death); True if the item is queued."""
        if item is _DEAD:
            # Swapped out, not iterated in place: callers may be adding calls meanwhile.
            calls, self._calls = self._calls, {}
            for future in calls.values():
                if not future.done():
                    future.set_exception(EngineDeadError(self.core.dead_reason))
            return True
        result = item.utility_result
        if result is not None:
            future = self._calls.pop(result.call_id, None)
            if future is not None and not future.done():
                future.set_result(result)
        return bool(item.outputs) or item.step is not None

    def _new_call(self, method: UtilityMethod, path: str | None, future: Any) -> UtilityRequest:
        self._check_alive()
        call = UtilityRequest(next(self._call_ids), method, path)
        self._calls[call.call_id] = future
        return call

    def _take(self, item: Any) -> EngineCoreOutputs:
        if item is _DEAD:
            self.state.dead = True
            raise EngineDeadError(self.core.dead_reason)
        return self.state.filter(item)

    def _check_alive(self) -> None:
        if self.state.dead or self.core.dead_reason is not None:
            self.state.dead = True
            raise EngineDeadError(self.core.dead_reason or "engine is dead")

    def _begin_shutdown(self) -> bool:
        """Stop admission; True if in-flight requests should be drained or aborted first."""
        if self.state.closed:
            return False
        self.state.closed = True
        return not self.state.dead and self.core.dead_reason is None


class SyncMPClient(_MPClient):
    """Blocking client for LLM: the core runs in its own process."""

    def __init__(
        self, config: EngineConfig, model_path: str, *, startup_timeout: float = STARTUP_TIMEOUT_S
    ) -> None:
        super().__init__(config, model_path, startup_timeout)
        self._queue: queue.Queue[Any] = queue.Queue()
        self.core.start(self._deliver)

    def _deliver(self, item: Any) -> None:
        if self._route(item):
            self._queue.put(item)

    def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.state.added(request.request_id)
        self.core.send(RequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        self.state.aborting(request_ids)
        self.core.send(RequestType.ABORT, request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch of outputs; an empty one at once when nothing is open."""
        self._check_alive()
        if not self.state.has_open() and self._queue.empty():
            return EngineCoreOutputs()
        try:
            return self._take(self._queue.get(timeout=timeout))
        except queue.Empty:
            return EngineCoreOutputs()

    def call_utility(
        self, method: UtilityMethod, path: str | None = None
    ) -> int | EngineStats | None:
        future: concurrent.futures.Future[UtilityResult] = concurrent.futures.Future()
        self.core.send(RequestType.UTILITY, self._new_call(method, path, future))
        return _unwrap(future.result())

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        """Stop admission, drain open requests up to the timeout, abort the rest, stop the core."""
        if self._begin_shutdown():
            deadline = time.monotonic() + drain_timeout
            try:
                while self.state.has_open() and time.monotonic() < deadline:
                    self.get_output(timeout=max(0.0, deadline - time.monotonic()))
                if self.state.open_ids:
                    self.core.send(RequestType.ABORT, sorted(self.state.open_ids))
            except EngineDeadError:
                pass
        self.core.close()


class AsyncMPClient(_MPClient):
    """asyncio client for the server: sends never block the event loop. ``core``: a core
    process already spawned for ``config`` (``CoreProcess``), else it spawns one."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        *,
        startup_timeout: float = STARTUP_TIMEOUT_S,
        core: CoreProcess | None = None,
    ) -> None:
        super().__init__(config, model_path, startup_timeout, core)
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        # Set the moment the core (or a worker) dies, even while nothing is open.
        self.dead_event = asyncio.Event()
        # Called when outputs are queued: a reader that sleeps while nothing is open wakes
        # for records that come after the last request (the KV state after aborts).
        self.on_output: Callable[[], Any] | None = None
        self.core.start(lambda item: self._loop.call_soon_threadsafe(self._deliver, item))

    def has_pending(self) -> bool:
        """Requests open, or outputs queued that nobody has read yet."""
        return self.state.has_open() or not self._queue.empty()

    def _deliver(self, item: Any) -> None:
        if item is _DEAD:
            self.dead_event.set()
        if self._route(item):
            self._queue.put_nowait(item)
            if self.on_output is not None:
                self.on_output()

    async def _send(self, kind: RequestType, obj: Any) -> None:
        while not self.core.send(kind, obj, block=False):
            await asyncio.sleep(0.001)  # pushed back: yield to the loop, then retry

    async def add_request(self, request: EngineCoreRequest) -> None:
        self._check_alive()
        self.state.added(request.request_id)
        await self._send(RequestType.ADD, request)

    async def abort_requests(self, request_ids: list[str]) -> None:
        self._check_alive()
        self.state.aborting(request_ids)
        await self._send(RequestType.ABORT, request_ids)

    async def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        self._check_alive()
        if not self.state.has_open() and self._queue.empty():
            return EngineCoreOutputs()
        if timeout is None:
            return self._take(await self._queue.get())
        try:
            async with asyncio.timeout(timeout):
                return self._take(await self._queue.get())
        except TimeoutError:
            return EngineCoreOutputs()

    async def call_utility(
        self, method: UtilityMethod, path: str | None = None
    ) -> int | EngineStats | None:
        future: asyncio.Future[UtilityResult] = self._loop.create_future()
        await self._send(RequestType.UTILITY, self._new_call(method, path, future))
        return _unwrap(await future)

    async def shutdown(self, drain_timeout: float = 0.0) -> None:
        if self._begin_shutdown():
            deadline = time.monotonic() + drain_timeout
            try:
                while self.state.has_open() and time.monotonic() < deadline:
                    await self.get_output(timeout=max(0.0, deadline - time.monotonic()))
                if self.state.open_ids:
                    await self._send(RequestType.ABORT, sorted(self.state.open_ids))
            except EngineDeadError:
                pass
        await asyncio.to_thread(self.core.close)


def _unwrap(result: UtilityResult) -> int | EngineStats | None:
    if result.error is not None:
        raise ValueError(result.error)
    return result.value
