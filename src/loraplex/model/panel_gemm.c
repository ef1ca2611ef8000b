/* Dense GEMM for CPU over weights packed in column panels (loraplex.model.panel_gemm).
 *
 * Semantics, for t < T and n < N:
 *
 *     y[t, n] = rnd(bias[n] + sum_k x[t, k] * W[n, k])       (float32 sums; bias NULL: 0)
 *
 * rounded once to y's element type (0 float32, 1 bfloat16); x and W are of the same type.
 *
 * Layout: W is packed once (loraplex_panel_pack) into panels of NR = 2 * VW output columns
 * (VW: the vector width in floats, 16 with AVX-512 and 8 with AVX2): float32 weights as
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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

enum { F32 = 0, BF16 = 1 };

#if defined(__AVX512F__)
#include <immintrin.h>
#define VW 16
#define MR 8
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define VW 8
#define MR 6
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define HAVE_DPBF16 0
#else
#define VW 8
#define MR 4
#define HAVE_DPBF16 0
#endif
#define NR (2 * VW)

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* bit 0: float32 computed with vectors; bit 1: bfloat16 (AVX512-BF16 dot products); the
 * vector width in floats from bit 8. */
int loraplex_panel_features(void) {
    int bits = 0;
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

/* Store one row's NR sums of panel pi (columns n0 .. n0 + NR, the valid ones only). */
static inline void store_row(const float *acc, const float *bias, int64_t n0, int64_t N,
                             void *y, int64_t ldy, int64_t t, int e) {
    int64_t m = N - n0 < NR ? N - n0 : NR;
    for (int64_t c = 0; c < m; c++) {
        float v = acc[c] + (bias ? bias[n0 + c] : 0.0f);
        if (e == F32)
            ((float *)y)[t * ldy + n0 + c] = v;
        else
            ((uint16_t *)y)[t * ldy + n0 + c] = f32_to_bf16(v);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

/* ---------------------------------------------------------------- 4-bit weights, bf16 x
 *
 * Semantics (G groups of gs input columns, the last one possibly shorter; gs and K even):
 *
 *     W[n, k]  = scales[n, k / gs] * (q[n, k] - zeros[n, k / gs])     (zeros NULL: 0)
 *     y[t, n]  = rnd(bias[n] + sum_k x[t, k] * W[n, k])
 *
 * Layout (loraplex_panel_q4_pack, from the QuantWeight layout of qgemm.c): per panel of NR
 * columns and pair kk of input columns, NR bytes, byte c = q[n, 2 kk] | q[n, 2 kk + 1] << 4;
 * then per panel and group NR float32 scales, then per panel and group NR int8 zero points
 * (the bytes of QuantWeight's layout: half a byte a weight, five bytes a column and group). A byte becomes the
 * bf16 pair (128 + q_even, 128 + q_odd) by OR-ing its nibbles into 0x4300 (bf16 128: the
 * nibble is its low mantissa bits), exact, so the pair dot products sum x * (128 + q) exactly
 * per product; each group's sums then take off (128 + z) * sum_group(x) and scale:
 * y += s * (sum x (128 + q) - (128 + z) sum x). Rows go four at a time (a group's partial
 * sums beside the running ones: 16 registers). */

#define MRQ 4

int64_t loraplex_panel_q4_bytes(int64_t N, int64_t K, int64_t G) {
    int64_t panels = (N + NR - 1) / NR;
    return panels * (K / 2) * NR + panels * G * NR * 4 + panels * G * NR;
}

/* P from q (uint8 [N, K / 2], qgemm.c's 32-column blocks), scales float32 [N, G], zeros int8
 * [N, G] or NULL: the nibbles, then the scales and offsets (see above). */
void loraplex_panel_q4_pack(const uint8_t *q, const float *scales, const int8_t *zeros,
                            int64_t N, int64_t K, int64_t G, void *p) {
    int64_t panels = (N + NR - 1) / NR, K2 = K / 2;
    uint8_t *nib = (uint8_t *)p;
    float *sc = (float *)(nib + panels * K2 * NR);
    int8_t *zp = (int8_t *)(sc + panels * G * NR);
    for (int64_t pi = 0; pi < panels; pi++)
        for (int64_t c = 0; c < NR; c++) {
            int64_t n = pi * NR + c;
            for (int64_t kk = 0; kk < K2; kk++) {
                uint8_t v[2] = {0, 0};
                for (int h = 0; h < 2 && n < N; h++) {
                    int64_t k = 2 * kk + h, b = k / 32, i = k % 32;
                    uint8_t byte = q[n * (K / 2) + 16 * b + (i < 16 ? i : i - 16)];
                    v[h] = i < 16 ? byte & 15 : byte >> 4;
                }
                nib[(pi * K2 + kk) * NR + c] = (uint8_t)(v[0] | v[1] << 4);
            }
            for (int64_t g = 0; g < G; g++) {
                sc[(pi * G + g) * NR + c] = n < N ? scales[n * G + g] : 0.0f;
                zp[(pi * G + g) * NR + c] = (int8_t)(n < N && zeros ? zeros[n * G + g] : 0);
            }
        }
}

#if HAVE_DPBF16
/* the bf16 pairs (128 + q_even, 128 + q_odd) of 16 columns' bytes */
static inline __m512bh q4_pairs(const uint8_t *bytes) {
    __m512i t = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
    __m512i u = _mm512_or_si512(t, _mm512_slli_epi32(t, 12));
    /* (u & 0x000F000F) | 0x43004300 */
    return (__m512bh)_mm512_ternarylogic_epi32(u, _mm512_set1_epi32(0x000F000F),
                                               _mm512_set1_epi32(0x43004300), 0xEA);
}

/* Rows t0 .. t0 + mr (mr <= MRQ) times one panel: its nibbles unpacked as they are read, or
 * (pairs not NULL) the panel's bf16 pairs unpacked once into pairs[K / 2][NR] for every
 * block of rows. */
static inline void q4_block(const uint16_t *x, int64_t ldx, int64_t t0, int mr,
                            const uint8_t *nib, const uint32_t *pairs, const float *sc,
                            const int8_t *zp, const float *xs, int64_t K, int64_t gs, int64_t G,
                            float *out) {
    __m512 a[MRQ][2], s[MRQ][2];
    for (int r = 0; r < MRQ; r++) a[r][0] = a[r][1] = _mm512_setzero_ps();
    const uint16_t *xr[MRQ];
    for (int r = 0; r < MRQ; r++) xr[r] = x + (t0 + (r < mr ? r : 0)) * ldx;
    for (int64_t g = 0; g < G; g++) {
        int64_t k0 = g * gs, k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
        for (int r = 0; r < MRQ; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
        for (int64_t kk = k0 / 2; kk < k1 / 2; kk++) {
            __m512bh w0, w1;
            if (pairs) {
                w0 = (__m512bh)_mm512_loadu_si512((const void *)(pairs + kk * NR));
                w1 = (__m512bh)_mm512_loadu_si512((const void *)(pairs + kk * NR + 16));
            } else {
                w0 = q4_pairs(nib + kk * NR), w1 = q4_pairs(nib + kk * NR + 16);
            }
#pragma GCC unroll 4
            for (int r = 0; r < MRQ; r++) {
                if (r < mr) {
                    int32_t pair;
                    memcpy(&pair, xr[r] + 2 * kk, sizeof pair);
                    __m512bh b = (__m512bh)_mm512_set1_epi32(pair);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], b, w0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], b, w1);
                }
            }
        }
        __m512 off[2], scale[2]; /* 128 + zero, and the scale, of the group's 32 columns */
        for (int h = 0; h < 2; h++) {
            __m128i z = _mm_loadu_si128((const __m128i *)(zp + g * NR + 16 * h));
            off[h] = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(z)),
                                   _mm512_set1_ps(128.0f));
            scale[h] = _mm512_loadu_ps(sc + g * NR + 16 * h);
        }
        for (int r = 0; r < mr; r++) {
            __m512 xsum = _mm512_set1_ps(xs[(t0 + r) * G + g]);
            for (int h = 0; h < 2; h++) {
                __m512 d = _mm512_fnmadd_ps(off[h], xsum, s[r][h]);
                a[r][h] = _mm512_fmadd_ps(scale[h], d, a[r][h]);
            }
        }
    }
    for (int r = 0; r < mr; r++) {
        _mm512_storeu_ps(out + r * NR, a[r][0]);
        _mm512_storeu_ps(out + r * NR + 16, a[r][1]);
    }
}
#endif

/* y [T, N] = x [T, K] (bf16) @ W.T + bias for the 4-bit W packed in p; -1 without AVX512-BF16
 * (or an odd K or group size), -2 if its scratch cannot be allocated. */
int loraplex_panel_q4_gemm(const uint16_t *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                           int64_t N, int64_t gs, int64_t G, const float *bias, void *y,
                           int64_t ldy, int e, int threads) {
#if HAVE_DPBF16
    if ((K & 1) || (gs & 1) || e != BF16) return -1;
    float *xs = (float *)malloc((size_t)(T * G) * sizeof(float)); /* each row's group sums */
    if (!xs) return -2;
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            int64_t k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
            float sum = 0.0f;
            for (int64_t k = g * gs; k < k1; k++) sum += bf16_to_f32(x[t * ldx + k]);
            xs[t * G + g] = sum;
        }
    int64_t panels = (N + NR - 1) / NR, K2 = K / 2;
    const uint8_t *nib = (const uint8_t *)p;
    const float *sc = (const float *)(nib + panels * K2 * NR);
    const int8_t *zp = (const int8_t *)(sc + panels * G * NR);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        /* more than one block of rows: unpack each panel once (K / 2 * NR pairs, in cache) */
        uint32_t *pairs = T > MRQ ? (uint32_t *)malloc((size_t)(K2 * NR) * sizeof(uint32_t)) : NULL;
        if (T > MRQ && !pairs) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (T > MRQ && !pairs) continue;
            const uint8_t *pn = nib + pi * K2 * NR;
            if (pairs)
                for (int64_t i = 0; i < K2 * NR; i += 16)
                    _mm512_storeu_si512((void *)(pairs + i), (__m512i)q4_pairs(pn + i));
            float out[MRQ * NR];
            for (int64_t t0 = 0; t0 < T; t0 += MRQ) {
                int mr = T - t0 < MRQ ? (int)(T - t0) : MRQ;
                q4_block(x, ldx, t0, mr, pn, pairs, sc + pi * G * NR, zp + pi * G * NR, xs, K,
                         gs, G, out);
                for (int r = 0; r < mr; r++)
                    store_row(out + r * NR, bias, pi * NR, N, y, ldy, t0 + r, BF16);
            }
        }
        free(pairs);
    }
    free(xs);
    return failed ? -2 : 0;
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bias;
    (void)y, (void)ldy, (void)e, (void)threads;
    return -1;
#endif
}
