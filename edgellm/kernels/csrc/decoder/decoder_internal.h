/* What the native decoder's two files share: the decoder object (its public interface, the model description
 * among it, is edgellm_decoder.h), the work-claiming helpers and the small per-row ops both the single-token step
 * (decode.c) and the prefill (prefill.c) run. Private to the library: not part of edgellm_kernels.h. */
#ifndef EDGELLM_DECODER_INTERNAL_H
#define EDGELLM_DECODER_INTERNAL_H

#include "edgellm_decoder.h"
#include "edgellm_kernels.h"
#include "arch/vec.h"

#include <math.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

/* ---- the decoder ----------------------------------------------------------------------------------- */

#define EL_MAX_GROUP 64   /* query heads per KV head (el_decoder_check) */
#define EL_MAX_HEAD_DIM 512 /* a q8 tile holds 8 rows of it at least */
#define EL_CHUNK_ALIGN 32 /* rows per chunk are a multiple of this: whole activation blocks, whole cache lines */
#define EL_CHUNKS_PER_THREAD 4

typedef struct {
    _Alignas(64) atomic_int next; /* next chunk to hand out; alone on its cache line */
    _Alignas(64) int chunk, rows, nchunks;
} el_job;

struct el_decoder {
    el_model_desc m;
    el_layer_desc *layers;
    el_pool *pool;
    el_job job;
    /* scratch, 64-byte aligned */
    float *x, *xn, *qkv, *att, *tmp, *gate, *up, *scores;
    el_block_q8a *xq, *hq;
    size_t scores_cap; /* floats per head the scores buffer holds */
    int item_heads;    /* query heads per attention work item (heads_per_item) */
    /* the step in flight (read by the pool's tasks) */
    const el_layer_desc *layer;
    const el_matrix *mat; /* task_residual's weight and input */
    const el_block_q8a *act;
    const float *out_norm; /* set (a sandwich norm): task_residual leaves mat . act in tmp, normed later */
    float *kcache, *vcache, *logits; /* float32 cache (kh, kq == NULL) */
    uint16_t *kh, *vh;               /* IEEE half cache */
    int8_t *kq, *vq;                 /* int8 cache ... */
    float *kscale, *vscale;          /* ... and its per-token-per-head scales */
    int pos, capacity;
};

/* ---- small helpers ---------------------------------------------------------------------------------- */

static inline int imin(int a, int b) { return a < b ? a : b; }
static inline int imax(int a, int b) { return a > b ? a : b; }

static inline void *alloc_floats(size_t n) { return aligned_alloc(64, (n * sizeof(float) + 63) / 64 * 64); }

/* out[K] = row `token` of the embedding (f32 rows, or row token % 8 of a block format's row group). */
static inline void embed_row(const el_matrix *e, int token, float *out) {
    if (e->fmt == EL_F32) {
        memcpy(out, (const float *)e->data + (size_t)token * e->k, (size_t)e->k * sizeof(float));
        return;
    }
    const int bk = el_fmt_block_k(e->fmt), nb = e->k / bk;
    const size_t size = el_fmt_group_bytes(e->fmt);
    const char *group = (const char *)e->data + (size_t)(token / EL_ROWS) * nb * size;
    for (int i = 0; i < nb; i++) el_block_row_f32(e->fmt, group + (size_t)i * size, token % EL_ROWS, out + (size_t)i * bk);
}

/* x[0..n) . x[0..n), n a multiple of 8 (the model dimension is one of 32), in 8 float lanes. */
static inline float sum_squares(const float *x, int n) {
    el_v8f acc = {0};
    for (int i = 0; i < n; i += 8) {
        const el_v8f v = v8f_load(x + i);
        acc += v * v;
    }
    return v8f_hsum(acc);
}

static inline void rmsnorm(const float *x, const float *w, int n, float eps, float *out) {
    float r = 1.f / sqrtf(sum_squares(x, n) / n + eps);
    for (int i = 0; i < n; i++) out[i] = x[i] * r * w[i];
}

static inline void rope(float *v, const float *cos, const float *sin, int hd) {
    int half = hd / 2;
    for (int i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * cos[i] - b * sin[i];
        v[i + half] = b * cos[i + half] + a * sin[i + half];
    }
}

/* GELU, tanh approximation (torch's gelu(approximate="tanh")): 0.5 g (1 + tanh(u)) = g sigmoid(2u). */
static inline float gelu_tanh(float g) { return g / (1.f + expf(-1.5957691216057308f * (g + 0.044715f * g * g * g))); }

/* gate[i] = act(gate[i]) * up[i] for i < n, act SiLU or (gelu) GELU-tanh: act(g) = g sigmoid(u), u = g (SiLU)
 * or GELU's 2 (tanh argument). */
static inline void gated_activation(float *gate, const float *up, int n, int gelu) {
    int r = 0;
    for (; r + 8 <= n; r += 8) {
        const el_v8f g = v8f_load(gate + r);
        const el_v8f u = gelu ? 1.5957691216057308f * (g + 0.044715f * g * g * g) : g;
        v8f_store(gate + r, g * v8f_sigmoid(u) * v8f_load(up + r));
    }
    for (; r < n; r++) {
        float g = gate[r];
        gate[r] = (gelu ? gelu_tanh(g) : g / (1.f + expf(-g))) * up[r];
    }
}

/* ---- work distribution ------------------------------------------------------------------------------ */

static inline int decoder_threads(const el_decoder *d) { return d->pool ? el_pool_threads(d->pool) : 1; }

static inline int job_claim(el_job *j, int *r0, int *r1) {
    int c = atomic_fetch_add_explicit(&j->next, 1, memory_order_relaxed);
    if (c >= j->nchunks) return 0;
    *r0 = c * j->chunk;
    *r1 = imin(*r0 + j->chunk, j->rows);
    return 1;
}

/* Hand out `rows` work items `chunk` at a time from the start. */
static inline void job_reset(el_job *j, int rows, int chunk) {
    j->chunk = chunk, j->rows = rows, j->nchunks = (rows + chunk - 1) / chunk;
    atomic_store_explicit(&j->next, 0, memory_order_relaxed);
}

#if defined(__AVX512F__) && !defined(EL_SCALAR)
/* exp(x) for x <= 0 on 16 lanes, as v8f_exp_nonpositive: x = n ln2 + r, the same degree-7 polynomial,
 * times 2^n by vscalefps. */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
    static const float c[] = {1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
    __m512 poly = _mm512_set1_ps(1.f / 5040.f);
    for (int i = 0; i < 7; i++) poly = _mm512_fmadd_ps(poly, r, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(poly, n);
}
#endif

/* Rows t0..t0+m of `f` (float rows, returned in place), or of `h` (halves) or `q` (int8 rows, not scaled) widened
 * into `tile` (m * hd floats; hd a multiple of 8): the cache rows as the step's and the prefill's attention read
 * them. */
static inline const float *tile_rows(const float *f, const uint16_t *h, const int8_t *q, int t0, int m, int hd,
                                     float *tile) {
    const size_t at = (size_t)t0 * hd;
#if defined(__AVX512F__) && !defined(EL_SCALAR)
    if (h && hd % 16 == 0) {
        for (int i = 0; i < m * hd; i += 16)
            _mm512_storeu_ps(tile + i, _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(h + at + i))));
        return tile;
    }
#endif
    if (h)
        for (int i = 0; i < m * hd; i += 8) v8f_store(tile + i, v8f_load_f16(h + at + i));
    else if (q)
        for (int i = 0; i < m * hd; i += 8) v8f_store(tile + i, v8f_load_i8(q + at + i));
    else
        return f + at;
    return tile;
}

#endif
