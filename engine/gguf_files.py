"""GGUF files: checked, then dequantized and converted once into the model cache.

A GGUF file is read by transformers' own GGUF loader (the `gguf` package underneath), so a
setting the file leaves out falls back exactly as transformers falls back, and the engine is
held to transformers loading the same file; its 4-bit grids are kept beside the weights
(engine/gguf_q4.py) for ``--quantization int4``. The result is a safetensors folder in
LUMEN_HOME/models named after the file and keyed by its content hash: a second start, or
the same file under another path, converts nothing. A conversion is written in a temporary
folder beside the cache and renamed into place whole, so a failure leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
from pathlib import Path

from engine import envs

MAGIC = b"GGUF"
# GGUF's general.architecture -> the families engine/config.py runs.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3")
# Tensor types read as they are; the quantized ones are those the gguf package dequantizes.
_PLAIN_TYPES = ("F32", "F16", "BF16", "F64")


def content_hash(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def cache_dir(path: Path, digest: str) -> Path:
    return envs.lumen_home() / "models" / f"{path.stem}-{digest[:12]}"


def check(path: Path) -> str:
    """The file's architecture; ValueError, in one line, for a file that is not GGUF, one
    cut short, or one whose architecture or tensor types Lumen cannot read."""
    with open(path, "rb") as fh:
        head = fh.read(4)
    if head != MAGIC:
        raise ValueError(f"{path} is not a GGUF file (it starts with {head!r}, not {MAGIC!r})")
    from gguf import GGUFReader, quants

    try:
        reader = GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, struct.error) as e:
        raise ValueError(f"{path} is truncated or damaged: {_first_line(e)}") from None
    size = path.stat().st_size
    end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > size:
        raise ValueError(f"{path} is truncated: its tensors end at byte {end}, the file at {size}")
    field = reader.fields.get("general.architecture")
    arch = field.contents() if field is not None else None
    if arch not in ARCHITECTURES:
        known = ", ".join(ARCHITECTURES)
        raise ValueError(f"{path}: unsupported GGUF architecture {arch!r}: Lumen reads {known}")
    readable = set(_PLAIN_TYPES) | {t.name for t in quants._type_traits}
    odd = sorted({t.tensor_type.name for t in reader.tensors} - readable)
    if odd:
        raise ValueError(f"{path}: unsupported GGUF quantization {', '.join(odd)}")
    return str(arch)


def ensure_converted(path: Path, *, log=print) -> Path:
    """The converted folder of the GGUF file at ``path``, made on first use."""
    path = path.expanduser().resolve()
    check(path)
    digest = content_hash(path)
    target = cache_dir(path, digest)
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        from engine import gguf_q4  # numpy: not before `lumen serve` has spawned its core

        if not (target / gguf_q4.GRIDS_FILE).is_file():  # converted before grids were kept
            gguf_q4.write_grids(path, target)  # best effort: int4 fits its own where it fails
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"lumen: converting {path.name} to safetensors (once, into {target}) ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        out = Path(tmp) / "model"
        convert(path, out)
        os.replace(out, target)
    return target


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to fp32 with transformers and save it, tokenizer included; what
    transformers' loader refuses is a ValueError in one line."""
    try:
        _convert(gguf, out)
    except Exception as e:
        raise ValueError(f"{gguf} could not be converted: {_first_line(e)}") from None


def _convert(gguf: Path, out: Path) -> None:
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
    # Its Q4_0, Q4_1 and Q4_K grids, which --quantization int4 keeps (engine/gguf_q4.py).
    from engine import gguf_q4

    gguf_q4.write_grids(gguf, out)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
