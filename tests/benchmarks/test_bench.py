"""`lumen bench`: each subcommand runs end to end on the tiny model and writes its ratios.

Speed is not asserted here (that is what the benchmarks report); these tests
check that each benchmark measures what it says: the FLOP count of a run,
exact output lengths on every system, no failed request, ratio keys in JSON.
"""

from __future__ import annotations

import importlib.util
import json
import time
from pathlib import Path
from typing import Any

import pytest

from bench.roofline import FlopCounter
from engine import SamplingParams
from engine.model_config import ModelConfig
from tests.helpers.bench import bench_json, lumen_bench, lumen_bench_refused, ratio_keys


def test_flop_counter_counts_every_token_of_a_run(tiny_llm, tiny_model_path: Path) -> None:
    """Step records cover the whole run: FLOPs equal the count from the requests alone."""
    cfg = ModelConfig.from_path(tiny_model_path)
    prompts = [[5 + i] * n for i, n in enumerate((3, 17, 40, 9))]
    outputs = [4, 9, 1, 12]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in outputs]
    tiny_llm.reset_prefix_cache()
    tiny_llm.step_log = []
    t0 = time.perf_counter()
    tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    steps, tiny_llm.step_log = tiny_llm.step_log, None

    counter = FlopCounter(cfg)
    for step, sampled in steps:
        counter.add(step, sampled)
    # Each request computes its prompt and all but its last output token;
    # the token at position k attends to k + 1 tokens; each output is one LM-head row.
    computed = [len(p) + n - 1 for p, n in zip(prompts, outputs)]
    expected = (
        sum(computed) * counter.token_flops
        + sum(outputs) * counter.head_flops
        + sum(c * (c + 1) // 2 for c in computed) * counter.attn_flops
    )
    assert counter.tokens == sum(computed)
    assert counter.flops == expected
    assert 0 < counter.model_seconds <= wall
    print(f"{counter.steps} steps, {counter.flops / 1e6:.1f} MFLOP, "
          f"model {counter.model_seconds:.3f} s of {wall:.3f} s")  # fmt: skip


def test_scheduler_bench(tmp_path: Path) -> None:
    out = tmp_path / "sched.json"
    r = lumen_bench("scheduler", "--sizes", "16,64", "--steps", "20", "--json", str(out))
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert [s["running"] for s in doc["sizes"]] == [16, 64]
    assert all(s["us_per_request"] > 0 for s in doc["sizes"])
    assert {"target_ratio_at_256", "per_request_growth_ratio"} <= set(ratio_keys(doc))
    print(r.stdout)


def test_mfu_bench(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "mfu.json"
    r = lumen_bench(
        "mfu", "--model", str(tiny_model_path), "--num-requests", "4",
        "--decode-batches", "1,16", "--decode-contexts", "32", "--rounds", "2",
        "--num-kv-blocks", "256", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    assert doc["rounds"] == 2
    assert doc["ceiling_flops"] > 0 and doc["achieved_flops"] > 0
    assert 0 < doc["model_time_ratio"] <= 1
    assert doc["mfu_ratio"] == pytest.approx(doc["achieved_flops"] / doc["ceiling_flops"])
    assert doc["decode_b16_ctx32_over_weights_pass_ratio"] > 0
    # The floor adds the KV read to the weights pass, so a step is closer to it.
    for d in doc["decode"]:
        assert d["kv_pass_s"] > 0
        assert 0 < d["floor_ratio"] < d["ratio"]
    print(r.stdout)


def test_prefill_bench_times_both_sides_interleaved(tmp_path: Path, tiny_model_path: Path) -> None:
    stdout, doc = bench_json(
        tmp_path, "prefill", "--model", str(tiny_model_path), "--lengths", "40,300",
        "--budgets", "64,512", "--rounds", "3",
    )  # fmt: skip
    assert set(doc["all_s"]) == {"hf", "lumen_64", "lumen_512"}
    for side in doc["all_s"].values():
        assert {n: len(v) for n, v in side.items()} == {"40": 3, "300": 3}
    assert doc["ratio"]["lumen_64"]["300"] == pytest.approx(
        doc["median_s"]["lumen_64"]["300"] / doc["median_s"]["hf"]["300"]
    )
    print(stdout)


def test_throughput_bench_runs_every_system(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "tp.json"
    r = lumen_bench(
        "throughput", "--model", str(tiny_model_path), "--num-requests", "6",
        "--prompt-lens", "16,128", "--output-lens", "8,48",
        "--hf-batch-sizes", "2,4", "--num-kv-blocks", "256", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    # Every system delivered the workload's exact output lengths (each run checks).
    assert [h["batch_size"] for h in doc["hf_generate"]] == [2, 4]
    assert doc["workload"]["output_len_range"] == [8, 48]
    assert 6 * 8 <= doc["lumen"]["output_tokens"] <= 6 * 48
    assert doc["hf_generate_batch"]["output_tokens"] == doc["lumen"]["output_tokens"]
    best = min(doc["hf_generate"], key=lambda h: h["seconds"])
    assert doc["hf_generate_best"] == best["system"]
    assert doc["throughput_ratio_vs_hf_generate_best"] == pytest.approx(
        doc["lumen"]["output_tok_s"] / best["output_tok_s"]
    )
    assert doc["throughput_ratio_vs_hf_generate_batch"] > 0
    print(r.stdout)


@pytest.mark.parametrize(
    "args, message",
    [
        (("throughput", "--hf-batch-sizes", "16,x"), "--hf-batch-sizes takes comma-separated"),
        (("throughput", "--output-lens", "64,8"), "--output-lens takes MIN,MAX with MIN <= MAX"),
        (("scheduler", "--sizes", "0"), "--sizes takes integers >= 1"),
        (("serve", "--rates", "-1"), "--rates must be positive"),
        (("mfu", "--json", "/nonexistent-folder/x.json"), "does not exist"),
        (("mfu", "--rounds", "0"), "--rounds must be at least 1, got 0"),
        (("overhead", "--streams", "16,0"), "--streams takes integers >= 1"),
        (("structured", "--rounds", "0"), "must be >= 1"),
        (("serve", "--kv-tokens", "0"), "--kv-tokens: must be >= 1, not 0"),
        (("overhead", "--kv-tokens", "many"), "--kv-tokens: takes an integer, not 'many'"),
    ],
)
def test_bad_input_is_one_clear_line(args: tuple[str, ...], message: str) -> None:
    code, stderr = lumen_bench_refused(*args)
    assert code == 2, stderr
    assert message in stderr and "Traceback" not in stderr


def test_precision_bench_compares_each_dtype_with_fp32(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    stdout, doc = bench_json(
        tmp_path, "precision", "--model", str(tiny_model_path), "--dtypes", "bfloat16",
        "--kv-cache-dtypes", "bfloat16", "--quantizations", "int4", "--max-tokens", "4",
    )  # fmt: skip
    fp32, bf16 = doc["results"]["float32"], doc["results"]["bfloat16"]
    int4 = doc["results"]["float32, int4 weights"]
    # 4-bit weights round: their logits and perplexity move, and both are reported.
    assert int4["max_logit_diff"] > 0 and 0 <= int4["top1_agreement"] <= 1
    assert int4["perplexity"] > 1 and fp32["perplexity"] > 1
    assert int4["perplexity"] != fp32["perplexity"]
    # A bf16 KV under an fp32 model: the prompt's logits come from its own prefill step, the
    # outputs' from decode steps that read the cache, so only a narrowed cache makes them differ.
    assert doc["results"]["float32, KV bfloat16"]["max_logit_diff"] > 0
    assert "float32_kv_bfloat16_decode_speedup_ratio" in doc
    # float32 against itself is exact; bfloat16 rounds, so its logits differ.
    assert fp32["exact_outputs"] == fp32["top1_agreement"] == 1.0
    assert fp32["max_logit_diff"] == 0.0
    assert bf16["max_logit_diff"] > 0
    assert 0 <= bf16["top1_agreement"] <= 1
    assert doc["float32_decode_speedup_ratio"] == 1.0
    print(stdout)


def test_precision_bench_refuses_an_unknown_dtype() -> None:
    code, stderr = lumen_bench_refused("precision", "--dtypes", "int4")
    assert code != 0
    assert "int4 not one of float32, bfloat16, float16" in stderr
    code, stderr = lumen_bench_refused("precision", "--kv-cache-dtypes", "fp8_e5m2")
    assert code != 0
    assert "--kv-cache-dtypes: fp8_e5m2 not one of" in stderr


def test_one_stream_bench_states_each_system_against_its_floor(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    stdout, doc = bench_json(
        tmp_path, "one-stream", "--model", str(tiny_model_path), "--quantizations", "none,int4",
        "--max-tokens", "8", "--repeats", "1",
    )  # fmt: skip
    print(stdout)
    fp32, int4 = doc["rows"][:2]
    assert (fp32["system"], int4["system"]) == ("lumen fp32", "lumen int4")
    assert int4["bytes_per_token"] < fp32["bytes_per_token"] / 3  # 6 bits a weight, not 32
    for row in doc["rows"]:
        assert row["tok_s"] > 0 and row["floor_tok_s"] > 0
        assert row["share_of_floor"] == row["tok_s"] / row["floor_tok_s"]
    if importlib.util.find_spec("llama_cpp") is None:
        assert "llama.cpp: not run (llama-cpp-python is not installed" in stdout
        assert len(doc["rows"]) == 2


def test_one_stream_bench_survives_a_llama_cpp_that_faults(monkeypatch: pytest.MonkeyPatch) -> None:
    """A native llama.cpp build can fault on a CPU that does not grant what it was built for
    (AMX tiles in a VM): it runs in its own process, and the bench says what killed it."""
    from bench import one_stream

    monkeypatch.setattr(one_stream, "_CHILD", "import os, signal; os.kill(os.getpid(), 11)")
    tok_s, failure = one_stream._llama_cpp_child(Path("model.gguf"), 8, 1)
    assert tok_s == 0.0 and failure.startswith("its process died of SIGSEGV")
    monkeypatch.setattr(one_stream, "_CHILD", "print(123.5)")
    assert one_stream._llama_cpp_child(Path("model.gguf"), 8, 1) == (123.5, "")


SPIN = """
import threading, time
from engine.background import name_os_thread
def spin():
    name_os_thread()
    end = time.thread_time() + 0.053
    while time.thread_time() < end:
        pass
    print(time.thread_time(), time.process_time(), flush=True)
    time.sleep(30)  # alive while it is read
threading.Thread(target=spin, name="spinner", daemon=True).start()
time.sleep(30)
"""


def test_cpu_of_another_process_and_its_thread_is_read_to_the_millisecond() -> None:
    """`lumen bench overhead` reads a server's CPU and its trace writer's from outside; /proc's
    10 ms clock ticks were 0.7% of a level's server CPU. Both figures match what the process
    measures of itself, to within 2 ms."""
    import subprocess
    import sys

    import psutil

    from bench.overhead import process_cpu_seconds, thread_cpu_seconds

    proc = subprocess.Popen([sys.executable, "-c", SPIN], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).parents[2])  # fmt: skip
    try:
        assert proc.stdout is not None
        thread_s, process_s = map(float, proc.stdout.readline().split())
        outside_thread = thread_cpu_seconds(proc.pid, "spinner")
        outside_process = process_cpu_seconds(psutil.Process(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    print(f"\nspinner thread {thread_s * 1e3:.2f} ms, read {outside_thread * 1e3:.2f} ms; "
          f"process {process_s * 1e3:.2f} ms, read {outside_process * 1e3:.2f} ms")  # fmt: skip
    assert abs(outside_thread - thread_s) < 0.002
    assert 0 <= outside_process - process_s < 0.002  # it only slept since


BUSY_WRITER = """
import threading, time
from engine.background import name_os_thread
def work():
    name_os_thread()
    print("started", flush=True)
    for _ in range(6):  # events handled after the load: 6 bursts of 40 ms, 50 ms apart
        end = time.thread_time() + 0.04
        while time.thread_time() < end:
            pass
        time.sleep(0.05)
    print(time.thread_time(), flush=True)
    while True:  # idle: it only polls
        time.sleep(0.05)
threading.Thread(target=work, name="trace-writer", daemon=True).start()
time.sleep(30)
"""


def test_the_overhead_bench_bills_a_writer_until_it_is_idle() -> None:
    """A level's bill holds the trace writer's CPU until it has handled the level's last
    events, traced or not: read while it works, the wait returns its CPU once it idles."""
    import subprocess
    import sys

    from bench.overhead import _wait_for_idle_writer

    proc = subprocess.Popen([sys.executable, "-c", BUSY_WRITER], stdout=subprocess.PIPE,
                            text=True, cwd=Path(__file__).parents[2])  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "started"
        billed = _wait_for_idle_writer(proc.pid)
        worked = float(proc.stdout.readline())  # printed before it idled
    finally:
        proc.kill()
        proc.wait()
    print(f"\nthe writer worked {worked * 1e3:.1f} ms; billed {billed * 1e3:.1f} ms")
    assert worked >= 0.24 and billed >= worked - 0.002


def test_tracing_shares_come_with_an_interval_that_holds_their_median() -> None:
    """On 2 cores one round's share of tracing moves by several points; the overhead bench
    gives each median a bootstrap interval, which widens with the rounds' spread and is the
    same on a rerun."""
    from bench.overhead import _ratios
    from bench.tracing_shares import intervals, median_interval

    def levels(extras: list[float]) -> list[dict[str, object]]:
        rows: list[dict[str, object]] = []
        for extra in extras:  # the untraced server at 100 us a token, the traced one above it
            for system, cpu in (("lumen (traced)", 100 * (1 + extra)),
                                ("lumen (no trace db)", 100.0)):  # fmt: skip
                rows.append({"system": system, "streams": 64, "server_cpu_us_per_token": cpu,
                             "api_cpu_us_per_token": cpu / 4,
                             "trace_writer_cpu_us_per_token": 1.0, "tok_s": 1.0})  # fmt: skip
        return rows

    steady = [0.02, 0.021, 0.019, 0.02, 0.022, 0.018, 0.02]
    noisy = [0.02, 0.09, -0.05, 0.06, -0.02, 0.04, 0.0]
    narrow, wide = (intervals(levels(x), [64])["s64_tracing_cpu_extra_ratio"]
                    for x in (steady, noisy))  # fmt: skip
    for interval, extras in ((narrow, steady), (wide, noisy)):
        median = _ratios(levels(extras), [64])["s64_tracing_cpu_extra_ratio"]
        assert interval["low"] <= median <= interval["high"] and interval["rounds"] == 7
    assert narrow["high"] - narrow["low"] < 0.005 < wide["high"] - wide["low"]
    assert median_interval(noisy) == median_interval(noisy)
    assert "s64_tracing_cpu_extra_ratio" not in intervals(levels(steady[:4]), [64])


def test_the_overhead_bench_compares_with_each_baseline_it_ran() -> None:
    """`lumen bench overhead`'s ratios, from one level of each server: the traced server over
    transformers serve, N tokens a write over one; a baseline left out (--skip-hf, no
    --stream-interval) leaves its ratios out. The servers themselves run in test_bench_servers."""
    from bench.overhead import _interval_name, _ratios

    def row(system: str, cpu: float, api: float, client: float, tok_s: float) -> dict[str, Any]:
        return {"system": system, "streams": 8, "server_cpu_us_per_token": cpu,
                "api_cpu_us_per_token": api, "client_cpu_us_per_token": client,
                "trace_writer_cpu_us_per_token": 0.0, "tok_s": tok_s}  # fmt: skip

    lumen = [row("lumen (traced)", 150, 60, 30, 9000),
             row("lumen (no trace db)", 140, 50, 30, 9500)]  # fmt: skip
    others = [row("transformers serve", 600, 500, 40, 3000),
              row(_interval_name(4), 120, 30, 12, 9600)]  # fmt: skip
    ratios = _ratios(lumen + others, [8], stream_interval=4)
    assert ratios["s8_cpu_per_token_ratio"] == pytest.approx(150 / 600)
    assert ratios["s8_tok_s_ratio"] == pytest.approx(9000 / 3000)
    assert ratios["s8_stream_interval_api_ratio"] == pytest.approx(30 / 50)
    assert ratios["s8_stream_interval_client_ratio"] == pytest.approx(12 / 30)
    alone = _ratios(lumen, [8])
    assert not {k for k in alone if "stream_interval" in k or k.startswith("s8_cpu_per_token")}
