"""`replay report --html`: one self-contained page (inline SVG, no scripts, no server) with
latency CDFs, the batch-composition and queue-depth timeline, and the TTFT breakdown."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from replay.report import PARTS, RequestTimes, attribute_ttft, load_times, summary
from tracing.store import open_db

W, H, PAD = 760, 300, 50
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2"]


def _scale(values: list[float], lo_px: float, hi_px: float) -> tuple[float, float, callable]:
    lo, hi = (min(values), max(values)) if values else (0.0, 1.0)
    hi = hi if hi > lo else lo + 1.0
    return lo, hi, lambda v: lo_px + (v - lo) / (hi - lo) * (hi_px - lo_px)


def _axes(x_label: str, y_label: str, x: tuple[float, float], y: tuple[float, float]) -> str:
    return (
        f'<line x1="{PAD}" y1="{H - PAD}" x2="{W - 10}" y2="{H - PAD}" stroke="#333"/>'
        f'<line x1="{PAD}" y1="10" x2="{PAD}" y2="{H - PAD}" stroke="#333"/>'
        f'<text x="{W / 2}" y="{H - 12}" text-anchor="middle">{html.escape(x_label)}</text>'
        f'<text x="14" y="{H / 2}" transform="rotate(-90 14 {H / 2})" text-anchor="middle">'
        f"{html.escape(y_label)}</text>"
        f'<text x="{PAD}" y="{H - PAD + 16}" text-anchor="middle">{x[0]:.3g}</text>'
        f'<text x="{W - 10}" y="{H - PAD + 16}" text-anchor="end">{x[1]:.3g}</text>'
        f'<text x="{PAD - 4}" y="{H - PAD}" text-anchor="end">{y[0]:.3g}</text>'
        f'<text x="{PAD - 4}" y="18" text-anchor="end">{y[1]:.3g}</text>'
    )


def line_chart(
    title: str, series: dict[str, tuple[list[float], list[float]]], x_label: str, y_label: str
) -> str:
    xs = [v for x, _ in series.values() for v in x]
    ys = [v for _, y in series.values() for v in y]
    x0, x1, sx = _scale(xs, PAD, W - 10)
    y0, y1, sy = _scale(ys, H - PAD, 10)
    body = [_axes(x_label, y_label, (x0, x1), (y0, y1))]
    for i, (name, (x, y)) in enumerate(series.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in zip(x, y))
        body.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" '
                    f'points="{points}"><title>{html.escape(name)}</title></polyline>')  # fmt: skip
        body.append(f'<text x="{W - 16}" y="{24 + 16 * i}" text-anchor="end" fill="{color}">'
                    f"{html.escape(name)}</text>")  # fmt: skip
    return _figure(title, "".join(body))


def bar_chart(title: str, rows: dict[str, dict[str, float]], unit: str) -> str:
    """Horizontal stacked bars: one per row, one segment per part."""
    total = max((sum(r.values()) for r in rows.values()), default=1.0) or 1.0
    body, y = [], 20
    for label, parts in rows.items():
        x = 160.0
        body.append(f'<text x="150" y="{y + 16}" text-anchor="end">{html.escape(label)}</text>')
        for i, (part, value) in enumerate(parts.items()):
            width = value / total * (W - 260)
            body.append(f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="24" '
                        f'fill="{COLORS[i % len(COLORS)]}"><title>{html.escape(part)}: '
                        f"{value:.1f} {unit}</title></rect>")  # fmt: skip
            x += width
        body.append(f'<text x="{x + 4:.1f}" y="{y + 16}">{sum(parts.values()):.1f} {unit}</text>')
        y += 40
    for i, part in enumerate(next(iter(rows.values()), {})):
        y += 18
        body.append(f'<text x="160" y="{y}" fill="{COLORS[i % len(COLORS)]}">&#9632; '
                    f"{html.escape(part)}</text>")  # fmt: skip
    return _figure(title, "".join(body), height=y + 20)


def _figure(title: str, svg: str, height: int = H) -> str:
    return (f'<figure><figcaption>{html.escape(title)}</figcaption><svg class="plot" '
            f'width="{W}" height="{height}" font-size="12" font-family="sans-serif">{svg}</svg>'
            "</figure>")  # fmt: skip


def _cdf(values: list[float]) -> tuple[list[float], list[float]]:
    v = sorted(values)
    return v, [(i + 1) / len(v) for i in range(len(v))]


def render_html(db: str, out: str | Path, run_id: str | None = None) -> None:
    run_id, times = load_times(db, run_id)
    if not times:
        raise ValueError(f"run {run_id} has no finished request")
    with open_db(db, timeout=10) as con:
        steps = con.execute(
            "SELECT schedule_start_ns, num_prefill_tokens, num_decode_tokens, num_waiting, "
            "num_running FROM steps WHERE run_id = ? ORDER BY schedule_start_ns",
            [run_id],
        ).fetchall()
    figures = [_latency_cdfs(times), _timeline(steps), _breakdown(times)]
    stats = summary(times)
    _, verdict = attribute_ttft(times)
    table = "".join(
        f"<tr><th>{name.removesuffix('_s').upper()}</th>"
        + "".join(f"<td>{pct[k] * 1000:.1f} ms</td>" for k in ("p50", "p90", "p99", "max"))
        + "</tr>"
        for name, pct in stats.items()
        if pct
    )
    Path(out).write_text(
        "<!doctype html><html><head><meta charset='utf-8'><title>Lumen replay report</title>"
        "<style>body{font-family:sans-serif;margin:2em;max-width:820px}td,th{padding:2px 10px;"
        "text-align:right}figure{margin:1.5em 0}figcaption{font-weight:bold}</style></head>"
        f"<body><h1>Replay report</h1><p>{html.escape(db)}, run {html.escape(run_id)}: "
        f"{len(times)} requests, {len(steps)} engine steps.</p>"
        f"<table><tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>{table}"
        f"</table><p class='verdict'>{html.escape(verdict)}</p>{''.join(figures)}"
        "</body></html>\n"
    )


def _latency_cdfs(times: list[RequestTimes]) -> str:
    series = {
        "TTFT": _cdf([t.ttft_ns / 1e9 for t in times]),
        "end to end": _cdf([t.e2e_ns / 1e9 for t in times]),
    }
    itls = [i / 1e9 for t in times for i in t.itls_ns]
    if itls:
        series["ITL"] = _cdf(itls)
    return line_chart("Latency CDFs", series, "seconds", "fraction of requests (tokens for ITL)")


def _timeline(steps: list[tuple]) -> str:
    if not steps:
        return _figure("Batch composition and queue depth", "<text x='20' y='40'>no steps</text>")
    t0 = steps[0][0]
    t = [(s[0] - t0) / 1e9 for s in steps]
    return line_chart(
        "Batch composition and queue depth, per engine step",
        {
            "prefill tokens": (t, [float(s[1]) for s in steps]),
            "decode tokens": (t, [float(s[2]) for s in steps]),
            "waiting requests x10": (t, [10.0 * s[3] for s in steps]),
            "running requests x10": (t, [10.0 * s[4] for s in steps]),
        },
        "seconds since the first step",
        "tokens / requests",
    )


def _breakdown(times: list[RequestTimes]) -> str:
    ttfts = np.array([t.ttft_ns for t in times])
    p50, p90 = np.percentile(ttfts, [50, 90])
    median = min(times, key=lambda t: abs(t.ttft_ns - p50))
    tail = [t for t in times if t.ttft_ns >= p90]
    rows = {
        "median request": {PARTS[k].split(" (")[0]: median.parts[k] / 1e6 for k in PARTS},
        "tail (>= p90) mean": {
            PARTS[k].split(" (")[0]: float(np.mean([t.parts[k] for t in tail])) / 1e6 for k in PARTS
        },
    }
    return bar_chart("Time to first token, by boundary", rows, "ms")
