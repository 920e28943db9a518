/*
 * test_format.c - the format module (statestore/st_format.c): one geometry encoding for the
 * session file and the store's geometry record, with one set of validity rules; one set of
 * structural rules, so that the reader and inspect name the same section, offset and rule for
 * every structurally wrong (correctly checksummed) file.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_file.h"
#include "st_format_int.h"
#include "st_golden.h"
#include "st_store.h"
#include "st_test_util.h"

#define GOLDEN_DIR ST_TEST_DATA "/golden"

/* Section checksums and the header checksum recomputed after an edit. */
static void reseal(uint8_t *b, size_t len)
{
    uint64_t off = ST_HDR_LEN;
    uint32_t n = st_get32(b + 20);
    for (uint32_t s = 0; s < n && off + ST_SEC_HDR_LEN <= len; s++) {
        uint64_t l = st_get64(b + off + 8);
        st_checksum_state cs;
        if (off + ST_SEC_HDR_LEN + l > len)
            break;
        assert_int_equal(st_checksum_init(&cs), 0);
        st_checksum_update(&cs, b + off, ST_SEC_HASHED);
        st_checksum_update(&cs, b + off + ST_SEC_HDR_LEN, l);
        st_put64(b + off + 24, st_checksum_final(&cs));
        st_checksum_free(&cs);
        off += ST_SEC_HDR_LEN + l;
    }
    st_put64(b + 56, st_checksum(b, 56));
}

static uint64_t section_off(const uint8_t *b, uint32_t s)
{
    uint64_t off = ST_HDR_LEN;
    for (uint32_t i = 0; i < s; i++)
        off += ST_SEC_HDR_LEN + st_get64(b + off + 8);
    return off;
}

/* A file's GEOMETRY payload is the store's geometry record after its 8 bytes, and both decode
 * to the image's geometry. */
static void test_geometry_one_encoding(void **state)
{
    (void)state;
    for (size_t k = 0; k < ST_GOLDEN_COUNT; k++) {
        char path[1024];
        size_t len = 0, rec_len = 0;
        snprintf(path, sizeof path, "%s/%s", GOLDEN_DIR, st_goldens[k].name);
        uint8_t *f = st_test_slurp(path, &len);
        assert_non_null(f);
        st_image *img = NULL;
        assert_int_equal(st_file_read_mem(f, len, NULL, &img), 0);
        uint8_t *rec = NULL;
        assert_int_equal(st_geometry_encode(st_image_geometry(img), &rec, &rec_len), 0);
        uint64_t glen = st_get64(f + ST_HDR_LEN + 8);
        assert_int_equal(st_get32(f + ST_HDR_LEN), ST_SECTION_GEOMETRY);
        assert_int_equal(rec_len, 8 + glen);
        assert_memory_equal(rec + 8, f + ST_HDR_LEN + ST_SEC_HDR_LEN, glen);
        st_geometry g;
        st_tensor_desc *t = NULL;
        assert_int_equal(st_geometry_decode(rec, rec_len, &g, &t), 0);
        memcpy(g.arch, st_image_geometry(img)->arch, sizeof g.arch);
        assert_int_equal(st_geometry_compare(st_image_geometry(img), &g), 0);
        free(t);
        free(rec);
        st_image_free(img);
        free(f);
    }
}

/* The rule kept: 0..4096 tensors (the session file's). The store's record of a geometry without
 * tensors, which its encoder always wrote, now decodes; a record naming more than its bytes
 * hold does not. */
static void test_geometry_rules(void **state)
{
    st_geometry g = {.page_size = 16, .n_ctx = 64, .n_vocab = 0, .n_tensors = 0, .tensors = NULL};
    st_geometry d;
    st_tensor_desc *t = NULL;
    uint8_t *rec = NULL;
    size_t rec_len = 0;
    (void)state;
    memset(g.model_fp, 0x5a, sizeof g.model_fp);
    assert_int_equal(st_geometry_encode(&g, &rec, &rec_len), 0);
    assert_int_equal(rec_len, ST_GEOM_HDR);
    assert_int_equal(st_geometry_decode(rec, rec_len, &d, &t), 0);
    assert_int_equal(d.n_tensors, 0);
    assert_int_equal(d.n_ctx, 64);
    free(t);
    st_put32(rec + 52, 1); /* one tensor, no bytes for it */
    assert_int_equal(st_geometry_decode(rec, rec_len, &d, &t), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "geometry record: length 48, but 1 tensors need 144"));
    assert_null(t);
    free(rec);
}

/* Reader (memory) and inspect (file) on the same structurally wrong file: the same error code
 * and the same detail, naming the section and its offset. */
static void expect_agree(const char *dir, const uint8_t *b, size_t len, int want, const char *what)
{
    char path[1200], rd[512];
    st_image *img = NULL;
    st_file_info info;
    snprintf(path, sizeof path, "%s/f.stsf", dir);
    FILE *fp = fopen(path, "wb");
    assert_non_null(fp);
    assert_int_equal(fwrite(b, 1, len, fp), len);
    assert_int_equal(fclose(fp), 0);

    int rc = st_file_read_mem(b, len, NULL, &img);
    snprintf(rd, sizeof rd, "%s", st_errdetail());
    if (rc != want || !strstr(rd, what))
        fail_msg("read: %d (%s), want %d with \"%s\"", rc, rd, want, what);
    assert_int_equal(st_file_inspect(path, &info), 0);
    if (info.all_ok || info.first_error != want || strcmp(info.first_error_detail, rd) != 0)
        fail_msg("inspect: all_ok %d, first error %d \"%s\"; the reader said %d \"%s\"", info.all_ok,
                 info.first_error, info.first_error_detail, rc, rd);
    st_file_info_free(&info);
}

static void test_reader_and_inspect_agree(void **state)
{
    char dir[1024];
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_format");
    for (size_t k = 0; k < ST_GOLDEN_COUNT; k++) {
        char path[1024];
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", GOLDEN_DIR, st_goldens[k].name);
        uint8_t *f = st_test_slurp(path, &len);
        assert_non_null(f);
        uint8_t *c = malloc(len);
        uint32_t n = st_get32(f + 20), v = st_get32(f + 8);
        uint64_t last = section_off(f, n - 1), prev = section_off(f, n - 2);
        uint64_t ck1 = section_off(f, n - 3);
        assert_int_equal(st_get32(f + last), ST_SECTION_LOGITS);
        assert_int_equal(st_get32(f + prev), ST_SECTION_CHECKPOINT);
        assert_int_equal(st_get32(f + ck1), ST_SECTION_CHECKPOINT);

        /* LOGITS before the last checkpoint (whole sections swapped: every checksum right) */
        {
            uint64_t pl = last - prev, ll = len - last;
            char want[96];
            memcpy(c, f, prev);
            memcpy(c + prev, f + last, ll);
            memcpy(c + prev + ll, f + prev, pl);
            snprintf(want, sizeof want, "section at offset %llu: found LOGITS where CHECKPOINT[%u] was "
                     "expected", (unsigned long long)prev, st_get32(f + prev + 4));
            expect_agree(dir, c, len, ST_ECORRUPT, want);
        }
        /* a position not after the checkpoint before it */
        memcpy(c, f, len);
        st_put64(c + ck1 + ST_SEC_HDR_LEN, 1);
        reseal(c, len);
        expect_agree(dir, c, len, ST_ECORRUPT, "is not after checkpoint");
        /* a position beyond the tokens */
        memcpy(c, f, len);
        st_put64(c + prev + ST_SEC_HDR_LEN, 1000);
        reseal(c, len);
        expect_agree(dir, c, len, ST_ECORRUPT, "position 1000 exceeds the");
        /* reserved checkpoint fields */
        memcpy(c, f, len);
        st_put32(c + prev + ST_SEC_HDR_LEN + 12, v == ST_FILE_VERSION_1 ? 1 : 0x7);
        reseal(c, len);
        expect_agree(dir, c, len, ST_ECORRUPT, v == ST_FILE_VERSION_1 ? "reserved field is" : "reserved bits set");
        if (v == ST_FILE_VERSION_2) {
            memcpy(c, f, len);
            st_put32(c + prev + ST_SEC_HDR_LEN + 8, 7);
            reseal(c, len);
            expect_agree(dir, c, len, ST_ECODEC, "unknown codec 7");
        }
        free(c);
        free(f);
    }
    st_test_rmdir(dir);
}

/* A session whose geometry has no tensors: put wrote its geometry record and get could not read
 * it back (the store's decoder refused 0 tensors); with the one rule it comes back. */
static void test_store_geometry_without_tensors(void **state)
{
    char dir[1024];
    st_geometry g = {.page_size = 4, .n_ctx = 32, .n_vocab = 0, .n_tensors = 0, .tensors = NULL};
    const uint32_t tokens[3] = {7, 8, 9};
    st_image *img = NULL, *back = NULL;
    st_store *st = NULL;
    st_store_opts o = {.create = 1};
    uint32_t ci;
    (void)state;
    memset(g.model_fp, 0x33, sizeof g.model_fp);
    st_test_tmpdir(dir, sizeof dir, "test_format_store");
    assert_int_equal(st_image_create(&img, &g), 0);
    assert_int_equal(st_image_tokens_set(img, tokens, 3), 0);
    assert_int_equal(st_image_checkpoint_add(img, 3, ST_CODEC_FP32, &ci), 0);
    assert_int_equal(st_store_open(&st, dir, &o), 0);
    assert_int_equal(st_store_put(st, "empty", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
    int rc = st_store_get(st, "empty", 0, &back);
    if (rc)
        fail_msg("get: %d %s", rc, st_errdetail());
    assert_int_equal(st_image_geometry(back)->n_tensors, 0);
    assert_int_equal(st_image_n_tokens(back), 3);
    st_image_free(back);
    st_image_free(img);
    st_store_close(st);
    st_test_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_geometry_one_encoding),
        cmocka_unit_test(test_geometry_rules),
        cmocka_unit_test(test_reader_and_inspect_agree),
        cmocka_unit_test(test_store_geometry_without_tensors),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
