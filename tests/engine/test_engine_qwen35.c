/*
 * test_engine_qwen35.c - the qwen35 architecture against llama.cpp v0.4.0 (tests/ref, node-llama-cpp
 * 3.21.1, F32 K/V, flash attention off) on seeded models with key heads != value heads
 * (qwen35-tiny: Hk 2, Hv 4; qwen35-tiny-tied): per-position log-probabilities over the whole
 * vocabulary within 1e-3 for F32, F16 and BF16 weights (f16 / bf16 against llama.cpp on the F32
 * twin holding the same values: llama.cpp rounds activations for such weights, the engine
 * computes in float) and three prompts; the negative control runs the same forward pass with
 * the value -> key head mapping swapped (tiled -> grouped) and must fail the comparison.
 * Exactness: N tokens in one process equal k, a session file, N - k in a new process (tokens
 * and final logits, fp32); a bf16 session restores and statectl diff reports its error.
 * Without the reference (tests/ref/node_modules) the comparisons fail: `make deps`.
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
#include "st_arch_int.h"

#define REF ST_TEST_DATA "/../ref"

static const char *const k_prompts[] = {
    "1,5,300,7,9,100,42",
    "262,263,264,11,12,13,14,15,16,17,18,19,20,21,22,23,24,25,26,27,28,29,30,31,32,33,34,35,36",
    ("511,0,255,256,257,258,259,260,261,262,263,264,265,266,300,301,302,303,304,305,306,307,308,"
     "309,310,311,312,313,314,315,316,317,318,319,320,321,322,323,324,325,326,327,328,329,330"),
};

/* The reference, or a failed test saying how to get it (a comparison never skips). */
static void need_ref(void)
{
    if (access(REF "/node_modules/node-llama-cpp/package.json", R_OK) != 0 ||
        st_test_run(out, sizeof out, "node --version") != 0)
        fail_msg("the llama.cpp reference is missing (tests/ref/node_modules, node): run `make "
                 "deps`");
}

/* The white-box forward pass of strata logits (one token at a time, f32 K/V, one thread), on
 * the CPU operations with the delta rule's head mapping flipped when wrong. */
static void (*g_delta_rule)(void *oc, const st_dn_args *a);
static void delta_rule_flipped(void *oc, const st_dn_args *a)
{
    st_dn_args b = *a;
    b.grouped = !b.grouped;
    g_delta_rule(oc, &b);
}

static void logits_white_box(const char *model, const char *tokens, int wrong, const char *path)
{
    st_model *m = NULL;
    st_pool *pool = NULL;
    st_ops_cpu *oc = NULL;
    st_kvmem *kv = NULL;
    st_recmem *rec = NULL;
    void *ws = NULL;
    st_kern kern = {st_kern_cpu_has_avx2(), 0, 0};
    st_ops ops = st_ops_cpu_table;
    g_delta_rule = ops.delta_rule;
    if (wrong)
        ops.delta_rule = delta_rule_flipped;
    assert_int_equal(st_model_load(model, &m), 0);
    uint32_t n_ctx = 256, V = m->hp.n_vocab;
    assert_int_equal(st_pool_new(1, &pool), 0);
    assert_int_equal(st_ops_cpu_new(&kern, pool, &m->mem, n_ctx, 1, 0, &oc), 0);
    assert_int_equal(st_kvmem_new(&m->mem, n_ctx, 256, ST_DTYPE_F32, &kv), 0);
    assert_int_equal(st_recmem_new(&m->mem, &rec), 0);
    assert_int_equal(m->arch->fwd_new(m, &ops, oc, 1, &ws), 0);
    float *logits = malloc((size_t)V * sizeof *logits);
    FILE *f = fopen(path, "wb");
    assert_non_null(logits);
    assert_non_null(f);
    const char *p = tokens;
    for (uint64_t pos = 0; *p; pos++) {
        char *end;
        uint32_t tok = (uint32_t)strtoul(p, &end, 10);
        p = *end == ',' ? end + 1 : end;
        assert_int_equal(st_kvmem_reserve(kv, pos, pos + 1), 0);
        st_fwd fw = {.m = m, .ops = &ops, .oc = oc, .tokens = &tok, .T = 1, .pos0 = pos,
                     .logits = logits};
        st_fwd_host hm;
        st_fwd_host_mem(&fw, &hm, kv, rec);
        m->arch->forward(&fw, ws);
        assert_int_equal(fwrite(logits, sizeof *logits, V, f), V);
    }
    assert_int_equal(fclose(f), 0);
    free(logits);
    m->arch->fwd_free(ws);
    st_recmem_free(rec);
    st_kvmem_free(kv);
    st_ops_cpu_free(oc);
    st_pool_free(pool);
    st_model_free(m);
}

static void compare_arch(const char *arch, const char *preset, const char *wtype)
{
    char mk[512];
    snprintf(mk, sizeof mk, BIN "/strata-mkmodel --arch %s --preset %s --wtype %s --ctx 256",
             arch, preset, wtype);
    sh(1, "%s -o %s/m.gguf 2>/dev/null && %s --f32-twin -o %s/twin.gguf 2>/dev/null", mk, g_dir,
       mk, g_dir);
    for (size_t i = 0; i < sizeof k_prompts / sizeof k_prompts[0]; i++) {
        sh(1, "node " REF "/llama_logits.mjs -m %s/twin.gguf --tokens %s -o %s/ref.bin", g_dir,
           k_prompts[i], g_dir);
        sh(1, BIN "/strata logits -m %s/m.gguf --kv-dtype f32 --tokens %s -o %s/eng.bin "
                  "2>/dev/null", g_dir, k_prompts[i], g_dir);
        sh(1, "node " REF "/compare_logits.mjs %s/ref.bin %s/eng.bin --n-vocab 512 --quiet "
              "--max-dlogprob 1e-3", g_dir, g_dir);
        fprintf(stderr, "%s %s prompt %zu: %s", preset, wtype, i, out);
    }
}

static void compare(const char *preset, const char *wtype)
{
    compare_arch("qwen35", preset, wtype);
}

/* qwen35moe and qwen3next (grouped head mapping, fused ssm_ba, MoE; attn_qkv and legacy
 * ssm_in), F32 and BF16. */
static void test_ref_moe_next(void **state)
{
    (void)state;
    need_ref();
    compare_arch("qwen35moe", "qwen35moe-tiny", "f32");
    compare_arch("qwen3next", "qwen3next-tiny", "f32");
    compare_arch("qwen3next", "qwen3next-tiny-legacy", "f32");
    compare_arch("qwen3next", "qwen3next-tiny", "bf16");
}

static void test_ref_f32(void **state)
{
    (void)state;
    need_ref();
    compare("qwen35-tiny", "f32");
    compare("qwen35-tiny-tied", "f32");
}

static void test_ref_f16(void **state)
{
    (void)state;
    need_ref();
    compare("qwen35-tiny", "f16");
}

static void test_ref_bf16(void **state)
{
    (void)state;
    need_ref();
    compare("qwen35-tiny", "bf16");
}

/* The white-box pass is strata logits bit for bit; with the head mapping swapped it fails the
 * comparison by a wide margin. */
static void test_wrong_head_mapping(void **state)
{
    (void)state;
    need_ref();
    char path[4200];
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --ctx 256 -o %s/m.gguf "
              "2>/dev/null", g_dir);
    snprintf(path, sizeof path, "%s/m.gguf", g_dir);
    const char *toks = k_prompts[1];
    sh(1, "node " REF "/llama_logits.mjs -m %s/m.gguf --tokens %s -o %s/ref.bin", g_dir, toks,
       g_dir);
    sh(1, BIN "/strata logits -m %s/m.gguf --kv-dtype f32 --threads 1 --tokens %s -o "
              "%s/eng.bin 2>/dev/null", g_dir, toks, g_dir);
    char wb[4200], bad[4200];
    snprintf(wb, sizeof wb, "%s/wb.bin", g_dir);
    snprintf(bad, sizeof bad, "%s/bad.bin", g_dir);
    logits_white_box(path, toks, 0, wb);
    logits_white_box(path, toks, 1, bad);
    sh(1, "cmp %s/eng.bin %s/wb.bin", g_dir, g_dir);
    sh(1, "node " REF "/compare_logits.mjs %s/ref.bin %s/wb.bin --n-vocab 512 --quiet", g_dir,
       g_dir);
    sh(0, "node " REF "/compare_logits.mjs %s/ref.bin %s/bad.bin --n-vocab 512 --quiet "
          "--max-dlogprob 0.1", g_dir, g_dir);
    fprintf(stderr, "swapped head mapping: %s", out);
}

/* N tokens in one process equal k, a session file, then N - k in another (tokens and final
 * logits bit for bit); a bf16 session restores, and statectl diff reports its error. */
static void test_session_exact(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --ctx 512 -o %s/s.gguf "
              "2>/dev/null", g_dir);
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate -m %s/s.gguf --temp 0.8 --seed 3 --ignore-eos "
             "--tokens -p 'qwen35 state'", g_dir);
    sh(1, "%s -n 40 --dump-logits %s/a.bin > %s/a.txt 2>/dev/null", g, g_dir, g_dir);
    sh(1, "%s -n 17 --threads 1 --session-out %s/s.stsf > %s/b1.txt 2>/dev/null", g, g_dir,
       g_dir);
    sh(1, BIN "/strata generate -m %s/s.gguf --temp 0.8 --seed 3 --ignore-eos --tokens -n 23 "
              "--scalar --session-in %s/s.stsf --dump-logits %s/b.bin > %s/b2.txt 2>/dev/null",
       g_dir, g_dir, g_dir, g_dir);
    size_t la, l1, l2, lfa, lfb;
    unsigned char *a = slurp("a.txt", &la), *b1 = slurp("b1.txt", &l1), *b2 = slurp("b2.txt", &l2);
    char joined[8192];
    snprintf(joined, sizeof joined, "%.*s %.*s", (int)l1 - 1, (const char *)b1, (int)l2,
             (const char *)b2);
    assert_int_equal(la, strlen(joined));
    assert_memory_equal(a, joined, la);
    unsigned char *fa = slurp("a.bin", &lfa), *fb = slurp("b.bin", &lfb);
    assert_int_equal(lfa, 512 * 4);
    assert_int_equal(lfa, lfb);
    assert_memory_equal(fa, fb, lfa);
    free(a);
    free(b1);
    free(b2);
    free(fa);
    free(fb);
    sh(1, "%s -n 17 --session-out %s/h.stsf --session-state-codec bf16 >/dev/null 2>&1", g, g_dir);
    sh(1, BIN "/strata generate -m %s/s.gguf -n 5 --ignore-eos --session-in %s/h.stsf --tokens",
       g_dir, g_dir);
    assert_non_null(strstr(out, "restored"));
    if (access(BIN "/statectl", X_OK) == 0) {
        int rc = st_test_run(out, sizeof out, BIN "/statectl diff %s/s.stsf %s/h.stsf", g_dir,
                             g_dir);
        if (rc != 1)
            fail_msg("statectl diff exited %d:\n%s", rc, out);
        assert_non_null(strstr(out, "largest relative error"));
        fprintf(stderr, "bf16 DeltaNet state:\n%s", out);
    }
    /* a strata-hybrid session is refused by the qwen35 model, naming the difference */
    sh(1, BIN "/strata-mkmodel --preset tiny -o %s/h.gguf 2>/dev/null && " BIN "/strata generate "
              "-m %s/h.gguf -p x -n 2 --session-out %s/hy.stsf >/dev/null 2>&1", g_dir, g_dir,
       g_dir);
    sh(0, BIN "/strata generate -m %s/s.gguf -n 1 --session-in %s/hy.stsf", g_dir, g_dir);
}

/* The loader refuses what it does not run, naming it; info shows the layer kinds. */
static void test_info_and_refusals(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny-tied -o %s/t.gguf 2>/dev/null "
              "&& " BIN "/strata info -m %s/t.gguf", g_dir, g_dir);
    assert_non_null(strstr(out, "architecture qwen35"));
    assert_non_null(strstr(out, "DDDA"));
    sh(0, BIN "/strata-mkmodel --arch qwen35 --preset nope -o %s/x.gguf", g_dir);
    assert_non_null(strstr(out, "qwen35-tiny"));
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "engine_qwen35");
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
        cmocka_unit_test(test_ref_f32),
        cmocka_unit_test(test_ref_f16),
        cmocka_unit_test(test_ref_bf16),
        cmocka_unit_test(test_ref_moe_next),
        cmocka_unit_test(test_wrong_head_mapping),
        cmocka_unit_test(test_session_exact),
        cmocka_unit_test(test_info_and_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
