/*
 * test_engine_quantize.c - `strata quantize` / st_gguf_quantize against llama.cpp's own ggml
 * (v0.4.0, the prebuilt libggml-base.so of tests/ref, installed by `make deps`), loaded at run
 * time as test_engine_wtype does:
 *   - a seeded strata-hybrid model (rows of 256, 288, 128 and 80 values, so that every fallback
 *     of llama.cpp is taken) quantized to each of the 15 types: every tensor llama-quantize
 *     quantizes holds exactly the blocks ggml_quantize_chunk makes from the same f32 values, in
 *     the type this test derives independently (the fallbacks written out again here); the F32
 *     set (norms, ssm_a, ssm_dt.bias, ssm_conv1d, 1-D tensors) stays F32, byte for byte; every
 *     key is copied with its bytes (general.file_type and general.quantization_version set as
 *     llama-quantize sets them); the project's reader and ggml's gguf reader
 *     (gguf_init_from_file) both parse the file and see the same tensors and types;
 *   - a quantized input (Q8_0, Q4_K) re-quantized: ggml's to_float then ggml's quantizer;
 *   - strata-mkmodel --wtype TYPE writes the very file `strata quantize` makes of the f32 model;
 *   - negative controls: one corrupted block and one altered key are caught by the comparison;
 *   - errors (unknown TYPE, input not GGUF, missing output directory, a NaN in a weight): a
 *     clear message, exit status, and nothing left behind (no OUT, no temp file).
 * Without the library the test fails (it never skips): `make deps`.
 */
#include <dirent.h>
#include <dlfcn.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine_cli_test.h"

/* ---- ggml, through dlopen ---------------------------------------------------------------------- */
struct ggml_type_traits { /* ggml.h of v0.4.0 */
    const char *type_name;
    int64_t blck_size;
    int64_t blck_size_interleave;
    size_t type_size;
    _Bool is_quantized;
    void (*to_float)(const void *x, float *y, int64_t k);
    void (*from_float_ref)(const float *x, void *y, int64_t k);
};
struct gguf_init_params {
    _Bool no_alloc;
    void **ctx;
};

static struct {
    void *h;
    const struct ggml_type_traits *(*traits)(int type);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
    void *(*gguf_init)(const char *fname, struct gguf_init_params p);
    void (*gguf_free)(void *ctx);
    int64_t (*gguf_n_tensors)(const void *ctx);
    const char *(*gguf_tensor_name)(const void *ctx, int64_t i);
    int (*gguf_tensor_type)(const void *ctx, int64_t i);
    int64_t (*gguf_n_kv)(const void *ctx);
    int64_t (*gguf_find_key)(const void *ctx, const char *key);
} G;

static int ggml_load(void)
{
    const char *path = getenv("STRATA_GGML_BASE");
    if (!path || !*path)
        path = STRATA_GGML_BASE_SO;
    G.h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!G.h) {
        fprintf(stderr, "test_engine_quantize: cannot load llama.cpp's ggml (%s): %s\n"
                "  run `make deps` (npm ci in tests/ref), or set STRATA_GGML_BASE\n", path,
                dlerror());
        return -1;
    }
    *(void **)&G.traits = dlsym(G.h, "ggml_get_type_traits");
    *(void **)&G.quantize_chunk = dlsym(G.h, "ggml_quantize_chunk");
    *(void **)&G.gguf_init = dlsym(G.h, "gguf_init_from_file");
    *(void **)&G.gguf_free = dlsym(G.h, "gguf_free");
    *(void **)&G.gguf_n_tensors = dlsym(G.h, "gguf_get_n_tensors");
    *(void **)&G.gguf_tensor_name = dlsym(G.h, "gguf_get_tensor_name");
    *(void **)&G.gguf_tensor_type = dlsym(G.h, "gguf_get_tensor_type");
    *(void **)&G.gguf_n_kv = dlsym(G.h, "gguf_get_n_kv");
    *(void **)&G.gguf_find_key = dlsym(G.h, "gguf_find_key");
    if (!G.traits || !G.quantize_chunk || !G.gguf_init || !G.gguf_free || !G.gguf_n_tensors ||
        !G.gguf_tensor_name || !G.gguf_tensor_type || !G.gguf_n_kv || !G.gguf_find_key) {
        fprintf(stderr, "test_engine_quantize: %s lacks a ggml symbol\n", path);
        return -1;
    }
    return 0;
}

/* ---- the expectation, derived here independently of engine/st_quantize.c ------------------ */
enum { F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q2_K = 10, Q3_K = 11,
       Q4_K = 12, Q5_K = 13, Q6_K = 14, IQ4_NL = 20, IQ4_XS = 23, BF16 = 30 };
static const struct {
    const char *name;
    int type;
} k_types[] = {
    {"F32", F32},   {"F16", F16},   {"BF16", BF16}, {"Q8_0", Q8_0},     {"Q4_0", Q4_0},
    {"Q4_1", Q4_1}, {"Q5_0", Q5_0}, {"Q5_1", Q5_1}, {"Q2_K", Q2_K},     {"Q3_K", Q3_K},
    {"Q4_K", Q4_K}, {"Q5_K", Q5_K}, {"Q6_K", Q6_K}, {"IQ4_NL", IQ4_NL}, {"IQ4_XS", IQ4_XS},
};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

/* The tensors of the strata-hybrid model llama-quantize keeps as they are. */
static int kept(const st_gguf_tensor *t)
{
    size_t n = strlen(t->name);
    int nd = t->dims[1] > 1 ? 2 : 1;
    return nd < 2 || n < 7 || strcmp(t->name + n - 7, ".weight") ||
           strstr(t->name, "_norm.weight") || strstr(t->name, "ssm_conv1d");
}

static int expected_type(int target, uint64_t ne0)
{
    int blk = G.traits(target)->blck_size;
    if (target == F32 || target == F16 || target == BF16 || ne0 % (uint64_t)blk == 0)
        return target;
    int r = target;
    switch (target) {
    case Q4_K: r = Q5_0; break;
    case Q5_K: r = Q5_1; break;
    case Q6_K: r = Q8_0; break;
    case Q2_K: case Q3_K: r = Q4_0; break;
    case IQ4_XS: r = IQ4_NL; break;
    }
    return ne0 % (uint64_t)G.traits(r)->blck_size ? F16 : r;
}

static float *ggml_values(const st_gguf_tensor *t, uint64_t n)
{
    float *v = malloc(n * sizeof *v);
    assert_non_null(v);
    if (t->type == F32)
        memcpy(v, t->data, n * 4);
    else
        G.traits((int)t->type)->to_float(t->data, v, (int64_t)n);
    return v;
}

/* Mismatches of the quantized file q against its input g quantized to target (0: exact). */
static int compare(const st_gguf *g, const st_gguf *q, int target, const char *q_path)
{
    int bad = 0;
    if (st_gguf_n_tensors(q) != st_gguf_n_tensors(g))
        return 1000;
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *a = st_gguf_tensor_at(g, i);
        const st_gguf_tensor *b = st_gguf_tensor_find(q, a->name);
        if (!b || b->n_dims != a->n_dims || memcmp(a->dims, b->dims, sizeof a->dims)) {
            fprintf(stderr, "tensor %s: missing or reshaped\n", a->name);
            bad++;
            continue;
        }
        int want = kept(a) ? (int)a->type : expected_type(target, a->dims[0]);
        if ((int)b->type != want) {
            fprintf(stderr, "tensor %s: type %s, expected %s\n", a->name,
                    st_gguf_type_name(b->type), st_gguf_type_name((uint32_t)want));
            bad++;
            continue;
        }
        if (want == (int)a->type) {
            if (a->nbytes != b->nbytes || memcmp(a->data, b->data, a->nbytes)) {
                fprintf(stderr, "tensor %s: not copied byte for byte\n", a->name);
                bad++;
            }
            continue;
        }
        uint64_t n = a->nbytes / G.traits((int)a->type)->type_size *
                     (uint64_t)G.traits((int)a->type)->blck_size;
        float *v = ggml_values(a, n);
        uint8_t *ref = malloc(b->nbytes);
        assert_non_null(ref);
        size_t got = G.quantize_chunk(want, v, ref, 0, (int64_t)(n / a->dims[0]),
                                      (int64_t)a->dims[0], NULL);
        if (got != b->nbytes || memcmp(ref, b->data, got)) {
            fprintf(stderr, "tensor %s (%s): blocks differ from ggml_quantize_chunk's\n", a->name,
                    st_gguf_type_name(b->type));
            bad++;
        }
        free(ref);
        free(v);
    }
    /* keys: every input key with its bytes, file type and quantization version as set */
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        int64_t j = st_gguf_find(q, k);
        if (j < 0) {
            fprintf(stderr, "key %s: missing\n", k);
            bad++;
            continue;
        }
        if (!strcmp(k, "general.file_type") || !strcmp(k, "general.quantization_version"))
            continue;
        const void *va, *vb;
        uint64_t la, lb;
        assert_int_equal(st_gguf_kv_raw(g, i, &va, &la), 0);
        assert_int_equal(st_gguf_kv_raw(q, (uint64_t)j, &vb, &lb), 0);
        if (st_gguf_kv_type(g, i, NULL, NULL) != st_gguf_kv_type(q, (uint64_t)j, NULL, NULL) ||
            la != lb || memcmp(va, vb, la)) {
            fprintf(stderr, "key %s: not copied\n", k);
            bad++;
        }
    }
    uint32_t qv = 0;
    if (st_gguf_get_u32(q, "general.quantization_version", &qv) || qv != 2) {
        fprintf(stderr, "general.quantization_version %u\n", qv);
        bad++;
    }
    uint32_t ft = 0;
    if (st_gguf_get_u32(q, "general.file_type", &ft)) {
        fprintf(stderr, "general.file_type missing\n");
        bad++;
    }
    /* ggml's own gguf reader */
    if (q_path) {
        struct gguf_init_params p = {1, NULL};
        void *ctx = G.gguf_init(q_path, p);
        if (!ctx) {
            fprintf(stderr, "%s: ggml's gguf reader refuses it\n", q_path);
            return bad + 1;
        }
        if (G.gguf_n_tensors(ctx) != (int64_t)st_gguf_n_tensors(q) ||
            G.gguf_n_kv(ctx) != (int64_t)st_gguf_n_kv(q)) {
            fprintf(stderr, "ggml sees %lld tensors, %lld keys\n",
                    (long long)G.gguf_n_tensors(ctx), (long long)G.gguf_n_kv(ctx));
            bad++;
        }
        for (int64_t i = 0; i < G.gguf_n_tensors(ctx); i++) {
            const st_gguf_tensor *t = st_gguf_tensor_find(q, G.gguf_tensor_name(ctx, i));
            if (!t || (int)t->type != G.gguf_tensor_type(ctx, i)) {
                fprintf(stderr, "ggml sees tensor %s as type %d\n", G.gguf_tensor_name(ctx, i),
                        G.gguf_tensor_type(ctx, i));
                bad++;
            }
        }
        G.gguf_free(ctx);
    }
    return bad;
}

/* ---- fixtures ----------------------------------------------------------------------------- */
static char g_f32[4200];

/* Rows of 256 (embedding, q/k/v, gates, attn_output: every type fits), 288 (ffn_down: 32
 * divides it, 256 does not: the 32-block fallbacks) and 80 (ssm_out, 2 heads x 40: neither
 * does: F16). */
static void geometry(st_model_hparams *hp)
{
    hp->n_embd = 256;
    hp->n_layer = 2;
    snprintf(hp->pattern, sizeof hp->pattern, "DA");
    hp->n_ff = 288;
    hp->n_head = 4;
    hp->n_head_kv = 2;
    hp->head_dim = 64;
    hp->ssm_heads = 2;
    hp->ssm_dk = 64;
    hp->ssm_dv = 40;
    hp->wtype = ST_GGML_F32;
}

static int setup(void **state)
{
    (void)state;
    if (ggml_load())
        return -1;
    st_test_tmpdir(g_dir, sizeof g_dir, "test_engine_quantize");
    et_model(g_f32, sizeof g_f32, g_dir, "f32.gguf", 7, geometry);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(g_dir);
    return 0;
}

static void quantize_to(const char *in, const char *name, int type)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    st_quantize_stats qs;
    int rc = st_gguf_quantize(in, path, (uint32_t)type, NULL, &qs);
    if (rc)
        fail_msg("quantize %s -> %s: %s", in, name, st_errdetail());
}

static int compare_files(const char *in, const char *name, int type)
{
    char path[4300];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    st_gguf *g = NULL, *q = NULL;
    assert_int_equal(st_gguf_open(in, &g), 0);
    assert_int_equal(st_gguf_open(path, &q), 0);
    int bad = compare(g, q, type, path);
    st_gguf_close(q);
    st_gguf_close(g);
    return bad;
}

/* ---- tests -------------------------------------------------------------------------------- */
static void test_every_type_equals_ggml(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_TYPES; i++) {
        char name[64];
        uint32_t parsed;
        assert_int_equal(st_quantize_type_parse(k_types[i].name, &parsed), 0);
        assert_int_equal((int)parsed, k_types[i].type);
        snprintf(name, sizeof name, "%s.gguf", k_types[i].name);
        quantize_to(g_f32, name, k_types[i].type);
        int bad = compare_files(g_f32, name, k_types[i].type);
        if (bad)
            fail_msg("%s: %d mismatches against ggml", k_types[i].name, bad);
    }
}

/* The F32 set by name: what the model has of it stays F32, and the fallbacks were taken. */
static void test_f32_set_and_fallbacks(void **state)
{
    (void)state;
    quantize_to(g_f32, "q4k.gguf", Q4_K);
    char path[4300];
    snprintf(path, sizeof path, "%s/q4k.gguf", g_dir);
    st_gguf *q = NULL;
    assert_int_equal(st_gguf_open(path, &q), 0);
    static const char *const f32[] = {"blk.0.attn_norm.weight", "blk.0.ssm_conv1d.weight",
                                      "blk.0.ssm_a", "blk.0.ssm_dt.bias",
                                      "blk.0.ssm_norm.weight", "blk.1.ffn_norm.weight",
                                      "output_norm.weight"};
    for (size_t i = 0; i < sizeof f32 / sizeof f32[0]; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_find(q, f32[i]);
        assert_non_null(t);
        assert_int_equal(t->type, F32);
    }
    assert_int_equal(st_gguf_tensor_find(q, "token_embd.weight")->type, Q4_K);
    assert_int_equal(st_gguf_tensor_find(q, "blk.1.attn_output.weight")->type, Q4_K);
    assert_int_equal(st_gguf_tensor_find(q, "blk.0.ffn_down.weight")->type, Q5_0); /* 288 */
    assert_int_equal(st_gguf_tensor_find(q, "blk.0.ssm_out.weight")->type, F16);   /* 80 */
    uint32_t ft = 0;
    assert_int_equal(st_gguf_get_u32(q, "general.file_type", &ft), 0);
    assert_int_equal(ft, 15); /* LLAMA_FTYPE_MOSTLY_Q4_K_M, the loader's name for mostly Q4_K */
    st_gguf_close(q);
}

/* A quantized input is dequantized first (ggml's to_float), then quantized. */
static void test_requantize(void **state)
{
    (void)state;
    char q8[4300], q4k[4300];
    quantize_to(g_f32, "rq_q8.gguf", Q8_0);
    snprintf(q8, sizeof q8, "%s/rq_q8.gguf", g_dir);
    quantize_to(q8, "rq_q8_q4k.gguf", Q4_K);
    assert_int_equal(compare_files(q8, "rq_q8_q4k.gguf", Q4_K), 0);
    quantize_to(g_f32, "rq_q4k.gguf", Q4_K);
    snprintf(q4k, sizeof q4k, "%s/rq_q4k.gguf", g_dir);
    quantize_to(q4k, "rq_q4k_iq4xs.gguf", IQ4_XS);
    assert_int_equal(compare_files(q4k, "rq_q4k_iq4xs.gguf", IQ4_XS), 0);
    quantize_to(q4k, "rq_q4k_f16.gguf", F16);
    assert_int_equal(compare_files(q4k, "rq_q4k_f16.gguf", F16), 0);
}

/* Negative controls: one flipped byte in one block, one altered key value. */
static void test_negative_controls(void **state)
{
    (void)state;
    quantize_to(g_f32, "neg.gguf", Q6_K);
    size_t len;
    unsigned char *buf = slurp("neg.gguf", &len);
    st_gguf *g = NULL, *q = NULL;
    assert_int_equal(st_gguf_open(g_f32, &g), 0);
    assert_int_equal(st_gguf_open_mem(buf, len, &q), 0);
    assert_int_equal(compare(g, q, Q6_K, NULL), 0);
    const st_gguf_tensor *t = st_gguf_tensor_find(q, "blk.1.attn_q.weight");
    assert_int_equal(t->type, Q6_K);
    size_t at = (size_t)((const unsigned char *)t->data - buf) + 210 * 3 + 17; /* block 3 */
    st_gguf_close(q);
    buf[at] ^= 0x10;
    assert_int_equal(st_gguf_open_mem(buf, len, &q), 0);
    assert_int_not_equal(compare(g, q, Q6_K, NULL), 0);
    st_gguf_close(q);
    buf[at] ^= 0x10;
    /* a key: the last byte of general.name's value */
    assert_int_equal(st_gguf_open_mem(buf, len, &q), 0);
    const void *v;
    uint64_t vl;
    assert_int_equal(st_gguf_kv_raw(q, (uint64_t)st_gguf_find(q, "general.name"), &v, &vl), 0);
    at = (size_t)((const unsigned char *)v - buf) + vl - 1;
    st_gguf_close(q);
    buf[at] ^= 0x01;
    assert_int_equal(st_gguf_open_mem(buf, len, &q), 0);
    assert_int_not_equal(compare(g, q, Q6_K, NULL), 0);
    st_gguf_close(q);
    st_gguf_close(g);
    free(buf);
}

/* Nothing in g_dir but the files a test made itself: no temp file of a failed write. */
static void assert_no_temp(void)
{
    DIR *d = opendir(g_dir);
    assert_non_null(d);
    struct dirent *e;
    while ((e = readdir(d)))
        if (strstr(e->d_name, ".tmp.") || strstr(e->d_name, ".f32."))
            fail_msg("left behind: %s/%s", g_dir, e->d_name);
    closedir(d);
}

static void assert_absent(const char *name)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    if (access(p, F_OK) == 0)
        fail_msg("%s exists after a failed quantize", p);
}

static void test_cli_errors(void **state)
{
    (void)state;
    sh(1, "%s/strata quantize --help | grep -q 'strata quantize IN OUT TYPE'", BIN);
    sh(0, "%s/strata quantize '%s' '%s/e1.gguf' Q9_K", BIN, g_f32, g_dir);
    assert_non_null(strstr(out, "unknown weight type \"Q9_K\""));
    assert_absent("e1.gguf");
    sh(1, "echo 'not a model' > '%s/junk.bin'", g_dir);
    sh(0, "%s/strata quantize '%s/junk.bin' '%s/e2.gguf' Q8_0", BIN, g_dir, g_dir);
    assert_non_null(strstr(out, "not a GGUF file"));
    assert_absent("e2.gguf");
    sh(0, "%s/strata quantize '%s' '%s/no/such/dir/e3.gguf' Q8_0", BIN, g_f32, g_dir);
    assert_non_null(strstr(out, "does not exist"));
    sh(0, "%s/strata quantize '%s/missing.gguf' '%s/e4.gguf' Q8_0", BIN, g_dir, g_dir);
    assert_absent("e4.gguf");
    /* a NaN in a weight: refused naming the tensor, after the write began; nothing left */
    size_t len;
    unsigned char *buf = slurp("f32.gguf", &len);
    st_gguf *g = NULL;
    assert_int_equal(st_gguf_open_mem(buf, len, &g), 0);
    const st_gguf_tensor *t = st_gguf_tensor_find(g, "blk.1.ffn_up.weight");
    size_t at = (size_t)((const unsigned char *)t->data - buf) + 4 * 1000;
    st_gguf_close(g);
    float nan = NAN;
    memcpy(buf + at, &nan, 4);
    char p[4300];
    snprintf(p, sizeof p, "%s/nan.gguf", g_dir);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(buf, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
    free(buf);
    sh(0, "%s/strata quantize '%s' '%s/e5.gguf' Q4_K", BIN, p, g_dir);
    assert_non_null(strstr(out, "blk.1.ffn_up.weight"));
    assert_non_null(strstr(out, "non-finite"));
    assert_absent("e5.gguf");
    assert_no_temp();
}

/* strata-mkmodel --wtype TYPE == strata quantize of the same seeded f32 model, byte for byte;
 * its f16 output is the seeded writer's own (unchanged). */
static void test_mkmodel_wtype(void **state)
{
    (void)state;
    sh(1, "cd '%s' && %s/strata-mkmodel --preset tiny --seed 3 --embd 256 -o mk_f32.gguf && "
       "%s/strata-mkmodel --preset tiny --seed 3 --embd 256 --wtype q4_K -o mk_q4k.gguf && "
       "%s/strata quantize mk_f32.gguf mk_f32_q4k.gguf Q4_K && cmp mk_q4k.gguf mk_f32_q4k.gguf",
       g_dir, BIN, BIN, BIN);
    sh(1, "cd '%s' && %s/strata-mkmodel --preset tiny --seed 3 --wtype IQ4_NL -o mk_iq.gguf && "
       "%s/strata-mkmodel --preset tiny --seed 3 -o mk_t.gguf && "
       "%s/strata quantize mk_t.gguf mk_t_iq.gguf iq4_nl && cmp mk_iq.gguf mk_t_iq.gguf",
       g_dir, BIN, BIN, BIN);
    char path[4300];
    snprintf(path, sizeof path, "%s/mk_f32.gguf", g_dir);
    assert_int_equal(compare_files(path, "mk_q4k.gguf", Q4_K), 0);
    sh(0, "%s/strata-mkmodel --preset tiny --wtype q7 -o '%s/mk_bad.gguf'", BIN, g_dir);
    assert_non_null(strstr(out, "unknown weight type"));
    assert_absent("mk_bad.gguf");
    /* f16 as before: the seeded writer's bytes */
    sh(1, "cd '%s' && %s/strata-mkmodel --preset tiny --seed 3 --wtype f16 -o mk_f16.gguf",
       g_dir, BIN);
    st_model_hparams hp;
    assert_int_equal(st_model_preset("tiny", &hp), 0);
    hp.wtype = ST_GGML_F16;
    snprintf(path, sizeof path, "%s/mk_f16_lib.gguf", g_dir);
    assert_int_equal(st_model_write_seeded(&hp, 3, "strata-hybrid tiny (seed 3)", path), 0);
    sh(1, "cmp '%s/mk_f16.gguf' '%s'", g_dir, path);
    assert_no_temp();
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_type_equals_ggml),
        cmocka_unit_test(test_f32_set_and_fallbacks),
        cmocka_unit_test(test_requantize),
        cmocka_unit_test(test_negative_controls),
        cmocka_unit_test(test_cli_errors),
        cmocka_unit_test(test_mkmodel_wtype),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
