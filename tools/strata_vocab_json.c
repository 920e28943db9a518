/*
 * strata_vocab_json.c - a Hugging Face tokenizer.json (+ tokenizer_config.json) as the GGUF
 * vocabulary keys llama.cpp's convert_hf_to_gguf.py writes for a byte-level BPE (its
 * _set_vocab_gpt2 / get_vocab_base and gguf.SpecialVocab), for strata-mkmodel --vocab-from.
 *
 * - tokens: id -> text for 0 .. max id (model.vocab and added_tokens); an id with neither is
 *   "[PADn]", type UNUSED. An added token is CONTROL when special or when it looks special
 *   (<|...|>, as the converter judges), USER_DEFINED otherwise; the others NORMAL.
 * - merges: model.merges, either "a b" strings or [a, b] pairs, written as "a b".
 * - pre: told from the Split regex of the pre-tokenizer (the three this engine runs), or given.
 * - bos / eos / unk / pad ids: tokenizer_config.json's *_token (a string or {content}) looked up
 *   among the tokens; add_bos_token / add_eos_token where the config sets them; the chat
 *   template (a string, or a list of {name, template}: "default" and tokenizer.chat_template.NAME).
 * - A normalizer of type NFC (the Qwen tokenizers) is recorded as tokenizer.strata.normalizer =
 *   "nfc": llama.cpp ignores the key (and does not normalize), st_vocab.c applies NFC to text
 *   fragments as the published tokenizer does (docs/MODELS.md, "Tokenizer").
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <jansson.h>

#include "st_engine.h"
#include "strata_vocab_json.h"

static const struct {
    const char *regex, *pre;
} k_regex[] = {
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+"
     "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+", "qwen2"},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+"
     "[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+", "llama-bpe"},
    {"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}"
     "\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+", "qwen35"},
};

#include <stdarg.h>

static int err(char *e, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int err(char *e, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e, cap, fmt, ap);
    va_end(ap);
    return -1;
}

/* The Split regex of a pre_tokenizer (itself or inside a Sequence), or NULL. */
static const char *split_regex(const json_t *pt)
{
    if (!json_is_object(pt))
        return NULL;
    const char *type = json_string_value(json_object_get(pt, "type"));
    if (type && !strcmp(type, "Split"))
        return json_string_value(json_object_get(json_object_get(pt, "pattern"), "Regex"));
    const json_t *seq = json_object_get(pt, "pretokenizers");
    size_t i;
    json_t *x;
    json_array_foreach(seq, i, x) {
        const char *r = split_regex(x);
        if (r)
            return r;
    }
    return NULL;
}

static int looks_special(const char *t)
{
    size_t n = strlen(t);
    if (!strcmp(t, "<pad>") || !strcmp(t, "<mask>") || !strcmp(t, "<2mass>") ||
        !strcmp(t, "[@BOS@]"))
        return 1;
    if (n >= 4 && !strncmp(t, "<|", 2) && !strcmp(t + n - 2, "|>"))
        return 1;
    if (n >= 7 && !strncmp(t, "<unused", 7) && t[n - 1] == '>')
        return 1;
    return 0;
}

/* A config's token value: a string or {"content": ...}. */
static const char *tok_value(const json_t *v)
{
    if (json_is_string(v))
        return json_string_value(v);
    return json_string_value(json_object_get(v, "content"));
}

int strata_vocab_json(const char *tok_path, const char *cfg_path, const char *pre_override,
                      st_gguf_writer *w, uint32_t *n_vocab, const char **pre_out, char *e,
                      size_t ecap)
{
    json_error_t je;
    json_t *tj = json_load_file(tok_path, 0, &je), *cj = NULL;
    char **tok = NULL;
    int32_t *type = NULL;
    const char **merges = NULL;
    char **mbuf = NULL;
    size_t n_merges = 0;
    uint32_t n = 0;
    int rc = -1;
    if (!tj) {
        snprintf(e, ecap, "%s: line %d: %s", tok_path, je.line, je.text);
        return -1;
    }
    if (cfg_path && !(cj = json_load_file(cfg_path, JSON_DECODE_INT_AS_REAL, &je))) {
        snprintf(e, ecap, "%s: line %d: %s", cfg_path, je.line, je.text);
        goto done;
    }
    const json_t *model = json_object_get(tj, "model");
    const char *mt = json_string_value(json_object_get(model, "type"));
    if (!mt || strcmp(mt, "BPE")) {
        err(e, ecap, "%s: model.type %s is not BPE", tok_path, mt ? mt : "(none)");
        goto done;
    }
    const json_t *vocab = json_object_get(model, "vocab"), *added = json_object_get(tj, "added_tokens");
    if (!json_is_object(vocab)) {
        err(e, ecap, "%s: no model.vocab", tok_path);
        goto done;
    }
    const char *key;
    json_t *val;
    size_t i;
    json_int_t max_id = -1;
    json_object_foreach((json_t *)vocab, key, val) {
        if (!json_is_integer(val) || json_integer_value(val) < 0 ||
            json_integer_value(val) >= (1 << 24)) {
            err(e, ecap, "%s: model.vocab[%s]: not an id below 2^24", tok_path, key);
            goto done;
        }
        if (json_integer_value(val) > max_id)
            max_id = json_integer_value(val);
    }
    json_array_foreach(added, i, val) {
        json_int_t id = json_integer_value(json_object_get(val, "id"));
        if (!json_is_integer(json_object_get(val, "id")) || id < 0 || id >= (1 << 24) ||
            !json_is_string(json_object_get(val, "content"))) {
            err(e, ecap, "%s: added_tokens: an entry without id below 2^24 and content",
                tok_path);
            goto done;
        }
        if (id > max_id)
            max_id = id;
    }
    n = (uint32_t)(max_id + 1);
    tok = calloc(n, sizeof *tok);
    type = calloc(n, sizeof *type);
    if (!tok || !type) {
        err(e, ecap, "%s: out of memory", tok_path);
        goto done;
    }
    json_object_foreach((json_t *)vocab, key, val) {
        uint32_t id = (uint32_t)json_integer_value(val);
        free(tok[id]);
        tok[id] = strdup(key);
        type[id] = 1; /* NORMAL */
    }
    json_array_foreach(added, i, val) {
        uint32_t id = (uint32_t)json_integer_value(json_object_get(val, "id"));
        const char *c = json_string_value(json_object_get(val, "content"));
        int special = json_is_true(json_object_get(val, "special")) || looks_special(c);
        free(tok[id]);
        tok[id] = strdup(c);
        if (!special && tok[id]) { /* the converter pre-normalizes "▁" to spaces */
            char *p;
            while ((p = strstr(tok[id], "\xe2\x96\x81"))) {
                *p = ' ';
                memmove(p + 1, p + 3, strlen(p + 3) + 1);
            }
        }
        type[id] = special ? 3 : 4; /* CONTROL, USER_DEFINED */
    }
    for (uint32_t k = 0; k < n; k++) {
        if (!tok[k]) {
            char pad[32];
            snprintf(pad, sizeof pad, "[PAD%u]", k);
            tok[k] = strdup(pad);
            type[k] = 5; /* UNUSED */
        }
        if (!tok[k]) {
            err(e, ecap, "%s: out of memory", tok_path);
            goto done;
        }
    }
    const json_t *jm = json_object_get(model, "merges");
    n_merges = json_array_size(jm);
    merges = calloc(n_merges ? n_merges : 1, sizeof *merges);
    mbuf = calloc(n_merges ? n_merges : 1, sizeof *mbuf);
    if (!merges || !mbuf) {
        err(e, ecap, "%s: out of memory", tok_path);
        goto done;
    }
    json_array_foreach(jm, i, val) {
        if (json_is_string(val)) {
            merges[i] = json_string_value(val);
            continue;
        }
        const char *l = json_string_value(json_array_get(val, 0)),
                   *r = json_string_value(json_array_get(val, 1));
        if (!l || !r || json_array_size(val) != 2) {
            err(e, ecap, "%s: model.merges: an entry neither \"a b\" nor [a, b]", tok_path);
            goto done;
        }
        size_t ll = strlen(l), rl = strlen(r);
        if (!(mbuf[i] = malloc(ll + rl + 2))) {
            err(e, ecap, "%s: out of memory", tok_path);
            goto done;
        }
        memcpy(mbuf[i], l, ll);
        mbuf[i][ll] = ' ';
        memcpy(mbuf[i] + ll + 1, r, rl + 1);
        merges[i] = mbuf[i];
    }
    const char *pre = pre_override;
    if (!pre) {
        const char *rx = split_regex(json_object_get(tj, "pre_tokenizer"));
        for (size_t k = 0; rx && k < sizeof k_regex / sizeof k_regex[0]; k++)
            if (!strcmp(rx, k_regex[k].regex))
                pre = k_regex[k].pre;
        if (!pre) {
            err(e, ecap, "%s: the pre-tokenizer's regex %s is not one of qwen2, llama-bpe, qwen35 "
                "(--pre NAME to name it)", tok_path, rx ? rx : "(none)");
            goto done;
        }
    }
    const char *norm = json_string_value(json_object_get(json_object_get(tj, "normalizer"), "type"));
    if (norm && strcmp(norm, "NFC")) {
        err(e, ecap, "%s: normalizer %s is not supported (NFC is)", tok_path, norm);
        goto done;
    }
    st_gguf_writer_set_str(w, "tokenizer.ggml.model", "gpt2");
    st_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre);
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.tokens", (const char *const *)tok, n);
    st_gguf_writer_set_arr(w, "tokenizer.ggml.token_type", ST_GGUF_INT32, type, n);
    st_gguf_writer_set_str_arr(w, "tokenizer.ggml.merges", merges, n_merges);
    if (norm)
        st_gguf_writer_set_str(w, "tokenizer.strata.normalizer", "nfc");
    if (cj) {
        static const char *const ids[][2] = {
            {"bos_token", "tokenizer.ggml.bos_token_id"},
            {"eos_token", "tokenizer.ggml.eos_token_id"},
            {"unk_token", "tokenizer.ggml.unknown_token_id"},
            {"pad_token", "tokenizer.ggml.padding_token_id"},
        };
        for (size_t k = 0; k < sizeof ids / sizeof ids[0]; k++) {
            const char *t = tok_value(json_object_get(cj, ids[k][0]));
            for (uint32_t j = 0; t && j < n; j++)
                if (!strcmp(tok[j], t)) {
                    st_gguf_writer_set_u32(w, ids[k][1], j);
                    break;
                }
        }
        const json_t *ab = json_object_get(cj, "add_bos_token"),
                     *ae = json_object_get(cj, "add_eos_token");
        if (json_is_boolean(ab))
            st_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", json_is_true(ab));
        if (json_is_boolean(ae))
            st_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", json_is_true(ae));
        const json_t *ct = json_object_get(cj, "chat_template");
        if (json_is_string(ct))
            st_gguf_writer_set_str(w, "tokenizer.chat_template", json_string_value(ct));
        json_array_foreach(ct, i, val) {
            const char *nm = json_string_value(json_object_get(val, "name")),
                       *tp = json_string_value(json_object_get(val, "template"));
            char k2[256];
            if (!nm || !tp)
                continue;
            if (!strcmp(nm, "default"))
                snprintf(k2, sizeof k2, "tokenizer.chat_template");
            else
                snprintf(k2, sizeof k2, "tokenizer.chat_template.%s", nm);
            st_gguf_writer_set_str(w, k2, tp);
        }
    }
    *n_vocab = n;
    if (pre_out) /* static: the table's name or pre_override */
        *pre_out = pre;
    rc = 0;
done:
    for (uint32_t k = 0; tok && k < n; k++)
        free(tok[k]);
    for (size_t k = 0; mbuf && k < n_merges; k++)
        free(mbuf[k]);
    free(tok);
    free(type);
    free(merges);
    free(mbuf);
    json_decref(tj);
    json_decref(cj);
    return rc;
}
