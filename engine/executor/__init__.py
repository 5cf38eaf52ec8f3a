"""Executors: run the model on one or more workers, for the EngineCore."""

from __future__ import annotations

import torch

from engine.config import EngineConfig
from engine.executor.base import Executor, WorkerDeadError
from engine.model_config import ModelConfig

__all__ = ["Executor", "WorkerDeadError", "make_executor"]


def make_executor(
    config: EngineConfig,
    model_config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    owns_process: bool = False,
) -> Executor:
    """``owns_process``: the caller's process is the engine's own (the EngineCore process),
    so the executor may set process-wide state there (CPU threads)."""
    if config.tensor_parallel_size == 1:
        from engine.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, model_config, device, dtype, max_model_len, owns_process)
    from engine.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, model_config, device, dtype, max_model_len)
