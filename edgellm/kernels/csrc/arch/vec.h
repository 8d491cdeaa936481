/* Float vectors of 8 lanes for the decode step's attention, written once with GCC/Clang vector
 * extensions: each variant's compiler flags turn them into AVX (x86), two NEON registers (aarch64),
 * or SSE2 pairs (the scalar build). Only the horizontal sums use intrinsics, where AVX is present. */
#ifndef EDGELLM_VEC_H
#define EDGELLM_VEC_H

#include <stdint.h>

#include "edgellm_kernels.h" /* el_half_to_float */

#if !defined(EL_SCALAR) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define EL_VEC_AVX 1
#elif !defined(EL_SCALAR) && defined(__aarch64__) && defined(__ARM_NEON)
#include <arm_neon.h>
#include <string.h>
#define EL_VEC_NEON 1
#endif

typedef float el_v8f __attribute__((vector_size(32), aligned(4))); /* unaligned loads and stores */
typedef int32_t el_v8i __attribute__((vector_size(32), aligned(4)));

static inline el_v8f v8f_load(const float *p) { return *(const el_v8f *)p; }
static inline void v8f_store(float *p, el_v8f v) { *(el_v8f *)p = v; }
static inline el_v8f v8f_splat(float x) { return (el_v8f){x, x, x, x, x, x, x, x}; }

/* 8 int8 values as floats (compilers turn the generic conversion into 8 scalar ones, hence intrinsics). */
static inline el_v8f v8f_load_i8(const int8_t *p) {
#if defined(EL_VEC_AVX)
    return (el_v8f)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(EL_VEC_NEON)
    const int16x8_t h = vmovl_s8(vld1_s8(p));
    const float32x4_t halves[2] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(h))), vcvtq_f32_s32(vmovl_high_s16(h))};
    el_v8f v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    el_v8f v;
    for (int j = 0; j < 8; j++) v[j] = (float)p[j];
    return v;
#endif
}

/* 8 IEEE halves as floats. */
static inline el_v8f v8f_load_f16(const uint16_t *p) {
#if defined(EL_VEC_AVX) && defined(__F16C__)
    return (el_v8f)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif defined(EL_VEC_NEON)
    const float32x4_t halves[2] = {vcvt_f32_f16(vld1_f16((const __fp16 *)p)),
                                   vcvt_f32_f16(vld1_f16((const __fp16 *)p + 4))};
    el_v8f v;
    memcpy(&v, halves, sizeof v);
    return v;
#else
    el_v8f v;
    for (int j = 0; j < 8; j++) v[j] = el_half_to_float(p[j]);
    return v;
#endif
}

/* a * b + c with one rounding where the CPU has fused multiply-add (compiled as ISO C, GCC does not
 * contract the vector expression itself: a separate multiply and add, twice the instructions). */
static inline el_v8f v8f_fma(el_v8f a, el_v8f b, el_v8f c) {
#if defined(EL_VEC_AVX)
    return (el_v8f)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#elif defined(EL_VEC_NEON)
    float32x4_t va[2], vb[2], vc[2];
    memcpy(va, &a, sizeof a), memcpy(vb, &b, sizeof b), memcpy(vc, &c, sizeof c);
    vc[0] = vfmaq_f32(vc[0], va[0], vb[0]), vc[1] = vfmaq_f32(vc[1], va[1], vb[1]);
    memcpy(&c, vc, sizeof c);
    return c;
#else
    return a * b + c;
#endif
}

/* Lane-wise maximum (no NaNs expected: the lanes are attention scores). */
static inline el_v8f v8f_max(el_v8f a, el_v8f b) {
    const el_v8i a_greater = a > b;
    return (el_v8f)((a_greater & (el_v8i)a) | (~a_greater & (el_v8i)b));
}

static inline float v8f_hmax(el_v8f v) {
    float m = v[0];
    for (int j = 1; j < 8; j++) m = v[j] > m ? v[j] : m;
    return m;
}

static inline float v8f_hsum(el_v8f v) {
    float s = 0.f;
    for (int j = 0; j < 8; j++) s += v[j];
    return s;
}

/* out[j] = the sum of the lanes of a[j], for 8 vectors at once. */
static inline void v8f_hsum8(const el_v8f a[8], float out[8]) {
#if defined(EL_VEC_AVX)
    __m256 v[8];
    for (int j = 0; j < 8; j++) v[j] = (__m256)a[j];
    const __m256 h01 = _mm256_hadd_ps(v[0], v[1]), h23 = _mm256_hadd_ps(v[2], v[3]);
    const __m256 h45 = _mm256_hadd_ps(v[4], v[5]), h67 = _mm256_hadd_ps(v[6], v[7]);
    const __m256 q0 = _mm256_hadd_ps(h01, h23), q1 = _mm256_hadd_ps(h45, h67);
    /* q0 = [a0 a1 a2 a3 | a0 a1 a2 a3] (low / high 128-bit halves), q1 likewise for a4..a7 */
    const __m256 lo = _mm256_permute2f128_ps(q0, q1, 0x20), hi = _mm256_permute2f128_ps(q0, q1, 0x31);
    _mm256_storeu_ps(out, _mm256_add_ps(lo, hi));
#else
    for (int j = 0; j < 8; j++) out[j] = v8f_hsum(a[j]);
#endif
}

/* exp(x) for x <= 0 (softmax after subtracting the maximum), lanes below -87 flush to exp(-87):
 * x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (truncation error
 * below 2e-9 relative), times 2^n built in the exponent bits. Relative error a few float ulps. */
static inline el_v8f v8f_exp_nonpositive(el_v8f x) {
    const el_v8f lo = v8f_splat(-87.0f);
    x = (el_v8f)((el_v8i)(x < lo) & (el_v8i)lo) + (el_v8f)((el_v8i)(x >= lo) & (el_v8i)x);
    /* n = round(x / ln2) for x <= 0: -(int)(0.5 - x / ln2), truncation of a positive number */
    const el_v8i n = -__builtin_convertvector(v8f_splat(0.5f) - x * 1.44269504088896341f, el_v8i);
    const el_v8f nf = __builtin_convertvector(n, el_v8f);
    const el_v8f r = (x - nf * 0.693145751953125f) - nf * 1.428606765330187045e-06f; /* ln2 hi + lo */
    el_v8f p = v8f_splat(1.f / 5040.f);
    p = v8f_fma(p, r, v8f_splat(1.f / 720.f));
    p = v8f_fma(p, r, v8f_splat(1.f / 120.f));
    p = v8f_fma(p, r, v8f_splat(1.f / 24.f));
    p = v8f_fma(p, r, v8f_splat(1.f / 6.f));
    p = v8f_fma(p, r, v8f_splat(0.5f));
    p = v8f_fma(p, r, v8f_splat(1.f));
    p = v8f_fma(p, r, v8f_splat(1.f));
    return p * (el_v8f)((n + 127) << 23);
}

/* 1 / (1 + exp(-u)), from exp(-|u|) (never overflows): 1 / (1 + e) for u >= 0, e / (1 + e) below. */
static inline el_v8f v8f_sigmoid(el_v8f u) {
    const el_v8f e = v8f_exp_nonpositive((el_v8f)((el_v8i)u | (el_v8i)v8f_splat(-0.0f))); /* -|u| */
    const el_v8i negative = u < v8f_splat(0.f);
    const el_v8f numerator = (el_v8f)((negative & (el_v8i)e) | (~negative & (el_v8i)v8f_splat(1.f)));
    return numerator / (v8f_splat(1.f) + e);
}

#endif
