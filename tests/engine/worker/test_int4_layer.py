"""The int4 decode layer in one native call (engine.worker.cpu_int4_layer): the same layer
outputs as the op-by-op path, step by step in a running engine, and the cases that must run
op by op instead."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import ModelConfig
from engine.worker import cpu_int4, cpu_int4_layer, llama
from tests.helpers.native import built


def _native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused layers need the native int4 kernel and the native decode attention; on the
    tiny model either may time slower than torch's path at load, and then nothing runs fused."""
    monkeypatch.setenv("LUMEN_CPU_INT4", "native")
    monkeypatch.setenv("LUMEN_CPU_ATTENTION", "native")


def _compare_each_step(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, float, float]]:
    """Patch the model's forward: each decode step the fused layers can run is also run op by
    op from the same input, and the op-by-op result continues. For each: (rows, the largest
    difference of the final hidden states over their largest value, the same of the paged KV
    caches as each path left them)."""
    seen: list[tuple[int, float, float]] = []
    forward = llama.LlamaForCausalLM.forward

    def both(self: llama.LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
             rotary: Any, kv_caches: Any, meta: Any, logits_indices: torch.Tensor,
             head: bool = True) -> torch.Tensor:  # fmt: skip
        fused = self.kernels.int4_layers
        h = self.embed_tokens(input_ids)
        tables = rotary.lookup(positions, h.dtype)
        got = fused.forward(h.clone(), tables, kv_caches, meta) if fused else None
        if got is None:
            return forward(self, input_ids, positions, rotary, kv_caches, meta, logits_indices,
                           head)  # fmt: skip
        caches = [torch.stack(kv).clone() for kv in kv_caches]
        for layer, kv_cache in zip(self.decoder_layers, kv_caches):
            h = layer(h, tables, kv_cache, meta)
        kv = max(float((c - torch.stack(w)).abs().max() / torch.stack(w).abs().max())
                 for c, w in zip(caches, kv_caches))  # fmt: skip
        seen.append((h.shape[0], float((got - h).abs().max() / h.abs().max()), kv))
        return self.final(h[logits_indices], head)

    monkeypatch.setattr(llama.LlamaForCausalLM, "forward", both)
    return seen


def test_fused_layers_equal_the_op_by_op_layers(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode steps of 1 to 5 rows, over KV block boundaries: each step's hidden states after
    the layers, and the KV each path wrote, agree with the op-by-op path's to float rounding
    (measured: median 4e-7 of the largest value, worst 8e-7). A rounding of an activation to 8
    bits that flips between the paths moves one product by a step of its group, about 1e-3:
    rare, and under the bound on the worst step. A wrong sign in RoPE made the median 1.2."""
    built(cpu_int4.build)
    _native_kernels(monkeypatch)
    seen = _compare_each_step(monkeypatch)
    llm = LLM(str(tiny_model_path), quantization="int4", warmup=False)
    try:
        prompts = [[5 + i] * (3 + 7 * i) for i in range(5)]
        params = [SamplingParams(temperature=0, max_tokens=6 + 4 * i, ignore_eos=True)
                  for i in range(5)]  # fmt: skip
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()
    hidden = sorted(d for _, d, _ in seen)
    kv = max(k for _, _, k in seen)
    print(
        f"\n{len(seen)} fused steps, rows {sorted({r for r, _, _ in seen})}: hidden states "
        f"median {hidden[len(hidden) // 2]:.1e}, worst {hidden[-1]:.1e}; KV worst {kv:.1e}"
    )
    assert len(seen) >= 20 and {1, 5} <= {r for r, _, _ in seen}
    assert hidden[len(hidden) // 2] < 1e-4 and hidden[-1] < 1e-2 and kv < 1e-2


def test_the_engine_runs_fused_where_it_can_and_says_why_not(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    built(cpu_int4.build)
    _native_kernels(monkeypatch)
    calls = []
    forward = cpu_int4_layer.FusedLayers.forward

    def counted(self: cpu_int4_layer.FusedLayers, *args: Any) -> torch.Tensor | None:
        out = forward(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_int4_layer.FusedLayers, "forward", counted)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    with caplog.at_level("INFO"):
        llm = LLM(str(tiny_model_path), quantization="int4", warmup=False)
        fused = llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
        llm.shutdown()
    assert "int4 decode layers: one native call each" in caplog.text
    assert sum(calls) == 7  # every decode step; the prefill ran op by op
    monkeypatch.setenv("LUMEN_CPU_INT4_LAYER", "off")
    calls.clear()
    caplog.clear()
    with caplog.at_level("INFO"):
        llm = LLM(str(tiny_model_path), quantization="int4", warmup=False)
        unfused = llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
        llm.shutdown()
    assert "int4 decode layers: op by op: set by LUMEN_CPU_INT4_LAYER" in caplog.text
    assert not calls
    assert len(fused[0].outputs[0].token_ids) == len(unfused[0].outputs[0].token_ids) == 8
    monkeypatch.setenv("LUMEN_CPU_INT4_LAYER", "on")
    with pytest.raises(ValueError, match="LUMEN_CPU_INT4_LAYER must be one of auto, off"):
        LLM(str(tiny_model_path), quantization="int4", warmup=False)


def test_layers_that_are_not_llama_shaped_run_op_by_op(tiny_family_path: Any) -> None:
    """Gemma 3 (its extra norms, GeGLU, q/k norms) and Qwen's biases: unfit names why."""
    built(cpu_int4.build)
    kernel = cpu_int4.build()
    plan = cpu_int4.Plan(kernel, 1 << 30, "test")
    for family, want in (("gemma3", "not a Llama-shaped layer"), ("qwen2", "a bias")):
        path = tiny_family_path(family)
        model = llama.LlamaForCausalLM(ModelConfig.from_path(str(path)))
        model.load_weights(str(path))
        model.quantize_weights("int4")
        why = cpu_int4_layer.unfit(model.decoder_layers, plan)
        assert why is not None and want in why, (family, why)
        assert model.kernels.int4_layers is None
