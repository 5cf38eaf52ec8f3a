"""A recording made with speculative decoding replays with it; one whose prompts were kept as
token ids replays with another --speculative-config; one without them refuses, saying why."""

from __future__ import annotations

import json
from pathlib import Path

import duckdb
import pytest

from engine import LLM, SamplingParams
from replay.cli import main


def _record(model: Path, db: Path, trace_prompts: str, spec: dict | None) -> None:
    llm = LLM(str(model), num_kv_blocks=256, trace_db=str(db), trace_prompts=trace_prompts,
              speculative_config=spec, warmup=False)  # fmt: skip
    llm.generate(["hello there", "the sea is", "one two three"],
                 SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)  # fmt: skip
    llm.shutdown()


def _drafts(db: Path) -> tuple[int, int]:
    with duckdb.connect(str(db), read_only=True) as con:
        sql = ("SELECT coalesce(sum(list_sum(num_drafted)), 0), "
               "coalesce(sum(list_sum(num_accepted)), 0) FROM steps")  # fmt: skip
        row = con.execute(sql).fetchone()
    assert row is not None
    return int(row[0]), int(row[1])


def test_speculation_replays_as_recorded_or_as_asked(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    self_draft = {"method": "draft_model", "model": str(tiny_model_path),
                  "quantization": "int8", "num_speculative_tokens": 3}  # fmt: skip
    recorded = tmp_path / "spec.db"
    _record(tiny_model_path, recorded, "tokens", self_draft)
    drafted, kept = _drafts(recorded)
    assert drafted > 0 and kept > 0
    out = tmp_path / "replayed.db"
    assert main(["run", str(recorded), "--out", str(out)]) == 0
    assert "speculative_config" in capsys.readouterr().out
    assert _drafts(out)[0] > 0  # replayed with the recording's own speculation

    plain = tmp_path / "plain.db"
    _record(tiny_model_path, plain, "tokens", None)
    again = tmp_path / "plain-spec.db"
    spec = json.dumps(self_draft)
    assert main(["run", str(plain), "--out", str(again), "--speculative-config", spec]) == 0
    assert _drafts(again)[0] > 0  # what speculation would have done to it

    # The run's report says what speculation did, and when the batch-size rule stopped it.
    assert main(["report", str(recorded)]) == 0
    assert "Speculative decoding: " in capsys.readouterr().out
    busy = tmp_path / "busy.db"
    _record(tiny_model_path, busy, "tokens", {**self_draft, "disable_by_batch_size": 2})
    assert main(["report", str(busy)]) == 0
    said = " ".join(capsys.readouterr().out.split())  # the report wraps its lines
    assert "The batch-size rule (disable_by_batch_size) let no request propose in" in said

    hashed = tmp_path / "hashed.db"
    _record(tiny_model_path, hashed, "hashes", None)
    assert main(["run", str(hashed), "--out", str(tmp_path / "x.db"),
                 "--speculative-config", spec]) == 2  # fmt: skip
    assert "--trace-prompts tokens" in capsys.readouterr().err
