/*
 * st_qmv_cuda.cu - matrix-vector products of quantized weights on the GPU, the weights read in
 * their file type and dequantized in registers (issue 14, section 1: the decode products):
 * Q8_0, Q4_K and Q6_K, in ggml's block layouts (docs/ENGINE.md, "Weight types"). Not yet used
 * by the forward pass: the CUDA backend runs strata-hybrid on bf16 weights; these kernels are
 * its first piece on the way to the op table (docs/ENGINE.md, "CUDA backend").
 *
 * Invariants:
 * 1. y[r] = sum over k of W[r][k] * x[k] for W [rows][cols] (rows of cols / block blocks, packed
 *    as in the file), x and y f32 in device memory; x 16-byte aligned.
 * 2. Each warp computes R rows; every lane reads the x values it needs once per block and uses
 *    them for the R rows (the x traffic is 1/R of a warp per row), the weights once.
 * 3. Determinism: each lane sums its elements in block order, the warp reduces with a fixed
 *    shuffle tree, no atomics: the same inputs give the same bits. The order is not the CPU's
 *    (the results agree within float rounding; tests/gpu/test_gpu_qmv.c).
 */
#include <stdint.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "st_engine_int.h"
#include "st_wtype.h"
}

#define QMV_R 4        /* rows per warp */
#define QMV_WARPS 8    /* warps per block */
#define FULLMASK 0xffffffffu

__device__ __forceinline__ float qmv_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(FULLMASK, v, o);
    return v;
}

__device__ __forceinline__ float h2f(const uint8_t *p)
{
    return __half2float(*(const __half *)p);
}

/* Q8_0: 34-byte blocks of 32 (f16 d, 32 int8). A warp covers 4 blocks per step, 8 lanes per
 * block, 4 values per lane. */
__global__ void k_qmv_q8_0(const uint8_t *W, uint64_t row_bytes, uint32_t rows, uint32_t nb,
                           const float *x, float *y)
{
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    uint32_t r0 = warp * QMV_R;
    if (r0 >= rows)
        return;
    uint32_t nr = rows - r0 < QMV_R ? rows - r0 : QMV_R;
    float acc[QMV_R] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t sub = lane >> 3, e = (lane & 7) * 4;
    for (uint32_t b = sub; b < nb; b += 4) {
        float4 xv = *(const float4 *)(x + (uint64_t)b * 32 + e);
#pragma unroll
        for (int r = 0; r < QMV_R; r++) {
            if ((uint32_t)r < nr) {
                const uint8_t *blk = W + (uint64_t)(r0 + r) * row_bytes + (uint64_t)b * 34;
                float d = h2f(blk);
                uint16_t lo = *(const uint16_t *)(blk + 2 + e), hi = *(const uint16_t *)(blk + 4 + e);
                float s = (float)(int8_t)(lo & 0xff) * xv.x;
                s += (float)(int8_t)(lo >> 8) * xv.y;
                s += (float)(int8_t)(hi & 0xff) * xv.z;
                s += (float)(int8_t)(hi >> 8) * xv.w;
                acc[r] += d * s;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QMV_R; r++) {
        float v = qmv_warp_sum(acc[r]);
        if (lane == 0 && (uint32_t)r < nr)
            y[r0 + r] = v;
    }
}

/* The 6-bit scale and min of sub-block j of a Q4_K block (ggml's get_scale_min_k4). */
__device__ __forceinline__ void q4k_scale(const uint8_t *q, int j, float *sc, float *m)
{
    if (j < 4) {
        *sc = (float)(q[j] & 63);
        *m = (float)(q[j + 4] & 63);
    } else {
        *sc = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *m = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* Q4_K: 144-byte blocks of 256 (f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles). A
 * warp takes one block per step: lane l reads 4 bytes of group g = l / 8, the values
 * 64g + 4(l % 8) + 0..3 (low nibbles, sub-block 2g) and 32 further (high, sub-block 2g + 1). */
__global__ void k_qmv_q4_k(const uint8_t *W, uint64_t row_bytes, uint32_t rows, uint32_t nb,
                           const float *x, float *y)
{
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    uint32_t r0 = warp * QMV_R;
    if (r0 >= rows)
        return;
    uint32_t nr = rows - r0 < QMV_R ? rows - r0 : QMV_R;
    float acc[QMV_R] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t g = lane >> 3, k = (lane & 7) * 4;
    for (uint32_t b = 0; b < nb; b++) {
        const float *xb = x + (uint64_t)b * 256 + 64 * g + k;
        float4 xl = *(const float4 *)xb, xh = *(const float4 *)(xb + 32);
        float sl = xl.x + xl.y + xl.z + xl.w, sh = xh.x + xh.y + xh.z + xh.w;
#pragma unroll
        for (int r = 0; r < QMV_R; r++) {
            if ((uint32_t)r < nr) {
                const uint8_t *blk = W + (uint64_t)(r0 + r) * row_bytes + (uint64_t)b * 144;
                float d = h2f(blk), dmin = h2f(blk + 2);
                float sc1, m1, sc2, m2;
                q4k_scale(blk + 4, (int)(2 * g), &sc1, &m1);
                q4k_scale(blk + 4, (int)(2 * g + 1), &sc2, &m2);
                uint32_t q = *(const uint32_t *)(blk + 16 + 32 * g + k);
                float ql = (float)(q & 0xF) * xl.x;
                ql += (float)((q >> 8) & 0xF) * xl.y;
                ql += (float)((q >> 16) & 0xF) * xl.z;
                ql += (float)((q >> 24) & 0xF) * xl.w;
                float qh = (float)((q >> 4) & 0xF) * xh.x;
                qh += (float)((q >> 12) & 0xF) * xh.y;
                qh += (float)((q >> 20) & 0xF) * xh.z;
                qh += (float)((q >> 28) & 0xF) * xh.w;
                acc[r] += d * sc1 * ql - dmin * m1 * sl;
                acc[r] += d * sc2 * qh - dmin * m2 * sh;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QMV_R; r++) {
        float v = qmv_warp_sum(acc[r]);
        if (lane == 0 && (uint32_t)r < nr)
            y[r0 + r] = v;
    }
}

/* Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
 * scales, f16 d). Per half n of a block, lane l makes the values 128n + l + {0, 32, 64, 96}. */
__global__ void k_qmv_q6_k(const uint8_t *W, uint64_t row_bytes, uint32_t rows, uint32_t nb,
                           const float *x, float *y)
{
    uint32_t warp = (blockIdx.x * blockDim.x + threadIdx.x) >> 5, lane = threadIdx.x & 31;
    uint32_t r0 = warp * QMV_R;
    if (r0 >= rows)
        return;
    uint32_t nr = rows - r0 < QMV_R ? rows - r0 : QMV_R;
    float acc[QMV_R] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t is = lane / 16;
    for (uint32_t b = 0; b < nb; b++) {
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const float *xb = x + (uint64_t)b * 256 + 128 * n + lane;
            float x0 = xb[0], x1 = xb[32], x2 = xb[64], x3 = xb[96];
#pragma unroll
            for (int r = 0; r < QMV_R; r++) {
                if ((uint32_t)r < nr) {
                    const uint8_t *blk = W + (uint64_t)(r0 + r) * row_bytes + (uint64_t)b * 210;
                    const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
                    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * n;
                    float d = h2f(blk + 208);
                    uint8_t a = ql[lane], c = ql[lane + 32], h = qh[lane];
                    int q1 = (int)((a & 0xF) | (((h >> 0) & 3) << 4)) - 32;
                    int q2 = (int)((c & 0xF) | (((h >> 2) & 3) << 4)) - 32;
                    int q3 = (int)((a >> 4) | (((h >> 4) & 3) << 4)) - 32;
                    int q4 = (int)((c >> 4) | (((h >> 6) & 3) << 4)) - 32;
                    float s = (float)sc[is + 0] * (float)q1 * x0;
                    s += (float)sc[is + 2] * (float)q2 * x1;
                    s += (float)sc[is + 4] * (float)q3 * x2;
                    s += (float)sc[is + 6] * (float)q4 * x3;
                    acc[r] += d * s;
                }
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QMV_R; r++) {
        float v = qmv_warp_sum(acc[r]);
        if (lane == 0 && (uint32_t)r < nr)
            y[r0 + r] = v;
    }
}

extern "C" int st_cuda_qmv_supported(uint32_t wtype)
{
    return wtype == ST_GGML_Q8_0 || wtype == ST_GGML_Q4_K || wtype == ST_GGML_Q6_K;
}

extern "C" int st_cuda_qmv(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols,
                           const float *x, float *y, void *stream)
{
    const st_wtype *t = st_wtype_get(wtype);
    if (!t || !st_cuda_qmv_supported(wtype))
        return st_error_set(ST_EINVAL, "cuda qmv: no kernel for weight type %u (%s): Q8_0, Q4_K "
                            "and Q6_K have one", wtype, t ? t->name : "unknown");
    if (!rows || !cols || cols % t->block)
        return st_error_set(ST_EINVAL, "cuda qmv: %u x %u: the columns must be a positive "
                            "multiple of %s's block of %u", rows, cols, t->name, t->block);
    if (!w || !x || !y || ((uintptr_t)x & 15))
        return st_error_set(ST_EINVAL, "cuda qmv: NULL or misaligned operand (x must be 16-byte aligned)");
    uint32_t nb = cols / t->block;
    uint64_t row_bytes = (uint64_t)nb * t->bytes;
    uint32_t warps = (rows + QMV_R - 1) / QMV_R;
    dim3 grid((warps + QMV_WARPS - 1) / QMV_WARPS), block(32 * QMV_WARPS);
    cudaStream_t st = (cudaStream_t)stream;
    const uint8_t *W = (const uint8_t *)w;
    if (wtype == ST_GGML_Q8_0)
        k_qmv_q8_0<<<grid, block, 0, st>>>(W, row_bytes, rows, nb, x, y);
    else if (wtype == ST_GGML_Q4_K)
        k_qmv_q4_k<<<grid, block, 0, st>>>(W, row_bytes, rows, nb, x, y);
    else
        k_qmv_q6_k<<<grid, block, 0, st>>>(W, row_bytes, rows, nb, x, y);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return st_error_set(ST_EIO, "cuda qmv: launch: %s", cudaGetErrorString(e));
    return 0;
}
