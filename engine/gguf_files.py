"""GGUF files: checked, then dequantized and converted once into the model cache.

A GGUF file is read by Lumen's own reader (engine/gguf_read.py), once: its config by
transformers' own GGUF mapping tables and rules, its weights dequantized by the gguf package
and processed by transformers' own tensor processors (llama's q and k rows un-permuted,
Gemma's norms less one), into a model built empty on the meta device and saved as
transformers saves it. The folder is the one transformers' loader made, bit for bit (tested),
so a setting the file leaves out still falls back as transformers falls back. It used to be
that loader itself; it read the file's metadata four times (config, tokenizer, weights, the
4-bit grids) through the gguf package's per-element reader: 33 s of the Gemma 3 270M file's
conversion without its tokenizer, now 5.5 s (docs/benchmarks.md). The tokenizer is still
transformers' (its GGUF vocabulary conversion). Its 4-bit grids are kept beside the weights
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
from typing import Any, cast

from engine import envs

MAGIC = b"GGUF"
# GGUF's general.architecture -> the families engine/model_config.py runs.
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
    from gguf import quants

    from engine import gguf_read

    try:
        reader = gguf_read.read(path)
    except gguf_read.Truncated as e:
        raise ValueError(str(e)) from None
    except (ValueError, IndexError, KeyError, OSError, struct.error, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is truncated or damaged: {_first_line(e)}") from None
    arch = reader.get("general.architecture")
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
        from engine import gguf_blocks, gguf_q4  # numpy: not before `lumen serve` has spawned

        if not (target / gguf_q4.GRIDS_FILE).is_file():  # converted before grids were kept
            gguf_q4.write_grids(path, target)  # best effort: int4 fits its own where it fails
        if not (target / gguf_blocks.BLOCKS_FILE).is_file():  # before blocks were kept
            gguf_blocks.write_blocks(path, target)  # best effort, as the grids
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"lumen: converting {path.name} to safetensors (once, into {target}) ...")
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".convert-") as tmp:
        out = Path(tmp) / "model"
        convert(path, out)
        os.replace(out, target)
    return target


def convert(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` to fp32 and save it, tokenizer included; what cannot be read is a
    ValueError in one line."""
    try:
        _convert(gguf, out)
    except Exception as e:
        raise ValueError(f"{gguf} could not be converted: {_first_line(e)}") from None


def _convert(gguf: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    from engine import gguf_blocks, gguf_q4, gguf_read

    # The tokenizer through transformers, which converts GGUF vocabularies (its own time).
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)
    gf = gguf_read.read(gguf)
    config = _config(gf)
    model = _empty_model(config)
    model.load_state_dict(_weights(gf, config, model), strict=False, assign=True)
    model.tie_weights()  # lm_head is the embedding where the file has no output.weight
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the file has no tensor for {', '.join(missing[:3])}")
    model.save_pretrained(out)
    # Its Q4_0, Q4_1 and Q4_K grids, which --quantization int4 keeps (engine/gguf_q4.py), and
    # its blocks as they are, which --quantization gguf runs on (engine/gguf_blocks.py).
    gguf_q4.write_grids(gguf, out, gf)
    gguf_blocks.write_blocks(gguf, out, gf)


def _config(gf: Any) -> Any:
    """The model's config from the file's metadata, as transformers reads a GGUF file's
    (its own mapping tables and rules, for the families Lumen serves)."""
    from transformers import CONFIG_MAPPING
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    arch = str(gf.get("general.architecture"))
    # transformers tests "mistral" in the list of the file's names: a name exactly "mistral".
    renamed = "mistral" if "llama" in arch and gf.get("general.name") == "mistral" else arch
    config: dict[str, Any] = {
        "tie_word_embeddings": all(t.name != "output.weight" for t in gf.tensors)
    }
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING
    for name, default in defaults.get(renamed, defaults.get(arch) or {}).items():
        config.setdefault(name, default)
    mapping = cast("dict[str, dict[str, Any]]", GGUF_CONFIG_MAPPING)
    for key, field in gf.fields.items():
        prefix, _, rest = key.replace(arch, renamed).partition(".")
        value = field.value
        if isinstance(value, list) and len(value) == 1:
            value = value[0]  # transformers reads a one-element array as its element
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, renamed)
        target = mapping.get(prefix, {}).get(rest, -1)
        if target is not None and target != -1:
            config[target] = value
    if config["model_type"] == "gemma3":
        config["model_type"] = "gemma3_text"  # the file holds the text backbone alone
    if "vocab_size" not in config and gf.get("tokenizer.ggml.tokens") is not None:
        config["vocab_size"] = len(gf.get("tokenizer.ggml.tokens"))
    return CONFIG_MAPPING[config["model_type"]].from_dict(config)


def _empty_model(config: Any) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def _weights(gf: Any, config: Any, model: Any) -> dict[str, Any]:
    """The file's tensors dequantized to fp32 under their Hugging Face names, processed as
    transformers processes them (llama's q and k rows un-permuted, Gemma's norms less one)."""
    import numpy as np
    import torch
    from gguf import dequantize
    from transformers.modeling_gguf_pytorch_utils import (
        TENSOR_PROCESSORS,
        TensorProcessor,
        get_gguf_hf_weights_map,
    )

    arch = str(gf.get("general.architecture"))
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    out = {}
    for t in gf.tensors:
        got = processor.process(weights=dequantize(t.data, t.tensor_type), name=t.name,
                                tensor_key_mapping=names, parsed_parameters={})  # fmt: skip
        if got.name in names:
            out[names[got.name]] = torch.from_numpy(np.array(got.weights, dtype=np.float32))
    return out


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
