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
above its own (``LUMEN_CPU_GREEDY_HEAD`` forces one). Without a compiler, on CUDA
or in bf16, torch's path runs.
"""

from __future__ import annotations

import ctypes
import subprocess
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine import envs
from engine.worker import cpu_matmul, native_build
from engine.worker.cpu_matmul import best_of

KERNELS = ("auto", "fused", "screened", "torch")
TIMED_ROWS = (1, 16, 64, 256)
ROWS_PER_TILE = 6

SOURCE = r"""
#include <stdint.h>
#include <string.h>
#include <float.h>
#include <math.h>
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

#define SCREEN_BLOCK 64

static inline float bf16_to_f32(uint16_t b) {
    union { uint32_t u; float f; } c;
    c.u = (uint32_t)b << 16;
    return c.f;
}

/* The argmax of x[i] . w[j] from bf16 logits lb[i] that are within err[i] of the exact ones
 * (bf16 inputs, fp32 accumulation) before their own rounding to bf16: each token that could
 * still be the best (lb[j] >= max - 2e, e also covering the output's rounding) is recomputed
 * in fp32, in order, the first kept on ties. */
void screened_argmax(const uint16_t *lb, const float *x, const float *w, const float *err,
                     int64_t *out, int64_t m, int64_t k, int64_t v, int threads) {
    int64_t blocks = (v + SCREEN_BLOCK - 1) / SCREEN_BLOCK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < m; i++) {
        const uint16_t *row = lb + i * v;
        float bmax[blocks];  /* each block's max: the second pass skips the blocks below t */
        float mx = -FLT_MAX;
        for (int64_t b = 0; b < blocks; b++) {
            int64_t j0 = b * SCREEN_BLOCK, j1 = j0 + SCREEN_BLOCK < v ? j0 + SCREEN_BLOCK : v;
            float bm = -FLT_MAX;
            for (int64_t j = j0; j < j1; j++) {
                float f = bf16_to_f32(row[j]);
                bm = f > bm ? f : bm;
            }
            bmax[b] = bm;
            mx = bm > mx ? bm : mx;
        }
        float e = 1.01f * err[i] + (fabsf(mx) + 2.f * err[i]) * (1.f / 64.f);
        float t = mx - 2.f * e;
        const float *xi = x + i * k;
        float best = -FLT_MAX;
        int64_t at = 0;
        for (int64_t j = 0; j < v; j++) {
            if (j % SCREEN_BLOCK == 0 && bmax[j / SCREEN_BLOCK] < t) {
                j += SCREEN_BLOCK - 1;
                continue;
            }
            if (bf16_to_f32(row[j]) < t) continue;
            const float *wj = w + j * k;
            vf acc = {0};
            int64_t t0 = 0;
            for (; t0 + VL <= k; t0 += VL) acc += load_f(xi + t0) * load_f(wj + t0);
            float dot = 0.f;
            for (int c = 0; c < VL; c++) dot += acc[c];
            for (; t0 < k; t0++) dot += xi[t0] * wj[t0];
            if (dot > best) { best = dot; at = j; }
        }
        out[i] = at;
    }
}
"""


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
    """The kernels' library for this CPU: (its path, fp32 lanes per vector, vectors per
    vocabulary block)."""
    vector = native_build.vector_floats()
    per_block = 4 if vector == 16 else 2  # accumulators: rows x per_block vectors in registers
    defines = (f"-DVL={vector}", f"-DNV={per_block}", f"-DR={ROWS_PER_TILE}")
    library = native_build.compile_library(f"greedy_head_v{vector}", SOURCE, defines)
    return str(library), vector, per_block


def plan(weight: torch.Tensor, torch_path: Path) -> Plan:
    """Build the kernels on ``weight`` ([vocab, hidden], the LM head) and time each path
    against ``torch_path`` (hidden rows -> token ids) at TIMED_ROWS: a batch takes the
    fastest at the smallest timed row count at or above its own."""
    forced = envs.LUMEN_CPU_GREEDY_HEAD.get() or "auto"
    if forced not in KERNELS:
        raise ValueError(
            f"LUMEN_CPU_GREEDY_HEAD must be one of {', '.join(KERNELS)}, not {forced!r}"
        )
    if forced == "torch":
        return Plan((), "torch's head and argmax, set by LUMEN_CPU_GREEDY_HEAD")
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return Plan((), f"the native kernels take an fp32 CPU head, not {weight.dtype}")
    try:
        library, vector, per_block = build()
        paths: dict[str, Path] = {"fused": FusedHead(library, weight, vector, per_block)}
        if cpu_matmul.onednn_available(torch.bfloat16):
            paths["screened"] = ScreenedHead(library, weight)
    except (RuntimeError, OSError, subprocess.SubprocessError) as e:
        if forced != "auto":
            raise RuntimeError(
                f"LUMEN_CPU_GREEDY_HEAD={forced}, but the kernel did not build: {e}"
            ) from e
        return Plan((), f"the native kernel did not build: {e}")
    if forced != "auto":
        if forced not in paths:
            raise RuntimeError(f"LUMEN_CPU_GREEDY_HEAD={forced}, but oneDNN has no bf16 here")
        return Plan(((EVERY, paths[forced]),), f"{forced}, set by LUMEN_CPU_GREEDY_HEAD")
    chosen: list[tuple[int, Path | None]] = []
    timings = []
    for rows in TIMED_ROWS:
        h = torch.randn(rows, weight.shape[1])
        times = {name: best_of(lambda: path(h)) for name, path in paths.items()}  # noqa: B023
        times["torch"] = best_of(lambda: torch_path(h))  # noqa: B023
        name = min(times, key=times.__getitem__)
        limit = EVERY if rows == TIMED_ROWS[-1] else rows
        chosen.append((limit, paths.get(name)))
        each = ", ".join(f"{n} {t * 1e3:.2f}" for n, t in times.items())
        timings.append(f"{rows} rows: {name} ({each} ms)")
    return Plan(tuple(chosen), "; ".join(timings))
