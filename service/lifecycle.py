"""The server's lifecycle (DESIGN §5): one drain for every stop signal, a supervisor that
restarts a dead or hung engine core, and the state that /health reports.

States: ``starting`` (until the first core is warm), ``ready``, ``unresponsive`` (the core
has not finished a loop iteration within the hang timeout), ``restarting`` (a new core is
starting and warming up), ``draining`` (a stop signal came: admission is closed, in-flight
requests finish within ``--shutdown-timeout``), ``stopping`` (the rest were aborted; the
trace rows are flushed and the process exits). /health answers 200 in ``ready`` only.

Stop signals: SIGTERM or SIGINT, to this process or to its whole group (Ctrl-C, systemd,
``kill -TERM -PGID``), start the drain; the core passes a SIGTERM of its own on as SIGUSR1
(engine/core/engine_core_proc.py), which starts the same drain; workers ignore both. A
second SIGTERM or SIGINT cuts the drain short: the rest are aborted at once, as cleanly.

Hangs: the core reports, with every output and a heartbeat every 0.5 s while idle or in a
long step, how long its loop has been busy in one iteration. A step is bounded by the token
budget (chunked prefill), so the hang timeout is a multiple of the warm-up's price of the
largest step the budget allows, never under 10 s: a 4K-token prefill on CPU, split into
chunks, stays far inside it. An idle core is not busy (its heartbeat says 0). A core that is
silent (SIGSTOP, a kernel holding the GIL) or busy past the timeout turns /health to 503;
past twice the timeout the supervisor kills it and starts a new one.

Several engines (``--data-parallel-size``): each is watched and restarted on its own, and
the group sends no request to one that is dead or silent. The server is ``ready`` while at
least one engine is; ``unresponsive`` when every live one is silent; ``restarting`` when none
is alive. The restarts of all engines count against one ``--max-restarts`` window.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from engine.data_parallel import EngineGroup
from service.admission import Admission
from service.errors import error_body
from service.metrics import ServerMetrics
from tracing.events import Lifecycle as LifecycleRow
from tracing.recorder import Tracer

logger = logging.getLogger(__name__)

STARTING, READY, UNRESPONSIVE = "starting", "ready", "unresponsive"
RESTARTING, DRAINING, STOPPING = "restarting", "draining", "stopping"
_WATCH_S = 0.25  # how often the watchdog looks at the core
_ABORT_WRITE_S = 2.0  # after the abort: for the aborted responses' last events to be written
MIN_HANG_TIMEOUT_S = 10.0
HANG_STEP_FACTOR = 20  # the hang timeout, in largest-step prices


def hang_timeout(config: EngineConfig, step_prior: list[float], given: float | None) -> float:
    """``given``, else max(10 s, 20 x the warm-up's price of the budget's largest step)."""
    if given is not None:
        return given
    if len(step_prior) < 3:
        return 3 * MIN_HANG_TIMEOUT_S  # no warm-up: no price to scale
    a, b, c = step_prior[:3]
    largest = (a + b * config.max_num_batched_tokens + c * config.max_num_seqs) / 1e9
    return max(MIN_HANG_TIMEOUT_S, HANG_STEP_FACTOR * largest)


@dataclass(frozen=True)
class LifecycleOptions:
    shutdown_timeout: float
    max_restarts: int
    restart_window: float
    hang_timeout: float
    exit_grace_period: float


class Lifecycle:
    """Owns the state, the stop signals, the supervisor and the watchdog of one server."""

    def __init__(
        self,
        engine: AsyncLLM | EngineGroup,
        admission: Admission,
        metrics: ServerMetrics,
        tracer: Tracer | None,
        options: LifecycleOptions,
        stopped: asyncio.Event,
    ) -> None:
        self.engine, self.admission, self.metrics = engine, admission, metrics
        self.tracer, self.options = tracer, options
        self.state = STARTING
        self.since_ns = time.time_ns()
        self._changed = asyncio.Event()  # set (and replaced) at every change of state
        self.stopped = stopped  # Hypercorn's shutdown trigger
        self.exit_code = 0
        self._force = asyncio.Event()
        self._drain: asyncio.Task[None] | None = None
        self._stop_signals = 0  # SIGTERM and SIGINT to this process: the second forces
        self._restarts: collections.deque[float] = collections.deque()
        self._hung: dict[int, str] = {}  # engine rank -> why the watchdog killed its core
        self._engine_state = {m.rank: READY for m in engine.members}  # each engine's own
        self._tasks: list[asyncio.Task[None]] = []

    # -- state -------------------------------------------------------------------------

    def set(self, state: str) -> None:
        if state == self.state:
            return
        logger.info("server state: %s -> %s", self.state, state)
        self.state, self.since_ns = state, time.time_ns()
        self.metrics.set_state(state)
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()  # wakes the requests waiting for the engine (wait_ready)

    @property
    def closing(self) -> bool:
        """Draining or stopping: new requests are refused (503, Connection: close)."""
        return self.state in (DRAINING, STOPPING)

    def describe(self) -> dict[str, object]:
        """The JSON body of /health and /livez."""
        described: dict[str, object] = {
            "status": self.state,
            "since": round(self.since_ns / 1e9, 3),
            "engine_epoch": self.engine.epoch,
            "restarts": len(self._restarts),
        }
        if len(self.engine.members) > 1:
            described["engines"] = [
                {"engine": m.rank, "status": self._engine_state[m.rank], "epoch": m.epoch}
                for m in self.engine.members
            ]
        return described

    async def wait_ready(self, timeout: float) -> bool:
        """Wait (up to ``timeout``) for the engine to be ready; False if it did not come or
        the server began to stop meanwhile."""
        deadline = time.monotonic() + timeout
        while not (self.state == READY and self.engine.is_alive):
            left = deadline - time.monotonic()
            if self.closing or left <= 0:
                return False
            # Ready but dead: the supervisor has yet to see it (it turns RESTARTING at once).
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(left, 0.02) if self.state == READY else left):
                    await self._changed.wait()
        return True

    # -- start and stop ------------------------------------------------------------------

    def start(self) -> None:
        """The engine is warm: serve, supervise, watch, and listen for stop signals."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_stop_signal, sig.name)
        loop.add_signal_handler(signal.SIGUSR1, self._on_core_signal)
        self.set(READY)
        self._tasks = [
            *(
                asyncio.create_task(self._supervise(m), name=f"engine-supervisor-{m.rank}")
                for m in self.engine.members
            ),
            asyncio.create_task(self._watch(), name="engine-watchdog"),
        ]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def _on_stop_signal(self, name: str) -> None:
        # A signal to the group reaches the core too, whose word (SIGUSR1) may be handled
        # first: only a second signal to this process cuts the drain short.
        self._stop_signals += 1
        if self._drain is None:
            self.begin_drain(name)
        elif self._stop_signals > 1 and not self._force.is_set():
            logger.warning("%s again: aborting the requests still in flight, then exiting", name)
            self._force.set()

    def _on_core_signal(self) -> None:
        if self._drain is None:
            self.begin_drain("SIGTERM to the engine core")

    def begin_drain(self, cause: str) -> None:
        self._drain = asyncio.create_task(self._drain_then_stop(cause), name="drain")

    async def _drain_then_stop(self, cause: str) -> None:
        start_ns = time.time_ns()
        timeout = self.options.shutdown_timeout
        in_flight = self.admission.num_in_flight
        self.set(DRAINING)
        logger.info(
            "draining (%s): %d requests in flight, up to %g s (--shutdown-timeout)",
            cause, in_flight, timeout,
        )  # fmt: skip
        deadline = time.monotonic() + timeout
        while self._busy() and time.monotonic() < deadline and not self._force.is_set():
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(min(0.05, max(deadline - time.monotonic(), 0))):
                    await self._force.wait()
        aborted = 0
        if self._busy():
            aborted = await self.engine.abort_all("the server is shutting down")
            logger.warning("drain: aborted %d requests still in flight", aborted)
            settle = time.monotonic() + _ABORT_WRITE_S
            while self._busy() and time.monotonic() < settle:
                await asyncio.sleep(0.02)
        self.set(STOPPING)
        self._record("drain", cause, start_ns, epoch=self.engine.epoch,
                     num_finished=max(in_flight - aborted, 0), num_failed=aborted)  # fmt: skip
        self.stopped.set()

    def _busy(self) -> bool:
        return self.admission.num_in_flight > 0 or self.admission.num_waiting > 0

    # -- crashes and hangs -----------------------------------------------------------------

    def _engine_is(self, member: AsyncLLM, state: str) -> None:
        """Set one engine's state; the server's follows from all of them (unless it stops)."""
        self._engine_state[member.rank] = state
        member.responsive = state == READY
        if self.closing or self.state == STARTING:
            return
        states = self._engine_state.values()
        for server_state in (READY, UNRESPONSIVE):
            if server_state in states:
                self.set(server_state)
                return
        self.set(RESTARTING)

    async def _supervise(self, member: AsyncLLM) -> None:
        rank, several = member.rank, len(self.engine.members) > 1
        which = f"engine {rank}" if several else "the engine"
        while True:
            failed_before = member.num_failed
            reason = await member.wait_dead()
            if self.closing:
                return  # a drain is under way: it aborts what is left
            died_ns = time.time_ns()
            hung = self._hung.pop(rank, None)
            cause = f"hung: {hung}" if hung else reason
            logger.error("%s failed (%s): open requests failed; restarting it", which, cause)
            self._engine_is(member, RESTARTING)
            now = time.monotonic()
            while self._restarts and now - self._restarts[0] > self.options.restart_window:
                self._restarts.popleft()
            if len(self._restarts) >= self.options.max_restarts:
                await self._give_up(cause, died_ns, member)
                return
            self._restarts.append(now)
            try:
                await member.restart()
            except asyncio.CancelledError:  # the server stops meanwhile: the failure stays a row
                failed = member.num_failed - failed_before
                stopped = f"{cause}; the server stopped before a new core was ready"
                self._record("restart", stopped, died_ns, epoch=member.epoch,
                             num_failed=failed, engine=rank)  # fmt: skip
                raise
            except Exception as e:  # it did not start: the next turn counts another restart
                logger.error("the new engine core did not start: %s", e)
                self._record("restart", f"{cause}; the new core failed: {e}", died_ns,
                             engine=rank)  # fmt: skip
                await asyncio.sleep(1.0)
                continue
            self.metrics.engine_restarts.inc()
            failed = member.num_failed - failed_before
            self._record("restart", cause, died_ns, epoch=member.epoch, num_failed=failed,
                         engine=rank)  # fmt: skip
            logger.info("%s: core %d ready %.1f s after the failure", which, member.epoch,
                        (time.time_ns() - died_ns) / 1e9)  # fmt: skip
            self._engine_is(member, READY)

    async def _give_up(self, cause: str, died_ns: int, member: AsyncLLM) -> None:
        o = self.options
        logger.error(
            "crash loop: %d restarts within %g s (--max-restarts, --restart-window); "
            "/health answers 503, exiting with code 1 in %g s",
            len(self._restarts), o.restart_window, o.exit_grace_period,
        )  # fmt: skip
        self._record("crash_loop", cause, died_ns, epoch=member.epoch, engine=member.rank)
        await asyncio.sleep(o.exit_grace_period)
        self.exit_code = 1
        self.set(STOPPING)
        self.stopped.set()

    async def _watch(self) -> None:
        bound = self.options.hang_timeout
        while True:
            await asyncio.sleep(_WATCH_S)
            if self.state not in (READY, UNRESPONSIVE):
                continue
            for member in self.engine.members:
                if member.is_alive:
                    self._watch_one(member, bound)

    def _watch_one(self, member: AsyncLLM, bound: float) -> None:
        core, state = member.client.core, self._engine_state[member.rank]
        stuck = core.stuck_for()
        which = (
            f"engine {member.rank}'s core" if len(self.engine.members) > 1 else "the engine core"
        )
        if stuck > 2 * bound and core.proc.pid is not None:
            self._hung[member.rank] = f"no loop iteration finished for {stuck:.1f} s"
            logger.error("%s is hung (%s): killing it", which, self._hung[member.rank])
            with contextlib.suppress(ProcessLookupError):
                os.kill(core.proc.pid, signal.SIGKILL)  # its supervisor sees it die
        elif stuck > bound and state == READY:
            logger.error("%s has not finished a step for %.1f s", which, stuck)
            self._engine_is(member, UNRESPONSIVE)
        elif stuck <= bound and state == UNRESPONSIVE:
            self._engine_is(member, READY)

    def _record(self, kind: str, cause: str, start_ns: int, **counts: int) -> None:
        if self.tracer is not None:
            self.tracer.lifecycle(LifecycleRow(kind, cause, start_ns, time.time_ns(), **counts))


class Door:
    """The ASGI app Hypercorn serves from the moment the port is bound: while the first engine
    core loads and warms up it answers the probes itself (/health 503 naming the phase, /livez
    200) and every other request with a 503 and ``Retry-After``; once the server is built,
    ``app`` takes every request. Lifespan events stay here (the app needs none)."""

    def __init__(self, phase: Callable[[], str]) -> None:
        self.app: ASGIApp | None = None
        self._phase = phase
        self._since = time.time_ns()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        status = {"status": self._phase(), "since": round(self._since / 1e9, 3),
                  "engine_epoch": 0, "restarts": 0}  # fmt: skip
        if scope["path"] == "/livez":
            response: Response = JSONResponse(status)
        elif scope["path"] == "/health":
            response = JSONResponse(status, 503, headers={"Retry-After": "1"})
        else:
            message = f"the server is starting ({status['status']}); retry later"
            body = error_body(503, message, code="starting")
            response = JSONResponse(body, 503, headers={"Retry-After": "1"})
        await response(scope, receive, send)
