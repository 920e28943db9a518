/*
 * st_golden.h - the golden session files and how each one is made. Frozen: a file listed here
 * must be reproduced byte for byte by the writer forever. Add entries, never change one.
 */
#ifndef ST_GOLDEN_H
#define ST_GOLDEN_H

#include "st_file.h"
#include "st_test_image.h"

typedef struct st_golden {
    const char *name;     /* under tests/data/golden/ */
    uint64_t seed;
    uint32_t codecs[3];   /* of the checkpoints at 3, 7, 11 */
    st_file_write_opts opts;
} st_golden;

static const st_golden st_goldens[] = {
    /* v1: every checkpoint fp32, written with the automatic version */
    {"v1_small.stsf", 0x601d000000000001ull, {ST_CODEC_FP32, ST_CODEC_FP32, ST_CODEC_FP32}, {0}},
    /* v2: f16, fp32 and bf16 checkpoints, zstd level 3 with byte-shuffle */
    {"v2_small.stsf", 0x601d000000000002ull, {ST_CODEC_F16, ST_CODEC_FP32, ST_CODEC_BF16},
     {.compress = 3, .shuffle = 1}},
    /* v2 uncompressed: bf16, f16 and fp32 checkpoints */
    {"v2_raw.stsf", 0x601d000000000003ull, {ST_CODEC_BF16, ST_CODEC_F16, ST_CODEC_FP32}, {0}},
};
#define ST_GOLDEN_COUNT (sizeof st_goldens / sizeof st_goldens[0])

#endif
