"""The diagnosis names the right cause, and none in a healthy run, on small synthetic trace dbs."""

from __future__ import annotations

import itertools
from pathlib import Path

import duckdb
import pytest

from tests.helpers.trace_builder import MS, T0, Trace, long_prefill_run, serial_run, serve_alone
from tracing.diagnose import RunDiagnosis, diagnose_run, explain_request, render_run
from tracing.store import TABLES
from tracing.store_migrations import MIGRATIONS


def kinds(run: RunDiagnosis, kind: str) -> list[str]:
    return [f.text for f in run.findings if f.kind == kind]


def test_healthy_run_has_nothing_that_stands_out(tmp_path: Path) -> None:
    run = diagnose_run(serial_run().write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert not kinds(run, "cause") and not kinds(run, "paid") and not kinds(run, "step")
    assert "Nothing stands out" in text and "Expected compute" in text
    # The parts sum to each phase; the text quotes the table's numbers.
    for r in run.requests:
        assert sum(r.ttft.values()) == r.delivered_ttft_ns
        assert r.ttft["unattributed"] == 0 and r.decode["unattributed"] == 0
    p50 = run.summary["ttft_s"]["p50"] * 1e3
    assert f"TTFT p50 {p50:,.1f} ms" in text and f"{p50:,.1f} ms" in text.splitlines()[3]


def test_a_few_ms_of_spread_is_not_a_cause(tmp_path: Path) -> None:
    tr = Trace()
    for i in range(12):
        tr.request(f"r{i}", i * 100.0, frontend_ms=1.0 + 1.5 * i)  # 1 to 17.5 ms
        serve_alone(tr, f"r{i}", i * 100.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    assert run.parts["ttft"]["frontend"].tail_extra_ns > 5 * MS
    assert not kinds(run, "cause") and "Nothing stands out" in render_run(run)


def test_frontend_cpu_paid_by_every_request(tmp_path: Path) -> None:
    run = diagnose_run(serial_run(frontend_ms=63.0).write(tmp_path / "t.db"))
    paid = [f for f in run.findings if f.kind == "paid"]
    print(render_run(run))
    assert [f.part for f in paid] == ["frontend"] and not kinds(run, "cause")
    assert paid[0].text.startswith(
        "Every request spent 63.0 ms (85% of the median time to "
        "first delivered token) in frontend CPU (chat template"
    )


def test_queue_held_by_max_num_seqs(tmp_path: Path) -> None:
    tr = Trace()
    for i in range(8):
        tr.request(f"q{i}", 0.0)
    for pair in range(4):
        a, b = f"q{2 * pair}", f"q{2 * pair + 1}"
        waiting = 6 - 2 * pair
        reason = "max_num_seqs" if waiting else ""
        tr.step({a: 32, b: 32}, 10.0, wait_reason=reason, waiting=waiting)
        while tr.reqs[a].status is None:
            tr.step({a: 1, b: 1}, 5.0, wait_reason=reason, waiting=waiting)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    causes = [f for f in run.findings if f.kind == "cause"]
    assert [f.part for f in causes] == ["queue"]
    assert "max_num_seqs" in causes[0].text and "--max-num-seqs" in causes[0].text
    assert {"q6", "q7"} <= set(causes[0].request_ids)
    assert run.requests[-1].wait_reason == "max_num_seqs"


def test_slow_scheduler(tmp_path: Path) -> None:
    tr = Trace()
    for i in range(6):
        tr.request(f"s{i}", i * 400.0)
        serve_alone(tr, f"s{i}", i * 400.0 + 2, schedule_ms=8.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    named = [f for f in run.findings if f.part == "schedule"]
    assert named and "scheduler CPU" in named[0].text
    assert all(f.part == "schedule" for f in run.findings if f.kind in ("cause", "paid", "step"))


def test_long_prefill_stalls_decodes_and_the_neighbour_is_named(tmp_path: Path) -> None:
    run = diagnose_run(long_prefill_run().write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    [stall] = [f for f in run.findings if f.kind == "step"]
    assert stall.text.startswith(
        "A 2,047-token prefill chunk of long-1 stalled 4 decoding requests"
    )
    assert "--max-num-batched-tokens" in stall.text
    itl = f"p99 ITL is {run.summary['itl_s']['p99'] * 1e3:,.1f} ms"
    assert itl in stall.text
    neighbour = [f for f in run.findings if f.part == "neighbour_prefill" and f.kind != "step"]
    assert neighbour and "long-1 with 2,047 prefill tokens" in neighbour[0].text
    assert "queue" not in {f.part for f in run.findings}


@pytest.mark.parametrize("core_id", ["long-1-0", "0_long-1"], ids=["child", "old-sample"])
def test_a_sample_is_counted_as_its_request(tmp_path: Path, core_id: str) -> None:
    """The core runs sample 0 of an n > 1 request as "ID-0" (before: "0_ID")."""
    path = long_prefill_run().write(tmp_path / "t.db")
    con = duckdb.connect(str(path))
    con.execute("UPDATE steps SET request_ids = list_transform(request_ids, "
                "lambda x: CASE WHEN x = 'long-1' THEN ? ELSE x END)", [core_id])  # fmt: skip
    con.close()
    run = diagnose_run(path)
    neighbour = [f for f in run.findings if f.part == "neighbour_prefill" and f.kind != "step"]
    assert neighbour and "long-1 with 2,047 prefill tokens" in neighbour[0].text


def test_slow_reader_delivery(tmp_path: Path) -> None:
    tr = Trace()
    for i in range(6):
        tr.request(f"c{i}", i * 200.0, output=10, reader_ns=50 * MS if i == 3 else 0)
        serve_alone(tr, f"c{i}", i * 200.0 + 2)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    [slow] = [f for f in run.findings if f.kind == "cause"]
    assert slow.part == "delivery" and slow.request_ids == ["c3"]
    assert "slow reader" in slow.text and "waited 500.0 ms on its socket" in slow.text


def test_tokens_sent_n_at_a_time_are_writes_not_causes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """lumen serve --stream-interval 4: the first token goes at once, then a write every 4
    tokens. The held tokens' emits end at their write: the token gaps are the writes' gaps,
    nothing is named, and `trace show` shows the hold apart from frontend.emit's own time."""
    from service.cli import main

    tr = serial_run(output=17, stream_interval=4)
    tr.engine_config = {"stream_interval": 4, "max_num_seqs": 128}  # as the server records it
    path = tr.write(tmp_path / "t.db")
    run = diagnose_run(path)
    text = render_run(run)
    print(text)
    assert not kinds(run, "cause") and not kinds(run, "paid") and not kinds(run, "step")
    assert "Nothing stands out" in text
    assert (
        "sent tokens 4 at a time (--stream-interval 4): ITL is the gap between writes"
        in " ".join(text.split())
    )
    for r in run.requests:  # 1 + 4 x 4 tokens: five writes, each gap 4 decode steps of 5 ms
        assert len(r.gaps_ns) == 4 and all(20 * MS < g < 25 * MS for g in r.gaps_ns), r.gaps_ns
    _, sentences = explain_request(path, "r3")
    assert any(s.startswith("Its token gaps were even") for s in sentences), sentences
    assert main(["trace", "show", "r3", "--db", str(path)]) == 0
    out = capsys.readouterr().out
    print(out)
    rows = {line[:18].strip(): line.split()[-4:] for line in out.splitlines() if "|" in line}
    held = float(out.split("held to send")[1].split()[1])
    emitted = float(next(line for line in out.splitlines() if line.startswith("frontend.emit"))
                    .split()[2])  # fmt: skip
    assert held > 100 and emitted == 1.0, rows  # 12 held tokens of 5-15 ms; 5 writes of 0.2
    assert "slowest boundary: worker.execute" in out
    # A write's wait on the client's socket: its summed waits over the writes, not the emits.
    slow = diagnose_run(serial_run(output=17, stream_interval=4, reader_ns=2 * MS)
                        .write(tmp_path / "slow.db"))  # fmt: skip
    assert all(r.ttft["delivery"] == 2 * MS for r in slow.requests)


def _all_aborted(kv_left: int, idle_at_ms: float = 62.0) -> Trace:
    tr = Trace()
    for i in range(6):
        tr.request(f"a{i}", 0.0, output=100)
    tr.step({f"a{i}": 32 for i in range(6)}, 10.0)
    for _ in range(3):
        tr.step({f"a{i}": 1 for i in range(6)}, 5.0)
    for i in range(6):
        tr.abort(f"a{i}", 60.0)
    tr.idle(idle_at_ms, kv_used=kv_left)
    return tr


def test_every_request_aborted_is_reported_with_kv_freed(tmp_path: Path) -> None:
    run = diagnose_run(_all_aborted(0).write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert run.num_aborted == 6 and run.num_ok == 0
    [cancelled] = [f.text for f in run.findings if f.section == "cancellations"]
    assert cancelled.startswith(
        "6 requests were cancelled (0 ok, 0 error); KV blocks in use "
        "after the last cancellation: 0 of 512 (freed within 0.5 ms"
    )
    assert not kinds(run, "cause")


@pytest.mark.parametrize("idle_at_ms", [62.0, 59.5])
def test_kv_blocks_held_after_every_request_ended(tmp_path: Path, idle_at_ms: float) -> None:
    run = diagnose_run(_all_aborted(40, idle_at_ms).write(tmp_path / "t.db"))
    [held] = [f for f in run.findings if f.kind == "cause"]
    assert held.text.startswith("40 KV blocks still held after every request ended")


def test_an_idle_record_just_before_the_frontend_closed_the_last_abort_counts(
    tmp_path: Path,
) -> None:
    """The core records its idle state once the aborts reach it, which can be a moment before
    the frontend's own record of the last cancelled stream's end: that idle record still
    holds the KV state after every cancellation."""
    run = diagnose_run(_all_aborted(0, idle_at_ms=59.5).write(tmp_path / "t.db"))
    [cancelled] = [f.text for f in run.findings if f.section == "cancellations"]
    assert "KV blocks in use after the last cancellation: 0 of 512" in cancelled, cancelled


def test_pauses_are_carved_out_of_the_parts_they_overlap(tmp_path: Path) -> None:
    tr = serial_run(frontend_ms=10.0)
    r5, r7 = tr.reqs["r5"], tr.reqs["r7"]
    prefill_start = r5.steps[0][2]  # r5's prefill executes for 10 ms from here
    tr.pause("core", "gc", (prefill_start - T0) / MS + 2, 5.0)
    tr.pause("api", "loop_lag", (r7.handler - T0) / MS + 1, 4.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    got = {r.request_id: r for r in run.requests}
    assert got["r5"].ttft["gc"] == 5 * MS and got["r5"].ttft["own_prefill"] == 5 * MS
    assert got["r7"].ttft["loop_lag"] == 4 * MS and got["r7"].ttft["frontend"] == 6 * MS
    for r in (got["r5"], got["r7"]):
        assert sum(r.ttft.values()) == r.delivered_ttft_ns and r.ttft["unattributed"] == 0


def test_time_after_a_preemption(tmp_path: Path) -> None:
    tr = Trace()
    tr.request("p0", 0.0, output=6)
    tr.request("p1", 0.0, output=4)
    tr.step({"p0": 32}, 10.0)
    tr.step({"p0": 1}, 5.0)
    tr.step({"p1": 32}, 10.0, preempted=("p0",))  # p0 gives its blocks to p1
    while tr.reqs["p1"].status is None:
        tr.step({"p1": 1}, 5.0)
    tr.reqs["p0"].computed = 0  # recomputed: its prompt and the tokens it had
    tr.reqs["p0"].prompt = 34
    tr.step({"p0": 34}, 12.0)
    while tr.reqs["p0"].status is None:
        tr.step({"p0": 1}, 5.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    p0 = next(r for r in run.requests if r.request_id == "p0")
    # From the step that preempted it to the step that ran it again: p1's four steps.
    assert p0.decode["preempted"] == (10.5 + 3 * 5.5) * MS
    assert sum(p0.decode.values()) == p0.end_ns - (p0.start_ns + p0.ttft_phase_ns)


def test_an_old_db_still_reports(tmp_path: Path) -> None:
    tr = serial_run()
    path = tmp_path / "old.db"
    con = duckdb.connect(str(path))
    con.execute("CREATE TABLE schema_migrations (version INTEGER, name VARCHAR, applied_ns BIGINT)")
    MIGRATIONS[0][2](con)
    con.execute("INSERT INTO schema_migrations VALUES (1, 'initial', 0)")
    for table, rows in (
        ("requests", tr.request_rows()),
        ("steps", tr.steps),
        ("spans", tr.span_rows()),
    ):
        have = [
            c
            for (c,) in con.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = ?", [table]
            ).fetchall()
        ]
        columns = TABLES["span_rows" if table == "spans" else table]  # spans: a table then
        index = [list(columns).index(c) for c in have]
        con.executemany(
            f"INSERT INTO {table} VALUES ({', '.join('?' * len(have))})",
            [[row[i] for i in index] for row in rows],
        )
    con.close()
    run = diagnose_run(path)
    text = render_run(run)
    print(text)
    assert "Nothing stands out" in text and run.summary["ttft_s"]
    # The spans stand in for the instants: frontend and IPC parts, delivery from frontend.emit.
    r = run.requests[0]
    assert r.ttft["frontend"] == pytest.approx(1.0 * MS) and r.ttft["ipc"] == pytest.approx(
        0.2 * MS
    )
    assert r.ttft["unattributed"] == 0


def test_explain_one_request(tmp_path: Path) -> None:
    path = long_prefill_run().write(tmp_path / "t.db")
    req, sentences = explain_request(path, "d1")
    text = " ".join(sentences)
    print("\n".join(sentences))
    assert req.neighbours == {"long-1": 2047, "d0": 32, "d2": 32, "d3": 32}
    assert "long-1 with 2,047 prefill tokens in step 6" in text
    assert "longest token gaps" in text and "carrying a 2,047-token prefill chunk of long-1" in text
    assert "other requests' prefill in the steps it shared 596.0 ms" in text  # the gap, cut
    with pytest.raises(ValueError, match="not in"):
        explain_request(path, "nope")


def test_lumen_trace_why(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from service.cli import main

    tr = long_prefill_run()
    tr.request("cmpl-7-0", 1500.0)
    tr.request("cmpl-7-1", 1500.0)
    tr.step({"cmpl-7-0": 32, "cmpl-7-1": 32}, 10.0, at_ms=1500.5)
    while tr.reqs["cmpl-7-0"].status is None:
        tr.step({"cmpl-7-0": 1, "cmpl-7-1": 1}, 5.0)
    path = str(tr.write(tmp_path / "t.db"))
    assert main(["trace", "why", "d2", "--db", path]) == 0
    out = capsys.readouterr().out
    print(out)
    assert out.startswith("d2  ok") and "long-1" in out and "run median" in out
    assert "other requests' prefill in the steps it shared" in out
    assert main(["trace", "why", "cmpl-7", "--db", path]) == 0
    out = capsys.readouterr().out
    assert "cmpl-7-0  ok" in out and "cmpl-7-1  ok" in out
    assert main(["trace", "why", "nope", "--db", path]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"lumen: error: request 'nope' is not in {path}"
    # The id after --db (which takes several dbs, so it took the id too): the same answer.
    assert main(["trace", "why", "--db", path, "d2"]) == 0
    assert capsys.readouterr().out.startswith("d2  ok")
    assert main(["trace", "show", "--db", path, "d2"]) == 0
    assert "d2" in capsys.readouterr().out
    assert main(["trace", "why", "--db", path]) == 2
    assert "give the request id" in capsys.readouterr().err


def test_trace_top_calls_the_queue_wait_core_queue(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from service.cli import main

    tr = Trace()
    tr.request("early", 0.0)
    tr.request("late", 0.0)
    serve_alone(tr, "early", 1.0, prefill_ms=10.0, decode_ms=40.0, wait_reason="max_num_seqs")
    serve_alone(tr, "late", 0.0)
    path = str(tr.write(tmp_path / "t.db"))
    assert main(["trace", "top", "--db", path]) == 0
    out = capsys.readouterr().out
    print(out)
    late = next(line for line in out.splitlines() if line.startswith("late"))
    assert "core.queue" in late and "core.schedule" not in out


def test_two_steps_written_at_once_are_one_gap(tmp_path: Path) -> None:
    """A frontend behind its core writes two steps' tokens in one write: their emits end at
    the same instant. The client saw one gap, ended by the later step, however the rows lie."""
    tr = serial_run(n=3)
    r = tr.reqs["r1"]
    (s3, recv3, _), (s4, recv4, at) = r.emits[3], r.emits[4]
    r.emits[3:5] = [(s4, recv4, at), (s3, recv3, at)]  # one write; the later step's row first
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    [req] = [q for q in run.requests if q.request_id == "r1"]
    writes = sorted({d: s for s, _, d in sorted(r.emits)}.items())
    assert req.gap_step_ids == [s for _, s in writes[1:]] and s3 not in req.gap_step_ids
    assert req.gaps_ns == [b - a for (a, _), (b, _) in itertools.pairwise(writes)]
    assert all(g > 0 for g in req.gaps_ns)


def test_a_recompute_after_a_preemption_is_the_preemptions_cost_to_the_rows_beside_it(
    tmp_path: Path,
) -> None:
    """Three decoders beside a request preempted mid-decode, which recomputes its 40-token
    prompt and 10 tokens in one step beside them (63 ms against 12.5; seed 1400043: a kv_blocks
    run whose recomputes read as other requests' prefill). Its cost to the decoders is the
    preemption's (`recompute`, named with the KV cache's knob), not a prefill a smaller token
    budget would cut; to the preempted request itself it is its own wait (`preempted`)."""
    tr = Trace()
    tr.step_prior = [10.0 * MS, 1.0 * MS, 0.5 * MS]
    live = [f"d{i}" for i in range(3)]
    for rid in live:
        tr.request(rid, 0.0, prompt=8, output=40)
    tr.request("p", 0.0, prompt=40, output=30)
    tr.step({**dict.fromkeys(live, 8), "p": 40}, 50.0)
    for _ in range(10):
        tr.step({**dict.fromkeys(live, 1), "p": 1}, 12.0)
    tr.step(dict.fromkeys(live, 1), 11.5, preempted=("p",))
    for _ in range(5):
        tr.step(dict.fromkeys(live, 1), 11.5)
    tr.reqs["p"].computed = 0  # recomputed: its prompt and the tokens it had
    tr.step({**dict.fromkeys(live, 1), "p": 51}, 11.5 + 51.0)
    while any(tr.reqs[r].status is None for r in tr.reqs):
        rows = {r: 1 for r in tr.reqs if tr.reqs[r].status is None}
        tr.step(rows, 10.0 + 0.5 * len(rows))
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    got = {r.request_id: r for r in run.requests}
    d0, p = got["d0"], got["p"]
    assert d0.decode["recompute"] >= 30 * MS and d0.decode["neighbour_prefill"] < 5 * MS, d0.decode
    assert p.decode["preempted"] >= 5 * 11.5 * MS + 30 * MS, p.decode
    gap = d0.long_gaps[0]
    assert gap.named == "recompute", gap
    assert "other requests' recompute after a preemption" in text, text
    assert "--max-num-batched-tokens" not in text, text
