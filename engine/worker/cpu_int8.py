"""Weight-only int8 (``--quantization int8``): each [out, in] weight stored as int8 with one
fp32 scale per output channel (symmetric, absmax / 127), activations kept in the model's dtype.

A weight read in int8 is a quarter of fp32's bytes, and decode at small batches is bound by
reading the weights. On CPU a native kernel (compiled like cpu_attention's, native_build)
multiplies fp32 rows by int8 weights, widening them in registers: each task takes four
output channels by four rows, so a widened weight vector serves four rows. For larger row
counts (prefill chunks) the weight is widened to the activations' dtype and multiplied by
torch's kernel; where the native kernel is faster, up to which row count, is timed at load
on the model's own weight. Without a C compiler, on CUDA, or for other dtypes, every product
widens the weight first: correct, but slower than the unquantized model.
"""

from __future__ import annotations

import ctypes
import subprocess
from dataclasses import dataclass

import torch

from engine.worker import native_build
from engine.worker.cpu_matmul import best_of

# Row counts the native kernel is timed at, against widening, at load; faster at the last,
# it takes every row count.
TIMED_ROWS = (1, 16, 64, 256)

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

typedef float vf __attribute__((vector_size(VL * 4)));
typedef int8_t vb __attribute__((vector_size(VL)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline vf load_w(const int8_t *p) {
    vf out;
#if VL == 16 && defined(__AVX512F__)
    __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
    memcpy(&out, &w, sizeof out);
#elif VL == 8 && defined(__AVX2__)
    __m256 w = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
    memcpy(&out, &w, sizeof out);
#else
    for (int i = 0; i < VL; i++) out[i] = (float)p[i];
#endif
    return out;
}
static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* y[m, n] = (x[m, k] . w[n, k]) * scale[n]; x, y fp32, w int8. k % VL == 0, n % 4 == 0. */
void int8_linear(const float *x, const int8_t *w, const float *scale, float *y, int64_t m,
                 int64_t n, int64_t k, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += 4) {
        const int8_t *w0 = w + j * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
        const float s0 = scale[j], s1 = scale[j + 1], s2 = scale[j + 2], s3 = scale[j + 3];
        int64_t i = 0;
        for (; i + 4 <= m; i += 4) {
            const float *x0 = x + i * k, *x1 = x0 + k, *x2 = x1 + k, *x3 = x2 + k;
            vf a[4][4];
            memset(a, 0, sizeof a);
            for (int64_t t = 0; t < k; t += VL) {
                vf b[4] = {load_w(w0 + t), load_w(w1 + t), load_w(w2 + t), load_w(w3 + t)};
                vf v[4] = {load_f(x0 + t), load_f(x1 + t), load_f(x2 + t), load_f(x3 + t)};
                for (int r = 0; r < 4; r++)
                    for (int c = 0; c < 4; c++) a[r][c] += v[r] * b[c];
            }
            for (int r = 0; r < 4; r++) {
                float *yr = y + (i + r) * n + j;
                yr[0] = hsum(a[r][0]) * s0; yr[1] = hsum(a[r][1]) * s1;
                yr[2] = hsum(a[r][2]) * s2; yr[3] = hsum(a[r][3]) * s3;
            }
        }
        for (; i < m; i++) {
            const float *xr = x + i * k;
            vf a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
            for (int64_t t = 0; t < k; t += VL) {
                vf v = load_f(xr + t);
                a0 += v * load_w(w0 + t); a1 += v * load_w(w1 + t);
                a2 += v * load_w(w2 + t); a3 += v * load_w(w3 + t);
            }
            float *yr = y + i * n + j;
            yr[0] = hsum(a0) * s0; yr[1] = hsum(a1) * s1;
            yr[2] = hsum(a2) * s2; yr[3] = hsum(a3) * s3;
        }
    }
}
"""


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


def plan(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> Plan:
    """Build the native kernel and time it against widening on ``q`` (the model's weight)."""
    if dtype != torch.float32:
        return Plan(None, 0, f"the native kernel takes fp32 activations, not {dtype}")
    vector = native_build.vector_floats()
    try:
        library = native_build.compile_library(
            f"int8_linear_v{vector}", SOURCE, (f"-DVL={vector}",)
        )
        kernel = NativeInt8(str(library), vector)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        return Plan(None, 0, f"the native kernel did not build: {e}")
    if not kernel.fits(q):
        return Plan(None, 0, f"weight {tuple(q.shape)} does not fit the kernel's tiles")
    max_rows, timings = 0, []
    for rows in TIMED_ROWS:
        x = torch.randn(rows, q.shape[1])
        native_s = best_of(lambda: kernel(x, q, scale))  # noqa: B023
        widen_s = best_of(lambda: widened_linear(x, q, scale))  # noqa: B023
        timings.append(f"{rows}: {native_s * 1e3:.2f}/{widen_s * 1e3:.2f}")
        if native_s >= widen_s:
            break
        max_rows = rows
    if max_rows == TIMED_ROWS[-1]:
        max_rows = 1 << 62
    limit = "every row count" if max_rows > TIMED_ROWS[-1] else f"up to {max_rows} rows"
    why = f"native for {limit} (ms native/widened at rows {', '.join(timings)})"
    return Plan(kernel if max_rows else None, max_rows, why)
