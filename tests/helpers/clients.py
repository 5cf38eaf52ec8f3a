"""Client adapters shared by the client and engine-process tests."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from engine.config import EngineConfig
from engine.messages import EngineCoreOutputs, EngineCoreRequest, UtilityMethod
from engine.mp_client import AsyncMPClient


class AsyncAdapter:
    """Drives an AsyncMPClient from test code through a loop in another thread."""

    def __init__(self, config: EngineConfig, path: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.client: AsyncMPClient = self._run(self._make(config, path))
        self.info = self.client.info

    async def _make(self, config: EngineConfig, path: str) -> AsyncMPClient:
        return AsyncMPClient(config, path)

    def _run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._run(self.client.add_request(request))

    def abort_requests(self, ids: list[str]) -> None:
        self._run(self.client.abort_requests(ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        return self._run(self.client.get_output(timeout))

    def call_utility(self, method: UtilityMethod, path: str | None = None) -> Any:
        return self._run(self.client.call_utility(method, path))

    def shutdown(self) -> None:
        self._run(self.client.shutdown())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
