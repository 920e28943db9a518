/*
 * test_engine_state_codec.c - what the bf16 and f16 codecs do to the DeltaNet state of qwen35,
 * measured and printed (docs/MODELS.md, "State codecs"):
 *   - a conversation of 256 tokens is snapshotted in fp32, bf16 and f16; the lossy images are
 *     restored into fresh slots and snapshotted again in fp32, so their widened values can be
 *     compared with the fp32 state, tensor by tensor: max and mean relative error of the conv
 *     states and of the SSM states (elements whose fp32 value is 0 are left out of the relative
 *     figures; they stay 0);
 *   - the three slots then read the same 32 tokens (those the fp32 slot generates greedily):
 *     max and mean over positions of max |Δ log-prob| over the vocabulary against the fp32 slot,
 *     and how many next-token choices agree.
 * Checks: the fp32 round trip changes nothing (0 everywhere); bf16 rounds to nearest, so every
 * element's relative error is at most 2^-8 and some are not 0 (the codec rounds: the negative
 * control of the figures); f16's relative error on values in its normal range is at most 2^-11.
 * Presets qwen35 tiny (4 layers) and small (8 layers, 256 wide, vocab 4,096).
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <cmocka.h>

#include "engine_test.h"
#include "st_codec.h"
#include "st_image.h"

#define N_PROMPT 256
#define N_NEXT 32

static char dir[4096];

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_engine_state_codec");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    if (!getenv("ST_TEST_KEEP"))
        st_test_rmdir(dir);
    return 0;
}

typedef struct errs {
    double max_rel, sum_rel, max_rel_normal16;
    uint64_t n, n_changed;
} errs;

/* Compare the live checkpoint's f32 tensors whose name ends in suffix between a (fp32) and b. */
static void compare(const st_image *a, const st_image *b, const char *suffix, errs *e)
{
    const st_geometry *g = st_image_geometry(a);
    uint32_t ca = st_image_n_checkpoints(a) - 1, cb = st_image_n_checkpoints(b) - 1;
    size_t ls = strlen(suffix);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        const st_tensor_desc *t = &g->tensors[ti];
        size_t ln = strlen(t->name);
        if (t->role != ST_ROLE_RUNNING || t->dtype != ST_DTYPE_F32 || ln < ls || strcmp(t->name + ln - ls, suffix))
            continue;
        uint64_t la = 0, lb = 0;
        const float *x = st_image_checkpoint_tensor_const(a, ca, ti, &la);
        const float *y = st_image_checkpoint_tensor_const(b, cb, ti, &lb);
        assert_non_null(x);
        assert_non_null(y);
        assert_int_equal(la, lb);
        for (uint64_t i = 0; i < la / sizeof *x; i++) {
            assert_true(isfinite(y[i]));
            if (x[i] == 0.0f) {
                assert_true(y[i] == 0.0f);
                continue;
            }
            double r = fabs((double)y[i] - (double)x[i]) / fabs((double)x[i]);
            e->max_rel = fmax(e->max_rel, r);
            if (fabs(x[i]) >= 6.103515625e-05 && fabs(x[i]) <= 65504.0)
                e->max_rel_normal16 = fmax(e->max_rel_normal16, r);
            e->sum_rel += r;
            e->n++;
            e->n_changed += x[i] != y[i];
        }
    }
}

/* max over the vocabulary of |log-softmax(a) - log-softmax(b)|; sets *same when the argmaxes agree. */
static double dlogprob(const float *a, const float *b, uint32_t n, int *same)
{
    double ma = a[0], mb = b[0], sa = 0, sb = 0, d = 0;
    uint32_t ia = 0, ib = 0;
    for (uint32_t i = 1; i < n; i++) {
        if (a[i] > ma)
            ma = a[i], ia = i;
        if (b[i] > mb)
            mb = b[i], ib = i;
    }
    for (uint32_t i = 0; i < n; i++) {
        sa += exp((double)a[i] - ma);
        sb += exp((double)b[i] - mb);
    }
    double la = ma + log(sa), lb = mb + log(sb);
    for (uint32_t i = 0; i < n; i++)
        d = fmax(d, fabs(((double)a[i] - la) - ((double)b[i] - lb)));
    *same = ia == ib;
    return d;
}

static void measure(const char *preset)
{
    char path[4200];
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("qwen35", preset, &hp), 0);
    snprintf(path, sizeof path, "%s/qwen35-%s.gguf", dir, preset);
    assert_int_equal(st_model_write_seeded(&hp, 1, "qwen35", path), 0);
    st_model *m = NULL;
    st_engine *e = NULL;
    assert_int_equal(st_model_load(path, &m), 0);
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = 2;
    assert_int_equal(st_engine_new(m, &o, &e), 0);

    static const uint32_t codecs[3] = {ST_CODEC_FP32, ST_CODEC_BF16, ST_CODEC_F16};
    static const char *const names[3] = {"fp32", "bf16", "f16"};
    uint32_t toks[N_PROMPT];
    for (uint32_t i = 0; i < N_PROMPT; i++)
        toks[i] = i ? ' ' + (i * 11 + i / 95) % 95 : ST_TOKEN_BOS;
    st_slot *s[3];
    st_image *img32 = NULL;
    for (int c = 0; c < 3; c++)
        assert_int_equal(st_slot_new(e, &s[c]), 0);
    assert_int_equal(st_slot_eval(s[0], toks, N_PROMPT, 0, NULL), 0);
    assert_int_equal(st_slot_snapshot(s[0], ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img32), 0);
    printf("qwen35-%s (%u layers, %u DeltaNet value heads, dk %u, dv %u), %u tokens:\n", preset, hp.n_layer,
           hp.ssm_heads, hp.ssm_dk, hp.ssm_dv, N_PROMPT);
    for (int c = 0; c < 3; c++) {
        st_image *lossy = NULL, *wide = NULL;
        assert_int_equal(st_slot_snapshot(s[0], ST_SNAPSHOT_SESSION, codecs[c], &lossy), 0);
        assert_int_equal(st_slot_restore(s[c], lossy), 0);
        assert_int_equal(st_slot_snapshot(s[c], ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &wide), 0);
        errs conv = {0}, ssm = {0};
        compare(img32, wide, ".conv_state", &conv);
        compare(img32, wide, ".ssm_state", &ssm);
        assert_true(conv.n > 0 && ssm.n > 0);
        printf("  %-4s conv state: max rel %.3e, mean rel %.3e (%llu values)   SSM state: max rel %.3e, "
               "mean rel %.3e (%llu values)\n", names[c], conv.max_rel, conv.sum_rel / (double)conv.n,
               (unsigned long long)conv.n, ssm.max_rel, ssm.sum_rel / (double)ssm.n, (unsigned long long)ssm.n);
        if (codecs[c] == ST_CODEC_FP32) {
            assert_true(conv.max_rel == 0.0 && ssm.max_rel == 0.0);
        } else if (codecs[c] == ST_CODEC_BF16) {
            assert_true(conv.max_rel <= 0x1p-8 && ssm.max_rel <= 0x1p-8);
            assert_true(conv.n_changed > 0 && ssm.n_changed > 0); /* negative control */
        } else {
            assert_true(conv.max_rel_normal16 <= 0x1p-11 && ssm.max_rel_normal16 <= 0x1p-11);
            assert_true(conv.n_changed > 0 && ssm.n_changed > 0);
        }
        st_image_free(lossy);
        st_image_free(wide);
    }
    /* the next tokens, read by all three */
    double dmax[3] = {0}, dsum[3] = {0};
    int agree[3] = {0};
    for (int k = 0; k < N_NEXT; k++) {
        uint32_t nv = 0, tok = 0;
        const float *ref = st_slot_logits(s[0], &nv);
        for (int c = 0; c < 3; c++) {
            uint32_t n2 = 0;
            const float *l = st_slot_logits(s[c], &n2);
            assert_int_equal(n2, nv);
            int same = 0;
            double d = dlogprob(ref, l, nv, &same);
            dmax[c] = fmax(dmax[c], d);
            dsum[c] += d;
            agree[c] += same;
        }
        assert_int_equal(st_slot_sample(s[0], 0.0f, 0, &tok), 0);
        for (int c = 0; c < 3; c++)
            assert_int_equal(st_slot_decode(s[c], tok), 0);
    }
    for (int c = 1; c < 3; c++)
        printf("  %-4s next %d tokens: max |d log-prob| %.3e, mean over positions %.3e, next-token "
               "choice agrees %d/%d\n", names[c], N_NEXT, dmax[c], dsum[c] / N_NEXT, agree[c], N_NEXT);
    assert_true(dmax[0] == 0.0 && agree[0] == N_NEXT); /* fp32 restores exactly */
    assert_true(dmax[1] > 0.0);                         /* bf16 rounding reaches the log-probs */
    for (int c = 0; c < 3; c++)
        st_slot_free(s[c]);
    st_image_free(img32);
    st_engine_free(e);
    st_model_free(m);
}

static void test_tiny(void **state)
{
    (void)state;
    measure("tiny");
}

static void test_small(void **state)
{
    (void)state;
    measure("small");
}

int main(void)
{
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_tiny), cmocka_unit_test(test_small)};
    return cmocka_run_group_tests(tests, setup, teardown);
}
