"""The CPU matrix-product kernel, chosen by measurement on the machine that runs it.

torch's ``x @ W`` on CPU calls the BLAS it was built with (MKL). On some
CPUs that BLAS does not take its fastest path: measured on an AMD EPYC with
AVX-512, oneDNN's linear on a weight packed once in its own blocked layout
ran 2.0-2.3x faster for prefill chunks (512-2048 rows) and 1.5-4x faster for
decode batches (1-64 rows, the LM head most of all), in fp32 and at fp32's
accuracy. Lumen's own kernel (native/f32_panels.c) packs a weight once in
panels of two vectors' columns and beat both at decode batches on an AVX2
EPYC: 16 rows of SmolLM2's products 40 ms against oneDNN's 57 and MKL's 100,
64 rows 108 against 170 and 199. Other CPUs may differ, so the engine times
the kernels on the model's widest weight at load and uses the fastest
(``LUMEN_CPU_MATMUL`` forces one; the decision is cached per machine and
shape, autotune).
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass
from typing import cast

import torch

from engine import envs
from engine.worker import autotune, native_build

# The batch size oneDNN packs a weight for; measured: any hint from 16 up serves every batch
# size from 1 to 2048 alike, a hint of 1 runs batches of 3-64 rows up to 1.6x slower.
PACK_ROWS = 16
TIMED_ROWS = (16, 512)  # a decode batch and a prefill chunk
# The LM head only ever multiplies the rows that sample: decode batches.
HEAD_ROWS = (16, 64)
KERNELS = ("auto", "onednn", "aten", "panels")


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


class Panels(ctypes.Structure):  # f32_panels.c's panels_t
    _fields_ = [("panels", ctypes.c_void_p), ("n", ctypes.c_int64), ("k", ctypes.c_int64)]


class NativePanels:
    """f32_panels.c, compiled once for this machine's vector width: ``pack`` a weight in its
    panels, ``linear`` a product on them; ``address``: the product's C function, which
    decode_layer.c's layers call."""

    def __init__(self) -> None:
        vector = native_build.vector_floats()
        library = autotune.build(f"f32_panels_v{vector}", "f32_panels.c", (f"-DVL={vector}",))
        lib = ctypes.CDLL(str(library))
        self._fn = lib.panels_linear
        self._fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                             ctypes.c_int]  # fmt: skip
        self._fn.restype = ctypes.c_int
        self.width = int(lib.panels_width())
        self.address = ctypes.cast(lib.panels_linear, ctypes.c_void_p).value or 0

    def pack(self, weight_in_out: torch.Tensor) -> tuple[torch.Tensor, Panels]:
        """The [in, out] fp32 weight as [ceil(out / width), in, width] panels (the last one
        padded with zeros), and their description for the C side (it points into them)."""
        k, n = weight_in_out.shape
        count = -(-n // self.width)
        padded = weight_in_out.new_zeros(k, count * self.width)
        padded[:, :n] = weight_in_out
        panels = padded.view(k, count, self.width).permute(1, 0, 2).contiguous()
        return panels, Panels(panels.data_ptr(), n, k)

    def linear(self, x: torch.Tensor, described: Panels) -> torch.Tensor:
        """``x @ W`` for fp32 ``x`` [..., in], W packed by ``pack``."""
        rows = x.reshape(-1, described.k).contiguous()
        y = torch.empty(rows.shape[0], described.n, dtype=torch.float32)
        self._fn(ctypes.addressof(described), rows.data_ptr(), rows.shape[0], y.data_ptr(),
                 torch.get_num_threads())  # fmt: skip
        return y.view(*x.shape[:-1], described.n)


@functools.cache
def panels() -> NativePanels:
    return NativePanels()


def panels_available(dtype: torch.dtype) -> bool:
    """Whether Lumen's panels kernel serves ``dtype`` here (fp32, where it builds)."""
    if dtype != torch.float32:
        return False
    try:
        panels()
    except autotune.BUILD_ERRORS:
        return False
    return True


@dataclass(frozen=True)
class Choice:
    kernel: str  # "onednn", "aten" or "panels"
    why: str  # the measurement (or the setting) behind it


def choose(
    weight_in_out: torch.Tensor,
    rows: tuple[int, ...] = TIMED_ROWS,
    aten_edge: float = 0.0,
    with_panels: bool = True,
) -> Choice:
    """The fastest kernel for products with ``weight_in_out`` ([in, out], as Linear holds it),
    timed at each of ``rows`` (autotune: cached per machine and shape). ``aten_edge``: oneDNN
    must be faster than aten by more than this fraction (where aten's products gain something
    beyond their own time: fp32's one-call decode layers, cpu_decode_layer), and so than
    Lumen's panels, which run in one call too. ``with_panels``: the panels are a candidate
    (the LM head's products are not theirs: there a forced ``panels`` leaves it to the
    timing). Forced, the panels refuse a weight that is not fp32, and fail where they do not
    build, as every forced native kernel does; a forced oneDNN that does not serve the dtype
    leaves it to aten, as before the panels."""
    forced = autotune.forced(envs.LUMEN_CPU_MATMUL, KERNELS)
    dtype = weight_in_out.dtype
    if forced == "panels" and with_panels:
        if dtype != torch.float32:
            raise ValueError(f"LUMEN_CPU_MATMUL=panels: Lumen's panels multiply fp32 weights, "
                             f"and this model's are {dtype}")  # fmt: skip
        panels()  # a build error is the load's
        return Choice("panels", "set by LUMEN_CPU_MATMUL")
    candidates = ["aten"]
    if onednn_available(dtype):
        candidates.append("onednn")
    if forced in ("aten", "onednn"):
        if forced in candidates:
            return Choice(forced, "set by LUMEN_CPU_MATMUL")
        return Choice("aten", f"oneDNN does not serve {dtype} here")
    if with_panels and panels_available(dtype):
        candidates.append("panels")
    if len(candidates) == 1:
        others = "neither oneDNN nor the panels serve" if with_panels else "oneDNN does not serve"
        return Choice("aten", f"{others} {dtype} here")
    shape = {"weight": list(weight_in_out.shape), "dtype": str(weight_in_out.dtype),
             "rows": list(rows), "aten_edge": aten_edge, "kernels": candidates}  # fmt: skip
    decision = autotune.decide(
        "matmul", shape, lambda: _time_each(weight_in_out, rows, candidates, aten_edge)
    )
    return Choice(decision.choice, decision.why)


NAMES = {"aten": "aten", "onednn": "oneDNN", "panels": "panels"}


def _time_each(
    weight_in_out: torch.Tensor, rows: tuple[int, ...], candidates: list[str],
    aten_edge: float = 0.0,
) -> tuple[str, str]:  # fmt: skip
    packed = pack(weight_in_out.t()) if "onednn" in candidates else None
    held, described = panels().pack(weight_in_out) if "panels" in candidates else (None, None)
    total = dict.fromkeys(candidates, 0.0)
    for n in rows:
        x = torch.randn(n, weight_in_out.shape[0], dtype=weight_in_out.dtype)
        products = {
            "aten": lambda: x @ weight_in_out,  # noqa: B023
            "onednn": lambda: onednn_linear(x, cast("torch.Tensor", packed)),  # noqa: B023
            "panels": lambda: panels().linear(x, cast("Panels", described)),  # noqa: B023
        }
        times = autotune.best_of_each({k: products[k] for k in candidates})
        total = {k: total[k] + times[k] for k in total}
    del held
    # oneDNN's products run from Python; aten's and the panels' in the layers' one call.
    score = {k: t * (1 + aten_edge) if k == "onednn" else t for k, t in total.items()}
    kernel = min(score, key=score.__getitem__)
    shape = "x".join(map(str, weight_in_out.shape))
    edge = f"; oneDNN must be over {aten_edge:.0%} faster" if aten_edge else ""
    timed = ", ".join(f"{NAMES[k]} {total[k] * 1e3:.2f} ms" for k in candidates)
    return kernel, f"weight {shape} at {'+'.join(map(str, rows))} rows: {timed}{edge}"
