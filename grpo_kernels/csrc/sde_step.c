/* Fused CPU kernels for one SDE step of a flow-matching policy (see grpo_kernels/cpu_fused.py).
 *
 * Latents are contiguous [B, N] rows of fp32 or bf16; per-sample coefficients are fp32 [B]
 * (float64 in the backward, which forms its scales from them):
 * mean m = a x + b v (never stored), x' = m + n eps, logp = alpha * sum (x' - m)^2 + beta.
 * Work is split into fixed blocks of BLOCK elements (static OpenMP schedule: each thread takes
 * one contiguous run of blocks), and partial sums are added in block order, so results are
 * bit-identical for any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16384
#define LANES 16
/* Below this many elements per input (~30 us of work on one core) one thread does it all:
 * waking a sleeping OpenMP worker costs about as much as the split would save, and on shared
 * cores a descheduled worker stalls the whole region (~8 ms measured here under load). */
#define PARALLEL_MIN (1 << 18)

static inline float load_f32(const float *p, int64_t i) { return p[i]; }
static inline void store_f32(float *p, int64_t i, float f) { p[i] = f; }

/* bf16 is the top half of an fp32; stores round to nearest even, as torch does. */
static inline float load_bf16(const uint16_t *p, int64_t i) {
    uint32_t u = (uint32_t)p[i] << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}
static inline void store_bf16(uint16_t *p, int64_t i, float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) { p[i] = 0x7fc0; return; }
    u += 0x7fffu + ((u >> 16) & 1u);
    p[i] = (uint16_t)(u >> 16);
}

#define DEFINE_KERNELS(T, SUFFIX)                                                              \
/* logp[i] = alpha[i] * sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 + beta[i] */             \
void sde_logprob_fwd_##SUFFIX(const T *x, const T *v, const T *xn, const float *a,             \
                              const float *b, const float *alpha, const float *beta,           \
                              float *logp, int64_t rows, int64_t n) {                          \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    double *partial = malloc(sizeof(double) * rows * blocks);                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        const float ar = a[row], br = b[row];                                                  \
        const int64_t off = row * n;                                                           \
        float acc[LANES] = {0};                                                                \
        int64_t k = start;                                                                     \
        for (; k + LANES <= stop; k += LANES)                                                  \
            for (int j = 0; j < LANES; j++) {                                                  \
                float d = load_##SUFFIX(xn, off + k + j) - ar * load_##SUFFIX(x, off + k + j)  \
                          - br * load_##SUFFIX(v, off + k + j);                                \
                acc[j] += d * d;                                                               \
            }                                                                                  \
        double sum = 0.0;                                                                      \
        for (int j = 0; j < LANES; j++) sum += acc[j];                                         \
        for (; k < stop; k++) {                                                                \
            float d = load_##SUFFIX(xn, off + k) - ar * load_##SUFFIX(x, off + k)              \
                      - br * load_##SUFFIX(v, off + k);                                        \
            sum += (double)d * d;                                                              \
        }                                                                                      \
        partial[task] = sum;                                                                   \
    }                                                                                          \
    for (int64_t row = 0; row < rows; row++) {                                                 \
        double sum = 0.0;                                                                      \
        for (int64_t blk = 0; blk < blocks; blk++) sum += partial[row * blocks + blk];         \
        logp[row] = (float)((double)alpha[row] * sum + (double)beta[row]);                     \
    }                                                                                          \
    free(partial);                                                                             \
}                                                                                              \
                                                                                               \
/* Gradients of sum_i g[i] logp[i]: with scale = 2 alpha[i] g[i] and d = x' - a x - b v,   \
 * gx = -a scale d, gv = -b scale d, gx' = scale d, for each requested (non-NULL) output.     \
 * The scales are formed in double from the double coefficients, then rounded to float.     \
 * g is read with a stride (0 for the backward of a .sum()). */                              \
void sde_logprob_bwd_##SUFFIX(const T *x, const T *v, const T *xn, const double *a,            \
                              const double *b, const double *alpha, const float *g,            \
                              int64_t g_stride, T *gx, T *gv, T *gn, int64_t rows, int64_t n) { \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        const double scale = 2.0 * alpha[row] * (double)g[row * g_stride];                     \
        const float ar = (float)a[row], br = (float)b[row];                                    \
        const float sx = (float)(-a[row] * scale), sv = (float)(-b[row] * scale);              \
        const float sn = (float)scale;                                                         \
        const int64_t off = row * n;                                                           \
        if (gv && !gx && !gn) { /* the common case: gradient to the velocity only */           \
            for (int64_t k = off + start; k < off + stop; k++)                                 \
                store_##SUFFIX(gv, k, sv * (load_##SUFFIX(xn, k) - ar * load_##SUFFIX(x, k)    \
                                            - br * load_##SUFFIX(v, k)));                      \
            continue;                                                                          \
        }                                                                                      \
        for (int64_t k = off + start; k < off + stop; k++) {                                   \
            float d = load_##SUFFIX(xn, k) - ar * load_##SUFFIX(x, k) - br * load_##SUFFIX(v, k); \
            if (gx) store_##SUFFIX(gx, k, sx * d);                                             \
            if (gv) store_##SUFFIX(gv, k, sv * d);                                             \
            if (gn) store_##SUFFIX(gn, k, sn * d);                                             \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* out[i,k] = a[i] x[i,k] + b[i] v[i,k] + scale[i] eps[i,k] */                                 \
void sde_sample_##SUFFIX(const T *x, const T *v, const T *eps, const float *a, const float *b, \
                         const float *scale, T *out, int64_t rows, int64_t n) {                \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        const float ar = a[row], br = b[row], sr = scale[row];                                 \
        for (int64_t k = row * n + start; k < row * n + stop; k++)                             \
            store_##SUFFIX(out, k, ar * load_##SUFFIX(x, k) + br * load_##SUFFIX(v, k)         \
                                   + sr * load_##SUFFIX(eps, k));                              \
    }                                                                                          \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(uint16_t, bf16)
