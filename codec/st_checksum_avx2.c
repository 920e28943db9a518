/*
 * st_checksum_avx2.c - XXH3-64 for AVX2 (st_checksum_simd.h); built with -mavx2 and entered
 * only where st_codec_isa() is AVX2 or more.
 */
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "st_checksum_simd.h"

uint64_t st_xxh3_avx2_64(const void *p, size_t n)
{
    return (uint64_t)XXH3_64bits(p, n);
}

void st_xxh3_avx2_update(void *state, const void *p, size_t n)
{
    XXH3_64bits_update((XXH3_state_t *)state, p, n);
}
