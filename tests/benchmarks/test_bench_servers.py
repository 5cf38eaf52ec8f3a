"""`lumen bench` subcommands that start servers (Lumen's and transformers serve) and load them.

As in test_bench.py, speed is not asserted: each test checks what its benchmark measured and
wrote (phases, token counts, errors, ratio keys), never how fast it was.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers.bench import bench_json, lumen_bench, ratio_keys

# Each starts one or two servers and loads them: about a minute in all, in make test-e2e.
pytestmark = pytest.mark.e2e


def test_serve_bench_against_transformers_serve(tmp_path: Path, tiny_model_path: Path) -> None:
    out = tmp_path / "serve.json"
    r = lumen_bench(
        "serve", "--model", str(tiny_model_path), "--concurrency", "1,3",
        "--requests-per-stream", "1", "--rates", "4", "--poisson-requests", "3",
        "--max-tokens", "8", "--json", str(out),
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(out.read_text())
    phases = {(p["system"], p["kind"], p["level"]) for p in doc["phases"]}
    assert phases == {
        (s, k, lv)
        for s in ("lumen", "hf")
        for k, lv in (("concurrency", 1), ("concurrency", 3), ("poisson", 4))
    }
    for p in doc["phases"]:
        assert p["errors"] == 0, p
        assert p["output_tokens"] == 8 * p["requests"]
    want = {"c3_throughput_ratio", "c3_ttft_p50_ratio", "c3_itl_p50_ratio",
            "c1_itl_p50_over_batch1_step_ratio", "c1_itl_p50_over_engine_execute_ratio",
            "c3_model_time_share_ratio", "rate4_throughput_ratio"}  # fmt: skip
    assert want <= set(ratio_keys(doc))
    # Lumen's phases carry its own steps, read back from the server's trace db.
    lumen = [p for p in doc["phases"] if p["system"] == "lumen"]
    assert all(p["engine_steps"] > 0 and 0 < p["engine_model_time_share"] <= 1 for p in lumen)
    print(r.stdout)


def test_overhead_bench_counts_every_token_and_the_store(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    out = tmp_path / "overhead.json"
    r = lumen_bench(
        "overhead", "--model", str(tiny_model_path), "--streams", "2,5", "--max-tokens", "8",
        "--tokens-per-level", "40", "--stream-interval", "4", "--json", str(out), "--skip-hf",
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    doc = json.loads(out.read_text())
    # transformers serve is left out: the serve bench above runs it, and the ratios to it are
    # test_bench.py's (a 12 s start on 2 cores, to run two requests).
    systems = ("lumen (traced)", "lumen (no trace db)",
               "lumen (no trace db, --stream-interval 4)")  # fmt: skip
    assert {(x["system"], x["streams"]) for x in doc["levels"]} == {
        (s, n) for s in systems for n in (2, 5)
    }
    for x in doc["levels"]:  # 40 tokens a level: 3 requests a stream at 2 streams, 1 at 5
        assert x["errors"] == 0 and x["tokens"] == 8 * x["requests"], x
        assert x["server_cpu_us_per_token"] > 0
        assert x["trace_writer_cpu_us_per_token"] >= 0  # the thread found by its name, or 0
    # Every traced token is in the store, whose size is reported per token.
    traced = sum(x["tokens"] for x in doc["levels"] if x["system"] == "lumen (traced)")
    assert doc["store"]["tokens"] >= traced and doc["store"]["bytes_per_token"] > 0
    want = {"cpu_per_token_s5_over_s2_ratio",
            "s2_tracing_cpu_extra_ratio", "s2_tracing_api_extra_ratio",
            "s5_trace_writer_extra_ratio", "s2_stream_interval_api_ratio",
            "s5_stream_interval_client_ratio"}  # fmt: skip
    assert want <= set(ratio_keys(doc))
    for x in doc["levels"]:  # the API process: the server less its engine core
        api = x["server_cpu_us_per_token"] - x["children_cpu_us_per_token"]
        assert x["api_cpu_us_per_token"] == pytest.approx(api)


def test_cold_start_bench_compares_the_first_burst_with_warm_ones(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    out = tmp_path / "cold.json"
    r = lumen_bench("cold-start", "--model", str(tiny_model_path), "--burst", "3",
                    "--max-tokens", "4", "--warm-bursts", "2", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    print(r.stdout)
    doc = json.loads(out.read_text())
    by_mode = {x["mode"]: x for x in doc["results"]}
    assert set(by_mode) == {"warm-up", "--no-warmup"}
    assert by_mode["warm-up"]["warmup_s"] > 0 and by_mode["--no-warmup"]["warmup_s"] == 0
    for x in doc["results"]:
        assert len(x["warm_bursts_slowest_ttft_s"]) == 2 and x["first_over_warm_ratio"] > 0


def test_structured_bench_compares_plain_itl_beside_grammar_streams(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """The plain streams' ITL beside grammar streams and beside as many plain ones, and the
    compile and mask figures read back from the trace store."""
    stdout, doc = bench_json(
        tmp_path, "structured", "--model", str(tiny_model_path), "--streams", "2",
        "--grammar-streams", "2", "--max-tokens", "12", "--rounds", "1",
    )  # fmt: skip
    print(stdout)
    itl = doc["itl_ms"]
    assert set(itl) == {"plain alone", "plain beside plain", "plain beside grammar",
                        "grammar streams"}  # fmt: skip
    assert all(v["p50"] > 0 for v in itl.values())
    store = doc["store"]
    # One schema: compiled once (warm-up phase), every later grammar request a cache hit.
    assert store["compiles"] == 1 and store["cache_hits"] == store["grammar_requests"] - 1
    assert store["mask_us_per_row"] > 0 and doc["plain_beside_grammar_over_beside_plain_p50"] > 0
