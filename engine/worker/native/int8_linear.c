/* Weight-only int8 products, the weight widened in registers (engine/worker/cpu_int8.py
 * loads it). Compiled by native_build with -DVL=<fp32 lanes per vector>. */

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
