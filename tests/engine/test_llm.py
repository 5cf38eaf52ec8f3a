"""LLM.generate / LLM.chat behaviour: sampling, stops, finish reasons, bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from engine import LLM, SamplingParams

PROMPT = {"prompt_token_ids": [101, 2045, 77, 3000, 12, 999, 4242, 17]}
OTHERS = [{"prompt_token_ids": [5 + i, 700 + 3 * i, 1234, 42 + i]} for i in range(5)]


def _gen(llm: LLM, prompts, params: SamplingParams):
    return llm.generate(prompts, params, use_tqdm=False)


def _no_requests_left(llm: LLM) -> bool:
    stats = llm.get_stats()
    return (stats.num_running, stats.num_waiting, stats.num_kv_blocks_used) == (0, 0, 0)


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(tiny_llm: LLM) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=16)
    alone = _gen(tiny_llm, [PROMPT], params)[0].outputs[0].token_ids
    batched = _gen(tiny_llm, [*OTHERS[:2], PROMPT, *OTHERS[2:]], params)[2].outputs[0].token_ids
    other_seed = _gen(tiny_llm, [PROMPT], params.clone(seed=8))[0].outputs[0].token_ids
    assert alone == batched
    assert alone != other_seed


def test_parallel_samples_are_distinct_and_indexed(tiny_llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8)
    out = _gen(tiny_llm, [PROMPT], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3
    again = _gen(tiny_llm, [PROMPT], params)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_greedy_logprobs_rank_the_sampled_token_first(tiny_llm: LLM) -> None:
    out = _gen(tiny_llm, [PROMPT], SamplingParams(temperature=0, logprobs=3, max_tokens=6))[0]
    comp = out.outputs[0]
    assert comp.logprobs is not None and len(comp.logprobs) == 6
    total = 0.0
    for token_id, entry in zip(comp.token_ids, comp.logprobs):
        assert token_id in entry and entry[token_id].rank == 1
        assert len(entry) == 3  # the sampled token is also the top-1
        assert entry[token_id].logprob == max(lp.logprob for lp in entry.values())
        total += entry[token_id].logprob
    assert comp.cumulative_logprob == pytest.approx(total)


def test_max_tokens_finishes_with_length(tiny_llm: LLM) -> None:
    comp = _gen(tiny_llm, [PROMPT], SamplingParams(temperature=0, max_tokens=5))[0].outputs[0]
    assert len(comp.token_ids) == 5
    assert comp.finish_reason == "length"


def test_stop_string_cuts_text_and_frees_the_request(tiny_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=24)
    ref = _gen(tiny_llm, [PROMPT], greedy)[0].outputs[0]
    cut = len(ref.text) // 2
    stop = ref.text[cut : cut + 3]
    assert stop and stop not in ref.text[: cut + 2]
    comp = _gen(tiny_llm, [PROMPT], greedy.clone(stop=[stop]))[0].outputs[0]
    assert comp.text == ref.text[:cut]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop)
    kept = _gen(tiny_llm, [PROMPT], greedy.clone(stop=[stop], include_stop_str_in_output=True))[
        0
    ].outputs[0]
    assert kept.text == ref.text[: cut + 3]
    assert _no_requests_left(tiny_llm)


def test_stop_token_ids_and_min_tokens(tiny_llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=12)
    ref = _gen(tiny_llm, [PROMPT], greedy)[0].outputs[0].token_ids
    stop_id = ref[3]
    first = ref.index(stop_id)
    comp = _gen(tiny_llm, [PROMPT], greedy.clone(stop_token_ids=[stop_id]))[0].outputs[0]
    assert comp.token_ids == ref[: first + 1]
    assert (comp.finish_reason, comp.stop_reason) == ("stop", stop_id)
    held = _gen(tiny_llm, [PROMPT], greedy.clone(stop_token_ids=[stop_id], min_tokens=first + 3))
    assert stop_id not in held[0].outputs[0].token_ids[: first + 3]


def test_bad_input_is_rejected_and_the_engine_keeps_serving(tiny_llm: LLM) -> None:
    max_len = tiny_llm.client.info.max_model_len
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        _gen(tiny_llm, [PROMPT, {"prompt_token_ids": []}], ok)
    with pytest.raises(ValueError, match=rf"{max_len + 1}.*{max_len}"):
        _gen(tiny_llm, [{"prompt_token_ids": [5] * (max_len + 1)}], ok)
    with pytest.raises(ValueError, match="vocabulary"):
        _gen(tiny_llm, [{"prompt_token_ids": [5, 49152]}], ok)
    with pytest.raises(ValueError, match="vocabulary"):
        _gen(tiny_llm, [{"prompt_token_ids": [5, -1]}], ok)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="sampling_params"):
        _gen(tiny_llm, [PROMPT, PROMPT], [ok])
    assert _no_requests_left(tiny_llm)
    out = _gen(tiny_llm, [PROMPT], ok)
    assert len(out[0].outputs[0].token_ids) == 4


def test_outputs_come_back_in_prompt_order(tiny_llm: LLM) -> None:
    params = [SamplingParams(temperature=0, max_tokens=m) for m in (9, 1, 5, 3)]
    outs = _gen(tiny_llm, OTHERS[:4], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [9, 1, 5, 3]
    assert [o.prompt_token_ids for o in outs] == [p["prompt_token_ids"] for p in OTHERS[:4]]


def test_priority_policy_runs_urgent_requests_first(tiny_model_path: Path) -> None:
    llm = LLM(str(tiny_model_path), num_kv_blocks=64, max_num_seqs=1, scheduling_policy="priority")
    seen: list[str] = []
    original = llm.frontend.output_processor.process_outputs

    def spy(outputs, *rest):
        finished, to_abort = original(outputs, *rest)
        seen.extend(r.prompt_token_ids[0] for r in finished)
        return finished, to_abort

    llm.frontend.output_processor.process_outputs = spy  # observe completion order only
    prompts = [{"prompt_token_ids": [p, 7, 8]} for p in (30, 10, 20)]
    llm.generate(prompts, SamplingParams(max_tokens=3), priority=[3, 1, 2], use_tqdm=False)
    assert seen == [10, 20, 30]


@pytest.mark.real_model
def test_chat_knows_the_capital_of_france(default_model_path: Path) -> None:
    llm = LLM(num_kv_blocks=256)
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=32),
        use_tqdm=False,
    )
    comp = out[0].outputs[0]
    print(repr(comp.text))
    assert "Paris" in comp.text
    assert comp.finish_reason == "stop"


def test_a_refused_request_raises_with_the_reason(tiny_llm: LLM) -> None:
    from engine.errors import RequestError

    tiny_llm.sleep()
    try:
        with pytest.raises(RequestError, match="asleep"):
            _gen(tiny_llm, [PROMPT], SamplingParams(max_tokens=2))
    finally:
        tiny_llm.wake_up()
    assert len(_gen(tiny_llm, [PROMPT], SamplingParams(max_tokens=2))[0].outputs[0].token_ids) == 2


def test_child_ids_of_parallel_samples_cannot_be_taken_over() -> None:
    from tokenizers import Tokenizer

    from engine.output_processor import OutputProcessor

    proc = OutputProcessor(Tokenizer.from_str(_TINY_TOKENIZER))
    assert proc.add_request("x", None, [1, 2], SamplingParams(n=2)) == ["x-0", "x-1"]
    with pytest.raises(ValueError, match="already in use"):
        proc.add_request("x-1", None, [1, 2], SamplingParams())


_TINY_TOKENIZER = (
    '{"version":"1.0","model":{"type":"WordLevel","vocab":{"a":0,"b":1,"c":2},'
    '"unk_token":"a"},"decoder":null,"pre_tokenizer":null,"normalizer":null,'
    '"post_processor":null,"added_tokens":[],"truncation":null,"padding":null}'
)


def test_a_kv_cache_larger_than_memory_is_refused_at_start(tiny_model_path: Path) -> None:
    """The KV pool takes its pages as it fills (calloc): one that cannot fit is refused at
    start, not found out mid-serving."""
    with pytest.raises(ValueError, match=r"more than the [\d.]+ GiB of memory available"):
        LLM(str(tiny_model_path), kv_cache_memory_bytes=1 << 50)


def test_chat_template_kwargs_reach_the_template(
    tiny_family_path: Callable[[str], Path],
) -> None:
    llm = LLM(str(tiny_family_path("qwen3")), num_kv_blocks=64)
    try:
        messages = [{"role": "user", "content": "Hi"}]
        params = SamplingParams(temperature=0, max_tokens=1)
        (plain,) = llm.chat(messages, params, use_tqdm=False)
        closed, = llm.chat(messages, params, use_tqdm=False,
                           chat_template_kwargs={"enable_thinking": False})  # fmt: skip
    finally:
        llm.shutdown()
    # enable_thinking false appends an empty think block to the prompt (THINKING_TEMPLATE).
    assert len(closed.prompt_token_ids) > len(plain.prompt_token_ids)
    assert closed.prompt_token_ids[: len(plain.prompt_token_ids)] == plain.prompt_token_ids


def test_generation_config_defaults_auto_none_or_a_folder(
    tiny_family_path: Callable[[str], Path], tiny_model_path: Path
) -> None:
    qwen3 = tiny_family_path("qwen3")
    llm = LLM(str(qwen3), num_kv_blocks=64)
    try:
        assert llm.processor.sampling_defaults == {
            "temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 3
        }  # fmt: skip
        (out,) = llm.generate("Hi", use_tqdm=False)  # no params: the model's defaults
        # max_new_tokens 3 (or a sampled EOS first: Qwen3's defaults sample)
        assert len(out.outputs[0].token_ids) == 3 or out.outputs[0].finish_reason == "stop"
        assert len(out.outputs[0].token_ids) <= 3
    finally:
        llm.shutdown()
    from engine.config import EngineConfig

    assert EngineConfig(generation_config="none").sampling_defaults(qwen3) == {}
    assert EngineConfig().sampling_defaults(tiny_model_path) == {}  # SmolLM2's sets none
    borrowed = EngineConfig(generation_config=str(qwen3)).sampling_defaults(tiny_model_path)
    assert borrowed["max_tokens"] == 3
    with pytest.raises(ValueError, match="generation_config must be auto, none or a folder"):
        EngineConfig(generation_config="greedy")


def test_finished_and_aborted_requests_leave_no_cycle_to_the_garbage_collector() -> None:
    """A request's parent and sequences point at each other: once its last output is taken
    they are let go, so reference counting frees them (in the API process, the collector's
    passes over such cycles took 11-17 ms each)."""
    import gc

    from tokenizers import Tokenizer

    from engine.messages import EngineCoreOutput, FinishReason
    from engine.output_processor import OutputProcessor

    proc = OutputProcessor(Tokenizer.from_str(_TINY_TOKENIZER))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds is kept in gc.garbage, not freed
    try:
        proc.add_request("s", None, [1], SamplingParams(max_tokens=2), stream=True)
        pair = proc.add_request("p", None, [1], SamplingParams(n=2, max_tokens=1))
        proc.add_request("a", None, [1], SamplingParams(), stream=True)
        outs, _ = proc.process_outputs([EngineCoreOutput("s", [0]), EngineCoreOutput("a", [1])])
        assert [o.request_id for o in outs] == ["s", "a"]
        done = FinishReason.LENGTH
        outs, _ = proc.process_outputs([
            EngineCoreOutput("s", [1], finish_reason=done),
            *(EngineCoreOutput(child, [2], finish_reason=done) for child in pair),
        ])  # fmt: skip
        assert sorted((o.request_id, o.finished) for o in outs) == [("p", True), ("s", True)]
        assert proc.abort_request("a") == ["a"]
        del outs
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert not {"_Parent", "_Sequence", "IncrementalDetokenizer"} & set(left), left


def test_the_warm_up_prices_a_step_on_both_paths(tiny_model_path: Path) -> None:
    """The warm-up's prior: [a, b, c] of a greedy step, and f and g, a row and a step on the
    full logits over the greedy head (twin requests, sampled); none is negative, and the engine
    serves both paths after it (the warm-up's requests are gone from the runner)."""
    llm = LLM(str(tiny_model_path), num_kv_blocks=64)
    prior = llm.client.info.step_prior
    print([round(v / 1e6, 3) for v in prior], "ms")
    assert len(prior) == 5 and all(v >= 0 for v in prior)
    assert prior[0] + prior[2] > 0  # a one-row step is priced (a alone may fit to 0: it is tiny)
    outs = llm.generate(["Hello", "Hi"], [SamplingParams(max_tokens=4, temperature=0),
                                          SamplingParams(max_tokens=4, temperature=1.0, seed=1)],
                        use_tqdm=False)  # fmt: skip
    assert [len(o.outputs[0].token_ids) for o in outs] == [4, 4]
