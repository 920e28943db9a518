/*
 * st_call.c - the request plumbing of strata-server: a call (st_api_call) from its parse to its
 * one reply: errors in the native and OpenAI shapes, replies and streamed replies, running a
 * handler on a worker, the JSON body and its helpers, percent-decoding and query strings. Below
 * the handlers; above the HTTP layer (st_http.c) and the worker pool (st_work.c).
 *
 * Invariants:
 * 1. A call's reply is sent once, from the loop: after the worker's done() (st_api_call_submit)
 *    or right after a handler that runs on the loop. A worker only fills the call (its JSON reply
 *    serialised there, so that the loop only copies bytes) and, for a streamed reply, hands
 *    bytes to the loop through the call's locked buffer and event.
 * 2. Once a streamed reply began, the call's reply and error are never sent.
 * 3. A JSON body is an object without duplicate keys in well-formed UTF-8, or empty; a handler
 *    sees nothing else (st_api_body_parse).
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_api_int.h"

/* ---- calls: errors and replies ------------------------------------------------------------ */

void st_api_call_error(st_api_call *c, int status, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    c->status = status;
    snprintf(c->err_code, sizeof c->err_code, "%s", code);
    free(c->err_msg);
    c->err_msg = strdup(msg);
    json_decref(c->reply);
    c->reply = NULL;
}

void st_api_call_fail(st_api_call *c, int rc, const char *what)
{
    int status = 500;
    const char *code = "internal";
    switch (rc) {
    case ST_ENOTFOUND: status = 404; code = "not_found"; break;
    case ST_ECONFLICT: status = 409; code = "conflict"; break;
    case ST_EBUSY: status = 409; code = "busy"; break;
    case ST_EINVAL: status = 400; code = "invalid"; break;
    case ST_ETOOBIG: status = 413; code = "too_big"; break;
    case ST_EMODEL: status = 409; code = "model_mismatch"; break;
    case ST_EGEOMETRY: status = 409; code = "geometry_mismatch"; break;
    case ST_ECORRUPT: status = 500; code = "corrupt"; break;
    case ST_EDAMAGED: status = 500; code = "session_damaged"; break;
    case ST_EVERSION: status = 422; code = "version"; break;
    case ST_ENOTSTRATA: status = 422; code = "not_a_session_file"; break;
    case ST_ECODEC: status = 422; code = "codec"; break;
    case ST_ELOSSY: status = 422; code = "lossy"; break;
    case ST_EFULL: status = 507; code = "store_full"; break;
    case ENOSPC: status = 507; code = "disk_full"; break;
    case ST_ENOMEMGUARD: status = 503; code = "memory_guard"; break;
    case ENOMEM: status = 503; code = "out_of_memory"; break;
    default: break;
    }
    const char *d = st_errdetail();
    if (d && *d)
        st_api_call_error(c, status, code, "%s: %s", what, d);
    else
        st_api_call_error(c, status, code, "%s: %s", what, st_strerror(rc));
}

void st_api_call_free(void *user, void *arg)
{
    st_api_call *c = user;
    (void)arg;
    if (!c)
        return;
    json_decref(c->body);
    json_decref(c->reply);
    free(c->reply_text);
    free(c->err_msg);
    if (c->file_fd >= 0)
        close(c->file_fd);
    if (c->text)
        evbuffer_free(c->text);
    if (c->stream_ev)
        event_free(c->stream_ev);
    if (c->stream_buf)
        evbuffer_free(c->stream_buf);
    free(c);
}

/* On the loop: what the worker streamed so far goes out as a chunk (the first begins the reply). */
static void stream_flush(st_api_call *c)
{
    if (c->stream_ended)
        return;
    if (!c->stream_begun) {
        c->stream_begun = 1;
        if (c->session_hdr[0])
            st_http_header_add(c->req, "X-Strata-Session", c->session_hdr);
        st_http_stream_begin(c->req, 200, "text/event-stream");
    }
    struct evbuffer *tmp = evbuffer_new();
    if (tmp) {
        evbuffer_remove_buffer(c->stream_buf, tmp, evbuffer_get_length(c->stream_buf));
        st_http_stream_write(c->req, tmp);
        evbuffer_free(tmp);
    }
}

static void stream_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    stream_flush(arg);
}

int st_api_call_stream(st_api_call *c, const void *data, size_t len)
{
    if (!c->stream_buf) {
        if (!(c->stream_buf = evbuffer_new()) || evbuffer_enable_locking(c->stream_buf, NULL) ||
            !(c->stream_ev = event_new(c->srv->base, -1, 0, stream_cb, c)))
            return st_error_set(ENOMEM, "no memory for a streamed reply");
    }
    if (evbuffer_add(c->stream_buf, data, len))
        return st_error_set(ENOMEM, "no memory for a streamed reply");
    event_active(c->stream_ev, 0, 0);
    return 0;
}

/* An error body in OpenAI's shape, {"error":{"message","type","param","code"}} (param NULL or ""
 * : null), malloc'd with a newline at the end; the type follows the status. NULL: no memory. */
static char *openai_error_body(int status, const char *code, const char *param, const char *msg,
                               size_t *len)
{
    const char *type = status == 401 ? "authentication_error"
                       : status == 404 ? "not_found_error"
                       : status < 500 ? "invalid_request_error" : "server_error";
    char *m = st_http_utf8_escape(msg ? msg : "");
    json_t *o = m ? json_pack("{s:{s:s,s:s,s:o,s:s}}", "error", "message", m, "type", type, "param",
                              param && param[0] ? json_string(param) : json_null(), "code",
                              code && code[0] ? code : "internal")
                  : NULL;
    char *t = o ? json_dumps(o, ST_API_JSON_FLAGS) : NULL;
    json_decref(o);
    free(m);
    char *r = t ? realloc(t, strlen(t) + 2) : NULL;
    if (!r) {
        free(t);
        return NULL;
    }
    *len = strlen(r);
    r[(*len)++] = '\n';
    return r;
}

/* st_http_error_fn of the requests on the OpenAI routes: refusals before the handler (401, 404,
 * 405, 413, 503, ...) in the same shape as the handler's errors. */
char *st_api_openai_error_fn(int status, const char *code, const char *msg, size_t *len)
{
    return openai_error_body(status, code, NULL, msg, len);
}

static void reply_openai_error(st_api_call *c, int status)
{
    size_t len = 0;
    char *b = openai_error_body(status, c->err_code, c->err_param, c->err_msg ? c->err_msg : "no reply",
                                &len);
    if (b)
        st_http_reply_buf(c->req, status, "application/json", b, len);
    else
        st_http_reply_buf(c->req, status, "application/json", "{}", 2);
    free(b);
}

/* Send what the handler left in c. c stays with the request (freed with it). */
void st_api_call_reply(st_api_call *c)
{
    st_http_req *r = c->req;
    if (c->stream_ev) {
        stream_flush(c);
        c->stream_ended = 1;
        st_http_stream_end(r, c->no_reply ? c->status : 0);
        return;
    }
    if (c->session_hdr[0] && !c->no_reply)
        st_http_header_add(r, "X-Strata-Session", c->session_hdr);
    if (!c->openai) /* POST /v1/completions with a body in the native shape */
        st_http_req_set_error_fn(r, NULL);
    if (c->no_reply) {
        st_http_reply_none(r, c->status);
    } else if (c->text) {
        st_http_reply_evbuf(r, c->status ? c->status : 200, c->file_ctype, c->text);
    } else if (c->file_fd >= 0) {
        int fd = c->file_fd;
        c->file_fd = -1;
        st_http_reply_file(r, c->status ? c->status : 200, c->file_ctype, fd, c->file_len);
    } else if (c->reply_text && c->status < 400) {
        st_http_reply_buf(r, c->status ? c->status : 200, "application/json", c->reply_text,
                          c->reply_len);
    } else if (c->reply && c->status < 400) {
        st_http_reply_json(r, c->status ? c->status : 200, c->reply);
        c->reply = NULL;
    } else if (c->openai) {
        reply_openai_error(c, c->status ? c->status : 500);
    } else {
        st_http_reply_error(r, c->status ? c->status : 500, c->err_code[0] ? c->err_code : "internal",
                            "%s", c->err_msg ? c->err_msg : "no reply");
    }
}

static void job_run(st_job *j)
{
    st_api_call *c = (st_api_call *)((char *)j - offsetof(st_api_call, job));
    void (*fn)(st_api_call *) = c->ctx;
    c->ctx = NULL;
    fn(c);
    /* the loop only copies bytes: a large reply is serialised here */
    if (c->reply && c->status < 400) {
        c->reply_text = json_dumps(c->reply, ST_API_JSON_FLAGS);
        if (c->reply_text) {
            c->reply_len = strlen(c->reply_text);
            c->reply_text[c->reply_len++] = '\n'; /* the NUL becomes a newline */
        }
    }
}

static void job_done(st_job *j)
{
    st_api_call_reply((st_api_call *)((char *)j - offsetof(st_api_call, job)));
}

void st_api_call_cancel(st_api_call *c)
{
    c->no_reply = 1;
    c->status = 499; /* nginx's "client closed request": what the request metrics count */
    json_decref(c->reply);
    c->reply = NULL;
}

void st_api_call_submit(st_api_call *c, void (*fn)(st_api_call *c))
{
    c->ctx = (void *)fn;
    c->job.run = job_run;
    c->job.done = job_done;
    st_work_submit(c->srv->work, &c->job);
}

/* ---- JSON body helpers -------------------------------------------------------------------- */

int st_api_json_only(st_api_call *c, const char *const *keys)
{
    const char *k;
    json_t *v;
    if (!c->body)
        return 0;
    json_object_foreach(c->body, k, v) {
        int ok = 0;
        for (const char *const *p = keys; *p; p++)
            ok |= !strcmp(*p, k);
        if (!ok) {
            st_api_call_error(c, 400, "unknown_field", "unknown field \"%s\"", k);
            return -1;
        }
    }
    return 0;
}

int st_api_json_opt_u64(st_api_call *c, const char *key, uint64_t max, uint64_t *out, int *given)
{
    json_t *v = c->body ? json_object_get(c->body, key) : NULL;
    if (given)
        *given = 0;
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) > max) {
        st_api_call_error(c, 400, "invalid_field", "\"%s\" must be an integer from 0 to %llu", key,
                          (unsigned long long)max);
        return -1;
    }
    *out = (uint64_t)json_integer_value(v);
    if (given)
        *given = 1;
    return 0;
}

int st_api_json_opt_str(st_api_call *c, const char *key, const char **out)
{
    json_t *v = c->body ? json_object_get(c->body, key) : NULL;
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_string(v)) {
        st_api_call_error(c, 400, "invalid_field", "\"%s\" must be a string", key);
        return -1;
    }
    *out = json_string_value(v);
    return 0;
}

int st_api_json_opt_double(st_api_call *c, const char *key, double *out, int *given)
{
    json_t *v = c->body ? json_object_get(c->body, key) : NULL;
    if (given)
        *given = 0;
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_number(v)) {
        st_api_call_error(c, 400, "invalid_field", "\"%s\" must be a number", key);
        return -1;
    }
    *out = json_number_value(v);
    if (given)
        *given = 1;
    return 0;
}

int st_api_json_opt_bool(st_api_call *c, const char *key, int *out)
{
    json_t *v = c->body ? json_object_get(c->body, key) : NULL;
    if (!v || json_is_null(v))
        return 0;
    if (!json_is_boolean(v)) {
        st_api_call_error(c, 400, "invalid_field", "\"%s\" must be true or false", key);
        return -1;
    }
    *out = json_is_true(v);
    return 0;
}

/* Offset of the first byte of p[0..n) that does not belong to a well-formed UTF-8 sequence (RFC
 * 3629: no overlong forms, no surrogates, at most U+10FFFF), or n. */
static size_t utf8_invalid_at(const unsigned char *p, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = p[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        if (!len || i + len > n)
            return i;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1fu : len == 3 ? c & 0x0fu : c & 0x07u;
        for (size_t t = 1; t < len; t++) {
            if ((p[i + t] & 0xc0) != 0x80)
                return i;
            cp = (cp << 6) | (p[i + t] & 0x3fu);
        }
        if ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
            cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return i;
        i += len;
    }
    return n;
}

int st_api_body_parse(st_api_call *c, const char *p, size_t n)
{
    if (!n)
        return 0;
    size_t bad = utf8_invalid_at((const unsigned char *)p, n);
    if (bad < n) {
        st_api_call_error(c, 400, "invalid_json",
                          "request body is not valid UTF-8: byte 0x%02x at byte offset %zu", (unsigned char)p[bad], bad);
        return -1;
    }
    json_error_t e;
    c->body = json_loadb(p, n, JSON_REJECT_DUPLICATES, &e);
    if (!c->body) {
        st_api_call_error(c, 400, "invalid_json", "request body is not valid JSON: %s (line %d, column %d)",
                          e.text, e.line, e.column);
        return -1;
    }
    if (!json_is_object(c->body)) {
        st_api_call_error(c, 400, "invalid_json", "request body must be a JSON object");
        return -1;
    }
    return 0;
}


int st_api_call_parse_body(st_api_call *c)
{
    struct evbuffer *b = st_http_req_body(c->req);
    size_t n = b ? evbuffer_get_length(b) : 0;
    const char *p = n ? (const char *)evbuffer_pullup(b, (ev_ssize_t)n) : NULL;
    if (n && !p) {
        st_api_call_error(c, 500, "internal", "no memory for a request body of %zu bytes", n);
        return -1;
    }
    return st_api_body_parse(c, p, n);
}


/* ---- paths and queries -------------------------------------------------------------------- */

static int hexval(int ch)
{
    if (ch >= '0' && ch <= '9')
        return ch - '0';
    if (ch >= 'a' && ch <= 'f')
        return ch - 'a' + 10;
    if (ch >= 'A' && ch <= 'F')
        return ch - 'A' + 10;
    return -1;
}

/* Percent-decode n bytes into dst (NUL-terminated). -1 on a bad escape, an encoded NUL, or more
 * than cap - 1 bytes. plus: '+' means a space (query strings). */
long st_api_pct_decode(const char *s, size_t n, char *dst, size_t cap, int plus)
{
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        int ch = (unsigned char)s[i];
        if (ch == '%') {
            if (i + 2 >= n)
                return -1;
            int hi = hexval((unsigned char)s[i + 1]), lo = hexval((unsigned char)s[i + 2]);
            if (hi < 0 || lo < 0)
                return -1;
            ch = hi * 16 + lo;
            if (!ch)
                return -1;
            i += 2;
        } else if (plus && ch == '+') {
            ch = ' ';
        }
        if (o + 1 >= cap)
            return -1;
        dst[o++] = (char)ch;
    }
    dst[o] = '\0';
    return (long)o;
}

/* Value of key in a raw query string into dst; 1 found, 0 absent, -1 malformed. */
int st_api_query_get(const char *q, const char *key, char *dst, size_t cap)
{
    size_t kl = strlen(key);
    while (q && *q) {
        const char *amp = strchr(q, '&');
        size_t n = amp ? (size_t)(amp - q) : strlen(q);
        const char *eq = memchr(q, '=', n);
        size_t klen = eq ? (size_t)(eq - q) : n;
        if (klen == kl && !memcmp(q, key, kl)) {
            if (!eq) {
                dst[0] = '\0';
                return 1;
            }
            return st_api_pct_decode(eq + 1, n - klen - 1, dst, cap, 1) < 0 ? -1 : 1;
        }
        q = amp ? amp + 1 : NULL;
    }
    return 0;
}
