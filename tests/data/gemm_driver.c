/* Test driver for el_gemm_f32 on another architecture (run under qemu-user by tests/test_kernels_arm.py).
 * stdin: int32 fmt (an EL_ format code), n, k, m, then n / 8 row groups of that format's weight blocks, then m x k
 * float32 activations.
 * stdout: el_prefill_matmul() padded to 16 bytes ("" for NULL), then y [m][n] on the caller's thread, then y on a
 * 3-thread pool. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "edgellm_kernels.h"

static void read_all(void *p, size_t n) {
    if (fread(p, 1, n, stdin) != n) {
        fprintf(stderr, "short input\n");
        exit(2);
    }
}

int main(void) {
    int32_t hdr[4];
    read_all(hdr, sizeof hdr);
    const int fmt = hdr[0], n = hdr[1], k = hdr[2], m = hdr[3];
    if (!el_fmt_block_k(fmt)) return 4;
    const size_t group = (size_t)(k / el_fmt_block_k(fmt)) * el_fmt_group_bytes(fmt);
    void *w = malloc(group * (n / EL_ROWS));
    float *x = malloc(sizeof(float) * m * k), *y = malloc(sizeof(float) * m * n * 2);
    read_all(w, group * (n / EL_ROWS));
    read_all(x, sizeof(float) * m * k);
    el_pool *pool = el_pool_create(3);
    if (el_gemm_f32(NULL, fmt, w, n, k, x, m, y) || el_gemm_f32(pool, fmt, w, n, k, x, m, y + (size_t)m * n)) return 3;
    el_pool_destroy(pool);
    char name[16] = {0};
    const char *matmul = el_prefill_matmul();
    if (matmul) strncpy(name, matmul, sizeof name - 1);
    fwrite(name, 1, sizeof name, stdout);
    fwrite(y, sizeof(float), (size_t)m * n * 2, stdout);
    return 0;
}
