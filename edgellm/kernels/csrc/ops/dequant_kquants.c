/* The float weights of one row of a group block of q4_0, iq4_nl, q5_1, q2_k, q3_k, q5_k (llama.cpp's Q4_0, IQ4_NL,
 * Q5_1, Q2_K, Q3_K, Q5_K held exactly): the values gguf-py's dequantize gives, bit for bit, by the same float32
 * operations in the same order (compiled as ISO C: no multiply-add contraction). el_block_row_f32 hands these formats here. */
#include "edgellm_kernels.h"

/* Byte i of row r's field stored in runs of 4 bytes per row (byte 32 (i / 4) + 4 r + i % 4). */
static inline uint8_t run_byte(const uint8_t *runs, int r, int i) { return runs[32 * (i >> 2) + 4 * r + (i & 3)]; }

/* Q2_K / Q3_K's 2-bit quant of element e: bits 2 ((e / 32) % 4) of row byte 32 (e / 128) + e % 32. */
static inline int crumb(const uint8_t *qs, int r, int e) {
    return (run_byte(qs, r, 32 * (e >> 7) + (e & 31)) >> (2 * ((e >> 5) & 3))) & 3;
}

int el_block_row_f32_kquant(int fmt, const void *block, int r, float *out) {
    if (fmt == EL_Q4_0 || fmt == EL_IQ4_NL) { /* d (q - 8), d value[q] (el_block_q4_0x8 and el_block_iq4_nlx8 agree) */
        const el_block_q4_0x8 *blk = block;
        const float d = el_half_to_float(blk->d[r]);
        for (int t = 0; t < 4; t++)
            for (int b = 0; b < 4; b++) {
                const uint8_t q = blk->qs[32 * t + 4 * r + b];
                const int lo = fmt == EL_Q4_0 ? (q & 15) - 8 : el_iq4_nl_values[q & 15];
                const int hi = fmt == EL_Q4_0 ? (q >> 4) - 8 : el_iq4_nl_values[q >> 4];
                out[4 * t + b] = d * (float)lo, out[16 + 4 * t + b] = d * (float)hi;
            }
    } else if (fmt == EL_Q5_1) { /* d q + m */
        const el_block_q5_1x8 *blk = block;
        const float d = el_half_to_float(blk->d[r]), m = el_half_to_float(blk->m[r]);
        for (int t = 0; t < 4; t++)
            for (int b = 0; b < 4; b++) {
                const uint8_t q = blk->qs[32 * t + 4 * r + b], h = blk->qh[4 * r + b];
                out[4 * t + b] = d * (float)((q & 15) | (((h >> t) & 1) << 4)) + m;
                out[16 + 4 * t + b] = d * (float)((q >> 4) | (((h >> (4 + t)) & 1) << 4)) + m;
            }
    } else if (fmt == EL_Q5_K) { /* (d sc) q - (dmin m) */
        const el_block_q5_kx8 *blk = block;
        const float d = el_half_to_float(blk->d[r]), dmin = el_half_to_float(blk->dmin[r]);
        for (int j = 0; j < 8; j++) {
            int sc, mn;
            el_q4_k_scale_min(&blk->scales[0][r], j, &sc, &mn);
            const float ds = d * (float)sc, dm = dmin * (float)mn;
            for (int l = 0; l < 32; l++) {
                const uint8_t q = run_byte(blk->qs, r, 32 * (j >> 1) + l), h = run_byte(blk->qh, r, l);
                out[32 * j + l] = ds * (float)((j & 1 ? q >> 4 : q & 15) | (((h >> j) & 1) << 4)) - dm;
            }
        }
    } else if (fmt == EL_Q3_K) { /* (d sc) (q - 4 + 4 h) */
        const el_block_q3_kx8 *blk = block;
        const float d = el_half_to_float(blk->d[r]);
        const uint8_t *s = &blk->scales[0][r];
        for (int j = 0; j < 16; j++) {
            const int low = j < 8 ? s[j * EL_ROWS] & 15 : s[(j - 8) * EL_ROWS] >> 4;
            const float dl = d * (float)((low | (((s[(8 + j % 4) * EL_ROWS] >> (2 * (j / 4))) & 3) << 4)) - 32);
            for (int e = 16 * j; e < 16 * j + 16; e++) {
                const int h = (run_byte(blk->hmask, r, e & 31) >> (e >> 5)) & 1;
                out[e] = dl * (float)(crumb(blk->qs, r, e) - 4 + 4 * h);
            }
        }
    } else if (fmt == EL_Q2_K) { /* (d (sc & 15)) q - (dmin (sc >> 4)) */
        const el_block_q2_kx8 *blk = block;
        const float d = el_half_to_float(blk->d[r]), dmin = el_half_to_float(blk->dmin[r]);
        for (int j = 0; j < 16; j++) {
            const int sc = blk->scales[j][r];
            const float dl = d * (float)(sc & 15), ml = dmin * (float)(sc >> 4);
            for (int e = 16 * j; e < 16 * j + 16; e++) out[e] = dl * (float)crumb(blk->qs, r, e) - ml;
        }
    } else {
        return -1;
    }
    return 0;
}
