/* Weight-only 4-bit products against 8-bit activations (engine/worker/cpu_int4.py loads it):
 * llama.cpp's Q4_1 x Q8 dot product. Compiled by native_build; three paths compute the same
 * integer sums: AVX-512 VNNI (vpdpbusd, 128 weights an instruction pair), AVX2 (vpmaddubsw),
 * and plain C. -DLUMEN_INT4_AVX2 or -DLUMEN_INT4_PLAIN forces a narrower one (the tests build
 * each where the CPU runs it).
 *
 * A weight row of k values is k / 32 groups; group g of row j has a scale d[j, g], a minimum
 * mn[j, g] and 16 bytes of codes, GGUF's Q4_1 block layout: byte i holds element i in its low
 * nibble and element i + 16 in its high one, and the value is d * code + mn (code 0..15).
 *
 * Each row of x is quantized per group of 32 first: dx = max|x| / 127 and xq = round(x / dx)
 * (half to even; 0 for an all-zero group), and xs = dx * sum(xq). Then
 *   y[r, j] = sum_g d[j, g] * dx[g] * (codes_g . xq_g) + mn[j, g] * xs[g],
 * the dot product of codes and xq exact in int32: exactly the dequantized weight times the
 * dequantized x. (With x's exact sum in xs instead, the minimum's term no longer cancels the
 * rounding errors of the codes' term: a Q4_1 minimum is about -8 scales, and SmolLM2 lost 7
 * points of top-1 agreement with fp32 that way.) x's groups are laid out in blocks of four
 * groups to match the codes: a block's 64 bytes of codes, split into low nibbles and high
 * ones, are two 64-byte vectors [g0 e0-15, g1 e0-15, g2 e0-15, g3 e0-15] and the same for
 * e16-31, so a block's xq is stored in that order, and its int32 lanes 4g..4g+3 sum group g. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define GROUP 32
#define HALF 16
#define BLOCK 4                 /* groups per block */
#define BLOCK_X (BLOCK * GROUP)  /* 128 activations, 64 bytes of codes */
#define TILE 4                  /* weight rows per task, sharing each load of x */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && !defined(LUMEN_INT4_AVX2) && !defined(LUMEN_INT4_PLAIN)
#define PATH 512
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LUMEN_INT4_PLAIN)
#define PATH 256
#else
#define PATH 0
#endif

/* The path compiled in: 512, 256 or 0 (plain C). */
int int4_linear_path(void) { return PATH; }

/* One row of x: xq [blocks * 128] int8 in block order, dxe [blocks * 16] (each group's dx
 * four times, as its int32 lanes), xs [blocks * 4] (dx * sum(xq)); groups past k / 32 are
 * zero. */
static void quantize_row(const float *x, int64_t groups, int64_t blocks, int8_t *xq,
                         float *dxe, float *xs) {
    memset(xq, 0, (size_t)blocks * BLOCK_X);
    memset(dxe, 0, (size_t)blocks * 16 * sizeof(float));
    memset(xs, 0, (size_t)blocks * BLOCK * sizeof(float));
    const float inv127 = 1.0f / 127.0f;  /* folded at compile time, correctly rounded */
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        float amax = 0.f;
        for (int i = 0; i < GROUP; i++) {
            float a = fabsf(xg[i]);
            amax = a > amax ? a : amax;
        }
        const float d = amax * inv127;
        const float id = d != 0.f ? 1.0f / d : 0.f;
        int8_t *block = xq + (g / BLOCK) * BLOCK_X + (g % BLOCK) * HALF;
        int32_t sum = 0;
        for (int i = 0; i < GROUP; i++) {
            float v = nearbyintf(xg[i] * id);
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            block[i < HALF ? i : BLOCK * HALF + i - HALF] = (int8_t)v;
            sum += (int32_t)v;
        }
        for (int i = 0; i < 4; i++) dxe[g * 4 + i] = d;
        xs[g] = d * (float)sum;
    }
}

/* The AVX-512 and plain paths (AVX2 has rows_pair below): a weight row's block (codes_t: its
 * 128 codes unpacked and its four scales as the int32 lanes they apply to), loaded once for up
 * to MR rows of x; the accumulator of one row of x against one weight row (acc_t), and the
 * step that adds one block of x to it. */
#if PATH == 512
typedef struct { __m512i lo, hi; __m512 d; } codes_t;
typedef __m512 acc_t;
static inline void codes_load(codes_t *w, const uint8_t *c, const float *d4) {
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i codes = _mm512_loadu_si512(c);
    const __m512i spread = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    w->lo = _mm512_and_si512(codes, low);
    w->hi = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low);
    w->d = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(_mm_loadu_ps(d4)));
}
static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }
static inline acc_t acc_add(acc_t a, const codes_t *w, const int8_t *xb, const float *dxb) {
    __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w->lo, _mm512_loadu_si512(xb));
    dot = _mm512_dpbusd_epi32(dot, w->hi, _mm512_loadu_si512(xb + 64));
    return _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(dot), _mm512_loadu_ps(dxb)), w->d,
                           a);
}
static inline float acc_sum(acc_t a) { return _mm512_reduce_add_ps(a); }
#else
typedef struct { const uint8_t *c; const float *d4; } codes_t;
typedef float acc_t;
static inline void codes_load(codes_t *w, const uint8_t *c, const float *d4) {
    w->c = c;
    w->d4 = d4;
}
static inline acc_t acc_zero(void) { return 0.f; }
static inline acc_t acc_add(acc_t a, const codes_t *w, const int8_t *xb, const float *dxb) {
    for (int g = 0; g < BLOCK; g++) {
        int32_t dot = 0;
        for (int i = 0; i < HALF; i++) {
            const uint8_t byte = w->c[g * HALF + i];
            dot += (byte & 15) * xb[g * HALF + i] + (byte >> 4) * xb[64 + g * HALF + i];
        }
        a += (float)dot * dxb[4 * g] * w->d4[g];
    }
    return a;
}
static inline float acc_sum(acc_t a) { return a; }
#endif

/* The quantized rows of x, each ``blocks`` blocks long. */
typedef struct { const int8_t *q; const float *dxe, *xs; int64_t blocks; } xrows_t;

/* ``mr`` (1 to MR, a constant where inlined) rows of x from row i against TILE weight rows
 * (rows[t]: their indices): out[r][t]. Each weight block is unpacked once for all mr rows.
 * A last, partial block is copied, zero-padded, so no load runs past a row or the weight. */
#define MR 4
#define ALWAYS_INLINE static inline __attribute__((always_inline))
/* ``blocks`` blocks from the ones w[t], d4[t], xq and dxe point at */
ALWAYS_INLINE void dot_blocks(acc_t acc[TILE][MR], const int mr, const int8_t *xq,
                              const float *dxe, int64_t xstride, int64_t dstride,
                              const uint8_t *const w[TILE], const float *const d4[TILE],
                              int64_t blocks) {
    for (int64_t b = 0; b < blocks; b++)
        for (int t = 0; t < TILE; t++) {
            codes_t c;
            codes_load(&c, w[t] + b * 64, d4[t] + b * BLOCK);
            for (int r = 0; r < mr; r++)
                acc[t][r] = acc_add(acc[t][r], &c, xq + r * xstride + b * BLOCK_X,
                                    dxe + r * dstride + b * 16);
        }
}

#if PATH == 256
/* The AVX2 path: ``mr`` (1 to MR) rows of x against two weight rows, rows[t0] and
 * rows[t0 + 1] (out[r][t0], out[r][t0 + 1]). Each weight block is unpacked once for all the
 * rows, x is read by the multiplies from memory (vpmaddubsw's memory operand) and the
 * minimums' term rides in the low half of each accumulator (a block's four minimums times x's
 * four xs), so the 2 x mr accumulators stay in registers: dot_tile's AVX2 form spilled its
 * unpacked codes. A block's four scales are spread over the int32 lanes each applies to once
 * for all the rows, then times x's dx as dxe holds them; a last, partial block loads only the
 * groups it has (masked), where dot_tile copies it.
 *
 * A tile's rows are read side by side, short runs (288 bytes a row at k = 576) that the
 * hardware prefetcher does not follow, so each read asks for the bytes AHEAD further on: the
 * rows are contiguous, so that is the tiles to come. On a 2-vCPU AVX2 EPYC, SmolLM2's 120
 * layer products (79.6 MB, 2 threads, best of runs) took 2.7-2.8 ms at one row with this
 * routine and AHEAD 4096, 3.6 without the prefetch, 4.1 with dot_tile; at 2 rows 4.1 against
 * 5.6, at 4 rows 6.8 against 8.3, at 16 rows the same (30 ms: the arithmetic bounds it there).
 * A plain every-core read of the same bytes took 2.2-2.7 ms. */
#define AHEAD 4096
ALWAYS_INLINE void rows_pair(const xrows_t *x, int64_t i, const int mr, const uint8_t *q,
                             const float *d, const float *mn, int64_t groups,
                             const int64_t *rows, int t0, float out[MR][TILE]) {
    const int64_t full = groups / BLOCK, rest = groups % BLOCK, stride = groups * HALF;
    const int64_t xstride = x->blocks * BLOCK_X, gstride = x->blocks * BLOCK;
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    const __m256i first = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i second = _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3);
    const uint8_t *w[2] = {q + rows[t0] * stride, q + rows[t0 + 1] * stride};
    const float *dw[2] = {d + rows[t0] * groups, d + rows[t0 + 1] * groups};
    const float *mw[2] = {mn + rows[t0] * groups, mn + rows[t0 + 1] * groups};
    const int8_t *xq = x->q + i * xstride;
    const int64_t dstride = x->blocks * 16;
    const float *dxe = x->dxe + i * dstride, *xs = x->xs + i * gstride;
    __m256 a[2][MR];
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < mr; r++) a[t][r] = _mm256_setzero_ps();
    const __m256i lane = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rest), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)rest - 2), lane);
    const __m128i mg = _mm_cmpgt_epi32(_mm_set1_epi32((int)rest), _mm_setr_epi32(0, 1, 2, 3));
    const int64_t blocks = full + (rest != 0);
    for (int64_t b = 0; b < blocks; b++) {
        const int part = b == full;  /* the last, partial block: masked loads */
        for (int t = 0; t < 2; t++) {
            const uint8_t *c = w[t] + b * 64;
            _mm_prefetch((const char *)c + AHEAD, _MM_HINT_T0);
            _mm_prefetch((const char *)(dw[t] + b * BLOCK) + AHEAD / 4, _MM_HINT_T0);
            _mm_prefetch((const char *)(mw[t] + b * BLOCK) + AHEAD / 4, _MM_HINT_T0);
            __m256i c0, c1;
            __m128 d4, m4;
            if (part) {
                c0 = _mm256_maskload_epi32((const int *)c, m0);
                c1 = _mm256_maskload_epi32((const int *)c + 8, m1);
                d4 = _mm_maskload_ps(dw[t] + b * BLOCK, mg);
                m4 = _mm_maskload_ps(mw[t] + b * BLOCK, mg);
            } else {
                c0 = _mm256_loadu_si256((const __m256i *)c);
                c1 = _mm256_loadu_si256((const __m256i *)(c + 32));
                d4 = _mm_loadu_ps(dw[t] + b * BLOCK);
                m4 = _mm_loadu_ps(mw[t] + b * BLOCK);
            }
            const __m256 d_lo = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), first);
            const __m256 d_hi = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), second);
            const __m256i l0 = _mm256_and_si256(c0, low);
            const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(c0, 4), low);
            const __m256i l1 = _mm256_and_si256(c1, low);
            const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(c1, 4), low);
            for (int r = 0; r < mr; r++) {
                const int8_t *xb = xq + r * xstride + b * BLOCK_X;
                const __m256i p0 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(l0, _mm256_loadu_si256((const __m256i *)xb)),
                    _mm256_maddubs_epi16(h0, _mm256_loadu_si256((const __m256i *)(xb + 64))));
                const __m256i p1 = _mm256_add_epi16(
                    _mm256_maddubs_epi16(l1, _mm256_loadu_si256((const __m256i *)(xb + 32))),
                    _mm256_maddubs_epi16(h1, _mm256_loadu_si256((const __m256i *)(xb + 96))));
                const float *dxb = dxe + r * dstride + b * 16;
                __m256 acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p0, ones)),
                                             _mm256_mul_ps(d_lo, _mm256_loadu_ps(dxb)), a[t][r]);
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p1, ones)),
                                      _mm256_mul_ps(d_hi, _mm256_loadu_ps(dxb + 8)), acc);
                a[t][r] = _mm256_add_ps(acc, _mm256_zextps128_ps256(
                    _mm_mul_ps(m4, _mm_loadu_ps(xs + r * gstride + b * BLOCK))));
            }
        }
    }
    for (int t = 0; t < 2; t++)
        for (int r = 0; r < mr; r++) {
            __m128 v = _mm_add_ps(_mm256_castps256_ps128(a[t][r]),
                                  _mm256_extractf128_ps(a[t][r], 1));
            v = _mm_add_ps(v, _mm_movehl_ps(v, v));
            v = _mm_add_ss(v, _mm_movehdup_ps(v));
            out[r][t0 + t] = _mm_cvtss_f32(v);
        }
}
#endif

ALWAYS_INLINE void dot_tile(const xrows_t *x, int64_t i, const int mr, const uint8_t *q,
                            const float *d, const float *mn, int64_t groups,
                            const int64_t *rows, float out[MR][TILE]) {
    const int64_t full = groups / BLOCK, rest = groups % BLOCK, stride = groups * HALF;
    const int64_t xstride = x->blocks * BLOCK_X, dstride = x->blocks * 16;
    const int8_t *xq = x->q + i * xstride;
    const float *dxe = x->dxe + i * dstride;
    const uint8_t *w[TILE];
    const float *d4[TILE];
    for (int t = 0; t < TILE; t++) {
        w[t] = q + rows[t] * stride;
        d4[t] = d + rows[t] * groups;
    }
    acc_t acc[TILE][MR];
    for (int t = 0; t < TILE; t++)
        for (int r = 0; r < mr; r++) acc[t][r] = acc_zero();
    dot_blocks(acc, mr, xq, dxe, xstride, dstride, w, d4, full);
    if (rest) {  /* the last, partial block, copied and zero-padded */
        uint8_t c[TILE][64] = {{0}};
        float s[TILE][BLOCK] = {{0}};
        const uint8_t *wt[TILE];
        const float *st[TILE];
        for (int t = 0; t < TILE; t++) {
            memcpy(c[t], w[t] + full * 64, (size_t)rest * HALF);
            memcpy(s[t], d4[t] + full * BLOCK, (size_t)rest * sizeof(float));
            wt[t] = c[t];
            st[t] = s[t];
        }
        dot_blocks(acc, mr, xq + full * BLOCK_X, dxe + full * 16, xstride, dstride, wt, st, 1);
    }
    /* the minimums' term: mn[j, :] . xs[i, :] */
    for (int t = 0; t < TILE; t++)
        for (int r = 0; r < mr; r++) {
            const float *m = mn + rows[t] * groups, *s = x->xs + (i + r) * x->blocks * BLOCK;
            float shift = 0.f;
            for (int64_t g = 0; g < groups; g++) shift += m[g] * s[g];
            out[r][t] = acc_sum(acc[t][r]) + shift;
        }
}

/* ``k_`` rows of x from row i against the TILE weight rows ``rows``: out[r][t] */
#if PATH == 256
#define ROWS_TILE(k_) (rows_pair(&xr, i, k_, q, d, mn, groups, rows, 0, out), \
                       rows_pair(&xr, i, k_, q, d, mn, groups, rows, 2, out))
#else
#define ROWS_TILE(k_) dot_tile(&xr, i, k_, q, d, mn, groups, rows, out)
#endif

/* y[m, n] = x[m, k] . w[n, k] with w in 4-bit groups and x quantized as above; x, y fp32;
 * k % 32 == 0. Returns 0, or -1 where scratch could not be allocated. */
int int4_linear(const float *x, const uint8_t *q, const float *d, const float *mn, float *y,
                int64_t m, int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0) return 0;
    const int64_t groups = k / GROUP, blocks = (groups + BLOCK - 1) / BLOCK;
    int8_t *xq = malloc((size_t)(m * blocks * BLOCK_X));
    float *dxe = malloc((size_t)(m * blocks * 16) * sizeof(float));
    float *xs = malloc((size_t)(m * blocks * BLOCK) * sizeof(float));
    if (!xq || !dxe || !xs) {
        free(xq), free(dxe), free(xs);
        return -1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * k, groups, blocks, xq + i * blocks * BLOCK_X,
                     dxe + i * blocks * 16, xs + i * blocks * BLOCK);
    const xrows_t xr = {xq, dxe, xs, blocks};
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += TILE) {
        const int r = n - j < TILE ? (int)(n - j) : TILE;
        int64_t rows[TILE];  /* a last, partial tile repeats its last row */
        for (int t = 0; t < TILE; t++) rows[t] = j + (t < r ? t : r - 1);
        float out[MR][TILE];
        for (int64_t i = 0; i < m; i += MR) {
            const int mr = m - i < MR ? (int)(m - i) : MR;
            switch (mr) {  /* each a constant, so the accumulators stay in registers */
            case 1: ROWS_TILE(1); break;
            case 2: ROWS_TILE(2); break;
            case 3: ROWS_TILE(3); break;
            default: ROWS_TILE(MR); break;
            }
            for (int a = 0; a < mr; a++)
                for (int t = 0; t < r; t++) y[(i + a) * n + j + t] = out[a][t];
        }
    }
    free(xq), free(dxe), free(xs);
    return 0;
}

/* w[n, k] fp32: the weight the codes stand for, d * code + mn rounded twice as torch's
 * dequantize does (no fused multiply-add), its columns past k (to a whole group) dropped. The
 * widened product's weight (cpu_int4.NativeInt4.widened): one pass over the codes into a
 * buffer that is used again, where torch's took several, each into a fresh tensor. */
__attribute__((optimize("fp-contract=off"))) void int4_widen(
    const uint8_t *q, const float *d, const float *mn, float *w, int64_t n, int64_t padded,
    int64_t k, int threads) {
    const int64_t groups = padded / GROUP;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const uint8_t *c = q + j * groups * HALF;
        float *row = w + j * k;
        for (int64_t g = 0; g < groups; g++) {
            const float dg = d[j * groups + g], mg = mn[j * groups + g];
            float v[GROUP];
            for (int i = 0; i < HALF; i++) {
                v[i] = dg * (float)(c[g * HALF + i] & 15) + mg;
                v[i + HALF] = dg * (float)(c[g * HALF + i] >> 4) + mg;
            }
            const int64_t take = k - g * GROUP < GROUP ? k - g * GROUP : GROUP;
            memcpy(row + g * GROUP, v, (size_t)take * sizeof(float));
        }
    }
}

/* The product as native/decode_layer.c calls it (its product_fn), over a weight described by
 * a q4_t: decode_layer runs a whole decoder layer of a decode step through this kernel. */
typedef struct {
    const uint8_t *codes;
    const float *d, *mn;
    int64_t n, k;  /* out, in (a whole number of groups) */
} q4_t;

int int4_product(const void *weight, const float *x, int64_t m, float *y, int threads) {
    const q4_t *w = weight;
    return int4_linear(x, w->codes, w->d, w->mn, y, m, w->n, w->k, threads);
}
