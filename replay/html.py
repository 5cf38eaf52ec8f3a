"""`replay report --html`: one self-contained page (inline SVG, no scripts, no server) with the
verdict, percentiles, latency CDFs, the engine timeline, the TTFT breakdown and waterfalls."""

from __future__ import annotations

import html
from pathlib import Path

import numpy as np

from replay import plots
from tracing.diagnose import TAIL_PERCENTILE, TTFT_PARTS, RequestDiagnosis, RunDiagnosis
from tracing.store import DbPath, open_db

MAX_WATERFALLS = 5
METRICS = {
    "ttft_s": "TTFT",
    "delivered_ttft_s": "delivered TTFT",
    "tpot_s": "TPOT",
    "itl_s": "ITL",
    "e2e_s": "end to end",
}
Span = tuple[str, int, int]  # name, start_ns, end_ns
STYLE = (
    "body{font-family:sans-serif;margin:2em auto;max-width:1000px;padding:0 1em;color:#222}"
    "h2{margin-top:1.6em;border-bottom:1px solid #ddd}"
    "table{border-collapse:collapse}td,th{padding:3px 12px;text-align:right}"
    "tr:nth-child(even){background:#f6f6f6}th:first-child{text-align:left}"
    "pre.verdict{white-space:pre-wrap;background:#f6f6f6;padding:1em;font-size:13px}"
    "figure{margin:1em 0}figcaption{font-weight:bold;margin-bottom:.3em}"
    "svg.plot{width:100%;height:auto;display:block}.note{color:#666;font-size:13px}"
)


def render_html(db: DbPath, out: str | Path, run_id: str | None = None) -> None:
    """Diagnose the run (default: the latest) and write its page to ``out``."""
    from tracing.diagnose import diagnose_run, render_run

    diag = diagnose_run(db, run_id)
    spans = load_spans(db, diag.run_id, named_requests(diag))
    source = Path(db).name if isinstance(db, str | Path) else ", ".join(Path(d).name for d in db)
    Path(out).write_text(build_page(diag, render_run(diag), spans, source=source))


def named_requests(diag: RunDiagnosis) -> list[str]:
    """The requests the verdict's findings name, first named first (at most MAX_WATERFALLS)."""
    ids: dict[str, None] = {}
    for finding in diag.findings:
        ids.update(dict.fromkeys(finding.request_ids))
    return list(ids)[:MAX_WATERFALLS]


def load_spans(db: DbPath, run_id: str, request_ids: list[str]) -> dict[str, list[Span]]:
    if not request_ids:
        return {}
    with open_db(db, timeout=10) as con:
        rows = con.execute(
            "SELECT request_id, name, start_ns, end_ns FROM spans WHERE run_id = ? "
            "AND list_contains(?, request_id) ORDER BY start_ns",
            [run_id, request_ids],
        ).fetchall()
    spans: dict[str, list[Span]] = {rid: [] for rid in request_ids}
    for rid, name, start, end in rows:
        spans[rid].append((name, start, end))
    return spans


def build_page(
    diag: RunDiagnosis, verdict: str, spans: dict[str, list[Span]], source: str = ""
) -> str:
    """The whole page as one string: everything it shows is in it."""
    e = html.escape
    t0 = _run_start(diag)
    ends = [r.arrival_ns + r.e2e_ns for r in diag.requests] + [s.end_ns for s in diag.steps]
    by_id = {r.request_id: r for r in diag.requests}
    of = f" of <code>{e(source)}</code>" if source else ""
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>Lumen replay report: {e(diag.run_id)}</title><style>{STYLE}</style></head>",
        f"<body><h1>Lumen replay report</h1><p>Run <code>{e(diag.run_id)}</code>{of}: ",
        f"{len(diag.requests):,} requests ({diag.num_ok:,} ok, {diag.num_aborted:,} aborted, ",
        f"{diag.num_error:,} errors) over {(max(ends, default=t0) - t0) / 1e9:,.1f} s, ",
        f"{len(diag.steps):,} engine steps.</p>",
        f"<h2>Verdict</h2><pre class='verdict'>{e(verdict)}</pre>",
        f"<h2>Latency</h2>{_table(diag.summary)}",
        _figure("Latency CDFs", plots.latency_cdfs(_latency_series(diag))),
        "<h2>The engine over time</h2>",
        _figure(
            "Batch composition, queue depth and step time",
            plots.timeline(_step_points(diag, t0)),
        ),
        "<h2>Time to first token, by part</h2>",
        _figure("Where the time to first token went", _breakdown(diag)),
    ]
    if spans:
        parts.append("<h2>Requests the verdict names</h2>")
        parts += [_waterfall(by_id.get(rid), rid, s) for rid, s in spans.items()]
    return "".join(parts) + "</body></html>\n"


def _figure(caption: str, svg: str) -> str:
    return f"<figure><figcaption>{html.escape(caption)}</figcaption>{svg}</figure>"


def _run_start(diag: RunDiagnosis) -> int:
    starts = [r.arrival_ns for r in diag.requests] + [s.start_ns for s in diag.steps]
    return min(starts, default=0)


def _table(summary: dict[str, dict[str, float]]) -> str:
    head = "<tr><th></th><th>p50</th><th>p90</th><th>p99</th><th>max</th></tr>"
    rows = "".join(
        f"<tr><th>{name}</th>"
        + "".join(f"<td>{summary[key][p] * 1e3:,.1f} ms</td>" for p in ("p50", "p90", "p99", "max"))
        + "</tr>"
        for key, name in METRICS.items()
        if summary.get(key)
    )
    return f"<table>{head}{rows}</table>"


def _latency_series(diag: RunDiagnosis) -> dict[str, list[float]]:
    reqs = diag.requests
    return {
        "TTFT": [r.ttft_ns / 1e9 for r in reqs if r.ttft_ns is not None],
        "delivered TTFT": [r.delivered_ttft_ns / 1e9 for r in reqs if r.delivered_ttft_ns],
        "end to end": [r.e2e_ns / 1e9 for r in reqs if r.status == "ok"],
        "token gaps (ITL)": [g / 1e9 for r in reqs for g in r.gaps_ns],
    }


def _step_points(diag: RunDiagnosis, t0: int) -> list[plots.StepPoint]:
    return [
        plots.StepPoint(
            start_s=(s.start_ns - t0) / 1e9,
            end_s=(s.end_ns - t0) / 1e9,
            prefill_tokens=s.prefill_tokens,
            decode_tokens=s.decode_tokens,
            running=s.running,
            waiting=s.waiting,
            execute_ms=s.execute_ns / 1e6,
        )
        for s in diag.steps
    ]


def _breakdown(diag: RunDiagnosis) -> str:
    """The median and the tail's TTFT by part: the verdict's own numbers where it gives them."""
    tail = f"slowest {100 - TAIL_PERCENTILE}%"
    stats = diag.parts.get("ttft")
    if stats:
        rows = {
            "median request": {k: s.median_ns / 1e6 for k, s in stats.items()},
            tail: {k: max(s.median_ns + s.tail_extra_ns, 0.0) / 1e6 for k, s in stats.items()},
        }
        return plots.ttft_breakdown(rows, TTFT_PARTS)
    # Otherwise from the requests: the median one, and the mean of those at or above p90.
    served = [r for r in diag.requests if r.ttft]
    if not served:
        return plots.ttft_breakdown({}, TTFT_PARTS)
    phase = np.array([sum(r.ttft.values()) for r in served])
    median = served[int(np.argmin(np.abs(phase - np.percentile(phase, 50))))]
    slow = [r for r, t in zip(served, phase) if t >= np.percentile(phase, TAIL_PERCENTILE)]
    rows = {
        "median request": {k: median.ttft.get(k, 0) / 1e6 for k in TTFT_PARTS},
        f"{tail} (mean of {len(slow)})": {
            k: sum(r.ttft.get(k, 0) for r in slow) / len(slow) / 1e6 for k in TTFT_PARTS
        },
    }
    return plots.ttft_breakdown(rows, TTFT_PARTS)


def _waterfall(req: RequestDiagnosis | None, request_id: str, spans: list[Span]) -> str:
    starts = [s for _, s, _ in spans] + ([req.start_ns, req.arrival_ns] if req else [])
    t0 = min(starts, default=0)
    title = f"request {request_id}"
    if req is not None:
        ttft = f"TTFT {req.ttft_ns / 1e6:,.1f} ms" if req.ttft_ns is not None else "no token"
        title += (
            f": {req.status}, {ttft}, end to end {req.e2e_ns / 1e6:,.1f} ms, "
            f"{req.prompt_tokens:,} prompt / {req.output_tokens:,} output tokens"
        )
    rel = [(name, (s - t0) / 1e9, (e - t0) / 1e9) for name, s, e in spans]
    return f"<figure>{plots.waterfall(rel, title)}</figure>"
