/*
 * test_corrupt.c - every single-byte change, every truncation and an extension of the golden
 * files, and of the same files naming an architecture (an ARCH section), must end in a typed
 * error: never success, never a crash (CI runs this under ASan+UBSan).
 */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "st_golden.h"
#include "st_file.h"
#include "st_test_util.h"

#define GOLDEN_DIR ST_TEST_DATA "/golden"

static int typed(int rc)
{
    return rc == ST_ECORRUPT || rc == ST_ENOTSTRATA || rc == ST_EVERSION || rc == ST_ECODEC ||
           rc == ST_ETOOBIG;
}

static void expect_refused(const uint8_t *b, size_t len, const char *name, const char *what, size_t at)
{
    st_image *img = NULL;
    int rc = st_file_read_mem(b, len, NULL, &img);
    if (!typed(rc))
        fail_msg("%s, %s at offset %zu: read returned %d (%s), detail: %s", name, what, at, rc,
                 st_strerror(rc), st_errdetail());
    assert_null(img);
}

static unsigned char *load(const char *name, size_t *len)
{
    char path[4096];
    unsigned char *f;
    snprintf(path, sizeof path, "%s/%s", GOLDEN_DIR, name);
    f = st_test_slurp(path, len);
    if (!f)
        fail_msg("golden file %s is missing", path);
    return f;
}

/* File k: the golden files, then the same images naming an architecture (written here). */
#define FILE_COUNT (2 * ST_GOLDEN_COUNT)
static unsigned char *file_k(size_t k, char *name, size_t cap, size_t *len)
{
    const st_golden *gd = &st_goldens[k % ST_GOLDEN_COUNT];
    if (k < ST_GOLDEN_COUNT) {
        snprintf(name, cap, "%s", gd->name);
        return load(gd->name, len);
    }
    st_image *img = NULL, *named = NULL;
    uint8_t *b = NULL;
    assert_int_equal(st_test_image_small(&img, gd->seed, gd->codecs), 0);
    assert_int_equal(st_test_image_named(&named, img, "qwen35moe"), 0);
    assert_int_equal(st_file_write_mem(named, &gd->opts, &b, len), 0);
    st_image_free(img);
    st_image_free(named);
    snprintf(name, cap, "%s named qwen35moe", gd->name);
    return b;
}

static void test_corrupt_mem(void **state)
{
    (void)state;
    for (size_t g = 0; g < FILE_COUNT; g++) {
        char name[96];
        size_t len = 0;
        unsigned char *f = file_k(g, name, sizeof name, &len);
        uint8_t *c = malloc(len + 1);
        st_image *img = NULL;

        /* the intact file reads */
        assert_int_equal(st_file_read_mem(f, len, NULL, &img), 0);
        st_image_free(img);

        for (size_t i = 0; i < len; i++) {
            memcpy(c, f, len);
            c[i] ^= 0xff;
            expect_refused(c, len, name, "byte xor 0xff", i);
            c[i] = (uint8_t)(f[i] + 1);
            expect_refused(c, len, name, "byte + 1", i);
        }
        for (size_t n = 0; n < len; n++)
            expect_refused(f, n, name, "truncation", n);
        memcpy(c, f, len);
        c[len] = 0;
        expect_refused(c, len + 1, name, "extension by a zero byte", len);
        c[len] = 0xa5;
        expect_refused(c, len + 1, name, "extension by 0xa5", len);

        free(c);
        free(f);
    }
}

/* The file reader (its pread path checks section by section, without the memory reader's
 * checksum pre-pass) and inspect on damaged files: every byte flipped, every truncation.
 * Inspect must never call a damaged file all_ok, and shows the sections a truncated file still
 * holds whole. */
static void test_corrupt_file(void **state)
{
    char dir[1024], path[1200];
    (void)state;

    st_test_tmpdir(dir, sizeof dir, "test_corrupt");
    snprintf(path, sizeof path, "%s/c.stsf", dir);
    for (size_t g = 0; g < FILE_COUNT; g++) {
        char name[96];
        size_t len = 0;
        unsigned char *f = file_k(g, name, sizeof name, &len);
        size_t stride = 1;
        uint64_t geometry_end; /* the end of section 0: a truncation after it shows a section */
        memcpy(&geometry_end, f + 64 + 8, 8);
        geometry_end += 64 + 32;
        int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
        assert_true(fd >= 0);
        assert_int_equal(pwrite(fd, f, len, 0), (ssize_t)len);

        for (size_t i = 0; i < len; i += stride) {
            st_image *img = NULL;
            st_file_info info;
            uint8_t v = (uint8_t)(f[i] ^ 0xff);
            int rc;

            assert_int_equal(pwrite(fd, &v, 1, (off_t)i), 1);
            rc = st_file_read(path, NULL, &img);
            if (!typed(rc))
                fail_msg("%s: file read with byte %zu flipped: %d (%s) %s", name, i, rc,
                         st_strerror(rc), st_errdetail());
            rc = st_file_inspect(path, &info);
            if (rc == 0 && info.all_ok)
                fail_msg("%s: inspect calls the file ok with byte %zu flipped", name, i);
            if (rc == 0 && !typed(info.first_error))
                fail_msg("%s: inspect first_error %d with byte %zu flipped", name, info.first_error, i);
            if (rc != 0 && !typed(rc))
                fail_msg("%s: inspect returned %d with byte %zu flipped", name, rc, i);
            st_file_info_free(&info);
            assert_int_equal(pwrite(fd, &f[i], 1, (off_t)i), 1);
        }
        for (size_t n = 0; n < len; n++) {
            st_image *img = NULL;
            st_file_info info;
            assert_int_equal(ftruncate(fd, (off_t)n), 0);
            int rc = st_file_read(path, NULL, &img);
            if (!typed(rc))
                fail_msg("%s: file read truncated at %zu: %d %s", name, n, rc, st_errdetail());
            /* inspect shows what it can of a truncated file, and never calls it ok */
            rc = st_file_inspect(path, &info);
            if ((rc != 0 && !typed(rc)) || info.all_ok || !typed(info.first_error))
                fail_msg("%s: inspect of the file truncated at %zu: %d, all_ok %d, first_error %d",
                         name, n, rc, info.all_ok, info.first_error);
            if (n >= geometry_end && info.n_sections == 0)
                fail_msg("%s: inspect of the file truncated at %zu shows no section", name, n);
            st_file_info_free(&info);
            assert_int_equal(pwrite(fd, f, len, 0), (ssize_t)len);
        }
        close(fd);
        free(f);
    }
    st_test_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_corrupt_mem),
        cmocka_unit_test(test_corrupt_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
