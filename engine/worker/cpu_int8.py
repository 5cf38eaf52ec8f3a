"""Weight-only int8 (``--quantization int8``): each [out, in] weight stored as int8 with one
fp32 scale per output channel (symmetric, absmax / 127), activations kept in the model's dtype.

A weight read in int8 is a quarter of fp32's bytes, and decode at small batches is bound by
reading the weights. On CPU a native kernel (native/int8_linear.c, built by native_build)
multiplies fp32 rows by int8 weights, widening them in registers: each task takes four
output channels by four rows, so a widened weight vector serves four rows. For larger row
counts (prefill chunks) the weight is widened to the activations' dtype and multiplied by
torch's kernel; where the native kernel is faster, up to which row count, is timed at load
on the model's own weight (autotune; ``LUMEN_CPU_INT8`` forces one). Without a C compiler,
on CUDA, or for other dtypes, every product widens the weight first: correct, but slower
than the unquantized model.

int4's LM head (int8 too) runs int8_q8_linear instead (``q8``): its activations rounded to
8 bits per group of 32, as the int4 kernel's are, and bytes multiplied by bytes with integer
dot products (SmolLM2's head at one row: 0.56 ms against 2.2 with fp32 activations).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from engine import envs
from engine.worker import autotune, native_build, weight_only

# Row counts the native kernel is timed at, against widening, at load; faster at the last,
# it takes every row count.
TIMED_ROWS = (1, 16, 64, 256)
Q8_GROUP = 32  # int8_q8_linear's activation groups


def quantize(weight_out_in: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [out, in], fp32 scale [out])."""
    w = weight_out_in.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous()


def widened_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x @ (q * scale).T in x's dtype: the weight widened for this product."""
    return torch.nn.functional.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


class NativeInt8:
    """The compiled kernel (for this machine's vector width). ``q8``: int8_q8_linear, which
    rounds the activations to 8 bits per group of 32 first and multiplies bytes by bytes
    (int4's LM head; ``path``: 512 for AVX-512 VNNI, 256 for AVX2, 0 for plain C)."""

    def __init__(self, library: str, vector: int, q8: bool = False) -> None:
        self.vector = vector
        self.q8 = q8
        lib = ctypes.CDLL(library)
        fn = lib.int8_q8_linear if q8 else lib.int8_linear
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = ctypes.c_int if q8 else None
        self._fn = fn
        self.path = int(lib.int8_q8_path())

    def fits(self, q: torch.Tensor) -> bool:
        if self.q8:
            return q.shape[1] % Q8_GROUP == 0
        return q.shape[1] % self.vector == 0 and q.shape[0] % 4 == 0

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x: [m, k] fp32; q: [n, k] int8; scale: [n] fp32 -> [m, n] fp32."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
        failed = self._fn(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(),
                          x.shape[0], q.shape[0], q.shape[1], torch.get_num_threads())  # fmt: skip
        if failed:
            raise MemoryError(f"int8_q8_linear: no memory for {x.shape[0]} rows of activations")
        return y


@dataclass(frozen=True)
class Plan:
    """How int8 products run here: the native kernel up to ``max_rows`` rows, widening above."""

    kernel: NativeInt8 | None
    max_rows: int
    why: str

    def linear(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.kernel is not None and x.shape[0] <= self.max_rows and x.dtype == torch.float32:
            return self.kernel(x, q, scale)
        return widened_linear(x, q, scale)


WIDEN_ONLY = Plan(None, 0, "every product widens the weight")


# A narrower path of int8_q8_linear than the CPU's widest (the tests build each it runs).
NARROWER = {"avx2": "-DLUMEN_INT8_AVX2", "plain": "-DLUMEN_INT8_PLAIN"}


def build(q8: bool = False, narrower: str | None = None) -> NativeInt8:
    """The kernel for this machine's vector width (native/int8_linear.c), compiled once;
    ``q8``: its 8-bit activations' product, ``narrower`` (one of NARROWER) forcing its path."""
    vector = native_build.vector_floats()
    defines = (f"-DVL={vector}", *((NARROWER[narrower],) if narrower else ()))
    stem = f"int8_linear_v{vector}{'_' + narrower if narrower else ''}"
    return NativeInt8(str(autotune.build(stem, "int8_linear.c", defines)), vector, q8)


def plan(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, q8: bool = False) -> Plan:
    """Build the native kernel and time it against widening on ``q`` (the model's weight);
    the decision is cached per machine and shape (weight_only.plan_rows)."""

    def products(kernel: NativeInt8) -> weight_only.Products:
        return lambda x: {"native": lambda: kernel(x, q, scale),
                          "widen": lambda: widened_linear(x, q, scale)}  # fmt: skip

    def unfit(kernel: NativeInt8) -> str | None:
        fits = kernel.fits(q)
        return None if fits else f"weight {tuple(q.shape)} does not fit the kernel's tiles"

    shape = {"weight": list(q.shape), "rows": list(TIMED_ROWS), **({"q8": True} if q8 else {})}
    planned = weight_only.plan_rows(
        "int8", envs.LUMEN_CPU_INT8, dtype, lambda: build(q8), products, in_features=q.shape[1],
        timed_rows=TIMED_ROWS, shape=shape, unfit=unfit,
    )  # fmt: skip
    return Plan(*planned)
