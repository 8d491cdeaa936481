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

void el_block_row_f32(int fmt, const void *block, int r, float *out) {
    if (fmt == EL_Q4) {
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
    const size_t size = fmt == EL_Q4 ? sizeof(el_block_q4x8) : sizeof(el_block_q8x8);
    float vals[EL_QK];
    for (int b = 0; b < nb; b++) {
        const void *blk = (const char *)w + ((size_t)g * nb + b) * size;
        for (int r = 0; r < EL_ROWS; r++) {
            el_block_row_f32(fmt, blk, r, vals);
            uint16_t *o = out + (size_t)r * ldo + (size_t)b * EL_QK;
            for (int j = 0; j < EL_QK; j++) o[j] = to_bf16(vals[j]);
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
    if ((fmt != EL_Q4 && fmt != EL_Q8) || k % EL_QK || r0 % EL_ROWS || r1 % EL_ROWS || r0 > r1) return -1;
    dequant_job job = {fmt, k / EL_QK, r0 / EL_ROWS, r1 / EL_ROWS, k, w, out, 0};
    if (pool) el_pool_run(pool, dequant_task, &job);
    else dequant_task(&job, 0, 1);
    return 0;
}
