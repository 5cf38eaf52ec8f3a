"""Per-batch statistics the frontend derives from the core's outputs, for metrics loggers.

Instants follow the clock rule of ``engine/messages.py`` (``time.time_ns``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from engine.messages import StepRecord


@dataclass
class FinishedRequest:
    """One request (all n of its sequences) that ended."""

    request_id: str
    finish_reason: str  # "stop", "length", "abort" or "error"
    num_prompt_tokens: int
    num_generation_tokens: int
    arrival_ns: int
    # 0 when the request never got that far (refused, or aborted while waiting).
    queued_ns: int = 0  # the core dequeued it (core.receive end)
    scheduled_ns: int = 0  # its first step was scheduled
    first_token_ns: int = 0
    finished_ns: int = 0


@dataclass
class IterationStats:
    """What one batch of core outputs changed, as the frontend saw it."""

    now_ns: int
    step: StepRecord | None = None
    num_outputs: int = 0  # core outputs in the batch
    num_prompt_tokens: int = 0  # prompts of requests that got their first token
    num_generation_tokens: int = 0
    ttfts_s: list[float] = field(default_factory=list)
    itls_s: list[float] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    # Structured outputs: per request that got its first token, how long its grammar compile
    # took (seconds; 0 for a cache hit) and whether it was cached.
    grammar_compiles: list[tuple[float, bool]] = field(default_factory=list)


class StatLogger(Protocol):
    """Receives every batch's stats on the frontend's output loop; must not block."""

    def record(self, stats: IterationStats) -> None: ...
