/* Quantized GEMV: int8 activation blocks times q4 / q8 weight blocks, integer multiply-accumulate
 * per block of 32, one float multiply-add per block.
 *
 * The instruction set is chosen at compile time from the compiler's target macros (build.py
 * compiles this file once per variant with that variant's -m flags):
 *   avx512   AVX-512 VL + VNNI: vpdpbusd on 256-bit registers, and for q4, q8, Q4_K, Q6_K (and Q5_0 at M > 1) on
 *            512-bit ones taking two 8-row groups at once (16 rows, one broadcast activation dword for all of them)
 *   avxvnni  AVX2 + AVX-VNNI: the same vpdpbusd, VEX-encoded
 *   avx2     AVX2 + FMA + F16C: vpmaddubsw + vpmaddwd
 *   neon-dotprod  ARMv8.2 sdot (vdotq_s32)
 *   neon     ARMv8 NEON widening multiplies (vmull_s8 / vpadalq_s16)
 *   scalar   portable C (also forced by -DEL_SCALAR, so an aarch64 build can have one)
 *
 * Weights come in groups of 8 rows (el_block_q4x8 / el_block_q8x8): one 32-byte vector of a block
 * holds 4 quants of each row, so an integer dot-product instruction against one broadcast dword of
 * activations leaves each row's partial sum in its own 32-bit lane, and a block's scales are applied
 * to the 8 rows with one vector multiply-add.
 *
 * Signedness: q4 weights are 0..15 and act as the unsigned operand of vpdpbusd / vpmaddubsw. q8
 * weights are signed: with VNNI they are offset by 128 (unsigned) and 128 * sum(x) is taken off
 * in the float step; without it |w| (unsigned) multiplies x * sign(w) (signed). Activation quants
 * are in -127..127 (never -128), so no product or pair sum overflows int16. */
#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"

#include "arch/isa.h"

const char *el_variant(void) {
#if defined(EL_AVX512)
    return "avx512";
#elif defined(EL_AVXVNNI)
    return "avxvnni";
#elif defined(EL_AVX2)
    return "avx2";
#elif defined(EL_DOTPROD)
    return "neon-dotprod";
#elif defined(EL_NEON)
    return "neon";
#else
    return "scalar";
#endif
}

/* Software prefetch of every cache line of a block, this many bytes ahead in the weight stream: the
 * hardware prefetchers alone left a 85 MB matrix (Qwen's lm_head) at 2-6 GB/s per core. One prefetch
 * per block reached only one of the 2.5 lines of a 160-byte q4 block (4.25 of a q8 one); prefetching
 * them all, 8 KiB ahead, made the whole native decode step 1.16x (Qwen2.5-0.5B q4, median of 10
 * alternated rounds) and 1.20x (SmolLM2 q4) faster than one line 4 KiB ahead, 1 thread, and 1.14x for
 * Qwen at 2 threads; of 2, 4, 8, 12 and 16 KiB ahead, 8 measured best.
 * EL_PF_LOC is the locality hint: on x86 2 (prefetcht1, into L2), not 3 (prefetcht0, into L1): a burst of 27
 * L1 prefetches per 1680-byte Q6_K group left that format streaming at the rate of no prefetch at all
 * (docs/kernels.md, "Prefetch locality"). */
#ifndef EL_PREFETCH
#define EL_PREFETCH 8192
#endif
#ifndef EL_PF_LOC
#if defined(EL_AVX512) || defined(EL_AVX2)
#define EL_PF_LOC 2
#else
#define EL_PF_LOC 3
#endif
#endif
static inline void el_prefetch_span(const char *a, unsigned n) {
    for (unsigned o = 0; o < n; o += 64) __builtin_prefetch(a + o, 0, EL_PF_LOC);
}
#define EL_PREFETCH_AHEAD(p) el_prefetch_span((const char *)(p) + EL_PREFETCH, sizeof(*(p)))

/* A tile of at most EL_TILE activation rows shares each unpacked weight block. x86: 8 (the unpack of a Q5_0 or K-quant
 * block costs about as much as two rows' dot products, and spilling a tile's accumulators costs less; docs/kernels.md). */
#if defined(EL_AVX512) || defined(EL_AVX2)
#define EL_TILE 8
#else
#define EL_TILE 4
#endif

/* ------------------------------------------------------------------------ the per-ISA bodies (arch/) */

/* Each defines group_q4 and group_q8; the x86 and NEON ones also the GGUF blocks held exactly (EL_HAVE_SIMD_EXACT:
 * q5_0, q4_k, q6_k; EL_HAVE_SIMD_KQUANTS: q5_1, q2_k, q3_k, q5_k; EL_HAVE_SIMD_4BIT: q4_0, iq4_nl), which the scalar
 * build takes from portable C. */
#if defined(EL_AVX512) || defined(EL_AVX2)
#include "arch/x86/gemv.inc"
#include "arch/x86/gemv_kquants.inc"
#include "arch/x86/gemv_4bit.inc"
#define EL_HAVE_SIMD_KQUANTS 1
#elif defined(EL_NEON)
#include "arch/arm/gemv.inc"
#include "arch/arm/gemv_gguf.inc"
#include "arch/arm/gemv_4bit.inc"
#else
#include "arch/portable/gemv.inc"
#endif
#if !defined(EL_HAVE_SIMD_EXACT)
#include "arch/portable/gemv_gguf.inc"
#endif
#if !defined(EL_HAVE_SIMD_KQUANTS)
#include "arch/portable/gemv_kquants.inc"
#endif
#if !defined(EL_HAVE_SIMD_4BIT)
#include "arch/portable/gemv_4bit.inc"
#endif

/* ------------------------------------------------------------------------ GEMV / GEMM */

/* Where the variant has them (EL_HAVE_PAIR: AVX-512), two row groups at a time, then the odd group alone. */
void el_gemm_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    int r = r0;
#if defined(EL_HAVE_PAIR)
    for (; r + 2 * EL_ROWS <= r1; r += 2 * EL_ROWS) pair_q4(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
#endif
    for (; r < r1; r += EL_ROWS) group_q4(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
}

void el_gemm_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    int r = r0;
#if defined(EL_HAVE_PAIR)
    for (; r + 2 * EL_ROWS <= r1; r += 2 * EL_ROWS) pair_q8(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
#endif
    for (; r < r1; r += EL_ROWS) group_q8(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
}

void el_gemv_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q4(w, k, x, 1, y, 0, r0, r1);
}

void el_gemv_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q8(w, k, x, 1, y, 0, r0, r1);
}

/* Rows per batch of the activation sums Q6_K, Q3_K and Q2_K take (bsum, on the stack): K / 16 per row. */
#define EL_BSUM_STACK 4096

/* The formats whose kernels take the activation quants' sums per 16: Q6_K's and Q3_K's offsets, Q2_K's mins. */
static int takes_bsum(int fmt) { return fmt == EL_Q6_K || fmt == EL_Q3_K || fmt == EL_Q2_K; }

static void group_bsum(int fmt, const void *g, int nb, const el_block_q8a *x, const int32_t *bsum, int m, float *y,
                       int ldy) {
    if (fmt == EL_Q6_K) group_q6_k(g, nb, x, bsum, m, y, ldy);
    else if (fmt == EL_Q3_K) group_q3_k(g, nb, x, bsum, m, y, ldy);
    else group_q2_k(g, nb, x, bsum, m, y, ldy);
}

/* out[2 b], out[2 b + 1]: the sums of the first and second 16 quants of activation block b, for n blocks. */
static void sums16(const el_block_q8a *x, int n, int32_t *out) {
    for (int i = 0; i < n; i++) {
        const int8_t *q = x[i].qs;
        int a = 0, c = 0;
        for (int j = 0; j < 16; j++) a += q[j], c += q[16 + j];
        out[2 * i] = a, out[2 * i + 1] = c;
    }
}

#if defined(EL_HAVE_PAIR)
/* Whether one activation row takes Q6_K's 16-row zmm kernel (pair_q6_k) rather than the 8-row one (group_q6_k; the same
 * bits either way): not where a zmm operation runs as two halves (Zen 4), on which the 8-row kernel measured 0.76x
 * the pair's time per call and the 1B shape's whole decode step 1.10x faster (docs/kernels.md). EDGELLM_Q6K_PAIRS=1
 * or 0 decides instead (to compare them, and for the tests); read once per process. */
static int q6_k_pairs_one_row(void) {
    static atomic_int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        const char *env = getenv("EDGELLM_Q6K_PAIRS");
        v = env && (!strcmp(env, "0") || !strcmp(env, "1")) ? env[0] == '1' : !el_cpu_splits_zmm();
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}
#endif

void el_gemm_fmt(int fmt, const void *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int bk = el_fmt_block_k(fmt), nb = k / bk, nbx = k / EL_QK;
    const size_t gsize = el_fmt_group_bytes(fmt) * (size_t)nb;
    if (fmt == EL_Q4) { el_gemm_q4(w, k, x, m, y, ldy, r0, r1); return; }
    if (fmt == EL_Q8) { el_gemm_q8(w, k, x, m, y, ldy, r0, r1); return; }
    if (takes_bsum(fmt)) {
        int32_t bsum[EL_BSUM_STACK];
        const int per = 2 * nbx <= EL_BSUM_STACK ? EL_BSUM_STACK / (2 * nbx) : 1;
        for (int i0 = 0; i0 < m; i0 += per) {
            const int mt = m - i0 < per ? m - i0 : per;
            const int32_t *bs = NULL;
            if (2 * nbx <= EL_BSUM_STACK) {
                sums16(x + (size_t)i0 * nbx, mt * nbx, bsum);
                bs = bsum;
            }
            int r = r0;
#if defined(EL_HAVE_PAIR)
            if (fmt == EL_Q6_K && bs && (mt > 1 || q6_k_pairs_one_row()))
                for (; r + 2 * EL_ROWS <= r1; r += 2 * EL_ROWS) {
                    const el_block_q6_kx8 *gp = (const el_block_q6_kx8 *)((const char *)w + (size_t)(r / EL_ROWS) * gsize);
                    if (mt == 1) pair_q6_k(gp, nb, x + (size_t)i0 * nbx, bs, y + (size_t)i0 * ldy + r);
                    else pair_q6_k_rows(gp, nb, x + (size_t)i0 * nbx, bs, mt, y + (size_t)i0 * ldy + r, ldy);
                }
#endif
            for (; r < r1; r += EL_ROWS) {
                const void *g = (const char *)w + (size_t)(r / EL_ROWS) * gsize;
                if (!bs) { /* K > 16 * EL_BSUM_STACK / 2: one row at a time, its sums on the heap */
                    int32_t *row = malloc((size_t)2 * nbx * sizeof *row);
                    for (int i = 0; row && i < mt; i++) {
                        sums16(x + (size_t)(i0 + i) * nbx, nbx, row);
                        group_bsum(fmt, g, nb, x + (size_t)(i0 + i) * nbx, row, 1, y + (size_t)(i0 + i) * ldy + r, ldy);
                    }
                    free(row);
                    continue;
                }
                group_bsum(fmt, g, nb, x + (size_t)i0 * nbx, bs, mt, y + (size_t)i0 * ldy + r, ldy);
            }
        }
        return;
    }
    int r = r0;
#if defined(EL_HAVE_PAIR)
    if (fmt == EL_Q4_K)
        for (; r + 2 * EL_ROWS <= r1; r += 2 * EL_ROWS)
            pair_q4_k((const el_block_q4_kx8 *)((const char *)w + (size_t)(r / EL_ROWS) * gsize), nb, x, m, y + r, ldy);
    else if (fmt == EL_Q5_0 && m > 1)
        for (; r + 2 * EL_ROWS <= r1; r += 2 * EL_ROWS)
            pair_q5_0((const el_block_q5_0x8 *)((const char *)w + (size_t)(r / EL_ROWS) * gsize), nb, x, m, y + r, ldy);
#endif
    for (; r < r1; r += EL_ROWS) {
        const void *g = (const char *)w + (size_t)(r / EL_ROWS) * gsize;
        if (fmt == EL_Q4_0) group_q4_0(g, nb, x, m, y + r, ldy);
        else if (fmt == EL_IQ4_NL) group_iq4_nl(g, nb, x, m, y + r, ldy);
        else if (fmt == EL_Q5_0) group_q5_0(g, nb, x, m, y + r, ldy);
        else if (fmt == EL_Q5_1) group_q5_1(g, nb, x, m, y + r, ldy);
        else if (fmt == EL_Q5_K) group_q5_k(g, nb, x, m, y + r, ldy);
        else group_q4_k(g, nb, x, m, y + r, ldy);
    }
}
