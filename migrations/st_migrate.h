/*
 * st_migrate.h - conversions between session-file formats and codecs, and the store's numbered
 * schema steps.
 *
 * File conversions work on images (st_image.h): read any version, change what is asked, write
 * with the version forced or automatic. Each conversion says what it changed and never touches
 * its input file; output files are replaced atomically.
 */
#ifndef ST_MIGRATE_H
#define ST_MIGRATE_H

#include <stddef.h>
#include <stdint.h>

#include "st_store.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Re-code every checkpoint of img to codec (f32 running tensors only; K/V and integer tensors are
 * never touched). Converts in slices through a scratch of ST_CODEC_SCRATCH_MAX bytes at most. */
int st_migrate_image_recode(st_image *img, uint32_t codec);

/* 0 if every checkpoint of img can be written as v1 (all fp32); ST_ELOSSY naming the first
 * checkpoint that is not. */
int st_migrate_image_v1_ok(const st_image *img);

/* Make img writable as v1: checkpoints in bf16 or f16 are widened to fp32 (exact). */
int st_migrate_image_to_v1(st_image *img);

typedef struct st_convert_opts {
    int codec;        /* -1: keep each checkpoint's codec; else an st_codec_id for all */
    uint32_t version; /* 0: automatic; 1 or 2 */
    int compress;     /* 0: none; else zstd level (v2 only) */
    void (*progress)(void *arg, const char *phase, uint64_t done, uint64_t total);
    void *progress_arg;
} st_convert_opts;

/* Read in_path, convert as opts says, write out_path atomically. in_path and out_path may name
 * the same file (the input is only replaced once the output is complete and durable).
 * ST_ELOSSY for v1 from state that is not fp32 without codec fp32. */
int st_migrate_file_convert(const char *in_path, const char *out_path, const st_convert_opts *opts);

/* Per-tensor comparison of two images of equal geometry, for `statectl diff`. */
typedef struct st_diff_entry {
    char what[96];        /* "tokens", "kv blk.3.k", "ckpt 2 @1024 blk.0.ssm_state", "logits" */
    uint64_t n;           /* elements (bytes for raw compares) compared */
    int float_compare;    /* 1: figures below are meaningful; 0: raw byte comparison */
    st_codec_errstat stat;
    uint64_t bytes_differ; /* raw compares: bytes that differ */
} st_diff_entry;

typedef struct st_diff {
    uint32_t n_entries;
    st_diff_entry *entries;
    int identical;        /* every byte of every compared part is equal */
    char note[256];       /* e.g. "checkpoint 3 only in A" */
} st_diff;

/* Compare a and b: ST_EGEOMETRY / ST_EMODEL when they cannot be compared, naming the difference.
 * Checkpoints are matched by position; float tensors are widened to fp32 and compared. */
int st_migrate_diff(const st_image *a, const st_image *b, st_diff *out);
void st_diff_free(st_diff *d);

/* ---- store schema steps ------------------------------------------------------------------------
 * A store records its schema number in its meta database; this build reads and writes
 * ST_STORE_SCHEMA (st_store.h) and st_store_open refuses any other. The steps below upgrade an
 * older store in place, one numbered step at a time; a step's number and meaning never change.
 *   1 -> 2  "refcounts-db": schema 1 kept each chunk's reference count in the first 8 bytes of
 *           its value (u64 LE) followed by the stored bytes; schema 2 keeps the bare stored bytes
 *           in "chunks" and the count in its own "refcounts" database, so a count change never
 *           rewrites a chunk. docs/STORE.md gives both layouts.
 * Each step runs in bounded write transactions and is resumable: the meta key "migrating" marks
 * a step in progress, every transaction moves whole records, and the schema number changes in
 * the last one, so a crash at any point leaves a store that `statectl migrate` finishes. */
typedef struct st_schema_step {
    uint32_t from;       /* the step upgrades schema `from` to from + 1 */
    const char *name;    /* "refcounts-db" */
    const char *summary; /* one line for --dry-run */
} st_schema_step;

/* The steps, ascending by from; *n gets their count. */
const st_schema_step *st_schema_steps(size_t *n);

typedef struct st_schema_migrate_opts {
    int dry_run;            /* report what would run; open read-only, change nothing */
    int no_backup;          /* skip the backup taken before the first step */
    const char *backup_dir; /* NULL: "<dir>.schema<N>-backup", "-2", "-3" ... if taken */
    const st_store_sys *sys;          /* NULL: the real functions */
    st_store_progress_fn progress;    /* optional */
    void *progress_arg;
} st_schema_migrate_opts;

typedef struct st_schema_migrate_report {
    uint32_t from, to;      /* schema found, schema reached (or that a dry run would reach) */
    uint32_t n_steps;       /* steps run (or that would run) */
    uint64_t items;         /* records the steps moved (or would move) */
    char backup_dir[4096];  /* the backup taken, "" when none */
} st_schema_migrate_report;

/* Upgrade the store in dir to this build's schema. Returns 0 with rep->n_steps 0 when it is
 * already current; ST_EVERSION ("store schema 3 is newer than this build's 2") for a newer one;
 * ST_ENOTFOUND when dir holds no store. The backup is a compacted copy of the old-schema store
 * (a plain LMDB directory: copy it back to undo), taken and verified before any step runs.
 * No other process may use the store meanwhile (an old schema cannot be opened for use anyway).
 * opts and rep may be NULL. */
int st_schema_migrate(const char *dir, const st_schema_migrate_opts *opts, st_schema_migrate_report *rep);

/* Restore the backup in backup_dir into dest_dir (must not exist, or be empty) like
 * st_store_restore_backup, also when the backup is of an older schema: its copy is migrated by
 * the steps above inside the restore's temporary directory, then checked fully (read_data) and
 * only then renamed into place. So dest_dir is untouched on any failure, a step that stops
 * included, and receives only a checked store of this build's schema; backup_dir is never
 * written (it is the old-schema copy: no other backup is taken). A newer schema is ST_EVERSION
 * ("the backup: store schema 3 is newer than this build's 2"). opts (may be NULL) supplies sys
 * and progress only. rep (may be NULL): from, the backup's schema; to, the restored store's;
 * n_steps and items as st_schema_migrate reports them (0 for a backup of this build's schema);
 * backup_dir "". */
int st_schema_restore_backup(const char *backup_dir, const char *dest_dir, const st_store_opts *opts,
                             st_schema_migrate_report *rep);

#ifdef __cplusplus
}
#endif
#endif /* ST_MIGRATE_H */
