"""A recording of requests with LoRA adapters replays each with its adapter, given the folders
with --lora-modules (the paths are not recorded); without them the replay refuses, naming
the adapters; a wait for an adapter slot is named by the replay's report as by the
recording's."""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest

from engine import LLM, LoRARequest, SamplingParams
from replay.cli import main
from tests.helpers.lora import build_adapter


def _adapters(db: Path) -> list[tuple[str | None, int]]:
    with duckdb.connect(str(db), read_only=True) as con:
        return con.execute("SELECT lora_name, count(*) FROM requests GROUP BY ALL "
                           "ORDER BY ALL").fetchall()  # fmt: skip


def test_adapters_replay_with_their_folders(
    tiny_model_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = build_adapter(tiny_model_path, tmp_path / "a", rank=4, seed=31)
    b = build_adapter(tiny_model_path, tmp_path / "b", rank=4, seed=32, targets=("q_proj",))
    recorded = tmp_path / "lora.db"
    llm = LLM(str(tiny_model_path), num_kv_blocks=256, trace_db=str(recorded), warmup=False,
              enable_lora=True, max_loras=1)  # fmt: skip
    plan = [LoRARequest("a", 1, str(a)), LoRARequest("b", 2, str(b)), None] * 2
    llm.generate(["hello there", "the sea is", "one two three"] * 2,
                 SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                 lora_request=plan, use_tqdm=False)  # fmt: skip
    llm.shutdown()
    assert _adapters(recorded) == [("a", 2), ("b", 2), (None, 2)]

    out = tmp_path / "replayed.db"
    assert main(["run", str(recorded), "--out", str(out)]) == 2
    said = capsys.readouterr().err
    assert "LoRA adapters the replay has no folder for: a, b (4 requests)" in said, said
    assert main(["run", str(recorded), "--out", str(out), "--lora-modules", f"a={a}",
                 f"b={b}"]) == 0  # fmt: skip
    assert _adapters(out) == [("a", 2), ("b", 2), (None, 2)]
    with duckdb.connect(str(out), read_only=True) as con:
        reasons = {r for (r,) in con.execute("SELECT DISTINCT wait_reason FROM steps").fetchall()}
    assert "lora_slots" in reasons  # one slot, as recorded: b's requests waited for a's
