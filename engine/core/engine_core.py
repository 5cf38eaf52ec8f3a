"""EngineCore: schedule -> execute -> update, one step at a time. Token ids in, token ids out."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable

import torch

from engine import faults, kv_events_config
from engine.background import in_background
from engine.config import EngineConfig
from engine.core.grammar import GRAMMAR_WAIT_S, GrammarManager
from engine.core.kv_events import ZmqEventPublisher
from engine.core.scheduler import Scheduler
from engine.core.warmup import warm_up
from engine.executor import Executor, make_executor
from engine.gc_pauses import GcPauses
from engine.kv_layout import KVLayout, kv_capacity
from engine.lora import LoraCheck
from engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineInfo,
    EngineStats,
    FinishReason,
    StepRecord,
    UtilityMethod,
    UtilityRequest,
    UtilityResult,
)
from engine.model_config import ModelConfig
from engine.request import Request, RequestStatus
from engine.version import __version__
from engine.worker.messages import SchedulerOutput

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        owns_process: bool = False,
        on_warm_up: Callable[[], object] | None = None,
        dp_rank: int = 0,
    ) -> None:
        """``on_warm_up``: called once the model and its KV cache are loaded, as the warm-up
        begins (the core process tells its server, whose /health says so). ``dp_rank``: its
        data-parallel engine (its KV events carry it, their endpoints offset by it)."""
        model_config = ModelConfig.from_path(model_path)
        device = config.resolve_device()
        dtype = config.resolve_dtype(device)
        max_model_len = config.max_model_len or model_config.max_position_embeddings
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {max_model_len} exceeds the model's context length "
                f"{model_config.max_position_embeddings}"
            )
        kv_dtype = config.resolve_kv_cache_dtype(dtype)
        layout = KVLayout.of(model_config, not config.disable_hybrid_kv_cache_manager)
        self.grammars = GrammarManager(  # the frontend resolved a --tokenizer to its folder
            config.tokenizer or model_path, model_config.vocab_size, model_config.eos_token_ids
        )
        # The grammar engine warms up (its tokenizer, 0.4 s) while the model loads; the model's
        # own warm-up, whose steps the diagnosis's prior times, waits for it.
        grammar_warmup = (
            in_background(self.grammars.warm_up, name="lumen-grammar-warmup")
            if config.warmup
            else None
        )
        executor = make_executor(
            config, model_config, device, dtype, max_model_len, owns_process=owns_process
        )
        try:
            num_blocks, max_model_len = _size_kv_cache(
                config, executor, device, max_model_len, layout
            )
            executor.init_kv_cache(num_blocks)
        except BaseException:
            executor.shutdown()  # no worker outlives a failed start
            raise
        finally:
            waited = time.monotonic()
            if grammar_warmup is not None:
                grammar_warmup.result()
            waited = time.monotonic() - waited
        self.executor = executor
        self.num_blocks = num_blocks
        self.warmup_s = 0.0
        step_prior: list[float] = []
        if on_warm_up is not None:
            on_warm_up()
        if config.warmup:
            warmed_s, step_prior = warm_up(executor, config, num_blocks, max_model_len)
            self.warmup_s = warmed_s + waited
        self.sleeping = False
        self.max_model_len = max_model_len
        self.vocab_size = model_config.vocab_size
        # LoRA: each adapter a request names is checked once against the model (engine/lora.py)
        self.loras = LoraCheck(model_config, config.max_lora_rank) if config.enable_lora else None
        self.scheduler = Scheduler.from_config(config, num_blocks, max_model_len, layout.windows)
        self.scheduler.grammars = self.grammars
        # KV events for routers (--kv-events-config): each step's stored and removed blocks.
        events_config = kv_events_config.parse(config.kv_events_config)
        self.kv_events: ZmqEventPublisher | None = None
        if events_config.enabled and config.enable_prefix_caching:
            self.kv_events = ZmqEventPublisher(events_config, dp_rank)
            self.scheduler.kv_cache.enable_events()
        elif events_config.enabled:
            logger.warning("KV events are off: prefix caching is disabled, so no block is stored")
        self.scheduler.fault = faults.hook("schedule")
        self.output_fault = faults.hook("output")
        self.gc_pauses = GcPauses()
        self.info = EngineInfo(
            model=model_path,
            max_model_len=max_model_len,
            num_kv_blocks=num_blocks,
            block_size=config.block_size,
            dtype=str(dtype).removeprefix("torch."),
            device=str(device),
            version=__version__,
            max_logprobs=config.max_logprobs,
            step_prior=step_prior,
            kv_windows=list(layout.windows),
            kv_group_size=layout.group_size,
        )
        logger.info(
            "engine ready: %s on %s (%s%s), %d KV blocks of %d tokens, max_model_len %d, "
            "warm-up %.2fs",
            model_path,
            device,
            self.info.dtype,
            ("" if kv_dtype == dtype else f", KV cache {str(kv_dtype).removeprefix('torch.')}")
            + (f", {config.quantization} weights" if config.quantization else ""),
            num_blocks,
            config.block_size,
            max_model_len,
            self.warmup_s,
        )
        # As vLLM says it: what the KV cache holds, in tokens and in requests of the context.
        capacity = kv_capacity(
            layout.windows, layout.group_size, num_blocks, config.block_size, max_model_len
        )
        logger.info("KV cache size: %s tokens", f"{capacity.tokens:,}")
        logger.info(
            "Maximum concurrency for %s tokens per request: %.2fx",
            f"{max_model_len:,}", capacity.max_concurrency,
        )  # fmt: skip
        for kind, layers, groups, blocks in capacity.kinds:
            logger.info(
                "KV cache for %s layers (%d, in %d group(s)): a request of %s tokens holds %d "
                "blocks of them at most", kind, layers, groups, f"{max_model_len:,}", blocks,
            )  # fmt: skip

    def add_request(self, request: EngineCoreRequest) -> EngineCoreOutput | None:
        """Queue a request; one the core cannot take comes back as an ERROR output."""
        try:
            if self.sleeping:
                raise ValueError("the engine is asleep: wake it up first")
            # The frontend validated the request; this check keeps a bad one from
            # reaching the model if another client skips that.
            ids = request.prompt_token_ids
            if not 0 < len(ids) <= self.max_model_len:
                raise ValueError(
                    f"prompt of {len(ids)} tokens does not fit max_model_len {self.max_model_len}"
                )
            if min(ids) < 0 or max(ids) >= self.vocab_size:
                raise ValueError(f"prompt token ids must be in [0, {self.vocab_size})")
            if request.lora_request is not None:
                if self.loras is None:
                    raise ValueError("the request names a LoRA adapter; LoRA is not enabled "
                                     "(--enable-lora)")  # fmt: skip
                self.loras.check(request.lora_request)
                self.executor.prefetch_lora(request.lora_request)
            core_request = Request.from_wire(request, self.max_model_len)
            core_request.received_ns = time.time_ns()
            self.scheduler.add_request(core_request)
        except ValueError as e:
            return EngineCoreOutput(
                request.request_id,
                [],
                finish_reason=FinishReason.ERROR,
                error=str(e),
                received_ns=time.time_ns(),
            )
        return None

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        """Abort, and return one acknowledgement per id (known or not), in order."""
        aborted = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        freed_ns = time.time_ns()
        # A request that never produced output reports its receive time here.
        received = {r.request_id: r.received_ns for r in aborted if r.num_output_tokens == 0}
        held = {r.request_id for r in aborted}
        return [
            EngineCoreOutput(
                r,
                [],
                finish_reason=FinishReason.ABORT,
                received_ns=received.get(r, 0),
                freed_ns=freed_ns if r in held else 0,
            )
            for r in request_ids
        ]

    def has_work(self) -> bool:
        """Requests to step, KV frees (aborts) not yet reported in a step record, or ended
        requests not yet told to the workers."""
        s = self.scheduler
        return (s.has_requests() or s.has_unreported_frees() or bool(s.grammar_errors)
                or s.has_untold_finished())  # fmt: skip

    def step(self) -> EngineCoreOutputs:
        scheduler = self.scheduler
        if scheduler.only_compiling():
            # Nothing can run until a grammar is ready: wait for it a moment (new requests
            # and aborts are read between these waits), never step an empty batch.
            self.grammars.wait(scheduler.compiling, GRAMMAR_WAIT_S)
            scheduler.admit_compiled()
        if not scheduler.has_requests() or scheduler.only_compiling():
            if scheduler.has_untold_finished():
                # Nothing runs: the workers let go of the ended requests now, not when the
                # next one comes (the CPU decode mirror gives its pages back).
                self.executor.execute_model(scheduler.idle_output())
            if scheduler.grammar_errors:
                return EngineCoreOutputs(self._grammar_errors())
            if scheduler.has_unreported_frees():
                return EngineCoreOutputs(step=self._idle_record())
            return EngineCoreOutputs()
        t_schedule = time.time_ns()
        sched = scheduler.schedule()
        # The step's adapters, while its requests are all known (update_from_output forgets
        # the finished).
        loras = (
            _lora_names(scheduler.requests[r] for r in sched.req_ids) if scheduler.max_loras else []
        )
        t_scheduled = time.time_ns()
        num_grammar_rows = self._grammar_masks(sched) if scheduler.has_grammars() else 0
        t_execute = time.time_ns()
        runner_out = self.executor.execute_model(sched)
        t_executed = time.time_ns()
        outputs = scheduler.update_from_output(sched, runner_out)
        if scheduler.grammar_errors:
            outputs += self._grammar_errors()
        t_updated = time.time_ns()
        if self.kv_events is not None:
            self._publish_events()
        self.output_fault()
        kv = self.scheduler.kv_cache
        gc_pauses, gc_pause_ns = self.gc_pauses.take()
        step = StepRecord(
            step_id=sched.step_id,
            schedule_start_ns=t_schedule,
            schedule_end_ns=t_scheduled,
            execute_start_ns=t_execute,
            execute_end_ns=t_executed,
            output_ns=time.time_ns(),
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting,
            num_scheduled_tokens=sched.num_scheduled_tokens,
            num_prefill_tokens=sched.num_prefill_tokens,
            num_decode_tokens=sched.num_decode_tokens,
            num_preemptions=sched.num_preemptions,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_usable_blocks,
            num_prefix_query_tokens=sched.num_prefix_query_tokens,
            num_prefix_hit_tokens=sched.num_prefix_hit_tokens,
            req_ids=sched.req_ids,
            num_scheduled=[len(ids) for ids in sched.token_ids],
            preempted_req_ids=sched.preempted_req_ids,
            update_end_ns=t_updated,
            wait_reason=sched.wait_reason,
            num_blocks_freed=self.scheduler.take_freed_blocks(),
            gc_pauses=gc_pauses,
            gc_pause_ns=gc_pause_ns,
            grammar_mask_ns=t_execute - t_scheduled if num_grammar_rows else 0,
            num_grammar_rows=num_grammar_rows,
            sample_ns=runner_out.sample_ns,
            logprobs_ns=runner_out.logprobs_ns,
            num_logprobs_rows=runner_out.num_logprobs_rows,
            max_logprobs=runner_out.max_logprobs,
            propose_ns=runner_out.propose_ns,
            num_spec_tokens=sched.num_spec_tokens if scheduler.speculative is not None else -1,
        )
        step.loras = loras
        if sched.spec_token_ids:
            spec, kept = sched.spec_token_ids, runner_out.spec_token_ids
            step.num_drafted = [len(spec.get(r, ())) for r in sched.req_ids]
            step.num_accepted = [len(kept.get(r, ())) if r in spec else 0 for r in sched.req_ids]
        return EngineCoreOutputs(outputs, step)

    def _grammar_masks(self, sched: SchedulerOutput) -> int:
        """The token masks of the rows that sample under a grammar this step: one a row, or,
        for a row that verifies drafts, one at each of its positions (its id once a mask).
        Returns the rows."""
        requests, spec = self.scheduler.requests, sched.spec_token_ids
        ids, matchers, drafts = [], [], []
        for rid, sample in zip(sched.req_ids, sched.sample):
            grammar = requests[rid].grammar if sample else None
            if grammar is not None:
                mine = spec.get(rid, [])
                ids.extend([rid] * (len(mine) + 1))
                matchers.append(grammar.matcher)
                drafts.append(mine)
        if ids:
            sched.grammar_req_ids = ids
            sched.grammar_bitmask = self.grammars.fill_masks(matchers, drafts)
        return len(matchers)

    def _grammar_errors(self) -> list[EngineCoreOutput]:
        """ERROR outputs of requests whose grammar failed to compile."""
        failed, self.scheduler.grammar_errors = self.scheduler.grammar_errors, []
        return [
            EngineCoreOutput(
                r.request_id,
                [],
                finish_reason=FinishReason.ERROR,
                error=error,
                received_ns=r.received_ns,
            )
            for r, error in failed
        ]

    def _idle_record(self) -> StepRecord:
        """The KV state once aborts emptied the engine: no step follows to report it."""
        now = time.time_ns()
        kv = self.scheduler.kv_cache
        gc_pauses, gc_pause_ns = self.gc_pauses.take()
        return StepRecord(
            step_id=self.scheduler.next_step_id(),
            schedule_start_ns=now,
            schedule_end_ns=now,
            execute_start_ns=now,
            execute_end_ns=now,
            output_ns=now,
            num_running=0,
            num_waiting=0,
            num_scheduled_tokens=0,
            num_prefill_tokens=0,
            num_decode_tokens=0,
            num_preemptions=0,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_usable_blocks,
            num_prefix_query_tokens=0,
            num_prefix_hit_tokens=0,
            update_end_ns=now,
            num_blocks_freed=self.scheduler.take_freed_blocks(),
            idle=True,
            gc_pauses=gc_pauses,
            gc_pause_ns=gc_pause_ns,
        )

    # -- utilities -------------------------------------------------------------

    def call_utility(self, call: UtilityRequest) -> UtilityResult:
        """Run one utility from the fixed set; a failure is returned, not raised."""
        try:
            value: int | EngineStats | None = None
            if call.method == UtilityMethod.RESET_PREFIX_CACHE:
                value = self.reset_prefix_cache()
            elif call.method == UtilityMethod.GET_STATS:
                value = self.get_stats()
            elif call.method == UtilityMethod.SLEEP:
                self.sleep()
            elif call.method == UtilityMethod.WAKE_UP:
                self.wake_up()
            elif call.method == UtilityMethod.START_PROFILE:
                if not call.path:
                    raise ValueError("start_profile needs a file path")
                self.start_profile(call.path)
            elif call.method == UtilityMethod.STOP_PROFILE:
                self.stop_profile()
            return UtilityResult(call.call_id, value)
        except (ValueError, RuntimeError) as e:
            return UtilityResult(call.call_id, error=str(e))

    def reset_prefix_cache(self) -> int:
        dropped = self.scheduler.kv_cache.reset_prefix_cache()
        self._publish_events()
        return dropped

    def _publish_events(self) -> None:
        if self.kv_events is not None and (events := self.scheduler.kv_cache.take_events()):
            self.kv_events.publish(events)

    def get_stats(self) -> EngineStats:
        sched, kv = self.scheduler, self.scheduler.kv_cache
        return EngineStats(
            num_running=len(sched.running),
            num_waiting=sched.num_waiting,
            num_kv_blocks_used=kv.num_used_blocks,
            num_kv_blocks_total=kv.num_usable_blocks,
            num_kv_blocks_cached=kv.pool.num_cached_blocks,
            num_preemptions=sched.num_preemptions_total,
            sleeping=self.sleeping,
            running_loras=_lora_names(sched.running),
            waiting_loras=_lora_names(sched.waiting),
        )

    def sleep(self) -> None:
        """Release the KV cache memory; only while no request is in flight."""
        if self.scheduler.has_requests():
            raise ValueError("cannot sleep while requests are in flight")
        if not self.sleeping:
            self.scheduler.kv_cache.reset_prefix_cache()
            self._publish_events()
            self.executor.release_kv_cache()
            if self.info.device.startswith("cuda"):
                torch.cuda.empty_cache()
            self.sleeping = True

    def wake_up(self) -> None:
        if self.sleeping:
            self.executor.init_kv_cache(self.num_blocks)
            self.sleeping = False

    def start_profile(self, path: str) -> None:
        self.executor.start_profile(path)

    def stop_profile(self) -> None:
        self.executor.stop_profile()

    def shutdown(self) -> None:
        if self.kv_events is not None:
            self.kv_events.shutdown()
        self.gc_pauses.close()
        self.grammars.shutdown()
        self.executor.shutdown()


def _size_kv_cache(
    config: EngineConfig, executor: Executor, device: torch.device, max_model_len: int,
    layout: KVLayout,
) -> tuple[int, int]:  # fmt: skip
    """The number of KV blocks, and max_model_len lowered to what they hold if not set."""
    bs = config.block_size
    spare = 1 if layout.hybrid else 0  # the null block (kv_cache_manager)
    num_blocks = config.num_kv_blocks
    if num_blocks is None:
        num_blocks = config.resolve_kv_cache_bytes(device) // executor.block_bytes()
        if config.kv_cache_memory_bytes is None:
            # A default budget need not exceed what max_num_seqs full sequences can use.
            most = config.max_num_seqs * layout.blocks_per_sequence(max_model_len, bs) + spare
            num_blocks = min(num_blocks, most)
    if layout.blocks_per_sequence(max_model_len, bs) > num_blocks - spare:
        # The longest context one sequence can hold: its blocks grow with its full groups'.
        fits = max(0, (num_blocks - spare) // layout.num_groups * bs)
        while layout.blocks_per_sequence(fits + bs, bs) <= num_blocks - spare:
            fits += bs
        if config.max_model_len is not None or fits < 1:
            raise ValueError(
                f"the KV cache holds {fits} tokens of one sequence ({num_blocks} blocks), "
                f"fewer than max_model_len {max_model_len}: raise kv_cache_memory_bytes or "
                "lower max_model_len"
            )
        logger.warning("max_model_len lowered to %d, what the KV cache holds", fits)
        max_model_len = fits
    return num_blocks, max_model_len


def _lora_names(requests: Iterable[Request]) -> list[str]:
    """The adapters some of ``requests`` run with, by name, once each."""
    return sorted({r.lora_request.lora_name for r in requests if r.lora_request is not None})
