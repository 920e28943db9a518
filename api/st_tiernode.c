/*
 * st_tiernode.c - a node's side of the shared tier (st_tiernode.h).
 *
 * Invariants:
 * 1. The tier's head decides: a SAVE is sent with the tier version this node's copy extends
 *    (the last version it sent or fetched of that conversation; none: 0), and the tier's
 *    compare-and-set refuses it when another node moved the head since (ST_TIER_CONFLICT): a
 *    stale node never overwrites a newer conversation.
 * 2. Order per conversation: while the queue holds an entry for a conversation, a newer SAVE of
 *    it replaces that entry's version instead of being sent past it (the tier needs only the
 *    newest), and while the tier is down (the queue is not empty, or the tier was never
 *    reached) a SAVE queues without trying; so versions reach the tier in their order. The queue
 *    holds at most pending_max conversations; beyond, a SAVE stays local (ST_TIER_UNQUEUED).
 * 3. One mutex guards the map of known versions, the queue and the counters; no call to the tier
 *    is made under it (the tier's client serialises its own calls).
 * 4. The queue's thread sends the oldest entry every retry_ms while entries wait, opening the
 *    tier first when it was never reached; an entry leaves the queue when sent, refused as a
 *    conflict, or failed for another reason than an unreachable tier (counted as an error and
 *    logged).
 * 5. Leases: one per conversation and node, held while any request of this node works on it
 *    (a count of requests), taken from the tier by the first and released by the last; a
 *    thread renews every held lease every lease_ms / 3 and marks it lost when the tier says
 *    another node holds it (its TTL ran out first), which the requests' end reports. A lease
 *    taken while the tier was unreachable is held locally only (no token) and never renewed.
 *    A renewal or release refused because the lease expired (the tier or this node paused
 *    longer than its TTL) is not a loss while the holder record still names this node: no
 *    other node took it since (lease_retake); the renewal then takes it again under a new
 *    token (strata_tier_leases_retaken_total).
 * 6. Handover: a take tells (the holder record, st_tier.c invariant 7) whether another node held
 *    the conversation since this node last did; begin reports it, so that a node never extends
 *    a live copy made before another node worked on the conversation (its turns there would
 *    fork the conversation). A park pushed to the tier (st_tiernode_park) is named in the
 *    record only under the lease the spill took fresh: while it is held no other node works on
 *    the conversation and no other request of this node does, so the park is the newest state.
 * 7. A restart empties the map of known versions. When a take finds the holder record naming
 *    this node and this process never sent or fetched the conversation, no other node took its
 *    lease since this node last did (completions, RESTOREs, SAVEs and spills all take it), so
 *    the tier's head is this node's own SAVE and its live copy, if any (a park kept over the
 *    restart), is at least as new: the head becomes the known version without a pull, when the
 *    local store holds the conversation (strata_tier_adopted_total). A SAVE another node made
 *    while it could not take the lease (the tier away from it) and sent later from its queue is
 *    not seen so (docs/SCALE.md, the failure modes).
 * 8. A take that got no reply (ST_EIO: a server stopped, a failover) may still have run when
 *    the server answers later; its token is kept (at most TN_ORPHANS, beyond the oldest is left
 *    to expire by its TTL) and the queue's thread releases the lease under it, before it sends
 *    the queue, once the tier answers: such a lease would keep every other node out of the
 *    conversation for its TTL. The release acts only under that token, so a lease taken since
 *    (by this node's next request, or another node) stays.
 * 9. The map of known versions keeps at most TN_KNOWN_MAX conversations (about 45 MiB), the
 *    least recently used dropped first. A conversation dropped from it is as after a restart
 *    (invariant 7): its next take adopts the tier's head when this node held it last, or pulls
 *    it; only a SAVE sent without a lease (from the queue) then extends "none" and is refused
 *    as a conflict (it stays local).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "st_tiernode.h"

#define TN_BUCKETS 4096u
#define TN_KNOWN_MAX (256u << 10) /* conversations whose tier version is kept (invariant 9) */

typedef struct known {
    struct known *next;
    struct known *older, *newer; /* least recently used first (invariant 9) */
    uint64_t tier_version;
    char id[ST_STORE_ID_MAX + 1];
} known;

typedef struct lease {
    struct lease *next;
    uint32_t refs;
    int taken, lost; /* taken: a token from the tier; lost: its renewal was refused */
    char token[ST_TIER_TOKEN_LEN + 1];
    char id[ST_STORE_ID_MAX + 1];
} lease;

/* A take that got no reply: the lease it may have taken, released under its token once the
 * tier answers (invariant 8). */
typedef struct orphan {
    char token[ST_TIER_TOKEN_LEN + 1];
    char id[ST_STORE_ID_MAX + 1];
} orphan;
#define TN_ORPHANS 256

typedef struct pending {
    uint64_t version; /* the local version to send */
    char id[ST_STORE_ID_MAX + 1];
} pending;

struct st_tiernode {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t thread, renewer;
    int thread_on, renewer_on, stop;
    lease *leases;
    st_tiernode_opts o;
    char url[4096], node_id[ST_TIER_OWNER_MAX + 1];
    st_store *store;
    st_tier *tier; /* NULL until the tier was reached once */
    known *map[TN_BUCKETS];
    known *oldest, *newest;
    uint32_t n_known;
    orphan orphans[TN_ORPHANS];
    uint32_t n_orphans;
    pending *q;    /* a ring of o.pending_max entries */
    uint32_t q_head, q_n;
    st_tiernode_stats st;
};

const char *st_tier_outcome_name(st_tier_outcome o)
{
    switch (o) {
    case ST_TIER_SENT: return "sent";
    case ST_TIER_PENDING: return "pending";
    case ST_TIER_CONFLICT: return "conflict";
    default: return "unqueued";
    }
}

static uint32_t bucket(const char *id)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (const unsigned char *p = (const unsigned char *)id; *p; p++)
        h = (h ^ *p) * 16777619u;
    return h % TN_BUCKETS;
}

static void known_unlink_locked(st_tiernode *tn, known *k)
{
    if (k->older)
        k->older->newer = k->newer;
    else
        tn->oldest = k->newer;
    if (k->newer)
        k->newer->older = k->older;
    else
        tn->newest = k->older;
    k->older = k->newer = NULL;
}

static void known_link_newest_locked(st_tiernode *tn, known *k)
{
    k->older = tn->newest;
    k->newer = NULL;
    if (tn->newest)
        tn->newest->newer = k;
    else
        tn->oldest = k;
    tn->newest = k;
}

/* id's entry out of the map and freed (NULL: nothing). */
static void known_drop_locked(st_tiernode *tn, known *k)
{
    if (!k)
        return;
    for (known **pp = &tn->map[bucket(k->id)]; *pp; pp = &(*pp)->next)
        if (*pp == k) {
            *pp = k->next;
            break;
        }
    known_unlink_locked(tn, k);
    tn->n_known--;
    free(k);
}

static known *known_find_locked(st_tiernode *tn, const char *id)
{
    for (known *k = tn->map[bucket(id)]; k; k = k->next)
        if (!strcmp(k->id, id)) {
            known_unlink_locked(tn, k); /* used: the newest */
            known_link_newest_locked(tn, k);
            return k;
        }
    return NULL;
}

static void known_set_locked(st_tiernode *tn, const char *id, uint64_t tv)
{
    known *k = known_find_locked(tn, id);
    if (!k) {
        if (tn->n_known >= TN_KNOWN_MAX) /* invariant 9 */
            known_drop_locked(tn, tn->oldest);
        if (!(k = calloc(1, sizeof *k)))
            return; /* the next SAVE of id then extends "none" and is refused as a conflict */
        snprintf(k->id, sizeof k->id, "%s", id);
        uint32_t b = bucket(id);
        k->next = tn->map[b];
        tn->map[b] = k;
        known_link_newest_locked(tn, k);
        tn->n_known++;
    }
    k->tier_version = tv;
}

static uint64_t known_get_locked(st_tiernode *tn, const char *id)
{
    known *k = known_find_locked(tn, id);
    return k ? k->tier_version : 0;
}

void st_tiernode_forget(st_tiernode *tn, const char *id)
{
    pthread_mutex_lock(&tn->mu);
    known_drop_locked(tn, known_find_locked(tn, id));
    pthread_mutex_unlock(&tn->mu);
}

static pending *q_at(st_tiernode *tn, uint32_t i)
{
    return &tn->q[(tn->q_head + i) % tn->o.pending_max];
}

/* invariant 2: replace id's entry, or append one; 0 when the queue is full */
static int q_put_locked(st_tiernode *tn, const char *id, uint64_t version)
{
    for (uint32_t i = 0; i < tn->q_n; i++) {
        pending *p = q_at(tn, i);
        if (!strcmp(p->id, id)) {
            p->version = version;
            return 1;
        }
    }
    if (tn->q_n == tn->o.pending_max)
        return 0;
    pending *p = q_at(tn, tn->q_n++);
    p->version = version;
    snprintf(p->id, sizeof p->id, "%s", id);
    tn->st.pending = tn->q_n;
    pthread_cond_broadcast(&tn->cv); /* the queue's thread (the renewer shares the condition) */
    return 1;
}

static st_tier *open_tier(st_tiernode *tn, int *bad)
{
    st_tier_opts to;
    st_tier_opts_default(&to);
    to.timeout_ms = 500;
    to.retry_ms = 1000;
    to.ttl_s = tn->o.ttl_s;
    st_tier *t = NULL;
    int rc = st_tier_open(&t, tn->url, &to);
    if (bad)
        *bad = rc == ST_EINVAL;
    return rc ? NULL : t;
}

/* The tier, opened by whoever first finds it closed (the thread or a fetch). */
static st_tier *tier_get(st_tiernode *tn)
{
    pthread_mutex_lock(&tn->mu);
    st_tier *t = tn->tier;
    pthread_mutex_unlock(&tn->mu);
    if (t)
        return t;
    if (!(t = open_tier(tn, NULL)))
        return NULL;
    pthread_mutex_lock(&tn->mu);
    if (tn->tier) { /* another thread opened it meanwhile */
        pthread_mutex_unlock(&tn->mu);
        st_tier_close(t);
        return tn->tier;
    }
    tn->tier = t;
    pthread_mutex_unlock(&tn->mu);
    return t;
}

/* One push of (id, version) from the tier version this node knows; the counters and the map
 * updated. Returns the push's error. */
static int push_one(st_tiernode *tn, st_tier *t, const char *id, uint64_t version, uint64_t *tv)
{
    pthread_mutex_lock(&tn->mu);
    uint64_t expect = known_get_locked(tn, id);
    pthread_mutex_unlock(&tn->mu);
    st_tier_xfer_stats xs;
    memset(&xs, 0, sizeof xs);
    int rc = st_tier_push(t, tn->store, id, version, expect, tn->o.replicas, tn->o.wait_ms, &xs);
    pthread_mutex_lock(&tn->mu);
    if (xs.tier_version) /* the head moved to it (its WAIT may have failed: sent again later) */
        known_set_locked(tn, id, xs.tier_version);
    if (!rc) {
        tn->st.pushes++;
        tn->st.pushed_bytes += xs.bytes;
        tn->st.pushed_new_bytes += xs.new_bytes;
    }
    tn->st.up = rc != ST_EIO;
    pthread_mutex_unlock(&tn->mu);
    *tv = xs.tier_version;
    return rc;
}

/* The queue thread's pause while the tier is down (retry_ms, or until woken). */
static void retry_wait_locked(st_tiernode *tn)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)tn->o.retry_ms * 1000000ull;
    ts.tv_sec += (time_t)(ns / 1000000000ull);
    ts.tv_nsec = (long)(ns % 1000000000ull);
    if (!tn->stop)
        pthread_cond_timedwait(&tn->cv, &tn->mu, &ts);
}

/* A take of id under token got no reply (invariant 8). */
static void orphan_add(st_tiernode *tn, const char *id, const char *token)
{
    if (!token[0])
        return;
    pthread_mutex_lock(&tn->mu);
    if (tn->n_orphans == TN_ORPHANS) /* the oldest is left to expire by its TTL */
        memmove(tn->orphans, tn->orphans + 1, (TN_ORPHANS - 1) * sizeof *tn->orphans);
    else
        tn->n_orphans++;
    orphan *o = &tn->orphans[tn->n_orphans - 1];
    snprintf(o->id, sizeof o->id, "%s", id);
    memcpy(o->token, token, sizeof o->token);
    tn->st.orphans = tn->n_orphans;
    pthread_cond_broadcast(&tn->cv);
    pthread_mutex_unlock(&tn->mu);
}

static void *queue_main(void *arg)
{
    st_tiernode *tn = arg;
    pthread_mutex_lock(&tn->mu);
    while (!tn->stop) {
        if (!tn->q_n && !tn->n_orphans) {
            pthread_cond_wait(&tn->cv, &tn->mu);
            continue;
        }
        if (tn->n_orphans) { /* first: a lease left behind keeps other nodes out */
            orphan o = tn->orphans[tn->n_orphans - 1];
            pthread_mutex_unlock(&tn->mu);
            st_tier *t = tier_get(tn);
            int rc = t ? st_tier_lease_release(t, o.id, o.token) : ST_EIO;
            pthread_mutex_lock(&tn->mu);
            if (rc == ST_EIO) {
                tn->st.up = 0;
                retry_wait_locked(tn);
                continue;
            }
            /* released, or not held under it (never taken, expired, or taken over) */
            for (uint32_t i = 0; i < tn->n_orphans; i++)
                if (!strcmp(tn->orphans[i].token, o.token)) { /* in order: the oldest first */
                    memmove(tn->orphans + i, tn->orphans + i + 1,
                            (tn->n_orphans - i - 1) * sizeof *tn->orphans);
                    tn->n_orphans--;
                    break;
                }
            tn->st.orphans = tn->n_orphans;
            if (!rc)
                tn->st.orphans_released++;
            continue;
        }
        pending p = *q_at(tn, 0);
        pthread_mutex_unlock(&tn->mu);
        st_tier *t = tier_get(tn);
        int rc = ST_EIO;
        uint64_t tv = 0;
        if (t)
            rc = push_one(tn, t, p.id, p.version, &tv);
        pthread_mutex_lock(&tn->mu);
        if (rc == ST_EIO) {
            tn->st.up = 0;
            retry_wait_locked(tn);
            continue;
        }
        if (!rc)
            tn->st.sent_from_queue++;
        else if (rc == ST_ECONFLICT)
            tn->st.conflicts++;
        else {
            tn->st.errors++;
            fprintf(stderr, "strata-server: tier: %s version %llu was not sent: %s: %s\n", p.id,
                    (unsigned long long)p.version, st_strerror(rc), st_errdetail());
        }
        /* the entry leaves unless a newer SAVE replaced its version meanwhile (invariant 2) */
        pending *h = q_at(tn, 0);
        if (tn->q_n && !strcmp(h->id, p.id) && h->version == p.version) {
            tn->q_head = (tn->q_head + 1) % tn->o.pending_max;
            tn->q_n--;
            tn->st.pending = tn->q_n;
        }
    }
    pthread_mutex_unlock(&tn->mu);
    return NULL;
}

static lease *lease_find_locked(st_tiernode *tn, const char *id)
{
    for (lease *l = tn->leases; l; l = l->next)
        if (!strcmp(l->id, id))
            return l;
    return NULL;
}

/* A renewal or release of id refused (ST_EBUSY): the lease expired (the tier or this node
 * paused longer than its TTL). When the holder record still names this node, no other node took
 * it since (every take sets the record, invariant 6): nothing was lost. With ntok, the lease is
 * taken again (fresh: only while the record names this node) under a new token in ntok. 1: not
 * lost (ntok set when taken again); 0: lost, or the tier could not tell. */
static int lease_retake(st_tiernode *tn, st_tier *t, const char *id,
                        char ntok[ST_TIER_TOKEN_LEN + 1])
{
    st_tier_holder h;
    if (st_tier_holder_get(t, id, &h) || strcmp(h.owner, tn->node_id)) {
        st_error_clear();
        return 0;
    }
    if (!ntok)
        return 1;
    if (st_tier_lease_take_held(t, id, tn->node_id, tn->o.lease_ms, ntok, &h)) {
        ntok[0] = '\0';
        st_error_clear();
        return 0;
    }
    return 1;
}

static void *renew_main(void *arg)
{
    st_tiernode *tn = arg;
    pthread_mutex_lock(&tn->mu);
    while (!tn->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        uint64_t ns = (uint64_t)ts.tv_nsec + (uint64_t)(tn->o.lease_ms / 3) * 1000000ull;
        ts.tv_sec += (time_t)(ns / 1000000000ull);
        ts.tv_nsec = (long)(ns % 1000000000ull);
        pthread_cond_timedwait(&tn->cv, &tn->mu, &ts);
        if (tn->stop)
            break;
        /* one lease at a time, the mutex released around each call to the tier */
        char id[ST_STORE_ID_MAX + 1], tok[ST_TIER_TOKEN_LEN + 1];
        for (lease *l = tn->leases; l;) {
            if (!l->taken || l->lost) {
                l = l->next;
                continue;
            }
            memcpy(id, l->id, sizeof id);
            memcpy(tok, l->token, sizeof tok);
            st_tier *t = tn->tier;
            pthread_mutex_unlock(&tn->mu);
            int rc = t ? st_tier_lease_renew(t, id, tok, tn->o.lease_ms) : ST_EIO;
            char ntok[ST_TIER_TOKEN_LEN + 1] = "";
            if (rc == ST_EBUSY && lease_retake(tn, t, id, ntok))
                rc = 0;
            pthread_mutex_lock(&tn->mu);
            lease *m = lease_find_locked(tn, id);
            if (ntok[0]) {
                if (m && !strcmp(m->token, tok)) {
                    memcpy(m->token, ntok, sizeof m->token);
                    tn->st.leases_retaken++;
                } else { /* its requests ended meanwhile: give the new one back */
                    pthread_mutex_unlock(&tn->mu);
                    (void)st_tier_lease_release(t, id, ntok);
                    pthread_mutex_lock(&tn->mu);
                    m = lease_find_locked(tn, id);
                }
            }
            if (rc == ST_EBUSY && m && !strcmp(m->token, tok)) {
                m->lost = 1;
                tn->st.leases_lost++;
                fprintf(stderr, "strata-server: tier: the lease of %s was lost (another node may "
                        "have taken the conversation): its live copy is dropped when its requests "
                        "end\n", id);
            }
            /* continue after id (the list may have changed while unlocked) */
            l = m ? m->next : NULL;
        }
    }
    pthread_mutex_unlock(&tn->mu);
    return NULL;
}

static int fetch_in(st_tiernode *tn, const char *id, uint64_t max_bytes, int own, int *fetched);

/* What a take's holder record says of the node that held the conversation before (invariant 6). */
static void begun_handed(st_tiernode_begun *b, const st_tier_holder *prev)
{
    b->handed = 1;
    b->park = prev->park;
    memcpy(b->prev, prev->owner, sizeof b->prev);
}

int st_tiernode_begin(st_tiernode *tn, const char *id, int flags, st_tiernode_begun *b)
{
    memset(b, 0, sizeof *b);
    int fresh = flags & ST_TIERNODE_FRESH;
    st_tier_holder prev;
    memset(&prev, 0, sizeof prev);
    for (int tries = 0;; tries++) {
        pthread_mutex_lock(&tn->mu);
        lease *l = lease_find_locked(tn, id);
        if (l && fresh) {
            pthread_mutex_unlock(&tn->mu);
            return st_error_set(ST_EBUSY, "session %s: a request of this node holds its lease", id);
        }
        if (fresh && tn->q_n > 0) { /* SAVEs wait for the tier (invariant 2): do not wait too */
            pthread_mutex_unlock(&tn->mu);
            return st_error_set(ST_EIO, "tier %s: not reachable (SAVEs are queued)", tn->url);
        }
        if (l && !l->lost) {
            l->refs++;
            pthread_mutex_unlock(&tn->mu);
            break;
        }
        if (l && l->lost) {
            pthread_mutex_unlock(&tn->mu);
            return st_error_set(ST_EBUSY, "session %s: this node lost its lease; retry when its "
                                "running requests end", id);
        }
        pthread_mutex_unlock(&tn->mu);
        st_tier *t = tier_get(tn);
        char tok[ST_TIER_TOKEN_LEN + 1] = "";
        int rc = !t    ? ST_EIO
                 : fresh ? st_tier_lease_take_held(t, id, tn->node_id, tn->o.lease_ms, tok, &prev)
                         : st_tier_lease_take(t, id, tn->node_id, tn->o.lease_ms, tok, &prev);
        if (fresh && rc == ST_ECONFLICT) { /* another node held it since: nothing taken */
            begun_handed(b, &prev);
            return st_error_set(rc, "session %s: node %s held it since this node did", id,
                                b->prev[0] ? b->prev : "?");
        }
        char owner[ST_TIER_OWNER_MAX + 1] = "";
        int64_t ttl = -2;
        if (rc == ST_EBUSY) { /* fresh or not: a lease this node left behind is taken over */
            (void)st_tier_lease_owner(t, id, owner, sizeof owner, &ttl);
            if (!strcmp(owner, tn->node_id) && tries < 50) {
                /* another request of this node took it a moment ago: share its lease */
                usleep(2000);
                continue;
            }
            if (!strcmp(owner, tn->node_id)) {
                /* no request of this node registered it in 100 ms: a lease this node left
                 * behind (its release failed, e.g. during a failover): take it over */
                pthread_mutex_lock(&tn->mu);
                int mine = lease_find_locked(tn, id) != NULL;
                pthread_mutex_unlock(&tn->mu);
                if (mine) {
                    tries = 0;
                    continue;
                }
                rc = st_tier_lease_takeover(t, id, tn->node_id, tn->o.lease_ms, tok, &prev);
                if (rc == ST_EBUSY && tries < 100)
                    continue; /* expired meanwhile (take again) or another node's now */
                if (rc == ST_EBUSY) /* the owner read above is stale */
                    (void)st_tier_lease_owner(t, id, owner, sizeof owner, &ttl);
            }
        }
        if (rc == ST_EBUSY) {
            pthread_mutex_lock(&tn->mu);
            if (!fresh) /* a spill's or SAVE's refusal is not a request refused */
                tn->st.leases_refused++;
            pthread_mutex_unlock(&tn->mu);
            return st_error_set(ST_EBUSY, "session %s is in use on node %s (its lease, %lld ms "
                                "left); retry", id, owner[0] ? owner : "?", (long long)ttl);
        }
        if (rc == ST_EIO)
            orphan_add(tn, id, tok);
        if (rc == ST_EIO && fresh) {
            pthread_mutex_lock(&tn->mu);
            tn->st.up = 0;
            pthread_mutex_unlock(&tn->mu);
            return st_error_set(ST_EIO, "tier %s: not reachable", tn->url);
        }
        if (rc && rc != ST_EIO)
            return rc;
        lease *n = calloc(1, sizeof *n);
        if (!n) {
            if (!rc)
                (void)st_tier_lease_release(t, id, tok);
            return st_error_set(ENOMEM, "tier: a lease");
        }
        n->refs = 1;
        n->taken = !rc;
        memcpy(n->token, tok, sizeof n->token);
        snprintf(n->id, sizeof n->id, "%s", id);
        pthread_mutex_lock(&tn->mu);
        n->next = tn->leases;
        tn->leases = n;
        tn->st.leases_held++;
        if (!rc)
            tn->st.leases_taken++;
        else
            tn->st.up = 0;
        if (!rc && prev.owner[0] && strcmp(prev.owner, tn->node_id)) {
            /* another node held it since this node did: whatever this node holds is older */
            begun_handed(b, &prev);
            tn->st.handovers++;
        }
        pthread_mutex_unlock(&tn->mu);
        if (rc) /* the tier unreachable: no lease, no head to compare with */
            return 0;
        break;
    }
    int rc = fetch_in(tn, id, 0, prev.owner[0] && !strcmp(prev.owner, tn->node_id), &b->fetched);
    if (rc == ST_EIO) {
        st_error_clear();
        rc = 0;
    }
    if (rc)
        (void)st_tiernode_end(tn, id);
    return rc;
}

int st_tiernode_park(st_tiernode *tn, const char *id, const char *park_id, uint64_t version)
{
    pthread_mutex_lock(&tn->mu);
    lease *l = lease_find_locked(tn, id);
    char tok[ST_TIER_TOKEN_LEN + 1] = "";
    int held = l && l->taken && !l->lost;
    if (held)
        memcpy(tok, l->token, sizeof tok);
    st_tier *t = tn->tier;
    pthread_mutex_unlock(&tn->mu);
    if (!held || !t)
        return st_error_set(ST_EBUSY, "tier: %s: parking into the tier needs its lease", id);
    st_tier_xfer_stats xs;
    memset(&xs, 0, sizeof xs);
    int rc = st_tier_push(t, tn->store, park_id, version, ST_TIER_HEAD_CURRENT, tn->o.replicas,
                          tn->o.wait_ms, &xs);
    if (!rc)
        rc = st_tier_holder_park(t, id, tok, xs.tier_version);
    pthread_mutex_lock(&tn->mu);
    if (!rc) {
        tn->st.park_pushes++;
        tn->st.park_pushed_bytes += xs.bytes;
        tn->st.pushed_new_bytes += xs.new_bytes;
    } else {
        tn->st.park_errors++;
    }
    pthread_mutex_unlock(&tn->mu);
    return rc;
}

int st_tiernode_park_pull(st_tiernode *tn, const char *park_id, uint64_t tier_version,
                          uint64_t max_bytes)
{
    st_tier *t = tier_get(tn);
    if (!t)
        return st_error_set(ST_EIO, "tier %s: not reachable: %s", tn->url, st_errdetail());
    st_tier_xfer_stats xs;
    memset(&xs, 0, sizeof xs);
    int rc = st_tier_pull(t, tn->store, park_id, tier_version, max_bytes, &xs);
    pthread_mutex_lock(&tn->mu);
    if (!rc) {
        tn->st.park_pulls++;
        tn->st.park_pulled_bytes += xs.bytes;
    } else {
        tn->st.park_errors++;
    }
    pthread_mutex_unlock(&tn->mu);
    return rc;
}

int st_tiernode_end(st_tiernode *tn, const char *id)
{
    pthread_mutex_lock(&tn->mu);
    lease *l = lease_find_locked(tn, id), **pp = &tn->leases;
    if (!l) {
        pthread_mutex_unlock(&tn->mu);
        return 0;
    }
    int lost = l->lost;
    if (--l->refs) {
        pthread_mutex_unlock(&tn->mu);
        return lost;
    }
    while (*pp != l)
        pp = &(*pp)->next;
    *pp = l->next;
    tn->st.leases_held--;
    st_tier *t = tn->tier;
    pthread_mutex_unlock(&tn->mu);
    /* the release is refused when the lease is not held under this token any more (it expired
     * and another node may have taken it before the renewal noticed): lost too; any other
     * failure (the tier unreachable) leaves it to expire by its TTL */
    if (l->taken && !lost && t && st_tier_lease_release(t, id, l->token) == ST_EBUSY &&
        !lease_retake(tn, t, id, NULL)) {
        lost = 1;
        pthread_mutex_lock(&tn->mu);
        tn->st.leases_lost++;
        pthread_mutex_unlock(&tn->mu);
        fprintf(stderr, "strata-server: tier: the lease of %s had expired when its request "
                "ended (another node may have taken the conversation): its live copy is "
                "dropped\n", id);
    }
    free(l);
    return lost;
}

int st_tiernode_new(const st_tiernode_opts *o, st_store *store, st_tiernode **out)
{
    *out = NULL;
    if (!o || !o->url || !store)
        return st_error_set(ST_EINVAL, "tier: no address");
    if (strlen(o->url) >= sizeof ((st_tiernode *)0)->url)
        return st_error_set(ST_EINVAL, "tier: the address is longer than 4095 bytes");
    const char *nid = o->node_id && *o->node_id ? o->node_id : NULL;
    if (nid && (strlen(nid) > ST_TIER_OWNER_MAX || strpbrk(nid, " \t\r\n")))
        return st_error_set(ST_EINVAL, "tier: node id \"%s\": 1 to %d bytes without spaces", nid,
                            ST_TIER_OWNER_MAX);
    st_tiernode *tn = calloc(1, sizeof *tn);
    if (!tn)
        return st_error_set(ENOMEM, "tier: no memory");
    tn->o = *o;
    if (!tn->o.wait_ms)
        tn->o.wait_ms = 2000;
    if (!tn->o.pending_max)
        tn->o.pending_max = 1024;
    if (!tn->o.retry_ms)
        tn->o.retry_ms = 500;
    if (tn->o.lease_ms < 300)
        tn->o.lease_ms = tn->o.lease_ms ? 300 : 10000;
    snprintf(tn->url, sizeof tn->url, "%s", o->url);
    if (nid)
        snprintf(tn->node_id, sizeof tn->node_id, "%s", nid);
    else if (gethostname(tn->node_id, sizeof tn->node_id) != 0 || !tn->node_id[0])
        snprintf(tn->node_id, sizeof tn->node_id, "node-%ld", (long)getpid());
    tn->o.url = tn->url;
    tn->o.node_id = tn->node_id;
    tn->store = store;
    tn->st.pending_max = tn->o.pending_max;
    pthread_mutex_init(&tn->mu, NULL);
    pthread_cond_init(&tn->cv, NULL);
    int bad = 0;
    tn->tier = open_tier(tn, &bad);
    int rc = 0;
    if (bad) {
        rc = ST_EINVAL; /* the detail is the client's: which part of the address */
        goto fail;
    }
    if (!tn->tier)
        fprintf(stderr, "strata-server: tier %s: %s (SAVEs are queued until it answers)\n",
                tn->url, st_errdetail());
    tn->st.up = tn->tier != NULL;
    if (!(tn->q = calloc(tn->o.pending_max, sizeof *tn->q))) {
        rc = st_error_set(ENOMEM, "tier: a queue of %u entries", tn->o.pending_max);
        goto fail;
    }
    if ((rc = pthread_create(&tn->thread, NULL, queue_main, tn))) {
        rc = st_error_set(rc, "tier: the queue's thread: %s", strerror(rc));
        goto fail;
    }
    tn->thread_on = 1;
    if ((rc = pthread_create(&tn->renewer, NULL, renew_main, tn))) {
        rc = st_error_set(rc, "tier: the leases' thread: %s", strerror(rc));
        goto fail;
    }
    tn->renewer_on = 1;
    *out = tn;
    return 0;
fail:
    st_tiernode_free(tn);
    return rc;
}

void st_tiernode_free(st_tiernode *tn)
{
    if (!tn)
        return;
    pthread_mutex_lock(&tn->mu);
    tn->stop = 1;
    pthread_cond_broadcast(&tn->cv);
    pthread_mutex_unlock(&tn->mu);
    if (tn->thread_on)
        pthread_join(tn->thread, NULL);
    if (tn->renewer_on)
        pthread_join(tn->renewer, NULL);
    for (lease *l = tn->leases, *n; l; l = n) { /* requests still holding one at shutdown */
        n = l->next;
        if (l->taken && !l->lost && tn->tier)
            (void)st_tier_lease_release(tn->tier, l->id, l->token);
        free(l);
    }
    if (tn->q_n)
        fprintf(stderr, "strata-server: tier: %u conversations were not sent (they stay in the "
                "local store)\n", tn->q_n);
    st_tier_close(tn->tier);
    for (uint32_t b = 0; b < TN_BUCKETS; b++)
        for (known *k = tn->map[b], *n; k; k = n) {
            n = k->next;
            free(k);
        }
    free(tn->q);
    pthread_cond_destroy(&tn->cv);
    pthread_mutex_destroy(&tn->mu);
    free(tn);
}

static st_tier_outcome queue_locked(st_tiernode *tn, const char *id, uint64_t version)
{
    int ok = q_put_locked(tn, id, version);
    if (!ok)
        tn->st.unqueued++;
    return ok ? ST_TIER_PENDING : ST_TIER_UNQUEUED;
}

st_tier_outcome st_tiernode_queue(st_tiernode *tn, const char *id, uint64_t version)
{
    pthread_mutex_lock(&tn->mu);
    st_tier_outcome out = queue_locked(tn, id, version);
    pthread_mutex_unlock(&tn->mu);
    return out;
}

st_tier_outcome st_tiernode_saved(st_tiernode *tn, const char *id, uint64_t version,
                                  uint64_t *tier_version)
{
    *tier_version = 0;
    pthread_mutex_lock(&tn->mu);
    int queue = tn->q_n > 0 || !tn->tier; /* invariant 2 */
    if (queue) {
        st_tier_outcome out = queue_locked(tn, id, version);
        pthread_mutex_unlock(&tn->mu);
        return out;
    }
    st_tier *t = tn->tier;
    pthread_mutex_unlock(&tn->mu);
    int rc = push_one(tn, t, id, version, tier_version);
    if (!rc)
        return ST_TIER_SENT;
    pthread_mutex_lock(&tn->mu);
    st_tier_outcome out;
    if (rc == ST_ECONFLICT) {
        tn->st.conflicts++;
        out = ST_TIER_CONFLICT;
    } else if (rc == ST_EIO) {
        out = queue_locked(tn, id, version);
    } else {
        tn->st.errors++;
        fprintf(stderr, "strata-server: tier: %s version %llu was not sent: %s: %s\n", id,
                (unsigned long long)version, st_strerror(rc), st_errdetail());
        out = ST_TIER_UNQUEUED;
    }
    pthread_mutex_unlock(&tn->mu);
    *tier_version = 0;
    return out;
}

/* st_tiernode_fetch; own: the holder record named this node when its lease was taken just now
 * (invariant 7). */
static int fetch_in(st_tiernode *tn, const char *id, uint64_t max_bytes, int own, int *fetched)
{
    *fetched = 0;
    st_tier *t = tier_get(tn);
    if (!t)
        return st_error_set(ST_EIO, "tier %s: not reachable: %s", tn->url, st_errdetail());
    uint64_t head = 0;
    int rc = st_tier_head_get(t, id, &head);
    if (rc == ST_EINVAL) /* an id the tier cannot hold (the store's alphabet is wider): local */
        return 0;
    if (rc) {
        pthread_mutex_lock(&tn->mu);
        tn->st.up = rc != ST_EIO;
        pthread_mutex_unlock(&tn->mu);
        return rc;
    }
    pthread_mutex_lock(&tn->mu);
    uint64_t mine = known_get_locked(tn, id);
    tn->st.up = 1;
    pthread_mutex_unlock(&tn->mu);
    if (!head || head == mine)
        return 0;
    st_version_info vi;
    if (own && !mine && !st_store_version_info(tn->store, id, 0, &vi)) {
        /* this process never sent or fetched it, but this node held it last (before a
         * restart): the head is this node's own SAVE, and its copy at least as new */
        pthread_mutex_lock(&tn->mu);
        known_set_locked(tn, id, head);
        tn->st.adopted++;
        pthread_mutex_unlock(&tn->mu);
        return 0;
    }
    st_error_clear();
    st_tier_xfer_stats xs;
    memset(&xs, 0, sizeof xs);
    rc = st_tier_pull(t, tn->store, id, head, max_bytes, &xs);
    if (!rc)
        *fetched = 1;
    pthread_mutex_lock(&tn->mu);
    if (!rc) {
        known_set_locked(tn, id, xs.tier_version);
        tn->st.pulls++;
        tn->st.pulled_bytes += xs.bytes;
    } else if (rc != ST_ENOTFOUND && rc != ST_EIO) {
        tn->st.errors++;
    }
    if (rc != ST_ENOTFOUND)
        tn->st.up = rc != ST_EIO;
    pthread_mutex_unlock(&tn->mu);
    return rc;
}

int st_tiernode_fetch(st_tiernode *tn, const char *id, uint64_t max_bytes, int *fetched)
{
    return fetch_in(tn, id, max_bytes, 0, fetched);
}

void st_tiernode_stats_get(st_tiernode *tn, st_tiernode_stats *s)
{
    pthread_mutex_lock(&tn->mu);
    *s = tn->st;
    pthread_mutex_unlock(&tn->mu);
}
