"""Speculative decoding in the engine: greedy output identical to decoding without drafts, in
every scheduling regime; sampled output distributed as the target's (rejection sampling)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampling_params import SamplingParams as Params
from engine.spec_config import parse
from engine.worker import spec_decode
from engine.worker.ngram import NgramIndex
from engine.worker.sampler import Sampler, SamplingRow
from tests.engine.test_correctness import SETTINGS, _random_prompts

MAX_TOKENS = 24
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 4, "disable_by_batch_size": 64}  # fmt: skip


class ScriptedProposer:
    """Drafts from the reference output, every third one wrong (a random model repeats nothing
    that prompt lookup could find): rows keep all, some or none of their drafts. Its interface
    is the ngram proposer's (engine/worker/ngram.py)."""

    def __init__(self, references: dict[tuple[int, ...], list[int]]) -> None:
        self.references = references
        self.prompts: dict[str, tuple[int, ...]] = {}
        self.rng = random.Random(0)
        self.num_proposed = 0

    def add(self, req_id: str, prompt: list[int]) -> None:
        self.prompts[req_id] = tuple(prompt)

    def drop(self, req_ids: list[str], preempted: list[str] = ()) -> None:  # type: ignore[assignment]
        for r in req_ids:
            self.prompts.pop(r, None)

    def propose(
        self, req_ids: list[str], rows: dict[str, Any], k: int, sched: object = None
    ) -> dict[str, list[int]]:
        out = {}
        for r in req_ids:
            done = len(rows[r].output_token_ids)
            drafts = list(self.references[self.prompts[r]][done : done + k])
            drafts = [t if self.rng.random() > 1 / 3 else self.wrong(t) for t in drafts]
            if drafts:
                out[r] = drafts
                self.num_proposed += len(drafts)
        return out

    def wrong(self, token: int) -> int:
        return (token + 1) % 1000


@pytest.fixture(scope="module")
def draft_copy(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's files in another folder: a draft_model of its own (own KV pool)."""
    folder = tmp_path_factory.mktemp("draft") / "tiny-copy"
    shutil.copytree(tiny_model_path, folder)
    return folder


@pytest.fixture(scope="module")
def references(tiny_llm: LLM) -> dict[int, list[list[int]]]:
    """Greedy outputs of the prompts of each shared-prefix length, without speculation."""
    found = {}
    for shared in {s for _, s in SETTINGS.values()}:
        prompts = _random_prompts(seed=shared, shared_prefix=shared)
        outs = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts],
                                 SamplingParams(temperature=0, max_tokens=MAX_TOKENS),
                                 use_tqdm=False)  # fmt: skip
        found[shared] = [list(o.outputs[0].token_ids) for o in outs]
    return found


@pytest.mark.parametrize(
    "proposer, path",
    [("scripted", "decode"), ("scripted", "chunk"), ("self_draft", "decode"),
     ("draft_model", "decode")],
)  # fmt: skip
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_greedy_output_is_the_same_with_drafts(
    setting: str, path: str, proposer: str, tiny_model_path: Path, draft_copy: Path,
    references: dict[int, list[list[int]]], monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Each verifying row as decode rows of its slot in the decode mirror, and as a prefill
    chunk (LUMEN_VERIFY_AS_DECODE=off); drafts scripted (some wrong), from the model's own
    weights in int8 (the self-draft: the target's KV pool), and from a draft checkpoint of its
    own (here the same weights in another folder, in int8: a KV pool of its own)."""
    options, shared = SETTINGS[setting]
    prompts = _random_prompts(seed=shared, shared_prefix=shared)
    expected = references[shared]
    monkeypatch.setenv("LUMEN_VERIFY_AS_DECODE", "auto" if path == "decode" else "off")
    spec: dict[str, Any] = NGRAM
    if proposer != "scripted":
        draft = tiny_model_path if proposer == "self_draft" else draft_copy
        spec = {"method": "draft_model", "model": str(draft), "quantization": "int8",
                "num_speculative_tokens": 3, "disable_by_batch_size": 64}  # fmt: skip
    llm = LLM(str(tiny_model_path), warmup=False, speculative_config=spec, **options)
    runner = llm.client.core.executor.runner
    assert runner.verify_as_decode == (path == "decode")
    if proposer == "scripted":
        runner.proposer = ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)})
    else:
        assert runner.proposer.shared == (proposer == "self_draft")
    llm.step_log = []
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    metrics = llm.get_metrics()
    llm.shutdown()
    drafted = sum(sum(s.num_drafted) for s, _ in llm.step_log)
    accepted = sum(sum(s.num_accepted) for s, _ in llm.step_log)
    steps = len(llm.step_log)
    print(f"{setting}: {steps} steps, {drafted} drafts verified, {accepted} kept, {metrics}")
    for i, (out, ref) in enumerate(zip(outs, expected)):
        assert list(out.outputs[0].token_ids) == ref, f"prompt {i} differs"
    assert 0 < accepted < drafted or (proposer != "scripted" and accepted > 0)
    if setting == "preemption":
        assert metrics["num_preemptions"] > 0
    if setting == "prefix_cache":
        assert metrics["num_prefix_hit_tokens"] > 0


def test_logprobs_and_penalties_are_the_targets_at_each_kept_token(
    tiny_model_path: Path, tiny_llm: LLM
) -> None:
    """A greedy row with logprobs and a repetition penalty: the same tokens and logprobs as
    without drafts (the penalty at a draft's position counts the drafts before it)."""
    prompts = _random_prompts(seed=5)[8:12]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=2,
                            repetition_penalty=1.3)  # fmt: skip
    plain = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in plain]
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256, speculative_config=NGRAM)
    proposer = ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)})
    llm.client.core.executor.runner.proposer = proposer
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    assert proposer.num_proposed > 0
    for a, b in zip(plain, outs):
        assert list(b.outputs[0].token_ids) == list(a.outputs[0].token_ids)
        for x, y in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            assert x.keys() == y.keys()
            for t in x:
                assert y[t].logprob == pytest.approx(x[t].logprob, abs=1e-4)


def test_a_stop_inside_a_steps_kept_drafts_ends_the_output_where_one_token_a_step_would(
    tiny_model_path: Path, tiny_llm: LLM
) -> None:
    """A stop string, a stop token and EOS-like ends met among a step's kept drafts: the same
    text, token ids and logprobs as without drafts (the tokens after the stop are dropped)."""
    prompts = _random_prompts(seed=7)[4:8]
    plain = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1)
    ref = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], plain, use_tqdm=False)
    expected = [list(o.outputs[0].token_ids) for o in ref]
    text = ref[0].outputs[0].text
    stop_string = text[len(text) // 2 : len(text) // 2 + 3]
    stop_token = expected[1][9]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, logprobs=1,
                            stop=[stop_string], stop_token_ids=[stop_token])  # fmt: skip
    want = tiny_llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256, speculative_config=NGRAM)
    proposer = ScriptedProposer({tuple(p): e for p, e in zip(prompts, expected)})
    proposer.rng.random = lambda: 1.0  # every draft right: stops fall inside kept drafts
    llm.client.core.executor.runner.proposer = proposer
    got = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.shutdown()
    assert any(o.outputs[0].finish_reason == "stop" for o in want)
    for a, b in zip(want, got):
        x, y = a.outputs[0], b.outputs[0]
        assert (y.text, list(y.token_ids), y.finish_reason) == (x.text, list(x.token_ids),
                                                                 x.finish_reason)  # fmt: skip
        assert len(y.logprobs) == len(x.logprobs) == len(x.token_ids)


def test_a_draft_model_draws_its_drafts_where_the_request_samples(tiny_model_path: Path) -> None:
    """The self-draft in int8 at temperature 1: drafts drawn from the draft's q, nearly the
    target's p, are mostly kept; a seeded request beside them drafts the draft's argmaxes (its
    output must not hang on the draft's shared generator), which the target, drawing from p,
    keeps far less often."""
    spec = {"method": "draft_model", "model": str(tiny_model_path), "quantization": "int8",
            "num_speculative_tokens": 3, "disable_by_batch_size": 64}  # fmt: skip
    asks = [{"prompt_token_ids": p} for p in _random_prompts(seed=13)[:4]]
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256, speculative_config=spec)
    llm.step_log = []
    outs = llm.generate(asks, [sampled, sampled, seeded, seeded], use_tqdm=False)
    llm.shutdown()
    rates = []
    for out in outs:
        rid = out.request_id
        drafted = sum(d for s, _ in llm.step_log for r, d in zip(s.req_ids, s.num_drafted or [])
                      if r == rid)  # fmt: skip
        kept = sum(a for s, _ in llm.step_log for r, a in zip(s.req_ids, s.num_accepted or [])
                   if r == rid)  # fmt: skip
        rates.append(kept / max(drafted, 1))
        assert len(out.outputs[0].token_ids) == MAX_TOKENS
    print("kept / drafted, sampled rows then seeded:", [f"{r:.2f}" for r in rates])
    assert min(rates[:2]) > 0.5 and max(rates[2:]) < min(rates[:2]) / 2


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_a_request_that_fills_the_context_speculates_to_its_end(
    tiny_model_path: Path, method: str
) -> None:
    """No draft past max_model_len: a 50-token prompt in a 64-token context ends at its 14th
    token (finish length), as without drafts."""
    spec: dict[str, Any] = {"num_speculative_tokens": 5, "method": method}
    spec |= ({"model": str(tiny_model_path), "quantization": "int8"} if method == "draft_model"
             else {"prompt_lookup_min": 1, "prompt_lookup_max": 2})  # fmt: skip
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=64, max_model_len=64,
              speculative_config=spec)  # fmt: skip
    out = llm.generate([{"prompt_token_ids": list(range(100, 150))}],
                       SamplingParams(temperature=0, max_tokens=100), use_tqdm=False)  # fmt: skip
    llm.shutdown()
    assert (len(out[0].outputs[0].token_ids), out[0].outputs[0].finish_reason) == (14, "length")


# -- rejection sampling, on a small vocabulary --------------------------------------------------


def _target(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    scaled = logits / temperature
    kth = scaled.topk(top_k).values[-1]
    return scaled.masked_fill(scaled < kth, float("-inf")).softmax(-1)


def test_rejection_sampling_keeps_the_targets_distribution() -> None:
    """Two drafts over a 6-token vocabulary, 20,000 draws: the first token follows p_0, the
    second (where the first draft was kept) p_1, the third (both kept) p_2, each within a total
    variation of sqrt(6 / draws) (about twice the noise: 0.017 at 20,000 draws)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    drafts = [2, 4]
    logits[0, 2] += 1.5  # drafts kept about half the time: every position gets draws
    logits[1, 4] += 1.5
    params = Params(temperature=0.8, top_k=5, max_tokens=8)
    sampler = Sampler(torch.device("cpu"), seed=1)
    row = SamplingRow(params, None, [1], [], frozenset())
    _follows_the_target(logits, lambda: spec_decode.verify(sampler, logits, [row], [drafts]))


def _follows_the_target(logits: torch.Tensor, verify: Any) -> None:
    """20,000 rows of two drafts through ``verify``: the token at each position follows the
    target's distribution there (temperature 0.8, top-k 5), within a total variation of
    sqrt(6 / its draws)."""
    counts = torch.zeros(3, 6)
    for _ in range(20_000):
        (kept,), _ = verify()
        for j, t in enumerate(kept):
            counts[j, t] += 1
    for j in range(3):
        want = _target(logits[j], 0.8, 5)
        got = counts[j] / counts[j].sum()
        tv = 0.5 * float((got - want).abs().sum())
        print(f"position {j}: {int(counts[j].sum())} draws, total variation {tv:.4f}")
        assert tv < (6 / counts[j].sum()) ** 0.5


def test_drafts_drawn_from_a_proposal_keep_the_targets_distribution() -> None:
    """Drafts drawn from a proposal q_j unlike the target's p_j (a draft model that samples),
    kept with min(1, p/q), a refusal redrawn from max(p - q, 0): each position follows p_j as
    above. Drafts drawn from p_j itself are all kept (a one-hot q would keep them about half the
    time)."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6)
    q = torch.randn(2, 6).softmax(-1)
    params = Params(temperature=0.8, top_k=5, max_tokens=8)
    sampler = Sampler(torch.device("cpu"), seed=1)
    row = SamplingRow(params, None, [1], [], frozenset())
    draws = torch.Generator().manual_seed(2)

    def drafted(proposal: torch.Tensor) -> list[int]:
        return [int(torch.multinomial(proposal[j], 1, generator=draws)) for j in range(2)]

    _follows_the_target(
        logits, lambda: spec_decode.verify(sampler, logits, [row], [drafted(q)], q=[q])
    )
    p = torch.stack([_target(logits[j], 0.8, 5) for j in range(2)])
    whole = [spec_decode.verify(sampler, logits, [row], [drafted(p)], q=[p])[0][0]
             for _ in range(300)]  # fmt: skip
    assert all(len(kept) == 3 for kept in whole)


def test_greedy_verification_keeps_drafts_up_to_the_first_disagreement() -> None:
    assert spec_decode.greedy([5, 6, 9, 1], [[5, 6, 7]]) == [[5, 6, 9]]
    assert spec_decode.greedy([5, 6, 7, 1, 3], [[5, 6, 7], []]) == [[5, 6, 7, 1], [3]]
    assert spec_decode.greedy([4, 6], [[5]]) == [[4]]


# -- the proposer and its configuration ---------------------------------------------------------


def test_prompt_lookup_proposes_what_followed_the_longest_match() -> None:
    index = NgramIndex([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 8], lookup_min=2, lookup_max=4)
    index.extend([1, 2, 3, 4])
    # 2 3 4 is followed by 5 (after 1 2 3 4) and by 7 (after 9 2 3 4): the longer match wins.
    assert index.propose(3) == [5, 9, 2]
    assert NgramIndex([1, 2, 3], 2, 4).propose(3) == []  # no earlier occurrence
    short = NgramIndex([7, 8, 9, 7, 8], 2, 2)
    assert short.propose(5) == [9, 7, 8]  # as many as are known


def _table(rows: list[list[int]]) -> dict[str, Any]:
    return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
            "num_speculative_tokens_per_batch_size": rows}  # fmt: skip


@pytest.mark.parametrize(
    "config, error",
    [
        ({"method": "eagle", "num_speculative_tokens": 3}, "not built yet"),
        ({"method": "lookahead", "num_speculative_tokens": 3}, "unknown method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "at least 1"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        (
            {
                "method": "ngram",
                "num_speculative_tokens": 3,
                "prompt_lookup_min": 4,
                "prompt_lookup_max": 2,
            },
            "prompt_lookup_min 4 is over",
        ),
        ({"method": "ngram", "num_speculative_tokens": 3, "acceptance": 1}, "not read here"),
        ({"method": "draft_model", "num_speculative_tokens": 3}, "draft_model needs model"),
        ({"model": "x", "num_speculative_tokens": 3, "quantization": "int3"}, "quantization must"),
        ({"method": "ngram", "num_speculative_tokens": 3, "quantization": "int4"}, "no weights"),
        ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_min": 2}, "are ngram's"),
        (_table([[1, 4]]), "must be a list of \\[start_batch_size"),
        (_table([[0, 4, 2]]), "needs 1 <= start <= end"),
        (_table([[1, 4, 5]]), "outside 0 to num_speculative_tokens"),
        (_table([[1, 4, 2], [4, 8, 1]]), "overlap at batch size 4"),
    ],
)
def test_a_speculative_config_lumen_cannot_honour_is_refused_in_one_line(
    config: dict[str, Any], error: str
) -> None:
    with pytest.raises(ValueError, match=error) as e:
        parse(json.dumps(config))
    assert "\n" not in str(e.value)


def test_a_draft_that_is_not_there_or_speaks_another_tokenizer_is_refused_at_start(
    tiny_model_path: Path, draft_copy: Path, tmp_path: Path
) -> None:
    from engine.config import EngineConfig
    from engine.model_files import resolve_config

    def start(draft: Path) -> None:
        spec = {"model": str(draft), "num_speculative_tokens": 2}
        resolve_config(
            EngineConfig(model=str(tiny_model_path), speculative_config=json.dumps(spec))
        )

    with pytest.raises(ValueError, match="not found"):
        start(tmp_path / "nowhere")
    other = tmp_path / "other-tokenizer"
    shutil.copytree(draft_copy, other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["added_tokens"] = tokenizer.get("added_tokens", [])[:1]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match=r"tokenizer .* is not the target's") as e:
        start(other)
    assert "\n" not in str(e.value)
    start(draft_copy)  # the same files elsewhere: taken


def test_a_batch_size_table_sets_k_where_it_holds_the_batch_and_the_rule_elsewhere(
    tiny_model_path: Path,
) -> None:
    """vLLM's num_speculative_tokens_per_batch_size: k = 0 for 2 to 8 running, 3 for 1; outside
    the table, disable_by_batch_size's rule. In an engine, two requests verify no drafts while
    both run, and the longer does once the shorter ends."""
    c = parse(json.dumps(_table([[2, 8, 0], [1, 1, 3]])))
    assert c is not None
    assert [c.k_for(n, 16) for n in (1, 2, 8, 9, 17)] == [3, 0, 0, 4, 0]
    llm = LLM(str(tiny_model_path), warmup=False, num_kv_blocks=256,
              speculative_config=_table([[2, 8, 0], [1, 1, 3]]))  # fmt: skip
    prompts = _random_prompts(seed=5)[:2]
    llm.client.core.executor.runner.proposer = ScriptedProposer(
        {tuple(p): list(range(200, 300)) for p in prompts}
    )
    llm.step_log = []
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                         for n in (4, MAX_TOKENS)], use_tqdm=False)  # fmt: skip
    llm.shutdown()
    steps = [(len(s.req_ids), s.num_spec_tokens, sum(s.num_drafted or [])) for s, _ in llm.step_log]
    print(steps)
    # The first step started with none running (both were admitted in it): the rule's k.
    assert steps[0][:2] == (2, 4)
    assert all(k == 0 and drafted == 0 for rows, k, drafted in steps[1:] if rows == 2)
    assert any(k == 3 and drafted > 0 for rows, k, drafted in steps if rows == 1)
    assert len(outs[1].outputs[0].token_ids) == MAX_TOKENS


def test_vllms_ngram_defaults() -> None:
    c = parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert c is not None and (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = parse('{"method": "[ngram]", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert c is not None and (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 3, 3)


@pytest.mark.e2e
def test_smollm2_speaks_the_same_with_each_proposer(default_model_path: Path) -> None:
    """SmolLM2 fp32, greedy, a copy-heavy and an open prompt, alone and batched: the same tokens
    without drafts, with prompt lookup and with its own weights in int4 drafting."""
    from bench.spec import TASKS

    path = str(default_model_path)
    messages = [[{"role": "user", "content": TASKS[t]}] for t in ("copy", "story")]
    params = SamplingParams(temperature=0, max_tokens=96)
    off = LLM(path, num_kv_blocks=128)
    want = [list(o.outputs[0].token_ids) for o in off.chat(messages, params, use_tqdm=False)]
    alone = [list(off.chat([m], params, use_tqdm=False)[0].outputs[0].token_ids) for m in messages]
    off.shutdown()
    assert alone == want
    for spec in (
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
         "prompt_lookup_max": 5},
        {"method": "draft_model", "model": path, "quantization": "int4",
         "num_speculative_tokens": 4},
    ):  # fmt: skip
        llm = LLM(path, num_kv_blocks=128, speculative_config=spec)
        llm.step_log = []
        got = [list(o.outputs[0].token_ids) for o in llm.chat(messages, params, use_tqdm=False)]
        one = [list(llm.chat([m], params, use_tqdm=False)[0].outputs[0].token_ids)
               for m in messages]  # fmt: skip
        drafted = sum(sum(s.num_drafted) for s, _ in llm.step_log)
        kept = sum(sum(s.num_accepted) for s, _ in llm.step_log)
        llm.shutdown()
        print(f"{spec['method']}: {drafted} drafts verified, {kept} kept")
        assert got == want and one == want
        assert kept > 0
