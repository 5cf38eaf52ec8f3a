"""Decode layers with native glue (engine.worker.cpu_decode_layer): the same layer outputs as
the op-by-op path, step by step in a running engine, in fp32 and under int4 (each layer in one
call up to 16 rows, the products from Python above), and the cases that run op by op."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.model_config import ModelConfig
from engine.worker import cpu_decode_layer, cpu_gguf, cpu_int4, cpu_matmul, llama
from tests.helpers.gguf_files import MIXED_TYPES, write_tiny_llama_gguf
from tests.helpers.models import lumen_greedy
from tests.helpers.native import built

Seen = list[tuple[int, float, float]]


def _native_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """The native layers need the native decode attention, and int4's one-call layers the
    native int4 kernel; on the tiny model either may time slower than torch's path at load."""
    monkeypatch.setenv("LUMEN_CPU_INT4", "native")
    monkeypatch.setenv("LUMEN_CPU_ATTENTION", "native")


def _compare_each_step(monkeypatch: pytest.MonkeyPatch) -> Seen:
    """Patch the model's forward: each decode step the native layers can run is also run op by
    op from the same input, and the op-by-op result continues. For each: (rows, the largest
    difference of the final hidden states over their largest value, the same of the paged KV
    caches as each path left them)."""
    seen: Seen = []
    forward = llama.LlamaForCausalLM.forward

    def both(self: llama.LlamaForCausalLM, input_ids: torch.Tensor, positions: torch.Tensor,
             rotary: Any, kv_caches: Any, meta: Any, logits_indices: torch.Tensor,
             head: bool = True) -> torch.Tensor:  # fmt: skip
        native = self.kernels.decode_layers
        h = self.embed_tokens(input_ids)
        tables = rotary.lookup(positions, h.dtype)
        got = native.forward(h.clone(), tables, kv_caches, meta) if native else None
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


def _generate(path: Path, quantization: str | None, streams: int) -> None:
    """``streams`` greedy requests of different lengths, all decoding together for a while
    (a small KV cache: each compared step copies all of it)."""
    llm = LLM(str(path), quantization=quantization, warmup=False, num_kv_blocks=256)
    try:
        prompts = [[5 + i] * (3 + 3 * i) for i in range(streams)]
        params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True)
                  for i in range(streams)]  # fmt: skip
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    finally:
        llm.shutdown()


def _summary(seen: Seen) -> tuple[float, float, float]:
    hidden = sorted(d for _, d, _ in seen)
    kv = max(k for _, _, k in seen)
    print(
        f"\n{len(seen)} native steps, rows {sorted({r for r, _, _ in seen})}: hidden states "
        f"median {hidden[len(hidden) // 2]:.1e}, worst {hidden[-1]:.1e}; KV worst {kv:.1e}"
    )
    return hidden[len(hidden) // 2], hidden[-1], kv


@pytest.mark.parametrize("model", ["llama", "llama_sgemm", "llama_panels", "qwen2", "llama_bias"])
def test_native_layers_equal_the_op_by_op_layers_in_fp32(
    tiny_model_path: Path, tiny_family_path: Any, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, model: str,
) -> None:  # fmt: skip
    """Decode steps of 1 to 20 rows, over KV block boundaries: the hidden states after the
    layers and the KV each path wrote agree to float rounding (the products are the same
    calls, but for one- and two-row steps in one call, which read the weights with their own
    pass; the norms, RoPE and SwiGLU round in another order). Qwen2's q/k/v biases, and
    a Llama with a bias on every product, are added by the products. ``llama_sgemm``: on aten's
    products, where torch runs them on MKL, steps of up to 16 rows (here) run each layer in one
    native call, the products through the sgemm aten calls; ``llama_panels`` the same on
    Lumen's panels (cpu_matmul), and from Python above. Measured on the tiny Llama: median
    1.2e-6 of the largest value, worst 3.6e-6, KV 1.5e-6 (in one call: 1.3e-6, 4.1e-6); a wrong
    sign in RoPE made the median 1.2, an sgemm adding to its output instead of writing it NaN."""
    built(cpu_decode_layer.build)
    _native_kernels(monkeypatch)
    if model == "llama_sgemm":
        if cpu_decode_layer.blas_sgemm() is None:
            pytest.skip("torch's products do not run on MKL here: no sgemm of aten's to call")
        monkeypatch.setenv("LUMEN_CPU_MATMUL", "aten")
        # Scratch for no more than 16 rows: steps of 17 to 20 rows call the products from Python.
        monkeypatch.setattr(cpu_decode_layer, "F32_SCRATCH_BYTES", 1)
    if model == "llama_panels":
        built(cpu_matmul.panels)
        monkeypatch.setenv("LUMEN_CPU_MATMUL", "panels")
        monkeypatch.setattr(cpu_decode_layer, "F32_SCRATCH_BYTES", 1)
    seen = _compare_each_step(monkeypatch)
    with caplog.at_level("INFO"):
        _generate(tiny_family_path(model) if model in ("qwen2", "llama_bias")
                  else tiny_model_path, None, 20)  # fmt: skip
    one_call = "fp32 decode layers: one native call each, products by sgemm, up to 16 rows"
    assert (one_call in caplog.text) == (model == "llama_sgemm")
    on_panels = "fp32 decode layers: one native call each, products on the panels, up to 16 rows"
    assert (on_panels in caplog.text) == (model == "llama_panels")
    median, worst, kv = _summary(seen)
    assert len(seen) >= 30 and {1, 20} <= {r for r, _, _ in seen}
    assert median < 1e-5 and worst < 1e-4 and kv < 1e-5


def test_fp32_layers_call_their_products_from_python_where_torch_has_no_mkl(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Without MKL (torch built on another BLAS, or on ARM) there is no sgemm of aten's to
    call: the layers keep their products in Python, say why, and decode the same tokens."""
    built(cpu_decode_layer.build)
    _native_kernels(monkeypatch)
    monkeypatch.setenv("LUMEN_CPU_MATMUL", "aten")

    def run() -> list[int]:
        caplog.clear()
        with caplog.at_level("INFO"):
            return lumen_greedy(tiny_model_path, [3, 4, 5, 6])

    with_mkl = run()
    monkeypatch.setattr(torch.backends.mkl, "is_available", lambda: False)
    assert cpu_decode_layer.blas_sgemm() is None
    assert run() == with_mkl
    assert (
        "fp32 decode layers: products from Python: torch's products do not run on MKL here"
        in caplog.text
    )


def test_int4_layers_equal_the_op_by_op_layers(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under int4: steps of up to 16 rows run each layer in one call, the products through the
    int4 kernel from C; above, the products come from Python. Both agree with the op-by-op
    path to float rounding (measured: median 4e-7 of the largest value, worst 8e-7). A rounding
    of an activation to 8 bits that flips between the paths moves one product by a step of its
    group, and the tiny model carries it on: rare, so only a few steps may differ by more than
    rounding, and none by much (measured on an Intel Xeon: one step of 43 at 1.3e-2, its KV at
    8e-3, every other step under 1e-6). A wrong sign in RoPE made the median 1.2."""
    built(cpu_int4.build)
    _native_kernels(monkeypatch)
    seen = _compare_each_step(monkeypatch)
    _generate(tiny_model_path, "int4", 20)
    median, worst, kv = _summary(seen)
    rows = {r for r, _, _ in seen}
    assert len(seen) >= 30 and {1, 16, 17, 20} <= rows
    flipped = [r for r, d, _ in seen if d >= 1e-4]  # steps where a rounding flipped
    assert median < 1e-4 and len(flipped) <= len(seen) // 10, flipped
    assert worst < 5e-2 and kv < 5e-2


def test_gguf_layers_equal_the_op_by_op_layers(
    tmp_path: Path, default_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --quantization gguf, a Llama-shaped file of mixed formats: steps of up to 16 rows
    run each layer in one call, its products on the file's blocks from C (gguf_product), and
    agree with the op-by-op path as int4's do (the same kernel either way; the glue's rounding
    may flip an activation's 8-bit rounding in a rare step)."""
    built(cpu_gguf.build)
    _native_kernels(monkeypatch)
    monkeypatch.setenv("LUMEN_CPU_GGUF", "native")
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "home"))
    gguf = write_tiny_llama_gguf(tmp_path / "mixed.gguf", default_model_path, types=MIXED_TYPES,
                                 head="Q8_0")  # fmt: skip
    seen = _compare_each_step(monkeypatch)
    _generate(gguf, "gguf", 20)
    median, worst, kv = _summary(seen)
    assert len(seen) >= 30 and {1, 16, 17, 20} <= {r for r, _, _ in seen}
    flipped = [r for r, d, _ in seen if d >= 1e-4]
    assert median < 1e-4 and len(flipped) <= len(seen) // 10, flipped
    assert worst < 5e-2 and kv < 5e-2


def _count_native_steps(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    calls: list[bool] = []
    forward = cpu_decode_layer.NativeLayers.forward

    def counted(self: cpu_decode_layer.NativeLayers, *args: Any) -> torch.Tensor | None:
        out = forward(self, *args)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(cpu_decode_layer.NativeLayers, "forward", counted)
    return calls


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_the_engine_runs_native_layers_where_it_can_and_says_why_not(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    quantization: str | None,
) -> None:  # fmt: skip
    built(cpu_decode_layer.build)
    _native_kernels(monkeypatch)
    calls = _count_native_steps(monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

    def run() -> list[int]:
        caplog.clear()
        calls.clear()
        with caplog.at_level("INFO"):
            llm = LLM(str(tiny_model_path), quantization=quantization, warmup=False)
            out = llm.generate([{"prompt_token_ids": [7, 8, 9]}], params, use_tqdm=False)
            llm.shutdown()
        return list(out[0].outputs[0].token_ids)

    monkeypatch.setenv("LUMEN_CPU_MATMUL", "aten")  # fp32's one call needs aten's products
    native = run()
    assert "decode layers: the work between the products in 3 native calls each" in caplog.text
    one_call = "int4 decode layers: one native call each, up to 16 rows" in caplog.text
    assert one_call == (quantization == "int4")
    f32_call = "fp32 decode layers: one native call each, products by sgemm" in caplog.text
    assert f32_call == (quantization is None and cpu_decode_layer.blas_sgemm() is not None)
    assert sum(calls) == 7  # every decode step; the prefill ran op by op
    if quantization is None:
        monkeypatch.setenv("LUMEN_CPU_F32_LAYER", "off")
        assert run() == native and sum(calls) == 7  # the same products: the same tokens
        assert "fp32 decode layers: products from Python: set by LUMEN_CPU_F32_LAYER" in (
            caplog.text
        )
        monkeypatch.delenv("LUMEN_CPU_F32_LAYER")
        monkeypatch.setenv("LUMEN_CPU_MATMUL", "onednn")
        assert len(run()) == 8 and sum(calls) == 7
        assert (
            "fp32 decode layers: products from Python: a bias, or a product that is not "
            "aten's fp32" in caplog.text
        )
    if quantization == "int4":
        monkeypatch.setenv("LUMEN_CPU_INT4_LAYER", "off")
        assert len(run()) == 8 and sum(calls) == 7
        assert "int4 decode layers: products from Python: set by LUMEN_CPU_INT4_LAYER" in (
            caplog.text
        )
    monkeypatch.setenv("LUMEN_CPU_DECODE_LAYER", "off")
    unfused = run()
    assert "decode layers: op by op: set by LUMEN_CPU_DECODE_LAYER" in caplog.text
    assert not calls
    if quantization is None:  # fp32: the same tokens
        assert native == unfused
    assert len(native) == len(unfused) == 8
    monkeypatch.setenv("LUMEN_CPU_DECODE_LAYER", "on")
    with pytest.raises(ValueError, match="LUMEN_CPU_DECODE_LAYER must be one of auto, off"):
        LLM(str(tiny_model_path), quantization=quantization, warmup=False)


def test_layers_that_are_not_llama_shaped_run_op_by_op(tiny_family_path: Any) -> None:
    """Gemma 3 (its extra norms, GeGLU, q/k norms) runs op by op; Qwen2's biases run natively
    (its products add them), but not in int4's one call, whose products have none."""
    built(cpu_int4.build)
    plan = cpu_int4.Plan(cpu_int4.build(), 1 << 30, "test")
    gemma = llama.LlamaForCausalLM(ModelConfig.from_path(str(tiny_family_path("gemma3"))))
    why = cpu_decode_layer.unfit(gemma.decoder_layers)
    assert why is not None and "not a Llama-shaped layer" in why
    path = tiny_family_path("qwen2")
    qwen = llama.LlamaForCausalLM(ModelConfig.from_path(str(path)))
    qwen.load_weights(str(path))
    assert cpu_decode_layer.unfit(qwen.decoder_layers) is None
    qwen.quantize_weights("int4")
    why = cpu_decode_layer.int4_unfit(qwen.decoder_layers, plan)
    assert why is not None and "a bias" in why


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k, n", [(64, 48), (576, 960), (37, 5), (3, 17)])
def test_fp32_products_of_one_or_two_rows_match_a_float64_reference(
    k: int, n: int, threads: int
) -> None:
    """The one-call layer's fp32 product (f32_product): steps of one or two rows are read by
    its own pass over the weights (k split over the threads), wider ones by MKL's sgemm. Both
    against float64, at widths that are no multiple of four rows, nor of the threads, and a k
    smaller than the threads' four-row passes."""
    import ctypes

    lib = ctypes.CDLL(str(built(cpu_decode_layer.build)))
    fn = lib.f32_product
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                   ctypes.c_int]  # fmt: skip
    fn.restype = ctypes.c_int
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(k, n, generator=gen)  # [in, out], as the model's Linear stores it
    sgemm = cpu_decode_layer.blas_sgemm()
    for m in (1, 2, 3) if sgemm is not None else (1, 2):
        x = torch.randn(m, k, generator=gen)
        y = torch.full((m, n), float("nan"))
        weight = cpu_decode_layer._F32(w.data_ptr(), n, k, sgemm or 0)
        assert fn(ctypes.byref(weight), x.data_ptr(), m, y.data_ptr(), threads) == 0
        ref = x.double() @ w.double()
        err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (m, err)
