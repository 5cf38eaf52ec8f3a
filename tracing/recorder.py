"""The frontend's tracer: cheap calls on the hot path, everything else on a writer thread.

The engine core only stamps instants into its outputs (StepRecord, received_ns).
Frontends (AsyncLLM, LLM) hand each output batch and a few lifecycle events to
``Tracer``, which only puts them on a queue. The writer thread turns them into
spans and rows, appends them to the DuckDB store in batches, exports OTLP and
feeds the boundary-latency metric. Nothing here ever blocks serving: a full
store buffer or a slow collector drops data and counts it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineInfo, FinishReason
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tracing.config import TracingConfig
from tracing.ids import parse_traceparent
from tracing.spans import (
    RequestTrace,
    StepVisit,
    build_request_row,
    build_spans,
)
from tracing.store import TraceStore

logger = logging.getLogger(__name__)
_STOP = object()
BoundaryObserver = Callable[[str, float], None]


@dataclass
class TracerStats:
    num_dropped_rows: int  # trace db rows lost to a full buffer
    num_dropped_spans: int  # OTLP spans lost (queue full or export failed)


class Tracer:
    def __init__(
        self,
        config: TracingConfig,
        info: EngineInfo,
        *,
        engine_config: Any = None,
        observe_boundary: BoundaryObserver | None = None,
        max_queued_events: int = 100_000,
    ) -> None:
        self.config = config
        self.run_id = uuid.uuid4().hex[:16]
        self.block_size = info.block_size
        self.observe_boundary = observe_boundary
        # Bounded: if the writer falls behind, events are dropped and counted, never waited for.
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max_queued_events)
        self.num_dropped_events = 0
        self._requests: dict[str, RequestTrace] = {}
        self._by_child: dict[str, tuple[RequestTrace, int]] = {}
        db = config.db_path
        self.store = TraceStore(db) if db else None
        if self.store is not None:
            self.store.add("runs", [_run_row(self.run_id, info, engine_config, config)])
        from tracing.otlp import make_exporter  # the SDK loads only when tracing is on

        self.otlp = make_exporter(config)
        self._thread = threading.Thread(target=self._run, name="lumen-trace-writer", daemon=True)
        self._thread.start()

    # -- the frontend's side: each call only enqueues --------------------------------

    def start(
        self,
        request_id: str,
        *,
        arrival_ns: int,
        endpoint: str,
        model: str,
        stream: bool,
        traceparent: str | None = None,
        client_request_id: str | None = None,
    ) -> None:
        """Optional metadata of a request, before it is handed to the engine."""
        self._put(
            ("start", request_id, arrival_ns, endpoint, model, stream, traceparent,
             client_request_id)
        )  # fmt: skip

    def enqueued(
        self,
        request_id: str,
        child_ids: list[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        arrival_ns: int,
        sent_ns: int,
        stream: bool,
    ) -> None:
        self._put(
            ("enqueued", request_id, child_ids, prompt_token_ids, params, priority, arrival_ns,
             sent_ns, stream)
        )  # fmt: skip

    def outputs(
        self, outs: EngineCoreOutputs, received_ns: int, acks: list[EngineCoreOutput]
    ) -> None:
        self._put(("outputs", outs, received_ns, acks))

    def delivered(self, request_id: str, ns: int) -> None:
        self._put(("delivered", request_id, ns))

    def finished(
        self, request_id: str, status: str, finish_reason: str, ns: int, error: str | None = None
    ) -> None:
        self._put(("finished", request_id, status, finish_reason, ns, error))

    def request_done(self, result: RequestOutput, ns: int) -> None:
        """``finished`` for a request whose final output came back."""
        errors = [c.error for c in result.outputs if c.error]
        reasons = [c.finish_reason for c in result.outputs if c.finish_reason]
        status, error = ("error", errors[0]) if errors else ("ok", None)
        self.finished(result.request_id, status, reasons[0] if reasons else "stop", ns, error)

    def closed(self, request_id: str, ns: int) -> None:
        """The caller has the whole response: the request's trace is complete."""
        self._put(("closed", request_id, ns))

    def rejected(self, request_id: str, ns: int, error: str) -> None:
        """A request refused before the engine saw it (``start`` must come first)."""
        self._put(("finished", request_id, "error", "error", ns, error))
        self._put(("closed", request_id, ns))

    def _put(self, event: Any) -> None:
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            if not self.num_dropped_events:
                logger.error("trace writer is behind: dropping trace events (counted)")
            self.num_dropped_events += 1

    def stats(self) -> TracerStats:
        return TracerStats(
            num_dropped_rows=(self.store.num_dropped_rows if self.store else 0)
            + self.num_dropped_events,
            num_dropped_spans=self.otlp.num_dropped if self.otlp else 0,
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Finish what is queued, flush the store, flush OTLP (bounded by ``timeout``)."""
        if not self._thread.is_alive():
            return
        self._queue.put(_STOP)  # waits for room: shutdown is not the hot path
        self._thread.join(timeout)
        if self.otlp is not None:
            self.otlp.shutdown(timeout)

    # -- the writer thread ---------------------------------------------------------

    def _run(self) -> None:
        interval = self.config.trace_flush_interval
        next_flush = time.monotonic() + interval
        while True:
            try:
                item = self._queue.get(timeout=max(0.0, next_flush - time.monotonic()))
            except queue.Empty:
                item = None
            if item is _STOP:
                break
            if item is not None:
                try:
                    getattr(self, "_on_" + item[0])(*item[1:])
                except Exception:
                    logger.exception("trace writer: %s failed", item[0])
            if time.monotonic() >= next_flush:
                next_flush = time.monotonic() + interval
                self._flush()
        self._flush()
        if self.store is not None:
            self.store.close()

    def _flush(self) -> None:
        if self.store is not None:
            try:
                self.store.flush()
            except Exception:
                logger.exception("trace db flush failed; its rows are kept for the next one")

    def _request(self, request_id: str, arrival_ns: int) -> RequestTrace:
        req = self._requests.get(request_id)
        if req is None:
            req = self._requests[request_id] = RequestTrace(request_id, arrival_ns)
        return req

    def _on_start(
        self,
        request_id: str,
        arrival_ns: int,
        endpoint: str,
        model: str,
        stream: bool,
        traceparent: str | None,
        client_request_id: str | None,
    ) -> None:
        req = self._request(request_id, arrival_ns)
        req.endpoint, req.model, req.stream = endpoint, model, stream
        req.client_request_id = client_request_id
        if (parent := parse_traceparent(traceparent)) is not None:
            req.trace_id, req.parent_span_id = parent

    def _on_enqueued(
        self,
        request_id: str,
        child_ids: list[str],
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_ns: int,
        sent_ns: int,
        stream: bool,
    ) -> None:
        req = self._request(request_id, arrival_ns)
        req.child_ids, req.prompt_token_ids, req.params = child_ids, prompt_token_ids, params
        req.priority, req.sent_ns, req.stream = priority, sent_ns, stream
        for seq, child_id in enumerate(child_ids):
            self._by_child[child_id] = (req, seq)

    def _on_outputs(
        self, outs: EngineCoreOutputs, received_ns: int, acks: list[EngineCoreOutput]
    ) -> None:
        by_child = self._by_child
        step = outs.step
        step_id = step.step_id if step is not None else None
        for out in [*acks, *outs.outputs]:
            found = by_child.get(out.request_id)
            if found is None:
                continue
            req, seq = found
            if out.received_ns and seq not in req.received_ns:
                req.received_ns[seq] = out.received_ns
            if out.new_token_ids:
                if not req.first_token_ns:
                    req.first_token_ns = received_ns
                req.output_tokens += len(out.new_token_ids)
                if step_id is not None and (
                    not req.pending_emits or req.pending_emits[-1][0] != step_id
                ):  # once per step, even for n > 1
                    req.pending_emits.append((step_id, received_ns))
            req.cached_tokens = max(req.cached_tokens, out.num_cached_tokens)
            if out.finish_reason == FinishReason.ERROR and out.error:
                req.error = out.error
        if step is None:
            return
        if self.store is not None:
            self.store.add("steps", [_step_row(self.run_id, step)])
        for rid, num_tokens in zip(step.req_ids, step.num_scheduled):
            found = by_child.get(rid)
            if found is not None:
                found[0].visits.append(StepVisit(found[1], step, num_tokens))
        for rid in step.preempted_req_ids:
            if (found := by_child.get(rid)) is not None:
                found[0].num_preemptions += 1

    def _on_delivered(self, request_id: str, ns: int) -> None:
        if (req := self._requests.get(request_id)) is not None:
            req.delivered(ns)

    def _on_finished(
        self, request_id: str, status: str, finish_reason: str, ns: int, error: str | None
    ) -> None:
        if (req := self._requests.get(request_id)) is not None and req.status is None:
            req.status, req.finish_reason, req.finished_ns = status, finish_reason, ns
            req.error = error or req.error

    def _on_closed(self, request_id: str, ns: int) -> None:
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        for child_id in req.child_ids:
            self._by_child.pop(child_id, None)
        req.close(ns)
        spans = build_spans(req, self.run_id)
        if self.store is not None:
            row = build_request_row(
                req, self.run_id, trace_prompts=self.config.trace_prompts,
                block_size=self.block_size,
            )  # fmt: skip
            self.store.add_all({"requests": [row], "spans": spans})  # whole, or not at all
        if self.observe_boundary is not None:
            for span in spans[1:]:
                self.observe_boundary(span[5], (span[7] - span[6]) / 1e9)
        if self.otlp is not None:
            self.otlp.export(spans)


def _step_row(run_id: str, s: Any) -> tuple[Any, ...]:
    return (
        run_id, s.step_id, s.schedule_start_ns, s.schedule_end_ns, s.execute_start_ns,
        s.execute_end_ns, s.output_ns, s.num_running, s.num_waiting, s.num_scheduled_tokens,
        s.num_prefill_tokens, s.num_decode_tokens, s.num_preemptions, s.num_kv_blocks_used,
        s.num_kv_blocks_total, s.num_prefix_query_tokens, s.num_prefix_hit_tokens,
        list(s.req_ids), list(s.num_scheduled), list(s.preempted_req_ids),
    )  # fmt: skip


def _run_row(
    run_id: str, info: EngineInfo, engine_config: Any, config: TracingConfig
) -> tuple[Any, ...]:
    try:
        cfg = msgspec.json.encode(engine_config).decode() if engine_config is not None else None
    except TypeError:
        cfg = None
    return (
        run_id, time.time_ns(), info.model, info.version, info.max_model_len, info.num_kv_blocks,
        info.block_size, cfg, config.trace_prompts,
    )  # fmt: skip
