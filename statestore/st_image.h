/*
 * st_image.h - the state image (geometry, tensors, checkpoints, logits), the state hash, and
 * synthetic images for demos, tests and benchmarks.
 *
 * Ownership: an st_image owns every buffer it hands out; pointers returned by st_image_* stay
 * valid until the image is freed or the same object is replaced (st_image_tokens_set re-sizes the
 * K/V buffers, st_image_checkpoint_recode replaces that checkpoint's tensors). Images are plain
 * data: no engine is needed to build, query, read or write them. An image is not thread-safe;
 * distinct images may be used from distinct threads.
 *
 * Session files (st_file.h) and the LMDB store (st_store.h) read and write images.
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_IMAGE_H
#define ST_IMAGE_H

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
#define ST_ARCH_NAME_MAX 32 /* bytes including the terminating NUL */

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
    /* The model's architecture (general.architecture: "qwen35", "llama", ...), NUL-terminated,
     * zero-padded; "" when unknown (a state written before files and store records named it).
     * Not part of the fingerprint's comparison: st_geometry_compare refuses two names that
     * differ under one fingerprint (ST_ECORRUPT), and accepts an unknown one. */
    char arch[ST_ARCH_NAME_MAX];
} st_geometry;

const char *st_dtype_name(uint32_t dtype); /* "f32", ...; "unknown" */
size_t st_dtype_size(uint32_t dtype);      /* bytes per element; 0 for an unknown dtype */

/* Structural check of a geometry (names, enums, shapes, overflow of sizes, the architecture
 * name: "" or 1..31 bytes of a-z 0-9 . _ -, NUL-terminated); ST_EGEOMETRY with a detail naming the
 * tensor and field. */
int st_geometry_check(const st_geometry *g);
/* 0 if equal, else ST_EGEOMETRY (or ST_EMODEL for the fingerprint) with a detail naming the
 * first difference, e.g. "incompatible K/V geometry: page_size 1 vs 256". a is "expected".
 * With one fingerprint, two known architecture names that differ are ST_ECORRUPT (a name that
 * disagrees with its fingerprint); an unknown name ("") matches any. */
int st_geometry_compare(const st_geometry *a, const st_geometry *b);
/* The layer kinds of a geometry, from the engine's tensor names (docs/ENGINE.md, "Geometry"): one
 * letter per layer in order, D for a Gated DeltaNet layer (blk.N.ssm_state / conv_state), A for
 * an attention layer (blk.N.k / v / k_scale / v_scale), ? for a layer with both or neither, then
 * the counts: "DDDA (3 deltanet, 1 attention)"; "none" without blk.N tensors. Truncated to cap. */
void st_geometry_layer_kinds(const st_geometry *g, char *out, size_t cap);
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

/* An allocation hook for an image's large buffers (those of 2 MiB and more: K/V tensors,
 * checkpoint blocks), e.g. pinned host memory a device can DMA into. alloc(ctx, len) returns len
 * bytes (contents undefined) or NULL, and the image then maps that buffer itself as usual. The
 * image records per buffer who made it and frees each hook buffer exactly once with
 * free(ctx, p, len) (the same len), also from st_image_free, recode and tokens_set. The hook
 * (functions and ctx) must outlive every buffer it made; it may be called from any thread that
 * uses the image. Clones use the default allocation. */
typedef struct st_image_allocator {
    void *(*alloc)(void *ctx, size_t len);
    void (*free)(void *ctx, void *p, size_t len);
    void *ctx;
} st_image_allocator;
/* st_image_create with an allocation hook (a copied; NULL: same as st_image_create). */
int st_image_create_with(st_image **out, const st_geometry *g, const st_image_allocator *a);
/* Deep copy. */
int st_image_clone(st_image **out, const st_image *img);

/* The image's geometry; its tensors array is owned by the image. */
const st_geometry *st_image_geometry(const st_image *img);

/* Tokens. Setting them (n <= n_ctx) resizes every K/V tensor to n rows; rows [0, min(old, n))
 * keep their bytes, new rows are zero. */
int st_image_tokens_set(st_image *img, const uint32_t *tokens, uint64_t n);
/* The same, but K/V rows added beyond the old n_tokens are left undefined (not zeroed): for a
 * caller that writes every one of them next (the engine's PARK). */
int st_image_tokens_set_unzeroed(st_image *img, const uint32_t *tokens, uint64_t n);
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
/* The same, but the tensors' bytes are left undefined (only the padding between them is zeroed):
 * for a caller that writes every running tensor of the checkpoint next (the engine's PARK). */
int st_image_checkpoint_add_unzeroed(st_image *img, uint64_t position, uint32_t codec,
                                     uint32_t *index);
uint32_t st_image_n_checkpoints(const st_image *img);
int st_image_checkpoint_info(const st_image *img, uint32_t ci, uint64_t *position, uint32_t *codec);
/* Running tensor ti (role running) of checkpoint ci: st_tensor_stored_bytes(desc, codec) bytes,
 * aligned to its stored element size (the codec's for f32 tensors, the dtype's otherwise). */
void *st_image_checkpoint_tensor(st_image *img, uint32_t ci, uint32_t ti, uint64_t *len);
const void *st_image_checkpoint_tensor_const(const st_image *img, uint32_t ci, uint32_t ti,
                                             uint64_t *len);
/* Re-code checkpoint ci's f32 tensors to another codec (other dtypes unchanged), converting in
 * slices through the caller's scratch (see st_codec_convert). */
int st_image_checkpoint_recode(st_image *img, uint32_t ci, uint32_t codec, void *scratch,
                               size_t scratch_cap);
/* Remove checkpoint ci. */
int st_image_checkpoint_remove(st_image *img, uint32_t ci);
/* A checkpoint block shared by reference: the engine keeps a held conversation-cache
 * checkpoint's bf16 form as one and puts it into every later snapshot instead of coding the
 * checkpoint again. A shared block never changes: the mutable accessors of an image whose block
 * another holder references (st_image_checkpoint_tensor, _recode) give the image a private copy
 * first, so a pointer it returned is for writing only until the block is next shared (a
 * snapshot or restore may share a held checkpoint's block). References are atomic (any thread
 * may drop one); the last one frees the buffer.
 * share: a new reference to checkpoint ci's block (the image keeps its own), NULL when there is
 * no such checkpoint or no memory; the image is only marked shared, its bytes stay as they are.
 * add_shared: a checkpoint at position in codec whose block is b (the image takes a reference;
 * b must be a block of this geometry in that codec, else ST_EINVAL). */
typedef struct st_image_block st_image_block;
st_image_block *st_image_checkpoint_share(const st_image *img, uint32_t ci);
int st_image_checkpoint_add_shared(st_image *img, uint64_t position, uint32_t codec,
                                   st_image_block *b, uint32_t *index);
void st_image_block_unref(st_image_block *b); /* accepts NULL */

/* The layout of a checkpoint block in codec for geometry tensors[0..n): running tensors in
 * geometry order, each at an offset aligned to its stored element size (off[ti]; 0 for K/V
 * tensors); returns the block's bytes. Every image of that geometry lays its checkpoints out
 * so (st_image_checkpoint_block), and the engine its own running-state buffers, so that a
 * block moves between them without a copy (st_image_checkpoint_exchange). */
uint64_t st_checkpoint_layout(const st_tensor_desc *tensors, uint32_t n, uint32_t codec,
                              uint64_t *off);
/* Checkpoint ci's block (its running tensors at st_checkpoint_layout's offsets) and in *len its
 * bytes; NULL when there is no such checkpoint. */
const void *st_image_checkpoint_block(const st_image *img, uint32_t ci, uint64_t *len);
/* Give checkpoint ci of an image about to be freed the block *block, and take its own block
 * into *block: the caller now owns the bytes the image held there (and releases them with
 * st_image_buffer_free), the image holds the caller's. *block must be a buffer of at least
 * st_image_checkpoint_block's bytes that st_image_buffer_free can release (malloc'd, or taken
 * from an image this way). The image's state then no longer verifies: only free it (its tokens,
 * logits and geometry stay readable). ST_EINVAL with nothing changed when the block is shared
 * (st_image_checkpoint_share) or there is no such checkpoint. */
int st_image_checkpoint_exchange(st_image *img, uint32_t ci, void **block);
/* Whether checkpoint ci's block is the image's own (not shared): _exchange would take it. */
int st_image_checkpoint_exclusive(const st_image *img, uint32_t ci);
/* Release a buffer taken from an image (st_image_checkpoint_exchange) or malloc'd: through the
 * allocation hook that made it, unmapped, or free()d. Accepts NULL. */
void st_image_buffer_free(void *p);

/* An image whose K/V and checkpoint bytes are still arriving while it is read (a streamed store
 * get, st_store_get_stream): the gate's wait(ctx, p, len) returns 0 once bytes [p, p + len) of
 * one of the image's buffers hold their final, checked contents, or the fill's error for them
 * (with its detail); p NULL waits for every byte. The geometry, tokens, logits, checkpoint list
 * and state hash are complete from the start. A reader that takes the bytes in pieces (the CUDA
 * backend's restore) calls st_image_wait before each piece; any other reader waits for all
 * first. st_image_wait on an image without a gate returns 0 at once. The gate is set and
 * cleared by the one who fills the image (never while another thread reads it). */
typedef struct st_image_gate {
    int (*wait)(void *ctx, const void *p, uint64_t len);
    void *ctx;
} st_image_gate;
void st_image_gate_set(st_image *img, const st_image_gate *gate); /* NULL clears it */
int st_image_wait(const st_image *img, const void *p, uint64_t len);
int st_image_gated(const st_image *img); /* whether a gate is set */

/* Last-token logits: n_vocab floats, or none (n == 0). */
int st_image_logits_set(st_image *img, const float *logits, uint32_t n);
const float *st_image_logits(const st_image *img, uint32_t *n);

/* State hash recorded by the engine (0: none). Carried by files and the store unchanged. */
void st_image_state_hash_set(st_image *img, uint64_t h);
uint64_t st_image_state_hash(const st_image *img);

/* ---- the state hash ----------------------------------------------------------------------------
 * What the engine records in an image and checks on restore (docs/ENGINE.md, "State hash"): a
 * hash of the live conversation as a slot holds it after a restore. It is defined over segments,
 * in order:
 *   segment 0: the tokens (u32 LE each);
 *   segment 1 + ti, for each geometry tensor ti: a K/V tensor's rows [0, n_tokens) as stored; an
 *     f32 running tensor of the live (last) checkpoint as the fp32 values (LE) it holds once
 *     widened from the checkpoint's codec (exact); another running tensor as stored.
 * Each segment is cut into blocks of ST_STATE_HASH_BLOCK bytes (the last one shorter; an empty
 * segment has none). A block's digest is XXH3-64 (seed 0) of its bytes. The hash is XXH3-64 of
 * n_tokens (u64 LE), the number of digests (u64 LE) and the digests (u64 LE) in segment and block
 * order, 0 replaced by 1 (0 means "none"). The digests are independent, so any number of threads
 * may compute them in any order: the value never depends on who computes it. Re-coding the live
 * checkpoint changes the hash unless the codec is exact for its values; conversions recompute it
 * once the old one has been verified (st_image_recode), and the store refuses to keep an image
 * whose recorded hash (nonzero) is not its own (st_store_put). */
#define ST_STATE_HASH_BLOCK ((uint64_t)1 << 20)

typedef struct st_state_hash_seg {
    const void *data; /* the segment's bytes as held (may be NULL when bytes is 0) */
    uint64_t bytes;   /* bytes hashed: for a widened segment, 4 per element */
    int32_t widen;    /* -1 or ST_CODEC_FP32: data is hashed as it is; ST_CODEC_BF16 / _F16: data
                         holds bytes / 4 values in that codec, hashed widened to fp32 */
} st_state_hash_seg;

/* A runner calls task(arg, i) once for every i in [0, n), on any threads in any order, and
 * returns when all calls have returned. NULL runners mean: in order on the calling thread. */
typedef void (*st_state_hash_task)(void *arg, uint64_t i);
typedef void (*st_state_hash_runner)(void *run_arg, uint64_t n, st_state_hash_task task, void *arg);

/* Digests of a segment of that many hashed bytes. */
uint64_t st_state_hash_blocks(uint64_t bytes);
/* The digests of segs[0..n_segs) into digests (sum of st_state_hash_blocks(segs[i].bytes)
 * entries), block by block through run. ST_ECODEC for an unknown widen codec, ENOMEM. */
int st_state_hash_digests(const st_state_hash_seg *segs, uint32_t n_segs, uint64_t *digests,
                          st_state_hash_runner run, void *run_arg);
/* The hash from all digests of a conversation of n_tokens tokens. */
uint64_t st_state_hash_combine(uint64_t n_tokens, const uint64_t *digests, uint64_t n_digests);
/* The state hash of a complete image (st_image_check), from its tokens, K/V and last checkpoint:
 * what a restore of img must find in the slot. run may be NULL. */
int st_image_state_hash_compute(const st_image *img, st_state_hash_runner run, void *run_arg,
                                uint64_t *out);

/* Re-code every checkpoint of img to codec (f32 running tensors only; K/V, integer tensors,
 * tokens and logits are never touched), in slices through one scratch of ST_CODEC_SCRATCH_MAX
 * bytes, keeping the state hash true: when the live checkpoint changes codec and the recorded
 * hash (nonzero) verifies against img before, the hash of the re-coded image is recorded after.
 * A hash that does not verify is carried unchanged, so a conversion never makes unverifiable
 * state pass (the store then refuses it). run (may be NULL) computes the block digests, see
 * st_state_hash_runner; progress (optional) is called after each checkpoint. On failure the
 * checkpoints already re-coded stay re-coded and the recorded hash is unchanged. */
int st_image_recode(st_image *img, uint32_t codec, st_state_hash_runner run, void *run_arg,
                    void (*progress)(void *arg, uint32_t done, uint32_t total), void *progress_arg);

/* Structural invariants of a complete image: at least one checkpoint, positions strictly
 * increasing and <= n_tokens, the last at n_tokens, codecs known, logits empty or n_vocab. */
int st_image_check(const st_image *img);

/* Total bytes of payload (tokens, K/V, checkpoint tensors, logits). */
uint64_t st_image_bytes(const st_image *img);

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

#ifdef __cplusplus
}
#endif
#endif /* ST_IMAGE_H */
