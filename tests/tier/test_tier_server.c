/*
 * test_tier_server.c - strata-server nodes sharing conversations through a real Redis Cluster
 * (issue 15, section 3): 3 masters and 3 replicas of Debian's redis-server and two (three)
 * strata-server processes on loopback, each with its own store, on the tiny model:
 * - a conversation saved on A continues on B with the tokens of the uninterrupted run on A (the
 *   completion says it was found in the tier); the control: a conversation B never got from
 *   the tier starts anew and continues otherwise;
 * - B saves it next (tier version 2); A, whose copy is older, SAVEs and is refused (409
 *   conflict: B held it since) and drops its copy; A's next completion continues from B's
 *   version, with the tokens a third node C gives from the tier;
 * - a SAVE (or PARK) of a copy another node continued since without saving is refused too, and
 *   that node goes on from its own turn (control: the same calls with every turn on A succeed);
 * - the lease: while a completion runs on A, B's request for that conversation is refused (409
 *   busy, naming node-a), and A releases the lease when it ends;
 * - A killed with SIGKILL after an acknowledged SAVE and one more turn: B continues from the
 *   SAVE with the tokens A gave for that lost turn;
 * - the whole cluster stopped (SIGSTOP to every server): a SAVE answers from the local store,
 *   once the tier's client gives up (about 2.5 s: its retry budget), with "tier": "pending",
 *   counted in /metrics; once the cluster runs again (SIGCONT) the
 *   queue sends it, and B continues the conversation from it.
 * - the cluster changing under SAVEs (test_cluster_changes): 1,000 slots resharded while A
 *   saves (no request fails, every SAVE "sent"), then a master killed with SIGKILL and started
 *   again as a replica: no request fails, the SAVEs made meanwhile answer "pending" and reach
 *   the tier, and every conversation's last acknowledged SAVE restores on B.
 * - a lease lost during a request (test_lost_lease): A stopped while it holds a conversation's
 *   lease, B takes it over and SAVEs; A's renewal is refused, its live copy dropped when its
 *   request ends, and its next completion continues from B's SAVE;
 * - the prefix index across nodes (test_prefix_across_nodes): a new chat on B sharing a long
 *   system prompt first read on A resumes from A's point through the tier, with a full read's
 *   tokens; B restarted resumes from its own store; another system prompt finds nothing.
 * - PARK into the tier (test_park_across_nodes): a conversation A parked at its RAM ceiling
 *   continues on B after A is killed, with an uninterrupted run's tokens; A restarted drops its
 *   own park, older than B's turn (the handover), and keeps one no other node touched.
 * - a RAM park another node continued before it was spilled (test_stale_spill): dropped at the
 *   spill, not written; the control spilled and continued from the store.
 * Labels cluster and integration (in make test).
 */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "api/st_api_test.h"
#include "redis_cluster.h"

static st_at_env g_env;
static rc_cluster g_rc;
static char g_url[512];

#define N_PREDICT 12

static void node_start(st_hc_server *s, const char *store, const char *id)
{
    const char *flags[] = {"--tier", g_url, "--node-id", id, "--slots", "2", NULL};
    assert_int_equal(st_at_server_start(s, &g_env, store, flags, NULL), 0);
}

static json_t *turn(uint16_t port, const char *id, const char *prompt, const char *found)
{
    json_t *o = st_at_complete(port, id, prompt, N_PREDICT, true);
    if (found) {
        const char *f = json_string_value(json_object_get(o, "found"));
        if (!f || strcmp(f, found))
            fail_msg("%s: the conversation was found in \"%s\", wanted \"%s\"", id, f ? f : "?",
                     found);
    }
    return o;
}

static int same(json_t *a, json_t *b)
{
    return json_equal(json_object_get(a, "tokens"), json_object_get(b, "tokens"));
}

static json_t *save(uint16_t port, const char *id, const char *tier)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
    json_t *o = st_at_call(port, "POST", path, "{}", 201);
    const char *t = json_string_value(json_object_get(o, "tier"));
    if (t && !strcmp(tier, "sent") && !strcmp(t, "pending")) {
        /* a loaded machine (the test builds run two suites at once): the tier's client timed
         * out and queued it; what is checked is that it reaches the tier */
        assert_int_equal(st_at_await_metric(port, "strata_tier_pending", 0), 0);
        return o;
    }
    if (!t || strcmp(t, tier))
        fail_msg("SAVE %s: tier \"%s\", wanted \"%s\"", id, t ? t : "(none)", tier);
    return o;
}

/* A SAVE the node must refuse (409 conflict): its copy is older than another node's. */
static json_t *save_refused(uint16_t port, const char *id)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
    json_t *o = st_at_call(port, "POST", path, "{}", 409);
    const char *code = json_string_value(json_object_get(json_object_get(o, "error"), "code"));
    assert_non_null(code);
    assert_string_equal(code, "conflict");
    return o;
}

static void test_across_nodes(void **state)
{
    (void)state;
    st_hc_server a, b, c;
    node_start(&a, "store-a", "node-a");
    node_start(&b, "store-b", "node-b");
    /* the uninterrupted run, on A */
    json_t *r1 = turn(a.port, "ref", "The first turn of it", "new");
    json_t *r2 = turn(a.port, "ref", " and the second turn", "slot");
    /* s: its first turn on A, saved; its second on B */
    json_t *s1 = turn(a.port, "s", "The first turn of it", "new");
    assert_true(same(s1, r1));
    json_t *sv = save(a.port, "s", "sent");
    if (!strcmp(json_string_value(json_object_get(sv, "tier")), "sent"))
        assert_int_equal(json_integer_value(json_object_get(sv, "tier_version")), 1);
    json_t *s2 = turn(b.port, "s", " and the second turn", "tier");
    if (!same(s2, r2)) {
        char *x = json_dumps(json_object_get(s2, "tokens"), JSON_COMPACT);
        char *y = json_dumps(json_object_get(r2, "tokens"), JSON_COMPACT);
        fail_msg("B continued s with %s, the uninterrupted run with %s", x, y);
    }
    printf("across: s saved on A, continued on B with the uninterrupted run's %d tokens\n",
           N_PREDICT);
    /* the control: a conversation B cannot find starts anew, and its turn differs */
    json_t *n2 = turn(b.port, "never-saved", " and the second turn", "new");
    assert_false(same(n2, r2));
    /* B saves s next; A's copy is older: its SAVE is refused (B held it since), the copy dropped */
    json_decref(save(b.port, "s", "sent"));
    json_t *sa = save_refused(a.port, "s");
    printf("across: the stale node's SAVE: 409 %s\n",
           json_string_value(json_object_get(json_object_get(sa, "error"), "message")));
    assert_true(st_at_metric(a.port, "strata_stale_refused_total") == 1);
    /* A's next request finds the tier's head newer than its copy: it drops the copy and
     * continues from B's version, as a third node does */
    /* a third node continues from B's version (the tier's head), not A's */
    json_t *a3 = turn(a.port, "s", " then a third", "tier");
    node_start(&c, "store-c", "node-c");
    json_t *c3 = turn(c.port, "s", " then a third", "tier");
    assert_true(same(c3, a3));
    printf("across: A dropped its stale copy and continued from B's version, as node C did\n");
    assert_int_equal(st_hc_server_stop(&c, SIGTERM), 0);
    /* u: saved on A, continued on B without a SAVE; A's SAVE of its older copy is refused (it
     * would have put that copy over B's turn), and B goes on from its own slot, not from A's */
    json_t *u1 = turn(a.port, "u", "The first turn of it", "new");
    json_decref(save(a.port, "u", "sent"));
    json_t *u2 = turn(b.port, "u", " and the second turn", "tier");
    assert_true(same(u2, r2));
    json_t *ua = save_refused(a.port, "u");
    assert_true(st_at_metric(a.port, "strata_stale_refused_total") == 2);
    json_decref(turn(b.port, "u", " then a third", "slot"));
    json_t *ub = save(b.port, "u", "sent");
    if (!strcmp(json_string_value(json_object_get(ub, "tier")), "sent"))
        assert_int_equal(json_integer_value(json_object_get(ub, "tier_version")), 2);
    /* a PARK too: w continued on B unsaved, A's PARK of its older copy is refused */
    json_decref(turn(a.port, "w", "The first turn of it", "new"));
    json_decref(save(a.port, "w", "sent"));
    json_decref(turn(b.port, "w", " and the second turn", "tier"));
    json_t *wa = st_at_call(a.port, "POST", "/v1/sessions/w/park", "{}", 409);
    assert_string_equal(json_string_value(json_object_get(json_object_get(wa, "error"), "code")),
                        "conflict");
    json_decref(wa);
    assert_true(st_at_metric(a.port, "strata_stale_refused_total") == 3);
    /* the control: the same SAVEs (and a PARK) with the second turn on A itself are accepted */
    json_decref(turn(a.port, "v", "The first turn of it", "new"));
    json_decref(save(a.port, "v", "sent"));
    json_decref(turn(a.port, "v", " and the second turn", "slot"));
    json_decref(save(a.port, "v", "sent"));
    json_decref(st_at_call(a.port, "POST", "/v1/sessions/v/park", "{}", 200));
    assert_true(st_at_metric(a.port, "strata_stale_refused_total") == 3);
    printf("across: A's SAVE of u and PARK of w after B continued them unsaved: refused; v (no "
           "other node): saved and parked\n");
    json_decref(u1);
    json_decref(u2);
    json_decref(ua);
    json_decref(ub);
    /* the lease: while a completion runs on A, B is refused the conversation (409, naming A) */
    st_at_bg bg;
    st_at_bg_completion(&bg, a.port, "long", "A long completion", 1500, true);
    while (st_at_metric(a.port, "strata_tier_leases_held") < 1)
        usleep(1000);
    char body[512];
    st_at_completion_body(body, sizeof body, "long", "meanwhile", 4, true);
    st_hc_resp rr;
    assert_int_equal(st_hc_json(b.port, "POST", "/v1/completions", body, &rr), 0);
    int refused = rr.status;
    printf("lease: B's request while A works on it: %d %.160s\n", rr.status,
           rr.body ? (const char *)rr.body : "");
    st_hc_resp_free(&rr);
    json_decref(st_at_bg_join(&bg, 200));
    assert_int_equal(refused, 409);
    assert_true(st_at_metric(b.port, "strata_tier_leases_refused_total") >= 1);
    assert_true(st_at_metric(a.port, "strata_tier_leases_held") == 0); /* released at its end */
    json_decref(r1);
    json_decref(r2);
    json_decref(s1);
    json_decref(s2);
    json_decref(sv);
    json_decref(n2);
    json_decref(sa);
    json_decref(a3);
    json_decref(c3);

    /* A killed after an acknowledged SAVE and one more (unsaved) turn */
    json_decref(turn(a.port, "k", "Killed after this", "new"));
    json_decref(save(a.port, "k", "sent"));
    json_t *lost = turn(a.port, "k", " and this turn is lost", "slot");
    assert_int_equal(st_hc_server_stop(&a, SIGKILL), -1);
    json_t *kb = turn(b.port, "k", " and this turn is lost", "tier");
    assert_true(same(kb, lost));
    printf("kill -9: B continued k from A's last acknowledged SAVE (the lost turn's tokens)\n");
    json_decref(lost);
    json_decref(kb);

    /* the whole cluster stopped: SAVE answers from the local store, "pending" */
    node_start(&a, "store-a", "node-a");
    json_t *p1 = turn(a.port, "p", "Saved while the tier is away", "new");
    json_t *p2 = turn(a.port, "p", " and continued", "slot");
    /* the reference for p's second turn is p2; start p again on A under another id */
    json_decref(turn(a.port, "q", "Saved while the tier is away", "new"));
    for (int i = 0; i < g_rc.n; i++)
        kill(g_rc.pid[i], SIGSTOP);
    double t0 = st_hc_now_ms();
    json_t *pq = save(a.port, "q", "pending");
    double ms = st_hc_now_ms() - t0;
    printf("cluster stopped: SAVE answered \"pending\" in %.0f ms\n", ms);
    assert_true(st_at_metric(a.port, "strata_tier_pending") == 1);
    assert_true(st_at_metric(a.port, "strata_tier_up") == 0);
    for (int i = 0; i < g_rc.n; i++)
        kill(g_rc.pid[i], SIGCONT);
    assert_int_equal(st_at_await_metric(a.port, "strata_tier_pending", 0), 0);
    assert_true(st_at_metric(a.port, "strata_tier_sent_from_queue_total") >= 1);
    /* the SAVE's lease take got no reply while the cluster was stopped; the server ran it
     * later: A released it under its token before sending the queue, or B would be refused */
    assert_true(st_at_metric(a.port, "strata_tier_lease_orphans") == 0);
    json_t *qb = turn(b.port, "q", " and continued", "tier");
    assert_true(same(qb, p2));
    printf("cluster back: the queued SAVE reached the tier, B continued q as p continued\n");
    json_decref(p1);
    json_decref(p2);
    json_decref(pq);
    json_decref(qb);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

/* ---- the cluster changing under SAVEs ------------------------------------------------------ */
#define N_CONV 8

typedef struct saver {
    uint16_t port;
    atomic_int stop;
    int cycles, failed, sent, pending, other;
    int64_t tokens[N_CONV]; /* the tokens of each conversation's last acknowledged SAVE */
    char why[512];
} saver;

/* One turn and a SAVE of conversation r<i % N_CONV>, over and over: every reply must be 200 /
 * 201; the SAVE's tier outcome is counted. */
static void *saver_main(void *arg)
{
    saver *sv = arg;
    for (int i = 0; !atomic_load(&sv->stop); i++) {
        char id[16], body[512], path[64];
        snprintf(id, sizeof id, "r%d", i % N_CONV);
        st_at_completion_body(body, sizeof body, id, " more", 2, true);
        st_hc_resp r;
        if (st_hc_json(sv->port, "POST", "/v1/completions", body, &r) || r.status != 200) {
            sv->failed++;
            snprintf(sv->why, sizeof sv->why, "completion %s: %d %.300s", id, r.status,
                     r.body ? (const char *)r.body : "");
            st_hc_resp_free(&r);
            continue;
        }
        st_hc_resp_free(&r);
        snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
        if (st_hc_json(sv->port, "POST", path, "{}", &r) || r.status != 201) {
            sv->failed++;
            snprintf(sv->why, sizeof sv->why, "SAVE %s: %d %.300s", id, r.status,
                     r.body ? (const char *)r.body : "");
            st_hc_resp_free(&r);
            continue;
        }
        json_t *o = st_at_parse(&r);
        st_hc_resp_free(&r);
        const char *t = o ? json_string_value(json_object_get(o, "tier")) : NULL;
        if (t && !strcmp(t, "sent"))
            sv->sent++;
        else if (t && !strcmp(t, "pending"))
            sv->pending++;
        else
            sv->other++;
        if (o)
            sv->tokens[i % N_CONV] = json_integer_value(json_object_get(o, "tokens"));
        json_decref(o);
        sv->cycles++;
    }
    return NULL;
}

/* 1,000 slots resharded while node A saves, then a master killed with SIGKILL (its replica
 * promoted) and started again (it rejoins as the new master's replica): no request fails; the
 * SAVEs during the reshard all reach the tier at once; those that could not during the failover
 * answer "pending" and reach it once the cluster has a replica for every master again; then every
 * conversation's last acknowledged SAVE continues on node B (the tokens it had). */
static void test_cluster_changes(void **state)
{
    (void)state;
    st_hc_server a, b;
    node_start(&a, "store-a2", "node-a2");
    node_start(&b, "store-b2", "node-b2");
    saver sv;
    memset(&sv, 0, sizeof sv);
    sv.port = a.port;
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, saver_main, &sv), 0);
    usleep(300000);
    int src = rc_master_of(&g_rc, 0), dst = rc_master_of(&g_rc, 16383);
    assert_true(src >= 0 && dst >= 0 && src != dst);
    char sid[64], did[64], out[8192];
    assert_int_equal(rc_node_id(&g_rc, src, sid), 0);
    assert_int_equal(rc_node_id(&g_rc, dst, did), 0);
    int before = sv.cycles;
    double t0 = st_hc_now_ms();
    int rrc = st_test_run(out, sizeof out, "redis-cli --cluster reshard 127.0.0.1:%d --cluster-from "
                          "%s --cluster-to %s --cluster-slots 1000 --cluster-yes", g_rc.port[src],
                          sid, did);
    double ms = st_hc_now_ms() - t0;
    if (rrc)
        fail_msg("reshard: %s", out);
    int during = sv.cycles - before, pend_reshard = sv.pending;
    printf("reshard: 1,000 slots moved in %.0f ms while A made %d turns and SAVEs (%d failed, %d "
           "pending)\n", ms, during, sv.failed, sv.pending);
    /* a master killed during SAVEs */
    int victim = rc_master_of(&g_rc, 8000);
    assert_true(victim >= 0);
    rc_kill(&g_rc, victim);
    usleep(4000000);
    g_rc.pid[victim] = rc_spawn_server(&g_rc, g_rc.port[victim], 1); /* back, as a replica */
    assert_true(g_rc.pid[victim] > 0);
    usleep(1500000);
    atomic_store(&sv.stop, 1);
    pthread_join(th, NULL);
    printf("failover: %d turns and SAVEs in all, %d failed, tier: %d sent, %d pending, %d other%s%s\n",
           sv.cycles, sv.failed, sv.sent, sv.pending, sv.other, sv.failed ? ": " : "", sv.why);
    assert_int_equal(sv.failed, 0);
    assert_int_equal(sv.other, 0);
    assert_int_equal(pend_reshard, 0);
    assert_true(during > 0);
    /* the queue drains once every master has a replica again */
    for (int i = 0; i < 600 && st_at_metric(a.port, "strata_tier_pending") != 0; i++)
        usleep(100000);
    assert_true(st_at_metric(a.port, "strata_tier_pending") == 0);
    int restored = 0;
    for (int i = 0; i < N_CONV; i++) {
        if (!sv.tokens[i])
            continue;
        char path[64];
        snprintf(path, sizeof path, "/v1/sessions/r%d/restore", i);
        json_t *o = st_at_call(b.port, "POST", path, "{}", 200);
        int64_t got = json_integer_value(json_object_get(o, "tokens"));
        if (got != sv.tokens[i])
            fail_msg("r%d: B restored %lld tokens, A's last acknowledged SAVE had %lld", i,
                     (long long)got, (long long)sv.tokens[i]);
        json_decref(o);
        restored++;
    }
    printf("failover: all %d conversations' last acknowledged SAVEs restored on B\n", restored);
    assert_true(restored > 0);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

/* A lease lost during a request: A is stopped (SIGSTOP) while a completion holds the lease of
 * "lost"; the lease expires, B takes the conversation, continues and SAVEs it; once A runs again
 * its renewal is refused, the lease counted lost, and when A's request ends its live copy is
 * dropped: A's next completion of "lost" continues from B's SAVE (found "tier"), not from the
 * copy it held. The control: without the stop, A's next completion finds its slot; with the
 * stop but no other node taking it, A keeps its copy too (the lease expired, nothing was lost). */
static void test_lost_lease(void **state)
{
    (void)state;
    st_hc_server a, b;
    const char *fa[] = {"--tier", g_url, "--node-id", "node-la", "--slots", "2", "--tier-lease-ms",
                        "300", NULL};
    const char *fb[] = {"--tier", g_url, "--node-id", "node-lb", "--slots", "2", "--tier-lease-ms",
                        "300", NULL};
    assert_int_equal(st_at_server_start(&a, &g_env, "store-lost-a", fa, NULL), 0);
    assert_int_equal(st_at_server_start(&b, &g_env, "store-lost-b", fb, NULL), 0);
    /* the control: a conversation A keeps stays in its slot */
    json_decref(turn(a.port, "kept", "Kept on A", "new"));
    json_decref(turn(a.port, "kept", " and again", "slot"));
    st_at_bg bg;
    /* the same pause with no other node taking the conversation: the lease expired but the
     * holder record still names A, so nothing was lost: A keeps its copy ("slot", the tokens of
     * the same turns without the pause) and its lease is taken again */
    json_decref(st_at_complete(a.port, "expref", "A long completion on A", 1500, true));
    json_t *er = turn(a.port, "expref", " and A again", "slot");
    st_at_bg_completion(&bg, a.port, "exp", "A long completion on A", 1500, true);
    for (int i = 0; st_at_metric(a.port, "strata_tier_leases_held") < 1; i++) {
        if (i > 20000 || bg.done)
            fail_msg("A's completion did not hold the lease");
        usleep(1000);
    }
    kill(a.pid, SIGSTOP);
    usleep(900 * 1000);
    kill(a.pid, SIGCONT);
    json_decref(st_at_bg_join(&bg, 200));
    assert_true(st_at_metric(a.port, "strata_tier_leases_lost_total") == 0);
    json_t *e2 = turn(a.port, "exp", " and A again", "slot");
    assert_true(same(e2, er));
    printf("expired lease nobody took: A kept its copy (%.0f taken again by the renewal)\n",
           st_at_metric(a.port, "strata_tier_leases_retaken_total"));
    json_decref(er);
    json_decref(e2);
    st_at_bg_completion(&bg, a.port, "lost", "A long completion on A", 1500, true);
    for (int i = 0; st_at_metric(a.port, "strata_tier_leases_held") < 1; i++) {
        if (i > 20000 || bg.done)
            fail_msg("A's completion did not hold the lease");
        usleep(1000);
    }
    kill(a.pid, SIGSTOP);
    usleep(900 * 1000); /* three times the lease's TTL */
    json_decref(turn(b.port, "lost", "B takes it over", "new"));
    json_decref(save(b.port, "lost", "sent"));
    kill(a.pid, SIGCONT);
    json_decref(st_at_bg_join(&bg, 200));
    assert_true(st_at_metric(a.port, "strata_tier_leases_lost_total") >= 1);
    json_t *o = turn(a.port, "lost", " and A again", "tier");
    printf("lost lease: A's renewal refused, its copy dropped; its next completion came from "
           "B's SAVE\n");
    json_decref(o);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

/* The prefix index across nodes (section 2): a long system prompt first read on A; a new chat on
 * B with that system prompt and another question resumes from A's point, fetched from the tier
 * (found "index", counted as a tier hit), with the tokens of a full read on a node without the
 * index; B restarted (SIGKILL) resumes from it again, now from its own store. The negative
 * control: another system prompt finds nothing. */
static void ask_body(char *body, size_t cap, const char *session, const char *sys, const char *q)
{
    snprintf(body, cap,
             "{\"session\":\"%s\",\"system\":\"%s\",\"prompt\":\"%s\",\"n_predict\":%d,"
             "\"temperature\":0,\"ignore_eos\":true}",
             session, sys, q, N_PREDICT);
}

static json_t *ask(uint16_t port, const char *session, const char *sys, const char *q,
                   const char *want_found)
{
    char body[4096];
    ask_body(body, sizeof body, session, sys, q);
    json_t *o = st_at_call(port, "POST", "/v1/completions", body, 200);
    const char *f = json_string_value(json_object_get(o, "found"));
    if (!f || strcmp(f, want_found))
        fail_msg("%s: found \"%s\", wanted \"%s\"", session, f ? f : "?", want_found);
    return o;
}

static void test_prefix_across_nodes(void **state)
{
    (void)state;
    char sys[600], other[600];
    size_t k = 0;
    while (k < 400)
        k += (size_t)snprintf(sys + k, sizeof sys - k, "%s", "Shared system prompt of the fleet. ");
    snprintf(other, sizeof other, "%s", sys);
    other[0] = 'Z';
    const char *q = "A question asked on node B.";
    /* the reference: a full read on a node without the index (and without the tier) */
    st_hc_server r, a, b;
    const char *ref_flags[] = {"--slots", "2", "--ubatch", "64", "--prompt-cache-root", "32", NULL};
    assert_int_equal(st_at_server_start(&r, &g_env, "store-pfx-ref", ref_flags, NULL), 0);
    json_t *ref = ask(r.port, "ref", sys, q, "new");
    assert_int_equal(st_hc_server_stop(&r, SIGTERM), 0);
    const char *flags[] = {"--tier", g_url, "--node-id", "node-a", "--slots", "2", "--ubatch", "64",
                           "--prompt-cache-root", "32", "--prefix-index-mib", "64",
                           "--prefix-min-tokens", "64", NULL};
    assert_int_equal(st_at_server_start(&a, &g_env, "store-pfx-a", flags, NULL), 0);
    flags[3] = "node-b";
    assert_int_equal(st_at_server_start(&b, &g_env, "store-pfx-b", flags, NULL), 0);
    json_decref(ask(a.port, "on-a", sys, "The question asked on A.", "new"));
    assert_int_equal(st_at_await_metric(a.port, "strata_prefix_record_queue", 0), 0);
    assert_true(st_at_metric(a.port, "strata_prefix_records_total") >= 1);
    json_t *o = ask(b.port, "on-b", sys, q, "index");
    json_int_t res = json_integer_value(json_object_get(json_object_get(o, "timings"), "resumed_tokens"));
    printf("prefix across nodes: B resumed %lld tokens from A's point\n", (long long)res);
    assert_true(res >= 64);
    assert_true(st_at_metric(b.port, "strata_prefix_tier_hits_total") == 1);
    assert_true(same(o, ref));
    json_decref(o);
    json_decref(ask(b.port, "on-b-other", other, q, "new"));
    /* B restarted: the point is in its store now */
    (void)st_hc_server_stop(&b, SIGKILL);
    assert_int_equal(st_at_server_start(&b, &g_env, "store-pfx-b", flags, NULL), 0);
    o = ask(b.port, "on-b-again", sys, q, "index");
    assert_true(same(o, ref));
    assert_true(st_at_metric(b.port, "strata_prefix_tier_hits_total") == 0);
    json_decref(o);
    json_decref(ref);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

/* PARK at the RAM ceiling goes to the tier too (docs/SCALE.md): A (--conversation-cache-mib 0:
 * every park spills) parks "pk" after an unsaved turn, continues it from its own park (no
 * handover), parks it again, and is killed with SIGKILL; B continues pk from A's park in the tier
 * (found "tier") with the tokens of an uninterrupted run on a node without the tier. The
 * negative control: "pc", the same turns on A but held in its slot when A died, continues on B
 * from its SAVE, and its tokens differ. The handover: A restarted finds its own disk park of pk
 * in its store, but B held pk since: A drops that older copy and continues from the SAVE (the
 * tokens B gave pc), not from its park (the tokens B gave pk). With no other node between, A
 * restarted continues its own park (kept over SIGTERM, or spilled before SIGKILL). */
static void test_park_across_nodes(void **state)
{
    (void)state;
    static const char *turns[] = {"Parked on node A", " and a turn nobody saved",
                                  " and one more there", " then on node B"};
    st_hc_server r, a, b;
    const char *rflags[] = {"--slots", "2", NULL};
    assert_int_equal(st_at_server_start(&r, &g_env, "store-park-ref", rflags, NULL), 0);
    json_t *ref[4];
    for (int i = 0; i < 4; i++)
        ref[i] = turn(r.port, "pk", turns[i], i ? "slot" : "new");
    assert_int_equal(st_hc_server_stop(&r, SIGTERM), 0);
    const char *fa[] = {"--tier", g_url, "--node-id", "node-pa", "--slots", "2",
                        "--conversation-cache-mib", "0", NULL};
    const char *fb[] = {"--tier", g_url, "--node-id", "node-pb", "--slots", "2", NULL};
    assert_int_equal(st_at_server_start(&a, &g_env, "store-park-a", fa, NULL), 0);
    assert_int_equal(st_at_server_start(&b, &g_env, "store-park-b", fb, NULL), 0);
    const char *ids[] = {"pk", "pc"};
    for (int k = 0; k < 2; k++) {
        json_t *o = turn(a.port, ids[k], turns[0], "new");
        assert_true(same(o, ref[0]));
        json_decref(o);
        json_decref(save(a.port, ids[k], "sent"));
        json_decref(turn(a.port, ids[k], turns[1], "slot"));
    }
    json_t *pk = st_at_call(a.port, "POST", "/v1/sessions/pk/park", "{}", 200);
    assert_string_equal(json_string_value(json_object_get(pk, "where")), "disk");
    json_decref(pk);
    assert_true(st_at_metric(a.port, "strata_tier_park_pushes_total") == 1);
    json_t *o = turn(a.port, "pk", turns[2], "disk"); /* its own park: no handover */
    assert_true(same(o, ref[2]));
    json_decref(o);
    assert_true(st_at_metric(a.port, "strata_tier_handovers_total") == 0);
    json_decref(st_at_call(a.port, "POST", "/v1/sessions/pk/park", "{}", 200));
    assert_true(st_at_metric(a.port, "strata_tier_park_pushes_total") == 2);
    assert_int_equal(st_hc_server_stop(&a, SIGKILL), -1);
    json_t *bk = turn(b.port, "pk", turns[3], "tier");
    if (!same(bk, ref[3]))
        fail_msg("B did not continue pk from A's park with the uninterrupted run's tokens");
    assert_true(st_at_metric(b.port, "strata_tier_park_pulls_total") == 1);
    assert_true(st_at_metric(b.port, "strata_tier_handovers_total") == 1);
    json_t *bc = turn(b.port, "pc", turns[3], "tier");
    assert_true(st_at_metric(b.port, "strata_tier_park_pulls_total") == 1);
    assert_false(same(bc, ref[3])); /* the negative control: from its SAVE, without turn 2 */
    printf("park across nodes: A killed; B continued A's park from the tier with the "
           "uninterrupted run's %d tokens; the conversation A held in its slot continued from "
           "its SAVE (other tokens)\n", N_PREDICT);
    /* A restarted: its disk park of pk is older than B's turn: dropped, continued from the SAVE */
    assert_int_equal(st_at_server_start(&a, &g_env, "store-park-a", fa, NULL), 0);
    json_t *ak = turn(a.port, "pk", turns[3], "tier");
    assert_true(same(ak, bc));
    assert_false(same(ak, bk));
    assert_true(st_at_metric(a.port, "strata_tier_handovers_total") == 1);
    printf("park across nodes: A restarted dropped its own older park of pk (B held it since) "
           "and continued from the SAVE\n");
    /* no other node between: A's own park, kept over a graceful stop (pr) or spilled into its
     * store and the tier before a SIGKILL (ps), is the newest state and continues after the
     * restart, though the restarted A knows no tier version of it (st_tiernode.c invariant 7) */
    for (int k = 0; k < 2; k++) {
        const char *id = k ? "ps" : "pr";
        json_decref(turn(a.port, id, turns[0], "new"));
        json_decref(save(a.port, id, "sent"));
        json_decref(turn(a.port, id, turns[1], "slot"));
        if (k)
            json_decref(st_at_call(a.port, "POST", "/v1/sessions/ps/park", "{}", 200));
        assert_int_equal(st_hc_server_stop(&a, k ? SIGKILL : SIGTERM), k ? -1 : 0);
        assert_int_equal(st_at_server_start(&a, &g_env, "store-park-a", fa, NULL), 0);
        json_t *ar = turn(a.port, id, turns[2], "disk");
        if (!same(ar, ref[2]))
            fail_msg("%s: A restarted did not continue its own park", id);
        json_decref(ar);
        assert_true(st_at_metric(a.port, "strata_tier_adopted_total") == 1);
        assert_true(st_at_metric(a.port, "strata_tier_handovers_total") == 0);
    }
    printf("park across nodes: A restarted (SIGTERM, SIGKILL) continued its own parks with the "
           "uninterrupted run's tokens\n");
    json_decref(ak);
    json_decref(bk);
    json_decref(bc);
    for (int i = 0; i < 4; i++)
        json_decref(ref[i]);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

/* A RAM park that turned stale before its spill (api/st_conv.c invariant 11): A parks "x" in RAM
 * (its pool of 1 MiB has room), B continues x without saving, then A parks other conversations
 * until the pool is over its ceiling: the spill of x, the oldest, finds that B held it since,
 * writes nothing and drops the entry (strata_park_dropped_stale_total); A's next turn of x comes
 * from the SAVE (found "tier"), not from its park. The control: "y", parked the same way and
 * touched by no other node, is spilled to A's store and continues from there ("disk"). */
static void test_stale_spill(void **state)
{
    (void)state;
    st_hc_server a, b;
    const char *fa[] = {"--tier", g_url, "--node-id", "node-sa", "--slots", "2",
                        "--conversation-cache-mib", "1", NULL};
    const char *fb[] = {"--tier", g_url, "--node-id", "node-sb", "--slots", "2", NULL};
    assert_int_equal(st_at_server_start(&a, &g_env, "store-stale-a", fa, NULL), 0);
    assert_int_equal(st_at_server_start(&b, &g_env, "store-stale-b", fb, NULL), 0);
    const char *ids[] = {"x", "y"};
    for (int k = 0; k < 2; k++) {
        json_decref(turn(a.port, ids[k], "Parked in RAM on A", "new"));
        json_decref(save(a.port, ids[k], "sent"));
        json_decref(turn(a.port, ids[k], " and a turn nobody saved", "slot"));
    }
    json_t *px = st_at_call(a.port, "POST", "/v1/sessions/x/park", "{}", 200);
    assert_string_equal(json_string_value(json_object_get(px, "where")), "ram");
    json_decref(px);
    json_decref(st_at_call(a.port, "POST", "/v1/sessions/y/park", "{}", 200));
    json_decref(turn(b.port, "x", " then on node B", "tier"));
    int i = 0;
    for (; i < 64 && st_at_metric(a.port, "strata_park_spills_total") < 1; i++) {
        char id[32], path[64];
        snprintf(id, sizeof id, "fill-%d", i);
        json_decref(turn(a.port, id, "Filling the pool", "new"));
        snprintf(path, sizeof path, "/v1/sessions/%s/park", id);
        json_decref(st_at_call(a.port, "POST", path, "{}", 200));
    }
    assert_true(st_at_metric(a.port, "strata_park_dropped_stale_total") == 1);
    assert_true(st_at_metric(a.port, "strata_park_spills_total") >= 1); /* y's */
    json_t *ax = turn(a.port, "x", " then on node B", "tier");
    json_t *ay = turn(a.port, "y", " then on node B", "disk");
    assert_false(same(ax, ay)); /* x continued from its SAVE, y from its park */
    printf("stale spill: after %d more parks A's pool spilled: x (B held it since) dropped, y "
           "spilled and continued from A's store\n", i);
    json_decref(ax);
    json_decref(ay);
    assert_int_equal(st_hc_server_stop(&a, SIGTERM), 0);
    assert_int_equal(st_hc_server_stop(&b, SIGTERM), 0);
}

static int setup(void **state)
{
    (void)state;
    if (st_at_setup(&g_env, "tier_server"))
        return -1;
    char dir[1000];
    snprintf(dir, sizeof dir, "%.900s/cluster", g_env.dir); /* rc_cluster keeps 1024 bytes */
    if (rc_start(&g_rc, dir, 6, 1, 1))
        return -1;
    rc_url(&g_rc, 2, g_url, sizeof g_url);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    for (int i = 0; i < g_rc.n; i++)
        if (g_rc.pid[i] > 0)
            kill(g_rc.pid[i], SIGCONT);
    rc_stop(&g_rc);
    return st_at_teardown(&g_env);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_across_nodes),
        cmocka_unit_test(test_cluster_changes),
        cmocka_unit_test(test_lost_lease),
        cmocka_unit_test(test_prefix_across_nodes),
        cmocka_unit_test(test_park_across_nodes),
        cmocka_unit_test(test_stale_spill),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
