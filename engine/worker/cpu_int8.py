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
    """The compiled kernel (for this machine's vector width)."""

    def __init__(self, library: str, vector: int) -> None:
        self.vector = vector
        fn = ctypes.CDLL(library).int8_linear
        fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
        self._fn = fn

    def fits(self, q: torch.Tensor) -> bool:
        return q.shape[1] % self.vector == 0 and q.shape[0] % 4 == 0

    def __call__(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """x: [m, k] fp32; q: [n, k] int8; scale: [n] fp32 -> [m, n] fp32."""
        x = x.contiguous()
        y = torch.empty(x.shape[0], q.shape[0], dtype=torch.float32)
        self._fn(x.data_ptr(), q.data_ptr(), scale.data_ptr(), y.data_ptr(), x.shape[0],
                 q.shape[0], q.shape[1], torch.get_num_threads())  # fmt: skip
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


def build() -> NativeInt8:
    """The kernel for this machine's vector width (native/int8_linear.c), compiled once."""
    vector = native_build.vector_floats()
    library = autotune.build(f"int8_linear_v{vector}", "int8_linear.c", (f"-DVL={vector}",))
    return NativeInt8(str(library), vector)


def plan(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Plan:
    """Build the native kernel and time it against widening on ``q`` (the model's weight);
    the decision is cached per machine and shape (weight_only.plan_rows)."""

    def products(kernel: NativeInt8) -> weight_only.Products:
        return lambda x: {"native": lambda: kernel(x, q, scale),
                          "widen": lambda: widened_linear(x, q, scale)}  # fmt: skip

    def unfit(kernel: NativeInt8) -> str | None:
        fits = kernel.fits(q)
        return None if fits else f"weight {tuple(q.shape)} does not fit the kernel's tiles"

    planned = weight_only.plan_rows(
        "int8", envs.LUMEN_CPU_INT8, dtype, build, products, in_features=q.shape[1],
        timed_rows=TIMED_ROWS, shape={"weight": list(q.shape), "rows": list(TIMED_ROWS)},
        unfit=unfit,
    )  # fmt: skip
    return Plan(*planned)
