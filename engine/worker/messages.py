"""Every message between the EngineCore and its executor and workers (one step's batch and its
result), and the executor <-> worker-process link that carries them.

Both sides import this module from below: the core, executors and workers
share these types and nothing else of each other. SchedulerOutput and
ModelRunnerOutput are plain dataclasses in-process (UniprocExecutor) and cross
a worker's pipe as msgpack inside the tagged structs below (never pickle);
WorkerArgs alone is pickled once, by multiprocessing's spawn.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec
import torch

from engine.kv_layout import KVLayout
from engine.lora import LoRARequest, LoraSettings
from engine.messages import Logprobs
from engine.model_config import ModelConfig
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig


@dataclass
class NewRequestData:
    """Sent once, when a request is first scheduled: what the worker keeps per request."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    lora_request: LoRARequest | None = None


@dataclass
class SchedulerOutput:
    """One step's batch, one row per scheduled request (columnar lists, same order).

    Row i computes ``token_ids[i]`` at positions starting at
    ``num_computed_tokens[i]``, writing KV into ``block_tables[i]`` (the first KV group's;
    a model of several groups, engine/kv_layout.py, has the others' in
    ``group_block_tables[i]``: none given, every group uses the first's). When
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
    group_block_tables: list[list[list[int]]] = field(default_factory=list)
    # Structured outputs: the rows sampling under a grammar this step, and their token masks
    # (one row of ceil(vocab / 32) int32 words each, bit t = token t allowed), as bytes. A row
    # that verifies drafts has a mask at each of its positions, its id repeated for each.
    grammar_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: bytes = b""
    # Speculative decoding (engine/worker/spec_decode.py): the drafts each verifying row's
    # token_ids end with (the row samples at each and after the last), and how many drafts the
    # driver proposes for the next step (0: none).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_spec_tokens: int = 0
    # Requests the driver proposes no drafts for this step: sitting out after their drafts
    # kept too few (engine/core/scheduler.py).
    no_drafts: list[str] = field(default_factory=list)
    # A draft model's own step (engine/worker/draft.py): rows with spec_token_ids end with
    # tokens already known, not drafts: they run as those rows do and sample after the last.
    spec_catch_up: bool = False

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
    # The sampler's share of the step (engine.worker.sampler): penalties, grammar masks,
    # temperature and top-k/p on the full logits; and the logprobs asked for, by how many rows,
    # the most per token. 0 on the greedy head's path (that head is part of the forward).
    sample_ns: int = 0
    logprobs_ns: int = 0
    num_logprobs_rows: int = 0
    max_logprobs: int = 0
    # Speculative decoding: the tokens a verifying row kept after its first (its drafts the
    # target agreed with, then the target's own); the drafts proposed for the next step; and
    # the proposer's time.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)
    propose_ns: int = 0


# -- executor -> worker ---------------------------------------------------------


class ExecuteModel(msgspec.Struct, tag=True):
    sched: SchedulerOutput


class InitKVCache(msgspec.Struct, tag=True):
    num_blocks: int


class ReleaseKVCache(msgspec.Struct, tag=True):
    pass


class StartProfile(msgspec.Struct, tag=True):
    path: str  # the executor's path; each rank writes rank_path(path, rank)


class StopProfile(msgspec.Struct, tag=True):
    pass


class Shutdown(msgspec.Struct, tag=True):
    pass


WorkerRequest = ExecuteModel | InitKVCache | ReleaseKVCache | StartProfile | StopProfile | Shutdown


# -- worker -> executor ---------------------------------------------------------


class Ready(msgspec.Struct, tag=True):
    block_bytes: int
    device: str


class Done(msgspec.Struct, tag=True):
    output: ModelRunnerOutput | None = None


class Failed(msgspec.Struct, tag=True):
    error: str  # "ValueError: the checkpoint has no tensor ..."
    traceback: str
    user_error: bool = False  # a ValueError (bad weights, bad path): re-raised as one


WorkerReply = Ready | Done | Failed


@dataclass(frozen=True)
class WorkerArgs:
    """What a rank needs to start; pickled once by multiprocessing's spawn."""

    model_config: ModelConfig
    device_type: str
    dtype: torch.dtype
    max_model_len: int
    block_size: int
    seed: int
    rank: int
    world_size: int
    init_method: str
    parent_pid: int
    kv_dtype: torch.dtype | None = None  # None: the model's dtype
    quantization: str | None = None
    kv_layout: KVLayout | None = None  # None: every layer in one group
    speculative: SpeculativeConfig | None = None  # --speculative-config (the driver proposes)
    lora: LoraSettings | None = None  # --enable-lora
