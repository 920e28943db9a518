/*
 * test_golden.c - the golden session files in tests/data/golden/: the writer reproduces each one
 * byte for byte from the same deterministic image, and the reader loads each one into an image
 * equal to the rebuilt one.
 *
 * Regeneration happens only when asked: ST_REGEN_GOLDEN=1 rewrites the golden files and the fuzz
 * seed corpus (tests/fuzz/corpus/file/) before checking them. Never regenerate a golden file of a
 * released format to make this test pass: a difference means the writer changed its output.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_golden.h"
#include "st_file.h"
#include "st_test_image.h"
#include "st_test_util.h"

#define GOLDEN_DIR ST_TEST_DATA "/golden"
#define CORPUS_DIR ST_TEST_DATA "/../fuzz/corpus/file"

static int regen(void)
{
    const char *e = getenv("ST_REGEN_GOLDEN");
    return e && strcmp(e, "1") == 0;
}

static void write_file(const char *dir, const char *name, const void *b, size_t len)
{
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    if (st_file_replace(path, b, len) != 0)
        fail_msg("cannot write %s: %s", path, st_errdetail());
    print_message("ST_REGEN_GOLDEN: wrote %s (%zu bytes)\n", path, len);
}

/* The seed corpus of the fuzz target: the golden files, small variants, and a few inputs that
 * must be refused early. */
static void regen_corpus(void)
{
    st_image *img = NULL;
    uint8_t *b;
    size_t len = 0;

    for (size_t g = 0; g < ST_GOLDEN_COUNT; g++) {
        assert_int_equal(st_test_image_small(&img, st_goldens[g].seed, st_goldens[g].codecs), 0);
        assert_int_equal(st_file_write_mem(img, &st_goldens[g].opts, &b, &len), 0);
        write_file(CORPUS_DIR, st_goldens[g].name, b, len);
        if (g == 0) {
            uint8_t h[64];
            write_file(CORPUS_DIR, "truncated_header", b, 40);
            memcpy(h, b, 64);
            h[8] = 3; /* version 3 */
            write_file(CORPUS_DIR, "version3_header", h, 64);
        }
        free(b);
        st_image_free(img);
    }
    assert_int_equal(st_test_image_minimal(&img, 77), 0);
    assert_int_equal(st_file_write_mem(img, NULL, &b, &len), 0);
    write_file(CORPUS_DIR, "minimal_v1.stsf", b, len);
    free(b);
    st_file_write_opts z = {.compress = 1};
    assert_int_equal(st_file_write_mem(img, &z, &b, &len), 0);
    write_file(CORPUS_DIR, "minimal_v2_zstd.stsf", b, len);
    free(b);
    st_image_free(img);
    write_file(CORPUS_DIR, "not_strata", "GIF89a\x01\x00\x01\x00", 10);
}

static void test_golden(void **state)
{
    (void)state;
    if (regen()) {
        for (size_t g = 0; g < ST_GOLDEN_COUNT; g++) {
            st_image *img = NULL;
            uint8_t *b;
            size_t len = 0;
            assert_int_equal(st_test_image_small(&img, st_goldens[g].seed, st_goldens[g].codecs), 0);
            assert_int_equal(st_file_write_mem(img, &st_goldens[g].opts, &b, &len), 0);
            write_file(GOLDEN_DIR, st_goldens[g].name, b, len);
            free(b);
            st_image_free(img);
        }
        regen_corpus();
    }

    for (size_t g = 0; g < ST_GOLDEN_COUNT; g++) {
        const st_golden *gd = &st_goldens[g];
        char path[4096];
        st_image *img = NULL, *back = NULL;
        uint8_t *b;
        size_t len = 0, flen = 0;
        unsigned char *f;
        st_file_info info;

        snprintf(path, sizeof path, "%s/%s", GOLDEN_DIR, gd->name);
        f = st_test_slurp(path, &flen);
        if (!f)
            fail_msg("golden file %s is missing (ST_REGEN_GOLDEN=1 makes it; see docs/FORMAT.md)",
                     path);
        assert_true(flen < 64 * 1024);

        /* the writer reproduces the file byte for byte */
        assert_int_equal(st_test_image_small(&img, gd->seed, gd->codecs), 0);
        assert_int_equal(st_file_write_mem(img, &gd->opts, &b, &len), 0);
        if (len != flen || memcmp(b, f, len) != 0) {
            size_t i = 0;
            while (i < len && i < flen && b[i] == f[i])
                i++;
            fail_msg("%s: the writer no longer reproduces the golden file (%zu vs %zu bytes, first "
                     "difference at offset %zu)", gd->name, len, flen, i);
        }

        /* so does the file writer (its own path: a 1 MiB buffer, section headers patched in
         * place, checksums of compressed sections read back), through a temp file and rename */
        {
            char out[4200];
            unsigned char *w;
            size_t wlen = 0;
            const char *tmp = getenv("ST_TEST_TMP");
            snprintf(out, sizeof out, "%s/test_golden.%d.stsf", tmp && *tmp ? tmp : "/tmp",
                     (int)getpid());
            assert_int_equal(st_file_write(img, out, &gd->opts), 0);
            w = st_test_slurp(out, &wlen);
            assert_non_null(w);
            unlink(out);
            if (wlen != flen || memcmp(w, f, flen) != 0)
                fail_msg("%s: st_file_write no longer reproduces the golden file (%zu vs %zu bytes)",
                         gd->name, wlen, flen);
            free(w);
        }

        /* the reader loads it into the same image */
        assert_int_equal(st_file_read(path, NULL, &back), 0);
        assert_int_equal(st_test_image_equal(img, back), 0);
        st_image_free(back);
        assert_int_equal(st_file_read_mem(f, flen, NULL, &back), 0);
        assert_int_equal(st_test_image_equal(img, back), 0);
        st_image_free(back);

        /* inspect agrees */
        assert_int_equal(st_file_inspect(path, &info), 0);
        assert_true(info.all_ok);
        assert_int_equal(info.version, f[8]);
        st_file_info_free(&info);

        free(b);
        free(f);
        st_image_free(img);
    }
}

/* The formats the golden files pin down, stated once more as plain facts. */
static void test_golden_facts(void **state)
{
    char path[4096];
    size_t len = 0;
    unsigned char *f;
    (void)state;

    snprintf(path, sizeof path, "%s/v1_small.stsf", GOLDEN_DIR);
    f = st_test_slurp(path, &len);
    assert_non_null(f);
    assert_memory_equal(f, "STRATAsf\x01\x00\x00\x00\x40\x00\x00\x00", 16);
    free(f);
    snprintf(path, sizeof path, "%s/v2_small.stsf", GOLDEN_DIR);
    f = st_test_slurp(path, &len);
    assert_non_null(f);
    assert_memory_equal(f, "STRATAsf\x02\x00\x00\x00\x40\x00\x00\x00", 16);
    free(f);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden),
        cmocka_unit_test(test_golden_facts),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
