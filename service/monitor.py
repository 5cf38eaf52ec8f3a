"""The API process's own stalls: event-loop lag (a sampler) and garbage-collection pauses.

Every request on this process shares one event loop: while it is blocked (a
long chat template, a GC pause, CPU starvation) no request is read, parsed or
written. A timer asks to wake every ``SAMPLE_S``; how late it wakes is the
loop's lag. Every sample feeds ``lumen:event_loop_lag_seconds``; lags of at
least ``LAG_ROW_MIN_S`` and GC pauses of at least 1 ms become rows of the
trace store's ``pauses`` table, which the diagnosis lays over requests.
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


async def watch_api_process(metrics: ServerMetrics, tracer: Tracer | None) -> None:
    """Run until cancelled."""
    gc_pauses = GcPauses()
    loop = asyncio.get_running_loop()
    try:
        while True:
            due = loop.time() + SAMPLE_S
            await asyncio.sleep(SAMPLE_S)
            lag = max(0.0, loop.time() - due)
            metrics.loop_lag.observe(lag)
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
