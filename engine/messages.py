"""Every message that crosses the frontend <-> EngineCore boundary, as compact msgspec structs.

Clock rule: every ``*_ns`` instant on these messages is ``time.time_ns()``, the
host's wall clock in nanoseconds since the Unix epoch. All Lumen processes of
one server run on one host, so instants taken in different processes are
directly comparable; durations inside one process use the same clock so that a
span's start and end never mix clocks.
"""

from __future__ import annotations

import enum

import msgspec

from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """The one message type that carries a new request into the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_ns: int
    priority: int = 0
    cache_salt: str | None = None


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of the tokens one step sampled for one request.

    Row i describes new token i: ``token_ids[i][0]`` is the sampled token,
    followed by the top-k alternatives; ``logprobs[i]`` matches it; ``ranks[i]``
    is the sampled token's rank among all tokens (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, when one did.
    stop_reason: int | None = None
    num_cached_tokens: int = 0


class StepRecord(msgspec.Struct, array_like=True, gc=False):
    """Timing and batch composition of one engine step (instants per the clock rule above)."""

    step_id: int
    schedule_start_ns: int
    schedule_end_ns: int
    execute_start_ns: int
    execute_end_ns: int
    output_ns: int
    num_running: int
    num_waiting: int
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_prefix_query_tokens: int
    num_prefix_hit_tokens: int


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs for every request that produced something."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    step: StepRecord | None = None


class EngineInfo(msgspec.Struct, array_like=True):
    """What the core reports once it is ready; clients adopt it."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    device: str
    version: str
