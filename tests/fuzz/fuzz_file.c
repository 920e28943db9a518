/*
 * fuzz_file.c - libFuzzer target for the session-file reader (st_file_read_mem).
 *
 * Properties checked on every input:
 * 1. A refused input ends in a typed error with a detail, and no image.
 * 2. An accepted input is a complete image (st_image_check); written back as v2 it reads again,
 *    and writing that image again gives the same bytes.
 * 3. An accepted v1 input is canonical: written as v1 it is the input, byte for byte (normal
 *    builds; a fuzzing build ignores checksums, so its inputs need not carry the right ones).
 *
 * Built as a libFuzzer binary with -DSTRATA_FUZZ=ON and clang (make fuzz), where the libraries are
 * compiled with FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION so the fuzzer gets past the checksums;
 * the test test_fuzz_replay runs the seed corpus through the same function in every build.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_file.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void st_fuzz_require(int cond, const char *what)
{
    if (!cond) {
        fprintf(stderr, "fuzz_file: property violated: %s (detail: %s)\n", what, st_errdetail());
        abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_file_read_opts ro = {.max_decoded_bytes = 64u << 20};
    st_file_write_opts w2 = {.version = ST_FILE_VERSION_2};
    st_image *img = NULL, *again = NULL;
    uint8_t *out = NULL, *out2 = NULL;
    size_t n = 0, n2 = 0;
    int rc;

    rc = st_file_read_mem(data, size, &ro, &img);
    if (rc != 0) {
        st_fuzz_require(img == NULL, "an image after an error");
        st_fuzz_require(rc == ST_ECORRUPT || rc == ST_ENOTSTRATA || rc == ST_EVERSION ||
                            rc == ST_ECODEC || rc == ST_ETOOBIG || rc == ENOMEM,
                        "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
        return 0;
    }
    st_fuzz_require(st_image_check(img) == 0, "an accepted image is incomplete");

    st_fuzz_require(st_file_write_mem(img, &w2, &out, &n) == 0, "write v2");
    st_fuzz_require(st_file_read_mem(out, n, &ro, &again) == 0, "read back v2");
    st_fuzz_require(st_file_write_mem(again, &w2, &out2, &n2) == 0, "write v2 again");
    st_fuzz_require(n == n2 && memcmp(out, out2, n) == 0, "v2 round trip changed the bytes");
    free(out2);
    out2 = NULL;

#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
    if (data[8] == ST_FILE_VERSION_1) {
        st_file_write_opts w1 = {.version = ST_FILE_VERSION_1};
        st_fuzz_require(st_file_write_mem(img, &w1, &out2, &n2) == 0, "write v1 from a v1 file");
        st_fuzz_require(n2 == size && memcmp(out2, data, size) == 0, "v1 is not canonical");
    }
#endif

    free(out);
    free(out2);
    st_image_free(img);
    st_image_free(again);
    return 0;
}
