/*
 * st_route_complete.c - the native completion (POST /v1/completions with a body in the native
 * shape: the prompt appended to what the session holds), llama.cpp's POST /apply-template, and
 * st_api_generate, the bridge from a call to the conversation manager's st_conv_generate that
 * the OpenAI routes (st_openai.c) use too.
 *
 * Invariant: a completion whose client went away ends with st_api_call_cancel (nothing is sent);
 * the conversation keeps what was read and generated (st_conv.c, invariant 7).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_api_int.h"

int st_api_generate(st_api_call *c, st_conv_gen *g)
{
    g->cancel = &c->cancelled;
    int rc = st_conv_generate(st_api_conv(c->srv), g);
    if (!rc)
        return 0;
    if (rc == ECANCELED)
        st_api_call_cancel(c);
    else if (rc != ST_CONV_EHOOK && g->code)
        st_api_call_error(c, 400, g->code, "%s", st_errdetail());
    else if (rc != ST_CONV_EHOOK)
        st_api_call_fail(c, rc, g->what);
    return -1;
}


/* Bytes as JSON-safe UTF-8: invalid sequences become U+FFFD. *out is malloc'd. */
static char *utf8_clean(const unsigned char *s, size_t n)
{
    char *o = malloc(n * 3 + 1);
    size_t k = 0;
    if (!o)
        return NULL;
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        int ok = len > 0 && i + len <= n;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (size_t t = 1; ok && t < len; t++) {
            if ((s[i + t] & 0xc0) != 0x80)
                ok = 0;
            else
                cp = (cp << 6) | (s[i + t] & 0x3f);
        }
        if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
                   cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || cp == 0))
            ok = 0;
        if (ok) {
            memcpy(o + k, s + i, len);
            k += len;
            i += len;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    o[k] = '\0';
    return o;
}


/* The native completion: the body's prompt appended to what the session holds. */
typedef struct native_gen {
    st_api_call *c;
    const st_vocab *vocab;
    const char *prompt, *system;
    json_t *jt;
    size_t sys_len, p_len, n_in;
    uint32_t *gen;          /* the generated ids */
    uint64_t n_gen;
    char *bytes;            /* their text */
    size_t n_bytes, cap_bytes;
    st_vocab_stream vs;
} native_gen;


/* the conversation as `strata generate` builds it: what is held, then BOS (new) or a turn
 * separator (continued), the system prompt and the prompt; with the model's vocabulary, what is
 * held, BOS on a new conversation when the vocabulary adds one, the system prompt and the prompt
 * (no separators: the text carries the turns) */
static int native_build(void *arg, const uint32_t *held, uint64_t n_held, uint32_t **out,
                        uint64_t *out_n, uint64_t *system_end)
{
    native_gen *ng = arg;
    st_conv *cv = st_api_conv(ng->c->srv);
    uint32_t *sys = NULL, *pr = NULL;
    uint64_t n_sys = 0, n_pr = 0;
    int rc = 0;
    if ((ng->sys_len && (rc = st_conv_tokenize(cv, ng->system, ng->sys_len, 0, 0, &sys, &n_sys))) ||
        (rc = st_conv_tokenize(cv, ng->prompt ? ng->prompt : "", ng->p_len, 0, 0, &pr, &n_pr))) {
        free(sys);
        st_api_call_fail(ng->c, rc, "tokenizing");
        return -1;
    }
    uint64_t cap = n_held + 3 + n_sys + n_pr + ng->n_in;
    uint32_t *toks = malloc(cap * sizeof *toks);
    if (!toks) {
        free(sys);
        free(pr);
        st_api_call_error(ng->c, 503, "out_of_memory", "no memory");
        return -1;
    }
    uint64_t n = n_held;
    if (n_held)
        memcpy(toks, held, n_held * sizeof *toks);
    int more = ng->sys_len || ng->p_len || ng->n_in;
    if (!ng->vocab) {
        if (!n_held || more)
            toks[n++] = n_held ? ST_TOKEN_SEP : ST_TOKEN_BOS;
    } else if (!n_held && st_vocab_add_bos(ng->vocab) &&
               st_vocab_special(ng->vocab, ST_VOCAB_BOS) != UINT32_MAX) {
        toks[n++] = st_vocab_special(ng->vocab, ST_VOCAB_BOS);
    }
    if (ng->sys_len) {
        memcpy(toks + n, sys, n_sys * sizeof *toks);
        n += n_sys;
        *system_end = n;
        if ((ng->p_len || ng->n_in) && !ng->vocab)
            toks[n++] = ST_TOKEN_SEP;
    }
    memcpy(toks + n, pr, n_pr * sizeof *toks);
    n += n_pr;
    for (size_t i = 0; i < ng->n_in; i++)
        toks[n++] = (uint32_t)json_integer_value(json_array_get(ng->jt, i));
    free(sys);
    free(pr);
    *out = toks;
    *out_n = n;
    return 0;
}

static int native_token(void *arg, uint32_t tok, int eog)
{
    native_gen *ng = arg;
    (void)eog;
    ng->gen[ng->n_gen++] = tok;
    if (!ng->vocab) {
        if (tok < 256)
            ng->bytes[ng->n_bytes++] = (char)tok;
        return 0;
    }
    for (;;) {
        size_t need = 0;
        int rc = st_vocab_stream_push(ng->vocab, &ng->vs, tok, 0, ng->bytes + ng->n_bytes,
                                      ng->cap_bytes - ng->n_bytes, &need);
        if (!rc) {
            ng->n_bytes += need;
            return 0;
        }
        if (rc != ST_ETOOBIG) {
            st_api_call_fail(ng->c, rc, "detokenizing");
            return -1;
        }
        size_t cap = (ng->n_bytes + need) * 2 + 64;
        char *b = realloc(ng->bytes, cap);
        if (!b) {
            st_api_call_error(ng->c, 503, "out_of_memory", "no memory");
            return -1;
        }
        ng->bytes = b;
        ng->cap_bytes = cap;
    }
}

void st_api_h_completion(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    static const char *const keys[] = {"session", "prompt", "tokens", "system", "n_predict",
                                       "temperature", "seed", "ignore_eos", "top_k", "top_p",
                                       "min_p", NULL};
    const char *sid = NULL;
    uint64_t n_predict = 16, seed = 0, top_k = 0;
    double temp = 0.0, top_p = 1.0, min_p = 0.0;
    int ignore_eos = 0;
    native_gen ng = {.c = c, .vocab = st_conv_vocab(cv)};
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "session", &sid) ||
        st_api_json_opt_str(c, "prompt", &ng.prompt) || st_api_json_opt_str(c, "system", &ng.system) ||
        st_api_json_opt_u64(c, "n_predict", cfg->max_n_predict, &n_predict, NULL) ||
        st_api_json_opt_double(c, "temperature", &temp, NULL) ||
        st_api_json_opt_u64(c, "seed", UINT64_MAX >> 1, &seed, NULL) ||
        st_api_json_opt_bool(c, "ignore_eos", &ignore_eos) ||
        st_api_json_opt_u64(c, "top_k", UINT32_MAX, &top_k, NULL) ||
        st_api_json_opt_double(c, "top_p", &top_p, NULL) ||
        st_api_json_opt_double(c, "min_p", &min_p, NULL))
        return;
    json_t *jt = json_object_get(c->body, "tokens");
    if (jt && !json_is_null(jt) && ng.prompt) {
        st_api_call_error(c, 400, "invalid_field", "give \"prompt\" or \"tokens\", not both");
        return;
    }
    if (jt && !json_is_null(jt) && !json_is_array(jt)) {
        st_api_call_error(c, 400, "invalid_field", "\"tokens\" must be an array of token ids");
        return;
    }
    if (temp < 0 || temp > 100 || temp != temp) {
        st_api_call_error(c, 400, "invalid_field", "\"temperature\" must be from 0 (greedy) to 100");
        return;
    }
    if (!(top_p > 0 && top_p <= 1) || !(min_p >= 0 && min_p <= 1)) {
        st_api_call_error(c, 400, "invalid_field",
                          "\"top_p\" must be in (0, 1] and \"min_p\" in [0, 1]");
        return;
    }
    if (sid && !st_api_id_valid(sid, strlen(sid))) {
        st_api_call_error(c, 400, "invalid_id", "\"session\" is not a valid session id");
        return;
    }
    ng.jt = jt;
    ng.sys_len = ng.system ? strlen(ng.system) : 0;
    ng.p_len = ng.prompt ? strlen(ng.prompt) : 0;
    ng.n_in = jt && json_is_array(jt) ? json_array_size(jt) : 0;
    if (ng.sys_len + ng.p_len + ng.n_in + 2 > st_conv_n_ctx(cv) && !ng.vocab) {
        st_api_call_error(c, 400, "context_full", "the prompt alone exceeds the context of %u tokens",
                          st_conv_n_ctx(cv));
        return;
    }
    for (size_t i = 0; i < ng.n_in; i++) {
        json_t *t = json_array_get(jt, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= st_conv_n_vocab(cv)) {
            st_api_call_error(c, 400, "invalid_field", "tokens[%zu] is not a token id below %u", i,
                              st_conv_n_vocab(cv));
            return;
        }
    }
    ng.cap_bytes = n_predict + 1;
    ng.gen = malloc((n_predict ? n_predict : 1) * sizeof *ng.gen);
    ng.bytes = malloc(ng.cap_bytes);
    char *text = NULL;
    if (!ng.gen || !ng.bytes) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        goto done;
    }
    st_conv_gen g = {.session = sid, .build = native_build, .token = native_token, .arg = &ng,
                     .n_predict = n_predict, .seed = seed, .ignore_eos = ignore_eos};
    g.sp.temp = (float)temp;
    g.sp.top_k = (uint32_t)top_k;
    g.sp.top_p = (float)top_p;
    g.sp.min_p = (float)min_p;
    if (st_api_generate(c, &g))
        goto done;
    if (ng.vocab) {
        char tail[4];
        size_t k = st_vocab_stream_flush(&ng.vs, tail, sizeof tail);
        if (ng.n_bytes + k <= ng.cap_bytes) {
            memcpy(ng.bytes + ng.n_bytes, tail, k);
            ng.n_bytes += k;
        }
    }
    text = utf8_clean((const unsigned char *)ng.bytes, ng.n_bytes);
    json_t *jtoks = json_array();
    for (uint64_t i = 0; i < ng.n_gen; i++)
        json_array_append_new(jtoks, json_integer(ng.gen[i]));
    c->reply = json_pack("{s:s,s:s,s:o,s:s,s:s,s:I,s:I,s:{s:f,s:I,s:I,s:f,s:f,s:f}}", "session", g.id,
                         "text", text ? text : "", "tokens", jtoks, "stop", g.stop, "found", g.found,
                         "n_prompt_tokens", (json_int_t)(g.n_prompt - g.n_held), "n_tokens",
                         (json_int_t)g.n_tokens, "timings", "prompt_ms", st_api_ms(g.prompt_ms),
                         "resumed_tokens", (json_int_t)g.resumed, "computed_tokens",
                         (json_int_t)g.computed, "decode_ms", st_api_ms(g.decode_ms), "tokens_per_s",
                         st_api_ms(g.decode_ms > 0 ? (double)g.n_gen * 1000.0 / g.decode_ms : 0.0),
                         "record_ms", st_api_ms(g.record_ms));
    c->status = 200;
done:
    free(ng.gen);
    free(ng.bytes);
    free(text);
}


/* POST /apply-template (llama.cpp's): the body of a chat request ({"messages": [...], "tools",
 * "add_generation_prompt" (default true), "chat_template_kwargs": {...}, any other key a
 * template variable) rendered by the model's chat template: {"prompt": "..."}. */
void st_api_h_apply_template(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    if (!json_is_array(json_object_get(c->body, "messages"))) {
        st_api_call_error(c, 400, "invalid_field", "\"messages\" must be an array");
        return;
    }
    json_t *kw = json_object_get(c->body, "chat_template_kwargs");
    if (kw && !json_is_object(kw)) {
        st_api_call_error(c, 400, "invalid_field", "\"chat_template_kwargs\" must be an object");
        return;
    }
    json_t *vars = json_copy(c->body); /* shallow: the values are shared */
    if (!vars || (!json_object_get(vars, "add_generation_prompt") &&
                  json_object_set_new(vars, "add_generation_prompt", json_true())) ||
        (kw && (json_object_del(vars, "chat_template_kwargs") || json_object_update(vars, kw)))) {
        json_decref(vars);
        st_api_call_error(c, 500, "internal", "no memory");
        return;
    }
    char *out = NULL;
    size_t len = 0;
    int rc = st_chat_template_render(st_conv_chat(cv), vars, &out, &len);
    json_decref(vars);
    if (rc) {
        st_api_call_error(c, 500, "template_error", "the chat template: %s", st_errdetail());
        return;
    }
    c->reply = json_pack("{s:s%}", "prompt", out, len);
    free(out);
    if (!c->reply) {
        st_api_call_error(c, 500, "internal", "no memory");
        return;
    }
    c->status = 200;
}
