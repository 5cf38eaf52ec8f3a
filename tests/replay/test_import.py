"""`replay import`: each public format from a small fixture, the transforms, and the real
Mooncake sample beside the project (../shared/traces)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from replay.cli import main
from replay.formats import parse_window, read_trace, transform
from tests.helpers.server import ROOT
from tracing.store import open_db

MOONCAKE = [
    {"timestamp": 0, "input_length": 1000, "output_length": 20, "hash_ids": [0, 1]},
    {"timestamp": 0, "input_length": 700, "output_length": 10, "hash_ids": [0, 2]},
    {"timestamp": 3000, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 3]},
    {"timestamp": 6000, "input_length": 100, "output_length": 7, "hash_ids": [4]},
]
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:15:47.1000000,879,8
"""
BURSTGPT = """Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type
5,ChatGPT,472,18,490,Conversation log
45,GPT-4,1087,0,1087,Conversation log
47,ChatGPT,312,291,603,API log
"""


def _rows(db: Path) -> list[tuple]:
    with open_db(db) as con:
        return con.execute(
            "SELECT arrival_ns, prompt_tokens, output_tokens, params, prompt_block_size, "
            "prompt_block_hashes, status FROM requests ORDER BY arrival_ns, request_id"
        ).fetchall()


def test_mooncake(tmp_path: Path) -> None:
    src = tmp_path / "trace.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in MOONCAKE))
    db = tmp_path / "t.db"
    assert main(["import", str(src), "--format", "mooncake", "--out", str(db)]) == 0
    rows = _rows(db)
    assert [r[0] for r in rows] == [0, 0, 3_000_000_000, 6_000_000_000]
    assert [(r[1], r[2]) for r in rows] == [(1000, 20), (700, 10), (1500, 5), (100, 7)]
    assert json.loads(rows[0][3]) == {"max_tokens": 20, "ignore_eos": True, "temperature": 0.0}
    assert rows[2][4:6] == (512, [0, 1, 3]) and rows[2][6] == "ok"


def test_azure_and_burstgpt(tmp_path: Path) -> None:
    (tmp_path / "azure.csv").write_text(AZURE)
    (tmp_path / "burst.csv").write_text(BURSTGPT)
    for name, fmt in (("azure.csv", "azure"), ("burst.csv", "burstgpt")):
        db = tmp_path / f"{fmt}.db"
        assert main(["import", str(tmp_path / name), "--format", fmt, "--out", str(db)]) == 0
    azure = _rows(tmp_path / "azure.db")
    start = azure[0][0]
    assert [(r[0] - start) / 1e9 for r in azure] == pytest.approx([0, 0.41941, 4.314579])
    assert [r[1] for r in azure] == [374, 879, 396]  # in arrival order, not file order
    assert all(r[5] is None for r in azure)  # no prefix information in this format
    burst = _rows(tmp_path / "burstgpt.db")
    assert [(r[0] / 1e9, r[1], r[2]) for r in burst] == [(0, 472, 18), (42, 312, 291)]


def test_transforms() -> None:
    records, _ = _records()
    spread = transform(records, spread=3.0, seed=1)
    assert spread == transform(records, spread=3.0, seed=1)  # deterministic
    assert spread[0].arrival_s < spread[1].arrival_s < 3.0 <= spread[2].arrival_s
    scaled = transform(records, scale_lengths=0.25, block_size=16)
    assert [r.block_size for r in scaled] == [128] * 4  # 512 * 0.25, a multiple of 16
    for r in scaled:  # still one hash per block
        assert math.ceil(r.prompt_tokens / r.block_size) == len(r.block_hashes)
    assert [r.output_tokens for r in scaled] == [5, 2, 1, 2]
    clipped = transform(records, max_prompt_len=600)
    assert clipped[2].prompt_tokens == 600 and clipped[2].block_hashes == (0, 1)
    window = transform(records, window=parse_window("2:7"))
    assert [r.arrival_s for r in window] == [1.0, 4.0]  # re-based to the window's start
    with pytest.raises(ValueError, match="window"):
        parse_window("5:1")


def _records():
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".jsonl", delete=False) as f:
        f.write("".join(json.dumps(r) + "\n" for r in MOONCAKE))
    try:
        return read_trace(f.name, "mooncake")
    finally:
        Path(f.name).unlink()


def test_bad_input_is_one_clear_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 5}\n')
    assert main(["import", str(bad), "--format", "mooncake", "--out", str(tmp_path / "x")]) == 2
    assert "bad.jsonl:1: not a Mooncake record" in capsys.readouterr().err
    assert main(["import", str(bad), "--format", "sharegpt", "--out", str(tmp_path / "x")]) == 2
    assert "--format must be one of" in capsys.readouterr().err


def test_the_real_mooncake_sample(tmp_path: Path) -> None:
    sample = ROOT.parent / "shared" / "traces" / "mooncake" / "conversation_trace.jsonl"
    if not sample.is_file():
        pytest.skip("the Mooncake sample is not beside the project (../shared/traces)")
    db = tmp_path / "mooncake.db"
    args = ["import", str(sample), "--format", "mooncake", "--out", str(db), "--window", "0:120",
            "--scale-lengths", "0.05", "--max-prompt-len", "1024", "--spread", "3"]  # fmt: skip
    assert main(args) == 0
    rows = _rows(db)
    print(f"\n2-minute window: {len(rows)} requests")
    assert 300 < len(rows) < 500  # ~3.4 requests/s
    assert all(r[1] <= 1024 for r in rows)
    assert {r[5][0] for r in rows} == {0}  # block 0, the shared system prompt, starts every one
    arrivals = [r[0] for r in rows]
    assert len(set(arrivals)) == len(arrivals)  # the 3-second buckets were spread
