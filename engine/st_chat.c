/*
 * st_chat.c - a model's chat template (st_engine.h, "chat templates"): tokenizer.chat_template
 * from the GGUF, parsed once, rendered per conversation with the vocabulary's bos_token and
 * eos_token; and the ChatML fallback for a model without a usable template.
 */
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine.h"

struct st_chat_template {
    st_jinja *t;
    char *bos, *eos; /* NULL when the file has none */
};

/* The ChatML of llama.cpp's built-in (llama_chat_apply_template, LLM_CHAT_TEMPLATE_CHATML). */
static const char chatml_src[] =
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}";

/* Token id's text from tokenizer.ggml.tokens, malloc'd; NULL (no error) when absent. */
static int token_text(const st_gguf *g, const char *id_key, char **out)
{
    *out = NULL;
    uint32_t id;
    if (st_gguf_get_u32(g, id_key, &id))
        return 0;
    int64_t k = st_gguf_find(g, "tokenizer.ggml.tokens");
    if (k < 0)
        return 0;
    uint32_t elem = 0;
    uint64_t count = 0;
    if (st_gguf_kv_type(g, (uint64_t)k, &elem, &count) != ST_GGUF_ARRAY || elem != ST_GGUF_STRING)
        return st_error_set(ST_ECORRUPT, "tokenizer.ggml.tokens: not an array of strings");
    if (id >= count)
        return st_error_set(ST_ECORRUPT, "%s %u: beyond the %llu tokens", id_key, id,
                            (unsigned long long)count);
    const void *raw;
    uint64_t len;
    int rc = st_gguf_kv_raw(g, (uint64_t)k, &raw, &len);
    if (rc)
        return rc;
    const uint8_t *p = raw, *end = p + len;
    p += 12; /* element type, count */
    for (uint64_t i = 0;; i++) {
        uint64_t n;
        if ((size_t)(end - p) < 8)
            return st_error_set(ST_ECORRUPT, "tokenizer.ggml.tokens: truncated at token %llu",
                                (unsigned long long)i);
        memcpy(&n, p, 8); /* little-endian hosts only, as the reader */
        p += 8;
        if (n > (uint64_t)(end - p))
            return st_error_set(ST_ECORRUPT, "tokenizer.ggml.tokens: token %llu overruns",
                                (unsigned long long)i);
        if (i == id) {
            char *s = malloc(n + 1);
            if (!s)
                return st_error_set(ENOMEM, "out of memory");
            memcpy(s, p, n);
            s[n] = 0;
            *out = s;
            return 0;
        }
        p += n;
    }
}

static int make(const st_gguf *g, const char *src, size_t len, const char *what,
                st_chat_template **out)
{
    *out = NULL;
    st_chat_template *ct = calloc(1, sizeof *ct);
    if (!ct)
        return st_error_set(ENOMEM, "out of memory");
    int rc = st_jinja_parse(src, len, &ct->t, NULL, NULL);
    if (rc) {
        st_error_wrap(rc, "%s", what);
        goto fail;
    }
    if (g && ((rc = token_text(g, "tokenizer.ggml.bos_token_id", &ct->bos)) ||
              (rc = token_text(g, "tokenizer.ggml.eos_token_id", &ct->eos))))
        goto fail;
    *out = ct;
    return 0;
fail:
    st_chat_template_free(ct);
    return rc;
}

int st_chat_template_load(const st_gguf *g, st_chat_template **out)
{
    const char *src;
    uint64_t len;
    *out = NULL;
    int rc = st_gguf_get_str(g, "tokenizer.chat_template", &src, &len);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_ENOTFOUND, "the model has no tokenizer.chat_template");
    if (rc)
        return rc;
    return make(g, src, (size_t)len, "tokenizer.chat_template", out);
}

int st_chat_template_chatml(const st_gguf *g, st_chat_template **out)
{
    return make(g, chatml_src, sizeof chatml_src - 1, "ChatML", out);
}

void st_chat_template_free(st_chat_template *ct)
{
    if (!ct)
        return;
    st_jinja_free(ct->t);
    free(ct->bos);
    free(ct->eos);
    free(ct);
}

int st_chat_template_render(const st_chat_template *ct, const struct json_t *conversation,
                            char **out, size_t *out_len)
{
    *out = NULL;
    if (!json_is_object(conversation))
        return st_error_set(ST_EINVAL, "the conversation must be a JSON object");
    json_t *msgs = json_object_get(conversation, "messages");
    if (!json_is_array(msgs))
        return st_error_set(ST_EINVAL, "the conversation needs \"messages\": an array");
    json_t *vars = json_copy((json_t *)conversation); /* shallow: the values are shared */
    if (!vars)
        return st_error_set(ENOMEM, "out of memory");
    int rc = 0;
    if ((ct->bos && !json_object_get(vars, "bos_token") &&
         json_object_set_new(vars, "bos_token", json_string(ct->bos))) ||
        (ct->eos && !json_object_get(vars, "eos_token") &&
         json_object_set_new(vars, "eos_token", json_string(ct->eos))))
        rc = st_error_set(ENOMEM, "out of memory");
    if (!rc)
        rc = st_jinja_render(ct->t, vars, NULL, out, out_len);
    json_decref(vars);
    return rc;
}
