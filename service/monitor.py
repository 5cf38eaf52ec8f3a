"""The API process's own stalls: event-loop lag (a sampler) and garbage-collection pauses;
and its busy stretches, when it takes CPU the engine core's steps may have wanted.

Every request on this process shares one event loop: while it is blocked (a
long chat template, a GC pause, CPU starvation) no request is read, parsed or
written. A timer asks to wake every ``SAMPLE_S``; how late it wakes is the
loop's lag. Every sample feeds ``lumen:event_loop_lag_seconds``; lags of at
least ``LAG_ROW_MIN_S`` and GC pauses of at least 1 ms become rows of the
trace store's ``pauses`` table, which the diagnosis lays over requests.

Each sample also reads the process's CPU time (all its threads). Samples that
used at least ``BUSY_SHARE`` of a core join into a busy stretch; a stretch of
at least ``BUSY_ROW_MIN_S`` becomes a ``cpu`` row with the CPU time it used.
On a machine whose cores the core's threads fill, that CPU was the steps'
(the diagnosis's ``api_cpu`` part).
"""

from __future__ import annotations

import asyncio
import time

from engine.gc_pauses import GcPauses
from service.metrics import ServerMetrics
from tracing.events import Pause
from tracing.recorder import Tracer

SAMPLE_S = 0.01
LAG_ROW_MIN_S = 0.005
BUSY_SHARE = 0.5  # of one core, over a sample
BUSY_ROW_MIN_S = 0.02


class BusyStretches:
    """Joins samples of (wall, CPU) time into busy stretches: (start, duration, cpu) in ns."""

    def __init__(self) -> None:
        self.start = self.last = time.time_ns()
        self.cpu_last = time.process_time_ns()
        self.cpu = 0
        self.busy = False

    def sample(self) -> tuple[int, int, int] | None:
        """Read the clocks: the stretch that just ended, if it was long enough."""
        now, cpu = time.time_ns(), time.process_time_ns()
        wall, used = now - self.last, cpu - self.cpu_last
        ended = None
        if used >= BUSY_SHARE * wall:
            if not self.busy:
                self.busy, self.start, self.cpu = True, self.last, 0
            self.cpu += used
        elif self.busy:
            self.busy = False
            if self.last - self.start >= BUSY_ROW_MIN_S * 1e9:
                ended = (self.start, self.last - self.start, self.cpu)
        self.last, self.cpu_last = now, cpu
        return ended


async def watch_api_process(metrics: ServerMetrics, tracer: Tracer | None) -> None:
    """Run until cancelled."""
    gc_pauses = GcPauses()
    busy = BusyStretches()
    loop = asyncio.get_running_loop()
    try:
        while True:
            due = loop.time() + SAMPLE_S
            await asyncio.sleep(SAMPLE_S)
            lag = max(0.0, loop.time() - due)
            metrics.loop_lag.observe(lag)
            if (stretch := busy.sample()) is not None and tracer is not None:
                start, duration, cpu = stretch
                tracer.pause(Pause("api", "cpu", start, duration, cpu_ns=cpu))
            if lag >= LAG_ROW_MIN_S and tracer is not None:
                now = time.time_ns()
                tracer.pause(Pause("api", "loop_lag", now - int(lag * 1e9), int(lag * 1e9)))
            if gc_pauses.pauses:
                pauses, _ = gc_pauses.take()
                for start, duration, gen in pauses:
                    metrics.gc_pause_api.observe(duration / 1e9)
                    if tracer is not None:
                        tracer.pause(Pause("api", "gc", start, duration, f"gen{gen}"))
    finally:
        gc_pauses.close()
