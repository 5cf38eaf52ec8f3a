"""The tiny random Llama the test suite and `lumen bench overhead` serve: a model that costs
almost nothing, so that what is measured is everything around it."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "special_tokens_map.json",
    "generation_config.json",
)


def build_tiny_llama(out: Path, tokenizer_from: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Llama (hidden 64) with the SmolLM2 tokenizer.

    Its init scale is large so that greedy choices are decisive: a random
    model at the usual scale has nearly tied logits, where fp32 noise from a
    different batch shape would flip an argmax.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta: a kwarg its stub omits
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # a stub quirk
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    return out
