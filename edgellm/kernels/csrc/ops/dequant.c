/* Dequantize q4 / q8 row groups to bf16 rows, for prefill: long inputs multiply bf16 weights (torch's
 * bf16 GEMM, float activations rounded to bf16) rather than int8 activations, which lose accuracy
 * on models with activation outliers. A slab of rows is dequantized per call into a caller's buffer
 * that stays in cache, so nothing but the mapped blocks is held between calls. */
#include <stdatomic.h>
#include <string.h>

#include "edgellm_kernels.h"

float el_half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        const float f = (float)man * 5.9604644775390625e-8f; /* zero or subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

uint16_t el_float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    x &= 0x7fffffffu;
    if (x > 0x7f800000u) return sign | 0x7e00u; /* NaN */
    if (x >= 0x477ff000u) return sign | 0x7c00u; /* >= 65520 rounds to infinity */
    uint32_t h, rem, half;
    if (x >= 0x38800000u) { /* a normal half: rebias the exponent, keep 10 mantissa bits */
        h = (x - 0x38000000u) >> 13, rem = x & 0x1fffu, half = 0x1000u;
    } else if (x >= 0x33000000u) { /* a subnormal half, in units of 2^-24 */
        const uint32_t e = x >> 23, m = (x & 0x7fffffu) | 0x800000u, shift = 126u - e;
        h = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    } else {
        return sign; /* below 2^-25, or exactly it (ties to the even zero) */
    }
    if (rem > half || (rem == half && (h & 1u))) h++; /* a carry into the exponent is the right result */
    return sign | (uint16_t)h;
}

/* Byte i of row r's quant bytes in a group's runs of 4 (byte 32 (i / 4) + 4 r + i % 4). */
static inline uint8_t run_byte(const uint8_t *runs, int r, int i) { return runs[32 * (i >> 2) + 4 * r + (i & 3)]; }

void el_block_row_f32(int fmt, const void *block, int r, float *out) {
    if (fmt == EL_Q5_0) {
        const el_block_q5_0x8 *blk = block;
        const float d = el_half_to_float(blk->d[r]);
        for (int t = 0; t < 4; t++)
            for (int b = 0; b < 4; b++) {
                const uint8_t q = blk->qs[32 * t + 4 * r + b], h = blk->qh[4 * r + b];
                out[4 * t + b] = d * (float)((int)((q & 15) | (((h >> t) & 1) << 4)) - 16);
                out[16 + 4 * t + b] = d * (float)((int)((q >> 4) | (((h >> (4 + t)) & 1) << 4)) - 16);
            }
    } else if (fmt == EL_Q4_K) {
        const el_block_q4_kx8 *blk = block;
        const float d = el_half_to_float(blk->d[r]), dmin = el_half_to_float(blk->dmin[r]);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            el_q4_k_scale_min(&blk->scales[0][r], j, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                const uint8_t q = run_byte(blk->qs, r, 32 * (j >> 1) + l);
                out[32 * j + l] = ds * (float)((j & 1) ? q >> 4 : q & 15) - dm;
            }
        }
    } else if (fmt == EL_Q6_K) {
        const el_block_q6_kx8 *blk = block;
        const float d = el_half_to_float(blk->d[r]);
        for (int e = 0; e < EL_QK_K; e++) {
            const int h = e >> 7, g = (e >> 5) & 3, l = e & 31;
            const uint8_t lo = run_byte(blk->ql, r, 64 * h + 32 * (g & 1) + l), hi = run_byte(blk->qh, r, 32 * h + l);
            const int q = ((g & 2 ? lo >> 4 : lo & 15) | (((hi >> (2 * g)) & 3) << 4)) - 32;
            out[e] = (d * (float)blk->scales[8 * h + 2 * g + (l >> 4)][r]) * (float)q;
        }
    } else if (fmt == EL_Q4) {
        const el_block_q4x8 *blk = block;
        const float d = el_half_to_float(blk->d[r]), m = el_half_to_float(blk->m[r]);
        for (int t = 0; t < 4; t++)
            for (int j = 0; j < 4; j++) {
                const uint8_t q = blk->qs[32 * t + 4 * r + j];
                out[4 * t + j] = d * (float)(q & 15) + m;
                out[16 + 4 * t + j] = d * (float)(q >> 4) + m;
            }
    } else {
        const el_block_q8x8 *blk = block;
        const float d = el_half_to_float(blk->d[r]);
        for (int t = 0; t < 8; t++)
            for (int j = 0; j < 4; j++) out[4 * t + j] = d * (float)blk->qs[32 * t + 4 * r + j];
    }
}

/* float -> bf16, round to nearest even (finite inputs). */
static inline uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows 8g .. 8g + 7 of the weight into out (row-major, ldo elements per row). */
static void group_bf16(int fmt, const void *w, int nb, int g, uint16_t *out, int ldo) {
    const size_t size = el_fmt_group_bytes(fmt);
    const int bk = el_fmt_block_k(fmt);
    float vals[EL_QK_K];
    for (int b = 0; b < nb; b++) {
        const void *blk = (const char *)w + ((size_t)g * nb + b) * size;
        for (int r = 0; r < EL_ROWS; r++) {
            el_block_row_f32(fmt, blk, r, vals);
            uint16_t *o = out + (size_t)r * ldo + (size_t)b * bk;
            for (int j = 0; j < bk; j++) o[j] = to_bf16(vals[j]);
        }
    }
}

typedef struct {
    int fmt, nb, g0, g1, ldo;
    const void *w;
    uint16_t *out;
    atomic_int next;
} dequant_job;

static void dequant_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    dequant_job *j = ctx;
    for (;;) {
        const int g = j->g0 + atomic_fetch_add(&j->next, 1);
        if (g >= j->g1) return;
        group_bf16(j->fmt, j->w, j->nb, g, j->out + (size_t)(g - j->g0) * EL_ROWS * j->ldo, j->ldo);
    }
}

int el_dequant_bf16(el_pool *pool, int fmt, const void *w, int k, int r0, int r1, uint16_t *out) {
    if (!el_fmt_ok(fmt, k) || r0 % EL_ROWS || r1 % EL_ROWS || r0 > r1) return -1;
    dequant_job job = {fmt, k / el_fmt_block_k(fmt), r0 / EL_ROWS, r1 / EL_ROWS, k, w, out, 0};
    if (pool) el_pool_run(pool, dequant_task, &job);
    else dequant_task(&job, 0, 1);
    return 0;
}
