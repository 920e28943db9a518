/*
 * bench_gpu_codec.c - the GPU codecs (st_codec_cuda_convert) against the device-to-device
 * cudaMemcpy bandwidth measured in the same run, plus pinned host<->device copies.
 *
 * Kernels: bf16 and f16 encode (fp32 -> 16 bit) and decode (16 bit -> fp32), bf16 <-> f16, over
 * --size-mib MiB of fp32 (default 1024) in cudaMalloc'd buffers (the vector kernel), and bf16
 * encode at offsets that select the element and the byte kernels. "GB/s moved" counts bytes read
 * plus bytes written (10^9 per second): 6 per element for encode and decode, 4 for bf16 <-> f16.
 * The limit is a device-to-device cudaMemcpy of the fp32 buffer, its bytes counted the same way
 * (2 per byte copied); it runs before every timed kernel run all through the benchmark and its
 * best time is kept. "x D2D" = kernel GB/s moved / memcpy GB/s moved. Each figure is the best of
 * --runs runs (default 10) after one warm-up, timed with CUDA events on one stream.
 *
 * Host link: pinned (cudaMallocHost) host->device and device->host copies of the fp32 buffer,
 * and the snapshot path that issue 6 wants: bf16 encode on the device, then the half-size copy
 * to pinned host memory, against copying the fp32 state as it is.
 *
 * The data look like recurrent state (as in bench_codec): rows of 4096 values, each an AR(1)
 * process of near-Gaussian innovations scaled by 1e-3..10; 16 Mi values generated and tiled.
 * At the end the GPU outputs of the first 16 Mi elements of each op are compared with the CPU's.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "st_codec.h"

#define TILE ((size_t)1 << 24) /* values generated on the host, then tiled */

#define CK(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            fprintf(stderr, "bench_gpu_codec: %s: %s\n", #call, cudaGetErrorString(e_));      \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

#define ST(call)                                                                               \
    do {                                                                                       \
        int rc_ = (call);                                                                      \
        if (rc_ != 0) {                                                                        \
            fprintf(stderr, "bench_gpu_codec: %s: %s (%s)\n", #call, st_strerror(rc_),         \
                    st_errdetail());                                                           \
            exit(1);                                                                           \
        }                                                                                      \
    } while (0)

static uint64_t rng_state = 0x5eed;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void fill_state_like(float *x, size_t n)
{
    const size_t row = 4096;
    for (size_t r = 0; r < n; r += row) {
        double scale = pow(10.0, -3.0 + 4.0 * (double)(rng_next() >> 11) * 0x1p-53);
        double v = 0.0;
        for (size_t i = r; i < n && i < r + row; i++) {
            uint64_t u = rng_next();
            double g = ((double)(u & 0xffff) + (double)((u >> 16) & 0xffff) +
                        (double)((u >> 32) & 0xffff) + (double)(u >> 48) - 131070.0) /
                       37837.0;
            v = 0.9 * v + 0.4359 * g;
            x[i] = (float)(scale * v);
        }
    }
}

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    CK(cudaMalloc(&p, bytes));
    CK(cudaMemset(p, 0, bytes));
    return p;
}

/* The limit: D2D memcpy of `bytes`, timed before every run of anything, best kept. */
struct limit {
    void *dst;
    const void *src;
    size_t bytes;
    float best_ms;
    int samples;
};

struct timer {
    cudaStream_t stream;
    cudaEvent_t e0, e1, e2;
};

/* One sample of the limit, then one run of the op (a convert), both timed. */
static float run_once(struct timer *t, struct limit *lim, uint32_t dst_id, void *dst,
                      uint32_t src_id, const void *src, size_t n)
{
    float copy_ms = 0, op_ms = 0;
    CK(cudaEventRecord(t->e0, t->stream));
    CK(cudaMemcpyAsync(lim->dst, lim->src, lim->bytes, cudaMemcpyDeviceToDevice, t->stream));
    CK(cudaEventRecord(t->e1, t->stream));
    ST(st_codec_cuda_convert(dst_id, dst, src_id, src, n, t->stream));
    CK(cudaEventRecord(t->e2, t->stream));
    ST(st_codec_cuda_sync(t->stream));
    CK(cudaEventElapsedTime(&copy_ms, t->e0, t->e1));
    CK(cudaEventElapsedTime(&op_ms, t->e1, t->e2));
    if (copy_ms < lim->best_ms)
        lim->best_ms = copy_ms;
    lim->samples++;
    return op_ms;
}

static float best_of(int runs, struct timer *t, struct limit *lim, uint32_t dst_id, void *dst,
                     uint32_t src_id, const void *src, size_t n)
{
    float best = 1e30f;
    run_once(t, lim, dst_id, dst, src_id, src, n); /* warm-up */
    for (int r = 0; r < runs; r++) {
        float ms = run_once(t, lim, dst_id, dst, src_id, src, n);
        if (ms < best)
            best = ms;
    }
    return best;
}

/* Best time of a plain copy (host<->device). */
static float copy_best(int runs, struct timer *t, void *dst, const void *src, size_t bytes,
                       enum cudaMemcpyKind kind)
{
    float best = 1e30f, ms = 0;
    for (int r = 0; r <= runs; r++) {
        CK(cudaEventRecord(t->e0, t->stream));
        CK(cudaMemcpyAsync(dst, src, bytes, kind, t->stream));
        CK(cudaEventRecord(t->e1, t->stream));
        CK(cudaStreamSynchronize(t->stream));
        CK(cudaEventElapsedTime(&ms, t->e0, t->e1));
        if (r > 0 && ms < best) /* run 0 is the warm-up */
            best = ms;
    }
    return best;
}

struct row {
    const char *op;
    const char *kernel;
    uint32_t dst_id, src_id;
    size_t src_off, dst_off; /* bytes */
    float ms;
};

static void usage(void)
{
    fprintf(stderr, "usage: bench_gpu_codec [--size-mib N] [--runs N]\n"
                    "  --size-mib N  fp32 MiB per buffer (default 1024)\n"
                    "  --runs N      timed runs per figure, best kept (default 10)\n");
}

int main(int argc, char **argv)
{
    long size_mib = 1024, runs = 10;
    for (int i = 1; i < argc; i++) {
        long *target = NULL;
        if (strcmp(argv[i], "--size-mib") == 0)
            target = &size_mib;
        else if (strcmp(argv[i], "--runs") == 0)
            target = &runs;
        else if (strcmp(argv[i], "--help") == 0) {
            usage();
            return 0;
        }
        char *end = NULL;
        if (!target || i + 1 >= argc || (*target = strtol(argv[++i], &end, 10)) <= 0 || *end ||
            *target > 65536) {
            usage();
            return 2;
        }
    }
    if (!st_codec_cuda_available()) {
        /* `make bench` runs every benchmark, also where there is no GPU; bench/gpu.sh runs this
         * one where there is, after test_gpu_codec has failed loudly if there is not. */
        printf("bench_gpu_codec: skipped: no usable CUDA device (%s)\n", st_errdetail());
        return 0;
    }

    size_t n = ((size_t)size_mib << 20) / 4;
    size_t f32_bytes = n * 4, h16_bytes = n * 2;
    int dev = 0;
    struct cudaDeviceProp prop;
    CK(cudaGetDevice(&dev));
    CK(cudaGetDeviceProperties(&prop, dev));

    /* device buffers, 16 spare bytes each for the offset rows */
    unsigned char *d_f32 = dev_alloc(f32_bytes + 16), *d_out32 = dev_alloc(f32_bytes + 16);
    unsigned char *d_h16 = dev_alloc(h16_bytes + 16), *d_h16b = dev_alloc(h16_bytes + 16);
    unsigned char *d_copy = dev_alloc(f32_bytes);
    float *h_f32 = NULL;
    CK(cudaMallocHost((void **)&h_f32, f32_bytes));

    size_t tile = n < TILE ? n : TILE;
    fill_state_like(h_f32, tile);
    for (size_t i = tile; i < n; i += tile)
        memcpy(h_f32 + i, h_f32, (n - i < tile ? n - i : tile) * 4);
    CK(cudaMemcpy(d_f32, h_f32, f32_bytes, cudaMemcpyHostToDevice));

    struct timer t;
    CK(cudaStreamCreate(&t.stream));
    CK(cudaEventCreate(&t.e0));
    CK(cudaEventCreate(&t.e1));
    CK(cudaEventCreate(&t.e2));
    struct limit lim = {d_copy, d_f32, f32_bytes, 1e30f, 0};

    struct row rows[] = {
        {"bf16 encode", "vector", ST_CODEC_BF16, ST_CODEC_FP32, 0, 0, 0},
        {"bf16 decode", "vector", ST_CODEC_FP32, ST_CODEC_BF16, 0, 0, 0},
        {"f16 encode", "vector", ST_CODEC_F16, ST_CODEC_FP32, 0, 0, 0},
        {"f16 decode", "vector", ST_CODEC_FP32, ST_CODEC_F16, 0, 0, 0},
        {"bf16 -> f16", "vector", ST_CODEC_F16, ST_CODEC_BF16, 0, 0, 0},
        {"f16 -> bf16", "vector", ST_CODEC_BF16, ST_CODEC_F16, 0, 0, 0},
        {"bf16 encode", "element", ST_CODEC_BF16, ST_CODEC_FP32, 0, 2, 0},
        {"bf16 encode", "byte", ST_CODEC_BF16, ST_CODEC_FP32, 1, 0, 0},
    };
    const size_t nrows = sizeof rows / sizeof rows[0];
    for (size_t r = 0; r < nrows; r++) {
        struct row *w = &rows[r];
        unsigned char *src, *dst;
        if (w->src_id == ST_CODEC_FP32) {
            src = d_f32;
            dst = d_h16;
        } else if (w->dst_id == ST_CODEC_FP32) {
            /* this op's own encoding of the data as input */
            ST(st_codec_cuda_convert(w->src_id, d_h16, ST_CODEC_FP32, d_f32, n, t.stream));
            src = d_h16;
            dst = d_out32;
        } else {
            ST(st_codec_cuda_convert(w->src_id, d_h16, ST_CODEC_FP32, d_f32, n, t.stream));
            src = d_h16;
            dst = d_h16b;
        }
        if (w->src_off) { /* the byte kernel reads src at an odd address: shift the data */
            CK(cudaMemcpyAsync(d_out32 + w->src_off, src, n * st_codec_elem_size(w->src_id),
                               cudaMemcpyDeviceToDevice, t.stream));
            src = d_out32;
        }
        w->ms = best_of((int)runs, &t, &lim, w->dst_id, dst + w->dst_off, w->src_id,
                        src + w->src_off, n);
    }

    /* host link */
    float h2d = copy_best((int)runs, &t, d_f32, h_f32, f32_bytes, cudaMemcpyHostToDevice);
    float d2h = copy_best((int)runs, &t, h_f32, d_f32, f32_bytes, cudaMemcpyDeviceToHost);
    float d2h_half = copy_best((int)runs, &t, h_f32, d_h16, h16_bytes, cudaMemcpyDeviceToHost);
    float snap = 1e30f;
    for (int r = 0; r <= runs; r++) {
        float ms = 0;
        CK(cudaEventRecord(t.e0, t.stream));
        ST(st_codec_cuda_convert(ST_CODEC_BF16, d_h16, ST_CODEC_FP32, d_f32, n, t.stream));
        CK(cudaMemcpyAsync(h_f32, d_h16, h16_bytes, cudaMemcpyDeviceToHost, t.stream));
        CK(cudaEventRecord(t.e1, t.stream));
        CK(cudaStreamSynchronize(t.stream));
        CK(cudaEventElapsedTime(&ms, t.e0, t.e1));
        if (r > 0 && ms < snap)
            snap = ms;
    }

    /* the outputs against the CPU codecs, on the first TILE elements of each vector op;
     * d_f32 still holds the data (only host buffers and 16-bit buffers were written since) */
    size_t m = tile;
    float *in32 = malloc(m * 4), *want32 = malloc(m * 4), *got32 = malloc(m * 4);
    uint16_t *in16 = malloc(m * 2), *want16 = malloc(m * 2), *got16 = malloc(m * 2);
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    int same = in32 && want32 && got32 && in16 && want16 && got16 && scratch;
    if (same)
        CK(cudaMemcpy(in32, d_f32, m * 4, cudaMemcpyDeviceToHost));
    for (size_t r = 0; r < 6 && same; r++) {
        struct row *w = &rows[r];
        size_t osz = st_codec_elem_size(w->dst_id), isz = st_codec_elem_size(w->src_id);
        const void *in = in32;
        if (w->src_id != ST_CODEC_FP32) {
            ST(st_codec_convert(w->src_id, in16, ST_CODEC_FP32, in32, m, NULL, 0));
            CK(cudaMemcpy(d_h16, in16, m * isz, cudaMemcpyHostToDevice));
            in = in16;
        }
        unsigned char *src = w->src_id == ST_CODEC_FP32 ? d_f32 : d_h16;
        unsigned char *dst = w->dst_id == ST_CODEC_FP32 ? d_out32 : d_h16b;
        void *want = osz == 4 ? (void *)want32 : (void *)want16;
        void *got = osz == 4 ? (void *)got32 : (void *)got16;
        ST(st_codec_convert(w->dst_id, want, w->src_id, in, m, scratch, ST_CODEC_SCRATCH_MAX));
        ST(st_codec_cuda_convert(w->dst_id, dst, w->src_id, src, m, NULL));
        ST(st_codec_cuda_sync(NULL));
        CK(cudaMemcpy(got, dst, m * osz, cudaMemcpyDeviceToHost));
        same = memcmp(got, want, m * osz) == 0;
    }

    double copy_gbs = 2.0 * (double)f32_bytes / ((double)lim.best_ms * 1e6);
    printf("bench_gpu_codec: %s (sm_%d%d, %d SMs), %ld MiB of fp32 (%zu values) per buffer, best "
           "of %ld runs, CUDA events\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, size_mib, n, runs);
    printf("limit: device-to-device cudaMemcpy of the %ld MiB fp32 buffer: %.0f GB/s moved "
           "(read + written; best of %d copies made before the timed runs)\n\n", size_mib,
           copy_gbs, lim.samples);
    printf("%-12s %-8s %5s %5s %12s %8s %11s\n", "op", "kernel", "src+", "dst+", "GB/s moved",
           "x D2D", "GB/s fp32");
    for (size_t r = 0; r < nrows; r++) {
        struct row *w = &rows[r];
        double moved = (double)n * (double)(st_codec_elem_size(w->src_id) +
                                            st_codec_elem_size(w->dst_id));
        double gbs = moved / ((double)w->ms * 1e6);
        printf("%-12s %-8s %5zu %5zu %12.0f %8.2f %11.0f\n", w->op, w->kernel, w->src_off,
               w->dst_off, gbs, gbs / copy_gbs, (double)n * 4.0 / ((double)w->ms * 1e6));
    }
    double h2d_gbs = (double)f32_bytes / ((double)h2d * 1e6);
    double d2h_gbs = (double)f32_bytes / ((double)d2h * 1e6);
    printf("\npinned host<->device, %ld MiB: host->device %.1f GB/s, device->host %.1f GB/s "
           "(device->host of %ld MiB: %.1f GB/s)\n", size_mib, h2d_gbs, d2h_gbs, size_mib / 2,
           (double)h16_bytes / ((double)d2h_half * 1e6));
    printf("state to pinned host, %ld MiB of fp32: as fp32 %.2f ms; bf16 encode + copy of %ld MiB "
           "%.2f ms = %.1f GB/s of fp32 state, %.2fx the fp32 copy\n", size_mib, (double)d2h,
           size_mib / 2, (double)snap, (double)f32_bytes / ((double)snap * 1e6),
           (double)d2h / (double)snap);
    /* the state hash's block digests on the GPU (st_codec_cuda_checksum_blocks, XXH3-64 of 1 MiB
     * blocks, one warp a block): the whole buffer, and one block alone (the latency of one
     * block's sequential chain, which bounds the hash of any state) */
    uint64_t *d_dg = dev_alloc(((size_t)size_mib + 1) * 8);
    float hash_all = 1e30f, hash_one = 1e30f, ms = 0;
    for (int r = 0; r <= runs; r++) {
        CK(cudaEventRecord(t.e0, t.stream));
        ST(st_codec_cuda_checksum_blocks(d_f32, f32_bytes, (uint64_t)1 << 20, d_dg, t.stream));
        CK(cudaEventRecord(t.e1, t.stream));
        ST(st_codec_cuda_checksum_blocks(d_f32, (uint64_t)1 << 20, (uint64_t)1 << 20, d_dg,
                                         t.stream));
        CK(cudaEventRecord(t.e2, t.stream));
        CK(cudaStreamSynchronize(t.stream));
        CK(cudaEventElapsedTime(&ms, t.e0, t.e1));
        if (r > 0 && ms < hash_all)
            hash_all = ms;
        CK(cudaEventElapsedTime(&ms, t.e1, t.e2));
        if (r > 0 && ms < hash_one)
            hash_one = ms;
    }
    uint64_t dg0 = 0;
    CK(cudaMemcpy(&dg0, d_dg, 8, cudaMemcpyDeviceToHost));
    int hash_same = !in32 ||
                    dg0 == st_checksum(in32, (size_t)1 << 20 < m * 4 ? (size_t)1 << 20 : m * 4) ||
                    m * 4 < ((size_t)1 << 20);
    double hash_gbs = (double)f32_bytes / ((double)hash_all * 1e6);
    printf("state hash on the GPU (XXH3-64 of 1 MiB blocks, one warp each), %ld MiB: %.3f ms = "
           "%.0f GB/s read, %.2fx the D2D copy's read rate; one 1 MiB block alone %.3f ms; first "
           "digest = CPU's: %s\n", size_mib, (double)hash_all, hash_gbs, hash_gbs / (copy_gbs / 2),
           (double)hash_one, hash_same ? "yes" : "NO");
    cudaFree(d_dg);
    same = same && hash_same;

    printf("\nGPU outputs = CPU codecs on the first %zu elements of each vector op: %s\n", m,
           same ? "yes" : "NO");

    cudaFreeHost(h_f32);
    cudaFree(d_f32);
    cudaFree(d_out32);
    cudaFree(d_h16);
    cudaFree(d_h16b);
    cudaFree(d_copy);
    cudaEventDestroy(t.e0);
    cudaEventDestroy(t.e1);
    cudaEventDestroy(t.e2);
    cudaStreamDestroy(t.stream);
    free(in32);
    free(want32);
    free(got32);
    free(in16);
    free(want16);
    free(got16);
    free(scratch);
    return same ? 0 : 1;
}
