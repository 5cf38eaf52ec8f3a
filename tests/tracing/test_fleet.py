"""Several trace stores read as one fleet: every row keeps its replica, and a request's `lumen
trace why` on the fleet is the one on its own replica's store."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from replay.cli import main as replay
from service.cli import main as lumen
from tracing.store import open_db

PROMPTS = [{"prompt_token_ids": [40 + i, 1200, 77 * (i + 1), 9, 31] * (i + 2)} for i in range(4)]


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path) -> Path:
    """Two replicas' stores in one folder, each recorded by its own engine; and a third
    recorded with no replica name of its own (it takes the host's)."""
    folder = tmp_path_factory.mktemp("fleet")
    for name, max_tokens in (("replica-a", 6), ("replica-b", 9)):
        with LLM(str(tiny_model_path), num_kv_blocks=128, trace_db=str(folder / f"{name}.db"),
                 service_instance_id=name, max_num_batched_tokens=16) as llm:  # fmt: skip
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens))
    return folder


def _out(cli, argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli(argv) == 0
    return out.getvalue()


def test_every_row_keeps_its_replica(fleet: Path) -> None:
    with open_db(fleet) as con:  # a folder
        by_replica = con.execute(
            "SELECT replica, count(*), sum(output_tokens) FROM requests GROUP BY 1 ORDER BY 1"
        ).fetchall()
        steps = con.execute("SELECT DISTINCT replica FROM steps ORDER BY 1").fetchall()
        spans = con.execute("SELECT DISTINCT replica FROM spans ORDER BY 1").fetchall()
    assert by_replica == [("replica-a", 4, 24), ("replica-b", 4, 36)]
    assert steps == spans == [("replica-a",), ("replica-b",)]
    top = _out(lumen, ["trace", "top", "--db", str(fleet / "replica-a.db"),
                       str(fleet / "replica-b.db"), "--limit", "8"])  # fmt: skip
    print(top)
    assert top.splitlines()[0].split()[:2] == ["request", "replica"]
    assert {line.split()[1] for line in top.splitlines()[1:]} == {"replica-a", "replica-b"}


def test_why_on_the_fleet_is_why_on_its_own_store(fleet: Path) -> None:
    for name in ("replica-a", "replica-b"):
        own = fleet / f"{name}.db"
        with open_db(own) as con:
            [(rid,)] = con.execute(
                "SELECT request_id FROM requests ORDER BY e2e_ns DESC LIMIT 1"
            ).fetchall()
        alone = _out(lumen, ["trace", "why", rid, "--db", str(own)])
        together = _out(lumen, ["trace", "why", rid, "--db", str(fleet)])
        assert together == alone and rid in alone
    print(together)
    # A fleet's report covers every run, names each replica, and lists the runs it used.
    for dbs in ([str(fleet / "replica-a.db"), str(fleet / "replica-b.db")], [str(fleet)]):
        report = _out(replay, ["report", *dbs])
        assert report.startswith("2 runs in 2 replicas' stores")
        for name in ("replica-a", "replica-b"):
            assert f"=== replica {name}, run " in report and f"on replica {name}:" in report
    assert f"{rid} on replica replica-b (" in together  # why names the request's replica


def test_bad_fleets_are_one_line_errors(fleet: Path, tmp_path: Path, capsys) -> None:
    (tmp_path / "empty").mkdir()
    for dbs, said in (
        ([str(fleet / "replica-a.db"), str(tmp_path / "missing.db")], "no trace db at"),
        ([str(tmp_path / "empty")], "no trace db (*.db) in the folder"),
        ([str(fleet / "replica-a.db"), str(fleet / "replica-a.db")], "named twice"),
    ):
        assert lumen(["trace", "top", "--db", *dbs]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_genai_server_metrics_reach_an_otlp_receiver(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The three OpenTelemetry GenAI server histograms, with the conventions' names, units,
    buckets and required attributes, decoded by a real OTLP/HTTP receiver."""
    from tracing.genai_metrics import DURATION_BUCKETS, TPOT_BUCKETS, TTFT_BUCKETS
    from tracing.receiver import OtlpReceiver

    with OtlpReceiver() as receiver:
        options = {"service_instance_id": "replica-m",
                   "otlp_metrics_endpoint": receiver.metrics_endpoint}  # fmt: skip
        with LLM(str(tiny_model_path), num_kv_blocks=128, **options) as llm:
            llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=5))
            llm.chat([[{"role": "user", "content": "hi"}]], SamplingParams(max_tokens=3))
        # the LLM's shutdown flushed them
    points = {(p.name, p.attributes["gen_ai.operation.name"]): p for p in receiver.metrics}
    print(sorted(points))
    buckets = {
        "gen_ai.server.time_to_first_token": TTFT_BUCKETS,
        "gen_ai.server.time_per_output_token": TPOT_BUCKETS,
        "gen_ai.server.request.duration": DURATION_BUCKETS,
    }
    for name, bounds in buckets.items():
        # Offline, a chat is templated, then generated: text_completion (the server's
        # /v1/chat/completions is chat).
        p = points[(name, "text_completion")]
        assert (p.unit, p.bounds, p.count) == ("s", list(bounds), 5)
        assert p.attributes["gen_ai.provider.name"] == "lumen"
        assert p.attributes["gen_ai.request.model"] == tiny_model_path.name
        assert p.resource["service.instance.id"] == "replica-m"
        assert 0 < p.sum / p.count < 60
