/*
 * st_fuzz.h - what every fuzz target shares: the entry point's prototype and the check that
 * aborts (a crash libFuzzer and test_fuzz_replay both report) when a property is violated.
 */
#ifndef ST_FUZZ_H
#define ST_FUZZ_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "st_codec.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define st_fuzz_require(cond, what) st_fuzz_require_at((cond), (what), __FILE__, __LINE__)

static inline void st_fuzz_require_at(int cond, const char *what, const char *file, int line)
{
    if (!cond) {
        fprintf(stderr, "%s:%d: property violated: %s (last error detail: %s)\n", file, line, what,
                st_errdetail());
        abort();
    }
}

/* A refusal: one of the typed errors a decoder may give a hostile input, with a detail. */
static inline int st_fuzz_typed(int rc)
{
    return rc == ST_ECORRUPT || rc == ST_ENOTSTRATA || rc == ST_EVERSION || rc == ST_ECODEC ||
           rc == ST_ETOOBIG || rc == ST_EGEOMETRY || rc == ST_EINVAL || rc == ENOMEM;
}

#endif
