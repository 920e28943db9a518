/*
 * st_arch_int.h - what an architecture is to the engine: a descriptor (st_arch) that reads its
 * hyperparameters, lists its tensors, says what memory each layer keeps, feeds the fingerprint,
 * writes its seeded model and runs its forward pass on the shared layer helpers below, which
 * compute through a backend's operations (st_ops_int.h).
 * One file per architecture under engine/arch/; st_model.c walks the descriptor and knows no
 * architecture. Nothing outside engine/ and tests/engine/ includes this header.
 */
#ifndef ST_ARCH_INT_H
#define ST_ARCH_INT_H

#include <stddef.h>
#include <stdint.h>

#include "st_engine_int.h"
#include "st_ops_int.h"

/* ---- the tensor list ----------------------------------------------------------------------
 * One entry per GGUF tensor, in file order. The loader checks name, type and shape, then binds
 * the data to the field at `field` of the st_layer of `layer` (or of the st_model when layer is
 * -1): a matrix (st_wmat, in the mapping) or a vector (an owned f32 copy, float *). */
typedef enum st_tinit {
    ST_TI_EMB,     /* uniform [-1, 1) */
    ST_TI_ONES,    /* 1 */
    ST_TI_MAT,     /* uniform, scaled by sqrt(3 / fan-in) */
    ST_TI_MAT_OUT, /* as ST_TI_MAT, also by 1 / sqrt(2 n_layer): a residual branch's output */
    ST_TI_CONV,    /* uniform [-0.5, 0.5) */
    ST_TI_ALOG,    /* log(1 + 15 u), u uniform in [0, 1): a DeltaNet A_log */
    ST_TI_DTBIAS,  /* softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] */
    ST_TI_NORM,    /* 1 + 0.5 u, u uniform in [-1, 1): a norm weight that is not all ones */
    ST_TI_ROPE_FREQS, /* Llama 3's factors (factor 32, low 1, high 4, original context n_ctx / 16) */
} st_tinit;

typedef struct st_tdesc {
    char name[64];
    uint32_t nd;
    uint64_t dims[2]; /* ne0 (cols / length), ne1 (rows) */
    int matrix;       /* stored in the weight type (st_wmat); else an f32 vector */
    int init;         /* st_tinit: how the seeded writer draws it */
    int32_t layer;    /* -1: a field of st_model */
    uint32_t field;   /* offsetof the st_wmat / float * it binds to */
} st_tdesc;

typedef struct st_tlist {
    st_tdesc *t;
    size_t n, cap;
    int err;
} st_tlist;

/* Append an entry (a failed allocation is remembered in l->err; st_tlist_done reports it). */
void st_tlist_add(st_tlist *l, int32_t layer, uint32_t field, int matrix, int init, uint64_t ne0,
                  uint64_t ne1, const char *fmt, ...) __attribute__((format(printf, 8, 9)));
/* 0, or ENOMEM (the list freed) when an add failed. */
int st_tlist_done(st_tlist *l);

/* ---- the fingerprint's inputs --------------------------------------------------------------
 * An architecture hashes its tag and its hyperparameters in a fixed order; st_model.c then adds
 * every listed tensor (name, type, dimensions, data). */
typedef struct st_fp st_fp;
void st_fp_bytes(st_fp *fp, const void *p, size_t n);
void st_fp_u32(st_fp *fp, uint32_t v); /* little-endian */
void st_fp_f32(st_fp *fp, float f);    /* its bits, little-endian */

/* ---- the forward pass -------------------------------------------------------------------------
 * One call reads T tokens at positions pos0.. of a slot: the model, the backend's operations and
 * the slot's memory modules; logits (n_vocab, the last token's) when not NULL. The backend has
 * checked the tokens and the position and reserved the K/V rows. */
typedef struct st_fwd {
    const st_model *m;
    const st_ops *ops;
    void *oc;
    st_kvmem *kv;
    st_recmem *rec;
    const uint32_t *tokens;
    uint32_t T;
    uint64_t pos0;
    float *logits;
} st_fwd;

/* The shared layers. Activations are [T][width] rows of the caller's workspace; E = n_embd. */
/* x = the rows of emb the tokens name. */
void st_layer_embed(const st_fwd *f, const st_wmat *emb, float *x);
/* x += add (add not NULL), then xn = RMSNorm(x) * w, eps = rms_eps. */
void st_layer_norm(const st_fwd *f, float *x, const float *add, const float *w, float *xn);
/* SwiGLU: out = W_down (SiLU(W_gate xn) * (W_up xn)); g and u: [T][rows of W_gate]. */
void st_layer_swiglu(const st_fwd *f, const st_wmat *gate, const st_wmat *up, const st_wmat *down,
                     const float *xn, float *out, float *g, float *u);
/* Gated DeltaNet of layer il with separate q, k, v projections (strata-hybrid's layout), its
 * shape and memory from the layer's memory spec (equal key and value head counts); q and k are
 * L2-normalised with eps 1e-6, q also scaled by 1 / sqrt(dk). out = W_out o. Workspace: qkv and
 * qkvc [T][conv_ch], z [T][H dv], ab [T][2H], o [T][H dv]. */
typedef struct st_gdn_ws {
    float *qkv, *qkvc, *z, *ab, *o;
} st_gdn_ws;
void st_layer_gdn(const st_fwd *f, uint32_t il, const float *xn, float *out, const st_gdn_ws *ws);
/* Grouped-query attention of layer il over its paged K/V: q, k (and, where the layer has
 * q_norm / k_norm, each head RMSNorm'ed with them, eps rms_eps, before RoPE), RoPE on q and k
 * with freq (head_dim / 2 angles per position step; NORM pairing, or NEOX when neox), out =
 * W_o o. Workspace: qkv [T][qa + 2 kva], o [T][qa], qa = query heads x head_dim, kva = K/V heads
 * x head_dim. */
typedef struct st_attn_ws {
    float *qkv, *o;
    const double *rope_freq;
    int neox;
} st_attn_ws;
void st_layer_attention(const st_fwd *f, uint32_t il, const float *xn, float *out,
                        const st_attn_ws *ws);
/* The last token's logits into f->logits: x += add, RMSNorm(x) * w (into xn, E floats), then
 * head . xn. x and add are the [T][E] rows. */
void st_layer_logits(const st_fwd *f, float *x, const float *add, const float *w,
                     const st_wmat *head, float *xn);

/* ---- the descriptor ------------------------------------------------------------------------ */
typedef struct st_arch {
    const char *name; /* general.architecture */
    /* Fill hp with a named preset (ST_EINVAL naming the presets otherwise). */
    int (*preset)(const char *name, st_model_hparams *hp);
    /* Structural check of hyperparameters (ranges, divisibility, layer kinds). */
    int (*check)(const st_model_hparams *hp);
    /* Hyperparameters from the GGUF keys (checked). */
    int (*read)(const st_gguf *g, st_model_hparams *hp);
    /* The keys of a seeded model after general.* (architecture, name, description, seed). */
    int (*write_keys)(st_gguf_writer *w, const st_model_hparams *hp);
    /* The tensor list of this geometry. */
    int (*tensors)(const st_model_hparams *hp, st_tlist *l);
    /* What layer il keeps (slot not set: st_mem_spec_build counts). */
    void (*memory)(const st_model_hparams *hp, uint32_t il, st_mem_layer *ml);
    /* Tag and hyperparameters into the fingerprint. */
    void (*fingerprint)(const st_model_hparams *hp, st_fp *fp);
    /* After every tensor is bound: derived constant data, owned by the layers (st_model_free). */
    int (*prepare)(st_model *m);
    /* The forward pass: a workspace for chunks of up to T tokens (ENOMEM), freed by fwd_free
     * (accepts NULL), and one pass on it (f->T <= T). */
    int (*fwd_new)(const st_model *m, uint32_t T, void **ws);
    void (*fwd_free)(void *ws);
    void (*forward)(const st_fwd *f, void *ws);
} st_arch;

extern const st_arch st_arch_hybrid;
extern const st_arch st_arch_llama, st_arch_qwen3;

/* The architecture of that general.architecture name, or NULL. */
const st_arch *st_arch_find(const char *name, size_t len);

#endif /* ST_ARCH_INT_H */
