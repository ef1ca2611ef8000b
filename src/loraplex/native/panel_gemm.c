/* Dense GEMM for CPU over weights packed in column panels (loraplex.model.panel_gemm).
 *
 * Semantics, for t < T and n < N:
 *
 *     y[t, n] = rnd(bias[n] + sum_k x[t, k] * W[n, k])       (float32 sums; bias NULL: 0)
 *
 * rounded once to y's element type (0 float32, 1 bfloat16); x and W are of the same type.
 *
 * Layout: W is packed once (loraplex_panel_pack) into panels of NR = 2 * VW output columns
 * (panel.h; VW: the vector width in floats, 16 with AVX-512 and 8 with AVX2): float32 weights as
 * P[panel][k][NR] and bfloat16 weights as P[panel][k / 2][NR][2] (a pair of consecutive k per
 * column, the operand layout of AVX512-BF16's dot product), zero past N (and past K for an odd
 * K in bf16). A block of up to MR rows of x times one panel keeps its 2 * MR accumulators in
 * registers for all of K: each step loads two vectors of the panel and broadcasts one value
 * (float32) or pair (bf16) of each row, so the weights stream from cache once per block of
 * rows with no horizontal sums. Panels are split over the threads.
 *
 * The weight-stationary blocking oneDNN uses for small batches reloads its accumulators; at
 * decode sizes (a few to a few dozen rows) this is what keeps a thin model's step compute
 * bound instead of load bound (docs/benchmarks.md, "The rest of the step").
 *
 * Plain C with AVX-512 / AVX2 intrinsics (a build with neither computes nothing); the caller
 * checks shapes, strides and dtypes and that this build computes its dtype
 * (loraplex_panel_features).
 */
#include "panel.h"

/* rows of x per block: the block's 2 * MR accumulators stay in registers */
#if defined(__AVX512F__)
#define MR 8
#elif HAVE_VEC
#define MR 6
#else
#define MR 4
#endif

/* bit 0: float32 computed with vectors; bit 1: bfloat16 (AVX512-BF16 dot products); the
 * vector width in floats from bit 8. (The quantized panels, and their W4A8 bit, are
 * quant_gemm.c's: loraplex_qgemm_features.) */
int loraplex_panel_features(void) {
    int bits = 0;
#if HAVE_VEC
    bits |= 1;
#endif
#if HAVE_DPBF16
    bits |= 2;
#endif
    return bits | (VW << 8);
}

int loraplex_panel_width(void) { return NR; }

/* Bytes of the packed layout of an [N, K] weight of element type e. */
int64_t loraplex_panel_bytes(int64_t N, int64_t K, int e) {
    int64_t panels = (N + NR - 1) / NR;
    return e == F32 ? panels * K * NR * 4 : panels * ((K + 1) / 2) * NR * 2 * 2;
}

/* P = W [N, K] (row stride ldw) in the panel layout described above. */
void loraplex_panel_pack(const void *w, int64_t ldw, int64_t N, int64_t K, int e, void *p) {
    int64_t panels = (N + NR - 1) / NR;
    if (e == F32) {
        const float *src = (const float *)w;
        float *dst = (float *)p;
        for (int64_t pi = 0; pi < panels; pi++)
            for (int64_t k = 0; k < K; k++)
                for (int64_t c = 0; c < NR; c++) {
                    int64_t n = pi * NR + c;
                    dst[(pi * K + k) * NR + c] = n < N ? src[n * ldw + k] : 0.0f;
                }
    } else {
        const uint16_t *src = (const uint16_t *)w;
        uint16_t *dst = (uint16_t *)p;
        int64_t K2 = (K + 1) / 2;
        for (int64_t pi = 0; pi < panels; pi++)
            for (int64_t kk = 0; kk < K2; kk++)
                for (int64_t c = 0; c < NR; c++)
                    for (int64_t h = 0; h < 2; h++) {
                        int64_t n = pi * NR + c, k = 2 * kk + h;
                        dst[((pi * K2 + kk) * NR + c) * 2 + h] =
                            n < N && k < K ? src[n * ldw + k] : 0;
                    }
    }
}

#if HAVE_VEC
/* Rows t0 .. t0 + mr (mr <= MR) of x times panel pi, float32. */
static inline void block_f32(const float *x, int64_t ldx, int64_t t0, int mr, const float *pp,
                             int64_t K, float *out /* [MR][NR] */) {
    vec a[MR][2];
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = VZERO();
    const float *xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + (t0 + (r < mr ? r : 0)) * ldx;
    for (int64_t k = 0; k < K; k++) {
        vec w0 = VLOAD(pp + k * NR), w1 = VLOAD(pp + k * NR + VW);
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                vec b = VSET1(xr[r][k]);
                a[r][0] = VFMA(b, w0, a[r][0]);
                a[r][1] = VFMA(b, w1, a[r][1]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        VSTORE(out + r * NR, a[r][0]);
        VSTORE(out + r * NR + VW, a[r][1]);
    }
}
#endif

#if HAVE_DPBF16
/* Rows t0 .. t0 + mr of bf16 x times bf16 panel pi (pairs of k per AVX512-BF16 dot). */
static inline void block_bf16(const uint16_t *x, int64_t ldx, int64_t t0, int mr,
                              const uint16_t *pp, int64_t K, float *out) {
    __m512 a[MR][2];
    for (int r = 0; r < MR; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    const uint16_t *xr[MR];
    for (int r = 0; r < MR; r++) xr[r] = x + (t0 + (r < mr ? r : 0)) * ldx;
    int64_t K2 = K / 2;
    for (int64_t kk = 0; kk < K2; kk++) {
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(pp + kk * 2 * NR));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(pp + kk * 2 * NR + NR));
#pragma GCC unroll 8
        for (int r = 0; r < MR; r++) {
            if (r < mr) {
                int32_t pair;
                memcpy(&pair, xr[r] + 2 * kk, sizeof pair);
                __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
                a[r][0] = _mm512_dpbf16_ps(a[r][0], b, w0);
                a[r][1] = _mm512_dpbf16_ps(a[r][1], b, w1);
            }
        }
    }
    if (K & 1) { /* the last k pairs with the packed zero */
        __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void *)(pp + K2 * 2 * NR));
        __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void *)(pp + K2 * 2 * NR + NR));
        for (int r = 0; r < mr; r++) {
            int32_t pair = (int32_t)xr[r][K - 1];
            __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
            a[r][0] = _mm512_dpbf16_ps(a[r][0], b, w0);
            a[r][1] = _mm512_dpbf16_ps(a[r][1], b, w1);
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out + r * NR, a[r][0]);
        _mm512_storeu_ps(out + r * NR + 16, a[r][1]);
    }
}
#endif

/* y [T, N] (row stride ldy) = x [T, K] (row stride ldx) @ W.T + bias, W packed in p; -1 if
 * this build does not compute element type e (loraplex_panel_features). */
int loraplex_panel_gemm(const void *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                        int64_t N, const float *bias, void *y, int64_t ldy, int e, int threads) {
    if (!(loraplex_panel_features() & (e == F32 ? 1 : 2))) return -1;
    int64_t panels = (N + NR - 1) / NR;
    int64_t pstride = e == F32 ? K * NR : ((K + 1) / 2) * NR * 2; /* elements per panel */
    (void)pstride; /* unused in a build without vectors */
#pragma omp parallel for num_threads(threads) if (threads > 1 && panels > 1) schedule(static)
    for (int64_t pi = 0; pi < panels; pi++) {
        float out[MR * NR];
        for (int64_t t0 = 0; t0 < T; t0 += MR) {
            int mr = T - t0 < MR ? (int)(T - t0) : MR;
#if HAVE_VEC
            if (e == F32)
                block_f32((const float *)x, ldx, t0, mr, (const float *)p + pi * pstride, K, out);
#endif
#if HAVE_DPBF16
            if (e == BF16)
                block_bf16((const uint16_t *)x, ldx, t0, mr, (const uint16_t *)p + pi * pstride,
                           K, out);
#endif
            for (int r = 0; r < mr; r++)
                store_row(out + r * NR, bias, pi * NR, N, y, ldy, t0 + r, e);
        }
    }
    return 0;
}
