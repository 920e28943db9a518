/*
 * test_api_cancel.c - clients that go away while their request is in flight, with the tiny model
 * and the real strata-server on loopback:
 *   - a long completion whose client closes its socket: the server stops generating (counted in
 *     strata_completions_cancelled_total), stays up, keeps the tokens computed so far, and the
 *     next completion continues from there token for token like a fresh run given exactly those
 *     tokens (a reference run asking for as many tokens as the cancelled one kept);
 *   - the same with a connection reset (SO_LINGER 0);
 *   - a completion waiting for a busy session whose client leaves before its turn never runs:
 *     the session holds exactly what the first request left;
 *   - a SAVE whose client leaves while it waits is not cancelled: the version is stored.
 * The tests wait for the server's own gauges and counters, never for a fixed time alone.
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

/* generated tokens of a long request: seconds on one CPU thread, far longer than the tests wait
 * before leaving */
#define LONG_N 16000
#define SHORT_N 16

static char dir[4096];
static char model[4200];
static char logpath[4200];

/* ---- helpers -------------------------------------------------------------------------------- */

static int start(st_hc_server *s, const char *name)
{
    char store[4400];
    snprintf(store, sizeof store, "%s/%s", dir, name);
    const char *args[] = {"--store", store, "--model", model, "--threads", "1", "--backend", "cpu",
                          "--ctx", "16384", "--max-n-predict", "16384", "--log-requests", NULL};
    return st_hc_server_start(s, SERVER, dir, logpath, args);
}

static json_t *call(uint16_t port, const char *method, const char *path, const char *body, int want)
{
    st_hc_resp r;
    assert_int_equal(st_hc_json(port, method, path, body, &r), 0);
    if (r.status != want)
        fprintf(stderr, "%s %s %s: %d (wanted %d): %s\n", method, path, body ? body : "", r.status, want,
                r.body ? (char *)r.body : "");
    assert_int_equal(r.status, want);
    json_error_t e;
    json_t *o = json_loadb((const char *)r.body, r.body_len, 0, &e);
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

static json_int_t jint(json_t *o, const char *key) { return json_integer_value(json_object_get(o, key)); }

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

/* Tokens the live conversation of id holds (GET /v1/sessions/{id}). */
static json_int_t live_tokens(uint16_t port, const char *id)
{
    char path[256];
    snprintf(path, sizeof path, "/v1/sessions/%s", id);
    json_t *o = call(port, "GET", path, NULL, 200);
    json_t *live = json_object_get(o, "live");
    assert_true(json_is_object(live));
    json_int_t n = jint(live, "tokens");
    json_decref(o);
    return n;
}

/* A request sent on its own connection, which is left open (the reply is never read). */
static int send_only(uint16_t port, const char *method, const char *path, const char *body)
{
    int fd = st_hc_connect(port, 30000);
    assert_true(fd >= 0);
    assert_int_equal(st_hc_send_req(fd, method, path, NULL, body, strlen(body)), 0);
    return fd;
}

/* The client goes away: a close (FIN) or, with reset, an abortive close (RST). */
static void leave(int fd, int reset)
{
    if (reset) {
        struct linger l = {1, 0};
        assert_int_equal(setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof l), 0);
    }
    close(fd);
}

/* A request on its own thread, read to its reply. */
typedef struct bg_req {
    pthread_t th;
    uint16_t port;
    char body[512];
    st_hc_resp r;
    int rc;
    atomic_int done;
} bg_req;

static void *bg_main(void *arg)
{
    bg_req *b = arg;
    b->rc = st_hc_json(b->port, "POST", "/v1/completions", b->body, &b->r);
    atomic_store(&b->done, 1);
    return NULL;
}

static void bg_completion(bg_req *b, uint16_t port, const char *session, const char *prompt, int n)
{
    memset(b, 0, sizeof *b);
    b->port = port;
    completion_body(b->body, sizeof b->body, session, prompt, n);
    assert_int_equal(pthread_create(&b->th, NULL, bg_main, b), 0);
}

static json_t *bg_join(bg_req *b)
{
    pthread_join(b->th, NULL);
    assert_int_equal(b->rc, 0);
    if (b->r.status != 200)
        fprintf(stderr, "background completion: %d: %s\n", b->r.status, b->r.body ? (char *)b->r.body : "");
    assert_int_equal(b->r.status, 200);
    json_error_t e;
    json_t *o = json_loadb((const char *)b->r.body, b->r.body_len, 0, &e);
    assert_non_null(o);
    st_hc_resp_free(&b->r);
    return o;
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_api_cancel");
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

/* A long completion whose client leaves while it generates. */
static void cancel_running(const char *store, int reset)
{
    st_hc_server s;
    assert_int_equal(start(&s, store), 0);
    char body[512];
    completion_body(body, sizeof body, "conv", "first turn", LONG_N);
    int fd = send_only(s.port, "POST", "/v1/completions", body);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    usleep(100000); /* some tokens are generated */
    leave(fd, reset);
    assert_int_equal(await_metric(s.port, "strata_completions_cancelled_total", 1), 0);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 0), 0);

    /* the server is up and the slot free; the conversation kept what was computed */
    json_decref(call(s.port, "GET", "/healthz", NULL, 200));
    json_int_t held = live_tokens(s.port, "conv");
    /* the prompt as a new conversation reads it: one token generated on top */
    json_t *probe = complete(s.port, "probe", "first turn", 1);
    json_int_t prompt = jint(probe, "n_prompt_tokens");
    json_decref(probe);
    json_int_t kept = held - prompt; /* generated tokens the cancelled run kept */
    fprintf(stderr, "cancelled after %lld of %d tokens (prompt %lld)\n", (long long)kept, LONG_N,
            (long long)prompt);
    assert_true(kept > 0);
    assert_true(kept < LONG_N);

    /* the next turn continues from there */
    json_t *o2 = complete(s.port, "conv", " second turn", SHORT_N);
    assert_string_equal(json_string_value(json_object_get(o2, "found")), "slot");
    assert_int_equal(jint(json_object_get(o2, "timings"), "resumed_tokens"), held);
    assert_int_equal(jint(o2, "n_tokens"), held + jint(o2, "n_prompt_tokens") + SHORT_N);

    /* coherently: a fresh conversation given the same turn with n_predict = kept holds the same
     * tokens, and continues identically */
    json_t *r1 = complete(s.port, "ref", "first turn", (int)kept);
    assert_int_equal(jint(r1, "n_tokens"), held);
    json_t *r2 = complete(s.port, "ref", " second turn", SHORT_N);
    assert_true(json_equal(json_object_get(o2, "tokens"), json_object_get(r2, "tokens")));
    assert_int_equal(jint(o2, "n_tokens"), jint(r2, "n_tokens"));
    assert_int_equal(metric(s.port, "strata_completions_cancelled_total"), 1);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(o2);
    json_decref(r1);
    json_decref(r2);
}

static void test_cancel_on_close(void **state)
{
    (void)state;
    cancel_running("close-store", 0);
}

static void test_cancel_on_reset(void **state)
{
    (void)state;
    cancel_running("reset-store", 1);
}

/* A completion waiting for a busy session whose client leaves before its turn never runs. */
static void test_cancel_while_waiting(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "wait-store"), 0);
    bg_req a;
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    char body[512];
    completion_body(body, sizeof body, "conv", " second", SHORT_N);
    int fd = send_only(s.port, "POST", "/v1/completions", body);
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    leave(fd, 0);
    assert_int_equal(await_metric(s.port, "strata_completions_cancelled_total", 1), 0);
    assert_int_equal(metric(s.port, "strata_busy_waiting_requests"), 0);
    assert_false(atomic_load(&a.done)); /* cancelled while the first still ran */
    json_t *o1 = bg_join(&a);
    assert_int_equal(jint(o1, "n_tokens"), jint(o1, "n_prompt_tokens") + LONG_N);
    /* the waiting request never ran: the session holds exactly what the first one left */
    assert_int_equal(live_tokens(s.port, "conv"), jint(o1, "n_tokens"));
    json_t *o3 = complete(s.port, "conv", " third", SHORT_N);
    assert_int_equal(jint(o3, "n_tokens") - jint(o3, "n_prompt_tokens") - SHORT_N, jint(o1, "n_tokens"));
    assert_int_equal(metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(metric(s.port, "strata_completions_cancelled_total"), 1);
    json_decref(o1);
    json_decref(o3);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* A SAVE whose client leaves while it waits still runs: its result is durable. */
static void test_save_not_cancelled(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "save-store"), 0);
    bg_req a;
    bg_completion(&a, s.port, "conv", "first turn", LONG_N);
    assert_int_equal(await_metric(s.port, "strata_slots_busy", 1), 0);
    int fd = send_only(s.port, "POST", "/v1/sessions/conv/save", "{}");
    assert_int_equal(await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    leave(fd, 0);
    json_t *o1 = bg_join(&a);
    json_t *v = NULL;
    for (int i = 0; i < 2000; i++) { /* the SAVE runs once the completion released the session */
        st_hc_resp r;
        assert_int_equal(st_hc_json(s.port, "GET", "/v1/sessions/conv/versions/latest", NULL, &r), 0);
        if (r.status == 200) {
            json_error_t e;
            v = json_loadb((const char *)r.body, r.body_len, 0, &e);
            st_hc_resp_free(&r);
            break;
        }
        st_hc_resp_free(&r);
        usleep(10000);
    }
    assert_non_null(v);
    assert_int_equal(jint(v, "version"), 1);
    assert_int_equal(jint(v, "tokens"), jint(o1, "n_tokens"));
    assert_int_equal(metric(s.port, "strata_saves_total"), 1);
    assert_int_equal(metric(s.port, "strata_completions_cancelled_total"), 0);
    json_decref(v);
    json_decref(o1);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_cancel_on_close),
        cmocka_unit_test(test_cancel_on_reset),
        cmocka_unit_test(test_cancel_while_waiting),
        cmocka_unit_test(test_save_not_cancelled),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
