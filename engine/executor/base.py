"""The Executor interface between the EngineCore and its workers."""

from __future__ import annotations

from typing import Protocol

from engine.lora import LoRARequest
from engine.worker.messages import ModelRunnerOutput, SchedulerOutput


class Executor(Protocol):
    """Runs what the scheduler decided on every worker; never decides who runs.

    Lifecycle: construct (start workers, load weights) -> ``block_bytes`` ->
    ``init_kv_cache`` -> ``execute_model`` per step -> ``shutdown``. A worker
    that dies makes ``execute_model`` and ``check_health`` raise
    ``WorkerDeadError``; ``sentinels`` lets a monitor wait on the worker
    processes without polling.
    """

    def block_bytes(self) -> int:
        """Bytes one KV block takes on each worker (the budget is per worker)."""
        ...

    def init_kv_cache(self, num_blocks: int) -> None: ...

    def release_kv_cache(self) -> None: ...

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput: ...

    def prefetch_lora(self, lora: LoRARequest) -> None:
        """Start reading a LoRA adapter a request just brought, off the step's path, where
        the workers can (else the step that first schedules it reads it)."""
        ...

    def start_profile(self, path: str) -> None: ...

    def stop_profile(self) -> None: ...

    def check_health(self) -> None: ...

    @property
    def sentinels(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class WorkerDeadError(RuntimeError):
    """A worker process died; the engine cannot go on."""
