"""Model builders and Hugging Face references shared by the correctness tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

from bench.tiny_model import build_tiny_llama

__all__ = ["build_tiny_llama", "hf_greedy"]


def hf_greedy(model_path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face generate, greedy, fp32, each prompt alone and unpadded.

    HF's tokens are a function of the weights, the prompts and the library versions, so they
    are kept in LUMEN_HOME/hf-references under a hash of all of these, and generated again when
    any of them changes: SmolLM2's two prompt sets took HF 33 s of a 2-core machine's run."""
    from transformers import __version__ as transformers_version

    from engine.envs import lumen_home

    identity = {
        "weights": _file_digests(Path(model_path)),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "torch": torch.__version__,
        "transformers": transformers_version,
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    path = lumen_home() / "hf-references" / f"{key}.json"
    try:
        tokens = json.loads(path.read_text())["tokens"]
        print(f"HF references read from {path.name} (same weights, prompts and versions)")
        return tokens
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tokens = _hf_generate(model_path, prompts, max_new_tokens)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_suffix(f".{os.getpid()}.part")
        part.write_text(json.dumps({"identity": identity | {"prompts": len(prompts)},
                                    "tokens": tokens}))  # fmt: skip
        part.replace(path)
    except OSError:
        pass  # a read-only cache costs the next run its generation, nothing else
    return tokens


def _file_digests(folder: Path) -> dict[str, str]:
    """sha256 of each file the model's weights and generation depend on."""
    digests = {}
    for f in sorted(folder.iterdir()):
        if f.suffix in (".safetensors", ".json") and f.is_file():
            with open(f, "rb") as fh:
                digests[f.name] = hashlib.file_digest(fh, "sha256").hexdigest()
    return digests


def _hf_generate(
    model_path: Path, prompts: list[list[int]], max_new_tokens: int
) -> list[list[int]]:
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
