/*
 * test_gpu_wcache.c - the BF16 -> FP16 weight-conversion cache of the CUDA backend on the device
 * (engine/st_backend_cuda.cu invariant 7, engine/st_wcache.c):
 * - off unless asked: no FP16 path and 0 bytes of arena without STRATA_BF16_TC=2 (and with =1
 *   on a card that computes BF16 natively), no arena without the exact STRATA_BF16_TC_CACHE=1;
 * - cached and uncached give the same bits, for prompts read in chunks of several shapes and the
 *   decode steps after them, with the arena large enough for every weight and with one of 1 MiB
 *   that holds only the first-admitted (the rest converted per call, nothing evicted); the FP16
 *   logits agree with the CPU's within GPU_TOL, and differ from the native path's (the control:
 *   the FP16 path is the one that ran);
 * - a mutable buffer is never looked up (its product follows each change), while an immutable
 *   one keeps its first conversion (the control: what the rule prevents);
 * - one address read as two shapes is two entries; an oversize and a full miss are converted per
 *   call while the resident entry stays;
 * - invalidation with freed and reallocated buffers (the same address again) gives the new
 *   bytes' products, and the arena keeps its size; without it the stale entry answers (control);
 * - two engines have arenas of their own.
 * Label gpu: without a CUDA device it FAILS, it never skips.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime.h>

#include "engine/engine_test.h"
#include "gpu_test.h"
#include "st_engine_int.h"

#define GPU_TOL 0.05

static char g_dir[4096];

static void env(const char *tc, const char *cache, const char *mib)
{
    const char *names[] = {"STRATA_BF16_TC", "STRATA_BF16_TC_CACHE", "STRATA_BF16_TC_CACHE_MIB"};
    const char *vals[] = {tc, cache, mib};
    for (int i = 0; i < 3; i++) {
        if (vals[i])
            setenv(names[i], vals[i], 1);
        else
            unsetenv(names[i]);
    }
}

static st_engine *engine(const st_model *m, const char *backend, const char *tc, const char *cache,
                         const char *mib)
{
    env(tc, cache, mib);
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = backend;
    o.ubatch = 64;
    o.prompt_cache = 0;
    st_engine *e = NULL;
    ST_OK(st_engine_new(m, &o, &e));
    env(NULL, NULL, NULL);
    return e;
}

static st_engine_wcache figures(const st_engine *e)
{
    st_engine_wcache w;
    ST_OK(st_engine_wcache_get(e, &w));
    return w;
}

static void tweak_bf16(st_model_hparams *hp) { hp->wtype = ST_GGML_BF16; }

static void tweak_wide(st_model_hparams *hp)
{
    hp->wtype = ST_GGML_BF16;
    hp->n_embd = 1024;
    hp->n_ff = 1024;
    hp->n_head = 8;
    hp->n_head_kv = 2;
    hp->head_dim = 64;
    hp->ssm_heads = 4;
    hp->ssm_dk = 64;
    hp->ssm_dv = 64;
}

static st_model *load(const char *name, void (*tweak)(st_model_hparams *))
{
    char path[4300];
    et_model(path, sizeof path, g_dir, name, 11, tweak);
    st_model *m = NULL;
    ST_OK(st_model_load(path, &m));
    return m;
}

static double rel_diff(const float *ref, const float *x, uint32_t n)
{
    double mref = 0, merr = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (fabs(ref[i]) > mref)
            mref = fabs(ref[i]);
        if (fabs((double)x[i] - ref[i]) > merr)
            merr = fabs((double)x[i] - ref[i]);
    }
    return merr / (mref > 0 ? mref : 1);
}

/* ---- off unless asked ------------------------------------------------------------------------ */
static void test_inactive(void **state)
{
    (void)state;
    st_model *m = load("tiny", tweak_bf16);
    struct {
        const char *tc, *cache, *mib;
        int fp16, cache_on;
    } k[] = {{NULL, NULL, NULL, 0, 0},  {NULL, "1", NULL, 0, 0}, {"0", "1", "64", 0, 0},
             {"2", NULL, NULL, 1, 0},   {"2", "yes", NULL, 1, 0}, {"2", "1", "0", 1, 0},
             {"2", "1", "64k", 1, 0},   {"2", "1", "8", 1, 1},   {"nonsense", "1", NULL, 0, 0}};
    int dev = 0, major = 0;
    CU_OK(cudaGetDevice(&dev));
    CU_OK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev));
    for (size_t i = 0; i < sizeof k / sizeof k[0]; i++) {
        st_engine *e = engine(m, "cuda", k[i].tc, k[i].cache, k[i].mib);
        st_engine_wcache w = figures(e);
        printf("case %zu: fp16 %d cache %d arena %llu device %.1f MiB\n", i, w.fp16, w.cache,
               (unsigned long long)w.arena_bytes, w.device_bytes / 1048576.0);
        assert_int_equal(w.fp16, k[i].fp16);
        assert_int_equal(w.cache, k[i].cache_on);
        assert_int_equal(w.arena_bytes, k[i].cache_on ? 8ull << 20 : 0);
        assert_true(w.device_bytes > 0);
        st_engine_free(e);
    }
    /* =1 keeps the native path where the card computes BF16 (sm_80 and later) */
    st_engine *e = engine(m, "cuda", "1", "1", NULL);
    st_engine_wcache w = figures(e);
    assert_int_equal(w.fp16, major < 8);
    if (major >= 8)
        assert_int_equal(w.arena_bytes, 0);
    st_engine_free(e);
    /* the CPU backend has none */
    e = engine(m, "cpu", "2", "1", NULL);
    w = figures(e);
    assert_int_equal(w.fp16, 0);
    assert_int_equal(w.arena_bytes, 0);
    st_engine_free(e);
    st_model_free(m);
}

/* ---- cached and uncached: the same bits ----------------------------------------------------- */
static void run_same(st_model *m, const char *mib, int expect_bypass)
{
    uint32_t V = st_model_hparams_get(m)->n_vocab, L = st_model_hparams_get(m)->n_layer;
    st_engine *ea = engine(m, "cuda", "2", "1", mib), *eb = engine(m, "cuda", "2", NULL, NULL);
    st_engine *en = engine(m, "cuda", NULL, NULL, NULL), *ec = engine(m, "cpu", NULL, NULL, NULL);
    static const uint64_t lens[] = {1, 5, 64, 65, 200};
    uint32_t native_same = 0, n_cmp = 0;
    double worst = 0;
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        st_slot *sa, *sb, *sn, *sc;
        ST_OK(st_slot_new(ea, &sa));
        ST_OK(st_slot_new(eb, &sb));
        ST_OK(st_slot_new(en, &sn));
        ST_OK(st_slot_new(ec, &sc));
        uint32_t *t = et_prompt(lens[li], li + 1);
        ST_OK(st_slot_eval(sa, t, lens[li], 0, NULL));
        ST_OK(st_slot_eval(sb, t, lens[li], 0, NULL));
        ST_OK(st_slot_eval(sn, t, lens[li], 0, NULL));
        ST_OK(st_slot_eval(sc, t, lens[li], 0, NULL));
        for (int d = 0; d <= 4; d++) {
            const float *la = st_slot_logits(sa, NULL), *lb = st_slot_logits(sb, NULL);
            if (memcmp(la, lb, (size_t)V * 4))
                fail_msg("prompt %llu, step %d: cached and uncached logits differ (rel %.3e)",
                         (unsigned long long)lens[li], d, rel_diff(lb, la, V));
            native_same += !memcmp(la, st_slot_logits(sn, NULL), (size_t)V * 4);
            n_cmp++;
            double r = rel_diff(st_slot_logits(sc, NULL), la, V);
            worst = r > worst ? r : worst;
            uint32_t tok = 32 + (uint32_t)((li * 7 + (size_t)d * 13) % 95);
            ST_OK(st_slot_decode(sa, tok));
            ST_OK(st_slot_decode(sb, tok));
            ST_OK(st_slot_decode(sn, tok));
            ST_OK(st_slot_decode(sc, tok));
        }
        free(t);
        st_slot_free(sa);
        st_slot_free(sb);
        st_slot_free(sn);
        st_slot_free(sc);
    }
    st_engine_wcache w = figures(ea), wb = figures(eb);
    printf("arena %s MiB: %llu entries, %.2f MiB used, %llu hits, %llu misses, %llu bypassed; "
           "fp16 vs cpu max rel %.3e; fp16 == native in %u of %u\n", mib ? mib : "256",
           (unsigned long long)w.entries, w.used_bytes / 1048576.0, (unsigned long long)w.hits,
           (unsigned long long)w.misses, (unsigned long long)w.bypassed, worst, native_same, n_cmp);
    if (worst > GPU_TOL)
        fail_msg("the FP16 path's logits differ from the CPU's by %.3e (tolerance %.2g)", worst, GPU_TOL);
    if (native_same == n_cmp)
        fail_msg("control: the FP16 logits are the native path's bits at every step: the FP16 path did not run");
    assert_true(w.hits > 0);
    assert_int_equal(wb.arena_bytes, 0);
    assert_int_equal(wb.hits + wb.misses, 0);
    if (expect_bypass) {
        assert_true(w.bypassed > 0);
        assert_true(w.entries >= 1 && w.entries < 4ull * L + 1);
        assert_true(w.used_bytes <= w.arena_bytes);
    } else {
        assert_int_equal(w.bypassed, 0);
        assert_int_equal(w.entries, 4ull * L + 1); /* per layer: in, out, ffn in, ffn down; the head */
        assert_int_equal(w.misses, w.entries);
    }
    st_engine_free(ea);
    st_engine_free(eb);
    st_engine_free(en);
    st_engine_free(ec);
}

static void test_same_bits(void **state)
{
    (void)state;
    st_model *m = load("tiny", tweak_bf16);
    run_same(m, NULL, 0);
    st_model_free(m);
}

static void test_same_bits_small_arena(void **state)
{
    (void)state;
    st_model *m = load("wide", tweak_wide); /* 1024 x 1024 weights: 2 MiB each, more than 1 MiB */
    run_same(m, "1", 1);
    run_same(m, "5", 1);
    st_model_free(m);
}

/* ---- the probes: mutable buffers, shapes, oversize, invalidation, owners ---------------------- */
static uint16_t bf16_of(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static void fill(void *dev, uint64_t n, uint64_t seed)
{
    uint16_t *h = malloc(n * 2);
    assert_non_null(h);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 3;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        h[i] = bf16_of(((float)(x % 2001) - 1000.0f) / 4000.0f);
    }
    CU_OK(cudaMemcpy(dev, h, n * 2, cudaMemcpyHostToDevice));
    /* a copy from pageable memory may return before its bytes are in place, and the engines
     * read them on streams of their own */
    CU_OK(cudaDeviceSynchronize());
    free(h);
}

typedef struct probe {
    st_engine *cached, *plain;
    float *x, *y, *yref;
    uint32_t T;
} probe;

static void probe_init(probe *p, st_model *m, const char *mib)
{
    p->cached = engine(m, "cuda", "2", "1", mib);
    p->plain = engine(m, "cuda", "2", NULL, NULL);
    p->T = 3;
    uint32_t E = st_model_hparams_get(m)->n_embd;
    p->x = malloc((size_t)p->T * E * 4);
    p->y = malloc((size_t)p->T * E * 4);
    p->yref = malloc((size_t)p->T * E * 4);
    assert_true(p->x && p->y && p->yref);
    for (uint32_t i = 0; i < p->T * E; i++)
        p->x[i] = (float)((i * 37) % 101) / 50.0f - 1.0f;
}

static void probe_free(probe *p)
{
    st_engine_free(p->cached);
    st_engine_free(p->plain);
    free(p->x);
    free(p->y);
    free(p->yref);
}

/* the cached engine's product (immutable or not) against the uncached one's: 1 if the same bits */
static int same(probe *p, const void *w, uint32_t rows, uint32_t cols, int immutable)
{
    ST_OK(st_cuda_gemm_probe(p->cached, w, rows, cols, immutable, p->x, p->T, p->y));
    ST_OK(st_cuda_gemm_probe(p->plain, w, rows, cols, 0, p->x, p->T, p->yref));
    return !memcmp(p->y, p->yref, (size_t)p->T * rows * 4);
}

static void test_mutation_and_shapes(void **state)
{
    (void)state;
    st_model *m = load("wide", tweak_wide);
    probe p;
    probe_init(&p, m, "64");
    void *w = NULL;
    CU_OK(cudaMalloc(&w, 1024 * 1024 * 2));
    /* a mutable buffer: never looked up, its product follows each change */
    for (int k = 0; k < 4; k++) {
        fill(w, 512 * 512, 100 + (uint64_t)k);
        assert_true(same(&p, w, 512, 512, 0));
    }
    st_engine_wcache f = figures(p.cached);
    assert_int_equal(f.hits + f.misses, 0);
    assert_int_equal(f.entries, 0);
    /* control: the same changes to an immutable one keep the first conversion */
    fill(w, 512 * 512, 200);
    assert_true(same(&p, w, 512, 512, 1));
    fill(w, 512 * 512, 201);
    if (same(&p, w, 512, 512, 1))
        fail_msg("control: an immutable entry followed a change of its bytes (it was not cached)");
    assert_int_equal(figures(p.cached).hits, 1);
    /* one address, two shapes: two entries, each the right product */
    ST_OK(st_engine_wcache_invalidate(p.cached));
    fill(w, 1024 * 256, 300);
    assert_true(same(&p, w, 256, 1024, 1));
    assert_true(same(&p, w, 1024, 256, 1));
    assert_true(same(&p, w, 256, 1024, 1));
    assert_true(same(&p, w, 1024, 256, 1));
    f = figures(p.cached);
    assert_int_equal(f.entries, 2);
    assert_int_equal(f.hits, 2 + 1);
    CU_OK(cudaFree(w));
    probe_free(&p);
    st_model_free(m);
}

static void test_oversize_retained(void **state)
{
    (void)state;
    st_model *m = load("wide", tweak_wide);
    probe p;
    probe_init(&p, m, "1");
    void *wa, *wb, *wc;
    CU_OK(cudaMalloc(&wa, 512 * 512 * 2));
    CU_OK(cudaMalloc(&wb, 1024 * 1024 * 2));
    CU_OK(cudaMalloc(&wc, 700 * 512 * 2));
    fill(wa, 512 * 512, 1);
    fill(wb, 1024 * 1024, 2);
    fill(wc, 700 * 512, 3);
    assert_true(same(&p, wa, 512, 512, 1));  /* admitted: 512 KiB of 1 MiB */
    assert_true(same(&p, wb, 1024, 1024, 1)); /* 2 MiB: larger than the arena */
    assert_true(same(&p, wc, 700, 512, 1));   /* 700 KiB: more than is left */
    assert_true(same(&p, wb, 1024, 1024, 1));
    assert_true(same(&p, wa, 512, 512, 1));   /* still resident */
    st_engine_wcache f = figures(p.cached);
    assert_int_equal(f.entries, 1);
    assert_int_equal(f.bypassed, 3);
    assert_int_equal(f.hits, 1);
    assert_int_equal(f.used_bytes, 512 * 512 * 2);
    CU_OK(cudaFree(wa));
    CU_OK(cudaFree(wb));
    CU_OK(cudaFree(wc));
    probe_free(&p);
    st_model_free(m);
}

static void test_invalidate_reuse(void **state)
{
    (void)state;
    st_model *m = load("wide", tweak_wide);
    probe p;
    probe_init(&p, m, "16");
    uint64_t arena = figures(p.cached).arena_bytes;
    void *prev = NULL;
    int reused = 0;
    for (int i = 0; i < 40; i++) {
        void *w = NULL;
        uint32_t rows = 256 + 64 * (uint32_t)(i % 4);
        CU_OK(cudaMalloc(&w, (size_t)rows * 1024 * 2));
        reused += w == prev;
        fill(w, (uint64_t)rows * 1024, 1000 + (uint64_t)i);
        if (!same(&p, w, rows, 1024, 1))
            fail_msg("round %d: after invalidation the product is not the new bytes' (%s address)",
                     i, w == prev ? "a reused" : "a new");
        assert_true(same(&p, w, rows, 1024, 1)); /* now a hit */
        CU_OK(cudaFree(w));
        ST_OK(st_engine_wcache_invalidate(p.cached));
        st_engine_wcache f = figures(p.cached);
        assert_int_equal(f.entries, 0);
        assert_int_equal(f.used_bytes, 0);
        assert_int_equal(f.arena_bytes, arena); /* the space is kept */
        prev = w;
    }
    printf("invalidate and reuse: %d of 40 allocations came back at the freed address\n", reused);
    st_engine_wcache f = figures(p.cached);
    assert_int_equal(f.invalidations, 40);
    assert_int_equal(f.hits, 40);
    /* control: a reused address without invalidation answers with the stale conversion */
    void *w = NULL;
    CU_OK(cudaMalloc(&w, 256 * 1024 * 2));
    fill(w, 256 * 1024, 1);
    assert_true(same(&p, w, 256, 1024, 1));
    fill(w, 256 * 1024, 2); /* what a free and a reallocation at the same address amount to */
    if (same(&p, w, 256, 1024, 1))
        fail_msg("control: a changed buffer at a cached address gave the new product without invalidation");
    ST_OK(st_engine_wcache_invalidate(p.cached));
    assert_true(same(&p, w, 256, 1024, 1));
    CU_OK(cudaFree(w));
    probe_free(&p);
    st_model_free(m);
}

static void test_owners(void **state)
{
    (void)state;
    st_model *m = load("tiny", tweak_bf16);
    st_engine *a = engine(m, "cuda", "2", "1", "32"), *b = engine(m, "cuda", "2", "1", "32");
    st_slot *sa, *sb;
    ST_OK(st_slot_new(a, &sa));
    ST_OK(st_slot_new(b, &sb));
    uint32_t *t = et_prompt(100, 9);
    ST_OK(st_slot_eval(sa, t, 100, 0, NULL));
    st_engine_wcache fa = figures(a), fb = figures(b);
    assert_true(fa.entries > 0 && fa.hits > 0);
    assert_int_equal(fb.entries, 0);
    assert_int_equal(fb.hits + fb.misses, 0);
    ST_OK(st_slot_eval(sb, t, 100, 0, NULL));
    fb = figures(b);
    assert_int_equal(fb.entries, fa.entries);
    assert_int_equal(memcmp(st_slot_logits(sa, NULL), st_slot_logits(sb, NULL),
                            (size_t)st_model_hparams_get(m)->n_vocab * 4), 0);
    ST_OK(st_engine_wcache_invalidate(a));
    assert_int_equal(figures(a).entries, 0);
    assert_int_equal(figures(b).entries, fa.entries);
    free(t);
    st_slot_free(sa);
    st_slot_free(sb);
    st_engine_free(a);
    st_engine_free(b);
    st_model_free(m);
}

int main(void)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "gpu_wcache");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_inactive),
        cmocka_unit_test(test_same_bits),
        cmocka_unit_test(test_same_bits_small_arena),
        cmocka_unit_test(test_mutation_and_shapes),
        cmocka_unit_test(test_oversize_retained),
        cmocka_unit_test(test_invalidate_reuse),
        cmocka_unit_test(test_owners),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    st_test_rmdir(g_dir);
    return rc;
}
