/* Checks vec.h's int8 -> float widening (v8f_load_i8) on every int8 value at every offset within 8
 * bytes (unaligned loads), and its half -> float widening (v8f_load_f16) on every half bit pattern
 * against the portable el_half_to_float (NaNs: still NaN); prints "ok <path>" or the first wrong
 * value, exit status 0 / 1. Linked with the kernel sources. */
#include "arch/vec.h"

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
    static uint16_t halves[65536 + 8];
    for (int i = 0; i < 65536 + 8; i++) halves[i] = (uint16_t)i;
    for (int i = 1; i < 65536; i += 8) { /* offset 1: unaligned */
        const el_v8f v = v8f_load_f16(halves + i);
        for (int j = 0; j < 8; j++) {
            const float want = el_half_to_float(halves[i + j]);
            if (want == want ? v[j] != want : v[j] == v[j]) {
                printf("wrong: half 0x%04x widened to %g, not %g\n", halves[i + j], (double)v[j], (double)want);
                return 1;
            }
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
