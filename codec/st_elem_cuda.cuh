/*
 * st_elem_cuda.cuh - the codec's per-element functions for CUDA code (st_codec_cuda.cu, and the
 * engine's kernels that digest a bf16 checkpoint on the device): st_elem.c's scalar reference,
 * compiled for host and device alike. Internal to the modules, not part of the codec API.
 * st_codec_cuda.cu's invariants 1 and 5 say why they are written this way; test_gpu_codec proves
 * them against the CPU codecs.
 */
#ifndef ST_ELEM_CUDA_CUH
#define ST_ELEM_CUDA_CUH

#include <stdint.h>
#include <string.h>

#define ST_HD __host__ __device__ __forceinline__

/* ---- the per-element functions (st_elem.c's scalar reference) ----------------------------- */

ST_HD uint32_t st_cuda_bf16_from_bits(uint32_t u)
{
    /* NaN: truncating could clear every payload bit left and make Inf, so force the quiet bit. */
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (u >> 16) | 0x0040u;
    /* Round to nearest even; a carry out of the mantissa bumps the exponent, up to Inf. */
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

ST_HD uint32_t st_cuda_f16_from_bits(uint32_t u)
{
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;

    if (a > 0x7f800000u) /* NaN, as vcvtps2ph: quiet bit set, top 10 payload bits kept */
        return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    if (a >= 0x477ff000u) /* >= 65520 = 65504 + half an ulp: a tie whose even side is Inf */
        return sign | 0x7c00u;
    if (a >= 0x38800000u) { /* >= 2^-14: a normal half; rebias and round to nearest even */
        uint32_t r = a - ((127u - 15u) << 23);
        r += 0x0fffu + ((r >> 13) & 1u);
        return sign | (r >> 13);
    }
    if (a <= 0x33000000u) /* <= 2^-25, half the smallest subnormal (the tie goes to even 0) */
        return sign;
    /* A subnormal half counts units of 2^-24: shift the full significand down by the gap. */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 for e in 102 .. 112 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t mid = 1u << (shift - 1u);
    r += (uint32_t)(rem > mid) | ((uint32_t)(rem == mid) & r);
    return sign | r; /* r may reach 0x400, the smallest normal: the right encoding */
}

/* u as fp32, times 2^112, as bits. Exact for every u = finite half << 13 (a power-of-two scale
 * into the normal fp32 range). On the device an explicit mul.rn.f32 without .ftz, so subnormal
 * halves, which arrive as fp32 subnormals, stay exact whatever -ftz or fast-math say. */
ST_HD uint32_t st_cuda_bits_mul_2p112(uint32_t u)
{
#ifdef __CUDA_ARCH__
    float r;
    asm("mul.rn.f32 %0, %1, %2;" : "=f"(r) : "f"(__uint_as_float(u)), "f"(0x1p112f));
    return __float_as_uint(r);
#else
    float f;
    memcpy(&f, &u, 4);
    f *= 0x1p112f;
    memcpy(&u, &f, 4);
    return u;
#endif
}

/* The reference's st_f16_to_bits in fewer integer operations (f16 decode is bound by them, not
 * by memory, otherwise): exponent and mantissa shifted into fp32 place are the value scaled by
 * 2^-112, for normal and subnormal halves alike, so one exact multiply rebiases both. Proven
 * equal to the reference on all 2^16 inputs by tests/gpu/test_gpu_codec.c. */
ST_HD uint32_t st_cuda_f16_to_bits(uint32_t h)
{
    uint32_t em = h & 0x7fffu;
    uint32_t r;
    if (em >= 0x7c00u) /* Inf or NaN; vcvtph2ps quiets a signalling NaN, so do the same */
        r = 0x7f800000u | (em << 13) | (em > 0x7c00u ? 0x400000u : 0u);
    else
        r = st_cuda_bits_mul_2p112(em << 13);
    return r | ((h & 0x8000u) << 16);
}

#endif
