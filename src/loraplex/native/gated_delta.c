/* The gated delta rule's decode step over the state pages, one call for all decode rows
 * (loraplex.model.gated_delta_cpu). Semantics (element type E = float32 or bfloat16 for the
 * in-projection rows, convolution weights and windows; rnd(v): v rounded to E, to nearest
 * even; the recurrent state and every other value float32), for each row b and key head hk:
 *
 *   for each channel c of hk's q and k, and of each of its value heads' v (G = Hv / Hk value
 *   heads per key head, value head h = hk * G + j):
 *       win = [conv[src[b], c, 0 .. K-2], x[b, c]]
 *       y[c] = rnd(silu(rnd(sum_i win[i] * w[c, i])))
 *       conv[dst[b], c] = win[1 ..]
 *   q = y_q / sqrt(sum y_q^2 + 1e-6) * dk^-0.5;  k = y_k / sqrt(sum y_k^2 + 1e-6)
 *   for each value head h of hk:
 *       S = exp(g[b, h]) * rec[src[b], h]                  [dk, dv]
 *       delta = beta[b, h] * (y_v - k^T S)
 *       S = S + k delta^T;  rec[dst[b], h] = S;  out[b, h] = q^T S
 *
 * which is what the torch backend computes (TorchDeltaRule.decode), except the order of the
 * sums and silu's exp. A row's source and destination are the same page while it stays in its
 * block: each channel's window and each head's state are read whole before they are written,
 * by the one thread that owns (b, hk). Rows run in parallel over (b, hk). Plain C, no torch
 * headers; the caller checks shapes and strides (windows and state pages contiguous within a
 * page, x rows of unit stride).
 */
#include <math.h>

#include "kernels.h"

/* y[i] for channels c0 .. c0 + n of row x, window page src -> dst (module comment) */
static void conv_silu(const void *x, const void *w, const void *src, void *dst, int64_t c0,
                      int64_t n, int64_t K, int e, float *y) {
    float win[16];
    for (int64_t i = 0; i < n; i++) {
        int64_t c = c0 + i;
        for (int64_t t = 0; t < K - 1; t++) win[t] = ld(src, c * (K - 1) + t, e);
        win[K - 1] = ld(x, c, e);
        float acc = 0.0f;
        for (int64_t t = 0; t < K; t++) acc += win[t] * ld(w, c * K + t, e);
        float a = rnd(acc, e);
        y[i] = rnd(a / (1.0f + expf(-a)), e);
        for (int64_t t = 0; t < K - 1; t++) st(dst, c * (K - 1) + t, e, win[t + 1]);
    }
}

static void l2norm(float *v, int64_t n, float scale) {
    float ss = 0.0f;
    for (int64_t i = 0; i < n; i++) ss += v[i] * v[i];
    float r = scale / sqrtf(ss + 1e-6f);
    for (int64_t i = 0; i < n; i++) v[i] *= r;
}

/* x [B, C] (row stride xs), w [C, K], g / beta [B, Hv] (row strides gs, bs), src / dst [B]
 * page ids, conv [P, C, K-1] (page stride cps), rec [P, Hv, dk, dv] (page stride rps), out
 * [B, Hv, dv]. Returns 0, or -1 (nothing done) when a size is out of the kernel's range: K > 16,
 * dk or dv > 1024. */
int loraplex_gdn_decode(const void *x, int64_t xs, int e, const void *w, const float *g,
                        int64_t gs, const float *beta, int64_t bs, const int64_t *src,
                        const int64_t *dst, void *conv, int64_t cps, float *rec, int64_t rps,
                        float *out, int64_t B, int64_t Hk, int64_t Hv, int64_t dk, int64_t dv,
                        int64_t K, int threads) {
    if (K > 16 || dk > 1024 || dv > 1024) return -1;
    const int64_t G = Hv / Hk, esz = e == F32 ? 4 : 2;
#pragma omp parallel for num_threads(threads) if (threads > 1 && B * Hk > 1) schedule(static)
    for (int64_t item = 0; item < B * Hk; item++) {
        const int64_t b = item / Hk, hk = item % Hk;
        float q[1024], k[1024], v[1024], kv[1024], o[1024];
        const char *xb = (const char *)x + b * xs * esz;
        const char *wsrc = (const char *)conv + src[b] * cps * esz;
        char *wdst = (char *)conv + dst[b] * cps * esz;
        conv_silu(xb, w, wsrc, wdst, hk * dk, dk, K, e, q);
        conv_silu(xb, w, wsrc, wdst, Hk * dk + hk * dk, dk, K, e, k);
        l2norm(q, dk, 1.0f / sqrtf((float)dk));
        l2norm(k, dk, 1.0f);
        for (int64_t j = 0; j < G; j++) {
            const int64_t h = hk * G + j;
            conv_silu(xb, w, wsrc, wdst, 2 * Hk * dk + h * dv, dv, K, e, v);
            const float decay = expf(g[b * gs + h]), bt = beta[b * bs + h];
            const float *S = rec + src[b] * rps + h * dk * dv;
            float *D = rec + dst[b] * rps + h * dk * dv;
            for (int64_t c = 0; c < dv; c++) kv[c] = 0.0f;
            for (int64_t i = 0; i < dk; i++) {  /* kv = k^T (decay S) */
                const float ki = k[i];
                for (int64_t c = 0; c < dv; c++) kv[c] += (S[i * dv + c] * decay) * ki;
            }
            for (int64_t c = 0; c < dv; c++) {
                v[c] = (v[c] - kv[c]) * bt;  /* delta */
                o[c] = 0.0f;
            }
            for (int64_t i = 0; i < dk; i++) {  /* S = decay S + k delta^T; o = q^T S */
                const float ki = k[i], qi = q[i];
                for (int64_t c = 0; c < dv; c++) {
                    const float s = S[i * dv + c] * decay + ki * v[c];
                    D[i * dv + c] = s;
                    o[c] += s * qi;
                }
            }
            memcpy(out + (b * Hv + h) * dv, o, (size_t)dv * sizeof(float));
        }
    }
    return 0;
}
