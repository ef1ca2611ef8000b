/* A decoder layer's small ops on CPU, one call each (loraplex.model.layer_ops).
 *
 * At decode sizes each of these is several torch ops of a few microseconds of arithmetic and
 * more of dispatch; one C call per op and layer replaces them. Semantics (element type E =
 * float32 or bfloat16; rnd(v): v rounded to E, to nearest even; every other value float32):
 *
 *   loraplex_add_rms_norm:  for each row t:
 *       if delta:  h[t] = rnd(h[t] + delta[t])                                  (the residual)
 *       r = 1 / sqrt(mean(h[t]^2) + eps)
 *       mode 0 (Llama):  out[t] = E == float32 ? (h[t] * r) * w : rnd(w * rnd(h[t] * r))
 *       mode 1 (Gemma):  out[t] = rnd((h[t] * r) * (1 + w))
 *       mode 2 (Gemma 4, GPT-OSS): out[t] = rnd((h[t] * r) * w)
 *   loraplex_rotary:  in place, per row t and head, on the first rd values (half = rd / 2):
 *       x[i]        = rnd(rnd(x[i] * cos[i]) + rnd(-x[i + half] * sin[i]))          i < half
 *       x[i + half] = rnd(rnd(x[i + half] * cos[i + half]) + rnd(x[i] * sin[i + half]))
 *   loraplex_gated_act:  out[t, i] = rnd(rnd(act(gu[t, i])) * gu[t, I + i]),
 *       act 0: silu(g) = g / (1 + exp(-g)); act 1: gelu_tanh(g) = 0.5 g (1 + tanh(sqrt(2 / pi)
 *       (g + 0.044715 g^3)))
 *   loraplex_decode_attention:  for each decode row b (query row rows[b], or b) and query head
 *       h (KV head j = h / G, G = H / KVH), over the positions p of [lo, len[b]) (lo = len - window
 *       with a window > 0; a window -C < 0 is chunked attention, lo = (len - 1) / C * C; else
 *       0) at cache slot block_table[b, p / bs] * bs + p % bs:
 *           s[p] = scale * dot(q[h], k[slot, j]),  with a cap: s[p] = tanh(s[p] / cap) * cap
 *           out[h] = rnd(sum_p softmax(s)[p] * v[slot, j])
 *       with attention sinks (``sinks``, float32 [H], or NULL): sinks[h] joins the softmax's
 *       denominator (max and sum) and takes no value row (GPT-OSS).
 *
 * These are what torch computes for the same ops (HF's rounding steps in bf16), except the
 * order of the sums (norm statistics, dot products) and exp / tanh, which are a polynomial
 * within a few ulp of float32's; attention keeps its scores and weights in float32 where SDPA's
 * bf16 path rounds the weights. Contractions into FMAs are off so that the elementwise float32
 * results are torch's own. Plain C, no torch headers; the caller checks shapes and strides.
 */
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif
#include <math.h>

#include "kernels.h"

/* exp(x) for float32, branch-free so loops of it vectorise: x = n ln2 + r, |r| <= ln2 / 2 (n
 * rounded to nearest by the 1.5 * 2^23 shift, no floorf: GCC vectorises that only with
 * -fno-trapping-math), exp(r) by its degree-6 Taylor polynomial, times 2^n built in the exponent
 * bits; below -87.3 it flushes to 0 and above 88.3 it saturates at exp(88.3) (2^n stays a
 * normal float). */
INLINE float exp_f32(float x) {
    float y = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
    float n = (y * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = y - n * 0.693145751953125f;
    r = r - n * 1.428606765330187e-06f;
    float p = 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x <= -87.3f ? 0.0f : p * scale;
}

INLINE float tanh_f32(float x) {
    /* tanh(x) = sign(x) (1 - 2 / (exp(2 |x|) + 1)); small |x| by its odd series, where the
     * difference from 1 would cancel */
    float a = fabsf(x);
    float e = exp_f32(2.0f * (a > 9.0f ? 9.0f : a));
    float big = 1.0f - 2.0f / (e + 1.0f);
    float x2 = x * x;
    float small = a * (1.0f + x2 * (-1.0f / 3.0f + x2 * (2.0f / 15.0f + x2 * (-17.0f / 315.0f))));
    float t = a < 0.04f ? small : big;
    return x < 0.0f ? -t : t;
}


/* ----------------------------------------------------------------------- residual + norm */

INLINE void add_norm_row(void *h, const void *delta, const void *w, int64_t D, float eps,
                         int mode, void *out, int e) {
    float acc[LANES] = {0};
    int64_t d = 0;
    if (delta) {
        for (int64_t i = 0; i < D; i++) st(h, i, e, ld(h, i, e) + ld(delta, i, e));
    }
    for (; d + LANES <= D; d += LANES)
        for (int l = 0; l < LANES; l++) {
            float v = ld(h, d + l, e);
            acc[l] += v * v;
        }
    float sum = 0.0f;
    for (; d < D; d++) {
        float v = ld(h, d, e);
        sum += v * v;
    }
    for (int l = 0; l < LANES; l++) sum += acc[l];
    float r = 1.0f / sqrtf(sum / (float)D + eps);
    if (mode == 1) {
        for (int64_t i = 0; i < D; i++) st(out, i, e, (ld(h, i, e) * r) * (1.0f + ld(w, i, e)));
    } else if (e == F32 || mode == 2) {
        for (int64_t i = 0; i < D; i++) st(out, i, e, (ld(h, i, e) * r) * ld(w, i, e));
    } else {
        for (int64_t i = 0; i < D; i++) st(out, i, e, ld(w, i, e) * rnd(ld(h, i, e) * r, e));
    }
}

int loraplex_add_rms_norm(void *h, int64_t h_stride, const void *delta, int64_t d_stride,
                          const void *w, int64_t T, int64_t D, float eps, int mode, void *out,
                          int64_t o_stride, int e, int threads) {
    int64_t esz = e == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        void *ht = (char *)h + t * h_stride * esz;
        const void *dt = delta ? (const char *)delta + t * d_stride * esz : NULL;
        void *ot = (char *)out + t * o_stride * esz;
        if (e == F32)
            add_norm_row(ht, dt, w, D, eps, mode, ot, F32);
        else
            add_norm_row(ht, dt, w, D, eps, mode, ot, BF16);
    }
    return 0;
}

/* --------------------------------------------------------------------------------- rotary */

INLINE void rotary_row(void *x, int64_t heads, int64_t hd, int64_t rd, const void *c,
                       const void *s, int e) {
    int64_t half = rd / 2;
    for (int64_t hh = 0; hh < heads; hh++) {
        int64_t o = hh * hd;
        for (int64_t i = 0; i < half; i++) {
            float a = ld(x, o + i, e), b = ld(x, o + i + half, e);
            float lo = rnd(rnd(a * ld(c, i, e), e) + rnd(-b * ld(s, i, e), e), e);
            float hi = rnd(rnd(b * ld(c, i + half, e), e) + rnd(a * ld(s, i + half, e), e), e);
            st(x, o + i, e, lo);
            st(x, o + i + half, e, hi);
        }
    }
}

int loraplex_rotary(void *x, int64_t x_stride, int64_t T, int64_t heads, int64_t hd, int64_t rd,
                    const void *cos, const void *sin, int64_t cs_stride, int e, int threads) {
    int64_t esz = e == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        void *xt = (char *)x + t * x_stride * esz;
        const void *ct = (const char *)cos + t * cs_stride * esz;
        const void *stt = (const char *)sin + t * cs_stride * esz;
        if (e == F32)
            rotary_row(xt, heads, hd, rd, ct, stt, F32);
        else
            rotary_row(xt, heads, hd, rd, ct, stt, BF16);
    }
    return 0;
}

/* ------------------------------------------------------------------------ gated activation */

INLINE void gated_row(const void *gu, int64_t I, int act, void *out, int e) {
    const char *up = (const char *)gu + I * (e == F32 ? 4 : 2);
    if (act == 0) {
        for (int64_t i = 0; i < I; i++) {
            float g = ld(gu, i, e);
            st(out, i, e, rnd(g / (1.0f + exp_f32(-g)), e) * ld(up, i, e));
        }
    } else {
        for (int64_t i = 0; i < I; i++) {
            float g = ld(gu, i, e);
            float inner = 0.7978845608028654f * (g + 0.044715f * (g * g * g));
            st(out, i, e, rnd(0.5f * g * (1.0f + tanh_f32(inner)), e) * ld(up, i, e));
        }
    }
}

int loraplex_gated_act(const void *gu, int64_t gu_stride, int64_t T, int64_t I, int act,
                       void *out, int64_t o_stride, int e, int threads) {
    int64_t esz = e == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && T > 1) schedule(static)
    for (int64_t t = 0; t < T; t++) {
        const void *g = (const char *)gu + t * gu_stride * esz;
        void *o = (char *)out + t * o_stride * esz;
        if (e == F32)
            gated_row(g, I, act, o, F32);
        else
            gated_row(g, I, act, o, BF16);
    }
    return 0;
}

/* ----------------------------------------------------------------------- decode attention */

/* Vectors of float32 for the attention's dot products and sums (kernels.h: AVX-512 or AVX2
 * where the build has them, 16 or 8 values), else scalar loops. */
#if defined(__AVX512F__)
/* the four sums of a0 .. a3 into out[0 .. 3], in one reduction tree */
INLINE void vsum4(vec a0, vec a1, vec a2, vec a3, float *out) {
    __m256 t0 = _mm256_add_ps(_mm512_castps512_ps256(a0), _mm512_extractf32x8_ps(a0, 1));
    __m256 t1 = _mm256_add_ps(_mm512_castps512_ps256(a1), _mm512_extractf32x8_ps(a1, 1));
    __m256 t2 = _mm256_add_ps(_mm512_castps512_ps256(a2), _mm512_extractf32x8_ps(a2, 1));
    __m256 t3 = _mm256_add_ps(_mm512_castps512_ps256(a3), _mm512_extractf32x8_ps(a3, 1));
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#elif HAVE_VEC
INLINE void vsum4(vec a0, vec a1, vec a2, vec a3, float *out) {
    __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}
#endif

/* The G scores of one key row: s[g * n] = dot(q[g], k) for g < G (q float32 [G, hd], k of
 * type e), k read once for every query head (four at a time in vectors). */
/* The scores of query heads q[0 .. M) (M <= 4, a constant where it is inlined) against k. */
INLINE void scores_tile(const float *__restrict q, const void *__restrict k, int64_t hd,
                        int64_t n, float *__restrict s, int M, int e) {
#if HAVE_VEC
    vec a[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
    for (int64_t d = 0; d < hd; d += VW) {
        vec kv = vload(k, d, e);
        for (int t = 0; t < M; t++) a[t] = VFMA(VLOAD(q + t * hd + d), kv, a[t]);
    }
    float sums[4];
    vsum4(a[0], a[1], a[2], a[3], sums);
    for (int t = 0; t < M; t++) s[t * n] = sums[t];
#else
    (void)q, (void)k, (void)hd, (void)n, (void)s, (void)M, (void)e;
#endif
}

INLINE void scores_row(const float *__restrict q, const void *__restrict k, int64_t G,
                       int64_t hd, int64_t n, float *__restrict s, int e) {
    int64_t g = 0;
#if HAVE_VEC
    if (hd % VW == 0) {
        for (; g + 4 <= G; g += 4) scores_tile(q + g * hd, k, hd, n, s + g * n, 4, e);
        switch (G - g) { /* the last tile's width, as a constant */
            case 3: scores_tile(q + g * hd, k, hd, n, s + g * n, 3, e); break;
            case 2: scores_tile(q + g * hd, k, hd, n, s + g * n, 2, e); break;
            case 1: scores_tile(q + g * hd, k, hd, n, s + g * n, 1, e); break;
        }
        return;
    }
#endif
    for (; g < G; g++) {
        float sum = 0.0f;
        for (int64_t d = 0; d < hd; d++) sum += q[g * hd + d] * ld(k, d, e);
        s[g * n] = sum;
    }
}

/* The weighted sum of the context's value rows: out[g] = rnd(sum_p w[g * n + p] * v_p) for
 * g < G, the rows v_p of positions [lo, len) found through the block table (``row``: bytes
 * from one slot's row to the next; v0: this KV head's row in slot 0). Each VW-value column
 * chunk is summed over every position in registers, four query heads at a time. */
/* Tile of M (<= 4, a constant where inlined) query heads, VW columns from d: out[t] =
 * rnd(sum_p w[t * n + p] * v_p[d .. d + VW)). */
INLINE void values_tile(const float *__restrict w, const char *__restrict v0,
                        const int64_t *table, int64_t lo, int64_t len, int64_t bs, int64_t row,
                        int64_t hd, int64_t n, int64_t d, void *out, int M, int e) {
#if HAVE_VEC
    vec a[4] = {VZERO(), VZERO(), VZERO(), VZERO()};
    for (int64_t p = lo; p < len;) {
        int64_t blk = p / bs, end = (blk + 1) * bs < len ? (blk + 1) * bs : len;
        const char *v = v0 + (table[blk] * bs + p - blk * bs) * row;
        for (; p < end; p++, v += row) {
            vec vv = vload(v, d, e);
            for (int t = 0; t < M; t++) a[t] = VFMA(VSET1(w[t * n + p - lo]), vv, a[t]);
        }
    }
    float buf[VW];
    for (int t = 0; t < M; t++) {
        VSTORE(buf, a[t]);
        for (int64_t l = 0; l < VW; l++) st(out, t * hd + d + l, e, buf[l]);
    }
#else
    (void)w, (void)v0, (void)table, (void)lo, (void)len, (void)bs, (void)row, (void)hd;
    (void)n, (void)d, (void)out, (void)M, (void)e;
#endif
}

/* The weighted sum of the context's value rows: out[g] = rnd(sum_p w[g * n + p] * v_p) for
 * g < G, the rows v_p of positions [lo, len) found through the block table (``row``: bytes
 * from one slot's row to the next; v0: this KV head's row in slot 0). Each VW-value column
 * chunk is summed over every position in registers, four query heads at a time. */
INLINE void weighted_values(const float *__restrict w, const char *__restrict v0,
                            const int64_t *table, int64_t lo, int64_t len, int64_t bs,
                            int64_t row, int64_t G, int64_t hd, int64_t n, void *out, int e) {
    int64_t d = 0;
#if HAVE_VEC
    int esz = e == F32 ? 4 : 2;
    for (; d + VW <= hd; d += VW) {
        int64_t g = 0;
        for (; g + 4 <= G; g += 4)
            values_tile(w + g * n, v0, table, lo, len, bs, row, hd, n, d,
                        (char *)out + g * hd * esz, 4, e);
        switch (G - g) {
            case 3: values_tile(w + g * n, v0, table, lo, len, bs, row, hd, n, d,
                                (char *)out + g * hd * esz, 3, e); break;
            case 2: values_tile(w + g * n, v0, table, lo, len, bs, row, hd, n, d,
                                (char *)out + g * hd * esz, 2, e); break;
            case 1: values_tile(w + g * n, v0, table, lo, len, bs, row, hd, n, d,
                                (char *)out + g * hd * esz, 1, e); break;
        }
    }
#endif
    for (; d < hd; d++)
        for (int64_t g = 0; g < G; g++) {
            float a = 0.0f;
            for (int64_t p = lo; p < len; p++) {
                int64_t blk = p / bs;
                a += w[g * n + p - lo] * ld(v0 + (table[blk] * bs + p - blk * bs) * row, d, e);
            }
            st(out, g * hd + d, e, a);
        }
}

/* One (decode row, KV head): its G query heads over the row's context. scratch: G * hd
 * (queries) + G * ctx (scores) floats. */
INLINE void attend_one(const void *q, const void *kc, const void *vc, const int64_t *table,
                       int64_t lo, int64_t len, int64_t bs, int64_t KVH, int64_t hd, int64_t G,
                       int64_t j, float scale, float cap, const float *sinks, void *out,
                       float *scratch, int e) {
    float *qf = scratch, *s = scratch + G * hd;
    int64_t n = len - lo;
    for (int64_t i = 0; i < G * hd; i++) qf[i] = ld(q, i, e);
    int64_t row = KVH * hd * (e == F32 ? 4 : 2), head = j * hd * (e == F32 ? 4 : 2);
    int64_t bytes = hd * (e == F32 ? 4 : 2);
    for (int64_t p = lo; p < len;) { /* block by block: no division per position */
        int64_t blk = p / bs, off = p - blk * bs, end = (blk + 1) * bs < len ? (blk + 1) * bs : len;
        int64_t at = (table[blk] * bs + off) * row + head;
        const char *k = (const char *)kc + at, *v = (const char *)vc + at;
        if (end < len) { /* the next block's keys: blocks are scattered, so no prefetcher */
            const char *nk = (const char *)kc + table[blk + 1] * bs * row + head;
            for (int64_t i = 0; i < bs && end + i < len; i++)
                for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(nk + i * row + c);
        }
        for (; p < end; p++, k += row, v += row) {
            for (int64_t c = 0; c < bytes; c += 64) __builtin_prefetch(v + c); /* for the sum */
            scores_row(qf, k, G, hd, n, s + p - lo, e);
        }
    }
    if (cap > 0.0f) /* two loops: in one, the compiler computes the tanh of every score */
        for (int64_t i = 0; i < G * n; i++) s[i] = tanh_f32(s[i] * scale / cap) * cap;
    else
        for (int64_t i = 0; i < G * n; i++) s[i] *= scale;
    for (int64_t g = 0; g < G; g++) {
        float *sg = s + g * n, m = sg[0], sum = 0.0f;
        for (int64_t i = 1; i < n; i++) m = sg[i] > m ? sg[i] : m;
        if (sinks) m = sinks[g] > m ? sinks[g] : m;
        for (int64_t i = 0; i < n; i++) {
            sg[i] = exp_f32(sg[i] - m);
            sum += sg[i];
        }
        if (sinks) sum += exp_f32(sinks[g] - m);
        float inv = 1.0f / sum;
        for (int64_t i = 0; i < n; i++) sg[i] *= inv;
    }
    weighted_values(s, (const char *)vc + head, table, lo, len, bs, row, G, hd, n, out, e);
}

int loraplex_decode_attention(const void *q, int64_t q_stride, const int64_t *rows, int64_t B,
                              int64_t H, int64_t KVH, int64_t hd, const void *kc,
                              const void *vc, const int64_t *block_table, int64_t nblk,
                              const int64_t *lens, int64_t bs, float scale, float cap,
                              int64_t window, void *out, int64_t o_stride, int e, int threads,
                              const float *sinks) {
    int64_t G = H / KVH, esz = e == F32 ? 4 : 2, ctx = nblk * bs;
    int64_t per = G * hd + G * ctx;
    int failed = 0;
#pragma omp parallel num_threads(threads) if (threads > 1 && B * KVH > 1)
    {
        float *scratch = (float *)malloc((size_t)per * sizeof(float));
        if (!scratch) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t bj = 0; bj < B * KVH; bj++) {
            if (!scratch) continue;
            int64_t b = bj / KVH, j = bj % KVH, row = rows ? rows[b] : b;
            int64_t len = lens[b];
            int64_t lo = window > 0 ? (len > window ? len - window : 0)
                         : window < 0 ? (len - 1) / -window * -window : 0;
            const void *qb = (const char *)q + (row * q_stride + j * G * hd) * esz;
            void *ob = (char *)out + (row * o_stride + j * G * hd) * esz;
            const int64_t *tb = block_table + b * nblk;
            const float *sk = sinks ? sinks + j * G : NULL; /* this KV head's G query heads' */
            if (e == F32)
                attend_one(qb, kc, vc, tb, lo, len, bs, KVH, hd, G, j, scale, cap, sk, ob,
                           scratch, F32);
            else
                attend_one(qb, kc, vc, tb, lo, len, bs, KVH, hd, G, j, scale, cap, sk, ob,
                           scratch, BF16);
        }
        free(scratch);
    }
    return failed ? -1 : 0;
}
