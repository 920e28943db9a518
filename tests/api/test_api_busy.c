/*
 * test_api_busy.c - requests for a session another request is using (--busy-wait-ms), with the
 * tiny model and the real strata-server on loopback:
 *   - completions for a session sent while a long one runs wait for it and are served in arrival
 *     order, each continuing the one before: their tokens equal a sequential run, and a SAVE sent
 *     last stores every turn; /healthz and a completion for another session are answered while
 *     they wait;
 *   - --busy-wait-ms 0: 409 busy at once, while the first request still runs;
 *   - a short wait behind a long request: 409 busy saying how long it waited, counted in /metrics;
 *   - the wait queue full (waiting requests and their holders may take at most --workers - 1
 *     workers): 409 busy at once, the others still served;
 *   - a DELETE waits in line too, and a completion queued behind it starts a new conversation.
 * The first request of each case is long (thousands of generated tokens in a large context) so
 * that the others reach the server while it runs; the tests wait for the server's own gauges
 * (strata_slots_busy, strata_busy_waiting_requests) rather than for a time.
 */
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_http_client.h"
#include "st_test_util.h"

#define SERVER ST_BIN_DIR "/strata-server"
#define MKMODEL ST_BIN_DIR "/strata-mkmodel"

/* generated tokens of the long first request: about a second on one CPU thread */
#define LONG_N 8000
#define SHORT_N 16

static char dir[4096];
static char model[4200];
static char logpath[4200];

/* ---- helpers -------------------------------------------------------------------------------- */

/* strata-server on the tiny model with a context that holds the long request, its store
 * DIR/name, with extra flags (NULL-terminated). */
static int start(st_hc_server *s, const char *name, const char *const *extra)
{
    char store[4400];
    snprintf(store, sizeof store, "%s/%s", dir, name);
    const char *args[40] = {"--store", store, "--model", model, "--threads", "1", "--backend", "cpu",
                            "--ctx", "16384", "--max-n-predict", "16384"};
    int n = 12;
    for (const char *const *a = extra; a && *a && n < 38; a++)
        args[n++] = *a;
    args[n] = NULL;
    return st_hc_server_start(s, SERVER, dir, logpath, args);
}

static json_t *parse(const st_hc_resp *r)
{
    json_error_t e;
    json_t *o = json_loadb((const char *)r->body, r->body_len, 0, &e);
    if (!o)
        fprintf(stderr, "not JSON (%d): %.200s\n", r->status, r->body ? (char *)r->body : "");
    return o;
}

static json_t *call(uint16_t port, const char *method, const char *path, const char *body, int want)
{
    st_hc_resp r;
    assert_int_equal(st_hc_json(port, method, path, body, &r), 0);
    if (r.status != want)
        fprintf(stderr, "%s %s %s: %d (wanted %d): %s\n", method, path, body ? body : "", r.status, want,
                r.body ? (char *)r.body : "");
    assert_int_equal(r.status, want);
    json_t *o = parse(&r);
    assert_non_null(o);
    st_hc_resp_free(&r);
    return o;
}

static void completion_body(char *dst, size_t cap, const char *session, const char *prompt, int n)
{
    snprintf(dst, cap,
             "{\"session\":\"%s\",\"prompt\":\"%s\",\"n_predict\":%d,\"temperature\":0,"
             "\"ignore_eos\":true}",
             session, prompt, n);
}

static json_t *complete(uint16_t port, const char *session, const char *prompt, int n)
{
    char body[512];
    completion_body(body, sizeof body, session, prompt, n);
    return call(port, "POST", "/v1/completions", body, 200);
}

/* The value of an unlabelled metric, or -1 when /metrics does not have it. */
static double metric(uint16_t port, const char *name)
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

/* Poll /metrics until name reaches want (20 s at most): 0 when it did. */
static int await_metric(uint16_t port, const char *name, double want)
{
    for (int i = 0; i < 10000; i++) {
        if (metric(port, name) == want)
            return 0;
        usleep(2000);
    }
    fprintf(stderr, "%s never reached %g (now %g)\n", name, want, metric(port, name));
    return -1;
}

/* A request on its own thread. */
typedef struct bg_req {
    pthread_t th;
    uint16_t port;
    const char *method;
    char path[128];
    char body[512];
    st_hc_resp r;
    int rc;
    atomic_int done;
} bg_req;

static void *bg_main(void *arg)
{
    bg_req *b = arg;
    b->rc = st_hc_json(b->port, b->method, b->path, b->body, &b->r);
    atomic_store(&b->done, 1);
    return NULL;
}

static void bg_start(bg_req *b, uint16_t port, const char *method, const char *path, const char *body)
{
    memset(b, 0, sizeof *b);
    b->port = port;
    b->method = method;
    snprintf(b->path, sizeof b->path, "%s", path);
    snprintf(b->body, sizeof b->body, "%s", body);
    assert_int_equal(pthread_create(&b->th, NULL, bg_main, b), 0);
}

/* Join b; its reply as JSON, which must have status want. */
static json_t *bg_join(bg_req *b, int want)
{
    pthread_join(b->th, NULL);
    assert_int_equal(b->rc, 0);
    if (b->r.status != want)
        fprintf(stderr, "%s %s: %d (wanted %d): %s\n", b->method, b->path, b->r.status, want,
                b->r.body ? (char *)b->r.body : "");
    assert_int_equal(b->r.status, want);
    json_t *o = parse(&b->r);
    assert_non_null(o);
    st_hc_resp_free(&b->r);
    return o;
}

static void bg_completion(bg_req *b, uint16_t port, const char *session, const char *prompt, int n)
{
    char body[512];
    completion_body(body, sizeof body, session, prompt, n);
    bg_start(b, port, "POST", "/v1/completions", body);
}

/* The error of a 409 reply: code "busy", and the message returned (borrowed from o). */
static const char *busy_message(json_t *o)
{
    json_t *e = json_object_get(o, "error");
    assert_string_equal(json_string_value(json_object_get(e, "code")), "busy");
    const char *msg = json_string_value(json_object_get(e, "message"));
    assert_non_null(msg);
    return msg;
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_api_busy");
    snprintf(model, sizeof model, "%s/tiny.gguf", dir);
    snprintf(logpath, sizeof logpath, "%s/server.log", dir);
    char out[4096];
    return st_test_run(out, sizeof out, MKMODEL " --preset tiny -o '%s'", model) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    st_hc_server_kill_all();
    if (!getenv("ST_TEST_KEEP"))
        st_test_rmdir(dir);
    return 0;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_second_request_waits_and_continues(void **state)
{
    (void)state;
    /* 6 workers: the holder and three waiters take four, leaving two */
    static const char *const args[] = {"--slots", "2", "--workers", "6", NULL};
    /* the reference: the turns one after the other */
    st_hc_server s;
    assert_int_equal(start(&s, "ref-store", args), 0);
    json_t *r1 = complete(s.port, "conv", "first turn", LONG_N);
    json_t *r2 = complete(s.port, "conv", " second turn", SHORT_N);
    json_t *r3 = complete(s.port, "conv", " third turn", SHORT_N);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, "wait-store", args), 0);
    bg_req a, b, c, sv;
    char body[512];
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    /* each sent once the one before waits: they must be served in this order */
    bg_completion(&b, s.port, "conv", " second turn", SHORT_N);
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    bg_completion(&c, s.port, "conv", " third turn", SHORT_N);
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 2), 0);
    bg_start(&sv, s.port, "POST", "/v1/sessions/conv/save", "{}");
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 3), 0);
    assert_false(atomic_load(&a.done));

    /* while they wait: /healthz, and a completion for another session (a free slot and worker) */
    json_t *h = call(s.port, "GET", "/healthz", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(h, "status")), "ok");
    json_decref(h);
    json_t *other = complete(s.port, "other", "meanwhile", 4);
    assert_string_equal(json_string_value(json_object_get(other, "found")), "new");
    json_decref(other);
    assert_false(atomic_load(&b.done)); /* still waiting for a */
    assert_false(atomic_load(&sv.done));
    assert_int_equal(metric(s.port, "strata_busy_waiting_requests"), 3);

    json_t *o1 = bg_join(&a, 200), *o2 = bg_join(&b, 200), *o3 = bg_join(&c, 200);
    json_t *os = bg_join(&sv, 201);
    /* token for token the sequential run: b continued a, c continued b */
    assert_true(json_equal(json_object_get(o1, "tokens"), json_object_get(r1, "tokens")));
    assert_true(json_equal(json_object_get(o2, "tokens"), json_object_get(r2, "tokens")));
    assert_true(json_equal(json_object_get(o3, "tokens"), json_object_get(r3, "tokens")));
    assert_string_equal(json_string_value(json_object_get(o2, "found")), "slot");
    assert_int_equal(json_integer_value(json_object_get(o2, "n_tokens")),
                     json_integer_value(json_object_get(r2, "n_tokens")));
    assert_int_equal(json_integer_value(json_object_get(o3, "n_tokens")),
                     json_integer_value(json_object_get(r3, "n_tokens")));
    assert_true(json_integer_value(json_object_get(json_object_get(o2, "timings"), "resumed_tokens")) > 0);
    /* the SAVE, sent last, saw every turn */
    assert_int_equal(json_integer_value(json_object_get(os, "tokens")),
                     json_integer_value(json_object_get(o3, "n_tokens")));
    assert_int_equal(metric(s.port, "strata_busy_waiting_requests"), 0);
    assert_int_equal(metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    /* and the session goes on */
    completion_body(body, sizeof body, "conv", " third", 4);
    json_decref(call(s.port, "POST", "/v1/completions", body, 200));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(o1);
    json_decref(o2);
    json_decref(o3);
    json_decref(os);
    json_decref(r1);
    json_decref(r2);
    json_decref(r3);
}

static void test_wait_off_answers_at_once(void **state)
{
    (void)state;
    static const char *const args[] = {"--busy-wait-ms", "0", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "off-store", args), 0);
    bg_req a;
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    char body[512];
    completion_body(body, sizeof body, "conv", " second", SHORT_N);
    json_t *o = call(s.port, "POST", "/v1/completions", body, 409);
    assert_false(atomic_load(&a.done)); /* answered while the first still runs */
    const char *msg = busy_message(o);
    assert_non_null(strstr(msg, "session conv is busy with another request"));
    assert_null(strstr(msg, "waiting"));
    json_decref(o);
    o = call(s.port, "POST", "/v1/sessions/conv/save", "{}", 409);
    busy_message(o);
    json_decref(o);
    json_decref(bg_join(&a, 200));
    assert_int_equal(metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_wait_times_out(void **state)
{
    (void)state;
    static const char *const args[] = {"--busy-wait-ms", "300", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "timeout-store", args), 0);
    bg_req a;
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    char body[512];
    completion_body(body, sizeof body, "conv", " second", SHORT_N);
    double t0 = st_hc_now_ms();
    json_t *o = call(s.port, "POST", "/v1/completions", body, 409);
    double ms = st_hc_now_ms() - t0;
    const char *msg = busy_message(o);
    if (!strstr(msg, "after waiting 300 ms"))
        fail_msg("the 409 does not say how long it waited: %s", msg);
    assert_true(ms >= 300); /* it waited at least the wait, measured on the server's clock */
    json_decref(o);
    assert_int_equal(metric(s.port, "strata_busy_wait_timeouts_total"), 1);
    assert_int_equal(metric(s.port, "strata_busy_waiting_requests"), 0);
    json_t *o1 = bg_join(&a, 200);
    /* the session is usable again, from where the first request left it */
    json_t *o3 = complete(s.port, "conv", " second", SHORT_N);
    assert_string_equal(json_string_value(json_object_get(o3, "found")), "slot");
    json_int_t held = json_integer_value(json_object_get(o3, "n_tokens")) -
                      json_integer_value(json_object_get(o3, "n_prompt_tokens")) - SHORT_N;
    assert_int_equal(held, json_integer_value(json_object_get(o1, "n_tokens")));
    json_decref(o1);
    json_decref(o3);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_wait_queue_full(void **state)
{
    (void)state;
    /* 3 workers: the holder and one waiter take two, the third stays for everything else */
    static const char *const args[] = {"--workers", "3", "--slots", "2", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "full-store", args), 0);
    bg_req a, b;
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    bg_completion(&b, s.port, "conv", " second", SHORT_N);
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    char body[512];
    completion_body(body, sizeof body, "conv", " third", SHORT_N);
    json_t *o = call(s.port, "POST", "/v1/completions", body, 409);
    assert_false(atomic_load(&a.done)); /* at once, not after a wait */
    const char *msg = busy_message(o);
    if (!strstr(msg, "wait queue is full"))
        fail_msg("the 409 does not say the wait queue is full: %s", msg);
    json_decref(o);
    assert_int_equal(metric(s.port, "strata_busy_wait_queue_full_total"), 1);
    /* DELETE of the session waits like the others: refused the same way */
    o = call(s.port, "DELETE", "/v1/sessions/conv", NULL, 409);
    busy_message(o);
    json_decref(o);
    /* everything else is still served */
    json_decref(call(s.port, "GET", "/healthz", NULL, 200));
    json_decref(complete(s.port, "other", "meanwhile", 4));
    assert_false(atomic_load(&b.done));
    json_decref(bg_join(&a, 200));
    json_t *o2 = bg_join(&b, 200);
    assert_string_equal(json_string_value(json_object_get(o2, "found")), "slot");
    json_decref(o2);
    assert_int_equal(metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* DELETE waits for the running completion; a completion sent after the DELETE waits behind it
 * and starts a new conversation: it never sees the versions the DELETE removes. */
static void test_delete_waits_in_line(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "delete-store", NULL), 0);
    json_decref(complete(s.port, "conv", "kept", 4));
    json_decref(call(s.port, "POST", "/v1/sessions/conv/save", "{}", 201));
    bg_req a, d, c;
    bg_completion(&a, s.port, "conv", " long turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    bg_start(&d, s.port, "DELETE", "/v1/sessions/conv", "");
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    bg_completion(&c, s.port, "conv", "after", 4);
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 2), 0);
    assert_false(atomic_load(&a.done));
    json_decref(bg_join(&a, 200));
    json_t *od = bg_join(&d, 200), *oc = bg_join(&c, 200);
    assert_true(json_is_true(json_object_get(od, "live_deleted")));
    assert_int_equal(json_integer_value(json_object_get(od, "versions_deleted")), 1);
    assert_string_equal(json_string_value(json_object_get(oc, "found")), "new");
    json_decref(od);
    json_decref(oc);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_second_request_waits_and_continues),
        cmocka_unit_test(test_wait_off_answers_at_once),
        cmocka_unit_test(test_wait_times_out),
        cmocka_unit_test(test_wait_queue_full),
        cmocka_unit_test(test_delete_waits_in_line),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
