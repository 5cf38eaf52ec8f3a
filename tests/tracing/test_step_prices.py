"""How a step's time is priced and split between its rows, on synthetic trace dbs: the
step-cost fit and its prior, cold and outlier steps, prefill stalls, the step in flight, and
steps of prefills alone (tracing.shares, tracing.verdict_steps)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.helpers.trace_builder import MS, T0, Trace, serve_alone
from tracing.diagnose import diagnose_run, render_run
from tracing.diagnosis import RunDiagnosis
from tracing.why import explain


def _four_decoders(output: int, prefill_ms: float, steps: int, step_ms: float) -> Trace:
    """Four requests of 8-token prompts prefilled together, then ``steps`` decode steps of
    about ``step_ms`` (0 to 2 x 10% more, in turn)."""
    tr = Trace()
    for i in range(4):
        tr.request(f"d{i}", 0.0, prompt=8, output=output)
    tr.step({f"d{i}": 8 for i in range(4)}, prefill_ms)
    for k in range(steps):
        tr.step({f"d{i}": 1 for i in range(4)}, step_ms * (1.0 + 0.1 * (k % 3)))
    return tr


def _to_end(tr: Trace, step_ms: Callable[[int], float]) -> None:
    """Steps of one token for every live request until all are done (``step_ms``: a step's
    time by its rows)."""
    while any(r.status is None for r in tr.reqs.values()):
        live = {r: 1 for r, q in tr.reqs.items() if q.status is None}
        tr.step(live, step_ms(len(live)))


def _diagnosed(tr: Trace, tmp_path: Path) -> tuple[RunDiagnosis, str]:
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    return run, text


def test_two_long_prefills_among_many_decodes_are_priced_not_dropped(tmp_path: Path) -> None:
    """A run of decodes with two steps of long prefill (as recorded: 1,900 tokens in one,
    5,700 in the next): the fit misses both, and trimmed as outliers they would leave a
    prefill token priced at 0 and both steps called contention."""
    tr = _four_decoders(output=80, prefill_ms=8.0, steps=30, step_ms=6.0)
    # As in CI: a decode step slowed by the API process tokenizing the long prompts, and a
    # price per prefill token that is not quite linear (1,900 tokens +48 ms, 5,700 +61 ms):
    # with 5 and 8 rows there, an exact fit of those two steps wants a negative price per row.
    tr.step({f"d{i}": 1 for i in range(4)}, 75.0)
    tr.request("long-0", tr.now / MS - T0 / MS, prompt=1900, output=2)
    tr.step({**{f"d{i}": 1 for i in range(4)}, "long-0": 1900}, 54.0)
    for j in (1, 2, 3):
        tr.request(f"long-{j}", tr.now / MS - T0 / MS, prompt=1900, output=2)
    tr.step({**{r: 1 for r in tr.reqs if tr.reqs[r].status is None and tr.reqs[r].computed},
             **{f"long-{j}": 1900 for j in (1, 2, 3)}}, 67.0)  # fmt: skip
    k = 0
    while any(r.status is None for r in tr.reqs.values()):
        slow = 12.0 if k == 0 else 0.0  # the long prompts' one decode step: 7 rows
        tr.step({r: 1 for r in tr.reqs if tr.reqs[r].status is None}, slow or 6.0 + 0.4 * (k % 3))
        k += 1
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert "-token prefill chunk of long-3 and 2 other prefills stalled" in text, text
    assert "1 more such step" in text, text  # long-0's step is a stall too, not contention


def test_a_short_run_does_not_blame_a_few_prompt_tokens(tmp_path: Path) -> None:
    """Too few steps for a fit, and one step slowed by contention that happened to carry four
    4-token prompts beside a decode: not a prefill stall, not neighbours' prefill (seen in CI,
    where parsing large bodies in the API process slowed the core's step)."""
    tr = Trace()
    tr.request("r0", 0.0, prompt=3, output=6)
    tr.step({"r0": 3}, 150.0)
    for i in range(1, 5):
        tr.request(f"r{i}", 10.0, prompt=4, output=4)
    tr.step({"r0": 1, **{f"r{i}": 4 for i in range(1, 5)}}, 130.0)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({rid: 1 for rid, r in tr.reqs.items() if r.status is None}, 20.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert len(run.steps) < 11  # no fit of the steps' shape: the fallback decides
    named = {f.part for f in run.findings if f.kind in ("cause", "paid", "step")}
    assert "neighbour_prefill" not in named, text
    assert "stalled" not in text, text


def test_cold_first_step(tmp_path: Path) -> None:
    tr = Trace()
    for i in range(12):
        tr.request(f"w{i}", i * 500.0, prompt=64 + 8 * i)  # long enough to price a token
        prefill_ms = 400.0 if i == 0 else 5.0 + 5.0 * (64 + 8 * i) / 64  # 5 ms + 5 ms / 64 tokens
        serve_alone(tr, f"w{i}", i * 500.0 + 2, prefill_ms=prefill_ms)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    [cold] = [f.text for f in run.findings if f.kind == "step"]
    expected = "Cold start: the first step took 400.0 ms against 10.0 ms expected"
    assert cold.startswith(expected), cold


@pytest.mark.parametrize(
    ("num_decode_steps", "prompt"),
    [(30, 96), (2, 96), (2, 16)],
    ids=["fit", "token-fallback", "row-fallback"],
)
def test_a_step_of_prefills_alone_files_nothing_under_decode(
    tmp_path: Path, num_decode_steps: int, prompt: int
) -> None:
    """19 prompts prefilled in one step with no decode row (a 415.8 ms step was once filed as
    "the batch's other rows (decode) 395.0 ms"): each request's share of the others' rows is
    their prefill, whether the run has a fit, only prompts a token could be priced by, or
    neither."""
    tr = Trace()
    tr.request("d", 0.0, prompt=8, output=num_decode_steps + 40)
    tr.step({"d": 8}, 5.0)
    for _ in range(num_decode_steps):
        tr.step({"d": 1}, 5.0)
    tr.step({"d": 1}, 5.0)
    burst = [f"p{i}" for i in range(19)]
    for rid in burst:
        tr.request(rid, tr.now / MS - T0 / MS, prompt=prompt, output=2)
    tr.step({rid: prompt for rid in burst}, 400.0)  # no decode row: "d" sits this one out
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({rid: 1 for rid, r in tr.reqs.items() if r.status is None}, 6.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    print(render_run(run))
    for r in run.requests:
        if r.request_id in burst:
            assert r.ttft.get("decode", 0) < 1e6, (r.request_id, r.ttft)
            assert r.ttft["own_prefill"] + r.ttft["neighbour_prefill"] >= 390e6, r.ttft


def _sent_during(
    tr: Trace, rid: str, step_ms: float, rows: dict[str, int], sample_ms: float = 0.0
) -> None:
    """Run a step of ``step_ms`` while ``rid`` is sent to the core 10 ms into it: the core
    receives it when the step's outputs are out."""
    start_ms = (max(tr.now, *(tr.reqs[r].received for r in rows)) + MS // 10 - T0) / MS
    tr.request(rid, start_ms + 10.0, prompt=16, output=4,
               ipc_ms=step_ms + 0.4 - 10.0 - 1.2)  # fmt: skip
    tr.step(rows, step_ms, sample_ms=sample_ms)


@pytest.mark.parametrize("outlier", [False, True], ids=["normal-step", "outlier-step"])
def test_waiting_for_the_step_in_flight_is_expected_unless_the_step_is_not(
    tmp_path: Path, outlier: bool
) -> None:
    """Requests sent while a long prefill (priced: four of them) runs wait for it: not IPC,
    expected for the step's decode rows and the prefill's share other requests' prefill (each
    waiter names it); the prefill is named as the stall it is. A decode step 30x its expected
    time is no shape's price: the wait beyond its expected time is the core stalling."""
    tr = Trace()

    def cost(rows: int, k: int = 0) -> float:  # 5 ms a step, 2.5 ms a row, a little jitter
        return 5.0 + 2.5 * rows + 0.5 * (k % 3)

    for i in range(4):
        tr.request(f"d{i}", 0.0, prompt=8, output=200)
    tr.step({f"d{i}": 8 for i in range(4)}, 15.0)
    for k in range(20):
        tr.step({f"d{i}": 1 for i in range(4)}, cost(4, k))
    for j in range(4):
        decoders = {f"d{i}": 1 for i in range(4)}
        if outlier:
            _sent_during(tr, f"s{j}", 30 * cost(4) if j == 0 else cost(4), decoders)
        else:  # 0.29 ms per prefill token
            tr.request(f"L{j}", (tr.now - T0) / MS, prompt=1000, output=2)
            _sent_during(tr, f"s{j}", cost(5) + 290.0, {**decoders, f"L{j}": 1000})
        for k in range(20):
            live = {r: 1 for r, q in tr.reqs.items() if q.status is None}
            tr.step(live, cost(len(live), k))
    _to_end(tr, cost)
    run, text = _diagnosed(tr, tmp_path)
    s0 = next(r for r in run.requests if r.request_id == "s0")
    if outlier:
        assert s0.ttft["core_stall"] >= 250 * MS and s0.ttft["ipc"] < MS, s0.ttft
        assert "the core stalled" in text, text
    else:
        held = s0.ttft["step_in_flight"] + s0.ttft["neighbour_prefill"]
        assert held >= 290 * MS and s0.ttft["ipc"] < MS, s0.ttft
        assert s0.ttft["neighbour_prefill"] >= 250 * MS and "L0" in s0.neighbours, s0.ttft
        named = {f.part for f in run.findings if f.kind in ("cause", "paid")}
        assert "ipc" not in named and "neighbour_prefill" in named, text
        assert "stalled 4 decoding requests" in text, text


def test_a_first_prefill_within_its_shapes_noise_is_not_a_cold_start(tmp_path: Path) -> None:
    """Short prompts (too short for the fit to price a prefill token) prefilled in 30-50 ms
    beside 20 ms decodes; the first took 79 ms. Against the fit (a decode's time) that is
    4x; against prefills of its shape it is within their spread: no cold start."""
    tr = Trace()
    for i in range(20):
        at = i * 400.0
        tr.request(f"r{i}", at, prompt=38 + i % 8, output=10)
        serve_alone(tr, f"r{i}", at + 2, prefill_ms=79.0 if i == 0 else 30.0 + 20.0 * (i % 5) / 4,
                    decode_ms=20.0)  # fmt: skip
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert "Cold start" not in text, text


def test_one_long_prompt_among_decoders_is_the_stall_it_is(tmp_path: Path) -> None:
    """Four decoders whose steps cost the same whatever the batch, then one 1,400-token prompt
    whose prefill takes 420 ms: named as the stall, with the request, not as a step slow for
    its shape (the refit keeps the one step that prices a prefill token)."""
    tr = _four_decoders(output=60, prefill_ms=12.0, steps=25, step_ms=11.0)
    tr.request("long", (tr.now - T0) / MS, prompt=1400, output=4)
    tr.step({**{f"d{i}": 1 for i in range(4)}, "long": 1400}, 420.0)
    _to_end(tr, lambda _: 11.0 + 2.0 * (len(tr.steps) % 3))
    _, text = _diagnosed(tr, tmp_path)
    assert "-token prefill chunk of long stalled 4 decoding requests" in text, text
    assert "3x the time expected" not in text, text


def test_a_core_stopped_in_a_short_chunks_step_is_a_stall_of_the_core(tmp_path: Path) -> None:
    """Decoders at 38 ms a step, a prefill token priced at 1.4 ms (a 200-token prompt), then a
    16-token prompt's step of 330 ms: its prefill is priced at 22 ms, so at most about 250 ms is
    the prefill's however its price errs; the rest is the core stopping (a 242 ms SIGSTOP of
    Gemma 3's core in the generated matrix read as that chunk stalling 3 decoders)."""
    tr = _four_decoders(output=60, prefill_ms=50.0, steps=25, step_ms=38.0)
    tr.request("long", (tr.now - T0) / MS, prompt=200, output=4)
    tr.step({**{f"d{i}": 1 for i in range(4)}, "long": 200}, 38.0 + 280.0)
    for k in range(6):
        tr.step({r: 1 for r, q in tr.reqs.items() if q.status is None}, 38.0 + (k % 3))
    tr.request("short", (tr.now - T0) / MS, prompt=16, output=4)
    tr.step({**{r: 1 for r, q in tr.reqs.items() if q.status is None}, "short": 16}, 330.0)
    _to_end(tr, lambda _: 38.0 + 2.0 * (len(tr.steps) % 3))
    run, text = _diagnosed(tr, tmp_path)
    assert "chunk of short stalled" not in text, text
    d0 = next(r for r in run.requests if r.request_id == "d0")
    assert d0.decode["core_stall"] >= 200 * MS, d0.decode


@pytest.mark.parametrize("prior", [False, True], ids=["no-prior", "warm-up-prior"])
def test_short_prompts_are_priced_by_the_warm_up(tmp_path: Path, prior: bool) -> None:
    """Prompts of 40 tokens, too short for the run to price a prefill token: with the warm-up's
    prior (0.29 ms a token) a request's own prefill is priced by it, and the report says the
    price rests on the prior; without one, the prefill's price is 0."""
    tr = Trace()
    if prior:
        tr.step_prior = [10.0 * MS, 0.29 * MS, 0.3 * MS]
    for i in range(16):
        at = i * 300.0
        tr.request(f"r{i}", at, prompt=40, output=6)
        serve_alone(tr, f"r{i}", at + 2, prefill_ms=10.0 + 0.29 * 40 + 0.1 * (i % 3),
                    decode_ms=10.3 + 0.1 * (i % 3))  # fmt: skip
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = render_run(run)
    print(text)
    assert ("priced from the warm-up (290 us a token" in text) == prior, text
    assert "Nothing stands out" in text, text


def test_the_sampler_of_the_step_in_flight_is_the_samplers_not_the_prefills(
    tmp_path: Path,
) -> None:
    """Penalty rows join with their prompts (187 and 277 tokens) in a 39.5 ms step whose
    sampler took 26.8 ms, and a request is sent 10 ms into it (seed 1200005 of the generated
    matrix): its wait is the sampler's where the sampler ran, and other requests' prefill only
    over the forward (it had read 28.8 ms of other requests' prefill, named as the cause)."""
    tr = Trace()
    for i in range(2):
        tr.request(f"d{i}", 0.0, prompt=8, output=400)
    tr.step({"d0": 8, "d1": 8}, 2.0)
    for k in range(40):
        tr.step({"d0": 1, "d1": 1}, 1.0 + 0.1 * (k % 3))  # greedy: the fused head, no sampler
    tr.request("L0", (tr.now - T0) / MS, prompt=187, output=300)
    tr.request("L1", (tr.now - T0) / MS, prompt=277, output=300)
    _sent_during(tr, "s", 39.5, {"d0": 1, "d1": 1, "L0": 187, "L1": 277}, sample_ms=26.8)
    k = 0
    while any(r.status is None for r in tr.reqs.values()):
        live = {r: 1 for r, q in tr.reqs.items() if q.status is None}
        live["s"] = 16 if k == 0 else live.get("s", 0)  # its prompt whole, then decode
        tr.step({r: n for r, n in live.items() if n}, 28.0 + 0.5 * (k % 3),
                sample_ms=25.0 + 0.5 * (k % 3))  # fmt: skip
        k += 1
    run, text = _diagnosed(tr, tmp_path)
    s = next(r for r in run.requests if r.request_id == "s")
    assert s.ttft["neighbour_prefill"] <= 12.7 * MS and s.ttft["sampling"] >= 26 * MS, s.ttft
    named = {f.part for f in run.findings if f.kind in ("cause", "paid")}
    assert "neighbour_prefill" not in named, text
    # The sampler is named in both phases: the headline says which is which.
    assert "the slow tail, before the first token" in " ".join(text.split()), text


@pytest.mark.parametrize("record", ["cpu", "gc", "none"])
def test_steps_slowed_beside_the_busy_api_process_are_its_cpu(tmp_path: Path, record: str) -> None:
    """Four decoders at 10 ms a step; for 400 ms the steps take 20 ms (2x: no outlier), one of
    them 80 ms (8x: a stall), while the API process used a core (its pauses row of kind cpu, as
    service/monitor.py records it): what the steps lost is the API process's CPU in each
    request, and the run and its steps name the API process. Where that busy stretch was the
    API process collecting garbage (gc rows inside it: seed 1400118, a 290 ms storm of 50 ms
    collections), what they lost is its GC, not its CPU. Without the row, the same slow steps
    stay decode compute, and the 80 ms one the core stalling."""
    tr = _four_decoders(output=120, prefill_ms=12.0, steps=40, step_ms=10.0)
    at = (tr.now - T0) / MS
    if record != "none":
        tr.pause("api", "cpu", at, 400.0, cpu_ms=390.0)
    if record == "gc":
        for k in range(8):
            tr.pause("api", "gc", at + 50.0 * k, 49.0)

    def step_ms(_: int) -> float:
        if (tr.now - T0) / MS >= at + 400.0:
            return 10.0 + 0.5 * (len(tr.steps) % 3)
        return 80.0 if len(tr.steps) == 50 else 20.0

    _to_end(tr, step_ms)
    run, text = _diagnosed(tr, tmp_path)
    said = " ".join(text.split())
    d0 = next(r for r in run.requests if r.request_id == "d0")
    if record == "cpu":
        assert d0.decode["api_cpu"] >= 200 * MS and d0.decode["core_stall"] < MS, d0.decode
        assert "the API process was busy on CPU in them" in said, text
    elif record == "gc":
        assert d0.decode["gc"] >= 200 * MS and d0.decode["api_cpu"] < 10 * MS, d0.decode
        named = {f.part for f in run.findings if f.kind in ("cause", "paid")}
        assert "api_cpu" not in named and "gc" in named, text
    else:
        assert d0.decode["api_cpu"] == 0 and d0.decode["core_stall"] >= 50 * MS, d0.decode
        assert "the core stalled in them" in said, text


@pytest.mark.parametrize("slow", ["joining", "later"])
def test_rows_joining_the_decode_mirror_after_a_long_prefill_are_the_prefills_cost(
    tmp_path: Path, slow: str
) -> None:
    """Four decoders; two prompts of 716 and 949 tokens prefilled in one 2.9 s step (1.7 ms a
    token, as SmolLM2's on 2 cores), then a step of 100 ms (recorded: 87 ms against 22, seed
    1400133). Where it is the two new rows' first decode, their 1,665 tokens of context copied
    into the decode mirror, it is their prefill's cost, not the core stalling. The same step
    two steps later, with no row joining, is a stall."""
    tr = _four_decoders(output=60, prefill_ms=30.0, steps=12, step_ms=20.0)
    tr.step_prior = [18.0 * MS, 1.7 * MS, 0.5 * MS]
    tr.request("p0", 290.0, prompt=716, output=2)
    tr.request("p1", 290.0, prompt=949, output=2)
    live = {f"d{i}": 1 for i in range(4)}
    tr.step({**live, "p0": 716, "p1": 949}, 2900.0)
    first = 100.0 if slow == "joining" else 22.0
    tr.step({**live, "p0": 1, "p1": 1}, first)
    tr.step(live, 20.0)
    tr.step(live, 20.0 if slow == "joining" else 100.0)
    _to_end(tr, lambda rows: 20.0)
    _, text = _diagnosed(tr, tmp_path)
    stalled = "took at least 3x" in text and "the core stalled" in text
    assert stalled == (slow == "later"), text


@pytest.mark.parametrize(
    ("lag_ms", "stream", "named"),
    [(25.0, True, False), (70.0, True, True), (70.0, False, False)],
    ids=["within-the-step", "past-it", "past-it-not-streamed"],
)
def test_a_requests_way_in_is_its_cost_only_where_it_delayed_what_its_client_saw(
    tmp_path: Path, lag_ms: float, stream: bool, named: bool
) -> None:
    """Four decoders at 40 ms a step; a request arrives 5 ms into a step and the API process's
    event loop lags for ``lag_ms`` before it is sent (a large body parsed beside it). Within the
    step, it would have waited for that step's end however fast its way in (seed 1400039: a
    17 ms lag named although the client's TTFT moved 4 ms): that is the step's wait. Past the
    step, it missed the next one's start by 35 ms: named. Not streamed, its client sees only
    its 2.5 s response, of which 35 ms is not 10% (seed 1400026: a 26 ms parse named in a
    1.3 s response): not named."""
    tr = _four_decoders(output=70, prefill_ms=30.0, steps=4, step_ms=40.0)
    live = {f"d{i}": 1 for i in range(4)}
    at = (tr.now - T0) / MS + 0.1  # the next step's start (the builder's 0.1 ms between)
    tr.request("s", at + 5.0, prompt=16, output=60, frontend_ms=lag_ms, stream=stream)
    tr.pause("api", "loop_lag", at + 5.2, lag_ms)
    for _ in range(1 if lag_ms < 40.0 else 2):
        tr.step(live, 40.0)
    tr.reqs["s"].received = tr.now + MS // 10  # read by the core when the step's outputs are out
    tr.step({**live, "s": 16}, 40.0)
    _to_end(tr, lambda rows: 40.0)
    run, text = _diagnosed(tr, tmp_path)
    s = next(r for r in run.requests if r.request_id == "s")
    why = " ".join(" ".join(explain(s, run)).split())
    print(why)
    ttft = s.ttft
    assert (ttft["loop_lag"] >= 30 * MS) == (lag_ms > 40.0), ttft
    if lag_ms < 40.0:
        assert ttft["step_in_flight"] >= 30 * MS, ttft
    said = {f.part for f in run.findings if f.kind in ("cause", "paid")}
    assert ("loop_lag" in said or "event-loop lag" in why) == named, (text, why)


def test_a_wait_for_a_step_slowed_beside_the_busy_api_process_is_its_cpu(tmp_path: Path) -> None:
    """Four decoders at 10 ms a step, then steps of 20 ms while the API process used a core
    (seed 3100002: a 1 MB body parsed beside a 62 ms step of four decode rows); a request sent
    1 ms into one of them waits for it at the core: the half of that wait past the step's
    expected time is the API process's CPU, not the step in flight's."""
    tr = _four_decoders(output=60, prefill_ms=12.0, steps=30, step_ms=10.0)
    live = {f"d{i}": 1 for i in range(4)}
    at = (tr.now - T0) / MS
    tr.pause("api", "cpu", at, 200.0, cpu_ms=190.0)
    for _ in range(4):
        tr.step(live, 20.0)
    tr.request("s", (tr.now - T0) / MS + 1.0, prompt=16, output=20)
    tr.step(live, 20.0)
    tr.reqs["s"].received = tr.now + MS // 10
    tr.step({**live, "s": 16}, 20.0)
    _to_end(tr, lambda rows: 10.0)
    run, _ = _diagnosed(tr, tmp_path)
    s = next(r for r in run.requests if r.request_id == "s")
    # (its own 20 ms step, beside the busy process too, lost 10 ms to it)
    assert s.ttft["api_cpu"] >= 16 * MS and s.ttft["step_in_flight"] <= 13 * MS, s.ttft
