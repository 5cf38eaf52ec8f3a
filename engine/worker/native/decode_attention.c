/* Decode attention over the CPU decode mirror (engine/worker/cpu_attention.py loads it).
 * Compiled by native_build per machine and model shape with -DGROUP=<query heads per KV head>
 * -DDIM=<head dim>, so the loops unroll into registers. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static inline float from_bf16(uint16_t x) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)x << 16;
    return v.f;
}
#define TO_F32(x) (x)


/* Positions ahead whose K (or V) row is prefetched: a row is DIM values, so 16 rows is 4 KiB
   of fp32 ahead at DIM 64. Without it the kernel read the KV at 17 GB/s on 2 threads of a
   Xeon that streams 32: it waits on each row's cache misses in turn (its sums run at 50 GB/s
   from cache). With it, 23 GB/s. The rows are fetched into L2, not L1 (prefetcht1): on the
   same Xeon that read 8-10% faster again at 16 and 64 rows (fetched into L1, the prefetches
   hold the L1's few miss buffers that the loads need); 8 or 32 rows ahead read slower. */
#define PREFETCH_ROWS 16
/* A narrower row (bf16, 8-bit) is prefetched about 8 KiB ahead, at least PREFETCH_ROWS rows:
   an 8-bit row is 68 bytes at DIM 64, so 16 rows ahead was only 1 KiB. At 64 rows x 512
   positions (30 layers, AMD EPYC Zen 5, 2 threads), 120 rows ahead read int8 5-11% faster
   (17.3 against 19.5 ms), 64 rows read bf16 10% faster (14.9 against 16.5); fp32's 32 rows
   ahead (8 KiB) changed nothing there and read slower on the Xeon above. */
#define LEAD_8K(BYTES) (8192 / (BYTES) > PREFETCH_ROWS ? 8192 / (BYTES) : PREFETCH_ROWS)
#define PREFETCH(p) __builtin_prefetch((p), 0, 2)

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 64); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* 8-bit rows (engine/worker/kv_quant.py): DIM codes, then the row's fp32 scale, value =
   code * scale. int8: code = round(x / scale), scale = max|x| / 127. fp8 (e4m3, stored as
   bytes): code = e4m3(x / scale), scale = max|x| / 448. Both round to nearest even, as
   torch's packing does, so a row the kernel writes equals the one torch writes. */
#define ROW8 (DIM + 4)
#define SCALE8(row) (*(const float *)((const char *)(row) + DIM))
#define FROM_I8(x) ((float)(x))
#define ONE(row) 1.0f

/* e4m3 (bias 7, 3 mantissa bits, no infinities) -> fp32, without branches: a normal code's
   exponent and mantissa moved into place and re-biased, a subnormal's mantissa * 2^-9. */
static inline float from_e4m3(uint8_t b) {
    union { uint32_t u; float f; } v, r;
    const uint32_t em = b & 0x7fu;
    v.u = (em << 20) + (120u << 23);
    r.f = em < 8 ? (float)(b & 7u) * 0.001953125f : v.f;
    r.u |= (uint32_t)(b & 0x80u) << 24;
    return r.f;
}

/* fp32 (|x| <= 448, finite) -> e4m3, rounding to nearest even */
__attribute__((optimize("no-fast-math")))
static inline uint8_t to_e4m3(float x) {
    union { float f; uint32_t u; } v;
    v.f = x;
    const uint8_t sign = (uint8_t)((v.u >> 24) & 0x80u);
    v.u &= 0x7fffffffu;
    if (v.f < 0.015625f) return sign | (uint8_t)lrintf(v.f * 512.f); /* subnormal: m * 2^-9 */
    uint32_t u = v.u + 0x7ffffu + ((v.u >> 20) & 1u);
    return sign | (uint8_t)((u >> 20) - (120u << 3));
}

/* Row [DIM] of fp32 into an 8-bit row: its codes and its scale. Compiled without
   -ffast-math's reciprocal (x / scale as x * (1 / scale) rounds some codes the other way),
   so that it writes the bytes torch's packing writes. */
#define PACK8(NAME, T, LARGEST, CODE)                                                      \
__attribute__((optimize("no-fast-math")))                                                  \
static void NAME(const float *x, T *row) {                                                 \
    float amax = 0.f;                                                                      \
    for (int d = 0; d < DIM; d++) amax = fmaxf(amax, fabsf(x[d]));                         \
    float scale = amax / LARGEST;                                                          \
    if (scale < 1.17549435e-38f) scale = 1.17549435e-38f;                                 \
    for (int d = 0; d < DIM; d++) {                                                        \
        float c = x[d] / scale;                                                            \
        c = c > LARGEST ? LARGEST : (c < -LARGEST ? -LARGEST : c);                         \
        row[d] = CODE(c);                                                                  \
    }                                                                                      \
    *(float *)((char *)row + DIM) = scale;                                                 \
}
#define I8_CODE(c) ((int8_t)lrintf(c))
PACK8(pack_i8, int8_t, 127.f, I8_CODE)
PACK8(pack_f8, uint8_t, 448.f, to_e4m3)

/* A float row's store: each value cast. */
#define STORE_ROW(NAME, T, STORE)                                                          \
static inline void NAME(const float *x, T *row) {                                          \
    for (int d = 0; d < DIM; d++) row[d] = STORE(x[d]);                                    \
}
STORE_ROW(store_f32, float, TO_F32)
STORE_ROW(store_bf16, uint16_t, to_bf16)

/* Positions a chunk of the mirror holds (cpu_attention.CHUNK, or a test's -DCHUNK). */
#ifndef CHUNK
#define CHUNK 128
#endif
_Static_assert((CHUNK & (CHUNK - 1)) == 0, "CHUNK must be a power of two");

/* A row of DIM values as fp32: an fp32 row as it lies, another converted once into BUF (and
   then read by each of the GROUP query heads; converting in each head's loop instead cost an
   int8 step at 64 rows about a tenth of its attention). */
#define KEEP_F32(row, buf) (row)
#define CONVERTER(NAME, T, LOAD)                                                           \
static inline const float *NAME(const T *row, float *buf) {                                \
    _Pragma("omp simd")                                                                    \
    for (int d = 0; d < DIM; d++) buf[d] = LOAD(row[d]);                                   \
    return buf;                                                                            \
}
CONVERTER(cvt_bf16, uint16_t, from_bf16)
CONVERTER(cvt_i8, int8_t, FROM_I8)
CONVERTER(cvt_f8, uint8_t, from_e4m3)

/* The GROUP query heads' dot products with one key row, into dot[GROUP]. Where GROUP is at
   most 4 and DIM a multiple of the vector width, each head's products add up in one vector,
   and the (up to) four vectors are summed across their lanes together, halving their lanes
   at each step: about 15 shuffles and adds for the four sums, where one reduction per head
   took about 8 each. (At 64 rows x 512 positions of SmolLM2, an int8 KV's attention is bound
   by its instructions, not its bytes: the reductions were the most of them.) */
#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
typedef float vf __attribute__((vector_size(VW * 4)));
typedef int vi __attribute__((vector_size(VW * 4)));
#if GROUP <= 4 && DIM % VW == 0
static inline vf load_vf(const float *p) {
    vf x;
    __builtin_memcpy(&x, p, sizeof x);
    return x;
}
/* (a, b) -> their adjacent pairs' sums, a's in the first half of the lanes, b's in the second */
static inline vf pair_sums(vf a, vf b) {
    vi even, odd;
    for (int i = 0; i < VW; i++) {
        even[i] = 2 * i;
        odd[i] = 2 * i + 1;
    }
    return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}
static inline void group_dots(const float *qh, const float *kx, float *dot) {
    vf acc[4] = {{0}, {0}, {0}, {0}};
    for (int j = 0; j < DIM; j += VW) {
        const vf kj = load_vf(kx + j);
        for (int g = 0; g < GROUP; g++) acc[g] += load_vf(qh + g * DIM + j) * kj;
    }
    /* four vectors -> one whose lanes hold each head's partial sums, VW / 4 apiece */
    vf r = pair_sums(pair_sums(acc[0], acc[1]), pair_sums(acc[2], acc[3]));
    for (int w = VW / 4; w > 1; w /= 2) r = pair_sums(r, r);
    for (int g = 0; g < GROUP; g++) dot[g] = r[g];
}
#else
static inline void group_dots(const float *qh, const float *kx, float *dot) {
    for (int g = 0; g < GROUP; g++) {
        const float *qg = qh + g * DIM;
        float a = 0.f;
        _Pragma("omp simd reduction(+:a)")
        for (int d = 0; d < DIM; d++) a += qg[d] * kx[d];
        dot[g] = a;
    }
}
#endif

/* Position t of a walk over chunk table TAB at offset OFF (CHUNKS chunks in the walk): ROW,
   advanced a row each step by the loop, is re-based at each chunk's start, as is AHEAD,
   PREFETCH_ROWS positions on, whose row is then prefetched. */
#define NEXT_ROW(TAB, OFF, CHUNKS, t, ROW, AHEAD, ROWLEN, LEAD)                            \
    do {                                                                                   \
        if (((t) & (CHUNK - 1)) == 0) ROW = TAB[(t) / CHUNK] + (OFF);                      \
        const int64_t ahead_ = (t) + (LEAD);                                               \
        if ((ahead_ & (CHUNK - 1)) == 0 && ahead_ < (CHUNKS) * CHUNK)                      \
            AHEAD = TAB[ahead_ / CHUNK] + (OFF);                                           \
        for (int b_ = 0; b_ < (int)(ROWLEN * sizeof(*(AHEAD))); b_ += 64)                  \
            PREFETCH((const char *)(AHEAD) + b_);                                          \
    } while (0)

/* A (row, KV head) pair's positions are split in segments() parts, each a task of its own, where
   there are too few pairs to keep every thread busy: one decode stream of a model with 3 KV
   heads is 3 tasks, and 2 threads then take 2 and 1, so one waits for the other. Each part
   keeps its own softmax maximum, sum and weighted V sum, merged after. A part has at least
   SEGMENT_MIN positions. On a 2-vCPU AVX2 EPYC, one row of 4096 positions (30 layers, 3 KV
   heads of 64, fp32): 10.8-12.1 ms on 2 threads whole, against 18.0 for two rows; 9.2-9.4
   split. */
#define SEGMENT_MIN 256
static int64_t segments(int64_t pairs, int64_t max_n, int threads) {
    if (threads < 2 || pairs >= 4 * threads) return 1;
    int64_t seg = (4 * threads + pairs - 1) / pairs;
    const int64_t most = max_n / SEGMENT_MIN;
    return seg < most ? seg : (most > 1 ? most : 1);
}

/* q, out: [rows, kvh * GROUP, DIM] fp32; k_new, v_new: [rows, kvh, DIM] fp32, the rows'
   own K and V, written first at position positions[r] of slot slots[r]. k, v: a layer's
   mirror as chunk tables: chunk c holds positions [c * CHUNK, (c + 1) * CHUNK) of every slot,
   slot s's head h at k[c] + s * slot_stride + h * head_stride, a row of DIM a position. Row r
   attends to positions [0, positions[r]] of its slot. One loop over the positions, its row
   pointer (and the prefetch's, PREFETCH_ROWS ahead) moved to the next chunk at a chunk's
   start: a loop over the chunks, with a loop over each one's rows, read 20-26% slower (a Xeon,
   16 and 64 rows at 128 and 512 positions). A task is a pair's part [lo, hi) of its positions
   (all of them where the pairs are not split). Every row's new K and V are written before any
   row attends, so several rows of one slot at consecutive positions (a request verifying its
   drafts, engine/worker/spec_decode.py) each see the rows before theirs.

   ring > 0: the mirror is a sliding window's ring (engine/worker/decode_cache.py) of ring
   places, as long as the window: position p lies at place p % ring, and row r attends to the
   min(p + 1, ring) places it has (all of them once the ring has wrapped), its new row written
   at place p % ring. */
#define DECODE_ATTENTION(NAME, T, CVT, PUT_ROW, ROWLEN, SCALE_OF, LEAD)                    \
int NAME(const float *q, float *out, const float *k_new, const float *v_new,               \
         T *const *k, T *const *v, const int64_t *slots, const int64_t *positions,         \
         int64_t rows, int64_t kvh, int64_t slot_stride, int64_t head_stride, float scale, \
         int threads, int64_t ring) {                                                      \
    int64_t max_n = 0;                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                     \
        if (positions[r] + 1 > max_n) max_n = positions[r] + 1;                            \
    if (ring && max_n > ring) max_n = ring;                                                \
    const int64_t pairs = rows * kvh, seg = segments(pairs, max_n, threads);               \
    /* a split pair's parts: each one's maximum and sum per query head, then its V sums */ \
    float *parts = seg > 1 ? malloc(sizeof(float) * pairs * seg * GROUP * (DIM + 2)) : 0;  \
    if (seg > 1 && !parts) return 1;                                                       \
    int failed = 0;                                                                        \
    _Pragma("omp parallel num_threads(threads)")                                           \
    {                                                                                      \
        float *s = malloc(sizeof(float) * GROUP * max_n);                                  \
        if (!s) failed = 1;                                                                \
        /* every row's K and V first (the loop's end waits for all): rows of one slot at    \
           consecutive positions (a request verifying drafts) each read the ones before */ \
        _Pragma("omp for schedule(static)")                                                \
        for (int64_t pair = 0; pair < pairs; pair++) {                                     \
            const int64_t r = pair / kvh, h = pair % kvh, p_ = positions[r];               \
            const int64_t off = slots[r] * slot_stride + h * head_stride;                  \
            const int64_t at = ring ? p_ % ring : p_;                                      \
            PUT_ROW(k_new + pair * DIM, k[at / CHUNK] + off + (at % CHUNK) * ROWLEN);      \
            PUT_ROW(v_new + pair * DIM, v[at / CHUNK] + off + (at % CHUNK) * ROWLEN);      \
        }                                                                                  \
        _Pragma("omp for schedule(static)")                                                \
        for (int64_t task = 0; task < pairs * seg; task++) {                               \
            if (!s) continue;                                                              \
            const int64_t pair = task / seg, part = task % seg;                            \
            const int64_t r = pair / kvh, h = pair % kvh, p_ = positions[r];               \
            const int64_t n = ring && p_ >= ring ? ring : p_ + 1;                          \
            const int64_t lo = part * n / seg, hi = (part + 1) * n / seg, len = hi - lo;   \
            const int64_t off = slots[r] * slot_stride + h * head_stride;                  \
            const int64_t chunks = (n + CHUNK - 1) / CHUNK, last = ring ? p_ % ring : n - 1; \
            const float *qh = q + pair * GROUP * DIM;                                      \
            (void)last;                                                                    \
            /* the row PREFETCH_ROWS past lo, where the walk has one */                    \
            const int64_t ahead = lo + (LEAD), at = (ahead % CHUNK) * ROWLEN;               \
            const int fits = ahead < chunks * CHUNK;                                       \
            float mx[GROUP], sum[GROUP], acc[GROUP * DIM], row_[DIM];                      \
            for (int g = 0; g < GROUP; g++) mx[g] = -3.0e38f;                              \
            const T *kr = k[lo / CHUNK] + off + (lo % CHUNK) * ROWLEN;                     \
            const T *kp = fits ? k[ahead / CHUNK] + off + at : kr;                         \
            for (int64_t t = lo; t < hi; t++, kr += ROWLEN, kp += ROWLEN) {                \
                NEXT_ROW(k, off, chunks, t, kr, kp, ROWLEN, LEAD);                         \
                const float ks = scale * SCALE_OF(kr), *kx = CVT(kr, row_);                \
                float dot[GROUP];                                                          \
                group_dots(qh, kx, dot);                                                   \
                for (int g = 0; g < GROUP; g++) {                                          \
                    const float a = dot[g] * ks;                                           \
                    s[g * len + t - lo] = a;                                               \
                    if (a > mx[g]) mx[g] = a;                                              \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < GROUP; g++) {                                              \
                float z = 0.f, m = mx[g], *sg = s + g * len;                               \
                _Pragma("omp simd reduction(+:z)")                                         \
                for (int64_t t = 0; t < len; t++) {                                        \
                    float e = expf(sg[t] - m);                                             \
                    sg[t] = e;                                                             \
                    z += e;                                                                \
                }                                                                          \
                sum[g] = z;                                                                \
                for (int d = 0; d < DIM; d++) acc[g * DIM + d] = 0.f;                      \
            }                                                                              \
            const T *vr = v[lo / CHUNK] + off + (lo % CHUNK) * ROWLEN;                     \
            const T *vp = fits ? v[ahead / CHUNK] + off + at : vr;                         \
            for (int64_t t = lo; t < hi; t++, vr += ROWLEN, vp += ROWLEN) {                \
                NEXT_ROW(v, off, chunks, t, vr, vp, ROWLEN, LEAD);                         \
                const float vs = SCALE_OF(vr), *vx = CVT(vr, row_);                        \
                for (int g = 0; g < GROUP; g++) {                                          \
                    float p = s[g * len + t - lo] * vs, *ag = acc + g * DIM;               \
                    _Pragma("omp simd")                                                    \
                    for (int d = 0; d < DIM; d++) ag[d] += p * vx[d];                      \
                }                                                                          \
            }                                                                              \
            if (seg == 1) {                                                                \
                float *oh = out + pair * GROUP * DIM;                                      \
                for (int g = 0; g < GROUP; g++) {                                          \
                    float inv = 1.f / sum[g];                                              \
                    for (int d = 0; d < DIM; d++) oh[g * DIM + d] = acc[g * DIM + d] * inv; \
                }                                                                          \
            } else {                                                                       \
                float *pt = parts + task * GROUP * (DIM + 2);                              \
                for (int g = 0; g < GROUP; g++) {                                          \
                    pt[g] = mx[g];                                                         \
                    pt[GROUP + g] = sum[g];                                                \
                }                                                                          \
                for (int i = 0; i < GROUP * DIM; i++) pt[2 * GROUP + i] = acc[i];          \
            }                                                                              \
        }                                                                                  \
        free(s);                                                                           \
        if (seg > 1) {                                                                     \
            _Pragma("omp for schedule(static)")                                            \
            for (int64_t pair = 0; pair < pairs; pair++) {                                 \
                const float *pt = parts + pair * seg * GROUP * (DIM + 2);                  \
                float *oh = out + pair * GROUP * DIM;                                      \
                for (int g = 0; g < GROUP; g++) {                                          \
                    float m = -3.0e38f, z = 0.f, w[seg];                                   \
                    for (int64_t p = 0; p < seg; p++)                                      \
                        if (pt[p * GROUP * (DIM + 2) + g] > m)                             \
                            m = pt[p * GROUP * (DIM + 2) + g];                             \
                    for (int64_t p = 0; p < seg; p++) {                                    \
                        const float *pp = pt + p * GROUP * (DIM + 2);                      \
                        w[p] = pp[GROUP + g] > 0.f ? expf(pp[g] - m) : 0.f;                \
                        z += w[p] * pp[GROUP + g];                                         \
                    }                                                                      \
                    const float inv = 1.f / z;                                             \
                    for (int d = 0; d < DIM; d++) {                                        \
                        float a = 0.f;                                                     \
                        for (int64_t p = 0; p < seg; p++)                                  \
                            a += w[p] * pt[p * GROUP * (DIM + 2) + 2 * GROUP + g * DIM + d]; \
                        oh[g * DIM + d] = a * inv;                                         \
                    }                                                                      \
                }                                                                          \
            }                                                                              \
        }                                                                                  \
    }                                                                                      \
    free(parts);                                                                           \
    return failed;                                                                         \
}

DECODE_ATTENTION(decode_attention_f32, float, KEEP_F32, store_f32, DIM, ONE, PREFETCH_ROWS)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, cvt_bf16, store_bf16, DIM, ONE, LEAD_8K(2 * DIM))
DECODE_ATTENTION(decode_attention_i8, int8_t, cvt_i8, pack_i8, ROW8, SCALE8, LEAD_8K(ROW8))
DECODE_ATTENTION(decode_attention_f8, uint8_t, cvt_f8, pack_f8, ROW8, SCALE8, LEAD_8K(ROW8))
