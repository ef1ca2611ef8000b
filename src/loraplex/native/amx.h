/* Intel AMX tiles for loraplex's C kernels: the tile configuration, the few tile operations
 * the kernels use, and a software model of them that runs anywhere.
 *
 *   HAVE_AMX_BF16   AMX-TILE + AMX-BF16 are compiled in: on hardware (the compiler targets them,
 *                   e.g. -march=native on a Xeon with AMX) or, built with
 *                   -DLORAPLEX_AMX_EMULATE, through the software model below (AMX_EMULATED 1)
 *   amx_config(rows_a, rows_b)
 *                   palette 1 with tile 0 = A [rows_a, 64 B], tiles 1, 2 = B [rows_b, 64 B],
 *                   tiles 3, 4 = C [rows_a, 64 B] (the only shape the kernels use)
 *   HAVE_AMX_INT8   AMX-INT8 too (the model has it whenever it has AMX-BF16)
 *   TILE_LOAD(t, ptr, stride) / TILE_STORE(t, ptr, stride) / TILE_ZERO(t) /
 *   TILE_DPBF16(c, a, b) / TILE_DPBSUD(c, a, b) / TILE_RELEASE()
 *                   _tile_loadd / _tile_stored / _tile_zero / _tile_dpbf16ps / _tile_dpbsud
 *                   (AMX-INT8 only) / _tile_release
 *   amx_enable()    0 where the OS lets this process use the tiles' data (Linux asks for it
 *                   once per process: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA), else -1
 *
 * TDPBF16PS, as Intel's SDM defines it (and the model computes it, in float32):
 *
 *     for m < C.rows, n < C.colsb / 4, k < A.colsb / 4:
 *         C[m].f32[n] += A[m].bf16[2k] * B[k].bf16[2n] + A[m].bf16[2k + 1] * B[k].bf16[2n + 1]
 *
 * so B holds, per row k, the pairs of inputs (2k, 2k + 1) of 16 output columns: the layout of
 * the bf16 pairs AVX512-BF16's dot product reads (quant_gemm.c's panels make them). TDPBSUD,
 * exact in int32, the same with quads of signed bytes of A and unsigned bytes of B:
 *
 *     C[m].i32[n] += sum_{i < 4} A[m].s8[4k + i] * B[k].u8[4n + i]
 *
 * The model checks what the hardware would fault on (a tile used beyond its configured rows
 * or bytes, operands of mismatched shapes, a reserved byte set in the configuration) and
 * counts it in amx_faults instead, so a test of an emulated build sees a kernel's misuse of
 * the tiles without the hardware. */
#ifndef LORAPLEX_AMX_H
#define LORAPLEX_AMX_H

#include "kernels.h"

#if defined(LORAPLEX_AMX_EMULATE)
#define HAVE_AMX_BF16 1
#define HAVE_AMX_INT8 1
#define AMX_EMULATED 1
#elif defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define HAVE_AMX_BF16 1
#define AMX_EMULATED 0
#if defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#else
#define HAVE_AMX_INT8 0
#endif
#else
#define HAVE_AMX_BF16 0
#define HAVE_AMX_INT8 0
#define AMX_EMULATED 0
#endif

#if HAVE_AMX_BF16

/* LDTILECFG's 64-byte operand (palette 1: 8 tiles of at most 16 rows of 64 bytes). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

#if AMX_EMULATED

static __thread amx_tilecfg amx_cfg;
static __thread uint8_t amx_tile[8][16][64];
static int amx_faults; /* misuses seen by the model (read by loraplex_*_amx_faults) */

INLINE void amx_fault(void) { __atomic_add_fetch(&amx_faults, 1, __ATOMIC_RELAXED); }

static void amx_emu_config(const amx_tilecfg *c) {
    for (int i = 0; i < 14; i++)
        if (c->reserved[i]) amx_fault();
    if (c->palette != 1 || c->start_row) amx_fault();
    for (int t = 0; t < 16; t++)
        if ((t >= 8 && (c->rows[t] || c->colsb[t])) || c->rows[t] > 16 || c->colsb[t] > 64)
            amx_fault();
    amx_cfg = *c;
    memset(amx_tile, 0, sizeof amx_tile);
}

static void amx_emu_load(int t, const void *p, int64_t stride) {
    const uint8_t *src = (const uint8_t *)p;
    if (!amx_cfg.palette) amx_fault();
    memset(amx_tile[t], 0, sizeof amx_tile[t]);
    for (int r = 0; r < amx_cfg.rows[t]; r++) memcpy(amx_tile[t][r], src + r * stride, amx_cfg.colsb[t]);
}

static void amx_emu_store(int t, void *p, int64_t stride) {
    uint8_t *dst = (uint8_t *)p;
    if (!amx_cfg.palette) amx_fault();
    for (int r = 0; r < amx_cfg.rows[t]; r++) memcpy(dst + r * stride, amx_tile[t][r], amx_cfg.colsb[t]);
}

static void amx_emu_dpbf16(int c, int a, int b) {
    int rows = amx_cfg.rows[c], cols = amx_cfg.colsb[c] / 4, ks = amx_cfg.colsb[a] / 4;
    if (!amx_cfg.palette || amx_cfg.rows[a] != rows || amx_cfg.rows[b] != ks ||
        amx_cfg.colsb[b] != amx_cfg.colsb[c] || c == a || c == b || a == b)
        amx_fault();
    for (int m = 0; m < rows; m++) {
        float *acc = (float *)amx_tile[c][m];
        const uint16_t *ar = (const uint16_t *)amx_tile[a][m];
        for (int k = 0; k < ks; k++) {
            const uint16_t *br = (const uint16_t *)amx_tile[b][k];
            for (int n = 0; n < cols; n++)
                acc[n] += bf16_to_f32(ar[2 * k]) * bf16_to_f32(br[2 * n]) +
                          bf16_to_f32(ar[2 * k + 1]) * bf16_to_f32(br[2 * n + 1]);
        }
    }
}

static void amx_emu_dpbsud(int c, int a, int b) {
    int rows = amx_cfg.rows[c], cols = amx_cfg.colsb[c] / 4, ks = amx_cfg.colsb[a] / 4;
    if (!amx_cfg.palette || amx_cfg.rows[a] != rows || amx_cfg.rows[b] != ks ||
        amx_cfg.colsb[b] != amx_cfg.colsb[c] || c == a || c == b || a == b)
        amx_fault();
    for (int m = 0; m < rows; m++) {
        int32_t *acc = (int32_t *)amx_tile[c][m];
        const int8_t *ar = (const int8_t *)amx_tile[a][m];
        for (int k = 0; k < ks; k++) {
            const uint8_t *br = amx_tile[b][k];
            for (int n = 0; n < cols; n++)
                for (int i = 0; i < 4; i++) acc[n] += (int32_t)ar[4 * k + i] * br[4 * n + i];
        }
    }
}

#define TILE_CONFIG(c) amx_emu_config(c)
#define TILE_ZERO(t) memset(amx_tile[t], 0, sizeof amx_tile[t])
#define TILE_DPBSUD(c, a, b) amx_emu_dpbsud(c, a, b)
#define TILE_LOAD(t, p, s) amx_emu_load(t, p, s)
#define TILE_STORE(t, p, s) amx_emu_store(t, p, s)
#define TILE_DPBF16(c, a, b) amx_emu_dpbf16(c, a, b)
#define TILE_RELEASE() memset(&amx_cfg, 0, sizeof amx_cfg)

static int amx_enable(void) { return 0; }

#else /* the hardware */

#include <sys/syscall.h>
#include <unistd.h>

#define TILE_CONFIG(c) _tile_loadconfig(c)
#define TILE_ZERO(t) _tile_zero(t)
#define TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#define TILE_LOAD(t, p, s) _tile_loadd(t, p, s)
#define TILE_STORE(t, p, s) _tile_stored(t, p, s)
#define TILE_DPBF16(c, a, b) _tile_dpbf16ps(c, a, b)
#define TILE_RELEASE() _tile_release()

static int amx_enable(void) {
#if defined(__linux__) && defined(SYS_arch_prctl)
    /* ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA (asm/prctl.h; not in every libc's headers) */
    return syscall(SYS_arch_prctl, 0x1023, 18) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

#endif

static void amx_config(int rows_a, int rows_b) {
    amx_tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int t = 0; t < 5; t++) {
        c.colsb[t] = 64;
        c.rows[t] = (uint8_t)(t == 1 || t == 2 ? rows_b : rows_a);
    }
    TILE_CONFIG(&c);
}

#endif /* HAVE_AMX_BF16 */
#endif /* LORAPLEX_AMX_H */
