/*
 * st_store_pages.c - a walker over data.mdb's pages that reads the file itself (pread), never
 * through LMDB. LMDB 0.9 keeps no page checksums and trusts what a page says: a flipped byte can
 * make it read outside a page, loop, or free pages it does not own (an overflow page count that
 * grew makes the next write that frees it list billions of pages). check and the server's
 * start-up scan run this walk first, so they see what a read or a write would trip on; the get
 * and delete paths check single values with st_store__value_check.
 *
 * What the walk assumes of the file: LMDB 0.9's on-disk format, data version 1 (0.9.24 in
 * Debian 12; st_store__pages_check refuses a liblmdb of another major.minor, and a page size that
 * differs from the running environment's):
 * 1. The file is pages of one size (mm_psize, a power of two in 512..65536). Pages 0 and 1 are
 *    meta pages; the one with the larger transaction id is in force. Commits alternate between
 *    them, so meta page i holds an id of parity i and the two ids are consecutive.
 * 2. A page starts with a 16-byte header: pgno (u64), pad (u16), flags (u16), then lower and
 *    upper (u16 each) for branch and leaf pages, or the number of pages (u32) of an overflow page.
 *    Node offsets (u16) fill [16, lower); the nodes fill [upper, psize) exactly, each of an even
 *    size (LMDB keeps a page's nodes packed when it adds, deletes or resizes one).
 * 3. A node: lo, hi (u16 each: the data size, or in a branch page bits 0..31 of the child's
 *    pgno), flags (u16; in a branch page bits 32..47 of the pgno), key size (u16), the key, then
 *    in a leaf page the data; with F_BIGDATA (1) an u64 pgno of the overflow pages that hold the
 *    data instead, with F_SUBDATA (2) a database record. An inline value keeps 8 + key + data
 *    within nodemax = ((psize - 16) / 2 & ~1) - 2; a larger one lives in overflow pages, at
 *    least OVPAGES = (15 + size) / psize + 1 of them starting with a header of flags P_OVERFLOW.
 *    A smaller value may live there too, on more pages than it needs: LMDB rewrites a value in
 *    place in overflow pages of this transaction that are large enough and never shrinks them.
 * 4. A database record (MDB_db, 48 bytes): pad (u32: in the free database's, the page size),
 *    flags (u16), depth (u16), branch, leaf and overflow page counts, entries and root (u64 each;
 *    root ~0 when the database is empty). The meta (at offset 16 of its page): magic 0xBEEFC0DE
 *    (u32), version 1 (u32), address, map size (u64 each), the free and the main database's
 *    records, the last page used (u64) and the transaction id (u64).
 * 5. Keys of the main database and of every database this store creates compare as LMDB's
 *    default (memcmp over the shorter length, then the shorter first); none has DUPSORT or other
 *    key flags (any is damage here). The free database's keys are u64 transaction ids in native
 *    order, its values page lists (a count, then that many page numbers), and no page it lists is
 *    part of a tree. The first key of a branch page is not compared (LMDB keeps it empty).
 * 6. Every page of the snapshot is reached once: twice means a damaged pointer.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

#define PG_HDR 16u
#define PG_BRANCH 0x01u
#define PG_LEAF 0x02u
#define PG_OVERFLOW 0x04u
#define PG_META 0x08u
#define ND_BIGDATA 0x01u
#define ND_SUBDATA 0x02u
#define NODE_HDR 8u
#define DB_REC 48u
#define META_MAGIC 0xBEEFC0DEu
#define META_VERSION 1u
#define DEPTH_MAX 32u
#define KEY_MAX 511u  /* LMDB's default MDB_MAXKEYSIZE */
#define NAMED_MAX 64u /* databases the main database may name */

typedef struct pg_db {
    uint32_t pad;
    uint16_t flags, depth;
    uint64_t branch, leaf, overflow, entries, root;
} pg_db;

static pg_db db_read(const uint8_t *p)
{
    pg_db d = {st_get32(p), st_get16(p + 4), st_get16(p + 6), st_get64(p + 8), st_get64(p + 16),
               st_get64(p + 24), st_get64(p + 32), st_get64(p + 40)};
    return d;
}

typedef struct pg_walk {
    int fd;
    uint32_t psize, nodemax;
    uint64_t npages;            /* pages of the snapshot: last page + 1 */
    uint8_t *seen, *freed;      /* one bit per page */
    uint8_t *buf[DEPTH_MAX + 1];
    uint8_t *ovbuf;             /* a free-list value kept in overflow pages */
    size_t ovcap;
    st_page_report_fn report;
    void *arg;
    const char *db;             /* the database walked */
    int integer_keys;           /* the free database */
    int main;                   /* the main database: values are database records */
    uint64_t problems, pages;
    uint64_t branch, leaf, overflow, entries; /* counted in the database walked */
    uint32_t leaf_depth;
    uint8_t prev[KEY_MAX];      /* the last key of the last good leaf, in key order */
    size_t prev_len;
    int have_prev;
    struct { char name[KEY_MAX + 1]; pg_db rec; } named[NAMED_MAX];
    unsigned n_named;
} pg_walk;

static void pg_problem(pg_walk *w, uint64_t pgno, const st_page_range *r, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void pg_problem(pg_walk *w, uint64_t pgno, const st_page_range *r, const char *fmt, ...)
{
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    st_page_problem p = {.db = w->db, .pgno = pgno, .message = msg};
    if (r)
        p.range = *r;
    w->problems++;
    if (w->report)
        w->report(w->arg, &p);
}

static int bit_get(const uint8_t *m, uint64_t i) { return m[i >> 3] >> (i & 7) & 1; }
static void bit_set(uint8_t *m, uint64_t i) { m[i >> 3] |= (uint8_t)(1u << (i & 7)); }

static uint64_t ovpages(uint32_t psize, uint64_t size) { return (PG_HDR - 1 + size) / psize + 1; }

/* pread all of n bytes at off; 0 or an errno (EIO for a short file). */
static int pg_read(int fd, void *dst, size_t n, uint64_t off)
{
    uint8_t *p = dst;
    while (n) {
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return r < 0 ? errno : EIO;
        p += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

static int key_cmp(const pg_walk *w, const uint8_t *a, size_t al, const uint8_t *b, size_t bl)
{
    if (w->integer_keys) {
        uint64_t x = 0, y = 0;
        memcpy(&x, a, al < 8 ? al : 8);
        memcpy(&y, b, bl < 8 ? bl : 8);
        return x < y ? -1 : x > y;
    }
    int c = memcmp(a, b, al < bl ? al : bl);
    return c ? c : al < bl ? -1 : al > bl;
}

/* Mark pages [pgno, pgno + n) reached; 0, or 1 after reporting a page outside the snapshot or
 * one reached before. */
static int pg_claim(pg_walk *w, uint64_t pgno, uint64_t n, const st_page_range *r, const char *what)
{
    if (pgno < 2 || pgno >= w->npages || n > w->npages - pgno) {
        pg_problem(w, pgno, r, "%s: pages %llu..%llu lie outside the %llu pages in use", what,
                   (unsigned long long)pgno, (unsigned long long)(pgno + n - 1), (unsigned long long)w->npages);
        return 1;
    }
    for (uint64_t i = pgno; i < pgno + n; i++)
        if (bit_get(w->seen, i)) {
            pg_problem(w, pgno, r, "%s: page %llu is reached twice (a damaged page pointer)", what,
                       (unsigned long long)i);
            return 1;
        }
    for (uint64_t i = pgno; i < pgno + n; i++)
        bit_set(w->seen, i);
    w->pages += n;
    return 0;
}

/* A value of size bytes kept in overflow pages from pgno: their header must say so. 0 or 1. */
static int pg_overflow(pg_walk *w, uint64_t pgno, uint64_t size, const st_page_range *r)
{
    uint8_t h[PG_HDR];
    uint64_t n = ovpages(w->psize, size);
    if (pgno < 2 || pgno >= w->npages) {
        pg_problem(w, pgno, r, "overflow page %llu lies outside the pages in use (%llu)", (unsigned long long)pgno,
                   (unsigned long long)w->npages);
        return 1;
    }
    int e = pg_read(w->fd, h, sizeof h, pgno * w->psize);
    if (e) {
        pg_problem(w, pgno, r, "overflow page %llu: read failed: %s", (unsigned long long)pgno, strerror(e));
        return 1;
    }
    /* LMDB overwrites a value in its own overflow pages when they are large enough and does not
       shrink them (mdb_cursor_put): the run may be longer than the value needs, never shorter */
    uint64_t have = st_get32(h + 12);
    if (st_get64(h) != pgno || st_get16(h + 10) != PG_OVERFLOW || have < n || have > w->npages - pgno) {
        pg_problem(w, pgno, r, "overflow page %llu: header says page %llu, flags 0x%x, %llu pages; a value of %llu "
                   "bytes needs page %llu, flags 0x%x, at least %llu pages inside the %llu in use",
                   (unsigned long long)pgno, (unsigned long long)st_get64(h), st_get16(h + 10),
                   (unsigned long long)have, (unsigned long long)size, (unsigned long long)pgno, PG_OVERFLOW,
                   (unsigned long long)n, (unsigned long long)w->npages);
        return 1;
    }
    if (pg_claim(w, pgno, have, r, "overflow value"))
        return 1;
    w->overflow += have;
    return 0;
}

/* A free-list value: a count and that many page numbers, each in the snapshot, none listed twice. */
static void pg_freelist(pg_walk *w, uint64_t pgno, const uint8_t *v, uint64_t size, const st_page_range *r)
{
    uint64_t cnt = size >= 8 ? st_get64(v) : 0;
    if (size < 8 || size % 8 || cnt != size / 8 - 1) {
        pg_problem(w, pgno, r, "free list entry of %llu bytes does not hold a page list", (unsigned long long)size);
        return;
    }
    for (uint64_t i = 0; i < cnt; i++) {
        uint64_t p = st_get64(v + 8 + 8 * i);
        if (p < 2 || p >= w->npages || bit_get(w->freed, p)) {
            pg_problem(w, pgno, r, "free list names page %llu %s", (unsigned long long)p,
                       p < 2 || p >= w->npages ? "outside the pages in use" : "twice");
            return;
        }
        bit_set(w->freed, p);
    }
}

/* One leaf node's value: inline, overflow or a database record. 0 or 1 (reported). */
static int pg_value(pg_walk *w, uint64_t pgno, const uint8_t *node, const uint8_t *key, uint32_t ksz,
                    const st_page_range *page_r)
{
    uint16_t fl = st_get16(node + 4);
    uint64_t dsz = (uint64_t)st_get16(node) | (uint64_t)st_get16(node + 2) << 16;
    const uint8_t *data = key + ksz;
    if (fl & ~(unsigned)(w->main ? ND_SUBDATA : ND_BIGDATA)) {
        pg_problem(w, pgno, page_r, "leaf page %llu: node flags 0x%x", (unsigned long long)pgno, fl);
        return 1;
    }
    /* a damaged value is its key's alone: the range [key, key + "\0") */
    uint8_t next[KEY_MAX + 1];
    memcpy(next, key, ksz);
    next[ksz] = 0;
    const st_page_range kr = {.lo = key, .lo_len = ksz, .has_lo = 1, .hi = next, .hi_len = ksz + 1, .has_hi = 1};
    const st_page_range *r = &kr;
    if (fl & ND_BIGDATA) {
        uint64_t ov = st_get64(data);
        if (pg_overflow(w, ov, dsz, r))
            return 1;
        if (w->integer_keys) {
            if (dsz > w->ovcap) {
                uint8_t *nb = realloc(w->ovbuf, dsz);
                if (!nb) {
                    pg_problem(w, pgno, r, "no memory for a free list entry of %llu bytes", (unsigned long long)dsz);
                    return 1;
                }
                w->ovbuf = nb;
                w->ovcap = dsz;
            }
            int e = pg_read(w->fd, w->ovbuf, dsz, ov * w->psize + PG_HDR);
            if (e) {
                pg_problem(w, ov, r, "overflow page %llu: read failed: %s", (unsigned long long)ov, strerror(e));
                return 1;
            }
            pg_freelist(w, pgno, w->ovbuf, dsz, r);
        }
        return 0;
    }
    if (NODE_HDR + ksz + dsz > w->nodemax) {
        pg_problem(w, pgno, r, "leaf page %llu: an inline value of %llu bytes exceeds the node limit %u",
                   (unsigned long long)pgno, (unsigned long long)dsz, w->nodemax);
        return 1;
    }
    if (w->integer_keys) {
        pg_freelist(w, pgno, data, dsz, r);
    } else if (w->main) {
        if (!(fl & ND_SUBDATA)) {
            pg_problem(w, pgno, r, "leaf page %llu: the main database holds a value that is not a database",
                       (unsigned long long)pgno);
            return 1;
        }
        if (dsz != DB_REC || w->n_named == NAMED_MAX) {
            pg_problem(w, pgno, r, "leaf page %llu: database record of %llu bytes", (unsigned long long)pgno,
                       (unsigned long long)dsz);
            return 1;
        }
        snprintf(w->named[w->n_named].name, sizeof w->named[w->n_named].name, "%.*s", (int)ksz, (const char *)key);
        w->named[w->n_named++].rec = db_read(data);
    }
    return 0;
}

/* One node of a page at offset off: its key and total (even) size, or 0 when it does not fit. */
static uint32_t pg_node(const pg_walk *w, const uint8_t *pg, uint32_t off, int leaf, uint32_t *ksz)
{
    if (off % 2 || off + NODE_HDR > w->psize)
        return 0;
    const uint8_t *n = pg + off;
    uint64_t sz = NODE_HDR + st_get16(n + 6);
    *ksz = st_get16(n + 6);
    if (leaf) {
        uint64_t dsz = (uint64_t)st_get16(n) | (uint64_t)st_get16(n + 2) << 16;
        sz += st_get16(n + 4) & ND_BIGDATA ? 8 : dsz;
    }
    sz += sz & 1;
    return off + sz <= w->psize ? (uint32_t)sz : 0;
}

static void pg_tree(pg_walk *w, uint64_t pgno, uint32_t level, const st_page_range *r);

/* Check page pgno (read into w->buf[level]) of the database walked, covering keys in r. */
static void pg_page(pg_walk *w, uint64_t pgno, uint32_t level, const st_page_range *r)
{
    uint8_t *pg = w->buf[level];
    int e = pg_read(w->fd, pg, w->psize, pgno * w->psize);
    if (e) {
        pg_problem(w, pgno, r, "page %llu: read failed: %s", (unsigned long long)pgno, strerror(e));
        return;
    }
    uint16_t fl = st_get16(pg + 10), lower = st_get16(pg + 12), upper = st_get16(pg + 14);
    if (st_get64(pg) != pgno || (fl != PG_BRANCH && fl != PG_LEAF)) {
        pg_problem(w, pgno, r, "page %llu: header says page %llu with flags 0x%x; expected a branch or leaf page",
                   (unsigned long long)pgno, (unsigned long long)st_get64(pg), fl);
        return;
    }
    int leaf = fl == PG_LEAF;
    if (lower < PG_HDR + 2 || (lower - PG_HDR) % 2 || upper < lower || upper > w->psize) {
        pg_problem(w, pgno, r, "%s page %llu: lower %u, upper %u do not bound its nodes in a page of %u bytes",
                   leaf ? "leaf" : "branch", (unsigned long long)pgno, lower, upper, w->psize);
        return;
    }
    uint32_t n = (lower - PG_HDR) / 2, used = 0;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t off = st_get16(pg + PG_HDR + 2 * i), ksz = 0;
        uint32_t sz = off >= upper ? pg_node(w, pg, off, leaf, &ksz) : 0;
        if (!sz || ksz > KEY_MAX || (leaf && !ksz)) {
            pg_problem(w, pgno, r, "%s page %llu: node %u at offset %u does not fit in [%u, %u)",
                       leaf ? "leaf" : "branch", (unsigned long long)pgno, i, off, upper, w->psize);
            return;
        }
        used += sz;
    }
    if (used != w->psize - upper) {
        pg_problem(w, pgno, r, "%s page %llu: its nodes take %u bytes, the page says %u",
                   leaf ? "leaf" : "branch", (unsigned long long)pgno, used, w->psize - upper);
        return;
    }
    /* keys in order and inside the range the parent gave this page */
    const uint8_t *pk = r->lo;
    size_t pl = r->lo_len;
    int have = r->has_lo;
    for (uint32_t i = leaf ? 0 : 1; i < n; i++) {
        const uint8_t *node = pg + st_get16(pg + PG_HDR + 2 * i);
        size_t kl = st_get16(node + 6);
        if ((have && key_cmp(w, pk, pl, node + NODE_HDR, kl) > 0) || (have && i > (leaf ? 0u : 1u) &&
                                                                      !key_cmp(w, pk, pl, node + NODE_HDR, kl)) ||
            (r->has_hi && key_cmp(w, node + NODE_HDR, kl, r->hi, r->hi_len) >= 0) ||
            (w->integer_keys && kl != 8)) {
            pg_problem(w, pgno, r, "%s page %llu: key %u is out of order", leaf ? "leaf" : "branch",
                       (unsigned long long)pgno, i);
            return;
        }
        pk = node + NODE_HDR;
        pl = kl;
        have = 1;
    }
    if (leaf) {
        if (level + 1 != w->leaf_depth) {
            pg_problem(w, pgno, r, "leaf page %llu at depth %u; the database records depth %u",
                       (unsigned long long)pgno, level + 1, w->leaf_depth);
            return;
        }
        unsigned before = w->n_named;
        for (uint32_t i = 0; i < n; i++) {
            const uint8_t *node = pg + st_get16(pg + PG_HDR + 2 * i);
            if (pg_value(w, pgno, node, node + NODE_HDR, st_get16(node + 6), r)) {
                w->n_named = before;
                return;
            }
        }
        w->leaf++;
        w->entries += n;
        const uint8_t *last = pg + st_get16(pg + PG_HDR + 2 * (n - 1));
        w->prev_len = st_get16(last + 6);
        memcpy(w->prev, last + NODE_HDR, w->prev_len);
        w->have_prev = 1;
        return;
    }
    if (level + 1 >= w->leaf_depth) {
        pg_problem(w, pgno, r, "branch page %llu at depth %u; the database records depth %u",
                   (unsigned long long)pgno, level + 1, w->leaf_depth);
        return;
    }
    w->branch++;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *node = pg + st_get16(pg + PG_HDR + 2 * i);
        uint64_t child = (uint64_t)st_get16(node) | (uint64_t)st_get16(node + 2) << 16 |
                         (uint64_t)st_get16(node + 4) << 32;
        st_page_range cr = *r;
        if (i > 0) {
            cr.lo = node + NODE_HDR;
            cr.lo_len = st_get16(node + 6);
            cr.has_lo = 1;
        }
        if (i + 1 < n) {
            const uint8_t *next = pg + st_get16(pg + PG_HDR + 2 * (i + 1));
            cr.hi = next + NODE_HDR;
            cr.hi_len = st_get16(next + 6);
            cr.has_hi = 1;
        }
        pg_tree(w, child, level + 1, &cr);
    }
}

static void pg_tree(pg_walk *w, uint64_t pgno, uint32_t level, const st_page_range *r)
{
    st_page_range wr = *r;
    if (w->have_prev) {
        wr.prev = w->prev;
        wr.prev_len = w->prev_len;
        wr.has_prev = 1;
    }
    if (pg_claim(w, pgno, 1, &wr, w->db))
        return;
    pg_page(w, pgno, level, &wr);
}

/* Walk one database from its record; its counts must match what the walk found. */
static void pg_db_walk(pg_walk *w, const char *name, const pg_db *d, int integer_keys, int main)
{
    st_page_range all;
    memset(&all, 0, sizeof all);
    w->db = name;
    w->integer_keys = integer_keys;
    w->main = main;
    w->branch = w->leaf = w->overflow = w->entries = 0;
    w->have_prev = 0;
    w->leaf_depth = d->depth;
    uint64_t before = w->problems;
    unsigned want = integer_keys ? 0x08u /* MDB_INTEGERKEY */ : 0;
    if (d->flags != want) {
        pg_problem(w, d->root, &all, "database \"%s\": flags 0x%x, expected 0x%x", name, d->flags, want);
        return;
    }
    if (d->root == UINT64_MAX) {
        if (d->depth || d->branch || d->leaf || d->overflow || d->entries)
            pg_problem(w, 0, &all, "database \"%s\" is empty but records depth %u and %llu entries", name,
                       d->depth, (unsigned long long)d->entries);
        return;
    }
    if (d->depth == 0 || d->depth > DEPTH_MAX) {
        pg_problem(w, d->root, &all, "database \"%s\": depth %u", name, d->depth);
        return;
    }
    pg_tree(w, d->root, 0, &all);
    if (w->problems == before &&
        (w->branch != d->branch || w->leaf != d->leaf || w->overflow != d->overflow || w->entries != d->entries))
        pg_problem(w, d->root, &all, "database \"%s\" records %llu branch, %llu leaf, %llu overflow pages and %llu "
                   "entries; its pages hold %llu, %llu, %llu and %llu", name, (unsigned long long)d->branch,
                   (unsigned long long)d->leaf, (unsigned long long)d->overflow, (unsigned long long)d->entries,
                   (unsigned long long)w->branch, (unsigned long long)w->leaf, (unsigned long long)w->overflow,
                   (unsigned long long)w->entries);
}

int st_store__pages_version_ok(void)
{
    int major = 0, minor = 0;
    mdb_version(&major, &minor, NULL);
    if (major != 0 || minor != 9)
        return st_error_set(ST_EVERSION, "the page walker knows LMDB 0.9's file format; this liblmdb is %d.%d",
                            major, minor);
    return 0;
}

int st_store__pages_check(const char *path, uint32_t psize_expected, uint64_t txnid, st_page_report_fn report,
                          void *arg, st_page_stats *stats)
{
    pg_walk w;
    uint8_t meta[2][PG_HDR + 152];
    memset(&w, 0, sizeof w);
    w.fd = -1;
    w.report = report;
    w.arg = arg;
    int rc = st_store__pages_version_ok();
    if (rc)
        return rc;
    if ((w.fd = open(path, O_RDONLY | O_CLOEXEC)) < 0)
        return st_error_set(errno == ENOENT ? ST_ENOTFOUND : errno, "%s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(w.fd, &sb) != 0) {
        rc = st_error_set(errno, "%s: %s", path, strerror(errno));
        goto done;
    }
    /* the metas: page size from the first (LMDB reads it there too) */
    w.db = "meta pages";
    if (pg_read(w.fd, meta[0], sizeof meta[0], 0)) {
        pg_problem(&w, 0, NULL, "%s: too short for a meta page (%lld bytes)", path, (long long)sb.st_size);
        goto done;
    }
    w.psize = st_get32(meta[0] + PG_HDR + 24);
    if (w.psize < 512 || w.psize > 65536 || (w.psize & (w.psize - 1)) ||
        (psize_expected && w.psize != psize_expected)) {
        pg_problem(&w, 0, NULL, "meta page 0 records a page size of %u bytes (the environment uses %u)", w.psize,
                   psize_expected);
        goto done;
    }
    if (pg_read(w.fd, meta[1], sizeof meta[1], w.psize)) {
        pg_problem(&w, 1, NULL, "%s: too short for two meta pages", path);
        goto done;
    }
    uint64_t tx[2];
    for (int i = 0; i < 2; i++) {
        const uint8_t *m = meta[i] + PG_HDR;
        tx[i] = st_get64(m + 128);
        if (st_get64(meta[i]) != (uint64_t)i || st_get16(meta[i] + 10) != PG_META || st_get32(m) != META_MAGIC ||
            st_get32(m + 4) != META_VERSION || st_get32(m + 24) != w.psize || (tx[i] && tx[i] % 2 != (uint64_t)i))
            pg_problem(&w, (uint64_t)i, NULL, "meta page %d: header, magic, version, page size or transaction id "
                       "(%llu) is not LMDB 0.9's", i, (unsigned long long)tx[i]);
    }
    if (w.problems)
        goto done;
    if (tx[0] + 1 != tx[1] && tx[1] + 1 != tx[0]) {
        pg_problem(&w, tx[0] > tx[1] ? 0 : 1, NULL, "meta pages record transactions %llu and %llu, which are not "
                   "consecutive", (unsigned long long)tx[0], (unsigned long long)tx[1]);
        goto done;
    }
    /* the caller's snapshot is the newest or, after a commit since it began, the other meta's */
    int cur = txnid ? (tx[0] == txnid ? 0 : tx[1] == txnid ? 1 : -1) : tx[1] > tx[0];
    if (cur < 0) {
        rc = st_error_set(ST_EBUSY, "the store committed twice while its pages were read (transaction %llu, now "
                          "%llu)", (unsigned long long)txnid, (unsigned long long)(tx[0] > tx[1] ? tx[0] : tx[1]));
        goto done;
    }
    const uint8_t *m = meta[cur] + PG_HDR;
    uint64_t last = st_get64(m + 120);
    if (last < 1 || last >= (uint64_t)sb.st_size / w.psize) {
        pg_problem(&w, (uint64_t)cur, NULL, "meta page %d: last page %llu lies beyond the file's %llu pages", cur,
                   (unsigned long long)last, (unsigned long long)((uint64_t)sb.st_size / w.psize));
        goto done;
    }
    w.npages = last + 1;
    w.nodemax = ((w.psize - PG_HDR) / 2 & ~1u) - 2;
    w.seen = calloc(w.npages / 8 + 1, 1);
    w.freed = calloc(w.npages / 8 + 1, 1);
    for (unsigned i = 0; i <= DEPTH_MAX && w.seen && w.freed; i++)
        if (!(w.buf[i] = malloc(w.psize)))
            break;
    if (!w.seen || !w.freed || !w.buf[DEPTH_MAX]) {
        rc = st_error_set(ENOMEM, "no memory to walk %llu pages", (unsigned long long)w.npages);
        goto done;
    }
    bit_set(w.seen, 0);
    bit_set(w.seen, 1);
    pg_db free_db = db_read(m + 24), main_db = db_read(m + 72);
    free_db.pad = 0;
    pg_db_walk(&w, "free list", &free_db, 1, 0);
    pg_db_walk(&w, "main", &main_db, 0, 1);
    unsigned n_named = w.n_named;
    for (unsigned i = 0; i < n_named; i++) {
        w.n_named = NAMED_MAX; /* a named database names no other */
        pg_db_walk(&w, w.named[i].name, &w.named[i].rec, 0, 0);
    }
    w.db = "free list";
    for (uint64_t p = 2; p < w.npages; p++)
        if (bit_get(w.freed, p) && bit_get(w.seen, p)) {
            pg_problem(&w, p, NULL, "page %llu is listed as free and is in use", (unsigned long long)p);
            break;
        }
    if (stats) {
        stats->pages = w.pages + 2;
        stats->npages = w.npages;
        stats->psize = w.psize;
        stats->txnid = tx[cur];
    }
done:
    if (stats)
        stats->problems = w.problems;
    for (unsigned i = 0; i <= DEPTH_MAX; i++)
        free(w.buf[i]);
    free(w.ovbuf);
    free(w.seen);
    free(w.freed);
    if (w.fd >= 0)
        close(w.fd);
    return rc;
}

/* The base of this handle's map of data.mdb, from the mapping (in /proc/self/maps) that holds
 * address a; 0 when none does. Cached until the map changes (map_forget). */
static uintptr_t map_base_of(st_store *st, uintptr_t a)
{
    uintptr_t base = 0;
    pthread_mutex_lock(&st->vc_mu);
    if (a >= st->vc_lo && a < st->vc_hi) {
        base = st->vc_base;
        goto done;
    }
    int fd = -1;
    struct stat sb;
    if (mdb_env_get_fd(st->env, &fd) || fd < 0 || fstat(fd, &sb) != 0)
        goto done;
    FILE *f = fopen("/proc/self/maps", "re");
    if (!f)
        goto done;
    char line[4352];
    while (fgets(line, sizeof line, f)) {
        unsigned long lo, hi, off, ino;
        unsigned maj, mnr;
        if (sscanf(line, "%lx-%lx %*s %lx %x:%x %lu", &lo, &hi, &off, &maj, &mnr, &ino) != 6)
            continue;
        if (ino == (unsigned long)sb.st_ino && makedev(maj, mnr) == sb.st_dev && a >= lo && a < hi && lo >= off) {
            st->vc_lo = lo;
            st->vc_hi = hi;
            st->vc_base = base = lo - off;
            break;
        }
    }
    fclose(f);
done:
    pthread_mutex_unlock(&st->vc_mu);
    return base;
}

int st_store__value_check(st_store *st, const MDB_val *v, const char *what)
{
    MDB_envinfo info;
    MDB_stat ms;
    uintptr_t b = map_base_of(st, (uintptr_t)v->mv_data);
    if (!b || mdb_env_info(st->env, &info) || mdb_env_stat(st->env, &ms))
        return 0; /* not in the map: a page this transaction copied (no MDB_WRITEMAP), its own */
    const uint8_t *base = (const uint8_t *)b, *at = v->mv_data;
    /* the map's pages bound it: a write transaction's new pages lie beyond the last committed one */
    uint64_t psize = ms.ms_psize, npages = info.me_mapsize / psize;
    uint64_t nodemax = ((psize - PG_HDR) / 2 & ~(uint64_t)1) - 2;
    if (at < base || (uint64_t)(at - base) >= npages * psize)
        return 0; /* a page this write transaction copied out of the map (no MDB_WRITEMAP): its own */
    uint64_t off = (uint64_t)(at - base), pgno = off / psize;
    if (off % psize != PG_HDR) {
        /* inline in a leaf page: a node holds at most nodemax bytes and stays in its page */
        if (v->mv_size + NODE_HDR > nodemax || off % psize + v->mv_size > psize)
            return st_error_set(ST_ECORRUPT, "%s: leaf page %llu holds a value of %zu bytes that does not fit in it "
                                "(store damaged: `statectl restore-backup` restores a backup)", what,
                                (unsigned long long)pgno, v->mv_size);
        return 0;
    }
    const uint8_t *h = base + pgno * psize;
    uint64_t need = ovpages((uint32_t)psize, v->mv_size);
    /* at least the pages it needs (LMDB never shrinks a run it rewrites in place, rule 3) */
    if (st_get64(h) != pgno || st_get16(h + 10) != PG_OVERFLOW || st_get32(h + 12) < need ||
        st_get32(h + 12) > npages - pgno)
        return st_error_set(ST_ECORRUPT, "%s: overflow page %llu says page %llu, flags 0x%x, %u pages; a value of "
                            "%zu bytes needs at least %llu pages inside the map's %llu (store damaged: `statectl "
                            "restore-backup` restores a backup)", what, (unsigned long long)pgno,
                            (unsigned long long)st_get64(h), st_get16(h + 10), st_get32(h + 12), v->mv_size,
                            (unsigned long long)need, (unsigned long long)npages);
    return 0;
}

typedef struct first_page_problem {
    char text[700];
    uint64_t n;
} first_page_problem;

static void first_page(void *arg, const st_page_problem *p)
{
    first_page_problem *f = arg;
    if (f->n++ == 0)
        snprintf(f->text, sizeof f->text, "data.mdb page %llu (%s): %s", (unsigned long long)p->pgno, p->db,
                 p->message);
}

int st_store__pages_require(st_store *st, const char *what)
{
    char path[4200];
    MDB_txn *txn = NULL;
    MDB_stat ms;
    first_page_problem f;
    memset(&f, 0, sizeof f);
    int rc = st_path(path, sizeof path, st->dir, "data.mdb");
    if (rc)
        return rc;
    pthread_rwlock_rdlock(&st->lock);
    rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = mdb_env_stat(st->env, &ms);
    if (!rc)
        rc = st_store__pages_check(path, ms.ms_psize, mdb_txn_id(txn), first_page, &f, NULL);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return st_store__edge(rc, what);
    if (f.n)
        return st_error_set(ST_ECORRUPT, "%s: %s (%llu damaged pages); the store is damaged: restore a backup with "
                            "`statectl restore-backup`", what, f.text, (unsigned long long)f.n);
    return 0;
}
