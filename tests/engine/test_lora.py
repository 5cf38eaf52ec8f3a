"""LoRA adapters (engine/lora.py, engine/worker/lora.py): one batch of the base model and two
adapters gives each prompt the tokens PEFT's PeftModel gives it alone; slots, the prefix
cache, the adapters kept read, and what is refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.lora import LoraError, LoRARequest, parse_module, read_spec
from engine.model_config import ModelConfig
from tests.engine.test_correctness import SETTINGS, _random_prompts
from tests.helpers.factories import make_request, make_scheduler
from tests.helpers.lora import build_adapter
from tests.helpers.models import hf_greedy

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def adapters(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the tiny model, made by PEFT: every module at rank 8, and q, v and down
    at rank 4 with rsLoRA scaling."""
    root = tmp_path_factory.mktemp("lora")
    a1 = build_adapter(tiny_model_path, root / "a1", rank=8, alpha=16, seed=1)
    a2 = build_adapter(tiny_model_path, root / "a2", rank=4, alpha=8, seed=2, rslora=True,
                       targets=("q_proj", "v_proj", "down_proj"))  # fmt: skip
    return {"a1": a1, "a2": a2}


def _plan(prompts: list[list[int]], adapters: dict[str, Path]) -> list[LoRARequest | None]:
    """Base, a1, a2, base, a1, ... over the prompts."""
    cycle = [None, LoRARequest("a1", 1, str(adapters["a1"])),
             LoRARequest("a2", 2, str(adapters["a2"]))]  # fmt: skip
    return [cycle[i % 3] for i in range(len(prompts))]


def _references(
    base: Path, adapters: dict[str, Path], prompts: list[list[int]],
    plan: list[LoRARequest | None],
) -> list[list[int]]:  # fmt: skip
    """Greedy tokens of each prompt alone: transformers on the base model, or PEFT's
    PeftModel with its adapter."""
    expected: list[list[int]] = [[] for _ in prompts]
    for name in (None, "a1", "a2"):
        idx = [i for i, lora in enumerate(plan) if (lora and lora.lora_name) == name]
        adapter = None if name is None else adapters[name]
        got = hf_greedy(base, [prompts[i] for i in idx], MAX_TOKENS, adapter)
        for i, tokens in zip(idx, got):
            expected[i] = tokens
    return expected


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_a_batch_of_adapters_matches_peft(
    setting: str, tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    """16 prompts, a third each on the base model and two adapters, in one engine, under
    chunked prefill, a shared prefix (each adapter's blocks apart: a hit across adapters would
    change the tokens) and preemption."""
    options, shared = SETTINGS[setting]
    prompts = _random_prompts(seed=shared, shared_prefix=shared)
    plan = _plan(prompts, adapters)
    expected = _references(tiny_model_path, adapters, prompts, plan)
    llm = LLM(str(tiny_model_path), warmup=False, enable_lora=True, max_loras=2, **options)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=plan, use_tqdm=False)  # fmt: skip
        metrics = llm.get_metrics()
    finally:
        llm.shutdown()
    print(setting, metrics)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        name = plan[i].lora_name if plan[i] else "base"
        assert list(out.outputs[0].token_ids) == ref, f"prompt {i} ({name}) differs"
    assert len({tuple(e[:4]) for e in expected[:3]}) == 3  # the adapters change the tokens
    if setting == "preemption":
        assert metrics["num_preemptions"] > 0
    if setting == "prefix_cache":
        assert metrics["num_prefix_hit_tokens"] > 0


def test_fused_checkpoints_and_tensor_parallel_ranks_take_their_part(
    tiny_family_path: Any, tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Phi-3's fused qkv_proj and gate_up_proj adapted as PEFT targets them; and the tiny
    Llama's adapters over two tensor-parallel ranks (each rank its shard of A or B)."""
    phi3 = tiny_family_path("phi3")
    fused = build_adapter(phi3, tmp_path / "phi3-lora", rank=6, seed=3,
                          targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))  # fmt: skip
    prompts = _random_prompts(seed=4)[4:10]
    want = hf_greedy(phi3, prompts, MAX_TOKENS, fused)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm = LLM(str(phi3), warmup=False, enable_lora=True)
    try:
        lora = LoRARequest("phi", 1, str(fused))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=lora, use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want

    plan = _plan(prompts, adapters)
    expected = _references(tiny_model_path, adapters, prompts, plan)
    llm = LLM(str(tiny_model_path), warmup=False, enable_lora=True, max_loras=2,
              tensor_parallel_size=2)  # fmt: skip
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=plan, use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected


def test_an_alpha_pattern_and_one_layer_scale_as_peft_does(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """PEFT's alpha_pattern (a full module name, and a module's short name) and
    layers_to_transform: the tokens PeftModel gives."""
    pattern = {"model.layers.0.self_attn.q_proj": 64.0, "down_proj": 2.0}
    folder = build_adapter(tiny_model_path, tmp_path / "pat", rank=4, alpha=8, seed=41,
                           alpha_pattern=pattern)  # fmt: skip
    one = build_adapter(tiny_model_path, tmp_path / "one", rank=4, seed=42, layers=[1])
    prompts = _random_prompts(seed=9)[3:8]
    llm = LLM(str(tiny_model_path), warmup=False, enable_lora=True, max_loras=2)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        for i, f in enumerate((folder, one), 1):
            lora = LoRARequest(f.name, i, str(f))
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                lora_request=lora, use_tqdm=False)  # fmt: skip
            want = hf_greedy(tiny_model_path, prompts, MAX_TOKENS, f)
            assert [list(o.outputs[0].token_ids) for o in outs] == want, f.name
    finally:
        llm.shutdown()


def test_one_slot_serves_adapters_in_turn_and_says_why_they_waited(
    tiny_model_path: Path, adapters: dict[str, Path]
) -> None:
    """--max-loras 1 and --max-cpu-loras 1: the two adapters never share a batch (the base
    model's requests run beside either), the waits are recorded as lora_slots, each adapter
    is read from disk again after the other pushed it out, and every token is still right."""
    prompts = _random_prompts(seed=7)[:9]
    plan = _plan(prompts, adapters)
    expected = _references(tiny_model_path, adapters, prompts, plan)
    llm = LLM(str(tiny_model_path), warmup=False, enable_lora=True, max_loras=1,
              max_cpu_loras=1)  # fmt: skip
    llm.step_log = []
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                            lora_request=plan, use_tqdm=False)  # fmt: skip
        runner = llm.client.core.executor.runner
        reads = runner.lora.num_reads
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    reasons = [s.wait_reason for s, _ in llm.step_log]
    print(f"{len(reasons)} steps, waits: {sorted(set(reasons))}, adapters read {reads} times")
    assert "lora_slots" in reasons
    assert reads >= 2


def test_the_scheduler_passes_over_a_request_whose_adapter_finds_no_slot() -> None:
    """A third adapter waits while two hold the slots; the base model's request behind it and
    another of a running adapter go first; it runs once a slot frees."""
    sched = make_scheduler()
    sched.max_loras = 2
    loras = [LoRARequest(n, i, "/x") for i, n in enumerate(["a", "b", "c"], 1)]
    reqs = [make_request(8, max_tokens=2, request_id=r) for r in ("a1", "b1", "c1", "base", "a2")]
    for r, lora in zip(reqs, [loras[0], loras[1], loras[2], None, loras[0]]):
        r.lora_request = lora
        sched.add_request(r)
    out = sched.schedule()
    assert out.req_ids == ["a1", "b1", "base", "a2"] and out.wait_reason == "lora_slots"
    assert [n.lora_request for n in out.new_requests] == [loras[0], loras[1], None, loras[0]]
    seen = set(out.req_ids)
    from engine.worker.messages import ModelRunnerOutput

    for _ in range(6):
        ids = [rid for rid, s in zip(out.req_ids, out.sample) if s]
        sched.update_from_output(out, ModelRunnerOutput(ids, [5] * len(ids)))
        out = sched.schedule()
        seen |= set(out.req_ids)
    assert "c1" in seen


def test_prefix_blocks_are_kept_apart_per_adapter_and_per_load() -> None:
    """The same prompt hits its own adapter's cached blocks, never the base model's or another
    adapter's, nor those of an earlier load of the same name (another id)."""
    sched = make_scheduler(block_size=4)
    prompt = list(range(100, 117))

    def hits(lora: LoRARequest | None) -> int:
        r = make_request(list(prompt), max_tokens=1)
        r.lora_request = lora
        sched.add_request(r)
        out = sched.schedule()
        sched.update_from_output(out, __import__("engine.worker.messages", fromlist=["x"])
                                 .ModelRunnerOutput([r.request_id], [3]))  # fmt: skip
        return out.num_prefix_hit_tokens

    a, a_again, b = LoRARequest("a", 1, "/x"), LoRARequest("a", 3, "/x"), LoRARequest("b", 2, "/y")
    assert [hits(None), hits(a), hits(b), hits(a), hits(None), hits(a_again)] == [
        0, 0, 0, 16, 16, 0,
    ]  # fmt: skip


def _write_adapter(folder: Path, conf: dict[str, Any], tensors: dict[str, Any]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(conf))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def test_adapters_that_cannot_be_served_are_refused_in_one_line(
    tiny_model_path: Path, adapters: dict[str, Path], tmp_path: Path
) -> None:
    cfg = ModelConfig.from_path(tiny_model_path)
    good = load_file(str(adapters["a1"] / "adapter_model.safetensors"))
    conf = json.loads((adapters["a1"] / "adapter_config.json").read_text())
    spec = read_spec(adapters["a1"], cfg, 16)
    assert spec.rank == 8 and len(spec.modules) == 7 * cfg.num_layers
    assert spec.modules[0].scale == 2.0
    cases = {
        "not a folder": (tmp_path / "missing", "No adapter found"),
        "rank": (adapters["a1"], "over --max-lora-rank 4"),
        "dora": (_write_adapter(tmp_path / "dora", conf | {"use_dora": True}, good), "DoRA"),
        "embed": (_write_adapter(tmp_path / "embed", conf, good | {
            "base_model.model.model.embed_tokens.lora_A.weight": good[next(iter(good))].clone()}),
            "not a LoRA weight of a layer"),
        "shape": (_write_adapter(tmp_path / "shape", conf, {
            k: v[:, :10].contiguous() if ".lora_A." in k else v for k, v in good.items()}),
            "the adapter is for another base model"),
        "half": (_write_adapter(tmp_path / "half", conf, {
            k: v for k, v in good.items() if ".lora_B." not in k}), "lora_A alone"),
    }  # fmt: skip
    corrupt = _write_adapter(tmp_path / "corrupt", conf, good)
    (corrupt / "adapter_model.safetensors").write_bytes(
        b"\x10\x00\x00\x00\x00\x00\x00\x00{not json"
    )
    cases["corrupt"] = (corrupt, "not a safetensors file")
    for name, (folder, said) in cases.items():
        with pytest.raises(LoraError, match=said) as e:
            read_spec(folder, cfg, 4 if name == "rank" else 16)
        assert "\n" not in str(e.value), name
    assert parse_module('{"name": "x", "path": "/p", "base_model_name": "m"}') == ("x", "/p", "m")
    assert parse_module("x=/p") == ("x", "/p", None)
    for bad in ("x", "=p", '{"name": "x"}', '{"name": "x", "path": "p", "r": 1}'):
        with pytest.raises(LoraError):
            parse_module(bad)


def test_a_request_for_an_adapter_fails_alone(tiny_llm: LLM, tmp_path: Path) -> None:
    """An engine without --enable-lora, or an adapter folder gone: the request fails with why,
    and the engine serves the next."""
    params = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(Exception, match="--enable-lora"):
        tiny_llm.generate(["hi"], params, lora_request=LoRARequest("x", 1, str(tmp_path)),
                          use_tqdm=False)  # fmt: skip
    assert tiny_llm.generate(["hi"], params, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.e2e
@pytest.mark.real_model
def test_smollm2_adapters_of_three_ranks_match_peft(
    default_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """SmolLM2 with three PEFT adapters (rank 8 on q and v, 16 on every product, 64 on o and
    the MLP): each prompt's greedy tokens equal PeftModel's, each adapter alone and all mixed
    in one batch with the base model."""
    root = tmp_path_factory.mktemp("smol-lora")
    made = {
        "r8": build_adapter(default_model_path, root / "r8", rank=8, seed=21,
                            targets=("q_proj", "v_proj")),
        "r16": build_adapter(default_model_path, root / "r16", rank=16, alpha=32, seed=22),
        "r64": build_adapter(default_model_path, root / "r64", rank=64, alpha=16, seed=23,
                             targets=("o_proj", "gate_proj", "up_proj", "down_proj"),
                             rslora=True),
    }  # fmt: skip
    from engine.processor import load_tokenizer

    tok = load_tokenizer(str(default_model_path))
    questions = ("What is the capital of France?", "Write a haiku about rain.",
                 "List three prime numbers.")  # fmt: skip
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                                  add_generation_prompt=True),
                          add_special_tokens=False) for q in questions]  # fmt: skip
    want = {None: hf_greedy(default_model_path, prompts, MAX_TOKENS)}
    for name, folder in made.items():
        want[name] = hf_greedy(default_model_path, prompts, MAX_TOKENS, folder)
    loras = {name: LoRARequest(name, i + 1, str(f)) for i, (name, f) in enumerate(made.items())}
    llm = LLM(str(default_model_path), enable_lora=True, max_loras=3, max_lora_rank=64)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)  # stops at EOS, as HF
    ids = [{"prompt_token_ids": p} for p in prompts]
    try:
        alone = {name: [list(o.outputs[0].token_ids) for o in
                        llm.generate(ids, params, lora_request=lora, use_tqdm=False)]
                 for name, lora in loras.items()}  # fmt: skip
        plan = [None, *loras.values()] * len(prompts)
        mixed = llm.generate([ids[i // 4] for i in range(len(plan))], params, lora_request=plan,
                             use_tqdm=False)  # fmt: skip
    finally:
        llm.shutdown()
    for name in loras:
        assert alone[name] == want[name], name
        assert want[name] != want[None], name  # each adapter changes the answer
    for i, (lora, out) in enumerate(zip(plan, mixed)):
        assert list(out.outputs[0].token_ids) == want[lora and lora.lora_name][i // 4], i


def test_adapter_weights_are_read_as_torch_reads_them(
    adapters: dict[str, Path], tmp_path: Path
) -> None:
    """engine.lora.read_tensors (numpy alone, for the background read) against safetensors'
    torch reader, for an adapter saved in fp32, fp16 and bf16."""
    import torch

    from engine.lora import read_tensors

    good = load_file(str(adapters["a2"] / "adapter_model.safetensors"))
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        file = tmp_path / f"{dtype}.safetensors"
        save_file({k: v.to(dtype) for k, v in good.items()}, str(file))
        read = read_tensors(file)
        for key, t in load_file(str(file)).items():
            assert torch.equal(torch.from_numpy(read[key]), t.float()), (dtype, key)
