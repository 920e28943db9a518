/*
 * test_codec_elem.c - element codecs: every ISA level this CPU has against the scalar reference
 * (all 2^16 encodings for decode, millions of inputs covering every special class for encode,
 * odd lengths and offsets), the scalar reference against an independent rounding model and
 * known answers, and st_codec_convert for all nine codec pairs.
 */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_codec.h"

#define N_RANDOM (1u << 22) /* 4 Mi encode inputs per run */

static uint64_t rng_state;

static uint64_t rng_next(void)
{
    /* splitmix64: fixed seed, so a failure reproduces */
    uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t f2u(float f)
{
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static float u2f(uint32_t u)
{
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Bit patterns at every boundary the codecs care about. */
static const uint32_t special_bits[] = {
    0x00000000, 0x7f800000,             /* 0, Inf */
    0x7fc00000, 0x7fc00001, 0x7fffffff, /* quiet NaNs with payloads */
    0x7f800001, 0x7fa00000, 0x7f802000, 0x7fbfffff, 0x7f801fff, /* signalling NaNs */
    0x00000001, 0x00000002, 0x007fffff, 0x00400000, /* fp32 subnormals */
    0x00800000, 0x7f7fffff,             /* smallest normal, largest finite */
    0x3f800000, 0x3f808000, 0x3f818000, 0x3f808001, 0x3f807fff, /* bf16 ties near 1 */
    0x7f7f0000, 0x7f7f7fff, 0x7f7f8000, 0x7f7f8001, 0x7f7effff, 0x7f7e8000, /* bf16 max */
    0x00008000, 0x00018000, 0x00008001, 0x00007fff, 0x007f8000, 0x007fffff, /* bf16 subnorm */
    0x477fe000, 0x477fefff, 0x477ff000, 0x477ff001, 0x477fd000, 0x47800000, /* f16 max */
    0x38800000, 0x387fc000, 0x387fe000, 0x387ff000, 0x387fefff, 0x387ff001, /* f16 min normal */
    0x33800000, 0x33000000, 0x33000001, 0x32ffffff, 0x33c00000, 0x34200000, /* f16 subnormal */
    0x3f801000, 0x3f803000, 0x3f801001, 0x3f800fff, /* f16 ties near 1 */
};
#define N_SPECIAL (sizeof special_bits / sizeof special_bits[0])

/* One input of a random class: the classes cover every special case the codecs treat apart. */
static uint32_t random_input(void)
{
    uint64_t r = rng_next();
    uint32_t sign = (uint32_t)(r >> 63) << 31;
    uint32_t mant = (uint32_t)(r >> 8) & 0x7fffffu;
    uint32_t pick = (uint32_t)(r >> 40);
    int delta = (int)(pick % 3) - 1; /* just below, at, just above a tie */
    switch (r & 7) {
    case 0: /* any bit pattern: NaNs with payloads, subnormals, everything */
        return (uint32_t)(r >> 16);
    case 1: /* exponents around the f16 range, including its subnormals */
        return sign | ((100u + pick % 50u) << 23) | mant;
    case 2: /* f16 ties among normals */
        return sign | ((113u + pick % 30u) << 23) | ((mant & ~0x1fffu) + 0x1000u + delta);
    case 3: /* bf16 ties anywhere, including the subnormal and overflow ends */
        return sign | ((((uint32_t)(r >> 16) & 0x7fff0000u) + 0x8000u + delta) & 0x7fffffffu);
    case 4: { /* f16 subnormal ties: exponents 102..112 round at bit 126 - e */
        uint32_t e = 102u + pick % 11u;
        uint32_t shift = 126u - e;
        uint32_t m = ((mant >> shift) << shift) | (1u << (shift - 1));
        return sign | (e << 23) | ((m + delta) & 0x7fffffu);
    }
    case 5: /* NaNs, quiet and signalling, with random payloads */
        return sign | 0x7f800000u | (mant ? mant : 1u);
    case 6: /* fp32 subnormals */
        return sign | (mant & (0x7fffffu >> (pick % 23u)));
    default:
        return sign | special_bits[pick % N_SPECIAL];
    }
}

static float *random_inputs(size_t n)
{
    float *f = malloc(n * sizeof *f);
    assert_non_null(f);
    rng_state = 42;
    for (size_t i = 0; i < N_SPECIAL && i < n; i++)
        f[i] = u2f(special_bits[i]);
    for (size_t i = N_SPECIAL; i < n; i++)
        f[i] = u2f(random_input());
    return f;
}

static void set_isa(st_codec_isa_level level)
{
    assert_int_equal(st_codec_isa_set(level), 0);
    assert_int_equal(st_codec_isa(), level);
}

typedef void (*encode_fn)(uint16_t *, const float *, size_t);
typedef void (*decode_fn)(float *, const uint16_t *, size_t);

/* Compare halves and report the first difference with its input. */
static void expect_same16(const uint16_t *got, const uint16_t *want, const float *in, size_t n,
                          const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (got[i] != want[i])
            fail_msg("%s: element %zu input 0x%08x: got 0x%04x, reference 0x%04x", what, i,
                     f2u(in[i]), got[i], want[i]);
    }
}

static void expect_same32(const float *got, const float *want, const uint16_t *in, size_t n,
                          const char *what)
{
    for (size_t i = 0; i < n; i++) {
        if (f2u(got[i]) != f2u(want[i]))
            fail_msg("%s: element %zu input 0x%04x: got 0x%08x, reference 0x%08x", what, i, in[i],
                     f2u(got[i]), f2u(want[i]));
    }
}

/* ---- every ISA level against the scalar reference --------------------------------------- */

static void check_decode_all(decode_fn dec, const char *name)
{
    uint16_t *in = malloc(65536 * sizeof *in);
    float *want = malloc(65536 * sizeof *want);
    float *got = malloc(65536 * sizeof *got);
    assert_true(in && want && got);
    for (uint32_t i = 0; i < 65536; i++)
        in[i] = (uint16_t)i;
    set_isa(ST_ISA_SCALAR);
    dec(want, in, 65536);
    for (int level = ST_ISA_AVX2; level <= (int)st_codec_isa_best(); level++) {
        char what[64];
        snprintf(what, sizeof what, "%s decode %s", name, st_codec_isa_name(level));
        set_isa(level);
        memset(got, 0xa5, 65536 * sizeof *got);
        dec(got, in, 65536);
        expect_same32(got, want, in, 65536, what);
    }
    free(in);
    free(want);
    free(got);
}

static void test_decode_all_encodings(void **state)
{
    check_decode_all(st_codec_bf16_decode, "bf16");
    check_decode_all(st_codec_f16_decode, "f16");
}

static void check_encode_random(encode_fn enc, const char *name)
{
    float *in = random_inputs(N_RANDOM);
    uint16_t *want = malloc(N_RANDOM * sizeof *want);
    uint16_t *got = malloc(N_RANDOM * sizeof *got);
    assert_true(want && got);
    set_isa(ST_ISA_SCALAR);
    enc(want, in, N_RANDOM);
    for (int level = ST_ISA_AVX2; level <= (int)st_codec_isa_best(); level++) {
        char what[64];
        snprintf(what, sizeof what, "%s encode %s", name, st_codec_isa_name(level));
        set_isa(level);
        memset(got, 0xa5, N_RANDOM * sizeof *got);
        enc(got, in, N_RANDOM);
        expect_same16(got, want, in, N_RANDOM, what);
    }
    free(in);
    free(want);
    free(got);
}

static void test_encode_random(void **state)
{
    check_encode_random(st_codec_bf16_encode, "bf16");
    check_encode_random(st_codec_f16_encode, "f16");
}

/* Lengths 0..80 at element offsets 0..3 of source and destination: every tail and every
 * alignment of the vector loops, with guard elements around dst that must stay untouched. */
static void test_tails_and_offsets(void **state)
{
    enum { MAXN = 80, PAD = 8 };
    float *in = random_inputs(MAXN + PAD);
    uint16_t h_in[MAXN + PAD];
    for (size_t i = 0; i < MAXN + PAD; i++)
        h_in[i] = (uint16_t)(f2u(in[i]) >> 7);
    for (int level = ST_ISA_SCALAR; level <= (int)st_codec_isa_best(); level++) {
        for (size_t n = 0; n <= MAXN; n++) {
            for (size_t so = 0; so < 4; so++) {
                for (size_t dof = 0; dof < 4; dof++) {
                    uint16_t want16[MAXN], got16[MAXN + 2 * PAD];
                    float want32[MAXN], got32[MAXN + 2 * PAD];
                    encode_fn encs[2] = {st_codec_bf16_encode, st_codec_f16_encode};
                    decode_fn decs[2] = {st_codec_bf16_decode, st_codec_f16_decode};
                    for (int c = 0; c < 2; c++) {
                        set_isa(ST_ISA_SCALAR);
                        encs[c](want16, in + so, n);
                        decs[c](want32, h_in + so, n);
                        set_isa(level);
                        memset(got16, 0xa5, sizeof got16);
                        memset(got32, 0xa5, sizeof got32);
                        encs[c](got16 + PAD + dof, in + so, n);
                        decs[c](got32 + PAD + dof, h_in + so, n);
                        expect_same16(got16 + PAD + dof, want16, in + so, n, "tail encode");
                        expect_same32(got32 + PAD + dof, want32, h_in + so, n, "tail decode");
                        for (size_t i = 0; i < MAXN + 2 * PAD; i++) {
                            if (i >= PAD + dof && i < PAD + dof + n)
                                continue;
                            if (got16[i] != 0xa5a5 || f2u(got32[i]) != 0xa5a5a5a5u)
                                fail_msg("%s n=%zu: wrote outside dst at %zu",
                                         st_codec_isa_name(level), n, i);
                        }
                    }
                }
            }
        }
    }
    free(in);
    set_isa(st_codec_isa_best());
}

/* st_codec_bf16_encode_stream at every ISA level against the scalar st_codec_bf16_encode and
 * st_codec_bf16_decode: random inputs, then every length 0..160 at every byte offset of dst in a
 * 64-byte line (odd ones too: no streaming there), src at byte offsets 0..4, wide on or off,
 * with guards around dst and wide that must stay untouched. */
static void test_encode_stream(void **state)
{
    enum { MAXN = 160, PAD = 96 }; /* 2 * MAXN + 2 * PAD and 4 * MAXN + 2 * PAD: multiples of 64 */
    float *in = random_inputs(N_RANDOM);
    uint16_t *want = malloc(N_RANDOM * sizeof *want), *got = malloc(N_RANDOM * sizeof *got);
    float *wwant = malloc(N_RANDOM * sizeof *wwant), *wgot = malloc(N_RANDOM * sizeof *wgot);
    unsigned char *db = aligned_alloc(64, 2 * MAXN + 2 * PAD);
    unsigned char *wb = aligned_alloc(64, 4 * MAXN + 2 * PAD);
    unsigned char *sb = malloc(4 * MAXN + 8);
    assert_true(want && got && wwant && wgot && db && wb && sb);
    set_isa(ST_ISA_SCALAR);
    st_codec_bf16_encode(want, in, N_RANDOM);
    st_codec_bf16_decode(wwant, want, N_RANDOM);
    for (int level = ST_ISA_SCALAR; level <= (int)st_codec_isa_best(); level++) {
        set_isa(level);
        memset(got, 0xa5, N_RANDOM * sizeof *got);
        memset(wgot, 0xa5, N_RANDOM * sizeof *wgot);
        st_codec_bf16_encode_stream(got, wgot, in, N_RANDOM);
        expect_same16(got, want, in, N_RANDOM, st_codec_isa_name(level));
        expect_same32(wgot, wwant, want, N_RANDOM, st_codec_isa_name(level));
        for (size_t n = 0; n <= MAXN; n++) {
            for (size_t dof = 0; dof < 66; dof++) {
                size_t so = dof % 5, wof = dof % 3 * 4 + (dof & 1);
                int with_wide = dof % 4 != 3;
                memcpy(sb + so, in + n, 4 * n);
                memset(db, 0xa5, 2 * MAXN + 2 * PAD);
                memset(wb, 0xa5, 4 * MAXN + 2 * PAD);
                st_codec_bf16_encode_stream((uint16_t *)(void *)(db + PAD + dof),
                                            with_wide ? (float *)(void *)(wb + PAD + wof) : NULL,
                                            (const float *)(const void *)(sb + so), n);
                for (size_t i = 0; i < n; i++) {
                    uint16_t h;
                    uint32_t u;
                    memcpy(&h, db + PAD + dof + 2 * i, 2);
                    memcpy(&u, wb + PAD + wof + 4 * i, 4);
                    if (h != want[n + i] || (with_wide && u != f2u(wwant[n + i])))
                        fail_msg("%s stream n=%zu dst+%zu element %zu input 0x%08x: got 0x%04x "
                                 "0x%08x, reference 0x%04x 0x%08x", st_codec_isa_name(level), n,
                                 dof, i, f2u(in[n + i]), h, u, want[n + i], f2u(wwant[n + i]));
                }
                for (size_t i = 0; i < 2 * MAXN + 2 * PAD; i++)
                    if ((i < PAD + dof || i >= PAD + dof + 2 * n) && db[i] != 0xa5)
                        fail_msg("%s stream n=%zu: wrote outside dst at %zu",
                                 st_codec_isa_name(level), n, i);
                for (size_t i = 0; i < 4 * MAXN + 2 * PAD; i++)
                    if ((!with_wide || i < PAD + wof || i >= PAD + wof + 4 * n) && wb[i] != 0xa5)
                        fail_msg("%s stream n=%zu: wrote outside wide at %zu",
                                 st_codec_isa_name(level), n, i);
            }
        }
    }
    free(in);
    free(want);
    free(got);
    free(wwant);
    free(wgot);
    free(db);
    free(wb);
    free(sb);
    set_isa(st_codec_isa_best());
}

/* ---- the scalar reference against an independent model ------------------------------------ */

/* Round |x| to a binary format of p significant bits, minimum exponent emin, largest finite
 * max, with ties to even, in double arithmetic (exact for float inputs): the textbook
 * definition, sharing nothing with the integer code under test. */
static double model_round(double x, int p, int emin, double max)
{
    if (x == 0.0)
        return 0.0;
    int e;
    frexp(x, &e); /* x = f * 2^e, f in [0.5, 1): leading bit has exponent e - 1 */
    int q = (e - 1 > emin ? e - 1 : emin) - (p - 1);
    double y = ldexp(nearbyint(ldexp(x, -q)), q); /* nearbyint: ties to even by default */
    return y > max ? INFINITY : y;
}

static void check_against_model(encode_fn enc, decode_fn dec, int p, int emin, double max,
                                 const char *name)
{
    enum { N = 1u << 20 };
    float *in = random_inputs(N);
    uint16_t *h = malloc(N * sizeof *h);
    float *back = malloc(N * sizeof *back);
    assert_true(h && back);
    set_isa(ST_ISA_SCALAR);
    enc(h, in, N);
    dec(back, h, N);
    for (size_t i = 0; i < N; i++) {
        float x = in[i];
        if (isnan(x)) {
            if (!isnan(back[i]) || !signbit(back[i]) != !signbit(x))
                fail_msg("%s: NaN 0x%08x became 0x%08x", name, f2u(x), f2u(back[i]));
            continue;
        }
        double want = copysign(model_round(fabs((double)x), p, emin, max), (double)x);
        if ((double)back[i] != want || !signbit(back[i]) != !signbit(x))
            fail_msg("%s: 0x%08x (%a) encoded 0x%04x = %a, model says %a", name, f2u(x),
                     (double)x, h[i], (double)back[i], want);
    }
    free(in);
    free(h);
    free(back);
    set_isa(st_codec_isa_best());
}

static void test_scalar_against_model(void **state)
{
    check_against_model(st_codec_bf16_encode, st_codec_bf16_decode, 8, -126,
                        ldexp(255.0, 127 - 7), "bf16");
    check_against_model(st_codec_f16_encode, st_codec_f16_decode, 11, -14, 65504.0, "f16");
}

/* ---- known answers -------------------------------------------------------------------------- */

struct kat_enc {
    uint32_t in;
    uint16_t out;
};

struct kat_dec {
    uint16_t in;
    uint32_t out;
};

static const struct kat_enc bf16_enc_kat[] = {
    {0x3f800000, 0x3f80}, /* 1.0 */
    {0x3f808000, 0x3f80}, /* tie, kept lsb even: down */
    {0x3f818000, 0x3f82}, /* tie, kept lsb odd: up */
    {0x3f808001, 0x3f81}, {0x3f807fff, 0x3f80},
    {0x7f7f7fff, 0x7f7f}, /* just below max + half ulp: max */
    {0x7f7f8000, 0x7f80}, /* max + half ulp (3.39617753e38): a tie, rounds to even Inf */
    {0xff7f8000, 0xff80}, {0x7f800000, 0x7f80}, {0xff800000, 0xff80},
    {0x7f800001, 0x7fc0}, /* signalling NaN quieted */
    {0x7fc00000, 0x7fc0}, {0xffa12345, 0xffe1}, {0x7fffffff, 0x7fff},
    {0x00008000, 0x0000}, /* subnormal tie to even zero */
    {0x00018000, 0x0002}, {0x00008001, 0x0001}, {0x80000001, 0x8000}, /* -0 */
    {0x007fffff, 0x0080}, /* largest fp32 subnormal rounds up to the smallest normal */
    {0x00000000, 0x0000}, {0x80000000, 0x8000},
};

static const struct kat_enc f16_enc_kat[] = {
    {0x3f800000, 0x3c00}, /* 1.0 */
    {0x3f801000, 0x3c00}, /* 1 + 2^-11: tie to even, down */
    {0x3f803000, 0x3c02}, /* 1 + 3 * 2^-11: tie to even, up */
    {0x3f801001, 0x3c01},
    {0x477fe000, 0x7bff}, /* 65504 */
    {0x477fefff, 0x7bff}, /* just below 65520 */
    {0x477ff000, 0x7c00}, /* 65520: Inf */
    {0xc77ff000, 0xfc00}, {0x501502f9, 0x7c00}, /* 1e10 */
    {0x7f800000, 0x7c00}, {0xff800000, 0xfc00},
    {0x7f800001, 0x7e00}, /* signalling NaN quieted, payload truncated */
    {0xffc00000, 0xfe00}, {0x7f802000, 0x7e01}, {0x7fffffff, 0x7fff},
    {0x38800000, 0x0400}, /* 2^-14, smallest normal */
    {0x387fc000, 0x03ff}, /* largest subnormal */
    {0x387ff000, 0x0400}, /* 1023.5 * 2^-24: tie to even, up to the smallest normal */
    {0x33800000, 0x0001}, /* 2^-24, smallest subnormal */
    {0x33000000, 0x0000}, /* 2^-25: tie to even zero */
    {0xb3000000, 0x8000}, {0x33000001, 0x0001}, {0x32ffffff, 0x0000},
    {0x33c00000, 0x0002}, /* 1.5 * 2^-24: tie, up to even 2 */
    {0x34200000, 0x0002}, /* 2.5 * 2^-24: tie, down to even 2 */
    {0x00000001, 0x0000}, {0x80000001, 0x8000}, /* fp32 subnormals vanish */
};

static const struct kat_dec f16_dec_kat[] = {
    {0x3c00, 0x3f800000}, {0x7bff, 0x477fe000}, {0x0001, 0x33800000}, {0x8001, 0xb3800000},
    {0x03ff, 0x387fc000}, {0x0400, 0x38800000}, {0x7c00, 0x7f800000}, {0xfc00, 0xff800000},
    {0x7c01, 0x7fc02000}, /* signalling NaN quieted, as vcvtph2ps does */
    {0x7e00, 0x7fc00000}, {0xfd00, 0xffe00000}, {0x8000, 0x80000000},
};

static const struct kat_dec bf16_dec_kat[] = {
    {0x3f80, 0x3f800000}, {0x7f81, 0x7f810000}, /* signalling NaN stays: an exact shift */
    {0x0001, 0x00010000}, {0xff80, 0xff800000}, {0x8000, 0x80000000},
};

static void test_known_answers(void **state)
{
    for (int level = ST_ISA_SCALAR; level <= (int)st_codec_isa_best(); level++) {
        set_isa(level);
        for (size_t i = 0; i < sizeof bf16_enc_kat / sizeof bf16_enc_kat[0]; i++) {
            float x = u2f(bf16_enc_kat[i].in);
            uint16_t h;
            st_codec_bf16_encode(&h, &x, 1);
            if (h != bf16_enc_kat[i].out)
                fail_msg("%s bf16 encode 0x%08x: got 0x%04x want 0x%04x",
                         st_codec_isa_name(level), bf16_enc_kat[i].in, h, bf16_enc_kat[i].out);
        }
        for (size_t i = 0; i < sizeof f16_enc_kat / sizeof f16_enc_kat[0]; i++) {
            float x = u2f(f16_enc_kat[i].in);
            uint16_t h;
            st_codec_f16_encode(&h, &x, 1);
            if (h != f16_enc_kat[i].out)
                fail_msg("%s f16 encode 0x%08x: got 0x%04x want 0x%04x", st_codec_isa_name(level),
                         f16_enc_kat[i].in, h, f16_enc_kat[i].out);
        }
        for (size_t i = 0; i < sizeof f16_dec_kat / sizeof f16_dec_kat[0]; i++) {
            float x;
            st_codec_f16_decode(&x, &f16_dec_kat[i].in, 1);
            if (f2u(x) != f16_dec_kat[i].out)
                fail_msg("%s f16 decode 0x%04x: got 0x%08x want 0x%08x", st_codec_isa_name(level),
                         f16_dec_kat[i].in, f2u(x), f16_dec_kat[i].out);
        }
        for (size_t i = 0; i < sizeof bf16_dec_kat / sizeof bf16_dec_kat[0]; i++) {
            float x;
            st_codec_bf16_decode(&x, &bf16_dec_kat[i].in, 1);
            if (f2u(x) != bf16_dec_kat[i].out)
                fail_msg("%s bf16 decode 0x%04x: got 0x%08x want 0x%08x",
                         st_codec_isa_name(level), bf16_dec_kat[i].in, f2u(x),
                         bf16_dec_kat[i].out);
        }
    }
    set_isa(st_codec_isa_best());
}

static void test_isa_levels(void **state)
{
    st_codec_isa_level best = st_codec_isa_best();
    for (int level = ST_ISA_SCALAR; level <= (int)best; level++)
        set_isa(level);
    if (best < ST_ISA_AVX512)
        assert_int_equal(st_codec_isa_set(ST_ISA_AVX512), ST_EINVAL);
    assert_int_equal(st_codec_isa_set((st_codec_isa_level)7), ST_EINVAL);
    assert_int_equal(st_codec_isa(), best); /* a refused level changes nothing */
    assert_string_equal(st_codec_isa_name(ST_ISA_SCALAR), "scalar");
    assert_string_equal(st_codec_isa_name(ST_ISA_AVX2), "avx2");
    assert_string_equal(st_codec_isa_name(ST_ISA_AVX512), "avx512");
}

/* ---- conversion ----------------------------------------------------------------------------- */

/* The expected content of an array of n elements of codec id made from fp32 input. */
static void *make_in(uint32_t id, const float *f, size_t n)
{
    void *p = malloc(n * 4 + 1);
    assert_non_null(p);
    if (id == ST_CODEC_FP32)
        memcpy(p, f, n * 4);
    else if (id == ST_CODEC_BF16)
        st_codec_bf16_encode(p, f, n);
    else
        st_codec_f16_encode(p, f, n);
    return p;
}

static void expect_convert(uint32_t dst_id, uint32_t src_id, const float *f, size_t n,
                           void *scratch, size_t scratch_cap, size_t byte_off)
{
    size_t es = st_codec_elem_size(dst_id);
    void *src = make_in(src_id, f, n);
    unsigned char *srcbuf = malloc(n * 4 + 8), *dstbuf = malloc(n * 4 + 8);
    float *wide = malloc(n * 4);
    void *want = NULL;
    assert_true(srcbuf && dstbuf && wide);
    memcpy(srcbuf + byte_off, src, n * st_codec_elem_size(src_id));

    /* Reference: widen to a whole fp32 array, then narrow. */
    if (src_id == ST_CODEC_FP32)
        memcpy(wide, src, n * 4);
    else if (src_id == ST_CODEC_BF16)
        st_codec_bf16_decode(wide, src, n);
    else
        st_codec_f16_decode(wide, src, n);
    if (src_id == dst_id) {
        want = malloc(n * es);
        assert_non_null(want);
        memcpy(want, src, n * es);
    } else {
        want = make_in(dst_id, wide, n);
    }

    assert_int_equal(st_codec_convert(dst_id, dstbuf + byte_off, src_id, srcbuf + byte_off, n,
                                      scratch, scratch_cap),
                     0);
    if (memcmp(dstbuf + byte_off, want, n * es) != 0)
        fail_msg("convert %s -> %s (n=%zu, offset %zu) differs from the fp32 route",
                 st_codec_name(src_id), st_codec_name(dst_id), n, byte_off);
    free(src);
    free(srcbuf);
    free(dstbuf);
    free(wide);
    free(want);
}

static void test_convert_pairs(void **state)
{
    /* Several slices of the minimum scratch (16 Ki fp32) plus an odd tail. */
    const size_t n = 5 * (ST_CODEC_SCRATCH_MIN / 4) + 77;
    float *f = random_inputs(n);
    void *scratch = malloc(ST_CODEC_SCRATCH_MIN);
    assert_non_null(scratch);
    for (uint32_t s = 0; s < ST_CODEC_COUNT; s++) {
        for (uint32_t d = 0; d < ST_CODEC_COUNT; d++) {
            expect_convert(d, s, f, n, scratch, ST_CODEC_SCRATCH_MIN, 0);
            expect_convert(d, s, f, 1001, scratch, ST_CODEC_SCRATCH_MIN, 1); /* odd address */
        }
    }
    /* A large scratch is used in bounded slices, with the same result. */
    void *big = malloc(ST_CODEC_SCRATCH_MAX);
    assert_non_null(big);
    expect_convert(ST_CODEC_F16, ST_CODEC_BF16, f, n, big, ST_CODEC_SCRATCH_MAX, 0);
    expect_convert(ST_CODEC_BF16, ST_CODEC_F16, f, n, big, ST_CODEC_SCRATCH_MAX, 0);
    free(big);
    free(scratch);
    free(f);
}

static void test_convert_errors(void **state)
{
    unsigned char small[ST_CODEC_SCRATCH_MIN - 1];
    uint16_t a[4] = {0x3f80, 0x4000, 0x0001, 0x7f81}, b[4];
    float fl[4];
    assert_int_equal(st_codec_convert(ST_CODEC_F16, b, ST_CODEC_BF16, a, 4, small, sizeof small),
                     ST_EINVAL);
    assert_true(strstr(st_errdetail(), "scratch") != NULL);
    assert_int_equal(st_codec_convert(ST_CODEC_BF16, b, ST_CODEC_F16, a, 4, NULL, 1 << 20),
                     ST_EINVAL);
    assert_int_equal(st_codec_convert(ST_CODEC_F16, b, ST_CODEC_BF16, a, 0, small, sizeof small),
                     ST_EINVAL);
    assert_int_equal(st_codec_convert(3, b, ST_CODEC_BF16, a, 4, NULL, 0), ST_ECODEC);
    assert_int_equal(st_codec_convert(ST_CODEC_BF16, b, 99, a, 4, NULL, 0), ST_ECODEC);
    assert_true(strstr(st_errdetail(), "99") != NULL);
    assert_int_equal(st_codec_convert(ST_CODEC_FP32, NULL, ST_CODEC_BF16, a, 4, NULL, 0),
                     ST_EINVAL);
    /* Pairs that need no scratch work without one. */
    assert_int_equal(st_codec_convert(ST_CODEC_FP32, fl, ST_CODEC_BF16, a, 4, NULL, 0), 0);
    assert_int_equal(f2u(fl[0]), 0x3f800000u);
    assert_int_equal(f2u(fl[3]), 0x7f810000u);
    assert_int_equal(st_codec_convert(ST_CODEC_BF16, b, ST_CODEC_BF16, a, 4, NULL, 0), 0);
    assert_memory_equal(a, b, sizeof a);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_isa_levels),
        cmocka_unit_test(test_known_answers),
        cmocka_unit_test(test_decode_all_encodings),
        cmocka_unit_test(test_encode_random),
        cmocka_unit_test(test_tails_and_offsets),
        cmocka_unit_test(test_encode_stream),
        cmocka_unit_test(test_scalar_against_model),
        cmocka_unit_test(test_convert_pairs),
        cmocka_unit_test(test_convert_errors),
    };
    printf("codec ISA levels on this CPU: scalar..%s\n", st_codec_isa_name(st_codec_isa_best()));
    return cmocka_run_group_tests(tests, NULL, NULL);
}
