"""`replay diff A B`: two runs' latency side by side, with bootstrap confidence intervals so a
change is told from noise, and the TTFT boundaries that moved."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from replay.report import PARTS, RequestTimes, load_times

METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class Change:
    metric: str
    quantile: int  # 50 or 99
    a_s: float
    b_s: float
    low_s: float  # 95% interval of b - a
    high_s: float

    @property
    def verdict(self) -> str:
        if self.low_s <= 0 <= self.high_s:
            return "no change beyond noise"
        rel = (self.b_s - self.a_s) / self.a_s if self.a_s else float("inf")
        return f"{'slower' if rel > 0 else 'faster'} by {abs(rel):.0%}"


def _values(times: list[RequestTimes], metric: str) -> list[list[float]]:
    """Per request, its values of the metric (ITL has many per request)."""
    if metric == "itl":
        return [[i / 1e9 for i in t.itls_ns] for t in times if t.itls_ns]
    if metric == "tpot":
        return [[t.tpot_ns / 1e9] for t in times if t.tpot_ns is not None]
    return [[(t.ttft_ns if metric == "ttft" else t.e2e_ns) / 1e9] for t in times]


def compare(
    a: list[list[float]], b: list[list[float]], q: int, *, resamples: int = 1000, seed: int = 0
) -> tuple[float, float, float, float]:
    """Quantile q of a and of b, and a 95% bootstrap interval of the difference
    (requests resampled, so a request's many ITLs move together)."""
    rng = np.random.default_rng(seed)

    def quantile(groups: list[list[float]], idx: np.ndarray | None = None) -> float:
        chosen = groups if idx is None else [groups[i] for i in idx]
        return float(np.percentile(np.concatenate(chosen), q))

    diffs = [
        quantile(b, rng.integers(0, len(b), len(b))) - quantile(a, rng.integers(0, len(a), len(a)))
        for _ in range(resamples)
    ]
    low, high = np.percentile(diffs, [2.5, 97.5])
    return quantile(a), quantile(b), float(low), float(high)


def diff(a_db: str, b_db: str, run_a: str | None = None, run_b: str | None = None) -> str:
    run_a, a = load_times(a_db, run_a)
    run_b, b = load_times(b_db, run_b)
    if not a or not b:
        raise ValueError("both runs need finished requests")
    lines = [f"A: {a_db} run {run_a} ({len(a)} requests)",
             f"B: {b_db} run {run_b} ({len(b)} requests)", "",
             f"{'':<10}{'A':>10}{'B':>10}   95% interval of B - A      verdict"]  # fmt: skip
    for metric in METRICS:
        va, vb = _values(a, metric), _values(b, metric)
        if not va or not vb:
            continue
        for q in (50, 99):
            c = Change(metric, q, *compare(va, vb, q))
            lines.append(
                f"{metric.upper() + f' p{q}':<10}{c.a_s * 1e3:>8.1f}ms{c.b_s * 1e3:>8.1f}ms   "
                f"[{c.low_s * 1e3:+8.1f}, {c.high_s * 1e3:+8.1f}] ms   {c.verdict}"
            )
    lines += ["", "mean time to first token, by boundary (ms):"]
    for part, label in PARTS.items():
        ma = np.mean([t.parts[part] for t in a]) / 1e6
        mb = np.mean([t.parts[part] for t in b]) / 1e6
        lines.append(f"  {ma:>8.1f} -> {mb:>8.1f}  ({mb - ma:+.1f})  {label}")
    return "\n".join(lines)
