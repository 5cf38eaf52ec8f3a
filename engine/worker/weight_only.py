"""What the weight-only kernels (cpu_int8, cpu_int4) share: up to how many rows their native
kernel takes a product, decided once per machine and weight shape (autotune), against
widening the weight to the activations' dtype for torch's product.

The native kernel is timed against widening at each of ``timed_rows`` in turn, from the
fewest; it takes the row counts up to the last where it was faster, and every row count where it
was faster at all of them. ``var`` (LUMEN_CPU_INT8, LUMEN_CPU_INT4) forces native or widen.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

import torch

from engine import envs
from engine.worker import autotune

KERNELS = ("auto", "native", "widen")
EVERY = 1 << 62  # "every row count"
N = TypeVar("N")
Products = Callable[[torch.Tensor], Mapping[str, Callable[[], object]]]


def plan_rows(
    name: str,
    var: envs.EnvVar,
    dtype: torch.dtype,
    build: Callable[[], N],
    products: Callable[[N], Products],
    *,
    in_features: int,
    timed_rows: Sequence[int],
    shape: Mapping[str, Any],
    unfit: Callable[[N], str | None] = lambda kernel: None,
) -> tuple[N | None, int, str]:
    """(the kernel or None, the most rows it takes, why) for one weight: ``products(kernel)(x)``
    gives the "native" and "widen" products of x to time; ``unfit(kernel)`` says why the
    weight cannot take the kernel at all (None: it can)."""
    forced = autotune.forced(var, KERNELS)
    if forced == "widen":
        return None, 0, f"every product widens the weight, set by {var.name}"
    if dtype != torch.float32:
        return None, 0, f"the native kernel takes fp32 activations, not {dtype}"
    try:
        kernel = build()
    except autotune.BUILD_ERRORS as e:
        if forced == "native":
            raise RuntimeError(f"{var.name}=native, but the kernel did not build: {e}") from e
        return None, 0, f"the native kernel did not build: {e}"
    if (why := unfit(kernel)) is not None:
        return None, 0, why
    if forced == "native":
        return kernel, EVERY, f"native for every row count, set by {var.name}"
    decision = autotune.decide(
        name, shape, lambda: _time(products(kernel), in_features, timed_rows)
    )
    max_rows = decision.choice
    limit = "every row count" if max_rows > timed_rows[-1] else f"up to {max_rows} rows"
    return kernel if max_rows else None, max_rows, f"native for {limit} ({decision.why})"


def _time(products: Products, in_features: int, timed_rows: Sequence[int]) -> tuple[int, str]:
    max_rows, timings = 0, []
    for rows in timed_rows:
        times = autotune.best_of_each(products(torch.randn(rows, in_features)))
        timings.append(f"{rows}: {times['native'] * 1e3:.2f}/{times['widen'] * 1e3:.2f}")
        if times["native"] >= times["widen"]:
            break
        max_rows = rows
    if max_rows == timed_rows[-1]:
        max_rows = EVERY
    return max_rows, f"ms native/widened at rows {', '.join(timings)}"
