/*
 * st_migrate.c - session-file conversions (v1 <-> v2, re-coding checkpoints) and image diffs.
 *
 * Invariants:
 * 1. A conversion never writes its input: the output goes through st_file_write, which replaces
 *    the target atomically, so in == out is safe and a failure leaves both files as they were.
 * 2. Codec work runs in slices through one scratch of ST_CODEC_SCRATCH_MAX bytes at most.
 * 3. Only f32 running tensors carry a codec; K/V, integer tensors, tokens and logits are copied
 *    unchanged by every step here.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_file.h"
#include "st_migrate.h"

struct recode_bridge {
    const st_convert_opts *opts;
};

static void recode_progress(void *arg, uint32_t done, uint32_t total)
{
    const struct recode_bridge *b = arg;
    b->opts->progress(b->opts->progress_arg, "recode", done, total);
}

/* Re-code every checkpoint, keeping the state hash true (st_image_recode, st_image.h). */
static int recode_all(st_image *img, uint32_t codec, const st_convert_opts *opts)
{
    struct recode_bridge b = {opts};
    int prog = opts && opts->progress;
    return st_image_recode(img, codec, NULL, NULL, prog ? recode_progress : NULL, prog ? &b : NULL);
}

int st_migrate_image_recode(st_image *img, uint32_t codec)
{
    if (!img)
        return st_error_set(ST_EINVAL, "recode: no image");
    return recode_all(img, codec, NULL);
}

int st_migrate_image_v1_ok(const st_image *img)
{
    uint32_t n = st_image_n_checkpoints(img);
    for (uint32_t ci = 0; ci < n; ci++) {
        uint64_t pos;
        uint32_t codec;
        int rc = st_image_checkpoint_info(img, ci, &pos, &codec);
        if (rc)
            return rc;
        if (codec != ST_CODEC_FP32)
            return st_error_set(ST_ELOSSY,
                                "checkpoint %u at position %llu is %s; format v1 holds only fp32 "
                                "(widen with --codec fp32)",
                                ci, (unsigned long long)pos, st_codec_name(codec));
    }
    return 0;
}

int st_migrate_image_to_v1(st_image *img)
{
    if (!img)
        return st_error_set(ST_EINVAL, "to v1: no image");
    return recode_all(img, ST_CODEC_FP32, NULL);
}

struct progress_bridge {
    const st_convert_opts *opts;
};

static void write_progress(void *arg, uint64_t done, uint64_t total)
{
    const struct progress_bridge *b = arg;
    b->opts->progress(b->opts->progress_arg, "write", done, total);
}

static void read_progress(void *arg, uint64_t done, uint64_t total)
{
    const struct progress_bridge *b = arg;
    b->opts->progress(b->opts->progress_arg, "read", done, total);
}

int st_migrate_file_convert(const char *in_path, const char *out_path, const st_convert_opts *opts)
{
    st_convert_opts def = {.codec = -1};
    if (!opts)
        opts = &def;
    if (!in_path || !out_path)
        return st_error_set(ST_EINVAL, "convert: missing input or output path");
    if (opts->version > ST_FILE_VERSION_MAX)
        return st_error_set(ST_EVERSION, "convert: format v%u is not one this build writes (1, 2)",
                            opts->version);
    if (opts->version == ST_FILE_VERSION_1 && opts->compress)
        return st_error_set(ST_ELOSSY, "convert: format v1 cannot carry compression");
    if (opts->codec >= 0) {
        int rc = st_codec_check((uint32_t)opts->codec);
        if (rc)
            return rc;
    }

    struct progress_bridge bridge = {.opts = opts};
    st_file_read_opts ro = {0};
    if (opts->progress) {
        ro.progress = read_progress;
        ro.progress_arg = &bridge;
    }
    st_image *img = NULL;
    int rc = st_file_read(in_path, &ro, &img);
    if (rc)
        goto done;
    if (opts->codec >= 0) {
        rc = recode_all(img, (uint32_t)opts->codec, opts);
        if (rc)
            goto done;
    }
    if (opts->version == ST_FILE_VERSION_1) {
        rc = st_migrate_image_v1_ok(img);
        if (rc)
            goto done;
    }
    st_file_write_opts wo = {.version = opts->version, .compress = opts->compress, .shuffle = 1};
    if (opts->progress) {
        wo.progress = write_progress;
        wo.progress_arg = &bridge;
    }
    rc = st_file_write(img, out_path, &wo);
done:
    st_image_free(img);
    return rc;
}

/* ---- diff ----------------------------------------------------------------------------------- */

static int diff_push(st_diff *d, uint32_t *cap, st_diff_entry **out)
{
    if (d->n_entries == *cap) {
        uint32_t ncap = *cap ? *cap * 2 : 16;
        st_diff_entry *e = realloc(d->entries, (size_t)ncap * sizeof *e);
        if (!e) {
            st_error_set(ENOMEM, "diff: no memory for %u entries", ncap);
            return ENOMEM;
        }
        d->entries = e;
        *cap = ncap;
    }
    *out = &d->entries[d->n_entries++];
    memset(*out, 0, sizeof **out);
    return 0;
}

static void raw_compare(st_diff_entry *e, const void *a, uint64_t alen, const void *b, uint64_t blen)
{
    const uint8_t *pa = a, *pb = b;
    uint64_t n = alen < blen ? alen : blen;
    e->n = alen > blen ? alen : blen;
    e->bytes_differ = e->n - n;
    for (uint64_t i = 0; i < n; i++)
        e->bytes_differ += pa[i] != pb[i];
}

/* Widen n elements of codec c starting at element off into dst (fp32). */
static void widen(float *dst, uint32_t codec, const void *src, uint64_t off, size_t n)
{
    if (codec == ST_CODEC_FP32)
        memcpy(dst, (const float *)src + off, n * sizeof(float));
    else if (codec == ST_CODEC_BF16)
        st_codec_bf16_decode(dst, (const uint16_t *)src + off, n);
    else
        st_codec_f16_decode(dst, (const uint16_t *)src + off, n);
}

static void float_compare(st_diff_entry *e, const void *a, uint32_t ca, const void *b, uint32_t cb,
                          uint64_t n, float *sa, float *sb, size_t slice)
{
    e->float_compare = 1;
    e->n = n;
    for (uint64_t off = 0; off < n; off += slice) {
        size_t m = (size_t)(n - off < slice ? n - off : slice);
        widen(sa, ca, a, off, m);
        widen(sb, cb, b, off, m);
        st_codec_errstat_add(&e->stat, sa, sb, m);
    }
}

static int entry_identical(const st_diff_entry *e)
{
    return e->float_compare ? e->stat.differ == 0 : e->bytes_differ == 0;
}

int st_migrate_diff(const st_image *a, const st_image *b, st_diff *out)
{
    memset(out, 0, sizeof *out);
    const st_geometry *ga = st_image_geometry(a), *gb = st_image_geometry(b);
    int rc = st_geometry_compare(ga, gb);
    if (rc)
        return rc;

    const size_t slice = 64 * 1024;
    float *sa = malloc(slice * sizeof(float)), *sb = malloc(slice * sizeof(float));
    uint32_t cap = 0;
    st_diff_entry *e;
    if (!sa || !sb) {
        rc = st_error_set(ENOMEM, "diff: no memory for the comparison slices");
        goto fail;
    }
    out->identical = 1;

    /* Tokens: compare the common prefix and report a length difference. */
    if ((rc = diff_push(out, &cap, &e)))
        goto fail;
    snprintf(e->what, sizeof e->what, "tokens");
    uint64_t na = st_image_n_tokens(a), nb = st_image_n_tokens(b);
    raw_compare(e, st_image_tokens(a), na * 4, st_image_tokens(b), nb * 4);
    if (na != nb)
        snprintf(out->note, sizeof out->note, "token counts differ: %llu vs %llu",
                 (unsigned long long)na, (unsigned long long)nb);

    for (uint32_t ti = 0; ti < ga->n_tensors; ti++) {
        const st_tensor_desc *t = &ga->tensors[ti];
        if (t->role != ST_ROLE_KV)
            continue;
        uint64_t la, lb;
        const void *pa = st_image_kv_const(a, ti, &la), *pb = st_image_kv_const(b, ti, &lb);
        if ((rc = diff_push(out, &cap, &e)))
            goto fail;
        snprintf(e->what, sizeof e->what, "kv %s", t->name);
        if (t->dtype == ST_DTYPE_F32 || t->dtype == ST_DTYPE_F16 || t->dtype == ST_DTYPE_BF16) {
            uint32_t c = t->dtype == ST_DTYPE_F32 ? ST_CODEC_FP32
                         : t->dtype == ST_DTYPE_F16 ? ST_CODEC_F16 : ST_CODEC_BF16;
            uint64_t rows = na < nb ? na : nb;
            uint64_t elems = rows * (st_tensor_row_bytes(t) / st_dtype_size(t->dtype));
            float_compare(e, pa, c, pb, c, elems, sa, sb, slice);
            if (la != lb)
                e->stat.differ += 1;
        } else {
            raw_compare(e, pa, la, pb, lb);
        }
    }

    /* Checkpoints matched by position. */
    uint32_t ca_n = st_image_n_checkpoints(a), cb_n = st_image_n_checkpoints(b);
    uint32_t i = 0, j = 0;
    while (i < ca_n || j < cb_n) {
        uint64_t pa_pos = UINT64_MAX, pb_pos = UINT64_MAX;
        uint32_t codec_a = 0, codec_b = 0;
        if (i < ca_n)
            st_image_checkpoint_info(a, i, &pa_pos, &codec_a);
        if (j < cb_n)
            st_image_checkpoint_info(b, j, &pb_pos, &codec_b);
        if (pa_pos != pb_pos) {
            int only_a = pa_pos < pb_pos;
            size_t used = strlen(out->note);
            snprintf(out->note + used, sizeof out->note - used, "%scheckpoint at %llu only in %s",
                     used ? "; " : "", (unsigned long long)(only_a ? pa_pos : pb_pos),
                     only_a ? "A" : "B");
            out->identical = 0;
            if (only_a)
                i++;
            else
                j++;
            continue;
        }
        for (uint32_t ti = 0; ti < ga->n_tensors; ti++) {
            const st_tensor_desc *t = &ga->tensors[ti];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            uint64_t la, lb;
            const void *ta = st_image_checkpoint_tensor_const(a, i, ti, &la);
            const void *tb = st_image_checkpoint_tensor_const(b, j, ti, &lb);
            if ((rc = diff_push(out, &cap, &e)))
                goto fail;
            snprintf(e->what, sizeof e->what, "ckpt @%llu %s", (unsigned long long)pa_pos, t->name);
            if (t->dtype == ST_DTYPE_F32)
                float_compare(e, ta, codec_a, tb, codec_b, st_tensor_elems(t), sa, sb, slice);
            else
                raw_compare(e, ta, la, tb, lb);
        }
        i++;
        j++;
    }

    /* The engine's state hash travels with the state: files that carry different ones differ. */
    if (st_image_state_hash(a) != st_image_state_hash(b)) {
        size_t used = strlen(out->note);
        snprintf(out->note + used, sizeof out->note - used, "%sstate hash %016llx vs %016llx",
                 used ? "; " : "", (unsigned long long)st_image_state_hash(a),
                 (unsigned long long)st_image_state_hash(b));
        out->identical = 0;
    }

    uint32_t nla, nlb;
    const float *la = st_image_logits(a, &nla), *lb = st_image_logits(b, &nlb);
    if (nla || nlb) {
        if ((rc = diff_push(out, &cap, &e)))
            goto fail;
        snprintf(e->what, sizeof e->what, "logits");
        if (nla == nlb) {
            float_compare(e, la, ST_CODEC_FP32, lb, ST_CODEC_FP32, nla, sa, sb, slice);
        } else {
            raw_compare(e, la, (uint64_t)nla * 4, lb, (uint64_t)nlb * 4);
        }
    }
    for (uint32_t k = 0; k < out->n_entries; k++)
        if (!entry_identical(&out->entries[k]))
            out->identical = 0;
    free(sa);
    free(sb);
    return 0;
fail:
    free(sa);
    free(sb);
    st_diff_free(out);
    return rc;
}

void st_diff_free(st_diff *d)
{
    if (!d)
        return;
    free(d->entries);
    d->entries = NULL;
    d->n_entries = 0;
}
