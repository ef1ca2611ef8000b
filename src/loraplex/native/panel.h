/* The column panels the dense (panel_gemm.c) and the quantized (quant_gemm.c) panel GEMMs share:
 * a weight's output columns in panels of NR = 2 * VW (kernels.h: 32 with AVX-512, 16 with AVX2),
 * each panel's sums for a row of x kept in NR floats and written out by store_row. */
#ifndef LORAPLEX_PANEL_H
#define LORAPLEX_PANEL_H

#include "kernels.h"

#define NR (2 * VW)

/* y[t, n0 + c] = rnd(acc[c] + bias[n0 + c]) (bias NULL: 0) for the columns c < NR of the panel
 * from n0 that lie below N, rounded to y's element type e. */
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

#endif /* LORAPLEX_PANEL_H */
