"""Decode attention on CPU in one native kernel, compiled on the machine that runs it.

torch's path for a decode row over its mirror slot (decode_cache.DecodePlan) is
two batched products and a softmax: three passes, each with small matrices
(a KV head's 3 query rows by 64 x context). Measured on an AMD EPYC (AVX-512),
SmolLM2's shapes, 30 layers, cache cold: it read the KV at 11-15 GB/s, where a
plain sum of the same slices reads 29-40 GB/s. This kernel runs one task per
(row, KV head): it writes the row's new K and V into its slot, then takes the
scores of the head's query rows against each K row, a softmax with a
vectorised exp, and one pass over V, in fp32 registers. It reads a bf16 KV
(``--kv-cache-dtype bfloat16``) as directly as an fp32 one, half the bytes.

The source (native/decode_attention.c) is compiled once per machine and model
shape (the group size and head dim are compile-time constants, so the loops
unroll into registers) with the system C compiler (``-O3 -march=native
-ffast-math -fopenmp``, linked without -ffast-math) into LUMEN_HOME/kernels;
it links the OpenMP runtime torch already loaded, so both share one thread
pool. Without a compiler, or where torch's path times faster at load, torch's
path runs (``LUMEN_CPU_ATTENTION`` forces one).
"""

from __future__ import annotations

import ctypes
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import envs
from engine.worker import autotune, kv_quant

KERNELS = ("auto", "native", "torch")
CHUNK = 128  # positions a chunk of the decode mirror holds (Chunks; the kernel's -DCHUNK)
_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int,
                                                            ctypes.c_int64]  # fmt: skip
# The storage dtypes it reads: int8 and uint8 (fp8) are 8-bit rows with a scale (kv_quant.py).
KV_DTYPES = (torch.float32, torch.bfloat16, torch.int8, torch.uint8)
# torch's path: (q [slots, heads, D], k, v, width, mask, scale) -> [slots, heads, D]
TorchPath = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, float], torch.Tensor
]


@dataclass
class Chunks:
    """A layer's K (or V) in the mirror: ``parts[c]`` holds positions ``[c * chunk,
    (c + 1) * chunk)`` of every slot, ``[slots, KVH, chunk, D]``, all with the same strides
    (chunks of their own, or views of one ``[slots, KVH, width, D]`` tensor: ``view``)."""

    parts: list[torch.Tensor]
    chunk: int
    table: torch.Tensor  # int64 [len(parts)]: the parts' addresses, what the kernel reads

    @classmethod
    def of(cls, parts: list[torch.Tensor], chunk: int) -> Chunks:
        table = torch.tensor([p.data_ptr() for p in parts], dtype=torch.int64)
        return cls(parts, chunk, table)

    @classmethod
    def view(cls, tensor: torch.Tensor, chunk: int = CHUNK) -> Chunks:
        """``tensor`` [slots, KVH, width, D] (contiguous) as chunks, in place."""
        return cls.of(list(tensor.split(chunk, dim=2)), chunk)

    @property
    def dtype(self) -> torch.dtype:
        return self.parts[0].dtype

    def write(self, slot: int, start: int, values: torch.Tensor) -> None:
        """Positions [start, start + n) of ``slot`` = values [KVH, n, D]."""
        n, c = values.shape[1], self.chunk
        for pos in range(start - start % c, start + n, c):
            lo, hi = max(pos, start), min(pos + c, start + n)
            self.parts[pos // c][slot, :, lo - pos : hi - pos] = values[:, lo - start : hi - start]

    def read(self, slot: int, n: int) -> torch.Tensor:
        """Positions [0, n) of ``slot``: [KVH, n, D] (a copy where they span chunks)."""
        spans = [p[slot] for p in self.parts[: -(-n // self.chunk)]]
        return torch.cat(spans, dim=1)[:, :n] if len(spans) > 1 else spans[0][:, :n]

    def set_rows(self, slots: torch.Tensor, positions: torch.Tensor, rows: torch.Tensor) -> None:
        """Position positions[i] of slot slots[i] = rows[i] ([nd, KVH, D])."""
        which = positions // self.chunk
        for c in which.unique().tolist():
            at = which == c
            self.parts[c][slots[at], :, positions[at] - c * self.chunk] = rows[at]

    def joined(self, used: int, first: int, width: int) -> torch.Tensor:
        """Slots [0, used), positions [first * chunk, width): [used, KVH, ..., D]."""
        parts = [p[:used] for p in self.parts[first : -(-width // self.chunk)]]
        out = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        return out[:, :, : width - first * self.chunk]


class NativeDecodeAttention:
    """The compiled kernel for one (group, head_dim, chunk)."""

    def __init__(self, library: Path, chunk: int = CHUNK) -> None:
        self.library = library
        self.chunk = chunk  # what it was built with
        lib = ctypes.CDLL(str(library))
        self._fns = {}
        for dtype, name in ((torch.float32, "decode_attention_f32"),
                            (torch.bfloat16, "decode_attention_bf16"),
                            (torch.int8, "decode_attention_i8"),
                            (torch.uint8, "decode_attention_f8")):  # fmt: skip
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    def address(self, dtype: torch.dtype) -> int:
        """The kernel's address for a KV of ``dtype`` (a native caller calls it directly)."""
        return ctypes.cast(self._fns[dtype], ctypes.c_void_p).value or 0

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kb: Chunks,
        vb: Chunks,
        slots: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
        ring: int = 0,
    ) -> torch.Tensor:
        """q: [rows, heads, D]; k, v: [rows, KVH, D], the rows' new K and V, written into
        the mirror first; kb, vb: the layer's mirror in chunks of this kernel's (fp32, bf16,
        or 8-bit rows with their scales: int8, uint8 for fp8); slots, positions: [rows]
        int64. Row r writes its K and V at position positions[r] of slot slots[r], and
        attends to positions [0, positions[r]] there; with ``ring`` (a sliding window's
        mirror, as long as the window), position p lies at place p % ring and the row attends
        to every place it has filled.
        Returns [rows, heads, D] in q's dtype."""
        assert kb.chunk == self.chunk, (kb.chunk, self.chunk)
        qf = q.to(torch.float32).contiguous()
        kf, vf = k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()
        out = torch.empty_like(qf)
        part = kb.parts[0]
        failed = self._fns[kb.dtype](
            qf.data_ptr(), out.data_ptr(), kf.data_ptr(), vf.data_ptr(), kb.table.data_ptr(),
            vb.table.data_ptr(), slots.data_ptr(), positions.data_ptr(), q.shape[0],
            part.shape[1], part.stride(0), part.stride(1), scale, torch.get_num_threads(), ring,
        )  # fmt: skip
        if failed:
            raise MemoryError("decode attention: could not allocate its score buffer")
        return out.to(q.dtype)


@dataclass(frozen=True)
class Choice:
    kernel: NativeDecodeAttention | None  # None: torch's path
    why: str


def build(group: int, head_dim: int, chunk: int = CHUNK) -> Path:
    """The kernel's shared library for this shape (native/decode_attention.c), compiled once."""
    return autotune.build(
        f"decode_attention_g{group}_d{head_dim}" + (f"_c{chunk}" if chunk != CHUNK else ""),
        "decode_attention.c", (f"-DGROUP={group}", f"-DDIM={head_dim}", f"-DCHUNK={chunk}"),
    )  # fmt: skip


def choose(group: int, head_dim: int, kv_dtype: torch.dtype, torch_path: TorchPath) -> Choice:
    """The native kernel where it builds and times faster than torch's path (autotune: the
    decision is cached per machine and shape)."""
    forced = autotune.forced(envs.LUMEN_CPU_ATTENTION, KERNELS)
    if forced == "torch":
        return Choice(None, "set by LUMEN_CPU_ATTENTION")
    if kv_dtype not in KV_DTYPES:
        return Choice(None, f"the native kernel does not read a {kv_dtype} KV")
    t0 = time.perf_counter()
    try:
        kernel = NativeDecodeAttention(build(group, head_dim))
    except autotune.BUILD_ERRORS as e:
        if forced == "native":
            raise RuntimeError(
                f"LUMEN_CPU_ATTENTION=native, but the kernel did not build: {e}"
            ) from e
        return Choice(None, f"the native kernel did not build: {e}")
    built_s = time.perf_counter() - t0
    if forced == "native":
        return Choice(kernel, "set by LUMEN_CPU_ATTENTION")

    def measure() -> tuple[str, str]:
        times = _time_both(kernel, torch_path, group, head_dim, kv_dtype)
        return min(times, key=times.__getitem__), (
            f"16 rows x 512 positions: native {times['native'] * 1e3:.2f} ms, "
            f"torch {times['torch'] * 1e3:.2f} ms; ready in {built_s:.2f} s"
        )

    shape = {"group": group, "head_dim": head_dim, "kv_dtype": str(kv_dtype)}
    decision = autotune.decide("attention", shape, measure)
    return Choice(kernel if decision.choice == "native" else None, decision.why)


def _time_both(
    kernel: NativeDecodeAttention, torch_path: TorchPath, group: int, head_dim: int,
    kv_dtype: torch.dtype, rows: int = 16, context: int = 512, kvh: int = 3,
) -> dict[str, float]:  # fmt: skip
    layers = 8  # distinct buffers, so the timing reads a cold-ish cache as a step does
    shape = (rows, kvh, context, head_dim)
    ks = [kv_quant.pack(torch.randn(shape), kv_dtype) for _ in range(layers)]
    vs = [kv_quant.pack(torch.randn(shape), kv_dtype) for _ in range(layers)]
    q = torch.randn(rows, kvh * group, head_dim)
    k_new = torch.randn(rows, kvh, head_dim)
    slots = torch.arange(rows)
    positions = torch.full((rows,), context - 1)
    mask = torch.zeros(rows, 1, 1, context)

    chunked = [(Chunks.view(k, kernel.chunk), Chunks.view(v, kernel.chunk)) for k, v in zip(ks, vs)]

    def native() -> None:
        for k, v in chunked:
            kernel(q, k_new, k_new, k, v, slots, positions, 0.125)

    def torch_() -> None:  # as the engine runs it: the mirror's chunks joined first
        for k, v in chunked:
            torch_path(q, kv_quant.unpack(k.joined(rows, 0, context), q.dtype),
                       kv_quant.unpack(v.joined(rows, 0, context), q.dtype), context, mask,
                       0.125)  # fmt: skip

    return autotune.best_of_each({"native": native, "torch": torch_}, rounds=3)
