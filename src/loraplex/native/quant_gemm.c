/* Every weight-quantized GEMM on CPU (loraplex.model.quant.cpu_kernel): first the GEMM and
 * dequantization over QuantWeight's layout as it is stored (loraplex_qgemm, loraplex_qdequant),
 * then the GEMMs over the same weights repacked into column panels (panel.h): 4- and 8-bit
 * weights with bf16 x (loraplex_panel_q_*) and 4-bit weights with int8 x (W4A8,
 * loraplex_panel_w4a8_*), each section with its semantics.
 *
 * Semantics of loraplex_qgemm, for t < T and n < N, with G = ceil(K / gs) groups of gs input columns (the last
 * one may be shorter, as GPTQ writes a width that is not a multiple of the group size):
 *
 *     W[n, k]  = scales[n, k / gs] * (q[n, k] - zeros[n, k / gs])      (zeros NULL: 0)
 *     y[t, n]  = bias[n] + sum_k x[t, k] * W[n, k]                     (float32, rounded once)
 *
 * q: bits 4: uint8 [N, K / 2] in blocks of 32 columns: column 32 b + i is the low nibble of
 *    byte 16 b + i for i < 16, the high nibble of byte 16 b + i - 16 otherwise (values 0..15;
 *    K a multiple of 32), so a block unpacks into two contiguous vectors;
 *    bits 8: int8 [N, K] (values -128..127). zeros: int8 [N, G] (integer zero points, as every
 *    checkpoint format stores them). scales: float32 [N, G]. bias: float32 [N] or NULL.
 *
 * Computed as y[t, n] = bias[n] + sum_g scales[n, g] * dot(x[t, group g], q[n, g] - zeros[n, g]):
 * each weight is unpacked once per call to the exact float (q - z) (a small integer) and used by
 * every row of x, four weight rows at a time over LANES partial sums (a fixed summation order,
 * vectorisable without fast-math). With AVX512-BF16 and bf16 x, the dot products use its bf16
 * pairs: (q - z) is an integer of at most 9 bits, exact in bf16, and each product is exact in
 * float32, so only the summation order differs from the float32 path.
 *
 * Plain C, no torch headers; element types 0 = float32, 1 = bfloat16. The caller checks
 * shapes, strides and dtypes.
 */
#include "amx.h"
#include "panel.h"

#define ROWS 4
#define CHUNK 256 /* columns unpacked at a time (a group of at most this many is one chunk) */

/* w[i] = q[n, k0 + i] - z for i < m, as float (4 bits: k0 and m multiples of 32). */
static inline void unpack(const void *q, int bits, int64_t K, int64_t n, int64_t k0, int64_t m,
                          float z, float *w) {
    if (bits == 4) {
        const uint8_t *row = (const uint8_t *)q + n * (K / 2) + k0 / 2;
        for (int64_t b = 0; b < m / 32; b++) {
            const uint8_t *src = row + 16 * b;
            float *dst = w + 32 * b;
            for (int i = 0; i < 16; i++) {
                dst[i] = (float)(src[i] & 15) - z;
                dst[16 + i] = (float)(src[i] >> 4) - z;
            }
        }
    } else {
        const int8_t *row = (const int8_t *)q + n * K;
        for (int64_t i = 0; i < m; i++) w[i] = (float)row[k0 + i] - z;
    }
}

/* The chunk width for groups of gs columns: one group per chunk where it fits, else CHUNK. */
static inline int64_t chunk_of(int64_t gs) { return gs <= CHUNK ? gs : CHUNK; }

/* d[r] = sum_i x[i] * w[r][i] for r < ROWS, i < m. */
static inline void dot4(const float *x, const float *w, int64_t m, float *d) {
    float s0[LANES] = {0}, s1[LANES] = {0}, s2[LANES] = {0}, s3[LANES] = {0};
    const float *w0 = w, *w1 = w + CHUNK, *w2 = w + 2 * CHUNK, *w3 = w + 3 * CHUNK;
    int64_t i = 0;
    for (; i + LANES <= m; i += LANES)
        for (int l = 0; l < LANES; l++) {
            const float xv = x[i + l];
            s0[l] += xv * w0[i + l];
            s1[l] += xv * w1[i + l];
            s2[l] += xv * w2[i + l];
            s3[l] += xv * w3[i + l];
        }
    float t0 = 0, t1 = 0, t2 = 0, t3 = 0;
    for (int l = 0; l < LANES; l++) t0 += s0[l], t1 += s1[l], t2 += s2[l], t3 += s3[l];
    for (; i < m; i++) {
        t0 += x[i] * w0[i];
        t1 += x[i] * w1[i];
        t2 += x[i] * w2[i];
        t3 += x[i] * w3[i];
    }
    d[0] = t0, d[1] = t1, d[2] = t2, d[3] = t3;
}

#if HAVE_AVX512
/* The AVX-512 path: weights unpacked through a 16-entry table of (v - z) per row and group
 * (4 bits: the nibble indexes it; 8 bits: converted), products accumulated in vectors across
 * the whole row (one horizontal sum per output). float32 x: FMA; bfloat16 x with AVX512-BF16:
 * pair dot products over the exact bf16 (q - z). */

/* The 32 weights of block b of row n at columns k0.. as two float32 vectors. */
static inline void block_f32(const void *q, int bits, int64_t K, int64_t n, int64_t k0,
                             __m512 tbl, __m512 zv, __m512 *lo, __m512 *hi) {
    if (bits == 4) {
        const __m128i v = _mm_loadu_si128((const __m128i *)((const uint8_t *)q + n * (K / 2) + k0 / 2));
        const __m512i i = _mm512_cvtepu8_epi32(v);
        *lo = _mm512_permutexvar_ps(_mm512_and_si512(i, _mm512_set1_epi32(15)), tbl);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(i, 4), tbl);
    } else {
        const int8_t *src = (const int8_t *)q + n * K + k0;
        *lo = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)src))), zv);
        *hi = _mm512_sub_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(src + 16)))), zv);
    }
}

/* The bf16 4-bit fast path reads x as ``xp``: each 64 columns reordered [0..15, 32..47, 16..31,
 * 48..63], the order in which two packed blocks widen into 16-bit lanes (low nibbles of 32
 * bytes, then high ones). A nibble v becomes the bf16 bit pattern 0x4300 | v, which is exactly
 * 128 + v (one OR, no table), and the 128 + z it is too large by is taken off once per chunk
 * (which lies within one group): dot(x, v - z) = dot(x, 128 + v) - (128 + z) * sum(x over the
 * chunk), in float32. */
static void permute_x64(const uint16_t *x, int64_t K, uint16_t *xp) {
    for (int64_t b = 0; b + 64 <= K; b += 64) {
        memcpy(xp + b, x + b, 16 * sizeof(uint16_t));
        memcpy(xp + b + 16, x + b + 32, 16 * sizeof(uint16_t));
        memcpy(xp + b + 32, x + b + 16, 16 * sizeof(uint16_t));
        memcpy(xp + b + 48, x + b + 48, 16 * sizeof(uint16_t));
    }
    for (int64_t b = K - K % 64; b < K; b++) xp[b] = x[b];
}

static void gemm_block_avx512(const void *x, int64_t x_stride, int x_type, int64_t T, int64_t K,
                              const void *q, int bits, const float *scales, const int8_t *zeros,
                              int64_t gs, int64_t n0, int rows, __m512 *acc, float *wf,
                              const uint16_t *xp, const float *xsum, float *corr) {
    const int64_t G = (K + gs - 1) / gs, ch = chunk_of(gs);
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < ROWS * T; i++) acc[i] = _mm512_setzero_ps(), corr[i] = 0.0f;
#if HAVE_DPBF16
    const int dp = x_type == 1;
#else
    const int dp = 0;
#endif
    for (int64_t k0 = 0; k0 < K; k0 += ch) {
        const int64_t m = K - k0 < ch ? K - k0 : ch, g = k0 / gs;
        const int offset = xp != NULL && m % 64 == 0; /* the fast path (above) */
        __m512 sc[ROWS];
        float off[ROWS]; /* (128 + z) * scale of each row, for the group correction */
        for (int r = 0; r < ROWS; r++) { /* unpack this chunk of each row once */
            const int64_t n = n0 + (r < rows ? r : 0); /* padding rows: scale 0 */
            const float z = zeros ? (float)zeros[n * G + g] : 0.0f;
            const __m512 zv = _mm512_set1_ps(z), tbl = _mm512_sub_ps(iota, zv);
            const float scale = r < rows ? scales[n * G + g] : 0.0f;
            sc[r] = _mm512_set1_ps(scale);
            off[r] = (128.0f + z) * scale;
            float *dst = wf + r * CHUNK;
#if HAVE_DPBF16
            if (offset) {
                const uint8_t *src = (const uint8_t *)q + n * (K / 2) + k0 / 2;
                const __m512i m4 = _mm512_set1_epi16(15), bias = _mm512_set1_epi16(0x4300);
                for (int64_t b = 0; b < m; b += 64) {
                    const __m512i v =
                        _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(src + b / 2)));
                    /* (v & 15) | 0x4300: ternary-logic truth table 0xEA = (A & B) | C */
                    const __m512i lo = _mm512_ternarylogic_epi32(v, m4, bias, 0xEA);
                    const __m512i hi =
                        _mm512_ternarylogic_epi32(_mm512_srli_epi16(v, 4), m4, bias, 0xEA);
                    _mm512_storeu_si512((void *)((uint16_t *)dst + b), lo);
                    _mm512_storeu_si512((void *)((uint16_t *)dst + b + 32), hi);
                }
                continue;
            }
            if (dp && bits == 4) { /* nibbles index a table of the 16 bf16 values (q - z) */
                const __m512i tb = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(tbl));
                const uint8_t *src = (const uint8_t *)q + n * (K / 2) + k0 / 2;
                for (int64_t b = 0; b < m; b += 32) {
                    const __m256i v = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src + b / 2)));
                    const __m256i m4 = _mm256_set1_epi16(15);
                    const __m512i idx = _mm512_inserti64x4(
                        _mm512_castsi256_si512(_mm256_and_si256(v, m4)), _mm256_srli_epi16(v, 4), 1);
                    _mm512_storeu_si512((void *)((uint16_t *)dst + b), _mm512_permutexvar_epi16(idx, tb));
                }
                continue;
            }
#endif
            for (int64_t b = 0; b < m; b += 32) {
                __m512 lo, hi;
                block_f32(q, bits, K, n, k0 + b, tbl, zv, &lo, &hi);
#if HAVE_DPBF16
                if (dp) {
                    _mm512_storeu_si512((void *)((uint16_t *)dst + b),
                                        (__m512i)_mm512_cvtne2ps_pbh(hi, lo)); /* exact */
                    continue;
                }
#endif
                _mm512_storeu_ps(dst + b, lo);
                _mm512_storeu_ps(dst + b + 16, hi);
            }
        }
        for (int64_t t = 0; t < T; t++) {
            __m512 s0 = _mm512_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
#if HAVE_DPBF16
            if (dp) {
                const uint16_t *xr = offset ? xp + t * K + k0 : (const uint16_t *)x + t * x_stride + k0;
                const uint16_t *w0 = (const uint16_t *)wf, *w1 = (const uint16_t *)(wf + CHUNK);
                const uint16_t *w2 = (const uint16_t *)(wf + 2 * CHUNK);
                const uint16_t *w3 = (const uint16_t *)(wf + 3 * CHUNK);
                for (int64_t b = 0; b < m; b += 32) {
                    const __m512bh xv = (__m512bh)_mm512_loadu_si512((const void *)(xr + b));
                    s0 = _mm512_dpbf16_ps(s0, xv, (__m512bh)_mm512_loadu_si512((const void *)(w0 + b)));
                    s1 = _mm512_dpbf16_ps(s1, xv, (__m512bh)_mm512_loadu_si512((const void *)(w1 + b)));
                    s2 = _mm512_dpbf16_ps(s2, xv, (__m512bh)_mm512_loadu_si512((const void *)(w2 + b)));
                    s3 = _mm512_dpbf16_ps(s3, xv, (__m512bh)_mm512_loadu_si512((const void *)(w3 + b)));
                }
            } else
#endif
            {
                const float *xr = (const float *)x + t * x_stride + k0;
                for (int64_t b = 0; b < m; b += 16) {
                    const __m512 xv = _mm512_loadu_ps(xr + b);
                    s0 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wf + b), s0);
                    s1 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wf + CHUNK + b), s1);
                    s2 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wf + 2 * CHUNK + b), s2);
                    s3 = _mm512_fmadd_ps(xv, _mm512_loadu_ps(wf + 3 * CHUNK + b), s3);
                }
            }
            __m512 *a = acc + t;
            a[0] = _mm512_fmadd_ps(sc[0], s0, a[0]);
            a[T] = _mm512_fmadd_ps(sc[1], s1, a[T]);
            a[2 * T] = _mm512_fmadd_ps(sc[2], s2, a[2 * T]);
            a[3 * T] = _mm512_fmadd_ps(sc[3], s3, a[3 * T]);
            if (offset)
                for (int r = 0; r < ROWS; r++)
                    corr[r * T + t] += off[r] * xsum[t * ((K + ch - 1) / ch) + k0 / ch];
        }
    }
}
#endif

/* bit 0: the AVX-512 path; bit 1: AVX512-BF16 dot products (bf16 x here, and the 4- and 8-bit
 * panels below); bit 2: the W4A8 panels below (AVX512-VNNI); bit 3: the 4- and 8-bit panels on
 * AMX-BF16 tiles (amx.h); bit 4: those tiles are amx.h's software model; bit 5: the W4A8
 * panels on AMX-INT8 tiles; the panels' width NR from bit 8. */
int loraplex_qgemm_features(void) {
    return HAVE_AVX512 | (HAVE_DPBF16 << 1) | (HAVE_VNNI << 2) |
           ((HAVE_DPBF16 && HAVE_AMX_BF16) << 3) | (AMX_EMULATED << 4) |
           ((HAVE_VNNI && HAVE_AMX_INT8) << 5) | (NR << 8);
}

/* The generic path for rows n0.. (any instruction set): acc[r * T + t] = y[t, n0 + r]. */
static void gemm_block_generic(const float *xs, int64_t xs_stride, int64_t T, int64_t K,
                               const void *q, int bits, const float *scales,
                               const int8_t *zeros, int64_t gs, int64_t n0, int rows,
                               float *acc, float *w) {
    const int64_t G = (K + gs - 1) / gs, ch = chunk_of(gs);
    memset(acc, 0, (size_t)(ROWS * T) * sizeof(float));
    for (int64_t k0 = 0; k0 < K; k0 += ch) {
        const int64_t m = K - k0 < ch ? K - k0 : ch, g = k0 / gs;
        float sc[ROWS], d[ROWS];
        for (int r = 0; r < ROWS; r++) {
            const int64_t n = n0 + (r < rows ? r : 0); /* padding rows: scale 0 */
            const float z = zeros ? (float)zeros[n * G + g] : 0.0f;
            unpack(q, bits, K, n, k0, m, z, w + r * CHUNK);
            sc[r] = r < rows ? scales[n * G + g] : 0.0f;
        }
        for (int64_t t = 0; t < T; t++) {
            dot4(xs + t * xs_stride + k0, w, m, d);
            for (int r = 0; r < ROWS; r++) acc[r * T + t] += sc[r] * d[r];
        }
    }
}

int loraplex_qgemm(const void *x, int64_t x_stride, int x_type, int64_t T, int64_t K,
                   const void *q, int bits, const float *scales, const int8_t *zeros, int64_t gs,
                   int64_t N, const float *bias, void *y, int64_t y_stride, int y_type,
                   int threads) {
    const int64_t ch = chunk_of(gs);
    int wide = 0; /* the AVX-512 path: chunks of whole 32-column blocks, a kind of x it reads */
#if HAVE_AVX512
    wide = ch % 32 == 0 && K % 32 == 0 && (x_type == 0 || HAVE_DPBF16);
#endif
    float *xf = NULL; /* x as float32 rows for the generic path */
    const float *xs = (const float *)x;
    int64_t xs_stride = x_stride;
    if (x_type == 1 && !wide) {
        xf = (float *)malloc((size_t)(T * K) * sizeof(float));
        if (!xf) return 1;
        for (int64_t t = 0; t < T; t++)
            row_to_f32((const uint16_t *)x + t * x_stride, BF16, K, xf + t * K);
        xs = xf, xs_stride = K;
    }
    uint16_t *xp = NULL; /* the bf16 4-bit fast path's x and group sums (gemm_block_avx512) */
    float *xsum = NULL;
    (void)ch;
#if HAVE_DPBF16
    const int64_t C = (K + ch - 1) / ch;
    if (wide && x_type == 1 && bits == 4 && ch % 64 == 0) {
        xp = (uint16_t *)malloc((size_t)(T * K) * sizeof(uint16_t));
        xsum = (float *)malloc((size_t)(T * C) * sizeof(float));
        if (!xp || !xsum) {
            free(xp), free(xsum), free(xf);
            return 1;
        }
        for (int64_t t = 0; t < T; t++) {
            const uint16_t *row = (const uint16_t *)x + t * x_stride;
            permute_x64(row, K, xp + t * K);
            for (int64_t c = 0; c < C; c++) { /* per unpacked chunk: within one group */
                float sum = 0.0f;
                const int64_t end = (c + 1) * ch < K ? (c + 1) * ch : K;
                for (int64_t k = c * ch; k < end; k++) sum += bf16_to_f32(row[k]);
                xsum[t * C + c] = sum;
            }
        }
    }
#endif
    const int64_t blocks = (N + ROWS - 1) / ROWS;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        /* accumulators: ROWS * T floats (generic) or vectors (AVX-512); unpacked weights;
         * the fast path's per-output corrections */
        float *acc = (float *)aligned_alloc(64, (size_t)(ROWS * T) * 64);
        float *w = (float *)aligned_alloc(64, (size_t)(ROWS * CHUNK) * sizeof(float));
        float *corr = (float *)malloc((size_t)(ROWS * T) * sizeof(float));
        if (!acc || !w || !corr) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++) {
            if (failed) continue;
            const int64_t n0 = b * ROWS;
            const int rows = (int)(N - n0 < ROWS ? N - n0 : ROWS);
            float out[ROWS];
            for (int64_t t = 0; t < T; t++) {
                if (t == 0) {
#if HAVE_AVX512
                    if (wide)
                        gemm_block_avx512(x, x_stride, x_type, T, K, q, bits, scales, zeros, gs,
                                          n0, rows, (__m512 *)acc, w, xp, xsum, corr);
                    else
#endif
                        gemm_block_generic(xs, xs_stride, T, K, q, bits, scales, zeros, gs, n0,
                                           rows, acc, w);
                }
                for (int r = 0; r < rows; r++) {
#if HAVE_AVX512
                    if (wide) {
                        out[r] = _mm512_reduce_add_ps(((__m512 *)acc)[r * T + t]) -
                                 (xp ? corr[r * T + t] : 0.0f);
                        continue;
                    }
#endif
                    out[r] = acc[r * T + t];
                }
                for (int r = 0; r < rows; r++) {
                    const int64_t n = n0 + r;
                    const float v = out[r] + (bias ? bias[n] : 0.0f);
                    if (y_type == 0)
                        ((float *)y)[t * y_stride + n] = v;
                    else
                        ((uint16_t *)y)[t * y_stride + n] = f32_to_bf16(v);
                }
            }
        }
        free(acc);
        free(w);
        free(corr);
    }
    free(xf);
    free(xp);
    free(xsum);
    return failed;
}

/* out[n - n0, k] = W[n, k] (as defined above) for n0 <= n < n1, in out's element type. */
int loraplex_qdequant(const void *q, int bits, const float *scales, const int8_t *zeros,
                      int64_t gs, int64_t N, int64_t K, int64_t n0, int64_t n1, void *out,
                      int out_type, int threads) {
    const int64_t G = (K + gs - 1) / gs;
    (void)N;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
        float *w = (float *)malloc((size_t)K * sizeof(float));
        if (!w) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t n = n0; n < n1; n++) {
            if (failed) continue;
#if HAVE_AVX512
            if (gs % 32 == 0 && K % 32 == 0) { /* the table path of the GEMM, scaled */
                const __m512 iota =
                    _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
                for (int64_t g = 0; g < G; g++) {
                    const float z = zeros ? (float)zeros[n * G + g] : 0.0f;
                    const __m512 zv = _mm512_set1_ps(z), sv = _mm512_set1_ps(scales[n * G + g]);
                    const __m512 tbl = _mm512_sub_ps(iota, zv);
                    const int64_t k0 = g * gs, m = K - k0 < gs ? K - k0 : gs;
                    for (int64_t b = 0; b < m; b += 32) {
                        __m512 lo, hi;
                        block_f32(q, bits, K, n, k0 + b, tbl, zv, &lo, &hi);
                        _mm512_storeu_ps(w + k0 + b, _mm512_mul_ps(lo, sv));
                        _mm512_storeu_ps(w + k0 + b + 16, _mm512_mul_ps(hi, sv));
                    }
                }
            } else
#endif
            for (int64_t g = 0; g < G; g++) {
                const float z = zeros ? (float)zeros[n * G + g] : 0.0f, s = scales[n * G + g];
                const int64_t k0 = g * gs, m = K - k0 < gs ? K - k0 : gs;
                unpack(q, bits, K, n, k0, m, z, w + k0);
                for (int64_t i = k0; i < k0 + m; i++) w[i] *= s;
            }
            if (out_type == 0)
                memcpy((float *)out + (n - n0) * K, w, (size_t)K * sizeof(float));
            else {
                uint16_t *dst = (uint16_t *)out + (n - n0) * K;
                int64_t k = 0;
#if HAVE_DPBF16
                for (; k + 16 <= K; k += 16) /* rounds to nearest even, as f32_to_bf16 */
                    _mm256_storeu_si256((__m256i *)(dst + k),
                                        (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(w + k)));
#endif
                for (; k < K; k++) dst[k] = f32_to_bf16(w[k]);
            }
        }
        free(w);
    }
    return failed;
}


/* ------------------------------------- panels of 4- and 8-bit weights, bf16 x (panel.h)
 *
 * Semantics (G groups of gs input columns, the last one possibly shorter; gs and K even):
 *
 *     W[n, k]  = scales[n, k / gs] * (q[n, k] - zeros[n, k / gs])     (zeros NULL: 0)
 *     y[t, n]  = rnd(bias[n] + sum_g scales[n, g] * sum_{k in g} x[t, k] * (q[n, k] - z))
 *
 * Layout (loraplex_panel_q_pack, from the QuantWeight layout above), per panel of NR columns
 * (panel.h), in halves of 16 columns (NR = 32 in the builds that compute it):
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
 * pairs (16 accumulators, as the dense panels of panel_gemm.c); the running sums of all rows wait in a small
 * per-thread buffer and take each group's scaled partials at the group's end, so the blocks
 * of rows need no second set of registers. Each block unpacks the weight as it reads it;
 * from PAIRS_FROM rows (prompt chunks) each chunk of the panel is unpacked once into a
 * buffer that stays in L1 and is read by every block. The result is bit-identical for any
 * number of rows (each row's sums are the same chain of operations). */

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

/* P from q (4 bits: uint8 [N, K / 2] in the 32-column blocks above; 8 bits: int8 [N, K]),
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

#if HAVE_AMX_BF16
/* sp[m][c] += the pair dot products of x's rows t0 + m (m below the configured A rows) with
 * pairs kk0 .. kk1 of one panel, on AMX tiles (amx.h): A = 16 pairs of inputs of the rows,
 * read from x as it is; B1 / B2 = the same pairs of the panel's two halves of 16 columns,
 * from `pairs` (the chunk unpacked, pairs[kk - kk0][NR]: row k of a B tile is pair kk0 + k,
 * 64 bytes, NR * 4 apart); C3 / C4 = the halves' sums, loaded from and stored back to sp.
 * kk1 - kk0 is a multiple of 16. */
static void amx_dots(const uint16_t *x, int64_t ldx, int64_t t0, const uint32_t *pairs,
                     int64_t kk0, int64_t kk1, float *sp /* [rows][NR] */) {
    TILE_LOAD(3, sp, NR * 4);
    TILE_LOAD(4, sp + 16, NR * 4);
    for (int64_t kk = kk0; kk < kk1; kk += 16) {
        TILE_LOAD(0, x + t0 * ldx + 2 * kk, ldx * 2);
        TILE_LOAD(1, pairs + (kk - kk0) * NR, NR * 4);
        TILE_LOAD(2, pairs + (kk - kk0) * NR + 16, NR * 4);
        TILE_DPBF16(3, 0, 1);
        TILE_DPBF16(4, 0, 2);
    }
    TILE_STORE(3, sp, NR * 4);
    TILE_STORE(4, sp + 16, NR * 4);
}
#endif

/* acc[t][c] = row t's sums for the NR columns of one panel (pv its values, psc / pzp its
 * scales and zero points); bits a constant where it is inlined. */
INLINE void q_panel(const int32_t *xp, int64_t T, int64_t K, const uint8_t *pv,
                    const float *psc, const int8_t *pzp, const float *xs, int64_t gs, int64_t G,
                    int bits, uint32_t *pairs, float *acc /* [2][T][NR] */, const uint16_t *x,
                    int64_t ldx, int *amx_rows) {
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
#if HAVE_AMX_BF16
            if (amx_rows) { /* on tiles: blocks of 16 rows */
                for (int64_t t0 = 0; t0 < T; t0 += 16) {
                    int mr = T - t0 < 16 ? (int)(T - t0) : 16;
                    if (mr != *amx_rows) amx_config(mr, 16), *amx_rows = mr;
                    amx_dots(x, ldx, t0, pairs, c, ce, sp + t0 * NR);
                }
                continue;
            }
#else
            (void)x, (void)ldx, (void)amx_rows;
#endif
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

#if HAVE_DPBF16
/* loraplex_panel_q_gemm (amx 0) and loraplex_panel_q_gemm_amx (amx 1): the same sums, the
 * pair dot products on AVX512-BF16 or on AMX tiles (blocks of 16 rows; each chunk of the
 * panel unpacked once into the pairs buffer that the tiles load). */
static int panel_q_run(const uint16_t *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                       int64_t N, int64_t gs, int64_t G, int bits, const float *bias, void *y,
                       int64_t ldy, int threads, int amx) {
    int64_t K2 = K / 2, Tp = (T + MRQ - 1) / MRQ * MRQ;
    float *xs = (float *)malloc((size_t)(T * G) * sizeof(float)); /* each row's group sums */
    /* x's pairs per block of MRQ rows: xp[block][kk][r], one pointer for a block's loads
     * (the tiles read x as it is) */
    int32_t *xp = amx ? NULL : (int32_t *)malloc((size_t)(Tp * K2) * sizeof(int32_t));
    if (!xs || (!amx && !xp)) {
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
        if (xp) {
            int32_t *xb = xp + (t / MRQ) * MRQ * K2;
            for (int64_t kk = 0; kk < K2; kk++)
                memcpy(xb + kk * MRQ + t % MRQ, x + t * ldx + 2 * kk, 4);
        }
    }
    int64_t panels = (N + NR - 1) / NR, vbytes = q_nib_bytes(K, bits);
    const uint8_t *val = (const uint8_t *)p;
    const float *sc = (const float *)(val + panels * vbytes);
    const int8_t *zp = (const int8_t *)(sc + panels * G * NR);
    int failed = 0, buffered = amx || T >= PAIRS_FROM;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        /* the rows' running and partial sums, and (tiles, or more than one block) a chunk's
         * pairs; amx_rows: the A / C tiles' rows as configured on this thread (0: none yet) */
        float *acc = (float *)malloc((size_t)(2 * T * NR) * sizeof(float));
        uint32_t *pairs = buffered ? (uint32_t *)malloc((size_t)(CKK * NR) * sizeof(uint32_t))
                                   : NULL;
        int amx_rows = 0, *tiles = amx ? &amx_rows : NULL;
        if (!acc || (buffered && !pairs)) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (!acc || (buffered && !pairs)) continue;
            if (bits == 4)
                q_panel(xp, T, K, val + pi * vbytes, sc + pi * G * NR, zp + pi * G * NR, xs,
                        gs, G, 4, pairs, acc, x, ldx, tiles);
            else
                q_panel(xp, T, K, val + pi * vbytes, sc + pi * G * NR, zp + pi * G * NR, xs,
                        gs, G, 8, pairs, acc, x, ldx, tiles);
            for (int64_t t = 0; t < T; t++)
                store_row(acc + t * NR, bias, pi * NR, N, y, ldy, t, BF16);
        }
#if HAVE_AMX_BF16
        if (amx_rows) TILE_RELEASE();
#endif
        free(pairs);
        free(acc);
    }
    free(xs), free(xp);
    return failed ? -2 : 0;
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
    return panel_q_run(x, ldx, T, K, p, N, gs, G, bits, bias, y, ldy, threads, 0);
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bits;
    (void)bias, (void)y, (void)ldy, (void)e, (void)threads;
    return -1;
#endif
}

/* loraplex_panel_q_gemm on AMX tiles (the same panels and semantics); -1 without them here
 * (or K or the group size not a multiple of 32: a tile reads 32 inputs), -2 if its scratch
 * cannot be allocated. The caller has had amx_enable() (loraplex_amx_enable) succeed. */
int loraplex_panel_q_gemm_amx(const uint16_t *x, int64_t ldx, int64_t T, int64_t K,
                              const void *p, int64_t N, int64_t gs, int64_t G, int bits,
                              const float *bias, void *y, int64_t ldy, int e, int threads) {
#if HAVE_DPBF16 && HAVE_AMX_BF16
    if ((K % 32) || (gs % 32) || e != BF16 || (bits != 4 && bits != 8)) return -1;
    return panel_q_run(x, ldx, T, K, p, N, gs, G, bits, bias, y, ldy, threads, 1);
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

/* P from q (uint8 [N, K / 2] in the 32-column blocks above), scales float32 [N, G], zeros
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
    default: __builtin_unreachable(); /* 1 <= mr <= MRQ */
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

#if HAVE_VNNI
/* W4A8's activations (above): each row's scale st[t], its int8 values xq[t][K] and their
 * group sums xsum[g][Tp] (exact in float32: |sum| <= 128 K < 2^24). */
static void w4a8_quantize(const void *x, int64_t ldx, int64_t T, int64_t K, int64_t gs,
                          int64_t G, int e, int64_t Tp, float *st, float *xsum, int8_t *xq) {
    for (int64_t t = 0; t < T; t++) {
        const void *xt = e == F32 ? (const void *)((const float *)x + t * ldx)
                                  : (const void *)((const uint16_t *)x + t * ldx); /* row t */
        int8_t *row = xq + t * K;
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
    }
}
#endif

#define WT_CHUNK 8 /* W4A8 on tiles: tiles of 64 inputs unpacked at a time, 8 x 2 KiB */
#if HAVE_VNNI && HAVE_AMX_INT8

/* The B tiles of tiles j < nt of one panel from input block b0 on (8 blocks of 8 inputs a
 * tile): wb[j][h][16][64], row 2 i of half h the low nibbles of block b0 + 8 j + i (inputs
 * 8 b .. 8 b + 3 of its 16 columns, four bytes a column), row 2 i + 1 the high ones. */
static void w4a8_tiles(const uint8_t *pv, int64_t b0, int64_t nt, uint8_t *wb) {
    const __m512i lo = _mm512_set1_epi8(0x0F);
    for (int64_t j = 0; j < nt; j++)
        for (int h = 0; h < 2; h++)
            for (int i = 0; i < 8; i++) {
                __m512i v = _mm512_loadu_si512((const void *)(pv + (b0 + 8 * j + i) * 128 + 64 * h));
                uint8_t *row = wb + ((j * 2 + h) * 16 + 2 * i) * 64;
                _mm512_storeu_si512((void *)row, _mm512_and_si512(v, lo));
                _mm512_storeu_si512((void *)(row + 64), _mm512_and_si512(_mm512_srli_epi16(v, 4), lo));
            }
}

/* ip[m][c] (int32, exact) += xq[t0 + m] . q over the nt tiles in wb (inputs k0 on), for the
 * configured A rows; C3 / C4 the halves, loaded from ip (zeroed where first) and stored back. */
static void w4a8_amx_dots(const int8_t *xq, int64_t K, int64_t t0, int64_t k0, const uint8_t *wb,
                          int64_t nt, int first, int32_t *ip /* [rows][NR] */) {
    if (first) {
        TILE_ZERO(3);
        TILE_ZERO(4);
    } else {
        TILE_LOAD(3, ip, NR * 4);
        TILE_LOAD(4, ip + 16, NR * 4);
    }
    for (int64_t j = 0; j < nt; j++) {
        TILE_LOAD(0, xq + t0 * K + k0 + 64 * j, K);
        TILE_LOAD(1, wb + (j * 2) * 1024, 64);
        TILE_LOAD(2, wb + (j * 2 + 1) * 1024, 64);
        TILE_DPBSUD(3, 0, 1);
        TILE_DPBSUD(4, 0, 2);
    }
    TILE_STORE(3, ip, NR * 4);
    TILE_STORE(4, ip + 16, NR * 4);
}
#endif

/* W4A8 on AVX512-VNNI (amx 0) or AMX-INT8 tiles (amx 1): the same exact int32 group sums. */
static int w4a8_run(const void *x, int64_t ldx, int64_t T, int64_t K, const void *p, int64_t N,
                    int64_t gs, int64_t G, const float *bias, void *y, int64_t ldy, int e,
                    int threads, int amx) {
#if HAVE_VNNI
    int64_t K4 = K / 4, Tp = (T + MRQ - 1) / MRQ * MRQ;
    float *st = (float *)malloc((size_t)T * sizeof(float));          /* each row's scale */
    float *xsum = (float *)malloc((size_t)(Tp * G) * sizeof(float)); /* [G][Tp] */
    int8_t *xq = (int8_t *)malloc((size_t)(T * K));                  /* [T][K]: the tiles' A */
    /* xq4[block][b][2][MRQ]: four int8 per int32, one pointer a block of rows (VNNI) */
    int32_t *xq4 = amx ? NULL : (int32_t *)calloc((size_t)(Tp * K4), sizeof(int32_t));
    if (!st || !xsum || !xq || (!amx && !xq4)) {
        free(st), free(xsum), free(xq), free(xq4);
        return -2;
    }
    w4a8_quantize(x, ldx, T, K, gs, G, e, Tp, st, xsum, xq);
    for (int64_t t = 0; xq4 && t < T; t++) {
        int32_t *blk = xq4 + (t / MRQ) * MRQ * K4;
        for (int64_t b = 0; b < K / 8; b++) {
            memcpy(blk + (b * 2) * MRQ + t % MRQ, xq + t * K + 8 * b, 4);
            memcpy(blk + (b * 2 + 1) * MRQ + t % MRQ, xq + t * K + 8 * b + 4, 4);
        }
    }
    int64_t panels = (N + NR - 1) / NR, vbytes = (K / 2) * NR;
    const uint8_t *val = (const uint8_t *)p;
    const float *sc = (const float *)(val + panels * vbytes);
    const int8_t *zp = (const int8_t *)(sc + panels * G * NR);
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && panels > 1)
    {
        float *sums = (float *)malloc((size_t)(T * NR) * sizeof(float));
        /* tiles: each group's int32 sums [T][NR] and a chunk's unpacked B tiles */
        int32_t *ip = amx ? (int32_t *)malloc((size_t)(T * NR) * sizeof(int32_t)) : NULL;
        uint8_t *wb = amx ? (uint8_t *)malloc((size_t)WT_CHUNK * 2048) : NULL;
        int ok = sums && (!amx || (ip && wb)), amx_rows = 0;
        (void)amx_rows; /* only with AMX-INT8 */
        if (!ok) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t pi = 0; pi < panels; pi++) {
            if (!ok) continue;
            memset(sums, 0, (size_t)(T * NR) * sizeof(float));
            const uint8_t *pv = val + pi * vbytes;
            for (int64_t g = 0; g < G; g++) {
                int64_t b0 = g * gs / 8, b1 = ((g + 1) * gs < K ? (g + 1) * gs : K) / 8;
                const float *gsc = sc + (pi * G + g) * NR;
                const int8_t *gzp = zp + (pi * G + g) * NR;
                if (!amx) {
                    for (int64_t t0 = 0; t0 < T; t0 += MRQ) {
                        int mr = T - t0 < MRQ ? (int)(T - t0) : MRQ;
                        w4a8_group(xq4 + t0 * K4, mr, pv, b0, b1, gsc, gzp, xsum + g * Tp + t0,
                                   sums + t0 * NR);
                    }
                    continue;
                }
#if HAVE_AMX_INT8
                for (int64_t c = b0; c < b1; c += 8 * WT_CHUNK) { /* blocks of 8 inputs */
                    int64_t nt = (b1 - c) / 8 < WT_CHUNK ? (b1 - c) / 8 : WT_CHUNK;
                    w4a8_tiles(pv, c, nt, wb);
                    for (int64_t t0 = 0; t0 < T; t0 += 16) {
                        int mr = T - t0 < 16 ? (int)(T - t0) : 16;
                        if (mr != amx_rows) amx_config(mr, 16), amx_rows = mr;
                        w4a8_amx_dots(xq, K, t0, 8 * c, wb, nt, c == b0, ip + t0 * NR);
                    }
                }
                for (int h = 0; h < 2; h++) { /* the group's sums: as w4a8_group */
                    __m512 z = _mm512_cvtepi32_ps(
                        _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(gzp + 16 * h))));
                    __m512 scale = _mm512_loadu_ps(gsc + 16 * h);
                    for (int64_t t = 0; t < T; t++) {
                        __m512i acc = _mm512_loadu_si512((const void *)(ip + t * NR + 16 * h));
                        __m512 d = _mm512_fnmadd_ps(z, _mm512_set1_ps(xsum[g * Tp + t]),
                                                    _mm512_cvtepi32_ps(acc));
                        float *a = sums + t * NR + 16 * h;
                        _mm512_storeu_ps(a, _mm512_fmadd_ps(scale, d, _mm512_loadu_ps(a)));
                    }
                }
#endif
            }
            for (int64_t t = 0; t < T; t++) {
                for (int64_t c = 0; c < NR; c++) sums[t * NR + c] *= st[t];
                store_row(sums + t * NR, bias, pi * NR, N, y, ldy, t, e);
            }
        }
#if HAVE_AMX_INT8
        if (amx_rows) TILE_RELEASE();
#endif
        free(sums), free(ip), free(wb);
    }
    free(st), free(xsum), free(xq), free(xq4);
    return failed ? -2 : 0;
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bias;
    (void)y, (void)ldy, (void)e, (void)threads, (void)amx;
    return -1;
#endif
}

/* y [T, N] = x [T, K] (float32 or bf16, element type e) @ W.T + bias under W4A8 (above), W
 * packed in p; -1 without AVX512-VNNI (or K not a multiple of 32, gs of 8), -2 if its scratch
 * cannot be allocated. */
int loraplex_panel_w4a8_gemm(const void *x, int64_t ldx, int64_t T, int64_t K, const void *p,
                             int64_t N, int64_t gs, int64_t G, const float *bias, void *y,
                             int64_t ldy, int e, int threads) {
    if ((K % 32) || (gs % 8) || (e != F32 && e != BF16)) return -1;
    return w4a8_run(x, ldx, T, K, p, N, gs, G, bias, y, ldy, e, threads, 0);
}

/* loraplex_panel_w4a8_gemm on AMX-INT8 tiles (the same panels and exact sums); -1 without
 * them (or K or gs not a multiple of 64: a tile reads 64 inputs). The caller has had
 * loraplex_amx_enable succeed. */
int loraplex_panel_w4a8_gemm_amx(const void *x, int64_t ldx, int64_t T, int64_t K,
                                 const void *p, int64_t N, int64_t gs, int64_t G,
                                 const float *bias, void *y, int64_t ldy, int e, int threads) {
#if HAVE_VNNI && HAVE_AMX_INT8
    if ((K % 64) || (gs % 64) || (e != F32 && e != BF16)) return -1;
    return w4a8_run(x, ldx, T, K, p, N, gs, G, bias, y, ldy, e, threads, 1);
#else
    (void)x, (void)ldx, (void)T, (void)K, (void)p, (void)N, (void)gs, (void)G, (void)bias;
    (void)y, (void)ldy, (void)e, (void)threads;
    return -1;
#endif
}

/* 0 where this process may use AMX tiles (amx.h's amx_enable; the software model: always),
 * -1 where they are not compiled in or the OS refuses. */
int loraplex_amx_enable(void) {
#if HAVE_AMX_BF16
    return amx_enable();
#else
    return -1;
#endif
}

/* The misuses of the tiles amx.h's software model has seen (0 on hardware). */
int loraplex_amx_faults(void) {
#if AMX_EMULATED
    return __atomic_load_n(&amx_faults, __ATOMIC_RELAXED);
#else
    return 0;
#endif
}

/* A first run of the AMX panels on a small 4-bit weight against the AVX512-BF16 panels, one
 * thread: 0 if they agree, else nonzero. Meant for a child process (cpu_kernel.py), so that
 * a CPU, OS or hypervisor that faults on the tiles costs that process, not the caller. */
int loraplex_amx_probe(void) {
#if HAVE_DPBF16 && HAVE_AMX_BF16
    enum { PN = 40, PK = 128, PG = 2, PT = 19 };
    uint8_t q[PN * PK / 2];
    float scales[PN * PG], bias[PN], got[PT * PN], want[PT * PN];
    int8_t zeros[PN * PG];
    uint16_t x[PT * PK], yg[PT * PN], yw[PT * PN];
    uint32_t r = 12345u;
    for (int i = 0; i < PN * PK / 2; i++) q[i] = (uint8_t)((r = r * 1103515245u + 12345u) >> 16);
    for (int i = 0; i < PN * PG; i++) {
        scales[i] = 0.01f * (float)(1 + i % 7);
        zeros[i] = (int8_t)(i % 16);
    }
    for (int i = 0; i < PN; i++) bias[i] = 0.1f * (float)(i % 5);
    for (int i = 0; i < PT * PK; i++)
        x[i] = f32_to_bf16((float)((int)((r = r * 1103515245u + 12345u) >> 20) % 64 - 32) / 16.0f);
    void *p = malloc((size_t)loraplex_panel_q_bytes(PN, PK, PG, 4));
    if (!p || amx_enable() != 0) {
        free(p);
        return 2;
    }
    loraplex_panel_q_pack(q, scales, zeros, PN, PK, PG, 4, p);
    int rc = loraplex_panel_q_gemm(x, PK, PT, PK, p, PN, PK / PG, PG, 4, bias, yw, PN, BF16, 1) |
             loraplex_panel_q_gemm_amx(x, PK, PT, PK, p, PN, PK / PG, PG, 4, bias, yg, PN, BF16, 1);
    free(p);
    if (rc) return 3;
    for (int i = 0; i < PT * PN; i++) {
        got[i] = bf16_to_f32(yg[i]), want[i] = bf16_to_f32(yw[i]);
        float d = got[i] - want[i], m = want[i] < 0 ? -want[i] : want[i];
        if (d < 0) d = -d;
        if (!(d <= 0.02f * (m + 1.0f))) return 4;
    }
#if HAVE_VNNI && HAVE_AMX_INT8
    /* W4A8 on AMX-INT8 tiles: the same exact sums as on VNNI, so the same bits */
    p = malloc((size_t)loraplex_panel_w4a8_bytes(PN, PK, PG));
    if (!p) return 2;
    loraplex_panel_w4a8_pack(q, scales, zeros, PN, PK, PG, p);
    rc = loraplex_panel_w4a8_gemm(x, PK, PT, PK, p, PN, PK / PG, PG, bias, yw, PN, BF16, 1) |
         loraplex_panel_w4a8_gemm_amx(x, PK, PT, PK, p, PN, PK / PG, PG, bias, yg, PN, BF16, 1);
    free(p);
    if (rc) return 6;
    if (memcmp(yg, yw, sizeof yg)) return 7;
#endif
    return loraplex_amx_faults() ? 5 : 0;
#else
    return 1;
#endif
}
