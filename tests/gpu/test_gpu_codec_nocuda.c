/*
 * test_gpu_codec_nocuda.c - in a build without CUDA the GPU codec API still links, and every
 * function says so: st_codec_cuda_available() is 0 and the others return ST_EINVAL with
 * "built without CUDA".
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <cmocka.h>

#include "st_codec.h"

static void test_nocuda(void **state)
{
    char buf[16] = {0};
    assert_int_equal(st_codec_cuda_available(), 0);
    assert_non_null(strstr(st_errdetail(), "built without CUDA"));
    st_error_clear();
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, buf, ST_CODEC_FP32, buf + 8, 1, NULL),
                     ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "built without CUDA"));
    st_error_clear();
    assert_int_equal(st_codec_cuda_sync(NULL), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "built without CUDA"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_nocuda),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
