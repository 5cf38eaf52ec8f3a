"""Data parallelism: N engines behind one API process, and the rule that picks one per request.

Each engine is an ``AsyncLLM`` with its own core process, KV cache and workers, started and
restarted on its own (service/lifecycle.py supervises each of ``members``). The group answers
as one engine to the server: prompts are prepared once (the engines share one processor),
and each request goes to the engine the rule picks, as vLLM's API server does:

- the lowest ``4 x waiting + running``, as vLLM counts them: the engine's waiting requests
  as its last step reported them, plus those sent to it since; running, the rest of the
  requests open on it (an idle engine's last report is never stale: it has none open);
- ties: the engine that was sent fewer requests, then the lower rank;
- only engines that are alive and responsive (a hung one is left out from the watchdog's
  bound, a dead one until its next core is ready).

Prefix affinity (``prefix_affinity`` > 0, --data-parallel-prefix-affinity): among the engines
whose 4 x waiting + running is within ``prefix_affinity`` of the least loaded engine's, a
request goes to the one that holds the longest run of its prompt's leading KV blocks (ties:
the less loaded, then as above), where that run is at least AFFINITY_MIN_SHARE of the
prompt's full blocks; else the rule above. The share keeps a prefix every prompt starts with
(a system prompt) from drawing every request to the first engine that held it: on the
Mooncake trace, whose every prompt starts with one shared block, affinity without it sent
917 of 918 requests to one engine (SGLang's cache-aware router has the same bar, 0.5 by
default).
What an engine holds is what this process sent it: the full blocks of each prompt, as chained
hashes (llm-d's approximate prefix scorer keeps the same), as many as the engine's KV cache
holds, the most recently sent (a prompt's tail forgotten before its head), forgotten when its
core restarts with an empty cache. Each request is recorded with why it went where it did
(``Routed``): load, prefix, pinned (the X-data-parallel-rank header) or handed (sent again
after an engine failed it before it had sent output).

A request whose engine dies before it sent any output goes to another engine (the rule again,
over the others), as a single engine sends it to its own next core; with none alive it waits
for the first that is, up to ``resubmit_timeout``. One that has sent output fails with
``engine_restarted``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from engine.async_llm import AsyncLLM
from engine.errors import CLIENT, EngineHandOverError, EngineRestartingError
from engine.frontend import FrontendObserver
from engine.lora import LoRARequest
from engine.messages import EngineInfo
from engine.outputs import RequestOutput
from engine.processor import PreparedPrompt, PromptType
from engine.request_ids import new_request_id
from engine.sampling_params import SamplingParams
from engine.stats import IterationStats, StatLogger

if TYPE_CHECKING:
    from engine.mp_client import CoreProcess

logger = logging.getLogger(__name__)

WAITING_WEIGHT = 4  # vLLM's: a waiting request counts as four running ones
AFFINITY_MIN_SHARE = 0.5  # of a prompt's full blocks an engine must hold for affinity


class Routed:
    """Why a request went to its engine (the trace store's requests.routed)."""

    LOAD = "load"  # the lowest 4 x waiting + running
    PREFIX = "prefix"  # prefix affinity: the engine holding its prompt's leading blocks
    PINNED = "pinned"  # the X-data-parallel-rank header
    HANDED = "handed"  # sent again after an engine failed it before it sent output


class EngineGroup:
    """``engines``: one ``AsyncLLM`` per data-parallel rank, in rank order."""

    def __init__(
        self, engines: list[AsyncLLM], resubmit_timeout: float = 0.0, prefix_affinity: int = 0
    ) -> None:
        self.engines = engines
        self.resubmit_timeout = resubmit_timeout
        self.prefix_affinity = prefix_affinity
        # Per rank: the chained hashes of the full prompt blocks sent to it, oldest first, and
        # the core epoch they were sent to (a restarted core starts with an empty cache).
        self._held: list[OrderedDict[int, None]] = [OrderedDict() for _ in engines]
        self._held_epoch = [e.epoch for e in engines]
        for engine in engines:
            engine.hand_over = True
        first = engines[0]
        self.config = first.config
        self.processor, self.tokenizer = first.processor, first.tokenizer
        # Per rank: the waiting requests its last step reported, those sent since, and how
        # many it was ever sent.
        self._step_waiting = [0] * len(engines)
        self._sent_since_step = [0] * len(engines)
        self.num_sent = [0] * len(engines)
        self._where: dict[str, AsyncLLM] = {}  # open request -> the engine serving it
        for engine in engines:
            engine.add_stat_logger(_StepCounts(self, engine.rank))

    @classmethod
    def start(
        cls, config: Any, cores: list[CoreProcess], *, tokenizer: Any = None, **options: Any
    ) -> EngineGroup:
        """The group over ``cores`` (one per rank, in order), each engine an
        ``AsyncLLM(config, core=..., **options)``; they share the first one's processor (and
        the ``tokenizer`` it loads). ``prefix_affinity``: the group's (0: off)."""
        affinity = options.pop("prefix_affinity", 0)
        first = AsyncLLM(config, core=cores[0], tokenizer=tokenizer, **options)
        rest = [
            AsyncLLM(config, core=core, processor=first.processor, **options) for core in cores[1:]
        ]
        return cls([first, *rest], options.get("resubmit_timeout", 0.0), affinity)

    # -- the engine's surface the server uses ----------------------------------------------

    @property
    def members(self) -> tuple[AsyncLLM, ...]:
        return tuple(self.engines)

    @property
    def is_alive(self) -> bool:
        """At least one engine can serve."""
        return any(e.is_alive for e in self.engines)

    @property
    def info(self) -> EngineInfo:
        return self.engines[0].info

    @property
    def max_model_len(self) -> int:
        return self.engines[0].max_model_len

    @property
    def epoch(self) -> int:
        """Cores started after the first ones, over every engine."""
        return sum(e.epoch for e in self.engines)

    @property
    def num_failed(self) -> int:
        return sum(e.num_failed for e in self.engines)

    @property
    def num_backpressure(self) -> int:
        return sum(e.num_backpressure for e in self.engines)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        return self.engines[0].tokenize(prompt)

    def apply_chat_template(self, messages: list[dict], **options: Any) -> list[int]:
        return self.engines[0].apply_chat_template(messages, **options)

    def prepare(
        self, prompt: PromptType, params: SamplingParams, lora_request: LoRARequest | None = None
    ) -> PreparedPrompt:
        return self.engines[0].prepare(prompt, params, lora_request)

    def observe(self, observer: FrontendObserver) -> None:
        for engine in self.engines:
            engine.observe(observer)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        for engine in self.engines:
            engine.add_stat_logger(stat_logger)

    def engine_of(self, request_id: str) -> int | None:
        """The rank serving an open request."""
        engine = self._where.get(request_id)
        return None if engine is None else engine.rank

    # -- balancing -------------------------------------------------------------------------

    def load(self, rank: int) -> tuple[int, int]:
        """(waiting, running) of engine ``rank``, as the rule counts them."""
        open_here = self.engines[rank].num_open
        waiting = min(self._step_waiting[rank] + self._sent_since_step[rank], open_here)
        return waiting, open_here - waiting

    def stepped(self, rank: int, num_waiting: int) -> None:
        """Engine ``rank``'s step reported ``num_waiting`` requests waiting."""
        self._step_waiting[rank] = num_waiting
        self._sent_since_step[rank] = 0

    def score(self, rank: int) -> int:
        """vLLM's load of engine ``rank``: 4 x waiting + running."""
        waiting, running = self.load(rank)
        return WAITING_WEIGHT * waiting + running

    def pick(self, exclude: AsyncLLM | None = None) -> AsyncLLM | None:
        """The engine the rule sends the next request to; None if none can take it."""
        best: AsyncLLM | None = None
        best_key: tuple[int, int, int] | None = None
        for engine in self._serving(exclude):
            key = (self.score(engine.rank), self.num_sent[engine.rank], engine.rank)
            if best_key is None or key < best_key:
                best, best_key = engine, key
        return best

    def _serving(self, exclude: AsyncLLM | None = None) -> list[AsyncLLM]:
        return [e for e in self.engines
                if e is not exclude and e.is_alive and e.responsive]  # fmt: skip

    def block_hashes(self, token_ids: list[int]) -> list[int]:
        """The chained hashes of the prompt's full KV blocks (equal hashes: equal prefixes)."""
        size, out, h = self.config.block_size, [], 0
        for end in range(size, len(token_ids) + 1, size):
            h = hash((h, *token_ids[end - size : end]))
            out.append(h)
        return out

    def _record(self, rank: int) -> OrderedDict[int, None]:
        """Engine ``rank``'s record of the blocks sent to it, emptied where its core restarted."""
        if self._held_epoch[rank] != self.engines[rank].epoch:
            self._held[rank].clear()
            self._held_epoch[rank] = self.engines[rank].epoch
        return self._held[rank]

    def held_blocks(self, rank: int, hashes: list[int]) -> int:
        """How many of ``hashes``' leading blocks engine ``rank`` holds, as far as this process
        sent them."""
        held, n = self._record(rank), 0
        for h in hashes:
            if h not in held:
                break
            n += 1
        return n

    def _remember(self, rank: int, hashes: list[int]) -> None:
        """The prompt's blocks sent to engine ``rank``, its head the most recent (a cache
        frees a sequence's tail first); at most a block per block of its KV cache's group."""
        held, info = self._record(rank), self.engines[rank].info
        for h in reversed(hashes):
            held[h] = None
            held.move_to_end(h)
        room = max(info.num_kv_blocks // max(len(info.kv_windows), 1), 1)
        while len(held) > room:
            held.popitem(last=False)

    def route(self, token_ids: list[int]) -> tuple[AsyncLLM | None, str, list[int]]:
        """The engine for a new request, why (Routed) and its prompt's block hashes (empty
        without affinity): prefix affinity where on and an engine within ``prefix_affinity``
        of the least loaded holds AFFINITY_MIN_SHARE of its blocks, else the load rule."""
        by_load = self.pick()
        if not self.prefix_affinity or by_load is None:
            return by_load, Routed.LOAD, []
        hashes = self.block_hashes(token_ids)
        least = self.score(by_load.rank)
        best, best_key = None, (0, 0, 0, 0)
        for engine in self._serving():
            rank = engine.rank
            held, score = self.held_blocks(rank, hashes), self.score(rank)
            key = (held, -score, -self.num_sent[rank], -rank)
            enough = held and held >= AFFINITY_MIN_SHARE * len(hashes)
            if enough and score - least <= self.prefix_affinity and key > best_key:
                best, best_key = engine, key
        if best is None:
            return by_load, Routed.LOAD, hashes
        return best, Routed.PREFIX, hashes

    async def _next_engine(self, failed: AsyncLLM) -> AsyncLLM | None:
        """Another engine for a request ``failed`` handed back, waiting up to the resubmit
        timeout for one to be alive; None if none came."""
        deadline = time.monotonic() + self.resubmit_timeout
        while (engine := self.pick(exclude=failed)) is None:
            if failed.is_alive and failed.responsive:
                return failed  # its own next core was the first ready
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(0.05)
        return engine

    async def generate_prepared(
        self,
        prompt: PreparedPrompt,
        *,
        request_id: str | None = None,
        direct: Callable[[RequestOutput], bool] | None = None,
        data_parallel_rank: int | None = None,
        **options: Any,
    ) -> AsyncGenerator[RequestOutput, None]:
        """As ``AsyncLLM.generate_prepared``, on the engine the rule picks, or on engine
        ``data_parallel_rank`` where it names one that can serve (vLLM's X-data-parallel-rank,
        for a replay of a recorded split; a dead or hung one leaves it to the rule)."""
        request_id = request_id or new_request_id()
        engine, routed, hashes = self.route(prompt.prompt_token_ids)
        if data_parallel_rank is not None:
            asked = self.engines[data_parallel_rank]
            if asked.is_alive and asked.responsive:
                engine, routed = asked, Routed.PINNED
        if engine is None:  # every engine is restarting or hung
            raise EngineRestartingError("no engine can serve now (all are restarting)")
        attempt = 0
        while True:
            rank = engine.rank
            self._sent_since_step[rank] += 1
            self.num_sent[rank] += 1
            self._where[request_id] = engine
            if hashes:
                self._remember(rank, hashes)
            outputs = engine.generate_prepared(
                prompt, request_id=request_id, direct=direct, attempt=attempt, routed=routed,
                **options,
            )  # fmt: skip
            try:
                async with contextlib.aclosing(outputs):
                    async for out in outputs:
                        yield out
                return
            except EngineHandOverError as e:
                failed = engine
                try:
                    next_engine = await self._next_engine(failed)
                except BaseException:  # its caller went away while it waited
                    await failed.abort(request_id)
                    raise
                if next_engine is None:
                    failed.handed_over(request_id, e)
                    raise EngineRestartingError(
                        f"{e}; no engine was ready within {self.resubmit_timeout:g} s"
                    ) from None
                failed.handed_over(request_id)
                logger.info("%s: engine %d failed before it sent output; sent to engine %d",
                            request_id, failed.rank, next_engine.rank)  # fmt: skip
                engine, attempt, routed = next_engine, attempt + 1, Routed.HANDED
            finally:
                if self._where.get(request_id) is engine:
                    del self._where[request_id]

    async def generate(
        self, prompt: PromptType, params: SamplingParams, **options: Any
    ) -> AsyncGenerator[RequestOutput, None]:
        prepared = self.prepare(prompt, params)
        outputs = self.generate_prepared(prepared, **options)
        async with contextlib.aclosing(outputs):
            async for out in outputs:
                yield out

    async def abort(self, request_id: str, code: str = CLIENT) -> None:
        engine = self._where.get(request_id)
        if engine is not None:
            await engine.abort(request_id, code)

    async def abort_all(self, message: str) -> int:
        counts = await asyncio.gather(*(e.abort_all(message) for e in self.engines))
        return sum(counts)

    async def shutdown(self) -> None:
        await asyncio.gather(*(e.shutdown() for e in self.engines))


def start_group(config: Any, size: int) -> EngineGroup:
    """``size`` engines for ``config`` in this process's care (unsupervised: a core that dies
    fails its requests, as one AsyncLLM's does), for a replay of a recorded split. Call inside
    a running event loop."""
    from engine.launch import launch_core

    return EngineGroup.start(
        config, [launch_core(config, dp_rank=r, dp_size=size) for r in range(size)]
    )


class _StepCounts:
    """A stat logger of one engine: its steps' waiting counts, for the rule."""

    __slots__ = ("group", "rank")

    def __init__(self, group: EngineGroup, rank: int) -> None:
        self.group, self.rank = group, rank

    def record(self, stats: IterationStats) -> None:
        if stats.step is not None:
            self.group.stepped(self.rank, stats.step.num_waiting)
