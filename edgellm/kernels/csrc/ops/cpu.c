/* What the CPU *and the OS* allow: CPUID says what the silicon has; XCR0 (xgetbv) says which register
 * states the OS saves on a context switch. A hypervisor can advertise AVX-512 in CPUID and leave it
 * off in XCR0, and then the first zmm instruction traps. On aarch64 the kernel's HWCAP says both. */
#include <string.h>

#include "edgellm_kernels.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

uint64_t el_cpu_xcr0(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & (1u << 27))) return 0; /* no OSXSAVE: no xgetbv */
    uint32_t lo, hi;
    __asm__ __volatile__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
    return ((uint64_t)hi << 32) | lo;
}

int el_cpu_allows(const char *variant) {
    if (!strcmp(variant, "scalar")) return 1;
    unsigned a1, b1, c1, d1, a7 = 0, b7 = 0, c7 = 0, d7 = 0, a71 = 0, b71, c71, d71;
    if (!__get_cpuid(1, &a1, &b1, &c1, &d1)) return 0;
    if (__get_cpuid_max(0, NULL) >= 7) {
        __cpuid_count(7, 0, a7, b7, c7, d7);
        __cpuid_count(7, 1, a71, b71, c71, d71);
    }
    const uint64_t xcr0 = el_cpu_xcr0();
    const int ymm = (xcr0 & 0x6) == 0x6;       /* SSE + AVX state */
    const int zmm = (xcr0 & 0xe6) == 0xe6;     /* + opmask, ZMM0-15 upper halves, ZMM16-31 */
    const int avx2 = ymm && (c1 & (1u << 28)) && (c1 & (1u << 12)) && (c1 & (1u << 29)) && (b7 & (1u << 5));
    if (!strcmp(variant, "avx2")) return avx2;
    if (!strcmp(variant, "avxvnni")) return avx2 && (a71 & (1u << 4));
    const int avx512 = avx2 && zmm && (b7 & (1u << 16)) && (b7 & (1u << 30)) && (b7 & (1u << 31)) && (c7 & (1u << 11));
    if (!strcmp(variant, "avx512")) return avx512;
    if (!strcmp(variant, "avx512bf16")) return avx512 && (a71 & (1u << 5));
    return 0;
}

int el_cpu_splits_zmm(void) {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541u || d != 0x69746e65u || c != 0x444d4163u) return 0;
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0; /* "AuthenticAMD" above; the family below */
    const unsigned base = (a >> 8) & 0xf, family = base == 0xf ? base + ((a >> 20) & 0xff) : base;
    return family == 0x19 && el_cpu_allows("avx512");
}

#elif defined(__aarch64__) && defined(__linux__)
#include <sys/auxv.h>

uint64_t el_cpu_xcr0(void) { return 0; }

int el_cpu_splits_zmm(void) { return 0; }

int el_cpu_allows(const char *variant) {
    const unsigned long hw = getauxval(AT_HWCAP);
    if (!strcmp(variant, "scalar")) return 1;
    if (!strcmp(variant, "neon")) return (hw >> 1) & 1;                         /* HWCAP_ASIMD */
    if (!strcmp(variant, "neon-dotprod")) return ((hw >> 1) & 1) && ((hw >> 20) & 1); /* + ASIMDDP */
    return 0;
}

#else
uint64_t el_cpu_xcr0(void) { return 0; }

int el_cpu_splits_zmm(void) { return 0; }

int el_cpu_allows(const char *variant) { return !strcmp(variant, "scalar"); }
#endif
