"""--quantization gguf: products on a GGUF file's own blocks (engine.worker.cpu_gguf). Each
format's kernel against a float64 reference on every vector path the CPU runs, its widening
bit for bit the gguf package's dequantization, and a served model on a file of mixed formats
giving transformers' greedy tokens (widened). Its decode layers in one call:
test_decode_layer.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from engine import LLM, SamplingParams
from engine.gguf_blocks import BLOCKS_FILE, TYPES, load_blocks, write_blocks
from engine.model_files import resolve_model
from engine.worker import cpu_gguf
from tests.helpers.gguf_files import (
    MIXED_TYPES,
    TINY_PROMPTS,
    greedy_tokens,
    random_blocks,
    write_tiny_llama_gguf,
)
from tests.helpers.models import hf_greedy
from tests.helpers.native import built, round_to_int8, vector_paths


@pytest.fixture(scope="module", params=vector_paths())
def kernel(request: pytest.FixtureRequest) -> cpu_gguf.NativeGGUF:
    return built(lambda: cpu_gguf.build(request.param))


def _dequantized(kind: str, blocks: np.ndarray, cols: int) -> torch.Tensor:
    import gguf
    from gguf import GGMLQuantizationType as Q

    values = gguf.quants.dequantize(blocks, Q[kind]).reshape(blocks.shape[0], cols)
    return torch.from_numpy(np.ascontiguousarray(values))


def _weight(parts: list[tuple[str, np.ndarray]], cols: int) -> cpu_gguf.GGUFWeight:
    return cpu_gguf.GGUFWeight([cpu_gguf.part(k, torch.from_numpy(b)) for k, b in parts], cols)


@pytest.mark.parametrize("kind", list(TYPES))
@pytest.mark.parametrize("rows", [1, 3, 6])
def test_each_format_equals_a_float64_reference(
    kernel: cpu_gguf.NativeGGUF, kind: str, rows: int
) -> None:
    """The product over the file's blocks is the dequantized weight times x rounded to 8 bits
    per 32 (float64 reference, to fp32 rounding), on every path; its widening is the gguf
    package's dequantization bit for bit."""
    cols = 512
    blocks = random_blocks(kind, 37, cols, seed=rows)
    w = _weight([(kind, blocks)], cols)
    want_w = _dequantized(kind, blocks, cols)
    assert torch.equal(kernel.dequantize(w), want_w)
    torch.manual_seed(rows)
    x = torch.randn(rows, cols)
    x[0, :32] = 0  # an all-zero group
    xq, dx = round_to_int8(x)
    reference = (xq * dx[..., None]).reshape(rows, cols) @ want_w.double().t()
    got = kernel(x, w)
    assert got.shape == (rows, 37) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * float(
        reference.abs().max()))  # fmt: skip


def test_a_fused_product_keeps_each_tensors_format(kernel: cpu_gguf.NativeGGUF) -> None:
    """q, k and v (or gate and up) in different formats, stacked: the rows of each part are its
    own product, and the widened weight stacks the parts' values."""
    cols = 256
    parts = [("Q5_0", random_blocks("Q5_0", 8, cols)), ("Q8_0", random_blocks("Q8_0", 3, cols)),
             ("Q6_K", random_blocks("Q6_K", 5, cols))]  # fmt: skip
    w = _weight(parts, cols)
    x = torch.randn(2, cols)
    alone = torch.cat([kernel(x, _weight([p], cols)) for p in parts], dim=1)
    assert w.out_features == 16 and torch.equal(kernel(x, w), alone)
    stacked = torch.cat([_dequantized(k, b, cols) for k, b in parts])
    assert torch.equal(kernel.dequantize(w), stacked)
    plan = cpu_gguf.Plan(kernel, 1, "test")  # above one row: the widened weight
    torch.testing.assert_close(plan.linear(x, w), x @ stacked.t())


def test_the_block_sizes_are_the_gguf_packages() -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    assert {
        kind: GGML_QUANT_SIZES[GGMLQuantizationType[name]] for name, kind in TYPES.items()
    } == cpu_gguf.BLOCKS
    assert all(GGMLQuantizationType[name].value == kind for name, kind in TYPES.items())


def test_blocks_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match="do not hold 100 weights"):
        _weight([("Q8_0", random_blocks("Q8_0", 2, 128))], 100)
    with pytest.raises(ValueError, match="not a format"):
        cpu_gguf.GGUFWeight([(1, torch.zeros(2, 64, dtype=torch.uint8))], 32)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LUMEN_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


def test_a_file_of_mixed_formats_serves_its_own_weights(
    tmp_path: Path, home: Path, default_model_path: Path, caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A file whose products are in five formats and whose head is Q8_0: every product and the
    head run on the file's blocks, and (widened, so with fp32 activations) the greedy tokens
    are transformers' reading the same file. A folder converted before blocks were kept gets
    them on its next use; one with none is refused in one line that names the way out."""
    built(cpu_gguf.build)
    monkeypatch.setenv("LUMEN_CPU_GGUF", "widen")
    gguf = write_tiny_llama_gguf(tmp_path / "mixed.gguf", default_model_path, types=MIXED_TYPES,
                                 head="Q8_0")  # fmt: skip
    folder = resolve_model(str(gguf), log=lambda _: None)
    (folder / BLOCKS_FILE).unlink()  # as a folder converted before blocks were kept
    assert resolve_model(str(gguf), log=lambda _: None) == folder
    assert len(load_blocks(folder)) == 15  # 2 layers x 7 products, and the head
    caplog.set_level("INFO", logger="engine.worker.llama")
    tokens = greedy_tokens(gguf, "gguf")
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gguf:")]
    print(said)
    assert said == ["gguf: 8 of 8 products and the LM head run on the file's own blocks "
                    "(Q4_0, Q4_1, Q5_0, Q8_0); the rest in torch.float32"]  # fmt: skip
    assert tokens == hf_greedy(folder, TINY_PROMPTS, 8)
    # A folder with no blocks (not the default model's: a packaged model converted now has them).
    (folder / BLOCKS_FILE).unlink()
    with pytest.raises(ValueError, match=r"has none .* serve the .gguf file itself"):
        LLM(str(folder), num_kv_blocks=64, quantization="gguf")
    assert write_blocks(gguf, tmp_path / "gone") == 0  # best effort: said, not raised


@pytest.mark.e2e
@pytest.mark.real_model
def test_the_gemma_file_runs_in_its_own_formats(monkeypatch: pytest.MonkeyPatch) -> None:
    """The packaged Gemma 3 270M file (Q4_K_M: Q5_0, Q8_0, Q4_K and Q6_K) under gguf: widened,
    its greedy tokens are the fp32 conversion's exactly (the blocks hold the file's values, in
    each format); with the native kernel (8-bit activations) the first tokens agree."""
    from engine.model_files import packaged_gguf

    gguf = str(packaged_gguf("gemma-3-270m"))
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    def run(quantization: str | None) -> list[list[int]]:
        llm = LLM(gguf, quantization=quantization, max_model_len=256, num_kv_blocks=256)
        try:
            return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params,
                                                                       use_tqdm=False)]  # fmt: skip
        finally:
            llm.shutdown()

    reference = run(None)
    monkeypatch.setenv("LUMEN_CPU_GGUF", "widen")
    assert run("gguf") == reference
    monkeypatch.setenv("LUMEN_CPU_GGUF", "native")
    native = run("gguf")
    same = [next((i for i, (a, b) in enumerate(zip(n, r)) if a != b), len(r))
            for n, r in zip(native, reference)]  # fmt: skip
    print(f"native gguf: tokens equal to fp32's before the first difference: {same}")
    assert min(same) >= 2
