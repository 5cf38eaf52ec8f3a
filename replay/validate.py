"""`replay validate`: does replay reproduce the recording, and does the virtual run reproduce
the real one?

1. The run is replayed for real, ``real_runs`` times (through a `lumen serve` started for it
   when the recording came from one), each with the recorded engine configuration.
2. The step-cost model, fitted on half of the steps those replays measured (every other one),
   predicts the other half: R² and relative errors on steps it never saw.
3. It is replayed virtually, with the cost model fitted on all the real replays' steps: the
   machine as the replays found it. (Fitted on the recording's steps, taken at another time,
   it reproduced the recording instead: on an overloaded recording whose TPOT p50 was 15%
   above its replays', the virtual TTFT p50 came out 69% above theirs.)
4. TTFT, TPOT, ITL and end-to-end at p50 / p90 / p99: virtual against the median of the real
   replays, and real against the recording, each as a relative error, beside the spread of
   the real replays among themselves (the noise a replay cannot beat).

The virtual run is judged on TTFT, TPOT and end-to-end; its ITL is shown, not judged. The cost
model prices a step shape at one figure, but one shape's real steps vary within a run (the
note gives their p90 over p50: 1.18-1.22 in three SmolLM2 recordings on 2 cores). A token gap is
one step, so that spread is in ITL's p90 (the real one was 18-21% above the virtual one in two
of those three); TPOT is a mean over a request's steps, and the spread averages out of it.

An imported public trace has no recorded latencies: the real-vs-recorded column is left empty.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from replay.cost_model import StepCostModel, step_features
from replay.report import load_times, percentiles
from replay.runner import replay_for_real
from replay.virtual import VirtualResult, run_virtual
from replay.workload import (
    is_server_recording,
    load_workload,
    recorded_config,
    replay_config,
)
from tracing.store import latest_run, open_db

METRICS = ("ttft", "tpot", "itl", "e2e")
JUDGED = ("ttft", "tpot", "e2e")  # the virtual run's verdict (ITL: the module docstring)
PERCENTILES = ("p50", "p90", "p99")
# Targets (issue [fidelity]): virtual within 5% of real at p50 / p90 and 10% at p99, or within
# the real replays' own spread if that is wider; real within 10% of the recording at p50 / p90.
VIRTUAL_TARGET = {"p50": 0.05, "p90": 0.05, "p99": 0.10}
REAL_TARGET = {"p50": 0.10, "p90": 0.10}

Latencies = dict[str, dict[str, float]]  # metric -> percentile -> seconds


@dataclass
class Validation:
    config_line: str
    served: bool
    held_out: dict[str, Any]  # the half-fitted cost model's quality on the other half
    cost: StepCostModel
    recorded: Latencies | None
    real: list[Latencies]
    virtual: Latencies
    steps_from: str
    notes: list[str] = field(default_factory=list)
    same_shape_spread: float | None = None  # the real decode steps' p90 / p50 within a shape

    def real_median(self) -> Latencies:
        return {
            m: {p: statistics.median(r[m][p] for r in self.real) for p in PERCENTILES}
            for m in METRICS
            if all(m in r for r in self.real)
        }

    def real_spread(self) -> Latencies:
        """(max - min) / median over the real replays, per cell."""
        med = self.real_median()
        return {
            m: {p: (max(r[m][p] for r in self.real) - min(r[m][p] for r in self.real))
                / med[m][p] if med[m][p] else 0.0 for p in PERCENTILES}
            for m in med
        }  # fmt: skip

    def errors(self) -> dict[str, dict[str, dict[str, float | None]]]:
        """{"virtual_vs_real" | "real_vs_recorded": metric -> percentile -> relative error}."""
        real = self.real_median()

        def rel(a: Latencies | None, b: Latencies) -> dict[str, dict[str, float | None]]:
            return {
                m: {p: (a[m][p] - b[m][p]) / b[m][p] if a and m in a and b[m][p] else None
                    for p in PERCENTILES}
                for m in b
            }  # fmt: skip

        out = {"virtual_vs_real": rel(self.virtual, real)}
        if self.recorded:
            out["real_vs_recorded"] = rel(real, self.recorded)
        return out

    def verdicts(self) -> dict[str, bool]:
        """Whether each comparison met its target (the spread widens the virtual one)."""
        errs, spread = self.errors(), self.real_spread()
        ok = {"virtual_vs_real": True}
        for m, row in errs["virtual_vs_real"].items():
            if m not in JUDGED:
                continue
            for p, e in row.items():
                if e is not None and abs(e) > max(VIRTUAL_TARGET[p], spread[m][p]):
                    ok["virtual_vs_real"] = False
        if "real_vs_recorded" in errs:
            ok["real_vs_recorded"] = all(
                abs(e) <= REAL_TARGET[p]
                for row in errs["real_vs_recorded"].values()
                for p, e in row.items()
                if p in REAL_TARGET and e is not None
            )
        return ok

    def to_json(self) -> dict[str, Any]:
        return {
            "served": self.served, "held_out_fit": self.held_out,
            "cost_model": dataclasses.asdict(self.cost),
            "recorded": self.recorded, "real": self.real, "real_median": self.real_median(),
            "real_spread": self.real_spread(), "virtual": self.virtual, "errors": self.errors(),
            "verdicts": self.verdicts(), "judged": list(JUDGED), "steps_from": self.steps_from,
            "same_shape_spread": self.same_shape_spread,
        }  # fmt: skip


def latencies_of(db: str, run_id: str | None = None) -> Latencies | None:
    """Percentiles of a measured run's served requests (None when it has no latencies)."""
    try:
        _, times = load_times(db, run_id)
    except ValueError:
        return None
    if not times:
        return None
    values = {
        "ttft": [t.ttft_ns / 1e9 for t in times],
        "tpot": [t.tpot_ns / 1e9 for t in times if t.tpot_ns is not None],
        "itl": [g / 1e9 for t in times for g in t.itls_ns],
        "e2e": [t.e2e_ns / 1e9 for t in times],
    }
    return {m: _cut(percentiles(v)) for m, v in values.items() if v}


def virtual_latencies(result: VirtualResult) -> Latencies:
    values = {"ttft": result.ttft_s, "tpot": result.tpot_s, "itl": result.itl_s,
              "e2e": result.e2e_s}  # fmt: skip
    return {m: _cut(percentiles(v)) for m, v in values.items() if v}


def validate(
    db: str,
    workdir: Path,
    *,
    run_id: str | None = None,
    real_runs: int = 3,
    given: dict[str, Any] | None = None,
    speed: float = 1.0,
    limit: int | None = None,
    window: tuple[float, float] = (0.0, float("inf")),
    in_process: bool = False,
) -> Validation:
    if real_runs < 1:
        raise ValueError("--real-runs must be at least 1")
    with open_db(db, timeout=10) as con:
        run_id = run_id or latest_run(con)
    config, line = replay_config(db, run_id, given or {}, core_process=True)
    served = is_server_recording(db, run_id) and not in_process
    options = dict(speed=speed, limit=limit, run_id=run_id, window=window, progress=False)
    real, outs = [], []
    for k in range(real_runs):
        out = str(workdir / f"real-{k}.db")
        result = replay_for_real(db, out, config, served=served, **options)
        if result.num_failed:
            raise RuntimeError(f"{result.num_failed} requests failed in real replay {k + 1}")
        outs.append((out, result.run_id))
        lat = latencies_of(out, result.run_id)
        if lat is None:
            raise RuntimeError(f"real replay {k + 1} served no request")
        real.append(lat)
    # The steps to fit: the real replays' own, which ran on the machine as the replays found
    # it. The recording's steps can be a few percent slower or faster (another time, another
    # load), and near saturation a few percent of step time moves a queue's tail by tens of
    # percent: fitted on the recording, the virtual run reproduced the recording instead.
    feats = [step_features(*o) for o in outs]
    x, y = np.concatenate([f[0] for f in feats]), np.concatenate([f[1] for f in feats])
    steps_from = f"the {len(outs)} real replays"
    if len(y) < 16:
        x, y = step_features(db, run_id)
        steps_from = "the recording (the real replays measured too few steps)"
    half = StepCostModel.fit_steps(x[::2], y[::2])
    held_out = half.quality(x[1::2], y[1::2])
    cost = StepCostModel.fit_steps(x, y)
    # The virtual core needs the KV blocks and context length: the real replay's, if the
    # recording (an import) did not say.
    measured = recorded_config(*outs[0])
    virtual_config = dataclasses.replace(
        config,
        num_kv_blocks=config.num_kv_blocks or measured.get("num_kv_blocks"),
        max_model_len=config.max_model_len or measured.get("max_model_len"),
    )
    _, work = load_workload(db, vocab=np.arange(1, 32000), run_id=run_id, limit=limit,
                            window=window)  # fmt: skip
    virtual = virtual_latencies(run_virtual(work, virtual_config, cost, speed=speed))
    recorded = latencies_of(db, run_id) if speed == 1.0 and not limit else None
    notes = _busy_machine(db, run_id, outs)
    if recorded is None:
        notes.append("no recorded latencies to compare with (an imported trace, or --speed / "
                     "--limit changed the load)")  # fmt: skip
    spread = _same_shape_spread(outs)
    if spread is not None and "itl" in virtual:
        notes.append(
            f"ITL is shown, not judged: in the real replays a decode step's p90 is {spread:.2f}x "
            "its p50 for the same number of rows, and the cost model prices a shape at one "
            "figure. A token gap is one step (ITL's p90 carries that spread); TPOT averages it."
        )
    return Validation(
        line, served, held_out, cost, recorded, real, virtual, steps_from, notes, spread
    )


def _same_shape_spread(outs: list[tuple[str, str]]) -> float | None:
    """p90 / p50 of the real replays' decode-only steps of one row count, the median over
    the shapes with 20 steps or more (None where none has)."""
    ratios = []
    for path, run in outs:
        with open_db(path, timeout=10) as con:
            rows = con.execute(
                "SELECT quantile_cont(ms, 0.9) / median(ms) FROM (SELECT num_decode_tokens AS n, "
                "(execute_end_ns - execute_start_ns) / 1e6 AS ms FROM steps WHERE run_id = ? "
                "AND num_prefill_tokens = 0 AND num_decode_tokens > 0 "
                "AND NOT coalesce(idle, false)) GROUP BY n HAVING count(*) >= 20",
                [run],
            ).fetchall()
        ratios += [r for (r,) in rows if r]
    return statistics.median(ratios) if ratios else None


def _busy_machine(db: str, run_id: str, outs: list[tuple[str, str]]) -> list[str]:
    """A note for each run whose median model step differs by over 30% from the others':
    the same steps on a machine that was busier (or quieter) then."""
    medians = {}
    runs = [("the recording", db, run_id)]
    runs += [(f"real replay {k + 1}", path, run) for k, (path, run) in enumerate(outs)]
    for name, path, run in runs:
        with open_db(path, timeout=10) as con:
            [(ms,)] = con.execute(
                "SELECT median(execute_end_ns - execute_start_ns) / 1e6 FROM steps "
                "WHERE run_id = ? AND num_prefill_tokens = 0 AND NOT coalesce(idle, false)",
                [run],
            ).fetchall()
        if ms:
            medians[name] = ms
    if len(medians) < 2:
        return []
    typical = statistics.median(medians.values())
    return [
        f"{name}'s median decode step took {ms:.1f} ms against {typical:.1f} ms in the others: "
        "the machine was not the same then (another load?), so its latencies are not comparable"
        for name, ms in medians.items()
        if not 1 / 1.3 <= ms / typical <= 1.3
    ]


def render(v: Validation) -> str:
    h = v.held_out
    how = "through a `lumen serve` started for each, over HTTP" if v.served else "in-process"
    lines = [
        v.config_line,
        f"real replays: {len(v.real)}, {how}",
        f"step-cost model, fitted on every other step of {v.steps_from} and tested on the "
        f"rest: R² {h['r2']:.3f}, |error| p50 {h['err_p50']:.1%}, p90 {h['err_p90']:.1%}, "
        f"p99 {h['err_p99']:.1%} ({h['num_steps']} held-out steps)",
        f"virtual replay with the model fitted on all of them: {v.cost.describe()}",
        "",
        f"{'':<10}{'recorded':>10}{'real':>10}{'spread':>8}{'virtual':>10}"
        f"{'virt/real':>11}{'real/rec':>10}",
    ]
    real, spread, errs = v.real_median(), v.real_spread(), v.errors()
    for m in METRICS:
        for p in PERCENTILES:
            if m not in real:
                continue
            rec = v.recorded[m][p] * 1e3 if v.recorded and m in v.recorded else None
            virt = v.virtual.get(m, {}).get(p)
            e_v = errs["virtual_vs_real"][m][p]
            e_r = errs.get("real_vs_recorded", {}).get(m, {}).get(p)
            lines.append(
                f"{(m.upper() + ' ' + p):<10}{_ms(rec):>10}{_ms(real[m][p] * 1e3):>10}"
                f"{spread[m][p]:>8.1%}{_ms(virt * 1e3 if virt is not None else None):>10}"
                f"{_pct(e_v):>11}{_pct(e_r):>10}{'' if m in JUDGED else '  (virtual not judged)'}"
            )
    verdicts = v.verdicts()
    lines += [
        "",
        "targets: virtual vs real within 5% at p50 and p90 and 10% at p99 (or the real "
        "replays' spread, if wider), for TTFT, TPOT and E2E (ITL is shown, not judged); real "
        "vs recorded within 10% at p50 and p90",
    ]
    for name, ok in verdicts.items():
        lines.append(f"  {name.replace('_', ' ')}: {'met' if ok else 'MISSED'}")
    lines += [f"note: {n}" for n in v.notes]
    return "\n".join(lines)


def _cut(p: dict[str, float]) -> dict[str, float]:
    return {k: p[k] for k in PERCENTILES}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"
