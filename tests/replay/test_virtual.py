"""`replay run --virtual`: the real scheduler on a simulated clock; identical every run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from replay.cli import main
from replay.virtual import StepCostModel


def _trace(tmp_path: Path) -> Path:
    """40 requests in bursts, sharing prefixes, as a Mooncake file, imported."""
    lines = []
    for i in range(40):
        hashes = [0, 1 + i % 4, 100 + i]  # a shared first block, four shared second blocks
        lines.append({"timestamp": (i // 8) * 1000, "input_length": 1400, "output_length": 400,
                      "hash_ids": hashes})  # fmt: skip
    src = tmp_path / "burst.jsonl"
    src.write_text("".join(json.dumps(x) + "\n" for x in lines))
    db = tmp_path / "burst.db"
    args = ["import", str(src), "--format", "mooncake", "--out", str(db), "--scale-lengths", "0.25"]
    assert main(args) == 0
    return db


def _cost(tmp_path: Path) -> Path:
    path = tmp_path / "cost.json"
    StepCostModel(0.02, 0.0004, 0.0015, 0.0002).save(path)
    return path


def _virtual(db: Path, cost: Path, out: Path, *extra: str) -> dict:
    args = ["run", str(db), "--virtual", "--cost-model", str(cost), "--json", str(out), *extra]
    assert main(args) == 0
    return json.loads(out.read_text())


def test_virtual_reports_are_identical(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    db, cost = _trace(tmp_path), _cost(tmp_path)
    capsys.readouterr()
    a = _virtual(db, cost, tmp_path / "a.json", "--num-kv-blocks", "512")
    first = capsys.readouterr().out
    b = _virtual(db, cost, tmp_path / "b.json", "--num-kv-blocks", "512")
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    assert capsys.readouterr().out == first
    print(first)
    assert a == b and a["num_requests"] == 40 and a["ttft_s"]["p99"] > a["ttft_s"]["p50"]


def test_what_if_a_smaller_kv_pool_preempts_more(tmp_path: Path) -> None:
    db, cost = _trace(tmp_path), _cost(tmp_path)
    roomy = _virtual(db, cost, tmp_path / "roomy.json", "--num-kv-blocks", "1024")
    tight = _virtual(db, cost, tmp_path / "tight.json", "--num-kv-blocks", "48")
    print(f"\npreemptions: {roomy['num_preemptions']} with 1024 blocks, "
          f"{tight['num_preemptions']} with 48")  # fmt: skip
    assert roomy["num_preemptions"] == 0 < tight["num_preemptions"]
    assert tight["e2e_s"]["p99"] > roomy["e2e_s"]["p99"]
    # A smaller token budget: more steps for the same work.
    small = _virtual(db, cost, tmp_path / "small.json", "--num-kv-blocks", "1024",
                     "--max-num-batched-tokens", "128")  # fmt: skip
    assert small["num_steps"] > roomy["num_steps"]


def test_a_stream_interval_makes_the_virtual_itl_the_gap_between_writes(tmp_path: Path) -> None:
    """--stream-interval 4: the first token, then every 4th and the last are written, so the
    virtual run's ITL is the gap between those writes, as a real run's is; TTFT, TPOT and the
    steps are the same run's."""
    db, cost = _trace(tmp_path), _cost(tmp_path)
    every = _virtual(db, cost, tmp_path / "1.json", "--num-kv-blocks", "512")
    held = _virtual(db, cost, tmp_path / "4.json", "--num-kv-blocks", "512",
                    "--stream-interval", "4")  # fmt: skip
    for key in ("ttft_s", "tpot_s", "e2e_s", "num_steps"):
        assert held[key] == every[key], key
    ratio = held["itl_s"]["p50"] / every["itl_s"]["p50"]
    a, b = every["itl_s"]["p50"] * 1e3, held["itl_s"]["p50"] * 1e3
    print(f"\nITL p50 {a:.2f} ms a token, {b:.2f} ms a write of 4 ({ratio:.2f}x)")
    assert 3.5 < ratio < 4.5


def test_calibration_fits_measured_steps(tmp_path: Path) -> None:
    from tracing.store import TraceStore, row

    db = tmp_path / "steps.db"
    store = TraceStore(db)
    rows = []
    for i in range(40):
        prefill, decode, reqs = (i * 37) % 500, i % 16, 1 + i % 9
        ns = int((0.01 + prefill * 2e-4 + decode * 1e-3 + reqs * 5e-4) * 1e9)
        rows.append(row(
            "steps", run_id="r", step_id=i, schedule_start_ns=1000, schedule_end_ns=0,
            execute_start_ns=0, execute_end_ns=0, output_ns=1000 + ns, num_running=reqs,
            num_waiting=0, num_scheduled_tokens=prefill + decode, num_prefill_tokens=prefill,
            num_decode_tokens=decode, num_preemptions=0, kv_blocks_used=0, kv_blocks_total=0,
            prefix_query_tokens=0, prefix_hit_tokens=0, request_ids=["x"] * reqs,
            num_scheduled=[1] * reqs, preempted_request_ids=[],
        ))  # fmt: skip
    store.add("steps", rows)
    assert store.flush()
    cost = StepCostModel.calibrate(db)
    assert cost.base_s == pytest.approx(0.01, rel=1e-3)
    assert cost.prefill_token_s == pytest.approx(2e-4, rel=1e-3)
    assert cost.decode_token_s == pytest.approx(1e-3, rel=1e-3)
    assert cost.request_s == pytest.approx(5e-4, rel=1e-3)
    assert cost.num_steps == 39  # the empty step is left out


def test_the_cost_model_prices_context_and_reports_its_fit(tmp_path: Path) -> None:
    """Decode steps whose rows read longer and longer contexts: the fit finds the price of a
    context token, says how well it fits, and what range of steps it saw."""
    from tracing.store import TraceStore, row

    db = tmp_path / "ctx.db"
    store = TraceStore(db)
    price = {"base": 0.005, "decode": 4e-4, "context": 2e-6}
    rows, step = [], 0
    for wave in range(6):  # waves of 2..12 requests: a 64-token prefill, then 40 decodes
        ids = [f"w{wave}-{j}" for j in range(2 + 2 * wave)]
        for k in range(41):
            n = 64 if k == 0 else 1
            context = 0 if n > 1 else sum(64 + k for _ in ids)
            prefill = n * len(ids) if n > 1 else 0
            decode = 0 if n > 1 else len(ids)
            seconds = price["base"] + decode * price["decode"] + context * price["context"]
            seconds += prefill * 1e-4
            rows.append(row(
                "steps", run_id="r", step_id=step, schedule_start_ns=0,
                output_ns=int(seconds * 1e9),
                num_scheduled_tokens=prefill + decode, num_prefill_tokens=prefill,
                num_decode_tokens=decode, request_ids=ids, num_scheduled=[n] * len(ids),
                preempted_request_ids=[],
            ))  # fmt: skip
            step += 1
    store.add("steps", rows)
    assert store.flush()
    store.close()
    cost = StepCostModel.calibrate(db)
    print("\n" + cost.describe() + "\n" + cost.describe_fit())
    # Every row of a step reads as long a context here: the price splits between the context
    # and the padded width (rows x the longest context) alike.
    assert cost.context_token_s + cost.padded_context_s == pytest.approx(price["context"], rel=0.05)
    # Every decode row decodes one token here: the price splits between the two terms.
    assert cost.decode_token_s + cost.request_s == pytest.approx(price["decode"], rel=0.05)
    assert cost.fit["r2"] > 0.99 and cost.fit["err_p90"] < 0.02
    assert cost.fit["covers"]["rows"] == 12
    assert "R² " in cost.describe_fit() and "covers steps of up to 12 rows" in cost.describe_fit()
    # A what-if with bigger batches than it saw says that it extrapolates.
    path = tmp_path / "cost.json"
    cost.save(path)
    assert StepCostModel.load(path) == cost
    out = _virtual(_trace(tmp_path), path, tmp_path / "v.json", "--max-num-seqs", "40")
    assert out["num_steps"] > 0


def test_a_what_if_beyond_the_fitted_range_says_it_extrapolates(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    fitted = StepCostModel(0.02, 0.0004, 0.0015, 0.0002, fit={
        "r2": 0.9, "err_p50": 0.05, "err_p90": 0.1, "err_p99": 0.2, "num_steps": 100,
        "covers": {"rows": 4, "prefill_tokens": 256, "decode_tokens": 4, "context_per_row": 300},
    })  # fmt: skip
    path = tmp_path / "cost.json"
    fitted.save(path)
    _virtual(_trace(tmp_path), path, tmp_path / "v.json", "--num-kv-blocks", "1024")
    printed = capsys.readouterr().out
    print(printed)
    assert "EXTRAPOLATED: the run held" in printed and "(the fit saw at most 4)" in printed


def test_capacity_is_the_edge_of_the_targets(tmp_path: Path) -> None:
    import numpy as np

    from engine.config import EngineConfig
    from replay.capacity import Target, figures_of, find_capacity, meets
    from replay.virtual import run_virtual
    from replay.workload import load_workload

    _, work = load_workload(str(_trace(tmp_path)), vocab=np.arange(1, 32000))
    cost = StepCostModel(0.02, 0.0004, 0.0015, 0.0002)
    config = EngineConfig(num_kv_blocks=1024, max_model_len=4096)
    targets = [Target.parse("ttft:p90:1"), Target.parse("e2e:p90:9.5")]
    cap = find_capacity(work, config, cost, targets)
    print(f"\ncapacity: {cap.speed:.2f}x the recorded {cap.recorded_rate:.2f} req/s")
    assert cap.speed > 0 and cap.rate == pytest.approx(cap.speed * cap.recorded_rate)

    def at(speed: float) -> bool:
        return meets(figures_of(run_virtual(work, config, cost, speed=speed).to_json()), targets)

    assert at(cap.speed) and not at(cap.speed * 1.1)
    with pytest.raises(ValueError, match="METRIC:PERCENTILE:SECONDS"):
        Target.parse("ttft:2")
    with pytest.raises(ValueError, match="p50, p90 or p99"):
        Target.parse("ttft:p95:2")
