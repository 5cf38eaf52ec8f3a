"""What the server tells the tracer beside the engine front's events (engine/frontend.py).

The engine front reports Enqueued / outputs / delivered / Finished / closed
through its observer interface; the HTTP server adds what only it sees: the
request's HTTP metadata (Start), its life outside the engine (HttpFacts, at
close) and the API process's pauses (Pause). All are plain typed records put
on the tracer's queue; the writer thread dispatches them by type.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import EngineCoreOutput, EngineCoreOutputs


@dataclass(slots=True)
class Start:
    """A request's HTTP metadata, before it is handed to the engine."""

    request_id: str
    arrival_ns: int  # the server's handler chain first saw it (vLLM's arrival)
    endpoint: str
    model: str
    stream: bool
    traceparent: str | None = None
    client_request_id: str | None = None
    http_start_ns: int = 0  # the server read the request's first byte (0: unknown)
    handler_ns: int = 0  # body read and validated: the route's handler began
    body_read_ns: int = 0  # the body was read whole (then decoded and validated to handler_ns)
    body_bytes: int = 0


@dataclass(slots=True)
class HttpFacts:
    """What the HTTP layer measured of one response, reported when it is closed."""

    admission_wait_ns: int = 0
    first_delivered_ns: int = 0  # the first chunk with output was accepted by the transport
    last_delivered_ns: int = 0  # the response's last byte was accepted
    send_wait_ns: int = 0  # summed time the writes waited for the client's socket
    bytes_sent: int = 0


@dataclass(slots=True)
class Closed:
    request_id: str
    ns: int
    http: HttpFacts | None = None


@dataclass(slots=True)
class Delivered:
    request_id: str
    ns: int


@dataclass(slots=True)
class Outputs:
    outs: EngineCoreOutputs
    received_ns: int
    acks: list[EngineCoreOutput] = field(default_factory=list)


@dataclass(slots=True)
class Pause:
    """A stretch in which a process could not run its work: GC, or a blocked event loop."""

    process: str  # api | core
    kind: str  # gc | loop_lag | cpu (a busy stretch of the API process, not a pause)
    start_ns: int
    duration_ns: int
    detail: str = ""
    cpu_ns: int | None = None  # cpu: the process's CPU time in it


@dataclass(slots=True)
class Lifecycle:
    """A drain, a restart of the engine core (after a crash or a hang) or a crash loop that
    ended the server: a row of the ``lifecycle`` table."""

    kind: str  # drain | restart | crash_loop
    cause: str  # the signal, or why the core failed
    start_ns: int  # the signal came, or the core was found dead
    end_ns: int  # the drain ended, or the new core was ready
    epoch: int = 0  # the core serving after it (restart: the new one)
    num_finished: int = 0  # drain: requests in flight that finished within the timeout
    num_failed: int = 0  # drain: aborted at the timeout; restart: failed with the dead core
    engine: int | None = None  # restart and crash loop: the data-parallel engine
