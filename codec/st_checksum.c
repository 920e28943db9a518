/*
 * st_checksum.c - XXH3-64 (seed 0) over buffers, one-shot and streaming: libxxhash at the
 * scalar ISA level, xxhash.h's AVX2 / AVX-512 code above it (st_checksum_simd.h; the same
 * values, 2-3x the speed of the library's SSE2 on data in cache). States are libxxhash's.
 */
#include <errno.h>
#include <xxhash.h>

#include "st_checksum_simd.h"
#include "st_codec.h"

uint64_t st_checksum(const void *p, size_t n)
{
    switch (st_codec_isa()) {
    case ST_ISA_AVX512:
        return st_xxh3_avx512_64(p, n);
    case ST_ISA_AVX2:
        return st_xxh3_avx2_64(p, n);
    case ST_ISA_SCALAR:
        break;
    }
    return (uint64_t)XXH3_64bits(p, n);
}

int st_checksum_init(st_checksum_state *s)
{
    XXH3_state_t *x = XXH3_createState();
    if (!x)
        return ENOMEM;
    XXH3_64bits_reset(x);
    s->impl = x;
    return 0;
}

void st_checksum_update(st_checksum_state *s, const void *p, size_t n)
{
    switch (st_codec_isa()) {
    case ST_ISA_AVX512:
        st_xxh3_avx512_update(s->impl, p, n);
        return;
    case ST_ISA_AVX2:
        st_xxh3_avx2_update(s->impl, p, n);
        return;
    case ST_ISA_SCALAR:
        break;
    }
    XXH3_64bits_update((XXH3_state_t *)s->impl, p, n);
}

uint64_t st_checksum_final(const st_checksum_state *s)
{
    return (uint64_t)XXH3_64bits_digest((const XXH3_state_t *)s->impl);
}

void st_checksum_free(st_checksum_state *s)
{
    if (s && s->impl) {
        XXH3_freeState((XXH3_state_t *)s->impl);
        s->impl = NULL;
    }
}
