"""The step price's least squares: never a negative coefficient, and always an end."""

from __future__ import annotations

import numpy as np

from engine.least_squares import nonnegative_fit


def test_a_negative_price_is_dropped_and_the_rest_refitted() -> None:
    # Rows nearly constant: a plain fit trades the fixed cost against a negative row price.
    rng = np.random.default_rng(0)
    rows = 4 + (rng.random(40) < 0.1)
    y = 30.0 + rng.normal(0, 0.5, 40) - 2.0 * (rows - 4)
    x = np.column_stack([np.ones(40), rows, np.zeros(40)]).astype(float)  # a column never used
    plain = np.linalg.lstsq(x, y, rcond=None)[0]
    assert plain[1] < 0
    coef = nonnegative_fit(x, y)
    assert coef[1] == 0 and coef[2] == 0 and abs(coef[0] - float(np.mean(y))) < 1e-9
    assert (x[:, 1] == rows).all()  # the caller's columns are left as they were
