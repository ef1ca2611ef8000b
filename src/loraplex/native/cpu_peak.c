/* The CPU's arithmetic peak for the products a decode step's GEMMs run or could run
 * (loraplex.tools.bench.cpu_peak): float32 FMAs, AVX512-BF16 pair dot products, and AVX512-VNNI
 * u8 x s8 quad dot products (what a W4A8 / W8A8 kernel would run), 512-bit where the build
 * has AVX-512 (256-bit FMAs with AVX2), on independent accumulators so that throughput,
 * not latency, bounds the loop. Returns the seconds of `iters` iterations of `threads` threads
 * (each iteration: ACC vector operations per thread), or -1 for a product this build lacks. */
#include <stdint.h>
#include <time.h>
#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#define ACC 12

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* kind 0: float32 FMA, 1: bf16 pair dot, 2: int8 quad dot; lanes: 32-bit lanes per vector */
double loraplex_cpu_peak(int kind, int64_t iters, int threads, int *lanes, float *sink) {
    double t0 = now();
    int ok = 1;
#pragma omp parallel num_threads(threads)
    {
        float s = 0.0f;
#if defined(__AVX512F__)
        __m512 a[ACC];
        for (int j = 0; j < ACC; j++) a[j] = _mm512_setzero_ps();
        __m512 u = _mm512_set1_ps(1e-9f);
        if (kind == 0) {
            for (int64_t i = 0; i < iters; i++) {
                for (int j = 0; j < ACC; j++) a[j] = _mm512_fmadd_ps(a[j], u, u);
                __asm__ volatile("" : "+v"(u));
            }
        }
#if defined(__AVX512VNNI__)
        else if (kind == 2) {
            __m512i c[ACC];
            for (int j = 0; j < ACC; j++) c[j] = _mm512_setzero_si512();
            __m512i x = _mm512_set1_epi8(1);
            for (int64_t i = 0; i < iters; i++) {
                for (int j = 0; j < ACC; j++) c[j] = _mm512_dpbusd_epi32(c[j], x, x);
                __asm__ volatile("" : "+v"(x));
            }
            for (int j = 0; j < ACC; j++) s += (float)_mm512_reduce_add_epi32(c[j]);
        }
#else
        else if (kind == 2) ok = 0;
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
        else {
            __m512bh x = (__m512bh)_mm512_set1_epi16(0x3f80);
            for (int64_t i = 0; i < iters; i++) {
                for (int j = 0; j < ACC; j++) a[j] = _mm512_dpbf16_ps(a[j], x, x);
                __asm__ volatile("" : "+v"(x));
            }
        }
#else
        else ok = 0;
#endif
        for (int j = 0; j < ACC; j++) s += _mm512_reduce_add_ps(a[j]);
#elif defined(__AVX2__) && defined(__FMA__)
        __m256 a[ACC];
        for (int j = 0; j < ACC; j++) a[j] = _mm256_setzero_ps();
        __m256 u = _mm256_set1_ps(1e-9f);
        if (kind == 0) {
            for (int64_t i = 0; i < iters; i++) {
                for (int j = 0; j < ACC; j++) a[j] = _mm256_fmadd_ps(a[j], u, u);
                __asm__ volatile("" : "+x"(u));
            }
        } else ok = 0;
        float buf[8];
        for (int j = 0; j < ACC; j++) {
            _mm256_storeu_ps(buf, a[j]);
            for (int l = 0; l < 8; l++) s += buf[l];
        }
#else
        ok = 0;
#endif
#pragma omp critical
        *sink += s;
    }
#if defined(__AVX512F__)
    *lanes = 16;
#else
    *lanes = 8;
#endif
    return ok ? now() - t0 : -1.0;
}
