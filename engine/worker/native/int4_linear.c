/* Weight-only 4-bit products, the weight widened in registers (engine/worker/cpu_int4.py loads
 * it). Compiled by native_build with -DVL=<fp32 lanes per vector>, 8 or 16.
 *
 * A weight row of k values is k / 32 groups; group g of row j has a scale d[j, g], a minimum
 * mn[j, g] and 16 bytes of codes, GGUF's Q4_1 block layout: byte i holds element i in its low
 * nibble and element i + 16 in its high one, and the value is d * code + mn (code 0..15).
 * So y[r, j] = sum_g d[j, g] * (codes_g . x_g) + mn[j, g] * sum(x_g), the second sum taken once
 * per row and group. */

#include <stdint.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define GROUP 32
#define HALF 16

typedef float vf __attribute__((vector_size(VL * 4)));

static inline vf load_f(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }

/* VL codes from VL bytes: the low nibbles (elements c..c+VL) and the high ones (+16). */
static inline void load_codes(const uint8_t *p, vf *lo, vf *hi) {
#if VL == 16 && defined(__AVX512F__)
    __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    __m512 l = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    __m512 h = _mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
    memcpy(lo, &l, sizeof *lo);
    memcpy(hi, &h, sizeof *hi);
#elif VL == 8 && defined(__AVX2__)
    __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    __m256 l = _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    __m256 h = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
    memcpy(lo, &l, sizeof *lo);
    memcpy(hi, &h, sizeof *hi);
#else
    for (int i = 0; i < VL; i++) { (*lo)[i] = (float)(p[i] & 15); (*hi)[i] = (float)(p[i] >> 4); }
#endif
}

static inline float hsum(vf v) {
    float s = 0.f;
    for (int i = 0; i < VL; i++) s += v[i];
    return s;
}

/* One row of x against TILE weight rows at once (rows[t]: their offsets in rows of q, d, mn):
 * each group's x is loaded once for all of them, and their sums are independent chains. TILE
 * is a constant, so the accumulators stay in registers. */
#define TILE 4
static inline void dot_rows(const float *x, const float *xs, const uint8_t *q, const float *d,
                            const float *mn, int64_t groups, int64_t stride,
                            const int64_t *rows, float *out) {
    vf acc[TILE] = {{0}};
    float shift[TILE] = {0};
    for (int64_t g = 0; g < groups; g++) {
        const float *xg = x + g * GROUP;
        vf xl[HALF / VL], xh[HALF / VL];
        for (int c = 0; c < HALF / VL; c++) {
            xl[c] = load_f(xg + c * VL);
            xh[c] = load_f(xg + HALF + c * VL);
        }
        for (int t = 0; t < TILE; t++) {
            const uint8_t *qg = q + rows[t] * stride + g * HALF;
            vf part = {0};
            for (int c = 0; c < HALF / VL; c++) {
                vf lo, hi;
                load_codes(qg + c * VL, &lo, &hi);
                part += lo * xl[c] + hi * xh[c];
            }
            acc[t] += part * d[rows[t] * groups + g];  /* a scalar operand: one broadcast */
            shift[t] += mn[rows[t] * groups + g] * xs[g];
        }
    }
    for (int t = 0; t < TILE; t++) out[t] = hsum(acc[t]) + shift[t];
}

/* y[m, n] = x[m, k] . w[n, k] with w in 4-bit groups (above); x, y fp32; k % 32 == 0.
 * xs: [m, k / 32] scratch for the per-group sums of x. */
void int4_linear(const float *x, const uint8_t *q, const float *d, const float *mn, float *y,
                 float *xs, int64_t m, int64_t n, int64_t k, int threads) {
    const int64_t groups = k / GROUP;
    for (int64_t i = 0; i < m; i++)
        for (int64_t g = 0; g < groups; g++) {
            float s = 0.f;
            for (int t = 0; t < GROUP; t++) s += x[i * k + g * GROUP + t];
            xs[i * groups + g] = s;
        }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j += TILE) {
        const int r = n - j < TILE ? (int)(n - j) : TILE;
        int64_t rows[TILE];  /* a last, partial tile repeats its last row */
        for (int t = 0; t < TILE; t++) rows[t] = t < r ? t : r - 1;
        for (int64_t i = 0; i < m; i++) {
            float out[TILE];
            dot_rows(x + i * k, xs + i * groups, q + j * (k / 2), d + j * groups,
                     mn + j * groups, groups, k / 2, rows, out);
            for (int t = 0; t < r; t++) y[i * n + j + t] = out[t];
        }
    }
}
