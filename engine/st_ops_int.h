/*
 * st_ops_int.h - a backend's operations: the table the layer helpers (st_arch_int.h) compute
 * through. An operation knows buffers and shapes, never a model; the CPU table is st_ops_cpu
 * (st_ops_cpu.c), and another backend provides the same table over its own memory.
 *
 * Every operation follows the determinism rules of docs/ENGINE.md: an output is computed alone
 * and in full with the canonical reductions of st_kernels.c, so results depend neither on how
 * the work is split across threads nor on how many tokens a call covers (a token's outputs are
 * the same whether it is read alone or with 2,047 others).
 *
 * Shapes: T tokens, token t's vector at base + t * ld (ld in floats). Buffers are the caller's
 * and are not retained after the call.
 */
#ifndef ST_OPS_INT_H
#define ST_OPS_INT_H

#include <stddef.h>
#include <stdint.h>

#include "st_engine_int.h"

/* One product of a batch that shares its input: y[t * ldy + r] = W row r . x_t for every row
 * r < w->rows. The weight type (w->type) picks the kernel. */
typedef struct st_mm {
    const st_wmat *w;
    float *y;
    uint32_t ldy;
} st_mm;

/* The delta rule of a Gated-DeltaNet layer over T tokens (docs/ENGINE.md): per value head h,
 * with key head kh = h mod n_k_heads (the tiled mapping; equal head counts map h to h):
 *   u = S k, delta = beta (v - alpha u), S = alpha S + delta k^T, o = S q
 * state: [n_v_heads][dk][dv], each head's S transposed; q, k of token t and key head kh at
 * q + t * ld + kh * dk (k likewise), v of value head h at v + t * ld + h * dv; alpha and beta
 * of token t and head h at [t * ld_g + h]; the output at out + t * ld_out + h * dv.
 * grouped: value head h reads key head h / (n_v_heads / n_k_heads) instead (qwen3next's
 * order, ARCHITECTURES.md §3.3 step 6). */
typedef struct st_dn_args {
    float *state;
    const float *q, *k, *v;
    size_t ld;
    const float *alpha, *beta;
    size_t ld_g;
    float *out;
    size_t ld_out;
    uint32_t n_k_heads, n_v_heads, dk, dv, T;
    int grouped;
} st_dn_args;

typedef struct st_ops {
    const char *name;
    /* The backend's memory, which every buffer the operations take lives in: a forward pass's
     * workspace from mem_alloc (zeroed; NULL when there is none), released by mem_free (accepts
     * NULL); upload and download copy bytes from and to host memory, the bytes there when they
     * return. On the CPU it is host memory and the copies are memcpy. */
    void *(*mem_alloc)(void *oc, size_t bytes);
    void (*mem_free)(void *oc, void *p);
    void (*upload)(void *oc, void *dst, const void *src, size_t bytes);
    void (*download)(void *oc, void *dst, const void *src, size_t bytes);
    /* x_t = row rows[t] of w, widened to f32. */
    void (*get_rows)(void *oc, const st_wmat *w, const uint32_t *rows, uint32_t T, float *x,
                     uint32_t ldx);
    /* Every product of mm[0..n) on the same input x (matmul by weight type). */
    void (*matmul)(void *oc, const float *x, uint32_t ldx, uint32_t T, const st_mm *mm, uint32_t n);
    /* Per token: x_t += add_t (add not NULL), then y_t = x_t / sqrt(mean(x_t^2) + eps) * w;
     * vectors of n, ld n. */
    void (*add_rmsnorm)(void *oc, float *x, const float *add, const float *w, uint32_t n,
                        float eps, float *y, uint32_t T);
    /* Per token and head of hd: x = rmsnorm(x) * w * silu(z) (w of hd, shared by the heads);
     * x and z of heads * hd per token. */
    void (*rmsnorm_gated)(void *oc, float *x, const float *z, const float *w, uint32_t heads,
                          uint32_t hd, float eps, uint32_t T);
    /* Per token and head of hd at x + t * ld + h * hd: x = x * (1 / sqrt(sum x^2 + eps)) * scale. */
    void (*l2norm)(void *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd, float eps,
                   float scale, uint32_t T);
    /* Per token: g = silu(g) * u, vectors of n. */
    void (*swiglu)(void *oc, float *g, const float *u, uint32_t n, uint32_t T);
    /* Optional (NULL: matmul then swiglu): mm[0] (gate) and mm[1] (up) on the same x, then
     * swiglu into mm[0].y, with the bits of those two calls; mm[1].y may be left unwritten. */
    void (*matmul_swiglu)(void *oc, const float *x, uint32_t ldx, uint32_t T, const st_mm *mm);
    /* The causal depthwise convolution (kernel 4) of C channels, then SiLU: x, y of C per token;
     * state: the last three inputs [3][C], oldest first, updated; wT: the weights [4][C]. */
    void (*short_conv)(void *oc, const float *x, float *y, uint32_t C, float *state,
                       const float *wT, uint32_t T);
    /* Per token and head h < H at [t * ld + h]: a = exp(ssm_a[h] * softplus(a + dt_bias[h]))
     * (the decay), b = sigmoid(b) (the write strength). */
    void (*dn_gates)(void *oc, float *a, float *b, uint32_t ld, const float *ssm_a,
                     const float *dt_bias, uint32_t H, uint32_t T);
    void (*delta_rule)(void *oc, const st_dn_args *a);
    /* RoPE, NORM pairing: per token and head at x + t * ld + h * hd, the pairs (x[2i], x[2i+1])
     * of its first n_rot dimensions (i < n_rot / 2; the rest unchanged) rotated by
     * (pos0 + t) * freq[i] (angle, cosine and sine in double). */
    void (*rope_norm)(void *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                      uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T);
    /* RoPE, NEOX pairing: as rope_norm, the pairs (x[i], x[i + n_rot / 2]) for i < n_rot / 2. */
    void (*rope_neox)(void *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                      uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T);
    /* Per token and head of hd at x + t * ld + h * hd: x = x / sqrt(mean(x^2) + eps) * w (w of
     * hd, shared by the heads). */
    void (*rmsnorm_heads)(void *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                          const float *w, float eps, uint32_t T);
    /* K and V of token t (kv_heads x head_dim at k + t * ld, v + t * ld) into rows pos0 + t of
     * the layer's pages (reserved), in its dtype: f16, or i8 with a scale per row and head. */
    void (*kv_store)(void *oc, const st_kv_view *kv, const float *k, const float *v, uint32_t ld,
                     uint64_t pos0, uint32_t T);
    /* Causal attention over the layer's rows 0..pos0 + t for query t (n_head heads of head_dim at
     * q + t * ldq; query head h reads K/V head h / (n_head / kv_heads)), softmax of
     * q k / sqrt(head_dim), the weighted sum of V at out + t * ldo + h * head_dim. */
    void (*attention)(void *oc, const st_kv_view *kv, const float *q, uint32_t ldq, float *out,
                      uint32_t ldo, uint32_t n_head, uint64_t pos0, uint32_t T);
    /* ggml's L2 norm, per token and head as l2norm: x = x / max(sqrt(sum x^2), eps) * scale. */
    void (*l2norm_max)(void *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd, float eps,
                       float scale, uint32_t T);
    /* Per token: x = x * sigmoid(g), vectors of n (x at t * ldx, g at t * ldg). */
    void (*sigmoid_mul)(void *oc, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                        uint32_t n, uint32_t T);
    /* MoE routing (ARCHITECTURES.md §3.5), per token: p = softmax(logits_t) over X experts (max,
     * exp, sum in expert order), the k largest p (ties: the lower expert first) into sel_t in
     * decreasing order, their weights p_e / max(sum of the k, 2^-14) into w_t; logits at
     * t * X, sel and w at t * k. */
    void (*moe_route)(void *oc, const float *logits, uint32_t X, uint32_t k, uint32_t *sel,
                      float *w, uint32_t T);
    /* Per token: x_t += s_t * y_t (s_t = s[t * lds]; s NULL: 1), vectors of n. */
    void (*scale_add)(void *oc, float *x, uint32_t ldx, const float *y, uint32_t ldy,
                      const float *s, uint32_t lds, uint32_t n, uint32_t T);
    /* Per token: x_t *= sigmoid(g[t * ldg]), vectors of n (the shared expert's gate). */
    void (*sigmoid_scale)(void *oc, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                          uint32_t n, uint32_t T);
} st_ops;

/* The CUDA table (st_ops_cuda.cu): its context is an st_ops_cuda, over device memory on the
 * engine's CUDA stream; matmul takes every weight type st_cuda_dequant_supported names, in its
 * file layout in device memory, and K/V views in the CUDA backend's page blocks (st_kv_view's
 * blocks). An operation cannot return an error: the first failure is kept and every later
 * operation does nothing until st_ops_cuda_error takes it (0: none). rope_freq tables and the
 * MoE selection are in device memory like everything else. max_T: tokens per call at most. */
extern const st_ops st_ops_cuda_table;
typedef struct st_ops_cuda st_ops_cuda;
int st_ops_cuda_new(void *stream, uint32_t max_T, uint32_t n_ctx, uint32_t max_head_dim,
                    st_ops_cuda **out);
void st_ops_cuda_free(st_ops_cuda *oc); /* accepts NULL */
int st_ops_cuda_error(st_ops_cuda *oc);
/* The table to run it with: st_ops_cuda_table, or with STRATA_CUDA_OPS_PROFILE=1 at creation
 * its profiled twin (every operation timed between two waits; the table printed to stderr when
 * the context is freed). */
const st_ops *st_ops_cuda_get(const st_ops_cuda *oc);
/* The dynamic mode (st_ops_cuda.cu invariant 8), for passes captured once and replayed at every
 * position: while on, the position-dependent kernels read the position that st_ops_cuda_stage
 * stages (with the pass's token ids) in pinned memory, which the pass's copies read when they
 * run. Stage before each replay, and before capturing. */
void st_ops_cuda_dynamic(st_ops_cuda *oc, int on);
/* The span of a one-token pass at position pos: the keys its attention splits are sized for
 * (invariant 8 of st_ops_cuda.cu); a pass captured in the dynamic mode serves every position of
 * the same span. */
uint64_t st_ops_cuda_att_span(const st_ops_cuda *oc, uint64_t pos);
/* How many attention calls this process has launched on each kernel (st_ops_cuda.cu invariants
 * 9 and 10: tests check which one ran): k_attn on the CUDA cores, k_attn_tc on the tensor cores
 * (several tokens), k_attn_dec (one token, K/V heads shared). */
enum { ST_CUDA_ATT_CORE, ST_CUDA_ATT_TC, ST_CUDA_ATT_DEC, ST_CUDA_ATT_N };
void st_ops_cuda_attention_runs(uint64_t out[ST_CUDA_ATT_N]);
void st_ops_cuda_stage(st_ops_cuda *oc, const uint32_t *tokens, uint32_t T, uint64_t pos0);

/* The CPU table: its context is an st_ops_cpu, made for a model's memory spec, a context length
 * (attention's scores), the engine's kernels and pool (borrowed), and for the integer path the
 * tokens a matmul reads at most (max_T) and the longest row of a weight that has one
 * (qact_cols; 0: none). */
extern const st_ops st_ops_cpu_table;
typedef struct st_ops_cpu st_ops_cpu;
int st_ops_cpu_new(const st_kern *kern, st_pool *pool, const st_mem_spec *ms, uint32_t n_ctx,
                   uint32_t max_T, uint64_t qact_cols, st_ops_cpu **out);
void st_ops_cpu_free(st_ops_cpu *oc); /* accepts NULL */

#endif /* ST_OPS_INT_H */
