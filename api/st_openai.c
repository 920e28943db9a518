/*
 * st_openai.c - the OpenAI-compatible routes: POST /v1/chat/completions, POST /v1/completions in
 * OpenAI's shape (a body with "model" or "max_tokens"; the native shape goes on to
 * st_route_complete.c),
 * GET /v1/models and /v1/models/{model}; Server-Sent Events when "stream" is true. docs/API.md, "OpenAI-compatible API".
 *
 * The conversation manager is used only through st_conv_generate (by st_api_generate) and the
 * few st_conv_* getters (st_conv.h): the prompt handed over is always the whole conversation (a chat rendered by the
 * model's template, or the prompt text), and the slot reuses the longest prefix it holds.
 *
 * Text: the generated tokens are decoded with the vocabulary's streaming decoder (the byte
 * tokenizer: bytes < 256), made valid UTF-8 (an invalid sequence becomes U+FFFD; an incomplete
 * one at the end waits for the next token), then cut at the first stop sequence. When streaming,
 * a tail of the text that could still become a stop sequence is held back until it cannot.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "st_api_int.h"
#include "st_engine.h"

#define MAX_STOPS 4        /* OpenAI's limit on "stop" */
#define MAX_STOP_BYTES 256 /* per stop sequence */


/* ---- errors ----------------------------------------------------------------------------------- */

static void oa_error(st_api_call *c, int status, const char *code, const char *param,
                     const char *msg)
{
    st_api_call_error(c, status, code, "%s", msg);
    snprintf(c->err_param, sizeof c->err_param, "%s", param ? param : "");
}

/* After a st_api_json_* helper refused key: name it as the error's param. */
static int oa_param(st_api_call *c, const char *key)
{
    snprintf(c->err_param, sizeof c->err_param, "%s", key);
    return -1;
}

/* ---- the request -------------------------------------------------------------------------------- */

typedef struct oa_req {
    int chat;
    char sid[ST_API_ID_MAX + 1];
    int has_sid;
    uint64_t max_tokens, seed, top_k;
    int max_given;
    double temp, top_p, min_p;
    int ignore_eos, stream, include_usage;
    const char *stops[MAX_STOPS];
    size_t stop_len[MAX_STOPS];
    unsigned n_stops;
} oa_req;

/* Fields every route here reads, those accepted and ignored (they mean nothing here, or are not
 * implemented: docs/API.md lists them), and each route's own. */
static const char *const common_keys[] = {
    "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
    "seed", "stop", "stream", "stream_options", "n", "session", "ignore_eos", "logprobs",
    /* accepted, ignored */
    "user", "store", "metadata", "service_tier", "frequency_penalty", "presence_penalty",
    "logit_bias", "parallel_tool_calls", "tool_choice", "reasoning_effort", "prompt_cache_key",
    "safety_identifier", NULL};
static const char *const chat_keys[] = {"messages", "tools", "chat_template_kwargs",
                                        "response_format", "top_logprobs", NULL};
static const char *const text_keys[] = {"prompt", "echo", "best_of", "suffix", NULL};

static int key_in(const char *const *keys, const char *k)
{
    for (const char *const *p = keys; *p; p++)
        if (!strcmp(*p, k))
            return 1;
    return 0;
}

static int parse_common(st_api_call *c, oa_req *q)
{
    const st_api_config *cfg = st_api_cfg(c->srv);
    const char *k;
    json_t *v;
    json_object_foreach(c->body, k, v) {
        if (!key_in(common_keys, k) && !key_in(q->chat ? chat_keys : text_keys, k)) {
            char msg[200];
            snprintf(msg, sizeof msg, "Unrecognized request argument supplied: %s", k);
            oa_error(c, 400, "unknown_field", k, msg);
            return -1;
        }
    }
    json_t *model = json_object_get(c->body, "model");
    if (model && !json_is_string(model) && !json_is_null(model)) {
        oa_error(c, 400, "invalid_field", "model", "\"model\" must be a string");
        return -1;
    }
    uint64_t mt = 0, mct = 0;
    int g1 = 0, g2 = 0;
    q->temp = 1.0; /* OpenAI's default */
    q->top_p = 1.0;
    if (st_api_json_opt_u64(c, "max_tokens", cfg->max_n_predict, &mt, &g1))
        return oa_param(c, "max_tokens");
    if (st_api_json_opt_u64(c, "max_completion_tokens", cfg->max_n_predict, &mct, &g2))
        return oa_param(c, "max_completion_tokens");
    q->max_given = g1 || g2;
    q->max_tokens = g2 ? mct : mt;
    if (st_api_json_opt_double(c, "temperature", &q->temp, NULL))
        return oa_param(c, "temperature");
    if (st_api_json_opt_double(c, "top_p", &q->top_p, NULL))
        return oa_param(c, "top_p");
    if (st_api_json_opt_double(c, "min_p", &q->min_p, NULL))
        return oa_param(c, "min_p");
    if (st_api_json_opt_u64(c, "top_k", UINT32_MAX, &q->top_k, NULL))
        return oa_param(c, "top_k");
    if (st_api_json_opt_bool(c, "ignore_eos", &q->ignore_eos))
        return oa_param(c, "ignore_eos");
    if (st_api_json_opt_bool(c, "stream", &q->stream))
        return oa_param(c, "stream");
    if (!(q->temp >= 0 && q->temp <= 100)) {
        oa_error(c, 400, "invalid_field", "temperature", "\"temperature\" must be from 0 to 100");
        return -1;
    }
    if (!(q->top_p > 0 && q->top_p <= 1)) {
        oa_error(c, 400, "invalid_field", "top_p", "\"top_p\" must be in (0, 1]");
        return -1;
    }
    if (!(q->min_p >= 0 && q->min_p <= 1)) {
        oa_error(c, 400, "invalid_field", "min_p", "\"min_p\" must be in [0, 1]");
        return -1;
    }
    json_t *seed = json_object_get(c->body, "seed");
    if (seed && !json_is_null(seed)) {
        if (!json_is_integer(seed)) {
            oa_error(c, 400, "invalid_field", "seed", "\"seed\" must be an integer");
            return -1;
        }
        q->seed = (uint64_t)json_integer_value(seed) & (UINT64_MAX >> 1);
    }
    json_t *n = json_object_get(c->body, "n");
    if (n && !json_is_null(n) && (!json_is_integer(n) || json_integer_value(n) != 1)) {
        oa_error(c, 400, "invalid_field", "n", "only \"n\": 1 is supported");
        return -1;
    }
    json_t *lp = json_object_get(c->body, "logprobs");
    if (lp && !json_is_null(lp) && !json_is_false(lp) && !(json_is_integer(lp) && !json_integer_value(lp))) {
        oa_error(c, 400, "invalid_field", "logprobs", "\"logprobs\" is not supported");
        return -1;
    }
    json_t *so = json_object_get(c->body, "stream_options");
    if (so && !json_is_null(so)) {
        json_t *iu = json_is_object(so) ? json_object_get(so, "include_usage") : NULL;
        if (!json_is_object(so) || (iu && !json_is_boolean(iu) && !json_is_null(iu))) {
            oa_error(c, 400, "invalid_field", "stream_options",
                     "\"stream_options\" must be an object {\"include_usage\": bool}");
            return -1;
        }
        q->include_usage = json_is_true(iu);
    }
    json_t *stop = json_object_get(c->body, "stop");
    if (stop && !json_is_null(stop)) {
        size_t ns = json_is_array(stop) ? json_array_size(stop) : 1;
        if ((!json_is_string(stop) && !json_is_array(stop)) || ns > MAX_STOPS) {
            oa_error(c, 400, "invalid_field", "stop",
                     "\"stop\" must be a string or an array of at most 4 strings");
            return -1;
        }
        for (size_t i = 0; i < ns; i++) {
            json_t *e = json_is_array(stop) ? json_array_get(stop, i) : stop;
            if (!json_is_string(e) || json_string_length(e) == 0 ||
                json_string_length(e) > MAX_STOP_BYTES) {
                oa_error(c, 400, "invalid_field", "stop",
                         "each stop sequence must be a string of 1 to 256 bytes");
                return -1;
            }
            q->stops[q->n_stops] = json_string_value(e);
            q->stop_len[q->n_stops++] = json_string_length(e);
        }
    }
    /* the session: the body's "session" or the header X-Strata-Session */
    const char *bs = NULL, *hs = st_http_req_header(c->req, "X-Strata-Session");
    if (st_api_json_opt_str(c, "session", &bs))
        return oa_param(c, "session");
    if (bs && hs && strcmp(bs, hs)) {
        oa_error(c, 400, "invalid_field", "session",
                 "\"session\" and the header X-Strata-Session name different sessions");
        return -1;
    }
    const char *sid = bs ? bs : hs;
    if (sid) {
        if (!st_api_id_valid(sid, strlen(sid))) {
            oa_error(c, 400, "invalid_id", "session", "\"session\" is not a valid session id");
            return -1;
        }
        snprintf(q->sid, sizeof q->sid, "%s", sid);
        q->has_sid = 1;
    }
    return 0;
}

/* ---- the text: UTF-8, stop sequences ----------------------------------------------------------- */

typedef struct oa_gen {
    st_api_call *c;
    const oa_req *q;
    const st_vocab *vocab;
    st_vocab_stream vs;
    unsigned char pend[64]; /* decoded bytes not yet valid text (an incomplete sequence) */
    size_t n_pend;
    char *text;             /* the valid text so far, NUL-terminated */
    size_t len, cap, sent;  /* sent: bytes of text streamed */
    int stopped;            /* a stop sequence was found (text cut before it) */
    int began;              /* streaming: the first chunk was sent */
    char cid[48];           /* the completion's id */
    long long created;
    const char *model;
    st_conv_gen *g;
} oa_gen;

static int text_add(oa_gen *o, const char *s, size_t n)
{
    if (o->len + n + 1 > o->cap) {
        size_t cap = (o->len + n + 1) * 2 + 64;
        char *t = realloc(o->text, cap);
        if (!t)
            return -1;
        o->text = t;
        o->cap = cap;
    }
    memcpy(o->text + o->len, s, n);
    o->len += n;
    o->text[o->len] = '\0';
    return 0;
}

/* Length of a valid UTF-8 sequence at p[0..n): 1..4; 0 invalid; -1 incomplete (could still
 * become valid). */
static int utf8_len(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    int len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (len == 0 || c == 0)
        return 0;
    uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
    for (int t = 1; t < len; t++) {
        if ((size_t)t >= n)
            return -1;
        if ((p[t] & 0xc0) != 0x80)
            return 0;
        cp = (cp << 6) | (p[t] & 0x3f);
    }
    if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
        cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
        return 0;
    return len;
}

/* Move the valid part of pend into text (invalid bytes as U+FFFD); final: an incomplete tail
 * too. */
static int pend_drain(oa_gen *o, int final)
{
    size_t i = 0;
    while (i < o->n_pend) {
        int l = utf8_len(o->pend + i, o->n_pend - i);
        if (l < 0 && !final)
            break;
        if (l <= 0) {
            if (text_add(o, "\xef\xbf\xbd", 3))
                return -1;
            i++;
        } else {
            if (text_add(o, (const char *)o->pend + i, (size_t)l))
                return -1;
            i += (size_t)l;
        }
    }
    memmove(o->pend, o->pend + i, o->n_pend - i);
    o->n_pend -= i;
    return 0;
}

/* Cut text at the first stop sequence found in what was added since from; 1 if cut. */
static int stop_cut(oa_gen *o, size_t from)
{
    size_t best = SIZE_MAX;
    for (unsigned k = 0; k < o->q->n_stops; k++) {
        size_t sl = o->q->stop_len[k];
        size_t start = from > sl ? from - sl + 1 : 0;
        for (size_t i = start; i + sl <= o->len; i++)
            if (!memcmp(o->text + i, o->q->stops[k], sl)) {
                if (i < best)
                    best = i;
                break;
            }
    }
    if (best == SIZE_MAX)
        return 0;
    o->len = best;
    o->text[best] = '\0';
    return 1;
}

/* Bytes at the end of text that could still begin a stop sequence (held back while streaming). */
static size_t stop_holdback(const oa_gen *o)
{
    size_t hold = 0;
    for (unsigned k = 0; k < o->q->n_stops; k++) {
        size_t sl = o->q->stop_len[k];
        for (size_t m = sl - 1; m > hold; m--)
            if (m <= o->len - o->sent && !memcmp(o->text + o->len - m, o->q->stops[k], m)) {
                hold = m;
                break;
            }
    }
    return hold;
}

/* ---- streaming ------------------------------------------------------------------------------------ */

static json_t *chunk_new(oa_gen *o)
{
    return json_pack("{s:s,s:s,s:I,s:s,s:s}", "id", o->cid, "object",
                     o->q->chat ? "chat.completion.chunk" : "text_completion", "created",
                     (json_int_t)o->created, "model", o->model, "session", o->g->id);
}

static json_t *choice_new(oa_gen *o, const char *content, size_t n, int role, const char *finish)
{
    json_t *ch;
    if (o->q->chat) {
        json_t *d = json_object();
        if (role)
            json_object_set_new(d, "role", json_string("assistant"));
        if (content)
            json_object_set_new(d, "content", json_stringn(content, n));
        ch = json_pack("{s:i,s:o,s:n}", "index", 0, "delta", d, "logprobs");
    } else {
        ch = json_pack("{s:s%,s:i,s:n}", "text", content ? content : "", content ? n : 0, "index", 0,
                       "logprobs");
    }
    json_object_set_new(ch, "finish_reason", finish ? json_string(finish) : json_null());
    return ch;
}

/* "data: JSON\n\n" (steals j) */
static int sse_send(st_api_call *c, json_t *j)
{
    char *s = j ? json_dumps(j, ST_API_JSON_FLAGS) : NULL;
    json_decref(j);
    if (!s)
        return -1;
    int rc = st_api_call_stream(c, "data: ", 6) || st_api_call_stream(c, s, strlen(s)) ||
             st_api_call_stream(c, "\n\n", 2);
    free(s);
    return rc ? -1 : 0;
}

static int sse_chunk(oa_gen *o, const char *content, size_t n, int role, const char *finish)
{
    json_t *j = chunk_new(o);
    json_t *arr = json_array();
    json_array_append_new(arr, choice_new(o, content, n, role, finish));
    json_object_set_new(j, "choices", arr);
    if (o->q->include_usage)
        json_object_set_new(j, "usage", json_null());
    return sse_send(o->c, j);
}

static int stream_text(oa_gen *o, int final)
{
    if (!o->began) {
        o->began = 1;
        snprintf(o->c->session_hdr, sizeof o->c->session_hdr, "%s", o->g->id);
        if (o->q->chat && sse_chunk(o, "", 0, 1, NULL))
            return -1;
    }
    size_t end = final ? o->len : o->len - stop_holdback(o);
    if (end <= o->sent)
        return 0;
    int rc = sse_chunk(o, o->text + o->sent, end - o->sent, 0, NULL);
    o->sent = end;
    return rc;
}

/* st_conv_gen's token hook */
static int oa_token(void *arg, uint32_t tok, int eog)
{
    oa_gen *o = arg;
    size_t from = o->len;
    if (eog && !o->q->ignore_eos)
        return o->q->stream ? (stream_text(o, 0) ? -1 : 0) : 0;
    if (!o->vocab) {
        if (tok < 256 && o->n_pend < sizeof o->pend)
            o->pend[o->n_pend++] = (unsigned char)tok;
    } else {
        char piece[256];
        size_t need = 0;
        int rc = st_vocab_stream_push(o->vocab, &o->vs, tok, 0, piece, sizeof piece, &need);
        char *big = NULL;
        if (rc == ST_ETOOBIG) {
            if (!(big = malloc(need)))
                goto oom;
            rc = st_vocab_stream_push(o->vocab, &o->vs, tok, 0, big, need, &need);
        }
        if (rc) {
            free(big);
            st_api_call_fail(o->c, rc, "detokenizing");
            return -1;
        }
        /* the decoder held back an incomplete sequence: what it wrote is whole characters or
         * invalid bytes, which pend_drain turns into U+FFFD */
        const char *src = big ? big : piece;
        size_t i = 0;
        while (i < need) {
            size_t room = sizeof o->pend - o->n_pend, take = need - i < room ? need - i : room;
            memcpy(o->pend + o->n_pend, src + i, take);
            o->n_pend += take;
            i += take;
            if (pend_drain(o, 0)) { /* leaves at most an incomplete sequence of 3 bytes */
                free(big);
                goto oom;
            }
        }
        free(big);
    }
    if (pend_drain(o, 0))
        goto oom;
    if (o->q->n_stops && stop_cut(o, from))
        o->stopped = 1;
    if (o->q->stream && stream_text(o, o->stopped))
        return -1;
    return o->stopped ? 1 : 0;
oom:
    st_api_call_error(o->c, 503, "out_of_memory", "no memory");
    return -1;
}

/* ---- the routes ----------------------------------------------------------------------------------- */


/* The chat's prompt: messages rendered by the model's template with add_generation_prompt; or,
 * when upto is not SIZE_MAX, the first `upto` messages without it (the system prompt's part). */
static char *render_chat(st_api_call *c, size_t *len, size_t upto)
{
    st_conv *cv = st_api_conv(c->srv);
    json_t *msgs = json_object_get(c->body, "messages");
    if (!json_is_array(msgs) || json_array_size(msgs) == 0) {
        oa_error(c, 400, "invalid_field", "messages", "\"messages\" must be a non-empty array");
        return NULL;
    }
    json_t *kw = json_object_get(c->body, "chat_template_kwargs");
    if (kw && !json_is_null(kw) && !json_is_object(kw)) {
        oa_error(c, 400, "invalid_field", "chat_template_kwargs",
                 "\"chat_template_kwargs\" must be an object");
        return NULL;
    }
    json_t *rf = json_object_get(c->body, "response_format");
    if (rf && !json_is_null(rf) &&
        !(json_is_object(rf) && json_is_string(json_object_get(rf, "type")) &&
          !strcmp(json_string_value(json_object_get(rf, "type")), "text"))) {
        oa_error(c, 400, "invalid_field", "response_format",
                 "only \"response_format\": {\"type\": \"text\"} is supported");
        return NULL;
    }
    json_t *vars = json_object(), *m2 = json_array();
    json_object_set_new(vars, "messages", m2);
    for (size_t i = 0; i < json_array_size(msgs) && i < upto; i++) {
        json_t *m = json_array_get(msgs, i), *content = json_object_get(m, "content");
        char param[40];
        snprintf(param, sizeof param, "messages[%zu]", i);
        if (!json_is_object(m) || !json_is_string(json_object_get(m, "role"))) {
            oa_error(c, 400, "invalid_field", param, "each message must be an object with a \"role\"");
            json_decref(vars);
            return NULL;
        }
        json_t *copy = json_copy(m);
        if (json_is_array(content)) { /* content parts: the texts, joined */
            json_t *txt = json_string("");
            for (size_t k = 0; k < json_array_size(content); k++) {
                json_t *part = json_array_get(content, k);
                const char *type = json_string_value(json_object_get(part, "type"));
                json_t *t = json_object_get(part, "text");
                if (!type || strcmp(type, "text") || !json_is_string(t)) {
                    oa_error(c, 400, "invalid_field", param, "only text content parts are supported");
                    json_decref(txt);
                    json_decref(copy);
                    json_decref(vars);
                    return NULL;
                }
                size_t a = json_string_length(txt), b = json_string_length(t);
                char *cat = malloc(a + b + 1);
                if (cat) {
                    memcpy(cat, json_string_value(txt), a);
                    memcpy(cat + a, json_string_value(t), b);
                    json_string_setn(txt, cat, a + b);
                    free(cat);
                }
            }
            json_object_set_new(copy, "content", txt);
        }
        json_array_append_new(m2, copy);
    }
    json_object_set_new(vars, "add_generation_prompt", json_boolean(upto == SIZE_MAX));
    json_t *tools = json_object_get(c->body, "tools");
    if (tools && !json_is_null(tools))
        json_object_set(vars, "tools", tools);
    if (json_is_object(kw))
        json_object_update(vars, kw);
    char *out = NULL;
    int rc = st_chat_template_render(st_conv_chat(cv), vars, &out, len);
    json_decref(vars);
    if (rc && upto != SIZE_MAX) /* the system part alone (a template may refuse it): none */
        return NULL;
    if (rc) {
        char msg[900];
        snprintf(msg, sizeof msg, "the chat template: %s", st_errdetail());
        oa_error(c, 500, "template_error", "messages", msg);
        return NULL;
    }
    return out;
}

/* A prompt's tokens: special tokens parsed, BOS first where the vocabulary adds one, but one BOS
 * in all when the text begins with it (Llama 3's template writes bos_token itself; llama.cpp's
 * chat path strips the template's). */
static int prompt_tokens(st_conv *cv, const char *text, size_t len, uint32_t **toks, uint64_t *n)
{
    int rc = st_conv_tokenize(cv, text, len, 1, 1, toks, n);
    const st_vocab *v = st_conv_vocab(cv);
    if (!rc && v && st_vocab_add_bos(v) && *n >= 2 && (*toks)[0] == (*toks)[1] &&
        (*toks)[0] == st_vocab_special(v, ST_VOCAB_BOS))
        memmove(*toks, *toks + 1, (size_t)--*n * sizeof **toks);
    return rc;
}

/* Where the system prompt of a chat ends in its tokens toks[0..n) (0: none): the leading system
 * messages rendered alone, tokenized, as far as those tokens begin toks. The conversation takes
 * a root checkpoint there (--prompt-cache-root) and the prefix index a point (st_prefix.h). */
static uint64_t chat_system_end(st_api_call *c, const uint32_t *toks, uint64_t n)
{
    json_t *msgs = json_object_get(c->body, "messages");
    size_t k = 0;
    while (k < json_array_size(msgs)) {
        const char *role = json_string_value(json_object_get(json_array_get(msgs, k), "role"));
        if (!role || strcmp(role, "system"))
            break;
        k++;
    }
    if (k == 0 || k == json_array_size(msgs))
        return 0;
    size_t len = 0;
    char *text = render_chat(c, &len, k);
    uint32_t *st = NULL;
    uint64_t ns = 0, m = 0;
    if (text && !prompt_tokens(st_api_conv(c->srv), text, len, &st, &ns))
        while (m < ns && m < n && st[m] == toks[m])
            m++;
    free(text);
    free(st);
    return m;
}

static void oa_run(st_api_call *c, oa_req *q)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    uint32_t *toks = NULL;
    uint64_t n = 0, system_end = 0;
    char *prompt = NULL;
    size_t plen = 0;
    int rc;
    if (q->chat) {
        if (!(prompt = render_chat(c, &plen, SIZE_MAX)))
            return;
        rc = prompt_tokens(cv, prompt, plen, &toks, &n);
        if (!rc && (cfg->prefix_budget_bytes || cfg->prompt_cache_root)) /* who uses it */
            system_end = chat_system_end(c, toks, n);
    } else {
        json_t *p = json_object_get(c->body, "prompt");
        json_t *echo = json_object_get(c->body, "echo"), *bo = json_object_get(c->body, "best_of");
        json_t *sfx = json_object_get(c->body, "suffix");
        if ((echo && !json_is_null(echo) && !json_is_false(echo)) ||
            (bo && !json_is_null(bo) && !(json_is_integer(bo) && json_integer_value(bo) == 1)) ||
            (sfx && !json_is_null(sfx))) {
            oa_error(c, 400, "invalid_field", echo && json_is_true(echo) ? "echo" : bo ? "best_of" : "suffix",
                     "\"echo\", \"best_of\" > 1 and \"suffix\" are not supported");
            return;
        }
        if (json_is_array(p) && json_array_size(p) == 1 && json_is_string(json_array_get(p, 0)))
            p = json_array_get(p, 0);
        if (json_is_string(p)) {
            rc = prompt_tokens(cv, json_string_value(p), json_string_length(p), &toks, &n);
        } else if (json_is_array(p) && json_array_size(p) > 0) { /* token ids */
            n = json_array_size(p);
            if (!(toks = malloc(n * sizeof *toks))) {
                oa_error(c, 503, "out_of_memory", NULL, "no memory");
                return;
            }
            for (size_t i = 0; i < n; i++) {
                json_t *t = json_array_get(p, i);
                if (!json_is_integer(t) || json_integer_value(t) < 0 ||
                    json_integer_value(t) >= st_conv_n_vocab(cv)) {
                    char msg[120];
                    snprintf(msg, sizeof msg, "prompt[%zu] is not a token id below %u", i,
                             st_conv_n_vocab(cv));
                    oa_error(c, 400, "invalid_field", "prompt", msg);
                    free(toks);
                    return;
                }
                toks[i] = (uint32_t)json_integer_value(t);
            }
            rc = 0;
        } else {
            oa_error(c, 400, "invalid_field", "prompt",
                     "\"prompt\" must be a string, one string in an array, or an array of token ids");
            return;
        }
    }
    free(prompt);
    if (rc) {
        st_api_call_fail(c, rc, "tokenizing");
        oa_param(c, q->chat ? "messages" : "prompt");
        return;
    }
    uint32_t n_ctx = st_conv_n_ctx(cv);
    char msg[300];
    if (n >= n_ctx || (q->max_given && n + q->max_tokens > n_ctx)) {
        snprintf(msg, sizeof msg,
                 "This model's maximum context length is %u tokens; the prompt is %llu tokens%s%s",
                 n_ctx, (unsigned long long)n, q->max_given ? " and max_tokens asks for " : "",
                 q->max_given ? "more than the rest" : "");
        oa_error(c, 400, "context_length_exceeded", q->chat ? "messages" : "prompt", msg);
        free(toks);
        return;
    }
    uint64_t n_predict = q->max_given ? q->max_tokens : n_ctx - n;
    if (n_predict > cfg->max_n_predict)
        n_predict = cfg->max_n_predict;

    oa_gen o = {.c = c, .q = q, .vocab = st_conv_vocab(cv), .model = st_conv_model_name(cv)};
    st_conv_gen g = {.session = q->has_sid ? q->sid : NULL, .whole = toks, .n_whole = n,
                     .system_end = system_end,
                     .anon_reuse = !q->has_sid, .token = oa_token, .arg = &o,
                     .n_predict = n_predict, .seed = q->seed, .ignore_eos = q->ignore_eos};
    g.sp.temp = (float)q->temp;
    g.sp.top_p = (float)q->top_p;
    g.sp.min_p = (float)q->min_p;
    g.sp.top_k = (uint32_t)q->top_k;
    o.g = &g;
    o.created = (long long)time(NULL);
    memcpy(o.cid, q->chat ? "chatcmpl-" : "cmpl-", q->chat ? 10 : 6);
    st_conv_random_hex(o.cid + strlen(o.cid), sizeof o.cid - strlen(o.cid));
    if (!(o.text = calloc(1, 64))) {
        free(toks);
        oa_error(c, 503, "out_of_memory", NULL, "no memory");
        return;
    }
    o.cap = 64;
    rc = st_api_generate(c, &g);
    free(toks);
    if (rc) {
        if (o.began && !c->no_reply) { /* the stream began: the error is its last event */
            json_t *e = json_pack("{s:{s:s,s:s,s:n,s:s}}", "error", "message",
                                  c->err_msg ? c->err_msg : "failed", "type", "server_error", "param",
                                  "code", c->err_code);
            sse_send(c, e);
        }
        free(o.text);
        return;
    }
    if (!o.stopped && o.vocab) { /* what the decoder still held */
        char tail[4];
        size_t k = st_vocab_stream_flush(&o.vs, tail, sizeof tail);
        memcpy(o.pend + o.n_pend, tail, k);
        o.n_pend += k;
    }
    if (!o.stopped) {
        pend_drain(&o, 1);
        if (q->n_stops && stop_cut(&o, o.sent))
            o.stopped = 1;
    }
    const char *finish = !strcmp(g.stop, "length") && !o.stopped ? "length" : "stop";
    json_t *usage = json_pack("{s:I,s:I,s:I,s:{s:I}}", "prompt_tokens", (json_int_t)g.n_prompt,
                              "completion_tokens", (json_int_t)g.n_gen, "total_tokens",
                              (json_int_t)(g.n_prompt + g.n_gen), "prompt_tokens_details",
                              "cached_tokens", (json_int_t)g.resumed);
    json_t *timings = json_pack("{s:s,s:f,s:I,s:I,s:I,s:f,s:f,s:f}", "found", g.found, "prompt_ms",
                                st_api_ms(g.prompt_ms), "resumed_tokens", (json_int_t)g.resumed,
                                "computed_tokens", (json_int_t)g.computed, "spliced_tokens",
                                (json_int_t)g.spliced, "search_ms", st_api_ms(g.search_ms), "decode_ms",
                                st_api_ms(g.decode_ms), "tokens_per_s",
                                st_api_ms(g.decode_ms > 0 ? (double)g.n_gen * 1000.0 / g.decode_ms : 0.0));
    snprintf(c->session_hdr, sizeof c->session_hdr, "%s", g.id);
    if (q->stream) {
        stream_text(&o, 1);
        json_t *j = chunk_new(&o), *arr = json_array();
        json_array_append_new(arr, choice_new(&o, q->chat ? NULL : "", 0, 0, finish));
        json_object_set_new(j, "choices", arr);
        json_object_set_new(j, "timings", timings);
        if (q->include_usage)
            json_object_set_new(j, "usage", json_null());
        sse_send(c, j);
        if (q->include_usage) {
            j = chunk_new(&o);
            json_object_set_new(j, "choices", json_array());
            json_object_set_new(j, "usage", usage);
            usage = NULL;
            sse_send(c, j);
        }
        st_api_call_stream(c, "data: [DONE]\n\n", 14);
        json_decref(usage);
        free(o.text);
        return;
    }
    json_t *choice;
    if (q->chat)
        choice = json_pack("{s:i,s:{s:s,s:s%,s:n},s:n,s:s}", "index", 0, "message", "role", "assistant",
                           "content", o.text, o.len, "refusal", "logprobs", "finish_reason", finish);
    else
        choice = json_pack("{s:s%,s:i,s:n,s:s}", "text", o.text, o.len, "index", 0, "logprobs",
                           "finish_reason", finish);
    c->reply = json_pack("{s:s,s:s,s:I,s:s,s:[o],s:o,s:s,s:o}", "id", o.cid, "object",
                         q->chat ? "chat.completion" : "text_completion", "created",
                         (json_int_t)o.created, "model", o.model, "choices", choice, "usage", usage,
                         "session", g.id, "timings", timings);
    free(o.text);
    if (!c->reply) {
        oa_error(c, 500, "internal", NULL, "reply not encodable");
        return;
    }
    c->status = 200;
}

void st_openai_chat(st_api_call *c)
{
    c->openai = 1;
    oa_req q = {.chat = 1};
    if (!c->body) {
        oa_error(c, 400, "invalid_field", "messages", "the body must hold \"messages\"");
        return;
    }
    if (parse_common(c, &q))
        return;
    oa_run(c, &q);
}

void st_openai_completions(st_api_call *c)
{
    if (!c->body || (!json_object_get(c->body, "model") && !json_object_get(c->body, "max_tokens"))) {
        c->openai = 0;
        st_api_h_completion(c); /* the native shape, with its strict rules */
        return;
    }
    c->openai = 1;
    oa_req q = {.chat = 0};
    if (parse_common(c, &q))
        return;
    oa_run(c, &q);
}

/* The model object of the model served. */
static json_t *model_object(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    struct stat st;
    long long created = stat(st_api_cfg(c->srv)->model_path, &st) ? 0 : (long long)st.st_mtime;
    return json_pack("{s:s,s:s,s:I,s:s,s:{s:I,s:I}}", "id", st_conv_model_name(cv), "object", "model",
                     "created", (json_int_t)created, "owned_by", "strata", "meta", "n_ctx",
                     (json_int_t)st_conv_n_ctx(cv), "n_vocab", (json_int_t)st_conv_n_vocab(cv));
}

void st_openai_models(st_api_call *c)
{
    c->openai = 1;
    json_t *m = model_object(c);
    c->reply = m ? json_pack("{s:s,s:[o]}", "object", "list", "data", m) : NULL;
    if (!c->reply) {
        oa_error(c, 500, "internal", NULL, "no memory");
        return;
    }
    c->status = 200;
}

void st_openai_model_get(st_api_call *c)
{
    c->openai = 1;
    if (strcmp(c->model_id, st_conv_model_name(st_api_conv(c->srv)))) {
        char msg[800];
        snprintf(msg, sizeof msg, "The model '%s' does not exist (this server serves '%s')",
                 c->model_id, st_conv_model_name(st_api_conv(c->srv)));
        oa_error(c, 404, "model_not_found", "model", msg);
        return;
    }
    if (!(c->reply = model_object(c))) {
        oa_error(c, 500, "internal", NULL, "no memory");
        return;
    }
    c->status = 200;
}

