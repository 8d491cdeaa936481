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
 * Signedness: q4 weights are 0..15 and act as the unsigned operand of vpdpbusd / vpmaddubsw; q8
 * weights are signed, so the x86 paths multiply |w| (unsigned) by x * sign(w) (signed). Activation
 * quants are in -127..127 (never -128), so no product or pair sum overflows int16.
 *
 * The x86 paths compute two weight rows per pass over the activation blocks (each activation block
 * and its scales are loaded once for both), and convert a block's f16 (d, m) pair with one
 * vcvtph2ps, multiplied by the activation block's adjacent (d, s) floats in one vmulps. */
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

/* Software prefetch this many bytes ahead in each weight row stream: the hardware prefetchers alone
 * left a 85 MB matrix (Qwen's lm_head) at 2-6 GB/s per core; 8 KiB ahead measured best of
 * 1/4/8/16 KiB (microbench on that shape, alternated with torch's int4pack). */
#ifndef EL_PREFETCH
#define EL_PREFETCH 8192
#endif
#define EL_PREFETCH_AHEAD(p) __builtin_prefetch((const char *)(p) + EL_PREFETCH, 0, 3)

/* IEEE half -> float. */
static inline float h2f(uint16_t h) {
#if defined(EL_AVX512) || defined(EL_AVX2)
    return _cvtsh_ss(h);
#elif defined(EL_NEON)
    __fp16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
    if (exp == 0) {
        float f = (float)man * 5.9604644775390625e-8f; /* zero or subnormal: man * 2^-24 */
        return sign ? -f : f;
    }
    bits = exp == 31 ? sign | 0x7f800000u | (man << 13) : sign | ((exp + 112u) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
#endif
}

/* ------------------------------------------------------------------------ activation quantization */

void el_quantize_act(const float *x, int k, el_block_q8a *out) {
    for (int b = 0; b < k / EL_QK; b++, x += EL_QK) {
        float amax = 0.0f;
        for (int j = 0; j < EL_QK; j++) amax = fmaxf(amax, fabsf(x[j]));
        const float d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        int sum = 0;
        for (int j = 0; j < EL_QK; j++) {
            int q = (int)lrintf(x[j] * id);
            q = q > 127 ? 127 : q < -127 ? -127 : q;
            out[b].qs[j] = (int8_t)q;
            sum += q;
        }
        out[b].d = d;
        out[b].s = d * (float)sum;
    }
}

/* ------------------------------------------------------------------------ x86: AVX2 / AVX-VNNI / AVX-512 VNNI */

#if defined(EL_AVX512) || defined(EL_AVX2)

static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> 32 values 0..15: elements 0..15 (low nibbles) in the low lane, 16..31 in the high. */
static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)qs));
    return _mm256_and_si256(_mm256_srlv_epi64(v, _mm256_set_epi64x(4, 4, 0, 0)), _mm256_set1_epi8(15));
}

/* 8 int32 partial sums of u[i] * s[i] (u unsigned 8-bit, s signed 8-bit). */
static inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(EL_AVX512)
    return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#elif defined(EL_AVXVNNI)
    return _mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), u, s);
#else
    return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/* 8 int32 partial sums of w[i] * x[i], both signed 8-bit (w != -128): |w| times x * sign(w). */
static inline __m256i dot_s8s8(__m256i w, __m256i x) {
    return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
}

/* [w.d * x.d, w.m * x.s, 0, 0] for a q4 block; [w.d * x.d, *, 0, 0] for q8 (first 2 bytes only). */
static inline __m128 block_scales(const void *w_dm, int both, const el_block_q8a *x) {
    int32_t dm = 0;
    memcpy(&dm, w_dm, both ? 4 : 2);
    const __m128 wf = _mm_cvtph_ps(_mm_cvtsi32_si128(dm));
    return _mm_mul_ps(wf, _mm_castsi128_ps(_mm_loadl_epi64((const __m128i *)&x->d)));
}

static void dot2_q4(const el_block_q4 *w0, const el_block_q4 *w1, const el_block_q8a *x, int nb, float *y0,
                    float *y1) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 min0 = _mm_setzero_ps(), min1 = _mm_setzero_ps();
    for (int b = 0; b < nb; b++) {
        EL_PREFETCH_AHEAD(&w0[b]);
        EL_PREFETCH_AHEAD(&w1[b]);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 s0 = block_scales(&w0[b].d, 1, &x[b]), s1 = block_scales(&w1[b].d, 1, &x[b]);
        const __m256i p0 = dot_u8s8(unpack_q4(w0[b].qs), xq), p1 = dot_u8s8(unpack_q4(w1[b].qs), xq);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcastss_ps(s0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcastss_ps(s1), acc1);
        min0 = _mm_add_ps(min0, s0);
        min1 = _mm_add_ps(min1, s1);
    }
    *y0 = hsum256(acc0) + _mm_cvtss_f32(_mm_movehdup_ps(min0));
    *y1 = hsum256(acc1) + _mm_cvtss_f32(_mm_movehdup_ps(min1));
}

static void dot2_q8(const el_block_q8 *w0, const el_block_q8 *w1, const el_block_q8a *x, int nb, float *y0,
                    float *y1) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int b = 0; b < nb; b++) {
        EL_PREFETCH_AHEAD(&w0[b]);
        EL_PREFETCH_AHEAD(&w1[b]);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m128 s0 = block_scales(&w0[b].d, 0, &x[b]), s1 = block_scales(&w1[b].d, 0, &x[b]);
        const __m256i p0 = dot_s8s8(_mm256_loadu_si256((const __m256i *)w0[b].qs), xq);
        const __m256i p1 = dot_s8s8(_mm256_loadu_si256((const __m256i *)w1[b].qs), xq);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_broadcastss_ps(s0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_broadcastss_ps(s1), acc1);
    }
    *y0 = hsum256(acc0);
    *y1 = hsum256(acc1);
}

static float dot_q4(const el_block_q4 *w, const el_block_q8a *x, int nb) {
    float y, unused;
    dot2_q4(w, w, x, nb, &y, &unused);
    return y;
}

static float dot_q8(const el_block_q8 *w, const el_block_q8a *x, int nb) {
    float y, unused;
    dot2_q8(w, w, x, nb, &y, &unused);
    return y;
}
#define EL_HAVE_DOT2 1

/* ------------------------------------------------------------------------ aarch64: NEON (+ dotprod) */

#elif defined(EL_NEON)
/* int32x4 partial sums of a[i] * b[i] over 16 signed bytes, added to acc. */
static inline int32x4_t dot16(int32x4_t acc, int8x16_t a, int8x16_t b) {
#if defined(EL_DOTPROD)
    return vdotq_s32(acc, a, b);
#else
    int16x8_t p = vmull_s8(vget_low_s8(a), vget_low_s8(b));
    p = vmlal_s8(p, vget_high_s8(a), vget_high_s8(b));
    return vpadalq_s16(acc, p);
#endif
}

static float dot_q4(const el_block_q4 *w, const el_block_q8a *x, int nb) {
    float32x4_t acc = vdupq_n_f32(0.0f);
    float mins = 0.0f;
    const uint8x16_t m4 = vdupq_n_u8(15);
    for (int b = 0; b < nb; b++) {
        EL_PREFETCH_AHEAD(&w[b]);
        const uint8x16_t raw = vld1q_u8(w[b].qs);
        int32x4_t p = dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(raw, m4)), vld1q_s8(x[b].qs));
        p = dot16(p, vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vld1q_s8(x[b].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), h2f(w[b].d) * x[b].d);
        mins += h2f(w[b].m) * x[b].s;
    }
    return vaddvq_f32(acc) + mins;
}

static float dot_q8(const el_block_q8 *w, const el_block_q8a *x, int nb) {
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        EL_PREFETCH_AHEAD(&w[b]);
        int32x4_t p = dot16(vdupq_n_s32(0), vld1q_s8(w[b].qs), vld1q_s8(x[b].qs));
        p = dot16(p, vld1q_s8(w[b].qs + 16), vld1q_s8(x[b].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), h2f(w[b].d) * x[b].d);
    }
    return vaddvq_f32(acc);
}

/* ------------------------------------------------------------------------ portable scalar */

#else
static float dot_q4(const el_block_q4 *w, const el_block_q8a *x, int nb) {
    float acc = 0.0f, mins = 0.0f;
    for (int b = 0; b < nb; b++) {
        int isum = 0;
        for (int j = 0; j < EL_QK / 2; j++)
            isum += (w[b].qs[j] & 15) * x[b].qs[j] + (w[b].qs[j] >> 4) * x[b].qs[j + EL_QK / 2];
        acc += h2f(w[b].d) * x[b].d * (float)isum;
        mins += h2f(w[b].m) * x[b].s;
    }
    return acc + mins;
}

static float dot_q8(const el_block_q8 *w, const el_block_q8a *x, int nb) {
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int isum = 0;
        for (int j = 0; j < EL_QK; j++) isum += w[b].qs[j] * x[b].qs[j];
        acc += h2f(w[b].d) * x[b].d * (float)isum;
    }
    return acc;
}
#endif

#if !defined(EL_HAVE_DOT2)
static void dot2_q4(const el_block_q4 *w0, const el_block_q4 *w1, const el_block_q8a *x, int nb, float *y0,
                    float *y1) {
    *y0 = dot_q4(w0, x, nb);
    *y1 = dot_q4(w1, x, nb);
}

static void dot2_q8(const el_block_q8 *w0, const el_block_q8 *w1, const el_block_q8a *x, int nb, float *y0,
                    float *y1) {
    *y0 = dot_q8(w0, x, nb);
    *y1 = dot_q8(w1, x, nb);
}
#endif

/* ------------------------------------------------------------------------ GEMV / small GEMM */

/* Rows r0..r1 two at a time; each weight row pair is read from memory once and reused (from L1)
 * for all m activation rows. */
#define EL_GEMM(NAME, BLOCK, DOT, DOT2)                                                                          \
    void NAME(const BLOCK *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {         \
        const int nb = k / EL_QK;                                                                               \
        int r = r0;                                                                                             \
        for (; r + 1 < r1; r += 2)                                                                              \
            for (int i = 0; i < m; i++)                                                                         \
                DOT2(w + (size_t)r * nb, w + (size_t)(r + 1) * nb, x + (size_t)i * nb, nb,                      \
                     &y[(size_t)i * ldy + r], &y[(size_t)i * ldy + r + 1]);                                     \
        if (r < r1)                                                                                             \
            for (int i = 0; i < m; i++) y[(size_t)i * ldy + r] = DOT(w + (size_t)r * nb, x + (size_t)i * nb, nb); \
    }

EL_GEMM(el_gemm_q4, el_block_q4, dot_q4, dot2_q4)
EL_GEMM(el_gemm_q8, el_block_q8, dot_q8, dot2_q8)

void el_gemv_q4(const el_block_q4 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q4(w, k, x, 1, y, 0, r0, r1);
}

void el_gemv_q8(const el_block_q8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_q8(w, k, x, 1, y, 0, r0, r1);
}
