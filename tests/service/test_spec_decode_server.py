"""Speculative decoding through a real server and the `openai` client: the same greedy text as a
server without it, vLLM's spec_decode counters on /metrics, and each response's
`metrics.speculative_decoding` (--per-request-spec-decode-metrics)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from replay.server import metric
from tests.helpers.server import LumenServer
from tracing.diagnose import explain_request

# Prompt lookup of one token: a random model's output repeats tokens of a long prompt of its own
# output now and then, so drafts are proposed (and mostly refused) on the tiny model.
SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                   "prompt_lookup_max": 3})  # fmt: skip


@pytest.fixture(scope="module")
def prompt(tiny_llm: LLM) -> list[int]:
    """40 tokens and the tiny model's 300-token greedy answer to them."""
    first = list(range(100, 140))
    greedy = SamplingParams(temperature=0, max_tokens=300)
    out = tiny_llm.generate([{"prompt_token_ids": first}], greedy, use_tqdm=False)
    return first + list(out[0].outputs[0].token_ids)


def test_speculation_through_a_server(
    tiny_model_path: Path, tmp_path: Path, prompt: list[int], tiny_llm: LLM
) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=40)
    expected = tiny_llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)
    want = expected[0].outputs[0].text
    with LumenServer(tiny_model_path, "--num-kv-blocks", "256", "--speculative-config", SPEC,
                     "--per-request-spec-decode-metrics", "detailed",
                     log_path=tmp_path / "serve.log") as server:  # fmt: skip
        client = server.client()
        model = client.models.list().data[0].id
        r = client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                      temperature=0)  # fmt: skip
        assert r.choices[0].text == want
        spec = r.model_extra["metrics"]["speculative_decoding"]
        print(f"\nwhole response: {spec}")
        assert spec["num_spec_steps"] > 0 and spec["num_draft_tokens"] >= spec["num_spec_steps"]
        assert sum(spec["acceptance_histogram"]) == spec["num_spec_steps"]
        assert spec["mean_acceptance_length"] == pytest.approx(
            1 + spec["num_accepted_tokens"] / spec["num_spec_steps"], abs=1e-3)  # fmt: skip
        assert len(spec["accepted_per_position"]) == 3  # k positions, kept or not

        # A stream: in the last chunk only, with the usage.
        stream = client.completions.create(model=model, prompt=prompt, max_tokens=40,
                                           temperature=0, stream=True,
                                           stream_options={"include_usage": True})  # fmt: skip
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        last = chunks[-1].model_extra
        assert last["metrics"]["speculative_decoding"] == spec
        assert all("metrics" not in (c.model_extra or {}) for c in chunks[:-1])

        # n > 1: none, as vLLM.
        body = {"prompt": prompt, "max_tokens": 8, "n": 2, "temperature": 0.5}
        many = httpx.post(server.url("/v1/completions"), headers=server.headers(), json=body,
                          timeout=60)  # fmt: skip
        assert "metrics" not in many.json()

        samples = server.metrics()
        drafts = metric(samples, "lumen:spec_decode_num_drafts_total")
        tokens = metric(samples, "lumen:spec_decode_num_draft_tokens_total")
        kept = metric(samples, "lumen:spec_decode_num_accepted_tokens_total")
        per_pos = metric(samples, "lumen:spec_decode_num_accepted_tokens_per_pos_total")
        print(f"/metrics: {drafts} drafts, {tokens} draft tokens, {kept} kept")
        assert drafts >= 2 * spec["num_spec_steps"] and tokens >= drafts and kept == per_pos
        request_id = r.id
    # `lumen trace why` tells the request's drafts, kept and thrown away.
    _, sentences = explain_request(server.trace_db, request_id)
    told = next(s for s in sentences if s.startswith("Speculative decoding:"))
    print(told)
    assert (f"{spec['num_spec_steps']} of its steps verified {spec['num_draft_tokens']} drafts "
            f"and kept {spec['num_accepted_tokens']}") in told  # fmt: skip
    if spec["draft_acceptance_rate"] <= 0.3:
        assert any(s.startswith("Low acceptance") for s in sentences)
