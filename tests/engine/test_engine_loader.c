/*
 * test_engine_loader.c - what the loader accepts and refuses in the files people bring:
 * split models (llama.cpp's gguf-split layout) give the logits of the unsplit file bit for bit
 * and llama.cpp v0.4.0 (tests/ref) agrees on them, and each inconsistency of the parts is
 * refused naming the part; MTP blocks are loaded and skipped (the logits, fingerprint and state
 * of the same model without them; llama.cpp agrees on the file with them); `strata info`
 * prints the fields docs/ENGINE.md lists; and a table of unsupported architectures, keys,
 * tensors and types, each refused naming it. A missing reference fails the test (`make deps`).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine_cli_test.h"

#define REF ST_TEST_DATA "/../ref"
#define TOKS "1,5,300,7,9,100,42,262,263,11,12"

/* The reference, or a failed test saying how to get it. */
static void need_ref(void)
{
    if (access(REF "/node_modules/node-llama-cpp/package.json", R_OK) != 0 ||
        st_test_run(out, sizeof out, "node --version") != 0)
        fail_msg("the llama.cpp reference is missing (tests/ref/node_modules, node): run `make "
                 "deps`");
}

static void path_of(char *dst, size_t cap, const char *name)
{
    snprintf(dst, cap, "%s/%s", g_dir, name);
}

/* strata logits (f32 K/V) of a model into NAME.st; llama.cpp's log-probabilities into NAME.ll
 * and their comparison (max |d log-prob| <= 1e-3) when ref. */
static void logits(const char *model, const char *name, int ref)
{
    sh(1, BIN "/strata logits -m %s/%s --kv-dtype f32 --threads 1 --tokens " TOKS
              " -o %s/%s.st 2>/dev/null", g_dir, model, g_dir, name);
    if (!ref)
        return;
    sh(1, "node " REF "/llama_logits.mjs -m %s/%s --tokens " TOKS " -o %s/%s.ll", g_dir, model,
       g_dir, name);
    sh(1, "node " REF "/compare_logits.mjs %s/%s.ll %s/%s.st --n-vocab 512 --quiet "
          "--max-dlogprob 1e-3", g_dir, name, g_dir, name);
    fprintf(stderr, "%s: %s", model, out);
}

static const uint8_t *fingerprint_of(const char *name, uint8_t fp[ST_FINGERPRINT_LEN])
{
    char p[4200];
    st_model *m = NULL;
    path_of(p, sizeof p, name);
    assert_int_equal(st_model_load(p, &m), 0);
    memcpy(fp, st_model_fingerprint(m), ST_FINGERPRINT_LEN);
    st_model_free(m);
    return fp;
}

/* st_model_load of g_dir/name fails with rc and a detail holding want. */
static void refused(const char *name, int rc, const char *want)
{
    char p[4200];
    st_model *m = NULL;
    path_of(p, sizeof p, name);
    int got = st_model_load(p, &m);
    assert_null(m);
    if (got != rc || !strstr(st_errdetail(), want))
        fail_msg("%s: rc %d (want %d), detail \"%s\" (want \"%s\")", name, got, rc,
                 st_errdetail(), want);
}

/* ---- split models -------------------------------------------------------------------------- */
static void test_split_same_logits(void **state)
{
    (void)state;
    need_ref();
    uint8_t a[ST_FINGERPRINT_LEN], b[ST_FINGERPRINT_LEN];
    for (int tied = 0; tied < 2; tied++) {
        const char *preset = tied ? "qwen35-tiny-tied" : "qwen35-tiny";
        sh(1, BIN "/strata-mkmodel --arch qwen35 --preset %s --ctx 256 -o %s/one.gguf "
                  "2>/dev/null && " BIN "/strata-mkmodel --arch qwen35 --preset %s --ctx 256 "
                  "--split-max-tensors 7 -o %s/sp.gguf 2>/dev/null", preset, g_dir, preset,
           g_dir);
        sh(1, "ls %s/sp-*-of-*.gguf | wc -l", g_dir);
        uint32_t n = (uint32_t)strtoul(out, NULL, 10);
        assert_true(n == 8);
        char first[64];
        snprintf(first, sizeof first, "sp-00001-of-%05u.gguf", n);
        logits("one.gguf", "one", 0);
        logits(first, "sp", 1);
        sh(1, "cmp %s/one.st %s/sp.st", g_dir, g_dir);
        assert_memory_equal(fingerprint_of("one.gguf", a), fingerprint_of(first, b),
                            ST_FINGERPRINT_LEN);
        sh(1, "rm -f %s/sp-*.gguf", g_dir);
    }
    /* a llama model split one tensor a part; strata quantize reads it whole */
    sh(1, BIN "/strata-mkmodel --arch llama --preset tiny --ctx 256 -o %s/one.gguf 2>/dev/null "
              "&& " BIN "/strata-mkmodel --arch llama --preset tiny --ctx 256 "
              "--split-max-tensors 1 -o %s/ll 2>/dev/null", g_dir, g_dir);
    sh(1, "ls %s/ll-*-of-*.gguf | wc -l", g_dir);
    uint32_t n = (uint32_t)strtoul(out, NULL, 10);
    char first[64];
    snprintf(first, sizeof first, "ll-00001-of-%05u.gguf", n);
    logits("one.gguf", "one", 0);
    logits(first, "ll", 1);
    sh(1, "cmp %s/one.st %s/ll.st", g_dir, g_dir);
    sh(1, BIN "/strata quantize %s/%s %s/whole.gguf f32 2>/dev/null", g_dir, first, g_dir);
    logits("whole.gguf", "whole", 0);
    sh(1, "cmp %s/one.st %s/whole.st", g_dir, g_dir);
    sh(1, "rm -f %s/ll-*.gguf", g_dir);
}

/* A copy of part `src` (a file of g_dir) as `dst`, its split.no / split.count set (0: kept),
 * general.architecture added (NULL: not), and its first tensor renamed (NULL: kept). */
static void craft_part(const char *src, const char *dst, uint32_t no, uint32_t count,
                       const char *arch, const char *rename)
{
    char p[4200];
    size_t len = 0;
    uint8_t *buf = slurp(src, &len);
    st_gguf *g = NULL;
    assert_int_equal(st_gguf_open_mem(buf, len, &g), 0);
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_writer_new(&w, st_gguf_alignment(g)), 0);
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (!strcmp(k, "general.alignment") || (no && !strcmp(k, "split.no")) ||
            (count && !strcmp(k, "split.count")))
            continue;
        assert_int_equal(st_gguf_writer_copy_kv(w, g, i), 0);
    }
    if (no)
        assert_int_equal(st_gguf_writer_set_u32(w, "split.no", no), 0);
    if (count)
        assert_int_equal(st_gguf_writer_set_u32(w, "split.count", count), 0);
    if (arch)
        assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", arch), 0);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        assert_int_equal(st_gguf_writer_add_tensor(w, i == 0 && rename ? rename : t->name,
                                                   t->type, t->n_dims, t->dims, t->data), 0);
    }
    path_of(p, sizeof p, dst);
    assert_int_equal(st_gguf_writer_write(w, p), 0);
    st_gguf_writer_free(w);
    st_gguf_close(g);
    free(buf);
}

static void test_split_refusals(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --split-max-tensors 20 -o "
              "%s/a.gguf 2>/dev/null && " BIN "/strata-mkmodel --arch qwen35 --preset "
              "qwen35-tiny-tied --split-max-tensors 20 -o %s/t.gguf 2>/dev/null", g_dir, g_dir);
    const char *a1 = "a-00001-of-00003.gguf";
    st_model *m = NULL;
    char p[4200];
    path_of(p, sizeof p, a1);
    assert_int_equal(st_model_load(p, &m), 0);
    st_model_free(m);
    /* a later part given */
    refused("a-00002-of-00003.gguf", ST_EINVAL, "is part 2 of 3 of a split model");
    /* the first part under another name: the parts are found by name */
    sh(1, "cp %s/%s %s/renamed.gguf", g_dir, a1, g_dir);
    refused("renamed.gguf", ST_EINVAL, "does not end in -00001-of-00003.gguf");
    /* a part missing */
    sh(1, "mv %s/a-00003-of-00003.gguf %s/keep3", g_dir, g_dir);
    refused(a1, ENOENT, "part 3 of 3 missing or unreadable");
    assert_non_null(strstr(st_errdetail(), "a-00003-of-00003.gguf"));
    /* a part of another model (one tensor fewer: split.tensors.count differs) */
    sh(1, "cp %s/t-00003-of-00003.gguf %s/a-00003-of-00003.gguf", g_dir, g_dir);
    refused(a1, ST_EINVAL, "a part of another model");
    assert_non_null(strstr(st_errdetail(), "a-00003-of-00003.gguf"));
    sh(1, "mv %s/keep3 %s/a-00003-of-00003.gguf", g_dir, g_dir);
    sh(1, "cp %s/a-00002-of-00003.gguf %s/keep2", g_dir, g_dir);
    /* split.no of another part, split.count of another split, another architecture */
    craft_part("keep2", "a-00002-of-00003.gguf", 2, 0, NULL, NULL);
    refused(a1, ST_EINVAL, "has split.no 2, expected 1");
    craft_part("keep2", "a-00002-of-00003.gguf", 0, 4, NULL, NULL);
    refused(a1, ST_EINVAL, "says 4 parts");
    craft_part("keep2", "a-00002-of-00003.gguf", 0, 0, "llama", NULL);
    refused(a1, ST_EINVAL, "has another general.architecture");
    /* a tensor in two parts */
    craft_part("keep2", "a-00002-of-00003.gguf", 0, 0, NULL, "token_embd.weight");
    refused(a1, ST_EINVAL, "tensor token_embd.weight is in part 1 and in part 2");
    /* a part whose tensors are fewer than split.tensors.count says */
    sh(1, "cp %s/keep2 %s/a-00002-of-00003.gguf", g_dir, g_dir);
    path_of(p, sizeof p, a1);
    assert_int_equal(st_model_load(p, &m), 0);
    st_model_free(m);
    /* split.count 1 alone is one file, as llama.cpp reads it (the other split keys unread) */
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny -o %s/one.gguf 2>/dev/null",
       g_dir);
    craft_part("one.gguf", "count1.gguf", 0, 1, NULL, NULL);
    path_of(p, sizeof p, "count1.gguf");
    assert_int_equal(st_model_load(p, &m), 0);
    st_model_free(m);
    sh(1, "rm -f %s/a-* %s/t-* %s/keep2 %s/renamed.gguf %s/count1.gguf", g_dir, g_dir, g_dir,
       g_dir, g_dir);
}

/* ---- MTP blocks ---------------------------------------------------------------------------- */
static void test_mtp_skipped(void **state)
{
    (void)state;
    need_ref();
    uint8_t a[ST_FINGERPRINT_LEN], b[ST_FINGERPRINT_LEN];
    static const char *const cases[][2] = {
        {"qwen35", "qwen35-tiny"}, {"qwen35moe", "qwen35moe-tiny"}, {"qwen3next", "qwen3next-tiny"}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *arch = cases[i][0], *preset = cases[i][1];
        uint32_t nextn = i == 0 ? 2 : 1;
        sh(1, BIN "/strata-mkmodel --arch %s --preset %s --ctx 256 -o %s/plain.gguf "
                  "2>/dev/null && " BIN "/strata-mkmodel --arch %s --preset %s --ctx 256 "
                  "--nextn %u -o %s/mtp.gguf 2>/dev/null", arch, preset, g_dir, arch, preset,
           nextn, g_dir);
        logits("plain.gguf", "plain", 0);
        logits("mtp.gguf", "mtp", 1); /* llama.cpp on the file with MTP blocks */
        sh(1, "cmp %s/plain.st %s/mtp.st", g_dir, g_dir);
        assert_memory_equal(fingerprint_of("plain.gguf", a), fingerprint_of("mtp.gguf", b),
                            ST_FINGERPRINT_LEN);
        char p[4200];
        st_model *m = NULL;
        path_of(p, sizeof p, "mtp.gguf");
        assert_int_equal(st_model_load(p, &m), 0);
        const st_model_hparams *hp = st_model_hparams_get(m);
        assert_int_equal(hp->n_layer, 4);
        assert_int_equal(hp->n_nextn, nextn);
        st_model_free(m);
    }
    /* a session of the file with MTP blocks restores under the file without (one model) */
    sh(1, BIN "/strata generate -m %s/mtp.gguf -p 'mtp' -n 5 --tokens --ignore-eos "
              "--session-out %s/s.stsf > /dev/null 2>&1 && " BIN "/strata generate -m "
              "%s/plain.gguf -p 'more' -n 3 --tokens --ignore-eos --session-in %s/s.stsf "
              "> /dev/null", g_dir, g_dir, g_dir, g_dir);
    /* the architectures without MTP blocks refuse them */
    sh(0, BIN "/strata-mkmodel --arch llama --preset tiny --nextn 1 -o %s/x.gguf", g_dir);
    assert_non_null(strstr(out, "the llama architecture has no MTP blocks"));
    sh(0, BIN "/strata-mkmodel --preset tiny --nextn 1 -o %s/x.gguf", g_dir);
    assert_non_null(strstr(out, "has no MTP blocks"));
}

/* ---- strata info --------------------------------------------------------------------------- */
static void test_info(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --nextn 1 "
              "--split-max-tensors 40 -o %s/i.gguf 2>/dev/null", g_dir);
    sh(1, BIN "/strata info -m %s/i-00001-of-00002.gguf", g_dir);
    static const char *const want[] = {
        "architecture qwen35\n",
        "layers       4, pattern DDDA\n",
        "kinds        DDDA (3 deltanet, 1 attention)\n",
        "types        f32 70 tensors ",
        "state        16904 B per checkpoint, K/V 256 B per token\n",
        "kv-per-token f16 256 B, f32 512 B, i8 144 B (f32: cpu backend only)\n",
        "mtp          1 blocks skipped (blk.4..blk.4: 14 tensors, ",
        "parts        2: ",
        "i-00001-of-00002.gguf 40 tensors ",
        "i-00002-of-00002.gguf 30 tensors ",
    };
    for (size_t i = 0; i < sizeof want / sizeof want[0]; i++)
        if (!strstr(out, want[i]))
            fail_msg("strata info lacks \"%s\":\n%s", want[i], out);
    sh(1, BIN "/strata-mkmodel --arch llama --preset tiny -o %s/l.gguf 2>/dev/null && "
              BIN "/strata info -m %s/l.gguf", g_dir, g_dir);
    assert_non_null(strstr(out, "mtp          none\n"));
    assert_non_null(strstr(out, "parts        1: "));
    sh(1, "rm -f %s/i-* %s/l.gguf", g_dir, g_dir);
}

/* ---- refusals ------------------------------------------------------------------------------ */
/* A copy of g_dir/src as g_dir/dst without key `drop` and tensor `tdrop`, with key `key` set to
 * the string sval (or the u32 uval when sval is NULL) and a tensor `tadd` (the bytes of
 * output_norm.weight); NULL leaves each out. */
typedef struct mut {
    const char *name, *src;
    const char *drop, *key, *sval;
    uint32_t uval;
    const char *tdrop, *tadd;
    uint32_t type_of_first; /* not 0: the first tensor's ggml type id patched to this (f32 size) */
    int rc;
    const char *want;
} mut;

static void rewrite(const mut *c, const char *dst)
{
    char p[4200];
    st_gguf *g = NULL;
    path_of(p, sizeof p, c->src);
    assert_int_equal(st_gguf_open(p, &g), 0);
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_writer_new(&w, st_gguf_alignment(g)), 0);
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (!strcmp(k, "general.alignment") || (c->drop && !strcmp(k, c->drop)) ||
            (c->key && !strcmp(k, c->key)))
            continue;
        assert_int_equal(st_gguf_writer_copy_kv(w, g, i), 0);
    }
    if (c->key && c->sval)
        assert_int_equal(st_gguf_writer_set_str(w, c->key, c->sval), 0);
    else if (c->key)
        assert_int_equal(st_gguf_writer_set_u32(w, c->key, c->uval), 0);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        if (c->tdrop && !strcmp(t->name, c->tdrop))
            continue;
        assert_int_equal(st_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->dims,
                                                   t->data), 0);
    }
    if (c->tadd) {
        const st_gguf_tensor *t = st_gguf_tensor_find(g, "output_norm.weight");
        assert_int_equal(st_gguf_writer_add_tensor(w, c->tadd, t->type, t->n_dims, t->dims,
                                                   t->data), 0);
    }
    path_of(p, sizeof p, dst);
    assert_int_equal(st_gguf_writer_write(w, p), 0);
    st_gguf_writer_free(w);
    st_gguf_close(g);
    if (!c->type_of_first)
        return;
    /* the first tensor's info: name, n_dims, dims, then the type (u32) */
    size_t len = 0;
    uint8_t *buf = st_test_slurp(p, &len);
    assert_non_null(buf);
    const char *tn = "token_embd.weight";
    uint8_t *at = NULL;
    for (size_t i = 8; i + strlen(tn) < len && !at; i++)
        if (!memcmp(buf + i, tn, strlen(tn)) && buf[i - 8] == strlen(tn))
            at = buf + i + strlen(tn);
    assert_non_null(at);
    uint32_t nd;
    memcpy(&nd, at, 4);
    memcpy(at + 4 + 8 * nd, &c->type_of_first, 4);
    assert_int_equal(st_test_spit(p, buf, len), 0);
    free(buf);
}

static void test_refusal_table(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny -o %s/q.gguf 2>/dev/null && "
              BIN "/strata-mkmodel --arch llama --preset tiny -o %s/l.gguf 2>/dev/null && "
              BIN "/strata-mkmodel --arch qwen3next --preset qwen3next-tiny -o %s/n.gguf "
              "2>/dev/null", g_dir, g_dir, g_dir);
    static const mut cases[] = {
        {"unknown architecture", "q.gguf", NULL, "general.architecture", "mamba2", 0, NULL, NULL,
         0, ST_EINVAL, "architecture \"mamba2\" is not supported"},
        {"no architecture", "q.gguf", "general.architecture", NULL, NULL, 0, NULL, NULL, 0,
         ST_EINVAL, "general.architecture missing"},
        {"architecture not a string", "l.gguf", NULL, "general.architecture", NULL, 7, NULL,
         NULL, 0, ST_ECORRUPT, "general.architecture has type u32, not a string"},
        {"required key", "q.gguf", "qwen35.embedding_length", NULL, NULL, 0, NULL, NULL, 0,
         ST_EINVAL, "qwen35.embedding_length missing"},
        {"required key (llama)", "l.gguf", "llama.context_length", NULL, NULL, 0, NULL, NULL, 0,
         ST_EINVAL, "llama.context_length missing"},
        {"rms epsilon", "n.gguf", "qwen3next.attention.layer_norm_rms_epsilon", NULL, NULL, 0,
         NULL, NULL, 0, ST_EINVAL, "qwen3next.attention.layer_norm_rms_epsilon missing"},
        {"M-RoPE sections", "q.gguf", "qwen35.rope.dimension_sections", NULL, NULL, 0, NULL,
         NULL, 0, ST_EINVAL, "qwen35.rope.dimension_sections missing"},
        {"vocabulary", "l.gguf", "tokenizer.ggml.tokens", NULL, NULL, 0, NULL, NULL, 0,
         ST_EINVAL, "tokenizer.ggml.tokens"},
        {"key of another type", "q.gguf", NULL, "qwen35.block_count", "4", 0, NULL, NULL, 0,
         ST_ECORRUPT, "qwen35.block_count has type string"},
        {"YaRN", "l.gguf", NULL, "llama.rope.scaling.type", "yarn", 0, NULL, NULL, 0, ST_EINVAL,
         "llama.rope.scaling.type \"yarn\" is not supported"},
        {"recurrent_layers", "q.gguf", NULL, "qwen35.attention.recurrent_layers", NULL, 1, NULL,
         NULL, 0, ST_EINVAL, "qwen35.attention.recurrent_layers is not supported"},
        {"experts in a dense arch", "q.gguf", NULL, "qwen35.expert_count", NULL, 8, NULL, NULL,
         0, ST_EINVAL, "qwen35.expert_count"},
        {"MTP on llama", "l.gguf", NULL, "llama.nextn_predict_layers", NULL, 1, NULL, NULL, 0,
         ST_EINVAL, "llama.nextn_predict_layers 1: MTP blocks are not supported"},
        {"MTP >= block_count", "q.gguf", NULL, "qwen35.nextn_predict_layers", NULL, 4, NULL,
         NULL, 0, ST_EINVAL, "block_count 4 with 4 MTP blocks"},
        {"conv kernel", "q.gguf", NULL, "qwen35.ssm.conv_kernel", NULL, 3, NULL, NULL, 0,
         ST_EINVAL, "ssm.conv_kernel 3"},
        {"unknown tensor", "l.gguf", NULL, NULL, NULL, 0, NULL, "blk.0.attn_q.bias", 0,
         ST_EINVAL, "tensor blk.0.attn_q.bias is not supported by the llama architecture"},
        {"a block past block_count", "q.gguf", NULL, NULL, NULL, 0, NULL,
         "blk.4.attn_norm.weight", 0, ST_EINVAL,
         "tensor blk.4.attn_norm.weight is not supported by the qwen35 architecture"},
        {"missing tensor", "q.gguf", NULL, NULL, NULL, 0, "blk.1.ssm_a", NULL, 0, ST_EINVAL,
         "tensor blk.1.ssm_a missing"},
        {"unknown ggml type id", "q.gguf", NULL, NULL, NULL, 0, NULL, NULL, 99, ST_ECORRUPT,
         "tensor \"token_embd.weight\": unknown ggml type 99"},
        {"a ggml type no weight has", "q.gguf", NULL, NULL, NULL, 0, NULL, NULL, 26, ST_EINVAL,
         "tensor token_embd.weight has type i32"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const mut *c = &cases[i];
        rewrite(c, "bad.gguf");
        char p[4200];
        st_model *m = NULL;
        path_of(p, sizeof p, "bad.gguf");
        int rc = st_model_load(p, &m);
        assert_null(m);
        if (rc != c->rc || !strstr(st_errdetail(), c->want))
            fail_msg("%s: rc %d (want %d), detail \"%s\" (want \"%s\")", c->name, rc, c->rc,
                     st_errdetail(), c->want);
        /* the CLI says the same */
        sh(0, BIN "/strata info -m %s/bad.gguf", g_dir);
        if (!strstr(out, c->want))
            fail_msg("%s: strata info says \"%s\"", c->name, out);
    }
    /* the unmodified copies load (the rewrite itself changes nothing) */
    static const mut same[] = {{"q", "q.gguf", 0, 0, 0, 0, 0, 0, 0, 0, 0},
                               {"l", "l.gguf", 0, 0, 0, 0, 0, 0, 0, 0, 0}};
    for (size_t i = 0; i < 2; i++) {
        rewrite(&same[i], "ok.gguf");
        sh(1, BIN "/strata info -m %s/ok.gguf", g_dir);
    }
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(g_dir, sizeof g_dir, "test_engine_loader");
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
        cmocka_unit_test(test_split_same_logits),
        cmocka_unit_test(test_split_refusals),
        cmocka_unit_test(test_mtp_skipped),
        cmocka_unit_test(test_info),
        cmocka_unit_test(test_refusal_table),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
