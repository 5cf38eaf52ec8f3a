"""Lumen's engine: offline LLM API, EngineCore, scheduler, KV cache and model runner."""

from __future__ import annotations

__version__ = "0.1.0"

from engine.llm import LLM
from engine.outputs import CompletionOutput, Logprob, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams", "__version__"]
