"""What single requests met, named: failures counted first and said in words, long token gaps
cut into parts, a step slow for its shape that cost no one, the core's and the API process's
pauses and stalls. The sampler's costs: test_verdict_sampler.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.trace_builder import MS, T0, Trace, serve_alone
from tracing.diagnose import diagnose_run, explain_request, render_run


def _streams(tr: Trace, n: int, output: int, **kw: object) -> list[str]:
    ids = [f"s{i}" for i in range(n)]
    for rid in ids:
        tr.request(rid, 0.0, prompt=16, output=output, **kw)  # type: ignore[arg-type]
    tr.step({rid: 16 for rid in ids}, 8.0)
    while any(tr.reqs[rid].status is None for rid in ids):
        tr.step({rid: 1 for rid in ids if tr.reqs[rid].status is None}, 2.0)
    return ids


def test_a_reader_that_pauses_mid_stream_is_named_by_its_gap(tmp_path: Path) -> None:
    """Four streams; one reader stops reading for 600 ms after its 20th write: the run names a
    token gap made of delivery, and its why cuts that gap into parts (it used to say nothing
    stands out, the gap unexplained)."""
    tr = Trace()
    _streams(tr, 3, 60)
    tr.request("paused", 0.0, prompt=16, output=60, pause_at=20, pause_ns=600 * MS)
    serve_alone(tr, "paused", 1.0, decode_ms=2.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = [f for f in run.findings if f.kind == "gap"]
    assert [f.part for f in gaps] == ["delivery"] and gaps[0].request_ids == ["paused"], text
    assert "Nothing stands out" not in text
    req, sentences = explain_request(tmp_path / "t.db", "paused")
    assert req.long_gaps and req.long_gaps[0].named == "delivery"
    assert sum(req.long_gaps[0].parts.values()) == req.long_gaps[0].ns  # the parts sum to it
    assert "delivery to the client 6" in " ".join(sentences)  # its ~600 ms, as its largest part


def test_a_crash_is_counted_first_and_said_in_each_failed_requests_why(tmp_path: Path) -> None:
    tr = Trace()
    ids = _streams(tr, 2, 4)
    tr.request("crashed", 20.0, prompt=16, output=100)
    tr.step({"crashed": 16}, 5.0, at_ms=21.0)
    tr.step({"crashed": 1}, 5.0)
    tr.lifecycle("restart", "engine core process died (exit code -9)", 40.0, 1500.0, num_failed=1)
    tr.fail("crashed", 41.0, "engine_restarted")
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    assert "1 of 3 requests did not finish: 1 failed with the engine core's crash" in text
    assert text.index("did not finish") < text.index("TTFT p50")  # the headline counts it first
    assert [f.part for f in run.findings if f.kind == "failure"] == ["crash"]
    assert "Nothing stands out" not in text
    _, sentences = explain_request(tmp_path / "t.db", "crashed")
    why = " ".join(sentences)
    assert "failed with the engine core's crash (engine core process died" in why, why
    assert "Nothing stands out" not in why
    assert all(r.failure is None for r in run.requests if r.request_id in ids)


def test_a_request_sent_again_after_a_crash_waited_for_the_restart_not_a_stalled_core(
    tmp_path: Path,
) -> None:
    """A request sent to a core that dies before reading it is sent again to the new core
    1.5 s later (service/lifecycle.py): that wait is the restart's, counted once; it is not
    also the core stalling (the time from its first send to the new core's read)."""
    tr = Trace()
    _streams(tr, 2, 4)
    tr.request("again", 30.0, prompt=16, output=8, ipc_ms=1512.0)
    tr.lifecycle("restart", "engine core process died (exit code -9)", 40.0, 1500.0, num_failed=0)
    tr.reqs["again"].resent = tr.reqs["again"].received - MS
    tr.step({"again": 16}, 5.0)
    while tr.reqs["again"].status is None:
        tr.step({"again": 1}, 5.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    again = next(r for r in run.requests if r.request_id == "again")
    assert again.ttft["engine_restart"] >= 1400 * MS and again.ttft["core_stall"] < MS, again.ttft
    assert "the core stalling" not in text, text


def _one_second_requests(
    tr: Trace, slow: int | None, gc: int | None, gc_ms: float = 140.0, step_ms: float = 10.0
) -> None:
    """Six requests one after another, each 100 tokens of 10 ms steps (``step_ms``); request
    ``slow`` has a 35 ms step (3.5x its shape, 25 ms over: 2% of its life, its gap under 4x the
    median), and request ``gc`` a step of ``step_ms`` plus ``gc_ms`` of the core's GC."""
    for i in range(6):
        rid = f"r{i}"
        tr.request(rid, i * 1200.0, output=100)
        tr.step({rid: 32}, step_ms, at_ms=i * 1200.0 + 2)
        while tr.reqs[rid].status is None:
            mid = len(tr.reqs[rid].emits) == 50
            ms = 35.0 if i == slow and mid else step_ms + gc_ms if i == gc and mid else step_ms
            tr.step({rid: 1}, ms, gc_ms=gc_ms if i == gc and mid else 0.0)


def test_a_slow_step_that_cost_no_one_is_listed_not_named(tmp_path: Path) -> None:
    """The slow step is listed under the steps, and the run is quiet."""
    tr = Trace()
    _one_second_requests(tr, slow=4, gc=None)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    slow = [f for f in run.findings if "took at least" in f.text]
    assert len(slow) == 1 and slow[0].kind == "info" and slow[0].section == "steps", text
    assert "Nothing stands out" in text


def test_gc_inside_a_step_is_gc_not_a_slow_step(tmp_path: Path) -> None:
    """The GC's step is no outlier (GC is named apart): only the 35 ms step is listed as slow,
    and the GC's 150 ms token gap (14% of its request's life) is named as GC."""
    tr = Trace()
    _one_second_requests(tr, slow=4, gc=2)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    slow = [f for f in run.findings if "took at least" in f.text]
    assert len(slow) == 1 and slow[0].text.startswith("1 step took") and slow[0].kind == "info"
    assert [(f.part, f.request_ids) for f in run.findings if f.kind == "gap"] == [("gc", ["r2"])]


@pytest.mark.parametrize("gc_ms", [22.0, 35.0])
def test_a_short_pause_in_a_long_stream_is_named_past_one_and_a_half_bars(
    tmp_path: Path, gc_ms: float
) -> None:
    """4 ms steps: a 26 ms token gap, 22 ms of it GC (5x the median gap, 5% of its request's
    life), is the machine's jitter, which healthy runs show: `trace why` lists it with its
    parts, and the run names no cause. 35 ms of GC is past 1.5 bars: named whatever the life."""
    tr = Trace()
    _one_second_requests(tr, slow=None, gc=2, gc_ms=gc_ms, step_ms=4.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = [f for f in run.findings if f.kind == "gap"]
    if gc_ms < 30.0:
        assert not gaps and "Nothing stands out" in text, text
    else:
        assert [f.part for f in gaps] == ["gc"], text
    _, sentences = explain_request(tmp_path / "t.db", "r2")
    said = " ".join(" ".join(sentences).split())
    print(said)
    assert "Its longest token gaps" in said, said
    assert f"garbage-collection pauses {gc_ms:.1f} ms" in said, said


def _a_slow_step_in_an_api_pause(tr: Trace, pause: bool) -> None:
    """Six 100-token requests of 10 ms steps, one after another; r2's 50th step takes 160 ms,
    and (``pause``) the API process paused 150 ms for GC inside it (a loop lag as long)."""
    for i in range(6):
        rid = f"r{i}"
        tr.request(rid, i * 1200.0, output=100)
        tr.step({rid: 32}, 10.0, at_ms=i * 1200.0 + 2)
        while tr.reqs[rid].status is None:
            slow = i == 2 and len(tr.reqs[rid].emits) == 50
            if slow and pause:
                at = (tr.now - T0) / MS + 1.0
                tr.pause("api", "gc", at, 150.0)
                tr.pause("api", "loop_lag", at, 150.0)
            tr.step({rid: 1}, 160.0 if slow else 10.0)


def test_a_stall_a_reader_sees_is_named_however_long_the_stream(tmp_path: Path) -> None:
    """A 120 ms stop of the core in 2.5 s streams (5% of each one's life, a hang primitive of
    `lumen bench diagnose` on the tiny model that read as nothing): a token gap of 100 ms or
    more is named whatever its share of the stream; the 50 ms one above still is not."""
    tr = Trace()
    ids = [f"s{i}" for i in range(3)]
    for rid in ids:
        tr.request(rid, 0.0, prompt=16, output=250)
    tr.step({rid: 16 for rid in ids}, 10.0)
    for k in range(249):
        tr.step({rid: 1 for rid in ids}, 130.0 if k == 120 else 10.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = [(f.part, sorted(f.request_ids)) for f in run.findings if f.kind == "gap"]
    assert gaps == [("core_stall", ids)], text


def test_a_step_slowed_by_the_api_processs_gc_names_the_gc(tmp_path: Path) -> None:
    """The slow step is the API process's GC (it took the core's CPU), not a core stall; the
    same step without the pause is the core's."""
    named = {}
    for pause in (True, False):
        tr = Trace()
        _a_slow_step_in_an_api_pause(tr, pause)
        run = diagnose_run(tr.write(tmp_path / f"t{pause}.db"))
        text = render_run(run)
        print(text)
        slow = [f for f in run.findings if "took at least" in f.text]
        assert len(slow) == 1 and slow[0].kind == "step", text
        named[pause] = slow[0]
    assert named[True].part == "gc" and "paused in them for garbage collection" in named[True].text
    assert named[False].part == "core_stall" and "the core stalled" in named[False].text


def test_a_step_slowed_by_the_api_processs_gc_is_gc_in_its_requests_too(tmp_path: Path) -> None:
    """The same slow step, as its request's time: the step's excess is the API process's GC in
    r2's decode (and so in the run's causes), not the core stalling (a Gemma 3 run of the gc
    primitive, an API pause of 0.4 s, read as a hang besides GC)."""
    tr = Trace()
    _a_slow_step_in_an_api_pause(tr, True)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    r2 = next(r for r in run.requests if r.request_id == "r2")
    assert r2.decode["core_stall"] < MS and r2.decode["gc"] >= 100 * MS, r2.decode
    assert "core_stall" not in {f.part for f in run.findings}, text


def test_a_core_stopped_while_a_token_waited_to_leave_it_is_a_core_stall(tmp_path: Path) -> None:
    """SIGSTOP of the core just after a step's output was made: the token reaches the frontend
    120 ms late, while the next step runs 120 ms past its time. Each stream's gap is the core
    stalling (the core's output thread stops with it), not the frontend's emit."""
    tr = Trace()
    ids = [f"s{i}" for i in range(4)]
    for rid in ids:
        tr.request(rid, 0.0, prompt=16, output=200)
    tr.step({rid: 16 for rid in ids}, 8.0)
    for k in range(198):  # with the stalled step: 199 decode steps
        stopped = k == 100
        tr.step({rid: 1 for rid in ids}, 2.0, held_ms=121.0 if stopped else 0.0)
        if stopped:
            tr.step({rid: 1 for rid in ids}, 122.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = [f for f in run.findings if f.kind == "gap"]
    assert [(f.part, sorted(f.request_ids)) for f in gaps] == [("core_stall", ids)], text


def test_an_event_loop_lag_that_gc_fills_is_gc() -> None:
    """Seven back-to-back collections (25 ms each) in a 200 ms lag: the lag is the storm's,
    all of it GC; a 100 ms lag with one 20 ms collection in it stays a lag (less the GC)."""
    from tracing.pauses import PauseRow, pauses_of

    storm = [PauseRow("api", "gc", T0 + k * 27 * MS, 25 * MS) for k in range(7)]
    storm.append(PauseRow("api", "loop_lag", T0, 200 * MS))
    lone = [PauseRow("api", "gc", T0 + 1000 * MS, 20 * MS),
            PauseRow("api", "loop_lag", T0 + 990 * MS, 100 * MS)]  # fmt: skip
    api, _ = pauses_of(storm + lone)
    parts = {"gc": 0, "loop_lag": 0}
    assert api.carve(parts, T0, T0 + 300 * MS) == 100 * MS
    assert parts == {"gc": 200 * MS, "loop_lag": 0}
    parts = {"gc": 0, "loop_lag": 0}
    api.carve(parts, T0 + 900 * MS, T0 + 1200 * MS)
    assert parts == {"gc": 20 * MS, "loop_lag": 80 * MS}


def test_a_long_prompt_past_its_fitted_price_is_a_prefill_stall(tmp_path: Path) -> None:
    """A prefill token costs 0.3 ms here and a decode row 0.05 ms; the fit caps a token's price
    at a row's (step_fit), so a 900-token prompt's 275 ms step reads as 5x its price (so did a
    962-token Gemma 3 step of 878 ms in a generated scenario). The decoders' gaps in it are
    that prompt's prefill (a prefill stall, as the steps' verdict has it), not the core
    stalling."""
    tr = Trace()
    ids = [f"d{i}" for i in range(4)]
    for i, rid in enumerate(ids):
        tr.request(rid, 0.0, prompt=16, output=120 + 40 * i)
    tr.step({rid: 16 for rid in ids}, 5.0 + 0.3 * 64)
    k = 0
    while any(tr.reqs[rid].status is None for rid in ids):
        rows = {rid: 1 for rid in ids if tr.reqs[rid].status is None}
        if k == 61:
            tr.request("long", (tr.now - T0) / MS, prompt=900, output=1)
            rows["long"] = 900
        prefill = sum(n for n in rows.values() if n > 1)
        decode = sum(1 for n in rows.values() if n == 1)
        tr.step(rows, 5.0 + 0.05 * decode + 0.3 * prefill + 0.02 * (k % 5))
        k += 1
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = {f.part for f in run.findings if f.kind == "gap"}
    assert "core_stall" not in gaps and "neighbour_prefill" in gaps, text


def _decoders(tr: Trace, n: int = 4, output: int = 200) -> list[str]:
    ids = [f"s{i}" for i in range(n)]
    for rid in ids:
        tr.request(rid, 0.0, prompt=16, output=output)
    tr.step({rid: 16 for rid in ids}, 8.0)
    return ids


def test_the_cores_gc_while_a_token_waits_to_leave_it_is_gc(tmp_path: Path) -> None:
    """An 80 ms collection of the core just after a step's outputs were made (the gc primitive
    of `lumen bench diagnose`, which read as a hang): the GIL holds the core's output thread,
    so the token reaches the frontend 81 ms late, and the next step starts after it. The
    streams' gap is the core's GC, neither a stall nor the frontend's emit."""
    tr = Trace()
    ids = _decoders(tr)
    for k in range(198):  # with the step after the pause: 199 decode steps
        rows = {rid: 1 for rid in ids}
        if k == 70:
            tr.step(rows, 2.0, held_ms=81.0)
            tr.pause("core", "gc", (tr.now - T0) / MS, 80.0)
            tr.step(rows, 2.0, at_ms=(tr.now - T0) / MS + 80.0)
        else:
            tr.step(rows, 2.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    gaps = [f for f in run.findings if f.kind == "gap"]
    assert [(f.part, sorted(f.request_ids)) for f in gaps] == [("gc", ids)], text


def test_a_core_stopped_while_idle_holds_new_requests_as_a_stall(tmp_path: Path) -> None:
    """The core stopped for 300 ms while no step ran: requests sent then reach it late. That
    wait is the core stalling (a healthy core reads its input within a millisecond), not IPC;
    the same requests sent 1 ms apart are quick and name nothing."""
    named = {}
    for stopped in (True, False):
        tr = Trace()
        for i in range(12):
            late = stopped and i in (6, 7)
            tr.request(f"r{i}", i * 200.0, output=8, ipc_ms=300.0 if late else 0.2)
            serve_alone(tr, f"r{i}", i * 200.0 + 2)
        run = diagnose_run(tr.write(tmp_path / f"t{stopped}.db"))
        print(render_run(run))
        named[stopped] = {f.part for f in run.findings if f.kind in ("cause", "paid")}
        if stopped:
            r6 = next(r for r in run.requests if r.request_id == "r6")
            assert r6.ttft["core_stall"] >= 295 * MS and r6.ttft["ipc"] < MS, r6.ttft
    assert named == {True: {"core_stall"}, False: set()}, named


def test_a_core_stopped_in_a_short_prefill_step_is_a_stall_not_the_prefill(
    tmp_path: Path,
) -> None:
    """SIGSTOP of the core for 500 ms during a step that carried a 64-token prefill beside
    three decoders (SmolLM2's scenario, named as a prefill stall before): the step is far past
    even a long prompt's slack, so the decoders' gap and the newcomer's TTFT are the core
    stalling."""
    tr = Trace()
    ids = _decoders(tr, 3)
    for k in range(60):
        tr.step({rid: 1 for rid in ids}, 2.0 + 0.1 * (k % 3))
    tr.request("p", (tr.now - T0) / MS, prompt=64, output=8)
    tr.step({**{rid: 1 for rid in ids}, "p": 64}, 2.0 + 0.3 * 64 + 500.0)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({rid: 1 for rid, r in tr.reqs.items() if r.status is None}, 2.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    parts = {f.part for f in run.findings if f.kind in ("cause", "paid", "gap", "step")}
    assert "core_stall" in parts and "neighbour_prefill" not in parts, text


@pytest.mark.parametrize("late", [False, True], ids=["decoders", "and-a-new-request"])
def test_the_cores_gc_between_steps_is_gc_not_a_stall(tmp_path: Path, late: bool) -> None:
    """An 80 ms collection of the core between two steps, its outputs already sent (a Gemma 3
    run of the gc primitive, which read as a hang): no step ran for 80 ms, which a core that
    stopped would also show; the store's pause says why. The decoders' gap, and (``late``) the
    wait of a request that arrived in it, are the core's GC, not a stall."""
    tr = Trace()
    ids = _decoders(tr)
    for k in range(199):
        rows = {rid: 1 for rid in ids}
        if k == 70:
            at = (tr.now - T0) / MS + 0.5
            tr.pause("core", "gc", at, 80.0)
            if late:
                tr.request("late", at + 10.0, prompt=16, output=40, ipc_ms=0.2)
                rows["late"] = 16
            tr.step(rows, 2.0, at_ms=at + 80.0)
        else:
            if late and "late" in tr.reqs and tr.reqs["late"].status is None:
                rows["late"] = 1
            tr.step(rows, 2.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    stalls = {r.request_id for r in run.requests
              if r.ttft.get("core_stall", 0) + r.decode.get("core_stall", 0) >= MS}  # fmt: skip
    assert not stalls, text
    assert "core_stall" not in {f.part for f in run.findings}, text
    assert "hang" not in text.lower(), text


@pytest.mark.parametrize("phase", ["schedule", "output"])
def test_a_core_stopped_in_a_steps_schedule_or_output_is_a_stall(
    tmp_path: Path, phase: str
) -> None:
    """SIGSTOP of the core for 300 ms while it was scheduling a step (its output thread, with
    the last step's tokens, stopped too), or while it was sending a step's outputs (a hang
    primitive of `lumen bench diagnose`, which read as scheduler CPU and emit): a phase that
    takes a fraction of a millisecond in every other step took 300 ms. That is the core
    stalling, whichever phase it stopped in."""
    tr = Trace()
    ids = _decoders(tr)
    for k in range(199):
        stopped = k == 100
        tr.step({rid: 1 for rid in ids}, 2.0,
                schedule_ms=300.0 if stopped and phase == "schedule" else 0.2,
                output_ms=300.0 if stopped and phase == "output" else 0.2,
                held_ms=300.0 if k == 99 and phase == "schedule" else 0.0)  # fmt: skip
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    named = {f.part for f in run.findings if f.kind in ("cause", "paid", "gap")}
    assert named == {"core_stall"}, text
