"""The offline LLM records the same spans and rows as the server."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from engine import LLM, SamplingParams
from tracing.spans import BOUNDARIES
from tracing.store import open_db

PROMPTS = [{"prompt_token_ids": [40 + i, 1200, 77 * (i + 1), 9, 31] * (i + 1)} for i in range(4)]


def test_llm_traces_every_request_with_exact_prompts(tmp_path: Path, tiny_model_path: Path) -> None:
    db = tmp_path / "offline.db"
    with LLM(str(tiny_model_path), num_kv_blocks=128, trace_db=str(db), trace_prompts="tokens",
             max_num_batched_tokens=8) as llm:  # fmt: skip
        outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=7, ignore_eos=True))
        llm.generate(PROMPTS[0], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=3))
    with open_db(db) as con:
        rows = con.execute(
            "SELECT request_id, status, endpoint, prompt_tokens, output_tokens, cached_tokens, "
            "prompt_token_ids FROM requests ORDER BY arrival_ns, request_id"
        ).fetchall()
        spans = con.execute("SELECT request_id, name, start_ns, end_ns FROM spans").fetchall()
        steps = con.execute("SELECT request_ids, num_scheduled FROM steps").fetchall()
    assert len(rows) == 5
    by_id = {r[0]: r for r in rows}
    scheduled = defaultdict(int)
    for ids, counts in steps:
        for rid, n in zip(ids, counts):
            scheduled[rid] += n
    names = defaultdict(set)
    for rid, name, _, _ in spans:
        names[rid].add(name)
    for prompt, out in zip(PROMPTS, outs):
        rid, status, endpoint, n_in, n_out, cached, token_ids = by_id[out.request_id]
        assert (status, endpoint, n_out) == ("ok", "generate", 7)
        assert token_ids == prompt["prompt_token_ids"]  # --trace-prompts tokens
        assert names[rid] == {"llm_request", *BOUNDARIES}
        assert scheduled[rid] == n_in - cached + n_out - 1
    # A budget of 8 tokens splits the 20-token prompt into at least 3 prefill chunks.
    longest = outs[-1].request_id
    assert sum(longest in ids for ids, _ in steps) >= 3 + 6
    # n = 2: one request row, both sequences' steps in its spans.
    [n2] = [r for r in rows if r[4] == 6]
    assert n2[1] == "ok"
