"""The generated scenarios' client: each request on a raw HTTP/1.1 socket of its own, in a thread
of its own, timed as the client sees it (its first content chunk, the gaps between chunks, its
end), reading as told: straight through, pausing after some chunks, or hanging up.

A raw socket, not an HTTP library: a reader that pauses must hold the server back exactly as a
slow client would (a small receive buffer, nothing read meanwhile), and the client counts the
bytes it had read when it paused and the bytes its buffers held when it resumed, so the time
the server's writes waited is its own measurement (bench.diagnose.score.reader_effect).
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

_CONTENT = re.compile(rb'"(?:content|text)":"(?:[^"\\]|\\.)')  # a chunk that carries text
RECV_BUFFER = 4096  # a pausing reader's receive buffer (the kernel doubles it)


@dataclass
class Ask:
    """One request of a scenario: what to send, when, and how to read the answer."""

    index: int  # its place in the scenario (the same request in the control has the same)
    body: dict[str, Any]
    at_s: float  # sent this long after the run's start
    path: str = "/v1/completions"
    pause_after: int | None = None  # chunks read before the reader pauses
    pause_s: float = 0.0
    cancel_after: int | None = None  # chunks read before the client hangs up
    extra: bool = False  # the primitive's own request (no counterpart in the control)


@dataclass
class Seen:
    """What the client saw of one request (instants in seconds after the run's start)."""

    index: int
    request_id: str = ""
    status: str = "ok"  # ok | failed | cancelled
    code: str | None = None  # the error code, where it failed
    sent_s: float = 0.0
    first_s: float | None = None  # the first chunk with text
    end_s: float = 0.0
    chunks: list[float] = field(default_factory=list)  # each chunk with text
    num_tokens: int = 0
    paused_at_s: float | None = None
    bytes_before_pause: int = 0
    # What the buffers between the server and it held when it resumed (None: it never paused):
    # the kernel's, read at once, and the server's transport's; and whether the rest of the
    # response fit in them (the server never waited).
    buffered_bytes: int | None = None
    ended_in_buffers: bool = False
    num_bytes: int = 0  # the response's, as read
    extra: bool = False

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_s is None else self.first_s - self.sent_s

    @property
    def e2e_s(self) -> float:
        return self.end_s - self.sent_s

    def gaps(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]

    def scaled(self, factor: float) -> Seen:
        """Its times (from the run's start) times ``factor``: as on a machine that much slower."""
        return replace(
            self, sent_s=self.sent_s * factor, end_s=self.end_s * factor,
            first_s=None if self.first_s is None else self.first_s * factor,
            chunks=[t * factor for t in self.chunks],
            paused_at_s=None if self.paused_at_s is None else self.paused_at_s * factor,
        )  # fmt: skip

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index, "request_id": self.request_id, "status": self.status,
            "code": self.code, "ttft_s": self.ttft_s, "e2e_s": self.e2e_s,
            "num_chunks": len(self.chunks), "max_gap_s": max(self.gaps(), default=None),
            "extra": self.extra, "num_bytes": self.num_bytes,
            **({"bytes_before_pause": self.bytes_before_pause,
                "buffered_bytes": self.buffered_bytes, "ended_in_buffers": self.ended_in_buffers}
               if self.buffered_bytes is not None else {}),
        }  # fmt: skip


def encode_all(asks: list[Ask]) -> list[bytes]:
    """Each ask's body, encoded before the run starts: a large body's encoding is the client's
    CPU, which would count in its TTFT and, holding the GIL, in the other streams' gaps."""
    return [json.dumps(a.body).encode() for a in asks]


def send_all(port: int, asks: list[Ask], payloads: list[bytes], t0: float) -> list[Seen]:
    """Every ask in a thread of its own, each sent at its offset from ``t0`` (monotonic)."""
    seen = [Seen(a.index, extra=a.extra) for a in asks]
    threads = [
        threading.Thread(target=_one, args=(port, a, p, s, t0), daemon=True)
        for a, p, s in zip(asks, payloads, seen)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    return seen


# The speed probe: one greedy stream alone, before a run's load (score.at_one_speed).
PROBE_TOKENS = 32
PROBE = {"prompt": "The machine's speed, as a client sees it:", "max_tokens": PROBE_TOKENS,
         "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip


def probe(port: int) -> float | None:
    """The median gap between the probe's chunks (seconds), or None where it failed: how fast
    this server process serves one stream, as the client sees it."""
    ask = Ask(-1, PROBE, 0.0)
    seen = Seen(-1)
    _one(port, ask, json.dumps(PROBE).encode(), seen, time.monotonic())
    gaps = sorted(seen.gaps())
    return gaps[len(gaps) // 2] if seen.status == "ok" and gaps else None


def _one(port: int, ask: Ask, payload: bytes, seen: Seen, t0: float) -> None:
    delay = t0 + ask.at_s - time.monotonic()
    if delay > 0:
        time.sleep(delay)
    seen.sent_s = time.monotonic() - t0
    try:
        _exchange(port, ask, payload, seen, t0)
    except OSError as e:
        seen.status, seen.code = "failed", f"{type(e).__name__}: {e}"
    seen.end_s = seen.end_s or time.monotonic() - t0


def _exchange(port: int, ask: Ask, payload: bytes, seen: Seen, t0: float) -> None:
    stream = bool(ask.body.get("stream"))
    with socket.socket() as sock:
        if ask.pause_after is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        sock.connect(("127.0.0.1", port))
        head = (
            f"POST {ask.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        sock.sendall(head.encode() + payload)
        reader = _Reader(sock)
        status, headers = reader.head()
        seen.request_id = headers.get("x-request-id", "")
        if status != 200 or not stream:
            body = reader.body(headers)
            seen.end_s = time.monotonic() - t0
            if status != 200:
                seen.status, seen.code = "failed", _error_code(body) or f"HTTP {status}"
            else:
                seen.num_tokens = json.loads(body).get("usage", {}).get("completion_tokens", 0)
                seen.first_s = seen.end_s
            return
        _read_stream(reader, ask, seen, t0)


# What the server's transport holds above the kernel's buffers before its writes wait
# (service/http_timing.py's TRANSPORT_BUFFER_BYTES, which bench may not import); a resumed
# reader reads the kernel's at once, and the transport's only once the server's event loop
# has written it, with the tokens made meanwhile.
SERVER_TRANSPORT_BYTES = 16 * 1024


def _read_stream(reader: _Reader, ask: Ask, seen: Seen, t0: float) -> None:
    merged, drained = False, 0
    for event in reader.events():
        now = time.monotonic() - t0
        if event.startswith(b"data: [DONE]"):
            break
        if b'"error"' in event[:20]:
            seen.status, seen.code = "failed", _error_code(event[6:]) or "error"
            break
        if not _CONTENT.search(event):
            continue
        seen.chunks.append(now)
        seen.num_tokens += 1
        if seen.first_s is None:
            seen.first_s = now
        n = len(seen.chunks)
        if ask.cancel_after is not None and n >= ask.cancel_after:
            seen.status = "cancelled"
            break
        if ask.pause_after is not None and n == ask.pause_after:
            seen.paused_at_s, seen.bytes_before_pause = now, reader.num_bytes
            time.sleep(ask.pause_s)
            drained = reader.drain()
            seen.buffered_bytes = drained + SERVER_TRANSPORT_BYTES
            merged = _merged(reader.buf[len(reader.buf) - drained :])
    seen.end_s = time.monotonic() - t0
    seen.num_bytes = reader.num_bytes
    if seen.buffered_bytes is not None:
        # The rest came at once, none of it merged: the server never waited. (Where the rest
        # was a few hundred bytes more than the kernel's buffers held, it waited the pause
        # out: the transport's buffer is no room to finish in.)
        rest = seen.num_bytes - seen.bytes_before_pause
        seen.ended_in_buffers = rest <= drained and not merged


# A token's text is a few bytes; an event with more carries tokens merged while the server
# could not write (it fell behind its reader): read at once with the rest of the response, it
# says the server waited, though its event loop wrote the rest too quickly for the reader to
# tell it from what the buffers held.
MERGED_TEXT = 32
_TEXT = re.compile(rb'"(?:content|text)":"((?:[^"\\]|\\.)*)"')


def _merged(data: bytes) -> bool:
    return any(len(m.group(1)) > MERGED_TEXT for m in _TEXT.finditer(data))


def _error_code(body: bytes) -> str | None:
    try:
        error = json.loads(body).get("error", {})
    except (ValueError, AttributeError):
        return None
    return str(error.get("code") or error.get("type") or "error")


class _Reader:
    """HTTP/1.1 response reading on a blocking socket: the head, a whole body, or a chunked
    body's SSE events as they come."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""
        self.num_bytes = 0  # read so far

    def _fill(self) -> bool:
        data = self.sock.recv(65536)
        self.num_bytes += len(data)
        self.buf += data
        return bool(data)

    def drain(self) -> int:
        """Read what is waiting now into the buffer, without waiting: the bytes read."""
        before = self.num_bytes
        self.sock.setblocking(False)
        try:
            while self._fill():
                pass
        except BlockingIOError:
            pass
        finally:
            self.sock.setblocking(True)
        return self.num_bytes - before

    def head(self) -> tuple[int, dict[str, str]]:
        while b"\r\n\r\n" not in self.buf:
            if not self._fill():
                raise ConnectionError("closed before the response head")
        head, self.buf = self.buf.split(b"\r\n\r\n", 1)
        lines = head.decode("latin-1").split("\r\n")
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        return int(lines[0].split()[1]), headers

    def body(self, headers: dict[str, str]) -> bytes:
        if "content-length" in headers:
            n = int(headers["content-length"])
            while len(self.buf) < n and self._fill():
                pass
            return self.buf[:n]
        return b"".join(self._chunks())

    def _chunks(self):
        while True:
            while b"\r\n" not in self.buf:
                if not self._fill():
                    return
            size_line, rest = self.buf.split(b"\r\n", 1)
            size = int(size_line.split(b";")[0] or b"0", 16)
            if size == 0:
                return
            while len(rest) < size + 2:
                self.buf = rest
                if not self._fill():
                    return
                rest = self.buf
            self.buf = rest[size + 2 :]  # before the yield: a paused reader reads on meanwhile
            yield rest[:size]

    def events(self):
        pending = b""
        for chunk in self._chunks():
            pending += chunk
            while b"\n\n" in pending:
                event, pending = pending.split(b"\n\n", 1)
                yield event
