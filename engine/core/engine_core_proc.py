"""EngineCoreProc: the core's busy loop in its own process, fed and drained by I/O threads.

Wire protocol (sockets in ``engine/ipc.py``): the frontend PUSHes
``[RequestType, payload]`` frames to the core's input socket; the core PUSHes
``[OutputType, payload]`` back. The first output is READY (EngineInfo, or the
startup error); then one OUTPUTS message per step, plus abort
acknowledgements and utility results. A SHUTDOWN message ends the loop.
While nothing else is sent, a heartbeat every ``HEARTBEAT_S`` says how long
the loop has been busy in its current iteration (0: idle), so the server
tells a hung core from an idle one or a long step (service/lifecycle.py).

Signals: the core never acts on SIGINT (Ctrl-C reaches the whole group; the
server conducts the stop). Under a server (``notify_pid``) a SIGTERM is passed
on to the server as SIGUSR1, "drain", whether it came to the group or to the
core alone; the server's drain then stops the core in order. Alone (the
offline LLM), a SIGTERM ends the core (exit 143).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import os
import queue
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from engine import faults
from engine.background import ENGINE_CORE_TITLE, name_os_thread, name_process
from engine.config import EngineConfig
from engine.gc_pauses import settle_heap
from engine.ipc import make_socket
from engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineStats,
    OutputType,
    ReadyMessage,
    RequestType,
    UtilityMethod,
    UtilityRequest,
)

if TYPE_CHECKING:  # the client's process imports this module for its entry point only
    from engine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

# Bounded queues between the I/O threads and the loop: a full input queue
# pushes back through ZMQ's high-water mark to the client's send.
INPUT_QUEUE_SIZE = 1024
OUTPUT_QUEUE_SIZE = 64
_PARENT_POLL_S = 0.2
HEARTBEAT_S = 0.5
# A restarted core numbers its steps from epoch << 40, and data-parallel engine r from r << 56:
# never another core's ids in a trace db (a step's engine is step_id >> 56).
STEP_EPOCH_BITS = 40
STEP_RANK_BITS = 56
_WORKER_DIED = object()


class EngineCoreProc:
    def __init__(
        self, core: EngineCore, input_addr: str, out_sock: zmq.Socket[bytes], epoch: int = 0
    ) -> None:
        self.core = core
        self.epoch = epoch
        # When the loop's current iteration began (monotonic ns; 0: idle, waiting for input).
        self.busy_since_ns = 0
        self.input_addr = input_addr
        self.out_sock = out_sock
        self.inputs: queue.Queue[Any] = queue.Queue(INPUT_QUEUE_SIZE)
        self.outputs: queue.Queue[EngineCoreOutputs | None] = queue.Queue(OUTPUT_QUEUE_SIZE)
        self.num_output_backpressure = 0
        self.running = True
        self.out_thread = threading.Thread(
            target=self._output_thread, name="core-output", daemon=True
        )
        self._pending: list[EngineCoreOutput] = []  # abort acks and refusals for the next send
        self._decode_add = msgspec.msgpack.Decoder(EngineCoreRequest)
        self._decode_abort = msgspec.msgpack.Decoder(list[str])
        self._decode_utility = msgspec.msgpack.Decoder(UtilityRequest)

    def run(self) -> bool:
        """Serve until SHUTDOWN; False if the loop failed (the frontend has been told why).

        The output thread alone touches the output socket until it has
        drained; it stops after the final message.
        """
        threading.Thread(target=self._input_thread, name="core-input", daemon=True).start()
        self.out_thread.start()
        if self.core.executor.sentinels:
            threading.Thread(target=self._watch_workers, name="core-workers", daemon=True).start()
        ok = True
        try:
            self._busy_loop()
        except Exception as e:
            logger.exception("engine core failed")
            ok = False
            self._put_final(EngineCoreOutputs(engine_error=f"{type(e).__name__}: {e}"))
        self._put_final(None)
        self.out_thread.join(timeout=5)
        return ok

    def _put_final(self, item: EngineCoreOutputs | None) -> None:
        try:
            self.outputs.put(item, timeout=2)
        except queue.Full:
            logger.warning("output queue full at exit: the frontend stopped reading")

    def _busy_loop(self) -> None:
        core = self.core
        while self.running:
            if not core.has_work() and not self._pending:
                self.busy_since_ns = 0
                self._handle(self.inputs.get())
            self.busy_since_ns = time.monotonic_ns()
            while not self.inputs.empty():
                self._handle(self.inputs.get_nowait())
            if not self.running:
                break
            outs = core.step() if core.has_work() else EngineCoreOutputs()
            if self._pending:
                outs.outputs = self._pending + outs.outputs
                self._pending = []
            if outs.outputs or outs.step is not None:
                self._send(outs)

    def _handle(self, item: Any) -> None:
        if item is _WORKER_DIED:
            raise RuntimeError("a worker process died")
        try:
            self._dispatch(*item)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            # A malformed message (a buggy or hostile local process): refuse it, keep serving.
            logger.warning("rejected a malformed %s message: %s", item[0].name, e)

    def _dispatch(self, kind: RequestType, payload: memoryview) -> None:
        if kind == RequestType.ADD:
            refused = self.core.add_request(self._decode_add.decode(payload))
            if refused is not None:
                self._pending.append(refused)
        elif kind == RequestType.ABORT:
            self._pending.extend(self.core.abort_requests(self._decode_abort.decode(payload)))
        elif kind == RequestType.UTILITY:
            call = self._decode_utility.decode(payload)
            result = self.core.call_utility(call)
            if call.method == UtilityMethod.GET_STATS and isinstance(result.value, EngineStats):
                result.value.num_output_backpressure = self.num_output_backpressure
            self._send(EngineCoreOutputs(outputs=self._pending, utility_result=result))
            self._pending = []
        elif kind == RequestType.SHUTDOWN:
            self.running = False

    def _send(self, outs: EngineCoreOutputs) -> None:
        try:
            self.outputs.put_nowait(outs)
        except queue.Full:
            self.num_output_backpressure += 1
            self.outputs.put(outs)

    def _input_thread(self) -> None:
        name_os_thread()
        sock = make_socket(zmq.Context.instance(), zmq.PULL, self.input_addr, bind=False)
        parent = os.getppid()
        while True:
            if not sock.poll(int(_PARENT_POLL_S * 1000)):
                if os.getppid() != parent:
                    # The frontend is gone (even kill -9): nobody will ever read us.
                    logger.error("frontend process died; engine core exiting")
                    os._exit(1)
                continue
            frames = sock.recv_multipart(copy=False)
            try:
                kind = RequestType(bytes(frames[0].buffer))
            except ValueError:
                kind = None
            if kind is None or len(frames) != 2:
                logger.warning("rejected a message with %d frames of unknown shape", len(frames))
                continue
            self.inputs.put((kind, frames[1].buffer))

    def _output_thread(self) -> None:
        name_os_thread()
        encoder = msgspec.msgpack.Encoder()
        buf = bytearray()
        epoch = self.epoch
        while True:
            try:
                outs = self.outputs.get(timeout=HEARTBEAT_S)
            except queue.Empty:
                since = self.busy_since_ns
                outs = EngineCoreOutputs(busy_ns=time.monotonic_ns() - since if since else 0)
            if outs is None:
                break
            if epoch:
                outs.epoch = epoch
            if outs.step is not None:
                outs.step.output_ns = time.time_ns()  # core.output ends as the batch leaves
            encoder.encode_into(outs, buf)
            self.out_sock.send_multipart((OutputType.OUTPUTS.value, buf), copy=False)
            buf = bytearray()

    def _watch_workers(self) -> None:
        multiprocessing.connection.wait(self.core.executor.sentinels)
        self.inputs.put(_WORKER_DIED)


def run_engine_core(
    config: EngineConfig,
    model_path: str,
    input_addr: str,
    output_addr: str,
    epoch: int = 0,
    notify_pid: int | None = None,
    dp_rank: int = 0,
    dp_size: int = 1,
) -> None:
    """Entry point of the core process (spawned by an MP client). ``epoch``: how many cores
    its engine slot started before this one; ``notify_pid``: the server that conducts the stop;
    ``dp_rank`` of ``dp_size``: its data-parallel engine (each pinned to its share of CPUs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(notify_pid))
    name_process(f"{ENGINE_CORE_TITLE}_DP{dp_rank}")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    out_sock = make_socket(zmq.Context.instance(), zmq.PUSH, output_addr, bind=False)
    encoder = msgspec.msgpack.Encoder()
    try:
        if dp_size > 1:
            _take_cpu_share(config, dp_rank, dp_size)
        from engine.core.engine_core import EngineCore

        core = EngineCore(
            config, model_path, owns_process=True, dp_rank=dp_rank,
            on_warm_up=lambda: out_sock.send_multipart((OutputType.PROGRESS.value, b"warming_up")),
        )  # fmt: skip
        core.scheduler.number_steps_from((dp_rank << STEP_RANK_BITS) | (epoch << STEP_EPOCH_BITS))
        settle_heap()  # the model is loaded and warm: what lives now lives for good
        faults.arm_gc_pause("core")
    except Exception as e:
        # Nothing started, so nothing to drain: a SIGTERM from here on (the frontend's close
        # after the error below) ends this process, not passed on as the server's SIGUSR1,
        # which the server would read as a stop signal and exit 0.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        if isinstance(e, ValueError):  # a user error: the frontend shows the one line
            logger.error("engine core failed to start: %s", e)
        else:
            logger.exception("engine core failed to start")
        ready = ReadyMessage(error=str(e), error_type=type(e).__name__)
        out_sock.send_multipart((OutputType.READY.value, encoder.encode(ready)))
        out_sock.close(linger=2000)
        zmq.Context.instance().term()  # flushes the READY error (up to the linger)
        logging.shutdown()
        # Nothing started, nothing to clean: skip interpreter teardown, which
        # can outlast the frontend's patience and end in its SIGTERM.
        os._exit(1)
    out_sock.send_multipart((OutputType.READY.value, encoder.encode(ReadyMessage(info=core.info))))
    proc = EngineCoreProc(core, input_addr, out_sock, epoch)
    ok = False
    try:
        ok = proc.run()
    finally:
        started = time.monotonic()
        core.shutdown()
        logger.info("engine core stopped (%.2fs to shut down)", time.monotonic() - started)
        if not proc.out_thread.is_alive():
            out_sock.close(linger=1000)
    sys.exit(0 if ok else 1)


def _take_cpu_share(config: EngineConfig, rank: int, size: int) -> None:
    """Pin this core (and the workers it starts) to its slice of the server's CPUs, and run
    that many threads; says so in the log."""
    from engine import cpu_share

    if config.resolve_device().type != "cpu":
        raise ValueError(
            "--data-parallel-size > 1 runs on CPU only for now (each engine on a device of its "
            "own is not built); use --device cpu, or one engine"
        )
    mine = cpu_share.share(rank, size, config.tensor_parallel_size)
    cpu_share.pin(mine.cpus)
    import torch

    torch.set_num_threads(mine.threads)
    logger.info("%s", mine.describe(rank, size))


def _on_sigterm(notify_pid: int | None) -> None:
    if notify_pid is not None and os.getppid() == notify_pid:
        os.kill(notify_pid, signal.SIGUSR1)  # the server drains, then stops us in order
    else:
        sys.exit(143)
