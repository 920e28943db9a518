/*
 * st_store_direct.c - the put's fast path, which relies on LMDB internals lmdb.h never promises.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
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
int st_store__put_populate(st_store *st, MDB_txn *txn, const st_plan *p, int *direct)
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
        if (st_store__map_budget(st) > info.me_mapsize)
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

void st_store__writeback_hint(st_store *st, st_put_ctx *c, const char *from, const char *to)
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
int st_store__overflow_at(st_store *st, const char *base, const char *at)
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

int st_store__pwrite_chunk(st_store *st, int fd, const uint8_t *p, size_t n, uint64_t off)
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
