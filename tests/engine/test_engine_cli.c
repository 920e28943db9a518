/*
 * test_engine_cli.c - the real binaries across processes: N tokens in one run equal k tokens,
 * --session-out, a new process with --session-in, N - k tokens (text, tokens and final logits
 * bit-identical) for fp32; bf16 completes (and statectl diff reports figures where it is built);
 * another model and another geometry are refused with messages naming the difference; a damaged
 * model file is a clear error; strata logits (teacher forcing) and f32 K/V sessions.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "engine_cli_test.h"

static void test_identity_fp32(void **state)
{
    const char *gen = BIN "/strata generate -m %s/m.gguf --temp 0.8 --seed 5 --ignore-eos "
                          "--threads 2";
    char g[8192];
    snprintf(g, sizeof g, gen, g_dir);
    const char *p = "-p 'Hello, Strata. Continue this.'";
    /* text */
    sh(1, "%s %s -n 30 --dump-logits %s/a.bin > %s/a.txt 2> %s/a.err", g, p, g_dir, g_dir, g_dir);
    sh(1, "%s %s -n 11 --session-out %s/s.stsf > %s/b1.txt 2> %s/b1.err", g, p, g_dir, g_dir,
       g_dir);
    sh(1, "%s -n 19 --session-in %s/s.stsf --dump-logits %s/b.bin > %s/b2.txt 2> %s/b2.err", g,
       g_dir, g_dir, g_dir, g_dir);
    size_t la, l1, l2, lla, llb;
    unsigned char *a = slurp("a.txt", &la), *b1 = slurp("b1.txt", &l1), *b2 = slurp("b2.txt", &l2);
    assert_int_equal(la, l1 + l2);
    assert_memory_equal(a, b1, l1);
    assert_memory_equal(a + l1, b2, l2);
    unsigned char *fa = slurp("a.bin", &lla), *fb = slurp("b.bin", &llb);
    assert_int_equal(lla, ST_VOCAB_BYTES * 4);
    assert_int_equal(lla, llb);
    assert_memory_equal(fa, fb, lla);
    free(a);
    free(b1);
    free(b2);
    free(fa);
    free(fb);
    /* token ids, with other thread counts and chunking in each process */
    sh(1, "%s %s -n 30 --tokens --ubatch 7 > %s/ta.txt 2>/dev/null", g, p, g_dir);
    sh(1, "%s %s -n 11 --tokens --threads 1 --session-out %s/t.stsf > %s/tb1.txt 2>/dev/null", g,
       p, g_dir, g_dir);
    sh(1, "%s -n 19 --tokens --threads 3 --scalar --session-in %s/t.stsf > %s/tb2.txt 2>/dev/null",
       g, g_dir, g_dir);
    a = slurp("ta.txt", &la);
    b1 = slurp("tb1.txt", &l1);
    b2 = slurp("tb2.txt", &l2);
    char joined[4096];
    snprintf(joined, sizeof joined, "%.*s %.*s", (int)l1 - 1, (const char *)b1, (int)l2,
             (const char *)b2);
    assert_int_equal(la, strlen(joined));
    assert_memory_equal(a, joined, la);
    free(a);
    free(b1);
    free(b2);
    /* stderr carries the logs, stdout only the text */
    unsigned char *err = slurp("a.err", &la);
    assert_non_null(memmem(err, la, "generated 30 tokens", 19));
    free(err);
}

/* strata logits: [n_tokens][n_vocab] f32, the same from --tokens and --tokens-file, at 1 and 2
 * threads; its last row is generate's final logits after the same tokens (BOS "Hi!"); f32 K/V
 * differs from f16; a token beyond the vocabulary or not a number is refused. */
static void test_logits(void **state)
{
    (void)state;
    const char *lg = BIN "/strata logits -m %s/m.gguf --kv-dtype f32";
    char g[8192];
    snprintf(g, sizeof g, lg, g_dir);
    sh(1, "%s --tokens 256,72,105,33 --threads 1 -o %s/l1.bin", g, g_dir);
    sh(1, "printf '256 72\\n105,\\t33\\n' > %s/tok.txt && %s --tokens-file %s/tok.txt --threads 2 "
          "-o %s/l2.bin", g_dir, g, g_dir, g_dir);
    sh(1, BIN "/strata generate -m %s/m.gguf -p 'Hi!' -n 0 --kv-dtype f32 --dump-logits "
              "%s/last.bin 2>/dev/null", g_dir, g_dir);
    sh(1, BIN "/strata logits -m %s/m.gguf --kv-dtype f16 --tokens 256,72,105,33 -o %s/l3.bin",
       g_dir, g_dir);
    size_t n1, n2, n3, nl;
    unsigned char *l1 = slurp("l1.bin", &n1), *l2 = slurp("l2.bin", &n2);
    unsigned char *l3 = slurp("l3.bin", &n3), *last = slurp("last.bin", &nl);
    assert_int_equal(n1, 4 * ST_VOCAB_BYTES * 4);
    assert_int_equal(n2, n1);
    assert_memory_equal(l1, l2, n1);
    assert_int_equal(nl, ST_VOCAB_BYTES * 4);
    assert_memory_equal(l1 + 3 * ST_VOCAB_BYTES * 4, last, nl);
    assert_int_equal(n3, n1);
    assert_true(memcmp(l1, l3, n1) != 0);
    free(l1);
    free(l2);
    free(l3);
    free(last);
    sh(0, "%s --tokens 256,259 -o %s/bad.bin", g, g_dir);
    assert_non_null(strstr(out, "token 1 is 259, the vocabulary has 259"));
    sh(0, "%s --tokens 256,x -o %s/bad.bin", g, g_dir);
    assert_non_null(strstr(out, "token 1 is not a number"));
    sh(0, "%s --tokens 256 --tokens-file %s/tok.txt -o %s/bad.bin", g, g_dir, g_dir);
}

/* f32 K/V saves and restores: N tokens in one run equal k, a session file, then N - k. */
static void test_kv_f32_session(void **state)
{
    (void)state;
    const char *gen = BIN "/strata generate -m %s/m.gguf --kv-dtype f32 --ignore-eos --tokens -p "
                          "'Hello'";
    char g[8192];
    snprintf(g, sizeof g, gen, g_dir);
    sh(1, "%s -n 20 > %s/fa.txt 2>/dev/null", g, g_dir);
    sh(1, "%s -n 8 --session-out %s/f.stsf > %s/fb1.txt 2>/dev/null", g, g_dir, g_dir);
    sh(1, BIN "/strata generate -m %s/m.gguf --kv-dtype f32 --ignore-eos --tokens -n 12 "
              "--session-in %s/f.stsf > %s/fb2.txt 2>/dev/null", g_dir, g_dir, g_dir);
    size_t la, l1, l2;
    unsigned char *a = slurp("fa.txt", &la), *b1 = slurp("fb1.txt", &l1), *b2 = slurp("fb2.txt", &l2);
    char joined[4096];
    snprintf(joined, sizeof joined, "%.*s %.*s", (int)l1 - 1, (const char *)b1, (int)l2,
             (const char *)b2);
    assert_int_equal(la, strlen(joined));
    assert_memory_equal(a, joined, la);
    free(a);
    free(b1);
    free(b2);
    /* the geometry names the K/V dtype: an f16 engine refuses the f32 session */
    sh(0, BIN "/strata generate -m %s/m.gguf -n 1 --session-in %s/f.stsf", g_dir, g_dir);
}

static void test_bf16_and_diff(void **state)
{
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate -m %s/m.gguf -p 'bf16 state' --ignore-eos", g_dir);
    sh(1, "%s -n 12 --session-out %s/f32.stsf >/dev/null 2>&1", g, g_dir);
    sh(1, "%s -n 12 --session-out %s/bf16.stsf --session-state-codec bf16 >/dev/null 2>&1", g,
       g_dir);
    sh(1, BIN "/strata generate -m %s/m.gguf -n 10 --ignore-eos --session-in %s/bf16.stsf --tokens",
       g_dir, g_dir);
    assert_non_null(strstr(out, "restored"));
    size_t l32, l16;
    unsigned char *a = slurp("f32.stsf", &l32), *b = slurp("bf16.stsf", &l16);
    assert_true(l16 < l32);
    free(a);
    free(b);
    if (access(BIN "/statectl", X_OK) == 0) {
        int rc = st_test_run(out, sizeof out, BIN "/statectl diff %s/f32.stsf %s/bf16.stsf", g_dir,
                             g_dir);
        if (rc != 1)
            fail_msg("statectl diff exited %d:\n%s", rc, out);
        assert_non_null(strstr(out, "largest relative error"));
        /* converted by statectl (f16, and bf16 -> f16 -> fp32), the sessions restore: the
         * conversion records the hash of the re-coded state once the old one verified */
        sh(1, BIN "/statectl convert %s/f32.stsf %s/f16.stsf --codec f16", g_dir, g_dir);
        sh(1, BIN "/statectl convert %s/bf16.stsf %s/c1.stsf --codec f16", g_dir, g_dir);
        sh(1, BIN "/statectl convert %s/c1.stsf %s/c2.stsf --codec fp32", g_dir, g_dir);
        const char *again[] = {"f16.stsf", "c1.stsf", "c2.stsf"};
        for (int i = 0; i < 3; i++) {
            sh(1, BIN "/strata generate -m %s/m.gguf -n 6 --ignore-eos --session-in %s/%s "
               "--tokens", g_dir, g_dir, again[i]);
            assert_non_null(strstr(out, "restored"));
        }
    }
}

static void test_refusals(void **state)
{
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate -m %s/m.gguf -p 'refuse me' --ignore-eos", g_dir);
    sh(1, "%s -n 4 --session-out %s/r.stsf >/dev/null 2>&1", g, g_dir);
    /* another model (another seed) */
    sh(0, BIN "/strata generate -m %s/other.gguf -n 4 --session-in %s/r.stsf", g_dir, g_dir);
    assert_non_null(strstr(out, "fingerprint"));
    /* another geometry */
    sh(0, BIN "/strata generate -m %s/m.gguf -n 4 --page-size 64 --session-in %s/r.stsf", g_dir,
       g_dir);
    assert_non_null(strstr(out, "page_size"));
    sh(0, BIN "/strata generate -m %s/m.gguf -n 4 --kv-dtype i8 --session-in %s/r.stsf", g_dir,
       g_dir);
    assert_non_null(strstr(out, "geometry"));
    /* a damaged session file */
    size_t len;
    unsigned char *f = slurp("r.stsf", &len);
    f[len / 2] ^= 0x40;
    char p[4300];
    snprintf(p, sizeof p, "%s/bad.stsf", g_dir);
    assert_int_equal(st_test_spit(p, f, len), 0);
    free(f);
    sh(0, BIN "/strata generate -m %s/m.gguf -n 4 --session-in %s", g_dir, p);
    /* truncated and foreign model files */
    f = slurp("m.gguf", &len);
    snprintf(p, sizeof p, "%s/cut.gguf", g_dir);
    assert_int_equal(st_test_spit(p, f, len - 100), 0);
    free(f);
    sh(0, BIN "/strata generate -m %s -p x -n 1", p);
    assert_non_null(strstr(out, "gguf"));
    sh(0, BIN "/strata generate -m %s/r.stsf -p x -n 1", g_dir);
    assert_non_null(strstr(out, "not a GGUF file"));
    sh(0, BIN "/strata generate -p x -n 1");
    sh(0, BIN "/strata-mkmodel --preset nope -o %s/x.gguf", g_dir);
    /* strata info names the fingerprint, the architecture, each layer's kind, the tensor types
     * and the state sizes (tiny: 3 DeltaNet layers to 1 attention layer, all f32) */
    sh(1, BIN "/strata info -m %s/m.gguf", g_dir);
    assert_non_null(strstr(out, "fingerprint"));
    assert_non_null(strstr(out, "architecture strata-hybrid\n"));
    assert_non_null(strstr(out, "kinds        DDDA (3 deltanet, 1 attention)\n"));
    assert_non_null(strstr(out, "types        f32 60 tensors "));
    assert_non_null(strstr(out, "state        9608 B per checkpoint, K/V 128 B per token\n"));
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "engine_cli");
    if (st_test_run(out, sizeof out, BIN "/strata-mkmodel --preset tiny --seed 1 -o %s/m.gguf",
                    g_dir) != 0 ||
        st_test_run(out, sizeof out, BIN "/strata-mkmodel --preset tiny --seed 2 -o %s/other.gguf",
                    g_dir) != 0) {
        fprintf(stderr, "strata-mkmodel failed: %s\n", out);
        return -1;
    }
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
        cmocka_unit_test(test_identity_fp32),
        cmocka_unit_test(test_bf16_and_diff),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_logits),
        cmocka_unit_test(test_kv_f32_session),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
