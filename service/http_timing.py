"""When the server read each request's first byte: the start of a request's recorded life.

Hypercorn parses a request before it calls the app, so the app's first
instant misses the read, the parsing, and any time the event loop was busy
elsewhere meanwhile. Hypercorn has no hook for it, so ``install`` wraps the
reader of each connection it accepts (its asyncio TCPServer) and stamps the
first read of each request: the first read after the previous response on
that connection ended. ``FrontDoor`` takes the stamp by the connection's peer
address (``scope["client"]``). Bytes can sit in the kernel a long while before
a busy event loop reads them, so on Linux the stamp goes back to the last time
the kernel received data on the socket before that read (``tcpi_last_data_recv``
of TCP_INFO, counted in kernel ticks and less one tick, so the stamp never
precedes the bytes themselves): the request was there at least that early. Event-loop lag
(service/monitor.py) shows why it waited.
Pipelined requests (a second one read while the first is answered) fall back
to the app's own instant.

The wrapper reads Hypercorn internals (``TCPServer``'s constructor, its
``reader`` and ``writer``), so it is installed only on the Hypercorn release it
was written for (``HOOKED_HYPERCORN_VERSION``). On any other, ``install`` logs
one warning and requests start at the app's own arrival instant.

It also gives a streamed HTTP/1.1 response a direct write of each chunk
(``chunk_writer``), past Hypercorn's and h11's per-message layers.

It bounds each connection's send buffers too (``SEND_BUFFER_BYTES``):
a client that reads slowly then holds little memory, and its slowness shows
as writes that wait (delivery lag) instead of vanishing into megabytes of
autotuned buffer, where the server could never see it.
"""

from __future__ import annotations

import importlib.metadata
import logging
import math
import socket
import struct
import time
from typing import Any

logger = logging.getLogger(__name__)

# The Hypercorn whose asyncio TCPServer the wrapper was written and checked against. Another
# release may move what it reads: check StampingTCPServer against it before changing this.
HOOKED_HYPERCORN_VERSION = "0.18.0"

# Per connection: the kernel's send buffer (Linux doubles it for its bookkeeping) and the
# transport's own buffer above it. SSE chunks are ~200 bytes, so neither limits a reader that
# keeps up; together they hold about 80 KiB for one that does not.
SEND_BUFFER_BYTES = 32 * 1024
TRANSPORT_BUFFER_BYTES = 16 * 1024

# Peer address -> [first byte of the request in progress (0: none), busy answering, the
# connection's TCPServer].
_connections: dict[tuple[str, int], list[Any]] = {}
_installed: bool | None = None  # None: install not called yet


def install() -> bool:
    """Wrap Hypercorn's asyncio connection class (once per process). False, with one warning,
    where the installed Hypercorn is not the one the wrapper was written for."""
    global _installed
    if _installed is not None:
        return _installed
    version = importlib.metadata.version("hypercorn")
    if version != HOOKED_HYPERCORN_VERSION:
        logger.warning(
            "Hypercorn %s is installed, not %s: requests start when the app first sees them "
            "(not when their first byte is read) and send buffers keep the system's size",
            version,
            HOOKED_HYPERCORN_VERSION,
        )
        _installed = False
        return False
    import hypercorn.asyncio.run as hc_run
    from hypercorn.asyncio.tcp_server import TCPServer
    from hypercorn.events import Closed, RawData

    class StampingTCPServer(TCPServer):
        def __init__(self, *args: Any) -> None:
            super().__init__(*args)
            # Bytes that go out with the connection's next write (ChunkWriter.hold), and
            # whether Hypercorn's next write is held so (a response head, ChunkWriter.hold_head).
            self.held, self.hold_next = b"", False
            sock = self.writer.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
                self.writer.transport.set_write_buffer_limits(high=TRANSPORT_BUFFER_BYTES)
            reader = self.reader
            peer = self.writer.get_extra_info("peername")
            key = (str(peer[0]), int(peer[1])) if isinstance(peer, tuple) else None
            if key is None:
                return
            state = _connections[key] = [0, False, self]
            read = reader.read

            async def stamping_read(n: int = -1) -> bytes:
                data = await read(n)
                if data and not state[0] and not state[1]:
                    now = time.time_ns()
                    state[0] = now - _waited_in_kernel_ns(sock)
                return data

            reader.read = stamping_read  # type: ignore[method-assign]

        async def protocol_send(self, event: Any) -> None:
            if isinstance(event, RawData):
                if self.hold_next:
                    self.hold_next = False
                    self.held += event.data
                    return
                if self.held:
                    event, self.held = RawData(self.held + event.data), b""
            elif isinstance(event, Closed) and self.held:
                held, self.held = self.held, b""
                if not self.writer.transport.is_closing():  # what was held, then the close
                    self.writer.write(held)
            await super().protocol_send(event)

        async def run(self) -> None:
            try:
                await super().run()
            finally:
                peer = self.writer.get_extra_info("peername")
                if isinstance(peer, tuple):
                    _connections.pop((str(peer[0]), int(peer[1])), None)

    # Replaces the class Hypercorn's serve loop builds each connection from: a patch of a
    # module's class, which mypy refuses by design.
    hc_run.TCPServer = StampingTCPServer  # type: ignore[misc, assignment]
    _installed = True
    return True


_TCP_INFO_LAST_DATA_RECV = 52  # offset of tcpi_last_data_recv (ms) in Linux's struct tcp_info
_CLOCK_MONOTONIC_COARSE = 6  # Linux's clock id; it ticks with the kernel's jiffies


def _kernel_tick_ms() -> int:
    """The kernel's tick (1000 / HZ ms), the unit tcpi_last_data_recv counts in: its reading
    is whole ticks since the last receive, so the bytes came at least one tick less ago.
    10 ms (HZ=100, the coarsest) where the tick cannot be read."""
    try:
        return max(1, math.ceil(time.clock_getres(_CLOCK_MONOTONIC_COARSE) * 1000))
    except (AttributeError, OSError):
        return 10


_TICK_MS = _kernel_tick_ms()


def _waited_in_kernel_ns(sock: socket.socket | None) -> int:
    """How long ago, at least, the kernel last received data on ``sock`` (0 where it cannot
    tell): the reading less one kernel tick, since it counts whole ticks (a read 0.2 ms after
    the bytes, across a tick, reads 4 ms at HZ=250)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return 0
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
        (ms,) = struct.unpack_from("I", info, _TCP_INFO_LAST_DATA_RECV)
    except (OSError, struct.error):
        return 0
    if ms >= 60_000:  # a minute or more: not this request's bytes
        return 0
    return max(0, ms - _TICK_MS) * 1_000_000


def request_started(client: Any) -> int:
    """The first byte of the request now handled on this connection (0: unknown); the
    connection is busy until ``request_ended``."""
    state = _connections.get((str(client[0]), int(client[1]))) if client else None
    if state is None:
        return 0
    first, state[0], state[1] = state[0], 0, True
    return first


class ChunkWriter:
    """Writes one chunk of a chunked HTTP/1.1 body straight to the connection, framed as h11
    frames it (``chunk_writer``). Each write also carries what was held for it: a stream's
    response head goes out with its first chunk, and its last chunk with the body's end, so a
    stream's first and last events each cost one send, not two."""

    __slots__ = ("lock", "server", "writer")

    def __init__(self, server: Any) -> None:
        self.server, self.writer, self.lock = server, server.writer, server.send_lock

    async def __call__(self, body: bytes) -> None:
        """Returns once the transport took the chunk: it waits as Hypercorn's own writes do
        (the connection's send lock, then the transport's buffer)."""
        writer, server = self.writer, self.server
        async with self.lock:
            if writer.transport.is_closing():
                return
            frame = b"%x\r\n%b\r\n" % (len(body), body)
            if server.held:
                frame, server.held = server.held + frame, b""
            try:
                writer.write(frame)
                await writer.drain()
            except (ConnectionError, RuntimeError):
                return

    def write_now(self, body: bytes) -> bool:
        """The chunk written now, without waiting, where nothing would make ``__call__`` wait:
        no other write in progress and nothing left in the transport's buffer. False (nothing
        written) otherwise, or where the connection is closing."""
        transport, server = self.writer.transport, self.server
        if self.lock.locked() or transport.is_closing() or transport.get_write_buffer_size():
            return False
        frame = b"%x\r\n%b\r\n" % (len(body), body)
        if server.held:
            frame, server.held = server.held + frame, b""
        transport.write(frame)
        return True

    def hold(self, body: bytes) -> None:
        """The chunk goes out with the connection's next write (the end of the body, which
        Hypercorn writes)."""
        self.server.held += b"%x\r\n%b\r\n" % (len(body), body)

    def hold_head(self) -> None:
        """Hypercorn's next write (the response head about to be sent) goes out with the
        first chunk instead: for a stream whose first event follows at once."""
        self.server.hold_next = True


def chunk_writer(client: Any) -> ChunkWriter | None:
    """A write of one chunk of a chunked HTTP/1.1 body straight to the connection, framed as
    h11 frames it; None where the hook is not installed.

    A streamed token is one small chunk, and Hypercorn's path for it (its ASGI stream, its
    h11 protocol, h11's writer) was about a quarter of the event loop's time per token at 64
    streams. This takes the connection's send lock and waits for the transport as Hypercorn
    does, so a write still returns once the transport took it. A connection that is closing
    takes nothing: Hypercorn sees the close on its read side, as ever."""
    state = _connections.get((str(client[0]), int(client[1]))) if client else None
    if state is None:
        return None
    server = state[2]
    return ChunkWriter(server)


def request_ended(client: Any) -> None:
    state = _connections.get((str(client[0]), int(client[1]))) if client else None
    if state is not None:
        state[1] = False
