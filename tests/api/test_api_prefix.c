/*
 * test_api_prefix.c - the prefix index of strata-server (issue 15 section 2; docs/SCALE.md, "The
 * prefix index"), on the real binary and its real store, for a model of each kind: strata-hybrid
 * and qwen35 (recurrent layers: points where the slot holds a checkpoint) and llama (K/V only:
 * points anywhere):
 * - a conversation reads a long system prompt and a question on node A (--prefix-index-mib);
 *   A is killed with SIGKILL and started again on its store; a new conversation with the same
 *   system prompt and another question resumes from the index (found "index", resumed at the
 *   root checkpoint of the system prompt, or at a multiple of --ubatch) and its tokens are those
 *   a server without the index gives for a full read of the same request;
 * - the negative controls: a system prompt that differs in its first byte finds nothing (found
 *   "new", nothing resumed); the reference's tokens for another question differ from the
 *   resumed answer's (the comparison can fail); without --prompt-cache-root the point is the
 *   deepest multiple of ubatch inside the system prompt;
 * - the budget: with room for one point, recording more evicts the least recently used (the
 *   store keeps at most that many "pfx:" sessions, /metrics counts the evictions), and the
 *   points never appear in GET /v1/sessions.
 * Label integration (in make test).
 */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "api/st_api_test.h"

static st_at_env g_env;

typedef struct model {
    const char *arch, *preset;
    char path[4200];
} model;
static model g_models[] = {
    {"strata-hybrid", "tiny", ""}, {"llama", "tiny-untied", ""}, {"qwen35", "qwen35-tiny", ""}};
#define N_MODELS (sizeof g_models / sizeof g_models[0])

#define N_PREDICT 10

static char g_sys[1200], g_sys_other[1200];

static void start(st_hc_server *s, const model *m, const char *store, const char *const *extra)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", g_env.dir, store);
    const char *args[40] = {"--store", path, "--model", m->path, "--threads", "1", "--backend", "cpu",
                            "--ubatch", "64", "--slots", "2"};
    int n = 12;
    for (const char *const *a = extra; a && *a; a++)
        args[n++] = *a;
    args[n] = NULL;
    assert_int_equal(st_hc_server_start(s, ST_AT_SERVER, g_env.dir, g_env.logpath, args), 0);
}

/* A greedy completion of a new session with system prompt sys and prompt q; the reply. */
static json_t *ask(uint16_t port, const char *session, const char *sys, const char *q)
{
    char body[4096];
    snprintf(body, sizeof body,
             "{\"session\":\"%s\",\"system\":\"%s\",\"prompt\":\"%s\",\"n_predict\":%d,"
             "\"temperature\":0,\"ignore_eos\":true}",
             session, sys, q, N_PREDICT);
    return st_at_call(port, "POST", "/v1/completions", body, 200);
}

/* The same through the OpenAI chat route (no session): the system message and a user message;
 * the reply's text, of N_PREDICT tokens. */
static char *chat(uint16_t port, const char *sys, const char *q)
{
    char body[4096];
    snprintf(body, sizeof body,
             "{\"messages\":[{\"role\":\"system\",\"content\":\"%s\"},{\"role\":\"user\","
             "\"content\":\"%s\"}],\"max_tokens\":%d,\"temperature\":0,\"ignore_eos\":true}",
             sys, q, N_PREDICT);
    json_t *o = st_at_call(port, "POST", "/v1/chat/completions", body, 200);
    json_t *msg = json_object_get(json_array_get(json_object_get(o, "choices"), 0), "message");
    char *text = strdup(json_string_value(json_object_get(msg, "content")));
    /* the texts compared are those of N_PREDICT generated tokens (not two empty answers) */
    assert_int_equal(json_integer_value(json_object_get(json_object_get(o, "usage"),
                                                        "completion_tokens")), N_PREDICT);
    json_decref(o);
    return text;
}

static const char *found(json_t *o) { return json_string_value(json_object_get(o, "found")); }
static json_int_t resumed(json_t *o)
{
    return json_integer_value(json_object_get(json_object_get(o, "timings"), "resumed_tokens"));
}
static int same(json_t *a, json_t *b)
{
    return json_equal(json_object_get(a, "tokens"), json_object_get(b, "tokens"));
}

static const char *const INDEX_ROOT[] = {"--prefix-index-mib", "256", "--prefix-min-tokens", "64",
                                         "--prompt-cache-root", "32", NULL};
static const char *const INDEX_PLAIN[] = {"--prefix-index-mib", "256", "--prefix-min-tokens", "64",
                                          NULL};
static const char *const PLAIN_ROOT[] = {"--prompt-cache-root", "32", NULL};

/* One model: index with root checkpoints (and, plain, without) against the reference. */
static void run_model(const model *m, const char *const *index_flags, const char *const *ref_flags,
                      const char *tag)
{
    char sa[64], sr[64];
    snprintf(sa, sizeof sa, "pfx-a-%s-%s", m->arch, tag);
    snprintf(sr, sizeof sr, "pfx-r-%s-%s", m->arch, tag);
    st_hc_server a, r;
    start(&r, m, sr, ref_flags);
    json_t *ref = ask(r.port, "ref", g_sys, "And the second question?");
    json_t *ref_other = ask(r.port, "ref2", g_sys, "Something else entirely, then.");
    char *chat_ref = chat(r.port, g_sys, "A chat question, the second.");
    assert_int_equal(st_hc_server_stop(&r, SIGTERM), 0);

    start(&a, m, sa, index_flags);
    json_t *first = ask(a.port, "first", g_sys, "The first question.");
    assert_string_equal(found(first), "new");
    json_decref(first);
    free(chat(a.port, g_sys, "A chat question, the first one."));
    /* the recorder puts the points in the background: once it is idle they are in the store */
    assert_int_equal(st_at_await_metric(a.port, "strata_prefix_record_queue", 0), 0);
    assert_true(st_at_metric(a.port, "strata_prefix_records_total") >= 1);
    (void)st_hc_server_stop(&a, SIGKILL); /* killed: the index is in the store */

    start(&a, m, sa, index_flags);
    json_t *again = ask(a.port, "second", g_sys, "And the second question?");
    printf("%s (%s): found %s, resumed %lld of %lld tokens\n", m->arch, tag, found(again),
           (long long)resumed(again),
           (long long)json_integer_value(json_object_get(again, "n_prompt_tokens")));
    assert_string_equal(found(again), "index");
    assert_true(resumed(again) >= 64);
    if (!same(again, ref))
        fail_msg("%s (%s): the resumed answer is not the full read's", m->arch, tag);
    /* negative control of the comparison: another question's full read differs */
    assert_false(same(again, ref_other));
    /* negative control of the lookup: a system prompt that differs in its first byte */
    json_t *miss = ask(a.port, "third", g_sys_other, "And the second question?");
    assert_string_equal(found(miss), "new");
    assert_int_equal(resumed(miss), 0);
    assert_true(st_at_metric(a.port, "strata_prefix_hits_total") == 1);
    /* the chat route: its system message's end is a point too (or a multiple of ubatch in it) */
    char *chat_b = chat(a.port, g_sys, "A chat question, the second.");
    assert_true(st_at_metric(a.port, "strata_prefix_hits_total") == 2);
    assert_string_equal(chat_b, chat_ref);
    free(chat_b);
    free(chat_ref);
    /* the points are not sessions */
    json_t *list = st_at_call(a.port, "GET", "/v1/sessions", NULL, 200);
    const char *dump = json_dumps(list, JSON_COMPACT);
    assert_null(strstr(dump, "pfx:"));
    free((void *)dump);
    json_decref(list);
    json_decref(miss);
    json_decref(again);
    json_decref(ref);
    json_decref(ref_other);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
}

static void test_resume_after_restart(void **state)
{
    (void)state;
    for (size_t i = 0; i < N_MODELS; i++) {
        run_model(&g_models[i], INDEX_ROOT, PLAIN_ROOT, "root");
        run_model(&g_models[i], INDEX_PLAIN, NULL, "plain");
    }
}

/* The budget: room for about one point; three system prompts recorded: the store keeps the
 * newest, the others were evicted (LRU), and the newest still resumes. */
static void test_budget(void **state)
{
    (void)state;
    const model *m = &g_models[1]; /* llama: a point's bytes are its K/V rows */
    st_hc_server a;
    const char *const flags[] = {"--prefix-index-mib", "256", "--prefix-min-tokens", "64",
                                 "--prefix-max-entries", "2", NULL};
    start(&a, m, "pfx-budget", flags);
    char sys[1200];
    for (int k = 0; k < 3; k++) {
        snprintf(sys, sizeof sys, "%c%s", 'A' + k, g_sys + 1);
        char id[32];
        snprintf(id, sizeof id, "b%d", k);
        json_decref(ask(a.port, id, sys, "The first question."));
        /* one at a time: the LRU order is that of the records */
        assert_int_equal(st_at_await_metric(a.port, "strata_prefix_record_queue", 0), 0);
    }
    double entries = st_at_metric(a.port, "strata_prefix_entries");
    printf("budget: %g points kept, %g evicted\n", entries,
           st_at_metric(a.port, "strata_prefix_evictions_total"));
    assert_true(entries <= 2);
    assert_true(st_at_metric(a.port, "strata_prefix_evictions_total") >= 1);
    /* the newest system prompt resumes; the oldest was evicted */
    snprintf(sys, sizeof sys, "%c%s", 'A' + 2, g_sys + 1);
    json_t *o = ask(a.port, "c2", sys, "Another question.");
    assert_string_equal(found(o), "index");
    json_decref(o);
    snprintf(sys, sizeof sys, "%c%s", 'A', g_sys + 1);
    o = ask(a.port, "c0", sys, "Another question.");
    assert_string_equal(found(o), "new");
    json_decref(o);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
}

static int setup(void **state)
{
    (void)state;
    if (st_at_setup(&g_env, "api_prefix"))
        return -1;
    /* a system prompt of about 300 tokens (bytes for the byte tokenizer) */
    size_t k = 0;
    const char *words = "You are a careful assistant of the Strata project. Answer briefly. ";
    while (k + strlen(words) < 300)
        k += (size_t)snprintf(g_sys + k, sizeof g_sys - k, "%s", words);
    snprintf(g_sys_other, sizeof g_sys_other, "%s", g_sys);
    g_sys_other[0] = 'W';
    char out[4096];
    for (size_t i = 0; i < N_MODELS; i++) {
        snprintf(g_models[i].path, sizeof g_models[i].path, "%s/%s.gguf", g_env.dir,
                 g_models[i].arch);
        if (st_test_run(out, sizeof out, ST_AT_MKMODEL " --arch %s --preset %s -o '%s'",
                        g_models[i].arch, g_models[i].preset, g_models[i].path))
            return -1;
    }
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&g_env);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_after_restart),
        cmocka_unit_test(test_budget),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
