/*
 * st_conv.c - the conversation manager (st_conv.h): conversations in the engine's slots, the
 * park pool, where each lives, and what is done to them (generation, SAVE, RESTORE, PARK,
 * llama.cpp's slot files, DELETE, the graceful stop's persist). Plain C over the engine and the
 * store: the route handlers above it (st_route_*.c, st_openai.c) parse requests and shape replies.
 *
 * A conversation is in at most one of three places: a slot (live), the park pool in RAM (an
 * image with its whole checkpoint chain), or the park pool on disk (that image stored in the
 * store as session "park:<id>"). Besides, the store may hold versions the client saved.
 *
 * Invariants (cv->mu guards every field below; no slow work is done while holding it):
 * 1. A session id is bound to at most one slot, and then has no park entry. A slot is bound to
 *    the id a request wants as soon as the slot is chosen (before any slow work), and while the
 *    slot's previous conversation is being parked its id stays findable there (victim), busy,
 *    until it is in the pool: no request ever finds a conversation in two places or in none.
 * 2. A slot or park entry marked busy belongs to one worker; nobody else reads or changes the
 *    slot's state or the entry's image until it is released. A park entry taken by SAVE or PARK
 *    stays in the pool, busy; one taken into a slot leaves the pool while the slot is bound to
 *    its id, busy: a session in use is always findable, and busy, in one place. An entry in the
 *    pool that is not busy belongs to no worker: one that puts it there (park_slot, a give-back)
 *    reads nothing of it after releasing mu, since another request may take it and free it.
 * 3. ram_bytes is the sum of the bytes of the park entries whose image is in RAM. After a park,
 *    entries are spilled oldest first until ram_bytes <= ram_limit (an entry being used is
 *    skipped; a spill that fails leaves the entry in RAM and is logged).
 * 4. A disk entry's image is in the store under ST_API_PARK_PREFIX + id until it is taken back
 *    into a slot, restored over, or deleted; it is then deleted from the store. At start, every
 *    such session in the store becomes a disk entry again, so disk-parked conversations survive a
 *    crash. RAM entries and live slots do not (they are written to disk at a graceful stop).
 * 5. Choosing a slot for a session not in one takes a free slot, else the least recently used
 *    idle one, whose conversation is parked first; if parking fails the request fails and the
 *    slot keeps its conversation.
 * 6. A request for a busy session waits for it on its own worker thread (never on the loop), in
 *    cv->waiters, for at most wait_ms (--busy-wait-ms; 0: no waiting), then is answered 409
 *    busy. Every place that clears a busy flag, or takes a victim's id out of its slot, wakes
 *    the waiters (cv->freed). Waiters for one id are served in arrival order: a request takes a
 *    session only when it is not busy and no earlier request waits for that id, so a newcomer
 *    never overtakes a waiter. The waiting requests plus one holder per session waited for (each
 *    holder runs on a worker too) never exceed wait_max = workers - 1 (beyond: 409 at once), so
 *    one worker is always left for other sessions: for a single session, workers - 2 requests
 *    wait. Requests that need a slot while every slot is busy, and /slots actions on a busy slot,
 *    are still answered 409 at once: nothing guarantees that a slot will be freed soon.
 * 7. A completion whose client went away (*g->cancel, set by the loop) stops at the
 *    next point where the conversation is whole: before it takes its session (while queued or
 *    waiting for it: it never runs), between prompt chunks, or between generated tokens. The
 *    slot then holds exactly the tokens read and generated so far, with the logits after the
 *    last one, like a completion that asked for that many; the session is released as after
 *    any completion, nothing is sent, and completions_cancelled counts it. The prompt is read
 *    in one st_slot_eval whose cancel hook (st_slot_set_cancel) the engine asks before each
 *    chunk: a stop there leaves the whole chunks read so far with the logits after the last (the
 *    next request reads on from there; SAVE and PARK take it as it is). SAVE, RESTORE, PARK, /slots and DELETE are never cancelled: their
 *    result is durable or cheap, and they run to the end.
 * 8. The prefix search of a request without a session (anon_best_locked) reads, under mu, only
 *    what no worker owns: idle slots' tokens, the tokens of pool entries that are not busy (a
 *    RAM entry's image, a disk entry's copy made when it was spilled: anonymous ones only, at most
 *    DISK_TOKENS tokens in all; the newest POOL_SEARCH_MAX entries), and the store index. The
 *    store index (sidx) holds the tokens of store heads this server saved or loaded, at most
 *    SIDX_MAX entries and SIDX_TOKENS tokens in all, least recently used dropped first; it is a
 *    hint: what a request reads is the image restored, compared token by token, so a stale
 *    entry (a version deleted or saved by another process) costs a restore, never a wrong
 *    answer.
 * 9. With a shared tier (env->tier, docs/SCALE.md): a completion or RESTORE holds the tier's lease
 *    on its conversation from acquire to slot_release (st_tiernode_begin / _end), so two nodes
 *    never work on one conversation at once (the other is refused, 409); when the tier's head
 *    is newer than the version this node last sent or fetched (another node saved it), the
 *    head is fetched into the store and this node's live copy (slot or park) is dropped before
 *    the request reads it; a lease lost during a request (not renewed in time, taken by another
 *    node) drops the live copy when the request ends. A SAVE (and a PARK) of a named
 *    conversation takes the lease as a spill does (live_lease; invariant 11): a copy older than
 *    what another node made since (held or saved) is dropped and the SAVE refused (409
 *    conflict); then it is sent to
 *    the tier after the local commit (st_tiernode_saved: the tier never fails the SAVE; the
 *    tier away: queued, "pending").
 * 10. With the prefix index (cv->prefix, st_prefix.h): a completion whose conversation holds
 *    nothing (a new id, a session never saved) resumes from the deepest point of the index its
 *    prompt shares (found "index"), before it reads; one whose read began at 0 or at that point
 *    (so that every position below is a full read's, in a full read's chunks) records its points
 *    when it ends, the slot still bound. A resumed read continues at a chunk end of a full read,
 *    so the tokens are a full read's. For a recurrent model the engine takes a checkpoint at
 *    every multiple of ubatch (--prompt-cache-every, unless given), where those points lie.
 * 11. Handover and parking into the tier (docs/SCALE.md): the lease's take tells whether another
 *    node held the conversation since this node did (st_tiernode_begun.handed); then this
 *    node's live copy (slot or park) is older than that node's and is dropped, as when the
 *    tier's head is newer, so one conversation is never extended from two states. A park
 *    entry of a named conversation spilled at the RAM ceiling is written to the store and,
 *    under a lease the spill takes for it (not while a request of this node or another node
 *    holds it), into the tier as session park:<id>, named in the holder record: the next node
 *    that takes the conversation continues from that park (found "tier"), so a turn parked
 *    here survives this node's loss. A spill that finds its copy stale drops the entry.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "st_conv.h"
#include "st_prefix.h"
#include "st_tiernode.h"
#include "st_engine.h"
#include "st_file.h"
#include "st_store.h"

#define PARK_ID_MAX (ST_STORE_ID_MAX + 1)
/* how often a request waiting for a busy session looks whether its client went away */
#define CANCEL_POLL_MS 50

typedef struct cslot {
    st_slot *slot;
    int bound;
    char id[ST_API_ID_MAX + 1];
    char victim[ST_API_ID_MAX + 1]; /* the conversation being parked out of this slot, or "" */
    int busy;
    uint64_t last_used;
    uint64_t tokens; /* held, as of the last release */
    uint64_t bytes;  /* of its park image (slot_image_bytes), as of the last release */
    int lease;       /* the request holding it holds the tier's lease on id (st_tiernode_begin) */
} cslot;

/* A held conversation's tokens and checkpoint positions (increasing), copied for the prefix
 * search (invariant 8). toks NULL: none. */
typedef struct hcopy {
    uint32_t *toks;
    uint64_t n;
    uint64_t *pos;
    uint32_t n_pos;
} hcopy;

typedef struct pentry {
    char id[ST_API_ID_MAX + 1];
    st_image *img; /* NULL when on disk */
    hcopy held;    /* on disk: a copy made at the spill (toks NULL: unknown, not searched) */
    uint64_t bytes, tokens, tick;
    int busy;
    struct pentry *prev, *next; /* oldest first */
} pentry;

/* A store head's tokens, for the prefix search (invariant 8). */
#define SIDX_MAX 64
#define SIDX_TOKENS (1u << 20) /* 4 MiB of token ids in all */
#define DISK_TOKENS (1u << 22) /* the disk entries' copies: 16 MiB of token ids in all */
#define POOL_SEARCH_MAX 256    /* pool entries the search reads, newest first */
typedef struct sidx_entry {
    char id[ST_API_ID_MAX + 1];
    hcopy held;    /* held.n == 0: unused */
    uint64_t tick;
} sidx_entry;

/* A request waiting for a busy session (invariant 6): on its worker's stack while it waits. */
typedef struct cwaiter {
    const char *id;
    struct cwaiter *next;
} cwaiter;

struct st_conv {
    const st_conv_env *env;
    st_store *store;
    st_conv_counters *m;
    const st_memguard *guard;
    st_model *model;
    st_engine *engine;
    st_chat_template *chat; /* the model's, or ChatML when it has none or it does not parse */
    uint32_t n_vocab, n_ctx;
    uint32_t n_slots;
    cslot *slots;
    pthread_mutex_t mu;
    pentry *head, *tail;
    uint64_t ram_bytes, ram_limit, tick;
    pthread_cond_t freed;          /* broadcast when a session may have stopped being busy */
    st_conv_hold *held;            /* ids held by name while a DELETE removes their versions */
    cwaiter *wait_head, *wait_tail; /* arrival order */
    uint32_t n_waiting, wait_max, wait_ms;
    sidx_entry sidx[SIDX_MAX];     /* the store index (invariant 8) */
    uint64_t sidx_tokens;
    int kv_only;                   /* every layer keeps K/V: a conversation cuts at any position */
    st_prefix *prefix;             /* the prefix index (invariant 10); NULL: off */
    _Atomic uint64_t disk_toks;    /* tokens in the disk entries' copies, at most DISK_TOKENS */
};

/* 0, or ST_EDAMAGED when the server quarantined id (st_conv_env.damaged). */
static int damaged(st_conv *cv, const char *id)
{
    return cv->env->damaged ? cv->env->damaged(cv->env->damaged_arg, id) : 0;
}

double st_conv_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

int st_conv_id_valid(const char *id, size_t len)
{
    if (!id || len == 0 || len > ST_API_ID_MAX)
        return 0;
    for (size_t i = 0; i < len; i++) {
        unsigned char ch = (unsigned char)id[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return 0;
    }
    return 1;
}

static void park_id(char *dst, const char *id)
{
    snprintf(dst, PARK_ID_MAX, "%s%s", ST_API_PARK_PREFIX, id);
}

/* ---- bookkeeping (under mu) ----------------------------------------------------------------- */

static void gauges_locked(st_conv *cv)
{
    uint64_t bound = 0, busy = 0, ram = 0, disk = 0;
    for (uint32_t i = 0; i < cv->n_slots; i++) {
        bound += cv->slots[i].bound;
        busy += cv->slots[i].busy;
    }
    for (pentry *p = cv->head; p; p = p->next) {
        if (p->img)
            ram++;
        else
            disk++;
    }
    cv->m->slots_bound = bound;
    cv->m->slots_busy = busy;
    cv->m->pool_ram_entries = ram;
    cv->m->pool_disk_entries = disk;
    cv->m->pool_ram_bytes = cv->ram_bytes;
}

static int slot_find_locked(st_conv *cv, const char *id)
{
    for (uint32_t i = 0; i < cv->n_slots; i++)
        if ((cv->slots[i].bound && !strcmp(cv->slots[i].id, id)) ||
            (cv->slots[i].victim[0] && !strcmp(cv->slots[i].victim, id)))
            return (int)i;
    return -1;
}

static pentry *park_find_locked(st_conv *cv, const char *id)
{
    for (pentry *p = cv->head; p; p = p->next)
        if (!strcmp(p->id, id))
            return p;
    return NULL;
}

static void park_append_locked(st_conv *cv, pentry *p)
{
    p->tick = ++cv->tick;
    p->prev = cv->tail;
    p->next = NULL;
    if (cv->tail)
        cv->tail->next = p;
    else
        cv->head = p;
    cv->tail = p;
    if (p->img)
        cv->ram_bytes += p->bytes;
}

static void park_remove_locked(st_conv *cv, pentry *p)
{
    if (p->prev)
        p->prev->next = p->next;
    else
        cv->head = p->next;
    if (p->next)
        p->next->prev = p->prev;
    else
        cv->tail = p->prev;
    if (p->img)
        cv->ram_bytes -= p->bytes;
}

static void hcopy_free(hcopy *h)
{
    free(h->toks);
    free(h->pos);
    memset(h, 0, sizeof *h);
}

/* Room for n tokens and n_pos positions in h (its contents undefined); -1 when out of memory
 * (h empty). */
static int hcopy_alloc(hcopy *h, uint64_t n, uint32_t n_pos)
{
    memset(h, 0, sizeof *h);
    h->n = n;
    h->n_pos = n_pos;
    h->toks = malloc((h->n ? h->n : 1) * sizeof *h->toks);
    h->pos = malloc((h->n_pos ? h->n_pos : 1) * sizeof *h->pos);
    if (!h->toks || !h->pos) {
        hcopy_free(h);
        return -1;
    }
    return 0;
}

/* A copy of img's tokens and checkpoint positions; -1 when out of memory (nothing copied). */
static int hcopy_image(const st_image *img, hcopy *h)
{
    if (hcopy_alloc(h, st_image_n_tokens(img), st_image_n_checkpoints(img)))
        return -1;
    memcpy(h->toks, st_image_tokens(img), h->n * sizeof *h->toks);
    for (uint32_t i = 0; i < h->n_pos; i++) {
        uint32_t codec;
        if (st_image_checkpoint_info(img, i, &h->pos[i], &codec))
            h->pos[i] = 0;
    }
    return 0;
}

/* The same of a slot (busy: the caller's). */
static int hcopy_slot(const st_slot *s, hcopy *h)
{
    if (hcopy_alloc(h, st_slot_n_tokens(s), st_slot_n_checkpoints(s)))
        return -1;
    memcpy(h->toks, st_slot_tokens(s), h->n * sizeof *h->toks);
    for (uint32_t i = 0; i < h->n_pos; i++)
        h->pos[i] = st_slot_checkpoint_pos(s, i);
    return 0;
}

static void pentry_free(st_conv *cv, pentry *p)
{
    if (p->held.toks)
        cv->disk_toks -= p->held.n;
    st_image_free(p->img);
    hcopy_free(&p->held);
    free(p);
}

/* ---- the store index (invariant 8) ---------------------------------------------------------- */

static void sidx_drop_locked(st_conv *cv, sidx_entry *e)
{
    cv->sidx_tokens -= e->held.n;
    hcopy_free(&e->held);
    memset(e, 0, sizeof *e);
}

/* Record h (taken: freed here when not kept) as the head of stored session id. */
static void sidx_put(st_conv *cv, const char *id, hcopy *h)
{
    if (!h->toks || h->n == 0 || h->n > SIDX_TOKENS ||
        !strncmp(id, ST_API_PARK_PREFIX, strlen(ST_API_PARK_PREFIX))) {
        hcopy_free(h);
        return;
    }
    pthread_mutex_lock(&cv->mu);
    for (int i = 0; i < SIDX_MAX; i++)
        if (cv->sidx[i].held.n && !strcmp(cv->sidx[i].id, id))
            sidx_drop_locked(cv, &cv->sidx[i]);
    sidx_entry *slot = NULL;
    for (;;) { /* room: a free entry and the tokens' bound, dropping the least recently used */
        sidx_entry *lru = NULL;
        slot = NULL;
        for (int i = 0; i < SIDX_MAX; i++) {
            if (!cv->sidx[i].held.n)
                slot = slot ? slot : &cv->sidx[i];
            else if (!lru || cv->sidx[i].tick < lru->tick)
                lru = &cv->sidx[i];
        }
        if (slot && cv->sidx_tokens + h->n <= SIDX_TOKENS)
            break;
        sidx_drop_locked(cv, lru);
    }
    snprintf(slot->id, sizeof slot->id, "%s", id);
    slot->held = *h;
    slot->tick = ++cv->tick;
    cv->sidx_tokens += h->n;
    pthread_mutex_unlock(&cv->mu);
    memset(h, 0, sizeof *h);
}

static void sidx_put_slot(st_conv *cv, const char *id, const st_slot *s)
{
    hcopy h;
    if (!hcopy_slot(s, &h))
        sidx_put(cv, id, &h);
}

static void sidx_put_image(st_conv *cv, const char *id, const st_image *img)
{
    hcopy h;
    if (!hcopy_image(img, &h))
        sidx_put(cv, id, &h);
}

static void sidx_forget(st_conv *cv, const char *id)
{
    pthread_mutex_lock(&cv->mu);
    for (int i = 0; i < SIDX_MAX; i++)
        if (cv->sidx[i].held.n && !strcmp(cv->sidx[i].id, id))
            sidx_drop_locked(cv, &cv->sidx[i]);
    pthread_mutex_unlock(&cv->mu);
}

/* ---- waiting for a busy session (invariant 6; under mu) ---------------------------------------- */

static void wake_locked(st_conv *cv)
{
    if (cv->wait_head)
        pthread_cond_broadcast(&cv->freed);
}

static int id_busy_locked(st_conv *cv, const char *id)
{
    for (st_conv_hold *h = cv->held; h; h = h->next)
        if (!strcmp(h->id, id))
            return 1;
    int j = slot_find_locked(cv, id);
    if (j >= 0)
        return cv->slots[j].busy;
    pentry *p = park_find_locked(cv, id);
    return p && p->busy;
}

static cwaiter *waiter_first_locked(st_conv *cv, const char *id)
{
    for (cwaiter *w = cv->wait_head; w; w = w->next)
        if (!strcmp(w->id, id))
            return w;
    return NULL;
}

static void waiter_remove_locked(st_conv *cv, cwaiter *me)
{
    cwaiter **pp = &cv->wait_head, *prev = NULL;
    while (*pp != me) {
        prev = *pp;
        pp = &(*pp)->next;
    }
    *pp = me->next;
    if (cv->wait_tail == me)
        cv->wait_tail = prev;
    cv->n_waiting--;
    cv->m->busy_waiting = cv->n_waiting;
}

/* Returns 0, still holding mu, once session id is not busy and no earlier request waits for it:
 * the caller takes it (or finds it absent) before unlocking. ST_EBUSY with a detail when waiting
 * is off, when the wait queue is full (invariant 6), or when wait_ms passed; ECANCELED when
 * cancel (NULL: the request cannot be cancelled) is set while it waits (invariant 7). */
static int wait_turn_locked(st_conv *cv, const char *id, const _Atomic int *cancel)
{
    if (!id_busy_locked(cv, id) && !waiter_first_locked(cv, id))
        return 0;
    if (!cv->wait_ms)
        return st_error_set(ST_EBUSY, "session %s is busy with another request", id);
    /* workers tied up once this one waits: the waiters, and one holder per session waited for */
    uint32_t ids = 0;
    for (cwaiter *w = cv->wait_head; w; w = w->next)
        ids += waiter_first_locked(cv, w->id) == w;
    uint32_t tied = cv->n_waiting + 1 + ids + (waiter_first_locked(cv, id) ? 0 : 1);
    if (tied > cv->wait_max) {
        cv->m->busy_wait_full++;
        return st_error_set(ST_EBUSY, "session %s is busy with another request and the wait queue is "
                                      "full (waiting requests: %u, sessions waited for: %u; waiting requests "
                                      "and those they wait for take at most --workers - 1 = %u workers)",
                            id, cv->n_waiting, ids, cv->wait_max);
    }
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    dl.tv_sec += (time_t)(cv->wait_ms / 1000);
    dl.tv_nsec += (long)(cv->wait_ms % 1000) * 1000000L;
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    cwaiter me = {id, NULL};
    if (cv->wait_tail)
        cv->wait_tail->next = &me;
    else
        cv->wait_head = &me;
    cv->wait_tail = &me;
    cv->n_waiting++;
    cv->m->busy_waiting = cv->n_waiting;
    int rc = 0;
    while (waiter_first_locked(cv, id) != &me || id_busy_locked(cv, id)) {
        if (cancel && atomic_load_explicit(cancel, memory_order_relaxed)) {
            rc = st_error_set(ECANCELED, "the client went away while session %s was busy", id);
            break;
        }
        struct timespec now, until = dl;
        clock_gettime(CLOCK_MONOTONIC, &now);
        if (now.tv_sec > dl.tv_sec || (now.tv_sec == dl.tv_sec && now.tv_nsec >= dl.tv_nsec)) {
            cv->m->busy_wait_timeouts++;
            rc = st_error_set(ST_EBUSY, "session %s is still busy with another request after waiting "
                                        "%u ms (--busy-wait-ms)", id, cv->wait_ms);
            break;
        }
        if (cancel) { /* nobody signals a cancellation: look again every CANCEL_POLL_MS */
            now.tv_nsec += CANCEL_POLL_MS * 1000000L;
            if (now.tv_nsec >= 1000000000L) {
                now.tv_sec++;
                now.tv_nsec -= 1000000000L;
            }
            if (now.tv_sec < dl.tv_sec || (now.tv_sec == dl.tv_sec && now.tv_nsec < dl.tv_nsec))
                until = now;
        }
        pthread_cond_timedwait(&cv->freed, &cv->mu, &until);
    }
    waiter_remove_locked(cv, &me);
    /* the next in line for id is first now: it takes the session once the caller releases it,
     * or at once if the caller leaves it (the session is not live, every slot is busy, a timeout) */
    wake_locked(cv);
    return rc;
}

/* ---- releasing ---------------------------------------------------------------------------------- */

/* Bytes (st_image_bytes) of the fp32 image st_slot_snapshot makes of this slot: a park image
 * holds the live state and every held checkpoint before it, a session image the live state and
 * the deepest of those (the memory guard's estimate, and the size a listing shows). */
static uint64_t slot_image_bytes(st_slot *s, int park)
{
    const st_geometry *g = st_slot_geometry(s);
    uint64_t n = st_slot_n_tokens(s), kv = 0, run = 0, before = 0;
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *t = &g->tensors[i];
        if (t->role == ST_ROLE_KV)
            kv += st_tensor_row_bytes(t) * n;
        else
            run += st_tensor_stored_bytes(t, ST_CODEC_FP32);
    }
    for (uint32_t i = 0, nc = st_slot_n_checkpoints(s); i < nc; i++)
        before += st_slot_checkpoint_pos(s, i) < n;
    uint64_t ck = 1 + (park ? before : before > 0);
    return kv + run * ck + n * 4 + (uint64_t)g->n_vocab * 4;
}

static void slot_release(st_conv *cv, int j)
{
    cslot *cs = &cv->slots[j];
    if (cs->lease) { /* the request's lease; lost meanwhile: this node's copy is dropped */
        cs->lease = 0;
        if (st_tiernode_end(cv->env->tier, cs->id)) {
            pthread_mutex_lock(&cv->mu);
            cs->bound = 0;
            st_slot_reset(cs->slot);
            pthread_mutex_unlock(&cv->mu);
        }
    }
    pthread_mutex_lock(&cv->mu);
    cs->busy = 0;
    wake_locked(cv);
    cs->last_used = ++cv->tick;
    cs->tokens = st_slot_n_tokens(cs->slot);
    cs->bytes = cs->tokens ? slot_image_bytes(cs->slot, 1) : 0;
    if (cs->bound && cs->tokens == 0)
        cs->bound = 0; /* an eval error reset it: nothing is held */
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);
}

/* ---- spilling and parking ----------------------------------------------------------------- */

/* A stored version of id (0: the head) into slot s, by a streamed get (st_store_get_stream):
 * the restore starts while the store still copies the chunks, and the CUDA backend moves each
 * one to the device once it is copied and checked. On any error the slot is as it was, and the
 * error is the restore's (a damaged chunk's, when the restore stopped at it) or the get's. */
static int restore_stored(st_conv *cv, st_slot *s, const char *id, uint64_t version)
{
    st_image *img = NULL;
    st_store_fill *fill = NULL;
    int rc = st_store_get_stream(cv->store, id, version, st_engine_image_allocator(cv->engine), &img, &fill);
    if (rc)
        return rc;
    rc = st_slot_restore_adopt(s, img);
    char d[1024] = "";
    if (rc)
        snprintf(d, sizeof d, "%s", st_errdetail());
    int frc = st_store_stream_end(fill); /* before the image is freed: the copy has finished */
    st_image_free(img);
    if (rc)
        return st_error_set(rc, "%s", d);
    return frc;
}

static int put_park(st_conv *cv, const char *id, const st_image *img, const st_put_opts *po,
                    uint64_t *version)
{
    char pid[PARK_ID_MAX];
    park_id(pid, id);
    int rc = st_store_put(cv->store, pid, img, ST_STORE_HEAD_ANY, po, version);
    if (rc == ST_EMODEL || rc == ST_EGEOMETRY) {
        /* a stale spill made under another model: this image replaces it */
        st_store_session_delete(cv->store, pid);
        rc = st_store_put(cv->store, pid, img, ST_STORE_HEAD_ANY, po, version);
    }
    return rc;
}

static void drop_park_store(st_conv *cv, const char *id)
{
    char pid[PARK_ID_MAX];
    park_id(pid, id);
    int rc = st_store_session_delete(cv->store, pid);
    if (rc && rc != ST_ENOTFOUND)
        fprintf(stderr, "strata-server: removing the spilled image of %s: %s\n", id, st_errdetail());
}

/* A spill of conversation id's parked image to the store and, with a tier, to the tier too
 * (invariant 11): *stale 1 when the tier says the image is older than what another node holds
 * (nothing written: the caller drops the entry). The tier's part never fails the spill. */
static int spill_one(st_conv *cv, const char *id, const st_image *img, int *stale)
{
    *stale = 0;
    st_tiernode *tn = cv->env->tier;
    st_tiernode_begun b;
    memset(&b, 0, sizeof b);
    int brc = tn && strncmp(id, ST_CONV_ANON_PREFIX, strlen(ST_CONV_ANON_PREFIX))
                  ? st_tiernode_begin(tn, id, ST_TIERNODE_FRESH, &b) : -1;
    if (brc == ST_ECONFLICT && b.handed) { /* another node held it since: this copy is older */
        st_error_clear();
        *stale = 1;
        return 0;
    }
    if (brc) {
        /* no tier; an anonymous conversation (no other node asks for it); a request of this
         * node holds its lease (it waits for this entry), or another node does, or the tier is
         * away: the local store only */
        st_error_clear();
        return put_park(cv, id, img, NULL, NULL);
    }
    if (b.fetched) { /* another node saved it since: this copy is older */
        (void)st_tiernode_end(tn, id);
        *stale = 1;
        return 0;
    }
    uint64_t v = 0;
    int rc = put_park(cv, id, img, NULL, &v);
    if (!rc) {
        char pid[PARK_ID_MAX];
        park_id(pid, id);
        if (st_tiernode_park(tn, id, pid, v)) /* counted in strata_tier_park_errors_total */
            fprintf(stderr, "strata-server: parking %s into the tier failed (it is parked in this "
                    "node's store only): %s\n", id, st_errdetail());
    }
    (void)st_tiernode_end(tn, id);
    return rc;
}

/* The park another node made of id in the tier (st_tiernode_begun.park) into slot s: pulled into
 * the local store as its disk park, restored, and removed from the store again (it is in the
 * slot now: invariant 4). On failure the slot is as it was. */
static int park_from_tier(st_conv *cv, st_slot *s, const char *id, uint64_t tier_version)
{
    char pid[PARK_ID_MAX];
    park_id(pid, id);
    drop_park_store(cv, id); /* one of this node's own, older (maybe of another model, which
                                the pull's put would refuse): the pulled one replaces it */
    int rc = st_tiernode_park_pull(cv->env->tier, pid, tier_version, 0);
    st_version_info vi;
    if (!rc)
        rc = st_store_version_info(cv->store, pid, 0, &vi);
    if (!rc)
        rc = st_memguard_admit(cv->guard, "restoring a conversation parked on another node",
                               vi.logical_bytes);
    if (!rc)
        rc = restore_stored(cv, s, pid, 0);
    if (!rc) {
        cv->m->restores++;
        cv->m->restore_bytes += vi.logical_bytes;
    }
    char d[1024] = "";
    if (rc)
        snprintf(d, sizeof d, "%s", st_errdetail());
    drop_park_store(cv, id);
    return rc ? st_error_set(rc, "%s", d) : 0;
}

/* Spill RAM entries, oldest first, until the pool is under its ceiling (invariant 3). */
static void spill_excess(st_conv *cv)
{
    for (;;) {
        pthread_mutex_lock(&cv->mu);
        pentry *p = NULL;
        if (cv->ram_bytes > cv->ram_limit)
            for (p = cv->head; p && (!p->img || p->busy); p = p->next) {
            }
        if (!p) {
            gauges_locked(cv);
            pthread_mutex_unlock(&cv->mu);
            return;
        }
        p->busy = 1;
        st_image *img = p->img;
        char id[ST_API_ID_MAX + 1];
        memcpy(id, p->id, sizeof id);
        pthread_mutex_unlock(&cv->mu);

        int stale = 0;
        int rc = spill_one(cv, id, img, &stale);
        if (!rc && stale) {
            /* another node held it since this copy was made: dropped (invariant 11) */
            fprintf(stderr, "strata-server: parked %s is older than the tier's (another node "
                    "held it since): dropped\n", id);
            pthread_mutex_lock(&cv->mu);
            park_remove_locked(cv, p);
            cv->m->park_dropped_stale++;
            wake_locked(cv);
            gauges_locked(cv);
            pthread_mutex_unlock(&cv->mu);
            drop_park_store(cv, id);
            pentry_free(cv, p);
            continue;
        }
        /* the prefix search's copy of an anonymous one's tokens (invariant 8): the image goes */
        uint64_t nt = st_image_n_tokens(img);
        hcopy held = {0};
        if (!rc && nt && !strncmp(id, ST_CONV_ANON_PREFIX, strlen(ST_CONV_ANON_PREFIX)) &&
            (atomic_fetch_add(&cv->disk_toks, nt) + nt > DISK_TOKENS || hcopy_image(img, &held)))
            atomic_fetch_sub(&cv->disk_toks, nt);

        pthread_mutex_lock(&cv->mu);
        p->busy = 0;
        wake_locked(cv);
        if (rc) {
            pthread_mutex_unlock(&cv->mu);
            fprintf(stderr, "strata-server: spilling parked %s to the store failed (it stays in RAM, "
                            "over the ceiling): %s\n", id, st_errdetail());
            return;
        }
        cv->ram_bytes -= p->bytes;
        p->img = NULL;
        p->held = held;
        cv->m->park_spills++;
        gauges_locked(cv);
        pthread_mutex_unlock(&cv->mu);
        st_image_free(img);
    }
}

/* Park the conversation id held by busy slot j into the pool; the slot ends empty, and unbound
 * when unbind (acquire has already bound it to its next id). *where: "ram" or "disk". On
 * failure the slot is unchanged. */
static int park_slot(st_conv *cv, int j, const char *id, int unbind, const char **where,
                     uint64_t *bytes)
{
    st_slot *s = cv->slots[j].slot;
    int rc = st_memguard_admit(cv->guard, "parking", slot_image_bytes(s, 1));
    if (rc)
        return rc;
    st_image *img = NULL;
    if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_PARK, ST_CODEC_FP32, &img)))
        return rc;
    pentry *p = calloc(1, sizeof *p);
    if (!p) {
        st_image_free(img);
        return st_error_set(ENOMEM, "parking %s: no memory", id);
    }
    snprintf(p->id, sizeof p->id, "%s", id);
    p->img = img;
    p->bytes = st_image_bytes(img);
    p->tokens = st_image_n_tokens(img);
    /* once p is in the pool and mu is released, p is no longer ours: another request may take
     * it back into a slot and free it (while spill_excess below waits for the store, say), so
     * nothing of p is read after the unlock */
    uint64_t img_bytes = p->bytes;
    pthread_mutex_lock(&cv->mu);
    park_append_locked(cv, p);
    cv->slots[j].victim[0] = '\0';
    if (unbind)
        cv->slots[j].bound = 0;
    cv->slots[j].tokens = 0;
    cv->slots[j].bytes = 0;
    wake_locked(cv); /* a victim's id is in the pool now, not busy */
    pthread_mutex_unlock(&cv->mu);
    st_slot_reset(s);
    spill_excess(cv);
    pthread_mutex_lock(&cv->mu);
    pentry *q = park_find_locked(cv, id); /* NULL when taken back into a slot meanwhile */
    int on_disk = q && !q->img;
    if (bytes)
        *bytes = q ? q->bytes : img_bytes;
    pthread_mutex_unlock(&cv->mu);
    if (on_disk)
        cv->m->parks_disk++;
    else
        cv->m->parks_ram++;
    cv->m->park_bytes += img_bytes;
    if (where)
        *where = on_disk ? "disk" : "ram";
    return 0;
}

/* Bring busy park entry p (not in the list any more) into slot j. */
static int load_parked(st_conv *cv, int j, pentry *p, const char **source)
{
    st_slot *s = cv->slots[j].slot;
    int rc;
    if (p->img) {
        if ((rc = st_slot_restore(s, p->img)))
            return rc;
        cv->m->conv_hits_ram++;
        *source = "ram";
        return 0;
    }
    if ((rc = st_memguard_admit(cv->guard, "restoring a parked conversation", p->bytes)))
        return rc;
    char pid[PARK_ID_MAX];
    park_id(pid, p->id);
    if ((rc = restore_stored(cv, s, pid, 0)))
        return rc;
    cv->m->conv_hits_disk++;
    cv->m->park_unspills++;
    *source = "disk";
    return 0;
}

/* 1 when id is in a slot or parked here. */
static int live(st_conv *cv, const char *id)
{
    pthread_mutex_lock(&cv->mu);
    int on = slot_find_locked(cv, id) >= 0 || park_find_locked(cv, id) != NULL;
    pthread_mutex_unlock(&cv->mu);
    return on;
}

/* A conversation this node does not hold live (with a tier): the tier's head, when another node
 * saved it since this node last sent or fetched it, is brought into the store first (st_tiernode
 * invariant 1), so that the store's head is the conversation's newest acknowledged state. The
 * tier unreachable: the store's head is used where there is one (docs/SCALE.md, "Failure
 * modes"), else ST_EIO (not silently a new conversation). *from_tier: 1 when fetched. */
static int tier_in(st_conv *cv, const char *id, int *from_tier)
{
    *from_tier = 0;
    if (!cv->env->tier)
        return 0;
    int rc = st_tiernode_fetch(cv->env->tier, id, 0, from_tier);
    if (rc == ST_EIO) {
        st_version_info vi;
        if (st_store_version_info(cv->store, id, 0, &vi) == 0) {
            st_error_clear();
            return 0;
        }
        return st_error_set(ST_EIO, "session %s: not in this node's store, and the tier cannot be "
                            "reached to look for it", id);
    }
    return rc;
}

enum { ACQ_LOAD, ACQ_EMPTY };

/* Get a slot for session id, marked busy (invariant 2). ACQ_LOAD: the slot holds the session's
 * conversation from wherever it was (slot, pool, store head) or nothing for a new one.
 * ACQ_EMPTY: a slot already bound to id is returned as it is; otherwise an empty slot, and a park
 * entry of id, if any, is returned busy in *pe (out of the list) for the caller to drop or give
 * back with park_giveback. */
static int acquire_in(st_conv *cv, const char *id, int mode, int *out_j, pentry **pe,
                      const char **source, const _Atomic int *cancel, int stale,
                      const st_tiernode_begun *tb)
{
    *out_j = -1;
    if (pe)
        *pe = NULL;
    *source = "slot";
    int rc = damaged(cv, id); /* its keys in the store may lie in a damaged page */
    if (rc)
        return rc;
    pthread_mutex_lock(&cv->mu);
    rc = wait_turn_locked(cv, id, cancel);
    if (rc) {
        pthread_mutex_unlock(&cv->mu);
        return rc;
    }
    int j = slot_find_locked(cv, id);
    if (j >= 0 && stale && mode == ACQ_LOAD) {
        /* another node saved it since this node's copy was taken (st_tiernode_begin fetched
         * the tier's head into the store), or held it since (invariant 11): the copy in the
         * slot is dropped, the head (or the other node's park) loaded */
        cv->slots[j].bound = 0;
        j = -1;
    }
    if (j >= 0) {
        cv->slots[j].busy = 1;
        gauges_locked(cv);
        pthread_mutex_unlock(&cv->mu);
        cv->m->conv_hits_slot++;
        *out_j = j;
        return 0;
    }
    pentry *p = park_find_locked(cv, id);
    for (uint32_t i = 0; i < cv->n_slots && j < 0; i++)
        if (!cv->slots[i].bound && !cv->slots[i].busy)
            j = (int)i;
    for (uint32_t i = 0; i < cv->n_slots; i++)
        if (j < 0 || (cv->slots[j].bound && cv->slots[i].bound && !cv->slots[i].busy &&
                      cv->slots[i].last_used < cv->slots[j].last_used))
            if (!cv->slots[i].busy)
                j = (int)i;
    if (j < 0 || cv->slots[j].busy) {
        pthread_mutex_unlock(&cv->mu);
        return st_error_set(ST_EBUSY, "all %u slots are busy; retry", cv->n_slots);
    }
    cslot *cs = &cv->slots[j];
    cs->busy = 1;
    char victim[ST_API_ID_MAX + 1] = "";
    if (cs->bound) {
        memcpy(victim, cs->id, sizeof victim);
        memcpy(cs->victim, cs->id, sizeof cs->victim);
    }
    cs->bound = 1; /* invariant 1: the slot is id's from now on */
    snprintf(cs->id, sizeof cs->id, "%s", id);
    if (p) {
        p->busy = 1;
        park_remove_locked(cv, p);
    }
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);

    if (victim[0] && (rc = park_slot(cv, j, victim, 0, NULL, NULL))) {
        pthread_mutex_lock(&cv->mu); /* the slot keeps its conversation */
        memcpy(cs->id, victim, sizeof cs->id);
        cs->victim[0] = '\0';
        if (p) {
            p->busy = 0;
            park_append_locked(cv, p);
        }
        cs->busy = 0;
        wake_locked(cv);
        gauges_locked(cv);
        pthread_mutex_unlock(&cv->mu);
        return rc;
    }
    if (mode == ACQ_EMPTY) {
        st_slot_reset(cs->slot);
        if (pe)
            *pe = p;
        p = NULL;
    } else if (p && !stale) {
        if ((rc = load_parked(cv, j, p, source)))
            goto fail;
        if (!p->img)
            drop_park_store(cv, p->id);
        pentry_free(cv, p);
        p = NULL;
    } else {
        if (p) { /* a parked copy older than the tier's head (see the slot's case above) */
            if (!p->img)
                drop_park_store(cv, p->id);
            pentry_free(cv, p);
            p = NULL;
        }
        st_version_info vi;
        int from_tier = 0;
        if (tb && tb->park && mode == ACQ_LOAD) {
            /* the node that held it last parked it into the tier: its newest state */
            if (!(rc = park_from_tier(cv, cs->slot, id, tb->park))) {
                cv->m->conv_hits_store++; /* as a SAVE fetched from the tier */
                *source = "tier";
                *out_j = j;
                return 0;
            }
            fprintf(stderr, "strata-server: %s: the park node %s made of it could not be "
                    "restored (it continues from its last SAVE): %s\n", id, tb->prev,
                    st_errdetail());
            st_error_clear();
        }
        rc = tier_in(cv, id, &from_tier);
        if (!rc)
            rc = st_store_version_info(cv->store, id, 0, &vi);
        if (rc == ST_ENOTFOUND) {
            st_slot_reset(cs->slot);
            cv->m->conv_new++;
            *source = "new";
            rc = 0;
        } else if (!rc) {
            if (!(rc = st_memguard_admit(cv->guard, "restoring the saved conversation", vi.logical_bytes)))
                rc = restore_stored(cv, cs->slot, id, 0);
            if (!rc) {
                cv->m->conv_hits_store++;
                cv->m->restores++;
                cv->m->restore_bytes += vi.logical_bytes;
                *source = from_tier || stale ? "tier" : "store";
                sidx_put_slot(cv, id, cs->slot);
            } else if (rc == ST_ENOTFOUND) {
                /* the session was deleted between the look-up and the read (a DELETE of a
                 * session that was not live): the conversation starts anew, as if it had
                 * come a moment later */
                st_error_clear();
                st_slot_reset(cs->slot);
                cv->m->conv_new++;
                *source = "new";
                rc = 0;
            }
        }
        if (rc)
            goto fail;
    }
    *out_j = j;
    return 0;
fail:
    pthread_mutex_lock(&cv->mu);
    if (p) { /* back into the pool, as it was */
        p->busy = 0;
        park_append_locked(cv, p);
    }
    cs->bound = 0; /* empty: its conversation was parked, the new one did not load */
    cs->busy = 0;
    wake_locked(cv);
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);
    return rc;
}

/* acquire_in within the tier's lease on id (st_tiernode_begin; invariant 9): the slot carries
 * the lease until slot_release; on failure it is ended here. */
static int acquire(st_conv *cv, const char *id, int mode, int *out_j, pentry **pe, const char **source,
                   const _Atomic int *cancel)
{
    st_tiernode_begun tb;
    memset(&tb, 0, sizeof tb);
    if (cv->env->tier) {
        int rc = damaged(cv, id);
        if (!rc)
            rc = st_tiernode_begin(cv->env->tier, id, 0, &tb);
        if (rc)
            return rc;
        if (tb.handed)
            fprintf(stderr, "strata-server: %s: node %s held it since this node did: %s\n", id,
                    tb.prev, tb.park ? "continuing from the park it made in the tier"
                                     : "this node's copy, if any, is dropped");
    }
    int rc = acquire_in(cv, id, mode, out_j, pe, source, cancel, tb.fetched || tb.handed, &tb);
    if (cv->env->tier) {
        if (rc)
            (void)st_tiernode_end(cv->env->tier, id);
        else
            cv->slots[*out_j].lease = 1;
    }
    return rc;
}

static void park_giveback(st_conv *cv, pentry *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&cv->mu);
    p->busy = 0;
    park_append_locked(cv, p);
    wake_locked(cv);
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);
}

/* Release a park entry take_live marked busy in place. */
static void park_release(st_conv *cv, pentry *p)
{
    pthread_mutex_lock(&cv->mu);
    p->busy = 0;
    wake_locked(cv);
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);
}

static void park_drop(st_conv *cv, pentry *p)
{
    if (!p)
        return;
    if (!p->img)
        drop_park_store(cv, p->id);
    pentry_free(cv, p);
}

/* ---- routes --------------------------------------------------------------------------------- */


/* st_slot_set_cancel's hook for a completion: whether its client went away. */
static int call_gone(void *arg)
{
    return atomic_load_explicit((const _Atomic int *)arg, memory_order_relaxed);
}

/* Whether the client of a generation went away. */
static int gen_cancelled(const st_conv_gen *g)
{
    return g->cancel && atomic_load_explicit(g->cancel, memory_order_relaxed);
}

void st_conv_random_hex(char *dst, size_t cap)
{
    unsigned char r[12] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, r, sizeof r) != (ssize_t)sizeof r)
            memset(r, 0, sizeof r);
        close(fd);
    }
    if (cap) {
        size_t n = (cap - 1) / 2;
        st_hex_encode(dst, r, n < sizeof r ? n : sizeof r);
    }
}

static void random_id(char *dst)
{
    strcpy(dst, "c-");
    st_conv_random_hex(dst + 2, 17); /* 16 hex digits */
}

/* How many of toks[0..n) begin held[0..nh). */
static uint64_t shared_len(const uint32_t *held, uint64_t nh, const uint32_t *toks, uint64_t n)
{
    uint64_t k = 0;
    while (k < nh && k < n && held[k] == toks[k])
        k++;
    return k;
}

/* Whether a conversation of nh tokens that a prompt shares k tokens with, and whose deepest
 * checkpoint at or before k is at ck, beats *best: what a restore of it could reuse (k when the
 * prompt extends it or the model cuts anywhere, else ck: st_slot_eval) is more, and at least half
 * of what it holds (llama.cpp's slot similarity 0.5). */
static int better(const st_conv *cv, uint64_t k, uint64_t nh, uint64_t ck, uint64_t *best)
{
    uint64_t u = k == nh || cv->kv_only ? k : ck;
    if (u > *best && 2 * u >= nh) {
        *best = u;
        return 1;
    }
    return 0;
}

/* The deepest of pos[0..np) (increasing) at or before k, else 0. */
static uint64_t deepest_at(const uint64_t *pos, uint32_t np, uint64_t k)
{
    uint64_t d = 0;
    for (uint32_t i = 0; i < np && pos[i] <= k; i++)
        d = pos[i];
    return d;
}

/* Under mu (invariant 8): the conversation held that shares the longest usable prefix with
 * toks[0..n) (at least half of what it holds): an anonymous conversation of the OpenAI routes (an
 * id the server made for a request without a session, ST_CONV_ANON_PREFIX) in an idle slot or in
 * the park pool, whose id is copied into id (the request continues it); or a store head of any
 * session in the store index, whose id is copied into seed (the request's new conversation
 * begins as a copy of it; the stored session is not changed). Native conversations ("c-") and
 * named sessions are never continued: their clients append to what they hold. Ties go to the
 * cheaper place: slot, then pool, then store. */
static void anon_best_locked(st_conv *cv, const uint32_t *toks, uint64_t n, char *id, char *seed)
{
    uint64_t best = 0;
    size_t pl = strlen(ST_CONV_ANON_PREFIX);
    seed[0] = '\0';
    for (uint32_t i = 0; i < cv->n_slots; i++) {
        cslot *cs = &cv->slots[i];
        if (!cs->bound || cs->busy || cs->victim[0] || strncmp(cs->id, ST_CONV_ANON_PREFIX, pl))
            continue;
        uint64_t nh = st_slot_n_tokens(cs->slot), k = shared_len(st_slot_tokens(cs->slot), nh, toks, n);
        uint64_t ck = 0;
        for (uint32_t c = 0; c < st_slot_n_checkpoints(cs->slot); c++)
            if (st_slot_checkpoint_pos(cs->slot, c) <= k)
                ck = st_slot_checkpoint_pos(cs->slot, c);
        if (better(cv, k, nh, ck, &best))
            memcpy(id, cs->id, ST_API_ID_MAX + 1);
    }
    unsigned seen = 0;
    for (pentry *p = cv->tail; p && seen < POOL_SEARCH_MAX; p = p->prev, seen++) {
        if (p->busy || (!p->img && !p->held.toks) || strncmp(p->id, ST_CONV_ANON_PREFIX, pl))
            continue;
        uint64_t nh, k, ck = 0;
        if (p->img) {
            nh = st_image_n_tokens(p->img);
            k = shared_len(st_image_tokens(p->img), nh, toks, n);
            for (uint32_t c = 0; c < st_image_n_checkpoints(p->img); c++) {
                uint64_t pos;
                uint32_t codec;
                if (!st_image_checkpoint_info(p->img, c, &pos, &codec) && pos <= k)
                    ck = pos;
            }
        } else {
            nh = p->held.n;
            k = shared_len(p->held.toks, nh, toks, n);
            ck = deepest_at(p->held.pos, p->held.n_pos, k);
        }
        if (better(cv, k, nh, ck, &best))
            memcpy(id, p->id, ST_API_ID_MAX + 1);
    }
    sidx_entry *from = NULL;
    for (int i = 0; i < SIDX_MAX; i++) {
        hcopy *h = &cv->sidx[i].held;
        if (!h->n)
            continue;
        uint64_t k = shared_len(h->toks, h->n, toks, n);
        if (better(cv, k, h->n, deepest_at(h->pos, h->n_pos, k), &best))
            from = &cv->sidx[i];
    }
    if (from) {
        memcpy(seed, from->id, ST_API_ID_MAX + 1);
        from->tick = ++cv->tick;
    }
}

/* Slot j, empty and bound to a new conversation, becomes a copy of the head of stored session
 * seed (the prefix search's choice). 0, or the error (the slot is left empty: the request goes
 * on as a new conversation). */
static int seed_from_store(st_conv *cv, int j, const char *seed)
{
    st_slot *s = cv->slots[j].slot;
    int rc = damaged(cv, seed);
    st_version_info vi;
    if (!rc)
        rc = st_store_version_info(cv->store, seed, 0, &vi);
    if (!rc)
        rc = st_memguard_admit(cv->guard, "restoring a stored prefix", vi.logical_bytes);
    st_image *img = NULL;
    if (!rc && !(rc = st_store_get(cv->store, seed, 0, &img)))
        rc = st_slot_restore(s, img);
    st_image_free(img);
    if (rc) {
        if (rc == ST_ENOTFOUND)
            sidx_forget(cv, seed);
        st_slot_reset(s);
        return rc;
    }
    cv->m->conv_hits_store++;
    cv->m->restores++;
    cv->m->restore_bytes += vi.logical_bytes;
    return 0;
}

/* The OpenAI routes resend the whole history, so a previous answer comes back as text, which the
 * tokenizer may split otherwise than the tokens generated (the tokenizer's merges are greedy; a
 * sampled sequence need not be its choice). From where whole[0..n) and held[0..nh) first differ,
 * while both spell the same bytes (the tokens' pieces, special tokens as their text), the held
 * tokens are used: *out (malloc'd) is held[0..m) + whole[m2..n) for the furthest m, m2 where the
 * two meet on a token boundary with equal bytes before it; *n_out its length, *spliced m minus
 * the first difference. *out NULL: nothing to splice (or no memory: the whole is read as it is). */
static void splice_held(const st_vocab *v, const uint32_t *held, uint64_t nh, const uint32_t *whole,
                        uint64_t n, uint32_t **out, uint64_t *n_out, uint64_t *spliced)
{
    *out = NULL;
    *spliced = 0;
    uint64_t k = 0;
    while (k < nh && k < n && held[k] == whole[k])
        k++;
    if (!v || k == nh || k == n)
        return;
    /* pend: the bytes one side has spelt beyond the other (side 1: held, 2: whole) */
    unsigned char pend[1024], piece[256];
    size_t np = 0;
    int side = 0;
    uint64_t i = k, j = k, bi = k, bj = k;
    for (;;) {
        if (np == 0 && i > bi) {
            bi = i;
            bj = j;
        }
        int from_held = np == 0 || side == 2;
        if (from_held ? i == nh : j == n)
            break;
        size_t len = 0;
        if (st_vocab_token_piece(v, from_held ? held[i] : whole[j], 1, (char *)piece, sizeof piece,
                                 &len) || len > sizeof piece)
            break;
        if (from_held)
            i++;
        else
            j++;
        if (np == 0) {
            memcpy(pend, piece, len);
            np = len;
            side = from_held ? 1 : 2;
            continue;
        }
        size_t m = len < np ? len : np;
        if (memcmp(pend, piece, m))
            break;
        if (len <= np) {
            memmove(pend, pend + len, np - len);
            np -= len;
        } else {
            memcpy(pend, piece + np, len - np);
            np = len - np;
            side = from_held ? 1 : 2;
        }
    }
    if (bi == k || !(*out = malloc((bi + n - bj) * sizeof **out)))
        return;
    memcpy(*out, held, bi * sizeof **out);
    memcpy(*out + bi, whole + bj, (n - bj) * sizeof **out);
    *n_out = bi + n - bj;
    *spliced = bi - k;
}

int st_conv_generate(st_conv *cv, st_conv_gen *g)
{
    const st_vocab *vocab = st_model_vocab(cv->model);
    g->found = "slot";
    g->stop = "length";
    g->what = "completion";
    g->code = NULL;
    g->n_gen = g->resumed = g->computed = 0;
    g->prompt_ms = g->decode_ms = 0.0;
    g->search_ms = 0.0;
    g->record_ms = 0.0;
    g->spliced = 0;
    char seed[ST_API_ID_MAX + 1] = "";
    if (g->session) {
        snprintf(g->id, sizeof g->id, "%s", g->session);
    } else {
        random_id(g->id);
        if (g->whole && g->anon_reuse) {
            char r[ST_API_ID_MAX + 1];
            snprintf(r, sizeof r, "%s%s", ST_CONV_ANON_PREFIX, g->id + 2); /* "c-" */
            memcpy(g->id, r, sizeof r);
            double ts = st_conv_now_ms();
            pthread_mutex_lock(&cv->mu);
            anon_best_locked(cv, g->whole, g->n_whole, g->id, seed);
            pthread_mutex_unlock(&cv->mu);
            g->search_ms = st_conv_now_ms() - ts;
        }
    }
    if (gen_cancelled(g)) { /* gone while queued for a worker: nothing runs */
        cv->m->completions_cancelled++;
        return st_error_set(ECANCELED, "the client went away before the completion ran");
    }
    int j = -1;
    int rc = acquire(cv, g->id, ACQ_LOAD, &j, NULL, &g->found, g->cancel);
    if (rc == ECANCELED) { /* gone while waiting for the session: it never ran */
        cv->m->completions_cancelled++;
        return rc;
    }
    if (rc) {
        g->what = "completion";
        return rc;
    }
    st_slot *s = cv->slots[j].slot;
    if (seed[0] && !strcmp(g->found, "new")) {
        if (!seed_from_store(cv, j, seed))
            g->found = "store";
        else
            fprintf(stderr, "strata-server: the stored prefix of %s was not used: %s\n", seed,
                    st_errdetail());
    }
    uint64_t held = st_slot_n_tokens(s), n = 0, system_end = 0;
    uint32_t *own = NULL;
    const uint32_t *toks = g->whole;
    int ret = ST_CONV_EHOOK;
    g->n_held = held;
    if (toks) {
        n = g->n_whole;
        system_end = g->system_end <= n ? g->system_end : 0;
        splice_held(vocab, st_slot_tokens(s), held, toks, n, &own, &n, &g->spliced);
        if (own)
            toks = own;
    } else {
        if (g->build(g->arg, st_slot_tokens(s), held, &own, &n, &system_end))
            goto done;
        toks = own;
    }
    if (n == 0) {
        g->code = "invalid_field";
        ret = st_error_set(ST_EINVAL, "the prompt is empty");
        goto done;
    }
    uint64_t idx_at = 0;
    if (cv->prefix && held == 0 && n + g->n_predict <= cv->n_ctx) {
        /* a conversation that holds nothing resumes from the prefix index (invariant 10) */
        double ts = st_conv_now_ms();
        st_prefix_resume(cv->prefix, s, toks, n, system_end, &idx_at);
        g->search_ms += st_conv_now_ms() - ts;
        if (idx_at)
            g->found = "index";
    }
    if (n + g->n_predict > cv->n_ctx) {
        g->code = "context_full";
        ret = st_error_set(ST_EINVAL, "the conversation would reach %llu tokens; the context holds %u",
                           (unsigned long long)(n + g->n_predict), cv->n_ctx);
        goto done;
    }
    double t0 = st_conv_now_ms();
    st_eval_stats es = {0, 0, UINT64_MAX, 0};
    es.reused = held;
    uint64_t shared = 0;
    while (shared < held && shared < n && st_slot_tokens(s)[shared] == toks[shared])
        shared++;
    if (shared < held || n > held || !st_slot_logits(s, NULL)) {
        /* one read; the engine asks the call before each chunk whether the client is still
         * there (invariant 7), and a stop leaves the whole chunks read so far */
        if (gen_cancelled(g))
            goto cancelled;
        st_slot_set_cancel(s, g->cancel ? call_gone : NULL, (void *)g->cancel);
        rc = st_slot_eval(s, toks, n, system_end, &es);
        st_slot_set_cancel(s, NULL, NULL);
        if (rc == ECANCELED)
            goto cancelled;
        if (rc) {
            g->what = "reading the prompt (the live conversation was dropped)";
            ret = rc;
            goto done;
        }
    }
    double t1 = st_conv_now_ms();
    g->n_prompt = n;
    for (uint64_t i = 0; i < g->n_predict; i++) {
        uint32_t tok;
        /* between tokens: every token appended so far stays, with its logits (invariant 7) */
        if (gen_cancelled(g))
            goto cancelled;
        if ((rc = st_slot_sample_with(s, &g->sp, g->seed, &tok)) || (rc = st_slot_decode(s, tok))) {
            g->what = "generating";
            ret = rc;
            goto done;
        }
        g->n_gen++;
        cv->m->tokens_generated++; /* counted as made: /metrics shows a completion advance */
        int eog = vocab ? st_vocab_is_eog(vocab, tok) : tok == ST_TOKEN_EOS;
        int r = g->token(g->arg, tok, eog);
        if (r < 0)
            goto done;
        if (r > 0) {
            g->stop = "stop";
            break;
        }
        if (eog && !g->ignore_eos) {
            g->stop = "eos";
            break;
        }
    }
    double t2 = st_conv_now_ms();
    if (cv->prefix && es.computed && (es.reused == 0 || es.reused == idx_at)) {
        st_prefix_record(cv->prefix, s, n, system_end, es.reused); /* invariant 10 */
        g->record_ms = st_conv_now_ms() - t2;
    }
    g->prompt_ms = t1 - t0;
    g->decode_ms = t2 - t1;
    g->resumed = es.reused;
    g->computed = es.computed;
    g->n_tokens = st_slot_n_tokens(s);
    cv->m->prompt_reused += es.reused;
    cv->m->prompt_computed += es.computed;
    ret = 0;
    goto done;
cancelled:
    if (idx_at && !st_slot_logits(s, NULL))
        /* gone before the first chunk after a resume from the index: the slot holds a point's
         * tokens without logits, which no SAVE or PARK takes; the conversation holds nothing
         * again, as before the request */
        st_slot_reset(s);
    cv->m->prompt_reused += es.reused;
    cv->m->prompt_computed += es.computed;
    cv->m->completions_cancelled++;
    ret = st_error_set(ECANCELED, "the client went away");
done:
    free(own);
    slot_release(cv, j);
    return ret;
}

const st_vocab *st_conv_vocab(st_conv *cv) { return st_model_vocab(cv->model); }
const st_chat_template *st_conv_chat(st_conv *cv) { return cv->chat; }
uint32_t st_conv_n_ctx(st_conv *cv) { return cv->n_ctx; }
uint32_t st_conv_n_vocab(st_conv *cv) { return cv->n_vocab; }

void st_conv_wcache(st_conv *cv, st_engine_wcache *out)
{
    if (st_engine_wcache_get(cv->engine, out))
        memset(out, 0, sizeof *out);
}

void st_conv_xcache(st_conv *cv, st_engine_xcache *out)
{
    if (st_engine_xcache_get(cv->engine, out))
        memset(out, 0, sizeof *out);
}

int st_conv_prefix_stats(st_conv *cv, st_prefix_stats *out)
{
    if (!cv->prefix)
        return 0;
    st_prefix_stats_get(cv->prefix, out);
    return 1;
}

const char *st_conv_model_name(st_conv *cv)
{
    const char *name = NULL;
    uint64_t len = 0;
    if (!st_gguf_get_str(st_model_gguf(cv->model), "general.name", &name, &len) && len &&
        !memchr(name, '\0', len) && strlen(name) == len)
        return name;
    const char *p = cv->env->cfg->model_path, *slash = strrchr(p, '/');
    return slash ? slash + 1 : p;
}

int st_conv_tokenize(st_conv *cv, const char *text, size_t len, int bos, int parse_special,
                     uint32_t **out, uint64_t *n)
{
    const st_vocab *v = st_model_vocab(cv->model);
    *out = NULL;
    *n = 0;
    uint32_t bos_id = !v ? ST_TOKEN_BOS
                      : st_vocab_add_bos(v) ? st_vocab_special(v, ST_VOCAB_BOS) : UINT32_MAX;
    int add = bos && bos_id != UINT32_MAX;
    size_t cap = len + 16, got = 0;
    for (int pass = 0; pass < 2; pass++) {
        uint32_t *t = malloc(cap * sizeof *t);
        if (!t)
            return st_error_set(ENOMEM, "no memory to tokenize %zu bytes", len);
        if (add)
            t[0] = bos_id;
        if (!v) {
            got = st_tokenize(text, len, t + add, cap - (size_t)add);
        } else {
            int rc = st_vocab_tokenize(v, text, len, 0, parse_special, t + add, cap - (size_t)add, &got);
            if (rc) {
                free(t);
                return rc;
            }
        }
        if (got + (size_t)add <= cap) {
            *out = t;
            *n = got + (uint64_t)add;
            return 0;
        }
        free(t);
        cap = got + (size_t)add;
    }
    return st_error_set(ST_EINVAL, "tokenizing: the count changed between two passes");
}

/* Take the live conversation of id: its slot (busy; slot_release) or its park entry (busy, left
 * in the pool so that it stays findable: park_release). Waits while it is busy (invariant 6). */
static int take_live(st_conv *cv, const char *id, int *j, pentry **pe)
{
    *j = -1;
    *pe = NULL;
    pthread_mutex_lock(&cv->mu);
    int rc = wait_turn_locked(cv, id, NULL);
    if (rc) {
        pthread_mutex_unlock(&cv->mu);
        return rc;
    }
    int k = slot_find_locked(cv, id);
    pentry *p = k < 0 ? park_find_locked(cv, id) : NULL;
    if (k >= 0) {
        cv->slots[k].busy = 1;
        *j = k;
    } else if (p) {
        p->busy = 1;
        *pe = p;
    } else {
        rc = st_error_set(ST_ENOTFOUND, "session %s is not live (neither in a slot nor parked)", id);
    }
    gauges_locked(cv);
    pthread_mutex_unlock(&cv->mu);
    return rc;
}

/* Drop a live copy the caller holds (take_live, forget_begin): slot j reset and unbound and
 * released, or park entry p out of the pool and freed; the id's waiters go on. */
static void drop_live(st_conv *cv, int j, pentry *p)
{
    if (j >= 0) {
        st_slot_reset(cv->slots[j].slot);
        pthread_mutex_lock(&cv->mu);
        cv->slots[j].bound = 0;
        pthread_mutex_unlock(&cv->mu);
        slot_release(cv, j);
    }
    if (p) {
        pthread_mutex_lock(&cv->mu);
        park_remove_locked(cv, p);
        wake_locked(cv); /* the id is gone: its waiters start afresh */
        gauges_locked(cv);
        pthread_mutex_unlock(&cv->mu);
        park_drop(cv, p);
    }
}

/* With a tier, a SAVE or PARK (what) of a named conversation takes its lease as a spill does
 * (fresh, and only while the holder record names this node or nobody: invariant 11), so that a
 * node never saves or parks a copy older than what another node made of the conversation since,
 * saved or not. A stale copy is dropped and the call refused (ST_ECONFLICT); ST_EBUSY while
 * another node (or a spill of this one) holds the lease (on failure the copy is released); the
 * tier away: 0 with *leased -1 (a SAVE stays local and queues, "pending"); taken: *leased 1. */
static int live_lease(st_conv *cv, const char *id, int j, pentry *p, const char *what,
                      int *leased)
{
    *leased = 0;
    st_tiernode *tn = cv->env->tier;
    if (!tn || !strncmp(id, ST_CONV_ANON_PREFIX, strlen(ST_CONV_ANON_PREFIX)))
        return 0;
    st_tiernode_begun b;
    int rc = st_tiernode_begin(tn, id, ST_TIERNODE_FRESH, &b);
    if (rc == ST_EIO) {
        st_error_clear();
        *leased = -1; /* the tier away: the SAVE queues without trying it again */
        return 0;
    }
    if (!rc && b.fetched)
        (void)st_tiernode_end(tn, id);
    if (rc == ST_ECONFLICT || (!rc && b.fetched)) {
        char d[1024];
        if (rc)
            snprintf(d, sizeof d, "%s", st_errdetail());
        else
            snprintf(d, sizeof d, "session %s: another node saved it since this node's copy was "
                     "made (the tier's head is in this node's store now)", id);
        fprintf(stderr, "strata-server: %s refused: %s: this node's older copy is dropped\n",
                what, d);
        drop_live(cv, j, p);
        cv->m->stale_refused++;
        return st_error_set(ST_ECONFLICT, "%s: this node's copy is older and was dropped (%s "
                            "refused); the next request continues from the tier", d, what);
    }
    if (rc) {
        if (j >= 0)
            slot_release(cv, j);
        else
            park_release(cv, p);
        return rc;
    }
    *leased = 1;
    return 0;
}

int st_conv_save(st_conv *cv, const char *id, const st_conv_save_opts *o, st_conv_save_info *out)
{
    uint32_t codec = o->codec;
    memset(out, 0, sizeof *out);
    int j;
    pentry *p;
    int rc = take_live(cv, id, &j, &p);
    if (rc)
        return rc;
    int leased = 0;
    if ((rc = live_lease(cv, id, j, p, "SAVE", &leased))) /* on failure it released the copy */
        return rc;
    double t0 = st_conv_now_ms();
    st_image *img = NULL;
    const st_image *put_img = NULL; /* what is stored: img, or the parked image itself */
    const char *from = j >= 0 ? "slot" : p->img ? "ram" : "disk";
    uint64_t est = j >= 0 ? slot_image_bytes(cv->slots[j].slot, 0) : p->bytes;
    if ((rc = st_memguard_admit(cv->guard, "SAVE", est)))
        goto done;
    if (j >= 0) {
        rc = st_slot_snapshot(cv->slots[j].slot, ST_SNAPSHOT_SESSION, codec, &img);
    } else if (p->img && codec == ST_CODEC_FP32) {
        put_img = p->img; /* parked images are fp32 and ours while the entry is busy */
    } else if (p->img) {
        if (!(rc = st_image_clone(&img, p->img)))
            rc = st_image_recode(img, codec, NULL, NULL, NULL, NULL);
    } else {
        char pid[PARK_ID_MAX];
        park_id(pid, id);
        if (!(rc = st_store_get(cv->store, pid, 0, &img)) && codec != ST_CODEC_FP32)
            rc = st_image_recode(img, codec, NULL, NULL, NULL, NULL);
    }
    if (rc)
        goto done;
    if (!put_img)
        put_img = img;
    double t1 = st_conv_now_ms();
    st_put_stats *ps = &out->ps;
    st_put_opts po = {.compress = o->compress, .label = o->label, .stats = ps};
    uint64_t version = 0;
    if ((rc = st_store_put(cv->store, id, put_img, o->expected, &po, &version)))
        goto done;
    sidx_put_image(cv, id, put_img);
    double t2 = st_conv_now_ms();
    if (leased < 0) /* durable locally; the tier away a moment ago: queued */
        out->tier = st_tier_outcome_name(st_tiernode_queue(cv->env->tier, id, version));
    else if (cv->env->tier) /* durable locally; then the tier (it never fails the SAVE) */
        out->tier = st_tier_outcome_name(st_tiernode_saved(cv->env->tier, id, version,
                                                           &out->tier_version));
    cv->m->saves++;
    cv->m->save_logical_bytes += ps->logical_bytes;
    cv->m->save_new_bytes += ps->new_bytes;
    cv->m->save_stored_bytes += ps->stored_bytes;
    out->version = version;
    out->from = from;
    out->tokens = st_image_n_tokens(put_img);
    out->snapshot_ms = t1 - t0;
    out->store_ms = t2 - t1;
    out->ms = t2 - t0;
done:
    st_image_free(img);
    if (leased > 0)
        (void)st_tiernode_end(cv->env->tier, id);
    if (j >= 0)
        slot_release(cv, j);
    else
        park_release(cv, p);
    return rc;
}

int st_conv_restore(st_conv *cv, const char *id, uint64_t version, st_conv_restore_info *out)
{
    memset(out, 0, sizeof *out);
    st_version_info vi;
    int rc = 0, from_tier = 0;
    if (version == 0 && !damaged(cv, id) && !live(cv, id))
        rc = tier_in(cv, id, &from_tier);
    if (!rc)
        rc = st_store_version_info(cv->store, id, version, &vi);
    if (rc)
        return rc;
    if ((rc = st_memguard_admit(cv->guard, "RESTORE", vi.logical_bytes)))
        return rc;
    int j = -1;
    pentry *p = NULL;
    const char *source;
    if ((rc = acquire(cv, id, ACQ_EMPTY, &j, &p, &source, NULL)))
        return rc;
    double t0 = st_conv_now_ms();
    rc = restore_stored(cv, cv->slots[j].slot, id, vi.version); /* on error the slot is as it was */
    double t1 = st_conv_now_ms();
    if (rc) {
        char d[1024];
        snprintf(d, sizeof d, "%s", st_errdetail()); /* what failed, not what the give-back did */
        park_giveback(cv, p);
        if (st_slot_n_tokens(cv->slots[j].slot) == 0) {
            pthread_mutex_lock(&cv->mu);
            cv->slots[j].bound = 0;
            pthread_mutex_unlock(&cv->mu);
        }
        rc = st_error_set(rc, "%s", d);
    } else {
        park_drop(cv, p); /* the restored version replaces what was parked */
        cv->m->restores++;
        cv->m->restore_bytes += vi.logical_bytes;
        out->version = vi.version;
        out->tokens = st_slot_n_tokens(cv->slots[j].slot);
        out->logical_bytes = vi.logical_bytes;
        out->ms = t1 - t0;
    }
    slot_release(cv, j);
    return rc;
}

int st_conv_park(st_conv *cv, const char *id, st_conv_park_info *out)
{
    memset(out, 0, sizeof *out);
    int j;
    pentry *p;
    int rc = take_live(cv, id, &j, &p);
    if (rc)
        return rc;
    if (p) { /* already parked: say where */
        out->where = p->img ? "ram" : "disk";
        out->bytes = p->bytes;
        out->tokens = p->tokens;
        out->already = 1;
        park_release(cv, p);
        return 0;
    }
    int leased = 0;
    if ((rc = live_lease(cv, id, j, NULL, "PARK", &leased))) /* on failure it released the slot */
        return rc;
    if (leased > 0) /* checked; a spill takes the lease again for itself */
        (void)st_tiernode_end(cv->env->tier, id);
    double t0 = st_conv_now_ms();
    const char *where = "ram";
    uint64_t bytes = 0, tokens = st_slot_n_tokens(cv->slots[j].slot);
    rc = park_slot(cv, j, id, 1, &where, &bytes);
    if (!rc) {
        out->where = where;
        out->bytes = bytes;
        out->tokens = tokens;
        out->ms = st_conv_now_ms() - t0;
    }
    slot_release(cv, j);
    return rc;
}

/* ---- llama.cpp's /slots ---------------------------------------------------------------------- */

uint32_t st_conv_n_slots(st_conv *cv) { return cv->n_slots; }

void st_conv_slots_get(st_conv *cv, st_conv_slot_info *arr)
{
    pthread_mutex_lock(&cv->mu);
    for (uint32_t i = 0; i < cv->n_slots; i++) {
        cslot *cs = &cv->slots[i];
        memset(&arr[i], 0, sizeof arr[i]);
        if (cs->bound) {
            memcpy(arr[i].id, cs->id, sizeof arr[i].id);
            arr[i].tokens = cs->tokens;
        }
        arr[i].busy = cs->busy;
    }
    pthread_mutex_unlock(&cv->mu);
}

int st_conv_slot_action(st_conv *cv, uint32_t n, int action, const char *path, uint32_t codec,
                        int compress, st_conv_slot_result *r)
{
    memset(r, 0, sizeof *r);
    int j = (int)n;
    pthread_mutex_lock(&cv->mu);
    int busy = cv->slots[j].busy;
    if (!busy)
        cv->slots[j].busy = 1;
    int bound = cv->slots[j].bound;
    pthread_mutex_unlock(&cv->mu);
    if (busy) {
        r->refused = "busy";
        return st_error_set(ST_EBUSY, "slot %d is busy", j);
    }
    st_slot *s = cv->slots[j].slot;
    double t0 = st_conv_now_ms();
    int rc = 0;
    st_image *img = NULL;
    if (action == ST_CONV_SLOT_ERASE) {
        uint64_t had = st_slot_n_tokens(s);
        st_slot_reset(s);
        pthread_mutex_lock(&cv->mu);
        cv->slots[j].bound = 0;
        pthread_mutex_unlock(&cv->mu);
        r->tokens = had;
    } else if (action == ST_CONV_SLOT_SAVE) {
        if (!bound || st_slot_n_tokens(s) == 0) {
            r->refused = "slot_empty";
            rc = st_error_set(ST_EINVAL, "slot %d holds no conversation", j);
        } else if (!(rc = st_memguard_admit(cv->guard, "slot save", slot_image_bytes(s, 0))) &&
                   !(rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, codec, &img)) &&
                   !(rc = st_file_write(img, path, &(st_file_write_opts){.compress = compress,
                                                                         .shuffle = 1}))) {
            struct stat sb;
            r->file_bytes = stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
            r->tokens = st_image_n_tokens(img);
            r->ms = st_conv_now_ms() - t0;
        }
    } else {
        struct stat sb;
        const char *fname = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
        /* read into the engine's image buffers (what its snapshots used before) */
        st_file_read_opts ro = {.alloc = st_engine_image_allocator(cv->engine)};
        if (stat(path, &sb) != 0) {
            rc = st_error_set(ST_ENOTFOUND, "no file %s in the slot save directory", fname);
        } else if (!(rc = st_memguard_admit(cv->guard, "slot restore", 2 * (uint64_t)sb.st_size)) &&
                   !(rc = st_file_read(path, &ro, &img)) && !(rc = st_slot_restore_adopt(s, img))) {
            pthread_mutex_lock(&cv->mu);
            if (!cv->slots[j].bound) {
                random_id(cv->slots[j].id);
                cv->slots[j].bound = 1;
            }
            memcpy(r->session, cv->slots[j].id, sizeof r->session);
            pthread_mutex_unlock(&cv->mu);
            r->tokens = st_image_n_tokens(img);
            r->file_bytes = (uint64_t)sb.st_size;
            r->ms = st_conv_now_ms() - t0;
        }
    }
    st_image_free(img);
    slot_release(cv, j);
    return rc;
}

/* ---- queries from other routes ----------------------------------------------------------------- */

const char *st_conv_where(st_conv *cv, const char *id, uint64_t *tokens, uint64_t *bytes)
{
    const char *w = NULL;
    pthread_mutex_lock(&cv->mu);
    int j = slot_find_locked(cv, id);
    pentry *p = j < 0 ? park_find_locked(cv, id) : NULL;
    if (j >= 0) {
        w = "slot";
        *tokens = cv->slots[j].tokens;
        *bytes = cv->slots[j].bytes;
    } else if (p) {
        w = p->img ? "ram" : "disk";
        *tokens = p->tokens;
        *bytes = p->bytes;
    }
    pthread_mutex_unlock(&cv->mu);
    return w;
}

void st_conv_list_live(st_conv *cv,
                       void (*fn)(void *arg, const char *id, const char *where, uint64_t tokens,
                                  uint64_t bytes),
                       void *arg)
{
    pthread_mutex_lock(&cv->mu);
    for (uint32_t i = 0; i < cv->n_slots; i++)
        if (cv->slots[i].bound)
            fn(arg, cv->slots[i].id, "slot", cv->slots[i].tokens, cv->slots[i].bytes);
    for (pentry *p = cv->head; p; p = p->next)
        fn(arg, p->id, p->img ? "ram" : "disk", p->tokens, p->bytes);
    pthread_mutex_unlock(&cv->mu);
}

int st_conv_forget_begin(st_conv *cv, const char *id, st_conv_hold *h)
{
    sidx_forget(cv, id); /* its stored head goes (a hint only: dropped even if the DELETE fails) */
    h->slot = -1;
    h->entry = NULL;
    h->id = NULL;
    h->next = NULL;
    pthread_mutex_lock(&cv->mu);
    int rc = wait_turn_locked(cv, id, NULL);
    if (!rc) {
        int k = slot_find_locked(cv, id);
        pentry *p = k < 0 ? park_find_locked(cv, id) : NULL;
        if (k >= 0) {
            cv->slots[k].busy = 1;
            h->slot = k;
        } else if (p) {
            p->busy = 1;
            h->entry = p;
        } else { /* not live: hold the id itself, so that no request loads a version meanwhile */
            h->id = id;
            h->next = cv->held;
            cv->held = h;
        }
        gauges_locked(cv);
    }
    pthread_mutex_unlock(&cv->mu);
    return rc;
}

/* Release a hold by name (forget_end, forget_abort); its waiters go on. */
static void unhold_id(st_conv *cv, st_conv_hold *h)
{
    if (!h->id)
        return;
    pthread_mutex_lock(&cv->mu);
    for (st_conv_hold **pp = &cv->held; *pp; pp = &(*pp)->next)
        if (*pp == h) {
            *pp = h->next;
            break;
        }
    wake_locked(cv);
    pthread_mutex_unlock(&cv->mu);
    h->id = NULL;
    h->next = NULL;
}

void st_conv_forget_abort(st_conv *cv, st_conv_hold *h)
{
    unhold_id(cv, h);
    if (h->slot >= 0)
        slot_release(cv, h->slot);
    if (h->entry)
        park_release(cv, h->entry);
    h->slot = -1;
    h->entry = NULL;
}

void st_conv_forget_end(st_conv *cv, st_conv_hold *h)
{
    unhold_id(cv, h);
    drop_live(cv, h->slot, h->entry);
    h->slot = -1;
    h->entry = NULL;
}

/* ---- life cycle -------------------------------------------------------------------------------- */

/* At a graceful stop: put id's image as its disk park; when the store refuses it (a full disk,
 * most often), keep it in a smaller form where the store still has room: only the live
 * checkpoint (what a continuation needs; the earlier ones only serve a prompt that diverges),
 * chunks compressed. img is the caller's and may be changed. */
static int persist_one(st_conv *cv, const char *id, st_image *img)
{
    int rc = put_park(cv, id, img, NULL, NULL);
    if (rc != ST_EFULL)
        return rc;
    char first[512];
    snprintf(first, sizeof first, "%s", st_errdetail());
    int rc2 = 0;
    while (!rc2 && st_image_n_checkpoints(img) > 1)
        rc2 = st_image_checkpoint_remove(img, 0);
    st_put_opts po = {.compress = 1};
    if (!rc2 && !(rc2 = put_park(cv, id, img, &po, NULL))) {
        fprintf(stderr, "strata-server: stop: %s kept without its resume checkpoints, compressed (%s)\n",
                id, first);
        return 0;
    }
    return st_error_set(rc, "%s", first);
}

/* What a graceful stop wrote and what it could not. */
typedef struct persist_tally {
    unsigned written, failed;
    int first_rc;
    char first[512];
    char lost[1024]; /* ids, ", "-separated, ending in ", ..." when they do not all fit */
    size_t used;
} persist_tally;

static void persist_note(persist_tally *t, const char *id, int rc)
{
    if (!rc) {
        t->written++;
        return;
    }
    fprintf(stderr, "strata-server: stop: could not write %s to the store, it is lost: %s\n", id,
            st_errdetail());
    if (!t->failed++) {
        t->first_rc = rc;
        snprintf(t->first, sizeof t->first, "%s", st_errdetail());
    }
    size_t need = strlen(id) + (t->used ? 2 : 0);
    if (t->used + need + 5 <= sizeof t->lost) /* whole ids only, room kept for ", ..." */
        t->used += (size_t)snprintf(t->lost + t->used, sizeof t->lost - t->used, "%s%s",
                                    t->used ? ", " : "", id);
    else if (t->used + 5 <= sizeof t->lost && strcmp(t->lost + t->used - 3, "..."))
        t->used += (size_t)snprintf(t->lost + t->used, sizeof t->lost - t->used, ", ...");
}

int st_conv_persist_all(st_conv *cv, unsigned *lost)
{
    *lost = 0;
    if (!cv)
        return 0;
    persist_tally t;
    memset(&t, 0, sizeof t);
    for (uint32_t i = 0; i < cv->n_slots; i++) {
        cslot *cs = &cv->slots[i];
        if (!cs->bound || cs->busy || st_slot_n_tokens(cs->slot) == 0)
            continue;
        st_image *img = NULL;
        int rc = st_slot_snapshot(cs->slot, ST_SNAPSHOT_PARK, ST_CODEC_FP32, &img);
        if (!rc)
            rc = persist_one(cv, cs->id, img);
        st_image_free(img);
        persist_note(&t, cs->id, rc);
    }
    for (pentry *p = cv->head; p; p = p->next)
        if (p->img && !p->busy)
            persist_note(&t, p->id, persist_one(cv, p->id, p->img));
    if (t.written || t.failed)
        fprintf(stderr, "strata-server: stop: %u live conversations written to the store as parked, %u "
                "could not be written%s%s\n", t.written, t.failed, t.failed ? ": " : "", t.lost);
    *lost = t.failed;
    if (!t.failed)
        return 0;
    return st_error_set(t.first_rc, "stop: %u live conversations could not be written to the store and "
                        "are lost (%s): %s", t.failed, t.lost, t.first);
}

/* Disk-parked conversations found in the store at start (invariant 4). */
static int load_spilled(st_conv *cv)
{
    st_session_info *arr = NULL;
    size_t n = 0;
    int rc = st_store_list(cv->store, &arr, &n);
    if (rc == ST_ECORRUPT) {
        /* a damaged sessions database: the start-up scan quarantined what it could name */
        fprintf(stderr, "strata-server: disk-parked conversations not loaded: %s\n", st_errdetail());
        return 0;
    }
    if (rc)
        return rc;
    size_t pl = strlen(ST_API_PARK_PREFIX);
    for (size_t i = 0; i < n; i++) {
        if (strncmp(arr[i].id, ST_API_PARK_PREFIX, pl) || arr[i].damaged)
            continue;
        const char *id = arr[i].id + pl;
        if (!st_conv_id_valid(id, strlen(id)) || damaged(cv, id))
            continue;
        st_version_info vi;
        if (st_store_version_info(cv->store, arr[i].id, 0, &vi))
            continue;
        pentry *p = calloc(1, sizeof *p);
        if (!p) {
            free(arr);
            return st_error_set(ENOMEM, "no memory");
        }
        snprintf(p->id, sizeof p->id, "%s", id);
        p->bytes = vi.logical_bytes;
        p->tokens = vi.n_tokens;
        park_append_locked(cv, p);
    }
    free(arr);
    return 0;
}


/* The model's chat template, parsed once at load; without one, or when it does not parse (the
 * error names its line and column), ChatML, saying so on stderr. */
static int chat_load(st_conv *cv)
{
    const st_gguf *g = st_model_gguf(cv->model);
    int rc = st_chat_template_load(g, &cv->chat);
    if (!rc)
        return 0;
    if (rc != ST_ENOTFOUND && rc != ST_EINVAL)
        return rc;
    fprintf(stderr, "strata-server: %s: the chat template is ChatML\n",
            rc == ST_ENOTFOUND ? "the model has no tokenizer.chat_template" : st_errdetail());
    return st_chat_template_chatml(g, &cv->chat);
}

/* The engine's image buffers (the CPU backend's image buffer cache, which holds two fp32
 * checkpoint blocks; the CUDA backend's pinned pool) made resident before the first request: a
 * SAVE or PARK right after the start then writes memory already mapped, as later ones do, instead
 * of faulting in and clearing fresh pages, which on a virtual machine costs many times the copy
 * itself (docs/BENCHMARKS.md, "Where the time of an HTTP SAVE goes"). Two blocks, each what an
 * image asks for one fp32 checkpoint (st_checkpoint_layout, in whole huge pages: st_image.c's
 * st_alloc); nothing when a block is under 2 MiB (images map those themselves) or the engine has
 * no allocator. Best effort: a buffer that cannot be had is skipped. */
static void images_warm(st_conv *cv)
{
    const st_image_allocator *ia = st_engine_image_allocator(cv->engine);
    const st_geometry *g = st_slot_geometry(cv->slots[0].slot);
    const uint64_t huge = (uint64_t)2 << 20;
    uint64_t *off = ia ? malloc((g->n_tensors ? g->n_tensors : 1) * sizeof *off) : NULL;
    if (!off)
        return;
    uint64_t len = st_checkpoint_layout(g->tensors, g->n_tensors, ST_CODEC_FP32, off);
    free(off);
    len = (len + huge - 1) & ~(huge - 1);
    if (len < huge || len > SIZE_MAX / 2)
        return;
    void *p[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++)
        if ((p[i] = ia->alloc(ia->ctx, (size_t)len)))
            memset(p[i], 0, (size_t)len);
    for (int i = 0; i < 2; i++)
        if (p[i])
            ia->free(ia->ctx, p[i], (size_t)len);
}

/* The prefix index's images pass the memory guard as a SAVE's and a RESTORE's do. */
static int prefix_admit(void *arg, const char *what, uint64_t bytes)
{
    st_conv *cv = arg;
    return st_memguard_admit(cv->guard, what, bytes);
}

int st_conv_new(const st_conv_env *ce, st_conv **out)
{
    const st_api_config *cfg = ce->cfg;
    *out = NULL;
    st_conv *cv = calloc(1, sizeof *cv);
    int rc = 0;
    if (!cv)
        return st_error_set(ENOMEM, "no memory");
    pthread_mutex_init(&cv->mu, NULL);
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC); /* deadlines immune to wall-clock steps */
    pthread_cond_init(&cv->freed, &ca);
    pthread_condattr_destroy(&ca);
    cv->wait_ms = cfg->busy_wait_ms;
    cv->wait_max = cfg->workers ? cfg->workers - 1 : 0;
    cv->env = ce;
    cv->store = ce->store;
    cv->m = ce->m;
    cv->guard = ce->guard;
    cv->ram_limit = cfg->conversation_cache_bytes;
    if ((rc = st_model_load(cfg->model_path, &cv->model))) {
        char d[600];
        snprintf(d, sizeof d, "%s", st_errdetail());
        rc = st_error_set(rc, "loading the model %s: %s", cfg->model_path, d[0] ? d : st_strerror(rc));
        goto fail;
    }
    if ((rc = chat_load(cv)))
        goto fail;
    st_engine_opts eo;
    st_engine_opts_default(&eo);
    eo.backend = cfg->backend;
    if (!eo.backend) {
        const char *env = getenv("STRATA_BACKEND");
        /* the CUDA backend where a GPU is and it computes the model (st_engine_cuda_check) */
        /* f32 K/V (the reference comparisons' precision) is the CPU's alone */
        int cuda = st_codec_cuda_available() && cfg->kv_dtype != ST_DTYPE_F32 &&
                   !st_engine_cuda_check(st_model_gguf(cv->model));
        eo.backend = env && *env ? env : cuda ? "cuda" : "cpu";
    }
    if (cfg->threads)
        eo.n_threads = cfg->threads;
    if (cfg->ubatch)
        eo.ubatch = cfg->ubatch;
    if (cfg->n_ctx)
        eo.n_ctx = cfg->n_ctx;
    if (cfg->page_size)
        eo.page_size = cfg->page_size;
    if (cfg->kv_dtype != UINT32_MAX)
        eo.kv_dtype = cfg->kv_dtype;
    if (cfg->prompt_cache_set)
        eo.prompt_cache = cfg->prompt_cache;
    eo.prompt_cache_every = cfg->prompt_cache_every;
    eo.prompt_cache_root = cfg->prompt_cache_root;
    /* the prefix index's points are chunk ends where the slot holds a state: for a recurrent
     * model, checkpoints at every multiple of ubatch (invariant 10) */
    if (cfg->prefix_budget_bytes && !eo.prompt_cache_every)
        eo.prompt_cache_every = eo.ubatch;
    eo.expert_cache_bytes = cfg->expert_cache_bytes;
    if ((rc = st_engine_new(cv->model, &eo, &cv->engine)))
        goto fail;
    fprintf(stderr, "strata-server: engine on the %s backend\n", eo.backend);
    cv->n_vocab = st_model_hparams_get(cv->model)->n_vocab;
    cv->n_ctx = st_engine_opts_get(cv->engine)->n_ctx;
    cv->n_slots = cfg->slots;
    cv->slots = calloc(cv->n_slots, sizeof *cv->slots);
    if (!cv->slots) {
        rc = st_error_set(ENOMEM, "no memory for slots");
        goto fail;
    }
    for (uint32_t i = 0; i < cv->n_slots; i++)
        if ((rc = st_slot_new(cv->engine, &cv->slots[i].slot)))
            goto fail;
    /* K/V only (llama, qwen3): the position is the one running tensor (st_slot.c's kv_only_pos) */
    const st_geometry *geo = st_slot_geometry(cv->slots[0].slot);
    cv->kv_only = 1;
    for (uint32_t ti = 0; ti < geo->n_tensors; ti++)
        if (geo->tensors[ti].role == ST_ROLE_RUNNING &&
            (geo->tensors[ti].dtype != ST_DTYPE_I64 || strcmp(geo->tensors[ti].name, "pos")))
            cv->kv_only = 0;
    if ((rc = load_spilled(cv)))
        goto fail;
    if (cfg->prefix_budget_bytes) {
        st_prefix_opts po;
        st_prefix_opts_default(&po);
        po.budget_bytes = cfg->prefix_budget_bytes;
        if (cfg->prefix_max_entries)
            po.max_entries = cfg->prefix_max_entries;
        if (cfg->prefix_min_tokens)
            po.min_tokens = cfg->prefix_min_tokens;
        po.admit = prefix_admit;
        po.admit_arg = cv;
        if ((rc = st_prefix_new(&po, cv->engine, geo, cv->store, ce->tier, &cv->prefix))) {
            char d[600];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(rc, "the prefix index: %s", d);
            goto fail;
        }
    }
    images_warm(cv);
    cv->m->slots_total = cv->n_slots;
    cv->m->pool_limit_bytes = cv->ram_limit;
    gauges_locked(cv);
    *out = cv;
    return 0;
fail:
    st_conv_free(cv);
    return rc;
}

void st_conv_free(st_conv *cv)
{
    if (!cv)
        return;
    st_prefix_free(cv->prefix);
    while (cv->head) {
        pentry *p = cv->head;
        park_remove_locked(cv, p);
        pentry_free(cv, p);
    }
    for (int i = 0; i < SIDX_MAX; i++)
        hcopy_free(&cv->sidx[i].held);
    if (cv->slots)
        for (uint32_t i = 0; i < cv->n_slots; i++)
            st_slot_free(cv->slots[i].slot);
    free(cv->slots);
    st_engine_free(cv->engine);
    st_chat_template_free(cv->chat);
    st_model_free(cv->model);
    pthread_mutex_destroy(&cv->mu);
    pthread_cond_destroy(&cv->freed);
    free(cv);
}

