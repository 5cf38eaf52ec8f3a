"""The shared server fixture type: bench.server.LumenServer plus what only tests need."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import openai

from bench.server import ROOT, free_port, metric, parse_metrics
from bench.server import LumenServer as _LumenServer
from engine.background import is_engine_core
from tests.helpers.procs import live_children

__all__ = ["ROOT", "LumenServer", "ServerPool", "free_port", "metric", "parse_metrics"]


class LumenServer(_LumenServer):
    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", **kwargs)

    def core_pid(self) -> int:
        """The EngineCore process (the server's one spawned child)."""
        kids = [p for p in live_children(self.proc.pid) if is_engine_core(p.cmdline())]
        assert kids, "the server has no engine core process"
        return kids[0].pid

    def __enter__(self) -> LumenServer:
        return self


class ServerPool:
    """Fresh, identical servers for tests that each use one up (a stop signal ends it): while
    a test runs on one, the next starts in the background, so the tests after the first do
    not wait for a start. ``size``: how many the tests will take (no spare is left over)."""

    def __init__(self, start: Callable[[int], LumenServer], size: int) -> None:
        self._start, self._left, self._count = start, size, itertools.count()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="server-pool")
        self._spare: Future[LumenServer] | None = None
        self._taken: list[LumenServer] = []
        self._prestart()

    def _prestart(self) -> None:
        self._spare = None
        if self._left > 0:
            self._left -= 1
            self._spare = self._pool.submit(self._start, next(self._count))

    def take(self) -> LumenServer:
        spare = self._spare or self._pool.submit(self._start, next(self._count))
        server = spare.result()
        self._taken.append(server)
        self._prestart()
        return server

    def close(self) -> None:
        """Stop every server it started that is still up (a failed test left it running)."""
        servers = list(self._taken)
        if self._spare is not None:
            with contextlib.suppress(Exception):
                servers.append(self._spare.result())
        for server in servers:
            with contextlib.suppress(Exception):
                server.stop(timeout=10, drain=1)
        self._pool.shutdown()
