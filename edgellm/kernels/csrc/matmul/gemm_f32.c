/* Prefill's portable matmul: y[M, N] = x[M, K] @ W.T with float32 operands and float32 sums, written once with
 * vec.h's 8-lane vector extensions, so that every variant's flags turn it into AVX2 + FMA, NEON or SSE2 code.
 *
 * A work item is a tile of up to NT (32) weight rows and a block of activation rows. Its weights are dequantized
 * exactly (d * q + m in float32: d * q is exact, an 11-bit half times an integer of at most 8 bits, so only the add
 * rounds) into a panel per group of 8 rows, [K][8] floats: a block's 32-byte stripe t holds a 4-byte run of each of
 * its 8 rows, so one 8-lane integer vector of it gives, shifted and masked, 8 rows' weight at one k. The micro-kernel
 * multiplies MR (6) activation rows by two panels (16 weight rows): 12 accumulators of 8 lanes, a broadcast of
 * x[i][k] and two panel loads per k (the avx512 library, used where AVX512-BF16 is missing: 8 rows by 32 weight rows
 * in 16-lane vectors, 237 against 127 GFLOP/s here; panels are stored in pairs, [K][16], for either). K is walked in blocks of KC so that the panels' block stays in L1 while every
 * activation strip passes; an output is loaded back between blocks, so each y[i][r] is one chain of multiply-adds
 * over k = 0..K-1 in order, whatever the tiling, the item or the thread: the same bits for any thread count and any
 * split of M. Items go out through an atomic counter (el_pool contract). */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"
#include "arch/vec.h"

#define NT 32  /* weight rows per item (four groups) */
#define MR 6   /* activation rows per micro-kernel */
#define KC 256 /* k per block: the panels of one micro-kernel call, 16 KiB (32 with 16 lanes), stay in L1 */
#define MB 96  /* activation rows per item at most when M is split (16 strips) */

#include "arch/portable/panel_kquant.inc"

/* Groups g and g + 1 (when `two`; else lanes 8..15 zero) as panel[16 k + 8 h + r] = the weight of row r of group
 * g + h at k, for k in [0, K). */
static void dequant_panel(int fmt, const void *w, int nb, int g, int two, float *panel) {
    for (int h = 0; h < 2; h++) {
        el_v8f *out = (el_v8f *)(panel + 8 * h); /* stride 2 vectors per k */
        if (h && !two) {
            for (int k = 0; k < nb * el_fmt_block_k(fmt); k++) out[2 * k] = v8f_splat(0.f);
            continue;
        }
        if (fmt == EL_Q5_0) { /* as q4; lane r of qh: row r's high bits, element 4t + c's at bit 8c + t (+ 4: 16 on) */
            const el_block_q5_0x8 *blk = (const el_block_q5_0x8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++, blk++) {
                const el_v8f d = v8f_load_f16(blk->d);
                el_v8i hb;
                memcpy(&hb, blk->qh, sizeof hb);
                el_v8f *o = out + (size_t)2 * b * EL_QK;
                for (int t = 0; t < 4; t++) {
                    el_v8i v;
                    memcpy(&v, blk->qs + 32 * t, sizeof v);
                    for (int c = 0; c < 4; c++) {
                        const el_v8i lo = ((v >> (8 * c)) & 15) | (((hb >> (8 * c + t)) & 1) << 4);
                        const el_v8i hi = ((v >> (8 * c + 4)) & 15) | (((hb >> (8 * c + 4 + t)) & 1) << 4);
                        o[2 * (4 * t + c)] = d * __builtin_convertvector(lo - 16, el_v8f);
                        o[2 * (16 + 4 * t + c)] = d * __builtin_convertvector(hi - 16, el_v8f);
                    }
                }
            }
        } else if (fmt == EL_Q4_K) {
            const el_block_q4_kx8 *blk = (const el_block_q4_kx8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q4_k(blk + b, out + (size_t)2 * b * EL_QK_K);
        } else if (fmt == EL_Q6_K) {
            const el_block_q6_kx8 *blk = (const el_block_q6_kx8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q6_k(blk + b, out + (size_t)2 * b * EL_QK_K);
        } else if (fmt == EL_Q4_0 || fmt == EL_IQ4_NL) { /* the same fields: el_block_q4_0x8 stands for both */
            const el_block_q4_0x8 *blk = (const el_block_q4_0x8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_nl4(blk + b, fmt == EL_Q4_0, out + (size_t)2 * b * EL_QK);
        } else if (fmt == EL_Q5_1) {
            const el_block_q5_1x8 *blk = (const el_block_q5_1x8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q5_1(blk + b, out + (size_t)2 * b * EL_QK);
        } else if (fmt == EL_Q5_K) {
            const el_block_q5_kx8 *blk = (const el_block_q5_kx8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q5_k(blk + b, out + (size_t)2 * b * EL_QK_K);
        } else if (fmt == EL_Q2_K) {
            const el_block_q2_kx8 *blk = (const el_block_q2_kx8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q2_k(blk + b, out + (size_t)2 * b * EL_QK_K);
        } else if (fmt == EL_Q3_K) {
            const el_block_q3_kx8 *blk = (const el_block_q3_kx8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++) panel_q3_k(blk + b, out + (size_t)2 * b * EL_QK_K);
        } else if (fmt == EL_Q4) {
            const el_block_q4x8 *blk = (const el_block_q4x8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++, blk++) {
                const el_v8f d = v8f_load_f16(blk->d), m = v8f_load_f16(blk->m);
                el_v8f *o = out + (size_t)2 * b * EL_QK;
                for (int t = 0; t < 4; t++) {
                    el_v8i v;
                    memcpy(&v, blk->qs + 32 * t, sizeof v); /* lane r: q[r][4t + c] (low), q[r][16 + 4t + c] (high) */
                    for (int c = 0; c < 4; c++) {
                        const el_v8i lo = (v >> (8 * c)) & 15, hi = (v >> (8 * c + 4)) & 15;
                        o[2 * (4 * t + c)] = d * __builtin_convertvector(lo, el_v8f) + m;
                        o[2 * (16 + 4 * t + c)] = d * __builtin_convertvector(hi, el_v8f) + m;
                    }
                }
            }
        } else {
            const el_block_q8x8 *blk = (const el_block_q8x8 *)w + (size_t)(g + h) * nb;
            for (int b = 0; b < nb; b++, blk++) {
                const el_v8f d = v8f_load_f16(blk->d);
                el_v8f *o = out + (size_t)2 * b * EL_QK;
                for (int t = 0; t < 8; t++) {
                    el_v8i v;
                    memcpy(&v, blk->qs + 32 * t, sizeof v); /* lane r: q[r][4t + c], signed bytes */
                    for (int c = 0; c < 4; c++)
                        o[2 * (4 * t + c)] = d * __builtin_convertvector((v << (24 - 8 * c)) >> 24, el_v8f);
                }
            }
        }
    }
}

#if defined(__AVX512F__) && !defined(EL_SCALAR)
#include "arch/x86/gemm_f32_micro.inc"
#else
#include "arch/portable/gemm_f32_micro.inc"
#endif

typedef struct {
    int fmt, n, k, m, mblocks, mb;
    const void *w;
    const float *x;
    float *y;
    atomic_int next, done;
} gemm_job;

static void gemm_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    gemm_job *j = ctx;
    const int nb = j->k / el_fmt_block_k(j->fmt), tiles_n = (j->n + NT - 1) / NT, items = tiles_n * j->mblocks;
    float *panels = NULL; /* NT / 16 panel pairs of [K][16] */
    int have = -1;        /* the weight tile in panels */
    for (int t; (t = atomic_fetch_add(&j->next, 1)) < items;) {
        if (!panels && !(panels = aligned_alloc(64, (size_t)NT * j->k * sizeof(float)))) return; /* others take it */
        const int tn = t / j->mblocks, tm = t % j->mblocks;
        const int r0 = tn * NT, r1 = r0 + NT < j->n ? r0 + NT : j->n, groups = (r1 - r0) / EL_ROWS;
        if (have != tn) {
            for (int g = 0; g < groups; g += 2)
                dequant_panel(j->fmt, j->w, nb, r0 / EL_ROWS + g, g + 1 < groups, panels + (size_t)g * EL_ROWS * j->k);
            have = tn;
        }
        const int i0 = tm * j->mb, i1 = i0 + j->mb < j->m ? i0 + j->mb : j->m;
        for (int k0 = 0; k0 < j->k; k0 += KC) {
            const int k1 = k0 + KC < j->k ? k0 + KC : j->k;
            for (int r = 0; r < r1 - r0; r += ROWS_PER_CALL) {
                const int rows = r1 - r0 - r < ROWS_PER_CALL ? r1 - r0 - r : ROWS_PER_CALL;
                const float *p0 = panels + (size_t)r * j->k, *p1 = p0 + (size_t)16 * j->k;
                for (int i = i0; i < i1; i += MR_ROWS)
                    micro_rows(j->x + (size_t)i * j->k, (size_t)j->k, p0, p1, k0, k1, j->y + (size_t)i * j->n + r0 + r,
                               (size_t)j->n, k0 > 0, i1 - i < MR_ROWS ? i1 - i : MR_ROWS, rows);
            }
        }
        atomic_fetch_add(&j->done, 1);
    }
    free(panels);
}

int el_gemm_f32(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    if (!el_fmt_ok(fmt, k) || k <= 0 || n <= 0 || n % EL_ROWS || m < 0) return -1;
    if (m == 0) return 0;
    const int nth = pool ? el_pool_threads(pool) : 1, tiles_n = (n + NT - 1) / NT;
    /* split M (re-dequantizing a tile per block) only where the weight tiles alone leave threads idle */
    int mblocks = 1;
    while (tiles_n * mblocks < 4 * nth && (m + 2 * mblocks - 1) / (2 * mblocks) >= MB) mblocks *= 2;
    const int mb = (m + mblocks - 1) / mblocks;
    gemm_job job = {fmt, n, k, m, mblocks, mb, w, x, y, 0, 0};
    job.mblocks = (m + mb - 1) / mb;
    if (pool) el_pool_run(pool, gemm_task, &job);
    else gemm_task(&job, 0, 1);
    return atomic_load(&job.done) == tiles_n * job.mblocks ? 0 : -1;
}
