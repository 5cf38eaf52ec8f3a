"""Greedy tokens match Hugging Face generate on the same weights, in every scheduling regime."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig
from tests.helpers.models import FAMILIES, hf_greedy

MAX_TOKENS = 12
# SmolLM2's runs generate as many: with twelve, nine of the sixteen prompts cross a KV block
# boundary in decode (fewer would narrow what the match proves).
SMOL_MAX_TOKENS = 12
NUM_PROMPTS = 16


def _random_prompts(seed: int, shared_prefix: int = 0) -> list[list[int]]:
    """16 prompts of lengths 1..~180; with shared_prefix, all start with the same tokens."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 49152) for _ in range(shared_prefix)]
    lengths = [1, 2, 5, 9, 16, 17, 31, 33, 48, 64, 70, 97, 120, 128, 150, 181]
    return [prefix + [rng.randrange(3, 49152) for _ in range(n)] for n in lengths]


# name -> (engine options, prompts' shared prefix length)
SETTINGS: dict[str, tuple[dict[str, Any], int]] = {
    "default": ({}, 0),
    "chunked_prefill": ({"max_num_batched_tokens": 24}, 0),
    "prefix_cache": ({"max_num_batched_tokens": 512}, 40),
    # 20 blocks of 16 tokens for 16 requests of up to ~200 tokens.
    "preemption": ({"num_kv_blocks": 20, "max_model_len": 320}, 0),
}


def _check_setting(
    model_path: Path,
    name: str,
    references: dict[int, list[list[int]]],
    max_tokens: int = MAX_TOKENS,
) -> None:
    """The setting's engine against Hugging Face; ``references`` (one per module, keyed by the
    prompts' shared prefix) keeps each reference for the tests that share its prompts."""
    options, shared = SETTINGS[name]
    prompts = _random_prompts(seed=shared, shared_prefix=shared)
    if shared not in references:
        references[shared] = hf_greedy(model_path, prompts, max_tokens)
    expected = references[shared]
    if "num_kv_blocks" in options:  # the same bytes: a block spans one KV group's layers
        layout = KVLayout.of(ModelConfig.from_path(model_path))
        blocks = options["num_kv_blocks"] * layout.num_groups + (1 if layout.hybrid else 0)
        options = {**options, "num_kv_blocks": blocks}
    # No warm-up: it changes no token, and a cold engine is the harder case.
    llm = LLM(str(model_path), warmup=False, **options)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=max_tokens),
        use_tqdm=False,
    )
    metrics = llm.get_metrics()
    llm.shutdown()
    print(f"{name}: {metrics}")
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    if name == "chunked_prefill":
        assert metrics["max_scheduled_tokens"] <= 24 < max(len(p) for p in prompts)
    if name == "prefix_cache":
        assert metrics["num_prefix_hit_tokens"] > 0
        assert sum(o.num_cached_tokens > 0 for o in outs) >= NUM_PROMPTS - 1
    if name == "preemption":
        assert metrics["num_preemptions"] > 0


@pytest.fixture(scope="module")
def tiny_references() -> dict[int, list[list[int]]]:
    return {}


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_tiny_llama_matches_hf(
    setting: str, tiny_model_path: Path, tiny_references: dict[int, list[list[int]]]
) -> None:
    _check_setting(tiny_model_path, setting, tiny_references)


@pytest.fixture(scope="module")
def family_references() -> dict[str, dict[int, list[list[int]]]]:
    return {family: {} for family in FAMILIES}


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("family", FAMILIES)
def test_tiny_families_match_hf(
    family: str,
    setting: str,
    tiny_family_path: Callable[[str], Path],
    family_references: dict[str, dict[int, list[list[int]]]],
) -> None:
    """Each family beside Llama, its quirks switched on (tests.helpers.models), alone against
    HF and in every scheduling regime: batched, chunked, prefix-cached, preempted."""
    _check_setting(tiny_family_path(family), setting, family_references[family])


def test_gemma3_local_layers_beside_the_native_decode_kernel(
    tiny_family_path: Callable[[str], Path],
    family_references: dict[str, dict[int, list[list[int]]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The tiny Gemma 3's window (32) is shorter than a ring of one chunk (128): its local
    layers run torch's path over their rings, masking the oldest places, beside the kernel
    on its global layer."""
    monkeypatch.setenv("LUMEN_CPU_ATTENTION", "native")
    _check_setting(tiny_family_path("gemma3"), "default", family_references["gemma3"])


def test_phi3_longrope_past_its_original_context_matches_hf(
    tiny_family_path: Callable[[str], Path],
) -> None:
    """Past original_max_position_embeddings (1024 in the tiny Phi-3) longrope's long factors
    apply: a prompt of 1,100 tokens, alone and in one step, as transformers runs it."""
    model = tiny_family_path("phi3")
    rng = random.Random(5)
    prompt = [rng.randrange(3, 49152) for _ in range(1100)]
    llm = LLM(str(model), num_kv_blocks=128, max_num_batched_tokens=2048)
    try:
        params = SamplingParams(temperature=0, max_tokens=8)
        (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.outputs[0].token_ids == hf_greedy(model, [prompt], 8)[0]


@pytest.fixture(scope="module")
def smol_references() -> dict[int, list[list[int]]]:
    return {}


# SmolLM2 in each scheduling regime, each regime on other forced CPU kernels: every kernel's
# choice (matrix products, decode attention, greedy LM head) is held to HF's tokens on the real
# model in one run or another. Four engines, not one per setting and another per kernel.
SMOL_RUNS: dict[str, dict[str, str]] = {
    "default": {},  # the load-time measurements choose, as a user's server does
    "chunked_prefill": {
        "LUMEN_CPU_MATMUL": "aten",
        "LUMEN_CPU_ATTENTION": "torch",
        "LUMEN_CPU_GREEDY_HEAD": "fused",
    },
    "prefix_cache": {
        "LUMEN_CPU_MATMUL": "onednn",
        "LUMEN_CPU_ATTENTION": "native",
        "LUMEN_CPU_GREEDY_HEAD": "screened",
    },
    "preemption": {"LUMEN_CPU_MATMUL": "panels", "LUMEN_CPU_GREEDY_HEAD": "torch"},
}


@pytest.mark.real_model
@pytest.mark.parametrize(
    "setting",
    [pytest.param(s, marks=[] if s == "default" else [pytest.mark.e2e]) for s in SMOL_RUNS],
)
def test_smollm2_matches_hf(
    setting: str,
    default_model_path: Path,
    smol_references: dict[int, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from engine.worker import cpu_matmul

    kernels = dict(SMOL_RUNS[setting])
    # A kernel this torch cannot run is left to the measurement (and said so).
    if kernels.get("LUMEN_CPU_MATMUL") == "onednn" and not cpu_matmul.onednn_available(
        torch.float32
    ):
        print("this torch has no oneDNN: the matrix kernel is measured")
        del kernels["LUMEN_CPU_MATMUL"]
    if kernels.get("LUMEN_CPU_GREEDY_HEAD") == "screened" and not cpu_matmul.onednn_available(
        torch.bfloat16
    ):
        print("this torch's oneDNN has no bf16: the greedy head is measured")
        del kernels["LUMEN_CPU_GREEDY_HEAD"]
    for name, value in kernels.items():
        monkeypatch.setenv(name, value)
    print(f"{setting} with kernels {kernels or 'measured'}")
    _check_setting(default_model_path, setting, smol_references, SMOL_MAX_TOKENS)


def test_unknown_cpu_kernel_is_a_clear_error(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUMEN_CPU_MATMUL", "blas")
    with pytest.raises(
        ValueError, match="LUMEN_CPU_MATMUL must be one of auto, onednn, aten, panels"
    ):
        LLM(str(tiny_model_path))


def test_unknown_cpu_attention_kernel_is_a_clear_error(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUMEN_CPU_ATTENTION", "flash")
    with pytest.raises(ValueError, match="LUMEN_CPU_ATTENTION must be one of auto, native, torch"):
        LLM(str(tiny_model_path))


@pytest.mark.parametrize("kernel", ["torch", "fused", "screened"])
@pytest.mark.parametrize("setting", ["default", "chunked_prefill"])
def test_tiny_llama_matches_hf_with_each_greedy_head(
    kernel: str,
    setting: str,
    tiny_model_path: Path,
    tiny_references: dict[int, list[list[int]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Greedy tokens by the logits' argmax, the fused fp32 kernel or the bf16-screened one
    match HF's."""
    from engine.worker import cpu_matmul

    if kernel == "screened" and not cpu_matmul.onednn_available(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", kernel)
    _check_setting(tiny_model_path, setting, tiny_references)


# --kv-cache-dtype -> the bytes of one KV row at head_dim D (8-bit: codes and a 4-byte scale)
NARROW_KV = {"bfloat16": lambda d: 2 * d, "int8": lambda d: d + 4, "fp8": lambda d: d + 4}


@pytest.mark.parametrize("kv_dtype", list(NARROW_KV))
def test_a_narrow_kv_cache_holds_more_tokens_and_every_decode_path_agrees(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, kv_dtype: str
) -> None:
    """--kv-cache-dtype bfloat16, int8 or fp8 under an fp32 model: the same memory holds more
    blocks (fp32's row bytes over its own), and the three ways decode reads its KV (the mirror
    through the native kernel, the mirror through torch, the paged gather when preemption
    squeezes the mirror out) give the same greedy tokens."""
    budget = 1 << 20
    fp32 = LLM(str(tiny_model_path), kv_cache_memory_bytes=budget)
    fp32_blocks = fp32.get_stats().num_kv_blocks_total
    fp32.shutdown()
    head_dim = ModelConfig.from_path(tiny_model_path).head_dim
    narrow = LLM(str(tiny_model_path), kv_cache_memory_bytes=budget, kv_cache_dtype=kv_dtype)
    want = fp32_blocks * 4 * head_dim // NARROW_KV[kv_dtype](head_dim)
    assert abs(narrow.get_stats().num_kv_blocks_total - want) <= 1
    narrow.shutdown()

    prompts = [{"prompt_token_ids": p} for p in _random_prompts(seed=3)]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    runs = {}
    for name, kernel, options in (
        ("native", "native", {}),
        ("torch", "torch", {}),
        ("squeezed", "native", SETTINGS["preemption"][0]),
    ):
        monkeypatch.setenv("LUMEN_CPU_ATTENTION", kernel)
        llm = LLM(str(tiny_model_path), kv_cache_dtype=kv_dtype, **options)
        outs = llm.generate(prompts, params, use_tqdm=False)
        runs[name] = [o.outputs[0].token_ids for o in outs]
        if name == "squeezed":
            assert llm.get_metrics()["num_preemptions"] > 0
        llm.shutdown()
    assert runs["native"] == runs["torch"] == runs["squeezed"]


@pytest.mark.parametrize("value", ["fp8_e5m2", "int4", "float64"])
def test_unknown_kv_cache_dtype_is_a_clear_error(tiny_model_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match="kv_cache_dtype must be auto or one of float32, bfloat16"):
        LLM(str(tiny_model_path), kv_cache_dtype=value)


def _dequantized_copy(model_path: Path, folder: Path, quantization: str) -> Path:
    """The model with each decoder layer's weights replaced by their quantized values (int8:
    per output channel; int4: per group of 32, and the LM head in int8, untied from the
    embedding), widened back to fp32: what the quantized engine computes with, for Hugging Face
    to run."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from engine.worker import cpu_int4, cpu_int8

    def widened(w: torch.Tensor, kind: str = quantization) -> torch.Tensor:
        if kind == "int4":
            return cpu_int4.dequantize(cpu_int4.quantize(w)).contiguous()
        q, scale = cpu_int8.quantize(w)
        return (q.float() * scale[:, None]).contiguous()

    folder.mkdir()
    for f in model_path.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, folder / f.name)
    config = json.loads((folder / "config.json").read_text())
    for f in model_path.glob("*.safetensors"):
        tensors = load_file(f)
        for name, w in list(tensors.items()):
            if name.startswith("model.layers.") and name.endswith("_proj.weight"):
                tensors[name] = widened(w)
        if quantization == "int4":
            head = tensors.get("lm_head.weight", tensors["model.embed_tokens.weight"])
            tensors["lm_head.weight"] = widened(head, "int8")
            config["tie_word_embeddings"] = False
        save_file(tensors, folder / f.name, metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_weights_match_hf_on_the_same_values(
    tiny_model_path: Path, tmp_path: Path, quantization: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--quantization int8 / int4 computes with the quantized weights' own values: greedy tokens
    equal Hugging Face's on a copy of the model whose weights are those values, and the output
    differs from the fp32 model's (the weights did change). int4's native kernels also round
    the activations to 8 bits (as llama.cpp's do), so their tokens are not Hugging Face's:
    here int4's products and its int8 LM head widen their weights instead, with fp32
    activations (LUMEN_CPU_INT4=widen, LUMEN_CPU_INT8=widen)."""
    if quantization == "int4":
        monkeypatch.setenv("LUMEN_CPU_INT4", "widen")
        monkeypatch.setenv("LUMEN_CPU_INT8", "widen")
    prompts = _random_prompts(seed=5)
    expected = hf_greedy(_dequantized_copy(tiny_model_path, tmp_path / quantization,
                                           quantization), prompts, MAX_TOKENS)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    for options in ({}, {"max_num_batched_tokens": 24}):  # prefill in one step, and chunked
        llm = LLM(str(tiny_model_path), quantization=quantization, **options)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        llm.shutdown()
        for i, (out, ref) in enumerate(zip(outs, expected)):
            assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    assert expected != hf_greedy(tiny_model_path, prompts, MAX_TOKENS)


@pytest.mark.parametrize("value", ["awq", "fp8", "INT8"])
def test_unknown_quantization_is_a_clear_error(tiny_model_path: Path, value: str) -> None:
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, gguf or unset"):
        LLM(str(tiny_model_path), quantization=value)
