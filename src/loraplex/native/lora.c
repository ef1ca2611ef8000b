/* Fused LoRA shrink + expand for short segments on CPU (loraplex.lora.cpu_ops).
 *
 * Semantics: for each module m (tables a[m], bt[m], output columns cols[m].. of out, all
 * reading the same x), each segment (ts, te, rs, re) with weight w and each token t in
 * [ts, te):
 *
 *     y[k]                       = w * sum_i x[t, i] * a[m][rs + k, i]     k < re - rs  (float32)
 *     out[t, cols[m] + j]       += sum_k y[k] * bt[m][rs + k, j]
 *
 * where a token in several segments (a composed request's adapters: every layer of a plan
 * comes in one call) sums its segments' deltas in float32 and out is rounded once per token.
 *
 * One call per group of modules sharing an input (q/k/v of a layer) and step replaces a dozen
 * small torch ops per module, each with its own dispatch and thread-team cost; the tables are
 * read in place, in their own dtype. Threads own tokens (no two add into one row); within a
 * thread, each adapter's A rows are read once for all of its tokens there (the shrinks of one
 * adapter run together), and a token's B rows stream once per token, a composed step's second
 * read of an adapter coming from this core's cache (its neighbour token read it just before).
 * Plain C, no torch headers: built at first use with the system compiler, with -fopenmp
 * binding to the libgomp torch already loaded (one thread team for both). Element types:
 * 0 = float32, 1 = bfloat16 (bf16 -> f32 is exact; f32 -> bf16 rounds to nearest even, as
 * torch does). The caller checks shapes, strides and bounds.
 */
#include "kernels.h"

#define MAX_TOKEN_SEGS 16 /* segments one token may lie in (a composition's adapters) */
#define EXPAND_BLOCK 64 /* output columns summed in registers at once */
#define CHUNK 8           /* pairs of one adapter shrunk against one block of four A rows */

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

/* out[j] += sum_q sum_k y[q][k] * w[q][k, j] for j < n: the nq segments of one token (a
 * composed request's adapters, r[q] rows each) summed in float32 per block of LANES columns
 * and added into out's row once. */
#define DEFINE_EXPAND_MULTI(NAME, LOAD)                                                        \
    static void NAME(const float *const *y, const void *const *w, const int64_t *r, int nq,   \
                     int64_t n, void *out, int out_type) {                                     \
        int64_t j = 0;                                                                         \
        for (; j + EXPAND_BLOCK <= n; j += EXPAND_BLOCK) {                                     \
            float v[EXPAND_BLOCK] = {0};                                                       \
            for (int q = 0; q < nq; q++)                                                       \
                for (int64_t k = 0; k < r[q]; k++) {                                           \
                    const float c = y[q][k];                                                   \
                    const int64_t o = k * n + j;                                               \
                    for (int l = 0; l < EXPAND_BLOCK; l++) v[l] += c * LOAD(w[q], o + l);      \
                }                                                                              \
            add_block(v, EXPAND_BLOCK, out, j, out_type);                                      \
        }                                                                                      \
        for (; j < n; j += LANES) {                                                            \
            const int64_t m = n - j < LANES ? n - j : LANES;                                   \
            float v[LANES] = {0};                                                              \
            for (int q = 0; q < nq; q++)                                                       \
                for (int64_t k = 0; k < r[q]; k++)                                             \
                    for (int64_t l = 0; l < m; l++) v[l] += y[q][k] * LOAD(w[q], k * n + j + l); \
            add_block(v, m, out, j, out_type);                                                 \
        }                                                                                      \
    }

DEFINE_SHRINK(shrink_f32, load_f32)
DEFINE_SHRINK(shrink_bf16, load_bf16)
DEFINE_EXPAND_MULTI(expand_multi_f32, load_f32)
DEFINE_EXPAND_MULTI(expand_multi_bf16, load_bf16)

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

/* Ask for a table block now: the rows of consecutive tokens' adapters lie anywhere in the
 * tables and each is a few KiB, so asking for all of them at once keeps many reads in flight
 * where the hardware prefetcher would find each row's stream one by one. */
static inline void prefetch_block(const char *p, size_t bytes) {
    for (size_t off = 0; off < bytes; off += 64) __builtin_prefetch(p + off, 0, 3);
}

/* One call's work: the tokens in some segment, each with its segments (token-major). */
typedef struct {
    const char *x;
    int64_t x_stride, d_in, n_mod, out_stride, max_rows;
    int x_type, w_type, out_type;
    const void *const *a, *const *bt;
    char *out;
    const int64_t *cols, *d_out, *segs;
    const float *weights; /* per segment, or NULL: all 1 */
    int64_t ntok;
    int64_t *tok;         /* the tokens in some segment, ascending */
    int64_t *tok_at;      /* ntok + 1 bounds into tok_seg */
    int64_t *tok_seg;     /* each token's segments, in the caller's order (layer 0 first):
                             a pair (token, segment) is known by its slot q here */
    int64_t *pair_tok;    /* per pair slot, its token */
    int64_t npairs;
    float *y;             /* [n_mod][npairs][max_rows]: each pair's weighted activations */
} Job;

/* Ask for the B rows of token e's segments, for every module. */
static void prefetch_token_b(const Job *j, int64_t e, size_t ws) {
    for (int64_t q = j->tok_at[e]; q < j->tok_at[e + 1]; q++) {
        const int64_t *seg = j->segs + 4 * j->tok_seg[q];
        const size_t rows = (size_t)(seg[3] - seg[2]);
        for (int64_t m = 0; m < j->n_mod; m++) {
            const size_t d_out = (size_t)j->d_out[m];
            prefetch_block((const char *)j->bt[m] + (size_t)seg[2] * d_out * ws,
                           rows * d_out * ws);
        }
    }
}

static int cmp_i64(const void *p, const void *q) {
    const int64_t a = *(const int64_t *)p, b = *(const int64_t *)q;
    return (a > b) - (a < b);
}

/* Shrink for the pairs key[0..n) of this thread (key = rs << 32 | q, sorted: q is the pair's
 * slot in tok_seg, rs its rows' start): y[m][q] = w * x[t] @ A[m][rs:re].T, adapter by
 * adapter, a block of four A rows serving up to CHUNK of the adapter's pairs from L1. */
static void shrink_pairs(const Job *j, const int64_t *key, int64_t n, float *xf) {
    const size_t xs = j->x_type ? 2 : 4, ws = j->w_type ? 2 : 4;
    const int dp = HAVE_DPBF16 && j->x_type == BF16 && j->w_type == BF16;
    const int convert = !dp && j->x_type != F32;
    for (int64_t i = 0; i < n;) {
        const int64_t rs = key[i] >> 32;
        const int64_t *seg = j->segs + 4 * j->tok_seg[key[i] & 0xffffffff];
        const int64_t r = seg[3] - seg[2];
        int64_t g1 = i + 1; /* the adapter's pairs: [i, g1), the same rows */
        while (g1 < n && key[g1] >> 32 == rs &&
               j->segs[4 * j->tok_seg[key[g1] & 0xffffffff] + 3] == seg[3])
            g1++;
        if (g1 < n) { /* the next adapter's A rows, for every module */
            const int64_t *nx = j->segs + 4 * j->tok_seg[key[g1] & 0xffffffff];
            for (int64_t m = 0; m < j->n_mod; m++)
                prefetch_block((const char *)j->a[m] + (size_t)(nx[2] * j->d_in) * ws,
                               (size_t)((nx[3] - nx[2]) * j->d_in) * ws);
        }
        for (int64_t c0 = i; c0 < g1; c0 += CHUNK) {
            const int nc = (int)(g1 - c0 < CHUNK ? g1 - c0 : CHUNK);
            const void *xp[CHUNK];
            int64_t q[CHUNK];
            float w[CHUNK];
            for (int c = 0; c < nc; c++) {
                q[c] = key[c0 + c] & 0xffffffff;
                const int64_t s = j->tok_seg[q[c]];
                const char *xt = j->x + (size_t)(j->pair_tok[q[c]] * j->x_stride) * xs;
                w[c] = j->weights ? j->weights[s] : 1.0f;
                if (convert) {
                    row_to_f32(xt, j->x_type, j->d_in, xf + c * j->d_in);
                    xp[c] = xf + c * j->d_in;
                } else {
                    xp[c] = xt;
                }
            }
            for (int64_t m = 0; m < j->n_mod; m++) {
                const char *a_seg = (const char *)j->a[m] + (size_t)(rs * j->d_in) * ws;
                float *ym = j->y + (size_t)(m * j->npairs) * j->max_rows;
                for (int64_t k = 0; k < r; k += 4) {
                    const int64_t nk = r - k < 4 ? r - k : 4;
                    const char *ak = a_seg + (size_t)(k * j->d_in) * ws;
                    for (int c = 0; c < nc; c++) {
                        float *yc = ym + q[c] * j->max_rows + k;
#if HAVE_DPBF16
                        if (dp)
                            shrink_bf16_dp((const uint16_t *)xp[c], (const uint16_t *)ak, nk,
                                           j->d_in, yc);
                        else
#endif
                            if (j->w_type)
                            shrink_bf16((const float *)xp[c], ak, nk, j->d_in, yc);
                        else
                            shrink_f32((const float *)xp[c], ak, nk, j->d_in, yc);
                    }
                }
                for (int c = 0; c < nc; c++)
                    if (w[c] != 1.0f)
                        for (int64_t k = 0; k < r; k++) ym[q[c] * j->max_rows + k] *= w[c];
            }
        }
        i = g1;
    }
}

/* Tokens tok[e0..e1), all this thread's (so no two threads add into one element): first every
 * pair's y, adapter by adapter (each adapter's A rows read once for all these tokens), then
 * token by token the sum of its segments' y @ B, added into out's row once per module (a
 * composed step's adapter serves two neighbouring tokens, whose second read of B comes from
 * this core's cache). scratch: (CHUNK * d_in floats, then the pairs' keys as int64). */
static void run_tokens(const Job *j, int64_t e0, int64_t e1, float *xf, int64_t *key) {
    const size_t ws = j->w_type ? 2 : 4, os = j->out_type ? 2 : 4;
    const int64_t q0 = j->tok_at[e0], n = j->tok_at[e1] - q0;
    key += q0; /* this thread's part of the keys */
    for (int64_t i = 0; i < n; i++)
        key[i] = (j->segs[4 * j->tok_seg[q0 + i] + 2] << 32) | (q0 + i);
    qsort(key, (size_t)n, sizeof(int64_t), cmp_i64);
    if (e0 < e1) prefetch_token_b(j, e0, ws); /* arriving while the shrinks read A */
    shrink_pairs(j, key, n, xf);
    const float *yq[MAX_TOKEN_SEGS];
    const void *bq[MAX_TOKEN_SEGS];
    int64_t rq[MAX_TOKEN_SEGS];
    for (int64_t e = e0; e < e1; e++) {
        if (e + 1 < e1) prefetch_token_b(j, e + 1, ws);
        const int64_t t = j->tok[e];
        for (int64_t m = 0; m < j->n_mod; m++) {
            const int64_t d_out = j->d_out[m];
            const float *ym = j->y + (size_t)(m * j->npairs) * j->max_rows;
            char *o = j->out + (size_t)(t * j->out_stride + j->cols[m]) * os;
            int nq = 0;
            for (int64_t q = j->tok_at[e]; q < j->tok_at[e + 1]; q++, nq++) {
                const int64_t *seg = j->segs + 4 * j->tok_seg[q];
                yq[nq] = ym + q * j->max_rows;
                bq[nq] = (const char *)j->bt[m] + (size_t)(seg[2] * d_out) * ws;
                rq[nq] = seg[3] - seg[2];
            }
            if (j->w_type)
                expand_multi_bf16(yq, bq, rq, nq, d_out, o, j->out_type);
            else
                expand_multi_f32(yq, bq, rq, nq, d_out, o, j->out_type);
        }
    }
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
 * out's columns [cols[m], cols[m] + d_out[m]); segs: nseg x (ts, te, rs, re); segments may
 * overlap in tokens (every layer of a plan in one call: a composed request's adapters), up to
 * MAX_TOKEN_SEGS on one token; weights: nseg floats each segment's delta is multiplied by (a
 * composed request's scale), or NULL for all 1. Each token's deltas of a module (its segments
 * in their order) are summed in float32 and rounded into out once. Bounds are checked by the
 * caller. Up to nthreads OpenMP threads split the tokens. Returns 0; 1 if the scratch cannot
 * be allocated (nothing written); 2 if a token lies in more than MAX_TOKEN_SEGS segments. */
int loraplex_lora_apply(const void *x, int64_t x_stride, int x_type, int64_t d_in,
                        int64_t n_mod, const void *const *a, const void *const *bt, int w_type,
                        void *out, const int64_t *cols, const int64_t *d_out, int64_t out_stride,
                        int out_type, const int64_t *segs, int64_t nseg, const float *weights,
                        int nthreads) {
    int64_t npairs = 0, max_rows = 0, macs = 0, width = d_in * n_mod, t_end = 0;
    for (int64_t m = 0; m < n_mod; m++) width += d_out[m];
    for (int64_t s = 0; s < nseg; s++) {
        const int64_t n = segs[4 * s + 1] - segs[4 * s], r = segs[4 * s + 3] - segs[4 * s + 2];
        npairs += n;
        macs += n * r * width;
        if (r > max_rows) max_rows = r;
        if (n > 0 && segs[4 * s + 1] > t_end) t_end = segs[4 * s + 1];
    }
    if (npairs == 0) return 0;
    int64_t workers = nthreads > 1 && macs >= PARALLEL_MIN_MACS ? nthreads : 1;
    /* one allocation: the token-major index (int64: tok [t_end], tok_at [t_end + 1], per token
     * its count then bounds, tok_seg and pair_tok [npairs], the pairs' sort keys [npairs]), y,
     * then each worker's CHUNK rows of x as float32 */
    const size_t idx = (size_t)(2 * t_end + 1 + 3 * npairs);
    const size_t ys = (size_t)(n_mod * npairs * max_rows), xfs = (size_t)(CHUNK * d_in);
    const size_t floats = ys + (size_t)workers * xfs;
    char *mem = (char *)malloc(idx * sizeof(int64_t) + floats * sizeof(float));
    if (mem == NULL) return 1;
    Job j = {(const char *)x, x_stride, d_in, n_mod, out_stride, max_rows, x_type, w_type,
             out_type, a, bt, (char *)out, cols, d_out, segs, weights, 0, NULL, NULL, NULL,
             NULL, npairs, NULL};
    j.tok = (int64_t *)mem;
    j.tok_at = j.tok + t_end;
    j.tok_seg = j.tok_at + t_end + 1;
    j.pair_tok = j.tok_seg + npairs;
    int64_t *keys = j.pair_tok + npairs;
    j.y = (float *)(keys + npairs);
    float *work = j.y + ys;
    int64_t *count = j.tok_at;
    memset(count, 0, (size_t)(t_end + 1) * sizeof(int64_t));
    for (int64_t s = 0; s < nseg; s++)
        for (int64_t t = segs[4 * s]; t < segs[4 * s + 1]; t++) count[t]++;
    for (int64_t t = 0; t < t_end; t++) { /* compact to the tokens with segments */
        if (count[t] > MAX_TOKEN_SEGS) {
            free(mem);
            return 2;
        }
        if (count[t]) j.tok[j.ntok] = t, count[j.ntok++] = count[t];
    }
    for (int64_t e = 0, at = 0; e <= j.ntok; e++) { /* counts -> each token's first slot */
        const int64_t c = e < j.ntok ? count[e] : 0;
        count[e] = at;
        at += c;
    }
    for (int64_t s = 0; s < nseg; s++) { /* in order: a token's segments stay in layer order */
        const int64_t ts = segs[4 * s], te = segs[4 * s + 1];
        if (ts == te) continue;
        int64_t lo = 0, hi = j.ntok; /* ts's index in tok */
        while (lo < hi) {
            const int64_t mid = (lo + hi) / 2;
            if (j.tok[mid] < ts) lo = mid + 1;
            else hi = mid;
        }
        for (int64_t e = lo; e < lo + (te - ts); e++) j.tok_seg[j.tok_at[e]++] = s;
    }
    for (int64_t e = j.ntok; e > 0; e--) j.tok_at[e] = j.tok_at[e - 1]; /* back to starts */
    j.tok_at[0] = 0;
    for (int64_t e = 0; e < j.ntok; e++)
        for (int64_t q = j.tok_at[e]; q < j.tok_at[e + 1]; q++) j.pair_tok[q] = j.tok[e];
    if (workers > j.ntok) workers = j.ntok;
    if (workers <= 1) {
        run_tokens(&j, 0, j.ntok, work, keys);
    } else {
#ifdef _OPENMP
#pragma omp parallel for num_threads(workers) schedule(static, 1)
#endif
        for (int64_t w = 0; w < workers; w++)
            run_tokens(&j, j.ntok * w / workers, j.ntok * (w + 1) / workers,
                       work + (size_t)w * xfs, keys);
    }
    free(mem);
    return 0;
}
