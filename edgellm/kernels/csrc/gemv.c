/* Quantized GEMV: int8 activation blocks times q4 / q8 weight blocks, integer multiply-accumulate
 * per block of 32, one float multiply-add per block.
 *
 * The instruction set is chosen at compile time from the compiler's target macros (build.py
 * compiles this file once per variant with that variant's -m flags):
 *   avx512   AVX-512 VL + VNNI: vpdpbusd on 256-bit registers (CPUs with AVX512-VNNI but no AVX-VNNI,
 *            e.g. Ice Lake / Cascade Lake; a 512-bit version measured no faster on Zen 5)
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
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"

#if !defined(EL_SCALAR) && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512VNNI__) && defined(__FMA__) && defined(__F16C__)
#define EL_AVX512 1
#elif !defined(EL_SCALAR) && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define EL_AVX2 1
#if defined(__AVXVNNI__)
#define EL_AVXVNNI 1
#endif
#elif !defined(EL_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#define EL_NEON 1
#if defined(__ARM_FEATURE_DOTPROD)
#define EL_DOTPROD 1
#endif
#endif

#if defined(EL_AVX512) || defined(EL_AVX2)
#include <immintrin.h>
#elif defined(EL_NEON)
#include <arm_neon.h>
#endif

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
 * Qwen at 2 threads; of 2, 4, 8, 12 and 16 KiB ahead, 8 measured best. */
#ifndef EL_PREFETCH
#define EL_PREFETCH 8192
#endif
static inline void el_prefetch_span(const char *a, unsigned n) {
    for (unsigned o = 0; o < n; o += 64) __builtin_prefetch(a + o, 0, 3);
}
#define EL_PREFETCH_AHEAD(p) el_prefetch_span((const char *)(p) + EL_PREFETCH, sizeof(*(p)))

/* ------------------------------------------------------------------------ activation quantization */

void el_quantize_act(const float *x, int k, el_block_q8a *out) {
    for (int b = 0; b < k / EL_QK; b++, x += EL_QK) {
        float amax = 0.0f;
        for (int j = 0; j < EL_QK; j++) {
            const float a = x[j] < 0.0f ? -x[j] : x[j];
            amax = a > amax ? a : amax;
        }
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < EL_QK; j++) {
            /* |x * id| <= 127: round half to even as lrintf does in the default rounding mode */
            const int q = (int)nearbyintf(x[j] * id);
            out[b].qs[j] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* A tile of at most EL_TILE activation rows shares each unpacked weight block. */
#define EL_TILE 4

/* ------------------------------------------------------------------------ x86: AVX2 / AVX-VNNI / AVX-512 VNNI */

#if defined(EL_AVX512) || defined(EL_AVX2)

/* A block's 8 x 32 quants as 8 vectors: v[t] pairs with activation bytes 4t..4t+3 (a dword broadcast
 * to every row's lane). q8: the quants plus 128 with VNNI (unsigned operand, the 128 * sum(x) is
 * subtracted in the float step), their magnitudes without it (the signs go onto the activations). */
typedef struct {
    __m256i v[8];
} el_wq;

static inline void unpack_q4(const el_block_q4x8 *b, el_wq *w) {
    const __m256i m4 = _mm256_set1_epi8(15);
    for (int t = 0; t < 4; t++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * t));
        w->v[t] = _mm256_and_si256(raw, m4);
        w->v[4 + t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
    }
}

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

static inline void unpack_q8(const el_block_q8x8 *b, el_wq *w, __m256i *signs) {
    for (int t = 0; t < 8; t++) {
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(b->qs + 32 * t));
#if defined(EL_VNNI)
        (void)signs;
        w->v[t] = _mm256_xor_si256(raw, _mm256_set1_epi8((char)0x80));
#else
        w->v[t] = _mm256_sign_epi8(raw, raw);
        signs[t] = raw;
#endif
    }
}

static inline __m256i xdword(const el_block_q8a *x, int t) {
    int32_t v;
    memcpy(&v, x->qs + 4 * t, 4);
    return _mm256_set1_epi32(v);
}

/* Lane r: the block's integer dot product of row r's quants with the activation quants. q4 quants
 * are at most 15, so without VNNI the int16 sums of all 8 vpmaddubsw (<= 8 * 2 * 15 * 127) are exact. */
static inline __m256i dot_q4(const el_wq *w, const el_block_q8a *x) {
#if defined(EL_VNNI)
    __m256i acc = _mm256_setzero_si256();
    for (int t = 0; t < 8; t++) acc = dpbusd(acc, w->v[t], xdword(x, t));
    return acc;
#else
    __m256i s = _mm256_maddubs_epi16(w->v[0], xdword(x, 0));
    for (int t = 1; t < 8; t++) s = _mm256_add_epi16(s, _mm256_maddubs_epi16(w->v[t], xdword(x, t)));
    return _mm256_madd_epi16(s, _mm256_set1_epi16(1));
#endif
}

/* The same for q8 (with VNNI: of the quants plus 128). */
static inline __m256i dot_q8(const el_wq *w, const __m256i *signs, const el_block_q8a *x) {
    __m256i acc = _mm256_setzero_si256();
#if defined(EL_VNNI)
    (void)signs;
    for (int t = 0; t < 8; t++) acc = dpbusd(acc, w->v[t], xdword(x, t));
#else
    const __m256i ones = _mm256_set1_epi16(1);
    for (int t = 0; t < 8; t++)
        acc = _mm256_add_epi32(
            acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w->v[t], _mm256_sign_epi8(xdword(x, t), signs[t])), ones));
#endif
    return acc;
}

static inline __m256 halves(const uint16_t *h) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)h)); }

/* y[i * ldy + r0 .. + 8] for the activation rows of a tile, from one 8-row group of nb blocks. Always
 * inlined into group_q4 / group_q8 with a constant is_q4, so each gets its own branch-free loop. */
static inline __attribute__((always_inline)) void group_x86(const void *g, const int is_q4, int nb,
                                                            const el_block_q8a *x, int m, float *y, int ldy) {
    for (int i0 = 0; i0 < m; i0 += EL_TILE) {
        const int mt = m - i0 < EL_TILE ? m - i0 : EL_TILE;
        __m256 acc[EL_TILE];
        for (int i = 0; i < EL_TILE; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            el_wq w;
            __m256i signs[8];
            __m256 d, mn = _mm256_setzero_ps();
            if (is_q4) {
                const el_block_q4x8 *blk = (const el_block_q4x8 *)g + b;
                EL_PREFETCH_AHEAD(blk);
                unpack_q4(blk, &w);
                d = halves(blk->d), mn = halves(blk->m);
            } else {
                const el_block_q8x8 *blk = (const el_block_q8x8 *)g + b;
                EL_PREFETCH_AHEAD(blk);
                unpack_q8(blk, &w, signs);
                d = halves(blk->d);
            }
            for (int i = 0; i < mt; i++) {
                const el_block_q8a *xb = x + (size_t)(i0 + i) * nb + b;
                if (is_q4) {
                    const __m256 p = _mm256_cvtepi32_ps(dot_q4(&w, xb));
                    acc[i] = _mm256_fmadd_ps(p, _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[i]);
                    acc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xb->s), acc[i]);
                } else {
                    const __m256 p = _mm256_cvtepi32_ps(dot_q8(&w, signs, xb));
#if defined(EL_VNNI)
                    const __m256 t = _mm256_fmadd_ps(p, _mm256_set1_ps(xb->d), _mm256_set1_ps(-128.0f * xb->s));
#else
                    const __m256 t = _mm256_mul_ps(p, _mm256_set1_ps(xb->d));
#endif
                    acc[i] = _mm256_fmadd_ps(d, t, acc[i]);
                }
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)(i0 + i) * ldy, acc[i]);
    }
}

static void group_q4(const el_block_q4x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_x86(g, 1, nb, x, m, y, ldy);
}

static void group_q8(const el_block_q8x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_x86(g, 0, nb, x, m, y, ldy);
}

/* ---- the GGUF blocks held exactly (q5_0, q4_k, q6_k) ---- */

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

/* Q5_0: w = d (q - 16), q = nibble | high bit << 4 (<= 31), the high bits of quant vector t at bits t and 4 + t of
 * qh's bytes (edgellm_kernels.h). */
#define Q5_LANES(t)                                                                                              \
    do {                                                                                                         \
        const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk->qs + 32 * (t)));                           \
        v[t] = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16(h, 4 - (t)), b4)); \
        v[4 + (t)] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),                             \
                                     _mm256_and_si256(_mm256_srli_epi16(h, (t)), b4));                            \
    } while (0)

static void group_q5_0(const el_block_q5_0x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
    for (int i0 = 0; i0 < m; i0 += EL_TILE) {
        const int mt = m - i0 < EL_TILE ? m - i0 : EL_TILE;
        __m256 acc[EL_TILE];
        for (int i = 0; i < EL_TILE; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const el_block_q5_0x8 *blk = g + b;
            EL_PREFETCH_AHEAD(blk);
            const __m256i h = _mm256_loadu_si256((const __m256i *)blk->qh);
            __m256i v[8];
            Q5_LANES(0);
            Q5_LANES(1);
            Q5_LANES(2);
            Q5_LANES(3);
            const __m256 d = halves(blk->d);
            for (int i = 0; i < mt; i++) {
                const el_block_q8a *xb = x + (size_t)(i0 + i) * nb + b;
                const __m256 p = _mm256_cvtepi32_ps(dot_u(v, xb, 0, 8, 4));
                acc[i] = _mm256_fmadd_ps(d, _mm256_fmadd_ps(p, _mm256_set1_ps(xb->d), _mm256_set1_ps(-16.0f * xb->s)), acc[i]);
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)(i0 + i) * ldy, acc[i]);
    }
}

/* Q4_K: per super-block, the 8 rows' 6-bit scales and mins unpacked as int32 lanes (one row each) and multiplied by
 * d / dmin; each sub-block of 32 is one activation block: w = ds q - dm, so sum w x = ds dx isum - dm sx. */
static void group_q4_k(const el_block_q4_kx8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    const __m256i m4 = _mm256_set1_epi8(15), m6 = _mm256_set1_epi32(63), lo4 = _mm256_set1_epi32(15);
    const int nbx = nb * 8; /* activation blocks per row */
    for (int i0 = 0; i0 < m; i0 += EL_TILE) {
        const int mt = m - i0 < EL_TILE ? m - i0 : EL_TILE;
        __m256 acc[EL_TILE];
        for (int i = 0; i < EL_TILE; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const el_block_q4_kx8 *blk = g + b;
            EL_PREFETCH_AHEAD(blk);
            __m256i sb[12];
            for (int i = 0; i < 12; i++) sb[i] = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)blk->scales[i]));
            const __m256 d = halves(blk->d), dmin = halves(blk->dmin);
            __m256 ds[8], dm[8];
            for (int j = 0; j < 4; j++) {
                ds[j] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(sb[j], m6)));
                dm[j] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(_mm256_and_si256(sb[j + 4], m6)));
                const __m256i sc = _mm256_or_si256(_mm256_and_si256(sb[j + 8], lo4), _mm256_slli_epi32(_mm256_srli_epi32(sb[j], 6), 4));
                const __m256i mn = _mm256_or_si256(_mm256_srli_epi32(sb[j + 8], 4), _mm256_slli_epi32(_mm256_srli_epi32(sb[j + 4], 6), 4));
                ds[j + 4] = _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc));
                dm[j + 4] = _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(mn));
            }
            for (int c = 0; c < 4; c++) { /* 64 weights: sub-blocks 2c (low nibbles) and 2c + 1 (high) */
                __m256i lo[8], hi[8];
                for (int t = 0; t < 8; t++) {
                    const __m256i raw = _mm256_loadu_si256((const __m256i *)(blk->qs + 256 * c + 32 * t));
                    lo[t] = _mm256_and_si256(raw, m4), hi[t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
                }
                for (int i = 0; i < mt; i++) {
                    const el_block_q8a *xa = x + (size_t)(i0 + i) * nbx + 8 * b + 2 * c;
                    const __m256 p0 = _mm256_cvtepi32_ps(dot_u(lo, xa, 0, 8, 8));
                    const __m256 p1 = _mm256_cvtepi32_ps(dot_u(hi, xa + 1, 0, 8, 8));
                    acc[i] = _mm256_fmadd_ps(p0, _mm256_mul_ps(ds[2 * c], _mm256_set1_ps(xa->d)), acc[i]);
                    acc[i] = _mm256_fnmadd_ps(dm[2 * c], _mm256_set1_ps(xa->s), acc[i]);
                    acc[i] = _mm256_fmadd_ps(p1, _mm256_mul_ps(ds[2 * c + 1], _mm256_set1_ps(xa[1].d)), acc[i]);
                    acc[i] = _mm256_fnmadd_ps(dm[2 * c + 1], _mm256_set1_ps(xa[1].s), acc[i]);
                }
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)(i0 + i) * ldy, acc[i]);
    }
}

/* Q6_K: q = low 4 | high 2 << 4 (0..63, the unsigned operand), w = d sc (q - 32) with a scale per 16: per activation
 * block (two sub-blocks a, b) the integer sum sc_a (isum_a - 32 xsum_a) + sc_b (isum_b - 32 xsum_b) in int32 lanes
 * (|.| < 2^25), then one multiply-add by d dx. bsum: the activation quants' sums per 16 (K / 16 per row, rows of m). */
static void group_q6_k(const el_block_q6_kx8 *g, int nb, const el_block_q8a *x, const int32_t *bsum, int m, float *y,
                       int ldy) {
    const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
    const int nbx = nb * 8;
    for (int i0 = 0; i0 < m; i0 += EL_TILE) {
        const int mt = m - i0 < EL_TILE ? m - i0 : EL_TILE;
        __m256 acc[EL_TILE];
        for (int i = 0; i < EL_TILE; i++) acc[i] = _mm256_setzero_ps();
        for (int b = 0; b < nb; b++) {
            const el_block_q6_kx8 *blk = g + b;
            EL_PREFETCH_AHEAD(blk);
            const __m256 d = halves(blk->d);
            for (int h = 0; h < 2; h++) {
                __m256i u[4][8];
                for (int t = 0; t < 8; t++) {
                    const __m256i a = _mm256_loadu_si256((const __m256i *)(blk->ql + 512 * h + 32 * t));
                    const __m256i c = _mm256_loadu_si256((const __m256i *)(blk->ql + 512 * h + 256 + 32 * t));
                    const __m256i q = _mm256_loadu_si256((const __m256i *)(blk->qh + 256 * h + 32 * t));
                    u[0][t] = _mm256_or_si256(_mm256_and_si256(a, m4), _mm256_and_si256(_mm256_slli_epi16(q, 4), m2));
                    u[1][t] = _mm256_or_si256(_mm256_and_si256(c, m4), _mm256_and_si256(_mm256_slli_epi16(q, 2), m2));
                    u[2][t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), _mm256_and_si256(q, m2));
                    u[3][t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(c, 4), m4),
                                              _mm256_and_si256(_mm256_srli_epi16(q, 2), m2));
                }
                for (int q4 = 0; q4 < 4; q4++) {
                    const int s = 8 * h + 2 * q4, xi = 8 * b + 4 * h + q4;
                    const __m256i sa = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)blk->scales[s]));
                    const __m256i sb = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)blk->scales[s + 1]));
                    for (int i = 0; i < mt; i++) {
                        const el_block_q8a *xb = x + (size_t)(i0 + i) * nbx + xi;
                        const int32_t *bs = bsum + (size_t)(i0 + i) * 2 * nbx + 2 * xi;
                        const __m256i ia = _mm256_sub_epi32(dot_u(u[q4], xb, 0, 4, 2), _mm256_set1_epi32(32 * bs[0]));
                        const __m256i ib = _mm256_sub_epi32(dot_u(u[q4], xb, 4, 8, 2), _mm256_set1_epi32(32 * bs[1]));
                        const __m256i tot = _mm256_add_epi32(_mm256_mullo_epi32(ia, sa), _mm256_mullo_epi32(ib, sb));
                        acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(d, _mm256_set1_ps(xb->d)), acc[i]);
                    }
                }
            }
        }
        for (int i = 0; i < mt; i++) _mm256_storeu_ps(y + (size_t)(i0 + i) * ldy, acc[i]);
    }
}
#define EL_HAVE_SIMD_EXACT 1

/* ------------------------------------------------------------------------ aarch64: NEON (+ dotprod) */

#elif defined(EL_NEON)

/* int32 lanes += the 4-byte dot products of a and b (lane by lane). */
static inline int32x4_t dot4(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(EL_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    const int16x8_t lo = vmull_s8(vget_low_s8(a), vget_low_s8(b)), hi = vmull_s8(vget_high_s8(a), vget_high_s8(b));
    return vpadalq_s16(acc, vpaddq_s16(lo, hi)); /* |pair sums| <= 2 * 127 * 127: exact in int16 */
#endif
}

static inline int8x16_t xdword(const el_block_q8a *x, int t) {
    int32_t v;
    memcpy(&v, x->qs + 4 * t, 4);
    return vreinterpretq_s8_s32(vdupq_n_s32(v));
}

static inline float32x4_t halves4(const uint16_t *h) {
    __fp16 v[4];
    memcpy(v, h, sizeof v);
    return vcvt_f32_f16(vld1_f16(v));
}

/* A block's integer dot products: rows 0..3 in lo, 4..7 in hi (each 32-byte quant vector of the
 * x86 layout is two NEON vectors). */
static inline void dot_q4(const el_block_q4x8 *blk, const el_block_q8a *xb, int32x4_t *lo, int32x4_t *hi) {
    const uint8x16_t m4 = vdupq_n_u8(15);
    int32x4_t a = vdupq_n_s32(0), c = vdupq_n_s32(0);
    for (int t = 0; t < 4; t++) {
        const uint8x16_t r0 = vld1q_u8(blk->qs + 32 * t), r1 = vld1q_u8(blk->qs + 32 * t + 16);
        const int8x16_t x0 = xdword(xb, t), x1 = xdword(xb, 4 + t);
        a = dot4(dot4(a, vreinterpretq_s8_u8(vandq_u8(r0, m4)), x0), vreinterpretq_s8_u8(vshrq_n_u8(r0, 4)), x1);
        c = dot4(dot4(c, vreinterpretq_s8_u8(vandq_u8(r1, m4)), x0), vreinterpretq_s8_u8(vshrq_n_u8(r1, 4)), x1);
    }
    *lo = a, *hi = c;
}

static inline void dot_q8(const el_block_q8x8 *blk, const el_block_q8a *xb, int32x4_t *lo, int32x4_t *hi) {
    int32x4_t a = vdupq_n_s32(0), c = vdupq_n_s32(0);
    for (int t = 0; t < 8; t++) {
        const int8x16_t x = xdword(xb, t);
        a = dot4(a, vld1q_s8(blk->qs + 32 * t), x);
        c = dot4(c, vld1q_s8(blk->qs + 32 * t + 16), x);
    }
    *lo = a, *hi = c;
}

/* y for the activation rows from one 8-row group (q4 adds its mins term). */
static void group_neon(const void *g, int is_q4, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    for (int i = 0; i < m; i++) {
        float32x4_t a0 = vdupq_n_f32(0.0f), a1 = vdupq_n_f32(0.0f);
        for (int b = 0; b < nb; b++) {
            const el_block_q8a *xb = x + (size_t)i * nb + b;
            const uint16_t *d, *mins = NULL;
            int32x4_t s0, s1;
            if (is_q4) {
                const el_block_q4x8 *blk = (const el_block_q4x8 *)g + b;
                EL_PREFETCH_AHEAD(blk);
                dot_q4(blk, xb, &s0, &s1);
                d = blk->d, mins = blk->m;
            } else {
                const el_block_q8x8 *blk = (const el_block_q8x8 *)g + b;
                EL_PREFETCH_AHEAD(blk);
                dot_q8(blk, xb, &s0, &s1);
                d = blk->d;
            }
            a0 = vmlaq_f32(a0, vcvtq_f32_s32(s0), vmulq_n_f32(halves4(d), xb->d));
            a1 = vmlaq_f32(a1, vcvtq_f32_s32(s1), vmulq_n_f32(halves4(d + 4), xb->d));
            if (mins) {
                a0 = vmlaq_n_f32(a0, halves4(mins), xb->s);
                a1 = vmlaq_n_f32(a1, halves4(mins + 4), xb->s);
            }
        }
        vst1q_f32(y + (size_t)i * ldy, a0), vst1q_f32(y + (size_t)i * ldy + 4, a1);
    }
}

static void group_q4(const el_block_q4x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_neon(g, 1, nb, x, m, y, ldy);
}

static void group_q8(const el_block_q8x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_neon(g, 0, nb, x, m, y, ldy);
}

/* ------------------------------------------------------------------------ portable scalar */

#else

/* Row r's integer dot product of one block with the activation quants. */
static int isum_q4(const el_block_q4x8 *blk, int r, const el_block_q8a *x) {
    int isum = 0;
    for (int t = 0; t < 4; t++)
        for (int j = 0; j < 4; j++) {
            const uint8_t q = blk->qs[32 * t + 4 * r + j];
            isum += (q & 15) * x->qs[4 * t + j] + (q >> 4) * x->qs[16 + 4 * t + j];
        }
    return isum;
}

static int isum_q8(const el_block_q8x8 *blk, int r, const el_block_q8a *x) {
    int isum = 0;
    for (int t = 0; t < 8; t++)
        for (int j = 0; j < 4; j++) isum += blk->qs[32 * t + 4 * r + j] * x->qs[4 * t + j];
    return isum;
}

/* y for the activation rows from one 8-row group (q4 adds its mins term). */
static void group_scalar(const void *g, int is_q4, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    for (int i = 0; i < m; i++)
        for (int r = 0; r < EL_ROWS; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const el_block_q8a *xb = x + (size_t)i * nb + b;
                if (is_q4) {
                    const el_block_q4x8 *blk = (const el_block_q4x8 *)g + b;
                    acc += el_half_to_float(blk->d[r]) * xb->d * (float)isum_q4(blk, r, xb) +
                           el_half_to_float(blk->m[r]) * xb->s;
                } else {
                    const el_block_q8x8 *blk = (const el_block_q8x8 *)g + b;
                    acc += el_half_to_float(blk->d[r]) * xb->d * (float)isum_q8(blk, r, xb);
                }
            }
            y[(size_t)i * ldy + r] = acc;
        }
}

static void group_q4(const el_block_q4x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_scalar(g, 1, nb, x, m, y, ldy);
}

static void group_q8(const el_block_q8x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    group_scalar(g, 0, nb, x, m, y, ldy);
}
#endif


/* ------------------------------------------------------------------------ the GGUF blocks, portable C */

#if !defined(EL_HAVE_SIMD_EXACT)
/* The scalar and NEON builds: row by row, integer sums per sub-block, then float (a NEON version is future work). */
static void group_q5_0(const el_block_q5_0x8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    for (int i = 0; i < m; i++)
        for (int r = 0; r < EL_ROWS; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const el_block_q5_0x8 *blk = g + b;
                const el_block_q8a *xb = x + (size_t)i * nb + b;
                int isum = 0;
                for (int t = 0; t < 4; t++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t q = blk->qs[32 * t + 4 * r + j], h = blk->qh[4 * r + j];
                        isum += ((int)((q & 15) | (((h >> t) & 1) << 4)) - 16) * xb->qs[4 * t + j] +
                                ((int)((q >> 4) | (((h >> (4 + t)) & 1) << 4)) - 16) * xb->qs[16 + 4 * t + j];
                    }
                acc += el_half_to_float(blk->d[r]) * xb->d * (float)isum;
            }
            y[(size_t)i * ldy + r] = acc;
        }
}

static inline uint8_t run_byte(const uint8_t *runs, int r, int i) { return runs[32 * (i >> 2) + 4 * r + (i & 3)]; }

static void group_q4_k(const el_block_q4_kx8 *g, int nb, const el_block_q8a *x, int m, float *y, int ldy) {
    for (int i = 0; i < m; i++)
        for (int r = 0; r < EL_ROWS; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const el_block_q4_kx8 *blk = g + b;
                const float d = el_half_to_float(blk->d[r]), dmin = el_half_to_float(blk->dmin[r]);
                for (int j = 0; j < 8; j++) {
                    const uint8_t *s = &blk->scales[0][r];
                    const int sc = j < 4 ? s[j * EL_ROWS] & 63 : (s[(j + 4) * EL_ROWS] & 15) | ((s[(j - 4) * EL_ROWS] >> 6) << 4);
                    const int mn = j < 4 ? s[(j + 4) * EL_ROWS] & 63 : (s[(j + 4) * EL_ROWS] >> 4) | ((s[j * EL_ROWS] >> 6) << 4);
                    const el_block_q8a *xb = x + (size_t)i * nb * 8 + 8 * b + j;
                    int isum = 0;
                    for (int l = 0; l < 32; l++) {
                        const uint8_t q = run_byte(blk->qs, r, 32 * (j >> 1) + l);
                        isum += ((j & 1) ? q >> 4 : q & 15) * xb->qs[l];
                    }
                    acc += d * (float)sc * xb->d * (float)isum - dmin * (float)mn * xb->s;
                }
            }
            y[(size_t)i * ldy + r] = acc;
        }
}

static void group_q6_k(const el_block_q6_kx8 *g, int nb, const el_block_q8a *x, const int32_t *bsum, int m, float *y,
                       int ldy) {
    (void)bsum;
    for (int i = 0; i < m; i++)
        for (int r = 0; r < EL_ROWS; r++) {
            float acc = 0.0f;
            for (int b = 0; b < nb; b++) {
                const el_block_q6_kx8 *blk = g + b;
                for (int xi = 0; xi < 8; xi++) { /* activation block xi: half xi / 4, group xi % 4 */
                    const int h = xi >> 2, q4 = xi & 3;
                    const el_block_q8a *xb = x + (size_t)i * nb * 8 + 8 * b + xi;
                    int tot = 0;
                    for (int half = 0; half < 2; half++) {
                        int isum = 0;
                        for (int l = 16 * half; l < 16 * half + 16; l++) {
                            const uint8_t lo = run_byte(blk->ql, r, 64 * h + 32 * (q4 & 1) + l), hi = run_byte(blk->qh, r, 32 * h + l);
                            isum += (((q4 & 2 ? lo >> 4 : lo & 15) | (((hi >> (2 * q4)) & 3) << 4)) - 32) * xb->qs[l];
                        }
                        tot += blk->scales[8 * h + 2 * q4 + half][r] * isum;
                    }
                    acc += el_half_to_float(blk->d[r]) * xb->d * (float)tot;
                }
            }
            y[(size_t)i * ldy + r] = acc;
        }
}
#endif

/* ------------------------------------------------------------------------ GEMV / GEMM */

void el_gemm_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r += EL_ROWS) group_q4(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
}

void el_gemm_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r += EL_ROWS) group_q8(w + (size_t)(r / EL_ROWS) * nb, nb, x, m, y + r, ldy);
}

void el_gemv_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q4(w, k, x, 1, y, 0, r0, r1);
}

void el_gemv_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q8(w, k, x, 1, y, 0, r0, r1);
}

/* Rows per batch of the activation sums Q6_K takes (bsum, on the stack): K / 16 per row. */
#define EL_BSUM_STACK 4096

void el_gemm_fmt(int fmt, const void *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int bk = el_fmt_block_k(fmt), nb = k / bk, nbx = k / EL_QK;
    const size_t gsize = el_fmt_group_bytes(fmt) * (size_t)nb;
    if (fmt == EL_Q4) { el_gemm_q4(w, k, x, m, y, ldy, r0, r1); return; }
    if (fmt == EL_Q8) { el_gemm_q8(w, k, x, m, y, ldy, r0, r1); return; }
    if (fmt == EL_Q6_K) {
        int32_t bsum[EL_BSUM_STACK];
        const int per = 2 * nbx <= EL_BSUM_STACK ? EL_BSUM_STACK / (2 * nbx) : 1;
        for (int i0 = 0; i0 < m; i0 += per) {
            const int mt = m - i0 < per ? m - i0 : per;
            const int32_t *bs = NULL;
            if (2 * nbx <= EL_BSUM_STACK) {
                for (int i = 0; i < mt * nbx; i++) {
                    const int8_t *q = x[(size_t)i0 * nbx + i].qs;
                    int a = 0, c = 0;
                    for (int j = 0; j < 16; j++) a += q[j], c += q[16 + j];
                    bsum[2 * i] = a, bsum[2 * i + 1] = c;
                }
                bs = bsum;
            }
            for (int r = r0; r < r1; r += EL_ROWS) {
                const void *g = (const char *)w + (size_t)(r / EL_ROWS) * gsize;
#if defined(EL_HAVE_SIMD_EXACT)
                if (!bs) { /* K > 16 * EL_BSUM_STACK / 2: one row at a time, its sums on the heap */
                    int32_t *row = malloc((size_t)2 * nbx * sizeof *row);
                    for (int i = 0; row && i < mt; i++) {
                        for (int b = 0; b < nbx; b++) {
                            const int8_t *q = x[(size_t)(i0 + i) * nbx + b].qs;
                            int a = 0, c = 0;
                            for (int j = 0; j < 16; j++) a += q[j], c += q[16 + j];
                            row[2 * b] = a, row[2 * b + 1] = c;
                        }
                        group_q6_k(g, nb, x + (size_t)(i0 + i) * nbx, row, 1, y + (size_t)(i0 + i) * ldy + r, ldy);
                    }
                    free(row);
                    continue;
                }
#endif
                group_q6_k(g, nb, x + (size_t)i0 * nbx, bs, mt, y + (size_t)i0 * ldy + r, ldy);
            }
        }
        return;
    }
    for (int r = r0; r < r1; r += EL_ROWS) {
        const void *g = (const char *)w + (size_t)(r / EL_ROWS) * gsize;
        if (fmt == EL_Q5_0) group_q5_0(g, nb, x, m, y + r, ldy);
        else group_q4_k(g, nb, x, m, y + r, ldy);
    }
}
