"""`replay report --html`: a self-contained page whose plots have real axes, from a diagnosis."""

from __future__ import annotations

import html
import re
from pathlib import Path

import pytest

from replay import plots
from replay.html import render_html
from tests.helpers.browser import render_page
from tests.helpers.trace_db import build_trace_db, make_diagnosis
from tracing.diagnose import PartStat

VERDICT = "The TTFT tail: r1 and r2 waited 400 ms in the core's queue behind r0's prefill."


@pytest.fixture
def page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """The page of the hand-made trace db, its diagnosis given (the diagnosis is tested apart)."""
    import tracing.diagnose

    db = build_trace_db(tmp_path / "t.db")
    monkeypatch.setattr(tracing.diagnose, "diagnose_run", lambda db, run_id=None: make_diagnosis())
    monkeypatch.setattr(tracing.diagnose, "render_run", lambda diag: VERDICT)
    out = tmp_path / "report.html"
    render_html(db, out)
    return out.read_text()


def _svgs(page: str) -> list[str]:
    return re.findall(r'<svg class="plot".*?</svg>', page, flags=re.S)


def _texts(svg: str) -> list[str]:
    return [html.unescape(t) for t in re.findall(r"<text[^>]*>([^<]*)</text>", svg)]


def _is_number(text: str) -> bool:
    return re.fullmatch(r"-?[\d,]+(\.\d+)?%?", text) is not None


def test_the_page_is_self_contained(page: str) -> None:
    assert "<script" not in page.lower() and "src=" not in page and "@import" not in page
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) == {"http://www.w3.org/2000/svg"}
    assert all(ref.startswith("#") for ref in re.findall(r'href="([^"]*)"', page))
    assert html.escape(VERDICT) in page
    assert "<td>420.0 ms</td>" in page  # the percentile table, from the diagnosis's summary


def test_every_plot_has_tick_labels_and_axis_titles(page: str) -> None:
    svgs = _svgs(page)
    assert len(svgs) == 5  # CDFs, timeline, TTFT breakdown, a waterfall for each named request
    for svg in svgs:
        texts = _texts(svg)
        assert sum(_is_number(t) for t in texts) >= 5, texts  # real ticks, not just min and max
        assert not any(re.search(r"\de[+-]\d", t) for t in texts), texts
    cdfs, timeline, breakdown, *waterfalls = (_texts(s) for s in svgs)
    assert "latency (ms)" in cdfs and "share at or below" in cdfs
    assert {"tokens per step", "requests", "execute (ms)", "seconds since the run's start"} <= set(
        timeline
    )
    assert {"prefill tokens", "decode tokens", "running", "waiting"} <= set(timeline)
    assert "milliseconds" in breakdown and "waiting in the core's queue" in breakdown
    assert all("milliseconds since the request's start" in w for w in waterfalls)


def test_a_waterfall_for_each_request_the_verdict_names(page: str) -> None:
    titles = [t for s in _svgs(page) for t in _texts(s) if t.startswith("request ")]
    assert [t.split(":")[0] for t in titles] == ["request r1", "request r2"]
    waterfall = _texts(_svgs(page)[3])
    assert {"llm_request", "core.queue", "worker.execute ×3"} <= set(waterfall)


def test_the_breakdown_draws_the_verdicts_numbers() -> None:
    """With the verdict's per-part statistics, the bars are those: a part it names is drawn."""
    from replay.html import _breakdown

    diag = make_diagnosis()
    diag.parts["ttft"] = {
        "own_prefill": PartStat(median_ns=50e6, tail_extra_ns=0.0),
        "queue": PartStat(median_ns=0.0, tail_extra_ns=400e6),
        "gc": PartStat(median_ns=0.0, tail_extra_ns=0.0),
    }
    texts = _texts(_breakdown(diag))
    assert "waiting in the core's queue" in texts and "its own prefill compute" in texts
    assert "garbage-collection pauses" not in texts  # nothing to draw: not in the legend
    assert "50.0 ms" in texts and "450.0 ms" in texts  # the median and the tail's totals


def test_the_timeline_breaks_where_no_step_ran() -> None:
    """Four far-apart steps stay four: no line joins them across the time without steps."""
    steps = [plots.StepPoint(t, t + 0.02, 500, 2, 2, 1, 18.0) for t in (0.0, 30.0, 60.0, 90.0)]
    edges, rows, binned = plots._step_rows(steps)
    prefill = rows[0]
    assert binned == 0.0 and len(edges) == len(prefill) + 1
    assert list(prefill[::2]) == [500.0] * 4 and all(v != v for v in prefill[1::2])  # NaN gaps
    assert all(b - a >= 90.02 / 500 * 0.99 for a, b in zip(edges[::2], edges[1::2]))  # visible
    busy = [plots.StepPoint(i * 0.021, i * 0.021 + 0.02, 0, 8, 8, 0, 19.0) for i in range(50)]
    _, rows, _ = plots._step_rows(busy)
    assert len(rows[0]) == 50 and not any(v != v for v in rows[0])  # continuous: one area
    many = [plots.StepPoint(i * 0.01, i * 0.01 + 0.009, 0, 8, 8, 0, 9.0) for i in range(5000)]
    edges, _, binned = plots._step_rows(many)
    assert binned > 0 and len(edges) == 1001  # long runs are binned: the page stays small
    assert len(plots.timeline(many)) < 150_000


def test_latency_cdfs_use_a_log_scale_for_wide_spans() -> None:
    wide = {"TTFT": [0.002, 0.01, 0.05, 0.3, 2.0, 9.0]}
    ticks = [t for t in _texts(plots.latency_cdfs(wide)) if _is_number(t)]
    assert {"0.01", "0.1", "1", "10"} <= set(ticks)  # decades, in seconds
    narrow = {"TTFT": [0.100, 0.120, 0.150, 0.200]}
    texts = _texts(plots.latency_cdfs(narrow))
    assert "latency (ms)" in texts and len([t for t in texts if _is_number(t)]) >= 8


def test_the_page_renders_in_a_browser(page: str, tmp_path: Path) -> None:
    report = tmp_path / "page.html"
    report.write_text(page)
    png, dom = render_page(report, tmp_path)
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000  # a page with drawings
    assert dom.count('<svg class="plot"') == 5
