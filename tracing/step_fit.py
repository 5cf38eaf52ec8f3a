"""The run's price of a step: the fit that says what a step of a given shape should take, and
the fallback where a run cannot be fitted (numpy; ``tracing.shares`` shares steps by it).

The fit (fit_step_shape, on the run's busy steps after the first COLD_STEPS)::

    execute_ns = a + b * prefill tokens + c * rows + f * full rows + g * on full

(full rows: a step's rows where it took the full logits, else 0; on full: 1 there, else 0)

least squares, refitted without the steps more than 3 robust deviations from its median residual
(except steps with MIN_PRICED_PREFILL prefill tokens: they alone price a token); no coefficient
below 0; b never above c (a prefill token is the same matmul work as a row, batched); where no step
carried MIN_PRICED_PREFILL prefill tokens and the warm-up priced one, or b is within 3 standard
errors of 0, b is the prior's (as measured, not capped by c) or else 0, and a, c are fitted the
same robust way to the rest. Without a prior (a run whose KV cache was too small to warm up), the
run's short prefills price a token where that price is beyond the noise: SmolLM2's prompts of 9 to
17 tokens at 1.7 ms a token (seeds 1400043 and 1400098), left unpriced, made recomputes of 34 and
50 tokens read as the core stalling.

The prior: the warm-up's own fit over a few timed shapes (engine.core.warmup, the runs row's
step_prior). Where the run cannot price a prefill token (no step carried MIN_PRICED_PREFILL,
or the price is within noise), b is the prior's and a, c are fitted to what it leaves; with
fewer than MIN_FIT_STEPS steps, the prior is the fit. The fit's ``source`` says which.

The fallback (step_weights, where the run recorded no prior): with fewer than MIN_FIT_STEPS
steps to fit (or a fit that is all 0), plain token shares (a = c = 0, b = d = 1); and if no
step carried MIN_PRICED_PREFILL prefill tokens, rows share alike (a = b = d = 0, c = 1).

f and g price what the full-logits path (a step where some row is not plain greedy: a grammar,
penalties, temperature, top-k/p, logprobs; every row of it takes the full logits) costs the
forward over the greedy head: g a step, f a row. They are the prior's where the prior has them:
the warm-up times the same batches on both paths, one after the other, where a run's steps of
the two paths differ in their context, their neighbours and the machine's speed at the time (on
SmolLM2 a run fitted 6.7 ms a row). Their cost comes off the steps on the full logits before a,
b, c are fitted to the rest. An older store's prior has f alone ([a, b, c, f]: a row's price,
g = 0) or neither; without f, f is fitted where the run holds steps of both paths, and kept only
at 3 standard errors above 0. A run whose rows all carry a grammar or a temperature holds steps
of one path only: without the prior, the full logits' cost reads as the model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from engine.least_squares import nonnegative_fit

MIN_CAUSE_NS = 20_000_000  # the verdict's absolute bar (tracing.diagnosis describes the rule)
OUTLIER_FACTOR = 3.0  # a step this many times its shape's expected time is an outlier
COLD_STEPS = 3  # the first steps, judged against a fit of the others
MIN_FIT_STEPS = 8  # fewer steps than this: no fit (no cold or outlier verdict, token shares)
MIN_PRICED_PREFILL = 64  # prefill tokens some step must carry before a token gets its own price

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class StepWeights:
    """The run's price of a step: fixed a, b per prefill token, c per row, d per decode token,
    f per row and g per step on the full-logits path."""

    a: float
    b: float
    c: float
    d: float
    fitted: bool = False  # a, b, c are ns from the fit (else the fallback's unitless shares)
    f: float = 0.0
    g: float = 0.0

    def full_extra(self, full_rows: npt.NDArray[np.int64]) -> FloatArray:
        """What the full logits cost steps with ``full_rows`` (0 where greedy) over the head."""
        extra: FloatArray = self.f * full_rows + self.g * (full_rows > 0)
        return extra


class StepFit(NamedTuple):
    """[a, b, c, f, g] of execute = a + b * prefill tokens + c * rows + f * full rows + g * on
    full, and where the prices come from:
    "run" (its own steps), "prior" (the warm-up's price of a prefill token: the run's prefills
    are too few or too short to price one) or "prior-all" (every price: too few steps)."""

    coef: FloatArray
    source: str


def fit_step_shape(
    prefill: npt.ArrayLike,
    rows: npt.ArrayLike,
    execute: npt.ArrayLike,
    prior: list[float] | None = None,
    full: npt.ArrayLike | None = None,
) -> StepFit | None:
    """The run's StepFit (the module docstring): with fewer than MIN_FIT_STEPS steps after the
    first COLD_STEPS, the prior (None without one).

    A step slowed by contention or a pause must not set the price of a token, hence the refit
    without outliers; but in a run of decodes the few long prefills are the only steps that
    price a prefill token, and the first fit (which the decodes dominate) misses exactly them:
    dropped, every long prefill would read as contention."""
    n = len(np.asarray(prefill))
    on_full = np.zeros(n) if full is None else np.asarray(full, dtype=float)
    x = np.column_stack([np.ones(n), prefill, rows, on_full]).astype(float)[COLD_STEPS:]
    y = np.asarray(execute, dtype=float)[COLD_STEPS:]
    has_f = prior is not None and len(prior) > 3  # an older store's prior is [a, b, c]
    prior_f = float(prior[3]) if prior is not None and has_f else 0.0
    prior_g = float(prior[4]) if prior is not None and len(prior) > 4 else 0.0
    if len(y) < MIN_FIT_STEPS:
        if prior is None:
            return None
        return StepFit(np.array([*prior[:3], prior_f, prior_g], dtype=float), "prior-all")
    full_rows = x[:, 3].copy()
    greedy = (full_rows == 0) & (x[:, 2] > 0)

    def without_f() -> None:
        """f and g are the prior's (or 0): their cost comes off the steps on the full logits,
        and the rest is fitted without the column."""
        nonlocal y
        y = y - prior_f * full_rows - prior_g * (full_rows > 0)
        x[:, 3] = 0.0

    if has_f or not (greedy.any() and (full_rows > 0).any()):
        without_f()  # the warm-up's price, or one path only: nothing to price it against

    def with_f(coef: FloatArray) -> FloatArray:
        """[a, b, c, f, g]: f fitted, or the prior's with its g."""
        if x[:, 3].any():
            return np.append(coef, 0.0)
        coef[3] = prior_f
        return np.append(coef, prior_g)

    def unpriced() -> StepFit:
        """The run cannot price a prefill token (no step can, or its price is within noise):
        the prior's price, or none."""
        price = float(prior[1]) if prior is not None else 0.0
        coef, kept = _robust_fit(x, y, price)
        if coef[3] and not _beyond_noise(x[kept], y[kept], coef, 3):
            without_f()
            coef = _robust_fit(x, y, price)[0]
        return StepFit(with_f(coef), "prior" if price > 0 else "run")

    if x[:, 1].max() < MIN_PRICED_PREFILL and prior is not None:
        return unpriced()
    coef, kept = _robust_fit(x, y)
    if not _beyond_noise(x[kept], y[kept], coef, 1):
        return unpriced()
    if coef[3] and not _beyond_noise(x[kept], y[kept], coef, 3):
        without_f()
        coef, kept = _robust_fit(x, y)
    a, b, c, f, g = with_f(coef)
    return StepFit(np.array([a, min(b, c) if c > 0 else b, c, f, g]), "run")


def _robust_fit(
    x: FloatArray, y: FloatArray, price: float | None = None
) -> tuple[FloatArray, npt.NDArray[np.bool_]]:
    """The fit, refitted without the steps it misses by more than 3 robust deviations (steps
    with MIN_PRICED_PREFILL prefill tokens are always kept), and the steps it kept; with
    ``price``, b is fixed to it and a, c are fitted to what the prefill leaves."""
    tokens = x[:, 1]
    if price is not None:
        y = y - price * tokens
        x = x.copy()
        x[:, 1] = 0.0
    coef = nonnegative_fit(x, y)
    # Distance from the median residual: slow steps pull the first fit, so the others' residuals
    # sit off 0 together.
    deviation = np.abs((y - x @ coef) - np.median(y - x @ coef))
    spread = 1.4826 * float(np.median(deviation)) or 1.0
    kept: npt.NDArray[np.bool_] = (deviation <= 3 * spread) | (tokens >= MIN_PRICED_PREFILL)
    if kept.sum() >= MIN_FIT_STEPS:
        coef = nonnegative_fit(x[kept], y[kept])
    else:
        kept = np.ones(len(y), dtype=bool)
    if price is not None:
        coef[1] = price
    return coef, kept


def _beyond_noise(x: FloatArray, y: FloatArray, coef: FloatArray, i: int) -> bool:
    """Whether coefficient i is at least 3 standard errors above 0, in the model the fit
    kept: a column nonnegative_fit dropped (coefficient 0) does not count. Counted, a rows
    column that only varies on the long-prefill steps (4 rows everywhere else) would share
    their variance with the prefill price and call a 12 us/token price noise."""
    used = (coef > 0) | (np.arange(len(coef)) == i)
    x, coef, i = x[:, used], coef[used], int(np.count_nonzero(used[:i]))
    dof = len(y) - x.shape[1]
    if dof < 1 or not x[:, i].any():
        return False
    sigma2 = float(np.sum((y - x @ coef) ** 2)) / dof
    cov = sigma2 * np.linalg.pinv(x.T @ x)
    return bool(coef[i] > 3 * np.sqrt(max(cov[i, i], 0.0)))


def step_weights(
    prefill: IntArray,
    rows: IntArray,
    execute: IntArray,
    prior: list[float] | None = None,
    full: IntArray | None = None,
) -> StepWeights:
    """The run's StepWeights from its busy steps' shapes and forward times: the fit (with the
    warm-up's prior where the run cannot price a step), else the fallback (module docstring)."""
    fit = fit_step_shape(prefill, rows, execute, prior, full)
    coef = None if fit is None else fit.coef
    if coef is not None and coef.sum() > 0:
        a, b, c, f, g = (float(v) for v in coef)
        return StepWeights(a, b, c, 0.0, fitted=True, f=f, g=g)
    if int(prefill.max(initial=0)) < MIN_PRICED_PREFILL:
        return StepWeights(0.0, 0.0, 1.0, 0.0)
    return StepWeights(0.0, 1.0, 0.0, 1.0)


def outlier(execute_ns: npt.ArrayLike, expected_ns: npt.ArrayLike) -> npt.NDArray[np.bool_]:
    """Steps slow for their shape: OUTLIER_FACTOR times their expected execute time, and
    MIN_CAUSE_NS over it."""
    execute, expected = np.asarray(execute_ns, float), np.asarray(expected_ns, float)
    slow: npt.NDArray[np.bool_] = (execute >= OUTLIER_FACTOR * expected) & (
        execute - expected >= MIN_CAUSE_NS
    )
    return slow
