/*
 * st_server.c - strata-server: configuration, the router, authentication, the routes answered
 * on the loop (/healthz, /metrics), the store routes, uploads, and the graceful stop.
 *
 * Invariants:
 * 1. The loop thread never touches the disk, hashes, runs a codec or computes: a route either
 *    answers from memory on the loop (/healthz, /metrics, refusals) or runs on a worker and
 *    replies from the loop with what the worker left in its st_api_call.
 * 2. The order of checks on a request head is: credentials (except /healthz), path, route,
 *    method, ids, body length. Nothing of a body is read before all of them passed.
 * 3. No LMDB transaction outlives a store call, and no store call runs on the loop: a download
 *    is exported to a spool file by a worker first, then streamed from that file by the loop.
 * 4. Each upload is used by one request at a time (its busy flag, under uploads_mu).
 * 5. A call belongs to its request: it is freed with the request, after the one reply, which the
 *    loop sends only after the worker's done(). When the client goes away meanwhile (on_gone),
 *    the loop sets the call's atomic cancelled flag; only completions act on it (st_conv.c,
 *    invariant 7) and end with st_api_call_cancel, which sends nothing (status 499 in the
 *    metrics). Every other route runs to the end.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <event2/thread.h>

#include "st_api_int.h"
#include "st_file.h"
#include "st_store.h"

#define UPLOAD_ID_LEN 24

enum body_kind { BODY_NONE, BODY_JSON, BODY_COMPLETION, BODY_PART };

typedef struct st_route {
    unsigned method;
    const char *pattern;
    enum body_kind body;
    int on_loop;      /* answered from memory on the loop */
    int engine;       /* needs the engine */
    int no_auth;      /* answered without credentials */
    void (*fn)(st_api_call *c);
    int metric;
} st_route;

typedef struct st_upload {
    char id[UPLOAD_ID_LEN + 1];
    char path[PATH_MAX + 64];
    int fd;
    uint64_t size, prev_end; /* prev_end: size before the last part (for its retry) */
    uint32_t parts;
    double touched;
    int busy;
    struct st_upload *next;
} st_upload;

/* A session the start-up scan found damaged: quarantined for the life of the server. */
typedef struct st_api_damaged {
    char id[ST_STORE_ID_MAX + 1];
    char *why;
} st_api_damaged;

struct st_api_server {
    st_api_config cfg;
    struct event_base *base;
    st_http *http;
    st_work *work;
    st_store *store;
    st_conv *conv;
    unsigned lost;            /* live conversations the graceful stop could not write */
    st_metrics metrics;
    st_memguard guard;
    uint8_t key_hash[SHA256_DIGEST_LENGTH];
    int have_key;
    struct event *sig_term, *sig_int, *stop_ev, *tick, *housekeeping;
    int stopping;
    double stop_deadline;
    double t_start;
    char spool[PATH_MAX];
    pthread_mutex_t uploads_mu;
    st_upload *uploads;
    _Atomic uint64_t seq;
    int stat_running;
    int metric_none;
    st_api_damaged *damaged;   /* sorted by id; fixed before the server serves */
    size_t n_damaged, cap_damaged;
};

static const st_route *routes_table(size_t *n);

static int ev_threads_rc_value;
static void ev_threads_init_once(void)
{
    ev_threads_rc_value = evthread_use_pthreads();
}

/* ---- small things ------------------------------------------------------------------------ */

double st_api_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

double st_api_ms(double ms)
{
    return (double)(int64_t)(ms * 1000.0 + 0.5) / 1000.0;
}

int st_api_id_valid(const char *id, size_t len)
{
    if (!id || len == 0 || len > ST_API_ID_MAX)
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)id[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return 0;
    }
    return 1;
}

int st_api_have_engine(void)
{
#ifdef ST_API_HAVE_ENGINE
    return 1;
#else
    return 0;
#endif
}

st_metrics *st_api_metrics(st_api_server *s) { return &s->metrics; }
struct st_store *st_api_store(st_api_server *s) { return s->store; }

static int damaged_cmp(const void *a, const void *b)
{
    return strcmp(((const st_api_damaged *)a)->id, ((const st_api_damaged *)b)->id);
}

static const st_api_damaged *damaged_find(const st_api_server *s, const char *id)
{
    st_api_damaged key;
    if (!s->n_damaged || strlen(id) > ST_STORE_ID_MAX)
        return NULL;
    snprintf(key.id, sizeof key.id, "%s", id);
    return bsearch(&key, s->damaged, s->n_damaged, sizeof key, damaged_cmp);
}

int st_api_session_damaged(st_api_server *s, const char *id)
{
    char pid[ST_STORE_ID_MAX + 1];
    const st_api_damaged *d = damaged_find(s, id);
    if (!d && snprintf(pid, sizeof pid, "%s%s", ST_API_PARK_PREFIX, id) < (int)sizeof pid)
        d = damaged_find(s, pid);
    if (!d)
        return 0;
    return st_error_set(ST_EDAMAGED, "session %s is damaged in the store and quarantined since start-up (%s); "
                        "restore a backup with `statectl restore-backup`", id, d->why);
}

/* st_store_scan's report: one damaged session, kept (sorted once the scan ends). */
static void damaged_add(void *arg, const char *id, const char *why)
{
    st_api_server *s = arg;
    fprintf(stderr, "strata-server: session %s is damaged, quarantined: %s\n", id, why);
    if (s->n_damaged == s->cap_damaged) {
        size_t cap = s->cap_damaged ? 2 * s->cap_damaged : 16;
        st_api_damaged *nd = realloc(s->damaged, cap * sizeof *nd);
        if (!nd)
            return;
        s->damaged = nd;
        s->cap_damaged = cap;
    }
    st_api_damaged *d = &s->damaged[s->n_damaged];
    snprintf(d->id, sizeof d->id, "%s", id);
    if ((d->why = strdup(why)))
        s->n_damaged++;
}

/* The start-up scan (in a child process: a crash on a damaged page ends it, not the server):
 * damaged sessions are quarantined; damage to the whole store stops the start. */
static int store_scan(st_api_server *s, const char *dir, uint32_t *damaged_dbs)
{
    char path[PATH_MAX];
    *damaged_dbs = 0;
    if (snprintf(path, sizeof path, "%s/data.mdb", dir) >= (int)sizeof path || access(path, F_OK) != 0)
        return 0; /* a new store */
    st_store_scan_stats ss;
    int rc = st_store_scan(dir, NULL, damaged_add, s, &ss);
    if (rc)
        return rc;
    if (s->n_damaged)
        qsort(s->damaged, s->n_damaged, sizeof *s->damaged, damaged_cmp);
    if (s->n_damaged != ss.damaged)
        return st_error_set(ENOMEM, "no memory for the list of %llu damaged sessions",
                            (unsigned long long)ss.damaged);
    s->metrics.sessions_damaged = s->n_damaged;
    *damaged_dbs = ss.damaged_dbs;
    if (ss.damaged)
        fprintf(stderr, "strata-server: the store %s has %llu damaged sessions of %llu, quarantined (GET /healthz "
                "lists them; `statectl check` names the damage, `statectl restore-backup` repairs it)\n", dir,
                (unsigned long long)ss.damaged, (unsigned long long)ss.sessions);
    return 0;
}
const st_api_config *st_api_cfg(st_api_server *s) { return &s->cfg; }
const st_memguard *st_api_memguard(st_api_server *s) { return &s->guard; }
st_conv *st_api_conv(st_api_server *s) { return s->conv; }
unsigned st_api_server_lost(const st_api_server *s) { return s->lost; }
uint16_t st_api_server_port(const st_api_server *s) { return st_http_port(s->http); }

void st_api_config_default(st_api_config *c)
{
    memset(c, 0, sizeof *c);
    c->host = "127.0.0.1";
    c->port = 8080;
    c->workers = 8;
    c->slots = 4;
    c->conversation_cache_bytes = UINT64_C(1) << 30;
    c->kv_dtype = UINT32_MAX;
    c->state_codec = ST_CODEC_FP32;
    c->max_n_predict = 4096;
    c->busy_wait_ms = 30000;
    c->max_connections = 256;
    c->max_connections_per_peer = 64;
    c->max_header_bytes = 16u << 10;
    c->max_headers = 64;
    c->max_json_body = 64u << 10;
    c->max_completion_body = 4u << 20;
    c->max_part_bytes = 16u << 20;
    c->max_upload_bytes = UINT64_C(64) << 30;
    c->body_budget = 256u << 20;
    c->head_timeout_ms = 10000;
    c->read_timeout_ms = 30000;
    c->body_timeout_ms = 600000;
    c->min_body_rate = 1024;
    c->body_rate_window_ms = 10000;
    c->write_timeout_ms = 60000;
    c->idle_timeout_ms = 60000;
    c->shutdown_timeout_ms = 30000;
    c->upload_ttl_s = 3600;
    c->store_stat_ms = 10000;
    c->mem_guard = 1;
    c->mem_reserve_bytes = 256u << 20;
    c->handle_signals = 1;
}

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

static void call_free(void *user, void *arg)
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
static char *openai_error_fn(int status, const char *code, const char *msg, size_t *len)
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
static void call_reply(st_api_call *c)
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
    call_reply((st_api_call *)((char *)j - offsetof(st_api_call, job)));
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

/* Parse the request's body (st_api_body_parse); on a worker. */
static int call_parse_body(st_api_call *c)
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

static void parsed_run(st_api_call *c);

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
static long pct_decode(const char *s, size_t n, char *dst, size_t cap, int plus)
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
static int query_get(const char *q, const char *key, char *dst, size_t cap)
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
            return pct_decode(eq + 1, n - klen - 1, dst, cap, 1) < 0 ? -1 : 1;
        }
        q = amp ? amp + 1 : NULL;
    }
    return 0;
}

#define SEGS_MAX 8
#define SEG_CAP 512

typedef struct path_segs {
    int n;
    char s[SEGS_MAX][SEG_CAP];
} path_segs;

/* Split and decode the path. 0, 1 (too many or empty segments: matches no route), or -1 with
 * a message (bad encoding, dot segments). */
static int path_split(const char *path, path_segs *ps, const char **why)
{
    ps->n = 0;
    const char *p = path + 1;
    if (!*p)
        return 0; /* "/": no segments, the page */
    for (;;) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if ((n == 1 && p[0] == '.') || (n == 2 && p[0] == '.' && p[1] == '.')) {
            *why = "dot segments (. and ..) are not accepted in paths";
            return -1;
        }
        if (ps->n == SEGS_MAX)
            return 1;
        long dn = pct_decode(p, n, ps->s[ps->n], SEG_CAP, 0);
        if (dn < 0) {
            *why = n >= SEG_CAP ? "path segment too long"
                                : "bad percent-encoding in the path (or an encoded NUL)";
            return -1;
        }
        if (!strcmp(ps->s[ps->n], ".") || !strcmp(ps->s[ps->n], "..")) {
            *why = "dot segments (. and ..) are not accepted in paths";
            return -1;
        }
        if (dn == 0)
            return 1;
        ps->n++;
        if (!e)
            break;
        p = e + 1;
    }
    return 0;
}

/* Does pattern match ps? Fills the parameters of c when c is not NULL. */
static int route_match(const char *pattern, const path_segs *ps, st_api_call *c, const char **why)
{
    const char *p = pattern + 1;
    int i = 0;
    int param = 0;
    if (!*p)
        return ps->n == 0;
    for (;;) {
        const char *e = strchr(p, '/');
        size_t n = e ? (size_t)(e - p) : strlen(p);
        if (i >= ps->n)
            return 0;
        if (p[0] == '{') {
            if (c) {
                const char *s = ps->s[i];
                size_t sl = strlen(s);
                if (!strncmp(p, "{id}", 4)) {
                    if (!st_api_id_valid(s, sl)) {
                        *why = "invalid_id";
                        return -1;
                    }
                    memcpy(c->id, s, sl + 1);
                } else if (!strncmp(p, "{model}", 7)) {
                    if (sl >= sizeof c->model_id) {
                        *why = "invalid_param";
                        return -1;
                    }
                    memcpy(c->model_id, s, sl + 1);
                } else if (param == 0) {
                    if (sl >= sizeof c->arg2) {
                        *why = "invalid_param";
                        return -1;
                    }
                    memcpy(c->arg2, s, sl + 1);
                    param++;
                } else {
                    if (sl >= sizeof c->arg3) {
                        *why = "invalid_param";
                        return -1;
                    }
                    memcpy(c->arg3, s, sl + 1);
                }
            }
        } else if (strlen(ps->s[i]) != n || memcmp(ps->s[i], p, n)) {
            return 0;
        }
        i++;
        if (!e)
            break;
        p = e + 1;
    }
    return i == ps->n;
}

/* ---- authentication ----------------------------------------------------------------------- */

static int auth_ok(st_api_server *s, st_http_req *r)
{
    if (!s->have_key)
        return 1;
    const char *h = st_http_req_header(r, "Authorization");
    if (!h || strncasecmp(h, "Bearer ", 7))
        return 0;
    const char *tok = h + 7;
    while (*tok == ' ')
        tok++;
    uint8_t d[SHA256_DIGEST_LENGTH];
    SHA256((const unsigned char *)tok, strlen(tok), d);
    /* equal-length digests compared in constant time: neither the key's length nor its bytes
     * show in the time a refusal takes */
    return CRYPTO_memcmp(d, s->key_hash, sizeof d) == 0;
}

/* ---- the HTTP callbacks ------------------------------------------------------------------- */

/* Whether path lies under one of OpenAI's API resources (/v1/chat/..., /v1/models/..., and those
 * this server does not have: /v1/embeddings, ...): its refusals are in OpenAI's error shape, so
 * that an OpenAI client reads them. /v1/uploads is the native upload route's. */
static int openai_path(const char *path)
{
    static const char *const res[] = {
        "chat", "completions", "models", "embeddings", "responses", "audio", "images", "files",
        "moderations", "fine_tuning", "fine-tunes", "batches", "assistants", "threads",
        "vector_stores", "realtime", "evals", "containers", "conversations", "organization",
        "engines", "edits", NULL};
    if (strncmp(path, "/v1/", 4))
        return 0;
    const char *p = path + 4, *e = strchr(p, '/');
    size_t n = e ? (size_t)(e - p) : strlen(p);
    for (const char *const *r = res; *r; r++)
        if (strlen(*r) == n && !memcmp(*r, p, n))
            return 1;
    return 0;
}

static int on_head(st_http_req *r, uint64_t *body_max, void *arg)
{
    st_api_server *s = arg;
    size_t nr = 0;
    const st_route *rt = routes_table(&nr);
    path_segs *ps = malloc(sizeof *ps);
    st_api_call *c = calloc(1, sizeof *c);
    if (openai_path(st_http_req_path(r)))
        st_http_req_set_error_fn(r, openai_error_fn);
    if (!ps || !c) {
        free(ps);
        free(c);
        st_http_reply_error(r, 503, "out_of_memory", "no memory");
        return 1;
    }
    c->srv = s;
    c->req = r;
    c->file_fd = -1;
    c->route = -1;
    st_http_req_set_user(r, c);
    const char *why = NULL;
    int sp = path_split(st_http_req_path(r), ps, &why);
    /* which routes have this path shape, and which of them this method */
    int found = -1, shape = 0;
    unsigned allowed = 0;
    if (sp == 0) {
        for (size_t i = 0; i < nr; i++) {
            const char *w = NULL;
            if (route_match(rt[i].pattern, ps, NULL, &w) == 1) {
                shape = 1;
                allowed |= rt[i].method;
                if (rt[i].method == st_http_req_method(r))
                    found = (int)i;
            }
        }
    }
    if (!(found >= 0 && rt[found].no_auth) && !auth_ok(s, r)) {
        st_http_header_add(r, "WWW-Authenticate", "Bearer");
        st_http_reply_error(r, 401, "unauthorized", "missing or wrong bearer token");
        goto replied;
    }
    if (sp < 0) {
        st_http_reply_error(r, 400, "invalid_path", "%s", why);
        goto replied;
    }
    if (!shape) {
        st_http_reply_error(r, 404, "not_found", "no route %s", st_http_req_path(r));
        goto replied;
    }
    if (found < 0) {
        char allow[96] = "";
        static const char *names[] = {"GET", "HEAD", "POST", "PUT", "DELETE", "OPTIONS", "PATCH"};
        for (int b = 0; b < 7; b++)
            if (allowed & (1u << b))
                snprintf(allow + strlen(allow), sizeof allow - strlen(allow), "%s%s",
                         allow[0] ? ", " : "", names[b]);
        st_http_header_add(r, "Allow", allow);
        st_http_reply_error(r, 405, "method_not_allowed", "%s is not allowed on %s (allowed: %s)",
                            st_http_req_method_name(r), st_http_req_path(r), allow);
        goto replied;
    }
    c->route = found;
    if (route_match(rt[found].pattern, ps, c, &why) != 1) {
        if (!strcmp(why, "invalid_id"))
            st_http_reply_error(r, 400, "invalid_id",
                                "session ids are 1 to %d characters of A-Z a-z 0-9 . _ - and start "
                                "with a letter or digit",
                                ST_API_ID_MAX);
        else
            st_http_reply_error(r, 400, "invalid_param", "path parameter too long");
        goto replied;
    }
    if (c->id[0] && st_api_session_damaged(s, c->id)) {
        st_http_reply_error(r, 500, "session_damaged", "%s", st_errdetail());
        goto replied;
    }
    if (rt[found].engine && !st_api_have_engine()) {
        st_http_reply_error(r, 501, "no_engine", "this build of strata-server has no engine");
        goto replied;
    }
    if (rt[found].engine && !s->conv) {
        st_http_reply_error(r, 501, "no_engine",
                            "this server runs without a model: start it with --model FILE");
        goto replied;
    }
    switch (rt[found].body) {
    case BODY_NONE: *body_max = 0; break;
    case BODY_JSON: *body_max = s->cfg.max_json_body; break;
    case BODY_COMPLETION: *body_max = s->cfg.max_completion_body; break;
    case BODY_PART:
        *body_max = s->cfg.max_part_bytes;
        st_http_req_set_bulk(r); /* parts never take the room kept for completions */
        break;
    }
    free(ps);
    return 0;
replied:
    free(ps);
    return 1;
}

static void parsed_run(st_api_call *c)
{
    size_t nr = 0;
    const st_route *rt = routes_table(&nr);
#ifdef ST_API_HAVE_ENGINE
    /* the OpenAI routes answer in OpenAI's error shape from the body's parse on (POST
     * /v1/completions too: until its body says which shape it has, st_openai_completions) */
    c->openai = rt[c->route].fn == st_openai_chat || rt[c->route].fn == st_openai_models ||
                rt[c->route].fn == st_openai_model_get || rt[c->route].fn == st_openai_completions;
#endif
    if (rt[c->route].body == BODY_JSON || rt[c->route].body == BODY_COMPLETION) {
        if (call_parse_body(c))
            return;
    }
    rt[c->route].fn(c);
}

static void on_request(st_http_req *r, void *arg)
{
    st_api_server *s = arg;
    st_api_call *c = st_http_req_user(r);
    size_t nr = 0;
    const st_route *rt = routes_table(&nr);
    (void)s;
    if (rt[c->route].on_loop) {
        rt[c->route].fn(c);
        call_reply(c);
        return;
    }
    st_api_call_submit(c, parsed_run);
}

static void on_done(st_http_req *r, void *arg)
{
    st_api_server *s = arg;
    st_api_call *c = st_http_req_user(r);
    size_t nr = 0;
    const st_route *rt = routes_table(&nr);
    int metric = c && c->route >= 0 ? rt[c->route].metric : s->metric_none;
    double ms = st_http_req_elapsed_ms(r);
    st_metrics_request(&s->metrics, metric, st_http_req_status(r), ms);
    if (s->cfg.log_requests)
        fprintf(stderr, "strata-server: %s %s %s %d %.3f ms %llu bytes\n", st_http_req_peer(r),
                st_http_req_method_name(r), st_http_req_path(r), st_http_req_status(r), ms,
                (unsigned long long)st_http_req_bytes_out(r));
}

/* The client went away while its request is in flight (on the loop): the worker sees the flag.
 * c lives until the request's reply, after the worker's done() (st_http.c invariants 2, 5). */
static void on_gone(st_http_req *r, void *arg)
{
    st_api_call *c = st_http_req_user(r);
    (void)arg;
    if (c)
        atomic_store_explicit(&c->cancelled, 1, memory_order_relaxed);
}

static void on_refused(int status, const char *code, void *arg)
{
    st_api_server *s = arg;
    (void)code;
    st_metrics_refused(&s->metrics, status);
    if (s->cfg.log_requests)
        fprintf(stderr, "strata-server: refused before routing: %d\n", status);
}

/* ---- routes answered on the loop ---------------------------------------------------------- */

static void h_healthz(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_metrics *m = &s->metrics;
    c->status = s->stopping ? 503 : 200;
    c->reply = json_pack("{s:s,s:f,s:b,s:i,s:i,s:{s:i,s:i,s:i},s:{s:I,s:I,s:I}}", "status",
                         s->stopping ? "stopping" : "ok", "uptime_s",
                         st_api_ms(st_api_now_ms() - s->t_start) / 1000.0, "engine", s->conv != NULL,
                         "connections", (int)st_http_n_connections(s->http), "jobs",
                         (int)st_work_outstanding(s->work), "slots", "total", (int)m->slots_total,
                         "bound", (int)m->slots_bound, "busy", (int)m->slots_busy, "park_pool",
                         "ram_bytes", (json_int_t)m->pool_ram_bytes, "ram_entries",
                         (json_int_t)m->pool_ram_entries, "disk_entries",
                         (json_int_t)m->pool_disk_entries);
    json_t *dmg = json_array();
    for (size_t i = 0; i < s->n_damaged; i++)
        json_array_append_new(dmg, json_pack("{s:s,s:s}", "id", s->damaged[i].id, "why", s->damaged[i].why));
    json_object_set_new(c->reply, "damaged_sessions", dmg);
    if (s->stopping) { /* a 503 goes out as an error body */
        st_api_call_error(c, 503, "stopping", "the server is shutting down");
    }
}

static void h_metrics(st_api_call *c)
{
    st_api_server *s = c->srv;
    c->text = evbuffer_new();
    if (!c->text) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    c->file_ctype = "text/plain; version=0.0.4; charset=utf-8";
    c->status = 200;
    st_http_stats hs;
    st_http_stats_get(s->http, &hs);
    st_metrics_render(&s->metrics, c->text, &hs, st_work_outstanding(s->work), st_work_queued(s->work));
}

/* The web page (api/web/index.html, embedded at build time), without credentials: it holds no
 * data and asks for the key. */
extern const unsigned char st_web_page[];
extern const size_t st_web_page_len;

static void h_page(st_api_call *c)
{
    c->text = evbuffer_new();
    if (!c->text || evbuffer_add_reference(c->text, st_web_page, st_web_page_len, NULL, NULL)) {
        if (c->text)
            evbuffer_free(c->text);
        c->text = NULL;
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    c->file_ctype = "text/html; charset=utf-8";
    c->status = 200;
}

/* ---- store routes (workers) --------------------------------------------------------------- */

static void iso_time(uint64_t ns, char *dst, size_t cap)
{
    time_t t = (time_t)(ns / 1000000000u);
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(dst, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(dst + n, cap - n, ".%03uZ", (unsigned)((ns / 1000000u) % 1000u));
}

static json_t *session_json(const st_session_info *si)
{
    char cr[40], up[40], fp[17];
    if (si->damaged)
        return json_pack("{s:s,s:b}", "id", si->id, "damaged", 1);
    iso_time(si->created_ns, cr, sizeof cr);
    iso_time(si->updated_ns, up, sizeof up);
    for (int i = 0; i < 8; i++)
        snprintf(fp + 2 * i, 3, "%02x", si->model_fp[i]);
    json_t *labels = json_object();
    for (uint32_t i = 0; i < si->n_labels; i++)
        json_object_set_new(labels, si->labels[i].name, json_integer((json_int_t)si->labels[i].version));
    return json_pack("{s:s,s:I,s:I,s:s,s:s,s:s,s:o}", "id", si->id, "head", (json_int_t)si->head,
                     "versions", (json_int_t)si->n_versions, "created", cr, "updated", up, "model", fp,
                     "labels", labels);
}

static json_t *version_json(const st_version_info *vi)
{
    char cr[40];
    iso_time(vi->created_ns, cr, sizeof cr);
    json_t *codecs = json_array();
    for (uint32_t c = 0; c < 32; c++)
        if (vi->codecs & (1u << c))
            json_array_append_new(codecs, json_string((1u << c) == ST_VERSION_CODEC_OTHER ? "other" : st_codec_name(c)));
    return json_pack("{s:I,s:s,s:I,s:I,s:I,s:i,s:I,s:i,s:i,s:i,s:o,s:s,s:o,s:i}", "version", (json_int_t)vi->version,
                     "created", cr, "tokens", (json_int_t)vi->n_tokens, "logical_bytes",
                     (json_int_t)vi->logical_bytes, "stored_bytes", (json_int_t)vi->stored_bytes,
                     "checkpoints", (int)vi->n_checkpoints, "last_position",
                     (json_int_t)vi->last_position, "chunks", (int)vi->n_chunks, "compress",
                     (int)vi->compress, "file_version", (int)vi->file_version, "architecture",
                     vi->arch[0] ? json_string(vi->arch) : json_null(), "codec", st_codec_name(vi->codec),
                     "codecs", codecs, "framed_chunks", (int)vi->n_framed);
}

/* Where a session lives in the engine: a "live" object or JSON null. */
static json_t *live_json(st_api_server *s, const char *id)
{
#ifdef ST_API_HAVE_ENGINE
    uint64_t tokens = 0, bytes = 0;
    const char *w = s->conv ? st_conv_where(s->conv, id, &tokens, &bytes) : NULL;
    if (w)
        return json_pack("{s:s,s:I,s:I}", "where", w, "tokens", (json_int_t)tokens, "bytes", (json_int_t)bytes);
#else
    (void)s;
    (void)id;
#endif
    return json_null();
}

/* ---- listings: cursor pagination --------------------------------------------------------------
 * GET /v1/sessions and GET /v1/sessions/{id}/versions take ?limit=N (1..LIST_LIMIT_MAX, default
 * LIST_LIMIT_DEFAULT) and ?after=CURSOR, and answer a page plus "next": the cursor of the page's
 * last entry when more follow, else null. The store is read one page at a time
 * (st_store_list_page, st_store_versions_page): a page costs O(limit) records, never the whole
 * store. One more entry than the page is fetched, so "next" is null exactly on the last page. */
#define LIST_LIMIT_DEFAULT 100
#define LIST_LIMIT_MAX 1000

/* ?limit: 0 with *limit set, or the call's 400 and -1. */
static int query_limit(st_api_call *c, size_t *limit)
{
    char v[16];
    int q = query_get(st_http_req_query(c->req), "limit", v, sizeof v);
    *limit = LIST_LIMIT_DEFAULT;
    if (q == 0)
        return 0;
    size_t x = 0;
    int ok = q == 1 && v[0];
    for (const char *p = v; ok && *p; p++) {
        ok = *p >= '0' && *p <= '9' && x <= LIST_LIMIT_MAX;
        x = x * 10 + (size_t)(*p - '0');
    }
    if (!ok || x < 1 || x > LIST_LIMIT_MAX) {
        st_api_call_error(c, 400, "invalid_param", "limit must be a whole number from 1 to %d",
                          LIST_LIMIT_MAX);
        return -1;
    }
    *limit = x;
    return 0;
}

/* ?after for sessions: a session id (API syntax) into dst, or "" when absent. */
static int query_after_id(st_api_call *c, char *dst, size_t cap)
{
    int q = query_get(st_http_req_query(c->req), "after", dst, cap);
    if (q == 0) {
        dst[0] = '\0';
        return 0;
    }
    /* a position, not a session that must exist: any id the store can hold (a `next` may name a
     * session made with `statectl import --id`, whose ids the store allows more of) */
    if (q < 0 || !st_store_id_valid(dst)) {
        st_api_call_error(c, 400, "invalid_param",
                          "after must be a session id as the store keeps them (1 to %d characters "
                          "of A-Z a-z 0-9 . _ : + = -; percent-encode + and =)",
                          ST_STORE_ID_MAX);
        return -1;
    }
    return 0;
}

/* ?after for versions: a version number (0: before the first), 0 when absent. */
static int query_after_version(st_api_call *c, uint64_t *after)
{
    char v[24];
    int q = query_get(st_http_req_query(c->req), "after", v, sizeof v);
    *after = 0;
    if (q == 0)
        return 0;
    uint64_t x = 0;
    int ok = q == 1 && v[0] && strlen(v) <= 18;
    for (const char *p = v; ok && *p; p++) {
        ok = *p >= '0' && *p <= '9';
        x = x * 10 + (uint64_t)(*p - '0');
    }
    if (!ok) {
        st_api_call_error(c, 400, "invalid_param",
                          "after must be a version number (0 to 999999999999999999)");
        return -1;
    }
    *after = x;
    return 0;
}

#ifdef ST_API_HAVE_ENGINE
/* A conversation live in the engine with no saved version. */
typedef struct live_only {
    const char *id; /* borrowed from the live array */
    json_t *entry;
} live_only;

static int cmp_live_only(const void *a, const void *b)
{
    return strcmp(((const live_only *)a)->id, ((const live_only *)b)->id);
}

static int cmp_info_id(const void *key, const void *elem)
{
    return strcmp((const char *)key, ((const st_session_info *)elem)->id);
}
#endif

static void h_sessions_list(st_api_call *c)
{
    st_api_server *s = c->srv;
    size_t limit;
    char after[ST_STORE_ID_MAX + 1];
    if (query_limit(c, &limit) || query_after_id(c, after, sizeof after))
        return;
    /* limit + 1 sessions visible to the API (disk-parked "park:" ones are skipped), read page by
     * page from `after` */
    size_t want = limit + 1, have = 0;
    int exhausted = 0;
    st_session_info *arr = malloc(want * sizeof *arr);
    char pos[ST_STORE_ID_MAX + 1];
    json_t *list = NULL, *live = NULL;
    live_only *lo = NULL;
    size_t n_lo = 0;
    if (!arr) {
        st_api_call_error(c, 503, "out_of_memory", "no memory for a page of %zu sessions", limit);
        return;
    }
    snprintf(pos, sizeof pos, "%s", after);
    while (have < want && !exhausted) {
        size_t got = 0;
        int rc = st_store_list_page(s->store, pos, arr + have, want - have, &got);
        if (rc) {
            st_api_call_fail(c, rc, "listing sessions");
            goto done;
        }
        exhausted = got < want - have;
        if (got)
            snprintf(pos, sizeof pos, "%s", arr[have + got - 1].id);
        for (size_t i = have, end = have + got; i < end; i++)
            if (strncmp(arr[i].id, ST_API_PARK_PREFIX, strlen(ST_API_PARK_PREFIX)))
                arr[have++] = arr[i];
    }
#ifdef ST_API_HAVE_ENGINE
    if (s->conv) {
        /* conversations that live only in the engine (never saved) take their place in id order:
         * those after `after`, and, unless the store ran out, before the last session read (past
         * it, limit + 1 entries precede them already) */
        live = json_array();
        st_conv_list_live(s->conv, live);
        lo = malloc((json_array_size(live) + 1) * sizeof *lo);
        if (!lo) {
            st_api_call_error(c, 503, "out_of_memory", "no memory for the live conversations");
            goto done;
        }
        size_t i;
        json_t *e;
        json_array_foreach(live, i, e) {
            const char *id = json_string_value(json_object_get(e, "id"));
            if (!id || strcmp(id, after) <= 0 || (have && bsearch(id, arr, have, sizeof *arr, cmp_info_id)))
                continue;
            if (!exhausted && strcmp(id, arr[have - 1].id) >= 0)
                continue;
            lo[n_lo++] = (live_only){id, e};
        }
        qsort(lo, n_lo, sizeof *lo, cmp_live_only);
    }
#endif
    list = json_array();
    size_t i = 0, j = 0, out = 0;
    const char *last = NULL;
    while (out < limit && (i < have || j < n_lo)) {
#ifdef ST_API_HAVE_ENGINE
        if (j < n_lo && (i == have || strcmp(lo[j].id, arr[i].id) < 0)) {
            json_t *e = lo[j++].entry;
            const char *id = json_string_value(json_object_get(e, "id"));
            if (last && !strcmp(last, id))
                continue; /* in a slot and in the pool at once: listed once */
            json_array_append_new(list, json_pack("{s:s,s:i,s:i,s:{s:O,s:O,s:O}}", "id", id, "head", 0,
                                                  "versions", 0, "live", "where",
                                                  json_object_get(e, "where"), "tokens",
                                                  json_object_get(e, "tokens"), "bytes",
                                                  json_object_get(e, "bytes")));
            last = id;
            out++;
            continue;
        }
#endif
        json_t *o = session_json(&arr[i]);
        json_object_set_new(o, "live", live_json(s, arr[i].id));
        json_array_append_new(list, o);
        last = arr[i++].id;
        out++;
    }
    /* more follow when an entry is left over (a duplicate live id left over does not count) */
    int more = i < have;
#ifdef ST_API_HAVE_ENGINE
    for (; !more && j < n_lo; j++)
        more = !last || strcmp(lo[j].id, last) != 0;
#endif
    c->reply = json_pack("{s:o,s:o}", "sessions", list, "next", more ? json_string(last) : json_null());
    list = NULL;
    c->status = 200;
done:
    json_decref(list);
    json_decref(live);
    free(lo);
    free(arr);
}

static void h_session_get(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_session_info si;
    int rc = st_store_show(s->store, c->id, &si);
    json_t *live = live_json(s, c->id);
    if (rc == ST_ENOTFOUND && !json_is_null(live)) {
        c->reply = json_pack("{s:s,s:i,s:i,s:o}", "id", c->id, "head", 0, "versions", 0, "live", live);
        c->status = 200;
        return;
    }
    if (rc) {
        json_decref(live);
        st_api_call_fail(c, rc, "session");
        return;
    }
    c->reply = session_json(&si);
    json_object_set_new(c->reply, "live", live);
    c->status = 200;
}

static void h_versions(st_api_call *c)
{
    size_t limit, n = 0;
    uint64_t after;
    if (query_limit(c, &limit) || query_after_version(c, &after))
        return;
    st_version_info *vi = malloc((limit + 1) * sizeof *vi);
    if (!vi) {
        st_api_call_error(c, 503, "out_of_memory", "no memory for a page of %zu versions", limit);
        return;
    }
    int rc = st_store_versions_page(c->srv->store, c->id, after, vi, limit + 1, &n);
    if (rc) {
        free(vi);
        st_api_call_fail(c, rc, "versions");
        return;
    }
    json_t *list = json_array();
    for (size_t i = 0; i < n && i < limit; i++)
        json_array_append_new(list, version_json(&vi[i]));
    json_t *next = n > limit ? json_integer((json_int_t)vi[limit - 1].version) : json_null();
    free(vi);
    c->reply = json_pack("{s:s,s:o,s:o}", "session", c->id, "versions", list, "next", next);
    c->status = 200;
}

/* {v}: a version number >= 1, or "latest" / "head" (0). */
static int parse_version(st_api_call *c, const char *s, uint64_t *v)
{
    if (!strcmp(s, "latest") || !strcmp(s, "head")) {
        *v = 0;
        return 0;
    }
    uint64_t x = 0;
    if (!*s || strlen(s) > 18)
        goto bad;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad;
        x = x * 10 + (uint64_t)(*p - '0');
    }
    if (!x)
        goto bad;
    *v = x;
    return 0;
bad:
    st_api_call_error(c, 400, "invalid_version", "version must be a number from 1, or \"latest\"");
    return -1;
}

static void h_version_get(st_api_call *c)
{
    uint64_t v;
    if (parse_version(c, c->arg2, &v))
        return;
    st_version_info vi;
    int rc = st_store_version_info(c->srv->store, c->id, v, &vi);
    if (rc) {
        st_api_call_fail(c, rc, "version");
        return;
    }
    c->reply = version_json(&vi);
    json_object_set_new(c->reply, "session", json_string(c->id));
    c->status = 200;
}

static void h_session_delete(st_api_call *c)
{
    st_api_server *s = c->srv;
    int live_found = 0;
#ifdef ST_API_HAVE_ENGINE
    /* the live conversation is held (busy) until the versions are gone, so that a request waiting
     * for it cannot load the head version this DELETE is removing */
    st_conv_hold hold = {-1, NULL, NULL, NULL};
    if (s->conv) {
        int rc = st_conv_forget_begin(s->conv, c->id, &hold);
        if (rc) {
            st_api_call_fail(c, rc, "deleting the live conversation");
            return;
        }
        live_found = st_conv_hold_live(&hold);
    }
#endif
    st_session_info si;
    uint64_t versions = 0;
    int rc = st_store_show(s->store, c->id, &si);
    if (!rc) {
        versions = si.n_versions;
        rc = st_store_session_delete(s->store, c->id);
    }
    if (rc == ST_ENOTFOUND && live_found)
        rc = 0;
    if (rc)
        st_api_call_fail(c, rc, "deleting the session"); /* before forget_end replaces the detail */
#ifdef ST_API_HAVE_ENGINE
    if (s->conv) {
        if (rc && rc != ST_ENOTFOUND) /* the versions are still there: keep the live one too */
            st_conv_forget_abort(s->conv, &hold);
        else
            st_conv_forget_end(s->conv, &hold);
    }
#endif
    if (rc)
        return;
    c->reply = json_pack("{s:s,s:b,s:I,s:b}", "session", c->id, "deleted", 1, "versions_deleted",
                         (json_int_t)versions, "live_deleted", live_found);
    c->status = 200;
}

static void h_version_delete(st_api_call *c)
{
    uint64_t v;
    if (parse_version(c, c->arg2, &v))
        return;
    if (!v) {
        st_version_info vi;
        int rc = st_store_version_info(c->srv->store, c->id, 0, &vi);
        if (rc) {
            st_api_call_fail(c, rc, "version");
            return;
        }
        v = vi.version;
    }
    int rc = st_store_version_delete(c->srv->store, c->id, v);
    if (rc) {
        st_api_call_fail(c, rc, "deleting the version");
        return;
    }
    c->reply = json_pack("{s:s,s:I,s:b}", "session", c->id, "version", (json_int_t)v, "deleted", 1);
    c->status = 200;
}

static void spool_path(st_api_server *s, const char *kind, char *dst, size_t cap)
{
    uint64_t n = ++s->seq;
    snprintf(dst, cap, "%s/%s-%d-%llu.tmp", s->spool, kind, (int)getpid(), (unsigned long long)n);
}

static void h_version_file(st_api_call *c)
{
    st_api_server *s = c->srv;
    uint64_t v;
    if (parse_version(c, c->arg2, &v))
        return;
    char fmt[16] = "";
    int q = query_get(st_http_req_query(c->req), "format", fmt, sizeof fmt);
    st_file_write_opts fo = {0};
    const st_file_write_opts *fop = NULL;
    if (q < 0 || (q == 1 && strcmp(fmt, "v1") && strcmp(fmt, "v2") && strcmp(fmt, "auto"))) {
        st_api_call_error(c, 400, "invalid_param", "format must be v1, v2 or auto");
        return;
    }
    if (q == 1 && strcmp(fmt, "auto")) {
        fo.version = fmt[1] == '1' ? ST_FILE_VERSION_1 : ST_FILE_VERSION_2;
        fop = &fo;
    }
    st_version_info vi;
    int rc = st_store_version_info(s->store, c->id, v, &vi);
    if (rc) {
        st_api_call_fail(c, rc, "version");
        return;
    }
    if ((rc = st_memguard_admit(&s->guard, "download (export)", vi.logical_bytes))) {
        st_api_call_fail(c, rc, "download");
        return;
    }
    char path[PATH_MAX + 64];
    spool_path(s, "dl", path, sizeof path);
    double t0 = st_api_now_ms();
    if ((rc = st_store_export(s->store, c->id, vi.version, path, fop))) {
        unlink(path);
        st_api_call_fail(c, rc, "exporting the session file");
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        rc = errno;
        if (fd >= 0)
            close(fd);
        unlink(path);
        st_api_call_error(c, 500, "internal", "reading the exported file: %s", strerror(rc));
        return;
    }
    unlink(path); /* the open descriptor keeps the bytes until the reply is sent */
    c->file_fd = fd;
    c->file_len = (uint64_t)sb.st_size;
    c->file_ctype = "application/octet-stream";
    c->status = 200;
    char disp[ST_API_ID_MAX + 80], num[32], ms[32];
    snprintf(disp, sizeof disp, "attachment; filename=\"%s-v%llu.stsf\"", c->id,
             (unsigned long long)vi.version);
    snprintf(num, sizeof num, "%llu", (unsigned long long)vi.version);
    snprintf(ms, sizeof ms, "%.3f", st_api_now_ms() - t0);
    /* headers are added on the loop: st_http_header_add is not thread-safe, but the request is
     * not touched by the loop while its job runs (invariant 1 of st_api_int.h) */
    st_http_header_add(c->req, "Content-Disposition", disp);
    st_http_header_add(c->req, "X-Strata-Version", num);
    st_http_header_add(c->req, "X-Strata-Export-Ms", ms);
    s->metrics.downloads++;
    s->metrics.download_bytes += (uint64_t)sb.st_size;
}

/* ---- uploads -------------------------------------------------------------------------------- */

#define UPLOADS_MAX 64

static st_upload *upload_find_locked(st_api_server *s, const char *id)
{
    for (st_upload *u = s->uploads; u; u = u->next)
        if (!strcmp(u->id, id))
            return u;
    return NULL;
}

static void upload_unlink_locked(st_api_server *s, st_upload *u)
{
    for (st_upload **pp = &s->uploads; *pp; pp = &(*pp)->next)
        if (*pp == u) {
            *pp = u->next;
            break;
        }
}

static void upload_destroy(st_upload *u)
{
    if (!u)
        return;
    if (u->fd >= 0)
        close(u->fd);
    unlink(u->path);
    free(u);
}

/* Take upload c->arg2 for this request (busy). NULL with the call's error set. */
static st_upload *upload_take(st_api_call *c)
{
    st_api_server *s = c->srv;
    pthread_mutex_lock(&s->uploads_mu);
    st_upload *u = upload_find_locked(s, c->arg2);
    if (u && u->busy) {
        pthread_mutex_unlock(&s->uploads_mu);
        st_api_call_error(c, 409, "busy", "upload %s is in use by another request", c->arg2);
        return NULL;
    }
    if (u)
        u->busy = 1;
    pthread_mutex_unlock(&s->uploads_mu);
    if (!u)
        st_api_call_error(c, 404, "not_found", "no upload %s", c->arg2);
    return u;
}

static void upload_give(st_api_server *s, st_upload *u)
{
    pthread_mutex_lock(&s->uploads_mu);
    u->busy = 0;
    u->touched = st_api_now_ms();
    pthread_mutex_unlock(&s->uploads_mu);
}

static void h_upload_create(st_api_call *c)
{
    st_api_server *s = c->srv;
    static const char *const keys[] = {NULL};
    if (st_api_json_only(c, keys))
        return;
    st_upload *u = calloc(1, sizeof *u);
    unsigned char rnd[UPLOAD_ID_LEN / 2];
    if (!u) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    u->fd = -1;
    int rfd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (rfd < 0 || read(rfd, rnd, sizeof rnd) != (ssize_t)sizeof rnd) {
        if (rfd >= 0)
            close(rfd);
        free(u);
        st_api_call_error(c, 500, "internal", "no random bytes for an upload id");
        return;
    }
    close(rfd);
    for (size_t i = 0; i < sizeof rnd; i++)
        snprintf(u->id + 2 * i, 3, "%02x", rnd[i]);
    snprintf(u->path, sizeof u->path, "%s/up-%s.tmp", s->spool, u->id);
    u->fd = open(u->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (u->fd < 0) {
        int e = errno;
        free(u);
        st_api_call_error(c, e == ENOSPC ? 507 : 500, e == ENOSPC ? "disk_full" : "internal",
                          "creating the upload file: %s", strerror(e));
        return;
    }
    u->touched = st_api_now_ms();
    pthread_mutex_lock(&s->uploads_mu);
    unsigned n = 0;
    for (st_upload *x = s->uploads; x; x = x->next)
        n++;
    if (n >= UPLOADS_MAX) {
        pthread_mutex_unlock(&s->uploads_mu);
        upload_destroy(u);
        st_api_call_error(c, 429, "too_many_uploads", "%d uploads are open; commit or delete one",
                          UPLOADS_MAX);
        return;
    }
    u->next = s->uploads;
    s->uploads = u;
    pthread_mutex_unlock(&s->uploads_mu);
    c->reply = json_pack("{s:s,s:i,s:I,s:I}", "upload", u->id, "next_part", 1, "max_part_bytes",
                         (json_int_t)s->cfg.max_part_bytes, "max_upload_bytes",
                         (json_int_t)s->cfg.max_upload_bytes);
    c->status = 201;
}

static int write_all_at(int fd, struct evbuffer *b, uint64_t off)
{
    size_t total = evbuffer_get_length(b);
    size_t done = 0;
    while (done < total) {
        struct evbuffer_iovec v[16];
        struct evbuffer_ptr ptr;
        evbuffer_ptr_set(b, &ptr, done, EVBUFFER_PTR_SET);
        int nv = evbuffer_peek(b, (ev_ssize_t)(total - done), &ptr, v, 16);
        if (nv <= 0)
            return EIO;
        struct iovec io[16];
        for (int i = 0; i < nv && i < 16; i++) {
            io[i].iov_base = v[i].iov_base;
            io[i].iov_len = v[i].iov_len;
        }
        ssize_t w = pwritev(fd, io, nv < 16 ? nv : 16, (off_t)(off + done));
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno;
        }
        if (w == 0)
            return EIO;
        done += (size_t)w;
    }
    return 0;
}

static void h_upload_part(st_api_call *c)
{
    st_api_server *s = c->srv;
    uint64_t n = 0;
    const char *p = c->arg3;
    if (!*p || strlen(p) > 9)
        goto bad;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad;
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (!n)
        goto bad;
    st_upload *u = upload_take(c);
    if (!u)
        return;
    uint64_t off;
    int retry = 0;
    if (n == (uint64_t)u->parts + 1) {
        off = u->size;
    } else if (n == u->parts && u->parts > 0) {
        off = u->prev_end; /* the last part again (a retry): it replaces the previous one */
        retry = 1;
    } else {
        st_api_call_error(c, 409, "part_order", "parts go in order: expected part %u (or %u again)",
                          u->parts + 1, u->parts);
        upload_give(s, u);
        return;
    }
    struct evbuffer *b = st_http_req_body(c->req);
    uint64_t len = b ? evbuffer_get_length(b) : 0;
    if (off + len > s->cfg.max_upload_bytes) {
        st_api_call_error(c, 413, "upload_too_large", "the upload would exceed %llu bytes",
                          (unsigned long long)s->cfg.max_upload_bytes);
        upload_give(s, u);
        return;
    }
    int rc = len ? write_all_at(u->fd, b, off) : 0;
    if (!rc && ftruncate(u->fd, (off_t)(off + len)) != 0)
        rc = errno;
    if (rc) {
        if (ftruncate(u->fd, (off_t)u->size) != 0) { /* leave it as it was */
        }
        st_api_call_error(c, rc == ENOSPC ? 507 : 500, rc == ENOSPC ? "disk_full" : "internal",
                          "writing part %llu: %s", (unsigned long long)n, strerror(rc));
        upload_give(s, u);
        return;
    }
    if (!retry) {
        u->prev_end = u->size;
        u->parts++;
    }
    u->size = off + len;
    s->metrics.upload_bytes += len;
    c->reply = json_pack("{s:s,s:I,s:I,s:I,s:I}", "upload", u->id, "part", (json_int_t)n, "bytes",
                         (json_int_t)len, "size", (json_int_t)u->size, "next_part",
                         (json_int_t)u->parts + 1);
    c->status = 200;
    upload_give(s, u);
    return;
bad:
    st_api_call_error(c, 400, "invalid_param", "part numbers are integers from 1");
}

static void h_upload_commit(st_api_call *c)
{
    st_api_server *s = c->srv;
    static const char *const keys[] = {"session", "label", "compress", NULL};
    const char *sid = NULL, *label = NULL;
    uint64_t compress = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "session", &sid) ||
        st_api_json_opt_str(c, "label", &label) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL))
        return;
    if (!sid || !st_api_id_valid(sid, strlen(sid))) {
        st_api_call_error(c, 400, "invalid_id", "\"session\" must be a session id (1 to %d characters "
                          "of A-Z a-z 0-9 . _ -, starting with a letter or digit)", ST_API_ID_MAX);
        return;
    }
    if (label && !st_store_id_valid(label)) {
        st_api_call_error(c, 400, "invalid_field", "\"label\" is not a valid label name");
        return;
    }
    st_upload *u = upload_take(c);
    if (!u)
        return;
    /* the import holds the file, its image and a re-encoding (to keep the exact bytes) */
    int rc = st_memguard_admit(&s->guard, "upload commit", 3 * u->size);
    if (rc) {
        st_api_call_fail(c, rc, "commit");
        upload_give(s, u);
        return;
    }
    double t0 = st_api_now_ms();
    st_put_stats ps;
    memset(&ps, 0, sizeof ps);
    st_put_opts po = {.compress = (int)compress, .label = label, .stats = &ps};
    uint64_t version = 0;
    /* st_store_import reads the whole file with st_file_read, checking every section and
     * checksum, before anything is written: a bad file never becomes a version */
    rc = st_store_import(s->store, u->path, sid, &po, &version);
    if (rc) {
        switch (rc) {
        case ST_ECORRUPT:
        case ST_ENOTSTRATA:
        case ST_EVERSION:
        case ST_ECODEC:
        case ST_EGEOMETRY:
            st_api_call_error(c, 422, "invalid_file", "the uploaded file is not a valid session file: %s",
                              st_errdetail()[0] ? st_errdetail() : st_strerror(rc));
            break;
        default:
            st_api_call_fail(c, rc, "commit");
        }
        upload_give(s, u);
        return;
    }
    uint64_t size = u->size;
    pthread_mutex_lock(&s->uploads_mu);
    upload_unlink_locked(s, u);
    pthread_mutex_unlock(&s->uploads_mu);
    upload_destroy(u);
    s->metrics.uploads++;
    s->metrics.saves++;
    s->metrics.save_logical_bytes += ps.logical_bytes;
    s->metrics.save_new_bytes += ps.new_bytes;
    c->reply = json_pack("{s:s,s:I,s:I,s:I,s:I,s:f}", "session", sid, "version", (json_int_t)version,
                         "bytes", (json_int_t)size, "logical_bytes", (json_int_t)ps.logical_bytes,
                         "new_stored_bytes", (json_int_t)ps.new_bytes, "ms", st_api_ms(st_api_now_ms() - t0));
    c->status = 201;
}

static void h_upload_delete(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_upload *u = upload_take(c);
    if (!u)
        return;
    pthread_mutex_lock(&s->uploads_mu);
    upload_unlink_locked(s, u);
    pthread_mutex_unlock(&s->uploads_mu);
    upload_destroy(u);
    c->reply = json_pack("{s:s,s:b}", "upload", c->arg2, "deleted", 1);
    c->status = 200;
}

/* ---- the route table ------------------------------------------------------------------------ */

#ifdef ST_API_HAVE_ENGINE
#define ENGINE_FN(f) f
#else
#define ENGINE_FN(f) NULL
#endif

static st_route route_table[] = {
    {ST_HTTP_GET, "/", BODY_NONE, 1, 0, 1, h_page, 0},
    {ST_HTTP_GET, "/healthz", BODY_NONE, 1, 0, 1, h_healthz, 0},
    {ST_HTTP_GET, "/metrics", BODY_NONE, 1, 0, 0, h_metrics, 0},
    {ST_HTTP_POST, "/v1/completions", BODY_COMPLETION, 0, 1, 0, ENGINE_FN(st_openai_completions), 0},
    {ST_HTTP_POST, "/v1/chat/completions", BODY_COMPLETION, 0, 1, 0, ENGINE_FN(st_openai_chat), 0},
    {ST_HTTP_GET, "/v1/models", BODY_NONE, 0, 1, 0, ENGINE_FN(st_openai_models), 0},
    {ST_HTTP_GET, "/v1/models/{model}", BODY_NONE, 0, 1, 0, ENGINE_FN(st_openai_model_get), 0},
    {ST_HTTP_GET, "/v1/sessions", BODY_NONE, 0, 0, 0, h_sessions_list, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}", BODY_NONE, 0, 0, 0, h_session_get, 0},
    {ST_HTTP_DELETE, "/v1/sessions/{id}", BODY_NONE, 0, 0, 0, h_session_delete, 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/save", BODY_JSON, 0, 1, 0, ENGINE_FN(st_conv_save), 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/restore", BODY_JSON, 0, 1, 0, ENGINE_FN(st_conv_restore), 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/park", BODY_JSON, 0, 1, 0, ENGINE_FN(st_conv_park), 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions", BODY_NONE, 0, 0, 0, h_versions, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions/{v}", BODY_NONE, 0, 0, 0, h_version_get, 0},
    {ST_HTTP_DELETE, "/v1/sessions/{id}/versions/{v}", BODY_NONE, 0, 0, 0, h_version_delete, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions/{v}/file", BODY_NONE, 0, 0, 0, h_version_file, 0},
    {ST_HTTP_POST, "/v1/uploads", BODY_JSON, 0, 0, 0, h_upload_create, 0},
    {ST_HTTP_PUT, "/v1/uploads/{uid}/parts/{n}", BODY_PART, 0, 0, 0, h_upload_part, 0},
    {ST_HTTP_POST, "/v1/uploads/{uid}/commit", BODY_JSON, 0, 0, 0, h_upload_commit, 0},
    {ST_HTTP_DELETE, "/v1/uploads/{uid}", BODY_NONE, 0, 0, 0, h_upload_delete, 0},
    {ST_HTTP_GET, "/slots", BODY_NONE, 0, 1, 0, ENGINE_FN(st_conv_slots_list), 0},
    {ST_HTTP_POST, "/slots/{n}", BODY_JSON, 0, 1, 0, ENGINE_FN(st_conv_slots_action), 0},
    {ST_HTTP_POST, "/apply-template", BODY_COMPLETION, 0, 1, 0, ENGINE_FN(st_conv_apply_template), 0},
};

static const st_route *routes_table(size_t *n)
{
    *n = sizeof route_table / sizeof route_table[0];
    return route_table;
}

/* ---- housekeeping: store statistics, expired uploads ----------------------------------------- */

typedef struct hk_job {
    st_job job;
    st_api_server *srv;
} hk_job;

static void hk_run(st_job *j)
{
    st_api_server *s = ((hk_job *)j)->srv;
    st_store_stats ss;
    if (!st_store_stat(s->store, &ss))
        st_metrics_store_set(&s->metrics, &ss);
    double now = st_api_now_ms(), ttl = (double)s->cfg.upload_ttl_s * 1000.0;
    st_upload *expired = NULL;
    pthread_mutex_lock(&s->uploads_mu);
    for (st_upload **pp = &s->uploads; *pp;) {
        st_upload *u = *pp;
        if (!u->busy && now - u->touched > ttl) {
            *pp = u->next;
            u->next = expired;
            expired = u;
        } else {
            pp = &u->next;
        }
    }
    pthread_mutex_unlock(&s->uploads_mu);
    while (expired) {
        st_upload *next = expired->next;
        upload_destroy(expired);
        expired = next;
    }
}

static void hk_done(st_job *j)
{
    hk_job *h = (hk_job *)j;
    h->srv->stat_running = 0;
    free(h);
}

static void hk_start(st_api_server *s)
{
    if (s->stat_running || s->stopping)
        return;
    hk_job *h = calloc(1, sizeof *h);
    if (!h)
        return;
    h->srv = s;
    h->job.run = hk_run;
    h->job.done = hk_done;
    s->stat_running = 1;
    st_work_submit(s->work, &h->job);
}

static void housekeeping_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    hk_start(arg);
}

/* ---- stopping ------------------------------------------------------------------------------- */

static void tick_cb(evutil_socket_t fd, short what, void *arg)
{
    st_api_server *s = arg;
    (void)fd;
    (void)what;
    uint32_t busy = st_http_close_idle(s->http);
    int late = st_api_now_ms() > s->stop_deadline;
    if ((busy == 0 && st_work_outstanding(s->work) == 0) || late) {
        if (late)
            fprintf(stderr, "strata-server: stop: %u requests still running after %u ms\n", busy,
                    s->cfg.shutdown_timeout_ms);
        event_del(s->tick);
        event_base_loopexit(s->base, NULL);
    }
}

static void begin_stop(st_api_server *s, const char *why)
{
    if (s->stopping)
        return;
    s->stopping = 1;
    fprintf(stderr, "strata-server: %s: stopping (no new connections; in-flight work finishes)\n", why);
    st_http_stop_accepting(s->http);
    s->stop_deadline = st_api_now_ms() + s->cfg.shutdown_timeout_ms;
    struct timeval tv = {0, 20000};
    event_add(s->tick, &tv);
}

static void signal_cb(evutil_socket_t sig, short what, void *arg)
{
    (void)what;
    begin_stop(arg, sig == SIGTERM ? "SIGTERM" : "SIGINT");
}

static void stop_cb(evutil_socket_t fd, short what, void *arg)
{
    (void)fd;
    (void)what;
    begin_stop(arg, "stop requested");
}

void st_api_server_stop(st_api_server *s)
{
    event_active(s->stop_ev, EV_READ, 0);
}

/* ---- life cycle ----------------------------------------------------------------------------- */

static int read_key(st_api_server *s, const char *path)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return st_error_set(errno, "--api-key-file %s: %s", path, strerror(errno));
    char buf[4097];
    size_t n = fread(buf, 1, sizeof buf, f);
    fclose(f);
    if (n == sizeof buf)
        return st_error_set(ST_EINVAL, "--api-key-file %s: longer than 4096 bytes", path);
    while (n && (buf[n - 1] == '\n' || buf[n - 1] == '\r' || buf[n - 1] == ' ' || buf[n - 1] == '\t'))
        n--;
    if (!n)
        return st_error_set(ST_EINVAL, "--api-key-file %s: empty key", path);
    for (size_t i = 0; i < n; i++)
        if ((unsigned char)buf[i] < 0x21 || (unsigned char)buf[i] > 0x7e)
            return st_error_set(ST_EINVAL, "--api-key-file %s: the key must be printable ASCII "
                                           "without spaces", path);
    SHA256((const unsigned char *)buf, n, s->key_hash);
    memset(buf, 0, sizeof buf);
    s->have_key = 1;
    return 0;
}

static int mkdir_p(const char *path)
{
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s", path) >= (int)sizeof tmp)
        return ENAMETOOLONG;
    for (char *p = tmp + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = '\0';
        if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
            return errno;
        *p = '/';
    }
    if (mkdir(tmp, 0700) != 0 && errno != EEXIST)
        return errno;
    return 0;
}

/* Files left in the spool by a process that died are removed at start. */
static void spool_clean(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char p[PATH_MAX + 300];
    while ((e = readdir(d))) {
        size_t n = strlen(e->d_name);
        if (n > 4 && !strcmp(e->d_name + n - 4, ".tmp") &&
            (!strncmp(e->d_name, "up-", 3) || !strncmp(e->d_name, "dl-", 3))) {
            snprintf(p, sizeof p, "%s/%s", dir, e->d_name);
            unlink(p);
        }
    }
    closedir(d);
}

static int write_ready_file(const char *path, uint16_t port)
{
    char tmp[PATH_MAX + 8], buf[16];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    int n = snprintf(buf, sizeof buf, "%u\n", (unsigned)port);
    FILE *f = fopen(tmp, "w");
    if (!f || fwrite(buf, 1, (size_t)n, f) != (size_t)n || fclose(f) != 0)
        return st_error_set(errno ? errno : EIO, "--ready-file %s: %s", path, strerror(errno));
    if (rename(tmp, path) != 0)
        return st_error_set(errno, "--ready-file %s: %s", path, strerror(errno));
    return 0;
}

int st_api_config_check(const st_api_config *cfg)
{
    if (!cfg->store_dir || !*cfg->store_dir)
        return st_error_set(ST_EINVAL, "a store directory is required (--store DIR)");
    if (!cfg->workers || cfg->workers > 256)
        return st_error_set(ST_EINVAL, "--workers must be 1..256, got %u", cfg->workers);
    if (!cfg->slots || cfg->slots > 1024)
        return st_error_set(ST_EINVAL, "--slots must be 1..1024, got %u", cfg->slots);
    if (cfg->backend && strcmp(cfg->backend, "cpu") && strcmp(cfg->backend, "cuda"))
        return st_error_set(ST_EINVAL, "--backend must be cpu or cuda, got \"%s\"", cfg->backend);
    const struct {
        const char *flag;
        uint64_t v, min;
    } lim[] = {
        {"--max-connections", cfg->max_connections, 1},
        {"--max-connections-per-peer", cfg->max_connections_per_peer, 1},
        {"--max-header-bytes", cfg->max_header_bytes, 256},
        {"--max-headers", cfg->max_headers, 1},
        {"--max-json-kib (bytes)", cfg->max_json_body, 16},
        {"--max-completion-kib (bytes)", cfg->max_completion_body, 1},
        {"--max-part-mib (bytes)", cfg->max_part_bytes, 1},
        {"--max-upload-mib (bytes)", cfg->max_upload_bytes, 1},
        {"--body-budget-mib (bytes)", cfg->body_budget, 1},
        {"--head-timeout-ms", cfg->head_timeout_ms, 1},
        {"--read-timeout-ms", cfg->read_timeout_ms, 1},
        {"--body-timeout-ms", cfg->body_timeout_ms, 1},
        {"--min-body-rate", cfg->min_body_rate, 1},
        {"--body-rate-window-ms", cfg->body_rate_window_ms, 1},
        {"--write-timeout-ms", cfg->write_timeout_ms, 1},
        {"--idle-timeout-ms", cfg->idle_timeout_ms, 1},
        {"--shutdown-timeout-ms", cfg->shutdown_timeout_ms, 1},
        {"--upload-ttl-s", cfg->upload_ttl_s, 1},
        {"--store-stat-ms", cfg->store_stat_ms, 100},
        {"--max-n-predict", cfg->max_n_predict, 1},
    };
    for (size_t i = 0; i < sizeof lim / sizeof lim[0]; i++)
        if (lim[i].v < lim[i].min)
            return st_error_set(ST_EINVAL, "%s must be at least %llu (a limit is never unlimited), got %llu",
                                lim[i].flag, (unsigned long long)lim[i].min,
                                (unsigned long long)lim[i].v);
    if (cfg->body_budget < cfg->max_completion_body ||
        cfg->body_budget - cfg->max_completion_body < cfg->max_part_bytes)
        return st_error_set(ST_EINVAL, "--body-budget-mib must hold at least one upload part "
                                       "(--max-part-mib) plus one completion body (--max-completion-kib)");
    return 0;
}

int st_api_server_new(const st_api_config *cfg, st_api_server **out)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    static int ev_threads_rc;
    int rc = 0;
    *out = NULL;
    if ((rc = st_api_config_check(cfg)))
        return rc;
    pthread_once(&once, ev_threads_init_once);
    ev_threads_rc = ev_threads_rc_value;
    if (ev_threads_rc)
        return st_error_set(ST_EIO, "libevent: evthread_use_pthreads failed");

    st_api_server *s = calloc(1, sizeof *s);
    if (!s)
        return st_error_set(ENOMEM, "server: no memory");
    s->cfg = *cfg;
    s->t_start = st_api_now_ms();
    pthread_mutex_init(&s->uploads_mu, NULL);
    st_metrics_init(&s->metrics);
    size_t nr = 0;
    routes_table(&nr);
    for (size_t i = 0; i < nr; i++)
        route_table[i].metric = st_metrics_route(&s->metrics, route_table[i].pattern);
    s->metric_none = st_metrics_route(&s->metrics, "(unrouted)");
    s->guard.enabled = cfg->mem_guard;
    s->guard.reserve = cfg->mem_reserve_bytes;
    s->guard.meminfo_path = cfg->meminfo_path;
    s->guard.refusals = &s->metrics.memguard_refusals;
    if (cfg->api_key_file && (rc = read_key(s, cfg->api_key_file)))
        goto fail;
    signal(SIGPIPE, SIG_IGN);
    if (!(s->base = event_base_new())) {
        rc = st_error_set(ENOMEM, "libevent: no event base");
        goto fail;
    }
    st_store_opts so = {.create = 1, .keep_last = cfg->keep_last};
    uint32_t damaged_dbs = 0;
    if ((rc = store_scan(s, cfg->store_dir, &damaged_dbs)) || (rc = st_store_open(&s->store, cfg->store_dir, &so))) {
        char d[600];
        snprintf(d, sizeof d, "%s", st_errdetail());
        rc = st_error_set(rc, "opening the store %s: %s", cfg->store_dir, d[0] ? d : st_strerror(rc));
        goto fail;
    }
    st_store_damaged_dbs_set(s->store, damaged_dbs);
    if (cfg->spool_dir)
        snprintf(s->spool, sizeof s->spool, "%s", cfg->spool_dir);
    else
        snprintf(s->spool, sizeof s->spool, "%s/spool", cfg->store_dir);
    if (strlen(s->spool) > PATH_MAX - 128) {
        rc = st_error_set(ENAMETOOLONG, "spool directory path too long");
        goto fail;
    }
    if ((rc = mkdir_p(s->spool))) {
        rc = st_error_set(rc, "spool directory %s: %s", s->spool, strerror(rc));
        goto fail;
    }
    spool_clean(s->spool);
    if ((rc = st_work_new(s->base, cfg->workers, &s->work)))
        goto fail;
    if (cfg->model_path) {
#ifdef ST_API_HAVE_ENGINE
        if ((rc = st_conv_new(s, &s->conv)))
            goto fail;
#else
        rc = st_error_set(ST_EINVAL, "--model given but this build of strata-server has no engine");
        goto fail;
#endif
    }
    st_http_limits lim = {
        .max_connections = cfg->max_connections,
        .max_connections_per_peer = cfg->max_connections_per_peer,
        .max_header_bytes = cfg->max_header_bytes,
        .max_headers = cfg->max_headers,
        .body_budget = cfg->body_budget,
        .bulk_budget = cfg->body_budget - cfg->max_completion_body, /* room kept for completions */
        .head_timeout_ms = cfg->head_timeout_ms,
        .read_timeout_ms = cfg->read_timeout_ms,
        .body_timeout_ms = cfg->body_timeout_ms,
        .write_timeout_ms = cfg->write_timeout_ms,
        .idle_timeout_ms = cfg->idle_timeout_ms,
        .min_body_rate = cfg->min_body_rate,
        .body_rate_window_ms = cfg->body_rate_window_ms,
    };
    st_http_cbs cbs = {on_head, on_request, on_done, on_refused, call_free, on_gone};
    if ((rc = st_http_new(s->base, cfg->host, cfg->port, &lim, &cbs, s, &s->http)))
        goto fail;
    s->stop_ev = event_new(s->base, -1, 0, stop_cb, s);
    s->tick = event_new(s->base, -1, EV_PERSIST, tick_cb, s);
    s->housekeeping = event_new(s->base, -1, EV_PERSIST, housekeeping_cb, s);
    if (!s->stop_ev || !s->tick || !s->housekeeping) {
        rc = st_error_set(ENOMEM, "libevent: no events");
        goto fail;
    }
    if (cfg->handle_signals) {
        s->sig_term = evsignal_new(s->base, SIGTERM, signal_cb, s);
        s->sig_int = evsignal_new(s->base, SIGINT, signal_cb, s);
        if (!s->sig_term || !s->sig_int || evsignal_add(s->sig_term, NULL) || evsignal_add(s->sig_int, NULL)) {
            rc = st_error_set(ST_EIO, "libevent: cannot watch signals");
            goto fail;
        }
    }
    struct timeval hk = {cfg->store_stat_ms / 1000, (cfg->store_stat_ms % 1000) * 1000};
    event_add(s->housekeeping, &hk);
    hk_start(s);
    if (cfg->ready_file && (rc = write_ready_file(cfg->ready_file, st_http_port(s->http))))
        goto fail;
    *out = s;
    return 0;
fail:
    st_api_server_free(s);
    return rc;
}

int st_api_server_run(st_api_server *s)
{
    fprintf(stderr, "strata-server: listening on %s port %u (store %s%s%s)\n", s->cfg.host,
            (unsigned)st_http_port(s->http), s->cfg.store_dir, s->conv ? ", model " : ", no model",
            s->conv ? s->cfg.model_path : "");
    int rc = event_base_dispatch(s->base);
    if (rc < 0)
        return st_error_set(ST_EIO, "libevent: the event loop failed");
    /* join the workers first (a job still running past the deadline finishes), so that nothing
     * touches the slots and the pool while they are written out */
    st_work_free(s->work);
    s->work = NULL;
    rc = 0;
#ifdef ST_API_HAVE_ENGINE
    if (s->conv)
        rc = st_conv_persist_all(s->conv, &s->lost);
#endif
    fprintf(stderr, "strata-server: stopped%s\n", s->lost ? " (live conversations were lost, see above)" : "");
    return rc;
}

void st_api_server_free(st_api_server *s)
{
    if (!s)
        return;
    st_work_free(s->work); /* joins the workers; completions still pending are dropped */
#ifdef ST_API_HAVE_ENGINE
    st_conv_free(s->conv);
#endif
    st_http_free(s->http);
    while (s->uploads) {
        st_upload *u = s->uploads;
        s->uploads = u->next;
        upload_destroy(u);
    }
    st_store_close(s->store);
    if (s->sig_term)
        event_free(s->sig_term);
    if (s->sig_int)
        event_free(s->sig_int);
    if (s->stop_ev)
        event_free(s->stop_ev);
    if (s->tick)
        event_free(s->tick);
    if (s->housekeeping)
        event_free(s->housekeeping);
    if (s->base)
        event_base_free(s->base);
    pthread_mutex_destroy(&s->uploads_mu);
    pthread_mutex_destroy(&s->metrics.store_mu);
    for (size_t i = 0; i < s->n_damaged; i++)
        free(s->damaged[i].why);
    free(s->damaged);
    free(s);
}
