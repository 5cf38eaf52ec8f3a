"""Server-sent events and client-disconnect detection for the OpenAI routes.

A streamed response writes each event with a send timeout: a client that
stops reading fills the socket buffers, the write blocks, and after the stall
timeout the response ends, which closes the events generator and so aborts the
request in the engine. A disconnect cancels the writer the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from service.context import find_context

logger = logging.getLogger(__name__)
T = TypeVar("T")
DONE = b"data: [DONE]\n\n"


def sse(payload: bytes) -> bytes:
    return b"data: " + payload + b"\n\n"


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


async def wait_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Run ``work``; cancel it (aborting its requests) and raise ClientGone if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientGone()
    return task.result()


class EventStream(Response):
    """A response that writes ``events`` as an SSE body (not Starlette's StreamingResponse:
    it needs the send timeout).

    ``on_end(reason)`` is called once with "done", "disconnect" or "stalled"; ``on_stall``
    is awaited first where the stream stalled, before its events are closed (so the requests
    end as stalled, not as left by their client).
    """

    def __init__(
        self,
        events: AsyncGenerator[bytes, None],
        *,
        send_timeout: float,
        headers: dict[str, str] | None = None,
        on_end: Callable[[str], Any] | None = None,
        on_stall: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.events = events
        self.status_code = 200
        self.background = None
        self.send_timeout = send_timeout
        self.extra_headers = [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        self.on_end = on_end
        self.on_stall = on_stall

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        ctx = find_context(scope)
        deliver = ctx.deliver if ctx is not None and ctx.deliver is not None else send
        writer = asyncio.ensure_future(self._write(send, deliver))
        watcher = asyncio.ensure_future(wait_disconnect(receive))
        self._sending_since: float | None = None
        self._stalled = False
        loop = asyncio.get_running_loop()
        self._check_handle = loop.call_later(self.send_timeout / 4, self._check_stall, loop, writer)
        reason = "done"
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not writer.done():
                reason = "disconnect"
                writer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await writer
            if self._stalled:
                reason = "stalled"
                logger.warning("a stream was not read for %.0f s: closing it", self.send_timeout)
        finally:
            self._check_handle.cancel()
            watcher.cancel()
            writer.cancel()
            try:
                # The writer must be gone before the events can be closed, even when this
                # task itself is being cancelled (shutdown).
                await asyncio.gather(writer, return_exceptions=True)
                if reason == "stalled" and self.on_stall is not None:
                    await self.on_stall()
                await self.events.aclose()  # aborts the request if it had not finished
            finally:
                if self.on_end is not None:
                    self.on_end(reason)

    def _check_stall(self, loop: asyncio.AbstractEventLoop, writer: asyncio.Future) -> None:
        """One timer per stream, not one per event: a write waiting longer than the send
        timeout ends the stream."""
        since = self._sending_since
        if since is not None and loop.time() - since >= self.send_timeout:
            self._stalled = True
            writer.cancel()
            return
        self._check_handle = loop.call_later(self.send_timeout / 4, self._check_stall, loop, writer)

    async def _write(self, send: Send, deliver: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [
                    (b"content-type", b"text/event-stream; charset=utf-8"),
                    (b"cache-control", b"no-cache"),
                    *self.extra_headers,
                ],
            }
        )
        loop = asyncio.get_running_loop()
        last = b""  # the [DONE] event goes out with the body's end
        async for event in self.events:
            if last:  # not the last after all
                await deliver({"type": "http.response.body", "body": last, "more_body": True})
                last = b""
            if event.endswith(DONE):
                last = event
                continue
            self._sending_since = loop.time()
            await deliver({"type": "http.response.body", "body": event, "more_body": True})
            self._sending_since = None
        self._sending_since = loop.time()
        await deliver({"type": "http.response.body", "body": last, "more_body": False})
        self._sending_since = None
