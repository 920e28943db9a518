/*
 * st_migrate.h - conversions between session-file formats and codecs, and the store's numbered
 * schema steps.
 *
 * File conversions work on images (st_store.h): read any version, change what is asked, write
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

#ifdef __cplusplus
}
#endif
#endif /* ST_MIGRATE_H */
