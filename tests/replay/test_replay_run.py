"""Record a session through the server, replay it through the real engine, report on it."""

from __future__ import annotations

import itertools
import json
import shutil
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from replay.capacity import figures_of
from replay.cli import main
from replay.cost_model import StepCostModel
from replay.virtual import run_virtual
from replay.workload import is_server_recording, load_workload, replay_config
from tests.conftest import built_folder, built_once
from tests.helpers.browser import render_page
from tests.helpers.load import SlowReader, stream_chat, wait_until
from tests.helpers.server import LumenServer
from tracing.store import open_db

SYSTEM = "You are a careful assistant. Answer in full sentences. " * 6


def _record(server: LumenServer) -> None:
    """Different lengths, a shared system prompt, one abort, one invalid request, and one slow
    reader (fat chunks: logprobs) whose socket backs the server's writes up."""
    url = server.url("/v1/chat/completions")
    for i, n in enumerate((4, 12, 7, 20, 9, 15)):
        messages = [{"role": "user", "content": f"Question {i}: " + "why? " * (i * 5)}]
        if i % 2 == 0:
            messages.insert(0, {"role": "system", "content": SYSTEM})
        body = {"messages": messages, "max_tokens": n, "temperature": 0, "ignore_eos": True}
        if i == 3:
            stream_chat(server, {**body, "max_tokens": 400}, stop_after=5)  # aborted
        else:
            assert httpx.post(url, json=body, timeout=60).status_code == 200
        time.sleep(0.15)
    assert httpx.post(url, json={"messages": []}).status_code == 400
    fat = {"prompt": "Count with me: " * 8, "max_tokens": 300, "ignore_eos": True,
           "temperature": 0, "logprobs": 5}  # fmt: skip
    # The replay reads it at the recorded pace (its delivery span over its tokens): a stall of
    # 2 s makes that ~7 ms a token, slower than a busy 2-core machine generates them, so the
    # replayed writes back up too. At 1 s (~4 ms a token) a slow machine's replay once kept
    # pace, and its writes waited 8.6 ms in all.
    SlowReader(server, fat, stall_s=2.0).run()


def _requests(db: Path, run_id: str | None = None) -> list[tuple]:
    with open_db(db) as con:
        if run_id is None:
            run_id = con.execute(
                "SELECT run_id FROM requests ORDER BY arrival_ns DESC LIMIT 1"
            ).fetchone()[0]
        return con.execute(
            "SELECT arrival_ns, prompt_tokens, output_tokens, status FROM requests "
            "WHERE run_id = ? ORDER BY arrival_ns",
            [run_id],
        ).fetchall()


ARGS = ["--trace-flush-interval", "0.2", "--num-kv-blocks", "512", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "384", "--quantization", "int8"]  # fmt: skip


@pytest.fixture(scope="module")
def recording(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    """The session, recorded once for `make test`'s two passes (conftest.built_folder); each
    module reads a copy of its own."""

    def build(folder: Path) -> None:
        db = folder / "recording.db"
        with LumenServer(
            tiny_model_path, *ARGS, log_path=folder / "serve.log", trace_db=db
        ) as server:
            _record(server)
            wait_until(lambda: len(_requests(db)) == 8, 20)

    built = built_once(built_folder(tmp_path_factory, "recording"), build)
    db = tmp_path_factory.mktemp("recording") / "recording.db"
    shutil.copyfile(built / "recording.db", db)
    return db


# Serial: it asserts the replay's arrival gaps on the wall clock and the server's send waits (a
# slow reader's over 10 ms, everyone else's under), which a busy neighbour would blur.
@pytest.mark.serial
def test_record_replay_report(
    tmp_path: Path, tiny_model_path: Path, recording: Path, capsys
) -> None:
    recorded = [r for r in _requests(recording) if r[3] != "error"]
    assert len(recorded) == 7 and sum(r[3] == "aborted" for r in recorded) == 1

    out = tmp_path / "replay.db"
    # No engine flags: the replay takes the recording's configuration and says so.
    code = main(["run", str(recording), "--out", str(out), "--speed", "2", "--seed", "7"])
    assert code == 0
    printed = capsys.readouterr().out
    print(printed)
    used = (f"model {tiny_model_path.name} (recorded)", "max_num_seqs 3 (recorded)",
            "max_num_batched_tokens 384 (recorded)", "num_kv_blocks 512 (recorded)",
            "quantization int8 (recorded)")  # fmt: skip
    assert all(u in printed for u in used)
    with open_db(out) as con:
        [(config, blocks)] = con.execute("SELECT engine_config, num_kv_blocks FROM runs").fetchall()
    config = json.loads(config)
    assert (config["max_num_seqs"], config["max_num_batched_tokens"], config["seed"]) == (3, 384, 7)
    assert config["quantization"] == "int8"
    assert blocks == 512
    # The virtual run too; a flag overrides the recording, and says so.
    assert main(["run", str(recording), "--virtual", "--max-num-seqs", "2"]) == 0
    virtual = capsys.readouterr().out
    assert "max_num_seqs 2 (flag)" in virtual and "num_kv_blocks 512 (recorded)" in virtual
    assert "max 2 running" in virtual
    replayed = _requests(out)
    # Every request, with its recorded lengths, in arrival order, at half the spacing; the
    # client that hung up hangs up again, after the tokens it had.
    assert [r[1] for r in replayed] == [r[1] for r in recorded]
    assert [r[3] for r in replayed] == [r[3] for r in recorded]
    for again, was in zip(replayed, recorded):
        assert again[2] == was[2] if was[3] == "ok" else again[2] >= was[2]
    # The slow reader reads slowly again: the server's writes wait on it, and on no one else.
    waits = []
    for db in (recording, out):
        with open_db(db) as con:
            waits.append(con.execute(
                "SELECT output_tokens = 300, send_wait_ns FROM requests WHERE run_id = "
                "(SELECT run_id FROM requests ORDER BY arrival_ns DESC LIMIT 1) AND status = 'ok'"
            ).fetchall())  # fmt: skip
    print(f"send waits, recorded and replayed (slow reader first): {waits}")
    for rows in waits:
        assert [w >= 10e6 for slow, w in sorted(rows, reverse=True)][:1] == [True]
        assert all(w < 10e6 for slow, w in rows if not slow)
    gaps = [(b[0] - a[0]) / 1e9 for a, b in itertools.pairwise(recorded)]
    replay_gaps = [(b[0] - a[0]) / 1e9 for a, b in itertools.pairwise(replayed)]
    for g, rg in zip(gaps, replay_gaps):
        assert abs(rg - g / 2) < 0.25, (gaps, replay_gaps)
    assert "arrival error: p50" in printed
    for section in ("TTFT", "TPOT", "ITL", "E2E", "Causes", "Expected compute", "by part"):
        assert section in printed
    # The shared system prompt is shared again (synthetic tokens per block hash).
    with open_db(out) as con:
        [(hits,)] = con.execute("SELECT sum(prefix_hit_tokens) FROM steps").fetchall()
    assert hits > 0


def _check_html_report(db: Path, tmp_path: Path) -> None:
    """The HTML report opens in a browser with no server, and its three plots are drawn."""
    report = tmp_path / "report.html"
    assert main(["report", str(db), "--html", str(report)]) == 0
    png, dom = render_page(report, tmp_path, window="900,1500")
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000  # a page with drawings
    assert dom.count('<svg class="plot"') >= 3  # CDFs, timeline, breakdown (+ waterfalls)
    assert dom.count("<path") >= 20 and "<text" in dom  # drawn, with text labels
    for caption in ("Latency CDFs", "Batch composition", "Time to first token, by part"):
        assert caption in dom


@pytest.mark.e2e  # two real replays over HTTP and a virtual one: 23 s
def test_replay_over_http(tmp_path: Path, tiny_model_path: Path, recording: Path, capsys) -> None:
    db = tmp_path / "server.db"
    with LumenServer(
        tiny_model_path, *ARGS, log_path=tmp_path / "serve.log", trace_db=db, api_key="k"
    ) as server:
        args = ["run", str(recording), "--server", server.base_url, "--api-key", "k",
                "--model", str(tiny_model_path), "--speed", "4"]  # fmt: skip
        assert main(args) == 0
        wait_until(lambda: len(_requests(db)) == 7, 20)
    printed = capsys.readouterr().out
    print(printed)
    assert "0 failed" in printed and "client-side TTFT" in printed
    recorded = [(r[1], r[3]) for r in _requests(recording) if r[3] != "error"]
    assert [(r[1], r[3]) for r in _requests(db)] == recorded
    _check_exports(recording, db, tmp_path, capsys)


def _check_exports(recording: Path, replayed: Path, tmp_path: Path, capsys) -> None:
    """What a replay's trace db gives other tools: OTLP JSON lines, the diff against the
    recording, the HTML report. Here, not in the serial test: none of it times anything."""
    with open_db(replayed) as con:
        [(num_spans,)] = con.execute("SELECT count(*) FROM spans").fetchall()
    # Exported for other tools: one span a line, the same count, roots and children.
    jsonl = tmp_path / "spans.jsonl"
    assert main(["export", str(replayed), "--format", "otel-jsonl", "--out", str(jsonl)]) == 0
    spans = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len(spans) == num_spans
    roots = {s["spanId"] for s in spans if s["name"] == "llm_request"}
    assert len(roots) == 7
    assert all(s["parentSpanId"] in roots for s in spans if s["name"] != "llm_request")
    # The recording against its replay, side by side.
    capsys.readouterr()
    assert main(["diff", str(recording), str(replayed)]) == 0
    compared = capsys.readouterr().out
    assert "TTFT p99" in compared and "95% interval" in compared and "scheduler CPU" in compared
    _check_html_report(replayed, tmp_path)


def test_validate_sets_virtual_against_real_against_recorded(
    tmp_path: Path, recording: Path, capsys
) -> None:
    figures = tmp_path / "validate.json"
    # A server's recording is replayed through a `lumen serve` started for each real run
    # (test_capacity's --check runs that path); here in this process, which starts no server.
    assert is_server_recording(str(recording))
    args = ["validate", str(recording), "--real-runs", "2", "--in-process", "--json", str(figures)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    print(printed)
    data = json.loads(figures.read_text())
    assert not data["served"] and len(data["real"]) == 2
    # The recorded requests were not streamed: no recorded ITL (the replays stream none either).
    for compared, metrics in (("virtual_vs_real", ("ttft", "tpot", "e2e")),
                              ("real_vs_recorded", ("ttft", "tpot", "e2e"))):  # fmt: skip
        cells = data["errors"][compared]
        assert {m: set(cells[m]) for m in metrics} == {m: {"p50", "p90", "p99"} for m in metrics}
        assert all(cells[m][p] is not None for m in metrics for p in cells[m])
    assert set(data["verdicts"]) == {"virtual_vs_real", "real_vs_recorded"}
    assert data["judged"] == ["ttft", "tpot", "e2e"]  # ITL is shown, not judged
    assert {"r2", "err_p50", "err_p90", "err_p99"} <= set(data["held_out_fit"])
    for text in ("held-out steps", "TTFT p50", "E2E p99", "virtual vs real:", "in-process"):
        assert text in printed
    # The virtual run is priced by the machine as the real replays found it.
    assert "fitted on every other step of the 2 real replays" in printed
    assert data["steps_from"] == "the 2 real replays"


@pytest.mark.e2e  # a search of several replays: 18 s
def test_capacity_finds_the_rate_that_meets_a_target(
    tmp_path: Path, recording: Path, capsys
) -> None:
    assert main(["capacity", str(recording), "--target", "tpot:p90:nope"]) == 2
    assert "METRIC:PERCENTILE:SECONDS" in capsys.readouterr().err
    # A TPOT target between what the fitted model predicts for a trickle and for a flood: met
    # at some rate, missed at a higher one. (Not from the recorded latencies: on a busy 2-core
    # machine the fit of the tiny model's steps can sit far from the fastest request.)
    cost = StepCostModel.calibrate(str(recording))
    _, work = load_workload(str(recording), vocab=np.arange(1, 32000))
    config, _ = replay_config(str(recording), None, {})
    tpot = [figures_of(run_virtual(work, config, cost, speed=speed).to_json())["tpot_p90"]
            for speed in (1 / 64, 64)]  # fmt: skip
    assert tpot[1] > 1.5 * tpot[0], tpot  # a flood of this mix must cost more per token
    target = f"tpot:p90:{(tpot[0] * tpot[1]) ** 0.5:.6f}"
    code = main(["capacity", str(recording), "--target", target, "--check"])
    printed = capsys.readouterr().out
    print(printed)
    assert code in (0, 1)  # the tiny model's real replays are noisy: agreement is not asserted
    assert "The highest rate that meets TPOT p90" in printed
    assert printed.count("  virtual at ") == 2 and printed.count("  real at ") == 2


def test_a_replay_sends_tokens_as_the_recording_did(tmp_path: Path) -> None:
    """A run recorded with --stream-interval 4 is replayed with it (its ITL is per write), and
    a flag given to the replay wins; the line that says where each setting came from says so."""
    from tracing.store import row, write_new

    db = tmp_path / "t.db"
    config = {"stream_interval": 4, "max_num_seqs": 8, "core_process": True}
    write_new(db, {"runs": [row("runs", run_id="r", started_ns=1,
                                engine_config=json.dumps(config))]})  # fmt: skip
    config, used = replay_config(str(db), "r", {})
    assert config.stream_interval == 4 and "stream_interval 4 (recorded)" in used, used
    config, used = replay_config(str(db), "r", {"stream_interval": 1})
    assert config.stream_interval == 1 and "stream_interval" not in used, used
