"""Starting the core process ahead of the engine that will use it: part of the engine's public
surface, for `lumen serve`, which launches the core before importing the server."""

from __future__ import annotations

import os

from engine.config import EngineConfig
from engine.model_files import resolve_config
from engine.mp_client import STARTUP_TIMEOUT_S, CoreProcess

__all__ = ["STARTUP_TIMEOUT_S", "CoreProcess", "launch_core", "launch_cores"]


def launch_core(
    config: EngineConfig, *, supervised: bool = False, dp_rank: int = 0, dp_size: int = 1
) -> CoreProcess:
    """The core process for ``config``, spawned now and not waited for: pass it to
    ``AsyncLLM(config, core=...)``, which waits for its READY. The core then imports torch and
    loads the model while the caller does its own start-up (the server's imports, about 3 s
    on 2 cores). A core nobody waits for is killed when the interpreter exits.
    ``supervised``: for ``AsyncLLM(..., supervised=True)``: the core tells this process of a
    SIGTERM instead of exiting. ``dp_rank`` of ``dp_size``: one of a data-parallel group's
    engines (``launch_cores`` starts them all)."""
    path, config = resolve_config(config)
    notify_pid = os.getpid() if supervised else None
    return CoreProcess(config, path, notify_pid=notify_pid, dp_rank=dp_rank, dp_size=dp_size)


def launch_cores(config: EngineConfig, data_parallel_size: int) -> list[CoreProcess]:
    """The supervised core processes of ``data_parallel_size`` engines, spawned now (as
    ``launch_core``), in rank order."""
    path, config = resolve_config(config)
    return [
        CoreProcess(config, path, notify_pid=os.getpid(), dp_rank=r, dp_size=data_parallel_size)
        for r in range(data_parallel_size)
    ]
