/*
 * st_model.c - models of any architecture (st_arch_int.h): the table of architectures, loading
 * from GGUF by walking the architecture's tensor list (every tensor's name, type and shape
 * checked), the memory spec, the model fingerprint, and the seeded model writer behind
 * strata-mkmodel. Nothing here knows an architecture's tensors or keys.
 *
 * Invariants:
 * 1. An architecture's tensor list is the one description of which tensors a model has, in
 *    which order and shape; the writer, the loader and the fingerprint all walk it.
 * 2. A loaded model's matrices point into the GGUF mapping (F32, F16 or BF16); its vectors are
 *    owned f32 copies, and what the architecture's prepare derives from them is owned too.
 *    Nothing is written after st_model_load returns.
 * 3. The fingerprint is SHA-256 over the architecture's tag and hyperparameters (its
 *    fingerprint function) followed by, for each listed tensor in list order, its name, ggml
 *    type, dimensions and data bytes.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


#include "st_arch_int.h"
#include "st_wtype.h"

static const st_arch *const k_archs[] = {&st_arch_hybrid, &st_arch_llama,    &st_arch_qwen3,
                                         &st_arch_qwen35, &st_arch_qwen35moe, &st_arch_qwen3next};
#define ARCH_NAMES ST_ARCH ", llama, qwen3, qwen35, qwen35moe, qwen3next"

/* The architecture hp names (hp->arch; empty: strata-hybrid, as before architectures had names;
 * one not in the table falls back to strata-hybrid, whose check then refuses what it cannot be). */
static const st_arch *hp_arch(const st_model_hparams *hp)
{
    size_t n = strnlen(hp->arch, sizeof hp->arch);
    const st_arch *a = n && n < sizeof hp->arch ? st_arch_find(hp->arch, n) : NULL;
    return a ? a : &st_arch_hybrid;
}

const st_arch *st_arch_find(const char *name, size_t len)
{
    for (size_t i = 0; i < sizeof k_archs / sizeof k_archs[0]; i++)
        if (strlen(k_archs[i]->name) == len && !memcmp(k_archs[i]->name, name, len))
            return k_archs[i];
    return NULL;
}

int st_model_preset(const char *name, st_model_hparams *hp)
{
    return st_arch_hybrid.preset(name, hp);
}

int st_model_preset_arch(const char *arch, const char *name, st_model_hparams *hp)
{
    const st_arch *a = arch ? st_arch_find(arch, strlen(arch)) : &st_arch_hybrid;
    if (!a)
        return st_error_set(ST_EINVAL, "architecture \"%s\" is not supported (" ARCH_NAMES ")",
                            arch);
    int rc = a->preset(name, hp);
    if (!rc && a != &st_arch_hybrid)
        snprintf(hp->arch, sizeof hp->arch, "%s", a->name);
    return rc;
}

char st_model_layer_kind(const st_model_hparams *hp, uint32_t il)
{
    size_t n = strnlen(hp->pattern, ST_PATTERN_MAX);
    return n ? hp->pattern[il % n] : 'D';
}

int st_model_hparams_check(const st_model_hparams *hp)
{
    return hp_arch(hp)->check(hp);
}

/* The memory spec of a geometry: each layer's, and the slots of each kind. */
static int mem_spec_build(const st_arch *a, const st_model_hparams *hp, st_mem_spec *ms)
{
    memset(ms, 0, sizeof *ms);
    ms->layer = calloc(hp->n_layer ? hp->n_layer : 1, sizeof *ms->layer);
    if (!ms->layer)
        return st_error_set(ENOMEM, "model: memory spec");
    ms->n_layer = hp->n_layer;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        st_mem_layer *ml = &ms->layer[il];
        a->memory(hp, il, ml);
        if (ml->kind == ST_MEM_KV)
            ml->slot = ms->n_kv++;
        else if (ml->kind == ST_MEM_REC)
            ml->slot = ms->n_rec++;
    }
    return 0;
}

uint64_t st_model_state_bytes(const st_model_hparams *hp)
{
    uint64_t b = 8; /* position */
    st_mem_layer ml;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        hp_arch(hp)->memory(hp, il, &ml);
        if (ml.kind == ST_MEM_REC)
            b += st_mem_ssm_bytes(&ml) + st_mem_conv_bytes(&ml);
    }
    return b;
}

uint64_t st_model_kv_bytes_per_token(const st_model_hparams *hp, uint32_t kv_dtype)
{
    uint64_t b = 0;
    st_mem_layer ml;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        hp_arch(hp)->memory(hp, il, &ml);
        if (ml.kind == ST_MEM_KV)
            b += 2 * (st_mem_kv_row_bytes(&ml, kv_dtype) + st_mem_kv_scale_bytes(&ml, kv_dtype));
    }
    return b;
}

/* ---- the tensor list ------------------------------------------------------------------- */
static st_tdesc *tlist_next(st_tlist *l)
{
    if (l->err)
        return NULL;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        st_tdesc *n = realloc(l->t, cap * sizeof *n);
        if (!n) {
            l->err = ENOMEM;
            return NULL;
        }
        l->t = n;
        l->cap = cap;
    }
    st_tdesc *d = &l->t[l->n++];
    memset(d, 0, sizeof *d);
    return d;
}

void st_tlist_add(st_tlist *l, int32_t layer, uint32_t field, int matrix, int init, uint64_t ne0,
                  uint64_t ne1, const char *fmt, ...)
{
    st_tdesc *d = tlist_next(l);
    if (!d)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->name, sizeof d->name, fmt, ap);
    va_end(ap);
    d->nd = ne1 ? 2 : 1;
    d->dims[0] = ne0;
    d->dims[1] = ne1;
    d->matrix = matrix;
    d->init = init;
    d->layer = layer;
    d->field = field;
}

void st_tlist_add3(st_tlist *l, int32_t layer, uint32_t field, int init, uint64_t ne0,
                   uint64_t ne1, uint64_t ne2, const char *fmt, ...)
{
    st_tdesc *d = tlist_next(l);
    if (!d)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->name, sizeof d->name, fmt, ap);
    va_end(ap);
    d->nd = 3;
    d->dims[0] = ne0;
    d->dims[1] = ne1;
    d->dims[2] = ne2;
    d->matrix = 1;
    d->init = init;
    d->layer = layer;
    d->field = field;
}

/* Elements of an entry. */
static uint64_t tdesc_n(const st_tdesc *d)
{
    uint64_t n = 1;
    for (uint32_t i = 0; i < d->nd; i++)
        n *= d->dims[i];
    return n;
}

int st_tlist_done(st_tlist *l)
{
    if (!l->err)
        return 0;
    free(l->t);
    l->t = NULL;
    return st_error_set(ENOMEM, "model: tensor list");
}

/* ---- MTP blocks ---------------------------------------------------------------------------
 * The last n_nextn blocks of block_count (blk.n_layer .. blk.n_layer + n_nextn - 1) predict
 * further tokens for speculative drafting; the engine does not run them. An architecture lists
 * their tensors (layer >= n_layer) for the seeded writer; the loader, the fingerprint and the
 * parameter count drop those entries, and the loader accepts a file's tensors of those blocks
 * without checking, binding or reading them (their pages are not touched). */
static size_t mtp_entries(const st_model_hparams *hp, const st_tlist *l)
{
    size_t n = 0;
    for (size_t i = 0; i < l->n; i++)
        n += l->t[i].layer >= (int32_t)hp->n_layer;
    return n;
}

static void mtp_drop(const st_model_hparams *hp, st_tlist *l)
{
    size_t k = 0;
    for (size_t i = 0; i < l->n; i++)
        if (l->t[i].layer < (int32_t)hp->n_layer)
            l->t[k++] = l->t[i];
    l->n = k;
}

/* Whether a file's tensor belongs to an MTP block: blk.B.* with n_layer <= B < n_layer + n_nextn. */
static int mtp_tensor(const st_model_hparams *hp, const char *name)
{
    if (!hp->n_nextn || strncmp(name, "blk.", 4) || name[4] < '0' || name[4] > '9')
        return 0;
    char *end;
    errno = 0;
    unsigned long b = strtoul(name + 4, &end, 10);
    return !errno && *end == '.' && b >= hp->n_layer && b - hp->n_layer < hp->n_nextn;
}

uint64_t st_model_n_params(const st_model_hparams *hp)
{
    st_tlist l;
    uint64_t n = 0;
    if (hp_arch(hp)->tensors(hp, &l))
        return 0;
    mtp_drop(hp, &l);
    for (size_t i = 0; i < l.n; i++)
        n += tdesc_n(&l.t[i]);
    free(l.t);
    return n;
}

/* ---- fingerprint ------------------------------------------------------------------------ */
struct st_fp {
    st_sha256_ctx h;
};

void st_fp_bytes(st_fp *fp, const void *p, size_t n)
{
    st_sha256_update(&fp->h, p, n);
}

void st_fp_u32(st_fp *fp, uint32_t v)
{
    uint8_t b[4];
    st_put32(b, v);
    st_fp_bytes(fp, b, 4);
}

void st_fp_f32(st_fp *fp, float f)
{
    uint32_t v;
    memcpy(&v, &f, 4);
    st_fp_u32(fp, v);
}

static int fingerprint(st_model *m, const st_tlist *l)
{
    st_fp fp;
    if (st_sha256_init(&fp.h))
        return st_error_set(ST_EIO, "model: SHA-256 unavailable");
    m->arch->fingerprint(&m->hp, &fp);
    for (size_t i = 0; i < l->n; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_find(m->gguf, l->t[i].name);
        uint32_t nl = (uint32_t)strlen(t->name);
        st_fp_u32(&fp, nl);
        st_fp_bytes(&fp, t->name, nl);
        st_fp_u32(&fp, t->type);
        st_fp_u32(&fp, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) {
            st_fp_u32(&fp, (uint32_t)t->dims[d]);
            st_fp_u32(&fp, (uint32_t)(t->dims[d] >> 32));
        }
        st_fp_bytes(&fp, t->data, (size_t)t->nbytes);
    }
    _Static_assert(ST_FINGERPRINT_LEN == ST_SHA256_LEN, "the fingerprint is a SHA-256");
    return st_sha256_final(&fp.h, m->fp) ? st_error_set(ST_EIO, "model: SHA-256 failed") : 0;
}


/* ---- loading ----------------------------------------------------------------------------- */
static int read_arch(const st_gguf *g, const st_arch **out)
{
    const char *s;
    uint64_t n;
    int rc;
    if ((rc = st_gguf_get_str(g, "general.architecture", &s, &n))) {
        if (rc == ST_ENOTFOUND)
            return st_error_set(ST_EINVAL, "model: general.architecture missing");
        return rc;
    }
    if (!(*out = st_arch_find(s, (size_t)n)))
        return st_error_set(ST_EINVAL, "model: architecture \"%.*s\" is not supported ("
                            ARCH_NAMES ")", (int)(n > 64 ? 64 : n), s);
    return 0;
}

static int check_tensor(const st_gguf *g, const st_tdesc *d, const st_gguf_tensor **out)
{
    const st_gguf_tensor *t = st_gguf_tensor_find(g, d->name);
    if (!t)
        return st_error_set(ST_EINVAL, "model: tensor %s missing", d->name);
    if (!st_wtype_get(t->type))
        return st_error_set(ST_EINVAL, "model: tensor %s has type %s (supported: f32, f16, bf16, "
                            "q8_0, q4_0, q4_1, q5_0, q5_1, q2_K, q3_K, q4_K, q5_K, q6_K, iq4_nl, "
                            "iq4_xs)", d->name, st_gguf_type_name(t->type));
    /* trailing dimensions of 1 are insignificant ({E, 1} is {E}) */
    uint32_t tn = t->n_dims, dn = d->nd;
    while (tn > 1 && t->dims[tn - 1] == 1)
        tn--;
    while (dn > 1 && d->dims[dn - 1] == 1)
        dn--;
    int same = tn == dn;
    for (uint32_t i = 0; same && i < dn; i++)
        same = t->dims[i] == d->dims[i];
    if (!same)
        return st_error_set(ST_EINVAL, "model: tensor %s has shape [%llu, %llu], expected [%llu, "
                            "%llu]", d->name, (unsigned long long)t->dims[0],
                            (unsigned long long)(t->n_dims > 1 ? t->dims[1] : 0),
                            (unsigned long long)d->dims[0],
                            (unsigned long long)(d->nd > 1 ? d->dims[1] : 0));
    *out = t;
    return 0;
}

/* Point the field a list entry names at its data: a matrix in the mapping, a vector as an owned
 * f32 copy. */
static int bind(st_model *m, const st_tdesc *d)
{
    const st_gguf_tensor *t = NULL;
    int rc = check_tensor(m->gguf, d, &t);
    if (rc)
        return rc;
    if (d->layer >= (int32_t)m->hp.n_layer)
        return st_error_set(ST_EINVAL, "model: tensor %s of layer %d", d->name, d->layer);
    uint8_t *base = d->layer < 0 ? (uint8_t *)m : (uint8_t *)&m->layers[d->layer];
    void *field = base + d->field;
    if (d->matrix) {
        st_wmat *w = field;
        w->data = t->data;
        w->type = t->type;
        w->cols = (uint32_t)d->dims[0];
        w->rows = (uint32_t)(d->dims[1] * (d->nd == 3 ? d->dims[2] : 1));
        return 0;
    }
    uint64_t n = tdesc_n(d);
    float *v = malloc(n * sizeof *v);
    if (!v)
        return st_error_set(ENOMEM, "model: tensor %s", d->name);
    st_wmat w = {t->data, t->type, 1, (uint32_t)n, 0};
    st_kern_row_f32(&w, 0, v);
    *(float **)field = v;
    return 0;
}

void st_model_free(st_model *m)
{
    if (!m)
        return;
    if (m->layers) {
        for (uint32_t il = 0; il < m->hp.n_layer; il++) {
            st_layer *L = &m->layers[il];
            free(L->attn_norm);
            free(L->ffn_norm);
            free(L->q_norm);
            free(L->k_norm);
            free(L->conv_w);
            free(L->conv_wT);
            free(L->a_log);
            free(L->ssm_a);
            free(L->dt_bias);
            free(L->ssm_norm);
        }
        free(m->layers);
    }
    free(m->mem.layer);
    free(m->output_norm);
    free(m->rope_freqs);
    st_vocab_free(m->vocab);
    st_gguf_close(m->gguf);
    free(m);
}

/* The vocabulary the file's tokenizer keys describe: none (the byte tokenizer) for
 * strata-hybrid's "strata-bytes" or no tokenizer.ggml.model; st_vocab_load's refusal otherwise. */
static int model_vocab(const st_gguf *g, st_vocab **out)
{
    const char *s;
    uint64_t len;
    *out = NULL;
    int rc = st_gguf_get_str(g, "tokenizer.ggml.model", &s, &len);
    if (rc == ST_ENOTFOUND || (!rc && len == 12 && !memcmp(s, "strata-bytes", 12)))
        return 0;
    return rc ? rc : st_vocab_load(g, out);
}

int st_model_load(const char *path, st_model **out)
{
    *out = NULL;
    st_tlist l = {0};
    st_model *m = calloc(1, sizeof *m);
    int rc;
    if (!m)
        return st_error_set(ENOMEM, "model");
    if ((rc = st_gguf_open(path, &m->gguf)))
        goto fail;
    if ((rc = read_arch(m->gguf, &m->arch)) || (rc = m->arch->read(m->gguf, &m->hp))) {
        rc = st_error_wrap(rc, "%s", path);
        goto fail;
    }
    if ((rc = model_vocab(m->gguf, &m->vocab))) {
        rc = st_error_wrap(rc, "%s", path);
        goto fail;
    }
    if ((rc = m->arch->tensors(&m->hp, &l)) || (rc = mem_spec_build(m->arch, &m->hp, &m->mem)))
        goto fail;
    mtp_drop(&m->hp, &l);
    /* a tensor the architecture does not list (a bias, a fused projection) is refused by name:
     * the engine would not compute what the file means; MTP blocks' are left unread */
    for (uint64_t i = 0; i < st_gguf_n_tensors(m->gguf); i++) {
        const char *tn = st_gguf_tensor_at(m->gguf, i)->name;
        size_t k = 0;
        while (k < l.n && strcmp(l.t[k].name, tn))
            k++;
        if (k == l.n && !mtp_tensor(&m->hp, tn)) {
            rc = st_error_set(ST_EINVAL, "model %s: tensor %s is not supported by the %s "
                              "architecture", path, tn, m->arch->name);
            goto fail;
        }
    }
    /* every file tensor is listed (names are unique): one listed but absent is named by bind */
    m->layers = calloc(m->hp.n_layer, sizeof *m->layers);
    if (!m->layers) {
        rc = st_error_set(ENOMEM, "model: layers");
        goto fail;
    }
    /* the mixer: DeltaNet where the layer keeps a recurrent state, attention where it keeps K/V */
    for (uint32_t il = 0; il < m->hp.n_layer; il++)
        m->layers[il].kind = m->mem.layer[il].kind == ST_MEM_REC ? 'D' : 'A';
    for (size_t i = 0; i < l.n; i++)
        if ((rc = bind(m, &l.t[i]))) {
            rc = st_error_wrap(rc, "%s", path);
            goto fail;
        }
    m->hp.wtype = m->tok_embd.type;
    if ((rc = m->arch->prepare(m)) || (rc = fingerprint(m, &l)))
        goto fail;
    free(l.t);
    *out = m;
    return 0;
fail:
    free(l.t);
    st_model_free(m);
    return rc;
}

const st_model_hparams *st_model_hparams_get(const st_model *m)
{
    return &m->hp;
}

const st_vocab *st_model_vocab(const st_model *m)
{
    return m->vocab;
}

const char *st_model_arch(const st_model *m)
{
    return m->arch->name;
}

char st_model_layer_mixer(const st_model *m, uint32_t il)
{
    return m->layers[il].kind;
}

const st_gguf *st_model_gguf(const st_model *m)
{
    return m->gguf;
}

const uint8_t *st_model_fingerprint(const st_model *m)
{
    return m->fp;
}

/* ---- seeded writer ------------------------------------------------------------------------ */
static uint64_t splitmix(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

/* Uniform in [-1, 1). */
static float unif(uint64_t *s)
{
    return (float)((double)(splitmix(s) >> 11) * 0x1p-53 * 2.0 - 1.0);
}

static void fill(const st_model_hparams *hp, const st_tdesc *d, uint64_t seed, size_t index,
                 float *v)
{
    uint64_t n = tdesc_n(d);
    uint64_t s = seed ^ (0x5bd1e995ull * (index + 1));
    splitmix(&s);
    double a = 0.0;
    switch (d->init) {
    case ST_TI_EMB: a = 1.0; break;
    case ST_TI_MAT:
    case ST_TI_MAT_F32: a = sqrt(3.0 / (double)d->dims[0]); break;
    case ST_TI_MAT_OUT: a = sqrt(3.0 / (double)d->dims[0]) / sqrt(2.0 * hp->n_layer); break;
    case ST_TI_CONV: a = 0.5; break;
    default: break;
    }
    for (uint64_t i = 0; i < n; i++) {
        switch (d->init) {
        case ST_TI_ONES: v[i] = 1.0f; break;
        case ST_TI_NORM: v[i] = 1.0f + 0.5f * unif(&s); break;
        case ST_TI_ROPE_FREQS: {
            /* Llama 3's rope scaling (the converter's factors): pairs of short wavelength keep
             * 1, long ones get factor, a smooth blend between */
            const double factor = 32.0, lo = 1.0, hi = 4.0, old_ctx = hp->n_ctx / 16.0;
            double freq = pow((double)hp->rope_base, -(double)(2 * i) / (double)hp->head_dim);
            double wl = 6.283185307179586 / freq;
            if (wl < old_ctx / hi) {
                v[i] = 1.0f;
            } else if (wl > old_ctx / lo) {
                v[i] = (float)factor;
            } else {
                double smooth = (old_ctx / wl - lo) / (hi - lo);
                v[i] = (float)(1.0 / ((1.0 - smooth) / factor + smooth));
            }
            break;
        }
        case ST_TI_ALOG: v[i] = logf(1.0f + 15.0f * (unif(&s) * 0.5f + 0.5f)); break;
        case ST_TI_SSM_A: v[i] = -(1.0f + 15.0f * (unif(&s) * 0.5f + 0.5f)); break;
        case ST_TI_DTBIAS: {
            /* dt in [1e-3, 1e-1] log-uniformly; the bias is softplus^-1(dt) */
            double dt = exp(log(1e-3) + (unif(&s) * 0.5 + 0.5) * (log(1e-1) - log(1e-3)));
            v[i] = (float)(dt + log(-expm1(-dt)));
            break;
        }
        default: v[i] = (float)(unif(&s) * a); break;
        }
    }
}

/* widen: the weights rounded to hp->wtype but stored as F32 (st_model_write_seeded_f32_twin). */
static int write_seeded(const st_model_hparams *hp, uint64_t seed, const char *name,
                        const char *path, int widen)
{
    const st_arch *arch = hp_arch(hp);
    st_tlist l = {0};
    st_gguf_writer *w = NULL;
    void **bufs = NULL;
    float *tmp = NULL;
    int rc = arch->check(hp);
    if (rc)
        return rc;
    if (hp->wtype != ST_GGML_F32 && hp->wtype != ST_GGML_F16 && hp->wtype != ST_GGML_BF16)
        return st_error_set(ST_EINVAL, "model: weight type %s (f32, f16 or bf16)",
                            st_gguf_type_name(hp->wtype));
    if ((rc = arch->tensors(hp, &l)) || (rc = st_gguf_writer_new(&w, 0)))
        goto done;
    if (hp->n_nextn && !mtp_entries(hp, &l)) {
        rc = st_error_set(ST_EINVAL, "model: the %s architecture has no MTP blocks (nextn %u)",
                          arch->name, hp->n_nextn);
        goto done;
    }
    char dflt[96];
    snprintf(dflt, sizeof dflt, "%s seeded", arch->name);
    st_gguf_writer_set_str(w, "general.architecture", arch->name);
    st_gguf_writer_set_str(w, "general.name", name && *name ? name : dflt);
    st_gguf_writer_set_str(w, "general.description",
                           "seeded random weights: the text this model writes is not meaningful");
    st_gguf_writer_set_u64(w, "general.seed", seed);
    if ((rc = arch->write_keys(w, hp)))
        goto done;
    bufs = calloc(l.n, sizeof *bufs);
    if (!bufs) {
        rc = st_error_set(ENOMEM, "model writer");
        goto done;
    }
    for (size_t i = 0; i < l.n; i++) {
        const st_tdesc *d = &l.t[i];
        uint64_t n = tdesc_n(d);
        uint32_t type = d->matrix && d->init != ST_TI_MAT_F32 ? hp->wtype : ST_GGML_F32;
        tmp = malloc(n * sizeof *tmp);
        if (!tmp) {
            rc = st_error_set(ENOMEM, "model writer: tensor %s", d->name);
            goto done;
        }
        fill(hp, d, seed, i, tmp);
        if (type == ST_GGML_F32) {
            bufs[i] = tmp;
        } else {
            uint16_t *h = malloc(n * sizeof *h);
            if (!h) {
                rc = st_error_set(ENOMEM, "model writer: tensor %s", d->name);
                goto done;
            }
            if (type == ST_GGML_F16)
                st_codec_f16_encode(h, tmp, n);
            else
                st_codec_bf16_encode(h, tmp, n);
            if (widen) {
                st_wmat hw = {h, type, 1, (uint32_t)n, 0};
                st_kern_row_f32(&hw, 0, tmp);
                free(h);
                bufs[i] = tmp;
                type = ST_GGML_F32;
            } else {
                free(tmp);
                bufs[i] = h;
            }
        }
        tmp = NULL;
        if ((rc = st_gguf_writer_add_tensor(w, d->name, type, d->nd, d->dims, bufs[i])))
            goto done;
    }
    rc = st_gguf_writer_write(w, path);
done:
    free(tmp);
    if (bufs)
        for (size_t i = 0; i < l.n; i++)
            free(bufs[i]);
    free(bufs);
    free(l.t);
    st_gguf_writer_free(w);
    return rc;
}

int st_model_write_seeded(const st_model_hparams *hp, uint64_t seed, const char *name,
                          const char *path)
{
    return write_seeded(hp, seed, name, path, 0);
}

int st_model_write_seeded_f32_twin(const st_model_hparams *hp, uint64_t seed, const char *name,
                                   const char *path)
{
    return write_seeded(hp, seed, name, path, 1);
}
