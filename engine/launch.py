"""Starting the core process ahead of the engine that will use it: part of the engine's public
surface, for `lumen serve`, which launches the core before importing the server."""

from __future__ import annotations

import dataclasses

from engine.config import EngineConfig
from engine.model_files import resolve_model, resolve_tokenizer
from engine.mp_client import CoreProcess

__all__ = ["CoreProcess", "launch_core"]


def launch_core(config: EngineConfig) -> CoreProcess:
    """The core process for ``config``, spawned now and not waited for: pass it to
    ``AsyncLLM(config, core=...)``, which waits for its READY. The core then imports torch and
    loads the model while the caller does its own start-up (the server's imports, about 3 s
    on 2 cores). A core nobody waits for is killed when the interpreter exits."""
    path = str(resolve_model(config.model))
    if config.tokenizer is not None:  # the core's grammars read it
        config = dataclasses.replace(config, tokenizer=resolve_tokenizer(config.tokenizer, path))
    return CoreProcess(config, path)
