"""Pause intervals (GC, event-loop lag) and how much of them lies inside a window: what
`tracing.diagnose` carves out of a request's parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt


class PauseRow(NamedTuple):
    """One row of the pauses table."""

    process: str  # api | core
    kind: str  # gc | loop_lag | cpu (the API process busy: not a pause)
    start_ns: int
    duration_ns: int
    cpu_ns: int | None = None


class Intervals:
    """Disjoint time intervals (merged on build): how much of them lies inside a window."""

    def __init__(self, spans: list[tuple[int, int]]) -> None:
        merged: list[list[int]] = []
        for a, b in sorted(spans):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        arr = np.array(merged, dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = arr[:, 0], arr[:, 1]
        self.cum = np.cumsum(self.ends - self.starts)

    def before(self, t: npt.ArrayLike) -> npt.NDArray[np.int64]:
        """Time inside the intervals before instant(s) t."""
        at = np.asarray(t, dtype=np.int64)
        if not len(self.starts):
            return np.zeros_like(at)
        i = np.searchsorted(self.starts, at, side="right") - 1
        j = np.maximum(i, 0)
        inside = self.cum[j] - np.maximum(self.ends[j] - at, 0)
        return np.where(i < 0, 0, inside)

    def within(self, a: int, b: int) -> int:
        return int(self.before(b) - self.before(a)) if b > a else 0

    def spans(self) -> list[tuple[int, int]]:
        return [(int(a), int(b)) for a, b in zip(self.starts, self.ends)]

    def minus(self, other: Intervals) -> Intervals:
        """These intervals with ``other``'s taken out."""
        return Intervals(minus(self.spans(), other.spans()))


@dataclass
class Pauses:
    """One process's pauses: GC, and event-loop lag (what GC does not already explain); and,
    recorded for the API process only, its busy stretches (not pauses: it ran, on CPU the
    core's steps may have wanted)."""

    gc: Intervals
    lag: Intervals
    busy: Intervals = field(default_factory=lambda: Intervals([]))

    def within(self, a: int, b: int) -> int:
        return self.gc.within(a, b)

    def carve(self, parts: dict[str, int], a: int, b: int) -> int:
        """[a, b]'s length less the pauses inside it, which are added to parts gc / loop_lag."""
        g = self.gc.within(a, b)
        lag = min(self.lag.within(a, b), max(b - a - g, 0))
        parts["gc"] += g
        parts["loop_lag"] += lag
        return max(b - a, 0) - g - lag


def no_pauses() -> Pauses:
    return Pauses(Intervals([]), Intervals([]))


def pauses_of(rows: list[PauseRow]) -> tuple[Pauses, Pauses]:
    """The (api, core) pauses of a run's rows (the core's loop lag is not recorded)."""

    def of(process: str, kind: str) -> Intervals:
        return Intervals(
            [(r.start_ns, r.start_ns + r.duration_ns) for r in rows
             if r.process == process and r.kind == kind]
        )  # fmt: skip

    api_gc = [(r.start_ns, r.start_ns + r.duration_ns) for r in rows
              if r.process == "api" and r.kind == "gc"]  # fmt: skip
    gc = Intervals(api_gc)
    lags: list[tuple[int, int]] = []
    gc_lags: list[tuple[int, int]] = []
    for r in rows:
        if r.process == "api" and r.kind == "loop_lag":
            span = (r.start_ns, r.start_ns + r.duration_ns)
            # A lag that GC pauses fill at least half of is theirs: the loop's moments between
            # back-to-back collections (a storm) are the same storm.
            theirs = gc.within(*span) >= GC_LAG_SHARE * r.duration_ns
            (gc_lags if theirs else lags).append(span)
    # Else the lag is what GC does not already explain: its time outside the collections.
    api = Pauses(Intervals(api_gc + gc_lags), Intervals(minus(lags, sorted(api_gc))),
                 of("api", "cpu"))  # fmt: skip
    return api, Pauses(of("core", "gc"), Intervals([]))


def minus(spans: list[tuple[int, int]], cuts: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The spans less the cuts (sorted by start)."""
    out = []
    for a, b in spans:
        for x, y in cuts:
            if x >= b:
                break
            if y <= a:
                continue
            if x > a:
                out.append((a, x))
            a = max(a, y)
        if b > a:
            out.append((a, b))
    return out


GC_LAG_SHARE = 0.5  # an event-loop lag this much GC is GC's
