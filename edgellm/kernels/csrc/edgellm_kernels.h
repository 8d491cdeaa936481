/* edgellm native kernels: the contract between the quantized GEMV kernels, the thread pool and the
 * native decode step. Every .c file of the library is compiled once per instruction-set variant
 * (scalar, avx2, avx512, neon, ...) into its own shared library; Python loads the one the CPU and
 * the OS allow. Inside one library, the decode step calls the GEMV of the same variant directly. */
#ifndef EDGELLM_KERNELS_H
#define EDGELLM_KERNELS_H

#include <stdint.h>
#include <stddef.h>

#define EL_QK 32 /* weights and activations are quantized in blocks of 32 along K */

/* Weights are stored in groups of EL_ROWS rows: for each block of 32 inputs, one header with the
 * group's scales and the quants of all its rows interleaved 4 bytes at a time, so that one 32-byte
 * vector holds 4 consecutive quants of each of the 8 rows and an integer dot-product instruction
 * (vpdpbusd, sdot) leaves one row's partial sum in each 32-bit lane. A matrix W[N, K] (N a multiple
 * of EL_ROWS) is N / EL_ROWS groups, each K / 32 of these blocks in order of K. */
#define EL_ROWS 8

/* 4-bit block of 8 rows x 32 weights: w[r][j] = d[r] * q + m[r], q in 0..15, d and m IEEE half.
 * Byte 32 t + 4 r + b of qs (t < 4, r < 8, b < 4) holds q[r][4 t + b] in its low nibble and
 * q[r][16 + 4 t + b] in its high nibble. (Row r's 16 bytes, in order t, b, are llama.cpp's Q4_1 quants.) */
typedef struct {
    uint16_t d[EL_ROWS];
    uint16_t m[EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK / 2];
} el_block_q4x8;

/* 8-bit block of 8 rows x 32 weights: w[r][j] = d[r] * q, q in -127..127, d IEEE half.
 * Byte 32 t + 4 r + b of qs (t < 8, r < 8, b < 4) is q[r][4 t + b]. */
typedef struct {
    uint16_t d[EL_ROWS];
    int8_t qs[EL_ROWS * EL_QK];
} el_block_q8x8;

/* Blocks held exactly as a GGUF stores them (llama.cpp's Q5_0, Q4_K, Q6_K), in groups of 8 rows. A row block is
 * the GGUF block's bytes; a group stores each of its fields for the 8 rows together: a field of 2-byte halves as the
 * 8 rows' halves, a field of scale bytes as [byte][row], and quant bytes in runs of 4 per row ([run][row][4], as
 * q4 / q8 above), so one 32-byte vector holds 4 quant bytes of each of the 8 rows. Sizes are 8x the GGUF block. */

/* Q5_0, 8 rows x 32: w = d * (q - 16), q = low 4 bits from qs (byte b: element b low nibble, b + 16 high, as Q4_0)
 * | high bit << 4. qh[4 r + b] (row r's 4 bytes, the GGUF's 32 high bits permuted): bit t (t < 4) is the high bit of
 * element 4 t + b, bit 4 + t that of element 16 + 4 t + b, so for quant vector t the high bits of byte 4 r + b are
 * bit t (low nibble) and bit 4 + t (high nibble) of the same byte of qh. */
typedef struct {
    uint16_t d[EL_ROWS];
    uint8_t qh[EL_ROWS * 4];
    uint8_t qs[EL_ROWS * EL_QK / 2];
} el_block_q5_0x8;

#define EL_QK_K 256 /* weights per K-quant super-block */

/* Q4_K, 8 rows x 256 (8 sub-blocks of 32): w = d * sc[j] * q - dmin * mn[j], sc / mn 6-bit from the GGUF's 12 scale
 * bytes (scales[i][r] = row r's byte i), q 4-bit: qs run t (t < 32, byte 32 t + 4 r + b = row r's qs byte 4 t + b),
 * low nibble = element (t / 8) * 64 + 4 (t % 8) + b, high nibble 32 further. */
typedef struct {
    uint16_t d[EL_ROWS];
    uint16_t dmin[EL_ROWS];
    uint8_t scales[12][EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK_K / 2];
} el_block_q4_kx8;

/* Q6_K, 8 rows x 256 (16 sub-blocks of 16): w = d * sc[j] * (q - 32), sc int8 (scales[j][r]), q 6-bit: low 4 bits
 * from ql, high 2 from qh (both in runs of 4 per row as above; the GGUF's element order within them). */
typedef struct {
    uint16_t d[EL_ROWS];
    int8_t scales[16][EL_ROWS];
    uint8_t ql[EL_ROWS * EL_QK_K / 2];
    uint8_t qh[EL_ROWS * EL_QK_K / 4];
} el_block_q6_kx8;

/* Q5_1, 8 rows x 32: w = d * q + m, q as Q5_0's (5 bits, the same permuted high bits in qh). */
typedef struct {
    uint16_t d[EL_ROWS];
    uint16_t m[EL_ROWS];
    uint8_t qh[EL_ROWS * 4];
    uint8_t qs[EL_ROWS * EL_QK / 2];
} el_block_q5_1x8;

/* Q2_K, 8 rows x 256 (16 sub-blocks of 16): w = d * (sc[j] & 15) * q - dmin * (sc[j] >> 4), scales[j][r] row r's
 * byte j, q 2-bit: row r's qs byte 32 c + l (c < 2, l < 32; in runs of 4 per row) holds element 128 c + 32 s + l in
 * bits 2 s. */
typedef struct {
    uint16_t d[EL_ROWS];
    uint16_t dmin[EL_ROWS];
    uint8_t scales[16][EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK_K / 4];
} el_block_q2_kx8;

/* Q3_K, 8 rows x 256 (16 sub-blocks of 16): w = d * sc[j] * (q - 4 + 4 h), sc[j] signed 6-bit from the GGUF's 12
 * scale bytes (scales[i][r]: low 4 bits nibble j / 8 of byte j % 8, high 2 bits bits 2 (j / 4) of byte 8 + j % 4,
 * minus 32), q 2-bit as Q2_K's, h bit s' of row r's hmask byte l for element 32 s' + l (both in runs of 4). */
typedef struct {
    uint16_t d[EL_ROWS];
    uint8_t scales[12][EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK_K / 4];
    uint8_t hmask[EL_ROWS * EL_QK_K / 8];
} el_block_q3_kx8;

/* Q5_K, 8 rows x 256: Q4_K's fields and element order, q 5-bit: the high bit of element 32 j + l is bit j of row r's
 * qh byte l (in runs of 4 per row). */
typedef struct {
    uint16_t d[EL_ROWS];
    uint16_t dmin[EL_ROWS];
    uint8_t scales[12][EL_ROWS];
    uint8_t qh[EL_ROWS * EL_QK_K / 8];
    uint8_t qs[EL_ROWS * EL_QK_K / 2];
} el_block_q5_kx8;

/* Q4_0, 8 rows x 32: w = d * (q - 8), q 4-bit in qs as el_block_q4x8's (row r's 16 bytes in runs of 4 are the GGUF's
 * quant bytes: byte b holds element b in its low nibble, b + 16 in its high one). */
typedef struct {
    uint16_t d[EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK / 2];
} el_block_q4_0x8;

/* IQ4_NL, 8 rows x 32: w = d * el_iq4_nl_values[q], q 4-bit as Q4_0's (the same fields and order). */
typedef struct {
    uint16_t d[EL_ROWS];
    uint8_t qs[EL_ROWS * EL_QK / 2];
} el_block_iq4_nlx8;

/* IQ4_NL's 16 quant values (the format's non-linear grid, as llama.cpp defines it). */
static const int8_t el_iq4_nl_values[16] __attribute__((unused)) = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* 8-bit activation block (32 values): x ~= d * q; s = d * sum(q) (for the q4 min term). */
typedef struct {
    float d;
    float s;
    int8_t qs[EL_QK];
} el_block_q8a;

/* Weight formats: 0 = f32 (plain float rows of K), 4 = q4 (el_block_q4x8 groups), 8 = q8 (el_block_q8x8), and the
 * GGUF blocks held exactly: q4_0 (el_block_q4_0x8), iq4_nl (el_block_iq4_nlx8), q5_0 (el_block_q5_0x8), ... */
enum { EL_F32 = 0, EL_Q4 = 4, EL_Q8 = 8, EL_Q4_0 = 40, EL_Q5_0 = 50, EL_Q5_1 = 51, EL_Q2_K = 102, EL_Q3_K = 103,
       EL_Q4_K = 104, EL_Q5_K = 105, EL_Q6_K = 106, EL_IQ4_NL = 204 };

/* Weights per block along K (32, or 256 for the K-quants) and bytes per 8-row group block; 0 for an unknown fmt. */
static inline int el_fmt_block_k(int fmt) {
    switch (fmt) {
        case EL_Q4: case EL_Q8: case EL_Q4_0: case EL_IQ4_NL: case EL_Q5_0: case EL_Q5_1: return EL_QK;
        case EL_Q2_K: case EL_Q3_K: case EL_Q4_K: case EL_Q5_K: case EL_Q6_K: return EL_QK_K;
        default: return 0;
    }
}
static inline size_t el_fmt_group_bytes(int fmt) {
    switch (fmt) {
        case EL_Q4: return sizeof(el_block_q4x8);
        case EL_Q8: return sizeof(el_block_q8x8);
        case EL_Q4_0: return sizeof(el_block_q4_0x8);
        case EL_IQ4_NL: return sizeof(el_block_iq4_nlx8);
        case EL_Q5_0: return sizeof(el_block_q5_0x8);
        case EL_Q4_K: return sizeof(el_block_q4_kx8);
        case EL_Q6_K: return sizeof(el_block_q6_kx8);
        case EL_Q5_1: return sizeof(el_block_q5_1x8);
        case EL_Q2_K: return sizeof(el_block_q2_kx8);
        case EL_Q3_K: return sizeof(el_block_q3_kx8);
        case EL_Q5_K: return sizeof(el_block_q5_kx8);
        default: return 0;
    }
}
/* Q4_K's 6-bit scale and min of sub-block j of row r from a group's scale bytes (scales[i][r] at s[i * EL_ROWS]; pass
 * &blk->scales[0][r]), as llama.cpp's get_scale_min_k4. */
static inline void el_q4_k_scale_min(const uint8_t *s, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = s[j * EL_ROWS] & 63, *mn = s[(j + 4) * EL_ROWS] & 63;
    } else {
        *sc = (s[(j + 4) * EL_ROWS] & 15) | ((s[(j - 4) * EL_ROWS] >> 6) << 4);
        *mn = (s[(j + 4) * EL_ROWS] >> 4) | ((s[j * EL_ROWS] >> 6) << 4);
    }
}

/* 1 if fmt is a block format and K a whole number of its blocks. */
static inline int el_fmt_ok(int fmt, int k) { return el_fmt_block_k(fmt) && k >= 0 && k % el_fmt_block_k(fmt) == 0; }

typedef struct el_pool el_pool; /* the thread pool, see below */

/* Name of the variant this library was compiled for ("scalar", "avx2", "avx512", "neon", ...). */
const char *el_variant(void);

/* x[K] (K a multiple of 32) -> K/32 activation blocks. */
void el_quantize_act(const float *x, int k, el_block_q8a *out);

/* y[r] = sum_k W[r, k] * x[k] for rows r0 <= r < r1 (multiples of EL_ROWS), with x given as
 * quantized blocks. */
void el_gemv_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1);
void el_gemv_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, float *y, int r0, int r1);

/* The same for any block format (el_fmt_ok(fmt, k)). */
void el_gemm_fmt(int fmt, const void *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1);

/* GEMM: y[i * ldy + r] = W[r, :] . x_i for 0 <= i < m, r0 <= r < r1 (multiples of EL_ROWS), where
 * x_i = x + i * (k / 32). A group's block is unpacked once for a tile of activation rows. */
void el_gemm_q4(const el_block_q4x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1);
void el_gemm_q8(const el_block_q8x8 *w, int k, const el_block_q8a *x, int m, float *y, int ldy, int r0, int r1);

/* y[M, N] = x[M, K] @ W.T (row-major x and y) for a q4 / q8 weight (fmt EL_Q4 / EL_Q8) of N / 8
 * groups: quantizes x, then hands out (row group, activation tile) chunks to the pool's threads (pool
 * may be NULL: the caller's thread only). Returns 0, or -1 on a bad argument (K % 32 != 0,
 * N % 8 != 0) or allocation failure. */
int el_linear(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y);

/* IEEE half -> float, exact (portable). */
float el_half_to_float(uint16_t h);

/* float -> IEEE half, round to nearest even as torch's .half() (subnormals, infinities; NaN -> 0x7e00). */
uint16_t el_float_to_half(float f);

/* out[el_fmt_block_k(fmt)] = the float weights of row r (< 8) of one 8-row group block of a block format: for q5_0,
 * q4_k and q6_k the values gguf-py's dequantize gives, bit for bit (the same float32 operations in the same order). */
void el_block_row_f32(int fmt, const void *block, int r, float *out);
/* The same for q4_0, iq4_nl, q5_1, q2_k, q3_k, q5_k (ops/dequant_kquants.c); returns -1 (nothing written) for another fmt. Hidden:
 * el_block_row_f32's helper inside the library, not exported. */
__attribute__((visibility("hidden"))) int el_block_row_f32_kquant(int fmt, const void *block, int r, float *out);

/* out[(r - r0) * k + j] = W[r, j] as bf16 (round to nearest even) for rows r0 <= r < r1 (multiples
 * of EL_ROWS) of a q4 / q8 weight; row groups are handed out to the pool's threads (pool may be NULL).
 * Returns 0, or -1 on a bad argument. */
int el_dequant_bf16(el_pool *pool, int fmt, const void *w, int k, int r0, int r1, uint16_t *out);

/* y[M, N] = x[M, K] @ W.T for a q4 / q8 weight (fmt EL_Q4 / EL_Q8) and float rows x, y, as prefill
 * multiplies: x rounded to bf16 (to nearest even, as torch's .bfloat16()), each tile of 32 weight rows
 * dequantized to bf16 in cache, products summed in float32 by bf16 dot-product instructions
 * (AVX512-BF16). Tiles are handed out to the pool's threads (pool may be NULL). Returns 0; -1 on a
 * bad argument (K % 32, N % 8) or an allocation failure; -2 where this library or this CPU and OS
 * have no AVX512-BF16 (nothing is written: the caller multiplies another way). */
int el_gemm_bf16(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y);

/* y[M, N] = x[M, K] @ W.T for a q4 / q8 weight (fmt EL_Q4 / EL_Q8) and float rows x, y, in float32 throughout:
 * each tile of 32 weight rows dequantized exactly (d * q + m, d and m IEEE halves) into a buffer that stays in cache,
 * multiplied by the activations with 8-lane vector multiply-adds (every variant, scalar included). Each y[i][r] is
 * one chain of multiply-adds over k in order: the same bits for any pool and any M. Tiles (and, when they are few,
 * blocks of activation rows) are handed out to the pool's threads (pool may be NULL). Returns 0; -1 on a bad
 * argument (K % 32, N % 8) or an allocation failure. */
int el_gemm_f32(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y);

/* y[M, N] = x[M, K] @ W.T with x's rows quantized as the decode step's (el_quantize_act) and integer products, one
 * float multiply-add per block of 32 (matmul/gemm_i8.c), for the x86 libraries' prefill where AVX512-BF16 is
 * missing. Each y[i][r] is summed in a fixed order: the same bits for any pool and any M. Returns 0; -1 on a bad
 * argument or an allocation failure; -2 (nothing written) for a format it does not take (q8, q2_k, q3_k, iq4_nl)
 * and in the libraries of other architectures. */
int el_gemm_i8(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y);

/* The matmul el_decoder_prefill* multiply with in this library on this CPU: "bf16" (el_gemm_bf16, AVX512-BF16),
 * "int8" (el_gemm_i8, and el_gemm_f32 for the formats it does not take), "f32" (el_gemm_f32), or NULL where this library has no native prefill (the scalar variant: the prefill returns -2
 * and callers go token by token through the decode step, or through torch). */
const char *el_prefill_matmul(void);

/* What the CPU and the OS allow: 1 if the named variant ("scalar", "avx2", "avxvnni", "avx512",
 * "neon", "neon-dotprod"), or the "avx512bf16" extension el_gemm_bf16 uses, can run here, from CPUID + XCR0 on x86 and HWCAP on aarch64. */
int el_cpu_allows(const char *variant);
/* XCR0 (the register states the OS enables), 0 where there is none. */
uint64_t el_cpu_xcr0(void);
/* 1 where the core runs a 512-bit vector operation as two 256-bit halves (AMD Zen 4: family 0x19 with AVX-512), so
 * a zmm kernel gains only what it saves in instructions; 0 elsewhere. */
int el_cpu_splits_zmm(void);

/* Thread pool: workers stay hot (spin, then sleep) between jobs. el_pool_run calls fn(ctx, ith, nth)
 * on the caller (ith 0) and on every worker that picks the job up before the caller's call returns,
 * then waits for those: fn must hand out its work dynamically (e.g. an atomic chunk counter), never
 * by ith, so that a worker descheduled on a busy machine is not waited for. */
typedef void (*el_task_fn)(void *ctx, int ith, int nth);
el_pool *el_pool_create(int nthreads);
/* The same with idle workers spinning spin_us microseconds before they sleep (el_pool_create: 200, or
 * EDGELLM_SPIN_US). 0 suits jobs separated by other work on the same cores, as prefill's matmuls are. */
el_pool *el_pool_create_spin(int nthreads, long spin_us);
void el_pool_run(el_pool *pool, el_task_fn fn, void *ctx);
int el_pool_threads(const el_pool *pool);
void el_pool_destroy(el_pool *pool);

#endif
