"""Fault injection for tests: the sleeps LUMEN_DEBUG_DELAY asks for at named sites, and the
garbage-collection pauses LUMEN_DEBUG_GC arms."""

from __future__ import annotations

import gc
import logging
import signal
import time
from collections.abc import Callable
from functools import partial

from engine import envs

logger = logging.getLogger(__name__)

# The sites, each reached once per step (grammar_compile: once per compile).
SITES = ("schedule", "output", "emit", "grammar_compile", "grammar_mask")


def parse(value: str) -> dict[str, float]:
    """``SITE=SECONDS[,SITE=SECONDS]`` as seconds by site; an unknown site is an error."""
    delays: dict[str, float] = {}
    for item in filter(None, value.split(",")):
        name, _, seconds = item.partition("=")
        site = name.strip()
        if site not in SITES:
            raise ValueError(
                f"{envs.LUMEN_DEBUG_DELAY.name}: unknown site {name!r} (one of {', '.join(SITES)})"
            )
        delays.setdefault(site, float(seconds))  # the first mention of a site wins
    return delays


def nothing() -> None:
    """The hook of a site no fault is armed at."""


def hook(site: str) -> Callable[[], None]:
    """What ``site`` calls each time it is reached: the sleep LUMEN_DEBUG_DELAY sets there, else
    ``nothing``. The component that holds the site calls this as it starts, so the environment
    is read then, never on the hot path, and a component built later may see another value."""
    assert site in SITES, site
    seconds = parse(envs.LUMEN_DEBUG_DELAY.get()).get(site)
    return partial(time.sleep, seconds) if seconds else nothing


GC_PROCESSES = ("api", "core")
_GC_SLICE_S = 0.02  # one collection of the graph takes about this long (or the whole pause)
_graph: list[object] = []  # kept alive: every collection walks it


def arm_gc_pause(process: str) -> None:
    """Where LUMEN_DEBUG_GC names ``process``: build an object graph whose collection takes
    about min(SECONDS, 20 ms), and collect it on SIGUSR2, once or several times in a row, for
    SECONDS in all. Called once the process's heap is settled (gc_pauses.settle_heap), so the
    graph is not frozen with it. The pauses are real collections: the process's GC recorder
    times them as any other."""
    spec = envs.LUMEN_DEBUG_GC.get()
    seconds = _parse_gc(spec).get(process) if spec else None
    if not seconds:
        return
    want = min(seconds, _GC_SLICE_S)

    def collect_with(n: int) -> float:
        _graph[:] = [[None] for _ in range(n)]
        start = time.perf_counter()
        gc.collect()
        return time.perf_counter() - start

    n, took = 10_000, collect_with(10_000)
    for _ in range(12):  # the collection's time is near linear in the graph: a few steps
        if abs(took - want) <= 0.15 * want:
            break
        n = max(1_000, min(int(n * min(want / max(took, 1e-6), 4.0)), 20_000_000))
        took = collect_with(n)
    repeats = max(1, round(seconds / max(took, 1e-6)))

    def pause(signum: int, frame: object) -> None:
        for _ in range(repeats):
            gc.collect()

    signal.signal(signal.SIGUSR2, pause)
    logger.warning(
        "LUMEN_DEBUG_GC: SIGUSR2 collects %d objects %d times (%.0f ms each)",
        len(_graph), repeats, took * 1e3,
    )  # fmt: skip


def _parse_gc(value: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for item in filter(None, value.split(",")):
        name, _, seconds = item.partition("=")
        if name.strip() not in GC_PROCESSES:
            raise ValueError(f"{envs.LUMEN_DEBUG_GC.name}: unknown process {name!r} (api or core)")
        out[name.strip()] = float(seconds)
    return out
