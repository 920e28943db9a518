/*
 * st_store_scan.c - the server's start-up scan of a store: which sessions a damaged data.mdb
 * leaves unreadable, so that the server quarantines them and serves the rest. Runs inside the
 * child process of st_store_scan (st_store_contain.c).
 *
 * Invariants:
 * 1. The page walk (st_store_pages.c) runs first, on the file. Damage to the meta pages, the free
 *    list, the main database or the meta database is the whole store's: the scan fails with
 *    ST_ECORRUPT naming the page and the remedy, and the server does not start on it.
 * 2. Damage inside the sessions, versions, chunks or refcounts database covers a key range (from
 *    the page's parent) widened down to the last key of the good leaf before it, since a cursor
 *    that walks up to that key steps into the damaged page next. The scan never reads a key in
 *    such a range through LMDB: a point lookup of any other key does not enter the page, and a
 *    cursor walks only a session whose keys lie outside every range.
 * 3. A session is damaged when its record or its key range is damaged, its record does not parse,
 *    its head version is missing, a manifest is damaged, or a chunk it names is in a damaged range,
 *    missing, of another length than recorded, or has a damaged overflow header. Chunk bytes are
 *    not read (check --read-data does that; a restore verifies them anyway).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_store_lmdb_int.h"

enum { DB_SESSIONS, DB_VERSIONS, DB_CHUNKS, DB_REFCOUNTS, DB_N };
static const char *const db_names[DB_N] = {"sessions", "versions", "chunks", "refcounts"};

typedef struct key_copy {
    uint8_t *p;
    size_t n;
    int has;
} key_copy;

typedef struct bad_range {
    int db;
    key_copy lo, hi; /* lo: the widened lower bound */
} bad_range;

typedef struct scan_ctx {
    bad_range *r;
    size_t n, cap;
    int fatal, nomem;
    char fatal_msg[600];
    st_store_scan_stats *stats;
} scan_ctx;

static key_copy key_dup(const uint8_t *p, size_t n, int has, int *nomem)
{
    key_copy k = {NULL, n, has};
    if (has && !(k.p = malloc(n ? n : 1)))
        *nomem = 1;
    else if (has)
        memcpy(k.p, p, n);
    return k;
}

static void on_page(void *arg, const st_page_problem *p)
{
    scan_ctx *c = arg;
    int db = -1;
    for (int i = 0; i < DB_N; i++)
        if (!strcmp(p->db, db_names[i]))
            db = i;
    if (db < 0) {
        if (!c->fatal)
            snprintf(c->fatal_msg, sizeof c->fatal_msg, "data.mdb page %llu (%s): %s",
                     (unsigned long long)p->pgno, p->db, p->message);
        c->fatal = 1;
        return;
    }
    c->stats->damaged_dbs |= 1u << db;
    c->stats->damaged_pages++;
    if (c->n == c->cap) {
        size_t cap = c->cap ? 2 * c->cap : 16;
        bad_range *nr = realloc(c->r, cap * sizeof *nr);
        if (!nr) {
            c->nomem = 1;
            return;
        }
        c->r = nr;
        c->cap = cap;
    }
    const st_page_range *pr = &p->range;
    bad_range *b = &c->r[c->n++];
    b->db = db;
    b->lo = pr->has_prev ? key_dup(pr->prev, pr->prev_len, 1, &c->nomem)
                         : key_dup(pr->lo, pr->lo_len, pr->has_lo, &c->nomem);
    b->hi = key_dup(pr->hi, pr->hi_len, pr->has_hi, &c->nomem);
}

static int kcmp(const uint8_t *a, size_t al, const uint8_t *b, size_t bl)
{
    int c = memcmp(a, b, al < bl ? al : bl);
    return c ? c : al < bl ? -1 : al > bl;
}

/* Whether [a, b) (b NULL: a alone) meets a damaged range of db. */
static int range_bad(const scan_ctx *c, int db, const uint8_t *a, size_t al, const uint8_t *b, size_t bl)
{
    for (size_t i = 0; i < c->n; i++) {
        const bad_range *r = &c->r[i];
        if (r->db != db)
            continue;
        int below_hi = !r->hi.has || kcmp(a, al, r->hi.p, r->hi.n) < 0;
        int above_lo = !r->lo.has || (b ? kcmp(r->lo.p, r->lo.n, b, bl) < 0 : kcmp(r->lo.p, r->lo.n, a, al) <= 0);
        if (below_hi && above_lo)
            return 1;
    }
    return 0;
}

typedef struct id_list {
    char (*id)[ST_STORE_ID_MAX + 1];
    size_t n, cap;
} id_list;

static int id_add(id_list *l, const void *p, size_t n)
{
    if (n == 0 || n > ST_STORE_ID_MAX)
        return 0;
    if (l->n && strlen(l->id[l->n - 1]) == n && !memcmp(l->id[l->n - 1], p, n))
        return 0;
    if (l->n == l->cap) {
        size_t cap = l->cap ? 2 * l->cap : 64;
        void *ni = realloc(l->id, cap * sizeof *l->id);
        if (!ni)
            return st_error_set(ENOMEM, "scan: no memory for the list of sessions");
        l->id = ni;
        l->cap = cap;
    }
    memcpy(l->id[l->n], p, n);
    l->id[l->n++][n] = '\0';
    return 0;
}

/* The ids the store holds: from the sessions database when it is undamaged, else from the
 * versions keys (every session with a version). */
static int collect_ids(st_store *st, MDB_txn *txn, const scan_ctx *c, id_list *l)
{
    int from_sessions = !(c->stats->damaged_dbs & 1u << DB_SESSIONS);
    if (!from_sessions && (c->stats->damaged_dbs & 1u << DB_VERSIONS))
        return st_error_set(ST_ECORRUPT, "the sessions and versions databases are both damaged: which sessions exist "
                            "cannot be told");
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    int rc = mdb_cursor_open(txn, from_sessions ? st->dbi_sessions : st->dbi_versions, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &k, &v, op)))
            break;
        size_t n = k.mv_size;
        if (!from_sessions) {
            const uint8_t *z = memchr(k.mv_data, 0, k.mv_size);
            n = z ? (size_t)(z - (const uint8_t *)k.mv_data) : 0;
        }
        rc = id_add(l, k.mv_data, n);
    }
    if (cur)
        mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

/* Why session id is damaged ("" when it is not); lmdb errors other than damage are returned. */
static int session_scan(st_store *st, MDB_txn *txn, const scan_ctx *c, const char *id, char *why, size_t cap)
{
    size_t idlen = strlen(id);
    uint8_t lo[ST_VKEY_MAX], hi[ST_VKEY_MAX];
    memcpy(lo, id, idlen);
    memcpy(hi, id, idlen);
    lo[idlen] = 0;
    hi[idlen] = 1;
    why[0] = '\0';
    if (range_bad(c, DB_SESSIONS, (const uint8_t *)id, idlen, NULL, 0)) {
        snprintf(why, cap, "its record lies in a damaged page of the sessions database");
        return 0;
    }
    if (range_bad(c, DB_VERSIONS, lo, idlen + 1, hi, idlen + 1)) {
        snprintf(why, cap, "its versions lie in a damaged page of the versions database");
        return 0;
    }
    MDB_val k = {idlen, (void *)id}, v;
    st_session_rec rec;
    int rc = mdb_get(txn, st->dbi_sessions, &k, &v);
    if (rc == MDB_NOTFOUND) {
        snprintf(why, cap, "it has versions but no session record");
        return 0;
    }
    if (rc)
        return rc;
    if (st_store__value_check(st, &v, "its record") || st_session_parse(v.mv_data, v.mv_size, id, &rec)) {
        snprintf(why, cap, "%s", st_errdetail());
        return 0;
    }
    MDB_cursor *cur = NULL;
    int head_seen = 0;
    if ((rc = mdb_cursor_open(txn, st->dbi_versions, &cur)))
        return rc;
    MDB_val vk = {idlen + 1, lo}, vv;
    for (rc = mdb_cursor_get(cur, &vk, &vv, MDB_SET_RANGE); !rc && !why[0];
         rc = mdb_cursor_get(cur, &vk, &vv, MDB_NEXT)) {
        uint64_t ver;
        if (!st_vkey_of(vk.mv_data, vk.mv_size, id, idlen, &ver))
            break;
        char what[ST_STORE_ID_MAX + 64];
        snprintf(what, sizeof what, "version %llu", (unsigned long long)ver);
        st_manifest m;
        if (st_store__value_check(st, &vv, what) || st_manifest_parse(vv.mv_data, vv.mv_size, what, &m)) {
            snprintf(why, cap, "%s", st_errdetail());
            break;
        }
        head_seen |= ver == rec.head;
        for (uint32_t i = 0; i < m.n_chunks && !why[0]; i++) {
            const st_mchunk *ch = &m.chunks[i];
            char hex[2 * ST_STORE_HASH_LEN + 1];
            st_hex_encode(hex, ch->hash, ST_STORE_HASH_LEN);
            if (range_bad(c, DB_CHUNKS, ch->hash, ST_STORE_HASH_LEN, NULL, 0) ||
                range_bad(c, DB_REFCOUNTS, ch->hash, ST_STORE_HASH_LEN, NULL, 0)) {
                snprintf(why, cap, "version %llu: chunk %s lies in a damaged page", (unsigned long long)ver, hex);
                break;
            }
            MDB_val ck = {ST_STORE_HASH_LEN, (void *)ch->hash}, cv;
            int g = mdb_get(txn, st->dbi_chunks, &ck, &cv);
            if (g && g != MDB_NOTFOUND) {
                rc = g;
                break;
            }
            if (g == MDB_NOTFOUND)
                snprintf(why, cap, "version %llu: chunk %s is missing", (unsigned long long)ver, hex);
            else if (cv.mv_size != ch->stored_len)
                snprintf(why, cap, "version %llu: chunk %s holds %zu bytes, %u recorded", (unsigned long long)ver, hex,
                         cv.mv_size, ch->stored_len);
            else if (st_store__value_check(st, &cv, hex))
                snprintf(why, cap, "version %llu: %s", (unsigned long long)ver, st_errdetail());
        }
        st_manifest_free(&m);
    }
    mdb_cursor_close(cur);
    if (rc && rc != MDB_NOTFOUND)
        return rc;
    if (!why[0] && rec.head && !head_seen)
        snprintf(why, cap, "its head version %llu is missing", (unsigned long long)rec.head);
    return 0;
}

int st_store__scan(const char *dir, const st_store_opts *opts, st_store_damaged_fn damaged, void *arg,
                   st_store_scan_stats *stats)
{
    char path[4200];
    scan_ctx c;
    id_list ids = {NULL, 0, 0};
    st_store *st = NULL;
    MDB_txn *txn = NULL;
    memset(&c, 0, sizeof c);
    memset(stats, 0, sizeof *stats);
    c.stats = stats;
    int rc = st_path(path, sizeof path, dir, "data.mdb");
    st_page_stats ps;
    if (!rc)
        rc = st_store__pages_check(path, 0, 0, on_page, &c, &ps);
    if (!rc && c.nomem)
        rc = st_error_set(ENOMEM, "scan: no memory for the damaged pages");
    if (!rc && c.fatal)
        rc = st_error_set(ST_ECORRUPT, "%s; the store is damaged: restore a backup with `statectl restore-backup`",
                          c.fatal_msg);
    if (rc)
        goto done;
    stats->pages = ps.pages;
    if ((rc = st_store_open(&st, dir, opts)))
        goto done;
    pthread_rwlock_rdlock(&st->lock);
    rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = collect_ids(st, txn, &c, &ids);
    for (size_t i = 0; i < ids.n && !rc; i++) {
        char why[600];
        stats->sessions++;
        if ((rc = session_scan(st, txn, &c, ids.id[i], why, sizeof why)))
            break;
        if (why[0]) {
            stats->damaged++;
            damaged(arg, ids.id[i], why);
        }
    }
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    rc = st_store__edge(rc, "scanning the store");
done:
    st_store_close(st);
    for (size_t i = 0; i < c.n; i++) {
        free(c.r[i].lo.p);
        free(c.r[i].hi.p);
    }
    free(c.r);
    free(ids.id);
    return rc;
}
