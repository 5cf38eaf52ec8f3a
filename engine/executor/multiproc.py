"""MultiprocExecutor: one worker process per tensor-parallel rank, driven over pipes."""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import time
import weakref
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any, NoReturn

import msgspec
import torch

from engine import spec_config
from engine.config import EngineConfig
from engine.executor.base import WorkerDeadError
from engine.kv_layout import KVLayout
from engine.lora import LoRARequest
from engine.model_config import ModelConfig
from engine.worker.layers import check_tensor_parallel
from engine.worker.messages import (
    Done,
    ExecuteModel,
    Failed,
    InitKVCache,
    ModelRunnerOutput,
    Ready,
    ReleaseKVCache,
    SchedulerOutput,
    Shutdown,
    StartProfile,
    StopProfile,
    WorkerArgs,
    WorkerReply,
    WorkerRequest,
)

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
_SHUTDOWN_GRACE_S = 5.0
_BROKEN_GRACE_S = 0.5
_PEER_DEATH_WAIT_S = 0.2


class WorkerError(RuntimeError):
    """A worker raised while handling a request; its traceback is the message."""


class MultiprocExecutor:
    """Spawns ``tensor_parallel_size`` ranks; every request goes to all, every rank replies.

    Replies are awaited together with the worker processes' sentinels, so a
    rank that dies (even by kill -9) turns a pending or later call into
    ``WorkerDeadError`` at once instead of a hang. After a dead rank or a
    failed step the ranks may be out of step (one waiting in a collective), so
    the executor refuses further work; the engine is expected to shut down.
    """

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ) -> None:
        tp = config.tensor_parallel_size
        check_tensor_parallel(model_config, tp)
        if device.type == "cuda" and torch.cuda.device_count() < tp:
            raise ValueError(
                f"tensor_parallel_size {tp} needs {tp} GPUs, found {torch.cuda.device_count()}"
            )
        self._broken: str | None = None
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(WorkerReply)
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self.procs: list[BaseProcess] = []
        self.conns: list[Connection] = []
        # Registered before any start, so workers are reaped even if startup
        # raises half-way or the executor is dropped without shutdown().
        self._finalizer = weakref.finalize(self, _stop_workers, self.procs, self.conns)
        for rank in range(tp):
            parent_end, child_end = ctx.Pipe(duplex=True)
            args = WorkerArgs(
                model_config,
                device.type,
                dtype,
                max_model_len,
                config.block_size,
                config.seed,
                rank,
                tp,
                init_method,
                os.getpid(),
                config.resolve_kv_cache_dtype(dtype),
                config.quantization,
                KVLayout.of(model_config, not config.disable_hybrid_kv_cache_manager),
                spec_config.parse(config.speculative_config),
                config.lora_settings(),
            )
            proc = ctx.Process(
                target=_run_worker, args=(args, child_end), name=f"lumen-tp{rank}", daemon=False
            )
            proc.start()
            # Only the child keeps its end, so the worker's death reads as EOF here.
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)
        try:
            replies = self._collect(timeout_s=startup_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        ready = [r for r in replies if isinstance(r, Ready)]
        self._block_bytes = ready[0].block_bytes
        logger.info("%d tensor-parallel workers ready on %s", tp, ready[0].device)

    # -- Executor protocol --------------------------------------------------------

    def block_bytes(self) -> int:
        return self._block_bytes

    def init_kv_cache(self, num_blocks: int) -> None:
        self._call(InitKVCache(num_blocks))

    def release_kv_cache(self) -> None:
        self._call(ReleaseKVCache())

    def prefetch_lora(self, lora: LoRARequest) -> None:
        """Each rank reads it in the step that first schedules it (no message for it)."""

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        reply = self._call(ExecuteModel(sched))[0]
        assert isinstance(reply, Done) and reply.output is not None
        return reply.output

    def start_profile(self, path: str) -> None:
        """Each rank writes its own trace: trace.json -> trace.rank0.json, trace.rank1.json."""
        self._call(StartProfile(path))

    def stop_profile(self) -> None:
        self._call(StopProfile())

    def check_health(self) -> None:
        if self._broken is not None:
            raise WorkerDeadError(self._broken)
        for rank, proc in enumerate(self.procs):
            if proc.exitcode is not None:
                raise WorkerDeadError(_death(rank, proc))

    @property
    def sentinels(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def shutdown(self) -> None:
        """Tell every rank to stop, wait briefly, then terminate and kill what is left."""
        if self._finalizer.detach() is None:
            return  # already stopped
        # After a failure a rank may sit in a collective forever: don't wait long on it.
        grace = _BROKEN_GRACE_S if self._broken else _SHUTDOWN_GRACE_S
        self._broken = self._broken or "the executor was shut down"
        _stop_workers(self.procs, self.conns, grace)

    # -- the pipes ----------------------------------------------------------------

    def _call(self, msg: WorkerRequest) -> list[WorkerReply]:
        self.check_health()
        data = self._encoder.encode(msg)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(data)
            except OSError as e:
                self._broken = f"worker rank {rank} is unreachable: {e}"
                raise WorkerDeadError(self._broken) from e
        # A rank that fails a step may leave the others waiting in a collective.
        return self._collect(None, fail_fast=isinstance(msg, ExecuteModel))

    def _collect(self, timeout_s: float | None, *, fail_fast: bool = True) -> list[WorkerReply]:
        """One reply per rank, in rank order; raises as soon as any rank dies.

        Without a timeout this still never hangs on a dead rank: the wait
        includes every worker's sentinel. With ``fail_fast`` a rank's failure
        raises at once and the executor is broken; otherwise every reply is
        read first, so the pipes stay in step and the executor stays usable.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        replies: dict[int, WorkerReply] = {}
        by_conn = {conn: rank for rank, conn in enumerate(self.conns)}
        by_sentinel = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        while len(replies) < len(self.conns):
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            waiting = [c for c, r in by_conn.items() if r not in replies]
            ready = wait([*waiting, *by_sentinel], timeout)
            if not ready:
                self._broken = f"the workers did not answer within {timeout_s}s"
                raise WorkerDeadError(self._broken)
            for obj in ready:
                if obj in by_conn:
                    rank = by_conn[obj]
                    replies[rank] = reply = self._receive(rank)
                    if fail_fast and isinstance(reply, Failed):
                        self._fail(rank, reply)
            # Checked after reading, so a rank's last words (its error) win.
            for obj in ready:
                if isinstance(obj, int) and obj in by_sentinel:
                    rank = by_sentinel[obj]
                    self._broken = _death(rank, self.procs[rank])
                    raise WorkerDeadError(self._broken)
        for rank, reply in sorted(replies.items()):
            if isinstance(reply, Failed):
                raise _error(rank, reply)
        return [replies[r] for r in range(len(self.conns))]

    def _fail(self, rank: int, failed: Failed) -> NoReturn:
        """Raise a rank's failure, or the death of a peer that caused it.

        When a rank is killed, its peers' collectives fail ("connection reset")
        at about the moment its sentinel fires; the death is the real cause.
        A rank that exits cleanly after reporting its own error is no death.
        """
        peers = {p.sentinel: r for r, p in enumerate(self.procs) if r != rank}
        for sentinel in wait(list(peers), _PEER_DEATH_WAIT_S):
            peer = peers[sentinel]  # type: ignore[index]
            death = _death(peer, self.procs[peer])
            if self.procs[peer].exitcode != 0:
                self._broken = f"{death}; then rank {rank} failed: {failed.error}"
                raise WorkerDeadError(self._broken)
        self._broken = f"worker rank {rank} failed: {failed.error}"
        raise _error(rank, failed)

    def _receive(self, rank: int) -> WorkerReply:
        try:
            return self._decoder.decode(self.conns[rank].recv_bytes())
        except (EOFError, OSError) as e:
            self._broken = _death(rank, self.procs[rank])
            raise WorkerDeadError(self._broken) from e


def _error(rank: int, failed: Failed) -> Exception:
    """A user's mistake (bad weights, bad path) stays a short ValueError; a bug keeps its trace."""
    if failed.user_error:
        return ValueError(f"worker rank {rank}: {failed.error}")
    return WorkerError(f"worker rank {rank} failed: {failed.error}\n{failed.traceback}")


def _death(rank: int, proc: BaseProcess) -> str:
    # Its pipes close a moment before it can be reaped: let the exit code settle.
    proc.join(0.5)
    code = proc.exitcode
    how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
    return f"worker rank {rank} (pid {proc.pid}) died: {how}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_workers(
    procs: list[BaseProcess], conns: list[Connection], grace_s: float = _SHUTDOWN_GRACE_S
) -> None:
    """Ordered stop: ask, join for ``grace_s``, then SIGKILL (ranks ignore SIGTERM: a group
    signal is their executor's to act on)."""
    shutdown = msgspec.msgpack.encode(Shutdown())
    for conn in conns:
        with contextlib.suppress(OSError):  # a dead rank's pipe is broken
            conn.send_bytes(shutdown)
    deadline = time.monotonic() + grace_s
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    if alive:
        logger.warning("kill on workers %s", [p.pid for p in alive])
    for proc in alive:
        proc.kill()
    for proc in alive:
        proc.join(1.0)
    for conn in conns:
        conn.close()


def _run_worker(args: WorkerArgs, conn: Any) -> None:
    """The spawned rank's entry point: only the rank loads the worker's process module."""
    from engine.background import name_process
    from engine.worker.worker import run_worker

    name_process(f"lumen::Worker_TP{args.rank}")
    run_worker(args, conn)
