/*
 * st_wtype_avx2.c - the AVX2+FMA+F16C forms of the weight-type table's dequantization and dot
 * products, bit-identical to the scalar reference of st_wtype.c.
 *
 * Invariants:
 * 1. Each value is computed with the scalar reference's operations on the same operands: the
 *    integer level assembled exactly (byte shuffles, shifts, masks), converted to f32, then the
 *    same rounded multiply and add or subtract (_mm256_mul_ps, _mm256_add_ps/_mm256_sub_ps,
 *    never a fused form). Per-block and per-sub-block scales are formed with the scalar code.
 * 2. A dot accumulates 8 lanes with _mm256_fmadd_ps, lane l taking elements 8j + l in increasing
 *    j, and sums them with the canonical tree (hsum8); the float types add their tail with fmaf
 *    after the tree, as the scalar code does.
 * 3. Only called where st_kern_cpu_has_avx2() holds (the caller's st_kern.vec).
 */
#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "st_wtype.h"

#define VEC __attribute__((target("avx2,fma,f16c")))
#define VEC_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* F16C widens exactly and quietens NaN, as st_wtype_f16_to_f32 does. */
VEC_INLINE float f16_at(const uint8_t *p)
{
    return _cvtsh_ss((unsigned short)(p[0] | p[1] << 8));
}

VEC_INLINE float hsum8(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 a = _mm_add_ps(lo, hi);                 /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a)); /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(c);
}

/* 16 signed bytes as two vectors of 8 floats (bytes 0..7, 8..15). */
VEC_INLINE __m256 lo8_i8(__m128i v)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}

VEC_INLINE __m256 hi8_i8(__m128i v)
{
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)));
}

/* Where a decoder's values go: stored to y (a dequantization), or accumulated into acc in
 * the canonical order with the matching x (a dot; values are emitted in increasing element
 * order, 8 at a time, so lane l takes elements 8j + l in increasing j). y and x point at the
 * block's first element. */
typedef struct vsink {
    float *y;
    const float *x;
    __m256 acc;
} vsink;

enum { TO_Y = 0, TO_DOT = 1 };

VEC_INLINE void emit8(vsink *s, const int mode, uint32_t off, __m256 v)
{
    if (mode == TO_DOT)
        s->acc = _mm256_fmadd_ps(v, _mm256_loadu_ps(s->x + off), s->acc);
    else
        _mm256_storeu_ps(s->y + off, v);
}

/* Values [off, off + 16) = levels * d for 16 signed byte levels. */
VEC_INLINE void mul16(vsink *s, const int mode, uint32_t off, __m128i q, __m256 d)
{
    emit8(s, mode, off, _mm256_mul_ps(lo8_i8(q), d));
    emit8(s, mode, off + 8, _mm256_mul_ps(hi8_i8(q), d));
}

/* levels * d + m (Q4_1, Q5_1). */
VEC_INLINE void muladd16(vsink *s, const int mode, uint32_t off, __m128i q, __m256 d, __m256 m)
{
    emit8(s, mode, off, _mm256_add_ps(_mm256_mul_ps(lo8_i8(q), d), m));
    emit8(s, mode, off + 8, _mm256_add_ps(_mm256_mul_ps(hi8_i8(q), d), m));
}

/* d * levels - m (the K-quants with minimums). */
VEC_INLINE void mulsub16(vsink *s, const int mode, uint32_t off, __m128i q, __m256 d, __m256 m)
{
    emit8(s, mode, off, _mm256_sub_ps(_mm256_mul_ps(d, lo8_i8(q)), m));
    emit8(s, mode, off + 8, _mm256_sub_ps(_mm256_mul_ps(d, hi8_i8(q)), m));
}

VEC_INLINE __m128i lo_nib(__m128i v)
{
    return _mm_and_si128(v, _mm_set1_epi8(0x0f));
}

VEC_INLINE __m128i hi_nib(__m128i v)
{
    return _mm_and_si128(_mm_srli_epi16(v, 4), _mm_set1_epi8(0x0f));
}

/* Bits [16 * half, 16 * half + 16) of qh as 16 bytes, 0x10 where the bit is set (Q5_0/Q5_1). */
VEC_INLINE __m128i bit16_x10(uint32_t qh, int half)
{
    __m128i b = _mm_set1_epi16((short)(uint16_t)(qh >> (16 * half)));
    b = _mm_shuffle_epi8(b, _mm_set_epi8(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0));
    const __m128i sel = _mm_set1_epi64x((long long)0x8040201008040201ull);
    b = _mm_cmpeq_epi8(_mm_and_si128(b, sel), sel);
    return _mm_and_si128(b, _mm_set1_epi8(0x10));
}

static inline uint32_t u32_at(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4); /* little-endian host (x86) */
    return v;
}

VEC_INLINE __m128i load16(const uint8_t *p)
{
    return _mm_loadu_si128((const __m128i *)p);
}

/* ---- block decoders, values emitted in increasing order --------------------------------------- */
VEC_INLINE void deqv_q4_0(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b));
    const __m128i qs = load16(b + 2), eight = _mm_set1_epi8(8);
    mul16(s, mode, 0, _mm_sub_epi8(lo_nib(qs), eight), d);
    mul16(s, mode, 16, _mm_sub_epi8(hi_nib(qs), eight), d);
}

VEC_INLINE void deqv_q4_1(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b)), m = _mm256_set1_ps(f16_at(b + 2));
    const __m128i qs = load16(b + 4);
    muladd16(s, mode, 0, lo_nib(qs), d, m);
    muladd16(s, mode, 16, hi_nib(qs), d, m);
}

VEC_INLINE void deqv_q5_0(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b));
    const uint32_t qh = u32_at(b + 2);
    const __m128i qs = load16(b + 6), s16 = _mm_set1_epi8(16);
    mul16(s, mode, 0, _mm_sub_epi8(_mm_or_si128(lo_nib(qs), bit16_x10(qh, 0)), s16), d);
    mul16(s, mode, 16, _mm_sub_epi8(_mm_or_si128(hi_nib(qs), bit16_x10(qh, 1)), s16), d);
}

VEC_INLINE void deqv_q5_1(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b)), m = _mm256_set1_ps(f16_at(b + 2));
    const uint32_t qh = u32_at(b + 4);
    const __m128i qs = load16(b + 8);
    muladd16(s, mode, 0, _mm_or_si128(lo_nib(qs), bit16_x10(qh, 0)), d, m);
    muladd16(s, mode, 16, _mm_or_si128(hi_nib(qs), bit16_x10(qh, 1)), d, m);
}

VEC_INLINE void deqv_q8_0(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b));
    mul16(s, mode, 0, load16(b + 2), d);
    mul16(s, mode, 16, load16(b + 18), d);
}

VEC_INLINE __m128i crumb(__m128i q, int shift)
{
    return _mm_and_si128(_mm_srl_epi16(q, _mm_cvtsi32_si128(shift)), _mm_set1_epi8(3));
}

VEC_INLINE void deqv_q2_K(const uint8_t *b, vsink *s, const int mode)
{
    const uint8_t *sc = b, *q = b + 16;
    const float d = f16_at(b + 80), dmin = f16_at(b + 82);
    uint32_t off = 0;
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++)
            for (int part = 0; part < 2; part++, off += 16) {
                uint8_t c = sc[8 * n + 2 * j + part];
                __m256 dl = _mm256_set1_ps(d * (float)(c & 0xf)),
                       ml = _mm256_set1_ps(dmin * (float)(c >> 4));
                mulsub16(s, mode, off, crumb(load16(q + 16 * part), 2 * j), dl, ml);
            }
}

static inline int q3k_scale(const uint8_t *scales, int i)
{
    int low = i < 8 ? scales[i] & 0xf : scales[i - 8] >> 4;
    int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

VEC_INLINE void deqv_q3_K(const uint8_t *b, vsink *s, const int mode)
{
    const uint8_t *hm = b, *q = b + 32, *scales = b + 96;
    const float d = f16_at(b + 108);
    const __m128i four = _mm_set1_epi8(4), zero = _mm_setzero_si128();
    uint32_t off = 0;
    for (int n = 0; n < 2; n++, q += 32)
        for (int j = 0; j < 4; j++) {
            const __m128i m = _mm_set1_epi8((char)(1u << (4 * n + j)));
            for (int part = 0; part < 2; part++, off += 16) {
                __m256 dl = _mm256_set1_ps(d * (float)q3k_scale(scales, 8 * n + 2 * j + part));
                __m128i lv = crumb(load16(q + 16 * part), 2 * j);
                __m128i h = _mm_and_si128(load16(hm + 16 * part), m);
                lv = _mm_sub_epi8(lv, _mm_and_si128(_mm_cmpeq_epi8(h, zero), four));
                mul16(s, mode, off, lv, dl);
            }
        }
}

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

VEC_INLINE void deqv_q4_K(const uint8_t *b, vsink *s, const int mode)
{
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *q = b + 16;
    for (uint32_t g = 0; g < 4; g++, q += 32) {
        uint8_t sc, mn;
        k4_scale_min(scales, 2 * (int)g, &sc, &mn);
        const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)mn);
        k4_scale_min(scales, 2 * (int)g + 1, &sc, &mn);
        const __m256 d2 = _mm256_set1_ps(d * (float)sc), m2 = _mm256_set1_ps(dmin * (float)mn);
        const __m128i v0 = load16(q), v1 = load16(q + 16);
        mulsub16(s, mode, 64 * g, lo_nib(v0), d1, m1);
        mulsub16(s, mode, 64 * g + 16, lo_nib(v1), d1, m1);
        mulsub16(s, mode, 64 * g + 32, hi_nib(v0), d2, m2);
        mulsub16(s, mode, 64 * g + 48, hi_nib(v1), d2, m2);
    }
}

VEC_INLINE void deqv_q5_K(const uint8_t *b, vsink *s, const int mode)
{
    const float d = f16_at(b), dmin = f16_at(b + 2);
    const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
    const __m128i s16 = _mm_set1_epi8(16), h0 = load16(qh), h1 = load16(qh + 16);
    for (uint32_t g = 0; g < 4; g++, ql += 32) {
        uint8_t sc, mn;
        const __m128i u1 = _mm_set1_epi8((char)(1u << (2 * g))), u2 = _mm_set1_epi8((char)(2u << (2 * g)));
        k4_scale_min(scales, 2 * (int)g, &sc, &mn);
        const __m256 d1 = _mm256_set1_ps(d * (float)sc), m1 = _mm256_set1_ps(dmin * (float)mn);
        k4_scale_min(scales, 2 * (int)g + 1, &sc, &mn);
        const __m256 d2 = _mm256_set1_ps(d * (float)sc), m2 = _mm256_set1_ps(dmin * (float)mn);
        const __m128i v0 = load16(ql), v1 = load16(ql + 16);
#define Q5K_BIT(h, u) _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, u), u), s16)
        mulsub16(s, mode, 64 * g, _mm_or_si128(lo_nib(v0), Q5K_BIT(h0, u1)), d1, m1);
        mulsub16(s, mode, 64 * g + 16, _mm_or_si128(lo_nib(v1), Q5K_BIT(h1, u1)), d1, m1);
        mulsub16(s, mode, 64 * g + 32, _mm_or_si128(hi_nib(v0), Q5K_BIT(h0, u2)), d2, m2);
        mulsub16(s, mode, 64 * g + 48, _mm_or_si128(hi_nib(v1), Q5K_BIT(h1, u2)), d2, m2);
#undef Q5K_BIT
    }
}

VEC_INLINE void deqv_q6_K(const uint8_t *b, vsink *s, const int mode)
{
    const uint8_t *ql = b, *qh = b + 128;
    const int8_t *sc = (const int8_t *)(b + 192);
    const float d = f16_at(b + 208);
    const __m128i s32 = _mm_set1_epi8(32);
    for (uint32_t h = 0; h < 2; h++, ql += 64, qh += 32, sc += 8) {
        const __m128i L0a = load16(ql), L0b = load16(ql + 16), L1a = load16(ql + 32),
                      L1b = load16(ql + 48), Ha = load16(qh), Hb = load16(qh + 16);
        const uint32_t o = 128 * h;
        /* quarter k of the half: low or high nibbles of L0 or L1, bits 2k.. of H */
#define Q6K_Q(L, H, k, lo) \
    _mm_sub_epi8(_mm_or_si128(lo ? lo_nib(L) : hi_nib(L), _mm_slli_epi16(crumb(H, 2 * k), 4)), s32)
        mul16(s, mode, o, Q6K_Q(L0a, Ha, 0, 1), _mm256_set1_ps(d * (float)sc[0]));
        mul16(s, mode, o + 16, Q6K_Q(L0b, Hb, 0, 1), _mm256_set1_ps(d * (float)sc[1]));
        mul16(s, mode, o + 32, Q6K_Q(L1a, Ha, 1, 1), _mm256_set1_ps(d * (float)sc[2]));
        mul16(s, mode, o + 48, Q6K_Q(L1b, Hb, 1, 1), _mm256_set1_ps(d * (float)sc[3]));
        mul16(s, mode, o + 64, Q6K_Q(L0a, Ha, 2, 0), _mm256_set1_ps(d * (float)sc[4]));
        mul16(s, mode, o + 80, Q6K_Q(L0b, Hb, 2, 0), _mm256_set1_ps(d * (float)sc[5]));
        mul16(s, mode, o + 96, Q6K_Q(L1a, Ha, 3, 0), _mm256_set1_ps(d * (float)sc[6]));
        mul16(s, mode, o + 112, Q6K_Q(L1b, Hb, 3, 0), _mm256_set1_ps(d * (float)sc[7]));
#undef Q6K_Q
    }
}

VEC_INLINE __m128i iq4_table(void)
{
    return _mm_loadu_si128((const __m128i *)st_wtype_iq4nl_values);
}

VEC_INLINE void deqv_iq4_nl(const uint8_t *b, vsink *s, const int mode)
{
    const __m256 d = _mm256_set1_ps(f16_at(b));
    const __m128i qs = load16(b + 2), t = iq4_table();
    mul16(s, mode, 0, _mm_shuffle_epi8(t, lo_nib(qs)), d);
    mul16(s, mode, 16, _mm_shuffle_epi8(t, hi_nib(qs)), d);
}

VEC_INLINE void deqv_iq4_xs(const uint8_t *b, vsink *s, const int mode)
{
    const float d = f16_at(b);
    const unsigned scales_h = (unsigned)b[2] | (unsigned)b[3] << 8;
    const uint8_t *scales_l = b + 4, *qs = b + 8;
    const __m128i t = iq4_table();
    for (uint32_t ib = 0; ib < 8; ib++, qs += 16) {
        int ls = ((scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) | (int)((scales_h >> (2 * ib)) & 3u) << 4;
        const __m256 dl = _mm256_set1_ps(d * (float)(ls - 32));
        const __m128i v = load16(qs);
        mul16(s, mode, 32 * ib, _mm_shuffle_epi8(t, lo_nib(v)), dl);
        mul16(s, mode, 32 * ib + 16, _mm_shuffle_epi8(t, hi_nib(v)), dl);
    }
}

/* ---- rows ------------------------------------------------------------------------------------------- */
#define QTYPE_VEC(NAME, QK, BYTES)                                                               \
    VEC void st_wtype_dequant_##NAME##_avx2(const void *src, float *dst, uint64_t n)             \
    {                                                                                            \
        const uint8_t *b = src;                                                                  \
        vsink s = {dst, NULL, _mm256_setzero_ps()};                                              \
        for (uint64_t k = 0; k < n; k += QK, b += BYTES, s.y += QK)                              \
            deqv_##NAME(b, &s, TO_Y);                                                            \
    }                                                                                            \
    VEC float st_wtype_dot_##NAME##_avx2(const void *row, const float *x, uint64_t n)            \
    {                                                                                            \
        const uint8_t *b = row;                                                                  \
        vsink s = {NULL, x, _mm256_setzero_ps()};                                                \
        for (uint64_t k = 0; k < n; k += QK, b += BYTES, s.x += QK)                              \
            deqv_##NAME(b, &s, TO_DOT);                                                          \
        return hsum8(s.acc);                                                                     \
    }                                                                                            \
    VEC void st_wtype_dot_rows_##NAME##_avx2(const void *rows, size_t stride, uint32_t nr,       \
                                             const float *x, uint64_t n, float *y)              \
    {                                                                                            \
        const uint8_t *w = rows;                                                                 \
        uint32_t r = 0;                                                                          \
        for (; r + 4 <= nr; r += 4) {                                                            \
            const uint8_t *b0 = w + r * stride, *b1 = b0 + stride, *b2 = b1 + stride,            \
                          *b3 = b2 + stride;                                                     \
            vsink s0 = {NULL, x, _mm256_setzero_ps()}, s1 = s0, s2 = s0, s3 = s0;                \
            for (uint64_t k = 0; k < n; k += QK, b0 += BYTES, b1 += BYTES, b2 += BYTES,          \
                          b3 += BYTES) {                                                         \
                s0.x = s1.x = s2.x = s3.x = x + k;                                               \
                deqv_##NAME(b0, &s0, TO_DOT);                                                    \
                deqv_##NAME(b1, &s1, TO_DOT);                                                    \
                deqv_##NAME(b2, &s2, TO_DOT);                                                    \
                deqv_##NAME(b3, &s3, TO_DOT);                                                    \
            }                                                                                    \
            y[r] = hsum8(s0.acc);                                                                \
            y[r + 1] = hsum8(s1.acc);                                                            \
            y[r + 2] = hsum8(s2.acc);                                                            \
            y[r + 3] = hsum8(s3.acc);                                                            \
        }                                                                                        \
        for (; r < nr; r++)                                                                      \
            y[r] = st_wtype_dot_##NAME##_avx2(w + r * stride, x, n);                             \
    }

QTYPE_VEC(q4_0, 32, 18)
QTYPE_VEC(q4_1, 32, 20)
QTYPE_VEC(q5_0, 32, 22)
QTYPE_VEC(q5_1, 32, 24)
QTYPE_VEC(q8_0, 32, 34)
QTYPE_VEC(q2_K, 256, 84)
QTYPE_VEC(q3_K, 256, 110)
QTYPE_VEC(q4_K, 256, 144)
QTYPE_VEC(q5_K, 256, 176)
QTYPE_VEC(q6_K, 256, 210)
QTYPE_VEC(iq4_nl, 32, 18)
QTYPE_VEC(iq4_xs, 256, 136)

/* Float types: 8 values per vector, the tail in scalar code with the same conversions. */
VEC_INLINE __m256 load8_f32(const uint8_t *p)
{
    return _mm256_loadu_ps((const float *)p);
}

VEC_INLINE __m256 load8_f16(const uint8_t *p)
{
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

VEC_INLINE __m256 load8_bf16(const uint8_t *p)
{
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline float at_f32(const uint8_t *p)
{
    float v;
    memcpy(&v, p, 4);
    return v;
}

VEC_INLINE float at_f16(const uint8_t *p)
{
    return f16_at(p);
}

static inline float at_bf16(const uint8_t *p)
{
    uint32_t f = ((uint32_t)p[0] | (uint32_t)p[1] << 8) << 16;
    float out;
    memcpy(&out, &f, 4);
    return out;
}

#define FTYPE_VEC(NAME, SIZE)                                                                    \
    VEC void st_wtype_dequant_##NAME##_avx2(const void *src, float *dst, uint64_t n)             \
    {                                                                                            \
        const uint8_t *p = src;                                                                  \
        uint64_t n8 = n & ~(uint64_t)7, k;                                                       \
        for (k = 0; k < n8; k += 8)                                                              \
            _mm256_storeu_ps(dst + k, load8_##NAME(p + SIZE * k));                               \
        for (; k < n; k++)                                                                       \
            dst[k] = at_##NAME(p + SIZE * k);                                                    \
    }                                                                                            \
    VEC float st_wtype_dot_##NAME##_avx2(const void *row, const float *x, uint64_t n)            \
    {                                                                                            \
        const uint8_t *p = row;                                                                  \
        __m256 acc = _mm256_setzero_ps();                                                        \
        uint64_t n8 = n & ~(uint64_t)7, k;                                                       \
        for (k = 0; k < n8; k += 8)                                                              \
            acc = _mm256_fmadd_ps(load8_##NAME(p + SIZE * k), _mm256_loadu_ps(x + k), acc);      \
        float s = hsum8(acc);                                                                    \
        for (; k < n; k++)                                                                       \
            s = fmaf(at_##NAME(p + SIZE * k), x[k], s);                                          \
        return s;                                                                                \
    }                                                                                            \
    VEC void st_wtype_dot_rows_##NAME##_avx2(const void *rows, size_t stride, uint32_t nr,       \
                                             const float *x, uint64_t n, float *y)              \
    {                                                                                            \
        const uint8_t *w = rows;                                                                 \
        uint64_t n8 = n & ~(uint64_t)7;                                                          \
        uint32_t r = 0;                                                                          \
        for (; r + 4 <= nr; r += 4) {                                                            \
            const uint8_t *p0 = w + r * stride, *p1 = p0 + stride, *p2 = p1 + stride,            \
                          *p3 = p2 + stride;                                                     \
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;                          \
            for (uint64_t k = 0; k < n8; k += 8) {                                               \
                __m256 xv = _mm256_loadu_ps(x + k);                                              \
                a0 = _mm256_fmadd_ps(load8_##NAME(p0 + SIZE * k), xv, a0);                       \
                a1 = _mm256_fmadd_ps(load8_##NAME(p1 + SIZE * k), xv, a1);                       \
                a2 = _mm256_fmadd_ps(load8_##NAME(p2 + SIZE * k), xv, a2);                       \
                a3 = _mm256_fmadd_ps(load8_##NAME(p3 + SIZE * k), xv, a3);                       \
            }                                                                                    \
            const uint8_t *p[4] = {p0, p1, p2, p3};                                              \
            float s[4] = {hsum8(a0), hsum8(a1), hsum8(a2), hsum8(a3)};                           \
            for (int i = 0; i < 4; i++) {                                                        \
                for (uint64_t k = n8; k < n; k++)                                                \
                    s[i] = fmaf(at_##NAME(p[i] + SIZE * k), x[k], s[i]);                         \
                y[r + (uint32_t)i] = s[i];                                                       \
            }                                                                                    \
        }                                                                                        \
        for (; r < nr; r++)                                                                      \
            y[r] = st_wtype_dot_##NAME##_avx2(w + r * stride, x, n);                             \
    }

FTYPE_VEC(f32, 4)
FTYPE_VEC(f16, 2)
FTYPE_VEC(bf16, 2)
