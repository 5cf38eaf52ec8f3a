"""Lumen's fp32 panels kernel (engine/worker/native/f32_panels.c, cpu_matmul.NativePanels):
products against float64 at shapes that are no whole number of its tiles, the model's Linear
on it, and its place among the kernels the load chooses from."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
import torch

from engine.worker import cpu_matmul, layers
from tests.helpers.models import lumen_greedy
from tests.helpers.native import built


def _panels() -> cpu_matmul.NativePanels:
    return built(cpu_matmul.panels)


# (k, n): k past one and two of its 256-row blocks (300, 513, 576), and of 1, 3 and 37;
# n past its 256-column blocks (600, 960), with a narrower last panel, and under a panel.
SHAPES = [(576, 960), (513, 600), (37, 5), (3, 17), (300, 1), (1, 33)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("k, n", SHAPES)
def test_panel_products_match_a_float64_reference(k: int, n: int, threads: int) -> None:
    """Rows from one (a decode stream) to past several six-row tiles, each against float64;
    the outputs start as NaN, so a column or row the kernel skipped or wrote past fails."""
    kernel = _panels()
    gen = torch.Generator().manual_seed(k * 1000 + n)
    w = torch.randn(k, n, generator=gen)  # [in, out], as the model's Linear stores it
    held, described = kernel.pack(w)
    assert held.shape == (-(-n // kernel.width), k, kernel.width)
    fn = kernel._fn
    for m in (1, 2, 5, 6, 7, 13, 64):
        x = torch.randn(m, k, generator=gen)
        y = torch.full((m, n), float("nan"))
        assert fn(ctypes.addressof(described), x.data_ptr(), m, y.data_ptr(), threads) == 0
        ref = x.double() @ w.double()
        err = (y.double() - ref).abs().max().item() / ref.abs().max().item()
        assert err < 1e-5, (m, err)


def test_a_linear_on_the_panels_gives_its_plain_product() -> None:
    """Linear.pack_panels frees the plain weight; the product, of 2-D and 3-D inputs and with
    a bias, is the plain one's to float rounding."""
    _panels()
    torch.manual_seed(0)
    linear = layers.Linear(40, 70, bias=True)
    torch.nn.init.normal_(linear.weight)
    torch.nn.init.normal_(linear.bias)
    w, b = linear.weight.detach().clone(), linear.bias.detach().clone()
    linear.pack_panels()
    assert linear.weight.numel() == 0 and linear.panels is not None
    for x in (torch.randn(9, 40), torch.randn(2, 3, 40)):
        got = linear(x)
        assert got.shape == (*x.shape[:-1], 70)
        torch.testing.assert_close(got, x @ w + b, rtol=1e-5, atol=1e-4)


def test_the_panels_are_timed_at_load_and_forced_where_they_serve(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
    tmp_path: Path,
) -> None:  # fmt: skip
    """The load times the panels beside aten and oneDNN (and names each figure); forced, a
    model runs on them, its decode layers in one call, with the tokens of aten's products; a
    bf16 weight, which they do not multiply, is refused with the reason; the LM head, which
    is never theirs, is timed."""
    _panels()
    monkeypatch.setenv("LUMEN_AUTOTUNE_DIR", str(tmp_path / "autotune"))
    w = torch.randn(64, 96)
    choice = cpu_matmul.choose(w, rows=(4, 32))
    assert choice.kernel in ("aten", "onednn", "panels") and "panels" in choice.why
    assert cpu_matmul.choose(w.t(), rows=(4,), with_panels=False).why.count("panels") == 0

    def run(kernel: str) -> list[int]:
        monkeypatch.setenv("LUMEN_CPU_MATMUL", kernel)
        caplog.clear()
        with caplog.at_level("INFO"):
            return lumen_greedy(tiny_model_path, [3, 4, 5, 6])

    on_panels = run("panels")
    assert "CPU matrix products: panels (set by LUMEN_CPU_MATMUL" in caplog.text
    assert "fp32 decode layers: one native call each, products on the panels" in caplog.text
    assert on_panels == run("aten")
    monkeypatch.setenv("LUMEN_CPU_MATMUL", "panels")
    with pytest.raises(ValueError, match="panels multiply fp32 weights, and this model's are"):
        cpu_matmul.choose(w.bfloat16(), rows=(4,))
    head = cpu_matmul.choose(w.t(), rows=(4,), with_panels=False)  # timed: not the panels'
    assert head.kernel in ("aten", "onednn") and "set by" not in head.why


def test_panels_that_do_not_build_are_an_error_forced_and_no_candidate_timed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Without a working C compiler the timing leaves the panels out, and forcing them fails
    the load with the build's error, as for every forced native kernel."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("LUMEN_AUTOTUNE_DIR", str(tmp_path / "autotune"))
    cpu_matmul.panels.cache_clear()
    try:
        timed = cpu_matmul.choose(torch.randn(64, 96), rows=(4,))
        assert timed.kernel != "panels" and "panels" not in timed.why
        monkeypatch.setenv("LUMEN_CPU_MATMUL", "panels")
        with pytest.raises((RuntimeError, OSError)):
            cpu_matmul.choose(torch.randn(64, 96), rows=(4,))
    finally:
        cpu_matmul.panels.cache_clear()
