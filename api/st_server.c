/*
 * st_server.c - strata-server's shell: configuration, the start-up scan's quarantine, the router
 * (paths, authentication, the route table, the HTTP callbacks), housekeeping, the graceful stop
 * and the server's life cycle. The handlers (st_route_*.c, st_openai.c) answer the routes; the
 * conversation manager (st_conv.h) is made here and handed the store, the counters and the guard.
 *
 * Invariants:
 * 1. The loop thread never touches the disk, hashes, runs a codec or computes: a route either
 *    answers from memory on the loop (/healthz, /metrics, refusals) or runs on a worker and
 *    replies from the loop with what the worker left in its st_api_call.
 * 2. The order of checks on a request head is: credentials (except /healthz), path, route,
 *    method, ids, body length. Nothing of a body is read before all of them passed.
 * 3. No LMDB transaction outlives a store call, and no store call runs on the loop: a download
 *    is exported to a spool file by a worker first, then streamed from that file by the loop.
 * 4. Each upload is used by one request at a time (its busy flag, under uploads_mu;
 *    st_route_files.c).
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
#include "st_tiernode.h"
#include "st_store.h"

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

static const st_route *routes_table(size_t *n);

static int ev_threads_rc_value;
static void ev_threads_init_once(void)
{
    ev_threads_rc_value = evthread_use_pthreads();
}

/* ---- small things ------------------------------------------------------------------------ */

double st_api_now_ms(void)
{
    return st_conv_now_ms();
}

double st_api_ms(double ms)
{
    return (double)(int64_t)(ms * 1000.0 + 0.5) / 1000.0;
}

int st_api_id_valid(const char *id, size_t len)
{
    return st_conv_id_valid(id, len);
}

int st_api_have_engine(void)
{
    return 1;
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

/* st_conv_env.damaged: the conversation manager asks the start-up scan's list through it. */
static int conv_damaged(void *arg, const char *id)
{
    return st_api_session_damaged(arg, id);
}
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
    c->tier_replicas = 1;
    c->tier_pending_max = 1024;
    c->tier_lease_ms = 10000;
    c->tier_ttl_s = 604800;
    c->prefix_max_entries = 4096;
    c->prefix_min_tokens = 256;
    c->handle_signals = 1;
}

static void parsed_run(st_api_call *c);

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
        long dn = st_api_pct_decode(p, n, ps->s[ps->n], SEG_CAP, 0);
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
    uint8_t d[ST_SHA256_LEN];
    if (st_sha256(tok, strlen(tok), d))
        return 0;
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
        st_http_req_set_error_fn(r, st_api_openai_error_fn);
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
    /* the OpenAI routes answer in OpenAI's error shape from the body's parse on (POST
     * /v1/completions too: until its body says which shape it has, st_openai_completions) */
    c->openai = rt[c->route].fn == st_openai_chat || rt[c->route].fn == st_openai_models ||
                rt[c->route].fn == st_openai_model_get || rt[c->route].fn == st_openai_completions;
    if (rt[c->route].body == BODY_JSON || rt[c->route].body == BODY_COMPLETION) {
        if (st_api_call_parse_body(c))
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
        st_api_call_reply(c);
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


/* ---- the route table ------------------------------------------------------------------------ */

static st_route route_table[] = {
    {ST_HTTP_GET, "/", BODY_NONE, 1, 0, 1, st_api_h_page, 0},
    {ST_HTTP_GET, "/healthz", BODY_NONE, 1, 0, 1, st_api_h_healthz, 0},
    {ST_HTTP_GET, "/metrics", BODY_NONE, 1, 0, 0, st_api_h_metrics, 0},
    {ST_HTTP_POST, "/v1/completions", BODY_COMPLETION, 0, 1, 0, st_openai_completions, 0},
    {ST_HTTP_POST, "/v1/chat/completions", BODY_COMPLETION, 0, 1, 0, st_openai_chat, 0},
    {ST_HTTP_GET, "/v1/models", BODY_NONE, 0, 1, 0, st_openai_models, 0},
    {ST_HTTP_GET, "/v1/models/{model}", BODY_NONE, 0, 1, 0, st_openai_model_get, 0},
    {ST_HTTP_GET, "/v1/sessions", BODY_NONE, 0, 0, 0, st_api_h_sessions_list, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}", BODY_NONE, 0, 0, 0, st_api_h_session_get, 0},
    {ST_HTTP_DELETE, "/v1/sessions/{id}", BODY_NONE, 0, 0, 0, st_api_h_session_delete, 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/save", BODY_JSON, 0, 1, 0, st_api_h_save, 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/restore", BODY_JSON, 0, 1, 0, st_api_h_restore, 0},
    {ST_HTTP_POST, "/v1/sessions/{id}/park", BODY_JSON, 0, 1, 0, st_api_h_park, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions", BODY_NONE, 0, 0, 0, st_api_h_versions, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions/{v}", BODY_NONE, 0, 0, 0, st_api_h_version_get, 0},
    {ST_HTTP_DELETE, "/v1/sessions/{id}/versions/{v}", BODY_NONE, 0, 0, 0, st_api_h_version_delete, 0},
    {ST_HTTP_GET, "/v1/sessions/{id}/versions/{v}/file", BODY_NONE, 0, 0, 0, st_api_h_version_file, 0},
    {ST_HTTP_POST, "/v1/uploads", BODY_JSON, 0, 0, 0, st_api_h_upload_create, 0},
    {ST_HTTP_PUT, "/v1/uploads/{uid}/parts/{n}", BODY_PART, 0, 0, 0, st_api_h_upload_part, 0},
    {ST_HTTP_POST, "/v1/uploads/{uid}/commit", BODY_JSON, 0, 0, 0, st_api_h_upload_commit, 0},
    {ST_HTTP_DELETE, "/v1/uploads/{uid}", BODY_NONE, 0, 0, 0, st_api_h_upload_delete, 0},
    {ST_HTTP_GET, "/slots", BODY_NONE, 0, 1, 0, st_api_h_slots_list, 0},
    {ST_HTTP_POST, "/slots/{n}", BODY_JSON, 0, 1, 0, st_api_h_slots_action, 0},
    {ST_HTTP_POST, "/apply-template", BODY_COMPLETION, 0, 1, 0, st_api_h_apply_template, 0},
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
    st_api_uploads_expire(s, st_api_now_ms(), (double)s->cfg.upload_ttl_s * 1000.0);
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
    int rc = st_sha256(buf, n, s->key_hash);
    memset(buf, 0, sizeof buf);
    if (rc)
        return rc;
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
        if (st_sys_calls.mkdir(tmp, 0700) != 0 && errno != EEXIST)
            return errno;
        *p = '/';
    }
    if (st_sys_calls.mkdir(tmp, 0700) != 0 && errno != EEXIST)
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
            st_sys_calls.unlink(p);
        }
    }
    closedir(d);
}

/* The bound port, replaced atomically and durably (st_replace_file: temp, fsync, rename, fsync
 * of the directory): a reader sees the old file or the whole new one. */
static int write_ready_file(const char *path, uint16_t port)
{
    char buf[16];
    int n = snprintf(buf, sizeof buf, "%u\n", (unsigned)port);
    int rc = st_replace_file(path, buf, (size_t)n);
    if (rc)
        return st_error_wrap(rc, "--ready-file %s", path);
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
    s->guard.refusals = &s->metrics.conv.memguard_refusals;
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
    if (cfg->tier_url) {
        st_tiernode_opts to = {.url = cfg->tier_url, .node_id = cfg->node_id,
                               .replicas = cfg->tier_replicas,
                               .pending_max = cfg->tier_pending_max,
                               .lease_ms = cfg->tier_lease_ms, .ttl_s = cfg->tier_ttl_s};
        if ((rc = st_tiernode_new(&to, s->store, &s->tier)))
            goto fail;
        s->metrics.tier = s->tier;
    }
    if (cfg->model_path) {
        s->conv_env = (st_conv_env){.cfg = &s->cfg, .store = s->store, .m = &s->metrics.conv,
                                    .guard = &s->guard, .damaged = conv_damaged, .damaged_arg = s,
                                    .tier = s->tier};
        if ((rc = st_conv_new(&s->conv_env, &s->conv)))
            goto fail;
        s->metrics.manager = s->conv;
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
    st_http_cbs cbs = {on_head, on_request, on_done, on_refused, st_api_call_free, on_gone};
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
    if (s->conv)
        rc = st_conv_persist_all(s->conv, &s->lost);
    fprintf(stderr, "strata-server: stopped%s\n", s->lost ? " (live conversations were lost, see above)" : "");
    return rc;
}

void st_api_server_free(st_api_server *s)
{
    if (!s)
        return;
    st_work_free(s->work); /* joins the workers; completions still pending are dropped */
    st_conv_free(s->conv);
    st_tiernode_free(s->tier); /* after the conversations; what is still queued stays local */
    st_http_free(s->http);
    st_api_uploads_free(s);
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
