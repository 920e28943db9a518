/*
 * st_lmdb_store.c - the LMDB state store: environment, map growth, put, get, export, import,
 * listing, deletion, labels. Check, stat, gc and backup live in st_store_admin.c; the records'
 * bytes in st_store_records.c. docs/STORE.md is the description; these are the rules the code
 * keeps:
 *
 * 1. Every write is one LMDB write transaction run by st_store__write: a manifest commits with
 *    its new chunks, its count increments, the session record and any retention deletions, or
 *    none of them does. Counts therefore always equal the references the manifests hold.
 * 2. A write transaction only inserts, deletes and copies: cutting, compressing and hashing of a
 *    put happen before it begins, so the single writer lock is held for the copy alone.
 * 3. A read transaction copies bytes out and ends; checking (XXH3/SHA-256) and decompressing
 *    happen after it. A pointer into the map never outlives the transaction it came from.
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
#define ST_GET_RETRIES 3
#define ST_PAR_MIN_BYTES (4u << 20) /* below this, one thread does all the hashing */

/* ---- the system table ----------------------------------------------------------------------- */

static int sys_txn_commit(MDB_txn *txn) { return mdb_txn_commit(txn); }
static int sys_set_mapsize(MDB_env *env, size_t size) { return mdb_env_set_mapsize(env, size); }
static int sys_open(const char *path, int flags, unsigned mode) { return open(path, flags, (mode_t)mode); }
static ssize_t sys_write(int fd, const void *buf, size_t n) { return write(fd, buf, n); }
static int sys_fsync(int fd) { return fsync(fd); }
static int sys_rename(const char *from, const char *to) { return rename(from, to); }
static int sys_mkdir(const char *path, unsigned mode) { return mkdir(path, (mode_t)mode); }
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif
static int sys_populate(void *addr, size_t len) { return madvise(addr, len, MADV_POPULATE_WRITE); }
static int sys_reserve(int fd, uint64_t off, uint64_t len)
{
    /* not posix_fallocate, which writes zeros where the file system cannot allocate */
    return fallocate(fd, 0, (off_t)off, (off_t)len);
}
static ssize_t sys_pwrite(int fd, const void *buf, size_t n, uint64_t off) { return pwrite(fd, buf, n, (off_t)off); }
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
        if (rc >= MDB_KEYEXIST && rc <= MDB_LAST_ERRCODE)
            return st_error_set(ST_EIO, "%s: LMDB: %s", what, mdb_strerror(rc));
        return rc; /* already one of ours, detail set where it happened */
    }
}

static int is_lmdb_code(int rc)
{
    return rc >= MDB_KEYEXIST && rc <= MDB_LAST_ERRCODE;
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
static uint64_t map_budget(const st_store *st)
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
    uint64_t budget = map_budget(st);
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
        if (is_lmdb_code(rc) || rc > 0) {
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
        return st_error_set(ENOMEM, "store open: no memory");
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
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&st->lock, &ra);
    pthread_rwlockattr_destroy(&ra);
    pthread_mutex_init(&st->vc_mu, NULL);
    st->dir = strdup(dir);
    if (!st->dir) {
        free(st);
        return st_error_set(ENOMEM, "store open: no memory");
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
    uint64_t budget = map_budget(st);
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

/* ---- parallel work ------------------------------------------------------------------------------
 * Items are taken from a shared counter by the calling thread and up to threads-1 helpers; the
 * first error wins and its detail (thread-local) is carried back to the caller. */

typedef struct st_par {
    size_t n;
    int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx);
    void *ctx;
    atomic_size_t next;
    atomic_int failed;
    pthread_mutex_t mu;
    int rc;
    char detail[512];
} st_par;

static void *par_worker(void *arg)
{
    st_par *p = arg;
    st_frame_ctx *fctx = NULL;
    for (;;) {
        if (atomic_load(&p->failed))
            break;
        size_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n)
            break;
        int rc = p->fn(p->ctx, i, &fctx);
        if (rc) {
            pthread_mutex_lock(&p->mu);
            if (!p->rc) {
                p->rc = rc;
                snprintf(p->detail, sizeof p->detail, "%s", st_errdetail());
            }
            pthread_mutex_unlock(&p->mu);
            atomic_store(&p->failed, 1);
            break;
        }
    }
    st_frame_ctx_free(fctx);
    return NULL;
}

int st_store__par_run(unsigned threads, size_t n, int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx), void *ctx)
{
    st_par p = {.n = n, .fn = fn, .ctx = ctx};
    pthread_t tid[16];
    unsigned started = 0;
    atomic_init(&p.next, 0);
    atomic_init(&p.failed, 0);
    pthread_mutex_init(&p.mu, NULL);
    if (threads > 16)
        threads = 16;
    if (threads > n)
        threads = (unsigned)n;
    for (unsigned t = 1; t < threads; t++)
        if (pthread_create(&tid[started], NULL, par_worker, &p) == 0)
            started++;
    par_worker(&p);
    for (unsigned t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&p.mu);
    if (p.rc)
        return st_error_set(p.rc, "%s", p.detail);
    return 0;
}

/* ---- cutting an image into chunks --------------------------------------------------------------- */

typedef struct st_piece {
    const uint8_t *src;   /* raw bytes (in the image, the geometry record or the file) */
    uint32_t raw_len;
    uint32_t elem;        /* shuffle width for compression (0: none) */
    int no_compress;
    uint8_t *framed;      /* owned: the frame, when it is smaller than the raw bytes */
    const uint8_t *stored;
    uint32_t stored_len;
    uint8_t hash[ST_STORE_HASH_LEN];
    uint64_t xxh;
} st_piece;

typedef struct st_plan {
    st_manifest m;        /* sections/chunks filled by the cut, chunks by the hashing */
    uint32_t cap_sec, cap_chunks;
    st_piece *pieces;
    int compress;
    int verify_sha;       /* get: SHA-256 instead of XXH3 */
} st_plan;

static void plan_free(st_plan *p)
{
    if (!p)
        return;
    if (p->pieces)
        for (uint32_t i = 0; i < p->m.n_chunks; i++)
            free(p->pieces[i].framed);
    free(p->pieces);
    st_manifest_free(&p->m);
    memset(p, 0, sizeof *p);
}

static int plan_section(st_plan *p, uint32_t type, uint32_t index, uint32_t tensor, const uint8_t *src,
                        uint64_t len, uint64_t unit, uint32_t elem)
{
    if (p->m.n_sec == p->cap_sec) {
        uint32_t cap = p->cap_sec ? p->cap_sec * 2 : 16;
        st_msection *s = realloc(p->m.sec, cap * sizeof *s);
        if (!s)
            return st_error_set(ENOMEM, "put: no memory for the manifest");
        p->m.sec = s;
        p->cap_sec = cap;
    }
    st_msection *sec = &p->m.sec[p->m.n_sec++];
    memset(sec, 0, sizeof *sec);
    sec->type = type;
    sec->index = index;
    sec->tensor = tensor;
    sec->length = len;
    sec->first = p->m.n_chunks;
    if (unit == 0 || unit > len)
        unit = len;
    for (uint64_t off = 0; off < len; off += unit) {
        uint64_t ulen = len - off < unit ? len - off : unit;
        for (uint64_t o = 0; o < ulen; o += ST_STORE_CHUNK_MAX) {
            uint64_t plen = ulen - o < ST_STORE_CHUNK_MAX ? ulen - o : ST_STORE_CHUNK_MAX;
            if (p->m.n_chunks == p->cap_chunks) {
                uint32_t cap = p->cap_chunks ? p->cap_chunks * 2 : 64;
                if (cap > ST_MANIFEST_CHUNKS_MAX)
                    return st_error_set(ST_ETOOBIG, "put: the image needs more than %u chunks",
                                        ST_MANIFEST_CHUNKS_MAX);
                st_piece *np = realloc(p->pieces, cap * sizeof *np);
                if (!np)
                    return st_error_set(ENOMEM, "put: no memory for %u chunks", cap);
                p->pieces = np;
                p->cap_chunks = cap;
            }
            st_piece *pc = &p->pieces[p->m.n_chunks++];
            memset(pc, 0, sizeof *pc);
            pc->src = src + off + o;
            pc->raw_len = (uint32_t)plen;
            pc->elem = elem;
            sec->n_chunks++;
        }
    }
    return 0;
}

/* Bytes of one group of pages: whole pages, grouped until they reach ST_STORE_CHUNK_MIN, so
 * page boundaries (and shared prefixes) fall on chunk boundaries whatever the row size. */
static uint64_t page_unit(uint32_t page_size, uint64_t row_bytes)
{
    if (row_bytes == 0)
        return 0;
    if (page_size > UINT64_MAX / row_bytes / 64)
        return UINT64_MAX;
    uint64_t page = (uint64_t)page_size * row_bytes;
    uint64_t g = page >= ST_STORE_CHUNK_MIN ? 1 : (ST_STORE_CHUNK_MIN + page - 1) / page;
    return g * page;
}

/* Cut img (geometry record geo) into sections and chunk pieces; file (optional) adds a FILE
 * section with those bytes. */
static int plan_cut(st_plan *p, const st_image *img, const uint8_t *geo, size_t geo_len, const uint8_t *file,
                    size_t file_len)
{
    const st_geometry *g = st_image_geometry(img);
    uint64_t n_tokens = st_image_n_tokens(img);
    int rc = plan_section(p, ST_MSEC_GEOMETRY, 0, 0, geo, geo_len, 0, 0);
    if (rc)
        return rc;
    p->pieces[p->m.n_chunks - 1].no_compress = 1;
    rc = plan_section(p, ST_MSEC_TOKENS, 0, 0, (const uint8_t *)st_image_tokens(img), n_tokens * 4,
                      page_unit(g->page_size, 4), 4);
    for (uint32_t ti = 0; ti < g->n_tensors && !rc; ti++) {
        const st_tensor_desc *t = &g->tensors[ti];
        if (t->role != ST_ROLE_KV)
            continue;
        uint64_t len = 0;
        const uint8_t *kv = st_image_kv_const(img, ti, &len);
        rc = plan_section(p, ST_MSEC_KV, ti, 0, kv, len, page_unit(g->page_size, st_tensor_row_bytes(t)),
                          (uint32_t)st_dtype_size(t->dtype));
    }
    memcpy(p->m.arch, g->arch, ST_ARCH_NAME_MAX); /* the manifest, not the shared geometry record */
    uint32_t n_ckpt = st_image_n_checkpoints(img);
    p->m.ckpt = calloc(n_ckpt ? n_ckpt : 1, sizeof *p->m.ckpt);
    if (!rc && !p->m.ckpt)
        rc = st_error_set(ENOMEM, "put: no memory");
    for (uint32_t c = 0; c < n_ckpt && !rc; c++) {
        st_mckpt *mc = &p->m.ckpt[p->m.n_ckpt++];
        rc = st_image_checkpoint_info(img, c, &mc->position, &mc->codec);
        for (uint32_t ti = 0; ti < g->n_tensors && !rc; ti++) {
            const st_tensor_desc *t = &g->tensors[ti];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            uint64_t len = 0, elems = st_tensor_elems(t);
            const uint8_t *x = st_image_checkpoint_tensor_const(img, c, ti, &len);
            rc = plan_section(p, ST_MSEC_CKPT, c, ti, x, len, len, (uint32_t)(elems ? len / elems : 0));
        }
    }
    uint32_t n_logits = 0;
    const float *logits = st_image_logits(img, &n_logits);
    if (!rc && n_logits)
        rc = plan_section(p, ST_MSEC_LOGITS, 0, 0, (const uint8_t *)logits, (uint64_t)n_logits * 4, 0, 4);
    if (!rc && file) {
        rc = plan_section(p, ST_MSEC_FILE, 0, 0, file, file_len, ST_STORE_CHUNK_MAX, 0);
        p->m.flags |= ST_MANIFEST_VERBATIM;
    }
    return rc;
}

static int prepare_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_plan *p = ctx;
    st_piece *pc = &p->pieces[i];
    pc->stored = pc->src;
    pc->stored_len = pc->raw_len;
    if (p->compress && !pc->no_compress) {
        if (!*fctx && !(*fctx = st_frame_ctx_new()))
            return st_error_set(ENOMEM, "put: no memory for a compression context");
        size_t cap = st_frame_bound(pc->raw_len), flen = 0;
        uint8_t *buf = malloc(cap);
        if (!buf)
            return st_error_set(ENOMEM, "put: no memory to compress a chunk of %u bytes", pc->raw_len);
        unsigned elem = pc->elem == 2 || pc->elem == 4 || pc->elem == 8 ? pc->elem : 0;
        int rc = st_frame_encode(*fctx, buf, cap, pc->src, pc->raw_len, elem, p->compress, &flen);
        if (rc) {
            free(buf);
            return rc;
        }
        if (flen < pc->raw_len) {
            pc->framed = buf;
            pc->stored = buf;
            pc->stored_len = (uint32_t)flen;
        } else {
            free(buf);
        }
    }
    int rc = st_store_sha256(pc->stored, pc->stored_len, pc->hash);
    if (rc)
        return rc;
    pc->xxh = st_checksum(pc->stored, pc->stored_len);
    st_mchunk *c = &p->m.chunks[i];
    memcpy(c->hash, pc->hash, ST_STORE_HASH_LEN);
    c->xxh = pc->xxh;
    c->raw_len = pc->raw_len;
    c->stored_len = pc->stored_len;
    return 0;
}

/* ---- sessions and versions inside a transaction -------------------------------------------------- */

static int session_get(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, int *found)
{
    MDB_val k = {strlen(id), (void *)id}, v;
    int rc = mdb_get(txn, st->dbi_sessions, &k, &v);
    *found = 0;
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return rc;
    char what[ST_STORE_ID_MAX + 32];
    snprintf(what, sizeof what, "session %s: its record", id);
    if ((rc = st_store__value_check(st, &v, what)))
        return rc;
    rc = st_session_parse(v.mv_data, v.mv_size, id, rec);
    if (!rc)
        *found = 1;
    return rc;
}

static int session_put(st_store *st, MDB_txn *txn, const char *id, const st_session_rec *rec)
{
    uint8_t b[ST_SESSION_REC_MAX];
    size_t n = st_session_encode(rec, b);
    MDB_val k = {strlen(id), (void *)id}, v = {n, b};
    return mdb_put(txn, st->dbi_sessions, &k, &v, 0);
}

/* Versions of session id present in txn, oldest first (malloc'd). */
static int session_versions(st_store *st, MDB_txn *txn, const char *id, uint64_t **out, size_t *n)
{
    MDB_cursor *cur = NULL;
    uint8_t kb[ST_VKEY_MAX];
    size_t idlen = strlen(id), cap = 0, cnt = 0;
    uint64_t *vs = NULL;
    *out = NULL;
    *n = 0;
    int rc = mdb_cursor_open(txn, st->dbi_versions, &cur);
    if (rc)
        return rc;
    MDB_val k = {st_vkey(kb, id, 0), kb}, v;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        uint64_t ver;
        if (!st_vkey_of(k.mv_data, k.mv_size, id, idlen, &ver))
            break;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 16;
            uint64_t *nv = realloc(vs, cap * sizeof *nv);
            if (!nv) {
                rc = st_error_set(ENOMEM, "no memory listing versions");
                goto done;
            }
            vs = nv;
        }
        vs[cnt++] = ver;
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
done:
    mdb_cursor_close(cur);
    if (rc) {
        free(vs);
        return rc;
    }
    *out = vs;
    *n = cnt;
    return 0;
}

/* Drop one reference to chunk hash; free the chunk at zero unless gc is deferred. */
static int chunk_unref(st_store *st, MDB_txn *txn, const uint8_t *hash, const char *what)
{
    MDB_val k = {ST_STORE_HASH_LEN, (void *)hash}, v;
    char hex[2 * ST_STORE_HASH_LEN + 1];
    int rc = mdb_get(txn, st->dbi_refcounts, &k, &v);
    if (rc == MDB_NOTFOUND || (!rc && (v.mv_size != 8 || st_get64(v.mv_data) == 0))) {
        st_store_hex(hex, hash, ST_STORE_HASH_LEN);
        return st_error_set(ST_ECORRUPT, "%s: chunk %s has no positive reference count (run `statectl check`)",
                            what, hex);
    }
    if (rc)
        return rc;
    uint64_t cnt = st_get64(v.mv_data) - 1;
    if (cnt == 0 && !st->opts.gc_deferred) {
        /* LMDB frees as many overflow pages as the value's page header says: check it first */
        MDB_val cv;
        rc = mdb_get(txn, st->dbi_chunks, &k, &cv);
        if (rc == MDB_NOTFOUND)
            return mdb_del(txn, st->dbi_refcounts, &k, NULL); /* already gone: nothing to free */
        if (!rc)
            rc = st_store__value_check(st, &cv, what);
        if (!rc)
            rc = mdb_del(txn, st->dbi_refcounts, &k, NULL);
        if (!rc)
            rc = mdb_del(txn, st->dbi_chunks, &k, NULL);
        return rc;
    }
    uint8_t b[8];
    st_put64(b, cnt);
    MDB_val nv = {8, b};
    return mdb_put(txn, st->dbi_refcounts, &k, &nv, 0);
}

/* Delete version `version` of session id (its manifest and references) and update rec
 * (count, labels); the caller fixes the head and writes rec. */
static int version_delete_txn(st_store *st, MDB_txn *txn, const char *id, uint64_t version, st_session_rec *rec)
{
    uint8_t kb[ST_VKEY_MAX];
    char what[ST_STORE_ID_MAX + 64];
    MDB_val k = {st_vkey(kb, id, version), kb}, v;
    st_manifest m;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)version);
    int rc = mdb_get(txn, st->dbi_versions, &k, &v);
    if (rc == MDB_NOTFOUND)
        return st_error_set(ST_ENOTFOUND, "session %s has no version %llu", id, (unsigned long long)version);
    if (rc)
        return rc;
    if ((rc = st_store__value_check(st, &v, what)) || (rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m)))
        return rc;
    for (uint32_t i = 0; i < m.n_chunks && !rc; i++)
        rc = chunk_unref(st, txn, m.chunks[i].hash, what);
    st_manifest_free(&m);
    if (!rc)
        rc = mdb_del(txn, st->dbi_versions, &k, NULL);
    if (rc)
        return rc;
    rec->n_versions--;
    uint32_t w = 0;
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (rec->labels[i].version != version)
            rec->labels[w++] = rec->labels[i];
    rec->n_labels = w;
    return 0;
}

static int label_index(const st_session_rec *rec, const char *name)
{
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (!strcmp(rec->labels[i].name, name))
            return (int)i;
    return -1;
}

static int label_apply(st_session_rec *rec, const char *id, const char *name, uint64_t version)
{
    int i = label_index(rec, name);
    if (i >= 0) {
        rec->labels[i].version = version;
        return 0;
    }
    if (rec->n_labels >= ST_STORE_LABELS_MAX)
        return st_error_set(ST_ETOOBIG, "session %s already has %u labels", id, ST_STORE_LABELS_MAX);
    snprintf(rec->labels[rec->n_labels].name, ST_STORE_LABEL_MAX, "%s", name);
    rec->labels[rec->n_labels].version = version;
    rec->n_labels++;
    return 0;
}

static int labelled(const st_session_rec *rec, uint64_t version)
{
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (rec->labels[i].version == version)
            return 1;
    return 0;
}

/* Retention: delete versions older than the newest keep that carry no label. */
static int prune_txn(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, uint32_t keep,
                     uint32_t *pruned)
{
    uint64_t *vs = NULL;
    size_t n = 0;
    *pruned = 0;
    if (keep == 0)
        return 0;
    int rc = session_versions(st, txn, id, &vs, &n);
    for (size_t i = 0; !rc && n > keep && i < n - keep; i++) {
        if (labelled(rec, vs[i]))
            continue;
        rc = version_delete_txn(st, txn, id, vs[i], rec);
        if (!rc)
            (*pruned)++;
    }
    free(vs);
    return rc;
}

/* ---- put ------------------------------------------------------------------------------------------- */

typedef struct st_put_ctx {
    const char *id;
    st_plan *plan;
    const st_image *img;
    uint64_t expected;
    uint8_t *mbuf;
    size_t mlen;
    uint8_t digest[ST_STORE_HASH_LEN];
    const char *label;
    st_put_stats stats;
    double t_fn, t_pop, t_ins; /* STRATA_STORE_TRACE: write start, populate done, inserts done */
    int attempts;
    uint64_t wb_done, wb_hi;   /* early writeback: file bytes handed to it, end of the copies */
} st_put_ctx;

/* Monotonic milliseconds, for STRATA_STORE_TRACE. */
static double trace_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The session holds another geometry: name the first difference. */
static int geometry_mismatch(st_store *st, MDB_txn *txn, const char *id, const st_session_rec *rec,
                             const st_image *img)
{
    MDB_val k = {ST_STORE_HASH_LEN, (void *)rec->geometry_digest}, v;
    st_geometry g;
    st_tensor_desc *t = NULL;
    int rc = mdb_get(txn, st->dbi_chunks, &k, &v);
    if (!rc)
        rc = st_store__value_check(st, &v, "the session's geometry");
    if (!rc)
        rc = st_geometry_decode(v.mv_data, v.mv_size, &g, &t);
    if (rc)
        return st_error_set(ST_EGEOMETRY, "session %s was saved with another geometry (its record is unreadable)", id);
    rc = st_geometry_compare(&g, st_image_geometry(img));
    free(t);
    if (rc) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_error_set(rc, "session %s: %s", id, d);
    }
    return st_error_set(ST_EGEOMETRY, "session %s was saved with another geometry", id);
}

#define ST_POPULATE_MARGIN_PAGES 16ull    /* room for a put's copied B-tree and meta pages */
#define ST_POPULATE_MARGIN_MAX (64ull << 20)
#define ST_VERIFY_EVERY 16

/* Where LMDB mapped data.mdb (mdb_env_info's me_mapaddr is only the MDB_FIXEDMAP address): the
 * mapping of the environment's file, from offset 0, of map_size bytes, in /proc/self/maps.
 * Found once per map size; NULL when it cannot be found. Called inside a write transaction. */
static void *map_base(st_store *st, uint64_t map_size)
{
    if (st->map_base && st->map_base_size == map_size)
        return st->map_base;
    st->map_base = NULL;
    int fd = -1;
    struct stat sb;
    if (mdb_env_get_fd(st->env, &fd) || fd < 0 || fstat(fd, &sb) != 0)
        return NULL;
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        return NULL;
    char line[4352];
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi, off, ino;
        unsigned maj, mnr;
        if (sscanf(line, "%lx-%lx %*s %lx %x:%x %lu", &lo, &hi, &off, &maj, &mnr, &ino) != 6)
            continue;
        if (off == 0 && ino == (unsigned long)sb.st_ino && makedev(maj, mnr) == sb.st_dev &&
            hi - lo == map_size) {
            st->map_base = (void *)lo;
            st->map_base_size = map_size;
            break;
        }
    }
    fclose(f);
    return st->map_base;
}

/* With MDB_WRITEMAP LMDB writes a put's new pages straight into the file's shared map, past the
 * last page in use (or into pages of its free list). A write into a page the file system cannot
 * back (full disk) would be a SIGBUS, and each first write to a page is a page fault (about
 * 20 us on the benchmark VM). So before inserting, the range the new chunks will take is sized:
 * only new chunks count (looked up in this transaction), less the pages on LMDB's free list (which
 * it uses first), plus a margin for the B-tree pages the put copies. That range is reserved with
 * fallocate (the disk says now whether it can take it: ST_EFULL), and *direct tells the caller to
 * write the new chunks' bytes with pwrite at the places LMDB gives them (no fault, no zeroing of
 * pages that are overwritten at once); where the file system cannot fallocate, the range is
 * populated with one madvise(MADV_POPULATE_WRITE) instead (EFAULT: ST_EFULL) and the bytes are
 * copied into the map. When the pages cannot fit past the last page and the map may still grow,
 * it returns MDB_MAP_FULL at once (the caller grows the map and runs the transaction again)
 * instead of inserting until LMDB finds the map full. Pages LMDB takes from its free list beyond
 * that estimate leave part of the range unused for later puts. */
static int put_populate(st_store *st, MDB_txn *txn, const st_plan *p, int *direct)
{
    *direct = 0;
    if (!(st->env_flags & MDB_WRITEMAP))
        return 0;
    MDB_stat ms;
    MDB_envinfo info;
    int rc = mdb_env_stat(st->env, &ms);
    if (rc)
        return rc;
    uint64_t psize = ms.ms_psize, need = 0;
    for (uint32_t i = 0; i < p->m.n_chunks; i++) {
        const st_piece *pc = &p->pieces[i];
        MDB_val k = {ST_STORE_HASH_LEN, (void *)pc->hash}, v;
        rc = mdb_get(txn, st->dbi_chunks, &k, &v);
        if (rc == MDB_NOTFOUND)
            need += ((uint64_t)pc->stored_len + 16 + psize - 1) / psize * psize; /* overflow pages */
        else if (rc)
            return rc;
    }
    /* LMDB takes pages from its free list (database 0; each value a page list led by its
     * length) before growing the file: only what the free list cannot hold is populated. */
    MDB_cursor *fc = NULL;
    uint64_t free_pages = 0;
    /* Every put also dirties B-tree, manifest and free-list pages (copy on write): room for
     * them is counted too, so that no put - however small - first touches an unbacked page of
     * the map, where a full disk would be a SIGBUS instead of ST_EFULL. */
    uint64_t margin = (ST_POPULATE_MARGIN_PAGES + (uint64_t)p->m.n_chunks) * psize;
    need += margin < ST_POPULATE_MARGIN_MAX ? margin : ST_POPULATE_MARGIN_MAX;
    if (mdb_cursor_open(txn, 0, &fc) == 0) {
        MDB_val fk, fv;
        for (int frc = mdb_cursor_get(fc, &fk, &fv, MDB_FIRST); !frc; frc = mdb_cursor_get(fc, &fk, &fv, MDB_NEXT))
            if (fv.mv_size >= sizeof(size_t)) {
                size_t cnt;
                memcpy(&cnt, fv.mv_data, sizeof cnt);
                free_pages += cnt;
            }
        mdb_cursor_close(fc);
    }
    need = need > free_pages * psize ? need - free_pages * psize : 0;
    mdb_filehandle_t fd;
    int have_fd = mdb_env_get_fd(st->env, &fd) == 0;
    mdb_env_info(st->env, &info);
    if (!need) {
        /* everything fits in free-list pages, which have their blocks: write with pwrite all the
         * same (a page LMDB takes past them gets its block from the pwrite, ENOSPC an error) */
        *direct = have_fd && map_base(st, info.me_mapsize) != NULL;
        return 0;
    }
    uint64_t start = ((uint64_t)info.me_last_pgno + 1) * psize, end = start + need + need / 64;
    if (end > info.me_mapsize) {
        if (map_budget(st) > info.me_mapsize)
            return MDB_MAP_FULL;
        end = info.me_mapsize;
    }
    char *base = map_base(st, info.me_mapsize);
    if (!base || start >= end)
        return 0;
    /* Reserve the blocks (fallocate): no page is touched, the disk's answer comes now, and the
     * new chunks' bytes then go into the file with pwrite at the places LMDB gives them (the
     * page cache is the map's, so LMDB sees them); only the pages LMDB writes itself (chunk
     * headers, B-tree) fault in, onto reserved blocks. Without fallocate, populate the range. */
    if (have_fd) {
        int r;
        while ((r = st->sys.reserve(fd, start, end - start)) != 0 && errno == EINTR)
            ;
        if (r == 0) {
            *direct = 1;
            return 0;
        }
        int e = errno;
        if (e == ENOSPC || e == EDQUOT)
            return st_error_set(ST_EFULL, "store %s: the disk cannot take %llu KiB of new chunks", st->dir,
                                (unsigned long long)((end - start + 1023) >> 10));
        if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL)
            return st_error_set(ST_EIO, "store %s: reserving %llu KiB for new chunks: %s", st->dir,
                                (unsigned long long)((end - start + 1023) >> 10), strerror(e));
        /* the file system cannot fallocate: populate the range instead */
    }
    if (st->sys.populate(base + start, (size_t)(end - start)) != 0 && errno == EFAULT)
        return st_error_set(ST_EFULL, "store %s: the disk cannot take %llu KiB of new chunks", st->dir,
                            (unsigned long long)((end - start + 1023) >> 10));
    return 0; /* other errors (a kernel without MADV_POPULATE_WRITE): the writes fault page by page */
}

/* With MDB_WRITEMAP a new chunk's bytes land in the file's shared map, mostly past the last page
 * in use and in order. Every ST_WRITEBACK_STEP of them, the file range up to the end of the last
 * copy is handed to the kernel's writeback (sync_file_range, SYNC_FILE_RANGE_WRITE: start, do not
 * wait), so that the disk writes while later chunks are copied and the commit's sync finds most
 * of the put on its way. Only a hint: durability is the commit's (pages written again later are
 * dirty again; a failed hint is ignored). */
#define ST_WRITEBACK_STEP ((uint64_t)64 << 20)

static void writeback_hint(st_store *st, st_put_ctx *c, const char *from, const char *to)
{
#ifdef SYNC_FILE_RANGE_WRITE
    const char *b = (const char *)st->map_base;
    if (!(st->env_flags & MDB_WRITEMAP) || !b || from < b || to <= from ||
        (uint64_t)(to - b) > st->map_base_size)
        return;
    uint64_t lo = (uint64_t)(from - b) & ~(uint64_t)4095, hi = (uint64_t)(to - b) & ~(uint64_t)4095;
    if (!c->wb_hi)
        c->wb_done = lo; /* the first new chunk: hints start there */
    if (hi > c->wb_hi)
        c->wb_hi = hi;
    if (c->wb_hi < c->wb_done + ST_WRITEBACK_STEP)
        return;
    mdb_filehandle_t fd;
    if (mdb_env_get_fd(st->env, &fd) == 0)
        (void)sync_file_range(fd, (off_t)c->wb_done, (off_t)(c->wb_hi - c->wb_done), SYNC_FILE_RANGE_WRITE);
    c->wb_done = c->wb_hi;
#else
    (void)st;
    (void)c;
    (void)from;
    (void)to;
#endif
}

/* A reserved put writes new chunks of at least this many bytes with pwrite (smaller ones, in
 * B-tree leaves, are copied into the map). */
#define ST_PWRITE_MIN (8u << 10)

/* Whether at, a value LMDB reserved, is the data of an overflow page at its file offset, seen
 * through the map at base: the page's header (LMDB 0.9: 16 bytes, its page number first) must
 * carry the page number of that offset. Guards the offsets pwrite uses against a map address
 * that went stale; false (copy through the map instead) whenever anything does not match. */
static int overflow_at(st_store *st, const char *base, const char *at)
{
    const uint64_t hdr = 16;
    MDB_stat ms;
    if (!base || at < base + hdr || (uint64_t)(at - base) > st->map_base_size || mdb_env_stat(st->env, &ms))
        return 0;
    uint64_t off = (uint64_t)(at - hdr - base), pgno;
    if (off % ms.ms_psize)
        return 0;
    memcpy(&pgno, at - hdr, sizeof pgno);
    return pgno == off / ms.ms_psize;
}

static int pwrite_chunk(st_store *st, int fd, const uint8_t *p, size_t n, uint64_t off)
{
    while (n) {
        ssize_t w = st->sys.pwrite(fd, p, n, off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int e = w < 0 ? errno : EIO;
            return st_error_set(e == ENOSPC || e == EDQUOT ? ST_EFULL : ST_EIO,
                                "store %s: writing a chunk of %zu bytes at offset %llu: %s", st->dir, n,
                                (unsigned long long)off, strerror(e));
        }
        p += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

static int put_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_put_ctx *c = arg;
    st_plan *p = c->plan;
    st_session_rec rec;
    int found = 0;
    memset(&c->stats, 0, sizeof c->stats);
    int rc = session_get(st, txn, c->id, &rec, &found);
    if (rc)
        return rc;
    if (c->expected == ST_STORE_HEAD_NONE && found)
        return st_error_set(ST_ECONFLICT, "session %s exists (head %llu) but a new session was expected", c->id,
                            (unsigned long long)rec.head);
    if (c->expected != ST_STORE_HEAD_ANY && c->expected != ST_STORE_HEAD_NONE) {
        if (!found)
            return st_error_set(ST_ECONFLICT, "session %s does not exist (expected head %llu)", c->id,
                                (unsigned long long)c->expected);
        if (rec.head != c->expected)
            return st_error_set(ST_ECONFLICT, "session %s: expected head %llu, the head is %llu", c->id,
                                (unsigned long long)c->expected, (unsigned long long)rec.head);
    }
    uint64_t now = st_store_now_ns();
    if (found) {
        if (memcmp(rec.geometry_digest, c->digest, ST_STORE_HASH_LEN))
            return geometry_mismatch(st, txn, c->id, &rec, c->img);
    } else {
        memset(&rec, 0, sizeof rec);
        memcpy(rec.model_fp, st_image_geometry(c->img)->model_fp, ST_FINGERPRINT_LEN);
        memcpy(rec.geometry_digest, c->digest, ST_STORE_HASH_LEN);
        rec.next_version = 1;
        rec.created_ns = now;
    }
    uint64_t version = rec.next_version;
    st_manifest_patch(c->mbuf, c->mlen, version, now);
    c->attempts++;
    c->wb_done = c->wb_hi = 0;
    c->t_fn = trace_ms();
    int direct = 0;
    if ((rc = put_populate(st, txn, p, &direct)))
        return rc;
    c->t_pop = trace_ms();
    mdb_filehandle_t fd = -1;
    const char *base = (const char *)st->map_base;
    if (direct && (mdb_env_get_fd(st->env, &fd) || !base))
        direct = 0;
    uint32_t tick = st->verify_tick++;

    for (uint32_t i = 0; i < p->m.n_chunks; i++) {
        const st_piece *pc = &p->pieces[i];
        MDB_val k = {ST_STORE_HASH_LEN, (void *)pc->hash}, v = {pc->stored_len, NULL};
        rc = mdb_put(txn, st->dbi_chunks, &k, &v, MDB_NOOVERWRITE | MDB_RESERVE);
        if (rc == 0) {
            const char *at = (const char *)v.mv_data;
            if (direct && pc->stored_len >= ST_PWRITE_MIN &&
                (!overflow_at(st, base, at) || (uint64_t)(at - base) + pc->stored_len > st->map_base_size))
                direct = 0; /* the map is not where it was looked up: copy through it from now on */
            if (direct && pc->stored_len >= ST_PWRITE_MIN) {
                if ((rc = pwrite_chunk(st, fd, pc->stored, pc->stored_len, (uint64_t)(at - base))))
                    return rc;
                writeback_hint(st, c, at, at + pc->stored_len);
            } else {
                memcpy(v.mv_data, pc->stored, pc->stored_len);
            }
            c->stats.new_chunks++;
            c->stats.new_bytes += pc->stored_len;
        } else if (rc == MDB_KEYEXIST) {
            /* The chunk is stored: its length is compared always, its bytes (a compare with the
             * fresh bytes, cheaper than a rehash) when its first hash byte plus the put's tick is
             * a multiple of ST_VERIFY_EVERY - about one existing chunk in 16 per put, and each
             * chunk at least once in 16 successive puts of the process. A damaged one is repaired
             * in this transaction with the fresh bytes, which hash to the key. */
            if ((rc = st_store__value_check(st, &v, "put: a stored chunk")))
                return rc;
            if (v.mv_size != pc->stored_len || ((pc->hash[0] + tick) % ST_VERIFY_EVERY == 0 &&
                                                memcmp(v.mv_data, pc->stored, pc->stored_len))) {
                MDB_val rv = {pc->stored_len, NULL};
                if ((rc = mdb_put(txn, st->dbi_chunks, &k, &rv, MDB_RESERVE)))
                    return rc;
                memcpy(rv.mv_data, pc->stored, pc->stored_len);
                c->stats.repaired++;
            }
        } else {
            return rc;
        }
        uint64_t cnt = 0;
        rc = mdb_get(txn, st->dbi_refcounts, &k, &v);
        if (rc == 0 && v.mv_size == 8)
            cnt = st_get64(v.mv_data);
        else if (rc != MDB_NOTFOUND && rc != 0)
            return rc;
        uint8_t b[8];
        st_put64(b, cnt + 1);
        MDB_val cv = {8, b};
        if ((rc = mdb_put(txn, st->dbi_refcounts, &k, &cv, 0)))
            return rc;
    }
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, c->id, version), kb}, v = {c->mlen, c->mbuf};
    rc = mdb_put(txn, st->dbi_versions, &k, &v, MDB_NOOVERWRITE);
    if (rc == MDB_KEYEXIST)
        return st_error_set(ST_ECORRUPT, "session %s: version %llu exists already but the session's next version "
                            "says it is new", c->id, (unsigned long long)version);
    if (rc)
        return rc;
    rec.head = version;
    rec.next_version = version + 1;
    rec.n_versions++;
    rec.updated_ns = now;
    if (c->label && (rc = label_apply(&rec, c->id, c->label, version)))
        return rc;
    if ((rc = prune_txn(st, txn, c->id, &rec, st->keep_last, &c->stats.pruned)))
        return rc;
    if ((rc = session_put(st, txn, c->id, &rec)))
        return rc;
    c->t_ins = trace_ms();
    c->stats.version = version;
    c->stats.chunks = p->m.n_chunks;
    c->stats.logical_bytes = p->m.logical_bytes;
    c->stats.stored_bytes = p->m.stored_bytes;
    return 0;
}

typedef struct st_file_as {
    uint32_t version;
    int compress, shuffle;
    const uint8_t *verbatim;
    size_t verbatim_len;
} st_file_as;

typedef struct st_hash_par {
    st_state_hash_task task;
    void *arg;
} st_hash_par;

static int hash_par_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    const st_hash_par *h = ctx;
    h->task(h->arg, i);
    return 0;
}

void st_store__state_hash_runner(void *run_arg, uint64_t n, st_state_hash_task task, void *arg)
{
    st_hash_par h = {task, arg};
    st_store__par_run(*(const unsigned *)run_arg, (size_t)n, hash_par_one, &h);
}

/* A version is only kept when a restore of it can succeed: the state hash the image records
 * (nonzero) must be the hash of its own tokens, K/V and live checkpoint (st_store.h, "the state
 * hash"), or the version would be acknowledged and never restore. */
static int put_state_hash_check(const st_image *img, const char *id, unsigned threads)
{
    uint64_t want = st_image_state_hash(img), got = 0;
    if (want == 0)
        return 0;
    int rc = st_image_state_hash_compute(img, threads > 1 ? st_store__state_hash_runner : NULL, &threads, &got);
    if (rc)
        return rc;
    if (got != want)
        return st_error_set(ST_ECORRUPT, "put %s: state hash mismatch: the image records %016llx, "
                            "its content hashes to %016llx (a restore would fail): nothing was "
                            "written", id, (unsigned long long)want, (unsigned long long)got);
    return 0;
}

static int put_ex(st_store *st, const char *id, const st_image *img, uint64_t expected, const st_put_opts *opts,
                  const st_file_as *fa, uint64_t *version)
{
    st_plan plan;
    uint8_t *geo = NULL;
    size_t geo_len = 0;
    st_put_ctx c;
    int rc;
    memset(&plan, 0, sizeof plan);
    memset(&c, 0, sizeof c);
    if (!st || !img)
        return st_error_set(ST_EINVAL, "put: no store or image");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "put: invalid session id (1..%d bytes of A-Z a-z 0-9 . _ : + = -)",
                            ST_STORE_ID_MAX);
    if (opts && opts->label && !st_store_id_valid(opts->label))
        return st_error_set(ST_EINVAL, "put: invalid label name");
    if (opts && opts->label && strlen(opts->label) >= ST_STORE_LABEL_MAX)
        return st_error_set(ST_EINVAL, "put: label longer than %d bytes", ST_STORE_LABEL_MAX - 1);
    if (opts && (opts->compress < 0 || opts->compress > 19))
        return st_error_set(ST_EINVAL, "put: compression level %d is not 0..19", opts->compress);
    if ((rc = st_image_check(img)))
        return rc;
    if ((rc = st_geometry_encode(st_image_geometry(img), &geo, &geo_len)))
        return rc;
    plan.compress = opts ? opts->compress : 0;
    rc = plan_cut(&plan, img, geo, geo_len, fa ? fa->verbatim : NULL, fa ? fa->verbatim_len : 0);
    if (!rc) {
        plan.m.chunks = calloc(plan.m.n_chunks ? plan.m.n_chunks : 1, sizeof *plan.m.chunks);
        if (!plan.m.chunks)
            rc = st_error_set(ENOMEM, "put: no memory for %u chunks", plan.m.n_chunks);
    }
    if (rc)
        goto done;
    /* Compress and hash before the write transaction (invariant 2). */
    double t0 = trace_ms();
    uint64_t total = st_image_bytes(img);
    unsigned threads = total < ST_PAR_MIN_BYTES ? 1 : st->threads;
    if ((rc = put_state_hash_check(img, id, threads)))
        goto done;
    double th = trace_ms();
    if ((rc = st_store__par_run(threads, plan.m.n_chunks, prepare_one, &plan)))
        goto done;
    plan.m.state_hash = st_image_state_hash(img);
    plan.m.n_tokens = st_image_n_tokens(img);
    plan.m.logical_bytes = total;
    plan.m.compress = (uint32_t)plan.compress;
    for (uint32_t i = 0; i < plan.m.n_chunks; i++)
        plan.m.stored_bytes += plan.pieces[i].stored_len;
    if (fa) {
        plan.m.file_version = fa->version;
        plan.m.file_compress = fa->compress;
        plan.m.file_shuffle = fa->shuffle;
    }
    if ((rc = st_manifest_encode(&plan.m, &c.mbuf, &c.mlen)))
        goto done;
    memcpy(c.digest, plan.pieces[0].hash, ST_STORE_HASH_LEN);
    c.id = id;
    c.plan = &plan;
    c.img = img;
    c.expected = expected;
    c.label = opts ? opts->label : NULL;
    double t1 = trace_ms();
    if ((rc = st_store__write(st, put_fn, &c)))
        goto done;
    if (getenv("STRATA_STORE_TRACE") && *getenv("STRATA_STORE_TRACE"))
        fprintf(stderr, "strata store put %s: %.1f MB in %u chunks (%u new): state hash %.1f ms, "
                "hash and frame %.1f ms, reserve %.1f ms, inserts %.1f ms, commit %.1f ms (%d "
                "attempt%s)\n", id, (double)total / 1e6, plan.m.n_chunks, c.stats.new_chunks,
                th - t0, t1 - th, c.t_pop - c.t_fn,
                c.t_ins - c.t_pop, trace_ms() - c.t_ins, c.attempts, c.attempts == 1 ? "" : "s");
    if (version)
        *version = c.stats.version;
    if (opts && opts->stats)
        *opts->stats = c.stats;
done:
    free(c.mbuf);
    free(geo);
    plan_free(&plan);
    return rc;
}

int st_store_put(st_store *st, const char *id, const st_image *img, uint64_t expected_head,
                 const st_put_opts *opts, uint64_t *version)
{
    return put_ex(st, id, img, expected_head, opts, NULL, version);
}

/* ---- get -------------------------------------------------------------------------------------- */

/* A session record's head version that the versions database lacks: damage, not a deletion (a
 * delete moves the head in the transaction that removes the version). */
static int head_missing(const char *id, uint64_t head)
{
    return st_error_set(ST_ECORRUPT, "session %s records head version %llu, which the store lacks (store damaged: "
                        "`statectl check` names what; `statectl restore-backup` restores a backup)", id,
                        (unsigned long long)head);
}

/* One read: copy the session record and version's manifest out of a read transaction. */
static int manifest_read(st_store *st, const char *id, uint64_t version, uint64_t *resolved, uint8_t **mbuf,
                         size_t *mlen, st_session_rec *rec_out)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    int found = 0;
    *mbuf = NULL;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (rc)
        goto done;
    if ((rc = session_get(st, txn, id, &rec, &found)))
        goto done;
    if (!found) {
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
        goto done;
    }
    uint64_t v = version ? version : rec.head;
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, id, v), kb}, val;
    rc = mdb_get(txn, st->dbi_versions, &k, &val);
    if (rc == MDB_NOTFOUND) {
        rc = v == rec.head ? head_missing(id, v)
                           : st_error_set(ST_ENOTFOUND, "session %s has no version %llu", id, (unsigned long long)v);
        goto done;
    }
    if (rc)
        goto done;
    char what[ST_STORE_ID_MAX + 64];
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    if ((rc = st_store__value_check(st, &val, what)))
        goto done;
    *mbuf = malloc(val.mv_size);
    if (!*mbuf) {
        rc = st_error_set(ENOMEM, "no memory for a manifest of %zu bytes", val.mv_size);
        goto done;
    }
    memcpy(*mbuf, val.mv_data, val.mv_size);
    *mlen = val.mv_size;
    *resolved = v;
    if (rec_out)
        *rec_out = rec;
done:
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc && is_lmdb_code(rc))
        rc = st_store__lmdb_err(rc, "reading a manifest");
    return rc;
}

/* A chunk to bring out of the store into dst (raw_len bytes). */
typedef struct st_job {
    uint32_t chunk;     /* index in the manifest's chunk table */
    uint8_t *dst;
    uint8_t *staged;    /* where its stored bytes were copied when framed (into the stage) */
    const void *src;    /* in the map: valid only while fetch's read transaction is open */
} st_job;

typedef struct st_fetch {
    st_store *st;
    const st_manifest *m;
    st_job *jobs;
    size_t n;
    const char *id;
    uint64_t version;
    int sha;
} st_fetch;

#define ST_CHANGED (-4900) /* private to this file: the manifest changed between two reads */

/* Copy one job's stored bytes out of the map. Runs on helper threads while the thread that owns
 * the read transaction keeps it open (the snapshot's pages stay mapped and unchanged until it
 * ends); the helpers never touch the transaction itself. */
static int fetch_copy_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    const st_fetch *f = ctx;
    const st_job *j = &f->jobs[i];
    memcpy(j->staged ? j->staged : j->dst, j->src, f->m->chunks[j->chunk].stored_len);
    return 0;
}

static int fetch_verify_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_fetch *f = ctx;
    const st_job *j = &f->jobs[i];
    const st_mchunk *c = &f->m->chunks[j->chunk];
    const uint8_t *stored = j->staged ? j->staged : j->dst;
    int ok;
    if (f->sha) {
        uint8_t h[ST_STORE_HASH_LEN];
        int rc = st_store_sha256(stored, c->stored_len, h);
        if (rc)
            return rc;
        ok = !memcmp(h, c->hash, ST_STORE_HASH_LEN);
    } else {
        ok = st_checksum(stored, c->stored_len) == c->xxh;
    }
    char hex[2 * ST_STORE_HASH_LEN + 1];
    if (!ok) {
        st_store_hex(hex, c->hash, ST_STORE_HASH_LEN);
        return st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: %s mismatch (stored bytes damaged)",
                            hex, f->id, (unsigned long long)f->version, f->sha ? "SHA-256" : "checksum");
    }
    if (j->staged) {
        if (!*fctx && !(*fctx = st_frame_ctx_new()))
            return st_error_set(ENOMEM, "no memory for a decompression context");
        size_t out = 0;
        int rc = st_frame_decode(*fctx, j->dst, c->raw_len, j->staged, c->stored_len, &out);
        if (rc || out != c->raw_len) {
            st_store_hex(hex, c->hash, ST_STORE_HASH_LEN);
            return st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: frame does not decode to %u bytes",
                                hex, f->id, (unsigned long long)f->version, c->raw_len);
        }
    }
    return 0;
}

/* Copy the jobs' chunks out of one read transaction (after checking the manifest is still the
 * one in mbuf), end it, then check and decode them (invariant 3). */
static int fetch(st_store *st, const char *id, uint64_t version, const uint8_t *mbuf, size_t mlen,
                 const st_manifest *m, st_job *jobs, size_t n)
{
    MDB_txn *txn = NULL;
    uint8_t *stage = NULL;
    uint64_t stage_len = 0, bytes = 0;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const st_mchunk *c = &m->chunks[jobs[i].chunk];
        if (c->stored_len < c->raw_len)
            stage_len += c->stored_len;
        bytes += c->stored_len;
    }
    if (stage_len && !(stage = malloc(stage_len)))
        return st_error_set(ENOMEM, "no memory to stage %llu compressed bytes", (unsigned long long)stage_len);
    pthread_rwlock_rdlock(&st->lock);
    if ((rc = st_store__rtxn(st, &txn)))
        goto unlock;
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, id, version), kb}, v;
    rc = mdb_get(txn, st->dbi_versions, &k, &v);
    if (rc == MDB_NOTFOUND) {
        rc = st_error_set(ST_ENOTFOUND, "version %llu of session %s was deleted while it was read",
                          (unsigned long long)version, id);
        goto unlock;
    }
    if (!rc)
        rc = st_store__value_check(st, &v, "a manifest");
    if (rc)
        goto unlock;
    if (v.mv_size != mlen || memcmp(v.mv_data, mbuf, mlen)) {
        rc = ST_CHANGED;
        goto unlock;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        st_job *j = &jobs[i];
        const st_mchunk *c = &m->chunks[j->chunk];
        MDB_val ck = {ST_STORE_HASH_LEN, (void *)c->hash}, cv;
        rc = mdb_get(txn, st->dbi_chunks, &ck, &cv);
        if (rc == 0 && cv.mv_size != c->stored_len)
            rc = MDB_CORRUPTED;
        if (rc == 0 && (rc = st_store__value_check(st, &cv, "a chunk")))
            goto unlock;
        if (rc) {
            char hex[2 * ST_STORE_HASH_LEN + 1];
            st_store_hex(hex, c->hash, ST_STORE_HASH_LEN);
            rc = rc == MDB_NOTFOUND
                     ? st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu is missing from the store", hex,
                                    id, (unsigned long long)version)
                     : rc == MDB_CORRUPTED
                           ? st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: %zu bytes stored, %u expected",
                                          hex, id, (unsigned long long)version, cv.mv_size, c->stored_len)
                           : rc;
            goto unlock;
        }
        j->src = cv.mv_data;
        j->staged = NULL;
        if (c->stored_len < c->raw_len) {
            j->staged = stage + off;
            off += c->stored_len;
        }
    }
    {
        /* the copy itself: first touches of a new image's pages are much of a get's cost, and
         * page faults on several threads proceed in parallel */
        st_fetch cf = {st, m, jobs, n, id, version, 0};
        rc = st_store__par_run(bytes < ST_PAR_MIN_BYTES ? 1 : st->threads, n, fetch_copy_one, &cf);
    }
unlock:
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (!rc) {
        st_fetch f = {st, m, jobs, n, id, version, st->opts.verify_sha256};
        unsigned threads = bytes < ST_PAR_MIN_BYTES ? 1 : st->threads;
        rc = st_store__par_run(threads, n, fetch_verify_one, &f);
    } else if (is_lmdb_code(rc)) {
        rc = st_store__lmdb_err(rc, "reading chunks");
    }
    free(stage);
    return rc;
}

/* Check that the manifest's sections are exactly what an image of geometry g needs. */
int st_store__manifest_layout_check(const st_manifest *m, const st_geometry *g, const char *what)
{
    uint32_t s = 0;
#define EXPECT(cond, ...)                                                                                  \
    do {                                                                                                   \
        if (!(cond))                                                                                       \
            return st_error_set(ST_ECORRUPT, __VA_ARGS__);                                                 \
    } while (0)
    EXPECT(m->n_tokens <= g->n_ctx, "%s: %llu tokens exceed n_ctx %u", what, (unsigned long long)m->n_tokens,
           g->n_ctx);
    EXPECT(m->n_sec >= 2 && m->sec[0].type == ST_MSEC_GEOMETRY && m->sec[0].n_chunks == 1 &&
               m->sec[1].type == ST_MSEC_TOKENS && m->sec[1].length == m->n_tokens * 4,
           "%s: manifest does not start with the geometry and %llu tokens", what, (unsigned long long)m->n_tokens);
    s = 2;
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        const st_tensor_desc *t = &g->tensors[ti];
        if (t->role != ST_ROLE_KV)
            continue;
        EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_KV && m->sec[s].index == ti &&
                   m->sec[s].length == m->n_tokens * st_tensor_row_bytes(t),
               "%s: manifest section %u is not K/V tensor %u (\"%s\") of %llu tokens", what, s, ti, t->name,
               (unsigned long long)m->n_tokens);
        s++;
    }
    for (uint32_t c = 0; c < m->n_ckpt; c++) {
        EXPECT(st_codec_check(m->ckpt[c].codec) == 0, "%s: checkpoint %u has unknown codec %u", what, c,
               m->ckpt[c].codec);
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            const st_tensor_desc *t = &g->tensors[ti];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_CKPT && m->sec[s].index == c &&
                       m->sec[s].tensor == ti && m->sec[s].length == st_tensor_stored_bytes(t, m->ckpt[c].codec),
                   "%s: manifest section %u is not checkpoint %u tensor %u (\"%s\")", what, s, c, ti, t->name);
            s++;
        }
    }
    if (s < m->n_sec && m->sec[s].type == ST_MSEC_LOGITS) {
        EXPECT(g->n_vocab && m->sec[s].length == (uint64_t)g->n_vocab * 4, "%s: logits section of %llu bytes",
               what, (unsigned long long)m->sec[s].length);
        s++;
    }
    if (m->flags & ST_MANIFEST_VERBATIM) {
        EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_FILE, "%s: manifest lacks its file section", what);
        s++;
    }
    EXPECT(s == m->n_sec, "%s: manifest has %u sections, the geometry explains %u", what, m->n_sec, s);
#undef EXPECT
    return 0;
}

static int jobs_for_section(const st_manifest *m, uint32_t s, uint8_t *base, st_job *jobs, size_t *n)
{
    const st_msection *sec = &m->sec[s];
    uint64_t off = 0;
    for (uint32_t j = 0; j < sec->n_chunks; j++) {
        jobs[*n].chunk = sec->first + j;
        jobs[*n].dst = base + off;
        jobs[*n].staged = NULL;
        off += m->chunks[sec->first + j].raw_len;
        (*n)++;
    }
    return 0;
}

/* Three read transactions: the geometry, the tokens, everything else; each copies out and ends
 * before its chunks are checked (invariant 3). A manifest replaced in between makes fetch
 * answer ST_CHANGED and the caller start over. */
static int get_once(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                    st_image **out)
{
    uint8_t *mbuf = NULL, *geo = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    st_session_rec rec;
    st_geometry g;
    st_tensor_desc *gt = NULL;
    uint32_t *tokens = NULL;
    float *logits = NULL;
    st_job *jobs = NULL;
    st_image *img = NULL;
    char what[ST_STORE_ID_MAX + 64];
    size_t nj = 0;
    memset(&m, 0, sizeof m);
    int rc = manifest_read(st, id, version, &v, &mbuf, &mlen, &rec);
    if (rc)
        return rc;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    if ((rc = st_manifest_parse(mbuf, mlen, what, &m)))
        goto done;
    if (m.n_sec < 2 || m.sec[0].type != ST_MSEC_GEOMETRY || m.sec[0].n_chunks != 1 ||
        m.chunks[0].stored_len != m.chunks[0].raw_len || m.sec[1].type != ST_MSEC_TOKENS) {
        rc = st_error_set(ST_ECORRUPT, "%s: manifest does not start with a geometry and tokens", what);
        goto done;
    }
    jobs = calloc(m.n_chunks ? m.n_chunks : 1, sizeof *jobs);
    geo = malloc(m.chunks[0].raw_len);
    if (!jobs || !geo) {
        rc = st_error_set(ENOMEM, "%s: no memory", what);
        goto done;
    }
    /* First the geometry (one chunk of at most 4 MiB): every other length is checked against it
     * before anything is allocated for it. */
    jobs_for_section(&m, 0, geo, jobs, &nj);
    if ((rc = fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    if ((rc = st_geometry_decode(geo, m.chunks[0].raw_len, &g, &gt)))
        goto done;
    memcpy(g.arch, m.arch, ST_ARCH_NAME_MAX);
    if ((rc = st_store__manifest_layout_check(&m, &g, what)))
        goto done;
    /* Then the tokens (n_tokens <= n_ctx now), to build the image. */
    if (!(tokens = malloc(m.sec[1].length ? m.sec[1].length : 1))) {
        rc = st_error_set(ENOMEM, "%s: no memory for %llu tokens", what, (unsigned long long)m.n_tokens);
        goto done;
    }
    nj = 0;
    jobs_for_section(&m, 1, (uint8_t *)tokens, jobs, &nj);
    if ((rc = fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    /* every K/V row and checkpoint tensor is one of the sections copied below (the layout
     * check), so nothing is zeroed first; an image whose copy fails is freed */
    if ((rc = st_image_create_with(&img, &g, alloc)))
        goto done;
    if ((rc = st_image_tokens_set_unzeroed(img, tokens, m.n_tokens)))
        goto done;
    for (uint32_t c = 0; c < m.n_ckpt; c++)
        if ((rc = st_image_checkpoint_add_unzeroed(img, m.ckpt[c].position, m.ckpt[c].codec, NULL))) {
            char d[512];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(ST_ECORRUPT, "%s: checkpoint %u: %s", what, c, d);
            goto done;
        }
    /* Last, everything else, straight into the image. */
    nj = 0;
    for (uint32_t s = 2; s < m.n_sec; s++) {
        const st_msection *sec = &m.sec[s];
        uint8_t *base = NULL;
        uint64_t len = 0;
        if (sec->type == ST_MSEC_KV) {
            base = st_image_kv(img, sec->index, &len);
        } else if (sec->type == ST_MSEC_CKPT) {
            base = st_image_checkpoint_tensor(img, sec->index, sec->tensor, &len);
        } else if (sec->type == ST_MSEC_LOGITS) {
            logits = malloc(sec->length);
            base = (uint8_t *)logits;
            len = sec->length;
        } else {
            continue; /* FILE: only export reads it */
        }
        if (!base || len != sec->length) {
            rc = st_error_set(base ? ST_ECORRUPT : ENOMEM, "%s: section %u of %llu bytes does not fit the image", what,
                              s, (unsigned long long)sec->length);
            goto done;
        }
        jobs_for_section(&m, s, base, jobs, &nj);
    }
    if ((rc = fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    if (logits && (rc = st_image_logits_set(img, logits, g.n_vocab)))
        goto done;
    st_image_state_hash_set(img, m.state_hash);
    if ((rc = st_image_check(img))) {
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        rc = st_error_set(ST_ECORRUPT, "%s: the stored image is incomplete: %s", what, d);
        goto done;
    }
    *out = img;
    img = NULL;
done:
    st_image_free(img);
    st_manifest_free(&m);
    free(mbuf);
    free(geo);
    free(gt);
    free(tokens);
    free(logits);
    free(jobs);
    return rc;
}

int st_store_get(st_store *st, const char *id, uint64_t version, st_image **out)
{
    return st_store_get_with(st, id, version, NULL, out);
}

int st_store_get_with(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                      st_image **out)
{
    if (!st || !out)
        return st_error_set(ST_EINVAL, "get: no store or out pointer");
    *out = NULL;
    for (int i = 0; i < ST_GET_RETRIES; i++) {
        int rc = get_once(st, id, version, alloc, out);
        if (rc != ST_CHANGED)
            return rc;
    }
    return st_error_set(ST_EBUSY, "get: session %s kept changing while it was read", id);
}

/* ---- export and import ----------------------------------------------------------------------- */

static int export_verbatim(st_store *st, const char *id, uint64_t v, const uint8_t *mbuf, size_t mlen,
                           const st_manifest *m, const char *path)
{
    const st_msection *sec = &m->sec[m->n_sec - 1];
    st_job *jobs = calloc(sec->n_chunks ? sec->n_chunks : 1, sizeof *jobs);
    uint8_t *buf = malloc(sec->length ? sec->length : 1);
    size_t nj = 0;
    int rc = 0;
    if (!jobs || !buf) {
        rc = st_error_set(ENOMEM, "export: no memory for %llu bytes", (unsigned long long)sec->length);
        goto done;
    }
    jobs_for_section(m, m->n_sec - 1, buf, jobs, &nj);
    st_store__progress(st, "read", 0, sec->length);
    if ((rc = fetch(st, id, v, mbuf, mlen, m, jobs, nj)))
        goto done;
    st_store__progress(st, "read", sec->length, sec->length);
    rc = st_file_replace(path, buf, sec->length);
done:
    free(jobs);
    free(buf);
    return rc;
}

static void export_progress(void *arg, uint64_t done, uint64_t total)
{
    st_store__progress(arg, "write", done, total);
}

int st_store_export(st_store *st, const char *id, uint64_t version, const char *path,
                    const st_file_write_opts *fopts)
{
    uint8_t *mbuf = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    st_image *img = NULL;
    char what[ST_STORE_ID_MAX + 64];
    memset(&m, 0, sizeof m);
    if (!st || !path)
        return st_error_set(ST_EINVAL, "export: no store or path");
    for (int attempt = 0;; attempt++) {
        int rc = manifest_read(st, id, version, &v, &mbuf, &mlen, NULL);
        if (rc)
            return rc;
        snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
        rc = st_manifest_parse(mbuf, mlen, what, &m);
        if (!rc && !fopts && (m.flags & ST_MANIFEST_VERBATIM)) {
            if (m.sec[m.n_sec - 1].type != ST_MSEC_FILE)
                rc = st_error_set(ST_ECORRUPT, "%s: manifest lacks its file section", what);
            else
                rc = export_verbatim(st, id, v, mbuf, mlen, &m, path);
        } else if (!rc) {
            st_file_write_opts fo = {.version = m.file_version, .compress = m.file_compress,
                                     .shuffle = m.file_shuffle};
            if (fopts)
                fo = *fopts;
            if (!fo.progress && st->opts.progress) {
                fo.progress = export_progress;
                fo.progress_arg = st;
            }
            rc = st_store_get(st, id, v, &img);
            if (!rc)
                rc = st_file_write(img, path, &fo);
            st_image_free(img);
            img = NULL;
        }
        st_manifest_free(&m);
        free(mbuf);
        mbuf = NULL;
        if (rc != ST_CHANGED)
            return rc;
        if (attempt + 1 >= ST_GET_RETRIES)
            return st_error_set(ST_EBUSY, "export: session %s kept changing while it was read", id);
    }
}

static int read_whole(const char *path, uint8_t **out, size_t *out_len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    uint8_t *buf = NULL;
    struct stat sb;
    int rc = 0;
    *out = NULL;
    if (fd < 0)
        return st_error_set(errno == ENOENT ? ST_ENOTFOUND : errno, "import: %s: %s", path, strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = st_error_set(ST_EINVAL, "import: %s is not a regular file", path);
        goto done;
    }
    size_t len = (size_t)sb.st_size;
    if (!(buf = malloc(len ? len : 1))) {
        rc = st_error_set(ENOMEM, "import: no memory for the %zu bytes of %s", len, path);
        goto done;
    }
    for (size_t off = 0; off < len;) {
        ssize_t r = read(fd, buf + off, len - off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            rc = st_error_set(r < 0 ? errno : ST_EIO, "import: reading %s: %s", path,
                              r < 0 ? strerror(errno) : "file shrank while read");
            goto done;
        }
        off += (size_t)r;
    }
    *out = buf;
    *out_len = len;
    buf = NULL;
done:
    free(buf);
    close(fd);
    return rc;
}

int st_store_import(st_store *st, const char *path, const char *id, const st_put_opts *opts, uint64_t *version)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    st_image *img = NULL;
    st_file_info info;
    st_file_as fa;
    memset(&info, 0, sizeof info);
    memset(&fa, 0, sizeof fa);
    if (!st || !path)
        return st_error_set(ST_EINVAL, "import: no store or path");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "import: invalid session id (1..%d bytes of A-Z a-z 0-9 . _ : + = -)",
                            ST_STORE_ID_MAX);
    st_store__progress(st, "read", 0, 1);
    int rc = read_whole(path, &buf, &len);
    if (!rc)
        rc = st_file_read_mem(buf, len, NULL, &img);
    if (!rc)
        rc = st_file_inspect(path, &info);
    if (rc)
        goto done;
    st_store__progress(st, "read", 1, 1);
    /* Find the writer options that give these very bytes back; else keep the bytes too. */
    int compressed = 0;
    for (uint32_t i = 0; i < info.n_sections; i++)
        compressed |= info.sections[i].compressed != 0;
    st_file_write_opts cand[3];
    int n_cand = 0;
    memset(cand, 0, sizeof cand);
    if (!compressed) {
        cand[n_cand++] = (st_file_write_opts){.version = info.version};
    } else {
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = ST_FRAME_LEVEL_DEFAULT, .shuffle = 1};
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = ST_FRAME_LEVEL_DEFAULT};
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = 1, .shuffle = 1};
    }
    int exact = 0;
    for (int i = 0; i < n_cand && !exact; i++) {
        uint8_t *re = NULL;
        size_t re_len = 0;
        if (st_file_write_mem(img, &cand[i], &re, &re_len) == 0)
            exact = re_len == len && !memcmp(re, buf, len);
        free(re);
        if (exact) {
            fa.version = cand[i].version;
            fa.compress = cand[i].compress;
            fa.shuffle = cand[i].shuffle;
        }
    }
    if (!exact) {
        fa.version = info.version;
        fa.verbatim = buf;
        fa.verbatim_len = len;
    } else {
        free(buf);
        buf = NULL;
    }
    st_store__progress(st, "store", 0, 1);
    rc = put_ex(st, id, img, ST_STORE_HEAD_ANY, opts, &fa, version);
    if (!rc)
        st_store__progress(st, "store", 1, 1);
done:
    st_file_info_free(&info);
    st_image_free(img);
    free(buf);
    return rc;
}

/* ---- listing ------------------------------------------------------------------------------------ */

static void session_info_fill(st_session_info *si, const char *id, size_t idlen, const st_session_rec *r)
{
    memset(si, 0, sizeof *si);
    memcpy(si->id, id, idlen);
    si->id[idlen] = '\0';
    memcpy(si->model_fp, r->model_fp, ST_FINGERPRINT_LEN);
    memcpy(si->geometry_digest, r->geometry_digest, ST_STORE_HASH_LEN);
    si->head = r->head;
    si->n_versions = r->n_versions;
    si->next_version = r->next_version;
    si->created_ns = r->created_ns;
    si->updated_ns = r->updated_ns;
    si->n_labels = r->n_labels;
    memcpy(si->labels, r->labels, sizeof si->labels);
}

/* The session under the cursor (k, v) into si (marked damaged when its record does not decode);
 * ST_ECORRUPT for a key that is no session id. */
static int session_info_from(st_store *st, st_session_info *si, const MDB_val *k, const MDB_val *v)
{
    char id[ST_STORE_ID_MAX + 1];
    if (k->mv_size == 0 || k->mv_size > ST_STORE_ID_MAX)
        return st_error_set(ST_ECORRUPT, "sessions database holds a key of %zu bytes", k->mv_size);
    memcpy(id, k->mv_data, k->mv_size);
    id[k->mv_size] = '\0';
    st_session_rec rec;
    int rc = st_store__value_check(st, v, "a session record");
    if (!rc)
        rc = st_session_parse(v->mv_data, v->mv_size, id, &rec);
    if (!rc) {
        session_info_fill(si, id, k->mv_size, &rec);
    } else if (rc == ST_ECORRUPT) {
        /* one damaged record does not hide the others */
        memset(si, 0, sizeof *si);
        memcpy(si->id, id, k->mv_size + 1);
        si->damaged = 1;
        rc = 0;
    }
    return rc;
}

void st_store_damaged_dbs_set(st_store *st, uint32_t dbs)
{
    if (st)
        st->damaged_dbs = dbs;
}

/* A cursor over a sessions database with a damaged page could enter it (LMDB trusts pages). */
static int sessions_walk_ok(const st_store *st)
{
    if (st->damaged_dbs & ST_STORE_DB_SESSIONS)
        return st_error_set(ST_ECORRUPT, "store %s: the sessions database has a damaged page, so sessions cannot be "
                            "listed (`statectl check` names it; `statectl restore-backup` restores a backup)",
                            st->dir);
    return 0;
}

int st_store_list(st_store *st, st_session_info **out, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    st_session_info *arr = NULL;
    size_t cnt = 0, cap = 0;
    if (!st || !out || !n)
        return st_error_set(ST_EINVAL, "list: bad arguments");
    *out = NULL;
    *n = 0;
    pthread_rwlock_rdlock(&st->lock);
    int rc = sessions_walk_ok(st);
    if (!rc)
        rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = mdb_cursor_open(txn, st->dbi_sessions, &cur);
    MDB_val k, v;
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        rc = mdb_cursor_get(cur, &k, &v, op);
        if (rc)
            break;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 64;
            st_session_info *na = realloc(arr, cap * sizeof *na);
            if (!na) {
                rc = st_error_set(ENOMEM, "list: no memory");
                break;
            }
            arr = na;
        }
        if ((rc = session_info_from(st, &arr[cnt], &k, &v)))
            break;
        cnt++;
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc) {
        free(arr);
        return is_lmdb_code(rc) ? st_store__lmdb_err(rc, "listing sessions") : rc;
    }
    *out = arr;
    *n = cnt;
    return 0;
}

/* One read transaction; the cursor is placed with MDB_SET_RANGE on `after` (the first key >= it)
 * and steps over `after` itself, so only the page's records are read and parsed. */
int st_store_list_page(st_store *st, const char *after, st_session_info *out, size_t limit, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    size_t cnt = 0;
    if (!st || !n || (limit && !out))
        return st_error_set(ST_EINVAL, "list page: bad arguments");
    *n = 0;
    if (after && *after && !st_store_id_valid(after))
        return st_error_set(ST_EINVAL, "list page: `after` is not a valid session id");
    if (!limit)
        return 0;
    size_t alen = after ? strlen(after) : 0;
    pthread_rwlock_rdlock(&st->lock);
    int rc = sessions_walk_ok(st);
    if (!rc)
        rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = mdb_cursor_open(txn, st->dbi_sessions, &cur);
    MDB_val k = {alen, (void *)after}, v;
    if (!rc)
        rc = mdb_cursor_get(cur, &k, &v, alen ? MDB_SET_RANGE : MDB_FIRST);
    if (!rc && alen && k.mv_size == alen && !memcmp(k.mv_data, after, alen))
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    while (!rc) {
        if ((rc = session_info_from(st, &out[cnt], &k, &v)))
            break;
        if (++cnt == limit)
            break;
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return is_lmdb_code(rc) ? st_store__lmdb_err(rc, "listing sessions") : rc;
    *n = cnt;
    return 0;
}

int st_store_show(st_store *st, const char *id, st_session_info *out)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    int found = 0;
    if (!st || !out)
        return st_error_set(ST_EINVAL, "show: bad arguments");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "show: invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = session_get(st, txn, id, &rec, &found);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return is_lmdb_code(rc) ? st_store__lmdb_err(rc, "reading a session") : rc;
    if (!found)
        return st_error_set(ST_ENOTFOUND, "no session %s", id);
    session_info_fill(out, id, strlen(id), &rec);
    return 0;
}

static void version_info_fill(st_version_info *vi, const st_manifest *m)
{
    memset(vi, 0, sizeof *vi);
    vi->version = m->version;
    vi->created_ns = m->created_ns;
    vi->n_tokens = m->n_tokens;
    vi->state_hash = m->state_hash;
    vi->logical_bytes = m->logical_bytes;
    vi->stored_bytes = m->stored_bytes;
    vi->n_checkpoints = m->n_ckpt;
    vi->last_position = m->n_ckpt ? m->ckpt[m->n_ckpt - 1].position : 0;
    vi->n_chunks = m->n_chunks;
    vi->compress = m->compress;
    vi->file_version = m->file_version;
    vi->file_verbatim = (m->flags & ST_MANIFEST_VERBATIM) != 0;
    memcpy(vi->arch, m->arch, ST_ARCH_NAME_MAX);
    vi->codec = m->n_ckpt ? m->ckpt[m->n_ckpt - 1].codec : ST_CODEC_FP32;
    for (uint32_t c = 0; c < m->n_ckpt; c++)
        vi->codecs |= m->ckpt[c].codec < 31 ? 1u << m->ckpt[c].codec : ST_VERSION_CODEC_OTHER;
    for (uint32_t i = 0; i < m->n_chunks; i++)
        vi->n_framed += m->chunks[i].stored_len < m->chunks[i].raw_len;
}

void st_version_codecs_text(uint32_t codecs, char *out, size_t cap)
{
    size_t n = 0;
    if (!cap)
        return;
    out[0] = 0;
    for (uint32_t c = 0; c < 32; c++) {
        if (!(codecs & (1u << c)))
            continue;
        const char *name = (1u << c) == ST_VERSION_CODEC_OTHER ? "other" : st_codec_name(c);
        int w = snprintf(out + n, cap - n, "%s%s", n ? "+" : "", name);
        if (w < 0 || (size_t)w >= cap - n)
            return;
        n += (size_t)w;
    }
    if (!n)
        snprintf(out, cap, "none");
}

int st_store_versions(st_store *st, const char *id, st_version_info **out, size_t *n)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    uint64_t *vs = NULL;
    size_t nv = 0;
    st_version_info *arr = NULL;
    int found = 0;
    if (!st || !out || !n)
        return st_error_set(ST_EINVAL, "versions: bad arguments");
    *out = NULL;
    *n = 0;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "versions: invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = session_get(st, txn, id, &rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    if (!rc)
        rc = session_versions(st, txn, id, &vs, &nv);
    if (!rc && !(arr = calloc(nv ? nv : 1, sizeof *arr)))
        rc = st_error_set(ENOMEM, "versions: no memory");
    for (size_t i = 0; i < nv && !rc; i++) {
        uint8_t kb[ST_VKEY_MAX];
        char what[ST_STORE_ID_MAX + 64];
        MDB_val k = {st_vkey(kb, id, vs[i]), kb}, v;
        st_manifest m;
        snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)vs[i]);
        rc = mdb_get(txn, st->dbi_versions, &k, &v);
        if (!rc)
            rc = st_store__value_check(st, &v, what);
        if (!rc)
            rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m);
        if (!rc) {
            version_info_fill(&arr[i], &m);
            st_manifest_free(&m);
        }
    }
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    free(vs);
    if (rc) {
        free(arr);
        return is_lmdb_code(rc) ? st_store__lmdb_err(rc, "listing versions") : rc;
    }
    *out = arr;
    *n = nv;
    return 0;
}

/* The versions key orders a session's versions by number (big-endian after the id and its 0x00),
 * so MDB_SET_RANGE on (id, after + 1) finds the page's first version without reading others. */
int st_store_versions_page(st_store *st, const char *id, uint64_t after, st_version_info *out,
                           size_t limit, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    st_session_rec rec;
    int found = 0;
    size_t cnt = 0;
    if (!st || !n || (limit && !out))
        return st_error_set(ST_EINVAL, "versions page: bad arguments");
    *n = 0;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "versions page: invalid session id");
    size_t idlen = strlen(id);
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = session_get(st, txn, id, &rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    if (!rc && limit && after != UINT64_MAX)
        rc = mdb_cursor_open(txn, st->dbi_versions, &cur);
    if (!rc && cur) {
        uint8_t kb[ST_VKEY_MAX];
        MDB_val k = {st_vkey(kb, id, after + 1), kb}, v;
        for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); !rc && cnt < limit;
             rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
            uint64_t ver;
            if (!st_vkey_of(k.mv_data, k.mv_size, id, idlen, &ver))
                break;
            char what[ST_STORE_ID_MAX + 64];
            snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)ver);
            st_manifest m;
            if ((rc = st_store__value_check(st, &v, what)) || (rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m)))
                break;
            version_info_fill(&out[cnt++], &m);
            st_manifest_free(&m);
        }
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return is_lmdb_code(rc) ? st_store__lmdb_err(rc, "listing versions") : rc;
    *n = cnt;
    return 0;
}

int st_store_version_info(st_store *st, const char *id, uint64_t version, st_version_info *out)
{
    uint8_t *mbuf = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    char what[ST_STORE_ID_MAX + 64];
    if (!st || !out)
        return st_error_set(ST_EINVAL, "version info: bad arguments");
    int rc = manifest_read(st, id, version, &v, &mbuf, &mlen, NULL);
    if (rc)
        return rc;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    rc = st_manifest_parse(mbuf, mlen, what, &m);
    if (!rc) {
        version_info_fill(out, &m);
        st_manifest_free(&m);
    }
    free(mbuf);
    return rc;
}

/* ---- deletion and labels --------------------------------------------------------------------------- */

typedef struct st_del_ctx {
    const char *id;
    uint64_t version; /* 0: the whole session */
    const char *label;
    int remove_label;
} st_del_ctx;

static int session_require(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec)
{
    int found = 0;
    int rc = session_get(st, txn, id, rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    return rc;
}

static int delete_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_del_ctx *c = arg;
    st_session_rec rec;
    uint64_t *vs = NULL;
    size_t n = 0;
    int rc = session_require(st, txn, c->id, &rec);
    if (rc)
        return rc;
    if (c->version) {
        if ((rc = version_delete_txn(st, txn, c->id, c->version, &rec)))
            return rc;
    } else {
        if ((rc = session_versions(st, txn, c->id, &vs, &n)))
            return rc;
        for (size_t i = 0; i < n && !rc; i++)
            rc = version_delete_txn(st, txn, c->id, vs[i], &rec);
        free(vs);
        vs = NULL;
        if (rc)
            return rc;
    }
    MDB_val k = {strlen(c->id), (void *)c->id};
    if ((rc = session_versions(st, txn, c->id, &vs, &n)))
        return rc;
    if (n == 0) {
        rc = mdb_del(txn, st->dbi_sessions, &k, NULL);
    } else {
        rec.head = vs[n - 1];
        rec.n_versions = n;
        rec.updated_ns = st_store_now_ns();
        rc = session_put(st, txn, c->id, &rec);
    }
    free(vs);
    return rc;
}

int st_store_version_delete(st_store *st, const char *id, uint64_t version)
{
    if (!st || !st_store_id_valid(id) || version == 0)
        return st_error_set(ST_EINVAL, "version delete: bad session id or version 0");
    st_del_ctx c = {.id = id, .version = version};
    return st_store__write(st, delete_fn, &c);
}

int st_store_session_delete(st_store *st, const char *id)
{
    if (!st || !st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "session delete: bad session id");
    st_del_ctx c = {.id = id};
    return st_store__write(st, delete_fn, &c);
}

static int label_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_del_ctx *c = arg;
    st_session_rec rec;
    int rc = session_require(st, txn, c->id, &rec);
    if (rc)
        return rc;
    if (c->remove_label) {
        int i = label_index(&rec, c->label);
        if (i < 0)
            return st_error_set(ST_ENOTFOUND, "session %s has no label \"%s\"", c->id, c->label);
        rec.labels[i] = rec.labels[rec.n_labels - 1];
        rec.n_labels--;
    } else {
        uint64_t v = c->version ? c->version : rec.head;
        uint8_t kb[ST_VKEY_MAX];
        MDB_val k = {st_vkey(kb, c->id, v), kb}, val;
        rc = mdb_get(txn, st->dbi_versions, &k, &val);
        if (rc == MDB_NOTFOUND)
            return st_error_set(ST_ENOTFOUND, "session %s has no version %llu", c->id, (unsigned long long)v);
        if (rc)
            return rc;
        if ((rc = label_apply(&rec, c->id, c->label, v)))
            return rc;
    }
    return session_put(st, txn, c->id, &rec);
}

int st_store_label_set(st_store *st, const char *id, const char *name, uint64_t version)
{
    if (!st || !st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "label set: bad session id");
    if (!st_store_id_valid(name) || strlen(name) >= ST_STORE_LABEL_MAX)
        return st_error_set(ST_EINVAL, "label set: a label is 1..%d bytes of A-Z a-z 0-9 . _ : + = -",
                            ST_STORE_LABEL_MAX - 1);
    st_del_ctx c = {.id = id, .version = version, .label = name};
    return st_store__write(st, label_fn, &c);
}

int st_store_label_remove(st_store *st, const char *id, const char *name)
{
    if (!st || !st_store_id_valid(id) || !name)
        return st_error_set(ST_EINVAL, "label remove: bad session id or name");
    st_del_ctx c = {.id = id, .label = name, .remove_label = 1};
    return st_store__write(st, label_fn, &c);
}
