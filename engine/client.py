"""EngineCore clients: the same core operations as a direct call or as ZMQ messages.

Semantics every client keeps (tests/engine/test_clients.py runs one suite on all three):
- ``add_request`` / ``abort_requests`` return at once; ``get_output`` returns
  the next batch of outputs, or an empty batch at once when nothing is open;
- after ``abort_requests`` no output of the aborted request is delivered,
  even if the same id is added again right away;
- a dead core raises ``EngineDeadError`` from every open and later call;
- utilities come from the fixed ``UtilityMethod`` set.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Protocol

from engine.config import EngineConfig
from engine.errors import EngineDeadError
from engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    FinishReason,
    UtilityMethod,
    UtilityRequest,
)

if TYPE_CHECKING:
    from engine.core.engine_core import EngineCore


class EngineCoreClient(Protocol):
    """The blocking client interface (InprocClient, SyncMPClient)."""

    info: EngineInfo
    state: ClientState

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs: ...

    def call_utility(
        self, method: UtilityMethod, path: str | None = None
    ) -> int | EngineStats | None: ...

    def shutdown(self, drain_timeout: float = 0.0) -> None: ...


class ClientState:
    """Open request ids, and the abort filter that keeps late outputs from reaching anyone."""

    def __init__(self) -> None:
        self.open_ids: set[str] = set()
        self._aborting: Counter[str] = Counter()
        self.dead = False
        self.closed = False
        # Abort acks the filter consumed, kept for a tracer (it drains them) when it asks.
        self.keep_acks = False
        self.acks: list[EngineCoreOutput] = []

    def added(self, request_id: str) -> None:
        if self.closed:
            raise EngineDeadError("the engine client is shut down")
        # Unique already: OutputProcessor.add_request is the one place that checks.
        self.open_ids.add(request_id)

    def aborting(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._aborting[request_id] += 1
            self.open_ids.discard(request_id)

    def take_acks(self) -> list[EngineCoreOutput]:
        """The abort acks kept since the last call (``keep_acks``), for a tracer."""
        acks, self.acks = self.acks, []
        return acks

    def has_open(self) -> bool:
        return bool(self.open_ids) or bool(self._aborting)

    def filter(self, outs: EngineCoreOutputs) -> EngineCoreOutputs:
        """Drop outputs of aborted requests up to and including the core's ack of the abort."""
        kept: list[EngineCoreOutput] = []
        for out in outs.outputs:
            rid = out.request_id
            if self._aborting[rid]:
                if out.finish_reason == FinishReason.ABORT and not out.new_token_ids:
                    self._aborting[rid] -= 1
                    if not self._aborting[rid]:
                        del self._aborting[rid]
                    if self.keep_acks:
                        self.acks.append(out)
                continue
            if out.finish_reason is not None:
                self.open_ids.discard(rid)
            kept.append(out)
        outs.outputs = kept
        return outs


class InprocClient:
    """The core in this process: get_output runs one engine step."""

    def __init__(self, config: EngineConfig, model_path: str) -> None:
        from engine.core.engine_core import EngineCore  # torch: only where the core runs here

        self.core: EngineCore = EngineCore(config, model_path)
        self.info = self.core.info
        self.state = ClientState()
        self._pending: list[EngineCoreOutput] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        self.state.added(request.request_id)
        if (refused := self.core.add_request(request)) is not None:
            self._pending.append(refused)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.state.aborting(request_ids)
        self._pending.extend(self.core.abort_requests(request_ids))

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        outs = self.core.step()
        if self._pending:
            outs.outputs = self._pending + outs.outputs
            self._pending = []
        return self.state.filter(outs)

    def call_utility(
        self, method: UtilityMethod, path: str | None = None
    ) -> int | EngineStats | None:
        result = self.core.call_utility(UtilityRequest(0, method, path))
        if result.error is not None:
            raise ValueError(result.error)
        return result.value

    def shutdown(self, drain_timeout: float = 0.0) -> None:
        if not self.state.closed:
            self.state.closed = True
            self.core.shutdown()
