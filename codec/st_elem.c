/*
 * st_elem.c - element codecs (fp32 <-> bf16, fp32 <-> IEEE half), their run-time ISA dispatch,
 * slice-wise conversion between any two codecs, and the error figures of a lossy round trip.
 *
 * Invariants:
 * 1. The scalar functions are the reference. Every vector path produces exactly the bits the
 *    scalar reference produces, for every input, including NaN payloads and subnormals; the tests
 *    in tests/codec prove it on all 2^16 encodings (decode) and millions of inputs (encode).
 * 2. f16 follows the hardware: the vector paths use F16C / AVX-512 conversions with an explicit
 *    round-to-nearest-even immediate, so MXCSR's rounding mode, FTZ and DAZ never matter (F16C
 *    ignores FTZ/DAZ); the scalar reference reproduces the hardware's NaN handling (quiet bit
 *    set, payload truncated or shifted).
 * 3. bf16 encode is integer arithmetic on every path. VCVTNEPS2BF16 is not used because it
 *    flushes subnormal inputs and outputs to zero, which IEEE rounding does not.
 * 4. Element pointers need no alignment beyond a byte: scalar code reads and writes through
 *    memcpy and vector code through unaligned loads and stores, so st_codec_convert can work on
 *    elements at any offset of a file buffer.
 * 5. The dispatch level is one atomic int, chosen on first use (the best this CPU supports) or
 *    forced by st_codec_isa_set(); every call reads it once, so a concurrent change is harmless.
 * 6. st_codec_bf16_encode_stream writes the same codes as st_codec_bf16_encode (its scalar
 *    reference is the same rounding); its streaming stores are fenced (sfence) before it returns,
 *    so whatever orders the return before another thread's read (a pool's barrier) orders them.
 */
#include <immintrin.h>
#include <math.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <string.h>
#include <strings.h>

#include "st_codec.h"

/* Elements of one bf16<->f16 slice in st_codec_convert: 64 Ki fp32 (256 KiB) stay in L2, so
 * the intermediate fp32 never goes to memory even when the caller's scratch is larger. */
#define ST_CONVERT_SLICE_ELEMS (64u * 1024u)

/* ---- scalar reference ----------------------------------------------------------------------- */

static inline uint32_t st_load32(const unsigned char *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint16_t st_load16(const unsigned char *p)
{
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}

static inline void st_store32(unsigned char *p, uint32_t v)
{
    memcpy(p, &v, 4);
}

static inline void st_store16(unsigned char *p, uint16_t v)
{
    memcpy(p, &v, 2);
}

static inline uint16_t st_bf16_from_bits(uint32_t u)
{
    /* NaN: truncating could clear every payload bit left and make Inf, so force the quiet bit. */
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    /* Round to nearest even: add just under half an ulp, plus one when the kept lsb is odd.
     * A carry out of the mantissa bumps the exponent, which is right, up to Inf. */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline uint16_t st_f16_from_bits(uint32_t u)
{
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t a = u & 0x7fffffffu;

    if (a > 0x7f800000u) /* NaN, as vcvtps2ph: quiet bit set, top 10 payload bits kept */
        return (uint16_t)(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
    if (a >= 0x477ff000u) /* >= 65520 = 65504 + half an ulp: a tie whose even side is Inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a >= 0x38800000u) { /* >= 2^-14: a normal half; rebias and round to nearest even */
        uint32_t r = a - ((127u - 15u) << 23);
        r += 0x0fffu + ((r >> 13) & 1u);
        return (uint16_t)(sign | (r >> 13));
    }
    if (a <= 0x33000000u) /* <= 2^-25, half the smallest subnormal (the tie goes to even 0) */
        return (uint16_t)sign;
    /* A subnormal half counts units of 2^-24: shift the full significand down by the gap. */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126u - e; /* 14 .. 24 for e in 102 .. 112 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u);
    uint32_t half = 1u << (shift - 1u);
    r += (rem > half) | ((rem == half) & r);
    return (uint16_t)(sign | r); /* r may reach 0x400, the smallest normal: the right encoding */
}

static inline uint32_t st_f16_to_bits(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu;
    uint32_t m = h & 0x3ffu;

    if (e == 0x1f) /* Inf or NaN; vcvtph2ps quiets a signalling NaN, so do the same */
        return sign | 0x7f800000u | (m ? 0x400000u : 0u) | (m << 13);
    if (e != 0)
        return sign | ((e + 127u - 15u) << 23) | (m << 13);
    if (m == 0)
        return sign;
    /* Subnormal half m * 2^-24: normalise so that bit 10 is the implicit one. */
    uint32_t s = (uint32_t)__builtin_clz(m) - 21u;
    return sign | ((113u - s) << 23) | (((m << s) & 0x3ffu) << 13);
}

static void st_bf16_encode_scalar(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        st_store16(d + 2 * i, st_bf16_from_bits(st_load32(s + 4 * i)));
}

/* The reference of st_codec_bf16_encode_stream: the encode above, and each code widened. */
static void st_bf16_encode_stream_scalar(void *dst, void *wide, const void *src, size_t n)
{
    unsigned char *d = dst, *w = wide;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++) {
        uint16_t h = st_bf16_from_bits(st_load32(s + 4 * i));
        st_store16(d + 2 * i, h);
        if (w)
            st_store32(w + 4 * i, (uint32_t)h << 16);
    }
}

static void st_bf16_decode_scalar(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        st_store32(d + 4 * i, (uint32_t)st_load16(s + 2 * i) << 16);
}

static void st_f16_encode_scalar(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        st_store16(d + 2 * i, st_f16_from_bits(st_load32(s + 4 * i)));
}

static void st_f16_decode_scalar(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    for (size_t i = 0; i < n; i++)
        st_store32(d + 4 * i, st_f16_to_bits(st_load16(s + 2 * i)));
}

/* ---- AVX2 + F16C ---------------------------------------------------------------------------
 * 16 elements per step. The tail (< 16 elements) goes through a zero-padded stack buffer and the
 * same vector step, so tails are computed by the vector code too, not by the reference. */

#define ST_AVX2 __attribute__((target("avx2,f16c")))

/* The rounding immediate of vcvtps2ph: nearest-even whatever MXCSR says, no exception flags.
 * A macro, not a const, because the intrinsic needs an immediate even at -O0. */
#define ST_F16_RNE (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)

ST_AVX2 static inline __m256i st_bf16_round8_avx2(__m256i u)
{
    const __m256i one = _mm256_set1_epi32(1);
    const __m256i bias = _mm256_set1_epi32(0x7fff);
    const __m256i absmask = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000);
    const __m256i quiet = _mm256_set1_epi32(0x0040);

    __m256i hi = _mm256_srli_epi32(u, 16);
    __m256i r = _mm256_srli_epi32(
        _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(hi, one)), 16);
    __m256i isnan = _mm256_cmpgt_epi32(_mm256_and_si256(u, absmask), inf);
    return _mm256_blendv_epi8(r, _mm256_or_si256(hi, quiet), isnan);
}

ST_AVX2 static inline void st_bf16_encode16_avx2(unsigned char *d, const unsigned char *s)
{
    __m256i r0 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)s));
    __m256i r1 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)(s + 32)));
    /* packus interleaves 128-bit lanes (r0 lo, r1 lo, r0 hi, r1 hi); the permute restores order.
     * Values are <= 0xffff so the unsigned saturation never triggers. */
    __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8);
    _mm256_storeu_si256((__m256i *)d, p);
}

ST_AVX2 static void st_bf16_encode_avx2(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        st_bf16_encode16_avx2(d + 2 * i, s + 4 * i);
    if (i < n) {
        unsigned char in[64] = {0}, out[32];
        memcpy(in, s + 4 * i, 4 * (n - i));
        st_bf16_encode16_avx2(out, in);
        memcpy(d + 2 * i, out, 2 * (n - i));
    }
}

/* k <= 16 elements through zero-padded stack buffers and the vector step (heads and tails). */
ST_AVX2 static void st_bf16_stream_part_avx2(unsigned char *d, unsigned char *w,
                                             const unsigned char *s, size_t k)
{
    unsigned char in[64] = {0}, out[32], wo[64];
    memcpy(in, s, 4 * k);
    __m256i r0 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)in));
    __m256i r1 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)(in + 32)));
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8));
    memcpy(d, out, 2 * k);
    if (w) {
        _mm256_storeu_si256((__m256i *)wo, _mm256_slli_epi32(r0, 16));
        _mm256_storeu_si256((__m256i *)(wo + 32), _mm256_slli_epi32(r1, 16));
        memcpy(w, wo, 4 * k);
    }
}

/* Streaming stores need dst 32-byte aligned: the elements before that go through the part step
 * (a dst at an odd address never gets there and is written with ordinary stores). */
ST_AVX2 static void st_bf16_encode_stream_avx2(void *dst, void *wide, const void *src, size_t n)
{
    unsigned char *d = dst, *w = wide;
    const unsigned char *s = src;
    size_t i = 0;
    int nt = ((uintptr_t)d & 1u) == 0;
    while (nt && i < n && ((uintptr_t)(d + 2 * i) & 31u)) {
        size_t k = (32u - ((uintptr_t)(d + 2 * i) & 31u)) / 2u;
        k = k < n - i ? k : n - i;
        st_bf16_stream_part_avx2(d + 2 * i, w ? w + 4 * i : NULL, s + 4 * i, k);
        i += k;
    }
    for (; i + 16 <= n; i += 16) {
        __m256i r0 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)(s + 4 * i)));
        __m256i r1 = st_bf16_round8_avx2(_mm256_loadu_si256((const __m256i *)(s + 4 * i + 32)));
        __m256i p = _mm256_permute4x64_epi64(_mm256_packus_epi32(r0, r1), 0xd8);
        if (nt)
            _mm256_stream_si256((__m256i *)(d + 2 * i), p);
        else
            _mm256_storeu_si256((__m256i *)(d + 2 * i), p);
        if (w) {
            _mm256_storeu_si256((__m256i *)(w + 4 * i), _mm256_slli_epi32(r0, 16));
            _mm256_storeu_si256((__m256i *)(w + 4 * i + 32), _mm256_slli_epi32(r1, 16));
        }
    }
    if (i < n)
        st_bf16_stream_part_avx2(d + 2 * i, w ? w + 4 * i : NULL, s + 4 * i, n - i);
    if (nt)
        _mm_sfence();
}

ST_AVX2 static inline void st_bf16_decode16_avx2(unsigned char *d, const unsigned char *s)
{
    __m256i h0 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)s));
    __m256i h1 = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(s + 16)));
    _mm256_storeu_si256((__m256i *)d, _mm256_slli_epi32(h0, 16));
    _mm256_storeu_si256((__m256i *)(d + 32), _mm256_slli_epi32(h1, 16));
}

ST_AVX2 static void st_bf16_decode_avx2(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        st_bf16_decode16_avx2(d + 4 * i, s + 2 * i);
    if (i < n) {
        unsigned char in[32] = {0}, out[64];
        memcpy(in, s + 2 * i, 2 * (n - i));
        st_bf16_decode16_avx2(out, in);
        memcpy(d + 4 * i, out, 4 * (n - i));
    }
}

ST_AVX2 static inline void st_f16_encode16_avx2(unsigned char *d, const unsigned char *s)
{
    __m128i h0 = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)s), ST_F16_RNE);
    __m128i h1 = _mm256_cvtps_ph(_mm256_loadu_ps((const float *)(s + 32)), ST_F16_RNE);
    _mm_storeu_si128((__m128i *)d, h0);
    _mm_storeu_si128((__m128i *)(d + 16), h1);
}

ST_AVX2 static void st_f16_encode_avx2(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        st_f16_encode16_avx2(d + 2 * i, s + 4 * i);
    if (i < n) {
        unsigned char in[64] = {0}, out[32];
        memcpy(in, s + 4 * i, 4 * (n - i));
        st_f16_encode16_avx2(out, in);
        memcpy(d + 2 * i, out, 2 * (n - i));
    }
}

ST_AVX2 static inline void st_f16_decode16_avx2(unsigned char *d, const unsigned char *s)
{
    __m256 f0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)s));
    __m256 f1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + 16)));
    _mm256_storeu_ps((float *)d, f0);
    _mm256_storeu_ps((float *)(d + 32), f1);
}

ST_AVX2 static void st_f16_decode_avx2(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 16 <= n; i += 16)
        st_f16_decode16_avx2(d + 4 * i, s + 2 * i);
    if (i < n) {
        unsigned char in[32] = {0}, out[64];
        memcpy(in, s + 2 * i, 2 * (n - i));
        st_f16_decode16_avx2(out, in);
        memcpy(d + 4 * i, out, 4 * (n - i));
    }
}

/* ---- AVX-512 F + BW + VL -------------------------------------------------------------------
 * 32 elements per step; the tail uses masked loads and stores (masked-off lanes never fault). */

#define ST_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,f16c")))

ST_AVX512 static inline __m256i st_bf16_round16_avx512(__m512i u)
{
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i bias = _mm512_set1_epi32(0x7fff);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x0040);

    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(hi, one)), 16);
    __mmask16 isnan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absmask), inf);
    r = _mm512_mask_or_epi32(r, isnan, hi, quiet);
    return _mm512_cvtepi32_epi16(r);
}

ST_AVX512 static void st_bf16_encode_avx512(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i r0 = st_bf16_round16_avx512(_mm512_loadu_si512(s + 4 * i));
        __m256i r1 = st_bf16_round16_avx512(_mm512_loadu_si512(s + 4 * i + 64));
        _mm256_storeu_si256((__m256i *)(d + 2 * i), r0);
        _mm256_storeu_si256((__m256i *)(d + 2 * i + 32), r1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m256i r = st_bf16_round16_avx512(_mm512_maskz_loadu_epi32(k, s + 4 * i));
        _mm256_mask_storeu_epi16(d + 2 * i, k, r);
    }
}

/* The rounded codes of 16 elements in 32-bit lanes (st_bf16_round16_avx512 before narrowing). */
ST_AVX512 static inline __m512i st_bf16_round16w_avx512(__m512i u)
{
    const __m512i one = _mm512_set1_epi32(1);
    const __m512i bias = _mm512_set1_epi32(0x7fff);
    const __m512i absmask = _mm512_set1_epi32(0x7fffffff);
    const __m512i inf = _mm512_set1_epi32(0x7f800000);
    const __m512i quiet = _mm512_set1_epi32(0x0040);

    __m512i hi = _mm512_srli_epi32(u, 16);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(u, bias), _mm512_and_si512(hi, one)), 16);
    __mmask16 isnan = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, absmask), inf);
    return _mm512_mask_or_epi32(r, isnan, hi, quiet);
}

/* k <= 16 elements with masked loads and stores (heads and tails). */
ST_AVX512 static inline void st_bf16_stream_part_avx512(unsigned char *d, unsigned char *w,
                                                        const unsigned char *s, size_t k)
{
    __mmask16 m = k >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << k) - 1u);
    __m512i r = st_bf16_round16w_avx512(_mm512_maskz_loadu_epi32(m, s));
    _mm256_mask_storeu_epi16(d, m, _mm512_cvtepi32_epi16(r));
    if (w)
        _mm512_mask_storeu_epi32(w, m, _mm512_slli_epi32(r, 16));
}

/* Streaming stores need dst 64-byte aligned: the elements before that go through the part step
 * (a dst at an odd address never gets there and is written with ordinary stores). */
ST_AVX512 static void st_bf16_encode_stream_avx512(void *dst, void *wide, const void *src,
                                                   size_t n)
{
    unsigned char *d = dst, *w = wide;
    const unsigned char *s = src;
    size_t i = 0;
    int nt = ((uintptr_t)d & 1u) == 0;
    while (nt && i < n && ((uintptr_t)(d + 2 * i) & 63u)) {
        size_t k = (64u - ((uintptr_t)(d + 2 * i) & 63u)) / 2u;
        k = k < 16 ? k : 16;
        k = k < n - i ? k : n - i;
        st_bf16_stream_part_avx512(d + 2 * i, w ? w + 4 * i : NULL, s + 4 * i, k);
        i += k;
    }
    for (; i + 32 <= n; i += 32) {
        __m512i r0 = st_bf16_round16w_avx512(_mm512_loadu_si512(s + 4 * i));
        __m512i r1 = st_bf16_round16w_avx512(_mm512_loadu_si512(s + 4 * i + 64));
        __m512i p = _mm512_inserti64x4(_mm512_castsi256_si512(_mm512_cvtepi32_epi16(r0)),
                                       _mm512_cvtepi32_epi16(r1), 1);
        if (nt)
            _mm512_stream_si512((void *)(d + 2 * i), p);
        else
            _mm512_storeu_si512(d + 2 * i, p);
        if (w) {
            _mm512_storeu_si512(w + 4 * i, _mm512_slli_epi32(r0, 16));
            _mm512_storeu_si512(w + 4 * i + 64, _mm512_slli_epi32(r1, 16));
        }
    }
    for (; i < n; i += 16)
        st_bf16_stream_part_avx512(d + 2 * i, w ? w + 4 * i : NULL, s + 4 * i,
                                   n - i < 16 ? n - i : 16);
    if (nt)
        _mm_sfence();
}

ST_AVX512 static void st_bf16_decode_avx512(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512i h0 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + 2 * i)));
        __m512i h1 = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(s + 2 * i + 32)));
        _mm512_storeu_si512(d + 4 * i, _mm512_slli_epi32(h0, 16));
        _mm512_storeu_si512(d + 4 * i + 64, _mm512_slli_epi32(h1, 16));
    }
    for (; i < n; i += 16) {
        __mmask16 k = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512i h = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, s + 2 * i));
        _mm512_mask_storeu_epi32(d + 4 * i, k, _mm512_slli_epi32(h, 16));
    }
}

ST_AVX512 static void st_f16_encode_avx512(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i h0 = _mm512_cvtps_ph(_mm512_loadu_ps(s + 4 * i), ST_F16_RNE);
        __m256i h1 = _mm512_cvtps_ph(_mm512_loadu_ps(s + 4 * i + 64), ST_F16_RNE);
        _mm256_storeu_si256((__m256i *)(d + 2 * i), h0);
        _mm256_storeu_si256((__m256i *)(d + 2 * i + 32), h1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(k, s + 4 * i), ST_F16_RNE);
        _mm256_mask_storeu_epi16(d + 2 * i, k, h);
    }
}

ST_AVX512 static void st_f16_decode_avx512(void *dst, const void *src, size_t n)
{
    unsigned char *d = dst;
    const unsigned char *s = src;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        __m512 f0 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 2 * i)));
        __m512 f1 = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(s + 2 * i + 32)));
        _mm512_storeu_ps(d + 4 * i, f0);
        _mm512_storeu_ps(d + 4 * i + 64, f1);
    }
    for (; i < n; i += 16) {
        __mmask16 k = (n - i >= 16) ? (__mmask16)0xffff : (__mmask16)((1u << (n - i)) - 1u);
        __m512 f = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(k, s + 2 * i));
        _mm512_mask_storeu_ps(d + 4 * i, k, f);
    }
}

/* ---- dispatch ------------------------------------------------------------------------------ */

typedef void (*st_elem_fn)(void *dst, const void *src, size_t n);
typedef void (*st_elem_stream_fn)(void *dst, void *wide, const void *src, size_t n);

typedef struct st_elem_impl {
    st_elem_fn bf16_encode;
    st_elem_fn bf16_decode;
    st_elem_fn f16_encode;
    st_elem_fn f16_decode;
    st_elem_stream_fn bf16_encode_stream;
} st_elem_impl;

static const st_elem_impl st_elem_impls[] = {
    [ST_ISA_SCALAR] = {st_bf16_encode_scalar, st_bf16_decode_scalar, st_f16_encode_scalar,
                       st_f16_decode_scalar, st_bf16_encode_stream_scalar},
    [ST_ISA_AVX2] = {st_bf16_encode_avx2, st_bf16_decode_avx2, st_f16_encode_avx2,
                     st_f16_decode_avx2, st_bf16_encode_stream_avx2},
    [ST_ISA_AVX512] = {st_bf16_encode_avx512, st_bf16_decode_avx512, st_f16_encode_avx512,
                       st_f16_decode_avx512, st_bf16_encode_stream_avx512},
};

static atomic_int st_isa_current = -1;

/* common's detector (st_cpu_features) counts the wide registers only where the OS saves them. */
st_codec_isa_level st_codec_isa_best(void)
{
    if (!st_cpu_has(ST_CPU_AVX2 | ST_CPU_F16C))
        return ST_ISA_SCALAR;
    if (st_cpu_has(ST_CPU_AVX512F | ST_CPU_AVX512BW | ST_CPU_AVX512VL))
        return ST_ISA_AVX512;
    return ST_ISA_AVX2;
}

st_codec_isa_level st_codec_isa(void)
{
    int level = atomic_load_explicit(&st_isa_current, memory_order_relaxed);
    if (level < 0) {
        level = (int)st_codec_isa_best();
        atomic_store_explicit(&st_isa_current, level, memory_order_relaxed);
    }
    return (st_codec_isa_level)level;
}

int st_codec_isa_set(st_codec_isa_level level)
{
    if ((int)level < (int)ST_ISA_SCALAR || (int)level > (int)ST_ISA_AVX512)
        return st_error_set(ST_EINVAL, "codec ISA level %d: no such level", (int)level);
    st_codec_isa_level best = st_codec_isa_best();
    if (level > best)
        return st_error_set(ST_EINVAL, "codec ISA level %s: this CPU supports at most %s",
                            st_codec_isa_name(level), st_codec_isa_name(best));
    atomic_store_explicit(&st_isa_current, (int)level, memory_order_relaxed);
    return 0;
}

const char *st_codec_isa_name(st_codec_isa_level level)
{
    switch (level) {
    case ST_ISA_SCALAR:
        return "scalar";
    case ST_ISA_AVX2:
        return "avx2";
    case ST_ISA_AVX512:
        return "avx512";
    }
    return "unknown";
}

static const st_elem_impl *st_elem_current(void)
{
    return &st_elem_impls[st_codec_isa()];
}

void st_codec_bf16_encode(uint16_t *dst, const float *src, size_t n)
{
    st_elem_current()->bf16_encode(dst, src, n);
}

void st_codec_bf16_encode_stream(uint16_t *dst, float *wide, const float *src, size_t n)
{
    st_elem_current()->bf16_encode_stream(dst, wide, src, n);
}

void st_codec_bf16_decode(float *dst, const uint16_t *src, size_t n)
{
    st_elem_current()->bf16_decode(dst, src, n);
}

void st_codec_f16_encode(uint16_t *dst, const float *src, size_t n)
{
    st_elem_current()->f16_encode(dst, src, n);
}

void st_codec_f16_decode(float *dst, const uint16_t *src, size_t n)
{
    st_elem_current()->f16_decode(dst, src, n);
}

/* ---- codec ids ----------------------------------------------------------------------------- */

static const struct {
    const char *name;
    size_t elem_size;
} st_codec_table[ST_CODEC_COUNT] = {
    [ST_CODEC_FP32] = {"fp32", 4},
    [ST_CODEC_BF16] = {"bf16", 2},
    [ST_CODEC_F16] = {"f16", 2},
};

int st_codec_check(uint32_t id)
{
    if (id >= ST_CODEC_COUNT)
        return st_error_set(ST_ECODEC, "codec id %u is unknown (known: 0 fp32, 1 bf16, 2 f16)",
                            id);
    return 0;
}

size_t st_codec_elem_size(uint32_t id)
{
    return id < ST_CODEC_COUNT ? st_codec_table[id].elem_size : 0;
}

const char *st_codec_name(uint32_t id)
{
    return id < ST_CODEC_COUNT ? st_codec_table[id].name : "unknown";
}

int st_codec_parse(const char *name, st_codec_id *out)
{
    if (name) {
        for (uint32_t id = 0; id < ST_CODEC_COUNT; id++) {
            if (strcasecmp(name, st_codec_table[id].name) == 0) {
                *out = (st_codec_id)id;
                return 0;
            }
        }
    }
    return st_error_set(ST_ECODEC, "codec \"%s\" is unknown (known: fp32, bf16, f16)",
                        name ? name : "(null)");
}

/* ---- conversion ---------------------------------------------------------------------------- */

static st_elem_fn st_elem_encoder(const st_elem_impl *impl, uint32_t id)
{
    return id == ST_CODEC_BF16 ? impl->bf16_encode : impl->f16_encode;
}

static st_elem_fn st_elem_decoder(const st_elem_impl *impl, uint32_t id)
{
    return id == ST_CODEC_BF16 ? impl->bf16_decode : impl->f16_decode;
}

int st_codec_convert(uint32_t dst_id, void *dst, uint32_t src_id, const void *src, size_t n,
                     void *scratch, size_t scratch_cap)
{
    int rc = st_codec_check(src_id);
    if (rc)
        return rc;
    if ((rc = st_codec_check(dst_id)))
        return rc;
    /* Checked before n == 0 returns so that a caller's wrong scratch shows up on every call. */
    bool via_fp32 = src_id != dst_id && src_id != ST_CODEC_FP32 && dst_id != ST_CODEC_FP32;
    if (via_fp32 && (!scratch || scratch_cap < ST_CODEC_SCRATCH_MIN))
        return st_error_set(ST_EINVAL,
                            "codec convert %s -> %s: scratch of %zu bytes, at least %u needed",
                            st_codec_name(src_id), st_codec_name(dst_id),
                            scratch ? scratch_cap : 0, ST_CODEC_SCRATCH_MIN);
    if (n == 0)
        return 0;
    if (!dst || !src)
        return st_error_set(ST_EINVAL, "codec convert: NULL buffer for %zu elements", n);
    if (n > SIZE_MAX / 4)
        return st_error_set(ST_EINVAL, "codec convert: %zu elements overflow a size", n);

    const st_elem_impl *impl = st_elem_current();
    if (src_id == dst_id) {
        memcpy(dst, src, n * st_codec_elem_size(src_id));
    } else if (src_id == ST_CODEC_FP32) {
        st_elem_encoder(impl, dst_id)(dst, src, n);
    } else if (dst_id == ST_CODEC_FP32) {
        st_elem_decoder(impl, src_id)(dst, src, n);
    } else {
        /* bf16 <-> f16: widen a slice to fp32 in the scratch, narrow it into dst. Widening is
         * exact, so this equals going through a full fp32 array. */
        size_t slice = scratch_cap / sizeof(float);
        if (slice > ST_CONVERT_SLICE_ELEMS)
            slice = ST_CONVERT_SLICE_ELEMS;
        st_elem_fn widen = st_elem_decoder(impl, src_id);
        st_elem_fn narrow = st_elem_encoder(impl, dst_id);
        const unsigned char *s = src;
        unsigned char *d = dst;
        for (size_t i = 0; i < n; i += slice) {
            size_t k = n - i < slice ? n - i : slice;
            widen(scratch, s + 2 * i, k);
            narrow(d + 2 * i, scratch, k);
        }
    }
    return 0;
}

/* ---- error figures ------------------------------------------------------------------------- */

void st_codec_errstat_add(st_codec_errstat *st, const float *a, const float *b, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        float x = a[i], y = b[i];
        uint32_t xb, yb;
        memcpy(&xb, &x, 4);
        memcpy(&yb, &y, 4);
        if (xb != yb)
            st->differ++;
        if (isfinite(x) && isfinite(y)) {
            double d = fabs((double)x - (double)y);
            if (d > st->max_abs)
                st->max_abs = d;
            if (x != 0.0f && d / fabs((double)x) > st->max_rel)
                st->max_rel = d / fabs((double)x);
        }
        /* NaN has no sign worth comparing; Inf does. */
        if (!isnan(x) && !isnan(y) && x != 0.0f && y != 0.0f &&
            !signbit(x) != !signbit(y))
            st->sign_changes++;
        if (x != 0.0f && y == 0.0f)
            st->new_zeros++;
        if (isfinite(x) && !isfinite(y))
            st->new_nonfinite++;
    }
    st->n += n;
}
