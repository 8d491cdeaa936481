/* The batched decode step: one call runs M rows, each a (token, position, KV cache), through every layer, reading
 * the quantized weights once for all of them (el_gemm_fmt takes M activation rows: each weight row group is
 * unpacked once per step, not once per row). Rows may belong to different sequences, each with its own cache, or
 * share one cache at consecutive positions (speculative verification: a row attends over its cache up to its own
 * position, the keys and values of the rows before it included).
 *
 * Per layer: the q/k/v projections of all rows in one pass; each row's keys and values written into its cache at
 * its position; then every row's attention (the work items are (row, query heads of one KV head) pairs, handed out
 * together); then o, gate/up and down for all rows at once; at the end the final norm and the LM head for all rows.
 * Each row computes exactly what el_decoder_step computes for it alone: the same int8 activations, the same
 * per-row kernels (an activation row's dot products do not depend on the other rows), the same attention.
 *
 * The batch's scratch memory belongs to an el_batch made for a decoder and a most rows per step; its attention
 * scores grow with the largest cache capacity it has seen, never per step. */
#include "decoder/decoder_internal.h"

/* el_kv_cache, the EL_KV_* kinds and the entry points are declared in edgellm_decoder.h. */
struct el_batch {
    el_decoder *d; /* the model, its layers and its pool (not owned) */
    el_job job;
    int max_rows, rows, qkv_w, item_heads, items_per_row;
    size_t scores_cap; /* floats per (row, head) the scores buffer holds */
    /* scratch, rows-major, 64-byte aligned */
    float *x, *xn, *qkv, *att, *tmp, *gate, *up, *scores;
    el_block_q8a *xq, *hq;
    /* the step in flight (read by the pool's tasks) */
    const el_layer_desc *layer;
    const el_matrix *mat;
    const el_block_q8a *act;
    int sandwich; /* task_residual leaves mat . act in tmp, normed later */
    const int32_t *pos, *cache_of;
    const el_kv_cache *caches;
    float *logits;
};

void el_batch_destroy(el_batch *b) {
    if (!b) return;
    free(b->x), free(b->xn), free(b->qkv), free(b->att), free(b->tmp), free(b->gate), free(b->up);
    free(b->scores), free(b->xq), free(b->hq);
    free(b);
}

/* Scratch for up to `max_rows` rows per step of decoder `d` (borrowed: destroy the batch first). NULL when
 * max_rows < 1 or out of memory. */
el_batch *el_batch_create(el_decoder *d, int max_rows) {
    if (!d || max_rows < 1 || max_rows > EL_BATCH_MAX_ROWS) return NULL;
    el_batch *b = aligned_alloc(64, (sizeof(el_batch) + 63) / 64 * 64);
    if (!b) return NULL;
    memset(b, 0, sizeof *b);
    const el_model_desc *m = &d->m;
    const int nq = m->n_heads * m->head_dim, nkv = m->n_kv_heads * m->head_dim, wide = imax(m->dim, nq);
    const size_t r = (size_t)max_rows;
    b->d = d, b->max_rows = max_rows, b->qkv_w = nq + 2 * nkv;
    b->item_heads = el_heads_per_item(m->n_heads / m->n_kv_heads, m->n_kv_heads, decoder_threads(d));
    b->items_per_row = m->n_heads / b->item_heads;
    b->x = alloc_floats(r * m->dim), b->xn = alloc_floats(r * m->dim), b->tmp = alloc_floats(r * m->dim);
    b->qkv = alloc_floats(r * b->qkv_w), b->att = alloc_floats(r * nq);
    b->gate = alloc_floats(r * m->ffn_dim), b->up = alloc_floats(r * m->ffn_dim);
    b->xq = aligned_alloc(64, (r * (wide / EL_QK) * sizeof(el_block_q8a) + 63) / 64 * 64);
    b->hq = aligned_alloc(64, (r * (m->ffn_dim / EL_QK) * sizeof(el_block_q8a) + 63) / 64 * 64);
    if (!b->x || !b->xn || !b->tmp || !b->qkv || !b->att || !b->gate || !b->up || !b->xq || !b->hq) {
        el_batch_destroy(b);
        return NULL;
    }
    atomic_init(&b->job.next, 0);
    return b;
}

int el_batch_max_rows(const el_batch *b) { return b->max_rows; }

/* ---- work distribution ------------------------------------------------------------------------------------ */

static void batch_job(el_batch *b, el_task_fn fn, int items, int chunk) {
    job_reset(&b->job, items, chunk);
    if (b->d->pool) el_pool_run(b->d->pool, fn, b);
    else fn(b, 0, 1);
}

static void batch_rows(el_batch *b, el_task_fn fn, int rows) {
    batch_job(b, fn, rows, el_row_chunk(rows, decoder_threads(b->d)));
}

/* y[i * ldy + r] = w[r] . act_i for every row i, output rows r0..r1 */
static void gemm(const el_batch *b, const el_matrix *w, const el_block_q8a *act, float *y, int ldy, int r0, int r1) {
    el_gemm_fmt(w->fmt, w->data, w->k, act, b->rows, y, ldy, r0, r1);
}

/* ---- the ops' tasks ------------------------------------------------------------------------------------------ */

/* q, k, v projections of every row's xq into its qkv = [q | k | v], plus their biases. */
static void task_qkv(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_batch *b = ctx;
    const el_layer_desc *L = b->layer;
    const el_matrix *mats[3] = {&L->q, &L->k, &L->v};
    const float *bias[3] = {L->q_bias, L->k_bias, L->v_bias};
    int r0, r1;
    while (job_claim(&b->job, &r0, &r1)) {
        int base = 0;
        for (int s = 0; s < 3; s++) {
            const int n = mats[s]->n, a = imax(r0 - base, 0), e = imin(r1 - base, n);
            if (a < e) {
                gemm(b, mats[s], b->xq, b->qkv + base, b->qkv_w, a, e);
                if (bias[s])
                    for (int i = 0; i < b->rows; i++)
                        for (int r = a; r < e; r++) b->qkv[(size_t)i * b->qkv_w + base + r] += bias[s][r];
            }
            base += n;
        }
    }
}

/* Attention of row `item / items_per_row` over its cache up to its position (or the last sliding_window
 * positions), for item_heads query heads of one KV head. */
static void task_attention(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_batch *b = ctx;
    const el_decoder *d = b->d;
    const el_model_desc *m = &d->m;
    const el_layer_desc *L = b->layer;
    const int hd = m->head_dim, group = m->n_heads / m->n_kv_heads, heads = b->item_heads, nq = m->n_heads * hd;
    const int window = L->sliding_window, l = (int)(L - d->layers);
    int i0, i1;
    while (job_claim(&b->job, &i0, &i1)) {
        for (int item = i0; item < i1; item++) {
            const int row = item / b->items_per_row, h0 = item % b->items_per_row * heads, g = h0 / group;
            const int pos = b->pos[row], first = window > 0 && pos + 1 > window ? pos + 1 - window : 0;
            const el_kv_cache *c = &b->caches[b->cache_of[row]];
            const size_t row0 = ((size_t)l * m->n_kv_heads + g) * c->capacity + first, off = row0 * hd;
            float *qs[EL_MAX_GROUP], *ss[EL_MAX_GROUP], *outs[EL_MAX_GROUP];
            for (int j = 0; j < heads; j++) {
                float *q = qs[j] = b->qkv + (size_t)row * b->qkv_w + (size_t)(h0 + j) * hd;
                ss[j] = b->scores + ((size_t)row * m->n_heads + h0 + j) * b->scores_cap;
                outs[j] = b->att + (size_t)row * nq + (size_t)(h0 + j) * hd;
                el_position_head(d, L, L->q_norm, q, pos);
                for (int i = 0; i < hd; i++) q[i] *= m->attn_scale;
            }
            const el_kv_rows kv =
                c->kind == EL_KV_Q8   ? (el_kv_rows){.kq = (const int8_t *)c->keys + off,
                                                     .vq = (const int8_t *)c->values + off,
                                                     .ks = c->key_scales + row0, .vs = c->value_scales + row0}
                : c->kind == EL_KV_F16 ? (el_kv_rows){.kh = (const uint16_t *)c->keys + off,
                                                      .vh = (const uint16_t *)c->values + off}
                                       : (el_kv_rows){.k = (const float *)c->keys + off, .v = (const float *)c->values + off};
            el_attention_group(qs, ss, outs, heads, &kv, pos + 1 - first, hd,
                               m->flags & EL_ATTN_SOFTCAP ? m->attn_softcap : 0.f);
        }
    }
}

/* x_i += mat . act_i (o_proj, down_proj) for every row; with a sandwich norm only tmp_i = mat . act_i. */
static void task_residual(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_batch *b = ctx;
    const int dim = b->d->m.dim;
    int r0, r1;
    while (job_claim(&b->job, &r0, &r1)) {
        gemm(b, b->mat, b->act, b->tmp, dim, r0, r1);
        if (!b->sandwich)
            for (int i = 0; i < b->rows; i++)
                for (int r = r0; r < r1; r++) b->x[(size_t)i * dim + r] += b->tmp[(size_t)i * dim + r];
    }
}

/* gate_i = act(gate_proj(xq_i)) * up_proj(xq_i), quantized chunk by chunk into hq_i for down_proj. */
static void task_gate_up(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_batch *b = ctx;
    const int gelu = (b->d->m.flags & EL_GELU_TANH) != 0, ffn = b->d->m.ffn_dim;
    int r0, r1;
    while (job_claim(&b->job, &r0, &r1)) {
        gemm(b, &b->layer->gate, b->xq, b->gate, ffn, r0, r1);
        gemm(b, &b->layer->up, b->xq, b->up, ffn, r0, r1);
        for (int i = 0; i < b->rows; i++) {
            float *gate = b->gate + (size_t)i * ffn + r0;
            gated_activation(gate, b->up + (size_t)i * ffn + r0, r1 - r0, gelu);
            el_quantize_act(gate, r1 - r0, b->hq + ((size_t)i * ffn + r0) / EL_QK);
        }
    }
}

/* logits_i = lm_head . xq_i, soft-capped with EL_LOGIT_SOFTCAP */
static void task_logits(void *ctx, int ith, int nth) {
    (void)ith, (void)nth;
    el_batch *b = ctx;
    const el_model_desc *m = &b->d->m;
    int r0, r1;
    while (job_claim(&b->job, &r0, &r1)) {
        gemm(b, &m->lm_head, b->xq, b->logits, m->vocab, r0, r1);
        if (m->flags & EL_LOGIT_SOFTCAP)
            for (int i = 0; i < b->rows; i++)
                for (int r = r0; r < r1; r++) {
                    float *y = b->logits + (size_t)i * m->vocab + r;
                    *y = tanhf(*y / m->logit_softcap) * m->logit_softcap;
                }
    }
}

/* ---- validation ---------------------------------------------------------------------------------------------- */

/* Bytes of one of cache c's key (or value) arrays, and of one of its scale arrays. */
static size_t cache_bytes(const el_model_desc *m, const el_kv_cache *c, int scales) {
    const size_t rows = (size_t)m->n_layers * m->n_kv_heads * c->capacity;
    if (scales) return rows * sizeof(float);
    return rows * m->head_dim * (c->kind == EL_KV_F32 ? sizeof(float) : c->kind == EL_KV_F16 ? 2 : 1);
}

static int overlaps(const void *a, size_t na, const void *b, size_t nb) {
    const char *x = a, *y = b;
    return x < y + nb && y < x + na;
}

/* EL_OK when caches[i] and caches[j] (i != j) share no byte, else EL_ERR_CACHE. */
static int disjoint(const el_model_desc *m, const el_kv_cache *ci, const el_kv_cache *cj) {
    void *const ai[4] = {ci->keys, ci->values, ci->key_scales, ci->value_scales};
    void *const aj[4] = {cj->keys, cj->values, cj->key_scales, cj->value_scales};
    const int ni = ci->kind == EL_KV_Q8 ? 4 : 2, nj = cj->kind == EL_KV_Q8 ? 4 : 2;
    for (int s = 0; s < ni; s++)
        for (int t = 0; t < nj; t++)
            if (overlaps(ai[s], cache_bytes(m, ci, s >= 2), aj[t], cache_bytes(m, cj, t >= 2))) return EL_ERR_CACHE;
    return EL_OK;
}

/* Everything the step reads checked before any of it is written: EL_OK or an EL_ERR_* code. */
static int check_rows(const el_batch *b, int rows, const int32_t *tokens, const int32_t *pos, const int32_t *cache_of,
                      const el_kv_cache *caches, int n_caches) {
    const el_model_desc *m = &b->d->m;
    if (rows < 1 || rows > b->max_rows || !tokens || !pos || !cache_of) return EL_ERR_ROWS;
    if (n_caches < 1 || n_caches > rows || !caches) return EL_ERR_CACHE;
    for (int c = 0; c < n_caches; c++) {
        const el_kv_cache *k = &caches[c];
        if (k->kind < EL_KV_F32 || k->kind > EL_KV_Q8 || k->capacity < 1 || !k->keys || !k->values ||
            (k->kind == EL_KV_Q8 && (!k->key_scales || !k->value_scales)))
            return EL_ERR_CACHE;
        for (int j = 0; j < c; j++)
            if (disjoint(m, k, &caches[j])) return EL_ERR_CACHE;
    }
    for (int i = 0; i < rows; i++) {
        if (cache_of[i] < 0 || cache_of[i] >= n_caches) return EL_ERR_CACHE;
        if (pos[i] < 0 || pos[i] >= caches[cache_of[i]].capacity || pos[i] >= m->rope_len) return EL_ERR_POSITION;
        if (tokens[i] < 0 || tokens[i] >= m->vocab) return EL_ERR_TOKEN;
        for (int j = i - 1; j >= 0; j--) /* the latest earlier row of the same cache is one position before */
            if (cache_of[j] == cache_of[i]) {
                if (pos[i] != pos[j] + 1) return EL_ERR_ORDER;
                break;
            }
    }
    return EL_OK;
}

/* ---- the step ------------------------------------------------------------------------------------------------ */

/* Row i's new keys and values (in its qkv) into its cache at its position, RoPE'd and normed as the step does. */
static void store_kv(el_batch *b, int l) {
    const el_decoder *d = b->d;
    const el_model_desc *m = &d->m;
    const el_layer_desc *L = &d->layers[l];
    const int hd = m->head_dim, nq = m->n_heads * hd, nkv = m->n_kv_heads * hd;
    for (int i = 0; i < b->rows; i++) {
        const el_kv_cache *c = &b->caches[b->cache_of[i]];
        for (int g = 0; g < m->n_kv_heads; g++) {
            float *k = b->qkv + (size_t)i * b->qkv_w + nq + (size_t)g * hd, *v = k + nkv;
            el_position_head(d, L, L->k_norm, k, b->pos[i]);
            const size_t at = (((size_t)l * m->n_kv_heads + g) * c->capacity + b->pos[i]) * hd;
            if (c->kind == EL_KV_Q8) {
                el_kv_quantize(k, hd, (int8_t *)c->keys + at, c->key_scales + at / hd);
                el_kv_quantize(v, hd, (int8_t *)c->values + at, c->value_scales + at / hd);
            } else if (c->kind == EL_KV_F16) {
                uint16_t *kh = (uint16_t *)c->keys + at, *vh = (uint16_t *)c->values + at;
                for (int e = 0; e < hd; e++) kh[e] = el_float_to_half(k[e]), vh[e] = el_float_to_half(v[e]);
            } else {
                memcpy((float *)c->keys + at, k, (size_t)hd * sizeof(float));
                memcpy((float *)c->values + at, v, (size_t)hd * sizeof(float));
            }
        }
    }
}

/* xq_i = int8 blocks of rmsnorm(x_i, w) for every row (rows of dim / 32 blocks). */
static void norm_rows(el_batch *b, const float *w) {
    const el_model_desc *m = &b->d->m;
    for (int i = 0; i < b->rows; i++) {
        rmsnorm(b->x + (size_t)i * m->dim, w, m->dim, m->eps, b->xn + (size_t)i * m->dim);
        el_quantize_act(b->xn + (size_t)i * m->dim, m->dim, b->xq + (size_t)i * (m->dim / EL_QK));
    }
}

/* x_i += mat . act_i for every row, or with EL_SANDWICH_NORMS x_i += rmsnorm(mat . act_i, out_norm). */
static void residual(el_batch *b, const el_matrix *mat, const el_block_q8a *act, const float *out_norm) {
    const el_model_desc *m = &b->d->m;
    b->mat = mat, b->act = act, b->sandwich = (m->flags & EL_SANDWICH_NORMS) != 0;
    batch_rows(b, task_residual, m->dim);
    if (b->sandwich)
        for (int i = 0; i < b->rows; i++) {
            float *t = b->tmp + (size_t)i * m->dim, *x = b->x + (size_t)i * m->dim;
            rmsnorm(t, out_norm, m->dim, m->eps, t);
            for (int e = 0; e < m->dim; e++) x[e] += t[e];
        }
}

/* Rows 0..rows: token tokens[i] at position pos[i] in cache caches[cache_of[i]]; logits[rows][vocab]. Distinct
 * caches share no memory; rows of one cache come at consecutive positions in row order. Returns EL_OK or an
 * EL_ERR_* code, with nothing written then. */
int el_batch_step(el_batch *b, int rows, const int32_t *tokens, const int32_t *pos, const int32_t *cache_of,
                  const el_kv_cache *caches, int n_caches, float *logits) {
    if (!b || !logits) return EL_ERR_ROWS;
    int code = check_rows(b, rows, tokens, pos, cache_of, caches, n_caches);
    if (code) return code;
    el_decoder *d = b->d;
    const el_model_desc *m = &d->m;
    int capacity = 0;
    for (int c = 0; c < n_caches; c++) capacity = imax(capacity, caches[c].capacity);
    if ((size_t)capacity > b->scores_cap) { /* the caches grew: once per growth, never per step */
        float *s = alloc_floats((size_t)b->max_rows * m->n_heads * capacity);
        if (!s) return EL_ERR_MEMORY;
        free(b->scores);
        b->scores = s, b->scores_cap = (size_t)capacity;
    }
    b->rows = rows, b->pos = pos, b->cache_of = cache_of, b->caches = caches, b->logits = logits;
    const int nq = m->n_heads * m->head_dim;

    for (int i = 0; i < rows; i++) {
        float *x = b->x + (size_t)i * m->dim;
        embed_row(&m->embed, tokens[i], x);
        if (m->flags & EL_EMBED_SCALE)
            for (int e = 0; e < m->dim; e++) x[e] *= m->embed_scale;
    }
    for (int l = 0; l < m->n_layers; l++) {
        const el_layer_desc *L = b->layer = &d->layers[l];
        norm_rows(b, L->attn_norm);
        batch_rows(b, task_qkv, b->qkv_w);
        store_kv(b, l); /* every row's keys/values first: a later row of the same cache attends over them */
        batch_job(b, task_attention, rows * b->items_per_row, 1);
        for (int i = 0; i < rows; i++)
            el_quantize_act(b->att + (size_t)i * nq, nq, b->xq + (size_t)i * (nq / EL_QK));
        residual(b, &L->o, b->xq, L->attn_out_norm);
        norm_rows(b, L->ffn_norm);
        batch_rows(b, task_gate_up, m->ffn_dim);
        residual(b, &L->down, b->hq, L->ffn_out_norm);
    }
    norm_rows(b, m->final_norm);
    batch_rows(b, task_logits, m->vocab);
    return EL_OK;
}
