/*
 * st_wtype_cuda.cuh - the block decoders of every weight type of the weight-type table
 * (st_wtype.c) on the GPU, shared by st_dequant_cuda.cu (rows widened to f32) and st_qmv_cuda.cu
 * (matrix-vector products dequantized in registers). Each decoder is the CPU's deq_* of
 * st_wtype.c written again for the device: the same float operations in the same order
 * (__fmul_rn / __fadd_rn / __fsub_rn, never fused), so a value it makes is bit for bit the CPU
 * scalar dequantization's (the invariants are st_dequant_cuda.cu's).
 */
#ifndef ST_WTYPE_CUDA_CUH
#define ST_WTYPE_CUDA_CUH

#include <stdint.h>

#include <cuda_fp16.h>

/* The IQ4 codebook: a __constant__ copy of st_wtype_iq4nl_values per file that includes this
 * header (a literal, so that every device has it with the module). */
static __constant__ int8_t dq_iq4nl[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                    1,    13,   25,  38,  53,  69,  89,  113};

/* The f16 at p (little-endian) widened as st_wtype_f16_to_f32 does (invariant 2). */
__device__ __forceinline__ float dq_f16(const uint8_t *p)
{
    uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
    if ((h & 0x7c00u) == 0x7c00u && (h & 0x3ffu))
        return __uint_as_float((h & 0x8000u) << 16 | 0x7fc00000u | (h & 0x3ffu) << 13);
    __half_raw r;
    r.x = (unsigned short)h;
    return __half2float(__half(r));
}

__device__ __forceinline__ uint32_t dq_u32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* One decoder per type: the QK values of the BYTES bytes at b, in the decoder's order, each
 * assigned to y[i] (y[j] = v, *y++ = v, y += n): Y is float * (the values stored, for
 * st_cuda_dequant_rows), st_dq_h16 (stored rounded to f16, st_cuda_dequant_rows_h) or st_dq_dot (each value multiplied by x[i] and added to one sum, for
 * the matrix-vector products of st_qmv_cuda.cu). */
struct dq_f32 {
    static const uint32_t QK = 1, BYTES = 4;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        *y = __uint_as_float(dq_u32(b));
    }
};

struct dq_f16v {
    static const uint32_t QK = 1, BYTES = 2;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        *y = dq_f16(b);
    }
};

struct dq_bf16 {
    static const uint32_t QK = 1, BYTES = 2;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        *y = __uint_as_float(((uint32_t)b[0] | (uint32_t)b[1] << 8) << 16);
    }
};

struct dq_q4_0 {
    static const uint32_t QK = 32, BYTES = 18;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            uint32_t q = qs[j];
            y[j] = __fmul_rn((float)((int)(q & 0xf) - 8), d);
            y[j + 16] = __fmul_rn((float)((int)(q >> 4) - 8), d);
        }
    }
};

struct dq_q4_1 {
    static const uint32_t QK = 32, BYTES = 20;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b), m = dq_f16(b + 2);
        const uint8_t *qs = b + 4;
        for (int j = 0; j < 16; j++) {
            uint32_t q = qs[j];
            y[j] = __fadd_rn(__fmul_rn((float)(int)(q & 0xf), d), m);
            y[j + 16] = __fadd_rn(__fmul_rn((float)(int)(q >> 4), d), m);
        }
    }
};

struct dq_q5_0 {
    static const uint32_t QK = 32, BYTES = 22;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b);
        const uint32_t qh = dq_u32(b + 2);
        const uint8_t *qs = b + 6;
        for (int j = 0; j < 16; j++) {
            uint32_t q = qs[j];
            int lo = (int)((q & 0xf) | ((qh >> j) & 1u) << 4);
            int hi = (int)((q >> 4) | ((qh >> (j + 16)) & 1u) << 4);
            y[j] = __fmul_rn((float)(lo - 16), d);
            y[j + 16] = __fmul_rn((float)(hi - 16), d);
        }
    }
};

struct dq_q5_1 {
    static const uint32_t QK = 32, BYTES = 24;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b), m = dq_f16(b + 2);
        const uint32_t qh = dq_u32(b + 4);
        const uint8_t *qs = b + 8;
        for (int j = 0; j < 16; j++) {
            uint32_t q = qs[j];
            int lo = (int)((q & 0xf) | ((qh >> j) & 1u) << 4);
            int hi = (int)((q >> 4) | ((qh >> (j + 16)) & 1u) << 4);
            y[j] = __fadd_rn(__fmul_rn((float)lo, d), m);
            y[j + 16] = __fadd_rn(__fmul_rn((float)hi, d), m);
        }
    }
};

struct dq_q8_0 {
    static const uint32_t QK = 32, BYTES = 34;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b);
        const int8_t *qs = (const int8_t *)(b + 2);
        for (int j = 0; j < 32; j++)
            y[j] = __fmul_rn((float)qs[j], d);
    }
};

/* Q2_K: 16 bytes of (scale | min << 4), 64 bytes of 2-bit levels, f16 d, f16 dmin. Value
 * 128n + 32j + 16part + l: level (q[32n + 16part + l] >> 2j) & 3, sub-block 8n + 2j + part. */
struct dq_q2_K {
    static const uint32_t QK = 256, BYTES = 84;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const uint8_t *sc = b, *q = b + 16;
        const float d = dq_f16(b + 80), dmin = dq_f16(b + 82);
        for (int n = 0; n < 2; n++, q += 32)
            for (int j = 0; j < 4; j++)
                for (int part = 0; part < 2; part++) {
                    uint32_t s = sc[8 * n + 2 * j + part];
                    float dl = __fmul_rn(d, (float)(int)(s & 0xf));
                    float ml = __fmul_rn(dmin, (float)(int)(s >> 4));
                    for (int l = 0; l < 16; l++) {
                        int v = (int)((q[16 * part + l] >> (2 * j)) & 3);
                        *y++ = __fsub_rn(__fmul_rn(dl, (float)v), ml);
                    }
                }
    }
};

/* The sixteen 6-bit scales of a Q3_K block, less 32 (st_wtype.c q3k_scale). */
__device__ __forceinline__ int dq_q3k_scale(const uint8_t *scales, int i)
{
    int low = i < 8 ? scales[i] & 0xf : scales[i - 8] >> 4;
    int high = (scales[8 + i % 4] >> (2 * (i / 4))) & 3;
    return (low | high << 4) - 32;
}

/* Q3_K: 32 bytes of high-bit mask, 64 of 2-bit levels, 12 of 6-bit scales, f16 d. */
struct dq_q3_K {
    static const uint32_t QK = 256, BYTES = 110;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const uint8_t *hm = b, *q = b + 32, *scales = b + 96;
        const float d = dq_f16(b + 108);
        for (int n = 0; n < 2; n++, q += 32)
            for (int j = 0; j < 4; j++) {
                const uint32_t m = 1u << (4 * n + j);
                for (int part = 0; part < 2; part++) {
                    float dl = __fmul_rn(d, (float)dq_q3k_scale(scales, 8 * n + 2 * j + part));
                    for (int l = 0; l < 16; l++) {
                        int e = 16 * part + l;
                        int v = (int)((q[e] >> (2 * j)) & 3) - ((hm[e] & m) ? 0 : 4);
                        *y++ = __fmul_rn(dl, (float)v);
                    }
                }
            }
    }
};

/* The j-th 6-bit (scale, min) pair of a Q4_K / Q5_K block (st_wtype.c k4_scale_min). */
__device__ __forceinline__ void dq_k4_scale_min(const uint8_t *q, int j, uint32_t *sc, uint32_t *mn)
{
    if (j < 4) {
        *sc = q[j] & 63u;
        *mn = q[j + 4] & 63u;
    } else {
        *sc = (q[j + 4] & 0xfu) | (uint32_t)(q[j - 4] >> 6) << 4;
        *mn = (uint32_t)(q[j + 4] >> 4) | (uint32_t)(q[j] >> 6) << 4;
    }
}

/* Q4_K: f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles (per 64 values, 32 bytes:
 * the low nibbles the first 32, the high ones the next). */
struct dq_q4_K {
    static const uint32_t QK = 256, BYTES = 144;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b), dmin = dq_f16(b + 2);
        const uint8_t *scales = b + 4, *q = b + 16;
        for (int g = 0; g < 4; g++, q += 32) {
            uint32_t sc, mn;
            dq_k4_scale_min(scales, 2 * g, &sc, &mn);
            const float d1 = __fmul_rn(d, (float)(int)sc), m1 = __fmul_rn(dmin, (float)(int)mn);
            dq_k4_scale_min(scales, 2 * g + 1, &sc, &mn);
            const float d2 = __fmul_rn(d, (float)(int)sc), m2 = __fmul_rn(dmin, (float)(int)mn);
            for (int l = 0; l < 32; l++)
                *y++ = __fsub_rn(__fmul_rn(d1, (float)(int)(q[l] & 0xf)), m1);
            for (int l = 0; l < 32; l++)
                *y++ = __fsub_rn(__fmul_rn(d2, (float)(int)(q[l] >> 4)), m2);
        }
    }
};

/* Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles (bits 2g and 2g + 1 of byte l:
 * values 64g + l and 64g + 32 + l). */
struct dq_q5_K {
    static const uint32_t QK = 256, BYTES = 176;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b), dmin = dq_f16(b + 2);
        const uint8_t *scales = b + 4, *qh = b + 16, *ql = b + 48;
        for (int g = 0; g < 4; g++, ql += 32) {
            const uint32_t u1 = 1u << (2 * g), u2 = 2u << (2 * g);
            uint32_t sc, mn;
            dq_k4_scale_min(scales, 2 * g, &sc, &mn);
            const float d1 = __fmul_rn(d, (float)(int)sc), m1 = __fmul_rn(dmin, (float)(int)mn);
            dq_k4_scale_min(scales, 2 * g + 1, &sc, &mn);
            const float d2 = __fmul_rn(d, (float)(int)sc), m2 = __fmul_rn(dmin, (float)(int)mn);
            for (int l = 0; l < 32; l++) {
                int v = (int)((ql[l] & 0xfu) + (qh[l] & u1 ? 16u : 0u));
                *y++ = __fsub_rn(__fmul_rn(d1, (float)v), m1);
            }
            for (int l = 0; l < 32; l++) {
                int v = (int)((uint32_t)(ql[l] >> 4) + (qh[l] & u2 ? 16u : 0u));
                *y++ = __fsub_rn(__fmul_rn(d2, (float)v), m2);
            }
        }
    }
};

/* Q6_K: 128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d; each value
 * (d * scale) * q, in that order. */
struct dq_q6_K {
    static const uint32_t QK = 256, BYTES = 210;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = dq_f16(b + 208);
        for (int h = 0; h < 2; h++, y += 128, ql += 64, qh += 32, sc += 8)
            for (int l = 0; l < 32; l++) {
                int is = l / 16;
                uint32_t a = ql[l], c = ql[l + 32], hb = qh[l];
                int q1 = (int)((a & 0xf) | (hb & 3) << 4) - 32;
                int q2 = (int)((c & 0xf) | ((hb >> 2) & 3) << 4) - 32;
                int q3 = (int)((a >> 4) | ((hb >> 4) & 3) << 4) - 32;
                int q4 = (int)((c >> 4) | ((hb >> 6) & 3) << 4) - 32;
                y[l] = __fmul_rn(__fmul_rn(d, (float)sc[is]), (float)q1);
                y[l + 32] = __fmul_rn(__fmul_rn(d, (float)sc[is + 2]), (float)q2);
                y[l + 64] = __fmul_rn(__fmul_rn(d, (float)sc[is + 4]), (float)q3);
                y[l + 96] = __fmul_rn(__fmul_rn(d, (float)sc[is + 6]), (float)q4);
            }
    }
};

struct dq_iq4_nl {
    static const uint32_t QK = 32, BYTES = 18;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b);
        const uint8_t *qs = b + 2;
        for (int j = 0; j < 16; j++) {
            uint32_t q = qs[j];
            y[j] = __fmul_rn(d, (float)dq_iq4nl[q & 0xf]);
            y[j + 16] = __fmul_rn(d, (float)dq_iq4nl[q >> 4]);
        }
    }
};

/* IQ4_XS: f16 d, 2 bytes of the scales' high bits, 4 of their low nibbles, 128 of codebook
 * indices (16 bytes per 32 values). */
struct dq_iq4_xs {
    static const uint32_t QK = 256, BYTES = 136;
    template <class Y> __device__ static void run(const uint8_t *b, Y y)
    {
        const float d = dq_f16(b);
        const uint32_t scales_h = (uint32_t)b[2] | (uint32_t)b[3] << 8;
        const uint8_t *scales_l = b + 4, *qs = b + 8;
        for (int ib = 0; ib < 8; ib++, y += 32, qs += 16) {
            int ls = (int)(((uint32_t)(scales_l[ib / 2] >> (4 * (ib % 2))) & 0xf) |
                           ((scales_h >> (2 * ib)) & 3u) << 4);
            const float dl = __fmul_rn(d, (float)(ls - 32));
            for (int j = 0; j < 16; j++) {
                uint32_t q = qs[j];
                y[j] = __fmul_rn(dl, (float)dq_iq4nl[q & 0xf]);
                y[j + 16] = __fmul_rn(dl, (float)dq_iq4nl[q >> 4]);
            }
        }
    }
};

/* The output of a decoder that sums value i times x[i] into *acc, in the decoder's order, each
 * step one fused multiply-add (__fmaf_rn: the order and the rounding are fixed). */
struct st_dq_ref {
    const float *x;
    float *acc;
    __device__ __forceinline__ void operator=(float v) const { *acc = __fmaf_rn(v, *x, *acc); }
};

struct st_dq_dot {
    const float *x;
    float *acc;
    __device__ __forceinline__ st_dq_ref operator[](int j) const { return st_dq_ref{x + j, acc}; }
    __device__ __forceinline__ st_dq_ref operator*() const { return st_dq_ref{x, acc}; }
    __device__ __forceinline__ st_dq_dot operator++(int)
    {
        st_dq_dot o = *this;
        x++;
        return o;
    }
    __device__ __forceinline__ st_dq_dot &operator+=(int n)
    {
        x += n;
        return *this;
    }
};

/* The output of a decoder that stores each value rounded to f16 (to nearest even; beyond the
 * f16 range: infinity), for the half tiles of the tensor-core products (st_dequant_cuda.cu). */
struct st_dq_href {
    __half *p;
    __device__ __forceinline__ void operator=(float v) const { *p = __float2half_rn(v); }
};

struct st_dq_h16 {
    __half *p;
    __device__ __forceinline__ st_dq_href operator[](int j) const { return st_dq_href{p + j}; }
    __device__ __forceinline__ st_dq_href operator*() const { return st_dq_href{p}; }
    __device__ __forceinline__ st_dq_h16 operator++(int)
    {
        st_dq_h16 o = *this;
        p++;
        return o;
    }
    __device__ __forceinline__ st_dq_h16 &operator+=(int n)
    {
        p += n;
        return *this;
    }
    __device__ __forceinline__ st_dq_h16 operator+(uint64_t n) const { return st_dq_h16{p + n}; }
};

#endif /* ST_WTYPE_CUDA_CUH */
