/*
 * st_engine_int.h - engine internals shared by the files of engine/ and white-box tests.
 * Nothing outside engine/ and tests/engine/ includes this header.
 */
#ifndef ST_ENGINE_INT_H
#define ST_ENGINE_INT_H

#include <pthread.h>
#ifndef __cplusplus /* the CUDA backend (C++) includes this header; it uses no atomics */
#include <stdatomic.h>
#endif

#include "st_engine.h"

/* ---- model ------------------------------------------------------------------------------- */

/* A matrix of rows (outputs) x cols (inputs), row-major, ggml type: weights in the mapping, or
 * K rows of one head in a K/V page (stride: elements from one row to the next; 0: cols). */
#define ST_GGML_I8 24
typedef struct st_wmat {
    const void *data;
    uint32_t type; /* ST_GGML_F32 / F16 / BF16, and I8 for K/V pages */
    uint32_t rows, cols;
    uint32_t stride;
} st_wmat;

typedef struct st_layer {
    char kind; /* 'D' or 'A' */
    float *attn_norm, *ffn_norm; /* n_embd */
    float *q_norm, *k_norm;      /* qwen3: per-head RMSNorm weights (head_dim); else NULL */
    /* attention */
    st_wmat wq, wk, wv, wo;
    /* Gated DeltaNet */
    st_wmat sq, sk, sv, sgate, sout, salpha, sbeta;
    float *conv_w;   /* [channels][ssm_conv] */
    float *conv_wT;  /* the same transposed, [ssm_conv][channels] (derived at load) */
    float *a_log;    /* [ssm_heads] */
    float *ssm_a;    /* -exp(a_log), the decay rate's factor (derived at load) */
    float *dt_bias;  /* [ssm_heads] */
    float *ssm_norm; /* [ssm_dv] */
    /* feed-forward */
    st_wmat ffn_gate, ffn_up, ffn_down;
    /* the Qwen hybrids (ARCHITECTURES.md §2.2): the fused DeltaNet projection [q; k; v]
     * (attn_qkv), qwen3next's fused [beta | alpha] per key head (ssm_ba) and its legacy fused
     * [q, k, v, z] per key head (ssm_in) */
    st_wmat sqkv, sba, sin;
    /* MoE feed-forward (qwen3next, qwen35moe): the router, the stacked experts (expert e's rows
     * e Fe .. e Fe + Fe - 1; down: e E ..), the shared expert and its gate (one row) */
    st_wmat moe_router, moe_gate, moe_up, moe_down;
    st_wmat sh_gate, sh_up, sh_down, sh_router;
} st_layer;

/* ---- the memory spec ------------------------------------------------------------------------
 * What each layer keeps from token to token, as its architecture says (st_arch.memory): K/V
 * rows per token (an attention layer: cut at any position) or a recurrent state (a DeltaNet
 * layer: a matrix and a convolution history, only at checkpoints). The memory modules and the
 * published geometry (st_state_layout) are built from it alone. */
typedef enum st_mem_kind {
    ST_MEM_KV = 1,   /* K and V rows of kv_heads x head_dim per token */
    ST_MEM_REC = 2,  /* ssm [ssm_heads][ssm_dk][ssm_dv] and conv [conv_len][conv_ch], f32 */
} st_mem_kind;

typedef struct st_mem_layer {
    uint32_t kind; /* st_mem_kind */
    uint32_t slot; /* index among the layers of its kind */
    uint32_t kv_heads, head_dim;
    uint32_t ssm_heads, ssm_dk, ssm_dv, conv_len, conv_ch;
} st_mem_layer;

typedef struct st_mem_spec {
    uint32_t n_layer, n_kv, n_rec;
    st_mem_layer *layer; /* n_layer entries */
} st_mem_spec;

/* Bytes of one K (or V) row of a K/V layer in dtype (f16 or i8), of its scale row (i8 only). */
uint64_t st_mem_kv_row_bytes(const st_mem_layer *ml, uint32_t kv_dtype);
uint64_t st_mem_kv_scale_bytes(const st_mem_layer *ml, uint32_t kv_dtype);
/* Bytes of a recurrent layer's matrix and of its convolution history. */
uint64_t st_mem_ssm_bytes(const st_mem_layer *ml);
uint64_t st_mem_conv_bytes(const st_mem_layer *ml);

/* ---- memory modules (st_mem_kv.c, st_mem_rec.c) -------------------------------------------
 * The host memory of a slot, in the shapes of a memory spec: they own the buffers, and the
 * geometry (st_state_layout) describes exactly them.
 *
 * Paged K/V: per K/V layer, K and V in pages of page_size rows (kv_heads x head_dim, f16 or
 * i8) and for i8 pages of f32 scales per row and head. A page exists once a row in it was
 * reserved or written; rows at or beyond the slot's position are never read. */
typedef struct st_kv_view { /* one K/V layer's pages */
    uint8_t **k, **v;       /* page p holds rows [p * page_size, (p + 1) * page_size) */
    uint8_t **ks, **vs;     /* i8: the scale pages; else NULL */
    uint32_t page_size, dtype, kv_heads, head_dim;
    uint64_t row, srow;     /* bytes of a K (or V) row, of a scale row */
    /* The CUDA backend (k, v, ks, vs NULL): page p is one device block for every K/V layer,
     * blocks (a device array) its table, this layer's K rows at blocks[p] + off_k, V at off_v,
     * the i8 scale rows at off_ks, off_vs (engine/st_backend_cuda.cu invariant 2). */
    uint8_t *const *blocks;
    uint64_t off_k, off_v, off_ks, off_vs;
} st_kv_view;

typedef struct st_kvmem st_kvmem;
int st_kvmem_new(const st_mem_spec *ms, uint32_t n_ctx, uint32_t page_size, uint32_t kv_dtype,
                 st_kvmem **out);
void st_kvmem_free(st_kvmem *kv); /* accepts NULL */
/* Make the pages of rows [r0, r1) of every K/V layer exist (ENOMEM leaves those made so far,
 * which hold no row yet). */
int st_kvmem_reserve(st_kvmem *kv, uint64_t r0, uint64_t r1);
void st_kvmem_view(const st_kvmem *kv, uint32_t slot, st_kv_view *v);
/* Rows [row0, row0 + nrows) of one K/V tensor (what: ST_SW_K, _V, _KS, _VS) of K/V layer slot,
 * to or from buf; a read of a page never written is ST_EINVAL. */
int st_kvmem_io(st_kvmem *kv, uint32_t slot, uint32_t what, uint64_t row0, uint64_t nrows,
                void *buf, int write);
/* Bytes [off, off + len) of a K/V tensor (its rows laid end to end) to buf (write 0) or from buf
 * (write 1); cs (not NULL): also the bytes as they now stand at the destination, in order. Every
 * page touched must exist (st_kvmem_reserve). No error detail is set: ST_EINVAL for another kind,
 * a range beyond n_ctx or a missing page (callers check before, on threads of the pool). */
int st_kvmem_copy(st_kvmem *kv, uint32_t slot, uint32_t what, uint64_t off, uint64_t len,
                  void *buf, int write, st_checksum_state *cs);

/* Recurrent state: per recurrent layer its matrix and its convolution history (f32). */
typedef struct st_recmem st_recmem;
/* One block: per recurrent slot, in layer order, its matrix then its convolution history (f32),
 * then 8 bytes for the position the module does not use: the fp32 checkpoint layout of the
 * published geometry (st_state_layout), so that an image's block can be taken as it is. */
int st_recmem_new(const st_mem_spec *ms, st_recmem **out);
/* The block and its bytes; exchange: the module takes *blk (of at least those bytes, released
 * with st_image_buffer_free) and gives its own in *blk. */
uint8_t *st_recmem_block(const st_recmem *r, uint64_t *len);
void st_recmem_exchange(st_recmem *r, uint8_t **blk);
void st_recmem_free(st_recmem *r); /* accepts NULL */
void st_recmem_reset(st_recmem *r); /* zero */
float *st_recmem_ssm(const st_recmem *r, uint32_t slot);
float *st_recmem_conv(const st_recmem *r, uint32_t slot);
/* One tensor (what: ST_SW_SSM or ST_SW_CONV) of recurrent layer slot, exactly len bytes, to or
 * from buf (ST_EINVAL otherwise). */
int st_recmem_io(st_recmem *r, uint32_t slot, uint32_t what, void *buf, uint64_t len, int write);

struct st_arch;

struct st_model {
    st_model_hparams hp;
    const struct st_arch *arch;
    st_mem_spec mem;
    st_gguf *gguf;
    st_wmat tok_embd; /* rows = n_vocab, cols = n_embd */
    st_wmat output;   /* rows = n_vocab, cols = n_embd */
    float *output_norm;
    float *rope_freqs; /* llama: head_dim / 2 factors dividing the RoPE angles; else NULL */
    st_layer *layers;
    st_vocab *vocab; /* the GGUF's BPE vocabulary; NULL: strata-hybrid's byte tokenizer */
    uint8_t fp[ST_FINGERPRINT_LEN];
};

/* ---- kernels (st_kernels.c) -------------------------------------------------------------
 * Every reduction has one fixed order, the same in the vector and the scalar code:
 * a dot product of length K keeps 8 lanes, lane l accumulating elements k = 8j + l with a fused
 * multiply-add in increasing j; the lanes are summed as ((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7));
 * the K mod 8 tail elements are then added in order, each with a fused multiply-add. */
typedef struct st_kern {
    int vec;  /* 1: AVX2+FMA+F16C */
    int qdot; /* 1: quantized weights with an integer path use it (st_wtype.h, st_qdot_get) */
    int v512; /* 1 (with vec): the integer path's AVX-512 VNNI form (st_qdot.mm[2]) */
} st_kern;

int st_kern_cpu_has_avx2(void);
int st_kern_cpu_has_avx512vnni(void);
float st_kern_dot(const st_kern *k, const float *a, const float *b, uint32_t n);
/* Y[t*ldy + r] = dot(W row r, X[t*ldx ...]) for r in [r0, r1), t in [t0, t1). */
void st_kern_matmul(const st_kern *k, const st_wmat *w, const float *x, uint32_t ldx, float *y,
                    uint32_t ldy, uint32_t r0, uint32_t r1, uint32_t t0, uint32_t t1);
/* Bytes from one row of W to the next. */
size_t st_wmat_row_bytes(const st_wmat *w);
/* Row r of W widened to f32 (exact). */
void st_kern_row_f32(const st_wmat *w, uint32_t r, float *dst);
/* Attention's weighted sum of values for nq (1..4) queries over value rows j in [j0, j1):
 * for each query i and element d, in increasing j:
 *   out[i*ldo + d] = fma(w, V[j][d], out[i*ldo + d]),  w = p[i*ldp + j] (f16 values) or
 *   w = p[i*ldp + j] * vscale[(j - j0) * sstride] (i8 values).
 * v points at row j0 (type ST_GGML_F32, ST_GGML_F16 or ST_GGML_I8), vstride elements apart. */
void st_kern_pv(const st_kern *k, float *out, uint32_t ldo, const float *p, uint32_t ldp,
                uint32_t nq, const void *v, uint32_t type, uint32_t vstride,
                const float *vscale, uint32_t sstride, uint32_t j0, uint32_t j1, uint32_t hd);
/* The Gated-DeltaNet recurrence of one head over T tokens: M [dk][dv] row-major, rows ldm apart
 * (M is S transposed; a block of dv columns may be done alone); token t's q, k, v at q + t*xs,
 * kk + t*xs, v + t*xs; alpha, beta at t*as; its output at out + t*os. u: 2*dv floats. */
void st_kern_delta_scan(const st_kern *k, float *M, size_t ldm, uint32_t dk, uint32_t dv, uint32_t T,
                        const float *q, const float *kk, const float *v, size_t xs,
                        const float *alpha, const float *beta, size_t as, float *out, size_t os,
                        float *u);
/* The DeltaNet causal convolution (kernel 4) of channels [c0, c1) over T tokens, before SiLU;
 * st: the last three inputs ([3][C], oldest first), updated; wT: weights transposed, [4][C]. */
void st_kern_conv(const st_kern *k, const float *x, size_t ldx, float *y, size_t ldy, float *st,
                  uint32_t C, const float *wT, uint32_t c0, uint32_t c1, uint32_t T);
float st_f16_to_f32(uint16_t h);
float st_bf16_to_f32(uint16_t h);

/* ---- memory (st_mem.c) ---------------------------------------------------------------------
 * Zeroed; large sizes backed by transparent huge pages where the kernel allows. Release with
 * free(). */
void *st_big_alloc(size_t n);
/* The process-wide image buffer cache (st_mem.c): an allocation hook for images whose freed large
 * buffers are kept, up to a ceiling, for the next image of the same length. reserve raises the
 * ceiling to bytes (never lowers it); held: the bytes kept now. */
const st_image_allocator *st_image_cache_hook(void);
void st_image_cache_reserve(size_t bytes);
size_t st_image_cache_held(void);

/* ---- thread pool (st_pool.c) --------------------------------------------------------------- */
typedef struct st_pool st_pool;
typedef void (*st_task_fn)(void *ctx, uint32_t task, uint32_t thread);
int st_pool_new(uint32_t n_threads, st_pool **out);
void st_pool_free(st_pool *p);
uint32_t st_pool_size(const st_pool *p);
/* Run fn(ctx, i, thread) for every i in [0, n_tasks) across the pool and wait. work is an
 * estimate of the arithmetic in the whole run: below ST_POOL_MIN_WORK the caller runs every task
 * itself, since waking other threads would cost more than it saves (results are the same). */
#define ST_POOL_MIN_WORK 262144u
void st_pool_run(st_pool *p, uint32_t n_tasks, st_task_fn fn, void *ctx, uint64_t work);

/* ---- the published state layout -------------------------------------------------------------
 * Every backend publishes the same geometry tensors, in the same order, so that a state saved by
 * one restores on another. st_state_layout is the one place that says what they are. */
typedef enum st_state_what {
    ST_SW_SSM,  /* blk.N.ssm_state f32 [heads, dk, dv] */
    ST_SW_CONV, /* blk.N.conv_state f32 [conv - 1, channels] */
    ST_SW_POS,  /* pos i64 [1] */
    ST_SW_K,    /* blk.N.k kv_dtype [n_ctx, kv_heads, head_dim] */
    ST_SW_V,    /* blk.N.v */
    ST_SW_KS,   /* blk.N.k_scale f32 [n_ctx, kv_heads] (int8 K/V only) */
    ST_SW_VS,   /* blk.N.v_scale */
} st_state_what;

typedef struct st_state_map {
    uint32_t layer; /* model layer */
    uint32_t slot;  /* index among the DeltaNet or among the attention layers */
    uint32_t what;  /* st_state_what */
} st_state_map;

/* Room st_state_layout needs in descs and map for a model of n_layer layers. */
#define ST_STATE_LAYOUT_MAX(n_layer) (4u * (n_layer) + 1u)
/* Fill descs/map (ST_STATE_LAYOUT_MAX entries each) from the memory spec: per recurrent layer its
 * ssm and conv state, per K/V layer its k, v (and i8 scales), in layer order, then pos. Returns
 * the tensor count. */
uint32_t st_state_layout(const st_mem_spec *ms, uint32_t n_ctx, uint32_t kv_dtype,
                         st_tensor_desc *descs, st_state_map *map);

/* ---- backends ------------------------------------------------------------------------------
 * A backend owns the buffers of a slot's state (running tensors and the K/V arena) and publishes
 * them as geometry tensors. Everything outside the backend reaches them only through these
 * functions, by geometry tensor index. */
typedef struct st_backend {
    const char *name;
    int (*create)(st_engine *e, void **bctx);
    void (*destroy)(void *bctx);
    /* The tensors this backend publishes (owned by the backend context). */
    int (*tensors)(void *bctx, const st_tensor_desc **descs, uint32_t *n);
    int (*state_new)(void *bctx, void **st);
    void (*state_free)(void *bctx, void *st);
    /* Zero running state, position 0 (K/V rows are not cleared: rows >= position are unused). */
    void (*state_reset)(void *bctx, void *st);
    /* Read tokens at positions pos0.. (pos0 must be the state's position); logits of the last
     * token into logits when not NULL. */
    int (*forward)(void *bctx, void *st, const uint32_t *tokens, uint32_t n, uint64_t pos0,
                   float *logits);
    int (*running_read)(void *bctx, void *st, uint32_t ti, void *dst, uint64_t len);
    int (*running_write)(void *bctx, void *st, uint32_t ti, const void *src, uint64_t len);
    int (*kv_read)(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows, void *dst);
    int (*kv_write)(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows,
                    const void *src);
    /* Optional bulk transfers (NULL: the slot code uses the per-tensor functions above). The
     * whole live state in one pass: the CUDA backend's pipelined through pinned buffers, the CPU
     * backend's in state-hash blocks on the engine's pool, each digested at its destination. The slot code combines the state hash from the digests these return
     * and the tokens' (after a save, before a load's swap). Only used with checkpoint codecs
     * fp32 and bf16.
     * save: the live state into img: K/V rows [0, n) into its K/V buffers (n is its n_tokens)
     *       and the running tensors into checkpoint ci, in that checkpoint's codec.
     * load: K/V rows [0, n) and checkpoint ci of img into st (new and reset, or a state that
     *       held another conversation: load writes every running tensor, the position and the
     *       rows, which is all a state is read for); the position tensor must hold the
     *       checkpoint's position (ST_ECORRUPT otherwise).
     * digests (not NULL): also the state hash's block digests of segments 1.. (the geometry
     *       tensors, st_image.h): of the state as saved (bf16 as a restore widens it), or of
     *       the state as loaded into st; the CUDA backend computes them on the device. */
    int (*save)(void *bctx, void *st, st_image *img, uint32_t ci, uint64_t n, uint64_t *digests);
    int (*load)(void *bctx, void *st, const st_image *img, uint32_t ci, uint64_t n,
                uint64_t *digests);
    /* Optional (NULL, or returning NULL: ordinary memory): the allocation hook for the large
     * buffers of an image that save fills (PARK and SAVE snapshots, st_image_create_with), e.g.
     * pinned host memory that save and load move without staging. The hook must stay valid for
     * the life of the process. */
    const st_image_allocator *(*image_allocator)(void *bctx);
    /* Optional (NULL: restores copy through load): a state whose running tensors live in one
     * host block in the fp32 checkpoint layout of the geometry (st_checkpoint_layout) can take
     * an image's fp32 checkpoint block as it is.
     * load_adopt: load, except that when checkpoint ci is fp32 and its block the image's own
     *       with the state's layout (*adopt set to 1), its running tensors are not copied: their
     *       digests are those of the image's bytes, and adopt makes them the state's once the
     *       caller has verified the hash. Otherwise (*adopt 0) exactly load.
     * adopt: after a load_adopt that set *adopt, exchange the state's running block with
     *       checkpoint ci's (st_image_checkpoint_exchange): st holds the image's bytes, the image
     *       the state's old ones. Cannot fail. */
    int (*load_adopt)(void *bctx, void *st, const st_image *img, uint32_t ci, uint64_t n,
                      uint64_t *digests, int *adopt);
    void (*adopt)(void *bctx, void *st, st_image *img, uint32_t ci);
    /* Optional (NULL: every field 0): the weight-conversion cache's figures; invalidate
     * (after the stream is idle) drops its entries. */
    void (*wcache_get)(void *bctx, st_engine_wcache *out);
    int (*wcache_invalidate)(void *bctx);
    /* Optional (NULL: every field 0): the routed-expert cache's figures (any thread). */
    void (*xcache_get)(void *bctx, st_engine_xcache *out);
    /* 1: load waits (st_image_wait) for each piece of the image before it reads it, so a
     * restore may start while a gated image (a streamed store get) is still arriving; 0: the
     * restore waits for the whole image first. */
    int load_waits;
} st_backend;

extern const st_backend st_backend_cpu;
/* The CUDA backend (st_backend_cuda.cu); in a build without CUDA its create refuses with
 * ST_EINVAL "built without CUDA" (st_backend_nocuda.c). */
extern const st_backend st_backend_cuda;

/* ---- the BF16 -> FP16 weight-conversion cache, host half (st_wcache.c) ---------------------- */
#define ST_WCACHE_MIB_DEFAULT 256u
#define ST_WCACHE_ALIGN 256u
typedef struct st_wcache_cfg {
    int mode;     /* STRATA_BF16_TC: 0 native, 1 FP16 where BF16 is not native, 2 FP16 on any card */
    int cache;    /* STRATA_BF16_TC_CACHE is exactly "1" and the size valid */
    uint32_t mib; /* STRATA_BF16_TC_CACHE_MIB (default 256) */
} st_wcache_cfg;
/* Parse the three values (NULL: unset). diag (may be NULL) gets what was refused, "" if
 * nothing: each refused value disables what it configures (st_wcache.c invariant 1). */
void st_wcache_parse(const char *tc, const char *cache, const char *mib, st_wcache_cfg *cfg,
                     char *diag, size_t diag_cap);
void st_wcache_from_env(st_wcache_cfg *cfg, char *diag, size_t diag_cap);

typedef struct st_wcache_entry {
    const void *src;
    uint32_t rows, cols;
    uint64_t off, bytes;
} st_wcache_entry;
/* One owner's arena: which weight's conversion is at which offset (st_wcache.c). */
typedef struct st_wcache {
    uint64_t cap, used;
    st_wcache_entry *ent;
    uint32_t n, n_cap;
    uint64_t hits, misses, bypassed, invalidations, admitted_bytes;
} st_wcache;
enum { ST_WCACHE_HIT = 0, ST_WCACHE_ADMIT = 1, ST_WCACHE_BYPASS = 2 };
void st_wcache_init(st_wcache *a, uint64_t cap);
void st_wcache_release(st_wcache *a);
/* HIT: *off holds its conversion. ADMIT: a new entry at *off, which the caller must now fill
 * (or take back with st_wcache_drop_last). BYPASS: convert per call; nothing resident moves. */
int st_wcache_lookup(st_wcache *a, const void *src, uint32_t rows, uint32_t cols,
                     uint64_t bytes, uint64_t *off);
void st_wcache_drop_last(st_wcache *a);
void st_wcache_invalidate(st_wcache *a);
/* Test access to the CUDA backend's FP16 path: y [T][rows] = W x for the bf16 W [rows][cols] at
 * device address w_dev and x [T][cols] (rounded to bf16 as activations are); immutable: W may be
 * looked up in the arena. rows, cols <= n_embd, T <= ubatch. ST_EINVAL on another backend, with
 * the path off, or in a build without CUDA. */
int st_cuda_gemm_probe(st_engine *e, const void *w_dev, uint32_t rows, uint32_t cols, int immutable,
                       const float *x, uint32_t T, float *y);

/* Matrix-vector products on the GPU, dequantized in registers (st_qmv_cuda.cu; the CUDA
 * operation table's one-token products): y [rows] = W x for W [rows][cols] of ggml type wtype
 * in its file layout at device address w (16-byte aligned), x [cols] (16-byte aligned) and y f32
 * device arrays, queued on stream (a cudaStream_t; NULL: the default stream). Every type of
 * st_cuda_dequant_supported has a kernel. st_cuda_qmv_n computes n (1..ST_CUDA_QMV_JOBS)
 * products of one type and column count over the same x in one launch, each row's bits the same
 * as alone. ST_EINVAL for a type without a kernel, columns not a multiple of its block, a NULL
 * or misaligned operand, or a build without CUDA. */
#define ST_CUDA_QMV_JOBS 32

/* The shapes the CUDA backend's kernels take, in one place: st_engine_cuda_check refuses a file
 * beyond them before an engine is made, and the backend (st_backend_cuda.cu, st_ops_cuda.cu)
 * checks them again. */
#define ST_CUDA_MAX_HEAD_DIM 256      /* attention: at most 8 elements per lane */
#define ST_CUDA_MAX_SSM_DV 1024       /* the delta rule: a thread per value column */
#define ST_CUDA_HYBRID_MAX_SSM_DK 512 /* strata-hybrid's own pass: 16 key elements per lane */
#define ST_CUDA_CONV_KERNEL 4         /* the short convolution (3 columns of history) */
typedef struct st_cuda_qmv_job {
    const void *w;
    float *y;
    uint32_t rows;
} st_cuda_qmv_job;
/* Programmatic dependent launch of the operation table's kernels (st_launch_cuda.cuh): on when
 * st_cuda_pdl_flag is 1. st_cuda_pdl_configure sets it for the process from the current device
 * (compute capability 9 or later) and STRATA_CUDA_PDL ("0": off, unset or anything else: on
 * where the device has it), and returns it; each operation context calls it when it is made.
 * 0 until then. */
extern int st_cuda_pdl_flag;
int st_cuda_pdl_configure(void);
int st_cuda_qmv_supported(uint32_t wtype);
int st_cuda_qmv(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols, const float *x, float *y,
                void *stream);
int st_cuda_qmv_n(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs, uint32_t n,
                  const float *x, void *stream);
/* One token's gate and up products and their swiglu in one launch (st_qmv_cuda.cu invariant 6):
 * y [rows] = silu(G x) * (U x) for G and U [rows][cols] of type wtype (Q8_0, Q4_K or Q6_K:
 * st_cuda_qmv_swiglu_supported), operands as st_cuda_qmv; the bits of st_cuda_qmv_n on both
 * followed by the operation table's swiglu. */
int st_cuda_qmv_swiglu_supported(uint32_t wtype);
uint64_t st_cuda_qmv_swiglu_runs(void); /* the process's paired launches so far (tests) */
int st_cuda_qmv_swiglu(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                       const void *up, const float *x, float *y, void *stream);
/* The integer form for Q8_0 weights: xq is the activation row as the CPU's integer path
 * quantizes it (st_qdot_get(ST_GGML_Q8_0)->quantize: 36-byte blocks), in device memory, 4-byte
 * aligned; y as st_cuda_qmv. ST_EINVAL for another type or without CUDA. */
int st_cuda_qmv_i8(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols, const void *xq, float *y,
                   void *stream);
/* The integer form of Q4_K (also through st_cuda_qmv_i8), as the forward pass runs it with
 * STRATA_CUDA_QMV_I8=1 (st_qmv_cuda.cu invariant 7): st_cuda_quant_q8_k writes cols values of x
 * (16-byte aligned) as the CPU's integer path quantizes them (st_qdot_get(ST_GGML_Q4_K)->quantize,
 * byte for byte: 292-byte Q8_K blocks) to xq (cols / 256 * 292 bytes, 4-byte aligned);
 * st_cuda_qmv_n_i8 and st_cuda_qmv_swiglu_i8 are st_cuda_qmv_n and st_cuda_qmv_swiglu over
 * those activations. ST_EINVAL for another type, bad operands, or without CUDA. */
int st_cuda_quant_q8_k(const float *x, uint32_t cols, void *xq, void *stream);
int st_cuda_qmv_n_i8(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs, uint32_t n,
                     const void *xq, void *stream);
int st_cuda_qmv_swiglu_i8(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                          const void *up, const void *xq, float *y, void *stream);

/* Rows of a weight matrix widened to f32 on the GPU (st_dequant_cuda.cu), exactly the values
 * the CPU's scalar dequantization gives (st_wtype_get(type)->dequant[0]; F32 copied, F16 and
 * BF16 widened): dst[i * ldd + c] = W[row_i][c] for i < n and c < cols, row_i = rows[i] (rows a
 * device array) or r0 + i (rows NULL). W of ggml type `type`, row_bytes per row, at device
 * address w (any alignment: it is read by bytes); dst a device array; queued on stream (a cudaStream_t; NULL: the
 * default stream). ST_EINVAL for a type without a kernel (st_cuda_dequant_supported: every
 * type of st_wtype_table), cols not a multiple of its block, or a build without CUDA. */
int st_cuda_dequant_supported(uint32_t type);
int st_cuda_dequant_rows(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                         const uint32_t *rows, uint32_t r0, uint32_t n, float *dst, uint64_t ldd,
                         void *stream);
/* The same rows rounded to f16 (to nearest even; a value beyond the f16 range becomes an
 * infinity): dst a device array of __half, ldd in elements. For the tensor-core products of
 * several tokens (st_ops_cuda.cu invariant 2). */
int st_cuda_dequant_rows_h(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                           const uint32_t *rows, uint32_t r0, uint32_t n, void *dst, uint64_t ldd,
                           void *stream);

/* ---- the routed-expert cache, host half (st_xcache.c; the device half: st_xcache_cuda.cu) --
 * A bounded arena of n_slots whole expert records (gate, up and down of one layer's expert,
 * record_bytes), logical keys layer * n_experts + expert, least recently used out. */
typedef struct st_xcache {
    uint32_t n_layers, n_experts, n_slots;
    uint64_t record_bytes;
    int32_t *slot;  /* [n_layers * n_experts]: the key's slot, -1: none */
    uint32_t *key;  /* [n_slots]: the slot's key, UINT32_MAX: empty */
    uint64_t *used; /* [n_slots]: the call that last used it (0: never) */
    uint64_t call;  /* calls of st_xcache_map so far */
    uint64_t hits, misses, evictions, bytes_uploaded;
} st_xcache;
/* ST_EINVAL when arena_bytes hold fewer than k records (the caller streams), or a bad shape;
 * ENOMEM. */
int st_xcache_init(st_xcache *c, uint32_t n_layers, uint32_t n_experts, uint64_t record_bytes,
                   uint64_t arena_bytes, uint32_t k);
void st_xcache_release(st_xcache *c);
/* One call of layer `layer` on the n distinct experts of its selection: slots[i] is expert i's
 * slot, load[i] 1 where its record must be uploaded before use (st_xcache.c invariant 3).
 * ST_ETOOBIG (nothing changed) when n > n_slots; ST_EINVAL for a bad id or a repeat. */
int st_xcache_map(st_xcache *c, uint32_t layer, const uint32_t *experts, uint32_t n,
                  uint32_t *slots, uint8_t *load);
/* Empty a slot whose upload failed. */
void st_xcache_drop(st_xcache *c, uint32_t slot);

/* ---- the routed-expert cache, device half (st_xcache_cuda.cu; CUDA builds only) ------------
 * m: the host model (its moe_gate / moe_up / moe_down in host memory); stream: the backend's
 * compute stream; pool: the threads of the host copies into the pinned staging. *out NULL with 0 when arena_bytes is 0 or the model has no experts. An arena
 * that cannot be had leaves the streaming path (a diagnostic, not an error). */
typedef struct st_xdev st_xdev;
int st_xdev_new(const st_model *m, uint64_t arena_bytes, void *stream, st_pool *pool,
                st_xdev **out);
void st_xdev_free(st_xdev *x); /* waits for both streams; accepts NULL */
/* st_fwd experts: the n experts of one token in layer il as views into device memory, their
 * uploads queued before the products the caller queues next on the compute stream. */
int st_xdev_experts(st_xdev *x, uint32_t il, const uint32_t *experts, uint32_t n,
                    st_wmat *views);
int st_xdev_error(st_xdev *x);                       /* the pass's sticky failure, cleared */
void st_xdev_stats(st_xdev *x, st_engine_xcache *out); /* any thread */
uint64_t st_xdev_device_bytes(const st_xdev *x);     /* the arena and the compact buffer */

struct st_engine {
    const st_model *m;
    st_engine_opts o;
    const st_backend *be;
    void *bctx;
    st_kern kern;
    st_pool *pool;
    pthread_mutex_t lock; /* one slot computes at a time */
    st_geometry geom;     /* tensors point into the backend's list */
    /* The state hash's staging buffer (st_slot.c), kept between calls so that hashing a state
     * does not fault in fresh memory each time; used under lock. */
    uint8_t *hstage;
    uint64_t hstage_cap;
    /* The spares (st_slot.c, used under lock): the backend state and the checkpoints a restore
     * replaced, kept for the next restore (and checkpoint) to write into, so that it writes
     * mapped memory instead of faulting in and zeroing fresh pages. At most one backend state
     * and prompt_cache checkpoints: one slot's memory. */
    void *spare_st;
    uint8_t **spare_ck; /* [prompt_cache]: checkpoint blocks (ck_off's layout) */
    uint32_t n_spare_ck;
    /* A checkpoint's host block: the fp32 checkpoint layout of the geometry
     * (st_checkpoint_layout), the layout of an image's fp32 checkpoint, so that a restore can
     * take an image's block as it is (st_slot_restore_adopt). */
    uint64_t *ck_off; /* [n_tensors] */
    uint64_t ck_bytes;
};

/* A conversation-cache checkpoint: host copies of every running tensor in one block (fp32,
 * running tensor ti at e->ck_off[ti]; released with st_image_buffer_free, as it may have been an
 * image's), and once a snapshot has stored it in bf16 (or it was restored from a bf16 image),
 * that block, shared with the images that hold it (st_slot.c invariant 7). */
typedef struct st_slot_ckpt {
    st_cache_entry e;
    uint8_t *blk; /* NULL: none */
    st_image_block *bf16;
} st_slot_ckpt;

struct st_slot {
    st_engine *e;
    void *st;          /* backend state */
    uint32_t *tokens;  /* n_ctx capacity */
    uint64_t n_tokens;
    float *logits;     /* n_vocab */
    int has_logits;
    st_slot_ckpt *ck;  /* ordered by position */
    uint32_t n_ck;
    uint64_t tick;
    st_cancel_fn cancel; /* st_slot_set_cancel */
    void *cancel_arg;
};

/* Free the engine's spares (st_engine_free, before the backend goes). */
void st_slot_spares_free(st_engine *e);

/* Running-state bytes of geometry tensor ti (0 for K/V). */
uint64_t st_engine_running_bytes(const st_engine *e, uint32_t ti);

#endif /* ST_ENGINE_INT_H */
