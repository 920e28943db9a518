/*
 * st_store_direct.c - the put's fast path, the one part of the store that relies on LMDB
 * internals lmdb.h never promises, and the plain path it falls back to. Nothing else in the
 * store's put depends on them (the page walker of st_store_pages.c, which reads data.mdb as a
 * file for check and value checks, tests its own LMDB version: st_store__pages_version_ok).
 *
 * The fast path (docs/STORE.md "Writing"): ahead of each new chunk, the file range the put's
 * new chunks take is extended (less the pages on LMDB's free list) and reserved with fallocate
 * (or populated with madvise), and each large new chunk is written with pwrite at the file
 * offset of the value LMDB reserved for it, by a writer thread, finished ranges handed to
 * writeback as the put goes; the map does no read-around while the transaction runs.
 *
 * Its assumptions about LMDB, each checked at open against the running liblmdb by
 * st_store__direct_probe (A1-A3, A7 there; A4 and A5 also at every chunk they are used for):
 *  A1. liblmdb is 0.9.x by mdb_version() (the release whose layout A2-A6 describe), and so is
 *      the lmdb.h this was built with.
 *  A2. A page starts with a 16-byte header: its page number (pgno_t, a 64-bit size_t) at offset
 *      0, its flags (u16) at offset 10. A meta page (pages 0 and 1) has flag P_META (0x08) and,
 *      after the header, the magic 0xBEEFC0DE, data version 1, and the page size in the free
 *      database's md_pad (header + 24). Probe: both meta pages read from data.mdb with pread.
 *  A3. The page size the meta records is mdb_env_stat's ms_psize, a power of two and a multiple
 *      of the OS page size (so page offsets are file offsets pwrite and fallocate may use).
 *  A4. A value longer than a page lives in overflow pages: mdb_put(MDB_RESERVE) returns a
 *      pointer into the map 16 bytes (the header) past its first page, whose header holds that
 *      page's number (st_store__overflow_at checks it before every pwrite).
 *  A5. With MDB_WRITEMAP the map is one shared mapping of data.mdb from offset 0 of exactly
 *      me_mapsize bytes, listed in /proc/self/maps (map_base), and the page cache behind a
 *      pwrite of the file is the map's, so LMDB sees the bytes pwrite put there.
 *  A6. The free-list database is DBI 0, readable with a cursor in a write transaction; each of
 *      its values is a page list led by its length (a size_t); a write takes pages from it
 *      before it extends the file past me_last_pgno.
 *  A7. The host is Linux with 64-bit size_t: /proc/self/maps, fallocate, sync_file_range.
 * A wrong A6 only mis-sizes the reservation; a wrong A4 or A5 would put chunk bytes at wrong
 * offsets, which is why each pwrite is guarded and the put copies through the map from the first
 * value that does not match.
 *
 * The plain path, taken when the probe finds an assumption that does not hold, when the store
 * is read-only or opened without MDB_WRITEMAP, or when the environment variable
 * STRATA_STORE_PLAIN_PUT is set (non-empty, not "0": tests force it so): chunks are inserted
 * with plain mdb_put of their bytes; the reservation uses lmdb.h alone (the new chunks' pages,
 * without the free list, fallocate'd past me_last_pgno; nothing is populated or pwritten).
 * Why the fast path is off is in st_store_stats.put_path, the STRATA_STORE_TRACE lines and
 * st_store__direct_status.
 *
 * Invariants:
 * 1. The path is chosen once per handle, at open (st->direct, st->direct_why), before any put.
 * 2. Both paths store the same bytes under the same keys in the same transaction: the choice
 *    changes only how the bytes reach the file, never what a get, check or export reads.
 * 3. No pwrite happens at an offset whose value A4 did not confirm in this transaction.
 * 4. Every pwrite of a transaction (the writer thread's) has finished before it commits or
 *    aborts: st_store__direct_end joins the writer, and put_fn calls it on every return.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

#define ST_POPULATE_MARGIN_PAGES 16ull    /* room for a put's copied B-tree and meta pages */
#define ST_POPULATE_MARGIN_MAX (64ull << 20)

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
 * 20 us on the benchmark VM). So the file range a put's new chunks take is reserved as the put
 * goes, ahead of each new chunk (the chunks are hashed while earlier ones are written, so which
 * are new is known one at a time): only new chunks count (looked up in this transaction), less
 * the pages on LMDB's free list (which it uses first), plus a margin for the B-tree pages the put
 * copies. The range is reserved with fallocate in steps of at least ST_RESERVE_STEP (the disk
 * says before each chunk whether it can take it: ST_EFULL), and d->on tells the put to write the
 * new chunks' bytes with pwrite at the places LMDB gives them (no fault, no zeroing of pages that
 * are overwritten at once); where the file system cannot fallocate, the range is populated with
 * madvise(MADV_POPULATE_WRITE) instead (EFAULT: ST_EFULL) and the bytes are copied into the map.
 * When the chunks could not fit past the last page even if all were new (their raw sizes are
 * known before any is hashed) and the map may still grow, st_store__direct_begin returns
 * MDB_MAP_FULL at once (the caller grows the map and runs the transaction again) instead of
 * inserting until LMDB finds the map full; a reservation that does not fit later returns it too.
 * Pages LMDB takes from its free list beyond the estimate leave part of the range unused for
 * later puts; a step reserves at most ST_RESERVE_STEP past what the put needs.
 * On the plain path (!st->direct) only what lmdb.h tells is used: the new chunks' pages plus the
 * margin are reserved past me_last_pgno (the free list is not read, so it may reserve more than
 * the put takes), nothing is populated, no MDB_MAP_FULL is predicted, and d->on stays 0. */
#define ST_RESERVE_STEP ((uint64_t)32 << 20)

static uint64_t pages_of(uint64_t psize, uint64_t stored_len)
{
    return (stored_len + 16 + psize - 1) / psize * psize; /* overflow pages and their header */
}

/* Make the reservation cover add more bytes of new pages (beyond the free list's). */
static int reserve_more(st_store *st, st_direct *d, uint64_t add)
{
    d->need += add;
    uint64_t net = d->need > d->credit ? d->need - d->credit : 0;
    uint64_t target = d->start + net + net / 64;
    if (target <= d->res_end)
        return 0;
    const int internals = st->direct;
    if (target > d->map_size && internals && st_store__map_budget(st) > d->map_size)
        return MDB_MAP_FULL;
    uint64_t end = target > d->res_end + ST_RESERVE_STEP ? target : d->res_end + ST_RESERVE_STEP;
    if (end > d->map_size)
        end = d->map_size;
    uint64_t from = d->res_end > d->start ? d->res_end : d->start;
    if (from >= end)
        return 0;
    d->res_end = end;
    /* Reserve the blocks (fallocate): no page is touched, the disk's answer comes now, and the
     * new chunks' bytes then go into the file with pwrite at the places LMDB gives them (the
     * page cache is the map's, so LMDB sees them); only the pages LMDB writes itself (chunk
     * headers, B-tree) fault in, onto reserved blocks. Without fallocate, populate the range. */
    if (d->have_fd && !d->no_reserve) {
        int r;
        while ((r = st->sys.reserve(d->fd, from, end - from)) != 0 && errno == EINTR)
            ;
        if (r == 0)
            return 0;
        int e = errno;
        if (e == ENOSPC || e == EDQUOT)
            return st_error_set(ST_EFULL, "store %s: the disk cannot take %llu KiB of new chunks", st->dir,
                                (unsigned long long)((end - from + 1023) >> 10));
        if (e != EOPNOTSUPP && e != ENOSYS && e != EINVAL)
            return st_error_set(ST_EIO, "store %s: reserving %llu KiB for new chunks: %s", st->dir,
                                (unsigned long long)((end - from + 1023) >> 10), strerror(e));
        /* the file system cannot fallocate: populate from now on, and copy through the map */
        d->no_reserve = 1;
        d->on = 0;
    }
    if (!d->pop_base)
        return 0; /* plain: the writes fault page by page */
    if (st->sys.populate(d->pop_base + from, (size_t)(end - from)) != 0 && errno == EFAULT)
        return st_error_set(ST_EFULL, "store %s: the disk cannot take %llu KiB of new chunks", st->dir,
                            (unsigned long long)((end - from + 1023) >> 10));
    return 0; /* other errors (a kernel without MADV_POPULATE_WRITE): the writes fault page by page */
}

/* Before any chunk: the free list, the range's start, the map-full prediction, the margin. */
static int reserve_begin(st_store *st, MDB_txn *txn, const st_plan *p, st_direct *d)
{
    const int internals = st->direct;
    MDB_stat ms;
    MDB_envinfo info;
    int rc = mdb_env_stat(st->env, &ms);
    if (rc)
        return rc;
    d->psize = ms.ms_psize;
    /* LMDB takes pages from its free list (database 0; each value a page list led by its
     * length) before growing the file: only what the free list cannot hold is reserved. */
    MDB_cursor *fc = NULL;
    uint64_t free_pages = 0;
    if (internals && mdb_cursor_open(txn, 0, &fc) == 0) {
        MDB_val fk, fv;
        for (int frc = mdb_cursor_get(fc, &fk, &fv, MDB_FIRST); !frc; frc = mdb_cursor_get(fc, &fk, &fv, MDB_NEXT))
            if (fv.mv_size >= sizeof(size_t)) {
                size_t cnt;
                memcpy(&cnt, fv.mv_data, sizeof cnt);
                free_pages += cnt;
            }
        mdb_cursor_close(fc);
    }
    d->credit = free_pages * d->psize;
    d->have_fd = mdb_env_get_fd(st->env, &d->fd) == 0;
    if (!d->have_fd)
        d->fd = -1;
    mdb_env_info(st->env, &info);
    d->map_size = info.me_mapsize;
    d->start = d->res_end = ((uint64_t)info.me_last_pgno + 1) * d->psize;
    char *base = internals ? map_base(st, info.me_mapsize) : NULL;
    d->pop_base = base;
    d->on = internals && d->have_fd && base != NULL;
    /* The put's own faults on the map (LMDB writing an overflow header or a B-tree page) would
     * each read around the faulting page (the file's readahead window: 8 MiB on the project VM),
     * pulling in pages the put is about to overwrite and locking those the writer is writing
     * into: a 237 MB put into a store that already held one took 0.70-0.79 s on the project VM,
     * 0.22-0.42 s without the read-around (the inserts' thread: 580-720 ms, then 90-150 ms).
     * So the map reads no further than the page faulted while the put's transaction runs
     * (MADV_RANDOM, back to MADV_NORMAL in st_store__direct_end; a hint: failures are ignored;
     * reads by other threads meanwhile go without readahead). */
    if (base && madvise(base, (size_t)info.me_mapsize, MADV_RANDOM) == 0) {
        d->advised = base;
        d->advised_len = info.me_mapsize;
    }
    /* Every put also dirties B-tree, manifest and free-list pages (copy on write): room for
     * them is counted too, so that no put - however small - first touches an unbacked page of
     * the map, where a full disk would be a SIGBUS instead of ST_EFULL. */
    uint64_t margin = (ST_POPULATE_MARGIN_PAGES + (uint64_t)p->m.n_chunks) * d->psize, all = 0;
    margin = margin < ST_POPULATE_MARGIN_MAX ? margin : ST_POPULATE_MARGIN_MAX;
    if (internals) {
        for (uint32_t i = 0; i < p->m.n_chunks; i++)
            all += pages_of(d->psize, p->pieces[i].raw_len); /* a frame is kept only when smaller */
        uint64_t net = all + margin > d->credit ? all + margin - d->credit : 0;
        if (d->start + net + net / 64 > d->map_size && st_store__map_budget(st) > d->map_size)
            return MDB_MAP_FULL;
    }
    if (internals && !base)
        return 0; /* the map was not found: no reservation, the inserts copy (d->on is 0) */
    d->reserving = 1;
    return reserve_more(st, d, margin);
}

/* With MDB_WRITEMAP a new chunk's bytes land in the file's shared map, mostly past the last page
 * in use and in order. Every ST_WRITEBACK_STEP of them, the file range up to the end of the last
 * copy is handed to the kernel's writeback (sync_file_range, SYNC_FILE_RANGE_WRITE: start, do not
 * wait), so that the disk writes while later chunks are copied and the commit's sync finds most
 * of the put on its way. Only a hint: durability is the commit's (pages written again later are
 * dirty again; a failed hint is ignored). The step is small (4 MiB, as st_file_write's) so
 * that the disk starts on the first chunks at once: with 64 MiB steps the commit's sync of a
 * 282 MiB put waited 30-40 ms on the project VM, with 4 MiB 10-17 ms (an A/B of this constant). */
#define ST_WRITEBACK_STEP ((uint64_t)4 << 20)

static void writeback_hint(st_store *st, st_direct *c, const char *from, const char *to)
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

/* The writer: a thread that pwrites the new chunks' bytes in the order the put reserved them,
 * so that the transaction's thread goes on with the next chunk's reservation, its count and the
 * writeback hints while the page cache takes the bytes (a buffered write of one file is one
 * copy at a time: one writer is enough). Every job is finished before st_store__direct_end
 * returns, and that is before the transaction commits or aborts (invariant 4). */
typedef struct st_wjob {
    const uint8_t *p;
    size_t n;
    uint64_t off;
} st_wjob;

struct st_writer {
    st_store *st;
    int fd;
    pthread_t tid;
    pthread_mutex_t mu;
    pthread_cond_t cv_job, cv_done;
    st_wjob *jobs;
    size_t cap, n_in, n_out;   /* jobs queued; jobs finished (in order) */
    uint64_t first, done_hi;   /* offset of the first job; end of the furthest finished one */
    int closing, rc;
    double pwrite_ms;          /* time inside pwrite_chunk (the store's trace) */
    char detail[256];
};

static void *writer_main(void *arg)
{
    st_writer *w = arg;
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (w->n_out == w->n_in && !w->closing)
            pthread_cond_wait(&w->cv_job, &w->mu);
        if (w->n_out == w->n_in)
            break;
        st_wjob j = w->jobs[w->n_out];
        int failed = w->rc != 0;
        pthread_mutex_unlock(&w->mu);
        struct timespec t0, t1;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        int rc = failed ? 0 : pwrite_chunk(w->st, w->fd, j.p, j.n, j.off);
        clock_gettime(CLOCK_MONOTONIC, &t1);
        pthread_mutex_lock(&w->mu);
        w->pwrite_ms += (double)(t1.tv_sec - t0.tv_sec) * 1e3 + (double)(t1.tv_nsec - t0.tv_nsec) / 1e6;
        if (rc && !w->rc) {
            w->rc = rc;
            snprintf(w->detail, sizeof w->detail, "%s", st_errdetail());
        }
        w->n_out++;
        if (j.off + j.n > w->done_hi)
            w->done_hi = j.off + j.n;
        pthread_cond_broadcast(&w->cv_done);
    }
    pthread_mutex_unlock(&w->mu);
    return NULL;
}

static int writer_start(st_store *st, st_direct *d, size_t cap)
{
    st_writer *w = calloc(1, sizeof *w);
    st_wjob *jobs = calloc(cap ? cap : 1, sizeof *jobs);
    if (!w || !jobs) {
        free(w);
        free(jobs);
        return 0; /* no memory for the queue: the transaction's thread writes itself */
    }
    w->st = st;
    w->fd = d->fd;
    w->jobs = jobs;
    w->cap = cap;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv_job, NULL);
    pthread_cond_init(&w->cv_done, NULL);
    if (pthread_create(&w->tid, NULL, writer_main, w) != 0) {
        pthread_cond_destroy(&w->cv_done);
        pthread_cond_destroy(&w->cv_job);
        pthread_mutex_destroy(&w->mu);
        free(jobs);
        free(w);
        return 0;
    }
    d->w = w;
    return 0;
}

/* Hand the bytes written so far to writeback (the range from the first job to the furthest
 * finished one). */
static void writer_hint(st_store *st, st_direct *d)
{
    st_writer *w = d->w;
    pthread_mutex_lock(&w->mu);
    uint64_t lo = w->first, hi = w->done_hi;
    pthread_mutex_unlock(&w->mu);
    if (hi > lo)
        writeback_hint(st, d, d->base + lo, d->base + hi);
}

/* Queue one chunk's pwrite; 0, or the first failed write's error. */
static int writer_put(st_store *st, st_direct *d, const uint8_t *p, size_t n, uint64_t off)
{
    st_writer *w = d->w;
    pthread_mutex_lock(&w->mu);
    int rc = w->rc;
    if (!rc && w->n_in < w->cap) {
        if (!w->n_in)
            w->first = off;
        w->jobs[w->n_in++] = (st_wjob){p, n, off};
        pthread_cond_signal(&w->cv_job);
        pthread_mutex_unlock(&w->mu);
        writer_hint(st, d);
        return 0;
    }
    char detail[256];
    snprintf(detail, sizeof detail, "%s", w->detail);
    pthread_mutex_unlock(&w->mu);
    if (rc)
        return st_error_set(rc, "%s", detail);
    return pwrite_chunk(st, d->fd, p, n, off); /* a full queue (one job per plan chunk: not expected) */
}

static int writer_end(st_store *st, st_direct *d, int rc);

int st_store__direct_end(st_store *st, st_direct *d, int rc)
{
    rc = writer_end(st, d, rc);
    if (d->advised)
        (void)madvise(d->advised, (size_t)d->advised_len, MADV_NORMAL);
    d->advised = NULL;
    return rc;
}

/* Wait for the writer's jobs and stop it. */
static int writer_end(st_store *st, st_direct *d, int rc)
{
    st_writer *w = d->w;
    if (!w)
        return rc;
    pthread_mutex_lock(&w->mu);
    w->closing = 1;
    pthread_cond_signal(&w->cv_job);
    while (w->n_out < w->n_in) {
        pthread_cond_wait(&w->cv_done, &w->mu);
        if (!rc && !w->rc) {
            pthread_mutex_unlock(&w->mu);
            writer_hint(st, d);
            pthread_mutex_lock(&w->mu);
        }
    }
    int wrc = w->rc;
    char detail[256];
    snprintf(detail, sizeof detail, "%s", w->detail);
    pthread_mutex_unlock(&w->mu);
    pthread_join(w->tid, NULL);
    d->pwrite_ms = w->pwrite_ms;
    pthread_cond_destroy(&w->cv_done);
    pthread_cond_destroy(&w->cv_job);
    pthread_mutex_destroy(&w->mu);
    free(w->jobs);
    free(w);
    d->w = NULL;
    if (!rc && wrc)
        rc = st_error_set(wrc, "%s", detail);
    return rc;
}

int st_store__direct_begin(st_store *st, MDB_txn *txn, const st_plan *p, st_direct *d)
{
    memset(d, 0, sizeof *d);
    d->fd = -1;
    if (!(st->env_flags & MDB_WRITEMAP))
        return 0;
    int rc = reserve_begin(st, txn, p, d);
    d->base = (const char *)st->map_base;
    if (d->on && !d->base)
        d->on = 0;
    if (!rc && d->on)
        rc = writer_start(st, d, p->m.n_chunks);
    return rc;
}

int st_store__direct_insert(st_store *st, MDB_txn *txn, st_direct *d, const st_piece *pc, MDB_val *v)
{
    MDB_val k = {ST_STORE_HASH_LEN, (void *)pc->hash};
    if (d->reserving) {
        /* a new chunk: its pages reserved before LMDB touches them (its header page included) */
        int rc = mdb_get(txn, st->dbi_chunks, &k, v);
        if (rc == MDB_NOTFOUND)
            rc = reserve_more(st, d, pages_of(d->psize, pc->stored_len));
        else if (rc == 0)
            return MDB_KEYEXIST; /* v is the stored value */
        if (rc)
            return rc;
    }
    if (!st->direct) {
        /* the plain path: LMDB copies the bytes (on MDB_KEYEXIST, v is the stored value) */
        v->mv_size = pc->stored_len;
        v->mv_data = (void *)pc->stored;
        return mdb_put(txn, st->dbi_chunks, &k, v, MDB_NOOVERWRITE);
    }
    v->mv_size = pc->stored_len;
    v->mv_data = NULL;
    int rc = mdb_put(txn, st->dbi_chunks, &k, v, MDB_NOOVERWRITE | MDB_RESERVE);
    if (rc)
        return rc;
    const char *at = (const char *)v->mv_data, *base = d->base;
    if (d->on && pc->stored_len >= ST_PWRITE_MIN &&
        (!overflow_at(st, base, at) || (uint64_t)(at - base) + pc->stored_len > st->map_base_size))
        d->on = 0; /* the map is not where it was looked up: copy through it from now on */
    if (d->on && pc->stored_len >= ST_PWRITE_MIN) {
        if (d->w)
            return writer_put(st, d, pc->stored, pc->stored_len, (uint64_t)(at - base));
        if ((rc = pwrite_chunk(st, d->fd, pc->stored, pc->stored_len, (uint64_t)(at - base))))
            return rc;
        writeback_hint(st, d, at, at + pc->stored_len);
    } else {
        memcpy(v->mv_data, pc->stored, pc->stored_len);
    }
    return 0;
}

/* ---- the assumptions, checked at open ------------------------------------------------------- */

#define ST_PG_HDR 16u          /* A2 */
#define ST_PG_FLAGS_OFF 10u
#define ST_P_META 0x08u
#define ST_MDB_MAGIC 0xBEEFC0DEu
#define ST_MDB_DATA_VERSION 1u
#define ST_META_PSIZE_OFF (ST_PG_HDR + 24u)
_Static_assert(ST_DIRECT_PROBE_BYTES == ST_META_PSIZE_OFF + 4u, "the probe reads up to the page size field");

static int why(char *dst, size_t cap, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int why(char *dst, size_t cap, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(dst, cap, fmt, ap);
    va_end(ap);
    return 0;
}

static int meta_ok(const uint8_t *m, uint64_t pgno, uint32_t psize, char *dst, size_t cap)
{
    uint64_t got = st_get64(m);
    uint16_t flags = st_get16(m + ST_PG_FLAGS_OFF);
    if (got != pgno)
        return why(dst, cap, "meta page %llu records page number %llu (the page header layout differs)",
                   (unsigned long long)pgno, (unsigned long long)got);
    if (!(flags & ST_P_META))
        return why(dst, cap, "meta page %llu has flags 0x%04x, no P_META (the page header layout differs)",
                   (unsigned long long)pgno, flags);
    if (st_get32(m + ST_PG_HDR) != ST_MDB_MAGIC || st_get32(m + ST_PG_HDR + 4) != ST_MDB_DATA_VERSION)
        return why(dst, cap, "meta page %llu: magic 0x%08x data version %u, not 0x%08x version %u",
                   (unsigned long long)pgno, st_get32(m + ST_PG_HDR), st_get32(m + ST_PG_HDR + 4), ST_MDB_MAGIC,
                   ST_MDB_DATA_VERSION);
    if (st_get32(m + ST_META_PSIZE_OFF) != psize)
        return why(dst, cap, "meta page %llu records page size %u, the environment uses %u",
                   (unsigned long long)pgno, st_get32(m + ST_META_PSIZE_OFF), psize);
    return 1;
}

int st_store__direct_check(int major, int minor, uint32_t psize, long os_page, const uint8_t *meta0,
                           const uint8_t *meta1, size_t meta_len, char *dst, size_t cap)
{
    dst[0] = '\0';
    if (MDB_VERSION_MAJOR != 0 || MDB_VERSION_MINOR != 9)
        return why(dst, cap, "built against lmdb.h %d.%d, the fast path knows 0.9", MDB_VERSION_MAJOR,
                   MDB_VERSION_MINOR);
    if (major != 0 || minor != 9)
        return why(dst, cap, "liblmdb is %d.%d, the fast path knows 0.9's layout", major, minor);
    if (sizeof(size_t) != 8)
        return why(dst, cap, "size_t is %zu bytes; LMDB 0.9's page numbers the fast path reads are 8",
                   sizeof(size_t));
    if (psize < 4096 || (psize & (psize - 1)) || os_page <= 0 || psize % (uint32_t)os_page)
        return why(dst, cap, "page size %u is not a power of two multiple of the OS page (%ld)", psize, os_page);
    if (!meta0 || !meta1 || meta_len < ST_DIRECT_PROBE_BYTES)
        return why(dst, cap, "the meta pages could not be read");
    return meta_ok(meta0, 0, psize, dst, cap) && meta_ok(meta1, 1, psize, dst, cap);
}

static int plain_forced(void)
{
    const char *e = getenv("STRATA_STORE_PLAIN_PUT");
    return e && *e && strcmp(e, "0") != 0;
}

void st_store__direct_probe(st_store *st)
{
    char *w = st->direct_why;
    size_t cap = sizeof st->direct_why;
    st->direct = 0;
    w[0] = '\0';
    if (plain_forced()) {
        why(w, cap, "STRATA_STORE_PLAIN_PUT is set");
    } else if (!(st->env_flags & MDB_WRITEMAP) || (st->env_flags & MDB_RDONLY)) {
        why(w, cap, "the store is not open for writing with MDB_WRITEMAP");
    } else {
        int major = 0, minor = 0;
        MDB_stat ms;
        mdb_filehandle_t fd;
        uint8_t m0[ST_DIRECT_PROBE_BYTES], m1[ST_DIRECT_PROBE_BYTES];
        const uint8_t *p0 = NULL, *p1 = NULL;
        mdb_version(&major, &minor, NULL);
        uint32_t psize = mdb_env_stat(st->env, &ms) == 0 ? ms.ms_psize : 0;
        if (psize && mdb_env_get_fd(st->env, &fd) == 0 && pread(fd, m0, sizeof m0, 0) == (ssize_t)sizeof m0 &&
            pread(fd, m1, sizeof m1, (off_t)psize) == (ssize_t)sizeof m1) {
            p0 = m0;
            p1 = m1;
        }
        st->direct = st_store__direct_check(major, minor, psize, sysconf(_SC_PAGESIZE), p0, p1, sizeof m0, w, cap);
    }
    if (!st->direct && getenv("STRATA_STORE_TRACE") && *getenv("STRATA_STORE_TRACE"))
        fprintf(stderr, "strata store %s: put fast path off (plain mdb_put): %s\n", st->dir, w);
}

const char *st_store__direct_status(const st_store *st, int *on)
{
    if (on)
        *on = st->direct;
    return st->direct ? "" : st->direct_why;
}
