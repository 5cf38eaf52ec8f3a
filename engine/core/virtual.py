"""VirtualCore: the EngineCore's scheduler and KV cache with no model, on a virtual clock.

Replay's virtual runs and the scheduler benchmark drive it. The scheduler, its
queues and the KV cache manager are the real ones, built from an EngineConfig
the way EngineCore builds its own (``Scheduler.from_config``). A step
"samples" one placeholder token for each row that samples; the caller prices
the step (a step-cost model) and keeps the clock.
"""

from __future__ import annotations

from pathlib import Path

from engine.config import EngineConfig
from engine.core.scheduler import Scheduler
from engine.kv_layout import KVLayout
from engine.messages import EngineCoreOutput, EngineCoreRequest
from engine.model_config import ModelConfig
from engine.request import Request
from engine.worker.messages import ModelRunnerOutput, SchedulerOutput


class VirtualCore:
    """``config`` must name its ``num_kv_blocks`` and ``max_model_len``: there is no memory to
    size a KV cache from, and no model to take a context length from. Where ``config.model``
    is a model folder here, its KV groups are the real core's (engine/kv_layout.py: blocks
    behind a sliding window freed); else every layer is in one group."""

    def __init__(self, config: EngineConfig, *, token: int = 0) -> None:
        if config.num_kv_blocks is None or config.max_model_len is None:
            raise ValueError("a virtual core needs num_kv_blocks and max_model_len")
        self.config = config
        self.max_model_len = config.max_model_len
        windows: tuple[int, ...] = (0,)
        if config.model and (Path(config.model) / "config.json").is_file():
            layout = KVLayout.of(
                ModelConfig.from_path(config.model), not config.disable_hybrid_kv_cache_manager
            )
            windows = layout.windows
        self.scheduler = Scheduler.from_config(
            config, config.num_kv_blocks, config.max_model_len, windows
        )
        self.token = token

    def add_request(self, request: EngineCoreRequest) -> None:
        if not 0 < len(request.prompt_token_ids) < self.max_model_len:
            raise ValueError(f"a prompt of {len(request.prompt_token_ids)} tokens does not fit "
                             f"max_model_len {self.max_model_len}")  # fmt: skip
        self.scheduler.add_request(Request.from_wire(request, self.max_model_len))

    def has_requests(self) -> bool:
        return self.scheduler.has_requests()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def step(self) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
        """Schedule one step and apply its placeholder tokens; no rows, no outputs."""
        out = self.scheduler.schedule()
        if not out.req_ids:
            return out, []
        sampled = [rid for rid, s in zip(out.req_ids, out.sample) if s]
        runner = ModelRunnerOutput(sampled, [self.token] * len(sampled))
        return out, self.scheduler.update_from_output(out, runner)
