/*
 * st_arch_llama.c - the `llama` and `qwen3` architectures (ARCHITECTURES.md §2, §3.1, §3.2): a
 * stack of grouped-query attention and SwiGLU blocks with RMSNorm before each. They differ in
 * three places only, so one file holds both:
 *   llama: RoPE NORM (adjacent pairs; the converter permuted q/k rows), angles divided by the
 *          optional rope_freqs.weight (Llama 3.1+);
 *   qwen3: q and k RMSNorm'ed per head (attn_q_norm / attn_k_norm, same eps) before RoPE NEOX
 *          (halves).
 * Both: optional output.weight (absent: the LM head is token_embd), K/V on every layer (a
 * conversation can be cut at any position), no biases.
 *
 * Invariants:
 * 1. The tensor list is the file's: names and shapes exactly as llama.cpp's loader expects them,
 *    so a seeded file loads there too and a real file loads here. Anything else is refused by
 *    name (st_model.c), as is a key value this engine does not compute (YaRN, partial RoPE,
 *    MTP blocks, per-layer head counts).
 * 2. The fingerprint's tags never change ("llama fingerprint 1", "qwen3 fingerprint 1").
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_arch_int.h"

/* ---- the two variants ----------------------------------------------------------------------- */
static int is_qwen3(const st_model_hparams *hp)
{
    return !strcmp(hp->arch, "qwen3");
}

static int base_preset(const char *arch, const char *name, st_model_hparams *hp)
{
    int q3 = !strcmp(arch, "qwen3");
    memset(hp, 0, sizeof *hp);
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);
    snprintf(hp->pattern, sizeof hp->pattern, "A");
    hp->kv_dtype = ST_DTYPE_F16;
    hp->wtype = ST_GGML_F32;
    if (!name || !strcmp(name, "tiny") || !strcmp(name, "tiny-untied")) {
        /* tests: 3 layers, 4 query heads on 2 K/V heads of 16, a vocabulary past the byte ids */
        hp->n_vocab = 512;
        hp->n_embd = 64;
        hp->n_layer = 3;
        hp->n_ff = 96;
        hp->n_ctx = 1024;
        hp->n_head = 4;
        hp->n_head_kv = 2;
        hp->head_dim = 16;
        hp->rms_eps = q3 ? 1e-6f : 1e-5f;
        hp->rope_base = 10000.0f;
        hp->tied = name && !strcmp(name, "tiny-untied") ? 0 : 1;
        hp->rope_freqs = !q3;
        return 0;
    }
    if (!strcmp(name, "tiny-q")) {
        /* quantized tests: every row length a multiple of 256 (K-quants used as such), untied */
        hp->n_vocab = 512;
        hp->n_embd = 256;
        hp->n_layer = 2;
        hp->n_ff = 256;
        hp->n_ctx = 1024;
        hp->n_head = 4;
        hp->n_head_kv = 2;
        hp->head_dim = 64;
        hp->rms_eps = q3 ? 1e-6f : 1e-5f;
        hp->rope_base = 10000.0f;
        hp->tied = 0;
        hp->rope_freqs = !q3;
        return 0;
    }
    if (!q3 && !strcmp(name, "llama-3.2-1b")) {
        hp->n_vocab = 128256;
        hp->n_embd = 2048;
        hp->n_layer = 16;
        hp->n_ff = 8192;
        hp->n_ctx = 131072;
        hp->n_head = 32;
        hp->n_head_kv = 8;
        hp->head_dim = 64;
        hp->rms_eps = 1e-5f;
        hp->rope_base = 500000.0f;
        hp->tied = 1;
        hp->rope_freqs = 1;
        hp->wtype = ST_GGML_BF16;
        return 0;
    }
    if (!q3 && !strcmp(name, "llama-3.1-8b")) {
        hp->n_vocab = 128256;
        hp->n_embd = 4096;
        hp->n_layer = 32;
        hp->n_ff = 14336;
        hp->n_ctx = 131072;
        hp->n_head = 32;
        hp->n_head_kv = 8;
        hp->head_dim = 128;
        hp->rms_eps = 1e-5f;
        hp->rope_base = 500000.0f;
        hp->tied = 0;
        hp->rope_freqs = 1;
        hp->wtype = ST_GGML_BF16;
        return 0;
    }
    if (q3 && !strcmp(name, "qwen3-0.6b")) {
        hp->n_vocab = 151936;
        hp->n_embd = 1024;
        hp->n_layer = 28;
        hp->n_ff = 3072;
        hp->n_ctx = 40960;
        hp->n_head = 16;
        hp->n_head_kv = 8;
        hp->head_dim = 128;
        hp->rms_eps = 1e-6f;
        hp->rope_base = 1000000.0f;
        hp->tied = 1;
        hp->wtype = ST_GGML_BF16;
        return 0;
    }
    if (q3 && !strcmp(name, "qwen3-8b")) {
        hp->n_vocab = 151936;
        hp->n_embd = 4096;
        hp->n_layer = 36;
        hp->n_ff = 12288;
        hp->n_ctx = 40960;
        hp->n_head = 32;
        hp->n_head_kv = 8;
        hp->head_dim = 128;
        hp->rms_eps = 1e-6f;
        hp->rope_base = 1000000.0f;
        hp->tied = 0;
        hp->wtype = ST_GGML_BF16;
        return 0;
    }
    return st_error_set(ST_EINVAL, "unknown %s preset \"%s\" (tiny, tiny-untied, tiny-q, %s)", arch,
                        name,
                        q3 ? "qwen3-0.6b, qwen3-8b" : "llama-3.2-1b, llama-3.1-8b");
}

static int llama_preset(const char *name, st_model_hparams *hp)
{
    return base_preset("llama", name, hp);
}

static int qwen3_preset(const char *name, st_model_hparams *hp)
{
    return base_preset("qwen3", name, hp);
}

static int la_check(const st_model_hparams *hp)
{
    if (hp->n_layer < 1 || hp->n_layer > 1024)
        return st_error_set(ST_EINVAL, "model: block_count %u (1..1024)", hp->n_layer);
    if (hp->n_vocab < 2 || hp->n_vocab > (1u << 20))
        return st_error_set(ST_EINVAL, "model: vocabulary of %u tokens (2..%u)", hp->n_vocab,
                            1u << 20);
    if (hp->n_embd < 1 || hp->n_embd > 65536 || hp->n_ff < 1 || hp->n_ff > 262144)
        return st_error_set(ST_EINVAL, "model: embedding %u / feed-forward %u out of range",
                            hp->n_embd, hp->n_ff);
    if (hp->n_ctx < 1 || hp->n_ctx > (1u << 24))
        return st_error_set(ST_EINVAL, "model: context_length %u (1..%u)", hp->n_ctx, 1u << 24);
    if (hp->n_head < 1 || hp->n_head > 1024 || hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv)
        return st_error_set(ST_EINVAL, "model: head_count %u / head_count_kv %u (kv must divide "
                            "heads)", hp->n_head, hp->n_head_kv);
    if (hp->head_dim < 2 || hp->head_dim > 4096 || hp->head_dim % 2)
        return st_error_set(ST_EINVAL, "model: attention head width %u (even, 2..4096)",
                            hp->head_dim);
    if (!(hp->rope_base > 1.0f) || !isfinite(hp->rope_base))
        return st_error_set(ST_EINVAL, "model: rope.freq_base %g", (double)hp->rope_base);
    if (!(hp->rms_eps > 0.0f) || !(hp->rms_eps < 1.0f))
        return st_error_set(ST_EINVAL, "model: layer_norm_rms_epsilon %g", (double)hp->rms_eps);
    if (hp->kv_dtype != ST_DTYPE_F16 && hp->kv_dtype != ST_DTYPE_I8)
        return st_error_set(ST_EINVAL, "model: K/V dtype %s (f16 or i8)",
                            st_dtype_name(hp->kv_dtype));
    if (is_qwen3(hp) && hp->rope_freqs)
        return st_error_set(ST_EINVAL, "model: qwen3 has no rope_freqs");
    if (strcmp(hp->pattern, "A"))
        return st_error_set(ST_EINVAL, "model: %s layers are all attention (pattern \"A\", got "
                            "\"%s\")", hp->arch, hp->pattern);
    return 0;
}

/* ---- keys ----------------------------------------------------------------------------------- */
static int key(char *dst, size_t cap, const st_model_hparams *hp, const char *k)
{
    return snprintf(dst, cap, "%s.%s", hp->arch, k);
}

static int req_u32(const st_gguf *g, const st_model_hparams *hp, const char *k, uint32_t *v)
{
    char kk[128];
    key(kk, sizeof kk, hp, k);
    int rc = st_gguf_get_u32(g, kk, v);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_EINVAL, "model: key %s missing", kk);
    return rc;
}

/* 0 and *v set, 0 and *v = dflt when absent, or the error of a key of another type. */
static int opt_u32(const st_gguf *g, const st_model_hparams *hp, const char *k, uint32_t dflt,
                   uint32_t *v)
{
    char kk[128];
    key(kk, sizeof kk, hp, k);
    int rc = st_gguf_get_u32(g, kk, v);
    if (rc == ST_ENOTFOUND) {
        *v = dflt;
        return 0;
    }
    return rc;
}

static int opt_f32(const st_gguf *g, const st_model_hparams *hp, const char *k, float dflt,
                   float *v)
{
    char kk[128];
    key(kk, sizeof kk, hp, k);
    int rc = st_gguf_get_f32(g, kk, v);
    if (rc == ST_ENOTFOUND) {
        *v = dflt;
        return 0;
    }
    return rc;
}

static int la_read_as(const char *arch, const st_gguf *g, st_model_hparams *hp)
{
    char kk[128];
    const char *s;
    uint64_t n;
    uint32_t kl, vl, rot, nextn, etype = 0;
    float factor;
    int rc;
    memset(hp, 0, sizeof *hp);
    snprintf(hp->arch, sizeof hp->arch, "%s", arch);
    snprintf(hp->pattern, sizeof hp->pattern, "A");
    hp->kv_dtype = ST_DTYPE_F16;
    if ((rc = req_u32(g, hp, "block_count", &hp->n_layer)) ||
        (rc = req_u32(g, hp, "context_length", &hp->n_ctx)) ||
        (rc = req_u32(g, hp, "embedding_length", &hp->n_embd)) ||
        (rc = req_u32(g, hp, "feed_forward_length", &hp->n_ff)) ||
        (rc = req_u32(g, hp, "attention.head_count", &hp->n_head)) ||
        (rc = opt_u32(g, hp, "attention.head_count_kv", hp->n_head, &hp->n_head_kv)))
        return rc;
    key(kk, sizeof kk, hp, "attention.layer_norm_rms_epsilon");
    if ((rc = st_gguf_get_f32(g, kk, &hp->rms_eps)))
        return rc == ST_ENOTFOUND ? st_error_set(ST_EINVAL, "model: key %s missing", kk) : rc;
    if (hp->n_head < 1 || hp->n_head > 1024)
        return st_error_set(ST_EINVAL, "model: head_count %u (1..1024)", hp->n_head);
    if ((rc = opt_u32(g, hp, "attention.key_length", hp->n_embd / hp->n_head, &kl)) ||
        (rc = opt_u32(g, hp, "attention.value_length", hp->n_embd / hp->n_head, &vl)) ||
        (rc = opt_u32(g, hp, "rope.dimension_count", kl, &rot)) ||
        (rc = opt_u32(g, hp, "nextn_predict_layers", 0, &nextn)) ||
        (rc = opt_u32(g, hp, "expert_count", 0, &etype)) ||
        (rc = opt_f32(g, hp, "rope.freq_base", 10000.0f, &hp->rope_base)) ||
        (rc = opt_f32(g, hp, "rope.scaling.factor", 0.0f, &factor)))
        return rc;
    if (kl != vl)
        return st_error_set(ST_EINVAL, "model: attention key_length %u != value_length %u", kl, vl);
    hp->head_dim = kl;
    if (rot != kl)
        return st_error_set(ST_EINVAL, "model: %s.rope.dimension_count %u: partial RoPE is not "
                            "supported for %s (head width %u)", arch, rot, arch, kl);
    if (nextn)
        return st_error_set(ST_EINVAL, "model: %s.nextn_predict_layers %u: MTP blocks are not "
                            "supported for %s", arch, nextn, arch);
    if (etype)
        return st_error_set(ST_EINVAL, "model: %s.expert_count %u: mixture of experts is not "
                            "supported for %s", arch, etype, arch);
    key(kk, sizeof kk, hp, "rope.scaling.type");
    if (st_gguf_get_str(g, kk, &s, &n) == 0 && !(n == 4 && !memcmp(s, "none", 4)) &&
        !(n == 6 && !memcmp(s, "linear", 6)))
        return st_error_set(ST_EINVAL, "model: %s \"%.*s\" is not supported (none, linear with "
                            "factor 1)", kk, (int)(n > 32 ? 32 : n), s);
    if (factor != 0.0f && factor != 1.0f)
        return st_error_set(ST_EINVAL, "model: %s.rope.scaling.factor %g is not supported (1)",
                            arch, (double)factor);
    int64_t ti = st_gguf_find(g, "tokenizer.ggml.tokens");
    uint32_t et = 0;
    uint64_t cnt = 0;
    if (ti < 0 || st_gguf_kv_type(g, (uint64_t)ti, &et, &cnt) != ST_GGUF_ARRAY ||
        et != ST_GGUF_STRING)
        return st_error_set(ST_EINVAL, "model: tokenizer.ggml.tokens (the vocabulary) missing or "
                            "not an array of strings");
    if (cnt > (1u << 20))
        return st_error_set(ST_EINVAL, "model: vocabulary of %llu tokens (<= %u)",
                            (unsigned long long)cnt, 1u << 20);
    hp->n_vocab = (uint32_t)cnt;
    hp->tied = st_gguf_tensor_find(g, "output.weight") == NULL;
    hp->rope_freqs = st_gguf_tensor_find(g, "rope_freqs.weight") != NULL;
    if (is_qwen3(hp) && hp->rope_freqs)
        return st_error_set(ST_EINVAL, "model: tensor rope_freqs.weight is not supported by the "
                            "qwen3 architecture");
    return la_check(hp);
}

static int llama_read(const st_gguf *g, st_model_hparams *hp)
{
    return la_read_as("llama", g, hp);
}

static int qwen3_read(const st_gguf *g, st_model_hparams *hp)
{
    return la_read_as("qwen3", g, hp);
}

/* The keys llama.cpp's loader reads, and the smallest tokenizer it opens: a byte-level BPE
 * ("gpt2") vocabulary whose ids 0..255 are the 256 bytes (as GPT-2's byte-to-unicode table
 * writes them; the same ids as the engine's byte tokenizer), then BOS, EOS and the turn
 * separator (CONTROL), then [PADn]; one merge. */
static int la_write_keys(st_gguf_writer *w, const st_model_hparams *hp)
{
    char kk[128];
#define SETU(k, v) (key(kk, sizeof kk, hp, k), st_gguf_writer_set_u32(w, kk, v))
#define SETF(k, v) (key(kk, sizeof kk, hp, k), st_gguf_writer_set_f32(w, kk, v))
    SETU("context_length", hp->n_ctx);
    SETU("embedding_length", hp->n_embd);
    SETU("block_count", hp->n_layer);
    SETU("feed_forward_length", hp->n_ff);
    SETU("attention.head_count", hp->n_head);
    SETU("attention.head_count_kv", hp->n_head_kv);
    SETU("attention.key_length", hp->head_dim);
    SETU("attention.value_length", hp->head_dim);
    SETU("rope.dimension_count", hp->head_dim);
    SETF("rope.freq_base", hp->rope_base);
    SETF("attention.layer_norm_rms_epsilon", hp->rms_eps);
    if (!is_qwen3(hp))
        SETU("vocab_size", hp->n_vocab);
#undef SETU
#undef SETF
    uint32_t V = hp->n_vocab;
    char **tok = calloc(V, sizeof *tok);
    int32_t *type = calloc(V, sizeof *type);
    int rc = 0;
    if (!tok || !type) {
        rc = st_error_set(ENOMEM, "model writer: vocabulary");
        goto done;
    }
    for (uint32_t b = 0, extra = 0; b < 256; b++) {
        /* GPT-2: printable Latin-1 bytes are themselves, the others U+0100 + n in byte order */
        int self = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        uint32_t cp = self ? b : 0x100 + extra++;
        char u[4];
        if (cp < 0x80) {
            u[0] = (char)cp;
            u[1] = 0;
        } else {
            u[0] = (char)(0xc0 | (cp >> 6));
            u[1] = (char)(0x80 | (cp & 0x3f));
            u[2] = 0;
        }
        if (b < V && !(tok[b] = strdup(u)))
            rc = ENOMEM;
        if (b < V)
            type[b] = 1; /* NORMAL */
    }
    static const char *const special[3] = {"<|bos|>", "<|eos|>", "<|sep|>"};
    for (uint32_t i = 256; i < V; i++) {
        char nm[32];
        if (i < 259)
            snprintf(nm, sizeof nm, "%s", special[i - 256]);
        else
            snprintf(nm, sizeof nm, "[PAD%u]", i);
        type[i] = i < 259 ? 3 : 1; /* CONTROL, NORMAL */
        if (!(tok[i] = strdup(nm)))
            rc = ENOMEM;
    }
    if (rc) {
        rc = st_error_set(ENOMEM, "model writer: vocabulary");
        goto done;
    }
    static const char *const merges[1] = {"\xc4\xa0 t"};
    st_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    st_gguf_writer_set_str(w, "tokenizer.ggml.pre", is_qwen3(hp) ? "qwen2" : "llama-bpe");
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.tokens", (const char *const *)tok, V);
    st_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", ST_GGUF_INT32, type, V);
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.merges", merges, 1);
    if (V > ST_TOKEN_SEP) {
        st_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", ST_TOKEN_BOS);
        st_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", ST_TOKEN_EOS);
        st_gguf_writer_set_u32(w, "tokenizer.ggml.seperator_token_id", ST_TOKEN_SEP);
    }
    rc = st_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 0);
done:
    for (uint32_t i = 0; tok && i < V; i++)
        free(tok[i]);
    free(tok);
    free(type);
    return rc;
}

#define LF(f) (uint32_t) offsetof(st_layer, f)
#define MF(f) (uint32_t) offsetof(st_model, f)

static int la_tensors(const st_model_hparams *hp, st_tlist *l)
{
    uint64_t E = hp->n_embd, V = hp->n_vocab, F = hp->n_ff, D = hp->head_dim;
    uint64_t qa = (uint64_t)hp->n_head * D, kva = (uint64_t)hp->n_head_kv * D;
    memset(l, 0, sizeof *l);
    st_tlist_add(l, -1, MF(tok_embd), 1, ST_TI_EMB, E, V, "token_embd.weight");
    if (hp->rope_freqs)
        st_tlist_add(l, -1, MF(rope_freqs), 0, ST_TI_ROPE_FREQS, D / 2, 0, "rope_freqs.weight");
    for (uint32_t u = 0; u < hp->n_layer; u++) {
        int32_t il = (int32_t)u;
        st_tlist_add(l, il, LF(attn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.attn_norm.weight", u);
        st_tlist_add(l, il, LF(wq), 1, ST_TI_MAT, E, qa, "blk.%u.attn_q.weight", u);
        st_tlist_add(l, il, LF(wk), 1, ST_TI_MAT, E, kva, "blk.%u.attn_k.weight", u);
        st_tlist_add(l, il, LF(wv), 1, ST_TI_MAT, E, kva, "blk.%u.attn_v.weight", u);
        st_tlist_add(l, il, LF(wo), 1, ST_TI_MAT_OUT, qa, E, "blk.%u.attn_output.weight", u);
        if (is_qwen3(hp)) {
            st_tlist_add(l, il, LF(q_norm), 0, ST_TI_NORM, D, 0, "blk.%u.attn_q_norm.weight", u);
            st_tlist_add(l, il, LF(k_norm), 0, ST_TI_NORM, D, 0, "blk.%u.attn_k_norm.weight", u);
        }
        st_tlist_add(l, il, LF(ffn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.ffn_norm.weight", u);
        st_tlist_add(l, il, LF(ffn_gate), 1, ST_TI_MAT, E, F, "blk.%u.ffn_gate.weight", u);
        st_tlist_add(l, il, LF(ffn_up), 1, ST_TI_MAT, E, F, "blk.%u.ffn_up.weight", u);
        st_tlist_add(l, il, LF(ffn_down), 1, ST_TI_MAT_OUT, F, E, "blk.%u.ffn_down.weight", u);
    }
    st_tlist_add(l, -1, MF(output_norm), 0, ST_TI_NORM, E, 0, "output_norm.weight");
    if (!hp->tied)
        st_tlist_add(l, -1, MF(output), 1, ST_TI_MAT, E, V, "output.weight");
    return st_tlist_done(l);
}

/* Every layer keeps its K/V rows: the conversation can be cut at any position. */
static void la_memory(const st_model_hparams *hp, uint32_t il, st_mem_layer *ml)
{
    (void)il;
    memset(ml, 0, sizeof *ml);
    ml->kind = ST_MEM_KV;
    ml->kv_heads = hp->n_head_kv;
    ml->head_dim = hp->head_dim;
}

static void la_fingerprint(const st_model_hparams *hp, st_fp *fp)
{
    static const char tl[] = "llama fingerprint 1", tq[] = "qwen3 fingerprint 1";
    if (is_qwen3(hp))
        st_fp_bytes(fp, tq, sizeof tq);
    else
        st_fp_bytes(fp, tl, sizeof tl);
    const uint32_t u[] = {hp->n_vocab, hp->n_embd,    hp->n_layer,  hp->n_ff,   hp->n_ctx,
                          hp->n_head,  hp->n_head_kv, hp->head_dim, hp->kv_dtype, hp->tied,
                          hp->rope_freqs};
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        st_fp_u32(fp, u[i]);
    st_fp_f32(fp, hp->rms_eps);
    st_fp_f32(fp, hp->rope_base);
}

/* Tied embeddings: the LM head is the embedding matrix. */
static int la_prepare(st_model *m)
{
    if (m->hp.tied)
        m->output = m->tok_embd;
    for (uint32_t i = 0; m->rope_freqs && i < m->hp.head_dim / 2; i++)
        if (!(m->rope_freqs[i] > 0.0f) || !isfinite(m->rope_freqs[i]))
            return st_error_set(ST_EINVAL, "model: rope_freqs.weight[%u] = %g (positive)", i,
                                (double)m->rope_freqs[i]);
    return 0;
}

/* ---- the forward pass ----------------------------------------------------------------------- */
typedef struct la_ws {
    float *x, *xn, *out, *qkv, *gate, *o, *logit_in;
    double *rope_freq; /* head_dim / 2 angles per position step: base^(-2i / D) / rope_freqs[i] */
    int neox;
    const st_ops *ops; /* the backend whose memory these are */
    void *oc;
} la_ws;

static void la_fwd_free(void *wsp)
{
    la_ws *w = wsp;
    if (!w)
        return;
    void *p[] = {w->x, w->xn, w->out, w->qkv, w->gate, w->o, w->logit_in, w->rope_freq};
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++)
        st_ws_free(w->ops, w->oc, p[i]);
    free(w);
}

/* The negative control of the llama.cpp comparison (tests/engine/CMakeLists.txt): with
 * STRATA_TEST_WRONG_ROPE=1 the other RoPE pairing is used, which must fail the comparison. */
static int wrong_rope(void)
{
    const char *e = getenv("STRATA_TEST_WRONG_ROPE");
    return e && !strcmp(e, "1");
}

static int la_fwd_new(const st_model *m, const st_ops *ops, void *oc, uint32_t T, void **out)
{
    const st_model_hparams *hp = &m->hp;
    *out = NULL;
    la_ws *w = calloc(1, sizeof *w);
    double *freq = calloc(hp->head_dim / 2 + 1, sizeof *freq);
    if (!w || !freq) {
        free(w);
        free(freq);
        return st_error_set(ENOMEM, "%s: workspace", hp->arch);
    }
    w->ops = ops;
    w->oc = oc;
#define falloc(n, err) st_ws_floats(ops, oc, (n), (err))
    uint64_t E = hp->n_embd, F = hp->n_ff;
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    int err = 0;
    w->x = falloc(T * E, &err);
    w->xn = falloc(T * E, &err);
    w->out = falloc(T * E, &err);
    w->qkv = falloc(T * (qa + 2 * kva), &err);
    w->gate = falloc(T * F, &err);
    w->o = falloc(T * (qa > F ? qa : F), &err);
    w->logit_in = falloc(E, &err);
#undef falloc
    for (uint32_t i = 0; i < hp->head_dim / 2; i++) {
        freq[i] = pow((double)hp->rope_base, -(double)(2 * i) / (double)hp->head_dim);
        if (m->rope_freqs)
            freq[i] /= (double)m->rope_freqs[i];
    }
    w->rope_freq = st_ws_doubles(ops, oc, freq, hp->head_dim / 2, &err);
    free(freq);
    if (err) {
        la_fwd_free(w);
        return st_error_set(ENOMEM, "%s: workspace for a chunk of %u tokens", hp->arch, T);
    }
    w->neox = is_qwen3(hp) != wrong_rope();
    *out = w;
    return 0;
}

/* x = embedding; per layer x += attention(RMSNorm(x)), x += SwiGLU(RMSNorm(x)); the logits of
 * the last token from RMSNorm(x). A branch's output stays in out until the next norm adds it. */
static void la_forward(const st_fwd *f, void *wsp)
{
    la_ws *w = wsp;
    const st_model *m = f->m;
    const st_attn_ws attn = {w->qkv, w->o, w->rope_freq, w->neox};
    st_layer_embed(f, &m->tok_embd, w->x);
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        const st_layer *L = &m->layers[il];
        st_layer_norm(f, w->x, il > 0 ? w->out : NULL, L->attn_norm, w->xn);
        st_layer_attention(f, il, w->xn, w->out, &attn);
        st_layer_norm(f, w->x, w->out, L->ffn_norm, w->xn);
        st_layer_swiglu(f, &L->ffn_gate, &L->ffn_up, &L->ffn_down, w->xn, w->out, w->gate, w->o);
    }
    if (f->logits)
        st_layer_logits(f, w->x, w->out, m->output_norm, &m->output, w->logit_in);
}

const st_arch st_arch_llama = {
    .name = "llama",
    .preset = llama_preset,
    .check = la_check,
    .read = llama_read,
    .write_keys = la_write_keys,
    .tensors = la_tensors,
    .memory = la_memory,
    .fingerprint = la_fingerprint,
    .prepare = la_prepare,
    .fwd_new = la_fwd_new,
    .fwd_free = la_fwd_free,
    .forward = la_forward,
};

const st_arch st_arch_qwen3 = {
    .name = "qwen3",
    .preset = qwen3_preset,
    .check = la_check,
    .read = qwen3_read,
    .write_keys = la_write_keys,
    .tensors = la_tensors,
    .memory = la_memory,
    .fingerprint = la_fingerprint,
    .prepare = la_prepare,
    .fwd_new = la_fwd_new,
    .fwd_free = la_fwd_free,
    .forward = la_forward,
};
