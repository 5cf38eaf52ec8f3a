"""Lumen's engine: offline LLM API, EngineCore, scheduler, KV cache and model runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.version import __version__

if TYPE_CHECKING:
    from engine.llm import LLM
    from engine.lora import LoRARequest
    from engine.outputs import CompletionOutput, Logprob, RequestOutput
    from engine.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "LoRARequest",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "__version__",
]  # fmt: skip

_LAZY = {
    "LLM": "engine.llm",
    "CompletionOutput": "engine.outputs",
    "Logprob": "engine.outputs",
    "LoRARequest": "engine.lora",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
    "StructuredOutputsParams": "engine.sampling_params",
}


def __getattr__(name: str) -> Any:
    # Lazy, so that worker and core processes, which import engine.*, do not
    # pay for transformers (pulled in by LLM) at start-up.
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
