"""The batched sampler: truncation, penalties, min_tokens, per-request seeds."""

from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import Sampler, SamplingRow, argmax

VOCAB = 50


def _row(seed: int | None = None, output: list[int] | None = None, **kw) -> SamplingRow:
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), gen, [1, 2, 3], list(output or []), frozenset({0}))


def _logits(rows: int = 1) -> torch.Tensor:
    torch.manual_seed(0)
    return torch.randn(rows, VOCAB) * 3


def test_truncation_to_one_token_equals_greedy() -> None:
    logits = _logits(3)
    rows = [_row(temperature=1.0, top_k=1), _row(temperature=1.0, top_p=1e-6), _row(min_p=1.0)]
    ids, _ = Sampler(torch.device("cpu"), 0)(logits, rows)
    assert ids == logits.argmax(-1).tolist()


def test_top_k_only_draws_from_the_k_best() -> None:
    logits = _logits(1).repeat(400, 1)
    ids, _ = Sampler(torch.device("cpu"), 0)(logits, [_row(top_k=3) for _ in range(400)])
    assert set(ids) <= set(logits[0].topk(3).indices.tolist())
    assert len(set(ids)) > 1


def test_draws_follow_the_softmax() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0] + [-1e9] * (VOCAB - 3)]).repeat(4000, 1)
    ids, _ = Sampler(torch.device("cpu"), 0)(logits, [_row() for _ in range(4000)])
    freq = torch.bincount(torch.tensor(ids), minlength=3)[:3].float() / 4000
    expected = torch.tensor([2.0, 1.0, 0.0]).softmax(-1)
    assert torch.allclose(freq, expected, atol=0.03), (freq, expected)


def test_seeded_rows_do_not_depend_on_their_neighbours() -> None:
    logits = _logits(3)
    s = Sampler(torch.device("cpu"), 0)
    a, _ = s(logits, [_row(seed=5), _row(), _row()])
    b, _ = s(logits[[2, 1, 0]], [_row(), _row(), _row(seed=5)])
    assert a[0] == b[2]


def test_penalties_push_repeated_tokens_down() -> None:
    logits = torch.full((1, VOCAB), 0.5)
    logits[0, 7] = 1.0
    out = [7, 7, 9]
    for kw in ({"frequency_penalty": 1.5}, {"presence_penalty": 1.5}, {"repetition_penalty": 3.0}):
        ids, _ = Sampler(torch.device("cpu"), 0)(logits, [_row(temperature=0, output=out, **kw)])
        assert ids[0] != 7, kw


def test_min_tokens_blocks_eos_and_stop_ids() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 0] = 10.0  # eos
    logits[0, 4] = 9.0  # a stop token id
    row = _row(temperature=0, output=[], min_tokens=2, stop_token_ids=[4])
    ids, _ = Sampler(torch.device("cpu"), 0)(logits, [row])
    assert ids[0] not in (0, 4)
    row.output_token_ids.extend([11, 12])
    ids, _ = Sampler(torch.device("cpu"), 0)(logits, [row])
    assert ids[0] == 0


@pytest.mark.parametrize("vocab", [49152, 49153, 50_000, 4096, 5000, 100])
def test_blocked_argmax_equals_torchs_first_index(vocab: int) -> None:
    """Ties (few distinct values), a maximum in a short tail block, random rows."""
    gen = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        x = torch.randn(37, vocab, generator=gen)
        if trial % 3 == 0:
            x = torch.randint(0, 5, (37, vocab), generator=gen).float()
        if trial % 4 == 0:
            x[::2, -1] = 100.0
        assert torch.equal(argmax(x), x.argmax(dim=-1)), trial


def test_blocked_argmax_of_no_rows() -> None:
    assert argmax(torch.empty(0, 49152)).shape == (0,)
