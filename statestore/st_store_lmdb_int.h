/*
 * st_store_lmdb_int.h - internals of the LMDB store shared by its .c files (statestore/) and
 * white-box tests. Nothing else includes this header: migrations/ drives the schema steps, which
 * live in st_store_schema.c, through st_store.h's schema API. docs/STORE.md describes every record below byte by byte.
 */
#ifndef ST_STORE_LMDB_INT_H
#define ST_STORE_LMDB_INT_H

#include <lmdb.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>

#include "st_file.h"
#include "st_format_int.h"
#include "st_store.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "store records are little-endian and tensors are stored as raw bytes: a little-endian host is required"
#endif

/* ---- the handle ------------------------------------------------------------------------------ */

struct st_store {
    MDB_env *env;
    MDB_dbi dbi_meta, dbi_sessions, dbi_versions, dbi_chunks, dbi_refcounts;
    int have_refcounts;       /* 0 only in a schema-1 store opened for migration */
    char *dir;
    st_store_opts opts;       /* as given, with sys pointing at our copy */
    st_store_sys sys;
    unsigned env_flags;       /* flags of mdb_env_open */
    uint32_t schema;          /* schema found at open */
    uint32_t keep_last;
    unsigned threads;
    unsigned fill_threads; /* a streamed get's copy (st_store_get.c): opts.threads, else every CPU up to 16 */
    /* Held shared by every call for the life of its transactions, exclusively to change the
     * map size or reopen the environment (LMDB forbids either with a transaction in flight). */
    pthread_rwlock_t lock;
    uint64_t map_size;        /* as last set (under lock) */
    void *map_base;           /* where the map of map_base_size bytes starts (put_populate) */
    uint64_t map_base_size;
    uint32_t verify_tick;     /* put: which existing chunks to compare (inside write txns only) */
    uint32_t damaged_dbs;     /* ST_STORE_DB_* a start-up scan found damaged (st_store_damaged_dbs_set) */
    int direct;               /* put's fast path (st_store_direct.c) on; chosen at open */
    char direct_why[160];     /* why it is off */
    /* st_store__value_check: the mapping of data.mdb last seen holding a value, [vc_lo, vc_hi)
     * with the file's offset 0 at vc_base (reset by every remap; under vc_mu) */
    pthread_mutex_t vc_mu;
    uintptr_t vc_lo, vc_hi, vc_base;
};

/* Open the environment in dir and its databases whatever the schema: st->schema says what was
 * found; the refcounts database is opened only when present (have_refcounts). extra_flags are
 * added to mdb_env_open's (MDB_RDONLY, MDB_NOLOCK for checking a backup nobody else uses).
 * Used by st_store_open (which then refuses any schema but the current one) and by migrations. */
int st_store__open_any(st_store **out, const char *dir, const st_store_opts *opts,
                       unsigned extra_flags);

/* Map an LMDB (or errno) code from call `what` to the project's error space with a detail:
 * MDB_MAP_FULL and ENOSPC -> ST_EFULL, corruption codes -> ST_ECORRUPT, MDB_READERS_FULL ->
 * ST_EBUSY, MDB_NOTFOUND -> ST_ENOTFOUND, MDB_VERSION_MISMATCH/MDB_INVALID -> ST_EVERSION,
 * MDB_TXN_FULL -> ST_ETOOBIG, MDB_PANIC -> ST_EIO, other errno values unchanged. */
int st_store__lmdb_err(int rc, const char *what);
/* The store's edge. Inside the store, LMDB codes travel up raw from the mdb_* call that gave
 * them; where a call leaves the store (a public function returns, or the code is reported with
 * a detail) it goes through here, once: an LMDB code becomes its st_err code with a detail
 * naming `what` (st_store__lmdb_err's table, the only one); 0, ST_E* codes and errno values that
 * the store's own code set (with their detail) pass unchanged. st_store__write applies it to
 * every write (and maps the errno of a commit too). */
int st_store__edge(int rc, const char *what);

/* Begin a read transaction (caller holds st->lock shared). */
int st_store__rtxn(st_store *st, MDB_txn **txn);

/* Run fn in a write transaction and commit it through st->sys.txn_commit, handling what LMDB
 * asks of the caller: when the map is full (MDB_MAP_FULL from fn or the commit) the transaction
 * is aborted, the map grown within the budget (no transaction in flight) and fn run again from
 * the start; MDB_MAP_RESIZED (another process grew it) adopts the new size and retries. fn must
 * therefore have no effect outside the transaction until the call returns 0; it returns 0, an
 * LMDB code (passed through this handling) or an error already mapped. Takes st->lock itself. */
int st_store__write(st_store *st, int (*fn)(st_store *st, MDB_txn *txn, void *arg), void *arg);

/* Bytes data.mdb occupies on disk (with MDB_WRITEMAP its apparent size is the map size). */
uint64_t st_store__file_bytes(const char *dir);

/* Copy the environment, compacted, into a new file dest_dir/data.mdb (dest_dir must exist)
 * through st->sys (mdb_env_copyfd2 writes into a pipe drained by a thread that writes and
 * fsyncs through the table). Takes st->lock shared. */
int st_store__copy_env(st_store *st, const char *dest_dir);

/* Remove dir and the LMDB files in it (data.mdb, lock.mdb) after a failed backup or restore;
 * anything else in dir is left alone (and the directory with it). */
void st_store__remove_env_dir(const char *dir);

/* fsync a directory (through sys). */
int st_store__fsync_dir(const st_store_sys *sys, const char *dir);

/* Run fn(ctx, i, &fctx) for i in [0, n) on the calling thread and up to threads-1 helpers
 * (items taken in order from a shared counter); *fctx is a per-thread frame context the
 * function may create (freed at the end). The first error stops the others and is returned
 * with its detail. */
int st_store__par_run(unsigned threads, size_t n, int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx),
                      void *ctx);
/* The same pool left running (st_store_par.c, "the stream"): helpers threads start running
 * fn(ctx, i, &fctx) for i = 0, 1, ... at once; st_store__stream_wait(s, i) returns when item i
 * is done (running later items itself while it waits), or the first failure with its detail;
 * st_store__stream_stop stops claiming, joins the helpers, frees s and returns when every
 * item finished (monotonic ms; 0 if it did not). */
typedef struct st_stream st_stream;
int st_store__stream_start(unsigned helpers, size_t n, int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx),
                           void *ctx, st_stream **out);
int st_store__stream_wait(st_stream *s, size_t i);
/* st_store__stream_wait without running items itself (a consumer with other work to queue). */
int st_store__stream_wait_idle(st_stream *s, size_t i);
/* Stop claiming and join the helpers (no item is running afterwards); s stays valid for waits
 * until _stop. Call it only once every item is done or one has failed: a wait on an item not
 * done returns the failure, and would block forever without one. */
void st_store__stream_join(st_stream *s);
double st_store__stream_stop(st_stream *s);
/* A state-hash runner (st_state_hash_runner) spreading the block digests over *run_arg threads
 * (an unsigned) with st_store__par_run. */
void st_store__state_hash_runner(void *run_arg, uint64_t n, st_state_hash_task task, void *arg);

/* Report progress if the handle asked for it. */
void st_store__progress(const st_store *st, const char *phase, uint64_t done, uint64_t total);

/* ---- pages (st_store_pages.c: a walk over data.mdb that reads the file, not through LMDB) ---- */

/* The keys a damaged page covers, as its parent gave them: keys >= lo (when has_lo) and < hi
 * (when has_hi); prev is the last key of the good leaf before it in key order (a cursor that
 * walks up to prev steps into the damaged page next). Pointers valid during the report only. */
typedef struct st_page_range {
    const uint8_t *lo, *hi, *prev;
    size_t lo_len, hi_len, prev_len;
    int has_lo, has_hi, has_prev;
} st_page_range;

typedef struct st_page_problem {
    const char *db;         /* "meta pages", "free list", "main", or a database's name */
    uint64_t pgno;          /* the damaged page */
    st_page_range range;    /* all zero when the whole database is affected */
    const char *message;
} st_page_problem;

typedef void (*st_page_report_fn)(void *arg, const st_page_problem *p);

typedef struct st_page_stats {
    uint64_t problems, pages, npages, txnid;
    uint32_t psize;
} st_page_stats;

/* 0 when the running liblmdb is of the 0.9 file format the walker knows, else ST_EVERSION. */
int st_store__pages_version_ok(void);

/* Walk every page of the newest snapshot of the data.mdb at path: both metas, the free list and
 * every database the main database names (page headers and bounds, packed nodes, key order
 * inside the parent's range, depth, overflow headers and counts inside the file, every page
 * reached once, free pages not in use, the page counts each database records). Each damaged page
 * is reported once (its subtree is not walked). psize_expected (0: any) is the running
 * environment's page size; txnid (0: the newest) the transaction of the caller's read snapshot,
 * which keeps its pages from reuse (ST_EBUSY when neither meta holds it any more: two commits
 * since it began). Returns 0 when the walk
 * ran (stats->problems counts what it found), else an error. stats may be NULL. */
int st_store__pages_check(const char *path, uint32_t psize_expected, uint64_t txnid, st_page_report_fn report,
                          void *arg, st_page_stats *stats);

/* Walk the pages of st's current snapshot (holding a read transaction for it): 0, or
 * ST_ECORRUPT naming `what`, the first damaged page and the remedy. Run before work that walks
 * whole databases through LMDB outside check (gc, stat, backup), which could crash on one. */
int st_store__pages_require(st_store *st, const char *what);

/* Check one value LMDB returned from the map before it is copied or its key deleted: inline
 * values must fit their leaf page, and a value in overflow pages must have the header LMDB
 * wrote (its page number, P_OVERFLOW, exactly the pages its length needs, inside the map).
 * A value outside the map (a page a write transaction without MDB_WRITEMAP copied) is its own.
 * Cheap: one header read. 0, or ST_ECORRUPT naming `what`, the page and the remedy. */
int st_store__value_check(st_store *st, const MDB_val *v, const char *what);

/* The start-up scan itself (st_store_scan.c), run by st_store_scan in its child process. */
int st_store__scan(const char *dir, const st_store_opts *opts, st_store_damaged_fn damaged, void *arg,
                   st_store_scan_stats *stats);

/* ---- records ---------------------------------------------------------------------------------
 * Little-endian throughout; each has a magic and a format number; readers check every length
 * against the bytes present before using it. */

#define ST_META_SCHEMA "schema"        /* u32 */
#define ST_META_KEEP_LAST "keep_last"  /* u32 */
#define ST_META_CREATED "created"      /* u64 ns */
#define ST_META_MIGRATING "migrating"  /* u32: schema a step is moving to (crash in between) */

#define ST_SESSION_MAGIC 0x53535453u   /* "STSS" */
#define ST_SESSION_FORMAT 1u
#define ST_SESSION_HDR 112u
#define ST_SESSION_LABEL 40u

/* the geometry record: st_format_int.h */

#define ST_MANIFEST_MAGIC 0x464d5453u  /* "STMF" */
#define ST_MANIFEST_FORMAT 1u       /* a version of unknown architecture: as before */
#define ST_MANIFEST_FORMAT_ARCH 2u  /* format 1 and the architecture name after its header */
#define ST_MANIFEST_HDR 96u
#define ST_MANIFEST_HDR_ARCH (ST_MANIFEST_HDR + ST_ARCH_NAME_MAX)
#define ST_MANIFEST_CKPT 16u
#define ST_MANIFEST_SECTION 32u
#define ST_MANIFEST_CHUNK 48u
#define ST_MANIFEST_TRAILER 8u
#define ST_MANIFEST_VERBATIM 1u        /* flags: a FILE section keeps the imported bytes */
#define ST_MANIFEST_CKPTS_MAX (1u << 20)
#define ST_MANIFEST_CHUNKS_MAX (1u << 26)

/* Section types of a manifest (on-disk codes): ST_MSEC_*, st_format_int.h. */

typedef struct st_mchunk {
    uint8_t hash[ST_STORE_HASH_LEN]; /* SHA-256 of the stored bytes: the chunks key */
    uint64_t xxh;                    /* XXH3-64 of the stored bytes */
    uint32_t raw_len;                /* image bytes it holds (1..ST_STORE_CHUNK_MAX) */
    uint32_t stored_len;             /* stored bytes; < raw_len exactly when framed */
} st_mchunk;

typedef struct st_msection {
    uint32_t type, index, tensor;
    uint32_t n_chunks;
    uint64_t length;                 /* image bytes of the section (sum of its raw_len) */
    uint32_t first;                  /* index of its first chunk in the chunk table */
} st_msection;

typedef struct st_mckpt {
    uint64_t position;
    uint32_t codec;
} st_mckpt;

/* A parsed manifest (arrays malloc'd; free with st_manifest_free). */
typedef struct st_manifest {
    uint32_t flags;
    uint64_t version, created_ns, state_hash, n_tokens, logical_bytes, stored_bytes;
    uint32_t file_version;
    int32_t file_compress, file_shuffle;
    uint32_t compress;
    uint32_t n_ckpt, n_sec, n_chunks;
    char arch[ST_ARCH_NAME_MAX];     /* "" (format 1) or the image's architecture (format 2) */
    st_mckpt *ckpt;
    st_msection *sec;
    st_mchunk *chunks;
} st_manifest;

/* Parse and check (structure, counts, lengths, trailer checksum) a manifest; ST_ECORRUPT with a
 * detail prefixed by `what` ("session a version 3"). */
int st_manifest_parse(const void *buf, size_t len, const char *what, st_manifest *m);
void st_manifest_free(st_manifest *m);
/* Check that a parsed manifest's sections are exactly those an image of geometry g needs
 * (order, tensors, lengths, checkpoint codecs); ST_ECORRUPT naming the first misfit. */
int st_store__manifest_layout_check(const st_manifest *m, const st_geometry *g, const char *what);
/* Serialise m (all fields) into a malloc'd buffer. */
int st_manifest_encode(const st_manifest *m, uint8_t **out, size_t *out_len);
/* Patch the version and creation time of an encoded manifest and recompute its trailer. */
void st_manifest_patch(uint8_t *buf, size_t len, uint64_t version, uint64_t created_ns);

typedef struct st_session_rec {
    uint8_t model_fp[ST_FINGERPRINT_LEN];
    uint8_t geometry_digest[ST_STORE_HASH_LEN];
    uint64_t head, next_version, n_versions, created_ns, updated_ns;
    uint32_t n_labels;
    st_store_label labels[ST_STORE_LABELS_MAX];
} st_session_rec;

int st_session_parse(const void *buf, size_t len, const char *id, st_session_rec *r);
/* Into dst of ST_SESSION_HDR + n_labels * ST_SESSION_LABEL bytes; returns the length. */
size_t st_session_encode(const st_session_rec *r, uint8_t *dst);
#define ST_SESSION_REC_MAX (ST_SESSION_HDR + ST_STORE_LABELS_MAX * ST_SESSION_LABEL)

/* Geometry record (st_geometry_encode, st_geometry_decode): st_format_int.h. */

/* versions key: id bytes, a 0 byte, the version big-endian (so a session's versions sort
 * together, oldest first). */
#define ST_VKEY_MAX (ST_STORE_ID_MAX + 1 + 8)
size_t st_vkey(uint8_t *dst, const char *id, uint64_t version);
/* Split a versions key; 0, or ST_ECORRUPT when it is not one. id gets a NUL. */
int st_vkey_parse(const void *key, size_t len, char *id, uint64_t *version);
/* 1 and *version when key is a versions key of session id (idlen bytes), else 0 (a cursor that
 * walks one session's versions stops there). */
int st_vkey_of(const void *key, size_t len, const char *id, size_t idlen, uint64_t *version);

/* little-endian helpers: st_put16/32/64, st_get16/32/64 (st_common.h) */

/* dir + "/" + name into dst; ST_EINVAL when it does not fit. */
static inline int st_path(char *dst, size_t cap, const char *dir, const char *name)
{
    int n = snprintf(dst, cap, "%s/%s", dir, name);
    return n < 0 || (size_t)n >= cap ? st_error_set(ST_EINVAL, "path too long: %s/%s", dir, name) : 0;
}

/* Hex of a hash (2 * n + 1 bytes in dst). */
void st_store_hex(char *dst, const uint8_t *p, size_t n);
/* SHA-256 (OpenSSL EVP). */
int st_store_sha256(const void *p, size_t n, uint8_t out[ST_STORE_HASH_LEN]);
uint64_t st_store_now_ns(void);

/* ---- the store's files (st_lmdb_store.c: environment; st_store_put.c, st_store_get.c,
 * st_store_export.c, st_store_catalog.c, st_store_par.c, st_store_direct.c): what they share --- */

#define ST_GET_RETRIES 3
#define ST_PAR_MIN_BYTES (4u << 20) /* below this, one thread does all the hashing */
#define ST_VERIFY_EVERY 16          /* put: about one existing chunk in 16 is compared */
/* A reserved put writes new chunks of at least this many bytes with pwrite (smaller ones, in
 * B-tree leaves, are copied into the map). */
#define ST_PWRITE_MIN (8u << 10)

/* The most bytes the map may take now (the budget, or the data file plus 3/4 of the free disk). */
uint64_t st_store__map_budget(const st_store *st);

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
    st_stream *hashing;        /* prepare_one of every chunk, running ahead of the inserts */
    double t_fn, t_pop, t_ins; /* STRATA_STORE_TRACE: write start, populate done, inserts done */
    double t_wait;             /* STRATA_STORE_TRACE: put_fn's time waiting for hashes */
    double t_state;            /* STRATA_STORE_TRACE: the state-hash check's time (its item) */
    double t_drain;            /* STRATA_STORE_TRACE: waiting for the writer after the inserts */
    double t_pwrite;           /* STRATA_STORE_TRACE: the writer's time inside pwrite */
    int attempts;
    int direct;                /* the last attempt wrote with pwrite (the fast path) */
} st_put_ctx;

typedef struct st_file_as {
    uint32_t version;
    int compress, shuffle;
    const uint8_t *verbatim;
    size_t verbatim_len;
} st_file_as;

/* A chunk to bring out of the store into dst (raw_len bytes). */
typedef struct st_job {
    uint32_t chunk;     /* index in the manifest's chunk table */
    uint8_t *dst;
    uint8_t *staged;    /* where its stored bytes were copied when framed (into the stage) */
    const void *src;    /* in the map: valid only while fetch's read transaction is open */
} st_job;

#define ST_CHANGED (-4900) /* the manifest changed between two reads (get, export) */

/* put (st_store_put.c); fa (NULL for a plain put) says how the image came as a session file. */
int st_store__put_ex(st_store *st, const char *id, const st_image *img, uint64_t expected, const st_put_opts *opts,
                     const st_file_as *fa, uint64_t *version);

/* get (st_store_get.c): one read of a session record and a version's manifest (copied out);
 * the jobs of one section; copying jobs' chunks out of one read transaction and checking them. */
int st_store__manifest_read(st_store *st, const char *id, uint64_t version, uint64_t *resolved, uint8_t **mbuf,
                            size_t *mlen, st_session_rec *rec_out);
int st_store__jobs_for_section(const st_manifest *m, uint32_t s, uint8_t *base, st_job *jobs, size_t *n);
int st_store__fetch(st_store *st, const char *id, uint64_t version, const uint8_t *mbuf, size_t mlen,
                    const st_manifest *m, st_job *jobs, size_t n);

/* catalog (st_store_catalog.c): session records and retention inside a write transaction. */
int st_store__session_get(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, int *found);
int st_store__session_put(st_store *st, MDB_txn *txn, const char *id, const st_session_rec *rec);
int st_store__label_apply(st_session_rec *rec, const char *id, const char *name, uint64_t version);
int st_store__prune_txn(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, uint32_t keep,
                        uint32_t *pruned);

/* ---- the put's fast path (st_store_direct.c: its top comment lists what it assumes of LMDB) -- */

/* One put's use of it, inside one write transaction. */
typedef struct st_writer st_writer;
typedef struct st_direct {
    st_writer *w;              /* the thread that pwrites (NULL: the caller's thread does) */
    int on;                    /* new large chunks go in with pwrite (else: copied) */
    mdb_filehandle_t fd;
    const char *base;          /* the map, as looked up */
    uint64_t wb_done, wb_hi;   /* early writeback: file bytes handed to it, end of the copies */
    /* the reservation, made as new chunks come (st_store_direct.c, reserve_more) */
    int reserving;             /* reserve ahead of each new chunk */
    int have_fd, no_reserve;   /* no_reserve: the file system cannot fallocate (populate) */
    char *pop_base;            /* the map to populate (fast path), else NULL */
    void *advised;             /* the map, MADV_RANDOM while the transaction runs (or NULL) */
    uint64_t advised_len;
    uint64_t psize, map_size;
    uint64_t start, res_end;   /* file bytes [start, res_end) past the last page are reserved */
    uint64_t need, credit;     /* bytes of new pages counted so far; free-list bytes LMDB uses first */
    double pwrite_ms;          /* the writer's time inside pwrite, this attempt (the store's trace) */
} st_direct;
/* Start a put's use of the fast path: read the free list, predict MDB_MAP_FULL (the chunks
 * could not fit if all were new, and the map may grow) and reserve the margin; ST_EFULL when the
 * disk cannot take it. */
int st_store__direct_begin(st_store *st, MDB_txn *txn, const st_plan *p, st_direct *d);
/* Insert one chunk under its hash with MDB_NOOVERWRITE: 0 (stored), MDB_KEYEXIST (v is the
 * stored value), or an error. A new chunk's pages are reserved first (ST_EFULL when the disk
 * cannot take them; MDB_MAP_FULL when they do not fit and the map may grow). */
int st_store__direct_insert(st_store *st, MDB_txn *txn, st_direct *d, const st_piece *pc, MDB_val *v);
/* After the inserts, on every path out of the transaction's function: wait for the queued
 * pwrites and stop the writer. Returns rc, or when rc is 0 the first failed write's error. */
int st_store__direct_end(st_store *st, st_direct *d, int rc);
/* At open: check the fast path's assumptions against the running liblmdb and this environment;
 * sets st->direct and, when off, st->direct_why (also on stderr with STRATA_STORE_TRACE). */
void st_store__direct_probe(st_store *st);
/* The assumptions as a pure function (tests feed it other versions and damaged meta pages): 1
 * when they hold, else 0 and why in dst. meta0/meta1: the first meta_len bytes of pages 0 and 1. */
int st_store__direct_check(int major, int minor, uint32_t psize, long os_page, const uint8_t *meta0,
                           const uint8_t *meta1, size_t meta_len, char *dst, size_t cap);
/* Bytes of a meta page st_store__direct_check reads. */
#define ST_DIRECT_PROBE_BYTES 44u
/* "" when the fast path is on (*on = 1), else why it is off. */
const char *st_store__direct_status(const st_store *st, int *on);

#endif /* ST_STORE_LMDB_INT_H */
