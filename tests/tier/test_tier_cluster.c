/*
 * test_tier_cluster.c - the shared tier's client (statestore/st_tier.c) against a real Redis
 * Cluster of 3 masters and 3 replicas on loopback (Debian's redis-server, started here), and
 * against one Redis without cluster mode:
 * - the slot of a key agrees with the servers' CLUSTER KEYSLOT on tagged and untagged keys; the
 *   control (the slot of the whole key, without the hash-tag rule) disagrees on tagged ones;
 * - chunks: written once (a second put writes nothing), read back and checked against their
 *   SHA-256 (a value changed behind the client is ST_ECORRUPT), spread over every master,
 *   bounded reads (ST_ETOOBIG), absent ones ST_ENOTFOUND;
 * - manifests immutable (the same bytes again succeed, others ST_ECONFLICT); the head's
 *   compare-and-set (a stale expectation is ST_ECONFLICT and reports the current head);
 * - leases: taken once, renewed and released only under their token, expiring;
 * - a slot moved to another master while the client holds the old map: ASK during the
 *   migration, MOVED after it, the values read through both;
 * - WAIT: writes confirmed on a replica; a master killed with SIGKILL, its replica promoted,
 *   every confirmed chunk read back through the new master; a master without a replica left
 *   refuses the confirmation (ST_EIO);
 * - bad addresses (ST_EINVAL) and an unreachable tier (ST_EIO within the retry budget).
 * Label `cluster` (runs in make test).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "redis_cluster.h"
#include "st_file.h"
#include "st_store.h"

static char g_dir[512]; /* short of the 1024-byte paths made from it */
static rc_cluster g_rc;

#define OK(x)                                                                                 \
    do {                                                                                      \
        int rc_ = (x);                                                                        \
        if (rc_)                                                                              \
            fail_msg("%s: %s: %s", #x, st_strerror(rc_), st_errdetail());                     \
    } while (0)

static st_tier *open_tier(uint32_t retry_ms)
{
    char url[512];
    rc_url(&g_rc, 2, url, sizeof url); /* two seeds: the rest comes from CLUSTER SLOTS */
    st_tier_opts o;
    st_tier_opts_default(&o);
    o.retry_ms = retry_ms;
    st_tier *t = NULL;
    OK(st_tier_open(&t, url, &o));
    return t;
}

static uint64_t g_x = 0x243f6a8885a308d3ull;
static uint64_t rnd(void)
{
    g_x ^= g_x << 13;
    g_x ^= g_x >> 7;
    g_x ^= g_x << 17;
    return g_x;
}

static void *chunk_bytes(size_t n, uint8_t sha[ST_SHA256_LEN])
{
    uint8_t *p = malloc(n ? n : 1);
    assert_non_null(p);
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)rnd();
    OK(st_sha256(p, n, sha));
    return p;
}

/* the slot rule without hash tags: the control */
static uint32_t slot_no_tags(const char *k)
{
    uint16_t crc = 0;
    for (const char *p = k; *p; p++) {
        crc ^= (uint16_t)((uint16_t)(uint8_t)*p << 8);
        for (int b = 0; b < 8; b++)
            crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc & 16383;
}

static void test_keyslot(void **state)
{
    (void)state;
    static const char *fixed[] = {"", "a", "{", "}", "{}", "{}x", "x{}y", "{a}", "{a}{b}", "a{b",
                                  "a}b{c}", "{{a}}", "st:h:{sess-1}", "st:m:{sess-1}:42",
                                  "123456789", "foo{bar}{zap}"};
    int n = 0, agree = 0, control_differs = 0, tagged = 0;
    char key[96];
    for (int i = 0; i < 216; i++) {
        const char *k = key;
        if (i < 16)
            k = fixed[i];
        else if (i % 2)
            snprintf(key, sizeof key, "st:c:%016llx%016llx", (unsigned long long)rnd(),
                     (unsigned long long)rnd());
        else
            snprintf(key, sizeof key, "x%llu{s%llu}:%d", (unsigned long long)(rnd() % 1000),
                     (unsigned long long)(rnd() % 100000), i);
        redisReply *r = rc_cmd(g_rc.port[0], "CLUSTER KEYSLOT %b", k, strlen(k));
        assert_non_null(r);
        assert_int_equal(r->type, REDIS_REPLY_INTEGER);
        uint32_t mine = st_tier_key_slot(k, strlen(k));
        n++;
        agree += (long long)mine == r->integer;
        if (mine != r->integer)
            print_error("key '%s': slot %u here, %lld in Redis\n", k, mine, r->integer);
        int has_tag = strchr(k, '{') && strchr(strchr(k, '{'), '}') &&
                      strchr(strchr(k, '{'), '}') > strchr(k, '{') + 1;
        if (has_tag) {
            tagged++;
            control_differs += (long long)slot_no_tags(k) != r->integer;
        }
        freeReplyObject(r);
    }
    printf("keyslot: %d of %d keys agree with CLUSTER KEYSLOT; the control (no hash tags) "
           "differs on %d of %d tagged keys\n", agree, n, control_differs, tagged);
    assert_int_equal(agree, n);
    assert_true(tagged > 50 && control_differs > tagged * 9 / 10);
}

static void test_chunks(void **state)
{
    (void)state;
    st_tier *t = open_tier(5000);
    enum { N = 300 };
    uint8_t sha[N][ST_SHA256_LEN];
    size_t len[N];
    void *data[N];
    int per_master[RC_MAX] = {0};
    for (int i = 0; i < N; i++) {
        len[i] = i == 0 ? 0 : 1 + (size_t)(rnd() % 65536);
        data[i] = chunk_bytes(len[i], sha[i]);
        int written = -1;
        OK(st_tier_chunk_put(t, sha[i], data[i], len[i], &written));
        assert_int_equal(written, 1);
        OK(st_tier_chunk_put(t, sha[i], data[i], len[i], &written));
        assert_int_equal(written, 0); /* content-addressed: present already */
        char key[80] = "st:c:";
        st_hex_encode(key + 5, sha[i], ST_SHA256_LEN);
        int m = rc_master_of(&g_rc, st_tier_key_slot(key, 69));
        assert_true(m >= 0);
        per_master[m]++;
    }
    int masters = 0;
    for (int i = 0; i < g_rc.n; i++)
        masters += per_master[i] > 0;
    assert_int_equal(masters, 3);
    for (int i = 0; i < N; i++) {
        void *p = NULL;
        size_t n = 0;
        OK(st_tier_chunk_get(t, sha[i], 1 << 20, &p, &n));
        assert_int_equal(n, len[i]);
        assert_memory_equal(p, data[i], n);
        free(p);
        int ex = 0;
        OK(st_tier_chunk_exists(t, sha[i], &ex));
        assert_int_equal(ex, 1);
    }
    st_tier_stats s;
    st_tier_stats_get(t, &s);
    assert_int_equal(s.cluster, 1);
    assert_int_equal(s.nodes, 3);
    printf("chunks: %d put twice and read back over %d masters (%llu commands, %llu redirects)\n",
           N, masters, (unsigned long long)s.commands, (unsigned long long)(s.moved + s.asked));
    /* bounded: a chunk larger than the caller's bound is refused, nothing allocated for it */
    void *p = (void *)1;
    size_t n = 7;
    size_t big = 0;
    for (int i = 1; i < N; i++)
        big = len[i] > len[big] ? (size_t)i : big;
    assert_int_equal(st_tier_chunk_get(t, sha[big], len[big] - 1, &p, &n), ST_ETOOBIG);
    assert_null(p);
    /* absent */
    uint8_t none[ST_SHA256_LEN] = {1, 2, 3};
    assert_int_equal(st_tier_chunk_get(t, none, 1 << 20, &p, &n), ST_ENOTFOUND);
    int ex = 1;
    OK(st_tier_chunk_exists(t, none, &ex));
    assert_int_equal(ex, 0);
    /* changed behind the client: the hash check catches it */
    char key[80] = "st:c:";
    st_hex_encode(key + 5, sha[5], ST_SHA256_LEN);
    int m = rc_master_of(&g_rc, st_tier_key_slot(key, 69));
    redisReply *r = rc_cmd(g_rc.port[m], "SET %b %b", key, (size_t)69, "forged", (size_t)6);
    assert_non_null(r);
    freeReplyObject(r);
    assert_int_equal(st_tier_chunk_get(t, sha[5], 1 << 20, &p, &n), ST_ECORRUPT);
    printf("chunks: a value changed behind the client: %s\n", st_errdetail());
    assert_null(p);
    for (int i = 0; i < N; i++)
        free(data[i]);
    st_tier_close(t);
}

static void test_head_manifest(void **state)
{
    (void)state;
    st_tier *t = open_tier(5000);
    uint64_t v = 99, cur = 99;
    OK(st_tier_head_get(t, "conv-a", &v));
    assert_int_equal(v, 0);
    OK(st_tier_head_cas(t, "conv-a", 0, 1, &cur));
    assert_int_equal(cur, 1);
    /* a second node that read "none" is stale: refused, and told the head */
    assert_int_equal(st_tier_head_cas(t, "conv-a", 0, 2, &cur), ST_ECONFLICT);
    assert_int_equal(cur, 1);
    assert_int_equal(st_tier_head_cas(t, "conv-a", 7, 8, &cur), ST_ECONFLICT);
    OK(st_tier_head_cas(t, "conv-a", 1, 2, &cur));
    OK(st_tier_head_get(t, "conv-a", &v));
    assert_int_equal(v, 2);
    /* manifests are immutable */
    static const char m1[] = "manifest one", m2[] = "manifest two";
    OK(st_tier_manifest_put(t, "conv-a", 2, m1, sizeof m1));
    OK(st_tier_manifest_put(t, "conv-a", 2, m1, sizeof m1)); /* a retry */
    assert_int_equal(st_tier_manifest_put(t, "conv-a", 2, m2, sizeof m2), ST_ECONFLICT);
    void *p = NULL;
    size_t n = 0;
    OK(st_tier_manifest_get(t, "conv-a", 2, 4096, &p, &n));
    assert_int_equal(n, sizeof m1);
    assert_memory_equal(p, m1, n);
    free(p);
    assert_int_equal(st_tier_manifest_get(t, "conv-a", 3, 4096, &p, &n), ST_ENOTFOUND);
    assert_int_equal(st_tier_manifest_get(t, "conv-a", 2, 4, &p, &n), ST_ETOOBIG);
    /* the session's small keys share one slot (a script may touch them together) */
    assert_int_equal(st_tier_key_slot("st:h:{conv-a}", 13), st_tier_key_slot("st:m:{conv-a}:2", 15));
    /* ids are the store's: braces, spaces and empty ones are refused */
    assert_int_equal(st_tier_head_get(t, "a{b}", &v), ST_EINVAL);
    assert_int_equal(st_tier_head_get(t, "", &v), ST_EINVAL);
    assert_int_equal(st_tier_head_cas(t, "conv-a", 2, 0, &cur), ST_EINVAL);
    assert_int_equal(st_tier_manifest_put(t, "conv-a", 0, m1, sizeof m1), ST_EINVAL);
    /* a head that is not a version is reported, not believed */
    int m = rc_master_of(&g_rc, st_tier_key_slot("st:h:{conv-b}", 13));
    redisReply *r = rc_cmd(g_rc.port[m], "SET st:h:{conv-b} 12x");
    freeReplyObject(r);
    assert_int_equal(st_tier_head_get(t, "conv-b", &v), ST_ECORRUPT);
    st_tier_close(t);
}

static void test_lease(void **state)
{
    (void)state;
    st_tier *t = open_tier(5000);
    char ta[ST_TIER_TOKEN_LEN + 1], tb[ST_TIER_TOKEN_LEN + 1], owner[80];
    int64_t ttl = 0;
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, "");
    assert_int_equal(ttl, -2);
    st_tier_holder h;
    OK(st_tier_holder_get(t, "conv-l", &h));
    assert_string_equal(h.owner, "");
    OK(st_tier_lease_take(t, "conv-l", "node-a", 60000, ta, &h));
    assert_string_equal(h.owner, ""); /* nobody held it before */
    assert_int_equal(strlen(ta), ST_TIER_TOKEN_LEN);
    assert_int_equal(st_tier_lease_take(t, "conv-l", "node-b", 60000, tb, NULL), ST_EBUSY);
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, "node-a");
    assert_true(ttl > 50000 && ttl <= 60000);
    char wrong[ST_TIER_TOKEN_LEN + 1];
    memcpy(wrong, ta, sizeof wrong);
    wrong[0] = wrong[0] == '0' ? '1' : '0';
    assert_int_equal(st_tier_lease_renew(t, "conv-l", wrong, 60000), ST_EBUSY);
    assert_int_equal(st_tier_lease_release(t, "conv-l", wrong), ST_EBUSY);
    OK(st_tier_lease_renew(t, "conv-l", ta, 300));
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_true(ttl > 0 && ttl <= 300);
    rc_sleep_ms(500); /* expired: another node may take it, the old token is dead */
    /* the holder record: node-a parks it under its (expired) token: refused */
    assert_int_equal(st_tier_holder_park(t, "conv-l", ta, 7), ST_EBUSY);
    OK(st_tier_lease_take(t, "conv-l", "node-b", 60000, tb, &h));
    assert_string_equal(h.owner, "node-a");
    assert_int_equal(h.park, 0);
    assert_int_equal(st_tier_holder_park(t, "conv-l", ta, 7), ST_EBUSY); /* not node-a's now */
    OK(st_tier_holder_park(t, "conv-l", tb, 7));
    assert_int_equal(st_tier_holder_park(t, "conv-l", tb, 0), ST_EINVAL);
    OK(st_tier_holder_get(t, "conv-l", &h));
    assert_string_equal(h.owner, "node-b");
    assert_int_equal(h.park, 7);
    assert_int_equal(st_tier_lease_renew(t, "conv-l", ta, 60000), ST_EBUSY);
    assert_int_equal(st_tier_lease_release(t, "conv-l", ta), ST_EBUSY);
    OK(st_tier_lease_release(t, "conv-l", tb));
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, "");
    /* takeover: a lease its owner left behind (a failed release) gets a new token; the old one
     * is dead; another owner's lease and a missing one are refused */
    char tc[ST_TIER_TOKEN_LEN + 1];
    assert_int_equal(st_tier_lease_takeover(t, "conv-l", "node-a", 60000, tc, NULL), ST_EBUSY);
    OK(st_tier_lease_take(t, "conv-l", "node-a", 60000, ta, &h));
    assert_string_equal(h.owner, "node-b"); /* the record of the last holder, with its park */
    assert_int_equal(h.park, 7);
    OK(st_tier_holder_get(t, "conv-l", &h));
    assert_string_equal(h.owner, "node-a"); /* a take resets the park */
    assert_int_equal(h.park, 0);
    assert_int_equal(st_tier_lease_takeover(t, "conv-l", "node-b", 60000, tc, NULL), ST_EBUSY);
    assert_int_equal(st_tier_lease_takeover(t, "conv-l", "node", 60000, tc, NULL), ST_EBUSY);
    OK(st_tier_lease_takeover(t, "conv-l", "node-a", 60000, tc, &h));
    assert_string_equal(h.owner, "node-a");
    assert_string_not_equal(tc, ta);
    assert_int_equal(st_tier_lease_renew(t, "conv-l", ta, 60000), ST_EBUSY);
    OK(st_tier_lease_renew(t, "conv-l", tc, 60000));
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, "node-a");
    OK(st_tier_lease_release(t, "conv-l", tc));
    /* take_held (a node parking its copy): refused, with nothing changed, once another node
     * held the conversation since; taken while the record names the taker */
    OK(st_tier_lease_take(t, "conv-l", "node-b", 60000, tb, NULL));
    OK(st_tier_lease_release(t, "conv-l", tb));
    assert_int_equal(st_tier_lease_take_held(t, "conv-l", "node-a", 60000, tc, &h), ST_ECONFLICT);
    assert_string_equal(h.owner, "node-b");
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, ""); /* no lease was taken */
    OK(st_tier_holder_get(t, "conv-l", &h));
    assert_string_equal(h.owner, "node-b");
    OK(st_tier_lease_take_held(t, "conv-l", "node-b", 60000, tb, &h));
    assert_string_equal(h.owner, "node-b");
    OK(st_tier_lease_release(t, "conv-l", tb));
    OK(st_tier_lease_take_held(t, "conv-new", "node-a", 60000, tc, &h)); /* no record yet */
    assert_string_equal(h.owner, "");
    OK(st_tier_lease_release(t, "conv-new", tc));
    assert_int_equal(st_tier_lease_take(t, "conv-l", "bad owner", 1000, tb, NULL), ST_EINVAL);
    assert_int_equal(st_tier_lease_take(t, "conv-l", "node-a", 0, tb, NULL), ST_EINVAL);
    assert_int_equal(st_tier_lease_renew(t, "conv-l", "short", 1000), ST_EINVAL);
    /* a take retried after a lost reply (every take sent twice): the second run finds the lease
     * under its own token and answers as the first did, with the record the first replaced (a
     * retry answered "busy" would take over and read a record naming the taker: no handover) */
    char url[512];
    rc_url(&g_rc, 2, url, sizeof url);
    st_tier_opts ro;
    st_tier_opts_default(&ro);
    ro.replay_takes = 1;
    st_tier *tr = NULL;
    OK(st_tier_open(&tr, url, &ro));
    OK(st_tier_lease_take(tr, "conv-l", "node-a", 60000, ta, &h)); /* node-b held it last */
    assert_string_equal(h.owner, "node-b");
    OK(st_tier_lease_owner(t, "conv-l", owner, sizeof owner, &ttl));
    assert_string_equal(owner, "node-a");
    assert_int_equal(st_tier_lease_release(t, "conv-l", ta), 0); /* under the token it gave */
    OK(st_tier_lease_take_held(tr, "conv-l", "node-a", 60000, ta, &h));
    assert_string_equal(h.owner, "node-a");
    OK(st_tier_lease_takeover(tr, "conv-l", "node-a", 60000, tc, &h));
    assert_string_equal(h.owner, "node-a");
    assert_int_equal(st_tier_lease_renew(t, "conv-l", ta, 60000), ST_EBUSY);
    OK(st_tier_lease_release(t, "conv-l", tc));
    OK(st_tier_lease_take(tr, "conv-l", "node-b", 60000, tb, &h));
    assert_string_equal(h.owner, "node-a");
    OK(st_tier_lease_release(tr, "conv-l", tb));
    st_tier_close(tr);
    st_tier_close(t);
}

static int rc_reply_has_role_master(int port)
{
    redisReply *r = rc_cmd(port, "ROLE");
    int m = r && r->type == REDIS_REPLY_ARRAY && r->elements > 0 &&
            r->element[0]->type == REDIS_REPLY_STRING && !strcmp(r->element[0]->str, "master");
    if (r)
        freeReplyObject(r);
    return m;
}

static void setslot(int port, unsigned slot, const char *how, const char *id)
{
    redisReply *r = rc_cmd(port, "CLUSTER SETSLOT %u %s %s", slot, how, id);
    assert_non_null(r);
    if (r->type == REDIS_REPLY_ERROR)
        fail_msg("CLUSTER SETSLOT %u %s at %d: %s", slot, how, port, r->str);
    freeReplyObject(r);
}

/* A slot moved by hand, as redis-cli --cluster reshard does it, while the client keeps its map. */
static void test_moved_ask(void **state)
{
    (void)state;
    st_tier *t = open_tier(5000);
    uint8_t sa[ST_SHA256_LEN], sb[ST_SHA256_LEN];
    void *a = chunk_bytes(5000, sa);
    OK(st_tier_chunk_put(t, sa, a, 5000, NULL));
    char ka[80] = "st:c:";
    st_hex_encode(ka + 5, sa, ST_SHA256_LEN);
    unsigned slot = st_tier_key_slot(ka, 69);
    /* a second chunk in the same slot, written after the migration starts */
    void *b = NULL;
    for (;;) {
        free(b);
        b = chunk_bytes(700, sb);
        char kb[80] = "st:c:";
        st_hex_encode(kb + 5, sb, ST_SHA256_LEN);
        if (st_tier_key_slot(kb, 69) == slot)
            break;
    }
    int src = rc_master_of(&g_rc, slot), dst = -1;
    for (unsigned probe = 0; probe < 16384 && dst < 0; probe += 997) { /* another master */
        int m = rc_master_of(&g_rc, probe);
        if (m >= 0 && m != src)
            dst = m;
    }
    assert_true(src >= 0 && dst >= 0);
    char sid[64], did[64];
    assert_int_equal(rc_node_id(&g_rc, src, sid), 0);
    assert_int_equal(rc_node_id(&g_rc, dst, did), 0);
    setslot(g_rc.port[dst], slot, "IMPORTING", sid);
    setslot(g_rc.port[src], slot, "MIGRATING", did);
    redisReply *r = rc_cmd(g_rc.port[src], "MIGRATE 127.0.0.1 %d %b 0 5000", g_rc.port[dst], ka,
                           (size_t)69);
    assert_non_null(r);
    if (r->type == REDIS_REPLY_ERROR)
        fail_msg("MIGRATE: %s", r->str);
    freeReplyObject(r);
    /* the key has left the source: it answers ASK, the client asks the target */
    st_tier_stats s0, s1, s2;
    st_tier_stats_get(t, &s0);
    void *p = NULL;
    size_t n = 0;
    OK(st_tier_chunk_get(t, sa, 1 << 20, &p, &n));
    assert_int_equal(n, 5000);
    assert_memory_equal(p, a, n);
    free(p);
    OK(st_tier_chunk_put(t, sb, b, 700, NULL)); /* a new key of a migrating slot: ASK too */
    st_tier_stats_get(t, &s1);
    assert_true(s1.asked >= s0.asked + 2);
    assert_int_equal(s1.moved, s0.moved);
    /* the migration ends: the slot is the target's, the client's map is stale (MOVED) */
    for (int i = 0; i < g_rc.n; i++)
        if (g_rc.pid[i] > 0 && rc_reply_has_role_master(g_rc.port[i]))
            setslot(g_rc.port[i], slot, "NODE", did);
    rc_sleep_ms(200);
    OK(st_tier_chunk_get(t, sa, 1 << 20, &p, &n));
    assert_memory_equal(p, a, n);
    free(p);
    OK(st_tier_chunk_get(t, sb, 1 << 20, &p, &n));
    assert_int_equal(n, 700);
    assert_memory_equal(p, b, n);
    free(p);
    st_tier_stats_get(t, &s2);
    assert_int_equal(s2.moved, s1.moved + 1); /* once: the map was updated */
    printf("moved: slot %u from :%d to :%d: %llu ASK and %llu MOVED followed\n", slot,
           g_rc.port[src], g_rc.port[dst], (unsigned long long)(s1.asked - s0.asked),
           (unsigned long long)(s2.moved - s1.moved));
    free(a);
    free(b);
    st_tier_close(t);
}

/* Chunks confirmed on a replica survive their master's SIGKILL; after the failover the new
 * master, which has no replica left, cannot confirm writes. Runs last: it changes the cluster. */
static void test_failover(void **state)
{
    (void)state;
    st_tier *t = open_tier(20000);
    enum { N = 200 };
    uint8_t sha[N][ST_SHA256_LEN];
    void *data[N];
    for (int i = 0; i < N; i++) {
        data[i] = chunk_bytes(2048, sha[i]);
        OK(st_tier_chunk_put(t, sha[i], data[i], 2048, NULL));
    }
    OK(st_tier_sync(t, 1, 5000)); /* every master's replica has them */
    char k0[80] = "st:c:";
    st_hex_encode(k0 + 5, sha[0], ST_SHA256_LEN);
    int victim = rc_master_of(&g_rc, st_tier_key_slot(k0, 69));
    assert_true(victim >= 0);
    rc_kill(&g_rc, victim);
    printf("failover: master :%d killed with SIGKILL\n", g_rc.port[victim]);
    /* reads ride through the failover (the client keeps retrying within its budget) */
    for (int i = 0; i < N; i++) {
        void *p = NULL;
        size_t n = 0;
        OK(st_tier_chunk_get(t, sha[i], 1 << 20, &p, &n));
        assert_int_equal(n, 2048);
        assert_memory_equal(p, data[i], n);
        free(p);
    }
    int promoted = rc_master_of(&g_rc, st_tier_key_slot(k0, 69));
    assert_true(promoted >= 0 && promoted != victim);
    st_tier_stats s;
    st_tier_stats_get(t, &s);
    printf("failover: %d confirmed chunks read back, the slot now at :%d (%llu retries, "
           "%llu refreshes, %llu moved)\n", N, g_rc.port[promoted], (unsigned long long)s.retries,
           (unsigned long long)s.refreshes, (unsigned long long)s.moved);
    /* the promoted master has no replica: a write there cannot be confirmed */
    uint8_t sx[ST_SHA256_LEN];
    void *x = NULL;
    for (;;) {
        free(x);
        x = chunk_bytes(100, sx);
        char kx[80] = "st:c:";
        st_hex_encode(kx + 5, sx, ST_SHA256_LEN);
        if (rc_master_of(&g_rc, st_tier_key_slot(kx, 69)) == promoted)
            break;
    }
    OK(st_tier_chunk_put(t, sx, x, 100, NULL));
    int rc = st_tier_sync(t, 1, 300);
    assert_int_equal(rc, ST_EIO);
    printf("failover: a write on the master without a replica: %s\n", st_errdetail());
    OK(st_tier_sync(t, 0, 0));
    free(x);
    for (int i = 0; i < N; i++)
        free(data[i]);
    st_tier_close(t);
}

static void test_single_and_errors(void **state)
{
    (void)state;
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/single", g_dir);
    rc_cluster one;
    if (rc_start(&one, dir, 1, 0, 0))
        fail_msg("could not start a single redis-server");
    char url[128];
    rc_url(&one, 0, url, sizeof url);
    st_tier *t = NULL;
    OK(st_tier_open(&t, url, NULL));
    st_tier_stats s;
    st_tier_stats_get(t, &s);
    assert_int_equal(s.cluster, 0);
    uint8_t sha[ST_SHA256_LEN];
    void *d = chunk_bytes(3000, sha);
    OK(st_tier_chunk_put(t, sha, d, 3000, NULL));
    void *p = NULL;
    size_t n = 0;
    OK(st_tier_chunk_get(t, sha, 1 << 20, &p, &n));
    assert_memory_equal(p, d, 3000);
    free(p);
    free(d);
    OK(st_tier_head_cas(t, "solo", 0, 1, NULL));
    st_tier_close(t);
    rc_stop(&one);
    /* nothing listens there now */
    st_tier_opts o;
    st_tier_opts_default(&o);
    o.timeout_ms = 200;
    o.retry_ms = 300;
    assert_int_equal(st_tier_open(&t, url, &o), ST_EIO);
    printf("unreachable: %s\n", st_errdetail());
    assert_null(t);
    static const char *bad[] = {"http://127.0.0.1:1", "redis://", "redis://host", "redis://:80",
                                "redis://h:0", "redis://h:99999", "redis://h:12a",
                                "redis://a:1,,b:2", NULL};
    for (int i = 0; i < 8; i++) {
        assert_int_equal(st_tier_open(&t, bad[i], &o), ST_EINVAL);
        assert_null(t);
    }
    assert_int_equal(st_tier_open(&t, NULL, &o), ST_EINVAL);
}

/* ---- a version between local stores through the tier (statestore/st_tier_xfer.c) ---------- */
static st_store *open_store(const char *name)
{
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/%s", g_dir, name);
    st_store_opts o;
    memset(&o, 0, sizeof o);
    o.create = 1;
    st_store *st = NULL;
    OK(st_store_open(&st, dir, &o));
    return st;
}

static st_image *synth(uint64_t seed, uint64_t prefix_seed, uint64_t prefix_len)
{
    st_synth_opts o;
    memset(&o, 0, sizeof o);
    o.seed = seed;
    o.n_ctx = 16384;
    o.n_tokens = 12000;
    o.attn_every = 2; /* two attention layers of four: mostly K/V, as a long conversation is */
    o.n_checkpoints = 1;
    o.head_dim = 64;
    o.prefix_seed = prefix_seed;
    o.prefix_len = prefix_len;
    st_image *img = NULL;
    OK(st_image_synthesize(&o, &img));
    return img;
}

/* the session file of a stored version: what the tier carries */
static uint8_t *file_of(st_store *st, const char *id, size_t *n)
{
    st_image *img = NULL;
    OK(st_store_get(st, id, 0, &img));
    st_file_write_opts fo;
    memset(&fo, 0, sizeof fo);
    fo.version = 2;
    uint8_t *b = NULL;
    OK(st_file_write_mem(img, &fo, &b, n));
    st_image_free(img);
    return b;
}

static void forge(const char *key, size_t kl)
{
    int m = rc_master_of(&g_rc, st_tier_key_slot(key, kl));
    assert_true(m >= 0);
    redisReply *r = rc_cmd(g_rc.port[m], "SET %b %b", key, kl, "forged", (size_t)6);
    assert_non_null(r);
    freeReplyObject(r);
}

/* A version saved on node A's store goes to the tier and comes back into node B's store with the
 * same session file (the control: another conversation's file differs); a second conversation
 * sharing 11,000 of its 12,000 tokens' K/V writes only the pieces of what differs; a stale node's
 * push is refused by the head's compare-and-set; a manifest orphaned by a failed push is passed
 * over; a forged piece, a missing one, a damaged manifest and one that claims more than the
 * caller allows fail with typed errors and leave B's store as it was. */
static void test_xfer(void **state)
{
    (void)state;
    st_tier *t = open_tier(5000);
    st_store *a = open_store("node-a"), *b = open_store("node-b");
    st_image *i1 = synth(11, 0, 0), *i2 = synth(12, 11, 11000);
    uint64_t v = 0;
    OK(st_store_put(a, "conv-x", i1, ST_STORE_HEAD_ANY, NULL, &v));
    OK(st_store_put(a, "conv-y", i2, ST_STORE_HEAD_ANY, NULL, &v));
    st_image_free(i1);
    st_image_free(i2);
    st_tier_xfer_stats s1, s2, p1;
    OK(st_tier_push(t, a, "conv-x", 0, 0, 1, 2000, &s1));
    assert_int_equal(s1.tier_version, 1);
    assert_int_equal(s1.new_pieces, s1.pieces);
    assert_true(s1.pieces > 1);
    OK(st_tier_push(t, a, "conv-y", 0, ST_TIER_HEAD_CURRENT, 1, 2000, &s2));
    printf("xfer: conv-x %llu bytes in %u pieces; conv-y (11,000 of 12,000 tokens shared) %u of %u "
           "pieces new, %llu of %llu bytes\n", (unsigned long long)s1.bytes, s1.pieces,
           s2.new_pieces, s2.pieces, (unsigned long long)s2.new_bytes,
           (unsigned long long)s2.bytes);
    assert_true(s2.new_bytes * 3 < s2.bytes); /* the shared prefix is not written again */
    OK(st_tier_pull(t, b, "conv-x", 0, 0, &p1));
    assert_int_equal(p1.tier_version, 1);
    assert_int_equal(p1.local_version, 1);
    size_t na = 0, nb = 0, ny = 0;
    uint8_t *fa = file_of(a, "conv-x", &na), *fb = file_of(b, "conv-x", &nb);
    uint8_t *fy = file_of(a, "conv-y", &ny);
    assert_int_equal(na, nb);
    assert_memory_equal(fa, fb, na);
    assert_true(na != ny || memcmp(fa, fy, na) != 0); /* the control */
    free(fa);
    free(fb);
    free(fy);
    /* a stale node: it believes the head is none; the compare-and-set refuses it */
    assert_int_equal(st_tier_push(t, a, "conv-x", 0, 0, 0, 0, NULL), ST_ECONFLICT);
    printf("xfer: a stale push: %s\n", st_errdetail());
    /* a manifest orphaned at version 2 (a push that died before its compare-and-set) */
    static const char junk[] = "left by a push that failed";
    OK(st_tier_manifest_put(t, "conv-x", 2, junk, sizeof junk));
    st_tier_xfer_stats s3;
    OK(st_tier_push(t, a, "conv-x", 0, 1, 1, 2000, &s3));
    assert_int_equal(s3.tier_version, 3);
    uint64_t head = 0;
    OK(st_tier_head_get(t, "conv-x", &head));
    assert_int_equal(head, 3);
    OK(st_tier_pull(t, b, "conv-x", 0, 0, &p1));
    assert_int_equal(p1.tier_version, 3);
    assert_int_equal(p1.local_version, 2);
    /* a forged piece of conv-y: refused, nothing stored on B */
    void *m = NULL;
    size_t mn = 0;
    OK(st_tier_manifest_get(t, "conv-y", 1, 1 << 20, &m, &mn));
    char key[80] = "st:c:";
    st_hex_encode(key + 5, (const uint8_t *)m + 56 + 36 * 2, ST_SHA256_LEN);
    forge(key, 69);
    assert_int_equal(st_tier_pull(t, b, "conv-y", 0, 0, NULL), ST_ECORRUPT);
    printf("xfer: a forged piece: %s\n", st_errdetail());
    st_session_info si;
    assert_int_equal(st_store_show(b, "conv-y", &si), ST_ENOTFOUND);
    /* a missing piece */
    int mm = rc_master_of(&g_rc, st_tier_key_slot(key, 69));
    redisReply *r = rc_cmd(g_rc.port[mm], "DEL %b", key, (size_t)69);
    freeReplyObject(r);
    assert_int_equal(st_tier_pull(t, b, "conv-y", 0, 0, NULL), ST_ECORRUPT);
    printf("xfer: a missing piece: %s\n", st_errdetail());
    assert_int_equal(st_store_show(b, "conv-y", &si), ST_ENOTFOUND);
    /* a damaged manifest (one byte changed: the trailer disagrees) */
    uint8_t *bad = malloc(mn);
    assert_non_null(bad);
    memcpy(bad, m, mn);
    bad[60] ^= 1;
    OK(st_tier_manifest_put(t, "conv-z", 1, bad, mn));
    OK(st_tier_head_cas(t, "conv-z", 0, 1, NULL));
    assert_int_equal(st_tier_pull(t, b, "conv-z", 0, 0, NULL), ST_ECORRUPT);
    printf("xfer: a damaged manifest: %s\n", st_errdetail());
    /* a manifest that claims a file larger than the caller allows: refused before allocating */
    assert_int_equal(st_tier_pull(t, b, "conv-y", 1, 4096, NULL), ST_ETOOBIG);
    printf("xfer: a bound: %s\n", st_errdetail());
    /* nothing in the tier */
    assert_int_equal(st_tier_pull(t, b, "conv-none", 0, 0, NULL), ST_ENOTFOUND);
    assert_int_equal(st_store_show(b, "conv-z", &si), ST_ENOTFOUND);
    free(bad);
    free(m);
    st_store_close(a);
    st_store_close(b);
    st_tier_close(t);
}

static long long key_ttl(const char *key, size_t kl)
{
    int m = rc_master_of(&g_rc, st_tier_key_slot(key, kl));
    assert_true(m >= 0);
    redisReply *r = rc_cmd(g_rc.port[m], "TTL %b", key, kl);
    assert_non_null(r);
    long long v = r->type == REDIS_REPLY_INTEGER ? r->integer : -99;
    freeReplyObject(r);
    return v;
}

/* Garbage collection by TTL (st_tier.c invariant 6): with ttl_s every key a push writes
 * expires; a chunk put again by a later push that names it gets its TTL again (so it outlives
 * the newer manifest); the control: without ttl_s nothing expires. */
static void test_ttl(void **state)
{
    (void)state;
    char url[512];
    rc_url(&g_rc, 2, url, sizeof url);
    st_tier_opts o;
    st_tier_opts_default(&o);
    o.ttl_s = 600;
    st_tier *t = NULL;
    OK(st_tier_open(&t, url, &o));
    st_store *a = open_store("node-ttl");
    st_image *i1 = synth(21, 0, 0), *i2 = synth(22, 21, 11000);
    OK(st_store_put(a, "ttl-x", i1, ST_STORE_HEAD_ANY, NULL, NULL));
    OK(st_store_put(a, "ttl-y", i2, ST_STORE_HEAD_ANY, NULL, NULL));
    st_image_free(i1);
    st_image_free(i2);
    OK(st_tier_push(t, a, "ttl-x", 0, 0, 0, 0, NULL));
    long long th = key_ttl("st:h:{ttl-x}", 12), tm = key_ttl("st:m:{ttl-x}:1", 14);
    void *m = NULL;
    size_t mn = 0;
    OK(st_tier_manifest_get(t, "ttl-x", 1, 1 << 20, &m, &mn));
    char key[80] = "st:c:";
    st_hex_encode(key + 5, (const uint8_t *)m + 56, ST_SHA256_LEN); /* the first piece */
    long long tc = key_ttl(key, 69);
    printf("ttl: head %lld s, manifest %lld s, a piece %lld s (ttl_s 600)\n", th, tm, tc);
    assert_true(th > 590 && th <= 600 && tm > 590 && tm <= 600 && tc > 590 && tc <= 600);
    /* a piece ttl-y shares with ttl-x, aged by hand, gets its TTL again when ttl-y names it */
    char shared[80] = "st:c:";
    st_hex_encode(shared + 5, (const uint8_t *)m + 56 + 36 * 10, ST_SHA256_LEN);
    int mi = rc_master_of(&g_rc, st_tier_key_slot(shared, 69));
    redisReply *r = rc_cmd(g_rc.port[mi], "EXPIRE %b 5", shared, (size_t)69);
    freeReplyObject(r);
    assert_true(key_ttl(shared, 69) <= 5);
    st_tier_xfer_stats s2;
    OK(st_tier_push(t, a, "ttl-y", 0, 0, 0, 0, &s2));
    assert_true(s2.new_pieces < s2.pieces); /* the shared piece was not written again */
    long long ts = key_ttl(shared, 69);
    printf("ttl: a shared piece aged to 5 s has %lld s again after a push that names it\n", ts);
    assert_true(ts > 590);
    free(m);
    st_tier_close(t);
    /* the control: without ttl_s nothing a push writes expires (TTL -1) */
    st_tier *u = open_tier(5000);
    OK(st_tier_push(u, a, "ttl-x", 0, ST_TIER_HEAD_CURRENT, 0, 0, NULL));
    assert_int_equal(key_ttl("st:m:{ttl-x}:2", 14), -1);
    st_tier_close(u);
    st_store_close(a);
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(g_dir, sizeof g_dir, "tier_cluster");
    char dir[1024];
    snprintf(dir, sizeof dir, "%s/cluster", g_dir);
    return rc_start(&g_rc, dir, 6, 1, 1) ? -1 : 0;
}

static int teardown(void **state)
{
    (void)state;
    rc_stop(&g_rc);
    st_test_rmdir(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_keyslot),
        cmocka_unit_test(test_chunks),
        cmocka_unit_test(test_head_manifest),
        cmocka_unit_test(test_lease),
        cmocka_unit_test(test_moved_ask),
        cmocka_unit_test(test_xfer),
        cmocka_unit_test(test_ttl),
        cmocka_unit_test(test_single_and_errors),
        cmocka_unit_test(test_failover),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
