"""One call on a thread of its own, for start-up work that can overlap another (the
tokenizer while the core process starts, the grammar engine while the model loads)."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def in_background(fn: Callable[..., T], *args: object, name: str) -> Future[T]:
    """``fn(*args)`` started now on a thread named ``name``; ``result()`` waits for it and
    raises what it raised."""
    pool = ThreadPoolExecutor(1, thread_name_prefix=name)
    future = pool.submit(fn, *args)
    pool.shutdown(wait=False)  # the thread ends with the call
    return future
