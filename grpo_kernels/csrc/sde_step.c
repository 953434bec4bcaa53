/* Fused CPU kernels for one SDE step of a flow-matching policy (see grpo_kernels/cpu_fused.py).
 *
 * Latents are contiguous [B, N] rows of fp32 or bf16; per-sample coefficients are fp32 [B]:
 * mean m = a x + b v (never stored), x' = m + n eps, logp = alpha * sum (x' - m)^2 + beta.
 * Work is split into fixed blocks of BLOCK elements (static OpenMP schedule), and partial sums
 * are added in block order, so results are bit-identical for any thread count.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 16384
#define LANES 16

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
    _Pragma("omp parallel for schedule(static)")                                               \
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
/* g_t[i,k] = s_t[i] * (x'[i,k] - a[i] x[i,k] - b[i] v[i,k]) for each requested output t. */  \
void sde_logprob_bwd_##SUFFIX(const T *x, const T *v, const T *xn, const float *a,             \
                              const float *b, const float *sx, const float *sv,                \
                              const float *sn, T *gx, T *gv, T *gn, int64_t rows, int64_t n) { \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static)")                                               \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        const float ar = a[row], br = b[row];                                                  \
        const int64_t off = row * n;                                                           \
        if (gv && !gx && !gn) { /* the common case: gradient to the velocity only */           \
            const float s = sv[row];                                                           \
            for (int64_t k = off + start; k < off + stop; k++)                                 \
                store_##SUFFIX(gv, k, s * (load_##SUFFIX(xn, k) - ar * load_##SUFFIX(x, k)     \
                                           - br * load_##SUFFIX(v, k)));                       \
            continue;                                                                          \
        }                                                                                      \
        for (int64_t k = off + start; k < off + stop; k++) {                                   \
            float d = load_##SUFFIX(xn, k) - ar * load_##SUFFIX(x, k) - br * load_##SUFFIX(v, k); \
            if (gx) store_##SUFFIX(gx, k, sx[row] * d);                                        \
            if (gv) store_##SUFFIX(gv, k, sv[row] * d);                                        \
            if (gn) store_##SUFFIX(gn, k, sn[row] * d);                                        \
        }                                                                                      \
    }                                                                                          \
}                                                                                              \
                                                                                               \
/* out[i,k] = a[i] x[i,k] + b[i] v[i,k] + scale[i] eps[i,k] */                                 \
void sde_sample_##SUFFIX(const T *x, const T *v, const T *eps, const float *a, const float *b, \
                         const float *scale, T *out, int64_t rows, int64_t n) {                \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static)")                                               \
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
