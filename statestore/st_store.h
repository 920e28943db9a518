/*
 * st_store.h - the state image, the session file (formats v1 and v2), and the LMDB state store.
 *
 * Ownership: an st_image owns every buffer it hands out; pointers returned by st_image_* stay
 * valid until the image is freed or the same object is replaced (st_image_tokens_set re-sizes the
 * K/V buffers, st_image_checkpoint_recode replaces that checkpoint's tensors). Images are plain
 * data: no engine is needed to build, query, read or write them. An image is not thread-safe;
 * distinct images may be used from distinct threads.
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_STORE_H
#define ST_STORE_H

#include <stddef.h>
#include <stdint.h>

#include "st_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- geometry -------------------------------------------------------------------------------
 * What a backend owns. Every enum below is an on-disk code: values never change. */
typedef enum st_role {
    ST_ROLE_RUNNING = 0, /* running state: stored per checkpoint */
    ST_ROLE_KV = 1,      /* per-token cache: shape[0] is the token axis (n_ctx), stored in pages */
} st_role;

typedef enum st_dtype {
    ST_DTYPE_F32 = 0,
    ST_DTYPE_F16 = 1,
    ST_DTYPE_BF16 = 2,
    ST_DTYPE_I8 = 3,
    ST_DTYPE_I32 = 4,
    ST_DTYPE_I64 = 5,
} st_dtype;
#define ST_DTYPE_COUNT 6

#define ST_TENSOR_NAME_MAX 48 /* bytes including the terminating NUL */
#define ST_TENSOR_NDIM_MAX 4
#define ST_GEOMETRY_TENSORS_MAX 4096
#define ST_FINGERPRINT_LEN 32

typedef struct st_tensor_desc {
    char name[ST_TENSOR_NAME_MAX]; /* printable ASCII, NUL-terminated, unique in a geometry */
    uint32_t role;                 /* st_role */
    uint32_t dtype;                /* st_dtype */
    uint32_t ndim;                 /* 1..ST_TENSOR_NDIM_MAX */
    uint64_t shape[ST_TENSOR_NDIM_MAX]; /* unused dims are 0; used dims >= 1 */
} st_tensor_desc;

typedef struct st_geometry {
    uint8_t model_fp[ST_FINGERPRINT_LEN]; /* SHA-256 model fingerprint */
    uint32_t page_size;                   /* K/V tokens per page, >= 1 */
    uint32_t n_ctx;                       /* context length, >= 1; K/V shape[0] == n_ctx */
    uint32_t n_vocab;                     /* logits length (0: no logits) */
    uint32_t n_tensors;
    const st_tensor_desc *tensors;        /* borrowed in calls; images keep their own copy */
} st_geometry;

const char *st_dtype_name(uint32_t dtype); /* "f32", ...; "unknown" */
size_t st_dtype_size(uint32_t dtype);      /* bytes per element; 0 for an unknown dtype */

/* Structural check of a geometry (names, enums, shapes, overflow of sizes); ST_EGEOMETRY with
 * a detail naming the tensor and field. */
int st_geometry_check(const st_geometry *g);
/* 0 if equal, else ST_EGEOMETRY (or ST_EMODEL for the fingerprint) with a detail naming the
 * first difference, e.g. "incompatible K/V geometry: page_size 1 vs 256". a is "expected". */
int st_geometry_compare(const st_geometry *a, const st_geometry *b);
/* Bytes of one token row of a K/V tensor (product of shape[1..] times the dtype size). */
uint64_t st_tensor_row_bytes(const st_tensor_desc *t);
/* Elements of a running tensor (product of its shape). */
uint64_t st_tensor_elems(const st_tensor_desc *t);
/* Bytes of a running tensor stored in codec: f32 tensors take the codec's element size, other
 * dtypes are stored unchanged whatever the codec. */
uint64_t st_tensor_stored_bytes(const st_tensor_desc *t, uint32_t codec);

/* ---- image ----------------------------------------------------------------------------------- */
typedef struct st_image st_image;

/* A new empty image (0 tokens, no checkpoints, no logits) with a copy of g (checked). */
int st_image_create(st_image **out, const st_geometry *g);
void st_image_free(st_image *img); /* accepts NULL */
/* Deep copy. */
int st_image_clone(st_image **out, const st_image *img);

/* The image's geometry; its tensors array is owned by the image. */
const st_geometry *st_image_geometry(const st_image *img);

/* Tokens. Setting them (n <= n_ctx) resizes every K/V tensor to n rows; rows [0, min(old, n))
 * keep their bytes, new rows are zero. */
int st_image_tokens_set(st_image *img, const uint32_t *tokens, uint64_t n);
uint64_t st_image_n_tokens(const st_image *img);
const uint32_t *st_image_tokens(const st_image *img);

/* K/V tensor (geometry index ti, role kv): n_tokens rows of st_tensor_row_bytes bytes.
 * Pages: page p covers rows [p*page_size, min((p+1)*page_size, n_tokens)). */
void *st_image_kv(st_image *img, uint32_t ti, uint64_t *len);
const void *st_image_kv_const(const st_image *img, uint32_t ti, uint64_t *len);
uint64_t st_image_kv_pages(const st_image *img);

/* Checkpoints, ordered by position (strictly increasing); the live state is the last one and
 * must sit at n_tokens for the image to be complete (st_image_check). Adding allocates zeroed
 * tensors in the given codec and returns the new index in *index. */
int st_image_checkpoint_add(st_image *img, uint64_t position, uint32_t codec, uint32_t *index);
uint32_t st_image_n_checkpoints(const st_image *img);
int st_image_checkpoint_info(const st_image *img, uint32_t ci, uint64_t *position, uint32_t *codec);
/* Running tensor ti (role running) of checkpoint ci: st_tensor_stored_bytes(desc, codec) bytes. */
void *st_image_checkpoint_tensor(st_image *img, uint32_t ci, uint32_t ti, uint64_t *len);
const void *st_image_checkpoint_tensor_const(const st_image *img, uint32_t ci, uint32_t ti,
                                             uint64_t *len);
/* Re-code checkpoint ci's f32 tensors to another codec (other dtypes unchanged), converting in
 * slices through the caller's scratch (see st_codec_convert). */
int st_image_checkpoint_recode(st_image *img, uint32_t ci, uint32_t codec, void *scratch,
                               size_t scratch_cap);
/* Remove checkpoint ci. */
int st_image_checkpoint_remove(st_image *img, uint32_t ci);

/* Last-token logits: n_vocab floats, or none (n == 0). */
int st_image_logits_set(st_image *img, const float *logits, uint32_t n);
const float *st_image_logits(const st_image *img, uint32_t *n);

/* State hash recorded by the engine (0: none). Carried by files and the store unchanged. */
void st_image_state_hash_set(st_image *img, uint64_t h);
uint64_t st_image_state_hash(const st_image *img);

/* Structural invariants of a complete image: at least one checkpoint, positions strictly
 * increasing and <= n_tokens, the last at n_tokens, codecs known, logits empty or n_vocab. */
int st_image_check(const st_image *img);

/* Total bytes of payload (tokens, K/V, checkpoint tensors, logits). */
uint64_t st_image_bytes(const st_image *img);

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
    void (*progress)(void *arg, uint64_t done, uint64_t total); /* optional */
    void *progress_arg;
} st_file_read_opts;

/* Read and fully verify a session file into a new image. Errors: ST_ENOTSTRATA (bad magic),
 * ST_EVERSION (a version this build does not read, named in the detail), ST_ECORRUPT (any
 * structure or checksum failure, the detail naming the section and offset), ST_ECODEC (unknown
 * codec id), ST_ETOOBIG, an errno. Allocation is bounded by the file size plus the declared
 * decompressed sizes (capped by opts). opts may be NULL. */
int st_file_read(const char *path, const st_file_read_opts *opts, st_image **out);
int st_file_read_mem(const void *buf, size_t len, const st_file_read_opts *opts, st_image **out);

/* What inspect sees, without loading payloads (checksums are computed streaming). */
typedef enum st_section_type {
    ST_SECTION_GEOMETRY = 1,
    ST_SECTION_TOKENS = 2,
    ST_SECTION_KV = 3,
    ST_SECTION_CHECKPOINT = 4,
    ST_SECTION_LOGITS = 5,
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
 * there and must still be freed). */
int st_file_inspect(const char *path, st_file_info *info);
void st_file_info_free(st_file_info *info);

const char *st_section_type_name(uint32_t type);

/* ---- synthetic images (demos, tests, benchmarks) -------------------------------------------
 * A deterministic image shaped like a hybrid model's state: per layer a recurrent state
 * blk.N.ssm_state f32 [heads, dk, dv] and a convolution history blk.N.conv_state f32 [3, channels];
 * every attn_every-th layer instead has K/V tensors blk.N.k / blk.N.v f16 [n_ctx, kv_heads,
 * head_dim]; one integer tensor "pos" i64 [1]. Values are seeded smooth noise of mixed magnitudes
 * (not zeros), so codecs and compression see realistic data. */
typedef struct st_synth_opts {
    uint64_t seed;
    uint32_t n_layers;     /* default 4 */
    uint32_t attn_every;   /* default 4: layers 3, 7, ... are attention */
    uint32_t heads;        /* default 4 */
    uint32_t head_dim;     /* dk = dv = head_dim; default 32 */
    uint32_t kv_heads;     /* default 2 */
    uint32_t n_ctx;        /* default 4096 */
    uint32_t page_size;    /* default 256 */
    uint32_t n_vocab;      /* default 260 */
    uint64_t n_tokens;     /* default 300; <= n_ctx */
    uint32_t n_checkpoints;/* default 2; spread over the tokens, the last at n_tokens */
    uint32_t codec;        /* codec of every checkpoint; default fp32 */
    uint64_t prefix_seed;  /* tokens/KV rows below prefix_len come from this seed (shared prefix) */
    uint64_t prefix_len;
} st_synth_opts;
int st_image_synthesize(const st_synth_opts *opts, st_image **out);

/* Atomic durable replacement of path with the given bytes (temp + fsync + rename + dir fsync). */
int st_file_replace(const char *path, const void *buf, size_t len);

#ifdef __cplusplus
}
#endif
#endif /* ST_STORE_H */
