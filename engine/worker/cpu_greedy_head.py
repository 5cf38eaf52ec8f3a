"""Greedy decoding's LM head and argmax without the logits, in native kernels compiled on
the machine that runs them.

A batch whose rows all sample greedily (no penalties, logprobs or grammar) needs
each row's best token, not its logits. torch's path writes the [rows, vocab]
logits and reads them back for the argmax: for a small model at 64 rows that is
12.6 MB written and read per step (SmolLM2's 49,152-token vocabulary), and in the
tiny test model the head and argmax were over half of the engine core's time.
Two paths instead:

- fused (fp32): a few rows times a block of 64 vocabulary rows in registers (the
  weight packed once, block by block, transposed), keeping each row's best value
  and index per lane; no logits are written.
- screened: bf16 logits by oneDNN, which is several times faster than fp32 where
  the CPU has AMX or AVX-512 BF16, then one pass that recomputes in fp32 every
  token whose bf16 logit is within the rounding bound of the row's best
  (ScreenedHead): the answer is fp32's argmax, not bf16's.

Ties go to the lowest index, as torch's argmax does. At load each path is timed
against torch's head and argmax (the LM head as cpu_matmul chose it) at 1, 16, 64
and 256 rows, and a batch takes the fastest at the smallest timed row count at or
above its own (``LUMEN_CPU_GREEDY_HEAD`` forces one; the decision is cached, autotune).
Without a compiler, on CUDA or in bf16, torch's path runs. The kernels' source is
native/greedy_head.c.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from engine import envs
from engine.worker import autotune, cpu_matmul, native_build

KERNELS = ("auto", "fused", "screened", "torch")
TIMED_ROWS = (1, 16, 64, 256)
ROWS_PER_TILE = 6


class FusedHead:
    """The fused fp32 path: the compiled kernel and the head weight packed for it."""

    def __init__(self, library: str, weight: torch.Tensor, vector: int, per_block: int) -> None:
        lib = ctypes.CDLL(library)
        lib.greedy_head_pack.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int64] * 2
        lib.greedy_head_pack.restype = None
        lib.greedy_head.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        lib.greedy_head.restype = None
        self._fn = lib.greedy_head
        self.vocab, self.hidden = weight.shape
        block = vector * per_block
        weight = weight.detach().float().contiguous()
        self.packed = torch.empty(-(-self.vocab // block) * block * self.hidden)
        lib.greedy_head_pack(weight.data_ptr(), self.packed.data_ptr(), self.vocab, self.hidden)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """h: [rows, hidden] fp32 -> each row's argmax over the vocabulary (int64)."""
        h = h.contiguous()
        out = torch.empty(h.shape[0], dtype=torch.int64)
        self._fn(h.data_ptr(), self.packed.data_ptr(), out.data_ptr(), h.shape[0],
                 self.hidden, self.vocab, torch.get_num_threads())  # fmt: skip
        return out


class ScreenedHead:
    """bf16 logits (oneDNN, where the CPU multiplies bf16 fast), then ``screened_argmax``:
    the same token as fp32's argmax, for the cost of a bf16 product and a pass over it.

    The bound on a bf16 logit's error before its own rounding: each input rounds by at
    most 2^-8 of itself, so a product by 2^-7 + 2^-16 of |x_t w_t|, and fp32 accumulation
    adds k 2^-24 more of the same sum; that sum is at most |x| |w_j| (Cauchy-Schwarz), and
    |w_j| at most the head's largest row norm. Taken with a margin."""

    def __init__(self, library: str, weight: torch.Tensor) -> None:
        fn = ctypes.CDLL(library).screened_argmax
        fn.argtypes = [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 3 + [ctypes.c_int]
        fn.restype = None
        self._fn = fn
        self.weight = weight.detach().contiguous()
        self.vocab, self.hidden = self.weight.shape
        self.packed = cpu_matmul.pack(self.weight.bfloat16())
        rel = 2.0**-7 + 2.0**-15 + self.hidden * 2.0**-23
        self.scale = float(self.weight.norm(dim=1).max()) * rel * 1.05

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        h = h.contiguous()
        logits = cpu_matmul.onednn_linear(h.bfloat16(), self.packed).contiguous()
        err = (h.norm(dim=1) * self.scale).contiguous()
        out = torch.empty(h.shape[0], dtype=torch.int64)
        self._fn(logits.data_ptr(), h.data_ptr(), self.weight.data_ptr(), err.data_ptr(),
                 out.data_ptr(), h.shape[0], self.hidden, self.vocab,
                 torch.get_num_threads())  # fmt: skip
        return out


Path = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Plan:
    """Which path takes a batch of each size: ``paths`` holds (up to this many rows, path)
    in ascending order, the last for any larger batch; a path of None is torch's head and
    argmax."""

    paths: tuple[tuple[int, Path | None], ...]
    why: str

    def path(self, rows: int) -> Path | None:
        for limit, path in self.paths:
            if rows <= limit:
                return path
        return None


TORCH_ONLY = Plan((), "torch's head and argmax")
EVERY = 1 << 62


def build() -> tuple[str, int, int]:
    """The kernels' library for this CPU (native/greedy_head.c): (its path, fp32 lanes per
    vector, vectors per vocabulary block)."""
    vector = native_build.vector_floats()
    per_block = 4 if vector == 16 else 2  # accumulators: rows x per_block vectors in registers
    defines = (f"-DVL={vector}", f"-DNV={per_block}", f"-DR={ROWS_PER_TILE}")
    library = autotune.build(f"greedy_head_v{vector}", "greedy_head.c", defines)
    return str(library), vector, per_block


def plan(weight: torch.Tensor, torch_path: Path, torch_kernel: str = "aten") -> Plan:
    """Build the kernels on ``weight`` ([vocab, hidden], the LM head) and time each path
    against ``torch_path`` (hidden rows -> token ids; ``torch_kernel`` names its product) at
    TIMED_ROWS: a batch takes the fastest at the smallest timed row count at or above its
    own (autotune: the decision is cached per machine and shape)."""
    forced = autotune.forced(envs.LUMEN_CPU_GREEDY_HEAD, KERNELS)
    if forced == "torch":
        return Plan((), "torch's head and argmax, set by LUMEN_CPU_GREEDY_HEAD")
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return Plan((), f"the native kernels take an fp32 CPU head, not {weight.dtype}")
    paths = _Paths(weight)
    if forced != autotune.AUTO:
        try:
            path = paths.get(forced)
        except autotune.BUILD_ERRORS as e:
            raise RuntimeError(
                f"LUMEN_CPU_GREEDY_HEAD={forced}, but the kernel did not build: {e}"
            ) from e
        if path is None:
            raise RuntimeError(f"LUMEN_CPU_GREEDY_HEAD={forced}, but oneDNN has no bf16 here")
        return Plan(((EVERY, path),), f"{forced}, set by LUMEN_CPU_GREEDY_HEAD")
    shape = {"vocab": weight.shape[0], "hidden": weight.shape[1], "torch": torch_kernel,
             "rows": list(TIMED_ROWS)}  # fmt: skip
    try:
        decision = autotune.decide("greedy_head", shape, lambda: _time_paths(paths, torch_path))
        chosen = tuple(
            (EVERY if rows == TIMED_ROWS[-1] else rows, paths.get(name))
            for rows, name in zip(TIMED_ROWS, decision.choice)
        )
    except autotune.BUILD_ERRORS as e:
        return Plan((), f"the native kernel did not build: {e}")
    return Plan(chosen, decision.why)


class _Paths:
    """The native paths on one head weight, each built and packed at its first use (a cached
    decision builds only the paths it takes)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._built: dict[str, Path] = {}

    def names(self) -> tuple[str, ...]:
        return ("fused", "screened") if cpu_matmul.onednn_available(torch.bfloat16) else ("fused",)

    def get(self, name: str) -> Path | None:
        """The path ``name`` (None: torch's, or one this machine cannot run)."""
        if name not in self.names():
            return None
        if name not in self._built:
            library, vector, per_block = build()
            self._built[name] = (
                FusedHead(library, self.weight, vector, per_block)
                if name == "fused"
                else ScreenedHead(library, self.weight)
            )
        return self._built[name]


def _time_paths(paths: _Paths, torch_path: Path) -> tuple[list[str], str]:
    names, timings = [], []
    for rows in TIMED_ROWS:
        h = torch.randn(rows, paths.weight.shape[1])
        # get gives None only for a name outside names()
        candidates = cast("dict[str, Path]", {name: paths.get(name) for name in paths.names()})
        candidates["torch"] = torch_path
        times = autotune.best_of_each({n: functools.partial(p, h) for n, p in candidates.items()})
        name = min(times, key=times.__getitem__)
        names.append(name)
        each = ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items())
        timings.append(f"{rows} rows: {name} ({each} ms)")
    return names, "; ".join(timings)
