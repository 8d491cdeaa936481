/* Prefill's matmul on AVX512-BF16: y[M, N] = x[M, K] @ W.T with bf16 operands and float32 sums.
 *
 * The activations are rounded to bf16 once and packed 32 rows at a time as [K/2][32 rows][2], so one
 * 64-byte load holds a pair of consecutive inputs of 16 rows; a weight row's pair is broadcast, and
 * vdpbf16ps leaves one activation row's partial sum in each float lane. A thread takes a tile of 32
 * weight rows, dequantizes it (row-major, as the blocks unpack) into a buffer that stays in cache, and
 * multiplies it by every activation row: the weights are read from memory once per call, the packed
 * activations from cache (0.9 MiB for 512 tokens of Qwen2.5-0.5B's 896-wide hidden state, 4.8 MiB of its
 * 4864-wide MLP). The tiles are handed out to the pool's threads. Up to SMALL_M (8) activation rows (prefill's LM
 * head on its last position) go another way, weight rows in the lanes, with the same bits (see there).
 *
 * Only the avx512 library carries it, and it runs only where CPUID and XCR0 say AVX512-BF16 works;
 * elsewhere el_gemm_bf16 returns -2 and prefill keeps torch's bf16 GEMM. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"

#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include <immintrin.h>

#define MT 32 /* activation rows per packed tile: two 16-lane vectors */
#define NT 32 /* weight rows per dequantized tile (four groups of EL_ROWS) */
#define NR 8  /* weight rows per micro-kernel call: 2 x 8 accumulators */
#define BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static uint16_t bf16_rne(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u); /* NaN stays NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rows t*MT .. t*MT + MT - 1 of x into packed tile t: [K/2][MT][2], rows past m as zeros. */
static void pack_tile(const float *x, int m, int k, int t, uint16_t *out) {
    for (int i = 0; i < MT; i++) {
        const int row = t * MT + i;
        for (int p = 0; p < k / 2; p++) {
            uint16_t *o = out + ((size_t)p * MT + i) * 2;
            if (row < m) {
                o[0] = bf16_rne(x[(size_t)row * k + 2 * p]);
                o[1] = bf16_rne(x[(size_t)row * k + 2 * p + 1]);
            } else {
                o[0] = o[1] = 0;
            }
        }
    }
}

/* y[i][j] (i < mr, j < NR) = sum_k a[i][k] * w[j][k] for one packed activation tile and NR weight rows. */
BF16_TARGET static void micro(const uint16_t *a, const uint16_t *w, int k, float *y, int ldy, int mr) {
    __m512 acc[NR][2];
    for (int j = 0; j < NR; j++) acc[j][0] = acc[j][1] = _mm512_setzero_ps();
    const int32_t *w32 = (const int32_t *)w;
    const int pairs = k / 2;
    for (int p = 0; p < pairs; p++) {
        const __m512bh a0 = (__m512bh)_mm512_loadu_si512(a + (size_t)p * 2 * MT);
        const __m512bh a1 = (__m512bh)_mm512_loadu_si512(a + (size_t)p * 2 * MT + 32);
        for (int j = 0; j < NR; j++) {
            const __m512bh b = (__m512bh)_mm512_set1_epi32(w32[(size_t)j * pairs + p]);
            acc[j][0] = _mm512_dpbf16_ps(acc[j][0], a0, b);
            acc[j][1] = _mm512_dpbf16_ps(acc[j][1], a1, b);
        }
    }
    float sums[NR][MT];
    for (int j = 0; j < NR; j++) {
        _mm512_storeu_ps(sums[j], acc[j][0]);
        _mm512_storeu_ps(sums[j] + 16, acc[j][1]);
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < NR; j++) y[(size_t)i * ldy + j] = sums[j][i];
}

/* 128-bit lane i (0..3) of v (the extract takes an immediate). */
BF16_TARGET static inline __m128i lane128(__m512i v, int i) {
    switch (i) {
        case 0: return _mm512_extracti32x4_epi32(v, 0);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

/* Rows 8g .. 8g + 7 of a q4 / q8 weight as bf16 into out (row-major, ldo per row): what
 * el_dequant_bf16 writes (d * q + m, multiplied then added in float, rounded to bf16 at nearest
 * even), 16 weights per instruction. A block keeps a 4-byte run of each row per 32-byte stripe: one dword
 * permute puts four rows' runs in the four 128-bit lanes of a vector. */
BF16_TARGET static void dequant_group(int fmt, const void *w, int nb, int g, uint16_t *out, int ldo) {
    const __m512i rows03 = _mm512_setr_epi32(0, 8, 16, 24, 1, 9, 17, 25, 2, 10, 18, 26, 3, 11, 19, 27);
    const __m512i rows47 = _mm512_add_epi32(rows03, _mm512_set1_epi32(4));
    float ds[EL_ROWS], ms[EL_ROWS];
    if (fmt == EL_Q5_0) { /* as q4, the high bit of element e at bit 8 (e % 4) + e / 4 (+ 4 for e >= 16) of qh */
        const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i sh_lo = _mm512_add_epi32(_mm512_slli_epi32(_mm512_and_si512(iota, _mm512_set1_epi32(3)), 3),
                                               _mm512_srli_epi32(iota, 2));
        const __m512i sh_hi = _mm512_add_epi32(sh_lo, _mm512_set1_epi32(4)), one = _mm512_set1_epi32(1);
        const el_block_q5_0x8 *blk = (const el_block_q5_0x8 *)w + (size_t)g * nb;
        for (int b = 0; b < nb; b++, blk++) {
            const __m512i q0 = _mm512_loadu_si512(blk->qs), q1 = _mm512_loadu_si512(blk->qs + 64);
            const __m512i runs[2] = {_mm512_permutex2var_epi32(q0, rows03, q1), _mm512_permutex2var_epi32(q0, rows47, q1)};
            _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d)));
            for (int r = 0; r < EL_ROWS; r++) {
                uint32_t h32;
                memcpy(&h32, blk->qh + 4 * r, 4);
                const __m512i h = _mm512_set1_epi32((int)h32), c16 = _mm512_set1_epi32(16);
                const __m512 d = _mm512_set1_ps(ds[r]);
                const __m512i q = _mm512_cvtepu8_epi32(lane128(runs[r >> 2], r & 3));
                const __m512i lo = _mm512_or_si512(_mm512_and_si512(q, _mm512_set1_epi32(15)),
                                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, sh_lo), one), 4));
                const __m512i hi = _mm512_or_si512(_mm512_srli_epi32(q, 4),
                                                   _mm512_slli_epi32(_mm512_and_si512(_mm512_srlv_epi32(h, sh_hi), one), 4));
                const __m512 wl = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, c16)));
                const __m512 wh = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, c16)));
                _mm512_storeu_si512(out + (size_t)r * ldo + (size_t)b * EL_QK, (__m512i)_mm512_cvtne2ps_pbh(wh, wl));
            }
        }
    } else if (fmt == EL_Q4_K || fmt == EL_Q6_K) { /* a row's 32 bytes of a chunk gathered, then 16 weights a vector */
        const size_t size = el_fmt_group_bytes(fmt);
        const __m512i m4 = _mm512_set1_epi32(15), m2 = _mm512_set1_epi32(3);
        for (int b = 0; b < nb; b++) {
            const char *raw = (const char *)w + ((size_t)g * nb + b) * size;
            for (int r = 0; r < EL_ROWS; r++) {
                uint16_t *o = out + (size_t)r * ldo + (size_t)b * EL_QK_K;
                if (fmt == EL_Q4_K) {
                    const el_block_q4_kx8 *blk = (const el_block_q4_kx8 *)raw;
                    const float d = el_half_to_float(blk->d[r]), dmin = el_half_to_float(blk->dmin[r]);
                    for (int c = 0; c < 4; c++) {
                        uint8_t row[32];
                        for (int t = 0; t < 8; t++) memcpy(row + 4 * t, blk->qs + 256 * c + 32 * t + 4 * r, 4);
                        int sc0, mn0, sc1, mn1;
                        el_q4_k_scale_min(&blk->scales[0][r], 2 * c, &sc0, &mn0);
                        el_q4_k_scale_min(&blk->scales[0][r], 2 * c + 1, &sc1, &mn1);
                        const __m512 ds0 = _mm512_set1_ps(d * (float)sc0), dm0 = _mm512_set1_ps(dmin * (float)mn0);
                        const __m512 ds1 = _mm512_set1_ps(d * (float)sc1), dm1 = _mm512_set1_ps(dmin * (float)mn1);
                        for (int half = 0; half < 2; half++) {
                            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + 16 * half)));
                            const __m512 a = _mm512_sub_ps(_mm512_mul_ps(ds0, _mm512_cvtepi32_ps(_mm512_and_si512(q, m4))), dm0);
                            const __m512 e = _mm512_sub_ps(_mm512_mul_ps(ds1, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), dm1);
                            _mm256_storeu_si256((__m256i *)(o + 64 * c + 16 * half), (__m256i)_mm512_cvtneps_pbh(a));
                            _mm256_storeu_si256((__m256i *)(o + 64 * c + 32 + 16 * half), (__m256i)_mm512_cvtneps_pbh(e));
                        }
                    }
                } else {
                    const el_block_q6_kx8 *blk = (const el_block_q6_kx8 *)raw;
                    const float d = el_half_to_float(blk->d[r]);
                    for (int h = 0; h < 2; h++) {
                        uint8_t la[32], lb[32], hq[32];
                        for (int t = 0; t < 8; t++) {
                            memcpy(la + 4 * t, blk->ql + 512 * h + 32 * t + 4 * r, 4);
                            memcpy(lb + 4 * t, blk->ql + 512 * h + 256 + 32 * t + 4 * r, 4);
                            memcpy(hq + 4 * t, blk->qh + 256 * h + 32 * t + 4 * r, 4);
                        }
                        for (int half = 0; half < 2; half++) {
                            const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(la + 16 * half)));
                            const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(lb + 16 * half)));
                            const __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(hq + 16 * half)));
                            const __m512i u[4] = {
                                _mm512_or_si512(_mm512_and_si512(a, m4), _mm512_slli_epi32(_mm512_and_si512(q, m2), 4)),
                                _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 2), m2), 4)),
                                _mm512_or_si512(_mm512_srli_epi32(a, 4), _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(q, 4), m2), 4)),
                                _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(q, 6), 4))};
                            for (int q4 = 0; q4 < 4; q4++) {
                                const __m512 ds = _mm512_set1_ps(d * (float)blk->scales[8 * h + 2 * q4 + half][r]);
                                const __m512 v = _mm512_mul_ps(ds, _mm512_cvtepi32_ps(_mm512_sub_epi32(u[q4], _mm512_set1_epi32(32))));
                                _mm256_storeu_si256((__m256i *)(o + 128 * h + 32 * q4 + 16 * half), (__m256i)_mm512_cvtneps_pbh(v));
                            }
                        }
                    }
                }
            }
        }
    } else if (fmt != EL_Q4 && fmt != EL_Q8) { /* any other block format: row by row through el_block_row_f32 */
        const size_t size = el_fmt_group_bytes(fmt);
        const int bk = el_fmt_block_k(fmt);
        float vals[EL_QK_K];
        for (int b = 0; b < nb; b++) {
            const char *blk = (const char *)w + ((size_t)g * nb + b) * size;
            for (int r = 0; r < EL_ROWS; r++) {
                el_block_row_f32(fmt, blk, r, vals);
                uint16_t *o = out + (size_t)r * ldo + (size_t)b * bk;
                for (int j = 0; j < bk; j++) o[j] = bf16_rne(vals[j]);
            }
        }
        (void)rows03, (void)rows47, (void)ds, (void)ms;
    } else if (fmt == EL_Q4) {
        const el_block_q4x8 *blk = (const el_block_q4x8 *)w + (size_t)g * nb;
        for (int b = 0; b < nb; b++, blk++) {
            const __m512i q0 = _mm512_loadu_si512(blk->qs), q1 = _mm512_loadu_si512(blk->qs + 64);
            const __m512i runs[2] = {_mm512_permutex2var_epi32(q0, rows03, q1), _mm512_permutex2var_epi32(q0, rows47, q1)};
            _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d)));
            _mm256_storeu_ps(ms, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->m)));
            for (int r = 0; r < EL_ROWS; r++) {
                const __m512 d = _mm512_set1_ps(ds[r]), m = _mm512_set1_ps(ms[r]);
                const __m512i q = _mm512_cvtepu8_epi32(lane128(runs[r >> 2], r & 3)); /* low nibbles: 0..15 */
                const __m512 lo = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(q, _mm512_set1_epi32(15)))), m);
                const __m512 hi = _mm512_add_ps(_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4))), m);
                _mm512_storeu_si512(out + (size_t)r * ldo + (size_t)b * EL_QK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
    } else {
        const el_block_q8x8 *blk = (const el_block_q8x8 *)w + (size_t)g * nb;
        for (int b = 0; b < nb; b++, blk++) {
            const int8_t *qs = blk->qs;
            const __m512i q0 = _mm512_loadu_si512(qs), q1 = _mm512_loadu_si512(qs + 64);
            const __m512i q2 = _mm512_loadu_si512(qs + 128), q3 = _mm512_loadu_si512(qs + 192);
            const __m512i first[2] = {_mm512_permutex2var_epi32(q0, rows03, q1), _mm512_permutex2var_epi32(q0, rows47, q1)};
            const __m512i second[2] = {_mm512_permutex2var_epi32(q2, rows03, q3), _mm512_permutex2var_epi32(q2, rows47, q3)};
            _mm256_storeu_ps(ds, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)blk->d)));
            for (int r = 0; r < EL_ROWS; r++) {
                const __m512 d = _mm512_set1_ps(ds[r]);
                const __m512 lo = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane128(first[r >> 2], r & 3))));
                const __m512 hi = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(lane128(second[r >> 2], r & 3))));
                _mm512_storeu_si512(out + (size_t)r * ldo + (size_t)b * EL_QK, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
            }
        }
    }
}

/* ---- a few activation rows (the LM head of prefill's last position): weight rows in the lanes ---------- */

/* The tiled path above spends a 32-row activation tile's multiply-adds on every weight pair, however few rows
 * there are. With m <= SMALL_M rows the roles turn: each of 16 lanes holds one weight row's sum for one activation
 * row, the weights are dequantized straight into [pair][16 rows] vectors from the blocks' own order (a block's
 * 32-byte stripe t holds a 4-byte run of each of its 8 rows, so two groups' stripes side by side put 16 rows in
 * the 16 dword lanes), and one vdpbf16ps per activation row takes a pair of inputs of all 16 rows. The bits are
 * the tiled path's: every weight is d * q (+ m), multiplied then added in float, rounded to bf16 at nearest even
 * as dequant_group does (d * q is exact in float32, an 11-bit half times an integer of at most 8 bits: only the
 * add rounds, fused or not); every input rounded as pack_tile does; and every output is the same vdpbf16ps chain
 * over the pairs of K in order, the activation pair in src1 and the weight pair in src2 of its lane. A chain is one
 * dependent vdpbf16ps per pair: with one or two rows of x, two lane vectors go side by side to cover its latency.
 * Qwen2.5-0.5B's LM head (151,936 x 896, q4) for one row: 33 ms tiled, 5.7 ms here; Gemma 3 270M's (262,144 x 640,
 * q8): 50 ms tiled, 10 ms here (its 178 MB at memory speed). */
#define SMALL_M 8 /* activation rows the lane path takes (a third of the tiled path's time on an LM head at 8) */
#define ITEM_GROUPS 8 /* 8-row groups per work item: 64 weight rows */
#define PAIRED_M 2    /* up to this many rows of x, two lane vectors side by side (more: registers spill) */

/* Words [e0..e15, o0..o15] of cvtne2ps_pbh(o, e) as dwords (e_i | o_i << 16): pairs of 16 lanes. */
static const uint16_t pair_words[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                        8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/* Stripe t (32 bytes: 8 rows' 4-byte runs) of the blocks b of groups g and g + 1 (g + 1 absent: zeros) as 16 dword
 * lanes, one row each. */
BF16_TARGET static inline __m512i stripes(const uint8_t *lo, const uint8_t *hi) {
    const __m256i a = _mm256_loadu_si256((const __m256i *)lo);
    return hi ? _mm512_inserti64x4(_mm512_castsi256_si512(a), _mm256_loadu_si256((const __m256i *)hi), 1)
              : _mm512_zextsi256_si512(a);
}

/* The 16 rows' scales (IEEE halves, 8 per group) as floats. */
BF16_TARGET static inline __m512 scales16(const uint16_t *lo, const uint16_t *hi) {
    const __m128i a = _mm_loadu_si128((const __m128i *)lo);
    const __m128i b = hi ? _mm_loadu_si128((const __m128i *)hi) : _mm_setzero_si128();
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(a), b, 1));
}

/* acc[s][i] += x_i . w over one block (16 pairs) for `sets` lane vectors of 16 weight rows: q4 (mins != NULL:
 * w = d q + m, q the nibbles of st[s], 4 stripes) or q8 (w = d q, q the signed bytes of st[s], 8 stripes).
 * xp[i]: row i's 16 input pairs of this block (bf16 pairs as dwords). */
BF16_TARGET static inline __attribute__((always_inline)) void lanes_block(const __m512i (*st)[8], const __m512 *d,
                                                                          const __m512 *mins, const uint32_t *const *xp,
                                                                          __m512 (*acc)[SMALL_M], const int m,
                                                                          const int sets) {
    const __m512i perm = _mm512_loadu_si512(pair_words), nib = _mm512_set1_epi32(15);
    for (int p = 0; p < 16; p++) {
        for (int s = 0; s < sets; s++) {
            __m512 e, o;
            if (mins) { /* pair p: weights 2p, 2p + 1: stripe p/2 % 4, bytes 2 (p % 2) and + 1, low nibbles below 8 */
                const __m512i v = st[s][(p >> 1) & 3];
                const int shift = 16 * (p & 1) + 4 * (p >> 3);
                e = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift), nib));
                o = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, shift + 8), nib));
                e = _mm512_add_ps(_mm512_mul_ps(d[s], e), mins[s]);
                o = _mm512_add_ps(_mm512_mul_ps(d[s], o), mins[s]);
            } else { /* stripe p/2, bytes 2 (p % 2) and + 1, sign-extended */
                const __m512i v = st[s][p >> 1];
                const int shift = 16 * (p & 1);
                e = _mm512_mul_ps(d[s], _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 24 - shift), 24)));
                o = _mm512_mul_ps(d[s], _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(v, 16 - shift), 24)));
            }
            const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(perm, (__m512i)_mm512_cvtne2ps_pbh(o, e));
            for (int i = 0; i < m; i++)
                acc[s][i] = _mm512_dpbf16_ps(acc[s][i], (__m512bh)_mm512_set1_epi32((int)xp[i][p]), w);
        }
    }
}

/* y[i][8g ..] = x_i . the weight rows of `sets` lane vectors (groups g, g + 1, then g + 2, g + 3; the last group
 * of the matrix may be alone), for m rows of x (xp: [m][K/2] pairs). */
BF16_TARGET static inline __attribute__((always_inline)) void lanes_rows(int fmt, const void *w, int nb, int g, int groups,
                                                                         const uint32_t *xp, int k, float *y, int n,
                                                                         const int m, const int sets) {
    __m512 acc[2][SMALL_M];
    for (int s = 0; s < sets; s++)
        for (int i = 0; i < m; i++) acc[s][i] = _mm512_setzero_ps();
    const int two[2] = {g + 1 < groups, g + 3 < groups};
    const uint32_t *rows[SMALL_M];
    for (int b = 0; b < nb; b++) {
        for (int i = 0; i < m; i++) rows[i] = xp + (size_t)i * (k / 2) + (size_t)b * 16;
        __m512i st[2][8];
        __m512 d[2], mins[2];
        for (int s = 0; s < sets; s++) {
            const int gs = g + 2 * s;
            if (fmt == EL_Q4) {
                const el_block_q4x8 *lo = (const el_block_q4x8 *)w + (size_t)gs * nb + b, *hi = two[s] ? lo + nb : NULL;
                for (int t = 0; t < 4; t++) st[s][t] = stripes(lo->qs + 32 * t, hi ? hi->qs + 32 * t : NULL);
                d[s] = scales16(lo->d, hi ? hi->d : NULL), mins[s] = scales16(lo->m, hi ? hi->m : NULL);
            } else {
                const el_block_q8x8 *lo = (const el_block_q8x8 *)w + (size_t)gs * nb + b, *hi = two[s] ? lo + nb : NULL;
                for (int t = 0; t < 8; t++)
                    st[s][t] = stripes((const uint8_t *)lo->qs + 32 * t, hi ? (const uint8_t *)hi->qs + 32 * t : NULL);
                d[s] = scales16(lo->d, hi ? hi->d : NULL);
            }
        }
        lanes_block((const __m512i(*)[8])st, d, fmt == EL_Q4 ? mins : NULL, rows, acc, m, sets);
    }
    for (int s = 0; s < sets; s++)
        for (int i = 0; i < m; i++)
            _mm512_mask_storeu_ps(y + (size_t)i * n + (size_t)(g + 2 * s) * EL_ROWS, two[s] ? 0xffff : 0xff, acc[s][i]);
}

/* Groups g .. g1 - 1 through lanes_rows, two lane vectors side by side while m <= PAIRED_M. */
BF16_TARGET static inline __attribute__((always_inline)) void lanes_item(int fmt, const void *w, int nb, int g, int g1,
                                                                         int groups, const uint32_t *xp, int k, float *y,
                                                                         int n, const int m) {
    if (m <= PAIRED_M)
        for (; g + 4 <= g1; g += 4) lanes_rows(fmt, w, nb, g, groups, xp, k, y, n, m, 2);
    for (; g < g1; g += 2) lanes_rows(fmt, w, nb, g, groups, xp, k, y, n, m, 1);
}

typedef struct {
    int fmt, n, k, m, tiles_m;
    const void *w;
    const float *x;
    uint16_t *packed; /* tiles_m tiles of [K/2][MT][2] */
    float *y;
    atomic_int next_pack, next_tile, done; /* done: weight tiles finished */
} gemm_job;

/* Work items of the lane path: ITEM_GROUPS groups of 8 weight rows. */
BF16_TARGET static void lanes_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    gemm_job *j = ctx;
    const int nb = j->k / EL_QK, groups = j->n / EL_ROWS, items = (groups + ITEM_GROUPS - 1) / ITEM_GROUPS;
    const uint32_t *xp = (const uint32_t *)j->packed;
    for (int t; (t = atomic_fetch_add(&j->next_tile, 1)) < items;) {
        const int g = t * ITEM_GROUPS, g1 = g + ITEM_GROUPS < groups ? g + ITEM_GROUPS : groups;
        switch (j->m) { /* the row count a constant of each copy: its accumulators stay in registers */
            case 1: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 1); break;
            case 2: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 2); break;
            case 3: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 3); break;
            case 4: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 4); break;
            case 5: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 5); break;
            case 6: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 6); break;
            case 7: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 7); break;
            default: lanes_item(j->fmt, j->w, nb, g, g1, groups, xp, j->k, j->y, j->n, 8); break;
        }
        atomic_fetch_add(&j->done, 1);
    }
}

static void pack_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    gemm_job *j = ctx;
    for (int t; (t = atomic_fetch_add(&j->next_pack, 1)) < j->tiles_m;)
        pack_tile(j->x, j->m, j->k, t, j->packed + (size_t)t * MT * j->k);
}

static void gemm_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    gemm_job *j = ctx;
    uint16_t *rows = aligned_alloc(64, (size_t)NT * j->k * sizeof(uint16_t));
    if (!rows) return; /* the other threads take the tiles; el_gemm_bf16 fails if none could */
    const int nb = j->k / el_fmt_block_k(j->fmt), tiles_n = (j->n + NT - 1) / NT;
    for (int t; (t = atomic_fetch_add(&j->next_tile, 1)) < tiles_n;) {
        const int r0 = t * NT, r1 = r0 + NT < j->n ? r0 + NT : j->n;
        for (int r = r0; r < r1; r += EL_ROWS)
            dequant_group(j->fmt, j->w, nb, r / EL_ROWS, rows + (size_t)(r - r0) * j->k, j->k);
        for (int tm = 0; tm < j->tiles_m; tm++) {
            const int mr = j->m - tm * MT < MT ? j->m - tm * MT : MT;
            for (int r = r0; r < r1; r += NR)
                micro(j->packed + (size_t)tm * MT * j->k, rows + (size_t)(r - r0) * j->k, j->k,
                      j->y + (size_t)tm * MT * j->n + r, j->n, mr);
        }
        atomic_fetch_add(&j->done, 1);
    }
    free(rows);
}

int el_gemm_bf16(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    if (!el_cpu_allows("avx512bf16")) return -2; /* CPUID + XCR0: well under a microsecond */
    if (!el_fmt_ok(fmt, k) || k <= 0 || n <= 0 || n % EL_ROWS || m < 0) return -1;
    if (m == 0) return 0;
    if (m <= SMALL_M && (fmt == EL_Q4 || fmt == EL_Q8)) { /* the GGUF blocks take the tiled path at any M */ /* rows of x as bf16 pairs ([m][K/2] dwords, rounded as pack_tile does), weights in the lanes */
        uint16_t *pairs = aligned_alloc(64, ((size_t)m * k * sizeof(uint16_t) + 63) / 64 * 64);
        if (!pairs) return -1;
        for (size_t i = 0; i < (size_t)m * k; i++) pairs[i] = bf16_rne(x[i]);
        gemm_job job = {fmt, n, k, m, 0, w, x, pairs, y, 0, 0, 0};
        if (pool) el_pool_run(pool, lanes_task, &job);
        else lanes_task(&job, 0, 1);
        free(pairs);
        return atomic_load(&job.done) == (n / EL_ROWS + ITEM_GROUPS - 1) / ITEM_GROUPS ? 0 : -1;
    }
    const int tiles_m = (m + MT - 1) / MT;
    uint16_t *packed = aligned_alloc(64, (size_t)tiles_m * MT * k * sizeof(uint16_t));
    if (!packed) return -1;
    gemm_job job = {fmt, n, k, m, tiles_m, w, x, packed, y, 0, 0, 0};
    if (pool) {
        el_pool_run(pool, pack_task, &job);
        el_pool_run(pool, gemm_task, &job);
    } else {
        pack_task(&job, 0, 1);
        gemm_task(&job, 0, 1);
    }
    free(packed);
    return atomic_load(&job.done) == (n + NT - 1) / NT ? 0 : -1;
}

#else

int el_gemm_bf16(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    (void)pool, (void)fmt, (void)w, (void)n, (void)k, (void)x, (void)m, (void)y;
    return -2;
}

#endif
