/*
 * test_api_http.c - the real strata-server binary on loopback, without a model: hostile requests
 * (each a JSON error with the right status, the server serving on), limits and timeouts,
 * keep-alive and pipelining, the connection cap, bearer-token auth, uploads in parts and
 * downloads, the memory guard, and 32 concurrent clients saving and fetching their own sessions.
 */
#include <jansson.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include "st_api_test.h"
#include "st_http_client.h"
#include "st_file.h"
#include "st_store.h"
#include "st_test_util.h"

#define SERVER ST_BIN_DIR "/strata-server"

static char dir[4096];
static char store[4200];
static char logpath[4200];
static st_hc_server srv;

/* ---- helpers -------------------------------------------------------------------------------- */

static void healthy(uint16_t port)
{
    st_hc_resp r;
    assert_int_equal(st_hc_request(port, "GET", "/healthz", NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr((char *)r.body, "\"status\":\"ok\""));
    st_hc_resp_free(&r);
}

/* r is a JSON error with this status and code. */
static void is_error(const st_hc_resp *r, int status, const char *code, const char *what)
{
    char ct[128];
    if (r->status != status)
        fprintf(stderr, "%s: status %d, expected %d; body %.300s\n", what, r->status, status,
                r->body ? (char *)r->body : "");
    assert_int_equal(r->status, status);
    assert_non_null(st_hc_header(r, "Content-Type", ct, sizeof ct));
    assert_string_equal(ct, "application/json");
    json_error_t e;
    json_t *o = json_loadb((const char *)r->body, r->body_len, 0, &e);
    assert_non_null(o);
    json_t *err = json_object_get(o, "error");
    assert_true(json_is_object(err));
    assert_true(json_is_string(json_object_get(err, "message")));
    const char *c = json_string_value(json_object_get(err, "code"));
    assert_non_null(c);
    if (code && strcmp(c, code))
        fprintf(stderr, "%s: code %s, expected %s\n", what, c, code);
    if (code)
        assert_string_equal(c, code);
    json_decref(o);
}

static json_t *body_json(const st_hc_resp *r)
{
    json_error_t e;
    json_t *o = json_loadb((const char *)r->body, r->body_len, 0, &e);
    assert_non_null(o);
    return o;
}

static int start(st_hc_server *s, const char *const *extra)
{
    const char *args[40];
    int n = 0;
    args[n++] = "--store";
    args[n++] = store;
    for (const char *const *a = extra; a && *a; a++)
        args[n++] = *a;
    args[n] = NULL;
    return st_hc_server_start(s, SERVER, dir, logpath, args);
}

/* A session file of about `tokens` tokens from seed, written to path; its bytes returned. */
static unsigned char *make_file(const char *path, uint64_t seed, uint64_t tokens, size_t *len)
{
    st_synth_opts o;
    memset(&o, 0, sizeof o);
    o.seed = seed;
    o.n_tokens = tokens;
    o.n_layers = 8;
    o.head_dim = 64;
    st_image *img = NULL;
    assert_int_equal(st_image_synthesize(&o, &img), 0);
    assert_int_equal(st_file_write(img, path, NULL), 0);
    st_image_free(img);
    unsigned char *b = st_test_slurp(path, len);
    assert_non_null(b);
    return b;
}

/* Upload bytes in parts of part_bytes and commit them as session id. Returns the version. */
static long upload(uint16_t port, const char *id, const unsigned char *b, size_t len, size_t part_bytes)
{
    st_hc_resp r;
    if (st_hc_json(port, "POST", "/v1/uploads", "{}", &r) || r.status != 201) {
        st_hc_resp_free(&r);
        return -1;
    }
    json_t *o = body_json(&r);
    char uid[64];
    snprintf(uid, sizeof uid, "%s", json_string_value(json_object_get(o, "upload")));
    json_decref(o);
    st_hc_resp_free(&r);
    char path[256];
    int part = 1;
    for (size_t off = 0; off < len; off += part_bytes, part++) {
        size_t n = len - off < part_bytes ? len - off : part_bytes;
        snprintf(path, sizeof path, "/v1/uploads/%s/parts/%d", uid, part);
        if (st_hc_request(port, "PUT", path, NULL, b + off, n, &r) || r.status != 200) {
            st_hc_resp_free(&r);
            return -1;
        }
        st_hc_resp_free(&r);
    }
    char body[256];
    snprintf(path, sizeof path, "/v1/uploads/%s/commit", uid);
    snprintf(body, sizeof body, "{\"session\":\"%s\"}", id);
    if (st_hc_json(port, "POST", path, body, &r) || r.status != 201) {
        st_hc_resp_free(&r);
        return -1;
    }
    o = body_json(&r);
    long v = (long)json_integer_value(json_object_get(o, "version"));
    json_decref(o);
    st_hc_resp_free(&r);
    return v;
}

/* ---- fixtures ------------------------------------------------------------------------------- */

static int group_setup(void **state)
{
    (void)state;
    st_test_tmpdir(dir, sizeof dir, "test_api_http");
    snprintf(store, sizeof store, "%s/store", dir);
    snprintf(logpath, sizeof logpath, "%s/server.log", dir);
    static const char *const args[] = {"--head-timeout-ms", "500", "--read-timeout-ms", "500",
                                       "--idle-timeout-ms", "800", "--max-part-mib", "1",
                                       "--workers", "8", NULL};
    return start(&srv, args);
}

static int group_teardown(void **state)
{
    (void)state;
    int rc = st_hc_server_stop(&srv, SIGTERM);
    st_hc_server_kill_all(); /* servers a failed test left running */
    if (rc != 0) {
        fprintf(stderr, "strata-server exited with %d; log:\n", rc);
        char cmd[4300];
        snprintf(cmd, sizeof cmd, "tail -20 '%s' >&2", logpath);
        if (system(cmd)) {
        }
        return -1;
    }
    if (!getenv("ST_TEST_KEEP")) /* keep the servers' logs and stores to look at */
        st_test_rmdir(dir);
    return 0;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_healthz_and_metrics(void **state)
{
    (void)state;
    healthy(srv.port);
    st_hc_resp r;
    assert_int_equal(st_hc_request(srv.port, "GET", "/metrics", NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr((char *)r.body, "strata_http_requests_total{route=\"/healthz\",code=\"2xx\"}"));
    assert_non_null(strstr((char *)r.body, "strata_http_request_duration_seconds_bucket{route=\"/healthz\""));
    assert_non_null(strstr((char *)r.body, "strata_park_pool_bytes"));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "GET", "/v1/sessions", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr((char *)r.body, "\"sessions\""));
    st_hc_resp_free(&r);
}

static const struct {
    const char *what;
    const char *raw;
    int status;
    const char *code;
} hostile[] = {
    {"unknown route", "GET /v2/nothing HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"},
    {"root: the page is GET only", "DELETE / HTTP/1.1\r\nHost: x\r\n\r\n", 405,
     "method_not_allowed"},
    {"trailing slash", "GET /v1/sessions/ HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"},
    {"wrong method", "DELETE /healthz HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"},
    {"wrong method on sessions", "PUT /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\n\r\n",
     405, "method_not_allowed"},
    {"unknown method", "BREW /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\n", 405, "method_not_allowed"},
    {"../x raw", "GET /v1/sessions/../x HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_path"},
    {"%2e%2e", "GET /v1/sessions/%2e%2e HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_path"},
    {"%2E%2E/versions", "GET /v1/sessions/%2E%2E/versions HTTP/1.1\r\nHost: x\r\n\r\n", 400,
     "invalid_path"},
    {"..%2Fx", "GET /v1/sessions/..%2Fx HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_id"},
    {"%00", "GET /v1/sessions/%00 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_path"},
    {"a%00b", "GET /v1/sessions/a%00b/versions HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_path"},
    {"bad escape", "GET /v1/sessions/%zz HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_path"},
    {"leading dash", "GET /v1/sessions/-x HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_id"},
    {"space in id", "GET /v1/sessions/a%20b HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_id"},
    {"garbage", "GARBAGE\r\n\r\n", 400, "bad_request"},
    {"HTTP/2.0", "GET /healthz HTTP/2.0\r\nHost: x\r\n\r\n", 505, "http_version"},
    {"HTTP/1.x", "GET /healthz HTTP/1.x\r\nHost: x\r\n\r\n", 400, "bad_request"},
    {"HTTP/1.1x", "GET /healthz HTTP/1.1x\r\nHost: x\r\n\r\n", 400, "bad_request"},
    {"HTTP/1.10", "GET /healthz HTTP/1.10\r\nHost: x\r\n\r\n", 400, "bad_request"},
    {"two Host headers", "GET /healthz HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n", 400, "bad_request"},
    {"two Host headers, one empty", "GET /healthz HTTP/1.1\r\nHost:\r\nhost: x\r\n\r\n", 400,
     "bad_request"},
    {"no Host", "GET /healthz HTTP/1.1\r\n\r\n", 400, "bad_request"},
    {"absolute target", "GET http://x/healthz HTTP/1.1\r\nHost: x\r\n\r\n", 400, "bad_request"},
    {"chunked body", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
     411, "length_required"},
    {"conflicting Content-Length",
     "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}", 400,
     "bad_request"},
    {"negative Content-Length", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
     400, "bad_request"},
    {"enormous Content-Length",
     "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999999999999\r\n\r\n", 413,
     "body_too_large"},
    {"folded header", "GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: 1\r\n  folded\r\n\r\n", 400, "bad_request"},
    {"control byte in header", "GET /healthz HTTP/1.1\r\nHost: x\r\nX-A: a\x01z\r\n\r\n", 400,
     "bad_request"},
    {"body on a GET route", "GET /v1/sessions HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\nhello",
     413, "body_too_large"},
    {"malformed JSON", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n\r\n{nope",
     400, "invalid_json"},
    {"JSON not an object", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n[1]", 400,
     "invalid_json"},
    {"unknown JSON field", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 7\r\n\r\n{\"x\":1}",
     400, "unknown_field"},
    {"duplicate JSON keys",
     "POST /v1/uploads/x/commit HTTP/1.1\r\nHost: x\r\nContent-Length: 27\r\n\r\n{\"session\":\"a\",\"session\":1}",
     400, "invalid_json"},
    {"Expect other", "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nExpect: magic\r\nContent-Length: 2\r\n\r\n",
     417, "expectation_failed"},
    {"bad version", "GET /v1/sessions/a/versions/abc HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_version"},
    {"version 0", "GET /v1/sessions/a/versions/0 HTTP/1.1\r\nHost: x\r\n\r\n", 400, "invalid_version"},
    {"bad format", "GET /v1/sessions/a/versions/1/file?format=v9 HTTP/1.1\r\nHost: x\r\n\r\n", 400,
     "invalid_param"},
    {"missing session", "GET /v1/sessions/nobody HTTP/1.1\r\nHost: x\r\n\r\n", 404, "not_found"},
    {"missing upload", "PUT /v1/uploads/abc/parts/1 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx",
     404, "not_found"},
    {"part 0", "PUT /v1/uploads/abc/parts/0 HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nx", 400,
     "invalid_param"},
    {"no engine", "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}", 501,
     "no_engine"},
    {"no engine: slots", "POST /slots/0?action=erase HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}",
     501, "no_engine"},
};

static void test_hostile_requests(void **state)
{
    (void)state;
    for (size_t i = 0; i < sizeof hostile / sizeof hostile[0]; i++) {
        st_hc_resp r;
        assert_int_equal(st_hc_raw(srv.port, hostile[i].raw, strlen(hostile[i].raw), &r), 0);
        is_error(&r, hostile[i].status, hostile[i].code, hostile[i].what);
        st_hc_resp_free(&r);
        healthy(srv.port);
    }
}

/* Bytes that are not UTF-8 in the request line: the error still says what was wrong, with
 * those bytes escaped (not "error text not encodable"). */
static void test_non_utf8_request_line(void **state)
{
    (void)state;
    static const struct {
        const char *raw, *says;
    } cases[] = {
        {"GET /healthz HTTP/1.\xff\r\nHost: x\r\n\r\n", "malformed HTTP version \"HTTP/1.\\xff\""},
        {"GET /healthz HTTP/\xc3\xa9.1\r\nHost: x\r\n\r\n", "malformed HTTP version \"HTTP/\xc3\xa9.1\""},
        {"GET /healthz HTTP/1.1\xc0\xaf\r\nHost: x\r\n\r\n",
         "malformed HTTP version \"HTTP/1.1\\xc0\\xaf\""}, /* an overlong '/' */
        {"G\xe2\x82T /healthz HTTP/1.1\r\nHost: x\r\n\r\n", "malformed method \"G\\xe2\\x82T\""},
        {"\xed\xa0\x80 /healthz HTTP/1.1\r\nHost: x\r\n\r\n", /* a surrogate */
         "malformed method \"\\xed\\xa0\\x80\""},
        {"\xf0\x9f\x98\x80 /healthz HTTP/1.1\r\nHost: x\r\n\r\n", /* U+1F600: kept */
         "malformed method \"\xf0\x9f\x98\x80\""},
        {"\xf4\x90\x80\x80 /healthz HTTP/1.1\r\nHost: x\r\n\r\n", /* past U+10FFFF */
         "malformed method \"\\xf4\\x90\\x80\\x80\""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        st_hc_resp r;
        assert_int_equal(st_hc_raw(srv.port, cases[i].raw, strlen(cases[i].raw), &r), 0);
        is_error(&r, 400, "bad_request", cases[i].raw);
        json_t *o = body_json(&r);
        const char *m = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
        if (!m || strncmp(m, cases[i].says, strlen(cases[i].says)))
            fprintf(stderr, "message %s, expected it to begin %s\n", m ? m : "(none)", cases[i].says);
        assert_non_null(m);
        assert_int_equal(strncmp(m, cases[i].says, strlen(cases[i].says)), 0);
        json_decref(o);
        st_hc_resp_free(&r);
    }
    healthy(srv.port);
}

static void test_bad_ids_and_sizes(void **state)
{
    (void)state;
    st_hc_resp r;
    /* 300 characters */
    char path[512] = "/v1/sessions/";
    memset(path + strlen(path), 'a', 300);
    path[13 + 300] = '\0';
    assert_int_equal(st_hc_request(srv.port, "GET", path, NULL, NULL, 0, &r), 0);
    is_error(&r, 400, "invalid_id", "300-character id");
    st_hc_resp_free(&r);
    /* 121 characters: one over the limit; 120 is a valid id (404: no such session) */
    memset(path, 0, sizeof path);
    strcpy(path, "/v1/sessions/");
    memset(path + 13, 'b', 121);
    assert_int_equal(st_hc_request(srv.port, "GET", path, NULL, NULL, 0, &r), 0);
    is_error(&r, 400, "invalid_id", "121-character id");
    st_hc_resp_free(&r);
    path[13 + 120] = '\0';
    assert_int_equal(st_hc_request(srv.port, "GET", path, NULL, NULL, 0, &r), 0);
    is_error(&r, 404, "not_found", "120-character id");
    st_hc_resp_free(&r);

    /* a NUL byte in the head itself */
    static const char nul[] = "GET /healthz\0x HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(st_hc_raw(srv.port, nul, sizeof nul - 1, &r), 0);
    is_error(&r, 400, "bad_request", "NUL in the head");
    st_hc_resp_free(&r);

    /* headers over 16 KiB: 431 */
    size_t big = 20000;
    char *req = malloc(big + 200);
    int n = sprintf(req, "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Big: ");
    memset(req + n, 'a', big);
    n += (int)big;
    n += sprintf(req + n, "\r\n\r\n");
    assert_int_equal(st_hc_raw(srv.port, req, (size_t)n, &r), 0);
    is_error(&r, 431, "headers_too_large", "20 KB header");
    st_hc_resp_free(&r);
    /* 100 header lines (limit 64): 431 */
    n = sprintf(req, "GET /healthz HTTP/1.1\r\nHost: x\r\n");
    for (int i = 0; i < 100; i++)
        n += sprintf(req + n, "X-H%d: %d\r\n", i, i);
    n += sprintf(req + n, "\r\n");
    assert_int_equal(st_hc_raw(srv.port, req, (size_t)n, &r), 0);
    is_error(&r, 431, "headers_too_large", "100 headers");
    st_hc_resp_free(&r);

    /* a body over the route's limit (64 KiB of JSON), sent in full */
    size_t blen = 200000;
    char *body = malloc(blen);
    memset(body, ' ', blen);
    assert_int_equal(st_hc_request(srv.port, "POST", "/v1/uploads", NULL, body, blen, &r), 0);
    is_error(&r, 413, "body_too_large", "200 KB JSON body");
    st_hc_resp_free(&r);
    /* with Expect: 100-continue the refusal comes before any body byte is sent */
    int fd = st_hc_connect(srv.port, 10000);
    assert_true(fd >= 0);
    const char *h = "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    "Content-Length: 10000000\r\n\r\n";
    assert_int_equal(st_hc_send(fd, h, strlen(h)), 0);
    char first[13] = {0};
    assert_int_equal(recv(fd, first, 12, MSG_WAITALL), 12);
    assert_string_equal(first, "HTTP/1.1 413");
    close(fd);
    /* an upload part over --max-part-mib 1 */
    assert_int_equal(st_hc_json(srv.port, "POST", "/v1/uploads", "{}", &r), 0);
    assert_int_equal(r.status, 201);
    json_t *o = body_json(&r);
    st_hc_resp_free(&r);
    char p2[128];
    snprintf(p2, sizeof p2, "/v1/uploads/%s/parts/1", json_string_value(json_object_get(o, "upload")));
    char *part = calloc(1, (1u << 20) + 1);
    assert_int_equal(st_hc_request(srv.port, "PUT", p2, NULL, part, (1u << 20) + 1, &r), 0);
    is_error(&r, 413, "body_too_large", "part over 1 MiB");
    st_hc_resp_free(&r);
    snprintf(p2, sizeof p2, "/v1/uploads/%s", json_string_value(json_object_get(o, "upload")));
    assert_int_equal(st_hc_request(srv.port, "DELETE", p2, NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    json_decref(o);
    free(part);
    free(body);
    free(req);
    healthy(srv.port);
}

/* Send the start of a request and stop: the server answers 408 request_timeout. */
static void stalled_request(const char *start, const char *what)
{
    st_hc_resp r;
    int fd = st_hc_connect(srv.port, 10000);
    assert_true(fd >= 0);
    assert_int_equal(st_hc_send(fd, start, strlen(start)), 0);
    assert_int_equal(st_hc_read(fd, &r), 0);
    is_error(&r, 408, "request_timeout", what);
    st_hc_resp_free(&r);
    close(fd);
}

static void test_timeouts(void **state)
{
    (void)state;
    /* a head that never ends: 408 after --head-timeout-ms */
    stalled_request("GET /healthz HTTP/1.1\r\nHo", "head timeout");
    /* a body that stalls: 408 after --read-timeout-ms */
    stalled_request("POST /v1/uploads HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{",
                    "body stall");
    /* an idle keep-alive connection is closed quietly */
    int fd = st_hc_connect(srv.port, 10000);
    char ch;
    assert_int_equal(recv(fd, &ch, 1, 0), 0);
    close(fd);
    healthy(srv.port);
}

static void test_keepalive_and_pipelining(void **state)
{
    (void)state;
    st_hc_resp r;
    int fd = st_hc_connect(srv.port, 10000);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0), 0);
        assert_int_equal(st_hc_read(fd, &r), 0);
        assert_int_equal(r.status, 200);
        st_hc_resp_free(&r);
    }
    /* two requests in one write: two replies, in order */
    const char *two = "GET /v1/sessions HTTP/1.1\r\nHost: x\r\n\r\nGET /nope HTTP/1.1\r\nHost: x\r\n\r\n";
    assert_int_equal(st_hc_send(fd, two, strlen(two)), 0);
    assert_int_equal(st_hc_read(fd, &r), 0);
    assert_int_equal(r.status, 200);
    assert_non_null(strstr((char *)r.body, "sessions"));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_read(fd, &r), 0);
    is_error(&r, 404, "not_found", "pipelined second");
    st_hc_resp_free(&r);
    /* Connection: close is honoured */
    assert_int_equal(st_hc_send_req(fd, "GET", "/healthz", "Connection: close\r\n", NULL, 0), 0);
    assert_int_equal(st_hc_read(fd, &r), 0);
    char v[32];
    assert_non_null(st_hc_header(&r, "Connection", v, sizeof v));
    assert_string_equal(v, "close");
    st_hc_resp_free(&r);
    char ch;
    assert_int_equal(recv(fd, &ch, 1, 0), 0);
    close(fd);
    /* HTTP/1.0 closes by default */
    static const char h10[] = "GET /healthz HTTP/1.0\r\n\r\n";
    assert_int_equal(st_hc_raw(srv.port, h10, sizeof h10 - 1, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
}

/* A request head with Expect: 100-continue and a body that never comes: once the 100 is read,
 * the server holds the connection in its body state (a request in progress). */
static int body_in_progress(uint16_t port, const char *from)
{
    int fd = st_hc_connect_from(port, from, 10000);
    assert_true(fd >= 0);
    const char *h = "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                    "Content-Length: 10\r\n\r\n";
    assert_int_equal(st_hc_send(fd, h, strlen(h)), 0);
    char got[26] = {0};
    assert_int_equal(recv(fd, got, 25, MSG_WAITALL), 25);
    assert_string_equal(got, "HTTP/1.1 100 Continue\r\n\r\n");
    return fd;
}

/* A kept-alive connection from `from` that has had one /healthz answered: idle now. */
static int idle_after_request(uint16_t port, const char *from)
{
    int fd = st_hc_connect_from(port, from, 10000);
    assert_true(fd >= 0);
    assert_int_equal(st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0), 0);
    st_hc_resp r;
    assert_int_equal(st_hc_read(fd, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    return fd;
}

/* fd is still served (a /healthz on it answers 200). */
static void still_served(int fd)
{
    st_hc_resp r;
    assert_int_equal(st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0), 0);
    assert_int_equal(st_hc_read(fd, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
}

/* The server closed fd (EOF before any byte). */
static void was_closed(int fd)
{
    char ch;
    assert_int_equal(recv(fd, &ch, 1, 0), 0);
}

static void test_connection_cap(void **state)
{
    (void)state;
    st_hc_server s2;
    static const char *const args[] = {"--max-connections", "3", NULL};
    assert_int_equal(start(&s2, args), 0);
    /* at the cap a new connection sheds the oldest idle one */
    int held[3];
    for (int i = 0; i < 3; i++)
        held[i] = idle_after_request(s2.port, NULL);
    int fd = idle_after_request(s2.port, NULL);
    was_closed(held[0]);
    still_served(held[1]);
    still_served(held[2]);
    /* a connection with a request in progress is never shed: with every one busy, a new
     * connection waits in the backlog until one closes */
    close(held[0]);
    close(held[1]);
    close(held[2]);
    close(fd);
    int busy[3];
    for (int i = 0; i < 3; i++)
        busy[i] = body_in_progress(s2.port, NULL);
    fd = st_hc_connect(s2.port, 10000);
    assert_true(fd >= 0);
    assert_int_equal(st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0), 0);
    struct pollfd pf = {fd, POLLIN, 0};
    assert_int_equal(poll(&pf, 1, 300), 0);
    close(busy[0]);
    st_hc_resp r;
    assert_int_equal(st_hc_read(fd, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    close(fd);
    close(busy[1]);
    close(busy[2]);
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
}

/* --max-connections-per-peer: a client address beyond it sheds its own oldest idle connection,
 * or, when all of its connections are busy, is refused; other addresses are not touched. */
static void test_connections_per_peer(void **state)
{
    (void)state;
    st_hc_server s2;
    static const char *const args[] = {"--max-connections", "16", "--max-connections-per-peer", "2",
                                       NULL};
    assert_int_equal(start(&s2, args), 0);
    int a0 = idle_after_request(s2.port, "127.0.0.2");
    int other = idle_after_request(s2.port, "127.0.0.3");
    int a1 = idle_after_request(s2.port, "127.0.0.2");
    int a2 = idle_after_request(s2.port, "127.0.0.2"); /* sheds a0, the oldest of 127.0.0.2 */
    was_closed(a0);
    still_served(a1);
    still_served(a2);
    still_served(other);
    close(a0);
    close(a1);
    close(a2);
    /* both connections of 127.0.0.2 busy: a third is refused with 503 */
    int b0 = body_in_progress(s2.port, "127.0.0.2");
    int b1 = body_in_progress(s2.port, "127.0.0.2");
    int fd = st_hc_connect_from(s2.port, "127.0.0.2", 10000);
    assert_true(fd >= 0);
    st_hc_resp r;
    assert_int_equal(st_hc_read(fd, &r), 0);
    is_error(&r, 503, "too_many_connections", "third busy connection of one address");
    char v[16];
    assert_non_null(st_hc_header(&r, "Retry-After", v, sizeof v));
    st_hc_resp_free(&r);
    close(fd);
    still_served(other);
    healthy(s2.port); /* from 127.0.0.1 */
    assert_true(st_at_metric(s2.port, "strata_http_connections_refused_total") == 1);
    assert_true(st_at_metric(s2.port, "strata_http_connections_shed_total") >= 1);
    close(b0);
    close(b1);
    close(other);
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
}

/* Poll /metrics until strata_http_body_bytes reaches at least want (20 s at most). */
static void await_body_bytes(uint16_t port, double want)
{
    double v = -1;
    for (int i = 0; i < 2000 && (v = st_at_metric(port, "strata_http_body_bytes")) < want; i++)
        usleep(10000);
    if (v < want)
        fprintf(stderr, "strata_http_body_bytes is %.0f, waited for %.0f\n", v, want);
    assert_true(v >= want);
}

/* Body bytes are charged as they arrive: a declared Content-Length holds nothing, upload parts
 * together stop at --body-budget-mib minus --max-completion-kib (a part that would pass it while
 * arriving gets 503), and what is left stays for the other requests' bodies. */
static void test_body_budget(void **state)
{
    (void)state;
    st_hc_server s2;
    /* 6 MiB of bodies, of which upload parts 2 MiB; parts of 1 MiB */
    static const char *const args[] = {"--body-budget-mib", "6", "--max-part-mib", "1", NULL};
    assert_int_equal(start(&s2, args), 0);
    const size_t part = 1u << 20, first = 768u << 10;
    char *bytes = malloc(part);
    memset(bytes, 'p', part);
    int fd[3];
    for (int i = 0; i < 3; i++) {
        json_t *o = st_at_call(s2.port, "POST", "/v1/uploads", "{}", 201);
        char head[256];
        int n = snprintf(head, sizeof head,
                         "PUT /v1/uploads/%s/parts/1 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         "Content-Length: %zu\r\n\r\n",
                         json_string_value(json_object_get(o, "upload")), part);
        json_decref(o);
        fd[i] = st_hc_connect(s2.port, 10000);
        assert_true(fd[i] >= 0);
        assert_int_equal(st_hc_send(fd[i], head, (size_t)n), 0);
        char got[26] = {0}; /* admitted: 3 MiB declared, nothing held */
        assert_int_equal(recv(fd[i], got, 25, MSG_WAITALL), 25);
        assert_string_equal(got, "HTTP/1.1 100 Continue\r\n\r\n");
    }
    /* 768 KiB of the first two parts: 1.5 MiB held */
    assert_int_equal(st_hc_send(fd[0], bytes, first), 0);
    await_body_bytes(s2.port, (double)first);
    assert_int_equal(st_hc_send(fd[1], bytes, first), 0);
    await_body_bytes(s2.port, 2.0 * first);
    /* the third would take the parts past 2 MiB as it arrives: 503 */
    st_hc_resp r;
    assert_int_equal(st_hc_send(fd[2], bytes, first), 0);
    assert_int_equal(st_hc_read(fd[2], &r), 0);
    is_error(&r, 503, "busy", "a part past the parts' budget");
    assert_non_null(strstr((char *)r.body, "upload parts"));
    st_hc_resp_free(&r);
    close(fd[2]);
    /* other bodies still fit beside the parts */
    json_decref(st_at_call(s2.port, "POST", "/v1/uploads", "{}", 201));
    /* and the first two parts finish */
    for (int i = 0; i < 2; i++) {
        assert_int_equal(st_hc_send(fd[i], bytes + first, part - first), 0);
        assert_int_equal(st_hc_read(fd[i], &r), 0);
        assert_int_equal(r.status, 200);
        st_hc_resp_free(&r);
        close(fd[i]);
    }
    free(bytes);
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
}

static void test_auth(void **state)
{
    (void)state;
    char keyf[4300];
    snprintf(keyf, sizeof keyf, "%s/key", dir);
    assert_int_equal(st_test_spit(keyf, "s3cret-token-42\n", 16), 0);
    st_hc_server s2;
    const char *const args[] = {"--api-key-file", keyf, NULL};
    assert_int_equal(start(&s2, args), 0);
    st_hc_resp r;
    char v[64];
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions", NULL, NULL, 0, &r), 0);
    is_error(&r, 401, "unauthorized", "no token");
    assert_non_null(st_hc_header(&r, "WWW-Authenticate", v, sizeof v));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions", "Authorization: Bearer s3cret-token-43\r\n",
                                   NULL, 0, &r), 0);
    is_error(&r, 401, "unauthorized", "wrong token");
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions", "Authorization: Bearer s3cret-token-4\r\n",
                                   NULL, 0, &r), 0);
    is_error(&r, 401, "unauthorized", "prefix of the token");
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(s2.port, "GET", "/nothing/here", NULL, NULL, 0, &r), 0);
    is_error(&r, 401, "unauthorized", "unknown route without a token");
    st_hc_resp_free(&r);
    /* refused before the body is used: a 50 MB Content-Length gets 401, not 413, at once */
    int fd = st_hc_connect(s2.port, 10000);
    const char *h = "POST /v1/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer nope\r\n"
                    "Content-Length: 50000000\r\n\r\n";
    assert_int_equal(st_hc_send(fd, h, strlen(h)), 0);
    assert_int_equal(st_hc_read(fd, &r), 0);
    is_error(&r, 401, "unauthorized", "token checked before the body");
    st_hc_resp_free(&r);
    close(fd);
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions", "Authorization: Bearer s3cret-token-42\r\n",
                                   NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    healthy(s2.port); /* /healthz needs no token */
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
}

static void test_upload_download(void **state)
{
    (void)state;
    char fpath[4300];
    snprintf(fpath, sizeof fpath, "%s/up.stsf", dir);
    size_t len = 0;
    unsigned char *b = make_file(fpath, 7, 3000, &len);
    assert_true(len > (2u << 20)); /* three parts of 1 MiB at least */
    st_hc_resp r;
    assert_int_equal(st_hc_json(srv.port, "POST", "/v1/uploads", "{}", &r), 0);
    assert_int_equal(r.status, 201);
    json_t *o = body_json(&r);
    char uid[64], path[256];
    snprintf(uid, sizeof uid, "%s", json_string_value(json_object_get(o, "upload")));
    json_decref(o);
    st_hc_resp_free(&r);
    size_t part = 1u << 20;
    /* part 2 before part 1: refused */
    snprintf(path, sizeof path, "/v1/uploads/%s/parts/2", uid);
    assert_int_equal(st_hc_request(srv.port, "PUT", path, NULL, b, part, &r), 0);
    is_error(&r, 409, "part_order", "part out of order");
    st_hc_resp_free(&r);
    int pn = 1;
    for (size_t off = 0; off < len; off += part, pn++) {
        size_t n = len - off < part ? len - off : part;
        snprintf(path, sizeof path, "/v1/uploads/%s/parts/%d", uid, pn);
        assert_int_equal(st_hc_request(srv.port, "PUT", path, NULL, b + off, n, &r), 0);
        assert_int_equal(r.status, 200);
        st_hc_resp_free(&r);
        if (pn == 2) { /* a retry of the last part replaces it */
            assert_int_equal(st_hc_request(srv.port, "PUT", path, NULL, b + off, n, &r), 0);
            assert_int_equal(r.status, 200);
            o = body_json(&r);
            assert_int_equal(json_integer_value(json_object_get(o, "size")), (json_int_t)(off + n));
            json_decref(o);
            st_hc_resp_free(&r);
        }
    }
    /* commit with a bad id, then the real one */
    snprintf(path, sizeof path, "/v1/uploads/%s/commit", uid);
    assert_int_equal(st_hc_json(srv.port, "POST", path, "{\"session\":\"../x\"}", &r), 0);
    is_error(&r, 400, "invalid_id", "commit to ../x");
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "POST", path, "{\"session\":\"up-1\"}", &r), 0);
    assert_int_equal(r.status, 201);
    o = body_json(&r);
    assert_int_equal(json_integer_value(json_object_get(o, "version")), 1);
    assert_int_equal(json_integer_value(json_object_get(o, "bytes")), (json_int_t)len);
    json_decref(o);
    st_hc_resp_free(&r);
    /* the upload is gone after its commit */
    assert_int_equal(st_hc_json(srv.port, "POST", path, "{\"session\":\"up-1\"}", &r), 0);
    is_error(&r, 404, "not_found", "commit twice");
    st_hc_resp_free(&r);

    /* the download is the uploaded file, byte for byte */
    assert_int_equal(st_hc_request(srv.port, "GET", "/v1/sessions/up-1/versions/1/file", NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, len);
    assert_memory_equal(r.body, b, len);
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(srv.port, "GET", "/v1/sessions/up-1/versions/latest/file?format=v2",
                                   NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    st_image *img = NULL;
    assert_int_equal(st_file_read_mem(r.body, r.body_len, NULL, &img), 0);
    assert_int_equal(st_image_n_tokens(img), 3000);
    st_image_free(img);
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_request(srv.port, "GET", "/v1/sessions/up-1/versions/2/file", NULL, NULL, 0, &r), 0);
    is_error(&r, 404, "not_found", "missing version");
    st_hc_resp_free(&r);

    /* a corrupt file never becomes a version */
    unsigned char *bad = malloc(len);
    memcpy(bad, b, len);
    bad[len / 2] ^= 0x40;
    assert_int_equal(upload(srv.port, "up-1", bad, len, part), -1);
    assert_int_equal(st_hc_json(srv.port, "GET", "/v1/sessions/up-1/versions", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    o = body_json(&r);
    assert_int_equal(json_array_size(json_object_get(o, "versions")), 1);
    json_decref(o);
    st_hc_resp_free(&r);
    /* a second good version, then deletes */
    assert_int_equal(upload(srv.port, "up-1", b, len, part), 2);
    assert_int_equal(st_hc_json(srv.port, "GET", "/v1/sessions/up-1", NULL, &r), 0);
    o = body_json(&r);
    assert_int_equal(json_integer_value(json_object_get(o, "head")), 2);
    json_decref(o);
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "DELETE", "/v1/sessions/up-1/versions/1", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "DELETE", "/v1/sessions/up-1", NULL, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "GET", "/v1/sessions/up-1", NULL, &r), 0);
    is_error(&r, 404, "not_found", "deleted session");
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_json(srv.port, "DELETE", "/v1/sessions/up-1", NULL, &r), 0);
    is_error(&r, 404, "not_found", "deleted twice");
    st_hc_resp_free(&r);
    free(bad);
    free(b);
}

static void test_memory_guard(void **state)
{
    (void)state;
    char fpath[4300], mi[4300];
    snprintf(fpath, sizeof fpath, "%s/mg.stsf", dir);
    size_t len = 0;
    unsigned char *b = make_file(fpath, 9, 500, &len);
    assert_int_equal(upload(srv.port, "mg", b, len, 1u << 20), 1);
    /* a second server on the same store that reads 1 MiB available */
    snprintf(mi, sizeof mi, "%s/meminfo", dir);
    const char *fake = "MemTotal: 8000000 kB\nMemAvailable:    1024 kB\n";
    assert_int_equal(st_test_spit(mi, fake, strlen(fake)), 0);
    st_hc_server s2;
    const char *const args[] = {"--meminfo", mi, "--mem-reserve-mib", "1", NULL};
    assert_int_equal(start(&s2, args), 0);
    st_hc_resp r;
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions/mg/versions/1/file", NULL, NULL, 0, &r), 0);
    is_error(&r, 503, "memory_guard", "guard refuses");
    assert_non_null(strstr((char *)r.body, "available 0.00 GiB (MemAvailable)"));
    assert_non_null(strstr((char *)r.body, "limit "));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
    /* RAM that cannot be read is said plainly */
    snprintf(mi, sizeof mi, "%s/no-such-meminfo", dir);
    const char *const args2[] = {"--meminfo", mi, NULL};
    assert_int_equal(start(&s2, args2), 0);
    assert_int_equal(st_hc_request(s2.port, "GET", "/v1/sessions/mg/versions/1/file", NULL, NULL, 0, &r), 0);
    is_error(&r, 503, "memory_guard", "unreadable RAM");
    assert_non_null(strstr((char *)r.body, "cannot read available RAM"));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_server_stop(&s2, SIGTERM), 0);
    /* and with enough RAM it passes */
    assert_int_equal(st_hc_request(srv.port, "GET", "/v1/sessions/mg/versions/1/file", NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    assert_int_equal(r.body_len, len);
    st_hc_resp_free(&r);
    free(b);
}

/* ---- 32 concurrent clients ------------------------------------------------------------------ */

#define CLIENTS 32
#define ROUNDS 3

static void *client_main(void *arg)
{
    st_at_client *c = arg;
    char fpath[4300], id[32], path[128];
    snprintf(fpath, sizeof fpath, "%s/c%d.stsf", dir, c->i);
    snprintf(id, sizeof id, "cc-%d", c->i);
    st_synth_opts o;
    memset(&o, 0, sizeof o);
    o.seed = 1000u + (uint64_t)c->i;
    o.n_tokens = 200 + 10 * (uint64_t)c->i;
    st_image *img = NULL;
    size_t len = 0;
    unsigned char *b = NULL;
    if (st_image_synthesize(&o, &img) || st_file_write(img, fpath, NULL) ||
        !(b = st_test_slurp(fpath, &len))) {
        c->failures++;
        snprintf(c->why, sizeof c->why, "cannot make the file");
        st_image_free(img);
        return NULL;
    }
    st_image_free(img);
    for (int round = 1; round <= ROUNDS; round++) {
        long v = upload(srv.port, id, b, len, 1u << 20);
        if (v != round) {
            c->failures++;
            snprintf(c->why, sizeof c->why, "round %d: upload gave version %ld", round, v);
            break;
        }
        st_hc_resp r;
        snprintf(path, sizeof path, "/v1/sessions/%s/versions/latest/file", id);
        if (st_hc_request(srv.port, "GET", path, NULL, NULL, 0, &r) || r.status != 200 ||
            r.body_len != len || memcmp(r.body, b, len)) {
            c->failures++;
            snprintf(c->why, sizeof c->why, "round %d: download differs (status %d, %zu bytes)", round,
                     r.status, r.body_len);
            st_hc_resp_free(&r);
            break;
        }
        st_hc_resp_free(&r);
    }
    free(b);
    return NULL;
}

static void test_concurrent_clients(void **state)
{
    (void)state;
    st_at_client cl[CLIENTS];
    st_at_poller pol;
    int failures = st_at_run_clients(srv.port, CLIENTS, client_main, cl, &pol);
    assert_int_equal(failures, 0);
    assert_int_equal(pol.failed, 0);
    assert_true(pol.ok > 0);
    /* every session has its versions, nothing else appeared */
    st_hc_resp r;
    assert_int_equal(st_hc_json(srv.port, "GET", "/v1/sessions", NULL, &r), 0);
    json_t *o = body_json(&r);
    size_t i;
    json_t *s;
    int seen = 0;
    json_array_foreach(json_object_get(o, "sessions"), i, s) {
        const char *id = json_string_value(json_object_get(s, "id"));
        if (!strncmp(id, "cc-", 3)) {
            seen++;
            assert_int_equal(json_integer_value(json_object_get(s, "head")), ROUNDS);
        }
    }
    assert_int_equal(seen, CLIENTS);
    json_decref(o);
    st_hc_resp_free(&r);
    healthy(srv.port);
}

/* ---- the command line ------------------------------------------------------------------------ */

/* --help names every flag with its default; a bad value is a clear error and exit status 2. */
/* GET path (a listing) must be 400 invalid_param naming param. */
static void bad_param(uint16_t port, const char *path, const char *param)
{
    st_hc_resp r;
    assert_int_equal(st_hc_request(port, "GET", path, NULL, NULL, 0, &r), 0);
    is_error(&r, 400, "invalid_param", path);
    json_t *o = body_json(&r);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    if (!strstr(msg, param))
        fprintf(stderr, "%s: message does not name %s: %s\n", path, param, msg);
    assert_non_null(strstr(msg, param));
    json_decref(o);
    st_hc_resp_free(&r);
}

/* An id for a query string: + and = percent-encoded (the rest of the id alphabet is safe). */
enum { ST_PCT_ID_CAP = 3 * 130 };
static const char *pct_id(const char *id)
{
    static char buf[ST_PCT_ID_CAP];
    size_t k = 0;
    for (const char *p = id; *p && k + 4 < sizeof buf; p++) {
        if (*p == '+' || *p == '=')
            k += (size_t)snprintf(buf + k, sizeof buf - k, "%%%02X", (unsigned char)*p);
        else
            buf[k++] = *p;
    }
    buf[k] = '\0';
    return buf;
}

static int cmp_str(const void *a, const void *b)
{
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* GET /v1/sessions in pages of 7 over a store of 25 sessions (and two internal park: ones),
 * GET .../versions in pages of 2; bad limit and after are 400. The store is filled before the
 * server starts (its own store, its own server). */
static void test_pagination(void **state)
{
    (void)state;
    char pstore[4300];
    snprintf(pstore, sizeof pstore, "%s/page-store", dir);
    enum { N = 25 };
    char ids[N][16];
    const char *want[N];
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, pstore, &(st_store_opts){.create = 1}), 0);
    st_synth_opts so = {.seed = 3, .n_tokens = 20, .n_layers = 2, .n_ctx = 256, .page_size = 16};
    st_image *img = NULL;
    assert_int_equal(st_image_synthesize(&so, &img), 0);
    for (int i = 0; i < N; i++) { /* put in an order that is not the listing's */
        if (i == N - 1)
            snprintf(ids[i], sizeof ids[i], "S"); /* upper case sorts first */
        else if (i == N - 2) /* the store allows + and = (statectl import --id): a `next` too */
            snprintf(ids[i], sizeof ids[i], "s-%02d+x=1", (i * 7) % (N - 1));
        else
            snprintf(ids[i], sizeof ids[i], "s-%02d", (i * 7) % (N - 1));
        want[i] = ids[i];
        assert_int_equal(st_store_put(st, ids[i], img, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    }
    for (int v = 2; v <= 5; v++)
        assert_int_equal(st_store_put(st, "s-07", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
    /* disk-parked conversations are internal: never listed, and they do not shorten a page */
    assert_int_equal(st_store_put(st, "park:s-03", img, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "park:zz", img, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    st_image_free(img);
    st_store_close(st);
    qsort(want, N, sizeof want[0], cmp_str);

    st_hc_server ps;
    const char *args[] = {"--store", pstore, NULL};
    assert_int_equal(st_hc_server_start(&ps, SERVER, dir, logpath, args), 0);

    /* pages of 7: 7, 7, 7, 4; every id once, in order; next is the last id, null at the end */
    char path[32 + ST_PCT_ID_CAP] = "/v1/sessions?limit=7"; /* room for any pct_id() */
    int seen = 0, pages = 0;
    for (;;) {
        json_t *o = st_at_call(ps.port, "GET", path, NULL, 200);
        json_t *list = json_object_get(o, "sessions"), *next = json_object_get(o, "next");
        size_t n = json_array_size(list);
        assert_int_equal(n, pages < 3 ? 7 : 4);
        for (size_t i = 0; i < n; i++) {
            json_t *e = json_array_get(list, i);
            assert_string_equal(json_string_value(json_object_get(e, "id")), want[seen]);
            assert_int_equal(json_integer_value(json_object_get(e, "head")),
                             strcmp(want[seen], "s-07") ? 1 : 5);
            assert_true(json_is_null(json_object_get(e, "live")));
            seen++;
        }
        pages++;
        if (pages == 4) {
            assert_true(json_is_null(next));
            json_decref(o);
            break;
        }
        assert_true(json_is_string(next));
        assert_string_equal(json_string_value(next), want[seen - 1]);
        snprintf(path, sizeof path, "/v1/sessions?limit=7&after=%s", pct_id(json_string_value(next)));
        json_decref(o);
    }
    assert_int_equal(seen, N);
    /* page by one from just before the id with + and =: it comes back and serves as `after` */
    for (int i = 0; i < N; i++)
        if (strchr(want[i], '+')) {
            snprintf(path, sizeof path, "/v1/sessions?limit=1&after=%s", pct_id(want[i - 1]));
            json_t *o = st_at_call(ps.port, "GET", path, NULL, 200);
            assert_string_equal(json_string_value(json_object_get(o, "next")), want[i]);
            json_decref(o);
            snprintf(path, sizeof path, "/v1/sessions?limit=1&after=%s", pct_id(want[i]));
            o = st_at_call(ps.port, "GET", path, NULL, 200);
            assert_string_equal(json_string_value(json_object_get(
                                    json_array_get(json_object_get(o, "sessions"), 0), "id")),
                                want[i + 1]);
            json_decref(o);
        }

    /* the default page holds all 25; a page that ends exactly at the last session says so */
    json_t *o = st_at_call(ps.port, "GET", "/v1/sessions", NULL, 200);
    assert_int_equal(json_array_size(json_object_get(o, "sessions")), N);
    assert_true(json_is_null(json_object_get(o, "next")));
    json_decref(o);
    o = st_at_call(ps.port, "GET", "/v1/sessions?limit=25", NULL, 200);
    assert_int_equal(json_array_size(json_object_get(o, "sessions")), N);
    assert_true(json_is_null(json_object_get(o, "next")));
    json_decref(o);
    o = st_at_call(ps.port, "GET", "/v1/sessions?limit=24", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(o, "next")), want[N - 2]);
    json_decref(o);
    /* an id that does not exist is a position; after the last id: an empty last page */
    o = st_at_call(ps.port, "GET", "/v1/sessions?after=s-05a&limit=2", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(o, "sessions"), 0), "id")),
                        "s-06");
    assert_string_equal(json_string_value(json_object_get(o, "next")), "s-07");
    json_decref(o);
    snprintf(path, sizeof path, "/v1/sessions?after=%s", want[N - 1]);
    o = st_at_call(ps.port, "GET", path, NULL, 200);
    assert_int_equal(json_array_size(json_object_get(o, "sessions")), 0);
    assert_true(json_is_null(json_object_get(o, "next")));
    json_decref(o);

    /* versions of s-07 in pages of 2: [1 2] [3 4] [5] */
    snprintf(path, sizeof path, "/v1/sessions/s-07/versions?limit=2");
    int v = 0;
    for (int page = 0; page < 3; page++) {
        o = st_at_call(ps.port, "GET", path, NULL, 200);
        json_t *list = json_object_get(o, "versions"), *next = json_object_get(o, "next");
        assert_int_equal(json_array_size(list), page < 2 ? 2 : 1);
        for (size_t i = 0; i < json_array_size(list); i++)
            assert_int_equal(json_integer_value(json_object_get(json_array_get(list, i), "version")), ++v);
        if (page < 2) {
            assert_int_equal(json_integer_value(next), v);
            snprintf(path, sizeof path, "/v1/sessions/s-07/versions?limit=2&after=%d", v);
        } else {
            assert_true(json_is_null(next));
        }
        json_decref(o);
    }
    assert_int_equal(v, 5);
    o = st_at_call(ps.port, "GET", "/v1/sessions/s-07/versions", NULL, 200);
    assert_int_equal(json_array_size(json_object_get(o, "versions")), 5);
    assert_true(json_is_null(json_object_get(o, "next")));
    json_decref(o);
    o = st_at_call(ps.port, "GET", "/v1/sessions/s-07/versions?after=9", NULL, 200);
    assert_int_equal(json_array_size(json_object_get(o, "versions")), 0);
    json_decref(o);
    st_hc_resp r;
    assert_int_equal(st_hc_request(ps.port, "GET", "/v1/sessions/nope/versions?limit=2", NULL, NULL, 0, &r), 0);
    is_error(&r, 404, "not_found", "versions of a missing session");
    st_hc_resp_free(&r);

    /* bad parameters: 400 naming the parameter (and the range, for limit) */
    static const char *const bad_limits[] = {"0", "1001", "-1", "abc", "", "7x", "99999999999999999999",
                                             "1e3", "%37%00"};
    for (size_t i = 0; i < sizeof bad_limits / sizeof bad_limits[0]; i++) {
        snprintf(path, sizeof path, "/v1/sessions?limit=%s", bad_limits[i]);
        bad_param(ps.port, path, "limit must be a whole number from 1 to 1000");
        snprintf(path, sizeof path, "/v1/sessions/s-07/versions?limit=%s", bad_limits[i]);
        bad_param(ps.port, path, "limit must be a whole number from 1 to 1000");
    }
    static const char *const bad_afters[] = {"", "a%2Fb", "%00", "a%zz", "a%20b", "a+b"};
    for (size_t i = 0; i < sizeof bad_afters / sizeof bad_afters[0]; i++) {
        snprintf(path, sizeof path, "/v1/sessions?after=%s", bad_afters[i]);
        bad_param(ps.port, path, "after");
    }
    /* 129 characters: one over the store's id limit (128 is a valid position) */
    char long_id[130];
    memset(long_id, 'a', 129);
    long_id[129] = '\0';
    snprintf(path, sizeof path, "/v1/sessions?after=%s", long_id);
    bad_param(ps.port, path, "after");
    long_id[128] = '\0';
    snprintf(path, sizeof path, "/v1/sessions?after=%s", long_id);
    o = st_at_call(ps.port, "GET", path, NULL, 200);
    assert_string_equal(json_string_value(json_object_get(json_array_get(json_object_get(o, "sessions"), 0), "id")),
                        "s-00");
    json_decref(o);
    static const char *const bad_versions[] = {"", "-1", "x", "1.5", "9999999999999999999"};
    for (size_t i = 0; i < sizeof bad_versions / sizeof bad_versions[0]; i++) {
        snprintf(path, sizeof path, "/v1/sessions/s-07/versions?after=%s", bad_versions[i]);
        bad_param(ps.port, path, "after");
    }
    assert_int_equal(st_hc_server_stop(&ps, SIGTERM), 0);
}

static void test_command_line(void **state)
{
    (void)state;
    static char out[16384];
    assert_int_equal(st_test_run(out, sizeof out, SERVER " --help"), 0);
    static const char *const flags[] = {
        "--host", "--port", "--ready-file", "--api-key-file", "--model", "--slots",
        "--conversation-cache-mib", "--slot-save-path", "--threads", "--ubatch", "--ctx",
        "--page-size", "--kv-dtype", "--prompt-cache ", "--prompt-cache-every", "--prompt-cache-root",
        "--expert-cache-mib",
        "--session-state-codec", "--save-compress", "--max-n-predict", "--store", "--keep-last",
        "--spool-dir", "--workers", "--max-connections ", "--max-connections-per-peer",
        "--max-header-bytes", "--max-headers", "--max-json-kib", "--max-completion-kib",
        "--max-part-mib", "--max-upload-mib", "--body-budget-mib", "--head-timeout-ms",
        "--read-timeout-ms", "--body-timeout-ms", "--min-body-rate", "--body-rate-window-ms",
        "--write-timeout-ms", "--idle-timeout-ms", "--shutdown-timeout-ms", "--upload-ttl-s",
        "--mem-guard", "--mem-reserve-mib", "--meminfo", "--log-requests"};
    for (size_t i = 0; i < sizeof flags / sizeof flags[0]; i++) {
        char at[64];
        snprintf(at, sizeof at, "\n  %s", flags[i]); /* the flag's own line */
        const char *f = strstr(out, at);
        if (!f)
            fprintf(stderr, "--help does not name %s\n", flags[i]);
        assert_non_null(f);
        const char *eol = strchr(f + 1, '\n');
        assert_non_null(eol);
        /* the default is on the flag's line or the next one */
        const char *next = strchr(eol + 1, '\n');
        char line[512];
        snprintf(line, sizeof line, "%.*s", (int)((next ? next : eol) - f), f);
        if (!strstr(line, "default"))
            fprintf(stderr, "--help gives no default for %s\n", flags[i]);
        assert_non_null(strstr(line, "default"));
    }
    static const struct {
        const char *args, *says;
    } bad[] = {
        {"--port x", "--port needs a number up to 65535, got \"x\""},
        {"--port 70000", "--port needs a number"},
        {"--slots 0", "--slots must be 1..1024, got 0"},
        {"--workers 0", "--workers must be 1..256"},
        {"--head-timeout-ms 0", "--head-timeout-ms must be at least 1"},
        {"--max-connections 0", "--max-connections must be at least 1"},
        {"--max-connections-per-peer 0", "--max-connections-per-peer must be at least 1"},
        {"--min-body-rate 0", "--min-body-rate must be at least 1"},
        {"--body-rate-window-ms 0", "--body-rate-window-ms must be at least 1"},
        {"--max-part-mib 254", "--body-budget-mib must hold"}, /* 254 MiB + 4 MiB > 256 MiB */
        {"--max-header-bytes 100", "--max-header-bytes must be at least 256"},
        {"--max-part-mib 512", "--body-budget-mib must hold"},
        {"--mem-guard maybe", "--mem-guard needs on|off, got \"maybe\""},
        {"--kv-dtype f32", "--kv-dtype needs f16|i8"},
        {"--session-state-codec fp8", "--session-state-codec needs fp32|bf16|f16, got \"fp8\""},
        {"--no-such-flag 1", "unknown option --no-such-flag"},
        {"--port", "--port needs a value"},
        {"--expert-cache-mib lots", "--expert-cache-mib needs a number"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = st_test_run(out, sizeof out, SERVER " --store '%s/never' %s", dir, bad[i].args);
        if (rc != 2 || !strstr(out, bad[i].says))
            fprintf(stderr, "%s: exit %d, said: %.300s\n", bad[i].args, rc, out);
        assert_int_equal(rc, 2);
        assert_non_null(strstr(out, bad[i].says));
    }
    assert_int_equal(st_test_run(out, sizeof out, SERVER), 2);
    assert_non_null(strstr(out, "--store DIR is required"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_healthz_and_metrics),
        cmocka_unit_test(test_hostile_requests),
        cmocka_unit_test(test_non_utf8_request_line),
        cmocka_unit_test(test_bad_ids_and_sizes),
        cmocka_unit_test(test_timeouts),
        cmocka_unit_test(test_keepalive_and_pipelining),
        cmocka_unit_test(test_connection_cap),
        cmocka_unit_test(test_connections_per_peer),
        cmocka_unit_test(test_body_budget),
        cmocka_unit_test(test_auth),
        cmocka_unit_test(test_upload_download),
        cmocka_unit_test(test_memory_guard),
        cmocka_unit_test(test_concurrent_clients),
        cmocka_unit_test(test_pagination),
        cmocka_unit_test(test_command_line),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
