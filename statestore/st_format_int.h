/*
 * st_format_int.h - the session file's bytes, written down once (docs/FORMAT.md): the header and
 * section sizes, the section codes (the file's and a store manifest's), the geometry encoding
 * (a GEOMETRY section's payload, and the store's geometry record that frames the same bytes),
 * and the structural rules of the walk over a file's sections that the reader (st_file_read)
 * and inspect (st_file_inspect, `statectl inspect`) both apply. Implemented in st_format.c.
 * Internal to statestore/ (and its white-box tests).
 *
 * Invariants:
 * 1. One encoding per structure: every writer of a geometry (the file writer, the store's
 *    record) encodes it here, every reader decodes it here, with one set of validity rules.
 * 2. The rules of a file's structure (section order, lengths, checkpoint headers) are functions
 *    here of what was read; the reader stops at the first rule that fails, inspect records it and
 *    goes on, but neither has a rule of its own.
 */
#ifndef ST_FORMAT_INT_H
#define ST_FORMAT_INT_H

#include <stdint.h>
#include <string.h>

#include "st_file.h"
#include "st_image.h"

#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "session files are little-endian and tensors are stored as raw bytes: a little-endian host is required"
#endif

/* ---- sizes and codes (docs/FORMAT.md) --------------------------------------------------------- */
#define ST_HDR_LEN 64u
#define ST_SEC_HDR_LEN 32u
#define ST_SEC_HASHED 24u /* the section checksum covers these header bytes, then the payload */
#define ST_GEOM_FIXED 48u
#define ST_GEOM_REC 96u
#define ST_CKPT_HDR 16u
#define ST_CFLAG_ZSTD 1u
#define ST_CFLAG_SHUFFLE 2u

extern const uint8_t st_fmt_magic[8]; /* "STRATAsf" */

/* Section codes of a store manifest (docs/STORE.md): a manifest's sections hold an image's parts
 * under the codes of the session file's sections (st_section_type, st_file.h) that hold the same
 * parts; code 6 is the manifest's own FILE (the imported file's bytes), where a file has ARCH (a
 * manifest keeps the architecture name in its header). On-disk codes: values never change. */
enum {
    ST_MSEC_GEOMETRY = ST_SECTION_GEOMETRY, /* one chunk: the geometry record */
    ST_MSEC_TOKENS = ST_SECTION_TOKENS,     /* u32 LE tokens */
    ST_MSEC_KV = ST_SECTION_KV,             /* index: tensor; n_tokens rows */
    ST_MSEC_CKPT = ST_SECTION_CHECKPOINT,   /* index: checkpoint, tensor: running tensor */
    ST_MSEC_LOGITS = ST_SECTION_LOGITS,     /* f32 */
    ST_MSEC_FILE = 6,                       /* the imported session file's bytes */
};

/* ---- the geometry --------------------------------------------------------------------------------
 * The bytes: ST_GEOM_FIXED bytes (fingerprint, page_size, n_ctx, n_vocab, n_tensors) then one
 * ST_GEOM_REC record per tensor (name NUL-padded to 48, role, dtype, ndim, reserved 0, shape[4]).
 * A session file's GEOMETRY section is exactly these bytes; the store's geometry record is
 * ST_GEOM_MAGIC, ST_GEOM_FORMAT (u32 each) and then these bytes. The validity rules (one set for
 * both): n_tensors 0..ST_GEOMETRY_TENSORS_MAX, the length exactly what n_tensors needs, every
 * name's padding after its NUL zero, every reserved field zero, and st_geometry_check. */
#define ST_GEOM_MAGIC 0x4d475453u /* "STGM" */
#define ST_GEOM_FORMAT 1u
#define ST_GEOM_HDR (8u + ST_GEOM_FIXED) /* the store record's bytes before the first tensor */
#define ST_GEOM_TENSOR ST_GEOM_REC

/* Bytes of the encoding of a geometry of n tensors (without the store record's 8). */
static inline uint64_t st_fmt_geometry_len(uint32_t n) { return ST_GEOM_FIXED + (uint64_t)ST_GEOM_REC * n; }
/* The fixed part and one tensor record, every byte written (names NUL-padded). */
void st_fmt_geometry_fixed_put(uint8_t dst[ST_GEOM_FIXED], const st_geometry *g);
void st_fmt_tensor_put(uint8_t dst[ST_GEOM_REC], const st_tensor_desc *t);
/* Decode and check len bytes; tensors go into *tensors (malloc'd, caller frees). ST_ECORRUPT with
 * a detail naming the tensor and field (no prefix: callers name where the bytes were). */
int st_fmt_geometry_decode(const uint8_t *p, uint64_t len, st_geometry *g, st_tensor_desc **tensors);

/* The store's geometry record: encode into a malloc'd buffer (after st_geometry_check); decode
 * into a geometry whose tensors array is malloc'd (*tensors, caller frees). Details start with
 * "geometry record". */
int st_geometry_encode(const st_geometry *g, uint8_t **out, size_t *out_len);
int st_geometry_decode(const void *buf, size_t len, st_geometry *g, st_tensor_desc **tensors);

/* ---- the walk over a file's sections -------------------------------------------------------------
 * The structural rules of docs/FORMAT.md, "Sections": GEOMETRY first, then ARCH (optional), TOKENS,
 * one KV per K/V tensor in geometry order, the checkpoints in order (index 0, 1, ...) and, last of
 * all and after at least one checkpoint, LOGITS when the geometry has n_vocab > 0. The reader
 * (st_file_read) and inspect (st_file_inspect, `statectl inspect`) both ask these functions. */
typedef struct st_fmt_walk {
    uint32_t n_sections;   /* as the header says (inspect: limited to what the file holds) */
    uint32_t n_arch;       /* 1 when section 1 is ARCH */
    uint32_t n_kv;         /* K/V tensors of g */
    const st_geometry *g;  /* the decoded geometry; NULL when none could be read */
    uint32_t ci;           /* checkpoints before the section asked about */
} st_fmt_walk;

/* The type and index the section at position s must have, given the type found there (ARCH is
 * expected at s == 1 only when found there; LOGITS in place of a checkpoint when found last).
 * Without a geometry the order past TOKENS cannot be known: the found type is returned with
 * *index = UINT32_MAX (any index). */
void st_fmt_expect(const st_fmt_walk *w, uint32_t s, uint32_t found, uint32_t *type, uint32_t *index);
/* Sections a file of geometry g needs at least (GEOMETRY, ARCH when present, TOKENS, its KVs, a
 * checkpoint). */
uint32_t st_fmt_min_sections(const st_geometry *g, uint32_t n_arch);
/* Payload bytes of a section whose length the header and geometry fix: TOKENS, KV[i] (a K/V
 * tensor), LOGITS; an uncompressed CHECKPOINT in codec (header included). Saturating. */
uint64_t st_fmt_tokens_len(uint64_t n_tokens);
uint64_t st_fmt_kv_len(const st_geometry *g, uint32_t i, uint64_t n_tokens);
uint64_t st_fmt_logits_len(const st_geometry *g);
uint64_t st_fmt_ckpt_stored_total(const st_geometry *g, uint32_t codec);

/* A checkpoint section's header. */
typedef struct st_fmt_ckpt {
    uint64_t position;
    uint32_t codec;   /* ST_CODEC_FP32 in a v1 file */
    uint32_t cflags;  /* 0 in a v1 file */
} st_fmt_ckpt;
/* Parse the ST_CKPT_HDR bytes b of checkpoint ci of a file of that version and check them:
 * reserved fields and flags, the codec, the position (<= n_tokens, after prev_pos when ci > 0).
 * *out is filled before any check. 0, ST_ECODEC (unknown codec) or ST_ECORRUPT, with a detail
 * that names the field (callers prefix the section). */
int st_fmt_ckpt_parse(const uint8_t b[ST_CKPT_HDR], uint32_t version, uint64_t n_tokens, uint32_t ci,
                      uint64_t prev_pos, st_fmt_ckpt *out);
/* The section header's reserved fields (bytes 16..23) are zero. */
static inline int st_fmt_sec_reserved_ok(const uint8_t b[ST_SEC_HDR_LEN])
{
    return st_get32(b + 16) == 0 && st_get32(b + 20) == 0;
}

#endif /* ST_FORMAT_INT_H */
