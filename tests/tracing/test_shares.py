"""The step-cost fit (tracing.shares) on shapes laid out by hand."""

from __future__ import annotations

import numpy as np
import pytest

from tracing.step_fit import COLD_STEPS, fit_step_shape, outlier

MS = 1e6


@pytest.mark.parametrize("prior", [None, [1.0 * MS, 0.3 * MS, 2.0 * MS]], ids=["no-prior", "prior"])
def test_slow_steps_do_not_set_the_price_when_prompts_are_short(prior: list[float] | None) -> None:
    """Decode steps of 3 to 5 rows at 2.5 ms a row, 8 of 40 held to 50 ms (a pause), prompts of
    20 tokens (too short to price): the fit drops the slow steps before pricing the rest, so
    all 8 are outliers."""
    rng = np.random.default_rng(0)
    n = COLD_STEPS + 40
    rows = rng.integers(3, 6, n)
    prefill = np.where(np.arange(n) % 10 == 1, 20, 0)
    execute = 2.5 * MS * rows + rng.normal(0, 0.2 * MS, n)
    slow = np.zeros(n, dtype=bool)
    slow[COLD_STEPS + np.arange(2, 40, 5)] = True
    execute[slow] = 50 * MS
    fit = fit_step_shape(prefill, rows, execute, prior)
    assert fit is not None
    coef = fit.coef
    expected = coef @ np.vstack([np.ones(n), prefill, rows, np.zeros(n), np.zeros(n)])  # greedy
    assert outlier(execute, expected)[slow].all(), (coef, expected[slow])
    assert not outlier(execute, expected)[~slow].any()


def test_short_prompts_price_a_prefill_token_where_the_warm_up_did_not() -> None:
    """A run without the warm-up's prior (its KV cache too small to warm up) whose prompts are
    short (9 to 17 tokens) but cost 1.7 ms a token over 17 ms decode steps (SmolLM2 on 2
    cores, seed 1400043): the run's own short prefills price a token, so a recompute of 50
    tokens in 103 ms is a prefill's time, not an outlier (unpriced, it read as the core
    stalling at 5.6x a decode step)."""
    rng = np.random.default_rng(1)
    n = COLD_STEPS + 60
    rows = rng.integers(1, 3, n)
    prefill = np.where(np.arange(n) % 10 == 3, rng.integers(9, 18, n), 0)
    execute = 16.7 * MS + 0.6 * MS * rows + 1.7 * MS * prefill + rng.normal(0, 0.3 * MS, n)
    prefill[-1], rows[-1], execute[-1] = 50, 2, 102.7 * MS
    fit = fit_step_shape(prefill, rows, execute, None)
    assert fit is not None and fit.source == "run" and fit.coef[1] >= 0.3 * MS, fit
    expected = fit.coef @ np.vstack([np.ones(n), prefill, rows, np.zeros(n), np.zeros(n)])
    assert not outlier(execute, expected)[-1], (fit.coef, expected[-1])
