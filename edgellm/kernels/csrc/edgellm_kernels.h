/* edgellm native kernels: the contract between the quantized GEMV kernels, the thread pool and the
 * native decode step. Every .c file of the library is compiled once per instruction-set variant
 * (scalar, avx2, avx512, neon, ...) into its own shared library; Python loads the one the CPU and
 * the OS allow. Inside one library, the decode step calls the GEMV of the same variant directly. */
#ifndef EDGELLM_KERNELS_H
#define EDGELLM_KERNELS_H

#include <stdint.h>
#include <stddef.h>

#define EL_QK 32 /* weights and activations are quantized in blocks of 32 along K */

/* 4-bit weight block (32 weights): w = d * q + m, q in 0..15.
 * qs[j] holds element j in its low nibble and element j + 16 in its high nibble. d, m: IEEE half. */
typedef struct {
    uint16_t d;
    uint16_t m;
    uint8_t qs[EL_QK / 2];
} el_block_q4;

/* 8-bit weight block (32 weights): w = d * q, q in -127..127. d: IEEE half. */
typedef struct {
    uint16_t d;
    int8_t qs[EL_QK];
} el_block_q8;

/* 8-bit activation block (32 values): x ~= d * q; s = d * sum(q) (for the q4 min term). */
typedef struct {
    float d;
    float s;
    int8_t qs[EL_QK];
} el_block_q8a;

/* A weight matrix W[N, K] stored row-major as N rows of K/32 blocks (K padded to a multiple of 32
 * with zero weights). fmt: 0 = f32 (plain float rows of K), 4 = q4, 8 = q8. */
enum { EL_F32 = 0, EL_Q4 = 4, EL_Q8 = 8 };

typedef struct el_pool el_pool; /* the thread pool, see below */

/* Name of the variant this library was compiled for ("scalar", "avx2", "avx512", "neon", ...). */
const char *el_variant(void);

/* x[K] (K a multiple of 32) -> K/32 activation blocks. */
void el_quantize_act(const float *x, int k, el_block_q8a *out);

/* y[r] = sum_k W[r, k] * x[k] for rows r0 <= r < r1, with x given as quantized blocks. */
void el_gemv_q4(const el_block_q4 *w, int k, const el_block_q8a *x, float *y, int r0, int r1);
void el_gemv_q8(const el_block_q8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1);

/* Small GEMM for a few activation rows (short chunks): y[i * ldy + r] = W[r, :] . x_i for
 * 0 <= i < m, r0 <= r < r1, where x_i = x + i * (k / 32). Each weight row is read once for all m. */
void el_gemm_q4(const el_block_q4 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1);
void el_gemm_q8(const el_block_q8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1);

/* y[M, N] = x[M, K] @ W.T (row-major x and y) for a q4 / q8 weight (fmt EL_Q4 / EL_Q8) of N rows of
 * K/32 blocks: quantizes x, then hands out chunks of rows to the pool's threads (pool may be NULL:
 * the caller's thread only). Returns 0, or -1 on a bad argument (K % 32 != 0) or allocation failure. */
int el_linear(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y);

/* What the CPU and the OS allow: 1 if the named variant ("scalar", "avx2", "avxvnni", "avx512",
 * "neon", "neon-dotprod") can run here, from CPUID + XCR0 on x86 and HWCAP on aarch64. */
int el_cpu_allows(const char *variant);
/* XCR0 (the register states the OS enables), 0 where there is none. */
uint64_t el_cpu_xcr0(void);

/* Thread pool: workers stay hot (spin, then sleep) between jobs. el_pool_run calls fn(ctx, ith, nth)
 * on the caller (ith 0) and on every worker that picks the job up before the caller's call returns,
 * then waits for those: fn must hand out its work dynamically (e.g. an atomic chunk counter), never
 * by ith, so that a worker descheduled on a busy machine is not waited for. */
typedef void (*el_task_fn)(void *ctx, int ith, int nth);
el_pool *el_pool_create(int nthreads);
void el_pool_run(el_pool *pool, el_task_fn fn, void *ctx);
int el_pool_threads(const el_pool *pool);
void el_pool_destroy(el_pool *pool);

#endif
