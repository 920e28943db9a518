/*
 * st_wtype.h - the weight-type traits table: one row per weight type the engine computes with
 * (block size, bytes per block, dequantize a row, dot a row, quantize a row). Internal to
 * engine/, its tests and bench/bench_wtype.c (the engine's public header is st_engine.h).
 *
 * Type ids are ggml's, as stored in GGUF tensor infos. The block formats are those of
 * ../shared/ARCHITECTURES.md section 8 (ggml-common.h of llama.cpp v0.4.0).
 *
 * Contracts (docs/ENGINE.md, "Weight types"):
 * 1. dequant gives the values llama.cpp's to_float gives for the same blocks, bit for bit
 *    (f16 scales widened exactly, NaN quietened; each value computed with the same operations
 *    in the same order, one rounding per operation, nothing fused).
 * 2. dot(row, x) computes in f32 on the dequantized weights, in the canonical reduction order
 *    of st_engine_int.h, so dot(row, x) == st_kern_dot(dequant(row), x) bit for bit; the scalar
 *    and the AVX2 entries give the same bits. A caller may therefore dequantize rows once and
 *    run the f32 kernels on them, or dot the blocks in place, with the same results.
 * 3. quantize gives the blocks ggml_quantize_chunk gives without an importance matrix (what
 *    llama-quantize writes without --imatrix), byte for byte; f16 and bf16 round to nearest
 *    even (ggml's conversions).
 * 4. A row of n values is n / block consecutive blocks; n must be a multiple of block (every
 *    function here assumes it; st_wtype_row_bytes checks it).
 * 5. All functions are pure (no state, no allocation) and safe to call from any thread.
 */
#ifndef ST_WTYPE_H
#define ST_WTYPE_H

#include <stddef.h>
#include <stdint.h>

#include "st_engine.h"

/* ggml type ids (GGUF); ST_GGML_F32, F16 and BF16 come from st_engine.h. */
#define ST_GGML_Q4_0 2
#define ST_GGML_Q4_1 3
#define ST_GGML_Q5_0 6
#define ST_GGML_Q5_1 7
#define ST_GGML_Q8_0 8
#define ST_GGML_Q2_K 10
#define ST_GGML_Q3_K 11
#define ST_GGML_Q4_K 12
#define ST_GGML_Q5_K 13
#define ST_GGML_Q6_K 14
#define ST_GGML_IQ4_NL 20
#define ST_GGML_IQ4_XS 23

typedef void (*st_wtype_dequant_fn)(const void *src, float *dst, uint64_t n);
typedef float (*st_wtype_dot_fn)(const void *row, const float *x, uint64_t n);
typedef void (*st_wtype_quantize_fn)(const float *src, void *dst, uint64_t n);
typedef void (*st_wtype_dot_rows_fn)(const void *rows, size_t stride, uint32_t n_rows,
                                     const float *x, uint64_t n, float *y);

typedef struct st_wtype {
    uint32_t type;      /* ggml type id */
    const char *name;   /* ggml's name: "f32", "q4_K", "iq4_xs", ... */
    uint32_t block;     /* values per block */
    uint32_t bytes;     /* bytes per block */
    /* dst[0..n) = the n values of the blocks at src. [0] scalar reference, [1] AVX2+FMA+F16C. */
    st_wtype_dequant_fn dequant[2];
    /* sum over the row of w[k] * x[k], in the order of contract 2. [0] scalar, [1] AVX2. */
    st_wtype_dot_fn dot[2];
    /* y[i] = dot(rows + i * stride, x, n) for i < n_rows, each bit for bit the dot above (the
     * vector form runs 4 rows' reductions side by side, which hides the latency of one row's
     * chain of fused adds). [0] scalar, [1] AVX2. */
    st_wtype_dot_rows_fn dot_rows[2];
    /* src[0..n) into n / block blocks at dst (contract 3). */
    st_wtype_quantize_fn quantize;
} st_wtype;

/* The traits of ggml type `type`; NULL when the engine does not compute with it (a caller
 * refuses naming st_gguf_type_name(type)). */
const st_wtype *st_wtype_get(uint32_t type);

/* The n_types rows of the table, in type-id order (tests and benchmarks walk them). */
const st_wtype *const *st_wtype_table(uint32_t *n_types);

/* Bytes of a row of n values: ST_EGEOMETRY when n is 0 or not a multiple of the block size,
 * ST_ETOOBIG when the size overflows. */
int st_wtype_row_bytes(const st_wtype *t, uint64_t n, uint64_t *bytes);

/* Whether this CPU runs the [1] (AVX2+FMA+F16C) entries: st_kern_cpu_has_avx2(). A caller
 * indexes the entries with its st_kern's vec (0 or 1). */
int st_wtype_has_avx2(void);

/* IEEE binary16 <-> f32 as ggml converts: widening is exact (NaN quietened, as F16C does);
 * narrowing rounds to nearest even (overflow to infinity, NaN to 0x7e00 with its sign). */
float st_wtype_f16_to_f32(uint16_t h);
uint16_t st_wtype_f32_to_f16(float f);
/* f32 -> bf16 rounding to nearest even, NaN quietened (ggml_fp32_to_bf16_row_ref). */
uint16_t st_wtype_f32_to_bf16(float f);

/* The IQ4_NL / IQ4_XS codebook. */
extern const int8_t st_wtype_iq4nl_values[16];

/* ---- per-file entry points (st_wtype_quant.c, st_wtype_avx2.c) ------------------------------ */
void st_wtype_quantize_f32(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_f16(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_bf16(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q4_0(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q4_1(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q5_0(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q5_1(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q8_0(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q2_K(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q3_K(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q4_K(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q5_K(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_q6_K(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_iq4_nl(const float *src, void *dst, uint64_t n);
void st_wtype_quantize_iq4_xs(const float *src, void *dst, uint64_t n);

#define ST_WTYPE_DECLARE_VEC(NAME)                                                                \
    void st_wtype_dequant_##NAME##_avx2(const void *src, float *dst, uint64_t n);                 \
    float st_wtype_dot_##NAME##_avx2(const void *row, const float *x, uint64_t n);            \
    void st_wtype_dot_rows_##NAME##_avx2(const void *rows, size_t stride, uint32_t n_rows,      \
                                         const float *x, uint64_t n, float *y);
ST_WTYPE_DECLARE_VEC(f32)
ST_WTYPE_DECLARE_VEC(f16)
ST_WTYPE_DECLARE_VEC(bf16)
ST_WTYPE_DECLARE_VEC(q4_0)
ST_WTYPE_DECLARE_VEC(q4_1)
ST_WTYPE_DECLARE_VEC(q5_0)
ST_WTYPE_DECLARE_VEC(q5_1)
ST_WTYPE_DECLARE_VEC(q8_0)
ST_WTYPE_DECLARE_VEC(q2_K)
ST_WTYPE_DECLARE_VEC(q3_K)
ST_WTYPE_DECLARE_VEC(q4_K)
ST_WTYPE_DECLARE_VEC(q5_K)
ST_WTYPE_DECLARE_VEC(q6_K)
ST_WTYPE_DECLARE_VEC(iq4_nl)
ST_WTYPE_DECLARE_VEC(iq4_xs)
#undef ST_WTYPE_DECLARE_VEC

/* ---- the integer path (st_wtype_qdot.c; docs/ENGINE.md, "The integer path") -----------------
 * llama.cpp's CPU fast path: the activation row is quantized once per matmul as llama.cpp
 * quantizes it for the weight type (ARCHITECTURES.md section 3.7: Q8_0 for Q8_0 weights, Q8_K
 * for the K-quants), then each weight row is dotted with it in integers per block, the block
 * scales applied in f32 in a fixed order (st_wtype_qdot.c invariant 2). [0] scalar reference,
 * [1] AVX2, [2] AVX-512 VNNI (st_kern_cpu_has_avx512vnni), bit-identical; each output computed alone, so results depend neither on threads nor
 * on how rows and tokens are split. Weight types without an entry compute in f32 on their
 * dequantized values (contract 2). */
#define ST_QACT_Q8_0 1 /* 32 values: f32 d (ggml's f16 d widened), 32 int8 (ggml's block_q8_0) */
#define ST_QACT_Q8_K 2 /* 256 values: f32 d, 256 int8, 16 int16 sums of 16 (ggml's block_q8_K) */

/* y[t * ldy + r] = row r (w + r * ws) . activation row t (xq + t * xs), r < nr, t < nt; nb
 * blocks a row (weight and activation blocks cover the same values). */
typedef void (*st_qdot_mm_fn)(const void *w, size_t ws, const void *xq, size_t xs, uint32_t nb,
                              float *y, uint32_t ldy, uint32_t nr, uint32_t nt);
typedef struct st_qdot {
    uint32_t act;         /* ST_QACT_* */
    uint32_t block;       /* values per activation (and weight) block */
    uint32_t act_bytes;   /* bytes per activation block */
    /* n values of x (a multiple of block) into n / block activation blocks at dst. One
     * function for every ISA level. */
    void (*quantize)(const float *x, void *dst, uint64_t n);
    st_qdot_mm_fn mm[3];
} st_qdot;

/* The integer path of weight type `wtype`, or NULL (the f32 path): Q8_0, Q4_K, Q6_K. */
const st_qdot *st_qdot_get(uint32_t wtype);
/* The negative control of tests/ref/test_quant_ref.mjs (STRATA_TEST_WRONG_QACT=1): the block
 * scales of n quantized activation values at xq made 127/128 of what they are. */
void st_qdot_wrong_scale(const st_qdot *qd, void *xq, uint64_t n);

#endif /* ST_WTYPE_H */
