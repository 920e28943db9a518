/*
 * st_test_image.c - deterministic test images. Frozen: see st_test_image.h.
 */
#include "st_test_image.h"

#include <stdio.h>
#include <string.h>

uint64_t st_test_rand(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t st_test_f32_bits(uint64_t i, uint64_t *state)
{
    static const uint32_t specials[] = {
        0x7f800000u, /* +Inf */
        0xff800000u, /* -Inf */
        0x7fc00001u, /* quiet NaN with payload */
        0x80000000u, /* -0 */
        0x00000123u, /* subnormal */
        0x7f7fffffu, /* FLT_MAX */
        0x00800000u, /* FLT_MIN */
        0xffc12345u, /* negative NaN */
    };
    uint64_t r = st_test_rand(state);
    if (i % 37 == 11)
        return specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
    /* sign, exponent 2^-30..2^30, 23 random mantissa bits */
    return (uint32_t)((r >> 63) << 31) | (uint32_t)(127 - 30 + (r >> 32) % 61) << 23 |
           (uint32_t)(r & 0x7fffffu);
}

void st_test_fill_f32(float *dst, uint64_t n, uint64_t *state)
{
    for (uint64_t i = 0; i < n; i++) {
        uint32_t b = st_test_f32_bits(i, state);
        memcpy(&dst[i], &b, 4);
    }
}

void st_test_fill_bf16(uint16_t *dst, uint64_t n, uint64_t *state)
{
    for (uint64_t i = 0; i < n; i++)
        dst[i] = (uint16_t)(st_test_f32_bits(i, state) >> 16);
}

void st_test_fill_f16(uint16_t *dst, uint64_t n, uint64_t *state)
{
    static const uint16_t specials[] = {0x7c00, 0xfc00, 0x7e01, 0x8000, 0x0001, 0x7bff, 0x0400, 0xfe42};
    for (uint64_t i = 0; i < n; i++) {
        uint64_t r = st_test_rand(state);
        if (i % 37 == 11)
            dst[i] = specials[(r >> 8) % (sizeof specials / sizeof specials[0])];
        else
            dst[i] = (uint16_t)((r >> 63) << 15 | (1 + (r >> 32) % 30) << 10 | (r & 0x3ff));
    }
}

void st_test_fill_bytes(void *dst, uint64_t n, uint64_t *state)
{
    uint8_t *d = dst;
    for (uint64_t i = 0; i < n; i += 8) {
        uint64_t r = st_test_rand(state);
        for (uint64_t k = 0; k < 8 && i + k < n; k++)
            d[i + k] = (uint8_t)(r >> (8 * k));
    }
}

static void st_test_desc(st_tensor_desc *t, const char *name, uint32_t role, uint32_t dtype,
                         uint32_t ndim, uint64_t d0, uint64_t d1, uint64_t d2)
{
    memset(t, 0, sizeof *t);
    snprintf(t->name, sizeof t->name, "%s", name);
    t->role = role;
    t->dtype = dtype;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 0;
    t->shape[2] = ndim > 2 ? d2 : 0;
}

void st_test_geometry_small(st_geometry *g, st_tensor_desc t[ST_TEST_SMALL_TENSORS])
{
    uint64_t s = 0x5354524154410001ull;
    memset(g, 0, sizeof *g);
    st_test_fill_bytes(g->model_fp, ST_FINGERPRINT_LEN, &s);
    g->page_size = 4;
    g->n_ctx = 16;
    g->n_vocab = 8;
    g->n_tensors = ST_TEST_SMALL_TENSORS;
    st_test_desc(&t[0], "attn.0.kv", ST_ROLE_KV, ST_DTYPE_F16, 3, 16, 2, 4);
    st_test_desc(&t[1], "ssm.0.state", ST_ROLE_RUNNING, ST_DTYPE_F32, 3, 2, 4, 8);
    st_test_desc(&t[2], "ssm.0.conv", ST_ROLE_RUNNING, ST_DTYPE_F32, 2, 3, 8, 0);
    st_test_desc(&t[3], "attn.1.kq", ST_ROLE_KV, ST_DTYPE_I8, 2, 16, 8, 0);
    st_test_desc(&t[4], "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    st_test_desc(&t[5], "ssm.0.gate", ST_ROLE_RUNNING, ST_DTYPE_BF16, 1, 4, 0, 0);
    g->tensors = t;
}

/* Fill checkpoint ci's running tensors in the stored form of its codec. */
static void st_test_fill_ckpt(st_image *img, uint32_t ci, uint64_t *s)
{
    const st_geometry *g = st_image_geometry(img);
    uint64_t pos;
    uint32_t codec;
    st_image_checkpoint_info(img, ci, &pos, &codec);
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *t = &g->tensors[i];
        uint64_t len, n = st_tensor_elems(t);
        void *p;
        if (t->role != ST_ROLE_RUNNING)
            continue;
        p = st_image_checkpoint_tensor(img, ci, i, &len);
        if (t->dtype == ST_DTYPE_F32 && codec == ST_CODEC_FP32)
            st_test_fill_f32(p, n, s);
        else if ((t->dtype == ST_DTYPE_F32 && codec == ST_CODEC_BF16) || t->dtype == ST_DTYPE_BF16)
            st_test_fill_bf16(p, n, s);
        else if ((t->dtype == ST_DTYPE_F32 && codec == ST_CODEC_F16) || t->dtype == ST_DTYPE_F16)
            st_test_fill_f16(p, n, s);
        else if (t->dtype == ST_DTYPE_I64) {
            int64_t v = (int64_t)pos;
            memcpy(p, &v, 8 < len ? 8 : len);
        } else
            st_test_fill_bytes(p, len, s);
    }
}

int st_test_image_small(st_image **out, uint64_t seed, const uint32_t codecs[3])
{
    static const uint64_t positions[3] = {3, 7, 11};
    st_tensor_desc t[ST_TEST_SMALL_TENSORS];
    st_geometry g;
    st_image *img = NULL;
    uint32_t tokens[11];
    float logits[8];
    uint64_t s = seed;
    int rc;

    st_test_geometry_small(&g, t);
    rc = st_image_create(&img, &g);
    if (rc)
        return rc;
    for (int i = 0; i < 11; i++)
        tokens[i] = (uint32_t)(st_test_rand(&s) % 50000);
    rc = st_image_tokens_set(img, tokens, 11);
    for (uint32_t i = 0; i < g.n_tensors && !rc; i++) {
        uint64_t len;
        void *p = st_image_kv(img, i, &len);
        if (!p)
            continue;
        if (t[i].dtype == ST_DTYPE_F16)
            st_test_fill_f16(p, len / 2, &s);
        else
            st_test_fill_bytes(p, len, &s);
    }
    for (uint32_t c = 0; c < 3 && !rc; c++) {
        uint32_t ci;
        rc = st_image_checkpoint_add(img, positions[c], codecs[c], &ci);
        if (!rc)
            st_test_fill_ckpt(img, ci, &s);
    }
    if (!rc) {
        st_test_fill_f32(logits, 8, &s);
        rc = st_image_logits_set(img, logits, 8);
    }
    if (!rc)
        st_image_state_hash_set(img, st_test_rand(&s));
    if (rc) {
        st_image_free(img);
        return rc;
    }
    *out = img;
    return 0;
}

int st_test_image_minimal(st_image **out, uint64_t seed)
{
    st_tensor_desc t;
    st_geometry g;
    st_image *img = NULL;
    uint64_t s = seed;
    int rc;

    memset(&g, 0, sizeof g);
    st_test_fill_bytes(g.model_fp, ST_FINGERPRINT_LEN, &s);
    g.page_size = 1;
    g.n_ctx = 8;
    g.n_tensors = 1;
    st_test_desc(&t, "state", ST_ROLE_RUNNING, ST_DTYPE_F32, 1, 4, 0, 0);
    g.tensors = &t;
    rc = st_image_create(&img, &g);
    if (!rc)
        rc = st_image_checkpoint_add(img, 0, ST_CODEC_FP32, NULL);
    if (!rc)
        st_test_fill_ckpt(img, 0, &s);
    if (rc) {
        st_image_free(img);
        return rc;
    }
    *out = img;
    return 0;
}

static int st_test_diff(const char *what)
{
    fprintf(stderr, "images differ: %s\n", what);
    return -1;
}

int st_test_image_equal(const st_image *a, const st_image *b)
{
    const st_geometry *g = st_image_geometry(a);
    char what[128];
    uint32_t na, nb;

    if (st_geometry_compare(g, st_image_geometry(b)) != 0)
        return st_test_diff(st_errdetail());
    if (strcmp(g->arch, st_image_geometry(b)->arch) != 0)
        return st_test_diff("architecture name");
    if (st_image_n_tokens(a) != st_image_n_tokens(b))
        return st_test_diff("n_tokens");
    if (st_image_n_tokens(a) &&
        memcmp(st_image_tokens(a), st_image_tokens(b), st_image_n_tokens(a) * 4) != 0)
        return st_test_diff("tokens");
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        uint64_t la, lb;
        const void *pa = st_image_kv_const(a, i, &la), *pb = st_image_kv_const(b, i, &lb);
        if (!pa)
            continue;
        if (la != lb || memcmp(pa, pb, la) != 0) {
            snprintf(what, sizeof what, "K/V tensor %u", i);
            return st_test_diff(what);
        }
    }
    if (st_image_n_checkpoints(a) != st_image_n_checkpoints(b))
        return st_test_diff("number of checkpoints");
    for (uint32_t c = 0; c < st_image_n_checkpoints(a); c++) {
        uint64_t pa, pb;
        uint32_t ca, cb;
        st_image_checkpoint_info(a, c, &pa, &ca);
        st_image_checkpoint_info(b, c, &pb, &cb);
        if (pa != pb || ca != cb) {
            snprintf(what, sizeof what, "checkpoint %u position/codec", c);
            return st_test_diff(what);
        }
        for (uint32_t i = 0; i < g->n_tensors; i++) {
            uint64_t la, lb;
            const void *xa = st_image_checkpoint_tensor_const(a, c, i, &la);
            const void *xb = st_image_checkpoint_tensor_const(b, c, i, &lb);
            if (!xa)
                continue;
            if (!xb || la != lb || memcmp(xa, xb, la) != 0) {
                snprintf(what, sizeof what, "checkpoint %u tensor %u", c, i);
                return st_test_diff(what);
            }
        }
    }
    {
        const float *la = st_image_logits(a, &na), *lb = st_image_logits(b, &nb);
        if (na != nb || (na && memcmp(la, lb, (size_t)na * 4) != 0))
            return st_test_diff("logits");
    }
    if (st_image_state_hash(a) != st_image_state_hash(b))
        return st_test_diff("state hash");
    return 0;
}

int st_test_image_named(st_image **out, const st_image *src, const char *arch)
{
    st_geometry g = *st_image_geometry(src);
    st_image *img = NULL;
    uint64_t len, n = st_image_n_tokens(src);
    uint32_t nl = 0, ci;
    int rc;

    *out = NULL;
    snprintf(g.arch, sizeof g.arch, "%s", arch);
    if ((rc = st_image_create(&img, &g)) || (rc = st_image_tokens_set(img, st_image_tokens(src), n)))
        goto fail;
    for (uint32_t i = 0; i < g.n_tensors; i++) {
        const void *p = st_image_kv_const(src, i, &len);
        if (p)
            memcpy(st_image_kv(img, i, &len), p, len);
    }
    for (uint32_t c = 0; c < st_image_n_checkpoints(src); c++) {
        uint64_t pos;
        uint32_t codec;
        st_image_checkpoint_info(src, c, &pos, &codec);
        if ((rc = st_image_checkpoint_add(img, pos, codec, &ci)))
            goto fail;
        for (uint32_t i = 0; i < g.n_tensors; i++) {
            const void *p = st_image_checkpoint_tensor_const(src, c, i, &len);
            if (p)
                memcpy(st_image_checkpoint_tensor(img, ci, i, &len), p, len);
        }
    }
    const float *lg = st_image_logits(src, &nl);
    if (nl && (rc = st_image_logits_set(img, lg, nl)))
        goto fail;
    st_image_state_hash_set(img, st_image_state_hash(src));
    *out = img;
    return 0;
fail:
    st_image_free(img);
    return rc;
}
