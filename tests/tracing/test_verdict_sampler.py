"""What a row's sampling settings cost the requests beside it, named: the sampler's time with
the settings its rows paid for (a grammar, logprobs), the full logits priced a step and a row
(not as the model's decode), and a grammar's compile as its own cost."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers.trace_builder import MS, T0, Trace
from tracing.diagnose import diagnose_run, render_run


def test_the_sampler_names_the_settings_its_rows_paid_for(tmp_path: Path) -> None:
    """Four streams, all under a grammar: the sampler's time is named with the grammar, not a
    list of what might take the full logits."""
    tr = Trace()
    schema = {"temperature": 0}
    for i in range(4):
        tr.request(f"g{i}", 0.0, prompt=16, output=30, grammar="json_schema", params=schema)
    tr.step({f"g{i}": 16 for i in range(4)}, 8.0, sample_ms=6.0)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({r.rid: 1 for r in tr.reqs.values() if r.status is None}, 9.0, sample_ms=6.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    named = [f for f in run.findings if f.part == "sampling" and f.kind in ("cause", "paid")]
    assert named and "for rows with a grammar (json_schema) in 4 requests" in named[0].text


def test_the_full_logits_cost_is_the_samplers_not_the_models(tmp_path: Path) -> None:
    """Four greedy streams (10 ms steps on the fused greedy head), then four under a grammar
    (16 ms steps: every row takes the full logits, 1 ms of sampler): the fit prices a row on
    the full logits, and what it costs their steps is the sampler's, named with the grammar,
    not the model's decode."""
    tr = Trace()
    for i in range(4):
        tr.request(f"p{i}", 0.0, prompt=16, output=30, params={"temperature": 0})
        tr.request(f"g{i}", 1000.0, prompt=16, output=30, grammar="json_schema",
                   params={"temperature": 0})  # fmt: skip
    for group, at, exec_ms, sample_ms in (("p", 0.0, 10.0, 0.0), ("g", 1000.0, 16.0, 1.0)):
        ids = [f"{group}{i}" for i in range(4)]
        tr.step({rid: 16 for rid in ids}, exec_ms, at_ms=at + 1, sample_ms=sample_ms)
        while any(tr.reqs[rid].status is None for rid in ids):
            tr.step({rid: 1 for rid in ids if tr.reqs[rid].status is None}, exec_ms,
                    sample_ms=sample_ms)  # fmt: skip
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    named = [f for f in run.findings if f.part == "sampling"]
    assert named and "for rows with a grammar (json_schema) in 4 requests" in named[0].text, text
    g = next(r for r in run.requests if r.request_id == "g0")
    p = next(r for r in run.requests if r.request_id == "p0")
    assert g.decode["sampling"] > 4 * MS * 25 and p.decode["sampling"] == 0


@pytest.mark.parametrize("prior_f", [True, False], ids=["warm-up-prices-it", "older-prior"])
def test_full_logits_in_every_step_are_priced_by_the_warm_up(tmp_path: Path, prior_f: bool) -> None:
    """Two streams together, one under a grammar, so every step takes the full logits (as
    Gemma 3's 262,144-token head does, 7 ms a row over its greedy head): the run holds no step
    to price the difference against. The warm-up's prior does, and the cost is the sampler's,
    named with the grammar; an older store's prior (no f) leaves it in the model's decode."""
    tr = Trace()
    tr.step_prior = [20.0 * MS, 0.05 * MS, 0.5 * MS] + ([7.0 * MS] if prior_f else [])
    tr.request("g", 0.0, prompt=16, output=40, grammar="json_schema",
               params={"temperature": 0})  # fmt: skip
    tr.request("p", 0.0, prompt=16, output=40, params={"temperature": 0})
    tr.step({"g": 16, "p": 16}, 22.0, sample_ms=0.3)
    while any(r.status is None for r in tr.reqs.values()):
        k = len(tr.steps) % 3
        tr.step({"g": 1, "p": 1}, 35.0 + 0.5 * k, sample_ms=0.3)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    named = [f for f in run.findings if f.part == "sampling" and f.kind in ("cause", "paid")]
    if prior_f:
        assert named and "for rows with a grammar (json_schema)" in named[0].text, text
        g = next(r for r in run.requests if r.request_id == "g")
        assert g.decode["sampling"] > 10 * MS * 39, g.decode
    else:
        assert not named, text


def test_the_full_logits_extra_is_a_steps_not_each_rows(tmp_path: Path) -> None:
    """Five streams, all with logprobs, so every step takes the full logits. The warm-up priced
    that path at 1.5 ms a step and 0.1 ms a row over the greedy head (SmolLM2: 1.5 ms at 1 row,
    2.2 ms at 16): the run's steps pay 2 ms of it (8%: not named), the sampler's share, and
    the rest of their time is the model's decode. Priced per row alone (1.6 ms a row at 1 row),
    5 rows would read 8 ms of sampling in a 25 ms step and name the sampler for what the
    model did."""
    tr = Trace()
    tr.step_prior = [20.0 * MS, 0.05 * MS, 0.5 * MS, 0.1 * MS, 1.5 * MS]
    ids = [f"r{i}" for i in range(5)]
    for rid in ids:
        tr.request(rid, 0.0, prompt=16, output=40, params={"temperature": 0, "logprobs": 1})
    tr.step({rid: 16 for rid in ids}, 30.0, sample_ms=0.2)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({rid: 1 for rid in ids}, 25.0 + 0.2 * (len(tr.steps) % 3), sample_ms=0.2)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    text = " ".join(render_run(run).split())
    print(text)
    assert not [f for f in run.findings if f.part == "sampling" and f.kind in ("cause", "paid")]
    r0 = next(r for r in run.requests if r.request_id == "r0")
    per_token = r0.decode["sampling"] / 39 / MS
    print(f"sampling {per_token:.2f} ms a token")
    assert 1.8 < per_token < 2.8, per_token


def test_a_grammar_compiled_during_a_step_waits_for_it_as_the_grammar_s_cost(
    tmp_path: Path,
) -> None:
    """A request under a grammar reaches the core as a 30 ms step begins; its grammar compiles
    in 2 ms, but it can join only the next step. Had it compiled at once, it would have run in
    that step: the wait is the grammar's, not a queue held by no limit."""
    tr = Trace()
    for i in range(2):
        tr.request(f"d{i}", 0.0, prompt=8, output=12)
    tr.step({"d0": 8, "d1": 8}, 20.0)
    tr.step({"d0": 1, "d1": 1}, 30.0)
    at = (tr.now - T0) / MS - 1.4  # received as the next step begins
    tr.request("g", at, prompt=8, output=4, grammar="json_schema", params={"temperature": 0})
    tr.reqs["g"].grammar_ready = tr.reqs["g"].received + 2 * MS
    tr.step({"d0": 1, "d1": 1}, 30.0)
    tr.step({"d0": 1, "d1": 1, "g": 8}, 30.0)
    while any(r.status is None for r in tr.reqs.values()):
        tr.step({r.rid: 1 for r in tr.reqs.values() if r.status is None}, 30.0)
    run = diagnose_run(tr.write(tmp_path / "t.db"))
    g = next(r for r in run.requests if r.request_id == "g")
    print(g.ttft)
    assert g.ttft["grammar_compile"] > 28 * MS and g.ttft["queue"] < 2 * MS, g.ttft
