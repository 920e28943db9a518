/*
 * engine_test.h - helpers shared by the engine tests: a tiny model written into a scratch
 * directory, an engine with chosen options, and a token sequence made from text.
 */
#ifndef ENGINE_TEST_H
#define ENGINE_TEST_H

#include <stdio.h>
#include <string.h>

#include "st_engine.h"
#include "st_test_util.h"

/* Write the tiny preset (with seed, possibly tweaked by fn) to dir/name; path in dst. */
static inline void et_model(char *dst, size_t cap, const char *dir, const char *name,
                            uint64_t seed, void (*tweak)(st_model_hparams *))
{
    st_model_hparams hp;
    if (st_model_preset("tiny", &hp))
        abort();
    if (tweak)
        tweak(&hp);
    snprintf(dst, cap, "%s/%s", dir, name);
    int rc = st_model_write_seeded(&hp, seed, name, dst);
    if (rc) {
        fprintf(stderr, "et_model: %s: %s\n", st_strerror(rc), st_errdetail());
        abort();
    }
}

/* BOS + the bytes of text. Returns the count. */
static inline uint64_t et_tokens(uint32_t *dst, const char *text)
{
    size_t n = strlen(text);
    dst[0] = ST_TOKEN_BOS;
    st_tokenize(text, n, dst + 1, n);
    return n + 1;
}

#endif
