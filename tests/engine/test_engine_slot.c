/*
 * test_engine_slot.c - slots: snapshot / restore identity (fp32 exact, bf16 completes), restores
 * that must fail leave the slot exactly as it was, the conversation cache (root checkpoint,
 * periodic checkpoints, prefix reuse identical to a full read), park images; a K/V-only model
 * (llama, qwen3) cut at any position; a compressed bf16 session file restores to the slot the
 * uncompressed one restores to; a restore that takes the image's blocks (st_slot_restore_adopt).
 */
#include <math.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine_test.h"
#include "st_file.h"
#include "st_engine_int.h"
#include "st_migrate.h"

static char g_dir[4096];
static char g_model[4200], g_other[4200], g_big[4200];

typedef struct rig {
    st_model *m;
    st_engine *e;
    st_slot *s;
} rig;

static void rig_open(rig *r, const char *model, const st_engine_opts *o)
{
    memset(r, 0, sizeof *r);
    assert_int_equal(st_model_load(model, &r->m), 0);
    int rc = st_engine_new(r->m, o, &r->e);
    if (rc)
        fail_msg("engine: %s", st_errdetail());
    assert_int_equal(st_slot_new(r->e, &r->s), 0);
}

static void rig_close(rig *r)
{
    st_slot_free(r->s);
    st_engine_free(r->e);
    st_model_free(r->m);
}

static st_engine_opts opts(uint32_t threads)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = threads;
    return o;
}

/* Generate n greedy tokens (fed back), into out. */
static void gen(st_slot *s, uint32_t n, uint32_t *out, float temp)
{
    for (uint32_t i = 0; i < n; i++) {
        uint32_t t;
        assert_int_equal(st_slot_sample(s, temp, 42, &t), 0);
        out[i] = t;
        assert_int_equal(st_slot_decode(s, t), 0);
    }
}

static void test_restore_identity(void **state)
{
    const uint32_t N = 24, K = 9;
    uint32_t toks[256], a[64], b[64];
    uint64_t n = et_tokens(toks, "Restore me, token for token.");
    st_engine_opts o = opts(2);
    for (int codec = 0; codec < 2; codec++) {
        rig r1, r2, r3;
        rig_open(&r1, g_model, &o);
        assert_int_equal(st_slot_eval(r1.s, toks, n, 0, NULL), 0);
        gen(r1.s, N, a, 0.7f);
        uint32_t nl;
        float *final = malloc(ST_VOCAB_BYTES * sizeof *final);
        memcpy(final, st_slot_logits(r1.s, &nl), ST_VOCAB_BYTES * sizeof *final);

        rig_open(&r2, g_model, &o);
        assert_int_equal(st_slot_eval(r2.s, toks, n, 0, NULL), 0);
        gen(r2.s, K, b, 0.7f);
        st_image *img = NULL;
        uint32_t c = codec ? ST_CODEC_BF16 : ST_CODEC_FP32;
        assert_int_equal(st_slot_snapshot(r2.s, ST_SNAPSHOT_SESSION, c, &img), 0);
        uint8_t *file = NULL;
        size_t flen = 0;
        assert_int_equal(st_file_write_mem(img, NULL, &file, &flen), 0);
        st_image_free(img);
        img = NULL;
        rig_close(&r2);

        rig_open(&r3, g_model, &o);
        assert_int_equal(st_file_read_mem(file, flen, NULL, &img), 0);
        int rc = st_slot_restore(r3.s, img);
        if (rc)
            fail_msg("restore (%s): %s", codec ? "bf16" : "fp32", st_errdetail());
        st_image_free(img);
        free(file);
        assert_int_equal(st_slot_n_tokens(r3.s), n + K);
        gen(r3.s, N - K, b + K, 0.7f);
        if (!codec) {
            assert_memory_equal(a, b, N * sizeof *a);
            assert_memory_equal(final, st_slot_logits(r3.s, &nl), ST_VOCAB_BYTES * sizeof *final);
        } else {
            /* the first K tokens came before the save */
            assert_memory_equal(a, b, K * sizeof *a);
            const float *l = st_slot_logits(r3.s, &nl);
            for (uint32_t i = 0; i < nl; i++)
                assert_true(isfinite(l[i]));
        }
        free(final);
        rig_close(&r1);
        rig_close(&r3);
    }
}

/* Everything observable about a slot, to check that a failed restore changed nothing. */
typedef struct obs {
    uint64_t n, hash;
    uint32_t n_ck;
    float logits[ST_VOCAB_BYTES];
} obs;

static void observe(st_slot *s, obs *o)
{
    uint32_t nl;
    o->n = st_slot_n_tokens(s);
    o->n_ck = st_slot_n_checkpoints(s);
    assert_int_equal(st_slot_state_hash(s, ST_CODEC_FP32, &o->hash), 0);
    memcpy(o->logits, st_slot_logits(s, &nl), sizeof o->logits);
}

static void same(st_slot *s, const obs *o)
{
    obs now;
    observe(s, &now);
    assert_int_equal(now.n, o->n);
    assert_int_equal(now.n_ck, o->n_ck);
    assert_int_equal(now.hash, o->hash);
    assert_memory_equal(now.logits, o->logits, sizeof o->logits);
}

static void test_failed_restore_leaves_slot(void **state)
{
    uint32_t toks[256], t1[16], t2[16];
    uint64_t n = et_tokens(toks, "a conversation that must survive bad restores");
    st_engine_opts o = opts(1);
    rig r, donor, ref;
    rig_open(&r, g_model, &o);
    rig_open(&donor, g_model, &o);
    rig_open(&ref, g_model, &o);
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    assert_int_equal(st_slot_eval(ref.s, toks, n, 0, NULL), 0);
    uint32_t other[256];
    uint64_t on = et_tokens(other, "another conversation entirely");
    assert_int_equal(st_slot_eval(donor.s, other, on, 0, NULL), 0);
    obs before;
    observe(r.s, &before);

    st_image *img = NULL;
    /* 1. a wrong state hash */
    assert_int_equal(st_slot_snapshot(donor.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img), 0);
    st_image_state_hash_set(img, st_image_state_hash(img) ^ 1);
    assert_int_equal(st_slot_restore(r.s, img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "state hash"));
    same(r.s, &before);
    /* 2. K/V never written: zeros cannot pass for the conversation */
    st_image_state_hash_set(img, st_image_state_hash(img) ^ 1);
    const st_geometry *g = st_image_geometry(img);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++)
        if (g->tensors[ti].role == ST_ROLE_KV) {
            uint64_t len = 0;
            void *kv = st_image_kv(img, ti, &len);
            memset(kv, 0, len);
        }
    assert_int_equal(st_slot_restore(r.s, img), ST_ECORRUPT);
    same(r.s, &before);
    /* 3. running state zeroed */
    st_image_free(img);
    assert_int_equal(st_slot_snapshot(donor.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img), 0);
    uint32_t last = st_image_n_checkpoints(img) - 1;
    g = st_image_geometry(img);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++)
        if (st_image_geometry(img)->tensors[ti].role == ST_ROLE_RUNNING &&
            st_image_geometry(img)->tensors[ti].dtype == ST_DTYPE_F32) {
            uint64_t len = 0;
            void *t = st_image_checkpoint_tensor(img, last, ti, &len);
            memset(t, 0, len);
        }
    assert_int_equal(st_slot_restore(r.s, img), ST_ECORRUPT);
    same(r.s, &before);
    st_image_free(img);
    img = NULL;
    /* 4. another geometry: page size */
    st_engine_opts o64 = o;
    o64.page_size = 64;
    rig p64;
    rig_open(&p64, g_model, &o64);
    assert_int_equal(st_slot_eval(p64.s, other, on, 0, NULL), 0);
    assert_int_equal(st_slot_snapshot(p64.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img), 0);
    assert_int_equal(st_slot_restore(r.s, img), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "page_size 256 vs 64"));
    same(r.s, &before);
    st_image_free(img);
    rig_close(&p64);
    /* 5. another model */
    rig om;
    rig_open(&om, g_other, &o);
    assert_int_equal(st_slot_eval(om.s, other, on, 0, NULL), 0);
    assert_int_equal(st_slot_snapshot(om.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img), 0);
    assert_int_equal(st_slot_restore(r.s, img), ST_EMODEL);
    assert_non_null(strstr(st_errdetail(), "fingerprint"));
    same(r.s, &before);
    st_image_free(img);
    rig_close(&om);
    /* the slot still continues exactly like one that saw none of this */
    gen(r.s, 12, t1, 0.0f);
    gen(ref.s, 12, t2, 0.0f);
    assert_memory_equal(t1, t2, 12 * sizeof *t1);
    rig_close(&r);
    rig_close(&donor);
    rig_close(&ref);
}

static void build_conv(uint32_t *dst, uint64_t *n, uint64_t *sys_end, const char *sys,
                       const char *user)
{
    *n = et_tokens(dst, sys);
    *sys_end = *n;
    dst[(*n)++] = ST_TOKEN_SEP;
    size_t ul = strlen(user);
    *n += st_tokenize(user, ul, dst + *n, ul);
}

static void test_prefix_reuse(void **state)
{
    const char *sys = "You are a careful assistant. Keep every answer short and exact, please.";
    uint32_t c1[512], c2[512], g1[16], g2[16];
    uint64_t n1, n2, se1, se2;
    build_conv(c1, &n1, &se1, sys, "What is a recurrent state?");
    build_conv(c2, &n2, &se2, sys, "And a K/V cache, how is it paged?");
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    o.prompt_cache_root = 32;
    o.prompt_cache = 4;
    rig r, fresh;
    rig_open(&r, g_model, &o);
    rig_open(&fresh, g_model, &o);
    st_eval_stats es;
    assert_int_equal(st_slot_eval(r.s, c1, n1, se1, &es), 0);
    assert_int_equal(es.computed, n1);
    /* root at the end of the system prompt, turn boundary at n1 */
    assert_int_equal(st_slot_n_checkpoints(r.s), 2);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 0), se1);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 1), n1);
    uint32_t tmp[8];
    gen(r.s, 8, tmp, 0.0f);
    /* a new conversation sharing the system prompt resumes from the root */
    assert_int_equal(st_slot_eval(r.s, c2, n2, se2, &es), 0);
    assert_int_equal(es.mounted_at, se2);
    assert_int_equal(es.reused, se2);
    assert_int_equal(es.computed, n2 - se2);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 0), se2);
    gen(r.s, 16, g1, 0.0f);
    /* exactly the tokens and logits of a full read */
    assert_int_equal(st_slot_eval(fresh.s, c2, n2, se2, &es), 0);
    assert_int_equal(es.computed, n2);
    gen(fresh.s, 16, g2, 0.0f);
    assert_memory_equal(g1, g2, sizeof g1);
    uint32_t nl;
    assert_memory_equal(st_slot_logits(r.s, &nl), st_slot_logits(fresh.s, &nl),
                        ST_VOCAB_BYTES * sizeof(float));
    /* the first conversation again: root mounted, same as its own full read */
    assert_int_equal(st_slot_eval(r.s, c1, n1, se1, &es), 0);
    assert_int_equal(es.mounted_at, se1);
    gen(r.s, 8, g1, 0.0f);
    st_slot_reset(fresh.s);
    assert_int_equal(st_slot_eval(fresh.s, c1, n1, se1, &es), 0);
    gen(fresh.s, 8, g2, 0.0f);
    assert_memory_equal(g1, g2, 8 * sizeof *g1);
    /* a prompt diverging before any checkpoint is a full read */
    uint32_t c3[64];
    uint64_t n3 = et_tokens(c3, "Different from the very start.");
    assert_int_equal(st_slot_eval(r.s, c3, n3, 0, &es), 0);
    assert_int_equal(es.mounted_at, UINT64_MAX);
    assert_int_equal(es.computed, n3);
    rig_close(&r);
    rig_close(&fresh);
}

/* The cancel hook (st_slot_set_cancel): asked before each chunk; a stop after k chunks leaves
 * exactly k whole chunks read with the logits after the last, no checkpoint at the stop,
 * ECANCELED; the next eval reads on and gives the bits of a read that was never stopped. */
static int stop_after(void *arg)
{
    int *left = arg;
    return (*left)-- <= 0;
}

static void test_cancel_between_chunks(void **state)
{
    (void)state;
    const char *sys = "You are a careful assistant. Keep every answer short and exact, please.";
    uint32_t c[512], g1[8], g2[8];
    uint64_t n, se;
    build_conv(c, &n, &se, sys, "Tell me about chunks and how a read can stop between them.");
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    o.prompt_cache = 4;
    rig r, fresh;
    rig_open(&r, g_model, &o);
    rig_open(&fresh, g_model, &o);
    assert_true(n > 3 * 16);
    /* a first turn with logits, so that stale logits would show */
    st_eval_stats es;
    assert_int_equal(st_slot_eval(r.s, c, 20, 0, &es), 0);
    uint32_t nck = st_slot_n_checkpoints(r.s);
    int left = 2;
    st_slot_set_cancel(r.s, stop_after, &left);
    assert_int_equal(st_slot_eval(r.s, c, n, 0, &es), ECANCELED);
    st_slot_set_cancel(r.s, NULL, NULL);
    /* chunks end on multiples of 16: [20, 32) and [32, 48) were read */
    assert_int_equal(st_slot_n_tokens(r.s), 48);
    assert_int_equal(es.reused, 20);
    assert_int_equal(es.computed, 28);
    assert_int_equal(st_slot_n_checkpoints(r.s), nck);
    /* whole: the logits are those after token 48, as a read of exactly 48 tokens gives */
    uint32_t nl;
    assert_int_equal(st_slot_eval(fresh.s, c, 48, 0, &es), 0);
    assert_non_null(st_slot_logits(r.s, NULL));
    assert_memory_equal(st_slot_logits(r.s, &nl), st_slot_logits(fresh.s, &nl),
                        ST_VOCAB_BYTES * sizeof(float));
    st_slot_reset(fresh.s);
    assert_memory_equal(st_slot_tokens(r.s), c, 48 * sizeof *c);
    /* reading on: the live state is reused, the result is that of a fresh full read */
    assert_int_equal(st_slot_eval(r.s, c, n, 0, &es), 0);
    assert_int_equal(es.reused, 48);
    assert_int_equal(st_slot_eval(fresh.s, c, n, 0, &es), 0);
    assert_memory_equal(st_slot_logits(r.s, &nl), st_slot_logits(fresh.s, &nl),
                        ST_VOCAB_BYTES * sizeof(float));
    gen(r.s, 8, g1, 0.0f);
    gen(fresh.s, 8, g2, 0.0f);
    assert_memory_equal(g1, g2, sizeof g1);
    /* a hook that says stop at once: nothing read, the slot keeps what it held */
    left = 0;
    uint64_t held = st_slot_n_tokens(r.s);
    uint32_t longer[600];
    memcpy(longer, st_slot_tokens(r.s), held * sizeof *longer);
    for (uint64_t i = held; i < held + 40; i++)
        longer[i] = 'a' + (uint32_t)(i % 26);
    st_slot_set_cancel(r.s, stop_after, &left);
    assert_int_equal(st_slot_eval(r.s, longer, held + 40, 0, &es), ECANCELED);
    st_slot_set_cancel(r.s, NULL, NULL);
    assert_int_equal(st_slot_n_tokens(r.s), held);
    assert_non_null(st_slot_logits(r.s, NULL)); /* still those after its last token */
    rig_close(&r);
    rig_close(&fresh);
}

static void test_periodic_and_park(void **state)
{
    char text[200];
    memset(text, 'x', sizeof text - 1);
    text[sizeof text - 1] = '\0';
    for (size_t i = 0; i < sizeof text - 1; i++)
        text[i] = (char)('a' + (i * 7) % 26);
    uint32_t toks[256];
    uint64_t n = et_tokens(toks, text);
    st_engine_opts o = opts(2);
    o.ubatch = 32;
    o.prompt_cache_every = 40; /* rounded up to 64 */
    o.prompt_cache = 6;
    rig r;
    rig_open(&r, g_model, &o);
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    assert_int_equal(n, 200);
    assert_int_equal(st_slot_n_checkpoints(r.s), 4);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 0), 64);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 1), 128);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 2), 192);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 3), 200);
    uint32_t g[8];
    gen(r.s, 4, g, 0.0f);
    /* park image: the whole chain plus the live state */
    st_image *img = NULL;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_BF16, &img), 0);
    assert_int_equal(st_image_n_checkpoints(img), 5);
    st_image *sess = NULL;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &sess), 0);
    assert_int_equal(st_image_n_checkpoints(sess), 2);
    uint64_t pos;
    uint32_t codec;
    assert_int_equal(st_image_checkpoint_info(sess, 0, &pos, &codec), 0);
    assert_int_equal(pos, 200);
    st_image_free(sess);
    rig r2;
    rig_open(&r2, g_model, &o);
    assert_int_equal(st_slot_restore(r2.s, img), 0);
    st_image_free(img);
    assert_int_equal(st_slot_n_checkpoints(r2.s), 4);
    /* diverge at 150: mounts the checkpoint at 128 (bf16-widened) and reads the rest */
    toks[150] = 'Z';
    st_eval_stats es;
    assert_int_equal(st_slot_eval(r2.s, toks, n, 0, &es), 0);
    assert_int_equal(es.mounted_at, 128);
    assert_int_equal(es.computed, n - 128);
    /* the fp32 chain of the original slot mounts at the same point; identical to a full read */
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, &es), 0);
    assert_int_equal(es.mounted_at, 128);
    uint32_t g1[8], g2[8];
    gen(r.s, 8, g1, 0.0f);
    rig fr;
    rig_open(&fr, g_model, &o);
    assert_int_equal(st_slot_eval(fr.s, toks, n, 0, NULL), 0);
    gen(fr.s, 8, g2, 0.0f);
    assert_memory_equal(g1, g2, sizeof g1);
    rig_close(&fr);
    rig_close(&r);
    rig_close(&r2);
}

static void test_cache_limits(void **state)
{
    uint32_t toks[600];
    char text[520];
    for (size_t i = 0; i < sizeof text - 1; i++)
        text[i] = (char)('a' + (i * 5) % 26);
    text[sizeof text - 1] = '\0';
    uint64_t n = et_tokens(toks, text);
    st_engine_opts o = opts(1);
    o.ubatch = 16;
    o.prompt_cache_every = 16;
    o.prompt_cache = 3;
    rig r;
    rig_open(&r, g_model, &o);
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    assert_int_equal(st_slot_n_checkpoints(r.s), 3);
    /* with LRU and no root, the newest three remain */
    assert_int_equal(st_slot_checkpoint_pos(r.s, 2), n);
    rig_close(&r);
    o.prompt_cache = 0;
    rig_open(&r, g_model, &o);
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    assert_int_equal(st_slot_n_checkpoints(r.s), 0);
    uint32_t bad = 9999;
    assert_int_equal(st_slot_eval(r.s, &bad, 1, 0, NULL), ST_EINVAL);
    assert_int_equal(st_slot_eval(r.s, toks, 0, 0, NULL), ST_EINVAL);
    rig_close(&r);
}

/* A running state of 4 MB per checkpoint, 1.3 MB per DeltaNet matrix: the bulk transfers cut
 * each into several hash blocks, and snapshot images take their checkpoint blocks (2 MiB and
 * more) from the image buffer cache. */
static void big_state(st_model_hparams *hp)
{
    hp->ssm_heads = 4;
    hp->ssm_dk = 128;
    hp->ssm_dv = 640;
}

static void flip(void *p, uint64_t at)
{
    ((uint8_t *)p)[at] ^= 0x10;
}

/* Restore img into r (holding another conversation): refused as corrupt, r unchanged. */
static void refused(rig *r, const st_image *img, const obs *before)
{
    assert_int_equal(st_slot_restore(r->s, img), ST_ECORRUPT);
    same(r->s, before);
}

/* The one-pass restore verifies what arrived: a bit flipped in any K/V tensor (first, middle and
 * last byte) or any running tensor of the live checkpoint of a PARK image, fp32 and bf16, is
 * refused and leaves the slot as it was; the untouched image restores and continues as the
 * original does. */
static void test_bulk_bit_flips(void **state)
{
    (void)state;
    uint32_t toks[256], other[256], a[8], b[8];
    uint64_t n = et_tokens(toks, "Every byte of this state is checked where it lands.");
    uint64_t on = et_tokens(other, "the conversation the slot holds meanwhile");
    st_engine_opts o = opts(2);
    uint32_t codecs[2] = {ST_CODEC_FP32, ST_CODEC_BF16};
    for (int c = 0; c < 2; c++) {
        rig r, t;
        rig_open(&r, g_big, &o);
        rig_open(&t, g_big, &o);
        assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
        gen(r.s, 3, a, 0.0f);
        assert_int_equal(st_slot_eval(t.s, other, on, 0, NULL), 0);
        obs before;
        observe(t.s, &before);
        st_image *img = NULL;
        assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, codecs[c], &img), 0);
        const st_geometry *g = st_image_geometry(img);
        uint32_t last = st_image_n_checkpoints(img) - 1;
        uint32_t n_flipped = 0;
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            uint64_t len = 0;
            uint8_t *p = g->tensors[ti].role == ST_ROLE_KV
                             ? st_image_kv(img, ti, &len)
                             : st_image_checkpoint_tensor(img, last, ti, &len);
            assert_true(len > 0);
            uint64_t at[3] = {0, len / 2, len - 1};
            for (int k = 0; k < 3; k++) {
                flip(p, at[k]);
                refused(&t, img, &before);
                flip(p, at[k]);
                n_flipped++;
            }
        }
        assert_true(n_flipped >= 3 * 9);
        /* the control: the image as made restores, hashes to its record and continues */
        assert_int_equal(st_slot_restore(t.s, img), 0);
        uint64_t h = 0;
        assert_int_equal(st_slot_state_hash(t.s, ST_CODEC_FP32, &h), 0);
        assert_true(h == st_image_state_hash(img));
        gen(r.s, 8, a, 0.0f);
        gen(t.s, 8, b, 0.0f);
        assert_memory_equal(a, b, sizeof a);
        st_image_free(img);
        rig_close(&r);
        rig_close(&t);
    }
}

/* An image made in reused buffers of the image buffer cache (which still hold another
 * conversation's state) has exactly the bytes of one made in fresh memory: every byte a file or
 * the store takes from it is written by the snapshot. */
static void test_image_cache_reuse(void **state)
{
    (void)state;
    uint32_t ta[256], tb[256], x[4];
    uint64_t na = et_tokens(ta, "conversation A, parked and freed, its buffers kept");
    uint64_t nb = et_tokens(tb, "conversation B, snapshotted before and after");
    st_engine_opts o = opts(2);
    uint32_t codecs[2] = {ST_CODEC_FP32, ST_CODEC_BF16};
    int modes[2] = {ST_SNAPSHOT_PARK, ST_SNAPSHOT_SESSION};
    rig r;
    st_slot *sb = NULL;
    rig_open(&r, g_big, &o);
    assert_int_equal(st_slot_new(r.e, &sb), 0);
    assert_int_equal(st_slot_eval(r.s, ta, na, 0, NULL), 0);
    gen(r.s, 4, x, 0.0f);
    assert_int_equal(st_slot_eval(sb, tb, nb, 0, NULL), 0);
    gen(sb, 2, x, 0.0f);
    for (int c = 0; c < 2; c++)
        for (int m = 0; m < 2; m++) {
            st_image *b1 = NULL, *a1 = NULL, *b2 = NULL;
            uint8_t *f1 = NULL, *f2 = NULL;
            size_t l1 = 0, l2 = 0;
            assert_int_equal(st_slot_snapshot(sb, modes[m], codecs[c], &b1), 0);
            assert_int_equal(st_file_write_mem(b1, NULL, &f1, &l1), 0);
            st_image_free(b1);
            /* A's image of the same shape, every checkpoint byte overwritten with a pattern;
             * freed, its blocks wait in the cache */
            assert_int_equal(st_slot_snapshot(r.s, modes[m], codecs[c], &a1), 0);
            const st_geometry *g = st_image_geometry(a1);
            for (uint32_t ci = 0; ci < st_image_n_checkpoints(a1); ci++)
                for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
                    uint64_t len = 0;
                    void *p = g->tensors[ti].role == ST_ROLE_RUNNING
                                  ? st_image_checkpoint_tensor(a1, ci, ti, &len) : NULL;
                    if (p)
                        memset(p, 0xa5, len);
                }
            st_image_free(a1);
            assert_int_equal(st_slot_snapshot(sb, modes[m], codecs[c], &b2), 0);
            assert_int_equal(st_file_write_mem(b2, NULL, &f2, &l2), 0);
            assert_int_equal(l1, l2);
            assert_memory_equal(f1, f2, l1);
            uint64_t h = 0;
            assert_int_equal(st_image_state_hash_compute(b2, NULL, NULL, &h), 0);
            assert_true(h == st_image_state_hash(b2));
            st_image_free(b2);
            free(f1);
            free(f2);
        }
    st_slot_free(sb);
    rig_close(&r);
}

/* The bytes of a PARK snapshot of s as a file holds them (the caller frees *f). */
static void park_bytes(st_slot *s, uint32_t codec, uint8_t **f, size_t *len)
{
    st_image *img = NULL;
    assert_int_equal(st_slot_snapshot(s, ST_SNAPSHOT_PARK, codec, &img), 0);
    assert_int_equal(st_file_write_mem(img, NULL, f, len), 0);
    st_image_free(img);
}

/* A restore writes into the engine's spares (the backend state and checkpoints the previous
 * restore replaced, here holding a longer conversation with more checkpoints): the slot it
 * leaves is bit for bit the slot a restore into a new engine leaves (its PARK image, its logits,
 * what it generates next), in each codec (fp32 and bf16 through the bulk load, f16 through the
 * per-tensor one); a bit flipped in the live state is still refused and changes nothing. The
 * second restore into r is the one that takes the spares (the first made them). */
static void test_restore_into_spares(void **state)
{
    (void)state;
    uint32_t tl[512], ts[256], a[8], b[8];
    uint64_t nl = et_tokens(tl, "A long conversation that fills many K/V rows and takes several "
                                "checkpoints of its running state on the way, so that the "
                                "state it leaves behind holds rows and values a shorter one "
                                "does not write.");
    uint64_t ns = et_tokens(ts, "a short one");
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    o.prompt_cache_every = 16;
    uint32_t codecs[3] = {ST_CODEC_FP32, ST_CODEC_BF16, ST_CODEC_F16};
    for (int c = 0; c < 3; c++) {
        rig r, f, m;
        rig_open(&r, g_big, &o);
        rig_open(&f, g_big, &o);
        rig_open(&m, g_big, &o);
        /* the short conversation's image, made elsewhere */
        assert_int_equal(st_slot_eval(m.s, ts, ns, 0, NULL), 0);
        gen(m.s, 2, a, 0.0f);
        st_image *img_s = NULL, *img_l = NULL;
        assert_int_equal(st_slot_snapshot(m.s, ST_SNAPSHOT_PARK, codecs[c], &img_s), 0);
        /* r: the long conversation, parked and restored (its state becomes the spare), then
         * the short one restored into the spares */
        assert_int_equal(st_slot_eval(r.s, tl, nl, 0, NULL), 0);
        gen(r.s, 3, a, 0.0f);
        assert_true(st_slot_n_checkpoints(r.s) > 2);
        assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, codecs[c], &img_l), 0);
        assert_int_equal(st_slot_restore(r.s, img_l), 0);
        assert_int_equal(st_slot_restore(r.s, img_s), 0);
        /* f: the same image into a new engine's new state */
        assert_int_equal(st_slot_restore(f.s, img_s), 0);
        uint8_t *pr = NULL, *pf = NULL;
        size_t lr = 0, lf = 0;
        park_bytes(r.s, codecs[c], &pr, &lr);
        park_bytes(f.s, codecs[c], &pf, &lf);
        assert_int_equal(lr, lf);
        assert_memory_equal(pr, pf, lr);
        free(pr);
        free(pf);
        uint64_t hr = 0, hf = 0;
        assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_FP32, &hr), 0);
        assert_int_equal(st_slot_state_hash(f.s, ST_CODEC_FP32, &hf), 0);
        assert_true(hr == hf && hr == st_image_state_hash(img_s));
        /* a flipped bit in the live state is refused, r unchanged; the spare is the long
         * conversation's state again (the restore of img_s replaced r's) */
        obs before;
        observe(r.s, &before);
        const st_geometry *g = st_image_geometry(img_s);
        uint32_t last = st_image_n_checkpoints(img_s) - 1;
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            uint64_t len = 0;
            uint8_t *p = g->tensors[ti].role == ST_ROLE_RUNNING
                             ? st_image_checkpoint_tensor(img_s, last, ti, &len) : NULL;
            if (!p || len < 8)
                continue;
            flip(p, len / 2);
            refused(&r, img_s, &before);
            flip(p, len / 2);
        }
        /* the long conversation back into the spares, then the short one once more */
        assert_int_equal(st_slot_restore(r.s, img_l), 0);
        assert_int_equal(st_slot_restore(r.s, img_s), 0);
        uint32_t nvr = 0, nvf = 0;
        const float *lgr = st_slot_logits(r.s, &nvr), *lgf = st_slot_logits(f.s, &nvf);
        assert_int_equal(nvr, nvf);
        assert_memory_equal(lgr, lgf, (size_t)nvr * sizeof *lgr);
        gen(r.s, 8, a, 0.0f);
        gen(f.s, 8, b, 0.0f);
        assert_memory_equal(a, b, sizeof a);
        lgr = st_slot_logits(r.s, &nvr);
        lgf = st_slot_logits(f.s, &nvf);
        assert_memory_equal(lgr, lgf, (size_t)nvr * sizeof *lgr);
        st_image_free(img_s);
        st_image_free(img_l);
        rig_close(&r);
        rig_close(&f);
        rig_close(&m);
    }
}

/* The image's checkpoint blocks, in order (at most 64). */
static uint32_t blocks(const st_image *img, const void **out)
{
    uint32_t n = st_image_n_checkpoints(img);
    assert_true(n <= 64);
    for (uint32_t ci = 0; ci < n; ci++)
        assert_non_null(out[ci] = st_image_checkpoint_block(img, ci, NULL));
    return n;
}

/* st_slot_restore_adopt: a restore that takes an image's fp32 checkpoint blocks as the slot's
 * running state and checkpoints. In fp32 the slot then holds the very blocks the image held
 * (the checkpoints' blocks are the image's, the image holds the engine's old ones), and the slot
 * is bit for bit the one a copying restore into a new engine leaves (its PARK image, logits and
 * what it generates next); in bf16 nothing is taken (the widening is the copy) and the result is
 * the same. A bit flipped in the live state or a checkpoint's position is refused with the slot,
 * the image exactly as they were (the image's file bytes and its blocks), the spares kept (the
 * blocks the failed restore wrote into are spares again, within one slot's). After
 * restores back and forth the spares stay within one slot's (prompt_cache checkpoints). */
static void test_restore_adopt(void **state)
{
    (void)state;
    uint32_t tl[512], ts[256], a[8], b[8];
    uint64_t nl = et_tokens(tl, "A conversation whose checkpoints and live state a restore takes "
                                "from the image as they are, without a copy, once verified.");
    uint64_t ns = et_tokens(ts, "another one, held before");
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    o.prompt_cache_every = 16;
    uint32_t codecs[2] = {ST_CODEC_FP32, ST_CODEC_BF16};
    for (int c = 0; c < 2; c++) {
        rig r, f;
        rig_open(&r, g_big, &o);
        rig_open(&f, g_big, &o);
        assert_int_equal(st_slot_eval(f.s, tl, nl, 0, NULL), 0);
        gen(f.s, 3, a, 0.0f);
        assert_true(st_slot_n_checkpoints(f.s) > 2);
        st_image *img = NULL, *img_s = NULL;
        assert_int_equal(st_slot_snapshot(f.s, ST_SNAPSHOT_PARK, codecs[c], &img), 0);
        uint8_t *want = NULL;
        size_t want_len = 0;
        assert_int_equal(st_file_write_mem(img, NULL, &want, &want_len), 0);
        /* r holds another conversation and has spares (the first restore made them) */
        assert_int_equal(st_slot_eval(r.s, ts, ns, 0, NULL), 0);
        gen(r.s, 2, b, 0.0f);
        assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, codecs[c], &img_s), 0);
        assert_int_equal(st_slot_restore(r.s, img_s), 0);
        obs before;
        observe(r.s, &before);
        /* refused: a flipped bit in each live running tensor, then a checkpoint's position */
        st_image *cp = NULL;
        assert_int_equal(st_image_clone(&cp, img), 0);
        const void *b0[64], *b1[64];
        uint32_t nb = blocks(cp, b0);
        const st_geometry *g = st_image_geometry(cp);
        uint32_t n_spare = r.e->n_spare_ck;
        for (uint32_t ci = 0; ci < nb; ci++)
            for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
                uint64_t len = 0;
                uint8_t *p = g->tensors[ti].role == ST_ROLE_RUNNING
                                 ? st_image_checkpoint_tensor(cp, ci, ti, &len) : NULL;
                int is_pos = p && g->tensors[ti].dtype == ST_DTYPE_I64;
                if (!p || (ci + 1 < nb && !is_pos) || (ci + 1 == nb && is_pos))
                    continue; /* the live state's tensors, the checkpoints' positions */
                flip(p, len / 2);
                assert_int_equal(st_slot_restore_adopt(r.s, cp), ST_ECORRUPT);
                same(r.s, &before);
                assert_true(r.e->n_spare_ck >= n_spare && r.e->n_spare_ck <= o.prompt_cache);
                flip(p, len / 2);
                blocks(cp, b1);
                assert_memory_equal(b0, b1, nb * sizeof *b0);
                uint8_t *got = NULL;
                size_t got_len = 0;
                assert_int_equal(st_file_write_mem(cp, NULL, &got, &got_len), 0);
                assert_int_equal(got_len, want_len);
                assert_memory_equal(got, want, want_len);
                free(got);
            }
        /* taken */
        assert_int_equal(st_slot_restore_adopt(r.s, cp), 0);
        blocks(cp, b1);
        uint32_t keep = r.s->n_ck;
        assert_int_equal(keep, nb - 1);
        for (uint32_t i = 0; i < keep; i++) {
            int taken = codecs[c] == ST_CODEC_FP32;
            assert_int_equal(r.s->ck[i].blk == b0[i], taken);
            assert_int_equal(b1[i] != b0[i], taken);
        }
        assert_int_equal(b1[nb - 1] != b0[nb - 1], codecs[c] == ST_CODEC_FP32);
        assert_int_equal(st_image_n_tokens(cp), st_image_n_tokens(img));
        st_image_free(cp);
        uint8_t *pr = NULL, *pf = NULL;
        size_t lr = 0, lf = 0;
        park_bytes(r.s, codecs[c], &pr, &lr);
        assert_int_equal(st_slot_restore(f.s, img), 0);
        park_bytes(f.s, codecs[c], &pf, &lf);
        assert_int_equal(lr, lf);
        assert_memory_equal(pr, pf, lr);
        free(pr);
        free(pf);
        /* back and forth, each restore taking the image's blocks: spares bounded, the slot
         * continues as the copying restore's */
        for (int k = 0; k < 4; k++) { /* ends with img */
            st_image *x = NULL;
            assert_int_equal(st_image_clone(&x, k % 2 ? img : img_s), 0);
            assert_int_equal(st_slot_restore_adopt(r.s, x), 0);
            st_image_free(x);
            assert_true(r.e->n_spare_ck <= o.prompt_cache);
        }
        uint32_t nvr = 0, nvf = 0;
        const float *lgr = st_slot_logits(r.s, &nvr), *lgf = st_slot_logits(f.s, &nvf);
        assert_int_equal(nvr, nvf);
        assert_memory_equal(lgr, lgf, (size_t)nvr * sizeof *lgr);
        gen(r.s, 8, a, 0.0f);
        gen(f.s, 8, b, 0.0f);
        assert_memory_equal(a, b, sizeof a);
        lgr = st_slot_logits(r.s, &nvr);
        lgf = st_slot_logits(f.s, &nvf);
        assert_memory_equal(lgr, lgf, (size_t)nvr * sizeof *lgr);
        free(want);
        st_image_free(img);
        st_image_free(img_s);
        rig_close(&r);
        rig_close(&f);
    }
}

/* The first running tensor of checkpoint ci of img, where the image holds it. */
static const void *ck_tensor(const st_image *img, uint32_t ci)
{
    const st_geometry *g = st_image_geometry(img);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++)
        if (g->tensors[ti].role == ST_ROLE_RUNNING && g->tensors[ti].dtype == ST_DTYPE_F32)
            return st_image_checkpoint_tensor_const(img, ci, ti, NULL);
    return NULL;
}

/* A held checkpoint's bf16 block (st_slot.c invariant 7): kept once a snapshot has coded it and
 * put by reference into every later bf16 PARK and SAVE, whose files are byte for byte those of an
 * engine that codes it afresh; dropped with its checkpoint (a new checkpoint at the same position
 * on another branch is coded again, not given the old block); adopted from a restored bf16
 * image; a shared block written through an image is copied first (the slot's stays as it was);
 * and a restore from such an image continues exactly as one from a freshly coded image. */
static void test_held_bf16_block(void **state)
{
    (void)state;
    uint32_t ta[256], tb[256], tc[300], x[8], y[8];
    uint64_t na = et_tokens(ta, "Conversation A: its prompt's end is a held checkpoint.");
    uint64_t nb = na; /* B: A with one token changed halfway */
    memcpy(tb, ta, na * sizeof *ta);
    tb[na / 2] = tb[na / 2] == 'q' ? 'z' : 'q';
    st_engine_opts o = opts(2);
    rig r, fa, fb;
    rig_open(&r, g_big, &o);
    rig_open(&fa, g_big, &o);
    rig_open(&fb, g_big, &o);
    assert_int_equal(st_slot_eval(r.s, ta, na, 0, NULL), 0);
    gen(r.s, 4, x, 0.0f);
    assert_int_equal(st_slot_n_checkpoints(r.s), 1);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 0), na);
    /* the references: A and B, each parked once by an engine that never kept a block */
    uint8_t *fa1 = NULL, *fb1 = NULL, *p = NULL;
    size_t la1 = 0, lb1 = 0, lp = 0;
    assert_int_equal(st_slot_eval(fa.s, ta, na, 0, NULL), 0);
    gen(fa.s, 4, x, 0.0f);
    park_bytes(fa.s, ST_CODEC_BF16, &fa1, &la1);
    assert_int_equal(st_slot_eval(fb.s, tb, nb, 0, NULL), 0);
    gen(fb.s, 4, x, 0.0f);
    park_bytes(fb.s, ST_CODEC_BF16, &fb1, &lb1);
    assert_int_equal(la1, lb1);
    assert_memory_not_equal(fa1, fb1, la1); /* negative control: the comparisons below can fail */

    /* coded by the first bf16 PARK, shared by the second and by a SAVE */
    st_image *i1 = NULL, *i2 = NULL, *i3 = NULL;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_BF16, &i1), 0);
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_BF16, &i2), 0);
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &i3), 0);
    assert_ptr_equal(ck_tensor(i1, 0), ck_tensor(i2, 0));
    assert_ptr_equal(ck_tensor(i1, 0), ck_tensor(i3, 0));
    assert_ptr_not_equal(ck_tensor(i1, 1), ck_tensor(i2, 1)); /* the live state: coded each time */
    assert_int_equal(st_file_write_mem(i2, NULL, &p, &lp), 0);
    assert_int_equal(lp, la1);
    assert_memory_equal(p, fa1, la1);
    free(p);
    /* an fp32 snapshot does not use it */
    st_image *f32 = NULL;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_FP32, &f32), 0);
    assert_ptr_not_equal(ck_tensor(f32, 0), ck_tensor(i1, 0));
    st_image_free(f32);
    /* written through an image: that image gets its own copy, the slot's block is unchanged */
    const st_geometry *g = st_image_geometry(i2);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        uint64_t len = 0;
        void *w = g->tensors[ti].role == ST_ROLE_RUNNING
                      ? st_image_checkpoint_tensor(i2, 0, ti, &len) : NULL;
        if (w)
            memset(w, 0x5a, len);
    }
    assert_ptr_not_equal(ck_tensor(i1, 0), ck_tensor(i2, 0));
    st_image_free(i2);
    st_image_free(i3);
    park_bytes(r.s, ST_CODEC_BF16, &p, &lp);
    assert_memory_equal(p, fa1, la1);
    free(p);

    /* B over A: the checkpoint at the same position is a new one, coded afresh */
    assert_int_equal(st_slot_eval(r.s, tb, nb, 0, NULL), 0);
    gen(r.s, 4, x, 0.0f);
    assert_int_equal(st_slot_n_checkpoints(r.s), 1);
    assert_int_equal(st_slot_checkpoint_pos(r.s, 0), nb);
    park_bytes(r.s, ST_CODEC_BF16, &p, &lp);
    assert_int_equal(lp, lb1);
    assert_memory_equal(p, fb1, lb1);
    free(p);

    /* A restored: its image's block is the held checkpoint's (the next PARK shares it and writes
     * A's reference file), and a follow-up resuming from that checkpoint gives the bits of one
     * restored from the reference image */
    assert_int_equal(st_slot_restore(r.s, i1), 0);
    st_image *i4 = NULL;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_BF16, &i4), 0);
    assert_ptr_equal(ck_tensor(i4, 0), ck_tensor(i1, 0));
    st_image_free(i1); /* the slot and i4 hold the block now */
    assert_int_equal(st_file_write_mem(i4, NULL, &p, &lp), 0);
    assert_memory_equal(p, fa1, la1);
    free(p);
    st_image *ref = NULL;
    assert_int_equal(st_file_read_mem(fa1, la1, NULL, &ref), 0);
    assert_int_equal(st_slot_restore(fa.s, ref), 0);
    st_image_free(ref);
    memcpy(tc, ta, na * sizeof *ta);
    uint64_t nc = na + et_tokens(tc + na, " and then it diverges.");
    st_eval_stats es;
    assert_int_equal(st_slot_restore(fb.s, i4), 0);
    st_image_free(i4);
    if (st_slot_tokens(fb.s)[na] == tc[na]) /* diverge right after the checkpoint */
        tc[na] = tc[na] == 'x' ? 'y' : 'x';
    assert_int_equal(st_slot_eval(fb.s, tc, nc, 0, &es), 0);
    assert_int_equal(es.mounted_at, na);
    assert_int_equal(st_slot_eval(fa.s, tc, nc, 0, &es), 0);
    assert_int_equal(es.mounted_at, na);
    uint32_t nv = 0;
    assert_memory_equal(st_slot_logits(fa.s, &nv), st_slot_logits(fb.s, &nv),
                        ST_VOCAB_BYTES * sizeof(float));
    gen(fa.s, 8, x, 0.0f);
    gen(fb.s, 8, y, 0.0f);
    assert_memory_equal(x, y, sizeof x);
    free(fa1);
    free(fb1);
    rig_close(&r);
    rig_close(&fa);
    rig_close(&fb);
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "engine_slot");
    et_model(g_model, sizeof g_model, g_dir, "tiny.gguf", 1, NULL);
    et_model(g_big, sizeof g_big, g_dir, "big-state.gguf", 3, big_state);
    et_model(g_other, sizeof g_other, g_dir, "other.gguf", 2, NULL);
    return 0;
}

static int teardown(void **state)
{
    st_test_rmdir(g_dir);
    return 0;
}

/* Restore img into a fresh slot (must succeed) and generate n greedy tokens into out. */
static void restore_gen(const st_image *img, uint32_t threads, uint32_t n, uint32_t *out)
{
    st_engine_opts o = opts(threads);
    rig r;
    rig_open(&r, g_model, &o);
    int rc = st_slot_restore(r.s, img);
    if (rc)
        fail_msg("restore: %s", st_errdetail());
    uint64_t h = 0;
    uint32_t codec;
    assert_int_equal(st_image_checkpoint_info(img, st_image_n_checkpoints(img) - 1, NULL, &codec),
                     0);
    /* the slot holds the widened values: as fp32 they hash to what the image records */
    assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_FP32, &h), 0);
    assert_true(h == st_image_state_hash(img));
    gen(r.s, n, out, 0.0f);
    const float *l = st_slot_logits(r.s, NULL);
    for (uint32_t i = 0; i < ST_VOCAB_BYTES; i++)
        assert_false(isnan(l[i]));
    rig_close(&r);
}

/* Zero the f32 running tensors of img's live checkpoint. */
static void zero_live(st_image *img)
{
    const st_geometry *g = st_image_geometry(img);
    uint32_t last = st_image_n_checkpoints(img) - 1;
    for (uint32_t ti = 0; ti < g->n_tensors; ti++)
        if (g->tensors[ti].role == ST_ROLE_RUNNING && g->tensors[ti].dtype == ST_DTYPE_F32) {
            uint64_t len = 0;
            void *p = st_image_checkpoint_tensor(img, last, ti, &len);
            assert_true(len > 0);
            memset(p, 0, len);
        }
}

/* The state hash is codec-independent in the sound sense: it covers the values a restore puts
 * in the slot, so state stored (or converted) in any codec restores and continues. */
static void test_state_hash_codecs(void **state)
{
    (void)state;
    uint32_t toks[256], a[16], b[16];
    uint64_t n = et_tokens(toks, "Convert me between codecs and bring me back.");
    st_engine_opts o = opts(2);
    rig r;
    rig_open(&r, g_model, &o);
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    gen(r.s, 5, a, 0.0f);
    st_image *fp = NULL, *f16 = NULL, *x = NULL;
    uint64_t h;
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_FP32, &fp), 0);
    assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_PARK, ST_CODEC_F16, &f16), 0);
    /* the slot's hash through a codec is what a snapshot in that codec records */
    assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_F16, &h), 0);
    assert_true(h == st_image_state_hash(f16));
    assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_FP32, &h), 0);
    assert_true(h == st_image_state_hash(fp));
    assert_true(st_image_state_hash(f16) != st_image_state_hash(fp));
    gen(r.s, 8, a, 0.0f);

    /* 1. a snapshot in f16 restores and continues; fp32 continues exactly */
    restore_gen(f16, 2, 8, b);
    restore_gen(fp, 2, 8, b);
    assert_memory_equal(a, b, sizeof a[0] * 8);

    /* 2. an fp32 snapshot re-coded to f16 (st_image_checkpoint_recode): the recorded hash no
     *    longer describes it until recomputed, as a conversion does; then it restores */
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    assert_non_null(scratch);
    assert_int_equal(st_image_clone(&x, fp), 0);
    for (uint32_t ci = 0; ci < st_image_n_checkpoints(x); ci++)
        assert_int_equal(st_image_checkpoint_recode(x, ci, ST_CODEC_F16, scratch,
                                                    ST_CODEC_SCRATCH_MAX), 0);
    rig q;
    rig_open(&q, g_model, &o);
    assert_int_equal(st_slot_restore(q.s, x), ST_ECORRUPT);
    assert_int_equal(st_slot_n_tokens(q.s), 0);
    rig_close(&q);
    assert_int_equal(st_image_state_hash_compute(x, NULL, NULL, &h), 0);
    assert_true(h == st_image_state_hash(f16));
    st_image_state_hash_set(x, h);
    restore_gen(x, 1, 8, b);
    st_image_free(x);
    x = NULL;
    free(scratch);

    /* 3. fp32 -> bf16 -> f16 -> fp32 through the conversions (which recompute a verified
     *    hash): each step restores and continues */
    assert_int_equal(st_image_clone(&x, fp), 0);
    uint32_t chain[] = {ST_CODEC_BF16, ST_CODEC_F16, ST_CODEC_FP32};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(st_migrate_image_recode(x, chain[i]), 0);
        restore_gen(x, 2, 4, b);
    }
    /* fp32 -> bf16 -> f16 -> fp32 is lossy, so the hash differs from the original's */
    assert_true(st_image_state_hash(x) != st_image_state_hash(fp));
    /* a conversion never makes unverifiable state pass: zeroed state keeps its old hash */
    uint64_t hx = st_image_state_hash(x);
    zero_live(x);
    assert_int_equal(st_migrate_image_recode(x, ST_CODEC_BF16), 0);
    assert_true(st_image_state_hash(x) == hx);
    rig_open(&q, g_model, &o);
    assert_int_equal(st_slot_restore(q.s, x), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "state hash"));
    rig_close(&q);
    st_image_free(x);

    /* 4. an image whose running state was zeroed is refused, in f16 too */
    zero_live(f16);
    rig_open(&q, g_model, &o);
    assert_int_equal(st_slot_restore(q.s, f16), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "state hash mismatch"));
    assert_int_equal(st_slot_n_tokens(q.s), 0);
    rig_close(&q);
    st_image_free(f16);
    st_image_free(fp);
    rig_close(&r);
}

/* The hash's block digests run on the pool: any thread count gives the same value, and it is
 * the value of the definition computed on one thread. */
static void test_state_hash_threads(void **state)
{
    (void)state;
    uint32_t toks[256], out[8];
    uint64_t n = et_tokens(toks, "The same conversation on one, two and three threads.");
    uint64_t ref = 0;
    for (uint32_t th = 1; th <= 3; th++) {
        st_engine_opts o = opts(th);
        rig r;
        rig_open(&r, g_model, &o);
        assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
        gen(r.s, 6, out, 0.0f);
        st_image *img = NULL;
        uint64_t h = 0, hs = 0;
        assert_int_equal(st_slot_snapshot(r.s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &img), 0);
        assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h), 0);
        assert_true(h == st_image_state_hash(img));
        assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_BF16, &hs), 0);
        assert_true(hs == h);
        if (th == 1)
            ref = h;
        assert_true(h == ref);
        restore_gen(img, 4 - th, 2, out);
        st_image_free(img);
        rig_close(&r);
    }
}

/* A model whose every layer keeps K/V (llama, qwen3) is cut at any position: a conversation that
 * diverges from the held one at token D reuses D tokens without a checkpoint there, and gives
 * the tokens, logits and state hash of a full read; a hybrid (qwen35) has no checkpoint at D and
 * reads everything (the control: a recurrent state cannot be cut). */
static void kv_cut_case(const char *arch, const char *preset, int kv_only)
{
    char path[4400];
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch(arch, preset, &hp), 0);
    snprintf(path, sizeof path, "%s/%s-%s.gguf", g_dir, arch, preset);
    assert_int_equal(st_model_write_seeded(&hp, 3, arch, path), 0);
    uint32_t c1[256], c2[256], g1[16], g2[16];
    uint64_t n1 = et_tokens(c1, "A first conversation, long enough to be cut in its middle: yes."), n2;
    memcpy(c2, c1, 37 * sizeof *c1);
    n2 = 37 + st_tokenize("X and then another way.", 23, c2 + 37, 200);
    assert_true(c2[37] != c1[37]);
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    rig r, fresh;
    rig_open(&r, path, &o);
    rig_open(&fresh, path, &o);
    st_eval_stats es;
    assert_int_equal(st_slot_eval(r.s, c1, n1, 0, &es), 0);
    gen(r.s, 8, g1, 0.0f);
    assert_int_equal(st_slot_eval(r.s, c2, n2, 0, &es), 0);
    assert_int_equal(es.reused, kv_only ? 37 : 0);
    assert_int_equal(es.computed, kv_only ? n2 - 37 : n2);
    assert_int_equal(es.mounted_at, kv_only ? 37 : UINT64_MAX);
    gen(r.s, 16, g1, 0.0f);
    assert_int_equal(st_slot_eval(fresh.s, c2, n2, 0, &es), 0);
    gen(fresh.s, 16, g2, 0.0f);
    assert_memory_equal(g1, g2, sizeof g1);
    uint32_t na, nb;
    const float *la = st_slot_logits(r.s, &na), *lb = st_slot_logits(fresh.s, &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(la, lb, na * sizeof *la);
    uint64_t ha = 0, hb = 0;
    assert_int_equal(st_slot_state_hash(r.s, ST_CODEC_FP32, &ha), 0);
    assert_int_equal(st_slot_state_hash(fresh.s, ST_CODEC_FP32, &hb), 0);
    assert_true(ha == hb);
    rig_close(&r);
    rig_close(&fresh);
}

/* st_slot_snapshot_prefix (the prefix index's points): a prefix image at a chunk end p, restored
 * into another engine's slot and read on from p, gives the logits, tokens and state hash of a
 * full read of the same prompt; without logits the slot takes no snapshot; refusals: p outside
 * the conversation, and a recurrent model with no checkpoint at p (a K/V-only one cuts anywhere). */
static void rig_reset_eval(rig *r, const uint32_t *t, uint64_t n)
{
    st_eval_stats es;
    st_slot_reset(r->s);
    assert_int_equal(st_slot_eval(r->s, t, n, 0, &es), 0);
}

static void prefix_case(const char *arch, const char *preset, int kv_only)
{
    char path[4400];
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch(arch, preset, &hp), 0);
    snprintf(path, sizeof path, "%s/pfx-%s-%s.gguf", g_dir, arch, preset);
    assert_int_equal(st_model_write_seeded(&hp, 5, arch, path), 0);
    uint32_t *c = et_prompt(100, 11), g1[12], g2[12];
    st_engine_opts o = opts(2);
    o.ubatch = 16;
    o.prompt_cache_every = 16;
    rig a, b, full;
    rig_open(&a, path, &o);
    rig_open(&b, path, &o);
    rig_open(&full, path, &o);
    st_eval_stats es;
    assert_int_equal(st_slot_eval(a.s, c, 70, 0, &es), 0);
    gen(a.s, 4, g1, 0.0f); /* decoded tokens after the prompt do not change rows below 64 */
    st_image *img = NULL;
    assert_int_equal(st_slot_snapshot_prefix(a.s, 0, ST_CODEC_FP32, &img), ST_EINVAL);
    assert_int_equal(st_slot_snapshot_prefix(a.s, 75, ST_CODEC_FP32, &img), ST_EINVAL);
    /* 40: no checkpoint (every 16: 16, 32, 48, 64) */
    assert_int_equal(st_slot_snapshot_prefix(a.s, 40, ST_CODEC_FP32, &img), kv_only ? 0 : ST_ENOTFOUND);
    st_image_free(img);
    img = NULL;
    assert_int_equal(st_slot_snapshot_prefix(a.s, 64, ST_CODEC_FP32, &img), 0);
    assert_int_equal(st_image_n_tokens(img), 64);
    uint32_t nl = 7;
    assert_null(st_image_logits(img, &nl));
    assert_int_equal(nl, 0);
    assert_int_equal(st_slot_restore(b.s, img), 0);
    assert_int_equal(st_slot_n_tokens(b.s), 64);
    assert_null(st_slot_logits(b.s, NULL));
    st_image *none = NULL;
    assert_int_equal(st_slot_snapshot(b.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &none), ST_EINVAL);
    assert_int_equal(st_slot_eval(b.s, c, 100, 0, &es), 0);
    assert_int_equal(es.reused, 64);
    assert_int_equal(st_slot_eval(full.s, c, 100, 0, &es), 0);
    assert_int_equal(es.reused, 0);
    uint32_t na, nb;
    const float *la = st_slot_logits(b.s, &na), *lb = st_slot_logits(full.s, &nb);
    assert_int_equal(na, nb);
    assert_memory_equal(la, lb, na * sizeof *la);
    uint64_t ha = 0, hb = 0;
    assert_int_equal(st_slot_state_hash(b.s, ST_CODEC_FP32, &ha), 0);
    assert_int_equal(st_slot_state_hash(full.s, ST_CODEC_FP32, &hb), 0);
    assert_true(ha == hb);
    gen(b.s, 12, g1, 0.0f);
    gen(full.s, 12, g2, 0.0f);
    assert_memory_equal(g1, g2, sizeof g1);
    /* negative control: the prefix of another prompt, read on, is not the full read */
    uint32_t *d = et_prompt(100, 12);
    memcpy(d + 64, c + 64, 36 * sizeof *d);
    rig_reset_eval(&a, d, 70);
    st_image *other = NULL;
    assert_int_equal(st_slot_snapshot_prefix(a.s, 64, ST_CODEC_FP32, &other), 0);
    assert_int_equal(st_slot_restore(b.s, other), 0);
    assert_int_equal(st_slot_eval(b.s, d, 100, 0, &es), 0);
    la = st_slot_logits(b.s, &na);
    assert_true(memcmp(la, lb, na * sizeof *la) != 0);
    st_image_free(other);
    st_image_free(img);
    free(c);
    free(d);
    rig_close(&a);
    rig_close(&b);
    rig_close(&full);
}

static void test_snapshot_prefix(void **state)
{
    (void)state;
    prefix_case("llama", "tiny-untied", 1);
    prefix_case("qwen35", "qwen35-tiny", 0);
    prefix_case("strata-hybrid", "tiny", 0);
}

static void test_kv_only_cut(void **state)
{
    (void)state;
    kv_cut_case("llama", "tiny-untied", 1);
    kv_cut_case("qwen3", "tiny-untied", 1);
    kv_cut_case("qwen35", "tiny", 0);
}

/* What a slot holds after a restore, for comparing two restores: its PARK bytes in bf16, its
 * state hash, its logits, then the tokens and logits of 12 greedy steps (the caller frees park). */
typedef struct after {
    uint8_t *park;
    size_t park_len;
    uint64_t hash;
    uint32_t toks[12];
    uint32_t n_vocab;
    float *logits[2];
} after;

static void after_free(after *a)
{
    free(a->park);
    free(a->logits[0]);
    free(a->logits[1]);
}

/* Read path as the server's LOAD does (into r's engine's image buffers), restore it into r,
 * and record what r holds and does next. */
static void load_run(rig *r, const char *path, after *out)
{
    st_file_read_opts ro = {.alloc = st_engine_image_allocator(r->e)};
    st_image *img = NULL;
    uint32_t nv;
    assert_int_equal(st_file_read(path, &ro, &img), 0);
    int rc = st_slot_restore(r->s, img);
    if (rc)
        fail_msg("restore %s: %s", path, st_errdetail());
    st_image_free(img);
    park_bytes(r->s, ST_CODEC_BF16, &out->park, &out->park_len);
    assert_int_equal(st_slot_state_hash(r->s, ST_CODEC_FP32, &out->hash), 0);
    for (int k = 0; k < 2; k++) {
        if (k)
            gen(r->s, 12, out->toks, 0.0f);
        const float *l = st_slot_logits(r->s, &nv);
        assert_non_null(l);
        assert_true(nv > 0);
        out->n_vocab = nv;
        out->logits[k] = malloc(nv * sizeof *l);
        assert_non_null(out->logits[k]);
        memcpy(out->logits[k], l, nv * sizeof *l);
    }
}

static int after_same(const after *a, const after *b)
{
    return a->park_len == b->park_len && !memcmp(a->park, b->park, a->park_len) &&
           a->hash == b->hash && !memcmp(a->toks, b->toks, sizeof a->toks) &&
           a->n_vocab == b->n_vocab &&
           !memcmp(a->logits[0], b->logits[0], a->n_vocab * sizeof *a->logits[0]) &&
           !memcmp(a->logits[1], b->logits[1], a->n_vocab * sizeof *a->logits[1]);
}

static uint64_t file_size(const char *path)
{
    struct stat sb;
    assert_int_equal(stat(path, &sb), 0);
    return (uint64_t)sb.st_size;
}

/* A bf16 session file with its checkpoints compressed (zstd level 1 shuffled, the level the
 * benchmarks measure; level 1 unshuffled; level 3 shuffled, statectl's default) restores, through
 * the server's SAVE / LOAD path (st_file_write of a SESSION snapshot; st_file_read into the
 * engine's image buffers, st_slot_restore into a slot holding another conversation), to the very
 * slot the uncompressed file restores to: the same PARK bytes, state hash and logits, and the
 * same tokens and logits after. Each file is smaller than the raw one and says its checkpoints
 * are compressed; the control: the file of the conversation one token on, compressed the same
 * way, restores to a slot that compares unequal. */
static void compressed_case(const char *model, uint32_t ubatch)
{
    uint32_t toks[512], g[4];
    uint64_t n = et_tokens(toks, "A conversation kept as a compressed session file, with a "
                                 "resume checkpoint or two of its running state on the way.");
    st_engine_opts o = opts(2);
    o.ubatch = ubatch;
    o.prompt_cache_every = ubatch;
    rig src, r;
    rig_open(&src, model, &o);
    rig_open(&r, model, &o);
    assert_int_equal(st_slot_eval(src.s, toks, n, 0, NULL), 0);
    gen(src.s, 3, g, 0.0f);
    assert_true(st_slot_n_checkpoints(src.s) > 1);
    char raw[4400], z[4400], ctl[4400];
    snprintf(raw, sizeof raw, "%s/zs-raw.stsf", g_dir);
    snprintf(z, sizeof z, "%s/zs-z.stsf", g_dir);
    snprintf(ctl, sizeof ctl, "%s/zs-ctl.stsf", g_dir);
    st_image *img = NULL;
    assert_int_equal(st_slot_snapshot(src.s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &img), 0);
    assert_int_equal(st_file_write(img, raw, NULL), 0);
    /* r holds another conversation (a longer one), so the LOADs below restore into its spares */
    assert_int_equal(st_slot_eval(r.s, toks, n, 0, NULL), 0);
    gen(r.s, 4, g, 0.0f);
    after ref, got;
    load_run(&r, raw, &ref);
    const st_file_write_opts zo[3] = {{.compress = 1, .shuffle = 1}, {.compress = 1},
                                      {.compress = 3, .shuffle = 1}};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(st_file_write(img, z, &zo[k]), 0);
        assert_true(file_size(z) < file_size(raw));
        st_file_info info;
        assert_int_equal(st_file_inspect(z, &info), 0);
        assert_true(info.all_ok);
        uint32_t nz = 0;
        for (uint32_t s = 0; s < info.n_sections; s++)
            nz += info.sections[s].type == ST_SECTION_CHECKPOINT && info.sections[s].compressed;
        assert_int_equal(nz, st_image_n_checkpoints(img));
        st_file_info_free(&info);
        load_run(&r, z, &got);
        if (!after_same(&ref, &got))
            fail_msg("compressed file (level %d, shuffle %d) restored to another slot",
                     zo[k].compress, zo[k].shuffle);
        after_free(&got);
    }
    /* the control: one token on, compressed, is not the same slot */
    uint32_t t;
    assert_int_equal(st_slot_sample(src.s, 0.0f, 1, &t), 0);
    assert_int_equal(st_slot_decode(src.s, t), 0);
    st_image_free(img);
    img = NULL;
    assert_int_equal(st_slot_snapshot(src.s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &img), 0);
    assert_int_equal(st_file_write(img, ctl, &zo[0]), 0);
    load_run(&r, ctl, &got);
    assert_false(after_same(&ref, &got));
    after_free(&got);
    after_free(&ref);
    st_image_free(img);
    unlink(raw);
    unlink(z);
    unlink(ctl);
    rig_close(&src);
    rig_close(&r);
}

static void test_compressed_session_file(void **state)
{
    (void)state;
    char path[4400];
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("qwen35", "tiny", &hp), 0);
    snprintf(path, sizeof path, "%s/zs-qwen35-tiny.gguf", g_dir);
    assert_int_equal(st_model_write_seeded(&hp, 5, "qwen35", path), 0);
    compressed_case(path, 8);
    compressed_case(g_big, 16);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_restore_identity),
        cmocka_unit_test(test_failed_restore_leaves_slot),
        cmocka_unit_test(test_prefix_reuse),
        cmocka_unit_test(test_cancel_between_chunks),
        cmocka_unit_test(test_periodic_and_park),
        cmocka_unit_test(test_cache_limits),
        cmocka_unit_test(test_state_hash_codecs),
        cmocka_unit_test(test_state_hash_threads),
        cmocka_unit_test(test_kv_only_cut),
        cmocka_unit_test(test_snapshot_prefix),
        cmocka_unit_test(test_bulk_bit_flips),
        cmocka_unit_test(test_image_cache_reuse),
        cmocka_unit_test(test_restore_into_spares),
        cmocka_unit_test(test_restore_adopt),
        cmocka_unit_test(test_held_bf16_block),
        cmocka_unit_test(test_compressed_session_file),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
