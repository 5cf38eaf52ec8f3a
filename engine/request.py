"""Request: the core's mutable state for one request (the wire type is EngineCoreRequest)."""

from __future__ import annotations

import enum
from typing import Any

from engine.lora import LoRARequest
from engine.messages import EngineCoreRequest, FinishReason
from engine.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


class Request:
    """A request inside the core: token ids in, token ids out.

    ``num_computed_tokens`` counts the tokens whose KV is in the cache; the
    scheduler's one rule is to catch it up with ``num_tokens``.
    """

    __slots__ = (
        "all_token_ids",
        "arrival_ns",
        "block_hashes",
        "cache_salt",
        "eos_token_ids",
        "grammar",
        "lora_request",
        "max_tokens",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_preemptions",
        "num_prompt_tokens",
        "priority",
        "received_ns",
        "request_id",
        "sampling_params",
        "spec_pause",
        "spec_rate",
        "spec_token_ids",
        "status",
        "stop_reason",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        *,
        eos_token_ids: tuple[int, ...] | list[int] = (),
        arrival_ns: int = 0,
        priority: int = 0,
        cache_salt: str | None = None,
        max_model_len: int | None = None,
        lora_request: LoRARequest | None = None,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(() if sampling_params.ignore_eos else eos_token_ids)
        self.arrival_ns = arrival_ns
        self.received_ns = 0  # set by the core when it dequeues the request
        self.priority = priority
        self.cache_salt = cache_salt
        self.lora_request = lora_request  # its LoRA adapter, or None: the base model
        limit = (max_model_len or 1 << 62) - self.num_prompt_tokens
        self.max_tokens = min(sampling_params.max_tokens or limit, limit)
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit tokens at first schedule; -1 = not yet
        self.num_preemptions = 0
        self.block_hashes: list[bytes] = []  # vLLM's sha256_cbor (engine/core/block_hashes.py)
        self.stop_reason: int | None = None
        self.grammar: Any = None  # engine.core.grammar.Grammar, set by the core
        # Drafts the worker proposed after the last step, verified in the next
        # (--speculative-config).
        self.spec_token_ids: list[int] = []
        # The share of its drafts the model kept, averaged over its verifying steps (each
        # halving the weight of the ones before), and the steps it still sits out after that
        # share fell under the scheduler's bar (engine/core/scheduler.py SPEC_MIN_RATE).
        self.spec_rate = 1.0
        self.spec_pause = 0

    @classmethod
    def from_wire(cls, req: EngineCoreRequest, max_model_len: int) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            eos_token_ids=req.eos_token_ids,
            arrival_ns=req.arrival_ns,
            priority=req.priority,
            cache_salt=req.cache_salt,
            max_model_len=max_model_len,
            lora_request=req.lora_request,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.all_token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    def check_stop(self, token_id: int) -> bool:
        """Append a sampled token and decide whether the request is done."""
        self.all_token_ids.append(token_id)
        num_output = self.num_output_tokens
        if num_output >= self.sampling_params.min_tokens:
            if token_id in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if token_id in self.sampling_params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token_id
                return True
        if num_output >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
