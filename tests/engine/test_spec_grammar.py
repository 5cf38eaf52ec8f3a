"""Speculative decoding under a grammar: drafts cut where the grammar refuses them, a mask at
each verified position, the grammar advanced through the kept tokens (engine/core/grammar.py,
EngineCore._grammar_masks): the same tokens as decoding without drafts, and conforming output."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from engine import LLM, SamplingParams
from tests.engine.test_correctness import _random_prompts
from tests.engine.test_spec_decode import MAX_TOKENS, NGRAM, ScriptedProposer

GRAMMARS = {
    "regex": {"regex": "[0-9]{3,8}"},
    "json": {"json": {"type": "object", "required": ["n", "s"],
                      "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}}},
}  # fmt: skip


class GrammarProposer(ScriptedProposer):
    """The reference's drafts, every third one another token the grammar allows there (a
    digit for a digit, a letter in a string): the target refuses those, not the grammar."""

    def __init__(self, references: dict[tuple[int, ...], list[int]], tokenizer: Any) -> None:
        super().__init__(references)
        self.tokenizer = tokenizer

    def wrong(self, token: int) -> int:
        text = self.tokenizer.decode([token])
        swap = "7" if text.strip().isdigit() else "q"
        return int(self.tokenizer.encode(swap, add_special_tokens=False)[0])


@pytest.mark.parametrize("kind", list(GRAMMARS))
def test_a_request_under_a_grammar_speculates_and_answers_as_without(
    kind: str, tiny_model_path: Path, tiny_llm: LLM
) -> None:
    """Greedy rows under a grammar, beside a plain one, with drafts right, wrong but allowed
    by the grammar, and (from the prompt lookup's random tokens) refused by it: the tokens
    decoding without drafts gives; the grammar rows verified drafts and kept some."""
    from engine.sampling_params import StructuredOutputsParams

    prompts = _random_prompts(seed=11)[2:5]
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS)] + [
        SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                       structured_outputs=StructuredOutputsParams(**GRAMMARS[kind]))
        for _ in prompts[1:]
    ]  # fmt: skip
    asks = [{"prompt_token_ids": p} for p in prompts]
    plain = tiny_llm.generate(asks, params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in plain]
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256, speculative_config=NGRAM)
    proposer = GrammarProposer({tuple(p): e for p, e in zip(prompts, expected)},
                               llm.get_tokenizer())  # fmt: skip
    llm.client.core.executor.runner.proposer = proposer
    llm.step_log = []
    outs = llm.generate(asks, params, use_tqdm=False)
    llm.shutdown()
    drafted: dict[str, int] = {}
    kept: dict[str, int] = {}
    for step, _ in llm.step_log:
        for rid, d, a in zip(step.req_ids, step.num_drafted or [0] * len(step.req_ids),
                             step.num_accepted or [0] * len(step.req_ids)):  # fmt: skip
            drafted[rid] = drafted.get(rid, 0) + d
            kept[rid] = kept.get(rid, 0) + a
    print(kind, [o.outputs[0].text for o in outs], drafted, kept)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert list(out.outputs[0].token_ids) == ref, f"prompt {i} differs"
    under = [o.request_id for o in outs[1:]]
    assert 0 < sum(kept[r] for r in under) < sum(drafted[r] for r in under)
    if kind == "regex":
        assert all(re.fullmatch("[0-9]{3,8}", o.outputs[0].text) for o in outs[1:])


def test_drafts_that_break_the_grammar_are_cut_before_verification(tiny_model_path: Path) -> None:
    """Beside a request that verifies drafts, one under a regex grammar whose every draft the
    grammar refuses verifies none, and its output matches the regex; sampled at a temperature,
    under drafts the grammar allows, it matches too."""
    from engine.sampling_params import StructuredOutputsParams

    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
            "prompt_lookup_max": 2, "disable_by_batch_size": 8}  # fmt: skip
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256, speculative_config=spec)
    prompts = _random_prompts(seed=3)[6:9]
    free = prompts[0]
    digit = int(llm.get_tokenizer().encode("7", add_special_tokens=False)[0])
    refused = list(range(1000, 1100))
    drafts = {tuple(prompts[0]): refused, tuple(prompts[1]): refused,
              tuple(prompts[2]): [digit] * 100}  # fmt: skip
    llm.client.core.executor.runner.proposer = ScriptedProposer(drafts)
    regex = StructuredOutputsParams(regex="[0-9]{3,8}")
    greedy = SamplingParams(temperature=0, max_tokens=12, structured_outputs=regex)
    sampled = SamplingParams(temperature=1.0, seed=5, max_tokens=12, structured_outputs=regex)
    llm.step_log = []
    outs = llm.generate([{"prompt_token_ids": p} for p in (free, prompts[1], prompts[2])],
                        [SamplingParams(temperature=0, max_tokens=12), greedy, sampled],
                        use_tqdm=False)  # fmt: skip
    llm.shutdown()
    assert re.fullmatch("[0-9]{3,8}", outs[1].outputs[0].text)
    assert re.fullmatch("[0-9]{3,8}", outs[2].outputs[0].text)
    drafted: dict[str, int] = {}
    for step, _ in llm.step_log:
        for rid, d in zip(step.req_ids, step.num_drafted or [0] * len(step.req_ids)):
            drafted[rid] = drafted.get(rid, 0) + d
    print(drafted, [o.outputs[0].text for o in outs])
    assert drafted[outs[0].request_id] > 0 and drafted[outs[1].request_id] == 0
    assert drafted[outs[2].request_id] > 0


def test_a_draft_model_drafts_argmaxes_under_a_grammar() -> None:
    """A draft cut where the grammar refuses it keeps the target's distribution only where the
    draft was certain: a request under a grammar drafts argmaxes, at any temperature; one
    without a grammar draws from q."""
    from engine.sampling_params import StructuredOutputsParams
    from engine.worker.draft import GREEDY, draft_params
    from engine.worker.sampler import SamplingRow

    regex = StructuredOutputsParams(regex="[0-9]+")
    under = SamplingParams(temperature=1.0, max_tokens=8, structured_outputs=regex)
    free = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=8)
    assert draft_params(SamplingRow(under, None, [1], [], frozenset())) is GREEDY
    drawn = draft_params(SamplingRow(free, None, [1], [], frozenset()))
    assert (drawn.temperature, drawn.top_p) == (0.7, 0.9)
