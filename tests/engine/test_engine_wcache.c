/*
 * test_engine_wcache.c - the host half of the BF16 -> FP16 weight-conversion cache
 * (engine/st_wcache.c), on any machine: the strict parsing of STRATA_BF16_TC,
 * STRATA_BF16_TC_CACHE and STRATA_BF16_TC_CACHE_MIB, and the arena's bookkeeping (admission
 * until full, no eviction, oversize and full misses bypassed with the resident entries kept,
 * (address, shape) keys, invalidation reusing the space from offset 0, the figures). On a
 * build without CUDA the engine's figures are all 0 and the probe refuses. The device half is
 * tests/gpu/test_gpu_wcache.c (label gpu).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_engine_int.h"

typedef struct pcase {
    const char *tc, *cache, *mib;
    int mode, on;
    uint32_t mib_v;
    const char *diag; /* a word the diagnostic must hold, or NULL: none */
} pcase;

static void test_parse(void **state)
{
    (void)state;
    static const pcase cases[] = {
        {NULL, NULL, NULL, 0, 0, 256, NULL},
        {"", "", NULL, 0, 0, 256, NULL},
        {"0", "0", NULL, 0, 0, 256, NULL},
        {"1", NULL, NULL, 1, 0, 256, NULL},
        {"2", "1", NULL, 2, 1, 256, NULL},
        {"2", "1", "1", 2, 1, 1, NULL},
        {"2", "1", "65536", 2, 1, 65536, NULL},
        {"2", "1", "0512", 2, 1, 512, NULL},
        {"2", "1", "65537", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "0", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "-5", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "+5", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", " 64", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "64 ", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "64M", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "0x40", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "1", "99999999999999999999", 2, 0, 256, "STRATA_BF16_TC_CACHE_MIB"},
        {"2", "yes", NULL, 2, 0, 256, "STRATA_BF16_TC_CACHE="},
        {"2", "true", NULL, 2, 0, 256, "STRATA_BF16_TC_CACHE="},
        {"2", "01", NULL, 2, 0, 256, "STRATA_BF16_TC_CACHE="},
        {"2", "1 ", NULL, 2, 0, 256, "STRATA_BF16_TC_CACHE="},
        {"2", "2", NULL, 2, 0, 256, "STRATA_BF16_TC_CACHE="},
        {"3", "1", NULL, 0, 1, 256, "STRATA_BF16_TC="},
        {"on", NULL, NULL, 0, 0, 256, "STRATA_BF16_TC="},
        {"1x", NULL, NULL, 0, 0, 256, "STRATA_BF16_TC="},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const pcase *k = &cases[i];
        st_wcache_cfg cfg;
        char diag[512];
        st_wcache_parse(k->tc, k->cache, k->mib, &cfg, diag, sizeof diag);
        if (cfg.mode != k->mode || cfg.cache != k->on || (k->on && cfg.mib != k->mib_v))
            fail_msg("case %zu (%s, %s, %s): mode %d cache %d mib %u, expected %d %d %u", i,
                     k->tc ? k->tc : "unset", k->cache ? k->cache : "unset", k->mib ? k->mib : "unset",
                     cfg.mode, cfg.cache, cfg.mib, k->mode, k->on, k->mib_v);
        if (k->diag ? !strstr(diag, k->diag) : diag[0] != 0)
            fail_msg("case %zu: diagnostic \"%s\", expected %s", i, diag, k->diag ? k->diag : "none");
        st_wcache_parse(k->tc, k->cache, k->mib, &cfg, NULL, 0); /* no room for a diagnostic */
    }
    /* a long value is cut in the diagnostic, which stays bounded */
    char big[300];
    memset(big, '9', sizeof big - 1);
    big[sizeof big - 1] = 0;
    char diag[96];
    st_wcache_cfg cfg;
    st_wcache_parse(big, big, big, &cfg, diag, sizeof diag);
    assert_int_equal(cfg.mode, 0);
    assert_int_equal(cfg.cache, 0);
    assert_true(strlen(diag) < sizeof diag);
}

static int dummy[8];

static void test_arena(void **state)
{
    (void)state;
    st_wcache a;
    st_wcache_init(&a, 1000 * ST_WCACHE_ALIGN);
    uint64_t off = 99;
    /* admitted in order, at aligned offsets */
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 10, 20, 400, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 0);
    assert_int_equal(st_wcache_lookup(&a, &dummy[1], 10, 20, 400, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 2 * ST_WCACHE_ALIGN);
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 10, 20, 400, &off), ST_WCACHE_HIT);
    assert_int_equal(off, 0);
    /* one address read as another shape is another entry */
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 20, 10, 400, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 4 * ST_WCACHE_ALIGN);
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 20, 10, 400, &off), ST_WCACHE_HIT);
    assert_int_equal(off, 4 * ST_WCACHE_ALIGN);
    assert_int_equal(a.n, 3);
    /* larger than the arena: bypassed, the entries stay */
    assert_int_equal(st_wcache_lookup(&a, &dummy[2], 1, 1, 1001 * ST_WCACHE_ALIGN, &off), ST_WCACHE_BYPASS);
    assert_int_equal(st_wcache_lookup(&a, &dummy[2], 1, 1, 0, &off), ST_WCACHE_BYPASS);
    /* fill it exactly, then a miss that does not fit what is left is bypassed */
    uint64_t left = a.cap - 6 * ST_WCACHE_ALIGN;
    assert_int_equal(st_wcache_lookup(&a, &dummy[3], 1, 1, left, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 6 * ST_WCACHE_ALIGN);
    assert_int_equal(a.used, a.cap);
    assert_int_equal(st_wcache_lookup(&a, &dummy[4], 1, 1, 1, &off), ST_WCACHE_BYPASS);
    assert_int_equal(st_wcache_lookup(&a, &dummy[4], 1, 1, 1, &off), ST_WCACHE_BYPASS);
    /* the first-admitted entries are still there: no eviction */
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 10, 20, 400, &off), ST_WCACHE_HIT);
    assert_int_equal(st_wcache_lookup(&a, &dummy[1], 10, 20, 400, &off), ST_WCACHE_HIT);
    assert_int_equal(st_wcache_lookup(&a, &dummy[3], 1, 1, left, &off), ST_WCACHE_HIT);
    assert_int_equal(a.n, 4);
    assert_int_equal(a.hits, 5);
    assert_int_equal(a.misses, 8);
    assert_int_equal(a.bypassed, 4);
    /* a taken-back admission frees its space for the next */
    st_wcache_drop_last(&a);
    assert_int_equal(a.used, 4 * ST_WCACHE_ALIGN + 400); /* the end of the third entry */
    assert_int_equal(st_wcache_lookup(&a, &dummy[5], 1, 1, 100, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 6 * ST_WCACHE_ALIGN);
    /* invalidation: every entry dropped, the space reused from 0, the capacity kept */
    uint64_t cap = a.cap;
    st_wcache_invalidate(&a);
    assert_int_equal(a.n, 0);
    assert_int_equal(a.used, 0);
    assert_int_equal(a.cap, cap);
    assert_int_equal(a.invalidations, 1);
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 10, 20, 400, &off), ST_WCACHE_ADMIT);
    assert_int_equal(off, 0);
    /* many entries: the table grows, every one found again at its own offset */
    st_wcache_invalidate(&a);
    static char many[500];
    for (int i = 0; i < 500; i++) {
        assert_int_equal(st_wcache_lookup(&a, &many[i], 1, 1, ST_WCACHE_ALIGN, &off), ST_WCACHE_ADMIT);
        assert_int_equal(off, (uint64_t)i * ST_WCACHE_ALIGN);
    }
    for (int i = 499; i >= 0; i--) {
        assert_int_equal(st_wcache_lookup(&a, &many[i], 1, 1, ST_WCACHE_ALIGN, &off), ST_WCACHE_HIT);
        assert_int_equal(off, (uint64_t)i * ST_WCACHE_ALIGN);
    }
    st_wcache_release(&a);
    /* an arena of 0 bytes admits nothing */
    st_wcache_init(&a, 0);
    assert_int_equal(st_wcache_lookup(&a, &dummy[0], 1, 1, 1, &off), ST_WCACHE_BYPASS);
    st_wcache_release(&a);
}

static void test_engine_figures(void **state)
{
    (void)state;
    /* NULL arguments are refused; the probe refuses without a CUDA engine */
    st_engine_wcache w;
    assert_int_equal(st_engine_wcache_get(NULL, &w), ST_EINVAL);
    assert_int_equal(st_engine_wcache_invalidate(NULL), ST_EINVAL);
    float x = 0, y = 0;
    assert_int_equal(st_cuda_gemm_probe(NULL, NULL, 1, 1, 1, &x, 1, &y), ST_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse),
        cmocka_unit_test(test_arena),
        cmocka_unit_test(test_engine_figures),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
