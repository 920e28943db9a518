/*
 * st_file.h - session files (formats v1 and v2): write an image to a file or buffer, read and
 * fully verify one back, and walk one without loading its payloads (`statectl inspect`).
 * docs/FORMAT.md describes the bytes; statestore/st_format_int.h holds the one encoding of them
 * that the reader, the writer, inspect and the store share.
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_FILE_H
#define ST_FILE_H

#include <stddef.h>
#include <stdint.h>

#include "st_image.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- session files -----------------------------------------------------------------------------
 * docs/FORMAT.md describes the bytes. */
#define ST_FILE_VERSION_1 1
#define ST_FILE_VERSION_2 2
#define ST_FILE_VERSION_MAX 2

typedef struct st_file_write_opts {
    uint32_t version;  /* 0: automatic (v1 when all fp32 and uncompressed, else v2); 1 or 2 */
    int compress;      /* 0: none; otherwise zstd level 1..19 for checkpoint tensors (v2 only) */
    int shuffle;       /* with compress: byte-shuffle by element size first (default on: 1) */
    void (*progress)(void *arg, uint64_t done, uint64_t total); /* optional */
    void *progress_arg;
} st_file_write_opts;

/* Write img to path atomically and durably: a temp file in the same directory, fsync, rename,
 * fsync of the directory; the temp file is removed on any failure and path is untouched.
 * ST_ELOSSY when version 1 is asked for state that is not fp32 or for compression.
 * opts may be NULL (automatic version, no compression). */
int st_file_write(const st_image *img, const char *path, const st_file_write_opts *opts);
/* The same bytes into a malloc'd buffer (*out, *out_len), owned by the caller. */
int st_file_write_mem(const st_image *img, const st_file_write_opts *opts, uint8_t **out,
                      size_t *out_len);

typedef struct st_file_read_opts {
    /* Cap on the bytes decompressed sections may declare in total (0: 32 GiB). */
    uint64_t max_decoded_bytes;
    /* Optional (NULL: ordinary memory): the hook for the image's buffers of 2 MiB and more, as
     * st_image_create_with takes it; e.g. st_engine_image_allocator(), whose buffers a restore
     * into that engine reads without faulting in fresh pages. */
    const st_image_allocator *alloc;
    void (*progress)(void *arg, uint64_t done, uint64_t total); /* optional */
    void *progress_arg;
} st_file_read_opts;

/* Read and fully verify a session file into a new image. Errors: ST_ENOTSTRATA (bad magic),
 * ST_EVERSION (a version this build does not read, named in the detail), ST_ECORRUPT (any
 * structure or checksum failure, the detail naming the section and offset), ST_ECODEC (unknown
 * codec id), ST_ETOOBIG, an errno. Allocation is bounded by about twice the file size plus the
 * declared decompressed sizes (capped by opts). opts may be NULL. */
int st_file_read(const char *path, const st_file_read_opts *opts, st_image **out);
int st_file_read_mem(const void *buf, size_t len, const st_file_read_opts *opts, st_image **out);

/* What inspect sees, without loading payloads (checksums are computed streaming). */
typedef enum st_section_type {
    ST_SECTION_GEOMETRY = 1,
    ST_SECTION_TOKENS = 2,
    ST_SECTION_KV = 3,
    ST_SECTION_CHECKPOINT = 4,
    ST_SECTION_LOGITS = 5,
    ST_SECTION_ARCH = 6, /* optional, right after GEOMETRY: the architecture name */
} st_section_type;

typedef struct st_file_section_info {
    uint32_t type;         /* st_section_type */
    uint32_t index;        /* tensor index (KV), checkpoint index (CHECKPOINT), else 0 */
    uint64_t offset;       /* of the section header in the file */
    uint64_t length;       /* payload bytes */
    uint64_t checksum;     /* as recorded */
    int checksum_ok;       /* recomputed checksum matches */
    /* CHECKPOINT only */
    uint64_t position;
    uint32_t codec;
    uint32_t compressed;
} st_file_section_info;

typedef struct st_file_info {
    uint32_t version;
    uint64_t file_len;
    uint64_t state_hash;
    uint64_t n_tokens;
    st_geometry geometry;            /* tensors owned by the info */
    uint32_t n_sections;
    st_file_section_info *sections;  /* owned by the info */
    int all_ok;                      /* every structure and checksum check passed */
    int first_error;                 /* 0, or the first error found */
    char first_error_detail[512];
} st_file_info;

/* Walk a file: header and section headers are parsed; checksums are recomputed with bounded
 * memory. Returns 0 when the file could be walked to its end (info->all_ok says whether every
 * checksum matched), otherwise the error that stopped the walk (info holds what was seen up to
 * there and must still be freed). A damaged header (checksum, reserved fields, a file_len that
 * says the file is truncated or extended) is noted in info and the walk goes on, so a truncated
 * file still shows its geometry and whole sections. */
int st_file_inspect(const char *path, st_file_info *info);
void st_file_info_free(st_file_info *info);

const char *st_section_type_name(uint32_t type);

/* Atomic durable replacement of path with the given bytes (temp + fsync + rename + dir fsync):
 * st_replace_file (st_common.h). */
int st_file_replace(const char *path, const void *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* ST_FILE_H */
