"""The smallest magnitude each rule is meant to catch (docs/diagnosis.md, "Sensitivity"): a
provocation a quarter above it is named, a quarter below it is not. Synthetic runs of 12
requests, each served alone (a 10 ms prefill, 8 tokens at 5 ms)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.trace_builder import MS, Trace, serve_alone
from tracing.diagnose import diagnose_run, render_run


def _named(tr: Trace, tmp_path: Path) -> set[str | None]:
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    return {f.part for f in run.findings if f.kind in ("cause", "paid", "step")}


def _serial(tmp_path: Path, **kw: float) -> Trace:
    tr = Trace()
    for i in range(12):
        tr.request(f"r{i}", i * 200.0, output=8, **kw)
        serve_alone(tr, f"r{i}", i * 200.0 + 2)
    return tr


@pytest.mark.parametrize("factor", [0.75, 1.25])
def test_frontend_cpu_every_request_pays(tmp_path: Path, factor: float) -> None:
    """Bar: 20 ms of a phase part (and 10% of the phase), paid at the median."""
    named = _named(_serial(tmp_path, frontend_ms=20.0 * factor), tmp_path)
    assert ("frontend" in named) == (factor > 1), named


@pytest.mark.parametrize("factor", [0.75, 1.25])
def test_one_slow_request_in_the_tail(tmp_path: Path, factor: float) -> None:
    """Bar: the slowest 10% pay 20 ms more than the median in a part, on average (here two
    requests of 12, the tail at the 90th percentile, stuck on their way to the core: from
    20 ms that is the core stalling, below it IPC)."""
    tr = Trace()
    for i in range(12):
        slow = 20.0 * factor if i in (5, 9) else 0.0
        tr.request(f"r{i}", i * 200.0, output=8, ipc_ms=0.2 + slow)
        serve_alone(tr, f"r{i}", i * 200.0 + 2)
    named = _named(tr, tmp_path)
    assert ("core_stall" in named) == (factor > 1) and "ipc" not in named, named


@pytest.mark.parametrize("factor", [0.75, 1.25])
def test_a_slow_reader(tmp_path: Path, factor: float) -> None:
    """Bar: its bytes wait 4 of its inter-token times (and 20 ms, 10% of its life) after the
    engine produced them. Each write here waits ``wait`` on its socket, so the reader falls
    behind by wait minus the 5.3 ms token gap a token, 9 tokens."""
    behind = 4 * 5.5 * factor  # ms, over its 9 writes
    wait = 5.5 + behind / 9
    named = _named(_reader(wait), tmp_path)
    assert ("delivery" in named) == (factor > 1), named


def _reader(wait_ms: float) -> Trace:
    tr = Trace()
    for i in range(12):
        tr.request(f"r{i}", i * 200.0, output=8, reader_ns=int(wait_ms * MS) if i == 5 else 0)
        serve_alone(tr, f"r{i}", i * 200.0 + 2)
    return tr


@pytest.mark.parametrize("factor", [0.75, 1.25])
def test_logprobs_in_every_step(tmp_path: Path, factor: float) -> None:
    """Bar: 2 ms of a step and 10% of it, at the median of the steps that had any."""
    tr = Trace()
    lp = 2.0 * factor
    for i in range(12):
        tr.request(f"r{i}", i * 200.0, output=8)
        r = tr.reqs[f"r{i}"]
        tr.step({f"r{i}": r.prompt}, 10.0 + lp, at_ms=i * 200.0 + 2, logprobs_ms=lp)
        while r.status is None:
            tr.step({f"r{i}": 1}, 5.0 + lp, logprobs_ms=lp)
    named = _named(tr, tmp_path)
    assert ("logprobs" in named) == (factor > 1), named
