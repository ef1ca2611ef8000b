/* Weight-quantized GEMM and dequantization on CPU (loraplex.model.quant.cpu_kernel).
 *
 * Semantics, for t < T and n < N, with G = ceil(K / gs) groups of gs input columns (the last
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
#include "kernels.h"

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

int loraplex_qgemm_features(void) { return HAVE_AVX512 | (HAVE_DPBF16 << 1); }

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
