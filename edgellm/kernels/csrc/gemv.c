/* Quantized GEMV: int8 activation blocks times q4 / q8 weight blocks, integer multiply-accumulate
 * per block of 32, one float multiply-add per block.
 *
 * The instruction set is chosen at compile time from the compiler's target macros (build.py
 * compiles this file once per variant with that variant's -m flags):
 *   avx512   AVX-512 F/BW/VL + VNNI: two blocks per 512-bit vpdpbusd
 *   avxvnni  AVX2 + AVX-VNNI: one block per 256-bit vpdpbusd
 *   avx2     AVX2 + FMA + F16C: vpmaddubsw + vpmaddwd
 *   neon-dotprod  ARMv8.2 sdot (vdotq_s32)
 *   neon     ARMv8 NEON widening multiplies (vmull_s8 / vpadalq_s16)
 *   scalar   portable C (also forced by -DEL_SCALAR, so an aarch64 build can have one)
 *
 * Signedness: q4 weights are 0..15 and act as the unsigned operand of vpdpbusd / vpmaddubsw; q8
 * weights are signed, so the x86 paths multiply |w| (unsigned) by x * sign(w) (signed). Activation
 * quants are in -127..127 (never -128), so no product or pair sum overflows int16. */
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

/* ------------------------------------------------------------------------ one row . one activation */

#if defined(EL_AVX512) || defined(EL_AVX2)
static inline float hsum256(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 packed bytes -> 32 values 0..15 (elements 0..15 in the low lane, 16..31 in the high lane). */
static inline __m256i unpack_q4(const uint8_t *qs) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)qs), m4 = _mm_set1_epi8(15);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(raw, 4), m4), _mm_and_si128(raw, m4));
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
#endif

#if defined(EL_AVX512)
static inline __m512 scale2(float a, float b) {
    const __m512d lo = _mm512_castps_pd(_mm512_castps256_ps512(_mm256_set1_ps(a)));
    return _mm512_castpd_ps(_mm512_insertf64x4(lo, _mm256_castps_pd(_mm256_set1_ps(b)), 1));
}

static inline __m512i join2(__m256i lo, __m256i hi) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
}
#endif

#if defined(EL_NEON)
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
#endif

static float dot_q4(const el_block_q4 *w, const el_block_q8a *x, int nb) {
    float mins = 0.0f;
    for (int b = 0; b < nb; b++) mins += h2f(w[b].m) * x[b].s;
#if defined(EL_AVX512)
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512i wq = join2(unpack_q4(w[b].qs), unpack_q4(w[b + 1].qs));
        const __m512i xq = join2(_mm256_loadu_si256((const __m256i *)x[b].qs),
                                 _mm256_loadu_si256((const __m256i *)x[b + 1].qs));
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wq, xq);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale2(h2f(w[b].d) * x[b].d, h2f(w[b + 1].d) * x[b + 1].d),
                              acc);
    }
    __m256 acc8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    if (b < nb) {
        const __m256i p = dot_u8s8(unpack_q4(w[b].qs), _mm256_loadu_si256((const __m256i *)x[b].qs));
        acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc8);
    }
    return hsum256(acc8) + mins;
#elif defined(EL_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i p0 = dot_u8s8(unpack_q4(w[b].qs), _mm256_loadu_si256((const __m256i *)x[b].qs));
        const __m256i p1 = dot_u8s8(unpack_q4(w[b + 1].qs), _mm256_loadu_si256((const __m256i *)x[b + 1].qs));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(h2f(w[b + 1].d) * x[b + 1].d), acc1);
    }
    if (b < nb) {
        const __m256i p = dot_u8s8(unpack_q4(w[b].qs), _mm256_loadu_si256((const __m256i *)x[b].qs));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc0);
    }
    return hsum256(_mm256_add_ps(acc0, acc1)) + mins;
#elif defined(EL_NEON)
    float32x4_t acc = vdupq_n_f32(0.0f);
    const uint8x16_t m4 = vdupq_n_u8(15);
    for (int b = 0; b < nb; b++) {
        const uint8x16_t raw = vld1q_u8(w[b].qs);
        int32x4_t p = dot16(vdupq_n_s32(0), vreinterpretq_s8_u8(vandq_u8(raw, m4)), vld1q_s8(x[b].qs));
        p = dot16(p, vreinterpretq_s8_u8(vshrq_n_u8(raw, 4)), vld1q_s8(x[b].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), h2f(w[b].d) * x[b].d);
    }
    return vaddvq_f32(acc) + mins;
#else
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int isum = 0;
        for (int j = 0; j < EL_QK / 2; j++)
            isum += (w[b].qs[j] & 15) * x[b].qs[j] + (w[b].qs[j] >> 4) * x[b].qs[j + EL_QK / 2];
        acc += h2f(w[b].d) * x[b].d * (float)isum;
    }
    return acc + mins;
#endif
}

static float dot_q8(const el_block_q8 *w, const el_block_q8a *x, int nb) {
#if defined(EL_AVX512)
    __m512 acc = _mm512_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m512i wq = join2(_mm256_loadu_si256((const __m256i *)w[b].qs),
                                 _mm256_loadu_si256((const __m256i *)w[b + 1].qs));
        const __m512i xq = join2(_mm256_loadu_si256((const __m256i *)x[b].qs),
                                 _mm256_loadu_si256((const __m256i *)x[b + 1].qs));
        const __m512i sx = _mm512_mask_sub_epi8(xq, _mm512_movepi8_mask(wq), _mm512_setzero_si512(), xq);
        const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_abs_epi8(wq), sx);
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), scale2(h2f(w[b].d) * x[b].d, h2f(w[b + 1].d) * x[b + 1].d),
                              acc);
    }
    __m256 acc8 = _mm256_add_ps(_mm512_castps512_ps256(acc), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(acc), 1)));
    if (b < nb) {
        const __m256i wq = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i p = dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
        acc8 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc8);
    }
    return hsum256(acc8);
#elif defined(EL_AVX2)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int b = 0;
    for (; b + 1 < nb; b += 2) {
        const __m256i w0 = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i x0 = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i w1 = _mm256_loadu_si256((const __m256i *)w[b + 1].qs);
        const __m256i x1 = _mm256_loadu_si256((const __m256i *)x[b + 1].qs);
        const __m256i p0 = dot_u8s8(_mm256_sign_epi8(w0, w0), _mm256_sign_epi8(x0, w0));
        const __m256i p1 = dot_u8s8(_mm256_sign_epi8(w1, w1), _mm256_sign_epi8(x1, w1));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(h2f(w[b + 1].d) * x[b + 1].d), acc1);
    }
    if (b < nb) {
        const __m256i wq = _mm256_loadu_si256((const __m256i *)w[b].qs);
        const __m256i xq = _mm256_loadu_si256((const __m256i *)x[b].qs);
        const __m256i p = dot_u8s8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xq, wq));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(h2f(w[b].d) * x[b].d), acc0);
    }
    return hsum256(_mm256_add_ps(acc0, acc1));
#elif defined(EL_NEON)
    float32x4_t acc = vdupq_n_f32(0.0f);
    for (int b = 0; b < nb; b++) {
        int32x4_t p = dot16(vdupq_n_s32(0), vld1q_s8(w[b].qs), vld1q_s8(x[b].qs));
        p = dot16(p, vld1q_s8(w[b].qs + 16), vld1q_s8(x[b].qs + 16));
        acc = vmlaq_n_f32(acc, vcvtq_f32_s32(p), h2f(w[b].d) * x[b].d);
    }
    return vaddvq_f32(acc);
#else
    float acc = 0.0f;
    for (int b = 0; b < nb; b++) {
        int isum = 0;
        for (int j = 0; j < EL_QK; j++) isum += w[b].qs[j] * x[b].qs[j];
        acc += h2f(w[b].d) * x[b].d * (float)isum;
    }
    return acc;
#endif
}

/* ------------------------------------------------------------------------ GEMV / small GEMM */

void el_gemv_q4(const el_block_q4 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r++) y[r] = dot_q4(w + (size_t)r * nb, x, nb);
}

void el_gemv_q8(const el_block_q8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r++) y[r] = dot_q8(w + (size_t)r * nb, x, nb);
}

/* Each weight row is read from memory once and reused (from L1) for all m activation rows. */
void el_gemm_q4(const el_block_q4 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r++)
        for (int i = 0; i < m; i++) y[(size_t)i * ldy + r] = dot_q4(w + (size_t)r * nb, x + (size_t)i * nb, nb);
}

void el_gemm_q8(const el_block_q8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1) {
    const int nb = k / EL_QK;
    for (int r = r0; r < r1; r++)
        for (int i = 0; i < m; i++) y[(size_t)i * ldy + r] = dot_q8(w + (size_t)r * nb, x + (size_t)i * nb, nb);
}
