/*
 * st_store_schema.c - the schema steps that rewrite the store's records of an older schema in
 * LMDB, and the backup taken before them. They live with the store because they read and write
 * its databases directly (an old schema's records are the store's format, docs/STORE.md);
 * migrations/st_schema.c numbers and names the steps, takes the decisions (dry run, backup
 * name, resume) and drives them through the store's narrow schema API (st_store.h, "schema
 * steps"): st_store_open_schema, st_store_schema, st_store_schema_step, st_store_schema_backup.
 *
 * Invariants (those of migrations/st_schema.c, kept here):
 * 1. Every step is a sequence of write transactions that each move whole records, and leaves
 *    the schema number to its last transaction; the meta key "migrating" is set by its first.
 *    A store interrupted anywhere is therefore either untouched, or marked and resumable: each
 *    step recognises the records it already moved.
 * 2. A step runs only on a store of exactly its `from` schema, and the handle's schema becomes
 *    from + 1 only when its last transaction committed.
 * 3. The backup is complete, reopened and its record counts and schema compared before it is
 *    reported taken; a failed one is removed.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_store_lmdb_int.h"

#define ST_SCHEMA_BATCH_CHUNKS 512u
#define ST_SCHEMA_BATCH_BYTES (64u << 20)

/* ---- step 1 -> 2: reference counts move out of the chunk values -------------------------------- */

typedef struct st_moved {
    uint8_t key[ST_STORE_HASH_LEN];
    uint8_t *val; /* the schema-1 value: u64 LE count, then the stored bytes */
    size_t len;
} st_moved;

typedef struct st_step12 {
    int first;
    uint8_t last[ST_STORE_HASH_LEN];
    /* out of one batch */
    int done;
    uint8_t next[ST_STORE_HASH_LEN];
    uint64_t moved;
    st_moved *items;
} st_step12;

static int put_u32(MDB_txn *txn, MDB_dbi dbi, const char *key, uint32_t value)
{
    uint8_t b[4];
    st_put32(b, value);
    MDB_val k = {strlen(key), (void *)key}, v = {4, b};
    return mdb_put(txn, dbi, &k, &v, 0);
}

static int step12_begin(st_store *st, MDB_txn *txn, void *arg)
{
    (void)arg;
    int rc = mdb_dbi_open(txn, "refcounts", MDB_CREATE, &st->dbi_refcounts);
    if (rc)
        return rc;
    st->have_refcounts = 1;
    return put_u32(txn, st->dbi_meta, ST_META_MIGRATING, 2);
}

static int step12_batch(st_store *st, MDB_txn *txn, void *arg)
{
    st_step12 *c = arg;
    MDB_cursor *cur = NULL;
    size_t n = 0, bytes = 0;
    c->done = 0;
    c->moved = 0;
    int rc = mdb_cursor_open(txn, st->dbi_chunks, &cur);
    if (rc)
        return rc;
    MDB_val k = {ST_STORE_HASH_LEN, c->last}, v;
    rc = mdb_cursor_get(cur, &k, &v, c->first ? MDB_FIRST : MDB_SET_RANGE);
    if (!rc && !c->first && k.mv_size == ST_STORE_HASH_LEN && !memcmp(k.mv_data, c->last, ST_STORE_HASH_LEN))
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    for (; !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        if (k.mv_size != ST_STORE_HASH_LEN) {
            rc = st_error_set(ST_ECORRUPT, "schema 1 -> 2: the chunks database holds a %zu-byte key", k.mv_size);
            break;
        }
        memcpy(c->next, k.mv_data, ST_STORE_HASH_LEN);
        MDB_val rv;
        int have = mdb_get(txn, st->dbi_refcounts, &k, &rv);
        if (have == 0)
            continue; /* moved by an earlier, committed batch */
        if (have != MDB_NOTFOUND) {
            rc = have;
            break;
        }
        if (v.mv_size < 8) {
            char hex[2 * ST_STORE_HASH_LEN + 1];
            st_hex_encode(hex, k.mv_data, ST_STORE_HASH_LEN);
            rc = st_error_set(ST_ECORRUPT, "schema 1 -> 2: chunk %s has a %zu-byte value, less than its count",
                              hex, v.mv_size);
            break;
        }
        st_moved *m = &c->items[n];
        memcpy(m->key, k.mv_data, ST_STORE_HASH_LEN);
        m->len = v.mv_size;
        if (!(m->val = malloc(v.mv_size))) {
            rc = st_error_set(ENOMEM, "schema 1 -> 2: no memory for a chunk of %zu bytes", v.mv_size);
            break;
        }
        memcpy(m->val, v.mv_data, v.mv_size); /* the map pointer does not survive our puts */
        n++;
        bytes += v.mv_size;
        if (n == ST_SCHEMA_BATCH_CHUNKS || bytes >= ST_SCHEMA_BATCH_BYTES)
            break;
    }
    mdb_cursor_close(cur);
    if (rc == MDB_NOTFOUND) {
        rc = 0;
        c->done = 1;
    }
    for (size_t i = 0; i < n && !rc; i++) {
        st_moved *m = &c->items[i];
        MDB_val key = {ST_STORE_HASH_LEN, m->key}, val = {m->len - 8, NULL}, cnt = {8, m->val};
        rc = mdb_put(txn, st->dbi_chunks, &key, &val, MDB_RESERVE);
        if (!rc) {
            memcpy(val.mv_data, m->val + 8, m->len - 8);
            rc = mdb_put(txn, st->dbi_refcounts, &key, &cnt, 0);
        }
        if (!rc)
            c->moved++;
    }
    for (size_t i = 0; i < n; i++) {
        free(c->items[i].val);
        c->items[i].val = NULL;
    }
    return rc;
}

static int step12_end(st_store *st, MDB_txn *txn, void *arg)
{
    (void)arg;
    int rc = put_u32(txn, st->dbi_meta, ST_META_SCHEMA, 2);
    if (!rc) {
        MDB_val k = {strlen(ST_META_MIGRATING), ST_META_MIGRATING};
        rc = mdb_del(txn, st->dbi_meta, &k, NULL);
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    return rc;
}

static int step12_run(st_store *st, uint64_t *items)
{
    st_step12 c;
    memset(&c, 0, sizeof c);
    c.first = 1;
    if (!(c.items = calloc(ST_SCHEMA_BATCH_CHUNKS, sizeof *c.items)))
        return st_error_set(ENOMEM, "schema 1 -> 2: no memory for a batch table of %u chunks (%zu bytes)",
                            ST_SCHEMA_BATCH_CHUNKS, (size_t)ST_SCHEMA_BATCH_CHUNKS * sizeof *c.items);
    MDB_stat ms;
    MDB_txn *txn = NULL;
    uint64_t total = 0;
    if (mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn) == 0) {
        if (mdb_stat(txn, st->dbi_chunks, &ms) == 0)
            total = ms.ms_entries;
        mdb_txn_abort(txn);
    }
    int rc = st_store__write(st, step12_begin, NULL);
    while (!rc) {
        rc = st_store__write(st, step12_batch, &c);
        if (rc)
            break;
        *items += c.moved;
        st_store__progress(st, "migrate", *items, total);
        if (c.done)
            break;
        memcpy(c.last, c.next, ST_STORE_HASH_LEN);
        c.first = 0;
    }
    if (!rc)
        rc = st_store__write(st, step12_end, NULL);
    free(c.items);
    return rc;
}

static int step12_count(st_store *st, uint64_t *items)
{
    MDB_txn *txn = NULL;
    MDB_stat ms;
    int rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn);
    if (!rc)
        rc = mdb_stat(txn, st->dbi_chunks, &ms);
    if (txn)
        mdb_txn_abort(txn);
    if (rc)
        return st_store__lmdb_err(rc, "counting chunks");
    *items += ms.ms_entries;
    return 0;
}

/* Compacted copy of the old-schema store, verified by opening it and comparing record counts. */
int st_store_schema_backup(st_store *st, const char *bdir)
{
    int rc = 0;
    if (st->sys.mkdir(bdir, 0755) != 0)
        return st_error_set(errno == ENOSPC ? ST_EFULL : errno, "migrate: creating backup %s: %s", bdir,
                            strerror(errno));
    if ((rc = st_store__copy_env(st, bdir)))
        goto fail;
    st_store *cp = NULL;
    st_store_opts o = {.read_only = 1, .sys = &st->sys};
    if ((rc = st_store__open_any(&cp, bdir, &o, MDB_RDONLY | MDB_NOLOCK)))
        goto fail;
    MDB_dbi a[] = {st->dbi_sessions, st->dbi_versions, st->dbi_chunks};
    MDB_dbi b[] = {cp->dbi_sessions, cp->dbi_versions, cp->dbi_chunks};
    MDB_txn *ta = NULL, *tb = NULL;
    rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &ta);
    if (!rc)
        rc = mdb_txn_begin(cp->env, NULL, MDB_RDONLY, &tb);
    for (int i = 0; i < 3 && !rc; i++) {
        MDB_stat sa, sb;
        rc = mdb_stat(ta, a[i], &sa);
        if (!rc)
            rc = mdb_stat(tb, b[i], &sb);
        if (!rc && sa.ms_entries != sb.ms_entries)
            rc = st_error_set(ST_ECORRUPT, "migrate: the backup holds %zu records where the store holds %zu",
                              sb.ms_entries, sa.ms_entries);
    }
    if (rc && rc != ST_ECORRUPT)
        rc = st_store__lmdb_err(rc, "verifying the backup");
    if (!rc && cp->schema != st->schema)
        rc = st_error_set(ST_ECORRUPT, "migrate: the backup has schema %u", cp->schema);
    if (ta)
        mdb_txn_abort(ta);
    if (tb)
        mdb_txn_abort(tb);
    st_store_close(cp);
    if (!rc)
        rc = st_store__fsync_dir(&st->sys, bdir);
    if (rc)
        goto fail;
    return 0;
fail:;
    char d[512];
    snprintf(d, sizeof d, "%s", st_errdetail());
    st_store__remove_env_dir(bdir);
    return st_error_set(rc, "migrate: backup to %s failed: %s", bdir, d);
}

/* ---- the schema API migrations/ drives ------------------------------------------------------- */

int st_store_open_schema(st_store **out, const char *dir, const st_store_opts *opts)
{
    if (!out)
        return st_error_set(ST_EINVAL, "store open: no out pointer");
    return st_store__open_any(out, dir, opts, 0);
}

uint32_t st_store_schema(const st_store *st)
{
    return st ? st->schema : 0;
}

int st_store_schema_step(st_store *st, uint32_t from, int count_only, uint64_t *items)
{
    if (!st || !items)
        return st_error_set(ST_EINVAL, "schema step: bad arguments");
    if (count_only ? from < st->schema : from != st->schema)
        return st_error_set(ST_EINVAL, "schema step from %u: the store is of schema %u", from, st->schema);
    int rc;
    switch (from) {
    case 1:
        rc = count_only ? step12_count(st, items) : step12_run(st, items);
        break;
    default:
        return st_error_set(ST_EVERSION, "store schema %u: this build has no step from it", from);
    }
    if (!rc && !count_only)
        st->schema = from + 1;
    return rc;
}
