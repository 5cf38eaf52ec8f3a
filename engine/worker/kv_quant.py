"""8-bit KV caches (``--kv-cache-dtype int8``, ``fp8``): codes and a scale in each row.

A KV cache row is one position's one KV head: ``head_dim`` values. An 8-bit cache stores it
as ``head_dim`` codes and then the row's fp32 scale, in the same row of ``head_dim + 4``
bytes::

    | c0 c1 ... c63 | scale (4 bytes) |      value_i = c_i * scale

    int8: c = round(x / scale), scale = max|x| / 127
    fp8:  c = e4m3(x / scale),  scale = max|x| / 448 (e4m3's largest finite value)

A scale per row (per position and head) follows each key and value as it comes, with no
calibration, and costs 4 bytes a row: at head_dim 64, 68 bytes where fp32 takes 256 (0.27).
Everything that moves rows (the paged cache's writes, the decode mirror's fills and moves,
gathers) moves codes and scale together without knowing which is which; only a write packs
and a read unpacks. fp8 rows are stored as uint8 (torch's CPU index ops do not take float8
tensors): a cache of dtype uint8 holds fp8, one of int8 int8. The native decode attention
reads both in place (native/decode_attention.c).
"""

from __future__ import annotations

import torch

SCALE_BYTES = 4
FP8 = torch.float8_e4m3fn
# The logical KV dtype -> what its cache tensors hold.
STORAGE = {torch.int8: torch.int8, FP8: torch.uint8}
_LARGEST = {torch.int8: 127.0, torch.uint8: 448.0}  # by storage dtype
_TINY = torch.finfo(torch.float32).tiny


def storage_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tensors that hold a ``kv_dtype`` cache."""
    return STORAGE.get(kv_dtype, kv_dtype)


def is_packed(dtype: torch.dtype) -> bool:
    """Whether cache tensors of ``dtype`` (a storage dtype) hold 8-bit rows with scales."""
    return dtype in _LARGEST


def row_width(head_dim: int, kv_dtype: torch.dtype) -> int:
    """Elements of one stored row: ``head_dim``, and the scale's 4 bytes where 8-bit."""
    return head_dim + SCALE_BYTES if is_packed(storage_dtype(kv_dtype)) else head_dim


def pack(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D] values -> [..., D + 4] rows of a ``dtype`` cache (a storage dtype; other
    dtypes: the values cast)."""
    if not is_packed(dtype):
        return x.to(dtype)
    xf = x.to(torch.float32)
    largest = _LARGEST[dtype]
    scale = (xf.abs().amax(-1, keepdim=True) / largest).clamp_min_(_TINY)
    codes = (xf / scale).clamp_(-largest, largest)
    # int8 rounds half to even (as the kernel's lrintf); e4m3's cast rounds to nearest even.
    q = codes.round_().to(torch.int8) if dtype == torch.int8 else codes.to(FP8).view(torch.uint8)
    return torch.cat([q, scale.view(dtype)], -1)


def unpack(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., D + 4] rows of an 8-bit cache -> [..., D] values in ``dtype`` (other caches:
    cast)."""
    if not is_packed(rows.dtype):
        return rows.to(dtype)
    codes = rows[..., :-SCALE_BYTES]
    if rows.dtype == torch.uint8:
        codes = codes.view(FP8)
    scale = rows[..., -SCALE_BYTES:].view(torch.float32)
    return (codes.to(torch.float32) * scale).to(dtype)
