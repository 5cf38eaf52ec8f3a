"""Small factories for core objects, so tests build them one way."""

from __future__ import annotations

import itertools
import time

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.scheduler import Scheduler
from engine.messages import EngineCoreRequest
from engine.request import Request
from engine.sampling_params import SamplingParams

_ids = itertools.count()


def make_request(
    prompt_token_ids: list[int] | int = 8,
    *,
    max_tokens: int = 4,
    request_id: str | None = None,
    priority: int = 0,
    arrival_ns: int | None = None,
    eos_token_ids: tuple[int, ...] = (),
    max_model_len: int = 4096,
    **params: object,
) -> Request:
    """A core Request; an int prompt means that many distinct token ids."""
    n = next(_ids)
    if isinstance(prompt_token_ids, int):
        prompt_token_ids = [1000 + (n * 131 + i) % 30000 for i in range(prompt_token_ids)]
    return Request(
        request_id or f"req-{n}",
        prompt_token_ids,
        SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=eos_token_ids,
        arrival_ns=n if arrival_ns is None else arrival_ns,
        priority=priority,
        max_model_len=max_model_len,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 4096,
    policy: str = "fcfs",
    enable_caching: bool = True,
    kv_windows: tuple[int, ...] = (0,),
) -> Scheduler:
    return Scheduler(
        KVCacheManager(num_blocks, block_size, enable_caching, kv_windows),
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        policy=policy,
    )


def make_core_request(
    request_id: str, prompt: list[int], max_tokens: int = 6, **params: object
) -> EngineCoreRequest:
    """A wire request as a frontend sends it: greedy, ignore_eos, eos id 2."""
    sampling = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **params)
    return EngineCoreRequest(request_id, prompt, sampling, [2], time.time_ns())
