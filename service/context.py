"""One request's typed context, from its arrival at the front door to its last byte written."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.types import Scope, Send

from tracing.events import HttpFacts, Start

# The context's one place in the ASGI scope (a dict of this request's own; ASGI extensions are
# namespaced keys). Read it through ``context_of`` only.
_SCOPE_KEY = "lumen.context"


@dataclass(slots=True)
class RequestContext:
    """What ``FrontDoor`` learns of a request, and what the route tells it back.

    The front door creates it before the app sees the request and reads it
    once the response is written: it closes the traces of ``traced_ids``, or
    records a refused completion request with its ``error``.
    """

    request_id: str  # echoed in x-request-id; a completion's response id
    kind: str  # the id's prefix: "chatcmpl", "cmpl", or "req" for every other route
    arrival_ns: int  # when the app first saw the request
    http_start_ns: int  # when its first byte was read (service/http_timing.py); <= arrival_ns
    client_request_id: str | None = None  # the client's own x-request-id
    traceparent: str | None = None  # the client's W3C trace context
    data_parallel_rank: str | None = None  # X-data-parallel-rank: the engine it asks for
    http: HttpFacts = field(default_factory=HttpFacts)  # what the front door measures of it
    deliver: Send | None = None  # writes a body message, timed (a stream's events use it)
    # Writes a stream's chunk now where the connection takes it without a wait (else False).
    deliver_now: Callable[[bytes], bool] | None = None
    hold_head: bool = False  # the response head waits for its first chunk, which follows at once
    # Set by the route.
    handler_ns: int = 0  # when the route's handler began (the body read and parsed)
    # Set by the front door: the body's size and when it was read whole (0: no body).
    body_read_ns: int = 0
    body_bytes: int = 0
    stream: bool | None = None  # None until a completion route knows
    traced_ids: list[str] = field(default_factory=list)  # engine requests it started traces for
    error: str | None = None  # why it was refused (4xx), for its trace

    def trace_start(self, request_id: str, path: str, model: str, stream: bool) -> Start:
        """The opening event of one engine request's trace (the whole response's, refused)."""
        return Start(
            request_id, self.arrival_ns, path, model, stream, self.traceparent,
            self.client_request_id, self.http_start_ns, self.handler_ns, self.body_read_ns,
            self.body_bytes,
        )  # fmt: skip


def attach(scope: Scope, context: RequestContext) -> None:
    scope[_SCOPE_KEY] = context


def context_of(scope: Scope) -> RequestContext:
    """The context the front door attached (every HTTP request passes through it)."""
    return scope[_SCOPE_KEY]


def find_context(scope: Scope) -> RequestContext | None:
    """The context, where the app may run without the front door (a bare test app)."""
    return scope.get(_SCOPE_KEY)
