/*
 * gpu_test.h - what the GPU tests share: a CUDA runtime call that must succeed (a cmocka
 * failure naming the call and the error otherwise). Include after <cmocka.h> and
 * <cuda_runtime.h>.
 */
#ifndef GPU_TEST_H
#define GPU_TEST_H

#define CU_OK(call)                                                                            \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                                 \
    } while (0)

#endif
