/*
 * st_qmv_cuda.cu - matrix-vector products on the GPU for every weight type of the weight-type
 * table (issue 14, section 1: the decode products), the weights read in their file type and
 * dequantized in registers. The CUDA operation table (st_ops_cuda.cu) runs every one-token
 * product through st_cuda_qmv_n, the products that share an input in one launch;
 * st_cuda_qmv_i8 is not used by the forward pass (docs/ENGINE.md, "Quantized products on the
 * GPU").
 *
 * Invariants:
 * 1. y[r] = sum over k of W[r][k] * x[k] for W [rows][cols] (rows of cols / block blocks, packed
 *    as in the file), x and y f32 in device memory; x 16-byte aligned, W 16-byte aligned.
 * 2. Q8_0, Q4_K and Q6_K have kernels of their own: a CTA of S warps (own_warps: no more than
 *    the row has steps for) computes QMV_R rows, its warps take the row's blocks in turn, every lane reads the x values of its part of a block
 *    once and uses them for the QMV_R rows (the x traffic is 1/QMV_R per row), the weights once;
 *    the warps' sums are added in warp order.
 * 3. Determinism: each lane sums its elements in block order with written-out fused
 *    multiply-adds (__fmaf_rn; the engine is compiled with --fmad=false), the warp reduces with
 *    a fixed shuffle tree, the CTA adds its warps in order, no atomics: the same inputs give the
 *    same bits. The order is not the CPU's (the results agree within float rounding;
 *    tests/gpu/test_gpu_qmv.c).
 * 4. One launch computes up to ST_CUDA_QMV_JOBS products of one type and column count over the
 *    same x (st_cuda_qmv_n): each product has CTAs of its own, so a row's result, and its bits,
 *    do not depend on which products share the launch.
 * 5. F32, F16 and BF16 rows of whole 16-byte words take the wide kernel (a warp per row, 16
 *    bytes per lane per step); every other type, and those rows otherwise, the decoder-driven
 *    kernel, whose values are those of st_wtype_cuda.cuh's decoders (the CPU's scalar
 *    dequantization, bit for bit) multiplied into the sum as they are made.
 * 7. The integer form of Q4_K (st_cuda_qmv_i8, and the forward pass with STRATA_CUDA_QMV_I8=1:
 *    st_cuda_qmv_n_i8, st_cuda_qmv_swiglu_i8): the activations quantized to Q8_K by
 *    k_quant_q8_k, which writes the CPU's integer path's bytes exactly; each lane's block dots
 *    are exact integers (as the CPU's), so the result differs from the CPU's integer path only by
 *    the order of the scaled sums. Deterministic as invariant 3.
 * 6. The paired form (st_cuda_qmv_swiglu; Q8_0, Q4_K, Q6_K): a CTA computes QMV_R rows of the
 *    gate weights and the same rows of the up weights over the same x (its x read once for
 *    both), each row's sum exactly as invariants 2 and 3 make it alone, and writes
 *    y = silu(gate row) * up row with the operation table's swiglu expression: the bits of the
 *    two products followed by the swiglu kernel, in one launch.
 */
#include <stdint.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "st_engine_int.h"
#include "st_wtype.h"
}
#include "st_launch_cuda.cuh"
#include "st_reduce_cuda.cuh"
#include "st_wtype_cuda.cuh"

#define QMV_R 4        /* rows per CTA (each of its warps computes all of them) */
/* warps per CTA at most (each takes every S-th step of the row's blocks): 8 for Q8_0 and Q6_K,
 * 4 for Q4_K, the faster of the two for each on wide rows (docs/BENCHMARKS.md, "Quantized
 * products on the GPU"); fewer for short rows (own_warps) */
#define QMV_S_MAX 8
#define QMV_GEN_WARPS 4 /* warps per CTA of the decoder-driven and the wide kernels */

/* The products of one launch (invariant 4): job j's rows are computed by the CTAs
 * start[j] .. start[j + 1] - 1, its weights at w[j], its results to y[j]. Passed by value (in
 * the kernel's parameter space). */
struct qmv_jobs {
    const uint8_t *up; /* the paired form (invariant 6): job 0's up weights; NULL otherwise */
    const uint8_t *w[ST_CUDA_QMV_JOBS];
    float *y[ST_CUDA_QMV_JOBS];
    uint32_t rows[ST_CUDA_QMV_JOBS];
    uint32_t start[ST_CUDA_QMV_JOBS + 1];
    uint32_t n;
};

/* A CTA's job: its weights W, row count rows, output y, and the CTA's index within the job. */
struct qmv_job_of {
    const uint8_t *W;
    float *y;
    uint32_t rows, cta;
};

__device__ __forceinline__ qmv_job_of qmv_job(const qmv_jobs &P)
{
    uint32_t j = 0;
    while (j + 1 < P.n && blockIdx.x >= P.start[j + 1])
        j++;
    return qmv_job_of{P.w[j], P.y[j], P.rows[j], blockIdx.x - P.start[j]};
}

/* The kernels of QMV_R rows per CTA: W, y, r0 (the CTA's first row) and nr (its row count). */
#define QMV_JOB(P)                                                                             \
    qmv_job_of jb_ = qmv_job(P);                                                               \
    const uint8_t *W = jb_.W;                                                                  \
    float *y = jb_.y;                                                                          \
    uint32_t r0 = jb_.cta * QMV_R, nr = jb_.rows - r0 < QMV_R ? jb_.rows - r0 : QMV_R


/* An integer below 2^23 as a float, exactly, on the full-rate pipes (an I2F conversion runs at a
 * fraction of the FMA rate): the bits of 2^23 + v, less 2^23. */
__device__ __forceinline__ float u2f(uint32_t v)
{
    return __int_as_float(0x4B000000u | v) - 8388608.0f;
}

/* The signed byte whose bits are b (0..255), exactly. */
__device__ __forceinline__ float i8f(uint32_t b)
{
    return __int_as_float(0x4B000000u | (b ^ 0x80u)) - 8388736.0f;
}

__device__ __forceinline__ float h2f(const uint8_t *p)
{
    return __half2float(*(const __half *)p);
}

__device__ __forceinline__ float h2f_bits(uint32_t bits16)
{
    __half_raw r;
    r.x = (unsigned short)bits16;
    return __half2float(__half(r));
}

/* The end of every kernel: each warp's sums of the R rows, then the CTA's warps added in warp
 * order by thread r (a fixed order: invariant 3). */
template <int S, int PAIR>
__device__ __forceinline__ void qmv_finish(float *acc, uint32_t r0, uint32_t nr, float *y)
{
    __shared__ float part[QMV_S_MAX][QMV_R * (1 + PAIR)];
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
#pragma unroll
    for (int r = 0; r < QMV_R * (1 + PAIR); r++) {
        float v = st_warp_sum(acc[r]);
        if (lane == 0)
            part[w][r] = v;
    }
    __syncthreads();
    if (threadIdx.x < nr) {
        float t = 0.0f;
        for (int k = 0; k < S; k++)
            t += part[k][threadIdx.x];
        if (PAIR) { /* invariant 6: the swiglu of the gate row and the up row, as k_elem's */
            float u = 0.0f;
            for (int k = 0; k < S; k++)
                u += part[k][QMV_R + threadIdx.x];
            t = t / (1.0f + expf(-t)) * u;
        }
        y[r0 + threadIdx.x] = t;
    }
}

/* The weights of a CTA's virtual row r (0 .. QMV_R (1 + PAIR) - 1): the job's rows, then (the
 * paired form) the same rows of the up weights. */
#define QMV_ROWS (QMV_R * (1 + PAIR))
#define QMV_W(r) ((r) < QMV_R ? W : P.up)
#define QMV_ROW(r) (r0 + ((r) % QMV_R))

/* Q8_0: 34-byte blocks of 32 (f16 d, 32 int8). A warp covers 4 blocks per step, 8 lanes per
 * block, 4 values per lane. */
template <int S, int PAIR>
__global__ void k_qmv_q8_0(qmv_jobs P, uint64_t row_bytes, uint32_t nb,
                           const float *x)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    QMV_JOB(P);
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float acc[QMV_ROWS];
#pragma unroll
    for (int r = 0; r < QMV_ROWS; r++)
        acc[r] = 0.0f;
    uint32_t e = (lane & 7) * 4;
    for (uint32_t b = 4 * w + (lane >> 3); b < nb; b += 4 * S) {
        float4 xv = *(const float4 *)(x + (uint64_t)b * 32 + e);
#pragma unroll
        for (int r = 0; r < QMV_ROWS; r++) {
            if ((uint32_t)(r % QMV_R) < nr) {
                const uint8_t *blk = QMV_W(r) + (uint64_t)QMV_ROW(r) * row_bytes + (uint64_t)b * 34;
                float d = h2f(blk);
                uint16_t lo = *(const uint16_t *)(blk + 2 + e), hi = *(const uint16_t *)(blk + 4 + e);
                float s = i8f(lo & 0xff) * xv.x;
                s = __fmaf_rn(i8f(lo >> 8), xv.y, s);
                s = __fmaf_rn(i8f(hi & 0xff), xv.z, s);
                s = __fmaf_rn(i8f(hi >> 8), xv.w, s);
                acc[r] = __fmaf_rn(d, s, acc[r]);
            }
        }
    }
    qmv_finish<S, PAIR>(acc, r0, nr, y);
}

/* Byte k (0..11) of a Q4_K block's 12 scale bytes, held in head.y, head.z, head.w (no local
 * array). The 6-bit scale and min of sub-block j follow ggml's get_scale_min_k4. */
__device__ __forceinline__ uint32_t q4k_byte(uint4 head, uint32_t k)
{
    uint32_t wd = k < 4 ? head.y : k < 8 ? head.z : head.w;
    return (wd >> (8 * (k & 3))) & 0xff;
}

__device__ __forceinline__ void q4k_scale_w(uint4 head, uint32_t j, float *sc, float *m)
{
    if (j < 4) {
        *sc = u2f(q4k_byte(head, j) & 63);
        *m = u2f(q4k_byte(head, j + 4) & 63);
    } else {
        *sc = u2f((q4k_byte(head, j + 4) & 0xF) | ((q4k_byte(head, j - 4) >> 6) << 4));
        *m = u2f((q4k_byte(head, j + 4) >> 4) | ((q4k_byte(head, j) >> 6) << 4));
    }
}

/* Q4_K: 144-byte blocks of 256 (f16 d, f16 dmin, 12 bytes of scales, 128 bytes of nibbles),
 * 16-byte aligned. A warp covers 4 blocks per step, 8 lanes per block: lane part p reads the
 * block's 16-byte head and 16 bytes of nibbles, group g = p / 2, the values
 * 64g + 16 (p % 2) + 0..15 (low nibbles, sub-block 2g) and those 32 further (high, 2g + 1). */
template <int S, int PAIR>
__global__ void k_qmv_q4_k(qmv_jobs P, uint64_t row_bytes, uint32_t nb,
                           const float *x)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    QMV_JOB(P);
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float acc[QMV_ROWS];
#pragma unroll
    for (int r = 0; r < QMV_ROWS; r++)
        acc[r] = 0.0f;
    uint32_t p = lane & 7, g = p >> 1, off = 64 * g + 16 * (p & 1);
    for (uint32_t b = 4 * w + (lane >> 3); b < nb; b += 4 * S) {
        const float4 *xb = (const float4 *)(x + (uint64_t)b * 256 + off);
        float4 xl[4], xh[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            xl[i] = xb[i];
            xh[i] = xb[8 + i];
        }
        float sl = 0.0f, sh = 0.0f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            sl += xl[i].x + xl[i].y + xl[i].z + xl[i].w;
            sh += xh[i].x + xh[i].y + xh[i].z + xh[i].w;
        }
#pragma unroll
        for (int r = 0; r < QMV_ROWS; r++) {
            if ((uint32_t)(r % QMV_R) < nr) {
                const uint8_t *blk = QMV_W(r) + (uint64_t)QMV_ROW(r) * row_bytes + (uint64_t)b * 144;
                uint4 head = *(const uint4 *)blk;
                uint4 qv = *(const uint4 *)(blk + 16 + 32 * g + 16 * (p & 1));
                float d = h2f_bits(head.x & 0xffff), dmin = h2f_bits(head.x >> 16);
                float sc1, m1, sc2, m2;
                q4k_scale_w(head, 2 * g, &sc1, &m1);
                q4k_scale_w(head, 2 * g + 1, &sc2, &m2);
                uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
                float ql = 0.0f, qh = 0.0f;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    uint32_t q = qw[i];
                    ql = __fmaf_rn(u2f(q & 0xF), xl[i].x, ql);
                    ql = __fmaf_rn(u2f((q >> 8) & 0xF), xl[i].y, ql);
                    ql = __fmaf_rn(u2f((q >> 16) & 0xF), xl[i].z, ql);
                    ql = __fmaf_rn(u2f((q >> 24) & 0xF), xl[i].w, ql);
                    qh = __fmaf_rn(u2f((q >> 4) & 0xF), xh[i].x, qh);
                    qh = __fmaf_rn(u2f((q >> 12) & 0xF), xh[i].y, qh);
                    qh = __fmaf_rn(u2f((q >> 20) & 0xF), xh[i].z, qh);
                    qh = __fmaf_rn(u2f(q >> 28), xh[i].w, qh);
                }
                acc[r] = __fmaf_rn(d * sc1, ql, acc[r]);
                acc[r] = __fmaf_rn(-dmin * m1, sl, acc[r]);
                acc[r] = __fmaf_rn(d * sc2, qh, acc[r]);
                acc[r] = __fmaf_rn(-dmin * m2, sh, acc[r]);
            }
        }
    }
    qmv_finish<S, PAIR>(acc, r0, nr, y);
}

/* Q4_K weights against activations quantized as the CPU's integer path does (Q8_K: 292-byte
 * blocks of an f32 d, 256 int8 and 16 int16 sums of 16; st_wtype_qdot.c qact_q8_K), the lanes
 * as in k_qmv_q4_k: per lane and row 8 dp4a of 4 nibbles and 4 activation bytes (16 low values
 * of sub-block 2g, 16 high of 2g + 1), the scale and min products exact integers, then two
 * fused multiply-adds by f16(d) * x.d and f16(dmin) * x.d (invariant 7). */
__device__ __forceinline__ int q4k_scale_i(uint4 head, uint32_t j, int *m)
{
    if (j < 4) {
        *m = (int)(q4k_byte(head, j + 4) & 63);
        return (int)(q4k_byte(head, j) & 63);
    }
    *m = (int)((q4k_byte(head, j + 4) >> 4) | ((q4k_byte(head, j) >> 6) << 4));
    return (int)((q4k_byte(head, j + 4) & 0xF) | ((q4k_byte(head, j - 4) >> 6) << 4));
}

template <int S, int PAIR>
__global__ void k_qmv_q4_k_i8(qmv_jobs P, uint64_t row_bytes, uint32_t nb, const uint8_t *xq)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    QMV_JOB(P);
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float acc[QMV_ROWS];
#pragma unroll
    for (int r = 0; r < QMV_ROWS; r++)
        acc[r] = 0.0f;
    uint32_t p = lane & 7, g = p >> 1, off = 64 * g + 16 * (p & 1);
    for (uint32_t b = 4 * w + (lane >> 3); b < nb; b += 4 * S) {
        const uint8_t *xb = xq + (uint64_t)b * 292;
        float dx = *(const float *)xb;
        const int *xl = (const int *)(xb + 4 + off), *xh = (const int *)(xb + 4 + off + 32);
        int al[4], ah[4];
#pragma unroll
        for (int i = 0; i < 4; i++) {
            al[i] = xl[i];
            ah[i] = xh[i];
        }
        const int16_t *bs = (const int16_t *)(xb + 260);
        int bl = bs[4 * g + (p & 1)], bh = bs[4 * g + 2 + (p & 1)];
#pragma unroll
        for (int r = 0; r < QMV_ROWS; r++) {
            if ((uint32_t)(r % QMV_R) < nr) {
                const uint8_t *blk = QMV_W(r) + (uint64_t)QMV_ROW(r) * row_bytes + (uint64_t)b * 144;
                uint4 head = *(const uint4 *)blk;
                uint4 qv = *(const uint4 *)(blk + 16 + 32 * g + 16 * (p & 1));
                int m1, m2, sc1 = q4k_scale_i(head, 2 * g, &m1), sc2 = q4k_scale_i(head, 2 * g + 1, &m2);
                uint32_t qw[4] = {qv.x, qv.y, qv.z, qv.w};
                int sl = 0, sh = 0;
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    sl = __dp4a((int)(qw[i] & 0x0F0F0F0Fu), al[i], sl);
                    sh = __dp4a((int)((qw[i] >> 4) & 0x0F0F0F0Fu), ah[i], sh);
                }
                float d = h2f_bits(head.x & 0xffff) * dx, dm = h2f_bits(head.x >> 16) * dx;
                acc[r] = __fmaf_rn(d, __int2float_rn(sc1 * sl + sc2 * sh), acc[r]);
                acc[r] = __fmaf_rn(-dm, __int2float_rn(m1 * bl + m2 * bh), acc[r]);
            }
        }
    }
    qmv_finish<S, PAIR>(acc, r0, nr, y);
}

/* The CPU's qact_q8_K on the GPU, byte for byte (invariant 7): a warp per block of 256, lane l
 * its values 8l .. 8l + 7; the value of largest magnitude (the first such: ties go to the lower
 * index), iscale = -127 / max, q = min(127, round-half-even(iscale * x)), the sums of 16 (lanes
 * 2k and 2k + 1), d = 1 / iscale; an all-zero block all zeros. */
__global__ void k_quant_q8_k(const float *x, uint32_t nb, uint8_t *xq)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint32_t lane = threadIdx.x & 31, b = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= nb)
        return;
    const float *xb = x + (uint64_t)b * 256 + 8 * lane;
    float v[8];
    float amax = 0.0f, mx = 0.0f;
    uint32_t at = 0xffffffffu;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        v[i] = xb[i];
        float a = fabsf(v[i]);
        if (a > amax) {
            amax = a;
            mx = v[i];
            at = 8 * lane + i;
        }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        float oa = __shfl_xor_sync(0xffffffffu, amax, o), om = __shfl_xor_sync(0xffffffffu, mx, o);
        uint32_t ot = __shfl_xor_sync(0xffffffffu, at, o);
        if (oa > amax || (oa == amax && ot < at)) {
            amax = oa;
            mx = om;
            at = ot;
        }
    }
    uint8_t *yb = xq + (uint64_t)b * 292;
    int q[8], sum = 0;
    float iscale = amax != 0.0f ? -127.0f / mx : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        int t = amax != 0.0f ? __float2int_rn(iscale * v[i]) : 0;
        q[i] = t < 127 ? t : 127;
        sum += q[i];
        yb[4 + 8 * lane + i] = (uint8_t)(int8_t)q[i];
    }
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    if (!(lane & 1))
        ((int16_t *)(yb + 260))[lane >> 1] = (int16_t)sum;
    if (lane == 0)
        *(float *)yb = amax != 0.0f ? 1.0f / iscale : 0.0f;
}

/* Q6_K: 210-byte blocks of 256 (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8
 * scales, f16 d). A warp takes one block per step; per half n, lane l makes the values
 * 128n + l + {0, 32, 64, 96}. */
template <int S, int PAIR>
__global__ void k_qmv_q6_k(qmv_jobs P, uint64_t row_bytes, uint32_t nb,
                           const float *x)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    QMV_JOB(P);
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float acc[QMV_ROWS];
#pragma unroll
    for (int r = 0; r < QMV_ROWS; r++)
        acc[r] = 0.0f;
    uint32_t is = lane / 16;
    for (uint32_t b = w; b < nb; b += S) {
#pragma unroll
        for (int n = 0; n < 2; n++) {
            const float *xb = x + (uint64_t)b * 256 + 128 * n + lane;
            float x0 = xb[0], x1 = xb[32], x2 = xb[64], x3 = xb[96];
#pragma unroll
            for (int r = 0; r < QMV_ROWS; r++) {
                if ((uint32_t)(r % QMV_R) < nr) {
                    const uint8_t *blk = QMV_W(r) + (uint64_t)QMV_ROW(r) * row_bytes + (uint64_t)b * 210;
                    const uint8_t *ql = blk + 64 * n, *qh = blk + 128 + 32 * n;
                    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * n;
                    float d = h2f(blk + 208);
                    uint8_t a = ql[lane], c = ql[lane + 32], h = qh[lane];
                    float q1 = u2f((a & 0xFu) | ((h & 3u) << 4)) - 32.0f;
                    float q2 = u2f((c & 0xFu) | (((h >> 2) & 3u) << 4)) - 32.0f;
                    float q3 = u2f((uint32_t)(a >> 4) | (((h >> 4) & 3u) << 4)) - 32.0f;
                    float q4 = u2f((uint32_t)(c >> 4) | (((h >> 6) & 3u) << 4)) - 32.0f;
                    float s = i8f((uint8_t)sc[is + 0]) * q1 * x0;
                    s = __fmaf_rn(i8f((uint8_t)sc[is + 2]) * q2, x1, s);
                    s = __fmaf_rn(i8f((uint8_t)sc[is + 4]) * q3, x2, s);
                    s = __fmaf_rn(i8f((uint8_t)sc[is + 6]) * q4, x3, s);
                    acc[r] = __fmaf_rn(d, s, acc[r]);
                }
            }
        }
    }
    qmv_finish<S, PAIR>(acc, r0, nr, y);
}

/* Q8_0 weights against activations quantized as the CPU's integer path does (st_qdot_get:
 * 36-byte blocks of an f32 d and 32 int8): per lane one dp4a of 4 weight bytes and 4 activation
 * bytes, scaled by both blocks' d. The lanes as in k_qmv_q8_0. */
template <int S>
__global__ void k_qmv_q8_0_i8(qmv_jobs P, uint64_t row_bytes, uint32_t nb, const uint8_t *xq)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    QMV_JOB(P);
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    float acc[QMV_R] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint32_t e = (lane & 7) * 4;
    for (uint32_t b = 4 * w + (lane >> 3); b < nb; b += 4 * S) {
        const uint8_t *xb = xq + (uint64_t)b * 36;
        float dx = *(const float *)xb;
        int xv = *(const int *)(xb + 4 + e);
#pragma unroll
        for (int r = 0; r < QMV_R; r++) {
            if ((uint32_t)r < nr) {
                const uint8_t *blk = W + (uint64_t)(r0 + r) * row_bytes + (uint64_t)b * 34;
                float d = h2f(blk) * dx;
                uint32_t lo = *(const uint16_t *)(blk + 2 + e), hi = *(const uint16_t *)(blk + 4 + e);
                int sumi = __dp4a((int)(lo | (hi << 16)), xv, 0);
                acc[r] = __fmaf_rn(d, __int2float_rn(sumi), acc[r]);
            }
        }
    }
    qmv_finish<S, 0>(acc, r0, nr, y);
}

/* Every other type (invariant 5): a decoder of st_wtype_cuda.cuh per block, its values
 * multiplied into the sum as they are made. L lanes (a power of two, at most 32) share a row,
 * lane l of them taking blocks l, l + L, ...; the L sums are added by a fixed shuffle tree. */
template <class D>
__global__ void __launch_bounds__(32 * QMV_GEN_WARPS)
    k_qmv_gen(qmv_jobs P, uint64_t row_bytes, uint32_t nb, uint32_t L, const float *x)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    qmv_job_of jb = qmv_job(P);
    uint32_t lane = threadIdx.x & 31, per_warp = 32 / L, sub = lane & (L - 1);
    uint64_t r = ((uint64_t)jb.cta * QMV_GEN_WARPS + (threadIdx.x >> 5)) * per_warp + lane / L;
    float acc = 0.0f;
    if (r < jb.rows) {
        const uint8_t *row = jb.W + (uint64_t)r * row_bytes;
        for (uint32_t b = sub; b < nb; b += L)
            D::run(row + (uint64_t)b * D::BYTES, st_dq_dot{x + (uint64_t)b * D::QK, &acc});
    }
    for (uint32_t o = L / 2; o > 0; o >>= 1)
        acc += __shfl_xor_sync(0xffffffffu, acc, o);
    if (sub == 0 && r < jb.rows)
        jb.y[r] = acc;
}

/* F32, F16 and BF16 rows of a multiple of 16 bytes (invariant 5): a warp per row, each lane
 * 16 bytes of it per step (4 or 8 values, in order), the warp's sums by st_warp_sum. */
__device__ __forceinline__ float wide_val(uint32_t word, int hi, int kind)
{
    uint32_t h = hi ? word >> 16 : word & 0xffffu;
    if (kind == 2)
        return __uint_as_float(h << 16);
    return h2f_bits(h);
}

template <int KIND> /* 0: F32, 1: F16, 2: BF16 */
__global__ void __launch_bounds__(32 * QMV_GEN_WARPS)
    k_qmv_wide(qmv_jobs P, uint64_t row_bytes, uint32_t cols, const float *x)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    qmv_job_of jb = qmv_job(P);
    uint32_t lane = threadIdx.x & 31, r = jb.cta * QMV_GEN_WARPS + (threadIdx.x >> 5);
    if (r >= jb.rows)
        return; /* the whole warp: no block-wide synchronisation follows */
    const uint4 *row = (const uint4 *)(jb.W + (uint64_t)r * row_bytes);
    const uint32_t per = KIND == 0 ? 4 : 8, n16 = cols / per;
    float acc = 0.0f;
    for (uint32_t i = lane; i < n16; i += 32) {
        uint4 v = row[i];
        const float4 *xv = (const float4 *)(x + (uint64_t)i * per);
        if (KIND == 0) {
            float4 a = xv[0];
            acc = __fmaf_rn(__uint_as_float(v.x), a.x, acc);
            acc = __fmaf_rn(__uint_as_float(v.y), a.y, acc);
            acc = __fmaf_rn(__uint_as_float(v.z), a.z, acc);
            acc = __fmaf_rn(__uint_as_float(v.w), a.w, acc);
        } else {
            float4 a = xv[0], b = xv[1];
            acc = __fmaf_rn(wide_val(v.x, 0, KIND), a.x, acc);
            acc = __fmaf_rn(wide_val(v.x, 1, KIND), a.y, acc);
            acc = __fmaf_rn(wide_val(v.y, 0, KIND), a.z, acc);
            acc = __fmaf_rn(wide_val(v.y, 1, KIND), a.w, acc);
            acc = __fmaf_rn(wide_val(v.z, 0, KIND), b.x, acc);
            acc = __fmaf_rn(wide_val(v.z, 1, KIND), b.y, acc);
            acc = __fmaf_rn(wide_val(v.w, 0, KIND), b.z, acc);
            acc = __fmaf_rn(wide_val(v.w, 1, KIND), b.w, acc);
        }
    }
    acc = st_warp_sum(acc);
    if (lane == 0)
        jb.y[r] = acc;
}

static int launched(const char *what)
{
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return st_error_set(ST_EIO, "cuda qmv: %s launch: %s", what, cudaGetErrorString(e));
    return 0;
}

extern "C" int st_cuda_qmv_i8(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols,
                              const void *xq, float *y, void *stream)
{
    if (wtype == ST_GGML_Q4_K) {
        const st_cuda_qmv_job j = {w, y, rows};
        return st_cuda_qmv_n_i8(wtype, cols, &j, 1, xq, stream);
    }
    if (wtype != ST_GGML_Q8_0)
        return st_error_set(ST_EINVAL, "cuda qmv: no integer kernel for weight type %u (Q8_0 and "
                            "Q4_K have one)", wtype);
    if (!rows || !cols || cols % 32)
        return st_error_set(ST_EINVAL, "cuda qmv: %u x %u: the columns must be a positive multiple of 32",
                            rows, cols);
    if (!w || !xq || !y || ((uintptr_t)xq & 3) || ((uintptr_t)w & 1))
        return st_error_set(ST_EINVAL, "cuda qmv: NULL or misaligned operand (xq must be 4-byte "
                            "aligned, w 2-byte)");
    uint32_t nb = cols / 32;
    qmv_jobs P;
    P.up = NULL;
    P.n = 1;
    P.w[0] = (const uint8_t *)w;
    P.y[0] = y;
    P.rows[0] = rows;
    P.start[0] = 0;
    P.start[1] = (rows + QMV_R - 1) / QMV_R;
    (void)st_launch(k_qmv_q8_0_i8<8>, P.start[1], 32 * 8, 0, (cudaStream_t)stream, P,
                    (uint64_t)nb * 34, nb, (const uint8_t *)xq);
    return launched("q8_0 integer");
}

extern "C" int st_cuda_qmv_supported(uint32_t wtype)
{
    return st_cuda_dequant_supported(wtype);
}

/* Which kernel a type and row take: 1 the type's own (Q8_0, Q4_K, Q6_K: QMV_R rows per CTA),
 * 2 the wide one (F32 / F16 / BF16 rows of whole 16-byte words), 0 the decoder-driven one. */
static int kernel_of(uint32_t wtype, uint64_t row_bytes)
{
    if (wtype == ST_GGML_Q8_0 || wtype == ST_GGML_Q4_K || wtype == ST_GGML_Q6_K)
        return 1;
    if ((wtype == ST_GGML_F32 || wtype == ST_GGML_F16 || wtype == ST_GGML_BF16) && row_bytes % 16 == 0)
        return 2;
    return 0;
}

/* The warps of a CTA of the own kernels (invariant 2): 8 (4 for Q4_K), halved while the row has
 * fewer warp steps than warps (a warp step: 4 blocks of Q8_0 or Q4_K, one of Q6_K), so that no
 * warp idles. The count depends on the column count alone, so a row's bits still do not depend
 * on anything but its weights and x (invariant 3). */
int st_cuda_pdl_flag = 0;

int st_cuda_pdl_configure(void)
{
    const char *e = getenv("STRATA_CUDA_PDL");
    int dev = 0, major = 0;
    /* and the kernels' code is for compute capability 9 or later: code JIT-compiled from an
     * older architecture's PTX (CMAKE_CUDA_ARCHITECTURES narrowed) has no griddepcontrol.wait,
     * so it must not be launched early */
    cudaFuncAttributes fa;
    int on = (!e || strcmp(e, "0")) && cudaGetDevice(&dev) == cudaSuccess &&
             cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) == cudaSuccess &&
             major >= 9 && cudaFuncGetAttributes(&fa, (const void *)k_qmv_wide<0>) == cudaSuccess &&
             fa.ptxVersion >= 90;
    (void)cudaGetLastError();
    __atomic_store_n(&st_cuda_pdl_flag, on, __ATOMIC_RELAXED);
    return on;
}

static uint32_t own_warps(uint32_t wtype, uint32_t nb)
{
    uint32_t per_step = wtype == ST_GGML_Q6_K ? 1 : 4, S = wtype == ST_GGML_Q4_K ? 4 : 8;
    uint32_t steps = (nb + per_step - 1) / per_step;
    while (S > 1 && S > steps)
        S /= 2;
    return S;
}

#define OWN_LAUNCH_P(k, PAIR)                                                                  \
    do {                                                                                       \
        if (S == 8)                                                                            \
            (void)st_launch(k<8, PAIR>, ctas, 32 * 8, 0, st, P, rb, nb, x);                    \
        else if (S == 4)                                                                       \
            (void)st_launch(k<4, PAIR>, ctas, 32 * 4, 0, st, P, rb, nb, x);                    \
        else if (S == 2)                                                                       \
            (void)st_launch(k<2, PAIR>, ctas, 32 * 2, 0, st, P, rb, nb, x);                    \
        else                                                                                   \
            (void)st_launch(k<1, PAIR>, ctas, 32, 0, st, P, rb, nb, x);                        \
    } while (0)
#define OWN_LAUNCH(k) OWN_LAUNCH_P(k, 0)

template <class D>
static void gen_launch(uint32_t ctas, const qmv_jobs &P, uint64_t rb, uint32_t nb, uint32_t L,
                       const float *x, cudaStream_t st)
{
    (void)st_launch(k_qmv_gen<D>, ctas, 32 * QMV_GEN_WARPS, 0, st, P, rb, nb, L, x);
}

extern "C" int st_cuda_qmv_n(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs, uint32_t n,
                             const float *x, void *stream)
{
    const st_wtype *t = st_wtype_get(wtype);
    if (!t || !st_cuda_qmv_supported(wtype))
        return st_error_set(ST_EINVAL, "cuda qmv: no kernel for weight type %u (%s)", wtype,
                            t ? t->name : "unknown");
    if (!cols || cols % t->block)
        return st_error_set(ST_EINVAL, "cuda qmv: %u columns: not a positive multiple of %s's "
                            "block of %u", cols, t->name, t->block);
    if (!n || n > ST_CUDA_QMV_JOBS || !jobs)
        return st_error_set(ST_EINVAL, "cuda qmv: %u products in one launch (1 to %u)", n,
                            ST_CUDA_QMV_JOBS);
    if (!x || ((uintptr_t)x & 15))
        return st_error_set(ST_EINVAL, "cuda qmv: NULL or misaligned x (it must be 16-byte aligned)");
    uint32_t nb = cols / t->block;
    uint64_t rb = (uint64_t)nb * t->bytes;
    int kind = kernel_of(wtype, rb);
    /* rows per CTA (invariant 4), and for the decoder-driven kernel the lanes per row */
    uint32_t L = 32;
    while (L > 1 && L / 2 >= nb)
        L /= 2;
    uint32_t per_cta = kind == 1 ? QMV_R : kind == 2 ? QMV_GEN_WARPS : QMV_GEN_WARPS * (32 / L);
    qmv_jobs P;
    P.up = NULL;
    P.n = n;
    P.start[0] = 0;
    for (uint32_t j = 0; j < n; j++) {
        const st_cuda_qmv_job *jb = &jobs[j];
        if (!jb->w || !jb->y || !jb->rows || ((uintptr_t)jb->w & 15))
            return st_error_set(ST_EINVAL, "cuda qmv: product %u of %u: %s", j, n,
                                !jb->rows ? "no rows" : !jb->w || !jb->y ? "a NULL operand"
                                : "the weights are not 16-byte aligned");
        uint64_t ctas = P.start[j] + ((uint64_t)jb->rows + per_cta - 1) / per_cta;
        if (ctas > 0x7fffffffull)
            return st_error_set(ST_EINVAL, "cuda qmv: %u products, product %u of %u rows: too "
                                "many CTAs for one launch", n, j, jb->rows);
        P.w[j] = (const uint8_t *)jb->w;
        P.y[j] = jb->y;
        P.rows[j] = jb->rows;
        P.start[j + 1] = (uint32_t)ctas;
    }
    uint32_t ctas = P.start[n];
    cudaStream_t st = (cudaStream_t)stream;
    uint32_t S = kind == 1 ? own_warps(wtype, nb) : 0;
    switch (wtype) {
    case ST_GGML_Q8_0: OWN_LAUNCH(k_qmv_q8_0); break;
    case ST_GGML_Q4_K: OWN_LAUNCH(k_qmv_q4_k); break;
    case ST_GGML_Q6_K: OWN_LAUNCH(k_qmv_q6_k); break;
    case ST_GGML_F32:
        if (kind == 2)
            (void)st_launch(k_qmv_wide<0>, ctas, 32 * QMV_GEN_WARPS, 0, st, P, rb, cols, x);
        else
            gen_launch<dq_f32>(ctas, P, rb, nb, L, x, st);
        break;
    case ST_GGML_F16:
        if (kind == 2)
            (void)st_launch(k_qmv_wide<1>, ctas, 32 * QMV_GEN_WARPS, 0, st, P, rb, cols, x);
        else
            gen_launch<dq_f16v>(ctas, P, rb, nb, L, x, st);
        break;
    case ST_GGML_BF16:
        if (kind == 2)
            (void)st_launch(k_qmv_wide<2>, ctas, 32 * QMV_GEN_WARPS, 0, st, P, rb, cols, x);
        else
            gen_launch<dq_bf16>(ctas, P, rb, nb, L, x, st);
        break;
    case ST_GGML_Q4_0: gen_launch<dq_q4_0>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q4_1: gen_launch<dq_q4_1>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q5_0: gen_launch<dq_q5_0>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q5_1: gen_launch<dq_q5_1>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q2_K: gen_launch<dq_q2_K>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q3_K: gen_launch<dq_q3_K>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_Q5_K: gen_launch<dq_q5_K>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_IQ4_NL: gen_launch<dq_iq4_nl>(ctas, P, rb, nb, L, x, st); break;
    case ST_GGML_IQ4_XS: gen_launch<dq_iq4_xs>(ctas, P, rb, nb, L, x, st); break;
    default: return st_error_set(ST_EINVAL, "cuda qmv: weight type %s", t->name);
    }
    return launched(t->name);
}

static uint64_t g_pair_runs; /* paired launches made by this process (tests) */

/* The one job of a paired launch (invariant 6): gate's rows, up's beside them; -1 when the rows
 * need more CTAs than one launch has. */
static int pair_jobs(uint32_t rows, const void *gate, const void *up, float *y, qmv_jobs *P)
{
    uint64_t ctas64 = ((uint64_t)rows + QMV_R - 1) / QMV_R;
    if (ctas64 > 0x7fffffffull)
        return -1;
    P->up = (const uint8_t *)up;
    P->n = 1;
    P->w[0] = (const uint8_t *)gate;
    P->y[0] = y;
    P->rows[0] = rows;
    P->start[0] = 0;
    P->start[1] = (uint32_t)ctas64;
    return 0;
}

extern "C" uint64_t st_cuda_qmv_swiglu_runs(void)
{
    return __atomic_load_n(&g_pair_runs, __ATOMIC_RELAXED);
}

extern "C" int st_cuda_qmv_swiglu_supported(uint32_t wtype)
{
    return wtype == ST_GGML_Q8_0 || wtype == ST_GGML_Q4_K || wtype == ST_GGML_Q6_K;
}

extern "C" int st_cuda_qmv_swiglu(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                                  const void *up, const float *x, float *y, void *stream)
{
    const st_wtype *t = st_wtype_get(wtype);
    if (!t || !st_cuda_qmv_swiglu_supported(wtype))
        return st_error_set(ST_EINVAL, "cuda qmv: no paired kernel for weight type %u (%s)", wtype,
                            t ? t->name : "unknown");
    if (!rows || !cols || cols % t->block)
        return st_error_set(ST_EINVAL, "cuda qmv: %u x %u: the columns must be a positive "
                            "multiple of %s's block of %u", rows, cols, t->name, t->block);
    if (!gate || !up || !x || !y || ((uintptr_t)gate & 15) || ((uintptr_t)up & 15) ||
        ((uintptr_t)x & 15))
        return st_error_set(ST_EINVAL, "cuda qmv: NULL or misaligned operand of the paired "
                            "product (weights and x 16-byte aligned)");
    uint32_t nb = cols / t->block;
    uint64_t rb = (uint64_t)nb * t->bytes;
    qmv_jobs P;
    if (pair_jobs(rows, gate, up, y, &P))
        return st_error_set(ST_EINVAL, "cuda qmv: %u rows: too many CTAs for one launch", rows);
    uint32_t ctas = P.start[1], S = own_warps(wtype, nb);
    cudaStream_t st = (cudaStream_t)stream;
    switch (wtype) {
    case ST_GGML_Q8_0: OWN_LAUNCH_P(k_qmv_q8_0, 1); break;
    case ST_GGML_Q4_K: OWN_LAUNCH_P(k_qmv_q4_k, 1); break;
    default: OWN_LAUNCH_P(k_qmv_q6_k, 1); break;
    }
    int rc = launched(t->name);
    if (!rc)
        __atomic_add_fetch(&g_pair_runs, 1, __ATOMIC_RELAXED);
    return rc;
}

extern "C" int st_cuda_qmv(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols,
                           const float *x, float *y, void *stream)
{
    const st_cuda_qmv_job j = {w, y, rows};
    return st_cuda_qmv_n(wtype, cols, &j, 1, x, stream);
}

#define I8_LAUNCH_P(PAIR)                                                                      \
    do {                                                                                       \
        if (S == 4)                                                                            \
            (void)st_launch(k_qmv_q4_k_i8<4, PAIR>, ctas, 32 * 4, 0, st, P, rb, nb, xqb);       \
        else if (S == 2)                                                                       \
            (void)st_launch(k_qmv_q4_k_i8<2, PAIR>, ctas, 32 * 2, 0, st, P, rb, nb, xqb);       \
        else                                                                                   \
            (void)st_launch(k_qmv_q4_k_i8<1, PAIR>, ctas, 32, 0, st, P, rb, nb, xqb);           \
    } while (0)

extern "C" int st_cuda_quant_q8_k(const float *x, uint32_t cols, void *xq, void *stream)
{
    if (!cols || cols % 256)
        return st_error_set(ST_EINVAL, "cuda qmv: %u values: not a positive multiple of 256", cols);
    if (!x || !xq || ((uintptr_t)x & 15) || ((uintptr_t)xq & 3))
        return st_error_set(ST_EINVAL, "cuda qmv: NULL or misaligned operand of the Q8_K "
                            "quantization (x 16-byte aligned, xq 4-byte)");
    uint32_t nb = cols / 256;
    (void)st_launch(k_quant_q8_k, (nb + 3) / 4, 128, 0, (cudaStream_t)stream, x, nb,
                    (uint8_t *)xq);
    return launched("q8_k quantization");
}

extern "C" int st_cuda_qmv_n_i8(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs,
                                uint32_t n, const void *xq, void *stream)
{
    if (wtype != ST_GGML_Q4_K)
        return st_error_set(ST_EINVAL, "cuda qmv: no integer kernel for weight type %u here (Q4_K)",
                            wtype);
    if (!cols || cols % 256)
        return st_error_set(ST_EINVAL, "cuda qmv: %u columns: not a positive multiple of 256", cols);
    if (!n || n > ST_CUDA_QMV_JOBS || !jobs || !xq || ((uintptr_t)xq & 3))
        return st_error_set(ST_EINVAL, "cuda qmv: %u products, or a NULL or misaligned xq", n);
    uint32_t nb = cols / 256;
    uint64_t rb = (uint64_t)nb * 144;
    qmv_jobs P;
    P.up = NULL;
    P.n = n;
    P.start[0] = 0;
    for (uint32_t j = 0; j < n; j++) {
        const st_cuda_qmv_job *jb = &jobs[j];
        if (!jb->w || !jb->y || !jb->rows || ((uintptr_t)jb->w & 15))
            return st_error_set(ST_EINVAL, "cuda qmv: product %u of %u: a NULL, empty or "
                                "misaligned operand", j, n);
        uint64_t ctas = P.start[j] + ((uint64_t)jb->rows + QMV_R - 1) / QMV_R;
        if (ctas > 0x7fffffffull)
            return st_error_set(ST_EINVAL, "cuda qmv: too many CTAs for one launch");
        P.w[j] = (const uint8_t *)jb->w;
        P.y[j] = jb->y;
        P.rows[j] = jb->rows;
        P.start[j + 1] = (uint32_t)ctas;
    }
    uint32_t ctas = P.start[n], S = own_warps(wtype, nb);
    cudaStream_t st = (cudaStream_t)stream;
    const uint8_t *xqb = (const uint8_t *)xq;
    I8_LAUNCH_P(0);
    return launched("q4_k integer");
}

extern "C" int st_cuda_qmv_swiglu_i8(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                                     const void *up, const void *xq, float *y, void *stream)
{
    if (wtype != ST_GGML_Q4_K)
        return st_error_set(ST_EINVAL, "cuda qmv: no paired integer kernel for weight type %u "
                            "(Q4_K)", wtype);
    if (!rows || !cols || cols % 256 || !gate || !up || !xq || !y || ((uintptr_t)gate & 15) ||
        ((uintptr_t)up & 15) || ((uintptr_t)xq & 3))
        return st_error_set(ST_EINVAL, "cuda qmv: a bad operand of the paired integer product");
    uint32_t nb = cols / 256;
    uint64_t rb = (uint64_t)nb * 144;
    qmv_jobs P;
    if (pair_jobs(rows, gate, up, y, &P))
        return st_error_set(ST_EINVAL, "cuda qmv: %u rows: too many CTAs for one launch", rows);
    uint32_t ctas = P.start[1], S = own_warps(wtype, nb);
    cudaStream_t st = (cudaStream_t)stream;
    const uint8_t *xqb = (const uint8_t *)xq;
    I8_LAUNCH_P(1);
    int rc = launched("q4_k paired integer");
    if (!rc)
        __atomic_add_fetch(&g_pair_runs, 1, __ATOMIC_RELAXED);
    return rc;
}
