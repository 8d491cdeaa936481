/* Test driver for the GGUF block kernels on another architecture (run under qemu-user by
 * tests/test_kernels_arm_gguf.py). stdin: int32 fmt, n, k, m, then n / 8 row groups of the format's group blocks,
 * then m x k float32 activations. stdout: el_variant() padded to 16 bytes, int32 el_linear's return code, the m x k/32
 * quantized activation blocks, the m x n float32 outputs of el_linear, then the n x k weights as el_block_row_f32
 * gives them. */
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
    if (!el_fmt_ok(fmt, k) || n % EL_ROWS || n <= 0 || m <= 0) {
        fprintf(stderr, "bad header\n");
        return 2;
    }
    const int bk = el_fmt_block_k(fmt), nb = k / bk, nbx = k / EL_QK;
    const size_t gsize = el_fmt_group_bytes(fmt), group = gsize * (size_t)nb;
    char *w = malloc(group * (size_t)(n / EL_ROWS));
    float *x = malloc(sizeof(float) * (size_t)m * k), *y = malloc(sizeof(float) * (size_t)m * n);
    float *rows = malloc(sizeof(float) * (size_t)n * k);
    el_block_q8a *xq = malloc(sizeof(el_block_q8a) * (size_t)m * nbx);
    read_all(w, group * (size_t)(n / EL_ROWS));
    read_all(x, sizeof(float) * (size_t)m * k);
    for (int i = 0; i < m; i++) el_quantize_act(x + (size_t)i * k, k, xq + (size_t)i * nbx);
    const int32_t rc = el_linear(NULL, fmt, w, n, k, x, m, y);
    for (int r = 0; r < n; r++)
        for (int b = 0; b < nb; b++)
            el_block_row_f32(fmt, w + (size_t)(r / EL_ROWS) * group + (size_t)b * gsize, r % EL_ROWS,
                             rows + (size_t)r * k + (size_t)b * bk);
    char name[16] = {0};
    strncpy(name, el_variant(), sizeof name - 1);
    fwrite(name, 1, sizeof name, stdout);
    fwrite(&rc, sizeof rc, 1, stdout);
    fwrite(xq, sizeof(el_block_q8a), (size_t)m * nbx, stdout);
    fwrite(y, sizeof(float), (size_t)m * n, stdout);
    fwrite(rows, sizeof(float), (size_t)n * k, stdout);
    return 0;
}
