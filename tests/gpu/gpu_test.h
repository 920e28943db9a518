/*
 * gpu_test.h - what the GPU tests share: a CUDA runtime call (CU_OK) and a Strata call (ST_OK)
 * that must succeed, a cmocka failure naming the call and the error otherwise. Include after
 * <cmocka.h>, and <cuda_runtime.h> where CU_OK is used, and a Strata header (st_strerror,
 * st_errdetail) where ST_OK is.
 */
#ifndef GPU_TEST_H
#define GPU_TEST_H

#define CU_OK(call)                                                                            \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            fail_msg("%s: %s", #call, cudaGetErrorString(e_));                                 \
    } while (0)

#define ST_OK(call)                                                                            \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        if (rc_ != 0)                                                                          \
            fail_msg("%s: %s: %s", #call, st_strerror(rc_), st_errdetail());                   \
    } while (0)

#endif
