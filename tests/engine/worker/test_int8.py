"""Weight-only int8 (engine.worker.cpu_int8): the quantization, the native kernel against the
widened product, its 8-bit activations form (int4's LM head) against a float64 reference, and
the plan chosen at load."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_int8
from tests.helpers.native import built, round_to_int8, vector_paths


def test_quantize_is_per_output_channel_and_within_half_a_step() -> None:
    torch.manual_seed(0)
    w = torch.randn(12, 40) * torch.logspace(-3, 1, 12)[:, None]  # channels of very unlike size
    w[5] = 0.0  # an all-zero channel must not divide by zero
    q, scale = cpu_int8.quantize(w)
    assert q.dtype == torch.int8 and q.shape == w.shape and scale.shape == (12,)
    assert q.abs().max() <= 127
    back = q.float() * scale[:, None]
    assert torch.all((back - w).abs() <= scale[:, None] / 2 + 1e-7)
    assert torch.all(back[5] == 0)


@pytest.fixture(scope="module")
def kernel() -> cpu_int8.NativeInt8:
    return built(cpu_int8.build)


@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 70])
@pytest.mark.parametrize(("n", "k"), [(4, 16), (36, 64), (256, 96)])
def test_native_kernel_equals_the_widened_product(
    kernel: cpu_int8.NativeInt8, rows: int, n: int, k: int
) -> None:
    if k % kernel.vector:
        pytest.skip(f"k={k} is not a multiple of this CPU's {kernel.vector} lanes")
    torch.manual_seed(rows * n + k)
    q, scale = cpu_int8.quantize(torch.randn(n, k))
    x = torch.randn(rows, k)
    got = kernel(x, q, scale)
    want = x.double() @ (q.double() * scale.double()[:, None]).t()
    assert got.shape == (rows, n) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_int8.widened_linear(x, q, scale).double(), want,
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_the_plan_times_the_kernel_and_falls_back_where_it_cannot_run(
    kernel: cpu_int8.NativeInt8, monkeypatch: pytest.MonkeyPatch
) -> None:
    q, scale = cpu_int8.quantize(torch.randn(64, 64))
    monkeypatch.setenv("LUMEN_AUTOTUNE", "retune")
    plan = cpu_int8.plan(q, scale, torch.float32)
    print(plan.why)
    assert "(ms native/widened at rows 1:" in plan.why
    assert (plan.kernel is None) == (plan.max_rows == 0)
    monkeypatch.delenv("LUMEN_AUTOTUNE")
    cached = cpu_int8.plan(q, scale, torch.float32)
    assert "(cached: ms native/widened at rows 1:" in cached.why
    assert cached.max_rows == plan.max_rows
    monkeypatch.setenv("LUMEN_CPU_INT8", "widen")
    assert cpu_int8.plan(q, scale, torch.float32).kernel is None
    monkeypatch.setenv("LUMEN_CPU_INT8", "native")
    assert cpu_int8.plan(q, scale, torch.float32).max_rows > 1 << 40
    monkeypatch.setenv("LUMEN_CPU_INT8", "fast")
    with pytest.raises(ValueError, match="LUMEN_CPU_INT8 must be one of auto, native, widen"):
        cpu_int8.plan(q, scale, torch.float32)
    monkeypatch.delenv("LUMEN_CPU_INT8")
    # bf16 activations: every product widens, and still computes the product.
    bf16 = cpu_int8.plan(q, scale, torch.bfloat16)
    assert bf16.kernel is None and "fp32 activations" in bf16.why
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(
        bf16.linear(x, q, scale).float(), x.float() @ (q.float() * scale[:, None]).t(),
        rtol=2e-2, atol=5e-2,
    )  # fmt: skip
    odd_q, odd_scale = cpu_int8.quantize(torch.randn(6, 64))  # 6 outputs: not in tiles of 4
    assert not kernel.fits(odd_q)
    assert cpu_int8.plan(odd_q, odd_scale, torch.float32).kernel is None


def q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8_q8_linear in float64: x rounded per group of 32 to int8 (dx = max|x| / 127 in
    fp32, half to even), each group's dot product exact, scaled by dx and the row's scale."""
    xq, dx = round_to_int8(x)
    w = q.reshape(q.shape[0], -1, 32).double()
    return torch.einsum("mgi,ngi,mg->mn", xq, w, dx) * scale.double()


@pytest.mark.parametrize("narrower", vector_paths())
@pytest.mark.parametrize("rows", [1, 3, 17])
@pytest.mark.parametrize(("n", "k"), [(1, 32), (7, 96), (130, 576), (5, 64)])
def test_q8_kernel_equals_a_float64_reference(
    narrower: str | None, rows: int, n: int, k: int
) -> None:
    """int4's LM head: every path (the CPU's widest, each narrower one it runs) gives the same
    sums, odd group counts (96: three) included; within 3% of the fp32 activations' product."""
    kernel = built(lambda: cpu_int8.build(q8=True, narrower=narrower))
    torch.manual_seed(rows * n + k)
    q, scale = cpu_int8.quantize(torch.randn(n, k))
    x = torch.randn(rows, k)
    x[0, :32] = 0  # an all-zero group
    got = kernel(x, q, scale)
    assert got.shape == (rows, n) and kernel.fits(q)
    torch.testing.assert_close(got.double(), q8_reference(x, q, scale), rtol=1e-4, atol=1e-4)
    exact = cpu_int8.widened_linear(x.double(), q, scale.double())
    assert (got.double() - exact).abs().max() <= 0.03 * exact.abs().max()
