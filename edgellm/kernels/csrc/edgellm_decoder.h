/* edgellm's native decoder: the model description Python hands over, the error codes, and the functions that run
 * a model's layers for one token (the decode step) or a chunk of them (prefill). edgellm/kernels/abi.py declares
 * all of it for ctypes; tests/test_abi.py fails when the two differ. */
#ifndef EDGELLM_DECODER_H
#define EDGELLM_DECODER_H

#include <stdint.h>

#include "edgellm_kernels.h"

/* Options of other model families; a description with a flag outside EL_SUPPORTED_FLAGS is refused
 * by el_decoder_create (the caller keeps torch's path). Norm weights come with any offset folded in
 * (Gemma's 1 + w is stored as such by the caller), and a layer with sliding_window > 0 attends to that
 * many positions (itself included), so neither needs a flag. */
enum {
    EL_QK_NORM = 1 << 0,       /* RMSNorm over each q/k head before RoPE (Qwen3, Gemma 3) */
    EL_SANDWICH_NORMS = 1 << 1, /* RMSNorm of the attention and MLP outputs before the residual add (Gemma) */
    EL_GELU_TANH = 1 << 2,     /* gate activation GELU (tanh approximation) instead of SiLU (Gemma) */
    EL_EMBED_SCALE = 1 << 3,   /* embedding rows multiplied by embed_scale (Gemma: sqrt(dim)) */
    EL_LOGIT_SOFTCAP = 1 << 4, /* logits = cap * tanh(logits / cap) (final_logit_softcapping) */
    EL_ATTN_SOFTCAP = 1 << 5   /* attention scores likewise, with attn_softcap (Gemma 2) */
};
#define EL_SUPPORTED_FLAGS \
    (EL_QK_NORM | EL_SANDWICH_NORMS | EL_GELU_TANH | EL_EMBED_SCALE | EL_LOGIT_SOFTCAP | EL_ATTN_SOFTCAP)

typedef struct {
    const void *data; /* N / 8 groups of blocks (a block format) or N rows of K floats (f32) */
    int32_t fmt;      /* EL_F32 or a block format (EL_Q4, EL_Q8, EL_Q5_0, EL_Q4_K, EL_Q6_K) */
    int32_t n, k;
} el_matrix;

typedef struct {
    const float *attn_norm, *ffn_norm;         /* [dim]: the inputs of attention and of the MLP */
    const float *attn_out_norm, *ffn_out_norm; /* [dim], EL_SANDWICH_NORMS: their outputs */
    el_matrix q, k, v, o, gate, up, down;
    const float *q_bias, *k_bias, *v_bias; /* NULL when the family has none */
    const float *q_norm, *k_norm;          /* [head_dim], EL_QK_NORM */
    const float *rope_cos, *rope_sin;      /* [rope_len, head_dim], this layer's rotate-half tables */
    int32_t sliding_window;                /* positions a query sees, itself included; 0 = all */
} el_layer_desc;

/* The vectors' lengths are not carried: el_decoder_check tests their pointers only, and the caller guarantees each
 * holds the floats its comment says (kernels/decoder.py, checked by families/tensor_specs.py). */
typedef struct {
    int32_t n_layers, dim, n_heads, n_kv_heads, head_dim, ffn_dim, vocab;
    uint32_t flags;
    float eps, attn_scale, embed_scale, logit_softcap, attn_softcap; /* scores = attn_scale * q . k */
    el_matrix embed, lm_head;
    const float *final_norm;
    int32_t rope_len; /* positions of every layer's RoPE tables */
    const el_layer_desc *layers; /* [n_layers]; copied by el_decoder_create */
} el_model_desc;

/* What the decoder's functions return (el_strerror says each in words): EL_OK, an EL_ERR_* of a step or a prefill,
 * or an EL_DESC_* of el_decoder_check (a description this library does not implement). */
enum {
    EL_OK = 0,
    EL_ERR_POSITION = 1,     /* a position outside the KV cache or the RoPE tables */
    EL_ERR_TOKEN = 2,        /* a token id outside the vocabulary */
    EL_ERR_MEMORY = 3,       /* scratch buffers could not be allocated */
    EL_ERR_ROWS = 4,         /* a batched step's rows count outside 1..its maximum */
    EL_ERR_CACHE = 5,        /* a batched step's caches: a bad kind, capacity, pointer or index, or two sharing memory */
    EL_ERR_ORDER = 6,        /* rows of one cache in a batched step not at consecutive positions */
    EL_ERR_UNAVAILABLE = -2, /* this library has no native prefill (the scalar variant) */
    EL_DESC_FLAGS = 11,      /* a flag outside EL_SUPPORTED_FLAGS */
    EL_DESC_SHAPE = 12,      /* dimensions out of range or not multiples of their blocks */
    EL_DESC_EMBED = 13,      /* the embedding or the LM head */
    EL_DESC_LAYER = 14,      /* a layer's matrices, norms, RoPE tables or window */
    EL_DESC_OPTION = 15      /* a flag's weights or value missing (QK norms, sandwich norms, soft-caps) */
};

/* The code in words (a static string; "unknown error code" for any other). */
const char *el_strerror(int code);

typedef struct el_decoder el_decoder;

/* EL_OK when the description is one this library implements; else an EL_DESC_* code. */
int el_decoder_check(const el_model_desc *m);
/* A decoder for `m` whose ops run on `pool` (shared, not owned; NULL: the caller's thread only); NULL when
 * el_decoder_check refuses `m` or memory runs out. */
el_decoder *el_decoder_create(const el_model_desc *m, el_pool *pool);
void el_decoder_destroy(el_decoder *d);
/* Threads the decoder's ops run on (its pool's, or 1). */
int el_decoder_threads(const el_decoder *d);

/* Run `token` at position `pos` through every layer, its keys/values appended to the cache
 * ([n_layers][n_kv_heads][capacity][head_dim]), and write the next-token logits[vocab]. Returns EL_OK or an EL_ERR_*
 * code (nothing written then). Over a float32 cache, an IEEE half one (the "f16" kind), or an int8 one with
 * per-token-per-head scales [n_layers][n_kv_heads][capacity] (the "q8" kind). */
int el_decoder_step(el_decoder *d, int token, int pos, float *kcache, float *vcache, int capacity, float *logits);
int el_decoder_step_f16(el_decoder *d, int token, int pos, uint16_t *kcache, uint16_t *vcache, int capacity,
                        float *logits);
int el_decoder_step_q8(el_decoder *d, int token, int pos, int8_t *kcache, int8_t *vcache, float *kscale,
                       float *vscale, int capacity, float *logits);

/* Prefill of tokens[0..n) at positions start..start+n-1 over the float32, half or int8 cache (decoder/prefill.c says
 * the contract); logits[n or 1][vocab] (all_logits: every position's, else the last one's). */
int el_decoder_prefill(el_decoder *d, const int32_t *tokens, int n, int start, float *kcache, float *vcache,
                       int capacity, float *logits, int all_logits);
int el_decoder_prefill_f16(el_decoder *d, const int32_t *tokens, int n, int start, uint16_t *kcache, uint16_t *vcache,
                           int capacity, float *logits, int all_logits);
int el_decoder_prefill_q8(el_decoder *d, const int32_t *tokens, int n, int start, int8_t *kcache, int8_t *vcache,
                          float *kscale, float *vscale, int capacity, float *logits, int all_logits);

/* The batched step (decoder/decode_batch.c says the contract): rows 0..rows, row i token tokens[i] at position pos[i]
 * in cache caches[cache_of[i]], logits[rows][vocab]. Rows of one cache come at consecutive positions in row order;
 * distinct caches share no memory. A cache as the single steps take it: kind EL_KV_F32, EL_KV_F16 or EL_KV_Q8 (int8
 * keys/values and float32 scales [n_layers][n_kv_heads][capacity]). */
#define EL_BATCH_MAX_ROWS 64 /* rows per batched step at most */
enum { EL_KV_F32 = 0, EL_KV_F16 = 1, EL_KV_Q8 = 2 };
typedef struct {
    void *keys, *values;
    float *key_scales, *value_scales; /* EL_KV_Q8 only */
    int32_t kind, capacity;
} el_kv_cache;
typedef struct el_batch el_batch;
/* Scratch for up to max_rows (1..EL_BATCH_MAX_ROWS) rows per step of decoder `d` (borrowed: destroy the batch
 * first); NULL on a bad argument or out of memory. */
el_batch *el_batch_create(el_decoder *d, int max_rows);
void el_batch_destroy(el_batch *b);
int el_batch_max_rows(const el_batch *b);
/* EL_OK or an EL_ERR_* code (nothing written then). */
int el_batch_step(el_batch *b, int rows, const int32_t *tokens, const int32_t *pos, const int32_t *cache_of,
                  const el_kv_cache *caches, int n_caches, float *logits);

/* Symmetric int8 of x[n] with one scale, bit for bit as kv_cache.quantize_q8. */
void el_kv_quantize(const float *x, int n, int8_t *q, float *scale);

#endif
