/*
 * st_prefix.c - the prefix index (st_prefix.h; docs/SCALE.md, "The prefix index").
 *
 * Invariants:
 * 1. A point's key names exactly what determines the state at p: the base (model fingerprint,
 *    geometry, backend, ubatch, the numeric path), the tokens [0, p) chained page by page, p,
 *    and the root split below p (the one chunk end of a full read that is not a multiple of
 *    ubatch). A resumed conversation is checked again after the restore: the image's tokens must
 *    be the prompt's (a key collision or a forged entry is refused, never continued).
 * 2. The table ents[] mirrors the store's "pfx:" sessions that this process knows of: every entry
 *    it lists was in the store when listed or put; one the store no longer has (deleted by hand,
 *    evicted by another process sharing the store) is dropped when a lookup misses it.
 * 3. Budget: after every insertion the least recently used unpinned entries are deleted from the
 *    store until the entries' logical bytes fit budget_bytes and their count max_entries. An entry
 *    is pinned while a lookup reads it (pins > 0), so a point being restored is never deleted
 *    under the reader.
 * 4. Nothing here fails a request: every error is counted (errors) and logged once per kind.
 * 5. Recording in the background: a request's worker only snapshots its points (the slot is
 *    read while the request still holds it) and queues the images; one recorder thread puts them
 *    into the store, into the table, evicts, and sends them to the tier, in the order queued. The
 *    queue holds at most RQ_MAX_BYTES of images (and never more than the budget); a point beyond
 *    is dropped (counted). A point queued or being put counts as held (record_one skips it).
 *    st_prefix_free puts what is queued before it returns; a crash loses it (the index is a
 *    cache: a lost point costs a full read, never a wrong answer).
 */
#include <errno.h>
#include <inttypes.h>
#include <openssl/evp.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_prefix.h"
#include "st_tiernode.h"

#define KEY_LEN 32
#define ID_LEN (sizeof ST_PREFIX_ID_PREFIX - 1 + 2 * KEY_LEN)

typedef struct pent {
    char id[ID_LEN + 1];
    uint64_t bytes, tick;
    unsigned pins;
} pent;

/* A point waiting for the recorder (invariant 5). */
#define RQ_MAX_BYTES (1ull << 30)
typedef struct rjob {
    struct rjob *next;
    st_image *img;
    uint64_t bytes;
    char id[ID_LEN + 1];
} rjob;

struct st_prefix {
    st_prefix_opts o;
    st_engine *e;
    st_store *store;
    st_tiernode *tier;
    const st_geometry *g;
    uint8_t base[KEY_LEN];
    uint32_t ubatch, page, root_min;
    int root_on; /* the engine takes root checkpoints */
    pthread_mutex_t mu;
    pent *ents;
    size_t n, cap;
    uint64_t tick;
    st_prefix_stats st;
    pthread_cond_t rcv;      /* invariant 5: a job queued, or stop */
    pthread_t rec;
    int rec_on, stop;
    rjob *rq_head, *rq_tail; /* the head is the job being put */
    uint64_t rq_bytes;
};

void st_prefix_opts_default(st_prefix_opts *o)
{
    memset(o, 0, sizeof *o);
    o->budget_bytes = 4ull << 30;
    o->max_entries = 4096;
    o->min_tokens = 256;
    o->codec = ST_CODEC_FP32;
}

/* ---- keys ----------------------------------------------------------------------------------- */
typedef struct sha {
    EVP_MD_CTX *c;
} sha;

static int sha_begin(sha *h)
{
    h->c = EVP_MD_CTX_new();
    return h->c && EVP_DigestInit_ex(h->c, EVP_sha256(), NULL) == 1 ? 0 : -1;
}
static void sha_add(sha *h, const void *p, size_t n) { (void)EVP_DigestUpdate(h->c, p, n); }
static void sha_u64(sha *h, uint64_t v)
{
    uint8_t b[8];
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)(v >> (8 * i));
    sha_add(h, b, 8);
}
static void sha_end(sha *h, uint8_t out[KEY_LEN])
{
    unsigned len = 0;
    (void)EVP_DigestFinal_ex(h->c, out, &len);
    EVP_MD_CTX_free(h->c);
    h->c = NULL;
}

static void sha_tokens(sha *h, const uint32_t *t, uint64_t n)
{
    uint8_t buf[1024];
    size_t k = 0;
    for (uint64_t i = 0; i < n; i++) {
        for (int b = 0; b < 4; b++)
            buf[k++] = (uint8_t)(t[i] >> (8 * b));
        if (k == sizeof buf) {
            sha_add(h, buf, k);
            k = 0;
        }
    }
    sha_add(h, buf, k);
}

/* The chain over the pages of tokens[0..n): chain[k] after the first k pages (chain[0] = base).
 * chain has n / page + 1 entries. */
static int key_chain(const st_prefix *px, const uint32_t *tokens, uint64_t n, uint8_t (*chain)[KEY_LEN])
{
    memcpy(chain[0], px->base, KEY_LEN);
    for (uint64_t k = 0; k < n / px->page; k++) {
        sha h;
        if (sha_begin(&h))
            return -1;
        sha_add(&h, chain[k], KEY_LEN);
        sha_tokens(&h, tokens + k * px->page, px->page);
        sha_end(&h, chain[k + 1]);
    }
    return 0;
}

/* The root split a full read of a prompt of n tokens with that system prompt has below p (0:
 * none): st_slot.c's read_range takes one at system_len when root checkpoints are on. */
static uint64_t root_below(const st_prefix *px, uint64_t system_len, uint64_t n, uint64_t p)
{
    int on = px->root_on && system_len >= px->root_min && system_len <= n;
    return on && system_len < p ? system_len : 0;
}

static int point_id(const st_prefix *px, const uint8_t (*chain)[KEY_LEN], const uint32_t *tokens,
                    uint64_t p, uint64_t root, char id[ID_LEN + 1])
{
    uint8_t key[KEY_LEN];
    sha h;
    if (sha_begin(&h))
        return -1;
    uint64_t full = p / px->page;
    sha_add(&h, chain[full], KEY_LEN);
    sha_tokens(&h, tokens + full * px->page, p - full * px->page);
    sha_u64(&h, p);
    sha_u64(&h, root);
    sha_end(&h, key);
    int k = snprintf(id, ID_LEN + 1, "%s", ST_PREFIX_ID_PREFIX);
    for (int i = 0; i < KEY_LEN; i++)
        k += snprintf(id + k, ID_LEN + 1 - (size_t)k, "%02x", key[i]);
    return 0;
}

static int make_base(st_prefix *px, const st_geometry *g)
{
    const st_engine_opts *eo = st_engine_opts_get(px->e);
    sha h;
    if (sha_begin(&h))
        return -1;
    sha_add(&h, "strata-prefix-1", 16);
    sha_add(&h, g->model_fp, sizeof g->model_fp);
    sha_u64(&h, g->page_size);
    sha_u64(&h, g->n_ctx);
    sha_u64(&h, g->n_vocab);
    sha_u64(&h, g->n_tensors);
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *t = &g->tensors[i];
        sha_add(&h, t->name, strnlen(t->name, sizeof t->name) + 1);
        sha_u64(&h, t->role);
        sha_u64(&h, t->dtype);
        sha_u64(&h, t->ndim);
        for (uint32_t d = 0; d < ST_TENSOR_NDIM_MAX; d++)
            sha_u64(&h, t->shape[d]);
    }
    const char *be = eo->backend ? eo->backend : "cpu";
    sha_add(&h, be, strlen(be) + 1);
    sha_u64(&h, eo->ubatch);
    sha_u64(&h, (uint64_t)eo->quant_f32);
    sha_end(&h, px->base);
    return 0;
}

/* ---- the table (under mu) ------------------------------------------------------------------- */
static pent *find_locked(st_prefix *px, const char *id)
{
    for (size_t i = 0; i < px->n; i++)
        if (!strcmp(px->ents[i].id, id))
            return &px->ents[i];
    return NULL;
}

static void remove_locked(st_prefix *px, pent *e)
{
    px->st.bytes -= e->bytes;
    *e = px->ents[--px->n];
    px->st.entries = px->n;
}

static int add_locked(st_prefix *px, const char *id, uint64_t bytes, uint64_t tick)
{
    pent *e = find_locked(px, id);
    if (e) {
        e->tick = tick;
        return 0;
    }
    if (px->n == px->cap) {
        size_t nc = px->cap ? 2 * px->cap : 64;
        pent *ne = realloc(px->ents, nc * sizeof *ne);
        if (!ne)
            return st_error_set(ENOMEM, "prefix index: %zu entries", nc);
        px->ents = ne;
        px->cap = nc;
    }
    e = &px->ents[px->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->id, sizeof e->id, "%s", id);
    e->bytes = bytes;
    e->tick = tick;
    px->st.bytes += bytes;
    px->st.entries = px->n;
    return 0;
}

/* Invariant 3: the victims' ids into out (malloc'd, *nv of them), removed from the table; the
 * caller deletes them from the store outside the lock. */
static void evict_locked(st_prefix *px, char (**out)[ID_LEN + 1], size_t *nv)
{
    *out = NULL;
    *nv = 0;
    while (px->st.bytes > px->o.budget_bytes || px->n > px->o.max_entries) {
        pent *v = NULL;
        for (size_t i = 0; i < px->n; i++)
            if (!px->ents[i].pins && (!v || px->ents[i].tick < v->tick))
                v = &px->ents[i];
        if (!v)
            break;
        char(*no)[ID_LEN + 1] = realloc(*out, (*nv + 1) * sizeof **out);
        if (!no)
            break;
        *out = no;
        memcpy((*out)[(*nv)++], v->id, ID_LEN + 1);
        remove_locked(px, v);
        px->st.evictions++;
    }
}

static void delete_all(st_prefix *px, char (*ids)[ID_LEN + 1], size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int rc = st_store_session_delete(px->store, ids[i]);
        if (rc && rc != ST_ENOTFOUND) {
            fprintf(stderr, "strata-server: prefix index: deleting %s: %s\n", ids[i], st_errdetail());
            pthread_mutex_lock(&px->mu);
            px->st.errors++;
            pthread_mutex_unlock(&px->mu);
        }
    }
    free(ids);
}

/* ---- life cycle ----------------------------------------------------------------------------- */
static int by_updated(const void *a, const void *b)
{
    uint64_t x = ((const st_session_info *)a)->updated_ns, y = ((const st_session_info *)b)->updated_ns;
    return x < y ? -1 : x > y;
}

static int load_existing(st_prefix *px)
{
    st_session_info *arr = NULL;
    size_t n = 0;
    int rc = st_store_list(px->store, &arr, &n);
    if (rc)
        return rc;
    size_t pl = strlen(ST_PREFIX_ID_PREFIX);
    /* oldest write first, so the ticks give the order of the last writes (st_prefix.h) */
    if (n > 1)
        qsort(arr, n, sizeof *arr, by_updated);
    for (size_t i = 0; i < n && !rc; i++) {
        if (strncmp(arr[i].id, ST_PREFIX_ID_PREFIX, pl) || arr[i].damaged ||
            strlen(arr[i].id) != ID_LEN)
            continue;
        st_version_info vi;
        if (st_store_version_info(px->store, arr[i].id, 0, &vi))
            continue;
        rc = add_locked(px, arr[i].id, vi.logical_bytes, ++px->tick);
    }
    free(arr);
    return rc;
}

static void count_error(st_prefix *px, const char *what, const char *id);

/* The recorder's part of a point (invariant 5): into the store, the table (evicting), the tier. */
static void put_point(st_prefix *px, rjob *j)
{
    uint64_t version = 0;
    int rc = st_store_put(px->store, j->id, j->img, ST_STORE_HEAD_NONE, NULL, &version);
    if (rc == ST_ECONFLICT) /* another process put it meanwhile */
        return;
    if (rc) {
        count_error(px, "recording", j->id);
        return;
    }
    char(*v)[ID_LEN + 1] = NULL;
    size_t nv = 0;
    pthread_mutex_lock(&px->mu);
    if (add_locked(px, j->id, j->bytes, ++px->tick))
        px->st.errors++;
    evict_locked(px, &v, &nv);
    pthread_mutex_unlock(&px->mu);
    delete_all(px, v, nv);
    if (px->tier) {
        uint64_t tv = 0;
        (void)st_tiernode_saved(px->tier, j->id, version, &tv);
    }
    pthread_mutex_lock(&px->mu); /* counted once it is everywhere it goes */
    px->st.records++;
    px->st.record_bytes += j->bytes;
    pthread_mutex_unlock(&px->mu);
}

static void *rec_main(void *arg)
{
    st_prefix *px = arg;
    pthread_mutex_lock(&px->mu);
    for (;;) {
        while (!px->rq_head && !px->stop)
            pthread_cond_wait(&px->rcv, &px->mu);
        rjob *j = px->rq_head;
        if (!j)
            break; /* stopped, and nothing is queued */
        pthread_mutex_unlock(&px->mu);
        put_point(px, j);
        st_image_free(j->img);
        j->img = NULL;
        pthread_mutex_lock(&px->mu);
        px->rq_head = j->next;
        if (!px->rq_head)
            px->rq_tail = NULL;
        px->rq_bytes -= j->bytes;
        px->st.queued--;
        free(j);
    }
    pthread_mutex_unlock(&px->mu);
    return NULL;
}

static int queued_locked(const st_prefix *px, const char *id)
{
    for (const rjob *j = px->rq_head; j; j = j->next)
        if (!strcmp(j->id, id))
            return 1;
    return 0;
}

int st_prefix_new(const st_prefix_opts *o, st_engine *e, const st_geometry *g, st_store *store,
                  st_tiernode *tier, st_prefix **out)
{
    *out = NULL;
    st_prefix *px = calloc(1, sizeof *px);
    if (!px)
        return st_error_set(ENOMEM, "prefix index");
    px->o = *o;
    px->e = e;
    px->store = store;
    px->tier = tier;
    px->g = g;
    const st_engine_opts *eo = st_engine_opts_get(e);
    px->ubatch = eo->ubatch;
    px->page = g->page_size;
    px->root_on = eo->prompt_cache && eo->prompt_cache_root;
    px->root_min = eo->prompt_cache_root;
    if (px->o.min_tokens < 1)
        px->o.min_tokens = 1;
    pthread_mutex_init(&px->mu, NULL);
    pthread_cond_init(&px->rcv, NULL);
    int rc = 0;
    if (!px->ubatch || !px->page || make_base(px, g))
        rc = st_error_set(ST_EINVAL, "prefix index: ubatch %u, page %u, or no SHA-256", px->ubatch,
                          px->page);
    if (!rc)
        rc = load_existing(px);
    if (!rc) {
        char(*v)[ID_LEN + 1];
        size_t nv;
        evict_locked(px, &v, &nv); /* a smaller budget than last time */
        delete_all(px, v, nv);
    }
    if (!rc) {
        int prc = pthread_create(&px->rec, NULL, rec_main, px);
        if (prc)
            rc = st_error_set(prc, "prefix index: the recorder's thread: %s", strerror(prc));
        else
            px->rec_on = 1;
    }
    if (rc) {
        st_prefix_free(px);
        return rc;
    }
    *out = px;
    return 0;
}

void st_prefix_free(st_prefix *px)
{
    if (!px)
        return;
    if (px->rec_on) { /* invariant 5: what is queued is put first */
        pthread_mutex_lock(&px->mu);
        px->stop = 1;
        pthread_cond_broadcast(&px->rcv);
        pthread_mutex_unlock(&px->mu);
        pthread_join(px->rec, NULL);
    }
    pthread_cond_destroy(&px->rcv);
    pthread_mutex_destroy(&px->mu);
    free(px->ents);
    free(px);
}

void st_prefix_stats_get(st_prefix *px, st_prefix_stats *out)
{
    pthread_mutex_lock(&px->mu);
    *out = px->st;
    pthread_mutex_unlock(&px->mu);
}

/* ---- lookup --------------------------------------------------------------------------------- */
static void count_error(st_prefix *px, const char *what, const char *id)
{
    fprintf(stderr, "strata-server: prefix index: %s %s: %s\n", what, id, st_errdetail());
    pthread_mutex_lock(&px->mu);
    px->st.errors++;
    pthread_mutex_unlock(&px->mu);
}

/* The candidates of a prompt of n tokens, deepest first: the multiples of ubatch and the root
 * split in (lo, limit] and at least min_tokens; returns how many went into c (room for
 * limit / ubatch + 2). */
static size_t candidates(const st_prefix *px, uint64_t n, uint64_t system_len, uint64_t lo,
                         uint64_t limit, uint64_t *c)
{
    size_t k = 0;
    uint64_t root = root_below(px, system_len, n, UINT64_MAX);
    int root_in = root && root > lo && root <= limit && root >= px->o.min_tokens;
    for (uint64_t p = limit / px->ubatch * px->ubatch; p > lo && p >= px->o.min_tokens && p > 0;
         p -= px->ubatch) {
        if (root_in && root > p) {
            c[k++] = root;
            root_in = 0;
        }
        if (p != root)
            c[k++] = p;
        else
            root_in = 0;
    }
    if (root_in)
        c[k++] = root;
    return k;
}

/* The point id in the local store, or fetched from the tier into it: 0 and *from_tier; else an
 * error (ST_ENOTFOUND: nowhere). *bytes: its logical bytes. */
static int locate(st_prefix *px, const char *id, int *from_tier, uint64_t *bytes)
{
    st_version_info vi;
    *from_tier = 0;
    int rc = st_store_version_info(px->store, id, 0, &vi);
    if (rc == ST_ENOTFOUND && px->tier) {
        int fetched = 0;
        st_tiernode_forget(px->tier, id); /* the store lacks it, whatever this node sent */
        int trc = st_tiernode_fetch(px->tier, id, px->o.budget_bytes, &fetched);
        if (trc && trc != ST_ENOTFOUND && trc != ST_EIO)
            count_error(px, "fetching", id);
        if (!trc && fetched) {
            *from_tier = 1;
            rc = st_store_version_info(px->store, id, 0, &vi);
        }
    }
    if (!rc)
        *bytes = vi.logical_bytes;
    return rc;
}

void st_prefix_resume(st_prefix *px, st_slot *s, const uint32_t *tokens, uint64_t n,
                      uint64_t system_len, uint64_t *at)
{
    *at = 0;
    if (n < 2 || n - 1 < px->o.min_tokens)
        return;
    uint64_t limit = n - 1;
    uint64_t *c = malloc((size_t)(limit / px->ubatch + 2) * sizeof *c);
    uint8_t(*chain)[KEY_LEN] = malloc((size_t)(limit / px->page + 1) * KEY_LEN);
    if (!c || !chain || key_chain(px, tokens, limit, chain)) {
        free(c);
        free(chain);
        return;
    }
    size_t nc = candidates(px, n, system_len, 0, limit, c);
    pthread_mutex_lock(&px->mu);
    px->st.lookups++;
    pthread_mutex_unlock(&px->mu);
    for (size_t i = 0; i < nc && !*at; i++) {
        char id[ID_LEN + 1];
        uint64_t p = c[i], bytes = 0;
        int from_tier = 0;
        if (point_id(px, (const uint8_t(*)[KEY_LEN])chain, tokens, p, root_below(px, system_len, n, p),
                     id))
            break;
        pthread_mutex_lock(&px->mu);
        pent *e = find_locked(px, id);
        if (e)
            e->pins++;
        pthread_mutex_unlock(&px->mu);
        int rc = locate(px, id, &from_tier, &bytes);
        st_image *img = NULL;
        if (!rc && px->o.admit)
            rc = px->o.admit(px->o.admit_arg, "restoring a point of the prefix index", bytes);
        if (!rc)
            rc = st_store_get(px->store, id, 0, &img);
        if (!rc && (st_image_n_tokens(img) != p ||
                    memcmp(st_image_tokens(img), tokens, (size_t)p * sizeof *tokens)))
            rc = st_error_set(ST_ECORRUPT, "the point's tokens are not the prompt's %" PRIu64, p);
        if (!rc)
            rc = st_slot_restore(s, img);
        st_image_free(img);
        pthread_mutex_lock(&px->mu);
        e = find_locked(px, id);
        if (e && e->pins)
            e->pins--;
        if (!rc) {
            *at = p;
            px->st.hits++;
            px->st.hit_tokens += p;
            px->st.tier_hits += from_tier;
            if (add_locked(px, id, bytes, ++px->tick))
                px->st.errors++;
        } else if (e && !e->pins && (rc == ST_ENOTFOUND || rc == ST_ECORRUPT ||
                                     rc == ST_EMODEL || rc == ST_EGEOMETRY)) {
            remove_locked(px, e); /* invariant 2; a damaged one is deleted below */
        }
        char(*v)[ID_LEN + 1] = NULL;
        size_t nv = 0;
        if (!rc)
            evict_locked(px, &v, &nv);
        pthread_mutex_unlock(&px->mu);
        delete_all(px, v, nv);
        if (rc && rc != ST_ENOTFOUND) {
            count_error(px, "restoring", id);
            st_slot_reset(s);
            if (rc == ST_ECORRUPT || rc == ST_EMODEL || rc == ST_EGEOMETRY)
                (void)st_store_session_delete(px->store, id);
        }
    }
    pthread_mutex_lock(&px->mu);
    if (!*at)
        px->st.misses++;
    pthread_mutex_unlock(&px->mu);
    free(c);
    free(chain);
}

/* ---- recording ------------------------------------------------------------------------------ */
/* Put the point at p (its id) unless the index or the store has it; 1 when the slot has no state
 * there (try another), 0 otherwise (recorded, present, or an error counted). */
static int record_one(st_prefix *px, st_slot *s, uint64_t p, const char *id)
{
    pthread_mutex_lock(&px->mu);
    pent *e = find_locked(px, id);
    if (e)
        e->tick = ++px->tick;
    int held = e || queued_locked(px, id);
    pthread_mutex_unlock(&px->mu);
    if (held)
        return 0;
    st_version_info vi;
    if (!st_store_version_info(px->store, id, 0, &vi)) { /* put by another process */
        pthread_mutex_lock(&px->mu);
        (void)add_locked(px, id, vi.logical_bytes, ++px->tick);
        pthread_mutex_unlock(&px->mu);
        return 0;
    }
    st_image *img = NULL;
    int rc = 0;
    if (px->o.admit) { /* the image's size, from the geometry */
        uint64_t need = p * 4;
        for (uint32_t ti = 0; ti < px->g->n_tensors; ti++) {
            const st_tensor_desc *t = &px->g->tensors[ti];
            need += t->role == ST_ROLE_KV ? p * st_tensor_row_bytes(t)
                                          : st_tensor_stored_bytes(t, px->o.codec);
        }
        if ((rc = px->o.admit(px->o.admit_arg, "recording a point of the prefix index", need))) {
            count_error(px, "recording", id);
            return 0;
        }
    }
    rc = st_slot_snapshot_prefix(s, p, px->o.codec, &img);
    if (rc == ST_ENOTFOUND)
        return 1;
    uint64_t bytes = img ? st_image_bytes(img) : 0;
    if (!rc && bytes > px->o.budget_bytes)
        rc = st_error_set(ST_ETOOBIG, "%" PRIu64 " bytes, more than the index's budget", bytes);
    rjob *j = NULL;
    if (!rc && !(j = calloc(1, sizeof *j)))
        rc = st_error_set(ENOMEM, "a point's job");
    if (rc) {
        st_image_free(img);
        count_error(px, "recording", id);
        return 0;
    }
    j->img = img;
    j->bytes = bytes;
    snprintf(j->id, sizeof j->id, "%s", id);
    uint64_t cap = px->o.budget_bytes < RQ_MAX_BYTES ? px->o.budget_bytes : RQ_MAX_BYTES;
    pthread_mutex_lock(&px->mu);
    int room = px->rq_bytes + bytes <= cap; /* invariant 5 */
    if (room) {
        if (px->rq_tail)
            px->rq_tail->next = j;
        else
            px->rq_head = j;
        px->rq_tail = j;
        px->rq_bytes += bytes;
        px->st.queued++;
        pthread_cond_signal(&px->rcv);
    } else {
        px->st.dropped++;
    }
    pthread_mutex_unlock(&px->mu);
    if (!room) {
        st_image_free(img);
        free(j);
    }
    return 0;
}

void st_prefix_record(st_prefix *px, st_slot *s, uint64_t n, uint64_t system_len, uint64_t from)
{
    uint64_t held = st_slot_n_tokens(s);
    if (n > held || n < px->o.min_tokens)
        return;
    const uint32_t *tokens = st_slot_tokens(s);
    uint64_t *c = malloc((size_t)(n / px->ubatch + 2) * sizeof *c);
    uint8_t(*chain)[KEY_LEN] = malloc((size_t)(n / px->page + 1) * KEY_LEN);
    if (!c || !chain || key_chain(px, tokens, n, chain)) {
        free(c);
        free(chain);
        return;
    }
    size_t nc = candidates(px, n, system_len, from, n, c);
    /* the deepest point the slot has a state for, and the system prompt's: its root checkpoint,
     * or without root checkpoints the deepest multiple of ubatch within it */
    uint64_t root = root_below(px, system_len, n, UINT64_MAX);
    int deepest = 0, sys = !system_len;
    for (size_t i = 0; i < nc && !(deepest && sys); i++) {
        uint64_t p = c[i];
        int sys_point = system_len && (root ? p == root : p <= system_len);
        if (deepest && !(sys_point && !sys))
            continue;
        char id[ID_LEN + 1];
        if (point_id(px, (const uint8_t(*)[KEY_LEN])chain, tokens, p,
                     root_below(px, system_len, n, p), id))
            break;
        if (record_one(px, s, p, id))
            continue; /* no state held there */
        deepest = 1;
        if (sys_point)
            sys = 1;
    }
    free(c);
    free(chain);
}
