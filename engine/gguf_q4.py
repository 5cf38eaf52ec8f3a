"""A GGUF file's own 4-bit grids (Q4_0, Q4_1, Q4_K), kept beside its conversion, so that
``--quantization int4`` keeps the file's 4-bit values instead of fitting new ones.

Lumen's int4 layout (engine/worker/cpu_int4.py) is, per group of 32 inputs of a row,
value = scale * code + minimum with an fp32 scale and minimum. Each of these formats is that
layout, repacked group by group:

- Q4_0, blocks of 32 with an fp16 ``d``: value = d * (q - 8), so scale d, minimum -8 d;
- Q4_1, blocks of 32 with fp16 ``d`` and ``m``: value = d * q + m, so scale d, minimum m;
- Q4_K, super-blocks of 256 with fp16 ``d`` and ``dmin`` and eight 6-bit pairs (sc, m), one
  per sub-block of 32: value = (d * sc) * q - dmin * m, so scale d * sc, minimum -(dmin * m).

Every one of these products is exact in fp32 (an 11-bit d, a 6-bit sc, a 4-bit q), so the
codes fitted to a kept grid, round((w - minimum) / scale), are the file's own, and they stand
for the very fp32 weights transformers read from the file. The worker checks that per weight
(cpu_int4.quantize) and fits its own grid to any weight where it does not hold.

Conversion writes the grids (GRIDS_FILE) with the weights, in Hugging Face's row order:
llama's q and k rows are un-permuted as transformers un-permutes them. A folder converted
before grids were kept gets them on its next use (gguf_files.ensure_converted); a packaged
model's (`make model`) when its folder is removed and fetched again. Other tensor types
(Q5_K, Q6_K, Q8_0, ...) have no grid here: under int4 they are fitted like any fp32 weight.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)
GRIDS_FILE = "gguf-q4-grids.st"  # safetensors; not *.safetensors, which are the weights
FORMATS = ("Q4_0", "Q4_1", "Q4_K")
# The per-layer products of a checkpoint. Phi-3 stores q/k/v and gate/up fused, and gguf's
# name map sends both up_proj and gate_up_proj to ffn_up: each family gets only its own names.
_PRODUCTS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
             "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
_FUSED_PRODUCTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj",
                   "mlp.down_proj")  # fmt: skip
_FUSED_ARCHS = ("phi3",)


def read_grids(path: Path, reader: Any = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Hugging Face weight name -> (scale, minimum), each [out, in / 32] fp32, for every layer
    product the file holds in Q4_0, Q4_1 or Q4_K (``reader``: the file as engine.gguf_read
    read it, where it has been)."""
    grids = {}
    for hf, tensor, heads in products(path, reader):
        kind = tensor.tensor_type.name
        if kind not in FORMATS:
            continue
        scale, minimum = _grid(kind, np.asarray(tensor.data))
        if heads:
            scale, minimum = unpermute(scale, heads), unpermute(minimum, heads)
        grids[hf] = (np.ascontiguousarray(scale), np.ascontiguousarray(minimum))
    return grids


def products(path: Path, reader: Any = None, head: bool = False) -> Iterator[tuple[str, Any, int]]:
    """(Hugging Face weight name, the file's tensor, n_head) for each layer product of the file
    (``head``: the LM head too, the embedding where the file ties them); n_head is the head count
    whose rows transformers un-permutes (llama's q and k), else 0."""
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map

    from engine import gguf_read

    reader = reader if reader is not None else gguf_read.read(path)
    arch = str(reader.fields["general.architecture"].contents())
    field = reader.fields.get(f"{arch}.block_count")
    arch_ids = {name: arch_id for arch_id, name in MODEL_ARCH_NAMES.items()}
    if field is None or arch not in arch_ids:
        return
    num_layers = int(field.contents())
    names = get_tensor_name_map(arch_ids[arch], num_layers)
    to_hf: dict[str, str] = {}
    for i in range(num_layers):
        for product in _FUSED_PRODUCTS if arch in _FUSED_ARCHS else _PRODUCTS:
            hf = f"model.layers.{i}.{product}"
            gguf_name = names.get_name(hf)
            if gguf_name is not None:
                to_hf.setdefault(f"{gguf_name}.weight", f"{hf}.weight")
    if head:
        tied = all(t.name != "output.weight" for t in reader.tensors)
        to_hf["token_embd.weight" if tied else "output.weight"] = "lm_head.weight"
    # transformers un-permutes llama's q and k only where the file gives both head counts.
    heads = _field(reader, f"{arch}.attention.head_count")
    kv_heads = _field(reader, f"{arch}.attention.head_count_kv")
    for tensor in reader.tensors:
        if (name := to_hf.get(tensor.name)) is None:
            continue
        permuted = (
            heads if ".attn_q." in tensor.name else kv_heads if ".attn_k." in tensor.name else None
        )
        yield name, tensor, permuted if arch == "llama" and heads and kv_heads and permuted else 0


def write_grids(gguf: Path, folder: Path, reader: Any = None) -> int:
    """The file's grids into ``folder`` (GRIDS_FILE, written whole; empty where it has none);
    how many weights have one. Best effort: where they cannot be read or written (a read-only
    cache, a full disk, a field of an odd type) none are kept, it says so, and int4 fits its
    own grids; the model starts as it did without them."""
    from safetensors.numpy import save_file

    part = folder / f".{GRIDS_FILE}.{os.getpid()}.part"
    try:
        grids = read_grids(gguf, reader)
        tensors = {f"{name}.{which}": array for name, pair in grids.items()
                   for which, array in zip(("scale", "minimum"), pair)}  # fmt: skip
        save_file(tensors, str(part))
        os.replace(part, folder / GRIDS_FILE)
    except Exception as e:  # safetensors' own errors are plain Exceptions
        logger.warning("%s: its 4-bit grids were not kept (%s); int4 fits its own", gguf.name, e)
        with contextlib.suppress(OSError):
            part.unlink()
        return 0
    return len(grids)


def load_grids(folder: str | Path) -> dict[str, Any]:
    """GRIDS_FILE of a converted folder as torch tensors by name ({} where there is none)."""
    path = Path(folder) / GRIDS_FILE
    if not path.is_file():
        return {}
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        return load_file(str(path))
    except (OSError, SafetensorError) as e:  # a damaged file costs exactness, not the start
        logger.warning("%s is unreadable (%s): int4 fits its own grids", path, e)
        return {}


def _grid(kind: str, data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale, minimum) [rows, groups of 32] of a tensor's raw blocks [rows, bytes]."""
    rows = data.shape[0]
    if kind in ("Q4_0", "Q4_1"):
        size = 18 if kind == "Q4_0" else 20
        blocks = data.reshape(rows, -1, size)
        d = _f16(blocks[..., 0:2])
        if kind == "Q4_0":
            return d, -8.0 * d
        return d, _f16(blocks[..., 2:4])
    from gguf.quants import Q4_K

    blocks = data.reshape(rows, -1, 144)  # d, dmin, 12 bytes of (sc, m), 128 of codes
    d, dmin = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    sc, m = Q4_K.get_scale_min(blocks[..., 4:16].reshape(-1, 12))
    sc = sc.reshape(rows, -1, 8).astype(np.float32)
    m = m.reshape(rows, -1, 8).astype(np.float32)
    scale = (d[..., None] * sc).reshape(rows, -1)
    minimum = -(dmin[..., None] * m).reshape(rows, -1)
    return scale, minimum


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def unpermute(rows: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order back to Hugging Face's (as transformers un-permutes them)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


def _field(reader: Any, key: str) -> int | None:
    field = reader.fields.get(key)
    return int(field.contents()) if field is not None else None
