"""The frontend's tracer: cheap calls on the hot path, everything else on a writer thread.

The engine core only stamps instants into its outputs (StepRecord, received_ns).
``Tracer`` is the engine front's observer (engine/frontend.py: Enqueued, each
output batch, delivered, Finished, closed) and takes the server's own events
(tracing/events.py: Start, HttpFacts at close, Pause). Each call only appends a
typed event to a deque (no lock, no thread woken: the writer polls every few
ms while events come); the writer thread dispatches them by type, turns them
into spans and rows, appends them to the DuckDB store in batches, exports OTLP
and feeds the boundary and delivery metrics. Nothing here ever blocks serving:
a full store buffer or a slow collector drops data and counts it.
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from engine.background import name_os_thread
from engine.frontend import Enqueued, Finished
from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineInfo, FinishReason
from tracing.config import TracingConfig, replica_id, store_path
from tracing.emit_columns import with_emit_lists
from tracing.engine_rows import run_row, step_row
from tracing.events import Closed, Delivered, HttpFacts, Lifecycle, Outputs, Pause, Start
from tracing.ids import parse_traceparent
from tracing.otlp_records import WINDOW_NS, engine_spans, request_record_spans
from tracing.spans import (
    RequestTrace,
    Span,
    StepVisit,
    boundary_durations,
    build_request_row,
    child_rows,
    request_spans,
    root_attributes,
    step_spans,
)
from tracing.store import TraceStore, prepare_appends

logger = logging.getLogger(__name__)
_STOP = object()
# The writer's poll interval after an event, growing by this much a poll while none comes, up to
# MAX_POLL_S. Every wake costs both threads (the GIL changes hands), so a busy server's events
# are taken ~10 ms at a time: at 2 ms, the API process spent 3 us more per token at 64 streams.
POLL_S = 0.010
MAX_POLL_S = 0.050
# A flush costs 8-13 ms of CPU fixed (DuckDB's attach, an insert a table, the checkpoint at
# commit: each ~10-50 us a column) and ~0.45 us a token. Under load the next flush waits until
# the last one's CPU is FLUSH_CPU_SHARE of a core in the time since, up to MAX_FLUSH_STRETCH
# flush intervals: at 64 streams of the tiny model (16k tokens/s) the per-token part alone is
# 0.7% of a core, so flushes are 10 intervals apart. A pause in traffic (QUIET_POLLS polls
# without an event, 0.1 s) flushes what waits at the interval as ever.
FLUSH_CPU_SHARE = 0.005
MAX_FLUSH_STRETCH = 10
QUIET_POLLS = 4
BoundaryObserver = Callable[[str, Sequence[float]], None]  # a boundary's durations (s)
# A request's delivery: its last token's lag to the client's socket, and the time all its writes
# waited on that socket (a reader that paused mid-stream shows in the second), in seconds.
DeliveryObserver = Callable[[float, float], None]


@dataclass
class TracerStats:
    num_dropped_rows: int  # trace db rows lost to a full buffer
    num_dropped_spans: int  # OTLP spans lost (queue full or export failed)
    num_flushes: int = 0  # trace db flushes that wrote rows
    flush_cpu_s: float = 0.0  # the writer thread's CPU in them


class Tracer:
    def __init__(
        self,
        config: TracingConfig,
        info: EngineInfo,
        *,
        engine_config: Any = None,
        observe_boundary: BoundaryObserver | None = None,
        observe_delivery: DeliveryObserver | None = None,
        max_queued_events: int = 100_000,
        host: str | None = None,
        port: int | None = None,
        data_parallel_size: int = 1,
    ) -> None:
        """``host``, ``port``: the server's, for the default replica name (``replica_id``)
        and the GenAI metrics' server.address and server.port. ``data_parallel_size``: the
        engines whose outputs it observes (each request's and step's engine is recorded)."""
        self.config = config
        self.replica = replica_id(config, port)
        self.observe_delivery = observe_delivery
        self._handlers: dict[type, Callable[[Any], None]] = {
            Start: self._on_start, Enqueued: self._on_enqueued, Outputs: self._on_outputs,
            Delivered: self._on_delivered, list: self._on_delivered_many,
            Finished: self._on_finished, Closed: self._on_closed,
            Pause: self._on_pause, Lifecycle: self._on_lifecycle,
        }  # fmt: skip
        self.run_id = uuid.uuid4().hex[:16]
        self.block_size = info.block_size
        self.observe_boundary = observe_boundary
        # Bounded: if the writer falls behind, events are dropped and counted, never waited for.
        # A deque, not a queue.Queue: an append takes no lock and wakes no thread (the writer
        # polls), which matters at several events per token.
        self._events: collections.deque[Any] = collections.deque()
        self.max_queued_events = max_queued_events
        self.num_dropped_events = 0
        self.num_flushes, self.flush_cpu_s = 0, 0.0
        self._requests: dict[str, RequestTrace] = {}
        self._by_child: dict[str, tuple[RequestTrace, int]] = {}
        db = store_path(config, self.replica)
        self.store = TraceStore(db) if db else None
        from tracing.otlp import make_exporter  # the SDK loads only when tracing is on

        self.otlp = make_exporter(config, self.replica, self.run_id)
        # --otlp-detail store: every row the store gets travels as a span too.
        store_detail = self.otlp is not None and self.otlp.detail == "store"
        self._otlp_rows = self.otlp if store_detail else None
        self._keep_rows = self.store is not None or self._otlp_rows is not None
        self._slow_ns = int(config.otlp_keep_slower_than * 1e9)
        self._run_row = run_row(
            self.run_id, info, engine_config, config, self.replica, data_parallel_size
        )
        # The engine trace (WINDOW_NS) the run record was last sent into: the run's first.
        self._window = self._run_row[1] // WINDOW_NS
        self._add({"runs": [self._run_row]})
        from tracing.genai_metrics import make_genai_metrics

        model = os.path.basename(info.model.rstrip("/"))
        self.genai = make_genai_metrics(config, self.replica, model, host, port)
        # Each request's every step, as objects: only OTLP's per-step spans need them.
        self._keep_visits = self.otlp is not None and self.otlp.detail in ("boundary", "step")
        self._thread = threading.Thread(target=self._run, name="trace-writer", daemon=True)
        self._thread.start()

    # -- the frontend's side (FrontendObserver, and the server's calls): each only enqueues --

    def start(self, event: Start) -> None:
        """Optional HTTP metadata of a request, before it is handed to the engine."""
        self._put(event)

    def enqueued(self, event: Enqueued) -> None:
        self._put(event)

    def outputs(
        self, outs: EngineCoreOutputs, received_ns: int, acks: list[EngineCoreOutput]
    ) -> None:
        self._put(Outputs(outs, received_ns, acks))

    def delivered(self, request_id: str, ns: int) -> None:
        self._put(Delivered(request_id, ns))

    def delivered_many(self, deliveries: list[tuple[str, int]]) -> None:
        self._put(deliveries)  # one event for a batch: a list of (request id, instant)

    def finished(self, event: Finished) -> None:
        self._put(event)

    def closed(self, request_id: str, ns: int, http: HttpFacts | None = None) -> None:
        """The caller has the whole response: the request's trace is complete."""
        self._put(Closed(request_id, ns, http))

    def rejected(
        self, request_id: str, ns: int, error: str, http: HttpFacts | None = None,
        code: str | None = None,
    ) -> None:  # fmt: skip
        """A request refused before the engine saw it (``start`` must come first)."""
        self._put(Finished(request_id, "error", "error", ns, error, code))
        self._put(Closed(request_id, ns, http))

    def pause(self, event: Pause) -> None:
        self._put(event)

    def lifecycle(self, event: Lifecycle) -> None:
        """A drain, restart or crash loop of the server (service/lifecycle.py)."""
        self._put(event)

    def _put(self, event: Any) -> None:
        if len(self._events) < self.max_queued_events:
            self._events.append(event)
            return
        if not self.num_dropped_events:
            logger.error("trace writer is behind: dropping trace events (counted)")
        self.num_dropped_events += 1

    def stats(self) -> TracerStats:
        return TracerStats(
            num_dropped_rows=(self.store.num_dropped_rows if self.store else 0)
            + self.num_dropped_events,
            num_dropped_spans=self.otlp.num_dropped if self.otlp else 0,
            num_flushes=self.num_flushes,
            flush_cpu_s=self.flush_cpu_s,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish what is queued, flush the store, flush OTLP (bounded by ``timeout``)."""
        if not self._thread.is_alive():
            return
        self._events.append(_STOP)  # past the bound: shutdown is not the hot path
        self._thread.join(timeout)
        if self.otlp is not None:
            self.otlp.shutdown(timeout)
        if self.genai is not None:
            self.genai.shutdown(timeout)

    # -- the writer thread ---------------------------------------------------------

    def _run(self) -> None:
        name_os_thread()
        if self.store is not None:  # so that the first flush costs what the others do
            prepare_appends()
        interval = self.config.trace_flush_interval
        # Flushes are timed from the oldest row they hold, not from the last flush: traffic that
        # starts after a quiet spell has its first flush a wait later, not a nearly empty one at
        # once (a flush's cost is mostly fixed).
        oldest: float | None = None  # when the buffer last went from empty to holding rows
        events, handlers, idle, wait = self._events, self._handlers, 0, interval
        while True:
            if not events:  # poll: more often while events keep coming
                idle += 1
                time.sleep(min(POLL_S * idle, MAX_POLL_S))
            polled = time.monotonic()
            while events:
                idle = 0
                item = events.popleft()
                if item is _STOP:
                    self._flush(last=True)
                    if self.store is not None:
                        self.store.close()
                    return
                try:
                    handlers[type(item)](item)
                except Exception:
                    logger.exception("trace writer: %s failed", type(item).__name__)
                if oldest is not None and time.monotonic() - oldest >= wait:
                    break
            if oldest is None:
                if not self._holds_rows():
                    continue
                oldest = polled
            age = time.monotonic() - oldest
            quiet = idle >= QUIET_POLLS
            if age >= wait or (age >= interval and (quiet or self._crowded())):
                cpu = self._flush()
                if not quiet:  # a quiet spell's flush says nothing of the load: wait as before
                    wait = flush_wait(interval, cpu)
                oldest = time.monotonic() if self._holds_rows() else None  # kept: retried

    def _holds_rows(self) -> bool:
        return self.store is not None and self.store.num_buffered_rows > 0

    def _crowded(self) -> bool:
        """The store's buffer is half full: flush now rather than drop rows later."""
        return (
            self.store is not None
            and self.store.num_buffered_rows * 2 > self.store.max_buffered_rows
        )

    def _add(
        self, rows_by_table: dict[str, list[tuple[Any, ...]]], request_of: list[Any] | None = None
    ) -> None:
        """Engine-side rows (runs, steps, pauses, lifecycle) to the store and, at
        --otlp-detail store, to OTLP (``request_of``: a step's members' requests). Each engine
        trace gets the run's record too: a window imported alone has it."""
        if self.store is not None:
            self.store.add_all(rows_by_table)
        if self._otlp_rows is not None:
            spans = [
                span for table, rows in rows_by_table.items()
                for span in engine_spans(self.run_id, table, rows, request_of or ())
            ]  # fmt: skip
            window = spans[0].start_ns // WINDOW_NS if spans else self._window
            if window != self._window:
                self._window = window
                spans += engine_spans(self.run_id, "runs", [self._run_row],
                                      at_ns=spans[0].start_ns)  # fmt: skip
            self._otlp_rows.export_records(spans)

    def _flush(self, *, last: bool = False) -> float:
        """Flush the store; the CPU seconds it took (0 with nothing to write). A flush that
        could not write (the file busy) costs CPU too, but is not counted as one. ``last``:
        the writer's final one (TraceStore.flush)."""
        if self.store is None or not self.store.num_buffered_rows:
            return 0.0
        cpu, written = time.thread_time(), False
        try:
            written = self.store.flush(last=last)
        except Exception:
            logger.exception("trace db flush failed; its rows are kept for the next one")
        cpu = time.thread_time() - cpu
        self.num_flushes += written
        self.flush_cpu_s += cpu
        return cpu

    def _request(self, request_id: str, arrival_ns: int) -> RequestTrace:
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = RequestTrace(request_id, arrival_ns)
        return req

    def _on_start(self, e: Start) -> None:
        req = self._request(e.request_id, e.arrival_ns)
        req.endpoint, req.model, req.stream = e.endpoint, e.model, e.stream
        req.client_request_id = e.client_request_id
        req.http_start_ns, req.handler_ns = e.http_start_ns, e.handler_ns
        req.body_read_ns, req.body_bytes = e.body_read_ns, e.body_bytes
        if (parent := parse_traceparent(e.traceparent)) is not None:
            req.trace_id, req.parent_span_id = parent

    def _on_enqueued(self, e: Enqueued) -> None:
        req = self._request(e.request_id, e.arrival_ns)
        if e.attempt:  # sent again to a new core: sent_ns stays the first send
            req.resubmitted(e.sent_ns)
        else:
            req.sent_ns = e.sent_ns
        req.child_ids, req.prompt_token_ids, req.params = e.child_ids, e.prompt_token_ids, e.params
        req.priority, req.stream, req.engine = e.priority, e.stream, e.engine
        req.routed, req.lora_name = e.routed, e.lora_name
        for seq, child_id in enumerate(e.child_ids):
            self._by_child[child_id] = (req, seq)

    def _on_outputs(self, e: Outputs) -> None:
        by_child, received_ns = self._by_child, e.received_ns
        step = e.outs.step
        step_id = step.step_id if step is not None else None
        for out in [*e.acks, *e.outs.outputs]:
            found = by_child.get(out.request_id)
            if found is None:
                continue
            req, seq = found
            if out.received_ns and seq not in req.received_ns:
                req.received_ns[seq] = out.received_ns
            if out.grammar is not None and not req.grammar_ready_ns:
                req.grammar_ready_ns, req.grammar_compile_ns, req.grammar_cached = out.grammar
            if out.new_token_ids:
                if not req.first_token_ns:
                    req.first_token_ns = received_ns
                req.last_token_ns = received_ns
                req.output_tokens += len(out.new_token_ids)
                steps = req.emit_steps
                if step_id is not None and (not steps or steps[-1] != step_id):
                    steps.append(step_id)  # once per step, even for n > 1
                    req.emit_received.append(received_ns)
            if out.num_cached_tokens > req.cached_tokens:
                req.cached_tokens = out.num_cached_tokens
            if out.finish_reason is not None:
                freed = out.freed_ns or (step.update_end_ns if step is not None else 0)
                req.kv_freed_ns = max(req.kv_freed_ns, freed)
                if out.finish_reason == FinishReason.ERROR and out.error:
                    req.error = out.error
        if step is None:
            return
        if self._keep_rows:
            rows: dict[str, list[tuple[Any, ...]]] = {"steps": [step_row(self.run_id, step)]}
            if step.gc_pauses:
                rows["pauses"] = [
                    (self.run_id, "core", "gc", start, duration, f"gen{gen}", None)
                    for start, duration, gen in step.gc_pauses
                ]
            request_of = None
            if self._otlp_rows is not None:  # the request each member belongs to
                parents = [by_child[r][0].request_id if r in by_child else r for r in step.req_ids]
                if parents != list(step.req_ids):
                    request_of = [parents]
            self._add(rows, request_of)
        if self.observe_boundary is not None and not step.idle:  # once a step, not per row
            self.observe_boundary(
                "core.schedule", ((step.schedule_end_ns - step.schedule_start_ns) / 1e9,)
            )
            self.observe_boundary(
                "worker.execute", ((step.execute_end_ns - step.execute_start_ns) / 1e9,)
            )
            self.observe_boundary(
                "core.output", (max(0, step.output_ns - step.execute_end_ns) / 1e9,)
            )
        keep_visits, step_id, started = self._keep_visits, step.step_id, step.schedule_start_ns
        mask_ns = step.grammar_mask_ns  # every request in the step waited for the masks
        for rid, num_tokens in zip(step.req_ids, step.num_scheduled):
            found = by_child.get(rid)
            if found is not None:
                req, seq = found
                if seq not in req.first_steps:
                    req.first_steps[seq] = started
                    if req.first_step_id is None:
                        req.first_step_id = step_id
                req.last_step_id = step_id
                if mask_ns:
                    req.grammar_mask_ns += mask_ns
                if keep_visits:
                    req.visits.append(StepVisit(seq, step, num_tokens))
        for rid in step.preempted_req_ids:
            if (found := by_child.get(rid)) is not None:
                found[0].num_preemptions += 1

    def _on_delivered(self, e: Delivered) -> None:
        if (req := self._requests.get(e.request_id)) is not None:
            req.delivered(e.ns)

    def _on_delivered_many(self, deliveries: list[tuple[str, int]]) -> None:
        requests = self._requests
        for request_id, ns in deliveries:
            if (req := requests.get(request_id)) is not None:
                req.delivered(ns)

    def _on_finished(self, e: Finished) -> None:
        if (req := self._requests.get(e.request_id)) is not None and req.status is None:
            req.status, req.finish_reason, req.finished_ns = e.status, e.finish_reason, e.ns
            req.error, req.end_code = e.error or req.error, e.code

    def _on_pause(self, e: Pause) -> None:
        if self._keep_rows:
            self._add({"pauses": [
                (self.run_id, e.process, e.kind, e.start_ns, e.duration_ns, e.detail, e.cpu_ns)
            ]})  # fmt: skip

    def _on_lifecycle(self, e: Lifecycle) -> None:
        if self._keep_rows:
            self._add({"lifecycle": [(
                self.run_id, e.kind, e.cause, e.start_ns, e.end_ns, e.epoch, e.num_finished,
                e.num_failed, e.engine,
            )]})  # fmt: skip

    def _on_closed(self, e: Closed) -> None:
        req = self._requests.pop(e.request_id, None)
        if req is None:
            return
        for child_id in req.child_ids:
            self._by_child.pop(child_id, None)
        req.close(e.ns, e.http)
        # Built once (a request of several sequences gets random ids for theirs), and only where
        # they go somewhere: OTLP's request spans, or a store's rows for those sequences.
        export = self.otlp if self._otlp_rows is None else None  # OTLP's own request spans
        spans: list[Span] = []
        stored: list[Span] = []
        if export is not None or (self._keep_rows and len(req.child_ids) > 1):
            spans, stored = request_spans(req, self.run_id)
        if self._keep_rows:
            row = build_request_row(
                req, self.run_id, trace_prompts=self.config.trace_prompts,
                block_size=self.block_size,
            )  # fmt: skip
            children = child_rows(req, self.run_id)
            if self.store is not None:
                self.store.add_all({  # whole, or not at all; per-step spans are the steps' rows
                    "requests": [row], "span_rows": stored, "request_children": children,
                })  # fmt: skip
            if self._otlp_rows is not None:
                self._otlp_rows.export_records(request_record_spans(
                    with_emit_lists(row), root_attributes(req), stored, children,
                    slow_ns=self._slow_ns,
                ))  # fmt: skip
        if self.observe_boundary is not None:  # a request's emits: one call for them all
            by_name: dict[str, list[float]] = {}
            for name, ns in boundary_durations(req):
                by_name.setdefault(name, []).append(ns / 1e9)
            for name, seconds in by_name.items():
                self.observe_boundary(name, seconds)
        if self.observe_delivery is not None and req.last_token_ns:
            waited = req.http.send_wait_ns if req.http is not None else 0
            self.observe_delivery(
                max(0, req.last_delivered_ns - req.last_token_ns) / 1e9, waited / 1e9
            )
        if export is not None:
            export.export([*spans, *step_spans(req, self.run_id)])
        if self.genai is not None:
            self.genai.record(req)


def flush_wait(interval: float, cpu: float) -> float:
    """Seconds from a flush that took ``cpu`` seconds of CPU to the next one under load: at
    least ``interval``, and long enough that flushing takes FLUSH_CPU_SHARE of a core, but
    never more than MAX_FLUSH_STRETCH intervals."""
    return min(max(interval, cpu / FLUSH_CPU_SHARE), MAX_FLUSH_STRETCH * interval)
