/*
 * test_statectl_file.c - the real statectl binary on real files: every file verb, its help, its
 * exit codes, and that bad input is reported with a message naming the problem and changes nothing.
 */
#include <jansson.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_test_util.h"

static char dir[4096];
static char out[1 << 16];
#define CTL ST_BIN_DIR "/statectl"

static void test_help_for_every_verb(void **state)
{
    (void)state;
    static const char *verbs[] = {"inspect", "verify", "convert", "diff", "synth"};
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        assert_int_equal(st_test_run(out, sizeof out, CTL " %s --help", verbs[i]), 0);
        assert_non_null(strstr(out, "usage: statectl"));
    }
    assert_int_equal(st_test_run(out, sizeof out, CTL " --help"), 0);
    assert_non_null(strstr(out, "Exit status"));
    assert_int_equal(st_test_run(out, sizeof out, CTL), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " frobnicate"), 2);
    assert_non_null(strstr(out, "unknown verb"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert onlyone"), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert a b --codec fp8"), 2);
    assert_non_null(strstr(out, "fp8"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert a b --compress zstd:99"), 2);
}

static void test_synth_inspect_verify(void **state)
{
    (void)state;
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s/s.stsf --tokens 700 --checkpoints 3",
                                 dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s/s.stsf", dir), 0);
    assert_non_null(strstr(out, "Strata session file v1"));
    assert_non_null(strstr(out, "all checks ok"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s/s.stsf", dir), 0);
    assert_non_null(strstr(out, "ok (700 tokens, 3 checkpoints)"));

    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect --json %s/s.stsf", dir), 0);
    json_error_t jerr;
    json_t *o = json_loads(out, 0, &jerr);
    assert_non_null(o);
    assert_int_equal(json_integer_value(json_object_get(o, "version")), 1);
    assert_int_equal(json_integer_value(json_object_get(o, "tokens")), 700);
    assert_true(json_is_true(json_object_get(o, "ok")));
    assert_int_equal(json_array_size(json_object_get(o, "checkpoints")), 3);
    json_decref(o);
}

static void test_damaged_file(void **state)
{
    (void)state;
    char p[8400];
    snprintf(p, sizeof p, "%s/d.stsf", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 300", p), 0);
    size_t len = 0;
    unsigned char *b = st_test_slurp(p, &len);
    assert_non_null(b);
    b[len / 2] ^= 0x40;
    assert_int_equal(st_test_spit(p, b, len), 0);
    free(b);
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s", p), 1);
    assert_non_null(strstr(out, "section"));
    assert_non_null(strstr(out, "offset"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", p), 1);
    assert_non_null(strstr(out, "BAD"));

    /* Not a Strata file at all; a file that does not exist. */
    snprintf(p, sizeof p, "%s/not.stsf", dir);
    static const char junk[] = "hello, this is not a session file at all......................";
    assert_int_equal(st_test_spit(p, junk, sizeof junk - 1), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s", p), 1);
    assert_non_null(strstr(out, "not a Strata file"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s/missing.stsf", dir), 3);
}

static void test_convert_and_diff(void **state)
{
    (void)state;
    char a[8400], b[8400], c[8400];
    snprintf(a, sizeof a, "%s/a.stsf", dir);
    snprintf(b, sizeof b, "%s/b.stsf", dir);
    snprintf(c, sizeof c, "%s/c.stsf", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 500", a), 0);
    size_t l0;
    unsigned char *before = st_test_slurp(a, &l0);

    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --codec bf16 --compress zstd:5",
                                 a, b), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", b), 0);
    assert_non_null(strstr(out, "Strata session file v2"));
    assert_non_null(strstr(out, "codec bf16, zstd"));

    /* v1 from bf16 is refused with advice, and OUT is not created. */
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --format v1", b, c), 3);
    assert_non_null(strstr(out, "--codec fp32"));
    assert_int_equal(access(c, F_OK), -1);
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --format v1 --codec fp32", b, c),
                     0);

    assert_int_equal(st_test_run(out, sizeof out, CTL " diff %s %s", a, a), 0);
    assert_non_null(strstr(out, "identical"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " diff %s %s", a, b), 1);
    assert_non_null(strstr(out, "largest relative error"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " diff --json %s %s", a, c), 1);
    json_error_t jerr;
    json_t *o = json_loads(out, 0, &jerr);
    assert_non_null(o);
    assert_true(json_is_false(json_object_get(o, "identical")));
    json_t *e;
    size_t i;
    int floats = 0;
    json_array_foreach(json_object_get(o, "entries"), i, e) {
        if (!json_is_true(json_object_get(e, "float")))
            continue;
        floats++;
        assert_true(json_real_value(json_object_get(e, "max_rel")) <= 1.0 / 256.0);
        assert_int_equal(json_integer_value(json_object_get(e, "sign_changes")), 0);
    }
    assert_true(floats > 0);
    json_decref(o);

    /* Another geometry cannot be compared: the message names the difference. */
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 500 --layers 8", c), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " diff %s %s", a, c), 3);
    assert_non_null(strstr(out, "geometry"));

    size_t l1;
    unsigned char *after = st_test_slurp(a, &l1);
    assert_int_equal(l0, l1);
    assert_memory_equal(before, after, l0);
    free(before);
    free(after);
}

static int count_entries(const char *d)
{
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "ls -A '%s' | wc -l", d);
    assert_int_equal(st_test_run(out, sizeof out, "%s", cmd), 0);
    return atoi(out);
}

/* inspect of a truncated file shows what it can: the header's fields, the geometry, the
 * sections that are whole, the problem and where the walk stopped; exit 1. A file this build
 * cannot read at all: exit 3. */
static void test_inspect_truncated(void **state)
{
    (void)state;
    char p[8400], t[8400];
    snprintf(p, sizeof p, "%s/whole.stsf", dir);
    snprintf(t, sizeof t, "%s/trunc.stsf", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 400", p), 0);
    size_t len = 0;
    unsigned char *b = st_test_slurp(p, &len);
    assert_non_null(b);
    assert_int_equal(st_test_spit(t, b, len / 2), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", t), 1);
    assert_non_null(strstr(out, "tokens       400"));
    assert_non_null(strstr(out, "blk.0.ssm_state"));
    assert_non_null(strstr(out, "GEOMETRY"));
    assert_non_null(strstr(out, "PROBLEM"));
    assert_non_null(strstr(out, "truncated"));
    assert_non_null(strstr(out, "stopped: "));
    assert_non_null(strstr(out, "exceeds"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect --json %s", t), 1);
    json_error_t jerr;
    json_t *o = json_loads(out, 0, &jerr);
    assert_non_null(o);
    assert_false(json_is_true(json_object_get(o, "ok")));
    assert_int_equal(json_integer_value(json_object_get(o, "tokens")), 400);
    assert_true(json_array_size(json_object_get(o, "sections")) >= 2);
    assert_non_null(json_string_value(json_object_get(o, "stopped")));
    json_decref(o);
    /* a header cut short: the format is known, the rest is not shown as zeros */
    assert_int_equal(st_test_spit(t, b, 30), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", t), 1);
    assert_non_null(strstr(out, "header       truncated"));
    assert_null(strstr(out, "tokens"));
    /* a version this build does not read */
    b[8] = 3;
    assert_int_equal(st_test_spit(t, b, len), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", t), 3);
    assert_non_null(strstr(out, "version 3"));
    free(b);
}

/* convert in place, a failed convert, and no progress output when stderr is not a terminal. */
static void test_convert_in_place_and_failures(void **state)
{
    (void)state;
    char sub[4200], p[8400], q[8400];
    snprintf(sub, sizeof sub, "%s/conv", dir);
    assert_int_equal(mkdir(sub, 0755), 0);
    snprintf(p, sizeof p, "%s/p.stsf", sub);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 300", p), 0);
    assert_null(strchr(out, '\r'));

    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --codec f16 --compress zstd", p, p),
                     0);
    assert_null(strchr(out, '\r'));
    assert_int_equal(count_entries(sub), 1); /* no temp file left */
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s", p), 0);
    assert_non_null(strstr(out, "codec f16, zstd"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s", p), 0);

    size_t l0, l1;
    unsigned char *before = st_test_slurp(p, &l0);
    /* refused in place (v1 from f16): IN unchanged */
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --format v1", p, p), 3);
    /* OUT in a directory that does not exist; IN that does not exist; IN not a session file */
    snprintf(q, sizeof q, "%s/nodir/q.stsf", sub);
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s", p, q), 3);
    assert_non_null(strstr(out, "nodir"));
    snprintf(q, sizeof q, "%s/missing.stsf", sub);
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s", q, p), 3);
    snprintf(q, sizeof q, "%s/junk", sub);
    assert_int_equal(st_test_spit(q, "junk", 4), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s", q, p), 3);
    assert_non_null(strstr(out, "not a Strata file"));
    unsigned char *after = st_test_slurp(p, &l1);
    assert_int_equal(l0, l1);
    assert_memory_equal(before, after, l0);
    free(before);
    free(after);
    assert_int_equal(count_entries(sub), 2); /* p.stsf and junk: no temp file left */

    /* usage errors */
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --compress zstd:3x", p), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s --tokens 5000 --ctx 100", p), 2);
    assert_non_null(strstr(out, "exceed"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " convert %s %s --compress zstd:", p, p), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect"), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " verify %s --bogus", p), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " diff %s", p), 2);
}

int main(void)
{
    st_test_tmpdir(dir, sizeof dir, "test_statectl_file");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_for_every_verb),
        cmocka_unit_test(test_synth_inspect_verify),
        cmocka_unit_test(test_damaged_file),
        cmocka_unit_test(test_convert_and_diff),
        cmocka_unit_test(test_inspect_truncated),
        cmocka_unit_test(test_convert_in_place_and_failures),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(dir);
    return rc;
}
