/*
 * st_dequant_cuda.cu - rows of a weight matrix widened to f32 on the GPU, for every type of the
 * weight-type table (st_wtype.c), the values bit for bit those of the CPU's scalar
 * dequantization (st_wtype_get(type)->dequant[0]; contract in st_engine_int.h). Each block
 * decoder below is the CPU's deq_* of st_wtype.c written again for the device.
 *
 * Invariants:
 * 1. Same bits as the CPU: every value is computed with the CPU decoder's float operations, in
 *    its order and with its operands (an integer converted to f32 exactly, then rounded
 *    multiplies and adds). They are written as __fmul_rn / __fadd_rn / __fsub_rn, which the
 *    compiler never fuses, so the result does not rest on --fmad=false alone. No intermediate
 *    is a subnormal f32 (an f16 scale is at least 2^-24 in magnitude, and the integers it is
 *    multiplied by are small), so flush-to-zero settings cannot matter either.
 * 2. f16 scales and values widen exactly (__half2float); a NaN is quietened with its payload
 *    kept, as st_wtype_f16_to_f32 does. F32 is copied and BF16 shifted as bits, so NaNs pass
 *    unchanged, as on the CPU. Results differ from the CPU only where IEEE arithmetic itself
 *    leaves the NaN's bits open: a NaN or infinite scale in a quantized block (the GPU's
 *    arithmetic gives its canonical NaN).
 * 3. Layout: a CTA per output row (grid x, rows beyond it taken in turn), its threads, and
 *    those of further CTAs in grid y for a row of more blocks than a CTA has threads, stride
 *    over the row's blocks; a thread decodes whole blocks (a value for F32, F16, BF16; 32 or
 *    256 for the quantized types) into dst directly, without a local array.
 * 4. The weights are read a byte at a time: a row may begin at any byte offset (row_bytes
 *    need not be a multiple of anything, nor w aligned). The output row i is dst + i * ldd,
 *    the source row rows[i] or r0 + i, in 64-bit arithmetic.
 * 5. The IQ4 codebook is a __constant__ copy of st_wtype_iq4nl_values (a literal, so that every
 *    device has it with the module); tests/gpu/test_gpu_dequant.c checks all 16 entries.
 */
#include <stdint.h>

#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "st_engine_int.h"
#include "st_wtype.h"
}
#include "st_launch_cuda.cuh"
#include "st_wtype_cuda.cuh"

#define DQ_THREADS_MAX 256
#define DQ_GRID_X_MAX 2147483647u
#define DQ_GRID_Y_MAX 65535u

/* Invariant 3: output row i of n in grid x, block b of nb in the threads of grid y. O is the
 * element type of dst: float (the exact values), or __half (rounded to nearest even, for the
 * tensor-core products of st_ops_cuda.cu: invariant 6). */
template <class O> struct dq_out;
template <> struct dq_out<float> {
    __device__ static float *at(float *p) { return p; }
};
template <> struct dq_out<__half> {
    __device__ static st_dq_h16 at(__half *p) { return st_dq_h16{p}; }
};

template <class D, class O>
__global__ void k_dequant(const uint8_t *W, uint64_t row_bytes, uint64_t nb, const uint32_t *rows,
                          uint32_t r0, uint32_t n, O *dst, uint64_t ldd)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    for (uint64_t i = blockIdx.x; i < n; i += gridDim.x) {
        uint64_t r = rows ? (uint64_t)rows[i] : (uint64_t)r0 + i;
        const uint8_t *row = W + r * row_bytes;
        O *out = dst + i * ldd;
        for (uint64_t b = (uint64_t)blockIdx.y * blockDim.x + threadIdx.x; b < nb;
             b += (uint64_t)gridDim.y * blockDim.x)
            D::run(row + b * D::BYTES, dq_out<O>::at(out + b * D::QK));
    }
}

template <class D, class O>
static void dq_launch(const void *w, uint64_t row_bytes, uint64_t nb, const uint32_t *rows, uint32_t r0,
                      uint32_t n, O *dst, uint64_t ldd, cudaStream_t st)
{
    uint64_t threads = nb < DQ_THREADS_MAX ? (nb + 31) / 32 * 32 : DQ_THREADS_MAX;
    uint64_t gy = (nb + threads - 1) / threads;
    dim3 grid(n < DQ_GRID_X_MAX ? n : DQ_GRID_X_MAX, gy < DQ_GRID_Y_MAX ? (uint32_t)gy : DQ_GRID_Y_MAX);
    (void)st_launch(k_dequant<D, O>, grid, (uint32_t)threads, 0, st, (const uint8_t *)w, row_bytes, nb,
                    rows, r0, n, dst, ldd);
}

extern "C" int st_cuda_dequant_supported(uint32_t type)
{
    switch (type) {
    case ST_GGML_F32:
    case ST_GGML_F16:
    case ST_GGML_BF16:
    case ST_GGML_Q4_0:
    case ST_GGML_Q4_1:
    case ST_GGML_Q5_0:
    case ST_GGML_Q5_1:
    case ST_GGML_Q8_0:
    case ST_GGML_Q2_K:
    case ST_GGML_Q3_K:
    case ST_GGML_Q4_K:
    case ST_GGML_Q5_K:
    case ST_GGML_Q6_K:
    case ST_GGML_IQ4_NL:
    case ST_GGML_IQ4_XS:
        return 1;
    default:
        return 0;
    }
}

template <class O>
static int dequant_rows(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                        const uint32_t *rows, uint32_t r0, uint32_t n, O *dst, uint64_t ldd,
                        void *stream)
{
    const st_wtype *t = st_wtype_get(type);
    if (!t || !st_cuda_dequant_supported(type))
        return st_error_set(ST_EINVAL, "cuda dequant: no kernel for weight type %u (%s)", type,
                            t ? t->name : "unknown");
    if (!cols || cols % t->block)
        return st_error_set(ST_EINVAL, "cuda dequant: %u columns: not a positive multiple of %s's "
                            "block of %u", cols, t->name, t->block);
    if (!n)
        return 0;
    uint64_t nb = cols / t->block;
    if (row_bytes < nb * t->bytes)
        return st_error_set(ST_EINVAL, "cuda dequant: %s rows of %u columns are %llu bytes, row_bytes "
                            "is %llu", t->name, cols, (unsigned long long)(nb * t->bytes),
                            (unsigned long long)row_bytes);
    if (n > 1 && ldd < cols)
        return st_error_set(ST_EINVAL, "cuda dequant: ldd %llu is less than the %u columns",
                            (unsigned long long)ldd, cols);
    if (!w || !dst)
        return st_error_set(ST_EINVAL, "cuda dequant: NULL %s", w ? "dst" : "w");
    cudaStream_t st = (cudaStream_t)stream;
    switch (type) {
    case ST_GGML_F32: dq_launch<dq_f32>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_F16: dq_launch<dq_f16v>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_BF16: dq_launch<dq_bf16>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q4_0: dq_launch<dq_q4_0>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q4_1: dq_launch<dq_q4_1>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q5_0: dq_launch<dq_q5_0>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q5_1: dq_launch<dq_q5_1>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q8_0: dq_launch<dq_q8_0>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q2_K: dq_launch<dq_q2_K>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q3_K: dq_launch<dq_q3_K>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q4_K: dq_launch<dq_q4_K>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q5_K: dq_launch<dq_q5_K>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_Q6_K: dq_launch<dq_q6_K>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_IQ4_NL: dq_launch<dq_iq4_nl>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    case ST_GGML_IQ4_XS: dq_launch<dq_iq4_xs>(w, row_bytes, nb, rows, r0, n, dst, ldd, st); break;
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return st_error_set(ST_EIO, "cuda dequant: %s launch: %s (%s)", t->name, cudaGetErrorName(e),
                            cudaGetErrorString(e));
    return 0;
}

extern "C" int st_cuda_dequant_rows(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                                    const uint32_t *rows, uint32_t r0, uint32_t n, float *dst,
                                    uint64_t ldd, void *stream)
{
    return dequant_rows(type, w, row_bytes, cols, rows, r0, n, dst, ldd, stream);
}

extern "C" int st_cuda_dequant_rows_h(uint32_t type, const void *w, uint64_t row_bytes,
                                      uint32_t cols, const uint32_t *rows, uint32_t r0, uint32_t n,
                                      void *dst, uint64_t ldd, void *stream)
{
    return dequant_rows(type, w, row_bytes, cols, rows, r0, n, (__half *)dst, ldd, stream);
}
