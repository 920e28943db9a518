/*
 * bench_gpu_qmv.c - the GPU's quantized matrix-vector products (engine/st_qmv_cuda.cu) against
 * the device memory's bandwidth measured in the same run: for Q8_0, Q4_K and Q6_K, a decode
 * product of ROWS x COLS weights (default 16,384 x 8,192: 71 to 143 MB, far beyond the L2) timed
 * over 50 calls with CUDA events, as weight bytes read per second, next to a device-to-device
 * cudaMemcpy of 1 GiB (bytes read plus bytes written per second: what HBM moves). Issue 14's
 * target: >= 0.7x HBM on the weight bytes.
 *
 *   bench_gpu_qmv [--rows N] [--cols N]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "bench_gpu.h"
#include "st_engine_int.h"
#include "st_wtype.h"

#define CK(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "bench_gpu_qmv: %s: %s\n", #call, cudaGetErrorString(e_));         \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static float time_ms(cudaEvent_t a, cudaEvent_t b)
{
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    return ms;
}

typedef int (*qmv_call)(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols, const void *x,
                        float *y);
static int call_float(uint32_t t, const void *w, uint32_t r, uint32_t c, const void *x, float *y)
{
    return st_cuda_qmv(t, w, r, c, (const float *)x, y, NULL);
}
static int call_i8(uint32_t t, const void *w, uint32_t r, uint32_t c, const void *x, float *y)
{
    return st_cuda_qmv_i8(t, w, r, c, x, y, NULL);
}

/* One warm-up call, then microseconds per call over 50 (CUDA events); exits on an error. */
static double time_calls(qmv_call f, uint32_t wtype, const void *w, uint32_t rows, uint32_t cols,
                         const void *x, float *y, cudaEvent_t e0, cudaEvent_t e1)
{
    if (f(wtype, w, rows, cols, x, y)) {
        fprintf(stderr, "bench_gpu_qmv: %s\n", st_errdetail());
        exit(1);
    }
    CK(cudaDeviceSynchronize());
    int n = 50;
    CK(cudaEventRecord(e0, 0));
    for (int i = 0; i < n; i++)
        f(wtype, w, rows, cols, x, y);
    CK(cudaEventRecord(e1, 0));
    CK(cudaEventSynchronize(e1));
    CK(cudaGetLastError());
    return time_ms(e0, e1) * 1e3 / n;
}

int main(int argc, char **argv)
{
    uint32_t rows = 16384, cols = 8192;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rows") && i + 1 < argc)
            rows = (uint32_t)strtoul(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--cols") && i + 1 < argc)
            cols = (uint32_t)strtoul(argv[++i], NULL, 10);
        else {
            fprintf(stderr, "usage: bench_gpu_qmv [--rows N] [--cols N]\n");
            return 2;
        }
    }
    if (!rows || !cols || cols % 256) {
        fprintf(stderr, "bench_gpu_qmv: --cols must be a positive multiple of 256\n");
        return 2;
    }
    cudaEvent_t e0, e1;
    CK(cudaEventCreate(&e0));
    CK(cudaEventCreate(&e1));
    /* the limit: a 1 GiB device-to-device copy (bench_gpu.h) */
    double hbm = bench_hbm_copy_rate();
    if (!(hbm > 0))
        return 1;
    size_t big = (size_t)1 << 30;
    void *a;
    CK(cudaMalloc(&a, big));
    printf("bench_gpu_qmv: %u x %u; device-to-device copy of 1 GiB: %.0f GB/s moved (read + written)\n",
           rows, cols, hbm / 1e9);
    printf("%-6s %10s %10s %10s %12s\n", "type", "MB", "us/call", "GB/s", "x HBM (copy)");
    static const uint32_t types[] = {ST_GGML_Q8_0, ST_GGML_Q4_K, ST_GGML_Q6_K};
    float *x, *y;
    CK(cudaMalloc((void **)&x, (size_t)cols * 4));
    CK(cudaMalloc((void **)&y, (size_t)rows * 4));
    CK(cudaMemset(x, 0, (size_t)cols * 4));
    for (size_t ti = 0; ti < 3; ti++) {
        const st_wtype *t = st_wtype_get(types[ti]);
        uint64_t bytes = (uint64_t)rows * (cols / t->block) * t->bytes;
        if (bytes > big) {
            fprintf(stderr, "bench_gpu_qmv: %s: %llu bytes exceed the 1 GiB buffer\n", t->name,
                    (unsigned long long)bytes);
            return 1;
        }
        /* quantize one row of seeded values on the host, repeat it: the kernels' speed does not
         * depend on the values, and every row's scales are valid */
        float *w = malloc((size_t)cols * 4);
        uint8_t *q = malloc(bytes / rows);
        uint64_t s = 88172645463325252ull;
        for (uint32_t k = 0; k < cols; k++) {
            s ^= s << 13, s ^= s >> 7, s ^= s << 17;
            w[k] = (float)((double)(s % 20001) / 10000.0 - 1.0);
        }
        t->quantize(w, q, cols);
        for (uint32_t r = 0; r < rows; r++)
            CK(cudaMemcpy((uint8_t *)a + (uint64_t)r * (bytes / rows), q, bytes / rows, cudaMemcpyHostToDevice));
        free(w);
        free(q);
        double us = time_calls(call_float, types[ti], a, rows, cols, x, y, e0, e1);
        double gbs = (double)bytes / (us * 1e-6);
        printf("%-6s %10.1f %10.1f %10.0f %12.2f\n", t->name, bytes / 1e6, us, gbs / 1e9, gbs / hbm);
    }
    /* the integer form of Q8_0: activations quantized as the CPU's integer path does */
    {
        const st_wtype *t = st_wtype_get(ST_GGML_Q8_0);
        const st_qdot *qd = st_qdot_get(ST_GGML_Q8_0);
        uint64_t bytes = (uint64_t)rows * (cols / 32) * t->bytes, xs = (uint64_t)cols / 32 * qd->act_bytes;
        float *w = malloc((size_t)cols * 4);
        uint8_t *q = malloc(bytes / rows), *xq = malloc(xs);
        for (uint32_t k = 0; k < cols; k++)
            w[k] = (float)(k % 17) / 8.0f - 1.0f;
        t->quantize(w, q, cols);
        qd->quantize(w, xq, cols);
        for (uint32_t r = 0; r < rows; r++)
            CK(cudaMemcpy((uint8_t *)a + (uint64_t)r * (bytes / rows), q, bytes / rows, cudaMemcpyHostToDevice));
        void *xqd;
        CK(cudaMalloc(&xqd, xs));
        CK(cudaMemcpy(xqd, xq, xs, cudaMemcpyHostToDevice));
        free(w), free(q), free(xq);
        double us = time_calls(call_i8, ST_GGML_Q8_0, a, rows, cols, xqd, y, e0, e1);
        double gbs = (double)bytes / (us * 1e-6);
        printf("%-6s %10.1f %10.1f %10.0f %12.2f   (int8 activations, dp4a)\n", "q8_0", bytes / 1e6, us,
               gbs / 1e9, gbs / hbm);
        CK(cudaFree(xqd));
    }
    CK(cudaFree(a));
    CK(cudaFree(x));
    CK(cudaFree(y));
    return 0;
}
