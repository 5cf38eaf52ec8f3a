"""`replay diff`: a change is told from noise by bootstrap intervals."""

from __future__ import annotations

import numpy as np

from replay.diff import Change, compare


def test_noise_and_change() -> None:
    rng = np.random.default_rng(3)
    a = [[float(x)] for x in rng.lognormal(-2, 0.5, 200)]
    same = [[float(x)] for x in rng.lognormal(-2, 0.5, 200)]  # another sample, same law
    slower = [[v[0] * 1.5] for v in same]
    assert Change("ttft", 50, *compare(a, same, 50)).verdict == "no change beyond noise"
    change = Change("ttft", 50, *compare(a, slower, 50))
    assert change.verdict.startswith("slower by") and change.low_s > 0
    faster = Change("ttft", 50, *compare(slower, a, 50))
    assert faster.verdict.startswith("faster by")
    # Deterministic: the same inputs give the same interval.
    assert compare(a, slower, 50) == compare(a, slower, 50)
