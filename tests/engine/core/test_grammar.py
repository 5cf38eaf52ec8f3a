"""Structured outputs in the core: grammars compile off the busy loop and never hold up the
batch, masks touch only the rows that have a grammar, and a failed or aborted grammar request
leaves nothing behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jsonschema
import pytest

from engine import LLM
from engine.client import InprocClient
from engine.config import EngineConfig
from engine.messages import FinishReason
from engine.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_outputs import prepare
from tests.helpers.factories import make_core_request as req

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["id", "ok", "tags"],
    "additionalProperties": False,
}


firsts: dict[str, object] = {}


def _grammar_request(rid: str, schema: dict, max_tokens: int = 60):
    params = SamplingParams(
        temperature=0,
        max_tokens=max_tokens,
        structured_outputs=StructuredOutputsParams(json=schema),
    )
    prepare(params)
    r = req(rid, list(range(20, 40)), max_tokens=max_tokens)
    r.sampling_params = params
    return r


def _run(client: InprocClient) -> tuple[dict[str, list[int]], dict[str, object], list]:
    """Step to the end: each request's tokens, its last output, the step records; and in
    ``firsts`` (module-level, per run) its first output with tokens."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, object] = {}
    firsts.clear()
    steps = []
    deadline = time.monotonic() + 60
    while client.core.has_work() and time.monotonic() < deadline:
        outs = client.get_output()
        if outs.step is not None:
            steps.append(outs.step)
        for o in outs.outputs:
            if o.new_token_ids and o.request_id not in tokens:
                firsts[o.request_id] = o
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finish_reason is not None:
                ends[o.request_id] = o
    return tokens, ends, steps


@pytest.mark.serial
def test_a_compiling_grammar_holds_up_no_one(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", "grammar_compile=0.5")
    client = InprocClient(EngineConfig(num_kv_blocks=64), str(tiny_model_path))
    started = time.time_ns()
    client.add_request(_grammar_request("g", SCHEMA))
    client.add_request(req("plain", list(range(50, 60)), max_tokens=8))
    tokens, _, steps = _run(client)
    first_g = next(s for s in steps if "g" in s.req_ids)
    plain_done = max(s.output_ns for s in steps if "plain" in s.req_ids)
    print(f"\nplain done {(plain_done - started) / 1e6:.0f} ms after the submit, the grammar "
          f"request's first step {(first_g.schedule_start_ns - started) / 1e6:.0f} ms")  # fmt: skip
    assert len(tokens["plain"]) == 8 and plain_done < first_g.schedule_start_ns
    assert all(s.req_ids for s in steps), "no empty step while the grammar compiled"
    ready_ns, compile_ns, cached = firsts["g"].grammar
    assert compile_ns >= 0.5e9 and not cached and ready_ns <= first_g.schedule_start_ns
    assert client.core.scheduler.num_grammars == 0 and not client.core.scheduler.compiling
    client.shutdown()


def test_grammar_rows_are_masked_and_plain_rows_are_untouched(tiny_llm: LLM) -> None:
    plain = [{"prompt_token_ids": list(range(1000 + i, 1020 + i))} for i in range(3)]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in tiny_llm.generate(plain, greedy)]
    so = SamplingParams(
        temperature=0, max_tokens=80, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    mixed = tiny_llm.generate([*plain, plain[0]], [greedy, greedy, greedy, so])
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    out = mixed[3].outputs[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), SCHEMA)
    sampled = SamplingParams(
        temperature=1.0, seed=7, max_tokens=20,
        structured_outputs=StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]),
    )  # fmt: skip
    for o in tiny_llm.generate(plain, sampled):
        assert o.outputs[0].text in ("alpha", "beta", "gamma delta")


def test_abort_while_compiling_and_a_grammar_the_core_cannot_build(
    tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LUMEN_DEBUG_DELAY", "grammar_compile=0.3")
    client = InprocClient(EngineConfig(num_kv_blocks=64), str(tiny_model_path))
    client.add_request(_grammar_request("gone", SCHEMA))
    acks = client.core.abort_requests(["gone"])
    assert [a.finish_reason for a in acks] == [FinishReason.ABORT]
    bad = req("bad", [5, 6, 7])  # a spec no frontend would pass: the core reports it
    bad.sampling_params = SamplingParams(
        max_tokens=4,
        structured_outputs=StructuredOutputsParams(grammar="x", kind="grammar", spec="start: ("),
    )
    client.add_request(bad)
    _, ends, _ = _run(client)
    assert ends["bad"].finish_reason == FinishReason.ERROR
    assert "grammar" in ends["bad"].error
    scheduler = client.core.scheduler
    assert not scheduler.requests and not scheduler.compiling and scheduler.num_grammars == 0
    assert scheduler.kv_cache.pool.num_free_blocks == scheduler.kv_cache.num_blocks
    client.shutdown()


def test_engines_of_one_model_share_the_grammar_tokenizer(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """llguidance's view of a tokenizer is loaded once a process for a tokenizer.json as it
    is, with the engine's vocabulary and EOS ids; another file, or other ids, load their own."""
    import shutil

    from engine.core import grammar

    def load(folder: Path, eos: tuple[int, ...] = (0,)) -> object:
        return grammar.GrammarManager(str(folder), 49152, eos)._load_tokenizer()

    first = load(tiny_model_path)
    assert load(tiny_model_path) is first
    assert load(tiny_model_path, eos=(0, 2)) is not first
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(tiny_model_path / "tokenizer.json", copy / "tokenizer.json")
    assert load(copy) is not first
    # A process that loads many models keeps the newest few.
    assert grammar._from_file.cache_info().currsize <= 4
