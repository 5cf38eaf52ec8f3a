"""LoRA adapters for tests, made by PEFT as a user's are: random (``init_lora_weights=False``:
B is not zero, so the adapter moves the tokens), saved by ``save_pretrained``. The reference
runs them with PEFT's PeftModel (tests/helpers/models.py ``hf_greedy(..., adapter=)``)."""

from __future__ import annotations

from pathlib import Path

import torch

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_adapter(
    base: Path, out: Path, *, rank: int = 8, alpha: float = 16, targets: tuple[str, ...] = ALL,
    seed: int = 0, rslora: bool = False, layers: list[int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
) -> Path:  # fmt: skip
    """A PEFT LoRA folder for ``base``'s ``targets`` (in ``layers``, default all)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), use_rslora=rslora,
        init_lora_weights=False, layers_to_transform=layers, lora_dropout=0.0,
        task_type="CAUSAL_LM", alpha_pattern=alpha_pattern or {},
    )  # fmt: skip
    get_peft_model(model, config).save_pretrained(str(out))
    return out
