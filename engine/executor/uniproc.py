"""UniProcExecutor: the one worker lives inside the EngineCore process."""

from __future__ import annotations

import torch

from engine import spec_config
from engine.config import EngineConfig
from engine.kv_layout import KVLayout
from engine.lora import LoRARequest
from engine.model_config import ModelConfig
from engine.worker.messages import ModelRunnerOutput, SchedulerOutput
from engine.worker.model_runner import ModelRunner
from engine.worker.profiler import Profiler


class UniProcExecutor:
    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        owns_process: bool = False,
    ) -> None:
        self.runner = ModelRunner(
            model_config, device, dtype, max_model_len, config.block_size, config.seed,
            kv_dtype=config.resolve_kv_cache_dtype(dtype), quantization=config.quantization,
            kv_layout=KVLayout.of(model_config, not config.disable_hybrid_kv_cache_manager),
            speculative=spec_config.parse(config.speculative_config),
            lora=config.lora_settings(),
        )  # fmt: skip
        self.runner.owns_process = owns_process
        self.runner.load_model()
        self.profiler = Profiler()

    def block_bytes(self) -> int:
        return self.runner.block_bytes()

    def init_kv_cache(self, num_blocks: int) -> None:
        self.runner.init_kv_cache(num_blocks)

    def release_kv_cache(self) -> None:
        self.runner.release_kv_cache()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(sched)

    def prefetch_lora(self, lora: LoRARequest) -> None:
        if self.runner.lora is not None:
            self.runner.lora.prefetch(lora)

    def start_profile(self, path: str) -> None:
        self.profiler.start(path)

    def stop_profile(self) -> None:
        self.profiler.stop()

    def check_health(self) -> None:
        pass

    @property
    def sentinels(self) -> list[int]:
        return []

    def shutdown(self) -> None:
        self.profiler.stop()
        self.runner.release_kv_cache()
