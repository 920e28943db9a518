/*
 * st_codec_cuda.cu - the element codecs on the GPU: fp32 <-> bf16, fp32 <-> IEEE half and
 * bf16 <-> f16 over device memory, bit-identical to the CPU codecs of st_elem.c.
 *
 * Invariants:
 * 1. Every element goes through the CPU scalar reference's functions: the encoders
 *    (st_cuda_bf16_from_bits, st_cuda_f16_from_bits) are st_elem.c's integer code line for
 *    line; f16 decode is the same function in fewer operations (one exact fp32 multiply by
 *    2^112, see st_cuda_f16_to_bits), checked against the reference on all 2^16 inputs. No CUDA
 *    conversion intrinsic is used: __float2bfloat16 and __float2half follow their own NaN rules
 *    and would have to be proven equal first. Results do not depend on FTZ or rounding modes.
 * 2. bf16 <-> f16 widens to fp32 in registers and narrows again; widening is exact, so this is
 *    bit for bit what the CPU's st_codec_convert gives through its fp32 scratch.
 * 3. Three kernels, chosen per call by the pointers' alignment, all giving the same bytes:
 *    - vector: units of 4 elements, one 16-byte (fp32) or 8-byte (16-bit) access per unit,
 *      consecutive threads on consecutive units, four units in flight per thread, grid-stride;
 *      used when some element index h < 4 puts src and dst both on a unit boundary (16 bytes
 *      for fp32, 8 for 16-bit), true for cudaMalloc'd buffers at element offsets that are
 *      multiples of 4. The first h elements and the tail (< 4) are done element by element by
 *      the first threads of the same launch.
 *    - element: one element a step with naturally aligned 2- or 4-byte accesses, when src and
 *      dst are each aligned to their element size but never reach a unit boundary together.
 *    - byte: one element a step assembled from single bytes, for elements at odd addresses
 *      (the CPU codecs accept any byte offset, so these do too).
 * 4. cudaError_t never leaves this file: every CUDA call is checked and its failure becomes
 *    ST_EIO (ENOMEM for an allocation failure) with a detail naming the call and the error.
 *    The exported functions allocate nothing and never synchronise except st_codec_cuda_sync.
 * 5. The thread bodies are __host__ __device__ so that their index logic can be run on the
 *    CPU against the reference (the kernels only pass in the thread index and the stride).
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include <cuda_runtime.h>

#include "st_codec.h"

#include "st_elem_cuda.cuh"
#include "st_xxh3.h"

/* ---- operations ------------------------------------------------------------------------------ */

enum st_cuda_op {
    ST_CUDA_BF16_ENCODE, /* fp32 -> bf16 */
    ST_CUDA_BF16_DECODE, /* bf16 -> fp32 */
    ST_CUDA_F16_ENCODE,  /* fp32 -> f16 */
    ST_CUDA_F16_DECODE,  /* f16 -> fp32 */
    ST_CUDA_BF16_TO_F16,
    ST_CUDA_F16_TO_BF16,
};

template <int OP> struct st_cuda_op_traits {
    static constexpr unsigned in = (OP == ST_CUDA_BF16_ENCODE || OP == ST_CUDA_F16_ENCODE) ? 4 : 2;
    static constexpr unsigned out = (OP == ST_CUDA_BF16_DECODE || OP == ST_CUDA_F16_DECODE) ? 4 : 2;
};

template <int OP> ST_HD uint32_t st_cuda_convert1(uint32_t x)
{
    switch (OP) {
    case ST_CUDA_BF16_ENCODE:
        return st_cuda_bf16_from_bits(x);
    case ST_CUDA_BF16_DECODE:
        return x << 16;
    case ST_CUDA_F16_ENCODE:
        return st_cuda_f16_from_bits(x);
    case ST_CUDA_F16_DECODE:
        return st_cuda_f16_to_bits(x);
    case ST_CUDA_BF16_TO_F16:
        return st_cuda_f16_from_bits(x << 16);
    default: /* ST_CUDA_F16_TO_BF16 */
        return st_cuda_bf16_from_bits(st_cuda_f16_to_bits(x));
    }
}

/* ---- element access ------------------------------------------------------------------------- */

/* Naturally aligned element i of width W (2 or 4 bytes). */
template <unsigned W> ST_HD uint32_t st_cuda_load_elem(const unsigned char *p, size_t i)
{
    if (W == 4)
        return *(const uint32_t *)(p + 4 * i);
    return *(const uint16_t *)(p + 2 * i);
}

template <unsigned W> ST_HD void st_cuda_store_elem(unsigned char *p, size_t i, uint32_t v)
{
    if (W == 4)
        *(uint32_t *)(p + 4 * i) = v;
    else
        *(uint16_t *)(p + 2 * i) = (uint16_t)v;
}

/* Element i of width W at any byte address, little-endian like the host. */
template <unsigned W> ST_HD uint32_t st_cuda_load_bytes(const unsigned char *p, size_t i)
{
    const unsigned char *q = p + W * i;
    uint32_t v = (uint32_t)q[0] | ((uint32_t)q[1] << 8);
    if (W == 4)
        v |= ((uint32_t)q[2] << 16) | ((uint32_t)q[3] << 24);
    return v;
}

template <unsigned W> ST_HD void st_cuda_store_bytes(unsigned char *p, size_t i, uint32_t v)
{
    unsigned char *q = p + W * i;
    q[0] = (unsigned char)v;
    q[1] = (unsigned char)(v >> 8);
    if (W == 4) {
        q[2] = (unsigned char)(v >> 16);
        q[3] = (unsigned char)(v >> 24);
    }
}

/* ---- thread bodies -------------------------------------------------------------------------- */

/* A unit of 4 elements: one 16-byte (fp32) or 8-byte (16-bit) load, one 8- or 16-byte store.
 * Consecutive threads take consecutive units, so each warp instruction reads or writes one
 * contiguous span of 256 or 512 bytes: whole sectors, which matters for stores (a store that
 * covers half of each sector, as two 16-byte stores per thread of 32 contiguous bytes would,
 * costs about a third of the write bandwidth). */
template <unsigned W> ST_HD void st_cuda_load4(const unsigned char *p, size_t u, uint32_t v[4])
{
    if (W == 4) {
        uint4 a = ((const uint4 *)p)[u];
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w;
    } else {
        uint2 a = ((const uint2 *)p)[u];
        v[0] = a.x & 0xffffu, v[1] = a.x >> 16, v[2] = a.y & 0xffffu, v[3] = a.y >> 16;
    }
}

template <unsigned W> ST_HD void st_cuda_store4(unsigned char *p, size_t u, const uint32_t v[4])
{
    if (W == 4)
        ((uint4 *)p)[u] = make_uint4(v[0], v[1], v[2], v[3]);
    else
        ((uint2 *)p)[u] = make_uint2(v[0] | (v[1] << 16), v[2] | (v[3] << 16));
}

/* Units each thread has in flight per pass: their loads are all issued before the first store,
 * so that enough bytes are in flight to cover memory latency at full bandwidth. */
#define ST_CUDA_UNROLL 4

/* Vector body: units [0, nvec) of 4 elements start at element `head`, where src and dst are
 * aligned to a unit's load and store width; elements [0, head) and [head + 4 * nvec, n) (at
 * most 3 each) are done one by one by the threads with the lowest indices. */
template <int OP>
ST_HD void st_cuda_vec_body(unsigned char *__restrict__ dst, const unsigned char *__restrict__ src,
                            size_t head, size_t nvec, size_t n, size_t tid, size_t stride)
{
    constexpr unsigned IN = st_cuda_op_traits<OP>::in, OUT = st_cuda_op_traits<OP>::out;
    const unsigned char *s = src + IN * head;
    unsigned char *d = dst + OUT * head;

    for (size_t u = tid; u < nvec; u += ST_CUDA_UNROLL * stride) {
        uint32_t v[ST_CUDA_UNROLL][4];
        for (int k = 0; k < ST_CUDA_UNROLL; k++) /* constant trip counts: nvcc unrolls these */
            if (u + k * stride < nvec)
                st_cuda_load4<IN>(s, u + k * stride, v[k]);
        for (int k = 0; k < ST_CUDA_UNROLL; k++) {
            if (u + k * stride < nvec) {
                for (int j = 0; j < 4; j++)
                    v[k][j] = st_cuda_convert1<OP>(v[k][j]);
                st_cuda_store4<OUT>(d, u + k * stride, v[k]);
            }
        }
    }
    if (tid < head)
        st_cuda_store_elem<OUT>(dst, tid, st_cuda_convert1<OP>(st_cuda_load_elem<IN>(src, tid)));
    size_t tail = head + 4 * nvec;
    if (tid < n - tail) {
        size_t i = tail + tid;
        st_cuda_store_elem<OUT>(dst, i, st_cuda_convert1<OP>(st_cuda_load_elem<IN>(src, i)));
    }
}

/* Element body: one element a step; BYTES for elements at any byte address. */
template <int OP, bool BYTES>
ST_HD void st_cuda_elem_body(unsigned char *__restrict__ dst, const unsigned char *__restrict__ src,
                             size_t n, size_t tid, size_t stride)
{
    constexpr unsigned IN = st_cuda_op_traits<OP>::in, OUT = st_cuda_op_traits<OP>::out;
    for (size_t i = tid; i < n; i += stride) {
        if (BYTES)
            st_cuda_store_bytes<OUT>(dst, i, st_cuda_convert1<OP>(st_cuda_load_bytes<IN>(src, i)));
        else
            st_cuda_store_elem<OUT>(dst, i, st_cuda_convert1<OP>(st_cuda_load_elem<IN>(src, i)));
    }
}

/* ---- plan: which kernel, and the split into head, vector groups and tail -------------------- */

enum st_cuda_kind { ST_CUDA_KIND_VEC, ST_CUDA_KIND_ELEM, ST_CUDA_KIND_BYTES };

struct st_cuda_plan {
    int kind;
    size_t head; /* elements before the first aligned unit (vector kernel) */
    size_t nvec; /* units of 4 elements (vector kernel) */
    size_t work; /* threads the grid needs: max(nvec, head, tail), or n */
};

static st_cuda_plan st_cuda_plan_make(unsigned in, unsigned out, uintptr_t dst, uintptr_t src,
                                      size_t n)
{
    st_cuda_plan p = {ST_CUDA_KIND_BYTES, 0, 0, n};
    if (src % in != 0 || dst % out != 0)
        return p;
    p.kind = ST_CUDA_KIND_ELEM;
    /* Elements until src reaches a unit's width (4 elements); dst must be there at the same
     * element. A unit moves both by a multiple of their widths, so h < 4 is the only candidate. */
    uintptr_t in_w = 4u * in, out_w = 4u * out;
    size_t h = (size_t)((in_w - src % in_w) % in_w) / in;
    if ((dst + (uintptr_t)h * out) % out_w != 0)
        return p;
    p.kind = ST_CUDA_KIND_VEC;
    p.head = h < n ? h : n;
    p.nvec = (n - p.head) / 4;
    size_t tail = n - p.head - 4 * p.nvec;
    p.work = p.nvec;
    if (p.work < p.head)
        p.work = p.head;
    if (p.work < tail)
        p.work = tail;
    return p;
}

/* ---- kernels -------------------------------------------------------------------------------- */

template <int OP>
__global__ void __launch_bounds__(256)
    st_cuda_vec_kernel(unsigned char *__restrict__ dst, const unsigned char *__restrict__ src,
                       size_t head, size_t nvec, size_t n)
{
    st_cuda_vec_body<OP>(dst, src, head, nvec, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x,
                         (size_t)gridDim.x * blockDim.x);
}

template <int OP, bool BYTES>
__global__ void __launch_bounds__(256)
    st_cuda_elem_kernel(unsigned char *__restrict__ dst, const unsigned char *__restrict__ src,
                        size_t n)
{
    st_cuda_elem_body<OP, BYTES>(dst, src, n, (size_t)blockIdx.x * blockDim.x + threadIdx.x,
                                 (size_t)gridDim.x * blockDim.x);
}

/* ---- host side ------------------------------------------------------------------------------ */

#define ST_CUDA_THREADS 256u

/* Map a failed CUDA call to the project's codes; the detail names the call and the error. */
static int st_cuda_fail(cudaError_t e, const char *call)
{
    int rc = e == cudaErrorMemoryAllocation ? ENOMEM : ST_EIO;
    const char *paren = strchr(call, '(');
    int len = paren ? (int)(paren - call) : (int)strlen(call);
    return st_error_set(rc, "codec cuda: %.*s: %s (%s)", len, call, cudaGetErrorName(e),
                        cudaGetErrorString(e));
}

#define ST_CUDA_CHECK(call)                                                                    \
    do {                                                                                       \
        cudaError_t st_cuda_e_ = (call);                                                       \
        if (st_cuda_e_ != cudaSuccess)                                                         \
            return st_cuda_fail(st_cuda_e_, #call);                                            \
    } while (0)

/* Refuse pointers the current device cannot dereference: a kernel touching host memory would
 * leave the context unusable for the rest of the process, so this is checked, not trusted. */
static int st_cuda_check_ptr(const void *p, int device, const char *what)
{
    cudaPointerAttributes attr;
    ST_CUDA_CHECK(cudaPointerGetAttributes(&attr, p));
    switch (attr.type) {
    case cudaMemoryTypeDevice:
        if (attr.device != device)
            return st_error_set(ST_EINVAL,
                                "codec cuda: %s %p is memory of device %d, the current device is %d",
                                what, p, attr.device, device);
        return 0;
    case cudaMemoryTypeManaged:
        return 0;
    case cudaMemoryTypeHost:
        if (attr.devicePointer == p)
            return 0;
        return st_error_set(ST_EINVAL,
                            "codec cuda: %s %p is pinned host memory not mapped at the same "
                            "address on the device",
                            what, p);
    default:
        return st_error_set(ST_EINVAL, "codec cuda: %s %p is not device memory", what, p);
    }
}

/* Blocks for a grid-stride launch: one full wave (what fits on every SM at once, from the
 * kernel's register use), fewer when the work is smaller. A second, partial wave would leave
 * most SMs idle at the end. */
template <typename K>
static int st_cuda_grid(K kernel, int sms, size_t work, unsigned *blocks)
{
    int per_sm = 0;
    ST_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel,
                                                                (int)ST_CUDA_THREADS, 0));
    size_t wave = (size_t)(sms > 0 ? sms : 1) * (size_t)(per_sm > 0 ? per_sm : 1);
    size_t want = (work + ST_CUDA_THREADS - 1) / ST_CUDA_THREADS;
    *blocks = (unsigned)(want == 0 ? 1 : want < wave ? want : wave);
    return 0;
}

template <int OP>
static int st_cuda_launch(void *dst, const void *src, size_t n, cudaStream_t stream, int sms)
{
    constexpr unsigned IN = st_cuda_op_traits<OP>::in, OUT = st_cuda_op_traits<OP>::out;
    st_cuda_plan p = st_cuda_plan_make(IN, OUT, (uintptr_t)dst, (uintptr_t)src, n);
    unsigned char *d = (unsigned char *)dst;
    const unsigned char *s = (const unsigned char *)src;
    unsigned blocks = 1;
    int rc;

    if (p.kind == ST_CUDA_KIND_VEC) {
        if ((rc = st_cuda_grid(st_cuda_vec_kernel<OP>, sms, p.work, &blocks)))
            return rc;
        st_cuda_vec_kernel<OP><<<blocks, ST_CUDA_THREADS, 0, stream>>>(d, s, p.head, p.nvec, n);
    } else if (p.kind == ST_CUDA_KIND_ELEM) {
        if ((rc = st_cuda_grid(st_cuda_elem_kernel<OP, false>, sms, p.work, &blocks)))
            return rc;
        st_cuda_elem_kernel<OP, false><<<blocks, ST_CUDA_THREADS, 0, stream>>>(d, s, n);
    } else {
        if ((rc = st_cuda_grid(st_cuda_elem_kernel<OP, true>, sms, p.work, &blocks)))
            return rc;
        st_cuda_elem_kernel<OP, true><<<blocks, ST_CUDA_THREADS, 0, stream>>>(d, s, n);
    }
    ST_CUDA_CHECK(cudaGetLastError());
    return 0;
}

extern "C" int st_codec_cuda_available(void)
{
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        st_cuda_fail(e, "cudaGetDeviceCount");
        return 0;
    }
    if (count == 0) {
        st_error_set(ST_EIO, "codec cuda: no CUDA device");
        return 0;
    }
    return 1;
}

extern "C" int st_codec_cuda_convert(uint32_t dst_id, void *dst_dev, uint32_t src_id,
                                     const void *src_dev, size_t n, void *stream)
{
    int rc = st_codec_check(src_id);
    if (rc)
        return rc;
    if ((rc = st_codec_check(dst_id)))
        return rc;
    if (n == 0)
        return 0;
    if (!dst_dev || !src_dev)
        return st_error_set(ST_EINVAL, "codec cuda convert: NULL buffer for %zu elements", n);
    if (n > SIZE_MAX / 4)
        return st_error_set(ST_EINVAL, "codec cuda convert: %zu elements overflow a size", n);
    size_t in_bytes = n * st_codec_elem_size(src_id), out_bytes = n * st_codec_elem_size(dst_id);
    uintptr_t d0 = (uintptr_t)dst_dev, s0 = (uintptr_t)src_dev;
    if (d0 < s0 + in_bytes && s0 < d0 + out_bytes)
        return st_error_set(ST_EINVAL, "codec cuda convert %s -> %s: dst and src overlap",
                            st_codec_name(src_id), st_codec_name(dst_id));

    int device = 0;
    ST_CUDA_CHECK(cudaGetDevice(&device));
    if ((rc = st_cuda_check_ptr(src_dev, device, "src")) ||
        (rc = st_cuda_check_ptr(dst_dev, device, "dst")))
        return rc;
    cudaStream_t st = (cudaStream_t)stream;
    if (src_id == dst_id) {
        ST_CUDA_CHECK(cudaMemcpyAsync(dst_dev, src_dev, in_bytes, cudaMemcpyDeviceToDevice, st));
        return 0;
    }
    int sms = 0;
    ST_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));

    if (src_id == ST_CODEC_FP32)
        return dst_id == ST_CODEC_BF16
                   ? st_cuda_launch<ST_CUDA_BF16_ENCODE>(dst_dev, src_dev, n, st, sms)
                   : st_cuda_launch<ST_CUDA_F16_ENCODE>(dst_dev, src_dev, n, st, sms);
    if (dst_id == ST_CODEC_FP32)
        return src_id == ST_CODEC_BF16
                   ? st_cuda_launch<ST_CUDA_BF16_DECODE>(dst_dev, src_dev, n, st, sms)
                   : st_cuda_launch<ST_CUDA_F16_DECODE>(dst_dev, src_dev, n, st, sms);
    return src_id == ST_CODEC_BF16
               ? st_cuda_launch<ST_CUDA_BF16_TO_F16>(dst_dev, src_dev, n, st, sms)
               : st_cuda_launch<ST_CUDA_F16_TO_BF16>(dst_dev, src_dev, n, st, sms);
}

extern "C" int st_codec_cuda_sync(void *stream)
{
    ST_CUDA_CHECK(cudaStreamSynchronize((cudaStream_t)stream));
    return 0;
}

/* ---- checksums of blocks ------------------------------------------------------------------ */

/* Bytes of a plain buffer for st_xxh3_warp: 8-byte words where aligned, else two 4-byte or eight
 * single-byte loads (any byte offset is accepted). */
struct st_cuda_lin_reader {
    const unsigned char *p;
    __device__ uint8_t byte(uint64_t o) const { return p[o]; }
    __device__ const uint64_t *span(uint64_t o, uint64_t len) const
    {
        (void)len;
        return ((uintptr_t)(p + o) & 7u) == 0 ? (const uint64_t *)(p + o) : nullptr;
    }
    __device__ uint64_t word(uint64_t o) const
    {
        const unsigned char *q = p + o;
        uintptr_t a = (uintptr_t)q;
        if ((a & 7u) == 0)
            return *(const uint64_t *)q;
        if ((a & 3u) == 0)
            return (uint64_t)((const uint32_t *)q)[0] | (uint64_t)((const uint32_t *)q)[1] << 32;
        uint64_t v = 0;
        for (unsigned i = 0; i < 8; i++)
            v |= (uint64_t)q[i] << (8 * i);
        return v;
    }
};

#define ST_CUDA_HASH_THREADS 128u

__global__ void st_cuda_checksum_kernel(const unsigned char *src, uint64_t bytes, uint64_t block,
                                        uint64_t nb, uint64_t *out)
{
    uint64_t w = ((uint64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= nb)
        return; /* whole warps: blockDim is a multiple of 32 */
    uint64_t off = w * block, len = bytes - off < block ? bytes - off : block;
    st_cuda_lin_reader r = {src + off};
    uint64_t h = st_xxh3_warp(r, len);
    if ((threadIdx.x & 31u) == 0)
        out[w] = h;
}

extern "C" int st_codec_cuda_checksum_blocks(const void *src_dev, uint64_t bytes, uint64_t block,
                                             uint64_t *digests_dev, void *stream)
{
    if (bytes == 0)
        return 0;
    if (block == 0 || !src_dev || !digests_dev || ((uintptr_t)digests_dev & 7u))
        return st_error_set(ST_EINVAL, "codec cuda checksum: block %llu, src %p, digests %p",
                            (unsigned long long)block, src_dev, (void *)digests_dev);
    uint64_t nb = (bytes - 1) / block + 1;
    if (nb > ((uint64_t)1 << 31))
        return st_error_set(ST_EINVAL, "codec cuda checksum: %llu blocks (at most 2^31)",
                            (unsigned long long)nb);
    int device = 0, rc;
    ST_CUDA_CHECK(cudaGetDevice(&device));
    if ((rc = st_cuda_check_ptr(src_dev, device, "src")) ||
        (rc = st_cuda_check_ptr(digests_dev, device, "digests")))
        return rc;
    uint64_t per = ST_CUDA_HASH_THREADS / 32;
    st_cuda_checksum_kernel<<<(unsigned)((nb + per - 1) / per), ST_CUDA_HASH_THREADS, 0,
                              (cudaStream_t)stream>>>((const unsigned char *)src_dev, bytes, block,
                                                      nb, digests_dev);
    ST_CUDA_CHECK(cudaGetLastError());
    return 0;
}
