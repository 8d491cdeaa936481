/* Prefill's integer matmul for the x86 libraries (avx2, avxvnni, and avx512 where AVX512-BF16 is missing):
 * y[M, N] = x[M, K] @ W.T with the activation rows quantized as the decode step quantizes them (el_quantize_act:
 * int8 per block of 32 with a float scale) and the weights' integer quants multiplied by them exactly in integers,
 * as the decode step's kernels do; per block of 32 one float multiply-add applies the scales. On a core whose
 * float multiply-adds are the limit (AVX2 without AVX512-BF16), vpmaddubsw multiplies 32 byte pairs per
 * instruction against a multiply-add's 8 floats.
 *
 * Formats: the linear ones whose quants fit 6 bits (q4, q4_0, q5_0, q5_1, q4_k, q5_k: w = a q + c per block of 32)
 * and q6_k (w = d sc (q - 32), a scale per 16). el_gemm_i8 answers -2 for any other (q8, q2_k, q3_k, iq4_nl: the
 * caller multiplies those in float32) and in the libraries of other architectures.
 *
 * A work item is a tile of 16 weight rows (two 8-row groups) and up to MB activation rows. K goes by in chunks of
 * KCB blocks: the tile's chunk is unpacked once into a panel (a block's 8 vectors of unsigned quants per group,
 * vector t pairing with activation dword t, and its float scales), which stays in L1 while each activation row
 * of the item passes over it. Each y[i][r] is the sum over chunks, in order, of one chain of multiply-adds over the
 * chunk's blocks in order: the same bits for any thread count and any split of M. Items go out through an atomic
 * counter (el_pool contract); the activation rows are quantized first, by the pool's threads as well. */
#include <stdatomic.h>
#include <stdlib.h>

#include "edgellm_kernels.h"

#include "arch/isa.h"

#if defined(EL_AVX2) || defined(EL_AVX512)

#include "arch/x86/int8_dot.h"

#define NG 2    /* 8-row groups per tile */
#define KCB 32  /* blocks of 32 per chunk: 1024 k, the panel's quants 16 KiB */
#define MB 64   /* activation rows per item at most */
#define QROWS 8 /* activation rows per quantization item */

/* One tile's chunk: quants q[b][g][t] (row r's 4 quants pairing with activation dword t in bytes 4r..4r+3), and per
 * block and group: a (the scale of the integer sum), c (of the activation block's sum s = dx sum(xq)). For q6_k, a
 * is d and sc holds the scales of the block's two halves of 16 (int16 pairs (sc, sc) per row for vpmaddwd; int32 with
 * VNNI), c of each half (-32 d sc) times dx times that half's sum of activation quants. */
typedef struct {
    __m256i q[KCB][NG][8];
    __m256 a[KCB][NG], c[KCB][NG][2];
    __m256i sc[KCB][NG][2];
} panel;

/* Blocks b0..b1-1 (of 32) of group gi into panel slot g: quants, a and c. */
static void unpack(int fmt, const void *w, int nb, int gi, int b0, int b1, panel *p, int g) {
    const __m256i m4 = _mm256_set1_epi8(15), b4 = _mm256_set1_epi8(16);
    const size_t gbytes = el_fmt_group_bytes(fmt) * (size_t)nb;
    const char *grp = (const char *)w + (size_t)gi * gbytes;
    __m256 ds[8], dm[8]; /* Q4_K / Q5_K: the current super-block's d sc and dmin mn per sub-block */
    for (int b = b0; b < b1; b++) {
        const int o = b - b0;
        __m256i *v = p->q[o][g];
        if (fmt == EL_Q4 || fmt == EL_Q4_0) { /* nibbles: low = element 4t + c, high = 16 + 4t + c */
            const el_block_q4x8 *q4 = (const el_block_q4x8 *)grp + b;
            const el_block_q4_0x8 *q40 = (const el_block_q4_0x8 *)grp + b;
            const uint8_t *qs = fmt == EL_Q4 ? q4->qs : q40->qs;
            for (int t = 0; t < 4; t++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * t));
                v[t] = _mm256_and_si256(raw, m4);
                v[4 + t] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
            }
            const __m256 d = halves(fmt == EL_Q4 ? q4->d : q40->d);
            p->a[o][g] = d;
            p->c[o][g][0] = fmt == EL_Q4 ? halves(q4->m) : _mm256_mul_ps(d, _mm256_set1_ps(-8.f));
        } else if (fmt == EL_Q5_0 || fmt == EL_Q5_1) { /* as q4, the fifth bit from qh (edgellm_kernels.h) */
            const el_block_q5_0x8 *q50 = (const el_block_q5_0x8 *)grp + b;
            const el_block_q5_1x8 *q51 = (const el_block_q5_1x8 *)grp + b;
            const uint8_t *qs = fmt == EL_Q5_0 ? q50->qs : q51->qs;
            const __m256i h = _mm256_loadu_si256((const __m256i *)(fmt == EL_Q5_0 ? q50->qh : q51->qh));
            for (int t = 0; t < 4; t++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 32 * t));
                const __m256i lo_h = _mm256_srlv_epi32(h, _mm256_set1_epi32(t)), hi_h = _mm256_srlv_epi32(h, _mm256_set1_epi32(4 + t));
                v[t] = _mm256_or_si256(_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_slli_epi16(lo_h, 4), b4));
                v[4 + t] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4),
                                           _mm256_and_si256(_mm256_slli_epi16(hi_h, 4), b4));
            }
            const __m256 d = halves(fmt == EL_Q5_0 ? q50->d : q51->d);
            p->a[o][g] = d;
            p->c[o][g][0] = fmt == EL_Q5_0 ? _mm256_mul_ps(d, _mm256_set1_ps(-16.f)) : halves(q51->m);
        } else if (fmt == EL_Q4_K || fmt == EL_Q5_K) { /* sub-block j = b % 8 of super-block b / 8 */
            const int sb = b / 8, j = b % 8, c = j / 2, hi = j % 2;
            const el_block_q4_kx8 *k4 = (const el_block_q4_kx8 *)grp + sb;
            const el_block_q5_kx8 *k5 = (const el_block_q5_kx8 *)grp + sb;
            const uint8_t *qs = fmt == EL_Q4_K ? k4->qs : k5->qs;
            for (int t = 0; t < 8; t++) {
                const __m256i raw = _mm256_loadu_si256((const __m256i *)(qs + 256 * c + 32 * t));
                v[t] = _mm256_and_si256(hi ? _mm256_srli_epi16(raw, 4) : raw, m4);
                if (fmt == EL_Q5_K) { /* bit j of row r's qh byte: the high bit of element 32 j + l */
                    const __m256i h = _mm256_loadu_si256((const __m256i *)(k5->qh + 32 * t));
                    v[t] = _mm256_or_si256(v[t], _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(h, j), 4), b4));
                }
            }
            if (j == 0) /* chunks start on a super-block (KCB is a multiple of 8) */
                k_scales_mins(fmt == EL_Q4_K ? k4->scales : k5->scales, halves(fmt == EL_Q4_K ? k4->d : k5->d),
                              halves(fmt == EL_Q4_K ? k4->dmin : k5->dmin), ds, dm);
            p->a[o][g] = ds[j];
            p->c[o][g][0] = _mm256_xor_ps(dm[j], _mm256_set1_ps(-0.0f)); /* -dmin mn */
        } else { /* EL_Q6_K: block b is activation block xi = 4h + q4 of super-block b / 8 (arch/x86/gemv.inc) */
            const int sb = b / 8, h = (b % 8) / 4, q4 = b % 4;
            const el_block_q6_kx8 *k6 = (const el_block_q6_kx8 *)grp + sb;
            const __m256i m2 = _mm256_set1_epi8(0x30);
            for (int t = 0; t < 8; t++) {
                const __m256i lo = _mm256_loadu_si256((const __m256i *)(k6->ql + 512 * h + 256 * (q4 & 1) + 32 * t));
                const __m256i qh = _mm256_loadu_si256((const __m256i *)(k6->qh + 256 * h + 32 * t));
                const __m256i l4 = q4 < 2 ? lo : _mm256_srli_epi16(lo, 4);
                const __m256i h2 = q4 == 0 ? _mm256_slli_epi16(qh, 4) : q4 == 1 ? _mm256_slli_epi16(qh, 2)
                                 : q4 == 2 ? qh : _mm256_srli_epi16(qh, 2);
                v[t] = _mm256_or_si256(_mm256_and_si256(l4, m4), _mm256_and_si256(h2, m2));
            }
            const __m256 d = halves(k6->d);
            p->a[o][g] = d;
            for (int hh = 0; hh < 2; hh++) {
                const int s = 8 * h + 2 * q4 + hh;
                const __m256i sc32 = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)k6->scales[s]));
#if defined(EL_VNNI)
                p->sc[o][g][hh] = sc32;
#else
                p->sc[o][g][hh] = _mm256_or_si256(_mm256_and_si256(sc32, _mm256_set1_epi32(0xffff)),
                                                  _mm256_slli_epi32(sc32, 16)); /* (sc, sc) int16 per row */
#endif
                p->c[o][g][hh] = _mm256_mul_ps(_mm256_mul_ps(d, _mm256_set1_ps(-32.f)), _mm256_cvtepi32_ps(sc32));
            }
        }
    }
}

/* q6_k's half-block sum times its scale: quants <= 63, so without VNNI two vpmaddubsw per int16 sum, widened by
 * vpmaddwd against (sc, sc). */
static inline __attribute__((always_inline)) __m256i isum6(const __m256i *v, const el_block_q8a *x, int t0, __m256i sc) {
#if defined(EL_VNNI)
    return _mm256_mullo_epi32(dot_u(v, x, t0, t0 + 4, 4), sc);
#else
    const __m256i s0 = _mm256_add_epi16(_mm256_maddubs_epi16(v[t0], xdword(x, t0)), _mm256_maddubs_epi16(v[t0 + 1], xdword(x, t0 + 1)));
    const __m256i s1 = _mm256_add_epi16(_mm256_maddubs_epi16(v[t0 + 2], xdword(x, t0 + 2)), _mm256_maddubs_epi16(v[t0 + 3], xdword(x, t0 + 3)));
    return _mm256_add_epi32(_mm256_madd_epi16(s0, sc), _mm256_madd_epi16(s1, sc));
#endif
}

typedef struct {
    int fmt, n, k, m, mblocks;
    const void *w;
    const float *x;
    el_block_q8a *xq;
    float *hsum; /* q6_k: dx times each half-block's sum of quants, [m][2 K / 32] */
    float *y;
    atomic_int next, qnext, done, qdone;
} i8_job;

/* el_quantize_act of one row in 8-lane vectors, the same float operations (amax / 127, 127 / amax, x * id rounded to
 * nearest even by vcvtps2dq in the default rounding mode, as nearbyintf), so the same blocks; with q6_k (hsum) also
 * dx times each half-block's sum of quants. */
static void quantize_row(const float *x, int k, el_block_q8a *out, float *hsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int b = 0; b < k / EL_QK; b++, x += EL_QK) {
        __m256 v[4], mx = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) v[j] = _mm256_loadu_ps(x + 8 * j), mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v[j]));
        __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
        m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
        m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
        const float amax = _mm_cvtss_f32(m4), d = amax / 127.0f, id = amax > 0.0f ? 127.0f / amax : 0.0f;
        __m256i q[4];
        for (int j = 0; j < 4; j++) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], _mm256_set1_ps(id)));
        /* int32 -> int8 in element order: packs interleave 128-bit lanes, the permute puts them back */
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(p16a, p16b), _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].qs, p8);
        const __m256i h0 = _mm256_add_epi32(q[0], q[1]), h1 = _mm256_add_epi32(q[2], q[3]);
        __m128i s0 = _mm_add_epi32(_mm256_castsi256_si128(h0), _mm256_extracti128_si256(h0, 1));
        __m128i s1 = _mm_add_epi32(_mm256_castsi256_si128(h1), _mm256_extracti128_si256(h1, 1));
        s0 = _mm_hadd_epi32(s0, s1);
        s0 = _mm_hadd_epi32(s0, s0); /* lanes: sum of the first 16, of the second 16 */
        const int first = _mm_cvtsi128_si32(s0), second = _mm_extract_epi32(s0, 1);
        out[b].d = d;
        out[b].s = d * (float)(first + second);
        if (hsum) hsum[2 * b] = d * (float)first, hsum[2 * b + 1] = d * (float)second;
    }
}

static void quantize_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    i8_job *j = ctx;
    const int nbx = j->k / EL_QK;
    for (int r0; (r0 = atomic_fetch_add(&j->qnext, QROWS)) < j->m;) {
        for (int i = r0; i < r0 + QROWS && i < j->m; i++)
            quantize_row(j->x + (size_t)i * j->k, j->k, j->xq + (size_t)i * nbx, j->hsum ? j->hsum + (size_t)i * nbx * 2 : NULL);
        atomic_fetch_add(&j->qdone, 1);
    }
}

static void gemm_task(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    i8_job *j = ctx;
    const int tiles = (j->n / EL_ROWS + NG - 1) / NG, items = tiles * j->mblocks, nbx = j->k / EL_QK;
    const int per = (j->fmt == EL_Q4 || j->fmt == EL_Q4_0 || j->fmt == EL_Q4_K) ? 8 : 4;
    const int six = j->fmt == EL_Q6_K, bk = el_fmt_block_k(j->fmt) / EL_QK;
    panel *p = NULL;
    for (int it; (it = atomic_fetch_add(&j->next, 1)) < items;) {
        if (!p && !(p = aligned_alloc(64, sizeof *p))) return; /* the others take the items */
        const int tn = it / j->mblocks, tm = it % j->mblocks;
        const int g0 = tn * NG, groups = j->n / EL_ROWS - g0 < NG ? j->n / EL_ROWS - g0 : NG;
        const int mb = (j->m + j->mblocks - 1) / j->mblocks, i0 = tm * mb, i1 = i0 + mb < j->m ? i0 + mb : j->m;
        for (int b0 = 0; b0 < nbx; b0 += KCB) {
            const int b1 = b0 + KCB < nbx ? b0 + KCB : nbx;
            for (int g = 0; g < NG; g++) /* a lone last group fills both slots; the second's sums are not stored */
                unpack(j->fmt, j->w, nbx / bk, g0 + (g < groups ? g : 0), b0, b1, p, g);
            for (int i = i0; i < i1; i++) {
                const el_block_q8a *xr = j->xq + (size_t)i * nbx;
                const float *hs = j->hsum ? j->hsum + (size_t)i * nbx * 2 : NULL;
                __m256 acc[NG] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
                for (int b = b0; b < b1; b++) {
                    const el_block_q8a *xb = xr + b;
                    const __m256 dx = _mm256_set1_ps(xb->d);
                    const int o = b - b0;
                    if (six) {
                        const __m256 h0 = _mm256_set1_ps(hs[2 * b]), h1 = _mm256_set1_ps(hs[2 * b + 1]);
                        for (int g = 0; g < NG; g++) {
                            const __m256i *v = p->q[o][g];
                            const __m256i s = _mm256_add_epi32(isum6(v, xb, 0, p->sc[o][g][0]), isum6(v, xb, 4, p->sc[o][g][1]));
                            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(p->a[o][g], dx), acc[g]);
                            acc[g] = _mm256_fmadd_ps(p->c[o][g][0], h0, acc[g]);
                            acc[g] = _mm256_fmadd_ps(p->c[o][g][1], h1, acc[g]);
                        }
                    } else {
                        const __m256 sx = _mm256_set1_ps(xb->s);
                        for (int g = 0; g < NG; g++) {
                            const __m256i s = per == 8 ? dot_u(p->q[o][g], xb, 0, 8, 8) : dot_u(p->q[o][g], xb, 0, 8, 4);
                            acc[g] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(p->a[o][g], dx), acc[g]);
                            acc[g] = _mm256_fmadd_ps(p->c[o][g][0], sx, acc[g]);
                        }
                    }
                }
                float *yr = j->y + (size_t)i * j->n + (size_t)g0 * EL_ROWS;
                for (int g = 0; g < groups; g++) {
                    const __m256 prev = b0 ? _mm256_loadu_ps(yr + 8 * g) : _mm256_setzero_ps();
                    _mm256_storeu_ps(yr + 8 * g, b0 ? _mm256_add_ps(prev, acc[g]) : acc[g]);
                }
            }
        }
        atomic_fetch_add(&j->done, 1);
    }
    free(p);
}

static int i8_format(int fmt) {
    return fmt == EL_Q4 || fmt == EL_Q4_0 || fmt == EL_Q5_0 || fmt == EL_Q5_1 || fmt == EL_Q4_K || fmt == EL_Q5_K ||
           fmt == EL_Q6_K;
}

int el_gemm_i8(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    if (!el_fmt_ok(fmt, k) || k <= 0 || n <= 0 || n % EL_ROWS || m < 0) return -1;
    if (!i8_format(fmt)) return -2;
    if (m == 0) return 0;
    const int nbx = k / EL_QK, tiles = (n / EL_ROWS + NG - 1) / NG;
    const int mblocks = (m + MB - 1) / MB;
    i8_job job = {fmt, n, k, m, mblocks, w, x, NULL, NULL, y, 0, 0, 0, 0};
    job.xq = malloc((size_t)m * nbx * sizeof(el_block_q8a));
    if (fmt == EL_Q6_K) job.hsum = malloc((size_t)m * nbx * 2 * sizeof(float));
    int rc = -1;
    if (job.xq && (fmt != EL_Q6_K || job.hsum)) {
        if (pool) el_pool_run(pool, quantize_task, &job);
        else quantize_task(&job, 0, 1);
        if (atomic_load(&job.qdone) == (m + QROWS - 1) / QROWS) {
            if (pool) el_pool_run(pool, gemm_task, &job);
            else gemm_task(&job, 0, 1);
            rc = atomic_load(&job.done) == tiles * mblocks ? 0 : -1;
        }
    }
    free(job.xq);
    free(job.hsum);
    return rc;
}

#else

int el_gemm_i8(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    (void)pool, (void)w, (void)x, (void)y;
    if (!el_fmt_ok(fmt, k) || k <= 0 || n <= 0 || n % EL_ROWS || m < 0) return -1;
    return -2;
}

#endif
