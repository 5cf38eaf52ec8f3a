"""The real Gemma 3 270M, converted from its GGUF file on PyPI, against transformers: a file of
its own, so that the parallel pass can run it beside the SmolLM2 runs (--dist loadfile)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.kv_layout import KVLayout
from engine.model_config import ModelConfig
from engine.processor import load_tokenizer
from tests.helpers.encoding import check_plain_encoder
from tests.helpers.models import hf_greedy

# Gemma 3 270M's window is 512 tokens: the last two prompts reach past it. They share their
# first 500 tokens, so the second's prefill is a chunk with cached context under the window
# (and the test prefills 1,100 tokens fewer on a loaded 2-core machine).
ROME = "The history of the Roman Empire spans many centuries and includes"
PRIMES = "In mathematics, a prime number is a natural number greater than one."
GEMMA_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    " ".join([ROME] * 48),
    " ".join([ROME] * 46 + [PRIMES] * 3),
]


@pytest.mark.e2e
@pytest.mark.real_model
def test_gemma3_270m_matches_hf(gemma_model_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real Gemma 3 270M (from its GGUF file): 32 greedy tokens of each prompt, batched,
    equal transformers' of each prompt alone. Its kernels are set, not timed (timing them on
    a 262,144-token head took 20 s of this test): oneDNN's products where this torch has
    them, a native greedy head over the whole vocabulary, and the native decode attention,
    over the global layers' mirror and the local layers' rings (the window's 512 places,
    wrapped by the two long prompts). The prompts are encoded by the
    engine's own tokenizer (AutoTokenizer's class, as tests/engine/test_tokenizer_load.py
    holds it): loading Gemma's 33 MB tokenizer.json a second time took 7 s of this test."""
    from engine.worker import cpu_matmul

    if cpu_matmul.onednn_available(torch.float32):
        monkeypatch.setenv("LUMEN_CPU_MATMUL", "onednn")
    screened = cpu_matmul.onednn_available(torch.bfloat16)
    monkeypatch.setenv("LUMEN_CPU_GREEDY_HEAD", "screened" if screened else "fused")
    monkeypatch.setenv("LUMEN_CPU_ATTENTION", "native")

    # 1,537 blocks of 3 layers: the bytes of 256 blocks of all 18 (and the null block).
    layout = KVLayout.of(ModelConfig.from_path(gemma_model_path))
    assert layout.windows == (0, 512, 512, 512, 512, 512) and layout.group_size == 3
    llm = LLM(str(gemma_model_path), max_model_len=2048, num_kv_blocks=1537, warmup=False)
    llm.step_log = []
    try:
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer(text)["input_ids"] for text in GEMMA_PROMPTS]
        assert sum(len(p) > 512 for p in prompts) == 2 and prompts[3][:500] == prompts[4][:500]
        params = SamplingParams(temperature=0, max_tokens=32)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        # The step before the last (which ends all five and frees all): the local layers'
        # groups hold only their windows.
        step = [s for s, _ in llm.step_log if s.num_decode_tokens == 5][-2]
        held = step.num_kv_blocks_used
        # Again, alone, after its window moved on: a prefix hit over the blocks still cached.
        hits = llm.get_metrics()["num_prefix_hit_tokens"]
        (again,) = llm.generate([{"prompt_token_ids": prompts[3]}], params, use_tqdm=False)
        hits = llm.get_metrics()["num_prefix_hit_tokens"] - hits
    finally:
        llm.shutdown()
    lengths = [len(p) + 30 for p in prompts]  # that step's context
    every_block = sum(6 * -(-n // 16) for n in lengths)
    print(f"blocks held in the step before the last: {held}, {every_block} keeping every layer's")
    assert held <= sum(layout.blocks_per_sequence(n, 16) for n in lengths) < every_block
    assert hits == (len(prompts[3]) - 1) // 16 * 16
    expected = hf_greedy(gemma_model_path, prompts, 32)
    for i, (out, ref) in enumerate(zip(outs, expected)):
        print(f"prompt {i} ({len(prompts[i])} tokens): {tokenizer.decode(ref)[:60]!r}")
        assert out.outputs[0].token_ids == ref, f"prompt {i} (len {len(prompts[i])}) differs"
    assert again.outputs[0].token_ids == expected[3]


@pytest.mark.e2e
@pytest.mark.real_model
def test_the_processor_encodes_gemma_as_transformers_does(gemma_model_path: Path) -> None:
    """tests/engine/test_tokenizer_load.py's check on Gemma's tokenizer (its <bos> and turn
    tokens), in this file: the test above loaded it in this process (load_tokenizer's cache)."""
    check_plain_encoder(load_tokenizer(str(gemma_model_path)))
