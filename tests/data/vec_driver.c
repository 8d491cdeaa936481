/* Checks vec.h's int8 -> float widening (v8f_load_i8) on every int8 value at every offset within 8
 * bytes (unaligned loads); prints "ok <path>" or the first wrong value, exit status 0 / 1. */
#include "vec.h"

#include <stdio.h>

int main(void) {
    int8_t bytes[256 + 16];
    for (int i = 0; i < 256 + 16; i++) bytes[i] = (int8_t)(i - 128);
    for (int offset = 0; offset < 8; offset++)
        for (int i = offset; i + 8 <= 256 + 16; i += 8) {
            const el_v8f v = v8f_load_i8(bytes + i);
            for (int j = 0; j < 8; j++)
                if (v[j] != (float)bytes[i + j]) {
                    printf("wrong: byte %d widened to %g\n", bytes[i + j], (double)v[j]);
                    return 1;
                }
        }
#if defined(EL_VEC_AVX)
    puts("ok avx");
#elif defined(EL_VEC_NEON)
    puts("ok neon");
#else
    puts("ok generic");
#endif
    return 0;
}
