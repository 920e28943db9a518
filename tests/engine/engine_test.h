/*
 * engine_test.h - helpers shared by the engine tests: a tiny model written into a scratch
 * directory, an engine with chosen options, and a token sequence made from text.
 */
#ifndef ENGINE_TEST_H
#define ENGINE_TEST_H

#include <stdio.h>
#include <stdlib.h>
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

/* A prompt of n tokens: BOS, then n - 1 printable bytes of a fixed pseudo-random text (seed).
 * malloc'd; aborts without memory. */
static inline uint32_t *et_prompt(uint64_t n, uint64_t seed)
{
    uint32_t *t = (uint32_t *)malloc(n * sizeof *t);
    if (!t)
        abort();
    t[0] = ST_TOKEN_BOS;
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint64_t i = 1; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t[i] = 32 + (uint32_t)(x % 95);
    }
    return t;
}

/* The greedy token of a slot's logits (st_slot_sample at temperature 0); aborts on an error. */
static inline uint32_t et_greedy(const st_slot *s)
{
    uint32_t t = 0;
    if (st_slot_sample(s, 0.0f, 1, &t)) {
        fprintf(stderr, "et_greedy: %s\n", st_errdetail());
        abort();
    }
    return t;
}

#endif
