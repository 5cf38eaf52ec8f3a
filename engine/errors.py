"""The two error kinds of the engine: dead for good, or one request refused."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore (or one of its workers) died; every open and later call fails."""


class RequestError(ValueError):
    """The core refused or failed one request; the engine serves the others."""


class EngineRestartingError(EngineDeadError):
    """The core died and its server's supervisor is starting a new one: retry the request."""


class EngineHandOverError(EngineRestartingError):
    """The request's core died before it sent output, and another engine of a data-parallel
    group takes it (engine/data_parallel.py); never reaches a caller outside the group."""


class RequestAbortedError(RuntimeError):
    """The request was ended before it finished: the server is stopping."""


# What ended a request that did not finish (Finished.code, the trace store's requests.end_code):
CLIENT = "client"  # its caller went away or cancelled it
STALLED = "stalled"  # its reader stopped reading for the stall timeout
SHUTDOWN = "shutdown"  # the server stopped: a drain past --shutdown-timeout aborted it
ENGINE_RESTARTED = "engine_restarted"  # its core failed after it had sent output (or it waited
# longer than the server allows for the new core)
ENGINE_DEAD = "engine_dead"  # its core failed and nothing restarts it
REQUEST_ERROR = "request_error"  # the core refused or failed this request alone
END_CODES = (CLIENT, STALLED, SHUTDOWN, ENGINE_RESTARTED, ENGINE_DEAD, REQUEST_ERROR)
