"""The CPU matrix-product kernel, chosen by measurement on the machine that runs it.

torch's ``x @ W`` on CPU calls the BLAS it was built with (MKL). On some
CPUs that BLAS does not take its fastest path: measured on an AMD EPYC with
AVX-512, oneDNN's linear on a weight packed once in its own blocked layout
ran 2.0-2.3x faster for prefill chunks (512-2048 rows) and 1.5-4x faster for
decode batches (1-64 rows, the LM head most of all), in fp32 and at fp32's
accuracy. Other CPUs may differ, so the engine times both kernels on the
model's widest weight at load and uses the faster (``LUMEN_CPU_MATMUL``
forces one; the decision is cached per machine and shape, autotune).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from engine import envs
from engine.worker import autotune

# The batch size oneDNN packs a weight for; measured: any hint from 16 up serves every batch
# size from 1 to 2048 alike, a hint of 1 runs batches of 3-64 rows up to 1.6x slower.
PACK_ROWS = 16
TIMED_ROWS = (16, 512)  # a decode batch and a prefill chunk
# The LM head only ever multiplies the rows that sample: decode batches.
HEAD_ROWS = (16, 64)
KERNELS = ("auto", "onednn", "aten")


def onednn_available(dtype: torch.dtype) -> bool:
    """oneDNN's packed products in ``dtype`` run here: fp32 wherever torch has oneDNN, bf16
    only where the CPU has AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT (an AVX2-only CPU
    refuses to pack a bf16 weight)."""
    if not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and _onednn_bf16())


@functools.cache
def _onednn_bf16() -> bool:
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    return bool(supported()) if supported is not None else False


def pack(weight_out_in: torch.Tensor) -> torch.Tensor:
    """An [out, in] weight in oneDNN's blocked layout, for ``onednn_linear``."""
    return torch.ops.mkldnn._reorder_linear_weight(weight_out_in.contiguous(), PACK_ROWS)


def onednn_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


@dataclass(frozen=True)
class Choice:
    kernel: str  # "onednn" or "aten"
    why: str  # the measurement (or the setting) behind it


def choose(
    weight_in_out: torch.Tensor, rows: tuple[int, ...] = TIMED_ROWS, aten_edge: float = 0.0
) -> Choice:
    """The faster kernel for products with ``weight_in_out`` ([in, out], as Linear holds it),
    timed at each of ``rows`` (autotune: cached per machine and shape). ``aten_edge``: oneDNN
    must be faster by more than this fraction (where aten's products gain something beyond
    their own time: fp32's one-call decode layers, cpu_decode_layer)."""
    forced = autotune.forced(envs.LUMEN_CPU_MATMUL, KERNELS)
    if not onednn_available(weight_in_out.dtype):
        return Choice("aten", f"oneDNN does not serve {weight_in_out.dtype} here")
    if forced != autotune.AUTO:
        return Choice(forced, "set by LUMEN_CPU_MATMUL")
    shape = {"weight": list(weight_in_out.shape), "dtype": str(weight_in_out.dtype),
             "rows": list(rows), "aten_edge": aten_edge}  # fmt: skip
    decision = autotune.decide("matmul", shape, lambda: _time_both(weight_in_out, rows, aten_edge))
    return Choice(decision.choice, decision.why)


def _time_both(
    weight_in_out: torch.Tensor, rows: tuple[int, ...], aten_edge: float = 0.0
) -> tuple[str, str]:
    packed = pack(weight_in_out.t())
    total = {"aten": 0.0, "onednn": 0.0}
    for n in rows:
        x = torch.randn(n, weight_in_out.shape[0], dtype=weight_in_out.dtype)
        times = autotune.best_of_each(
            {"aten": lambda: x @ weight_in_out, "onednn": lambda: onednn_linear(x, packed)}  # noqa: B023
        )
        total = {k: total[k] + times[k] for k in total}
    kernel = "onednn" if total["onednn"] * (1 + aten_edge) < total["aten"] else "aten"
    shape = "x".join(map(str, weight_in_out.shape))
    edge = f"; aten unless oneDNN is over {aten_edge:.0%} faster" if aten_edge else ""
    return kernel, (
        f"weight {shape} at {'+'.join(map(str, rows))} rows: "
        f"oneDNN {total['onednn'] * 1e3:.2f} ms, aten {total['aten'] * 1e3:.2f} ms{edge}"
    )
