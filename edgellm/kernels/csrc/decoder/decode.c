/* One decode step of a Llama-style decoder in native code: a single call per token runs every layer.
 * Flags of the model description add what other families do differently (Qwen3's q/k norms; Gemma's
 * sandwich norms, GELU, embedding scale, soft-capping, sliding-window layers with RoPE tables of their own).
 *
 * Weights are pointers into the memory-mapped artifact (el_block_q4x8 / el_block_q8x8 row groups, see
 * edgellm_kernels.h); nothing is copied. Each matmul quantizes its input once per block of 32
 * (el_quantize_act) and shares it across the fused projections (q/k/v, gate/up); rows are handed
 * out in chunks of EL_CHUNK_ALIGN-aligned rows to the pool's threads through an atomic counter, so a
 * thread the OS deschedules holds up the op by one chunk at most, and no two threads write the same
 * cache line. The KV cache is the caller's (layers, 1, kv_heads, capacity, head_dim) pair of tensors,
 * passed on every step: float32 (el_decoder_step), IEEE half (el_decoder_step_f16: new positions
 * rounded to nearest even as torch's .half()), or int8 with one float32 scale per token per head
 * in (layers, 1, kv_heads, capacity) scale tensors (el_decoder_step_q8, edgellm/models/kv_cache.py's
 * "q8" kind: new positions are quantized exactly as its quantize_q8 does, see el_kv_quantize). The
 * thread pool is the caller's (shared with the per-op kernels). All scratch memory is allocated at
 * create time (the attention scores grow with the cache capacity, never per token). */
#include "decoder/decoder_internal.h"

/* AVX-512 builds run attention on 16-lane vectors (see attention_scores16). */
#if defined(__AVX512F__) && !defined(EL_SCALAR)
#define EL_ATTENTION_16 1
#endif

/* The model description, the decoder object and the helpers prefill.c shares are in decoder_internal.h. */

static void gemv(const el_matrix *w, const el_block_q8a *x, float *y, int r0, int r1) {
    el_gemm_fmt(w->fmt, w->data, w->k, x, 1, y, 0, r0, r1);
}

/* ---- work distribution ------------------------------------------------------------------------------ */

/* Rows per chunk for an op of `rows` rows: a few chunks per thread, EL_CHUNK_ALIGN-aligned. */
int el_row_chunk(int rows, int nth) {
    if (nth == 1) return rows;
    int chunk = (rows + nth * EL_CHUNKS_PER_THREAD - 1) / (nth * EL_CHUNKS_PER_THREAD);
    return (chunk + EL_CHUNK_ALIGN - 1) / EL_CHUNK_ALIGN * EL_CHUNK_ALIGN;
}

/* Run `fn` on the pool over `rows` work items handed out `chunk` at a time. */
static void run_job(el_decoder *d, el_task_fn fn, int rows, int chunk) {
    job_reset(&d->job, rows, chunk);
    if (d->pool) el_pool_run(d->pool, fn, d);
    else fn(d, 0, 1);
}

static void run_rows(el_decoder *d, el_task_fn fn, int rows) { run_job(d, fn, rows, el_row_chunk(rows, decoder_threads(d))); }

/* ---- the ops' tasks (fn(ctx, ith, nth) for el_pool_run) ------------------------------------------------ */

/* q, k, v projections of xq into qkv = [q | k | v], plus their biases. */
static void task_qkv(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_decoder *d = ctx;
    const el_layer_desc *L = d->layer;
    const el_matrix *mats[3] = {&L->q, &L->k, &L->v};
    const float *bias[3] = {L->q_bias, L->k_bias, L->v_bias};
    int r0, r1;
    while (job_claim(&d->job, &r0, &r1)) {
        int base = 0;
        for (int s = 0; s < 3; s++) {
            int n = mats[s]->n, a = r0 - base > 0 ? r0 - base : 0, b = imin(r1 - base, n);
            float *y = d->qkv + base;
            if (a < b) {
                gemv(mats[s], d->xq, y, a, b);
                if (bias[s])
                    for (int r = a; r < b; r++) y[r] += bias[s][r];
            }
            base += n;
        }
    }
}

/* scores[t] = q . keys[t] for 0 <= t < n (rows of hd floats, hd a multiple of 8), eight positions
 * per pass: their eight vector accumulators are summed across lanes together. */
static void attention_scores(const float *q, const float *keys, int n, int hd, float *scores) {
    int t = 0;
    for (; t + 8 <= n; t += 8) {
        el_v8f acc[8] = {{0}};
        for (int i = 0; i < hd; i += 8) {
            const el_v8f qv = v8f_load(q + i);
            for (int j = 0; j < 8; j++) acc[j] = v8f_fma(qv, v8f_load(keys + (size_t)(t + j) * hd + i), acc[j]);
        }
        v8f_hsum8(acc, scores + t);
    }
    for (; t < n; t++) {
        el_v8f acc = {0};
        for (int i = 0; i < hd; i += 8) acc = v8f_fma(v8f_load(q + i), v8f_load(keys + (size_t)t * hd + i), acc);
        scores[t] = v8f_hsum(acc);
    }
}

#if !defined(EL_ATTENTION_16)
/* p[t] = exp(p[t] - max(p)) in place, 8 lanes at a time; returns their sum. */
static float exp_minus_max(float *p, int n) {
    el_v8f m8 = v8f_splat(-INFINITY), acc = {0};
    int t = 0;
    for (; t + 8 <= n; t += 8) m8 = v8f_max(m8, v8f_load(p + t));
    float mx = v8f_hmax(m8), sum = 0.f;
    for (int u = t; u < n; u++) mx = p[u] > mx ? p[u] : mx;
    for (t = 0; t + 8 <= n; t += 8) {
        const el_v8f e = v8f_exp_nonpositive(v8f_load(p + t) - mx);
        v8f_store(p + t, e);
        acc += e;
    }
    sum = v8f_hsum(acc);
    for (; t < n; t++) sum += p[t] = expf(p[t] - mx);
    return sum;
}
#endif

/* out[0..8w) += sum_t p[t] * vals[t][0..8w) (rows of hd floats), the 8w outputs held in registers:
 * inlined with a constant w, so that the accumulators are not spilled to the stack. */
static inline __attribute__((always_inline)) void values_columns(const float *p, const float *vals, int n, int hd,
                                                                 float *out, const int w) {
    el_v8f acc[8];
    for (int c = 0; c < w; c++) acc[c] = v8f_load(out + 8 * c);
    for (int t = 0; t < n; t++) {
        const el_v8f pt = {p[t], p[t], p[t], p[t], p[t], p[t], p[t], p[t]};
        for (int c = 0; c < w; c++) acc[c] = v8f_fma(pt, v8f_load(vals + (size_t)t * hd + 8 * c), acc[c]);
    }
    for (int c = 0; c < w; c++) v8f_store(out + 8 * c, acc[c]);
}

/* out[hd] += sum_t p[t] * vals[t], 64 output floats at a time (then 8). */
static void attention_values(const float *p, const float *vals, int n, int hd, float *out) {
    int i0 = 0;
    for (; i0 + 64 <= hd; i0 += 64) values_columns(p, vals + i0, n, hd, out + i0, 8);
    for (; i0 < hd; i0 += 8) values_columns(p, vals + i0, n, hd, out + i0, 1);
}

#if defined(EL_ATTENTION_16)
#include "arch/x86/decode_attention16.inc"
#endif

/* Keys and values are read a tile of rows at a time, once for all the query heads that share their
 * KV head, so the tile stays in L1 while every head uses it; half and int8 rows are widened to floats first. */
#define EL_TILE_FLOATS 4096


/* tile_rows (decoder_internal.h) widens half and int8 rows into a tile. */

/* p[0..n) = softmax(p[0..n)) in place (exp_minus_max on this build's vector width). */
static void softmax(float *p, int n) {
    const float inv = 1.f / exp_minus_max(p, n);
    for (int t = 0; t < n; t++) p[t] *= inv;
}

/* Software prefetch of a KV head's keys then values (float, half or int8 rows, as tile_rows), ahead
 * of their use: the cache lives in memory (each decode step streams all the weights through the caches
 * in between), and the hardware prefetchers stop at every 4 KiB page. `next` counts rows of keys
 * (0..n) then values (n..2n) already asked for. */
typedef struct {
    const char *k, *v;
    size_t row_bytes;
    int n, next;
} el_kv_prefetch;

static el_kv_prefetch kv_prefetch_init(const el_kv_rows *kv, int n, int hd) {
    const size_t size = kv->k ? sizeof(float) : kv->kh ? sizeof(uint16_t) : sizeof(int8_t);
    return (el_kv_prefetch){.k = kv->k ? (const char *)kv->k : kv->kh ? (const char *)kv->kh : (const char *)kv->kq,
                            .v = kv->v ? (const char *)kv->v : kv->vh ? (const char *)kv->vh : (const char *)kv->vq,
                            .row_bytes = (size_t)hd * size, .n = n};
}

/* Prefetch up to row `upto` of the 2n (keys, then values). */
static void kv_prefetch_to(el_kv_prefetch *p, int upto) {
    upto = imin(upto, 2 * p->n);
    while (p->next < upto) {
        const int in_keys = p->next < p->n, end = in_keys ? imin(upto, p->n) : upto;
        const char *base = in_keys ? p->k : p->v;
        const int r0 = in_keys ? p->next : p->next - p->n, r1 = in_keys ? end : end - p->n;
        for (size_t o = (size_t)r0 * p->row_bytes; o < (size_t)r1 * p->row_bytes; o += 64) __builtin_prefetch(base + o, 0, 3);
        p->next = end;
    }
}

/* Rows asked for ahead of the tile in use: two tiles (the time to use one is shorter than the time
 * to fetch the next from memory). */
#define EL_KV_AHEAD_TILES 2

/* Attention of `group` query heads (q[h], rotated and scaled; scores s[h]; output out[h]) over n
 * positions of one KV head; scores soft-capped at `cap` unless it is 0. */
void el_attention_group(float *const *q, float *const *s, float *const *out, int group, const el_kv_rows *kv,
                            int n, int hd, float cap) {
    _Alignas(64) float tile[EL_TILE_FLOATS];
    const int rows = EL_TILE_FLOATS / hd / 8 * 8;
    el_kv_prefetch ahead = kv_prefetch_init(kv, n, hd);
    for (int t0 = 0; t0 < n; t0 += rows) {
        const int m = imin(rows, n - t0);
        kv_prefetch_to(&ahead, t0 + (1 + EL_KV_AHEAD_TILES) * rows);
        const float *keys = tile_rows(kv->k, kv->kh, kv->kq, t0, m, hd, tile);
#if defined(EL_ATTENTION_16)
        if (hd % 16 == 0) {
            for (int h = 0; h < group; h++) attention_scores16(q[h], keys, m, hd, s[h] + t0);
            continue;
        }
#endif
        for (int h = 0; h < group; h++) attention_scores(q[h], keys, m, hd, s[h] + t0);
    }
    for (int h = 0; h < group; h++) {
        if (kv->kq)
            for (int t = 0; t < n; t++) s[h][t] *= kv->ks[t];
        if (cap > 0.f)
            for (int t = 0; t < n; t++) s[h][t] = tanhf(s[h][t] / cap) * cap;
        softmax(s[h], n);
        if (kv->vq)
            for (int t = 0; t < n; t++) s[h][t] *= kv->vs[t];
        memset(out[h], 0, (size_t)hd * sizeof(float));
    }
    for (int t0 = 0; t0 < n; t0 += rows) {
        const int m = imin(rows, n - t0);
        kv_prefetch_to(&ahead, n + t0 + (1 + EL_KV_AHEAD_TILES) * rows);
        const float *vals = tile_rows(kv->v, kv->vh, kv->vq, t0, m, hd, tile);
#if defined(EL_ATTENTION_16)
        if (hd % 16 == 0) {
            for (int h = 0; h < group; h++) attention_values16(s[h] + t0, vals, m, hd, out[h]);
            continue;
        }
#endif
        for (int h = 0; h < group; h++) attention_values(s[h] + t0, vals, m, hd, out[h]);
    }
}

/* Symmetric int8 of x[n] with one scale, bit for bit as kv_cache.quantize_q8: scale = amax / 127
 * (1 when amax is 0), q = round-half-even(x / scale) clamped to [-127, 127]. */
void el_kv_quantize(const float *x, int n, int8_t *q, float *scale) {
    float amax = 0.f;
    for (int i = 0; i < n; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
    const float s = amax / 127.f > 0.f ? amax / 127.f : 1.f;
    for (int i = 0; i < n; i++) {
        const float r = rintf(x[i] / s);
        q[i] = (int8_t)(r > 127.f ? 127.f : r < -127.f ? -127.f : r);
    }
    *scale = s;
}

/* Head `v` (hd floats) as RoPE and the q/k norm leave it at position pos of layer L. */
void el_position_head(const el_decoder *d, const el_layer_desc *L, const float *norm, float *v, int pos) {
    const el_model_desc *m = &d->m;
    const int hd = m->head_dim;
    if (m->flags & EL_QK_NORM) rmsnorm(v, norm, hd, m->eps, v);
    rope(v, L->rope_cos + (size_t)pos * hd, L->rope_sin + (size_t)pos * hd, hd);
}

/* Query heads per attention work item: all that share a KV head (its keys and values are then read
 * once), unless that leaves threads idle (Gemma 3 has one KV head): then the largest divisor of the
 * group that gives every thread an item. Which heads share a pass does not change any head's bits. */
int el_heads_per_item(int group, int n_kv_heads, int nth) {
    int heads = group;
    while (heads > 1 && n_kv_heads * (group / heads) < nth) {
        do heads--;
        while (group % heads);
    }
    return heads;
}

/* Attention over the positions of the cache that d->layer sees at d->pos (0..pos, or the last
 * sliding_window of them), d->item_heads query heads (of one KV head) per work item, so that their
 * keys and values stay in this core's cache for all of them. */
static void task_attention(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_decoder *d = ctx;
    const el_model_desc *m = &d->m;
    const el_layer_desc *L = d->layer;
    const int hd = m->head_dim, group = m->n_heads / m->n_kv_heads, heads = d->item_heads;
    const int window = L->sliding_window;
    const int first = window > 0 && d->pos + 1 > window ? d->pos + 1 - window : 0, n = d->pos + 1 - first;
    const size_t layer_off = (size_t)(L - d->layers) * m->n_kv_heads * d->capacity * hd;
    int i0, i1;
    while (job_claim(&d->job, &i0, &i1)) {
        for (int item = i0; item < i1; item++) {
            const int h0 = item * heads, g = h0 / group;
            const size_t row0 = layer_off / hd + (size_t)g * d->capacity + first, off = row0 * hd; /* row0: scales */
            float *qs[EL_MAX_GROUP], *ss[EL_MAX_GROUP], *outs[EL_MAX_GROUP];
            for (int j = 0; j < heads; j++) {
                float *q = qs[j] = d->qkv + (size_t)(h0 + j) * hd;
                ss[j] = d->scores + (size_t)(h0 + j) * d->scores_cap;
                outs[j] = d->att + (size_t)(h0 + j) * hd;
                el_position_head(d, L, L->q_norm, q, d->pos);
                for (int i = 0; i < hd; i++) q[i] *= m->attn_scale;
            }
            const el_kv_rows kv = d->kq   ? (el_kv_rows){.kq = d->kq + off, .vq = d->vq + off, .ks = d->kscale + row0,
                                                         .vs = d->vscale + row0}
                                  : d->kh ? (el_kv_rows){.kh = d->kh + off, .vh = d->vh + off}
                                          : (el_kv_rows){.k = d->kcache + off, .v = d->vcache + off};
            el_attention_group(qs, ss, outs, heads, &kv, n, hd, m->flags & EL_ATTN_SOFTCAP ? m->attn_softcap : 0.f);
        }
    }
}

/* x += mat . act (o_proj, down_proj); with a sandwich norm only tmp = mat . act (see residual). */
static void task_residual(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_decoder *d = ctx;
    int r0, r1;
    while (job_claim(&d->job, &r0, &r1)) {
        gemv(d->mat, d->act, d->tmp, r0, r1);
        if (!d->out_norm)
            for (int r = r0; r < r1; r++) d->x[r] += d->tmp[r];
    }
}

/* logits = lm_head . xq, soft-capped with EL_LOGIT_SOFTCAP */
static void task_logits(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_decoder *d = ctx;
    const float cap = d->m.logit_softcap;
    int r0, r1;
    while (job_claim(&d->job, &r0, &r1)) {
        gemv(&d->m.lm_head, d->xq, d->logits, r0, r1);
        if (d->m.flags & EL_LOGIT_SOFTCAP)
            for (int r = r0; r < r1; r++) d->logits[r] = tanhf(d->logits[r] / cap) * cap;
    }
}

/* gate = act(gate_proj(xq)) * up_proj(xq), act SiLU or GELU, quantized chunk by chunk into hq for down_proj. */
static void task_gate_up(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_decoder *d = ctx;
    const int gelu = (d->m.flags & EL_GELU_TANH) != 0;
    int r0, r1;
    while (job_claim(&d->job, &r0, &r1)) {
        gemv(&d->layer->gate, d->xq, d->gate, r0, r1);
        gemv(&d->layer->up, d->xq, d->up, r0, r1);
        gated_activation(d->gate + r0, d->up + r0, r1 - r0, gelu);
        el_quantize_act(d->gate + r0, r1 - r0, d->hq + r0 / EL_QK);
    }
}

/* ---- step profile (compiled in only with -DEL_PROFILE): time per part of the step, printed at exit; wall time,
 * or with -DEL_PROFILE_CLOCK=CLOCK_THREAD_CPUTIME_ID the calling thread's CPU time (a shared machine, one thread) ---- */
#if defined(EL_PROFILE)
#include <stdio.h>
#include <time.h>
#if !defined(EL_PROFILE_CLOCK)
#define EL_PROFILE_CLOCK CLOCK_MONOTONIC
#endif
enum { PR_EMBED, PR_NORM_QUANT, PR_QKV, PR_ROPE_KV, PR_ATTN, PR_O, PR_GATE_UP, PR_DOWN, PR_LM_HEAD, PR_STEP, PR_N };
static const char *const pr_name[PR_N] = {"embed", "norms+quantize", "qkv", "rope+kv store", "attention", "o_proj",
                                          "gate+up", "down", "lm_head", "whole step"};
static double pr_sec[PR_N];
static long pr_steps;
static double pr_now(void) {
    struct timespec t;
    clock_gettime(EL_PROFILE_CLOCK, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}
static void pr_report(void) {
    if (!pr_steps) return;
    for (int i = 0; i < PR_N; i++)
        fprintf(stderr, "el_profile %-16s %8.3f ms/step %5.1f%%\n", pr_name[i], 1e3 * pr_sec[i] / (double)pr_steps,
                100.0 * pr_sec[i] / pr_sec[PR_STEP]);
}
#define PR_START(t) double t = pr_now()
#define PR_LAP(t, part) (pr_sec[part] += pr_now() - t, t = pr_now())
#define PR_STEP_DONE(t0) (pr_sec[PR_STEP] += pr_now() - t0, pr_steps++ ? 0 : atexit(pr_report))
#else
#define PR_START(t) ((void)0)
#define PR_LAP(t, part) ((void)0)
#define PR_STEP_DONE(t0) ((void)0)
#endif

/* ---- public API ------------------------------------------------------------------------------------------ */

static int matrix_ok(const el_matrix *w, int n, int k) {
    return w->data && el_fmt_ok(w->fmt, k) && w->n == n && w->k == k && n % EL_ROWS == 0;
}

/* EL_OK when the description is one this file implements; else the EL_DESC_* code of the first check it fails. */
int el_decoder_check(const el_model_desc *m) {
    if (m->flags & ~EL_SUPPORTED_FLAGS) return EL_DESC_FLAGS;
    if (m->n_layers < 1 || m->dim < 1 || m->ffn_dim < 1 || m->n_heads < 1 || m->head_dim < 2 || m->vocab < 1 ||
        m->rope_len < 1 || !m->final_norm || !m->layers || m->dim % EL_QK || m->ffn_dim % EL_QK ||
        m->head_dim % 8 || m->n_kv_heads < 1 || m->n_heads % m->n_kv_heads || (m->n_heads * m->head_dim) % EL_QK || m->n_heads / m->n_kv_heads > EL_MAX_GROUP ||
        m->head_dim > EL_MAX_HEAD_DIM)
        return EL_DESC_SHAPE;
    if (!(m->embed.fmt == EL_F32 || el_fmt_ok(m->embed.fmt, m->embed.k)) || !m->embed.data ||
        m->embed.n != m->vocab || m->embed.k != m->dim || !matrix_ok(&m->lm_head, m->vocab, m->dim))
        return EL_DESC_EMBED;
    int nq = m->n_heads * m->head_dim, nkv = m->n_kv_heads * m->head_dim;
    for (int l = 0; l < m->n_layers; l++) {
        const el_layer_desc *L = &m->layers[l];
        if (!matrix_ok(&L->q, nq, m->dim) || !matrix_ok(&L->k, nkv, m->dim) || !matrix_ok(&L->v, nkv, m->dim) ||
            !matrix_ok(&L->o, m->dim, nq) || !matrix_ok(&L->gate, m->ffn_dim, m->dim) ||
            !matrix_ok(&L->up, m->ffn_dim, m->dim) || !matrix_ok(&L->down, m->dim, m->ffn_dim) ||
            !L->attn_norm || !L->ffn_norm || !L->rope_cos || !L->rope_sin || L->sliding_window < 0)
            return EL_DESC_LAYER;
        if (((m->flags & EL_QK_NORM) && (!L->q_norm || !L->k_norm)) ||
            ((m->flags & EL_SANDWICH_NORMS) && (!L->attn_out_norm || !L->ffn_out_norm)))
            return EL_DESC_OPTION;
    }
    if (((m->flags & EL_LOGIT_SOFTCAP) && !(m->logit_softcap > 0.f)) ||
        ((m->flags & EL_ATTN_SOFTCAP) && !(m->attn_softcap > 0.f)))
        return EL_DESC_OPTION;
    return EL_OK;
}

void el_decoder_destroy(el_decoder *d) {
    if (!d) return;
    free(d->layers);
    free(d->x), free(d->xn), free(d->qkv), free(d->att), free(d->tmp), free(d->gate), free(d->up);
    free(d->scores), free(d->xq), free(d->hq);
    free(d);
}

/* A decoder for `m` whose ops run on `pool` (shared, not owned; NULL: the caller's thread only). */
el_decoder *el_decoder_create(const el_model_desc *m, el_pool *pool) {
    if (el_decoder_check(m)) return NULL;
    el_decoder *d = aligned_alloc(64, (sizeof(el_decoder) + 63) / 64 * 64);
    if (!d) return NULL;
    memset(d, 0, sizeof *d);
    d->m = *m;
    int nq = m->n_heads * m->head_dim, nkv = m->n_kv_heads * m->head_dim;
    int wide = m->dim > nq ? m->dim : nq;
    d->layers = malloc((size_t)m->n_layers * sizeof(el_layer_desc));
    d->pool = pool;
    d->item_heads = el_heads_per_item(m->n_heads / m->n_kv_heads, m->n_kv_heads, decoder_threads(d));
    d->x = alloc_floats(m->dim), d->xn = alloc_floats(m->dim), d->tmp = alloc_floats(m->dim);
    d->qkv = alloc_floats(nq + 2 * nkv), d->att = alloc_floats(nq);
    d->gate = alloc_floats(m->ffn_dim), d->up = alloc_floats(m->ffn_dim);
    d->xq = aligned_alloc(64, (wide / EL_QK * sizeof(el_block_q8a) + 63) / 64 * 64);
    d->hq = aligned_alloc(64, (m->ffn_dim / EL_QK * sizeof(el_block_q8a) + 63) / 64 * 64);
    if (!d->layers || !d->x || !d->xn || !d->tmp || !d->qkv || !d->att || !d->gate || !d->up ||
        !d->xq || !d->hq) {
        el_decoder_destroy(d);
        return NULL;
    }
    memcpy(d->layers, m->layers, (size_t)m->n_layers * sizeof(el_layer_desc));
    d->m.layers = d->layers;
    atomic_init(&d->job.next, 0);
    return d;
}

int el_decoder_threads(const el_decoder *d) { return decoder_threads(d); }

/* x += mat . act, or with EL_SANDWICH_NORMS x += rmsnorm(mat . act, out_norm). */
static void residual(el_decoder *d, const el_matrix *mat, const el_block_q8a *act, const float *out_norm) {
    const el_model_desc *m = &d->m;
    d->mat = mat, d->act = act, d->out_norm = m->flags & EL_SANDWICH_NORMS ? out_norm : NULL;
    run_rows(d, task_residual, m->dim);
    if (d->out_norm) {
        rmsnorm(d->tmp, d->out_norm, m->dim, m->eps, d->tmp);
        for (int i = 0; i < m->dim; i++) d->x[i] += d->tmp[i];
    }
}

/* Run `token` at position `pos` through every layer, appending its keys/values to the cache (the
 * float32 one, or the half one when d->kh is set, or the int8 one when d->kq is), and write the
 * next-token logits[vocab]. */
static int decoder_step(el_decoder *d, int token, int pos, int capacity, float *logits) {
    const el_model_desc *m = &d->m;
    if (pos < 0 || pos >= capacity || pos >= m->rope_len) return EL_ERR_POSITION;
    if (token < 0 || token >= m->vocab) return EL_ERR_TOKEN;
    if ((size_t)capacity > d->scores_cap) { /* the cache grew: once per growth, never per token */
        float *s = alloc_floats((size_t)m->n_heads * capacity);
        if (!s) return EL_ERR_MEMORY;
        free(d->scores);
        d->scores = s;
        d->scores_cap = (size_t)capacity;
    }
    d->capacity = capacity, d->pos = pos, d->logits = logits;
    int hd = m->head_dim, nq = m->n_heads * hd, nkv = m->n_kv_heads * hd;

    PR_START(t0);
    PR_START(t);
    embed_row(&m->embed, token, d->x);
    if (m->flags & EL_EMBED_SCALE)
        for (int i = 0; i < m->dim; i++) d->x[i] *= m->embed_scale;
    PR_LAP(t, PR_EMBED);
    for (int l = 0; l < m->n_layers; l++) {
        const el_layer_desc *L = d->layer = &d->layers[l];
        rmsnorm(d->x, L->attn_norm, m->dim, m->eps, d->xn);
        el_quantize_act(d->xn, m->dim, d->xq);
        PR_LAP(t, PR_NORM_QUANT);
        run_rows(d, task_qkv, nq + 2 * nkv);
        PR_LAP(t, PR_QKV);
        /* RoPE on the new keys; keys and values into the cache at pos (the queries rotate per head). */
        size_t layer_off = (size_t)l * m->n_kv_heads * capacity * hd;
        for (int g = 0; g < m->n_kv_heads; g++) {
            float *k = d->qkv + nq + (size_t)g * hd, *v = d->qkv + nq + nkv + (size_t)g * hd;
            el_position_head(d, L, L->k_norm, k, pos);
            size_t at = layer_off + ((size_t)g * capacity + pos) * hd;
            if (d->kq) {
                el_kv_quantize(k, hd, d->kq + at, d->kscale + at / hd);
                el_kv_quantize(v, hd, d->vq + at, d->vscale + at / hd);
            } else if (d->kh) {
                for (int i = 0; i < hd; i++) d->kh[at + i] = el_float_to_half(k[i]), d->vh[at + i] = el_float_to_half(v[i]);
            } else {
                memcpy(d->kcache + at, k, (size_t)hd * sizeof(float));
                memcpy(d->vcache + at, v, (size_t)hd * sizeof(float));
            }
        }
        PR_LAP(t, PR_ROPE_KV);
        run_job(d, task_attention, m->n_heads / d->item_heads, 1);
        PR_LAP(t, PR_ATTN);
        el_quantize_act(d->att, nq, d->xq);
        PR_LAP(t, PR_NORM_QUANT);
        residual(d, &L->o, d->xq, L->attn_out_norm);
        PR_LAP(t, PR_O);
        rmsnorm(d->x, L->ffn_norm, m->dim, m->eps, d->xn);
        el_quantize_act(d->xn, m->dim, d->xq);
        PR_LAP(t, PR_NORM_QUANT);
        run_rows(d, task_gate_up, m->ffn_dim);
        PR_LAP(t, PR_GATE_UP);
        residual(d, &L->down, d->hq, L->ffn_out_norm);
        PR_LAP(t, PR_DOWN);
    }
    rmsnorm(d->x, m->final_norm, m->dim, m->eps, d->xn);
    el_quantize_act(d->xn, m->dim, d->xq);
    PR_LAP(t, PR_NORM_QUANT);
    run_rows(d, task_logits, m->vocab);
    PR_LAP(t, PR_LM_HEAD);
    PR_STEP_DONE(t0);
    return EL_OK;
}

/* The step over a float32 cache. Returns EL_OK or an EL_ERR_* code (nothing written then). */
int el_decoder_step(el_decoder *d, int token, int pos, float *kcache, float *vcache, int capacity, float *logits) {
    d->kcache = kcache, d->vcache = vcache, d->kh = d->vh = NULL, d->kq = d->vq = NULL, d->kscale = d->vscale = NULL;
    return decoder_step(d, token, pos, capacity, logits);
}

/* The step over an IEEE half cache (the "f16" kind). */
int el_decoder_step_f16(el_decoder *d, int token, int pos, uint16_t *kcache, uint16_t *vcache, int capacity,
                        float *logits) {
    d->kcache = d->vcache = NULL, d->kh = kcache, d->vh = vcache, d->kq = d->vq = NULL, d->kscale = d->vscale = NULL;
    return decoder_step(d, token, pos, capacity, logits);
}

/* The step over an int8 cache with per-token-per-head scales [layers, kv_heads, capacity]. */
int el_decoder_step_q8(el_decoder *d, int token, int pos, int8_t *kcache, int8_t *vcache, float *kscale,
                       float *vscale, int capacity, float *logits) {
    d->kcache = d->vcache = NULL, d->kh = d->vh = NULL, d->kq = kcache, d->vq = vcache, d->kscale = kscale,
    d->vscale = vscale;
    return decoder_step(d, token, pos, capacity, logits);
}
