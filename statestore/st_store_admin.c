/*
 * st_store_admin.c - the LMDB store's maintenance: gc, check, stat, hot backup and restore.
 *
 * Invariants:
 * 1. gc deletes only chunks whose count entry is zero, each batch in its own write transaction;
 *    a put takes its references in the transaction that finds the chunk, so no batch can free a
 *    chunk a committed manifest names. Readers keep their snapshot (LMDB MVCC).
 * 2. check's structural pass runs in one read snapshot (manifests, counts and chunks agree with
 *    each other there or nowhere); the data pass re-reads chunks in bounded batches and hashes
 *    them with no transaction open.
 * 3. A backup or restored copy is written into a temporary sibling directory, fsynced, opened
 *    and checked with read_data; it is renamed into place only when the check finds nothing, and
 *    the temporary directory is removed on any failure.
 * 4. A restored copy of an older-schema backup is upgraded (by the caller's function: the schema
 *    steps live in migrations/) inside that temporary directory, before its check, so the
 *    destination only ever receives a checked store of this build's schema.
 */
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

#define ST_GC_BATCH 4096u
#define ST_GC_SCAN 65536u
#define ST_READ_BATCH_BYTES (64u << 20)
#define ST_READ_BATCH_CHUNKS 4096u

/* The edge of check and gc, whose positive codes all come from LMDB calls (errno). */
static int lmdb_or(int rc, const char *what)
{
    return rc > 0 ? st_store__lmdb_err(rc, what) : st_store__edge(rc, what);
}

/* ---- gc ----------------------------------------------------------------------------------------- */

typedef struct st_gc_ctx {
    uint8_t start[ST_STORE_HASH_LEN]; /* resume after this key (inclusive when first) */
    int first, done;
    uint8_t next[ST_STORE_HASH_LEN];
    uint64_t freed, bytes;
} st_gc_ctx;

static int gc_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_gc_ctx *c = arg;
    MDB_cursor *cur = NULL;
    uint8_t (*zero)[ST_STORE_HASH_LEN] = NULL;
    uint32_t nz = 0, scanned = 0;
    c->freed = c->bytes = 0;
    c->done = 0;
    int rc = mdb_cursor_open(txn, st->dbi_refcounts, &cur);
    if (rc)
        return rc;
    if (!(zero = malloc(ST_GC_BATCH * sizeof *zero))) {
        mdb_cursor_close(cur);
        return st_error_set(ENOMEM, "gc: no memory");
    }
    MDB_val k = {ST_STORE_HASH_LEN, c->start}, v;
    rc = mdb_cursor_get(cur, &k, &v, c->first ? MDB_FIRST : MDB_SET_RANGE);
    if (!rc && !c->first && k.mv_size == ST_STORE_HASH_LEN && !memcmp(k.mv_data, c->start, ST_STORE_HASH_LEN))
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    for (; !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        if (k.mv_size != ST_STORE_HASH_LEN)
            continue; /* check reports it */
        memcpy(c->next, k.mv_data, ST_STORE_HASH_LEN);
        if (v.mv_size == 8 && st_get64(v.mv_data) == 0)
            memcpy(zero[nz++], k.mv_data, ST_STORE_HASH_LEN);
        if (nz == ST_GC_BATCH || ++scanned == ST_GC_SCAN)
            break;
    }
    if (rc == MDB_NOTFOUND) {
        c->done = 1;
        rc = 0;
    }
    mdb_cursor_close(cur);
    for (uint32_t i = 0; i < nz && !rc; i++) {
        MDB_val zk = {ST_STORE_HASH_LEN, zero[i]}, zv;
        int g = mdb_get(txn, st->dbi_chunks, &zk, &zv);
        if (g == 0) {
            c->bytes += zv.mv_size;
            rc = st_store__value_check(st, &zv, "gc: a chunk"); /* LMDB frees the pages its header says */
            if (!rc)
                rc = mdb_del(txn, st->dbi_chunks, &zk, NULL);
        } else if (g != MDB_NOTFOUND) {
            rc = g;
        }
        if (!rc)
            rc = mdb_del(txn, st->dbi_refcounts, &zk, NULL);
        if (!rc)
            c->freed++;
    }
    free(zero);
    return rc;
}

/* Orphans: what a check reported as chunks without a count entry that no manifest names. */
typedef struct st_orphans {
    uint8_t (*hash)[ST_STORE_HASH_LEN];
    size_t n, cap, done;
    int unsafe;         /* a manifest could not be read: its references are unknown */
    int nomem;
    uint64_t freed, bytes;
} st_orphans;

static void orphan_collect(void *arg, const st_check_problem *p)
{
    st_orphans *o = arg;
    if (p->kind == ST_CHECK_MANIFEST)
        o->unsafe = 1;
    if (p->kind != ST_CHECK_ORPHAN_CHUNK || strlen(p->chunk) != 2 * ST_STORE_HASH_LEN)
        return;
    if (o->n == o->cap) {
        size_t cap = o->cap ? o->cap * 2 : 64;
        void *h = realloc(o->hash, cap * sizeof *o->hash);
        if (!h) {
            o->nomem = 1;
            return;
        }
        o->hash = h;
        o->cap = cap;
    }
    if (st_hex_decode(o->hash[o->n], p->chunk, ST_STORE_HASH_LEN))
        return;
    o->n++;
}

/* Delete up to ST_GC_BATCH orphans, each only if it still has no count entry. */
static int orphan_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_orphans *o = arg;
    int rc = 0;
    o->freed = o->bytes = 0;
    for (size_t i = o->done; i < o->n && i < o->done + ST_GC_BATCH && !rc; i++) {
        MDB_val k = {ST_STORE_HASH_LEN, o->hash[i]}, v;
        rc = mdb_get(txn, st->dbi_refcounts, &k, &v);
        if (rc == 0) /* a put took a reference meanwhile */
            continue;
        if (rc != MDB_NOTFOUND)
            break;
        rc = mdb_get(txn, st->dbi_chunks, &k, &v);
        if (rc == MDB_NOTFOUND) {
            rc = 0;
            continue;
        }
        uint64_t len = v.mv_size;
        if (!rc)
            rc = st_store__value_check(st, &v, "gc: an orphan chunk");
        if (!rc)
            rc = mdb_del(txn, st->dbi_chunks, &k, NULL);
        if (!rc) {
            o->freed++;
            o->bytes += len;
        }
    }
    return rc;
}

static int gc_orphans(st_store *st, st_gc_stats *total)
{
    st_orphans o;
    memset(&o, 0, sizeof o);
    int rc = st_store_check(st, 0, orphan_collect, &o, NULL);
    if (!rc && o.nomem)
        rc = st_error_set(ENOMEM, "gc: no memory for the list of orphan chunks");
    while (!rc && !o.unsafe && o.done < o.n) {
        if ((rc = st_store__write(st, orphan_fn, &o)))
            break;
        total->orphans_freed += o.freed;
        total->bytes_freed += o.bytes;
        o.done += ST_GC_BATCH;
    }
    free(o.hash);
    return rc;
}

int st_store_gc(st_store *st, st_gc_stats *out)
{
    st_gc_ctx c;
    st_gc_stats total = {0, 0, 0};
    memset(&c, 0, sizeof c);
    if (!st)
        return st_error_set(ST_EINVAL, "gc: no store");
    int prc = st_store__pages_require(st, "gc"); /* its cursors walk whole databases */
    if (prc)
        return prc;
    c.first = 1;
    for (;;) {
        int rc = st_store__write(st, gc_fn, &c);
        if (rc)
            return rc;
        total.chunks_freed += c.freed;
        total.bytes_freed += c.bytes;
        st_store__progress(st, "gc", total.chunks_freed, 0);
        if (c.done)
            break;
        memcpy(c.start, c.next, ST_STORE_HASH_LEN);
        c.first = 0;
    }
    int rc = gc_orphans(st, &total);
    if (rc)
        return rc;
    if (out)
        *out = total;
    return 0;
}

/* ---- check -------------------------------------------------------------------------------------- */

typedef struct st_ref {
    uint8_t hash[ST_STORE_HASH_LEN];
    uint64_t refs;
    uint64_t xxh;
    uint64_t version;   /* first reference, for messages */
    uint32_t sess;
    uint32_t stored_len, raw_len;
    uint8_t used, in_chunks, counted;
} st_ref;

typedef struct st_sess {
    char id[ST_STORE_ID_MAX + 1];
    st_session_rec rec;
    int ok;
    uint64_t seen, max;
    int geo_state;            /* 0 not read, 1 decoded, -1 unreadable */
    st_geometry g;
    st_tensor_desc *gt;
} st_sess;

typedef struct st_checker {
    st_store *st;
    void (*report)(void *arg, const st_check_problem *p);
    void *arg;
    st_check_result res;
    st_ref *tab;
    size_t cap, used;
    st_sess *sess;
    size_t n_sess;
    uint64_t total_stored;
} st_checker;

static void problem(st_checker *k, uint32_t kind, const char *session, uint64_t version, const uint8_t *hash,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static void problem(st_checker *k, uint32_t kind, const char *session, uint64_t version, const uint8_t *hash,
                    const char *fmt, ...)
{
    char msg[768];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    st_check_problem p = {.kind = kind, .session = session ? session : "", .version = version, .message = msg};
    if (hash)
        st_hex_encode(p.chunk, hash, ST_STORE_HASH_LEN);
    k->res.problems++;
    if (k->report)
        k->report(k->arg, &p);
}

static size_t ref_slot(const st_checker *k, const uint8_t *hash)
{
    uint64_t h;
    memcpy(&h, hash, sizeof h);
    return (size_t)(h & (k->cap - 1));
}

static st_ref *ref_find(st_checker *k, const uint8_t *hash)
{
    if (!k->cap)
        return NULL;
    for (size_t i = ref_slot(k, hash);; i = (i + 1) & (k->cap - 1)) {
        st_ref *r = &k->tab[i];
        if (!r->used)
            return NULL;
        if (!memcmp(r->hash, hash, ST_STORE_HASH_LEN))
            return r;
    }
}

static int ref_grow(st_checker *k)
{
    size_t cap = k->cap ? k->cap * 2 : 4096;
    st_ref *old = k->tab, *tab = calloc(cap, sizeof *tab);
    if (!tab)
        return st_error_set(ENOMEM, "check: no memory for %zu chunk references", cap);
    size_t old_cap = k->cap;
    k->tab = tab;
    k->cap = cap;
    for (size_t i = 0; i < old_cap; i++) {
        if (!old[i].used)
            continue;
        size_t j = ref_slot(k, old[i].hash);
        while (tab[j].used)
            j = (j + 1) & (cap - 1);
        tab[j] = old[i];
    }
    free(old);
    return 0;
}

static int ref_add(st_checker *k, const uint8_t *hash, st_ref **out)
{
    if ((k->used + 1) * 4 > k->cap * 3) {
        int rc = ref_grow(k);
        if (rc)
            return rc;
    }
    size_t i = ref_slot(k, hash);
    for (;; i = (i + 1) & (k->cap - 1)) {
        st_ref *r = &k->tab[i];
        if (!r->used) {
            r->used = 1;
            memcpy(r->hash, hash, ST_STORE_HASH_LEN);
            k->used++;
            *out = r;
            return 0;
        }
        if (!memcmp(r->hash, hash, ST_STORE_HASH_LEN)) {
            *out = r;
            return 0;
        }
    }
}

static int sess_cmp(const void *a, const void *b)
{
    return strcmp(((const st_sess *)a)->id, ((const st_sess *)b)->id);
}

static st_sess *sess_find(st_checker *k, const char *id)
{
    st_sess key;
    snprintf(key.id, sizeof key.id, "%s", id);
    return bsearch(&key, k->sess, k->n_sess, sizeof *k->sess, sess_cmp);
}

static const char *ref_session(const st_checker *k, const st_ref *r)
{
    return r && r->sess < k->n_sess ? k->sess[r->sess].id : "";
}

static int check_sessions(st_checker *k, MDB_txn *txn)
{
    MDB_cursor *cur = NULL;
    MDB_val key, v;
    size_t cap = 0;
    int rc = mdb_cursor_open(txn, k->st->dbi_sessions, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &key, &v, op)))
            break;
        if (k->n_sess == cap) {
            cap = cap ? cap * 2 : 64;
            st_sess *ns = realloc(k->sess, cap * sizeof *ns);
            if (!ns) {
                rc = st_error_set(ENOMEM, "check: no memory");
                break;
            }
            k->sess = ns;
        }
        st_sess *s = &k->sess[k->n_sess];
        memset(s, 0, sizeof *s);
        k->res.sessions++;
        if (key.mv_size == 0 || key.mv_size > ST_STORE_ID_MAX) {
            problem(k, ST_CHECK_SESSION, "", 0, NULL, "sessions database holds a key of %zu bytes", key.mv_size);
            continue;
        }
        memcpy(s->id, key.mv_data, key.mv_size);
        s->id[key.mv_size] = '\0';
        k->n_sess++;
        if (!st_store_id_valid(s->id)) {
            problem(k, ST_CHECK_SESSION, s->id, 0, NULL, "session id is not valid");
            continue;
        }
        if (st_session_parse(v.mv_data, v.mv_size, s->id, &s->rec) != 0) {
            problem(k, ST_CHECK_SESSION, s->id, 0, NULL, "%s", st_errdetail());
            continue;
        }
        s->ok = 1;
    }
    if (cur)
        mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (!rc && k->n_sess)
        qsort(k->sess, k->n_sess, sizeof *k->sess, sess_cmp);
    return rc;
}

/* The session's geometry, decoded from its geometry chunk in txn (once per session). */
static const st_geometry *sess_geometry(st_checker *k, MDB_txn *txn, st_sess *s)
{
    if (s->geo_state == 0) {
        MDB_val key = {ST_STORE_HASH_LEN, s->rec.geometry_digest}, v;
        s->geo_state = -1;
        if (mdb_get(txn, k->st->dbi_chunks, &key, &v) == 0 && st_geometry_decode(v.mv_data, v.mv_size, &s->g, &s->gt) == 0)
            s->geo_state = 1;
    }
    return s->geo_state == 1 ? &s->g : NULL;
}

static int check_versions(st_checker *k, MDB_txn *txn)
{
    MDB_cursor *cur = NULL;
    MDB_val key, v;
    int rc = mdb_cursor_open(txn, k->st->dbi_versions, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &key, &v, op)))
            break;
        char id[ST_STORE_ID_MAX + 1], what[ST_STORE_ID_MAX + 64];
        uint64_t ver = 0;
        k->res.versions++;
        if (st_vkey_parse(key.mv_data, key.mv_size, id, &ver) != 0) {
            problem(k, ST_CHECK_MANIFEST, "", 0, NULL, "%s", st_errdetail());
            continue;
        }
        st_sess *s = sess_find(k, id);
        if (!s) {
            problem(k, ST_CHECK_MANIFEST, id, ver, NULL, "version %llu of session %s has no session record",
                    (unsigned long long)ver, id);
        } else if (s->ok) {
            s->seen++;
            if (ver > s->max)
                s->max = ver;
            if (ver >= s->rec.next_version)
                problem(k, ST_CHECK_SESSION, id, ver, NULL, "version %llu is not below the session's next version %llu",
                        (unsigned long long)ver, (unsigned long long)s->rec.next_version);
        }
        snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)ver);
        st_manifest m;
        if (st_manifest_parse(v.mv_data, v.mv_size, what, &m) != 0) {
            problem(k, ST_CHECK_MANIFEST, id, ver, NULL, "%s", st_errdetail());
            continue;
        }
        if (m.version != ver)
            problem(k, ST_CHECK_MANIFEST, id, ver, NULL, "%s: manifest says version %llu", what,
                    (unsigned long long)m.version);
        if (s && s->ok) {
            if (!m.n_chunks || memcmp(m.chunks[0].hash, s->rec.geometry_digest, ST_STORE_HASH_LEN))
                problem(k, ST_CHECK_MANIFEST, id, ver, m.n_chunks ? m.chunks[0].hash : NULL,
                        "%s: its geometry is not the session's", what);
            const st_geometry *g = sess_geometry(k, txn, s);
            if (g && st_store__manifest_layout_check(&m, g, what) != 0)
                problem(k, ST_CHECK_MANIFEST, id, ver, NULL, "%s", st_errdetail());
        }
        for (uint32_t i = 0; i < m.n_chunks && !rc; i++) {
            const st_mchunk *c = &m.chunks[i];
            st_ref *r = NULL;
            if ((rc = ref_add(k, c->hash, &r)))
                break;
            if (r->refs == 0) {
                r->xxh = c->xxh;
                r->stored_len = c->stored_len;
                r->raw_len = c->raw_len;
                r->sess = s ? (uint32_t)(s - k->sess) : UINT32_MAX;
                r->version = ver;
            } else if (r->stored_len != c->stored_len || r->xxh != c->xxh || r->raw_len != c->raw_len) {
                problem(k, ST_CHECK_MANIFEST, id, ver, c->hash,
                        "%s: chunk recorded with length %u/%u, checksum %016llx; session %s version %llu says "
                        "%u/%u, %016llx", what, c->stored_len, c->raw_len, (unsigned long long)c->xxh,
                        ref_session(k, r), (unsigned long long)r->version, r->stored_len, r->raw_len,
                        (unsigned long long)r->xxh);
            }
            r->refs++;
        }
        st_manifest_free(&m);
    }
    if (cur)
        mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static void check_session_totals(st_checker *k, MDB_txn *txn)
{
    for (size_t i = 0; i < k->n_sess; i++) {
        st_sess *s = &k->sess[i];
        if (!s->ok)
            continue;
        if (s->seen != s->rec.n_versions || s->max != s->rec.head)
            problem(k, ST_CHECK_SESSION, s->id, 0, NULL,
                    "session %s records %llu versions with head %llu; the store holds %llu with newest %llu", s->id,
                    (unsigned long long)s->rec.n_versions, (unsigned long long)s->rec.head,
                    (unsigned long long)s->seen, (unsigned long long)s->max);
        for (uint32_t l = 0; l < s->rec.n_labels; l++) {
            uint8_t kb[ST_VKEY_MAX];
            MDB_val key = {st_vkey(kb, s->id, s->rec.labels[l].version), kb}, v;
            if (mdb_get(txn, k->st->dbi_versions, &key, &v) != 0)
                problem(k, ST_CHECK_SESSION, s->id, s->rec.labels[l].version, NULL,
                        "label \"%s\" names version %llu, which does not exist", s->rec.labels[l].name,
                        (unsigned long long)s->rec.labels[l].version);
        }
    }
}

static int check_chunks(st_checker *k, MDB_txn *txn)
{
    MDB_cursor *cur = NULL;
    MDB_val key, v;
    int rc = mdb_cursor_open(txn, k->st->dbi_chunks, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &key, &v, op)))
            break;
        k->res.chunks++;
        k->total_stored += v.mv_size;
        if (key.mv_size != ST_STORE_HASH_LEN) {
            problem(k, ST_CHECK_ORPHAN_CHUNK, "", 0, NULL, "chunks database holds a key of %zu bytes", key.mv_size);
            continue;
        }
        st_ref *r = ref_find(k, key.mv_data);
        MDB_val cv;
        int have_count = mdb_get(txn, k->st->dbi_refcounts, &key, &cv) == 0;
        if (!r) {
            if (!have_count)
                problem(k, ST_CHECK_ORPHAN_CHUNK, "", 0, key.mv_data, "chunk of %zu bytes has no reference count",
                        v.mv_size);
            continue;
        }
        r->in_chunks = 1;
        if (v.mv_size != r->stored_len)
            problem(k, ST_CHECK_CORRUPT_CHUNK, ref_session(k, r), r->version, key.mv_data,
                    "chunk holds %zu bytes; session %s version %llu recorded %u", v.mv_size, ref_session(k, r),
                    (unsigned long long)r->version, r->stored_len);
    }
    if (cur)
        mdb_cursor_close(cur);
    return rc == MDB_NOTFOUND ? 0 : rc;
}

static int check_refcounts(st_checker *k, MDB_txn *txn)
{
    MDB_cursor *cur = NULL;
    MDB_val key, v;
    int rc = mdb_cursor_open(txn, k->st->dbi_refcounts, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &key, &v, op)))
            break;
        k->res.refcounts++;
        if (key.mv_size != ST_STORE_HASH_LEN || v.mv_size != 8) {
            problem(k, ST_CHECK_REFCOUNT, "", 0, NULL, "refcounts entry with a %zu-byte key and %zu-byte value",
                    key.mv_size, v.mv_size);
            continue;
        }
        uint64_t cnt = st_get64(v.mv_data);
        st_ref *r = ref_find(k, key.mv_data);
        uint64_t refs = r ? r->refs : 0;
        if (r)
            r->counted = 1;
        MDB_val cv;
        int have_chunk = mdb_get(txn, k->st->dbi_chunks, &key, &cv) == 0;
        if (cnt != refs) {
            problem(k, ST_CHECK_REFCOUNT, ref_session(k, r), r ? r->version : 0, key.mv_data,
                    "count %llu, but manifests hold %llu references", (unsigned long long)cnt,
                    (unsigned long long)refs);
        } else if (cnt == 0) {
            if (have_chunk)
                k->res.zero_count_chunks++;
            else
                problem(k, ST_CHECK_REFCOUNT, "", 0, key.mv_data, "count 0 for a chunk the store lacks");
        }
    }
    if (cur)
        mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND)
        rc = 0;
    for (size_t i = 0; !rc && i < k->cap; i++) {
        st_ref *r = &k->tab[i];
        if (!r->used)
            continue;
        if (!r->in_chunks)
            problem(k, ST_CHECK_MISSING_CHUNK, ref_session(k, r), r->version, r->hash,
                    "session %s version %llu names a chunk the store lacks (%llu references)", ref_session(k, r),
                    (unsigned long long)r->version, (unsigned long long)r->refs);
        else if (!r->counted)
            problem(k, ST_CHECK_REFCOUNT, ref_session(k, r), r->version, r->hash,
                    "no count entry, but manifests hold %llu references", (unsigned long long)r->refs);
    }
    return rc;
}

static int check_meta(st_checker *k, MDB_txn *txn)
{
    const char *keys[] = {ST_META_SCHEMA, ST_META_KEEP_LAST};
    for (int i = 0; i < 2; i++) {
        MDB_val key = {strlen(keys[i]), (void *)keys[i]}, v;
        int rc = mdb_get(txn, k->st->dbi_meta, &key, &v);
        if (rc && rc != MDB_NOTFOUND)
            return rc;
        if (rc || v.mv_size != 4) {
            problem(k, ST_CHECK_META, "", 0, NULL, "meta \"%s\" is missing or not 4 bytes", keys[i]);
            continue;
        }
        uint32_t x = st_get32(v.mv_data);
        if (i == 0 && x != ST_STORE_SCHEMA)
            problem(k, ST_CHECK_META, "", 0, NULL, "schema %u; this build checks schema %u", x, ST_STORE_SCHEMA);
        if (i == 1 && x == 0)
            problem(k, ST_CHECK_META, "", 0, NULL, "keep_last is 0");
    }
    MDB_val key = {strlen(ST_META_MIGRATING), ST_META_MIGRATING}, v;
    if (mdb_get(txn, k->st->dbi_meta, &key, &v) == 0)
        problem(k, ST_CHECK_META, "", 0, NULL, "a schema migration was interrupted: run `statectl migrate`");
    return 0;
}

/* The data pass: chunks in batches, hashed with no transaction open. */
typedef struct st_rd_item {
    uint8_t key[ST_STORE_HASH_LEN];
    uint8_t *data;
    size_t len;
    int bad_sha, bad_xxh, bad_frame;
} st_rd_item;

typedef struct st_rd_batch {
    st_checker *k;
    st_rd_item *items;
} st_rd_batch;

static int rd_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_rd_batch *b = ctx;
    st_rd_item *it = &b->items[i];
    uint8_t h[ST_STORE_HASH_LEN];
    int rc = st_sha256(it->data, it->len, h);
    if (rc)
        return rc;
    it->bad_sha = memcmp(h, it->key, ST_STORE_HASH_LEN) != 0;
    st_ref *r = ref_find(b->k, it->key);
    if (r) {
        it->bad_xxh = st_checksum(it->data, it->len) != r->xxh;
        if (!it->bad_sha && r->stored_len < r->raw_len && r->stored_len == it->len) {
            if (!*fctx && !(*fctx = st_frame_ctx_new()))
                return st_error_set(ENOMEM, "check: no memory for a decompression context");
            uint8_t *out = malloc(r->raw_len);
            size_t n = 0;
            if (!out)
                return st_error_set(ENOMEM, "check: no memory");
            it->bad_frame = st_frame_decode(*fctx, out, r->raw_len, it->data, it->len, &n) != 0 || n != r->raw_len;
            free(out);
        }
    }
    return 0;
}

static int check_data(st_checker *k)
{
    st_store *st = k->st;
    uint8_t last[ST_STORE_HASH_LEN];
    int first = 1, rc = 0;
    st_rd_item *items = calloc(ST_READ_BATCH_CHUNKS, sizeof *items);
    if (!items)
        return st_error_set(ENOMEM, "check: no memory");
    uint64_t done_bytes = 0;
    for (int end = 0; !end && !rc;) {
        size_t n = 0, bytes = 0;
        MDB_txn *txn = NULL;
        MDB_cursor *cur = NULL;
        pthread_rwlock_rdlock(&st->lock);
        rc = st_store__rtxn(st, &txn);
        if (!rc)
            rc = mdb_cursor_open(txn, st->dbi_chunks, &cur);
        MDB_val key = {ST_STORE_HASH_LEN, last}, v;
        if (!rc) {
            rc = mdb_cursor_get(cur, &key, &v, first ? MDB_FIRST : MDB_SET_RANGE);
            if (!rc && !first && key.mv_size == ST_STORE_HASH_LEN && !memcmp(key.mv_data, last, ST_STORE_HASH_LEN))
                rc = mdb_cursor_get(cur, &key, &v, MDB_NEXT);
        }
        for (; !rc; rc = mdb_cursor_get(cur, &key, &v, MDB_NEXT)) {
            if (key.mv_size != ST_STORE_HASH_LEN)
                continue;
            st_ref *r = ref_find(k, key.mv_data);
            if (r && v.mv_size != r->stored_len)
                continue; /* the structural pass reported its length */
            if (st_store__value_check(st, &v, "check: a chunk")) {
                problem(k, ST_CHECK_CORRUPT_CHUNK, ref_session(k, r), r ? r->version : 0, key.mv_data, "%s",
                        st_errdetail());
                continue;
            }
            st_rd_item *it = &items[n];
            memset(it, 0, sizeof *it);
            memcpy(it->key, key.mv_data, ST_STORE_HASH_LEN);
            it->len = v.mv_size;
            if (!(it->data = malloc(v.mv_size ? v.mv_size : 1))) {
                rc = st_error_set(ENOMEM, "check: no memory for a chunk of %zu bytes", v.mv_size);
                break;
            }
            memcpy(it->data, v.mv_data, v.mv_size);
            memcpy(last, key.mv_data, ST_STORE_HASH_LEN);
            first = 0;
            n++;
            bytes += v.mv_size;
            if (n == ST_READ_BATCH_CHUNKS || bytes >= ST_READ_BATCH_BYTES)
                break;
        }
        if (rc == MDB_NOTFOUND) {
            rc = 0;
            end = 1;
        }
        if (cur)
            mdb_cursor_close(cur);
        if (txn)
            mdb_txn_abort(txn);
        pthread_rwlock_unlock(&st->lock);
        if (!rc && n) {
            st_rd_batch b = {k, items};
            rc = st_store__par_run(bytes < (4u << 20) ? 1 : st->threads, n, rd_one, &b);
        }
        for (size_t i = 0; i < n; i++) {
            st_rd_item *it = &items[i];
            if (!rc) {
                st_ref *r = ref_find(k, it->key);
                k->res.chunks_read++;
                k->res.bytes_read += it->len;
                if (it->bad_sha)
                    problem(k, ST_CHECK_CORRUPT_CHUNK, ref_session(k, r), r ? r->version : 0, it->key,
                            "chunk's bytes do not hash to its key (SHA-256 mismatch); used by session %s version %llu",
                            r ? ref_session(k, r) : "(none)", (unsigned long long)(r ? r->version : 0));
                else if (it->bad_xxh)
                    problem(k, ST_CHECK_CORRUPT_CHUNK, ref_session(k, r), r ? r->version : 0, it->key,
                            "chunk's XXH3 differs from what its manifests recorded");
                else if (it->bad_frame)
                    problem(k, ST_CHECK_CORRUPT_CHUNK, ref_session(k, r), r ? r->version : 0, it->key,
                            "chunk's compressed frame does not decode to %u bytes", r ? r->raw_len : 0);
            }
            free(it->data);
            it->data = NULL;
        }
        done_bytes += bytes;
        st_store__progress(st, "read", done_bytes, k->total_stored);
    }
    free(items);
    return rc;
}

/* The page pass: data.mdb's pages as LMDB would read them, walked from the file in the snapshot
 * txn holds. A problem there stops the check before any pass through LMDB (which trusts pages). */
static void page_problem(void *arg, const st_page_problem *pp)
{
    st_checker *k = arg;
    char msg[768];
    snprintf(msg, sizeof msg, "data.mdb page %llu (%s): %s; the store is damaged: restore a backup with `statectl "
             "restore-backup`", (unsigned long long)pp->pgno, pp->db, pp->message);
    st_check_problem p = {.kind = ST_CHECK_PAGE, .session = "", .message = msg, .page = pp->pgno};
    k->res.problems++;
    if (k->report)
        k->report(k->arg, &p);
}

static int check_pages(st_checker *k, MDB_txn *txn)
{
    char path[4200];
    MDB_stat ms;
    int rc = st_path(path, sizeof path, k->st->dir, "data.mdb");
    if (!rc)
        rc = mdb_env_stat(k->st->env, &ms);
    if (!rc)
        rc = st_store__pages_check(path, ms.ms_psize, mdb_txn_id(txn), page_problem, k, NULL);
    return rc;
}

/* Every version, reassembled as a restore reassembles it, must hash to the state hash it recorded
 * (st_image.h, "the state hash"): chunk checksums alone cannot see a version that was stored
 * whole but with a hash that is not its own, acknowledged and never restorable. A version that
 * does not reassemble is a problem here only when the earlier passes found none (earlier: their
 * count), which otherwise named its cause. */
static int check_state_hashes(st_checker *k, uint64_t earlier)
{
    st_store *st = k->st;
    int rc = 0;
    for (size_t i = 0; i < k->n_sess && !rc; i++) {
        const char *id = k->sess[i].id;
        st_version_info *vs = NULL;
        size_t n = 0;
        if (!k->sess[i].ok)
            continue; /* reported by the structure pass */
        int lrc = st_store_versions(st, id, &vs, &n);
        if (lrc == ENOMEM || lrc == ST_EBUSY) {
            rc = lrc;
            break;
        }
        if (lrc) {
            if (lrc != ST_ENOTFOUND && !earlier) /* ST_ENOTFOUND: deleted since the snapshot */
                problem(k, ST_CHECK_STATE_HASH, id, 0, NULL, "the versions of session %s cannot be "
                        "read: %s", id, st_errdetail());
            continue;
        }
        for (size_t j = 0; j < n && !rc; j++) {
            st_image *img = NULL;
            uint64_t h = 0, want = vs[j].state_hash, ver = vs[j].version;
            if (!want)
                continue; /* no hash recorded: nothing to verify */
            int grc = st_store_get(st, id, ver, &img);
            if (!grc && !(grc = st_image_state_hash_compute(img, st_store__state_hash_runner,
                                                            &st->threads, &h)))
                k->res.versions_hashed++;
            st_image_free(img);
            if (grc == ENOMEM || grc == ST_EBUSY)
                rc = grc;
            else if (grc == ST_ENOTFOUND)
                continue; /* deleted since its listing */
            else if (grc && !earlier)
                problem(k, ST_CHECK_STATE_HASH, id, ver, NULL, "session %s version %llu does not "
                        "reassemble: %s", id, (unsigned long long)ver, st_errdetail());
            else if (!grc && h != want)
                problem(k, ST_CHECK_STATE_HASH, id, ver, NULL, "session %s version %llu: state hash "
                        "mismatch: recorded %016llx, its image hashes to %016llx (a restore fails)",
                        id, (unsigned long long)ver, (unsigned long long)want,
                        (unsigned long long)h);
        }
        free(vs);
        st_store__progress(st, "state hash", i + 1, k->n_sess);
    }
    return rc;
}

/* st_store_check; hashes: also the state-hash pass (with read_data). */
static int check_run(st_store *st, int read_data, int hashes,
                     void (*report)(void *arg, const st_check_problem *p), void *arg, st_check_result *res)
{
    st_checker k;
    MDB_txn *txn = NULL;
    memset(&k, 0, sizeof k);
    if (!st)
        return st_error_set(ST_EINVAL, "check: no store");
    if (!st->have_refcounts || st->schema != ST_STORE_SCHEMA)
        return st_error_set(ST_EVERSION, "check: store schema %u; this build checks schema %u", st->schema,
                            ST_STORE_SCHEMA);
    k.st = st;
    k.report = report;
    k.arg = arg;
    st_store__progress(st, "check", 0, 5);
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = check_pages(&k, txn);
    int damaged = k.res.problems != 0;
    if (!rc && !damaged)
        rc = check_meta(&k, txn);
    if (!rc && !damaged)
        rc = check_sessions(&k, txn);
    if (!rc && !damaged)
        rc = check_versions(&k, txn);
    if (!rc && !damaged)
        check_session_totals(&k, txn);
    if (!rc && !damaged)
        rc = check_chunks(&k, txn);
    if (!rc && !damaged)
        rc = check_refcounts(&k, txn);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    st_store__progress(st, "check", 5, 5);
    if (!rc && read_data && !damaged)
        rc = check_data(&k);
    if (!rc && read_data && hashes && !damaged)
        rc = check_state_hashes(&k, k.res.problems);
    for (size_t i = 0; i < k.n_sess; i++)
        free(k.sess[i].gt);
    free(k.sess);
    free(k.tab);
    if (rc)
        return lmdb_or(rc, "checking the store");
    if (res)
        *res = k.res;
    return 0;
}

int st_store_check(st_store *st, int read_data, void (*report)(void *arg, const st_check_problem *p), void *arg,
                   st_check_result *res)
{
    return check_run(st, read_data, read_data, report, arg, res);
}

/* ---- stat ---------------------------------------------------------------------------------------- */

static int cmp_pgno(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return (x > y) - (x < y);
}

/* The longest run of consecutive page numbers among n distinct ones (sorts pg). */
static uint64_t free_run_max(size_t *pg, size_t n)
{
    uint64_t best = 0, run = 0;
    if (n < 2)
        return n;
    qsort(pg, n, sizeof *pg, cmp_pgno);
    for (size_t i = 0; i < n; i++) {
        run = i && pg[i] == pg[i - 1] + 1 ? run + 1 : 1;
        if (run > best)
            best = run;
    }
    return best;
}

int st_store_stat(st_store *st, st_store_stats *out)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    size_t *free_pgs = NULL, n_free = 0, cap_free = 0;
    st_store_stats s;
    memset(&s, 0, sizeof s);
    if (!st || !out)
        return st_error_set(ST_EINVAL, "stat: bad arguments");
    int rc = st_store__pages_require(st, "stat"); /* its cursors walk whole databases */
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    rc = st_store__rtxn(st, &txn);
    if (rc)
        goto done;
    /* the newest commit's last page (LMDB gives no snapshot's): read as the snapshot starts */
    MDB_envinfo info;
    mdb_env_info(st->env, &info);
    s.pages_used = (uint64_t)info.me_last_pgno + 1;
    int direct = 0;
    const char *why = st_store__direct_status(st, &direct);
    snprintf(s.put_path, sizeof s.put_path, "%s%s", direct ? "fast path" : "plain mdb_put: ", why);
    s.map_size = info.me_mapsize;
    MDB_stat ms;
    if ((rc = mdb_stat(txn, st->dbi_sessions, &ms)))
        goto done;
    s.sessions = ms.ms_entries;
    s.page_size = ms.ms_psize;
    if ((rc = mdb_cursor_open(txn, st->dbi_versions, &cur)))
        goto done;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        s.versions++;
        const uint8_t *p = v.mv_data;
        if (v.mv_size >= ST_MANIFEST_HDR && st_get32(p) == ST_MANIFEST_MAGIC) {
            s.logical_bytes += st_get64(p + 40);
            s.referenced_bytes += st_get64(p + 48);
        }
    }
    mdb_cursor_close(cur);
    cur = NULL;
    if (rc != MDB_NOTFOUND || (rc = mdb_cursor_open(txn, st->dbi_chunks, &cur)))
        goto done;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        s.chunks++;
        s.stored_bytes += v.mv_size;
    }
    mdb_cursor_close(cur);
    cur = NULL;
    if (rc != MDB_NOTFOUND || (rc = mdb_cursor_open(txn, st->dbi_refcounts, &cur)))
        goto done;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        if (v.mv_size == 8 && st_get64(v.mv_data) == 0) {
            MDB_val cv;
            s.zero_count_chunks++;
            if (mdb_get(txn, st->dbi_chunks, &k, &cv) == 0)
                s.zero_count_bytes += cv.mv_size;
        }
    }
    mdb_cursor_close(cur);
    cur = NULL;
    /* LMDB's free list (database 0): each value is a page-number list led by its length. The
     * lists of all entries are gathered (8 bytes a free page) for the longest run. */
    if (rc != MDB_NOTFOUND || (rc = mdb_cursor_open(txn, 0, &cur)))
        goto done;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        size_t cnt = 0;
        if (v.mv_size >= sizeof(size_t))
            memcpy(&cnt, v.mv_data, sizeof cnt);
        if (cnt > v.mv_size / sizeof(size_t) - 1) {
            rc = st_error_set(ST_ECORRUPT, "stat: a free-list entry claims %zu pages in %zu bytes", cnt,
                              v.mv_size);
            goto done;
        }
        if (!cnt)
            continue;
        if (n_free + cnt > cap_free) {
            size_t cap = (n_free + cnt) * 2;
            size_t *grown = realloc(free_pgs, cap * sizeof *grown);
            if (!grown) {
                rc = st_error_set(ENOMEM, "stat: no memory for a free list of %zu pages", n_free + cnt);
                goto done;
            }
            free_pgs = grown;
            cap_free = cap;
        }
        memcpy(free_pgs + n_free, (const size_t *)v.mv_data + 1, cnt * sizeof *free_pgs);
        n_free += cnt;
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
    s.pages_free = n_free;
    s.pages_free_run = free_run_max(free_pgs, n_free);
done:
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    free(free_pgs);
    if (rc)
        return lmdb_or(rc, "reading store statistics");
    s.file_bytes = st_store__file_bytes(st->dir);
    s.schema = st->schema;
    s.keep_last = st->keep_last;
    s.budget = st->opts.budget;
    if (!s.budget) {
        uint64_t avail = 0;
        if (st->sys.disk_free(st->dir, &avail) == 0)
            s.budget = (s.file_bytes + avail / 4 * 3) / (1u << 20) * (1u << 20);
    }
    s.dedup_ratio = s.stored_bytes ? (double)s.referenced_bytes / (double)s.stored_bytes : 1.0;
    *out = s;
    return 0;
}

/* ---- copies: backup and restore ------------------------------------------------------------------ */

int st_store__fsync_dir(const st_store_sys *sys, const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return st_error_set(errno, "opening directory %s: %s", dir, strerror(errno));
    int rc = sys->fsync(fd) != 0 ? errno : 0;
    close(fd);
    if (rc)
        return st_error_set(rc == ENOSPC ? ST_EFULL : rc, "fsync of directory %s: %s", dir, strerror(rc));
    return 0;
}

void st_store__remove_env_dir(const char *dir)
{
    char path[4200];
    if (!st_path(path, sizeof path, dir, "data.mdb"))
        st_sys_calls.unlink(path);
    if (!st_path(path, sizeof path, dir, "lock.mdb"))
        st_sys_calls.unlink(path);
    st_sys_calls.rmdir(dir);
}

static int sys_err(int e, const char *what, const char *path)
{
    if (e == ENOSPC || e == EDQUOT)
        return st_error_set(ST_EFULL, "%s %s: the disk is full (%s)", what, path, strerror(e));
    return st_error_set(e ? e : ST_EIO, "%s %s: %s", what, path, strerror(e ? e : EIO));
}

/* Write all of buf through sys; 0 or an errno. */
static int write_all(const st_store_sys *sys, int fd, const uint8_t *buf, size_t n)
{
    while (n) {
        ssize_t w = sys->write(fd, buf, n);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return w < 0 ? errno : EIO;
        buf += w;
        n -= (size_t)w;
    }
    return 0;
}

typedef struct st_copy_writer {
    const st_store *st;
    int in_fd, out_fd;
    int err;
    uint64_t bytes, total;
} st_copy_writer;

/* Drain the pipe LMDB writes its copy into; after an error keep draining (so LMDB never blocks
 * or meets a closed pipe) but write nothing more. */
static void *copy_writer(void *arg)
{
    st_copy_writer *w = arg;
    uint8_t *buf = malloc(1u << 20);
    if (!buf)
        w->err = ENOMEM;
    uint8_t small[4096];
    for (;;) {
        ssize_t r = read(w->in_fd, buf ? buf : small, buf ? (1u << 20) : sizeof small);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            if (!w->err)
                w->err = errno;
            break;
        }
        if (r == 0)
            break;
        if (!w->err)
            w->err = write_all(w->st->opts.sys, w->out_fd, buf, (size_t)r);
        w->bytes += (uint64_t)r;
        st_store__progress(w->st, "copy", w->bytes, w->total);
    }
    if (!w->err && w->st->opts.sys->fsync(w->out_fd) != 0)
        w->err = errno ? errno : EIO;
    free(buf);
    return NULL;
}

int st_store__copy_env(st_store *st, const char *dest_dir)
{
    char path[4200];
    int pfd[2] = {-1, -1}, out = -1, rc = 0;
    if ((rc = st_path(path, sizeof path, dest_dir, "data.mdb")))
        return rc;
    out = st->sys.open(path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (out < 0)
        return sys_err(errno, "creating", path);
    if (pipe2(pfd, O_CLOEXEC) != 0) {
        rc = st_error_set(errno, "backup: pipe: %s", strerror(errno));
        goto done;
    }
    MDB_envinfo info;
    MDB_stat ms;
    mdb_env_info(st->env, &info);
    mdb_env_stat(st->env, &ms);
    st_copy_writer w = {.st = st, .in_fd = pfd[0], .out_fd = out,
                        .total = ((uint64_t)info.me_last_pgno + 1) * ms.ms_psize};
    pthread_t tid;
    if (pthread_create(&tid, NULL, copy_writer, &w) != 0) {
        rc = st_error_set(EAGAIN, "backup: cannot start the writer thread");
        goto done;
    }
    pthread_rwlock_rdlock(&st->lock);
    int lrc = mdb_env_copyfd2(st->env, pfd[1], MDB_CP_COMPACT);
    pthread_rwlock_unlock(&st->lock);
    close(pfd[1]);
    pfd[1] = -1;
    pthread_join(tid, NULL);
    if (w.err)
        rc = sys_err(w.err, "writing the copy", path);
    else if (lrc)
        rc = st_store__lmdb_err(lrc, "copying the environment");
done:
    if (pfd[0] >= 0)
        close(pfd[0]);
    if (pfd[1] >= 0)
        close(pfd[1]);
    if (out >= 0 && st_sys_calls.close(out) != 0 && !rc)
        rc = sys_err(errno, "closing", path);
    if (rc)
        st_sys_calls.unlink(path);
    return rc;
}

/* dest must not exist, or be an empty directory. */
static int dest_ok(const char *dest)
{
    struct stat sb;
    if (stat(dest, &sb) != 0)
        return errno == ENOENT ? 0 : st_error_set(errno, "%s: %s", dest, strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return st_error_set(ST_EINVAL, "%s exists and is not a directory", dest);
    DIR *d = opendir(dest);
    if (!d)
        return st_error_set(errno, "%s: %s", dest, strerror(errno));
    struct dirent *e;
    int empty = 1;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            empty = 0;
    closedir(d);
    return empty ? 0 : st_error_set(ST_EINVAL, "%s exists and is not empty", dest);
}

static void parent_of(const char *path, char *dst, size_t cap)
{
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s", path);
    snprintf(dst, cap, "%s", dirname(tmp));
}

typedef struct st_first_problem {
    char text[600];
    uint64_t n;
} st_first_problem;

static void first_problem(void *arg, const st_check_problem *p)
{
    st_first_problem *f = arg;
    if (f->n++ == 0)
        snprintf(f->text, sizeof f->text, "%s%s%s", p->chunk[0] ? p->chunk : "", p->chunk[0] ? ": " : "",
                 p->message);
}

/* Open the copy in dir (read-only, no lock file: nobody else uses it) and check it fully.
 * *schema (may be NULL) gets its schema. A newer schema than this build's is refused; an older
 * one too unless old_ok, which returns 0 without checking it (its records are not this build's:
 * the caller checks the copy once it is upgraded). */
static int check_copy(const char *dir, const st_store_sys *sys, st_store_progress_fn progress, void *arg,
                      const char *what, int old_ok, uint32_t *schema)
{
    st_store *cp = NULL;
    st_store_opts o = {.read_only = 1, .sys = sys, .progress = progress, .progress_arg = arg};
    int rc = st_store__open_any(&cp, dir, &o, MDB_RDONLY | MDB_NOLOCK);
    if (rc)
        return st_error_wrap(rc, "%s does not open", what);
    if (schema)
        *schema = cp->schema;
    if (cp->schema > ST_STORE_SCHEMA)
        rc = st_error_set(ST_EVERSION, "%s: store schema %u is newer than this build's %u", what, cp->schema,
                          ST_STORE_SCHEMA);
    else if (cp->schema < ST_STORE_SCHEMA && !old_ok)
        rc = st_error_set(ST_EVERSION, "%s is of store schema %u, older than this build's %u: `statectl "
                          "restore-backup` (st_schema_restore_backup) restores and migrates it", what,
                          cp->schema, ST_STORE_SCHEMA);
    else if (cp->schema == ST_STORE_SCHEMA && !cp->have_refcounts)
        rc = st_error_set(ST_ECORRUPT, "%s (schema %u) lacks its \"refcounts\" database", what, cp->schema);
    if (rc || cp->schema < ST_STORE_SCHEMA) {
        st_store_close(cp);
        return rc;
    }
    st_first_problem fp;
    st_check_result res;
    memset(&fp, 0, sizeof fp);
    /* every byte is read and checked; not the state hashes, which are the content's, copied as it
     * is: a version that cannot restore does not make the others of a copy unusable */
    rc = check_run(cp, 1, 0, first_problem, &fp, &res);
    st_store_close(cp);
    if (rc)
        return st_error_wrap(rc, "checking %s", what);
    if (res.problems)
        return st_error_set(ST_ECORRUPT, "%s fails its check: %llu problems, the first: %s", what,
                            (unsigned long long)res.problems, fp.text);
    return 0;
}

/* The temp directory a copy is made in before it is renamed to dest: common's temp name of dest. */
static int tmp_sibling(const char *dest, char *tmp, size_t cap)
{
    char base[4200];
    size_t n = strlen(dest);
    while (n > 1 && dest[n - 1] == '/')
        n--;
    if (n >= sizeof base)
        return st_error_set(ST_EINVAL, "path too long: %s", dest);
    memcpy(base, dest, n);
    base[n] = '\0';
    if (st_replace_tmp_next(tmp, cap, base))
        return st_error_set(ST_EINVAL, "path too long: %s", dest);
    return 0;
}

/* Rename the checked copy into place and make the rename durable. */
static int publish(const st_store_sys *sys, const char *tmp, const char *dest)
{
    char parent[4200];
    int rc = st_store__fsync_dir(sys, tmp);
    if (rc)
        return rc;
    if (sys->rename(tmp, dest) != 0)
        return sys_err(errno, "renaming the copy to", dest);
    parent_of(dest, parent, sizeof parent);
    return st_store__fsync_dir(sys, parent);
}

int st_store_backup(st_store *st, const char *dest_dir)
{
    char tmp[4200];
    if (!st || !dest_dir || !*dest_dir)
        return st_error_set(ST_EINVAL, "backup: no store or destination");
    int rc = dest_ok(dest_dir);
    if (!rc)
        rc = tmp_sibling(dest_dir, tmp, sizeof tmp);
    if (!rc)
        rc = st_store__pages_require(st, "backup"); /* the compacting copy walks every database */
    if (rc)
        return rc;
    st_store__remove_env_dir(tmp); /* a leftover of a crashed process that had this pid */
    if (st->sys.mkdir(tmp, 0755) != 0)
        return sys_err(errno, "creating", tmp);
    rc = st_store__copy_env(st, tmp);
    if (!rc)
        rc = check_copy(tmp, &st->sys, st->opts.progress, st->opts.progress_arg, "the backup copy", 0, NULL);
    if (!rc)
        rc = publish(&st->sys, tmp, dest_dir);
    if (rc) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_store__remove_env_dir(tmp);
        st_error_set(rc, "%s", d);
    }
    return rc;
}

static int copy_file(const st_store_sys *sys, const char *from, const char *to, const st_store_opts *o)
{
    int in = open(from, O_RDONLY | O_CLOEXEC), out = -1, rc = 0;
    uint8_t *buf = NULL;
    struct stat sb;
    if (in < 0)
        return st_error_set(errno == ENOENT ? ST_ENOTFOUND : errno, "%s: %s", from, strerror(errno));
    fstat(in, &sb);
    out = sys->open(to, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (out < 0) {
        rc = sys_err(errno, "creating", to);
        goto done;
    }
    if (!(buf = malloc(1u << 20))) {
        rc = st_error_set(ENOMEM, "restore: no memory");
        goto done;
    }
    uint64_t done_bytes = 0;
    for (;;) {
        ssize_t r = read(in, buf, 1u << 20);
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0) {
            rc = st_error_set(errno, "reading %s: %s", from, strerror(errno));
            goto done;
        }
        if (r == 0)
            break;
        int e = write_all(sys, out, buf, (size_t)r);
        if (e) {
            rc = sys_err(e, "writing", to);
            goto done;
        }
        done_bytes += (uint64_t)r;
        if (o && o->progress)
            o->progress(o->progress_arg, "copy", done_bytes, (uint64_t)sb.st_size);
    }
    if (sys->fsync(out) != 0)
        rc = sys_err(errno, "fsync of", to);
done:
    free(buf);
    close(in);
    if (out >= 0 && st_sys_calls.close(out) != 0 && !rc)
        rc = sys_err(errno, "closing", to);
    return rc;
}

/* Upgrade the restored copy in tmp (schema `schema`) through the caller's function. */
static int upgrade_copy(st_store_upgrade_fn upgrade, void *arg, const char *tmp, uint32_t schema,
                        const char *dest)
{
    int rc = upgrade(arg, tmp, schema);
    if (rc) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_error_set(rc, "migrating the restored copy from schema %u to %u: %s (%s is untouched: the "
                            "copy was migrated before it was put in place)", schema, ST_STORE_SCHEMA, d, dest);
    }
    return 0;
}

int st_store_restore_backup(const char *backup_dir, const char *dest_dir, const st_store_opts *opts)
{
    return st_store_restore_backup_upgrade(backup_dir, dest_dir, opts, NULL, NULL);
}

int st_store_restore_backup_upgrade(const char *backup_dir, const char *dest_dir, const st_store_opts *opts,
                                    st_store_upgrade_fn upgrade, void *arg)
{
    st_store_sys sys;
    char tmp[4200], from[4200], to[4200], what[64];
    uint32_t schema = 0;
    if (!backup_dir || !dest_dir || !*dest_dir)
        return st_error_set(ST_EINVAL, "restore: no backup or destination");
    if (opts && opts->sys)
        sys = *opts->sys;
    else
        st_store_sys_init(&sys);
    st_store_progress_fn progress = opts ? opts->progress : NULL;
    void *parg = opts ? opts->progress_arg : NULL;
    if (st_path(from, sizeof from, backup_dir, "data.mdb"))
        return ST_EINVAL;
    if (access(from, R_OK) != 0)
        return st_error_set(ST_ENOTFOUND, "no backup at %s (no readable data.mdb)", backup_dir);
    int rc = dest_ok(dest_dir);
    if (!rc)
        rc = tmp_sibling(dest_dir, tmp, sizeof tmp);
    if (!rc)
        rc = check_copy(backup_dir, &sys, progress, parg, "the backup", upgrade != NULL, &schema);
    if (rc)
        return rc;
    int old = schema < ST_STORE_SCHEMA;
    st_store__remove_env_dir(tmp);
    if (sys.mkdir(tmp, 0755) != 0)
        return sys_err(errno, "creating", tmp);
    rc = st_path(to, sizeof to, tmp, "data.mdb");
    if (!rc)
        rc = copy_file(&sys, from, to, opts);
    if (!rc && old)
        rc = upgrade_copy(upgrade, arg, tmp, schema, dest_dir);
    if (old)
        snprintf(what, sizeof what, "the restored copy (migrated from schema %u)", schema);
    else
        snprintf(what, sizeof what, "the restored copy");
    if (!rc)
        rc = check_copy(tmp, &sys, progress, parg, what, 0, NULL);
    if (!rc && old && !st_path(to, sizeof to, tmp, "lock.mdb"))
        st_sys_calls.unlink(to); /* the upgrade's; a restored store holds data.mdb only, as a current one does */
    if (!rc)
        rc = publish(&sys, tmp, dest_dir);
    if (rc) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_store__remove_env_dir(tmp);
        st_error_set(rc, "%s", d);
    }
    return rc;
}
