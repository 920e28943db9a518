/*
 * test_codec_checksum.c - st_checksum and the streaming st_checksum_* at every ISA level this
 * CPU has (libxxhash at the scalar level, xxhash.h's AVX2 / AVX-512 code above it) against
 * libxxhash's XXH3_64bits: every length 0..4,200, long buffers around the 1 KiB blocks and the
 * state-hash block (1 MiB), odd start offsets, and streams cut at random points. Negative
 * control: the same buffer with one byte flipped must differ from the reference.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <xxhash.h>

#include "st_codec.h"

static uint64_t rng = 0x2545f4914f6cdd1dull;

static uint64_t next64(void)
{
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return rng;
}

#define BIG ((3u << 20) + 77u)

static uint8_t *random_bytes(size_t n)
{
    uint8_t *p = malloc(n);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(next64() >> 56);
    return p;
}

/* st_checksum of p[0..n) streamed in random cuts. */
static uint64_t streamed(const uint8_t *p, size_t n)
{
    st_checksum_state s = {0};
    size_t at = 0;
    assert_int_equal(st_checksum_init(&s), 0);
    while (at < n) {
        size_t k = (size_t)(next64() % (n < 300000 ? 700 : 300000)) + 1;
        if (k > n - at)
            k = n - at;
        st_checksum_update(&s, p + at, k);
        at += k;
    }
    uint64_t h = st_checksum_final(&s);
    st_checksum_free(&s);
    return h;
}

static void check_level(st_codec_isa_level level, const uint8_t *buf)
{
    static const size_t longs[] = {4201, 65536, 65536 + 1, 1u << 20, (1u << 20) + 63, BIG - 3};
    assert_int_equal(st_codec_isa_set(level), 0);
    for (size_t n = 0; n <= 4200; n++) {
        uint64_t want = (uint64_t)XXH3_64bits(buf + (n % 7), n);
        if (st_checksum(buf + (n % 7), n) != want)
            fail_msg("%s: length %zu differs", st_codec_isa_name(level), n);
        if (n % 97 == 0 && streamed(buf + (n % 7), n) != want)
            fail_msg("%s: length %zu streamed differs", st_codec_isa_name(level), n);
    }
    for (size_t i = 0; i < sizeof longs / sizeof longs[0]; i++) {
        uint64_t want = (uint64_t)XXH3_64bits(buf + 3, longs[i]);
        assert_true(st_checksum(buf + 3, longs[i]) == want);
        assert_true(streamed(buf + 3, longs[i]) == want);
    }
}

static void test_every_level(void **state)
{
    (void)state;
    uint8_t *buf = random_bytes(BIG);
    st_codec_isa_level best = st_codec_isa_best(), was = st_codec_isa();
    for (int l = ST_ISA_SCALAR; l <= (int)best; l++)
        check_level((st_codec_isa_level)l, buf);
    assert_int_equal(st_codec_isa_set(was), 0);
    free(buf);
}

/* Negative control: one flipped byte, at the start, in a middle block and last, differs at every
 * level (the comparison above can fail). */
static void test_flipped_byte_differs(void **state)
{
    (void)state;
    uint8_t *buf = random_bytes(BIG);
    const size_t n = (1u << 20) + 100, at[] = {0, n / 2 + 5, n - 1};
    uint64_t want = (uint64_t)XXH3_64bits(buf, n);
    st_codec_isa_level best = st_codec_isa_best(), was = st_codec_isa();
    for (int l = ST_ISA_SCALAR; l <= (int)best; l++) {
        assert_int_equal(st_codec_isa_set((st_codec_isa_level)l), 0);
        for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
            buf[at[i]] ^= 0x20;
            assert_true(st_checksum(buf, n) != want);
            assert_true(streamed(buf, n) != want);
            buf[at[i]] ^= 0x20;
        }
        assert_true(st_checksum(buf, n) == want);
    }
    assert_int_equal(st_codec_isa_set(was), 0);
    free(buf);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_level),
        cmocka_unit_test(test_flipped_byte_differs),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
