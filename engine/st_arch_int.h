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
    ST_TI_SSM_A,   /* -(1 + 15 u), u uniform in [0, 1): -exp(A_log) as ST_TI_ALOG draws A_log */
    ST_TI_MAT_F32, /* as ST_TI_MAT, always stored F32 (a router: §2.4, never quantised) */
} st_tinit;

typedef struct st_tdesc {
    char name[64];
    uint32_t nd;
    uint64_t dims[3]; /* ne0 (cols / length), ne1 (rows), ne2 (experts: a matrix of ne1 ne2 rows) */
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
/* A 3-dimensional entry {ne0, ne1, ne2} (stacked experts): a matrix of ne1 x ne2 rows. */
void st_tlist_add3(st_tlist *l, int32_t layer, uint32_t field, int init, uint64_t ne0,
                   uint64_t ne1, uint64_t ne2, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));
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
 * the slot's memory as the backend keeps it (mem, reached through kv_view and rec); logits
 * (n_vocab, the last token's, in the backend's memory) when not NULL. The backend has checked
 * the tokens (host memory) and the position and reserved the K/V rows. The model's weights
 * and vectors are in the backend's memory too: the CUDA backend passes a copy of the model
 * whose pointers are device addresses (st_backend_cuda.cu). */
typedef struct st_fwd {
    const st_model *m;
    const st_ops *ops;
    void *oc;
    void *mem;
    /* K/V layer slot's view; recurrent layer slot's matrix (conv 0) or convolution history */
    void (*kv_view)(void *mem, uint32_t slot, st_kv_view *v);
    float *(*rec)(void *mem, uint32_t slot, int conv);
    const uint32_t *tokens;
    uint32_t T;
    uint64_t pos0;
    float *logits;
    /* Optional (NULL: the routed experts are rows of the layer's moe_gate / moe_up / moe_down):
     * the n selected experts of one token in layer il as views (views[3j], [3j + 1], [3j + 2]:
     * expert j's gate, up and down) where the backend has put them (the CUDA backend's
     * routed-expert cache, st_xcache_cuda.cu). Nonzero: the backend failed (its error kept for
     * the end of the pass); the layer stops. */
    int (*experts)(void *mem, uint32_t il, const uint32_t *experts, uint32_t n, st_wmat *views);
} st_fwd;

/* The memory modules as a forward pass's memory (the CPU backend's): st_fwd_host_mem(&f, &hm,
 * kv, rec) points f at them. */
typedef struct st_fwd_host {
    st_kvmem *kv;
    st_recmem *rec;
} st_fwd_host;
void st_fwd_host_mem(st_fwd *f, st_fwd_host *hm, st_kvmem *kv, st_recmem *rec);

/* Workspace in the backend's memory (st_ops mem_alloc): n floats, zeroed (*err set to 1 when
 * there is none); n doubles copied from src; released by st_ws_free (accepts NULL). */
float *st_ws_floats(const st_ops *ops, void *oc, uint64_t n, int *err);
double *st_ws_doubles(const st_ops *ops, void *oc, const double *src, uint64_t n, int *err);
void st_ws_free(const st_ops *ops, void *oc, void *p);

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
/* The Qwen hybrids' layers (ARCHITECTURES.md §3.1, §3.3). Products whose outputs a layer splits
 * (per-head [q | gate], per-key-head groups) are computed as row ranges of their weights: a
 * range's outputs are the same bits as the full product's. mm and views: room for the products
 * of one call, at least 2 n_head + 2 (attention) and 6 Hk + 4 (DeltaNet). */
/* Gated attention of layer il: q and its gate per head from attn_q ([q_h | gate_h] per head),
 * per-head RMSNorm of q and k (q_norm, k_norm), partial RoPE NEOX on the first n_rot dims of
 * each head with freq (n_rot / 2 angles), attention over the paged K/V, o * sigmoid(gate),
 * out = W_o o. Workspace: q, gate, o [T][qa], kv [T][2 kva]. */
typedef struct st_gattn_ws {
    float *q, *gate, *kv, *o;
    const double *rope_freq;
    uint32_t n_rot;
    st_mm *mm;
    st_wmat *views;
} st_gattn_ws;
void st_layer_gated_attention(const st_fwd *f, uint32_t il, const float *xn, float *out,
                              const st_gattn_ws *ws);
/* Gated DeltaNet of layer il from the fused projections: attn_qkv ([q; k; v]) and attn_gate, or
 * the legacy ssm_in ([q_kh, k_kh, v, z] per key head); beta and alpha from ssm_beta and
 * ssm_alpha, or from ssm_ba ([beta x R | alpha x R] per key head). Hk key heads (n_k_heads)
 * and the layer's memory spec's value heads; grouped picks the head mapping (st_dn_args).
 * ggml's L2 norm with eps rms_eps; the file's ssm_a is -exp(A_log) already. Workspace: qkv,
 * qkvc [T][conv_ch], z, o [T][Hv dv], ab [T][2 Hv]. */
typedef struct st_gdnf_ws {
    float *qkv, *qkvc, *z, *ab, *o;
    uint32_t n_k_heads;
    int grouped;
    st_mm *mm;
    st_wmat *views;
} st_gdnf_ws;
void st_layer_gdn_fused(const st_fwd *f, uint32_t il, const float *xn, float *out,
                        const st_gdnf_ws *ws);
/* The MoE feed-forward of layer il (ARCHITECTURES.md §3.5): the shared expert's SwiGLU gated by
 * sigmoid(sh_router . xn) into out, then per token the top-k experts of the router's softmax,
 * each one's SwiGLU weighted by its renormalised probability, added in rank order. k experts
 * of Fe, shared expert of Fs. Workspace: logits [T][X], sel and w [T][k], g and u [T][max(Fe,
 * Fs)], y [E], gs [T]; sel_h: the selection downloaded to host memory ([T][k]), where the
 * layer reads it to pick the experts' rows; xv: 3k views (host) for f->experts. */
typedef struct st_moe_ws {
    float *logits, *w, *g, *u, *y, *gs;
    uint32_t *sel, *sel_h;
    uint32_t k;
    st_wmat *xv;
} st_moe_ws;
void st_layer_moe(const st_fwd *f, uint32_t il, const float *xn, float *out, const st_moe_ws *ws);
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
    /* The forward pass: a workspace for chunks of up to T tokens in the memory of the backend
     * whose operations are ops (ENOMEM), freed by fwd_free (accepts NULL; ops and oc must still
     * be alive), and one pass on it (f->T <= T, f->ops the same). m is the host model: fwd_new
     * reads its hyperparameters and vectors on the host. */
    int (*fwd_new)(const st_model *m, const st_ops *ops, void *oc, uint32_t T, void **ws);
    void (*fwd_free)(void *ws);
    void (*forward)(const st_fwd *f, void *ws);
} st_arch;

extern const st_arch st_arch_hybrid;
extern const st_arch st_arch_llama, st_arch_qwen3;
extern const st_arch st_arch_qwen35, st_arch_qwen35moe, st_arch_qwen3next;

/* The architecture of that general.architecture name, or NULL. */
const st_arch *st_arch_find(const char *name, size_t len);

#endif /* ST_ARCH_INT_H */
