"""A GGUF file's metadata and tensors, read once and fast.

The gguf package's reader builds every metadata value out of numpy views, one element at a
time: a 262,144-token vocabulary is millions of them, 14 s a read of the Gemma 3 270M file on
a 2-core EPYC, and a transformers conversion read the file four times (its config, its
tokenizer, its weights, our 4-bit grids). Here the header is parsed in one pass (arrays of
numbers in one numpy call each, strings in a loop over the bytes) and the tensors are views
of one memory map, shaped as the gguf package shapes them (``GGUFFile.tensors``: numpy order,
raw bytes for quantized types), so ``gguf.quants.dequantize`` reads them as it reads its own.

The format (github.com/ggml-org/ggml, docs/gguf.md): magic, version (2 or 3), tensor and
key-value counts; key-value pairs; tensor infos (name, dims in ggml order, type, offset);
padding to ``general.alignment`` (32); the tensors' data.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MAGIC = b"GGUF"
# GGUF value types -> numpy dtypes (8: string, 9: array are parsed apart).
_NUMBERS = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
            6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}  # fmt: skip


class Truncated(ValueError):
    """The file ends before its tensors do."""


# Tensor types the gguf package hands over as numbers (the others as raw bytes).
_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
          "I16": np.int16, "I32": np.int32, "I64": np.int64}  # fmt: skip


@dataclass
class Field:
    """One metadata value: a number, a string, or a list of them (``contents``, as the gguf
    package's ReaderField gives it)."""

    name: str
    value: Any

    def contents(self) -> Any:
        return self.value


@dataclass
class Tensor:
    name: str
    shape: tuple[int, ...]  # ggml order (innermost first), as in the file
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # numpy order: numbers for F16/F32/F64/I*, raw bytes [..., row bytes] else


@dataclass
class GGUFFile:
    path: Path
    fields: dict[str, Field]
    tensors: list[Tensor]

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.value


def read(path: Path) -> GGUFFile:
    """The file's metadata and its tensors as views of one memory map; ValueError for a file
    that is not GGUF or is cut short."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quant_shape_to_byte_shape

    mm = np.memmap(path, dtype=np.uint8, mode="r")
    buf = mm.data  # one buffer: the header is parsed from it in place
    if bytes(buf[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    version, n_tensors, n_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} (Lumen reads 2 and 3)")
    reader = _Cursor(buf, 24)
    fields = {}
    for _ in range(n_kv):
        key = reader.string()
        fields[key] = Field(key, reader.value(reader.u32()))
    infos = []
    for _ in range(n_tensors):
        name = reader.string()
        dims = tuple(int(d) for d in struct.unpack_from(f"<{reader.u32()}Q", buf, reader.at))
        reader.at += 8 * len(dims)
        kind, offset = struct.unpack_from("<IQ", buf, reader.at)
        reader.at += 12
        infos.append((name, dims, GGMLQuantizationType(kind), offset))
    alignment = int(fields["general.alignment"].value) if "general.alignment" in fields else 32
    start = -(-reader.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))
        raw = quant_shape_to_byte_shape(shape, kind)
        size = int(np.prod(raw))
        begin = start + offset
        if begin + size > len(mm):
            raise Truncated(f"{path} is truncated: its tensors end at byte {begin + size}, "
                            f"the file at {len(mm)}")  # fmt: skip
        data = mm[begin : begin + size]
        typed = _TYPED.get(kind.name)
        data = data.view(typed).reshape(shape) if typed is not None else data.reshape(raw)
        tensors.append(Tensor(name, dims, kind, data))
    return GGUFFile(path, fields, tensors)


class _Cursor:
    """Reads the header's values in order."""

    def __init__(self, buf: memoryview, at: int) -> None:
        self.buf, self.at = buf, at

    def u32(self) -> int:
        (v,) = struct.unpack_from("<I", self.buf, self.at)
        self.at += 4
        return int(v)

    def u64(self) -> int:
        (v,) = struct.unpack_from("<Q", self.buf, self.at)
        self.at += 8
        return int(v)

    def string(self) -> str:
        n = self.u64()
        s = bytes(self.buf[self.at : self.at + n]).decode("utf-8", errors="replace")
        self.at += n
        return s

    def value(self, kind: int) -> Any:
        if kind == 8:
            return self.string()
        if kind == 9:
            return self.array()
        dtype = np.dtype(_NUMBERS[kind])
        v = np.frombuffer(self.buf, dtype, 1, self.at)[0]
        self.at += dtype.itemsize
        return v.item()

    def array(self) -> list[Any]:
        kind, n = self.u32(), self.u64()
        if kind == 8:
            return [self.string() for _ in range(n)]
        if kind == 9:
            return [self.array() for _ in range(n)]
        dtype = np.dtype(_NUMBERS[kind])
        values = np.frombuffer(self.buf, dtype, n, self.at)
        self.at += dtype.itemsize * n
        return values.tolist()
