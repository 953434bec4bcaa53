/* Fused CPU kernels for one SDE step of a flow-matching policy (see grpo_kernels/cpu_fused.py).
 *
 * Latents are contiguous [B, N] rows of fp32 or bf16. Each kernel computes its per-row
 * coefficients itself, in double, from the step's parameters (step_coefficients below): the
 * mean m = a x + b v (never stored), x' = m + n eps, logp = alpha * sum (x' - m)^2 + beta.
 * The forward and the sampler use them rounded to float; the backward forms its scales in
 * double.
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

/* The step's parameters: sigma, sigma', eta, sigma_max. Row i of parameter j is
 * p[j][i * stride[j]] (stride 0: one value for every row), a double if bit j of f64 is set, else
 * a float. kind: 0 flow, 1 dance, 2 cps, 3 cps_mse; mean: 1 for reduction="mean", 0 for "sum". */
#define STEP_ARGS const void *p_sigma, const void *p_next, const void *p_eta, const void *p_max, \
    int64_t s_sigma, int64_t s_next, int64_t s_eta, int64_t s_max, int64_t f64, int64_t kind,  \
    int64_t mean
#define STEP_INIT {{p_sigma, p_next, p_eta, p_max}, {s_sigma, s_next, s_eta, s_max}, f64, kind, mean}

typedef struct {
    const void *p[4];
    int64_t stride[4];
    int64_t f64, kind, mean;
} step_t;

enum { A, B, N, ALPHA, BETA };

static inline double step_param(const step_t *st, int j, int64_t row) {
    int64_t i = row * st->stride[j];
    /* + 0.0: a -0.0 parameter computes as 0.0 */
    return ((st->f64 >> j) & 1 ? ((const double *)st->p[j])[i] : (double)((const float *)st->p[j])[i]) + 0.0;
}

/* Row `row`'s (a, b, n, alpha, beta) for rows of n_elems elements: docs/math.md's formulas
 * expanded (see sde_coefficients.py, which computes the same expressions in torch). No FMA
 * contraction here: every operation rounds as written, as numpy and torch round it. */
__attribute__((optimize("fp-contract=off")))
static void step_coefficients(const step_t *st, int64_t row, int64_t n_elems, double c[5]) {
    const double s = step_param(st, 0, row), s_next = step_param(st, 1, row);
    const double eta = step_param(st, 2, row), s_max = step_param(st, 3, row);
    const double dt = s_next - s;
    double a, b, n;
    if (st->kind == 0) { /* flow: at s == 1 the schedule's s_1 replaces s in the denominator */
        double std = eta * sqrt(s / (1 - (s == 1 ? s_max : s)));
        a = 1 + std * std / (2 * s) * dt;
        b = (1 + std * std * (1 - s) / (2 * s)) * dt;
        n = std * sqrt(-dt);
    } else if (st->kind == 1) { /* dance */
        double drift = 0.5 * (eta * eta) * dt / s;
        a = 1 + drift;
        b = dt + drift * (1 - s);
        n = eta * sqrt(-dt);
    } else { /* cps, cps_mse */
        n = s_next * sin(eta * (M_PI / 2));
        double k = sqrt(s_next * s_next - n * n);
        a = (1 - s_next) + k;
        b = -(1 - s_next) * s + k * (1 - s);
    }
    double alpha, beta;
    if (st->kind == 3) { alpha = -1.0; beta = 0.0; }
    else { alpha = -1 / (2 * (n * n)); beta = -log(n) - 0.5 * log(2 * M_PI); }
    if (st->mean) alpha = alpha / (double)n_elems;
    else beta = beta * (double)n_elems;
    c[A] = a; c[B] = b; c[N] = n; c[ALPHA] = alpha; c[BETA] = beta;
}

#define DEFINE_KERNELS(T, SUFFIX)                                                              \
/* logp[i] = alpha[i] * sum_k (x'[i,k] - a[i] x[i,k] - b[i] v[i,k])^2 + beta[i] */             \
void sde_logprob_fwd_##SUFFIX(const T *x, const T *v, const T *xn, STEP_ARGS,               \
                              float *logp, int64_t rows, int64_t n) {                          \
    const step_t st = STEP_INIT;                                                               \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    double *partial = malloc(sizeof(double) * rows * blocks);                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        double c[5];                                                                           \
        step_coefficients(&st, row, n, c);                                                     \
        const float ar = (float)c[A], br = (float)c[B];                                        \
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
        double c[5];                                                                           \
        step_coefficients(&st, row, n, c);                                                     \
        logp[row] = (float)((double)(float)c[ALPHA] * sum + (double)(float)c[BETA]);           \
    }                                                                                          \
    free(partial);                                                                             \
}                                                                                              \
                                                                                               \
/* Gradients of sum_i g[i] logp[i]: with scale = 2 alpha[i] g[i] and d = x' - a x - b v,   \
 * gx = -a scale d, gv = -b scale d, gx' = scale d, for each requested (non-NULL) output.     \
 * The scales are formed in double from the double coefficients, then rounded to float.     \
 * g is read with a stride (0 for the backward of a .sum()). */                              \
void sde_logprob_bwd_##SUFFIX(const T *x, const T *v, const T *xn, STEP_ARGS, const float *g,   \
                              int64_t g_stride, T *gx, T *gv, T *gn, int64_t rows, int64_t n) { \
    const step_t st = STEP_INIT;                                                               \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        double c[5];                                                                           \
        step_coefficients(&st, row, n, c);                                                     \
        const double scale = 2.0 * c[ALPHA] * (double)g[row * g_stride];                       \
        const float ar = (float)c[A], br = (float)c[B];                                        \
        const float sx = (float)(-c[A] * scale), sv = (float)(-c[B] * scale);                  \
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
/* out[i,k] = a[i] x[i,k] + b[i] v[i,k] + n[i] eps[i,k] */                                 \
void sde_sample_##SUFFIX(const T *x, const T *v, const T *eps, STEP_ARGS, T *out,             \
                         int64_t rows, int64_t n) {                                            \
    const step_t st = STEP_INIT;                                                               \
    int64_t blocks = (n + BLOCK - 1) / BLOCK;                                                  \
    _Pragma("omp parallel for schedule(static) if (rows * n >= PARALLEL_MIN)")                 \
    for (int64_t task = 0; task < rows * blocks; task++) {                                     \
        int64_t row = task / blocks, start = (task % blocks) * BLOCK;                          \
        int64_t stop = start + BLOCK < n ? start + BLOCK : n;                                  \
        double c[5];                                                                           \
        step_coefficients(&st, row, n, c);                                                     \
        const float ar = (float)c[A], br = (float)c[B], sr = (float)c[N];                      \
        for (int64_t k = row * n + start; k < row * n + stop; k++)                             \
            store_##SUFFIX(out, k, ar * load_##SUFFIX(x, k) + br * load_##SUFFIX(v, k)         \
                                   + sr * load_##SUFFIX(eps, k));                              \
    }                                                                                          \
}

DEFINE_KERNELS(float, f32)
DEFINE_KERNELS(uint16_t, bf16)
