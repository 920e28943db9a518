/*
 * test_api_unit.c - in-process checks of api/ (fast; also run under ASan+UBSan): the session-id
 * pattern, the memory guard, and a server started on a thread of this process taking hostile and
 * ordinary requests, then stopped and freed (so the sanitizers see every path of the HTTP layer,
 * including the refusals, the worker hand-off and the shutdown).
 */
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_api.h"
#include "st_api_int.h"
#include "st_http_client.h"
#include "st_test_util.h"

static char dir[4096];

static void test_id_pattern(void **state)
{
    (void)state;
    static const char *good[] = {"a", "A9", "conv-1", "x.y_z-0", "9"};
    static const char *bad[] = {"", ".", "..", "../x", "-a", "_a", ".a", "a/b", "a b", "a:b", "a%2e",
                                "é"};
    for (size_t i = 0; i < sizeof good / sizeof good[0]; i++)
        assert_true(st_api_id_valid(good[i], strlen(good[i])));
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        assert_false(st_api_id_valid(bad[i], strlen(bad[i])));
    assert_false(st_api_id_valid("a\0b", 3));
    char long_id[ST_API_ID_MAX + 2];
    memset(long_id, 'k', sizeof long_id);
    assert_true(st_api_id_valid(long_id, ST_API_ID_MAX));
    assert_false(st_api_id_valid(long_id, ST_API_ID_MAX + 1));
}

static void test_memguard(void **state)
{
    (void)state;
    char mi[4200];
    snprintf(mi, sizeof mi, "%s/meminfo", dir);
    const char *txt = "MemTotal: 16000000 kB\nMemFree: 100 kB\nMemAvailable: 2097152 kB\n";
    assert_int_equal(st_test_spit(mi, txt, strlen(txt)), 0);
    st_memguard g = {1, 256u << 20, mi, NULL};
    uint64_t avail = 0;
    const char *src = NULL;
    assert_int_equal(st_memguard_available(&g, &avail, &src), 0);
    assert_int_equal(avail, UINT64_C(2) << 30);
    assert_string_equal(src, "MemAvailable");
    assert_int_equal(st_memguard_admit(&g, "SAVE", 1u << 30), 0);
    assert_int_equal(st_memguard_admit(&g, "SAVE", UINT64_C(3) << 30), ST_ENOMEMGUARD);
    assert_non_null(strstr(st_errdetail(), "limit 3.25 GiB, available 2.00 GiB (MemAvailable)"));
    g.enabled = 0;
    assert_int_equal(st_memguard_admit(&g, "SAVE", UINT64_C(3) << 40), 0);
    g.enabled = 1;
    snprintf(mi, sizeof mi, "%s/missing", dir);
    assert_int_equal(st_memguard_admit(&g, "RESTORE", 1), ST_ENOMEMGUARD);
    assert_non_null(strstr(st_errdetail(), "cannot read available RAM"));
    /* the real machine: /proc/meminfo or the sysconf fallback */
    st_memguard real = {1, 0, NULL, NULL};
    assert_int_equal(st_memguard_available(&real, &avail, &src), 0);
    assert_true(avail > 0);
}

typedef struct run_arg {
    st_api_server *s;
    int rc;
} run_arg;

static void *run_main(void *p)
{
    run_arg *a = p;
    a->rc = st_api_server_run(a->s);
    return NULL;
}

/* The reply's status, and an error body that begins with body_start. */
static void expect_body(uint16_t port, const char *raw, int status, const char *body_start)
{
    st_hc_resp r;
    assert_int_equal(st_hc_raw(port, raw, strlen(raw), &r), 0);
    if (r.status != status)
        fprintf(stderr, "%.60s: %d, expected %d\n", raw, r.status, status);
    assert_int_equal(r.status, status);
    if (status >= 400)
        assert_non_null(strstr((char *)r.body, body_start));
    st_hc_resp_free(&r);
}

static void expect(uint16_t port, const char *raw, int status)
{
    expect_body(port, raw, status, "{\"error\":{\"code\":");
}

static void test_server_in_process(void **state)
{
    (void)state;
    char store[4200], keyf[4200];
    snprintf(store, sizeof store, "%s/store", dir);
    snprintf(keyf, sizeof keyf, "%s/key", dir);
    assert_int_equal(st_test_spit(keyf, "k3y", 3), 0);
    st_api_config c;
    st_api_config_default(&c);
    c.store_dir = store;
    c.port = 0;
    c.workers = 2;
    c.handle_signals = 0;
    c.head_timeout_ms = 300;
    c.api_key_file = keyf;
    c.max_part_bytes = 64u << 10;
    c.max_completion_body = 64u << 10;
    c.body_budget = 1u << 20;
    st_api_server *s = NULL;
    assert_int_equal(st_api_server_new(&c, &s), 0);
    uint16_t port = st_api_server_port(s);
    assert_true(port > 0);
    run_arg a = {s, -1};
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, run_main, &a), 0);

    const char *A = "Authorization: Bearer k3y\r\n";
    char req[70000];
    expect(port, "GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 200);
    expect(port, "GET /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n", 401);
    /* authenticated: request line, what follows the credentials, the status */
    static const struct {
        const char *line, *rest;
        int status;
    } authed[] = {
        {"GET /v1/sessions", "\r\n", 200},
        {"GET /v1/sessions/%2e%2e", "\r\n", 400},
        {"GET /v1/sessions/a%00", "\r\n", 400},
        {"DELETE /metrics", "\r\n", 405},
        {"GET /x/y/z", "\r\n", 404},
        {"POST /v1/uploads", "Content-Length: 4\r\n\r\n{{{{", 400},
        {"POST /v1/uploads", "Content-Length: 2000000\r\n\r\n", 413},
    };
    for (size_t i = 0; i < sizeof authed / sizeof authed[0]; i++) {
        snprintf(req, sizeof req, "%s HTTP/1.1\r\nHost: x\r\n%s%s", authed[i].line, A, authed[i].rest);
        expect(port, req, authed[i].status);
    }
    int n = snprintf(req, sizeof req, "GET /healthz HTTP/1.1\r\nHost: x\r\nX: ");
    memset(req + n, 'z', 20000);
    snprintf(req + n + 20000, sizeof req - (size_t)n - 20000, "\r\n\r\n");
    expect(port, req, 431);
    expect(port, "GET /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n", 411);
    expect(port, "GET /healthz HTTP/1.1\r", 408); /* the head never ends */
    /* an OpenAI route's refusal on the head is in OpenAI's shape */
    snprintf(req, sizeof req, "POST /v1/completions HTTP/1.1\r\nHost: x\r\n%sContent-Length: 2\r\n\r\n{}", A);
    expect_body(port, req, 501, "{\"error\":{\"message\":\"this ");
    expect_body(port, req, 501, "\"type\":\"server_error\",\"param\":null,\"code\":\"no_engine\"}}");

    /* an upload round trip on workers */
    st_hc_resp r;
    assert_int_equal(st_hc_request(port, "POST", "/v1/uploads", A, "{}", 2, &r), 0);
    assert_int_equal(r.status, 201);
    json_error_t je;
    json_t *o = json_loadb((const char *)r.body, r.body_len, 0, &je);
    char path[128];
    snprintf(path, sizeof path, "/v1/uploads/%s/parts/1", json_string_value(json_object_get(o, "upload")));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(port, "PUT", path, A, "not a session file", 18, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    snprintf(path, sizeof path, "/v1/uploads/%s/commit", json_string_value(json_object_get(o, "upload")));
    assert_int_equal(st_hc_request(port, "POST", path, A, "{\"session\":\"u\"}", 15, &r), 0);
    assert_int_equal(r.status, 422);
    assert_non_null(strstr((char *)r.body, "invalid_file"));
    st_hc_resp_free(&r);
    json_decref(o);

    /* a connection left open and one left mid-body when the server stops */
    int idle = st_hc_connect(port, 5000);
    int mid = st_hc_connect(port, 5000);
    snprintf(req, sizeof req, "POST /v1/uploads HTTP/1.1\r\nHost: x\r\n%sContent-Length: 10\r\n\r\n{", A);
    assert_int_equal(st_hc_send(mid, req, strlen(req)), 0);
    usleep(50000);
    st_api_server_stop(s);
    pthread_join(th, NULL);
    assert_int_equal(a.rc, 0);
    st_api_server_free(s);
    close(idle);
    close(mid);
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_api_unit");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_id_pattern),
        cmocka_unit_test(test_memguard),
        cmocka_unit_test(test_server_in_process),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
