/*
 * test_gpu_xcache.c - the routed-expert cache's device half (engine/st_xcache_cuda.cu,
 * st_engine_opts.expert_cache_bytes) on the CUDA backend, for qwen35moe (f32 and Q8_0) and
 * qwen3next (Q4_K): a prompt read in chunks of 16 tokens and 8 decode steps give the same
 * logits, bit for bit, and the same state hash with
 * - every expert in VRAM (expert_cache_bytes 0: the reference),
 * - an arena that holds every record (misses only on first use, no eviction),
 * - an arena of k + 2 records, half to an eighth of the experts (evictions: every miss once
 *   it is full, so evictions = misses - slots),
 * - an arena smaller than one token's k records (refused: every call streamed),
 * - STRATA_XCACHE_INJECT=alloc (the arena's allocation refused: every call streamed),
 * - STRATA_XCACHE_INJECT=load:3 (the third upload into the arena fails: that call streamed,
 *   the rest cached);
 * - STRATA_XCACHE_INJECT=slow (a spin on the compute stream each call, so the host's uploads
 *   run ahead of the products and only the fences keep a slot from being rewritten while it is
 *   read), cached and streamed;
 * and the figures add up: hits + misses = calls x k on the cached paths, streamed = calls on
 * the streaming ones, the bytes uploaded per record the same on both. The control: another
 * prompt's logits differ from the reference's under the same comparison. The eviction order
 * itself is the host half's (tests/engine/test_engine_xcache.c). Runs only under the ctest
 * label `gpu`; without a usable CUDA device it FAILS, it never skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/engine_test.h"
#include "st_engine_int.h"
#include "st_wtype.h"
#include "gpu_test.h"

static char g_dir[4096];

#define N_PROMPT 40
#define UBATCH 16
#define N_DEC 8

typedef struct xcase {
    const char *arch, *preset;
    uint32_t wtype;
} xcase;

static const xcase k_cases[] = {
    {"qwen35moe", "tiny", ST_GGML_F32},
    {"qwen35moe", "tiny-q", ST_GGML_Q8_0},
    {"qwen3next", "tiny-q", ST_GGML_Q4_K},
};

static st_model *load_case(const xcase *c)
{
    st_model_hparams hp;
    ST_OK(st_model_preset_arch(c->arch, c->preset, &hp));
    int quant = c->wtype != ST_GGML_F32;
    hp.wtype = ST_GGML_F32;
    char name[160], path[4400], src[4400];
    snprintf(name, sizeof name, "%s-%s-%s", c->arch, c->preset, st_gguf_type_name(c->wtype));
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, name);
    snprintf(src, sizeof src, "%s/%s.f32.gguf", g_dir, name);
    ST_OK(st_model_write_seeded(&hp, 21, name, quant ? src : path));
    if (quant) {
        st_quantize_stats qs;
        ST_OK(st_gguf_quantize(src, path, c->wtype, NULL, &qs));
        assert_true(qs.n_quantized > 0);
    }
    st_model *m = NULL;
    ST_OK(st_model_load(path, &m));
    return m;
}

/* A CUDA engine with an arena of `bytes` (0: every expert in VRAM), STRATA_XCACHE_INJECT as
 * given (NULL: unset) while it is made. */
static st_engine *engine(const st_model *m, uint64_t bytes, const char *inject)
{
    if (inject)
        setenv("STRATA_XCACHE_INJECT", inject, 1);
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = "cuda";
    o.ubatch = UBATCH;
    o.n_ctx = 256;
    o.prompt_cache = 0;
    o.expert_cache_bytes = bytes;
    st_engine *e = NULL;
    int rc = st_engine_new(m, &o, &e);
    unsetenv("STRATA_XCACHE_INJECT");
    ST_OK(rc);
    return e;
}

static uint32_t *prompt(uint64_t n, uint32_t V, uint64_t seed)
{
    uint32_t *t = malloc(n * sizeof *t);
    assert_non_null(t);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t[i] = 1 + (uint32_t)(x % (V - 1));
    }
    return t;
}

typedef struct trace {
    float *logits; /* [N_DEC + 1][V] */
    uint32_t dec[N_DEC];
    uint64_t hash;
    st_engine_xcache xc;
} trace;

/* The prompt (seed), then N_DEC decodes: of dec where given, else greedy (recorded). */
static void run(const st_model *m, st_engine *e, uint64_t seed, const uint32_t *dec, trace *tr)
{
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    tr->logits = malloc((size_t)(N_DEC + 1) * V * sizeof *tr->logits);
    assert_non_null(tr->logits);
    uint32_t *t = prompt(N_PROMPT, V, seed);
    st_slot *s = NULL;
    ST_OK(st_slot_new(e, &s));
    ST_OK(st_slot_eval(s, t, N_PROMPT, 0, NULL));
    memcpy(tr->logits, st_slot_logits(s, NULL), (size_t)V * 4);
    for (int k = 0; k < N_DEC; k++) {
        tr->dec[k] = dec ? dec[k] : et_greedy(s);
        ST_OK(st_slot_decode(s, tr->dec[k]));
        memcpy(tr->logits + (size_t)(k + 1) * V, st_slot_logits(s, NULL), (size_t)V * 4);
    }
    ST_OK(st_slot_state_hash(s, ST_CODEC_FP32, &tr->hash));
    ST_OK(st_engine_xcache_get(e, &tr->xc));
    st_slot_free(s);
    free(t);
}

static void same(const st_model *m, const trace *ref, const trace *x, const char *what)
{
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    for (int k = 0; k <= N_DEC; k++)
        if (memcmp(ref->logits + (size_t)k * V, x->logits + (size_t)k * V, (size_t)V * 4))
            fail_msg("%s: the logits of step %d differ from every expert in VRAM", what, k);
    if (ref->hash != x->hash)
        fail_msg("%s: the state hash differs from every expert in VRAM", what);
}

static void print(const char *what, const st_engine_xcache *x)
{
    printf("  %-22s host %d cached %d slots %3u of %3llu (%6llu B each): hits %5llu misses %5llu "
           "evictions %5llu streamed %4llu failed %llu, %llu B uploaded\n", what, x->host,
           x->cached, x->slots, (unsigned long long)x->records,
           (unsigned long long)x->record_bytes, (unsigned long long)x->hits,
           (unsigned long long)x->misses, (unsigned long long)x->evictions,
           (unsigned long long)x->streamed, (unsigned long long)x->load_failures,
           (unsigned long long)x->bytes_uploaded);
    fflush(stdout);
}

static void test_same_bits(void **state)
{
    (void)state;
    for (size_t ci = 0; ci < sizeof k_cases / sizeof k_cases[0]; ci++) {
        const xcase *c = &k_cases[ci];
        st_model *m = load_case(c);
        const st_model_hparams *hp = st_model_hparams_get(m);
        uint64_t k = hp->n_expert_used, calls = (uint64_t)(N_PROMPT + N_DEC) * hp->n_layer;
        printf("%s %s %s: %u layers of %u experts, top %llu, %llu calls\n", c->arch, c->preset,
               st_gguf_type_name(c->wtype), hp->n_layer, hp->n_expert, (unsigned long long)k,
               (unsigned long long)calls);

        trace ref, all, lru, str, alloc, load, slow, slow_str, other;
        st_engine *e = engine(m, 0, NULL);
        run(m, e, 3, NULL, &ref);
        st_engine_free(e);
        print("every expert in VRAM", &ref.xc);
        assert_int_equal(ref.xc.host, 0);
        assert_true(ref.xc.hits == 0 && ref.xc.bytes_uploaded == 0);

        e = engine(m, 1ull << 30, NULL); /* room for every record */
        run(m, e, 3, ref.dec, &all);
        st_engine_free(e);
        print("arena of every record", &all.xc);
        same(m, &ref, &all, "an arena of every record");
        assert_true(all.xc.host && all.xc.cached);
        assert_int_equal(all.xc.records, (uint64_t)hp->n_layer * hp->n_expert);
        assert_int_equal(all.xc.slots, all.xc.records);
        assert_int_equal(all.xc.hits + all.xc.misses, calls * k);
        assert_true(all.xc.misses <= all.xc.records);
        assert_int_equal(all.xc.evictions, 0);
        assert_int_equal(all.xc.streamed, 0);
        uint64_t rec = all.xc.record_bytes;
        assert_true(rec > 0 && rec % 256 == 0);

        e = engine(m, (k + 2) * rec, NULL);
        run(m, e, 3, ref.dec, &lru);
        st_engine_free(e);
        print("arena of k + 2 records", &lru.xc);
        same(m, &ref, &lru, "an arena of k + 2 records");
        assert_true(lru.xc.cached);
        assert_int_equal(lru.xc.slots, k + 2);
        assert_true(lru.xc.slots * 2 <= lru.xc.records); /* far fewer than the experts */
        assert_int_equal(lru.xc.hits + lru.xc.misses, calls * k);
        assert_true(lru.xc.evictions > 0);
        assert_int_equal(lru.xc.evictions, lru.xc.misses - lru.xc.slots);
        assert_int_equal(lru.xc.streamed, 0);
        assert_int_equal(lru.xc.load_failures, 0);

        e = engine(m, rec, NULL); /* one record: fewer than k, so streamed */
        run(m, e, 3, ref.dec, &str);
        st_engine_free(e);
        print("arena below k records", &str.xc);
        same(m, &ref, &str, "the streaming path");
        assert_true(str.xc.host && !str.xc.cached);
        assert_int_equal(str.xc.slots, 0);
        assert_int_equal(str.xc.streamed, calls);
        assert_int_equal(str.xc.hits + str.xc.misses, 0);
        /* the bytes of a record's parts, the same whichever path uploads it */
        assert_int_equal(str.xc.bytes_uploaded % (calls * k), 0);
        uint64_t per = str.xc.bytes_uploaded / (calls * k);
        assert_true(per > 0 && per <= rec);
        assert_int_equal(lru.xc.bytes_uploaded, lru.xc.misses * per);
        assert_int_equal(all.xc.bytes_uploaded, all.xc.misses * per);

        e = engine(m, (k + 2) * rec, "alloc");
        run(m, e, 3, ref.dec, &alloc);
        st_engine_free(e);
        print("injected: no arena", &alloc.xc);
        same(m, &ref, &alloc, "STRATA_XCACHE_INJECT=alloc");
        assert_true(alloc.xc.host && !alloc.xc.cached);
        assert_int_equal(alloc.xc.streamed, calls);

        e = engine(m, (k + 2) * rec, "load:3");
        run(m, e, 3, ref.dec, &load);
        st_engine_free(e);
        print("injected: load 3 fails", &load.xc);
        same(m, &ref, &load, "STRATA_XCACHE_INJECT=load:3");
        assert_true(load.xc.cached);
        assert_int_equal(load.xc.load_failures, 1);
        assert_int_equal(load.xc.streamed, 1);
        assert_int_equal(load.xc.hits + load.xc.misses, calls * k);

        /* the products lag the host's calls (a spin on the compute stream each call): the
         * slots and the compact buffer are rewritten only behind their fences */
        e = engine(m, (k + 2) * rec, "slow");
        run(m, e, 3, ref.dec, &slow);
        st_engine_free(e);
        print("injected: slow, k + 2", &slow.xc);
        same(m, &ref, &slow, "STRATA_XCACHE_INJECT=slow, k + 2 records");
        assert_true(slow.xc.cached && slow.xc.evictions == lru.xc.evictions);
        e = engine(m, rec, "slow");
        run(m, e, 3, ref.dec, &slow_str);
        st_engine_free(e);
        print("injected: slow, streamed", &slow_str.xc);
        same(m, &ref, &slow_str, "STRATA_XCACHE_INJECT=slow, streamed");
        assert_int_equal(slow_str.xc.streamed, calls);

        /* the control: the comparison tells another conversation apart */
        e = engine(m, (k + 2) * rec, NULL);
        run(m, e, 4, ref.dec, &other);
        st_engine_free(e);
        uint32_t V = hp->n_vocab;
        assert_true(memcmp(ref.logits, other.logits, (size_t)V * 4) != 0);
        assert_true(ref.hash != other.hash);

        trace *all_t[] = {&ref, &all, &lru, &str, &alloc, &load, &slow, &slow_str, &other};
        for (size_t i = 0; i < sizeof all_t / sizeof all_t[0]; i++)
            free(all_t[i]->logits);
        st_model_free(m);
    }
}

/* The option is ignored where it means nothing: a model without experts. */
static void test_dense(void **state)
{
    (void)state;
    st_model_hparams hp;
    ST_OK(st_model_preset_arch("qwen35", "tiny", &hp));
    char path[4400];
    snprintf(path, sizeof path, "%s/dense.gguf", g_dir);
    ST_OK(st_model_write_seeded(&hp, 5, "dense", path));
    st_model *m = NULL;
    ST_OK(st_model_load(path, &m));
    st_engine *a = engine(m, 0, NULL), *b = engine(m, 64ull << 20, NULL);
    trace ta, tb;
    run(m, a, 3, NULL, &ta);
    run(m, b, 3, ta.dec, &tb);
    same(m, &ta, &tb, "a dense model with --expert-cache-mib");
    assert_int_equal(tb.xc.host, 0);
    free(ta.logits);
    free(tb.logits);
    st_engine_free(a);
    st_engine_free(b);
    st_model_free(m);
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(g_dir, sizeof g_dir, "gpu_xcache");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_same_bits),
        cmocka_unit_test(test_dense),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
