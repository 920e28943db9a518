/*
 * test_codec_misc.c - codec ids, the error space and its detail string, the error figures of a
 * lossy round trip, and XXH3 checksums (streaming equals one-shot).
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_codec.h"

static void test_codec_ids(void **state)
{
    assert_int_equal(st_codec_check(ST_CODEC_FP32), 0);
    assert_int_equal(st_codec_check(ST_CODEC_BF16), 0);
    assert_int_equal(st_codec_check(ST_CODEC_F16), 0);
    assert_int_equal(st_codec_check(3), ST_ECODEC);
    assert_true(strstr(st_errdetail(), "3") != NULL);
    assert_int_equal(st_codec_check(UINT32_MAX), ST_ECODEC);
    assert_int_equal(st_codec_elem_size(ST_CODEC_FP32), 4);
    assert_int_equal(st_codec_elem_size(ST_CODEC_BF16), 2);
    assert_int_equal(st_codec_elem_size(ST_CODEC_F16), 2);
    assert_int_equal(st_codec_elem_size(3), 0);
    assert_string_equal(st_codec_name(ST_CODEC_FP32), "fp32");
    assert_string_equal(st_codec_name(ST_CODEC_BF16), "bf16");
    assert_string_equal(st_codec_name(ST_CODEC_F16), "f16");
    assert_string_equal(st_codec_name(77), "unknown");
    st_codec_id id = ST_CODEC_FP32;
    assert_int_equal(st_codec_parse("bf16", &id), 0);
    assert_int_equal(id, ST_CODEC_BF16);
    assert_int_equal(st_codec_parse("F16", &id), 0);
    assert_int_equal(id, ST_CODEC_F16);
    assert_int_equal(st_codec_parse("fp32", &id), 0);
    assert_int_equal(id, ST_CODEC_FP32);
    assert_int_equal(st_codec_parse("fp8", &id), ST_ECODEC);
    assert_true(strstr(st_errdetail(), "fp8") != NULL);
    assert_int_equal(st_codec_parse("", &id), ST_ECODEC);
    assert_int_equal(st_codec_parse(NULL, &id), ST_ECODEC);
    assert_int_equal(id, ST_CODEC_FP32); /* untouched on failure */
}

static void test_errors(void **state)
{
    assert_string_equal(st_strerror(0), "success");
    assert_string_equal(st_strerror(ST_ECORRUPT), "corrupt data");
    assert_string_equal(st_strerror(ST_EIO), "input/output error");
    for (int rc = ST_ELAST; rc <= ST_EFIRST; rc++)
        assert_string_not_equal(st_strerror(rc), "unknown error");
    assert_string_equal(st_strerror(ST_ELAST - 1), "unknown error");
    assert_string_equal(st_strerror(-1), "unknown error");
    assert_string_equal(st_strerror(ENOENT), strerror(ENOENT));

    st_error_clear();
    assert_string_equal(st_errdetail(), "");
    assert_int_equal(st_error_set(ST_ECORRUPT, "section %s at %d", "KV", 42), ST_ECORRUPT);
    assert_string_equal(st_errdetail(), "section KV at 42");
    char longer[1000];
    memset(longer, 'x', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    st_error_set(ST_EINVAL, "%s", longer);
    assert_int_equal(strlen(st_errdetail()), 511);
    /* wrapping a lower layer's detail in place */
    st_error_set(ST_ECORRUPT, "checksum mismatch at %d", 1004);
    st_error_set(ST_ECORRUPT, "%s: %s", "f.stsf", st_errdetail());
    assert_string_equal(st_errdetail(), "f.stsf: checksum mismatch at 1004");
    st_error_set(ST_EINVAL, "%s", longer);
    st_error_set(ST_EINVAL, "x%s", st_errdetail());
    assert_int_equal(strlen(st_errdetail()), 511);
    assert_int_equal(st_errdetail()[0], 'x');
    st_error_clear();
    assert_string_equal(st_errdetail(), "");
}

static void test_errstat(void **state)
{
    const float a[] = {1.0f, -2.0f, 4.0f, 0.0f, 5.0f, INFINITY, NAN, 1e-3f, 3.0f, -0.0f};
    const float b[] = {1.0f, 2.0f, 3.0f, 0.0f, 0.0f, INFINITY, NAN, 1e-3f, INFINITY, 0.0f};
    st_codec_errstat st;
    memset(&st, 0, sizeof st);
    st_codec_errstat_add(&st, a, b, 5);
    st_codec_errstat_add(&st, a + 5, b + 5, 5); /* slice by slice */
    assert_int_equal(st.n, 10);
    /* finite pairs: |1-1| 0, |-2-2| 4, |4-3| 1, 0, |5-0| 5, 0, 0(-0 vs 0) */
    assert_true(st.max_abs == 5.0);
    assert_true(st.max_rel == 2.0); /* |-2 - 2| / 2 */
    assert_int_equal(st.sign_changes, 1);
    assert_int_equal(st.new_zeros, 1);
    assert_int_equal(st.new_nonfinite, 1);
    assert_int_equal(st.differ, 5); /* -2, 4, 5, 3, -0 */

    /* Identical arrays: all zero but n. */
    memset(&st, 0, sizeof st);
    st_codec_errstat_add(&st, a, a, 10);
    assert_int_equal(st.n, 10);
    assert_true(st.max_abs == 0.0 && st.max_rel == 0.0);
    assert_int_equal(st.sign_changes + st.new_zeros + st.new_nonfinite + st.differ, 0);
}

static void test_checksum(void **state)
{
    enum { N = 100000 };
    unsigned char *p = malloc(N);
    assert_non_null(p);
    for (size_t i = 0; i < N; i++)
        p[i] = (unsigned char)(i * 2654435761u >> 13);
    uint64_t want = st_checksum(p, N);
    assert_true(want != st_checksum(p, N - 1));
    const size_t steps[] = {1, 7, 64, 1000, 65536, N};
    for (size_t s = 0; s < sizeof steps / sizeof steps[0]; s++) {
        st_checksum_state cs;
        memset(&cs, 0, sizeof cs);
        assert_int_equal(st_checksum_init(&cs), 0);
        for (size_t off = 0; off < N; off += steps[s])
            st_checksum_update(&cs, p + off, N - off < steps[s] ? N - off : steps[s]);
        assert_true(st_checksum_final(&cs) == want);
        st_checksum_free(&cs);
        st_checksum_free(&cs); /* idempotent */
    }
    st_checksum_state empty;
    memset(&empty, 0, sizeof empty);
    assert_int_equal(st_checksum_init(&empty), 0);
    assert_true(st_checksum_final(&empty) == st_checksum("", 0));
    assert_true(st_checksum("", 0) == 0x2d06800538d394c2ull); /* XXH3-64 of nothing, seed 0 */
    st_checksum_free(&empty);
    memset(&empty, 0, sizeof empty);
    st_checksum_free(&empty); /* a zeroed state */
    free(p);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_codec_ids),
        cmocka_unit_test(test_errors),
        cmocka_unit_test(test_errstat),
        cmocka_unit_test(test_checksum),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
