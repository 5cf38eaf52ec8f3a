"""Weight-only 4-bit (engine.worker.cpu_int4): the quantization, the native kernel against a
float64 reference at several shapes (widths that are not whole groups among them), and the
plan chosen at load."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_int4, native_build
from tests.helpers.native import built, round_to_int8, vector_paths


def test_quantize_is_per_group_and_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(6, 72) * torch.logspace(-3, 1, 6)[:, None]  # 72: two groups and a part
    w[2] = 0.5  # a constant row: a zero range must not divide by zero
    q = cpu_int4.quantize(w)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (6, 48) and q.padded == 96
    assert q.scale.shape == q.minimum.shape == (6, 3)
    back = cpu_int4.dequantize(q)
    assert back.shape == w.shape
    step = q.scale.repeat_interleave(32, dim=1)[:, :72]
    assert torch.all((back - w).abs() <= step / 2 + 1e-6)
    assert torch.all(back[2] == 0.5)
    # GGUF's Q4_1 block layout: byte i of a group holds element i (low) and i + 16 (high).
    codes = torch.round((w[0, :32] - q.minimum[0, 0]) / q.scale[0, 0]).to(torch.uint8)
    assert torch.equal(q.codes[0, :16], codes[:16] | (codes[16:] << 4))


def q8_reference(x: torch.Tensor, q: cpu_int4.Q4Weight) -> torch.Tensor:
    """The kernel's product in float64: x quantized per group of 32 to int8 (dx = max|x| / 127
    in fp32, round half to even), each group's dot product with the codes exact, then scaled,
    plus each group's minimum times the sum of its rounded x: the dequantized weight times the
    dequantized x, exactly."""
    xq, dx = round_to_int8(torch.nn.functional.pad(x, (0, q.padded - x.shape[1])))
    c = q.codes.reshape(q.out_features, -1, 16)
    codes = torch.cat([c & 15, c >> 4], dim=2).double()
    dots = torch.einsum("mgi,ngi->mng", xq, codes)
    scaled = (dots * dx[:, None, :] * q.scale.double()[None]).sum(dim=2)
    return scaled + (xq.sum(dim=2) * dx) @ q.minimum.double().t()


@pytest.fixture(scope="module", params=vector_paths())
def kernel(request: pytest.FixtureRequest) -> cpu_int4.NativeInt4:
    return built(lambda: cpu_int4.build(request.param))


@pytest.mark.parametrize("rows", [1, 3, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 40), (64, 96), (130, 576), (9, 1568)])
def test_native_kernel_equals_a_float64_reference(
    kernel: cpu_int4.NativeInt4, rows: int, n: int, k: int
) -> None:
    """Every path (the CPU's widest and each narrower one it runs) computes the same sums;
    the 8-bit activations stay within 3% of the product with fp32 ones (a random x, the
    largest error against the largest output)."""
    torch.manual_seed(rows * n + k)
    q = cpu_int4.quantize(torch.randn(n, k))
    x = torch.randn(rows, k)
    x[0, :32] = 0  # an all-zero group
    got = kernel(x, q)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), q8_reference(x, q), rtol=1e-4, atol=1e-4)
    exact = x.double() @ cpu_int4.dequantize(q).double().t()
    assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()
    torch.testing.assert_close(cpu_int4.widened_linear(x, q).double(), exact,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 40), (130, 576), (9, 1568)])
def test_the_native_widening_is_torchs_bit_for_bit(n: int, k: int) -> None:
    """Prefill's widened product: the weight widened natively (into a buffer kept between
    products, here reused by a smaller weight after a larger one) holds exactly torch's
    dequantized values, so the product is torch's."""
    kernel = built(cpu_int4.build)
    torch.manual_seed(n + k)
    big = cpu_int4.quantize(torch.randn(300, 1600))
    x_big = torch.randn(5, 1600)
    assert torch.equal(kernel.widened(x_big, big), cpu_int4.widened_linear(x_big, big))
    q = cpu_int4.quantize(torch.randn(n, k))
    x = torch.randn(70, k)
    assert torch.equal(kernel.widened(x, q), cpu_int4.widened_linear(x, q))
    plan = cpu_int4.Plan(kernel, 16, "test")
    want = cpu_int4.widened_linear(x, q).view(2, 35, n)
    assert torch.equal(plan.linear(x.view(2, 35, k), q), want)


def test_the_widest_path_is_the_one_the_cpu_has() -> None:
    kernel = built(cpu_int4.build)
    flags = native_build.cpu_key()
    vnni = all(f" {f}" in flags for f in ("avx512_vnni", "avx512bw", "avx512vl"))
    want = 512 if vnni else 256 if " avx2" in flags and " fma" in flags else 0
    assert kernel.path == want


def test_greedy_ties_break_as_torch_does(kernel: cpu_int4.NativeInt4) -> None:
    """Two vocabulary rows with the same codes get the same logit, bit for bit: the largest
    twice, argmax takes the first, as torch's does on the widened product."""
    torch.manual_seed(1)
    x = torch.randn(1, 64)
    w = torch.randn(10, 64) * 0.1
    w[3] = w[7] = x[0]  # the rows most aligned with x
    q = cpu_int4.quantize(w)
    logits = kernel(x, q)
    assert logits[0, 3] == logits[0, 7] == logits.max()
    assert int(logits.argmax()) == 3 == int(cpu_int4.widened_linear(x, q).argmax())


def test_the_plan_times_the_kernel_and_falls_back_where_it_cannot_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    built(cpu_int4.build)
    q = cpu_int4.quantize(torch.randn(64, 64))
    monkeypatch.setenv("LUMEN_AUTOTUNE", "retune")
    plan = cpu_int4.plan(q, torch.float32)
    print(plan.why)
    assert "(ms native/widened at rows 1:" in plan.why
    assert (plan.kernel is None) == (plan.max_rows == 0)
    monkeypatch.delenv("LUMEN_AUTOTUNE")
    cached = cpu_int4.plan(q, torch.float32)
    assert "(cached: ms native/widened at rows 1:" in cached.why
    assert cached.max_rows == plan.max_rows
    monkeypatch.setenv("LUMEN_CPU_INT4", "widen")
    assert cpu_int4.plan(q, torch.float32).kernel is None
    monkeypatch.setenv("LUMEN_CPU_INT4", "native")
    native = cpu_int4.plan(q, torch.float32)
    assert native.max_rows > 1 << 40
    x = torch.randn(2, 5, 64)  # a batch of rows of any shape
    want = q8_reference(x.reshape(-1, 64), q).float().reshape(2, 5, 64)
    torch.testing.assert_close(native.linear(x, q), want, rtol=1e-4, atol=1e-4)
    monkeypatch.setenv("LUMEN_CPU_INT4", "fast")
    with pytest.raises(ValueError, match="LUMEN_CPU_INT4 must be one of auto, native, widen"):
        cpu_int4.plan(q, torch.float32)
    monkeypatch.delenv("LUMEN_CPU_INT4")
    bf16 = cpu_int4.plan(q, torch.bfloat16)
    assert bf16.kernel is None and "fp32 activations" in bf16.why


def test_q4_1_values_come_back_exactly() -> None:
    """Weights that are a GGUF Q4_1 file's values (scale * code + minimum per 32, fp16 scale
    and minimum, every group's codes reaching 0 and 15: how llama.cpp quantizes) are quantized
    to the same groups: int4 computes with the file's own 4-bit values, not a second rounding.
    (SmolLM2's default checkpoint is such a file: all of its layer weights come back exactly.)"""
    torch.manual_seed(3)
    out, groups = 8, 5
    d = (torch.rand(out, groups) * 0.01 + 1e-3).half().float()
    m = (-torch.rand(out, groups) * 0.1).half().float()
    codes = torch.randint(0, 16, (out, groups, 32))
    codes[..., 0], codes[..., 1] = 0, 15
    w = (codes.float() * d[..., None] + m[..., None]).reshape(out, groups * 32)
    q = cpu_int4.quantize(w)
    assert torch.equal(cpu_int4.dequantize(q), w)
