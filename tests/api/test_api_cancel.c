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
 * The tests wait for the server's own gauges and counters, never for a fixed time; a request
 * that must hold a session busy is left by the test when it is done with it.
 */
#include <stdbool.h>
#include <stdint.h>

#include "st_api_test.h"

/* generated tokens of a long request: seconds on one CPU thread, far longer than the tests wait
 * before leaving */
#define LONG_N 16000
#define SHORT_N 16

static st_at_env env;

/* ---- helpers -------------------------------------------------------------------------------- */

/* strata-server on the tiny model with a context that holds the long request, logging every
 * request, its store DIR/name. */
static int start(st_hc_server *s, const char *name)
{
    static const char *const flags[] = {"--ctx", "16384", "--max-n-predict", "16384", "--log-requests", NULL};
    return st_at_server_start(s, &env, name, flags, NULL);
}

static json_int_t jint(json_t *o, const char *key) { return json_integer_value(json_object_get(o, key)); }

/* Tokens the live conversation of id holds (GET /v1/sessions/{id}). */
static json_int_t live_tokens(uint16_t port, const char *id)
{
    char path[256];
    snprintf(path, sizeof path, "/v1/sessions/%s", id);
    json_t *o = st_at_call(port, "GET", path, NULL, 200);
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

static int setup(void **state)
{
    (void)state;
    return st_at_setup(&env, "test_api_cancel");
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

/* ---- tests ---------------------------------------------------------------------------------- */

/* A long completion whose client leaves while it generates. */
static void cancel_running(const char *store, int reset)
{
    st_hc_server s;
    assert_int_equal(start(&s, store), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", "first turn", LONG_N, true);
    int fd = send_only(s.port, "POST", "/v1/completions", body);
    /* tokens are counted as they are generated: leave once some are */
    assert_int_equal(st_at_await_metric_cmp(s.port, "strata_generated_tokens_total", 8, true), 0);
    leave(fd, reset);
    assert_int_equal(st_at_await_metric(s.port, "strata_completions_cancelled_total", 1), 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 0), 0);

    /* the server is up and the slot free; the conversation kept what was computed */
    json_decref(st_at_call(s.port, "GET", "/healthz", NULL, 200));
    json_int_t held = live_tokens(s.port, "conv");
    /* the prompt as a new conversation reads it: one token generated on top */
    json_t *probe = st_at_complete(s.port, "probe", "first turn", 1, true);
    json_int_t prompt = jint(probe, "n_prompt_tokens");
    json_decref(probe);
    json_int_t kept = held - prompt; /* generated tokens the cancelled run kept */
    fprintf(stderr, "cancelled after %lld of %d tokens (prompt %lld)\n", (long long)kept, LONG_N,
            (long long)prompt);
    assert_true(kept > 0);
    assert_true(kept < LONG_N);

    /* the next turn continues from there */
    json_t *o2 = st_at_complete(s.port, "conv", " second turn", SHORT_N, true);
    assert_string_equal(json_string_value(json_object_get(o2, "found")), "slot");
    assert_int_equal(jint(json_object_get(o2, "timings"), "resumed_tokens"), held);
    assert_int_equal(jint(o2, "n_tokens"), held + jint(o2, "n_prompt_tokens") + SHORT_N);

    /* coherently: a fresh conversation given the same turn with n_predict = kept holds the same
     * tokens, and continues identically */
    json_t *r1 = st_at_complete(s.port, "ref", "first turn", (int)kept, true);
    assert_int_equal(jint(r1, "n_tokens"), held);
    json_t *r2 = st_at_complete(s.port, "ref", " second turn", SHORT_N, true);
    assert_true(json_equal(json_object_get(o2, "tokens"), json_object_get(r2, "tokens")));
    assert_int_equal(jint(o2, "n_tokens"), jint(r2, "n_tokens"));
    assert_int_equal(st_at_metric(s.port, "strata_completions_cancelled_total"), 1);
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

/* A completion waiting for a busy session whose client leaves before its turn never runs. The
 * first completion holds the session until the test leaves it too, so nothing depends on how
 * fast the server generates. */
static void test_cancel_while_waiting(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "wait-store"), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", "first turn", LONG_N, true);
    int first = send_only(s.port, "POST", "/v1/completions", body);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    st_at_completion_body(body, sizeof body, "conv", " second", SHORT_N, true);
    int fd = send_only(s.port, "POST", "/v1/completions", body);
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    leave(fd, 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_completions_cancelled_total", 1), 0);
    assert_int_equal(st_at_metric(s.port, "strata_busy_waiting_requests"), 0);
    assert_int_equal(st_at_metric(s.port, "strata_slots_busy"), 1); /* the first still runs */
    leave(first, 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_completions_cancelled_total", 2), 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 0), 0);

    /* the waiting request never ran: the session holds the first prompt and the tokens the
     * first request generated, and no prompt but the first was read */
    json_int_t held = live_tokens(s.port, "conv");
    json_int_t generated = (json_int_t)st_at_metric(s.port, "strata_generated_tokens_total");
    json_int_t computed = (json_int_t)st_at_metric(s.port, "strata_prompt_tokens_computed_total");
    json_t *probe = st_at_complete(s.port, "probe", "first turn", 1, true);
    json_int_t prompt = jint(probe, "n_prompt_tokens");
    json_decref(probe);
    assert_true(generated > 0);
    assert_int_equal(held, prompt + generated);
    assert_int_equal(computed, prompt);
    json_t *o3 = st_at_complete(s.port, "conv", " third", SHORT_N, true);
    assert_int_equal(jint(o3, "n_tokens") - jint(o3, "n_prompt_tokens") - SHORT_N, held);
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(st_at_metric(s.port, "strata_completions_cancelled_total"), 2);
    json_decref(o3);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* A SAVE whose client leaves while it waits still runs: its result is durable. The completion
 * holding the session ends when the test leaves it, after the SAVE's client left. */
static void test_save_not_cancelled(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "save-store"), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", "first turn", LONG_N, true);
    int first = send_only(s.port, "POST", "/v1/completions", body);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    int fd = send_only(s.port, "POST", "/v1/sessions/conv/save", "{}");
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    leave(fd, 0);
    /* on loopback the FIN is in the server's socket when close() returns; the loop reads it no
     * later than the request of a connection opened after it: one round trip on the loop */
    json_decref(st_at_call(s.port, "GET", "/healthz", NULL, 200));
    leave(first, 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_saves_total", 1), 0);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 0), 0);
    json_t *v = st_at_call(s.port, "GET", "/v1/sessions/conv/versions/latest", NULL, 200);
    assert_int_equal(jint(v, "version"), 1);
    assert_int_equal(jint(v, "tokens"), live_tokens(s.port, "conv"));
    /* only the completion was cancelled */
    assert_int_equal(st_at_metric(s.port, "strata_completions_cancelled_total"), 1);
    json_decref(v);
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
