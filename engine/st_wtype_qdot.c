/*
 * st_wtype_qdot.c - the integer path for quantized weights: activation rows quantized as
 * llama.cpp's CPU backend quantizes them (ARCHITECTURES.md section 3.7), and dot products of
 * weight blocks with those rows in integers, a scalar reference, an AVX2 form and an AVX-512
 * VNNI form (st_wtype.h, "The integer path").
 *
 * Invariants:
 * 1. An activation row is quantized by one function for every ISA level (it is O(n) against
 *    the matmul's O(n x rows)), so its bytes never depend on the CPU.
 * 2. The result of one (row, token) product is defined block by block: the integer products of
 *    weight and activation values (with the weight's integer sub-block scales) are summed exactly
 *    into 8 lanes, lane m taking the elements i of the block with (i mod 32) / 4 == m (the lanes
 *    of maddubs + madd); then per lane acc[m] = fmaf(D_b, (float)lane[m], acc[m]) with D_b the
 *    product of the two block scales (one f32 multiply), and the result is the lane tree of
 *    st_kernels.c. Types with minima (Q4_K) keep 8 more lanes, one per sub-block j,
 *    accm[j] = fmaf(Dmin_b, (float)(min_j * bsum_j), accm[j]), and subtract their tree.
 * 3. Integer sums cannot overflow (bounds at each kernel), so the scalar code may sum in any
 *    order; the float operations are the same in every form, one rounding each (this file is
 *    compiled with -ffp-contract=off). Results are therefore bit-identical across ISA levels,
 *    and, each output being computed alone, across thread counts and tilings.
 * 4. The AVX-512 form keeps each (row, token)'s 8 lanes in one 256-bit half of a zmm (two rows
 *    per zmm, the token's block broadcast to both halves), so it needs no other definition; its
 *    byte products (vpdpbusd, vpmaddubsw) never saturate for these ranges (bounds at each
 *    kernel), so its integer lanes are those of the AVX2 form.
 */
#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "st_engine_int.h"
#include "st_wtype.h"

#define VEC __attribute__((target("avx2,fma,f16c")))
#define VEC_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* ---- activation rows --------------------------------------------------------------------- */
/* Q8_0 activation block: ggml's block_q8_0 with its f16 d widened to f32 (exactly), so that a
 * product reads it without a conversion. */
typedef struct {
    float d;
    int8_t q[32];
} qa8_0;
/* Q8_K activation block: ggml's block_q8_K (f32 d, 256 int8, 16 sums of 16). */
typedef struct {
    float d;
    int8_t q[256];
    int16_t bsums[16];
} qa8_K;

_Static_assert(sizeof(qa8_0) == 36, "qa8_0");
_Static_assert(sizeof(qa8_K) == 292, "qa8_K");

/* Round to nearest, ties to even, for |v| < 2^22 (ggml's nearest_int). */
static inline int nearest_int(float v)
{
    float f = v + 12582912.f;
    int32_t i;
    memcpy(&i, &f, 4);
    return (i & 0x007fffff) - 0x00400000;
}

/* ggml's AVX2 quantize_row_q8_0: d = amax / 127 (stored f16), q = round-half-even(x * 127/amax). */
static void qact_q8_0(const float *x, void *dst, uint64_t n)
{
    qa8_0 *y = dst;
    for (uint64_t b = 0; b < n / 32; b++, x += 32) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) {
            float a = fabsf(x[j]);
            amax = a > amax ? a : amax;
        }
        y[b].d = st_wtype_f16_to_f32(st_wtype_f32_to_f16(amax / 127.f));
        float id = amax != 0.0f ? 127.f / amax : 0.0f;
        for (int j = 0; j < 32; j++)
            y[b].q[j] = (int8_t)nearest_int(x[j] * id);
    }
}

/* ggml's quantize_row_q8_K: max = the value of largest magnitude (the first such), iscale =
 * -127 / max, q = min(127, round-half-even(iscale * x)), d = 1 / iscale, sums of 16. */
static void qact_q8_K(const float *x, void *dst, uint64_t n)
{
    qa8_K *y = dst;
    for (uint64_t b = 0; b < n / 256; b++, x += 256) {
        float max = 0.0f, amax = 0.0f;
        for (int j = 0; j < 256; j++) {
            float a = fabsf(x[j]);
            if (a > amax) {
                amax = a;
                max = x[j];
            }
        }
        if (amax == 0.0f) {
            memset(&y[b], 0, sizeof y[b]);
            continue;
        }
        float iscale = -127.f / max;
        for (int j = 0; j < 256; j++) {
            int v = nearest_int(iscale * x[j]);
            y[b].q[j] = (int8_t)(v < 127 ? v : 127);
        }
        for (int j = 0; j < 16; j++) {
            int s = 0;
            for (int i = 0; i < 16; i++)
                s += y[b].q[16 * j + i];
            y[b].bsums[j] = (int16_t)s;
        }
        y[b].d = 1.0f / iscale;
    }
}

/* ---- the fixed lane tree (st_kernels.c lanes_sum / hsum8) ---------------------------------- */
static inline float lanes_sum(const float a[8])
{
    float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    float c0 = b0 + b2, c1 = b1 + b3;
    return c0 + c1;
}

VEC_INLINE float hsum8(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 a = _mm_add_ps(lo, hi);
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
    __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(c);
}

/* ---- Q8_0 x Q8_0 ------------------------------------------------------------------------- */
static inline uint16_t rd16(const uint8_t *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

/* Weight block = ggml's block_q8_0 (f16 d, 32 int8; 34 B). Lane m of block b: sum of w[i] * x[i],
 * i = 4m..4m+3 (|lane| <= 4 * 128 * 127). D_b = f16(w.d) * x.d. */
static float dot1_q8_0(const uint8_t *w, const uint8_t *xq, uint32_t nb)
{
    const qa8_0 *xb = (const qa8_0 *)xq;
    float acc[8] = {0};
    for (uint32_t b = 0; b < nb; b++, w += 34) {
        const int8_t *q = (const int8_t *)(w + 2);
        float d = st_wtype_f16_to_f32(rd16(w)) * xb[b].d;
        for (int m = 0; m < 8; m++) {
            int s = 0;
            for (int i = 4 * m; i < 4 * m + 4; i++)
                s += q[i] * xb[b].q[i];
            acc[m] = fmaf(d, (float)s, acc[m]);
        }
    }
    return lanes_sum(acc);
}

/* ---- Q4_K x Q8_K ------------------------------------------------------------------------- */
/* Weight block (144 B): f16 d, f16 dmin, scales[12], qs[128] (ARCHITECTURES.md section 8).
 * Lane m: sum of sc(j) * q4[i] * x[i] over i with (i mod 32) / 4 == m, j = i / 32 (|lane| <=
 * 8 * 4 * 63 * 15 * 127 < 2^23); min lane j: mn(j) * (bsums[2j] + bsums[2j+1]).
 * D_b = x.d * f16(d), Dmin_b = x.d * f16(dmin); result = tree(acc) - tree(accm). */
static inline void q4k_scales(const uint8_t *s12, uint8_t sc[8], uint8_t mn[8])
{
    for (int s = 0; s < 4; s++) {
        sc[s] = s12[s] & 63;
        mn[s] = s12[s + 4] & 63;
    }
    for (int s = 4; s < 8; s++) {
        sc[s] = (uint8_t)((s12[s + 4] & 0xF) | ((s12[s - 4] >> 6) << 4));
        mn[s] = (uint8_t)((s12[s + 4] >> 4) | ((s12[s] >> 6) << 4));
    }
}

static float dot1_q4_K(const uint8_t *w, const uint8_t *xq, uint32_t nb)
{
    const qa8_K *xb = (const qa8_K *)xq;
    float acc[8] = {0}, accm[8] = {0};
    for (uint32_t b = 0; b < nb; b++, w += 144) {
        uint8_t sc[8], mn[8];
        q4k_scales(w + 4, sc, mn);
        const uint8_t *qs = w + 16;
        const int8_t *x = xb[b].q;
        int lane[8] = {0};
        for (int g = 0; g < 4; g++)
            for (int l = 0; l < 32; l++) {
                lane[l / 4] += sc[2 * g] * (qs[32 * g + l] & 0xF) * x[64 * g + l];
                lane[l / 4] += sc[2 * g + 1] * (qs[32 * g + l] >> 4) * x[64 * g + 32 + l];
            }
        float d = xb[b].d * st_wtype_f16_to_f32(rd16(w)),
              dm = xb[b].d * st_wtype_f16_to_f32(rd16(w + 2));
        for (int m = 0; m < 8; m++)
            acc[m] = fmaf(d, (float)lane[m], acc[m]);
        for (int j = 0; j < 8; j++)
            accm[j] = fmaf(dm, (float)(mn[j] * (xb[b].bsums[2 * j] + xb[b].bsums[2 * j + 1])),
                           accm[j]);
    }
    return lanes_sum(acc) - lanes_sum(accm);
}

/* ---- Q6_K x Q8_K ------------------------------------------------------------------------- */
/* Weight block (210 B): ql[128], qh[64], int8 sc[16], f16 d. Lane m: sum of sc(i) * (q6[i] - 32)
 * * x[i] over i with (i mod 32) / 4 == m, sc(i) = sc[i / 16] (|lane| <= 32 * 128 * 32 * 127 <
 * 2^24, exact in f32). D_b = x.d * f16(d). */
static float dot1_q6_K(const uint8_t *w, const uint8_t *xq, uint32_t nb)
{
    const qa8_K *xb = (const qa8_K *)xq;
    float acc[8] = {0};
    for (uint32_t b = 0; b < nb; b++, w += 210) {
        const int8_t *x = xb[b].q;
        const int8_t *sc = (const int8_t *)(w + 192);
        int lane[8] = {0};
        for (int h = 0; h < 2; h++) {
            const uint8_t *L = w + 64 * h, *H = w + 128 + 32 * h;
            const int8_t *S = sc + 8 * h, *X = x + 128 * h;
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                int q1 = ((L[l] & 0xF) | ((H[l] & 3) << 4)) - 32;
                int q2 = ((L[l + 32] & 0xF) | (((H[l] >> 2) & 3) << 4)) - 32;
                int q3 = ((L[l] >> 4) | (((H[l] >> 4) & 3) << 4)) - 32;
                int q4 = ((L[l + 32] >> 4) | (((H[l] >> 6) & 3) << 4)) - 32;
                lane[l / 4] += S[is] * q1 * X[l] + S[is + 2] * q2 * X[l + 32] +
                               S[is + 4] * q3 * X[l + 64] + S[is + 6] * q4 * X[l + 96];
            }
        }
        float d = xb[b].d * st_wtype_f16_to_f32(rd16(w + 208));
        for (int m = 0; m < 8; m++)
            acc[m] = fmaf(d, (float)lane[m], acc[m]);
    }
    return lanes_sum(acc);
}

/* ---- AVX2 ---------------------------------------------------------------------------------- */
/* Each kernel runs NT tokens (4 or 1) against one weight row at a time: the row's blocks are
 * decoded once per block and used for every token of the group. */
VEC_INLINE float f16s(uint16_t h)
{
    return _cvtsh_ss(h);
}

VEC_INLINE void q8_0_vec(const uint8_t *w, const uint8_t *xq, size_t xs, uint32_t nb, float *y,
                         uint32_t ldy, const int NT)
{
    __m256 acc[4];
    for (int t = 0; t < NT; t++)
        acc[t] = _mm256_setzero_ps();
    const __m256i ones = _mm256_set1_epi16(1);
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 34;
        __m256i wq = _mm256_loadu_si256((const __m256i *)(wb + 2));
        __m256i aw = _mm256_sign_epi8(wq, wq);
        __m256 dw = _mm256_set1_ps(f16s(rd16(wb)));
        for (int t = 0; t < NT; t++) {
            const qa8_0 *xb = (const qa8_0 *)(xq + (size_t)t * xs) + b;
            __m256i xv = _mm256_loadu_si256((const __m256i *)xb->q);
            __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, _mm256_sign_epi8(xv, wq)), ones);
            __m256 d = _mm256_mul_ps(dw, _mm256_broadcast_ss(&xb->d));
            acc[t] = _mm256_fmadd_ps(d, _mm256_cvtepi32_ps(p), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++)
        y[(size_t)t * ldy] = hsum8(acc[t]);
}

VEC_INLINE void q4_K_vec(const uint8_t *w, const uint8_t *xq, size_t xs, uint32_t nb, float *y,
                         uint32_t ldy, const int NT)
{
    __m256 acc[4], accm[4];
    for (int t = 0; t < NT; t++)
        acc[t] = accm[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF);
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 144;
        _Alignas(16) uint8_t sc[8], mn[16];
        q4k_scales(wb + 4, sc, mn);
        __m128i m8 = _mm_loadl_epi64((const __m128i *)mn);
        __m256i mdup = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m8, m8));
        __m256i lo[4], hi[4], s[8];
        for (int g = 0; g < 4; g++) {
            __m256i q = _mm256_loadu_si256((const __m256i *)(wb + 16 + 32 * g));
            lo[g] = _mm256_and_si256(q, m4);
            hi[g] = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            s[2 * g] = _mm256_set1_epi16(sc[2 * g]);
            s[2 * g + 1] = _mm256_set1_epi16(sc[2 * g + 1]);
        }
        __m256 dw = _mm256_set1_ps(f16s(rd16(wb))), dmw = _mm256_set1_ps(f16s(rd16(wb + 2)));
        for (int t = 0; t < NT; t++) {
            const qa8_K *xb = (const qa8_K *)(xq + (size_t)t * xs) + b;
            __m256i sum = _mm256_setzero_si256();
            for (int g = 0; g < 4; g++) {
                __m256i x0 = _mm256_loadu_si256((const __m256i *)(xb->q + 64 * g));
                __m256i x1 = _mm256_loadu_si256((const __m256i *)(xb->q + 64 * g + 32));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(lo[g], x0), s[2 * g]));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_maddubs_epi16(hi[g], x1), s[2 * g + 1]));
            }
            __m256i pm = _mm256_madd_epi16(mdup, _mm256_loadu_si256((const __m256i *)xb->bsums));
            __m256 xd = _mm256_broadcast_ss(&xb->d);
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(xd, dw), _mm256_cvtepi32_ps(sum), acc[t]);
            accm[t] = _mm256_fmadd_ps(_mm256_mul_ps(xd, dmw), _mm256_cvtepi32_ps(pm), accm[t]);
        }
    }
    for (int t = 0; t < NT; t++)
        y[(size_t)t * ldy] = hsum8(acc[t]) - hsum8(accm[t]);
}

VEC_INLINE void q6_K_vec(const uint8_t *w, const uint8_t *xq, size_t xs, uint32_t nb, float *y,
                         uint32_t ldy, const int NT)
{
    __m256 acc[4];
    for (int t = 0; t < NT; t++)
        acc[t] = _mm256_setzero_ps();
    const __m256i m4 = _mm256_set1_epi8(0xF), m3 = _mm256_set1_epi8(0x03),
                  mc = _mm256_set1_epi8(0x0C), m30 = _mm256_set1_epi8(0x30),
                  mc0 = _mm256_set1_epi8((char)0xC0), k32 = _mm256_set1_epi8(32);
    for (uint32_t b = 0; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 210;
        __m128i sc = _mm_loadu_si128((const __m128i *)(wb + 192));
        __m256i q[8], s[8];
        for (int h = 0; h < 2; h++) {
            __m256i L0 = _mm256_loadu_si256((const __m256i *)(wb + 64 * h));
            __m256i L1 = _mm256_loadu_si256((const __m256i *)(wb + 64 * h + 32));
            __m256i H = _mm256_loadu_si256((const __m256i *)(wb + 128 + 32 * h));
            q[4 * h + 0] = _mm256_or_si256(_mm256_and_si256(L0, m4),
                                           _mm256_slli_epi16(_mm256_and_si256(H, m3), 4));
            q[4 * h + 1] = _mm256_or_si256(_mm256_and_si256(L1, m4),
                                           _mm256_slli_epi16(_mm256_and_si256(H, mc), 2));
            q[4 * h + 2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4),
                                           _mm256_and_si256(H, m30));
            q[4 * h + 3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4),
                                           _mm256_srli_epi16(_mm256_and_si256(H, mc0), 2));
            for (int k = 0; k < 4; k++) {
                int a = 8 * h + 2 * k;
                __m128i sh = _mm_set_epi8((char)(a + 1), (char)(a + 1), (char)(a + 1), (char)(a + 1),
                                          (char)(a + 1), (char)(a + 1), (char)(a + 1), (char)(a + 1),
                                          (char)a, (char)a, (char)a, (char)a, (char)a, (char)a,
                                          (char)a, (char)a);
                s[4 * h + k] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sc, sh));
            }
        }
        __m256 dw = _mm256_set1_ps(f16s(rd16(wb + 208)));
        for (int t = 0; t < NT; t++) {
            const qa8_K *xb = (const qa8_K *)(xq + (size_t)t * xs) + b;
            __m256i sum = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xb->q + 32 * c));
                __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[c], xv),
                                             _mm256_maddubs_epi16(k32, xv));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(p, s[c]));
            }
            acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(&xb->d), dw),
                                     _mm256_cvtepi32_ps(sum), acc[t]);
        }
    }
    for (int t = 0; t < NT; t++)
        y[(size_t)t * ldy] = hsum8(acc[t]);
}

#define QDOT_ENTRIES(NAME)                                                          \
    VEC static void NAME##_vec4(const uint8_t *w, const uint8_t *xq, size_t xs, uint32_t nb,      \
                                float *y, uint32_t ldy)                                          \
    {                                                                                            \
        NAME##_vec(w, xq, xs, nb, y, ldy, 4);                                                    \
    }                                                                                            \
    VEC static void NAME##_vec1(const uint8_t *w, const uint8_t *xq, size_t xs, uint32_t nb,      \
                                float *y, uint32_t ldy)                                          \
    {                                                                                            \
        NAME##_vec(w, xq, xs, nb, y, ldy, 1);                                                    \
    }                                                                                            \
    static void NAME##_mm_scalar(const void *w, size_t ws, const void *xq, size_t xs, uint32_t nb, \
                                 float *y, uint32_t ldy, uint32_t nr, uint32_t nt)               \
    {                                                                                            \
        for (uint32_t t = 0; t < nt; t++)                                                        \
            for (uint32_t r = 0; r < nr; r++)                                                    \
                y[(size_t)t * ldy + r] = dot1_##NAME((const uint8_t *)w + (size_t)r * ws,         \
                                                     (const uint8_t *)xq + (size_t)t * xs, nb);  \
    }                                                                                            \
    VEC static void NAME##_mm_vec(const void *w, size_t ws, const void *xq, size_t xs, uint32_t nb, \
                                  float *y, uint32_t ldy, uint32_t nr, uint32_t nt)              \
    {                                                                                            \
        const uint8_t *x = xq;                                                                   \
        uint32_t t = 0;                                                                          \
        for (; t + 4 <= nt; t += 4)                                                              \
            for (uint32_t r = 0; r < nr; r++)                                                    \
                NAME##_vec4((const uint8_t *)w + (size_t)r * ws, x + (size_t)t * xs, xs, nb,     \
                            y + (size_t)t * ldy + r, ldy);                                       \
        for (; t < nt; t++)                                                                      \
            for (uint32_t r = 0; r < nr; r++)                                                    \
                NAME##_vec1((const uint8_t *)w + (size_t)r * ws, x + (size_t)t * xs, xs, nb,     \
                            y + (size_t)t * ldy + r, ldy);                                       \
    }

QDOT_ENTRIES(q8_0)
QDOT_ENTRIES(q4_K)
QDOT_ENTRIES(q6_K)

/* ---- AVX-512 VNNI ----------------------------------------------------------------------------
 * A zmm holds the same block of two weight rows (rows 2p and 2p + 1 of a tile, one per 256-bit
 * half) against one token's block broadcast to both halves, so each half is exactly the 8 lanes
 * of invariant 2 for its (row, token) and no definition changes. A tile is 2 RP rows x NT
 * tokens, its accumulators in registers: each weight block is decoded once for NT tokens and
 * each activation block loaded once for 2 RP rows. */
#define V512 __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))
#define V512_INLINE                                                                              \
    static inline __attribute__((always_inline,                                                  \
                                 target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")))

/* the tile loops fully unrolled, so that the accumulators stay in registers */
#define UNROLL _Pragma("GCC unroll 8")

/* f32 rows of a tile: the two halves of v to y[0] and y[1] through the lane tree */
V512_INLINE void store_pair(__m512 v, float *y0, float *y1)
{
    *y0 = hsum8(_mm512_castps512_ps256(v));
    *y1 = hsum8(_mm512_extractf32x8_ps(v, 1));
}

V512_INLINE __m512 pair_ps(float a, float b)
{
    return _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(a)), _mm256_set1_ps(b), 1);
}

V512_INLINE __m512i pair_256(const void *a, const void *b)
{
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)a)),
                              _mm256_loadu_si256((const __m256i *)b), 1);
}

/* Q8_0: vpdpbusd multiplies unsigned by signed bytes, so the weights are offset by 128
 * (w ^ 0x80 = w + 128 in 0..255) and 128 * (the lane's sum of x) is subtracted, both exactly in
 * the lane's int32: sum (w + 128) x - 128 sum x = sum w x (|.| < 2^17). */
V512_INLINE void q8_0_v512(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,
                           uint32_t nb, float *y, uint32_t ldy, const int RP, const int NT)
{
    __m512 acc[4][4];
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++)
            acc[p][t] = _mm512_setzero_ps();
    const __m512i k80 = _mm512_set1_epi8((char)0x80), zero = _mm512_setzero_si512();
    for (uint32_t b = 0; b < nb; b++) {
        __m512i wu[4];
        __m512 dw[4];
        UNROLL
        for (int p = 0; p < RP; p++) {
            const uint8_t *w0 = w + (size_t)(2 * p) * ws + (size_t)b * 34, *w1 = w0 + ws;
            wu[p] = _mm512_xor_si512(pair_256(w0 + 2, w1 + 2), k80);
            dw[p] = pair_ps(f16s(rd16(w0)), f16s(rd16(w1)));
        }
        UNROLL
        for (int t = 0; t < NT; t++) {
            const qa8_0 *xb = (const qa8_0 *)(xq + (size_t)t * xs) + b;
            __m512i xv = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xb->q));
            __m512i nbias = _mm512_sub_epi32(zero, _mm512_dpbusd_epi32(zero, k80, xv));
            __m512 dx = _mm512_set1_ps(xb->d);
            UNROLL
            for (int p = 0; p < RP; p++) {
                __m512i s = _mm512_dpbusd_epi32(nbias, wu[p], xv);
                acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(dw[p], dx), _mm512_cvtepi32_ps(s),
                                            acc[p][t]);
            }
        }
    }
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++)
            store_pair(acc[p][t], y + (size_t)t * ldy + 2 * p, y + (size_t)t * ldy + 2 * p + 1);
}

/* q4k_scales on 32-bit words: the bytes of out[0..1] are sc[0..7], of out[2..3] mn[0..7] */
static inline void q4k_scales32(const uint8_t *s12, uint32_t out[4])
{
    uint32_t u[3];
    memcpy(u, s12, 12);
    const uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
    out[0] = u[0] & k6;
    out[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
    out[2] = u[1] & k6;
    out[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
}

/* Q4_K: the nibbles are unsigned, so vpmaddubsw (u8 x s8, |.| <= 2 * 15 * 127: never saturates)
 * gives pairs, and vpdpwssd multiplies them by the sub-block scale (both rows' scales, one per
 * half) and adds them into the lane: the same integers as the AVX2 form's maddubs + madd. */
V512_INLINE void q4_K_v512(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,
                           uint32_t nb, float *y, uint32_t ldy, const int RP, const int NT)
{
    __m512 acc[2][4], accm[2][4];
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++)
            acc[p][t] = accm[p][t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0xF);
    /* vpermw indices: scale j of row 0 in the low half, of row 1 (word 8 + j) in the high */
    const __m512i hi8 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(8), 1);
    for (uint32_t b = 0; b < nb; b++) {
        __m512i q[2][8], s[2][8], mdup[2];
        __m512 dw[2], dmw[2];
        UNROLL
        for (int p = 0; p < RP; p++) {
            const uint8_t *w0 = w + (size_t)(2 * p) * ws + (size_t)b * 144, *w1 = w0 + ws;
            uint32_t u0[4], u1[4];
            q4k_scales32(w0 + 4, u0);
            q4k_scales32(w1 + 4, u1);
            __m512i scv = _mm512_cvtepu8_epi16(
                _mm256_zextsi128_si256(
                    _mm_set_epi32((int)u1[1], (int)u1[0], (int)u0[1], (int)u0[0])));
            UNROLL
            for (int j = 0; j < 8; j++)
                s[p][j] = _mm512_permutexvar_epi16(
                    _mm512_add_epi16(hi8, _mm512_set1_epi16((short)j)), scv);
            __m128i m0 = _mm_set_epi32(0, 0, (int)u0[3], (int)u0[2]),
                    m1 = _mm_set_epi32(0, 0, (int)u1[3], (int)u1[2]);
            mdup[p] = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m0, m0))),
                _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(m1, m1)), 1);
            UNROLL
            for (int g = 0; g < 4; g++) {
                __m512i v = pair_256(w0 + 16 + 32 * g, w1 + 16 + 32 * g);
                q[p][2 * g] = _mm512_and_si512(v, m4);
                q[p][2 * g + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            }
            dw[p] = pair_ps(f16s(rd16(w0)), f16s(rd16(w1)));
            dmw[p] = pair_ps(f16s(rd16(w0 + 2)), f16s(rd16(w1 + 2)));
        }
        UNROLL
        for (int t = 0; t < NT; t++) {
            const qa8_K *xb = (const qa8_K *)(xq + (size_t)t * xs) + b;
            __m512i sum[2];
            UNROLL
            for (int p = 0; p < RP; p++)
                sum[p] = _mm512_setzero_si512();
            UNROLL
            for (int c = 0; c < 8; c++) {
                __m512i xv = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(xb->q + 32 * c)));
                UNROLL
                for (int p = 0; p < RP; p++)
                    sum[p] = _mm512_dpwssd_epi32(sum[p], _mm512_maddubs_epi16(q[p][c], xv),
                                                 s[p][c]);
            }
            __m512i bs = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)xb->bsums));
            __m512 xd = _mm512_set1_ps(xb->d);
            UNROLL
            for (int p = 0; p < RP; p++) {
                acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(xd, dw[p]), _mm512_cvtepi32_ps(sum[p]),
                                            acc[p][t]);
                accm[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(xd, dmw[p]),
                                             _mm512_cvtepi32_ps(_mm512_madd_epi16(mdup[p], bs)),
                                             accm[p][t]);
            }
        }
    }
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++) {
            float *yt = y + (size_t)t * ldy + 2 * p;
            yt[0] = hsum8(_mm512_castps512_ps256(acc[p][t])) -
                    hsum8(_mm512_castps512_ps256(accm[p][t]));
            yt[1] = hsum8(_mm512_extractf32x8_ps(acc[p][t], 1)) -
                    hsum8(_mm512_extractf32x8_ps(accm[p][t], 1));
        }
}

/* Q6_K: the 6-bit values unsigned (0..63) through vpmaddubsw, less 32 x the activation pairs
 * (one vpmaddubsw per token and chunk, shared by the rows), as the AVX2 form does; then the
 * sub-block scales (16 values each: two per 32-value chunk) by vpdpwssd. */
V512_INLINE void q6_K_v512(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,
                           uint32_t nb, float *y, uint32_t ldy, const int RP, const int NT)
{
    __m512 acc[2][4];
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++)
            acc[p][t] = _mm512_setzero_ps();
    const __m512i m4 = _mm512_set1_epi8(0xF), m3 = _mm512_set1_epi8(0x03),
                  mc = _mm512_set1_epi8(0x0C), m30 = _mm512_set1_epi8(0x30),
                  mc0 = _mm512_set1_epi8((char)0xC0), k32 = _mm512_set1_epi8(32);
    /* vpermw indices of chunk a / 2: words a, a + 1 of row 0, then 16 + a, 17 + a of row 1 */
    const __m512i base = _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set_m128i(_mm_set1_epi16(1), _mm_setzero_si128())),
        _mm256_set_m128i(_mm_set1_epi16(17), _mm_set1_epi16(16)), 1);
    for (uint32_t b = 0; b < nb; b++) {
        __m512i q[2][8], s[2][8];
        __m512 dw[2];
        UNROLL
        for (int p = 0; p < RP; p++) {
            const uint8_t *w0 = w + (size_t)(2 * p) * ws + (size_t)b * 210, *w1 = w0 + ws;
            __m512i scv = _mm512_cvtepi8_epi16(
                _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(w1 + 192)),
                                 _mm_loadu_si128((const __m128i *)(w0 + 192))));
            UNROLL
            for (int h = 0; h < 2; h++) {
                __m512i L0 = pair_256(w0 + 64 * h, w1 + 64 * h);
                __m512i L1 = pair_256(w0 + 64 * h + 32, w1 + 64 * h + 32);
                __m512i H = pair_256(w0 + 128 + 32 * h, w1 + 128 + 32 * h);
                q[p][4 * h + 0] = _mm512_or_si512(_mm512_and_si512(L0, m4),
                                                  _mm512_slli_epi16(_mm512_and_si512(H, m3), 4));
                q[p][4 * h + 1] = _mm512_or_si512(_mm512_and_si512(L1, m4),
                                                  _mm512_slli_epi16(_mm512_and_si512(H, mc), 2));
                q[p][4 * h + 2] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L0, 4), m4),
                                                  _mm512_and_si512(H, m30));
                q[p][4 * h + 3] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L1, 4), m4),
                                                  _mm512_srli_epi16(_mm512_and_si512(H, mc0), 2));
                UNROLL
                for (int k = 0; k < 4; k++)
                    s[p][4 * h + k] = _mm512_permutexvar_epi16(
                        _mm512_add_epi16(base, _mm512_set1_epi16((short)(8 * h + 2 * k))), scv);
            }
            dw[p] = pair_ps(f16s(rd16(w0 + 208)), f16s(rd16(w1 + 208)));
        }
        UNROLL
        for (int t = 0; t < NT; t++) {
            const qa8_K *xb = (const qa8_K *)(xq + (size_t)t * xs) + b;
            __m512i sum[2];
            UNROLL
            for (int p = 0; p < RP; p++)
                sum[p] = _mm512_setzero_si512();
            UNROLL
            for (int c = 0; c < 8; c++) {
                __m512i xv = _mm512_broadcast_i64x4(
                    _mm256_loadu_si256((const __m256i *)(xb->q + 32 * c)));
                __m512i cx = _mm512_maddubs_epi16(k32, xv);
                UNROLL
                for (int p = 0; p < RP; p++)
                    sum[p] = _mm512_dpwssd_epi32(
                        sum[p], _mm512_sub_epi16(_mm512_maddubs_epi16(q[p][c], xv), cx), s[p][c]);
            }
            __m512 xd = _mm512_set1_ps(xb->d);
            UNROLL
            for (int p = 0; p < RP; p++)
                acc[p][t] = _mm512_fmadd_ps(_mm512_mul_ps(xd, dw[p]), _mm512_cvtepi32_ps(sum[p]),
                                            acc[p][t]);
        }
    }
    UNROLL
    for (int p = 0; p < RP; p++)
        UNROLL
        for (int t = 0; t < NT; t++)
            store_pair(acc[p][t], y + (size_t)t * ldy + 2 * p, y + (size_t)t * ldy + 2 * p + 1);
}

/* The tiles of an nr x nt product: RPxNT kernels for whole tiles, smaller ones at the edges
 * (an odd last row goes through the AVX2 form, which gives the same bits). */
#define V512_ENTRIES(NAME, RPB)                                                                    \
    V512 static void NAME##_t44(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,         \
                                uint32_t nb, float *y, uint32_t ldy)                               \
    {                                                                                              \
        NAME##_v512(w, ws, xq, xs, nb, y, ldy, RPB, 4);                                            \
    }                                                                                              \
    V512 static void NAME##_t14(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,         \
                                uint32_t nb, float *y, uint32_t ldy)                               \
    {                                                                                              \
        NAME##_v512(w, ws, xq, xs, nb, y, ldy, 1, 4);                                              \
    }                                                                                              \
    V512 static void NAME##_t41(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,         \
                                uint32_t nb, float *y, uint32_t ldy)                               \
    {                                                                                              \
        NAME##_v512(w, ws, xq, xs, nb, y, ldy, RPB, 1);                                            \
    }                                                                                              \
    V512 static void NAME##_t11(const uint8_t *w, size_t ws, const uint8_t *xq, size_t xs,         \
                                uint32_t nb, float *y, uint32_t ldy)                               \
    {                                                                                              \
        NAME##_v512(w, ws, xq, xs, nb, y, ldy, 1, 1);                                              \
    }                                                                                              \
    V512 static void NAME##_mm_v512(const void *wv, size_t ws, const void *xv, size_t xs,          \
                                    uint32_t nb, float *y, uint32_t ldy, uint32_t nr, uint32_t nt) \
    {                                                                                              \
        const uint8_t *w = wv, *x = xv;                                                            \
        uint32_t t = 0;                                                                            \
        for (; t + 4 <= nt; t += 4) {                                                              \
            uint32_t r = 0;                                                                        \
            for (; r + 2 * RPB <= nr; r += 2 * RPB)                                                \
                NAME##_t44(w + (size_t)r * ws, ws, x + (size_t)t * xs, xs, nb,                     \
                           y + (size_t)t * ldy + r, ldy);                                          \
            for (; r + 2 <= nr; r += 2)                                                            \
                NAME##_t14(w + (size_t)r * ws, ws, x + (size_t)t * xs, xs, nb,                     \
                           y + (size_t)t * ldy + r, ldy);                                          \
            if (r < nr)                                                                            \
                NAME##_vec4(w + (size_t)r * ws, x + (size_t)t * xs, xs, nb,                        \
                            y + (size_t)t * ldy + r, ldy);                                         \
        }                                                                                          \
        for (; t < nt; t++) {                                                                      \
            uint32_t r = 0;                                                                        \
            for (; r + 2 * RPB <= nr; r += 2 * RPB)                                                \
                NAME##_t41(w + (size_t)r * ws, ws, x + (size_t)t * xs, xs, nb,                     \
                           y + (size_t)t * ldy + r, ldy);                                          \
            for (; r + 2 <= nr; r += 2)                                                            \
                NAME##_t11(w + (size_t)r * ws, ws, x + (size_t)t * xs, xs, nb,                     \
                           y + (size_t)t * ldy + r, ldy);                                          \
            if (r < nr)                                                                            \
                NAME##_vec1(w + (size_t)r * ws, x + (size_t)t * xs, xs, nb,                        \
                            y + (size_t)t * ldy + r, ldy);                                         \
        }                                                                                          \
    }

V512_ENTRIES(q8_0, 4)
V512_ENTRIES(q4_K, 1)
V512_ENTRIES(q6_K, 1)

/* The negative control of the llama.cpp comparison (tests/ref/test_quant_ref.mjs): every block
 * scale of n quantized activation values multiplied by 127/128, as if d were max/128. */
void st_qdot_wrong_scale(const st_qdot *qd, void *xq, uint64_t n)
{
    for (uint64_t b = 0; b < n / qd->block; b++) {
        if (qd->act == ST_QACT_Q8_0) {
            qa8_0 *y = (qa8_0 *)xq + b;
            y->d = st_wtype_f16_to_f32(st_wtype_f32_to_f16(y->d * (127.f / 128.f)));
        } else {
            qa8_K *y = (qa8_K *)xq + b;
            y->d *= 127.f / 128.f;
        }
    }
}

/* ---- the table ------------------------------------------------------------------------------ */
static const st_qdot k_q8_0 = {ST_QACT_Q8_0, 32, 36, qact_q8_0,
                               {q8_0_mm_scalar, q8_0_mm_vec, q8_0_mm_v512}};
static const st_qdot k_q4_K = {ST_QACT_Q8_K, 256, 292, qact_q8_K,
                               {q4_K_mm_scalar, q4_K_mm_vec, q4_K_mm_v512}};
static const st_qdot k_q6_K = {ST_QACT_Q8_K, 256, 292, qact_q8_K,
                               {q6_K_mm_scalar, q6_K_mm_vec, q6_K_mm_v512}};

const st_qdot *st_qdot_get(uint32_t wtype)
{
    switch (wtype) {
    case ST_GGML_Q8_0: return &k_q8_0;
    case ST_GGML_Q4_K: return &k_q4_K;
    case ST_GGML_Q6_K: return &k_q6_K;
    default: return NULL;
    }
}
