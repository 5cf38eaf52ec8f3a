"""A tensor-parallel worker process: one rank's ModelRunner, driven by messages from the executor.

The executor <-> worker link is one duplex pipe per rank carrying msgpack
messages (never pickle). Every request gets exactly one reply, in order::

    executor                         worker rank r
       | spawn(WorkerArgs)   ---->   init torch.distributed, load its shard
       |                     <----   Ready(block_bytes) | Failed(error)
       | ExecuteModel(sched) ---->   forward (rank 0 also samples)
       |                     <----   Done(output on rank 0, None elsewhere) | Failed
       | Shutdown            ---->   stop profiler, leave the process group, exit

A worker exits by itself when the executor's process dies (its parent pid
changes, or the pipe reaches EOF), so no rank outlives the engine.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from multiprocessing.connection import Connection
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from engine.cpu_share import allowed_cpus
from engine.gc_pauses import settle_heap
from engine.worker.layers import Shard
from engine.worker.messages import (
    Done,
    ExecuteModel,
    Failed,
    InitKVCache,
    ModelRunnerOutput,
    Ready,
    ReleaseKVCache,
    Shutdown,
    StartProfile,
    StopProfile,
    WorkerArgs,
    WorkerReply,
    WorkerRequest,
)
from engine.worker.model_runner import ModelRunner
from engine.worker.profiler import Profiler

logger = logging.getLogger(__name__)

_PARENT_POLL_S = 0.2


def rank_path(path: str, rank: int) -> str:
    """trace.json -> trace.rank1.json: each rank profiles into its own file."""
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def run_worker(args: WorkerArgs, conn: Connection) -> None:
    """Process entry point: start up, report Ready or Failed, then serve until told to stop."""
    # Ctrl-C, systemd and `kill -TERM -PGID` signal the whole process group: the executor
    # decides when ranks stop (it asks; kill -9 past its grace), and a rank whose executor
    # died exits with it (_exit_with_parent).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _exit_with_parent(args.parent_pid)
    encoder = msgspec.msgpack.Encoder()
    try:
        worker = Worker(args)
        settle_heap()  # torch and the model's shard are loaded: what lives now lives for good
    except BaseException as e:
        conn.send_bytes(encoder.encode(_failed(e)))
        return
    conn.send_bytes(encoder.encode(Ready(worker.runner.block_bytes(), str(worker.device))))
    try:
        worker.serve(conn, encoder)
    finally:
        worker.close()


class Worker:
    def __init__(self, args: WorkerArgs) -> None:
        self.rank = args.rank
        if args.device_type == "cuda":
            self.device = torch.device("cuda", args.rank)
            torch.cuda.set_device(self.device)
            backend = "nccl"
        else:
            self.device = torch.device("cpu")
            # The ranks share the machine's cores; oversubscribing them slows every rank.
            torch.set_num_threads(max(1, len(allowed_cpus()) // args.world_size))
            backend = "gloo"
        dist.init_process_group(
            backend,
            init_method=args.init_method,
            world_size=args.world_size,
            rank=args.rank,
        )
        self.runner = ModelRunner(
            args.model_config,
            self.device,
            args.dtype,
            args.max_model_len,
            args.block_size,
            args.seed,
            Shard(args.rank, args.world_size),
            kv_dtype=args.kv_dtype,
            quantization=args.quantization,
            kv_layout=args.kv_layout,
            speculative=args.speculative,
            lora=args.lora,
        )
        self.runner.owns_process = True  # a worker process of the engine's own
        self.runner.load_model()
        self.profiler = Profiler()

    def serve(self, conn: Connection, encoder: msgspec.msgpack.Encoder) -> None:
        decoder = msgspec.msgpack.Decoder(WorkerRequest)
        while True:
            try:
                data = conn.recv_bytes()
            except (EOFError, OSError):
                return  # the executor is gone
            try:
                msg = decoder.decode(data)
                if isinstance(msg, Shutdown):
                    return
                reply: WorkerReply = Done(self.handle(msg))
            except Exception as e:
                reply = _failed(e)
            conn.send_bytes(encoder.encode(reply))

    def handle(self, msg: WorkerRequest) -> ModelRunnerOutput | None:
        if isinstance(msg, ExecuteModel):
            out = self.runner.execute_model(msg.sched)
            return out if self.runner.is_driver else None
        if isinstance(msg, InitKVCache):
            self.runner.init_kv_cache(msg.num_blocks)
        elif isinstance(msg, ReleaseKVCache):
            self.runner.release_kv_cache()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        elif isinstance(msg, StartProfile):
            self.profiler.start(rank_path(msg.path, self.rank))
        elif isinstance(msg, StopProfile):
            self.profiler.stop()
        return None

    def close(self) -> None:
        try:
            self.profiler.stop()
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _failed(e: BaseException) -> Failed:
    error = f"{type(e).__name__}: {e}"
    return Failed(error, traceback.format_exc(), user_error=isinstance(e, ValueError))


def _exit_with_parent(parent_pid: int) -> None:
    """Exit at once when the executor's process dies, even mid-collective (no EOF seen there)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="lumen-parent-watch", daemon=True).start()
