"""How many CPU threads the model's ops use, chosen by measurement where the engine owns
the process.

torch runs its ops on an OpenMP team as wide as the machine. For a model whose steps are
large (SmolLM2 on 2 cores: a 16-row step takes 50 ms on one thread, 32 ms on two) the team
pays. For a small one it does not, even where it makes the step itself faster: the step
is then shorter than the Python around it (the scheduler's and the frontend's, about
200 us per token, so 3 ms for 16 rows), and after each op the team's other threads spin
on the cores that Python needs. Measured serving a 2-layer, hidden-64 model (a 16-row step
of 1.2 ms on one thread, 0.9 ms on two) to 64 streams on 2 cores: the core's second thread
burned as much CPU as its main thread, and one thread served 1.3-1.5x the tokens per
second at 0.55x the CPU per token.

So where the engine owns its process (the EngineCore process, a tensor-parallel worker),
it times a 16-row step on the full team and on one thread before READY, and keeps the
team only where the step on one thread takes at least ``MIN_STEP_S`` and the team makes
it at least ``GAIN`` times faster; the decision is cached per machine and model (autotune).
``LUMEN_CPU_THREADS`` (a number) or ``OMP_NUM_THREADS`` set by the user decide instead.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import torch

from engine import envs
from engine.worker import autotune

GAIN = 1.25  # the speed-up a wider team must buy to keep its threads
MIN_STEP_S = 0.005  # a one-thread step shorter than this is outweighed by the Python around it
ROWS = 16  # a decode batch's size: the steady state of a busy server
ROUNDS = 5


def forced() -> int | None:
    """The thread count LUMEN_CPU_THREADS sets, or None for auto."""
    value = envs.LUMEN_CPU_THREADS.get().strip() or "auto"
    if value == "auto":
        return None
    try:
        threads = int(value)
    except ValueError:
        threads = 0
    if threads < 1:
        raise ValueError(f"LUMEN_CPU_THREADS must be auto or a whole number >= 1, not {value!r}")
    return threads


def choose(
    step: Callable[[], object], owns_process: bool, shape: Mapping[str, Any] | None = None
) -> str | None:
    """Set torch's thread count for this process; returns why, for the log (None: left
    as it was). ``step`` runs one forward of ``ROWS`` rows of the model ``shape`` describes
    (the decision is cached for it, autotune). Only LUMEN_CPU_THREADS changes a process the
    engine does not own (an offline ``LLM`` in the user's own process)."""
    threads = forced()
    if threads is not None:
        torch.set_num_threads(threads)
        return f"{threads} (set by LUMEN_CPU_THREADS)"
    if not owns_process:
        return None
    team = torch.get_num_threads()
    if "OMP_NUM_THREADS" in os.environ:
        return f"{team} (set by OMP_NUM_THREADS)"
    if team == 1:
        return "1 (the machine's share)"
    decision = autotune.decide("threads", shape or {}, lambda: _time(step, team))
    torch.set_num_threads(decision.choice)
    return f"{decision.choice} ({decision.why})"


def _time(step: Callable[[], object], team: int) -> tuple[int, str]:
    best = autotune.best_of_each({team: step, 1: step}, ROUNDS, before=torch.set_num_threads)
    gain = best[1] / best[team]
    keep = team if gain >= GAIN and best[1] >= MIN_STEP_S else 1
    return keep, (
        f"a {ROWS}-row step: {best[team] * 1e3:.2f} ms on {team} threads, "
        f"{best[1] * 1e3:.2f} ms on 1; a wider team is kept where the step takes "
        f"{MIN_STEP_S * 1e3:.0f} ms or more on one thread and the team makes it {GAIN}x faster"
    )
