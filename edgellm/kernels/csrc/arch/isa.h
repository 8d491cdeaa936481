/* The kernel variant this translation unit is compiled for, from the compiler's target macros (build.py
 * compiles every source once per variant with that variant's -m flags; -DEL_SCALAR forces portable C). */
#ifndef EDGELLM_ISA_H
#define EDGELLM_ISA_H

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

#endif
