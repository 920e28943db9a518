/*
 * st_frame.c - lossless framing: optional byte-shuffle, then one zstd frame, behind a 16-byte
 * header. Layout (docs/CODECS.md):
 *
 *   0..2  magic "STZ"        5     shuffle width: 0, or 2 / 4 / 8 when flag bit 0 is set
 *   3     version (1)        6..7  reserved, zero
 *   4     flags (bit 0: shuffled; bits 1..7 reserved, zero)
 *   8..15 decoded size, u64 little-endian
 *   16..  one zstd frame with its content size, content checksum and no dictionary
 *
 * Invariants:
 * 1. Memory is bounded by the context: zstd runs in streaming mode, the shuffle works on one
 *    ST_FRAME_BLOCK buffer owned by the context, and the decoder's zstd window is capped at
 *    2^ST_FRAME_WINDOWLOG_MAX bytes. Nothing here allocates per call.
 * 2. The decoder writes at most the declared size into dst, and only after checking that the
 *    declared size fits dst_cap; it succeeds only when the zstd frame's content size equals the
 *    declared size, the whole output was produced, the checksum matched and no byte follows.
 * 3. The header is canonical: one content has exactly one valid header for a given shuffle
 *    width, so a flipped header bit is always an error rather than a different reading. Which
 *    valid width was used is not protected (zstd's checksum covers the shuffled bytes): the
 *    container checks the width it expects at byte 5 (st_file.c does).
 * 4. Shuffle works block by block (ST_FRAME_BLOCK input bytes, the last block may be short):
 *    within a block of nelem whole elements, plane p holds byte p of every element; the
 *    len % width bytes that do not make a whole element stay unshuffled at the block's end.
 */
#include <errno.h>
#include <immintrin.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <zstd.h>
#include <zstd_errors.h>

#include "st_codec.h"

#define ST_FRAME_VERSION 1u
#define ST_FRAME_FLAG_SHUFFLE 0x01u
#define ST_FRAME_LEVEL_MAX 19 /* levels above 19 want windows beyond ST_FRAME_WINDOWLOG_MAX */

static const unsigned char st_frame_magic[3] = {'S', 'T', 'Z'};

struct st_frame_ctx {
    ZSTD_CCtx *cctx;
    ZSTD_DCtx *dctx;
    unsigned char *block; /* ST_FRAME_BLOCK bytes: the shuffled form of one block */
};

st_frame_ctx *st_frame_ctx_new(void)
{
    st_frame_ctx *ctx = calloc(1, sizeof *ctx);
    if (!ctx)
        return NULL;
    ctx->cctx = ZSTD_createCCtx();
    ctx->dctx = ZSTD_createDCtx();
    ctx->block = malloc(ST_FRAME_BLOCK);
    if (!ctx->cctx || !ctx->dctx || !ctx->block)
        goto fail;
    /* Sticky across session resets: every frame this context decodes is held to the cap. */
    if (ZSTD_isError(ZSTD_DCtx_setParameter(ctx->dctx, ZSTD_d_windowLogMax,
                                            ST_FRAME_WINDOWLOG_MAX)))
        goto fail;
    return ctx;
fail:
    st_frame_ctx_free(ctx);
    return NULL;
}

void st_frame_ctx_free(st_frame_ctx *ctx)
{
    if (!ctx)
        return;
    ZSTD_freeCCtx(ctx->cctx);
    ZSTD_freeDCtx(ctx->dctx);
    free(ctx->block);
    free(ctx);
}

size_t st_frame_bound(size_t src_len)
{
    size_t z = ZSTD_compressBound(src_len);
    if (ZSTD_isError(z) || z > SIZE_MAX - ST_FRAME_HEADER)
        return 0;
    return ST_FRAME_HEADER + z;
}

/* ---- shuffle --------------------------------------------------------------------------------
 * The scalar loops are the reference; the width is a compile-time constant in each instance so
 * the compiler can unroll them (about 3 GB/s for width 4). Widths 2 and 4, the ones fp32, bf16
 * and f16 state use, also have AVX2 versions (about 3x faster), because with a ~1.5 GB/s zstd
 * decoder the scalar unshuffle would take a third of the decode time. Both produce the same
 * bytes; tests/codec checks the layout at every ISA level. */

static inline void st_shuffle_w(unsigned char *restrict dst, const unsigned char *restrict src,
                                size_t nelem, size_t done, unsigned w)
{
    for (size_t i = done; i < nelem; i++)
        for (unsigned p = 0; p < w; p++)
            dst[p * nelem + i] = src[i * w + p];
}

static inline void st_unshuffle_w(unsigned char *restrict dst, const unsigned char *restrict src,
                                  size_t nelem, size_t done, unsigned w)
{
    for (size_t i = done; i < nelem; i++)
        for (unsigned p = 0; p < w; p++)
            dst[i * w + p] = src[p * nelem + i];
}

#define ST_AVX2 __attribute__((target("avx2")))

/* Width 2, 32 elements a step: split each lane into low and high bytes, then gather lanes. */
ST_AVX2 static size_t st_shuffle2_avx2(unsigned char *dst, const unsigned char *src, size_t nelem)
{
    const __m256i split = _mm256_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
                                           0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
    size_t i = 0;
    for (; i + 32 <= nelem; i += 32) {
        __m256i v0 = _mm256_loadu_si256((const __m256i *)(src + 2 * i));
        __m256i v1 = _mm256_loadu_si256((const __m256i *)(src + 2 * i + 32));
        /* each v: [lo bytes of 16 elements | hi bytes of 16 elements] */
        v0 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v0, split), 0xd8);
        v1 = _mm256_permute4x64_epi64(_mm256_shuffle_epi8(v1, split), 0xd8);
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permute2x128_si256(v0, v1, 0x20));
        _mm256_storeu_si256((__m256i *)(dst + nelem + i),
                            _mm256_permute2x128_si256(v0, v1, 0x31));
    }
    return i;
}

ST_AVX2 static size_t st_unshuffle2_avx2(unsigned char *dst, const unsigned char *src,
                                         size_t nelem)
{
    const __m256i merge = _mm256_setr_epi8(0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15,
                                           0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15);
    size_t i = 0;
    for (; i + 32 <= nelem; i += 32) {
        __m256i p0 = _mm256_loadu_si256((const __m256i *)(src + i));
        __m256i p1 = _mm256_loadu_si256((const __m256i *)(src + nelem + i));
        __m256i v0 = _mm256_permute2x128_si256(p0, p1, 0x20);
        __m256i v1 = _mm256_permute2x128_si256(p0, p1, 0x31);
        v0 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v0, 0xd8), merge);
        v1 = _mm256_shuffle_epi8(_mm256_permute4x64_epi64(v1, 0xd8), merge);
        _mm256_storeu_si256((__m256i *)(dst + 2 * i), v0);
        _mm256_storeu_si256((__m256i *)(dst + 2 * i + 32), v1);
    }
    return i;
}

/* 4x4 transpose of 64-bit quarters: out[p] = {in[0].q[p], in[1].q[p], in[2].q[p], in[3].q[p]}.
 * Its own inverse. */
ST_AVX2 static inline void st_transpose_q4(__m256i v[4])
{
    __m256i t0 = _mm256_unpacklo_epi64(v[0], v[1]);
    __m256i t1 = _mm256_unpackhi_epi64(v[0], v[1]);
    __m256i t2 = _mm256_unpacklo_epi64(v[2], v[3]);
    __m256i t3 = _mm256_unpackhi_epi64(v[2], v[3]);
    v[0] = _mm256_permute2x128_si256(t0, t2, 0x20);
    v[1] = _mm256_permute2x128_si256(t1, t3, 0x20);
    v[2] = _mm256_permute2x128_si256(t0, t2, 0x31);
    v[3] = _mm256_permute2x128_si256(t1, t3, 0x31);
}

/* Width 4, 32 elements a step: group byte p of each 8 elements into quarter p of a register,
 * then transpose quarters across four registers so register p is 32 bytes of plane p. */
ST_AVX2 static size_t st_shuffle4_avx2(unsigned char *dst, const unsigned char *src, size_t nelem)
{
    const __m256i split = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i gather = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    size_t i = 0;
    for (; i + 32 <= nelem; i += 32) {
        __m256i v[4];
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_loadu_si256((const __m256i *)(src + 4 * i + 32 * k));
            v[k] = _mm256_permutevar8x32_epi32(_mm256_shuffle_epi8(v[k], split), gather);
        }
        st_transpose_q4(v);
        for (int p = 0; p < 4; p++)
            _mm256_storeu_si256((__m256i *)(dst + p * nelem + i), v[p]);
    }
    return i;
}

ST_AVX2 static size_t st_unshuffle4_avx2(unsigned char *dst, const unsigned char *src,
                                         size_t nelem)
{
    /* the byte split is a 4x4 transpose, its own inverse; the dword gather is inverted */
    const __m256i merge = _mm256_setr_epi8(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15,
                                           0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    const __m256i scatter = _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7);
    size_t i = 0;
    for (; i + 32 <= nelem; i += 32) {
        __m256i v[4];
        for (int p = 0; p < 4; p++)
            v[p] = _mm256_loadu_si256((const __m256i *)(src + p * nelem + i));
        st_transpose_q4(v);
        for (int k = 0; k < 4; k++) {
            v[k] = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(v[k], scatter), merge);
            _mm256_storeu_si256((__m256i *)(dst + 4 * i + 32 * k), v[k]);
        }
    }
    return i;
}

static void st_shuffle(unsigned char *dst, const unsigned char *src, size_t len, unsigned w)
{
    size_t nelem = len / w, done = 0;
    bool avx2 = st_codec_isa() >= ST_ISA_AVX2;
    switch (w) {
    case 2:
        done = avx2 ? st_shuffle2_avx2(dst, src, nelem) : 0;
        st_shuffle_w(dst, src, nelem, done, 2);
        break;
    case 4:
        done = avx2 ? st_shuffle4_avx2(dst, src, nelem) : 0;
        st_shuffle_w(dst, src, nelem, done, 4);
        break;
    default:
        st_shuffle_w(dst, src, nelem, 0, 8);
        break;
    }
    memcpy(dst + nelem * w, src + nelem * w, len - nelem * w);
}

static void st_unshuffle(unsigned char *dst, const unsigned char *src, size_t len, unsigned w)
{
    size_t nelem = len / w, done = 0;
    bool avx2 = st_codec_isa() >= ST_ISA_AVX2;
    switch (w) {
    case 2:
        done = avx2 ? st_unshuffle2_avx2(dst, src, nelem) : 0;
        st_unshuffle_w(dst, src, nelem, done, 2);
        break;
    case 4:
        done = avx2 ? st_unshuffle4_avx2(dst, src, nelem) : 0;
        st_unshuffle_w(dst, src, nelem, done, 4);
        break;
    default:
        st_unshuffle_w(dst, src, nelem, 0, 8);
        break;
    }
    memcpy(dst + nelem * w, src + nelem * w, len - nelem * w);
}

/* ---- encode -------------------------------------------------------------------------------- */

/* Map a zstd error: out of memory is ENOMEM, a window beyond the cap ST_ETOOBIG, anything else
 * other_rc (ST_ECORRUPT when decoding input, ST_EINVAL when encoding). */
static int st_frame_zstd_fail(size_t zrc, const char *where, int other_rc)
{
    if (ZSTD_getErrorCode(zrc) == ZSTD_error_memory_allocation)
        return st_error_set(ENOMEM, "frame %s: zstd: %s", where, ZSTD_getErrorName(zrc));
    if (ZSTD_getErrorCode(zrc) == ZSTD_error_frameParameter_windowTooLarge)
        return st_error_set(ST_ETOOBIG, "frame %s: zstd window exceeds 2^%d bytes", where,
                            ST_FRAME_WINDOWLOG_MAX);
    return st_error_set(other_rc, "frame %s: zstd: %s", where, ZSTD_getErrorName(zrc));
}

/* Feed one input piece to the compressor; ST_ETOOBIG when dst fills up first. */
static int st_frame_feed(ZSTD_CCtx *cctx, ZSTD_outBuffer *out, const void *p, size_t len,
                         ZSTD_EndDirective end)
{
    ZSTD_inBuffer in = {p, len, 0};
    for (;;) {
        size_t left = ZSTD_compressStream2(cctx, out, &in, end);
        if (ZSTD_isError(left))
            return st_frame_zstd_fail(left, "encode", ST_EINVAL);
        bool done = end == ZSTD_e_end ? left == 0 : in.pos == in.size;
        if (done)
            return 0;
        if (out->pos == out->size)
            return st_error_set(ST_ETOOBIG, "frame encode: output exceeds dst_cap %zu bytes",
                                out->size + ST_FRAME_HEADER);
    }
}

int st_frame_encode(st_frame_ctx *ctx, void *dst, size_t dst_cap, const void *src, size_t src_len,
                    unsigned elem_size, int level, size_t *out_len)
{
    if (!ctx || !dst || (!src && src_len) || !out_len)
        return st_error_set(ST_EINVAL, "frame encode: NULL argument");
    if (elem_size != 0 && elem_size != 1 && elem_size != 2 && elem_size != 4 && elem_size != 8)
        return st_error_set(ST_EINVAL, "frame encode: element size %u (want 0, 1, 2, 4 or 8)",
                            elem_size);
    if (level == 0)
        level = ST_FRAME_LEVEL_DEFAULT;
    if (level < 1 || level > ST_FRAME_LEVEL_MAX)
        return st_error_set(ST_EINVAL, "frame encode: level %d (want 1..%d)", level,
                            ST_FRAME_LEVEL_MAX);
    if (dst_cap < ST_FRAME_HEADER)
        return st_error_set(ST_ETOOBIG, "frame encode: dst_cap %zu cannot hold the %u-byte "
                            "header", dst_cap, ST_FRAME_HEADER);

    bool shuffle = elem_size >= 2;
    unsigned char *d = dst;
    memcpy(d, st_frame_magic, sizeof st_frame_magic);
    d[3] = ST_FRAME_VERSION;
    d[4] = shuffle ? ST_FRAME_FLAG_SHUFFLE : 0;
    d[5] = (unsigned char)(shuffle ? elem_size : 0);
    d[6] = d[7] = 0;
    st_put64(d + 8, (uint64_t)src_len);

    ZSTD_CCtx *cctx = ctx->cctx;
    size_t zrc = ZSTD_CCtx_reset(cctx, ZSTD_reset_session_and_parameters);
    if (!ZSTD_isError(zrc))
        zrc = ZSTD_CCtx_setParameter(cctx, ZSTD_c_compressionLevel, level);
    if (!ZSTD_isError(zrc))
        zrc = ZSTD_CCtx_setParameter(cctx, ZSTD_c_checksumFlag, 1);
    if (!ZSTD_isError(zrc))
        zrc = ZSTD_CCtx_setParameter(cctx, ZSTD_c_contentSizeFlag, 1);
    if (!ZSTD_isError(zrc))
        zrc = ZSTD_CCtx_setPledgedSrcSize(cctx, (unsigned long long)src_len);
    if (ZSTD_isError(zrc))
        return st_frame_zstd_fail(zrc, "encode setup", ST_EINVAL);

    ZSTD_outBuffer out = {d + ST_FRAME_HEADER, dst_cap - ST_FRAME_HEADER, 0};
    const unsigned char *s = src;
    int rc = 0;
    if (!shuffle) {
        rc = st_frame_feed(cctx, &out, s, src_len, ZSTD_e_end);
    } else {
        size_t off = 0;
        do {
            size_t len = src_len - off < ST_FRAME_BLOCK ? src_len - off : ST_FRAME_BLOCK;
            st_shuffle(ctx->block, s + off, len, elem_size);
            off += len;
            /* zstd may keep a pointer into the block until it is consumed: st_frame_feed
             * returns only once every byte of it has been taken. */
            rc = st_frame_feed(cctx, &out, ctx->block, len,
                               off == src_len ? ZSTD_e_end : ZSTD_e_continue);
        } while (rc == 0 && off < src_len);
    }
    if (rc) {
        ZSTD_CCtx_reset(cctx, ZSTD_reset_session_only);
        return rc;
    }
    *out_len = ST_FRAME_HEADER + out.pos;
    return 0;
}

/* ---- decode -------------------------------------------------------------------------------- */

static int st_frame_header_check(const unsigned char *s, size_t src_len, uint64_t *size,
                                 unsigned *width)
{
    if (src_len < ST_FRAME_HEADER)
        return st_error_set(ST_ECORRUPT, "frame: %zu bytes, shorter than the %u-byte header",
                            src_len, ST_FRAME_HEADER);
    if (memcmp(s, st_frame_magic, sizeof st_frame_magic) != 0)
        return st_error_set(ST_ECORRUPT, "frame header: bad magic %02x %02x %02x (want \"STZ\")",
                            s[0], s[1], s[2]);
    if (s[3] != ST_FRAME_VERSION)
        return st_error_set(ST_EVERSION, "frame header: version %u (this build reads %u)", s[3],
                            ST_FRAME_VERSION);
    if (s[4] & ~ST_FRAME_FLAG_SHUFFLE)
        return st_error_set(ST_ECORRUPT, "frame header byte 4: reserved flag bits 0x%02x set",
                            s[4] & ~ST_FRAME_FLAG_SHUFFLE);
    bool shuffle = s[4] & ST_FRAME_FLAG_SHUFFLE;
    bool width_ok = shuffle ? (s[5] == 2 || s[5] == 4 || s[5] == 8) : s[5] == 0;
    if (!width_ok)
        return st_error_set(ST_ECORRUPT, "frame header byte 5: shuffle width %u with%s shuffle "
                            "flag", s[5], shuffle ? "" : "out");
    if (s[6] || s[7])
        return st_error_set(ST_ECORRUPT, "frame header bytes 6..7: reserved, found %02x %02x",
                            s[6], s[7]);
    *size = st_get64(s + 8);
    *width = shuffle ? s[5] : 0;
    return 0;
}

int st_frame_decoded_size(const void *src, size_t src_len, uint64_t *out)
{
    unsigned width;
    if (!src || !out)
        return st_error_set(ST_EINVAL, "frame decoded size: NULL argument");
    return st_frame_header_check(src, src_len, out, &width);
}

/* The zstd frame header (RFC 8878, section 3.1.1.1) must describe exactly what st_frame_encode
 * writes: a data frame, content checksum on, no dictionary, a content size equal to the declared
 * size, a window within the cap, and the unused and reserved descriptor bits clear. Parsed here
 * from the stable format rather than through zstd's experimental header API. */
static int st_frame_zstd_header_check(const unsigned char *z, size_t zlen, uint64_t declared)
{
    static const unsigned char zmagic[4] = {0x28, 0xb5, 0x2f, 0xfd};
    if (zlen < 5)
        return st_error_set(ST_ECORRUPT, "frame: zstd frame truncated (%zu bytes)", zlen);
    if (memcmp(z, zmagic, 4) != 0)
        return st_error_set(ST_ECORRUPT, "frame byte %u: not a zstd data frame",
                            ST_FRAME_HEADER);
    unsigned fhd = z[4];
    unsigned fcs_flag = fhd >> 6;
    bool single = fhd & 0x20;
    if (fhd & 0x18)
        return st_error_set(ST_ECORRUPT, "frame byte %u: zstd descriptor 0x%02x has its unused "
                            "or reserved bit set", ST_FRAME_HEADER + 4, fhd);
    if (!(fhd & 0x04))
        return st_error_set(ST_ECORRUPT, "frame: zstd frame has no content checksum");
    if (fhd & 0x03)
        return st_error_set(ST_ECORRUPT, "frame: zstd frame names a dictionary");
    if (fcs_flag == 0 && !single)
        return st_error_set(ST_ECORRUPT, "frame: zstd frame does not state its content size");

    size_t fcs_len = fcs_flag == 0 ? 1 : (size_t)1 << fcs_flag; /* 1, 2, 4 or 8 bytes */
    size_t hdr_len = 5 + (single ? 0 : 1) + fcs_len;
    if (zlen < hdr_len)
        return st_error_set(ST_ECORRUPT, "frame: zstd frame header truncated (%zu of %zu bytes)",
                            zlen, hdr_len);
    const unsigned char *f = z + hdr_len - fcs_len;
    uint64_t content = 0;
    for (size_t i = fcs_len; i-- > 0;)
        content = (content << 8) | f[i];
    if (fcs_len == 2)
        content += 256; /* the two-byte form is offset by 256 */
    if (content != declared)
        return st_error_set(ST_ECORRUPT, "frame: zstd content size %llu, header declares %llu",
                            (unsigned long long)content, (unsigned long long)declared);

    uint64_t window = content; /* a single-segment frame's window is its content */
    if (!single) {
        unsigned wd = z[5];
        uint64_t base = 1ull << (10 + (wd >> 3));
        window = base + (base / 8) * (wd & 7);
    }
    if (window > (1ull << ST_FRAME_WINDOWLOG_MAX))
        return st_error_set(ST_ETOOBIG, "frame: zstd window of %llu bytes exceeds 2^%d",
                            (unsigned long long)window, ST_FRAME_WINDOWLOG_MAX);
    return 0;
}

/* Fill out completely from the zstd stream. *left keeps zstd's last answer: 0 once the frame has
 * ended (after which the stream would start reading a new frame). */
static int st_frame_pull(ZSTD_DCtx *dctx, ZSTD_outBuffer *out, ZSTD_inBuffer *in,
                         uint64_t declared, size_t produced, size_t *left)
{
    while (out->pos < out->size) {
        size_t in_before = in->pos, out_before = out->pos;
        *left = ZSTD_decompressStream(dctx, out, in);
        if (ZSTD_isError(*left))
            return st_frame_zstd_fail(*left, "decode", ST_ECORRUPT);
        if (*left == 0 && out->pos < out->size)
            return st_error_set(ST_ECORRUPT, "frame: zstd frame ends after %zu bytes, "
                                "header declares %llu", produced + out->pos,
                                (unsigned long long)declared);
        if (in->pos == in_before && out->pos == out_before)
            return st_error_set(ST_ECORRUPT, "frame: truncated after %zu of %llu bytes",
                                produced + out->pos, (unsigned long long)declared);
    }
    return 0;
}

/* All declared bytes are out. Unless the frame has already ended, let zstd read the rest of it
 * (an empty last block, the checksum) into a spill buffer that must stay empty. Then no input
 * may remain. */
static int st_frame_finish(ZSTD_DCtx *dctx, ZSTD_inBuffer *in, uint64_t declared, size_t left)
{
    unsigned char spill[64];
    while (left != 0) {
        ZSTD_outBuffer out = {spill, sizeof spill, 0};
        size_t in_before = in->pos;
        left = ZSTD_decompressStream(dctx, &out, in);
        if (ZSTD_isError(left))
            return st_frame_zstd_fail(left, "decode", ST_ECORRUPT);
        if (out.pos > 0)
            return st_error_set(ST_ECORRUPT, "frame: zstd frame holds more than the %llu "
                                "declared bytes", (unsigned long long)declared);
        if (left != 0 && in->pos == in_before)
            return st_error_set(ST_ECORRUPT, "frame: truncated at the end of the zstd frame");
    }
    if (in->pos != in->size)
        return st_error_set(ST_ECORRUPT, "frame: %zu trailing bytes after the zstd frame",
                            in->size - in->pos);
    return 0;
}

int st_frame_decode(st_frame_ctx *ctx, void *dst, size_t dst_cap, const void *src, size_t src_len,
                    size_t *out_len)
{
    uint64_t declared = 0;
    unsigned width = 0;
    if (!ctx || !src || !out_len || (!dst && dst_cap))
        return st_error_set(ST_EINVAL, "frame decode: NULL argument");
    int rc = st_frame_header_check(src, src_len, &declared, &width);
    if (rc)
        return rc;
    if (declared > dst_cap)
        return st_error_set(ST_ETOOBIG, "frame: declares %llu bytes, the buffer holds %zu",
                            (unsigned long long)declared, dst_cap);
    const unsigned char *z = (const unsigned char *)src + ST_FRAME_HEADER;
    size_t zlen = src_len - ST_FRAME_HEADER;
    if ((rc = st_frame_zstd_header_check(z, zlen, declared)))
        return rc;

    ZSTD_DCtx *dctx = ctx->dctx;
    ZSTD_DCtx_reset(dctx, ZSTD_reset_session_only);
    ZSTD_inBuffer in = {z, zlen, 0};
    unsigned char *d = dst;
    size_t size = (size_t)declared;
    size_t left = 1; /* nothing read yet: the frame has not ended */
    if (width == 0) {
        ZSTD_outBuffer out = {d, size, 0};
        rc = st_frame_pull(dctx, &out, &in, declared, 0, &left);
    } else {
        for (size_t off = 0; rc == 0 && off < size; off += ST_FRAME_BLOCK) {
            size_t len = size - off < ST_FRAME_BLOCK ? size - off : ST_FRAME_BLOCK;
            ZSTD_outBuffer out = {ctx->block, len, 0};
            rc = st_frame_pull(dctx, &out, &in, declared, off, &left);
            if (rc == 0)
                st_unshuffle(d + off, ctx->block, len, width);
        }
    }
    if (rc == 0)
        rc = st_frame_finish(dctx, &in, declared, left);
    if (rc) {
        ZSTD_DCtx_reset(dctx, ZSTD_reset_session_only);
        return rc;
    }
    *out_len = size;
    return 0;
}
