"""The Executor interface between the EngineCore and its workers, and how one is chosen."""

from __future__ import annotations

from typing import Protocol

import torch

from engine.config import EngineConfig, ModelConfig
from engine.core.scheduler_output import ModelRunnerOutput, SchedulerOutput


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

    def start_profile(self, path: str) -> None: ...

    def stop_profile(self) -> None: ...

    def check_health(self) -> None: ...

    @property
    def sentinels(self) -> list[int]: ...

    def shutdown(self) -> None: ...


class WorkerDeadError(RuntimeError):
    """A worker process died; the engine cannot go on."""


def make_executor(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
) -> Executor:
    if config.tensor_parallel_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_config, device, dtype, max_model_len)
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, device, dtype, max_model_len)
