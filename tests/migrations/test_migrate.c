/*
 * test_migrate.c - session-file conversions and diffs: v1 -> v2 keeps every byte of state and
 * records fp32, v2 -> v1 widens bf16/f16 exactly, v1 from coded state is refused, re-coding and
 * diff figures are what the codecs imply.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_file.h"
#include "st_migrate.h"
#include "st_test_util.h"

static char dir[4096];

static st_image *synth(uint32_t codec, uint64_t seed)
{
    st_synth_opts o = {.seed = seed, .n_tokens = 600, .n_checkpoints = 3, .codec = codec};
    st_image *img = NULL;
    assert_int_equal(st_image_synthesize(&o, &img), 0);
    return img;
}

static void path_of(char *dst, size_t cap, const char *name)
{
    snprintf(dst, cap, "%s/%s", dir, name);
}

static uint32_t file_version(const char *path)
{
    size_t len;
    unsigned char *b = st_test_slurp(path, &len);
    assert_non_null(b);
    assert_true(len >= 12);
    uint32_t v = (uint32_t)b[8] | (uint32_t)b[9] << 8 | (uint32_t)b[10] << 16 | (uint32_t)b[11] << 24;
    free(b);
    return v;
}

static void assert_same_state(const st_image *a, const st_image *b)
{
    st_diff d;
    assert_int_equal(st_migrate_diff(a, b, &d), 0);
    if (!d.identical)
        for (uint32_t i = 0; i < d.n_entries; i++)
            print_error("%s differs\n", d.entries[i].what);
    assert_true(d.identical);
    st_diff_free(&d);
}

static void test_v1_to_v2_and_back(void **state)
{
    (void)state;
    char v1[8400], v2[8400], back[8400];
    path_of(v1, sizeof v1, "a.v1");
    path_of(v2, sizeof v2, "a.v2");
    path_of(back, sizeof back, "a.back");
    st_image *img = synth(ST_CODEC_FP32, 7);
    assert_int_equal(st_file_write(img, v1, NULL), 0);
    assert_int_equal(file_version(v1), 1);

    st_convert_opts o = {.codec = -1, .version = 2};
    assert_int_equal(st_migrate_file_convert(v1, v2, &o), 0);
    assert_int_equal(file_version(v2), 2);
    st_image *r = NULL;
    assert_int_equal(st_file_read(v2, NULL, &r), 0);
    for (uint32_t ci = 0; ci < st_image_n_checkpoints(r); ci++) {
        uint64_t pos;
        uint32_t codec;
        assert_int_equal(st_image_checkpoint_info(r, ci, &pos, &codec), 0);
        assert_int_equal(codec, ST_CODEC_FP32);
    }
    assert_same_state(img, r);
    st_image_free(r);

    /* Back to v1: the bytes are exactly what the writer makes of the original image. */
    o.version = 1;
    assert_int_equal(st_migrate_file_convert(v2, back, &o), 0);
    size_t la, lb;
    unsigned char *a = st_test_slurp(v1, &la), *b = st_test_slurp(back, &lb);
    assert_int_equal(la, lb);
    assert_memory_equal(a, b, la);
    free(a);
    free(b);
    st_image_free(img);
}

static void test_v1_refused_for_coded_state(void **state)
{
    (void)state;
    char in[8400], out[8400];
    path_of(in, sizeof in, "b.bf16");
    path_of(out, sizeof out, "b.v1");
    st_image *img = synth(ST_CODEC_BF16, 8);
    assert_int_equal(st_migrate_image_v1_ok(img), ST_ELOSSY);
    assert_non_null(strstr(st_errdetail(), "bf16"));
    assert_int_equal(st_file_write(img, in, NULL), 0);
    assert_int_equal(file_version(in), 2);

    st_convert_opts o = {.codec = -1, .version = 1};
    assert_int_equal(st_migrate_file_convert(in, out, &o), ST_ELOSSY);
    assert_int_equal(access(out, F_OK), -1);
    /* With codec fp32 it widens exactly: every value equals the bf16 value widened. */
    o.codec = ST_CODEC_FP32;
    assert_int_equal(st_migrate_file_convert(in, out, &o), 0);
    assert_int_equal(file_version(out), 1);
    st_image *r = NULL;
    assert_int_equal(st_file_read(out, NULL, &r), 0);
    st_image *widened = NULL;
    assert_int_equal(st_image_clone(&widened, img), 0);
    assert_int_equal(st_migrate_image_to_v1(widened), 0);
    assert_int_equal(st_migrate_image_v1_ok(widened), 0);
    assert_same_state(widened, r);
    /* ... and the widened values re-encode to the same bf16 bits (widening is exact). */
    st_image *re = NULL;
    assert_int_equal(st_image_clone(&re, r), 0);
    assert_int_equal(st_migrate_image_recode(re, ST_CODEC_BF16), 0);
    assert_same_state(img, re);
    st_image_free(re);
    st_image_free(widened);
    st_image_free(r);
    st_image_free(img);
}

static void test_convert_in_place_and_compress(void **state)
{
    (void)state;
    char p[8400];
    path_of(p, sizeof p, "c.stsf");
    st_image *img = synth(ST_CODEC_FP32, 9);
    assert_int_equal(st_file_write(img, p, NULL), 0);
    st_convert_opts o = {.codec = ST_CODEC_F16, .compress = 3};
    assert_int_equal(st_migrate_file_convert(p, p, &o), 0);
    assert_int_equal(file_version(p), 2);
    st_image *r = NULL;
    assert_int_equal(st_file_read(p, NULL, &r), 0);
    uint64_t pos;
    uint32_t codec;
    assert_int_equal(st_image_checkpoint_info(r, 0, &pos, &codec), 0);
    assert_int_equal(codec, ST_CODEC_F16);
    st_image *f16 = NULL;
    assert_int_equal(st_image_clone(&f16, img), 0);
    assert_int_equal(st_migrate_image_recode(f16, ST_CODEC_F16), 0);
    assert_same_state(f16, r);
    st_image_free(f16);
    st_image_free(r);
    st_image_free(img);

    /* Bad requests change nothing. */
    size_t l0, l1;
    unsigned char *before = st_test_slurp(p, &l0);
    st_convert_opts bad = {.codec = 7};
    assert_int_equal(st_migrate_file_convert(p, p, &bad), ST_ECODEC);
    st_convert_opts badv = {.codec = -1, .version = 3};
    assert_int_equal(st_migrate_file_convert(p, p, &badv), ST_EVERSION);
    st_convert_opts v1z = {.codec = ST_CODEC_FP32, .version = 1, .compress = 1};
    assert_int_equal(st_migrate_file_convert(p, p, &v1z), ST_ELOSSY);
    unsigned char *after = st_test_slurp(p, &l1);
    assert_int_equal(l0, l1);
    assert_memory_equal(before, after, l0);
    free(before);
    free(after);
}

static void test_diff_figures(void **state)
{
    (void)state;
    st_image *a = synth(ST_CODEC_FP32, 10);
    st_image *b = NULL;
    assert_int_equal(st_image_clone(&b, a), 0);
    assert_int_equal(st_migrate_image_recode(b, ST_CODEC_BF16), 0);
    st_diff d;
    assert_int_equal(st_migrate_diff(a, b, &d), 0);
    assert_false(d.identical);
    int seen_ckpt = 0;
    for (uint32_t i = 0; i < d.n_entries; i++) {
        const st_diff_entry *e = &d.entries[i];
        if (strncmp(e->what, "ckpt", 4))
            continue;
        if (!e->float_compare) {
            assert_int_equal(e->bytes_differ, 0); /* integer state is never coded */
            continue;
        }
        seen_ckpt++;
        /* bf16 keeps 8 significant bits: relative error at most 2^-8 for normal values. */
        assert_true(e->stat.max_rel <= 1.0 / 256.0);
        assert_true(e->stat.max_rel > 0);
        assert_int_equal(e->stat.sign_changes, 0);
        assert_int_equal(e->stat.new_nonfinite, 0);
    }
    assert_true(seen_ckpt > 0);
    st_diff_free(&d);

    /* Files that differ only in the engine's state hash are not identical. */
    st_image *h = NULL;
    assert_int_equal(st_image_clone(&h, a), 0);
    st_image_state_hash_set(h, st_image_state_hash(a) ^ 1);
    assert_int_equal(st_migrate_diff(a, h, &d), 0);
    assert_false(d.identical);
    assert_non_null(strstr(d.note, "state hash"));
    st_diff_free(&d);
    st_image_free(h);

    /* Another model: refused, naming the fingerprint. */
    st_image *other = NULL;
    st_synth_opts o = {.seed = 10, .n_tokens = 600, .n_checkpoints = 3, .n_layers = 8};
    assert_int_equal(st_image_synthesize(&o, &other), 0);
    int rc = st_migrate_diff(a, other, &d);
    assert_true(rc == ST_EGEOMETRY || rc == ST_EMODEL);
    assert_true(strlen(st_errdetail()) > 0);
    st_image_free(other);
    st_image_free(a);
    st_image_free(b);
}

int main(void)
{
    st_test_tmpdir(dir, sizeof dir, "test_migrate");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_v1_to_v2_and_back),
        cmocka_unit_test(test_v1_refused_for_coded_state),
        cmocka_unit_test(test_convert_in_place_and_compress),
        cmocka_unit_test(test_diff_figures),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(dir);
    return rc;
}
