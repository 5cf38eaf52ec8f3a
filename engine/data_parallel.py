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
from collections.abc import AsyncGenerator, Callable
from typing import TYPE_CHECKING, Any

from engine.async_llm import AsyncLLM
from engine.errors import CLIENT, EngineHandOverError, EngineRestartingError
from engine.frontend import FrontendObserver
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


class EngineGroup:
    """``engines``: one ``AsyncLLM`` per data-parallel rank, in rank order."""

    def __init__(self, engines: list[AsyncLLM], resubmit_timeout: float = 0.0) -> None:
        self.engines = engines
        self.resubmit_timeout = resubmit_timeout
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
        the ``tokenizer`` it loads)."""
        first = AsyncLLM(config, core=cores[0], tokenizer=tokenizer, **options)
        rest = [
            AsyncLLM(config, core=core, processor=first.processor, **options) for core in cores[1:]
        ]
        return cls([first, *rest], options.get("resubmit_timeout", 0.0))

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

    def prepare(self, prompt: PromptType, params: SamplingParams) -> PreparedPrompt:
        return self.engines[0].prepare(prompt, params)

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

    def pick(self, exclude: AsyncLLM | None = None) -> AsyncLLM | None:
        """The engine the rule sends the next request to; None if none can take it."""
        best: AsyncLLM | None = None
        best_key: tuple[int, int, int] | None = None
        for engine in self.engines:
            if engine is exclude or not (engine.is_alive and engine.responsive):
                continue
            waiting, running = self.load(engine.rank)
            key = (WAITING_WEIGHT * waiting + running, self.num_sent[engine.rank], engine.rank)
            if best_key is None or key < best_key:
                best, best_key = engine, key
        return best

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
        engine = self.pick()
        if data_parallel_rank is not None:
            asked = self.engines[data_parallel_rank]
            engine = asked if asked.is_alive and asked.responsive else engine
        if engine is None:  # every engine is restarting or hung
            raise EngineRestartingError("no engine can serve now (all are restarting)")
        attempt = 0
        while True:
            rank = engine.rank
            self._sent_since_step[rank] += 1
            self.num_sent[rank] += 1
            self._where[request_id] = engine
            outputs = engine.generate_prepared(
                prompt, request_id=request_id, direct=direct, attempt=attempt, **options
            )
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
                engine, attempt = next_engine, attempt + 1
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
