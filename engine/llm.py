"""LLM: the offline API, LLM(model).generate(prompts, params) and LLM.chat(messages)."""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, cast

from tqdm import tqdm

from engine import chat_templates
from engine.client import EngineCoreClient, InprocClient
from engine.config import EngineConfig
from engine.errors import RequestError
from engine.frontend import Frontend
from engine.lora import LoRARequest
from engine.messages import EngineStats, StepRecord, UtilityMethod
from engine.model_files import resolve_config
from engine.outputs import RequestOutput
from engine.processor import InputProcessor, PromptType, start_loading_tokenizer
from engine.request_ids import new_request_id
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats

if TYPE_CHECKING:
    from tracing.recorder import Tracer

logger = logging.getLogger(__name__)

_METRICS = (
    "num_steps",
    "num_prefill_tokens",
    "num_decode_tokens",
    "num_preemptions",
    "num_prefix_hit_tokens",
    "max_scheduled_tokens",
    "max_kv_blocks_used",
)


class LLM:
    """Generate offline with the same engine the server uses.

    ``LLM(model=None)`` loads the default model; every EngineConfig field is
    a keyword argument (``max_num_seqs=...``, ``kv_cache_memory_bytes=...``).
    Tracing is off unless ``trace_db=PATH``, ``otlp_traces_endpoint=URL`` or
    ``otlp_metrics_endpoint=URL``
    is given (the other TracingConfig fields are keywords too).
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        from tracing.config import TracingConfig

        tracing_names = {f.name for f in dataclasses.fields(TracingConfig)}
        tracing = {k: options.pop(k) for k in list(options) if k in tracing_names}
        if isinstance(options.get("speculative_config"), dict):  # vLLM's LLM takes a dict
            options["speculative_config"] = json.dumps(options["speculative_config"])
        path, self.config = resolve_config(EngineConfig(model=model, **options))
        tokenizer = start_loading_tokenizer(self.config.tokenizer or path)  # as the core starts
        self.client = make_client(self.config, path)
        self.processor = InputProcessor.for_model(
            path, self.client.info, tokenizer, self.config.sampling_defaults(path)
        )
        self.tokenizer = self.processor.tokenizer
        self.frontend = Frontend(self.processor, self.client.state, stat_loggers=(self,))
        self.tracer: Tracer | None = None
        if any(
            tracing.get(k) for k in ("trace_db", "otlp_traces_endpoint", "otlp_metrics_endpoint")
        ):
            # The one place the engine reaches tracing: LLM(trace_db=...) builds its observer.
            from tracing.recorder import Tracer

            tracing.setdefault("no_trace_db", not tracing.get("trace_db"))
            self.tracer = Tracer(
                TracingConfig(**tracing), self.client.info, engine_config=self.config
            )
            self.frontend.observe(self.tracer)
        self._metrics = dict.fromkeys(_METRICS, 0)
        # Set to a list to keep every step's record and its number of outputs
        # (benchmarks count model FLOPs and model time from these).
        self.step_log: list[tuple[StepRecord, int]] | None = None

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; results come back in the order given.
        ``lora_request``: the LoRA adapter every prompt runs with, or one per prompt (None:
        the base model), as vLLM's (engine/lora.py; the engine needs enable_lora)."""
        arrival_ns = time.time_ns()  # frontend.enqueue starts before tokenization
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        tokenized = [self.processor.tokenize(p) for p in prompts]
        return self._run(tokenized, sampling_params, priority, use_tqdm, arrival_ns, lora_request)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """One conversation (a list of messages) or several, with the tokenizer's template or
        ``chat_template`` (a file, a built-in name or a Jinja string: engine.chat_templates);
        ``chat_template_kwargs`` become the template's variables (Qwen3's enable_thinking)."""
        arrival_ns = time.time_ns()
        if chat_template is not None:
            chat_template = chat_templates.resolve(chat_template)
        several = bool(messages) and isinstance(messages[0], list)
        conversations = cast(list[list[dict[str, Any]]], messages if several else [messages])
        tokenized: list[tuple[str | None, list[int]]] = [
            (
                None,
                self.processor.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    chat_template=chat_template,
                    template_kwargs=chat_template_kwargs,
                ),
            )
            for conv in conversations
        ]
        return self._run(tokenized, sampling_params, None, use_tqdm, arrival_ns)

    def _run(
        self,
        tokenized: list[tuple[str | None, list[int]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        priority: Sequence[int] | None,
        use_tqdm: bool,
        arrival_ns: int,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        params = _per_prompt(sampling_params, len(tokenized), self.processor.sampling_defaults)
        if lora_request is None or isinstance(lora_request, LoRARequest):
            loras = [lora_request] * len(tokenized)
        elif len(loras := list(lora_request)) != len(tokenized):
            raise ValueError("lora_request must be one LoRARequest or one entry per prompt")
        priorities = list(priority) if priority is not None else [0] * len(tokenized)
        if len(priorities) != len(tokenized):
            raise ValueError("priority must have one entry per prompt")
        # Validate everything before adding anything, so a bad prompt adds nothing.
        for (_, ids), p in zip(tokenized, params):
            self.processor.validate(ids, p)
        frontend = self.frontend
        order: dict[str, int] = {}
        for i, ((text, ids), p, prio, lora) in enumerate(zip(tokenized, params, priorities, loras)):
            request_id = new_request_id()
            order[request_id] = i
            requests = frontend.add(
                request_id, text, ids, p, priority=prio, arrival_ns=arrival_ns, stream=False,
                stream_deltas=False, lora_request=lora,
            )  # fmt: skip
            for request in requests:
                self.client.add_request(request)
        results: list[RequestOutput | None] = [None] * len(tokenized)
        bar = tqdm(total=len(tokenized), desc="generate", disable=not use_tqdm)
        try:
            while frontend.output_processor.has_unfinished():
                finished, to_abort = frontend.process(self.client.get_output())
                if to_abort:
                    self.client.abort_requests(to_abort)
                for result in finished:
                    results[order[result.request_id]] = result
                    frontend.closed(result.request_id)
                bar.update(len(finished))
        except BaseException:
            # Ctrl-C or a failure: leave no request behind in the engine.
            for request_id in order:
                if child_ids := frontend.abort(request_id):
                    self.client.abort_requests(child_ids)
                    frontend.closed(request_id)
            raise
        finally:
            bar.close()
        for done in results:
            errors = [c.error for c in done.outputs if c.error] if done else []
            if errors:
                raise RequestError(errors[0])
        return [r for r in results if r is not None]

    def get_metrics(self) -> dict[str, int]:
        """Counters over every engine step this LLM ran (steps, tokens, preemptions, hits)."""
        return dict(self._metrics)

    def record(self, stats: IterationStats) -> None:
        """The frontend's stat logger: counts every step, and logs it when asked."""
        if (step := stats.step) is None or step.idle:
            return
        if self.step_log is not None:
            self.step_log.append((step, stats.num_outputs))
        m = self._metrics
        m["num_steps"] += 1
        m["num_prefill_tokens"] += step.num_prefill_tokens
        m["num_decode_tokens"] += step.num_decode_tokens
        m["num_preemptions"] += step.num_preemptions
        m["num_prefix_hit_tokens"] += step.num_prefix_hit_tokens
        m["max_scheduled_tokens"] = max(m["max_scheduled_tokens"], step.num_scheduled_tokens)
        m["max_kv_blocks_used"] = max(m["max_kv_blocks_used"], step.num_kv_blocks_used)

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix block; returns how many were dropped."""
        return self.client.call_utility(UtilityMethod.RESET_PREFIX_CACHE)  # type: ignore[return-value]

    def get_stats(self) -> EngineStats:
        """Scheduler and KV cache state now."""
        return self.client.call_utility(UtilityMethod.GET_STATS)  # type: ignore[return-value]

    def sleep(self) -> None:
        """Release the KV cache's memory until wake_up (no request may be running)."""
        self.client.call_utility(UtilityMethod.SLEEP)

    def wake_up(self) -> None:
        self.client.call_utility(UtilityMethod.WAKE_UP)

    def start_profile(self, path: str) -> None:
        """Run the torch profiler on the workers until stop_profile; writes a Chrome trace."""
        self.client.call_utility(UtilityMethod.START_PROFILE, path)

    def stop_profile(self) -> None:
        self.client.call_utility(UtilityMethod.STOP_PROFILE)

    def shutdown(self) -> None:
        """Stop the engine (and its processes); the LLM cannot be used after."""
        self.client.shutdown()
        if self.tracer is not None:
            self.tracer.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _per_prompt(
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    num: int,
    defaults: dict[str, Any],
) -> list[SamplingParams]:
    if sampling_params is None:  # the model's generation config's defaults, as vLLM's
        return [SamplingParams(**defaults)] * num
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * num
    params = list(sampling_params)
    if len(params) != num:
        raise ValueError(f"got {len(params)} sampling_params for {num} prompts")
    return params


def make_client(config: EngineConfig, model_path: str) -> EngineCoreClient:
    """The blocking client LLM uses: in this process, or the core in its own (core_process)."""
    if config.core_process:
        from engine.mp_client import SyncMPClient

        return SyncMPClient(config, model_path)
    return InprocClient(config, model_path)
