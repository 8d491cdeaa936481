/* The integer dot-product pieces the x86 kernels share (matmul/gemv.c's GEMV bodies, matmul/gemm_i8.c's prefill
 * GEMM): a block's unsigned quant vectors against broadcast dwords of int8 activations, one 32-bit lane per row. */
#ifndef EDGELLM_X86_INT8_DOT_H
#define EDGELLM_X86_INT8_DOT_H

#include <string.h>

#include "edgellm_kernels.h"
#include "arch/isa.h"

#if defined(EL_AVX512) || defined(EL_AVXVNNI)
#define EL_VNNI 1
static inline __m256i dpbusd(__m256i acc, __m256i u, __m256i s) {
#if defined(EL_AVX512)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#endif

static inline __m256i xdword(const el_block_q8a *x, int t) {
    int32_t v;
    memcpy(&v, x->qs + 4 * t, 4);
    return _mm256_set1_epi32(v);
}

static inline __m256 halves(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

/* Lane r: sum over quant vectors t0 <= t < t1 of row r's unsigned quants (v[t], at most 63) times activation dwords
 * dword(x, t). Without VNNI, vpmaddubsw pair sums (<= 2 * 63 * 127) are added in int16 `per` at a time (exact: per *
 * 2 * qmax * 127 < 2^15) before widening. */
static inline __attribute__((always_inline)) __m256i dot_u(const __m256i *v, const el_block_q8a *x, const int t0,
                                                           const int t1, const int per) {
    __m256i acc = _mm256_setzero_si256();
#if defined(EL_VNNI)
    (void)per;
    for (int t = t0; t < t1; t++) acc = dpbusd(acc, v[t], xdword(x, t));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = t0; t < t1; t += per) {
        __m256i s16 = _mm256_maddubs_epi16(v[t], xdword(x, t));
        for (int u = t + 1; u < t + per && u < t1; u++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(v[u], xdword(x, u)));
        acc = _mm256_add_epi32(acc, _mm256_madd_epi16(s16, ones));
    }
#endif
    return acc;
}

/* Q4_K / Q5_K's per-row 6-bit scales and mins of a super-block, times d and dmin, as float lanes (one row each). */
static inline void k_scales_mins(const uint8_t (*scales)[EL_ROWS], __m256 d, __m256 dmin, __m256 *ds, __m256 *dm) {
    const __m256i m6 = _mm256_set1_epi32(63), lo4 = _mm256_set1_epi32(15);
    __m256i sb[12];
    for (int i = 0; i < 12; i++) sb[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)scales[i]));
    for (int j = 0; j < 4; j++) {
        ds[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sb[j], m6)));
        dm[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(sb[j + 4], m6)));
        const __m256i sc = _mm256_or_si256(_mm256_and_si256(sb[j + 8], lo4), _mm256_slli_epi32(_mm256_srli_epi32(sb[j], 6), 4));
        const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(sb[j + 8], 4), _mm256_slli_epi32(_mm256_srli_epi32(sb[j + 4], 6), 4));
        ds[j + 4] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
        dm[j + 4] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
    }
}

#endif
