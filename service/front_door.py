"""The front door: the ASGI middleware every HTTP request passes first (ids, auth, the body, the
timing of each write, and the completion routes' valid bodies), in front of the FastAPI app."""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import REQUEST_ERROR
from engine.request_ids import new_request_id
from service import http_timing
from service.config import ServerConfig
from service.context import RequestContext, attach
from service.errors import APIError
from service.prepared import Prepared
from service.protocol import ChatCompletionRequest, CompletionRequest
from service.serving import Serving

logger = logging.getLogger(__name__)
_ID_KINDS = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl"}
# The routes FrontDoor serves itself for a valid body (``FrontDoor._complete``): the schema and
# the Serving method that prepares it. Their FastAPI routes answer every other body.
_COMPLETION_ROUTES: dict[str, tuple[type[Any], Callable[..., Prepared]]] = {
    "/v1/chat/completions": (ChatCompletionRequest, Serving.prepare_chat),
    "/v1/completions": (CompletionRequest, Serving.prepare_completion),
}


class FrontDoor:
    """Pure ASGI middleware, first in line for every request.

    Gives the request its id (echoed in ``x-request-id`` on every response,
    errors included), its arrival instant and the instant its first byte was
    read, checks the API key on /v1 routes (constant-time), and reads the body
    up to the size limit (413). It times every write of the response (how long
    the client's socket took to accept it) and, once the last byte is
    accepted, closes the traces of the engine requests the response started.
    What it learns and what the route tells it back travel in the request's
    one ``RequestContext`` (service/context.py).
    """

    def __init__(self, app: ASGIApp, serving: Serving, config: ServerConfig) -> None:
        self.app = app
        self.serving = serving
        self.api_key = config.api_key.encode() if config.api_key else None
        self.protected = ("/v1", "/health", "/metrics") if config.protect_probes else ("/v1",)
        self.max_body = config.max_request_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival_ns = time.time_ns()
        client = scope.get("client")
        http_start_ns = http_timing.request_started(client) or arrival_ns
        kind = _ID_KINDS.get(scope["path"], "req")
        headers = dict(scope["headers"])
        ctx = RequestContext(
            new_request_id(kind), kind, arrival_ns, min(http_start_ns, arrival_ns),
            _header(headers, b"x-request-id", 256), _header(headers, b"traceparent", 128),
            _header(headers, b"x-data-parallel-rank", 16),
        )  # fmt: skip
        attach(scope, ctx)
        facts = ctx.http
        id_header = (b"x-request-id", ctx.request_id.encode())
        lifecycle = self.serving.lifecycle
        status = 0

        chunk: http_timing.ChunkWriter | None = None  # set by a chunked response

        async def deliver(message: Message) -> None:
            """A body message, straight to the server, its delivery measured."""
            started = time.time_ns()
            body = message.get("body", b"")
            if chunk is not None and body:
                if message.get("more_body", False):
                    await chunk(body)  # the transport took it (a slow reader blocks it)
                else:  # the last chunk goes out with the body's end: one write
                    chunk.hold(body)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
            else:
                await send(message)  # likewise
            ended = time.time_ns()
            facts.send_wait_ns += ended - started
            facts.bytes_sent += len(body)
            facts.last_delivered_ns = ended
            if not facts.first_delivered_ns and ctx.stream is False:
                facts.first_delivered_ns = ended  # a whole response: one write

        def deliver_now(body: bytes) -> bool:
            """A stream's chunk written now if the connection takes it without a wait (False:
            nothing written; ``deliver`` it then)."""
            if chunk is None or not chunk.write_now(body):
                return False
            facts.bytes_sent += len(body)
            facts.last_delivered_ns = time.time_ns()
            return True

        async def send_with_id(message: Message) -> None:
            nonlocal status, chunk
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = [*message.get("headers", []), id_header]
                if _chunked(scope, status, headers):
                    chunk = http_timing.chunk_writer(client)
                    if chunk is not None and ctx.hold_head:
                        chunk.hold_head()
                if lifecycle.closing:
                    headers.append((b"connection", b"close"))  # the client reconnects elsewhere
                message = {**message, "headers": headers}
                await send(message)
                return
            await deliver(message)

        # A stream's events skip the app's middleware on the way out (streaming.EventStream):
        # they only look at the response's start.
        ctx.deliver, ctx.deliver_now = deliver, deliver_now
        try:
            await self._handle(scope, receive, send_with_id, headers, ctx)
        finally:
            http_timing.request_ended(client)
            self._close_traces(scope["path"], ctx, status)
            # Each closure points back at ctx: left, the cycle is the garbage collector's to free.
            ctx.deliver = ctx.deliver_now = None

    def _close_traces(self, path: str, ctx: RequestContext, status: int) -> None:
        """The response is written (or abandoned): every engine request it started ends here."""
        tracer = self.serving.tracer
        if tracer is None:
            return
        if ctx.traced_ids:
            now_ns = time.time_ns()
            for rid in ctx.traced_ids:
                tracer.closed(rid, now_ns, ctx.http)
        elif ctx.kind != "req" and status >= 400:
            # A completion request the engine never saw (invalid, unauthorized, too big...).
            tracer.start(ctx.trace_start(ctx.request_id, path, self.serving.model_name, False))
            error = ctx.error or f"HTTP {status}"
            tracer.rejected(ctx.request_id, time.time_ns(), error, ctx.http, REQUEST_ERROR)

    async def _handle(
        self,
        scope: Scope,
        receive: Receive,
        send_with_id: Send,
        headers: dict[bytes, bytes],
        ctx: RequestContext,
    ) -> None:
        if scope["path"].startswith(self.protected) and not self._authorized(headers):
            error = APIError(401, "invalid or missing API key", code="invalid_api_key")
            ctx.error = error.message
            await error.response()(scope, receive, send_with_id)
            return
        if scope["method"] in ("POST", "PUT", "PATCH"):
            body = await self._read_body(headers, receive)
            if body is None:
                error = APIError(413, f"the request body is over {self.max_body} bytes")
                ctx.error = error.message
                await error.response()(scope, receive, send_with_id)
                return
            ctx.body_read_ns, ctx.body_bytes = time.time_ns(), len(body)
            receive = _replay(body, receive)
            if (route := _COMPLETION_ROUTES.get(scope["path"])) is not None and (
                await self._complete(route, scope, receive, send_with_id, headers, body, ctx)
            ):
                return
        await self.app(scope, receive, send_with_id)

    async def _complete(
        self,
        route: tuple[type[Any], Callable[..., Prepared]],
        scope: Scope,
        receive: Receive,
        send_with_id: Send,
        headers: dict[bytes, bytes],
        body: bytes,
        ctx: RequestContext,
    ) -> bool:
        """Serve a completion request whose body is valid JSON of its schema, as its FastAPI
        route would but without FastAPI's layers (about 120 us a request on 2 busy cores);
        False, having done nothing, for any other body: the route answers it, with FastAPI's
        own errors."""
        model, prepare = route
        content_type = headers.get(b"content-type", b"").partition(b";")[0].strip().lower()
        if scope["method"] != "POST" or not (  # FastAPI's JSON types: application/json, .../*+json
            content_type == b"application/json"
            or (content_type.startswith(b"application/") and content_type.endswith(b"+json"))
        ):
            return False
        try:  # what FastAPI does with a JSON body: Starlette's json.loads, then validation
            parsed = model.model_validate(json.loads(body), from_attributes=True)
        except Exception:  # a bad body: its route says why, as ever
            return False
        try:
            prep = prepare(self.serving, parsed, ctx, scope["path"])
            response = await self.serving.respond(prep, Request(scope, receive))
        except APIError as e:  # as the app's APIError handler answers
            ctx.error = e.message
            response = e.response()
        except Exception:  # as its handler of the unexpected
            logger.exception("unexpected error in %s", scope["path"])
            response = APIError(500, "internal server error").response()
        await response(scope, receive, send_with_id)
        return True

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        if self.api_key is None:
            return True
        given = headers.get(b"authorization", b"")
        scheme, _, token = given.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _read_body(self, headers: dict[bytes, bytes], receive: Receive) -> bytes | None:
        """The whole body, or None when it is over the limit (read no further than that)."""
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return None
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks)


def _header(headers: dict[bytes, bytes], name: bytes, max_len: int) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")[:max_len]


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: wait for the disconnect

    return replayed


def _chunked(scope: Scope, status: int, headers: list[tuple[bytes, bytes]]) -> bool:
    """Whether h11 frames this response's body in chunks: HTTP/1.1, a body, and neither a
    length nor a transfer coding of the app's own."""
    if scope.get("http_version") != "1.1" or scope.get("method") == "HEAD":
        return False
    if status < 200 or status in (204, 304):
        return False
    return not any(name.lower() in (b"content-length", b"transfer-encoding") for name, _ in headers)
