/*
 * st_api_test.h - helpers shared by the strata-server tests (test_api_http.c, test_api_engine.c,
 * test_api_busy.c, test_api_cancel.c), which drive the real binary on loopback:
 *   - a scratch directory with the tiny model, and strata-server started on it with extra flags;
 *   - JSON requests whose status is checked, completions, the value of a metric in /metrics;
 *   - a request on its own thread;
 *   - N concurrent client threads with a /healthz poller running beside them.
 * The checks are cmocka assertions: a helper that finds a wrong answer fails the running test.
 */
#ifndef ST_API_TEST_H
#define ST_API_TEST_H

#include <errno.h>
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_http_client.h"
#include "st_test_util.h"

#define ST_AT_SERVER ST_BIN_DIR "/strata-server"
#define ST_AT_MKMODEL ST_BIN_DIR "/strata-mkmodel"

/* ---- the server on the tiny model ------------------------------------------------------------ */

/* One test program's scratch directory (its stores live in DIR/name), the tiny model in it, the
 * servers' log, and the engine backend they run on ("cpu" unless the test sets another before
 * st_at_setup). */
typedef struct st_at_env {
    char dir[4096];
    char model[4200];
    char logpath[4200];
    const char *backend;
} st_at_env;

/* A fresh scratch directory named name (see st_test_tmpdir) with the tiny model written by
 * strata-mkmodel in it. 0, or -1 when the model could not be made; for a cmocka group setup. */
static inline int st_at_setup(st_at_env *env, const char *name)
{
    if (!env->backend)
        env->backend = "cpu";
    st_test_tmpdir(env->dir, sizeof env->dir, name);
    snprintf(env->model, sizeof env->model, "%s/tiny.gguf", env->dir);
    snprintf(env->logpath, sizeof env->logpath, "%s/server.log", env->dir);
    char out[4096];
    return st_test_run(out, sizeof out, ST_AT_MKMODEL " --preset tiny -o '%s'", env->model) == 0 ? 0 : -1;
}

/* Kill the servers a failed test left running; remove the scratch directory unless ST_TEST_KEEP
 * is set (to look at the servers' logs and stores). Returns 0; for a cmocka group teardown. */
static inline int st_at_teardown(st_at_env *env)
{
    st_hc_server_kill_all();
    if (!getenv("ST_TEST_KEEP"))
        st_test_rmdir(env->dir);
    return 0;
}

/* strata-server on env's model and backend with one thread and its store in DIR/store, then the
 * flags of two NULL-terminated lists (either may be NULL): flags, then extra. 0 when it listens;
 * E2BIG when the lists hold more than 31 flags together; otherwise -1 (see st_hc_server_start). */
static inline int st_at_server_start(st_hc_server *s, const st_at_env *env, const char *store,
                                     const char *const *flags, const char *const *extra)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", env->dir, store);
    const char *args[40] = {"--store", path, "--model", env->model, "--threads", "1", "--backend", env->backend};
    int n = 8;
    const char *const *lists[] = {flags, extra};
    for (int l = 0; l < 2; l++)
        for (const char *const *a = lists[l]; a && *a; a++) {
            if (n == 39)
                return E2BIG;
            args[n++] = *a;
        }
    args[n] = NULL;
    return st_hc_server_start(s, ST_AT_SERVER, env->dir, env->logpath, args);
}

/* ---- requests -------------------------------------------------------------------------------- */

/* r's body as JSON (a new reference), or NULL with the body printed when it is not JSON. */
static inline json_t *st_at_parse(const st_hc_resp *r)
{
    json_error_t e;
    json_t *o = json_loadb((const char *)r->body, r->body_len, 0, &e);
    if (!o)
        fprintf(stderr, "not JSON (%d): %.200s\n", r->status, r->body ? (char *)r->body : "");
    return o;
}

/* A JSON request (body may be NULL); its reply, which must have status want and be JSON (a new
 * reference). A wrong status is printed with the request and the reply. */
static inline json_t *st_at_call(uint16_t port, const char *method, const char *path, const char *body,
                                 int want)
{
    st_hc_resp r;
    assert_int_equal(st_hc_json(port, method, path, body, &r), 0);
    if (r.status != want)
        fprintf(stderr, "%s %s %s: %d (wanted %d): %s\n", method, path, body ? body : "", r.status, want,
                r.body ? (char *)r.body : "");
    assert_int_equal(r.status, want);
    json_t *o = st_at_parse(&r);
    assert_non_null(o);
    st_hc_resp_free(&r);
    return o;
}

/* The body of a greedy completion of n tokens for session; with ignore_eos, all n are generated
 * even past an end of sequence. */
static inline void st_at_completion_body(char *dst, size_t cap, const char *session, const char *prompt,
                                         int n, bool ignore_eos)
{
    snprintf(dst, cap, "{\"session\":\"%s\",\"prompt\":\"%s\",\"n_predict\":%d,\"temperature\":0%s}",
             session, prompt, n, ignore_eos ? ",\"ignore_eos\":true" : "");
}

/* A completion (see st_at_completion_body) that must answer 200; returns the reply (tokens, text,
 * found, ...). */
static inline json_t *st_at_complete(uint16_t port, const char *session, const char *prompt, int n,
                                     bool ignore_eos)
{
    char body[1024];
    st_at_completion_body(body, sizeof body, session, prompt, n, ignore_eos);
    return st_at_call(port, "POST", "/v1/completions", body, 200);
}

/* The value of an unlabelled metric, or -1 when /metrics does not have it. */
static inline double st_at_metric(uint16_t port, const char *name)
{
    st_hc_resp r;
    double v = -1;
    if (st_hc_request(port, "GET", "/metrics", NULL, NULL, 0, &r) || r.status != 200) {
        st_hc_resp_free(&r);
        return -1;
    }
    char key[128];
    snprintf(key, sizeof key, "\n%s ", name);
    const char *p = strstr((const char *)r.body, key);
    if (p)
        v = strtod(p + strlen(key), NULL);
    st_hc_resp_free(&r);
    return v;
}

/* Poll /metrics until name reaches want (at_least: want or more), for 60 s at most (a bound for
 * a server that is broken, never a wait for an event): 0 when it did. */
static inline int st_at_await_metric_cmp(uint16_t port, const char *name, double want, bool at_least)
{
    double end = st_hc_now_ms() + 60000, v = -1;
    while (st_hc_now_ms() < end) {
        v = st_at_metric(port, name);
        if (v == want || (at_least && v > want))
            return 0;
        usleep(2000);
    }
    fprintf(stderr, "%s never reached %s%g (now %g)\n", name, at_least ? ">= " : "", want, v);
    return -1;
}

/* Poll /metrics until name is want (see st_at_await_metric_cmp). */
static inline int st_at_await_metric(uint16_t port, const char *name, double want)
{
    return st_at_await_metric_cmp(port, name, want, false);
}

/* ---- a request on its own thread ------------------------------------------------------------- */

/* Started by st_at_bg_start or st_at_bg_completion; `done` is set once the reply is read, and
 * st_at_bg_join must be called once. */
typedef struct st_at_bg {
    pthread_t th;
    uint16_t port;
    const char *method; /* static */
    char path[128];
    char body[512];
    st_hc_resp r;
    int rc;
    atomic_int done;
} st_at_bg;

/* A request on its own thread may be the long one others wait behind, and runs as long as the
 * build makes it (ASan, TSan, a loaded machine): its client waits for the reply up to just below
 * ctest's 300 s, the bound for a server that hangs. */
#define ST_AT_BG_TIMEOUT_MS 290000

static inline void *st_at_bg_main(void *arg)
{
    st_at_bg *b = arg;
    b->rc = st_hc_request_ms(b->port, ST_AT_BG_TIMEOUT_MS, b->method, b->path, NULL, b->body,
                             strlen(b->body), &b->r);
    atomic_store(&b->done, 1);
    return NULL;
}

/* Send a JSON request (method must outlive the request; path and body are copied) on a thread. */
static inline void st_at_bg_start(st_at_bg *b, uint16_t port, const char *method, const char *path,
                                  const char *body)
{
    memset(b, 0, sizeof *b);
    b->port = port;
    b->method = method;
    snprintf(b->path, sizeof b->path, "%s", path);
    snprintf(b->body, sizeof b->body, "%s", body);
    assert_int_equal(pthread_create(&b->th, NULL, st_at_bg_main, b), 0);
}

/* A completion (see st_at_completion_body) on a thread. */
static inline void st_at_bg_completion(st_at_bg *b, uint16_t port, const char *session, const char *prompt,
                                       int n, bool ignore_eos)
{
    char body[512];
    st_at_completion_body(body, sizeof body, session, prompt, n, ignore_eos);
    st_at_bg_start(b, port, "POST", "/v1/completions", body);
}

/* Join b; its reply as JSON (a new reference), which must have status want. */
static inline json_t *st_at_bg_join(st_at_bg *b, int want)
{
    pthread_join(b->th, NULL);
    assert_int_equal(b->rc, 0);
    if (b->r.status != want)
        fprintf(stderr, "%s %s: %d (wanted %d): %s\n", b->method, b->path, b->r.status, want,
                b->r.body ? (char *)b->r.body : "");
    assert_int_equal(b->r.status, want);
    json_t *o = st_at_parse(&b->r);
    assert_non_null(o);
    st_hc_resp_free(&b->r);
    return o;
}

/* ---- concurrent clients ---------------------------------------------------------------------- */
/* One client thread: its index, and its failures with the last reason. */
typedef struct st_at_client {
    int i, failures;
    char why[256];
} st_at_client;

/* A thread asking GET /healthz every 5 ms while `running`: answers that were 200, others, and
 * the slowest answer. */
typedef struct st_at_poller {
    uint16_t port;
    atomic_int running;
    int ok, failed;
    double worst_ms;
} st_at_poller;

static inline void *st_at_poller_main(void *arg)
{
    st_at_poller *p = arg;
    while (atomic_load(&p->running)) {
        st_hc_resp r;
        double t0 = st_hc_now_ms();
        if (st_hc_request(p->port, "GET", "/healthz", NULL, NULL, 0, &r) || r.status != 200)
            p->failed++;
        else
            p->ok++;
        double ms = st_hc_now_ms() - t0;
        if (ms > p->worst_ms)
            p->worst_ms = ms;
        st_hc_resp_free(&r);
        usleep(5000);
    }
    return NULL;
}

/* Run n clients (cl[0..n-1], fn(&cl[i])) at once against port with a poller beside them; every
 * client's failure is printed. Returns the failures summed over the clients, or -1 when a thread
 * could not be started. *pol is filled in. */
static inline int st_at_run_clients(uint16_t port, int n, void *(*fn)(void *), st_at_client *cl,
                                    st_at_poller *pol)
{
    pthread_t th[n], pt;
    memset(pol, 0, sizeof *pol);
    pol->port = port;
    atomic_store(&pol->running, 1);
    if (pthread_create(&pt, NULL, st_at_poller_main, pol))
        return -1;
    int started = 0, failures = 0;
    for (int i = 0; i < n; i++, started++) {
        memset(&cl[i], 0, sizeof cl[i]);
        cl[i].i = i;
        if (pthread_create(&th[i], NULL, fn, &cl[i]))
            break;
    }
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (cl[i].failures)
            fprintf(stderr, "client %d: %s\n", i, cl[i].why);
        failures += cl[i].failures;
    }
    atomic_store(&pol->running, 0);
    pthread_join(pt, NULL);
    fprintf(stderr, "%d clients: /healthz answered %d times during the load (worst %.1f ms)\n", n,
            pol->ok, pol->worst_ms);
    return started == n ? failures : -1;
}

#endif /* ST_API_TEST_H */
