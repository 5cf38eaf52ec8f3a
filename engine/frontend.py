"""The frontend loop LLM and AsyncLLM share, and the observer interface tracing implements.

Both frontends do the same three things around their client: add a request
(its n sequences become core requests), turn each batch of core outputs into
RequestOutputs, and abort. ``Frontend`` does them once, reporting each event
to an optional ``FrontendObserver`` (the tracer) and to the stat loggers
(metrics). The drivers only differ in how they wait: LLM blocks, AsyncLLM awaits.

Instants follow the clock rule of ``engine/messages.py`` (``time.time_ns``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Protocol

from engine import faults
from engine.client import ClientState
from engine.errors import CLIENT, REQUEST_ERROR
from engine.lora import LoRARequest
from engine.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest
from engine.output_processor import OutputProcessor, child_params
from engine.outputs import RequestOutput
from engine.processor import InputProcessor
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats, StatLogger

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Enqueued:
    """A request handed to the engine client: the end of frontend.enqueue."""

    request_id: str
    child_ids: list[str]  # its core requests (one per sequence of n)
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_ns: int
    sent_ns: int
    stream: bool  # the caller takes every delta (False: one response at the end)
    # 0; n: sent again after n engine cores failed before it had sent its caller any output
    # (what the earlier cores did of it is lost work).
    attempt: int = 0
    engine: int = 0  # the data-parallel engine it was sent to
    routed: str | None = None  # why it went there (engine.data_parallel's Routed; None: alone)
    lora_name: str | None = None  # its LoRA adapter (None: the base model)


@dataclass(slots=True)
class Finished:
    """A request ended: ok (its final output came back), aborted or error."""

    request_id: str
    status: str  # ok | aborted | error
    finish_reason: str
    ns: int
    error: str | None = None
    code: str | None = None  # what ended it, where not ok (engine.errors.END_CODES)


class FrontendObserver(Protocol):
    """What a frontend reports, in order, from the thread or task that runs it.

    Every method must return at once (enqueue, never block): it runs on the
    frontend's output path.
    """

    def enqueued(self, event: Enqueued) -> None: ...

    def outputs(
        self, outs: EngineCoreOutputs, received_ns: int, acks: list[EngineCoreOutput]
    ) -> None: ...

    def delivered(self, request_id: str, ns: int) -> None:
        """The caller took the request's pending outputs."""

    def delivered_many(self, deliveries: list[tuple[str, int]]) -> None:
        """``delivered`` for each (request id, instant) pair, in order: one call per output
        batch where the output loop itself delivers."""

    def finished(self, event: Finished) -> None: ...

    def closed(self, request_id: str, ns: int) -> None:
        """The caller has the whole response: the request's record is complete."""


class Frontend:
    """Requests in flight between a caller and an engine client."""

    def __init__(
        self,
        processor: InputProcessor,
        client_state: ClientState,
        stat_loggers: tuple[StatLogger, ...] = (),
        stream_interval: int = 1,
    ) -> None:
        self.processor = processor
        self.state = client_state
        self.output_processor = OutputProcessor(
            processor.tokenizer.backend_tokenizer, stream_interval
        )
        self.stat_loggers = stat_loggers
        self.observer: FrontendObserver | None = None
        self.emit_fault = faults.hook("emit")  # nothing unless LUMEN_DEBUG_DELAY sets it
        self.engine = 0  # the data-parallel rank of the engine it serves (its Enqueued say so)

    def observe(self, observer: FrontendObserver) -> None:
        self.observer = observer
        self.state.keep_acks = True  # the observer also sees acks the abort filter consumes

    def add(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        priority: int,
        arrival_ns: int,
        stream: bool,
        stream_deltas: bool,
        attempt: int = 0,
        routed: str | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[EngineCoreRequest]:
        """Register a request; returns the core requests to send (one per sequence).

        ``stream_deltas``: the frontend wants a delta after every step; ``stream``: the caller
        delivers each one as it comes. ``attempt``: as Enqueued's (a request sent again to a
        new core, ``forget`` first); ``routed`` too.
        """
        child_ids = self.output_processor.add_request(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            stream=stream_deltas,
            arrival_ns=arrival_ns,
        )
        if self.observer is not None:
            self.observer.enqueued(
                Enqueued(
                    request_id,
                    child_ids,
                    prompt_token_ids,
                    params,
                    priority,
                    arrival_ns,
                    time.time_ns(),
                    stream,
                    attempt,
                    self.engine,
                    routed,
                    None if lora_request is None else lora_request.lora_name,
                )
            )
        return [
            self.processor.make_request(
                child_id,
                prompt_token_ids,
                child_params(params, index),
                priority=priority,
                arrival_ns=arrival_ns,
                lora_request=lora_request,
            )
            for index, child_id in enumerate(child_ids)
        ]

    def process(self, outs: EngineCoreOutputs) -> tuple[list[RequestOutput], list[str]]:
        """One batch of core outputs: the RequestOutputs to deliver, and core ids to abort
        (stopped by a stop string)."""
        now_ns = time.time_ns()
        if self.observer is not None:
            self.observer.outputs(outs, now_ns, self.state.take_acks())
        stats = IterationStats(now_ns, num_outputs=len(outs.outputs)) if self.stat_loggers else None
        results, to_abort = self.output_processor.process_outputs(outs.outputs, outs.step, stats)
        self.emit_fault()
        if self.observer is not None:
            for result in results:
                if result.finished:
                    self.observer.finished(_finished(result, now_ns))
        if stats is not None:
            self.record(stats)
        return results, to_abort

    def abort(self, request_id: str, code: str = CLIENT) -> list[str]:
        """Forget a request; returns its core ids (the caller aborts them in the core).
        ``code``: who ended it (engine.errors.END_CODES)."""
        return self._end(request_id, "aborted", "abort", None, code)

    def failed(self, request_id: str, error: str, code: str) -> list[str]:
        """The engine failed the request (its core died): forgotten, and counted with the
        finish reason "error", never as a client's abort."""
        return self._end(request_id, "error", "error", error, code)

    def forget(self, request_id: str) -> None:
        """Forget a request silently: it is added again (``add``, the next attempt)."""
        self.output_processor.abort_request(request_id)

    def _end(
        self, request_id: str, status: str, reason: str, error: str | None, code: str
    ) -> list[str]:
        now_ns = time.time_ns()
        stats = IterationStats(now_ns) if self.stat_loggers else None
        child_ids = self.output_processor.abort_request(request_id, stats, reason)
        if child_ids and self.observer is not None:
            self.observer.finished(Finished(request_id, status, reason, now_ns, error, code))
        if stats is not None and stats.finished:
            self.record(stats)
        return child_ids

    def delivered(self, request_id: str) -> None:
        if self.observer is not None:
            self.observer.delivered(request_id, time.time_ns())

    def delivered_many(self, deliveries: list[tuple[str, int]]) -> None:
        if self.observer is not None:
            self.observer.delivered_many(deliveries)

    def closed(self, request_id: str) -> None:
        if self.observer is not None:
            self.observer.closed(request_id, time.time_ns())

    def record(self, stats: IterationStats) -> None:
        for stat_logger in self.stat_loggers:
            try:
                stat_logger.record(stats)
            except Exception:
                logger.exception("stat logger %r failed", stat_logger)


def _finished(result: RequestOutput, ns: int) -> Finished:
    errors = [c.error for c in result.outputs if c.error]
    reasons = [c.finish_reason for c in result.outputs if c.finish_reason]
    status, error = ("error", errors[0]) if errors else ("ok", None)
    reason = reasons[0] if reasons else "stop"
    return Finished(result.request_id, status, reason, ns, error, REQUEST_ERROR if errors else None)
