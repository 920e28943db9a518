/*
 * st_arch_qwen35.c - the Qwen hybrid architectures of ARCHITECTURES.md (§2, §3): qwen35 (Qwen3.5
 * / 3.6 dense) and qwen3next (Qwen3-Next, current attn_qkv / attn_gate files and the legacy
 * ssm_in). Three Gated DeltaNet layers to one gated-attention layer (full_attention_interval),
 * SwiGLU feed-forward; hyperparameters from the GGUF keys, presets in the shapes of the
 * published models and small test shapes with key heads != value heads, the tensor list, the
 * memory spec (K/V on the attention layers, convolution history + DeltaNet matrix on the
 * others), the fingerprint inputs, the seeded model's keys (with the minimal byte-level BPE
 * tokenizer metadata llama.cpp's loader needs) and the forward pass on the shared layers.
 *
 * Invariants:
 * 1. The value head -> key head mapping is the architecture's: qwen35 tiled (h mod Hk: its
 *    converter reordered the value heads), qwen3next grouped (h div Hv/Hk). Nothing here
 *    reorders weights: what the converter did (§3.6: norm weights 1 + w, ssm_a = -exp(A_log))
 *    is in the file already.
 * 2. MTP blocks (the last nextn_predict_layers of block_count) are not model layers: they are
 *    listed last (for the seeded writer; the loader drops them) and neither run, cached, saved
 *    nor fingerprinted.
 * 3. The fingerprint tags ("qwen35 fingerprint 1", "qwen3next fingerprint 1") and their
 *    parameter order never change.
 */
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_arch_int.h"

typedef struct qn_arch {
    const char *name;
    int grouped; /* the head mapping: 0 tiled (qwen35*), 1 grouped (qwen3next) */
    int moe;     /* the feed-forward: 0 SwiGLU, 1 experts */
} qn_arch;

static const qn_arch k_qwen35 = {"qwen35", 0, 0};
static const qn_arch k_qwen35moe = {"qwen35moe", 0, 1};
static const qn_arch k_qwen3next = {"qwen3next", 1, 1};

/* ---- presets ------------------------------------------------------------------------------ */
typedef struct qn_preset {
    const char *arch, *name;
    uint32_t E, layers, interval, ff, ctx, vocab, hq, hkv, D, rot, hk, hv, dk, tied, wtype;
    uint32_t X, k, fe, fs, legacy;
    float base;
} qn_preset;

/* The published shapes (ARCHITECTURES.md §7; the MoE ones with fewer experts would not be the
 * shape) and test shapes with Hk != Hv. */
static const qn_preset k_presets[] = {
    {"qwen35", "tiny", 64, 4, 4, 128, 2048, 512, 4, 2, 32, 16, 2, 4, 16, 0, ST_GGML_F32,
     0, 0, 0, 0, 0, 1e7f},
    {"qwen35", "tiny-tied", 64, 4, 4, 128, 2048, 512, 4, 2, 32, 16, 2, 4, 16, 1, ST_GGML_F32,
     0, 0, 0, 0, 0, 1e7f},
    /* quantized tests: every row length a multiple of 256, so the K-quants are used as such */
    {"qwen35", "tiny-q", 256, 4, 4, 256, 2048, 512, 4, 2, 64, 16, 2, 4, 64, 0, ST_GGML_F32,
     0, 0, 0, 0, 0, 1e7f},
    {"qwen35", "small", 256, 8, 4, 768, 32768, 4096, 4, 2, 64, 32, 2, 6, 32, 0, ST_GGML_F16,
     0, 0, 0, 0, 0, 1e7f},
    {"qwen35", "0.8b", 1024, 24, 4, 3584, 262144, 248320, 8, 2, 256, 64, 16, 16, 128, 1,
     ST_GGML_BF16, 0, 0, 0, 0, 0, 1e7f},
    {"qwen35", "2b", 2048, 24, 4, 6144, 262144, 248320, 8, 2, 256, 64, 16, 16, 128, 1,
     ST_GGML_BF16, 0, 0, 0, 0, 0, 1e7f},
    {"qwen35", "9b", 4096, 32, 4, 12288, 262144, 248320, 16, 4, 256, 64, 16, 32, 128, 0,
     ST_GGML_BF16, 0, 0, 0, 0, 0, 1e7f},
    {"qwen35moe", "tiny", 64, 4, 4, 128, 2048, 512, 4, 2, 32, 16, 2, 4, 16, 0, ST_GGML_F32,
     8, 2, 32, 48, 0, 1e7f},
    {"qwen35moe", "tiny-q", 256, 2, 2, 256, 2048, 512, 4, 2, 64, 16, 2, 4, 64, 0, ST_GGML_F32,
     4, 2, 256, 256, 0, 1e7f},
    {"qwen35moe", "35b-a3b", 2048, 40, 4, 512, 262144, 248320, 16, 2, 256, 64, 16, 32, 128, 0,
     ST_GGML_BF16, 256, 8, 512, 512, 0, 1e7f},
    {"qwen3next", "tiny", 64, 4, 4, 128, 2048, 512, 4, 2, 32, 16, 2, 4, 16, 0, ST_GGML_F32,
     8, 2, 32, 48, 0, 1e7f},
    {"qwen3next", "tiny-legacy", 64, 4, 4, 128, 2048, 512, 4, 2, 32, 16, 2, 4, 16, 0,
     ST_GGML_F32, 8, 2, 32, 48, 1, 1e7f},
    {"qwen3next", "tiny-q", 256, 2, 2, 256, 2048, 512, 4, 2, 64, 16, 2, 4, 64, 0, ST_GGML_F32,
     4, 2, 256, 256, 0, 1e7f},
    {"qwen3next", "80b-a3b", 2048, 48, 4, 512, 262144, 151936, 16, 2, 256, 64, 16, 32, 128, 0,
     ST_GGML_BF16, 512, 10, 512, 512, 0, 1e7f},
};

static int qn_preset_fill(const qn_arch *a, const char *name, st_model_hparams *hp)
{
    size_t al = strlen(a->name);
    const char *p = name && !strncmp(name, a->name, al) && name[al] == '-' ? name + al + 1 : name;
    char names[256] = "";
    for (size_t i = 0; i < sizeof k_presets / sizeof k_presets[0]; i++) {
        const qn_preset *q = &k_presets[i];
        if (strcmp(q->arch, a->name))
            continue;
        size_t nl = strlen(names);
        snprintf(names + nl, sizeof names - nl, "%s%s-%s", nl ? ", " : "", a->name, q->name);
        if (!p || strcmp(p, q->name))
            continue;
        memset(hp, 0, sizeof *hp);
        snprintf(hp->arch, sizeof hp->arch, "%s", a->name);
        hp->n_embd = q->E;
        hp->n_layer = q->layers;
        hp->n_ff = q->ff;
        hp->n_ctx = q->ctx;
        hp->n_vocab = q->vocab;
        hp->n_head = q->hq;
        hp->n_head_kv = q->hkv;
        hp->head_dim = q->D;
        hp->n_rot = q->rot;
        hp->ssm_groups = q->hk;
        hp->ssm_heads = q->hv;
        hp->ssm_dk = hp->ssm_dv = q->dk;
        hp->ssm_conv = 4;
        hp->tied = q->tied;
        hp->wtype = q->wtype;
        hp->n_expert = q->X;
        hp->n_expert_used = q->k;
        hp->n_ff_exp = q->fe;
        hp->n_ff_shexp = q->fs;
        hp->ssm_in = q->legacy;
        hp->rms_eps = 1e-6f;
        hp->rope_base = q->base;
        hp->kv_dtype = ST_DTYPE_F16;
        /* M-RoPE sections [t, h, w, e] over the rotated pairs, as real files spell [11,11,10,0] */
        uint32_t half = q->rot / 2;
        hp->rope_sections[0] = (int32_t)(half - 2 * (half / 3));
        hp->rope_sections[1] = (int32_t)(half / 3);
        hp->rope_sections[2] = (int32_t)(half / 3);
        for (uint32_t j = 0; j + 1 < q->interval; j++)
            hp->pattern[j] = 'D';
        hp->pattern[q->interval - 1] = 'A';
        return 0;
    }
    return st_error_set(ST_EINVAL, "unknown %s preset \"%s\" (%s)", a->name, name ? name : "",
                        names);
}

/* ---- checks and keys -------------------------------------------------------------------- */
static int qn_check(const st_model_hparams *hp)
{
    size_t plen = strnlen(hp->pattern, ST_PATTERN_MAX);
    if (hp->n_layer < 1 || hp->n_layer > 1024)
        return st_error_set(ST_EINVAL, "model: %u layers (1..1024)", hp->n_layer);
    if (hp->n_nextn > 16)
        return st_error_set(ST_EINVAL, "model: %u MTP blocks (nextn_predict_layers 0..16)",
                            hp->n_nextn);
    if (plen < 1 || plen >= ST_PATTERN_MAX || hp->pattern[plen - 1] != 'A')
        return st_error_set(ST_EINVAL, "model: full_attention_interval %zu (1..%d)", plen,
                            ST_PATTERN_MAX - 1);
    if (hp->n_vocab < 1 || hp->n_vocab > (1u << 20))
        return st_error_set(ST_EINVAL, "model: vocabulary of %u tokens (1..%u)", hp->n_vocab,
                            1u << 20);
    if (hp->n_embd < 1 || hp->n_embd > 65536 || hp->n_ff < 1 || hp->n_ff > 262144)
        return st_error_set(ST_EINVAL, "model: embedding %u / feed-forward %u out of range",
                            hp->n_embd, hp->n_ff);
    if (hp->n_ctx < 1 || hp->n_ctx > (1u << 24))
        return st_error_set(ST_EINVAL, "model: context_length %u (1..%u)", hp->n_ctx, 1u << 24);
    if (hp->n_head < 1 || hp->n_head > 1024 || hp->n_head_kv < 1 || hp->n_head % hp->n_head_kv)
        return st_error_set(ST_EINVAL, "model: head_count %u / head_count_kv %u (kv must divide "
                            "heads)", hp->n_head, hp->n_head_kv);
    if (hp->head_dim < 2 || hp->head_dim > 4096)
        return st_error_set(ST_EINVAL, "model: attention head width %u (2..4096)", hp->head_dim);
    if (hp->n_rot < 2 || hp->n_rot > hp->head_dim || hp->n_rot % 2)
        return st_error_set(ST_EINVAL, "model: rope.dimension_count %u (even, 2..%u)", hp->n_rot,
                            hp->head_dim);
    if (!(hp->rope_base > 1.0f) || !isfinite(hp->rope_base))
        return st_error_set(ST_EINVAL, "model: rope.freq_base %g", (double)hp->rope_base);
    if (hp->ssm_groups < 1 || hp->ssm_heads < 1 || hp->ssm_heads > 1024 ||
        hp->ssm_heads % hp->ssm_groups)
        return st_error_set(ST_EINVAL, "model: ssm.group_count %u / ssm.time_step_rank %u (key "
                            "heads must divide value heads)", hp->ssm_groups, hp->ssm_heads);
    if (hp->ssm_dk < 1 || hp->ssm_dk > 4096 || hp->ssm_dv != hp->ssm_dk)
        return st_error_set(ST_EINVAL, "model: ssm.state_size %u, value width %u (equal, "
                            "1..4096)", hp->ssm_dk, hp->ssm_dv);
    if (hp->ssm_conv != 4)
        return st_error_set(ST_EINVAL, "model: ssm.conv_kernel %u (only 4 is supported)",
                            hp->ssm_conv);
    if (!(hp->rms_eps > 0.0f) || !(hp->rms_eps < 1.0f))
        return st_error_set(ST_EINVAL, "model: layer_norm_rms_epsilon %g", (double)hp->rms_eps);
    if (hp->kv_dtype != ST_DTYPE_F16 && hp->kv_dtype != ST_DTYPE_I8)
        return st_error_set(ST_EINVAL, "model: K/V dtype %s (f16 or i8)",
                            st_dtype_name(hp->kv_dtype));
    if (hp->n_expert && (hp->n_expert > 4096 || hp->n_expert_used < 1 ||
                         hp->n_expert_used > hp->n_expert || hp->n_ff_exp < 1 ||
                         hp->n_ff_exp > 65536 || hp->n_ff_shexp < 1 || hp->n_ff_shexp > 65536))
        return st_error_set(ST_EINVAL, "model: %u experts, %u used, widths %u / %u out of range",
                            hp->n_expert, hp->n_expert_used, hp->n_ff_exp, hp->n_ff_shexp);
    return 0;
}

static int qn_check_arch(const qn_arch *a, const st_model_hparams *hp)
{
    if (a->moe != (hp->n_expert > 0))
        return st_error_set(ST_EINVAL, "model: %s %s experts (expert_count %u)", a->name,
                            a->moe ? "needs" : "has no", hp->n_expert);
    if (hp->ssm_in && !a->grouped)
        return st_error_set(ST_EINVAL, "model: %s has no ssm_in layout", a->name);
    return qn_check(hp);
}

static int get_u32(const st_gguf *g, const char *key, uint32_t *v)
{
    int rc = st_gguf_get_u32(g, key, v);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_EINVAL, "model: key %s missing", key);
    return rc;
}

/* An optional u32 key: *v keeps its default when absent. */
static int opt_u32(const st_gguf *g, const char *key, uint32_t *v)
{
    int rc = st_gguf_get_u32(g, key, v);
    return rc == ST_ENOTFOUND ? 0 : rc;
}

static int opt_f32(const st_gguf *g, const char *key, float *v)
{
    int rc = st_gguf_get_f32(g, key, v);
    return rc == ST_ENOTFOUND ? 0 : rc;
}

static int qn_read(const qn_arch *a, const st_gguf *g, st_model_hparams *hp)
{
    char k[128];
    uint32_t blocks = 0, kl = 0, vl = 0, inner = 0, interval = 4, et = 0;
    uint64_t cnt = 0;
    int64_t ki;
    int rc;
    memset(hp, 0, sizeof *hp);
    snprintf(hp->arch, sizeof hp->arch, "%s", a->name);
#define K(s) (snprintf(k, sizeof k, "%s." s, a->name), k)
    if ((rc = get_u32(g, K("block_count"), &blocks)) ||
        (rc = get_u32(g, K("context_length"), &hp->n_ctx)) ||
        (rc = get_u32(g, K("embedding_length"), &hp->n_embd)) ||
        (rc = get_u32(g, K("attention.head_count"), &hp->n_head)) ||
        (rc = get_u32(g, K("ssm.conv_kernel"), &hp->ssm_conv)) ||
        (rc = get_u32(g, K("ssm.state_size"), &hp->ssm_dk)) ||
        (rc = get_u32(g, K("ssm.group_count"), &hp->ssm_groups)) ||
        (rc = get_u32(g, K("ssm.time_step_rank"), &hp->ssm_heads)) ||
        (rc = get_u32(g, K("ssm.inner_size"), &inner)) ||
        (rc = opt_u32(g, K("nextn_predict_layers"), &hp->n_nextn)) ||
        (rc = opt_u32(g, K("full_attention_interval"), &interval)))
        return rc;
    if ((rc = st_gguf_get_f32(g, K("attention.layer_norm_rms_epsilon"), &hp->rms_eps)))
        return rc == ST_ENOTFOUND ? st_error_set(ST_EINVAL, "model: key %s missing", k) : rc;
    rc = st_gguf_get_u32(g, K("feed_forward_length"), &hp->n_ff);
    if (rc && !(rc == ST_ENOTFOUND && a->moe))
        return st_error_set(ST_EINVAL, "model: key %s: %s (one u32 is supported)", k,
                            rc == ST_ENOTFOUND ? "missing" : "not a u32");
    hp->n_head_kv = hp->n_head;
    if ((rc = opt_u32(g, K("attention.head_count_kv"), &hp->n_head_kv)))
        return rc;
    kl = vl = hp->n_head ? hp->n_embd / hp->n_head : 0;
    if ((rc = opt_u32(g, K("attention.key_length"), &kl)) ||
        (rc = opt_u32(g, K("attention.value_length"), &vl)))
        return rc;
    if (kl != vl)
        return st_error_set(ST_EINVAL, "model: attention key_length %u != value_length %u", kl, vl);
    hp->head_dim = hp->n_rot = kl;
    hp->rope_base = 10000.0f;
    if ((rc = opt_u32(g, K("rope.dimension_count"), &hp->n_rot)) ||
        (rc = opt_f32(g, K("rope.freq_base"), &hp->rope_base)))
        return rc;
    /* RoPE scaling: only the identity (no key, "none", or linear with factor 1) */
    const char *s;
    uint64_t n;
    float factor = 0.0f;
    if ((rc = opt_f32(g, K("rope.scaling.factor"), &factor)))
        return rc;
    if (st_gguf_get_str(g, K("rope.scaling.type"), &s, &n) == 0 &&
        !(n == 4 && !memcmp(s, "none", 4)) && !(n == 6 && !memcmp(s, "linear", 6)))
        return st_error_set(ST_EINVAL, "model: %s \"%.*s\" is not supported (none or linear "
                            "with factor 1)", k, (int)(n > 16 ? 16 : n), s);
    if (factor != 0.0f && factor != 1.0f)
        return st_error_set(ST_EINVAL, "model: %s.rope.scaling.factor %g is not supported (1)",
                            a->name, (double)factor);
    if (!a->grouped) {
        /* text positions write the same p into every M-RoPE stream: IMROPE is NEOX on n_rot */
        ki = st_gguf_find(g, K("rope.dimension_sections"));
        if (ki < 0)
            return st_error_set(ST_EINVAL, "model: key %s missing", k);
        if (st_gguf_kv_type(g, (uint64_t)ki, &et, &cnt) != ST_GGUF_ARRAY || cnt != 4 ||
            (et != ST_GGUF_INT32 && et != ST_GGUF_UINT32))
            return st_error_set(ST_EINVAL, "model: %s is not an array of 4 integers", k);
    }
    if (st_gguf_find(g, K("attention.recurrent_layers")) >= 0)
        return st_error_set(ST_EINVAL, "model: key %s is not supported (the layer kinds come "
                            "from full_attention_interval)", k);
    if (a->moe) {
        if ((rc = get_u32(g, K("expert_count"), &hp->n_expert)) ||
            (rc = get_u32(g, K("expert_used_count"), &hp->n_expert_used)))
            return rc;
        /* fallbacks of llama.cpp: n_ff / k for an expert, n_ff for the shared one */
        hp->n_ff_exp = hp->n_expert_used ? hp->n_ff / hp->n_expert_used : 0;
        hp->n_ff_shexp = hp->n_ff;
        if ((rc = opt_u32(g, K("expert_feed_forward_length"), &hp->n_ff_exp)) ||
            (rc = opt_u32(g, K("expert_shared_feed_forward_length"), &hp->n_ff_shexp)))
            return rc;
        if (st_gguf_tensor_find(g, "blk.0.ffn_gate_up_exps.weight"))
            return st_error_set(ST_EINVAL, "model: tensor blk.0.ffn_gate_up_exps.weight (merged "
                                "experts) is not supported");
    } else if (st_gguf_find(g, K("expert_count")) >= 0) {
        return st_error_set(ST_EINVAL, "model: %s with %s (experts: that is qwen35moe)", a->name,
                            k);
    }
#undef K
    if (hp->n_nextn >= blocks)
        return st_error_set(ST_EINVAL, "model: block_count %u with %u MTP blocks", blocks,
                            hp->n_nextn);
    hp->n_layer = blocks - hp->n_nextn;
    if (interval < 1 || interval >= ST_PATTERN_MAX)
        return st_error_set(ST_EINVAL, "model: full_attention_interval %u (1..%d)", interval,
                            ST_PATTERN_MAX - 1);
    for (uint32_t j = 0; j + 1 < interval; j++)
        hp->pattern[j] = 'D';
    hp->pattern[interval - 1] = 'A';
    hp->ssm_dv = hp->ssm_heads ? inner / hp->ssm_heads : 0;
    if (hp->ssm_heads && inner != hp->ssm_dv * hp->ssm_heads)
        return st_error_set(ST_EINVAL, "model: ssm.inner_size %u is not a multiple of "
                            "ssm.time_step_rank %u", inner, hp->ssm_heads);
    ki = st_gguf_find(g, "tokenizer.ggml.tokens");
    if (ki < 0 || st_gguf_kv_type(g, (uint64_t)ki, &et, &cnt) != ST_GGUF_ARRAY ||
        et != ST_GGUF_STRING || cnt > UINT32_MAX)
        return st_error_set(ST_EINVAL, "model: tokenizer.ggml.tokens missing or not an array of "
                            "strings (the vocabulary's size)");
    hp->n_vocab = (uint32_t)cnt;
    hp->tied = st_gguf_tensor_find(g, "output.weight") == NULL;
    hp->ssm_in = st_gguf_tensor_find(g, "blk.0.ssm_in.weight") != NULL;
    hp->kv_dtype = ST_DTYPE_F16;
    if (a->moe && !hp->n_ff)
        hp->n_ff = hp->n_ff_shexp; /* unused by the experts; keeps the range check honest */
    return qn_check_arch(a, hp);
}


/* GPT-2's byte-level alphabet: byte b as the UTF-8 of its code point. */
static void byte_token(uint32_t b, char out[4])
{
    uint32_t cp = b;
    if (!((b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff))) {
        uint32_t n = 0;
        for (uint32_t c = 0; c < b; c++)
            if (!((c >= 0x21 && c <= 0x7e) || (c >= 0xa1 && c <= 0xac) || (c >= 0xae && c <= 0xff)))
                n++;
        cp = 256 + n;
    }
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = 0;
    } else {
        out[0] = (char)(0xc0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3f));
        out[2] = 0;
    }
}

/* The tokenizer keys a seeded model carries for llama.cpp's loader (the engine does not
 * tokenize these models): the 256 byte tokens, a few merges and their tokens, the chat special
 * tokens, then padding to n_vocab. */
static int qn_write_tokenizer(st_gguf_writer *w, const st_model_hparams *hp, const char *pre)
{
    static const char *const merges[] = {"Ġ t", "h e", "i n", "t h", "a n", "e r"};
    static const char *const merged[] = {"Ġt", "he", "in", "th", "an", "er"};
    static const char *const special[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    uint32_t V = hp->n_vocab, nm = 6, ns = 3, base = 256;
    if (V < base + nm + ns)
        return st_error_set(ST_EINVAL, "model: a vocabulary of %u tokens (at least %u for the "
                            "byte-level tokenizer)", V, base + nm + ns);
    char **tok = calloc(V, sizeof *tok);
    int32_t *type = calloc(V, sizeof *type);
    int rc = 0;
    if (!tok || !type) {
        rc = st_error_set(ENOMEM, "model writer: vocabulary");
        goto done;
    }
    for (uint32_t i = 0; i < V && !rc; i++) {
        char buf[32];
        if (i < base)
            byte_token(i, buf);
        else if (i < base + nm)
            snprintf(buf, sizeof buf, "%s", merged[i - base]);
        else if (i < base + nm + ns)
            snprintf(buf, sizeof buf, "%s", special[i - base - nm]);
        else
            snprintf(buf, sizeof buf, "[PAD%u]", i);
        type[i] = i >= base + nm && i < base + nm + ns ? 3 : i >= base + nm + ns ? 5 : 1;
        if (!(tok[i] = strdup(buf)))
            rc = st_error_set(ENOMEM, "model writer: vocabulary");
    }
    if (rc)
        goto done;
    st_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    st_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.tokens", (const char *const *)tok, V);
    st_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", ST_GGUF_INT32, type, V);
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.merges", merges, nm);
    st_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", base + nm);
    st_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", base + nm + 2);
    st_gguf_writer_set_u32(w, "tokenizer.ggml.padding_token_id", base + nm);
    rc = st_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", 0);
done:
    for (uint32_t i = 0; tok && i < V; i++)
        free(tok[i]);
    free(tok);
    free(type);
    return rc;
}

static int qn_write_keys(const qn_arch *a, st_gguf_writer *w, const st_model_hparams *hp)
{
    char k[128];
#define K(s) (snprintf(k, sizeof k, "%s." s, a->name), k)
    st_gguf_writer_set_u32(w, K("block_count"), hp->n_layer + hp->n_nextn);
    if (hp->n_nextn)
        st_gguf_writer_set_u32(w, K("nextn_predict_layers"), hp->n_nextn);
    st_gguf_writer_set_u32(w, K("context_length"), hp->n_ctx);
    st_gguf_writer_set_u32(w, K("embedding_length"), hp->n_embd);
    st_gguf_writer_set_u32(w, K("feed_forward_length"), hp->n_ff);
    st_gguf_writer_set_u32(w, K("attention.head_count"), hp->n_head);
    st_gguf_writer_set_u32(w, K("attention.head_count_kv"), hp->n_head_kv);
    st_gguf_writer_set_u32(w, K("attention.key_length"), hp->head_dim);
    st_gguf_writer_set_u32(w, K("attention.value_length"), hp->head_dim);
    st_gguf_writer_set_f32(w, K("attention.layer_norm_rms_epsilon"), hp->rms_eps);
    st_gguf_writer_set_u32(w, K("rope.dimension_count"), hp->n_rot);
    st_gguf_writer_set_f32(w, K("rope.freq_base"), hp->rope_base);
    if (!a->grouped)
        st_gguf_writer_set_arr(w, K("rope.dimension_sections"), ST_GGUF_INT32, hp->rope_sections,
                               4);
    st_gguf_writer_set_u32(w, K("ssm.conv_kernel"), hp->ssm_conv);
    st_gguf_writer_set_u32(w, K("ssm.state_size"), hp->ssm_dk);
    st_gguf_writer_set_u32(w, K("ssm.group_count"), hp->ssm_groups);
    st_gguf_writer_set_u32(w, K("ssm.time_step_rank"), hp->ssm_heads);
    st_gguf_writer_set_u32(w, K("ssm.inner_size"), hp->ssm_heads * hp->ssm_dv);
    st_gguf_writer_set_u32(w, K("full_attention_interval"),
                           (uint32_t)strnlen(hp->pattern, ST_PATTERN_MAX));
    if (a->moe) {
        st_gguf_writer_set_u32(w, K("expert_count"), hp->n_expert);
        st_gguf_writer_set_u32(w, K("expert_used_count"), hp->n_expert_used);
        st_gguf_writer_set_u32(w, K("expert_feed_forward_length"), hp->n_ff_exp);
        st_gguf_writer_set_u32(w, K("expert_shared_feed_forward_length"), hp->n_ff_shexp);
    }
#undef K
    return qn_write_tokenizer(w, hp, a->grouped ? "qwen2" : "qwen35");
}


/* ---- tensors and memory ------------------------------------------------------------------ */
#define LF(f) (uint32_t) offsetof(st_layer, f)
#define MF(f) (uint32_t) offsetof(st_model, f)

/* Block u's tensors: a layer of kind 'A' or 'D', or (u >= n_layer) an MTP block: a
 * full-attention block with its FFN and the nextn projections (§2.2), listed for the writer. */
static void qn_block(const qn_arch *a, const st_model_hparams *hp, st_tlist *l, uint32_t u,
                     char kind)
{
    uint64_t E = hp->n_embd, F = hp->n_ff, D = hp->head_dim;
    uint64_t Hq = hp->n_head, Hkv = hp->n_head_kv, Hk = hp->ssm_groups, Hv = hp->ssm_heads;
    uint64_t dk = hp->ssm_dk, dv = hp->ssm_dv, kd = Hk * dk, vd = Hv * dv, R = Hv / Hk;
    int32_t il = (int32_t)u;
    st_tlist_add(l, il, LF(attn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.attn_norm.weight", u);
    if (kind == 'A') {
        st_tlist_add(l, il, LF(wq), 1, ST_TI_MAT, E, 2 * D * Hq, "blk.%u.attn_q.weight", u);
        st_tlist_add(l, il, LF(wk), 1, ST_TI_MAT, E, D * Hkv, "blk.%u.attn_k.weight", u);
        st_tlist_add(l, il, LF(wv), 1, ST_TI_MAT, E, D * Hkv, "blk.%u.attn_v.weight", u);
        st_tlist_add(l, il, LF(wo), 1, ST_TI_MAT_OUT, D * Hq, E, "blk.%u.attn_output.weight",
                     u);
        st_tlist_add(l, il, LF(q_norm), 0, ST_TI_NORM, D, 0, "blk.%u.attn_q_norm.weight", u);
        st_tlist_add(l, il, LF(k_norm), 0, ST_TI_NORM, D, 0, "blk.%u.attn_k_norm.weight", u);
    } else {
        if (hp->ssm_in) {
            st_tlist_add(l, il, LF(sin), 1, ST_TI_MAT, E, Hk * (2 * dk + 2 * R * dv),
                         "blk.%u.ssm_in.weight", u);
        } else {
            st_tlist_add(l, il, LF(sqkv), 1, ST_TI_MAT, E, 2 * kd + vd,
                         "blk.%u.attn_qkv.weight", u);
            st_tlist_add(l, il, LF(sgate), 1, ST_TI_MAT, E, vd, "blk.%u.attn_gate.weight", u);
        }
        st_tlist_add(l, il, LF(conv_w), 0, ST_TI_CONV, hp->ssm_conv, 2 * kd + vd,
                     "blk.%u.ssm_conv1d.weight", u);
        st_tlist_add(l, il, LF(dt_bias), 0, ST_TI_DTBIAS, Hv, 0, "blk.%u.ssm_dt.bias", u);
        st_tlist_add(l, il, LF(ssm_a), 0, ST_TI_SSM_A, Hv, 0, "blk.%u.ssm_a", u);
        if (a->grouped) {
            st_tlist_add(l, il, LF(sba), 1, ST_TI_MAT, E, 2 * Hv, "blk.%u.ssm_ba.weight", u);
        } else {
            st_tlist_add(l, il, LF(sbeta), 1, ST_TI_MAT, E, Hv, "blk.%u.ssm_beta.weight", u);
            st_tlist_add(l, il, LF(salpha), 1, ST_TI_MAT, E, Hv, "blk.%u.ssm_alpha.weight", u);
        }
        st_tlist_add(l, il, LF(ssm_norm), 0, ST_TI_NORM, dv, 0, "blk.%u.ssm_norm.weight", u);
        st_tlist_add(l, il, LF(sout), 1, ST_TI_MAT_OUT, vd, E, "blk.%u.ssm_out.weight", u);
    }
    st_tlist_add(l, il, LF(ffn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.post_attention_norm.weight",
                 u);
    if (a->moe) {
        uint64_t X = hp->n_expert, Fe = hp->n_ff_exp, Fs = hp->n_ff_shexp;
        st_tlist_add(l, il, LF(moe_router), 1, ST_TI_MAT_F32, E, X,
                     "blk.%u.ffn_gate_inp.weight", u);
        st_tlist_add3(l, il, LF(moe_gate), ST_TI_MAT, E, Fe, X, "blk.%u.ffn_gate_exps.weight",
                      u);
        st_tlist_add3(l, il, LF(moe_up), ST_TI_MAT, E, Fe, X, "blk.%u.ffn_up_exps.weight", u);
        st_tlist_add3(l, il, LF(moe_down), ST_TI_MAT_OUT, Fe, E, X,
                      "blk.%u.ffn_down_exps.weight", u);
        st_tlist_add(l, il, LF(sh_router), 1, ST_TI_MAT_F32, E, 1,
                     "blk.%u.ffn_gate_inp_shexp.weight", u);
        st_tlist_add(l, il, LF(sh_gate), 1, ST_TI_MAT, E, Fs, "blk.%u.ffn_gate_shexp.weight",
                     u);
        st_tlist_add(l, il, LF(sh_up), 1, ST_TI_MAT, E, Fs, "blk.%u.ffn_up_shexp.weight", u);
        st_tlist_add(l, il, LF(sh_down), 1, ST_TI_MAT_OUT, Fs, E,
                     "blk.%u.ffn_down_shexp.weight", u);
    } else {
        st_tlist_add(l, il, LF(ffn_gate), 1, ST_TI_MAT, E, F, "blk.%u.ffn_gate.weight", u);
        st_tlist_add(l, il, LF(ffn_up), 1, ST_TI_MAT, E, F, "blk.%u.ffn_up.weight", u);
        st_tlist_add(l, il, LF(ffn_down), 1, ST_TI_MAT_OUT, F, E, "blk.%u.ffn_down.weight",
                     u);
    }
    if (u < hp->n_layer)
        return;
    /* never bound (the loader drops layers >= n_layer): the fields are the nearest alike */
    st_tlist_add(l, (int32_t)u, LF(wo), 1, ST_TI_MAT, 2 * E, E, "blk.%u.nextn.eh_proj.weight", u);
    st_tlist_add(l, (int32_t)u, LF(attn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.nextn.enorm.weight",
                 u);
    st_tlist_add(l, (int32_t)u, LF(ffn_norm), 0, ST_TI_NORM, E, 0, "blk.%u.nextn.hnorm.weight",
                 u);
}

static int qn_tensors(const qn_arch *a, const st_model_hparams *hp, st_tlist *l)
{
    uint64_t E = hp->n_embd, V = hp->n_vocab;
    memset(l, 0, sizeof *l);
    st_tlist_add(l, -1, MF(tok_embd), 1, ST_TI_EMB, E, V, "token_embd.weight");
    for (uint32_t u = 0; u < hp->n_layer; u++)
        qn_block(a, hp, l, u, st_model_layer_kind(hp, u));
    st_tlist_add(l, -1, MF(output_norm), 0, ST_TI_NORM, E, 0, "output_norm.weight");
    if (!hp->tied)
        st_tlist_add(l, -1, MF(output), 1, ST_TI_MAT, E, V, "output.weight");
    /* the MTP blocks last: the model's tensors keep their place (and seeds) without them */
    for (uint32_t u = hp->n_layer; u < hp->n_layer + hp->n_nextn; u++)
        qn_block(a, hp, l, u, 'A');
    return st_tlist_done(l);
}


/* Attention layers keep K/V; DeltaNet layers their matrix per value head and the convolution
 * history of the q, k (key heads) and v (value heads) channels. */
static void qn_memory(const st_model_hparams *hp, uint32_t il, st_mem_layer *ml)
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
    ml->conv_ch = 2 * hp->ssm_groups * hp->ssm_dk + hp->ssm_heads * hp->ssm_dv;
}

/* The MTP blocks are not part of the model that runs: their slot in the parameter order (it
 * was n_nextn, 0 for every file that loaded before MTP blocks were accepted) stays 0, so that a
 * file with MTP blocks and the same file without them have one fingerprint (their tensors are
 * not hashed either, st_model.c). */
static void qn_fingerprint(const qn_arch *a, const st_model_hparams *hp, st_fp *fp)
{
    char tag[64];
    int n = snprintf(tag, sizeof tag, "%s fingerprint 1", a->name);
    st_fp_bytes(fp, tag, (size_t)n + 1);
    const uint32_t u[] = {hp->n_vocab,   hp->n_embd,    hp->n_layer,  hp->n_ff,
                          hp->n_ctx,     hp->n_head,    hp->n_head_kv, hp->head_dim,
                          hp->n_rot,     hp->ssm_heads, hp->ssm_groups, hp->ssm_dk,
                          hp->ssm_dv,    hp->ssm_conv,  hp->kv_dtype,  0 /* see below */,
                          hp->tied,      hp->ssm_in,
                          (uint32_t)strnlen(hp->pattern, ST_PATTERN_MAX),
                          hp->n_expert,  hp->n_expert_used, hp->n_ff_exp, hp->n_ff_shexp};
    for (size_t i = 0; i < sizeof u / sizeof u[0]; i++)
        st_fp_u32(fp, u[i]);
    st_fp_f32(fp, hp->rms_eps);
    st_fp_f32(fp, hp->rope_base);
}


/* The convolution weights transposed ([4][C], what the kernel walks); a tied LM head. */
static int qn_prepare(st_model *m)
{
    const st_model_hparams *hp = &m->hp;
    uint32_t C = 2 * hp->ssm_groups * hp->ssm_dk + hp->ssm_heads * hp->ssm_dv, K = hp->ssm_conv;
    if (hp->tied)
        m->output = m->tok_embd;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        st_layer *L = &m->layers[il];
        if (L->kind != 'D')
            continue;
        if (!(L->conv_wT = malloc((size_t)K * C * sizeof *L->conv_wT)))
            return st_error_set(ENOMEM, "model: layer %u", il);
        for (uint32_t ch = 0; ch < C; ch++)
            for (uint32_t j = 0; j < K; j++)
                L->conv_wT[(size_t)j * C + ch] = L->conv_w[(size_t)ch * K + j];
    }
    return 0;
}

/* ---- the forward pass ------------------------------------------------------------------- */
typedef struct qn_ws {
    float *x, *xn, *out;           /* the residual stream, its normalised copy, a branch's output */
    float *qkv, *qkvc, *z, *ab, *o; /* DeltaNet */
    float *q, *gate, *kv, *ao;     /* attention */
    float *g, *u;                  /* feed-forward */
    float *rl, *rw, *y, *gs;       /* MoE: router logits, weights, an expert's output, gates */
    uint32_t *sel, *sel_h;         /* the MoE selection (backend memory), its host copy */
    st_wmat *xv;                   /* 3k views of one token's experts (st_fwd experts) */
    float *logit_in;
    double *rope_freq;             /* n_rot / 2 angles per position step, base^(-2i / n_rot) */
    st_mm *mm;
    st_wmat *views;
    int grouped;
    const st_ops *ops;             /* the backend whose memory these are */
    void *oc;
} qn_ws;

static void qn_fwd_free(void *wsp)
{
    qn_ws *w = wsp;
    if (!w)
        return;
    void *f[] = {w->x, w->xn, w->out, w->qkv, w->qkvc, w->z, w->ab, w->o,
                 w->q, w->gate, w->kv, w->ao, w->g, w->u, w->logit_in,
                 w->rl, w->rw, w->y, w->gs, w->sel, w->rope_freq};
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        st_ws_free(w->ops, w->oc, f[i]);
    free(w->sel_h);
    free(w->xv);
    free(w->mm);
    free(w->views);
    free(w);
}

static int qn_fwd_new(const qn_arch *a, const st_model *m, const st_ops *ops, void *oc,
                      uint32_t T, void **out)
{
    const st_model_hparams *hp = &m->hp;
    *out = NULL;
    qn_ws *w = calloc(1, sizeof *w);
    double *freq = calloc(hp->n_rot / 2 + 1, sizeof *freq);
    if (!w || !freq) {
        free(w);
        free(freq);
        return st_error_set(ENOMEM, "%s: workspace", a->name);
    }
    w->ops = ops;
    w->oc = oc;
#define falloc(n, err) st_ws_floats(ops, oc, (n), (err))
    uint64_t E = hp->n_embd, F = hp->n_ff;
    if (hp->n_ff_exp > F)
        F = hp->n_ff_exp;
    if (hp->n_ff_shexp > F)
        F = hp->n_ff_shexp;
    uint64_t X = hp->n_expert, K = hp->n_expert_used;
    uint64_t C = 2 * (uint64_t)hp->ssm_groups * hp->ssm_dk + (uint64_t)hp->ssm_heads * hp->ssm_dv;
    uint64_t vd = (uint64_t)hp->ssm_heads * hp->ssm_dv;
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    uint64_t nmm = 2 * (uint64_t)hp->n_head + 2;
    if (6 * (uint64_t)hp->ssm_groups + 4 > nmm)
        nmm = 6 * (uint64_t)hp->ssm_groups + 4;
    int err = 0;
    w->grouped = a->grouped;
    w->x = falloc(T * E, &err);
    w->xn = falloc(T * E, &err);
    w->out = falloc(T * E, &err);
    w->qkv = falloc(T * C, &err);
    w->qkvc = falloc(T * C, &err);
    w->z = falloc(T * vd, &err);
    w->o = falloc(T * vd, &err);
    w->ab = falloc(T * 2 * (uint64_t)hp->ssm_heads, &err);
    w->q = falloc(T * qa, &err);
    w->gate = falloc(T * qa, &err);
    w->ao = falloc(T * qa, &err);
    w->kv = falloc(T * 2 * kva, &err);
    w->g = falloc(T * F, &err);
    w->u = falloc(T * F, &err);
    w->logit_in = falloc(E, &err);
    w->rl = falloc(T * X, &err);
    w->rw = falloc(T * K, &err);
    w->y = falloc(E, &err);
    w->gs = falloc(T, &err);
#undef falloc
    w->sel = ops->mem_alloc(oc, (T * K + 1) * sizeof *w->sel);
    w->sel_h = calloc(T * K + 1, sizeof *w->sel_h);
    w->xv = calloc(3 * (size_t)K + 1, sizeof *w->xv);
    w->mm = calloc(nmm, sizeof *w->mm);
    w->views = calloc(nmm, sizeof *w->views);
    for (uint32_t i = 0; i < hp->n_rot / 2; i++)
        freq[i] = pow((double)hp->rope_base, -(double)(2 * i) / (double)hp->n_rot);
    w->rope_freq = st_ws_doubles(ops, oc, freq, hp->n_rot / 2, &err);
    free(freq);
    if (err || !w->mm || !w->views || !w->sel || !w->sel_h || !w->xv) {
        qn_fwd_free(w);
        return st_error_set(ENOMEM, "%s: workspace for a chunk of %u tokens", a->name, T);
    }
    *out = w;
    return 0;
}


/* x = embedding; per layer x += mixer(RMSNorm(x)), x += SwiGLU(RMSNorm(x)); the logits of the
 * last token from RMSNorm(x). */
static void qn_forward(const st_fwd *f, void *wsp)
{
    qn_ws *w = wsp;
    const st_model *m = f->m;
    const st_gdnf_ws gdn = {w->qkv, w->qkvc, w->z, w->ab, w->o, m->hp.ssm_groups, w->grouped,
                            w->mm, w->views};
    const st_gattn_ws attn = {w->q, w->gate, w->kv, w->ao, w->rope_freq, m->hp.n_rot, w->mm,
                              w->views};
    const st_moe_ws moe = {w->rl, w->rw, w->g, w->u, w->y, w->gs, w->sel, w->sel_h,
                           m->hp.n_expert_used, w->xv};
    st_layer_embed(f, &m->tok_embd, w->x);
    for (uint32_t il = 0; il < m->hp.n_layer; il++) {
        const st_layer *L = &m->layers[il];
        st_layer_norm(f, w->x, il > 0 ? w->out : NULL, L->attn_norm, w->xn);
        if (L->kind == 'D')
            st_layer_gdn_fused(f, il, w->xn, w->out, &gdn);
        else
            st_layer_gated_attention(f, il, w->xn, w->out, &attn);
        st_layer_norm(f, w->x, w->out, L->ffn_norm, w->xn);
        if (m->hp.n_expert)
            st_layer_moe(f, il, w->xn, w->out, &moe);
        else
            st_layer_swiglu(f, &L->ffn_gate, &L->ffn_up, &L->ffn_down, w->xn, w->out, w->g,
                            w->u);
    }
    if (f->logits)
        st_layer_logits(f, w->x, w->out, m->output_norm, &m->output, w->logit_in);
}

/* The descriptors: one set of functions, the variant bound per architecture. */
#define QN_ARCH(id, var)                                                                         \
    static int id##_preset(const char *name, st_model_hparams *hp)                              \
    {                                                                                            \
        return qn_preset_fill(&var, name, hp);                                                   \
    }                                                                                            \
    static int id##_check(const st_model_hparams *hp) { return qn_check_arch(&var, hp); }        \
    static int id##_read(const st_gguf *g, st_model_hparams *hp) { return qn_read(&var, g, hp); } \
    static int id##_write_keys(st_gguf_writer *w, const st_model_hparams *hp)                   \
    {                                                                                            \
        return qn_write_keys(&var, w, hp);                                                       \
    }                                                                                            \
    static int id##_tensors(const st_model_hparams *hp, st_tlist *l)                            \
    {                                                                                            \
        return qn_tensors(&var, hp, l);                                                          \
    }                                                                                            \
    static void id##_fingerprint(const st_model_hparams *hp, st_fp *fp)                         \
    {                                                                                            \
        qn_fingerprint(&var, hp, fp);                                                            \
    }                                                                                            \
    static int id##_fwd_new(const st_model *m, const st_ops *ops, void *oc, uint32_t T,         \
                            void **out)                                                          \
    {                                                                                            \
        return qn_fwd_new(&var, m, ops, oc, T, out);                                             \
    }                                                                                            \
    const st_arch st_arch_##id = {                                                               \
        .name = #id,                                                                             \
        .preset = id##_preset,                                                                   \
        .check = id##_check,                                                                     \
        .read = id##_read,                                                                       \
        .write_keys = id##_write_keys,                                                           \
        .tensors = id##_tensors,                                                                 \
        .memory = qn_memory,                                                                     \
        .fingerprint = id##_fingerprint,                                                         \
        .prepare = qn_prepare,                                                                   \
        .fwd_new = id##_fwd_new,                                                                 \
        .fwd_free = qn_fwd_free,                                                                 \
        .forward = qn_forward,                                                                   \
    };

QN_ARCH(qwen35, k_qwen35)
QN_ARCH(qwen35moe, k_qwen35moe)
QN_ARCH(qwen3next, k_qwen3next)
