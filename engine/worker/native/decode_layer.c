/* A Llama decoder layer's work between its matrix products, for decode steps
 * (engine/worker/cpu_decode_layer.py loads it): the norms and residual adds, RoPE, the paged
 * KV cache write, decode attention (the kernel cpu_attention chose, called by its address)
 * and SwiGLU, each in one call over all of a step's rows. Compiled by native_build.
 *
 * decode_layer runs a whole layer in one call where its products are native too (int4's
 * kernel, or fp32's f32_product: its own pass over the weights for one or two rows, sgemm
 * handed in by address for more): a step then runs no Python between its ops. */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

/* decode_attention_f32, or _i8 / _f8 over an 8-bit mirror (native/decode_attention.c) */
typedef int (*attention_fn)(const float *q, float *out, const float *k_new, const float *v_new,
                            void *const *k, void *const *v, const int64_t *slots,
                            const int64_t *positions,
                            int64_t rows, int64_t kvh, int64_t slot_stride, int64_t head_stride,
                            float scale, int threads, int64_t ring);

/* y [m, w->n] = x [m, w->k] . w: a native product over a weight it describes */
typedef struct {
    const void *weight;
    int64_t n, k;  /* out, in */
} weight_t;
typedef int (*product_fn)(const void *weight, const float *x, int64_t m, float *y, int threads);

/* Fortran BLAS sgemm: MKL's, which torch's CPU library exports and aten's fp32 products call */
typedef void (*sgemm_fn)(const char *transa, const char *transb, const int *m, const int *n,
                         const int *k, const float *alpha, const float *a, const int *lda,
                         const float *b, const int *ldb, const float *beta, float *c,
                         const int *ldc);
typedef struct {
    const float *w;  /* [k, n], row-major: the model's Linear stores [in, out] */
    int64_t n, k;
    sgemm_fn sgemm;
} f32_weight_t;

/* Steps of at most this many rows take their fp32 products from f32_rows, not sgemm. */
#define F32_ROWS_MAX 2

/* y [m, n] = x [m, k] . w [k, n] for a step of one or two rows, read at the memory's speed.
 * Each thread streams its own contiguous block of w's rows (k split over the threads, four
 * rows a pass) into a partial y of its own, and the partials are summed after. MKL's sgemm
 * at one row read SmolLM2's 425 MB of decoder weights at 13-16 GB/s, oneDNN's product (from
 * Python) at about 20, and this at 29-30, as fast as a plain sum of the same bytes (AMD EPYC,
 * AVX2, 2 threads). Returns -1 where its partials cannot be allocated. */
static int f32_rows(const f32_weight_t *W, const float *x, int64_t m, float *y, int threads) {
    const int64_t n = W->n, k = W->k;
    const float *w = W->w;
    float *part = malloc(sizeof(float) * (size_t)threads * (size_t)(m * n));
    if (!part) return -1;
    #pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t i0 = k * t / nt, i1 = k * (t + 1) / nt;
        float *py = part + (size_t)t * (size_t)(m * n);
        memset(py, 0, sizeof(float) * (size_t)(m * n));
        int64_t i = i0;
        for (; i + 4 <= i1; i += 4) {
            const float *w0 = w + i * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
            for (int64_t r = 0; r < m; r++) {
                const float *xr = x + r * k;
                const float a0 = xr[i], a1 = xr[i + 1], a2 = xr[i + 2], a3 = xr[i + 3];
                float *yr = py + r * n;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++)
                    yr[j] += a0 * w0[j] + a1 * w1[j] + a2 * w2[j] + a3 * w3[j];
            }
        }
        for (; i < i1; i++)
            for (int64_t r = 0; r < m; r++) {
                const float a = x[r * k + i], *wi = w + i * n;
                float *yr = py + r * n;
                #pragma omp simd
                for (int64_t j = 0; j < n; j++) yr[j] += a * wi[j];
            }
        #pragma omp barrier
        #pragma omp for schedule(static)
        for (int64_t j = 0; j < m * n; j++) {
            float sum = 0.f;
            for (int u = 0; u < nt; u++) sum += part[(size_t)u * (size_t)(m * n) + j];
            y[j] = sum;
        }
    }
    free(part);
    return 0;
}

/* y [m, n] = x [m, k] . w: steps of up to F32_ROWS_MAX rows through f32_rows, wider ones
 * through sgemm, called as aten calls it for x @ w (its results are the same bits); sgemm
 * runs on the BLAS's own threads, which torch sets with its own. */
int f32_product(const void *weight, const float *x, int64_t m, float *y, int threads) {
    const f32_weight_t *W = weight;
    if (m <= F32_ROWS_MAX) return f32_rows(W, x, m, y, threads > 0 ? threads : 1);
    const int n = (int)W->n, k = (int)W->k, rows = (int)m;
    const float one = 1.0f, zero = 0.0f;
    /* Column-major: y^T [n, m] = w^T [n, k] . x^T [k, m], each buffer as it lies. */
    W->sgemm("N", "N", &n, &rows, &k, &one, W->w, &n, x, &k, &zero, y, &n);
    return 0;
}

typedef struct {
    int64_t heads, kv_heads, head_dim;
    float scale;
    attention_fn attention;
    /* 0: an fp32 KV cache. Else the bytes of a bf16 row, or of an 8-bit one (head_dim codes
       and a 4-byte scale, engine/worker/kv_quant.py): the attention kernel writes each new
       row into the mirror (rounded, or packed), and that row's bytes are copied into the paged
       cache after it. */
    int64_t row_bytes;
    int64_t elem_bytes;  /* of the mirror's elements, whose strides the step gives */
} attn_t;

typedef struct {
    const float *cos, *sin;            /* [m, head_dim]: each row's rotary tables */
    const int64_t *slot_mapping;       /* [m]: each row's row of the paged KV cache */
    float *k_cache, *v_cache;          /* the layer's paged cache, [rows, kv_heads, head_dim] */
    void *const *kb, *const *vb;       /* the layer's decode mirror: its chunk tables */
    const int64_t *slots, *positions;  /* [m]: each row's mirror slot and position */
    int64_t slot_stride, head_stride;
} step_t;

/* Rows at which the row-wise work (the norms, RoPE and the paged KV write) splits over the
 * threads: below, a parallel region costs about what it saves. At 64 rows of SmolLM2 (2 threads,
 * Xeon) the three were about 2.5 ms of a 95 ms step on one thread, the other waiting. */
#define PARALLEL_ROWS 32

/* h += add (where add is set), then out = h * rsqrt(mean(h^2) + eps) * w (where w is set);
 * m rows of n. */
void add_rms_norm(float *h, const float *add, const float *w, float eps, int64_t m, int64_t n,
                  float *out, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t i = 0; i < m; i++) {
        float *hr = h + i * n;
        if (add)
            for (int64_t j = 0; j < n; j++) hr[j] += add[i * n + j];
        if (!w) continue;
        float ss = 0.f;
        for (int64_t j = 0; j < n; j++) ss += hr[j] * hr[j];
        const float r = 1.0f / sqrtf(ss / (float)n + eps);
        for (int64_t j = 0; j < n; j++) out[i * n + j] = hr[j] * r * w[j];
    }
}

/* Hugging Face's rotate_half form: out = x * cos + cat(-x[half:], x[:half]) * sin */
static void rotate(const float *x, const float *cos, const float *sin, int64_t dim,
                   float *out) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        out[i] = x[i] * cos[i] - x[i + half] * sin[i];
        out[i + half] = x[i + half] * cos[i + half] + x[i] * sin[i + half];
    }
}

/* qkv [m, (heads + 2 kv_heads) * D] -> out [m, heads * D]: RoPE on q and k, k and v into
 * the paged cache, then attention over the mirror (which writes them there too). Returns 0,
 * or -1 where memory or the attention kernel failed. */
int rope_attend(const attn_t *A, const step_t *S, const float *qkv, float *out, int64_t m,
                int threads) {
    if (m <= 0) return 0;
    const int64_t D = A->head_dim, qs = A->heads * D, kvs = A->kv_heads * D;
    const int64_t width = qs + 2 * kvs;
    float *q = malloc(sizeof(float) * (size_t)(m * (qs + 2 * kvs)));
    if (!q) return -1;
    float *k = q + m * qs, *v = k + m * kvs;
    #pragma omp parallel for num_threads(threads) schedule(static) if (m >= PARALLEL_ROWS)
    for (int64_t r = 0; r < m; r++) {
        const float *row = qkv + r * width, *cos = S->cos + r * D, *sin = S->sin + r * D;
        for (int64_t a = 0; a < A->heads; a++) rotate(row + a * D, cos, sin, D, q + r * qs + a * D);
        for (int64_t a = 0; a < A->kv_heads; a++)
            rotate(row + qs + a * D, cos, sin, D, k + r * kvs + a * D);
        memcpy(v + r * kvs, row + qs + kvs, sizeof(float) * (size_t)kvs);
        if (A->row_bytes) continue;  /* 8-bit: written after attention packs the rows */
        memcpy(S->k_cache + S->slot_mapping[r] * kvs, k + r * kvs, sizeof(float) * (size_t)kvs);
        memcpy(S->v_cache + S->slot_mapping[r] * kvs, v + r * kvs, sizeof(float) * (size_t)kvs);
    }
    const int failed = A->attention(q, out, k, v, S->kb, S->vb, S->slots, S->positions, m,
                                    A->kv_heads, S->slot_stride, S->head_stride, A->scale,
                                    threads, 0);
    free(q);
    if (!failed && A->row_bytes) {
        /* Each new row as the kernel packed it in the mirror (chunks of CHUNK rows, strides
           in bytes), into the paged cache's row of its slot. */
        const int64_t rb = A->row_bytes, e = A->elem_bytes;
        const int64_t head = S->head_stride * e, chunk = head / rb;
        for (int64_t r = 0; r < m; r++) {
            const int64_t p = S->positions[r];
            const int64_t at = S->slots[r] * S->slot_stride * e + (p % chunk) * rb;
            char *kc = (char *)S->k_cache + S->slot_mapping[r] * A->kv_heads * rb;
            char *vc = (char *)S->v_cache + S->slot_mapping[r] * A->kv_heads * rb;
            const char *ks = (const char *)S->kb[p / chunk] + at;
            const char *vs = (const char *)S->vb[p / chunk] + at;
            for (int64_t h = 0; h < A->kv_heads; h++) {
                memcpy(kc + h * rb, ks + h * head, (size_t)rb);
                memcpy(vc + h * rb, vs + h * head, (size_t)rb);
            }
        }
    }
    return failed ? -1 : 0;
}

/* gu [m, 2 * inter] (gate, then up) -> act [m, inter] = silu(gate) * up */
void swiglu(const float *gu, float *act, int64_t m, int64_t inter, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static) if (m * inter >= 65536)
    for (int64_t r = 0; r < m; r++)
        for (int64_t j = 0; j < inter; j++) {
            const float g = gu[r * 2 * inter + j], u = gu[r * 2 * inter + inter + j];
            act[r * inter + j] = g / (1.0f + expf(-g)) * u;
        }
}

typedef struct {
    weight_t qkv, o, gate_up, down;
    product_fn product;
    const float *norm_in, *norm_mlp;  /* input_layernorm, post_attention_layernorm */
    float eps;
    attn_t attn;
} layer_t;

static int product(const layer_t *L, const weight_t *w, const float *x, int64_t m, float *y,
                   int threads) {
    return L->product(w->weight, x, m, y, threads);
}

/* h [m, hidden] in place: h += attention(norm(h)); h += mlp(norm(h)), every product through
 * L->product. Returns 0, or -1 where memory, a product or attention failed. */
int decode_layer(const layer_t *L, const step_t *S, float *h, int64_t m, int threads) {
    if (m <= 0) return 0;
    const int64_t hidden = L->qkv.k, qs = L->attn.heads * L->attn.head_dim, inter = L->down.k;
    float *buf = malloc(sizeof(float) * (size_t)m
                        * (size_t)(hidden + L->qkv.n + qs + hidden + 2 * inter + inter));
    if (!buf) return -1;
    float *xn = buf, *qkv = xn + m * hidden, *attn = qkv + m * L->qkv.n, *o = attn + m * qs,
          *gu = o + m * hidden, *act = gu + m * 2 * inter;
    add_rms_norm(h, NULL, L->norm_in, L->eps, m, hidden, xn, threads);
    int failed = product(L, &L->qkv, xn, m, qkv, threads);
    if (!failed) failed = rope_attend(&L->attn, S, qkv, attn, m, threads);
    if (!failed) failed = product(L, &L->o, attn, m, o, threads);
    if (!failed) {
        add_rms_norm(h, o, L->norm_mlp, L->eps, m, hidden, xn, threads);
        failed = product(L, &L->gate_up, xn, m, gu, threads);
    }
    if (!failed) {
        swiglu(gu, act, m, inter, threads);
        failed = product(L, &L->down, act, m, o, threads);
    }
    if (!failed) add_rms_norm(h, o, NULL, 0.f, m, hidden, NULL, threads);
    free(buf);
    return failed ? -1 : 0;
}
