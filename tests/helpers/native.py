"""Building a native kernel in a test: a skip only where there is no C compiler, a failure
where one is present and the build fails (so CI cannot lose the kernels' coverage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

from engine.worker import native_build

T = TypeVar("T")


def built(build: Callable[[], T]) -> T:
    """``build()``'s kernel; skips the test only where no C compiler is on PATH."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler (cc or gcc, or $CC) on PATH: the native kernels cannot build")
    return build()


def vector_paths() -> list[str | None]:
    """The 8-bit-activation kernels' paths this CPU runs: its widest (None), then each narrower
    one ("avx2" where it has AVX2 and FMA, "plain" C everywhere), as their builds name them."""
    flags = native_build.cpu_key()
    return [None, *(["avx2"] if " avx2" in flags and " fma" in flags else []), "plain"]


def round_to_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' rounding of activations, for float64 references: x [rows, k] (k a whole
    number of groups of 32) -> (xq [rows, groups, 32] float64, dx [rows, groups] float64),
    dx = max|x| / 127 in fp32 and xq = round(x / dx), half to even (0 for an all-zero group)."""
    xp = x.reshape(x.shape[0], -1, 32)
    dx = xp.abs().amax(dim=2) * torch.tensor(1 / 127, dtype=torch.float32)
    inv = torch.where(dx != 0, 1.0 / dx, torch.zeros_like(dx))
    return torch.round(xp * inv[..., None]).clamp(-127, 127).double(), dx.double()
