"""The OpenAI routes' work: request -> SamplingParams -> AsyncLLM -> response or SSE stream."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any

import jinja2
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from engine import chat_templates
from engine.async_llm import AsyncLLM, StreamStalledError
from engine.data_parallel import EngineGroup
from engine.errors import STALLED, EngineDeadError, EngineRestartingError, RequestAbortedError
from engine.frontend import Finished
from engine.lora import LoRARequest
from engine.outputs import CompletionOutput, RequestOutput
from service import tools
from service.admission import Admission, AdmissionRefused
from service.context import RequestContext
from service.errors import APIError, error_body
from service.lifecycle import Lifecycle
from service.lora_adapters import LoraAdapters
from service.metrics import ServerMetrics
from service.prepared import Prepared, as_prompts, max_tokens_for, pinned_engine
from service.protocol import ChatCompletionRequest, CompletionRequest
from service.request_metrics import request_metrics, server_timing_header, spec_decode_metrics
from service.responses import Choice, ReplyStream, ResponseHead
from service.streaming import DONE, ClientGone, EventStream, sse, until_disconnect
from tracing.recorder import Tracer

logger = logging.getLogger(__name__)
_encode = msgspec.json.encode
# What a malformed chat or prompt can raise while it is templated and tokenized.
_INPUT_ERRORS = (ValueError, TypeError, KeyError, jinja2.TemplateError)


class Serving:
    def __init__(
        self,
        engine: AsyncLLM | EngineGroup,
        metrics: ServerMetrics,
        admission: Admission,
        lifecycle: Lifecycle,
        *,
        model_name: str,
        stall_timeout: float,
        tracer: Tracer | None = None,
        reasoning_parser: str | None = None,
        per_request_metrics: bool = False,
        trust_request_chat_template: bool = False,
        spec_metrics: str | None = None,
        adapters: LoraAdapters | None = None,
    ) -> None:
        self.engine = engine
        self.adapters = adapters or LoraAdapters(model_name, None, 0, enabled=False)
        self.spec_metrics = spec_metrics
        self.trust_request_chat_template = trust_request_chat_template
        self.per_request_metrics = per_request_metrics
        self.lifecycle = lifecycle
        self.reasoning_parser = reasoning_parser
        self.tracer = tracer
        self.metrics = metrics
        self.admission = admission
        self.model_name = model_name
        self.stall_timeout = stall_timeout

    def _spec_figures(
        self, prep: Prepared, timings: list[tuple[str, dict[str, Any]]]
    ) -> dict[str, Any] | None:
        return _spec_figures_of(self.spec_metrics, prep, timings)

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter ``model`` names (None: the base model); a 404 for an unknown name."""
        return self.adapters.resolve(model)

    def prepare_chat(self, body: ChatCompletionRequest, ctx: RequestContext, path: str) -> Prepared:
        ctx.handler_ns = time.time_ns()
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            plan = tools.plan_from_request(body.tools, body.tool_choice, body.parallel_tool_calls)
            if plan is not None:
                tools.check_alone(body.n, body.structured_outputs_params() is not None)
            native = self.engine.processor.template_takes_tools
            if plan is not None and native and self.engine.processor.template_writes_llama3_calls:
                plan.fmt = "llama3_json"
            messages = tools.render_messages(body.plain_messages(), plan, native)
            ids = self.engine.apply_chat_template(
                messages, add_generation_prompt=body.add_generation_prompt,
                tools=[{"type": "function", "function": f} for f in plan.functions]
                if plan is not None and native else None,
                chat_template=chat_templates.for_request(
                    body.chat_template, self.trust_request_chat_template
                ),
                template_kwargs=body.chat_template_kwargs,
            )  # fmt: skip
            return self._prepare(
                body, ctx, path, [(None, ids)], body.requested_max_tokens, body.num_logprobs,
                True, plan, lora,
            )  # fmt: skip
        except _INPUT_ERRORS as e:
            raise APIError(400, str(e)) from None

    def prepare_completion(
        self, body: CompletionRequest, ctx: RequestContext, path: str
    ) -> Prepared:
        ctx.handler_ns = time.time_ns()
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            prompts = [self.engine.tokenize(p) for p in as_prompts(body.prompts())]
            return self._prepare(
                body, ctx, path, prompts, body.max_tokens, body.logprobs, False, None, lora
            )
        except _INPUT_ERRORS as e:
            raise APIError(400, str(e)) from None

    def _prepare(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        ctx: RequestContext,
        path: str,
        prompts: list[tuple[str | None, list[int]]],
        max_tokens: int | None,
        num_logprobs: int | None,
        chat: bool,
        plan: tools.ToolPlan | None = None,
        lora: LoRARequest | None = None,
    ) -> Prepared:
        longest = max(len(ids) for _, ids in prompts)
        engine_rank = pinned_engine(ctx.data_parallel_rank, len(self.engine.members))
        defaults = self.engine.processor.sampling_defaults
        if max_tokens is None:
            max_tokens = defaults.get("max_tokens")
        room = max_tokens_for(longest, max_tokens, self.engine.max_model_len)
        params = body.sampling_params(room, num_logprobs, defaults)
        if plan is not None:
            params = params.clone(structured_outputs=plan.structured_outputs())
        # The one validation a served prompt gets: the engine runs it as it is.
        checked = [
            self.engine.prepare({"prompt": text, "prompt_token_ids": ids}, params, lora)
            for text, ids in prompts
        ]
        model = self.model_name if lora is None else lora.lora_name
        head = ResponseHead(
            id=ctx.request_id,
            created=int(time.time()),
            model=model,
            chat=chat,
            num_logprobs=num_logprobs or 0,
            include_usage=body.stream and body.include_usage,
            tools=plan,
            reasoning=self.reasoning_parser if chat else None,
        )
        prep = Prepared(
            checked, params, head, body.stream, body.priority, ctx,
            include_metrics=self.per_request_metrics or body.wants_metrics,
            engine_rank=engine_rank,
        )  # fmt: skip
        ctx.stream = prep.stream
        if (tracer := self.tracer) is not None:
            request_ids = prep.request_ids
            for rid in request_ids:
                tracer.start(ctx.trace_start(rid, path, model, prep.stream))
            ctx.traced_ids = request_ids  # the front door closes them once the response is written
        return prep

    async def respond(self, prep: Prepared, request: Request) -> Response:
        """Admit, then run: a stream keeps its admission slot until it ends."""
        try:
            await self._gate()
            try:
                started = time.time_ns()
                await self.admission.acquire()
                prep.ctx.http.admission_wait_ns = time.time_ns() - started
            except AdmissionRefused as e:
                self.metrics.reject(e.reason)
                status = 429 if e.reason == "queue_full" else 503
                raise APIError(
                    status, str(e), code=e.reason, headers={"Retry-After": "1"}
                ) from None
        except APIError as e:
            if (tracer := self.tracer) is not None:
                for rid in prep.request_ids:
                    tracer.finished(
                        Finished(rid, "error", "error", time.time_ns(), e.message, e.code)
                    )
            raise
        if prep.stream:
            prep.ctx.hold_head = prep.head.chat  # its role chunks follow the head at once
            return EventStream(
                self._events(prep),
                send_timeout=self.stall_timeout,
                on_end=lambda reason: self._stream_ended(prep, reason),
                on_stall=lambda: self._abort(prep, STALLED),
            )
        try:
            return await self._complete(prep, request)
        finally:
            self.admission.release()

    async def _gate(self) -> None:
        """Refuse while the server stops; while the engine restarts, wait for it as long as
        for an admission slot (``--max-queue-wait``), then refuse."""
        lifecycle = self.lifecycle
        if not await lifecycle.wait_ready(self.admission.max_wait):
            if lifecycle.closing:
                reason, message = "shutting_down", "the server is shutting down; retry later"
            else:
                reason = "engine_restarting"
                message = f"the engine is {lifecycle.state}; retry later"
            self.metrics.reject(reason)
            raise APIError(503, message, code=reason, headers={"Retry-After": "1"})

    async def _abort(self, prep: Prepared, code: str) -> None:
        for rid in prep.request_ids:
            await self.engine.abort(rid, code)

    def _stream_ended(self, prep: Prepared, reason: str) -> None:
        self.admission.release()
        if reason == "disconnect":
            self.metrics.disconnects.inc()
        elif reason == "stalled":
            self.metrics.stall_aborts.inc()

    async def _complete(self, prep: Prepared, request: Request) -> Response:
        head, n = prep.head, prep.params.n
        choices: defaultdict[int, Choice] = defaultdict(Choice)
        timings: list[tuple[str, dict[str, Any]]] = []

        async def collect() -> None:
            async with contextlib.aclosing(self._generate(prep)) as outputs:
                async for p, out in outputs:
                    for c in out.outputs:
                        if c.error is not None:
                            raise APIError(400, c.error)
                        choices[p * n + c.index].add(c)
                    if out.finished:
                        timings.append((prep.request_ids[p], out.metrics))

        try:
            await until_disconnect(request, collect())
        except ClientGone:
            self.metrics.disconnects.inc()
            return Response(status_code=499)
        except EngineDeadError as e:
            message, code = _dead(e)
            raise APIError(503, message, code=code) from None
        except RequestAbortedError as e:
            retry = {"Retry-After": "1"}
            raise APIError(503, str(e), code="shutting_down", headers=retry) from None
        except StreamStalledError as e:
            raise APIError(503, str(e), code="stalled") from None
        has_logprobs = prep.params.logprobs is not None
        num_tokens = sum(len(c.token_ids) for c in choices.values())
        body = head.body(
            [head.final_choice(i, choices[i], has_logprobs) for i in sorted(choices)],
            prep.num_prompt_tokens,
            num_tokens,
        )
        figures = _metrics(prep, timings, num_tokens)
        if prep.include_metrics:
            body["metrics"] = figures
        if (spec := self._spec_figures(prep, timings)) is not None:
            body.setdefault("metrics", {})["speculative_decoding"] = spec
        return Response(_encode(body), media_type="application/json",
                        headers={"Server-Timing": server_timing_header(figures)})  # fmt: skip

    async def _events(self, prep: Prepared) -> AsyncGenerator[bytes, None]:
        head, n = prep.head, prep.params.n
        num_completion_tokens = 0
        offsets: defaultdict[int, int] = defaultdict(int)
        timings: list[tuple[str, dict[str, Any]]] = []
        facts = prep.ctx.http
        streams: dict[int, ReplyStream] = {}  # per choice, where tools or reasoning are in play
        done: set[int] = set()  # choices that finished
        deliver_now = prep.ctx.deliver_now or _never

        def direct(out: RequestOutput) -> bool:
            """An output of text deltas only, written by the engine's output loop where the
            connection takes it at once: the events and counts the loop below would give."""
            nonlocal num_completion_tokens
            events = []
            for c in out.outputs:
                if c.error is not None or c.finish_reason is not None or c.logprobs is not None:
                    return False
                if c.text:
                    events.append(head.text_event(c.index, c.text))
            if events and not deliver_now(events[0] if len(events) == 1 else b"".join(events)):
                return False
            for c in out.outputs:
                num_completion_tokens += len(c.token_ids)
                offsets[c.index] += len(c.text)
                if not facts.first_delivered_ns and c.token_ids:
                    facts.first_delivered_ns = time.time_ns()
            return True

        single = len(prep.prompts) == 1
        plain = head.tools is None and head.reasoning is None and single
        tail: list[bytes] = []  # a single prompt's last events go out with [DONE], in one write
        try:
            if head.chat:
                yield b"".join(
                    sse(_encode(head.chunk([head.role_choice(index)])))
                    for index in range(len(prep.prompts) * n)
                )
            generate = self._generate(
                prep, direct if plain and deliver_now is not _never else None, hold_last=single
            )
            async with contextlib.aclosing(generate) as outputs:
                async for p, out in outputs:
                    batch: list[bytes] = []  # the output's events, in one write
                    for c in out.outputs:
                        if c.error is not None:
                            batch.append(sse(_encode(error_body(400, c.error))))
                            yield b"".join(batch)
                            return
                        num_completion_tokens += len(c.token_ids)
                        if not (c.text or c.finish_reason or c.logprobs):
                            continue
                        index = p * n + c.index
                        if c.finish_reason is not None:
                            done.add(index)
                        if head.tools is not None or head.reasoning is not None:
                            for chunk in head.parsed_chunks(index, c, streams):
                                batch.append(sse(_encode(chunk)))
                        elif c.text and c.finish_reason is None and c.logprobs is None:
                            batch.append(head.text_event(index, c.text))
                        else:
                            chunk = head.chunk([head.delta_choice(index, c, offsets[index])])
                            batch.append(sse(_encode(chunk)))
                        offsets[index] += len(c.text)
                    if out.finished:
                        timings.append((prep.request_ids[p], out.metrics))
                        if single:
                            tail = batch
                            continue
                    if batch:
                        yield batch[0] if len(batch) == 1 else b"".join(batch)
                    if not facts.first_delivered_ns and any(c.token_ids for c in out.outputs):
                        facts.first_delivered_ns = time.time_ns()  # the transport took it
            spec = self._spec_figures(prep, timings)
            if head.include_usage or prep.include_metrics or spec is not None:
                last = head.usage_chunk(prep.num_prompt_tokens, num_completion_tokens)
                if not head.include_usage:
                    del last["usage"]
                if prep.include_metrics:
                    last["metrics"] = _metrics(prep, timings, num_completion_tokens)
                if spec is not None:
                    last.setdefault("metrics", {})["speculative_decoding"] = spec
                tail.append(sse(_encode(last)))
            tail.append(DONE)
            yield b"".join(tail)
        except EngineDeadError as e:
            message, code = _dead(e)
            yield sse(_encode(error_body(503, message, code=code)))
        except RequestAbortedError as e:
            # The server stops (a drain past its timeout): every open choice ends with
            # finish_reason "abort", then an error event the openai client raises.
            for index in range(len(prep.prompts) * n):
                if index not in done:
                    end = CompletionOutput(index, "", [], finish_reason="abort")
                    yield sse(_encode(head.chunk([head.delta_choice(index, end, offsets[index])])))
            yield sse(_encode(error_body(503, str(e), code="shutting_down")))
        except StreamStalledError:
            return
        except Exception:
            # The 200 is sent already: end the stream with an error event, never mid-chunk.
            logger.exception("stream of %s failed", head.id)
            yield sse(_encode(error_body(500, "internal server error")))

    async def _generate(
        self,
        prep: Prepared,
        direct: Callable[[RequestOutput], bool] | None = None,
        hold_last: bool = False,
    ) -> AsyncGenerator[tuple[int, RequestOutput], None]:
        """Deltas of every prompt's request, tagged with the prompt's index (``direct`` and
        ``hold_last``: one prompt's, as AsyncLLM.generate_prepared takes them)."""
        arrival_ns = prep.ctx.arrival_ns
        pinned: dict[str, Any] = (
            {} if prep.engine_rank is None else {"data_parallel_rank": prep.engine_rank}
        )
        gens = [
            self.engine.generate_prepared(
                prompt,
                request_id=rid,
                priority=prep.priority,
                arrival_ns=arrival_ns,
                stream=prep.stream,
                close_trace=False,  # the front door closes it, once the response is written
                direct=direct,
                hold_last=hold_last,
                **pinned,
            )
            for rid, prompt in zip(prep.request_ids, prep.prompts)
        ]
        if len(gens) == 1:
            try:
                async for out in gens[0]:
                    yield 0, out
            finally:
                await gens[0].aclose()
            return
        async with contextlib.aclosing(_merge(gens)) as merged:
            async for item in merged:
                yield item


async def _merge(
    gens: Sequence[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    # A bounded queue: a slow reader holds the producers back; each engine
    # stream then merges its deltas, so memory stays bounded.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(
        len(gens)
    )

    async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in gen:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))
        finally:
            await gen.aclose()

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*tasks, return_exceptions=True)


def _never(body: bytes) -> bool:
    """A connection that writes nothing at once (no direct chunk writes: HTTP/1.0, or an
    unhooked Hypercorn)."""
    return False


def _dead(e: EngineDeadError) -> tuple[str, str]:
    """The message and code of a request that failed with the engine."""
    if isinstance(e, EngineRestartingError):
        return str(e), "engine_restarted"
    return f"the engine died: {e}", "engine_dead"


def _spec_figures_of(
    mode: str | None, prep: Prepared, timings: list[tuple[str, dict[str, Any]]]
) -> dict[str, Any] | None:
    """``metrics.speculative_decoding`` (--per-request-spec-decode-metrics): for one prompt
    and one sample that verified drafts, as vLLM gives it; else None."""
    if mode is None or prep.params.n > 1 or len(timings) != 1:
        return None
    return spec_decode_metrics(timings[0][1], detailed=mode == "detailed")


def _metrics(
    prep: Prepared, timings: list[tuple[str, dict[str, Any]]], num_tokens: int
) -> dict[str, Any]:
    ctx = prep.ctx
    return request_metrics(
        timings, http_start_ns=ctx.http_start_ns, handler_ns=ctx.handler_ns,
        first_delivered_ns=ctx.http.first_delivered_ns if prep.stream else 0,
        num_tokens=num_tokens, now_ns=time.time_ns(),
    )  # fmt: skip
