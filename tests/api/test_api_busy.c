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
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "st_api_test.h"

/* generated tokens of the long first request: about a second on one CPU thread; a sanitizer
 * build's server (ASan, TSan) is several times slower, so a quarter holds the session as long */
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define ST_BUSY_SANITIZED 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define ST_BUSY_SANITIZED 1
#endif
#endif
#ifdef ST_BUSY_SANITIZED
#define LONG_N 2000
#else
#define LONG_N 8000
#endif
#define SHORT_N 16

static st_at_env env;

/* Waiting requests of the tests that want them served in turn wait for the holder however long
 * the build makes it run (the default 30 s was passed under TSan), up to below ctest's bound. */
#define WAIT_LONG "--busy-wait-ms", "280000"

/* ---- helpers -------------------------------------------------------------------------------- */

/* strata-server on the tiny model with a context that holds the long request, its store
 * DIR/name, with extra flags (NULL-terminated). */
static int start(st_hc_server *s, const char *name, const char *const *extra)
{
    static const char *const flags[] = {"--ctx", "16384", "--max-n-predict", "16384", NULL};
    return st_at_server_start(s, &env, name, flags, extra);
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
    return st_at_setup(&env, "test_api_busy");
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_second_request_waits_and_continues(void **state)
{
    (void)state;
    /* 6 workers: the holder and three waiters take four, leaving two */
    static const char *const args[] = {"--slots", "2", "--workers", "6", WAIT_LONG, NULL};
    /* the reference: the turns one after the other */
    st_hc_server s;
    assert_int_equal(start(&s, "ref-store", args), 0);
    json_t *r1 = st_at_complete(s.port, "conv", "first turn", LONG_N, true);
    json_t *r2 = st_at_complete(s.port, "conv", " second turn", SHORT_N, true);
    json_t *r3 = st_at_complete(s.port, "conv", " third turn", SHORT_N, true);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, "wait-store", args), 0);
    st_at_bg a, b, c, sv;
    char body[512];
    st_at_bg_completion(&a, s.port, "conv", "first turn", LONG_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    /* each sent once the one before waits: they must be served in this order */
    st_at_bg_completion(&b, s.port, "conv", " second turn", SHORT_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    st_at_bg_completion(&c, s.port, "conv", " third turn", SHORT_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 2), 0);
    st_at_bg_start(&sv, s.port, "POST", "/v1/sessions/conv/save", "{}");
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 3), 0);
    assert_false(atomic_load(&a.done));

    /* while they wait: /healthz, and a completion for another session (a free slot and worker) */
    json_t *h = st_at_call(s.port, "GET", "/healthz", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(h, "status")), "ok");
    json_decref(h);
    json_t *other = st_at_complete(s.port, "other", "meanwhile", 4, true);
    assert_string_equal(json_string_value(json_object_get(other, "found")), "new");
    json_decref(other);
    assert_false(atomic_load(&b.done)); /* still waiting for a */
    assert_false(atomic_load(&sv.done));
    assert_int_equal(st_at_metric(s.port, "strata_busy_waiting_requests"), 3);

    json_t *o1 = st_at_bg_join(&a, 200), *o2 = st_at_bg_join(&b, 200), *o3 = st_at_bg_join(&c, 200);
    json_t *os = st_at_bg_join(&sv, 201);
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
    assert_int_equal(st_at_metric(s.port, "strata_busy_waiting_requests"), 0);
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    /* and the session goes on */
    st_at_completion_body(body, sizeof body, "conv", " third", 4, true);
    json_decref(st_at_call(s.port, "POST", "/v1/completions", body, 200));
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
    st_at_bg a;
    st_at_bg_completion(&a, s.port, "conv", "first turn", LONG_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", " second", SHORT_N, true);
    json_t *o = st_at_call(s.port, "POST", "/v1/completions", body, 409);
    assert_false(atomic_load(&a.done)); /* answered while the first still runs */
    const char *msg = busy_message(o);
    assert_non_null(strstr(msg, "session conv is busy with another request"));
    assert_null(strstr(msg, "waiting"));
    json_decref(o);
    o = st_at_call(s.port, "POST", "/v1/sessions/conv/save", "{}", 409);
    busy_message(o);
    json_decref(o);
    json_decref(st_at_bg_join(&a, 200));
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_wait_times_out(void **state)
{
    (void)state;
    static const char *const args[] = {"--busy-wait-ms", "300", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "timeout-store", args), 0);
    st_at_bg a;
    st_at_bg_completion(&a, s.port, "conv", "first turn", LONG_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", " second", SHORT_N, true);
    double t0 = st_hc_now_ms();
    json_t *o = st_at_call(s.port, "POST", "/v1/completions", body, 409);
    double ms = st_hc_now_ms() - t0;
    const char *msg = busy_message(o);
    if (!strstr(msg, "after waiting 300 ms"))
        fail_msg("the 409 does not say how long it waited: %s", msg);
    assert_true(ms >= 300); /* it waited at least the wait, measured on the server's clock */
    json_decref(o);
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_timeouts_total"), 1);
    assert_int_equal(st_at_metric(s.port, "strata_busy_waiting_requests"), 0);
    json_t *o1 = st_at_bg_join(&a, 200);
    /* the session is usable again, from where the first request left it */
    json_t *o3 = st_at_complete(s.port, "conv", " second", SHORT_N, true);
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
    static const char *const args[] = {"--workers", "3", "--slots", "2", WAIT_LONG, NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "full-store", args), 0);
    st_at_bg a, b;
    st_at_bg_completion(&a, s.port, "conv", "first turn", LONG_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    st_at_bg_completion(&b, s.port, "conv", " second", SHORT_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    char body[512];
    st_at_completion_body(body, sizeof body, "conv", " third", SHORT_N, true);
    json_t *o = st_at_call(s.port, "POST", "/v1/completions", body, 409);
    assert_false(atomic_load(&a.done)); /* at once, not after a wait */
    const char *msg = busy_message(o);
    if (!strstr(msg, "wait queue is full"))
        fail_msg("the 409 does not say the wait queue is full: %s", msg);
    json_decref(o);
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_queue_full_total"), 1);
    /* DELETE of the session waits like the others: refused the same way */
    o = st_at_call(s.port, "DELETE", "/v1/sessions/conv", NULL, 409);
    busy_message(o);
    json_decref(o);
    /* everything else is still served */
    json_decref(st_at_call(s.port, "GET", "/healthz", NULL, 200));
    json_decref(st_at_complete(s.port, "other", "meanwhile", 4, true));
    assert_false(atomic_load(&b.done));
    json_decref(st_at_bg_join(&a, 200));
    json_t *o2 = st_at_bg_join(&b, 200);
    assert_string_equal(json_string_value(json_object_get(o2, "found")), "slot");
    json_decref(o2);
    assert_int_equal(st_at_metric(s.port, "strata_busy_wait_timeouts_total"), 0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* DELETE waits for the running completion; a completion sent after the DELETE waits behind it
 * and starts a new conversation: it never sees the versions the DELETE removes. */
static void test_delete_waits_in_line(void **state)
{
    (void)state;
    st_hc_server s;
    static const char *const args[] = {WAIT_LONG, NULL};
    assert_int_equal(start(&s, "delete-store", args), 0);
    json_decref(st_at_complete(s.port, "conv", "kept", 4, true));
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/conv/save", "{}", 201));
    st_at_bg a, d, c;
    st_at_bg_completion(&a, s.port, "conv", " long turn", LONG_N, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_slots_busy", 1), 0);
    st_at_bg_start(&d, s.port, "DELETE", "/v1/sessions/conv", "");
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 1), 0);
    st_at_bg_completion(&c, s.port, "conv", "after", 4, true);
    assert_int_equal(st_at_await_metric(s.port, "strata_busy_waiting_requests", 2), 0);
    assert_false(atomic_load(&a.done));
    json_decref(st_at_bg_join(&a, 200));
    json_t *od = st_at_bg_join(&d, 200), *oc = st_at_bg_join(&c, 200);
    assert_true(json_is_true(json_object_get(od, "live_deleted")));
    assert_int_equal(json_integer_value(json_object_get(od, "versions_deleted")), 1);
    assert_string_equal(json_string_value(json_object_get(oc, "found")), "new");
    json_decref(od);
    json_decref(oc);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* A DELETE of a session that is only in the store, raced by a completion for it: the two are
 * ordered either way, never mixed. Completion first: it loads the saved head ("store") and the
 * DELETE, waiting for it, removes the live conversation too. DELETE first: the completion starts
 * a new conversation ("new"), never a 404. After both, the session is never a live copy of the
 * deleted version with no versions left. Rounds with a few ms between the two. */
static void test_delete_of_stored_session_races_completion(void **state)
{
    (void)state;
    st_hc_server s;
    static const char *const one_slot[] = {"--slots", "1", NULL};
    assert_int_equal(start(&s, "delete-race-store", one_slot), 0);
    int store_first = 0, delete_first = 0;
    for (int round = 0; round < 40; round++) {
        char id[32], path[96];
        snprintf(id, sizeof id, "x%d", round);
        json_decref(st_at_complete(s.port, id, "saved turn", 4, true));
        snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
        json_decref(st_at_call(s.port, "POST", path, "{}", 201));
        /* only in the store now */
        json_decref(st_at_call(s.port, "POST", "/slots/0?action=erase", NULL, 200));
        st_at_bg d, c;
        snprintf(path, sizeof path, "/v1/sessions/%s", id);
        if (round % 2) {
            st_at_bg_start(&d, s.port, "DELETE", path, "");
            usleep((useconds_t)(round % 5) * 300);
            st_at_bg_completion(&c, s.port, id, " next", 2, true);
        } else {
            st_at_bg_completion(&c, s.port, id, " next", 2, true);
            usleep((useconds_t)(round % 5) * 300);
            st_at_bg_start(&d, s.port, "DELETE", path, "");
        }
        json_t *od = st_at_bg_join(&d, 200), *oc = st_at_bg_join(&c, 200);
        const char *found = json_string_value(json_object_get(oc, "found"));
        assert_non_null(found);
        if (!strcmp(found, "store")) {
            store_first++;
            if (!json_is_true(json_object_get(od, "live_deleted")))
                fail_msg("round %d: the completion loaded the saved version, yet the DELETE left "
                         "it live", round);
        } else {
            assert_string_equal(found, "new");
            delete_first++;
        }
        json_decref(od);
        json_decref(oc);
    }
    printf("delete race: completion first %d, delete first %d\n", store_first, delete_first);
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
        cmocka_unit_test(test_delete_of_stored_session_races_completion),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
