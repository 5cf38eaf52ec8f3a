"""Executors: run the model on one or more workers, for the EngineCore."""

from __future__ import annotations

from engine.executor.base import Executor, make_executor

__all__ = ["Executor", "make_executor"]
