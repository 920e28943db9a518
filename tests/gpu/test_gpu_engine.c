/*
 * test_gpu_engine.c - the CUDA backend of the engine in one process, against the CPU reference:
 * - logits of a prompt read in several chunks and of teacher-forced decode steps agree with the
 *   CPU's within GPU_TOL (max |logit difference| / max |CPU logit|; docs/ENGINE.md, "CUDA
 *   backend", gives the tolerance and the measured errors, printed by this test), on models
 *   that reach every kernel path: f32, f16 and bf16 weights, f16 and i8 K/V, widths that are not
 *   multiples of the kernels' tiles, a group of 3 query heads per K/V head, and the bench
 *   preset's head widths (DeltaNet 448 x 448, attention 240) with a 2,100-token prompt;
 * - the same inputs and chunks give the same bits (two slots, two engines);
 * - snapshot -> restore on the GPU continues bit for bit (fp32 state; bf16 continues), session
 *   and park images, f16 and i8 K/V, and the restored state hash is the recorded one (the
 *   per-tensor reads and writes are exercised by checkpoints, mounts and st_slot_state_hash);
 * - a state made on the CPU restores on the GPU and the reverse (the state hash, which covers the
 *   K/V rows and the running state rounded to bf16, is verified by each restore; the continued
 *   logits of the two backends agree within GPU_TOL);
 * - a new conversation sharing a system prompt mounts the root checkpoint and gives the bits of
 *   a full read;
 * - a restore under another page size is refused.
 * Runs only under the ctest label `gpu`. Without a usable CUDA device it FAILS, it never skips.
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

#include "engine/engine_test.h"
#include "gpu_test.h"

/* max |GPU logit - CPU logit| over max |CPU logit|, per comparison */
#define GPU_TOL 0.05

static char g_dir[4096];

typedef struct cmp {
    double max_rel, sum_err2, sum_ref2;
    uint32_t top_same, n_cmp;
} cmp;

static double cmp_add(cmp *c, const float *ref, const float *x, uint32_t n)
{
    double mref = 0.0, merr = 0.0;
    uint32_t ar = 0, ax = 0;
    for (uint32_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - (double)ref[i]);
        if (!(d == d))
            fail_msg("logit %u is NaN on one side (cpu %g, gpu %g)", i, ref[i], x[i]);
        if (fabs(ref[i]) > mref)
            mref = fabs(ref[i]);
        if (d > merr)
            merr = d;
        c->sum_err2 += d * d;
        c->sum_ref2 += (double)ref[i] * ref[i];
        if (ref[i] > ref[ar])
            ar = i;
        if (x[i] > x[ax])
            ax = i;
    }
    double rel = merr / (mref > 0 ? mref : 1.0);
    if (rel > c->max_rel)
        c->max_rel = rel;
    c->top_same += ar == ax;
    c->n_cmp++;
    return rel;
}

static st_engine *engine(const st_model *m, const char *backend, uint32_t ubatch,
                         uint32_t prompt_cache, uint32_t root, uint32_t page)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = backend;
    o.ubatch = ubatch;
    o.prompt_cache = prompt_cache;
    o.prompt_cache_root = root;
    if (page)
        o.page_size = page;
    st_engine *e = NULL;
    ST_OK(st_engine_new(m, &o, &e));
    return e;
}

/* ---- models ---------------------------------------------------------------------------------- */
static void tweak_odd(st_model_hparams *hp)
{
    hp->n_embd = 72;
    hp->n_ff = 136;
    hp->n_head = 6;
    hp->n_head_kv = 2;
    hp->head_dim = 24;
    hp->ssm_heads = 3;
    hp->ssm_dk = 20;
    hp->ssm_dv = 24;
    hp->wtype = ST_GGML_F16;
}

static void tweak_odd_i8(st_model_hparams *hp)
{
    tweak_odd(hp);
    hp->kv_dtype = ST_DTYPE_I8;
    hp->wtype = ST_GGML_BF16;
}

static void tweak_wide(st_model_hparams *hp)
{
    /* the bench preset's widths in four layers */
    hp->n_embd = 256;
    hp->n_ff = 768;
    hp->n_head = 8;
    hp->n_head_kv = 2;
    hp->head_dim = 240;
    hp->ssm_heads = 2;
    hp->ssm_dk = 448;
    hp->ssm_dv = 448;
    hp->n_ctx = 4096;
    hp->wtype = ST_GGML_F16;
}

static st_model *load(const char *name, uint64_t seed, void (*tweak)(st_model_hparams *))
{
    char path[4300];
    et_model(path, sizeof path, g_dir, name, seed, tweak);
    st_model *m = NULL;
    ST_OK(st_model_load(path, &m));
    return m;
}

/* ---- GPU logits against the CPU ----------------------------------------------------------- */
static void agree(const char *name, void (*tweak)(st_model_hparams *), uint64_t n_prompt,
                  uint32_t ubatch, uint32_t n_dec)
{
    st_model *m = load(name, 7, tweak);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_engine *ec = engine(m, "cpu", ubatch, 0, 0, 0), *eg = engine(m, "cuda", ubatch, 0, 0, 0);
    st_slot *sc = NULL, *sg = NULL;
    ST_OK(st_slot_new(ec, &sc));
    ST_OK(st_slot_new(eg, &sg));
    uint32_t *t = et_prompt(n_prompt, 3);
    ST_OK(st_slot_eval(sc, t, n_prompt, 0, NULL));
    ST_OK(st_slot_eval(sg, t, n_prompt, 0, NULL));
    cmp c = {0};
    double first = cmp_add(&c, st_slot_logits(sc, NULL), st_slot_logits(sg, NULL), V);
    for (uint32_t i = 0; i < n_dec; i++) {
        uint32_t tok = et_greedy(sc);
        ST_OK(st_slot_decode(sc, tok));
        ST_OK(st_slot_decode(sg, tok));
        cmp_add(&c, st_slot_logits(sc, NULL), st_slot_logits(sg, NULL), V);
    }
    printf("gpu-vs-cpu %-8s prompt %5llu (ubatch %4u) + %2u decodes: max rel %.3e (prompt %.3e), "
           "rms rel %.3e, top-1 same %u/%u\n", name, (unsigned long long)n_prompt, ubatch, n_dec,
           c.max_rel, first, sqrt(c.sum_err2 / c.sum_ref2), c.top_same, c.n_cmp);
    if (c.max_rel > GPU_TOL)
        fail_msg("%s: GPU logits differ from the CPU's by %.3e of the largest (tolerance %.2g)",
                 name, c.max_rel, GPU_TOL);
    free(t);
    st_slot_free(sc);
    st_slot_free(sg);
    st_engine_free(ec);
    st_engine_free(eg);
    st_model_free(m);
}

static void test_agree_tiny(void **state) { agree("tiny", NULL, 300, 64, 16); }
static void test_agree_odd(void **state) { agree("odd", tweak_odd, 300, 64, 16); }
static void test_agree_odd_i8(void **state) { agree("odd-i8", tweak_odd_i8, 300, 48, 16); }
static void test_agree_wide(void **state) { agree("wide", tweak_wide, 2100, 2048, 8); }

/* ---- determinism ---------------------------------------------------------------------------- */
static void test_deterministic(void **state)
{
    st_model *m = load("det", 9, tweak_odd);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_engine *e1 = engine(m, "cuda", 37, 0, 0, 0), *e2 = engine(m, "cuda", 37, 0, 0, 0);
    st_slot *a = NULL, *b = NULL, *c = NULL;
    ST_OK(st_slot_new(e1, &a));
    ST_OK(st_slot_new(e1, &b));
    ST_OK(st_slot_new(e2, &c));
    uint32_t *t = et_prompt(500, 5);
    ST_OK(st_slot_eval(a, t, 500, 0, NULL));
    ST_OK(st_slot_eval(b, t, 500, 0, NULL));
    ST_OK(st_slot_eval(c, t, 500, 0, NULL));
    for (int i = 0; i < 10; i++) {
        assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
        assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(c, NULL), V * 4);
        uint32_t tok = et_greedy(a);
        ST_OK(st_slot_decode(a, tok));
        ST_OK(st_slot_decode(b, tok));
        ST_OK(st_slot_decode(c, tok));
    }
    uint64_t ha, hc;
    ST_OK(st_slot_state_hash(a, ST_CODEC_FP32, &ha));
    ST_OK(st_slot_state_hash(c, ST_CODEC_FP32, &hc));
    assert_true(ha == hc);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
    st_slot_free(c);
    st_engine_free(e1);
    st_engine_free(e2);
    st_model_free(m);
}

/* ---- snapshot and restore on the GPU -------------------------------------------------------- */
static void restore_case(const char *name, void (*tweak)(st_model_hparams *), uint32_t codec,
                         int mode)
{
    st_model *m = load(name, 11, tweak);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_engine *e = engine(m, "cuda", 64, 4, 0, 0);
    st_slot *a = NULL, *b = NULL;
    ST_OK(st_slot_new(e, &a));
    ST_OK(st_slot_new(e, &b));
    uint32_t *t = et_prompt(700, 13);
    /* two reads: the first leaves a resume checkpoint in the chain */
    ST_OK(st_slot_eval(a, t, 400, 0, NULL));
    ST_OK(st_slot_eval(a, t, 700, 0, NULL));
    for (int i = 0; i < 3; i++)
        ST_OK(st_slot_decode(a, et_greedy(a)));
    st_image *img = NULL;
    ST_OK(st_slot_snapshot(a, mode, codec, &img));
    uint64_t ha;
    ST_OK(st_slot_state_hash(a, codec, &ha));
    assert_true(ha == st_image_state_hash(img));
    ST_OK(st_slot_restore(b, img));
    uint64_t hb;
    ST_OK(st_slot_state_hash(b, codec, &hb));
    assert_true(hb == ha);
    assert_int_equal(st_slot_n_tokens(b), st_slot_n_tokens(a));
    assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
    for (int i = 0; i < 12; i++) {
        uint32_t tok = et_greedy(a);
        ST_OK(st_slot_decode(a, tok));
        ST_OK(st_slot_decode(b, tok));
        if (codec == ST_CODEC_FP32)
            assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
    }
    /* a shorter branch reads again (from the checkpoint at 400 when the image carried it) */
    ST_OK(st_slot_eval(b, t, 500, 0, NULL));
    st_image_free(img);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
    st_engine_free(e);
    st_model_free(m);
}

static void test_restore_gpu(void **state)
{
    restore_case("rs-odd", tweak_odd, ST_CODEC_FP32, ST_SNAPSHOT_SESSION);
    restore_case("rs-odd", tweak_odd, ST_CODEC_BF16, ST_SNAPSHOT_PARK);
    restore_case("rs-i8", tweak_odd_i8, ST_CODEC_FP32, ST_SNAPSHOT_PARK);
    restore_case("rs-i8", tweak_odd_i8, ST_CODEC_BF16, ST_SNAPSHOT_SESSION);
}

/* A bit changed in any tensor of a PARK image (every K/V tensor, scales included, and every
 * running tensor, fp32 and bf16 state) is caught by the digests the GPU computes of what
 * arrived: the restore fails with ST_ECORRUPT naming the hash, and the slot keeps its state. */
static void test_restore_corrupt(void **state)
{
    st_model *m = load("rs-bad", 23, tweak_odd_i8);
    st_engine *e = engine(m, "cuda", 64, 0, 0, 0);
    st_slot *a = NULL, *b = NULL;
    ST_OK(st_slot_new(e, &a));
    ST_OK(st_slot_new(e, &b));
    uint32_t *t = et_prompt(300, 29);
    ST_OK(st_slot_eval(a, t, 300, 0, NULL));
    ST_OK(st_slot_eval(b, t, 100, 0, NULL));
    uint64_t hb0;
    ST_OK(st_slot_state_hash(b, ST_CODEC_FP32, &hb0));
    const st_geometry *g = st_slot_geometry(a);
    int hits = 0;
    for (uint32_t codec = 0; codec < 2; codec++) {
        uint32_t cid = codec ? ST_CODEC_BF16 : ST_CODEC_FP32;
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            st_image *img = NULL;
            ST_OK(st_slot_snapshot(a, ST_SNAPSHOT_PARK, cid, &img));
            uint64_t len = 0;
            uint8_t *p = g->tensors[ti].role == ST_ROLE_KV
                             ? st_image_kv(img, ti, &len)
                             : st_image_checkpoint_tensor(img, st_image_n_checkpoints(img) - 1,
                                                          ti, &len);
            if (!p || len <= 8) { /* the position: checked against the checkpoint, not hashed alone */
                st_image_free(img);
                continue;
            }
            p[(ti * 7919 + codec * 131) % len] ^= 0x10;
            int rc = st_slot_restore(b, img);
            if (rc != ST_ECORRUPT || !strstr(st_errdetail(), "hash"))
                fail_msg("tensor %s (%s): restore gave %d (%s), want ST_ECORRUPT",
                         g->tensors[ti].name, st_codec_name(cid), rc, st_errdetail());
            hits++;
            uint64_t hb;
            ST_OK(st_slot_state_hash(b, ST_CODEC_FP32, &hb));
            assert_true(hb == hb0);
            assert_int_equal(st_slot_n_tokens(b), 100);
            st_image_free(img);
        }
    }
    assert_true(hits >= 4);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
    st_engine_free(e);
    st_model_free(m);
}

/* ---- across backends ------------------------------------------------------------------------ */
static void across(st_engine *from, st_engine *to, st_engine *ref, uint32_t codec, uint32_t V)
{
    st_slot *a = NULL, *b = NULL, *r = NULL;
    ST_OK(st_slot_new(from, &a));
    ST_OK(st_slot_new(to, &b));
    ST_OK(st_slot_new(ref, &r));
    uint32_t *t = et_prompt(333, 17);
    ST_OK(st_slot_eval(a, t, 333, 0, NULL));
    st_image *img = NULL;
    ST_OK(st_slot_snapshot(a, ST_SNAPSHOT_SESSION, codec, &img));
    /* the restoring backend verifies the recorded state hash of the other one */
    ST_OK(st_slot_restore(b, img));
    ST_OK(st_slot_restore(r, img));
    uint64_t ha, hb;
    ST_OK(st_slot_state_hash(a, codec, &ha));
    ST_OK(st_slot_state_hash(b, codec, &hb));
    assert_true(ha == hb);
    /* the first continued token comes from the restored logits: the same on both */
    assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
    /* continuing from the same state, the two backends agree within the tolerance */
    cmp c = {0};
    for (int i = 0; i < 10; i++) {
        uint32_t tok = et_greedy(r);
        ST_OK(st_slot_decode(b, tok));
        ST_OK(st_slot_decode(r, tok));
        cmp_add(&c, st_slot_logits(r, NULL), st_slot_logits(b, NULL), V);
    }
    printf("across backends (%s -> %s, %s): continued logits max rel %.3e vs the %s backend\n",
           st_engine_opts_get(from)->backend, st_engine_opts_get(to)->backend,
           st_codec_name(codec), c.max_rel, st_engine_opts_get(ref)->backend);
    assert_true(c.max_rel <= GPU_TOL);
    st_image_free(img);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
    st_slot_free(r);
}

static void test_across_backends(void **state)
{
    st_model *m = load("across", 21, tweak_odd_i8);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_engine *ec = engine(m, "cpu", 64, 4, 0, 0), *eg = engine(m, "cuda", 64, 4, 0, 0);
    across(ec, eg, ec, ST_CODEC_FP32, V);
    across(ec, eg, ec, ST_CODEC_BF16, V);
    across(eg, ec, eg, ST_CODEC_FP32, V);
    across(eg, ec, eg, ST_CODEC_BF16, V);
    st_engine_free(ec);
    st_engine_free(eg);
    st_model_free(m);
}

/* ---- the conversation cache ------------------------------------------------------------------ */
static void test_cache_root(void **state)
{
    st_model *m = load("cache", 23, tweak_odd);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_engine *e = engine(m, "cuda", 32, 6, 64, 0);
    st_slot *a = NULL, *f = NULL;
    ST_OK(st_slot_new(e, &a));
    ST_OK(st_slot_new(e, &f));
    uint32_t *c1 = et_prompt(160, 29), *c2 = et_prompt(160, 31);
    memcpy(c2, c1, 100 * sizeof *c1); /* a 100-token system prompt */
    st_eval_stats es;
    ST_OK(st_slot_eval(a, c1, 160, 100, &es));
    ST_OK(st_slot_eval(a, c2, 160, 100, &es));
    assert_int_equal(es.mounted_at, 100);
    assert_int_equal(es.computed, 60);
    ST_OK(st_slot_eval(f, c2, 160, 100, &es));
    assert_int_equal(es.computed, 160);
    assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(f, NULL), V * 4);
    free(c1);
    free(c2);
    st_slot_free(a);
    st_slot_free(f);
    st_engine_free(e);
    st_model_free(m);
}

static void test_refused(void **state)
{
    st_model *m = load("refuse", 25, NULL);
    st_engine *e = engine(m, "cuda", 64, 4, 0, 0), *e64 = engine(m, "cuda", 64, 4, 0, 64);
    st_slot *a = NULL, *b = NULL;
    ST_OK(st_slot_new(e, &a));
    ST_OK(st_slot_new(e64, &b));
    uint32_t *t = et_prompt(50, 1);
    ST_OK(st_slot_eval(a, t, 50, 0, NULL));
    st_image *img = NULL;
    ST_OK(st_slot_snapshot(a, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img));
    assert_int_equal(st_slot_restore(b, img), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "page_size"));
    assert_int_equal(st_slot_n_tokens(b), 0);
    st_image_free(img);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
    st_engine_free(e);
    st_engine_free(e64);
    st_model_free(m);
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "gpu_engine");
    return 0;
}

static int teardown(void **state)
{
    st_test_rmdir(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agree_tiny),     cmocka_unit_test(test_agree_odd),
        cmocka_unit_test(test_agree_odd_i8),   cmocka_unit_test(test_agree_wide),
        cmocka_unit_test(test_deterministic),  cmocka_unit_test(test_restore_gpu),
        cmocka_unit_test(test_restore_corrupt),
        cmocka_unit_test(test_across_backends), cmocka_unit_test(test_cache_root),
        cmocka_unit_test(test_refused),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
