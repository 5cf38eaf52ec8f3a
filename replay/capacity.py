"""`replay capacity`: the highest arrival rate at which a recorded mix still meets its latency
targets, for an engine configuration, found on the virtual clock.

The recorded requests keep their lengths, sampling and order; their arrival offsets are divided
by a speed factor. Virtual runs at growing speeds bracket the point where a target is first
missed; bisection narrows it to 1%. With ``check``, the answer is tested for real: a real
replay at the predicted speed should meet the targets, and one at 1.1x should miss them.
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.config import EngineConfig
from replay.cost_model import StepCostModel
from replay.runner import replay_for_real
from replay.validate import latencies_of
from replay.virtual import run_virtual
from replay.workload import ReplayRequest, is_server_recording, load_workload, replay_config

MAX_SPEED = 1024.0
PRECISION = 0.01  # relative width of the final bracket


@dataclass(frozen=True)
class Target:
    """``metric`` (ttft, tpot, itl, e2e) at ``percentile`` (p50, p90, p99) at most ``seconds``."""

    metric: str
    percentile: str
    seconds: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """``ttft:p90:2.0`` (seconds)."""
        try:
            metric, pct, seconds = text.split(":")
            target = cls(metric.lower(), pct.lower(), float(seconds))
        except ValueError:
            raise ValueError(f"a target is METRIC:PERCENTILE:SECONDS, e.g. ttft:p90:2, "
                             f"not {text!r}") from None  # fmt: skip
        if target.metric not in ("ttft", "tpot", "itl", "e2e"):
            raise ValueError(f"target metric must be ttft, tpot, itl or e2e, not {metric!r}")
        if target.percentile not in ("p50", "p90", "p99"):
            raise ValueError(f"target percentile must be p50, p90 or p99, not {pct!r}")
        if target.seconds <= 0:
            raise ValueError("a target's seconds must be positive")
        return target

    def __str__(self) -> str:
        return f"{self.metric.upper()} {self.percentile} <= {self.seconds * 1e3:,.0f} ms"


@dataclass
class Capacity:
    speed: float  # the highest speed that meets every target (0: none does)
    rate: float  # requests per second at that speed
    recorded_rate: float
    measured: dict[float, dict[str, float]] = field(default_factory=dict)  # speed -> figures


def meets(figures: dict[str, float], targets: list[Target]) -> bool:
    return all(figures[f"{t.metric}_{t.percentile}"] <= t.seconds for t in targets)


def figures_of(summary: dict[str, dict[str, float]]) -> dict[str, float]:
    """{"ttft_p90": seconds, ...} of a result's ``to_json`` percentiles."""
    return {
        f"{m}_{p}": summary[f"{m}_s"][p]
        for m in ("ttft", "tpot", "itl", "e2e")
        for p in ("p50", "p90", "p99")
        if summary.get(f"{m}_s")
    }


def find_capacity(
    work: list[ReplayRequest], config: EngineConfig, cost: StepCostModel, targets: list[Target]
) -> Capacity:
    if not targets:
        raise ValueError("give at least one target (--target ttft:p90:2)")
    if len(work) < 2:
        raise ValueError("capacity needs a mix of at least 2 requests")
    span = work[-1].offset_s - work[0].offset_s
    recorded_rate = (len(work) - 1) / span if span > 0 else float("inf")
    result = Capacity(0.0, 0.0, recorded_rate)

    def ok(speed: float) -> bool:
        figures = figures_of(run_virtual(work, config, cost, speed=speed).to_json())
        result.measured[speed] = figures
        return meets(figures, targets)

    lo, hi = 0.0, 1.0
    while ok(hi):  # grow until a target is missed
        lo, hi = hi, hi * 2
        if hi > MAX_SPEED:
            raise ValueError(f"every target is still met at {MAX_SPEED:.0f}x the recorded rate: "
                             "the mix is too light to load this engine")  # fmt: skip
    while lo == 0.0:  # missed at the recorded rate: halve until a rate meets the targets
        if hi < 1.0 / MAX_SPEED:
            return result  # not even a trickle: one request alone misses a target
        lo, hi = (hi / 2, hi) if ok(hi / 2) else (0.0, hi / 2)
    while (hi - lo) / hi > PRECISION:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    result.speed = lo
    result.rate = recorded_rate * lo
    return result


def capacity_report(
    db: str,
    target_texts: list[str],
    *,
    run_id: str | None = None,
    limit: int | None = None,
    window: tuple[float, float] = (0.0, float("inf")),
    cost_model: str | None = None,
    given: dict[str, Any] | None = None,
    check: bool = False,
) -> tuple[str, bool]:
    """`replay capacity`'s text, and whether some rate met the targets (and, with ``check``,
    whether the real replays agreed: met at the answer, missed at 1.1x it)."""
    targets = [Target.parse(t) for t in target_texts]
    cost = (StepCostModel.load(cost_model) if cost_model
            else StepCostModel.calibrate(db, run_id=run_id))  # fmt: skip
    run_id, work = load_workload(db, vocab=np.arange(1, 32000), run_id=run_id, limit=limit,
                                 window=window)  # fmt: skip
    config, used = replay_config(db, run_id, given or {})
    lines = [used, f"step cost: {cost.describe()}", cost.describe_fit()]
    virtual = dataclasses.replace(config, num_kv_blocks=config.num_kv_blocks or 4096,
                                  max_model_len=config.max_model_len or 8192)  # fmt: skip
    cap = find_capacity(work, virtual, cost, targets)
    wanted = ", ".join(str(t) for t in targets)
    if cap.speed == 0:
        return "\n".join(
            [*lines, f"no arrival rate meets {wanted}: one request alone misses"]
        ), False
    lines.append(f"{len(work)} requests, recorded at {cap.recorded_rate:.2f} req/s. The highest "
                 f"rate that meets {wanted}: {cap.rate:.2f} req/s ({cap.speed:.3f}x the "
                 "recorded rate)")  # fmt: skip
    above = min((s for s in cap.measured if s > cap.speed), default=None)
    for speed in (cap.speed, above):
        if speed is not None:
            lines.append(f"  virtual at {speed:.3f}x: {_shown(cap.measured[speed], targets)}")
    agreed = True
    if check:
        served = is_server_recording(db, run_id)
        for speed, want in ((cap.speed, True), (cap.speed * 1.1, False)):
            with tempfile.TemporaryDirectory(prefix="lumen-capacity-") as tmp:
                out = str(Path(tmp) / "real.db")
                result = replay_for_real(
                    db, out, dataclasses.replace(config, core_process=True), served=served,
                    speed=speed, limit=limit, run_id=run_id, window=window, progress=False,
                )  # fmt: skip
                lat = latencies_of(out, result.run_id) or {}
            figures = {f"{m}_{p}": v for m, row in lat.items() for p, v in row.items()}
            met = meets(figures, targets)
            agreed &= met == want
            lines.append(f"  real at {speed:.3f}x: {'meets' if met else 'misses'} "
                         f"({_shown(figures, targets)})")  # fmt: skip
        lines.append("the real replays " + ("agree" if agreed else "DISAGREE") +
                     ": met at the answer, missed at 1.1x it")  # fmt: skip
    return "\n".join(lines), agreed


def _shown(figures: dict[str, float], targets: list[Target]) -> str:
    return ", ".join(
        f"{t.metric.upper()} {t.percentile} {figures[f'{t.metric}_{t.percentile}'] * 1e3:,.0f} ms"
        for t in targets
    )
