/*
 * st_lmdb_store.c - the LMDB state store's environment: the system table, LMDB error mapping,
 * map sizing and growth, opening and closing, and st_store__write (the one way to write). The
 * rest of the store: st_store_put.c (put), st_store_get.c (get), st_store_export.c (export and
 * import), st_store_catalog.c (listing, deletion, labels), st_store_par.c (the thread pool),
 * st_store_direct.c (the put's fast path on LMDB internals); check, stat, gc and backup in
 * st_store_admin.c; the records' bytes in st_store_records.c. docs/STORE.md is the description;
 * these are the rules all of these files keep:
 *
 * 1. Every write is one LMDB write transaction run by st_store__write: a manifest commits with
 *    its new chunks, its count increments, the session record and any retention deletions, or
 *    none of them does. Counts therefore always equal the references the manifests hold.
 * 2. A write transaction only inserts, deletes and copies; what it waits for is done on other
 *    threads: a put's chunks are cut before it begins and hashed and compressed on the store's
 *    threads while it writes the earlier ones (st_store_put.c), so the single writer lock is
 *    held for the copy and the tail of the hashing.
 * 3. A read transaction copies bytes out and ends; checking (XXH3/SHA-256) and decompressing
 *    happen after it, except in the streamed get (st_store_get.c), whose one transaction (and
 *    the store's lock) lasts while each chunk is copied and checked, tens of milliseconds for
 *    hundreds of MB. A pointer into the map never outlives the transaction it came from.
 * 4. No transaction of this process is in flight while the map size changes or the environment
 *    is reopened: calls hold st->lock shared around their transactions, resizing holds it
 *    exclusively.
 * 5. A chunk is stored under the SHA-256 of its stored bytes, and exists while its count is
 *    positive; with deferred gc a count of zero keeps it until st_store_gc. A put that finds a
 *    chunk takes its reference in the same transaction, so gc can never free it under a put.
 * 6. Version numbers of a session only grow (next_version), so a (session, version) pair names
 *    one manifest for as long as the session exists.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

#define ST_MAP_MIN (256ull << 20)
#define ST_MAP_ALIGN (1ull << 20)

/* ---- the system table ----------------------------------------------------------------------- */

static int sys_txn_commit(MDB_txn *txn) { return mdb_txn_commit(txn); }
static int sys_set_mapsize(MDB_env *env, size_t size) { return mdb_env_set_mapsize(env, size); }
/* The file calls go through common's one table (st_sys_calls), so that a test injecting there
 * reaches the store too; a store opened with its own st_store_sys replaces them per store. */
static int sys_open(const char *path, int flags, unsigned mode) { return st_sys_calls.open(path, flags, mode); }
static ssize_t sys_write(int fd, const void *buf, size_t n) { return st_sys_calls.write(fd, buf, n); }
static int sys_fsync(int fd) { return st_sys_calls.fsync(fd); }
static int sys_rename(const char *from, const char *to) { return st_sys_calls.rename(from, to); }
static int sys_mkdir(const char *path, unsigned mode) { return st_sys_calls.mkdir(path, mode); }
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static int sys_populate(void *addr, size_t len) { return madvise(addr, len, MADV_POPULATE_WRITE); }
static int sys_reserve(int fd, uint64_t off, uint64_t len)
{
    /* common's fallocate is mode 0, not posix_fallocate, which writes zeros where the file system
     * cannot allocate */
    return st_sys_calls.fallocate(fd, off, len);
}
static ssize_t sys_pwrite(int fd, const void *buf, size_t n, uint64_t off)
{
    return st_sys_calls.pwrite(fd, buf, n, off);
}
static int sys_disk_free(const char *path, uint64_t *bytes)
{
    struct statvfs v;
    if (statvfs(path, &v) != 0)
        return errno;
    *bytes = (uint64_t)v.f_bavail * (uint64_t)v.f_frsize;
    return 0;
}

void st_store_sys_init(st_store_sys *sys)
{
    sys->txn_commit = sys_txn_commit;
    sys->set_mapsize = sys_set_mapsize;
    sys->open = sys_open;
    sys->write = sys_write;
    sys->fsync = sys_fsync;
    sys->rename = sys_rename;
    sys->mkdir = sys_mkdir;
    sys->disk_free = sys_disk_free;
    sys->populate = sys_populate;
    sys->reserve = sys_reserve;
    sys->pwrite = sys_pwrite;
}

/* ---- errors ------------------------------------------------------------------------------------ */

static int is_lmdb(int rc)
{
    return rc >= MDB_KEYEXIST && rc <= MDB_LAST_ERRCODE;
}

int st_store__lmdb_err(int rc, const char *what)
{
    switch (rc) {
    case 0:
        return 0;
    case MDB_MAP_FULL:
        return st_error_set(ST_EFULL, "%s: the store's map is full", what);
    case ENOSPC:
    case EDQUOT:
        return st_error_set(ST_EFULL, "%s: the disk is full (%s); nothing was written", what, strerror(rc));
    case MDB_NOTFOUND:
        return st_error_set(ST_ENOTFOUND, "%s: not found", what);
    case MDB_CORRUPTED:
    case MDB_PAGE_NOTFOUND:
    case MDB_INCOMPATIBLE:
    case MDB_INVALID:
        return st_error_set(ST_ECORRUPT, "%s: LMDB: %s", what, mdb_strerror(rc));
    case MDB_VERSION_MISMATCH:
        return st_error_set(ST_EVERSION, "%s: LMDB: %s", what, mdb_strerror(rc));
    case MDB_READERS_FULL:
        return st_error_set(ST_EBUSY, "%s: LMDB: %s", what, mdb_strerror(rc));
    case MDB_TXN_FULL:
    case MDB_BAD_VALSIZE:
        return st_error_set(ST_ETOOBIG, "%s: LMDB: %s", what, mdb_strerror(rc));
    default:
        if (rc > 0)
            return st_error_set(rc, "%s: %s", what, strerror(rc));
        if (is_lmdb(rc))
            return st_error_set(ST_EIO, "%s: LMDB: %s", what, mdb_strerror(rc));
        return rc; /* already one of ours, detail set where it happened */
    }
}

int st_store__edge(int rc, const char *what)
{
    return is_lmdb(rc) ? st_store__lmdb_err(rc, what) : rc;
}

void st_store__progress(const st_store *st, const char *phase, uint64_t done, uint64_t total)
{
    if (st && st->opts.progress)
        st->opts.progress(st->opts.progress_arg, phase, done, total);
}

/* ---- map sizing -------------------------------------------------------------------------------- */

static uint64_t align_down(uint64_t x) { return x / ST_MAP_ALIGN * ST_MAP_ALIGN; }
static uint64_t align_up(uint64_t x) { return (x + ST_MAP_ALIGN - 1) / ST_MAP_ALIGN * ST_MAP_ALIGN; }

/* Size of data.mdb: its apparent size (*apparent; with MDB_WRITEMAP LMDB extends the file to the
 * map size, sparse) and, returned, the bytes it occupies on disk (at most the apparent size). */
static uint64_t data_file_size(const char *dir, uint64_t *apparent)
{
    char path[4200];
    struct stat sb;
    if (apparent)
        *apparent = 0;
    if (st_path(path, sizeof path, dir, "data.mdb") || stat(path, &sb) != 0)
        return 0;
    if (apparent)
        *apparent = (uint64_t)sb.st_size;
    uint64_t used = (uint64_t)sb.st_blocks * 512;
    return used < (uint64_t)sb.st_size ? used : (uint64_t)sb.st_size;
}

uint64_t st_store__file_bytes(const char *dir) { return data_file_size(dir, NULL); }

/* The most bytes the map may take now: the configured budget, or the data file plus 3/4 of the
 * free disk (re-read every time, so space freed elsewhere becomes usable). */
uint64_t st_store__map_budget(const st_store *st)
{
    if (st->opts.budget)
        return align_down(st->opts.budget);
    uint64_t file = data_file_size(st->dir, NULL), avail = 0;
    if (st->sys.disk_free(st->dir, &avail) != 0)
        avail = 0;
    return align_down(file + avail / 4 * 3);
}

/* LMDB mapped data.mdb anew (open, reopen, growth, adoption): the map may sit at another address
 * now, even at the same size, so the cached address (map_base) must be looked up again. */
static void map_forget(st_store *st)
{
    st->map_base = NULL;
    st->map_base_size = 0;
    pthread_mutex_lock(&st->vc_mu);
    st->vc_lo = st->vc_hi = st->vc_base = 0;
    pthread_mutex_unlock(&st->vc_mu);
}

/* Grow the map after MDB_MAP_FULL seen with map size `seen`: double it (at least +64 MiB),
 * within the budget. Holds the lock exclusively, so no transaction of ours is in flight. */
static int map_grow(st_store *st, uint64_t seen)
{
    int rc = 0;
    pthread_rwlock_wrlock(&st->lock);
    if (st->map_size > seen)
        goto done; /* another thread grew it meanwhile */
    uint64_t budget = st_store__map_budget(st);
    uint64_t want = st->map_size * 2;
    if (want < st->map_size + (64ull << 20))
        want = st->map_size + (64ull << 20);
    if (want > budget)
        want = budget;
    want = align_down(want);
    if (want <= st->map_size) {
        rc = st_error_set(ST_EFULL, "store %s is full: its map of %llu MiB has reached the budget of %llu MiB "
                          "(free disk space, or st_store_opts.budget)", st->dir,
                          (unsigned long long)(st->map_size >> 20), (unsigned long long)(budget >> 20));
        goto done;
    }
    int lrc = st->sys.set_mapsize(st->env, (size_t)want);
    if (lrc) {
        rc = st_store__lmdb_err(lrc, "growing the store's map");
        if (rc == ST_EFULL || lrc == ENOMEM)
            rc = st_error_set(ST_EFULL, "store %s: growing the map from %llu to %llu MiB failed: %s", st->dir,
                              (unsigned long long)(st->map_size >> 20), (unsigned long long)(want >> 20),
                              lrc > 0 ? strerror(lrc) : mdb_strerror(lrc));
        goto done;
    }
    st->map_size = want;
    map_forget(st);
done:
    pthread_rwlock_unlock(&st->lock);
    return rc;
}

/* Another process grew the map: adopt its size. */
static int map_adopt(st_store *st)
{
    pthread_rwlock_wrlock(&st->lock);
    int rc = st->sys.set_mapsize(st->env, 0);
    map_forget(st);
    if (!rc) {
        MDB_envinfo info;
        mdb_env_info(st->env, &info);
        st->map_size = info.me_mapsize;
    }
    pthread_rwlock_unlock(&st->lock);
    return rc ? st_store__lmdb_err(rc, "adopting the map size another process set") : 0;
}

/* ---- opening ----------------------------------------------------------------------------------- */

static int env_open(st_store *st, uint64_t map, unsigned flags)
{
    MDB_env *env = NULL;
    int rc = mdb_env_create(&env);
    if (!rc)
        rc = mdb_env_set_maxdbs(env, 8);
    if (!rc)
        rc = mdb_env_set_maxreaders(env, 126);
    if (!rc)
        rc = mdb_env_set_mapsize(env, (size_t)map);
    if (!rc)
        rc = mdb_env_open(env, st->dir, flags, 0644);
    if (rc) {
        if (env)
            mdb_env_close(env);
        if (rc == ENOENT || rc == EACCES || rc == EROFS)
            return st_error_set(rc, "opening store %s: %s", st->dir, strerror(rc));
        if (rc == MDB_INVALID)
            return st_error_set(ST_ECORRUPT, "opening store %s: data.mdb is not an LMDB environment", st->dir);
        return st_store__lmdb_err(rc, "opening the store's environment");
    }
    MDB_envinfo info;
    mdb_env_info(env, &info);
    st->env = env;
    st->env_flags = flags;
    st->map_size = info.me_mapsize;
    map_forget(st);
    return 0;
}

int st_store__rtxn(st_store *st, MDB_txn **txn)
{
    for (int i = 0;; i++) {
        int rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, txn);
        if (rc == MDB_MAP_RESIZED && i < 4) {
            pthread_rwlock_unlock(&st->lock);
            rc = map_adopt(st);
            pthread_rwlock_rdlock(&st->lock);
            if (rc)
                return rc;
            continue;
        }
        return rc ? st_store__lmdb_err(rc, "beginning a read transaction") : 0;
    }
}

/* The environment reported MDB_PANIC (a commit failed after writing part of its meta, so LMDB
 * refuses further use of this handle): reopen it. The data file is intact - LMDB writes the meta
 * page last - so the reopened environment sees the last committed state. */
static int env_reopen(st_store *st)
{
    pthread_rwlock_wrlock(&st->lock);
    MDB_envinfo info;
    mdb_env_info(st->env, &info);
    uint64_t map = info.me_mapsize;
    mdb_env_close(st->env);
    st->env = NULL;
    map_forget(st);
    int rc = env_open(st, map, st->env_flags);
    MDB_txn *txn = NULL;
    if (!rc)
        rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn);
    if (!rc) {
        /* DBI handles are per environment: open them again (same names, same numbers). */
        MDB_dbi d;
        const char *names[] = {"meta", "sessions", "versions", "chunks", "refcounts"};
        MDB_dbi *slots[] = {&st->dbi_meta, &st->dbi_sessions, &st->dbi_versions, &st->dbi_chunks,
                            &st->dbi_refcounts};
        for (int i = 0; i < 5 && !rc; i++) {
            if (i == 4 && !st->have_refcounts)
                break;
            rc = mdb_dbi_open(txn, names[i], 0, &d);
            if (!rc)
                *slots[i] = d;
        }
        rc = rc ? (mdb_txn_abort(txn), rc) : mdb_txn_commit(txn);
    }
    pthread_rwlock_unlock(&st->lock);
    return rc ? st_store__lmdb_err(rc, "reopening the store after a failed commit") : 0;
}

int st_store__write(st_store *st, int (*fn)(st_store *st, MDB_txn *txn, void *arg), void *arg)
{
    if (st->env_flags & MDB_RDONLY)
        return st_error_set(ST_EINVAL, "store %s is open read-only", st->dir);
    for (int attempt = 0;; attempt++) {
        MDB_txn *txn = NULL;
        pthread_rwlock_rdlock(&st->lock);
        uint64_t seen = st->map_size;
        int rc = mdb_txn_begin(st->env, NULL, 0, &txn);
        if (!rc) {
            st_error_clear();
            rc = fn(st, txn, arg);
            if (!rc)
                rc = st->sys.txn_commit(txn);
            else
                mdb_txn_abort(txn);
        }
        pthread_rwlock_unlock(&st->lock);
        if (attempt < 64) {
            if (rc == MDB_MAP_FULL) {
                int grc = map_grow(st, seen);
                if (grc)
                    return grc;
                continue;
            }
            if (rc == MDB_MAP_RESIZED) {
                int grc = map_adopt(st);
                if (grc)
                    return grc;
                continue;
            }
            if (rc == MDB_PANIC && attempt == 0) {
                int grc = env_reopen(st);
                if (grc)
                    return grc;
                continue;
            }
        }
        if (rc == 0)
            return 0;
        if (is_lmdb(rc) || rc > 0) {
            if (rc == EIO)
                return st_error_set(EIO, "store %s: committing failed: %s (the change may not be durable; "
                                    "the store keeps a consistent state)", st->dir, strerror(rc));
            return st_store__lmdb_err(rc, "writing to the store");
        }
        return rc;
    }
}

static int dbi_open(MDB_txn *txn, const char *name, unsigned flags, MDB_dbi *dbi, const char *dir)
{
    int rc = mdb_dbi_open(txn, name, flags, dbi);
    if (rc == MDB_NOTFOUND)
        return st_error_set(ST_ECORRUPT, "store %s lacks its \"%s\" database", dir, name);
    return rc ? st_store__lmdb_err(rc, "opening a database") : 0;
}

static int meta_u32(MDB_txn *txn, MDB_dbi dbi, const char *key, uint32_t *out, int *found)
{
    MDB_val k = {strlen(key), (void *)key}, v;
    int rc = mdb_get(txn, dbi, &k, &v);
    *found = 0;
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return st_store__lmdb_err(rc, "reading the meta database");
    if (v.mv_size != 4)
        return st_error_set(ST_ECORRUPT, "meta \"%s\": %zu bytes, expected 4", key, v.mv_size);
    *out = st_get32(v.mv_data);
    *found = 1;
    return 0;
}

static int put_meta_u32(MDB_txn *txn, MDB_dbi dbi, const char *key, uint32_t value)
{
    uint8_t b[4];
    st_put32(b, value);
    MDB_val k = {strlen(key), (void *)key}, v = {4, b};
    return mdb_put(txn, dbi, &k, &v, 0);
}

/* A new store: create every database and the meta keys. */
static int create_fn(st_store *st, MDB_txn *txn, void *arg)
{
    (void)arg;
    struct {
        const char *name;
        MDB_dbi *dbi;
    } dbs[] = {{"meta", &st->dbi_meta}, {"sessions", &st->dbi_sessions}, {"versions", &st->dbi_versions},
               {"chunks", &st->dbi_chunks}, {"refcounts", &st->dbi_refcounts}};
    for (size_t i = 0; i < sizeof dbs / sizeof dbs[0]; i++) {
        int rc = mdb_dbi_open(txn, dbs[i].name, MDB_CREATE, dbs[i].dbi);
        if (rc)
            return rc;
    }
    uint32_t keep = st->opts.keep_last ? st->opts.keep_last : ST_STORE_KEEP_LAST_DEFAULT;
    int rc = put_meta_u32(txn, st->dbi_meta, ST_META_SCHEMA, ST_STORE_SCHEMA);
    if (!rc)
        rc = put_meta_u32(txn, st->dbi_meta, ST_META_KEEP_LAST, keep);
    if (!rc) {
        uint8_t b[8];
        st_put64(b, st_store_now_ns());
        MDB_val k = {strlen(ST_META_CREATED), ST_META_CREATED}, v = {8, b};
        rc = mdb_put(txn, st->dbi_meta, &k, &v, 0);
    }
    return rc;
}

static int keep_fn(st_store *st, MDB_txn *txn, void *arg)
{
    (void)arg;
    return put_meta_u32(txn, st->dbi_meta, ST_META_KEEP_LAST, st->opts.keep_last);
}

/* Open the databases of an existing store, or find that there is none (*fresh). */
static int dbis_open(st_store *st, int *fresh)
{
    MDB_txn *txn = NULL;
    int rc = mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn);
    *fresh = 0;
    if (rc)
        return st_store__lmdb_err(rc, "beginning a read transaction");
    rc = mdb_dbi_open(txn, "meta", 0, &st->dbi_meta);
    if (rc == MDB_NOTFOUND) {
        /* No meta: a fresh environment, unless something else lives in it. */
        MDB_stat ms;
        MDB_dbi main_dbi;
        rc = mdb_dbi_open(txn, NULL, 0, &main_dbi);
        if (!rc)
            rc = mdb_stat(txn, main_dbi, &ms);
        mdb_txn_abort(txn);
        if (rc)
            return st_store__lmdb_err(rc, "reading the store's main database");
        if (ms.ms_entries)
            return st_error_set(ST_ENOTSTRATA, "%s holds an LMDB environment that is not a Strata store", st->dir);
        *fresh = 1;
        return 0;
    }
    if (rc) {
        mdb_txn_abort(txn);
        return st_store__lmdb_err(rc, "opening the meta database");
    }
    int found = 0;
    uint32_t keep = ST_STORE_KEEP_LAST_DEFAULT;
    rc = meta_u32(txn, st->dbi_meta, ST_META_SCHEMA, &st->schema, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ECORRUPT, "store %s: the meta database has no schema", st->dir);
    if (!rc)
        rc = meta_u32(txn, st->dbi_meta, ST_META_KEEP_LAST, &keep, &found);
    st->keep_last = keep;
    if (!rc)
        rc = dbi_open(txn, "sessions", 0, &st->dbi_sessions, st->dir);
    if (!rc)
        rc = dbi_open(txn, "versions", 0, &st->dbi_versions, st->dir);
    if (!rc)
        rc = dbi_open(txn, "chunks", 0, &st->dbi_chunks, st->dir);
    if (!rc) {
        int r2 = mdb_dbi_open(txn, "refcounts", 0, &st->dbi_refcounts);
        if (r2 == 0)
            st->have_refcounts = 1;
        else if (r2 != MDB_NOTFOUND)
            rc = st_store__lmdb_err(r2, "opening the refcounts database");
    }
    if (rc) {
        mdb_txn_abort(txn);
        return rc;
    }
    rc = mdb_txn_commit(txn); /* keeps the DBI handles */
    return rc ? st_store__lmdb_err(rc, "opening the store's databases") : 0;
}

int st_store__open_any(st_store **out, const char *dir, const st_store_opts *opts, unsigned extra_flags)
{
    st_store *st = NULL;
    int rc = 0;
    *out = NULL;
    if (!dir || !*dir)
        return st_error_set(ST_EINVAL, "store open: no directory");
    st = calloc(1, sizeof *st);
    if (!st)
        return st_error_set(ENOMEM, "store open: no memory for the handle (%zu bytes)", sizeof *st);
    if (opts)
        st->opts = *opts;
    if (st->opts.sys)
        st->sys = *st->opts.sys;
    else
        st_store_sys_init(&st->sys);
    if (!st->sys.populate) /* a table filled before the entry existed */
        st->sys.populate = sys_populate;
    if (!st->sys.reserve)
        st->sys.reserve = sys_reserve;
    if (!st->sys.pwrite)
        st->sys.pwrite = sys_pwrite;
    st->opts.sys = &st->sys;
    long cpus = sysconf(_SC_NPROCESSORS_ONLN);
    st->threads = st->opts.threads ? st->opts.threads : (unsigned)(cpus > 8 ? 8 : cpus < 1 ? 1 : cpus);
    st->fill_threads = st->opts.threads ? st->opts.threads : (unsigned)(cpus > 16 ? 16 : cpus < 1 ? 1 : cpus);
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&st->lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    pthread_mutex_init(&st->vc_mu, NULL);
    st->dir = strdup(dir);
    if (!st->dir) {
        free(st);
        return st_error_set(ENOMEM, "store open: no memory for the directory's name (%zu bytes)", strlen(dir) + 1);
    }
    int read_only = st->opts.read_only || (extra_flags & MDB_RDONLY);

    struct stat sb;
    if (stat(dir, &sb) != 0) {
        if (errno != ENOENT) {
            rc = st_error_set(errno, "store %s: %s", dir, strerror(errno));
            goto fail;
        }
        if (!st->opts.create || read_only) {
            rc = st_error_set(ST_ENOTFOUND, "no store at %s (the directory does not exist)", dir);
            goto fail;
        }
        if (st->sys.mkdir(dir, 0755) != 0 && errno != EEXIST) {
            rc = st_error_set(errno == ENOSPC ? ST_EFULL : errno, "store %s: creating the directory: %s", dir,
                              strerror(errno));
            goto fail;
        }
    } else if (!S_ISDIR(sb.st_mode)) {
        rc = st_error_set(ST_EINVAL, "store %s is not a directory", dir);
        goto fail;
    }
    char path[4200];
    if ((rc = st_path(path, sizeof path, dir, "data.mdb")))
        goto fail;
    if (access(path, F_OK) != 0 && (!st->opts.create || read_only)) {
        rc = st_error_set(ST_ENOTFOUND, "no store at %s (no data.mdb)", dir);
        goto fail;
    }

    uint64_t apparent = 0;
    uint64_t file = data_file_size(dir, &apparent);
    uint64_t budget = st_store__map_budget(st);
    uint64_t map = st->opts.map_initial ? st->opts.map_initial : (file * 2 > ST_MAP_MIN ? file * 2 : ST_MAP_MIN);
    if (map > budget)
        map = budget;
    /* Never below the file's apparent size: with MDB_WRITEMAP LMDB truncates the file to the map
     * size, which must not cut the map of another process using the store. */
    if (map < apparent)
        map = apparent;
    map = align_up(map);
    if (map < ST_MAP_ALIGN)
        map = ST_MAP_ALIGN;
    /* Writers write straight into the file's map (MDB_WRITEMAP, see put_populate and
     * docs/STORE.md "Writing"); every writer of a store opens it so. */
    unsigned flags = MDB_NOTLS | extra_flags | (read_only ? MDB_RDONLY : MDB_WRITEMAP);
    if ((rc = env_open(st, map, flags)))
        goto fail;
    if (!(flags & MDB_NOLOCK)) {
        int dead = 0;
        mdb_reader_check(st->env, &dead); /* clear slots of dead processes */
    }
    int fresh = 0;
    if ((rc = dbis_open(st, &fresh)))
        goto fail;
    if (fresh) {
        if (read_only || !st->opts.create) {
            rc = st_error_set(ST_ENOTFOUND, "no store at %s (an empty environment)", dir);
            goto fail;
        }
        if ((rc = st_store__write(st, create_fn, NULL)))
            goto fail;
        st->schema = ST_STORE_SCHEMA;
        st->have_refcounts = 1;
        st->keep_last = st->opts.keep_last ? st->opts.keep_last : ST_STORE_KEEP_LAST_DEFAULT;
    }
    st_store__direct_probe(st); /* the put's fast path, or plain mdb_put (st_store_direct.c) */
    *out = st;
    return 0;
fail:
    st_store_close(st);
    return rc;
}

int st_store_open(st_store **out, const char *dir, const st_store_opts *opts)
{
    st_store *st = NULL;
    if (!out)
        return st_error_set(ST_EINVAL, "store open: no out pointer");
    *out = NULL;
    int rc = st_store__open_any(&st, dir, opts, 0);
    if (rc)
        return rc;
    if (st->schema < ST_STORE_SCHEMA) {
        rc = st_error_set(ST_EVERSION, "store schema %u is older than this build's %u: run `statectl migrate %s`",
                          st->schema, ST_STORE_SCHEMA, dir);
        goto fail;
    }
    if (st->schema > ST_STORE_SCHEMA) {
        rc = st_error_set(ST_EVERSION, "store schema %u is newer than this build's %u", st->schema,
                          ST_STORE_SCHEMA);
        goto fail;
    }
    if (!st->have_refcounts) {
        rc = st_error_set(ST_ECORRUPT, "store %s (schema %u) lacks its \"refcounts\" database", dir, st->schema);
        goto fail;
    }
    if (st->opts.keep_last && st->opts.keep_last != st->keep_last && !(st->env_flags & MDB_RDONLY)) {
        if ((rc = st_store__write(st, keep_fn, NULL)))
            goto fail;
        st->keep_last = st->opts.keep_last;
    }
    *out = st;
    return 0;
fail:
    st_store_close(st);
    return rc;
}

void st_store_close(st_store *st)
{
    if (!st)
        return;
    if (st->env)
        mdb_env_close(st->env);
    pthread_rwlock_destroy(&st->lock);
    pthread_mutex_destroy(&st->vc_mu);
    free(st->dir);
    free(st);
}

const char *st_store_dir(const st_store *st)
{
    return st ? st->dir : "";
}

uint32_t st_store_keep_last(const st_store *st)
{
    return st ? st->keep_last : 0;
}

int st_store_schema_version(const char *dir, uint32_t *schema)
{
    st_store *st = NULL;
    st_store_opts o = {.read_only = 1, .map_initial = ST_MAP_ALIGN};
    int rc = st_store__open_any(&st, dir, &o, 0);
    if (!rc)
        *schema = st->schema;
    st_store_close(st);
    return rc;
}
