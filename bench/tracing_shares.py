"""Tracing's cost in `lumen bench overhead`, paired round by round: each round runs the traced
and the untraced server (every other round in reverse order), and a share is the traced
server's extra ``figure`` over the untraced server's CPU per token in that round.

With MIN_ROUNDS_FOR_INTERVAL or more rounds each share also gets an INTERVAL bootstrap interval
of its median: on 2 cores one round's whole-server share moves by several points, so the median
alone cannot say whether a target of a few percent is met.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

INTERVAL = 0.9
MIN_ROUNDS_FOR_INTERVAL = 5
FIGURES = {"tracing_cpu": "server_cpu_us_per_token", "tracing_api": "api_cpu_us_per_token",
           "trace_writer": "trace_writer_cpu_us_per_token"}  # fmt: skip


def keys(levels: list[int]) -> dict[str, tuple[int, str]]:
    """Each tracing share's key, with its level and figure."""
    return {f"s{streams}_{name}_extra_ratio": (streams, figure)
            for streams in levels for name, figure in FIGURES.items()}  # fmt: skip


def paired_extras(summaries: list[dict[str, Any]], streams: int, figure: str) -> list[float]:
    """Per round, (traced - untraced) ``figure`` as a share of the untraced server's CPU per
    token in that round; empty without both servers."""

    def of(system: str) -> list[dict[str, Any]]:
        return [s for s in summaries if s["system"] == system and s["streams"] == streams]

    pairs = zip(of("lumen (traced)"), of("lumen (no trace db)"))
    return [(on[figure] - off[figure]) / off["server_cpu_us_per_token"] for on, off in pairs]


def medians(summaries: list[dict[str, Any]], levels: list[int]) -> dict[str, float]:
    """Each tracing share's median over the rounds (where both servers ran)."""
    out = {}
    for key, (streams, figure) in keys(levels).items():
        if extras := paired_extras(summaries, streams, figure):
            out[key] = statistics.median(extras)
    return out


def intervals(summaries: list[dict[str, Any]], levels: list[int]) -> dict[str, dict[str, float]]:
    """Each tracing share's INTERVAL bootstrap interval of its median, where it has at least
    MIN_ROUNDS_FOR_INTERVAL paired rounds."""
    out = {}
    for key, (streams, figure) in keys(levels).items():
        extras = paired_extras(summaries, streams, figure)
        if len(extras) >= MIN_ROUNDS_FOR_INTERVAL:
            low, high = median_interval(extras)
            out[key] = {"low": low, "high": high, "rounds": len(extras)}
    return out


def median_interval(
    values: list[float], share: float = INTERVAL, resamples: int = 4000, seed: int = 0
) -> tuple[float, float]:
    """The percentile bootstrap interval holding ``share`` of the medians of ``values``
    resampled with replacement; the same for the same values (a fixed seed)."""
    rng = random.Random(seed)
    n = len(values)
    medians = sorted(statistics.median(rng.choices(values, k=n)) for _ in range(resamples))
    tail = (1 - share) / 2
    return medians[int(tail * (resamples - 1))], medians[int((1 - tail) * (resamples - 1))]
