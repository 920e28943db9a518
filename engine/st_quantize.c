/*
 * st_quantize.c - re-quantize a GGUF file (`strata quantize`, `strata-mkmodel --wtype`).
 *
 * What is quantized follows llama.cpp v0.4.0's llama-quantize run with one type for every
 * tensor (its --pure mode; src/llama-quant.cpp, tensor_allows_quantization and
 * tensor_type_fallback), so that a file written here holds the tensors and types llama-quantize
 * would write, and the bytes: each row is dequantized through the weight-type table
 * (st_wtype.h, contract 1) and quantized by the table's quantizer (contract 3: ggml's bytes).
 *
 * Invariants:
 * 1. A tensor is converted iff llama-quantize would convert it and its type differs from the
 *    target; every other tensor's bytes are copied unchanged (the F32 set of
 *    ARCHITECTURES.md section 2.4 among them).
 * 2. Keys are copied in their order with their serialized bytes; general.file_type and
 *    general.quantization_version take llama-quantize's values; split.* keys are dropped (a split
 *    model, opened from its first part, is written as one file).
 * 3. The output appears only complete (the writer's temp file and rename); on any error
 *    nothing is left at `out`.
 * 4. One tensor's output and one row of f32 are in memory at a time (besides the mapped input).
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "st_engine.h"
#include "st_wtype.h"

/* The types a file can be quantized to, with llama.cpp's file type (llama_ftype) of a file
 * whose tensors are mostly of that type (the loader's guess, src/llama-model-loader.cpp). */
static const struct {
    const char *name;
    uint32_t type;
    uint32_t ftype;
} k_targets[] = {
    {"F32", ST_GGML_F32, 0},        {"F16", ST_GGML_F16, 1},       {"BF16", ST_GGML_BF16, 32},
    {"Q8_0", ST_GGML_Q8_0, 7},      {"Q4_0", ST_GGML_Q4_0, 2},     {"Q4_1", ST_GGML_Q4_1, 3},
    {"Q5_0", ST_GGML_Q5_0, 8},      {"Q5_1", ST_GGML_Q5_1, 9},     {"Q2_K", ST_GGML_Q2_K, 10},
    {"Q3_K", ST_GGML_Q3_K, 12},     {"Q4_K", ST_GGML_Q4_K, 15},    {"Q5_K", ST_GGML_Q5_K, 17},
    {"Q6_K", ST_GGML_Q6_K, 18},     {"IQ4_NL", ST_GGML_IQ4_NL, 25}, {"IQ4_XS", ST_GGML_IQ4_XS, 30},
};
#define N_TARGETS (sizeof k_targets / sizeof k_targets[0])
#define GGML_QNT_VERSION 2

const char *st_quantize_type_list(void)
{
    return "F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, IQ4_NL, "
           "IQ4_XS";
}

int st_quantize_type_parse(const char *name, uint32_t *type)
{
    for (size_t i = 0; name && i < N_TARGETS; i++)
        if (!strcasecmp(name, k_targets[i].name)) {
            *type = k_targets[i].type;
            return 0;
        }
    return st_error_set(ST_EINVAL, "unknown weight type \"%s\" (%s)", name ? name : "",
                        st_quantize_type_list());
}

static uint32_t ftype_of(uint32_t type)
{
    for (size_t i = 0; i < N_TARGETS; i++)
        if (k_targets[i].type == type)
            return k_targets[i].ftype;
    return 0;
}

static int is_quantized(uint32_t type)
{
    return type != ST_GGML_F32 && type != ST_GGML_F16 && type != ST_GGML_BF16;
}

/* ggml_n_dims: trailing dimensions of 1 do not count. */
static uint32_t ggml_n_dims(const st_gguf_tensor *t)
{
    for (uint32_t d = ST_GGUF_MAX_DIMS; d > 1; d--)
        if (t->dims[d - 1] > 1)
            return d;
    return 1;
}

static int has(const char *name, const char *part)
{
    return strstr(name, part) != NULL;
}

/* tensor_allows_quantization of llama.cpp v0.4.0 (the architecture-named position and token
 * type embeddings are the names every architecture gives them). */
static int allows_quantization(const st_gguf_tensor *t)
{
    static const char *const k_never[] = {
        "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
        "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
        "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight",
        "time_mix_w1.weight", "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight",
        "time_mix_v2.weight", "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight",
        "time_mix_g1.weight", "time_mix_g2.weight", "time_mix_decay_w1.weight",
        "time_mix_decay_w2.weight", "time_mix_lerp_fused.weight", "attn_rel_b.weight",
        ".position_embd", "sam.pos_embd", "sam.neck.", "sam.net_", ".rel_pos", ".patch_embd",
        ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
    };
    const char *name = t->name;
    size_t n = strlen(name);
    if (ggml_n_dims(t) < 2)
        return 0;
    if (n < 6 || strcmp(name + n - 6, "weight"))
        return 0;
    for (size_t i = 0; i < sizeof k_never / sizeof k_never[0]; i++)
        if (has(name, k_never[i]))
            return 0;
    if (!strcmp(name, "position_embd.weight") || !strcmp(name, "token_types.weight"))
        return 0;
    return 1;
}

/* tensor_type_fallback: a row length the target's block does not divide. */
static uint32_t fallback(uint32_t type, uint64_t ne0)
{
    const st_wtype *w = st_wtype_get(type);
    if (ne0 % w->block == 0)
        return type;
    uint32_t r = type;
    switch (type) {
    case ST_GGML_IQ4_XS: r = ST_GGML_IQ4_NL; break;
    case ST_GGML_Q2_K: case ST_GGML_Q3_K: r = ST_GGML_Q4_0; break;
    case ST_GGML_Q4_K: r = ST_GGML_Q5_0; break;
    case ST_GGML_Q5_K: r = ST_GGML_Q5_1; break;
    case ST_GGML_Q6_K: r = ST_GGML_Q8_0; break;
    default: break; /* a 32-block type: F16 below */
    }
    if (ne0 % st_wtype_get(r)->block)
        r = ST_GGML_F16;
    return r;
}

typedef struct qjob {
    const st_gguf_tensor *src;
    uint32_t type; /* target */
    int convert;
} qjob;

typedef struct qctx {
    const qjob *jobs;
    uint64_t n;
    const st_quantize_opts *opts;
    int vec;
    uint64_t done_bytes, total_bytes;
} qctx;

static void qlog(const st_quantize_opts *o, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void qlog(const st_quantize_opts *o, const char *fmt, ...)
{
    if (!o || !o->log)
        return;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    o->log(o->log_ctx, line);
}

static int fill_tensor(void *vctx, uint64_t index, void *dst, uint64_t nbytes)
{
    qctx *c = vctx;
    const qjob *j = &c->jobs[index];
    const st_gguf_tensor *t = j->src;
    if (!j->convert) {
        memcpy(dst, t->data, (size_t)nbytes);
    } else {
        const st_wtype *in = st_wtype_get(t->type), *out = st_wtype_get(j->type);
        uint64_t ne0 = t->dims[0], rows = t->dims[1] * t->dims[2] * t->dims[3];
        uint64_t in_row, out_row;
        if (st_wtype_row_bytes(in, ne0, &in_row) || st_wtype_row_bytes(out, ne0, &out_row) ||
            out_row * rows != nbytes)
            return st_error_set(ST_EINVAL, "quantize: tensor %s: row of %llu values does not fit "
                                "%s", t->name, (unsigned long long)ne0, out->name);
        float *row = malloc((size_t)ne0 * sizeof *row);
        if (!row)
            return st_error_set(ENOMEM, "quantize: tensor %s: a row of %llu values", t->name,
                                (unsigned long long)ne0);
        for (uint64_t r = 0; r < rows; r++) {
            in->dequant[c->vec]((const uint8_t *)t->data + r * in_row, row, ne0);
            for (uint64_t k = 0; k < ne0; k++)
                if (!isfinite(row[k])) {
                    int rc = st_error_set(ST_EINVAL, "quantize: tensor %s: row %llu holds a "
                                          "non-finite value (%g at column %llu); it cannot be "
                                          "quantized", t->name, (unsigned long long)r,
                                          (double)row[k], (unsigned long long)k);
                    free(row);
                    return rc;
                }
            out->quantize(row, (uint8_t *)dst + r * out_row, ne0);
            if (j->type == ST_GGML_F16) {
                const uint16_t *h = (const uint16_t *)((uint8_t *)dst + r * out_row);
                for (uint64_t k = 0; k < ne0; k++)
                    if ((h[k] & 0x7c00) == 0x7c00) {
                        int rc = st_error_set(ST_EINVAL, "quantize: tensor %s: row %llu: %g at "
                                              "column %llu is beyond the range of f16", t->name,
                                              (unsigned long long)r, (double)row[k],
                                              (unsigned long long)k);
                        free(row);
                        return rc;
                    }
            }
        }
        free(row);
    }
    c->done_bytes += t->nbytes;
    if (c->opts && c->opts->progress)
        qlog(c->opts, "[%4llu/%4llu] %-40s %-6s -> %-6s %9.2f MiB -> %9.2f MiB (%3.0f%%)",
             (unsigned long long)index + 1, (unsigned long long)c->n, t->name,
             st_gguf_type_name(t->type), st_gguf_type_name(j->convert ? j->type : t->type),
             (double)t->nbytes / 1048576.0, (double)nbytes / 1048576.0,
             c->total_bytes ? 100.0 * (double)c->done_bytes / (double)c->total_bytes : 100.0);
    return 0;
}

/* The directory `out` goes into must exist (the writer's temp file goes there). */
static int check_out_dir(const char *out)
{
    char *dir = strdup(out);
    if (!dir)
        return st_error_set(ENOMEM, "quantize: path");
    char *slash = strrchr(dir, '/');
    const char *d = ".";
    if (slash) {
        *slash = '\0';
        d = *dir ? dir : "/";
    }
    struct stat sb;
    int rc = 0;
    if (stat(d, &sb) != 0)
        rc = st_error_set(errno == ENOENT ? ST_ENOTFOUND : errno, "output directory %s: %s", d,
                          errno == ENOENT ? "does not exist" : strerror(errno));
    else if (!S_ISDIR(sb.st_mode))
        rc = st_error_set(ST_EINVAL, "output directory %s is not a directory", d);
    free(dir);
    return rc;
}

int st_gguf_quantize(const char *in, const char *out, uint32_t type,
                     const st_quantize_opts *opts, st_quantize_stats *stats)
{
    st_gguf *g = NULL;
    st_gguf_writer *w = NULL;
    qjob *jobs = NULL;
    st_quantize_stats st = {0};
    int rc;
    if (stats)
        memset(stats, 0, sizeof *stats);
    if (!ftype_of(type) && type != ST_GGML_F32)
        return st_error_set(ST_EINVAL, "quantize: weight type %s (%s)", st_gguf_type_name(type),
                            st_quantize_type_list());
    if ((rc = check_out_dir(out)))
        return rc;
    if ((rc = st_gguf_open(in, &g)))
        return rc;
    uint64_t n = st_gguf_n_tensors(g);
    jobs = calloc(n ? n : 1, sizeof *jobs);
    if (!jobs) {
        rc = st_error_set(ENOMEM, "quantize: %llu tensors", (unsigned long long)n);
        goto done;
    }
    qctx c = {jobs, n, opts, st_wtype_has_avx2() ? 1 : 0, 0, 0};
    for (uint64_t i = 0; i < n; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        qjob *j = &jobs[i];
        j->src = t;
        j->type = t->type;
        c.total_bytes += t->nbytes;
        if (!allows_quantization(t))
            continue;
        uint32_t nt = is_quantized(type) ? fallback(type, t->dims[0]) : type;
        if (nt != type) {
            st.n_fallback++;
            qlog(opts, "%s: row of %llu values is not a multiple of the %s block (%u): %s "
                 "instead, as llama.cpp falls back", t->name, (unsigned long long)t->dims[0],
                 st_gguf_type_name(type), st_wtype_get(type)->block, st_gguf_type_name(nt));
        }
        if (nt == t->type)
            continue;
        if (!st_wtype_get(t->type)) {
            rc = st_error_set(ST_EINVAL, "%s: tensor %s is %s, which cannot be dequantized here "
                              "(%s can)", in, t->name, st_gguf_type_name(t->type),
                              st_quantize_type_list());
            goto done;
        }
        j->type = nt;
        j->convert = 1;
    }
    if ((rc = st_gguf_writer_new(&w, st_gguf_alignment(g))))
        goto done;
    int have_ft = 0, have_qv = 0;
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (!strcmp(k, "general.alignment") || !strncmp(k, "split.", 6))
            continue;
        if (!strcmp(k, "general.file_type")) {
            rc = st_gguf_writer_set_u32(w, k, ftype_of(type));
            have_ft = 1;
        } else if (!strcmp(k, "general.quantization_version")) {
            rc = st_gguf_writer_set_u32(w, k, GGML_QNT_VERSION);
            have_qv = 1;
        } else {
            rc = st_gguf_writer_copy_kv(w, g, i);
        }
        if (rc)
            goto done;
    }
    if ((!have_qv && (rc = st_gguf_writer_set_u32(w, "general.quantization_version",
                                                 GGML_QNT_VERSION))) ||
        (!have_ft && (rc = st_gguf_writer_set_u32(w, "general.file_type", ftype_of(type)))))
        goto done;
    for (uint64_t i = 0; i < n; i++) {
        const st_gguf_tensor *t = jobs[i].src;
        if ((rc = st_gguf_writer_add_tensor_fill(w, t->name, jobs[i].type, t->n_dims, t->dims,
                                                 fill_tensor, &c, i)))
            goto done;
        st.n_tensors++;
        st.n_quantized += jobs[i].convert;
        st.n_copied += !jobs[i].convert;
        st.bytes_in += t->nbytes;
        if (jobs[i].convert) {
            uint64_t rb = 0;
            st_wtype_row_bytes(st_wtype_get(jobs[i].type), t->dims[0], &rb);
            st.bytes_out += rb * t->dims[1] * t->dims[2] * t->dims[3];
        } else {
            st.bytes_out += t->nbytes;
        }
    }
    rc = st_gguf_writer_write(w, out);
done:
    if (!rc && stats)
        *stats = st;
    st_gguf_writer_free(w);
    free(jobs);
    st_gguf_close(g);
    return rc;
}
