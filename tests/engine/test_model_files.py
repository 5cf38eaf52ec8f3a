"""Model provisioning: the default model's folder, local folders, and one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from engine.config import ModelConfig
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
    # A window that is on, or a Llama whose config asks for biases.
    config = json.loads((tiny_family_path("qwen2") / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ValueError, match=r"sliding-window attention \(Qwen2ForCausalLM"):
        ModelConfig.from_path(tmp_path)
    llama = {**config, "architectures": ["LlamaForCausalLM"], "attention_bias": True}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ValueError, match=r"sliding-window attention \(LlamaForCausalLM"):
        ModelConfig.from_path(tmp_path)  # for Llama and Mistral, sliding_window is a window
    # Phi-3-mini-4k's window of 2047 is refused; Phi-4-mini's, longer than its context, is none.
    phi3_config = json.loads((tiny_family_path("phi3") / "config.json").read_text())
    for window, refused in ((1024, True), (1 << 20, False)):
        (tmp_path / "config.json").write_text(json.dumps({**phi3_config, "sliding_window": window}))
        if refused:
            with pytest.raises(ValueError, match=r"sliding-window attention \(Phi3ForCausalLM"):
                ModelConfig.from_path(tmp_path)
        else:
            assert ModelConfig.from_path(tmp_path).fused_checkpoint
    llama["sliding_window"] = None
    (tmp_path / "config.json").write_text(json.dumps(llama))
    assert ModelConfig.from_path(tmp_path).o_bias


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
