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
#define FROM_F32(x) (x)
#define TO_F32(x) (x)
/* Positions ahead whose K (or V) row is prefetched: a row is DIM values, so 16 rows is 4 KiB
   of fp32 ahead at DIM 64. Without it the kernel read the KV at 17 GB/s on 2 threads of a
   Xeon that streams 32: it waits on each row's cache misses in turn (its sums run at 50 GB/s
   from cache). With it, 23 GB/s. The rows are fetched into L2, not L1 (prefetcht1): on the
   same Xeon that read 8-10% faster again at 16 and 64 rows (fetched into L1, the prefetches
   hold the L1's few miss buffers that the loads need); 8 or 32 rows ahead read slower. */
#define PREFETCH_ROWS 16
#define PREFETCH(p) __builtin_prefetch((p), 0, 2)

/* Round to nearest even, as torch's .to(torch.bfloat16) does. */
static inline uint16_t to_bf16(float f) {
    union { float f; uint32_t u; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((v.u >> 16) | 64); /* NaN */
    return (uint16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* Positions a chunk of the mirror holds (cpu_attention.CHUNK, or a test's -DCHUNK). */
#ifndef CHUNK
#define CHUNK 128
#endif
_Static_assert((CHUNK & (CHUNK - 1)) == 0, "CHUNK must be a power of two");

/* Position t of a walk over chunk table TAB at offset OFF (CHUNKS chunks in the walk): ROW,
   advanced a row each step by the loop, is re-based at each chunk's start, as is AHEAD,
   PREFETCH_ROWS positions on, whose row is then prefetched. */
#define NEXT_ROW(TAB, OFF, CHUNKS, t, ROW, AHEAD)                                          \
    do {                                                                                   \
        if (((t) & (CHUNK - 1)) == 0) ROW = TAB[(t) / CHUNK] + (OFF);                      \
        const int64_t ahead_ = (t) + PREFETCH_ROWS;                                        \
        if ((ahead_ & (CHUNK - 1)) == 0 && ahead_ < (CHUNKS) * CHUNK)                      \
            AHEAD = TAB[ahead_ / CHUNK] + (OFF);                                           \
        for (int b_ = 0; b_ < (int)(DIM * sizeof(*(AHEAD))); b_ += 64)                     \
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
   (all of them where the pairs are not split); the part holding the last writes the new K and
   V first. */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                             \
int NAME(const float *q, float *out, const float *k_new, const float *v_new,               \
         T *const *k, T *const *v, const int64_t *slots, const int64_t *positions,         \
         int64_t rows, int64_t kvh, int64_t slot_stride, int64_t head_stride, float scale, \
         int threads) {                                                                    \
    int64_t max_n = 0;                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                     \
        if (positions[r] + 1 > max_n) max_n = positions[r] + 1;                            \
    const int64_t pairs = rows * kvh, seg = segments(pairs, max_n, threads);               \
    /* a split pair's parts: each one's maximum and sum per query head, then its V sums */ \
    float *parts = seg > 1 ? malloc(sizeof(float) * pairs * seg * GROUP * (DIM + 2)) : 0;  \
    if (seg > 1 && !parts) return 1;                                                       \
    int failed = 0;                                                                        \
    _Pragma("omp parallel num_threads(threads)")                                           \
    {                                                                                      \
        float *s = malloc(sizeof(float) * GROUP * max_n);                                  \
        if (!s) failed = 1;                                                                \
        _Pragma("omp for schedule(static)")                                                \
        for (int64_t task = 0; task < pairs * seg; task++) {                               \
            if (!s) continue;                                                              \
            const int64_t pair = task / seg, part = task % seg;                            \
            const int64_t r = pair / kvh, h = pair % kvh, n = positions[r] + 1;            \
            const int64_t lo = part * n / seg, hi = (part + 1) * n / seg, len = hi - lo;   \
            const int64_t off = slots[r] * slot_stride + h * head_stride;                  \
            const int64_t chunks = (n + CHUNK - 1) / CHUNK, last = n - 1;                  \
            const float *qh = q + pair * GROUP * DIM;                                      \
            if (hi == n) {                                                                 \
                T *kw = k[last / CHUNK] + off + (last % CHUNK) * DIM;                      \
                T *vw = v[last / CHUNK] + off + (last % CHUNK) * DIM;                      \
                for (int d = 0; d < DIM; d++) {                                            \
                    kw[d] = STORE(k_new[pair * DIM + d]);                                  \
                    vw[d] = STORE(v_new[pair * DIM + d]);                                  \
                }                                                                          \
            }                                                                              \
            /* the row PREFETCH_ROWS past lo, where the walk has one */                    \
            const int64_t ahead = lo + PREFETCH_ROWS, at = (ahead % CHUNK) * DIM;           \
            const int fits = ahead < chunks * CHUNK;                                       \
            float mx[GROUP], sum[GROUP], acc[GROUP * DIM];                                 \
            for (int g = 0; g < GROUP; g++) mx[g] = -3.0e38f;                              \
            const T *kr = k[lo / CHUNK] + off + (lo % CHUNK) * DIM;                        \
            const T *kp = fits ? k[ahead / CHUNK] + off + at : kr;                         \
            for (int64_t t = lo; t < hi; t++, kr += DIM, kp += DIM) {                      \
                NEXT_ROW(k, off, chunks, t, kr, kp);                                       \
                for (int g = 0; g < GROUP; g++) {                                          \
                    const float *qg = qh + g * DIM;                                        \
                    float a = 0.f;                                                         \
                    _Pragma("omp simd reduction(+:a)")                                     \
                    for (int d = 0; d < DIM; d++) a += qg[d] * LOAD(kr[d]);                \
                    a *= scale;                                                            \
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
            const T *vr = v[lo / CHUNK] + off + (lo % CHUNK) * DIM;                        \
            const T *vp = fits ? v[ahead / CHUNK] + off + at : vr;                         \
            for (int64_t t = lo; t < hi; t++, vr += DIM, vp += DIM) {                      \
                NEXT_ROW(v, off, chunks, t, vr, vp);                                       \
                for (int g = 0; g < GROUP; g++) {                                          \
                    float p = s[g * len + t - lo], *ag = acc + g * DIM;                    \
                    _Pragma("omp simd")                                                    \
                    for (int d = 0; d < DIM; d++) ag[d] += p * LOAD(vr[d]);                \
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

DECODE_ATTENTION(decode_attention_f32, float, FROM_F32, TO_F32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, from_bf16, to_bf16)
