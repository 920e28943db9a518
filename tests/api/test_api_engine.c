/*
 * test_api_engine.c - strata-server with the tiny model, the real binary on loopback:
 *   - a conversation, SAVE, kill -9, restart, RESTORE, continue: the same tokens and text as a
 *     run that was never interrupted (greedy);
 *   - more conversations than slots: each one parked and resumed continues exactly;
 *   - parking past the RAM ceiling spills to the store and comes back; disk-parked conversations
 *     survive kill -9, RAM-parked ones survive a graceful stop (SIGTERM);
 *   - 32 concurrent clients with their own conversations: completions, SAVE, RESTORE, nothing
 *     lost and no cross-talk, /healthz answering throughout;
 *   - llama.cpp's /slots actions, DELETE of a live session, the memory guard on SAVE and park;
 *   - a PARK whose conversation is taken back into a slot while the park still spills older
 *     images to the store is answered (the server once read the freed park entry there).
 * The engine runs on the cpu backend, or on the one named by the first argument: `cuda` is the
 * ctest test_api_engine_gpu (label gpu), every case above on the CUDA backend.
 */
#include <lmdb.h>
#include <pthread.h>
#include <stdint.h>
#include <time.h>

#include "st_api_test.h"
#include "st_file.h"

static st_at_env env = {.backend = "cpu"};

/* ---- helpers -------------------------------------------------------------------------------- */

/* strata-server on the tiny model, its store DIR/name, with extra flags (NULL-terminated). */
static int start(st_hc_server *s, const char *name, const char *const *extra)
{
    return st_at_server_start(s, &env, name, extra, NULL);
}

/* A completion that stops at an end of sequence; returns the reply (tokens, text, found, ...). */
static json_t *complete(uint16_t port, const char *session, const char *prompt, int n)
{
    return st_at_complete(port, session, prompt, n, false);
}

static void same_tokens(json_t *a, json_t *b)
{
    json_t *ta = json_object_get(a, "tokens"), *tb = json_object_get(b, "tokens");
    assert_true(json_is_array(ta));
    assert_int_equal(json_array_size(ta), json_array_size(tb));
    assert_true(json_equal(ta, tb));
    assert_string_equal(json_string_value(json_object_get(a, "text")),
                        json_string_value(json_object_get(b, "text")));
}

static const char *found(json_t *o)
{
    return json_string_value(json_object_get(o, "found"));
}

static int setup(void **state)
{
    (void)state;
    return st_at_setup(&env, strcmp(env.backend, "cpu") ? "test_api_engine_gpu" : "test_api_engine");
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

/* The reference: turns of one conversation on a fresh server that is never interrupted. */
static json_t *reference(const char *const *prompts, int turns, int n)
{
    const char *store = "ref-store";
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", env.dir, store);
    st_test_rmdir(path);
    st_hc_server s;
    static const char *const args[] = {"--slots", "1", NULL};
    assert_int_equal(start(&s, store, args), 0);
    json_t *all = json_array();
    for (int t = 0; t < turns; t++)
        json_array_append_new(all, complete(s.port, "ref", prompts[t], n));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    return all;
}

/* ---- tests ---------------------------------------------------------------------------------- */

static void test_save_kill9_restore_continue(void **state)
{
    (void)state;
    static const char *const prompts[] = {"Hello, Strata.", " And then?", " Once more."};
    json_t *ref = reference(prompts, 3, 24);
    const char *store = "crash-store";
    st_hc_server s;
    assert_int_equal(start(&s, store, NULL), 0);
    {
        /* the server names its backend on start: this is the one asked for */
        char want[64], buf[1 << 16];
        snprintf(want, sizeof want, "engine on the %s backend", env.backend);
        FILE *f = fopen(env.logpath, "r");
        assert_non_null(f);
        size_t got = fread(buf, 1, sizeof buf - 1, f);
        fclose(f);
        buf[got] = 0;
        if (!strstr(buf, want))
            fail_msg("the server log %s does not say \"%s\"", env.logpath, want);
    }
    json_t *t0 = complete(s.port, "chat", prompts[0], 24);
    assert_string_equal(found(t0), "new");
    same_tokens(t0, json_array_get(ref, 0));
    json_t *sv = st_at_call(s.port, "POST", "/v1/sessions/chat/save", "{}", 201);
    assert_int_equal(json_integer_value(json_object_get(sv, "version")), 1);
    json_decref(sv);
    /* more turns after the SAVE, then a crash: they are lost, the SAVE is not */
    json_decref(complete(s.port, "chat", " (lost)", 8));
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);

    assert_int_equal(start(&s, store, NULL), 0);
    json_t *rs = st_at_call(s.port, "POST", "/v1/sessions/chat/restore", "{}", 200);
    assert_int_equal(json_integer_value(json_object_get(rs, "version")), 1);
    json_decref(rs);
    json_t *t1 = complete(s.port, "chat", prompts[1], 24);
    same_tokens(t1, json_array_get(ref, 1));
    json_t *tm = json_object_get(t1, "timings");
    assert_true(json_integer_value(json_object_get(tm, "resumed_tokens")) > 0);
    /* without an explicit RESTORE, a completion continues from the head version */
    sv = st_at_call(s.port, "POST", "/v1/sessions/chat/save", "{}", 201);
    json_decref(sv);
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);
    assert_int_equal(start(&s, store, NULL), 0);
    json_t *t2 = complete(s.port, "chat", prompts[2], 24);
    assert_string_equal(found(t2), "store");
    same_tokens(t2, json_array_get(ref, 2));
    /* an older version restores too (RESTORE {version}) */
    rs = st_at_call(s.port, "POST", "/v1/sessions/chat/restore", "{\"version\":1}", 200);
    json_decref(rs);
    json_t *t1b = complete(s.port, "chat", prompts[1], 24);
    same_tokens(t1b, json_array_get(ref, 1));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(t0);
    json_decref(t1);
    json_decref(t1b);
    json_decref(t2);
    json_decref(ref);
}

/* n conversations with two turns each, interleaved, on a server with args; every turn must equal
 * that conversation run alone. */
static void interleave(const char *store, const char *const *args, int n, const char *expect_found)
{
    static const char *const p1[] = {"one", " two"};
    json_t *ref = reference(p1, 2, 12);
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    char id[32];
    for (int turn = 0; turn < 2; turn++) {
        for (int i = 0; i < n; i++) {
            snprintf(id, sizeof id, "conv-%d", i);
            json_t *t = complete(s.port, id, p1[turn], 12);
            same_tokens(t, json_array_get(ref, turn));
            if (turn == 1 && expect_found)
                assert_string_equal(found(t), expect_found);
            json_decref(t);
        }
    }
    json_t *sl = st_at_call(s.port, "GET", "/v1/sessions", NULL, 200);
    assert_int_equal(json_array_size(json_object_get(sl, "sessions")), (size_t)n);
    json_decref(sl);
    /* pages of 3 over saved and never-saved conversations: each id once, in id order, "next"
     * the page's last id and null on the last page */
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/conv-1/save", "{}", 201));
    char path[128] = "/v1/sessions?limit=3", last[64] = "";
    int listed = 0, saved = 0;
    for (int pages = 0;; pages++) {
        assert_true(pages <= n / 3);
        sl = st_at_call(s.port, "GET", path, NULL, 200);
        size_t i;
        json_t *e, *next = json_object_get(sl, "next");
        json_array_foreach(json_object_get(sl, "sessions"), i, e) {
            const char *sid = json_string_value(json_object_get(e, "id"));
            assert_true(strcmp(last, sid) < 0);
            snprintf(last, sizeof last, "%s", sid);
            saved += json_integer_value(json_object_get(e, "head")) == 1;
            listed++;
        }
        if (json_is_null(next)) {
            json_decref(sl);
            break;
        }
        assert_int_equal(json_array_size(json_object_get(sl, "sessions")), 3);
        assert_string_equal(json_string_value(next), last);
        snprintf(path, sizeof path, "/v1/sessions?limit=3&after=%s", last);
        json_decref(sl);
    }
    assert_int_equal(listed, n);
    assert_int_equal(saved, 1);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(ref);
}

static void test_more_conversations_than_slots(void **state)
{
    (void)state;
    const char *store = "slots-store";
    static const char *const args[] = {"--slots", "2", NULL};
    interleave(store, args, 6, "ram");
}

static void test_spill_past_ceiling_and_back(void **state)
{
    (void)state;
    const char *store = "spill-store";
    static const char *const args[] = {"--slots", "1", "--conversation-cache-mib", "0", NULL};
    interleave(store, args, 4, "disk");
    /* the disk-parked conversations are in the store: they survive kill -9 */
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    st_hc_resp r;
    assert_int_equal(st_hc_request(s.port, "GET", "/metrics", NULL, NULL, 0, &r), 0);
    assert_non_null(strstr((char *)r.body, "strata_park_pool_entries{where=\"disk\"} 4"));
    /* the weight-conversion cache is off without STRATA_BF16_TC: its figures are 0 */
    assert_non_null(strstr((char *)r.body, "\nstrata_wcache_fp16 0\n"));
    assert_non_null(strstr((char *)r.body, "\nstrata_wcache_arena_bytes 0\n"));
    assert_non_null(strstr((char *)r.body, "\nstrata_wcache_hits_total 0\n"));
    /* no --expert-cache-mib (and the CPU backend): the routed-expert cache's figures are 0 */
    assert_non_null(strstr((char *)r.body, "\nstrata_xcache_host 0\n"));
    assert_non_null(strstr((char *)r.body, "\nstrata_xcache_misses_total 0\n"));
    st_hc_resp_free(&r);
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);
    assert_int_equal(start(&s, store, args), 0);
    json_t *t = complete(s.port, "conv-2", " three", 4);
    assert_string_equal(found(t), "disk");
    json_decref(t);
    json_t *pk = st_at_call(s.port, "POST", "/v1/sessions/conv-2/park", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(pk, "where")), "disk");
    json_decref(pk);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_ram_ceiling_oldest_first(void **state)
{
    (void)state;
    const char *store = "ceiling-store";
    /* 1 MiB of RAM parking: the tiny model's images are ~20 KB, so parking 3 stays in RAM */
    static const char *const args[] = {"--slots", "1", "--conversation-cache-mib", "1", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        json_decref(complete(s.port, id, "x", 4));
    }
    json_t *sl = st_at_call(s.port, "GET", "/v1/sessions/r0", NULL, 200);
    json_t *live = json_object_get(sl, "live");
    assert_string_equal(json_string_value(json_object_get(live, "where")), "ram");
    json_decref(sl);
    sl = st_at_call(s.port, "GET", "/v1/sessions/r3", NULL, 200);
    assert_string_equal(json_string_value(json_object_get(json_object_get(sl, "live"), "where")), "slot");
    json_decref(sl);
    /* a graceful stop writes live and RAM-parked conversations to the store */
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    assert_int_equal(start(&s, store, args), 0);
    for (int i = 0; i < 4; i++) {
        char id[16];
        snprintf(id, sizeof id, "r%d", i);
        json_t *t = complete(s.port, id, "y", 4);
        assert_string_equal(found(t), "disk");
        json_decref(t);
    }
    /* kill -9 loses RAM-parked conversations that were never spilled or saved */
    json_decref(complete(s.port, "lost", "z", 4));
    json_decref(complete(s.port, "r0", "z", 4)); /* parks "lost" in RAM */
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);
    assert_int_equal(start(&s, store, args), 0);
    json_t *t = complete(s.port, "lost", "z", 4);
    assert_string_equal(found(t), "new");
    json_decref(t);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_slots_delete_and_guard(void **state)
{
    (void)state;
    const char *store = "misc-store";
    char saves[4300], mi[4300];
    snprintf(saves, sizeof saves, "%s/slot-saves", env.dir);
    assert_int_equal(mkdir(saves, 0700), 0);
    const char *const args[] = {"--slots", "2", "--slot-save-path", saves, NULL};
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    json_t *t = complete(s.port, "sl", "slot me", 8);
    json_decref(t);
    json_t *l = st_at_call(s.port, "GET", "/slots", NULL, 200);
    assert_int_equal(json_array_size(l), 2);
    json_decref(l);
    json_t *o = st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"a.stsf\"}", 200);
    assert_true(json_integer_value(json_object_get(o, "n_saved")) > 0);
    json_decref(o);
    /* the same slot saved with its checkpoints compressed: a v2 file that says so */
    o = st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"z.stsf\",\"compress\":1}", 200);
    json_decref(o);
    json_decref(st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"y\",\"compress\":20}", 400));
    json_decref(st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"y\",\"compress\":\"1\"}", 400));
    char za[4400], zz[4400];
    snprintf(za, sizeof za, "%s/a.stsf", saves);
    snprintf(zz, sizeof zz, "%s/z.stsf", saves);
    st_file_info zi, ai;
    assert_int_equal(st_file_inspect(zz, &zi), 0);
    assert_int_equal(st_file_inspect(za, &ai), 0);
    assert_true(zi.all_ok && zi.version == 2 && ai.version == 1);
    for (uint32_t k = 0; k < zi.n_sections; k++)
        if (zi.sections[k].type == ST_SECTION_CHECKPOINT)
            assert_true(zi.sections[k].compressed);
    st_file_info_free(&zi);
    st_file_info_free(&ai);
    json_decref(st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"../a.stsf\"}", 400));
    json_decref(st_at_call(s.port, "POST", "/slots/0?action=save", "{\"filename\":\"/etc/x\"}", 400));
    json_decref(st_at_call(s.port, "POST", "/slots/7?action=save", "{\"filename\":\"b\"}", 404));
    json_decref(st_at_call(s.port, "POST", "/slots/0?action=fly", "{\"filename\":\"b\"}", 400));
    o = st_at_call(s.port, "POST", "/slots/0?action=erase", NULL, 200);
    assert_true(json_integer_value(json_object_get(o, "n_erased")) > 0);
    json_decref(o);
    o = st_at_call(s.port, "POST", "/slots/1?action=restore", "{\"filename\":\"a.stsf\"}", 200);
    assert_true(json_integer_value(json_object_get(o, "n_restored")) > 0);
    char sid[200];
    snprintf(sid, sizeof sid, "%s", json_string_value(json_object_get(o, "session")));
    json_decref(o);
    /* the compressed file restores to the conversation the raw one does: the same continuation
     * of the same length (the control: the conversation one turn on is longer) */
    json_t *ca = complete(s.port, sid, "go on", 6);
    o = st_at_call(s.port, "POST", "/slots/1?action=restore", "{\"filename\":\"z.stsf\"}", 200);
    assert_string_equal(json_string_value(json_object_get(o, "session")), sid);
    json_decref(o);
    json_t *cz = complete(s.port, sid, "go on", 6);
    same_tokens(ca, cz);
    assert_int_equal(json_integer_value(json_object_get(ca, "n_tokens")),
                     json_integer_value(json_object_get(cz, "n_tokens")));
    json_t *cn = complete(s.port, sid, "go on", 6);
    assert_true(json_integer_value(json_object_get(cn, "n_tokens")) >
                json_integer_value(json_object_get(ca, "n_tokens")));
    json_decref(ca);
    json_decref(cz);
    json_decref(cn);
    json_decref(st_at_call(s.port, "POST", "/slots/1?action=restore", "{\"filename\":\"missing\"}", 404));
    /* SAVE of nothing live, DELETE of a live-only session */
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/nobody/save", NULL, 404));
    json_decref(complete(s.port, "gone", "bye", 4));
    o = st_at_call(s.port, "DELETE", "/v1/sessions/gone", NULL, 200);
    assert_true(json_is_true(json_object_get(o, "live_deleted")));
    json_decref(o);
    json_decref(st_at_call(s.port, "GET", "/v1/sessions/gone", NULL, 404));
    /* malformed completions */
    json_decref(st_at_call(s.port, "POST", "/v1/completions", "{\"prompt\":\"a\",\"tokens\":[1]}", 400));
    json_decref(st_at_call(s.port, "POST", "/v1/completions", "{\"tokens\":[99999]}", 400));
    json_decref(st_at_call(s.port, "POST", "/v1/completions", "{\"n_predict\":-1}", 400));
    json_decref(st_at_call(s.port, "POST", "/v1/completions", "{\"session\":\"../x\"}", 400));
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/sl/save", "{\"codec\":\"fp8\"}", 400));
    /* bf16 SAVE, labels, conflicts */
    json_decref(complete(s.port, "sl", "again", 4));
    o = st_at_call(s.port, "POST", "/v1/sessions/sl/save", "{\"codec\":\"bf16\",\"label\":\"keep\"}", 201);
    assert_string_equal(json_string_value(json_object_get(o, "codec")), "bf16");
    json_decref(o);
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/sl/save", "{\"expected_head\":7}", 409));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    /* the guard refuses SAVE and park with what it read */
    snprintf(mi, sizeof mi, "%s/meminfo", env.dir);
    const char *fake = "MemAvailable: 10 kB\n";
    assert_int_equal(st_test_spit(mi, fake, strlen(fake)), 0);
    const char *const gargs[] = {"--meminfo", mi, "--mem-reserve-mib", "0", NULL};
    assert_int_equal(start(&s, store, gargs), 0);
    json_decref(complete(s.port, "g", "guarded", 4));
    o = st_at_call(s.port, "POST", "/v1/sessions/g/save", NULL, 503);
    const char *msg = json_string_value(json_object_get(json_object_get(o, "error"), "message"));
    assert_non_null(strstr(msg, "available 0.00 GiB (MemAvailable)"));
    json_decref(o);
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/g/park", NULL, 503));
    json_decref(complete(s.port, "g", " still here", 4)); /* the refused park changed nothing */
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* ---- 32 concurrent clients ------------------------------------------------------------------ */

#define CLIENTS 32
static uint16_t cport;
static json_t *cref; /* reference turns */

/* A call that retries while the server says busy (409 busy: all slots in use). The bound is
 * time, and generous: 32 clients share 4 slots, and under ASan on a loaded 2-core machine a
 * client may wait well over the 2,000 tries (about 9 s) this once allowed, which failed the
 * test with "status 0" (retries exhausted) although the server was right. */
static int call_retry(int client, const char *method, const char *path, const char *body, st_hc_resp *r)
{
    /* each client from its own loopback address (127.0.1.N): the server's per-address limit and
       its shedding of an address's idle connections are test_api_slow's subject, not this one's
       (they were suspected of the "status 0" answers this test once read under ASan; the cause
       was the server aborting on a use-after-free, test_park_taken_while_spilling) */
    char src[32];
    snprintf(src, sizeof src, "127.0.1.%d", 1 + client);
    struct timespec t0, t;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (int attempt = 0;; attempt++) {
        clock_gettime(CLOCK_MONOTONIC, &t);
        if (t.tv_sec - t0.tv_sec > 240)
            break;
        /* each answer may take the server's --busy-wait-ms (30 s) after the request waited for a
           worker: a receive timeout of 30 s, the client's default, met it exactly and read
           "status 0" (no answer) on a loaded machine while /healthz answered in 28 ms */
        memset(r, 0, sizeof *r);
        int fd = st_hc_connect_from(cport, src, 120000);
        if (fd < 0)
            return -1;
        int rc = st_hc_send_req(fd, method, path, NULL, body, body ? strlen(body) : 0);
        if (!rc)
            rc = st_hc_read(fd, r);
        close(fd);
        if (rc)
            return -1;
        if (!(r->status == 409 && strstr((char *)r->body, "\"busy\"")))
            return 0;
        st_hc_resp_free(r);
        usleep(2000 + 100 * (attempt % 50));
    }
    return -1;
}

static void *client_main(void *arg)
{
    st_at_client *c = arg;
    static const char *const p[] = {"one", " two"};
    char id[32], body[256], path[128];
    snprintf(id, sizeof id, "k-%d", c->i);
    for (int turn = 0; turn < 2 && !c->failures; turn++) {
        st_hc_resp r;
        snprintf(body, sizeof body, "{\"session\":\"%s\",\"prompt\":\"%s\",\"n_predict\":12}", id, p[turn]);
        if (call_retry(c->i, "POST", "/v1/completions", body, &r) || r.status != 200) {
            c->failures++;
            snprintf(c->why, sizeof c->why, "turn %d: status %d %.100s", turn, r.status,
                     r.body ? (char *)r.body : "");
            st_hc_resp_free(&r);
            break;
        }
        json_error_t e;
        json_t *o = json_loadb((const char *)r.body, r.body_len, 0, &e);
        st_hc_resp_free(&r);
        if (!o || strcmp(json_string_value(json_object_get(o, "session")), id) ||
            !json_equal(json_object_get(o, "tokens"),
                        json_object_get(json_array_get(cref, (size_t)turn), "tokens"))) {
            c->failures++;
            snprintf(c->why, sizeof c->why, "turn %d: tokens differ from the reference", turn);
        }
        json_decref(o);
        if (turn == 0) { /* SAVE, then RESTORE it: the next turn must be unchanged */
            snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
            if (call_retry(c->i, "POST", path, "{}", &r) || r.status != 201) {
                c->failures++;
                snprintf(c->why, sizeof c->why, "save: %d", r.status);
            }
            st_hc_resp_free(&r);
            snprintf(path, sizeof path, "/v1/sessions/%s/restore", id);
            if (!c->failures && (call_retry(c->i, "POST", path, "{}", &r) || r.status != 200)) {
                c->failures++;
                snprintf(c->why, sizeof c->why, "restore: %d", r.status);
            }
            st_hc_resp_free(&r);
        }
    }
    return NULL;
}

static void test_concurrent_conversations(void **state)
{
    (void)state;
    static const char *const p[] = {"one", " two"};
    cref = reference(p, 2, 12);
    const char *store = "conc-store";
    static const char *const args[] = {"--slots", "4", "--workers", "8", "--conversation-cache-mib", "0",
                                       NULL};
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    cport = s.port;
    st_at_client cl[CLIENTS];
    st_at_poller pol;
    int failures = st_at_run_clients(s.port, CLIENTS, client_main, cl, &pol);
    assert_int_equal(failures, 0);
    assert_int_equal(pol.failed, 0);
    json_t *sl = st_at_call(s.port, "GET", "/v1/sessions", NULL, 200);
    size_t i;
    json_t *e;
    int saved = 0;
    json_array_foreach(json_object_get(sl, "sessions"), i, e)
        saved += json_integer_value(json_object_get(e, "head")) == 1;
    assert_int_equal(saved, CLIENTS);
    json_decref(sl);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(cref);
}

/* A burst of requests on one session: each is served or told busy, and the session is never in
 * two slots at once. */
static void *same_main(void *arg)
{
    int *status = arg;
    st_hc_resp r;
    *status = st_hc_json(cport, "POST", "/v1/completions",
                         "{\"session\":\"same\",\"prompt\":\"x\",\"n_predict\":2}", &r) ? -1 : r.status;
    st_hc_resp_free(&r);
    return NULL;
}

static void test_one_session_many_requests(void **state)
{
    (void)state;
    const char *store = "same-store";
    static const char *const args[] = {"--slots", "4", "--workers", "8", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    cport = s.port;
    for (int round = 0; round < 3; round++) {
        pthread_t th[8];
        int st[8];
        for (int i = 0; i < 8; i++)
            assert_int_equal(pthread_create(&th[i], NULL, same_main, &st[i]), 0);
        int ok = 0;
        for (int i = 0; i < 8; i++) {
            pthread_join(th[i], NULL);
            assert_true(st[i] == 200 || st[i] == 409);
            ok += st[i] == 200;
        }
        assert_true(ok >= 1);
        json_t *l = st_at_call(s.port, "GET", "/slots", NULL, 200);
        size_t i;
        json_t *e;
        int bound = 0;
        json_array_foreach(l, i, e) {
            const char *sid = json_string_value(json_object_get(e, "session"));
            bound += sid && !strcmp(sid, "same");
        }
        assert_int_equal(bound, 1);
        json_decref(l);
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* A PARK puts its conversation into the RAM pool, releases the pool's lock, and then spills
 * older images to the store while the pool is over its ceiling. From the release on, another
 * request may take the conversation back into a slot, which frees its park entry: the PARK must
 * not read that entry afterwards. It did (park_slot added the entry's bytes to a metric): under
 * ASan the server aborted there and every connection in flight was closed without an answer,
 * which test_concurrent_conversations' clients read as "status 0". Here the window is held open
 * without any timing: the test holds the store's LMDB write lock (a second writer process, as
 * statectl would be), so the spill waits in the store while a completion takes the conversation
 * from RAM into a free slot; only then is the lock let go. */
static void test_park_taken_while_spilling(void **state)
{
    (void)state;
    const char *store = "parkrace-store";
    /* 1 MiB of RAM parking; a 1,900-token conversation of the tiny model parks in ~270 KB, so
     * three fit and a fourth is over the ceiling */
    static const char *const args[] = {"--slots", "2", "--conversation-cache-mib", "1", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, store, args), 0);
    char prompt[1901], body[2048];
    memset(prompt, 'a', sizeof prompt - 1);
    prompt[sizeof prompt - 1] = '\0';
    static const char *const ids[] = {"old-1", "old-2", "old-3", "racer"};
    json_int_t pooled = 0, one = 0;
    for (int i = 0; i < 4; i++) {
        st_at_completion_body(body, sizeof body, ids[i], prompt, 1, false);
        json_decref(st_at_call(s.port, "POST", "/v1/completions", body, 200));
        if (i < 3) { /* into the pool, in RAM: its slot is free again */
            char path[64];
            snprintf(path, sizeof path, "/v1/sessions/%s/park", ids[i]);
            json_t *pk = st_at_call(s.port, "POST", path, NULL, 200);
            assert_string_equal(json_string_value(json_object_get(pk, "where")), "ram");
            one = json_integer_value(json_object_get(pk, "bytes"));
            pooled += one;
            json_decref(pk);
        }
    }
    /* the premise: racer's image (as large as the others) takes the pool over its ceiling */
    if (!(pooled <= (1 << 20) && pooled + one > (1 << 20)))
        fail_msg("three parked images of %lld bytes each no longer take the 1 MiB pool to just under "
                 "its ceiling: change the prompt length", (long long)one);
    /* the store's write lock, held from here: every store write of the server waits for it */
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", env.dir, store);
    MDB_env *me = NULL;
    MDB_txn *mt = NULL;
    assert_int_equal(mdb_env_create(&me), 0);
    assert_int_equal(mdb_env_set_maxdbs(me, 16), 0);
    assert_int_equal(mdb_env_open(me, path, 0, 0644), 0);
    assert_int_equal(mdb_txn_begin(me, NULL, 0, &mt), 0);
    /* PARK racer: in the pool (over the ceiling), then the spill of old-1 waits for the lock */
    st_at_bg park;
    st_at_bg_start(&park, s.port, "POST", "/v1/sessions/racer/park", "");
    for (;;) { /* racer is in the pool once GET says so (a bound for a broken server: ctest's) */
        json_t *g = st_at_call(s.port, "GET", "/v1/sessions/racer", NULL, 200);
        const char *where = json_string_value(json_object_get(json_object_get(g, "live"), "where"));
        int in_ram = where && !strcmp(where, "ram");
        json_decref(g);
        if (in_ram)
            break;
        usleep(2000);
    }
    assert_int_equal(atomic_load(&park.done), 0); /* the spill still waits for the store */
    /* a completion takes racer from RAM into the free slot (no store write): its entry is freed */
    st_at_completion_body(body, sizeof body, "racer", " more", 2, false);
    json_t *t = st_at_call(s.port, "POST", "/v1/completions", body, 200);
    assert_string_equal(found(t), "ram");
    json_decref(t);
    mdb_txn_abort(mt);
    mdb_env_close(me);
    /* the PARK finishes: answered, not a closed connection */
    json_t *pk = st_at_bg_join(&park, 200);
    assert_string_equal(json_string_value(json_object_get(pk, "session")), "racer");
    assert_true(json_integer_value(json_object_get(pk, "bytes")) > 0);
    json_decref(pk);
    assert_int_equal(st_at_metric(s.port, "strata_park_spills_total"), 1);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        env.backend = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_kill9_restore_continue),
        cmocka_unit_test(test_more_conversations_than_slots),
        cmocka_unit_test(test_spill_past_ceiling_and_back),
        cmocka_unit_test(test_ram_ceiling_oldest_first),
        cmocka_unit_test(test_slots_delete_and_guard),
        cmocka_unit_test(test_concurrent_conversations),
        cmocka_unit_test(test_one_session_many_requests),
        cmocka_unit_test(test_park_taken_while_spilling),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
