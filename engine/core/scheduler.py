"""Scheduler: one token budget that catches every request up to its target, each step."""

from __future__ import annotations

import logging

from engine import faults, spec_config
from engine.config import EngineConfig
from engine.core.grammar import GrammarManager
from engine.core.kv_cache_manager import KVCacheManager
from engine.core.request_queue import FCFSQueue, PriorityQueue
from engine.messages import EngineCoreOutput, Logprobs
from engine.request import Request, RequestStatus
from engine.spec_config import SpeculativeConfig
from engine.worker.messages import ModelRunnerOutput, NewRequestData, SchedulerOutput

logger = logging.getLogger(__name__)
FREED_FINISH, FREED_ABORT, FREED_PREEMPT = 0, 1, 2
# Speculative decoding's rule per request: one whose drafts the model keeps under SPEC_MIN_RATE
# (averaged over its verifying steps, each halving the weight of those before) proposes none for
# SPEC_PAUSE_STEPS steps, then tries again from SPEC_RETRY_RATE. Refused drafts cost their
# share of the verifying pass and of the proposer: a proposer that misses wastes them each step.
SPEC_MIN_RATE, SPEC_PAUSE_STEPS, SPEC_RETRY_RATE = 0.2, 16, 0.5


class Scheduler:
    """Decides, each step, how many tokens every request computes.

    The one rule: a request is given ``num_tokens - num_computed_tokens``
    tokens (its prompt, the rest of a chunked prompt, or its last sampled
    token), capped by the step's token budget, ``max_num_seqs`` and the free
    KV blocks. Running requests go first; waiting ones are admitted with what
    budget is left. When blocks run out, the lowest-priority running request
    is preempted: its blocks are freed and it recomputes later.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: str = "fcfs",
    ) -> None:
        self.kv_cache = kv_cache
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.waiting = PriorityQueue() if policy == "priority" else FCFSQueue()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._new_req_ids: set[str] = set()
        self._finished_req_ids: list[str] = []
        self._step_id = 0
        self.num_preemptions_total = 0
        # KV blocks released since the last step record, by cause (finish, abort, preemption).
        self.num_freed_blocks = [0, 0, 0]
        self.fault = faults.nothing  # EngineCore arms LUMEN_DEBUG_DELAY's schedule site
        # Structured outputs (engine/core/grammar.py): requests whose grammar is compiling wait
        # here, outside the queue, so they hold up nothing; a grammar that failed ends its
        # request with an error the core reports.
        self.grammars: GrammarManager | None = None
        self.compiling: list[Request] = []
        self.num_grammars = 0  # requests holding a grammar, compiling or not
        self.grammar_errors: list[tuple[Request, str]] = []
        # Speculative decoding (--speculative-config): drafts are verified while at most
        # spec_max_rows requests run, or as the user's batch-size table says
        # (SpeculativeConfig.k_for).
        self.speculative: SpeculativeConfig | None = None
        self.spec_max_rows = 0
        # LoRA (--enable-lora): at most max_loras adapters in one batch; 0 = LoRA off.
        self.max_loras = 0

    @classmethod
    def from_config(
        cls, config: EngineConfig, num_blocks: int, max_model_len: int,
        kv_windows: tuple[int, ...] = (0,),
    ) -> Scheduler:  # fmt: skip
        """The scheduler of a core (real or virtual) with ``num_blocks`` KV blocks, in KV
        groups of ``kv_windows`` (engine/kv_layout.py)."""
        scheduler = cls(
            KVCacheManager(num_blocks, config.block_size, config.enable_prefix_caching, kv_windows),
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=max_model_len,
            policy=config.scheduling_policy,
        )
        scheduler.speculative = spec_config.parse(config.speculative_config)
        if scheduler.speculative is not None:
            scheduler.spec_max_rows = scheduler.speculative.disable_by_batch_size
        if config.enable_lora:
            scheduler.max_loras = config.max_loras
        return scheduler

    # -- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self._new_req_ids.add(request.request_id)
        so = request.sampling_params.structured_outputs
        if so is not None and so.spec and self.grammars is not None:
            request.grammar = self.grammars.add(so.spec)
            self.num_grammars += 1
            if not self._grammar_ready(request):
                self.compiling.append(request)
                return
        self.waiting.add(request)

    def _grammar_ready(self, request: Request) -> bool:
        """Poll a request's grammar; a failed one ends the request (grammar_errors)."""
        assert self.grammars is not None
        if not self.grammars.poll(request.grammar):
            return False
        if request.grammar.error is not None:
            self.grammar_errors.append((request, request.grammar.error))
            request.status = RequestStatus.FINISHED_ABORTED
            self._free(request, FREED_ABORT)
            return False
        return True

    def admit_compiled(self) -> None:
        """Requests whose grammar finished compiling join the queue."""
        still = []
        for request in self.compiling:
            if self._grammar_ready(request):
                self.waiting.add(request)
            elif request.grammar.error is None:
                still.append(request)
        self.compiling = still

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """End requests from outside (abort); unknown or finished ids are ignored."""
        done = []
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.compiling:
                self.compiling.remove(request)
            else:
                self.waiting.remove(request)
            request.status = status
            self._free(request, FREED_ABORT)
            done.append(request)
        return done

    def has_requests(self) -> bool:
        return bool(self.requests)

    def has_grammars(self) -> bool:
        """Whether any request holds a grammar (the step fills masks for those it runs)."""
        return self.num_grammars > 0

    def only_compiling(self) -> bool:
        """Every request waits for its grammar: a step would have nothing to run."""
        return len(self.compiling) == len(self.requests) > 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.compiling)

    # -- the step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.fault()
        out = SchedulerOutput(step_id=self._step_id, finished_req_ids=self._finished_req_ids)
        self._step_id += 1
        self._finished_req_ids = []
        if self.compiling:
            self.admit_compiled()
        budget = self.max_num_batched_tokens
        scheduled: dict[str, int] = {}

        # Speculative decoding: the rows that verify drafts this step, and how many drafts the
        # driver proposes for the next (none while the batch is over the rule's size).
        spec = out.spec_token_ids
        if self.speculative is not None:
            out.num_spec_tokens = self.speculative.k_for(len(self.running), self.spec_max_rows)
        # A draft model writes its KV at the k positions past a request's tokens: slots for them.
        ahead = out.num_spec_tokens if self.speculative and self.speculative.needs_kv else 0
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = request.spec_token_ids
            if drafts:
                request.spec_token_ids = []
                # A decoding row verifies its drafts, as many as the budget and the blocks take.
                if num_new == 1 and out.num_spec_tokens and budget > 1:
                    drafts = drafts[: budget - 1]
                    if self.kv_cache.allocate_slots(request, 1 + len(drafts) + ahead,
                                                    num_lookahead=len(drafts) + ahead):  # fmt: skip
                        spec[request.request_id] = drafts
                        scheduled[request.request_id] = 1 + len(drafts)
                        budget -= 1 + len(drafts)
                        i += 1
                        continue
            while not self.kv_cache.allocate_slots(request, num_new + ahead, num_lookahead=ahead):
                victim = self._pick_victim()
                victim_idx = self.running.index(victim)
                self._preempt(victim)
                out.preempted_req_ids.append(victim.request_id)
                if victim is request:
                    break
                budget += scheduled.pop(victim.request_id, 0)
                spec.pop(victim.request_id, None)
                if victim_idx < i:
                    i -= 1
            else:
                scheduled[request.request_id] = num_new
                budget -= num_new
                i += 1
                continue
            # The request itself was preempted; i now points at the next one.

        # The adapters in the batch (--enable-lora), kept as requests are admitted.
        loras: set[int] = set()
        if self.max_loras:
            loras = {r.lora_request.lora_int_id for r in self.running if r.lora_request}
        # Admit waiting requests only in a step that preempted nothing, so a
        # preempted request is not immediately overtaken.
        while len(self.waiting):
            if out.num_preemptions:
                out.wait_reason = "preemption"
                break
            if budget <= 0:
                out.wait_reason = "token_budget"
                break
            if len(self.running) >= self.max_num_seqs:
                out.wait_reason = "max_num_seqs"
                break
            head = self.waiting.peek()
            fits = self._lora_fits(out, loras) if self.max_loras else head
            if fits is None:
                break
            request = fits
            # A waiting request has nothing computed (preemption resets it).
            hits, num_hit = self.kv_cache.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit, budget)
            if not self.kv_cache.allocate_slots(request, num_new + ahead, hits, ahead):
                out.wait_reason = "kv_blocks"
                break
            if request is head:
                self.waiting.pop()
            else:  # passed over a request waiting for a LoRA slot
                self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit
            if self.kv_cache.enable_caching:
                out.num_prefix_query_tokens += request.num_tokens
            out.num_prefix_hit_tokens += num_hit
            self.running.append(request)
            scheduled[request.request_id] = num_new
            budget -= num_new
            if request.lora_request is not None:
                loras.add(request.lora_request.lora_int_id)

        self._fill_batch(out, scheduled)
        self.num_preemptions_total += out.num_preemptions
        return out

    @staticmethod
    def _take(request: Request, token: int) -> bool:
        """Append a sampled token; whether the request is done. Its grammar advances through
        each kept token (each was sampled under its position's mask); a token it refuses (its
        mask left nothing, e.g. min_tokens blocking the EOS it required) ends the request rather
        than the output, and so does the grammar's end."""
        if request.check_stop(token):
            return True
        if request.grammar is not None:
            matcher = request.grammar.matcher
            if not matcher.consume_token(token) or matcher.is_stopped():
                request.status = RequestStatus.FINISHED_STOPPED
                return True
        return False

    def update_from_output(
        self, sched: SchedulerOutput, runner: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Advance computed tokens, append samples, stop finished requests."""
        for req_id, token_ids in zip(sched.req_ids, sched.token_ids):
            request = self.requests.get(req_id)
            if request is not None and request.status == RequestStatus.RUNNING:
                request.num_computed_tokens += len(token_ids)
        outputs = []
        spec, kept = sched.spec_token_ids, runner.spec_token_ids
        for req_id, token_id in zip(runner.req_ids, runner.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran: its output is dropped
            new_ids = [token_id]
            finished = self._take(request, token_id)
            if req_id in spec:
                # Drafts the target refused leave the KV behind them unused: the next step
                # writes over it.
                more = kept.get(req_id, ())
                request.num_computed_tokens -= len(spec[req_id]) - len(more)
                request.spec_rate = (request.spec_rate + len(more) / len(spec[req_id])) / 2
                if request.spec_rate < SPEC_MIN_RATE:
                    request.spec_pause, request.spec_rate = SPEC_PAUSE_STEPS, SPEC_RETRY_RATE
                for token in more:  # a stop among the kept drafts drops the tokens after it
                    if finished:
                        break
                    new_ids.append(token)
                    finished = self._take(request, token)
            if request.spec_pause and sched.num_spec_tokens:
                request.spec_pause -= 1  # a step sat out
            elif not finished and (drafts := runner.draft_token_ids.get(req_id)):
                # The next step verifies at most what the request may still produce, less one;
                # under a grammar, the drafts up to the first it refuses (the proposers do not
                # know it), so that every position has a mask (EngineCore._grammar_masks).
                room = request.max_tokens - request.num_output_tokens - 1
                if request.grammar is not None:
                    room = min(room, request.grammar.matcher.validate_tokens(drafts[:room]))
                request.spec_token_ids = drafts[:room]
            logprobs = runner.logprobs.get(req_id)
            if logprobs is not None and len(logprobs.ranks) > len(new_ids):  # ended mid-way
                n = len(new_ids)
                logprobs = Logprobs(logprobs.token_ids[:n], logprobs.logprobs[:n],
                                    logprobs.ranks[:n])  # fmt: skip
            outputs.append(
                EngineCoreOutput(
                    req_id,
                    new_ids,
                    logprobs,
                    request.status.finish_reason,
                    request.stop_reason,
                    request.num_cached_tokens,
                    received_ns=request.received_ns if request.num_output_tokens == 1 else 0,
                )
            )
            if request.grammar is not None and request.num_output_tokens == 1:
                g = request.grammar
                outputs[-1].grammar = (g.ready_ns, g.compile_ns, g.cached)
            if finished:
                self.running.remove(request)
                self._free(request, FREED_FINISH)
        return outputs

    # -- helpers ---------------------------------------------------------------

    def _lora_fits(self, out: SchedulerOutput, running: set[int]) -> Request | None:
        """The first waiting request, in the queue's order, whose adapter is in the batch
        (``running``: the batch's adapter ids) or finds a free slot (--max-loras), as vLLM's
        scheduler skips the others; None when none does. A request passed over records the
        step's wait reason, lora_slots."""
        for request in self.waiting:
            lora = request.lora_request
            if lora is None or lora.lora_int_id in running or len(running) < self.max_loras:
                return request
            out.wait_reason = "lora_slots"
        return None

    def _pick_victim(self) -> Request:
        if self.policy == "priority":
            return max(self.running, key=lambda r: (r.priority, r.arrival_ns))
        return self.running[-1]

    def _preempt(self, victim: Request) -> None:
        self.running.remove(victim)
        victim.spec_token_ids = []
        self.num_freed_blocks[FREED_PREEMPT] += self.kv_cache.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.waiting.add_preempted(victim)

    def _fill_batch(self, out: SchedulerOutput, scheduled: dict[str, int]) -> None:
        for req_id, num_new in scheduled.items():
            request = self.requests[req_id]
            start = request.num_computed_tokens
            if req_id in self._new_req_ids:
                self._new_req_ids.discard(req_id)
                out.new_requests.append(
                    NewRequestData(
                        req_id,
                        request.prompt_token_ids,
                        request.sampling_params,
                        request.eos_token_ids,
                        request.lora_request,
                    )
                )
            out.req_ids.append(req_id)
            if out.num_spec_tokens and request.spec_pause:
                out.no_drafts.append(req_id)  # the driver proposes none for it
            drafts = out.spec_token_ids.get(req_id)
            if drafts:
                out.token_ids.append(request.all_token_ids[start:] + drafts)
                num_new -= len(drafts)  # the row still samples: after its last draft
            else:
                out.token_ids.append(request.all_token_ids[start : start + num_new])
            out.num_computed_tokens.append(start)
            tables = self.kv_cache.block_tables(req_id)
            out.block_tables.append(tables[0])
            if len(tables) > 1:
                out.group_block_tables.append(tables[1:])
            out.sample.append(start + num_new == request.num_tokens)
            if drafts:
                out.num_decode_tokens += 1 + len(drafts)  # a decode row with its drafts
            elif start < request.num_prompt_tokens or num_new > 1:
                out.num_prefill_tokens += num_new
            else:
                out.num_decode_tokens += num_new

    def take_freed_blocks(self) -> list[int]:
        """Blocks released since the last call, by cause (FREED_FINISH, _ABORT, _PREEMPT)."""
        freed, self.num_freed_blocks = self.num_freed_blocks, [0, 0, 0]
        return freed

    def has_unreported_frees(self) -> bool:
        return any(self.num_freed_blocks)

    def has_untold_finished(self) -> bool:
        """Requests ended since the last step, which the workers still hold state for."""
        return bool(self._finished_req_ids)

    def idle_output(self) -> SchedulerOutput:
        """No batch, only the ended requests: what the workers hear when nothing runs."""
        out = SchedulerOutput(step_id=-1, finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = []
        return out

    def number_steps_from(self, first: int) -> None:
        """Number this core's steps from ``first``: a restarted core's never meet the old one's."""
        self._step_id = first

    def next_step_id(self) -> int:
        """A step id for a record with no batch (the KV state after aborts)."""
        self._step_id += 1
        return self._step_id - 1

    def _free(self, request: Request, cause: int) -> None:
        if request.grammar is not None:
            self.num_grammars -= 1
        self.num_freed_blocks[cause] += self.kv_cache.free(request)
        del self.requests[request.request_id]
        if request.request_id in self._new_req_ids:
            self._new_req_ids.discard(request.request_id)
        else:
            self._finished_req_ids.append(request.request_id)
