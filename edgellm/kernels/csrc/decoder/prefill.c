/* Prefill in native code: a chunk of tokens through every layer in one call, the many-token sibling of
 * decode.c's step (same model description, same decoder object, same thread pool).
 *
 * The math is torch's prefill path (edgellm/models/transformer.py, blocks.py), in float32 but for the
 * matmul operands: all seven projections and the LM head go through el_gemm_bf16 (inputs rounded to bf16,
 * weights dequantized to bf16 tile by tile, float32 sums) as that path's quantized linears do, where the library
 * has it and the CPU allows AVX512-BF16; elsewhere, in the x86 libraries, through el_gemm_i8 (inputs quantized to
 * int8 per block of 32 as the decode step's, integer products) for the formats it takes, and through el_gemm_f32
 * (float32 operands, weights dequantized exactly) for the others and in the NEON libraries. Which one is fixed per process
 * (el_prefill_matmul says), so the results stay the same bits for any thread count and chunking. Around
 * them, row by row: embedding rows (and Gemma's scale), RMSNorms, q/k/v biases, per-head q/k norms, RoPE
 * with each layer's table, the residual adds (through the sandwich norms where the family has them), the
 * gated activation, the final norm and the logit soft-cap; these are handed out to the pool's threads
 * in chunks of rows.
 *
 * Attention reads the cache the step reads ([layers][kv_heads][capacity][head_dim], float32, IEEE half or int8
 * with a scale per row: el_decoder_prefill, _f16, _q8) after this chunk's keys and values are written into it
 * (rounded or quantized as the step does), so a chunk at start > 0 attends over the earlier ones, and every chunk
 * over its own keys/values as stored, as torch's KVCache.update/read has it.
 * Per layer the visible keys of each KV head are transposed once ([head_dim][positions], shared by every
 * thread; half and int8 rows widened to floats on the way, their values into a float copy); a work item is
 * one KV head and a tile of query positions with all the query heads of that KV head, taken six (position, head) rows at a time: their scores over the positions the six see (a
 * 6 x 64 register tile of multiply-adds over head_dim), each row's softmax over exactly its own window
 * (causal, and sliding where the layer has one; soft-capped first with EL_ATTN_SOFTCAP), zeros outside
 * it, then probabilities times values (a 6 x 64 tile over positions). Each score and output is a sum in
 * a fixed order that does not depend on the tiling or the thread, so the result is the same bits for
 * any thread count and however the prompt is chunked. Items go out through an atomic counter, the
 * costliest (latest positions) first.
 *
 * Built in every SIMD variant: the row ops and attention tiles in AVX-512 intrinsics (16 lanes) in the avx512
 * library, as they were, elsewhere in vec.h's 8-lane vector extensions (AVX2, NEON), the same algorithms and sum
 * orders within a library. The scalar variant has no prefill: el_decoder_prefill* return -2 there before touching
 * anything (callers go token by token through the decode step, or through torch). */
#include <string.h>

#include "decoder/decoder_internal.h"

#if !defined(EL_SCALAR)
#define EL_PREFILL 1
#if defined(__AVX512F__) && (defined(__clang__) || __GNUC__ >= 10)
#define EL_PREFILL_AVX512 1 /* the row ops in 16-lane AVX-512 (the bf16 GEMM's library); elsewhere vec.h's 8 lanes */
#include <immintrin.h>
#endif
#endif

#if defined(EL_PREFILL)

#define QROWS 6          /* (position, head) rows per attention register tile */
#define POS_CHUNK 64     /* positions per key-transposition work item */
#define MAX_TILE_POS 16  /* query positions per attention work item, at most */

typedef struct prefill prefill;
typedef void (*rows_fn)(prefill *p, int r0, int r1);

/* The KV cache kinds (edgellm/models/kv_cache.py): float32, IEEE half, int8 with a float32 scale per row. */
typedef enum { KV_F32, KV_F16, KV_Q8 } kv_kind;

/* One kind's cache: keys and values [n_layers][n_kv_heads][capacity][head_dim] (q8: scales [...][capacity]). */
typedef struct {
    kv_kind kind;
    float *k, *v;        /* KV_F32 */
    uint16_t *kh, *vh;   /* KV_F16 */
    int8_t *kq, *vq;     /* KV_Q8 ... */
    float *kscale, *vscale; /* ... and its scales */
} kv_cache;

struct prefill {
    el_job job;
    el_decoder *d;
    rows_fn fn; /* the row op in flight (task_rows) */
    const int32_t *tokens;
    int n, start, capacity;
    kv_cache c;
    float *x, *xn, *tmp;              /* [n][dim]: residual stream, normed input of a matmul, matmul output */
    float *q, *k, *v, *kt;            /* attention: [n][nq] (the output too), [n][nkv] x 2, keys transposed */
    float *vf;                        /* f16/q8: the visible values as floats, [n_kv_heads][span][head_dim] */
    float *gate, *up;                 /* MLP: [n][ffn] x 2 (the same memory as the attention's) */
    const el_layer_desc *L;
    size_t layer_off;                 /* floats before this layer's keys in the cache */
    const float *norm, *out_norm;     /* rows_residual: the next matmul's input norm, the sandwich norm */
    int row0;                         /* rows_final: first output row */
    float *logits;
    /* attention of the layer in flight */
    int kfirst, span, ldkt, tile_pos, tiles;
    atomic_int done; /* attention items finished (a thread that cannot allocate its scores leaves its share) */
};

/* ---- work distribution ------------------------------------------------------------------------------ */

static void task_rows(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    prefill *p = ctx;
    int r0, r1;
    while (job_claim(&p->job, &r0, &r1)) p->fn(p, r0, r1);
}

static void run(prefill *p, el_task_fn task, int items, int chunk) {
    job_reset(&p->job, items, chunk);
    if (p->d->pool) el_pool_run(p->d->pool, task, p);
    else task(p, 0, 1);
}

/* fn over rows 0..rows-1, a few chunks per thread. */
static void run_rows(prefill *p, rows_fn fn, int rows) {
    const int nth = decoder_threads(p->d);
    p->fn = fn;
    run(p, task_rows, rows, nth == 1 ? rows : imax(1, (rows + nth * EL_CHUNKS_PER_THREAD - 1) / (nth * EL_CHUNKS_PER_THREAD)));
}

/* el_gemm_bf16 where it runs (probed once: -2 without AVX512-BF16 in this library or on this CPU), else el_gemm_f32. */
static int bf16_gemm_available(void) {
    static atomic_int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        v = el_gemm_bf16(NULL, EL_Q4, NULL, EL_ROWS, EL_QK, NULL, 0, NULL) == 0;
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}

/* el_gemm_i8 where it runs (the x86 libraries) unless EDGELLM_PREFILL_GEMM=f32 asks for the exact float32 GEMM; read
 * once per process. */
static int i8_gemm_wanted(void) {
    static atomic_int known = -1;
    int v = atomic_load_explicit(&known, memory_order_relaxed);
    if (v < 0) {
        const char *env = getenv("EDGELLM_PREFILL_GEMM");
        v = !(env && !strcmp(env, "f32")) && el_gemm_i8(NULL, EL_Q4, NULL, EL_ROWS, EL_QK, NULL, 0, NULL) == 0;
        atomic_store_explicit(&known, v, memory_order_relaxed);
    }
    return v;
}

/* el_gemm_bf16 where it runs; else el_gemm_i8 where wanted, and el_gemm_f32 for the formats it does not take (-2),
 * with EDGELLM_PREFILL_GEMM=f32 and in the other libraries. */
static int gemm(prefill *p, const el_matrix *w, const float *x, int m, float *y) {
    if (bf16_gemm_available()) return el_gemm_bf16(p->d->pool, w->fmt, w->data, w->n, w->k, x, m, y);
    if (i8_gemm_wanted()) {
        const int rc = el_gemm_i8(p->d->pool, w->fmt, w->data, w->n, w->k, x, m, y);
        if (rc != -2) return rc;
    }
    return el_gemm_f32(p->d->pool, w->fmt, w->data, w->n, w->k, x, m, y);
}

/* ---- vector helpers ------------------------------------------------------------------------------------ */

#if defined(EL_PREFILL_AVX512)
#include "arch/x86/prefill_rows.inc"
#else
#include "arch/portable/prefill_rows.inc"
#endif

/* ---- the ops ------------------------------------------------------------------------------------------- */

/* x[r] = the embedding rows (scaled), xn[r] = their first attention norm */
static void rows_embed(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    for (int r = r0; r < r1; r++) {
        float *x = p->x + (size_t)r * m->dim;
        embed_row(&m->embed, p->tokens[r], x);
        if (m->flags & EL_EMBED_SCALE)
            for (int i = 0; i < m->dim; i++) x[i] *= m->embed_scale;
        rmsnorm(x, p->norm, m->dim, m->eps, p->xn + (size_t)r * m->dim);
    }
}

/* Biases, q/k norms, RoPE at the row's position, the attention scale on q; keys and values into the cache. */
static void rows_qkv(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    const el_layer_desc *L = p->L;
    const int hd = m->head_dim, nq = m->n_heads * hd, nkv = m->n_kv_heads * hd;
    for (int r = r0; r < r1; r++) {
        const int pos = p->start + r;
        const float *cos = L->rope_cos + (size_t)pos * hd, *sin = L->rope_sin + (size_t)pos * hd;
        float *q = p->q + (size_t)r * nq, *k = p->k + (size_t)r * nkv, *v = p->v + (size_t)r * nkv;
        if (L->q_bias)
            for (int i = 0; i < nq; i++) q[i] += L->q_bias[i];
        if (L->k_bias)
            for (int i = 0; i < nkv; i++) k[i] += L->k_bias[i];
        if (L->v_bias)
            for (int i = 0; i < nkv; i++) v[i] += L->v_bias[i];
        for (int h = 0; h < m->n_heads; h++) {
            float *head = q + (size_t)h * hd;
            if (m->flags & EL_QK_NORM) rmsnorm(head, L->q_norm, hd, m->eps, head);
            rope(head, cos, sin, hd);
            for (int i = 0; i < hd; i++) head[i] *= m->attn_scale;
        }
        for (int g = 0; g < m->n_kv_heads; g++) {
            float *head = k + (size_t)g * hd;
            if (m->flags & EL_QK_NORM) rmsnorm(head, L->k_norm, hd, m->eps, head);
            rope(head, cos, sin, hd);
            const size_t at = p->layer_off + ((size_t)g * p->capacity + pos) * hd;
            const float *val = v + (size_t)g * hd;
            switch (p->c.kind) { /* as decode.c's step stores them, bit for bit */
                case KV_F32:
                    memcpy(p->c.k + at, head, (size_t)hd * sizeof(float));
                    memcpy(p->c.v + at, val, (size_t)hd * sizeof(float));
                    break;
                case KV_F16:
                    for (int i = 0; i < hd; i++)
                        p->c.kh[at + i] = el_float_to_half(head[i]), p->c.vh[at + i] = el_float_to_half(val[i]);
                    break;
                case KV_Q8:
                    el_kv_quantize(head, hd, p->c.kq + at, p->c.kscale + at / hd);
                    el_kv_quantize(val, hd, p->c.vq + at, p->c.vscale + at / hd);
                    break;
            }
        }
    }
}

/* Rows t0..t0+m-1 of this layer's cache of KV head g (keys, or values when `values`) as the attention reads them:
 * float32 rows in place; half rows widened into `tile` (exactly); int8 rows widened into `tile` and multiplied by
 * their scales (q * scale in float32, as KVCache.read dequantizes them). */
static const float *cached_rows(const prefill *p, int values, int g, int t0, int m, float *tile) {
    const int hd = p->d->m.head_dim;
    const size_t row0 = p->layer_off / hd + (size_t)g * p->capacity; /* in rows: the scales' index too */
    const kv_cache *c = &p->c;
    const float *f = c->kind == KV_F32 ? (values ? c->v : c->k) + row0 * hd : NULL;
    const uint16_t *h = c->kind == KV_F16 ? (values ? c->vh : c->kh) + row0 * hd : NULL;
    const int8_t *q = c->kind == KV_Q8 ? (values ? c->vq : c->kq) + row0 * hd : NULL;
    const float *rows = tile_rows(f, h, q, t0, m, hd, tile);
    if (q) {
        const float *scale = (values ? c->vscale : c->kscale) + row0 + t0;
        for (int r = 0; r < m; r++) {
#if defined(EL_PREFILL_AVX512)
            const __m512 s = _mm512_set1_ps(scale[r]);
            for (int i = 0; i < hd; i += 16) {
                const __mmask16 k = tail_mask(hd - i);
                float *at = tile + (size_t)r * hd + i;
                _mm512_mask_storeu_ps(at, k, _mm512_mul_ps(_mm512_maskz_loadu_ps(k, at), s));
            }
#else
            for (int i = 0; i < hd; i++) tile[(size_t)r * hd + i] *= scale[r];
#endif
        }
    }
    return rows;
}

/* kt[g][d][j] = key d of position kfirst + j of KV head g; columns span..ldkt zero; with a half or int8 cache also
 * vf[g][j] = the values of that position as floats. Items: (g, POS_CHUNK positions), gathered 16 positions at a
 * time so that every write is a whole row segment (the other order, a key row scattered over a column, thrashes a
 * few L1 sets: ldkt is often a power of two); half and int8 keys are widened 16 rows at a time first. */
static void rows_transpose(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    const int hd = m->head_dim, chunks = (p->span + POS_CHUNK - 1) / POS_CHUNK;
#if defined(EL_PREFILL_AVX512)
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(hd));
#endif
    _Alignas(64) float tile[16 * EL_MAX_HEAD_DIM];
    for (int item = r0; item < r1; item++) {
        const int g = item / chunks, j0 = item % chunks * POS_CHUNK, j1 = imin(j0 + POS_CHUNK, p->span);
        float *kt = p->kt + (size_t)g * hd * p->ldkt;
        for (int j = j0; j < j1; j += 16) {
            const int len = imin(16, j1 - j);
            const float *keys = cached_rows(p, 0, g, p->kfirst + j, len, tile);
#if defined(EL_PREFILL_AVX512)
            const __mmask16 k = tail_mask(len);
            for (int d = 0; d < hd; d++)
                _mm512_mask_storeu_ps(kt + (size_t)d * p->ldkt + j, k,
                                      _mm512_mask_i32gather_ps(_mm512_setzero_ps(), k, rows, keys + d, 4));
#else
            for (int d = 0; d < hd; d++) {
                float *o = kt + (size_t)d * p->ldkt + j;
                for (int r = 0; r < len; r++) o[r] = keys[(size_t)r * hd + d];
            }
#endif
            if (p->vf) /* widened into vf itself */
                cached_rows(p, 1, g, p->kfirst + j, len, p->vf + ((size_t)g * p->span + j) * hd);
        }
        if (j1 == p->span)
            for (int d = 0; d < hd; d++)
                for (int j = p->span; j < p->ldkt; j++) kt[(size_t)d * p->ldkt + j] = 0.f;
    }
}

/* The first position the query at `pos` sees in layer L. */
static inline int first_seen(const el_layer_desc *L, int pos) {
    return L->sliding_window > 0 && pos + 1 > L->sliding_window ? pos + 1 - L->sliding_window : 0;
}

/* Attention work items: (KV head, tile of tile_pos query positions), latest tiles first. */
static void task_attention(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    prefill *p = ctx;
    const el_model_desc *m = &p->d->m;
    const el_layer_desc *L = p->L;
    const int hd = m->head_dim, nq = m->n_heads * hd, group = m->n_heads / m->n_kv_heads;
    const float cap = m->flags & EL_ATTN_SOFTCAP ? m->attn_softcap : 0.f;
    const size_t lds = (size_t)p->ldkt;
    float *s = NULL, *dummy = NULL;
    int i0, i1;
    while (job_claim(&p->job, &i0, &i1)) {
        if (!s) {
            s = alloc_floats(QROWS * lds + (size_t)hd);
            if (!s) return; /* the other threads take the items; el_decoder_prefill fails if some are left */
            dummy = s + QROWS * lds;
        }
        for (int item = i0; item < i1; item++) {
            const int g = item % m->n_kv_heads, tile = p->tiles - 1 - item / m->n_kv_heads;
            const int pos0 = tile * p->tile_pos, pos1 = imin(pos0 + p->tile_pos, p->n); /* rows of this chunk */
            const float *kt = p->kt + (size_t)g * hd * p->ldkt;
            const float *vals = p->vf ? p->vf + (size_t)g * p->span * hd
                                      : p->c.v + p->layer_off + ((size_t)g * p->capacity + p->kfirst) * hd;
            const int rows = (pos1 - pos0) * group;
            for (int f0 = 0; f0 < rows; f0 += QROWS) {
                const float *q[QROWS];
                float *out[QROWS];
                int first[QROWS], last[QROWS]; /* columns (positions - kfirst) each row sees, inclusive */
                for (int r = 0; r < QROWS; r++) {
                    const int f = imin(f0 + r, rows - 1), i = pos0 + f / group, h = g * group + f % group;
                    float *row = p->q + (size_t)i * nq + (size_t)h * hd;
                    q[r] = row, out[r] = f0 + r < rows ? row : dummy;
                    first[r] = first_seen(L, p->start + i) - p->kfirst, last[r] = p->start + i - p->kfirst;
                }
                const int c0 = first[0] & ~15, lo = first[0] - c0, cols = last[QROWS - 1] + 1 - c0;
                qk_rows(q, kt + c0, (size_t)p->ldkt, hd, s, lds, cols);
                const float *prow[QROWS];
                for (int r = 0; r < QROWS; r++) {
                    float *sr = s + r * lds;
                    prow[r] = sr;
                    if (f0 + r >= rows) continue; /* a repeat of the last row, written to dummy */
                    const int a = first[r] - c0, b = last[r] + 1 - c0;
                    softmax_row(sr + a, b - a, cap);
                    for (int j = lo; j < a; j++) sr[j] = 0.f;
                    for (int j = b; j < cols; j++) sr[j] = 0.f;
                }
                pv_rows(prow, vals + (size_t)c0 * hd, hd, lo, cols, out);
            }
            atomic_fetch_add(&p->done, 1);
        }
    }
    free(s);
}

/* x[r] += tmp[r] (normed by out_norm first, when set); xn[r] = rmsnorm(x[r], norm) when norm is set. */
static void rows_residual(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    for (int r = r0; r < r1; r++) {
        float *x = p->x + (size_t)r * m->dim, *t = p->tmp + (size_t)r * m->dim;
        if (p->out_norm) rmsnorm(t, p->out_norm, m->dim, m->eps, t);
        for (int i = 0; i < m->dim; i++) x[i] += t[i];
        if (p->norm) rmsnorm(x, p->norm, m->dim, m->eps, p->xn + (size_t)r * m->dim);
    }
}

/* gate = act(gate) * up, 16 lanes at a time (ffn_dim is a multiple of 32): act(g) = g sigmoid(u), u = g (SiLU) or
 * GELU's 2 (tanh argument) as in gated_activation, sigmoid(u) = 1 / (1 + e) for u >= 0, e / (1 + e) below,
 * e = exp(-|u|). */
static void rows_activation(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    const size_t f = (size_t)m->ffn_dim;
    const int gelu = (m->flags & EL_GELU_TANH) != 0;
#if !defined(EL_PREFILL_AVX512)
    for (int r = r0; r < r1; r++) gated_activation(p->gate + r * f, p->up + r * f, (int)f, gelu);
#else
    const __m512 one = _mm512_set1_ps(1.f), c = _mm512_set1_ps(1.5957691216057308f), c3 = _mm512_set1_ps(0.044715f);
    float *gate = p->gate + r0 * f;
    const float *up = p->up + r0 * f;
    for (size_t i = 0; i < (size_t)(r1 - r0) * f; i += 16) {
        const __m512 g = _mm512_loadu_ps(gate + i);
        const __m512 u = gelu ? _mm512_mul_ps(c, _mm512_fmadd_ps(_mm512_mul_ps(c3, g), _mm512_mul_ps(g, g), g)) : g;
        const __m512 e = exp16_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(u)));
        const __m512 num = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, _mm512_setzero_ps(), _CMP_LT_OQ), one, e);
        const __m512 act = _mm512_mul_ps(g, _mm512_div_ps(num, _mm512_add_ps(one, e)));
        _mm512_storeu_ps(gate + i, _mm512_mul_ps(act, _mm512_loadu_ps(up + i)));
    }
#endif
}

/* xn[r] = final norm of x[row0 + r] */
static void rows_final(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    for (int r = r0; r < r1; r++)
        rmsnorm(p->x + (size_t)(p->row0 + r) * m->dim, m->final_norm, m->dim, m->eps, p->xn + (size_t)r * m->dim);
}

static void rows_logit_softcap(prefill *p, int r0, int r1) {
    const el_model_desc *m = &p->d->m;
    for (int r = r0; r < r1; r++) softcap(p->logits + (size_t)r * m->vocab, m->vocab, m->logit_softcap);
}

static size_t round16(size_t n) { return (n + 15) / 16 * 16; }

/* Query positions per attention item: up to MAX_TILE_POS, fewer when that leaves under 8 items per thread. */
static int tile_positions(int n, int n_kv, int nth) {
    int t = MAX_TILE_POS;
    while (t > 1 && (long long)n_kv * ((n + t - 1) / t) < 8LL * nth) t /= 2;
    return t;
}

static int prefill_layers(prefill *p, int all_logits) {
    el_decoder *d = p->d;
    const el_model_desc *m = &d->m;
    const int n = p->n, hd = m->head_dim, nth = decoder_threads(d);
    p->norm = d->layers[0].attn_norm;
    run_rows(p, rows_embed, n);
    for (int l = 0; l < m->n_layers; l++) {
        const el_layer_desc *L = p->L = &d->layers[l];
        p->layer_off = (size_t)l * m->n_kv_heads * p->capacity * hd;
        if (gemm(p, &L->q, p->xn, n, p->q) || gemm(p, &L->k, p->xn, n, p->k) || gemm(p, &L->v, p->xn, n, p->v))
            return EL_ERR_MEMORY;
        run_rows(p, rows_qkv, n);
        p->kfirst = first_seen(L, p->start);
        p->span = p->start + n - p->kfirst;
        p->ldkt = (int)round16((size_t)p->span);
        run_rows(p, rows_transpose, m->n_kv_heads * ((p->span + POS_CHUNK - 1) / POS_CHUNK));
        p->tile_pos = tile_positions(n, m->n_kv_heads, nth);
        p->tiles = (n + p->tile_pos - 1) / p->tile_pos;
        atomic_store(&p->done, 0);
        run(p, task_attention, m->n_kv_heads * p->tiles, 1);
        if (atomic_load(&p->done) != m->n_kv_heads * p->tiles) return EL_ERR_MEMORY;
        if (gemm(p, &L->o, p->q, n, p->tmp)) return EL_ERR_MEMORY;
        p->out_norm = m->flags & EL_SANDWICH_NORMS ? L->attn_out_norm : NULL, p->norm = L->ffn_norm;
        run_rows(p, rows_residual, n);
        if (gemm(p, &L->gate, p->xn, n, p->gate) || gemm(p, &L->up, p->xn, n, p->up)) return EL_ERR_MEMORY;
        run_rows(p, rows_activation, n);
        if (gemm(p, &L->down, p->gate, n, p->tmp)) return EL_ERR_MEMORY;
        p->out_norm = m->flags & EL_SANDWICH_NORMS ? L->ffn_out_norm : NULL;
        p->norm = l + 1 < m->n_layers ? d->layers[l + 1].attn_norm : NULL;
        run_rows(p, rows_residual, n);
    }
    const int rows = all_logits ? n : 1;
    p->row0 = n - rows;
    run_rows(p, rows_final, rows);
    if (gemm(p, &m->lm_head, p->xn, rows, p->logits)) return EL_ERR_MEMORY;
    if (m->flags & EL_LOGIT_SOFTCAP) run_rows(p, rows_logit_softcap, rows);
    return EL_OK;
}

/* Run tokens[0..n) at positions start..start+n-1 through every layer: positions 0..start-1 are read from the
 * cache (c: [n_layers][n_kv_heads][capacity][head_dim] keys and values of its kind, as el_decoder_step*), the new
 * keys/values written into it; logits gets every position's next-token logits ([n][vocab]) with all_logits, else
 * the last position's ([vocab]: only that row goes through the final norm and the LM head). */
static int decoder_prefill(el_decoder *d, const int32_t *tokens, int n, int start, const kv_cache *c, int capacity,
                           float *logits, int all_logits) {
    const el_model_desc *m = &d->m;
    if (n < 1 || start < 0 || (long long)start + n > capacity || (long long)start + n > m->rope_len) return EL_ERR_POSITION;
    for (int i = 0; i < n; i++)
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return EL_ERR_TOKEN;
    const size_t hd = (size_t)m->head_dim, nq = (size_t)m->n_heads * hd, nkv = (size_t)m->n_kv_heads * hd;
    const size_t rows = (size_t)n, span = round16((size_t)start + n), visible = (size_t)m->n_kv_heads * hd * span;
    const size_t attention = round16(rows * nq) + 2 * round16(rows * nkv) + visible * (c->kind == KV_F32 ? 1 : 2);
    const size_t mlp = 2 * round16(rows * (size_t)m->ffn_dim);
    const size_t stream = round16(rows * (size_t)m->dim);
    prefill p;
    memset(&p, 0, sizeof p);
    float *work = alloc_floats(attention > mlp ? attention : mlp), *streams = alloc_floats(3 * stream);
    if (!work || !streams) {
        free(work), free(streams);
        return EL_ERR_MEMORY;
    }
    p.d = d, p.tokens = tokens, p.n = n, p.start = start, p.capacity = capacity;
    p.c = *c, p.logits = logits;
    p.x = streams, p.xn = streams + stream, p.tmp = streams + 2 * stream;
    p.q = work, p.k = p.q + round16(rows * nq), p.v = p.k + round16(rows * nkv), p.kt = p.v + round16(rows * nkv);
    p.vf = c->kind == KV_F32 ? NULL : p.kt + visible;
    p.gate = work, p.up = work + round16(rows * (size_t)m->ffn_dim);
    atomic_init(&p.job.next, 0), atomic_init(&p.done, 0);
    const int code = prefill_layers(&p, all_logits);
    free(work), free(streams);
    return code;
}

/* The prefill over a float32 cache (kcache, vcache: [n_layers][n_kv_heads][capacity][head_dim]).
 * Returns EL_OK; -2 (EL_ERR_UNAVAILABLE) in the scalar library (el_prefill_matmul() is NULL there); EL_ERR_POSITION for n < 1, start < 0, start + n beyond capacity or the RoPE tables;
 * EL_ERR_TOKEN for a token id outside the vocabulary; EL_ERR_MEMORY when the scratch buffers (about
 * n x (3 dim + 2 ffn_dim) floats, and the visible keys of one layer transposed, and with a half or int8 cache
 * the visible values of one layer as floats) cannot be allocated. Nothing is written on any of these but an
 * allocation failing inside a matmul or the attention, after which the cache positions start..start+n-1 may hold
 * some new keys/values (never earlier ones). The same for the two below. */
int el_decoder_prefill(el_decoder *d, const int32_t *tokens, int n, int start, float *kcache, float *vcache,
                       int capacity, float *logits, int all_logits) {
    const kv_cache c = {.kind = KV_F32, .k = kcache, .v = vcache};
    return decoder_prefill(d, tokens, n, start, &c, capacity, logits, all_logits);
}

/* The prefill over an IEEE half cache (the "f16" kind): new keys/values rounded to nearest even (el_float_to_half,
 * as torch's .half() and el_decoder_step_f16), then every visible position, the chunk's own included, read back as
 * stored (widened exactly), as torch's KVCache.update/read. */
int el_decoder_prefill_f16(el_decoder *d, const int32_t *tokens, int n, int start, uint16_t *kcache, uint16_t *vcache,
                           int capacity, float *logits, int all_logits) {
    const kv_cache c = {.kind = KV_F16, .kh = kcache, .vh = vcache};
    return decoder_prefill(d, tokens, n, start, &c, capacity, logits, all_logits);
}

/* The prefill over an int8 cache with one float32 scale per token per head (kscale, vscale:
 * [n_layers][n_kv_heads][capacity]; the "q8" kind): new keys/values quantized by el_kv_quantize (kv_cache.quantize_q8
 * and el_decoder_step_q8, bit for bit), then every visible position, the chunk's own included, read back dequantized
 * (q * scale in float32), as torch's KVCache.update/read. */
int el_decoder_prefill_q8(el_decoder *d, const int32_t *tokens, int n, int start, int8_t *kcache, int8_t *vcache,
                          float *kscale, float *vscale, int capacity, float *logits, int all_logits) {
    const kv_cache c = {.kind = KV_Q8, .kq = kcache, .vq = vcache, .kscale = kscale, .vscale = vscale};
    return decoder_prefill(d, tokens, n, start, &c, capacity, logits, all_logits);
}

const char *el_prefill_matmul(void) {
    if (bf16_gemm_available()) return "bf16";
    return i8_gemm_wanted() ? "int8" : "f32";
}

#else

const char *el_prefill_matmul(void) { return NULL; }

int el_decoder_prefill(el_decoder *d, const int32_t *tokens, int n, int start, float *kcache, float *vcache,
                       int capacity, float *logits, int all_logits) {
    (void)d, (void)tokens, (void)n, (void)start, (void)kcache, (void)vcache, (void)capacity, (void)logits,
        (void)all_logits;
    return EL_ERR_UNAVAILABLE;
}

int el_decoder_prefill_f16(el_decoder *d, const int32_t *tokens, int n, int start, uint16_t *kcache, uint16_t *vcache,
                           int capacity, float *logits, int all_logits) {
    (void)d, (void)tokens, (void)n, (void)start, (void)kcache, (void)vcache, (void)capacity, (void)logits,
        (void)all_logits;
    return EL_ERR_UNAVAILABLE;
}

int el_decoder_prefill_q8(el_decoder *d, const int32_t *tokens, int n, int start, int8_t *kcache, int8_t *vcache,
                          float *kscale, float *vscale, int capacity, float *logits, int all_logits) {
    (void)d, (void)tokens, (void)n, (void)start, (void)kcache, (void)vcache, (void)kscale, (void)vscale,
        (void)capacity, (void)logits, (void)all_logits;
    return EL_ERR_UNAVAILABLE;
}

#endif
