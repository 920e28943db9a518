/*
 * test_gpu_arch.c - every architecture of the engine on the CUDA backend's operation table
 * (engine/st_ops_cuda.cu, st_backend_cuda.cu invariant 8), against the CPU backend:
 * - logits of a prompt read in chunks of 64 and in one chunk (the products and attention of
 *   many tokens: f16 tiles and attention on the tensor cores by default, f32 tiles, SGEMM and
 *   CUDA-core attention with STRATA_CUDA_PREFILL=f32) and of teacher-forced decode
 *   steps (one token: the quantized matrix-vector kernels) agree with the CPU's (weights
 *   computed in f32 on their dequantized values: quant_f32) within ARCH_TOL_F16 and ARCH_TOL
 *   (max |logit difference| / max |CPU logit|, printed), for llama, qwen3, qwen35, qwen35moe,
 *   qwen3next (fused and legacy projections) and quantized strata-hybrid, on f32, f16, bf16 and
 *   every quantized weight type, f16 and i8 K/V;
 * - the control: the same comparison against a model of another seed fails the tolerance;
 * - the same inputs and chunks give the same bits (two engines), and a decode step replayed as a
 *   CUDA graph gives the bits of the same step launched directly (STRATA_CUDA_GRAPHS=1 against unset);
 * - programmatic dependent launch (the default on the H200) gives the bits of launches without it
 *   (STRATA_CUDA_PDL=0), directly and in graphs;
 * - a session saved on either backend restores on the other (the state hash verified by the
 *   restore) and continues within ARCH_TOL of the saving backend.
 * Runs only under the ctest label `gpu`. Without a usable CUDA device it FAILS, it never skips.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine/engine_test.h"
#include "st_engine_int.h"
#include "st_ops_int.h"
#include "st_wtype.h"
#include "gpu_test.h"

/* max |GPU logit - CPU logit| over max |CPU logit|: with STRATA_CUDA_PREFILL=f32 both compute
 * in f32 on the same weight values, in other orders (ARCH_TOL); in the f16 mode, the default, the
 * GPU's products and attention of several tokens (the prompt's chunks) round weights, activations,
 * queries and softmax weights to f16 for the tensor cores (st_ops_cuda.cu invariants 2 and 9):
 * ARCH_TOL_F16, about 5x the worst measured (1.05e-3 on the H100, session 20) */
#define ARCH_TOL 5e-3
#define ARCH_TOL_F16 5e-3

static char g_dir[4096];

typedef struct acase {
    const char *arch, *preset;
    uint32_t wtype, kv_dtype;
    void (*tweak)(st_model_hparams *hp);
} acase;

/* The delta rule's three forms: keys of 8 x 2^k split over warps (256 x 256: the widest);
 * other widths one thread per column, the matrix in shared memory (24 x 24) or, beyond it
 * (240 x 240: 225 KiB and the vectors), in place in global memory */
static void big_heads(st_model_hparams *hp)
{
    hp->ssm_dk = 256;
    hp->ssm_dv = 256;
}

static void odd_heads(st_model_hparams *hp)
{
    hp->ssm_dk = 24;
    hp->ssm_dv = 24;
}

static void huge_odd_heads(st_model_hparams *hp)
{
    hp->ssm_dk = 240;
    hp->ssm_dv = 240;
}

/* attention heads of 128 and 256 (Qwen3.5's), the widest the tensor-core attention takes */
static void wide_attention(st_model_hparams *hp)
{
    hp->head_dim = hp->head_dim * 4 <= 128 ? 128 : 256;
}

static void widest_attention(st_model_hparams *hp)
{
    hp->head_dim = 256;
}

/* 4 and 8 query heads on each K/V head (llama-3's 4, Qwen3-Next's 8) */
static void grouped4(st_model_hparams *hp)
{
    hp->n_head = 8;
    hp->n_head_kv = 2;
    hp->head_dim = 32;
}

static void grouped8(st_model_hparams *hp)
{
    hp->n_head = 8;
    hp->n_head_kv = 1;
    hp->head_dim = 32;
}

static const acase k_cases[] = {
    {"llama", "tiny", ST_GGML_F32, ST_DTYPE_F16, NULL},
    {"llama", "tiny-untied", ST_GGML_BF16, ST_DTYPE_I8, NULL},
    {"llama", "tiny-q", ST_GGML_Q4_K, ST_DTYPE_F16, NULL},
    {"llama", "tiny-q", ST_GGML_Q6_K, ST_DTYPE_F16, NULL},
    {"llama", "tiny-q", ST_GGML_Q2_K, ST_DTYPE_F16, NULL},
    {"llama", "tiny-q", ST_GGML_Q3_K, ST_DTYPE_F16, NULL},
    {"llama", "tiny-q", ST_GGML_Q5_K, ST_DTYPE_F16, NULL},
    {"qwen3", "tiny", ST_GGML_F16, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny", ST_GGML_F32, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny", ST_GGML_F16, ST_DTYPE_I8, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q8_0, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q4_K, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q4_0, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q4_1, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q5_0, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_Q5_1, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_IQ4_NL, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny-q", ST_GGML_IQ4_XS, ST_DTYPE_F16, NULL},
    {"qwen35moe", "tiny", ST_GGML_F32, ST_DTYPE_F16, NULL},
    {"qwen35moe", "tiny-q", ST_GGML_Q8_0, ST_DTYPE_F16, NULL},
    {"qwen3next", "tiny", ST_GGML_F32, ST_DTYPE_F16, NULL},
    {"qwen3next", "tiny-legacy", ST_GGML_BF16, ST_DTYPE_F16, NULL},
    {"qwen3next", "tiny-q", ST_GGML_Q4_K, ST_DTYPE_F16, NULL},
    {"strata-hybrid", "tiny", ST_GGML_Q8_0, ST_DTYPE_F16, NULL},
    {"qwen35", "tiny", ST_GGML_F32, ST_DTYPE_F16, big_heads},
    {"qwen35", "tiny", ST_GGML_F32, ST_DTYPE_F16, odd_heads},
    {"qwen35", "tiny", ST_GGML_F32, ST_DTYPE_F16, huge_odd_heads},
    {"qwen35", "tiny", ST_GGML_F32, ST_DTYPE_F16, widest_attention},
    {"llama", "tiny-q", ST_GGML_Q4_K, ST_DTYPE_F16, wide_attention},
    {"llama", "tiny-q", ST_GGML_Q8_0, ST_DTYPE_F16, grouped4},
    {"llama", "tiny-q", ST_GGML_Q8_0, ST_DTYPE_F16, grouped8},
};
#define N_CASES (sizeof k_cases / sizeof k_cases[0])

static st_model *load_case(const acase *c, uint64_t seed)
{
    st_model_hparams hp;
    ST_OK(st_model_preset_arch(c->arch, c->preset, &hp));
    if (c->tweak)
        c->tweak(&hp);
    int quant = c->wtype != ST_GGML_F32 && c->wtype != ST_GGML_F16 && c->wtype != ST_GGML_BF16;
    hp.wtype = quant ? ST_GGML_F32 : c->wtype;
    hp.kv_dtype = c->kv_dtype;
    char name[160], path[4400], src[4400];
    snprintf(name, sizeof name, "%s-%s-%s-%u-%u-%u-%llu", c->arch, c->preset,
             st_gguf_type_name(c->wtype), c->kv_dtype, hp.ssm_dk, hp.ssm_dv,
             (unsigned long long)seed);
    snprintf(path, sizeof path, "%s/%s.gguf", g_dir, name);
    snprintf(src, sizeof src, "%s/%s.f32.gguf", g_dir, name);
    ST_OK(st_model_write_seeded(&hp, seed, name, quant ? src : path));
    if (quant) {
        st_quantize_stats qs;
        ST_OK(st_gguf_quantize(src, path, c->wtype, NULL, &qs));
        if (qs.n_quantized == 0)
            fail_msg("%s: nothing quantized", name);
    }
    st_model *m = NULL;
    ST_OK(st_model_load(path, &m));
    return m;
}

static st_engine *engine(const st_model *m, const char *backend, uint32_t ubatch)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = backend;
    o.ubatch = ubatch;
    o.n_ctx = 512;
    o.prompt_cache = 2;
    o.quant_f32 = 1; /* the CPU computes on the dequantized values, as the GPU does */
    st_engine *e = NULL;
    ST_OK(st_engine_new(m, &o, &e));
    return e;
}

/* n tokens in [1, V) from seed. */
static uint32_t *prompt(uint64_t n, uint32_t V, uint64_t seed)
{
    uint32_t *t = malloc(n * sizeof *t);
    assert_non_null(t);
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint64_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t[i] = 1 + (uint32_t)(x % (V - 1));
    }
    return t;
}

static double rel_err(const float *ref, const float *x, uint32_t n)
{
    double mref = 0.0, merr = 0.0;
    for (uint32_t i = 0; i < n; i++) {
        double d = fabs((double)x[i] - (double)ref[i]);
        if (!(d == d))
            fail_msg("logit %u is NaN on one side (cpu %g, gpu %g)", i, ref[i], x[i]);
        if (fabs(ref[i]) > mref)
            mref = fabs(ref[i]);
        if (d > merr)
            merr = d;
    }
    return merr / (mref > 0 ? mref : 1.0);
}

#define N_PROMPT 150
#define UBATCH 64
#define N_DEC 6

/* The prompt (three chunks) and N_DEC teacher-forced decodes on mc (CPU) and mg (GPU); the
 * largest relative error. */
static double compare_n(const st_model *mc, const st_model *mg, uint32_t ubatch, uint32_t n_prompt)
{
    uint32_t V = st_model_hparams_get(mc)->n_vocab;
    st_engine *ec = engine(mc, "cpu", ubatch), *eg = engine(mg, "cuda", ubatch);
    st_slot *sc = NULL, *sg = NULL;
    ST_OK(st_slot_new(ec, &sc));
    ST_OK(st_slot_new(eg, &sg));
    uint32_t *t = prompt(n_prompt, V, 3);
    ST_OK(st_slot_eval(sc, t, n_prompt, 0, NULL));
    ST_OK(st_slot_eval(sg, t, n_prompt, 0, NULL));
    double worst = rel_err(st_slot_logits(sc, NULL), st_slot_logits(sg, NULL), V);
    for (int i = 0; i < N_DEC; i++) {
        uint32_t tok = et_greedy(sc);
        ST_OK(st_slot_decode(sc, tok));
        ST_OK(st_slot_decode(sg, tok));
        double r = rel_err(st_slot_logits(sc, NULL), st_slot_logits(sg, NULL), V);
        worst = r > worst ? r : worst;
    }
    free(t);
    st_slot_free(sc);
    st_slot_free(sg);
    st_engine_free(ec);
    st_engine_free(eg);
    return worst;
}

static double compare(const st_model *mc, const st_model *mg, uint32_t ubatch)
{
    return compare_n(mc, mg, ubatch, N_PROMPT);
}

/* Which attention kernels a case must have run (st_ops_cuda.cu invariants 9 and 10), from the
 * process's launch counts before (b) and after (e) one comparison: one-token attention on
 * k_attn_dec for f16 K/V of head_dim 8 x 2^k and 1, 2, 4 or 8 query heads a K/V head, else on
 * k_attn; in the f16 mode the prompt's on k_attn_tc for f16 K/V of head_dim a multiple of 16
 * (the H100 and H200 have the shared memory for every width the cases have). */
static int ran_expected(const st_model_hparams *hp, int f32, const uint64_t *b, const uint64_t *e)
{
    uint32_t hd = hp->head_dim, C = hd / 8, G = hp->n_head_kv ? hp->n_head / hp->n_head_kv : 0;
    int f16kv = hp->kv_dtype == ST_DTYPE_F16;
    int dec = f16kv && hd % 8 == 0 && (C & (C - 1)) == 0 && (G == 1 || G == 2 || G == 4 || G == 8);
    int tc = !f32 && f16kv && hd % 16 == 0;
    int ok = 1;
    if (dec && e[ST_CUDA_ATT_DEC] == b[ST_CUDA_ATT_DEC]) {
        printf("  ^ one-token attention did not run on k_attn_dec\n");
        ok = 0;
    }
    if (!dec && e[ST_CUDA_ATT_CORE] == b[ST_CUDA_ATT_CORE]) {
        printf("  ^ one-token attention did not run on k_attn\n");
        ok = 0;
    }
    if (tc && e[ST_CUDA_ATT_TC] == b[ST_CUDA_ATT_TC]) {
        printf("  ^ the prompt's attention did not run on the tensor cores (k_attn_tc)\n");
        ok = 0;
    }
    if (!tc && e[ST_CUDA_ATT_TC] != b[ST_CUDA_ATT_TC]) {
        printf("  ^ the prompt's attention ran on the tensor cores where it must not\n");
        ok = 0;
    }
    return ok;
}

static void test_agree(void **state)
{
    (void)state;
    int bad = 0;
    double worst[2] = {0.0, 0.0};
    for (size_t i = 0; i < N_CASES; i++) {
        const acase *c = &k_cases[i];
        st_model *m = load_case(c, 7);
        const st_model_hparams *hp = st_model_hparams_get(m);
        /* the prompt on f16 tensor cores in chunks of UBATCH and in one chunk (several tiles
         * of queries), then on f32 */
        for (int run = 0; run < 3; run++) {
            int f32 = run == 2;
            uint32_t ub = run == 1 ? N_PROMPT : UBATCH;
            setenv("STRATA_CUDA_PREFILL", f32 ? "f32" : "f16", 1);
            uint64_t b[ST_CUDA_ATT_N], e[ST_CUDA_ATT_N];
            st_ops_cuda_attention_runs(b);
            double r = compare(m, m, ub);
            st_ops_cuda_attention_runs(e);
            unsetenv("STRATA_CUDA_PREFILL");
            double tol = f32 ? ARCH_TOL : ARCH_TOL_F16;
            printf("gpu-vs-cpu %-13s %-11s %-7s kv %-3s DeltaNet %3u x %3u, head %3u, prefill %s "
                   "in %3u: max rel %.3e\n", c->arch, c->preset, st_gguf_type_name(c->wtype),
                   c->kv_dtype == ST_DTYPE_I8 ? "i8" : "f16", hp->ssm_dk, hp->ssm_dv,
                   hp->head_dim, f32 ? "f32" : "f16", ub, r);
            fflush(stdout);
            worst[f32] = r > worst[f32] ? r : worst[f32];
            if (!(r <= tol)) {
                printf("  ^ beyond the tolerance %.1e\n", tol);
                bad++;
            }
            if (hp->n_head && !ran_expected(hp, f32, b, e))
                bad++;
        }
        st_model_free(m);
    }
    printf("gpu-vs-cpu worst: prefill f16 %.3e (tolerance %.1e), f32 %.3e (tolerance %.1e)\n",
           worst[0], ARCH_TOL_F16, worst[1], ARCH_TOL);
    if (bad)
        fail_msg("%d of %zu comparisons beyond the tolerance", bad, 3 * N_CASES);
}

/* One-token attention whose splits take more than one tile of keys (k_attn_dec's tiles of 256,
 * STRATA_CUDA_ATT_KEYS=280 after a prompt of 300 tokens: the first split 256 + 24 keys, the
 * rescaled running sums between the tiles) agrees with the CPU, for heads of 64 and 256. */
static void test_long_splits(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[2], &k_cases[27]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 7);
        setenv("STRATA_CUDA_ATT_KEYS", "280", 1);
        uint64_t b[ST_CUDA_ATT_N], e[ST_CUDA_ATT_N];
        st_ops_cuda_attention_runs(b);
        double r = compare_n(m, m, UBATCH, 300);
        st_ops_cuda_attention_runs(e);
        unsetenv("STRATA_CUDA_ATT_KEYS");
        printf("gpu-vs-cpu %-6s head %3u, splits of 280 keys after 300 tokens: max rel %.3e\n",
               cs[i]->arch, st_model_hparams_get(m)->head_dim, r);
        assert_true(e[ST_CUDA_ATT_DEC] > b[ST_CUDA_ATT_DEC]);
        if (!(r <= ARCH_TOL_F16))
            fail_msg("%s: %.3e beyond the tolerance %.1e", cs[i]->arch, r, ARCH_TOL_F16);
        st_model_free(m);
    }
}

/* The control: a model of another seed in the same shapes must not pass. */
static void test_control(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[2], &k_cases[10], &k_cases[19]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *a = load_case(cs[i], 7), *b = load_case(cs[i], 8);
        double r = compare(a, b, UBATCH);
        printf("control %-13s %-7s (other seed): max rel %.3e\n", cs[i]->arch,
               st_gguf_type_name(cs[i]->wtype), r);
        if (!(r > 10 * ARCH_TOL))
            fail_msg("%s: another model's logits pass the comparison (%.3e)", cs[i]->arch, r);
        st_model_free(a);
        st_model_free(b);
    }
}

/* Engines ea and eb read the same prompt of n tokens, then `steps` greedy decodes: the same
 * logits at every step and the same state hash at the end. */
static void same_bits(const st_model *m, st_engine *ea, st_engine *eb, uint64_t n, uint64_t seed,
                      int steps)
{
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    st_slot *a = NULL, *b = NULL;
    ST_OK(st_slot_new(ea, &a));
    ST_OK(st_slot_new(eb, &b));
    uint32_t *t = prompt(n, V, seed);
    ST_OK(st_slot_eval(a, t, n, 0, NULL));
    ST_OK(st_slot_eval(b, t, n, 0, NULL));
    for (int k = 0; k < steps; k++) {
        assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
        uint32_t tok = et_greedy(a);
        ST_OK(st_slot_decode(a, tok));
        ST_OK(st_slot_decode(b, tok));
    }
    uint64_t ha, hb;
    ST_OK(st_slot_state_hash(a, ST_CODEC_FP32, &ha));
    ST_OK(st_slot_state_hash(b, ST_CODEC_FP32, &hb));
    assert_true(ha == hb);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
}

static void test_deterministic(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[11], &k_cases[22], &k_cases[19]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 9);
        st_engine *e1 = engine(m, "cuda", 37), *e2 = engine(m, "cuda", 37);
        same_bits(m, e1, e2, 200, 5, 6);
        st_engine_free(e1);
        st_engine_free(e2);
        st_model_free(m);
    }
}

/* Graph replays against direct launches: the same bits at every decode step, across the first
 * span boundary of one-token attention (256 keys: the graph is captured again there). */
static void test_graphs(void **state)
{
    (void)state;
    /* no MoE model: their decode steps wait for the selection and are not captured */
    const acase *cs[] = {&k_cases[10], &k_cases[2], &k_cases[9], &k_cases[7]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 13);
        setenv("STRATA_CUDA_GRAPHS", "1", 1);
        st_engine *eg = engine(m, "cuda", UBATCH);
        unsetenv("STRATA_CUDA_GRAPHS");
        st_engine *ed = engine(m, "cuda", UBATCH);
        same_bits(m, eg, ed, 240, 19, 24);
        st_engine_free(eg);
        st_engine_free(ed);
        st_model_free(m);
    }
    /* splits of two tiles (k_attn_dec, STRATA_CUDA_ATT_KEYS=300) past the span boundary */
    st_model *m = load_case(&k_cases[2], 13);
    setenv("STRATA_CUDA_ATT_KEYS", "300", 1);
    setenv("STRATA_CUDA_GRAPHS", "1", 1);
    st_engine *eg = engine(m, "cuda", UBATCH);
    unsetenv("STRATA_CUDA_GRAPHS");
    st_engine *ed = engine(m, "cuda", UBATCH);
    unsetenv("STRATA_CUDA_ATT_KEYS");
    same_bits(m, eg, ed, 240, 19, 24);
    st_engine_free(eg);
    st_engine_free(ed);
    st_model_free(m);
}

/* The logits of a prompt of n tokens (ubatch 37) and of `steps` decodes of the given tokens, on
 * a CUDA engine made with STRATA_CUDA_PDL and STRATA_CUDA_GRAPHS as given (NULL: unset); and the
 * state hash at the end in *h. The launch mode is the process's (st_cuda_pdl_configure), so one
 * engine at a time. */
static float *pdl_trace(const st_model *m, const char *pdl, const char *graphs, uint64_t n,
                        const uint32_t *t, const uint32_t *dec, int steps, uint64_t *h)
{
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    if (pdl)
        setenv("STRATA_CUDA_PDL", pdl, 1);
    if (graphs)
        setenv("STRATA_CUDA_GRAPHS", graphs, 1);
    st_engine *e = engine(m, "cuda", 37);
    unsetenv("STRATA_CUDA_PDL");
    unsetenv("STRATA_CUDA_GRAPHS");
    assert_int_equal(st_cuda_pdl_flag, pdl && !strcmp(pdl, "0") ? 0 : 1); /* the H200: sm_90 */
    float *out = malloc((size_t)(steps + 1) * V * sizeof *out);
    assert_non_null(out);
    st_slot *s = NULL;
    ST_OK(st_slot_new(e, &s));
    ST_OK(st_slot_eval(s, t, n, 0, NULL));
    memcpy(out, st_slot_logits(s, NULL), (size_t)V * 4);
    for (int k = 0; k < steps; k++) {
        ST_OK(st_slot_decode(s, dec[k]));
        memcpy(out + (size_t)(k + 1) * V, st_slot_logits(s, NULL), (size_t)V * 4);
    }
    ST_OK(st_slot_state_hash(s, ST_CODEC_FP32, h));
    st_slot_free(s);
    st_engine_free(e);
    return out;
}

/* Programmatic dependent launch (engine/st_launch_cuda.cuh) changes when blocks start, never
 * what they compute: the same bits with it (the default on the H200) and without
 * (STRATA_CUDA_PDL=0), launched directly and as graphs, on prefill chunks and decode steps, for
 * attention, DeltaNet and MoE models; the control: another prompt's logits differ. */
static void test_pdl(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[10], &k_cases[2], &k_cases[19], &k_cases[22]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 21);
        uint32_t V = st_model_hparams_get(m)->n_vocab;
        const uint64_t n = 100;
        const int steps = 12;
        uint32_t *t = prompt(n, V, 23), *dec = prompt(steps, V, 29), *t2 = prompt(n, V, 31);
        size_t bytes = (size_t)(steps + 1) * V * 4;
        uint64_t h_on, h_off, h_g, h_c;
        float *on = pdl_trace(m, NULL, NULL, n, t, dec, steps, &h_on);
        float *off = pdl_trace(m, "0", NULL, n, t, dec, steps, &h_off);
        float *g = pdl_trace(m, NULL, "1", n, t, dec, steps, &h_g);
        float *c = pdl_trace(m, NULL, NULL, n, t2, dec, steps, &h_c);
        assert_memory_equal(on, off, bytes);
        assert_memory_equal(on, g, bytes);
        assert_true(h_on == h_off && h_on == h_g);
        assert_true(memcmp(on, c, (size_t)V * 4) != 0 && h_c != h_on);
        printf("pdl %-10s %-7s: %d decode steps, the same bits with and without\n", cs[i]->arch,
               st_gguf_type_name(cs[i]->wtype), steps);
        free(on);
        free(off);
        free(g);
        free(c);
        free(t);
        free(t2);
        free(dec);
        st_model_free(m);
    }
}

/* The paired gate/up product with its swiglu in one launch (st_qmv_cuda.cu invariant 6) gives
 * the bits of the two products and the swiglu kernel (STRATA_CUDA_QMV_PAIR=0), on Q4_K, Q6_K and
 * Q8_0 feed-forward weights; the control: another prompt's logits differ. */
static void test_pair(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[2], &k_cases[3], &k_cases[10]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 41);
        uint32_t V = st_model_hparams_get(m)->n_vocab;
        const uint64_t n = 90;
        const int steps = 10;
        uint32_t *t = prompt(n, V, 43), *dec = prompt(steps, V, 47), *t2 = prompt(n, V, 53);
        size_t bytes = (size_t)(steps + 1) * V * 4;
        uint64_t h_on, h_off, h_c;
        uint64_t r0 = st_cuda_qmv_swiglu_runs();
        float *on = pdl_trace(m, NULL, NULL, n, t, dec, steps, &h_on);
        uint64_t r1 = st_cuda_qmv_swiglu_runs();
        setenv("STRATA_CUDA_QMV_PAIR", "0", 1);
        float *off = pdl_trace(m, NULL, NULL, n, t, dec, steps, &h_off);
        unsetenv("STRATA_CUDA_QMV_PAIR");
        assert_true(r1 > r0);                            /* the paired kernel ran */
        assert_true(st_cuda_qmv_swiglu_runs() == r1);    /* and not with it off */
        float *c = pdl_trace(m, NULL, NULL, n, t2, dec, steps, &h_c);
        assert_memory_equal(on, off, bytes);
        assert_true(h_on == h_off);
        assert_true(memcmp(on, c, (size_t)V * 4) != 0 && h_c != h_on);
        printf("pair %-6s %-5s: %d decode steps, the paired product's bits are the separate ones\n",
               cs[i]->arch, st_gguf_type_name(cs[i]->wtype), steps);
        free(on);
        free(off);
        free(c);
        free(t);
        free(t2);
        free(dec);
        st_model_free(m);
    }
}

/* A session saved on `from` restores on `to` and continues within the tolerance of `from`. */
static void across(st_engine *from, st_engine *to, uint32_t V, const char *what)
{
    st_slot *a = NULL, *b = NULL;
    ST_OK(st_slot_new(from, &a));
    ST_OK(st_slot_new(to, &b));
    uint32_t *t = prompt(120, V, 17);
    ST_OK(st_slot_eval(a, t, 120, 0, NULL));
    st_image *img = NULL;
    ST_OK(st_slot_snapshot(a, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img));
    ST_OK(st_slot_restore(b, img));
    uint64_t ha, hb;
    ST_OK(st_slot_state_hash(a, ST_CODEC_FP32, &ha));
    ST_OK(st_slot_state_hash(b, ST_CODEC_FP32, &hb));
    assert_true(ha == hb);
    assert_memory_equal(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V * 4);
    double worst = 0.0;
    for (int i = 0; i < 6; i++) {
        uint32_t tok = et_greedy(a);
        ST_OK(st_slot_decode(a, tok));
        ST_OK(st_slot_decode(b, tok));
        double r = rel_err(st_slot_logits(a, NULL), st_slot_logits(b, NULL), V);
        worst = r > worst ? r : worst;
    }
    printf("across %-24s %s -> %s: continued max rel %.3e\n", what,
           st_engine_opts_get(from)->backend, st_engine_opts_get(to)->backend, worst);
    assert_true(worst <= ARCH_TOL);
    st_image_free(img);
    free(t);
    st_slot_free(a);
    st_slot_free(b);
}

static void test_across(void **state)
{
    (void)state;
    const acase *cs[] = {&k_cases[10], &k_cases[2], &k_cases[9], &k_cases[22]};
    for (size_t i = 0; i < sizeof cs / sizeof cs[0]; i++) {
        st_model *m = load_case(cs[i], 21);
        uint32_t V = st_model_hparams_get(m)->n_vocab;
        char what[96];
        snprintf(what, sizeof what, "%s %s", cs[i]->arch, st_gguf_type_name(cs[i]->wtype));
        st_engine *ec = engine(m, "cpu", UBATCH), *eg = engine(m, "cuda", UBATCH);
        across(ec, eg, V, what);
        across(eg, ec, V, what);
        st_engine_free(ec);
        st_engine_free(eg);
        st_model_free(m);
    }
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(g_dir, sizeof g_dir, "gpu_arch");
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
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_long_splits),
        cmocka_unit_test(test_control),
        cmocka_unit_test(test_deterministic),
        cmocka_unit_test(test_graphs),
        cmocka_unit_test(test_pdl),
        cmocka_unit_test(test_pair),
        cmocka_unit_test(test_across),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
