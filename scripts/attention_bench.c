/* Times the native decode step's attention alone: Qwen2.5-0.5B's shapes (24 layers, 2 KV heads of 7
 * query heads, head dim 64) over a half-precision cache of N positions, every layer's keys and values
 * in their own memory as in a real cache. Built and run by scripts/attention_bench.py, which includes
 * the decoder/decode.c under test (this file's first line) with one kernel variant's compiler flags. */
#include "decoder/decode.c"

#include <stdio.h>
#include <time.h>

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    const int n = argc > 1 ? atoi(argv[1]) : 600, reps = argc > 2 ? atoi(argv[2]) : 200;
    enum { LAYERS = 24, KV_HEADS = 2, GROUP = 7, HD = 64 };
    const size_t per_head = (size_t)n * HD, total = (size_t)LAYERS * KV_HEADS * per_head;
    uint16_t *keys = malloc(total * sizeof *keys), *values = malloc(total * sizeof *values);
    float *q[GROUP], *s[GROUP], *out[GROUP];
    if (!keys || !values) return 1;
    for (size_t i = 0; i < total; i++) {
        keys[i] = el_float_to_half((float)((i * 7919) % 1000) / 1000.f - 0.5f);
        values[i] = el_float_to_half((float)((i * 104729) % 1000) / 1000.f - 0.5f);
    }
    for (int h = 0; h < GROUP; h++) {
        q[h] = alloc_floats(HD), s[h] = alloc_floats((size_t)n), out[h] = alloc_floats(HD);
        for (int i = 0; i < HD; i++) q[h][i] = 0.01f * (float)(i - h);
    }
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        const double t0 = seconds();
        for (int layer = 0; layer < LAYERS; layer++)
            for (int g = 0; g < KV_HEADS; g++) {
                const size_t off = ((size_t)layer * KV_HEADS + g) * per_head;
                const el_kv_rows kv = {.kh = keys + off, .vh = values + off};
                attention_group(q, s, out, GROUP, &kv, n, HD, 0.f);
            }
        const double t = seconds() - t0;
        best = t < best ? t : best;
    }
    printf("%.3f\n", best * 1e3);
    return 0;
}
