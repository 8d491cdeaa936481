/* Prefill's matmul on AVX512-BF16 (el_gemm_bf16): the body is arch/x86/gemm_bf16.inc, which says how it works.
 * Only the avx512 library carries it; elsewhere el_gemm_bf16 returns -2 and prefill keeps torch's bf16 GEMM. */
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"

#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#include "arch/x86/gemm_bf16.inc"
#else

int el_gemm_bf16(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    (void)pool, (void)fmt, (void)w, (void)n, (void)k, (void)x, (void)m, (void)y;
    return -2;
}

#endif
