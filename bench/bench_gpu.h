/*
 * bench_gpu.h - what the GPU benchmarks share: the HBM limit their figures are ratios to (one
 * definition, so that every "x HBM" in docs/BENCHMARKS.md is against the same number), and the
 * greedy token their decodes feed back.
 */
#ifndef BENCH_GPU_H
#define BENCH_GPU_H

#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "st_engine.h"

/* The greedy token (st_slot_sample at temperature 0); on an error prog's line and exit 1. */
static inline uint32_t bench_greedy(const char *prog, const st_slot *s)
{
    uint32_t tok = 0;
    int rc = st_slot_sample(s, 0.0f, 1, &tok);
    if (rc) {
        fprintf(stderr, "%s: sample: %s: %s\n", prog, st_strerror(rc), st_errdetail());
        exit(1);
    }
    return tok;
}

/* The best of 5 device-to-device copies of 1 GiB after a warm-up one, timed with events: bytes
 * read plus written per second (what HBM moves). 0 on a CUDA error (printed). */
static inline double bench_hbm_copy_rate(void)
{
    size_t big = (size_t)1 << 30;
    void *a = NULL, *b = NULL;
    cudaEvent_t e0 = NULL, e1 = NULL;
    double rate = 0.0;
    float best = 1e30f;
    cudaError_t e = cudaMalloc(&a, big);
    if (e == cudaSuccess)
        e = cudaMalloc(&b, big);
    if (e == cudaSuccess)
        e = cudaEventCreate(&e0);
    if (e == cudaSuccess)
        e = cudaEventCreate(&e1);
    if (e == cudaSuccess)
        e = cudaMemset(a, 1, big);
    if (e == cudaSuccess)
        e = cudaMemcpy(b, a, big, cudaMemcpyDeviceToDevice);
    for (int i = 0; i < 5 && e == cudaSuccess; i++) {
        float ms = 0.0f;
        e = cudaEventRecord(e0, 0);
        if (e == cudaSuccess)
            e = cudaMemcpy(b, a, big, cudaMemcpyDeviceToDevice);
        if (e == cudaSuccess)
            e = cudaEventRecord(e1, 0);
        if (e == cudaSuccess)
            e = cudaEventSynchronize(e1);
        if (e == cudaSuccess)
            e = cudaEventElapsedTime(&ms, e0, e1);
        if (e == cudaSuccess && ms < best)
            best = ms;
    }
    if (e == cudaSuccess)
        rate = 2.0 * (double)big / ((double)best * 1e-3);
    else
        fprintf(stderr, "bench_hbm_copy_rate: %s\n", cudaGetErrorString(e));
    if (e0)
        cudaEventDestroy(e0);
    if (e1)
        cudaEventDestroy(e1);
    cudaFree(a);
    cudaFree(b);
    return rate;
}

#endif
