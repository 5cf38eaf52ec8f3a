"""KV cache events for routers (``--kv-events-config``): vLLM's flag, JSON fields and wire format,
so llm-d's KV-cache indexer and the Gateway API Inference Extension's prefix-aware scorers
can follow which blocks each engine holds.

The wire format is vLLM's, as vLLM 0.32 publishes it (checked against its own msgspec
classes: the bytes are equal) and llm-d's KV-cache indexer reads it: each ZMQ message is three
frames, the topic, an 8-byte big-endian sequence number and a msgpack ``EventBatch``, an array
``[ts, events, data_parallel_rank]`` whose events are maps tagged by ``type``, their fields in
vLLM's order, the defaulted ones left out as vLLM leaves them::

    {"type": "BlockStored", "block_hashes": [...], "parent_block_hash": int | None,
     "token_ids": [...], "block_size": 16, "lora_id": None, "medium": "GPU", "lora_name": None}
    {"type": "BlockRemoved", "block_hashes": [...], "medium": "GPU"}
    {"type": "AllBlocksCleared"}

(vLLM 0.10 and 0.11 encoded the events as arrays too; a subscriber written for those reads
this layout only where it decodes maps, as llm-d's current one does.)
Hashes are the low 64 bits of vLLM's sha256_cbor block hashes (engine/core/block_hashes.py).
A subscriber that missed batches asks the replay endpoint (a ROUTER socket) with the first
sequence number it wants, 8 bytes big-endian; it gets every batch still buffered from there,
(sequence, payload) each, then (-1, b"").

The core's loop only hands each step's events to a queue; a thread of this module encodes and
sends them, so a slow or absent subscriber costs the loop nothing (a full queue drops the
batch and logs it once).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from engine.kv_events_config import KVEventsConfig, offset_endpoint

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class ZmqEventPublisher:
    """A PUB socket for the batches and a ROUTER socket for replays, served by one thread."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq

        self.rank = data_parallel_rank
        self.endpoint = offset_endpoint(config.endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint(config.replay_endpoint, data_parallel_rank)
        self._topic = config.topic.encode()
        self._queue: queue.Queue[tuple[float, list[Any]] | None] = queue.Queue(
            config.max_queue_size
        )
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._dropped = 0
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._replay = ctx.socket(zmq.ROUTER) if self.replay_endpoint else None
        try:
            assert self.endpoint is not None
            # As vLLM: bind a wildcard or local address, connect to a named host.
            if (
                "*" in self.endpoint
                or "::" in self.endpoint
                or not self.endpoint.startswith("tcp://")
            ):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self._replay is not None and self.replay_endpoint is not None:
                self._replay.bind(self.replay_endpoint)
        except zmq.ZMQError as e:
            self._close()
            raise ValueError(f"--kv-events-config: cannot open {self.endpoint} or "
                             f"{self.replay_endpoint}: {e}") from None  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="lumen-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s (topic %r, data-parallel rank %d)",
                    self.endpoint, f", replay on {self.replay_endpoint}" if self._replay else "",
                    config.topic, data_parallel_rank)  # fmt: skip

    def publish(self, events: list[Any]) -> None:
        """Hand one step's events to the thread (never blocks the core's loop)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            if not self._dropped:
                logger.warning("KV events: the queue is full, batches are dropped (a subscriber "
                               "that misses one asks the replay endpoint)")  # fmt: skip
            self._dropped += 1

    def shutdown(self, timeout: float = 1.0) -> None:
        """Send what is queued (for up to ``timeout`` s), then close."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import msgspec

        encode = msgspec.msgpack.Encoder().encode
        seq = 0
        while True:
            if self._replay is not None and self._replay.poll(0):
                self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            ts, events = item
            payload = encode([ts, events, self.rank])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))
            seq += 1

    def _serve_replay(self) -> None:
        replay = self._replay
        assert replay is not None  # polled only where there is one
        frames = replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", END_SEQ, b""))
