"""Building a native kernel in a test: a skip only where there is no C compiler, a failure
where one is present and the build fails (so CI cannot lose the kernels' coverage)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import pytest

from engine.worker import native_build

T = TypeVar("T")


def built(build: Callable[[], T]) -> T:
    """``build()``'s kernel; skips the test only where no C compiler is on PATH."""
    if native_build.compiler() is None:
        pytest.skip("no C compiler (cc or gcc, or $CC) on PATH: the native kernels cannot build")
    return build()
