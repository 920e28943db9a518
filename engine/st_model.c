/*
 * st_model.c - the strata-hybrid architecture: hyperparameters and presets, the tensor list,
 * loading from GGUF (every tensor's name, type and shape checked), the model fingerprint, and
 * the seeded model writer behind strata-mkmodel.
 *
 * Invariants:
 * 1. The tensor list (tensor_list) is the one description of which tensors a model has, in which
 *    order and shape; the writer, the loader and the fingerprint all walk it.
 * 2. A loaded model's matrices point into the GGUF mapping (F32, F16 or BF16); its vectors are
 *    owned f32 copies. Nothing is written after st_model_load returns.
 * 3. The fingerprint is SHA-256 over a fixed serialisation of the hyperparameters followed by,
 *    for each listed tensor in list order, its name, ggml type, dimensions and data bytes.
 */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <openssl/evp.h>

#include "st_engine_int.h"

#define KEY(s) ST_ARCH "." s

int st_model_preset(const char *name, st_model_hparams *hp)
{
    memset(hp, 0, sizeof *hp);
    hp->n_vocab = ST_VOCAB_BYTES;
    hp->ssm_conv = 4;
    hp->rms_eps = 1e-6f;
    hp->rope_base = 10000.0f;
    hp->kv_dtype = ST_DTYPE_F16;
    snprintf(hp->pattern, sizeof hp->pattern, "DDDA");
    if (!name || !strcmp(name, "tiny")) {
        hp->n_embd = 64;
        hp->n_layer = 4;
        hp->n_ff = 128;
        hp->n_ctx = 2048;
        hp->n_head = 4;
        hp->n_head_kv = 2;
        hp->head_dim = 16;
        hp->ssm_heads = 2;
        hp->ssm_dk = 16;
        hp->ssm_dv = 16;
        hp->wtype = ST_GGML_F32;
    } else if (!strcmp(name, "small")) {
        hp->n_embd = 256;
        hp->n_layer = 8;
        hp->n_ff = 768;
        hp->n_ctx = 32768;
        hp->n_head = 4;
        hp->n_head_kv = 2;
        hp->head_dim = 64;
        hp->ssm_heads = 4;
        hp->ssm_dk = 64;
        hp->ssm_dv = 64;
        hp->wtype = ST_GGML_F16;
    } else if (!strcmp(name, "bench")) {
        /* 24 DeltaNet layers of 6 x 448 x 448: ~118 MB of running state per checkpoint;
         * 8 attention layers of 2 K/V heads x 240 in f16: 15,360 B of K/V per token. */
        hp->n_embd = 256;
        hp->n_layer = 32;
        hp->n_ff = 768;
        hp->n_ctx = 65536;
        hp->n_head = 8;
        hp->n_head_kv = 2;
        hp->head_dim = 240;
        hp->ssm_heads = 6;
        hp->ssm_dk = 448;
        hp->ssm_dv = 448;
        hp->wtype = ST_GGML_F16;
    } else {
        return st_error_set(ST_EINVAL, "unknown model preset \"%s\" (tiny, small, bench)", name);
    }
    return 0;
}

char st_model_layer_kind(const st_model_hparams *hp, uint32_t il)
{
    size_t n = strnlen(hp->pattern, ST_PATTERN_MAX);
    return n ? hp->pattern[il % n] : 'D';
}

int st_model_hparams_check(const st_model_hparams *hp)
{
    size_t plen = strnlen(hp->pattern, ST_PATTERN_MAX);
    int has_a = 0, has_d = 0;
    if (plen == 0 || plen >= ST_PATTERN_MAX)
        return st_error_set(ST_EINVAL, "model: layer pattern empty or longer than %d",
                            ST_PATTERN_MAX - 1);
    for (size_t i = 0; i < plen; i++) {
        if (hp->pattern[i] != 'A' && hp->pattern[i] != 'D')
            return st_error_set(ST_EINVAL, "model: layer pattern \"%s\": '%c' is neither D nor A",
                                hp->pattern, hp->pattern[i]);
    }
    if (hp->n_layer < 1 || hp->n_layer > 1024)
        return st_error_set(ST_EINVAL, "model: block_count %u (1..1024)", hp->n_layer);
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        if (st_model_layer_kind(hp, il) == 'A')
            has_a = 1;
        else
            has_d = 1;
    }
    if (hp->n_vocab < ST_VOCAB_BYTES || hp->n_vocab > (1u << 20))
        return st_error_set(ST_EINVAL, "model: vocab %u (the byte tokenizer needs %u..%u)",
                            hp->n_vocab, ST_VOCAB_BYTES, 1u << 20);
    if (hp->n_embd < 1 || hp->n_embd > 65536 || hp->n_ff < 1 || hp->n_ff > 262144)
        return st_error_set(ST_EINVAL, "model: embedding %u / feed-forward %u out of range",
                            hp->n_embd, hp->n_ff);
    if (hp->n_ctx < 1 || hp->n_ctx > (1u << 24))
        return st_error_set(ST_EINVAL, "model: context_length %u (1..%u)", hp->n_ctx, 1u << 24);
    if (has_a) {
        if (hp->n_head < 1 || hp->n_head > 1024 || hp->n_head_kv < 1 ||
            hp->n_head % hp->n_head_kv)
            return st_error_set(ST_EINVAL, "model: head_count %u / head_count_kv %u (kv must "
                                "divide heads)", hp->n_head, hp->n_head_kv);
        if (hp->head_dim < 2 || hp->head_dim > 4096 || hp->head_dim % 2)
            return st_error_set(ST_EINVAL, "model: attention head width %u (even, 2..4096)",
                                hp->head_dim);
        if (!(hp->rope_base > 1.0f) || !isfinite(hp->rope_base))
            return st_error_set(ST_EINVAL, "model: rope.freq_base %g", (double)hp->rope_base);
    }
    if (has_d) {
        if (hp->ssm_heads < 1 || hp->ssm_heads > 1024 || hp->ssm_dk < 1 || hp->ssm_dk > 4096 ||
            hp->ssm_dv < 1 || hp->ssm_dv > 4096)
            return st_error_set(ST_EINVAL, "model: DeltaNet heads %u x %u x %u out of range",
                                hp->ssm_heads, hp->ssm_dk, hp->ssm_dv);
        if (hp->ssm_conv != 4)
            return st_error_set(ST_EINVAL, "model: ssm.conv_kernel %u (only 4 is supported)",
                                hp->ssm_conv);
    }
    if (!(hp->rms_eps > 0.0f) || !(hp->rms_eps < 1.0f))
        return st_error_set(ST_EINVAL, "model: layer_norm_rms_epsilon %g", (double)hp->rms_eps);
    if (hp->kv_dtype != ST_DTYPE_F16 && hp->kv_dtype != ST_DTYPE_I8)
        return st_error_set(ST_EINVAL, "model: K/V dtype %s (f16 or i8)",
                            st_dtype_name(hp->kv_dtype));
    return 0;
}

uint64_t st_model_state_bytes(const st_model_hparams *hp)
{
    uint64_t b = 8; /* position */
    uint64_t C = (uint64_t)hp->ssm_heads * (2ull * hp->ssm_dk + hp->ssm_dv);
    for (uint32_t il = 0; il < hp->n_layer; il++)
        if (st_model_layer_kind(hp, il) == 'D')
            b += 4ull * hp->ssm_heads * hp->ssm_dk * hp->ssm_dv + 4ull * (hp->ssm_conv - 1) * C;
    return b;
}

uint64_t st_model_kv_bytes_per_token(const st_model_hparams *hp, uint32_t kv_dtype)
{
    uint64_t b = 0;
    for (uint32_t il = 0; il < hp->n_layer; il++)
        if (st_model_layer_kind(hp, il) == 'A') {
            if (kv_dtype == ST_DTYPE_I8)
                b += 2ull * hp->n_head_kv * (hp->head_dim + 4);
            else
                b += 2ull * hp->n_head_kv * hp->head_dim * 2;
        }
    return b;
}

/* ---- the tensor list ------------------------------------------------------------------- */
enum tinit { T_EMB, T_ONES, T_MAT, T_MAT_OUT, T_CONV, T_ALOG, T_DTBIAS };

typedef struct tdesc {
    char name[64];
    uint32_t nd;
    uint64_t dims[2]; /* ne0 (cols / length), ne1 (rows) */
    int matrix;       /* stored in the weight type; vectors and conv weights are f32 */
    int init;
} tdesc;

typedef struct tlist {
    tdesc *t;
    size_t n, cap;
    int err;
} tlist;

static void tl_add(tlist *l, int matrix, int init, uint64_t ne0, uint64_t ne1, const char *fmt,
                   ...) __attribute__((format(printf, 6, 7)));
static void tl_add(tlist *l, int matrix, int init, uint64_t ne0, uint64_t ne1, const char *fmt, ...)
{
    if (l->err)
        return;
    if (l->n == l->cap) {
        size_t cap = l->cap ? l->cap * 2 : 64;
        tdesc *n = realloc(l->t, cap * sizeof *n);
        if (!n) {
            l->err = ENOMEM;
            return;
        }
        l->t = n;
        l->cap = cap;
    }
    tdesc *d = &l->t[l->n++];
    memset(d, 0, sizeof *d);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(d->name, sizeof d->name, fmt, ap);
    va_end(ap);
    d->nd = ne1 ? 2 : 1;
    d->dims[0] = ne0;
    d->dims[1] = ne1;
    d->matrix = matrix;
    d->init = init;
}

static int tensor_list(const st_model_hparams *hp, tlist *l)
{
    uint64_t E = hp->n_embd, V = hp->n_vocab, F = hp->n_ff;
    uint64_t H = hp->ssm_heads, dk = hp->ssm_dk, dv = hp->ssm_dv;
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    memset(l, 0, sizeof *l);
    tl_add(l, 1, T_EMB, E, V, "token_embd.weight");
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        tl_add(l, 0, T_ONES, E, 0, "blk.%u.attn_norm.weight", il);
        if (st_model_layer_kind(hp, il) == 'A') {
            tl_add(l, 1, T_MAT, E, qa, "blk.%u.attn_q.weight", il);
            tl_add(l, 1, T_MAT, E, kva, "blk.%u.attn_k.weight", il);
            tl_add(l, 1, T_MAT, E, kva, "blk.%u.attn_v.weight", il);
            tl_add(l, 1, T_MAT_OUT, qa, E, "blk.%u.attn_output.weight", il);
        } else {
            tl_add(l, 1, T_MAT, E, H * dk, "blk.%u.ssm_q.weight", il);
            tl_add(l, 1, T_MAT, E, H * dk, "blk.%u.ssm_k.weight", il);
            tl_add(l, 1, T_MAT, E, H * dv, "blk.%u.ssm_v.weight", il);
            tl_add(l, 0, T_CONV, hp->ssm_conv, H * (2 * dk + dv), "blk.%u.ssm_conv1d.weight", il);
            tl_add(l, 1, T_MAT, E, H, "blk.%u.ssm_alpha.weight", il);
            tl_add(l, 1, T_MAT, E, H, "blk.%u.ssm_beta.weight", il);
            tl_add(l, 0, T_ALOG, H, 0, "blk.%u.ssm_a", il);
            tl_add(l, 0, T_DTBIAS, H, 0, "blk.%u.ssm_dt.bias", il);
            tl_add(l, 0, T_ONES, dv, 0, "blk.%u.ssm_norm.weight", il);
            tl_add(l, 1, T_MAT, E, H * dv, "blk.%u.ssm_gate.weight", il);
            tl_add(l, 1, T_MAT_OUT, H * dv, E, "blk.%u.ssm_out.weight", il);
        }
        tl_add(l, 0, T_ONES, E, 0, "blk.%u.ffn_norm.weight", il);
        tl_add(l, 1, T_MAT, E, F, "blk.%u.ffn_gate.weight", il);
        tl_add(l, 1, T_MAT, E, F, "blk.%u.ffn_up.weight", il);
        tl_add(l, 1, T_MAT_OUT, F, E, "blk.%u.ffn_down.weight", il);
    }
    tl_add(l, 0, T_ONES, E, 0, "output_norm.weight");
    tl_add(l, 1, T_MAT, E, V, "output.weight");
    if (l->err) {
        free(l->t);
        l->t = NULL;
        return st_error_set(ENOMEM, "model: tensor list");
    }
    return 0;
}

uint64_t st_model_n_params(const st_model_hparams *hp)
{
    tlist l;
    uint64_t n = 0;
    if (tensor_list(hp, &l))
        return 0;
    for (size_t i = 0; i < l.n; i++)
        n += l.t[i].dims[0] * (l.t[i].nd == 2 ? l.t[i].dims[1] : 1);
    free(l.t);
    return n;
}

/* ---- fingerprint ------------------------------------------------------------------------ */
static void fp_u32(EVP_MD_CTX *c, uint32_t v)
{
    uint8_t b[4] = {(uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24)};
    EVP_DigestUpdate(c, b, 4);
}

static void fp_f32(EVP_MD_CTX *c, float f)
{
    uint32_t v;
    memcpy(&v, &f, 4);
    fp_u32(c, v);
}

static int fingerprint(st_model *m, const tlist *l)
{
    const st_model_hparams *hp = &m->hp;
    EVP_MD_CTX *c = EVP_MD_CTX_new();
    unsigned int len = 0;
    if (!c || EVP_DigestInit_ex(c, EVP_sha256(), NULL) != 1) {
        EVP_MD_CTX_free(c);
        return st_error_set(ST_EIO, "model: SHA-256 unavailable");
    }
    static const char tag[] = "strata-hybrid fingerprint 1";
    EVP_DigestUpdate(c, tag, sizeof tag);
    const uint32_t u[] = {hp->n_vocab, hp->n_embd,    hp->n_layer,  hp->n_ff,     hp->n_ctx,
                          hp->n_head,  hp->n_head_kv, hp->head_dim, hp->ssm_heads, hp->ssm_dk,
                          hp->ssm_dv,  hp->ssm_conv,  hp->kv_dtype};
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        fp_u32(c, u[i]);
    fp_f32(c, hp->rms_eps);
    fp_f32(c, hp->rope_base);
    uint32_t plen = (uint32_t)strnlen(hp->pattern, ST_PATTERN_MAX);
    fp_u32(c, plen);
    EVP_DigestUpdate(c, hp->pattern, plen);
    for (size_t i = 0; i < l->n; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_find(m->gguf, l->t[i].name);
        uint32_t nl = (uint32_t)strlen(t->name);
        fp_u32(c, nl);
        EVP_DigestUpdate(c, t->name, nl);
        fp_u32(c, t->type);
        fp_u32(c, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++) {
            fp_u32(c, (uint32_t)t->dims[d]);
            fp_u32(c, (uint32_t)(t->dims[d] >> 32));
        }
        EVP_DigestUpdate(c, t->data, (size_t)t->nbytes);
    }
    int ok = EVP_DigestFinal_ex(c, m->fp, &len) == 1 && len == ST_FINGERPRINT_LEN;
    EVP_MD_CTX_free(c);
    return ok ? 0 : st_error_set(ST_EIO, "model: SHA-256 failed");
}

void st_fingerprint_hex(char *dst, const uint8_t *fp, size_t n)
{
    static const char hx[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        dst[2 * i] = hx[fp[i] >> 4];
        dst[2 * i + 1] = hx[fp[i] & 15];
    }
    dst[2 * n] = '\0';
}

/* ---- loading ----------------------------------------------------------------------------- */
static int get_u32(const st_gguf *g, const char *key, uint32_t *v)
{
    int rc = st_gguf_get_u32(g, key, v);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_EINVAL, "model: key %s missing", key);
    return rc;
}

static int get_f32(const st_gguf *g, const char *key, float *v)
{
    int rc = st_gguf_get_f32(g, key, v);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_EINVAL, "model: key %s missing", key);
    return rc;
}

static int read_hparams(const st_gguf *g, st_model_hparams *hp)
{
    const char *s;
    uint64_t n;
    int rc;
    memset(hp, 0, sizeof *hp);
    if ((rc = st_gguf_get_str(g, "general.architecture", &s, &n))) {
        if (rc == ST_ENOTFOUND)
            return st_error_set(ST_EINVAL, "model: general.architecture missing");
        return rc;
    }
    if (n != strlen(ST_ARCH) || memcmp(s, ST_ARCH, n))
        return st_error_set(ST_EINVAL, "model: architecture \"%.*s\" is not supported (only "
                            ST_ARCH ")", (int)(n > 64 ? 64 : n), s);
    if ((rc = get_u32(g, KEY("block_count"), &hp->n_layer)) ||
        (rc = get_u32(g, KEY("context_length"), &hp->n_ctx)) ||
        (rc = get_u32(g, KEY("embedding_length"), &hp->n_embd)) ||
        (rc = get_u32(g, KEY("feed_forward_length"), &hp->n_ff)) ||
        (rc = get_u32(g, KEY("vocab_size"), &hp->n_vocab)) ||
        (rc = get_f32(g, KEY("attention.layer_norm_rms_epsilon"), &hp->rms_eps)))
        return rc;
    if ((rc = st_gguf_get_str(g, KEY("layer_pattern"), &s, &n))) {
        if (rc == ST_ENOTFOUND)
            return st_error_set(ST_EINVAL, "model: key " KEY("layer_pattern") " missing");
        return rc;
    }
    if (n == 0 || n >= ST_PATTERN_MAX)
        return st_error_set(ST_EINVAL, "model: layer pattern of %llu characters (1..%d)",
                            (unsigned long long)n, ST_PATTERN_MAX - 1);
    memcpy(hp->pattern, s, n);
    hp->pattern[n] = '\0';
    int has_a = 0, has_d = 0;
    for (uint32_t il = 0; il < hp->n_layer && il < 1024; il++) {
        if (st_model_layer_kind(hp, il) == 'A')
            has_a = 1;
        else
            has_d = 1;
    }
    hp->kv_dtype = ST_DTYPE_F16;
    if (has_a) {
        uint32_t kl = 0, vl = 0;
        if ((rc = get_u32(g, KEY("attention.head_count"), &hp->n_head)) ||
            (rc = get_u32(g, KEY("attention.head_count_kv"), &hp->n_head_kv)) ||
            (rc = get_u32(g, KEY("attention.key_length"), &kl)) ||
            (rc = get_u32(g, KEY("attention.value_length"), &vl)) ||
            (rc = get_f32(g, KEY("rope.freq_base"), &hp->rope_base)))
            return rc;
        if (kl != vl)
            return st_error_set(ST_EINVAL, "model: attention key_length %u != value_length %u", kl,
                                vl);
        hp->head_dim = kl;
        if (st_gguf_get_str(g, KEY("attention.kv_dtype"), &s, &n) == 0) {
            if (n == 3 && !memcmp(s, "f16", 3))
                hp->kv_dtype = ST_DTYPE_F16;
            else if (n == 2 && !memcmp(s, "i8", 2))
                hp->kv_dtype = ST_DTYPE_I8;
            else
                return st_error_set(ST_EINVAL, "model: " KEY("attention.kv_dtype") " \"%.*s\" "
                                    "(f16 or i8)", (int)(n > 16 ? 16 : n), s);
        }
    }
    if (has_d) {
        if ((rc = get_u32(g, KEY("ssm.head_count"), &hp->ssm_heads)) ||
            (rc = get_u32(g, KEY("ssm.key_length"), &hp->ssm_dk)) ||
            (rc = get_u32(g, KEY("ssm.value_length"), &hp->ssm_dv)) ||
            (rc = get_u32(g, KEY("ssm.conv_kernel"), &hp->ssm_conv)))
            return rc;
    }
    return st_model_hparams_check(hp);
}

static int check_tensor(const st_gguf *g, const tdesc *d, const st_gguf_tensor **out)
{
    const st_gguf_tensor *t = st_gguf_tensor_find(g, d->name);
    if (!t)
        return st_error_set(ST_EINVAL, "model: tensor %s missing", d->name);
    if (t->type != ST_GGML_F32 && t->type != ST_GGML_F16 && t->type != ST_GGML_BF16)
        return st_error_set(ST_EINVAL, "model: tensor %s has type %s (f32, f16 or bf16 supported)",
                            d->name, st_gguf_type_name(t->type));
    if (t->n_dims != d->nd || t->dims[0] != d->dims[0] || (d->nd == 2 && t->dims[1] != d->dims[1]))
        return st_error_set(ST_EINVAL, "model: tensor %s has shape [%llu, %llu], expected [%llu, "
                            "%llu]", d->name, (unsigned long long)t->dims[0],
                            (unsigned long long)(t->n_dims > 1 ? t->dims[1] : 0),
                            (unsigned long long)d->dims[0],
                            (unsigned long long)(d->nd > 1 ? d->dims[1] : 0));
    *out = t;
    return 0;
}

static int load_vec(const st_gguf *g, const tdesc *d, float **out)
{
    const st_gguf_tensor *t = NULL;
    int rc = check_tensor(g, d, &t);
    if (rc)
        return rc;
    uint64_t n = d->dims[0] * (d->nd == 2 ? d->dims[1] : 1);
    float *v = malloc(n * sizeof *v);
    if (!v)
        return st_error_set(ENOMEM, "model: tensor %s", d->name);
    st_wmat w = {t->data, t->type, 1, (uint32_t)n, 0};
    st_kern_row_f32(&w, 0, v);
    *out = v;
    return 0;
}

static int load_mat(const st_gguf *g, const tdesc *d, st_wmat *w)
{
    const st_gguf_tensor *t;
    int rc = check_tensor(g, d, &t);
    if (rc)
        return rc;
    w->data = t->data;
    w->type = t->type;
    w->cols = (uint32_t)d->dims[0];
    w->rows = (uint32_t)d->dims[1];
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
            free(L->conv_w);
            free(L->a_log);
            free(L->dt_bias);
            free(L->ssm_norm);
        }
        free(m->layers);
    }
    free(m->output_norm);
    st_gguf_close(m->gguf);
    free(m);
}

/* Point the field a list entry names at its data. */
static int bind(st_model *m, const tdesc *d)
{
    const st_gguf *g = m->gguf;
    unsigned il;
    char rest[64];
    if (!strcmp(d->name, "token_embd.weight"))
        return load_mat(g, d, &m->tok_embd);
    if (!strcmp(d->name, "output.weight"))
        return load_mat(g, d, &m->output);
    if (!strcmp(d->name, "output_norm.weight"))
        return load_vec(g, d, &m->output_norm);
    if (sscanf(d->name, "blk.%u.%63s", &il, rest) != 2 || il >= m->hp.n_layer)
        return st_error_set(ST_EINVAL, "model: unexpected tensor %s", d->name);
    st_layer *L = &m->layers[il];
    static const struct {
        const char *n;
        size_t off;
        int vec;
    } map[] = {
        {"attn_norm.weight", offsetof(st_layer, attn_norm), 1},
        {"ffn_norm.weight", offsetof(st_layer, ffn_norm), 1},
        {"attn_q.weight", offsetof(st_layer, wq), 0},
        {"attn_k.weight", offsetof(st_layer, wk), 0},
        {"attn_v.weight", offsetof(st_layer, wv), 0},
        {"attn_output.weight", offsetof(st_layer, wo), 0},
        {"ssm_q.weight", offsetof(st_layer, sq), 0},
        {"ssm_k.weight", offsetof(st_layer, sk), 0},
        {"ssm_v.weight", offsetof(st_layer, sv), 0},
        {"ssm_gate.weight", offsetof(st_layer, sgate), 0},
        {"ssm_out.weight", offsetof(st_layer, sout), 0},
        {"ssm_alpha.weight", offsetof(st_layer, salpha), 0},
        {"ssm_beta.weight", offsetof(st_layer, sbeta), 0},
        {"ssm_conv1d.weight", offsetof(st_layer, conv_w), 1},
        {"ssm_a", offsetof(st_layer, a_log), 1},
        {"ssm_dt.bias", offsetof(st_layer, dt_bias), 1},
        {"ssm_norm.weight", offsetof(st_layer, ssm_norm), 1},
        {"ffn_gate.weight", offsetof(st_layer, ffn_gate), 0},
        {"ffn_up.weight", offsetof(st_layer, ffn_up), 0},
        {"ffn_down.weight", offsetof(st_layer, ffn_down), 0},
    };
    for (size_t i = 0; i < sizeof map / sizeof map[0]; i++)
        if (!strcmp(rest, map[i].n)) {
            void *field = (uint8_t *)L + map[i].off;
            return map[i].vec ? load_vec(g, d, (float **)field) : load_mat(g, d, field);
        }
    return st_error_set(ST_EINVAL, "model: unexpected tensor %s", d->name);
}

int st_model_load(const char *path, st_model **out)
{
    *out = NULL;
    tlist l = {0};
    st_model *m = calloc(1, sizeof *m);
    int rc;
    if (!m)
        return st_error_set(ENOMEM, "model");
    if ((rc = st_gguf_open(path, &m->gguf)))
        goto fail;
    if ((rc = read_hparams(m->gguf, &m->hp))) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        rc = st_error_set(rc, "%s: %s", path, d);
        goto fail;
    }
    if ((rc = tensor_list(&m->hp, &l)))
        goto fail;
    if (st_gguf_n_tensors(m->gguf) != l.n) {
        rc = st_error_set(ST_EINVAL, "model %s: %llu tensors, the architecture has %zu", path,
                          (unsigned long long)st_gguf_n_tensors(m->gguf), l.n);
        goto fail;
    }
    m->layers = calloc(m->hp.n_layer, sizeof *m->layers);
    if (!m->layers) {
        rc = st_error_set(ENOMEM, "model: layers");
        goto fail;
    }
    for (uint32_t il = 0; il < m->hp.n_layer; il++)
        m->layers[il].kind = st_model_layer_kind(&m->hp, il);
    for (size_t i = 0; i < l.n; i++)
        if ((rc = bind(m, &l.t[i]))) {
            char d[512];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(rc, "%s: %s", path, d);
            goto fail;
        }
    m->hp.wtype = m->tok_embd.type;
    if ((rc = fingerprint(m, &l)))
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

static void fill(const st_model_hparams *hp, const tdesc *d, uint64_t seed, size_t index, float *v)
{
    uint64_t n = d->dims[0] * (d->nd == 2 ? d->dims[1] : 1);
    uint64_t s = seed ^ (0x5bd1e995ull * (index + 1));
    splitmix(&s);
    double a = 0.0;
    switch (d->init) {
    case T_EMB: a = 1.0; break;
    case T_MAT: a = sqrt(3.0 / (double)d->dims[0]); break;
    case T_MAT_OUT: a = sqrt(3.0 / (double)d->dims[0]) / sqrt(2.0 * hp->n_layer); break;
    case T_CONV: a = 0.5; break;
    default: break;
    }
    for (uint64_t i = 0; i < n; i++) {
        switch (d->init) {
        case T_ONES: v[i] = 1.0f; break;
        case T_ALOG: v[i] = logf(1.0f + 15.0f * (unif(&s) * 0.5f + 0.5f)); break;
        case T_DTBIAS: {
            /* dt in [1e-3, 1e-1] log-uniformly; the bias is softplus^-1(dt) */
            double dt = exp(log(1e-3) + (unif(&s) * 0.5 + 0.5) * (log(1e-1) - log(1e-3)));
            v[i] = (float)(dt + log(-expm1(-dt)));
            break;
        }
        default: v[i] = (float)(unif(&s) * a); break;
        }
    }
}

int st_model_write_seeded(const st_model_hparams *hp, uint64_t seed, const char *name,
                          const char *path)
{
    tlist l = {0};
    st_gguf_writer *w = NULL;
    void **bufs = NULL;
    float *tmp = NULL;
    int rc = st_model_hparams_check(hp);
    if (rc)
        return rc;
    if (hp->wtype != ST_GGML_F32 && hp->wtype != ST_GGML_F16 && hp->wtype != ST_GGML_BF16)
        return st_error_set(ST_EINVAL, "model: weight type %s (f32, f16 or bf16)",
                            st_gguf_type_name(hp->wtype));
    if ((rc = tensor_list(hp, &l)) || (rc = st_gguf_writer_new(&w, 0)))
        goto done;
    st_gguf_writer_set_str(w, "general.architecture", ST_ARCH);
    st_gguf_writer_set_str(w, "general.name", name && *name ? name : "strata-hybrid seeded");
    st_gguf_writer_set_str(w, "general.description",
                           "seeded random weights: the text this model writes is not meaningful");
    st_gguf_writer_set_u64(w, "general.seed", seed);
    st_gguf_writer_set_u32(w, KEY("block_count"), hp->n_layer);
    st_gguf_writer_set_u32(w, KEY("context_length"), hp->n_ctx);
    st_gguf_writer_set_u32(w, KEY("embedding_length"), hp->n_embd);
    st_gguf_writer_set_u32(w, KEY("feed_forward_length"), hp->n_ff);
    st_gguf_writer_set_u32(w, KEY("vocab_size"), hp->n_vocab);
    st_gguf_writer_set_u32(w, KEY("attention.head_count"), hp->n_head);
    st_gguf_writer_set_u32(w, KEY("attention.head_count_kv"), hp->n_head_kv);
    st_gguf_writer_set_u32(w, KEY("attention.key_length"), hp->head_dim);
    st_gguf_writer_set_u32(w, KEY("attention.value_length"), hp->head_dim);
    st_gguf_writer_set_f32(w, KEY("attention.layer_norm_rms_epsilon"), hp->rms_eps);
    st_gguf_writer_set_str(w, KEY("attention.kv_dtype"), hp->kv_dtype == ST_DTYPE_I8 ? "i8" : "f16");
    st_gguf_writer_set_f32(w, KEY("rope.freq_base"), hp->rope_base);
    st_gguf_writer_set_u32(w, KEY("rope.dimension_count"), hp->head_dim);
    st_gguf_writer_set_u32(w, KEY("ssm.head_count"), hp->ssm_heads);
    st_gguf_writer_set_u32(w, KEY("ssm.key_length"), hp->ssm_dk);
    st_gguf_writer_set_u32(w, KEY("ssm.value_length"), hp->ssm_dv);
    st_gguf_writer_set_u32(w, KEY("ssm.conv_kernel"), hp->ssm_conv);
    st_gguf_writer_set_str(w, KEY("layer_pattern"), hp->pattern);
    st_gguf_writer_set_str(w, "tokenizer.ggml.model", "strata-bytes");
    st_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", ST_TOKEN_BOS);
    st_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", ST_TOKEN_EOS);
    rc = st_gguf_writer_set_u32(w, "tokenizer.ggml.seperator_token_id", ST_TOKEN_SEP);
    if (rc)
        goto done;
    bufs = calloc(l.n, sizeof *bufs);
    if (!bufs) {
        rc = st_error_set(ENOMEM, "model writer");
        goto done;
    }
    for (size_t i = 0; i < l.n; i++) {
        const tdesc *d = &l.t[i];
        uint64_t n = d->dims[0] * (d->nd == 2 ? d->dims[1] : 1);
        uint32_t type = d->matrix ? hp->wtype : ST_GGML_F32;
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
            free(tmp);
            bufs[i] = h;
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
