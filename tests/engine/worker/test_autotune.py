"""The one way CPU kernels are chosen (engine.worker.autotune): a decision is timed once per
machine, model shape and versions, cached on disk, and timed again only when told to or when
its key changes; a cache file someone else could have written is not trusted."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from engine.worker import autotune, cpu_attention, cpu_decode_layer, cpu_matmul
from engine.worker.decode_cache import torch_attention
from tests.helpers.native import built


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("LUMEN_AUTOTUNE_DIR", str(tmp_path))
    monkeypatch.delenv("LUMEN_AUTOTUNE", raising=False)
    return tmp_path


class Measure:
    def __init__(self, choice: object = "fast") -> None:
        self.calls = 0
        self.choice = choice

    def __call__(self) -> tuple[object, str]:
        self.calls += 1
        return self.choice, f"timed {self.calls}"


def test_a_decision_is_timed_once_then_read_from_the_cache(cache: Path) -> None:
    measure = Measure(["fused", "torch"])
    first = autotune.decide("thing", {"rows": 16}, measure)
    assert (first.choice, first.why, first.cached) == (["fused", "torch"], "timed 1", False)
    second = autotune.decide("thing", {"rows": 16}, measure)
    assert (second.choice, second.why, second.cached) == (
        ["fused", "torch"],
        "cached: timed 1",
        True,
    )
    assert measure.calls == 1
    assert len(list(cache.glob("thing-*.json"))) == 1


def test_another_shape_machine_or_version_is_timed_again(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    measure = Measure()
    autotune.decide("thing", {"rows": 16}, measure)
    autotune.decide("thing", {"rows": 64}, measure)
    assert measure.calls == 2
    monkeypatch.setattr(autotune.native_build, "cpu_key", lambda: "x86_64 flags: other")
    autotune.decide("thing", {"rows": 16}, measure)
    assert measure.calls == 3
    monkeypatch.setattr(torch, "__version__", "0.0.1")
    autotune.decide("thing", {"rows": 16}, measure)
    assert measure.calls == 4


def test_retune_times_again_and_overwrites(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    measure = Measure()
    autotune.decide("thing", {}, measure)
    monkeypatch.setenv("LUMEN_AUTOTUNE", "retune")
    assert autotune.decide("thing", {}, measure).why == "timed 2"
    monkeypatch.delenv("LUMEN_AUTOTUNE")
    assert autotune.decide("thing", {}, measure).why == "cached: timed 2"
    monkeypatch.setenv("LUMEN_AUTOTUNE", "sometimes")
    with pytest.raises(ValueError, match="LUMEN_AUTOTUNE must be one of cache, retune"):
        autotune.decide("thing", {}, measure)


def test_a_cache_file_others_can_write_is_not_read(
    cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    measure = Measure()
    autotune.decide("thing", {}, measure)
    (path,) = cache.glob("thing-*.json")
    assert path.stat().st_mode & 0o777 == 0o644
    path.chmod(0o666)
    with caplog.at_level(logging.WARNING, logger="engine.worker.native_build"):
        assert autotune.decide("thing", {}, measure).why == "timed 2"
    assert path.stat().st_mode & 0o777 == 0o644  # replaced by this user's own
    assert autotune.decide("thing", {}, measure).cached
    path.write_text("{not json")
    assert autotune.decide("thing", {}, measure).why == "timed 3"
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "not loading the cached kernel decision" in warnings[0].message


def test_a_cache_that_cannot_be_written_only_costs_the_timing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    monkeypatch.setenv("LUMEN_AUTOTUNE_DIR", str(blocked / "autotune"))
    assert autotune.decide("thing", {}, Measure()).choice == "fast"


def test_cache_folder_defaults_under_lumen_home(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LUMEN_AUTOTUNE_DIR")
    monkeypatch.setenv("LUMEN_HOME", "/somewhere")
    assert autotune.cache_dir() == Path("/somewhere/autotune")


def test_best_of_each_interleaves_and_sets_up_untimed() -> None:
    order: list[str] = []
    times = autotune.best_of_each(
        {"a": lambda: order.append("a"), "b": lambda: order.append("b")},
        rounds=2,
        before=lambda key: order.append(f"set {key}"),
    )
    assert set(times) == {"a", "b"} and all(t >= 0 for t in times.values())
    assert order == ["set a", "a", "set b", "b"] * 3


def test_the_matmul_and_attention_choosers_go_through_the_cache(cache: Path) -> None:
    weight = torch.randn(64, 96)
    first = cpu_matmul.choose(weight, rows=(4,))
    again = cpu_matmul.choose(weight, rows=(4,))
    assert again == cpu_matmul.Choice(first.kernel, f"cached: {first.why}")
    built(lambda: cpu_attention.build(2, 8))
    timed = cpu_attention.choose(2, 8, torch.float32, torch_attention)
    assert "16 rows x 512 positions: native" in timed.why
    cached = cpu_attention.choose(2, 8, torch.float32, torch_attention)
    assert cached.why == f"cached: {timed.why}"
    assert (cached.kernel is None) == (timed.kernel is None)


@pytest.mark.parametrize(
    ("aten_s", "panels_s", "edge", "kernel"),
    [(1.05, 5.0, 0.0, "onednn"), (1.05, 5.0, 0.10, "aten"), (1.2, 5.0, 0.10, "onednn"),
     (0.9, 5.0, 0.0, "aten"), (1.2, 1.05, 0.10, "panels"), (1.2, 0.95, 0.0, "panels")],
)  # fmt: skip
def test_the_matmul_chooser_gives_aten_its_edge(
    cache: Path, monkeypatch: pytest.MonkeyPatch, aten_s: float, panels_s: float, edge: float,
    kernel: str,
) -> None:  # fmt: skip
    """Where aten's products gain beyond their own time (fp32's one-call decode layers), oneDNN
    is chosen only when it times more than the edge faster, than aten and than Lumen's panels
    (which run in one call too); the fastest otherwise. The edge is in the cache's key."""
    if not cpu_matmul.onednn_available(torch.float32):
        pytest.skip("oneDNN does not serve fp32 here")
    built(cpu_matmul.panels)
    times = {"aten": aten_s, "onednn": 1.0, "panels": panels_s}
    monkeypatch.setattr(autotune, "best_of_each", lambda fns, **kw: {k: times[k] for k in fns})
    choice = cpu_matmul.choose(torch.randn(32, 48), rows=(4,), aten_edge=edge)
    assert choice.kernel == kernel, choice.why
    assert ("oneDNN must be over 10% faster" in choice.why) == (edge > 0)
    assert f"panels {panels_s * 1e3:.2f} ms" in choice.why


def test_fp32_layers_that_can_run_in_one_call_give_aten_the_edge(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    weight = torch.randn(32, 48)
    if cpu_decode_layer.blas_sgemm() is None:
        assert not cpu_decode_layer.f32_one_call(weight)
        pytest.skip("torch's products do not run on MKL here")
    assert cpu_decode_layer.f32_one_call(weight)
    assert not cpu_decode_layer.f32_one_call(weight.to(torch.bfloat16))
    monkeypatch.setenv("LUMEN_CPU_F32_LAYER", "off")
    assert not cpu_decode_layer.f32_one_call(weight)
    monkeypatch.setenv("LUMEN_CPU_F32_LAYER", "auto")
    monkeypatch.setenv("LUMEN_CPU_DECODE_LAYER", "off")
    assert not cpu_decode_layer.f32_one_call(weight)
