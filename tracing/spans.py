"""What the trace writer knows of one request, and the rows and spans it becomes.

Spans follow DESIGN §3 (instants per the clock rule in engine/messages.py):

    llm_request       the first byte the server read (arrival offline) -> response closed
    frontend.enqueue  arrival -> handed to the engine client (parse, template, tokenize)
    core.receive      handed to the client -> the core dequeued it
    core.queue        dequeued -> its first step began (waiting for a slot, blocks or budget)
    core.schedule     per step: step began -> decision
    worker.execute    per step: forward + sampling of the batch
    core.output       per step: execute end -> outputs left the core
    frontend.emit     per step with output: outputs received -> delivered to the caller
                      (non-streamed: one span, the final response)
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import msgspec

from engine.messages import StepRecord
from tracing.emit_columns import closes_write, emits_of
from tracing.events import HttpFacts
from tracing.ids import new_span_id, new_trace_id

BOUNDARIES = (
    "frontend.enqueue",
    "core.receive",
    "core.queue",
    "core.schedule",
    "worker.execute",
    "core.output",
    "frontend.emit",
)
ROOT = "llm_request"
_encode = msgspec.json.encode


class Span(NamedTuple):
    """One row of the spans table (store_schema.SPAN_COLUMNS, in order)."""

    run_id: str
    request_id: str
    trace_id: str
    span_id: str
    parent_span_id: str | None
    name: str
    start_ns: int
    end_ns: int
    step_id: int | None
    attributes: str  # JSON


@dataclass
class StepVisit:
    """One step a core request took part in (the step's record is shared, not copied)."""

    seq: int  # which of the request's n sequences
    step: StepRecord
    num_tokens: int


@dataclass
class RequestTrace:
    request_id: str
    arrival_ns: int
    endpoint: str = "generate"
    model: str = ""
    stream: bool = True
    client_request_id: str | None = None
    trace_id: str = field(default_factory=new_trace_id)
    root_span_id: str = field(default_factory=new_span_id)
    parent_span_id: str | None = None  # from an incoming traceparent
    http_start_ns: int = 0  # the first byte the server read (0: not over HTTP)
    handler_ns: int = 0
    body_read_ns: int = 0  # the body read whole; JSON decoded and validated to handler_ns
    body_bytes: int = 0
    http: HttpFacts | None = None  # what the HTTP layer measured, at close
    # Set when it is handed to the engine.
    sent_ns: int = 0
    child_ids: list[str] = field(default_factory=list)
    prompt_token_ids: list[int] = field(default_factory=list)
    params: Any = None
    priority: int = 0
    # What the engine's outputs tell.
    received_ns: dict[int, int] = field(default_factory=dict)  # per seq
    # The steps it took part in: per sequence when its first began, the first and last step
    # ids, and (only where OTLP exports per-step spans) every visit.
    first_steps: dict[int, int] = field(default_factory=dict)
    first_step_id: int | None = None
    last_step_id: int | None = None
    visits: list[StepVisit] = field(default_factory=list)
    # Its emits, one per step that gave it tokens: the step, when the frontend received them, and
    # when they were delivered to the caller. Three flat lists, appended to once per emit (a
    # tuple per emit cost twice as much); emit_delivered is shorter while emits wait.
    emit_steps: list[int] = field(default_factory=list)
    emit_received: list[int] = field(default_factory=list)
    emit_delivered: list[int] = field(default_factory=list)
    first_token_ns: int = 0
    last_token_ns: int = 0
    kv_freed_ns: int = 0
    output_tokens: int = 0
    # Structured outputs: the grammar's first-output facts (engine EngineCoreOutput.grammar), and
    # the token-mask time of every step it took part in (its own grammar's or its neighbours').
    grammar_ready_ns: int = 0
    grammar_compile_ns: int = 0
    grammar_cached: bool = False
    grammar_mask_ns: int = 0
    cached_tokens: int = 0
    num_preemptions: int = 0
    # The end.
    status: str | None = None  # ok | aborted | error
    finish_reason: str | None = None
    error: str | None = None
    end_code: str | None = None  # what ended it, where it did not finish (Finished.code)
    finished_ns: int = 0
    resent_ns: int = 0  # sent again to a new core (Enqueued.attempt > 0): the last such send
    engine: int | None = None  # the data-parallel engine it was last sent to (None: never)
    routed: str | None = None  # why it went there (engine.data_parallel's Routed)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)

    def resubmitted(self, sent_ns: int) -> None:
        """Sent again to a new core, having sent its caller nothing: what the failed core did
        of it is lost work, and the new core's outputs tell its story from here."""
        self.resent_ns = sent_ns
        self.received_ns, self.first_steps, self.visits = {}, {}, []
        self.first_step_id = self.last_step_id = None
        self.emit_steps, self.emit_received, self.emit_delivered = [], [], []
        self.first_token_ns = self.last_token_ns = self.kv_freed_ns = self.output_tokens = 0
        self.grammar_ready_ns = self.grammar_compile_ns = self.grammar_mask_ns = 0
        self.grammar_cached = False

    def delivered(self, ns: int) -> None:
        if self.stream:
            delivered = self.emit_delivered
            waiting = len(self.emit_steps) - len(delivered)
            if waiting == 1:
                delivered.append(ns)
            elif waiting:
                delivered += [ns] * waiting

    @property
    def start_ns(self) -> int:
        """Where the recorded life starts: the first byte read, else the arrival."""
        return min(self.http_start_ns or self.arrival_ns, self.arrival_ns)

    @property
    def first_delivered_ns(self) -> int:
        if self.http is not None and self.http.first_delivered_ns:
            return self.http.first_delivered_ns
        return self.emit_delivered[0] if self.emit_delivered else 0

    @property
    def last_delivered_ns(self) -> int:
        if self.http is not None and self.http.last_delivered_ns:
            return self.http.last_delivered_ns
        return self.finished_ns

    def close(self, ns: int, http: HttpFacts | None = None) -> None:
        self.http = http
        if len(self.emit_steps) > len(self.emit_delivered):
            if self.stream:
                self.delivered(ns)
            else:  # the one write of the final response: its last emit
                del self.emit_steps[:-1], self.emit_received[:-1]
                self.emit_delivered[:] = [ns]
        if self.status is None:
            self.status, self.finish_reason = "error", "error"
            self.error = self.error or "the request ended without finishing"
        self.finished_ns = max(self.finished_ns, ns)


# Boundaries numbered as in their span ids (span_id_of) and the spans view.
BOUNDARY_CODES = {
    "core.schedule": 1, "worker.execute": 2, "core.output": 3, "frontend.emit": 4,
    "frontend.enqueue": 5, "core.receive": 6, "core.queue": 7, "core.grammar": 8,
}  # fmt: skip
GRAMMAR_SPAN = "core.grammar"  # dequeued -> its grammar compiled (structured outputs only)


def span_id_of(root_span_id: str, name: str, step_id: int = -1, seq: int = 0) -> str:
    """A span's id: its root's XOR (step id + 1, sequence, boundary). The store keeps no row
    for it (store_views.SPANS_VIEW derives the same id), so OTLP and SQL agree without storing 8
    random bytes per span."""
    mix = ((step_id + 1) << 16) | (seq << 4) | BOUNDARY_CODES[name]
    return format(int(root_span_id, 16) ^ mix, "016x")


def request_spans(req: RequestTrace, run_id: str) -> tuple[list[Span], list[Span]]:
    """The request's own spans (the root, frontend.enqueue, per sequence core.receive and
    core.queue), and those of them the store keeps as rows: the per-sequence ones of a request
    that ran as several (the view derives the rest from the request row)."""
    rows: list[Span] = []
    stored: list[Span] = []
    trace_id, root, rid = req.trace_id, req.root_span_id, req.request_id
    multi = len(req.child_ids) > 1

    def add(name: str, start: int, end: int, seq: int | None = None) -> None:
        if seq is None:
            span_id, attrs = span_id_of(root, name), "{}"
        else:
            span_id, attrs = new_span_id(), _encode({"seq": seq}).decode()
        span = Span(run_id, rid, trace_id, span_id, root, name, start, max(start, end), None,
                    attrs)  # fmt: skip
        rows.append(span)
        if seq is not None:
            stored.append(span)

    end = max(req.finished_ns, req.arrival_ns)
    rows.append(Span(run_id, rid, trace_id, root, req.parent_span_id, ROOT, req.start_ns, end,
                     None, _encode(root_attributes(req)).decode()))  # fmt: skip
    add("frontend.enqueue", req.arrival_ns, req.sent_ns or end)
    for seq, received in sorted(req.received_ns.items()):
        add("core.receive", req.sent_ns or received, received, seq if multi else None)
    for seq, first in sorted(req.first_steps.items()):
        received = req.received_ns.get(seq, first)
        add("core.queue", received, first, seq if multi else None)
    if req.grammar_ready_ns and (grammar_from := req.received_ns.get(0)):
        add(GRAMMAR_SPAN, grammar_from, req.grammar_ready_ns, 0 if multi else None)
        span = rows[-1]
        rows[-1] = span._replace(attributes=_encode(grammar_attributes(req)).decode())
        if multi:
            stored[-1] = rows[-1]
    return rows, stored


def grammar_kind(req: RequestTrace) -> str | None:
    so = getattr(req.params, "structured_outputs", None)
    return so.kind or None if so is not None else None


def grammar_attributes(req: RequestTrace) -> dict[str, Any]:
    return {
        "lumen.grammar": grammar_kind(req),
        "lumen.grammar.compile_ns": req.grammar_compile_ns,
        "lumen.grammar.cached": req.grammar_cached,
    }


def step_spans(req: RequestTrace, run_id: str) -> list[Span]:
    """The per-step spans (for OTLP; the store derives them: store_views.SPANS_VIEW)."""
    rows: list[Span] = []
    trace_id, root, rid = req.trace_id, req.root_span_id, req.request_id
    multi = len(req.child_ids) > 1

    def add(name: str, start: int, end: int, step: int, seq: int, attrs: str) -> None:
        rows.append(Span(run_id, rid, trace_id, span_id_of(root, name, step, seq), root, name,
                         start, max(start, end), step, attrs))  # fmt: skip

    for v in req.visits:
        s = v.step
        attrs = {"tokens": v.num_tokens, "seq": v.seq} if multi else {"tokens": v.num_tokens}
        text = _encode(attrs).decode()
        add("core.schedule", s.schedule_start_ns, s.schedule_end_ns, s.step_id, v.seq, text)
        add("worker.execute", s.execute_start_ns, s.execute_end_ns, s.step_id, v.seq, text)
        add("core.output", s.execute_end_ns, s.output_ns, s.step_id, v.seq, text)
    for step, recv, delivered in zip(req.emit_steps, req.emit_received, req.emit_delivered):
        add("frontend.emit", recv, delivered, step, 0, "{}")
    return rows


def build_spans(req: RequestTrace, run_id: str) -> list[Span]:
    """Every span of the request, root first."""
    return [*request_spans(req, run_id)[0], *step_spans(req, run_id)]


def boundary_durations(req: RequestTrace) -> list[tuple[str, int]]:
    """(boundary, ns) for the request's own boundaries and its emits, without building spans
    (the per-step boundaries are observed once per step: tracing.recorder)."""
    out = [("frontend.enqueue", max(0, (req.sent_ns or req.finished_ns) - req.arrival_ns))]
    out += [("core.receive", max(0, r - (req.sent_ns or r))) for r in req.received_ns.values()]
    out += [
        ("core.queue", max(0, first - req.received_ns.get(seq, first)))
        for seq, first in req.first_steps.items()
    ]
    # Once per write (emit_columns.closes_write): the wait of the step that sent it.
    delivered = req.emit_delivered
    out += [
        ("frontend.emit", max(0, at - recv))
        for recv, at, last in zip(req.emit_received, delivered, closes_write(delivered))
        if last
    ]
    return out


def root_attributes(req: RequestTrace) -> dict[str, Any]:
    """OpenTelemetry GenAI attribute names, as vLLM uses them."""
    p = req.params
    attrs: dict[str, Any] = {
        "gen_ai.request.id": req.request_id,
        "gen_ai.request.model": req.model,  # the name asked for: a LoRA adapter's, or the base's
        "gen_ai.response.model": req.model,
        "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
        "gen_ai.usage.output_tokens": req.output_tokens,
        # The deprecated names they replace, kept for one release more.
        "gen_ai.usage.prompt_tokens": len(req.prompt_token_ids),
        "gen_ai.usage.completion_tokens": req.output_tokens,
        "gen_ai.latency.e2e": (req.finished_ns - req.arrival_ns) / 1e9,
        "lumen.endpoint": req.endpoint,
        "lumen.status": req.status,
        "lumen.stream": req.stream,
    }
    if req.finish_reason is not None:
        attrs["gen_ai.response.finish_reasons"] = [req.finish_reason]
    if req.first_token_ns:
        attrs["gen_ai.latency.time_to_first_token"] = (req.first_token_ns - req.arrival_ns) / 1e9
    if req.stream and (first_delivered := req.first_delivered_ns):
        attrs["lumen.delivered_ttft"] = (first_delivered - req.start_ns) / 1e9
    if p is not None:
        attrs["gen_ai.request.max_tokens"] = p.max_tokens
        attrs["gen_ai.request.temperature"] = p.temperature
        attrs["gen_ai.request.top_p"] = p.top_p
        attrs["gen_ai.request.n"] = p.n
    if (kind := grammar_kind(req)) is not None:
        attrs["lumen.grammar"] = kind
        attrs["lumen.grammar.compile_s"] = req.grammar_compile_ns / 1e9
        attrs["lumen.grammar.cached"] = req.grammar_cached
    if req.grammar_mask_ns:
        attrs["lumen.grammar.mask_s"] = req.grammar_mask_ns / 1e9
    if phase := slowest_phase(req):
        attrs["lumen.slowest_phase"] = phase
    if req.client_request_id:
        attrs["lumen.client_request_id"] = req.client_request_id
    if req.error:
        attrs["lumen.error"] = req.error
    if req.lora_name is not None:
        attrs["lumen.lora_name"] = req.lora_name
    return attrs


def slowest_phase(req: RequestTrace) -> str | None:
    """Where most of the request's time went, by phase, from what the trace writer holds at its
    close (a first answer on dashboards; `lumen trace why` weighs it against its run)."""
    http = req.http
    admission = http.admission_wait_ns if http is not None else 0
    received = min(req.received_ns.values(), default=0)
    first_step = min(req.first_steps.values(), default=0)
    queue = first_step - received if first_step and received else 0
    parts = {
        "admission": admission,
        "frontend": req.sent_ns - req.start_ns - admission if req.sent_ns else 0,
        "grammar compile": req.grammar_compile_ns,
        "queue": queue - req.grammar_compile_ns,
        "prefill": req.first_token_ns - first_step if req.first_token_ns and first_step else 0,
        "decode": req.last_token_ns - req.first_token_ns if req.first_token_ns else 0,
        "delivery": http.send_wait_ns if http is not None else 0,
    }
    phase, ns = max(parts.items(), key=lambda kv: kv[1])
    return phase if ns > 0 else None


def build_request_row(
    req: RequestTrace, run_id: str, *, trace_prompts: str, block_size: int
) -> tuple[Any, ...]:
    """The request's row (columns of store_schema.REQUEST_COLUMNS)."""
    first_schedule = min(req.first_steps.values(), default=0)  # the end of its queue wait
    received = min(req.received_ns.values(), default=0)
    http = req.http or HttpFacts()
    first_delivered = req.first_delivered_ns
    first_step = req.first_step_id
    # The same in all three emit columns' places: the flush builds them (tracing.emit_columns).
    emits = emits_of(req.emit_steps, req.emit_received, req.emit_delivered, first_step or 0,
                     req.arrival_ns)  # fmt: skip
    hashes = tokens = None
    if trace_prompts == "hashes" and req.prompt_token_ids:
        hashes = block_hashes(req.prompt_token_ids, block_size)
    elif trace_prompts == "tokens":
        tokens = req.prompt_token_ids
    return (
        run_id,
        req.request_id,
        req.trace_id,
        req.root_span_id,
        req.client_request_id,
        req.endpoint,
        req.model,
        req.arrival_ns,
        len(req.prompt_token_ids),
        req.output_tokens,
        req.cached_tokens,
        req.num_preemptions,
        _params_json(req.params),
        req.stream,
        req.priority,
        req.finish_reason,
        req.status,
        req.error,
        req.first_token_ns - req.arrival_ns if req.first_token_ns else None,
        req.finished_ns - req.arrival_ns,
        first_schedule - received if first_schedule and received else None,
        block_size if hashes is not None else None,
        hashes,
        tokens,
        req.http_start_ns or None,
        req.handler_ns or None,
        req.sent_ns or None,
        received or None,
        first_schedule or None,
        http.admission_wait_ns if req.http is not None else None,
        first_delivered or None,
        req.last_delivered_ns or None,
        # A whole response's one write is no first token to its client: streams only.
        first_delivered - req.start_ns if first_delivered and req.stream else None,
        http.send_wait_ns if req.http is not None else None,
        http.bytes_sent if req.http is not None else None,
        req.kv_freed_ns or None,
        req.parent_span_id,
        first_step,
        req.last_step_id,
        emits,
        emits,
        emits,
        grammar_kind(req),
        req.grammar_ready_ns or None,
        req.grammar_compile_ns if req.grammar_ready_ns else None,
        req.grammar_cached if req.grammar_ready_ns else None,
        req.grammar_mask_ns or None,
        req.body_bytes if req.body_read_ns else None,
        req.body_read_ns or None,
        None,  # sample_weight: only a store rebuilt from a sampled window has one
        req.end_code,
        req.resent_ns or None,
        req.engine,
        req.routed,
        req.lora_name,
    )


def _params_json(params: Any) -> str | None:
    """The sampling parameters as the requests row keeps them: without the compiled grammar
    (the schema, regex or grammar it came from is kept, which is what replay needs)."""
    if params is None:
        return None
    so = getattr(params, "structured_outputs", None)
    if so is not None and so.spec:
        params = params.clone(structured_outputs=msgspec.structs.replace(so, spec=""))
    return _encode(params).decode()


def child_rows(req: RequestTrace, run_id: str) -> list[tuple[Any, ...]]:
    """request_children rows: the core ids that are not the request id itself."""
    return [
        (run_id, child, req.request_id, seq)
        for seq, child in enumerate(req.child_ids)
        if child != req.request_id
    ]


def block_hashes(token_ids: list[int], block_size: int) -> list[int]:
    """A chained 63-bit hash per block (the last one may be partial): equal prefixes give equal
    leading hashes, as in the prefix cache, so replay can share the same prefixes again. A
    block hashes its ids as 4-byte little-endian integers, after its parent's digest."""
    out: list[int] = []
    parent = b""
    data = struct.pack(f"<{len(token_ids)}I", *token_ids)
    step = 4 * block_size
    for start in range(0, len(data), step):
        digest = hashlib.blake2b(parent + data[start : start + step], digest_size=8).digest()
        out.append(int.from_bytes(digest, "little") >> 1)
        parent = digest
    return out
