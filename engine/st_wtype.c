/*
 * st_wtype.c - the weight-type traits table and the scalar reference of every type's
 * dequantization and dot product (the AVX2 forms: st_wtype_avx2.c; the quantizers:
 * st_wtype_quant.c).
 *
 * Invariants:
 * 1. Each value of a block is computed with the operations and the order of ggml's
 *    dequantize_row_* (v0.4.0): an integer converted to f32, then one rounded multiply (and,
 *    for types with a minimum, one rounded add or subtract); the products of scales are formed
 *    in ggml's order (Q6_K: (d * scale) * q). This file is compiled with -ffp-contract=off, so
 *    nothing is fused.
 * 2. A dot of a quantized row dequantizes one block at a time into a buffer and accumulates it
 *    in the canonical order of st_engine_int.h (lane l takes elements 8j + l, fused, in
 *    increasing j; the lane tree at the end). Blocks are multiples of 8 values, so a quantized
 *    row has no tail; f32/f16/bf16 rows may, and add it after the tree with fused adds.
 * 3. The table has one row per supported type and nothing else: st_wtype_get of any other id
 *    is NULL; there is no fallback type.
 */
#include <math.h>
#include <string.h>

#include "st_engine_int.h"
#include "st_wtype.h"

const int8_t st_wtype_iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                          1,    13,   25,  38,  53,  69,  89,  113};

/* ---- f16 / bf16 ----------------------------------------------------------------------------- */
float st_wtype_f16_to_f32(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    float out;
    if (e == 0) {
        float v = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        memcpy(&f, &v, 4);
        f |= s;
    } else if (e == 31) {
        f = s | 0x7f800000u | (m << 13) | (m ? 0x00400000u : 0u); /* NaN: quiet */
    } else {
        f = s | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&out, &f, 4);
    return out;
}

/* Round to nearest even by letting the f32 adder round: the value is scaled so that its f16
 * ulp becomes the f32 ulp of a bias added to it (the method of ggml_compute_fp32_to_fp16). */
uint16_t st_wtype_f32_to_f16(float f)
{
    float base = (fabsf(f) * 0x1p+112f) * 0x1p-110f;
    uint32_t w, bits, bias;
    memcpy(&w, &f, 4);
    uint32_t shl1_w = w + w, sign = w & 0x80000000u;
    bias = shl1_w & 0xff000000u;
    if (bias < 0x71000000u)
        bias = 0x71000000u;
    uint32_t bb = (bias >> 1) + 0x07800000u;
    float fb;
    memcpy(&fb, &bb, 4);
    base = fb + base;
    memcpy(&bits, &base, 4);
    uint32_t nonsign = ((bits >> 13) & 0x7c00u) + (bits & 0x0fffu);
    return (uint16_t)((sign >> 16) | (shl1_w > 0xff000000u ? 0x7e00u : nonsign));
}

uint16_t st_wtype_f32_to_bf16(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 64u);
    return (uint16_t)((u + (0x7fffu + ((u >> 16) & 1u))) >> 16);
}

static inline float f16_at(const uint8_t *p)
{
    return st_wtype_f16_to_f32((uint16_t)(p[0] | (uint16_t)p[1] << 8));
}

static inline float bf16_at(const uint8_t *p)
{
    uint32_t f = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
    float out;
    memcpy(&out, &f, 4);
    return out;
}

/* ---- block decoders (one block of the type into y) ------------------------------------------- */
static void deq_q4_0(const uint8_t *b, float *y)
{
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)((qs[j] & 0xf) - 8) * d;
        y[j + 16] = (float)((qs[j] >> 4) - 8) * d;
    }
}

static void deq_q4_1(const uint8_t *b, float *y)
{
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint8_t *qs = b + 4;
    for (int j = 0; j < 16; j++) {
        y[j] = (float)(qs[j] & 0xf) * d + m;
        y[j + 16] = (float)(qs[j] >> 4) * d + m;
    }
}

static inline uint32_t u32_at(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void deq_q5_0(const uint8_t *b, float *y)
{
    const float d = f16_at(b);
    const uint32_t qh = u32_at(b + 2);
    const uint8_t *qs = b + 6;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xf) | (int)((qh >> j) & 1u) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)(lo - 16) * d;
        y[j + 16] = (float)(hi - 16) * d;
    }
}

static void deq_q5_1(const uint8_t *b, float *y)
{
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = u32_at(b + 4);
    const uint8_t *qs = b + 8;
    for (int j = 0; j < 16; j++) {
        int lo = (qs[j] & 0xf) | (int)((qh >> j) & 1u) << 4;
        int hi = (qs[j] >> 4) | (int)((qh >> (j + 16)) & 1u) << 4;
        y[j] = (float)lo * d + m;
        y[j + 16] = (float)hi * d + m;
    }
}

static void deq_q8_0(const uint8_t *b, float *y)
{
    const float d = f16_at(b);
    const int8_t *qs = (const int8_t *)(b + 2);
    for (int j = 0; j < 32; j++)
        y[j] = (float)qs[j] * d;
}

static void deq_q2_K(const uint8_t *b, float *y)
{
    const uint8_t *sc = b, *q = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int part = 0; part < 2; part++) {
                uint8_t s = sc[8 * n + 2 * j + part];
                float dl = d * (float)(s & 0xf), ml = dmin * (float)(s >> 4);
                for (int l = 0; l < 16; l++)
                    *y++ = dl * (float)((q[16 * part + l] >> (2 * j)) & 3) - ml;
            }
}

/* The sixteen 6-bit scales of a Q3_K block, less 32. */
static inline int q3k_scale(const uint8_t *scales, int i)
{
    int low = i < 8 ? scales[i] & 0xf : scales[i - 8] >> 4;
    int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

static void deq_q3_K(const uint8_t *b, float *y)
{
    const uint8_t *hm = b, *q = b + 32, *scales = b + 96;
    const float d = f16_at(b + 108);
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++) {
            const uint8_t m = (uint8_t)(1u << (4 * n + j));
            for (int part = 0; part < 2; part++) {
                float dl = d * (float)q3k_scale(scales, 8 * n + 2 * j + part);
                for (int l = 0; l < 16; l++) {
                    int e = 16 * part + l;
                    *y++ = dl * (float)(((q[e] >> (2 * j)) & 3) - ((hm[e] & m) ? 0 : 4));
                }
            }
        }
}

/* The j-th 6-bit (scale, min) pair of a Q4_K / Q5_K block. */
static inline void k4_scale_min(const uint8_t *q, int j, uint8_t *sc, uint8_t *mn)
{
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (uint8_t)((q[j + 4] & 0xf) | ((q[j - 4] >> 6) << 4));
        *mn = (uint8_t)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

static void deq_q4_K(const uint8_t *b, float *y)
{
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (int g = 0; g < 4; g++, q += 32) {
        uint8_t sc, mn;
        k4_scale_min(scales, 2 * g, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        k4_scale_min(scales, 2 * g + 1, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)(q[l] & 0xf) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)(q[l] >> 4) - m2;
    }
}

static void deq_q5_K(const uint8_t *b, float *y)
{
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    for (int g = 0; g < 4; g++, ql += 32) {
        uint8_t sc, mn, u1 = (uint8_t)(1u << (2 * g)), u2 = (uint8_t)(2u << (2 * g));
        k4_scale_min(scales, 2 * g, &sc, &mn);
        const float d1 = d * (float)sc, m1 = dmin * (float)mn;
        k4_scale_min(scales, 2 * g + 1, &sc, &mn);
        const float d2 = d * (float)sc, m2 = dmin * (float)mn;
        for (int l = 0; l < 32; l++)
            *y++ = d1 * (float)((ql[l] & 0xf) + (qh[l] & u1 ? 16 : 0)) - m1;
        for (int l = 0; l < 32; l++)
            *y++ = d2 * (float)((ql[l] >> 4) + (qh[l] & u2 ? 16 : 0)) - m2;
    }
}

static void deq_q6_K(const uint8_t *b, float *y)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    for (int h = 0; h < 2; h++, y += 128, ql += 64, qh += 32, sc += 8)
        for (int l = 0; l < 32; l++) {
            int is = l / 16;
            int q1 = ((ql[l] & 0xf) | ((qh[l] >> 0) & 3) << 4) - 32;
            int q2 = ((ql[l + 32] & 0xf) | ((qh[l] >> 2) & 3) << 4) - 32;
            int q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) - 32;
            int q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) - 32;
            y[l] = d * (float)sc[is] * (float)q1;
            y[l + 32] = d * (float)sc[is + 2] * (float)q2;
            y[l + 64] = d * (float)sc[is + 4] * (float)q3;
            y[l + 96] = d * (float)sc[is + 6] * (float)q4;
        }
}

static void deq_iq4_nl(const uint8_t *b, float *y)
{
    const float d = f16_at(b);
    const uint8_t *qs = b + 2;
    for (int j = 0; j < 16; j++) {
        y[j] = d * (float)st_wtype_iq4nl_values[qs[j] & 0xf];
        y[j + 16] = d * (float)st_wtype_iq4nl_values[qs[j] >> 4];
    }
}

static void deq_iq4_xs(const uint8_t *b, float *y)
{
    const float d = f16_at(b);
    const unsigned scales_h = (unsigned)b[2] | (unsigned)b[3] << 8;
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    for (int ib = 0; ib < 8; ib++, y += 32, qs += 16) {
        int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) | (int)((scales_h >> (2 * ib)) & 3u) << 4;
        const float dl = d * (float)(ls - 32);
        for (int j = 0; j < 16; j++) {
            y[j] = dl * (float)st_wtype_iq4nl_values[qs[j] & 0xf];
            y[j + 16] = dl * (float)st_wtype_iq4nl_values[qs[j] >> 4];
        }
    }
}

/* ---- rows: dequantize and dot ------------------------------------------------------------------ */
static inline float lanes_sum(const float a[8])
{
    float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    float c0 = b0 + b2, c1 = b1 + b3;
    return c0 + c1;
}

#define QTYPE_SCALAR(NAME, QK, BYTES)                                                            \
    static void dequant_##NAME(const void *src, float *dst, uint64_t n)                          \
    {                                                                                            \
        const uint8_t *b = src;                                                                  \
        for (uint64_t k = 0; k < n; k += QK, b += BYTES)                                         \
            deq_##NAME(b, dst + k);                                                              \
    }                                                                                            \
    static float dot_##NAME(const void *row, const float *x, uint64_t n)                         \
    {                                                                                            \
        float acc[8] = {0}, buf[QK];                                                             \
        const uint8_t *b = row;                                                                  \
        for (uint64_t k = 0; k < n; k += QK, b += BYTES) {                                       \
            deq_##NAME(b, buf);                                                                  \
            for (uint32_t i = 0; i < QK; i += 8)                                                 \
                for (uint32_t l = 0; l < 8; l++)                                                 \
                    acc[l] = fmaf(buf[i + l], x[k + i + l], acc[l]);                             \
        }                                                                                        \
        return lanes_sum(acc);                                                                   \
    }

QTYPE_SCALAR(q4_0, 32, 18)
QTYPE_SCALAR(q4_1, 32, 20)
QTYPE_SCALAR(q5_0, 32, 22)
QTYPE_SCALAR(q5_1, 32, 24)
QTYPE_SCALAR(q8_0, 32, 34)
QTYPE_SCALAR(q2_K, 256, 84)
QTYPE_SCALAR(q3_K, 256, 110)
QTYPE_SCALAR(q4_K, 256, 144)
QTYPE_SCALAR(q5_K, 256, 176)
QTYPE_SCALAR(q6_K, 256, 210)
QTYPE_SCALAR(iq4_nl, 32, 18)
QTYPE_SCALAR(iq4_xs, 256, 136)

/* Float types: one value per "block"; rows of any length (the tail after the lane tree). */
static inline float f32_at(const uint8_t *p)
{
    float v;
    memcpy(&v, p, 4);
    return v;
}

#define FTYPE_SCALAR(NAME, SIZE, AT)                                                             \
    static void dequant_##NAME(const void *src, float *dst, uint64_t n)                          \
    {                                                                                            \
        const uint8_t *p = src;                                                                  \
        for (uint64_t k = 0; k < n; k++)                                                         \
            dst[k] = AT(p + SIZE * k);                                                           \
    }                                                                                            \
    static float dot_##NAME(const void *row, const float *x, uint64_t n)                         \
    {                                                                                            \
        const uint8_t *p = row;                                                                  \
        float acc[8] = {0};                                                                      \
        uint64_t n8 = n & ~(uint64_t)7, k;                                                       \
        for (k = 0; k < n8; k += 8)                                                              \
            for (uint32_t l = 0; l < 8; l++)                                                     \
                acc[l] = fmaf(AT(p + SIZE * (k + l)), x[k + l], acc[l]);                         \
        float s = lanes_sum(acc);                                                                \
        for (; k < n; k++)                                                                       \
            s = fmaf(AT(p + SIZE * k), x[k], s);                                                 \
        return s;                                                                                \
    }

FTYPE_SCALAR(f32, 4, f32_at)
FTYPE_SCALAR(f16, 2, f16_at)
FTYPE_SCALAR(bf16, 2, bf16_at)

/* The scalar rows: one dot after the other. */
#define DOT_ROWS_SCALAR(NAME)                                                                    \
    static void dot_rows_##NAME(const void *rows, size_t stride, uint32_t nr, const float *x,    \
                                uint64_t n, float *y)                                            \
    {                                                                                            \
        for (uint32_t r = 0; r < nr; r++)                                                        \
            y[r] = dot_##NAME((const uint8_t *)rows + r * stride, x, n);                         \
    }
DOT_ROWS_SCALAR(f32)
DOT_ROWS_SCALAR(f16)
DOT_ROWS_SCALAR(bf16)
DOT_ROWS_SCALAR(q4_0)
DOT_ROWS_SCALAR(q4_1)
DOT_ROWS_SCALAR(q5_0)
DOT_ROWS_SCALAR(q5_1)
DOT_ROWS_SCALAR(q8_0)
DOT_ROWS_SCALAR(q2_K)
DOT_ROWS_SCALAR(q3_K)
DOT_ROWS_SCALAR(q4_K)
DOT_ROWS_SCALAR(q5_K)
DOT_ROWS_SCALAR(q6_K)
DOT_ROWS_SCALAR(iq4_nl)
DOT_ROWS_SCALAR(iq4_xs)

/* ---- the table ------------------------------------------------------------------------------------ */
#define ROW(ID, NAME, STR, QK, BYTES)                                                            \
    [ID] = {ID,                                                                                  \
            STR,                                                                                 \
            QK,                                                                                  \
            BYTES,                                                                               \
            {dequant_##NAME, st_wtype_dequant_##NAME##_avx2},                                    \
            {dot_##NAME, st_wtype_dot_##NAME##_avx2},                                            \
            {dot_rows_##NAME, st_wtype_dot_rows_##NAME##_avx2},                                  \
            st_wtype_quantize_##NAME}

static const st_wtype k_wtypes[] = {
    ROW(ST_GGML_F32, f32, "f32", 1, 4),
    ROW(ST_GGML_F16, f16, "f16", 1, 2),
    ROW(ST_GGML_Q4_0, q4_0, "q4_0", 32, 18),
    ROW(ST_GGML_Q4_1, q4_1, "q4_1", 32, 20),
    ROW(ST_GGML_Q5_0, q5_0, "q5_0", 32, 22),
    ROW(ST_GGML_Q5_1, q5_1, "q5_1", 32, 24),
    ROW(ST_GGML_Q8_0, q8_0, "q8_0", 32, 34),
    ROW(ST_GGML_Q2_K, q2_K, "q2_K", 256, 84),
    ROW(ST_GGML_Q3_K, q3_K, "q3_K", 256, 110),
    ROW(ST_GGML_Q4_K, q4_K, "q4_K", 256, 144),
    ROW(ST_GGML_Q5_K, q5_K, "q5_K", 256, 176),
    ROW(ST_GGML_Q6_K, q6_K, "q6_K", 256, 210),
    ROW(ST_GGML_IQ4_NL, iq4_nl, "iq4_nl", 32, 18),
    ROW(ST_GGML_IQ4_XS, iq4_xs, "iq4_xs", 256, 136),
    ROW(ST_GGML_BF16, bf16, "bf16", 1, 2),
};
#define N_IDS (sizeof k_wtypes / sizeof k_wtypes[0])

/* The rows in id order, without the holes of the id-indexed array. */
static const st_wtype *const k_rows[] = {
    &k_wtypes[ST_GGML_F32],    &k_wtypes[ST_GGML_F16],    &k_wtypes[ST_GGML_Q4_0],
    &k_wtypes[ST_GGML_Q4_1],   &k_wtypes[ST_GGML_Q5_0],   &k_wtypes[ST_GGML_Q5_1],
    &k_wtypes[ST_GGML_Q8_0],   &k_wtypes[ST_GGML_Q2_K],   &k_wtypes[ST_GGML_Q3_K],
    &k_wtypes[ST_GGML_Q4_K],   &k_wtypes[ST_GGML_Q5_K],   &k_wtypes[ST_GGML_Q6_K],
    &k_wtypes[ST_GGML_IQ4_NL], &k_wtypes[ST_GGML_IQ4_XS], &k_wtypes[ST_GGML_BF16],
};
#define N_ROWS (sizeof k_rows / sizeof k_rows[0])

const st_wtype *st_wtype_get(uint32_t type)
{
    if (type >= N_IDS || k_wtypes[type].name == NULL)
        return NULL;
    return &k_wtypes[type];
}

const st_wtype *const *st_wtype_table(uint32_t *n_types)
{
    *n_types = (uint32_t)N_ROWS;
    return k_rows;
}

int st_wtype_has_avx2(void)
{
    return st_kern_cpu_has_avx2();
}

int st_wtype_row_bytes(const st_wtype *t, uint64_t n, uint64_t *bytes)
{
    if (n == 0 || n % t->block)
        return ST_EGEOMETRY;
    if (n / t->block > UINT64_MAX / t->bytes)
        return ST_ETOOBIG;
    *bytes = n / t->block * t->bytes;
    return 0;
}
