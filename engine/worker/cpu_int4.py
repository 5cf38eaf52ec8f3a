"""Weight-only 4-bit (``--quantization int4``): each [out, in] weight in groups of 32 inputs,
each group a scale, a minimum and 32 four-bit codes (value = scale * code + minimum: GGUF's
Q4_1, with fp32 scale and minimum).

Decode at one stream is bound by the bytes of the weights it reads: 6 bits per weight here
(4 of code, and the fp32 scale and minimum: 64 bits a group), against 8 for int8, 32 for fp32.
A native kernel (native/int4_linear.c, built by native_build) rounds each row of activations to
8 bits per group of 32 (as llama.cpp's Q4 x Q8 products do) and multiplies codes by bytes with
integer dot products (AVX-512 VNNI, else AVX2); above the row count where it stops winning
(timed at load on the model's own weight, autotune; ``LUMEN_CPU_INT4`` forces one) and
without a C compiler the weight is widened to fp32 for the product, with fp32 activations (in
one native pass into a buffer kept for the next product where the kernel built, with torch
where it did not).
cpu_decode_layer runs a whole decoder layer of a decode step through the same kernel.

A width that is not a whole number of groups is padded with zero weights, and its
activations with zeros, to the next group."""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

from engine import envs
from engine.worker import autotune, weight_only

GROUP = 32
# Timed up to 256 rows alone, the kernel won at every count in one start on the AVX2 EPYC (7.35
# ms against 8.19 widened at 256; it lost at the next start, 6.96 against 6.34), so every row
# count went to it, and a 512-row prefill took 1162 ms where widening took 1038. Timing 1024 rows
# too puts the crossover between timed counts.
TIMED_ROWS = (1, 4, 16, 64, 256, 1024)


@dataclass
class Q4Weight:
    """A [out, in] weight in 4-bit groups: ``codes`` [out, in_padded / 2] uint8 (byte i of a
    group: element i low, element i + 16 high), ``scale`` and ``minimum`` [out, groups] fp32."""

    codes: torch.Tensor
    scale: torch.Tensor
    minimum: torch.Tensor
    in_features: int  # before padding

    @property
    def padded(self) -> int:
        return self.codes.shape[1] * 2

    @property
    def out_features(self) -> int:
        return int(self.codes.shape[0])


def quantize(weight_out_in: torch.Tensor) -> Q4Weight:
    """Asymmetric 4-bit per group of 32: scale (max - min) / 15, code round((w - min) / scale)."""
    g, k = _groups(weight_out_in)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    return _fit(g, (hi - lo) / 15.0, lo, k)


def quantize_on_grid(
    weight_out_in: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor
) -> Q4Weight | None:
    """The weight's codes on a grid (scale, minimum) [out, groups] its values already lie on
    (a GGUF file's, engine/gguf_q4.py); None where those codes do not give back exactly the
    weight (quantize fits a grid of its own then)."""
    g, k = _groups(weight_out_in)
    if scale.shape != g.shape[:2] or minimum.shape != g.shape[:2]:
        return None
    scale, minimum = (t.to(g.device, torch.float32).contiguous() for t in (scale, minimum))
    q = _fit(g, scale, minimum, k)
    return q if torch.equal(dequantize(q), weight_out_in.detach().float()) else None


def _groups(weight_out_in: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The weight in fp32 as [out, groups, 32], zero-padded to whole groups; its width."""
    w = weight_out_in.detach().float()
    out, k = w.shape
    padded = -(-k // GROUP) * GROUP
    if padded != k:
        w = torch.nn.functional.pad(w, (0, padded - k))
    return w.reshape(out, padded // GROUP, GROUP), k


def _fit(g: torch.Tensor, scale: torch.Tensor, lo: torch.Tensor, k: int) -> Q4Weight:
    """The codes of the groups ``g`` on the grid (scale, lo)."""
    out, groups, _ = g.shape
    safe = torch.where(scale != 0, scale, torch.ones_like(scale))  # Q4_0's d can be < 0
    codes = torch.round((g - lo[..., None]) / safe[..., None]).clamp_(0, 15).to(torch.uint8)
    packed = codes[..., :16] | (codes[..., 16:] << 4)
    return Q4Weight(packed.reshape(out, groups * GROUP // 2).contiguous(), scale.contiguous(),
                    lo.contiguous(), k)  # fmt: skip


def dequantize(q: Q4Weight) -> torch.Tensor:
    """The fp32 [out, in] weight the codes stand for."""
    c = q.codes.reshape(q.out_features, -1, GROUP // 2)
    codes = torch.cat([c & 15, c >> 4], dim=2).float()
    w = codes * q.scale[..., None] + q.minimum[..., None]
    return w.reshape(q.out_features, q.padded)[:, : q.in_features]


def widened_linear(x: torch.Tensor, q: Q4Weight) -> torch.Tensor:
    """x @ W.T with the weight widened to x's dtype for this product (prefill's path)."""
    return torch.nn.functional.linear(x, dequantize(q).to(x.dtype))


class NativeInt4:
    """The compiled kernel (native/int4_linear.c): ``path`` names the vector code it runs,
    512 (AVX-512 VNNI), 256 (AVX2) or 0 (plain C), all with the same integer sums."""

    def __init__(self, library: str) -> None:
        self.library = lib = ctypes.CDLL(library)
        fn = lib.int4_linear
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int
        self._fn = fn
        self.path = int(lib.int4_linear_path())
        # int4_product's address: native/decode_layer.c calls it for a layer's products
        self.product_address = ctypes.cast(lib.int4_product, ctypes.c_void_p).value or 0
        widen = lib.int4_widen
        widen.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        widen.restype = None
        self._widen = widen
        self._scratch = threading.local()  # each thread's fp32 weight, grown as needed

    def __call__(self, x: torch.Tensor, q: Q4Weight) -> torch.Tensor:
        """x: [m, in] fp32 -> [m, out] fp32 (x quantized to 8 bits per group of 32)."""
        if x.shape[1] != q.padded:
            x = torch.nn.functional.pad(x, (0, q.padded - x.shape[1]))
        x = x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, q.out_features, dtype=torch.float32)
        failed = self._fn(x.data_ptr(), q.codes.data_ptr(), q.scale.data_ptr(),
                          q.minimum.data_ptr(), y.data_ptr(), m, q.out_features, q.padded,
                          torch.get_num_threads())  # fmt: skip
        if failed:
            raise MemoryError(f"int4_linear: no memory for {m} rows of {q.padded} activations")
        return y

    def widened(self, x: torch.Tensor, q: Q4Weight) -> torch.Tensor:
        """``widened_linear`` for fp32 x, the same weight values widened natively into a
        buffer kept for the next product (prefill's many rows, where the kernel is slower)."""
        size = q.out_features * q.in_features
        buffer = getattr(self._scratch, "weight", None)
        if buffer is None or buffer.numel() < size:
            buffer = self._scratch.weight = torch.empty(size, dtype=torch.float32)
        weight = buffer[:size].view(q.out_features, q.in_features)
        self._widen(q.codes.data_ptr(), q.scale.data_ptr(), q.minimum.data_ptr(),
                    weight.data_ptr(), q.out_features, q.padded, q.in_features,
                    torch.get_num_threads())  # fmt: skip
        return torch.nn.functional.linear(x, weight)


@dataclass(frozen=True)
class Plan:
    """How 4-bit products run here: the native kernel up to ``max_rows`` rows, widening above."""

    kernel: NativeInt4 | None
    max_rows: int
    why: str

    def linear(self, x: torch.Tensor, q: Q4Weight) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if self.kernel is None or x.dtype != torch.float32:
            return widened_linear(x, q)
        if rows.shape[0] <= self.max_rows:
            return self.kernel(rows, q).reshape(*x.shape[:-1], q.out_features)
        return self.kernel.widened(x, q)


WIDEN_ONLY = Plan(None, 0, "every product widens the weight")


# A narrower path than the CPU's widest, forced at build (the tests build each the CPU runs).
NARROWER = {"avx2": "-DLUMEN_INT4_AVX2", "plain": "-DLUMEN_INT4_PLAIN"}


def build(narrower: str | None = None) -> NativeInt4:
    """The kernel for this machine (native/int4_linear.c), compiled once; ``narrower``, one of
    NARROWER, forces that path."""
    defines = (NARROWER[narrower],) if narrower else ()
    library = autotune.build(f"int4_linear{'_' + narrower if narrower else ''}", "int4_linear.c",
                             defines)  # fmt: skip
    return NativeInt4(str(library))


def plan(q: Q4Weight, dtype: torch.dtype) -> Plan:
    """Build the native kernel and time it against widening on ``q`` (the model's weight);
    the decision is cached per machine and shape (weight_only.plan_rows)."""

    def products(kernel: NativeInt4) -> weight_only.Products:
        return lambda x: {"native": lambda: kernel(x, q), "widen": lambda: kernel.widened(x, q)}

    planned = weight_only.plan_rows(
        "int4", envs.LUMEN_CPU_INT4, dtype, build, products, in_features=q.in_features,
        timed_rows=TIMED_ROWS, shape={"weight": [q.out_features, q.padded],
                                      "rows": list(TIMED_ROWS)},
    )  # fmt: skip
    return Plan(*planned)
