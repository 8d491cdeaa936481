/* Test driver for the GEMV kernels on another architecture (run under qemu-user by
 * tests/test_kernels_arm.py). stdin: int32 fmt (4 | 8), n, k, then n / 8 row groups of k/32 weight blocks (el_block_q4x8 / el_block_q8x8), then
 * k float32 activations. stdout: el_variant() padded to 16 bytes, int32 el_cpu_allows(argv[1]), the
 * k/32 quantized activation blocks, then n float32 outputs. */
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

int main(int argc, char **argv) {
    int32_t hdr[3];
    read_all(hdr, sizeof hdr);
    const int fmt = hdr[0], n = hdr[1], k = hdr[2], nb = k / EL_QK;
    const size_t group = (size_t)nb * (fmt == EL_Q4 ? sizeof(el_block_q4x8) : sizeof(el_block_q8x8));
    void *w = malloc(group * (n / EL_ROWS));
    float *x = malloc(sizeof(float) * k), *y = malloc(sizeof(float) * n);
    el_block_q8a *xq = malloc(sizeof(el_block_q8a) * nb);
    read_all(w, group * (n / EL_ROWS));
    read_all(x, sizeof(float) * k);
    el_quantize_act(x, k, xq);
    if (fmt == EL_Q4) el_gemv_q4(w, k, xq, y, 0, n);
    else el_gemv_q8(w, k, xq, y, 0, n);
    char name[16] = {0};
    strncpy(name, el_variant(), sizeof name - 1);
    const int32_t allowed = argc > 1 ? el_cpu_allows(argv[1]) : -1;
    fwrite(name, 1, sizeof name, stdout);
    fwrite(&allowed, sizeof allowed, 1, stdout);
    fwrite(xq, sizeof(el_block_q8a), nb, stdout);
    fwrite(y, sizeof(float), n, stdout);
    return 0;
}
