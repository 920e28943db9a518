/*
 * st_arch_hybrid.c - the strata-hybrid architecture (docs/ENGINE.md, "The model"): Gated
 * DeltaNet and grouped-query attention layers in a repeating pattern, SwiGLU feed-forward, byte
 * tokens. Its hyperparameters and presets, GGUF keys, tensor list, memory spec, fingerprint
 * inputs, and its forward pass on the shared layers (st_layers.c).
 *
 * Invariants:
 * 1. The tensor list is the one description of which tensors a model has, in which order and
 *    shape; the writer, the loader and the fingerprint all walk it. Names never change: stored
 *    sessions carry the fingerprint made from them.
 * 2. The fingerprint's tag and parameter order never change ("strata-hybrid fingerprint 1").
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_arch_int.h"

#define KEY(s) ST_ARCH "." s

static int hy_preset(const char *name, st_model_hparams *hp)
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

static int hy_check(const st_model_hparams *hp)
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

static int hy_read(const st_gguf *g, st_model_hparams *hp)
{
    const char *s;
    uint64_t n;
    int rc;
    memset(hp, 0, sizeof *hp);
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
    return hy_check(hp);
}

static int hy_write_keys(st_gguf_writer *w, const st_model_hparams *hp)
{
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
    return st_gguf_writer_set_u32(w, "tokenizer.ggml.seperator_token_id", ST_TOKEN_SEP);
}

#define LF(f) (uint32_t) offsetof(st_layer, f)
#define MF(f) (uint32_t) offsetof(st_model, f)

static int hy_tensors(const st_model_hparams *hp, st_tlist *l)
{
    uint64_t E = hp->n_embd, V = hp->n_vocab, F = hp->n_ff;
    uint64_t H = hp->ssm_heads, dk = hp->ssm_dk, dv = hp->ssm_dv;
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    memset(l, 0, sizeof *l);
    st_tlist_add(l, -1, MF(tok_embd), 1, ST_TI_EMB, E, V, "token_embd.weight");
    for (uint32_t u = 0; u < hp->n_layer; u++) {
        int32_t il = (int32_t)u;
        st_tlist_add(l, il, LF(attn_norm), 0, ST_TI_ONES, E, 0, "blk.%u.attn_norm.weight", u);
        if (st_model_layer_kind(hp, u) == 'A') {
            st_tlist_add(l, il, LF(wq), 1, ST_TI_MAT, E, qa, "blk.%u.attn_q.weight", u);
            st_tlist_add(l, il, LF(wk), 1, ST_TI_MAT, E, kva, "blk.%u.attn_k.weight", u);
            st_tlist_add(l, il, LF(wv), 1, ST_TI_MAT, E, kva, "blk.%u.attn_v.weight", u);
            st_tlist_add(l, il, LF(wo), 1, ST_TI_MAT_OUT, qa, E, "blk.%u.attn_output.weight", u);
        } else {
            st_tlist_add(l, il, LF(sq), 1, ST_TI_MAT, E, H * dk, "blk.%u.ssm_q.weight", u);
            st_tlist_add(l, il, LF(sk), 1, ST_TI_MAT, E, H * dk, "blk.%u.ssm_k.weight", u);
            st_tlist_add(l, il, LF(sv), 1, ST_TI_MAT, E, H * dv, "blk.%u.ssm_v.weight", u);
            st_tlist_add(l, il, LF(conv_w), 0, ST_TI_CONV, hp->ssm_conv, H * (2 * dk + dv),
                         "blk.%u.ssm_conv1d.weight", u);
            st_tlist_add(l, il, LF(salpha), 1, ST_TI_MAT, E, H, "blk.%u.ssm_alpha.weight", u);
            st_tlist_add(l, il, LF(sbeta), 1, ST_TI_MAT, E, H, "blk.%u.ssm_beta.weight", u);
            st_tlist_add(l, il, LF(a_log), 0, ST_TI_ALOG, H, 0, "blk.%u.ssm_a", u);
            st_tlist_add(l, il, LF(dt_bias), 0, ST_TI_DTBIAS, H, 0, "blk.%u.ssm_dt.bias", u);
            st_tlist_add(l, il, LF(ssm_norm), 0, ST_TI_ONES, dv, 0, "blk.%u.ssm_norm.weight", u);
            st_tlist_add(l, il, LF(sgate), 1, ST_TI_MAT, E, H * dv, "blk.%u.ssm_gate.weight", u);
            st_tlist_add(l, il, LF(sout), 1, ST_TI_MAT_OUT, H * dv, E, "blk.%u.ssm_out.weight", u);
        }
        st_tlist_add(l, il, LF(ffn_norm), 0, ST_TI_ONES, E, 0, "blk.%u.ffn_norm.weight", u);
        st_tlist_add(l, il, LF(ffn_gate), 1, ST_TI_MAT, E, F, "blk.%u.ffn_gate.weight", u);
        st_tlist_add(l, il, LF(ffn_up), 1, ST_TI_MAT, E, F, "blk.%u.ffn_up.weight", u);
        st_tlist_add(l, il, LF(ffn_down), 1, ST_TI_MAT_OUT, F, E, "blk.%u.ffn_down.weight", u);
    }
    st_tlist_add(l, -1, MF(output_norm), 0, ST_TI_ONES, E, 0, "output_norm.weight");
    st_tlist_add(l, -1, MF(output), 1, ST_TI_MAT, E, V, "output.weight");
    return st_tlist_done(l);
}

/* DeltaNet layers keep their recurrent state (the convolution runs over the q, k and v
 * channels); attention layers their K/V rows. */
static void hy_memory(const st_model_hparams *hp, uint32_t il, st_mem_layer *ml)
{
    memset(ml, 0, sizeof *ml);
    if (st_model_layer_kind(hp, il) == 'A') {
        ml->kind = ST_MEM_KV;
        ml->kv_heads = hp->n_head_kv;
        ml->head_dim = hp->head_dim;
        return;
    }
    ml->kind = ST_MEM_REC;
    ml->ssm_heads = hp->ssm_heads;
    ml->ssm_dk = hp->ssm_dk;
    ml->ssm_dv = hp->ssm_dv;
    ml->conv_len = hp->ssm_conv - 1;
    ml->conv_ch = hp->ssm_heads * (2 * hp->ssm_dk + hp->ssm_dv);
}

static void hy_fingerprint(const st_model_hparams *hp, st_fp *fp)
{
    static const char tag[] = "strata-hybrid fingerprint 1";
    st_fp_bytes(fp, tag, sizeof tag);
    const uint32_t u[] = {hp->n_vocab, hp->n_embd,    hp->n_layer,  hp->n_ff,      hp->n_ctx,
                          hp->n_head,  hp->n_head_kv, hp->head_dim, hp->ssm_heads, hp->ssm_dk,
                          hp->ssm_dv,  hp->ssm_conv,  hp->kv_dtype};
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        st_fp_u32(fp, u[i]);
    st_fp_f32(fp, hp->rms_eps);
    st_fp_f32(fp, hp->rope_base);
    uint32_t plen = (uint32_t)strnlen(hp->pattern, ST_PATTERN_MAX);
    st_fp_u32(fp, plen);
    st_fp_bytes(fp, hp->pattern, plen);
}

/* The convolution weights transposed ([4][C], what the kernel walks) and the decay factor
 * -exp(A_log) of every DeltaNet layer. */
static int hy_prepare(st_model *m)
{
    const st_model_hparams *hp = &m->hp;
    uint32_t C = hp->ssm_heads * (2 * hp->ssm_dk + hp->ssm_dv), K = hp->ssm_conv;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        st_layer *L = &m->layers[il];
        if (L->kind != 'D')
            continue;
        L->conv_wT = malloc((size_t)K * C * sizeof *L->conv_wT);
        L->ssm_a = malloc((size_t)hp->ssm_heads * sizeof *L->ssm_a);
        if (!L->conv_wT || !L->ssm_a)
            return st_error_set(ENOMEM, "model: layer %u", il);
        for (uint32_t ch = 0; ch < C; ch++)
            for (uint32_t j = 0; j < K; j++)
                L->conv_wT[(size_t)j * C + ch] = L->conv_w[(size_t)ch * K + j];
        for (uint32_t h = 0; h < hp->ssm_heads; h++)
            L->ssm_a[h] = -expf(L->a_log[h]);
    }
    return 0;
}

/* ---- the forward pass ------------------------------------------------------------------- */
typedef struct hy_ws {
    float *x, *xn, *out; /* the residual stream, its normalised copy, a branch's output */
    float *qkv, *qkvc, *gate, *o, *ab, *logit_in;
    double *rope_freq;   /* head_dim / 2 angles per position step, base^(-2i / head_dim) */
    const st_ops *ops;   /* the backend whose memory these are */
    void *oc;
} hy_ws;

static void hy_fwd_free(void *wsp)
{
    hy_ws *w = wsp;
    if (!w)
        return;
    void *p[] = {w->x, w->xn, w->out, w->qkv, w->qkvc, w->gate, w->o, w->ab, w->logit_in,
                 w->rope_freq};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        st_ws_free(w->ops, w->oc, p[i]);
    free(w);
}

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int hy_fwd_new(const st_model *m, const st_ops *ops, void *oc, uint32_t T, void **out)
{
    const st_model_hparams *hp = &m->hp;
    *out = NULL;
    hy_ws *w = calloc(1, sizeof *w);
    double *freq = calloc(hp->head_dim / 2 + 1, sizeof *freq);
    if (!w || !freq) {
        free(w);
        free(freq);
        return st_error_set(ENOMEM, "strata-hybrid: workspace");
    }
    w->ops = ops;
    w->oc = oc;
#define falloc(n, err) st_ws_floats(ops, oc, (n), (err))
    uint64_t E = hp->n_embd, F = hp->n_ff, n_dn = m->mem.n_rec, n_attn = m->mem.n_kv;
    uint64_t C = (uint64_t)hp->ssm_heads * (2 * hp->ssm_dk + hp->ssm_dv);
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    uint64_t hdv = (uint64_t)hp->ssm_heads * hp->ssm_dv;
    int err = 0;
    w->x = falloc(T * E, &err);
    w->xn = falloc(T * E, &err);
    w->out = falloc(T * E, &err);
    w->qkv = falloc(T * max3(n_dn ? C : 0, n_attn ? qa + 2 * kva : 0, 1), &err);
    w->qkvc = falloc(n_dn ? T * C : 1, &err);
    w->gate = falloc(T * max3(n_dn ? hdv : 0, F, 1), &err);
    w->o = falloc(T * max3(n_dn ? hdv : 0, n_attn ? qa : 0, F), &err);
    w->ab = falloc(T * 2 * (uint64_t)(hp->ssm_heads ? hp->ssm_heads : 1), &err);
    w->logit_in = falloc(E, &err);
#undef falloc
    for (uint32_t i = 0; i < hp->head_dim / 2; i++)
        freq[i] = pow((double)hp->rope_base, -(double)(2 * i) / (double)hp->head_dim);
    w->rope_freq = st_ws_doubles(ops, oc, freq, hp->head_dim / 2, &err);
    free(freq);
    if (err) {
        hy_fwd_free(w);
        return st_error_set(ENOMEM, "strata-hybrid: workspace for a chunk of %u tokens", T);
    }
    *out = w;
    return 0;
}

/* x = embedding; per layer x += mixer(RMSNorm(x)), x += SwiGLU(RMSNorm(x)); the logits of the
 * last token from RMSNorm(x). A branch's output stays in out until the next norm adds it. */
static void hy_forward(const st_fwd *f, void *wsp)
{
    hy_ws *w = wsp;
    const st_model *m = f->m;
    const st_gdn_ws gdn = {w->qkv, w->qkvc, w->gate, w->ab, w->o};
    const st_attn_ws attn = {w->qkv, w->o, w->rope_freq, 0};
    st_layer_embed(f, &m->tok_embd, w->x);
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        const st_layer *L = &m->layers[il];
        st_layer_norm(f, w->x, il > 0 ? w->out : NULL, L->attn_norm, w->xn);
        if (L->kind == 'D')
            st_layer_gdn(f, il, w->xn, w->out, &gdn);
        else
            st_layer_attention(f, il, w->xn, w->out, &attn);
        st_layer_norm(f, w->x, w->out, L->ffn_norm, w->xn);
        st_layer_swiglu(f, &L->ffn_gate, &L->ffn_up, &L->ffn_down, w->xn, w->out, w->gate, w->o);
    }
    if (f->logits)
        st_layer_logits(f, w->x, w->out, m->output_norm, &m->output, w->logit_in);
}

const st_arch st_arch_hybrid = {
    .name = ST_ARCH,
    .preset = hy_preset,
    .check = hy_check,
    .read = hy_read,
    .write_keys = hy_write_keys,
    .tensors = hy_tensors,
    .memory = hy_memory,
    .fingerprint = hy_fingerprint,
    .prepare = hy_prepare,
    .fwd_new = hy_fwd_new,
    .fwd_free = hy_fwd_free,
    .forward = hy_forward,
};
