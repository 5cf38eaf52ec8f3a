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

/* q, out: [rows, kvh * GROUP, DIM] fp32; k_new, v_new: [rows, kvh, DIM] fp32, the rows'
   own K and V, written first at position positions[r] of slot slots[r]. k, v: a layer's
   mirror as chunk tables: chunk c holds positions [c * CHUNK, (c + 1) * CHUNK) of every slot,
   slot s's head h at k[c] + s * slot_stride + h * head_stride, a row of DIM a position. Row r
   attends to positions [0, positions[r]] of its slot. One loop over the positions, its row
   pointer (and the prefetch's, PREFETCH_ROWS ahead) moved to the next chunk at a chunk's
   start: a loop over the chunks, with a loop over each one's rows, read 20-26% slower (a Xeon,
   16 and 64 rows at 128 and 512 positions). */
#define DECODE_ATTENTION(NAME, T, LOAD, STORE)                                             \
int NAME(const float *q, float *out, const float *k_new, const float *v_new,               \
         T *const *k, T *const *v, const int64_t *slots, const int64_t *positions,         \
         int64_t rows, int64_t kvh, int64_t slot_stride, int64_t head_stride, float scale, \
         int threads) {                                                                    \
    int64_t max_n = 0;                                                                     \
    for (int64_t r = 0; r < rows; r++)                                                     \
        if (positions[r] + 1 > max_n) max_n = positions[r] + 1;                            \
    int failed = 0;                                                                        \
    _Pragma("omp parallel num_threads(threads)")                                           \
    {                                                                                      \
        float *s = malloc(sizeof(float) * GROUP * max_n);                                  \
        if (!s) failed = 1;                                                                \
        _Pragma("omp for schedule(static)")                                                \
        for (int64_t task = 0; task < rows * kvh; task++) {                                \
            if (!s) continue;                                                              \
            int64_t r = task / kvh, h = task % kvh, n = positions[r] + 1;                  \
            const int64_t off = slots[r] * slot_stride + h * head_stride;                  \
            const int64_t chunks = (n + CHUNK - 1) / CHUNK, last = n - 1;                  \
            const float *qh = q + task * GROUP * DIM;                                      \
            T *kw = k[last / CHUNK] + off + (last % CHUNK) * DIM;                          \
            T *vw = v[last / CHUNK] + off + (last % CHUNK) * DIM;                          \
            for (int d = 0; d < DIM; d++) {                                                \
                kw[d] = STORE(k_new[task * DIM + d]);                                      \
                vw[d] = STORE(v_new[task * DIM + d]);                                      \
            }                                                                              \
            float mx[GROUP], sum[GROUP], acc[GROUP * DIM];                                 \
            for (int g = 0; g < GROUP; g++) mx[g] = -3.0e38f;                              \
            const T *kr = k[0] + off, *kp = kr + PREFETCH_ROWS * DIM;                      \
            for (int64_t t = 0; t < n; t++, kr += DIM, kp += DIM) {                        \
                NEXT_ROW(k, off, chunks, t, kr, kp);                                       \
                for (int g = 0; g < GROUP; g++) {                                          \
                    const float *qg = qh + g * DIM;                                        \
                    float a = 0.f;                                                         \
                    _Pragma("omp simd reduction(+:a)")                                     \
                    for (int d = 0; d < DIM; d++) a += qg[d] * LOAD(kr[d]);                \
                    a *= scale;                                                            \
                    s[g * n + t] = a;                                                      \
                    if (a > mx[g]) mx[g] = a;                                              \
                }                                                                          \
            }                                                                              \
            for (int g = 0; g < GROUP; g++) {                                              \
                float z = 0.f, m = mx[g], *sg = s + g * n;                                 \
                _Pragma("omp simd reduction(+:z)")                                         \
                for (int64_t t = 0; t < n; t++) {                                          \
                    float e = expf(sg[t] - m);                                             \
                    sg[t] = e;                                                             \
                    z += e;                                                                \
                }                                                                          \
                sum[g] = z;                                                                \
                for (int d = 0; d < DIM; d++) acc[g * DIM + d] = 0.f;                      \
            }                                                                              \
            const T *vr = v[0] + off, *vp = vr + PREFETCH_ROWS * DIM;                      \
            for (int64_t t = 0; t < n; t++, vr += DIM, vp += DIM) {                        \
                NEXT_ROW(v, off, chunks, t, vr, vp);                                       \
                for (int g = 0; g < GROUP; g++) {                                          \
                    float p = s[g * n + t], *ag = acc + g * DIM;                           \
                    _Pragma("omp simd")                                                    \
                    for (int d = 0; d < DIM; d++) ag[d] += p * LOAD(vr[d]);                \
                }                                                                          \
            }                                                                              \
            float *oh = out + task * GROUP * DIM;                                          \
            for (int g = 0; g < GROUP; g++) {                                              \
                float inv = 1.f / sum[g];                                                  \
                for (int d = 0; d < DIM; d++) oh[g * DIM + d] = acc[g * DIM + d] * inv;    \
            }                                                                              \
        }                                                                                  \
        free(s);                                                                           \
    }                                                                                      \
    return failed;                                                                         \
}

DECODE_ATTENTION(decode_attention_f32, float, FROM_F32, TO_F32)
DECODE_ATTENTION(decode_attention_bf16, uint16_t, from_bf16, to_bf16)
