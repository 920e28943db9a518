/*
 * test_engine_wtype.c - the weight-type traits table against llama.cpp's own ggml (v0.4.0, the
 * prebuilt libggml-base.so of @node-llama-cpp/linux-x64 3.21.1, installed by `make deps`),
 * loaded at run time:
 *   - every type of the table has ggml's id, name, block size and block bytes;
 *   - dequantize == ggml's to_float, bit for bit (NaN: both NaN), on random blocks and on
 *     quantized rows, scalar and AVX2;
 *   - quantize == ggml_quantize_chunk without an importance matrix (and the type's reference
 *     quantizer where that is the same function), byte for byte, on seeded rows with edge cases
 *     (zeros, constants, huge values, f32 and f16 subnormals, sparse rows, ties, rows of several
 *     blocks);
 *   - dot == the engine's f32 dot of ggml's dequantized row, bit for bit, scalar and AVX2, and
 *     within the rounding bound of a double-precision reference;
 *   - results do not depend on chunking or on the thread count;
 *   - the integer path (st_qdot_get: Q8_0, Q4_K, Q6_K): activation rows quantized as ggml's
 *     from_float (Q8_K byte for byte; Q8_0, where ggml's baseline build rounds half away from
 *     zero with 1/d and the engine as ggml's AVX2 code, half to even with 127/amax, within one
 *     step), products within f32 reordering of llama.cpp's vec_dot on the same activation
 *     bytes, scalar == AVX2 for every split of rows and tokens;
 * and negative controls: an interleaved nibble order and an off-by-one f16 scale are caught by
 * the same comparisons, and so are activation scales 127/128 of what they are. Without the library the test fails (it never skips): `make deps`.
 */
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

#include "st_engine_int.h"
#include "st_wtype.h"

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

struct ggml_type_traits_cpu { /* ggml-cpu.h of v0.4.0 */
    void (*from_float)(const float *x, void *y, int64_t k);
    void (*vec_dot)(int n, float *s, size_t bs, const void *x, size_t bx, const void *y, size_t by,
                    int nrc);
    int vec_dot_type;
    int64_t nrows;
};

static struct {
    void *h, *cpu;
    const struct ggml_type_traits_cpu *(*traits_cpu)(int type);
    const struct ggml_type_traits *(*traits)(int type);
    size_t (*quantize_chunk)(int type, const float *src, void *dst, int64_t start, int64_t nrows,
                             int64_t n_per_row, const float *imatrix);
    _Bool (*requires_imatrix)(int type);
    float (*fp16_to_fp32)(uint16_t h);
    uint16_t (*fp32_to_fp16)(float f);
} G;

static int ggml_load(void)
{
    const char *path = getenv("STRATA_GGML_BASE");
    if (!path || !*path)
        path = STRATA_GGML_BASE_SO;
    G.h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!G.h) {
        fprintf(stderr,
                "test_engine_wtype: cannot load llama.cpp's ggml (%s): %s\n"
                "  run `make deps` (npm ci in tests/ref), or set STRATA_GGML_BASE\n",
                path, dlerror());
        return -1;
    }
    *(void **)&G.traits = dlsym(G.h, "ggml_get_type_traits");
    *(void **)&G.quantize_chunk = dlsym(G.h, "ggml_quantize_chunk");
    *(void **)&G.requires_imatrix = dlsym(G.h, "ggml_quantize_requires_imatrix");
    *(void **)&G.fp16_to_fp32 = dlsym(G.h, "ggml_fp16_to_fp32");
    *(void **)&G.fp32_to_fp16 = dlsym(G.h, "ggml_fp32_to_fp16");
    if (!G.traits || !G.quantize_chunk || !G.requires_imatrix || !G.fp16_to_fp32 ||
        !G.fp32_to_fp16) {
        fprintf(stderr, "test_engine_wtype: %s lacks a ggml symbol: %s\n", path, dlerror());
        return -1;
    }
    /* The CPU backend next to it, in its baseline x86-64 build (no ISA requirement): llama.cpp's
     * own dot with activations quantized to the type's vec_dot_type. */
    char cpu[4096];
    const char *slash = strrchr(path, '/');
    snprintf(cpu, sizeof cpu, "%.*slibggml-cpu-x64.so", slash ? (int)(slash - path + 1) : 0, path);
    G.cpu = dlopen(cpu, RTLD_NOW | RTLD_LOCAL);
    void (*cpu_init)(void) = NULL;
    if (G.cpu) {
        *(void **)&G.traits_cpu = dlsym(G.cpu, "ggml_get_type_traits_cpu");
        *(void **)&cpu_init = dlsym(G.cpu, "ggml_cpu_init");
    }
    if (!G.cpu || !G.traits_cpu || !cpu_init) {
        fprintf(stderr, "test_engine_wtype: cannot load ggml's CPU backend %s: %s\n", cpu, dlerror());
        return -1;
    }
    cpu_init();
    return 0;
}

/* ggml's dequantization of n values (F32 has no to_float in ggml: its values are its bytes). */
static void ggml_dequant(uint32_t type, const void *src, float *dst, uint64_t n)
{
    const struct ggml_type_traits *tt = G.traits((int)type);
    if (type == ST_GGML_F32)
        memcpy(dst, src, n * 4);
    else
        tt->to_float(src, dst, (int64_t)n);
}

/* ---- seeded inputs ------------------------------------------------------------------------------------- */
static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static double rng_unit(uint64_t *s) /* (0, 1) */
{
    return ((double)(rng_next(s) >> 11) + 0.5) * 0x1p-53;
}

static float rng_gauss(uint64_t *s)
{
    return (float)(sqrt(-2.0 * log(rng_unit(s))) * cos(6.283185307179586 * rng_unit(s)));
}

#define N_KINDS 15
static const char *const k_kind_names[N_KINDS] = {
    "gauss", "gauss*0.02", "uniform+outliers", "zeros", "huge 1e6", "huge 1e9", "huge 1e30",
    "f32 subnormals", "f16 subnormals", "positive", "negative", "constant", "sparse",
    "mixed magnitudes", "ties"};

/* Row kind `kind` of n values from seed. */
static void make_row(int kind, uint64_t seed, float *x, uint64_t n)
{
    uint64_t s = seed * 1000003u + (uint64_t)kind;
    for (uint64_t i = 0; i < n; i++) {
        float g = rng_gauss(&s);
        switch (kind) {
        case 0: x[i] = g; break;
        case 1: x[i] = 0.02f * g; break;
        case 2:
            x[i] = (float)(2.0 * rng_unit(&s) - 1.0);
            if (rng_next(&s) % 61 == 0)
                x[i] *= 50.0f;
            break;
        case 3: x[i] = 0.0f; break;
        case 4: x[i] = 1e6f * g; break;
        case 5: x[i] = 1e9f * g; break;
        case 6: x[i] = 1e30f * g; break;
        case 7: x[i] = 1e-40f * g; break;
        case 8: x[i] = 3e-6f * g; break;
        case 9: x[i] = fabsf(g) + 0.1f; break;
        case 10: x[i] = -fabsf(g) - 0.5f; break;
        case 11: x[i] = (float)(seed % 5) - 2.0f; break;
        case 12: x[i] = rng_next(&s) % 37 == 0 ? g : 0.0f; break;
        case 13: x[i] = g * powf(10.0f, (float)((i / 32) % 10) - 6.0f); break;
        default: x[i] = 0.5f * (float)((int)(rng_next(&s) % 33) - 16); break;
        }
    }
}

static void random_bytes(uint64_t seed, uint8_t *p, size_t n)
{
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rng_next(&s);
}

/* ---- comparisons ----------------------------------------------------------------------------------------- */
static int same_value(float a, float b)
{
    uint32_t ua, ub;
    memcpy(&ua, &a, 4);
    memcpy(&ub, &b, 4);
    return ua == ub || (isnan(a) && isnan(b));
}

/* Values that differ between mine and ggml's (bits, NaN = NaN); the first one reported. */
static uint64_t count_value_diffs(const char *what, const st_wtype *t, const float *mine,
                                  const float *ref, uint64_t n, int report)
{
    uint64_t bad = 0;
    for (uint64_t i = 0; i < n; i++)
        if (!same_value(mine[i], ref[i])) {
            if (!bad && report)
                fprintf(stderr, "%s %s: value %llu: %a vs ggml %a\n", t->name, what,
                        (unsigned long long)i, (double)mine[i], (double)ref[i]);
            bad++;
        }
    return bad;
}

static uint64_t count_block_diffs(const char *what, const st_wtype *t, const uint8_t *mine,
                                  const uint8_t *ref, uint64_t nblocks, int report)
{
    uint64_t bad = 0;
    for (uint64_t b = 0; b < nblocks; b++) {
        const uint8_t *p = mine + b * t->bytes, *q = ref + b * t->bytes;
        if (memcmp(p, q, t->bytes)) {
            if (!bad && report) {
                uint32_t o = 0;
                while (p[o] == q[o])
                    o++;
                fprintf(stderr, "%s %s: block %llu byte %u: %02x vs ggml %02x\n", t->name, what,
                        (unsigned long long)b, o, p[o], q[o]);
            }
            bad++;
        }
    }
    return bad;
}

/* Negative control of the dequantization: the outputs of each group of 32 in interleaved
 * nibble order (y'[2j] = y[j], y'[2j + 1] = y[j + 16]), the classic 4-bit packing mistake;
 * for the float types (block 1) each value read with its bytes in the wrong order. */
static void wrong_dequant(const st_wtype *t, const void *src, float *dst, uint64_t n)
{
    if (t->block == 1) {
        uint8_t v[4];
        for (uint64_t i = 0; i < n; i++) {
            const uint8_t *p = (const uint8_t *)src + i * t->bytes;
            for (uint32_t b = 0; b < t->bytes; b++)
                v[b] = p[t->bytes - 1 - b];
            t->dequant[0](v, dst + i, 1);
        }
        return;
    }
    t->dequant[0](src, dst, n);
    float g[32];
    for (uint64_t k = 0; k < n; k += 32) {
        for (int j = 0; j < 16; j++) {
            g[2 * j] = dst[k + (uint64_t)j];
            g[2 * j + 1] = dst[k + 16 + (uint64_t)j];
        }
        memcpy(dst + k, g, sizeof g);
    }
}

/* Offset of the f16 super-scale d in a block (the off-by-one negative control bumps it). */
static uint32_t d_offset(uint32_t type)
{
    switch (type) {
    case ST_GGML_Q2_K: return 80;
    case ST_GGML_Q3_K: return 108;
    case ST_GGML_Q6_K: return 208;
    default: return 0;
    }
}

/* Negative control of the quantizer: the blocks with their f16 scale one step larger (for the
 * float types, the low 16 bits of every value one larger). */
static void wrong_quantize(const st_wtype *t, const float *src, uint8_t *dst, uint64_t n)
{
    t->quantize(src, dst, n);
    for (uint64_t b = 0; b < n / t->block; b++) {
        uint8_t *p = dst + b * t->bytes + d_offset(t->type);
        uint16_t h = (uint16_t)(p[0] | p[1] << 8);
        h++;
        p[0] = (uint8_t)h;
        p[1] = (uint8_t)(h >> 8);
    }
}

static float canon_dot(const float *w, const float *x, uint64_t n)
{
    st_kern k = {0, 0, 0};
    return st_kern_dot(&k, w, x, (uint32_t)n);
}

/* The rounding bound of an f32 dot in the canonical order against the exact sum: lanes of
 * n / 8 fused steps plus the 3 adds of the tree (and a tail of at most 7), each step a
 * relative 2^-24 of the magnitudes summed so far, or, among subnormals, half the smallest
 * subnormal 2^-150 absolute. */
static double dot_tolerance(const float *w, const float *x, uint64_t n)
{
    double mag = 0;
    for (uint64_t i = 0; i < n; i++)
        mag += fabs((double)w[i] * (double)x[i]);
    return ((double)n / 8 + 11) * 0x1p-24 * mag + (double)(n + 8) * 0x1p-150;
}

static int all_finite(const float *v, uint64_t n)
{
    for (uint64_t i = 0; i < n; i++)
        if (!isfinite(v[i]))
            return 0;
    return 1;
}

/* ---- the tests ------------------------------------------------------------------------------------------- */
static const uint32_t k_types[] = {ST_GGML_F32,  ST_GGML_F16,  ST_GGML_BF16,  ST_GGML_Q8_0,
                                   ST_GGML_Q4_0, ST_GGML_Q4_1, ST_GGML_Q5_0,  ST_GGML_Q5_1,
                                   ST_GGML_Q2_K, ST_GGML_Q3_K, ST_GGML_Q4_K,  ST_GGML_Q5_K,
                                   ST_GGML_Q6_K, ST_GGML_IQ4_NL, ST_GGML_IQ4_XS};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

static int have_vec(void)
{
    return st_wtype_has_avx2();
}

static void test_table(void **state)
{
    (void)state;
    uint32_t n;
    const st_wtype *const *rows = st_wtype_table(&n);
    assert_int_equal(n, N_TYPES);
    for (size_t i = 0; i < N_TYPES; i++) {
        const st_wtype *t = st_wtype_get(k_types[i]);
        assert_non_null(t);
        const struct ggml_type_traits *tt = G.traits((int)k_types[i]);
        assert_int_equal(t->type, k_types[i]);
        assert_string_equal(t->name, tt->type_name);
        assert_int_equal(t->block, tt->blck_size);
        assert_int_equal(t->bytes, tt->type_size);
        assert_false(G.requires_imatrix((int)k_types[i]));
        assert_non_null(t->dequant[0]);
        assert_non_null(t->dequant[1]);
        assert_non_null(t->dot[0]);
        assert_non_null(t->dot[1]);
        assert_non_null(t->dot_rows[0]);
        assert_non_null(t->dot_rows[1]);
        assert_non_null(t->quantize);
        int listed = 0;
        for (uint32_t r = 0; r < n; r++)
            listed += rows[r] == t;
        assert_int_equal(listed, 1);
    }
    /* No row for any other id: the ggml types the engine does not compute with and beyond. */
    for (uint32_t id = 0; id < 1000; id++) {
        int known = 0;
        for (size_t i = 0; i < N_TYPES; i++)
            known |= k_types[i] == id;
        if (!known)
            assert_null(st_wtype_get(id));
    }
    assert_null(st_wtype_get(UINT32_MAX));
    uint64_t bytes = 0;
    assert_int_equal(st_wtype_row_bytes(st_wtype_get(ST_GGML_Q4_K), 512, &bytes), 0);
    assert_int_equal(bytes, 288);
    assert_int_equal(st_wtype_row_bytes(st_wtype_get(ST_GGML_Q4_K), 320, &bytes), ST_EGEOMETRY);
    assert_int_equal(st_wtype_row_bytes(st_wtype_get(ST_GGML_Q8_0), 0, &bytes), ST_EGEOMETRY);
    assert_int_equal(st_wtype_row_bytes(st_wtype_get(ST_GGML_F32), UINT64_MAX, &bytes), ST_ETOOBIG);
}

static void test_f16_conversions(void **state)
{
    (void)state;
    for (uint32_t h = 0; h < 65536; h++) {
        float a = st_wtype_f16_to_f32((uint16_t)h), b = G.fp16_to_fp32((uint16_t)h);
        assert_memory_equal(&a, &b, 4);
    }
    /* f32 -> f16: a stride through every bit pattern, plus the boundaries of rounding. */
    uint64_t s = 7;
    for (uint64_t i = 0; i < 600000; i++) {
        uint32_t u = i < 300000 ? (uint32_t)(i * 14327u) : (uint32_t)rng_next(&s);
        float f;
        memcpy(&f, &u, 4);
        uint16_t a = st_wtype_f32_to_f16(f), b = G.fp32_to_fp16(f);
        if (a != b)
            fail_msg("f32 %08x -> f16: %04x vs ggml %04x", u, a, b);
    }
    static const float edge[] = {65504.0f, 65519.99f, 65520.0f, 6.1035156e-05f, 5.9604645e-08f,
                                 2.9802322e-08f, 2.9802326e-08f, -0.0f, INFINITY, -INFINITY, NAN};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++)
        assert_int_equal(st_wtype_f32_to_f16(edge[i]), G.fp32_to_fp16(edge[i]));
}

/* Rows per kind and lengths: 256-value super-blocks (and 32-value blocks) several times over. */
#ifdef __SANITIZE_ADDRESS__
#define N_SEEDS 2 /* the sanitizer build checks memory; the plain build checks the numbers in full */
#else
#define N_SEEDS 6
#endif
static const uint64_t k_lens[] = {256, 768, 2048};

static void test_quantize_matches_ggml(void **state)
{
    (void)state;
    uint64_t nmax = 2048;
    float *x = malloc(nmax * sizeof(float)), *y = malloc(nmax * sizeof(float)),
          *yr = malloc(nmax * sizeof(float));
    uint8_t *mine = malloc(nmax * 4), *ref = malloc(nmax * 4), *piece = malloc(nmax * 4);
    assert_true(x && y && yr && mine && ref && piece);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const st_wtype *t = st_wtype_get(k_types[ti]);
        const struct ggml_type_traits *tt = G.traits((int)t->type);
        uint64_t blocks = 0, bad = 0, bad_wrong = 0, bad_ref = 0;
        for (size_t li = 0; li < sizeof k_lens / sizeof k_lens[0]; li++) {
            uint64_t n = k_lens[li], nb = n / t->block, bytes = nb * t->bytes;
            for (int kind = 0; kind < N_KINDS; kind++)
                for (uint64_t seed = 0; seed < N_SEEDS; seed++) {
                    make_row(kind, seed + 100 * li, x, n);
                    t->quantize(x, mine, n);
                    memset(ref, 0xa5, bytes);
                    assert_int_equal(G.quantize_chunk((int)t->type, x, ref, 0, 1, (int64_t)n, NULL),
                                     bytes);
                    char what[96];
                    snprintf(what, sizeof what, "quantize (%s row, n %llu, seed %llu)",
                             k_kind_names[kind], (unsigned long long)n, (unsigned long long)seed);
                    bad += count_block_diffs(what, t, mine, ref, nb, 1);
                    blocks += nb;
                    /* the reference quantizer, where ggml's is the same function (IQ4_NL's
                     * quantize_row_iq4_nl_ref skips the scale search that files get) */
                    if (tt->from_float_ref && t->type != ST_GGML_IQ4_NL) {
                        memset(ref, 0x5a, bytes);
                        tt->from_float_ref(x, ref, (int64_t)n);
                        bad_ref += count_block_diffs("reference quantizer", t, mine, ref, nb, 1);
                    }
                    /* in pieces of whole blocks: the same bytes */
                    uint64_t step = t->block * (1 + seed % 3);
                    for (uint64_t k = 0; k < n; k += step) {
                        uint64_t m = n - k < step ? n - k : step;
                        t->quantize(x + k, piece + k / t->block * t->bytes, m);
                    }
                    assert_memory_equal(piece, mine, bytes);
                    /* the dequantized blocks agree too (scalar and AVX2) */
                    t->dequant[0](mine, y, n);
                    ggml_dequant(t->type, mine, yr, n);
                    bad += count_value_diffs("dequantize of quantized row", t, y, yr, n, 1);
                    if (have_vec()) {
                        t->dequant[1](mine, y, n);
                        bad += count_value_diffs("AVX2 dequantize of quantized row", t, y, yr, n, 1);
                    }
                    /* negative control: an off-by-one scale */
                    wrong_quantize(t, x, piece, n);
                    G.quantize_chunk((int)t->type, x, ref, 0, 1, (int64_t)n, NULL);
                    bad_wrong += count_block_diffs(what, t, piece, ref, nb, 0);
                }
        }
        fprintf(stderr, "%-7s quantize: %llu blocks, %llu differ from ggml (%llu from its reference "
                "quantizer); off-by-one-scale control: %llu differ\n",
                t->name, (unsigned long long)blocks, (unsigned long long)bad,
                (unsigned long long)bad_ref, (unsigned long long)bad_wrong);
        assert_int_equal(bad, 0);
        assert_int_equal(bad_ref, 0);
        assert_true(bad_wrong > 0);
    }
    free(x);
    free(y);
    free(yr);
    free(mine);
    free(ref);
    free(piece);
}

static void test_dequant_and_dot_match_ggml(void **state)
{
    (void)state;
    const uint64_t n = 4096;
    float *w = malloc(n * 4), *wr = malloc(n * 4), *wv = malloc(n * 4), *ww = malloc(n * 4),
          *x = malloc(n * 4), *src = malloc(n * 4);
    uint8_t *blk = malloc(n * 4);
    assert_true(w && wr && wv && ww && x && src && blk);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const st_wtype *t = st_wtype_get(k_types[ti]);
        uint64_t bytes = n / t->block * t->bytes, bad = 0, bad_wrong = 0, dot_bad = 0;
        uint64_t dots_checked = 0, wrong_caught = 0, wrong_tried = 0;
        double worst = 0;
        for (uint64_t r = 0; r < 48; r++) {
            /* rows 0..23 random block bytes (any scale, NaN and infinity included), rows 24..
             * quantized from the row kinds */
            if (r < 24) {
                random_bytes(r * 7919u + ti, blk, bytes);
            } else {
                make_row((int)(r % N_KINDS), r, src, n);
                t->quantize(src, blk, n);
            }
            ggml_dequant(t->type, blk, wr, n);
            t->dequant[0](blk, w, n);
            bad += count_value_diffs("dequantize", t, w, wr, n, 1);
            if (have_vec()) {
                t->dequant[1](blk, wv, n);
                /* the same bits, but a NaN may carry either operand's payload: which one C leaves
                 * to the compiler (clang commutes d * q + m where gcc does not) */
                assert_int_equal(count_value_diffs("AVX2 dequantize", t, wv, w, n, 1), 0);
            }
            /* chunked: a row dequantized in pieces of 1, 2, 3... blocks is the same */
            uint64_t step = t->block * (1 + r % 5);
            for (uint64_t k = 0; k < n; k += step)
                t->dequant[r & 1 && have_vec()](blk + k / t->block * t->bytes, ww + k,
                                                 n - k < step ? n - k : step);
            assert_int_equal(count_value_diffs("chunked dequantize", t, ww, w, n, 1), 0);
            wrong_dequant(t, blk, ww, n);
            bad_wrong += count_value_diffs("wrong dequantize", t, ww, wr, n, 0);

            /* the dot: the engine's f32 dot of ggml's values, bit for bit */
            make_row(0, r + 1000, x, n);
            for (uint64_t len = t->block == 1 ? n - 5 : n; len <= n; len += 5) {
                float d0 = t->dot[0](blk, x, len), ref = canon_dot(wr, x, len);
                if (!same_value(d0, ref)) {
                    fprintf(stderr, "%s dot row %llu len %llu: %a vs f32 dot of ggml's values %a\n",
                            t->name, (unsigned long long)r, (unsigned long long)len, (double)d0,
                            (double)ref);
                    dot_bad++;
                }
                if (have_vec()) {
                    float d1 = t->dot[1](blk, x, len);
                    if (!same_value(d1, d0))
                        fail_msg("%s AVX2 dot row %llu: %a vs scalar %a", t->name,
                                 (unsigned long long)r, (double)d1, (double)d0);
                }
                if (!all_finite(wr, len))
                    continue;
                /* within the rounding bound of the exact (double) dot of ggml's values */
                double exact = 0;
                for (uint64_t i = 0; i < len; i++)
                    exact += (double)wr[i] * (double)x[i];
                double tol = dot_tolerance(wr, x, len), err = fabs((double)d0 - exact);
                if (!(err <= tol)) {
                    fprintf(stderr, "%s dot row %llu: |%.9g - %.9g| = %.3g > %.3g\n", t->name,
                            (unsigned long long)r, (double)d0, exact, err, tol);
                    dot_bad++;
                }
                if (tol > 0 && err / tol > worst)
                    worst = err / tol;
                dots_checked++;
                /* negative control: the dot of the wrongly dequantized row, wherever the
                 * variant changes the row (a permutation leaves a constant row as it is) */
                wrong_dequant(t, blk, ww, n);
                if (len == n && isfinite(exact) && fabs(exact) > 0 && memcmp(ww, w, n * 4)) {
                    float dw = canon_dot(ww, x, n);
                    wrong_tried++;
                    wrong_caught += !(fabs((double)dw - exact) <= tol);
                }
            }
        }
        fprintf(stderr, "%-7s dequantize: %llu values differ from ggml (control: %llu); dot: %llu "
                "off, %llu within tolerance (worst %.2g of the bound); control caught %llu/%llu\n",
                t->name, (unsigned long long)bad, (unsigned long long)bad_wrong,
                (unsigned long long)dot_bad, (unsigned long long)dots_checked, worst,
                (unsigned long long)wrong_caught, (unsigned long long)wrong_tried);
        assert_int_equal(bad, 0);
        assert_int_equal(dot_bad, 0);
        assert_true(bad_wrong > 0);
        assert_true(dots_checked > 0);
        assert_true(wrong_tried >= 10);
        assert_int_equal(wrong_caught, wrong_tried);
    }
    free(w);
    free(wr);
    free(wv);
    free(ww);
    free(x);
    free(src);
    free(blk);
}

/* Against llama.cpp's own dot (ggml-cpu's vec_dot, activations quantized to Q8_0, Q8_1 or
 * Q8_K, or rounded to f16 / bf16 for those weights, ARCHITECTURES.md 3.7): the f32 dot on
 * dequantized weights differs from it by that quantization only. Measured as the rms over 16
 * activation vectors of the difference, in units of sqrt(sum (w x)^2) (the size of a sum of the
 * row's terms with random signs): the activation quantization gives about rms(x - xq) / rms(x)
 * (about 0.01 for Q8 blocks), a wrongly decoded row (the interleaved-nibble control) about 1.4;
 * the tolerance is 0.1. The figures quantify the
 * choice of docs/ENGINE.md ("Weight types"). */
static void test_dot_vs_llama_cpp_integer_dot(void **state)
{
    (void)state;
    const uint64_t n = 4096;
    float *src = malloc(n * 4), *x = malloc(n * 4), *w = malloc(n * 4), *ww = malloc(n * 4);
    uint8_t *blk = malloc(n * 4), *xq = malloc(n * 4 + 4096);
    assert_true(src && x && w && ww && blk && xq);
    const double tol = 0.1;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const st_wtype *t = st_wtype_get(k_types[ti]);
        const struct ggml_type_traits_cpu *tc = G.traits_cpu((int)t->type);
        assert_non_null(tc->vec_dot);
        double worst = 0, sum_rel = 0;
        int rows = 0, caught = 0;
        for (uint64_t r = 0; r < 24; r++) {
            static const int kinds[] = {0, 1, 2, 13};
            make_row(kinds[r % 4], r + 500, src, n);
            t->quantize(src, blk, n);
            t->dequant[0](blk, w, n);
            wrong_dequant(t, blk, ww, n);
            /* over 16 activation vectors, so that the figures are rms values, not one sum */
            double d2 = 0, dw2 = 0, mag2 = 0;
            for (uint64_t k = 0; k < 16; k++) {
                make_row(0, 900 + 16 * r + k, x, n);
                if (tc->vec_dot_type == ST_GGML_F32)
                    memcpy(xq, x, n * 4);
                else
                    G.traits_cpu(tc->vec_dot_type)->from_float(x, xq, (int64_t)n);
                float theirs = 0;
                tc->vec_dot((int)n, &theirs, 0, blk, 0, xq, 0, 1);
                double ours = t->dot[0](blk, x, n), wrong = canon_dot(ww, x, n);
                d2 += (ours - theirs) * (ours - theirs);
                dw2 += (wrong - theirs) * (wrong - theirs);
                for (uint64_t i = 0; i < n; i++)
                    mag2 += ((double)w[i] * (double)x[i]) * ((double)w[i] * (double)x[i]);
            }
            double rel = sqrt(d2 / mag2), rel_wrong = sqrt(dw2 / mag2);
            if (rel > worst)
                worst = rel;
            sum_rel += rel;
            rows++;
            assert_true(rel <= tol);
            caught += !(rel_wrong <= tol);
        }
        fprintf(stderr, "%-7s vs llama.cpp's vec_dot (activations as %s), rms over 16 x of |ours - theirs| / "
                "sqrt(sum (w x)^2) mean %.2g, max %.2g; interleaved control beyond 0.1: %d/%d\n",
                t->name, G.traits(tc->vec_dot_type)->type_name, sum_rel / rows, worst, caught, rows);
        assert_int_equal(caught, rows);
    }
    free(src);
    free(x);
    free(w);
    free(ww);
    free(blk);
    free(xq);
}

/* A product Y = W X over the pool: the same bits whatever the thread count and task size. */
typedef struct mm_job {
    const st_wtype *t;
    const uint8_t *w;
    uint64_t row_bytes, n;
    const float *x;
    float *y;
    uint32_t rows, per_task, vec;
} mm_job;

static void mm_task(void *ctx, uint32_t task, uint32_t thread)
{
    (void)thread;
    mm_job *j = ctx;
    for (uint32_t r = task * j->per_task; r < (task + 1) * j->per_task && r < j->rows; r++)
        j->y[r] = j->t->dot[j->vec](j->w + r * j->row_bytes, j->x, j->n);
}

static void test_threads_and_isa(void **state)
{
    (void)state;
    const uint32_t rows = 37;
    const uint64_t n = 1024;
    float *src = malloc(n * 4), *x = malloc(n * 4), *y0 = malloc(rows * 4), *y = malloc(rows * 4);
    uint8_t *w = malloc(rows * n * 4);
    assert_true(src && x && y0 && y && w);
    make_row(0, 5, x, n);
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const st_wtype *t = st_wtype_get(k_types[ti]);
        uint64_t rb = n / t->block * t->bytes;
        for (uint32_t r = 0; r < rows; r++) {
            make_row((int)(r % N_KINDS), r, src, n);
            t->quantize(src, w + r * rb, n);
        }
        for (uint32_t r = 0; r < rows; r++)
            y0[r] = t->dot[0](w + r * rb, x, n);
        /* dot_rows: the same bits for any number of rows side by side */
        for (uint32_t vec = 0; vec <= (uint32_t)have_vec(); vec++)
            for (uint32_t nr = 1; nr <= 9; nr++) {
                memset(y, 0, rows * 4);
                for (uint32_t r = 0; r < rows; r += nr)
                    t->dot_rows[vec](w + r * rb, rb, rows - r < nr ? rows - r : nr, x, n, y + r);
                assert_memory_equal(y, y0, rows * 4);
            }
        for (uint32_t threads = 1; threads <= 4; threads++) {
            st_pool *p = NULL;
            assert_int_equal(st_pool_new(threads, &p), 0);
            static const uint32_t per[] = {1, 3, 5, 7, 37};
            for (size_t pi = 0; pi < sizeof per / sizeof per[0]; pi++)
                for (uint32_t vec = 0; vec <= (uint32_t)have_vec(); vec++) {
                    mm_job j = {t, w, rb, n, x, y, rows, per[pi], vec};
                    memset(y, 0, rows * 4);
                    st_pool_run(p, (rows + per[pi] - 1) / per[pi], mm_task, &j, UINT64_MAX);
                    assert_memory_equal(y, y0, rows * 4);
                }
            st_pool_free(p);
        }
    }
    free(src);
    free(x);
    free(y0);
    free(y);
    free(w);
}

/* The integer path: quantized activations against ggml's, products against llama.cpp's vec_dot
 * on the same bytes (within 1e-5 of sum |w x| of the dequantized values: f32 reordering), and
 * scalar == AVX2 == AVX-512 VNNI bit for bit for every tiling of 19 rows x 9 tokens. */
static void test_qdot(void **state)
{
    (void)state;
    static const uint32_t types[] = {ST_GGML_Q8_0, ST_GGML_Q4_K, ST_GGML_Q6_K};
    static const int xkinds[] = {0, 1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14};
    enum { R = 19, T = 9 };
    const uint64_t n = 1024;
    float *src = malloc(n * 4), *wd = malloc(R * n * 4), *xd = malloc(n * 4);
    uint8_t *w = malloc(R * n * 4), *xq = malloc(T * n * 2), *gq = malloc(n * 2);
    float *y0 = malloc(R * T * 4), *y = malloc(R * T * 4);
    assert_true(src && wd && xd && w && xq && gq && y0 && y);
    for (size_t ti = 0; ti < sizeof types / sizeof types[0]; ti++) {
        const st_wtype *t = st_wtype_get(types[ti]);
        const st_qdot *qd = st_qdot_get(types[ti]);
        const struct ggml_type_traits_cpu *tc = G.traits_cpu((int)t->type);
        assert_non_null(qd);
        assert_int_equal(qd->block, t->block);
        const uint32_t act_type = qd->act == ST_QACT_Q8_0 ? ST_GGML_Q8_0 : 15; /* GGML_TYPE_Q8_K */
        assert_int_equal(tc->vec_dot_type, (int)act_type);
        const uint64_t rb = n / t->block * t->bytes, xs = n / qd->block * qd->act_bytes;
        for (uint32_t r = 0; r < R; r++) {
            static const int wkinds[] = {0, 1, 2, 12};
            make_row(wkinds[r % 4], r + 70, src, n);
            t->quantize(src, w + r * rb, n);
            t->dequant[0](w + r * rb, wd + r * n, n);
        }
        if (t->type == ST_GGML_Q8_0)
            w[2] = 0x80; /* a weight of -128: abs() in the vector code must not lose it */
        t->dequant[0](w, wd, n);
        double worst = 0;
        int sizable = 0, caught = 0;
        for (uint32_t k = 0; k < T; k++) {
            make_row(xkinds[k % (sizeof xkinds / sizeof xkinds[0])], k + 300, src, n);
            uint8_t *xk = xq + k * xs;
            qd->quantize(src, xk, n);
            G.traits_cpu((int)act_type)->from_float(src, gq, (int64_t)n);
            if (qd->act == ST_QACT_Q8_K) {
                /* a block of zeros: ggml leaves its sums as they were, the engine writes 0 */
                for (uint64_t b = 0; b < n / 256; b++) {
                    float d;
                    memcpy(&d, xk + 292 * b, 4);
                    assert_memory_equal(xk + 292 * b, gq + 292 * b, d == 0 ? 260 : 292);
                }
            } else {
                /* the engine keeps ggml's f16 d widened to f32: 36 bytes a block against 34 */
                for (uint64_t b = 0; b < n / 32; b++) {
                    float d;
                    memcpy(&d, xk + 36 * b, 4);
                    assert_true(d == st_wtype_f16_to_f32((uint16_t)(gq[34 * b] | gq[34 * b + 1] << 8)));
                    for (int j = 0; j < 32; j++)
                        assert_true(abs((int8_t)xk[36 * b + 4 + j] - (int8_t)gq[34 * b + 2 + j]) <= 1);
                }
            }
            /* the activation values the products see, and ggml's layout of them */
            for (uint64_t b = 0; b < n / qd->block; b++) {
                const uint8_t *blk = xk + b * qd->act_bytes;
                float d;
                memcpy(&d, blk, 4);
                const int8_t *q = (const int8_t *)(blk + 4);
                for (uint32_t j = 0; j < qd->block; j++)
                    xd[b * qd->block + j] = d * (float)q[j];
                if (qd->act == ST_QACT_Q8_0) {
                    uint16_t h = st_wtype_f32_to_f16(d);
                    memcpy(gq + 34 * b, &h, 2);
                    memcpy(gq + 34 * b + 2, q, 32);
                }
            }
            const uint8_t *theirs_x = qd->act == ST_QACT_Q8_0 ? gq : xk;
            uint8_t *wrong = malloc(xs);
            assert_non_null(wrong);
            memcpy(wrong, xk, xs);
            st_qdot_wrong_scale(qd, wrong, n);
            for (uint32_t r = 0; r < R; r++) {
                double mag = 0;
                for (uint64_t i = 0; i < n; i++)
                    mag += fabs((double)wd[r * n + i] * (double)xd[i]);
                float theirs = 0, ours = 0, bad = 0;
                tc->vec_dot((int)n, &theirs, 0, w + r * rb, 0, theirs_x, 0, 1);
                qd->mm[0](w + r * rb, rb, xk, xs, (uint32_t)(n / qd->block), &ours, 1, 1, 1);
                qd->mm[0](w + r * rb, rb, wrong, xs, (uint32_t)(n / qd->block), &bad, 1, 1, 1);
                if (mag == 0) {
                    assert_true(ours == 0 && theirs == 0);
                    continue;
                }
                double rel = fabs((double)ours - theirs) / mag, relw = fabs((double)bad - theirs) / mag;
                if (rel > 1e-5)
                    fail_msg("%s row %u token %u: ours %.9g, llama.cpp's %.9g (sum |w x| %.9g)",
                             t->name, r, k, ours, theirs, mag);
                worst = rel > worst ? rel : worst;
                if (fabs(theirs) > 0.05 * mag) {
                    sizable++;
                    caught += relw > 1e-4;
                }
            }
            free(wrong);
        }
        fprintf(stderr, "%-5s integer path vs llama.cpp's vec_dot on the same activations: max "
                "|ours - theirs| / sum |w x| %.2g; scales 127/128 off by > 1e-4 in %d of the %d "
                "products of a size\n", t->name, worst, caught, sizable);
        /* the negative control: scales 127/128 of llama.cpp's move the products (all but those
         * of f16-subnormal scales, which 127/128 may leave as they are) */
        assert_true(sizable > 0 && caught >= sizable * 8 / 10);
        /* scalar reference == AVX2 == AVX-512 VNNI, for every split into calls: row counts
         * below, at and past the AVX-512 tile (8 rows x 4 tokens) and its pairs of rows, an odd
         * last row, token counts that are and are not multiples of 4 */
        static const uint32_t nrs[] = {1, 2, 3, 7, 8, 9, 10, 16, R};
        const uint32_t nb = (uint32_t)(n / qd->block);
        const uint32_t levels = have_vec() ? (st_kern_cpu_has_avx512vnni() ? 3 : 2) : 1;
        qd->mm[0](w, rb, xq, xs, nb, y0, R, R, T);
        for (uint32_t vec = 0; vec < levels; vec++)
            for (size_t ri = 0; ri < sizeof nrs / sizeof nrs[0]; ri++)
                for (uint32_t nt = 1, nr = nrs[ri]; nt <= T; nt++) {
                    memset(y, 0, R * T * 4);
                    for (uint32_t t0 = 0; t0 < T; t0 += nt)
                        for (uint32_t r0 = 0; r0 < R; r0 += nr)
                            qd->mm[vec](w + r0 * rb, rb, xq + t0 * xs, xs, nb, y + t0 * R + r0, R,
                                        R - r0 < nr ? R - r0 : nr, T - t0 < nt ? T - t0 : nt);
                    assert_memory_equal(y, y0, R * T * 4);
                }
    }
    free(src);
    free(wd);
    free(xd);
    free(w);
    free(xq);
    free(gq);
    free(y0);
    free(y);
}

int main(void)
{
    if (ggml_load())
        return 1;
    if (!have_vec())
        fprintf(stderr, "test_engine_wtype: no AVX2 here: the scalar kernels only\n");
    else if (!st_kern_cpu_has_avx512vnni())
        fprintf(stderr, "test_engine_wtype: no AVX-512 VNNI here: the integer path's AVX-512 "
                "form is not checked\n");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_table),
        cmocka_unit_test(test_f16_conversions),
        cmocka_unit_test(test_quantize_matches_ggml),
        cmocka_unit_test(test_dequant_and_dot_match_ggml),
        cmocka_unit_test(test_dot_vs_llama_cpp_integer_dot),
        cmocka_unit_test(test_threads_and_isa),
        cmocka_unit_test(test_qdot),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    dlclose(G.cpu);
    dlclose(G.h);
    return rc;
}
