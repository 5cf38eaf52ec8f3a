"""Load and fault helpers for server tests: timed streams, a client that never reads, polling."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import httpx
import openai

from tests.helpers.server import LumenServer

T = TypeVar("T")


@dataclass
class StreamResult:
    num_chunks: int  # content chunks (about one per token)
    first_s: float  # monotonic instant of the first content chunk
    last_s: float
    events: list[str]

    @property
    def rate(self) -> float:
        """Chunks per second between the first and the last."""
        return (self.num_chunks - 1) / max(self.last_s - self.first_s, 1e-9)


def stream_chat(
    server: LumenServer,
    body: dict,
    *,
    stop_after: int | None = None,
    until: Callable[[], bool] | None = None,
    timeout: float = 120,
) -> StreamResult:
    """Stream a chat completion; hang up after ``stop_after`` chunks, or at the first
    chunk once ``until()`` holds."""
    body = {**body, "stream": True}
    first = last = 0.0
    count = 0
    events: list[str] = []
    with httpx.stream(
        "POST",
        server.url("/v1/chat/completions"),
        json=body,
        headers=server.headers(),
        timeout=timeout,
    ) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[6:])
            if line[6:] == "[DONE]" or '"content"' not in line:
                continue
            last = time.monotonic()
            first = first or last
            count += 1
            if (stop_after is not None and count >= stop_after) or (until is not None and until()):
                break  # leaving the block closes the connection
    return StreamResult(count, first, last, events)


class StalledClient:
    """Sends a streaming request over a raw socket and then never reads a byte.

    Its receive buffer is made tiny, so the server's writes back up quickly.
    """

    def __init__(self, server: LumenServer, body: dict) -> None:
        payload = json.dumps({**body, "stream": True}).encode()
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
        self.sock.connect(("127.0.0.1", server.port))
        auth = "".join(f"{k}: {v}\r\n" for k, v in server.headers().items())
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(payload)}\r\n{auth}\r\n"
        )
        self.sock.sendall(head.encode() + payload)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> StalledClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class SlowReader:
    """Streams a completion over a raw socket with a tiny receive buffer, and reads slowly:
    after the first bytes it stops reading until ``until()`` holds (if given), then for
    ``stall_s`` more, then drains the rest.

    The server's writes back up meanwhile (its per-connection send buffer is bounded), as
    they would for a client on a slow link.
    """

    def __init__(
        self,
        server: LumenServer,
        body: dict,
        *,
        stall_s: float,
        until: Callable[[], bool] | None = None,
    ) -> None:
        self.server, self.body, self.stall_s = server, {**body, "stream": True}, stall_s
        self.until = until
        self.request_id = ""
        self.num_bytes = 0
        self.received = bytearray()  # the whole response, as read

    def texts(self) -> list[str]:
        """The completion's text of each SSE event of the chunked body it read."""
        _, _, body = bytes(self.received).partition(b"\r\n\r\n")
        events = bytearray()
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            if n == 0:
                break
            events += rest[:n]
            body = rest[n + 2 :]
        return [
            json.loads(e[6:])["choices"][0]["text"]
            for e in bytes(events).split(b"\n\n")
            if e.startswith(b"data: {")
        ]

    def run(self) -> SlowReader:
        payload = json.dumps(self.body).encode()
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(("127.0.0.1", self.server.port))
            auth = "".join(f"{k}: {v}\r\n" for k, v in self.server.headers().items())
            head = (
                "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                f"application/json\r\nContent-Length: {len(payload)}\r\n{auth}\r\n"
            )
            sock.sendall(head.encode() + payload)
            data = sock.recv(4096)
            for line in data.split(b"\r\n"):
                if line.lower().startswith(b"x-request-id:"):
                    self.request_id = line.split(b":", 1)[1].strip().decode()
            if self.until is not None:
                wait_until(self.until, 120, interval=0.1)
            time.sleep(self.stall_s)
            sock.settimeout(60)
            tail = b""
            while data:
                self.num_bytes += len(data)
                self.received += data
                tail = (tail + data)[-256:]
                if b"data: [DONE]" in tail and tail.endswith(b"0\r\n\r\n"):
                    break
                data = sock.recv(65536)
        return self


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.05) -> float:
    """Seconds until ``predicate()`` held; raises AssertionError after ``timeout``."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)
    return time.monotonic() - start


def server_idle(server: LumenServer) -> bool:
    """Nothing running, no KV block in use, no admission slot held."""
    from bench.server import metric

    m = server.metrics()
    return (
        metric(m, "lumen:num_requests_running") == 0
        and metric(m, "lumen:kv_cache_usage_perc") == 0
        and metric(m, "lumen:num_requests_admitted") == 0
    )


def at_once(calls: list[Callable[[], T]], timeout: float = 60) -> list[T]:
    """Each call in a thread of its own, all started together; their results in order."""
    with ThreadPoolExecutor(max(len(calls), 1)) as pool:
        futures = [pool.submit(call) for call in calls]
        return [f.result(timeout) for f in futures]


class WholeResponses:
    """``n`` whole (non-streamed) completions of ``body`` in flight, each in its own thread:
    ``responses`` once ``join`` returns."""

    def __init__(self, server: LumenServer, n: int, body: dict[str, object]) -> None:
        self.responses: list[httpx.Response] = []
        self._threads = [
            threading.Thread(target=lambda: self.responses.append(server.http.post(
                server.url("/v1/completions"), headers=server.headers(), json=body, timeout=60,
            )), daemon=True)
            for _ in range(n)
        ]  # fmt: skip
        for t in self._threads:
            t.start()

    def join(self, timeout: float = 60) -> list[httpx.Response]:
        for t in self._threads:
            t.join(timeout)
        return self.responses


class Streams:
    """Chat streams of fixed lengths (``max_tokens`` with ``ignore_eos``), each in its own
    thread, through the official ``openai`` client: what each one got, and how it ended."""

    def __init__(self, server: LumenServer, lengths: list[int], timeout: float = 60) -> None:
        self.lengths = lengths
        self.tokens = [0] * len(lengths)  # content chunks seen
        self.usage = [0] * len(lengths)  # completion tokens, as the final usage chunk counts
        self.finish: list[str | None] = [None] * len(lengths)
        self.error: list[str | None] = [None] * len(lengths)  # the code of a raised APIError
        self.ended = [0.0] * len(lengths)
        self.ended_ns = [0] * len(lengths)  # wall clock, to compare with the trace store's
        client = server.client(timeout=timeout)
        self._threads = [
            threading.Thread(target=self._run, args=(client, i), daemon=True)
            for i in range(len(lengths))
        ]
        for t in self._threads:
            t.start()

    def _run(self, client: openai.OpenAI, i: int) -> None:
        try:
            stream = client.chat.completions.create(
                model=client.models.list().data[0].id,
                messages=[{"role": "user", "content": f"Stream {i}: go on."}],
                max_tokens=self.lengths[i], temperature=0, stream=True,
                extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
            )  # fmt: skip
            for chunk in stream:
                if chunk.usage is not None:
                    self.usage[i] = chunk.usage.completion_tokens
                for choice in chunk.choices:
                    self.tokens[i] += bool(choice.delta.content)
                    self.finish[i] = choice.finish_reason or self.finish[i]
        except openai.APIError as e:
            body = e.body if isinstance(e.body, dict) else {}
            self.error[i] = str(body.get("code") or body.get("error", {}).get("code") or e)
        except Exception as e:  # a cut connection: what a drain must never give
            self.error[i] = f"{type(e).__name__}: {e}"
        self.ended[i] = time.monotonic()
        self.ended_ns[i] = time.time_ns()

    def started(self, indices: range | list[int] | None = None) -> bool:
        """Every stream (of ``indices``) has had its first token."""
        return all(self.tokens[i] for i in indices or range(len(self.lengths)))

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(deadline - time.monotonic(), 0))
        assert not any(t.is_alive() for t in self._threads), f"streams hang: {self.summary()}"

    def whole(self, i: int) -> bool:
        """Stream ``i`` ended normally with every token it asked for."""
        return self.finish[i] == "length" and self.usage[i] == self.lengths[i]

    def summary(self) -> list[tuple[int, int, str | None, str | None]]:
        """(max_tokens, completion tokens, finish_reason, error code) per stream."""
        return list(zip(self.lengths, self.usage, self.finish, self.error, strict=True))
