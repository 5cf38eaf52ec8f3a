"""KVLayout: layers in KV groups of one kind each, and what a KV cache holds with them."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import duckdb
import pytest

from engine.config import EngineConfig
from engine.kv_layout import KVLayout, blocks_per_sequence, kv_capacity
from engine.model_config import ModelConfig


def config(num_layers: int, window: int = 0, local: tuple[int, ...] = ()) -> ModelConfig:
    return ModelConfig(
        path="", architecture="", vocab_size=8, hidden_size=8, intermediate_size=8,
        num_layers=num_layers, num_heads=1, num_kv_heads=1, head_dim=8, rms_norm_eps=1e-6,
        rope_theta=1e4, rope_scaling=None, max_position_embeddings=32768,
        tie_word_embeddings=True, eos_token_ids=(), sliding_window=window, local_layers=local,
    )  # fmt: skip


def test_gemma3_layers_make_one_full_group_and_five_windows() -> None:
    """Gemma 3 270M: 18 layers, every sixth global. Groups of gcd(3, 15) = 3 layers, each of
    one kind; every layer has a place in its group, and no two layers of a group share it."""
    local = tuple(i for i in range(18) if i % 6 != 5)
    layout = KVLayout.of(config(18, 512, local))
    assert layout.windows == (0, 512, 512, 512, 512, 512) and layout.group_size == 3
    assert [i for i in range(18) if layout.layer_group[i] == 0] == [5, 11, 17]
    for g in range(6):
        places = [layout.layer_slot[i] for i in range(18) if layout.layer_group[i] == g]
        assert sorted(places) == [0, 1, 2]
        kinds = {i in local for i in range(18) if layout.layer_group[i] == g}
        assert kinds == {g > 0}
    # At 8K: 512 blocks of the global group, 33 of each window's (32 and the one its start
    # falls in), against 6 x 512 when every layer keeps every block: 4.54x the sequences.
    assert layout.blocks_per_sequence(8192, 16) == 512 + 5 * 33
    all_kept = KVLayout.of(config(18, 512, local), hybrid=False)
    assert all_kept.windows == (0,) and all_kept.group_size == 18
    ratio = (6 * 512) / layout.blocks_per_sequence(8192, 16)
    assert ratio == pytest.approx(4.54, abs=0.01)


def test_one_kind_of_layer_is_one_group() -> None:
    assert KVLayout.of(config(4)) == KVLayout.single(4)  # no window: today's cache
    mistral = KVLayout.of(config(4, 4096, (0, 1, 2, 3)))
    assert mistral.windows == (4096,) and mistral.group_size == 4 and mistral.hybrid
    # A window past the context frees nothing: a short sequence holds all it has.
    assert mistral.blocks_per_sequence(100, 16) == 7


def test_groups_of_the_gcd_when_the_kinds_do_not_divide() -> None:
    """Gemma 3 1B: 26 layers, 4 global and 22 local: groups of 2."""
    local = tuple(i for i in range(26) if i % 6 != 5)
    layout = KVLayout.of(config(26, 512, local))
    assert layout.group_size == 2 and layout.windows.count(0) == 2
    assert layout.windows.count(512) == 11


def test_capacity_as_vllm_reports_it() -> None:
    """Tokens: the blocks (less the null block) shared out over the groups; concurrency:
    sequences of the context that fit, windows freed."""
    cap = kv_capacity((0,), 18, 256, 16, 2048)
    assert (cap.tokens, cap.max_concurrency) == (4096, 2.0)
    assert cap.kinds == [("full", 18, 1, 128)]
    cap = kv_capacity((0, 512, 512, 512, 512, 512), 3, 6 * 677 + 1, 16, 8192)
    assert cap.tokens == 677 * 16 and cap.max_concurrency == 6.0
    assert cap.kinds == [("full", 3, 1, 512), ("sliding_window_512", 15, 5, 165)]
    assert blocks_per_sequence([0, 32], 20, 16) == 2 + 2


def test_a_gemma3_core_reports_its_groups_and_frees_its_windows(
    tiny_family_path: Callable[[str], Path], caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """The tiny Gemma 3 (local, global, local; a window of 32): its core logs the capacity
    per layer kind, tells its groups in EngineInfo and the runs table, and a 200-token
    sequence holds its global layer's blocks and only its windows' of the local ones."""
    from engine import LLM, SamplingParams
    from engine.core.engine_core import EngineCore

    model = tiny_family_path("gemma3")
    with caplog.at_level(logging.INFO, logger="engine.core.engine_core"):
        core = EngineCore(EngineConfig(num_kv_blocks=193, max_model_len=1024), str(model))
    try:
        assert core.info.kv_windows == [0, 32, 32] and core.info.kv_group_size == 1
        # The warm-up ran its steps past block 0: the null block is never written.
        for k_cache, v_cache in core.executor.runner.kv_caches:  # type: ignore[attr-defined]
            assert not k_cache[0].any() and not v_cache[0].any()
        text = caplog.text
        # 192 usable blocks over 3 groups: 64 blocks of 16 tokens each; a 1,024-token
        # sequence holds 64 + 2 x 3 blocks.
        assert "KV cache size: 1,024 tokens" in text
        assert "Maximum concurrency for 1,024 tokens per request: 2.74x" in text
        assert (
            "KV cache for sliding_window_32 layers (2, in 2 group(s)): a request of 1,024 "
            "tokens holds 6 blocks of them at most" in text
        )
        assert "KV cache for full layers (1, in 1 group(s)): a request of 1,024" in text
    finally:
        core.shutdown()

    db = tmp_path / "t.db"
    llm = LLM(str(model), num_kv_blocks=193, max_model_len=1024, warmup=False, trace_db=str(db))
    llm.step_log = []
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        llm.generate([{"prompt_token_ids": list(range(3, 203))}], params, use_tqdm=False)
    finally:
        llm.shutdown()
    held = [s.num_kv_blocks_used for s, _ in llm.step_log][-2]  # before the last frees all
    assert held == 15 + 2 * 3  # 239 tokens: 15 global blocks; each window its 3 at most
    with duckdb.connect(str(db), read_only=True) as con:
        row = con.execute(
            "SELECT kv_windows, kv_group_size, kv_max_concurrency FROM runs"
        ).fetchone()
    assert row is not None and row[:2] == ([0, 32, 32], 1) and round(row[2], 2) == 2.74


def test_a_virtual_core_has_the_real_cores_groups(
    tiny_family_path: Callable[[str], Path], tiny_model_path: Path
) -> None:
    """Replay's virtual core frees windows as the real one does where the model folder is
    here (a recording's model), and keeps one group where it is not."""
    from engine.core.virtual import VirtualCore

    gemma = EngineConfig(model=str(tiny_family_path("gemma3")), num_kv_blocks=64,
                         max_model_len=512)  # fmt: skip
    assert VirtualCore(gemma).scheduler.kv_cache.windows == (0, 32, 32)
    kept = EngineConfig(**{**gemma.__dict__, "disable_hybrid_kv_cache_manager": True})
    assert VirtualCore(kept).scheduler.kv_cache.windows == (0,)
    llama = EngineConfig(model=str(tiny_model_path), num_kv_blocks=64, max_model_len=512)
    assert VirtualCore(llama).scheduler.kv_cache.windows == (0,)
    elsewhere = EngineConfig(model="not-here", num_kv_blocks=64, max_model_len=512)
    assert VirtualCore(elsewhere).scheduler.kv_cache.windows == (0,)
