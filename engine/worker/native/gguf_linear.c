/* Products over a GGUF file's own blocks (engine/worker/cpu_gguf.py loads it): the weight is
 * the file's bytes, read as they are, in the formats a llama.cpp file mixes (Q4_0, Q4_1, Q5_0,
 * Q8_0, Q4_K, Q5_K, Q6_K). Compiled by native_build; the dot products run on AVX-512 VNNI
 * (vpdpbusd on 256-bit vectors), AVX2 (vpmaddubsw) or plain C, all with the same integer sums.
 * -DLUMEN_GGUF_AVX2 or -DLUMEN_GGUF_PLAIN forces a narrower path.
 *
 * Every format is, per chunk of 32 weights, integer codes q[32] with a scale for each half of
 * 16 (the same scale for both but in Q6_K) and a shift: value = scale * q + shift.
 *   Q4_0  18 bytes / 32: fp16 d, 16 bytes of nibbles    q = nibble - 8, scale d
 *   Q4_1  20 bytes / 32: fp16 d, m, 16 bytes            q = nibble, scale d, shift m
 *   Q5_0  22 bytes / 32: fp16 d, 32 high bits, 16 bytes q = nibble | bit << 4 - 16, scale d
 *   Q8_0  34 bytes / 32: fp16 d, 32 int8                q, scale d
 *   Q4_K 144 bytes / 256: fp16 d, dmin, 12 bytes of eight 6-bit (sc, m), 128 bytes of nibbles
 *                        q = nibble, scale d * sc, shift -(dmin * m), per chunk
 *   Q5_K 176 bytes / 256: as Q4_K, then 32 bytes of fifth bits (bit c of byte l: chunk c)
 *   Q6_K 210 bytes / 256: 128 bytes of low nibbles, 64 of high pairs, 16 int8 sc, fp16 d
 *                        q = (low | pair << 4) - 32, scale d * sc per 16
 * (ggml's layouts; gguf-py's dequantize_blocks compute value in that order, and gguf_widen
 * below gives the same fp32 bits.) In a chunk, element i of the 32 is byte i of the codes.
 *
 * Each row of x is quantized per 32 first, as the int4 kernel's: dx = max|x| / 127,
 * xq = round(x / dx), xs = dx * sum(xq). Then y[r, j] = sum over chunks of
 * dx * (scale_lo * (q_lo . xq_lo) + scale_hi * (q_hi . xq_hi)) + shift * xs: the dequantized
 * weight times the dequantized x, the dot products exact in int32. The instructions take
 * unsigned bytes on one side: Q5_0's codes go in as 0-31 with its -16 d in the shift (fewer
 * instructions a chunk), the other signed codes (Q4_0, Q8_0, Q6_K) as |q| . sign(xq, q). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

#define CHUNK 32
#define MR 4  /* rows of x sharing each decoded chunk */

#if defined(__AVX512VNNI__) && defined(__AVX512VL__) && !defined(LUMEN_GGUF_AVX2) \
    && !defined(LUMEN_GGUF_PLAIN)
#define PATH 512
#elif defined(__AVX2__) && defined(__FMA__) && !defined(LUMEN_GGUF_PLAIN)
#define PATH 256
#else
#define PATH 0
#endif

/* ggml's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };

int gguf_linear_path(void) { return PATH; }

/* A format's block: its bytes and its weights (0: not a format here). */
static inline int64_t block_bytes(int type) {
    switch (type) {
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q5_0: return 22;
    case Q8_0: return 34;
    case Q4_K: return 144;
    case Q5_K: return 176;
    case Q6_K: return 210;
    default: return 0;
    }
}
static inline int64_t block_weights(int type) {
    return type >= Q4_K ? 256 : block_bytes(type) ? 32 : 0;
}
int64_t gguf_block_bytes(int type) { return block_bytes(type); }
int64_t gguf_block_weights(int type) { return block_weights(type); }

static inline float half(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 31, man = h & 1023;
    uint32_t bits;
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else if (exp) bits = sign | ((exp + 112) << 23) | (man << 13);
    else if (!man) bits = sign;
    else {  /* subnormal: man * 2^-24, exact in fp32 */
        float f = (float)man * 5.9604644775390625e-8f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
#endif
}

/* Q4_K's and Q5_K's 6-bit scale and minimum of chunk c (0-7) */
static inline void scale_min_k(const uint8_t *s, int c, int *sc, int *m) {
    if (c < 4) {
        *sc = s[c] & 63;
        *m = s[c + 4] & 63;
    } else {
        *sc = (s[c + 4] & 15) | ((s[c - 4] >> 6) << 4);
        *m = (s[c + 4] >> 4) | ((s[c] >> 6) << 4);
    }
}

/* Chunk c of a block, decoded in plain C: its codes, scales and shift. */
typedef struct { int16_t q[CHUNK]; float lo, hi, shift; } chunk_t;

static void decode_chunk(int type, const uint8_t *b, int c, chunk_t *o) {
    o->shift = 0.f;
    switch (type) {
    case Q4_0: case Q4_1: case Q5_0: {
        const uint8_t *qs = b + (type == Q4_0 ? 2 : type == Q4_1 ? 4 : 6);
        uint32_t high = 0;
        if (type == Q5_0) memcpy(&high, b + 2, 4);
        const int offset = type == Q4_0 ? 8 : type == Q5_0 ? 16 : 0;
        for (int i = 0; i < 16; i++) {
            o->q[i] = (int16_t)(((qs[i] & 15) | ((high >> i) & 1) << 4) - offset);
            o->q[i + 16] = (int16_t)(((qs[i] >> 4) | ((high >> (i + 16)) & 1) << 4) - offset);
        }
        o->lo = o->hi = half(b);
        if (type == Q4_1) o->shift = half(b + 2);
        break;
    }
    case Q8_0:
        for (int i = 0; i < CHUNK; i++) o->q[i] = (int8_t)b[2 + i];
        o->lo = o->hi = half(b);
        break;
    case Q4_K: case Q5_K: {
        int sc, m;
        scale_min_k(b + 4, c, &sc, &m);
        const uint8_t *qs = b + (type == Q4_K ? 16 : 48) + 32 * (c / 2);
        for (int i = 0; i < CHUNK; i++) {
            int q = c % 2 ? qs[i] >> 4 : qs[i] & 15;
            if (type == Q5_K) q |= ((b[16 + i] >> c) & 1) << 4;
            o->q[i] = (int16_t)q;
        }
        o->lo = o->hi = half(b) * (float)sc;
        o->shift = -(half(b + 2) * (float)m);
        break;
    }
    case Q6_K: {
        const int h = c / 4, j = c % 4;
        const uint8_t *ql = b + 64 * h + 32 * (j % 2), *qh = b + 128 + 32 * h;
        for (int i = 0; i < CHUNK; i++) {
            const int low = j < 2 ? ql[i] & 15 : ql[i] >> 4;
            o->q[i] = (int16_t)((low | ((qh[i] >> (2 * j)) & 3) << 4) - 32);
        }
        const float d = half(b + 208);
        o->lo = d * (float)(int8_t)b[192 + 2 * c];
        o->hi = d * (float)(int8_t)b[192 + 2 * c + 1];
        break;
    }
    }
}

/* One row of x: xq [chunks * 32] int8, dx and xs [chunks]. */
static void quantize_row(const float *x, int64_t chunks, int8_t *xq, float *dx, float *xs) {
    const float inv127 = 1.0f / 127.0f;
    for (int64_t g = 0; g < chunks; g++) {
        const float *xg = x + g * CHUNK;
        float amax = 0.f;
        for (int i = 0; i < CHUNK; i++) amax = fabsf(xg[i]) > amax ? fabsf(xg[i]) : amax;
        const float d = amax * inv127, id = d != 0.f ? 1.0f / d : 0.f;
        int32_t sum = 0;
        for (int i = 0; i < CHUNK; i++) {
            float v = nearbyintf(xg[i] * id);
            v = v > 127.f ? 127.f : (v < -127.f ? -127.f : v);
            xq[g * CHUNK + i] = (int8_t)v;
            sum += (int32_t)v;
        }
        dx[g] = d;
        xs[g] = d * (float)sum;
    }
}

typedef struct { const int8_t *q; const float *dx, *xs; int64_t chunks; } xrows_t;

#if PATH != 0
/* The vector paths: a chunk's 32 codes in one register (signed or not, as the format's), its
 * two scales as the 8 int32 lanes of the dot product they apply to (lanes 0-3: weights 0-15). */
static inline __m256i nibbles(const uint8_t *qs) {  /* 16 bytes: low nibbles, then high */
    const __m256i q = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    const __m256i shift = _mm256_setr_epi64x(0, 0, 0x0004000400040004LL, 0x0004000400040004LL);
    return _mm256_and_si256(_mm256_srlv_epi16(q, shift), _mm256_set1_epi8(15));
}
static inline __m256i bit_bytes(uint32_t bits, uint8_t value) {  /* byte i: value if bit i */
    const __m256i spread = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
    const __m256i select = _mm256_set1_epi64x(0x8040201008040201LL);
    const __m256i v = _mm256_and_si256(_mm256_shuffle_epi8(_mm256_set1_epi32((int)bits), spread),
                                       select);
    return _mm256_and_si256(_mm256_cmpeq_epi8(v, select), _mm256_set1_epi8((char)value));
}
#if PATH == 512
static inline __m256i dot_u(__m256i w, __m256i x) {
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), w, x);
}
#else
static inline __m256i dot_u(__m256i w, __m256i x) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1));
}
#endif

/* A block's scales and shifts, per chunk: lo[c] (weights 0-15), hi[c] (16-31), shift[c]. */
static inline void block_scales(int type, const uint8_t *b, float *lo, float *hi, float *shift) {
    switch (type) {
    case Q4_K: case Q5_K: {
        const float d = half(b), dmin = half(b + 2);
        for (int c = 0; c < 8; c++) {
            int sc, m;
            scale_min_k(b + 4, c, &sc, &m);
            lo[c] = hi[c] = d * (float)sc;
            shift[c] = -(dmin * (float)m);
        }
        break;
    }
    case Q6_K: {
        const float d = half(b + 208);
        for (int c = 0; c < 8; c++) {
            lo[c] = d * (float)(int8_t)b[192 + 2 * c];
            hi[c] = d * (float)(int8_t)b[192 + 2 * c + 1];
            shift[c] = 0.f;
        }
        break;
    }
    default:
        lo[0] = hi[0] = half(b);
        shift[0] = type == Q4_1 ? half(b + 2) : type == Q5_0 ? -16.f * lo[0] : 0.f;
    }
}

/* Codes of chunk c of block b. Q5_0's go in unsigned, 0-31, its -16 d in the shift (fewer
 * instructions a chunk than carrying a sign to x); signed() says which formats' do not. */
static inline int signed_codes(int type) {
    return type == Q4_0 || type == Q8_0 || type == Q6_K;
}
static inline __m256i codes(int type, const uint8_t *b, int c) {
    switch (type) {
    case Q4_0: return _mm256_sub_epi8(nibbles(b + 2), _mm256_set1_epi8(8));
    case Q4_1: return nibbles(b + 4);
    case Q5_0: {
        uint32_t high;
        memcpy(&high, b + 2, 4);
#if defined(__AVX512BW__)
        const __m256i q = nibbles(b + 6);
        return _mm256_mask_add_epi8(q, (__mmask32)high, q, _mm256_set1_epi8(16));
#else
        return _mm256_or_si256(nibbles(b + 6), bit_bytes(high, 16));
#endif
    }
    case Q8_0: return _mm256_loadu_si256((const __m256i *)(b + 2));
    case Q4_K: case Q5_K: {
        __m256i q = _mm256_loadu_si256((const __m256i *)(b + (type == Q4_K ? 16 : 48)
                                                         + 32 * (c / 2)));
        if (c % 2) q = _mm256_srli_epi16(q, 4);
        q = _mm256_and_si256(q, _mm256_set1_epi8(15));
        if (type == Q5_K) {
            const __m256i bit = _mm256_set1_epi8((char)(1 << c));
            const __m256i qh = _mm256_loadu_si256((const __m256i *)(b + 16));
            q = _mm256_or_si256(q, _mm256_and_si256(
                _mm256_cmpeq_epi8(_mm256_and_si256(qh, bit), bit), _mm256_set1_epi8(16)));
        }
        return q;
    }
    default: {  /* Q6_K */
        const int h = c / 4, j = c % 4;
        __m256i low = _mm256_loadu_si256((const __m256i *)(b + 64 * h + 32 * (j % 2)));
        if (j >= 2) low = _mm256_srli_epi16(low, 4);
        low = _mm256_and_si256(low, _mm256_set1_epi8(15));
        __m256i pair = _mm256_loadu_si256((const __m256i *)(b + 128 + 32 * h));
        pair = _mm256_and_si256(_mm256_srli_epi16(pair, 2 * j), _mm256_set1_epi8(3));
        return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_slli_epi16(pair, 4)),
                               _mm256_set1_epi8(32));
    }
    }
}

static inline float hsum(__m256 a) {
    __m128 v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    v = _mm_add_ss(v, _mm_movehdup_ps(v));
    return _mm_cvtss_f32(v);
}

/* ``mr`` rows of x (from xr's row i) against one weight row of ``type``: out[r]. Inlined per
 * type and row count, so the format's switches and the accumulators fold. A block's scales
 * are read once for its chunks. */
#define AHEAD 1024
static inline __attribute__((always_inline)) void row_dot(
    int type, const uint8_t *row, const xrows_t *xr, int64_t i, const int mr, float *out) {
    const int per = (int)(block_weights(type) / CHUNK), sign = signed_codes(type);
    const int64_t bytes = block_bytes(type), blocks = xr->chunks / per;
    __m256 acc[MR];
    float shift[MR];
    for (int r = 0; r < mr; r++) acc[r] = _mm256_setzero_ps(), shift[r] = 0.f;
    for (int64_t blk = 0; blk < blocks; blk++) {
        const uint8_t *b = row + blk * bytes;
        _mm_prefetch((const char *)b + AHEAD, _MM_HINT_T0);
        float lo[8], hi[8], sh[8];
        block_scales(type, b, lo, hi, sh);
        for (int c = 0; c < per; c++) {
            const int64_t g = blk * per + c;
            const __m256i w = codes(type, b, c);
            const __m256i aw = sign ? _mm256_abs_epi8(w) : w;
            const __m256 f = _mm256_set_m128(_mm_set1_ps(hi[c]), _mm_set1_ps(lo[c]));
            for (int r = 0; r < mr; r++) {
                const int64_t at = (i + r) * xr->chunks + g;
                __m256i x = _mm256_loadu_si256((const __m256i *)(xr->q + at * CHUNK));
                if (sign) x = _mm256_sign_epi8(x, w);
                acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_u(aw, x)),
                                         _mm256_mul_ps(f, _mm256_set1_ps(xr->dx[at])), acc[r]);
                shift[r] += sh[c] * xr->xs[at];
            }
        }
    }
    for (int r = 0; r < mr; r++) out[r] = hsum(acc[r]) + shift[r];
}
#else
static inline void row_dot(int type, const uint8_t *row, const xrows_t *xr, int64_t i,
                           const int mr, float *out) {
    const int64_t per = block_weights(type) / CHUNK, bytes = block_bytes(type);
    for (int r = 0; r < mr; r++) out[r] = 0.f;
    for (int64_t g = 0; g < xr->chunks; g++) {
        chunk_t c;
        decode_chunk(type, row + (g / per) * bytes, (int)(g % per), &c);
        for (int r = 0; r < mr; r++) {
            const int64_t at = (i + r) * xr->chunks + g;
            const int8_t *x = xr->q + at * CHUNK;
            int32_t lo = 0, hi = 0;
            for (int e = 0; e < 16; e++) lo += c.q[e] * x[e], hi += c.q[e + 16] * x[e + 16];
            out[r] += xr->dx[at] * (c.lo * (float)lo + c.hi * (float)hi) + c.shift * xr->xs[at];
        }
    }
}
#endif

/* A weight: its rows in parts, each the file's blocks of one type ([rows, row_bytes]), for a
 * product that fuses several of the file's tensors (q, k and v; gate and up). */
typedef struct { int64_t type, rows, row_bytes; const uint8_t *blocks; } part_t;
typedef struct { const part_t *parts; int64_t count, n, k; } gguf_weight_t;

#define ROWS(t) do { \
    switch (mr) { \
    case 1: row_dot(t, row, &xr, i, 1, out); break; \
    case 2: row_dot(t, row, &xr, i, 2, out); break; \
    case 3: row_dot(t, row, &xr, i, 3, out); break; \
    default: row_dot(t, row, &xr, i, MR, out); break; \
    } } while (0)

/* y[m, n] = x[m, k] . w[n, k]; x, y fp32; k a whole number of the parts' blocks. Returns 0,
 * -1 where scratch could not be allocated, -2 for a type this kernel does not read. */
int gguf_linear(const float *x, const gguf_weight_t *w, float *y, int64_t m, int threads) {
    const int64_t k = w->k, n = w->n, chunks = k / CHUNK;
    for (int64_t p = 0; p < w->count; p++)
        if (!block_bytes((int)w->parts[p].type)) return -2;
    if (m <= 0 || n <= 0) return 0;
    int8_t *xq = malloc((size_t)(m * k));
    float *dx = malloc((size_t)(m * chunks) * sizeof(float));
    float *xs = malloc((size_t)(m * chunks) * sizeof(float));
    if (!xq || !dx || !xs) {
        free(xq), free(dx), free(xs);
        return -1;
    }
    for (int64_t i = 0; i < m; i++)
        quantize_row(x + i * k, chunks, xq + i * k, dx + i * chunks, xs + i * chunks);
    const xrows_t xr = {xq, dx, xs, chunks};
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < n; j++) {
        const part_t *part = w->parts;
        int64_t local = j;
        while (local >= part->rows) local -= part->rows, part++;
        const uint8_t *row = part->blocks + local * part->row_bytes;
        float out[MR];
        for (int64_t i = 0; i < m; i += MR) {
            const int mr = m - i < MR ? (int)(m - i) : MR;
            switch (part->type) {  /* each a constant, so row_dot folds its format */
            case Q4_0: ROWS(Q4_0); break;
            case Q4_1: ROWS(Q4_1); break;
            case Q5_0: ROWS(Q5_0); break;
            case Q8_0: ROWS(Q8_0); break;
            case Q4_K: ROWS(Q4_K); break;
            case Q5_K: ROWS(Q5_K); break;
            default: ROWS(Q6_K); break;
            }
            for (int r = 0; r < mr; r++) y[(i + r) * n + j] = out[r];
        }
    }
    free(xq), free(dx), free(xs);
    return 0;
}

/* The product as native/decode_layer.c calls it (its product_fn). */
int gguf_product(const void *weight, const float *x, int64_t m, float *y, int threads) {
    return gguf_linear(x, weight, y, m, threads);
}

#if PATH != 0
/* Chunk c of block b widened to fp32 at o, as decode_chunk's values: Q5_0's codes signed
 * (q - 16) with no shift, so that d * (q - 16) rounds once, as gguf-py's does. */
__attribute__((optimize("fp-contract=off"))) static inline void widen_chunk(
    int type, const uint8_t *b, int c, float lo, float hi, float shift, float *o) {
    __m256i w = codes(type, b, c);
    if (type == Q5_0) w = _mm256_sub_epi8(w, _mm256_set1_epi8(16)), shift = 0.f;
    const int sign = signed_codes(type) || type == Q5_0;
    const __m128i low = _mm256_castsi256_si128(w), high = _mm256_extracti128_si256(w, 1);
    const __m128i eighths[4] = {low, _mm_srli_si128(low, 8), high, _mm_srli_si128(high, 8)};
    for (int e = 0; e < 4; e++) {
        const __m256i q = sign ? _mm256_cvtepi8_epi32(eighths[e]) : _mm256_cvtepu8_epi32(eighths[e]);
        __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(e < 2 ? lo : hi));
        if (shift != 0.f) v = _mm256_add_ps(v, _mm256_set1_ps(shift));
        _mm256_storeu_ps(o + 8 * e, v);
    }
}
#endif

/* w[n, k] fp32: the weight's values, bit for bit gguf-py's dequantize_blocks (scale * q, then
 * + shift: two roundings, no fused multiply-add). Returns -2 for a type it does not read. */
__attribute__((optimize("fp-contract=off"))) int gguf_widen(const gguf_weight_t *w, float *out,
                                                            int threads) {
    for (int64_t p = 0; p < w->count; p++)
        if (!block_bytes((int)w->parts[p].type)) return -2;
    const int64_t k = w->k, chunks = k / CHUNK;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < w->n; j++) {
        const part_t *part = w->parts;
        int64_t local = j;
        while (local >= part->rows) local -= part->rows, part++;
        const int type = (int)part->type;
        const int64_t per = block_weights(type) / CHUNK, bytes = block_bytes(type);
        const uint8_t *row = part->blocks + local * part->row_bytes;
        float *o = out + j * k;
#if PATH != 0
        for (int64_t blk = 0; blk < chunks / per; blk++) {
            const uint8_t *b = row + blk * bytes;
            float lo[8], hi[8], sh[8];
            block_scales(type, b, lo, hi, sh);
            for (int c = 0; c < per; c++)
                widen_chunk(type, b, c, lo[c], hi[c], sh[c], o + (blk * per + c) * CHUNK);
        }
#else
        for (int64_t g = 0; g < chunks; g++) {
            chunk_t c;
            decode_chunk(type, row + (g / per) * bytes, (int)(g % per), &c);
            for (int e = 0; e < CHUNK; e++) {
                const float scaled = (e < 16 ? c.lo : c.hi) * (float)c.q[e];
                o[g * CHUNK + e] = c.shift != 0.f ? scaled + c.shift : scaled;
            }
        }
#endif
    }
    return 0;
}
