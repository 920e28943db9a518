/*
 * st_tier.c - the shared tier's client: a Redis Cluster (or one Redis without cluster mode) that
 * several strata-server nodes share (issue 15). hiredis speaks RESP2 to one server; the cluster
 * part (slots, redirects, topology) is here, as cluster clients do it. Contract in st_store.h.
 *
 * Invariants:
 * 1. Routing. A key's slot is CRC16-XMODEM of the key, or of its hash tag (the bytes between the
 *    first '{' and the next '}', when not empty), mod 16384: Redis Cluster's rule, checked against
 *    the servers' CLUSTER KEYSLOT by tests/tier. The slot map names the master of each slot as the
 *    last CLUSTER SLOTS reply gave it; a server without cluster support owns every slot.
 * 2. Redirects. MOVED updates the slot's owner and is retried there; ASK is retried once at the
 *    node it names, preceded by ASKING, without touching the map; TRYAGAIN, CLUSTERDOWN, LOADING
 *    and a lost connection wait a little (10 ms, doubling to 200) and refresh the map first. A
 *    command gives up after ST_TIER_REDIRECTS_MAX redirects or when its retry budget (the
 *    options' retry_ms) is spent, with ST_EIO naming the last node and what it said. Only
 *    idempotent commands are sent (SET NX of content-addressed or immutable values, GET, EXISTS,
 *    compare-and-set scripts, PEXPIRE under a token): a retry after a lost reply cannot apply a
 *    change twice in a way the caller would see (a CAS whose reply was lost reports a conflict
 *    on its retry, and the caller reads the head again).
 * 3. Values are checked: a chunk read back hashes to the SHA-256 it is stored under (else
 *    ST_ECORRUPT), and no reply larger than the caller's bound is copied out (ST_ETOOBIG).
 * 4. Durability. Each node's connection remembers that it wrote since its last WAIT;
 *    st_tier_sync sends WAIT to each such node, so an acknowledged write is on a replica too
 *    (Redis replicates asynchronously; WAIT is what makes a failover keep it).
 * 5. Threads. hiredis's async client on its libevent adapter does the I/O, on one event loop
 *    thread that owns every connection (one per node, shared by all callers: their commands are
 *    pipelined on it). A caller's command is a request queued to that thread (woken through a
 *    pipe); the caller waits for its reply, at most timeout_ms, and on a timeout the connection
 *    is dropped (every request on it answered "no reply") and made again by the next command.
 *    One mutex guards the slot map, the node table, the queue and the requests; a caller holds
 *    it except while it waits, so several callers' commands are in flight at once and the map
 *    is never seen half updated. The loop thread takes it for each batch of the queue and each
 *    reply; replies are moved out of hiredis's (which frees its own after the callback), not
 *    copied. Sequence numbers in wire order per connection tell WAIT which writes it covers
 *    (invariant 4), so that one caller's WAIT never clears another's unconfirmed write.
 * 6. Key layout (every key under the prefix "st:"): chunks "st:c:<sha-256 hex>" (no hash tag:
 *    chunks spread over the slots), a version's manifest "st:m:{<id>}:<version>", the head
 *    "st:h:{<id>}" and the lease "st:l:{<id>}": a session's small keys share one slot, so a
 *    script may read and write them together. Session ids are the store's (st_store_id_valid:
 *    no braces), so the tag is exactly the id. Garbage collection (opts.ttl_s > 0): every key
 *    is written with that TTL under noeviction; a manifest and a head when written, a chunk when
 *    written and whenever it is put again (its TTL set anew, written or not). A push puts every
 *    chunk its manifest names before the manifest, so a chunk outlives every manifest that names
 *    it, and a conversation not saved for ttl_s seconds leaves the tier whole: its head, its
 *    manifests, and the chunks no newer manifest names. Nothing is deleted by name, so a reader
 *    never meets a manifest whose chunks were collected.
 * 7. The holder record "st:o:{<id>}" = "owner park" names the node that last took the
 *    conversation's lease (set by the take's script, atomically with the lease: same slot) and,
 *    once that node parked the conversation into the tier under that lease (st_tier_holder_park,
 *    under the lease's token), the tier version of session "park:<id>" that holds it; a take
 *    resets park to 0. So the record says where the conversation's newest state is: in the park
 *    it names, or live on the node it names (or lost with it), or, for any other node, in its
 *    head. Written with the TTL of invariant 6. A take is idempotent under its token: the
 *    script keeps the record it replaced in "st:p:{<id>}" for the lease's TTL, and a run that
 *    finds the lease held under its own value (the client's retry after a lost reply) returns
 *    that record again, so the retried take still sees the handover.
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_store.h"

#if ST_HAVE_TIER
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <event2/event.h>
#include <hiredis/adapters/libevent.h>
#include <hiredis/async.h>
#include <hiredis/hiredis.h>
#endif

#define ST_TIER_SLOTS 16384
#define ST_TIER_NODES_MAX 64
#define ST_TIER_REDIRECTS_MAX 16
#define ST_TIER_HOST_MAX 255

/* ---- the slot of a key (invariant 1) ---------------------------------------------------------- */
static uint16_t crc16_xmodem(const uint8_t *p, size_t n)
{
    uint16_t crc = 0;
    for (size_t i = 0; i < n; i++) {
        crc ^= (uint16_t)((uint16_t)p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

uint32_t st_tier_key_slot(const void *key, size_t n)
{
    const uint8_t *k = key;
    for (size_t i = 0; i < n; i++)
        if (k[i] == '{') {
            for (size_t j = i + 1; j < n; j++)
                if (k[j] == '}') {
                    if (j > i + 1)
                        return crc16_xmodem(k + i + 1, j - i - 1) & (ST_TIER_SLOTS - 1);
                    break;
                }
            break;
        }
    return crc16_xmodem(k, n) & (ST_TIER_SLOTS - 1);
}

void st_tier_opts_default(st_tier_opts *o)
{
    memset(o, 0, sizeof *o);
    o->timeout_ms = 1000;
    o->retry_ms = 5000;
}

#if !ST_HAVE_TIER
/* ---- built without hiredis -------------------------------------------------------------------- */
static int no_tier(void)
{
    return st_error_set(ST_EINVAL, "tier: this build has no Redis client (hiredis was not found "
                                   "when it was configured)");
}

int st_tier_open(st_tier **out, const char *url, const st_tier_opts *o)
{
    (void)url, (void)o;
    *out = NULL;
    return no_tier();
}
void st_tier_close(st_tier *t) { (void)t; }
int st_tier_chunk_put(st_tier *t, const uint8_t sha[ST_SHA256_LEN], const void *p, size_t n,
                      int *written)
{
    (void)t, (void)sha, (void)p, (void)n, (void)written;
    return no_tier();
}
int st_tier_chunk_get(st_tier *t, const uint8_t sha[ST_SHA256_LEN], size_t max, void **p,
                      size_t *n)
{
    (void)t, (void)sha, (void)max, (void)p, (void)n;
    return no_tier();
}
int st_tier_chunk_get_into(st_tier *t, const uint8_t sha[ST_SHA256_LEN], void *dst, size_t cap,
                           size_t *n)
{
    (void)t, (void)sha, (void)dst, (void)cap, (void)n;
    return no_tier();
}
int st_tier_chunk_exists(st_tier *t, const uint8_t sha[ST_SHA256_LEN], int *exists)
{
    (void)t, (void)sha, (void)exists;
    return no_tier();
}
int st_tier_manifest_put(st_tier *t, const char *id, uint64_t version, const void *p, size_t n)
{
    (void)t, (void)id, (void)version, (void)p, (void)n;
    return no_tier();
}
int st_tier_manifest_get(st_tier *t, const char *id, uint64_t version, size_t max, void **p,
                         size_t *n)
{
    (void)t, (void)id, (void)version, (void)max, (void)p, (void)n;
    return no_tier();
}
int st_tier_head_get(st_tier *t, const char *id, uint64_t *version)
{
    (void)t, (void)id, (void)version;
    return no_tier();
}
int st_tier_head_cas(st_tier *t, const char *id, uint64_t expect, uint64_t next, uint64_t *cur)
{
    (void)t, (void)id, (void)expect, (void)next, (void)cur;
    return no_tier();
}
int st_tier_lease_take(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                       char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    (void)t, (void)id, (void)owner, (void)ttl_ms, (void)token, (void)prev;
    return no_tier();
}
int st_tier_holder_park(st_tier *t, const char *id, const char *token, uint64_t park)
{
    (void)t, (void)id, (void)token, (void)park;
    return no_tier();
}
int st_tier_lease_take_held(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                            char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    (void)t, (void)id, (void)owner, (void)ttl_ms, (void)token, (void)prev;
    return no_tier();
}
int st_tier_holder_get(st_tier *t, const char *id, st_tier_holder *h)
{
    (void)t, (void)id, (void)h;
    return no_tier();
}
int st_tier_lease_renew(st_tier *t, const char *id, const char *token, uint32_t ttl_ms)
{
    (void)t, (void)id, (void)token, (void)ttl_ms;
    return no_tier();
}
int st_tier_lease_takeover(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                           char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    (void)t, (void)id, (void)owner, (void)ttl_ms, (void)token, (void)prev;
    return no_tier();
}
int st_tier_lease_release(st_tier *t, const char *id, const char *token)
{
    (void)t, (void)id, (void)token;
    return no_tier();
}
int st_tier_lease_owner(st_tier *t, const char *id, char *owner, size_t cap, int64_t *ttl_ms)
{
    (void)t, (void)id, (void)owner, (void)cap, (void)ttl_ms;
    return no_tier();
}
int st_tier_sync(st_tier *t, uint32_t replicas, uint32_t timeout_ms)
{
    (void)t, (void)replicas, (void)timeout_ms;
    return no_tier();
}
void st_tier_stats_get(st_tier *t, st_tier_stats *s)
{
    (void)t;
    memset(s, 0, sizeof *s);
}
#else

/* ---- the client ------------------------------------------------------------------------------ */
struct st_tier;

typedef struct tnode {
    char host[ST_TIER_HOST_MAX + 1];
    int port;
    struct st_tier *t;
    redisAsyncContext *ac; /* the loop thread's (invariant 5); NULL: not connected */
    uint64_t gen;          /* connections made to it: a request's seq counts in one of them */
    uint64_t sent;         /* requests sent on the current connection, in wire order */
    uint64_t wseq, cseq;   /* invariant 4: the last write answered, the last one WAIT covered */
    int drop;              /* a caller timed out: the loop thread drops the connection */
} tnode;

/* One command of a caller, queued to the loop thread (invariant 5). */
typedef struct treq {
    struct treq *next;
    int node, asking, argc, done, abandoned, refs; /* refs: the caller's and the loop's */
    const char **argv;     /* the caller's, read only while it waits */
    const size_t *lens;
    redisReply *reply;     /* moved out of hiredis's reply */
    uint64_t seq, gen;     /* where it went on the wire */
    char why[256];         /* no reply: what happened */
    pthread_cond_t cv;
} treq;

struct st_tier {
    pthread_mutex_t mu; /* invariant 5 */
    st_tier_opts o;
    int cluster;                       /* 0: one server without cluster support */
    tnode nodes[ST_TIER_NODES_MAX];    /* seeds first, then the masters CLUSTER SLOTS names */
    uint32_t n_nodes, n_seeds;
    uint16_t slot[ST_TIER_SLOTS];      /* the master of each slot: an index into nodes */
    uint64_t epoch;                    /* a counter the lease tokens draw from */
    int unconfirmed;                   /* invariant 4: a written connection was lost */
    st_tier_stats st;
    /* the loop thread */
    struct event_base *base;
    struct event *wake_ev;
    int wake[2];
    pthread_t loop;
    int loop_on, stopping;
    int loop_holds_mu; /* read and written by the loop thread only: hiredis may call back
                          synchronously while it holds mu (a connection freed) */
    treq *q, *q_tail;
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec * 1e-6;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void loop_wake(st_tier *t)
{
    char c = 1;
    ssize_t w = write(t->wake[1], &c, 1); /* full: the loop is awake already */
    (void)w;
}

static void req_unref_locked(treq *q)
{
    if (--q->refs)
        return;
    if (q->reply)
        freeReplyObject(q->reply);
    pthread_cond_destroy(&q->cv);
    free(q);
}

static void req_finish_locked(treq *q)
{
    q->done = 1;
    pthread_cond_signal(&q->cv);
    req_unref_locked(q);
}

/* A connection gone (mu held): writes it made since its last WAIT can no longer be confirmed
 * (WAIT counts one connection's writes), so the next st_tier_sync fails (invariant 4). */
static void node_lost_locked(st_tier *t, tnode *n)
{
    if (n->wseq > n->cseq)
        t->unconfirmed = 1;
    n->ac = NULL;
    n->sent = n->wseq = n->cseq = 0;
}

static void lock_cb(st_tier *t)
{
    if (!t->loop_holds_mu)
        pthread_mutex_lock(&t->mu);
}

static void unlock_cb(st_tier *t)
{
    if (!t->loop_holds_mu)
        pthread_mutex_unlock(&t->mu);
}

static void on_connect(const redisAsyncContext *ac, int status)
{
    tnode *n = ac->data;
    st_tier *t = n->t;
    lock_cb(t);
    if (status != REDIS_OK) {
        if (n->ac == ac) /* hiredis frees it after this */
            node_lost_locked(t, n);
    } else {
        t->st.connects++;
    }
    unlock_cb(t);
}

static void on_disconnect(const redisAsyncContext *ac, int status)
{
    (void)status;
    tnode *n = ac->data;
    st_tier *t = n->t;
    lock_cb(t);
    if (n->ac == ac)
        node_lost_locked(t, n);
    unlock_cb(t);
}

static void on_reply(redisAsyncContext *ac, void *r, void *priv)
{
    tnode *n = ac->data;
    st_tier *t = n->t;
    treq *q = priv;
    lock_cb(t);
    if (r) {
        /* moved out: hiredis frees the husk (a nil reply) when this returns */
        redisReply *src = r, *dst = malloc(sizeof *dst);
        if (dst) {
            *dst = *src;
            src->type = REDIS_REPLY_NIL;
            src->str = NULL;
            src->len = 0;
            src->element = NULL;
            src->elements = 0;
            q->reply = dst;
        } else {
            snprintf(q->why, sizeof q->why, "out of memory for a reply");
        }
    } else {
        snprintf(q->why, sizeof q->why, "%s", ac->errstr[0] ? ac->errstr : "connection lost");
    }
    req_finish_locked(q);
    unlock_cb(t);
}

/* The node's connection, made if it has none (loop thread, mu held); NULL with why. */
static redisAsyncContext *node_ac(st_tier *t, tnode *n, char *why, size_t cap)
{
    if (n->ac)
        return n->ac;
    redisAsyncContext *ac = redisAsyncConnect(n->host, n->port);
    if (!ac) {
        snprintf(why, cap, "out of memory");
        return NULL;
    }
    if (ac->err) {
        snprintf(why, cap, "%s", ac->errstr);
        redisAsyncFree(ac);
        return NULL;
    }
    ac->data = n;
    if (redisLibeventAttach(ac, t->base) != REDIS_OK) {
        snprintf(why, cap, "the event loop refused the connection");
        redisAsyncFree(ac);
        return NULL;
    }
    redisAsyncSetConnectCallback(ac, on_connect);
    redisAsyncSetDisconnectCallback(ac, on_disconnect);
    n->ac = ac;
    n->gen++;
    n->sent = n->wseq = n->cseq = 0;
    return ac;
}

/* The loop thread: connections dropped on request, the queue sent, the stop. */
static void on_wake(evutil_socket_t fd, short what, void *arg)
{
    (void)what;
    st_tier *t = arg;
    char buf[256];
    while (read(fd, buf, sizeof buf) > 0) {
    }
    pthread_mutex_lock(&t->mu);
    t->loop_holds_mu = 1;
    for (uint32_t i = 0; i < t->n_nodes; i++) {
        tnode *n = &t->nodes[i];
        if ((n->drop || t->stopping) && n->ac) {
            redisAsyncContext *ac = n->ac;
            node_lost_locked(t, n);
            redisAsyncFree(ac); /* its requests are answered "no reply" now */
        }
        n->drop = 0;
    }
    treq *q;
    while ((q = t->q)) {
        t->q = q->next;
        if (!t->q)
            t->q_tail = NULL;
        if (q->abandoned) {
            req_unref_locked(q);
            continue;
        }
        if (t->stopping) {
            snprintf(q->why, sizeof q->why, "the client is closing");
            req_finish_locked(q);
            continue;
        }
        tnode *n = &t->nodes[q->node];
        redisAsyncContext *ac = node_ac(t, n, q->why, sizeof q->why);
        if (ac && q->asking && redisAsyncCommand(ac, NULL, NULL, "ASKING") != REDIS_OK) {
            snprintf(q->why, sizeof q->why, "%s", ac->errstr[0] ? ac->errstr : "not sent");
            ac = NULL;
        }
        if (ac && redisAsyncCommandArgv(ac, on_reply, q, q->argc, q->argv, q->lens) == REDIS_OK) {
            q->seq = ++n->sent;
            q->gen = n->gen;
        } else {
            if (ac)
                snprintf(q->why, sizeof q->why, "%s", ac->errstr[0] ? ac->errstr : "not sent");
            req_finish_locked(q);
        }
    }
    if (t->stopping)
        event_base_loopbreak(t->base);
    t->loop_holds_mu = 0;
    pthread_mutex_unlock(&t->mu);
}

static void *loop_main(void *arg)
{
    st_tier *t = arg;
    sigset_t ss; /* a write to a closed socket fails with EPIPE here, and kills nothing */
    sigemptyset(&ss);
    sigaddset(&ss, SIGPIPE);
    pthread_sigmask(SIG_BLOCK, &ss, NULL);
    event_base_dispatch(t->base);
    return NULL;
}

/* One command on node ni (ASKING first with asking), mu held: its reply (the caller frees), or
 * NULL with why when none came in timeout_ms (the connection is dropped) or the connection
 * failed. *seq and *gen: where it went on the wire (invariant 4). Waiting releases mu. */
static redisReply *node_cmd(st_tier *t, int ni, int asking, int argc, const char **argv,
                            const size_t *lens, uint32_t timeout_ms, uint64_t *seq, uint64_t *gen,
                            char *why, size_t cap)
{
    treq *q = calloc(1, sizeof *q);
    if (!q) {
        snprintf(why, cap, "out of memory");
        return NULL;
    }
    q->node = ni;
    q->asking = asking;
    q->argc = argc;
    q->argv = argv;
    q->lens = lens;
    q->refs = 2;
    pthread_cond_init(&q->cv, NULL);
    if (t->q_tail)
        t->q_tail->next = q;
    else
        t->q = q;
    t->q_tail = q;
    loop_wake(t);
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)timeout_ms * 1000000ull;
    ts.tv_sec += (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    while (!q->done)
        if (pthread_cond_timedwait(&q->cv, &t->mu, &ts) == ETIMEDOUT)
            break;
    redisReply *r = NULL;
    if (q->done) {
        r = q->reply;
        q->reply = NULL;
        *seq = q->seq;
        *gen = q->gen;
        if (!r)
            snprintf(why, cap, "%s", q->why);
    } else {
        q->abandoned = 1; /* the loop frees it (its reply, if any, comes to nobody) */
        t->nodes[ni].drop = 1;
        loop_wake(t);
        snprintf(why, cap, "no reply in %u ms", timeout_ms);
    }
    req_unref_locked(q);
    return r;
}

/* A write answered on node n (mu held): WAIT must cover it (invariant 4). */
static void node_written(st_tier *t, tnode *n, uint64_t seq, uint64_t gen)
{
    if (gen != n->gen || !n->ac) {
        t->unconfirmed = 1; /* its connection is gone already */
        return;
    }
    if (seq > n->wseq)
        n->wseq = seq;
}

/* The index of host:port in the node table, added if new; -1 when the table is full. */
static int node_find(st_tier *t, const char *host, size_t hl, int port)
{
    for (uint32_t i = 0; i < t->n_nodes; i++)
        if (t->nodes[i].port == port && strlen(t->nodes[i].host) == hl &&
            !memcmp(t->nodes[i].host, host, hl))
            return (int)i;
    if (t->n_nodes == ST_TIER_NODES_MAX || hl == 0 || hl > ST_TIER_HOST_MAX)
        return -1;
    tnode *n = &t->nodes[t->n_nodes];
    memcpy(n->host, host, hl);
    n->host[hl] = 0;
    n->port = port;
    n->t = t;
    n->ac = NULL;
    n->gen = n->sent = n->wseq = n->cseq = 0;
    n->drop = 0;
    return (int)t->n_nodes++;
}

/* "host:port" (the form MOVED, ASK and the options use): 0, or -1 if malformed. */
static int parse_hostport(const char *s, size_t len, const char **host, size_t *hl, int *port)
{
    size_t colon = len;
    for (size_t i = len; i > 0; i--)
        if (s[i - 1] == ':') {
            colon = i - 1;
            break;
        }
    if (colon == len || colon == 0 || colon + 1 == len || len - colon > 6)
        return -1;
    long p = 0;
    for (size_t i = colon + 1; i < len; i++) {
        if (s[i] < '0' || s[i] > '9')
            return -1;
        p = p * 10 + (s[i] - '0');
    }
    if (p < 1 || p > 65535)
        return -1;
    *host = s;
    *hl = colon;
    *port = (int)p;
    return 0;
}

/* The slot map from one node's CLUSTER SLOTS: 0, 1 if that node has no cluster support (it owns
 * every slot), -1 if it could not be read (why says so). */
static int refresh_from(st_tier *t, uint32_t ni, char *why, size_t cap)
{
    static const char *argv[] = {"CLUSTER", "SLOTS"};
    static const size_t lens[] = {7, 5};
    uint64_t seq, gen;
    char w[256];
    redisReply *r = node_cmd(t, (int)ni, 0, 2, argv, lens, t->o.timeout_ms, &seq, &gen, w, sizeof w);
    if (!r) {
        snprintf(why, cap, "%.64s:%d: %.160s", t->nodes[ni].host, t->nodes[ni].port, w);
        return -1;
    }
    int rc = -1;
    if (r->type == REDIS_REPLY_ERROR) {
        if (strstr(r->str, "cluster support disabled")) {
            for (uint32_t s = 0; s < ST_TIER_SLOTS; s++)
                t->slot[s] = (uint16_t)ni;
            t->cluster = 0;
            rc = 1;
        } else {
            snprintf(why, cap, "CLUSTER SLOTS: %s", r->str);
        }
        freeReplyObject(r);
        return rc;
    }
    if (r->type != REDIS_REPLY_ARRAY || r->elements == 0) {
        snprintf(why, cap, "CLUSTER SLOTS: %s", r->type == REDIS_REPLY_ARRAY ? "no slots served"
                                                                             : "not an array");
        freeReplyObject(r);
        return -1;
    }
    uint16_t map[ST_TIER_SLOTS];
    for (uint32_t s = 0; s < ST_TIER_SLOTS; s++)
        map[s] = UINT16_MAX;
    for (size_t i = 0; i < r->elements; i++) {
        redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER || e->element[1]->type != REDIS_REPLY_INTEGER ||
            e->element[2]->type != REDIS_REPLY_ARRAY || e->element[2]->elements < 2 ||
            e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER) {
            snprintf(why, cap, "CLUSTER SLOTS: entry %zu is malformed", i);
            freeReplyObject(r);
            return -1;
        }
        long long a = e->element[0]->integer, b = e->element[1]->integer;
        redisReply *m = e->element[2];
        const char *host = m->element[0]->str;
        size_t hl = m->element[0]->len;
        long long port = m->element[1]->integer;
        if (hl == 0) { /* an empty host: the node we asked, at the port given */
            host = t->nodes[ni].host;
            hl = strlen(host);
        }
        if (a < 0 || b >= ST_TIER_SLOTS || a > b || port < 1 || port > 65535) {
            snprintf(why, cap, "CLUSTER SLOTS: entry %zu names slots %lld-%lld at port %lld", i,
                     a, b, port);
            freeReplyObject(r);
            return -1;
        }
        int k = node_find(t, host, hl, (int)port);
        if (k < 0) {
            snprintf(why, cap, "CLUSTER SLOTS: more than %d nodes", ST_TIER_NODES_MAX);
            freeReplyObject(r);
            return -1;
        }
        for (long long s = a; s <= b; s++)
            map[s] = (uint16_t)k;
    }
    freeReplyObject(r);
    memcpy(t->slot, map, sizeof map);
    t->cluster = 1;
    return 0;
}

/* A new slot map from the first node that gives one (the masters known, then the seeds). */
static int refresh(st_tier *t, char *why, size_t cap)
{
    t->st.refreshes++;
    char w[256] = "no node";
    for (uint32_t i = 0; i < t->n_nodes; i++) {
        int rc = refresh_from(t, i, w, sizeof w);
        if (rc >= 0)
            return 0;
    }
    snprintf(why, cap, "%s", w);
    return -1;
}

enum { RP_OK, RP_MOVED, RP_ASK, RP_RETRY };

/* What an error reply asks for (invariant 2); for MOVED and ASK the node in *to. */
static int classify(st_tier *t, const redisReply *r, int *to)
{
    if (r->type != REDIS_REPLY_ERROR)
        return RP_OK;
    int moved = !strncmp(r->str, "MOVED ", 6), ask = !strncmp(r->str, "ASK ", 4);
    if (moved || ask) {
        const char *sp = strchr(r->str + (moved ? 6 : 4), ' ');
        const char *host;
        size_t hl;
        int port;
        if (sp && !parse_hostport(sp + 1, strlen(sp + 1), &host, &hl, &port)) {
            if (hl == 0)
                return RP_RETRY;
            *to = node_find(t, host, hl, port);
            if (*to >= 0)
                return moved ? RP_MOVED : RP_ASK;
        }
        return RP_RETRY;
    }
    if (!strncmp(r->str, "TRYAGAIN", 8) || !strncmp(r->str, "CLUSTERDOWN", 11) ||
        !strncmp(r->str, "LOADING", 7) || !strncmp(r->str, "MASTERDOWN", 10))
        return RP_RETRY;
    return RP_OK; /* an answer: the caller reads the error */
}

/* Runs argv at the master of key's slot, following redirects (invariant 2): the reply (caller
 * frees; may be an error reply the command itself gave), or NULL with ST_EIO set. write: the
 * command writes (invariant 4). mu held; released while the command waits (invariant 5). */
static redisReply *tier_cmd(st_tier *t, const char *key, size_t klen, int argc, const char **argv,
                            const size_t *lens, int write, int *rc)
{
    uint32_t slot = st_tier_key_slot(key, klen);
    double deadline = now_ms() + t->o.retry_ms;
    unsigned backoff = 10;
    int ask_to = -1, redirects = 0;
    char why[1024] = "";
    for (;;) {
        int ni = ask_to >= 0 ? ask_to : t->slot[slot];
        if (ni == UINT16_MAX) {
            snprintf(why, sizeof why, "slot %u has no master in the cluster's map", slot);
        } else {
            tnode *n = &t->nodes[ni];
            char cw[256];
            uint64_t seq = 0, gen = 0;
            redisReply *r = node_cmd(t, ni, ask_to >= 0, argc, argv, lens, t->o.timeout_ms, &seq,
                                     &gen, cw, sizeof cw);
            if (!r) {
                snprintf(why, sizeof why, "%s:%d: %s", n->host, n->port, cw);
                t->st.errors++;
            } else {
                int to = -1, k = classify(t, r, &to);
                if (k == RP_OK) {
                    if (write)
                        node_written(t, n, seq, gen);
                    t->st.commands++;
                    return r;
                }
                snprintf(why, sizeof why, "%s:%d: %s", n->host, n->port, r->str);
                freeReplyObject(r);
                ask_to = -1;
                if (k == RP_MOVED || k == RP_ASK) {
                    if (++redirects > ST_TIER_REDIRECTS_MAX)
                        break;
                    if (k == RP_MOVED) {
                        t->slot[slot] = (uint16_t)to;
                        t->st.moved++;
                    } else {
                        ask_to = to;
                        t->st.asked++;
                    }
                    continue;
                }
                t->st.retries++;
            }
        }
        ask_to = -1;
        if (now_ms() + backoff > deadline)
            break;
        pthread_mutex_unlock(&t->mu); /* other callers go on meanwhile */
        sleep_ms(backoff);
        pthread_mutex_lock(&t->mu);
        backoff = backoff < 100 ? backoff * 2 : 200;
        char rw[256];
        if (refresh(t, rw, sizeof rw))
            snprintf(why + strlen(why), sizeof why - strlen(why), "; topology: %s", rw);
    }
    *rc = st_error_set(ST_EIO, "tier: %s (gave up after %u ms and %d redirects)", why,
                       t->o.retry_ms, redirects);
    return NULL;
}

/* ---- opening -------------------------------------------------------------------------------- */
int st_tier_open(st_tier **out, const char *url, const st_tier_opts *o)
{
    *out = NULL;
    static const char scheme[] = "redis://";
    if (!url || strncmp(url, scheme, sizeof scheme - 1))
        return st_error_set(ST_EINVAL, "tier: %s: not a redis://HOST:PORT[,HOST:PORT...] address",
                            url ? url : "(none)");
    st_tier *t = calloc(1, sizeof *t);
    if (!t)
        return st_error_set(ENOMEM, "tier");
    if (o)
        t->o = *o;
    else
        st_tier_opts_default(&t->o);
    if (!t->o.timeout_ms)
        t->o.timeout_ms = 1000;
    for (uint32_t s = 0; s < ST_TIER_SLOTS; s++)
        t->slot[s] = UINT16_MAX;
    pthread_mutex_init(&t->mu, NULL);
    t->wake[0] = t->wake[1] = -1;
    int rc = 0;
    if (pipe(t->wake) || fcntl(t->wake[0], F_SETFL, O_NONBLOCK) ||
        fcntl(t->wake[1], F_SETFL, O_NONBLOCK) || fcntl(t->wake[0], F_SETFD, FD_CLOEXEC) ||
        fcntl(t->wake[1], F_SETFD, FD_CLOEXEC)) {
        rc = st_error_set(errno ? errno : EIO, "tier: the event loop's pipe: %s", strerror(errno));
        goto fail;
    }
    if (!(t->base = event_base_new()) ||
        !(t->wake_ev = event_new(t->base, t->wake[0], EV_READ | EV_PERSIST, on_wake, t)) ||
        event_add(t->wake_ev, NULL)) {
        rc = st_error_set(ENOMEM, "tier: the event loop");
        goto fail;
    }
    if ((rc = pthread_create(&t->loop, NULL, loop_main, t))) {
        rc = st_error_set(rc, "tier: the event loop's thread");
        goto fail;
    }
    t->loop_on = 1;
    const char *p = url + sizeof scheme - 1;
    while (*p) {
        const char *e = strchr(p, ',');
        size_t len = e ? (size_t)(e - p) : strlen(p);
        const char *host;
        size_t hl;
        int port;
        if (parse_hostport(p, len, &host, &hl, &port) || hl > ST_TIER_HOST_MAX) {
            rc = st_error_set(ST_EINVAL, "tier: %s: seed %u ('%.*s') is not HOST:PORT", url,
                              t->n_nodes + 1, (int)(len < 300 ? len : 300), p);
            goto fail;
        }
        if (node_find(t, host, hl, port) < 0) {
            rc = st_error_set(ST_EINVAL, "tier: %s: more than %d seeds", url, ST_TIER_NODES_MAX);
            goto fail;
        }
        if (!e)
            break;
        p = e + 1;
    }
    if (!t->n_nodes) {
        rc = st_error_set(ST_EINVAL, "tier: %s: no HOST:PORT", url);
        goto fail;
    }
    t->n_seeds = t->n_nodes;
    t->epoch = (uint64_t)time(NULL) << 20;
    char why[256];
    pthread_mutex_lock(&t->mu);
    int frc = refresh(t, why, sizeof why);
    pthread_mutex_unlock(&t->mu);
    if (frc) {
        rc = st_error_set(ST_EIO, "tier: %s: no seed answered: %s", url, why);
        goto fail;
    }
    *out = t;
    return 0;
fail:
    st_tier_close(t);
    return rc;
}

void st_tier_close(st_tier *t)
{
    if (!t)
        return;
    if (t->loop_on) { /* the loop frees every connection and stops */
        pthread_mutex_lock(&t->mu);
        t->stopping = 1;
        loop_wake(t);
        pthread_mutex_unlock(&t->mu);
        pthread_join(t->loop, NULL);
    }
    if (t->wake_ev)
        event_free(t->wake_ev);
    if (t->base)
        event_base_free(t->base);
    for (int i = 0; i < 2; i++)
        if (t->wake[i] >= 0)
            close(t->wake[i]);
    pthread_mutex_destroy(&t->mu);
    free(t);
}

/* ---- keys (invariant 6) ------------------------------------------------------------------- */
static int id_ok(const char *id)
{
    if (!id || !st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "tier: session id '%.128s' is not valid", id ? id : "");
    return 0;
}

static size_t key_chunk(char *k, const uint8_t sha[ST_SHA256_LEN])
{
    memcpy(k, "st:c:", 5);
    st_hex_encode(k + 5, sha, ST_SHA256_LEN);
    return 5 + 2 * ST_SHA256_LEN;
}

/* the bytes of a reply string copied into a new buffer of at most max bytes */
static int reply_copy(const redisReply *r, size_t max, const char *what, void **p, size_t *n)
{
    if (r->len > max)
        return st_error_set(ST_ETOOBIG, "tier: %s is %zu bytes (at most %zu)", what, r->len, max);
    void *b = malloc(r->len ? r->len : 1);
    if (!b)
        return st_error_set(ENOMEM, "tier: %s of %zu bytes", what, r->len);
    memcpy(b, r->str, r->len);
    *p = b;
    *n = r->len;
    return 0;
}

static int unexpected(const redisReply *r, const char *what)
{
    if (r->type == REDIS_REPLY_ERROR)
        return st_error_set(ST_EIO, "tier: %s: %s", what, r->str);
    return st_error_set(ST_EIO, "tier: %s: an unexpected reply (type %d)", what, r->type);
}

/* ---- chunks --------------------------------------------------------------------------------- */
int st_tier_chunk_put(st_tier *t, const uint8_t sha[ST_SHA256_LEN], const void *p, size_t n,
                      int *written)
{
    char k[80], ttl[16];
    size_t kl = key_chunk(k, sha);
    int tl = snprintf(ttl, sizeof ttl, "%u", t->o.ttl_s);
    /* with a TTL (invariant 6): written with it if absent, else its TTL set again, so that a
     * chunk outlives every manifest written since that names it */
    static const char lua[] =
        "if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'EX', ARGV[2]) then return 1 end "
        "redis.call('EXPIRE', KEYS[1], ARGV[2]) return 0";
    const char *argv_nx[] = {"SET", k, p, "NX"};
    const size_t lens_nx[] = {3, kl, n, 2};
    const char *argv_ttl[] = {"EVAL", lua, "1", k, p, ttl};
    const size_t lens_ttl[] = {4, sizeof lua - 1, 1, kl, n, (size_t)tl};
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    redisReply *r = t->o.ttl_s ? tier_cmd(t, k, kl, 6, argv_ttl, lens_ttl, 1, &rc)
                               : tier_cmd(t, k, kl, 4, argv_nx, lens_nx, 1, &rc);
    if (r) {
        if (r->type == REDIS_REPLY_STATUS || (r->type == REDIS_REPLY_INTEGER && r->integer == 1)) {
            if (written)
                *written = 1;
            t->st.bytes_written += n;
        } else if (r->type == REDIS_REPLY_NIL || r->type == REDIS_REPLY_INTEGER) {
            if (written) /* present already: content-addressed */
                *written = 0;
        } else {
            rc = unexpected(r, "SET NX of a chunk");
        }
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* A chunk's GET: into dst (cap bytes) when dst is given, else into a new buffer of at most cap
 * bytes (*alloc); then its bytes checked against sha (invariant 3). On an error nothing is
 * allocated and *n is 0. */
static int chunk_fetch(st_tier *t, const uint8_t sha[ST_SHA256_LEN], void *dst, size_t cap,
                       void **alloc, size_t *n)
{
    *n = 0;
    if (alloc)
        *alloc = NULL;
    char k[80], hex[2 * ST_SHA256_LEN + 1];
    size_t kl = key_chunk(k, sha);
    memcpy(hex, k + 5, sizeof hex - 1);
    hex[sizeof hex - 1] = 0;
    const char *argv[] = {"GET", k};
    const size_t lens[] = {3, kl};
    int rc = 0;
    void *got_p = NULL;
    size_t got_n = 0;
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, kl, 2, argv, lens, 0, &rc);
    if (r) {
        if (r->type == REDIS_REPLY_NIL) {
            rc = st_error_set(ST_ENOTFOUND, "tier: chunk %.16s...: not in the tier", hex);
        } else if (r->type != REDIS_REPLY_STRING) {
            rc = unexpected(r, "GET of a chunk");
        } else if (!dst) {
            rc = reply_copy(r, cap, "a chunk", &got_p, &got_n);
        } else if (r->len > cap) {
            rc = st_error_set(ST_ETOOBIG, "tier: a chunk is %zu bytes (at most %zu)", r->len, cap);
        } else {
            memcpy(dst, r->str, r->len);
            got_p = dst;
            got_n = r->len;
        }
        if (!rc)
            t->st.bytes_read += got_n;
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    if (!rc) {
        uint8_t got[ST_SHA256_LEN];
        rc = st_sha256(got_p, got_n, got);
        if (!rc && memcmp(got, sha, ST_SHA256_LEN)) {
            char gh[2 * ST_SHA256_LEN + 1];
            st_hex_encode(gh, got, ST_SHA256_LEN);
            gh[2 * ST_SHA256_LEN] = 0;
            rc = st_error_set(ST_ECORRUPT, "tier: chunk %.16s...: its %zu bytes hash to "
                              "%.16s...", hex, got_n, gh);
        }
    }
    if (rc) {
        if (!dst)
            free(got_p);
        return rc;
    }
    if (alloc)
        *alloc = got_p;
    *n = got_n;
    return 0;
}

int st_tier_chunk_get(st_tier *t, const uint8_t sha[ST_SHA256_LEN], size_t max, void **p,
                      size_t *n)
{
    return chunk_fetch(t, sha, NULL, max, p, n);
}

/* A chunk straight into the caller's buffer (no copy of its own). */
int st_tier_chunk_get_into(st_tier *t, const uint8_t sha[ST_SHA256_LEN], void *dst, size_t cap,
                           size_t *n)
{
    return dst ? chunk_fetch(t, sha, dst, cap, NULL, n)
               : st_error_set(ST_EINVAL, "tier: a chunk into no buffer");
}

int st_tier_chunk_exists(st_tier *t, const uint8_t sha[ST_SHA256_LEN], int *exists)
{
    char k[80];
    size_t kl = key_chunk(k, sha);
    const char *argv[] = {"EXISTS", k};
    const size_t lens[] = {6, kl};
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, kl, 2, argv, lens, 0, &rc);
    if (r) {
        if (r->type == REDIS_REPLY_INTEGER)
            *exists = r->integer > 0;
        else
            rc = unexpected(r, "EXISTS of a chunk");
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- manifests -------------------------------------------------------------------------------- */
int st_tier_manifest_put(st_tier *t, const char *id, uint64_t version, const void *p, size_t n)
{
    int rc = id_ok(id);
    if (rc)
        return rc;
    if (!version)
        return st_error_set(ST_EINVAL, "tier: %s: version 0 is not a version", id);
    char k[200];
    int kl = snprintf(k, sizeof k, "st:m:{%s}:%llu", id, (unsigned long long)version);
    /* immutable: written once; the same bytes again are a retry, other bytes a conflict; with a
     * TTL (invariant 6; ARGV[2] "0": none) written with it */
    static const char lua[] =
        "local c = redis.call('GET', KEYS[1]) "
        "if c == false then "
        "if ARGV[2] == '0' then redis.call('SET', KEYS[1], ARGV[1]) "
        "else redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2]) end return 1 end "
        "if c == ARGV[1] then return 0 end return -1";
    char ttl[16];
    int tl = snprintf(ttl, sizeof ttl, "%u", t->o.ttl_s);
    const char *argv[] = {"EVAL", lua, "1", k, p, ttl};
    const size_t lens[] = {4, sizeof lua - 1, 1, (size_t)kl, n, (size_t)tl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 6, argv, lens, 1, &rc);
    if (r) {
        if (r->type != REDIS_REPLY_INTEGER)
            rc = unexpected(r, "the manifest's write");
        else if (r->integer < 0)
            rc = st_error_set(ST_ECONFLICT, "tier: %s version %llu: another manifest is stored "
                              "under that version", id, (unsigned long long)version);
        else if (r->integer > 0)
            t->st.bytes_written += n;
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int st_tier_manifest_get(st_tier *t, const char *id, uint64_t version, size_t max, void **p,
                         size_t *n)
{
    *p = NULL;
    *n = 0;
    int rc = id_ok(id);
    if (rc)
        return rc;
    char k[200];
    int kl = snprintf(k, sizeof k, "st:m:{%s}:%llu", id, (unsigned long long)version);
    const char *argv[] = {"GET", k};
    const size_t lens[] = {3, (size_t)kl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 2, argv, lens, 0, &rc);
    if (r) {
        if (r->type == REDIS_REPLY_NIL)
            rc = st_error_set(ST_ENOTFOUND, "tier: %s version %llu: no manifest in the tier", id,
                              (unsigned long long)version);
        else if (r->type == REDIS_REPLY_STRING)
            rc = reply_copy(r, max, "a manifest", p, n);
        else
            rc = unexpected(r, "GET of a manifest");
        if (!rc)
            t->st.bytes_read += *n;
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- the head ----------------------------------------------------------------------------- */
/* A head's value: the version in decimal. */
static int parse_version(const redisReply *r, const char *id, uint64_t *v)
{
    if (r->type == REDIS_REPLY_NIL) {
        *v = 0;
        return 0;
    }
    if (r->type != REDIS_REPLY_STRING || r->len == 0 || r->len > 20)
        return st_error_set(ST_ECORRUPT, "tier: %s: the head is not a version", id);
    uint64_t x = 0;
    for (size_t i = 0; i < r->len; i++) {
        if (r->str[i] < '0' || r->str[i] > '9' || x > (UINT64_MAX - 9) / 10)
            return st_error_set(ST_ECORRUPT, "tier: %s: the head '%.20s' is not a version", id,
                                r->str);
        x = x * 10 + (uint64_t)(r->str[i] - '0');
    }
    *v = x;
    return 0;
}

int st_tier_head_get(st_tier *t, const char *id, uint64_t *version)
{
    *version = 0;
    int rc = id_ok(id);
    if (rc)
        return rc;
    char k[200];
    int kl = snprintf(k, sizeof k, "st:h:{%s}", id);
    const char *argv[] = {"GET", k};
    const size_t lens[] = {3, (size_t)kl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 2, argv, lens, 0, &rc);
    if (r) {
        rc = r->type == REDIS_REPLY_ERROR ? unexpected(r, "GET of a head")
                                          : parse_version(r, id, version);
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int st_tier_head_cas(st_tier *t, const char *id, uint64_t expect, uint64_t next, uint64_t *cur)
{
    if (cur)
        *cur = 0;
    int rc = id_ok(id);
    if (rc)
        return rc;
    if (!next)
        return st_error_set(ST_EINVAL, "tier: %s: a head cannot move to version 0", id);
    char k[200], ev[24], nv[24];
    int kl = snprintf(k, sizeof k, "st:h:{%s}", id);
    int el = snprintf(ev, sizeof ev, "%llu", (unsigned long long)expect);
    int nl = snprintf(nv, sizeof nv, "%llu", (unsigned long long)next);
    /* the head moves only from the version the caller read (0: none yet); the reply is what
     * it holds afterwards, and whether this call moved it */
    static const char lua[] =
        "local c = redis.call('GET', KEYS[1]) "
        "if (c == false and ARGV[1] == '0') or c == ARGV[1] then "
        "if ARGV[3] == '0' then redis.call('SET', KEYS[1], ARGV[2]) "
        "else redis.call('SET', KEYS[1], ARGV[2], 'EX', ARGV[3]) end return {1, ARGV[2]} end "
        "if c == false then return {0, '0'} end return {0, c}";
    char ttl[16];
    int tl = snprintf(ttl, sizeof ttl, "%u", t->o.ttl_s);
    const char *argv[] = {"EVAL", lua, "1", k, ev, nv, ttl};
    const size_t lens[] = {4, sizeof lua - 1, 1, (size_t)kl, (size_t)el, (size_t)nl, (size_t)tl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 7, argv, lens, 1, &rc);
    if (r) {
        uint64_t now = 0;
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_INTEGER)
            rc = unexpected(r, "the head's compare-and-set");
        else if (!(rc = parse_version(r->element[1], id, &now))) {
            if (cur)
                *cur = now;
            if (!r->element[0]->integer) {
                t->st.conflicts++;
                rc = st_error_set(ST_ECONFLICT, "tier: %s: the head is version %llu, not %llu",
                                  id, (unsigned long long)now, (unsigned long long)expect);
            }
        }
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- leases ----------------------------------------------------------------------------------- */
/* The holder record's value: "owner park" (invariant 7). */
static void parse_holder(const redisReply *r, st_tier_holder *h)
{
    memset(h, 0, sizeof *h);
    if (r->type != REDIS_REPLY_STRING)
        return;
    const char *sp = memchr(r->str, ' ', r->len);
    size_t ol = sp ? (size_t)(sp - r->str) : r->len;
    if (ol > ST_TIER_OWNER_MAX)
        ol = ST_TIER_OWNER_MAX;
    memcpy(h->owner, r->str, ol);
    h->owner[ol] = 0;
    uint64_t v = 0;
    for (size_t i = sp ? (size_t)(sp - r->str) + 1 : r->len; i < r->len; i++) {
        if (r->str[i] < '0' || r->str[i] > '9' || v > (UINT64_MAX - 9) / 10) {
            v = 0; /* not a version: no park to continue from */
            break;
        }
        v = v * 10 + (uint64_t)(r->str[i] - '0');
    }
    h->park = v;
}

static int holder_key(char *k, size_t cap, const char *id)
{
    return snprintf(k, cap, "st:o:{%s}", id);
}

/* mode LEASE_TAKE: only when nobody holds it; LEASE_OVER: take over from the same owner (only
 * while its owner is `owner`); LEASE_HELD: as LEASE_TAKE, and only when the holder record names
 * owner or nobody (else ST_ECONFLICT, *prev the record, nothing changed). Under a new token; one
 * script that also records owner as the last holder and returns the record it replaced
 * (invariant 7). */
enum { LEASE_TAKE, LEASE_OVER, LEASE_HELD };
static int lease_set(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                     char token[ST_TIER_TOKEN_LEN + 1], int mode, st_tier_holder *prev)
{
    token[0] = 0;
    if (prev)
        memset(prev, 0, sizeof *prev);
    int rc = id_ok(id);
    if (rc)
        return rc;
    size_t ol = owner ? strlen(owner) : 0;
    if (!ol || ol > ST_TIER_OWNER_MAX || strchr(owner, ' '))
        return st_error_set(ST_EINVAL, "tier: lease owner '%.64s': 1..%d bytes without spaces",
                            owner ? owner : "", ST_TIER_OWNER_MAX);
    if (!ttl_ms)
        return st_error_set(ST_EINVAL, "tier: %s: a lease of 0 ms", id);
    char k[200], ko[200], kp[200], v[ST_TIER_OWNER_MAX + ST_TIER_TOKEN_LEN + 2];
    char hv[ST_TIER_OWNER_MAX + 4], ttl[16], gc[16];
    int kl = snprintf(k, sizeof k, "st:l:{%s}", id);
    int kol = holder_key(ko, sizeof ko, id);
    int kpl = snprintf(kp, sizeof kp, "st:p:{%s}", id);
    pthread_mutex_lock(&t->mu);
    uint64_t x = ++t->epoch ^ ((uint64_t)(uintptr_t)t << 7) ^ (uint64_t)now_ms();
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    char tok[ST_TIER_TOKEN_LEN + 1];
    snprintf(tok, sizeof tok, "%016llx", (unsigned long long)x);
    int vl = snprintf(v, sizeof v, "%s %s", owner, tok);
    int hl = snprintf(hv, sizeof hv, "%s 0", owner);
    int tl = snprintf(ttl, sizeof ttl, "%u", ttl_ms);
    int gl = snprintf(gc, sizeof gc, "%u", t->o.ttl_s);
    /* KEYS: the lease, the holder record, the record this take replaced (kept for the lease's
     * TTL: a retry of this take after a lost reply returns it again). ARGV: the lease's value,
     * its TTL, the holder record, the record's TTL (0: none), the mode ("take", "held", or
     * "over"), the owner */
    static const char lua[] =
        "local c = redis.call('GET', KEYS[1]) "
        "if c == ARGV[1] then local p = redis.call('GET', KEYS[3]) "
        "if p == false then p = '' end return {1, p} end "
        "if ARGV[5] ~= 'over' then if c ~= false then return {0, ''} end "
        "elseif c == false or string.sub(c, 1, -18) ~= ARGV[6] then return {0, ''} end "
        "local o = redis.call('GET', KEYS[2]) "
        "if ARGV[5] == 'held' and o ~= false and string.match(o, '^[^ ]*') ~= ARGV[6] then "
        "return {2, o} end "
        "redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]) "
        "if ARGV[4] == '0' then redis.call('SET', KEYS[2], ARGV[3]) "
        "else redis.call('SET', KEYS[2], ARGV[3], 'EX', ARGV[4]) end "
        "if o == false then o = '' end redis.call('SET', KEYS[3], o, 'PX', ARGV[2]) "
        "return {1, o}";
    const char *argv[] = {"EVAL", lua, "3", k, ko, kp, v, ttl, hv, gc,
                          mode == LEASE_OVER ? "over" : mode == LEASE_HELD ? "held" : "take", owner};
    const size_t lens[] = {4, sizeof lua - 1, 1, (size_t)kl, (size_t)kol, (size_t)kpl,
                           (size_t)vl, (size_t)tl, (size_t)hl, (size_t)gl, 4, ol};
    redisReply *r = tier_cmd(t, k, (size_t)kl, 12, argv, lens, 1, &rc);
    if (r && t->o.replay_takes) { /* a lost reply retried (st_tier_opts.replay_takes) */
        freeReplyObject(r);
        r = tier_cmd(t, k, (size_t)kl, 12, argv, lens, 1, &rc);
    }
    if (r) {
        if (r->type != REDIS_REPLY_ARRAY || r->elements != 2 ||
            r->element[0]->type != REDIS_REPLY_INTEGER) {
            rc = unexpected(r, "the lease's take");
        } else if (r->element[0]->integer == 1) {
            memcpy(token, tok, sizeof tok);
            if (prev)
                parse_holder(r->element[1], prev);
        } else if (r->element[0]->integer == 2) {
            st_tier_holder h;
            parse_holder(r->element[1], &h);
            if (prev)
                *prev = h;
            rc = st_error_set(ST_ECONFLICT, "tier: %s: node %s held it since", id, h.owner);
        } else {
            t->st.conflicts++;
            rc = mode == LEASE_OVER
                     ? st_error_set(ST_EBUSY, "tier: %s: its lease is not %s's", id, owner)
                     : st_error_set(ST_EBUSY, "tier: %s: another node holds its lease", id);
        }
        freeReplyObject(r);
    } else if (rc == ST_EIO) {
        /* no reply: the script may have run (a stopped server answers later); the caller can
         * release what it may have taken under this token once the tier answers */
        memcpy(token, tok, sizeof tok);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int st_tier_lease_take(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                       char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    return lease_set(t, id, owner, ttl_ms, token, LEASE_TAKE, prev);
}

int st_tier_lease_take_held(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                            char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    return lease_set(t, id, owner, ttl_ms, token, LEASE_HELD, prev);
}

int st_tier_lease_takeover(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                           char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev)
{
    return lease_set(t, id, owner, ttl_ms, token, LEASE_OVER, prev);
}

int st_tier_holder_park(st_tier *t, const char *id, const char *token, uint64_t park)
{
    int rc = id_ok(id);
    if (rc)
        return rc;
    if (!token || strlen(token) != ST_TIER_TOKEN_LEN)
        return st_error_set(ST_EINVAL, "tier: %s: not a lease token", id);
    if (!park)
        return st_error_set(ST_EINVAL, "tier: %s: a park of version 0", id);
    char k[200], ko[200], pv[24], gc[16];
    int kl = snprintf(k, sizeof k, "st:l:{%s}", id);
    int kol = holder_key(ko, sizeof ko, id);
    int pl = snprintf(pv, sizeof pv, "%llu", (unsigned long long)park);
    int gl = snprintf(gc, sizeof gc, "%u", t->o.ttl_s);
    static const char lua[] =
        "local c = redis.call('GET', KEYS[1]) "
        "if c == false or string.sub(c, -16) ~= ARGV[1] then return 0 end "
        "local v = string.sub(c, 1, -18) .. ' ' .. ARGV[2] "
        "if ARGV[3] == '0' then redis.call('SET', KEYS[2], v) "
        "else redis.call('SET', KEYS[2], v, 'EX', ARGV[3]) end return 1";
    const char *argv[] = {"EVAL", lua, "2", k, ko, token, pv, gc};
    const size_t lens[] = {4, sizeof lua - 1, 1, (size_t)kl, (size_t)kol, ST_TIER_TOKEN_LEN,
                           (size_t)pl, (size_t)gl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 8, argv, lens, 1, &rc);
    if (r) {
        if (r->type != REDIS_REPLY_INTEGER)
            rc = unexpected(r, "the holder record's park");
        else if (!r->integer)
            rc = st_error_set(ST_EBUSY, "tier: %s: the lease is not held under that token (it "
                              "expired or another node took it)", id);
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int st_tier_holder_get(st_tier *t, const char *id, st_tier_holder *h)
{
    memset(h, 0, sizeof *h);
    int rc = id_ok(id);
    if (rc)
        return rc;
    char ko[200];
    int kol = holder_key(ko, sizeof ko, id);
    const char *argv[] = {"GET", ko};
    const size_t lens[] = {3, (size_t)kol};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, ko, (size_t)kol, 2, argv, lens, 0, &rc);
    if (r) {
        if (r->type == REDIS_REPLY_STRING)
            parse_holder(r, h);
        else if (r->type != REDIS_REPLY_NIL)
            rc = unexpected(r, "GET of a holder record");
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* A script over the lease that acts only while it holds token: 1 done, 0 not held. */
static int lease_script(st_tier *t, const char *id, const char *token, const char *lua,
                        size_t lual, const char *arg, const char *what)
{
    int rc = id_ok(id);
    if (rc)
        return rc;
    if (!token || strlen(token) != ST_TIER_TOKEN_LEN)
        return st_error_set(ST_EINVAL, "tier: %s: not a lease token", id);
    char k[200];
    int kl = snprintf(k, sizeof k, "st:l:{%s}", id);
    const char *argv[] = {"EVAL", lua, "1", k, token, arg};
    const size_t lens[] = {4, lual, 1, (size_t)kl, ST_TIER_TOKEN_LEN, strlen(arg)};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 6, argv, lens, 1, &rc);
    if (r) {
        if (r->type != REDIS_REPLY_INTEGER)
            rc = unexpected(r, what);
        else if (!r->integer)
            rc = st_error_set(ST_EBUSY, "tier: %s: the lease is not held under that token (it "
                              "expired or another node took it)", id);
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* the value is "owner token": the token is what follows the last space */
#define LEASE_HELD "local c = redis.call('GET', KEYS[1]) " \
                   "if c == false or string.sub(c, -16) ~= ARGV[1] then return 0 end "

int st_tier_lease_renew(st_tier *t, const char *id, const char *token, uint32_t ttl_ms)
{
    static const char lua[] = LEASE_HELD "redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1";
    if (!ttl_ms)
        return st_error_set(ST_EINVAL, "tier: %s: a lease of 0 ms", id ? id : "");
    char ttl[16];
    snprintf(ttl, sizeof ttl, "%u", ttl_ms);
    return lease_script(t, id, token, lua, sizeof lua - 1, ttl, "the lease's renewal");
}

int st_tier_lease_release(st_tier *t, const char *id, const char *token)
{
    static const char lua[] = LEASE_HELD "redis.call('DEL', KEYS[1]) return 1";
    return lease_script(t, id, token, lua, sizeof lua - 1, "0", "the lease's release");
}

int st_tier_lease_owner(st_tier *t, const char *id, char *owner, size_t cap, int64_t *ttl_ms)
{
    if (cap)
        owner[0] = 0;
    *ttl_ms = -2;
    int rc = id_ok(id);
    if (rc)
        return rc;
    char k[200];
    int kl = snprintf(k, sizeof k, "st:l:{%s}", id);
    static const char lua[] = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}";
    const char *argv[] = {"EVAL", lua, "1", k};
    const size_t lens[] = {4, sizeof lua - 1, 1, (size_t)kl};
    pthread_mutex_lock(&t->mu);
    redisReply *r = tier_cmd(t, k, (size_t)kl, 4, argv, lens, 0, &rc);
    if (r) {
        /* a missing key makes the GET's false the script's nil, which ends the array early */
        if (r->type != REDIS_REPLY_ARRAY || r->elements < 1)
            rc = unexpected(r, "the lease's read");
        else if (r->element[0]->type == REDIS_REPLY_STRING && r->elements == 2 &&
                 r->element[1]->type == REDIS_REPLY_INTEGER) {
            const char *sp = memchr(r->element[0]->str, ' ', r->element[0]->len);
            size_t ol = sp ? (size_t)(sp - r->element[0]->str) : r->element[0]->len;
            if (cap) {
                size_t c = ol < cap - 1 ? ol : cap - 1;
                memcpy(owner, r->element[0]->str, c);
                owner[c] = 0;
            }
            *ttl_ms = r->element[1]->integer;
        } else if (r->element[0]->type != REDIS_REPLY_NIL) {
            rc = unexpected(r, "the lease's read");
        }
        freeReplyObject(r);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- durability (invariant 4) ---------------------------------------------------------------- */
int st_tier_sync(st_tier *t, uint32_t replicas, uint32_t timeout_ms)
{
    int rc = 0;
    pthread_mutex_lock(&t->mu);
    if (t->unconfirmed && replicas) {
        t->unconfirmed = 0;
        rc = st_error_set(ST_EIO, "tier: a connection that wrote was lost before its writes "
                          "were confirmed on a replica (write them again)");
    }
    char wr[16], wt[16];
    int wrl = snprintf(wr, sizeof wr, "%u", replicas), wtl = snprintf(wt, sizeof wt, "%u", timeout_ms);
    const char *argv[] = {"WAIT", wr, wt};
    const size_t lens[] = {4, (size_t)wrl, (size_t)wtl};
    for (uint32_t i = 0; i < t->n_nodes && !rc; i++) {
        tnode *n = &t->nodes[i];
        if (n->wseq <= n->cseq || !n->ac)
            continue;
        if (!replicas) {
            n->cseq = n->wseq;
            t->unconfirmed = 0;
            continue;
        }
        uint64_t seq = 0, gen = 0;
        char w[256];
        redisReply *r = node_cmd(t, (int)i, 0, 3, argv, lens, t->o.timeout_ms + timeout_ms, &seq,
                                 &gen, w, sizeof w);
        if (!r) {
            rc = st_error_set(ST_EIO, "tier: WAIT at %s:%d: %s (its writes may be lost)", n->host,
                              n->port, w);
        } else {
            if (r->type != REDIS_REPLY_INTEGER)
                rc = unexpected(r, "WAIT");
            else if (r->integer < (long long)replicas)
                rc = st_error_set(ST_EIO, "tier: %s:%d: %lld of %u replicas confirmed the writes "
                                  "within %u ms", n->host, n->port, r->integer, replicas,
                                  timeout_ms);
            else if (gen == n->gen && seq - 1 > n->cseq) /* it covers what was sent before */
                n->cseq = seq - 1;
            freeReplyObject(r);
        }
        t->st.waits++;
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void st_tier_stats_get(st_tier *t, st_tier_stats *s)
{
    pthread_mutex_lock(&t->mu);
    *s = t->st;
    s->cluster = t->cluster;
    s->nodes = 0;
    for (uint32_t i = 0; i < t->n_nodes; i++) {
        int owns = 0;
        for (uint32_t k = 0; k < ST_TIER_SLOTS && !owns; k++)
            owns = t->slot[k] == i;
        s->nodes += owns;
    }
    pthread_mutex_unlock(&t->mu);
}
#endif
