/*
 * st_tiernode.h - a strata-server node's side of the shared tier (issue 15; docs/SCALE.md): what
 * this node sends to the tier after each SAVE, what it fetches from it for a conversation it
 * does not hold, and the bounded queue of SAVEs the tier has not confirmed yet. Internal to api/;
 * the conversation manager (st_conv.c) calls it, the server (st_server.c) makes it and renders
 * its counters in /metrics. Plain C over the store and the tier's client (statestore/st_tier.c,
 * st_tier_xfer.c); nothing here knows HTTP or JSON.
 *
 * Threads: every function may be called from any thread; one background thread sends the queue.
 */
#ifndef ST_TIERNODE_H
#define ST_TIERNODE_H

#include <stdint.h>

#include "st_store.h"

typedef struct st_tiernode st_tiernode;

typedef struct st_tiernode_opts {
    const char *url;      /* redis://HOST:PORT[,HOST:PORT...] */
    const char *node_id;  /* this node's name in the tier (leases, logs) */
    uint32_t replicas;    /* --tier-ack replica: 1 (a SAVE waits for WAIT); none: 0 */
    uint32_t wait_ms;     /* WAIT's timeout (default 2000) */
    uint32_t pending_max; /* conversations the queue holds at most (default 1024) */
    uint32_t retry_ms;    /* the queue's pause between tries while the tier is down (500) */
    uint32_t lease_ms;    /* a lease's TTL, renewed every third of it (default 10000) */
    uint32_t ttl_s;       /* what the tier keeps: st_tier_opts.ttl_s (0: forever) */
} st_tiernode_opts;

/* What the tier did with a SAVE (st_tiernode_saved). */
typedef enum {
    ST_TIER_SENT = 0,     /* the version is the tier's head (and on a replica, with replicas) */
    ST_TIER_PENDING,      /* the tier could not be reached: queued, sent when it returns */
    ST_TIER_CONFLICT,     /* another node saved this conversation since this node's copy was
                             taken: the tier keeps the other node's; this version stays local */
    ST_TIER_UNQUEUED      /* unreachable and the queue is full: this version stays local */
} st_tier_outcome;
const char *st_tier_outcome_name(st_tier_outcome o); /* "sent", "pending", "conflict", "unqueued" */

typedef struct st_tiernode_stats {
    uint64_t pushes, pushed_bytes, pushed_new_bytes, pulls, pulled_bytes;
    uint64_t conflicts, errors, unqueued, sent_from_queue;
    uint64_t leases_taken, leases_refused, leases_lost;
    uint64_t handovers;   /* begins that found another node held the conversation since */
    uint64_t adopted;     /* heads taken as this node's own after a restart (invariant 7) */
    uint64_t leases_retaken; /* expired leases nobody took since, taken again by the renewal */
    uint64_t orphans;     /* gauge: takes without a reply whose lease waits to be released */
    uint64_t orphans_released; /* such leases the tier held and released (invariant 8) */
    uint64_t park_pushes, park_pushed_bytes, park_pulls, park_pulled_bytes, park_errors;
    uint64_t leases_held; /* gauge */
    uint64_t pending;     /* gauge: conversations waiting in the queue */
    uint64_t pending_max;
    int up;               /* gauge: 1 when the last call to the tier succeeded */
} st_tiernode_stats;

/* Opens the tier (or, when no seed answers yet, keeps trying from the queue's thread: SAVEs
 * queue meanwhile) and starts the queue's thread. ST_EINVAL for a bad url or node id. */
int st_tiernode_new(const st_tiernode_opts *o, st_store *store, st_tiernode **out);
void st_tiernode_free(st_tiernode *tn); /* accepts NULL; stops the thread (what is queued stays
                                           local: a node restarted with the queue unsent saves
                                           those conversations again at their next SAVE) */

/* After version `version` of id was committed to the local store: send it (synchronously, with
 * WAIT when replicas > 0), or queue it. *tier_version: the tier's version when sent (else 0).
 * Never fails the SAVE: the outcome says what happened. */
st_tier_outcome st_tiernode_saved(st_tiernode *tn, const char *id, uint64_t version,
                                  uint64_t *tier_version);
/* The same, queued without trying: the caller found the tier unreachable a moment ago (a SAVE
 * whose lease could not be taken), so the SAVE does not wait for the tier's timeout twice. */
st_tier_outcome st_tiernode_queue(st_tiernode *tn, const char *id, uint64_t version);
/* id is not live on this node: when the tier's head of id is not the version this node last
 * sent or fetched (another node saved it since, or this node never had it), that head is put
 * into the local store as its new head (st_tier_pull) and *fetched is 1. 0 with *fetched 0 when
 * the local copy is current or the tier has none; ST_EIO when the tier cannot be reached; the
 * pull's error otherwise (the local store unchanged). */
int st_tiernode_fetch(st_tiernode *tn, const char *id, uint64_t max_bytes, int *fetched);
void st_tiernode_stats_get(st_tiernode *tn, st_tiernode_stats *s);
/* Forget the tier version this node last sent or fetched of id: its next fetch pulls the tier's
 * head whatever it is (the prefix index, for a point its store no longer holds). */
void st_tiernode_forget(st_tiernode *tn, const char *id);

/* Leases (invariant 5): a request that works on conversation id (a completion, a RESTORE)
 * begins with st_tiernode_begin and ends with st_tiernode_end. begin holds this node's lease on
 * id for the request (taken from the tier when no other request of this node holds it; renewed
 * by a thread every lease_ms / 3 while held): ST_EBUSY, naming the node, when another node holds
 * it; when the tier cannot be reached the request goes on without one. Taking it, begin learns
 * from the holder record (st_tier.c invariant 7) whether another node held the conversation
 * since this node did (b->handed: the caller drops its live copy, which is older; b->park: that
 * node parked the conversation into the tier as this version of park:<id>, the newest state to
 * continue from, st_tiernode_park_pull). Then, as st_tiernode_fetch, the tier's head is brought
 * into the local store when another node saved it since: b->fetched tells the caller to drop its
 * live copy of id and load the store's head. end releases the lease when no other request of
 * this node holds it, and returns 1 when it was lost meanwhile (not renewed in time and taken by
 * another node, or found expired by the release at the end): the caller drops its live copy.
 * flags ST_TIERNODE_FRESH (a spill to the tier, a SAVE): only a lease taken from the tier now,
 * and only while the holder record names this node or nobody, will do (a lease this node left
 * behind, its release failed, is taken over as for a request): ST_EBUSY when a request
 * of this node or another node holds it, ST_EIO when the tier cannot be reached, ST_ECONFLICT
 * with b->handed (and b->prev, b->park) when another node held the conversation since this node
 * did (this node's copy is stale; the record is left as it is). A fresh take that succeeds
 * never reports handed; fetched still tells that another node saved it since. */
typedef struct st_tiernode_begun {
    int fetched;   /* the tier's head was newer than this node's copy: now in the local store */
    int handed;    /* another node (prev) held the conversation since this node did */
    uint64_t park; /* with handed: prev parked it into the tier as this version of park:<id> */
    char prev[ST_TIER_OWNER_MAX + 1];
} st_tiernode_begun;
#define ST_TIERNODE_FRESH 1
int st_tiernode_begin(st_tiernode *tn, const char *id, int flags, st_tiernode_begun *b);
int st_tiernode_end(st_tiernode *tn, const char *id);

/* PARK at the RAM ceiling (docs/SCALE.md): version `version` of local session park_id (the
 * parked image of conversation id, just written to the local store) goes to the tier as
 * session park_id, and the holder record of id names it, under the lease this node holds on id
 * (begun with ST_TIERNODE_FRESH). ST_EBUSY when the lease was lost, ST_EIO when the tier (or
 * with replicas, a replica) did not confirm it: the park then stays local only. */
int st_tiernode_park(st_tiernode *tn, const char *id, const char *park_id, uint64_t version);
/* The park another node made (st_tiernode_begun.park): tier version tier_version of park_id into
 * the local store as a new version of park_id (at most max_bytes; 0: 32 GiB), as st_tier_pull. */
int st_tiernode_park_pull(st_tiernode *tn, const char *park_id, uint64_t tier_version,
                          uint64_t max_bytes);

#endif /* ST_TIERNODE_H */
