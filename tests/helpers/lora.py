"""LoRA adapters for tests: random PEFT folders for a checkpoint, and the checkpoint with an
adapter merged into its weights (what Hugging Face runs as the reference)."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base: Path, out: Path, *, rank: int = 8, alpha: float = 16, targets: tuple[str, ...] = ALL,
    seed: int = 0, rslora: bool = False, layers: tuple[int, ...] | None = None,
    size: float = 1.0,
) -> Path:  # fmt: skip
    """A PEFT LoRA folder for ``base``'s modules in ``targets`` (of ``layers``, default all),
    with random A and B (PEFT starts B at zero; a trained adapter's is not): its deltas move
    the tiny model's greedy tokens. ``size`` scales them."""
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for key, w in sorted(weights.items()):
        parts = key.split(".")
        if len(parts) < 5 or parts[-2] not in targets or parts[-1] != "weight":
            continue
        layer = int(parts[2])
        if layers is not None and layer not in layers:
            continue
        fan_out, fan_in = w.shape
        stem = "base_model.model." + key.removesuffix(".weight")
        a = torch.randn(rank, fan_in, generator=g) / math.sqrt(fan_in)
        b = torch.randn(fan_out, rank, generator=g) * size * w.std() * math.sqrt(fan_in / rank)
        tensors[f"{stem}.lora_A.weight"], tensors[f"{stem}.lora_B.weight"] = a, b
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"))
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha, "target_modules": list(targets),
        "use_rslora": rslora, "bias": "none", "lora_dropout": 0.0,
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM",
    }))  # fmt: skip
    return out


def merged(base: Path, adapter: Path, out: Path) -> Path:
    """``base`` with ``adapter``'s deltas added to its weights (W + s B A), beside its other
    files: the reference a LoRA engine must match."""
    conf = json.loads((adapter / "adapter_config.json").read_text())
    weights = load_file(str(base / "model.safetensors"))
    lora = load_file(str(adapter / "adapter_model.safetensors"))
    for key in [k for k in lora if ".lora_A." in k]:
        a, b = lora[key], lora[key.replace(".lora_A.", ".lora_B.")]
        r = a.shape[0]
        s = conf["lora_alpha"] / (math.sqrt(r) if conf.get("use_rslora") else r)
        target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        weights[target] = weights[target] + s * (b @ a)
    out.mkdir(parents=True, exist_ok=True)
    for f in base.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, out / f.name)
    save_file(weights, str(out / "model.safetensors"))
    return out
