/*
 * st_checksum.c - XXH3-64 (seed 0) over buffers, one-shot and streaming, through libxxhash.
 */
#include <errno.h>
#include <xxhash.h>

#include "st_codec.h"

uint64_t st_checksum(const void *p, size_t n)
{
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
