/*
 * bench_codec.c - throughput of the element codecs and of the lossless framing, each as a ratio
 * to memcpy measured in the same run.
 *
 * Element codecs: for every ISA level this CPU has, bf16 and f16 encode (fp32 -> 16 bit) and
 * decode (16 bit -> fp32), and the snapshot direction's bf16 encode in streaming stores ("bf16
 * stream", st_codec_bf16_encode_stream), over --size-mib MiB of fp32 (default 1024). The figure is GB/s of fp32
 * data processed (10^9 bytes of fp32 read by an encode or written by a decode, per second), and
 * "x memcpy" is the time memcpy takes to copy the same fp32 byte count divided by the codec's
 * time. The memcpy is sampled before every timed run all through the benchmark and its best time
 * is the limit, so background load cannot flatter the ratios. Every buffer's pages are touched
 * before timing. Best of 3 runs.
 *
 * Framing: st_frame_encode / st_frame_decode over --frame-mib MiB of the same fp32 values
 * (default 64) and over those values encoded as bf16, with and without byte-shuffle, at zstd
 * levels 1 and 3. MB/s counts uncompressed bytes (10^6 per second); ratio is uncompressed /
 * framed size. Best of 3 runs.
 *
 * The data look like recurrent state: rows of 4096 values, each row an AR(1) process (smooth,
 * correlated neighbours) of near-Gaussian innovations, scaled by a per-row magnitude between
 * 1e-3 and 10. Never zeros.
 */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_codec.h"

#define RUNS 3
#define MIB (1024.0 * 1024.0)

static uint64_t rng_state = 0x5eed;

static uint64_t rng_next(void)
{
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

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
        fprintf(stderr, "bench_codec: cannot allocate %zu bytes\n", bytes);
        exit(1);
    }
    memset(p, 0x11, bytes); /* fault every page in before anything is timed */
    return p;
}

static void fill_state_like(float *x, size_t n)
{
    const size_t row = 4096;
    for (size_t r = 0; r < n; r += row) {
        double scale = pow(10.0, -3.0 + 4.0 * (double)(rng_next() >> 11) * 0x1p-53);
        double v = 0.0;
        for (size_t i = r; i < n && i < r + row; i++) {
            uint64_t u = rng_next();
            /* sum of four uniform 16-bit values: mean 0, variance 1 after scaling */
            double g = ((double)(u & 0xffff) + (double)((u >> 16) & 0xffff) +
                        (double)((u >> 32) & 0xffff) + (double)(u >> 48) - 131070.0) /
                       37837.0;
            v = 0.9 * v + 0.4359 * g;
            x[i] = (float)(scale * v);
        }
    }
}

typedef void (*bench_fn)(void *dst, const void *src, size_t n);

static void run_bf16_encode(void *dst, const void *src, size_t n)
{
    st_codec_bf16_encode(dst, src, n);
}
static void run_bf16_stream(void *dst, const void *src, size_t n)
{
    st_codec_bf16_encode_stream(dst, NULL, src, n);
}
static void run_bf16_decode(void *dst, const void *src, size_t n)
{
    st_codec_bf16_decode(dst, src, n);
}
static void run_f16_encode(void *dst, const void *src, size_t n)
{
    st_codec_f16_encode(dst, src, n);
}
static void run_f16_decode(void *dst, const void *src, size_t n)
{
    st_codec_f16_decode(dst, src, n);
}

/* Best of RUNS for fn, each run preceded by a memcpy of the same fp32 bytes into *copy_best's
 * buffers: the limit is sampled all through the benchmark and its best time is kept, so a quiet
 * moment that favours one op also favours the limit. */
struct limit {
    void *dst;
    const void *src;
    size_t bytes;
    double best;
};

static double best_time(struct limit *lim, bench_fn fn, void *dst, const void *src, size_t n)
{
    double best = 1e30;
    for (int r = 0; r < RUNS; r++) {
        double t0 = now();
        memcpy(lim->dst, lim->src, lim->bytes);
        double t1 = now();
        fn(dst, src, n);
        double t2 = now();
        if (t1 - t0 < lim->best)
            lim->best = t1 - t0;
        if (t2 - t1 < best)
            best = t2 - t1;
    }
    return best;
}

static int bench_elements(size_t bytes)
{
    size_t n = bytes / 4;
    float *src = alloc_touched(n * 4);
    uint16_t *half = alloc_touched(n * 2);
    float *wide = alloc_touched(n * 4);
    float *copy = alloc_touched(n * 4);
    fill_state_like(src, n);
    struct limit lim = {copy, src, n * 4, 1e30};

    static const struct {
        const char *name;
        bench_fn fn;
        int encode;
    } ops[] = {
        {"bf16 encode", run_bf16_encode, 1},
        {"bf16 decode", run_bf16_decode, 0},
        {"f16 encode", run_f16_encode, 1},
        {"f16 decode", run_f16_decode, 0},
        {"bf16 stream", run_bf16_stream, 1},
    };
    enum { N_OPS = sizeof ops / sizeof ops[0] };
    double t[ST_ISA_AVX512 + 1][N_OPS];
    uint64_t ref_sum[N_OPS] = {0};
    int same = 1;
    int best_level = (int)st_codec_isa_best();
    for (int level = ST_ISA_SCALAR; level <= best_level; level++) {
        if (st_codec_isa_set((st_codec_isa_level)level) != 0)
            return 1;
        for (size_t o = 0; o < N_OPS; o++) {
            uint64_t sum;
            if (ops[o].encode) {
                t[level][o] = best_time(&lim, ops[o].fn, half, src, n);
                sum = st_checksum(half, n * 2);
            } else {
                /* decode input: this op's own encoding of the data, made by the same level */
                (o == 1 ? run_bf16_encode : run_f16_encode)(half, src, n);
                t[level][o] = best_time(&lim, ops[o].fn, wide, half, n);
                sum = st_checksum(wide, n * 4);
            }
            if (level == ST_ISA_SCALAR)
                ref_sum[o] = sum;
            else if (sum != ref_sum[o])
                same = 0;
        }
    }
    st_codec_isa_set(st_codec_isa_best());
    if (ref_sum[N_OPS - 1] != ref_sum[0]) /* the streaming encode writes the encode's codes */
        same = 0;

    printf("Element codecs: %zu MiB of fp32 (%zu values), best of %d; GB/s = 10^9 bytes of fp32 "
           "per second\n", bytes >> 20, n, RUNS);
    printf("memcpy of the same fp32 bytes: %.2f GB/s (the limit: best of %d copies made between "
           "the runs; x memcpy = memcpy time / op time)\n\n", (double)(n * 4) / lim.best / 1e9,
           RUNS * N_OPS * (best_level + 1));
    printf("%-12s %-8s %10s %10s\n", "op", "isa", "GB/s fp32", "x memcpy");
    for (int level = ST_ISA_SCALAR; level <= best_level; level++)
        for (size_t o = 0; o < N_OPS; o++)
            printf("%-12s %-8s %10.2f %10.2f\n", ops[o].name,
                   st_codec_isa_name((st_codec_isa_level)level),
                   (double)(n * 4) / t[level][o] / 1e9, lim.best / t[level][o]);
    printf("\noutputs bit-identical across ISA levels: %s\n\n", same ? "yes" : "NO");
    free(src);
    free(half);
    free(wide);
    free(copy);
    return same ? 0 : 1;
}

static int bench_framing(size_t bytes)
{
    size_t n = bytes / 4;
    float *f32 = alloc_touched(n * 4);
    uint16_t *b16 = alloc_touched(n * 2);
    fill_state_like(f32, n);
    st_codec_bf16_encode(b16, f32, n);
    size_t cap = st_frame_bound(n * 4);
    unsigned char *frame = alloc_touched(cap);
    unsigned char *back = alloc_touched(n * 4);
    st_frame_ctx *ctx = st_frame_ctx_new();
    if (!ctx)
        return 1;

    /* the limit: memcpy of the fp32 bytes, sampled before every framing run, best kept */
    struct limit lim = {back, f32, n * 4, 1e30};
    struct row {
        double ratio, enc, dec;
    } rows[8];
    int nrows = 0;

    int rc = 0;
    for (int d = 0; d < 2 && rc == 0; d++) {
        const void *src = d == 0 ? (const void *)f32 : (const void *)b16;
        size_t len = d == 0 ? n * 4 : n * 2;
        unsigned width = d == 0 ? 4 : 2;
        for (int sh = 1; sh >= 0 && rc == 0; sh--) {
            for (int level = 1; level <= 3 && rc == 0; level += 2) {
                size_t flen = 0, dlen = 0;
                double te = 1e30, td = 1e30;
                for (int r = 0; r < RUNS && rc == 0; r++) {
                    double t0 = now();
                    memcpy(lim.dst, lim.src, lim.bytes);
                    double t1 = now();
                    rc = st_frame_encode(ctx, frame, cap, src, len, sh ? width : 0, level, &flen);
                    double t2 = now();
                    if (rc == 0)
                        rc = st_frame_decode(ctx, back, len, frame, flen, &dlen);
                    double t3 = now();
                    lim.best = t1 - t0 < lim.best ? t1 - t0 : lim.best;
                    te = t2 - t1 < te ? t2 - t1 : te;
                    td = t3 - t2 < td ? t3 - t2 : td;
                }
                if (rc == 0 && (dlen != len || memcmp(back, src, len) != 0))
                    rc = st_error_set(ST_ECORRUPT, "framing round trip differs");
                if (rc) {
                    fprintf(stderr, "bench_codec: framing: %s (%s)\n", st_strerror(rc),
                            st_errdetail());
                    break;
                }
                rows[nrows++] = (struct row){(double)len / (double)flen, (double)len / te / 1e6,
                                             (double)len / td / 1e6};
            }
        }
    }
    if (rc == 0) {
        double copy_mbs = (double)(n * 4) / lim.best / 1e6;
        printf("Lossless framing: %zu MiB of fp32 and the same values as bf16 (%zu MiB), best "
               "of %d; MB/s = 10^6 uncompressed bytes per second\n", bytes >> 20,
               (n * 2) >> 20, RUNS);
        printf("memcpy: %.0f MB/s (best of the copies made between the runs; x memcpy = MB/s / "
               "memcpy MB/s); ratio = input bytes / frame bytes\n\n", copy_mbs);
        printf("%-5s %-8s %5s %7s %12s %9s %12s %9s\n", "data", "shuffle", "level", "ratio",
               "encode MB/s", "x memcpy", "decode MB/s", "x memcpy");
        for (int i = 0; i < nrows; i++)
            printf("%-5s %-8s %5d %7.3f %12.0f %9.3f %12.0f %9.3f\n", i < 4 ? "fp32" : "bf16",
                   (i % 4) < 2 ? "yes" : "no", (i % 2) ? 3 : 1, rows[i].ratio, rows[i].enc,
                   rows[i].enc / copy_mbs, rows[i].dec, rows[i].dec / copy_mbs);
    }
    st_frame_ctx_free(ctx);
    free(f32);
    free(b16);
    free(frame);
    free(back);
    return rc ? 1 : 0;
}

static void usage(void)
{
    fprintf(stderr, "usage: bench_codec [--quick] [--size-mib N] [--frame-mib N]\n"
                    "  --quick        a short run: --size-mib 128 --frame-mib 16\n"
                    "  --size-mib N   fp32 MiB for the element codecs (default 1024)\n"
                    "  --frame-mib N  fp32 MiB for the framing (default 64, at most --size-mib)\n");
}

int main(int argc, char **argv)
{
    long size_mib = 1024, frame_mib = 64;
    for (int i = 1; i < argc; i++) {
        long *target = NULL;
        if (strcmp(argv[i], "--size-mib") == 0)
            target = &size_mib;
        else if (strcmp(argv[i], "--frame-mib") == 0)
            target = &frame_mib;
        else if (strcmp(argv[i], "--help") == 0) {
            usage();
            return 0;
        } else if (strcmp(argv[i], "--quick") == 0) {
            size_mib = 128;
            frame_mib = 16;
            continue;
        }
        char *end = NULL;
        if (!target || i + 1 >= argc || (*target = strtol(argv[++i], &end, 10)) <= 0 || *end ||
            *target > 65536) {
            usage();
            return 2;
        }
    }
    if (frame_mib > size_mib)
        frame_mib = size_mib;
    printf("bench_codec: codec ISA levels on this CPU: scalar..%s\n\n",
           st_codec_isa_name(st_codec_isa_best()));
    int rc = bench_elements((size_t)size_mib << 20);
    if (rc == 0)
        rc = bench_framing((size_t)frame_mib << 20);
    return rc;
}
