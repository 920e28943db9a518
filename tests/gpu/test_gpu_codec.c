/*
 * test_gpu_codec.c - the GPU codecs (st_codec_cuda_convert) against the CPU scalar reference,
 * byte for byte:
 * - decode and the bf16 <-> f16 pairs on all 2^16 encodings;
 * - both encoders on every one of the 2^32 fp32 bit patterns;
 * - both encoders on 16 Mi inputs from a generator of every special class, and the decoders on
 *   16 Mi random halves, each at four alignments (the vector kernel with and without head
 *   elements, the element and the byte kernels);
 * - all nine codec pairs at lengths 0..40 and byte offsets 0..7 of source and destination, with
 *   guard bytes around the destination that must stay untouched;
 * - the error cases (unknown codec, NULL, host memory, overlap) and pinned host memory.
 * Runs only under the ctest label `gpu`. Without a usable CUDA device it FAILS, it never skips:
 * running this test means a GPU was expected.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime_api.h>

#include "st_codec.h"
#include "gpu_test.h"

#define N_RANDOM ((size_t)1 << 24)    /* elements per random run */
#define SWEEP_CHUNK ((size_t)1 << 26) /* fp32 patterns per chunk of the 2^32 sweep */

/* ---- inputs ------------------------------------------------------------------------------- */

static uint64_t rng_s[2];

/* xorshift128+, fixed seed: a failure reproduces. */
static uint64_t rng(void)
{
    uint64_t a = rng_s[0], b = rng_s[1];
    rng_s[0] = b;
    a ^= a << 23;
    rng_s[1] = a ^ b ^ (a >> 17) ^ (b >> 26);
    return rng_s[1] + b;
}

static void rng_seed(uint64_t seed)
{
    rng_s[0] = seed ^ 0x243f6a8885a308d3ull;
    rng_s[1] = seed * 0x9e3779b97f4a7c15ull + 1;
    for (int i = 0; i < 16; i++)
        rng();
}

/* Boundaries where bf16 or f16 change behaviour; each is also used with a random distance
 * of up to +-3 ulps of fp32. */
static const uint32_t edges[] = {
    0x00000000u, 0x00000001u, 0x007fffffu, 0x00800000u, /* 0, fp32 subnormals, min normal */
    0x7f7fffffu, 0x7f800000u, 0x7f800001u, 0x7fc00000u, /* max finite, Inf, NaNs */
    0x7f7f7fffu, 0x7f7f8000u, 0x7f7f8001u,              /* bf16 overflow to Inf */
    0x00008000u, 0x00018000u,                           /* bf16 underflow ties */
    0x477fe000u, 0x477ff000u, 0x47800000u,              /* f16 max, overflow tie, 65536 */
    0x38800000u, 0x387fe000u, 0x387ff000u,              /* f16 min normal and below */
    0x33000000u, 0x33800000u, 0x33c00000u, 0x34000000u, /* f16 zero threshold, min subnormal */
    0x3f800000u, 0x3f801000u, 0x3f808000u, 0xbf808000u, /* ties near 1 */
};
#define N_EDGES (sizeof edges / sizeof edges[0])

static uint32_t gen_input(void)
{
    uint64_t r = rng();
    uint32_t sign = (uint32_t)r & 0x80000000u;
    uint32_t mant = (uint32_t)(r >> 32) & 0x7fffffu;
    uint32_t k = (uint32_t)(r >> 56);
    int near = (int)((r >> 1) & 7) - 3; /* -3 .. +4 ulps */

    switch ((r >> 4) % 12) {
    case 0: /* any pattern */
    case 1:
        return (uint32_t)(r >> 16);
    case 2: { /* bf16 tie +-3, any exponent (also subnormal and overflow) */
        uint32_t hi = (uint32_t)(r >> 24) & 0x7fff0000u;
        return sign | ((hi | 0x8000u) + (uint32_t)near);
    }
    case 3: { /* f16 normal tie: exponents 113..142 */
        uint32_t e = 113u + k % 30u;
        return sign | (e << 23) | (((mant & ~0x1fffu) | 0x1000u) + (uint32_t)near);
    }
    case 4: { /* f16 subnormal tie: exponents 102..112 round at bit 126 - e */
        uint32_t e = 102u + k % 11u, sh = 126u - e;
        uint32_t m = ((mant >> sh) << sh) | (1u << (sh - 1u));
        return sign | (((e << 23) | m) + (uint32_t)near);
    }
    case 5: /* the f16 range, exponents 98..145 with random mantissas */
        return sign | ((98u + k % 48u) << 23) | mant;
    case 6: /* NaN, quiet or signalling, payload anywhere (low bits only too) */
        if (k & 1)
            mant &= 0x1fffu;
        return sign | 0x7f800000u | (mant ? mant : 0x1u);
    case 7: /* fp32 subnormals of every size */
        return sign | (mant >> (k % 23u));
    case 8: /* +-0, +-Inf */
        return sign | ((k & 1) ? 0x7f800000u : 0u);
    case 9: /* large finite: bf16 and f16 overflow region */
        return sign | ((0x8eu + k % 0x71u) << 23) | mant;
    default: /* next to a boundary */
        return sign | (edges[k % N_EDGES] + (uint32_t)near);
    }
}

/* ---- helpers ------------------------------------------------------------------------------ */

static void *dev_alloc(size_t bytes)
{
    void *p = NULL;
    CU_OK(cudaMalloc(&p, bytes ? bytes : 1));
    return p;
}

static void *host_alloc(size_t bytes)
{
    void *p = malloc(bytes ? bytes : 1);
    assert_non_null(p);
    return p;
}

/* The CPU reference: the scalar level, forced. */
static void *cpu_scratch;

static void cpu_convert(uint32_t dst_id, void *dst, uint32_t src_id, const void *src, size_t n)
{
    ST_OK(st_codec_isa_set(ST_ISA_SCALAR));
    ST_OK(st_codec_convert(dst_id, dst, src_id, src, n, cpu_scratch, ST_CODEC_SCRATCH_MAX));
}

static void gpu_convert_sync(uint32_t dst_id, void *dst, uint32_t src_id, const void *src,
                             size_t n)
{
    ST_OK(st_codec_cuda_convert(dst_id, dst, src_id, src, n, NULL));
    ST_OK(st_codec_cuda_sync(NULL));
}

static uint32_t load_elem(const unsigned char *p, size_t size, size_t i)
{
    uint32_t v = 0;
    memcpy(&v, p + size * i, size);
    return v;
}

/* Compare n elements of `size` bytes; name the first difference with its input. */
static void expect_same(const void *got, const void *want, const void *in, size_t in_size,
                        size_t size, size_t n, const char *what)
{
    if (memcmp(got, want, n * size) == 0)
        return;
    for (size_t i = 0; i < n; i++) {
        uint32_t g = load_elem(got, size, i), w = load_elem(want, size, i);
        if (g != w)
            fail_msg("%s: element %zu, input 0x%0*x: GPU 0x%0*x, CPU 0x%0*x", what, i,
                     (int)(2 * in_size), load_elem(in, in_size, i), (int)(2 * size), g,
                     (int)(2 * size), w);
    }
}

/* ---- tests -------------------------------------------------------------------------------- */

static void test_device_present(void **state)
{
    int dev = 0;
    struct cudaDeviceProp prop;
    if (!st_codec_cuda_available())
        fail_msg("no usable CUDA device: %s (this test runs only under the gpu label)",
                 st_errdetail());
    CU_OK(cudaGetDevice(&dev));
    CU_OK(cudaGetDeviceProperties(&prop, dev));
    print_message("GPU %d: %s, sm_%d%d, %d SMs\n", dev, prop.name, prop.major, prop.minor,
                  prop.multiProcessorCount);
}

/* Every 16-bit encoding through the four conversions that take 16-bit input. */
static void test_all_encodings(void **state)
{
    static const uint32_t pairs[4][2] = {
        {ST_CODEC_FP32, ST_CODEC_BF16},
        {ST_CODEC_FP32, ST_CODEC_F16},
        {ST_CODEC_F16, ST_CODEC_BF16},
        {ST_CODEC_BF16, ST_CODEC_F16},
    };
    const size_t n = 65536;
    uint16_t *in = host_alloc(n * 2);
    unsigned char *want = host_alloc(n * 4), *got = host_alloc(n * 4);
    void *d_in = dev_alloc(n * 2), *d_out = dev_alloc(n * 4);
    for (size_t i = 0; i < n; i++)
        in[i] = (uint16_t)i;
    CU_OK(cudaMemcpy(d_in, in, n * 2, cudaMemcpyHostToDevice));
    for (int p = 0; p < 4; p++) {
        uint32_t dst_id = pairs[p][0], src_id = pairs[p][1];
        size_t out = st_codec_elem_size(dst_id);
        char what[64];
        snprintf(what, sizeof what, "%s -> %s, all 2^16", st_codec_name(src_id),
                 st_codec_name(dst_id));
        cpu_convert(dst_id, want, src_id, in, n);
        CU_OK(cudaMemset(d_out, 0xa5, n * 4));
        gpu_convert_sync(dst_id, d_out, src_id, d_in, n);
        CU_OK(cudaMemcpy(got, d_out, n * out, cudaMemcpyDeviceToHost));
        expect_same(got, want, in, 2, out, n, what);
    }
    cudaFree(d_in);
    cudaFree(d_out);
    free(in);
    free(want);
    free(got);
}

/* Both encoders on all 2^32 fp32 bit patterns, in chunks. */
static void test_encode_every_fp32(void **state)
{
    const size_t n = SWEEP_CHUNK;
    uint32_t *in = NULL;
    uint16_t *got = NULL, *want = host_alloc(n * 2);
    void *d_in = dev_alloc(n * 4), *d_out = dev_alloc(n * 2);
    CU_OK(cudaMallocHost((void **)&in, n * 4));
    CU_OK(cudaMallocHost((void **)&got, n * 2));
    for (uint64_t base = 0; base < ((uint64_t)1 << 32); base += n) {
        for (size_t i = 0; i < n; i++)
            in[i] = (uint32_t)(base + i);
        CU_OK(cudaMemcpy(d_in, in, n * 4, cudaMemcpyHostToDevice));
        for (uint32_t id = ST_CODEC_BF16; id <= ST_CODEC_F16; id++) {
            char what[64];
            snprintf(what, sizeof what, "fp32 -> %s, every pattern", st_codec_name(id));
            ST_OK(st_codec_cuda_convert(id, d_out, ST_CODEC_FP32, d_in, n, NULL));
            cpu_convert(id, want, ST_CODEC_FP32, in, n); /* overlaps the kernel */
            ST_OK(st_codec_cuda_sync(NULL));
            CU_OK(cudaMemcpy(got, d_out, n * 2, cudaMemcpyDeviceToHost));
            expect_same(got, want, in, 4, 2, n, what);
        }
    }
    cudaFreeHost(in);
    cudaFreeHost(got);
    cudaFree(d_in);
    cudaFree(d_out);
    free(want);
}

/* Large buffers at four alignments (byte offsets from cudaMalloc's 256-byte alignment):
 * (0, 0) the vector kernel; (one element, one element) the vector kernel after 3 head
 * elements; (one element, 0) element aligned but never on a unit boundary together: the element
 * kernel; (3, 1) odd addresses: the byte kernel. The lengths are odd and span many grid-stride
 * passes. */
static void check_big(uint32_t dst_id, uint32_t src_id, const unsigned char *in, size_t n)
{
    size_t isz = st_codec_elem_size(src_id), osz = st_codec_elem_size(dst_id);
    const size_t offsets[4][2] = {{0, 0}, {isz, osz}, {isz, 0}, {3, 1}}; /* src, dst bytes */
    unsigned char *want = host_alloc(n * osz + 16), *got = host_alloc(n * osz + 16);
    unsigned char *d_in = dev_alloc(n * isz + 16), *d_out = dev_alloc(n * osz + 16);
    cpu_convert(dst_id, want, src_id, in, n);
    for (int a = 0; a < 4; a++) {
        size_t so = offsets[a][0], dof = offsets[a][1];
        char what[96];
        snprintf(what, sizeof what, "%s -> %s, %zu elements, src +%zu dst +%zu bytes",
                 st_codec_name(src_id), st_codec_name(dst_id), n, so, dof);
        CU_OK(cudaMemcpy(d_in + so, in, n * isz, cudaMemcpyHostToDevice));
        CU_OK(cudaMemset(d_out, 0xa5, n * osz + 16));
        gpu_convert_sync(dst_id, d_out + dof, src_id, d_in + so, n);
        CU_OK(cudaMemcpy(got, d_out, n * osz + 16, cudaMemcpyDeviceToHost));
        expect_same(got + dof, want, in, isz, osz, n, what);
        for (size_t i = 0; i < dof; i++)
            assert_int_equal(got[i], 0xa5);
        for (size_t i = dof + n * osz; i < n * osz + 16; i++)
            assert_int_equal(got[i], 0xa5);
    }
    cudaFree(d_in);
    cudaFree(d_out);
    free(want);
    free(got);
}

static void test_encode_random(void **state)
{
    const size_t n = N_RANDOM + 3;
    uint32_t *in = host_alloc(n * 4);
    rng_seed(1);
    for (size_t i = 0; i < N_EDGES; i++)
        in[i] = edges[i];
    for (size_t i = N_EDGES; i < n; i++)
        in[i] = gen_input();
    check_big(ST_CODEC_BF16, ST_CODEC_FP32, (const unsigned char *)in, n);
    check_big(ST_CODEC_F16, ST_CODEC_FP32, (const unsigned char *)in, n);
    free(in);
}

static void test_decode_random(void **state)
{
    const size_t n = N_RANDOM + 5;
    uint16_t *in = host_alloc(n * 2);
    rng_seed(2);
    for (size_t i = 0; i < n; i++)
        in[i] = (uint16_t)(rng() >> 20);
    check_big(ST_CODEC_FP32, ST_CODEC_BF16, (const unsigned char *)in, n);
    check_big(ST_CODEC_FP32, ST_CODEC_F16, (const unsigned char *)in, n);
    check_big(ST_CODEC_F16, ST_CODEC_BF16, (const unsigned char *)in, n);
    check_big(ST_CODEC_BF16, ST_CODEC_F16, (const unsigned char *)in, n);
    check_big(ST_CODEC_BF16, ST_CODEC_BF16, (const unsigned char *)in, n);
    free(in);
}

/* Every pair, every length 0..40, every byte offset 0..7 of src and dst; guards around dst. */
static void test_pairs_lengths_offsets(void **state)
{
    enum { MAXN = 40, GUARD = 32, SRC_BYTES = 4 * MAXN + 8, DST_BYTES = GUARD + 4 * MAXN + 8 + GUARD };
    unsigned char src[SRC_BYTES], want[DST_BYTES], got[DST_BYTES];
    unsigned char *d_src = dev_alloc(SRC_BYTES), *d_dst = dev_alloc(DST_BYTES);
    rng_seed(3);
    for (size_t i = 0; i < SRC_BYTES; i += 4) {
        uint32_t v = gen_input();
        memcpy(src + i, &v, 4);
    }
    CU_OK(cudaMemcpy(d_src, src, SRC_BYTES, cudaMemcpyHostToDevice));
    for (uint32_t dst_id = 0; dst_id < ST_CODEC_COUNT; dst_id++) {
        for (uint32_t src_id = 0; src_id < ST_CODEC_COUNT; src_id++) {
            for (size_t n = 0; n <= MAXN; n++) {
                for (size_t so = 0; so < 8; so++) {
                    for (size_t dof = 0; dof < 8; dof++) {
                        char what[96];
                        snprintf(what, sizeof what, "%s -> %s, n %zu, src +%zu, dst +%zu",
                                 st_codec_name(src_id), st_codec_name(dst_id), n, so, dof);
                        memset(want, 0xa5, DST_BYTES);
                        cpu_convert(dst_id, want + GUARD + dof, src_id, src + so, n);
                        CU_OK(cudaMemset(d_dst, 0xa5, DST_BYTES));
                        gpu_convert_sync(dst_id, d_dst + GUARD + dof, src_id, d_src + so, n);
                        CU_OK(cudaMemcpy(got, d_dst, DST_BYTES, cudaMemcpyDeviceToHost));
                        for (size_t i = 0; i < DST_BYTES; i++) {
                            if (got[i] != want[i])
                                fail_msg("%s: byte %zu of the destination window (the "
                                         "elements start at %d): GPU 0x%02x, CPU 0x%02x",
                                         what, i, GUARD + (int)dof, got[i], want[i]);
                        }
                    }
                }
            }
        }
    }
    cudaFree(d_src);
    cudaFree(d_dst);
}

static void test_errors_and_memory_kinds(void **state)
{
    const size_t n = 1000;
    float *host = host_alloc(n * 4);
    float *pinned = NULL;
    unsigned char *d = dev_alloc(n * 4);
    uint16_t *want = host_alloc(n * 2), *got = host_alloc(n * 2);
    CU_OK(cudaMallocHost((void **)&pinned, n * 4));
    rng_seed(4);
    for (size_t i = 0; i < n; i++) {
        uint32_t v = gen_input();
        memcpy(&pinned[i], &v, 4);
    }

    assert_int_equal(st_codec_cuda_convert(3, d, ST_CODEC_FP32, d + 2048, 10, NULL), ST_ECODEC);
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, d, 7, d + 2048, 10, NULL), ST_ECODEC);
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, NULL, ST_CODEC_FP32, d, 10, NULL),
                     ST_EINVAL);
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, d, ST_CODEC_FP32, NULL, 10, NULL),
                     ST_EINVAL);
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, NULL, ST_CODEC_FP32, NULL, 0, NULL), 0);
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, d, ST_CODEC_FP32, d, SIZE_MAX / 2,
                                           NULL),
                     ST_EINVAL);
    /* Pageable host memory: refused before any kernel could touch it. */
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, d, ST_CODEC_FP32, host, n, NULL),
                     ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "not device memory"));
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_FP32, host, ST_CODEC_BF16, d, n, NULL),
                     ST_EINVAL);
    /* Overlap: dst inside src. */
    assert_int_equal(st_codec_cuda_convert(ST_CODEC_BF16, d + 100, ST_CODEC_FP32, d, 100, NULL),
                     ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "overlap"));
    /* Adjacent is not overlapping. */
    ST_OK(st_codec_cuda_convert(ST_CODEC_BF16, d + 400, ST_CODEC_FP32, d, 100, NULL));
    ST_OK(st_codec_cuda_sync(NULL));

    /* Mapped pinned host memory as the source works and matches the CPU. */
    cpu_convert(ST_CODEC_BF16, want, ST_CODEC_FP32, pinned, n);
    gpu_convert_sync(ST_CODEC_BF16, d, ST_CODEC_FP32, pinned, n);
    CU_OK(cudaMemcpy(got, d, n * 2, cudaMemcpyDeviceToHost));
    expect_same(got, want, pinned, 4, 2, n, "fp32 (pinned host) -> bf16");

    /* A stream of our own: copy in, convert, copy out, one synchronisation. */
    cudaStream_t s = NULL;
    unsigned char *d_out = dev_alloc(n * 2);
    CU_OK(cudaStreamCreate(&s));
    cpu_convert(ST_CODEC_F16, want, ST_CODEC_FP32, pinned, n);
    CU_OK(cudaMemcpyAsync(d, pinned, n * 4, cudaMemcpyHostToDevice, s));
    ST_OK(st_codec_cuda_convert(ST_CODEC_F16, d_out, ST_CODEC_FP32, d, n, s));
    CU_OK(cudaMemcpyAsync(got, d_out, n * 2, cudaMemcpyDeviceToHost, s));
    ST_OK(st_codec_cuda_sync(s));
    expect_same(got, want, pinned, 4, 2, n, "fp32 -> f16 on a stream");
    CU_OK(cudaStreamDestroy(s));
    cudaFree(d_out);

    cudaFreeHost(pinned);
    cudaFree(d);
    free(host);
    free(want);
    free(got);
}

/* Block digests on the GPU against st_checksum (libxxhash) on the CPU: every length 0..1,300 as
 * one block (every short path and the first block edges), at four byte offsets; then 5 MiB + 77
 * bytes cut in 1 MiB blocks (the state hash's) and in odd block sizes, and a zero buffer. */
static void test_checksum_blocks(void **state)
{
    (void)state;
    size_t max = ((size_t)5 << 20) + 77;
    unsigned char *h = host_alloc(max + 8);
    for (size_t i = 0; i < max + 8; i++)
        h[i] = (unsigned char)(rng() >> 56);
    unsigned char *d = dev_alloc(max + 8);
    uint64_t *dg = dev_alloc(8 * 32768), *got = host_alloc(8 * 32768);
    CU_OK(cudaMemcpy(d, h, max + 8, cudaMemcpyHostToDevice));
    for (size_t off = 0; off < 4; off++) {
        for (size_t n = 0; n <= 1300; n++)
            assert_int_equal(st_codec_cuda_checksum_blocks(d + off + 3 * n, n, n ? n : 1,
                                                           dg + n, NULL), 0);
        assert_int_equal(st_codec_cuda_sync(NULL), 0);
        CU_OK(cudaMemcpy(got, dg, 8 * 1301, cudaMemcpyDeviceToHost));
        for (size_t n = 1; n <= 1300; n++)
            if (got[n] != st_checksum(h + off + 3 * n, n))
                fail_msg("checksum of %zu bytes at offset %zu: GPU %016llx, CPU %016llx", n,
                         off + 3 * n, (unsigned long long)got[n],
                         (unsigned long long)st_checksum(h + off + 3 * n, n));
    }
    const uint64_t blocks[] = {(uint64_t)1 << 20, 4096, 1025, 241, 100000, (uint64_t)max};
    for (size_t k = 0; k < sizeof blocks / sizeof blocks[0]; k++) {
        for (int zero = 0; zero < 2; zero++) {
            size_t off = k % 4;
            if (zero)
                CU_OK(cudaMemset(d, 0, max + 8));
            uint64_t nb = (max + blocks[k] - 1) / blocks[k];
            assert_true(nb <= 32768);
            assert_int_equal(st_codec_cuda_checksum_blocks(d + off, max, blocks[k], dg, NULL), 0);
            assert_int_equal(st_codec_cuda_sync(NULL), 0);
            CU_OK(cudaMemcpy(got, dg, 8 * nb, cudaMemcpyDeviceToHost));
            unsigned char *ref = zero ? calloc(1, max + 8) : h;
            assert_non_null(ref);
            for (uint64_t b = 0; b < nb; b++) {
                uint64_t a = b * blocks[k], len = max - a < blocks[k] ? max - a : blocks[k];
                if (got[b] != st_checksum(ref + off + a, len))
                    fail_msg("block %llu of %llu bytes (block size %llu, %s): GPU %016llx",
                             (unsigned long long)b, (unsigned long long)len,
                             (unsigned long long)blocks[k], zero ? "zeros" : "random",
                             (unsigned long long)got[b]);
            }
            if (zero) {
                free(ref);
                CU_OK(cudaMemcpy(d, h, max + 8, cudaMemcpyHostToDevice));
            }
        }
    }
    assert_int_equal(st_codec_cuda_checksum_blocks(d, 10, 0, dg, NULL), ST_EINVAL);
    assert_int_equal(st_codec_cuda_checksum_blocks(h, 10, 4, dg, NULL), ST_EINVAL);
    assert_int_equal(st_codec_cuda_checksum_blocks(d, 0, 4, dg, NULL), 0);
    CU_OK(cudaFree(d));
    CU_OK(cudaFree(dg));
    free(h);
    free(got);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_device_present),
        cmocka_unit_test(test_all_encodings),
        cmocka_unit_test(test_pairs_lengths_offsets),
        cmocka_unit_test(test_errors_and_memory_kinds),
        cmocka_unit_test(test_encode_random),
        cmocka_unit_test(test_decode_random),
        cmocka_unit_test(test_encode_every_fp32),
        cmocka_unit_test(test_checksum_blocks),
    };
    if (!st_codec_cuda_available()) {
        fprintf(stderr, "test_gpu_codec: FAIL: no usable CUDA device (%s); this test runs only "
                        "under the ctest label gpu and needs one\n",
                st_errdetail());
        return 1;
    }
    cpu_scratch = malloc(ST_CODEC_SCRATCH_MAX);
    if (!cpu_scratch)
        return 1;
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    free(cpu_scratch);
    return rc;
}
