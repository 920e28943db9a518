/*
 * st_api_int.h - the parts of strata-server above the conversation manager (st_conv.h): the
 * HTTP/1.1 layer (st_http.c), the worker pool (st_work.c), metrics (st_metrics.c), the request
 * plumbing (st_call.c: calls, replies, JSON bodies, queries), the route handlers by area
 * (st_route_sessions.c, st_route_files.c, st_route_slots.c, st_route_complete.c, st_openai.c,
 * st_route_metrics.c, st_route_page.c) and the server shell with the router (st_server.c).
 * Dependencies point down: st_server.c -> handlers -> st_call.c, st_http.c -> st_conv.c ->
 * engine, store. Internal to api/; tests may include it.
 */
#ifndef ST_API_INT_H
#define ST_API_INT_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include <event2/buffer.h>
#include <event2/event.h>
#include <jansson.h>

#include "st_api.h"
#include "st_conv.h"
#include "st_store.h"

/* ---- the HTTP/1.1 layer --------------------------------------------------------------------
 * Built on bufferevents rather than evhttp: libevent 2.1's evhttp answers its own limit
 * failures with fixed HTML pages (400 for oversize headers, 413 after it decided alone), drops a
 * connection silently on a timeout (no 408), has no connection cap and no hook between
 * accepting a connection and reading its headers. This layer owns those decisions: every
 * refusal is a JSON error with the right status, and a body is never read before the route,
 * the credentials and the Content-Length were accepted.
 *
 * Invariants:
 * 1. One request per connection at a time: parsing stops once a head and its body are in, and
 *    resumes after the reply was written (pipelined bytes wait in the input buffer, a bounded
 *    part of them read already so that a close is seen, invariant 5).
 * 2. A connection whose request is with a handler (state BUSY) is never freed; a failure noticed
 *    meanwhile marks it dead and the reply frees it.
 * 3. Every request gets exactly one reply; the layer replies for the handler when it refuses.
 * 4. Body bytes buffered at once, over all connections, never exceed the budget: they are
 *    charged as they arrive (a declared Content-Length holds nothing) and released when the
 *    request ends; bulk bodies (st_http_req_set_bulk) have a smaller budget of their own inside
 *    it (st_http.c, invariant 3).
 * 5. When the connection of a request that is with its handler (BUSY) reaches EOF or fails,
 *    on_gone is called once for that request, on the loop: only the request in flight, never a
 *    pipelined one behind it. The request (and what is attached to it) stays valid until its
 *    one reply, as in invariant 2; the handler decides whether to reply or drop it.
 * All functions run on the loop thread. */
typedef struct st_http st_http;
typedef struct st_http_req st_http_req;

enum {
    ST_HTTP_GET = 1,
    ST_HTTP_HEAD = 2,
    ST_HTTP_POST = 4,
    ST_HTTP_PUT = 8,
    ST_HTTP_DELETE = 16,
    ST_HTTP_OPTIONS = 32,
    ST_HTTP_PATCH = 64,
    ST_HTTP_OTHER = 128,
};

typedef struct st_http_limits {
    uint32_t max_connections;
    uint32_t max_connections_per_peer; /* 0 or more than max_connections: max_connections */
    uint32_t max_header_bytes;
    uint32_t max_headers;
    uint64_t body_budget;
    uint64_t bulk_budget;     /* bulk bodies together, at most body_budget */
    /* head_timeout runs from the accept of a new connection and from the first byte of a later
     * head; idle_timeout between requests */
    uint32_t head_timeout_ms, read_timeout_ms, body_timeout_ms, write_timeout_ms, idle_timeout_ms;
    /* a body must bring min_body_rate bytes/s, checked at the end of every window */
    uint32_t min_body_rate, body_rate_window_ms;
} st_http_limits;

typedef struct st_http_stats {
    uint32_t connections, idle, peers;
    uint64_t body_bytes;   /* request body bytes held now */
    uint64_t shed;         /* idle connections closed to make room for new ones */
    uint64_t peer_refused; /* new connections refused: their peer's connections all busy */
} st_http_stats;

typedef struct st_http_cbs {
    /* A head was parsed. Return 0 with *body_max set to read the body (up to *body_max bytes;
     * a larger Content-Length is answered 413 by the layer; st_http_req_set_bulk marks it bulk)
     * and then call on_request; or reply (st_http_reply_*) and return non-zero: the body is not
     * read. */
    int (*on_head)(st_http_req *req, uint64_t *body_max, void *arg);
    /* The body is in (st_http_req_body). The handler replies now or later, once. */
    void (*on_request)(st_http_req *req, void *arg);
    /* The reply was handed to the socket (or the connection failed): for metrics and logs. */
    void (*on_done)(st_http_req *req, void *arg);
    /* A request the layer refused before routing (bad head, limits, timeout). */
    void (*on_refused)(int status, const char *code, void *arg);
    /* The request is freed: free what st_http_req_set_user attached. */
    void (*free_user)(void *user, void *arg);
    /* The client of a request with the handler went away (EOF or an error; invariant 5). The
     * request still needs its reply (st_http_reply_none sends nothing). May be NULL. */
    void (*on_gone)(st_http_req *req, void *arg);
} st_http_cbs;

int st_http_new(struct event_base *base, const char *host, uint16_t port,
                const st_http_limits *lim, const st_http_cbs *cbs, void *arg, st_http **out);
void st_http_free(st_http *h); /* closes every connection */
uint16_t st_http_port(const st_http *h);
/* Stop accepting; connections finish their current request and close. */
void st_http_stop_accepting(st_http *h);
uint32_t st_http_n_connections(const st_http *h);
void st_http_stats_get(const st_http *h, st_http_stats *out);
/* Close idle connections (no request in progress); returns those still busy. */
uint32_t st_http_close_idle(st_http *h);

unsigned st_http_req_method(const st_http_req *r);
const char *st_http_req_method_name(const st_http_req *r);
const char *st_http_req_path(const st_http_req *r);   /* raw, before '?' */
const char *st_http_req_query(const st_http_req *r);  /* raw, after '?', or NULL */
const char *st_http_req_header(const st_http_req *r, const char *name); /* first, or NULL */
struct evbuffer *st_http_req_body(st_http_req *r);    /* the body (owned by the request) */
uint64_t st_http_req_body_len(const st_http_req *r);
double st_http_req_elapsed_ms(const st_http_req *r);  /* since its head was complete */
int st_http_req_status(const st_http_req *r);         /* status replied (0: none yet) */
uint64_t st_http_req_bytes_out(const st_http_req *r);
const char *st_http_req_peer(const st_http_req *r);
void st_http_req_set_user(st_http_req *r, void *user);
void *st_http_req_user(const st_http_req *r);
/* From on_head: the body is charged to the bulk budget as well (upload parts). */
void st_http_req_set_bulk(st_http_req *r);
/* The body of an error reply (st_http_reply_error, also the layer's own refusals once the head is
 * parsed: 413, 503 busy, 408, 417) as a malloc'd string of *len bytes, or NULL: no memory. */
typedef char *(*st_http_error_fn)(int status, const char *code, const char *message, size_t *len);
/* From on_head on: error replies of r get their body from fn (NULL: {"error":{code,message}}). */
void st_http_req_set_error_fn(st_http_req *r, st_http_error_fn fn);

/* The request-head parser of a connection, as a pure function (tests/fuzz/fuzz_http_head.c):
 * head holds len bytes through the empty line that ends a head, as a connection passes them once
 * it found that line (max_headers: st_http_limits'). 0 and *out, a request without a connection
 * on which only the st_http_req_method..st_http_req_header accessors may be used, freed with
 * st_http_head_free; or the status a connection refuses the head with, *code and msg set. */
int st_http_head_parse(const void *head, size_t len, uint32_t max_headers, st_http_req **out,
                       const char **code, char *msg, size_t msg_cap);
void st_http_head_free(st_http_req *r); /* accepts NULL */

/* Replies. Each takes the request's one reply; an extra header may be added first. */
void st_http_header_add(st_http_req *r, const char *name, const char *value);
void st_http_reply_buf(st_http_req *r, int status, const char *ctype, const void *data, size_t len);
/* Moves the contents of body. */
void st_http_reply_evbuf(st_http_req *r, int status, const char *ctype, struct evbuffer *body);
/* Streams len bytes of fd from offset 0 (sendfile where possible); takes ownership of fd. */
void st_http_reply_file(st_http_req *r, int status, const char *ctype, int fd, uint64_t len);
void st_http_reply_json(st_http_req *r, int status, json_t *body); /* steals body */
/* Ends the request without sending anything and closes its connection (a client that went
 * away); status is what on_done and the metrics see. */
void st_http_reply_none(st_http_req *r, int status);
void st_http_reply_error(st_http_req *r, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* A streamed reply (Server-Sent Events): begin sends the head without a length (chunked on
 * HTTP/1.1; HTTP/1.0: the close ends it), write sends the contents of data as one chunk, end the
 * last chunk. The request stays with its handler until end (the connection is BUSY), so on_gone
 * still reports a client that goes away; abort_status != 0 (499) closes the connection instead,
 * with that status for on_done. Writes to a connection that failed are dropped. */
void st_http_stream_begin(st_http_req *r, int status, const char *ctype);
void st_http_stream_write(st_http_req *r, struct evbuffer *data);
void st_http_stream_end(st_http_req *r, int abort_status);
const char *st_http_reason(int status);
/* {"error":{"code":code,"message":message}} as a malloc'd string. */
char *st_http_error_body(const char *code, const char *message, size_t *len);
/* s with every byte that is not part of well-formed UTF-8 written as the four characters \xNN
 * (malloc'd; NULL when out of memory): JSON can carry it, and it still shows what was sent. */
char *st_http_utf8_escape(const char *s);

/* ---- worker pool --------------------------------------------------------------------------
 * run() executes on a worker thread, done() then executes on the loop thread. A job is owned by
 * its submitter; done() typically frees it. */
typedef struct st_work st_work;
typedef struct st_job st_job;
struct st_job {
    void (*run)(st_job *j);
    void (*done)(st_job *j);
    st_job *next;
};
int st_work_new(struct event_base *base, unsigned n_threads, st_work **out);
void st_work_submit(st_work *w, st_job *j);
/* Jobs submitted and not yet done (queued, running or waiting for the loop). */
unsigned st_work_outstanding(const st_work *w);
unsigned st_work_queued(st_work *w);
/* Stop the threads after the queue drained (no job may be submitted after). */
void st_work_free(st_work *w);

/* ---- metrics -------------------------------------------------------------------------------- */
#define ST_METRICS_ROUTES_MAX 32
#define ST_METRICS_BUCKETS 15
typedef struct st_metrics {
    /* per route (index into the router's table; the last is "none"): loop thread only */
    const char *route_name[ST_METRICS_ROUTES_MAX];
    uint32_t n_routes;
    uint64_t req_by_class[ST_METRICS_ROUTES_MAX][6]; /* 1xx..5xx, index 1..5 */
    uint64_t lat_bucket[ST_METRICS_ROUTES_MAX][ST_METRICS_BUCKETS];
    uint64_t lat_count[ST_METRICS_ROUTES_MAX];
    double lat_sum[ST_METRICS_ROUTES_MAX];
    uint64_t refused[6]; /* by the layer before routing: 1xx..5xx */
    /* any thread */
    st_conv_counters conv; /* the conversation manager's (st_conv.h) */
    _Atomic uint64_t downloads, download_bytes, uploads, upload_bytes;
    uint64_t sessions_damaged; /* quarantined by the start-up scan (set before serving) */
    /* store statistics refreshed by a worker now and then (st_metrics_store_set), rendered as
     * one snapshot: the free map's parts add up to the map */
    pthread_mutex_t store_mu;
    st_store_stats store;
    int store_ok;
    struct st_tiernode *tier; /* the shared tier's node (st_tiernode.h), or NULL: no tier */
    struct st_conv *manager;  /* the conversation manager (its prefix index), or NULL */
} st_metrics;
extern const double st_metrics_bucket_ms[ST_METRICS_BUCKETS];
void st_metrics_init(st_metrics *m);
void st_metrics_store_set(st_metrics *m, const st_store_stats *ss); /* any thread */
int st_metrics_route(st_metrics *m, const char *name); /* registers; returns its index */
void st_metrics_request(st_metrics *m, int route, int status, double ms);
void st_metrics_refused(st_metrics *m, int status);
/* Prometheus text exposition (version 0.0.4) into out. */
void st_metrics_render(st_metrics *m, struct evbuffer *out, const st_http_stats *http,
                       uint32_t work_outstanding, uint32_t work_queued, const st_engine_wcache *wc,
                       const st_engine_xcache *xc);

/* ---- the server ------------------------------------------------------------------------------
 * Its state, shared by the shell (st_server.c) and the handlers. Fields are set at start and
 * fixed while serving, except: uploads (under uploads_mu, st_route_files.c), seq (atomic),
 * stopping, stat_running (loop thread). */
typedef struct st_api_server st_api_server;
struct st_upload;

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
    struct st_tiernode *tier; /* --tier: the shared tier's node (st_tiernode.h); NULL: none */
    st_conv *conv;
    st_conv_env conv_env;     /* what conv was made with */
    unsigned lost;            /* live conversations the graceful stop could not write */
    st_metrics metrics;
    st_memguard guard;
    uint8_t key_hash[ST_SHA256_LEN]; /* of the API key */
    int have_key;
    struct event *sig_term, *sig_int, *stop_ev, *tick, *housekeeping;
    int stopping;
    double stop_deadline;
    double t_start;
    char spool[PATH_MAX];
    pthread_mutex_t uploads_mu;
    struct st_upload *uploads;
    _Atomic uint64_t seq;
    int stat_running;
    int metric_none;
    st_api_damaged *damaged;   /* sorted by id; fixed before the server serves */
    size_t n_damaged, cap_damaged;
};

/* A parsed request, handed to route handlers. */
typedef struct st_api_call {
    st_api_server *srv;
    st_http_req *req;
    int route;                 /* router index */
    char id[ST_API_ID_MAX + 1];/* {id} when the route has one */
    char arg2[64];             /* second parameter ({v}, {uid}, {n}) raw, validated by handler */
    char arg3[32];
    char model_id[256];        /* {model} (GET /v1/models/{model}), percent-decoded */
    json_t *body;              /* parsed JSON body (NULL when none) */
    /* the worker's result, sent by the loop */
    st_job job;
    int status;
    json_t *reply;             /* JSON reply (serialised by the worker into reply_text), or */
    char *reply_text;
    size_t reply_len;
    char err_code[32];
    char *err_msg;
    struct evbuffer *text;     /* a text reply (/metrics) */
    int file_fd;               /* a file reply (downloads) */
    uint64_t file_len;
    const char *file_ctype;
    void *ctx;                 /* handler's own */
    /* Set by the loop (on_gone) when the client went away while the call was in flight; read by
     * the worker. Lives with the call, which the loop frees only after the worker's done(). */
    _Atomic int cancelled;
    int no_reply;              /* st_api_call_cancel: end the request without a reply */
    /* a streamed reply (st_api_call_stream): bytes the worker hands to the loop */
    struct event *stream_ev;
    struct evbuffer *stream_buf;
    int stream_begun, stream_ended;
    /* errors in OpenAI's shape {"error":{"message","type","param","code"}} (st_openai.c) */
    int openai;
    char err_param[40];        /* its "param" ("" : null) */
    char session_hdr[ST_API_ID_MAX + 1]; /* the reply's X-Strata-Session ("": none) */
} st_api_call;

/* Whether the client of c went away (any thread). Long handlers that can stop early (completions)
 * poll it; those whose result is durable (SAVE, RESTORE, downloads) finish regardless. */
#define st_api_call_cancelled(c) atomic_load_explicit(&(c)->cancelled, memory_order_relaxed)
/* The handler stopped because the client went away: nothing is sent (status 499 in metrics). */
void st_api_call_cancel(st_api_call *c);

/* Fill call's error from rc (an ST_E* code or errno) and the thread's detail. */
void st_api_call_fail(st_api_call *c, int rc, const char *what);
void st_api_call_error(st_api_call *c, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
/* From the worker: send data as the next part of a streamed reply (200, text/event-stream),
 * which the first call begins. Once begun, the call's reply and error are not sent: the stream
 * ends when the handler returns (or the connection closes when it called st_api_call_cancel).
 * 0, or ENOMEM. */
int st_api_call_stream(st_api_call *c, const void *data, size_t len);
/* Run fn on a worker, then reply from the loop with what it left in the call. */
void st_api_call_submit(st_api_call *c, void (*fn)(st_api_call *c));
/* On the loop: send what the handler left in c (c stays with the request, freed with it). */
void st_api_call_reply(st_api_call *c);
/* st_http_cbs.free_user: frees a call with its request. */
void st_api_call_free(void *user, void *arg);
/* Parse the request's body into c->body (st_api_body_parse); on a worker. */
int st_api_call_parse_body(st_api_call *c);
/* st_http_error_fn of the requests on the OpenAI routes: refusals before the handler (401, 404,
 * 405, 413, 503, ...) in OpenAI's error shape. */
char *st_api_openai_error_fn(int status, const char *code, const char *msg, size_t *len);

st_metrics *st_api_metrics(st_api_server *s);
struct st_store *st_api_store(st_api_server *s);
/* 0, or ST_EDAMAGED with a detail naming why and the remedy when the start-up scan quarantined
 * session id (or its disk-parked image): nothing may read or write its keys in the store, which
 * could enter a damaged page. Any thread (the list is fixed before the server serves). */
int st_api_session_damaged(st_api_server *s, const char *id);
const st_api_config *st_api_cfg(st_api_server *s);
const st_memguard *st_api_memguard(st_api_server *s);

/* JSON body helpers: 0, or fill the call's 400 error and return -1. */
int st_api_json_opt_u64(st_api_call *c, const char *key, uint64_t max, uint64_t *out, int *given);
int st_api_json_opt_str(st_api_call *c, const char *key, const char **out);
int st_api_json_opt_double(st_api_call *c, const char *key, double *out, int *given);
int st_api_json_opt_bool(st_api_call *c, const char *key, int *out);
/* Unknown keys are refused (400 unknown_field) so that typos do not pass silently. */
int st_api_json_only(st_api_call *c, const char *const *keys);
/* Parse n bytes of a request body into c->body: a JSON object without duplicate keys, or nothing
 * for an empty body (n == 0). -1 with the call's error set (400 invalid_json) otherwise. The
 * request plumbing calls it for every route with a JSON body; tests/fuzz/fuzz_json_body.c too. */
int st_api_body_parse(st_api_call *c, const char *p, size_t n);

/* Percent-decode n bytes into dst (NUL-terminated). -1 on a bad escape, an encoded NUL, or more
 * than cap - 1 bytes. plus: '+' means a space (query strings). */
long st_api_pct_decode(const char *s, size_t n, char *dst, size_t cap, int plus);
/* Value of key in a raw query string into dst; 1 found, 0 absent, -1 malformed. */
int st_api_query_get(const char *q, const char *key, char *dst, size_t cap);

double st_api_now_ms(void);
/* Milliseconds rounded to the microsecond, for replies. */
double st_api_ms(double ms);
/* json_dumps flags of every reply: compact, and reals without noise digits. */
#define ST_API_JSON_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(12))

st_conv *st_api_conv(st_api_server *s);

/* ---- route handlers (run on workers unless named on the loop) ------------------------------- */
/* st_route_metrics.c: GET /healthz, GET /metrics (on the loop) */
void st_api_h_healthz(st_api_call *c);
void st_api_h_metrics(st_api_call *c);
/* st_route_page.c: GET / (on the loop) */
void st_api_h_page(st_api_call *c);
/* st_route_sessions.c: listings, versions, DELETE, and SAVE / RESTORE / PARK */
void st_api_h_sessions_list(st_api_call *c);
void st_api_h_session_get(st_api_call *c);
void st_api_h_session_delete(st_api_call *c);
void st_api_h_versions(st_api_call *c);
void st_api_h_version_get(st_api_call *c);
void st_api_h_version_delete(st_api_call *c);
void st_api_h_save(st_api_call *c);
void st_api_h_restore(st_api_call *c);
void st_api_h_park(st_api_call *c);
/* {v}: a version number >= 1, or "latest" / "head" (0); else the call's 400 and -1. */
int st_api_parse_version(st_api_call *c, const char *s, uint64_t *v);
/* st_route_files.c: downloads and uploads through the spool */
void st_api_h_version_file(st_api_call *c);
void st_api_h_upload_create(st_api_call *c);
void st_api_h_upload_part(st_api_call *c);
void st_api_h_upload_commit(st_api_call *c);
void st_api_h_upload_delete(st_api_call *c);
/* Uploads not touched for ttl_ms are removed (housekeeping, on a worker); all of them (stop). */
void st_api_uploads_expire(st_api_server *s, double now, double ttl_ms);
void st_api_uploads_free(st_api_server *s);
/* st_route_slots.c: llama.cpp's GET /slots, POST /slots/{n}?action=save|restore|erase */
void st_api_h_slots_list(st_api_call *c);
void st_api_h_slots_action(st_api_call *c);
/* st_route_complete.c: the native POST /v1/completions, POST /apply-template */
void st_api_h_completion(st_api_call *c);
void st_api_h_apply_template(st_api_call *c);
/* st_conv_generate for call c: its cancel flag, and its error (or st_api_call_cancel) set from
 * the result. 0, or -1 when the call's error is set or it was cancelled. */
int st_api_generate(st_api_call *c, st_conv_gen *g);

/* ---- the OpenAI-compatible routes (st_openai.c) ------------------------------------------------
 * POST /v1/chat/completions, POST /v1/completions (a body with "model" or "max_tokens" is
 * OpenAI's shape, any other goes to st_api_h_completion), GET /v1/models. */
void st_openai_chat(st_api_call *c);
void st_openai_completions(st_api_call *c);
void st_openai_models(st_api_call *c);
void st_openai_model_get(st_api_call *c); /* GET /v1/models/{model} */

#endif /* ST_API_INT_H */
