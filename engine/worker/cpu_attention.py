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

The source is compiled once per machine and model shape (the group size and
head dim are compile-time constants, so the loops unroll into registers) with
the system C compiler (``-O3 -march=native -ffast-math -fopenmp``, linked
without -ffast-math) into LUMEN_HOME/kernels;
it links the OpenMP runtime torch already loaded, so both share one thread
pool. Without a compiler, or where torch's path times faster at load, torch's
path runs (``LUMEN_CPU_ATTENTION`` forces one).
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import envs
from engine.worker import native_build
from engine.worker.cpu_matmul import best_of

logger = logging.getLogger(__name__)

KERNELS = ("auto", "native", "torch")

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}
#define FROM_F32(x) (x)
#define TO_F32(x) (x)

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 64); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* q, out: [rows, kvh * GROUP, DIM] fp32; k_new, v_new: [rows, kvh, DIM] fp32, the rows'
   own K and V, written first at position positions[r] of slot slots[r]. k, v: a layer's
   mirror, [slots, kvh, width, DIM]. Row r attends to positions [0, positions[r]] of its
   slot. */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                            \
int NAME(const float *q, float *out, const float *k_new, const float *v_new, T *k, T *v,  \
         const int64_t *slots, const int64_t *positions, int64_t rows, int64_t kvh,       \
         int64_t slot_stride, int64_t head_stride, float scale, int threads) {            \
    int64_t max_n = 0;                                                                    \
    for (int64_t r = 0; r < rows; r++)                                                    \
        if (positions[r] + 1 > max_n) max_n = positions[r] + 1;                           \
    int failed = 0;                                                                       \
    _Pragma("omp parallel num_threads(threads)")                                          \
    {                                                                                     \
        float *s = malloc(sizeof(float) * GROUP * max_n);                                 \
        if (!s) failed = 1;                                                               \
        _Pragma("omp for schedule(static)")                                               \
        for (int64_t task = 0; task < rows * kvh; task++) {                               \
            if (!s) continue;                                                             \
            int64_t r = task / kvh, h = task % kvh, n = positions[r] + 1;                 \
            const float *qh = q + task * GROUP * DIM;                                     \
            T *kh = k + slots[r] * slot_stride + h * head_stride;                         \
            T *vh = v + slots[r] * slot_stride + h * head_stride;                         \
            for (int d = 0; d < DIM; d++) {                                               \
                kh[(n - 1) * DIM + d] = STORE(k_new[task * DIM + d]);                     \
                vh[(n - 1) * DIM + d] = STORE(v_new[task * DIM + d]);                     \
            }                                                                             \
            float mx[GROUP], sum[GROUP], acc[GROUP * DIM];                                \
            for (int g = 0; g < GROUP; g++) mx[g] = -3.0e38f;                             \
            for (int64_t t = 0; t < n; t++) {                                             \
                const T *kr = kh + t * DIM;                                               \
                for (int g = 0; g < GROUP; g++) {                                         \
                    const float *qg = qh + g * DIM;                                       \
                    float a = 0.f;                                                        \
                    _Pragma("omp simd reduction(+:a)")                                    \
                    for (int d = 0; d < DIM; d++) a += qg[d] * LOAD(kr[d]);               \
                    a *= scale;                                                           \
                    s[g * n + t] = a;                                                     \
                    if (a > mx[g]) mx[g] = a;                                             \
                }                                                                         \
            }                                                                             \
            for (int g = 0; g < GROUP; g++) {                                             \
                float z = 0.f, m = mx[g], *sg = s + g * n;                                \
                _Pragma("omp simd reduction(+:z)")                                        \
                for (int64_t t = 0; t < n; t++) {                                         \
                    float e = expf(sg[t] - m);                                            \
                    sg[t] = e;                                                            \
                    z += e;                                                               \
                }                                                                         \
                sum[g] = z;                                                               \
                for (int d = 0; d < DIM; d++) acc[g * DIM + d] = 0.f;                     \
            }                                                                             \
            for (int64_t t = 0; t < n; t++) {                                             \
                const T *vr = vh + t * DIM;                                               \
                for (int g = 0; g < GROUP; g++) {                                         \
                    float p = s[g * n + t], *ag = acc + g * DIM;                          \
                    _Pragma("omp simd")                                                   \
                    for (int d = 0; d < DIM; d++) ag[d] += p * LOAD(vr[d]);               \
                }                                                                         \
            }                                                                             \
            float *oh = out + task * GROUP * DIM;                                         \
            for (int g = 0; g < GROUP; g++) {                                             \
                float inv = 1.f / sum[g];                                                 \
                for (int d = 0; d < DIM; d++) oh[g * DIM + d] = acc[g * DIM + d] * inv;   \
            }                                                                             \
        }                                                                                 \
        free(s);                                                                          \
    }                                                                                     \
    return failed;                                                                        \
}

DECODE_ATTENTION(decode_attention_f32, float, FROM_F32, TO_F32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, from_bf16, to_bf16)
"""

_ARGTYPES = [ctypes.c_void_p] * 8 + [ctypes.c_int64] * 4 + [ctypes.c_float, ctypes.c_int]
KV_DTYPES = (torch.float32, torch.bfloat16)
# torch's path: (q [slots, heads, D], k, v, width, mask, scale) -> [slots, heads, D]
TorchPath = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor, float], torch.Tensor
]


class NativeDecodeAttention:
    """The compiled kernel for one (group, head_dim)."""

    def __init__(self, library: Path) -> None:
        self.library = library
        lib = ctypes.CDLL(str(library))
        self._fns = {}
        for dtype, name in ((torch.float32, "decode_attention_f32"),
                            (torch.bfloat16, "decode_attention_bf16")):  # fmt: skip
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = _ARGTYPES, ctypes.c_int
            self._fns[dtype] = fn

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kb: torch.Tensor,
        vb: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q: [rows, heads, D]; k, v: [rows, KVH, D], the rows' new K and V, written into
        the mirror first; kb, vb: [slots, KVH, width, D] (contiguous, fp32 or bf16);
        slots, positions: [rows] int64. Row r writes its K and V at position positions[r]
        of slot slots[r], and attends to positions [0, positions[r]] there. Returns
        [rows, heads, D] in q's dtype."""
        qf = q.to(torch.float32).contiguous()
        kf, vf = k.to(torch.float32).contiguous(), v.to(torch.float32).contiguous()
        out = torch.empty_like(qf)
        failed = self._fns[kb.dtype](
            qf.data_ptr(), out.data_ptr(), kf.data_ptr(), vf.data_ptr(), kb.data_ptr(),
            vb.data_ptr(), slots.data_ptr(), positions.data_ptr(), q.shape[0], kb.shape[1],
            kb.stride(0), kb.stride(1), scale, torch.get_num_threads(),
        )  # fmt: skip
        if failed:
            raise MemoryError("decode attention: could not allocate its score buffer")
        return out.to(q.dtype)


@dataclass(frozen=True)
class Choice:
    kernel: NativeDecodeAttention | None  # None: torch's path
    why: str


def build(group: int, head_dim: int) -> Path:
    """The kernel's shared library for this shape, compiled once into LUMEN_HOME/kernels."""
    return native_build.compile_library(
        f"decode_attention_g{group}_d{head_dim}", SOURCE, (f"-DGROUP={group}", f"-DDIM={head_dim}")
    )


def choose(group: int, head_dim: int, kv_dtype: torch.dtype, torch_path: TorchPath) -> Choice:
    """The native kernel where it builds and times faster than torch's path."""
    forced = envs.LUMEN_CPU_ATTENTION.get() or "auto"
    if forced not in KERNELS:
        raise ValueError(f"LUMEN_CPU_ATTENTION must be one of {', '.join(KERNELS)}, not {forced!r}")
    if forced == "torch":
        return Choice(None, "set by LUMEN_CPU_ATTENTION")
    if kv_dtype not in KV_DTYPES:
        return Choice(None, f"the native kernel does not read a {kv_dtype} KV")
    t0 = time.perf_counter()
    try:
        kernel = NativeDecodeAttention(build(group, head_dim))
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        if forced == "native":
            raise RuntimeError(
                f"LUMEN_CPU_ATTENTION=native, but the kernel did not build: {e}"
            ) from e
        return Choice(None, f"the native kernel did not build: {e}")
    built_s = time.perf_counter() - t0
    if forced == "native":
        return Choice(kernel, "set by LUMEN_CPU_ATTENTION")
    native_s, torch_s = _time_both(kernel, torch_path, group, head_dim, kv_dtype)
    faster = native_s < torch_s
    return Choice(
        kernel if faster else None,
        f"16 rows x 512 positions: native {native_s * 1e3:.2f} ms, torch {torch_s * 1e3:.2f} ms"
        f"; ready in {built_s:.2f} s",
    )


def _time_both(
    kernel: NativeDecodeAttention, torch_path: TorchPath, group: int, head_dim: int,
    kv_dtype: torch.dtype, rows: int = 16, context: int = 512, kvh: int = 3,
) -> tuple[float, float]:  # fmt: skip
    layers = 8  # distinct buffers, so the timing reads a cold-ish cache as a step does
    shape = (rows, kvh, context, head_dim)
    ks = [torch.randn(shape).to(kv_dtype) for _ in range(layers)]
    vs = [torch.randn(shape).to(kv_dtype) for _ in range(layers)]
    q = torch.randn(rows, kvh * group, head_dim)
    k_new = torch.randn(rows, kvh, head_dim)
    slots = torch.arange(rows)
    positions = torch.full((rows,), context - 1)
    mask = torch.zeros(rows, 1, 1, context)

    def native() -> None:
        for k, v in zip(ks, vs):
            kernel(q, k_new, k_new, k, v, slots, positions, 0.125)

    def torch_() -> None:
        for k, v in zip(ks, vs):
            torch_path(q, k, v, context, mask, 0.125)

    return best_of(native, repeat=3), best_of(torch_, repeat=3)
