"""EngineCore clients: the same core operations as a direct call or (later) over ZMQ."""

from __future__ import annotations

from typing import Protocol

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.messages import EngineCoreOutputs, EngineCoreRequest, EngineInfo


class EngineCoreClient(Protocol):
    """What a frontend may ask of the core: ADD, ABORT, and pulling outputs."""

    info: EngineInfo

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self) -> EngineCoreOutputs: ...

    def reset_prefix_cache(self) -> int: ...

    def shutdown(self) -> None: ...


class InprocClient:
    """The core in this process: get_output runs one engine step."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        self.core = EngineCore(config, model_path)
        self.info = self.core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self) -> EngineCoreOutputs:
        return self.core.step()

    def reset_prefix_cache(self) -> int:
        return self.core.reset_prefix_cache()

    def shutdown(self) -> None:
        self.core.shutdown()
