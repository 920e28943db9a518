/*
 * st_codec.h - element codecs (fp32 / bf16 / f16),
 * slice-wise conversion with a bounded scratch, byte-shuffle + zstd framing, XXH3-64 checksums.
 *
 * Everything here is a pure function over caller-owned buffers, except the framing context
 * (st_frame_ctx), which owns its zstd contexts and one shuffle block and nothing else.
 * No function in this module does I/O. All functions are thread-safe; an st_frame_ctx must be
 * used by one thread at a time.
 *
 * The error space of the whole project (ST_E* codes, st_strerror, the per-thread detail) lives in
 * common/st_common.h, the layer under this one, which this header includes: every module that
 * sees the codec sees it.
 */
#ifndef ST_CODEC_H
#define ST_CODEC_H

#include <stddef.h>
#include <stdint.h>

#include "st_common.h" /* the error space, and the layer under this one */

#ifdef __cplusplus
extern "C" {
#endif

/* ---- element codecs ------------------------------------------------------------------------
 * On-disk enum: values never change, new codecs are only ever added. */
typedef enum st_codec_id {
    ST_CODEC_FP32 = 0,
    ST_CODEC_BF16 = 1,
    ST_CODEC_F16 = 2,
} st_codec_id;
#define ST_CODEC_COUNT 3

/* 0 if id is a known codec, ST_ECODEC (with detail) otherwise. */
int st_codec_check(uint32_t id);
/* Bytes per element (4, 2, 2); 0 for an unknown id. */
size_t st_codec_elem_size(uint32_t id);
/* "fp32", "bf16", "f16"; "unknown" for an unknown id. */
const char *st_codec_name(uint32_t id);
/* Parse a codec name; ST_ECODEC for an unknown name. */
int st_codec_parse(const char *name, st_codec_id *out);

/* Element conversion. n elements; dst and src must not overlap.
 * Encode rounds to nearest, ties to even. NaN stays NaN (quiet; sign and the top payload bits
 * kept), +-Inf stay +-Inf, finite values beyond the target's range become +-Inf, values below
 * half the smallest subnormal become +-0, subnormals are produced as IEEE 754 says.
 * Decode (widening to fp32) is exact. These dispatch to the best implementation this CPU has. */
void st_codec_bf16_encode(uint16_t *dst, const float *src, size_t n);
void st_codec_bf16_decode(float *dst, const uint16_t *src, size_t n);
void st_codec_f16_encode(uint16_t *dst, const float *src, size_t n);
/* The bf16 encode of the snapshot direction: dst as st_codec_bf16_encode writes it, in streaming
 * (non-temporal) stores where dst's alignment allows, for coded bytes not read again soon; and,
 * when wide is not NULL, wide[i] = the fp32 value dst[i] widens to (exactly what
 * st_codec_bf16_decode gives), for a digest of the widened values taken while they are in cache.
 * dst, wide and src must not overlap. */
void st_codec_bf16_encode_stream(uint16_t *dst, float *wide, const float *src, size_t n);
void st_codec_f16_decode(float *dst, const uint16_t *src, size_t n);

/* Instruction-set levels. st_codec_isa() says which one the dispatching functions use;
 * st_codec_isa_set() forces one (tests, benchmarks): ST_EINVAL if this CPU lacks it. */
typedef enum st_codec_isa_level {
    ST_ISA_SCALAR = 0,
    ST_ISA_AVX2 = 1,   /* AVX2 + F16C */
    ST_ISA_AVX512 = 2, /* AVX-512 F + BW + VL */
} st_codec_isa_level;
st_codec_isa_level st_codec_isa(void);
int st_codec_isa_set(st_codec_isa_level level);
const char *st_codec_isa_name(st_codec_isa_level level);
/* Highest level this CPU supports. */
st_codec_isa_level st_codec_isa_best(void);

/* Convert n elements from codec src_id to codec dst_id (any pair; fp32->fp32 is a copy).
 * Pairs that do not involve fp32 go through fp32 in slices of the caller's scratch;
 * scratch_cap must be at least ST_CODEC_SCRATCH_MIN and need not exceed ST_CODEC_SCRATCH_MAX.
 * No allocation. Returns 0, or ST_ECODEC for an unknown id, ST_EINVAL for a scratch too small. */
#define ST_CODEC_SCRATCH_MIN (64u * 1024u)
#define ST_CODEC_SCRATCH_MAX (4u * 1024u * 1024u)
int st_codec_convert(uint32_t dst_id, void *dst, uint32_t src_id, const void *src, size_t n,
                     void *scratch, size_t scratch_cap);

/* Error figures of a lossy round trip: compare a reference fp32 array with another
 * (typically decoded) fp32 array. Accumulates into *st so it can run slice by slice. */
typedef struct st_codec_errstat {
    uint64_t n;             /* elements compared */
    double max_abs;         /* max |a - b| over finite pairs */
    double max_rel;         /* max |a - b| / |a| over finite pairs with a != 0 */
    uint64_t sign_changes;  /* a and b both non-zero with opposite signs */
    uint64_t new_zeros;     /* a != 0, b == 0 */
    uint64_t new_nonfinite; /* a finite, b Inf or NaN */
    uint64_t differ;        /* bit patterns differ */
} st_codec_errstat;
void st_codec_errstat_add(st_codec_errstat *st, const float *a, const float *b, size_t n);

/* ---- lossless framing ----------------------------------------------------------------------
 * A frame is a 16-byte header (see docs/CODECS.md) followed by one zstd frame with its content
 * size and content checksum. With shuffle, each block of up to ST_FRAME_BLOCK input bytes has
 * its element bytes split into planes (all byte 0s, then all byte 1s, ...) before compression.
 * Decoding caps the zstd window (ST_FRAME_WINDOWLOG_MAX) and refuses a declared size above the
 * caller's dst_cap, so a hostile frame cannot make it allocate or write beyond a bound. */
#define ST_FRAME_HEADER 16u
#define ST_FRAME_BLOCK (1u << 20)
#define ST_FRAME_WINDOWLOG_MAX 24
#define ST_FRAME_LEVEL_DEFAULT 3

typedef struct st_frame_ctx st_frame_ctx;
/* Allocates the zstd contexts and one ST_FRAME_BLOCK buffer. NULL on ENOMEM. */
st_frame_ctx *st_frame_ctx_new(void);
void st_frame_ctx_free(st_frame_ctx *ctx); /* accepts NULL */

/* Largest frame st_frame_encode can produce for src_len input bytes. */
size_t st_frame_bound(size_t src_len);
/* Encode src into dst. elem_size 0 or 1: no shuffle; 2, 4 or 8: shuffle planes of that width.
 * level: zstd level 1..19 (0 means ST_FRAME_LEVEL_DEFAULT). */
int st_frame_encode(st_frame_ctx *ctx, void *dst, size_t dst_cap, const void *src, size_t src_len,
                    unsigned elem_size, int level, size_t *out_len);
/* The decoded size a frame declares (after checking its header). ST_ECORRUPT on a bad header. */
int st_frame_decoded_size(const void *src, size_t src_len, uint64_t *out);
/* Decode a whole frame into dst. ST_ETOOBIG if the declared size exceeds dst_cap, ST_ECORRUPT on
 * any malformed or mismatching input (including trailing bytes after the frame). */
int st_frame_decode(st_frame_ctx *ctx, void *dst, size_t dst_cap, const void *src, size_t src_len,
                    size_t *out_len);

/* ---- checksums (XXH3-64, seed 0) ---------------------------------------------------------- */
uint64_t st_checksum(const void *p, size_t n);
/* Streaming: same result as st_checksum over the concatenation of all updates. */
typedef struct st_checksum_state {
    void *impl; /* XXH3_state_t, allocated by _init */
} st_checksum_state;
int st_checksum_init(st_checksum_state *s);           /* ENOMEM */
void st_checksum_update(st_checksum_state *s, const void *p, size_t n);
uint64_t st_checksum_final(const st_checksum_state *s);
void st_checksum_free(st_checksum_state *s);           /* accepts a zeroed state */

/* ---- GPU codecs (built with CUDA: ST_HAVE_CUDA) ------------------------------------------
 * st_codec_convert's element conversions over GPU memory, producing exactly the bytes the CPU
 * codecs produce, NaN payloads and subnormals included (docs/CODECS.md, "GPU codecs"). A build
 * without CUDA has these functions too: they return ST_EINVAL ("built without CUDA"), and
 * st_codec_cuda_available() returns 0, so callers link either way.
 * They act on the calling thread's current CUDA device. A failed CUDA call returns ST_EIO
 * (ENOMEM when CUDA is out of memory) with a detail naming the call and the CUDA error;
 * cudaError_t never appears in this API. Nothing is allocated. Thread-safe. */

/* 1 when this build has CUDA and a CUDA device is present; 0 otherwise, with the reason in
 * st_errdetail() ("built without CUDA", "no CUDA device", a driver error). */
int st_codec_cuda_available(void);

/* Enqueue the conversion of n elements of codec src_id at src_dev into codec dst_id at dst_dev
 * on stream (a cudaStream_t; NULL is the default stream) and return without waiting. Any of the
 * nine pairs; same codec is a device-to-device copy; bf16 <-> f16 goes through fp32 in registers
 * (no scratch). Buffers: memory the current device can address (its own device memory, managed
 * memory, or mapped pinned host memory), each holding its n elements, at any byte offset; the
 * fast path wants src and dst to reach a 16-byte (fp32) / 8-byte (16-bit) boundary at the
 * same element (true for cudaMalloc'd buffers at element offsets that are multiples of 4).
 * They must not overlap.
 * Returns 0; ST_ECODEC for an unknown id; ST_EINVAL for a NULL buffer with n > 0, host memory
 * the device cannot address, memory of another device, overlapping buffers or an n whose byte
 * count overflows; ST_EIO if the launch fails. A failure while the kernel runs shows at the next
 * synchronisation (st_codec_cuda_sync). n == 0 does nothing. */
int st_codec_cuda_convert(uint32_t dst_id, void *dst_dev, uint32_t src_id, const void *src_dev,
                          size_t n, void *stream);

/* Enqueue the XXH3-64 digests (st_checksum's, seed 0) of the consecutive blocks of `block` bytes
 * of the bytes bytes at src_dev (the last block shorter) into digests_dev[0 .. ceil(bytes /
 * block)) on stream, and return without waiting. One warp digests one block (codec/st_xxh3.h);
 * the digests equal st_checksum's of the same blocks on the CPU. src_dev: memory the device can
 * address, at any byte offset; digests_dev: device memory, 8-byte aligned. Returns 0; ST_EINVAL
 * for block 0, a NULL or unaddressable buffer, or more than 2^31 blocks; ST_EIO if the launch
 * fails. bytes == 0 does nothing. */
int st_codec_cuda_checksum_blocks(const void *src_dev, uint64_t bytes, uint64_t block,
                                  uint64_t *digests_dev, void *stream);

/* Wait until the work queued on stream (a cudaStream_t; NULL: the default stream) is done.
 * 0, or ST_EIO naming the CUDA error (an earlier kernel's failure shows here). */
int st_codec_cuda_sync(void *stream);

#ifdef __cplusplus
}
#endif
#endif /* ST_CODEC_H */
