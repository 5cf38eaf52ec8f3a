/* fp32 products on a weight packed once in panels (engine/worker/cpu_matmul.py packs and
 * chooses it): the [k, n] weight as ceil(n / P) panels of P = 2 vectors of columns, each
 * panel [k][P] contiguous, the last one padded with zeros. Compiled by native_build with
 * -DVL=<fp32 lanes per vector>.
 *
 * A thread takes a contiguous run of panels. It walks them in blocks of NC columns by KC
 * rows (a block fits the core's L2), and over each block runs every group of MR rows of x:
 * MR x P outputs in 2 MR vector registers, each step one broadcast of x per row against the
 * panel row's two vectors. A panel's rows lie one after the other, so a block streams from
 * memory as one run; read in place from the plain [k, n] weight, each row of a block is a
 * separate page, and the same kernel ran at half the speed. Measured on SmolLM2's products
 * (AMD EPYC, AVX2, 2 threads; oneDNN's and MKL's in the same runs): 16 rows 40 ms against
 * 57 and 100, 64 rows 108 against 170 and 199; prefill chunks of 128-512 rows 117-185
 * GFLOP/s against oneDNN's 148-169. */

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

typedef float vf __attribute__((vector_size(VL * 4)));

#define P (2 * VL)  /* a panel's columns */
#define MR 6        /* rows of x per tile: 2 MR accumulators leave AVX2 four registers */
#define KC 256      /* rows of a block */
#define NC 256      /* columns of a block */

typedef struct {
    const float *panels; /* [ceil(n / P)][k][P] */
    int64_t n, k;
} panels_t;

static inline vf load(const float *p) { vf v; memcpy(&v, p, sizeof v); return v; }
static inline void store(float *p, vf v) { memcpy(p, &v, sizeof v); }

/* out [rows, P] (ldo apart) = (accumulate ? out : 0) + x [rows, kc] (ldx apart) . w [kc, P].
 * Named accumulators: an array of them was kept in memory by gcc, a third of the speed. */
static inline __attribute__((always_inline)) void tile(
    const float *x, int64_t ldx, const float *w, int64_t kc, float *out, int64_t ldo,
    const int rows, const int accumulate) {
    vf c00 = {0}, c01 = {0}, c10 = {0}, c11 = {0}, c20 = {0}, c21 = {0};
    vf c30 = {0}, c31 = {0}, c40 = {0}, c41 = {0}, c50 = {0}, c51 = {0};
#define LOAD(r) if (rows > r) { c##r##0 = load(out + r * ldo); c##r##1 = load(out + r * ldo + VL); }
    if (accumulate) { LOAD(0) LOAD(1) LOAD(2) LOAD(3) LOAD(4) LOAD(5) }
#undef LOAD
    for (int64_t p = 0; p < kc; p++) {
        const vf b0 = load(w + p * P), b1 = load(w + p * P + VL);
#define STEP(r) if (rows > r) { const float a = x[r * ldx + p]; c##r##0 += a * b0; c##r##1 += a * b1; }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
#undef STEP
    }
#define STORE(r) if (rows > r) { store(out + r * ldo, c##r##0); store(out + r * ldo + VL, c##r##1); }
    STORE(0) STORE(1) STORE(2) STORE(3) STORE(4) STORE(5)
#undef STORE
}

static void tile_rows(const float *x, int64_t ldx, const float *w, int64_t kc, float *out,
                      int64_t ldo, int rows, int accumulate) {
    switch (rows) {
    case 6: tile(x, ldx, w, kc, out, ldo, 6, accumulate); break;
    case 5: tile(x, ldx, w, kc, out, ldo, 5, accumulate); break;
    case 4: tile(x, ldx, w, kc, out, ldo, 4, accumulate); break;
    case 3: tile(x, ldx, w, kc, out, ldo, 3, accumulate); break;
    case 2: tile(x, ldx, w, kc, out, ldo, 2, accumulate); break;
    default: tile(x, ldx, w, kc, out, ldo, 1, accumulate); break;
    }
}

/* The panel's tile where it has fewer than P columns of y (the last panel): through a
 * buffer of P columns, y's columns copied in and back. */
static void tile_narrow(const float *x, int64_t ldx, const float *w, int64_t kc, float *y,
                        int64_t n, int64_t cols, int rows, int accumulate) {
    float buf[MR * P];
    for (int r = 0; r < rows; r++)
        for (int64_t c = 0; c < P; c++) buf[r * P + c] = accumulate && c < cols ? y[r * n + c] : 0.f;
    tile_rows(x, ldx, w, kc, buf, P, rows, accumulate);
    for (int r = 0; r < rows; r++) memcpy(y + r * n, buf + r * P, sizeof(float) * (size_t)cols);
}

/* y [m, n] = x [m, k] . W, W packed in panels (panels_t). The signature of decode_layer.c's
 * products, so its layers call it too; returns 0. */
int panels_linear(const void *weight, const float *x, int64_t m, float *y, int threads) {
    const panels_t *W = weight;
    const int64_t n = W->n, k = W->k, panels = (n + P - 1) / P, block = NC / P;
    if (m <= 0) return 0;
    #pragma omp parallel num_threads(threads > 0 ? threads : 1)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t b0 = panels * t / nt, b1 = panels * (t + 1) / nt;
        for (int64_t bc = b0; bc < b1; bc += block) {
            const int64_t be = bc + block < b1 ? bc + block : b1;
            for (int64_t kc = 0; kc < k; kc += KC) {
                const int64_t kl = kc + KC < k ? KC : k - kc;
                for (int64_t r = 0; r < m; r += MR) {
                    const int rows = m - r < MR ? (int)(m - r) : MR;
                    const float *xr = x + r * k + kc;
                    for (int64_t b = bc; b < be; b++) {
                        const float *w = W->panels + (b * k + kc) * P;
                        float *yr = y + r * n + b * P;
                        const int64_t cols = n - b * P;
                        if (cols >= P)
                            tile_rows(xr, k, w, kl, yr, n, rows, kc > 0);
                        else
                            tile_narrow(xr, k, w, kl, yr, n, cols, rows, kc > 0);
                    }
                }
            }
        }
    }
    return 0;
}

/* The panels' width, for the loader's packing. */
int panels_width(void) { return P; }
