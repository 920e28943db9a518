/*
 * test_gpu_engine_cli.c - the CUDA backend through the real binaries, across processes:
 * - on the GPU, N tokens in one run equal k tokens, --session-out, a new process with
 *   --session-in, N - k tokens: the token ids and the final logits bit for bit (fp32 state;
 *   with sampling at a temperature, so every logit matters); a prompt appended after the
 *   restore gives the same tokens in two processes; with bf16 state the continued run
 *   completes;
 * - a session saved by the CPU backend restores on the GPU and the reverse, and continues. What
 *   is compared: the restore verifies the recorded state hash (K/V rows and the running state),
 *   the first continued token (sampled from the restored logits) equals the saving backend's own
 *   continuation, and the requested number of tokens follows; later tokens may differ, since the
 *   two backends round differently (bf16 weights on the GPU);
 * - a geometry the GPU was not started with is refused with the difference named.
 * Runs only under the ctest label `gpu`; without a usable CUDA device it FAILS, it never skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "engine/engine_cli_test.h"

/* Token ids printed by --tokens, into ids (at most cap). */
static size_t ids_of(const char *name, uint32_t *ids, size_t cap)
{
    size_t len, n = 0;
    unsigned char *b = slurp(name, &len);
    char *p = (char *)b, *end;
    b[len ? len - 1 : 0] = '\0';
    while (n < cap) {
        unsigned long v = strtoul(p, &end, 10);
        if (end == p)
            break;
        ids[n++] = (uint32_t)v;
        p = end;
    }
    free(b);
    return n;
}

static void test_gpu_identity(void **state)
{
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate --backend cuda -m %s/m.gguf --temp 0.8 --seed 5 "
             "--ignore-eos --tokens --ubatch 64", g_dir);
    const char *p = "-p 'A conversation the GPU keeps, saved and continued in another process.'";
    sh(1, "%s %s -n 40 --dump-logits %s/a.bin > %s/a.txt 2> %s/a.err", g, p, g_dir, g_dir, g_dir);
    sh(1, "%s %s -n 13 --session-out %s/s.stsf > %s/b1.txt 2>/dev/null", g, p, g_dir, g_dir);
    sh(1, "%s -n 27 --session-in %s/s.stsf --dump-logits %s/b.bin > %s/b2.txt 2> %s/b2.err", g,
       g_dir, g_dir, g_dir, g_dir);
    uint32_t a[64], b1[64], b2[64];
    size_t na = ids_of("a.txt", a, 64), n1 = ids_of("b1.txt", b1, 64), n2 = ids_of("b2.txt", b2, 64);
    assert_int_equal(na, 40);
    assert_int_equal(n1, 13);
    assert_int_equal(n2, 27);
    assert_memory_equal(a, b1, 13 * 4);
    assert_memory_equal(a + 13, b2, 27 * 4);
    size_t la, lb;
    unsigned char *fa = slurp("a.bin", &la), *fb = slurp("b.bin", &lb);
    assert_int_equal(la, ST_VOCAB_BYTES * 4);
    assert_int_equal(la, lb);
    assert_memory_equal(fa, fb, la);
    free(fa);
    free(fb);
    size_t le;
    unsigned char *err = slurp("b2.err", &le);
    assert_non_null(memmem(err, le, "cuda backend", 12));
    assert_non_null(memmem(err, le, "restored", 8));
    free(err);
    /* a prompt appended after the restore: two processes give the same tokens */
    sh(1, "%s %s -n 13 > /dev/null 2>&1", g, p);
    sh(1, "%s -p ' And then?' -n 9 --session-in %s/s.stsf > %s/c2.txt 2>/dev/null", g, g_dir,
       g_dir);
    sh(1, "%s -p ' And then?' -n 9 --session-in %s/s.stsf > %s/c3.txt 2>/dev/null", g, g_dir,
       g_dir);
    size_t l2, l3;
    unsigned char *c2 = slurp("c2.txt", &l2), *c3 = slurp("c3.txt", &l3);
    assert_int_equal(l2, l3);
    assert_memory_equal(c2, c3, l2);
    free(c2);
    free(c3);
    /* bf16 running state: smaller file, the continued run completes */
    sh(1, "%s %s -n 13 --session-out %s/h.stsf --session-state-codec bf16 > /dev/null 2>&1", g, p,
       g_dir);
    sh(1, "%s -n 27 --session-in %s/h.stsf > %s/h2.txt 2>/dev/null", g, g_dir, g_dir);
    assert_int_equal(ids_of("h2.txt", b2, 64), 27);
    size_t l32, l16;
    unsigned char *f32 = slurp("s.stsf", &l32), *f16 = slurp("h.stsf", &l16);
    assert_true(l16 < l32);
    free(f32);
    free(f16);
}

/* Save with one backend, continue with both; see the header for what is compared. */
static void cross(const char *from, const char *to, const char *codec)
{
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate -m %s/m.gguf --ignore-eos --tokens --temp 0",
             g_dir);
    const char *p = "-p 'Saved by one backend, continued by the other.'";
    sh(1, "%s --backend %s %s -n 10 --session-out %s/x.stsf --session-state-codec %s "
       "> /dev/null 2>&1", g, from, p, g_dir, codec);
    sh(1, "%s --backend %s -n 12 --session-in %s/x.stsf > %s/same.txt 2>/dev/null", g, from,
       g_dir, g_dir);
    sh(1, "%s --backend %s -n 12 --session-in %s/x.stsf > %s/other.txt 2> %s/other.err", g, to,
       g_dir, g_dir, g_dir);
    uint32_t s[16], o[16];
    assert_int_equal(ids_of("same.txt", s, 16), 12);
    assert_int_equal(ids_of("other.txt", o, 16), 12);
    assert_int_equal(s[0], o[0]);
    size_t le;
    unsigned char *err = slurp("other.err", &le);
    char want[64];
    snprintf(want, sizeof want, "%s backend", to);
    assert_non_null(memmem(err, le, want, strlen(want)));
    assert_non_null(memmem(err, le, "restored", 8));
    free(err);
    /* and saved again by the second backend, back to the first */
    sh(1, "%s --backend %s -n 5 --session-in %s/x.stsf --session-out %s/y.stsf > /dev/null 2>&1",
       g, to, g_dir, g_dir);
    sh(1, "%s --backend %s -n 5 --session-in %s/y.stsf > %s/back.txt 2>/dev/null", g, from, g_dir,
       g_dir);
    assert_int_equal(ids_of("back.txt", s, 16), 5);
}

static void test_cross_backends(void **state)
{
    cross("cpu", "cuda", "fp32");
    cross("cuda", "cpu", "fp32");
    cross("cpu", "cuda", "bf16");
    cross("cuda", "cpu", "bf16");
}

static void test_gpu_refusals(void **state)
{
    char g[8192];
    snprintf(g, sizeof g, BIN "/strata generate --backend cuda -m %s/m.gguf -p 'refuse me'", g_dir);
    sh(1, "%s -n 4 --session-out %s/r.stsf >/dev/null 2>&1", g, g_dir);
    sh(0, BIN "/strata generate --backend cuda -m %s/m.gguf -n 4 --page-size 64 --session-in "
       "%s/r.stsf", g_dir, g_dir);
    assert_non_null(strstr(out, "page_size"));
    sh(0, BIN "/strata generate --backend cuda -m %s/m.gguf -n 4 --kv-dtype i8 --session-in "
       "%s/r.stsf", g_dir, g_dir);
    assert_non_null(strstr(out, "geometry"));
    sh(0, BIN "/strata generate --backend tpu -m %s/m.gguf -n 4", g_dir);
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "gpu_engine_cli");
    if (st_test_run(out, sizeof out, BIN "/strata-mkmodel --preset small --seed 1 --ctx 4096 -o "
                    "%s/m.gguf", g_dir) != 0) {
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
        cmocka_unit_test(test_gpu_identity),
        cmocka_unit_test(test_cross_backends),
        cmocka_unit_test(test_gpu_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
