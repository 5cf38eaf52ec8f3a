"""Garbage-collection pauses of this process, timed through ``gc.callbacks``.

A pause stops every thread of the process (the GIL is held), so it delays
whatever was in flight: the core's step, or the API process's event loop.
The callback only stamps two instants and appends a tuple for the longer
pauses; whoever owns the recorder takes them (per step, or on a timer).
"""

from __future__ import annotations

import gc
import time

GC_PAUSE_MIN_NS = 1_000_000  # pauses listed one by one; shorter ones are only summed
_NONE: list[tuple[int, int, int]] = []  # shared, never appended to


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
