/*
 * st_reduce_cuda.cuh - the reductions the engine's CUDA files share (st_backend_cuda.cu,
 * st_ops_cuda.cu, st_qmv_cuda.cu), each in one fixed order so that results are the same bits
 * run after run (docs/ENGINE.md, "Determinism rules"): within a warp a fixed shuffle tree,
 * across a block the warps' values in warp order, the same value in every thread.
 */
#ifndef ST_REDUCE_CUDA_CUH
#define ST_REDUCE_CUDA_CUH

__device__ __forceinline__ float st_warp_sum(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float st_warp_max(float v)
{
    for (int o = 16; o > 0; o >>= 1)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Over the block (blockDim a multiple of 32, at most 1024); sh: 32 floats of shared memory. */
__device__ __forceinline__ float st_block_sum(float v, float *sh)
{
    v = st_warp_sum(v);
    unsigned w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0)
        sh[w] = v;
    __syncthreads();
    float t = 0.0f;
    for (unsigned i = 0; i < nw; i++)
        t += sh[i];
    __syncthreads();
    return t;
}

__device__ __forceinline__ float st_block_max(float v, float *sh)
{
    v = st_warp_max(v);
    unsigned w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if ((threadIdx.x & 31) == 0)
        sh[w] = v;
    __syncthreads();
    float t = sh[0];
    for (unsigned i = 1; i < nw; i++)
        t = fmaxf(t, sh[i]);
    __syncthreads();
    return t;
}

#endif /* ST_REDUCE_CUDA_CUH */
