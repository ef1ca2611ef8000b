/* Fused LoRA shrink + expand for short segments on CPU (loraplex.lora.cpu_ops).
 *
 * Semantics: for each module m (tables a[m], bt[m], output columns cols[m].. of out, all
 * reading the same x), each segment (ts, te, rs, re) and each token t in [ts, te):
 *
 *     y[k]                       = sum_i x[t, i] * a[m][rs + k, i]     k < re - rs  (float32)
 *     out[t, cols[m] + j]       += sum_k y[k] * bt[m][rs + k, j]       (added in float32,
 *                                                                       rounded once)
 *
 * One call per group of modules sharing an input (q/k/v of a layer) and step replaces a dozen
 * small torch ops per module, each with its own dispatch and thread-team cost; the tables are
 * read in place, in their own dtype, and x is widened once per token for every module. Plain C,
 * no torch headers: built at first use with the system compiler, with -fopenmp binding to the
 * libgomp torch already loaded (one thread team for both). Element types: 0 = float32,
 * 1 = bfloat16 (bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even, as torch does).
 * The caller checks shapes, strides and bounds.
 */
#include "kernels.h"

/* Loads of one table element as float32: the kernels below are written once over these. */
static inline float load_f32(const void *p, int64_t i) { return ((const float *)p)[i]; }
static inline float load_bf16(const void *p, int64_t i) {
    return bf16_to_f32(((const uint16_t *)p)[i]);
}

/* y[k] = sum_i x[i] * w[k, i] for k < r, four rows at a time over LANES partial sums each (a
 * fixed summation order, vectorisable without fast-math); w rows are n elements apart. */
#define DEFINE_SHRINK(NAME, LOAD)                                                              \
    static void NAME(const float *x, const void *w, int64_t r, int64_t n, float *y) {         \
        int64_t k = 0;                                                                         \
        for (; k + 4 <= r; k += 4) {                                                           \
            float s0[LANES] = {0}, s1[LANES] = {0}, s2[LANES] = {0}, s3[LANES] = {0};          \
            const int64_t o0 = k * n, o1 = o0 + n, o2 = o1 + n, o3 = o2 + n;                   \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= n; i += LANES)                                                 \
                for (int l = 0; l < LANES; l++) {                                              \
                    const float xv = x[i + l];                                                 \
                    s0[l] += xv * LOAD(w, o0 + i + l);                                         \
                    s1[l] += xv * LOAD(w, o1 + i + l);                                         \
                    s2[l] += xv * LOAD(w, o2 + i + l);                                         \
                    s3[l] += xv * LOAD(w, o3 + i + l);                                         \
                }                                                                              \
            float t0 = 0, t1 = 0, t2 = 0, t3 = 0;                                              \
            for (int l = 0; l < LANES; l++) t0 += s0[l], t1 += s1[l], t2 += s2[l], t3 += s3[l]; \
            for (; i < n; i++) {                                                               \
                t0 += x[i] * LOAD(w, o0 + i);                                                  \
                t1 += x[i] * LOAD(w, o1 + i);                                                  \
                t2 += x[i] * LOAD(w, o2 + i);                                                  \
                t3 += x[i] * LOAD(w, o3 + i);                                                  \
            }                                                                                  \
            y[k] = t0, y[k + 1] = t1, y[k + 2] = t2, y[k + 3] = t3;                            \
        }                                                                                      \
        for (; k < r; k++) {                                                                   \
            float s[LANES] = {0};                                                              \
            const int64_t o = k * n;                                                           \
            int64_t i = 0;                                                                     \
            for (; i + LANES <= n; i += LANES)                                                 \
                for (int l = 0; l < LANES; l++) s[l] += x[i + l] * LOAD(w, o + i + l);         \
            float t = 0;                                                                       \
            for (int l = 0; l < LANES; l++) t += s[l];                                         \
            for (; i < n; i++) t += x[i] * LOAD(w, o + i);                                     \
            y[k] = t;                                                                          \
        }                                                                                      \
    }

/* out[j0 + l] += v[l] for l < m, rounded once into out's type. */
static inline void add_block(const float *v, int64_t m, void *out, int64_t j0, int type) {
    if (type == 0) {
        float *o = (float *)out + j0;
        for (int64_t l = 0; l < m; l++) o[l] += v[l];
    } else {
        uint16_t *o = (uint16_t *)out + j0;
        for (int64_t l = 0; l < m; l++) o[l] = f32_to_bf16(bf16_to_f32(o[l]) + v[l]);
    }
}

/* out[j] += sum_k y[k] * w[k, j] for j < n (w rows n elements apart), LANES columns at a time
 * held in registers across all r rows, then added into out's row and rounded once. */
#define DEFINE_EXPAND(NAME, LOAD)                                                              \
    static void NAME(const float *y, const void *w, int64_t r, int64_t n, void *out,           \
                     int out_type) {                                                           \
        int64_t j = 0;                                                                         \
        for (; j + LANES <= n; j += LANES) {                                                   \
            float v[LANES] = {0};                                                              \
            for (int64_t k = 0; k < r; k++) {                                                  \
                const float c = y[k];                                                          \
                const int64_t o = k * n + j;                                                   \
                for (int l = 0; l < LANES; l++) v[l] += c * LOAD(w, o + l);                    \
            }                                                                                  \
            add_block(v, LANES, out, j, out_type);                                             \
        }                                                                                      \
        if (j < n) {                                                                           \
            float v[LANES] = {0};                                                              \
            for (int64_t k = 0; k < r; k++)                                                    \
                for (int64_t l = 0; l < n - j; l++) v[l] += y[k] * LOAD(w, k * n + j + l);     \
            add_block(v, n - j, out, j, out_type);                                             \
        }                                                                                      \
    }

DEFINE_SHRINK(shrink_f32, load_f32)
DEFINE_SHRINK(shrink_bf16, load_bf16)
DEFINE_EXPAND(expand_f32, load_f32)
DEFINE_EXPAND(expand_bf16, load_bf16)

#if HAVE_DPBF16
/* shrink for bf16 x and bf16 rows with AVX512-BF16 dot products (pairs of exact bf16 products
 * accumulated in float32): 32 elements per instruction, no widening of either operand. */
static void shrink_bf16_dp(const uint16_t *x, const uint16_t *w, int64_t r, int64_t n,
                           float *y) {
    const int64_t full = n / 32 * 32;
    const __mmask32 tail = (__mmask32)((1ull << (n - full)) - 1);
    int64_t k = 0;
    for (; k + 4 <= r; k += 4) {
        const uint16_t *w0 = w + k * n, *w1 = w0 + n, *w2 = w1 + n, *w3 = w2 + n;
        __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
        for (int64_t i = 0; i < full; i += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + i);
            s0 = _mm512_dpbf16_ps(s0, xv, (__m512bh)_mm512_loadu_si512(w0 + i));
            s1 = _mm512_dpbf16_ps(s1, xv, (__m512bh)_mm512_loadu_si512(w1 + i));
            s2 = _mm512_dpbf16_ps(s2, xv, (__m512bh)_mm512_loadu_si512(w2 + i));
            s3 = _mm512_dpbf16_ps(s3, xv, (__m512bh)_mm512_loadu_si512(w3 + i));
        }
        if (tail) {
            const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full);
            s0 = _mm512_dpbf16_ps(s0, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w0 + full));
            s1 = _mm512_dpbf16_ps(s1, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w1 + full));
            s2 = _mm512_dpbf16_ps(s2, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w2 + full));
            s3 = _mm512_dpbf16_ps(s3, xv, (__m512bh)_mm512_maskz_loadu_epi16(tail, w3 + full));
        }
        y[k] = _mm512_reduce_add_ps(s0);
        y[k + 1] = _mm512_reduce_add_ps(s1);
        y[k + 2] = _mm512_reduce_add_ps(s2);
        y[k + 3] = _mm512_reduce_add_ps(s3);
    }
    for (; k < r; k++) {
        const uint16_t *wk = w + k * n;
        __m512 s = _mm512_setzero_ps();
        for (int64_t i = 0; i < full; i += 32)
            s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_loadu_si512(x + i),
                                 (__m512bh)_mm512_loadu_si512(wk + i));
        if (tail)
            s = _mm512_dpbf16_ps(s, (__m512bh)_mm512_maskz_loadu_epi16(tail, x + full),
                                 (__m512bh)_mm512_maskz_loadu_epi16(tail, wk + full));
        y[k] = _mm512_reduce_add_ps(s);
    }
}
#endif

/* Segments ahead whose rows are requested early (in the engine 1 beat 0, 2, 4 and 8). */
#define PREFETCH_AHEAD 1

/* Ask for a table block now: the rows of consecutive segments lie anywhere in the tables and
 * each is a few KiB, so asking for all of them at once keeps many reads in flight where the
 * hardware prefetcher would find each row's stream one by one. */
static inline void prefetch_block(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

typedef struct {
    const char *x;
    int64_t x_stride, d_in, n_mod, out_stride, nseg;
    int x_type, w_type, out_type;
    const void *const *a, *const *bt;
    char *out;
    const int64_t *cols, *d_out, *segs;
    const float *weights; /* per segment, or NULL: all 1 */
} Job;

/* The job's tokens with global index in [g0, g1) (counted over the segments in order). */
static int run_range(const Job *j, int64_t g0, int64_t g1, int64_t max_rows) {
    const size_t xs = j->x_type ? 2 : 4, ws = j->w_type ? 2 : 4, os = j->out_type ? 2 : 4;
    float *xf = (float *)malloc((size_t)(j->d_in + max_rows) * sizeof(float));
    if (xf == NULL) return 1;
    float *y = xf + j->d_in;
    const int dp = HAVE_DPBF16 && j->x_type == 1 && j->w_type == 1; /* bf16 x bf16 shrink */
    int64_t g = 0;
    for (int64_t s = 0; s < j->nseg && g < g1; s++) {
        const int64_t *seg = j->segs + 4 * s;
        const int64_t ts = seg[0], te = seg[1], rs = seg[2], r = seg[3] - seg[2];
        const float w = j->weights ? j->weights[s] : 1.0f;
        if (g + (te - ts) <= g0) {
            g += te - ts;
            continue;
        }
        /* this segment's rows (at the range's first) and the next ones', for every module */
        for (int64_t n = g <= g0 ? 0 : PREFETCH_AHEAD; n <= PREFETCH_AHEAD && s + n < j->nseg; n++) {
            const int64_t *nx = seg + 4 * n;
            const size_t rows = (size_t)(nx[3] - nx[2]);
            for (int64_t m = 0; m < j->n_mod; m++) {
                const size_t d_out = (size_t)j->d_out[m];
                prefetch_block((const char *)j->a[m] + (size_t)nx[2] * j->d_in * ws,
                               rows * (size_t)j->d_in * ws);
                prefetch_block((const char *)j->bt[m] + (size_t)nx[2] * d_out * ws,
                               rows * d_out * ws);
            }
        }
        for (int64_t t = ts; t < te; t++, g++) {
            if (g < g0) continue;
            if (g >= g1) break;
            const char *xt = j->x + (size_t)(t * j->x_stride) * xs;
            if (!dp) row_to_f32(xt, j->x_type, j->d_in, xf);
            for (int64_t m = 0; m < j->n_mod; m++) {
                const int64_t d_out = j->d_out[m];
                const char *a_seg = (const char *)j->a[m] + (size_t)(rs * j->d_in) * ws;
                const char *b_seg = (const char *)j->bt[m] + (size_t)(rs * d_out) * ws;
                char *o = j->out + (size_t)(t * j->out_stride + j->cols[m]) * os;
                if (j->w_type) {
#if HAVE_DPBF16
                    if (dp)
                        shrink_bf16_dp((const uint16_t *)xt, (const uint16_t *)a_seg, r,
                                       j->d_in, y);
                    else
#endif
                        shrink_bf16(xf, a_seg, r, j->d_in, y);
                    if (w != 1.0f)
                        for (int64_t k = 0; k < r; k++) y[k] *= w;
                    expand_bf16(y, b_seg, r, d_out, o, j->out_type);
                } else {
                    shrink_f32(xf, a_seg, r, j->d_in, y);
                    if (w != 1.0f)
                        for (int64_t k = 0; k < r; k++) y[k] *= w;
                    expand_f32(y, b_seg, r, d_out, o, j->out_type);
                }
            }
        }
    }
    free(xf);
    return 0;
}

/* What this build was compiled for (loraplex.lora.cpu_ops.FEATURE_BITS): 1 AVX2, 2 FMA, 4 F16C,
 * 8 AVX-512F, 16 the AVX512-BF16 shrink. The tests check that a build for an instruction set
 * uses it and nothing above it. */
int loraplex_lora_features(void) {
    int bits = 0;
#ifdef __AVX2__
    bits |= 1;
#endif
#ifdef __FMA__
    bits |= 2;
#endif
#ifdef __F16C__
    bits |= 4;
#endif
#ifdef __AVX512F__
    bits |= 8;
#endif
    if (HAVE_DPBF16) bits |= 16;
    return bits;
}

#define PARALLEL_MIN_MACS 65536 /* below this one thread wins: waking a second costs more */

/* x: [T, d_in] rows x_stride elements apart; out: [T, *] rows out_stride elements apart; for
 * each of n_mod modules: a[m] [rows, d_in] and bt[m] [rows, d_out[m]], contiguous, adding into
 * out's columns [cols[m], cols[m] + d_out[m]); segs: nseg x (ts, te, rs, re), disjoint in
 * tokens (threads split the tokens); weights: nseg floats each segment's delta is multiplied
 * by (a composed request's scale), or NULL for all 1. Bounds are checked by the caller. Up to nthreads OpenMP threads split the tokens. Returns 0, or 1 if a
 * scratch row cannot be allocated (then some rows may be unwritten). */
int loraplex_lora_apply(const void *x, int64_t x_stride, int x_type, int64_t d_in,
                        int64_t n_mod, const void *const *a, const void *const *bt, int w_type,
                        void *out, const int64_t *cols, const int64_t *d_out, int64_t out_stride,
                        int out_type, const int64_t *segs, int64_t nseg, const float *weights,
                        int nthreads) {
    Job job = {(const char *)x, x_stride, d_in, n_mod, out_stride, nseg, x_type, w_type,
               out_type, a, bt, (char *)out, cols, d_out, segs, weights};
    int64_t tokens = 0, max_rows = 0, macs = 0, width = d_in * n_mod;
    for (int64_t m = 0; m < n_mod; m++) width += d_out[m];
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t n = segs[4 * s + 1] - segs[4 * s], r = segs[4 * s + 3] - segs[4 * s + 2];
        tokens += n;
        macs += n * r * width;
        if (r > max_rows) max_rows = r;
    }
    int64_t workers = nthreads > 1 && macs >= PARALLEL_MIN_MACS ? nthreads : 1;
    if (workers > tokens) workers = tokens;
    if (workers <= 1) return run_range(&job, 0, tokens, max_rows);
    int failed = 0;
#ifdef _OPENMP
#pragma omp parallel for num_threads(workers) schedule(static, 1) reduction(| : failed)
#endif
    for (int64_t w = 0; w < workers; w++)
        failed |= run_range(&job, tokens * w / workers, tokens * (w + 1) / workers, max_rows);
    return failed;
}
