"""The report's plots: pure functions from plain numbers to an inline SVG string (matplotlib)."""

from __future__ import annotations

import hashlib
import io
import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

WIDTH_IN = 10.0  # the page scales the SVG to its column; this sets the text-to-plot ratio
MAX_CDF_POINTS = 1000
MAX_STEP_SEGMENTS = 1500  # above this many steps, the timeline draws time bins instead
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2",
          "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
          "#c5b0d5")  # fmt: skip
FONTS = "'DejaVu Sans', 'Liberation Sans', Arial, Helvetica, sans-serif"
RC: dict[str, Any] = {
    "svg.fonttype": "none",  # text stays text: searchable, small, drawn by the browser
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans", "Liberation Sans", "Arial", "Helvetica"],
    "font.size": 10,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.color": "#e4e4e4",
    "grid.linewidth": 0.6,
    "legend.frameon": False,
    "path.simplify": True,
}
# Written by matplotlib for Inkscape; an inline figure needs none of it.
NO_METADATA = {"Type": None, "Format": None, "Creator": None, "Date": None}


class StepPoint(NamedTuple):
    """One engine step, in the units the timeline draws."""

    start_s: float  # since the run's start
    end_s: float
    prefill_tokens: int
    decode_tokens: int
    running: int
    waiting: int
    execute_ms: float


@contextmanager
def _figure(height_in: float, salt: str) -> Iterator[Figure]:
    # rc_context and the object API: no pyplot, no global state left behind.
    with matplotlib.rc_context({**RC, "svg.hashsalt": salt}):  # type: ignore[dict-item]
        yield Figure(figsize=(WIDTH_IN, height_in), layout="constrained")


def _svg(fig: Figure) -> str:
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata=NO_METADATA)
    svg = buf.getvalue()
    svg = svg[svg.index("<svg") :]  # no XML prolog or DOCTYPE inside HTML
    svg = re.sub(r"<!--.*?-->\s*", "", svg, flags=re.S)
    # Scaled by the page (viewBox stays); href works inline without the xlink namespace.
    svg = svg.replace(' xmlns:xlink="http://www.w3.org/1999/xlink"', "")
    svg = re.sub(r'<svg width="[^"]*" height="[^"]*"', '<svg class="plot"', svg, count=1)
    svg = svg.replace("xlink:href=", "href=")
    # Group ids repeat between figures on one page: keep only the ids something refers to.
    refs = set(re.findall(r"#([\w-]+)", svg))
    svg = re.sub(r' id="([^"]*)"', lambda m: m[0] if m[1] in refs else "", svg)
    # A hundredth of a point is finer than any screen: the paths' digits past it only weigh.
    svg = re.sub(r' d="[^"]*"', lambda m: re.sub(r"(\.\d\d)\d+", r"\1", m[0]), svg)
    # The font once, on the root, instead of on every label; no rotation by zero.
    svg = re.sub(r"font-family: [^;\"]*;? ?", "", svg)
    svg = re.sub(r' transform="rotate\(-0 [^"]*\)"', "", svg)
    return svg.replace('<svg class="plot"', f'<svg class="plot" style="font-family: {FONTS}"', 1)


def _salt(*data: object) -> str:
    """Ids of the SVG's clip paths and markers: distinct between figures on one page."""
    return hashlib.sha1(repr(data).encode()).hexdigest()[:10]


def _number(v: float, _pos: object = None) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:g}"


def latency_cdfs(series: dict[str, list[float]]) -> str:
    """Empirical CDFs of latencies in seconds; log x when they span more than ~1.5 decades."""
    series = {name: sorted(v) for name, v in series.items() if v}
    counts = {name: len(v) for name, v in series.items()}
    for name, vs in series.items():  # a CDF drawn from 1,000 quantiles looks the same, smaller
        if len(vs) > MAX_CDF_POINTS:
            series[name] = list(np.quantile(vs, np.linspace(0, 1, MAX_CDF_POINTS)))
    values = np.array([v for vs in series.values() for v in vs if v > 0])
    ms = values.size > 0 and float(np.percentile(values, 90)) < 1.0
    unit, factor = ("ms", 1e3) if ms else ("s", 1.0)
    with _figure(3.6, _salt("cdf", series)) as fig:
        ax = fig.add_subplot()
        if not series:
            return _empty(fig, ax, "no finished request")
        for i, (name, vs) in enumerate(series.items()):
            x = np.concatenate([vs[:1], vs]) * factor  # from 0 at the smallest value
            y = np.arange(len(x)) / len(vs)
            label = f"{name} (n={counts[name]:,})"
            ax.step(x, y, where="post", color=COLORS[i], linewidth=1.6, label=label)
        lo, hi = (values.min() * factor, values.max() * factor) if values.size else (1.0, 1.0)
        if hi / lo > 10**1.5:
            ax.set_xscale("log")
            ax.xaxis.set_major_locator(LogLocator(base=10))
            ax.xaxis.set_major_formatter(FuncFormatter(_number))
            # 2 and 5 labelled between the decades while they fit; else unlabelled ticks.
            few = hi / lo < 10**3.3
            subs = (2.0, 5.0) if few else tuple(range(2, 10))
            ax.xaxis.set_minor_locator(LogLocator(base=10, subs=subs))
            ax.xaxis.set_minor_formatter(FuncFormatter(_number) if few else NullFormatter())
            ax.grid(True, which="minor", color="#f0f0f0", linewidth=0.5)
        else:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=8))
            ax.xaxis.set_major_formatter(FuncFormatter(_number))
        ax.set_ylim(0, 1.02)
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.0%}"))
        ax.set_xlabel(f"latency ({unit})")
        ax.set_ylabel("share at or below")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        return _svg(fig)


def timeline(steps: Sequence[StepPoint]) -> str:
    """Batch composition, queue depth and step time over the run, panels sharing the time axis.

    Each step is drawn over its own time (stretched to be visible), continuous steps as one
    filled area, and any stretch with no step as a gap: nothing joins far-apart steps.
    """
    with _figure(6.4, _salt("timeline", steps)) as fig:
        if not steps:
            return _empty(fig, fig.add_subplot(), "no engine step recorded")
        edges, rows, binned = _step_rows(steps)
        tokens, reqs, exe = fig.subplots(
            3, 1, sharex=True, gridspec_kw={"height_ratios": [3, 2, 1.4]}
        )
        prefill, decode, running, waiting, execute = rows
        tokens.stairs(prefill, edges, fill=True, color=COLORS[3], label="prefill tokens")
        tokens.stairs(prefill + decode, edges, baseline=prefill, fill=True, color=COLORS[0],
                      label="decode tokens")  # fmt: skip
        tokens.set_ylabel("tokens per step")
        line = {"baseline": None, "linewidth": 1.4}  # no drop to 0 where a stretch ends
        reqs.stairs(running, edges, color=COLORS[2], label="running", **line)
        reqs.stairs(waiting, edges, color=COLORS[1], label="waiting", **line)
        exe.stairs(execute, edges, color=COLORS[4], label="execute", **line)
        # A mark on each step when there are few, and on any lone one, so that it is seen.
        drawn = ~np.isnan(prefill)
        alone = drawn & ~np.r_[False, drawn[:-1]] & ~np.r_[drawn[1:], False]
        mark = drawn if len(steps) <= 100 else alone
        mid = ((edges[:-1] + edges[1:]) / 2)[mark]
        dots = {"linestyle": "none", "marker": "o", "markersize": 3}
        top = (edges[:-1] + edges[1:]) / 2
        tokens.plot(top[alone], (prefill + decode)[alone], color="#555", **dots)
        reqs.plot(mid, running[mark], color=COLORS[2], **dots)
        reqs.plot(mid, waiting[mark], color=COLORS[1], **dots)
        exe.plot(mid, execute[mark], color=COLORS[4], **dots)
        reqs.set_ylabel("requests")
        exe.set_ylabel("execute (ms)")
        exe.set_xlabel("seconds since the run's start")
        for ax in (tokens, reqs, exe):
            ax.set_ylim(bottom=0)
            ax.yaxis.set_major_locator(MaxNLocator(nbins=4, integer=ax is not exe))
            ax.yaxis.set_major_formatter(FuncFormatter(_number))
            ax.legend(loc="upper left", bbox_to_anchor=(1.0, 1.0))
        exe.set_xlim(edges[0], edges[-1] + (edges[-1] - edges[0]) / 100)
        exe.xaxis.set_major_locator(MaxNLocator(nbins=10))
        exe.xaxis.set_major_formatter(FuncFormatter(_number))
        if binned:
            tokens.set_title(f"mean per step in {binned:.3g} s bins (max for requests and "
                             "execute)", fontsize=9, loc="left")  # fmt: skip
        return _svg(fig)


def _step_rows(steps: Sequence[StepPoint]) -> tuple[np.ndarray, list[np.ndarray], float]:
    """Stair edges and values (NaN where no step ran); the bin width when binned, else 0."""
    steps = sorted(steps)
    start = np.array([s.start_s for s in steps])
    end = np.maximum(np.array([s.end_s for s in steps]), start)
    cols = np.array([s[2:] for s in steps], dtype=float).T  # prefill, decode, running, ...
    span = max(end.max() - start.min(), 1e-6)
    if len(steps) > MAX_STEP_SEGMENTS:
        width = span / 1000
        edges = start.min() + width * np.arange(1001)
        idx = np.minimum(((start - start.min()) / width).astype(int), 999)
        count = np.bincount(idx, minlength=1000)
        binned: list[np.ndarray] = []
        for i, col in enumerate(cols):
            if i < 2:  # tokens: the mean step
                v = np.bincount(idx, weights=col, minlength=1000) / np.maximum(count, 1)
            else:  # requests and step time: the worst step
                v = np.full(1000, -np.inf)
                np.maximum.at(v, idx, col)
            binned.append(np.where(count > 0, v, np.nan))
        return edges, binned, width
    # A step is at least a couple of pixels wide; a short pause (CPU between steps) is no gap.
    min_width = span / 500
    gap = max(3 * float(np.median(end - start)), span / 400)
    stairs: list[float] = [start[0]]
    rows: list[list[float]] = [[] for _ in cols]
    for i in range(len(steps)):
        nxt = start[i + 1] if i + 1 < len(steps) else math.inf
        stop = nxt if nxt - end[i] <= gap else min(max(end[i], start[i] + min_width), nxt)
        for row, col in zip(rows, cols):
            row.append(col[i])
        stairs.append(stop)
        if stop < nxt < math.inf:  # a gap: a NaN stair is drawn as nothing
            for row in rows:
                row.append(np.nan)
            stairs.append(nxt)
    return np.array(stairs), [np.array(r) for r in rows], 0.0


def ttft_breakdown(rows: dict[str, dict[str, float]], labels: dict[str, str]) -> str:
    """Horizontal stacked bars of milliseconds per part, one bar per row, one colour per part."""
    parts = [p for p in labels if any(r.get(p, 0.0) > 0 for r in rows.values())]
    height = 1.2 + 0.45 * len(rows) + 0.22 * math.ceil(len(parts) / 2)
    with _figure(height, _salt("ttft", rows, labels)) as fig:
        ax = fig.add_subplot()
        if not parts:
            return _empty(fig, ax, "no time to first token recorded")
        names = list(rows)
        y = np.arange(len(names))
        left = np.zeros(len(names))
        for i, part in enumerate(parts):
            widths = np.array([rows[n].get(part, 0.0) for n in names])
            ax.barh(y, widths, left=left, height=0.6, color=COLORS[i % len(COLORS)],
                    label=labels[part])  # fmt: skip
            left += widths
        for yi, total in zip(y, left):
            ax.annotate(f"{total:,.1f} ms", (total, yi), xytext=(4, 0),
                        textcoords="offset points", va="center", fontsize=9)  # fmt: skip
        ax.set_yticks(y, names)
        ax.invert_yaxis()
        ax.set_xlim(0, left.max() * 1.12)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=8))
        ax.xaxis.set_major_formatter(FuncFormatter(_number))
        ax.set_xlabel("milliseconds")
        ax.grid(False, axis="y")
        fig.legend(loc="outside lower left", ncols=2, fontsize=9)
        return _svg(fig)


def waterfall(spans: list[tuple[str, float, float]], title: str) -> str:
    """One request's spans as a Gantt: a row per span name, per-step spans as many segments."""
    last = max((end for _, _, end in spans), default=0.0)
    unit, factor = ("milliseconds", 1e3) if last < 1.0 else ("seconds", 1.0)
    rows: dict[str, list[tuple[float, float]]] = {}
    for name, start, end in sorted(spans, key=lambda s: (s[1], s[1] - s[2])):
        rows.setdefault(name, []).append((start * factor, max(end - start, 0.0) * factor))
    height = 1.0 + 0.3 * max(len(rows), 2)
    with _figure(height, _salt("waterfall", spans, title)) as fig:
        ax = fig.add_subplot()
        ax.set_title(title, loc="left", fontsize=10)
        if not rows:
            return _empty(fig, ax, "no span recorded")
        span = max(max(s + w for s, w in r) for r in rows.values()) or 1e-6
        for i, segments in enumerate(rows.values()):
            visible = [(s, max(w, span / 800)) for s, w in segments]
            ax.broken_barh(visible, (i - 0.35, 0.7), color=COLORS[i % len(COLORS)])
        names = [f"{n} ×{len(r)}" if len(r) > 1 else n for n, r in rows.items()]
        ax.set_yticks(range(len(rows)), names)
        ax.set_ylim(len(rows) - 0.5, -0.5)
        ax.set_xlim(0, span * 1.01)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=10))
        ax.xaxis.set_major_formatter(FuncFormatter(_number))
        ax.set_xlabel(f"{unit} since the request's start")
        ax.grid(False, axis="y")
        return _svg(fig)


def _empty(fig: Figure, ax: Axes, text: str) -> str:
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes)
    return _svg(fig)
