/* y[M, N] = x[M, K] @ W.T for a weight in a block format: the entry point of the per-op (torch) path.
 * Quantizes the activation rows once, then hands out work items to the pool's threads: a chunk of
 * weight row groups times a tile of at most EL_M_TILE activation rows (whose quantized blocks stay in
 * the core's cache while the chunk's weights stream through). */
#include <stdatomic.h>
#include <stdlib.h>

#include "edgellm_kernels.h"

#define EL_M_TILE 64

typedef struct {
    int fmt, n, k, m, chunk, row_chunks;
    const void *w;
    const el_block_q8a *x;
    float *y;
    atomic_int next;
} linear_job;

static void linear_task(void *ctx, int ith, int nth) {
    (void)ith;
    (void)nth;
    linear_job *j = ctx;
    const int nb = j->k / EL_QK, tiles = (j->m + EL_M_TILE - 1) / EL_M_TILE;
    for (;;) {
        const int item = atomic_fetch_add(&j->next, 1);
        if (item >= tiles * j->row_chunks) return;
        const int i0 = item / j->row_chunks * EL_M_TILE, r0 = item % j->row_chunks * j->chunk;
        const int mt = j->m - i0 < EL_M_TILE ? j->m - i0 : EL_M_TILE;
        const int r1 = r0 + j->chunk < j->n ? r0 + j->chunk : j->n;
        const el_block_q8a *x = j->x + (size_t)i0 * nb;
        float *y = j->y + (size_t)i0 * j->n;
        el_gemm_fmt(j->fmt, j->w, j->k, x, mt, y, j->n, r0, r1);
    }
}

int el_linear(el_pool *pool, int fmt, const void *w, int n, int k, const float *x, int m, float *y) {
    if (!el_fmt_ok(fmt, k) || n % EL_ROWS || n < 0 || m < 0) return -1;
    if (n == 0 || m == 0) return 0;
    const int nb = k / EL_QK;
    el_block_q8a *xq = malloc((size_t)m * (nb > 0 ? nb : 1) * sizeof(el_block_q8a));
    if (!xq) return -1;
    for (int i = 0; i < m; i++) el_quantize_act(x + (size_t)i * k, k, xq + (size_t)i * nb);
    const int nth = pool ? el_pool_threads(pool) : 1;
    int chunk = n / (nth * 8);
    chunk = chunk < 16 ? 16 : (chunk + 15) / 16 * 16;
    linear_job job = {fmt, n, k, m, chunk, (n + chunk - 1) / chunk, w, xq, y, 0};
    if (pool) el_pool_run(pool, linear_task, &job);
    else linear_task(&job, 0, 1);
    free(xq);
    return 0;
}
