/*
 * st_conv.c - conversations in the engine: slots, the park pool, and the routes that use them
 * (completions, SAVE, RESTORE, PARK, llama.cpp's /slots).
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
 * 7. A completion whose client went away (st_api_call_cancelled, set by the loop) stops at the
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
 */
#ifdef ST_API_HAVE_ENGINE

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

#include "st_api_int.h"
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
    st_api_server *srv;
    st_store *store;
    st_metrics *m;
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
    _Atomic uint64_t disk_toks;    /* tokens in the disk entries' copies, at most DISK_TOKENS */
};

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

/* A copy of img's tokens and checkpoint positions; -1 when out of memory (nothing copied). */
static int hcopy_image(const st_image *img, hcopy *h)
{
    memset(h, 0, sizeof *h);
    h->n = st_image_n_tokens(img);
    h->n_pos = st_image_n_checkpoints(img);
    h->toks = malloc((h->n ? h->n : 1) * sizeof *h->toks);
    h->pos = malloc((h->n_pos ? h->n_pos : 1) * sizeof *h->pos);
    if (!h->toks || !h->pos) {
        hcopy_free(h);
        return -1;
    }
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
    memset(h, 0, sizeof *h);
    h->n = st_slot_n_tokens(s);
    h->n_pos = st_slot_n_checkpoints(s);
    h->toks = malloc((h->n ? h->n : 1) * sizeof *h->toks);
    h->pos = malloc((h->n_pos ? h->n_pos : 1) * sizeof *h->pos);
    if (!h->toks || !h->pos) {
        hcopy_free(h);
        return -1;
    }
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
    pthread_mutex_lock(&cv->mu);
    cslot *cs = &cv->slots[j];
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

static int put_park(st_conv *cv, const char *id, const st_image *img, const st_put_opts *po)
{
    char pid[PARK_ID_MAX];
    park_id(pid, id);
    int rc = st_store_put(cv->store, pid, img, ST_STORE_HEAD_ANY, po, NULL);
    if (rc == ST_EMODEL || rc == ST_EGEOMETRY) {
        /* a stale spill made under another model: this image replaces it */
        st_store_session_delete(cv->store, pid);
        rc = st_store_put(cv->store, pid, img, ST_STORE_HEAD_ANY, po, NULL);
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

        int rc = put_park(cv, id, img, NULL);
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
    st_image *img = NULL;
    if ((rc = st_store_get_with(cv->store, pid, 0, st_engine_image_allocator(cv->engine), &img)))
        return rc;
    rc = st_slot_restore_adopt(s, img);
    st_image_free(img);
    if (rc)
        return rc;
    cv->m->conv_hits_disk++;
    cv->m->park_unspills++;
    *source = "disk";
    return 0;
}

enum { ACQ_LOAD, ACQ_EMPTY };

/* Get a slot for session id, marked busy (invariant 2). ACQ_LOAD: the slot holds the session's
 * conversation from wherever it was (slot, pool, store head) or nothing for a new one.
 * ACQ_EMPTY: a slot already bound to id is returned as it is; otherwise an empty slot, and a park
 * entry of id, if any, is returned busy in *pe (out of the list) for the caller to drop or give
 * back with park_giveback. */
static int acquire(st_conv *cv, const char *id, int mode, int *out_j, pentry **pe, const char **source,
                   const _Atomic int *cancel)
{
    *out_j = -1;
    if (pe)
        *pe = NULL;
    *source = "slot";
    int rc = st_api_session_damaged(cv->srv, id); /* its keys in the store may lie in a damaged page */
    if (rc)
        return rc;
    pthread_mutex_lock(&cv->mu);
    rc = wait_turn_locked(cv, id, cancel);
    if (rc) {
        pthread_mutex_unlock(&cv->mu);
        return rc;
    }
    int j = slot_find_locked(cv, id);
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
    } else if (p) {
        if ((rc = load_parked(cv, j, p, source)))
            goto fail;
        if (!p->img)
            drop_park_store(cv, p->id);
        pentry_free(cv, p);
        p = NULL;
    } else {
        st_version_info vi;
        rc = st_store_version_info(cv->store, id, 0, &vi);
        if (rc == ST_ENOTFOUND) {
            st_slot_reset(cs->slot);
            cv->m->conv_new++;
            *source = "new";
            rc = 0;
        } else if (!rc) {
            st_image *img = NULL;
            if (!(rc = st_memguard_admit(cv->guard, "restoring the saved conversation", vi.logical_bytes)) &&
                !(rc = st_store_get_with(cv->store, id, 0, st_engine_image_allocator(cv->engine), &img)))
                rc = st_slot_restore_adopt(cs->slot, img);
            st_image_free(img);
            if (!rc) {
                cv->m->conv_hits_store++;
                cv->m->restores++;
                cv->m->restore_bytes += vi.logical_bytes;
                *source = "store";
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

/* ---- text ---------------------------------------------------------------------------------- */

/* Bytes as JSON-safe UTF-8: invalid sequences become U+FFFD. *out is malloc'd. */
static char *utf8_clean(const unsigned char *s, size_t n)
{
    char *o = malloc(n * 3 + 1);
    size_t k = 0;
    if (!o)
        return NULL;
    for (size_t i = 0; i < n;) {
        unsigned char c = s[i];
        size_t len = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
        int ok = len > 0 && i + len <= n;
        uint32_t cp = len == 1 ? c : len == 2 ? c & 0x1f : len == 3 ? c & 0x0f : c & 0x07;
        for (size_t t = 1; ok && t < len; t++) {
            if ((s[i + t] & 0xc0) != 0x80)
                ok = 0;
            else
                cp = (cp << 6) | (s[i + t] & 0x3f);
        }
        if (ok && ((len == 2 && cp < 0x80) || (len == 3 && cp < 0x800) || (len == 4 && cp < 0x10000) ||
                   cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff) || cp == 0))
            ok = 0;
        if (ok) {
            memcpy(o + k, s + i, len);
            k += len;
            i += len;
        } else {
            memcpy(o + k, "\xef\xbf\xbd", 3);
            k += 3;
            i++;
        }
    }
    o[k] = '\0';
    return o;
}

/* ---- routes --------------------------------------------------------------------------------- */


/* st_slot_set_cancel's hook for a completion: whether its client went away. */
static int call_gone(void *arg)
{
    return st_api_call_cancelled((st_api_call *)arg);
}

void st_api_random_hex(char *dst, size_t cap)
{
    unsigned char r[12] = {0};
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        if (read(fd, r, sizeof r) != (ssize_t)sizeof r)
            memset(r, 0, sizeof r);
        close(fd);
    }
    if (cap)
        dst[0] = 0;
    for (size_t i = 0; i < sizeof r && 2 * i + 2 < cap; i++)
        snprintf(dst + 2 * i, 3, "%02x", r[i]);
}

static void random_id(char *dst)
{
    strcpy(dst, "c-");
    st_api_random_hex(dst + 2, 17); /* 16 hex digits */
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
    int rc = st_api_session_damaged(cv->srv, seed);
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

int st_conv_generate(st_api_call *c, st_conv_gen *g)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_vocab *vocab = st_model_vocab(cv->model);
    g->found = "slot";
    g->stop = "length";
    g->n_gen = g->resumed = g->computed = 0;
    g->prompt_ms = g->decode_ms = 0.0;
    g->search_ms = 0.0;
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
            double ts = st_api_now_ms();
            pthread_mutex_lock(&cv->mu);
            anon_best_locked(cv, g->whole, g->n_whole, g->id, seed);
            pthread_mutex_unlock(&cv->mu);
            g->search_ms = st_api_now_ms() - ts;
        }
    }
    if (st_api_call_cancelled(c)) { /* gone while queued for a worker: nothing runs */
        cv->m->completions_cancelled++;
        st_api_call_cancel(c);
        return -1;
    }
    int j = -1;
    int rc = acquire(cv, g->id, ACQ_LOAD, &j, NULL, &g->found, &c->cancelled);
    if (rc == ECANCELED) { /* gone while waiting for the session: it never ran */
        cv->m->completions_cancelled++;
        st_api_call_cancel(c);
        return -1;
    }
    if (rc) {
        st_api_call_fail(c, rc, "completion");
        return -1;
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
    int ret = -1;
    g->n_held = held;
    if (toks) {
        n = g->n_whole;
        splice_held(vocab, st_slot_tokens(s), held, toks, n, &own, &n, &g->spliced);
        if (own)
            toks = own;
    } else {
        if (g->build(g->arg, st_slot_tokens(s), held, &own, &n, &system_end))
            goto done;
        toks = own;
    }
    if (n == 0) {
        st_api_call_error(c, 400, "invalid_field", "the prompt is empty");
        goto done;
    }
    if (n + g->n_predict > cv->n_ctx) {
        st_api_call_error(c, 400, "context_full",
                          "the conversation would reach %llu tokens; the context holds %u",
                          (unsigned long long)(n + g->n_predict), cv->n_ctx);
        goto done;
    }
    double t0 = st_api_now_ms();
    st_eval_stats es = {0, 0, UINT64_MAX, 0};
    es.reused = held;
    uint64_t shared = 0;
    while (shared < held && shared < n && st_slot_tokens(s)[shared] == toks[shared])
        shared++;
    if (shared < held || n > held || !st_slot_logits(s, NULL)) {
        /* one read; the engine asks the call before each chunk whether the client is still
         * there (invariant 7), and a stop leaves the whole chunks read so far */
        if (st_api_call_cancelled(c))
            goto cancelled;
        st_slot_set_cancel(s, call_gone, c);
        rc = st_slot_eval(s, toks, n, system_end, &es);
        st_slot_set_cancel(s, NULL, NULL);
        if (rc == ECANCELED)
            goto cancelled;
        if (rc) {
            st_api_call_fail(c, rc, "reading the prompt (the live conversation was dropped)");
            goto done;
        }
    }
    double t1 = st_api_now_ms();
    g->n_prompt = n;
    for (uint64_t i = 0; i < g->n_predict; i++) {
        uint32_t tok;
        /* between tokens: every token appended so far stays, with its logits (invariant 7) */
        if (st_api_call_cancelled(c))
            goto cancelled;
        if ((rc = st_slot_sample_with(s, &g->sp, g->seed, &tok)) || (rc = st_slot_decode(s, tok))) {
            st_api_call_fail(c, rc, "generating");
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
    double t2 = st_api_now_ms();
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
    cv->m->prompt_reused += es.reused;
    cv->m->prompt_computed += es.computed;
    cv->m->completions_cancelled++;
    st_api_call_cancel(c);
done:
    free(own);
    slot_release(cv, j);
    return ret;
}

const st_vocab *st_conv_vocab(st_conv *cv) { return st_model_vocab(cv->model); }
const st_chat_template *st_conv_chat(st_conv *cv) { return cv->chat; }
uint32_t st_conv_n_ctx(st_conv *cv) { return cv->n_ctx; }
uint32_t st_conv_n_vocab(st_conv *cv) { return cv->n_vocab; }

const char *st_conv_model_name(st_conv *cv)
{
    const char *name = NULL;
    uint64_t len = 0;
    if (!st_gguf_get_str(st_model_gguf(cv->model), "general.name", &name, &len) && len &&
        !memchr(name, '\0', len) && strlen(name) == len)
        return name;
    const char *p = st_api_cfg(cv->srv)->model_path, *slash = strrchr(p, '/');
    return slash ? slash + 1 : p;
}

/* The native completion: the body's prompt appended to what the session holds. */
typedef struct native_gen {
    st_api_call *c;
    const st_vocab *vocab;
    const char *prompt, *system;
    json_t *jt;
    size_t sys_len, p_len, n_in;
    uint32_t *gen;          /* the generated ids */
    uint64_t n_gen;
    char *bytes;            /* their text */
    size_t n_bytes, cap_bytes;
    st_vocab_stream vs;
} native_gen;

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

/* the conversation as `strata generate` builds it: what is held, then BOS (new) or a turn
 * separator (continued), the system prompt and the prompt; with the model's vocabulary, what is
 * held, BOS on a new conversation when the vocabulary adds one, the system prompt and the prompt
 * (no separators: the text carries the turns) */
static int native_build(void *arg, const uint32_t *held, uint64_t n_held, uint32_t **out,
                        uint64_t *out_n, uint64_t *system_end)
{
    native_gen *ng = arg;
    st_conv *cv = st_api_conv(ng->c->srv);
    uint32_t *sys = NULL, *pr = NULL;
    uint64_t n_sys = 0, n_pr = 0;
    int rc = 0;
    if ((ng->sys_len && (rc = st_conv_tokenize(cv, ng->system, ng->sys_len, 0, 0, &sys, &n_sys))) ||
        (rc = st_conv_tokenize(cv, ng->prompt ? ng->prompt : "", ng->p_len, 0, 0, &pr, &n_pr))) {
        free(sys);
        st_api_call_fail(ng->c, rc, "tokenizing");
        return -1;
    }
    uint64_t cap = n_held + 3 + n_sys + n_pr + ng->n_in;
    uint32_t *toks = malloc(cap * sizeof *toks);
    if (!toks) {
        free(sys);
        free(pr);
        st_api_call_error(ng->c, 503, "out_of_memory", "no memory");
        return -1;
    }
    uint64_t n = n_held;
    if (n_held)
        memcpy(toks, held, n_held * sizeof *toks);
    int more = ng->sys_len || ng->p_len || ng->n_in;
    if (!ng->vocab) {
        if (!n_held || more)
            toks[n++] = n_held ? ST_TOKEN_SEP : ST_TOKEN_BOS;
    } else if (!n_held && st_vocab_add_bos(ng->vocab) &&
               st_vocab_special(ng->vocab, ST_VOCAB_BOS) != UINT32_MAX) {
        toks[n++] = st_vocab_special(ng->vocab, ST_VOCAB_BOS);
    }
    if (ng->sys_len) {
        memcpy(toks + n, sys, n_sys * sizeof *toks);
        n += n_sys;
        *system_end = n;
        if ((ng->p_len || ng->n_in) && !ng->vocab)
            toks[n++] = ST_TOKEN_SEP;
    }
    memcpy(toks + n, pr, n_pr * sizeof *toks);
    n += n_pr;
    for (size_t i = 0; i < ng->n_in; i++)
        toks[n++] = (uint32_t)json_integer_value(json_array_get(ng->jt, i));
    free(sys);
    free(pr);
    *out = toks;
    *out_n = n;
    return 0;
}

static int native_token(void *arg, uint32_t tok, int eog)
{
    native_gen *ng = arg;
    (void)eog;
    ng->gen[ng->n_gen++] = tok;
    if (!ng->vocab) {
        if (tok < 256)
            ng->bytes[ng->n_bytes++] = (char)tok;
        return 0;
    }
    for (;;) {
        size_t need = 0;
        int rc = st_vocab_stream_push(ng->vocab, &ng->vs, tok, 0, ng->bytes + ng->n_bytes,
                                      ng->cap_bytes - ng->n_bytes, &need);
        if (!rc) {
            ng->n_bytes += need;
            return 0;
        }
        if (rc != ST_ETOOBIG) {
            st_api_call_fail(ng->c, rc, "detokenizing");
            return -1;
        }
        size_t cap = (ng->n_bytes + need) * 2 + 64;
        char *b = realloc(ng->bytes, cap);
        if (!b) {
            st_api_call_error(ng->c, 503, "out_of_memory", "no memory");
            return -1;
        }
        ng->bytes = b;
        ng->cap_bytes = cap;
    }
}

void st_conv_completion(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    static const char *const keys[] = {"session", "prompt", "tokens", "system", "n_predict",
                                       "temperature", "seed", "ignore_eos", "top_k", "top_p",
                                       "min_p", NULL};
    const char *sid = NULL;
    uint64_t n_predict = 16, seed = 0, top_k = 0;
    double temp = 0.0, top_p = 1.0, min_p = 0.0;
    int ignore_eos = 0;
    native_gen ng = {.c = c, .vocab = st_model_vocab(cv->model)};
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "session", &sid) ||
        st_api_json_opt_str(c, "prompt", &ng.prompt) || st_api_json_opt_str(c, "system", &ng.system) ||
        st_api_json_opt_u64(c, "n_predict", cfg->max_n_predict, &n_predict, NULL) ||
        st_api_json_opt_double(c, "temperature", &temp, NULL) ||
        st_api_json_opt_u64(c, "seed", UINT64_MAX >> 1, &seed, NULL) ||
        st_api_json_opt_bool(c, "ignore_eos", &ignore_eos) ||
        st_api_json_opt_u64(c, "top_k", UINT32_MAX, &top_k, NULL) ||
        st_api_json_opt_double(c, "top_p", &top_p, NULL) ||
        st_api_json_opt_double(c, "min_p", &min_p, NULL))
        return;
    json_t *jt = json_object_get(c->body, "tokens");
    if (jt && !json_is_null(jt) && ng.prompt) {
        st_api_call_error(c, 400, "invalid_field", "give \"prompt\" or \"tokens\", not both");
        return;
    }
    if (jt && !json_is_null(jt) && !json_is_array(jt)) {
        st_api_call_error(c, 400, "invalid_field", "\"tokens\" must be an array of token ids");
        return;
    }
    if (temp < 0 || temp > 100 || temp != temp) {
        st_api_call_error(c, 400, "invalid_field", "\"temperature\" must be from 0 (greedy) to 100");
        return;
    }
    if (!(top_p > 0 && top_p <= 1) || !(min_p >= 0 && min_p <= 1)) {
        st_api_call_error(c, 400, "invalid_field",
                          "\"top_p\" must be in (0, 1] and \"min_p\" in [0, 1]");
        return;
    }
    if (sid && !st_api_id_valid(sid, strlen(sid))) {
        st_api_call_error(c, 400, "invalid_id", "\"session\" is not a valid session id");
        return;
    }
    ng.jt = jt;
    ng.sys_len = ng.system ? strlen(ng.system) : 0;
    ng.p_len = ng.prompt ? strlen(ng.prompt) : 0;
    ng.n_in = jt && json_is_array(jt) ? json_array_size(jt) : 0;
    if (ng.sys_len + ng.p_len + ng.n_in + 2 > cv->n_ctx && !ng.vocab) {
        st_api_call_error(c, 400, "context_full", "the prompt alone exceeds the context of %u tokens",
                          cv->n_ctx);
        return;
    }
    for (size_t i = 0; i < ng.n_in; i++) {
        json_t *t = json_array_get(jt, i);
        if (!json_is_integer(t) || json_integer_value(t) < 0 || json_integer_value(t) >= cv->n_vocab) {
            st_api_call_error(c, 400, "invalid_field", "tokens[%zu] is not a token id below %u", i,
                              cv->n_vocab);
            return;
        }
    }
    ng.cap_bytes = n_predict + 1;
    ng.gen = malloc((n_predict ? n_predict : 1) * sizeof *ng.gen);
    ng.bytes = malloc(ng.cap_bytes);
    char *text = NULL;
    if (!ng.gen || !ng.bytes) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        goto done;
    }
    st_conv_gen g = {.session = sid, .build = native_build, .token = native_token, .arg = &ng,
                     .n_predict = n_predict, .seed = seed, .ignore_eos = ignore_eos};
    g.sp.temp = (float)temp;
    g.sp.top_k = (uint32_t)top_k;
    g.sp.top_p = (float)top_p;
    g.sp.min_p = (float)min_p;
    if (st_conv_generate(c, &g))
        goto done;
    if (ng.vocab) {
        char tail[4];
        size_t k = st_vocab_stream_flush(&ng.vs, tail, sizeof tail);
        if (ng.n_bytes + k <= ng.cap_bytes) {
            memcpy(ng.bytes + ng.n_bytes, tail, k);
            ng.n_bytes += k;
        }
    }
    text = utf8_clean((const unsigned char *)ng.bytes, ng.n_bytes);
    json_t *jtoks = json_array();
    for (uint64_t i = 0; i < ng.n_gen; i++)
        json_array_append_new(jtoks, json_integer(ng.gen[i]));
    c->reply = json_pack("{s:s,s:s,s:o,s:s,s:s,s:I,s:I,s:{s:f,s:I,s:I,s:f,s:f}}", "session", g.id,
                         "text", text ? text : "", "tokens", jtoks, "stop", g.stop, "found", g.found,
                         "n_prompt_tokens", (json_int_t)(g.n_prompt - g.n_held), "n_tokens",
                         (json_int_t)g.n_tokens, "timings", "prompt_ms", st_api_ms(g.prompt_ms),
                         "resumed_tokens", (json_int_t)g.resumed, "computed_tokens",
                         (json_int_t)g.computed, "decode_ms", st_api_ms(g.decode_ms), "tokens_per_s",
                         st_api_ms(g.decode_ms > 0 ? (double)g.n_gen * 1000.0 / g.decode_ms : 0.0));
    c->status = 200;
done:
    free(ng.gen);
    free(ng.bytes);
    free(text);
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

void st_conv_save(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    static const char *const keys[] = {"codec", "compress", "label", "expected_head", NULL};
    const char *codec_name = NULL, *label = NULL;
    uint64_t compress = (uint64_t)cfg->save_compress, expected = ST_STORE_HEAD_ANY;
    int have_expected = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "codec", &codec_name) ||
        st_api_json_opt_str(c, "label", &label) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL) ||
        st_api_json_opt_u64(c, "expected_head", UINT64_MAX >> 1, &expected, &have_expected))
        return;
    uint32_t codec = cfg->state_codec;
    if (codec_name) {
        st_codec_id id;
        if (st_codec_parse(codec_name, &id)) {
            st_api_call_error(c, 400, "invalid_field", "\"codec\" must be fp32, bf16 or f16");
            return;
        }
        codec = id;
    }
    if (label && (!st_store_id_valid(label) || strlen(label) >= ST_STORE_LABEL_MAX)) {
        st_api_call_error(c, 400, "invalid_field", "\"label\" must be 1..%d bytes of A-Z a-z 0-9 . _ : + = -",
                          ST_STORE_LABEL_MAX - 1);
        return;
    }
    if (have_expected && expected == 0)
        expected = ST_STORE_HEAD_NONE; /* 0: the session must not exist yet */
    int j;
    pentry *p;
    int rc = take_live(cv, c->id, &j, &p);
    if (rc) {
        st_api_call_fail(c, rc, "save");
        return;
    }
    double t0 = st_api_now_ms();
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
        park_id(pid, c->id);
        if (!(rc = st_store_get(cv->store, pid, 0, &img)) && codec != ST_CODEC_FP32)
            rc = st_image_recode(img, codec, NULL, NULL, NULL, NULL);
    }
    if (rc)
        goto done;
    if (!put_img)
        put_img = img;
    double t1 = st_api_now_ms();
    st_put_stats ps;
    memset(&ps, 0, sizeof ps);
    st_put_opts po = {.compress = (int)compress, .label = label, .stats = &ps};
    uint64_t version = 0;
    if ((rc = st_store_put(cv->store, c->id, put_img, expected, &po, &version)))
        goto done;
    sidx_put_image(cv, c->id, put_img);
    double t2 = st_api_now_ms();
    cv->m->saves++;
    cv->m->save_logical_bytes += ps.logical_bytes;
    cv->m->save_new_bytes += ps.new_bytes;
    cv->m->save_stored_bytes += ps.stored_bytes;
    c->reply = json_pack("{s:s,s:I,s:s,s:s,s:I,s:I,s:I,s:I,s:i,s:i,s:i,s:f,s:f,s:f}", "session", c->id,
                         "version", (json_int_t)version, "codec", st_codec_name(codec), "from", from,
                         "tokens", (json_int_t)st_image_n_tokens(put_img), "logical_bytes",
                         (json_int_t)ps.logical_bytes, "stored_bytes", (json_int_t)ps.stored_bytes,
                         "new_stored_bytes", (json_int_t)ps.new_bytes, "chunks", (int)ps.chunks,
                         "new_chunks", (int)ps.new_chunks, "pruned_versions", (int)ps.pruned,
                         "snapshot_ms", st_api_ms(t1 - t0), "store_ms", st_api_ms(t2 - t1), "ms",
                         st_api_ms(t2 - t0));
    c->status = 201;
done:
    if (rc)
        st_api_call_fail(c, rc, "save");
    st_image_free(img);
    if (j >= 0)
        slot_release(cv, j);
    else
        park_release(cv, p);
}

void st_conv_restore(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    static const char *const keys[] = {"version", NULL};
    uint64_t version = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_u64(c, "version", UINT64_MAX >> 1, &version, NULL))
        return;
    st_version_info vi;
    int rc = st_store_version_info(cv->store, c->id, version, &vi);
    if (rc) {
        st_api_call_fail(c, rc, "restore");
        return;
    }
    if ((rc = st_memguard_admit(cv->guard, "RESTORE", vi.logical_bytes))) {
        st_api_call_fail(c, rc, "restore");
        return;
    }
    int j = -1;
    pentry *p = NULL;
    const char *source;
    if ((rc = acquire(cv, c->id, ACQ_EMPTY, &j, &p, &source, NULL))) {
        st_api_call_fail(c, rc, "restore");
        return;
    }
    double t0 = st_api_now_ms();
    st_image *img = NULL;
    if (!(rc = st_store_get_with(cv->store, c->id, vi.version, st_engine_image_allocator(cv->engine), &img)))
        rc = st_slot_restore_adopt(cv->slots[j].slot, img); /* on error the slot is as it was */
    double t1 = st_api_now_ms();
    if (rc) {
        st_api_call_fail(c, rc, "restore");
        park_giveback(cv, p);
        if (st_slot_n_tokens(cv->slots[j].slot) == 0) {
            pthread_mutex_lock(&cv->mu);
            cv->slots[j].bound = 0;
            pthread_mutex_unlock(&cv->mu);
        }
    } else {
        park_drop(cv, p); /* the restored version replaces what was parked */
        cv->m->restores++;
        cv->m->restore_bytes += vi.logical_bytes;
        c->reply = json_pack("{s:s,s:I,s:I,s:I,s:f}", "session", c->id, "version",
                             (json_int_t)vi.version, "tokens", (json_int_t)st_image_n_tokens(img),
                             "logical_bytes", (json_int_t)vi.logical_bytes, "ms", st_api_ms(t1 - t0));
        c->status = 200;
    }
    st_image_free(img);
    slot_release(cv, j);
}

void st_conv_park(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    static const char *const keys[] = {NULL};
    if (st_api_json_only(c, keys))
        return;
    int j;
    pentry *p;
    int rc = take_live(cv, c->id, &j, &p);
    if (rc) {
        st_api_call_fail(c, rc, "park");
        return;
    }
    if (p) { /* already parked: say where */
        c->reply = json_pack("{s:s,s:s,s:I,s:I,s:b,s:f}", "session", c->id, "where",
                             p->img ? "ram" : "disk", "bytes", (json_int_t)p->bytes, "tokens",
                             (json_int_t)p->tokens, "already", 1, "ms", 0.0);
        c->status = 200;
        park_release(cv, p);
        return;
    }
    double t0 = st_api_now_ms();
    const char *where = "ram";
    uint64_t bytes = 0, tokens = st_slot_n_tokens(cv->slots[j].slot);
    rc = park_slot(cv, j, c->id, 1, &where, &bytes);
    if (rc)
        st_api_call_fail(c, rc, "park");
    else {
        c->reply = json_pack("{s:s,s:s,s:I,s:I,s:b,s:f}", "session", c->id, "where", where, "bytes",
                             (json_int_t)bytes, "tokens", (json_int_t)tokens, "already", 0, "ms",
                             st_api_ms(st_api_now_ms() - t0));
        c->status = 200;
    }
    slot_release(cv, j);
}

/* ---- llama.cpp's /slots ---------------------------------------------------------------------- */

void st_conv_slots_list(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    json_t *a = json_array();
    pthread_mutex_lock(&cv->mu);
    for (uint32_t i = 0; i < cv->n_slots; i++) {
        cslot *cs = &cv->slots[i];
        json_array_append_new(a, json_pack("{s:i,s:o,s:I,s:b,s:I}", "id", (int)i, "session",
                                           cs->bound ? json_string(cs->id) : json_null(), "n_tokens",
                                           (json_int_t)(cs->bound ? cs->tokens : 0), "is_processing",
                                           cs->busy, "n_ctx", (json_int_t)cv->n_ctx));
    }
    pthread_mutex_unlock(&cv->mu);
    c->reply = a;
    c->status = 200;
}

static int filename_ok(const char *f)
{
    size_t n = strlen(f);
    if (!n || n > 128)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)f[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return 0;
    }
    return 1;
}

void st_conv_slots_action(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    char action[16] = "";
    const char *q = st_http_req_query(c->req);
    /* the query is tiny and already bounded by the header limit */
    const char *a = q ? strstr(q, "action=") : NULL;
    if (a && (a == q || a[-1] == '&')) {
        size_t n = strcspn(a + 7, "&");
        if (n < sizeof action) {
            memcpy(action, a + 7, n);
            action[n] = '\0';
        }
    }
    if (strcmp(action, "save") && strcmp(action, "restore") && strcmp(action, "erase")) {
        st_api_call_error(c, 400, "invalid_param", "action must be save, restore or erase");
        return;
    }
    uint64_t n = 0;
    const char *p = c->arg2;
    if (!*p || strlen(p) > 6)
        goto bad_slot;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad_slot;
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (n >= cv->n_slots)
        goto bad_slot;
    static const char *const keys[] = {"filename", "compress", NULL};
    const char *fname = NULL;
    uint64_t compress = 0; /* save: the zstd level of the file's checkpoints (docs/API.md) */
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "filename", &fname) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL))
        return;
    char path[PATH_MAX];
    if (strcmp(action, "erase")) {
        if (!cfg->slot_save_path) {
            st_api_call_error(c, 501, "not_configured", "start the server with --slot-save-path DIR");
            return;
        }
        if (!fname || !filename_ok(fname)) {
            st_api_call_error(c, 400, "invalid_filename",
                              "\"filename\" must be a plain file name (A-Z a-z 0-9 . _ -, not starting "
                              "with '.'), never a path");
            return;
        }
        if (snprintf(path, sizeof path, "%s/%s", cfg->slot_save_path, fname) >= (int)sizeof path) {
            st_api_call_error(c, 400, "invalid_filename", "path too long");
            return;
        }
    }
    int j = (int)n;
    pthread_mutex_lock(&cv->mu);
    int busy = cv->slots[j].busy;
    if (!busy)
        cv->slots[j].busy = 1;
    int bound = cv->slots[j].bound;
    char sid[ST_API_ID_MAX + 1];
    memcpy(sid, cv->slots[j].id, sizeof sid);
    pthread_mutex_unlock(&cv->mu);
    if (busy) {
        st_api_call_error(c, 409, "busy", "slot %d is busy", j);
        return;
    }
    st_slot *s = cv->slots[j].slot;
    double t0 = st_api_now_ms();
    int rc = 0;
    st_image *img = NULL;
    if (!strcmp(action, "erase")) {
        uint64_t had = st_slot_n_tokens(s);
        st_slot_reset(s);
        pthread_mutex_lock(&cv->mu);
        cv->slots[j].bound = 0;
        pthread_mutex_unlock(&cv->mu);
        c->reply = json_pack("{s:i,s:I}", "id_slot", j, "n_erased", (json_int_t)had);
        c->status = 200;
    } else if (!strcmp(action, "save")) {
        if (!bound || st_slot_n_tokens(s) == 0) {
            st_api_call_error(c, 409, "slot_empty", "slot %d holds no conversation", j);
        } else if (!(rc = st_memguard_admit(cv->guard, "slot save", slot_image_bytes(s, 0))) &&
                   !(rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, cfg->state_codec, &img)) &&
                   !(rc = st_file_write(img, path, &(st_file_write_opts){.compress = (int)compress,
                                                                         .shuffle = 1}))) {
            struct stat sb;
            uint64_t written = stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
            c->reply = json_pack("{s:i,s:s,s:I,s:I,s:{s:f}}", "id_slot", j, "filename", fname,
                                 "n_saved", (json_int_t)st_image_n_tokens(img), "n_written",
                                 (json_int_t)written, "timings", "save_ms", st_api_ms(st_api_now_ms() - t0));
            c->status = 200;
        }
    } else {
        struct stat sb;
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
            memcpy(sid, cv->slots[j].id, sizeof sid);
            pthread_mutex_unlock(&cv->mu);
            c->reply = json_pack("{s:i,s:s,s:s,s:I,s:I,s:{s:f}}", "id_slot", j, "session", sid,
                                 "filename", fname, "n_restored", (json_int_t)st_image_n_tokens(img),
                                 "n_read", (json_int_t)sb.st_size, "timings", "restore_ms",
                                 st_api_ms(st_api_now_ms() - t0));
            c->status = 200;
        }
    }
    if (rc)
        st_api_call_fail(c, rc, action);
    st_image_free(img);
    slot_release(cv, j);
    return;
bad_slot:
    st_api_call_error(c, 404, "not_found", "no slot %s (slots are 0..%u)", c->arg2, cv->n_slots - 1);
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

void st_conv_list_live(st_conv *cv, json_t *arr)
{
    pthread_mutex_lock(&cv->mu);
    for (uint32_t i = 0; i < cv->n_slots; i++)
        if (cv->slots[i].bound)
            json_array_append_new(arr, json_pack("{s:s,s:s,s:I,s:I}", "id", cv->slots[i].id, "where", "slot",
                                                 "tokens", (json_int_t)cv->slots[i].tokens, "bytes",
                                                 (json_int_t)cv->slots[i].bytes));
    for (pentry *p = cv->head; p; p = p->next)
        json_array_append_new(arr, json_pack("{s:s,s:s,s:I,s:I}", "id", p->id, "where",
                                             p->img ? "ram" : "disk", "tokens", (json_int_t)p->tokens,
                                             "bytes", (json_int_t)p->bytes));
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
    if (h->slot >= 0) {
        st_slot_reset(cv->slots[h->slot].slot);
        pthread_mutex_lock(&cv->mu);
        cv->slots[h->slot].bound = 0;
        pthread_mutex_unlock(&cv->mu);
        slot_release(cv, h->slot);
    }
    pentry *p = h->entry;
    if (p) {
        pthread_mutex_lock(&cv->mu);
        park_remove_locked(cv, p);
        wake_locked(cv); /* the id is gone: its waiters start afresh */
        gauges_locked(cv);
        pthread_mutex_unlock(&cv->mu);
        park_drop(cv, p);
    }
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
    int rc = put_park(cv, id, img, NULL);
    if (rc != ST_EFULL)
        return rc;
    char first[512];
    snprintf(first, sizeof first, "%s", st_errdetail());
    int rc2 = 0;
    while (!rc2 && st_image_n_checkpoints(img) > 1)
        rc2 = st_image_checkpoint_remove(img, 0);
    st_put_opts po = {.compress = 1};
    if (!rc2 && !(rc2 = put_park(cv, id, img, &po))) {
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
        if (!st_api_id_valid(id, strlen(id)) || st_api_session_damaged(cv->srv, id))
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

/* POST /apply-template (llama.cpp's): the body of a chat request ({"messages": [...], "tools",
 * "add_generation_prompt" (default true), "chat_template_kwargs": {...}, any other key a
 * template variable) rendered by the model's chat template: {"prompt": "..."}. */
void st_conv_apply_template(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    if (!json_is_array(json_object_get(c->body, "messages"))) {
        st_api_call_error(c, 400, "invalid_field", "\"messages\" must be an array");
        return;
    }
    json_t *kw = json_object_get(c->body, "chat_template_kwargs");
    if (kw && !json_is_object(kw)) {
        st_api_call_error(c, 400, "invalid_field", "\"chat_template_kwargs\" must be an object");
        return;
    }
    json_t *vars = json_copy(c->body); /* shallow: the values are shared */
    if (!vars || (!json_object_get(vars, "add_generation_prompt") &&
                  json_object_set_new(vars, "add_generation_prompt", json_true())) ||
        (kw && (json_object_del(vars, "chat_template_kwargs") || json_object_update(vars, kw)))) {
        json_decref(vars);
        st_api_call_error(c, 500, "internal", "no memory");
        return;
    }
    char *out = NULL;
    size_t len = 0;
    int rc = st_chat_template_render(cv->chat, vars, &out, &len);
    json_decref(vars);
    if (rc) {
        st_api_call_error(c, 500, "template_error", "the chat template: %s", st_errdetail());
        return;
    }
    c->reply = json_pack("{s:s%}", "prompt", out, len);
    free(out);
    if (!c->reply) {
        st_api_call_error(c, 500, "internal", "no memory");
        return;
    }
    c->status = 200;
}

int st_conv_new(st_api_server *srv, st_conv **out)
{
    const st_api_config *cfg = st_api_cfg(srv);
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
    cv->srv = srv;
    cv->store = st_api_store(srv);
    cv->m = st_api_metrics(srv);
    cv->guard = st_api_memguard(srv);
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
        /* the CUDA backend runs strata-hybrid with f32 / f16 / bf16 weights only: every other
         * architecture and quantized weights run on the CPU */
        int cuda = st_codec_cuda_available() && !st_engine_cuda_check(st_model_gguf(cv->model));
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

#endif /* ST_API_HAVE_ENGINE */
