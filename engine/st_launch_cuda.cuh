/*
 * st_launch_cuda.cuh - how the operation table's kernels are launched (st_ops_cuda.cu,
 * st_qmv_cuda.cu, st_dequant_cuda.cu): with programmatic dependent launch on Hopper and later
 * (compute capability 9+), so that a kernel is launched and its blocks made resident while the
 * kernel before it on the stream is still running, and only waits for that kernel's results
 * (griddepcontrol.wait) before it reads anything. A one-token decode step is ~320 dependent
 * kernels, most of them a few KB of work; what each costs is mostly the gap between the last
 * block of one and the first of the next, which this hides.
 *
 * Rules (docs/ENGINE.md, "Programmatic dependent launch"):
 * 1. Every kernel launched by st_launch begins with st_pdl_begin(): it waits for the kernel
 *    before it to complete and its memory to be visible (every grid before it on the stream is
 *    then complete too, since each waited in turn), and only then lets the next kernel launch.
 *    So nothing is read early, and no more than one kernel waits ahead of the running one.
 * 2. The wait is a no-op for a kernel launched without the attribute (other GPUs,
 *    STRATA_CUDA_PDL=0, a kernel after a copy or another library's kernel), so the same code
 *    runs either way and gives the same bits: the attribute changes when blocks start, never
 *    what they compute.
 * 3. STRATA_CUDA_PDL=0 turns it off: read when an operation context is made (an engine on the
 *    operation table), which sets it for the process (st_cuda_pdl_configure).
 */
#ifndef ST_LAUNCH_CUDA_CUH
#define ST_LAUNCH_CUDA_CUH

#include <stdlib.h>
#include <string.h>
#include <utility>

#include <cuda_runtime.h>

extern "C" {
#include "st_engine_int.h"
}

__device__ __forceinline__ void st_pdl_begin(void)
{
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

/* Whether launches carry the attribute (st_cuda_pdl_configure, st_engine_int.h). */
static inline int st_pdl_on(void)
{
    return __atomic_load_n(&st_cuda_pdl_flag, __ATOMIC_RELAXED);
}

/* k<<<grid, block, smem, stream>>>(args...), with programmatic stream serialization when on. */
template <typename... KArgs, typename... Args>
static inline cudaError_t st_launch(void (*k)(KArgs...), dim3 grid, dim3 block, size_t smem,
                                    cudaStream_t stream, Args &&...args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute at[1] = {};
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = st_pdl_on() ? 1 : 0;
    return cudaLaunchKernelEx(&cfg, k, std::forward<Args>(args)...);
}

#endif /* ST_LAUNCH_CUDA_CUH */
