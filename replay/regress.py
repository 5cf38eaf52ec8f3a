"""`replay regress`: the latency regression gate CI runs, on a committed Mooncake excerpt.

Two layers:
1. deterministic (`--virtual`): the schedule itself on a simulated clock with the committed
   step-cost model; any difference from the baseline fails, with a readable diff;
2. measured: a real replay through the real engine at modest load, with figures normalised
   within the run (non-model time per step over model time per step, each frontend/IPC
   boundary over the step's model time); each must stay within the baseline's tolerance,
   derived from the spread of the runs that made the baseline.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

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
IMPORT = {"scale_lengths": 0.02, "max_prompt_len": 256, "spread": 3.0, "block_size": 16}
VIRTUAL = EngineConfig(num_kv_blocks=64, block_size=16, max_num_batched_tokens=256,
                       max_num_seqs=32, max_model_len=2048)  # fmt: skip
# The virtual layer replays 10x faster than recorded, so queues form and policy matters.
VIRTUAL_SPEED = 10.0
MEASURED = {"limit": 32, "speed": 2.0}
BASELINE_RUNS = 3
BOUNDARIES = ("frontend.enqueue", "core.receive", "core.output", "frontend.emit")


def import_excerpt(folder: Path, out: Path) -> Path:
    records, start = read_trace(folder / EXCERPT, "mooncake")
    kept = transform(records, **IMPORT)
    write_trace_db(kept, start, out, source={"format": "mooncake", "file": EXCERPT, **IMPORT})
    return out


def virtual_layer(db: Path, cost: StepCostModel) -> dict[str, Any]:
    _, work = load_workload(str(db), vocab=np.arange(1, 32000))
    return run_virtual(work, VIRTUAL, cost, speed=VIRTUAL_SPEED).to_json()


def measured_layer(
    db: Path, model: str | None, workdir: Path, settings: dict[str, Any]
) -> tuple[dict[str, float], Path]:
    """Normalised figures of one real replay, and its trace db."""
    out = workdir / f"measured-{len(list(workdir.glob('measured-*')))}.db"
    config = EngineConfig(model=model, core_process=True, num_kv_blocks=512)
    result = asyncio.run(run_replay(str(db), str(out), config, progress=False, **settings))
    if result.num_failed:
        raise RuntimeError(f"{result.num_failed} requests failed in the measured replay")
    with open_db(out, timeout=10) as con:
        steps = con.execute(
            "SELECT output_ns - schedule_start_ns, execute_end_ns - execute_start_ns FROM steps"
        ).fetchall()
        spans = con.execute(
            "SELECT name, median(end_ns - start_ns) FROM spans GROUP BY name"
        ).fetchall()
    execute = statistics.median(e for _, e in steps)
    figures = {"step_overhead_over_execute": statistics.median(t - e for t, e in steps) / execute}
    medians = dict(spans)
    for name in BOUNDARIES:
        figures[f"{name}_over_execute"] = medians.get(name, 0) / execute
    return figures, out


def update_baseline(
    folder: Path, model: str | None, settings: dict[str, Any] = MEASURED
) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        db = import_excerpt(folder, work / "excerpt.db")
        runs = []
        for _ in range(BASELINE_RUNS):
            figures, trace = measured_layer(db, model, work, settings)
            runs.append(figures)
            if len(runs) == 1:
                StepCostModel.calibrate(trace).save(folder / "cost.json")
        cost = StepCostModel.load(folder / "cost.json")
        virtual = virtual_layer(db, cost)
    measured = {}
    for name in runs[0]:
        values = [r[name] for r in runs]
        mean = statistics.mean(values)
        # Noise measured here, widened: a loaded CI machine is noisier than three runs show
        # (core.receive, which includes waiting for the step in flight, moved by 47% between
        # two clean runs).
        tolerance = max(3 * (max(values) - min(values)), mean, 0.05)
        measured[name] = {"value": mean, "tolerance": tolerance, "runs": values}
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
            figures, _ = measured_layer(db, model, work, baseline["measured_settings"])
            lines.append("measured layer (normalised in-run):")
            lines.append(f"  {'metric':<40}{'baseline':>10}{'now':>10}{'tolerance':>11}")
            for name, base in baseline["measured"].items():
                new = figures[name]
                bad = new > base["value"] + base["tolerance"]
                verdict = "REGRESSED" if bad else "ok"
                lines.append(f"  {name:<40}{base['value']:>10.3f}{new:>10.3f}"
                             f"{base['tolerance']:>11.3f}  {verdict}")  # fmt: skip
                if bad:
                    failures.append(
                        f"{name}: baseline {base['value']:.3f}, now {new:.3f}, tolerance "
                        f"{base['tolerance']:.3f}"
                    )
    if failures:
        lines += ["", "REGRESSION:", *(f"  {f}" for f in failures)]
    else:
        lines += ["", "no regression"]
    return not failures, "\n".join(lines)


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
