/*
 * test_api_damage.c - strata-server on a store whose data.mdb was damaged while it was stopped.
 * The start-up scan (in a child process) quarantines the damaged sessions and the server serves
 * the rest: /healthz lists them, /metrics counts them, GET /v1/sessions/{id}, RESTORE, DELETE and
 * completions on them answer 500 session_damaged, GET /v1/sessions marks them; the other sessions
 * restore and continue. Cases: a session record whose magic was flipped (the server did not start
 * before), and a flipped page-count byte in the header of a chunk's overflow pages (a RESTORE that
 * evicted, or a DELETE, freed 16 million pages and never answered).
 */
#include <signal.h>
#include <sys/stat.h>

#include "st_api_test.h"
#include "st_store.h"
#include "st_store_lmdb_int.h"

static st_at_env env;

static int setup(void **state)
{
    (void)state;
    return st_at_setup(&env, "test_api_damage");
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

static void flip(const char *db, size_t off, uint8_t x)
{
    FILE *f = fopen(db, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
    int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, (long)off, SEEK_SET), 0);
    assert_int_equal(fputc(c ^ x, f), c ^ x);
    assert_int_equal(fclose(f), 0);
}

/* Three saved conversations (distinct prompts: no chunk is shared), the server stopped. */
static void make_sessions(const char *store)
{
    st_hc_server s;
    assert_int_equal(st_at_server_start(&s, &env, store, NULL, NULL), 0);
    static const char *const ids[] = {"alpha", "beta", "gamma"};
    static const char *const prompts[] = {"the first of three", "a second one here", "and then the third"};
    for (int i = 0; i < 3; i++) {
        json_decref(st_at_complete(s.port, ids[i], prompts[i], 8, true));
        char path[128];
        snprintf(path, sizeof path, "/v1/sessions/%s/save", ids[i]);
        json_decref(st_at_call(s.port, "POST", path, "{}", 201));
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* GET path must answer 500 with code session_damaged. */
static void want_damaged(uint16_t port, const char *method, const char *path, const char *body)
{
    json_t *o = st_at_call(port, method, path, body, 500);
    const char *code = json_string_value(json_object_get(json_object_get(o, "error"), "code"));
    assert_non_null(code);
    assert_string_equal(code, "session_damaged");
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    assert_non_null(strstr(msg, "statectl restore-backup"));
    json_decref(o);
}

/* /healthz lists id among the damaged sessions (with a reason). */
static void want_listed(uint16_t port, const char *id)
{
    json_t *h = st_at_call(port, "GET", "/healthz", NULL, 200);
    json_t *d = json_object_get(h, "damaged_sessions");
    assert_true(json_is_array(d));
    int found = 0;
    for (size_t i = 0; i < json_array_size(d); i++) {
        const char *x = json_string_value(json_object_get(json_array_get(d, i), "id"));
        const char *why = json_string_value(json_object_get(json_array_get(d, i), "why"));
        assert_non_null(why);
        found |= x && !strcmp(x, id);
    }
    assert_true(found);
    json_decref(h);
    assert_true(st_at_metric(port, "strata_sessions_damaged") >= 1);
}

/* gamma is whole: it restores and continues. */
static void want_served(uint16_t port)
{
    json_decref(st_at_call(port, "GET", "/v1/sessions/gamma", NULL, 200));
    json_decref(st_at_call(port, "POST", "/v1/sessions/gamma/restore", "{}", 200));
    json_decref(st_at_complete(port, "gamma", " and more", 4, true));
}

static void test_damaged_record(void **state)
{
    (void)state;
    char db[4400];
    make_sessions("rec");
    snprintf(db, sizeof db, "%s/rec/data.mdb", env.dir);
    /* beta's record: the key "beta" then the record's magic "STSS" in a leaf node (every copy,
     * and the disk-parked "park:beta" with it) */
    size_t len = 0, hits = 0;
    uint8_t *file = st_test_slurp(db, &len);
    assert_non_null(file);
    for (uint8_t *p = file; (p = memmem(p, len - (size_t)(p - file), "betaSTSS", 8)); p++, hits++)
        flip(db, (size_t)(p - file) + 5, 0x20);
    free(file);
    assert_true(hits >= 1);

    st_hc_server s;
    assert_int_equal(st_at_server_start(&s, &env, "rec", NULL, NULL), 0);
    want_listed(s.port, "beta");
    want_damaged(s.port, "GET", "/v1/sessions/beta", NULL);
    want_damaged(s.port, "POST", "/v1/sessions/beta/restore", "{}");
    want_damaged(s.port, "POST", "/v1/completions", "{\"session\":\"beta\",\"prompt\":\"x\",\"n_predict\":2}");
    /* the listing marks it and shows the others */
    json_t *l = st_at_call(s.port, "GET", "/v1/sessions", NULL, 200);
    json_t *arr = json_object_get(l, "sessions");
    int saw_beta = 0, saw_alpha = 0;
    for (size_t i = 0; i < json_array_size(arr); i++) {
        json_t *e = json_array_get(arr, i);
        const char *id = json_string_value(json_object_get(e, "id"));
        if (id && !strcmp(id, "beta"))
            saw_beta = json_is_true(json_object_get(e, "damaged"));
        if (id && !strcmp(id, "alpha"))
            saw_alpha = 1;
    }
    json_decref(l);
    assert_true(saw_beta && saw_alpha);
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/alpha/restore", "{}", 200));
    want_served(s.port);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_damaged_overflow_count(void **state)
{
    (void)state;
    char dir[4400], db[4500];
    make_sessions("ovf");
    snprintf(dir, sizeof dir, "%s/ovf", env.dir);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    /* the largest chunk of alpha's head version, found by its bytes in the file */
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.read_only = 1}), 0);
    st_session_info si;
    assert_int_equal(st_store_show(st, "alpha", &si), 0);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, "alpha", si.head), kb}, v;
    assert_int_equal(mdb_get(txn, st->dbi_versions, &k, &v), 0);
    st_manifest m;
    assert_int_equal(st_manifest_parse(v.mv_data, v.mv_size, "alpha", &m), 0);
    uint32_t pick = 0;
    for (uint32_t i = 1; i < m.n_chunks; i++)
        if (m.chunks[i].stored_len > m.chunks[pick].stored_len)
            pick = i;
    assert_true(m.chunks[pick].stored_len >= 2048); /* over LMDB's node limit: in an overflow page */
    MDB_val ck = {ST_STORE_HASH_LEN, m.chunks[pick].hash}, cv;
    assert_int_equal(mdb_get(txn, st->dbi_chunks, &ck, &cv), 0);
    size_t n = cv.mv_size;
    uint8_t *copy = malloc(n);
    assert_non_null(copy);
    memcpy(copy, cv.mv_data, n);
    st_manifest_free(&m);
    mdb_txn_abort(txn);
    st_store_close(st);
    size_t len = 0;
    uint8_t *file = st_test_slurp(db, &len);
    assert_non_null(file);
    uint8_t *hit = memmem(file, len, copy, n);
    assert_non_null(hit);
    assert_null(memmem(hit + 1, len - (size_t)(hit + 1 - file), copy, n));
    flip(db, (size_t)(hit - file) - 16 + 15, 0x5a); /* the overflow page count's high byte */
    free(file);
    free(copy);
    struct stat sb0, sb1;
    assert_int_equal(stat(db, &sb0), 0);

    st_hc_server s;
    assert_int_equal(st_at_server_start(&s, &env, "ovf", NULL, NULL), 0);
    want_listed(s.port, "alpha");
    want_damaged(s.port, "POST", "/v1/sessions/alpha/restore", "{}");
    want_damaged(s.port, "DELETE", "/v1/sessions/alpha", NULL);
    want_damaged(s.port, "GET", "/v1/sessions/alpha/versions", NULL);
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/beta/restore", "{}", 200));
    want_served(s.port);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    assert_int_equal(stat(db, &sb1), 0);
    assert_true(sb1.st_size <= sb0.st_size);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_damaged_record),
        cmocka_unit_test(test_damaged_overflow_count),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
