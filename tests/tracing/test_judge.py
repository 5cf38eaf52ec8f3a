"""One judgement: `lumen trace top`, `lumen trace why` and `replay report` name the same part as
what dominated each request, from the diagnosis's parts (not the spans)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from replay.report import render_text
from tests.helpers.trace_builder import MS, T0, Trace, serve_alone
from tracing.diagnose import diagnose_run
from tracing.judge import call_part, dominant_part, passes, request_calls


def _lagged_frontends(path: Path) -> Path:
    """Twelve requests served alone; r5's and r9's 60 ms in the frontend are mostly event-loop
    lag (what the frontend.enqueue span holds, and `trace top` used to call the frontend)."""
    tr = Trace()
    for i in range(12):
        slow = i in (5, 9)
        tr.request(f"r{i}", i * 200.0, frontend_ms=60.0 if slow else 1.0)
        if slow:
            tr.pause("api", "loop_lag", (tr.reqs[f"r{i}"].handler - T0) / MS + 5, 50.0)
        serve_alone(tr, f"r{i}", i * 200.0 + 2)
    return tr.write(path)


def _top(db: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    from service.cli import main

    assert main(["trace", "top", "--db", str(db), "--limit", "50"]) == 0
    rows = capsys.readouterr().out.splitlines()[1:]
    return {line.split()[0]: line[73:].strip() for line in rows}


def _why(db: Path, rid: str, capsys: pytest.CaptureFixture[str]) -> str:
    from service.cli import main

    assert main(["trace", "why", rid, "--db", str(db)]) == 0
    head = capsys.readouterr().out.splitlines()[0]
    return head.split("  dominated by ", 1)[1]


def _report(db: Path) -> dict[str, str]:
    text = render_text(str(db))
    section = text.split("Slowest requests (end to end) and what dominated each\n", 1)[1]
    found = {}
    for line in section.split("\n\n", 1)[0].splitlines():
        m = re.match(r"  (\S+) \(\w+\) [\d,.]+ ms: (.*)$", line)
        assert m, line
        found[m[1]] = m[2]
    return found


def test_top_why_and_report_name_the_same_dominant_part(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    db = _lagged_frontends(tmp_path / "t.db")
    top, report = _top(db, capsys), _report(db)
    assert set(report) <= set(top) and {"r5", "r9"} <= set(report)
    for rid, words in top.items():
        assert _why(db, rid, capsys) == words, rid
        assert report.get(rid, words) == words, rid
    assert top["r5"].startswith("loop_lag (") and top["r9"].startswith("loop_lag (")
    assert "frontend.enqueue" not in top["r5"]
    run = diagnose_run(db)
    r5 = next(r for r in run.requests if r.request_id == "r5")
    assert r5.dominant == dominant_part(r5, run) and r5.dominant is not None
    assert r5.dominant.judged and r5.dominant.ns == r5.ttft["loop_lag"] == 50 * MS


def test_one_rule_for_a_run_and_a_request() -> None:
    # Beyond the reference where the extra passes; else large in itself; never expected work.
    assert passes(20 * MS, 200 * MS) and not passes(19 * MS, 10 * MS)
    assert not passes(25 * MS, 300 * MS)  # under 10% of the phase
    beyond = call_part("queue", 30 * MS, 31 * MS, 100 * MS, 100 * MS)
    assert beyond is not None and beyond.beyond and beyond.ns == 30 * MS
    large = call_part("queue", 30 * MS, 31 * MS, 100 * MS, 100 * MS, has_reference=False)
    assert large is not None and not large.beyond and large.ns == 31 * MS
    assert call_part("own_prefill", 90 * MS, 90 * MS, 100 * MS, 100 * MS) is None
    assert call_part("delivery", 90 * MS, 90 * MS, 100 * MS, 100 * MS) is None


def test_the_api_process_is_called_as_a_whole_when_each_part_is_under_the_bars(
    tmp_path: Path,
) -> None:
    """Every request spends 15 ms in the frontend and 10 ms of event-loop lag: neither passes
    20 ms alone, their sum does; the run and each request name the API process, by its
    largest part (the frontend)."""
    tr = Trace()
    for i in range(12):
        tr.request(f"r{i}", i * 200.0, frontend_ms=25.0)
        tr.pause("api", "loop_lag", (tr.reqs[f"r{i}"].handler - T0) / MS + 5, 10.0)
        serve_alone(tr, f"r{i}", i * 200.0 + 2)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    named = [f for f in run.findings if f.label == "the API process"]
    assert len(named) == 1 and named[0].kind == "paid" and named[0].part == "frontend", named
    assert "event-loop lag in the API process 10.0 ms" in named[0].text
    calls = request_calls(run.requests[3], run, "ttft")
    assert [c.part for c in calls] == ["frontend"] and not calls[0].beyond


def test_a_short_requests_one_slow_gap_is_not_paid_over_the_median_requests_tokens(
    tmp_path: Path,
) -> None:
    """Nine 200-to-280-token streams and a 2-token request whose one gap shared a step with a
    300-token prefill (8 ms): the tail by time per output token is that request and the
    slowest stream, 3.6 ms a token over the median on average. Over their own decodes they paid
    4.2 ms more on average, not 3.6 ms x the median request's 229 tokens (0.8 s): under the
    bars, nothing is named."""
    tr = Trace()
    tr.step_prior = [0.5e6, 25e3, 0.05e6, 0.0]  # a prefill token at 25 us: 300 of them 7.5 ms
    decoders = [f"d{i}" for i in range(9)]
    for i, rid in enumerate(decoders):
        tr.request(rid, 0.0, output=200 + 10 * i)
    tr.request("s", 0.0, output=2)
    tr.request("p", 0.0, prompt=300, output=2)
    tr.step({**{rid: 32 for rid in decoders}, "s": 32}, 5.0)
    tr.step({**{rid: 1 for rid in decoders}, "s": 1, "p": 300}, 8.0)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({rid: 1 for rid, r in tr.reqs.items() if r.status is None}, 1.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    s = next(r for r in run.requests if r.request_id == "s")
    assert s.decode["neighbour_prefill"] > 5 * MS  # its one gap was the prefill's
    causes = [f for f in run.findings if f.kind == "cause"]
    assert not causes, [f.text for f in causes]
