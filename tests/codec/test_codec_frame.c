/*
 * test_codec_frame.c - lossless framing: round trips for every shuffle width and awkward size,
 * the documented byte layout, and hostile frames (truncated, flipped, oversized, bad window,
 * reserved bits, trailing bytes), each of which must end in a typed error and never a crash.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>

#include <cmocka.h>

#include "st_codec.h"

static uint64_t rng_state = 7;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Float-like data: a slow random walk, so the high bytes repeat and shuffling pays. */
static unsigned char *make_data(size_t len)
{
    unsigned char *p = malloc(len ? len : 1);
    assert_non_null(p);
    float x = 1.0f;
    for (size_t i = 0; i < len; i += 4) {
        x += (float)((int)(rng_next() & 0xff) - 128) * 1e-4f;
        size_t k = len - i < 4 ? len - i : 4;
        memcpy(p + i, &x, k);
    }
    return p;
}

static unsigned char *make_random(size_t len)
{
    unsigned char *p = malloc(len ? len : 1);
    assert_non_null(p);
    for (size_t i = 0; i < len; i++)
        p[i] = (unsigned char)rng_next();
    return p;
}

/* Encode src and return the frame (caller frees). */
static unsigned char *encode(st_frame_ctx *ctx, const void *src, size_t len, unsigned width,
                             int level, size_t *flen)
{
    size_t cap = st_frame_bound(len);
    unsigned char *f = malloc(cap);
    assert_non_null(f);
    int rc = st_frame_encode(ctx, f, cap, src, len, width, level, flen);
    if (rc)
        fail_msg("encode %zu bytes width %u: %s (%s)", len, width, st_strerror(rc),
                 st_errdetail());
    assert_true(*flen <= cap);
    return f;
}

static int decode(st_frame_ctx *ctx, const unsigned char *f, size_t flen, size_t cap,
                  unsigned char **out, size_t *out_len)
{
    *out = malloc(cap ? cap : 1);
    assert_non_null(*out);
    return st_frame_decode(ctx, *out, cap, f, flen, out_len);
}

static void test_round_trips(void **state)
{
    const size_t sizes[] = {0, 1, 3, 7, 8, 4097, ST_FRAME_BLOCK, ST_FRAME_BLOCK + 1,
                            2 * ST_FRAME_BLOCK + 13};
    const unsigned widths[] = {0, 1, 2, 4, 8};
    st_frame_ctx *ctx = st_frame_ctx_new();
    assert_non_null(ctx);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++) {
        unsigned char *src = make_data(sizes[si]);
        for (size_t wi = 0; wi < sizeof widths / sizeof widths[0]; wi++) {
            size_t flen, dlen;
            unsigned char *f = encode(ctx, src, sizes[si], widths[wi], 1, &flen);
            uint64_t declared;
            assert_int_equal(st_frame_decoded_size(f, flen, &declared), 0);
            assert_int_equal(declared, sizes[si]);
            unsigned char *d;
            int rc = decode(ctx, f, flen, sizes[si], &d, &dlen);
            if (rc)
                fail_msg("decode %zu bytes width %u: %s (%s)", sizes[si], widths[wi],
                         st_strerror(rc), st_errdetail());
            assert_int_equal(dlen, sizes[si]);
            if (sizes[si])
                assert_memory_equal(d, src, sizes[si]);
            free(d);
            free(f);
        }
        free(src);
    }
    st_frame_ctx_free(ctx);
}

static void test_levels_and_args(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    unsigned char *src = make_data(100000);
    const int levels[] = {0, 1, 3, 9, 19};
    size_t flen, dlen;
    for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++) {
        unsigned char *f = encode(ctx, src, 100000, 4, levels[i], &flen), *d;
        assert_int_equal(decode(ctx, f, flen, 100000, &d, &dlen), 0);
        assert_memory_equal(d, src, 100000);
        free(f);
        free(d);
    }
    unsigned char buf[1024];
    assert_int_equal(st_frame_encode(ctx, buf, sizeof buf, src, 100, 3, 1, &flen), ST_EINVAL);
    assert_int_equal(st_frame_encode(ctx, buf, sizeof buf, src, 100, 16, 1, &flen), ST_EINVAL);
    assert_int_equal(st_frame_encode(ctx, buf, sizeof buf, src, 100, 4, 20, &flen), ST_EINVAL);
    assert_int_equal(st_frame_encode(ctx, buf, sizeof buf, src, 100, 4, -1, &flen), ST_EINVAL);
    assert_int_equal(st_frame_encode(ctx, buf, 15, src, 100, 4, 1, &flen), ST_ETOOBIG);
    /* Incompressible input does not fit in its own size: ETOOBIG, and the context still works. */
    unsigned char *rnd = make_random(4096);
    assert_int_equal(st_frame_encode(ctx, buf, sizeof buf, rnd, 4096, 0, 1, &flen), ST_ETOOBIG);
    unsigned char *f = encode(ctx, rnd, 4096, 2, 3, &flen), *d;
    assert_int_equal(decode(ctx, f, flen, 4096, &d, &dlen), 0);
    assert_memory_equal(d, rnd, 4096);
    free(f);
    free(d);
    free(rnd);
    free(src);
    st_frame_ctx_free(ctx);
    st_frame_ctx_free(NULL);
}

/* st_frame_bound holds for incompressible input, across block boundaries, with shuffle. */
static void test_bound(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    size_t len = 3 * ST_FRAME_BLOCK + 5, flen;
    unsigned char *src = make_random(len);
    unsigned char *f = encode(ctx, src, len, 8, 19, &flen);
    assert_true(flen <= st_frame_bound(len));
    assert_true(st_frame_bound(0) >= ST_FRAME_HEADER);
    assert_int_equal(st_frame_bound(SIZE_MAX), 0);
    free(f);
    free(src);
    st_frame_ctx_free(ctx);
}

/* The documented layout, checked by hand at every ISA level (the shuffle has vector paths):
 * header bytes, then a plain zstd frame whose content is the input with each 1 MiB block split
 * into planes and the partial element left at the end of the last block. */
static void check_layout(st_frame_ctx *ctx, const unsigned char *src, size_t len, unsigned w)
{
    size_t flen;
    unsigned char *f = encode(ctx, src, len, w, 1, &flen);
    const unsigned char want_hdr[16] = {'S', 'T', 'Z', 1, 1, (unsigned char)w, 0, 0,
                                        (unsigned char)len, (unsigned char)(len >> 8),
                                        (unsigned char)(len >> 16), 0, 0, 0, 0, 0};
    assert_memory_equal(f, want_hdr, 16);

    unsigned char *plain = malloc(len);
    assert_non_null(plain);
    assert_int_equal(ZSTD_getFrameContentSize(f + 16, flen - 16), len);
    size_t zr = ZSTD_decompress(plain, len, f + 16, flen - 16);
    assert_false(ZSTD_isError(zr));
    assert_int_equal(zr, len);
    for (size_t off = 0; off < len; off += ST_FRAME_BLOCK) {
        size_t blen = len - off < ST_FRAME_BLOCK ? len - off : ST_FRAME_BLOCK, nelem = blen / w;
        for (size_t i = 0; i < nelem; i++)
            for (size_t p = 0; p < w; p++)
                if (plain[off + p * nelem + i] != src[off + w * i + p])
                    fail_msg("width %u %s: block at %zu element %zu byte %zu not in its plane", w,
                             st_codec_isa_name(st_codec_isa()), off, i, p);
        assert_memory_equal(plain + off + nelem * w, src + off + nelem * w, blen - nelem * w);
    }
    size_t dlen;
    assert_int_equal(st_frame_decode(ctx, plain, len, f, flen, &dlen), 0);
    assert_memory_equal(plain, src, len);
    free(plain);
    free(f);
}

static void test_layout(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    /* second block: 1000 4-byte elements and 3 bytes; 2000 2-byte elements and 3 bytes; ... */
    const size_t len = ST_FRAME_BLOCK + 4 * 1000 + 3;
    unsigned char *src = make_random(len);
    const unsigned widths[] = {2, 4, 8};
    for (int level = ST_ISA_SCALAR; level <= (int)st_codec_isa_best(); level++) {
        assert_int_equal(st_codec_isa_set((st_codec_isa_level)level), 0);
        for (size_t wi = 0; wi < 3; wi++) {
            check_layout(ctx, src, len, widths[wi]);
            check_layout(ctx, src, 61, widths[wi]); /* shorter than one vector step */
        }
    }
    assert_int_equal(st_codec_isa_set(st_codec_isa_best()), 0);

    /* Without shuffle: flags and width zero, and the zstd content is the input itself. */
    size_t flen;
    unsigned char *f = encode(ctx, src, 1000, 1, 1, &flen);
    assert_int_equal(f[4], 0);
    assert_int_equal(f[5], 0);
    unsigned char back[1000];
    assert_int_equal(ZSTD_decompress(back, sizeof back, f + 16, flen - 16), 1000);
    assert_memory_equal(back, src, 1000);
    free(f);
    free(src);
    st_frame_ctx_free(ctx);
}

static int is_typed_error(int rc)
{
    return rc == ST_ECORRUPT || rc == ST_ETOOBIG || rc == ST_EVERSION;
}

static void test_truncated_everywhere(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    const unsigned widths[] = {0, 4};
    for (size_t wi = 0; wi < 2; wi++) {
        unsigned char *src = make_data(3000);
        size_t flen, dlen;
        unsigned char *f = encode(ctx, src, 3000, widths[wi], 3, &flen);
        unsigned char dst[3000];
        for (size_t cut = 0; cut < flen; cut++) {
            /* A copy of exactly cut bytes, so ASan sees any read past the end. */
            unsigned char *t = malloc(cut ? cut : 1);
            memcpy(t, f, cut);
            int rc = st_frame_decode(ctx, dst, sizeof dst, t, cut, &dlen);
            if (rc != ST_ECORRUPT)
                fail_msg("frame cut at %zu of %zu: rc %d, want ST_ECORRUPT", cut, flen, rc);
            free(t);
        }
        assert_int_equal(st_frame_decode(ctx, dst, sizeof dst, f, flen, &dlen), 0);
        assert_memory_equal(dst, src, 3000);
        free(f);
        free(src);
    }
    st_frame_ctx_free(ctx);
}

static void test_flipped_everywhere(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    const unsigned widths[] = {0, 2};
    for (size_t wi = 0; wi < 2; wi++) {
        unsigned char *src = make_data(2000);
        size_t flen, dlen;
        unsigned char *f = encode(ctx, src, 2000, widths[wi], 3, &flen);
        unsigned char dst[4096];
        size_t accepted = 0;
        for (size_t i = 0; i < flen; i++) {
            for (int bit = 0; bit <= 8; bit++) {
                unsigned mask = bit == 8 ? 0xffu : 1u << bit;
                f[i] ^= (unsigned char)mask;
                int rc = st_frame_decode(ctx, dst, sizeof dst, f, flen, &dlen);
                /* zstd's entropy headers have a few bits that do not change the output; such a
                 * flip may decode, but only to the original bytes (the checksum says so). */
                if (rc == 0 && (dlen != 2000 || memcmp(dst, src, 2000) != 0))
                    fail_msg("byte %zu of %zu xor 0x%02x: decoded to different content", i,
                             flen, mask);
                if (rc == 0 && i < ST_FRAME_HEADER + 7)
                    fail_msg("header byte %zu xor 0x%02x went unnoticed", i, mask);
                accepted += rc == 0;
                if (rc != 0 && !is_typed_error(rc))
                    fail_msg("byte %zu of %zu xor 0x%02x: rc %d (%s), want a typed error", i,
                             flen, mask, rc, st_strerror(rc));
                f[i] ^= (unsigned char)mask;
            }
        }
        print_message("width %u: %zu of %zu flips decoded to the original content\n",
                      widths[wi], accepted, flen * 9);
        assert_true(accepted * 100 < flen * 9); /* a rare exception, not a blind spot */
        assert_int_equal(st_frame_decode(ctx, dst, sizeof dst, f, flen, &dlen), 0);
        assert_memory_equal(dst, src, 2000);
        free(f);
        free(src);
    }
    st_frame_ctx_free(ctx);
}

static void test_hostile_headers(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    unsigned char *src = make_data(5000);
    size_t flen, dlen;
    unsigned char *f = encode(ctx, src, 5000, 4, 3, &flen);
    unsigned char *dst = malloc(8192);
    uint64_t declared;

    /* Declared size beyond the caller's buffer: refused before any output. */
    memset(dst, 0x5a, 8192);
    assert_int_equal(st_frame_decode(ctx, dst, 4999, f, flen, &dlen), ST_ETOOBIG);
    assert_true(strstr(st_errdetail(), "5000") != NULL);
    for (size_t i = 0; i < 8192; i++)
        assert_int_equal(dst[i], 0x5a);

    /* A huge declared size: too big for dst, and never trusted for an allocation. */
    unsigned char save[8];
    memcpy(save, f + 8, 8);
    memset(f + 8, 0xff, 8);
    assert_int_equal(st_frame_decoded_size(f, flen, &declared), 0);
    assert_int_equal(declared, UINT64_MAX);
    assert_int_equal(st_frame_decode(ctx, dst, 8192, f, flen, &dlen), ST_ETOOBIG);
    /* A declared size that fits but disagrees with zstd's content size. */
    f[8] = 0x87, f[9] = 0x13, memset(f + 10, 0, 6); /* 4999 */
    assert_int_equal(st_frame_decode(ctx, dst, 8192, f, flen, &dlen), ST_ECORRUPT);
    memcpy(f + 8, save, 8);

    /* Reserved bits and bytes, one at a time. */
    const struct {
        size_t off;
        unsigned char val;
        int rc;
    } cases[] = {
        {0, 'X', ST_ECORRUPT}, {3, 2, ST_EVERSION},   {3, 0, ST_EVERSION},
        {4, 0x03, ST_ECORRUPT}, {4, 0x80, ST_ECORRUPT}, {4, 0x00, ST_ECORRUPT}, /* width 4, no flag */
        {5, 3, ST_ECORRUPT},   {5, 0, ST_ECORRUPT},    {5, 16, ST_ECORRUPT},
        {6, 1, ST_ECORRUPT},   {7, 0x80, ST_ECORRUPT},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        unsigned char old = f[cases[i].off];
        f[cases[i].off] = cases[i].val;
        int rc = st_frame_decode(ctx, dst, 8192, f, flen, &dlen);
        if (rc != cases[i].rc)
            fail_msg("header byte %zu = 0x%02x: rc %d, want %d", cases[i].off, cases[i].val, rc,
                     cases[i].rc);
        assert_int_equal(st_frame_decoded_size(f, flen, &declared), cases[i].rc);
        f[cases[i].off] = old;
    }

    /* Trailing garbage: one byte, or a whole second frame. */
    unsigned char *g = malloc(2 * flen);
    memcpy(g, f, flen);
    g[flen] = 0;
    assert_int_equal(st_frame_decode(ctx, dst, 8192, g, flen + 1, &dlen), ST_ECORRUPT);
    assert_true(strstr(st_errdetail(), "trailing") != NULL);
    memcpy(g + flen, f + 16, flen - 16);
    assert_int_equal(st_frame_decode(ctx, dst, 8192, g, 2 * flen - 16, &dlen), ST_ECORRUPT);
    free(g);

    /* A valid zstd frame without a content checksum is not one of ours. */
    unsigned char *h = malloc(16 + ZSTD_compressBound(5000));
    memcpy(h, f, 16);
    h[4] = 0, h[5] = 0; /* unshuffled */
    size_t z = ZSTD_compress(h + 16, ZSTD_compressBound(5000), src, 5000, 3);
    assert_false(ZSTD_isError(z));
    assert_int_equal(st_frame_decode(ctx, dst, 8192, h, 16 + z, &dlen), ST_ECORRUPT);
    assert_true(strstr(st_errdetail(), "checksum") != NULL);
    free(h);

    /* The context survives all of this. */
    assert_int_equal(st_frame_decode(ctx, dst, 8192, f, flen, &dlen), 0);
    assert_memory_equal(dst, src, 5000);
    free(dst);
    free(f);
    free(src);
    st_frame_ctx_free(ctx);
}

/* A frame whose zstd window descriptor asks for 2^25 bytes is refused; 2^24 is accepted. */
static void test_window_cap(void **state)
{
    st_frame_ctx *ctx = st_frame_ctx_new();
    const size_t len = 4u << 20;
    unsigned char *src = make_random(len);
    size_t flen, dlen;
    unsigned char *f = encode(ctx, src, len, 0, 1, &flen);
    unsigned char *dst = malloc(len);
    /* Level 1 on 4 MiB uses a 512 KiB window, so the frame is not single-segment and byte 5
     * of the zstd frame is its window descriptor: exponent = windowLog - 10 in bits 7..3. */
    assert_int_equal(f[16 + 4] & 0x20, 0);
    f[16 + 5] = (25 - 10) << 3;
    assert_int_equal(st_frame_decode(ctx, dst, len, f, flen, &dlen), ST_ETOOBIG);
    assert_true(strstr(st_errdetail(), "window") != NULL);
    f[16 + 5] = (ST_FRAME_WINDOWLOG_MAX - 10) << 3;
    assert_int_equal(st_frame_decode(ctx, dst, len, f, flen, &dlen), 0);
    assert_memory_equal(dst, src, len);
    free(dst);
    free(f);
    free(src);
    st_frame_ctx_free(ctx);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_round_trips),        cmocka_unit_test(test_levels_and_args),
        cmocka_unit_test(test_bound),              cmocka_unit_test(test_layout),
        cmocka_unit_test(test_truncated_everywhere), cmocka_unit_test(test_flipped_everywhere),
        cmocka_unit_test(test_hostile_headers),    cmocka_unit_test(test_window_cap),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
