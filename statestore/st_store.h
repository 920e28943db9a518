/*
 * st_store.h - the LMDB state store: sessions, versions, chunks; import and export of session
 * files; check, gc, scan, backup and restore.
 *
 * Images (st_image.h) are what the store keeps; session files (st_file.h) are what it imports
 * and exports. This header includes st_image.h (its signatures take images) but not st_file.h:
 * st_store_export names the file writer's options only by their struct tag.
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_STORE_H
#define ST_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "st_image.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- the LMDB store ----------------------------------------------------------------------------
 * A directory holding an LMDB environment (data.mdb, lock.mdb) with named databases meta,
 * sessions, versions, chunks and refcounts (docs/STORE.md gives every key and value byte by
 * byte). Each SAVE (st_store_put) of a session makes a new version: the image is cut into chunks
 * on natural boundaries, each chunk is stored once under the SHA-256 of its stored bytes, and a
 * manifest listing the chunks commits in the same transaction as the new chunks and their
 * reference counts. Sessions sharing a prefix share its chunks.
 *
 * Threads and processes: an st_store handle may be used from any number of threads at once;
 * any number of processes may open the same store (LMDB serialises writers, readers never
 * block). Every call runs its own short transactions; no call leaves one open.
 *
 * Durability: a call that returned 0 after writing has committed with a synced commit (data and
 * meta page on disk); a crash at any moment leaves each write wholly present or wholly absent.
 *
 * Errors (besides an errno): ST_ENOTFOUND (no such session, version, label or store),
 * ST_ECONFLICT (expected head not current), ST_EFULL (the map budget or the disk is full; the
 * store stays usable), ST_ECORRUPT (a check failed: the detail names the chunk and session),
 * ST_EVERSION (store schema older or newer than this build), ST_EINVAL, ST_EGEOMETRY/ST_EMODEL
 * (an image that does not match the session's earlier versions), ST_EBUSY (reader slots full). */
#include <sys/types.h> /* ssize_t */

#define ST_STORE_SCHEMA 2u             /* the schema this build writes (migrations/ upgrades) */
#define ST_STORE_ID_MAX 128            /* session id: 1..128 bytes of [A-Za-z0-9._:+=-] */
#define ST_STORE_LABEL_MAX 32          /* label name with its NUL: 1..31 bytes, same alphabet */
#define ST_STORE_LABELS_MAX 16         /* labels per session */
#define ST_STORE_KEEP_LAST_DEFAULT 8u  /* versions kept per session in a new store */
#define ST_STORE_HASH_LEN 32           /* SHA-256 */
#define ST_STORE_CHUNK_MAX (4u << 20)  /* no chunk holds more than 4 MiB of image bytes */
#define ST_STORE_CHUNK_MIN (16u << 10) /* small K/V or token pages are grouped up to this */
#define ST_STORE_HEAD_ANY 0            /* put: whatever the head is (or a new session) */
#define ST_STORE_HEAD_NONE UINT64_MAX  /* put: the session must not exist yet */

typedef struct st_store st_store;

/* The file system and commit points as the store reaches them. Tests copy the table that
 * st_store_sys_init() fills, replace entries to fail the Nth call (ENOSPC, EIO), and pass it in
 * st_store_opts.sys. What is covered:
 *   txn_commit  every write transaction's commit (LMDB writes its pages and meta page through its
 *               own descriptor inside it). Contract: the function consumes the transaction like
 *               mdb_txn_commit; a fake may mdb_txn_abort() it and return an error (the write never
 *               happened), or commit it and still return an error (the write happened but was not
 *               acknowledged); both must leave a usable store.
 *   set_mapsize every change of the map size (growth when full, adoption of another process's).
 *   open, write, fsync, rename, mkdir: the files the store itself writes: backup and
 *               restore-backup copies (mdb_env_copyfd2 output goes through write), the directory
 *               a new store is created in, and their fsyncs.
 *   disk_free   free bytes of the file system holding a path (the default map budget).
 *   reserve     fallocate of the file range a put's new chunks will take (ENOSPC: the put fails
 *               with ST_EFULL; EOPNOTSUPP, ENOSYS or EINVAL: the file system cannot, and the put
 *               populates the range instead).
 *   populate    madvise(MADV_POPULATE_WRITE) of that range when it could not be reserved
 *               (EFAULT: the disk cannot back it, the put fails with ST_EFULL).
 *   pwrite      the bytes of a reserved put's large new chunks, written into the file at the
 *               place LMDB gave them (ENOSPC: ST_EFULL; other errors: ST_EIO).
 * LMDB's own page writes are not individually covered: a failing write or fsync inside LMDB
 * surfaces from txn_commit, which is where the table injects it. */
struct MDB_env;
struct MDB_txn;
typedef struct st_store_sys {
    int (*txn_commit)(struct MDB_txn *txn);                 /* LMDB code or errno */
    int (*set_mapsize)(struct MDB_env *env, size_t size);   /* LMDB code or errno */
    int (*open)(const char *path, int flags, unsigned mode); /* -1 and errno on failure */
    ssize_t (*write)(int fd, const void *buf, size_t n);     /* -1 and errno on failure */
    int (*fsync)(int fd);                                    /* -1 and errno on failure */
    int (*rename)(const char *from, const char *to);         /* -1 and errno on failure */
    int (*mkdir)(const char *path, unsigned mode);           /* -1 and errno on failure */
    int (*disk_free)(const char *path, uint64_t *bytes);     /* 0 or errno */
    int (*populate)(void *addr, size_t len);                 /* -1 and errno on failure */
    int (*reserve)(int fd, uint64_t off, uint64_t len);      /* -1 and errno on failure */
    ssize_t (*pwrite)(int fd, const void *buf, size_t n, uint64_t off); /* -1 and errno */
} st_store_sys;
/* Fill sys with the real functions. */
void st_store_sys_init(st_store_sys *sys);

/* Progress of long work (import, export, check, gc, backup, restore, migrate): phase is a short
 * word ("check", "copy", ...), done/total in that phase's units. May be called from a helper
 * thread of the call in progress, never after the call returned. */
typedef void (*st_store_progress_fn)(void *arg, const char *phase, uint64_t done, uint64_t total);

/* Options of st_store_open. All-zero is the default for every field. */
typedef struct st_store_opts {
    int read_only;        /* open without write access (no put, delete, gc, migrate) */
    int create;           /* create the directory and an empty store when missing */
    uint64_t budget;      /* most bytes the map may grow to; 0: the data file's size plus 3/4
                             of the free space of its file system, re-read at each growth */
    uint64_t map_initial; /* map size at open; 0: max(256 MiB, 2 x the data file), <= budget */
    uint32_t keep_last;   /* retention: 0 keeps the store's setting (8 in a new store); another
                             value becomes the store's setting (needs write access) */
    int gc_deferred;      /* 0: a chunk whose count reaches 0 is deleted in the same transaction;
                             1: it stays (count 0) until st_store_gc */
    int verify_sha256;    /* get re-hashes every chunk with SHA-256 instead of XXH3-64 */
    unsigned threads;     /* threads of one call: put's hashing and compression, get's copy-out
                             and checking, check's re-hashing; 0: min(8, online CPUs) */
    const st_store_sys *sys;   /* NULL: the real functions; copied at open */
    st_store_progress_fn progress; /* optional */
    void *progress_arg;
} st_store_opts;

/* Open (or with opts->create, create) the store in directory dir. Stale reader slots left by
 * dead processes are cleared. A store of an older schema is refused with ST_EVERSION and the
 * detail "store schema 1 is older than this build's 2: run `statectl migrate DIR`"; a newer one
 * with "store schema 3 is newer than this build's 2". ST_ENOTFOUND when dir holds no store and
 * create is off. opts may be NULL. *out is NULL on failure. */
int st_store_open(st_store **out, const char *dir, const st_store_opts *opts);
/* Close the handle (accepts NULL). No call on it may be in progress. */
void st_store_close(st_store *st);
/* The directory given at open (owned by the handle). */
const char *st_store_dir(const st_store *st);
/* The store's retention setting (versions kept per session besides labelled ones). */
uint32_t st_store_keep_last(const st_store *st);

/* Schema of the store in dir without opening it for use (works on any schema). */
int st_store_schema_version(const char *dir, uint32_t *schema);

/* 1 if id is a valid session id (see ST_STORE_ID_MAX), 0 otherwise. */
int st_store_id_valid(const char *id);

/* What a put did; filled when st_put_opts.stats is set. */
typedef struct st_put_stats {
    uint64_t version;
    uint32_t chunks;        /* chunk references in the manifest */
    uint32_t new_chunks;    /* chunks that were not in the store */
    uint64_t logical_bytes; /* image payload bytes */
    uint64_t stored_bytes;  /* bytes of all referenced chunks, as stored */
    uint64_t new_bytes;     /* bytes of the new chunks, as stored */
    uint32_t pruned;        /* versions removed by retention */
    uint32_t repaired;      /* stored chunks found damaged and rewritten with the fresh bytes */
} st_put_stats;

typedef struct st_put_opts {
    int compress;           /* 0: chunks stored raw (the default); 1..19: zstd level with
                               byte-shuffle; a chunk is kept framed only when that is smaller */
    const char *label;      /* optional: label the new version (moves the label if it exists) */
    st_put_stats *stats;    /* optional out */
} st_put_opts;

/* Save img (complete: st_image_check) as a new version of session id and return its number in
 * *version (optional). Version numbers start at 1, grow by one per put and are never reused
 * while the session exists. expected_head: ST_STORE_HEAD_ANY, ST_STORE_HEAD_NONE (the session
 * must be new) or the version the caller believes is the head; anything else than the current
 * head fails with ST_ECONFLICT. An image whose model fingerprint or geometry differs from the
 * session's fails with ST_EMODEL or ST_EGEOMETRY. After the put, versions beyond the newest
 * keep_last that carry no label are deleted in the same transaction. The image is only read.
 * opts may be NULL. */
int st_store_put(st_store *st, const char *id, const st_image *img, uint64_t expected_head,
                 const st_put_opts *opts, uint64_t *version);

/* Load version (0: the head) of session id into a new image (caller frees). Every chunk is
 * checked against the XXH3-64 its manifest recorded (or SHA-256, see opts.verify_sha256) after
 * it was copied out of the store; a mismatch or a missing chunk is ST_ECORRUPT naming the chunk,
 * session and version; nothing is returned then. */
int st_store_get(st_store *st, const char *id, uint64_t version, st_image **out);
/* st_store_get with an allocation hook for the image's buffers of 2 MiB and more (as
 * st_image_create_with takes it; NULL: as st_store_get), e.g. st_engine_image_allocator(),
 * whose buffers a restore into that engine writes without faulting in fresh pages. Every byte
 * of the image is copied from the store, so its buffers are not zeroed first. */
int st_store_get_with(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                      st_image **out);
/* A streamed get, for a restore that starts while the chunks are still being copied (a RESTORE
 * from the store straight to the GPU: docs/STORE.md, "The streamed get"): the image comes back
 * once its geometry, tokens, checkpoint list, logits and state hash are read and checked, with a
 * gate (st_image_wait, st_image.h) through which a reader waits for the K/V and checkpoint bytes
 * it is about to read, while the store's threads copy them out of one read transaction, each
 * chunk checked as it is copied, in the order a restore reads them. A chunk that fails its check
 * fails every wait on it (and on everything after it) with the chunk named, and
 * st_store_stream_end. The caller must call st_store_stream_end(*fill) before it frees or changes
 * the image, except through reads and restores that waited for every byte they touch (its
 * result is the whole get's: 0 only when every chunk arrived and checked; it waits for the copy
 * to finish), and may use the image as a complete one only when it returned 0.
 * Meanwhile the calling thread may use the store as usual. */
typedef struct st_store_fill st_store_fill;
int st_store_get_stream(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                        st_image **out, st_store_fill **fill);
int st_store_stream_end(st_store_fill *fill); /* accepts NULL (0) */

/* Write version (0: head) of session id as a session file at path (atomically, durably).
 * fopts NULL re-creates the file as it was imported (same bytes) or, for a version saved by
 * put, writes it with automatic options; non-NULL forces those options. */
struct st_file_write_opts; /* st_file.h */
int st_store_export(st_store *st, const char *id, uint64_t version, const char *path,
                    const struct st_file_write_opts *fopts);

/* Read and verify the session file at path and put it as a new version of id (expected head
 * ST_STORE_HEAD_ANY). Records how to re-create the same bytes: exporting the version with
 * fopts NULL gives a file identical to path. When the writer cannot reproduce the file (an
 * unknown compression level), the file's bytes are also kept, chunked, for export. */
int st_store_import(st_store *st, const char *path, const char *id, const st_put_opts *opts,
                    uint64_t *version);

typedef struct st_store_label {
    char name[ST_STORE_LABEL_MAX];
    uint64_t version;
} st_store_label;

typedef struct st_session_info {
    char id[ST_STORE_ID_MAX + 1];
    uint8_t model_fp[ST_FINGERPRINT_LEN];
    uint8_t geometry_digest[ST_STORE_HASH_LEN]; /* SHA-256 of the stored geometry record */
    uint64_t head;            /* newest version */
    uint64_t n_versions;
    uint64_t next_version;    /* the number the next put gets */
    uint64_t created_ns, updated_ns; /* CLOCK_REALTIME, nanoseconds */
    uint32_t n_labels;
    st_store_label labels[ST_STORE_LABELS_MAX];
    int damaged;              /* list, list_page: 1 when the record does not decode (only id is set;
                                 `statectl check` names the damage) */
} st_session_info;

typedef struct st_version_info {
    uint64_t version;
    uint64_t created_ns;
    uint64_t n_tokens;
    uint64_t state_hash;
    uint64_t logical_bytes;   /* image payload bytes */
    uint64_t stored_bytes;    /* bytes of its chunks as stored (shared ones counted in full) */
    uint32_t n_checkpoints;
    uint64_t last_position;   /* position of the live checkpoint */
    uint32_t n_chunks;        /* chunk references */
    uint32_t compress;        /* zstd level of the put (0: raw) */
    uint32_t file_version;    /* session-file version export re-creates (0: automatic) */
    int file_verbatim;        /* 1: the imported file's bytes are kept for export */
    char arch[ST_ARCH_NAME_MAX]; /* the model's architecture; "" unknown (saved before versions
                                  * recorded it) */
    /* The codecs its manifest records, per checkpoint (every manifest format has them): codec is
     * the live (last) checkpoint's, st_codec_id (fp32 when it has no checkpoint); codecs has bit
     * c set for each code c < 31 some checkpoint is in, bit 31 for any code beyond. The codec is
     * that of the running state's f32 tensors: K/V and other dtypes are stored as they are. */
    uint32_t codec;
    uint32_t codecs;
    uint32_t n_framed;        /* chunk references stored zstd-framed (stored < raw length) */
} st_version_info;
#define ST_VERSION_CODEC_OTHER (1u << 31)
/* A version's codecs (st_version_info.codecs) as text, NUL-terminated in out[0..cap): the codec
 * names in code order joined by "+" ("bf16", "fp32+bf16"), "other" for ST_VERSION_CODEC_OTHER,
 * "none" when no bit is set; truncated to cap. */
void st_version_codecs_text(uint32_t codecs, char *out, size_t cap);

/* Every session, sorted by id: *out is a malloc'd array of *n entries (free()). */
int st_store_list(st_store *st, st_session_info **out, size_t *n);
/* One page of the sessions, in the order of st_store_list (ids compared bytewise): at most limit
 * sessions whose id sorts after `after`, into the caller's out[0..limit); *n says how many (fewer
 * than limit only when no more follow). `after` NULL or "" starts at the first session; it need
 * not name an existing session (it is a position), but must be a valid id (else ST_EINVAL).
 * Only the page's records are read, in one read transaction; limit 0 returns 0 sessions. Pages
 * taken while others write each show one snapshot: a session made or deleted between two calls
 * is seen or not according to where it sorts. */
int st_store_list_page(st_store *st, const char *after, st_session_info *out, size_t limit,
                       size_t *n);
/* One session. */
int st_store_show(st_store *st, const char *id, st_session_info *out);
/* Every version of a session, oldest first: malloc'd array (free()). */
int st_store_versions(st_store *st, const char *id, st_version_info **out, size_t *n);
/* One page of a session's versions, oldest first: at most limit versions numbered above after
 * (0: from the first), into the caller's out[0..limit); *n says how many (fewer than limit only
 * when no more follow). Only the page's manifests are read. ST_ENOTFOUND when there is no
 * session id. */
int st_store_versions_page(st_store *st, const char *id, uint64_t after, st_version_info *out,
                           size_t limit, size_t *n);
/* One version (0: head). */
int st_store_version_info(st_store *st, const char *id, uint64_t version, st_version_info *out);

/* Delete one version (its labels go with it). Deleting the only version deletes the session.
 * Chunks whose count reaches zero are freed at once unless opts.gc_deferred. */
int st_store_version_delete(st_store *st, const char *id, uint64_t version);
/* Delete a session and all its versions. */
int st_store_session_delete(st_store *st, const char *id);
/* Point label name at version (0: head) of session id, moving it if it exists. Labelled
 * versions are never removed by retention. ST_ETOOBIG beyond ST_STORE_LABELS_MAX labels. */
int st_store_label_set(st_store *st, const char *id, const char *name, uint64_t version);
/* Remove a label (ST_ENOTFOUND if the session has no such label). */
int st_store_label_remove(st_store *st, const char *id, const char *name);

typedef struct st_gc_stats {
    uint64_t chunks_freed;      /* chunks whose count was zero */
    uint64_t bytes_freed;       /* bytes of those and of the orphans */
    uint64_t orphans_freed;     /* chunks without a count entry that no manifest names */
} st_gc_stats;
/* Delete every chunk whose reference count is zero, in write transactions of a bounded size;
 * then the orphans st_store_check reports (chunks with no count entry that no manifest of its
 * snapshot names), unless check found a manifest it cannot read (its references are unknown);
 * each is deleted only if it still has no count entry in the deleting transaction.
 * Safe alongside readers and writers in any process: a reader's snapshot keeps what it sees,
 * and a put that takes a reference to a chunk does so in the same transaction that finds it
 * (creating its count entry), so a chunk is never freed under a reference. out may be NULL. */
int st_store_gc(st_store *st, st_gc_stats *out);

/* What check finds. */
typedef enum st_check_kind {
    ST_CHECK_META = 1,          /* meta database: schema or settings */
    ST_CHECK_SESSION = 2,       /* a session record that does not parse or disagrees with its
                                   versions (head, count, labels) */
    ST_CHECK_MANIFEST = 3,      /* a manifest that does not parse or fails its checksum */
    ST_CHECK_MISSING_CHUNK = 4, /* a manifest names a chunk the store lacks */
    ST_CHECK_REFCOUNT = 5,      /* a stored count differs from the references counted */
    ST_CHECK_ORPHAN_CHUNK = 6,  /* a chunk without a count entry */
    ST_CHECK_CORRUPT_CHUNK = 7, /* stored bytes do not hash to their key, or disagree with the
                                   length or checksum a manifest recorded */
    ST_CHECK_STATE_HASH = 8,    /* with read_data: a version whose image, reassembled as a restore
                                   does, is not what its recorded state hash says (or does not
                                   reassemble): it can never be restored */
    ST_CHECK_PAGE = 9,          /* a page of data.mdb that LMDB would misread (page, header,
                                   nodes, key order, overflow count); the database checks
                                   through LMDB are then skipped: they could crash on it */
} st_check_kind;

typedef struct st_check_problem {
    uint32_t kind;              /* st_check_kind */
    const char *session;        /* "" when not about one session */
    uint64_t version;           /* 0 when not about one version */
    char chunk[2 * ST_STORE_HASH_LEN + 1]; /* hex SHA-256, "" when not about a chunk */
    const char *message;        /* what was expected and what was found */
    uint64_t page;              /* PAGE: the damaged page of data.mdb, else 0 */
} st_check_problem;             /* valid only during the report call */

typedef struct st_check_result {
    uint64_t problems;
    uint64_t sessions, versions, chunks, refcounts;
    uint64_t zero_count_chunks; /* awaiting gc (not a problem) */
    uint64_t chunks_read, bytes_read; /* with read_data */
    uint64_t versions_hashed;   /* with read_data: versions reassembled and their state hash compared */
} st_check_result;

/* Check the store's structure in one snapshot: every session record, manifest (structure and
 * checksum), chunk reference and count; chunks no count covers; counts without a chunk. With
 * read_data, also re-hash every chunk (SHA-256 against its key) and check the length and
 * XXH3-64 each manifest recorded, reading in batches without holding a transaction across the
 * hashing; then reassemble every version of the sessions of the snapshot (st_store_get) and
 * compare the state hash of its image with the one it recorded (ST_CHECK_STATE_HASH; a version
 * that does not reassemble is reported so only when the earlier passes found nothing, which
 * otherwise named the cause; versions deleted meanwhile are skipped). report (optional) is called once per problem. Returns 0 when the check ran to the
 * end (res->problems says what it found), else the error that stopped it. res may be NULL. */
int st_store_check(st_store *st, int read_data,
                   void (*report)(void *arg, const st_check_problem *p), void *arg,
                   st_check_result *res);

/* st_store_check of the store in dir, run in a child process that opens it read-only with opts
 * (may be NULL): report is called in the caller's process as the child finds each problem. A
 * child that dies (a crash inside liblmdb on a page the page walk did not catch) is
 * ST_ECORRUPT naming the signal and the remedy (`statectl restore-backup`); the caller lives
 * on. Not for a process whose other threads hold locks the child would need (call it before
 * starting them, or from a single-threaded tool). */
int st_store_check_contained(const char *dir, const st_store_opts *opts, int read_data,
                             void (*report)(void *arg, const st_check_problem *p), void *arg,
                             st_check_result *res);

/* What the start-up scan found. */
#define ST_STORE_DB_SESSIONS 1u
#define ST_STORE_DB_VERSIONS 2u
#define ST_STORE_DB_CHUNKS 4u
#define ST_STORE_DB_REFCOUNTS 8u
typedef struct st_store_scan_stats {
    uint64_t sessions;       /* sessions found */
    uint64_t damaged;        /* of them damaged (each reported) */
    uint64_t pages;          /* pages of data.mdb walked */
    uint64_t damaged_pages;  /* damaged pages inside the databases below */
    uint32_t damaged_dbs;    /* ST_STORE_DB_* with a damaged page: walking one with a cursor could
                                enter it, so st_store_list refuses the sessions database's */
} st_store_scan_stats;

typedef void (*st_store_damaged_fn)(void *arg, const char *id, const char *why);

/* The start-up scan of the store in dir (in a child process, as st_store_check_contained):
 * walks data.mdb's pages, then every session: its record, its manifests and, without reading
 * their bytes, that every chunk they name is present with the recorded length and an intact page
 * header. damaged(arg, id, why) is called once per damaged session, in the caller's process.
 * Returns 0 when the store can be served without the damaged sessions; ST_ECORRUPT naming the
 * page and the remedy when the damage is the whole store's (meta pages, free list, the main or
 * meta database, or both the sessions and versions databases) or the scan crashed. */
int st_store_scan(const char *dir, const st_store_opts *opts, st_store_damaged_fn damaged, void *arg,
                  st_store_scan_stats *stats);

/* Tell an open handle which of its databases the scan found damaged (ST_STORE_DB_*): cursor
 * walks over the sessions database (st_store_list, st_store_list_page) then fail with
 * ST_ECORRUPT instead of entering a damaged page. */
void st_store_damaged_dbs_set(st_store *st, uint32_t dbs);

typedef struct st_store_stats {
    uint32_t schema;
    uint32_t keep_last;
    uint64_t sessions, versions;
    uint64_t logical_bytes;     /* sum over versions of their image bytes */
    uint64_t referenced_bytes;  /* sum over versions of their chunks' stored bytes */
    uint64_t chunks;            /* distinct chunks */
    uint64_t stored_bytes;      /* bytes of the distinct chunks */
    uint64_t zero_count_chunks, zero_count_bytes; /* awaiting gc */
    double dedup_ratio;         /* referenced_bytes / stored_bytes (1 when empty) */
    uint32_t page_size;
    uint64_t map_size, budget;
    uint64_t pages_used;        /* pages of the data file in use (last page + 1) */
    uint64_t pages_free;        /* pages on LMDB's free list, reusable */
    uint64_t pages_free_run;    /* the longest run of consecutive page numbers on the free list
                                   (0 when it is empty): the largest value that fits without
                                   growing the file */
    uint64_t file_bytes;        /* bytes data.mdb occupies on disk */
    char put_path[192];         /* how this handle's puts write: "fast path" (st_store_direct.c),
                                   or "plain mdb_put: " and why the fast path is off */
} st_store_stats;
/* The free map in pages: pages_used - pages_free hold data (of which zero_count_bytes are chunks
 * a gc frees), pages_free are freed pages LMDB reuses for later writes (those a reader still
 * sees once it ends), and map_size / page_size - pages_used pages of the map are not yet part of
 * the file's data. Every figure is of one read snapshot except pages_used and map_size, which
 * are the newest commit's as the snapshot starts (LMDB tells no snapshot's last page): while
 * others commit, the split between used and free may be one commit off. */
int st_store_stat(st_store *st, st_store_stats *out);

/* Hot backup into dest_dir (must not exist, or be an empty directory): a compacted copy taken
 * from one read snapshot (consistent while others write), written through the sys table into a
 * temporary sibling directory, fsynced, opened and checked with read_data (its bytes: not the
 * state-hash pass, see docs/STORE.md); only then renamed to
 * dest_dir. On failure nothing is left at dest_dir. */
int st_store_backup(st_store *st, const char *dest_dir);
/* Check the backup in backup_dir, copy it into dest_dir (must not exist, or be empty), check the
 * copy, then rename it into place. The backup must be of this build's schema: an older one is
 * ST_EVERSION pointing at st_schema_restore_backup (migrations/st_migrate.h, `statectl
 * restore-backup`), a newer one ST_EVERSION "...: store schema 3 is newer than this build's 2".
 * opts (may be NULL) supplies sys and progress only. On failure dest_dir is untouched. */
int st_store_restore_backup(const char *backup_dir, const char *dest_dir,
                            const st_store_opts *opts);
/* Brings the store in dir, of schema `schema` (older than ST_STORE_SCHEMA), to ST_STORE_SCHEMA;
 * 0, or an error with its detail. dir is a restored copy in a temporary directory that nothing
 * else uses. */
typedef int (*st_store_upgrade_fn)(void *arg, const char *dir, uint32_t schema);
/* st_store_restore_backup, also for a backup of an older schema: that backup is opened (not
 * checked: its records are not this build's), copied into the temporary directory, upgraded
 * there by upgrade(arg, tmp, schema), then the copy is checked (read_data) and renamed into
 * place. dest_dir is untouched on any failure, a failed upgrade included; backup_dir is never
 * written. upgrade NULL: st_store_restore_backup. migrations/ passes its schema steps
 * (st_schema_restore_backup); this module cannot call them itself. */
int st_store_restore_backup_upgrade(const char *backup_dir, const char *dest_dir,
                                    const st_store_opts *opts, st_store_upgrade_fn upgrade,
                                    void *arg);

/* ---- schema steps (migrations/st_schema.c drives them; statestore/st_store_schema.c holds them)
 * A step rewrites the store's records of schema `from` into those of from + 1 inside the store
 * (it touches LMDB directly, so it lives here); migrations/ numbers, names and orders the steps
 * (st_migrate.h), decides on dry runs and backups, and calls only these. */

/* Open the store in dir whatever its schema (st_store_open refuses any but ST_STORE_SCHEMA), for
 * the calls below only: no other call may be made on a handle of an older schema. */
int st_store_open_schema(st_store **out, const char *dir, const st_store_opts *opts);
/* The handle's schema: found at open, raised by each step that completed. */
uint32_t st_store_schema(const st_store *st);
/* Run the store's step from schema `from` (the handle's schema) to from + 1, adding the records
 * it moved to *items; with count_only (from at or above the handle's schema), only add the
 * records it would move (a read-only handle may count). ST_EVERSION when this build has no step from `from`; a step that stops leaves the
 * store marked and resumable (st_migrate.h). */
int st_store_schema_step(st_store *st, uint32_t from, int count_only, uint64_t *items);
/* Backup of the handle's store before a step: a compacted copy into dest_dir (created; must not
 * exist), reopened and compared (record counts, schema), fsynced; removed on failure. */
int st_store_schema_backup(st_store *st, const char *dest_dir);

/* ---- the shared tier (st_tier.c): a Redis Cluster, or one Redis, shared by several nodes -----
 * A client of one cluster: it routes each key to the master of its slot, follows MOVED and ASK,
 * and refreshes the cluster's map when a node is lost or the cluster is changing (st_tier.c
 * invariants). Every call may be made from any thread: one mutex serialises them. Errors: ST_EIO
 * when the tier cannot be reached or keeps redirecting within opts.retry_ms (the detail names the
 * last node and what it said), ST_EINVAL for bad arguments, the others as each call says. A
 * build without hiredis has these functions, and st_tier_open says the build has no client. */
typedef struct st_tier st_tier;
typedef struct st_tier_opts {
    uint32_t timeout_ms; /* connect and per-reply timeout of one node (default 1000) */
    uint32_t retry_ms;   /* how long one call keeps retrying a lost or changing cluster (5000) */
    uint32_t ttl_s;      /* garbage collection (st_tier.c invariant 6): chunks, manifests and
                            heads expire ttl_s seconds after the last write that named them
                            (a chunk put again gets its TTL again); 0 (default): never */
    int replay_takes;    /* fault injection for tests: every lease take is sent a second time
                            once answered, as the client's retry after a lost reply is; 0 */
} st_tier_opts;
void st_tier_opts_default(st_tier_opts *o);
/* url: "redis://HOST:PORT[,HOST:PORT...]", the seed nodes (at most 64); the first seed that
 * answers gives the cluster's map (a server without cluster support serves every key). */
int st_tier_open(st_tier **out, const char *url, const st_tier_opts *opts);
void st_tier_close(st_tier *t); /* accepts NULL */

/* Redis Cluster's slot of a key (CRC16 of the key or of its {hash tag}, mod 16384). */
uint32_t st_tier_key_slot(const void *key, size_t n);

/* Chunks, under their SHA-256: written only if absent (*written 1 if this call wrote it, 0 if
 * it was there; written may be NULL). chunk_get copies the value into a new buffer (caller
 * frees) of at most max bytes (else ST_ETOOBIG), after checking that it hashes to sha (else
 * ST_ECORRUPT); ST_ENOTFOUND if absent. */
int st_tier_chunk_put(st_tier *t, const uint8_t sha[ST_SHA256_LEN], const void *p, size_t n,
                      int *written);
int st_tier_chunk_get(st_tier *t, const uint8_t sha[ST_SHA256_LEN], size_t max, void **p,
                      size_t *n);
/* chunk_get into the caller's buffer of cap bytes (ST_ETOOBIG when larger): the bytes are
 * checked there, so on an error the buffer's bytes are not a chunk's. */
int st_tier_chunk_get_into(st_tier *t, const uint8_t sha[ST_SHA256_LEN], void *dst, size_t cap,
                           size_t *n);
int st_tier_chunk_exists(st_tier *t, const uint8_t sha[ST_SHA256_LEN], int *exists);
/* A version's manifest, immutable: put stores it once (the same bytes again succeed; other bytes
 * under that version are ST_ECONFLICT); get as chunk_get (no hash to check: the caller checks
 * the manifest's own records). */
int st_tier_manifest_put(st_tier *t, const char *id, uint64_t version, const void *p, size_t n);
int st_tier_manifest_get(st_tier *t, const char *id, uint64_t version, size_t max, void **p,
                         size_t *n);
/* The head of session id: its current version (0: none). head_cas moves it from expect (0:
 * none) to next (> 0) atomically, or fails with ST_ECONFLICT; *cur (may be NULL) gets the head
 * after the call either way. This compare-and-set is what keeps a stale node from committing. */
int st_tier_head_get(st_tier *t, const char *id, uint64_t *version);
int st_tier_head_cas(st_tier *t, const char *id, uint64_t expect, uint64_t next, uint64_t *cur);
/* The lease of a live conversation: owner (a node id, 1..ST_TIER_OWNER_MAX bytes without
 * spaces) for ttl_ms. take gives a token (ST_EBUSY if someone holds it); renew and release act
 * only under that token (ST_EBUSY when it expired or another node took it). A take (any of the
 * three) that got no reply (ST_EIO) still gives the token it sent: the script may have run, and
 * a release under that token once the tier answers frees what it may have taken. owner reads
 * the holder (owner "" and *ttl_ms -2 when none).
 * The holder record (st_tier.c invariant 7): every take (and takeover) also records its owner as
 * the conversation's last holder, in the same script, and gives the record it replaced in *prev
 * (optional; owner "" when none): a node whose live copy was made before another node held the
 * conversation knows that copy is stale. holder_park, under the lease's token, adds to the
 * record the tier version of session park:<id> into which the holder parked the conversation:
 * the next holder continues from it (until then, park is 0). */
#define ST_TIER_TOKEN_LEN 16
#define ST_TIER_OWNER_MAX 64
typedef struct st_tier_holder {
    char owner[ST_TIER_OWNER_MAX + 1];
    uint64_t park; /* the tier version of park:<id> the holder parked it into; 0: none */
} st_tier_holder;
int st_tier_lease_take(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                       char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev);
int st_tier_lease_renew(st_tier *t, const char *id, const char *token, uint32_t ttl_ms);
/* take over a lease that owner holds already under a token it no longer has (a release that
 * failed): a new token, ST_EBUSY when the lease is missing or another owner's. */
int st_tier_lease_takeover(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                           char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev);
int st_tier_lease_release(st_tier *t, const char *id, const char *token);
int st_tier_lease_owner(st_tier *t, const char *id, char *owner, size_t cap, int64_t *ttl_ms);
/* take_held: as take, and only while the holder record names owner or nobody: ST_ECONFLICT
 * (*prev the record; nothing changed) when another node held the conversation since (a node
 * parking its copy into the tier must not claim a conversation another node continued). */
int st_tier_lease_take_held(st_tier *t, const char *id, const char *owner, uint32_t ttl_ms,
                            char token[ST_TIER_TOKEN_LEN + 1], st_tier_holder *prev);
int st_tier_holder_park(st_tier *t, const char *id, const char *token, uint64_t park);
int st_tier_holder_get(st_tier *t, const char *id, st_tier_holder *h);
/* Waits until every write since the last sync is on at least `replicas` replicas of its master
 * (WAIT), at most timeout_ms per node: ST_EIO when fewer confirmed or a connection that wrote
 * was lost (the writes may be gone: write them again). replicas 0 forgets the writes. */
int st_tier_sync(st_tier *t, uint32_t replicas, uint32_t timeout_ms);
/* ---- a version between the local store and the tier (st_tier_xfer.c invariants) ----
 * push: version `version` (0: the head) of local session id goes to the tier as its session
 * file (version 2, uncompressed), cut at content-defined boundaries into pieces of at most
 * ST_TIER_PIECE_MAX bytes (so that conversations sharing a prefix share its pieces), each stored
 * once under its SHA-256; then its tier manifest under a new tier version, and the tier's head
 * moved to it from `expect` by compare-and-set (ST_TIER_HEAD_CURRENT: from whatever it is).
 * ST_ECONFLICT when the head is not expect or moves during the push (another node saved: the
 * caller's copy is stale). replicas > 0: returns only once st_tier_sync(replicas, wait_ms)
 * confirmed every write; when the sync fails (ST_EIO) the head is already at the new version
 * (*out says which) but its writes are unconfirmed: push again to write them again. pull: tier version `version` (0: the head) of id, every piece checked
 * against its SHA-256 and the file against the manifest's, read as a session file (at most
 * max_bytes; 0: 32 GiB) and put into the local store as a new version of id (local version
 * numbers are the store's own); on any error the local store is unchanged. */
#define ST_TIER_PIECE_MAX ((1u << 20) - 64) /* costs 1.00x its size in Redis; 1 MiB costs 1.25x */
#define ST_TIER_HEAD_CURRENT UINT64_MAX
typedef struct st_tier_xfer_stats {
    uint64_t tier_version;  /* the version pushed or pulled */
    uint64_t local_version; /* pull: the local store's new version */
    uint64_t bytes;         /* the session file's bytes */
    uint32_t pieces;        /* pieces of the file */
    uint32_t new_pieces;    /* push: pieces the tier did not have */
    uint64_t new_bytes;     /* push: their bytes */
} st_tier_xfer_stats;
int st_tier_push(st_tier *t, st_store *st, const char *id, uint64_t version, uint64_t expect,
                 uint32_t replicas, uint32_t wait_ms, st_tier_xfer_stats *out);
int st_tier_pull(st_tier *t, st_store *st, const char *id, uint64_t version, uint64_t max_bytes,
                 st_tier_xfer_stats *out);

typedef struct st_tier_stats {
    int cluster;        /* 1: a cluster; 0: one server without cluster support */
    uint32_t nodes;     /* masters that own slots in the map */
    uint64_t commands, moved, asked, retries, refreshes, connects, errors, conflicts, waits;
    uint64_t bytes_written, bytes_read;
} st_tier_stats;
void st_tier_stats_get(st_tier *t, st_tier_stats *s);

#ifdef __cplusplus
}
#endif
#endif /* ST_STORE_H */
