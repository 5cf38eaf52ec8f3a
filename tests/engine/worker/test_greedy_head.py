"""Greedy decoding's fused LM head and argmax (engine.worker.cpu_greedy_head): the kernel
against torch's logits and argmax, ties, padding, threads, and the plan chosen at load."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_greedy_head, native_build


def _kernel(weight: torch.Tensor) -> cpu_greedy_head.NativeGreedyHead:
    vector = native_build.vector_floats()
    per_block = 4 if vector == 16 else 2
    defines = (f"-DVL={vector}", f"-DNV={per_block}", f"-DR={cpu_greedy_head.ROWS_PER_TILE}")
    try:
        library = native_build.compile_library(
            f"greedy_head_v{vector}", cpu_greedy_head.SOURCE, defines
        )
    except RuntimeError as e:
        pytest.skip(f"the native greedy head did not build here: {e}")
    return cpu_greedy_head.NativeGreedyHead(str(library), weight, vector, per_block)


@pytest.mark.parametrize("vocab", [1, 63, 130, 1000, 4099])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 13, 64])
def test_kernel_equals_the_argmax_of_the_logits(vocab: int, rows: int) -> None:
    torch.manual_seed(vocab * 100 + rows)
    weight = torch.randn(vocab, 48)
    h = torch.randn(rows, 48)
    got = _kernel(weight)(h)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert got.tolist() == (h.double() @ weight.double().t()).argmax(-1).tolist()


def test_ties_take_the_lowest_index_and_padding_never_wins() -> None:
    """Every logit negative: a zero-padded vocabulary block would win if it counted."""
    weight = torch.full((150, 16), -1.0)
    weight[[70, 20, 149]] = -0.5  # three equal best rows
    kernel = _kernel(weight)
    h = torch.ones(9, 16)
    assert kernel(h).tolist() == [20] * 9
    assert (h @ weight.t()).max(-1).values.lt(0).all()


def test_threads_split_the_vocabulary_and_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(1)
    weight = torch.randn(5000, 64)
    weight[4000] = weight[10]  # the same best logit in two threads' shares: the first wins
    h = torch.randn(20, 64)
    h[3] = weight[10] * 10
    kernel = _kernel(weight)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = kernel(h)
        torch.set_num_threads(max(2, threads))
        many = kernel(h)
    finally:
        torch.set_num_threads(threads)
    assert one.tolist() == many.tolist() == (h @ weight.t()).argmax(-1).tolist()
    assert one[3] == 10


def test_plan_is_timed_and_forced_by_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(3000, 32)
    torch_path = lambda h: (h @ weight.t()).argmax(-1)  # noqa: E731
    plan = cpu_greedy_head.plan(weight, torch_path)
    print(plan.why)
    assert "ms native/torch at rows 1:" in plan.why or "did not build" in plan.why
    assert not cpu_greedy_head.plan(weight.bfloat16(), torch_path).takes(1)
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "torch")
    assert not cpu_greedy_head.plan(weight, torch_path).takes(1)
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "native")
    forced = cpu_greedy_head.plan(weight, torch_path)
    assert forced.takes(1) and forced.takes(10_000)
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "fused")
    with pytest.raises(ValueError, match="LUMEN_CPU_GREEDY_HEAD must be one of auto, native"):
        cpu_greedy_head.plan(weight, torch_path)
