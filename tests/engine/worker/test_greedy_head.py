"""Greedy decoding's LM head and argmax (engine.worker.cpu_greedy_head): the fused fp32
kernel and the bf16-screened one against the exact argmax, ties, padding, threads, and the
plan chosen at load."""

from __future__ import annotations

import pytest
import torch

from engine.worker import cpu_greedy_head, cpu_matmul
from tests.helpers.native import built


def _library() -> tuple[str, int, int]:
    return built(cpu_greedy_head.build)


def _kernel(weight: torch.Tensor) -> cpu_greedy_head.FusedHead:
    library, vector, per_block = _library()
    return cpu_greedy_head.FusedHead(library, weight, vector, per_block)


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


def _screened(weight: torch.Tensor) -> cpu_greedy_head.ScreenedHead:
    if not cpu_matmul.onednn_available(torch.bfloat16):
        pytest.skip("this CPU has no oneDNN bf16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT)")
    return cpu_greedy_head.ScreenedHead(_library()[0], weight)


@pytest.mark.parametrize(("vocab", "hidden"), [(1, 16), (130, 48), (5000, 64), (3000, 576)])
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_screened_head_equals_the_exact_argmax(vocab: int, hidden: int, rows: int) -> None:
    """bf16 logits only screen the candidates: the answer is fp32's, not bf16's."""
    torch.manual_seed(vocab + hidden + rows)
    weight = torch.randn(vocab, hidden) * 0.1
    h = torch.randn(rows, hidden) * 3
    want = (h.double() @ weight.double().t()).argmax(-1)
    assert _screened(weight)(h).tolist() == want.tolist()


def test_screened_head_separates_what_bf16_cannot() -> None:
    """Logits 3e-6 of themselves apart (bf16 resolves 4e-3): fp32's winner, the first of
    exact ties, with positive and with negative logits."""
    torch.manual_seed(3)
    weight = torch.randn(4000, 64)
    weight[2500] = weight[7] * (1 + 3e-6)
    weight[3000] = weight[7] * (1 - 3e-6)
    weight[3500] = weight[2500]  # an exact tie with 2500: the first wins
    h = (weight[7] * 5 + torch.randn(64) * 1e-3).repeat(3, 1)
    want = (h.double() @ weight.double().t()).argmax(-1).tolist()
    assert want == [2500] * 3
    assert _screened(weight)(h).tolist() == want

    negative = -torch.rand(4000, 64) - 0.5  # with h > 0 every logit is below zero
    negative[10] = -0.01
    negative[20] = negative[10] * (1 - 3e-6)  # the least negative
    h = torch.rand(3, 64) + 0.5
    want = (h.double() @ negative.double().t()).argmax(-1).tolist()
    assert want == [20] * 3
    assert _screened(negative)(h).tolist() == want
    assert _screened(weight)(torch.zeros(2, 64)).tolist() == [0, 0]  # every logit 0: the first


def test_plan_is_timed_cached_and_forced_by_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _library()
    weight = torch.randn(3000, 32)
    torch_path = lambda h: (h @ weight.t()).argmax(-1)  # noqa: E731
    monkeypatch.setenv("LUMEN_AUTOTUNE", "retune")
    plan = cpu_greedy_head.plan(weight, torch_path)
    print(plan.why)
    assert plan.why.startswith("1 rows:")
    monkeypatch.delenv("LUMEN_AUTOTUNE")
    again = cpu_greedy_head.plan(weight, torch_path)  # the same shape: no timing
    assert again.why == f"cached: {plan.why}"
    assert [type(p) for _, p in again.paths] == [type(p) for _, p in plan.paths]
    assert cpu_greedy_head.plan(weight.bfloat16(), torch_path).path(1) is None
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "torch")
    assert cpu_greedy_head.plan(weight, torch_path).path(1) is None
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "fused")
    forced = cpu_greedy_head.plan(weight, torch_path)
    assert isinstance(forced.path(1), cpu_greedy_head.FusedHead)
    assert forced.path(10_000) is forced.path(1)
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "flash")
    with pytest.raises(ValueError, match="LUMEN_CPU_GREEDY_HEAD must be one of auto, fused"):
        cpu_greedy_head.plan(weight, torch_path)


def test_bf16_is_offered_exactly_where_onednn_packs_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """An AVX2-only CPU has oneDNN, but it refuses to pack a bf16 weight: there the screened
    head is not timed, and forcing it is one clear error rather than a failed load."""
    try:
        cpu_matmul.pack(torch.randn(64, 32).bfloat16())
        packs = True
    except RuntimeError as e:
        print(f"\noneDNN bf16 here: {e}")
        packs = False
    assert cpu_matmul.onednn_available(torch.bfloat16) == packs
    weight = torch.randn(300, 32)
    torch_path = lambda h: (h @ weight.t()).argmax(-1)  # noqa: E731
    assert ("screened" in cpu_greedy_head._Paths(weight).names()) == packs
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "screened")
    if packs:
        path = cpu_greedy_head.plan(weight, torch_path).path(1)
        assert isinstance(path, cpu_greedy_head.ScreenedHead)
    else:
        with pytest.raises(RuntimeError, match="screened, but oneDNN has no bf16 here"):
            cpu_greedy_head.plan(weight, torch_path)
