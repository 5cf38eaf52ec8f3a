/* Greedy decoding's LM head and argmax without the logits (engine/worker/cpu_greedy_head.py
 * loads it): the fused fp32 path (greedy_head_pack, greedy_head) and the bf16-screened one's
 * fp32 pass (screened_argmax). Compiled by native_build with -DVL=<fp32 lanes per vector>
 * -DNV=<vectors per vocabulary block> -DR=<rows per tile>. */

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
