"""The server's LoRA adapters, as vLLM's serving models: the names a request's ``model`` may
take, their cards on /v1/models, and loading and unloading them at run time.

An adapter is checked against the model when it is named (engine/lora.py ``read_spec``: its
config and its safetensors header, no weights), so a folder that does not fit is refused
here, with vLLM's status codes, and never reaches the engine. Each load gets a new id: the
engine keys its prefix cache and its read adapters by it, so an adapter loaded again under
its old name never meets the old weights' KV.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.lora import AdapterSpec, LoraError, LoRARequest, parse_module, read_spec
from engine.model_config import ModelConfig
from service.errors import APIError

logger = logging.getLogger(__name__)

# vLLM's switch for the load and unload routes, honoured beside --allow-runtime-lora-updating.
RUNTIME_ENV = "VLLM_ALLOW_RUNTIME_LORA_UPDATING"


def runtime_updating(flag: bool) -> bool:
    return flag or os.environ.get(RUNTIME_ENV, "").strip().lower() in ("1", "true")


@dataclass(frozen=True)
class Adapter:
    request: LoRARequest
    parent: str
    spec: AdapterSpec
    created: int


class LoraAdapters:
    """The adapters a server serves by name; ``enabled``: the engine runs with --enable-lora."""

    def __init__(
        self, base_name: str, model_config: ModelConfig | None, max_rank: int, enabled: bool
    ) -> None:
        self.base_name, self.cfg, self.max_rank = base_name, model_config, max_rank
        self.enabled = enabled
        self.by_name: dict[str, Adapter] = {}
        self._next_id = 1

    def load(self, name: str, path: str, base_model_name: str | None = None) -> Adapter:
        """Check and add an adapter; APIError (vLLM's codes) if it cannot be served."""
        if not self.enabled or self.cfg is None:
            raise APIError(400, "LoRA is not enabled: start the server with --enable-lora",
                           code="lora_not_enabled")  # fmt: skip
        if not name or not path:
            raise APIError(400, "Both 'lora_name' and 'lora_path' must be provided.")
        if name in self.by_name:
            raise APIError(400, f"The lora adapter '{name}' has already been loaded.")
        if name == self.base_name:
            raise APIError(400, f"'{name}' is the base model's name")
        if base_model_name is not None and base_model_name != self.base_name:
            raise APIError(400, f"base_model_name {base_model_name!r} is not this server's "
                           f"model ({self.base_name!r})")  # fmt: skip
        try:
            spec = read_spec(path, self.cfg, self.max_rank)
        except LoraError as e:
            status = 404 if str(e).startswith("No adapter found") else 400
            raise APIError(status, str(e)) from None
        request = LoRARequest(name, self._next_id, str(Path(path).resolve()))
        self._next_id += 1
        adapter = Adapter(request, self.base_name, spec, int(time.time()))
        self.by_name[name] = adapter
        logger.info("LoRA adapter %s: %s (rank %d, %d modules over %d layers)", name, path,
                    spec.rank, len(spec.modules), spec.num_layers)  # fmt: skip
        return adapter

    def unload(self, name: str) -> None:
        if not name:
            raise APIError(400, "either 'lora_name' and 'lora_int_id' needs to be provided.")
        if self.by_name.pop(name, None) is None:
            raise APIError(404, f"The lora adapter '{name}' cannot be found.",
                           code="model_not_found")  # fmt: skip
        logger.info("LoRA adapter %s unloaded", name)

    def resolve(self, model: str | None) -> LoRARequest | None:
        """The adapter a request's ``model`` names; None for the base model (or none named);
        a 404 for a name nobody serves, as vLLM's."""
        if model is None or model == self.base_name:
            return None
        adapter = self.by_name.get(model)
        if adapter is None:
            raise APIError(404, f"The model `{model}` does not exist.", code="model_not_found",
                           param="model")  # fmt: skip
        return adapter.request

    def cards(self) -> list[dict[str, Any]]:
        """/v1/models entries of the adapters, as vLLM's (root: the folder; parent: the base)."""
        return [
            {"id": name, "object": "model", "created": a.created, "owned_by": "lumen",
             "root": a.request.lora_path, "parent": a.parent}
            for name, a in self.by_name.items()
        ]  # fmt: skip


def start(
    base_name: str, model_path: str | None, modules: tuple[str, ...] | None, enabled: bool,
    max_rank: int,
) -> LoraAdapters:  # fmt: skip
    """The server's adapters with --lora-modules loaded: a ValueError (one line, exit 2) for
    one that cannot be served, or for modules without --enable-lora."""
    if modules and not enabled:
        raise ValueError("--lora-modules needs --enable-lora")
    cfg = ModelConfig.from_path(model_path) if enabled and model_path is not None else None
    adapters = LoraAdapters(base_name, cfg, max_rank, enabled)
    for module in modules or ():
        name, path, parent = parse_module(module)
        try:
            adapters.load(name, path, parent)
        except APIError as e:
            raise ValueError(f"--lora-modules {name}: {e.message}") from None
    return adapters
