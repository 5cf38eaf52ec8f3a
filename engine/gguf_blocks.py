"""A GGUF file's blocks as they are, kept beside its conversion for ``--quantization gguf``
(engine/worker/cpu_gguf.py): every layer product and the LM head (the embedding, where the file
ties them) whose format the kernel reads, as the raw bytes [rows, row_bytes] and the ggml type
id, in Hugging Face's row order (llama's q and k rows un-permuted as transformers un-permutes
them: each row is whole blocks, so a row moves as it is).

Conversion writes them (BLOCKS_FILE, a safetensors file, ``NAME.blocks`` and ``NAME.type``); a
folder converted before they were kept gets them on its next use (gguf_files.ensure_converted).
A tensor in another format (F16, Q3_K, ...) has no blocks here: under ``gguf`` that product
runs on the conversion's fp32 weight, and the start-up log says how many did."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from engine import gguf_q4

logger = logging.getLogger(__name__)
BLOCKS_FILE = "gguf-blocks.st"  # safetensors; not *.safetensors, which are the weights
# ggml's type ids of the formats engine/worker/cpu_gguf.py reads (its TYPES, without torch).
TYPES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def read_blocks(path: Path, reader: Any = None) -> dict[str, tuple[int, np.ndarray]]:
    """Hugging Face weight name -> (ggml type id, blocks [rows, row_bytes] uint8) for each
    product and the head the file holds in a format of TYPES."""
    kept = {}
    for hf, tensor, heads in gguf_q4.products(path, reader, head=True):
        kind = tensor.tensor_type.name
        if kind not in TYPES:
            continue
        data = np.asarray(tensor.data)
        data = data.reshape(data.shape[0], -1)
        if heads:
            data = gguf_q4.unpermute(data, heads)
        kept[hf] = (TYPES[kind], np.ascontiguousarray(data))
    return kept


def write_blocks(gguf: Path, folder: Path, reader: Any = None) -> int:
    """The file's blocks into ``folder`` (BLOCKS_FILE, written whole); how many weights have
    them. Best effort, as gguf_q4.write_grids: where they cannot be kept, ``gguf`` runs on the
    fp32 conversion and says so."""
    from safetensors.numpy import save_file

    part = folder / f".{BLOCKS_FILE}.{os.getpid()}.part"
    try:
        kept = read_blocks(gguf, reader)
        tensors: dict[str, np.ndarray] = {}
        for name, (kind, blocks) in kept.items():
            tensors[f"{name}.blocks"] = blocks
            tensors[f"{name}.type"] = np.array([kind], dtype=np.int64)
        save_file(tensors, str(part))
        os.replace(part, folder / BLOCKS_FILE)
    except Exception as e:  # safetensors' own errors are plain Exceptions
        logger.warning("%s: its blocks were not kept (%s); --quantization gguf runs on the "
                       "fp32 conversion", gguf.name, e)  # fmt: skip
        with contextlib.suppress(OSError):
            part.unlink()
        return 0
    return len(kept)


def load_blocks(folder: str | Path) -> dict[str, tuple[int, Any]]:
    """BLOCKS_FILE of a converted folder: name -> (ggml type id, blocks as a torch tensor);
    {} where there is none (a model not converted from a GGUF file)."""
    path = Path(folder) / BLOCKS_FILE
    if not path.is_file():
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(str(path))
    except (OSError, SafetensorError) as e:
        logger.warning("%s is unreadable (%s): --quantization gguf runs on fp32", path, e)
        return {}
    return {name[: -len(".blocks")]: (int(tensors[name[: -len(".blocks")] + ".type"][0]), t)
            for name, t in tensors.items() if name.endswith(".blocks")}  # fmt: skip
