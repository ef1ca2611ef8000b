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
#include "kernels.h"

/* rows of x per block: the block's 2 * MR accumulators stay in registers */
#if defined(__AVX512F__)
#define MR 8
#elif HAVE_VEC
#define MR 6
#else
#define MR 4
#endif
#define NR (2 * VW)

/* bit 0: float32 computed with vectors; bit 1: bfloat16 (AVX512-BF16 dot products); bit 2:
 * 4-bit weights x int8 activations (AVX512-VNNI); the vector width in floats from bit 8. */
int loraplex_panel_features(void) {
    int bits = 0;
#if HAVE_VEC
    bits |= 1;
#endif
#if HAVE_DPBF16
    bits |= 2;
#endif
#if HAVE_VNNI
    bits |= 4;
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

/* ---------------------------------------------------------- 4- and 8-bit weights, bf16 x
 *
 * Semantics (G groups of gs input columns, the last one possibly shorter; gs and K even):
 *
 *     W[n, k]  = scales[n, k / gs] * (q[n, k] - zeros[n, k / gs])     (zeros NULL: 0)
 *     y[t, n]  = rnd(bias[n] + sum_g scales[n, g] * sum_{k in g} x[t, k] * (q[n, k] - z))
 *
 * Layout (loraplex_panel_q_pack, from the QuantWeight layout of quant_gemm.c), per panel of NR
 * columns, in halves of 16 columns (NR = 32 in the builds that compute it):
 *   4 bits: per four inputs 4j .. 4j + 3 and half h, 32 bytes: byte 2c + s (column 16 h + c,
 *     s = 0, 1) = q[n, 4j + s] | q[n, 4j + 2 + s] << 4 (inputs past K: 0);
 *   8 bits: per pair kk of inputs, NR byte pairs (q[n, 2 kk], q[n, 2 kk + 1]) as int8;
 * then per panel and group NR float32 scales, then per panel and group NR int8 zero points
 * (the bytes of QuantWeight's layout plus the panels' padding). Every pair of inputs becomes
 * an exact bf16 pair per column, the operand of AVX512-BF16's dot product, in a few
 * instructions: 4 bits, 32 bytes widened to words hold both pairs' nibbles of 16 columns in
 * place; masked (after a shift by 4 for the second pair) and OR'd into 0x4300 (bf16 128: the
 * nibble is its low mantissa bits) they are (128 + q[n, 2 kk], 128 + q[n, 2 kk + 1]). 8 bits:
 * two times 8 columns' pairs widened to float32 (|q| <= 128 has 8 significant bits) and
 * rounded, exactly, into one vector of bf16 pairs. The pair dot products then sum x * (c + q)
 * exactly per product in float32 (c = 128 for 4 bits, 0 for 8), and each group's sums take
 * off (c + z) * sum_group(x) and scale: y += s * (sum x (c + q) - (c + z) sum x).
 *
 * Blocking: MRQ rows at a time keep a group's partial sums in registers over a chunk of CKK
 * pairs (16 accumulators, as the dense kernel); the running sums of all rows wait in a small
 * per-thread buffer and take each group's scaled partials at the group's end, so the blocks
 * of rows need no second set of registers. Each block unpacks the weight as it reads it;
 * from PAIRS_FROM rows (prompt chunks) each chunk of the panel is unpacked once into a
 * buffer that stays in L1 and is read by every block. The result is bit-identical for any number of rows (each row's sums
 * are the same chain of operations). */

#define MRQ 8
#define CKK 64 /* pairs of inputs per chunk: CKK * NR * 4 = 8 KiB of bf16 pairs */
/* From how many rows a chunk is unpacked once into a buffer for every block (below, each
 * block unpacks as it reads: a few instructions per 16 dot products, cheaper than the
 * buffer's stores and loads; measured on [2048, 2048], docs/benchmarks.md) */
#define PAIRS_FROM 65

static int64_t q_nib_bytes(int64_t K, int bits) {
    return bits == 4 ? (K + 3) / 4 * 2 * NR : K * NR;
}

int64_t loraplex_panel_q_bytes(int64_t N, int64_t K, int64_t G, int bits) {
    int64_t panels = (N + NR - 1) / NR;
    return panels * q_nib_bytes(K, bits) + panels * G * NR * 4 + panels * G * NR;
}

/* P from q (4 bits: uint8 [N, K / 2] in quant_gemm.c's 32-column blocks; 8 bits: int8 [N, K]),
 * scales float32 [N, G], zeros int8 [N, G] or NULL: the values, then the scales and zero
 * points (see above). */
void loraplex_panel_q_pack(const uint8_t *q, const float *scales, const int8_t *zeros,
                           int64_t N, int64_t K, int64_t G, int bits, void *p) {
    int64_t panels = (N + NR - 1) / NR, K2 = K / 2;
    uint8_t *val = (uint8_t *)p;
    float *sc = (float *)(val + panels * q_nib_bytes(K, bits));
    int8_t *zp = (int8_t *)(sc + panels * G * NR);
    memset(val, 0, (size_t)(panels * q_nib_bytes(K, bits)));
    for (int64_t pi = 0; pi < panels; pi++)
        for (int64_t c = 0; c < NR; c++) {
            int64_t n = pi * NR + c;
            for (int64_t kk = 0; kk < K2; kk++) {
                uint8_t v[2] = {0, 0};
                for (int h = 0; h < 2 && n < N; h++) {
                    int64_t k = 2 * kk + h, b = k / 32, i = k % 32;
                    if (bits == 8) {
                        v[h] = q[n * K + k];
                        continue;
                    }
                    uint8_t byte = q[n * (K / 2) + 16 * b + (i < 16 ? i : i - 16)];
                    v[h] = i < 16 ? byte & 15 : byte >> 4;
                }
                if (bits == 4) { /* inputs 4j + 2 (kk & 1) + h, nibble kk & 1 of byte 2 c' + h */
                    int64_t j = kk / 2, half = c / 16, cc = c % 16;
                    uint8_t *b = val + pi * q_nib_bytes(K, 4) + j * 2 * NR + half * 32 + 2 * cc;
                    int shift = (int)(kk & 1) * 4;
                    b[0] = (uint8_t)(b[0] | v[0] << shift);
                    b[1] = (uint8_t)(b[1] | v[1] << shift);
                } else {
                    val[((pi * K2 + kk) * NR + c) * 2] = v[0];
                    val[((pi * K2 + kk) * NR + c) * 2 + 1] = v[1];
                }
            }
            for (int64_t g = 0; g < G; g++) {
                sc[(pi * G + g) * NR + c] = n < N ? scales[n * G + g] : 0.0f;
                zp[(pi * G + g) * NR + c] = (int8_t)(n < N && zeros ? zeros[n * G + g] : 0);
            }
        }
}

#if HAVE_DPBF16
/* pair kk's bf16 pairs (128 + q[n, 2 kk], 128 + q[n, 2 kk + 1]) of one half's 16 columns,
 * from that half's 32 bytes of four inputs (see the layout above) */
INLINE __m512bh q4_pairs(const uint8_t *bytes, int64_t kk) {
    __m512i w = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)bytes));
    if (kk & 1) w = _mm512_srli_epi16(w, 4);
    /* (w & 0x000F000F) | 0x43004300 */
    return (__m512bh)_mm512_ternarylogic_epi32(w, _mm512_set1_epi32(0x000F000F),
                                               _mm512_set1_epi32(0x43004300), 0xEA);
}

/* the bf16 pairs (q_even, q_odd) of 16 columns' int8 pairs: 8 columns' pairs per float32
 * vector, rounded exactly (the low result words from the second operand) */
INLINE __m512bh q8_pairs(const uint8_t *pairs) {
    __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)pairs)));
    __m512 hi =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(pairs + 16))));
    return _mm512_cvtne2ps_pbh(hi, lo);
}

/* the pairs of columns 16 h .. 16 h + 16 at pair kk of one panel's values */
INLINE __m512bh q_pairs(const uint8_t *val, int bits, int64_t kk, int h) {
    return bits == 4 ? q4_pairs(val + (kk / 2) * 2 * NR + 32 * h, kk)
                     : q8_pairs(val + (kk * NR + 16 * h) * 2);
}

/* sp[r] += the pair dot products of block row r (r < MR, a constant where this is inlined)
 * with pairs kk0 .. kk1 of one panel: xp[kk][MRQ] the block's x pairs, the weight's from
 * `pairs` (the chunk unpacked, pairs[kk - kk0][NR]) or unpacked here. */
INLINE void q_dots_n(const int32_t *xp, const int MR_, const uint8_t *val, int bits,
                     const uint32_t *pairs, int64_t kk0, int64_t kk1, float *sp /* [MR_][NR] */) {
    __m512 s[MRQ][2];
    for (int r = 0; r < MR_; r++) {
        s[r][0] = _mm512_loadu_ps(sp + r * NR);
        s[r][1] = _mm512_loadu_ps(sp + r * NR + 16);
    }
    for (int64_t kk = kk0; kk < kk1; kk++) {
        __m512bh w0, w1;
        if (pairs) {
            w0 = (__m512bh)_mm512_loadu_si512((const void *)(pairs + (kk - kk0) * NR));
            w1 = (__m512bh)_mm512_loadu_si512((const void *)(pairs + (kk - kk0) * NR + 16));
        } else {
            w0 = q_pairs(val, bits, kk, 0), w1 = q_pairs(val, bits, kk, 1);
        }
        const int32_t *xk = xp + kk * MRQ;
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) {
            __m512bh b = (__m512bh)_mm512_set1_epi32(xk[r]);
            s[r][0] = _mm512_dpbf16_ps(s[r][0], b, w0);
            s[r][1] = _mm512_dpbf16_ps(s[r][1], b, w1);
        }
    }
    for (int r = 0; r < MR_; r++) {
        _mm512_storeu_ps(sp + r * NR, s[r][0]);
        _mm512_storeu_ps(sp + r * NR + 16, s[r][1]);
    }
}

/* q_dots_n for mr rows (1 .. MRQ), each count its own copy */
INLINE void q_dots(const int32_t *xp, int mr, const uint8_t *val, int bits,
                   const uint32_t *pairs, int64_t kk0, int64_t kk1, float *sp) {
    switch (mr) {
#define Q_CASE(m) \
    case m: q_dots_n(xp, m, val, bits, pairs, kk0, kk1, sp); break;
        Q_CASE(1) Q_CASE(2) Q_CASE(3) Q_CASE(4) Q_CASE(5) Q_CASE(6) Q_CASE(7) Q_CASE(8)
#undef Q_CASE
    }
}

/* acc[t][c] = row t's sums for the NR columns of one panel (pv its values, psc / pzp its
 * scales and zero points); bits a constant where it is inlined. */
INLINE void q_panel(const int32_t *xp, int64_t T, int64_t K, const uint8_t *pv,
                    const float *psc, const int8_t *pzp, const float *xs, int64_t gs, int64_t G,
                    int bits, uint32_t *pairs, float *acc /* [2][T][NR] */) {
    const float c0 = bits == 4 ? 128.0f : 0.0f;
    float *sp = acc + T * NR;
    memset(acc, 0, (size_t)(T * NR) * sizeof(float));
    for (int64_t g = 0; g < G; g++) {
        int64_t kk0 = g * gs / 2, kk1 = ((g + 1) * gs < K ? (g + 1) * gs : K) / 2;
        memset(sp, 0, (size_t)(T * NR) * sizeof(float));
        for (int64_t c = kk0; c < kk1; c += CKK) {
            int64_t ce = c + CKK < kk1 ? c + CKK : kk1;
            if (pairs)
                for (int64_t kk = c; kk < ce; kk++)
                    for (int h = 0; h < 2; h++)
                        _mm512_storeu_si512((void *)(pairs + (kk - c) * NR + 16 * h),
                                            (__m512i)q_pairs(pv, bits, kk, h));
            for (int64_t t0 = 0; t0 < T; t0 += MRQ) {
                int mr = T - t0 < MRQ ? (int)(T - t0) : MRQ;
                const int32_t *xb = xp + t0 * (K / 2); /* the block's [K / 2][MRQ] pairs */
                if (pairs) /* two copies: with the buffer, and unpacking as it reads */
                    q_dots(xb, mr, pv, bits, pairs, c, ce, sp + t0 * NR);
                else
                    q_dots(xb, mr, pv, bits, NULL, c, ce, sp + t0 * NR);
            }
        }
        __m512 off[2], scale[2]; /* c0 + zero, and the scale, of the group's columns */
        for (int h = 0; h < 2; h++) {
            __m128i z = _mm_loadu_si128((const __m128i *)(pzp + g * NR + 16 * h));
            off[h] = _mm512_add_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(z)),
                                   _mm512_set1_ps(c0));
            scale[h] = _mm512_loadu_ps(psc + g * NR + 16 * h);
        }
        for (int64_t t = 0; t < T; t++) {
            __m512 xsum = _mm512_set1_ps(xs[t * G + g]);
            for (int h = 0; h < 2; h++) {
                float *a = acc + t * NR + 16 * h;
                __m512 d = _mm512_fnmadd_ps(off[h], xsum, _mm512_loadu_ps(sp + t * NR + 16 * h));
                _mm512_storeu_ps(a, _mm512_fmadd_ps(scale[h], d, _mm512_loadu_ps(a)));
            }
        }
    }
}

#endif

/* y [T, N] = x [T, K] (bf16) @ W.T + bias for the 4- or 8-bit W packed in p; -1 without
 * AVX512-BF16 (or an odd K or group size, or other bits), -2 if its scratch cannot be
 * allocated. */
int loraplex_panel_q_gemm(const uint16_t *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                          int64_t N, int64_t gs, int64_t G, int bits, const float *bias,
                          void *y, int64_t ldy, int e, int threads) {
#if HAVE_DPBF16
    if ((K & 1) || (gs & 1) || e != BF16 || (bits != 4 && bits != 8)) return -1;
    int64_t K2 = K / 2, Tp = (T + MRQ - 1) / MRQ * MRQ;
    float *xs = (float *)malloc((size_t)(T * G) * sizeof(float)); /* each row's group sums */
    /* x's pairs per block of MRQ rows: xp[block][kk][r], one pointer for a block's loads */
    int32_t *xp = (int32_t *)malloc((size_t)(Tp * K2) * sizeof(int32_t));
    if (!xs || !xp) {
        free(xs), free(xp);
        return -2;
    }
    for (int64_t t = 0; t < T; t++) {
        for (int64_t g = 0; g < G; g++) {
            int64_t k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
            float sum = 0.0f;
            for (int64_t k = g * gs; k < k1; k++) sum += bf16_to_f32(x[t * ldx + k]);
            xs[t * G + g] = sum;
        }
        int32_t *xb = xp + (t / MRQ) * MRQ * K2;
        for (int64_t kk = 0; kk < K2; kk++) memcpy(xb + kk * MRQ + t % MRQ, x + t * ldx + 2 * kk, 4);
    }
    int64_t panels = (N + NR - 1) / NR, vbytes = q_nib_bytes(K, bits);
    const uint8_t *val = (const uint8_t *)p;
    const float *sc = (const float *)(val + panels * vbytes);
    const int8_t *zp = (const int8_t *)(sc + panels * G * NR);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        /* the rows' running and partial sums, and (more than one block) a chunk's pairs */
        float *acc = (float *)malloc((size_t)(2 * T * NR) * sizeof(float));
        uint32_t *pairs = T >= PAIRS_FROM ? (uint32_t *)malloc((size_t)(CKK * NR) * sizeof(uint32_t))
                                  : NULL;
        if (!acc || (T >= PAIRS_FROM && !pairs)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (!acc || (T >= PAIRS_FROM && !pairs)) continue;
            if (bits == 4)
                q_panel(xp, T, K, val + pi * vbytes, sc + pi * G * NR, zp + pi * G * NR, xs,
                        gs, G, 4, pairs, acc);
            else
                q_panel(xp, T, K, val + pi * vbytes, sc + pi * G * NR, zp + pi * G * NR, xs,
                        gs, G, 8, pairs, acc);
            for (int64_t t = 0; t < T; t++)
                store_row(acc + t * NR, bias, pi * NR, N, y, ldy, t, BF16);
        }
        free(pairs);
        free(acc);
    }
    free(xs), free(xp);
    return failed ? -2 : 0;
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bits;
    (void)bias, (void)y, (void)ldy, (void)e, (void)threads;
    return -1;
#endif
}


/* ------------------------------------------- 4-bit weights x int8 activations (W4A8, VNNI)
 *
 * Semantics (compressed-tensors' W4A8: int8 activations quantized per token, dynamically and
 * symmetrically, as vLLM does; G groups of gs inputs, gs a multiple of 8, K of 32 as the
 * 4-bit storage has it):
 *
 *     s_t      = max(max_k |x[t, k]| / 127, 1e-10)                         (float32)
 *     xq[t, k] = clamp(rne(x[t, k] / s_t), -128, 127)
 *     y[t, n]  = rnd(bias[n] + s_t * sum_g scales[n, g]
 *                     * (sum_{k in g} xq[t, k] q[n, k] - zeros[n, g] sum_{k in g} xq[t, k]))
 *
 * with q in 0 .. 15 and zeros as QuantWeight stores them (W = scales (q - zeros)), x and y
 * float32 or bf16. Each group's sums are exact int32 (AVX512-VNNI: 64 u8 x s8 products an
 * instruction, twice the bf16 dot's rate where both run one a cycle), made float once per
 * group. The LoRA delta never reads xq (kernels.py): only the base product is W4A8.
 *
 * Layout (loraplex_panel_w4a8_pack): per panel of NR = 32 columns, per block b of 8 inputs,
 * per half h of 16 columns, 64 bytes: byte 4 c + i = q[n, 8 b + i] | q[n, 8 b + 4 + i] << 4
 * (column 16 h + c, i < 4): masked they are VNNI's four bytes of inputs 8b .. 8b + 3 per
 * column, shifted and masked those of 8b + 4 .. 8b + 7. Then per panel and group NR float32
 * scales and NR int8 zero points, as the other quantized panels. */

int64_t loraplex_panel_w4a8_bytes(int64_t N, int64_t K, int64_t G) {
    int64_t panels = (N + NR - 1) / NR;
    return panels * (K / 2) * NR + panels * G * NR * 5;
}

/* P from q (uint8 [N, K / 2] in quant_gemm.c's 32-column blocks), scales float32 [N, G], zeros
 * int8 [N, G] or NULL (then 8, the symmetric 4-bit zero point). */
void loraplex_panel_w4a8_pack(const uint8_t *q, const float *scales, const int8_t *zeros,
                              int64_t N, int64_t K, int64_t G, void *p) {
    int64_t panels = (N + NR - 1) / NR;
    uint8_t *val = (uint8_t *)p;
    float *sc = (float *)(val + panels * (K / 2) * NR);
    int8_t *zp = (int8_t *)(sc + panels * G * NR);
    memset(val, 0, (size_t)(panels * (K / 2) * NR));
    for (int64_t pi = 0; pi < panels; pi++)
        for (int64_t c = 0; c < NR; c++) {
            int64_t n = pi * NR + c;
            if (n < N)
                for (int64_t k = 0; k < K; k++) {
                    int64_t blk = k / 32, i = k % 32;
                    uint8_t byte = q[n * (K / 2) + 16 * blk + (i < 16 ? i : i - 16)];
                    uint8_t v = i < 16 ? byte & 15 : byte >> 4;
                    int64_t b = k / 8, r = k % 8, h = c / 16, cc = c % 16;
                    uint8_t *dst = val + pi * (K / 2) * NR + b * 2 * 64 + h * 64 + 4 * cc + r % 4;
                    *dst = (uint8_t)(*dst | v << (r < 4 ? 0 : 4));
                }
            for (int64_t g = 0; g < G; g++) {
                sc[(pi * G + g) * NR + c] = n < N ? scales[n * G + g] : 0.0f;
                zp[(pi * G + g) * NR + c] = (int8_t)(n < N ? (zeros ? zeros[n * G + g] : 8) : 0);
            }
        }
}

#if HAVE_VNNI

/* acc[r][h] (int32, exact) += xq . q of block rows r < MR_ over input blocks b0 .. b1 of one
 * panel; xq4[b][2][MRQ]: each row's four int8 of inputs 8b .. 8b+3, then of 8b+4 .. 8b+7. */
INLINE void w4a8_dots_n(const int32_t *xq4, const int MR_, const uint8_t *val, int64_t b0,
                        int64_t b1, __m512i acc[MRQ][2]) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int r = 0; r < MR_; r++) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
    for (int64_t b = b0; b < b1; b++) {
        const uint8_t *vb = val + b * 128;
        __m512i v0 = _mm512_loadu_si512((const void *)vb);
        __m512i v1 = _mm512_loadu_si512((const void *)(vb + 64));
        __m512i w0a = _mm512_and_si512(v0, lo), w0b = _mm512_and_si512(_mm512_srli_epi16(v0, 4), lo);
        __m512i w1a = _mm512_and_si512(v1, lo), w1b = _mm512_and_si512(_mm512_srli_epi16(v1, 4), lo);
        const int32_t *xk = xq4 + b * 2 * MRQ;
#pragma GCC unroll 8
        for (int r = 0; r < MR_; r++) {
            __m512i xa = _mm512_set1_epi32(xk[r]), xb = _mm512_set1_epi32(xk[MRQ + r]);
            acc[r][0] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][0], w0a, xa), w0b, xb);
            acc[r][1] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(acc[r][1], w1a, xa), w1b, xb);
        }
    }
}

/* one group's exact sums of block rows t0 .. t0 + mr into the float32 running sums sums[t] */
INLINE void w4a8_group(const int32_t *xq4, int mr, const uint8_t *val, int64_t b0, int64_t b1,
                       const float *gsc, const int8_t *gzp, const float *xsum /* [mr] */,
                       float *sums /* [mr][NR] */) {
    __m512i acc[MRQ][2];
    switch (mr) {
#define W_CASE(m) \
    case m: w4a8_dots_n(xq4, m, val, b0, b1, acc); break;
        W_CASE(1) W_CASE(2) W_CASE(3) W_CASE(4) W_CASE(5) W_CASE(6) W_CASE(7) W_CASE(8)
#undef W_CASE
    }
    for (int h = 0; h < 2; h++) {
        __m512 z = _mm512_cvtepi32_ps(
            _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(gzp + 16 * h))));
        __m512 scale = _mm512_loadu_ps(gsc + 16 * h);
        for (int r = 0; r < mr; r++) {
            __m512 d = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[r]),
                                        _mm512_cvtepi32_ps(acc[r][h]));
            float *a = sums + r * NR + 16 * h;
            _mm512_storeu_ps(a, _mm512_fmadd_ps(scale, d, _mm512_loadu_ps(a)));
        }
    }
}
#endif

/* y [T, N] = x [T, K] (float32 or bf16, element type e) @ W.T + bias under W4A8 (above), W
 * packed in p; -1 without AVX512-VNNI (or K not a multiple of 32, gs of 8), -2 if its scratch
 * cannot be allocated. */
int loraplex_panel_w4a8_gemm(const void *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                             int64_t N, int64_t gs, int64_t G, const float *bias, void *y,
                             int64_t ldy, int e, int threads) {
#if HAVE_VNNI
    if ((K % 32) || (gs % 8) || (e != F32 && e != BF16)) return -1;
    int64_t K4 = K / 4, Tp = (T + MRQ - 1) / MRQ * MRQ;
    float *st = (float *)malloc((size_t)T * sizeof(float));          /* each row's scale */
    /* each row's group sums of xq, exact in float32 (|sum| <= 128 K < 2^24) [G][Tp] */
    float *xsum = (float *)malloc((size_t)(Tp * G) * sizeof(float));
    /* xq4[block][b][2][MRQ]: four int8 per int32, one pointer a block of rows */
    int32_t *xq4 = (int32_t *)calloc((size_t)(Tp * K4), sizeof(int32_t));
    int8_t *row = (int8_t *)malloc((size_t)K);
    if (!st || !xsum || !xq4 || !row) {
        free(st), free(xsum), free(xq4), free(row);
        return -2;
    }
    for (int64_t t = 0; t < T; t++) {
        const void *xt = e == F32 ? (const void *)((const float *)x + t * ldx)
                                  : (const void *)((const uint16_t *)x + t * ldx); /* row t */
        __m512 amax = _mm512_setzero_ps();
        for (int64_t k = 0; k < K; k += 16)
            amax = _mm512_max_ps(amax, _mm512_abs_ps(vload(xt, k, e)));
        float s = _mm512_reduce_max_ps(amax) / 127.0f;
        s = s < 1e-10f ? 1e-10f : s;
        st[t] = s;
        __m512 sv = _mm512_set1_ps(s);
        for (int64_t k = 0; k < K; k += 16) { /* x / s, rounded half to even, clamped */
            __m512i qv = _mm512_cvtps_epi32(_mm512_roundscale_ps(
                _mm512_div_ps(vload(xt, k, e), sv),
                _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
            qv = _mm512_max_epi32(_mm512_min_epi32(qv, _mm512_set1_epi32(127)),
                                  _mm512_set1_epi32(-128));
            _mm_storeu_si128((__m128i *)(row + k), _mm512_cvtepi32_epi8(qv));
        }
        for (int64_t g = 0; g < G; g++) {
            int64_t k1 = (g + 1) * gs < K ? (g + 1) * gs : K;
            int32_t sum = 0;
            for (int64_t k = g * gs; k < k1; k++) sum += row[k];
            xsum[g * Tp + t] = (float)sum;
        }
        int32_t *blk = xq4 + (t / MRQ) * MRQ * K4;
        for (int64_t b = 0; b < K / 8; b++) {
            memcpy(blk + (b * 2) * MRQ + t % MRQ, row + 8 * b, 4);
            memcpy(blk + (b * 2 + 1) * MRQ + t % MRQ, row + 8 * b + 4, 4);
        }
    }
    free(row);
    int64_t panels = (N + NR - 1) / NR, vbytes = (K / 2) * NR;
    const uint8_t *val = (const uint8_t *)p;
    const float *sc = (const float *)(val + panels * vbytes);
    const int8_t *zp = (const int8_t *)(sc + panels * G * NR);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        float *sums = (float *)malloc((size_t)(T * NR) * sizeof(float));
        if (!sums) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (!sums) continue;
            memset(sums, 0, (size_t)(T * NR) * sizeof(float));
            const uint8_t *pv = val + pi * vbytes;
            for (int64_t g = 0; g < G; g++) {
                int64_t b0 = g * gs / 8, b1 = ((g + 1) * gs < K ? (g + 1) * gs : K) / 8;
                for (int64_t t0 = 0; t0 < T; t0 += MRQ) {
                    int mr = T - t0 < MRQ ? (int)(T - t0) : MRQ;
                    w4a8_group(xq4 + t0 * K4, mr, pv, b0, b1, sc + (pi * G + g) * NR,
                               zp + (pi * G + g) * NR, xsum + g * Tp + t0, sums + t0 * NR);
                }
            }
            for (int64_t t = 0; t < T; t++) {
                for (int64_t c = 0; c < NR; c++) sums[t * NR + c] *= st[t];
                store_row(sums + t * NR, bias, pi * NR, N, y, ldy, t, e);
            }
        }
        free(sums);
    }
    free(st), free(xsum), free(xq4);
    return failed ? -2 : 0;
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bias;
    (void)y, (void)ldy, (void)e, (void)threads;
    return -1;
#endif
}
