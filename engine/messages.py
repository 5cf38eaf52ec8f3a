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

from engine.lora import LoRARequest
from engine.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class RequestType(bytes, enum.Enum):
    """The first frame of every frontend -> core message."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"


class OutputType(bytes, enum.Enum):
    """The first frame of every core -> frontend message."""

    READY = b"\x00"
    OUTPUTS = b"\x01"
    # Before READY: the phase the start has reached ("warming_up": the model is loaded).
    PROGRESS = b"\x02"


class UtilityMethod(enum.IntEnum):
    """The fixed set of utility calls; nothing on the wire names a method."""

    RESET_PREFIX_CACHE = 0
    GET_STATS = 1
    SLEEP = 2
    WAKE_UP = 3
    START_PROFILE = 4
    STOP_PROFILE = 5


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    method: UtilityMethod
    path: str | None = None  # START_PROFILE's trace file


class EngineStats(msgspec.Struct, array_like=True):
    """Scheduler and KV cache state, for the get_stats utility."""

    num_running: int
    num_waiting: int
    num_kv_blocks_used: int
    num_kv_blocks_total: int
    num_kv_blocks_cached: int
    num_preemptions: int
    sleeping: bool
    # Times the core's bounded output queue was full and its loop had to wait.
    num_output_backpressure: int = 0
    # LoRA (--enable-lora): the adapters of the running requests, and of the waiting ones.
    running_loras: list[str] = []
    waiting_loras: list[str] = []


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    value: int | EngineStats | None = None
    error: str | None = None


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """The one message type that carries a new request into the core."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_ns: int
    priority: int = 0
    cache_salt: str | None = None
    lora_request: LoRARequest | None = None


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
    """New tokens of one request, and how it ended if it did.

    An ABORT output with no tokens acknowledges an abort: every output the
    core produced for that request before it comes earlier in the stream.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: Logprobs | None = None
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request, when one did.
    stop_reason: int | None = None
    num_cached_tokens: int = 0
    # Why the core refused or failed this request (finish_reason ERROR).
    error: str | None = None
    # When the core's loop dequeued the request (the end of core.receive); sent
    # once, on the request's first output, its abort ack or its refusal.
    received_ns: int = 0
    # On an abort ack of a request the core held: when its KV blocks were freed.
    freed_ns: int = 0
    # Structured outputs, on the first output of a request with a grammar: when its grammar
    # was ready (its compile ended, or the cache had it), how long the compile took (0 when
    # cached) and whether it came from the cache.
    grammar: tuple[int, int, bool] | None = None


# What held waiting requests back in a step (StepRecord.wait_reason; "" when none waited).
WAIT_REASONS = ("max_num_seqs", "kv_blocks", "token_budget", "preemption", "lora_slots")


class StepRecord(msgspec.Struct, array_like=True, gc=False):
    """Timing and batch composition of one engine step (instants per the clock rule above).

    ``output_ns`` is when the step's outputs left the core: handed to the
    socket in a core process, returned to the caller in-process.
    """

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
    # Who took part: the per-step boundaries of each request come from these.
    req_ids: list[str] = msgspec.field(default_factory=list)
    num_scheduled: list[int] = msgspec.field(default_factory=list)  # tokens, per req_ids row
    preempted_req_ids: list[str] = msgspec.field(default_factory=list)
    # Outputs built (update_from_output's end): output CPU apart from sending.
    update_end_ns: int = 0
    wait_reason: str = ""  # one of WAIT_REASONS
    # KV blocks released since the previous record: by finishing, aborted and preempted requests.
    num_blocks_freed: list[int] = msgspec.field(default_factory=list)
    # A record with no batch: the KV state after aborts emptied the engine (no step follows).
    idle: bool = False
    # The core process's garbage-collection pauses since the previous record, each
    # (start_ns, duration_ns, generation); only pauses of at least GC_PAUSE_MIN_NS are listed.
    gc_pauses: list[tuple[int, int, int]] = msgspec.field(default_factory=list)
    gc_pause_ns: int = 0  # every pause summed, listed or not
    # Structured outputs: computing the token masks of the rows that sample under a grammar,
    # between the scheduler's decision (schedule_end_ns) and the execute start; and how many.
    grammar_mask_ns: int = 0
    num_grammar_rows: int = 0
    # Inside execute: the sampler on the full logits, and logprobs, with the rows that asked
    # for logprobs and the most asked per token (engine.worker.messages.ModelRunnerOutput).
    sample_ns: int = 0
    logprobs_ns: int = 0
    num_logprobs_rows: int = 0
    max_logprobs: int = 0
    # Speculative decoding, per req_ids row ([] in a step where no row verified drafts): the
    # drafts it verified and how many of them the target kept (the row's output tokens are
    # the kept ones and one more); the proposer's time for the next step's drafts (inside
    # execute); and the drafts the rule let a request propose this step (0: none, by the
    # batch-size rule; -1: no speculative decoding).
    num_drafted: list[int] = msgspec.field(default_factory=list)
    num_accepted: list[int] = msgspec.field(default_factory=list)
    propose_ns: int = 0
    num_spec_tokens: int = -1
    # LoRA (--enable-lora): the adapters of the step's rows, by name, once each ([]: none).
    loras: list[str] = msgspec.field(default_factory=list)


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One step's outputs for every request that produced something."""

    outputs: list[EngineCoreOutput] = msgspec.field(default_factory=list)
    step: StepRecord | None = None
    utility_result: UtilityResult | None = None
    # Set when the core is failing for good: the client raises EngineDeadError.
    engine_error: str | None = None
    # The core's start number under its server (0: the first core); the client drops
    # messages of another epoch (a dead core's late ones).
    epoch: int = 0
    # A heartbeat (nothing else set): for how long the core's loop has been busy in its
    # current iteration, ns (0: idle, waiting for input). The client's watchdog reads it.
    busy_ns: int | None = None


class EngineInfo(msgspec.Struct, array_like=True):
    """What the core reports once it is ready; clients adopt it."""

    model: str
    max_model_len: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    device: str
    version: str
    max_logprobs: int = 20  # the most a request may ask for; -1: no cap (--max-logprobs)
    # The warm-up's price of a step, [a, b, c] ns of execute = a + b * prefill tokens + c *
    # rows ([]: no warm-up); the diagnosis's prior (tracing.shares).
    step_prior: list[float] = msgspec.field(default_factory=list)
    # The KV groups (engine/kv_layout.py): each one's sliding window (0: it keeps every block),
    # and the layers in each ([] and 0: not told, one group of every layer).
    kv_windows: list[int] = msgspec.field(default_factory=list)
    kv_group_size: int = 0


class ReadyMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    """The core's first message: what it is, or why it could not start."""

    info: EngineInfo | None = None
    error: str | None = None
    error_type: str | None = None  # "ValueError" for a user error
