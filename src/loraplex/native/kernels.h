/* What loraplex's C kernels share (each .c of loraplex/native that includes it; the build key
 * of a kernel covers the bytes of every header it includes, so a change here rebuilds them all).
 *
 *   F32, BF16       element type codes (loraplex.native.build.ELEMENT_TYPES)
 *   bf16_to_f32     exact;  f32_to_bf16 (and f32_to_bf16_select, branch-free): rounded to
 *                   nearest even, a NaN stays a quiet NaN (torch's rounding); row_to_f32: a
 *                   row of either type as float32; ld / st: element i of either type as /
 *                   from float32, rnd: a float32 rounded through the element type
 *   HAVE_AVX512     AVX-512 F + BW;  HAVE_DPBF16: AVX512-BF16 pair dot products;
 *                   HAVE_VNNI: AVX512-VNNI u8 x s8 quad dot products
 *   HAVE_VEC        float32 vectors of VW lanes (16: AVX-512, 8: AVX2 + FMA), as the type vec
 *                   with VZERO, VLOAD, VSTORE, VSET1, VFMA and vload (VW values of either
 *                   element type as float32); without vectors VW is 8 (a layout's width stays
 *                   defined) and none of these exist
 *   LANES           the partial sums of a fixed-order float32 reduction (vectorisable without
 *                   fast-math)
 *   INLINE          static inline, always inlined
 *
 * Plain C, no torch headers. */
#ifndef LORAPLEX_KERNELS_H
#define LORAPLEX_KERNELS_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

enum { F32 = 0, BF16 = 1 };
#define LANES 16
#define INLINE static inline __attribute__((always_inline))

#if defined(__AVX512F__) && defined(__AVX512BW__)
#define HAVE_AVX512 1
#else
#define HAVE_AVX512 0
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_DPBF16 1
#else
#define HAVE_DPBF16 0
#endif
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

INLINE float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

INLINE uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* f32_to_bf16 without a branch: the same bits, but GCC compiles the loops around the two
 * differently. layer_ops.c was written with this one (its elementwise loops vectorise with
 * it); the LoRA kernel (lora.c) runs 1.4 to 2.7 times slower with it than with the branching
 * one (Zen 4, GCC 12), so each kernel keeps the spelling it was tuned with. */
INLINE uint16_t f32_to_bf16_select(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint32_t r = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (uint16_t)((u & 0x7fffffffu) > 0x7f800000u ? ((u >> 16) | 0x40u) : r); /* NaN: quiet */
}

INLINE float ld(const void *p, int64_t i, int e) {
    return e == F32 ? ((const float *)p)[i] : bf16_to_f32(((const uint16_t *)p)[i]);
}

INLINE void st(void *p, int64_t i, int e, float v) {
    if (e == F32)
        ((float *)p)[i] = v;
    else
        ((uint16_t *)p)[i] = f32_to_bf16_select(v);
}

INLINE float rnd(float v, int e) { return e == F32 ? v : bf16_to_f32(f32_to_bf16_select(v)); }

/* dst[i] = src[i] as float32 for i < n, src of element type e */
static inline void row_to_f32(const void *src, int e, int64_t n, float *dst) {
    if (e == F32) {
        memcpy(dst, src, (size_t)n * sizeof(float));
    } else {
        const uint16_t *s = (const uint16_t *)src;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(s[i]);
    }
}

#if defined(__AVX512F__)
#define HAVE_VEC 1
#define VW 16
typedef __m512 vec;
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VSTORE(p, v) _mm512_storeu_ps(p, v)
#define VSET1(x) _mm512_set1_ps(x)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
/* p[i .. i + VW) of element type e as float32 */
INLINE vec vload(const void *p, int64_t i, int e) {
    if (e == F32) return _mm512_loadu_ps((const float *)p + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#elif defined(__AVX2__) && defined(__FMA__)
#define HAVE_VEC 1
#define VW 8
typedef __m256 vec;
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VSTORE(p, v) _mm256_storeu_ps(p, v)
#define VSET1(x) _mm256_set1_ps(x)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
INLINE vec vload(const void *p, int64_t i, int e) {
    if (e == F32) return _mm256_loadu_ps((const float *)p + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#else
#define HAVE_VEC 0
#define VW 8
#endif

#endif /* LORAPLEX_KERNELS_H */
