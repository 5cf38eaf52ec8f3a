"""Model builders and Hugging Face references shared by the correctness tests."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.tiny_model import build_tiny_llama

__all__ = ["build_tiny_llama", "hf_greedy"]


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face generate, greedy, fp32, each prompt alone and unpadded."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    outs = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=eos if isinstance(eos, int) else eos[0],
            )
            outs.append(y[0, len(ids) :].tolist())
    return outs
