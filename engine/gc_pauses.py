"""Garbage-collection pauses of this process, timed through ``gc.callbacks``.

A pause stops every thread of the process (the GIL is held), so it delays
whatever was in flight: the core's step, or the API process's event loop.
The callback only stamps two instants and appends a tuple for the longer
pauses; whoever owns the recorder takes them (per step, or on a timer).
"""

from __future__ import annotations

import gc
import time

from engine import envs

GC_PAUSE_MIN_NS = 1_000_000  # pauses listed one by one; shorter ones are only summed
_NONE: list[tuple[int, int, int]] = []  # shared, never appended to
# The collector's thresholds once a server process has started (Python's are 700, 10, 10).
# A serving process allocates a few objects per token and keeps almost none, so a young
# generation of 700 is collected every few steps, and each 10th-of-10th collection walks the
# whole heap: torch, transformers and the tokenizer, millions of objects. Measured (tiny model,
# 64 streams x 768 tokens each, traced, AMD EPYC 2 vCPUs): the API process paused 504-540 ms
# for GC with Python's settings (one pause of 216-245 ms), 29-41 ms with these and a frozen heap.
SERVING_GC_THRESHOLDS = (20_000, 50, 100)


def gc_setting() -> str:
    """LUMEN_GC, checked (a server checks it before it starts anything)."""
    setting = envs.LUMEN_GC.get() or "serving"
    if setting not in ("serving", "default"):
        raise ValueError(f"LUMEN_GC must be serving or default, not {setting!r}")
    return setting


def settle_heap() -> None:
    """Once start-up is done: collect, move what survived out of the collector's sight
    (``gc.freeze()``: the model, the tokenizer, the modules are never garbage), and collect
    the young generation less often (SERVING_GC_THRESHOLDS). ``LUMEN_GC=default`` keeps
    Python's own settings."""
    if gc_setting() == "default":
        return
    gc.collect()
    gc.freeze()
    gc.set_threshold(*SERVING_GC_THRESHOLDS)


class GcPauses:
    def __init__(self) -> None:
        self.pauses: list[tuple[int, int, int]] = []  # (start_ns, duration_ns, generation)
        self.total_ns = 0
        self._start_ns = 0
        gc.callbacks.append(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.time_ns()
        if phase == "start":
            self._start_ns = now
            return
        if not self._start_ns:
            return
        duration = now - self._start_ns
        self.total_ns += duration
        if duration >= GC_PAUSE_MIN_NS:
            self.pauses.append((self._start_ns, duration, info.get("generation", -1)))
        self._start_ns = 0

    def take(self) -> tuple[list[tuple[int, int, int]], int]:
        """The listed pauses and the summed pause time since the last call (once a step: no
        new list when there was no pause)."""
        if not self.total_ns:
            return _NONE, 0
        pauses, total = self.pauses, self.total_ns
        self.pauses, self.total_ns = [], 0
        return pauses, total

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
