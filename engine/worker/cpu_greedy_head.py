"""Greedy decoding's LM head and argmax in one native pass, compiled on the machine that runs it.

A batch whose rows all sample greedily (no penalties, logprobs or grammar) needs
each row's best token, not its logits. torch's path writes the [rows, vocab]
logits and reads them back for the argmax: for a small model at 64 rows that is
12.6 MB written and read per step (SmolLM2's 49,152-token vocabulary), and in the
tiny test model the head and argmax were over half of the engine core's time.
This kernel multiplies a few rows by a block of 64 vocabulary rows in registers
(the weight packed once, block by block, transposed) and keeps each row's best
value and index per lane; no logits are written. Ties go to the lowest index,
as torch's argmax does.

Like cpu_int8's kernel it is timed at load against the model's own head and
argmax (the LM head as cpu_matmul chose it) at 1, 16, 64 and 256 rows, and takes
the row counts up to the first it loses at (``LUMEN_CPU_GREEDY_HEAD`` forces
one path). Without a compiler, on CUDA or in bf16, torch's path runs.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import envs
from engine.worker import native_build
from engine.worker.cpu_matmul import best_of

KERNELS = ("auto", "native", "torch")
TIMED_ROWS = (1, 16, 64, 256)
ROWS_PER_TILE = 6

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <omp.h>
#include <stdlib.h>

/* VL: fp32 lanes per vector; NV: vectors per vocabulary block; R: rows per tile. */
#define NB (VL * NV)
typedef float vf __attribute__((vector_size(VL * 4)));
typedef int32_t vi __attribute__((vector_size(VL * 4)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

/* Pack w [v, k] (row-major) into blocks [v / NB (rounded up)][k][NB], zero-padded. */
void greedy_head_pack(const float *w, float *packed, int64_t v, int64_t k) {
    int64_t blocks = (v + NB - 1) / NB;
    #pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++)
        for (int64_t t = 0; t < k; t++)
            for (int64_t j = 0; j < NB; j++) {
                int64_t row = b * NB + j;
                packed[(b * k + t) * NB + j] = row < v ? w[row * k + t] : 0.f;
            }
}

static inline __attribute__((always_inline)) void tile(
    int rows, const float *x, const float *pb, int64_t k, int64_t base, int64_t v,
    vf *bestv, vi *besti) {
    vf acc[R][NV];
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < NV; c++) acc[r][c] = (vf){0};
    for (int64_t t = 0; t < k; t++) {
        vf w[NV];
        for (int c = 0; c < NV; c++) w[c] = load_f(pb + t * NB + c * VL);
        for (int r = 0; r < rows; r++) {
            vf xr = (vf){0} + x[r * k + t];
            for (int c = 0; c < NV; c++) acc[r][c] += xr * w[c];
        }
    }
    vi lane;
    for (int j = 0; j < VL; j++) lane[j] = j;
    for (int r = 0; r < rows; r++)
        for (int c = 0; c < NV; c++) {
            vi idx = lane + (int32_t)(base + c * VL);
            vf a = acc[r][c];
            if (base + NB > v) {  /* the padded tail: its extra lanes never win */
                vi pad = idx >= (int32_t)v;
                a = (vf)(((vi)a & ~pad) | ((vi)((vf){0} - FLT_MAX) & pad));
            }
            vi m = a > bestv[r * NV + c];
            bestv[r * NV + c] = (vf)(((vi)a & m) | ((vi)bestv[r * NV + c] & ~m));
            besti[r * NV + c] = (idx & m) | (besti[r * NV + c] & ~m);
        }
}

/* out[i] = argmax_j (x[i] . w[j]) over j < v, the first on ties; x [m, k], packed as above. */
void greedy_head(const float *x, const float *packed, int64_t *out, int64_t m, int64_t k,
                 int64_t v, int threads) {
    int64_t blocks = (v + NB - 1) / NB;
    if (threads < 1) threads = 1;
    if (threads > blocks) threads = (int)blocks;
    float bv_all[threads][m];
    int64_t bi_all[threads][m];
    int team = 1;
    #pragma omp parallel num_threads(threads)
    {
        int tid = omp_get_thread_num(), nt = omp_get_num_threads();
        if (tid == 0) team = nt;  /* the runtime may give fewer threads than asked */
        int64_t b0 = blocks * tid / nt, b1 = blocks * (tid + 1) / nt;
        /* Each row's best so far, per lane: the weight block is read once for all rows. */
        vf *bestv = aligned_alloc(64, sizeof(vf) * m * NV);
        vi *besti = aligned_alloc(64, sizeof(vi) * m * NV);
        for (int64_t j = 0; j < m * NV; j++) {
            bestv[j] = (vf){0} - FLT_MAX;
            besti[j] = (vi){0} + (int32_t)v;
        }
        for (int64_t b = b0; b < b1; b++) {
            const float *pb = packed + b * k * NB;
            for (int64_t i0 = 0; i0 < m; i0 += R) {
                int rows = m - i0 < R ? (int)(m - i0) : R;
                const float *xi = x + i0 * k;
                vf *bv = bestv + i0 * NV;
                vi *bi = besti + i0 * NV;
                switch (rows) {
                    case R: tile(R, xi, pb, k, b * NB, v, bv, bi); break;
                    case 1: tile(1, xi, pb, k, b * NB, v, bv, bi); break;
                    case 2: tile(2, xi, pb, k, b * NB, v, bv, bi); break;
                    case 3: tile(3, xi, pb, k, b * NB, v, bv, bi); break;
                    case 4: tile(4, xi, pb, k, b * NB, v, bv, bi); break;
                    default: tile(5, xi, pb, k, b * NB, v, bv, bi); break;  /* R is 6 */
                }
            }
        }
        for (int64_t r = 0; r < m; r++) {
            float best = -FLT_MAX;
            int64_t at = v;
            for (int c = 0; c < NV; c++)
                for (int j = 0; j < VL; j++) {
                    float val = bestv[r * NV + c][j];
                    int64_t id = besti[r * NV + c][j];
                    if (val > best || (val == best && id < at)) { best = val; at = id; }
                }
            bv_all[tid][r] = best;
            bi_all[tid][r] = at;
        }
        free(bestv);
        free(besti);
    }
    for (int64_t i = 0; i < m; i++) {
        float best = bv_all[0][i];
        int64_t at = bi_all[0][i];
        for (int t = 1; t < team; t++)  /* threads took the blocks in order: ties go left */
            if (bv_all[t][i] > best) { best = bv_all[t][i]; at = bi_all[t][i]; }
        out[i] = at < v ? at : 0;
    }
}
"""


class NativeGreedyHead:
    """The compiled kernel and the head weight packed for it."""

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


@dataclass(frozen=True)
class Plan:
    """The native kernel up to ``max_rows`` rows; torch's head and argmax above."""

    kernel: NativeGreedyHead | None
    max_rows: int
    why: str

    def takes(self, rows: int) -> bool:
        return self.kernel is not None and rows <= self.max_rows


TORCH_ONLY = Plan(None, 0, "torch's head and argmax")


def plan(weight: torch.Tensor, torch_path: Callable[[torch.Tensor], torch.Tensor]) -> Plan:
    """Build the kernel on ``weight`` ([vocab, hidden], the LM head) and time it against
    ``torch_path`` (hidden rows -> token ids) at TIMED_ROWS."""
    forced = envs.LUMEN_CPU_GREEDY_HEAD.get() or "auto"
    if forced not in KERNELS:
        raise ValueError(
            f"LUMEN_CPU_GREEDY_HEAD must be one of {', '.join(KERNELS)}, not {forced!r}"
        )
    if forced == "torch":
        return Plan(None, 0, "torch's head and argmax, set by LUMEN_CPU_GREEDY_HEAD")
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return Plan(None, 0, f"the native kernel takes an fp32 CPU head, not {weight.dtype}")
    vector = native_build.vector_floats()
    per_block = 4 if vector == 16 else 2  # accumulators: rows x per_block vectors in registers
    defines = (f"-DVL={vector}", f"-DNV={per_block}", f"-DR={ROWS_PER_TILE}")
    try:
        library = native_build.compile_library(f"greedy_head_v{vector}", SOURCE, defines)
        kernel = NativeGreedyHead(str(library), weight, vector, per_block)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        if forced == "native":
            raise RuntimeError(
                f"LUMEN_CPU_GREEDY_HEAD=native, but the kernel did not build: {e}"
            ) from e
        return Plan(None, 0, f"the native kernel did not build: {e}")
    if forced == "native":
        return Plan(kernel, 1 << 62, "native for every row count, set by LUMEN_CPU_GREEDY_HEAD")
    max_rows, timings = 0, []
    for rows in TIMED_ROWS:
        h = torch.randn(rows, weight.shape[1])
        native_s = best_of(lambda: kernel(h))  # noqa: B023
        torch_s = best_of(lambda: torch_path(h))  # noqa: B023
        timings.append(f"{rows}: {native_s * 1e3:.2f}/{torch_s * 1e3:.2f}")
        if native_s >= torch_s:
            break
        max_rows = rows
    if max_rows == TIMED_ROWS[-1]:
        max_rows = 1 << 62
    limit = "every row count" if max_rows > TIMED_ROWS[-1] else f"up to {max_rows} rows"
    why = f"native for {limit} (ms native/torch at rows {', '.join(timings)})"
    return Plan(kernel if max_rows else None, max_rows, why)
