"""What a diagnosis is made of: the parts a request's time is cut into, the rule's bars, and the
records `tracing.diagnose` fills in and `tracing.verdict`, `tracing.why`, `tracing.render` and
`replay` read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tracing.failures import LifecycleRow as LifecycleRow  # the lifecycle table's rows
from tracing.parts import EXPECTED_PARTS as EXPECTED_PARTS  # reported, never named a cause
from tracing.parts import phase_labels
from tracing.step_fit import MIN_CAUSE_NS as MIN_CAUSE_NS  # beside the step math that uses it

if TYPE_CHECKING:
    from tracing.failures import Failure
    from tracing.gaps import Gap

# What a request's time is made of, per phase: key -> its label in the phase's table (keys of
# RequestDiagnosis.ttft and .decode), from the registry in tracing.parts.
TTFT_PARTS = phase_labels("ttft")
DECODE_PARTS = phase_labels("decode")

# The verdict's rule (tracing.verdict): a part is named only when the time is large in absolute
# terms AND relative to the phase: at least MIN_CAUSE_NS and at least MIN_CAUSE_SHARE of the
# median request's phase time. "The tail" is the requests at or above TAIL_PERCENTILE.
MIN_CAUSE_SHARE = 0.10
TAIL_PERCENTILE = 90


@dataclass(frozen=True)
class Dominant:
    """The part that dominated a request (tracing.judge.dominant_part decides it)."""

    part: str
    phase: str  # ttft | decode: the phase it was judged in
    ns: int  # the request's time in it
    judged: bool  # named by the rule (beyond the run's median); else merely its largest part


@dataclass
class RequestDiagnosis:
    request_id: str
    status: str  # ok | aborted | error
    arrival_ns: int
    start_ns: int  # the first byte the server read (arrival_ns where not recorded)
    prompt_tokens: int
    output_tokens: int
    ttft_ns: int | None  # vLLM's meaning: arrival -> first output at the frontend
    delivered_ttft_ns: int | None  # first byte read -> first chunk accepted by the transport
    e2e_ns: int
    ttft: dict[str, int] = field(default_factory=dict)  # ns per TTFT_PARTS key
    decode: dict[str, int] = field(default_factory=dict)  # ns per DECODE_PARTS key
    gaps_ns: list[int] = field(default_factory=list)  # token gaps as delivered
    # Other requests whose prefill shared its steps: request id -> their prefill tokens there.
    neighbours: dict[str, int] = field(default_factory=dict)
    wait_reason: str | None = None  # the limit that held it in the queue
    num_preemptions: int = 0
    # Added: evidence the words quote.
    stream: bool = True
    end_ns: int = 0  # the last byte accepted (or finish / abort at the frontend)
    gap_step_ids: list[int | None] = field(default_factory=list)  # the step ending each gap
    # Per phase (ttft | decode): neighbour -> (its prefill tokens, the shared step ids).
    neighbour_steps: dict[str, dict[str, tuple[int, list[int]]]] = field(default_factory=dict)
    step_ids: list[int] = field(default_factory=list)  # every step it took part in
    send_wait_ns: int | None = None
    bytes_sent: int | None = None
    kv_freed_ns: int | None = None
    # The API process's work on it, as instants: decoding and validating its body (with the
    # body's size), and the chat template and tokenizer (handler to sent, less admission).
    body_bytes: int | None = None
    parse_span: tuple[int, int] | None = None
    frontend_span: tuple[int, int] | None = None
    weight: float = 1.0  # the requests of its run it stands for (a sampled import)
    long_gaps: list[Gap] = field(default_factory=list)  # tracing.gaps: cut into parts
    failure: Failure | None = None  # what ended it, where it did not finish
    resent_ns: int | None = None  # sent again to a new core after its first failed
    settings: tuple[str, ...] = ()  # what of its sampling is not plain greedy (grammar, ...)
    engine: int | None = None  # the data-parallel engine that served it
    routed: str | None = None  # why it went there: load, prefix, pinned, handed (None: alone)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    # Set by explain_request: the run's median per part (phase -> part -> ns; decode per token).
    run_medians: dict[str, dict[str, float]] = field(default_factory=dict)
    dominant: Dominant | None = None  # set once the run is judged

    @property
    def ttft_phase_ns(self) -> int:
        return sum(self.ttft.values())

    @property
    def decode_phase_ns(self) -> int:
        return sum(self.decode.values())


@dataclass
class Finding:
    """One sentence of a verdict."""

    kind: str  # cause (beyond the threshold) | paid (every request) | step | info
    text: str
    ms: float = 0.0
    part: str | None = None
    request_ids: list[str] = field(default_factory=list)
    section: str = "causes"  # causes | paid | steps | cancellations | lifecycle | ...
    label: str | None = None  # what "Largest first" calls it, where not its part's words
    phase: str | None = None  # ttft | decode: a part's finding, of the phase it was paid in


@dataclass
class StepFacts:
    step_id: int
    start_ns: int
    end_ns: int
    schedule_ns: int
    execute_ns: int
    output_ns: int
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    preemptions: int
    kv_blocks_used: int
    kv_blocks_total: int
    idle: bool
    wait_reason: str | None
    rows: int = 0  # requests in the batch
    build_ns: int | None = None  # building outputs (update_end - execute_end), where recorded
    gc_pause_ns: int = 0
    grammar_mask_ns: int = 0  # structured outputs' token masks (inside schedule_ns)
    # Inside execute_ns: the sampler on the full logits, and logprobs (for logprobs_rows rows,
    # at most max_logprobs per token). The rest is the forward.
    sample_ns: int = 0
    logprobs_ns: int = 0
    logprobs_rows: int = 0
    max_logprobs: int = 0
    # Speculative decoding's part of execute: the proposer's time and the refused drafts'
    # share of the forward (tracing/diagnose_load.py).
    spec_ns: int = 0
    drafted: int = 0  # drafts its rows verified, and of them kept
    kept: int = 0
    spec_tokens: int = -1  # drafts a request could propose in it (0: the rule let none; -1: off)
    # The context of its rows that decode for the first time since their prompt was computed
    # (tracing.stalls.join_tokens): on CPU, copied into the decode mirror in this step.
    join_tokens: int = 0

    @property
    def full_rows(self) -> int:
        """Its rows where it took the full logits (the sampler ran), else 0."""
        return (self.rows or self.running) if self.sample_ns else 0

    @property
    def forward_ns(self) -> int:
        """The model's forward: execute less the sampler, logprobs and the core's GC pauses
        in the step (where in the step they fell is not recorded: the forward is most of it)."""
        return max(self.execute_ns - self.sample_ns - self.logprobs_ns - self.spec_ns
                   - self.gc_pause_ns, 0)  # fmt: skip


@dataclass
class PartStat:
    """One part over a phase's requests (ns; the decode phase per output token).
    ``tail_paid_ns``: what the tail's requests paid beyond the median, each over its own
    tokens (their mean; the TTFT phase: ``tail_extra_ns``). A 2-token request's one slow gap
    is 7 ms a token over the median, and it paid 7 ms, not 7 ms times another request's 500
    tokens."""

    median_ns: float
    tail_extra_ns: float
    tail_paid_ns: float = 0.0


@dataclass
class RunDiagnosis:
    run_id: str
    requests: list[RequestDiagnosis]
    steps: list[StepFacts]
    # ttft_s, delivered_ttft_s, tpot_s, itl_s, e2e_s -> p50/p90/p99/max (seconds): the one set of
    # numbers the table, the text and the page all use.
    summary: dict[str, dict[str, float]]
    findings: list[Finding]  # empty of causes: "nothing stands out"
    num_ok: int = 0
    num_aborted: int = 0
    num_error: int = 0
    # phase (ttft | decode) -> part -> median and the tail's extra; decode per output token.
    parts: dict[str, dict[str, PartStat]] = field(default_factory=dict)
    phase_median_ns: dict[str, float] = field(default_factory=dict)
    # step id -> the requests prefilling in it and their tokens there.
    prefill_members: dict[int, list[tuple[str, int]]] = field(default_factory=dict)
    pauses: list[tuple[str, str, int, int]] = field(default_factory=list)  # process, kind, ns
    api_busy: list[tuple[int, int]] = field(default_factory=list)  # the API process on CPU
    step_prior: list[float] | None = None  # the warm-up's price of a step (tracing.shares)
    lifecycle: list[LifecycleRow] = field(default_factory=list)  # the server's drains, restarts
    stream_interval: int = 1  # tokens a write took (--stream-interval): ITL is between writes
    replica: str | None = None  # the replica that recorded it (a fleet's store names it)


def percentiles(values: list[float], weights: list[float] | None = None) -> dict[str, float]:
    """p50, p90, p99 and max; with ``weights`` (the requests each value stands for, in a
    sampled window) the weighted ones: the smallest value whose share of the weight reaches p."""
    if not values:
        return {}
    a = np.asarray(values, dtype=float)
    if weights is None or len(set(weights)) <= 1:
        p50, p90, p99 = np.percentile(a, [50, 90, 99])
    else:
        order = np.argsort(a, kind="stable")
        a = a[order]
        cum = np.cumsum(np.asarray(weights, dtype=float)[order])
        at = np.searchsorted(cum, np.array([0.5, 0.9, 0.99]) * cum[-1])
        p50, p90, p99 = a[np.minimum(at, len(a) - 1)]
    return {"p50": float(p50), "p90": float(p90), "p99": float(p99), "max": float(a.max())}


def summarize(requests: list[RequestDiagnosis]) -> dict[str, dict[str, float]]:
    ok = [r for r in requests if r.status == "ok"]
    sampled = any(r.weight != 1.0 for r in requests)

    def pct(pairs: list[tuple[float, float]]) -> dict[str, float]:
        return percentiles([v for v, _ in pairs], [w for _, w in pairs] if sampled else None)

    tpot = [
        ((r.e2e_ns - r.ttft_ns) / (r.output_tokens - 1) / 1e9, r.weight)
        for r in ok
        if r.ttft_ns is not None and r.output_tokens >= 2
    ]
    delivered = [
        (r.delivered_ttft_ns / 1e9, r.weight) for r in requests if r.delivered_ttft_ns is not None
    ]
    return {
        "ttft_s": pct([(r.ttft_ns / 1e9, r.weight) for r in requests if r.ttft_ns is not None]),
        "delivered_ttft_s": pct(delivered),
        "tpot_s": pct(tpot),
        "itl_s": pct([(g / 1e9, r.weight) for r in requests for g in r.gaps_ns]),
        "e2e_s": pct([(r.e2e_ns / 1e9, r.weight) for r in ok]),
    }
