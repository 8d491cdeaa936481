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
