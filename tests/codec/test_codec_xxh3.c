/*
 * test_codec_xxh3.c - codec/st_xxh3.h, the XXH3-64 the CUDA kernels digest state with, against
 * libxxhash (st_checksum) on the host: every length 0..4,200 (every short path, the block edges at
 * 1,024 and the partial blocks), long buffers up to a state-hash block (1 MiB) and past it, at
 * odd start offsets, and a buffer with every byte value in every position class.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_codec.h"
#include "st_xxh3.h"

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

static uint8_t *random_bytes(size_t n)
{
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(next64() >> 56);
    return p;
}

static void test_every_short_length(void **state)
{
    (void)state;
    size_t max = 4200;
    uint8_t *p = random_bytes(max + 8);
    for (size_t n = 0; n <= max; n++)
        for (size_t off = 0; off < 3; off++) {
            uint64_t want = st_checksum(p + off, n), got = st_xxh3_64(p + off, n);
            if (want != got)
                fail_msg("length %zu at offset %zu: libxxhash %016llx, st_xxh3_64 %016llx", n, off,
                         (unsigned long long)want, (unsigned long long)got);
        }
    free(p);
}

static void test_long_lengths(void **state)
{
    (void)state;
    const size_t lens[] = {(size_t)1 << 20, ((size_t)1 << 20) - 4, ((size_t)1 << 20) + 1,
                           ((size_t)1 << 20) + 64, 3 * 1024 * 1024 + 1000, 65536 + 63,
                           131072 - 65};
    size_t max = 3 * 1024 * 1024 + 1000;
    uint8_t *p = random_bytes(max + 1);
    for (size_t i = 0; i < sizeof lens / sizeof lens[0]; i++) {
        uint64_t want = st_checksum(p + (i & 1), lens[i]), got = st_xxh3_64(p + (i & 1), lens[i]);
        if (want != got)
            fail_msg("length %zu: libxxhash %016llx, st_xxh3_64 %016llx", lens[i],
                     (unsigned long long)want, (unsigned long long)got);
    }
    free(p);
}

/* Structured inputs: all zeros, all 0xff, and a ramp, where a slip in a lane's index or a secret
 * offset would still show. */
static void test_structured(void **state)
{
    (void)state;
    size_t n = 70000;
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (int kind = 0; kind < 3; kind++) {
        for (size_t i = 0; i < n; i++)
            p[i] = kind == 0 ? 0 : kind == 1 ? 0xff : (uint8_t)(i * 7 + (i >> 8));
        for (size_t len = 0; len <= n; len += len < 300 ? 1 : 997)
            assert_true(st_checksum(p, len) == st_xxh3_64(p, len));
    }
    free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_short_length),
        cmocka_unit_test(test_long_lengths),
        cmocka_unit_test(test_structured),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
