"""The CPUs a process may use, and each data-parallel engine's share of them.

A process may use the CPUs of its affinity set (``taskset``, a container's cpuset), and no more
time than its cgroup's quota (``cpu.max``: a container's ``--cpus``). ``os.cpu_count`` counts
neither. Each of N engine cores gets its own slice of the affinity set, pinned, as wide as its
share of what the process may use: torch then runs as many threads as the slice has CPUs.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_CPU_MAX = Path("/sys/fs/cgroup/cpu.max")  # cgroup v2: "<quota> <period>" or "max <period>"


def allowed_cpus() -> list[int]:
    """The CPUs of this process's affinity set, in order."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return list(range(os.cpu_count() or 1))


def cgroup_quota_cpus(path: Path = CGROUP_CPU_MAX) -> float | None:
    """The cgroup's CPU quota in CPUs (``cpu.max`` 150000 100000: 1.5), or None: no quota."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def usable_cpus() -> int:
    """How many CPUs this process can keep busy: its affinity set, capped by its quota."""
    cpus = len(allowed_cpus())
    quota = cgroup_quota_cpus()
    return max(1, min(cpus, math.floor(quota)) if quota is not None else cpus)


@dataclass(frozen=True)
class Share:
    """One engine's slice: the CPUs it is pinned to, and the threads it runs."""

    cpus: list[int]
    threads: int
    of: int  # the CPUs the whole server may use

    def describe(self, rank: int, size: int) -> str:
        cpus = ",".join(map(str, self.cpus))
        return (
            f"engine {rank} of {size}: CPUs {cpus}, {self.threads} thread"
            f"{'s' if self.threads != 1 else ''} (its share of the {self.of} this server may use)"
        )


def share(rank: int, size: int, tensor_parallel_size: int = 1) -> Share:
    """Engine ``rank`` of ``size``'s slice; each of its ``tensor_parallel_size`` workers takes
    an equal part of it."""
    cpus = allowed_cpus()
    usable = usable_cpus()
    width = max(1, usable // size)
    start = rank * width
    mine = cpus[start : start + width] or cpus[-width:]
    return Share(mine, max(1, len(mine) // tensor_parallel_size), usable)


def check_split(data_parallel_size: int, tensor_parallel_size: int) -> None:
    """ValueError, in one line, when N engines of TP workers each cannot have a CPU of their
    own (on CPU: the machine can then serve no faster, only slower)."""
    if data_parallel_size < 1:
        raise ValueError(f"--data-parallel-size must be at least 1, got {data_parallel_size}")
    needed = data_parallel_size * tensor_parallel_size
    usable = usable_cpus()
    if data_parallel_size > 1 and needed > usable:
        raise ValueError(
            f"--data-parallel-size {data_parallel_size} x --tensor-parallel-size "
            f"{tensor_parallel_size} needs {needed} CPUs; this process may use {usable} "
            "(its affinity set and cgroup quota)"
        )


def pin(cpus: list[int]) -> None:
    """Pin this process (and the threads and workers it starts after) to ``cpus``."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setaffinity(0, cpus)
