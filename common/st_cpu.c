/*
 * st_cpu.c - what this CPU can run, the project's one detector (the codec's ISA levels and the
 * engine's kernels both ask it).
 * Invariants: a feature of the wide registers counts only when the OS saves them (the compiler's
 * __builtin_cpu_supports checks XCR0 for AVX2 and AVX-512; F16C, which it does not know under
 * clang, is read from CPUID leaf 1 and only counted together with AVX2, which implies YMM state);
 * the answer is computed once and cached (a data race on the cache writes the same value).
 */
#include <stdatomic.h>

#include "st_common.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>

static unsigned st_cpu_detect(void)
{
    unsigned f = 0, a, b, c, d;
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2"))
        f |= ST_CPU_AVX2;
    if ((f & ST_CPU_AVX2) && __get_cpuid(1, &a, &b, &c, &d) && (c & bit_F16C))
        f |= ST_CPU_F16C;
    if (__builtin_cpu_supports("fma"))
        f |= ST_CPU_FMA;
    if (__builtin_cpu_supports("avx512f"))
        f |= ST_CPU_AVX512F;
    if (__builtin_cpu_supports("avx512bw"))
        f |= ST_CPU_AVX512BW;
    if (__builtin_cpu_supports("avx512vl"))
        f |= ST_CPU_AVX512VL;
    if (__builtin_cpu_supports("avx512dq"))
        f |= ST_CPU_AVX512DQ;
    if (__builtin_cpu_supports("avx512vnni"))
        f |= ST_CPU_AVX512VNNI;
    return f;
}
#else
static unsigned st_cpu_detect(void)
{
    return 0;
}
#endif

#define ST_CPU_KNOWN (1u << 31)

unsigned st_cpu_features(void)
{
    static atomic_uint cached;
    unsigned f = atomic_load_explicit(&cached, memory_order_relaxed);
    if (!(f & ST_CPU_KNOWN)) {
        f = st_cpu_detect() | ST_CPU_KNOWN;
        atomic_store_explicit(&cached, f, memory_order_relaxed);
    }
    return f & ~ST_CPU_KNOWN;
}
