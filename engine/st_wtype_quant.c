/*
 * st_wtype_quant.c - the quantizers of the weight-type table: f32 rows into blocks, as
 * llama.cpp v0.4.0's ggml_quantize_chunk does them without an importance matrix (what
 * llama-quantize writes without --imatrix and what ggml's reference quantizers compute), so the
 * blocks are the same byte for byte. Written from the algorithms of ggml-quants.c.
 *
 * Invariants:
 * 1. Every float expression keeps ggml's operations, operand order and intermediate roundings
 *    (f32, one rounding per operation; this file is compiled with -ffp-contract=off, and ggml's
 *    reference build has no FMA either), and every integer conversion keeps ggml's truncations
 *    (a value stored into a uint8_t or int8_t before it is clamped stays so here).
 * 2. nearest_int is ggml's: round half to even by adding 1.5 * 2^23 (valid for |x| < 2^22, as
 *    in ggml; larger inputs give ggml's same garbage, deterministically).
 * 3. Scales are stored through st_wtype_f32_to_f16 (ggml's rounding) and the later steps use
 *    the stored f16 value widened, exactly as ggml does.
 * 4. Each block depends only on its own values: a row quantized in pieces of whole blocks gives
 *    the same bytes.
 */
#include <float.h>
#include <math.h>
#include <string.h>

#include "st_wtype.h"

#define QK_K 256
#define GROUP_MAX_EPS 1e-15f
#define MAXI(a, b) ((a) > (b) ? (a) : (b))
#define MINI(a, b) ((a) < (b) ? (a) : (b))

static inline void put_f16(uint8_t *p, float v)
{
    uint16_t h = st_wtype_f32_to_f16(v);
    p[0] = (uint8_t)h;
    p[1] = (uint8_t)(h >> 8);
}

static inline float get_f16(const uint8_t *p)
{
    return st_wtype_f16_to_f32((uint16_t)(p[0] | (uint16_t)p[1] << 8));
}

/* A float to int8 as ggml's x86 build converts it (a 32-bit truncating conversion, cvttss2si,
 * then the low byte): out-of-range values and NaN give INT32_MIN's low byte, 0. C leaves such a
 * cast undefined and clang and gcc differ, so it is written out. */
static inline int8_t f2i8(float v)
{
    int32_t i = (v >= -2147483648.0f && v < 2147483648.0f) ? (int32_t)v : INT32_MIN;
    return (int8_t)(uint8_t)((uint32_t)i & 0xffu);
}

static inline int nearest_int(float fval)
{
    float val = fval + 12582912.f;
    int i;
    memcpy(&i, &val, sizeof i);
    return (i & 0x007fffff) - 0x00400000;
}

/* ---- float types --------------------------------------------------------------------------------- */
void st_wtype_quantize_f32(const float *src, void *dst, uint64_t n)
{
    memcpy(dst, src, n * sizeof(float));
}

void st_wtype_quantize_f16(const float *src, void *dst, uint64_t n)
{
    uint8_t *p = dst;
    for (uint64_t k = 0; k < n; k++)
        put_f16(p + 2 * k, src[k]);
}

void st_wtype_quantize_bf16(const float *src, void *dst, uint64_t n)
{
    uint8_t *p = dst;
    for (uint64_t k = 0; k < n; k++) {
        uint16_t h = st_wtype_f32_to_bf16(src[k]);
        p[2 * k] = (uint8_t)h;
        p[2 * k + 1] = (uint8_t)(h >> 8);
    }
}

/* ---- 32-value types ---------------------------------------------------------------------------------- */
/* The value of largest magnitude (the first of equal ones), with its sign. */
static inline float signed_absmax(const float *x, int n)
{
    float amax = 0.0f, max = 0.0f;
    for (int j = 0; j < n; j++)
        if (amax < fabsf(x[j])) {
            amax = fabsf(x[j]);
            max = x[j];
        }
    return max;
}

void st_wtype_quantize_q4_0(const float *src, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, src += 32, y += 18) {
        const float d = signed_absmax(src, 32) / -8;
        const float id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        for (int j = 0; j < 16; j++) {
            const float x0 = src[j] * id, x1 = src[16 + j] * id;
            const uint8_t q0 = (uint8_t)MINI(15, f2i8(x0 + 8.5f));
            const uint8_t q1 = (uint8_t)MINI(15, f2i8(x1 + 8.5f));
            y[2 + j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

static inline void minmax(const float *x, int n, float *mn, float *mx)
{
    float lo = FLT_MAX, hi = -FLT_MAX;
    for (int j = 0; j < n; j++) {
        if (x[j] < lo)
            lo = x[j];
        if (x[j] > hi)
            hi = x[j];
    }
    *mn = lo;
    *mx = hi;
}

void st_wtype_quantize_q4_1(const float *src, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, src += 32, y += 20) {
        float min, max;
        minmax(src, 32, &min, &max);
        const float d = (max - min) / 15;
        const float id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        put_f16(y + 2, min);
        for (int j = 0; j < 16; j++) {
            const float x0 = (src[j] - min) * id, x1 = (src[16 + j] - min) * id;
            const uint8_t q0 = (uint8_t)MINI(15, f2i8(x0 + 0.5f));
            const uint8_t q1 = (uint8_t)MINI(15, f2i8(x1 + 0.5f));
            y[4 + j] = (uint8_t)(q0 | q1 << 4);
        }
    }
}

void st_wtype_quantize_q5_0(const float *src, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, src += 32, y += 22) {
        const float d = signed_absmax(src, 32) / -16;
        const float id = d ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        put_f16(y, d);
        for (int j = 0; j < 16; j++) {
            const float x0 = src[j] * id, x1 = src[16 + j] * id;
            const uint8_t q0 = (uint8_t)MINI(31, f2i8(x0 + 16.5f));
            const uint8_t q1 = (uint8_t)MINI(31, f2i8(x1 + 16.5f));
            y[6 + j] = (uint8_t)((q0 & 0xf) | (q1 & 0xf) << 4);
            qh |= (uint32_t)((q0 & 0x10u) >> 4) << j;
            qh |= (uint32_t)((q1 & 0x10u) >> 4) << (j + 16);
        }
        st_put32(y + 2, qh);
    }
}

void st_wtype_quantize_q5_1(const float *src, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, src += 32, y += 24) {
        float min, max;
        minmax(src, 32, &min, &max);
        const float d = (max - min) / 31;
        const float id = d ? 1.0f / d : 0.0f;
        uint32_t qh = 0;
        put_f16(y, d);
        put_f16(y + 2, min);
        for (int j = 0; j < 16; j++) {
            const float x0 = (src[j] - min) * id, x1 = (src[16 + j] - min) * id;
            const uint8_t q0 = (uint8_t)(x0 + 0.5f);
            const uint8_t q1 = (uint8_t)(x1 + 0.5f);
            y[8 + j] = (uint8_t)((q0 & 0xf) | (q1 & 0xf) << 4);
            qh |= (uint32_t)((q0 & 0x10u) >> 4) << j;
            qh |= (uint32_t)((q1 & 0x10u) >> 4) << (j + 16);
        }
        st_put32(y + 4, qh);
    }
}

void st_wtype_quantize_q8_0(const float *src, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, src += 32, y += 34) {
        float amax = 0.0f;
        for (int j = 0; j < 32; j++)
            amax = amax > fabsf(src[j]) ? amax : fabsf(src[j]);
        const float d = amax / 127;
        const float id = d ? 1.0f / d : 0.0f;
        put_f16(y, d);
        for (int j = 0; j < 32; j++)
            y[2 + j] = (uint8_t)f2i8(roundf(src[j] * id));
    }
}

/* ---- K-quant helpers (ggml's make_qx_quants, make_q3_quants, make_qkx2_quants) ---------------------- */
/* Signed levels L in [0, 2 nmax) of x with the scale that minimises the weighted error over 19
 * trial scales; weights x^2 (rmse_type 1: the only one the reference quantizers use). */
static float make_qx_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i)
            L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAXI(-nmax, MINI(nmax - 1, l));
        L[i] = (int8_t)(l + nmax);
        float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    float scale = suml2 ? sumlx / suml2 : 0.0f;
    float best = scale * sumlx;
    for (int is = -9; is <= 9; ++is) {
        if (is == 0)
            continue;
        iscale = -((float)nmax + 0.1f * (float)is) / max;
        sumlx = suml2 = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * x[i]);
            l = MAXI(-nmax, MINI(nmax - 1, l));
            float w = x[i] * x[i];
            sumlx += w * x[i] * (float)l;
            suml2 += w * (float)l * (float)l;
        }
        if (suml2 > 0 && sumlx * sumlx > best * suml2) {
            for (int i = 0; i < n; ++i) {
                int l = nearest_int(iscale * x[i]);
                L[i] = (int8_t)(nmax + MAXI(-nmax, MINI(nmax - 1, l)));
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    return scale;
}

/* Q3_K's levels: greedy per-element improvement of the x^2-weighted error (do_rmse). */
static float make_q3_quants(int n, int nmax, const float *x, int8_t *L)
{
    float max = 0, amax = 0;
    for (int i = 0; i < n; ++i) {
        float ax = fabsf(x[i]);
        if (ax > amax) {
            amax = ax;
            max = x[i];
        }
    }
    if (amax < GROUP_MAX_EPS) {
        for (int i = 0; i < n; ++i)
            L[i] = 0;
        return 0.f;
    }
    float iscale = -nmax / max;
    float sumlx = 0, suml2 = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * x[i]);
        l = MAXI(-nmax, MINI(nmax - 1, l));
        L[i] = (int8_t)l;
        float w = x[i] * x[i];
        sumlx += w * x[i] * (float)l;
        suml2 += w * (float)l * (float)l;
    }
    for (int itry = 0; itry < 5; ++itry) {
        int n_changed = 0;
        for (int i = 0; i < n; ++i) {
            float w = x[i] * x[i];
            float slx = sumlx - w * x[i] * (float)L[i];
            if (slx > 0) {
                float sl2 = suml2 - w * (float)L[i] * (float)L[i];
                int new_l = nearest_int(x[i] * sl2 / slx);
                new_l = MAXI(-nmax, MINI(nmax - 1, new_l));
                if (new_l != L[i]) {
                    slx += w * x[i] * (float)new_l;
                    sl2 += w * (float)new_l * (float)new_l;
                    if (sl2 > 0 && slx * slx * suml2 > sumlx * sumlx * sl2) {
                        L[i] = (int8_t)new_l;
                        sumlx = slx;
                        suml2 = sl2;
                        ++n_changed;
                    }
                }
            }
        }
        if (!n_changed)
            break;
    }
    for (int i = 0; i < n; ++i)
        L[i] = (int8_t)(L[i] + nmax);
    return suml2 > 0.0f ? sumlx / suml2 : 0.0f;
}

/* Levels L in [0, nmax] with a scale and a minimum (returned negated in *the_min), the weighted
 * error minimised over nstep + 1 trial scales by least squares. */
static float make_qkx2_quants(int n, int nmax, const float *x, const float *weights, uint8_t *L,
                              float *the_min, uint8_t *Laux, float rmin, float rdelta, int nstep,
                              int use_mad)
{
    float min = x[0], max = x[0];
    float sum_w = weights[0];
    float sum_x = sum_w * x[0];
    for (int i = 1; i < n; ++i) {
        if (x[i] < min)
            min = x[i];
        if (x[i] > max)
            max = x[i];
        float w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if (min > 0)
        min = 0;
    if (max == min) {
        for (int i = 0; i < n; ++i)
            L[i] = 0;
        *the_min = -min;
        return 0.f;
    }
    float iscale = (float)nmax / (max - min);
    float scale = 1 / iscale;
    float best_error = 0;
    for (int i = 0; i < n; ++i) {
        int l = nearest_int(iscale * (x[i] - min));
        L[i] = (uint8_t)MAXI(0, MINI(nmax, l));
        float diff = scale * (float)L[i] + min - x[i];
        diff = use_mad ? fabsf(diff) : diff * diff;
        best_error += weights[i] * diff;
    }
    for (int is = 0; is <= nstep; ++is) {
        iscale = (rmin + rdelta * (float)is + (float)nmax) / (max - min);
        float sum_l = 0, sum_l2 = 0, sum_xl = 0;
        for (int i = 0; i < n; ++i) {
            int l = nearest_int(iscale * (x[i] - min));
            l = MAXI(0, MINI(nmax, l));
            Laux[i] = (uint8_t)l;
            float w = weights[i];
            sum_l += w * (float)l;
            sum_l2 += w * (float)l * (float)l;
            sum_xl += w * (float)l * x[i];
        }
        float D = sum_w * sum_l2 - sum_l * sum_l;
        if (D > 0) {
            float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
            float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
            if (this_min > 0) {
                this_min = 0;
                this_scale = sum_xl / sum_l2;
            }
            float cur_error = 0;
            for (int i = 0; i < n; ++i) {
                float diff = this_scale * (float)Laux[i] + this_min - x[i];
                diff = use_mad ? fabsf(diff) : diff * diff;
                cur_error += weights[i] * diff;
            }
            if (cur_error < best_error) {
                for (int i = 0; i < n; ++i)
                    L[i] = Laux[i];
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    *the_min = -min;
    return scale;
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

/* Two-bit-per-value packing of Q2_K and Q3_K: byte l of each 32-byte half holds the levels of
 * elements l, l + 32, l + 64 and l + 96 of its 128 values. */
static void pack_2bit(const uint8_t *L, uint8_t *qs)
{
    for (int j = 0; j < QK_K; j += 128)
        for (int l = 0; l < 32; ++l)
            qs[j / 4 + l] = (uint8_t)(L[j + l] | (L[j + l + 32] << 2) | (L[j + l + 64] << 4) |
                                      (L[j + l + 96] << 6));
}

/* ---- K-quants -------------------------------------------------------------------------------------- */
void st_wtype_quantize_q2_K(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    uint8_t L[QK_K], Laux[16];
    float weights[16], mins[QK_K / 16], scales[QK_K / 16];
    const float q4scale = 15.f;
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 84) {
        uint8_t *sc = y, *qs = y + 16;
        float max_scale = 0, max_min = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
            for (int l = 0; l < 16; ++l)
                weights[l] = fabsf(x[16 * j + l]);
            scales[j] = make_qkx2_quants(16, 3, x + 16 * j, weights, L + 16 * j, &mins[j], Laux,
                                         -0.5f, 0.1f, 15, 1);
            if (scales[j] > max_scale)
                max_scale = scales[j];
            if (mins[j] > max_min)
                max_min = mins[j];
        }
        if (max_scale > 0) {
            float iscale = q4scale / max_scale;
            for (int j = 0; j < QK_K / 16; ++j)
                sc[j] = (uint8_t)nearest_int(iscale * scales[j]);
            put_f16(y + 80, max_scale / q4scale);
        } else {
            for (int j = 0; j < QK_K / 16; ++j)
                sc[j] = 0;
            put_f16(y + 80, 0.f);
        }
        if (max_min > 0) {
            float iscale = q4scale / max_min;
            for (int j = 0; j < QK_K / 16; ++j)
                sc[j] = (uint8_t)(sc[j] | (unsigned)nearest_int(iscale * mins[j]) << 4);
            put_f16(y + 82, max_min / q4scale);
        } else {
            put_f16(y + 82, 0.f);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            const float d = get_f16(y + 80) * (float)(sc[j] & 0xf);
            if (!d)
                continue;
            const float dm = get_f16(y + 82) * (float)(sc[j] >> 4);
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int((x[16 * j + ii] + dm) / d);
                L[16 * j + ii] = (uint8_t)MAXI(0, MINI(3, l));
            }
        }
        pack_2bit(L, qs);
    }
}

void st_wtype_quantize_q3_K(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 110) {
        uint8_t *hmask = y, *qs = y + 32, *ys = y + 96;
        float max_scale = 0, amax = 0;
        for (int j = 0; j < QK_K / 16; ++j) {
            scales[j] = make_q3_quants(16, 4, x + 16 * j, L + 16 * j);
            float scale = fabsf(scales[j]);
            if (scale > amax) {
                amax = scale;
                max_scale = scales[j];
            }
        }
        memset(ys, 0, 12);
        if (max_scale) {
            float iscale = -32.f / max_scale;
            for (int j = 0; j < QK_K / 16; ++j) {
                int8_t l = (int8_t)nearest_int(iscale * scales[j]);
                l = (int8_t)(MAXI(-32, MINI(31, l)) + 32);
                if (j < 8)
                    ys[j] = (uint8_t)(l & 0xf);
                else
                    ys[j - 8] = (uint8_t)(ys[j - 8] | (l & 0xf) << 4);
                l = (int8_t)(l >> 4);
                ys[j % 4 + 8] = (uint8_t)(ys[j % 4 + 8] | l << (2 * (j / 4)));
            }
            put_f16(y + 108, 1 / iscale);
        } else {
            put_f16(y + 108, 0.f);
        }
        for (int j = 0; j < QK_K / 16; ++j) {
            int8_t sc = (int8_t)(j < 8 ? ys[j] & 0xf : ys[j - 8] >> 4);
            sc = (int8_t)((sc | ((ys[8 + j % 4] >> (2 * (j / 4))) & 3) << 4) - 32);
            float d = get_f16(y + 108) * (float)sc;
            if (!d)
                continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(MAXI(-4, MINI(3, l)) + 4);
            }
        }
        memset(hmask, 0, QK_K / 8);
        int m = 0;
        uint8_t hm = 1;
        for (int j = 0; j < QK_K; ++j) {
            if (L[j] > 3) {
                hmask[m] |= hm;
                L[j] = (int8_t)(L[j] - 4);
            }
            if (++m == QK_K / 8) {
                m = 0;
                hm = (uint8_t)(hm << 1);
            }
        }
        pack_2bit((const uint8_t *)L, qs);
    }
}

/* Q4_K and Q5_K share everything but the level count (nmax) and the trial-scale search. */
static void quantize_k45(const float *x, uint8_t *y, int nmax, float rmin, int nstep, uint8_t *L)
{
    uint8_t Laux[32];
    float weights[32], mins[QK_K / 32], scales[QK_K / 32];
    uint8_t *ys = y + 4;
    float max_scale = 0, max_min = 0;
    for (int j = 0; j < QK_K / 32; ++j) {
        float sum_x2 = 0;
        for (int l = 0; l < 32; ++l)
            sum_x2 += x[32 * j + l] * x[32 * j + l];
        float av_x = sqrtf(sum_x2 / 32);
        for (int l = 0; l < 32; ++l)
            weights[l] = av_x + fabsf(x[32 * j + l]);
        scales[j] = make_qkx2_quants(32, nmax, x + 32 * j, weights, L + 32 * j, &mins[j], Laux,
                                     rmin, 0.1f, nstep, 0);
        if (scales[j] > max_scale)
            max_scale = scales[j];
        if (mins[j] > max_min)
            max_min = mins[j];
    }
    float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
    float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t ls = (uint8_t)nearest_int(inv_scale * scales[j]);
        uint8_t lm = (uint8_t)nearest_int(inv_min * mins[j]);
        ls = MINI(63, ls);
        lm = MINI(63, lm);
        if (j < 4) {
            ys[j] = ls;
            ys[j + 4] = lm;
        } else {
            ys[j + 4] = (uint8_t)((ls & 0xf) | (lm & 0xf) << 4);
            ys[j - 4] = (uint8_t)(ys[j - 4] | (ls >> 4) << 6);
            ys[j] = (uint8_t)(ys[j] | (lm >> 4) << 6);
        }
    }
    put_f16(y, max_scale / 63.f);
    put_f16(y + 2, max_min / 63.f);
    for (int j = 0; j < QK_K / 32; ++j) {
        uint8_t sc, m;
        k4_scale_min(ys, j, &sc, &m);
        const float d = get_f16(y) * (float)sc;
        if (!d)
            continue;
        const float dm = get_f16(y + 2) * (float)m;
        for (int ii = 0; ii < 32; ++ii) {
            int l = nearest_int((x[32 * j + ii] + dm) / d);
            L[32 * j + ii] = (uint8_t)MAXI(0, MINI(nmax, l));
        }
    }
}

void st_wtype_quantize_q4_K(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst, L[QK_K];
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 144) {
        quantize_k45(x, y, 15, -1.f, 20, L);
        uint8_t *q = y + 16;
        for (int j = 0; j < QK_K; j += 64, q += 32)
            for (int l = 0; l < 32; ++l)
                q[l] = (uint8_t)(L[j + l] | L[j + l + 32] << 4);
    }
}

void st_wtype_quantize_q5_K(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst, L[QK_K];
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 176) {
        quantize_k45(x, y, 31, -0.5f, 15, L);
        uint8_t *qh = y + 16, *ql = y + 48;
        memset(qh, 0, QK_K / 8);
        uint8_t m1 = 1, m2 = 2;
        for (int nn = 0; nn < QK_K; nn += 64, ql += 32) {
            for (int j = 0; j < 32; ++j) {
                int l1 = L[nn + j];
                if (l1 > 15) {
                    l1 -= 16;
                    qh[j] |= m1;
                }
                int l2 = L[nn + j + 32];
                if (l2 > 15) {
                    l2 -= 16;
                    qh[j] |= m2;
                }
                ql[j] = (uint8_t)(l1 | l2 << 4);
            }
            m1 = (uint8_t)(m1 << 2);
            m2 = (uint8_t)(m2 << 2);
        }
    }
}

void st_wtype_quantize_q6_K(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    int8_t L[QK_K];
    float scales[QK_K / 16];
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 210) {
        uint8_t *ql = y, *qh = y + 128;
        int8_t *ys = (int8_t *)(y + 192);
        float max_scale = 0, max_abs_scale = 0;
        for (int ib = 0; ib < QK_K / 16; ++ib) {
            const float scale = make_qx_quants(16, 32, x + 16 * ib, L + 16 * ib);
            scales[ib] = scale;
            const float abs_scale = fabsf(scale);
            if (abs_scale > max_abs_scale) {
                max_abs_scale = abs_scale;
                max_scale = scale;
            }
        }
        if (max_abs_scale < GROUP_MAX_EPS) {
            memset(y, 0, 210);
            put_f16(y + 208, 0.f);
            continue;
        }
        float iscale = -128.f / max_scale;
        put_f16(y + 208, 1 / iscale);
        for (int ib = 0; ib < QK_K / 16; ++ib)
            ys[ib] = (int8_t)MINI(127, nearest_int(iscale * scales[ib]));
        for (int j = 0; j < QK_K / 16; ++j) {
            float d = get_f16(y + 208) * (float)ys[j];
            if (!d)
                continue;
            for (int ii = 0; ii < 16; ++ii) {
                int l = nearest_int(x[16 * j + ii] / d);
                L[16 * j + ii] = (int8_t)(MAXI(-32, MINI(31, l)) + 32);
            }
        }
        for (int j = 0; j < QK_K; j += 128, ql += 64, qh += 32)
            for (int l = 0; l < 32; ++l) {
                const uint8_t q1 = L[j + l] & 0xf, q2 = L[j + l + 32] & 0xf,
                              q3 = L[j + l + 64] & 0xf, q4 = L[j + l + 96] & 0xf;
                ql[l] = (uint8_t)(q1 | q3 << 4);
                ql[l + 32] = (uint8_t)(q2 | q4 << 4);
                qh[l] = (uint8_t)((L[j + l] >> 4) | (L[j + l + 32] >> 4) << 2 |
                                  (L[j + l + 64] >> 4) << 4 | (L[j + l + 96] >> 4) << 6);
            }
    }
}

/* ---- IQ4_NL / IQ4_XS (ggml's quantize_row_iq4_nl_impl without weights, 7 trial scales) ---------- */
/* Index of the codebook value nearest x (ties to the lower). */
static inline int best_index_int8(int n, const int8_t *val, float x)
{
    if (x <= val[0])
        return 0;
    if (x >= val[n - 1])
        return n - 1;
    int ml = 0, mu = n - 1;
    while (mu - ml > 1) {
        int mav = (ml + mu) / 2;
        if (x < val[mav])
            mu = mav;
        else
            ml = mav;
    }
    return x - val[mu - 1] < val[mu] - x ? mu - 1 : mu;
}

/* One super-block of sbs values (32: IQ4_NL, 256: IQ4_XS) in sub-blocks of 32: the f16 scale at
 * dh, the nibbles at q4, and for IQ4_XS the 6-bit sub-block scales at scales_h / scales_l. */
static void quantize_iq4(int sbs, const float *x, uint8_t *dh, uint8_t *q4, uint8_t *scales_h,
                         uint8_t *scales_l)
{
    const int8_t *values = st_wtype_iq4nl_values;
    const int ntry = 7;
    float scales[QK_K / 32], weight[32];
    uint8_t L[QK_K];
    memset(q4, 0, (size_t)sbs / 2);
    put_f16(dh, 0.f);
    float max_scale = 0, amax_scale = 0;
    for (int ib = 0; ib < sbs / 32; ++ib) {
        const float *xb = x + ib * 32;
        uint8_t *Lb = L + ib * 32;
        for (int j = 0; j < 32; ++j)
            weight[j] = xb[j] * xb[j];
        float amax = 0, max = 0;
        for (int j = 0; j < 32; ++j) {
            float ax = fabsf(xb[j]);
            if (ax > amax) {
                amax = ax;
                max = xb[j];
            }
        }
        if (amax < GROUP_MAX_EPS) {
            scales[ib] = 0;
            continue;
        }
        float d = -max / (float)values[0];
        float id = 1 / d;
        float sumqx = 0, sumq2 = 0;
        for (int j = 0; j < 32; ++j) {
            int l = best_index_int8(16, values, id * xb[j]);
            Lb[j] = (uint8_t)l;
            float q = values[l], w = weight[j];
            sumqx += w * q * xb[j];
            sumq2 += w * q * q;
        }
        d = sumq2 > 0 ? sumqx / sumq2 : 0.f;
        float best = d * sumqx;
        for (int itry = -ntry; itry <= ntry; ++itry) {
            id = (float)(itry + values[0]) / max;
            sumqx = sumq2 = 0;
            for (int j = 0; j < 32; ++j) {
                int l = best_index_int8(16, values, id * xb[j]);
                float q = values[l], w = weight[j];
                sumqx += w * q * xb[j];
                sumq2 += w * q * q;
            }
            if (sumq2 > 0 && sumqx * sumqx > best * sumq2) {
                d = sumqx / sumq2;
                best = d * sumqx;
            }
        }
        scales[ib] = d;
        float abs_d = fabsf(d);
        if (abs_d > amax_scale) {
            amax_scale = abs_d;
            max_scale = d;
        }
    }
    if (sbs / 32 > 1) {
        uint16_t sh = 0;
        float d = -max_scale / 32;
        put_f16(dh, d);
        float id = d ? 1 / d : 0.f;
        for (int ib = 0; ib < sbs / 32; ++ib) {
            int l = nearest_int(id * scales[ib]);
            l = MAXI(-32, MINI(31, l));
            float dl = d * (float)l;
            float idl = dl ? 1 / dl : 0.f;
            uint8_t *Lb = L + ib * 32;
            const float *xb = x + ib * 32;
            for (int j = 0; j < 32; ++j)
                Lb[j] = (uint8_t)best_index_int8(16, values, idl * xb[j]);
            l += 32;
            uint8_t l_l = (uint8_t)(l & 0xf), l_h = (uint8_t)(l >> 4);
            if (ib % 2 == 0)
                scales_l[ib / 2] = l_l;
            else
                scales_l[ib / 2] = (uint8_t)(scales_l[ib / 2] | l_l << 4);
            sh = (uint16_t)(sh | l_h << (2 * (ib % 8)));
        }
        scales_h[0] = (uint8_t)sh;
        scales_h[1] = (uint8_t)(sh >> 8);
    } else {
        put_f16(dh, scales[0]);
        float id = scales[0] ? 1 / scales[0] : 0;
        for (int j = 0; j < sbs; ++j)
            L[j] = (uint8_t)best_index_int8(16, values, id * x[j]);
    }
    for (int i = 0; i < sbs / 32; ++i)
        for (int j = 0; j < 16; ++j)
            q4[16 * i + j] = (uint8_t)(L[32 * i + j] | L[32 * i + 16 + j] << 4);
}

void st_wtype_quantize_iq4_nl(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / 32; i++, x += 32, y += 18)
        quantize_iq4(32, x, y, y + 2, NULL, NULL);
}

void st_wtype_quantize_iq4_xs(const float *x, void *dst, uint64_t n)
{
    uint8_t *y = dst;
    for (uint64_t i = 0; i < n / QK_K; i++, x += QK_K, y += 136)
        quantize_iq4(QK_K, x, y, y + 8, y + 2, y + 4);
}
