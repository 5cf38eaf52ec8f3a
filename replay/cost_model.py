"""The step-cost model of virtual replay: what one engine step costs, from what it holds.

Seconds per step = base
    + prefill tokens x a + decode tokens x b + rows x c
    + context tokens the decode rows read x d (each decode row attends to its whole context)
    + (query, key) pairs of the prefill rows x e (a chunk of n tokens after s cached ones
      attends to n s + n (n + 1) / 2 pairs)
    + decode rows x the longest decode context x f (decode attention runs over the rows' slots
      of the decode mirror, each as wide as the longest: engine/worker/decode_cache.py)
    + context tokens copied into that mirror x g (a row's whole context, the first step it
      decodes: a long prompt's first decode step costs its neighbours that copy).

It is fitted to the measured steps of a trace db, from schedule to output, so the scheduler's
and the output path's time is in it: least squares (so the predicted time of a run's steps
adds up to the measured time), no negative term. The fit keeps its own quality (R², relative
error percentiles), the range it saw (most rows in a step, most prefill tokens, longest
context), so a what-if beyond that range is told it extrapolates, and the spread of measured
over predicted step times: on a shared CPU the same step shape can take 1x or 2x. With
``step_noise`` a virtual run draws each step's factor from that spread (seeded: the same run
gives the same report), weighted by step time so the factors average to 1 over time. It is
off by default: measured on three recordings, i.i.d. noise widened queues more than the real
runs' (time-correlated) noise did, and the plain prediction came closer at every percentile.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engine.worker.messages import SchedulerOutput
from tracing.store import open_db

TERMS = ("base_s", "prefill_token_s", "decode_token_s", "request_s", "context_token_s",
         "prefill_pair_s", "padded_context_s", "fill_token_s")  # fmt: skip
# What each term is priced per, for people.
UNITS = {"base_s": ("ms", 1e3, "per step"), "prefill_token_s": ("us", 1e6, "per prefill token"),
         "decode_token_s": ("us", 1e6, "per decode token"), "request_s": ("us", 1e6, "per row"),
         "context_token_s": ("ns", 1e9, "per context token a decode row reads"),
         "prefill_pair_s": ("ns", 1e9, "per prefill (query, key) pair"),
         "padded_context_s": ("ns", 1e9, "per decode row per token of the longest context"),
         "fill_token_s": ("ns", 1e9, "per context token copied in at a row's first decode"),
         }  # fmt: skip
MIN_STEPS = 8
NUM_RATIOS = 100  # quantiles of measured / predicted kept for the virtual run's noise


@dataclass(frozen=True)
class StepCostModel:
    base_s: float
    prefill_token_s: float
    decode_token_s: float
    request_s: float
    context_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    padded_context_s: float = 0.0
    fill_token_s: float = 0.0
    num_steps: int = 0  # how many measured steps it was fitted on
    # r2, err_p50/p90/p99 (|predicted - measured| / measured), covers: the range it saw.
    fit: dict[str, Any] = field(default_factory=dict)

    @property
    def coef(self) -> np.ndarray:
        return np.array([getattr(self, t) for t in TERMS])

    def cost(self, out: SchedulerOutput) -> float:
        return float(self.coef @ scheduled_features(out))

    def predict(self, features: np.ndarray) -> np.ndarray:
        return features @ self.coef

    @classmethod
    def calibrate(cls, db: str | Path, *, run_id: str | None = None) -> StepCostModel:
        """Fitted to every measured step of ``db`` (or of one run)."""
        x, y = step_features(db, run_id)
        return cls.fit_steps(x, y)

    @classmethod
    def fit_steps(cls, x: np.ndarray, y: np.ndarray) -> StepCostModel:
        if len(y) < MIN_STEPS:
            raise ValueError(
                f"{len(y)} measured steps; calibration needs {MIN_STEPS} or more "
                "(an imported trace has none: replay it for real first)"
            )
        # Every step counts, slow ones too (a pause is part of the run's time): with a fixed
        # term, the predicted time of the steps adds up to their measured time.
        coef = _nnls(x, y)
        terms: dict[str, Any] = dict(zip(TERMS, map(float, coef), strict=True))
        model = cls(**terms, num_steps=len(y))
        fit = model.quality(x, y)
        fit["ratios"] = _time_weighted_ratios(y, model.predict(x))
        return cls(**terms, num_steps=len(y), fit=fit)

    def noise(self, seed: int = 0) -> Callable[[], float] | None:
        """A draw of measured / predicted for one step, seeded (None: no spread recorded)."""
        ratios = self.fit.get("ratios")
        if not ratios:
            return None
        table, rng = np.asarray(ratios), np.random.default_rng(seed)
        return lambda: float(table[rng.integers(len(table))])

    def quality(self, x: np.ndarray, y: np.ndarray) -> dict[str, Any]:
        """R² and relative errors on the steps (x, y), and the range those steps cover."""
        pred = self.predict(x)
        ss_tot = float(((y - y.mean()) ** 2).sum())
        r2 = 1 - float(((y - pred) ** 2).sum()) / ss_tot if ss_tot > 0 else 1.0
        err = np.abs(pred - y) / np.maximum(y, 1e-9)
        p50, p90, p99 = (float(v) for v in np.percentile(err, [50, 90, 99]))
        return {"r2": r2, "err_p50": p50, "err_p90": p90, "err_p99": p99,
                "num_steps": len(y), "covers": _covers(x)}  # fmt: skip

    def describe(self) -> str:
        parts = []
        for t in TERMS:
            unit, scale, what = UNITS[t]
            if getattr(self, t) or t == "base_s":
                parts.append(f"{getattr(self, t) * scale:.3f} {unit} {what}")
        return " + ".join(parts)

    def describe_fit(self) -> str:
        f = self.fit
        if not f:
            return "fit: not recorded (a model file from before fits were saved)"
        c = f["covers"]
        return (
            f"fit on {f['num_steps']} steps: R² {f['r2']:.3f}; |error| p50 {f['err_p50']:.1%}, "
            f"p90 {f['err_p90']:.1%}, p99 {f['err_p99']:.1%}; covers steps of up to "
            f"{c['rows']} rows, {c['prefill_tokens']:,} prefill tokens, {c['decode_tokens']} "
            f"decode rows, decode context {c['context_per_row']:,} tokens"
        )

    def extrapolation(self, seen: dict[str, int]) -> list[str]:
        """What a run (``seen``, as ``_covers`` counts it) held beyond the fitted range."""
        covers = self.fit.get("covers")
        if not covers:
            return []
        words = {"rows": "rows in a step", "prefill_tokens": "prefill tokens in a step",
                 "decode_tokens": "decode rows in a step",
                 "context_per_row": "tokens of context in a decode row"}  # fmt: skip
        return [
            f"{seen[k]:,} {w} (the fit saw at most {covers[k]:,})"
            for k, w in words.items()
            if seen.get(k, 0) > 1.25 * covers[k]
        ]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(asdict(self), indent=2, sort_keys=True) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        try:
            return cls(**json.loads(Path(path).read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path} is not a step-cost model ({e})") from None


class Features:
    """A run's steps as TERMS' features, one step at a time: it keeps which requests decode
    (a row's first decode step copies its context into the decode mirror)."""

    def __init__(self) -> None:
        self.decoding: set[str] = set()

    def of(self, rows: list[tuple[str, int, int]], prefill: int, decode: int) -> np.ndarray:
        """``rows``: (request id, tokens scheduled, tokens computed before) per row."""
        context = pairs = widest = fill = 0
        for rid, n, start in rows:
            if n == 1:
                context += start + 1
                widest = max(widest, start + 1)
                if rid not in self.decoding:
                    self.decoding.add(rid)
                    fill += start
            else:
                pairs += n * start + n * (n + 1) // 2
                self.decoding.discard(rid)  # a (re)computed prompt: its next decode copies in
        return np.array([1.0, prefill, decode, len(rows), context, pairs, decode * widest, fill])

    def forget(self, rid: str) -> None:
        self.decoding.discard(rid)


def scheduled_features(out: SchedulerOutput, features: Features | None = None) -> np.ndarray:
    """The features of one scheduled step (the virtual core's), in TERMS order."""
    computed = out.num_computed_tokens
    rows = [(rid, len(ids), start) for rid, ids, start in zip(out.req_ids, out.token_ids, computed)]
    return (features or Features()).of(rows, out.num_prefill_tokens, out.num_decode_tokens)


def step_features(db: str | Path, run_id: str | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Features (rows in TERMS order) and seconds, schedule to output, of measured steps.

    A row's context is what its request computed in earlier steps of the run (a preempted
    request starts again from zero; a prefix-cache hit is not known per request, so a row
    after one is counted from zero as well).
    """
    with open_db(db, timeout=10) as con:
        where = "AND run_id = $run" if run_id else ""
        steps = con.execute(
            "SELECT run_id, output_ns - schedule_start_ns, num_prefill_tokens, "
            "num_decode_tokens, request_ids, num_scheduled, preempted_request_ids FROM steps "
            f"WHERE num_scheduled_tokens > 0 AND NOT coalesce(idle, false) {where} "
            "ORDER BY run_id, step_id",
            {"run": run_id} if run_id else {},
        ).fetchall()
    x, y = np.zeros((len(steps), len(TERMS))), np.zeros(len(steps))
    computed: dict[tuple[str, str], int] = {}
    features: dict[str, Features] = {}
    for i, (run, seconds_ns, prefill, decode, rids, nums, preempted) in enumerate(steps):
        f = features.setdefault(run, Features())
        for rid in preempted or ():
            computed.pop((run, rid), None)
            f.forget(rid)
        rows = []
        for rid, n in zip(rids or (), nums or ()):
            start = computed.get((run, rid), 0)
            computed[(run, rid)] = start + n
            rows.append((rid, n, start))
        x[i] = f.of(rows, prefill, decode)
        y[i] = seconds_ns / 1e9
    return x, y


def _time_weighted_ratios(measured: np.ndarray, predicted: np.ndarray) -> list[float]:
    """NUM_RATIOS quantiles of measured / predicted, each step weighted by its predicted time
    (a 3 s step's factor counts 50 times a 60 ms one's): drawn per step, they keep a run's
    expected time what the fit predicts."""
    predicted = np.maximum(predicted, 1e-9)
    ratios = np.clip(measured / predicted, 0.2, 5.0)
    order = np.argsort(ratios)
    cdf = np.cumsum(predicted[order]) / predicted.sum()
    at = np.searchsorted(cdf, (np.arange(NUM_RATIOS) + 0.5) / NUM_RATIOS)
    return [round(float(r), 4) for r in ratios[order][np.minimum(at, len(ratios) - 1)]]


def _covers(x: np.ndarray) -> dict[str, int]:
    """The range of steps x holds: most rows, prefill tokens, decode rows, context per row."""
    if not len(x):
        return {"rows": 0, "prefill_tokens": 0, "decode_tokens": 0, "context_per_row": 0}
    per_row = x[:, 4] / np.maximum(x[:, 2], 1)
    return {"rows": int(x[:, 3].max()), "prefill_tokens": int(x[:, 1].max()),
            "decode_tokens": int(x[:, 2].max()), "context_per_row": int(per_row.max())}  # fmt: skip


def _nnls(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares with no negative coefficient: drop the most negative term and refit.

    Columns are scaled to unit norm first, so terms of very different sizes (per step, per
    pair) are weighed alike.
    """
    norms = np.linalg.norm(x, axis=0)
    norms[norms == 0] = 1.0
    xs = x / norms
    active = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    while True:
        coef = np.zeros(x.shape[1])
        if active:
            coef[active] = np.linalg.lstsq(xs[:, active], y, rcond=None)[0]
        if (coef >= 0).all():
            return coef / norms
        active.remove(int(np.argmin(coef)))
