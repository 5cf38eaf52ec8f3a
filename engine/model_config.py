"""What the engine needs to know about a model, read once from its folder: ModelConfig, and
each family's config translated into it in one place (``ARCHITECTURES``)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def _llama_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Llama and Mistral: biases only where the config asks (attention_bias, mlp_bias)."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "qk_norm": False, "window": cfg.get("sliding_window")}  # fmt: skip


def _qwen2_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2 / Qwen2.5: biases on q, k and v (not o); a window only with use_sliding_window."""
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": False, "qk_norm": False,
            "window": _qwen_window(cfg), "layer_types": _qwen_layer_types(cfg)}  # fmt: skip


def _qwen3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen3: an RMSNorm over each q and k head before RoPE; biases where attention_bias."""
    bias = bool(cfg.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "window": _qwen_window(cfg), "layer_types": _qwen_layer_types(cfg)}  # fmt: skip


def _phi3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3, Phi-3.5, Phi-4-mini: q/k/v and gate/up fused in the checkpoint, RoPE over the
    first partial_rotary_factor of each head (longrope: the rope type, read below)."""
    return {"qkv_bias": False, "o_bias": False, "mlp_bias": False, "qk_norm": False,
            "fused_checkpoint": True, "window": cfg.get("sliding_window")}  # fmt: skip


def _gemma3_flags(cfg: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3 (text): RMSNorm as (1 + w), norms before and after attention and the MLP,
    embeddings scaled by sqrt(hidden), GeGLU (tanh GELU), q/k norms, attention scaled by
    query_pre_attn_scalar, sliding layers interleaved with global ones (layer_types, or every
    sliding_window_pattern-th layer global), each kind with its own RoPE base."""
    for key in ("final_logit_softcapping", "attn_logit_softcapping"):
        if cfg.get(key) is not None:
            raise ValueError(f"Gemma 3 with {key} {cfg[key]} is not supported (Lumen runs it null)")
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("Gemma 3 with use_bidirectional_attention is not supported")
    bias = bool(cfg.get("attention_bias", False))
    pattern = cfg.get("sliding_window_pattern", 6)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
        for i in range(cfg["num_hidden_layers"])
    ]
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": False, "qk_norm": True,
            "gemma": True, "window": cfg.get("sliding_window"), "layer_types": types}  # fmt: skip


def _qwen_window(cfg: dict[str, Any]) -> int | None:
    """Qwen configs carry sliding_window beside use_sliding_window: false, which turns it off."""
    sliding = "sliding_attention" in (cfg.get("layer_types") or [])
    return cfg.get("sliding_window") if cfg.get("use_sliding_window") or sliding else None


def _qwen_layer_types(cfg: dict[str, Any]) -> list[str] | None:
    """Qwen2/Qwen3 window only the layers from max_window_layers on (transformers' rule)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    first = cfg.get("max_window_layers", cfg["num_hidden_layers"])
    return ["sliding_attention" if i >= first else "full_attention"
            for i in range(cfg["num_hidden_layers"])]  # fmt: skip


# The one registry of families: each architecture's config translated into the switches the
# shared decoder (engine/worker/llama.py) takes. They differ from Llama only by these flags,
# so they share one module.
ARCHITECTURES = {
    "LlamaForCausalLM": _llama_flags,
    "MistralForCausalLM": _llama_flags,
    "Qwen2ForCausalLM": _qwen2_flags,
    "Qwen3ForCausalLM": _qwen3_flags,
    "Phi3ForCausalLM": _phi3_flags,
    "Gemma3ForCausalLM": _gemma3_flags,
}
SUPPORTED_ARCHITECTURES = tuple(ARCHITECTURES)


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, read from its config.json."""

    path: str
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    qkv_bias: bool = False  # biases on the q, k and v projections (Qwen2)
    o_bias: bool = False  # ... and on the output projection
    mlp_bias: bool = False  # ... and on gate, up and down
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3)
    fused_checkpoint: bool = False  # the checkpoint holds qkv_proj and gate_up_proj (Phi-3)
    rotary_dim: int = 0  # RoPE rotates a head's first rotary_dim dims (0: all of head_dim)
    # Sliding-window attention: a local layer's query at position p reads the keys at
    # (p - sliding_window, p] (transformers' rule); 0 is no window. One window per model.
    sliding_window: int = 0
    local_layers: tuple[int, ...] = ()  # the sliding_attention layers
    local_rope_theta: float = 0.0  # the local layers' own RoPE base (0: rope_theta)
    gemma: bool = False  # Gemma 3's layer (see _gemma3_flags); query_pre_attn_scalar below
    query_pre_attn_scalar: float = 0.0  # attention scaled by its -1/2 power (0: head_dim's)

    @classmethod
    def from_path(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{path} is not a model folder: it has no config.json")
        cfg = json.loads(cfg_file.read_text())
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r} in {path}: "
                f"Lumen runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        flags = ARCHITECTURES[arch](cfg)
        max_positions = cfg.get("max_position_embeddings", 2048)
        flags.update(_windows(cfg, flags.pop("window"), flags.pop("layer_types", None)))
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        # transformers 5 moved rope_theta (and the scaling dict) into rope_parameters; Gemma 3
        # keeps one dict per layer type there (older configs: rope_local_base_freq).
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        if "full_attention" in rope:
            local = rope.get("sliding_attention") or {}
            rope = dict(rope["full_attention"])
            flags["local_rope_theta"] = float(local.get("rope_theta", 10000.0))
        elif flags.get("gemma"):
            flags["local_rope_theta"] = float(cfg.get("rope_local_base_freq", 10000.0))
        if flags.get("gemma"):
            flags["query_pre_attn_scalar"] = float(cfg.get("query_pre_attn_scalar", head_dim))
        rope_theta = float(rope.pop("rope_theta", cfg.get("rope_theta", 10000.0)))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "longrope"):
            raise ValueError(f"unsupported rope type {rope_type!r} in {path}")
        # Partial RoPE (Phi-3): at the top level, or among transformers 5's rope_parameters.
        partial = float(
            rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor") or 1.0
        )
        flags["rotary_dim"] = int(head_dim * partial) if partial != 1.0 else 0
        if rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") or cfg.get(
                "original_max_position_embeddings", max_positions
            )
            rope = {**rope, "original_max_position_embeddings": original,
                    "factor": rope.get("factor") or max_positions / original}  # fmt: skip
        return cls(
            path=str(path),
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads", num_heads),
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=None if rope_type == "default" else {**rope, "rope_type": rope_type},
            max_position_embeddings=max_positions,
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            eos_token_ids=_eos_token_ids(path, cfg, flags.get("gemma", False)),
            **flags,
        )

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        # An 8-bit cache's row: head_dim codes and a 4-byte scale (engine/worker/kv_quant.py).
        row = self.head_dim * dtype.itemsize + (4 if dtype.itemsize == 1 else 0)
        return 2 * self.num_layers * self.num_kv_heads * row


def _windows(cfg: dict[str, Any], window: int | None, types: list[str] | None) -> dict[str, Any]:
    """The sliding window and the layers of the local kind: those layer_types names
    sliding_attention, or every layer where the family has no layer_types (Mistral, Phi-3).
    A window as long as the context is none (its layers keep their own RoPE base)."""
    if not window:
        return {}
    if types is not None and len(types) != cfg["num_hidden_layers"]:
        raise ValueError(f"layer_types names {len(types)} layers, the model has "
                         f"{cfg['num_hidden_layers']}")  # fmt: skip
    layers = tuple(
        i for i in range(cfg["num_hidden_layers"])
        if types is None or types[i] == "sliding_attention"
    )  # fmt: skip
    within = window < cfg.get("max_position_embeddings", 2048)
    return {"sliding_window": int(window) if within and layers else 0, "local_layers": layers}


def _eos_token_ids(path: Path, cfg: dict[str, Any], gemma: bool = False) -> tuple[int, ...]:
    """generation_config.json's eos_token_id, else config.json's; for Gemma, its end-of-turn
    token too (a GGUF file's config names only <eos>, the hub's generation config both)."""
    gen_file = path / "generation_config.json"
    eos = json.loads(gen_file.read_text()).get("eos_token_id") if gen_file.is_file() else None
    if eos is None:
        eos = cfg.get("eos_token_id")
    ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    end_of_turn = _added_token(path, "<end_of_turn>") if gemma else None
    return (*ids, end_of_turn) if end_of_turn is not None and end_of_turn not in ids else ids


def _added_token(path: Path, content: str) -> int | None:
    """The id of an added token of tokenizer.json, found in the added_tokens list at its
    head without parsing the whole file (Gemma's is 33 MB)."""
    try:
        with open(path / "tokenizer.json", "rb") as fh:
            head = fh.read(1 << 20)
    except OSError:
        return None
    pattern = rb'"id":\s*(\d+),\s*"content":\s*"' + re.escape(content.encode()) + rb'"'
    found = re.search(pattern, head)
    return int(found.group(1)) if found else None
