/* LoRA's deltas over one product of a step, in one call (engine/worker/lora.py).
 *
 * segs holds nsegs runs of rows, 5 int64 each: A's address, B's address, the rank r, the first
 * row and the row after the last. For each row i of a run: y[i] += (x[i] A) B, with x [m, k]
 * and y [m, n] row-major, A [k, r] and B [r, n] row-major fp32 (B carries the adapter's
 * scale). A run of rank 0 adds nothing. Torch's small products cost about 10 us each to call:
 * 8 adapters' two products and the add on 4 products of 30 layers were 70 ms of a 150 ms step
 * of 32 rows (SmolLM2, rank 16); their arithmetic is under 3% of the step's. Compiled by
 * native_build. */
#include <stdint.h>
#include <stdlib.h>
#include <omp.h>

#define MAX_RANK 1024

/* One row's delta: y_i += (x_i A) B. */
static void row_delta(const float *xi, float *yi, const float *a, const float *b, int64_t r,
                      int64_t k, int64_t n) {
    float t[MAX_RANK];
    for (int64_t j = 0; j < r; j++) t[j] = 0.f;
    for (int64_t c = 0; c < k; c++) {
        const float xv = xi[c];
        const float *ac = a + c * r;
        #pragma omp simd
        for (int64_t j = 0; j < r; j++) t[j] += xv * ac[j];
    }
    for (int64_t j = 0; j < r; j++) {
        const float tv = t[j];
        const float *bj = b + j * n;
        #pragma omp simd
        for (int64_t c = 0; c < n; c++) yi[c] += tv * bj[c];
    }
}

/* The rows of every run are shared out among the threads in order, each thread a contiguous
 * share, so a thread's rows of one adapter read its A and B from cache after the first. */
void lora_add(const int64_t *segs, int64_t nsegs, const float *x, float *y, int64_t k,
              int64_t n, int threads) {
    int64_t rows = 0;
    for (int64_t s = 0; s < nsegs; s++) rows += segs[5 * s + 4] - segs[5 * s + 3];
    if (rows <= 0) return;
    #pragma omp parallel num_threads(threads) if (rows > 1)
    {
        const int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t lo = rows * t / nt, hi = rows * (t + 1) / nt;
        int64_t seen = 0;  /* rows of the runs before s */
        for (int64_t s = 0; s < nsegs && seen < hi; s++) {
            const int64_t first = segs[5 * s + 3], end = segs[5 * s + 4], r = segs[5 * s + 2];
            const int64_t count = end - first;
            /* this run's rows in [lo, hi) of the flattened order */
            int64_t from = lo > seen ? lo - seen : 0, to = hi - seen < count ? hi - seen : count;
            seen += count;
            if (r <= 0 || r > MAX_RANK || from >= to) continue;
            const float *a = (const float *)(intptr_t)segs[5 * s];
            const float *b = (const float *)(intptr_t)segs[5 * s + 1];
            for (int64_t i = first + from; i < first + to; i++)
                row_delta(x + i * k, y + i * n, a, b, r, k, n);
        }
    }
}
