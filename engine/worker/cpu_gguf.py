"""A GGUF file's products in its own formats (``--quantization gguf``): each product's weight
is the file's blocks, as they are, in whichever format the file stores it (Q4_0, Q4_1, Q5_0,
Q8_0, Q4_K, Q5_K, Q6_K; a llama.cpp "Q4_K_M" file mixes several), so a decode step reads the
bytes llama.cpp reads and the values are the file's own, not fitted again.

A native kernel (native/gguf_linear.c) rounds each row of activations to 8 bits per 32 (as the
int4 kernel and llama.cpp do) and multiplies codes by bytes with integer dot products (AVX-512
VNNI, else AVX2); above the row count where it stops winning (timed at load on the model's own
weight, autotune; ``LUMEN_CPU_GGUF`` forces one) the weight is widened to fp32 for oneDNN's
product, bit for bit the values the file's conversion holds (gguf-py's dequantization).
A product that fuses several of the file's tensors (q, k and v; gate and up) keeps each
tensor's rows in its own format (``GGUFWeight.parts``)."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field

import torch

from engine import envs
from engine.gguf_blocks import TYPES
from engine.worker import autotune, cpu_matmul, weight_only

# The formats' blocks by ggml type id (TYPES): (weights, bytes), as the gguf package sizes them
# (GGML_QUANT_SIZES; tested), written out: importing that package costs an engine 0.12 s.
BLOCKS = {2: (32, 18), 3: (32, 20), 6: (32, 22), 8: (32, 34), 12: (256, 144), 13: (256, 176),
          14: (256, 210)}  # fmt: skip
TIMED_ROWS = (1, 4, 16, 64, 256, 1024)  # 1024: prefill chunks, where widening wins
# A narrower path than the CPU's widest, forced at build (the tests build each the CPU runs).
NARROWER = {"avx2": "-DLUMEN_GGUF_AVX2", "plain": "-DLUMEN_GGUF_PLAIN"}


class _Part(ctypes.Structure):  # gguf_linear.c's part_t
    _fields_ = [("type", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("row_bytes", ctypes.c_int64), ("blocks", ctypes.c_void_p)]  # fmt: skip


class _Weight(ctypes.Structure):  # gguf_linear.c's gguf_weight_t
    _fields_ = [("parts", ctypes.c_void_p), ("count", ctypes.c_int64), ("n", ctypes.c_int64),
                ("k", ctypes.c_int64)]  # fmt: skip


@dataclass
class GGUFWeight:
    """An [out, in] weight as the file's blocks: ``parts`` [(ggml type id, blocks [rows,
    row_bytes] uint8)], their rows stacked in order. ``described`` is the C description the
    kernel reads (it points into the parts' tensors, kept alive here)."""

    parts: list[tuple[int, torch.Tensor]]
    in_features: int
    described: _Weight = field(init=False, repr=False)

    def __post_init__(self) -> None:
        for kind, blocks in self.parts:
            if kind not in BLOCKS:
                raise ValueError(f"ggml type {kind} is not a format the gguf kernel reads")
            weights, size = BLOCKS[kind]
            if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
                raise ValueError("a part's blocks are a contiguous [rows, bytes] uint8 tensor")
            if self.in_features % weights or blocks.shape[1] != self.in_features // weights * size:
                raise ValueError(
                    f"{blocks.shape[1]} bytes a row do not hold {self.in_features} weights "
                    f"in blocks of {weights} ({size} bytes each)"
                )
        self._parts = (_Part * len(self.parts))(
            *(_Part(kind, b.shape[0], b.shape[1], b.data_ptr()) for kind, b in self.parts)
        )
        self.described = _Weight(ctypes.addressof(self._parts), len(self.parts),
                                 self.out_features, self.in_features)  # fmt: skip

    @property
    def out_features(self) -> int:
        return sum(int(b.shape[0]) for _, b in self.parts)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() for _, b in self.parts)


def part(kind: str, blocks: torch.Tensor) -> tuple[int, torch.Tensor]:
    """A part from a format's name (one of TYPES) and its blocks."""
    return TYPES[kind], blocks.contiguous()


class NativeGGUF:
    """The compiled kernel (native/gguf_linear.c): ``path`` names the vector code it runs,
    512 (AVX-512 VNNI), 256 (AVX2) or 0 (plain C), all with the same integer sums."""

    def __init__(self, library: str) -> None:
        self.library = lib = ctypes.CDLL(library)
        p, i64, cint = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        self._fn = lib.gguf_linear
        self._fn.argtypes = [p, p, p, i64, cint]
        self._fn.restype = cint
        self._widen = lib.gguf_widen
        self._widen.argtypes = [p, p, cint]
        self._widen.restype = cint
        self.path = int(lib.gguf_linear_path())
        # gguf_product's address: native/decode_layer.c calls it for a layer's products
        self.product_address = ctypes.cast(lib.gguf_product, ctypes.c_void_p).value or 0
        self._scratch = threading.local()  # each thread's fp32 weight, grown as needed

    def __call__(self, x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
        """x: [m, in] fp32 -> [m, out] fp32 (x rounded to 8 bits per 32)."""
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, w.out_features, dtype=torch.float32)
        failed = self._fn(x.data_ptr(), ctypes.addressof(w.described), y.data_ptr(), m,
                          torch.get_num_threads())  # fmt: skip
        if failed:
            raise MemoryError(f"gguf_linear: no memory for {m} rows of {w.in_features}")
        return y

    def dequantize(self, w: GGUFWeight, out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 [out, in] weight, bit for bit gguf-py's dequantization of the blocks."""
        if out is None:
            out = torch.empty(w.out_features, w.in_features, dtype=torch.float32)
        self._widen(ctypes.addressof(w.described), out.data_ptr(), torch.get_num_threads())
        return out

    def widened(self, x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
        """x @ W.T with the weight widened natively into a buffer kept for the next product
        (prefill's many rows, where the kernel is slower), multiplied by oneDNN where torch
        has it: packing the widened weight each time and its product took 3.3 ms at 512 x 640
        x 2048 on an AMD EPYC, torch's own product 6.8."""
        size = w.out_features * w.in_features
        buffer = getattr(self._scratch, "weight", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._scratch.weight = torch.empty(size, dtype=torch.float32)
        weight = self.dequantize(w, buffer[:size].view(w.out_features, w.in_features))
        if cpu_matmul.onednn_available(torch.float32):  # packed afresh: still 2x torch's mm
            y = cpu_matmul.onednn_linear(x.float().contiguous(), cpu_matmul.pack(weight))
        else:
            y = torch.nn.functional.linear(x.float(), weight)
        return y.to(x.dtype)


@dataclass(frozen=True)
class Plan:
    """How the file's products run here: the native kernel up to ``max_rows`` rows, the
    widened weight above (and for activations other than fp32)."""

    kernel: NativeGGUF
    max_rows: int
    why: str

    def linear(self, x: torch.Tensor, w: GGUFWeight) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] <= self.max_rows and x.dtype == torch.float32:
            return self.kernel(rows, w).reshape(*x.shape[:-1], w.out_features)
        return self.kernel.widened(x, w)


def build(narrower: str | None = None) -> NativeGGUF:
    """The kernel for this machine, compiled once; ``narrower``, one of NARROWER, forces that
    path. Unlike int8 and int4 there is no torch fallback: the file's formats need it."""
    defines = (NARROWER[narrower],) if narrower else ()
    library = autotune.build(f"gguf_linear{'_' + narrower if narrower else ''}",
                             "gguf_linear.c", defines)  # fmt: skip
    return NativeGGUF(str(library))


def plan(w: GGUFWeight, dtype: torch.dtype) -> Plan:
    """Build the kernel and time it against widening on ``w`` (the model's weight); the
    decision is cached per machine and shape (weight_only.plan_rows)."""
    try:
        kernel = build()
    except autotune.BUILD_ERRORS as e:
        raise RuntimeError(f"--quantization gguf needs its native kernel, which did not build "
                           f"here (a C compiler: cc, gcc or $CC): {e}") from e  # fmt: skip

    def products(_: object) -> weight_only.Products:  # the kernel built above
        return lambda x: {"native": lambda: kernel(x, w), "widen": lambda: kernel.widened(x, w)}

    planned = weight_only.plan_rows(
        "gguf", envs.LUMEN_CPU_GGUF, dtype, lambda: kernel, products,
        in_features=w.in_features, timed_rows=TIMED_ROWS,
        shape={"weight": [w.out_features, w.in_features], "rows": list(TIMED_ROWS),
               "types": sorted({kind for kind, _ in w.parts})},
    )  # fmt: skip
    chosen, max_rows, why = planned
    return Plan(kernel, max_rows if chosen is not None else 0, why)
