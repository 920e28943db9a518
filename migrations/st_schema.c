/*
 * st_schema.c - the store's numbered schema steps and the driver that runs them.
 *
 * Invariants:
 * 1. A step never changes meaning: a new layout gets a new step with the next number.
 * 2. Every step is a sequence of write transactions that each move whole records, and leaves
 *    the schema number to its last transaction; the meta key "migrating" is set by its first.
 *    A store interrupted anywhere is therefore either untouched, or marked and resumable: each
 *    step recognises the records it already moved.
 * 3. The backup (unless declined) is complete and verified before the first step writes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_migrate.h"
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
        return st_error_set(ENOMEM, "schema 1 -> 2: no memory");
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

/* ---- the table of steps ------------------------------------------------------------------------- */

typedef struct st_step_impl {
    st_schema_step info;
    int (*run)(st_store *st, uint64_t *items);
    int (*count)(st_store *st, uint64_t *items);
} st_step_impl;

static const st_step_impl st_steps[] = {
    {{1, "refcounts-db", "move each chunk's reference count out of its value into the refcounts database"},
     step12_run, step12_count},
};
#define ST_N_STEPS (sizeof st_steps / sizeof st_steps[0])

const st_schema_step *st_schema_steps(size_t *n)
{
    static st_schema_step info[ST_N_STEPS];
    for (size_t i = 0; i < ST_N_STEPS; i++)
        info[i] = st_steps[i].info;
    *n = ST_N_STEPS;
    return info;
}

/* ---- the driver ------------------------------------------------------------------------------ */

static int default_backup_dir(const char *dir, uint32_t schema, char *dst, size_t cap)
{
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    for (int i = 1; i < 1000; i++) {
        int w = i == 1 ? snprintf(dst, cap, "%.*s.schema%u-backup", (int)n, dir, schema)
                       : snprintf(dst, cap, "%.*s.schema%u-backup-%d", (int)n, dir, schema, i);
        if (w < 0 || (size_t)w >= cap)
            return st_error_set(ST_EINVAL, "migrate: path too long: %s", dir);
        struct stat sb;
        if (stat(dst, &sb) != 0 && errno == ENOENT)
            return 0;
    }
    return st_error_set(ST_EINVAL, "migrate: no free name for a backup next to %s", dir);
}

/* Compacted copy of the old-schema store, verified by opening it and comparing record counts. */
static int backup_old(st_store *st, const char *bdir)
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
    st_store__remove_env_dir(bdir);
    return st_error_wrap(rc, "migrate: backup to %s failed", bdir);
}

/* st_schema_migrate; resume_hint ends the detail of a step that stopped. */
static int migrate_dir(const char *dir, const st_schema_migrate_opts *opts, st_schema_migrate_report *rep,
                       const char *resume_hint)
{
    st_schema_migrate_report r;
    st_store *st = NULL;
    memset(&r, 0, sizeof r);
    st_store_opts o = {0};
    int dry = opts && opts->dry_run;
    if (opts) {
        o.sys = opts->sys;
        o.progress = opts->progress;
        o.progress_arg = opts->progress_arg;
    }
    o.read_only = dry;
    int rc = st_store__open_any(&st, dir, &o, 0);
    if (rc)
        goto done;
    r.from = r.to = st->schema;
    if (st->schema > ST_STORE_SCHEMA) {
        rc = st_error_set(ST_EVERSION, "store schema %u is newer than this build's %u", st->schema, ST_STORE_SCHEMA);
        goto done;
    }
    if (st->schema == ST_STORE_SCHEMA)
        goto done; /* nothing to do */
    for (size_t i = 0; i < ST_N_STEPS; i++)
        if (st_steps[i].info.from >= st->schema && st_steps[i].info.from < ST_STORE_SCHEMA)
            r.n_steps++;
    if (r.n_steps != ST_STORE_SCHEMA - st->schema) {
        rc = st_error_set(ST_EVERSION, "store schema %u: this build has no steps from it to %u", st->schema,
                          ST_STORE_SCHEMA);
        goto done;
    }
    if (dry) {
        for (size_t i = 0; i < ST_N_STEPS && !rc; i++)
            if (st_steps[i].info.from >= st->schema)
                rc = st_steps[i].count(st, &r.items);
        r.to = ST_STORE_SCHEMA;
        goto done;
    }
    if (!(opts && opts->no_backup)) {
        if (opts && opts->backup_dir)
            snprintf(r.backup_dir, sizeof r.backup_dir, "%s", opts->backup_dir);
        else if ((rc = default_backup_dir(dir, st->schema, r.backup_dir, sizeof r.backup_dir)))
            goto done;
        st_store__progress(st, "backup", 0, 1);
        if ((rc = backup_old(st, r.backup_dir))) {
            r.backup_dir[0] = '\0';
            goto done;
        }
        st_store__progress(st, "backup", 1, 1);
    }
    for (size_t i = 0; i < ST_N_STEPS && !rc; i++) {
        if (st_steps[i].info.from != st->schema)
            continue;
        rc = st_steps[i].run(st, &r.items);
        if (rc) {
            char d[512];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(rc, "migrate: step %u -> %u (%s) stopped: %s%s", st->schema, st->schema + 1,
                              st_steps[i].info.name, d, resume_hint);
            break;
        }
        st->schema++;
        r.to = st->schema;
    }
done:
    st_store_close(st);
    if (rep)
        *rep = r;
    return rc;
}

int st_schema_migrate(const char *dir, const st_schema_migrate_opts *opts, st_schema_migrate_report *rep)
{
    return migrate_dir(dir, opts, rep, "; run `statectl migrate` again to resume");
}

/* ---- restoring an older backup ------------------------------------------------------------------ */

typedef struct st_restore_upgrade {
    const st_store_opts *opts;
    int ran;
    st_schema_migrate_report rep;
} st_restore_upgrade;

/* The copy in dir is a temporary directory of st_store_restore_backup_upgrade: the backup it
 * came from is never written and is the old-schema copy, so no second backup is taken, and a
 * step that stops is not resumed there (the copy is removed; the destination is untouched). */
static int restore_upgrade(void *arg, const char *dir, uint32_t schema)
{
    st_restore_upgrade *u = arg;
    st_schema_migrate_opts o = {.no_backup = 1};
    if (u->opts) {
        o.sys = u->opts->sys;
        o.progress = u->opts->progress;
        o.progress_arg = u->opts->progress_arg;
    }
    u->ran = 1;
    int rc = migrate_dir(dir, &o, &u->rep, "");
    if (!rc && (u->rep.from != schema || u->rep.to != ST_STORE_SCHEMA))
        rc = st_error_set(ST_EVERSION, "the copy went from schema %u to %u, not from %u to %u", u->rep.from,
                          u->rep.to, schema, ST_STORE_SCHEMA);
    return rc;
}

int st_schema_restore_backup(const char *backup_dir, const char *dest_dir, const st_store_opts *opts,
                             st_schema_migrate_report *rep)
{
    st_restore_upgrade u;
    memset(&u, 0, sizeof u);
    u.opts = opts;
    int rc = st_store_restore_backup_upgrade(backup_dir, dest_dir, opts, restore_upgrade, &u);
    if (!u.ran && !rc)
        u.rep.from = u.rep.to = ST_STORE_SCHEMA;
    if (rep)
        *rep = u.rep;
    return rc;
}
