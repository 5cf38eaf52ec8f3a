"""`replay regress`: the latency regression gate CI runs, on a committed Mooncake excerpt.

Two layers:
1. deterministic (`--virtual`): the schedule itself on a simulated clock with the committed
   step-cost model; any difference from the baseline fails, with a readable diff;
2. measured: a real replay through the real engine at modest load. Each figure is a median
   over the run's steps (or its emits), in shares of the run's median model step: the
   scheduler, the core's output path, all of a step outside the model, the frontend's enqueue
   and emit. A figure fails only when it is more than its tolerance (at least
   MIN_TOLERANCE of a step and MIN_TOLERANCE_MS) above the baseline in the first run AND in
   the median of CONFIRM_RUNS more runs: one noisy run on a loaded machine is re-measured,
   not reported. The runs of one measurement (the baseline's, or a check's and its
   confirmations) share one engine, each recorded into a trace db of its own.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from replay.formats import read_trace, transform
from replay.importer import write_trace_db
from replay.runner import run_replay
from replay.virtual import StepCostModel, run_virtual
from replay.workload import load_workload
from tracing.store import open_db

DEFAULT_DIR = Path("regress")
EXCERPT = "mooncake-excerpt.jsonl"
# How the gate scales the excerpt and what it simulates; part of the baseline's meaning.
IMPORT: dict[str, Any] = {
    "scale_lengths": 0.02, "max_prompt_len": 256, "spread": 3.0, "block_size": 16,
}  # fmt: skip
VIRTUAL = EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256,
                       max_num_seqs=32, max_model_len=2048)  # fmt: skip
# The virtual layer replays 10x faster than recorded, so queues form and policy matters.
VIRTUAL_SPEED = 10.0
MEASURED = {"limit": 32, "speed": 2.0}
BASELINE_RUNS = 3
# What is gated, each a median in shares of the median model step.
GATED = ("schedule_over_execute", "core.output_over_execute", "step_overhead_over_execute",
         "frontend.enqueue_over_execute", "frontend.emit_over_execute")  # fmt: skip
# Shown, never gated: core.receive holds the wait for the step in flight (0.8x-1.9x a step on
# an unchanged tree), so it cannot see a change of a tenth of a step.
REPORTED = ("core.receive_over_execute",)
# The smallest change the gate names: 4% of a model step, under half the 10% it must catch,
# and never under MIN_TOLERANCE_MS: a thread's wake-up and a socket's send jitter by tens of
# microseconds whatever the model, which is most of a tiny model's step (0.3 ms on a fast CPU).
MIN_TOLERANCE = 0.04
MIN_TOLERANCE_MS = 0.1
SPREAD_FACTOR = 4  # or 4x the spread of the baseline's own runs, if that is wider
CONFIRM_RUNS = 2


def import_excerpt(folder: Path, out: Path) -> Path:
    records, start = read_trace(folder / EXCERPT, "mooncake")
    kept = transform(records, **IMPORT)
    write_trace_db(kept, start, out, source={"format": "mooncake", "file": EXCERPT, **IMPORT})
    return out


def virtual_layer(db: Path, cost: StepCostModel) -> dict[str, Any]:
    _, work = load_workload(str(db), vocab=np.arange(1, 32000))
    return run_virtual(work, VIRTUAL, cost, speed=VIRTUAL_SPEED).to_json()


Figures = dict[str, float]


def measured_runs(
    db: Path,
    model: str | None,
    workdir: Path,
    settings: dict[str, Any],
    more: Callable[[list[Figures]], bool],
) -> list[tuple[Figures, Path]]:
    """Real replays of ``db`` while ``more(figures so far)`` asks for another, all through one
    engine (its start, not the replay, is most of a run's time), each into a trace db of its
    own: the normalised figures of each, and its db."""

    async def session() -> list[tuple[Figures, Path]]:
        config = EngineConfig(model=model, core_process=True, num_kv_blocks=512)
        engine = AsyncLLM(config)
        runs: list[tuple[Figures, Path]] = []
        try:
            while more([f for f, _ in runs]):
                out = workdir / f"measured-{len(list(workdir.glob('measured-*')))}.db"
                result = await run_replay(
                    str(db), str(out), config, progress=False, engine=engine, **settings
                )
                if result.num_failed:
                    raise RuntimeError(
                        f"{result.num_failed} requests failed in the measured replay"
                    )
                runs.append((_figures(out), out))
        finally:
            await engine.shutdown()
        return runs

    return asyncio.run(session())


def _figures(out: Path) -> Figures:
    """One replay's medians, in shares of its median model step."""
    with open_db(out, timeout=10) as con:
        steps = con.execute(
            "SELECT output_ns - schedule_start_ns, execute_end_ns - execute_start_ns, "
            "schedule_end_ns - schedule_start_ns FROM steps WHERE NOT coalesce(idle, false)"
        ).fetchall()
        spans = con.execute(
            "SELECT name, median(end_ns - start_ns) FROM spans GROUP BY name"
        ).fetchall()
    execute = statistics.median(s[1] for s in steps)
    figures = {
        "schedule_over_execute": statistics.median(s[2] for s in steps) / execute,
        "step_overhead_over_execute": statistics.median(t - e for t, e, _ in steps) / execute,
        "execute_ms": execute / 1e6,
    }
    medians = dict(spans)
    for name in ("frontend.enqueue", "core.receive", "core.output", "frontend.emit"):
        figures[f"{name}_over_execute"] = medians.get(name, 0) / execute
    return figures


def update_baseline(
    folder: Path, model: str | None, settings: dict[str, Any] = MEASURED
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        db = import_excerpt(folder, work / "excerpt.db")
        replays = measured_runs(db, model, work, settings, lambda r: len(r) < BASELINE_RUNS)
        StepCostModel.calibrate(replays[0][1]).save(folder / "cost.json")
        runs = [figures for figures, _ in replays]
        cost = StepCostModel.load(folder / "cost.json")
        virtual = virtual_layer(db, cost)
    steps_ms = [r["execute_ms"] for r in runs]
    floor = max(MIN_TOLERANCE, MIN_TOLERANCE_MS / statistics.median(steps_ms))
    measured = {}
    for name in (*GATED, *REPORTED):
        values = [r[name] for r in runs]
        spread = max(values) - min(values)
        tolerance = max(SPREAD_FACTOR * spread, floor) if name in GATED else None
        measured[name] = {"value": statistics.median(values), "tolerance": tolerance,
                          "runs": values}  # fmt: skip
    measured["execute_ms"] = {"value": statistics.median(steps_ms), "tolerance": None,
                              "runs": steps_ms}  # fmt: skip
    baseline = {"virtual": virtual, "measured": measured, "import": IMPORT,
                "measured_settings": settings, "model": model}  # fmt: skip
    (folder / "baseline.json").write_text(json.dumps(baseline, indent=2, sort_keys=True) + "\n")
    return baseline


def check(folder: Path, model: str | None, *, measured: bool = True) -> tuple[bool, str]:
    """(passed, the table); each failure names the metric, baseline, new value, tolerance."""
    path = folder / "baseline.json"
    if not path.is_file():
        raise ValueError(f"no baseline at {path}: run `replay regress --update-baseline`")
    baseline = json.loads(path.read_text())
    cost = StepCostModel.load(folder / "cost.json")
    lines, failures = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        db = import_excerpt(folder, work / "excerpt.db")
        virtual = virtual_layer(db, cost)
        lines.append("deterministic layer (--virtual, exact):")
        for key, old, new in _flat_diff(baseline["virtual"], virtual):
            failures.append(f"{key}: baseline {old}, now {new} (tolerance 0: the schedule changed)")
        lines.append(f"  {len(_flatten(virtual))} figures, "
                     f"{len(failures)} different")  # fmt: skip
        if measured:
            lines += _measured(baseline, db, model, work, failures)
    if failures:
        lines += ["", "REGRESSION:", *(f"  {f}" for f in failures)]
    else:
        lines += ["", "no regression"]
    return not failures, "\n".join(lines)


def _measured(
    baseline: dict[str, Any], db: Path, model: str | None, work: Path, failures: list[str]
) -> list[str]:
    """The measured layer's table; a figure over its tolerance is measured CONFIRM_RUNS more
    times and fails only if the median of all its runs is still over."""
    settings = baseline["measured_settings"]
    gated = {k: v for k, v in baseline["measured"].items() if v.get("tolerance") is not None}

    def over(name: str, value: float) -> bool:
        return value > gated[name]["value"] + gated[name]["tolerance"]

    def more(runs: list[Figures]) -> bool:
        if not runs:
            return True
        return len(runs) < 1 + CONFIRM_RUNS and any(over(n, runs[0][n]) for n in gated)

    runs = [figures for figures, _ in measured_runs(db, model, work, settings, more)]
    lines = [
        f"measured layer: medians in shares of the median model step ({len(runs)} "
        f"run{'s' if len(runs) > 1 else ''}; step {runs[0]['execute_ms']:.1f} ms here, "
        f"{baseline['measured'].get('execute_ms', {}).get('value', 0):.1f} ms in the baseline):",
        f"  {'metric':<34}{'baseline':>10}{'now':>10}{'tolerance':>11}",
    ]
    for name, base in baseline["measured"].items():
        if name == "execute_ms" or name not in runs[0]:
            continue
        new = statistics.median(r[name] for r in runs)
        if name not in gated:
            lines.append(f"  {name:<34}{base['value']:>10.3f}{new:>10.3f}{'':>11}  (not gated)")
            continue
        bad = over(name, new)
        lines.append(f"  {name:<34}{base['value']:>10.3f}{new:>10.3f}"
                     f"{base['tolerance']:>11.3f}  {'REGRESSED' if bad else 'ok'}")  # fmt: skip
        if bad:
            failures.append(
                f"{name}: baseline {base['value']:.3f}, now {new:.3f} (median of {len(runs)} "
                f"runs), tolerance {base['tolerance']:.3f}"
            )
    return lines


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _flat_diff(old: dict[str, Any], new: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    a, b = _flatten(old), _flatten(new)
    return [(k, a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
