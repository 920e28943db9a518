/*
 * test_engine_model.c - the model and the CPU backend: results bit-identical across thread
 * counts, prompt chunk sizes and the scalar / vector kernels; odd shapes, int8 K/V, f16 and bf16
 * weights, quantized weights (Q8_0; Q4_K and Q6_K on strata-hybrid and qwen35 rows of 256, so
 * the K-quants are used as such; each of the twelve quantized types gives the logits of its F32
 * twin, the same values dequantized, bit for bit); the CUDA backend's refusal of quantized
 * weights; the DeltaNet step against a direct evaluation of its formula; the delta-rule
 * operation's key-head mapping; fingerprints, presets, the published geometry and sampling.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine_test.h"
#include "st_engine_int.h"
#include "st_ops_int.h"
#include "st_wtype.h"

static char g_dir[4096];

static const char *k_text = "The quick brown fox jumps over the lazy dog; 0123456789 and more "
                            "text to read past a few chunks of the prompt.";

/* The prompt of the quantized models' tests (their widths make a token costlier). */
static const char *k_text_short = "Quantized: 0123456789, and a few more words.";

/* Read the prompt, generate n_gen greedy tokens; return every logit vector concatenated. */
static float *run_text(const char *model, const st_engine_opts *o, uint32_t n_gen,
                       uint32_t *gen_out, const char *text)
{
    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    uint32_t toks[512];
    uint64_t n = et_tokens(toks, text);
    assert_int_equal(st_model_load(model, &m), 0);
    int rc = st_engine_new(m, o, &e);
    if (rc)
        fail_msg("engine: %s", st_errdetail());
    assert_int_equal(st_slot_new(e, &s), 0);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    float *all = malloc((size_t)(n_gen + 1) * V * sizeof *all);
    assert_non_null(all);
    assert_int_equal(st_slot_eval(s, toks, n, 0, NULL), 0);
    for (uint32_t i = 0; i <= n_gen; i++) {
        uint32_t nl = 0;
        const float *l = st_slot_logits(s, &nl);
        assert_int_equal(nl, V);
        memcpy(all + (size_t)i * V, l, V * sizeof *l);
        for (uint32_t k = 0; k < V; k++)
            assert_true(isfinite(l[k]));
        if (i == n_gen)
            break;
        uint32_t t;
        assert_int_equal(st_slot_sample(s, 0.0f, 0, &t), 0);
        if (gen_out)
            gen_out[i] = t;
        assert_int_equal(st_slot_decode(s, t), 0);
    }
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
    return all;
}

/* quant_f32: the path quantized weights take (st_engine_opts.quant_f32). */
static void check_invariance_path(const char *model, uint32_t V, const char *text, int quant_f32)
{
    st_engine_opts base;
    st_engine_opts_default(&base);
    base.quant_f32 = quant_f32;
    base.n_threads = 1;
    base.force_scalar = 1;
    const uint32_t n_gen = 6;
    float *ref = run_text(model, &base, n_gen, NULL, text);
    /* isa: 0 the best this CPU has (AVX-512 VNNI where present), 1 scalar, 2 at most AVX2 */
    struct {
        uint32_t threads, ubatch;
        int isa;
    } v[] = {{1, 2048, 0}, {2, 2048, 0}, {3, 2048, 0}, {2, 1, 0}, {3, 5, 0},
             {1, 7, 1},    {4, 3, 1},    {2, 64, 0},   {2, 2048, 2}, {3, 5, 2}};
    static const char *const isa[] = {"best vector", "scalar", "AVX2 (no AVX-512)"};
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        st_engine_opts o = base;
        o.n_threads = v[i].threads;
        o.ubatch = v[i].ubatch;
        o.force_scalar = v[i].isa == 1;
        o.no_avx512 = v[i].isa == 2;
        float *got = run_text(model, &o, n_gen, NULL, text);
        if (memcmp(ref, got, (size_t)(n_gen + 1) * V * sizeof *ref) != 0)
            fail_msg("logits differ with %u threads, ubatch %u, %s kernels", v[i].threads,
                     v[i].ubatch, isa[v[i].isa]);
        free(got);
    }
    free(ref);
}

static void check_invariance_text(const char *model, uint32_t V, const char *text)
{
    check_invariance_path(model, V, text, 0);
}

static void check_invariance(const char *model, uint32_t V)
{
    check_invariance_text(model, V, k_text);
}

static void test_invariance_tiny(void **state)
{
    char path[4200];
    et_model(path, sizeof path, g_dir, "tiny.gguf", 1, NULL);
    check_invariance(path, ST_VOCAB_BYTES);
}

static void odd(st_model_hparams *hp)
{
    hp->n_vocab = 300;
    hp->n_embd = 36;
    hp->n_ff = 44;
    hp->n_layer = 3;
    snprintf(hp->pattern, sizeof hp->pattern, "DAD");
    hp->n_head = 3;
    hp->n_head_kv = 1;
    hp->head_dim = 6;
    hp->ssm_heads = 3;
    hp->ssm_dk = 5;
    hp->ssm_dv = 12;
}

static void test_invariance_odd_shapes(void **state)
{
    char path[4200];
    et_model(path, sizeof path, g_dir, "odd.gguf", 3, odd);
    check_invariance(path, 300);
}

static void i8_f16w(st_model_hparams *hp)
{
    hp->kv_dtype = ST_DTYPE_I8;
    hp->wtype = ST_GGML_F16;
}

static void bf16w(st_model_hparams *hp)
{
    hp->wtype = ST_GGML_BF16;
    snprintf(hp->pattern, sizeof hp->pattern, "AD");
}

static void test_invariance_i8_f16_bf16(void **state)
{
    char path[4200];
    et_model(path, sizeof path, g_dir, "i8.gguf", 5, i8_f16w);
    check_invariance(path, ST_VOCAB_BYTES);
    et_model(path, sizeof path, g_dir, "bf16.gguf", 6, bf16w);
    check_invariance(path, ST_VOCAB_BYTES);
}

/* Rows of 256 everywhere (embedding, feed-forward, attention 4 x 64, DeltaNet 4 x 64 x 64), so
 * every K-quant applies without fallback; the vocabulary (259 rows) leaves partial row tiles. */
static void rows256(st_model_hparams *hp)
{
    hp->n_embd = 256;
    hp->n_ff = 256;
    hp->n_layer = 2;
    snprintf(hp->pattern, sizeof hp->pattern, "DA");
    hp->n_head = 4;
    hp->n_head_kv = 2;
    hp->head_dim = 64;
    hp->ssm_heads = 4;
    hp->ssm_dk = 64;
    hp->ssm_dv = 64;
}

/* The f32 model at f32 quantized to `type` (as strata quantize does) at dir/name. */
static void quantized(char *dst, size_t cap, const char *f32, const char *name, uint32_t type)
{
    snprintf(dst, cap, "%s/%s", g_dir, name);
    st_quantize_stats qs;
    if (st_gguf_quantize(f32, dst, type, NULL, &qs))
        fail_msg("quantize %s: %s", name, st_errdetail());
    assert_int_equal(qs.n_fallback, 0);
    assert_true(qs.n_quantized > 0);
}

static void test_invariance_quantized(void **state)
{
    char f32[4200], path[4200];
    et_model(f32, sizeof f32, g_dir, "q64.gguf", 8, NULL);
    quantized(path, sizeof path, f32, "q64_q8_0.gguf", ST_GGML_Q8_0);
    check_invariance_text(path, ST_VOCAB_BYTES, k_text_short);
    check_invariance_path(path, ST_VOCAB_BYTES, k_text_short, 1);
    et_model(f32, sizeof f32, g_dir, "r256.gguf", 8, rows256);
    quantized(path, sizeof path, f32, "r256_q4_K.gguf", ST_GGML_Q4_K);
    check_invariance_text(path, ST_VOCAB_BYTES, k_text_short);
    check_invariance_path(path, ST_VOCAB_BYTES, k_text_short, 1);
    /* the Qwen hybrid layers (fused DeltaNet projection, gated attention, key heads != value
     * heads) on a K-quant */
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("qwen35", "qwen35-tiny-q", &hp), 0);
    hp.n_layer = 2;
    snprintf(hp.pattern, sizeof hp.pattern, "DA");
    snprintf(f32, sizeof f32, "%s/qn.gguf", g_dir);
    assert_int_equal(st_model_write_seeded(&hp, 9, "qn", f32), 0);
    quantized(path, sizeof path, f32, "qn_q6_K.gguf", ST_GGML_Q6_K);
    check_invariance_text(path, hp.n_vocab, k_text_short);
    check_invariance_path(path, hp.n_vocab, k_text_short, 1);
}

/* Logits after the prompt and a few greedy tokens, with the vector kernels on 2 threads;
 * quant_f32 as st_engine_opts.quant_f32. */
static float *run_default(const char *model, uint32_t n_gen, int quant_f32)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = 2;
    o.quant_f32 = quant_f32;
    return run_text(model, &o, n_gen, NULL, k_text_short);
}

/* Every quantized type: `strata quantize q twin F32` holds exactly the dequantized values, and
 * on the f32 path (quant_f32) the engine computes on the quantized file what it computes on that
 * twin, bit for bit (f32 on the dequantized weights: docs/ENGINE.md, "Weight types"). The
 * default is the f32 path too for the types without an integer path, and differs from it for
 * those with one (Q8_0, Q4_K, Q6_K: the activations are quantized). */
static void test_quantized_equals_f32_twin(void **state)
{
    static const uint32_t types[] = {ST_GGML_Q8_0, ST_GGML_Q4_0, ST_GGML_Q4_1, ST_GGML_Q5_0,
                                     ST_GGML_Q5_1, ST_GGML_Q2_K, ST_GGML_Q3_K, ST_GGML_Q4_K,
                                     ST_GGML_Q5_K, ST_GGML_Q6_K, ST_GGML_IQ4_NL, ST_GGML_IQ4_XS};
    char f32_64[4200], f32_256[4200], q[4200], twin[4200], name[64];
    et_model(f32_64, sizeof f32_64, g_dir, "t64.gguf", 10, NULL);
    et_model(f32_256, sizeof f32_256, g_dir, "t256.gguf", 10, rows256);
    const uint32_t n_gen = 3, V = ST_VOCAB_BYTES;
    for (size_t i = 0; i < sizeof types / sizeof types[0]; i++) {
        const char *tn = st_gguf_type_name(types[i]);
        /* the tiny preset's rows of 64 for the types of 32-value blocks, rows of 256 for the
         * others */
        const char *f32 = st_wtype_get(types[i])->block == 32 ? f32_64 : f32_256;
        snprintf(name, sizeof name, "t_%s.gguf", tn);
        quantized(q, sizeof q, f32, name, types[i]);
        snprintf(name, sizeof name, "t_%s_twin.gguf", tn);
        snprintf(twin, sizeof twin, "%s/%s", g_dir, name);
        assert_int_equal(st_gguf_quantize(q, twin, ST_GGML_F32, NULL, NULL), 0);
        st_gguf *gq = NULL, *gt = NULL;
        assert_int_equal(st_gguf_open(q, &gq), 0);
        assert_int_equal(st_gguf_open(twin, &gt), 0);
        uint64_t n_q = 0;
        for (uint64_t k = 0; k < st_gguf_n_tensors(gq); k++) {
            const st_gguf_tensor *a = st_gguf_tensor_at(gq, k);
            const st_gguf_tensor *b = st_gguf_tensor_find(gt, a->name);
            assert_non_null(b);
            assert_int_equal(b->type, ST_GGML_F32);
            uint64_t n = 1;
            for (uint32_t d = 0; d < a->n_dims; d++)
                n *= a->dims[d];
            float *v = malloc(n * sizeof *v);
            assert_non_null(v);
            st_wtype_get(a->type)->dequant[0](a->data, v, n);
            if (memcmp(v, b->data, n * sizeof *v))
                fail_msg("%s: the F32 twin of %s is not its dequantized values", a->name, tn);
            free(v);
            n_q += a->type == types[i];
        }
        assert_true(n_q > 0);
        st_gguf_close(gq);
        st_gguf_close(gt);
        float *lq = run_default(q, n_gen, 1), *lt = run_default(twin, n_gen, 1);
        float *ld = run_default(q, n_gen, 0);
        size_t bytes = (size_t)(n_gen + 1) * V * sizeof *lq;
        if (memcmp(lq, lt, bytes))
            fail_msg("%s: logits differ from those of the F32 twin", tn);
        if (!memcmp(ld, lq, bytes) != !st_qdot_get(types[i]))
            fail_msg("%s: the default path %s the f32 path", tn,
                     st_qdot_get(types[i]) ? "is" : "is not");
        free(lq);
        free(lt);
        free(ld);
    }
}

/* The CUDA backend computes every architecture of the engine on every weight type it computes
 * with (strata-hybrid's own forward pass or the operation table); a file of another
 * architecture is refused naming it (the tools and the server then choose the CPU backend). */
static void test_cuda_check(void **state)
{
    char f32[4200], q[4200];
    st_gguf *g = NULL;
    et_model(f32, sizeof f32, g_dir, "c.gguf", 11, i8_f16w);
    assert_int_equal(st_gguf_open(f32, &g), 0);
    assert_int_equal(st_engine_cuda_check(g), 0);
    st_gguf_close(g);
    quantized(q, sizeof q, f32, "c_q4_0.gguf", ST_GGML_Q4_0);
    assert_int_equal(st_gguf_open(q, &g), 0);
    assert_int_equal(st_engine_cuda_check(g), 0);
    st_gguf_close(g);
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("llama", "tiny", &hp), 0);
    snprintf(q, sizeof q, "%s/c_llama.gguf", g_dir);
    assert_int_equal(st_model_write_seeded(&hp, 1, "c", q), 0);
    assert_int_equal(st_gguf_open(q, &g), 0);
    assert_int_equal(st_engine_cuda_check(g), 0);
    st_gguf_close(g);
    /* a shape beyond the GPU's kernels: attention heads of 512 */
    hp.head_dim = 512;
    snprintf(q, sizeof q, "%s/c_llama512.gguf", g_dir);
    assert_int_equal(st_model_write_seeded(&hp, 1, "c", q), 0);
    assert_int_equal(st_gguf_open(q, &g), 0);
    assert_int_equal(st_engine_cuda_check(g), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "head_dim 512"));
    st_gguf_close(g);
    /* the control: an architecture the engine does not have */
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_writer_new(&w, 0), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", "mamba2"), 0);
    snprintf(q, sizeof q, "%s/c_mamba2.gguf", g_dir);
    assert_int_equal(st_gguf_writer_write(w, q), 0);
    st_gguf_writer_free(w);
    assert_int_equal(st_gguf_open(q, &g), 0);
    assert_int_equal(st_engine_cuda_check(g), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "architecture mamba2"));
    st_gguf_close(g);
}

/* The kernel's step against S_t = a S (I - b k k^T) + b v k^T, o = S_t q, in double. */
static void test_deltanet_formula(void **state)
{
    const uint32_t dk = 11, dv = 13;
    float M[11 * 13], Mv[11 * 13], k[11], q[11], v[13], out[13], outv[13], scr[26];
    double S[13][11], Sn[13][11];
    uint64_t r = 99;
    for (uint32_t i = 0; i < dk * dv; i++) {
        r = r * 6364136223846793005ull + 1;
        M[i] = (float)((double)(r >> 40) / (double)(1u << 24) - 0.5);
    }
    double nk = 0;
    for (uint32_t i = 0; i < dk; i++) {
        k[i] = (float)sin(i + 1.0);
        q[i] = (float)cos(i * 0.7);
        nk += (double)k[i] * k[i];
    }
    for (uint32_t i = 0; i < dk; i++)
        k[i] = (float)(k[i] / sqrt(nk));
    for (uint32_t j = 0; j < dv; j++)
        v[j] = (float)(0.1 * j - 0.4);
    float a = 0.93f, b = 0.4f;
    for (uint32_t j = 0; j < dv; j++)
        for (uint32_t i = 0; i < dk; i++)
            S[j][i] = M[i * dv + j];
    /* S (I - b k k^T) */
    for (uint32_t j = 0; j < dv; j++)
        for (uint32_t i = 0; i < dk; i++) {
            double acc = 0;
            for (uint32_t l = 0; l < dk; l++)
                acc += S[j][l] * ((l == i ? 1.0 : 0.0) - (double)b * k[l] * k[i]);
            Sn[j][i] = a * acc + (double)b * v[j] * k[i];
        }
    memcpy(Mv, M, sizeof M);
    st_kern ks = {0, 0, 0}, kv = {st_kern_cpu_has_avx2(), 0, 0};
    st_kern_delta_scan(&ks, M, dv, dk, dv, 1, q, k, v, 0, &a, &b, 0, out, 0, scr);
    st_kern_delta_scan(&kv, Mv, dv, dk, dv, 1, q, k, v, 0, &a, &b, 0, outv, 0, scr);
    assert_memory_equal(M, Mv, sizeof M);
    assert_memory_equal(out, outv, sizeof out);
    for (uint32_t j = 0; j < dv; j++) {
        double o = 0;
        for (uint32_t i = 0; i < dk; i++) {
            assert_true(fabs(M[i * dv + j] - Sn[j][i]) < 1e-5);
            o += Sn[j][i] * q[i];
        }
        assert_true(fabs(out[j] - o) < 1e-5);
    }
}

/* Three tokens in one scan equal three scans of one token, in both kernels. */
static void test_deltanet_scan_chunking(void **state)
{
    const uint32_t dk = 9, dv = 20, T = 3, xs = 64;
    float x[3 * 64], al[3] = {0.9f, 0.5f, 0.99f}, be[3] = {0.3f, 0.7f, 0.1f};
    float M1[9 * 20], M2[9 * 20], o1[3 * 20], o2[3 * 20], scr[40];
    for (uint32_t i = 0; i < sizeof x / sizeof x[0]; i++)
        x[i] = (float)sin(i * 0.37) * 0.5f;
    for (int vec = 0; vec < 2; vec++) {
        st_kern k = {vec && st_kern_cpu_has_avx2(), 0, 0};
        for (uint32_t i = 0; i < dk * dv; i++)
            M1[i] = M2[i] = (float)cos(i * 0.11) * 0.1f;
        st_kern_delta_scan(&k, M1, dv, dk, dv, T, x, x + 16, x + 32, xs, al, be, 1, o1, dv, scr);
        for (uint32_t t = 0; t < T; t++)
            st_kern_delta_scan(&k, M2, dv, dk, dv, 1, x + t * xs, x + 16 + t * xs, x + 32 + t * xs, 0,
                               al + t, be + t, 0, o2 + t * dv, 0, scr);
        assert_memory_equal(M1, M2, sizeof M1);
        assert_memory_equal(o1, o2, sizeof o1);
        /* columns in two blocks (11 and 9 wide) of the same matrix */
        for (uint32_t i = 0; i < dk * dv; i++)
            M2[i] = (float)cos(i * 0.11) * 0.1f;
        st_kern_delta_scan(&k, M2, dv, dk, 11, T, x, x + 16, x + 32, xs, al, be, 1, o2, dv, scr);
        st_kern_delta_scan(&k, M2 + 11, dv, dk, 9, T, x, x + 16, x + 32 + 11, xs, al, be, 1,
                           o2 + 11, dv, scr);
        assert_memory_equal(M1, M2, sizeof M1);
        assert_memory_equal(o1, o2, sizeof o1);
    }
}

/* Several tokens over 16-, 8- and 1-column blocks (dv = 27 of a row of 40): the vector kernel
 * (column blocks in registers, every token over one block before the next) gives the scalar
 * reference's bits, for M, the outputs and the untouched columns beyond dv. */
static void test_deltanet_scan_blocks(void **state)
{
    enum { DK = 9, DV = 27, LDM = 40, T = 5, XS = 100 };
    float x[T * XS], al[T], be[T], Ms[DK * LDM], Mv[DK * LDM], os[T * DV], ov[T * DV];
    float scr[2 * DV];
    if (!st_kern_cpu_has_avx2())
        skip();
    for (uint32_t i = 0; i < T * XS; i++)
        x[i] = (float)sin(i * 0.29) * 0.45f;
    for (uint32_t t = 0; t < T; t++) {
        al[t] = 0.6f + 0.07f * (float)t;
        be[t] = 0.2f + 0.15f * (float)t;
    }
    for (uint32_t i = 0; i < DK * LDM; i++)
        Ms[i] = Mv[i] = (float)cos(i * 0.13) * 0.2f;
    st_kern ks = {0, 0, 0}, kv = {1, 0, 0};
    st_kern_delta_scan(&ks, Ms, LDM, DK, DV, T, x, x + 10, x + 20, XS, al, be, 1, os, DV, scr);
    st_kern_delta_scan(&kv, Mv, LDM, DK, DV, T, x, x + 10, x + 20, XS, al, be, 1, ov, DV, scr);
    assert_memory_equal(Ms, Mv, sizeof Ms);
    assert_memory_equal(os, ov, sizeof os);
    for (uint32_t i = 0; i < DK; i++)
        for (uint32_t j = DV; j < LDM; j++)
            assert_true(Ms[i * LDM + j] == (float)cos((i * LDM + j) * 0.13) * 0.2f);
}

/* The CPU delta-rule operation with fewer key heads than value heads (Hk = 2, Hv = 6, as
 * Qwen3.5 files have): value head h reads key head h mod Hk, and equals the kernel run on that
 * head alone; the grouped mapping h / (Hv / Hk) (a wrong one for the tiled layout) must differ. */
static void test_ops_delta_rule_heads(void **state)
{
    enum { HK = 2, HV = 6, DK = 8, DV = 12, T = 5, LD = 2 * HK * DK + HV * DV };
    static float x[T * LD], g[T * 2 * HV], out[T * HV * DV], ref[T * HV * DV];
    static float S[HV * DK * DV], Sr[HV * DK * DV], scr[2 * DV];
    for (uint32_t i = 0; i < T * LD; i++)
        x[i] = (float)sin(i * 0.61) * 0.4f;
    for (uint32_t i = 0; i < T * 2 * HV; i++)
        g[i] = 0.5f + 0.45f * (float)cos(i * 1.3);
    for (uint32_t i = 0; i < HV * DK * DV; i++)
        S[i] = (float)cos(i * 0.07) * 0.1f;
    st_mem_layer ml = {.kind = ST_MEM_REC, .ssm_heads = HV, .ssm_dk = DK, .ssm_dv = DV};
    st_mem_spec ms = {.n_layer = 1, .n_rec = 1, .layer = &ml};
    st_pool *pool = NULL;
    st_ops_cpu *oc = NULL;
    st_kern k = {st_kern_cpu_has_avx2(), 0, 0};
    assert_int_equal(st_pool_new(3, &pool), 0);
    assert_int_equal(st_ops_cpu_new(&k, pool, &ms, 64, 1, 0, &oc), 0);
    for (int grouped = 0; grouped < 2; grouped++) {
        memcpy(Sr, S, sizeof S);
        for (uint32_t h = 0; h < HV; h++) {
            uint32_t kh = grouped ? h / (HV / HK) : h % HK;
            st_kern_delta_scan(&k, Sr + h * DK * DV, DV, DK, DV, T, x + kh * DK,
                               x + HK * DK + kh * DK, x + 2 * HK * DK + h * DV, LD, g + h,
                               g + HV + h, 2 * HV, ref + h * DV, HV * DV, scr);
        }
        float St[HV * DK * DV];
        memcpy(St, S, sizeof S);
        const st_dn_args a = {.state = St, .q = x, .k = x + HK * DK, .v = x + 2 * HK * DK,
                              .ld = LD, .alpha = g, .beta = g + HV, .ld_g = 2 * HV, .out = out,
                              .ld_out = HV * DV, .n_k_heads = HK, .n_v_heads = HV, .dk = DK,
                              .dv = DV, .T = T};
        st_ops_cpu_table.delta_rule(oc, &a);
        if (grouped) {
            assert_memory_not_equal(out, ref, sizeof out);
        } else {
            assert_memory_equal(out, ref, sizeof out);
            assert_memory_equal(St, Sr, sizeof St);
        }
    }
    st_ops_cpu_free(oc);
    st_pool_free(pool);
}

static void test_fingerprint(void **state)
{
    char a[4200], b[4200], c[4200];
    et_model(a, sizeof a, g_dir, "fa.gguf", 7, NULL);
    et_model(b, sizeof b, g_dir, "fb.gguf", 7, NULL);
    et_model(c, sizeof c, g_dir, "fc.gguf", 8, NULL);
    st_model *ma = NULL, *mb = NULL, *mc = NULL;
    assert_int_equal(st_model_load(a, &ma), 0);
    assert_int_equal(st_model_load(b, &mb), 0);
    assert_int_equal(st_model_load(c, &mc), 0);
    assert_memory_equal(st_model_fingerprint(ma), st_model_fingerprint(mb), ST_FINGERPRINT_LEN);
    assert_memory_not_equal(st_model_fingerprint(ma), st_model_fingerprint(mc),
                            ST_FINGERPRINT_LEN);
    char hex[65];
    st_hex_encode(hex, st_model_fingerprint(ma), ST_FINGERPRINT_LEN);
    assert_int_equal(strlen(hex), 64);
    st_model_free(ma);
    st_model_free(mb);
    st_model_free(mc);
}

static void test_presets(void **state)
{
    st_model_hparams hp;
    assert_int_equal(st_model_preset("bench", &hp), 0);
    assert_int_equal(st_model_hparams_check(&hp), 0);
    uint64_t sb = st_model_state_bytes(&hp);
    assert_true(sb > 115000000ull && sb < 121000000ull);
    assert_int_equal(st_model_kv_bytes_per_token(&hp, ST_DTYPE_F16), 15360);
    assert_int_equal(st_model_preset("small", &hp), 0);
    assert_int_equal(st_model_hparams_check(&hp), 0);
    assert_true(st_model_n_params(&hp) > 1000000 && st_model_n_params(&hp) < 20000000);
    assert_int_equal(st_model_preset("huge", &hp), ST_EINVAL);
    assert_int_equal(st_model_preset("tiny", &hp), 0);
    snprintf(hp.pattern, sizeof hp.pattern, "DXA");
    assert_int_equal(st_model_hparams_check(&hp), ST_EINVAL);
    assert_int_equal(st_model_preset("tiny", &hp), 0);
    hp.n_head_kv = 3;
    assert_int_equal(st_model_hparams_check(&hp), ST_EINVAL);
}

static void test_geometry_published(void **state)
{
    char path[4200];
    et_model(path, sizeof path, g_dir, "geo.gguf", 1, NULL);
    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    assert_int_equal(st_model_load(path, &m), 0);
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = 1;
    o.page_size = 64;
    o.kv_dtype = ST_DTYPE_I8;
    assert_int_equal(st_engine_new(m, &o, &e), 0);
    assert_int_equal(st_slot_new(e, &s), 0);
    const st_geometry *g = st_slot_geometry(s);
    assert_int_equal(st_geometry_check(g), 0);
    assert_int_equal(g->page_size, 64);
    assert_int_equal(g->n_ctx, 2048);
    assert_int_equal(g->n_vocab, ST_VOCAB_BYTES);
    assert_memory_equal(g->model_fp, st_model_fingerprint(m), ST_FINGERPRINT_LEN);
    uint64_t running = 0;
    int saw_k = 0, saw_scale = 0, saw_pos = 0;
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *d = &g->tensors[i];
        if (d->role == ST_ROLE_RUNNING)
            running += st_tensor_elems(d) * st_dtype_size(d->dtype);
        if (!strcmp(d->name, "blk.0.ssm_state")) {
            assert_int_equal(d->ndim, 3);
            assert_int_equal(d->shape[0], 2);
            assert_int_equal(d->shape[1], 16);
            assert_int_equal(d->shape[2], 16);
        }
        if (!strcmp(d->name, "blk.0.conv_state")) {
            assert_int_equal(d->shape[0], 3);
            assert_int_equal(d->shape[1], 2 * (16 + 16 + 16));
        }
        if (!strcmp(d->name, "blk.3.k")) {
            saw_k = 1;
            assert_int_equal(d->role, ST_ROLE_KV);
            assert_int_equal(d->dtype, ST_DTYPE_I8);
            assert_int_equal(d->shape[0], 2048);
            assert_int_equal(st_tensor_row_bytes(d), 2 * 16);
        }
        if (!strcmp(d->name, "blk.3.k_scale")) {
            saw_scale = 1;
            assert_int_equal(d->dtype, ST_DTYPE_F32);
            assert_int_equal(st_tensor_row_bytes(d), 2 * 4);
        }
        if (!strcmp(d->name, "pos")) {
            saw_pos = 1;
            assert_int_equal(d->dtype, ST_DTYPE_I64);
        }
    }
    assert_true(saw_k && saw_scale && saw_pos);
    assert_int_equal(running, st_model_state_bytes(st_model_hparams_get(m)));
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
}

static void test_sampling(void **state)
{
    char path[4200];
    et_model(path, sizeof path, g_dir, "samp.gguf", 1, NULL);
    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    assert_int_equal(st_model_load(path, &m), 0);
    assert_int_equal(st_engine_new(m, NULL, &e), 0);
    assert_int_equal(st_slot_new(e, &s), 0);
    uint32_t t;
    assert_int_equal(st_slot_sample(s, 0.0f, 1, &t), ST_EINVAL); /* no logits yet */
    uint32_t toks[256];
    uint64_t n = et_tokens(toks, "sampling");
    assert_int_equal(st_slot_eval(s, toks, n, 0, NULL), 0);
    uint32_t nl;
    const float *l = st_slot_logits(s, &nl);
    uint32_t best = 0;
    for (uint32_t i = 1; i < nl; i++)
        if (l[i] > l[best])
            best = i;
    assert_int_equal(st_slot_sample(s, 0.0f, 1, &t), 0);
    assert_int_equal(t, best);
    uint32_t a, b, differ = 0;
    for (uint64_t seed = 0; seed < 32; seed++) {
        assert_int_equal(st_slot_sample(s, 1.0f, seed, &a), 0);
        assert_int_equal(st_slot_sample(s, 1.0f, seed, &b), 0);
        assert_int_equal(a, b);
        assert_true(a < nl);
        differ += a != best;
    }
    assert_true(differ > 0);
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
}

static int setup(void **state)
{
    st_test_tmpdir(g_dir, sizeof g_dir, "engine_model");
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
        cmocka_unit_test(test_invariance_tiny),
        cmocka_unit_test(test_invariance_odd_shapes),
        cmocka_unit_test(test_invariance_i8_f16_bf16),
        cmocka_unit_test(test_invariance_quantized),
        cmocka_unit_test(test_quantized_equals_f32_twin),
        cmocka_unit_test(test_cuda_check),
        cmocka_unit_test(test_deltanet_formula),
        cmocka_unit_test(test_deltanet_scan_chunking),
        cmocka_unit_test(test_deltanet_scan_blocks),
        cmocka_unit_test(test_ops_delta_rule_heads),
        cmocka_unit_test(test_fingerprint),
        cmocka_unit_test(test_presets),
        cmocka_unit_test(test_geometry_published),
        cmocka_unit_test(test_sampling),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
