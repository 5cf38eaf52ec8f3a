"""The two error kinds of the engine: dead for good, or one request refused."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The EngineCore (or one of its workers) died; every open and later call fails."""


class RequestError(ValueError):
    """The core refused or failed one request; the engine serves the others."""


class EngineRestartingError(EngineDeadError):
    """The core died and its server's supervisor is starting a new one: retry the request."""


class RequestAbortedError(RuntimeError):
    """The request was ended before it finished: the server is stopping."""
