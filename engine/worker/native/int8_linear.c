/* Weight-only int8 products, the weight widened in registers (engine/worker/cpu_int8.py
 * loads it), and int8_q8_linear below, against 8-bit activations. Compiled by native_build
 * with -DVL=<fp32 lanes per vector>. */

#include <stdint.h>
#include <stdlib.h>
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

/* ---- int8 weights against 8-bit activations (int4's LM head, cpu_int8.Plan with q8): each
 * row of x quantized per group of 32 as the int4 kernel does (dx = max|x| / 127, round half
 * to even), then y[r, j] = scale[j] * sum_g dx[g] * (w_g . xq_g), each group's dot product
 * exact in int32. The signs move onto x (|w| . sign(w) x), so the products are unsigned by
 * signed bytes: vpdpbusd with AVX-512 VNNI, vpmaddubsw with AVX2 (at most 2 * 127 * 127 a
 * pair, within int16). k % 32 == 0. */

#define Q8_GROUP 32
#define Q8_TILE 4

#if defined(__AVX512VNNI__) && defined(__AVX512BW__) && defined(__AVX512VL__) \
    && !defined(LUMEN_INT8_AVX2) && !defined(LUMEN_INT8_PLAIN)
#define Q8_PATH 512
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LUMEN_INT8_PLAIN)
#define Q8_PATH 256
#else
#define Q8_PATH 0
#endif

int int8_q8_path(void) { return Q8_PATH; }

/* xq [k] int8; dx [k / 32] fp32 */
static void q8_row(const float *x, int64_t k, int8_t *xq, float *dx) {
    const float inv127 = 1.0f / 127.0f;  /* folded at compile time, correctly rounded */
    for (int64_t g = 0; g < k / Q8_GROUP; g++) {
        const float *xg = x + g * Q8_GROUP;
        float amax = 0.f;
        for (int i = 0; i < Q8_GROUP; i++) {
            const float a = xg[i] < 0 ? -xg[i] : xg[i];
            amax = a > amax ? a : amax;
        }
        const float d = amax * inv127;
        const float id = d != 0.f ? 1.0f / d : 0.f;
        for (int i = 0; i < Q8_GROUP; i++) {
            float v = __builtin_nearbyintf(xg[i] * id);
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            xq[g * Q8_GROUP + i] = (int8_t)v;
        }
        dx[g] = d;
    }
}

/* w . x over k for one weight row, in groups: sum_g dx[g] * (w_g . xq_g) */
static inline float q8_dot(const int8_t *w, const int8_t *xq, const float *dx, int64_t k) {
#if Q8_PATH == 512
    __m512 acc = _mm512_setzero_ps();
    int64_t i = 0;
    for (; i + 64 <= k; i += 64) {  /* two groups: lanes 0-7 and 8-15 */
        const __m512i wv = _mm512_loadu_si512(w + i), xv = _mm512_loadu_si512(xq + i);
        const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(wv),
                                                _mm512_setzero_si512(), xv);
        const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wv), sx);
        const __m512 d = _mm512_insertf32x8(
            _mm512_castps256_ps512(_mm256_set1_ps(dx[i / 32])), _mm256_set1_ps(dx[i / 32 + 1]), 1);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), d, acc);
    }
    float s = _mm512_reduce_add_ps(acc);
    for (; i < k; i += 32) {  /* a last, odd group */
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i));
        const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_abs_epi8(wv),
                                                _mm256_sign_epi8(xv, wv));
        __m256 f = _mm256_cvtepi32_ps(dot);
        __m128 v = _mm_add_ps(_mm256_castps256_ps128(f), _mm256_extractf128_ps(f, 1));
        v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        v = _mm_add_ss(v, _mm_movehdup_ps(v));
        s += _mm_cvtss_f32(v) * dx[i / 32];
    }
    return s;
#elif Q8_PATH == 256
    __m256 acc = _mm256_setzero_ps();
    for (int64_t i = 0; i < k; i += 32) {
        const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + i));
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i));
        const __m256i pairs = _mm256_maddubs_epi16(_mm256_abs_epi8(wv), _mm256_sign_epi8(xv, wv));
        const __m256i dot = _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dx[i / 32]), acc);
    }
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
#else
    float s = 0.f;
    for (int64_t g = 0; g < k / Q8_GROUP; g++) {
        int32_t dot = 0;
        for (int i = 0; i < Q8_GROUP; i++) dot += w[g * Q8_GROUP + i] * xq[g * Q8_GROUP + i];
        s += (float)dot * dx[g];
    }
    return s;
#endif
}

/* y[m, n] = (q8(x)[m, k] . w[n, k]) * scale[n]; returns 0, or -1 where scratch could not be
 * allocated. */
int int8_q8_linear(const float *x, const int8_t *w, const float *scale, float *y, int64_t m,
                   int64_t n, int64_t k, int threads) {
    if (m <= 0 || n <= 0) return 0;
    int8_t *xq = malloc((size_t)(m * k));
    float *dx = malloc(sizeof(float) * (size_t)(m * (k / Q8_GROUP)));
    if (!xq || !dx) {
        free(xq), free(dx);
        return -1;
    }
    for (int64_t i = 0; i < m; i++) q8_row(x + i * k, k, xq + i * k, dx + i * (k / Q8_GROUP));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++)
        for (int64_t i = 0; i < m; i++)
            y[i * n + j] = q8_dot(w + j * k, xq + i * k, dx + i * (k / Q8_GROUP), k) * scale[j];
    free(xq), free(dx);
    return 0;
}
