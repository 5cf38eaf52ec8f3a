"""A recorded grammar request replays under its grammar: compiled and masked again."""

from __future__ import annotations

from pathlib import Path

import httpx

from replay.cli import main
from tests.helpers.load import wait_until
from tests.helpers.server import LumenServer
from tracing.store import open_db

# The recording server of test_replay_run: the replay takes its (int8, batched) configuration.
ARGS = ["--trace-flush-interval", "0.2", "--num-kv-blocks", "512", "--max-num-seqs", "3",
        "--max-num-batched-tokens", "384", "--quantization", "int8"]  # fmt: skip


def test_structured_requests_replay_under_their_grammar(tmp_path: Path, tiny_model_path: Path):
    """A recorded grammar request replays with its grammar: compiled and masked again."""
    db = tmp_path / "grammar.db"
    with LumenServer(tiny_model_path, *ARGS, log_path=tmp_path / "serve.log", trace_db=db) as s:
        url = s.url("/v1/chat/completions")
        for extra in ({"structured_outputs": {"regex": "[a-z]{4,8}"}},
                      {"response_format": {"type": "json_object"}}, {}):  # fmt: skip
            body = {"messages": [{"role": "user", "content": "Say a word"}], "max_tokens": 10}
            assert httpx.post(url, json={**body, **extra}, timeout=60).status_code == 200
        wait_until(lambda: _count(db) == 3, 20)
    out = tmp_path / "replayed.db"
    assert main(["run", str(db), "--out", str(out)]) == 0
    for path in (db, out):
        with open_db(path) as con:
            rows = con.execute(
                "SELECT grammar, grammar_ready_ns IS NOT NULL, grammar_mask_ns > 0 FROM requests "
                "ORDER BY arrival_ns"
            ).fetchall()
        assert rows == [("regex", True, True), ("json_object", True, True), (None, False, None)]


def _count(db: Path) -> int:
    if not db.exists():
        return 0
    with open_db(db) as con:
        return con.execute("SELECT count(*) FROM requests").fetchone()[0]
