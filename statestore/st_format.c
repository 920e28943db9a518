/*
 * st_format.c - the session file's structures encoded and checked once (st_format_int.h): the
 * geometry (a file's GEOMETRY section, the store's geometry record) and the rules of a file's
 * walk that the reader and inspect share. Pure functions over buffers.
 *
 * Invariants:
 * 1. A decoder checks every count and length against the bytes present, with overflow-safe
 *    arithmetic, before it allocates or reads; reserved fields and padding must be zero.
 * 2. An encoder writes every byte (no uninitialised padding), so equal inputs give equal bytes,
 *    and what it writes its decoder accepts.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_format_int.h"
#include "st_store_int.h" /* st_mul_sat, ST_BYTES_MAX */

const uint8_t st_fmt_magic[8] = {'S', 'T', 'R', 'A', 'T', 'A', 's', 'f'};

/* ---- the geometry ----------------------------------------------------------------------------- */

void st_fmt_geometry_fixed_put(uint8_t dst[ST_GEOM_FIXED], const st_geometry *g)
{
    memcpy(dst, g->model_fp, ST_FINGERPRINT_LEN);
    st_put32(dst + 32, g->page_size);
    st_put32(dst + 36, g->n_ctx);
    st_put32(dst + 40, g->n_vocab);
    st_put32(dst + 44, g->n_tensors);
}

void st_fmt_tensor_put(uint8_t dst[ST_GEOM_REC], const st_tensor_desc *t)
{
    memset(dst, 0, ST_GEOM_REC);
    memcpy(dst, t->name, strnlen(t->name, ST_TENSOR_NAME_MAX)); /* NUL-padded */
    st_put32(dst + 48, t->role);
    st_put32(dst + 52, t->dtype);
    st_put32(dst + 56, t->ndim);
    for (int d = 0; d < ST_TENSOR_NDIM_MAX; d++)
        st_put64(dst + 64 + 8 * d, t->shape[d]);
}

int st_fmt_geometry_decode(const uint8_t *p, uint64_t len, st_geometry *g, st_tensor_desc **tensors)
{
    st_tensor_desc *t = NULL;
    int rc;

    *tensors = NULL;
    memset(g, 0, sizeof *g);
    if (len < ST_GEOM_FIXED)
        return st_error_set(ST_ECORRUPT, "length %llu is shorter than the %u-byte geometry header",
                            (unsigned long long)len, ST_GEOM_FIXED);
    memcpy(g->model_fp, p, ST_FINGERPRINT_LEN);
    g->page_size = st_get32(p + 32);
    g->n_ctx = st_get32(p + 36);
    g->n_vocab = st_get32(p + 40);
    g->n_tensors = st_get32(p + 44);
    if (g->n_tensors > ST_GEOMETRY_TENSORS_MAX)
        return st_error_set(ST_ECORRUPT, "%u tensors exceed the limit of %u", g->n_tensors,
                            ST_GEOMETRY_TENSORS_MAX);
    if (len != st_fmt_geometry_len(g->n_tensors))
        return st_error_set(ST_ECORRUPT, "length %llu, but %u tensors need %llu",
                            (unsigned long long)len, g->n_tensors,
                            (unsigned long long)st_fmt_geometry_len(g->n_tensors));
    t = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *t);
    if (!t)
        return st_error_set(ENOMEM, "geometry: no memory for %u tensors", g->n_tensors);
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const uint8_t *r = p + ST_GEOM_FIXED + (size_t)ST_GEOM_REC * i;
        size_t nl = strnlen((const char *)r, ST_TENSOR_NAME_MAX);
        memcpy(t[i].name, r, ST_TENSOR_NAME_MAX);
        if (nl < ST_TENSOR_NAME_MAX)
            for (size_t k = nl; k < ST_TENSOR_NAME_MAX; k++)
                if (r[k] != 0) {
                    rc = st_error_set(ST_ECORRUPT, "tensor %u: name padding byte %zu is not zero", i, k);
                    goto fail;
                }
        t[i].role = st_get32(r + 48);
        t[i].dtype = st_get32(r + 52);
        t[i].ndim = st_get32(r + 56);
        if (st_get32(r + 60) != 0) {
            rc = st_error_set(ST_ECORRUPT, "tensor %u: reserved field is %u, must be 0", i,
                              st_get32(r + 60));
            goto fail;
        }
        for (int d = 0; d < ST_TENSOR_NDIM_MAX; d++)
            t[i].shape[d] = st_get64(r + 64 + 8 * d);
    }
    g->tensors = t;
    rc = st_geometry_check(g); /* an unterminated name fails here */
    if (rc) {
        char d[400];
        snprintf(d, sizeof d, "%s", st_errdetail());
        rc = st_error_set(ST_ECORRUPT, "%s", d);
        goto fail;
    }
    *tensors = t;
    return 0;
fail:
    free(t);
    g->tensors = NULL;
    return rc;
}

int st_geometry_encode(const st_geometry *g, uint8_t **out, size_t *out_len)
{
    *out = NULL;
    int rc = st_geometry_check(g);
    if (rc)
        return rc;
    size_t len = ST_GEOM_HDR + (size_t)g->n_tensors * ST_GEOM_TENSOR;
    uint8_t *b = calloc(1, len);
    if (!b)
        return st_error_set(ENOMEM, "geometry record: no memory for %zu bytes", len);
    st_put32(b, ST_GEOM_MAGIC);
    st_put32(b + 4, ST_GEOM_FORMAT);
    st_fmt_geometry_fixed_put(b + 8, g);
    for (uint32_t i = 0; i < g->n_tensors; i++)
        st_fmt_tensor_put(b + ST_GEOM_HDR + (size_t)i * ST_GEOM_TENSOR, &g->tensors[i]);
    *out = b;
    *out_len = len;
    return 0;
}

int st_geometry_decode(const void *buf, size_t len, st_geometry *g, st_tensor_desc **tensors)
{
    const uint8_t *b = buf;
    *tensors = NULL;
    memset(g, 0, sizeof *g);
    if (len < ST_GEOM_HDR || st_get32(b) != ST_GEOM_MAGIC)
        return st_error_set(ST_ECORRUPT, "geometry record: bad magic or %zu bytes is too short", len);
    if (st_get32(b + 4) != ST_GEOM_FORMAT)
        return st_error_set(ST_EVERSION, "geometry record format %u; this build reads %u",
                            st_get32(b + 4), ST_GEOM_FORMAT);
    int rc = st_fmt_geometry_decode(b + 8, len - 8, g, tensors);
    if (rc) {
        char d[400];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_error_set(rc, "geometry record: %s", d);
    }
    return 0;
}

/* ---- the walk over a file's sections ---------------------------------------------------------- */

void st_fmt_expect(const st_fmt_walk *w, uint32_t s, uint32_t found, uint32_t *type, uint32_t *index)
{
    const st_geometry *g = w->g;
    *index = 0;
    if (s == 0) {
        *type = ST_SECTION_GEOMETRY;
        return;
    }
    if (s == 1 && found == ST_SECTION_ARCH) {
        *type = ST_SECTION_ARCH;
        return;
    }
    if (s == 1 + w->n_arch) {
        *type = ST_SECTION_TOKENS;
        return;
    }
    if (!g) {
        *type = found; /* no geometry: the order cannot be checked past here */
        *index = UINT32_MAX;
        return;
    }
    if (s - 2 - w->n_arch < w->n_kv) { /* s > 1 + n_arch here */
        uint32_t k = s - 2 - w->n_arch;
        for (uint32_t i = 0; i < g->n_tensors; i++)
            if (g->tensors[i].role == ST_ROLE_KV && k-- == 0) {
                *type = ST_SECTION_KV;
                *index = i;
                return;
            }
    }
    if (found == ST_SECTION_LOGITS && s == w->n_sections - 1 && w->ci > 0 && g->n_vocab > 0) {
        *type = ST_SECTION_LOGITS;
        return;
    }
    *type = ST_SECTION_CHECKPOINT;
    *index = w->ci;
}

uint32_t st_fmt_min_sections(const st_geometry *g, uint32_t n_arch)
{
    uint32_t n_kv = 0;
    for (uint32_t i = 0; i < g->n_tensors; i++)
        n_kv += g->tensors[i].role == ST_ROLE_KV;
    return 3 + n_arch + n_kv;
}

uint64_t st_fmt_tokens_len(uint64_t n_tokens)
{
    return st_mul_sat(n_tokens, 4);
}

uint64_t st_fmt_kv_len(const st_geometry *g, uint32_t i, uint64_t n_tokens)
{
    return st_mul_sat(n_tokens, st_tensor_row_bytes(&g->tensors[i]));
}

uint64_t st_fmt_logits_len(const st_geometry *g)
{
    return (uint64_t)g->n_vocab * 4;
}

uint64_t st_fmt_ckpt_stored_total(const st_geometry *g, uint32_t codec)
{
    uint64_t total = 0;
    for (uint32_t i = 0; i < g->n_tensors; i++)
        if (g->tensors[i].role == ST_ROLE_RUNNING)
            total += st_tensor_stored_bytes(&g->tensors[i], codec); /* bounded by ST_BYTES_MAX */
    return total;
}

int st_fmt_ckpt_parse(const uint8_t b[ST_CKPT_HDR], uint32_t version, uint64_t n_tokens, uint32_t ci,
                      uint64_t prev_pos, st_fmt_ckpt *out)
{
    out->position = st_get64(b);
    out->codec = version == ST_FILE_VERSION_1 ? ST_CODEC_FP32 : st_get32(b + 8);
    out->cflags = version == ST_FILE_VERSION_1 ? 0 : st_get32(b + 12);
    if (version == ST_FILE_VERSION_1) {
        if (st_get64(b + 8) != 0)
            return st_error_set(ST_ECORRUPT, "reserved field is %llu, must be 0",
                                (unsigned long long)st_get64(b + 8));
    } else {
        if (out->cflags & ~(ST_CFLAG_ZSTD | ST_CFLAG_SHUFFLE))
            return st_error_set(ST_ECORRUPT, "flags 0x%x: reserved bits set", out->cflags);
        if ((out->cflags & ST_CFLAG_SHUFFLE) && !(out->cflags & ST_CFLAG_ZSTD))
            return st_error_set(ST_ECORRUPT, "flags 0x%x: shuffle without compression", out->cflags);
        if (st_codec_check(out->codec) != 0)
            return st_error_set(ST_ECODEC, "unknown codec %u", out->codec);
    }
    if (out->position > n_tokens)
        return st_error_set(ST_ECORRUPT, "position %llu exceeds the %llu tokens",
                            (unsigned long long)out->position, (unsigned long long)n_tokens);
    if (ci > 0 && out->position <= prev_pos)
        return st_error_set(ST_ECORRUPT, "position %llu is not after checkpoint %u's %llu",
                            (unsigned long long)out->position, ci - 1, (unsigned long long)prev_pos);
    return 0;
}
