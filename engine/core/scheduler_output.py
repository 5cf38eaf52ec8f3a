"""What the scheduler hands the workers each step, and what they hand back."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.messages import Logprobs
from engine.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """Sent once, when a request is first scheduled: what the worker keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]


@dataclass
class SchedulerOutput:
    """One step's batch, one row per scheduled request (columnar lists, same order).

    Row i computes ``token_ids[i]`` at positions starting at
    ``num_computed_tokens[i]``, writing KV into ``block_tables[i]``. When
    ``sample[i]`` the row's last token is the sequence's last known token, so
    the worker samples the next one.
    """

    step_id: int
    new_requests: list[NewRequestData] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    token_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    sample: list[bool] = field(default_factory=list)
    # Requests that ended since the last step: workers drop their state.
    finished_req_ids: list[str] = field(default_factory=list)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_req_ids: list[str] = field(default_factory=list)
    # Prefix-cache lookups of requests admitted this step: tokens looked up, tokens hit.
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # What kept requests waiting after this step's admissions ("" when none waits), one of
    # WAIT_REASONS in engine/messages.py.
    wait_reason: str = ""

    @property
    def num_preemptions(self) -> int:
        return len(self.preempted_req_ids)

    @property
    def num_scheduled_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens


@dataclass
class ModelRunnerOutput:
    """Sampled tokens, one per row of the SchedulerOutput that had ``sample`` set."""

    req_ids: list[str]
    sampled_token_ids: list[int]
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
