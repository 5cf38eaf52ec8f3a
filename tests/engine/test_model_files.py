"""Model provisioning: the default model's folder, local folders, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.model_config import ModelConfig
from engine.model_files import resolve_model, served_name


def test_default_model_is_a_converted_llama(default_model_path: Path) -> None:
    cfg = ModelConfig.from_path(default_model_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.max_position_embeddings == 8192
    assert cfg.rope_theta == 100000.0  # read from transformers 5's rope_parameters
    assert list(default_model_path.glob("*.safetensors"))
    assert not list(default_model_path.glob("*.gguf"))
    assert resolve_model(None) == default_model_path
    assert served_name(None) == "SmolLM2-135M-Instruct"


def test_local_folder_resolves(tiny_model_path: Path) -> None:
    assert resolve_model(str(tiny_model_path)) == tiny_model_path.resolve()
    assert served_name(str(tiny_model_path)) == tiny_model_path.name


def test_missing_and_unsupported_models_raise_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ValueError, match=r"no config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture.*GPT2LMHeadModel") as e:
        resolve_model(str(tmp_path))
    assert "Qwen2ForCausalLM" in str(e.value) and "Qwen3ForCausalLM" in str(e.value)


def test_each_family_translates_its_config(
    tiny_family_path: Callable[[str], Path], tmp_path: Path
) -> None:
    qwen2 = ModelConfig.from_path(tiny_family_path("qwen2"))
    qwen3 = ModelConfig.from_path(tiny_family_path("qwen3"))
    # Qwen2's sliding_window (32 here) is off: use_sliding_window is false.
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.qk_norm, qwen2.rope_theta) == (
        True, False, False, 1e6
    )  # fmt: skip
    assert (qwen3.qkv_bias, qwen3.qk_norm, qwen3.head_dim) == (False, True, 32)
    phi3 = ModelConfig.from_path(tiny_family_path("phi3"))
    assert (phi3.fused_checkpoint, phi3.rotary_dim, phi3.head_dim) == (True, 8, 16)
    assert phi3.rope_scaling is not None and phi3.rope_scaling["rope_type"] == "longrope"
    assert phi3.rope_scaling["original_max_position_embeddings"] == 1024
    # A window that is on windows the layers from max_window_layers on (transformers' rule).
    config = json.loads((tiny_family_path("qwen2") / "config.json").read_text())
    config.pop("layer_types", None)
    on = {**config, "use_sliding_window": True, "max_window_layers": 1}
    assert _config(tmp_path, on)[1:] == (32, (1,), 0.0)
    # For Llama and Mistral, sliding_window is a window on every layer; a Llama's biases.
    llama = {**config, "architectures": ["LlamaForCausalLM"], "attention_bias": True}
    cfg, *windows = _config(tmp_path, llama)
    assert cfg.o_bias and windows == [32, (0, 1), 0.0]
    # Phi-3-mini-4k's window of 2047 is a window; Phi-4-mini's, past its context, is none.
    phi3_config = json.loads((tiny_family_path("phi3") / "config.json").read_text())
    assert _config(tmp_path, {**phi3_config, "sliding_window": 1024})[1] == 1024
    assert _config(tmp_path, {**phi3_config, "sliding_window": 1 << 20})[1] == 0
    # Gemma 3: its layer_types, or every sixth layer global in older configs; its second RoPE
    # base from rope_parameters, or rope_local_base_freq.
    gemma = ModelConfig.from_path(tiny_family_path("gemma3"))
    assert (gemma.sliding_window, gemma.local_layers, gemma.local_rope_theta) == (32, (0, 2), 1e4)
    assert (gemma.gemma, gemma.query_pre_attn_scalar, gemma.rope_theta) == (True, 24.0, 1e6)
    assert gemma.rope_scaling == {"rope_type": "linear", "factor": 4.0}
    old = json.loads((tiny_family_path("gemma3") / "config.json").read_text())
    del old["layer_types"], old["rope_parameters"]
    old |= {"num_hidden_layers": 7, "rope_theta": 1e6, "rope_local_base_freq": 5e3}
    assert _config(tmp_path, old)[1:] == (32, (0, 1, 2, 3, 4, 6), 5e3)
    for key, value in (("final_logit_softcapping", 30.0), ("use_bidirectional_attention", True)):
        with pytest.raises(ValueError, match=key):
            _config(tmp_path, {**old, key: value})


def _config(folder: Path, config: dict) -> tuple[ModelConfig, int, tuple[int, ...], float]:
    """The ModelConfig of ``config`` written to ``folder``, and its windows and local base."""
    (folder / "config.json").write_text(json.dumps(config))
    cfg = ModelConfig.from_path(folder)
    return cfg, cfg.sliding_window, cfg.local_layers, cfg.local_rope_theta


def _lumen(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service.cli", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_cli_model_path_prints_the_folder(default_model_path: Path) -> None:
    result = _lumen("model", "path")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(default_model_path)


def test_cli_errors_are_one_line_without_traceback(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["BertModel"]}))
    for target in (str(tmp_path / "missing"), str(tmp_path)):
        result = _lumen("model", "path", target)
        assert result.returncode == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lumen: error:"), result.stderr
        assert "Traceback" not in result.stderr
