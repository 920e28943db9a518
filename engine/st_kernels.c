/*
 * st_kernels.c - the CPU compute kernels, each in a scalar reference and an AVX2+FMA+F16C form
 * that give bit-identical results.
 *
 * Invariants:
 * 1. Every reduction follows the canonical order of st_engine_int.h: 8 lanes of fused
 *    multiply-adds, the fixed lane tree, then the tail with fused multiply-adds. The scalar code
 *    spells the lanes out and uses fmaf(); the vector code uses _mm256_fmadd_ps and the same tree.
 * 2. Element-wise updates (axpy, the DeltaNet step) are per element, so the vector width only
 *    changes how many elements are done at once, never the operations on one of them.
 * 3. This file is compiled with -ffp-contract=off so the compiler never fuses a multiply and an
 *    add on its own: every fused operation is written out.
 * 4. Weights are widened to f32 exactly (f16, bf16) before they are used; quantized weights
 *    (st_wtype.h) are dequantized by the weight-type table, a chunk of a row at a time, and
 *    dotted in f32 in the same canonical order (a quantized row is a whole number of 32-value
 *    blocks, so it has no tail).
 */
#include <math.h>
#include <string.h>

#include <immintrin.h>

#include "st_codec.h"
#include "st_engine_int.h"
#include "st_wtype.h"

#define VEC __attribute__((target("avx2,fma,f16c")))
#define VEC_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

/* The codec's AVX2 level (AVX2 + F16C with the OS saving YMM state) and FMA, from common's one
 * detector. */
int st_kern_cpu_has_avx2(void)
{
    return st_cpu_has(ST_CPU_AVX2 | ST_CPU_F16C | ST_CPU_FMA);
}

/* AVX-512 F, BW, VL, DQ and VNNI with the OS saving ZMM state, on top of the AVX2 level: the
 * integer path's third form. */
int st_kern_cpu_has_avx512vnni(void)
{
    return st_kern_cpu_has_avx2() && st_cpu_has(ST_CPU_AVX512F | ST_CPU_AVX512BW | ST_CPU_AVX512VL |
                                                ST_CPU_AVX512DQ | ST_CPU_AVX512VNNI);
}

float st_f16_to_f32(uint16_t h)
{
    uint32_t s = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu, f;
    float out;
    if (e == 0) {
        float v = (float)m * 0x1p-24f; /* exact: m < 2^10 */
        memcpy(&f, &v, 4);
        f |= s;
    } else if (e == 31) {
        f = s | 0x7f800000u | (m << 13);
    } else {
        f = s | ((e + 112u) << 23) | (m << 13);
    }
    memcpy(&out, &f, 4);
    return out;
}

float st_bf16_to_f32(uint16_t h)
{
    uint32_t f = (uint32_t)h << 16;
    float out;
    memcpy(&out, &f, 4);
    return out;
}

static inline float w_at(const st_wmat *w, const void *row, uint32_t k)
{
    switch (w->type) {
    case ST_GGML_F16: return st_f16_to_f32(((const uint16_t *)row)[k]);
    case ST_GGML_BF16: return st_bf16_to_f32(((const uint16_t *)row)[k]);
    case ST_GGML_I8: return (float)((const int8_t *)row)[k];
    default: return ((const float *)row)[k];
    }
}

/* Bytes of n values of a row: i8 K/V rows, or a weight type of the table (the loader admits
 * only those). */
static inline size_t w_bytes(uint32_t type, uint32_t n)
{
    if (type == ST_GGML_I8)
        return n;
    const st_wtype *t = st_wtype_get(type);
    return (size_t)n / t->block * t->bytes;
}

static inline size_t w_stride_bytes(const st_wmat *w)
{
    return w_bytes(w->type, w->stride ? w->stride : w->cols);
}

static inline const void *w_row(const st_wmat *w, uint32_t r)
{
    return (const uint8_t *)w->data + (size_t)r * w_stride_bytes(w);
}

/* F32, F16, BF16 and I8 have kernels of their own here; every other type goes through the
 * weight-type table. */
static inline int w_is_quant(uint32_t type)
{
    return type != ST_GGML_F32 && type != ST_GGML_F16 && type != ST_GGML_BF16 &&
           type != ST_GGML_I8;
}

size_t st_wmat_row_bytes(const st_wmat *w)
{
    return w_stride_bytes(w);
}

void st_kern_row_f32(const st_wmat *w, uint32_t r, float *dst)
{
    const void *row = w_row(w, r);
    if (w_is_quant(w->type)) {
        st_wtype_get(w->type)->dequant[0](row, dst, w->cols);
        return;
    }
    for (uint32_t k = 0; k < w->cols; k++)
        dst[k] = w_at(w, row, k);
}

static inline float lanes_sum(const float a[8])
{
    float b0 = a[0] + a[4], b1 = a[1] + a[5], b2 = a[2] + a[6], b3 = a[3] + a[7];
    float c0 = b0 + b2, c1 = b1 + b3;
    return c0 + c1;
}

/* ---- scalar reference ------------------------------------------------------------------ */
static float dot_w_scalar(const st_wmat *w, const void *row, const float *x, uint32_t n)
{
    float acc[8] = {0};
    uint32_t n8 = n & ~7u, k;
    for (k = 0; k < n8; k += 8)
        for (int l = 0; l < 8; l++)
            acc[l] = fmaf(w_at(w, row, k + (uint32_t)l), x[k + (uint32_t)l], acc[l]);
    float s = lanes_sum(acc);
    for (; k < n; k++)
        s = fmaf(w_at(w, row, k), x[k], s);
    return s;
}

static float dot_scalar(const float *a, const float *b, uint32_t n)
{
    float acc[8] = {0};
    uint32_t n8 = n & ~7u, k;
    for (k = 0; k < n8; k += 8)
        for (int l = 0; l < 8; l++)
            acc[l] = fmaf(a[k + (uint32_t)l], b[k + (uint32_t)l], acc[l]);
    float s = lanes_sum(acc);
    for (; k < n; k++)
        s = fmaf(a[k], b[k], s);
    return s;
}

/* ---- AVX2 + FMA + F16C --------------------------------------------------------------- */
VEC_INLINE float hsum8(__m256 v)
{
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    __m128 a = _mm_add_ps(lo, hi);              /* l0+l4, l1+l5, l2+l6, l3+l7 */
    __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a)); /* (l0+l4)+(l2+l6), (l1+l5)+(l3+l7) */
    __m128 c = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));
    return _mm_cvtss_f32(c);
}

VEC_INLINE __m256 load_w8(const void *row, uint32_t k, const int type)
{
    if (type == ST_GGML_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k)));
    if (type == ST_GGML_BF16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + k))),
            16));
    if (type == ST_GGML_I8)
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + k))));
    return _mm256_loadu_ps((const float *)row + k);
}

VEC_INLINE float w_at_vec(const void *row, uint32_t k, const int type)
{
    if (type == ST_GGML_F16)
        return _cvtsh_ss(((const uint16_t *)row)[k]);
    if (type == ST_GGML_BF16)
        return st_bf16_to_f32(((const uint16_t *)row)[k]);
    if (type == ST_GGML_I8)
        return (float)((const int8_t *)row)[k];
    return ((const float *)row)[k];
}

/* Tiles of MR rows x NT tokens of outputs, every output in the canonical order. The
 * accumulators are named variables so they stay in registers (16 ymm registers: the 3 x 4 tile
 * uses 12 accumulators, 3 weight vectors and 1 input vector). */
VEC_INLINE void tile_fin(__m256 acc, const void *row, const float *xr, float *dst, uint32_t n8,
                         uint32_t n, const int type)
{
    float s = hsum8(acc);
    for (uint32_t kk = n8; kk < n; kk++)
        s = fmaf(w_at_vec(row, kk, type), xr[kk], s);
    *dst = s;
}

VEC_INLINE void tile_3x4(const uint8_t *w, size_t ws, const float *x, uint32_t ldx, float *y,
                         uint32_t ldy, uint32_t r, uint32_t t, uint32_t n, const int type)
{
    const void *r0 = w + (size_t)r * ws, *r1 = w + (size_t)(r + 1) * ws,
               *r2 = w + (size_t)(r + 2) * ws;
    const float *x0 = x + (size_t)t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    __m256 a00 = _mm256_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m256 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m256 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    uint32_t n8 = n & ~7u;
    for (uint32_t k = 0; k < n8; k += 8) {
        __m256 w0 = load_w8(r0, k, type), w1 = load_w8(r1, k, type), w2 = load_w8(r2, k, type);
        __m256 xv = _mm256_loadu_ps(x0 + k);
        a00 = _mm256_fmadd_ps(w0, xv, a00);
        a10 = _mm256_fmadd_ps(w1, xv, a10);
        a20 = _mm256_fmadd_ps(w2, xv, a20);
        xv = _mm256_loadu_ps(x1 + k);
        a01 = _mm256_fmadd_ps(w0, xv, a01);
        a11 = _mm256_fmadd_ps(w1, xv, a11);
        a21 = _mm256_fmadd_ps(w2, xv, a21);
        xv = _mm256_loadu_ps(x2 + k);
        a02 = _mm256_fmadd_ps(w0, xv, a02);
        a12 = _mm256_fmadd_ps(w1, xv, a12);
        a22 = _mm256_fmadd_ps(w2, xv, a22);
        xv = _mm256_loadu_ps(x3 + k);
        a03 = _mm256_fmadd_ps(w0, xv, a03);
        a13 = _mm256_fmadd_ps(w1, xv, a13);
        a23 = _mm256_fmadd_ps(w2, xv, a23);
    }
    float *y0 = y + (size_t)t * ldy + r, *y1 = y0 + ldy, *y2 = y1 + ldy, *y3 = y2 + ldy;
    tile_fin(a00, r0, x0, y0, n8, n, type);
    tile_fin(a10, r1, x0, y0 + 1, n8, n, type);
    tile_fin(a20, r2, x0, y0 + 2, n8, n, type);
    tile_fin(a01, r0, x1, y1, n8, n, type);
    tile_fin(a11, r1, x1, y1 + 1, n8, n, type);
    tile_fin(a21, r2, x1, y1 + 2, n8, n, type);
    tile_fin(a02, r0, x2, y2, n8, n, type);
    tile_fin(a12, r1, x2, y2 + 1, n8, n, type);
    tile_fin(a22, r2, x2, y2 + 2, n8, n, type);
    tile_fin(a03, r0, x3, y3, n8, n, type);
    tile_fin(a13, r1, x3, y3 + 1, n8, n, type);
    tile_fin(a23, r2, x3, y3 + 2, n8, n, type);
}

VEC_INLINE void tile_1x4(const uint8_t *w, size_t ws, const float *x, uint32_t ldx, float *y,
                         uint32_t ldy, uint32_t r, uint32_t t, uint32_t n, const int type)
{
    const void *r0 = w + (size_t)r * ws;
    const float *x0 = x + (size_t)t * ldx, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    uint32_t n8 = n & ~7u;
    for (uint32_t k = 0; k < n8; k += 8) {
        __m256 w0 = load_w8(r0, k, type);
        a0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x0 + k), a0);
        a1 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x1 + k), a1);
        a2 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x2 + k), a2);
        a3 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x3 + k), a3);
    }
    float *y0 = y + (size_t)t * ldy + r;
    tile_fin(a0, r0, x0, y0, n8, n, type);
    tile_fin(a1, r0, x1, y0 + ldy, n8, n, type);
    tile_fin(a2, r0, x2, y0 + 2 * (size_t)ldy, n8, n, type);
    tile_fin(a3, r0, x3, y0 + 3 * (size_t)ldy, n8, n, type);
}

VEC_INLINE void tile_4x1(const uint8_t *w, size_t ws, const float *x, uint32_t ldx, float *y,
                         uint32_t ldy, uint32_t r, uint32_t t, uint32_t n, const int type)
{
    const void *r0 = w + (size_t)r * ws, *r1 = w + (size_t)(r + 1) * ws,
               *r2 = w + (size_t)(r + 2) * ws, *r3 = w + (size_t)(r + 3) * ws;
    const float *x0 = x + (size_t)t * ldx;
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    uint32_t n8 = n & ~7u;
    for (uint32_t k = 0; k < n8; k += 8) {
        __m256 xv = _mm256_loadu_ps(x0 + k);
        a0 = _mm256_fmadd_ps(load_w8(r0, k, type), xv, a0);
        a1 = _mm256_fmadd_ps(load_w8(r1, k, type), xv, a1);
        a2 = _mm256_fmadd_ps(load_w8(r2, k, type), xv, a2);
        a3 = _mm256_fmadd_ps(load_w8(r3, k, type), xv, a3);
    }
    float *y0 = y + (size_t)t * ldy + r;
    tile_fin(a0, r0, x0, y0, n8, n, type);
    tile_fin(a1, r1, x0, y0 + 1, n8, n, type);
    tile_fin(a2, r2, x0, y0 + 2, n8, n, type);
    tile_fin(a3, r3, x0, y0 + 3, n8, n, type);
}

VEC_INLINE void tile_1x1(const uint8_t *w, size_t ws, const float *x, uint32_t ldx, float *y,
                         uint32_t ldy, uint32_t r, uint32_t t, uint32_t n, const int type)
{
    const void *r0 = w + (size_t)r * ws;
    const float *x0 = x + (size_t)t * ldx;
    __m256 a0 = _mm256_setzero_ps();
    uint32_t n8 = n & ~7u;
    for (uint32_t k = 0; k < n8; k += 8)
        a0 = _mm256_fmadd_ps(load_w8(r0, k, type), _mm256_loadu_ps(x0 + k), a0);
    tile_fin(a0, r0, x0, y + (size_t)t * ldy + r, n8, n, type);
}

#define MM_VARIANT(NAME, TYPE)                                                                   \
    VEC static void NAME(const st_wmat *w, const float *x, uint32_t ldx, float *y, uint32_t ldy,  \
                         uint32_t r0, uint32_t r1, uint32_t t0, uint32_t t1)                      \
    {                                                                                            \
        const uint8_t *wd = w->data;                                                             \
        size_t ws = w_stride_bytes(w);                                                           \
        uint32_t n = w->cols, t = t0, r;                                                         \
        for (; t + 4 <= t1; t += 4) {                                                            \
            for (r = r0; r + 3 <= r1; r += 3)                                                    \
                tile_3x4(wd, ws, x, ldx, y, ldy, r, t, n, TYPE);                                 \
            for (; r < r1; r++)                                                                  \
                tile_1x4(wd, ws, x, ldx, y, ldy, r, t, n, TYPE);                                 \
        }                                                                                        \
        for (; t < t1; t++) {                                                                    \
            for (r = r0; r + 4 <= r1; r += 4)                                                    \
                tile_4x1(wd, ws, x, ldx, y, ldy, r, t, n, TYPE);                                 \
            for (; r < r1; r++)                                                                  \
                tile_1x1(wd, ws, x, ldx, y, ldy, r, t, n, TYPE);                                 \
        }                                                                                        \
    }

MM_VARIANT(mm_f32_vec, ST_GGML_F32)
MM_VARIANT(mm_f16_vec, ST_GGML_F16)
MM_VARIANT(mm_bf16_vec, ST_GGML_BF16)
MM_VARIANT(mm_i8_vec, ST_GGML_I8)

/* Quantized weights, several tokens: rows of the weight-type table dequantized a chunk of
 * QCHUNK values at a time (QMR rows into buf), each chunk dotted with every token of the block
 * of QTB tokens, the accumulators kept across chunks (acc). A chunk is a whole number of blocks
 * and a multiple of 8, so lane l still takes elements 8j + l in increasing j and the result is
 * the canonical dot of the dequantized row: dot_rows' bits, for any split of rows and tokens.
 * One token alone goes to the table's fused dot_rows instead (same bits, no buffer). */
#define QCHUNK 256
#define QMR 4
#define QTB 32
VEC static void mm_q_vec(const st_wtype *wt, const st_wmat *w, const float *x, uint32_t ldx,
                         float *y, uint32_t ldy, uint32_t r0, uint32_t r1, uint32_t t0, uint32_t t1)
{
    const uint8_t *wd = w->data;
    const size_t ws = w_stride_bytes(w);
    const uint32_t n = w->cols;
    _Alignas(32) float buf[QMR][QCHUNK];
    __m256 acc[QMR][QTB];
    for (uint32_t t = t0; t < t1; t += QTB) {
        uint32_t tn = t1 - t < QTB ? t1 - t : QTB;
        for (uint32_t r = r0; r < r1; r += QMR) {
            uint32_t mr = r1 - r < QMR ? r1 - r : QMR;
            for (uint32_t i = 0; i < mr; i++)
                for (uint32_t j = 0; j < tn; j++)
                    acc[i][j] = _mm256_setzero_ps();
            for (uint32_t k = 0; k < n; k += QCHUNK) {
                uint32_t kn = n - k < QCHUNK ? n - k : QCHUNK;
                for (uint32_t i = 0; i < mr; i++)
                    wt->dequant[1](wd + (size_t)(r + i) * ws + w_bytes(w->type, k), buf[i], kn);
                uint32_t j = 0;
                if (mr == QMR)
                    for (; j + 2 <= tn; j += 2) {
                        const float *xa = x + (size_t)(t + j) * ldx + k, *xb = xa + ldx;
                        __m256 a0 = acc[0][j], a1 = acc[1][j], a2 = acc[2][j], a3 = acc[3][j];
                        __m256 b0 = acc[0][j + 1], b1 = acc[1][j + 1], b2 = acc[2][j + 1],
                               b3 = acc[3][j + 1];
                        for (uint32_t kk = 0; kk < kn; kk += 8) {
                            __m256 w0 = _mm256_load_ps(buf[0] + kk);
                            __m256 w1 = _mm256_load_ps(buf[1] + kk);
                            __m256 w2 = _mm256_load_ps(buf[2] + kk);
                            __m256 w3 = _mm256_load_ps(buf[3] + kk);
                            __m256 xv = _mm256_loadu_ps(xa + kk);
                            a0 = _mm256_fmadd_ps(w0, xv, a0);
                            a1 = _mm256_fmadd_ps(w1, xv, a1);
                            a2 = _mm256_fmadd_ps(w2, xv, a2);
                            a3 = _mm256_fmadd_ps(w3, xv, a3);
                            xv = _mm256_loadu_ps(xb + kk);
                            b0 = _mm256_fmadd_ps(w0, xv, b0);
                            b1 = _mm256_fmadd_ps(w1, xv, b1);
                            b2 = _mm256_fmadd_ps(w2, xv, b2);
                            b3 = _mm256_fmadd_ps(w3, xv, b3);
                        }
                        acc[0][j] = a0, acc[1][j] = a1, acc[2][j] = a2, acc[3][j] = a3;
                        acc[0][j + 1] = b0, acc[1][j + 1] = b1, acc[2][j + 1] = b2,
                        acc[3][j + 1] = b3;
                    }
                for (; j < tn; j++) {
                    const float *xa = x + (size_t)(t + j) * ldx + k;
                    for (uint32_t i = 0; i < mr; i++) {
                        __m256 a = acc[i][j];
                        for (uint32_t kk = 0; kk < kn; kk += 8)
                            a = _mm256_fmadd_ps(_mm256_load_ps(buf[i] + kk),
                                                _mm256_loadu_ps(xa + kk), a);
                        acc[i][j] = a;
                    }
                }
            }
            for (uint32_t j = 0; j < tn; j++)
                for (uint32_t i = 0; i < mr; i++)
                    y[(size_t)(t + j) * ldy + r + i] = hsum8(acc[i][j]);
        }
    }
}

VEC static float dot_vec(const float *a, const float *b, uint32_t n)
{
    __m256 acc = _mm256_setzero_ps();
    uint32_t n8 = n & ~7u, k;
    for (k = 0; k < n8; k += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
    float s = hsum8(acc);
    for (; k < n; k++)
        s = fmaf(a[k], b[k], s);
    return s;
}

/* The DeltaNet recurrence over T tokens of one head, M[i][j] = S[j][i]. For each token t:
 *   u[j]     = sum_i M[i][j] k_t[i]            (increasing i, fused)
 *   delta[j] = beta_t * (v_t[j] - alpha_t * u[j])
 *   M[i][j]  = fma(k_t[i], delta[j], alpha_t * M[i][j])
 *   out_t[j] = sum_i M[i][j] q_t[i]            (increasing i, fused)
 * which is S_t = alpha_t S (I - beta_t k_t k_t^T) + beta_t v_t k_t^T, o_t = S_t q_t. The sum u of
 * token t + 1 is accumulated in the same pass that updates M for token t (the same operations in
 * the same order), so M is read and written once per token. Columns are independent: M may be
 * a block of dv columns of a wider matrix whose rows are ldm floats apart. The vector form runs
 * every token over a block of DN_NV x 8 columns before the next block (the same operations on
 * each element, in the same order): the block of M (dk rows of 64 bytes) stays in L1 over all T
 * tokens, and u, delta and out of the block live in registers. */
#define DN_ARGS                                                                                  \
    float *M, size_t ldm, uint32_t dk, uint32_t dv, uint32_t T, const float *q, const float *kk, \
        const float *v, size_t xs, const float *alpha, const float *beta, size_t as, float *out, \
        size_t os, float *u
#define DN_NV 2
VEC_INLINE void delta_block_vec(float *M, size_t ldm, uint32_t dk, uint32_t T, const float *q,
                                const float *kk, const float *v, size_t xs, const float *alpha,
                                const float *beta, size_t as, float *out, size_t os,
                                const int nv)
{
    __m256 u[DN_NV], d[DN_NV], o[DN_NV];
    for (int l = 0; l < nv; l++)
        u[l] = _mm256_setzero_ps();
    for (uint32_t i = 0; i < dk; i++) {
        const float *m = M + (size_t)i * ldm;
        __m256 ki = _mm256_set1_ps(kk[i]);
        for (int l = 0; l < nv; l++)
            u[l] = _mm256_fmadd_ps(_mm256_loadu_ps(m + 8 * l), ki, u[l]);
    }
    for (uint32_t t = 0; t < T; t++) {
        const float *qt = q + t * xs, *kt = kk + t * xs, *vt = v + t * xs;
        const float *kn = t + 1 < T ? kk + (t + 1) * xs : NULL;
        __m256 av = _mm256_set1_ps(alpha[t * as]), bv = _mm256_set1_ps(beta[t * as]);
        for (int l = 0; l < nv; l++) {
            d[l] = _mm256_mul_ps(bv, _mm256_sub_ps(_mm256_loadu_ps(vt + 8 * l),
                                                   _mm256_mul_ps(av, u[l])));
            o[l] = _mm256_setzero_ps();
            u[l] = _mm256_setzero_ps();
        }
        if (kn)
            for (uint32_t i = 0; i < dk; i++) {
                float *m = M + (size_t)i * ldm;
                __m256 ki = _mm256_set1_ps(kt[i]), qi = _mm256_set1_ps(qt[i]),
                       kni = _mm256_set1_ps(kn[i]);
                for (int l = 0; l < nv; l++) {
                    __m256 mv = _mm256_fmadd_ps(ki, d[l],
                                                _mm256_mul_ps(av, _mm256_loadu_ps(m + 8 * l)));
                    _mm256_storeu_ps(m + 8 * l, mv);
                    o[l] = _mm256_fmadd_ps(mv, qi, o[l]);
                    u[l] = _mm256_fmadd_ps(mv, kni, u[l]);
                }
            }
        else
            for (uint32_t i = 0; i < dk; i++) {
                float *m = M + (size_t)i * ldm;
                __m256 ki = _mm256_set1_ps(kt[i]), qi = _mm256_set1_ps(qt[i]);
                for (int l = 0; l < nv; l++) {
                    __m256 mv = _mm256_fmadd_ps(ki, d[l],
                                                _mm256_mul_ps(av, _mm256_loadu_ps(m + 8 * l)));
                    _mm256_storeu_ps(m + 8 * l, mv);
                    o[l] = _mm256_fmadd_ps(mv, qi, o[l]);
                }
            }
        float *ot = out + t * os;
        for (int l = 0; l < nv; l++)
            _mm256_storeu_ps(ot + 8 * l, o[l]);
    }
}

/* Columns [j0, j1) in the scalar order (the tail of the vector form, and the reference). */
static void delta_cols_scalar(float *M, size_t ldm, uint32_t dk, uint32_t j0, uint32_t j1,
                              uint32_t T, const float *q, const float *kk, const float *v,
                              size_t xs, const float *alpha, const float *beta, size_t as,
                              float *out, size_t os, float *u)
{
    float *d = u + j1;
    for (uint32_t j = j0; j < j1; j++)
        u[j] = 0.0f;
    for (uint32_t i = 0; i < dk; i++)
        for (uint32_t j = j0; j < j1; j++)
            u[j] = fmaf(M[(size_t)i * ldm + j], kk[i], u[j]);
    for (uint32_t t = 0; t < T; t++) {
        const float *qt = q + t * xs, *kt = kk + t * xs, *vt = v + t * xs;
        const float *kn = t + 1 < T ? kk + (t + 1) * xs : NULL;
        float a = alpha[t * as], b = beta[t * as], *o = out + t * os;
        for (uint32_t j = j0; j < j1; j++) {
            d[j] = b * (vt[j] - a * u[j]);
            o[j] = 0.0f;
            u[j] = 0.0f;
        }
        for (uint32_t i = 0; i < dk; i++) {
            float *m = M + (size_t)i * ldm;
            for (uint32_t j = j0; j < j1; j++) {
                m[j] = fmaf(kt[i], d[j], a * m[j]);
                o[j] = fmaf(m[j], qt[i], o[j]);
                if (kn)
                    u[j] = fmaf(m[j], kn[i], u[j]);
            }
        }
    }
}

VEC static void delta_scan_vec(DN_ARGS)
{
    uint32_t j = 0;
    for (; j + 8 * DN_NV <= dv; j += 8 * DN_NV)
        delta_block_vec(M + j, ldm, dk, T, q, kk, v + j, xs, alpha, beta, as, out + j, os, DN_NV);
    for (; j + 8 <= dv; j += 8)
        delta_block_vec(M + j, ldm, dk, T, q, kk, v + j, xs, alpha, beta, as, out + j, os, 1);
    if (j < dv)
        delta_cols_scalar(M, ldm, dk, j, dv, T, q, kk, v, xs, alpha, beta, as, out, os, u);
}

static void delta_scan_scalar(DN_ARGS)
{
    delta_cols_scalar(M, ldm, dk, 0, dv, T, q, kk, v, xs, alpha, beta, as, out, os, u);
}

/* ---- attention: weighted sum of values ------------------------------------------------ */
VEC_INLINE __m256 load_v8(const void *row, uint32_t d, const int type)
{
    if (type == ST_GGML_F32)
        return _mm256_loadu_ps((const float *)row + d);
    if (type == ST_GGML_I8)
        return _mm256_cvtepi32_ps(
            _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)((const int8_t *)row + d))));
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)row + d)));
}

VEC_INLINE float v_at_vec(const void *row, uint32_t d, const int type)
{
    if (type == ST_GGML_F32)
        return ((const float *)row)[d];
    if (type == ST_GGML_I8)
        return (float)((const int8_t *)row)[d];
    return _cvtsh_ss(((const uint16_t *)row)[d]);
}

VEC_INLINE void pv_body(float *out, uint32_t ldo, const float *p, uint32_t ldp, uint32_t nq,
                        const uint8_t *v, size_t vs, const float *vscale, uint32_t sstride,
                        uint32_t j0, uint32_t j1, uint32_t hd, const int type)
{
    uint32_t d8 = hd & ~7u, d;
    for (d = 0; d < d8; d += 8) {
        __m256 a0 = _mm256_loadu_ps(out + d);
        __m256 a1 = nq > 1 ? _mm256_loadu_ps(out + ldo + d) : a0;
        __m256 a2 = nq > 2 ? _mm256_loadu_ps(out + 2 * (size_t)ldo + d) : a0;
        __m256 a3 = nq > 3 ? _mm256_loadu_ps(out + 3 * (size_t)ldo + d) : a0;
        for (uint32_t j = j0; j < j1; j++) {
            const uint8_t *row = v + (size_t)(j - j0) * vs;
            __m256 vv = load_v8(row, d, type);
            float sc = type == ST_GGML_I8 ? vscale[(size_t)(j - j0) * sstride] : 1.0f;
            float w0 = type == ST_GGML_I8 ? p[j] * sc : p[j];
            a0 = _mm256_fmadd_ps(_mm256_set1_ps(w0), vv, a0);
            if (nq > 1) {
                float w = type == ST_GGML_I8 ? p[ldp + j] * sc : p[ldp + j];
                a1 = _mm256_fmadd_ps(_mm256_set1_ps(w), vv, a1);
            }
            if (nq > 2) {
                float w = type == ST_GGML_I8 ? p[2 * (size_t)ldp + j] * sc : p[2 * (size_t)ldp + j];
                a2 = _mm256_fmadd_ps(_mm256_set1_ps(w), vv, a2);
            }
            if (nq > 3) {
                float w = type == ST_GGML_I8 ? p[3 * (size_t)ldp + j] * sc : p[3 * (size_t)ldp + j];
                a3 = _mm256_fmadd_ps(_mm256_set1_ps(w), vv, a3);
            }
        }
        _mm256_storeu_ps(out + d, a0);
        if (nq > 1)
            _mm256_storeu_ps(out + ldo + d, a1);
        if (nq > 2)
            _mm256_storeu_ps(out + 2 * (size_t)ldo + d, a2);
        if (nq > 3)
            _mm256_storeu_ps(out + 3 * (size_t)ldo + d, a3);
    }
    for (; d < hd; d++)
        for (uint32_t i = 0; i < nq; i++) {
            float acc = out[(size_t)i * ldo + d];
            for (uint32_t j = j0; j < j1; j++) {
                const uint8_t *row = v + (size_t)(j - j0) * vs;
                float w = p[(size_t)i * ldp + j];
                if (type == ST_GGML_I8)
                    w = w * vscale[(size_t)(j - j0) * sstride];
                acc = fmaf(w, v_at_vec(row, d, type), acc);
            }
            out[(size_t)i * ldo + d] = acc;
        }
}

VEC static void pv_f16_vec(float *out, uint32_t ldo, const float *p, uint32_t ldp, uint32_t nq,
                           const uint8_t *v, size_t vs, uint32_t j0, uint32_t j1, uint32_t hd)
{
    pv_body(out, ldo, p, ldp, nq, v, vs, NULL, 0, j0, j1, hd, ST_GGML_F16);
}

VEC static void pv_f32_vec(float *out, uint32_t ldo, const float *p, uint32_t ldp, uint32_t nq,
                           const uint8_t *v, size_t vs, uint32_t j0, uint32_t j1, uint32_t hd)
{
    pv_body(out, ldo, p, ldp, nq, v, vs, NULL, 0, j0, j1, hd, ST_GGML_F32);
}

VEC static void pv_i8_vec(float *out, uint32_t ldo, const float *p, uint32_t ldp, uint32_t nq,
                          const uint8_t *v, size_t vs, const float *vscale, uint32_t sstride,
                          uint32_t j0, uint32_t j1, uint32_t hd)
{
    pv_body(out, ldo, p, ldp, nq, v, vs, vscale, sstride, j0, j1, hd, ST_GGML_I8);
}

void st_kern_pv(const st_kern *k, float *out, uint32_t ldo, const float *p, uint32_t ldp,
                uint32_t nq, const void *v, uint32_t type, uint32_t vstride,
                const float *vscale, uint32_t sstride, uint32_t j0, uint32_t j1, uint32_t hd)
{
    size_t vs = w_bytes(type, vstride);
    if (k->vec) {
        if (type == ST_GGML_I8)
            pv_i8_vec(out, ldo, p, ldp, nq, v, vs, vscale, sstride, j0, j1, hd);
        else if (type == ST_GGML_F32)
            pv_f32_vec(out, ldo, p, ldp, nq, v, vs, j0, j1, hd);
        else
            pv_f16_vec(out, ldo, p, ldp, nq, v, vs, j0, j1, hd);
        return;
    }
    st_wmat vm = {v, type, j1 - j0, hd, vstride};
    for (uint32_t i = 0; i < nq; i++)
        for (uint32_t d = 0; d < hd; d++) {
            float acc = out[(size_t)i * ldo + d];
            for (uint32_t j = j0; j < j1; j++) {
                float w = p[(size_t)i * ldp + j];
                if (type == ST_GGML_I8)
                    w = w * vscale[(size_t)(j - j0) * sstride];
                acc = fmaf(w, w_at(&vm, w_row(&vm, j - j0), d), acc);
            }
            out[(size_t)i * ldo + d] = acc;
        }
}


/* ---- the DeltaNet short convolution ------------------------------------------------------ */
/* For channels [c0, c1) and tokens 0..T-1 in order:
 *   y[t][c] = fma(w3[c], x_t[c], fma(w2[c], h2, fma(w1[c], h1, fma(w0[c], h0, 0))))
 * with (h0, h1, h2) the three previous inputs, taken from st (rows of C) and left there for the
 * next chunk. wT holds the weights transposed, [4][C]. */
VEC static void conv_vec(const float *x, size_t ldx, float *y, size_t ldy, float *st, uint32_t C,
                         const float *wT, uint32_t c0, uint32_t c1, uint32_t T)
{
    uint32_t c = c0;
    for (; c + 8 <= c1; c += 8) {
        __m256 h0 = _mm256_loadu_ps(st + c), h1 = _mm256_loadu_ps(st + C + c),
               h2 = _mm256_loadu_ps(st + 2 * (size_t)C + c);
        __m256 w0 = _mm256_loadu_ps(wT + c), w1 = _mm256_loadu_ps(wT + C + c),
               w2 = _mm256_loadu_ps(wT + 2 * (size_t)C + c),
               w3 = _mm256_loadu_ps(wT + 3 * (size_t)C + c);
        for (uint32_t t = 0; t < T; t++) {
            __m256 xt = _mm256_loadu_ps(x + t * ldx + c);
            __m256 acc = _mm256_fmadd_ps(w0, h0, _mm256_setzero_ps());
            acc = _mm256_fmadd_ps(w1, h1, acc);
            acc = _mm256_fmadd_ps(w2, h2, acc);
            acc = _mm256_fmadd_ps(w3, xt, acc);
            _mm256_storeu_ps(y + t * ldy + c, acc);
            h0 = h1;
            h1 = h2;
            h2 = xt;
        }
        _mm256_storeu_ps(st + c, h0);
        _mm256_storeu_ps(st + C + c, h1);
        _mm256_storeu_ps(st + 2 * (size_t)C + c, h2);
    }
    for (; c < c1; c++) {
        float h0 = st[c], h1 = st[C + c], h2 = st[2 * (size_t)C + c];
        for (uint32_t t = 0; t < T; t++) {
            float xt = x[t * ldx + c];
            float acc = fmaf(wT[c], h0, 0.0f);
            acc = fmaf(wT[C + c], h1, acc);
            acc = fmaf(wT[2 * (size_t)C + c], h2, acc);
            acc = fmaf(wT[3 * (size_t)C + c], xt, acc);
            y[t * ldy + c] = acc;
            h0 = h1;
            h1 = h2;
            h2 = xt;
        }
        st[c] = h0;
        st[C + c] = h1;
        st[2 * (size_t)C + c] = h2;
    }
}

static void conv_scalar(const float *x, size_t ldx, float *y, size_t ldy, float *st, uint32_t C,
                        const float *wT, uint32_t c0, uint32_t c1, uint32_t T)
{
    for (uint32_t c = c0; c < c1; c++) {
        float h0 = st[c], h1 = st[C + c], h2 = st[2 * (size_t)C + c];
        for (uint32_t t = 0; t < T; t++) {
            float xt = x[t * ldx + c];
            float acc = fmaf(wT[c], h0, 0.0f);
            acc = fmaf(wT[C + c], h1, acc);
            acc = fmaf(wT[2 * (size_t)C + c], h2, acc);
            acc = fmaf(wT[3 * (size_t)C + c], xt, acc);
            y[t * ldy + c] = acc;
            h0 = h1;
            h1 = h2;
            h2 = xt;
        }
        st[c] = h0;
        st[C + c] = h1;
        st[2 * (size_t)C + c] = h2;
    }
}

void st_kern_conv(const st_kern *k, const float *x, size_t ldx, float *y, size_t ldy, float *st,
                  uint32_t C, const float *wT, uint32_t c0, uint32_t c1, uint32_t T)
{
    if (k->vec)
        conv_vec(x, ldx, y, ldy, st, C, wT, c0, c1, T);
    else
        conv_scalar(x, ldx, y, ldy, st, C, wT, c0, c1, T);
}

/* ---- dispatch -------------------------------------------------------------------------- */
float st_kern_dot(const st_kern *k, const float *a, const float *b, uint32_t n)
{
    return k->vec ? dot_vec(a, b, n) : dot_scalar(a, b, n);
}

void st_kern_delta_scan(const st_kern *k, DN_ARGS)
{
    if (k->vec)
        delta_scan_vec(M, ldm, dk, dv, T, q, kk, v, xs, alpha, beta, as, out, os, u);
    else
        delta_scan_scalar(M, ldm, dk, dv, T, q, kk, v, xs, alpha, beta, as, out, os, u);
}

void st_kern_matmul(const st_kern *k, const st_wmat *w, const float *x, uint32_t ldx, float *y,
                    uint32_t ldy, uint32_t r0, uint32_t r1, uint32_t t0, uint32_t t1)
{
    if (w_is_quant(w->type)) {
        const st_wtype *wt = st_wtype_get(w->type);
        if (k->vec && t1 - t0 > 1)
            mm_q_vec(wt, w, x, ldx, y, ldy, r0, r1, t0, t1);
        else
            for (uint32_t t = t0; t < t1; t++)
                wt->dot_rows[k->vec](w_row(w, r0), w_stride_bytes(w), r1 - r0,
                                     x + (size_t)t * ldx, w->cols, y + (size_t)t * ldy + r0);
        return;
    }
    if (k->vec) {
        switch (w->type) {
        case ST_GGML_F16: mm_f16_vec(w, x, ldx, y, ldy, r0, r1, t0, t1); return;
        case ST_GGML_BF16: mm_bf16_vec(w, x, ldx, y, ldy, r0, r1, t0, t1); return;
        case ST_GGML_I8: mm_i8_vec(w, x, ldx, y, ldy, r0, r1, t0, t1); return;
        default: mm_f32_vec(w, x, ldx, y, ldy, r0, r1, t0, t1); return;
        }
    }
    for (uint32_t t = t0; t < t1; t++)
        for (uint32_t r = r0; r < r1; r++)
            y[(size_t)t * ldy + r] = dot_w_scalar(w, w_row(w, r), x + (size_t)t * ldx, w->cols);
}
