"""The shared server fixture type: bench.server.LumenServer plus what only tests need."""

from __future__ import annotations

import openai

from bench.server import ROOT, free_port, metric, parse_metrics
from bench.server import LumenServer as _LumenServer
from tests.helpers.procs import live_children

__all__ = ["ROOT", "LumenServer", "free_port", "metric", "parse_metrics"]


class LumenServer(_LumenServer):
    def client(self, **kwargs) -> openai.OpenAI:
        kwargs.setdefault("max_retries", 0)
        return openai.OpenAI(base_url=self.url("/v1"), api_key=self.api_key or "unused", **kwargs)

    def core_pid(self) -> int:
        """The EngineCore process (the server's one spawned child)."""
        kids = [p for p in live_children(self.proc.pid) if "spawn" in " ".join(p.cmdline())]
        assert kids, "the server has no engine core process"
        return kids[0].pid

    def __enter__(self) -> LumenServer:
        return self
