/*
 * st_store_int.h - statestore internals shared by st_image.c, st_file.c and white-box tests.
 * Nothing outside statestore/ and tests/statestore/ includes this header.
 */
#ifndef ST_STORE_INT_H
#define ST_STORE_INT_H

#include <stdint.h>
#include <sys/types.h>

#include "st_image.h"

/* Every byte size of a checked geometry (each tensor at n_ctx tokens, each checkpoint tensor in
 * the widest codec, their sum) stays at or below this, so sums of a few of them never overflow
 * and every size fits an off_t. */
#define ST_BYTES_MAX ((uint64_t)INT64_MAX / 8)

/* One checkpoint. All its running tensors live in one allocation, data: running tensor ti sits at
 * ckpt_off[codec * n_tensors + ti] and holds st_tensor_stored_bytes(desc, codec) bytes. One block
 * per checkpoint (not one per tensor) keeps the memory a file can make the reader allocate a small
 * multiple of the file's size, whatever the number of tensors. */
typedef struct st_ckpt {
    uint64_t position;
    uint32_t codec;
    uint8_t *data;
    struct st_image_block *shared; /* NULL: data is the image's own; else data is shared->data */
} st_ckpt;

/* Invariants of a complete image (the reader builds one step by step and frees it on error):
 * 1. g.tensors == tensors, a private copy that passed st_geometry_check.
 * 2. tokens holds n_tokens values (n_tokens <= n_ctx); kv[ti] holds n_tokens rows for every
 *    K/V tensor and is NULL for running ones; every buffer is allocated with at least 1 byte so a
 *    valid tensor never yields NULL.
 * 3. ckpt[0..n_ckpt) have strictly increasing positions <= n_ctx and known codecs; ckpt[c].data
 *    holds ckpt_bytes[codec] bytes (at least 1). The layout of a codec's block is fixed by the
 *    geometry: running tensors in geometry order, each at an offset aligned to its stored element
 *    size (1, 2, 4 or 8 bytes; malloc's alignment covers 8), padding bytes zero. A block with
 *    ckpt[c].shared set may be referenced by other holders and is never written in place (a
 *    mutable accessor replaces it with a private copy first).
 * 4. logits is NULL with n_logits 0, or holds n_vocab floats. */
struct st_image {
    st_geometry g;
    st_tensor_desc *tensors;
    uint64_t n_tokens;
    uint32_t *tokens;
    uint8_t **kv;
    uint32_t n_ckpt, cap_ckpt;
    st_ckpt *ckpt;
    uint64_t *ckpt_off;                  /* [ST_CODEC_COUNT * n_tensors] */
    uint64_t ckpt_bytes[ST_CODEC_COUNT]; /* block size of a checkpoint in each codec */
    float *logits;
    uint32_t n_logits;
    uint64_t state_hash;
    st_image_allocator alloc; /* hook for buffers >= 2 MiB (has_alloc set) */
    int has_alloc;
    st_image_gate gate; /* a fill still running (st_image_gate_set): readers wait through it */
};

/* Offset of running tensor ti in a checkpoint block of codec (a known codec). */
static inline uint64_t st_ckpt_offset(const st_image *img, uint32_t codec, uint32_t ti)
{
    return img->ckpt_off[(size_t)codec * img->g.n_tensors + ti];
}

/* Append a checkpoint whose data is NULL (the reader allocates and fills it after checking the
 * section's sizes). Same position rules as st_image_checkpoint_add. */
int st_image_ckpt_append_empty(st_image *img, uint64_t position, uint32_t codec, uint32_t *index);

/* An architecture name field: NUL-terminated within ST_ARCH_NAME_MAX, "" or bytes of
 * a-z 0-9 . _ - (padding is not checked: decoders check it, images make it zero);
 * ST_ECORRUPT with a detail starting with what. */
int st_arch_name_check(const char name[ST_ARCH_NAME_MAX], const char *what);

/* Saturating products: UINT64_MAX on overflow. */
uint64_t st_mul_sat(uint64_t a, uint64_t b);

#endif /* ST_STORE_INT_H */
