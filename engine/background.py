"""One call on a thread of its own, for start-up work that can overlap another (the
tokenizer while the core process starts, the grammar engine while the model loads)."""

from __future__ import annotations

import ctypes
import functools
import sys
import threading
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


def name_os_thread() -> None:
    """Give the calling thread its Python name in the OS too (Linux keeps 15 bytes), so that
    top -H, /proc/PID/task/TID/comm and `lumen bench overhead` tell the threads apart."""
    prctl = _prctl()
    if prctl is not None:
        prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # PR_SET_NAME


ENGINE_CORE_TITLE = "lumen::EngineCore"  # engine_core_proc names its process so (with _DP<rank>)


def is_engine_core(cmdline: list[str]) -> bool:
    """Whether a process's command line is an engine core's: its title (name_process), or, where
    setproctitle is missing, multiprocessing's spawned child."""
    line = " ".join(cmdline)
    return ENGINE_CORE_TITLE in line or "spawn" in line


def name_process(title: str) -> None:
    """Name this process as ``ps`` and ``top`` show it, as vLLM names its own: the title (its
    command line, in ``ps -ef``) where setproctitle is installed, and the part after ``::``
    as its comm (Linux keeps 15 bytes: what ``top`` and ``ps -e`` show)."""
    try:
        from setproctitle import setproctitle
    except ImportError:
        pass
    else:
        setproctitle(title)
    prctl = _prctl()
    if prctl is not None:
        prctl(15, title.rpartition("::")[2].encode()[:15], 0, 0, 0)  # PR_SET_NAME


@functools.cache
def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
