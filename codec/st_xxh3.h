/*
 * st_xxh3.h - XXH3-64 (seed 0, the default secret) written out for code that cannot call
 * libxxhash: the CUDA kernels that digest state on the device. Internal to the modules (not part
 * of the codec API, st_codec.h); st_checksum (libxxhash) stays the reference everywhere else.
 *
 * Invariants:
 * 1. st_xxh3_64(p, n) == XXH3_64bits(p, n) for every n: the scalar functions follow the published
 *    algorithm (xxhash.h 0.8: the 0..16, 17..128, 129..240 and long paths) and are compiled for
 *    the host and the device alike (ST_XHD). tests/codec/test_codec_xxh3.c compares them with
 *    libxxhash on every length up to 4,200 bytes and on long buffers, in every build.
 * 2. The long path is an 8-lane accumulator updated one 64-byte stripe at a time and scrambled
 *    after every 1,024-byte block; within a block the updates are sums mod 2^64, so any grouping
 *    of a block's stripes gives the same accumulators. The device's warp form (st_xxh3_warp,
 *    __CUDACC__ only) relies on exactly that: 32 lanes = 8 accumulator lanes x 4 stripes, summed
 *    with shuffles before each scramble. test_gpu_codec checks it against libxxhash.
 * 3. Plain C11 and C++ (nvcc) alike: no casts from void *, no designated initialisers.
 */
#ifndef ST_XXH3_H
#define ST_XXH3_H

#include <stddef.h>
#include <stdint.h>

#ifdef __CUDACC__
#define ST_XHD __host__ __device__ __forceinline__
#else
#define ST_XHD static inline
#endif

#define ST_XXH_P32_1 0x9E3779B1u
#define ST_XXH_P32_2 0x85EBCA77u
#define ST_XXH_P32_3 0xC2B2AE3Du
#define ST_XXH_P64_1 0x9E3779B185EBCA87ull
#define ST_XXH_P64_2 0xC2B2AE3D27D4EB4Full
#define ST_XXH_P64_3 0x165667B19E3779F9ull
#define ST_XXH_P64_4 0x85EBCA77C2B2AE63ull
#define ST_XXH_P64_5 0x27D4EB2F165667C5ull
#define ST_XXH_STRIPE 64u
#define ST_XXH_BLOCK 1024u       /* 16 stripes between scrambles (192-byte secret) */
#define ST_XXH_SECRET_SIZE 192u

/* The default secret as 8-byte little-endian words at every byte offset the algorithm reads:
 * st_xxh3_sec(o) is the word at byte o (o <= 184). */
ST_XHD uint64_t st_xxh3_sec(uint32_t o)
{
    /* XXH3's kSecret, 192 bytes */
    const uint8_t k[ST_XXH_SECRET_SIZE] = {
        0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad,
        0x1c, 0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3,
        0x67, 0x1f, 0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc,
        0xff, 0x72, 0x21, 0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6,
        0x81, 0x3a, 0x26, 0x4c, 0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65,
        0x8b, 0x1b, 0x53, 0x2e, 0xa3, 0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19,
        0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8, 0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9,
        0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d, 0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31,
        0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64, 0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb,
        0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb, 0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0,
        0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e, 0x2b, 0x16, 0xbe, 0x58, 0x7d,
        0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce, 0x45, 0xcb, 0x3a, 0x8f,
        0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
    };
    uint64_t v = 0;
    for (uint32_t i = 0; i < 8; i++)
        v |= (uint64_t)k[o + i] << (8 * i);
    return v;
}

ST_XHD uint64_t st_xxh3_rd64(const uint8_t *p)
{
    uint64_t v = 0;
    for (uint32_t i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

ST_XHD uint32_t st_xxh3_rd32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

ST_XHD uint64_t st_xxh3_rotl(uint64_t x, uint32_t r)
{
    return (x << r) | (x >> (64 - r));
}

ST_XHD uint64_t st_xxh3_swap64(uint64_t x)
{
    uint64_t r = 0;
    for (uint32_t i = 0; i < 8; i++)
        r |= ((x >> (8 * i)) & 0xffu) << (8 * (7 - i));
    return r;
}

/* The low and high halves of the 128-bit product, xor-ed. */
ST_XHD uint64_t st_xxh3_fold(uint64_t a, uint64_t b)
{
#ifdef __CUDA_ARCH__
    return (a * b) ^ __umul64hi(a, b);
#else
    uint64_t al = a & 0xffffffffu, ah = a >> 32, bl = b & 0xffffffffu, bh = b >> 32;
    uint64_t ll = al * bl, lh = al * bh, hl = ah * bl, hh = ah * bh;
    uint64_t cross = (ll >> 32) + (hl & 0xffffffffu) + lh;
    uint64_t hi = (hl >> 32) + (cross >> 32) + hh;
    uint64_t lo = (cross << 32) | (ll & 0xffffffffu);
    return hi ^ lo;
#endif
}

ST_XHD uint64_t st_xxh64_avalanche(uint64_t h)
{
    h ^= h >> 33;
    h *= ST_XXH_P64_2;
    h ^= h >> 29;
    h *= ST_XXH_P64_3;
    h ^= h >> 32;
    return h;
}

ST_XHD uint64_t st_xxh3_avalanche(uint64_t h)
{
    h ^= h >> 37;
    h *= 0x165667919E3779F9ull;
    h ^= h >> 32;
    return h;
}

ST_XHD uint64_t st_xxh3_mix16(const uint8_t *p, uint32_t so)
{
    return st_xxh3_fold(st_xxh3_rd64(p) ^ st_xxh3_sec(so), st_xxh3_rd64(p + 8) ^ st_xxh3_sec(so + 8));
}

/* Inputs of 0..240 bytes. */
ST_XHD uint64_t st_xxh3_short(const uint8_t *p, uint64_t n)
{
    if (n == 0)
        return st_xxh64_avalanche(st_xxh3_sec(56) ^ st_xxh3_sec(64));
    if (n <= 3) {
        uint32_t c = ((uint32_t)p[0] << 16) | ((uint32_t)p[n >> 1] << 24) | (uint32_t)p[n - 1] |
                     ((uint32_t)n << 8);
        uint64_t flip = (uint64_t)((uint32_t)st_xxh3_sec(0) ^ (uint32_t)st_xxh3_sec(4));
        return st_xxh64_avalanche((uint64_t)c ^ flip);
    }
    if (n <= 8) {
        uint64_t flip = st_xxh3_sec(8) ^ st_xxh3_sec(16);
        uint64_t in = (uint64_t)st_xxh3_rd32(p + n - 4) + ((uint64_t)st_xxh3_rd32(p) << 32);
        uint64_t h = in ^ flip;
        h ^= st_xxh3_rotl(h, 49) ^ st_xxh3_rotl(h, 24);
        h *= 0x9FB21C651E98DF25ull;
        h ^= (h >> 35) + n;
        h *= 0x9FB21C651E98DF25ull;
        return h ^ (h >> 28);
    }
    if (n <= 16) {
        uint64_t lo = st_xxh3_rd64(p) ^ (st_xxh3_sec(24) ^ st_xxh3_sec(32));
        uint64_t hi = st_xxh3_rd64(p + n - 8) ^ (st_xxh3_sec(40) ^ st_xxh3_sec(48));
        return st_xxh3_avalanche(n + st_xxh3_swap64(lo) + hi + st_xxh3_fold(lo, hi));
    }
    uint64_t acc = n * ST_XXH_P64_1;
    if (n <= 128) {
        if (n > 32) {
            if (n > 64) {
                if (n > 96) {
                    acc += st_xxh3_mix16(p + 48, 96);
                    acc += st_xxh3_mix16(p + n - 64, 112);
                }
                acc += st_xxh3_mix16(p + 32, 64);
                acc += st_xxh3_mix16(p + n - 48, 80);
            }
            acc += st_xxh3_mix16(p + 16, 32);
            acc += st_xxh3_mix16(p + n - 32, 48);
        }
        acc += st_xxh3_mix16(p, 0);
        acc += st_xxh3_mix16(p + n - 16, 16);
        return st_xxh3_avalanche(acc);
    }
    uint32_t rounds = (uint32_t)n / 16;
    for (uint32_t i = 0; i < 8; i++)
        acc += st_xxh3_mix16(p + 16 * i, 16 * i);
    acc = st_xxh3_avalanche(acc);
    for (uint32_t i = 8; i < rounds; i++)
        acc += st_xxh3_mix16(p + 16 * i, 16 * (i - 8) + 3);
    acc += st_xxh3_mix16(p + n - 16, 136 - 17);
    return st_xxh3_avalanche(acc);
}

/* The accumulators' start and one lane's steps (lane a of 8). */
ST_XHD uint64_t st_xxh3_acc_init(uint32_t a)
{
    switch (a) {
    case 0: return ST_XXH_P32_3;
    case 1: return ST_XXH_P64_1;
    case 2: return ST_XXH_P64_2;
    case 3: return ST_XXH_P64_3;
    case 4: return ST_XXH_P64_4;
    case 5: return ST_XXH_P32_2;
    case 6: return ST_XXH_P64_5;
    default: return ST_XXH_P32_1;
    }
}

/* The product term of data word d under secret word k. */
ST_XHD uint64_t st_xxh3_prod(uint64_t d, uint64_t k)
{
    uint64_t x = d ^ k;
    return (x & 0xffffffffu) * (x >> 32);
}

/* Lane a's scramble: key is st_xxh3_sec(128 + 8 a). */
ST_XHD uint64_t st_xxh3_scramble(uint64_t acc, uint64_t key)
{
    acc ^= acc >> 47;
    acc ^= key;
    return acc * ST_XXH_P32_1;
}

/* The final merge of the 8 accumulators of an input of n bytes. */
ST_XHD uint64_t st_xxh3_merge(const uint64_t *acc, uint64_t n)
{
    uint64_t r = n * ST_XXH_P64_1;
    for (uint32_t i = 0; i < 4; i++)
        r += st_xxh3_fold(acc[2 * i] ^ st_xxh3_sec(11 + 16 * i),
                          acc[2 * i + 1] ^ st_xxh3_sec(11 + 16 * i + 8));
    return st_xxh3_avalanche(r);
}

/* One stripe at p into acc, with the secret at byte so. */
ST_XHD void st_xxh3_stripe(uint64_t *acc, const uint8_t *p, uint32_t so)
{
    for (uint32_t a = 0; a < 8; a++) {
        uint64_t d = st_xxh3_rd64(p + 8 * a);
        acc[a ^ 1] += d;
        acc[a] += st_xxh3_prod(d, st_xxh3_sec(so + 8 * a));
    }
}

/* XXH3-64, seed 0, of n bytes at p. */
ST_XHD uint64_t st_xxh3_64(const uint8_t *p, uint64_t n)
{
    if (n <= 240)
        return st_xxh3_short(p, n);
    uint64_t acc[8];
    for (uint32_t a = 0; a < 8; a++)
        acc[a] = st_xxh3_acc_init(a);
    uint64_t nb = (n - 1) / ST_XXH_BLOCK;
    for (uint64_t b = 0; b < nb; b++) {
        for (uint32_t s = 0; s < 16; s++)
            st_xxh3_stripe(acc, p + b * ST_XXH_BLOCK + s * ST_XXH_STRIPE, 8 * s);
        for (uint32_t a = 0; a < 8; a++)
            acc[a] = st_xxh3_scramble(acc[a], st_xxh3_sec(ST_XXH_SECRET_SIZE - ST_XXH_STRIPE + 8 * a));
    }
    uint32_t ns = (uint32_t)(((n - 1) - nb * ST_XXH_BLOCK) / ST_XXH_STRIPE);
    for (uint32_t s = 0; s < ns; s++)
        st_xxh3_stripe(acc, p + nb * ST_XXH_BLOCK + s * ST_XXH_STRIPE, 8 * s);
    st_xxh3_stripe(acc, p + n - ST_XXH_STRIPE, ST_XXH_SECRET_SIZE - ST_XXH_STRIPE - 7);
    return st_xxh3_merge(acc, n);
}

#ifdef __CUDACC__
#define ST_XXH_WARP_GROUP 8u /* 1 KiB blocks whose words are in flight together */

/* ---- the warp form (device) ------------------------------------------------------------------
 * st_xxh3_warp<R>(r, n) is XXH3-64 of the n bytes r gives, computed by the 32 lanes of a warp
 * (all must call it with the same arguments; every lane returns the hash). R is a reader:
 *   uint64_t R::word(uint64_t o) const   the 8 bytes at offset o as a little-endian word, for o a
 *                                        multiple of 8 or o = n - 64 + 8j (the last stripe);
 *   uint8_t  R::byte(uint64_t o) const   the byte at offset o (inputs of <= 240 bytes);
 *   const uint64_t *R::span(uint64_t o, uint64_t len) const
 *                                        the len bytes at offset o (a multiple of 8) as 8-byte
 *                                        aligned words in one run of memory, or NULL where they
 *                                        are not (word() then reads each one).
 * Lane l holds accumulator l & 7 and adds stripes l >> 3, +4, +8, +12 of every 1 KiB block. */
template <class R> __device__ uint64_t st_xxh3_warp(const R &r, uint64_t n)
{
    const unsigned full = 0xffffffffu;
    unsigned l = threadIdx.x & 31u, a = l & 7u, q = l >> 3;
    if (n <= 240) {
        uint64_t h = 0;
        if (l == 0) {
            uint8_t buf[240];
            for (uint64_t i = 0; i < n; i++)
                buf[i] = r.byte(i);
            h = st_xxh3_short(buf, n);
        }
        return __shfl_sync(full, h, 0);
    }
    /* the secret words this lane uses: stripe s = q + 4j of a block reads word at 8 * (s + a) */
    uint64_t key[4];
    for (unsigned j = 0; j < 4; j++)
        key[j] = st_xxh3_sec(8 * (q + 4 * j + a));
    const uint64_t skey = st_xxh3_sec(ST_XXH_SECRET_SIZE - ST_XXH_STRIPE + 8 * a);
    const uint64_t lkey = st_xxh3_sec(ST_XXH_SECRET_SIZE - ST_XXH_STRIPE - 7 + 8 * a);
    uint64_t acc = st_xxh3_acc_init(a);
    uint64_t nb = (n - 1) / ST_XXH_BLOCK;
    /* word j of block b for this lane: offset b * 1024 + 256 j + 64 q + 8 a (stripe q + 4 j).
     * Blocks go in groups of ST_XXH_WARP_GROUP: the next group's words are loaded before this
     * group is summed, so the loads' latency (a page table lookup first, for paged state) is
     * paid once a group, not once a block. A group in one run of memory (R::span) is read
     * from its start without the reader's address arithmetic per word (paged state: one page
     * table lookup a group instead of one a word). */
    uint64_t lo = 64u * q + 8u * a;
    uint64_t cur[ST_XXH_WARP_GROUP * 4], nxt[ST_XXH_WARP_GROUP * 4];
    {
        uint64_t ng = nb < ST_XXH_WARP_GROUP ? nb : ST_XXH_WARP_GROUP;
        const uint64_t *sp = ng ? r.span(0, ng * ST_XXH_BLOCK) : 0;
#pragma unroll
        for (unsigned i = 0; i < ST_XXH_WARP_GROUP; i++)
#pragma unroll
            for (unsigned j = 0; j < 4; j++) {
                uint64_t o = i * ST_XXH_BLOCK + lo + 256u * j;
                cur[i * 4 + j] = i < nb ? (sp ? sp[o / 8] : r.word(o)) : 0;
            }
    }
    for (uint64_t g0 = 0; g0 < nb; g0 += ST_XXH_WARP_GROUP) {
        uint64_t n0 = g0 + ST_XXH_WARP_GROUP;
        uint64_t ng = n0 >= nb ? 0 : nb - n0 < ST_XXH_WARP_GROUP ? nb - n0 : ST_XXH_WARP_GROUP;
        const uint64_t *sp = ng ? r.span(n0 * ST_XXH_BLOCK, ng * ST_XXH_BLOCK) : 0;
#pragma unroll
        for (unsigned i = 0; i < ST_XXH_WARP_GROUP; i++) {
            uint64_t b = n0 + i;
#pragma unroll
            for (unsigned j = 0; j < 4; j++) {
                uint64_t o = (uint64_t)i * ST_XXH_BLOCK + lo + 256u * j;
                nxt[i * 4 + j] = b < nb ? (sp ? sp[o / 8] : r.word(n0 * ST_XXH_BLOCK + o)) : 0;
            }
        }
#pragma unroll
        for (unsigned i = 0; i < ST_XXH_WARP_GROUP; i++) {
            if (g0 + i < nb) { /* the same in every lane */
                uint64_t pr = 0, sm = 0;
#pragma unroll
                for (unsigned j = 0; j < 4; j++) {
                    pr += st_xxh3_prod(cur[i * 4 + j], key[j]);
                    sm += cur[i * 4 + j];
                }
                pr += __shfl_xor_sync(full, pr, 8);
                pr += __shfl_xor_sync(full, pr, 16);
                sm += __shfl_xor_sync(full, sm, 8);
                sm += __shfl_xor_sync(full, sm, 16);
                /* acc[a ^ 1] += data of lane a: this lane takes its partner's sum */
                acc += pr + __shfl_xor_sync(full, sm, 1);
                acc = st_xxh3_scramble(acc, skey);
            }
        }
#pragma unroll
        for (unsigned k = 0; k < ST_XXH_WARP_GROUP * 4; k++)
            cur[k] = nxt[k];
    }
    /* the last, partial block: stripes [0, ns) without a scramble, then the last stripe */
    unsigned ns = (unsigned)(((n - 1) - nb * ST_XXH_BLOCK) / ST_XXH_STRIPE);
    uint64_t pr = 0, sm = 0;
    for (unsigned j = 0; j < 4; j++)
        if (q + 4 * j < ns) {
            uint64_t w = r.word(nb * ST_XXH_BLOCK + lo + 256u * j);
            pr += st_xxh3_prod(w, key[j]);
            sm += w;
        }
    pr += __shfl_xor_sync(full, pr, 8);
    pr += __shfl_xor_sync(full, pr, 16);
    sm += __shfl_xor_sync(full, sm, 8);
    sm += __shfl_xor_sync(full, sm, 16);
    acc += pr + __shfl_xor_sync(full, sm, 1);
    uint64_t w = r.word(n - ST_XXH_STRIPE + 8u * a);
    uint64_t wp = __shfl_xor_sync(full, w, 1);
    acc += wp + st_xxh3_prod(w, lkey);
    uint64_t all[8];
    for (unsigned i = 0; i < 8; i++)
        all[i] = __shfl_sync(full, acc, i);
    return st_xxh3_merge(all, n);
}
#endif

#endif
