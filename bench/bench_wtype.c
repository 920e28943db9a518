/*
 * bench_wtype.c - the dot of a weight row (st_wtype.h) for every weight type, as GB/s of weight
 * bytes read, next to memcpy measured in the same run.
 *
 * A matrix of rows of --cols values (default 4096) holding --size-mib MiB of weight bytes in
 * the type (default 256, beyond the last-level cache) is multiplied by one f32 vector on one
 * thread (a decode step's matrix-vector product), by the traits' dot one row at a time and by
 * dot_rows over blocks of 48 rows; and dequantized to f32 row by row. GB/s is 10^9 weight bytes
 * per second. The rows are quantized from seeded Gaussian values (64 distinct rows, repeated).
 * memcpy copies the same byte count between two buffers of that size: "x memcpy" is the dot's
 * weight bytes per second over memcpy's bytes copied per second (memcpy reads and writes each
 * byte once, the dot only reads, so the ratio can exceed 1 when the dot is memory-bound). The
 * memcpy is sampled before every timed run and its best time is the limit. Every buffer is
 * touched before timing. Best of 3 runs. Scalar reference and AVX2 (where the CPU has it).
 *
 *   bench_wtype [--quick] [--size-mib N] [--cols N] [--type NAME]
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_wtype.h"

#define RUNS 3
#define DISTINCT_ROWS 64
#define ROW_BLOCK 48 /* rows per call of dot_rows (the engine's matmul tasks are 48 rows) */

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void *alloc_touched(size_t bytes)
{
    void *p = aligned_alloc(4096, (bytes + 4095) & ~(size_t)4095);
    if (!p) {
        fprintf(stderr, "bench_wtype: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    memset(p, 0x11, bytes);
    return p;
}

static uint64_t rng_state = 0x5eed;

static double rng_unit(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    return ((double)(z >> 11) + 0.5) * 0x1p-53;
}

static float rng_gauss(void)
{
    return (float)(sqrt(-2.0 * log(rng_unit())) * cos(6.283185307179586 * rng_unit()));
}

static double best_memcpy = 1e30;

static void sample_memcpy(void *dst, const void *src, size_t bytes)
{
    double t0 = now();
    memcpy(dst, src, bytes);
    double t = now() - t0;
    if (t < best_memcpy)
        best_memcpy = t;
}

int main(int argc, char **argv)
{
    size_t size_mib = 256;
    uint64_t cols = 4096;
    const char *only = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            size_mib = 64;
        else if (!strcmp(argv[i], "--size-mib") && i + 1 < argc)
            size_mib = (size_t)strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--cols") && i + 1 < argc)
            cols = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--type") && i + 1 < argc)
            only = argv[++i];
        else {
            fprintf(stderr, "usage: bench_wtype [--quick] [--size-mib N] [--cols N] [--type NAME]\n");
            return 2;
        }
    }
    if (size_mib == 0 || cols == 0 || cols % 256) {
        fprintf(stderr, "bench_wtype: --size-mib must be > 0 and --cols a multiple of 256\n");
        return 2;
    }
    size_t bytes = size_mib << 20;
    uint8_t *w = alloc_touched(bytes), *copy = alloc_touched(bytes);
    float *x = alloc_touched(cols * sizeof(float)), *src = alloc_touched(cols * sizeof(float));
    float y[ROW_BLOCK];
    for (uint64_t i = 0; i < cols; i++)
        x[i] = rng_gauss();
    int vec = st_wtype_has_avx2();
    printf("weight rows of %llu values, %zu MiB of weights, 1 thread (GB/s of weight bytes; "
           "x memcpy of the same bytes)\n",
           (unsigned long long)cols, size_mib);
    printf("  %-8s %10s %12s %10s %12s %10s\n", "type", "rows", "scalar GB/s", "x memcpy",
           vec ? "AVX2 GB/s" : "-", vec ? "x memcpy" : "");
    uint32_t n_types;
    const st_wtype *const *types = st_wtype_table(&n_types);
    struct {
        const st_wtype *t;
        uint64_t rows;
        double gbs[3][2];
    } res[64];
    memset(res, 0, sizeof res);
    if (n_types > 64)
        n_types = 64;
    for (uint32_t ti = 0; ti < n_types; ti++) {
        const st_wtype *t = types[ti];
        if (only && strcmp(only, t->name))
            continue;
        uint64_t rb;
        if (st_wtype_row_bytes(t, cols, &rb))
            continue;
        uint64_t rows = bytes / rb;
        for (uint64_t r = 0; r < rows; r++) {
            if (r < DISTINCT_ROWS) {
                for (uint64_t i = 0; i < cols; i++)
                    src[i] = 0.02f * rng_gauss();
                t->quantize(src, w + r * rb, cols);
            } else {
                memcpy(w + r * rb, w + (r % DISTINCT_ROWS) * rb, rb);
            }
        }
        volatile float sink = 0;
        /* way 0: one dot per row; 1: dot_rows over blocks of ROW_BLOCK rows; 2: dequantize */
        for (int way = 0; way < 3; way++)
            for (int v = 0; v <= vec; v++) {
                double best = 1e30;
                for (int run = 0; run < RUNS; run++) {
                    sample_memcpy(copy, w, bytes);
                    float acc = 0;
                    double t0 = now();
                    if (way == 0) {
                        for (uint64_t r = 0; r < rows; r++)
                            acc += t->dot[v](w + r * rb, x, cols);
                    } else if (way == 1) {
                        for (uint64_t r = 0; r < rows; r += ROW_BLOCK) {
                            uint32_t nr = (uint32_t)(rows - r < ROW_BLOCK ? rows - r : ROW_BLOCK);
                            t->dot_rows[v](w + r * rb, rb, nr, x, cols, y);
                            acc += y[0];
                        }
                    } else {
                        for (uint64_t r = 0; r < rows; r++) {
                            t->dequant[v](w + r * rb, src, cols);
                            acc += src[r % cols];
                        }
                    }
                    double el = now() - t0;
                    sink += acc;
                    if (el < best)
                        best = el;
                }
                res[ti].gbs[way][v] = (double)(rows * rb) / best / 1e9;
            }
        res[ti].t = t;
        res[ti].rows = rows;
        (void)sink;
    }
    /* printed once memcpy's best is known, so every ratio has the same limit */
    double mc = (double)bytes / best_memcpy / 1e9;
    static const char *const ways[3] = {"dot, one row at a time", "dot_rows, 4 rows side by side",
                                        "dequantize a row to f32"};
    for (int way = 0; way < 3; way++) {
        printf("%s:\n", ways[way]);
        for (uint32_t ti = 0; ti < n_types; ti++) {
            if (!res[ti].t)
                continue;
            printf("  %-8s %10llu %12.2f %10.2f", res[ti].t->name,
                   (unsigned long long)res[ti].rows, res[ti].gbs[way][0],
                   res[ti].gbs[way][0] / mc);
            if (vec)
                printf(" %12.2f %10.2f", res[ti].gbs[way][1], res[ti].gbs[way][1] / mc);
            printf("\n");
        }
    }
    printf("memcpy (best of every sample): %.2f GB/s copied\n", mc);
    free(w);
    free(copy);
    free(x);
    free(src);
    return 0;
}
