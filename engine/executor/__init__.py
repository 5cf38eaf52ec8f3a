"""Executors: run the model on one or more workers, for the EngineCore."""

from __future__ import annotations

import torch

from engine.config import EngineConfig, ModelConfig
from engine.executor.base import Executor, WorkerDeadError

__all__ = ["Executor", "WorkerDeadError", "make_executor"]


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
