"""Model builders and Hugging Face references shared by the correctness tests."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch

from bench.tiny_model import TOKENIZER_FILES, build_tiny_llama
from engine.gguf_files import content_hash

__all__ = ["FAMILIES", "build_tiny_family", "build_tiny_llama", "hf_greedy", "lumen_greedy"]

# Families beside Llama, each as a tiny random checkpoint with its quirks switched on.
FAMILIES = ("qwen2", "qwen3", "phi3", "gemma3")
# Gemma scales its embeddings by sqrt(hidden): at the common init they drown the layers and
# greedy repeats one token. A twentieth lets tokens vary (and a missed window change them).
EMBED_SHRINK = 0.05


def build_tiny_family(out: Path, tokenizer_from: Path, family: str, *, seed: int = 0) -> Path:
    """A random 2-layer model of ``family`` (hidden 64) with the SmolLM2 tokenizer, at the
    tiny Llama's decisive init scale. Its biases and q/k norms are drawn at random too (the
    library's init leaves them at 0 and 1, where a missed bias or norm would not show):
    - qwen2: biases on q, k and v, tied embeddings, RoPE theta 1e6, and the hub's quirk of a
      sliding_window beside use_sliding_window: false, which turns it off;
    - qwen3: q/k RMSNorm per head, a head_dim (32) other than hidden / heads (16), a chat
      template that enable_thinking switches (THINKING_TEMPLATE), and sampling defaults in its
      generation_config.json (Qwen3's, and max_new_tokens 3);
    - phi3: q/k/v and gate/up fused in the checkpoint, RoPE over half of each head, longrope
      (short factors up to 1024 positions, long ones past it, attention factor of 2x), and a
      sliding window of 48 on every layer (shorter than most prompts);
    - gemma3: three layers, local (a window of 32), global, local, each kind with its own
      RoPE (10,000; 1e6 scaled linearly by 4), (1 + w) norms before and after attention and
      the MLP, q/k norms, a head_dim (32) other than hidden / heads, attention scaled by
      query_pre_attn_scalar 24, embeddings scaled by sqrt(hidden), GeGLU;
    - llama_bias (not in FAMILIES: for tensor parallelism's row-parallel biases): a Llama
      with attention_bias and mlp_bias, biases on every product."""
    import shutil

    from transformers import (
        Gemma3ForCausalLM,
        Gemma3TextConfig,
        LlamaConfig,
        LlamaForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    common = dict(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=1e6, initializer_range=0.5, bos_token_id=1,
        eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    if family == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=True))
    elif family == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    elif family == "phi3":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "short_factor": [1.0, 1.3, 1.9, 2.6],
            "long_factor": [2.0, 3.5, 6.0, 9.0],
        }
        config = Phi3Config(**{**common, "rope_theta": 10000.0}, partial_rotary_factor=0.5,
                            original_max_position_embeddings=1024, rope_scaling=rope,
                            sliding_window=48, tie_word_embeddings=False)  # fmt: skip
        model = Phi3ForCausalLM(config)
    elif family == "gemma3":
        rope = {
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        }
        config = Gemma3TextConfig(
            **{**common, "num_hidden_layers": 3}, head_dim=32, query_pre_attn_scalar=24,
            sliding_window=32, rope_parameters=rope, tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        )  # fmt: skip
        model = Gemma3ForCausalLM(config)
    elif family == "llama_bias":
        config = LlamaConfig(**common, attention_bias=True, mlp_bias=True)
        model = LlamaForCausalLM(config)
    else:
        raise ValueError(f"no tiny {family!r}: one of {', '.join(FAMILIES)} or llama_bias")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                param.uniform_(0.5, 1.5)
            elif family == "gemma3" and name.endswith("norm.weight"):
                param.uniform_(-0.5, 0.5)  # Gemma scales by 1 + w: 0 would hide a missed 1
            elif family == "gemma3" and name.endswith("embed_tokens.weight"):
                param.mul_(EMBED_SHRINK)
    model.to(torch.float32).save_pretrained(out)
    if family == "qwen2":
        config = json.loads((out / "config.json").read_text())
        (out / "config.json").write_text(json.dumps({**config, "sliding_window": 32}))
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copy(tokenizer_from / name, out / name)
    if family == "qwen3":
        (out / "chat_template.jinja").write_text(THINKING_TEMPLATE)
        # Qwen3's own sampling defaults, and a max_new_tokens to see them applied by.
        generation = json.loads((out / "generation_config.json").read_text())
        generation.update(temperature=0.6, top_k=20, top_p=0.95, max_new_tokens=3)
        (out / "generation_config.json").write_text(json.dumps(generation))
    return out


# Qwen3's template, cut to what its enable_thinking switches: false closes an empty think
# block after the generation prompt, so that the reply starts with the answer.
THINKING_TEMPLATE = (
    "{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


# Llama 3.1's template, cut to what its tools switch: the tools listed in an ipython
# environment, an assistant's calls written as JSON objects with parameters (joined by "; "),
# tool results as ipython turns.
LLAMA3_TOOL_TEMPLATE = (
    "{{- bos_token }}{%- if tools %}<|start_header_id|>system<|end_header_id|>\n\n"
    "Environment: ipython\nRespond with a JSON for a function call: "
    '{"name": function name, "parameters": dictionary of argument name and its value}\n'
    "{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|eot_id|>{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n{%- for c in m.tool_calls %}"
    '{"name": "{{ c.function.name }}", "parameters": {{ c.function.arguments | tojson }}}'
    "{%- if not loop.last %}; {% endif %}{%- endfor %}<|eot_id|>"
    "{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n"
    "{{ m.content }}<|eot_id|>"
    "{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{%- endif %}"
)


def lumen_greedy(
    model_path: Path, prompt: list[int], max_tokens: int = 8, **engine: Any
) -> list[int]:
    """One greedy request through a fresh offline engine (no warm-up), which is shut down
    after: the kernels' choices are made again at each call, under the environment's
    settings, and logged."""
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm = LLM(str(model_path), warmup=False, **engine)
    try:
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    return list(out[0].outputs[0].token_ids)


def hf_greedy(
    model_path: Path, prompts: list[list[int]], max_new_tokens: int, adapter: Path | None = None
) -> list[list[int]]:
    """Hugging Face generate, greedy, fp32, each prompt alone and unpadded.

    HF's tokens are a function of the weights, the prompts and the library versions, so they
    are kept in LUMEN_HOME/hf-references under a hash of all of these, and generated again when
    any of them changes: SmolLM2's two prompt sets took HF 33 s of a 2-core machine's run.
    ``adapter``: a PEFT LoRA folder, run by PEFT's PeftModel over the model."""
    from transformers import __version__ as transformers_version

    from engine.envs import lumen_home

    identity = {
        "weights": _file_digests(Path(model_path)),
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "torch": torch.__version__,
        "transformers": transformers_version,
    }
    if adapter is not None:
        import peft

        identity |= {"adapter": _file_digests(Path(adapter)), "peft": peft.__version__}
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    path = lumen_home() / "hf-references" / f"{key}.json"
    try:
        tokens = json.loads(path.read_text())["tokens"]
        print(f"HF references read from {path.name} (same weights, prompts and versions)")
        return tokens
    except (OSError, ValueError, KeyError, TypeError):
        pass
    tokens = _hf_generate(model_path, prompts, max_new_tokens, adapter)
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
            digests[f.name] = content_hash(f)
    return digests


def _hf_generate(
    model_path: Path, prompts: list[list[int]], max_new_tokens: int, adapter: Path | None = None
) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter)).eval()
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
