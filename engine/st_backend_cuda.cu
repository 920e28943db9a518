/*
 * st_backend_cuda.cu - the CUDA backend on one GPU: strata-hybrid's own forward pass (bf16
 * weights, cuBLAS projections with fp32 accumulation, kernels for the rest) and, for every other
 * model, the architecture's forward pass on the operation table (st_ops_cuda.cu, invariant 8);
 * the slot state in device memory (running tensors and a paged K/V arena), and the transfers
 * that move it through pinned staging buffers, published as the same geometry tensors as the
 * CPU backend.
 *
 * Invariants:
 * 1. The geometry is the CPU backend's, tensor for tensor (names, order, dtypes, shapes), so an
 *    image made by either backend restores on the other. The device buffers hold exactly those
 *    bytes: blk.N.ssm_state [H][dk][dv] f32 and blk.N.conv_state [3][C] f32 in one running
 *    buffer per slot; K and V rows ([n_head_kv][head_dim], f16 or i8) and i8 scales in pages of
 *    page_size rows; the position lives on the host.
 * 2. A page is one device block holding, for every attention layer, its K rows, V rows and (i8)
 *    scale rows of page_size tokens; a slot's page table (host array + device copy) maps page p
 *    to its block. Blocks and running buffers come from free lists of the backend and return to
 *    them when a state is freed, so a restore allocates nothing once the pools are warm.
 * 3. Determinism: every kernel gives each output to one thread (or one warp / block, reducing in
 *    a fixed order: fixed shuffle trees and serial sums, no atomics); cuBLAS runs on one stream
 *    with a fixed workspace and atomics disallowed, which makes its results reproducible on the
 *    same GPU and library. So the same inputs read in the same chunks give the same bits, run
 *    after run and process after process. Chunking is not free as on the CPU: cuBLAS may pick
 *    another kernel for another number of tokens, and attention splits keys by the chunk size;
 *    the slot code cuts a resumed read exactly as a full read, so the cache stays exact.
 * 4. Every public function leaves the stream idle when it returns (it synchronises), so host
 *    buffers handed in or out are never touched after return, and a CUDA error shows in the call
 *    that caused it. A failure inside a state's reset is kept in the state (s->err) and returned
 *    by the next call on it.
 * 5. Transfers (snapshot, restore, checkpoints, hashes) run through NSTAGE pinned host buffers
 *    and NSTAGE device buffers of STAGE_BYTES: the GPU gathers K/V rows from pages (or encodes
 *    the running state to bf16) into a device buffer and copies it to a pinned buffer while the
 *    host copies earlier buffers into the image with the thread pool; a restore is the reverse.
 *    Chunks alternate between two streams, so one chunk's kernel overlaps the next one's copy.
 *    Image buffers in the pinned image pool (PARK images, cu_image_allocator) skip the pinned
 *    host buffers: the device copies straight to / from them (seg.direct).
 * 6. A whole-state save / load also gives the state hash's block digests of the tensors, and the
 *    GPU computes them (st_xxh3_warp, one warp per 1 MiB block) from device memory on a third
 *    stream: a save digests the state while it is copied out (through the bf16 rounding for a
 *    bf16 checkpoint); a load digests what arrived once the copies are done, so a restore is
 *    verified over the bytes the slot will run on.
 *    The slot code (engine/st_slot.c) adds the tokens' digests and combines them.
 * 7. The FP16 path for BF16 weights (STRATA_BF16_TC, st_wcache.c): each product converts its
 *    input and its weight to FP16 (saturated to +-65504) and runs cuBLAS on FP16 with FP32
 *    accumulation. A weight's conversion is looked up in the engine's own arena when the arena
 *    is on and the weight is immutable (the model's: all that the forward pass multiplies);
 *    a miss that does not fit is converted into wtmp for that call only. The arena and wtmp
 *    are allocated by cudaMalloc (256-byte aligned) and the product's shape and leading
 *    dimensions are the same either way, so a cached and an uncached product are the same
 *    cuBLAS call on the same bytes: the same bits. The arena is its own allocation, never lent
 *    as scratch, and exists only when the path and the cache are both on.
 * 8. Every model but strata-hybrid on f32 / f16 / bf16 weights runs on the operation table
 *    (st_ops_cuda.cu) with the architecture's own forward pass (engine/arch/): the weights are
 *    copied to the device in their file types (VRAM about the file's size), one allocation per
 *    tensor, into a copy of the model whose pointers are device addresses; the K/V views are
 *    this file's page blocks (st_kv_view.blocks) and the recurrent state its running buffer, so
 *    the state, its transfers and its hashes are the same code for both paths. A decode step
 *    (one token) of a model without MoE routing (whose layer waits for the selection) is
 *    captured once into a CUDA graph, with the operation table in its dynamic mode (the token
 *    and the position read from pinned staging when the graph runs; st_ops_cuda.cu invariant
 *    8), and replayed for every later step of a state with the same running buffer (every
 *    address the pass reads lies in it, in the context, or in the K/V pages its page table
 *    names, which is brought up to date before each step) and the same logits request. The
 *    kernels are a direct run's except that one-token attention launches the context's key
 *    splits and their merge (those past the position empty, passed over exactly), so the bits
 *    are the same. Another buffer or request captures again, and the executable graph is updated in
 *    place (cudaGraphExecUpdate) or, where the update is refused, instantiated again. Opt-in
 *    (STRATA_CUDA_GRAPHS=1; docs/BENCHMARKS.md has what it gains).
 */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

extern "C" {
#include "st_arch_int.h"
#include "st_engine_int.h"
#include "st_ops_int.h"
}
#include "st_elem_cuda.cuh"
#include "st_reduce_cuda.cuh"
#include "st_xxh3.h"

typedef __nv_bfloat16 bf16;

#define NSTAGE 4
static_assert(NSTAGE % 2 == 0, "xstream: a slot must keep the parity of its stream");
#define STAGE_BYTES ((size_t)16 << 20)
#define BLAS_WS_BYTES ((size_t)32 << 20)
#define FULL 0xffffffffu

/* ---- errors ------------------------------------------------------------------------------ */
static int cu_fail(cudaError_t err, const char *what)
{
    return st_error_set(err == cudaErrorMemoryAllocation ? ENOMEM : ST_EIO,
                        "cuda backend: %s: %s (%s)", what, cudaGetErrorName(err),
                        cudaGetErrorString(err));
}

static int blas_fail(cublasStatus_t st, const char *what)
{
    return st_error_set(st == CUBLAS_STATUS_ALLOC_FAILED ? ENOMEM : ST_EIO,
                        "cuda backend: %s: %s", what, cublasGetStatusName(st));
}

/* Release-time calls: checked, a failure recorded as the thread's detail (nothing to return). */
static void cu_release(cudaError_t err, const char *what)
{
    if (err != cudaSuccess)
        cu_fail(err, what);
}

#define CU(call)                                                                               \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess)                                                                 \
            return cu_fail(e_, #call);                                                         \
    } while (0)
#define CUG(call)                                                                              \
    do {                                                                                       \
        cudaError_t e_ = (call);                                                               \
        if (e_ != cudaSuccess) {                                                               \
            rc = cu_fail(e_, #call);                                                           \
            goto fail;                                                                         \
        }                                                                                      \
    } while (0)
/* After a kernel launch: a bad configuration shows here, a fault at the next synchronisation. */
#define KCHECK(name)                                                                           \
    do {                                                                                       \
        cudaError_t e_ = cudaGetLastError();                                                   \
        if (e_ != cudaSuccess)                                                                 \
            return cu_fail(e_, "launch of " name);                                             \
    } while (0)

/* The state hash on the device (hash_queue): a source of bytes and a block of one. */
enum { HS_LIN, HS_BF16, HS_PAGED };

typedef struct hsrc {
    uint32_t kind, rb, ps;
    uint32_t fast;           /* PAGED from row 0, < 4 GiB, 8-byte aligned: o / pb finds the page */
    uint32_t pb, pbm, pbs;   /* the tensor's bytes per page (ps * rb), its division magic */
    uint32_t pad;
    const uint8_t *base;         /* LIN: the bytes; BF16: fp32 values, hashed rounded to bf16 */
    uint8_t *const *pages;       /* PAGED: the device page table */
    uint64_t koff, row0;
} hsrc;

typedef struct hjob {
    uint32_t src, pad;
    uint64_t off, len, out; /* the block [off, off + len) of source src, digest index out */
} hjob;

/* ---- contexts ---------------------------------------------------------------------------- */

typedef struct cu_layer {
    char kind;
    uint32_t slot; /* index among its kind */
    float *attn_norm, *ffn_norm;
    bf16 *w_in;  /* D: [C + H*dv + 2H][E] (q, k, v, gate, alpha, beta); A: [qa + 2*kva][E] */
    bf16 *w_out; /* [E][H*dv] or [E][qa] */
    bf16 *w_ffn_in;   /* [2F][E]: gate, up */
    bf16 *w_ffn_down; /* [E][F] */
    uint32_t in_rows, out_cols;
    uint64_t ssm_off, conv_off; /* its running tensors in a state's running buffer */
    float *conv_w; /* [C][4] */
    float *a_log, *dt_bias, *ssm_norm;
} cu_layer;

typedef struct cu_ctx {
    st_engine *e;
    const st_model *m;
    const st_model_hparams *hp;
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    int n_sm;
    uint32_t T, n_ctx, ps, n_pages, kv_dtype, n_threads;
    uint32_t E, F, V, H, dk, dv, C, hdv, nh, nkv, hd, qa, kva;
    uint32_t n_dn, n_attn, nmix, ngin;
    st_tensor_desc *descs;
    st_state_map *tm;
    uint32_t n_desc;
    uint64_t *run_off, *run_len; /* per tensor: byte offset / length in the running buffer */
    uint64_t run_bytes, table_off, state_bytes;
    /* K/V pages */
    uint64_t krow, srow, off_v, off_ks, off_vs, per_layer, page_bytes;
    /* weights */
    uint8_t *wbuf;
    cu_layer *L;
    float *tok_embd; /* [V][E] f32 */
    bf16 *w_head;    /* [V][E] */
    float *out_norm;
    double *rope_freq;
    /* workspace for a chunk of T tokens */
    float *x, *out, *mix, *qkvc, *ab, *o, *logits_d;
    bf16 *xnb, *gin;
    uint32_t *tok_d, *tok_h;
    float *logits_h;
    float *att_po, *att_pm, *att_pl;
    uint64_t att_cap_rows;
    /* staging */
    uint8_t *hstage[NSTAGE], *dstage[NSTAGE];
    cudaEvent_t ev[NSTAGE];
    cudaStream_t xs2, hs;            /* the second transfer stream; the state hash's stream */
    cudaEvent_t ev_go, ev_go2, ev_h; /* ordering between them; the digests are down */
    /* the state hash on the device (hash_queue): sources, jobs and digests, room for a full
     * state of n_ctx tokens (hjob_cap blocks) */
    hsrc *hsrc_h, *hsrc_d;
    hjob *hjob_h, *hjob_d;
    uint64_t *hdg_h, *hdg_d, hjob_cap;
    uint32_t *hjob_at; /* [n_desc + 1] */
    int trace; /* STRATA_CUDA_TRACE set: save / load print their phases to stderr */
    cudaEvent_t ev_t0, ev_t1; /* trace: the hash kernel's time */
    uint16_t *htmp;
    /* pools */
    void **free_pages, **free_run;
    uint32_t n_free_pages, cap_free_pages, n_free_run, cap_free_run;
    /* the FP16 path for BF16 weights (invariant 7; st_wcache.c) */
    int fp16;          /* the products run on FP16 tensor cores */
    __half *xh;        /* a product's input in FP16: [T][cmax] */
    __half *wtmp;      /* the per-call conversion of one weight: wmax elements */
    uint64_t wmax;     /* elements of the largest weight */
    uint32_t cmax;     /* the widest product input */
    st_wcache wc;      /* the arena's entries (wc.cap 0: no arena) */
    __half *arena;
    uint64_t device_bytes;
    pthread_mutex_t wc_mu; /* guards wc_pub: read by st_engine_wcache_get from any thread */
    int wc_mu_ok;
    st_engine_wcache wc_pub;
    /* the operation-table path (invariant 8): any architecture, any weight type */
    int ops;            /* 1: the forward pass is the architecture's on st_ops_cuda */
    st_model dm;        /* the model, its weights and vectors at device addresses */
    st_layer *dlayers;
    const void **dsrc;  /* host address -> device copy, one per uploaded tensor */
    void **ddst;
    uint32_t n_dcopy, cap_dcopy;
    st_ops_cuda *oc;
    void *ws;           /* the architecture's workspace, in device memory */
    uint64_t *rec_ssm, *rec_conv; /* recurrent slot -> its tensors' offsets in the running buffer */
    int graphs;                /* decode steps run as CUDA graphs (STRATA_CUDA_GRAPHS, invariant 8) */
    cudaGraphExec_t gexec;     /* the decode graph (invariant 8) */
    const uint8_t *g_run;      /* the running buffer it was captured for (NULL: none valid) */
    int g_logits;              /* and whether it copies the logits */
    uint64_t g_span;           /* and the attention span of its position (st_ops_cuda_att_span) */
    uint64_t g_inst, g_upd, g_replay; /* graphs instantiated, updated in place, replayed */
    /* the routed-expert cache (st_xcache_cuda.cu): host_experts 1 keeps moe_gate / moe_up /
     * moe_down out of dm (host addresses there, never read by a kernel) */
    int host_experts;
    st_xdev *xdev;
} cu_ctx;

typedef struct cu_state {
    int64_t pos;
    int err;         /* sticky failure of a reset */
    int table_dirty; /* the device page table lags the host one */
    uint8_t *run;    /* running tensors, then the device page table */
    uint8_t **pages; /* host: device block of page p or NULL */
    uint8_t **pages_d;
} cu_state;

/* ---- kernels: helpers (the reductions: st_reduce_cuda.cuh) ----------------------------- */
__device__ __forceinline__ float silu_f(float x) { return x / (1.0f + expf(-x)); }

/* ---- kernels: the layers ------------------------------------------------------------------ */
/* x[t] = embedding row of token t. grid T. */
__global__ void k_embed(const uint32_t *tok, const float *emb, uint32_t E, float *x)
{
    const float *r = emb + (size_t)tok[blockIdx.x] * E;
    float *y = x + (size_t)blockIdx.x * E;
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x)
        y[i] = r[i];
}

/* Per token (grid T): optionally x += out, then y = bf16(rmsnorm(x) * w). */
__global__ void k_add_norm(float *x, const float *out, int add, const float *w, uint32_t E,
                           float eps, bf16 *y)
{
    __shared__ float sh[32];
    float *xr = x + (size_t)blockIdx.x * E;
    const float *orow = out + (size_t)blockIdx.x * E;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x) {
        float v = xr[i];
        if (add) {
            v = v + orow[i];
            xr[i] = v;
        }
        ss = fmaf(v, v, ss);
    }
    ss = st_block_sum(ss, sh);
    float sc = 1.0f / sqrtf(ss / (float)E + eps);
    bf16 *yr = y + (size_t)blockIdx.x * E;
    for (uint32_t i = threadIdx.x; i < E; i += blockDim.x)
        yr[i] = __float2bfloat16_rn(xr[i] * sc * w[i]);
}

/* DeltaNet causal convolution (kernel 4) + SiLU: grid (T, channel blocks). The inputs before
 * the chunk are the state, [3][C] oldest first. */
__global__ void k_conv(const float *mix, uint32_t ldm, uint32_t C, const float *w,
                       const float *st, float *y)
{
    uint32_t t = blockIdx.x, ch = blockIdx.y * blockDim.x + threadIdx.x;
    if (ch >= C)
        return;
    float acc = 0.0f;
    for (int j = 0; j < 4; j++) {
        int64_t s = (int64_t)t - 3 + j;
        float xin = s >= 0 ? mix[(size_t)s * ldm + ch] : st[(size_t)(3 + s) * C + ch];
        acc = fmaf(w[(size_t)ch * 4 + j], xin, acc);
    }
    y[(size_t)t * C + ch] = silu_f(acc);
}

/* The convolution state after the chunk: its last three inputs (each thread reads its channel's
 * three values before writing them). */
__global__ void k_conv_state(const float *mix, uint32_t ldm, uint32_t C, float *st, uint32_t T)
{
    uint32_t ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= C)
        return;
    float v[3];
    for (int j = 0; j < 3; j++) {
        int64_t s = (int64_t)T - 3 + j;
        v[j] = s >= 0 ? mix[(size_t)s * ldm + ch] : st[(size_t)(3 + s) * C + ch];
    }
    for (int j = 0; j < 3; j++)
        st[(size_t)j * C + ch] = v[j];
}

/* DeltaNet per (token, head) (grid (T, H)): L2-normalise q (also by 1/sqrt(dk)) and k; the decay
 * alpha and the write strength beta. mab: the raw alpha at [h], beta at [H + h] of each row. */
__global__ void k_dn_prep(float *qkvc, uint32_t C, uint32_t H, uint32_t dk, const float *mab,
                          uint32_t ldm, const float *a_log, const float *dt_bias, float *ab)
{
    __shared__ float sh[32];
    uint32_t t = blockIdx.x, h = blockIdx.y;
    float *q = qkvc + (size_t)t * C + (size_t)h * dk;
    float *k = qkvc + (size_t)t * C + (size_t)H * dk + (size_t)h * dk;
    float sq = 0.0f, sk = 0.0f;
    for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x) {
        sq = fmaf(q[i], q[i], sq);
        sk = fmaf(k[i], k[i], sk);
    }
    sq = st_block_sum(sq, sh);
    sk = st_block_sum(sk, sh);
    float nq = 1.0f / sqrtf(sq + 1e-6f), nk = 1.0f / sqrtf(sk + 1e-6f);
    float qs = 1.0f / sqrtf((float)dk);
    for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x) {
        q[i] = q[i] * nq * qs;
        k[i] = k[i] * nk;
    }
    if (threadIdx.x == 0) {
        float xa = mab[(size_t)t * ldm + h] + dt_bias[h];
        float sp = xa > 20.0f ? xa : log1pf(expf(xa));
        float g = -expf(a_log[h]) * sp;
        ab[(size_t)t * 2 * H + h] = expf(g);
        ab[(size_t)t * 2 * H + H + h] = 1.0f / (1.0f + expf(-mab[(size_t)t * ldm + H + h]));
    }
}

/* The Gated-DeltaNet recurrence over the T tokens of a chunk, the state on chip.
 * Block (16 columns j of one head h) x grid (dv / 16, H); 256 threads: thread (p, cl) with
 * cl = tid & 15 (column), p = tid >> 4 (row group) keeps rows i = r*16 + p, r < R, of column j
 * of M (= S transposed, [dk][dv]) in registers for the whole chunk. Per token:
 *   d_j = beta (v_j - alpha u_j),  M[i][j] = k_i d_j + alpha M[i][j],
 *   o_j = sum_i M[i][j] q_i,       u_j (next token) = sum_i M[i][j] k'_i,
 * the sums over i as: each thread in increasing r, then the two row groups of a warp (shuffle),
 * then the eight warps in order: one fixed order. q and k of SC_TT tokens (and the next token's
 * k) are staged in shared memory, zero-padded to R*16 rows. */
#define SC_COLS 16
#define SC_TT 8
template <int R>
__global__ void __launch_bounds__(256)
    k_dn_scan(float *M, uint32_t dk, uint32_t dv, uint32_t T, const float *qkvc, uint32_t C,
              uint32_t H, const float *ab, float *o)
{
    extern __shared__ float smem[];
    const uint32_t DKP = R * 16;
    float *qs = smem;                      /* [SC_TT][DKP] */
    float *ks = qs + SC_TT * DKP;          /* [SC_TT + 1][DKP] */
    float *vs = ks + (SC_TT + 1) * DKP;    /* [SC_TT][16] */
    float *as = vs + SC_TT * SC_COLS;      /* [SC_TT] */
    float *bs = as + SC_TT;                /* [SC_TT] */
    float *red = bs + SC_TT;               /* [2][8][16][2] */
    const uint32_t h = blockIdx.y, tid = threadIdx.x;
    const uint32_t cl = tid & 15, p = tid >> 4, w = tid >> 5;
    const uint32_t j0 = blockIdx.x * SC_COLS, j = j0 + cl;
    const bool jv = j < dv;
    float *Mh = M + (size_t)h * dk * dv;
    float m[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        uint32_t i = (uint32_t)r * 16 + p;
        m[r] = (jv && i < dk) ? Mh[(size_t)i * dv + j] : 0.0f;
    }
    const float *qb = qkvc + (size_t)h * dk;
    const float *kb = qkvc + (size_t)H * dk + (size_t)h * dk;
    const float *vb = qkvc + 2 * (size_t)H * dk + (size_t)h * dv;
    float u = 0.0f;
    int buf = 0;
    for (uint32_t t0 = 0; t0 < T; t0 += SC_TT) {
        uint32_t nt = T - t0 < SC_TT ? T - t0 : SC_TT;
        uint32_t nk = T - t0 < SC_TT + 1 ? T - t0 : SC_TT + 1;
        __syncthreads();
        for (uint32_t e = tid; e < SC_TT * DKP; e += blockDim.x) {
            uint32_t tt = e / DKP, i = e % DKP;
            qs[e] = (tt < nt && i < dk) ? qb[(size_t)(t0 + tt) * C + i] : 0.0f;
        }
        for (uint32_t e = tid; e < (SC_TT + 1) * DKP; e += blockDim.x) {
            uint32_t tt = e / DKP, i = e % DKP;
            ks[e] = (tt < nk && i < dk) ? kb[(size_t)(t0 + tt) * C + i] : 0.0f;
        }
        for (uint32_t e = tid; e < SC_TT * SC_COLS; e += blockDim.x) {
            uint32_t tt = e / SC_COLS, jj = j0 + e % SC_COLS;
            vs[e] = (tt < nt && jj < dv) ? vb[(size_t)(t0 + tt) * C + jj] : 0.0f;
        }
        if (tid < SC_TT) {
            as[tid] = tid < nt ? ab[(size_t)(t0 + tid) * 2 * H + h] : 0.0f;
            bs[tid] = tid < nt ? ab[(size_t)(t0 + tid) * 2 * H + H + h] : 0.0f;
        }
        __syncthreads();
        if (t0 == 0) {
            /* u for the first token: S_{t-1} k_t from the state as it enters the chunk */
            float pu = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++)
                pu = fmaf(m[r], ks[r * 16 + p], pu);
            pu += __shfl_xor_sync(FULL, pu, 16);
            float *rb = red + buf * (8 * 16 * 2);
            if ((tid & 31) < 16)
                rb[(w * 16 + cl) * 2 + 1] = pu;
            __syncthreads();
            float su = 0.0f;
            for (int ww = 0; ww < 8; ww++)
                su += rb[(ww * 16 + cl) * 2 + 1];
            u = su;
            buf ^= 1;
        }
        for (uint32_t tt = 0; tt < nt; tt++) {
            float a = as[tt], b = bs[tt];
            float d = b * (vs[tt * SC_COLS + cl] - a * u);
            const float *kt = ks + tt * DKP, *qt = qs + tt * DKP, *kn = kt + DKP;
            float po = 0.0f, pu = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                uint32_t i = (uint32_t)r * 16 + p;
                float mv = fmaf(kt[i], d, a * m[r]);
                m[r] = mv;
                po = fmaf(mv, qt[i], po);
                pu = fmaf(mv, kn[i], pu);
            }
            po += __shfl_xor_sync(FULL, po, 16);
            pu += __shfl_xor_sync(FULL, pu, 16);
            float *rb = red + buf * (8 * 16 * 2);
            if ((tid & 31) < 16) {
                rb[(w * 16 + cl) * 2] = po;
                rb[(w * 16 + cl) * 2 + 1] = pu;
            }
            __syncthreads();
            float so = 0.0f, su = 0.0f;
            for (int ww = 0; ww < 8; ww++) {
                so += rb[(ww * 16 + cl) * 2];
                su += rb[(ww * 16 + cl) * 2 + 1];
            }
            if (p == 0 && jv)
                o[(size_t)(t0 + tt) * H * dv + (size_t)h * dv + j] = so;
            u = su;
            buf ^= 1;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) {
        uint32_t i = (uint32_t)r * 16 + p;
        if (jv && i < dk)
            Mh[(size_t)i * dv + j] = m[r];
    }
}

/* DeltaNet output per (token, head) (grid (T, H)): y = bf16(rmsnorm(o_h) * norm * silu(gate)). */
__global__ void k_dn_gate(const float *o, const float *gate, uint32_t ldm, const float *nw,
                          uint32_t H, uint32_t dv, float eps, bf16 *y)
{
    __shared__ float sh[32];
    uint32_t t = blockIdx.x, h = blockIdx.y;
    const float *orow = o + (size_t)t * H * dv + (size_t)h * dv;
    const float *g = gate + (size_t)t * ldm + (size_t)h * dv;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < dv; i += blockDim.x)
        ss = fmaf(orow[i], orow[i], ss);
    ss = st_block_sum(ss, sh);
    float sc = 1.0f / sqrtf(ss / (float)dv + eps);
    bf16 *yr = y + (size_t)t * H * dv + (size_t)h * dv;
    for (uint32_t i = threadIdx.x; i < dv; i += blockDim.x)
        yr[i] = __float2bfloat16_rn(orow[i] * sc * nw[i] * silu_f(g[i]));
}

/* RoPE on adjacent pairs, angle pos * freq[i] in double (the CPU's formula). */
__device__ void rope_vec(float *v, uint32_t hd, uint64_t pos, const double *freq)
{
    for (uint32_t i = threadIdx.x; i < hd / 2; i += blockDim.x) {
        double a = (double)pos * freq[i];
        float cs = (float)cos(a), sn = (float)sin(a);
        float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cs - x1 * sn;
        v[2 * i + 1] = x0 * sn + x1 * cs;
    }
}

/* RoPE on the query heads, in place: grid (T, n_head). */
__global__ void k_rope_q(float *mix, uint32_t ldm, uint32_t hd, uint64_t pos0, const double *freq)
{
    rope_vec(mix + (size_t)blockIdx.x * ldm + (size_t)blockIdx.y * hd, hd, pos0 + blockIdx.x, freq);
}

typedef struct kv_geom {
    uint8_t *const *pages;
    uint32_t ps, krow, srow, i8;
    uint64_t lay, off_v, off_ks, off_vs; /* lay: this layer's offset in a page block */
} kv_geom;

__device__ __forceinline__ uint8_t *kv_row(const kv_geom &g, uint64_t j, uint64_t off, uint32_t rb)
{
    return g.pages[j / g.ps] + g.lay + off + (j % g.ps) * rb;
}

/* RoPE on the K heads, then K and V of token pos0 + t into the arena (f16, or i8 with a scale
 * per token and head: scale = max|x| / 127, q = round-to-even(x * 127 / max|x|)).
 * grid (T, n_head_kv). */
__global__ void k_kv_store(float *mix, uint32_t ldm, uint32_t qa, uint32_t kva, uint32_t hd,
                           uint64_t pos0, const double *freq, kv_geom g)
{
    __shared__ float sh[32];
    uint32_t t = blockIdx.x, hk = blockIdx.y;
    float *k = mix + (size_t)t * ldm + qa + (size_t)hk * hd;
    const float *v = mix + (size_t)t * ldm + qa + kva + (size_t)hk * hd;
    uint64_t pos = pos0 + t;
    rope_vec(k, hd, pos, freq);
    __syncthreads();
    if (!g.i8) {
        __half *kr = (__half *)kv_row(g, pos, 0, g.krow) + (size_t)hk * hd;
        __half *vr = (__half *)kv_row(g, pos, g.off_v, g.krow) + (size_t)hk * hd;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x) {
            kr[i] = __float2half_rn(k[i]);
            vr[i] = __float2half_rn(v[i]);
        }
        return;
    }
    for (int which = 0; which < 2; which++) {
        const float *x = which ? v : k;
        int8_t *q = (int8_t *)kv_row(g, pos, which ? g.off_v : 0, g.krow) + (size_t)hk * hd;
        float *sc = (float *)kv_row(g, pos, which ? g.off_vs : g.off_ks, g.srow) + hk;
        float am = 0.0f;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
            am = fmaxf(am, fabsf(x[i]));
        am = st_block_max(am, sh);
        if (!(am > 0.0f) || !isfinite(am)) {
            for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
                q[i] = 0;
            if (threadIdx.x == 0)
                *sc = 0.0f;
            continue;
        }
        float inv = 127.0f / am;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x) {
            int r = __float2int_rn(x[i] * inv);
            q[i] = (int8_t)(r > 127 ? 127 : r < -127 ? -127 : r);
        }
        if (threadIdx.x == 0)
            *sc = am / 127.0f;
    }
}

/* Attention over the paged K/V, grouped-query. The rows of a kv head g are (token t, head hh of
 * its group) pairs r = t*G + hh; a block takes BR = 4*NI rows and the keys of one split
 * [split*KS, (split+1)*KS), in tiles of 32 keys: the tile's K (then V) widened to f32 in shared
 * memory; warp w owns rows w + 4i (i < NI), lane l the key l of the tile, so a row's scores,
 * maximum and sum are warp shuffles in a fixed order; online softmax; the weighted sum of V
 * accumulates per (row, element d = lane + 32c) in registers. With one split the result (divided
 * by the sum) goes to out as bf16; with several, each split's (max, sum, unnormalised sum of V)
 * goes to po/pm/pl and k_attn_comb merges the splits in order. */
#define AT_BK 32
#define AT_THREADS 128
#define AT_MAXC (ST_CUDA_MAX_HEAD_DIM / 32) /* elements per lane */
/* Row stride in shared memory: head_dim rounded up to 4 (zero-padded, for 16-byte loads), plus
 * 4 when that is an even number of 16-byte units, so that the 8 lanes of a quarter-warp reading
 * 8 different rows hit 8 different bank groups. */
__host__ __device__ static inline uint32_t at_stride(uint32_t hd)
{
    uint32_t h4 = (hd + 3) / 4 * 4;
    return (h4 / 4) % 2 ? h4 : h4 + 4;
}
typedef struct attn_args {
    const float *mix;
    uint32_t ldm, hd, nkv, G, T, qa, nsplit;
    uint64_t pos0, KS;
    float scale;
    kv_geom g;
    bf16 *out;
    float *po, *pm, *pl;
} attn_args;

template <int NI>
__global__ void __launch_bounds__(AT_THREADS) k_attn(attn_args a)
{
    extern __shared__ float4 sm4[];
    float *sm = (float *)sm4;
    const uint32_t BR = 4 * NI, HS = at_stride(a.hd), hd4 = (a.hd + 3) / 4 * 4;
    float *Qs = sm;           /* [BR][HS] */
    float *KV = sm + BR * HS; /* [AT_BK][HS] */
    const uint32_t split = blockIdx.y, g = blockIdx.z;
    const uint32_t tid = threadIdx.x, lane = tid & 31, w = tid >> 5;
    const uint32_t nrows = a.T * a.G, r0 = blockIdx.x * BR, hd = a.hd;
    __shared__ const uint8_t *rowp[AT_BK];
    __shared__ const float *sclp[AT_BK];
    for (uint32_t lr = w; lr < BR; lr += 4) {
        uint32_t r = r0 + lr;
        const float *q = NULL;
        if (r < nrows)
            q = a.mix + (size_t)(r / a.G) * a.ldm + (size_t)(g * a.G + r % a.G) * hd;
        for (uint32_t d = lane; d < hd4; d += 32)
            Qs[lr * HS + d] = q && d < hd ? q[d] : 0.0f;
    }
    uint32_t rlast = (r0 + BR < nrows ? r0 + BR : nrows) - 1;
    uint64_t kend = a.pos0 + rlast / a.G + 1;
    uint64_t k0 = (uint64_t)split * a.KS, k1 = k0 + a.KS < kend ? k0 + a.KS : kend;
    float mrow[NI], lrow[NI], acc[NI][AT_MAXC];
    uint64_t klim[NI];
#pragma unroll
    for (int i = 0; i < NI; i++) {
        uint32_t r = r0 + w + 4 * i;
        klim[i] = r < nrows ? a.pos0 + r / a.G + 1 : 0;
        mrow[i] = -INFINITY;
        lrow[i] = 0.0f;
#pragma unroll
        for (int c = 0; c < AT_MAXC; c++)
            acc[i][c] = 0.0f;
    }
    const uint64_t ofs_k[2] = {0, a.g.off_v}, ofs_s[2] = {a.g.off_ks, a.g.off_vs};
    for (uint64_t kb = k0; kb < k1; kb += AT_BK) {
        uint32_t nkeys = k1 - kb < AT_BK ? (uint32_t)(k1 - kb) : AT_BK;
        float s[NI];
#pragma unroll
        for (int i = 0; i < NI; i++)
            s[i] = 0.0f;
        for (int which = 0; which < 2; which++) {
            __syncthreads(); /* the previous use of KV and of the row pointers is over */
            if (tid < nkeys) {
                /* one division per key, not per element */
                rowp[tid] = kv_row(a.g, kb + tid, ofs_k[which], a.g.krow);
                if (a.g.i8)
                    sclp[tid] = (const float *)kv_row(a.g, kb + tid, ofs_s[which], a.g.srow) + g;
            }
            __syncthreads();
            for (uint32_t kk = w; kk < AT_BK; kk += 4) {
                const uint8_t *row = kk < nkeys ? rowp[kk] : NULL;
                float sc = row && a.g.i8 ? *sclp[kk] : 0.0f;
                for (uint32_t d = lane; d < hd4; d += 32) {
                    float kv = 0.0f;
                    if (row && d < hd)
                        kv = a.g.i8 ? (float)((const int8_t *)row)[(size_t)g * hd + d] * sc
                                    : __half2float(((const __half *)row)[(size_t)g * hd + d]);
                    KV[kk * HS + d] = kv;
                }
            }
            __syncthreads();
            if (which == 0) {
                const float4 *k4 = (const float4 *)(KV + lane * HS);
                for (uint32_t d4 = 0; d4 < hd4 / 4; d4++) {
                    float4 kd = k4[d4];
#pragma unroll
                    for (int i = 0; i < NI; i++) {
                        float4 q = ((const float4 *)(Qs + (w + 4 * i) * HS))[d4];
                        s[i] = fmaf(q.x, kd.x, s[i]);
                        s[i] = fmaf(q.y, kd.y, s[i]);
                        s[i] = fmaf(q.z, kd.z, s[i]);
                        s[i] = fmaf(q.w, kd.w, s[i]);
                    }
                }
            }
        }
        /* KV now holds V; the online softmax of this tile, row by row */
        uint64_t j = kb + lane;
#pragma unroll
        for (int i = 0; i < NI; i++) {
            float sv = (lane < nkeys && j < klim[i]) ? s[i] * a.scale : -INFINITY;
            float mn = fmaxf(mrow[i], st_warp_max(sv));
            float pr = sv == -INFINITY ? 0.0f : expf(sv - mn);
            float al = mrow[i] == -INFINITY ? 0.0f : expf(mrow[i] - mn);
            lrow[i] = lrow[i] * al + st_warp_sum(pr);
            mrow[i] = mn;
            s[i] = pr;
#pragma unroll
            for (int c = 0; c < AT_MAXC; c++)
                acc[i][c] *= al;
        }
        for (uint32_t kk = 0; kk < nkeys; kk++) {
            float pv[NI];
#pragma unroll
            for (int i = 0; i < NI; i++)
                pv[i] = __shfl_sync(FULL, s[i], kk);
#pragma unroll
            for (int c = 0; c < AT_MAXC; c++) {
                uint32_t d = lane + 32 * c;
                float vv = d < hd ? KV[kk * HS + d] : 0.0f;
#pragma unroll
                for (int i = 0; i < NI; i++)
                    acc[i][c] = fmaf(pv[i], vv, acc[i][c]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < NI; i++) {
        uint32_t r = r0 + w + 4 * i;
        if (r >= nrows)
            continue;
        if (a.nsplit == 1) {
            uint32_t t = r / a.G, qh = g * a.G + r % a.G;
            float inv = lrow[i] > 0.0f ? 1.0f / lrow[i] : 0.0f;
            bf16 *orow = a.out + (size_t)t * a.qa + (size_t)qh * hd;
#pragma unroll
            for (int c = 0; c < AT_MAXC; c++) {
                uint32_t d = lane + 32 * c;
                if (d < hd)
                    orow[d] = __float2bfloat16_rn(acc[i][c] * inv);
            }
        } else {
            size_t pr = ((size_t)split * a.nkv + g) * nrows + r;
#pragma unroll
            for (int c = 0; c < AT_MAXC; c++) {
                uint32_t d = lane + 32 * c;
                if (d < hd)
                    a.po[pr * hd + d] = acc[i][c];
            }
            if (lane == 0) {
                a.pm[pr] = mrow[i];
                a.pl[pr] = lrow[i];
            }
        }
    }
}

/* Merge the splits of one row (grid (rows, n_head_kv)), in split order. */
__global__ void k_attn_comb(attn_args a)
{
    extern __shared__ float wt[]; /* [nsplit] */
    __shared__ float tot;
    uint32_t r = blockIdx.x, g = blockIdx.y, nrows = a.T * a.G;
    if (threadIdx.x == 0) {
        float mx = -INFINITY;
        for (uint32_t s = 0; s < a.nsplit; s++)
            mx = fmaxf(mx, a.pm[((size_t)s * a.nkv + g) * nrows + r]);
        float l = 0.0f;
        for (uint32_t s = 0; s < a.nsplit; s++) {
            size_t pr = ((size_t)s * a.nkv + g) * nrows + r;
            float m = a.pm[pr];
            wt[s] = m == -INFINITY ? 0.0f : expf(m - mx);
            l += a.pl[pr] * wt[s];
        }
        tot = l > 0.0f ? 1.0f / l : 0.0f;
    }
    __syncthreads();
    uint32_t t = r / a.G, qh = g * a.G + r % a.G;
    bf16 *orow = a.out + (size_t)t * a.qa + (size_t)qh * a.hd;
    for (uint32_t d = threadIdx.x; d < a.hd; d += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t s = 0; s < a.nsplit; s++)
            acc = fmaf(a.po[(((size_t)s * a.nkv + g) * nrows + r) * a.hd + d], wt[s], acc);
        orow[d] = __float2bfloat16_rn(acc * tot);
    }
}

/* Feed-forward per token (grid (T, blocks)): y = bf16(silu(gate) * up). */
__global__ void k_swiglu(const float *mix, uint32_t F, bf16 *y)
{
    uint32_t t = blockIdx.x, i = blockIdx.y * blockDim.x + threadIdx.x;
    if (i >= F)
        return;
    float gt = mix[(size_t)t * 2 * F + i], up = mix[(size_t)t * 2 * F + F + i];
    y[(size_t)t * F + i] = __float2bfloat16_rn(silu_f(gt) * up);
}

/* Rows [row0, row0 + gridDim.x) of one K/V tensor between the pages and a contiguous buffer. */
__global__ void k_kv_copy(uint8_t *const *pages, uint64_t off, uint32_t ps, uint32_t rb,
                          uint64_t row0, uint8_t *buf, int to_pages)
{
    uint64_t r = row0 + blockIdx.x;
    uint8_t *pr = pages[r / ps] + off + (r % ps) * rb;
    uint8_t *br = buf + (size_t)blockIdx.x * rb;
    if (rb % 16 == 0) {
        uint4 *x = (uint4 *)pr, *y = (uint4 *)br;
        for (uint32_t i = threadIdx.x; i < rb / 16; i += blockDim.x) {
            if (to_pages)
                x[i] = y[i];
            else
                y[i] = x[i];
        }
    } else if (rb % 4 == 0) {
        uint32_t *x = (uint32_t *)pr, *y = (uint32_t *)br;
        for (uint32_t i = threadIdx.x; i < rb / 4; i += blockDim.x) {
            if (to_pages)
                x[i] = y[i];
            else
                y[i] = x[i];
        }
    } else {
        for (uint32_t i = threadIdx.x; i < rb; i += blockDim.x) {
            if (to_pages)
                pr[i] = br[i];
            else
                br[i] = pr[i];
        }
    }
}

static uint64_t align_up(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

/* ---- create / destroy -------------------------------------------------------------------- */
/* The cache's figures, copied where st_engine_wcache_get reads them (any thread). */
static void wcache_publish(cu_ctx *c)
{
    if (!c->wc_mu_ok)
        return;
    pthread_mutex_lock(&c->wc_mu);
    st_engine_wcache *o = &c->wc_pub;
    o->fp16 = c->fp16;
    o->cache = c->wc.cap != 0;
    o->arena_bytes = c->wc.cap;
    o->used_bytes = c->wc.used;
    o->entries = c->wc.n;
    o->hits = c->wc.hits;
    o->misses = c->wc.misses;
    o->bypassed = c->wc.bypassed;
    o->invalidations = c->wc.invalidations;
    o->device_bytes = c->device_bytes;
    pthread_mutex_unlock(&c->wc_mu);
}

static void ops_release(cu_ctx *c);

static void cu_destroy(void *bctx)
{
    cu_ctx *c = (cu_ctx *)bctx;
    if (!c)
        return;
    if (c->stream)
        cu_release(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    ops_release(c);
    if (c->xs2)
        cu_release(cudaStreamSynchronize(c->xs2), "cudaStreamSynchronize");
    if (c->hs)
        cu_release(cudaStreamSynchronize(c->hs), "cudaStreamSynchronize");
    for (uint32_t i = 0; i < c->n_free_pages; i++)
        cu_release(cudaFree(c->free_pages[i]), "cudaFree (K/V page)");
    for (uint32_t i = 0; i < c->n_free_run; i++)
        cu_release(cudaFree(c->free_run[i]), "cudaFree (running state)");
    free(c->free_pages);
    free(c->free_run);
    if (c->wc.cap)
        fprintf(stderr, "strata: cuda backend: weight-conversion arena: %u entries, %.1f of %.1f "
                "MiB, %llu hits, %llu misses, %llu converted per call, %llu invalidations\n",
                c->wc.n, (double)c->wc.used / 1048576.0, (double)c->wc.cap / 1048576.0,
                (unsigned long long)c->wc.hits, (unsigned long long)c->wc.misses,
                (unsigned long long)c->wc.bypassed, (unsigned long long)c->wc.invalidations);
    st_wcache_release(&c->wc);
    if (c->wc_mu_ok)
        pthread_mutex_destroy(&c->wc_mu);
    void *dev[] = {c->wbuf, c->x, c->out, c->mix, c->qkvc, c->ab, c->o, c->logits_d, c->xnb,
                   c->gin, c->tok_d, c->att_po, c->att_pm, c->att_pl, c->blas_ws, c->wtmp,
                   c->xh, c->arena};
    for (size_t i = 0; i < sizeof dev / sizeof dev[0]; i++)
        if (dev[i])
            cu_release(cudaFree(dev[i]), "cudaFree");
    for (int i = 0; i < NSTAGE; i++) {
        if (c->dstage[i])
            cu_release(cudaFree(c->dstage[i]), "cudaFree (staging)");
        if (c->hstage[i])
            cu_release(cudaFreeHost(c->hstage[i]), "cudaFreeHost (staging)");
        if (c->ev[i])
            cu_release(cudaEventDestroy(c->ev[i]), "cudaEventDestroy");
    }
    void *hdev[] = {c->hsrc_d, c->hjob_d, c->hdg_d}, *hhost[] = {c->hsrc_h, c->hjob_h, c->hdg_h};
    for (size_t i = 0; i < 3; i++) {
        if (hdev[i])
            cu_release(cudaFree(hdev[i]), "cudaFree (state hash)");
        if (hhost[i])
            cu_release(cudaFreeHost(hhost[i]), "cudaFreeHost (state hash)");
    }
    cudaEvent_t evs[] = {c->ev_go, c->ev_go2, c->ev_h, c->ev_t0, c->ev_t1};
    for (size_t i = 0; i < 5; i++)
        if (evs[i])
            cu_release(cudaEventDestroy(evs[i]), "cudaEventDestroy");
    if (c->xs2)
        cu_release(cudaStreamDestroy(c->xs2), "cudaStreamDestroy");
    if (c->hs)
        cu_release(cudaStreamDestroy(c->hs), "cudaStreamDestroy");
    if (c->tok_h)
        cu_release(cudaFreeHost(c->tok_h), "cudaFreeHost");
    if (c->logits_h)
        cu_release(cudaFreeHost(c->logits_h), "cudaFreeHost");
    if (c->blas) {
        cublasStatus_t st = cublasDestroy(c->blas);
        if (st != CUBLAS_STATUS_SUCCESS)
            blas_fail(st, "cublasDestroy");
    }
    if (c->stream)
        cu_release(cudaStreamDestroy(c->stream), "cudaStreamDestroy");
    free(c->hjob_at);
    free(c->L);
    free(c->descs);
    free(c->tm);
    free(c->run_off);
    free(c->run_len);
    free(c);
}

/* Bump layout of the weights in one device buffer (base NULL: only measure). */
typedef struct bump {
    uint8_t *base;
    size_t off;
} bump;

static void *bump_take(bump *b, size_t bytes)
{
    size_t o = (size_t)align_up(b->off, 256);
    b->off = o + bytes;
    return b->base ? (void *)(b->base + o) : NULL;
}

static void layout_weights(cu_ctx *c, bump *b)
{
    size_t E = c->E, F = c->F, V = c->V;
    c->tok_embd = (float *)bump_take(b, V * E * 4);
    c->w_head = (bf16 *)bump_take(b, V * E * 2);
    c->out_norm = (float *)bump_take(b, E * 4);
    c->rope_freq = (double *)bump_take(b, (c->hd / 2 + 1) * sizeof(double));
    for (uint32_t il = 0; il < c->hp->n_layer; il++) {
        cu_layer *L = &c->L[il];
        L->attn_norm = (float *)bump_take(b, E * 4);
        L->ffn_norm = (float *)bump_take(b, E * 4);
        L->w_ffn_in = (bf16 *)bump_take(b, 2 * F * E * 2);
        L->w_ffn_down = (bf16 *)bump_take(b, E * F * 2);
        if (L->kind == 'D') {
            L->in_rows = c->C + c->hdv + 2 * c->H;
            L->out_cols = c->hdv;
            L->conv_w = (float *)bump_take(b, (size_t)c->C * 4 * 4);
            L->a_log = (float *)bump_take(b, (size_t)c->H * 4);
            L->dt_bias = (float *)bump_take(b, (size_t)c->H * 4);
            L->ssm_norm = (float *)bump_take(b, (size_t)c->dv * 4);
        } else {
            L->in_rows = c->qa + 2 * c->kva;
            L->out_cols = c->qa;
        }
        L->w_in = (bf16 *)bump_take(b, (size_t)L->in_rows * E * 2);
        L->w_out = (bf16 *)bump_take(b, E * L->out_cols * 2);
    }
}

static uint64_t wmat_bytes(const st_wmat *w)
{
    return (uint64_t)w->rows * w->cols * (w->type == ST_GGML_F32 ? 4 : 2);
}

/* Upload weight matrix w (expected rows x cols) into dst in codec dst_codec (bf16, or fp32 for
 * the embedding), through tmp, converting on the device with the codec kernels. Every copy is
 * queued on the backend's stream: a cudaMemcpy from pageable memory may return before its DMA
 * lands, and the stream (non-blocking) would not wait for it. */
static int upload_mat(cu_ctx *c, const st_wmat *w, uint32_t rows, uint32_t cols, void *dst,
                      uint32_t dst_codec, void *tmp, const char *name)
{
    uint32_t codec;
    switch (w->type) {
    case ST_GGML_F32: codec = ST_CODEC_FP32; break;
    case ST_GGML_F16: codec = ST_CODEC_F16; break;
    case ST_GGML_BF16: codec = ST_CODEC_BF16; break;
    default:
        return st_error_set(ST_EINVAL, "cuda backend: weight %s: ggml type %u", name, w->type);
    }
    if (w->rows != rows || w->cols != cols || (w->stride && w->stride != w->cols))
        return st_error_set(ST_EINVAL, "cuda backend: weight %s is %u x %u (stride %u), expected "
                            "%u x %u", name, w->rows, w->cols, w->stride, rows, cols);
    CU(cudaMemcpyAsync(tmp, w->data, wmat_bytes(w), cudaMemcpyHostToDevice, c->stream));
    int rc = st_codec_cuda_convert(dst_codec, dst, codec, tmp, (size_t)rows * cols, c->stream);
    if (!rc)
        rc = st_codec_cuda_sync(c->stream);
    return rc;
}

static int upload_f32(cu_ctx *c, void *dst, const float *src, size_t n)
{
    CU(cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, c->stream));
    CU(cudaStreamSynchronize(c->stream));
    return 0;
}

static int upload_weights(cu_ctx *c)
{
    const st_model *m = c->m;
    uint32_t E = c->E, F = c->F, H = c->H;
    void *tmp = NULL;
    int rc = 0;
    uint64_t maxb = wmat_bytes(&m->tok_embd);
    if (wmat_bytes(&m->output) > maxb)
        maxb = wmat_bytes(&m->output);
    for (uint32_t il = 0; il < c->hp->n_layer; il++) {
        const st_layer *l = &m->layers[il];
        const st_wmat *all[] = {&l->wq, &l->wk, &l->wv, &l->wo, &l->sq, &l->sk, &l->sv,
                                &l->sgate, &l->sout, &l->salpha, &l->sbeta, &l->ffn_gate,
                                &l->ffn_up, &l->ffn_down};
        for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
            if (all[i]->data && wmat_bytes(all[i]) > maxb)
                maxb = wmat_bytes(all[i]);
    }
    CUG(cudaMalloc(&tmp, maxb));
    if ((rc = upload_mat(c, &m->tok_embd, c->V, E, c->tok_embd, ST_CODEC_FP32, tmp,
                         "token_embd")) ||
        (rc = upload_mat(c, &m->output, c->V, E, c->w_head, ST_CODEC_BF16, tmp, "output")) ||
        (rc = upload_f32(c, c->out_norm, m->output_norm, E)))
        goto fail;
    {
        double *freq = (double *)calloc(c->hd / 2 + 1, sizeof *freq);
        if (!freq) {
            rc = st_error_set(ENOMEM, "cuda backend: rope");
            goto fail;
        }
        for (uint32_t i = 0; i < c->hd / 2; i++)
            freq[i] = pow((double)c->hp->rope_base, -(double)(2 * i) / (double)c->hd);
        cudaError_t ce = cudaMemcpyAsync(c->rope_freq, freq, (c->hd / 2 + 1) * sizeof *freq,
                                         cudaMemcpyHostToDevice, c->stream);
        if (ce == cudaSuccess)
            ce = cudaStreamSynchronize(c->stream);
        free(freq);
        if (ce != cudaSuccess) {
            rc = cu_fail(ce, "cudaMemcpy (rope)");
            goto fail;
        }
    }
    for (uint32_t il = 0; il < c->hp->n_layer && !rc; il++) {
        const st_layer *l = &m->layers[il];
        cu_layer *L = &c->L[il];
        char nm[64];
        snprintf(nm, sizeof nm, "blk.%u", il);
        if ((rc = upload_f32(c, L->attn_norm, l->attn_norm, E)) ||
            (rc = upload_f32(c, L->ffn_norm, l->ffn_norm, E)) ||
            (rc = upload_mat(c, &l->ffn_gate, F, E, L->w_ffn_in, ST_CODEC_BF16, tmp, nm)) ||
            (rc = upload_mat(c, &l->ffn_up, F, E, L->w_ffn_in + (size_t)F * E, ST_CODEC_BF16, tmp,
                             nm)) ||
            (rc = upload_mat(c, &l->ffn_down, E, F, L->w_ffn_down, ST_CODEC_BF16, tmp, nm)))
            break;
        if (L->kind == 'D') {
            uint32_t hdk = H * c->dk;
            size_t r0[6] = {0, hdk, 2 * (size_t)hdk, c->C, (size_t)c->C + c->hdv,
                            (size_t)c->C + c->hdv + H};
            const st_wmat *in[6] = {&l->sq, &l->sk, &l->sv, &l->sgate, &l->salpha, &l->sbeta};
            uint32_t rows[6] = {hdk, hdk, c->hdv, c->hdv, H, H};
            for (int i = 0; i < 6 && !rc; i++)
                rc = upload_mat(c, in[i], rows[i], E, L->w_in + r0[i] * E, ST_CODEC_BF16, tmp, nm);
            if (rc || (rc = upload_mat(c, &l->sout, E, c->hdv, L->w_out, ST_CODEC_BF16, tmp, nm)) ||
                (rc = upload_f32(c, L->conv_w, l->conv_w, (size_t)c->C * 4)) ||
                (rc = upload_f32(c, L->a_log, l->a_log, H)) ||
                (rc = upload_f32(c, L->dt_bias, l->dt_bias, H)) ||
                (rc = upload_f32(c, L->ssm_norm, l->ssm_norm, c->dv)))
                break;
        } else {
            if ((rc = upload_mat(c, &l->wq, c->qa, E, L->w_in, ST_CODEC_BF16, tmp, nm)) ||
                (rc = upload_mat(c, &l->wk, c->kva, E, L->w_in + (size_t)c->qa * E, ST_CODEC_BF16,
                                 tmp, nm)) ||
                (rc = upload_mat(c, &l->wv, c->kva, E, L->w_in + (size_t)(c->qa + c->kva) * E,
                                 ST_CODEC_BF16, tmp, nm)) ||
                (rc = upload_mat(c, &l->wo, E, c->qa, L->w_out, ST_CODEC_BF16, tmp, nm)))
                break;
        }
    }
fail:
    if (tmp)
        cu_release(cudaFree(tmp), "cudaFree (upload)");
    return rc;
}

/* ---- the operation-table path (invariant 8) ---------------------------------------------------- */
/* Whether strata-hybrid's own forward pass applies: that architecture, every tensor f32 / f16 /
 * bf16. */
static int hybrid_native(const st_model *m)
{
    if (m->arch != &st_arch_hybrid)
        return 0;
    const st_gguf *g = st_model_gguf(m);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        uint32_t t = st_gguf_tensor_at(g, i)->type;
        if (t != ST_GGML_F32 && t != ST_GGML_F16 && t != ST_GGML_BF16)
            return 0;
    }
    return 1;
}

/* The device copy of host bytes src (uploaded once: a tied head shares the embedding's). */
static int dcopy(cu_ctx *c, const void *src, uint64_t bytes, void **out)
{
    for (uint32_t i = 0; i < c->n_dcopy; i++)
        if (c->dsrc[i] == src) {
            *out = c->ddst[i];
            return 0;
        }
    if (c->n_dcopy == c->cap_dcopy) {
        uint32_t nc = c->cap_dcopy ? 2 * c->cap_dcopy : 64;
        const void **ns = (const void **)realloc(c->dsrc, nc * sizeof *ns);
        if (ns)
            c->dsrc = ns;
        void **nd = (void **)realloc(c->ddst, nc * sizeof *nd);
        if (nd)
            c->ddst = nd;
        if (!ns || !nd)
            return st_error_set(ENOMEM, "cuda backend: the model's tensors");
        c->cap_dcopy = nc;
    }
    void *d = NULL;
    CU(cudaMalloc(&d, bytes ? bytes : 1));
    c->dsrc[c->n_dcopy] = src;
    c->ddst[c->n_dcopy++] = d;
    /* on the backend's stream, waited for: a copy from pageable memory may return before its
     * bytes are in place, and the forward pass runs on this stream, not the default one */
    CU(cudaMemcpyAsync(d, src, bytes, cudaMemcpyHostToDevice, c->stream));
    CU(cudaStreamSynchronize(c->stream));
    *out = d;
    return 0;
}

static int dmat(cu_ctx *c, st_wmat *w)
{
    if (!w->data)
        return 0;
    if (!st_cuda_dequant_supported(w->type))
        return st_error_set(ST_EINVAL, "cuda backend: weight type %s has no GPU kernel",
                            st_gguf_type_name(w->type));
    void *d;
    int rc = dcopy(c, w->data, (uint64_t)w->rows * st_wmat_row_bytes(w), &d);
    if (!rc)
        w->data = d;
    return rc;
}

static int dvec(cu_ctx *c, float **v, uint64_t n)
{
    if (!*v)
        return 0;
    void *d;
    int rc = dcopy(c, *v, n * sizeof(float), &d);
    if (!rc)
        *v = (float *)d;
    return rc;
}

/* The model with every weight and vector at a device address. The lists below name every
 * st_wmat and float * of st_layer: a field added there must be added here (the size check). */
#define ST_LAYER_SIZE_CHECKED 688 /* x86-64: 25 st_wmat, 10 float *, kind */
static_assert(sizeof(st_layer) == ST_LAYER_SIZE_CHECKED,
              "st_layer changed: list its new fields in ops_upload_model");
static int ops_upload_model(cu_ctx *c)
{
    const st_model *m = c->m;
    const st_model_hparams *hp = &m->hp;
    uint64_t E = hp->n_embd;
    int rc = 0;
    c->dm = *m;
    c->dlayers = (st_layer *)calloc(hp->n_layer ? hp->n_layer : 1, sizeof *c->dlayers);
    if (!c->dlayers)
        return st_error_set(ENOMEM, "cuda backend: the model's layers");
    memcpy(c->dlayers, m->layers, (size_t)hp->n_layer * sizeof *c->dlayers);
    c->dm.layers = c->dlayers;
    if ((rc = dmat(c, &c->dm.tok_embd)) || (rc = dmat(c, &c->dm.output)) ||
        (rc = dvec(c, &c->dm.output_norm, E)) ||
        (rc = dvec(c, &c->dm.rope_freqs, hp->head_dim / 2)))
        return rc;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        st_layer *L = &c->dlayers[il];
        const st_mem_layer *ml = &m->mem.layer[il];
        st_wmat *mats[] = {&L->wq, &L->wk, &L->wv, &L->wo, &L->sq, &L->sk, &L->sv, &L->sgate,
                           &L->sout, &L->salpha, &L->sbeta, &L->ffn_gate, &L->ffn_up,
                           &L->ffn_down, &L->sqkv, &L->sba, &L->sin, &L->moe_router,
                           &L->moe_gate, &L->moe_up, &L->moe_down, &L->sh_gate, &L->sh_up,
                           &L->sh_down, &L->sh_router};
        for (size_t i = 0; i < sizeof mats / sizeof mats[0]; i++) {
            if (c->host_experts &&
                (mats[i] == &L->moe_gate || mats[i] == &L->moe_up || mats[i] == &L->moe_down)) {
                if (mats[i]->data && !st_cuda_dequant_supported(mats[i]->type))
                    return st_error_set(ST_EINVAL, "cuda backend: layer %u: weight type %s has "
                                        "no GPU kernel", il, st_gguf_type_name(mats[i]->type));
                continue; /* the routed-expert cache uploads them (st_xcache_cuda.cu) */
            }
            if ((rc = dmat(c, mats[i])))
                return st_error_wrap(rc, "layer %u", il);
        }
        uint64_t conv = (uint64_t)hp->ssm_conv * ml->conv_ch;
        struct {
            float **v;
            uint64_t n;
        } vecs[] = {{&L->attn_norm, E},       {&L->ffn_norm, E},
                    {&L->q_norm, hp->head_dim}, {&L->k_norm, hp->head_dim},
                    {&L->conv_w, conv},       {&L->conv_wT, conv},
                    {&L->a_log, ml->ssm_heads}, {&L->ssm_a, ml->ssm_heads},
                    {&L->dt_bias, ml->ssm_heads}, {&L->ssm_norm, ml->ssm_dv}};
        for (size_t i = 0; i < sizeof vecs / sizeof vecs[0]; i++)
            if ((rc = dvec(c, vecs[i].v, vecs[i].n)))
                return st_error_wrap(rc, "layer %u", il);
    }
    return 0;
}

/* What the operation table needs of this model and of a state's layout. */
static int ops_setup(cu_ctx *c)
{
    const st_model *m = c->m;
    const st_model_hparams *hp = &m->hp;
    int rc;
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const st_mem_layer *ml = &m->mem.layer[il];
        if (ml->kind == ST_MEM_KV && (ml->kv_heads != c->nkv || ml->head_dim != c->hd))
            return st_error_set(ST_EINVAL, "cuda backend: layer %u keeps K/V of %u x %u, the "
                                "model's are %u x %u", il, ml->kv_heads, ml->head_dim, c->nkv,
                                c->hd);
        if (ml->kind == ST_MEM_REC &&
            (hp->ssm_conv != ST_CUDA_CONV_KERNEL || ml->ssm_dv > ST_CUDA_MAX_SSM_DV))
            return st_error_set(ST_EINVAL, "cuda backend: layer %u: a convolution kernel of %u "
                                "(%u), DeltaNet value width %u (at most %u)", il, hp->ssm_conv,
                                ST_CUDA_CONV_KERNEL, ml->ssm_dv, ST_CUDA_MAX_SSM_DV);
    }
    if (c->kv_dtype != ST_DTYPE_F16 && c->kv_dtype != ST_DTYPE_I8)
        return st_error_set(ST_EINVAL, "cuda backend: K/V dtype %u (f16 or i8)", c->kv_dtype);
    uint32_t nrec = m->mem.n_rec ? m->mem.n_rec : 1;
    c->rec_ssm = (uint64_t *)calloc(nrec, sizeof *c->rec_ssm);
    c->rec_conv = (uint64_t *)calloc(nrec, sizeof *c->rec_conv);
    if (!c->rec_ssm || !c->rec_conv)
        return st_error_set(ENOMEM, "cuda backend");
    for (uint32_t ti = 0; ti < c->n_desc; ti++) {
        if (c->tm[ti].what == ST_SW_SSM)
            c->rec_ssm[c->tm[ti].slot] = c->run_off[ti];
        else if (c->tm[ti].what == ST_SW_CONV)
            c->rec_conv[c->tm[ti].slot] = c->run_off[ti];
    }
    c->host_experts = c->e->o.expert_cache_bytes && hp->n_expert;
    if ((rc = ops_upload_model(c)) ||
        (c->host_experts &&
         (rc = st_xdev_new(m, c->e->o.expert_cache_bytes, c->stream, c->e->pool, &c->xdev))) ||
        (rc = st_ops_cuda_new(c->stream, c->T, c->n_ctx, c->n_attn ? c->hd : 1, &c->oc)) ||
        (rc = m->arch->fwd_new(m, st_ops_cuda_get(c->oc), c->oc, c->T, &c->ws)) ||
        (rc = st_ops_cuda_error(c->oc))) /* a failed upload of the workspace's tables */
        return rc;
    CU(cudaMalloc((void **)&c->logits_d, (size_t)c->V * 4));
    CU(cudaHostAlloc((void **)&c->logits_h, (size_t)c->V * 4, cudaHostAllocDefault));
    const char *gv = getenv("STRATA_CUDA_GRAPHS");
    /* a profiled table waits inside every operation, which a capture cannot hold */
    c->graphs = gv && !strcmp(gv, "1") && !hp->n_expert &&
                st_ops_cuda_get(c->oc) == &st_ops_cuda_table;
    if (gv && *gv && strcmp(gv, "0") && strcmp(gv, "1"))
        fprintf(stderr, "strata: cuda backend: STRATA_CUDA_GRAPHS=%s: 0 or 1; graphs stay off\n",
                gv);
    return 0;
}

/* Replay graph g of a decode step: the previous step's executable graph updated to it, or a new
 * one where the update is refused. */
static int graph_run(cu_ctx *c, cudaGraph_t g)
{
    if (c->gexec) {
        cudaGraphExecUpdateResultInfo info;
        if (cudaGraphExecUpdate(c->gexec, g, &info) == cudaSuccess) {
            c->g_upd++;
        } else {
            cudaGetLastError();
            cu_release(cudaGraphExecDestroy(c->gexec), "cudaGraphExecDestroy");
            c->gexec = NULL;
        }
    }
    if (!c->gexec) {
        cudaError_t e = cudaGraphInstantiate(&c->gexec, g, 0);
        if (e != cudaSuccess) {
            c->gexec = NULL;
            return cu_fail(e, "cudaGraphInstantiate");
        }
        c->g_inst++;
    }
    CU(cudaGraphLaunch(c->gexec, c->stream));
    return 0;
}

typedef struct ops_mem {
    cu_ctx *c;
    cu_state *s;
} ops_mem;

static void ops_kv_view(void *mp, uint32_t slot, st_kv_view *v)
{
    ops_mem *om = (ops_mem *)mp;
    cu_ctx *c = om->c;
    memset(v, 0, sizeof *v);
    v->page_size = c->ps;
    v->dtype = c->kv_dtype;
    v->kv_heads = c->nkv;
    v->head_dim = c->hd;
    v->row = c->krow;
    v->srow = c->srow;
    v->blocks = om->s->pages_d;
    v->off_k = (uint64_t)slot * c->per_layer;
    v->off_v = v->off_k + c->off_v;
    v->off_ks = v->off_k + c->off_ks;
    v->off_vs = v->off_k + c->off_vs;
}

static float *ops_rec(void *mp, uint32_t slot, int conv)
{
    ops_mem *om = (ops_mem *)mp;
    return (float *)(om->s->run + (conv ? om->c->rec_conv[slot] : om->c->rec_ssm[slot]));
}

static int ops_experts(void *mp, uint32_t il, const uint32_t *experts, uint32_t n,
                       st_wmat *views)
{
    return st_xdev_experts(((ops_mem *)mp)->c->xdev, il, experts, n, views);
}

static void ops_release(cu_ctx *c)
{
    if (c->gexec)
        cu_release(cudaGraphExecDestroy(c->gexec), "cudaGraphExecDestroy");
    c->gexec = NULL;
    if (c->trace && c->ops)
        fprintf(stderr, "strata: cuda backend: decode graphs: %llu instantiated, %llu updated, "
                "%llu replays\n", (unsigned long long)c->g_inst, (unsigned long long)c->g_upd,
                (unsigned long long)c->g_replay);
    st_xdev_free(c->xdev); /* waits for its copies and the products that read them */
    c->xdev = NULL;
    if (c->ws)
        c->m->arch->fwd_free(c->ws);
    c->ws = NULL;
    st_ops_cuda_free(c->oc);
    c->oc = NULL;
    for (uint32_t i = 0; i < c->n_dcopy; i++)
        cu_release(cudaFree(c->ddst[i]), "cudaFree (model)");
    free(c->dsrc);
    free(c->ddst);
    free(c->dlayers);
    free(c->rec_ssm);
    free(c->rec_conv);
}

static int cu_create(st_engine *e, void **out)
{
    *out = NULL;
    const st_model_hparams *hp = &e->m->hp;
    int rc = 0, ndev = 0, dev = 0, cc_major = 0, cc_minor = 0;
    size_t free0 = 0, total0 = 0, free1 = 0, total1 = 0;
    st_wcache_cfg wcfg;
    char wdiag[512];
    /* strata-hybrid on f32 / f16 / bf16 weights runs this file's forward pass; every other
     * model the architecture's own on the operation table (invariant 8) */
    if ((rc = st_engine_cuda_check(st_model_gguf(e->m))))
        return rc;
    cu_ctx *c = (cu_ctx *)calloc(1, sizeof *c);
    if (!c)
        return st_error_set(ENOMEM, "cuda backend");
    c->e = e;
    c->m = e->m;
    c->hp = hp;
    if (pthread_mutex_init(&c->wc_mu, NULL) == 0)
        c->wc_mu_ok = 1;
    c->T = e->o.ubatch;
    c->n_ctx = e->o.n_ctx;
    c->ps = e->o.page_size;
    c->n_pages = (c->n_ctx + c->ps - 1) / c->ps;
    c->kv_dtype = e->o.kv_dtype;
    c->n_threads = st_pool_size(e->pool);
    c->E = hp->n_embd;
    c->F = hp->n_ff;
    c->V = hp->n_vocab;
    c->H = hp->ssm_heads;
    c->dk = hp->ssm_dk;
    c->dv = hp->ssm_dv;
    c->C = c->H * (2 * c->dk + c->dv);
    c->hdv = c->H * c->dv;
    c->nh = hp->n_head;
    c->nkv = hp->n_head_kv;
    c->hd = hp->head_dim;
    c->qa = c->nh * c->hd;
    c->kva = c->nkv * c->hd;
    c->ops = !hybrid_native(e->m);
    if (!c->ops && (hp->ssm_conv != ST_CUDA_CONV_KERNEL || c->hd > ST_CUDA_MAX_HEAD_DIM ||
                    c->dk > ST_CUDA_HYBRID_MAX_SSM_DK || c->nkv == 0 || c->nh % c->nkv)) {
        rc = st_error_set(ST_EINVAL, "cuda backend: this model's shape is not supported (conv "
                          "kernel %u: %u; head_dim %u: <= %u; ssm dk %u: <= %u)", hp->ssm_conv,
                          ST_CUDA_CONV_KERNEL, c->hd, ST_CUDA_MAX_HEAD_DIM, c->dk,
                          ST_CUDA_HYBRID_MAX_SSM_DK);
        goto fail;
    }
    CUG(cudaGetDeviceCount(&ndev));
    if (ndev < 1) {
        rc = st_error_set(ST_EINVAL, "cuda backend: no CUDA device");
        goto fail;
    }
    CUG(cudaGetDevice(&dev));
    CUG(cudaDeviceGetAttribute(&c->n_sm, cudaDevAttrMultiProcessorCount, dev));
    CUG(cudaDeviceGetAttribute(&cc_major, cudaDevAttrComputeCapabilityMajor, dev));
    CUG(cudaDeviceGetAttribute(&cc_minor, cudaDevAttrComputeCapabilityMinor, dev));
    CUG(cudaMemGetInfo(&free0, &total0));
    CUG(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    {
        cublasStatus_t st = cublasCreate(&c->blas);
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasSetStream(c->blas, c->stream);
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasSetAtomicsMode(c->blas, CUBLAS_ATOMICS_NOT_ALLOWED);
        if (st == CUBLAS_STATUS_SUCCESS)
            st = cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH);
        if (st != CUBLAS_STATUS_SUCCESS) {
            rc = blas_fail(st, "cublas setup");
            goto fail;
        }
        CUG(cudaMalloc(&c->blas_ws, BLAS_WS_BYTES));
        st = cublasSetWorkspace(c->blas, c->blas_ws, BLAS_WS_BYTES);
        if (st != CUBLAS_STATUS_SUCCESS) {
            rc = blas_fail(st, "cublasSetWorkspace");
            goto fail;
        }
    }
    /* the geometry: the CPU backend's, in the same order */
    c->descs = (st_tensor_desc *)calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->descs);
    c->tm = (st_state_map *)calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->tm);
    c->run_off = (uint64_t *)calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->run_off);
    c->run_len = (uint64_t *)calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->run_len);
    c->L = (cu_layer *)calloc(hp->n_layer ? hp->n_layer : 1, sizeof *c->L);
    if (!c->descs || !c->tm || !c->run_off || !c->run_len || !c->L) {
        rc = st_error_set(ENOMEM, "cuda backend");
        goto fail;
    }
    {
        uint64_t esz = c->kv_dtype == ST_DTYPE_I8 ? 1 : 2;
        c->krow = (uint64_t)c->nkv * c->hd * esz;
        c->srow = (uint64_t)c->nkv * 4;
        c->n_desc = st_state_layout(&e->m->mem, c->n_ctx, c->kv_dtype, c->descs, c->tm);
        c->n_dn = e->m->mem.n_rec;
        c->n_attn = e->m->mem.n_kv;
        for (uint32_t il = 0; il < hp->n_layer; il++) {
            c->L[il].kind = e->m->layers[il].kind;
            c->L[il].slot = e->m->mem.layer[il].slot;
        }
        uint64_t off = 0;
        for (uint32_t ti = 0; ti < c->n_desc; ti++)
            if (c->tm[ti].what == ST_SW_SSM || c->tm[ti].what == ST_SW_CONV) {
                c->run_len[ti] = 4ull * st_tensor_elems(&c->descs[ti]);
                c->run_off[ti] = off;
                if (c->tm[ti].what == ST_SW_SSM)
                    c->L[c->tm[ti].layer].ssm_off = off;
                else
                    c->L[c->tm[ti].layer].conv_off = off;
                off = align_up(off + c->run_len[ti], 256);
            }
        c->run_bytes = off;
        c->table_off = off;
        c->state_bytes = align_up(off + (uint64_t)c->n_pages * sizeof(void *), 256);
        /* a page block: per attention layer K, V (and i8 scales) of ps rows, 16-byte aligned */
        c->off_v = align_up((uint64_t)c->ps * c->krow, 16);
        c->off_ks = c->off_v + align_up((uint64_t)c->ps * c->krow, 16);
        c->off_vs = c->off_ks + (c->kv_dtype == ST_DTYPE_I8 ? align_up((uint64_t)c->ps * c->srow, 16) : 0);
        c->per_layer = align_up(c->off_vs + (c->kv_dtype == ST_DTYPE_I8 ?
                                              align_up((uint64_t)c->ps * c->srow, 16) : 0), 256);
        c->page_bytes = c->per_layer * (c->n_attn ? c->n_attn : 1);
    }
    if (c->ops) {
        if ((rc = ops_setup(c)))
            goto fail;
    } else {
        /* weights */
        bump b = {NULL, 0};
        layout_weights(c, &b);
        CUG(cudaMalloc((void **)&c->wbuf, b.off));
        b.base = c->wbuf;
        b.off = 0;
        layout_weights(c, &b);
        if ((rc = upload_weights(c)))
            goto fail;
    }
    /* workspace for a chunk */
    if (!c->ops) {
        size_t T = c->T, E = c->E;
        uint32_t nmix = 2 * c->F, ngin = c->F;
        if (c->n_dn) {
            nmix = nmix > c->C + c->hdv + 2 * c->H ? nmix : c->C + c->hdv + 2 * c->H;
            ngin = ngin > c->hdv ? ngin : c->hdv;
        }
        if (c->n_attn) {
            nmix = nmix > c->qa + 2 * c->kva ? nmix : c->qa + 2 * c->kva;
            ngin = ngin > c->qa ? ngin : c->qa;
        }
        c->nmix = nmix;
        c->ngin = ngin;
        CUG(cudaMalloc((void **)&c->x, T * E * 4));
        CUG(cudaMalloc((void **)&c->out, T * E * 4));
        CUG(cudaMalloc((void **)&c->xnb, T * E * 2));
        CUG(cudaMalloc((void **)&c->gin, T * ngin * 2));
        CUG(cudaMalloc((void **)&c->mix, T * nmix * 4));
        CUG(cudaMalloc((void **)&c->qkvc, (c->n_dn ? T * c->C : 1) * 4));
        CUG(cudaMalloc((void **)&c->ab, (c->n_dn ? T * 2 * c->H : 1) * 4));
        CUG(cudaMalloc((void **)&c->o, (c->n_dn ? T * c->hdv : 1) * 4));
        CUG(cudaMalloc((void **)&c->logits_d, (size_t)c->V * 4));
        CUG(cudaMalloc((void **)&c->tok_d, T * 4));
        CUG(cudaHostAlloc((void **)&c->tok_h, T * 4, cudaHostAllocDefault));
        CUG(cudaHostAlloc((void **)&c->logits_h, (size_t)c->V * 4, cudaHostAllocDefault));
        c->att_cap_rows = 2ull * 2 * (uint64_t)c->n_sm * 32;
        CUG(cudaMalloc((void **)&c->att_po, c->att_cap_rows * c->hd * 4));
        CUG(cudaMalloc((void **)&c->att_pm, c->att_cap_rows * 4));
        CUG(cudaMalloc((void **)&c->att_pl, c->att_cap_rows * 4));
    }
    for (int i = 0; i < NSTAGE; i++) {
        CUG(cudaHostAlloc((void **)&c->hstage[i], STAGE_BYTES, cudaHostAllocDefault));
        CUG(cudaMalloc((void **)&c->dstage[i], STAGE_BYTES));
        CUG(cudaEventCreateWithFlags(&c->ev[i], cudaEventDisableTiming));
    }
    c->trace = getenv("STRATA_CUDA_TRACE") && *getenv("STRATA_CUDA_TRACE");
    if (c->trace) {
        CUG(cudaEventCreate(&c->ev_t0));
        CUG(cudaEventCreate(&c->ev_t1));
    }
    CUG(cudaStreamCreateWithFlags(&c->xs2, cudaStreamNonBlocking));
    CUG(cudaStreamCreateWithFlags(&c->hs, cudaStreamNonBlocking));
    CUG(cudaEventCreateWithFlags(&c->ev_go, cudaEventDisableTiming));
    CUG(cudaEventCreateWithFlags(&c->ev_go2, cudaEventDisableTiming));
    CUG(cudaEventCreateWithFlags(&c->ev_h, cudaEventDisableTiming));
    for (uint32_t ti = 0; ti < c->n_desc; ti++) {
        uint64_t b = c->descs[ti].role == ST_ROLE_KV
                         ? (uint64_t)c->n_ctx * st_tensor_row_bytes(&c->descs[ti])
                         : (c->run_len[ti] > 8 ? c->run_len[ti] : 8);
        c->hjob_cap += st_state_hash_blocks(b);
    }
    if (!(c->hjob_at = (uint32_t *)calloc((size_t)c->n_desc + 1, sizeof *c->hjob_at))) {
        rc = st_error_set(ENOMEM, "cuda backend: state hash");
        goto fail;
    }
    CUG(cudaHostAlloc((void **)&c->hsrc_h, (size_t)c->n_desc * sizeof *c->hsrc_h,
                      cudaHostAllocDefault));
    CUG(cudaMalloc((void **)&c->hsrc_d, (size_t)c->n_desc * sizeof *c->hsrc_d));
    CUG(cudaHostAlloc((void **)&c->hjob_h, (size_t)c->hjob_cap * sizeof *c->hjob_h,
                      cudaHostAllocDefault));
    CUG(cudaMalloc((void **)&c->hjob_d, (size_t)c->hjob_cap * sizeof *c->hjob_d));
    CUG(cudaHostAlloc((void **)&c->hdg_h, (size_t)c->hjob_cap * sizeof *c->hdg_h,
                      cudaHostAllocDefault));
    CUG(cudaMalloc((void **)&c->hdg_d, (size_t)c->hjob_cap * sizeof *c->hdg_d));
    /* the FP16 path for BF16 weights and its arena (invariant 7), priced before it is taken */
    st_wcache_from_env(&wcfg, wdiag, sizeof wdiag);
    if (wdiag[0])
        fprintf(stderr, "strata: cuda backend: %s\n", wdiag);
    c->fp16 = !c->ops && (wcfg.mode == 2 || (wcfg.mode == 1 && cc_major < 8));
    if (c->ops && wcfg.mode)
        fprintf(stderr, "strata: cuda backend: STRATA_BF16_TC=%d: the FP16 path is strata-hybrid's "
                "own on f32 / f16 / bf16 weights; %s runs on the operation table without it\n",
                wcfg.mode, e->m->arch->name);
    if (wcfg.mode == 1 && !c->fp16)
        fprintf(stderr, "strata: cuda backend: STRATA_BF16_TC=1: sm_%d%d computes BF16 natively; "
                "the native path is kept (2 forces the FP16 path)\n", cc_major, cc_minor);
    if (!c->fp16 && wcfg.cache && !c->ops)
        fprintf(stderr, "strata: cuda backend: STRATA_BF16_TC_CACHE=1 without the FP16 path: no "
                "arena is made\n");
    if (c->fp16) {
        uint64_t E = c->E, wm = (uint64_t)c->V * E;
        uint64_t sizes[] = {(uint64_t)2 * c->F * E, E * c->F,
                            c->n_dn ? (uint64_t)(c->C + c->hdv + 2 * c->H) * E : 0, E * c->hdv,
                            c->n_attn ? (uint64_t)(c->qa + 2 * c->kva) * E : 0, E * c->qa};
        for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++)
            wm = sizes[i] > wm ? sizes[i] : wm;
        c->wmax = wm;
        c->cmax = c->E;
        uint32_t w2[] = {c->F, c->hdv, c->qa};
        for (size_t i = 0; i < 3; i++)
            c->cmax = w2[i] > c->cmax ? w2[i] : c->cmax;
        CUG(cudaMalloc((void **)&c->wtmp, c->wmax * 2));
        CUG(cudaMalloc((void **)&c->xh, (size_t)c->T * c->cmax * 2));
        if (wcfg.cache) {
            uint64_t want = (uint64_t)wcfg.mib << 20;
            CUG(cudaMemGetInfo(&free1, &total1));
            /* keep room for the K/V pages and running state of one full context */
            uint64_t keep = (uint64_t)c->n_pages * c->page_bytes + c->state_bytes;
            if (want + keep > free1) {
                fprintf(stderr, "strata: cuda backend: the weight-conversion arena of %u MiB does "
                        "not fit (%llu MiB free after the weights and workspace, %llu MiB kept for "
                        "one context's state): the cache stays off\n", wcfg.mib,
                        (unsigned long long)(free1 >> 20), (unsigned long long)(keep >> 20));
            } else {
                CUG(cudaMalloc((void **)&c->arena, want));
                st_wcache_init(&c->wc, want);
            }
        }
    }
    {
        size_t asm8 = (size_t)(32 + AT_BK) * at_stride(c->hd) * 4;
        CUG(cudaFuncSetAttribute(k_attn<8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)asm8));
        CUG(cudaFuncSetAttribute(k_attn<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)asm8));
        CUG(cudaFuncSetAttribute(k_attn<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)asm8));
    }
    CUG(cudaMemGetInfo(&free1, &total1));
    c->device_bytes = free0 > free1 ? (uint64_t)(free0 - free1) : 0;
    if (c->fp16)
        fprintf(stderr, "strata: cuda backend: BF16 weights on FP16 tensor cores (STRATA_BF16_TC=%d), "
                "weight-conversion arena %s%llu MiB; device memory at creation %.1f MiB\n",
                wcfg.mode, c->wc.cap ? "" : "off, ", (unsigned long long)(c->wc.cap >> 20),
                (double)c->device_bytes / 1048576.0);
    wcache_publish(c);
    *out = c;
    return 0;
fail:
    cu_destroy(c);
    return rc;
}

static int cu_tensors(void *bctx, const st_tensor_desc **descs, uint32_t *n)
{
    cu_ctx *c = (cu_ctx *)bctx;
    *descs = c->descs;
    *n = c->n_desc;
    return 0;
}

/* ---- state ------------------------------------------------------------------------------- */
static int list_push(void ***list, uint32_t *n, uint32_t *cap, void *p)
{
    if (*n == *cap) {
        uint32_t nc = *cap ? *cap * 2 : 64;
        void **nl = (void **)realloc(*list, nc * sizeof *nl);
        if (!nl)
            return ENOMEM;
        *list = nl;
        *cap = nc;
    }
    (*list)[(*n)++] = p;
    return 0;
}

static void cu_state_free(void *bctx, void *stp)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    if (!s)
        return;
    if (s->pages)
        for (uint32_t p = 0; p < c->n_pages; p++)
            if (s->pages[p] &&
                list_push(&c->free_pages, &c->n_free_pages, &c->cap_free_pages, s->pages[p]))
                cu_release(cudaFree(s->pages[p]), "cudaFree (K/V page)");
    if (s->run && list_push(&c->free_run, &c->n_free_run, &c->cap_free_run, s->run))
        cu_release(cudaFree(s->run), "cudaFree (running state)");
    free(s->pages);
    free(s);
}

static int cu_state_new(void *bctx, void **out)
{
    cu_ctx *c = (cu_ctx *)bctx;
    *out = NULL;
    cu_state *s = (cu_state *)calloc(1, sizeof *s);
    if (!s)
        return st_error_set(ENOMEM, "cuda backend: slot state");
    s->pages = (uint8_t **)calloc(c->n_pages ? c->n_pages : 1, sizeof *s->pages);
    if (!s->pages) {
        cu_state_free(c, s);
        return st_error_set(ENOMEM, "cuda backend: slot state");
    }
    if (c->n_free_run) {
        s->run = (uint8_t *)c->free_run[--c->n_free_run];
    } else {
        cudaError_t ce = cudaMalloc((void **)&s->run, c->state_bytes);
        if (ce != cudaSuccess) {
            s->run = NULL;
            cu_state_free(c, s);
            return cu_fail(ce, "cudaMalloc (slot state)");
        }
    }
    s->pages_d = (uint8_t **)(s->run + c->table_off);
    s->table_dirty = 1;
    *out = s;
    return 0;
}

static void cu_state_reset(void *bctx, void *stp)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    s->pos = 0;
    cudaError_t ce = cudaMemsetAsync(s->run, 0, c->run_bytes, c->stream);
    if (ce == cudaSuccess)
        ce = cudaStreamSynchronize(c->stream);
    s->err = ce == cudaSuccess ? 0 : cu_fail(ce, "cudaMemsetAsync (reset)");
}

/* Pages covering rows [r0, r1) exist afterwards, and the device table is current. */
static int ensure_pages(cu_ctx *c, cu_state *s, uint64_t r0, uint64_t r1)
{
    if (r1 > r0)
        for (uint64_t p = r0 / c->ps; p <= (r1 - 1) / c->ps; p++) {
            if (s->pages[p])
                continue;
            if (c->n_free_pages) {
                s->pages[p] = (uint8_t *)c->free_pages[--c->n_free_pages];
            } else {
                void *pg = NULL;
                CU(cudaMalloc(&pg, c->page_bytes));
                s->pages[p] = (uint8_t *)pg;
            }
            s->table_dirty = 1;
        }
    if (s->table_dirty) {
        CU(cudaMemcpyAsync(s->pages_d, s->pages, (size_t)c->n_pages * sizeof *s->pages,
                           cudaMemcpyHostToDevice, c->stream));
        CU(cudaStreamSynchronize(c->stream));
        s->table_dirty = 0;
    }
    return 0;
}

static int have_pages(cu_ctx *c, cu_state *s, uint64_t r0, uint64_t r1, const char *name)
{
    if (r1 > r0)
        for (uint64_t p = r0 / c->ps; p <= (r1 - 1) / c->ps; p++)
            if (!s->pages[p])
                return st_error_set(ST_EINVAL, "cuda backend: K/V page %llu of %s never written",
                                    (unsigned long long)p, name);
    return 0;
}

/* ---- transfers ------------------------------------------------------------------------------ */
enum { SEG_KV, SEG_F32, SEG_BF16, SEG_HOST };

/* One tensor's part of a transfer: units are rows (KV), f32 elements (F32: moved as f32; BF16:
 * moved as bf16, coded on the device) or bytes (HOST: in the image already, nothing to move). */
typedef struct seg {
    int kind;
    uint64_t units, row0, koff;
    uint32_t rb;
    uint8_t *dev;
    uint8_t *host;
    int direct; /* host is pinned (the image pool): the device copies to / from it directly */
} seg;

static uint64_t seg_unit(const seg *g)
{
    switch (g->kind) {
    case SEG_KV: return g->rb;
    case SEG_F32: return 4;
    case SEG_BF16: return 2;
    default: return 1;
    }
}

typedef struct xchunk {
    uint32_t si;
    uint64_t a, b;
} xchunk;

typedef struct xit {
    uint32_t si;
    uint64_t at;
} xit;

static int xnext(const seg *segs, uint32_t ns, xit *it, xchunk *ch)
{
    while (it->si < ns && it->at >= segs[it->si].units) {
        it->si++;
        it->at = 0;
    }
    if (it->si >= ns)
        return 0;
    const seg *g = &segs[it->si];
    uint64_t per = g->kind == SEG_HOST ? g->units : STAGE_BYTES / seg_unit(g);
    ch->si = it->si;
    ch->a = it->at;
    ch->b = g->units - it->at < per ? g->units : it->at + per;
    it->at = ch->b;
    return 1;
}

/* ---- the state hash on the device -------------------------------------------------------------
 * The block digests of a save's or load's tensors (st_image.h: segment 1 + i of the state hash is
 * geometry tensor i, so segment i here) are computed by the GPU from the bytes in device memory,
 * one warp per block (st_xxh3_warp): a save digests the state it copies out, on its own stream
 * while the copies run (a bf16 checkpoint through the bf16 rounding: the values a restore widens);
 * a load digests what arrived in the slot's buffers once its copies are done, so the check covers
 * the bytes the slot will run on. The position (SEG_HOST, 8 bytes on the host) is digested by the
 * host. Each digest is XXH3-64 of its block, as st_state_hash_digests computes it on the CPU. */
/* Bytes of one block of a source, for st_xxh3_warp; o counts from the block's start. */
struct hreader {
    hsrc g;
    uint64_t at;
    __device__ const uint8_t *paged(uint64_t o) const
    {
        /* rows and pages count in 32 bits (n_ctx is a uint32_t); the offset does when it fits:
         * a 64-bit division costs several times a 32-bit one on the GPU */
        uint32_t r, cc;
        if (o < ((uint64_t)1 << 32)) {
            r = (uint32_t)o / g.rb;
            cc = (uint32_t)o - r * g.rb;
        } else {
            r = (uint32_t)(o / g.rb);
            cc = (uint32_t)(o - (uint64_t)r * g.rb);
        }
        r += (uint32_t)g.row0;
        uint32_t pg = r / g.ps;
        return g.pages[pg] + g.koff + (uint64_t)(r - pg * g.ps) * g.rb + cc;
    }
    __device__ uint8_t byte(uint64_t o) const
    {
        o += at;
        switch (g.kind) {
        case HS_LIN: return g.base[o];
        case HS_BF16: {
            uint32_t w = st_cuda_bf16_from_bits(((const uint32_t *)g.base)[o / 4]) << 16;
            return (uint8_t)(w >> (8 * (o % 4)));
        }
        default: return *paged(o);
        }
    }
    /* A page's rows of one tensor are contiguous (ps rows of rb bytes): from row 0 on, byte o
     * of the tensor is byte o % pb of page o / pb. The division is by an invariant, as a
     * multiply-high (Granlund-Montgomery, set up by hash_prepare): these loads are the cost. */
    __device__ uint32_t page_of(uint32_t o) const
    {
        return g.pb == 1 ? o : (__umulhi(g.pbm, o) + ((o - __umulhi(g.pbm, o)) >> 1)) >> g.pbs;
    }
    __device__ const uint8_t *paged_fast(uint32_t o) const
    {
        uint32_t pg = page_of(o);
        return g.pages[pg] + g.koff + (o - pg * g.pb);
    }
    /* [o, o + len) as aligned words in one run: a linear source's, or a paged one's within one
     * page (st_xxh3_warp reads a group of blocks so) */
    __device__ const uint64_t *span(uint64_t o, uint64_t len) const
    {
        uint64_t p = at + o;
        if (g.kind == HS_LIN)
            return ((uintptr_t)(g.base + p) & 7u) == 0 ? (const uint64_t *)(g.base + p) : nullptr;
        if (g.kind != HS_PAGED || !g.fast || p % 8 || p + len > ((uint64_t)1 << 32) || !len)
            return nullptr;
        if (page_of((uint32_t)p) != page_of((uint32_t)(p + len - 1)))
            return nullptr;
        return (const uint64_t *)paged_fast((uint32_t)p);
    }
    __device__ uint64_t word(uint64_t o) const
    {
        uint64_t p = at + o;
        if (g.kind == HS_PAGED && g.fast && p % 8 == 0)
            return *(const uint64_t *)paged_fast((uint32_t)p);
        if (g.kind == HS_LIN && ((uintptr_t)(g.base + p) & 7u) == 0)
            return *(const uint64_t *)(g.base + p);
        if (g.kind == HS_BF16 && p % 4 == 0) {
            const uint32_t *x = (const uint32_t *)g.base + p / 4;
            return (uint64_t)(st_cuda_bf16_from_bits(x[0]) << 16) |
                   (uint64_t)(st_cuda_bf16_from_bits(x[1]) << 16) << 32;
        }
        uint64_t v = 0;
        for (unsigned i = 0; i < 8; i++)
            v |= (uint64_t)byte(o + i) << (8 * i);
        return v;
    }
};

#define HASH_THREADS 128u

__global__ void k_hash(const hsrc *srcs, const hjob *jobs, uint32_t n, uint64_t *out)
{
    uint32_t w = (blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    if (w >= n)
        return; /* whole warps */
    hjob j = jobs[w];
    hreader r;
    r.g = srcs[j.src];
    r.at = j.off;
    uint64_t h = st_xxh3_warp(r, j.len);
    if ((threadIdx.x & 31u) == 0)
        out[j.out] = h;
}

/* Bytes a segment's part of the state hash covers: f32 tensors as fp32 (bf16 ones widened). */
static uint64_t seg_hbytes(const seg *g)
{
    switch (g->kind) {
    case SEG_KV: return g->units * g->rb;
    case SEG_F32:
    case SEG_BF16: return g->units * 4;
    default: return g->units;
    }
}

/* Index in a transfer's digests of each segment's first block (first[ns] = all of them). */
static int hash_first(const seg *segs, uint32_t ns, uint64_t **first)
{
    *first = (uint64_t *)malloc(((size_t)ns + 1) * sizeof **first);
    if (!*first)
        return st_error_set(ENOMEM, "cuda backend: state hash of a transfer");
    uint64_t t = 0;
    for (uint32_t i = 0; i < ns; i++) {
        (*first)[i] = t;
        t += st_state_hash_blocks(seg_hbytes(&segs[i]));
    }
    (*first)[ns] = t;
    return 0;
}

/* The device digests of segs, in three steps on c->hs: hash_prepare builds the sources and jobs
 * (c->hjob_at[si]: segment si's first job) and sends them up; hash_launch digests segments
 * [s0, s1) (c->hs must wait for their bytes first); hash_finish sends the digests down into
 * c->hdg_h and records c->ev_h. */
static int hash_prepare(cu_ctx *c, cu_state *s, const seg *segs, uint32_t ns, int save,
                        const uint64_t *first)
{
    uint32_t nj = 0;
    if (ns > c->n_desc || first[ns] > c->hjob_cap)
        return st_error_set(ST_EINVAL, "cuda backend: state hash of %u segments, %llu blocks "
                            "(room for %u and %llu)", ns, (unsigned long long)first[ns],
                            c->n_desc, (unsigned long long)c->hjob_cap);
    for (uint32_t si = 0; si < ns; si++) {
        const seg *g = &segs[si];
        hsrc *h = &c->hsrc_h[si];
        memset(h, 0, sizeof *h);
        c->hjob_at[si] = nj;
        if (g->kind == SEG_HOST)
            continue;
        if (g->kind == SEG_KV) {
            h->kind = HS_PAGED;
            h->rb = g->rb;
            h->ps = c->ps;
            h->pages = s->pages_d;
            h->koff = g->koff;
            h->row0 = g->row0;
            uint64_t pb = (uint64_t)c->ps * g->rb;
            h->fast = g->row0 == 0 && pb % 8 == 0 && g->koff % 8 == 0 && pb < ((uint64_t)1 << 32) &&
                      seg_hbytes(g) < ((uint64_t)1 << 32);
            if (h->fast) {
                /* Granlund-Montgomery: l = ceil(log2 pb), m = 2^32 (2^l - pb) / pb + 1, and
                 * n / pb = (t + ((n - t) >> 1)) >> (l - 1) with t = umulhi(m, n), every n < 2^32 */
                uint32_t l = 0;
                while (((uint64_t)1 << l) < pb)
                    l++;
                h->pb = (uint32_t)pb;
                h->pbm = (uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << l) - pb)) / pb + 1);
                h->pbs = l ? l - 1 : 0;
            }
        } else {
            h->kind = g->kind == SEG_BF16 && save ? HS_BF16 : HS_LIN;
            h->base = g->dev;
        }
        uint64_t hb = seg_hbytes(g);
        for (uint64_t b = 0; b < st_state_hash_blocks(hb); b++) {
            hjob *j = &c->hjob_h[nj++];
            j->src = si;
            j->pad = 0;
            j->off = b * ST_STATE_HASH_BLOCK;
            j->len = hb - j->off < ST_STATE_HASH_BLOCK ? hb - j->off : ST_STATE_HASH_BLOCK;
            j->out = first[si] + b;
        }
    }
    c->hjob_at[ns] = nj;
    if (nj) {
        CU(cudaMemcpyAsync(c->hsrc_d, c->hsrc_h, (size_t)ns * sizeof *c->hsrc_h,
                           cudaMemcpyHostToDevice, c->hs));
        CU(cudaMemcpyAsync(c->hjob_d, c->hjob_h, (size_t)nj * sizeof *c->hjob_h,
                           cudaMemcpyHostToDevice, c->hs));
    }
    return 0;
}

static int hash_launch(cu_ctx *c, uint32_t s0, uint32_t s1)
{
    uint32_t j0 = c->hjob_at[s0], nj = c->hjob_at[s1] - j0, per = HASH_THREADS / 32;
    if (!nj)
        return 0;
    if (c->trace)
        CU(cudaEventRecord(c->ev_t0, c->hs));
    k_hash<<<(nj + per - 1) / per, HASH_THREADS, 0, c->hs>>>(c->hsrc_d, c->hjob_d + j0, nj,
                                                              c->hdg_d);
    KCHECK("k_hash");
    if (c->trace)
        CU(cudaEventRecord(c->ev_t1, c->hs));
    return 0;
}

static int hash_finish(cu_ctx *c, uint32_t ns, const uint64_t *first)
{
    if (c->hjob_at[ns])
        CU(cudaMemcpyAsync(c->hdg_h, c->hdg_d, first[ns] * sizeof *c->hdg_d,
                           cudaMemcpyDeviceToHost, c->hs));
    CU(cudaEventRecord(c->ev_h, c->hs));
    return 0;
}

/* After c->ev_h: the device digests into dg, and the host segments' digests from their bytes. */
static int hash_collect(cu_ctx *c, const seg *segs, uint32_t ns, const uint64_t *first,
                        uint64_t *dg)
{
    CU(cudaEventSynchronize(c->ev_h));
    for (uint32_t si = 0; si < ns; si++) {
        const seg *g = &segs[si];
        uint64_t nb = first[si + 1] - first[si];
        if (g->kind != SEG_HOST) {
            memcpy(dg + first[si], c->hdg_h + first[si], nb * sizeof *dg);
            continue;
        }
        st_state_hash_seg hs;
        hs.data = g->host;
        hs.bytes = g->units;
        hs.widen = -1;
        int rc = st_state_hash_digests(&hs, 1, dg + first[si], NULL, NULL);
        if (rc)
            return rc;
    }
    return 0;
}

/* Host copies between a pinned staging buffer and an image, on the pool. */
typedef struct cjob {
    uint8_t *stage, *host;
    size_t bytes, piece;
    int to_host;
} cjob;

static void cjob_task(void *ctx, uint32_t task, uint32_t thread)
{
    (void)thread;
    cjob *j = (cjob *)ctx;
    size_t a = (size_t)task * j->piece;
    if (a >= j->bytes)
        return;
    size_t b = j->bytes - a < j->piece ? j->bytes : a + j->piece;
    if (j->to_host)
        memcpy(j->host + a, j->stage + a, b - a);
    else
        memcpy(j->stage + a, j->host + a, b - a);
}

/* Whether a chunk of g moves through the pinned staging buffer (the host copies it). */
static int staged(const seg *g)
{
    return g->kind != SEG_HOST && !g->direct;
}

/* The host's part of a staged chunk: copy between pinned buffer slot and the image. */
static void host_step(cu_ctx *c, const seg *segs, const xchunk *ch, int slot, int save)
{
    const seg *g = &segs[ch->si];
    if (!staged(g))
        return;
    uint64_t u = seg_unit(g);
    cjob j;
    j.stage = c->hstage[slot];
    j.host = g->host + ch->a * u;
    j.bytes = (size_t)((ch->b - ch->a) * u);
    j.to_host = save;
    uint32_t nc = (uint32_t)((j.bytes + (256u << 10) - 1) / (256u << 10));
    if (nc > c->n_threads)
        nc = c->n_threads;
    if (!nc)
        return;
    j.piece = (size_t)align_up((j.bytes + nc - 1) / nc, 64);
    st_pool_run(c->e->pool, nc, cjob_task, &j, nc > 1 ? (uint64_t)1 << 40 : 0);
}

/* The device's part of a chunk, queued on stream st. */
static int dev_step(cu_ctx *c, cu_state *s, const seg *g, const xchunk *ch, int slot, int save,
                    cudaStream_t st)
{
    uint64_t n = ch->b - ch->a;
    uint8_t *hs = g->direct ? g->host + ch->a * seg_unit(g) : c->hstage[slot];
    int rc;
    switch (g->kind) {
    case SEG_KV:
        if (save) {
            k_kv_copy<<<(unsigned)n, 128, 0, st>>>(s->pages_d, g->koff, c->ps, g->rb,
                                                   g->row0 + ch->a, c->dstage[slot], 0);
            KCHECK("k_kv_copy");
            CU(cudaMemcpyAsync(hs, c->dstage[slot], n * g->rb, cudaMemcpyDeviceToHost, st));
        } else {
            CU(cudaMemcpyAsync(c->dstage[slot], hs, n * g->rb, cudaMemcpyHostToDevice, st));
            k_kv_copy<<<(unsigned)n, 128, 0, st>>>(s->pages_d, g->koff, c->ps, g->rb,
                                                   g->row0 + ch->a, c->dstage[slot], 1);
            KCHECK("k_kv_copy");
        }
        return 0;
    case SEG_F32:
        if (save)
            CU(cudaMemcpyAsync(hs, g->dev + ch->a * 4, n * 4, cudaMemcpyDeviceToHost, st));
        else
            CU(cudaMemcpyAsync(g->dev + ch->a * 4, hs, n * 4, cudaMemcpyHostToDevice, st));
        return 0;
    case SEG_BF16:
        if (save) {
            if ((rc = st_codec_cuda_convert(ST_CODEC_BF16, c->dstage[slot], ST_CODEC_FP32,
                                            g->dev + ch->a * 4, n, st)))
                return rc;
            CU(cudaMemcpyAsync(hs, c->dstage[slot], n * 2, cudaMemcpyDeviceToHost, st));
        } else {
            CU(cudaMemcpyAsync(c->dstage[slot], hs, n * 2, cudaMemcpyHostToDevice, st));
            if ((rc = st_codec_cuda_convert(ST_CODEC_FP32, g->dev + ch->a * 4, ST_CODEC_BF16,
                                            c->dstage[slot], n, st)))
                return rc;
        }
        return 0;
    default:
        return 0;
    }
}

/* Chunk k runs on the transfer stream k % 2, so one chunk's kernel (gather, scatter, codec)
 * overlaps the next one's copy. Slot k % NSTAGE has the same parity as k: the chunk that used
 * a slot's device buffer before is earlier on the same stream. */
static cudaStream_t xstream(cu_ctx *c, uint64_t k)
{
    return k % 2 ? c->xs2 : c->stream;
}

static double xt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* STRATA_CUDA_TRACE: one line per whole-state save / load on stderr, its phases in ms from its
 * start: everything queued, the copies done, the digests down (hashed bytes / bytes moved). */
static void xfer_trace(const cu_ctx *c, const char *what, double t0, double tq, double tc,
                       double th, const seg *segs, uint32_t ns)
{
    uint64_t mv = 0, hb = 0;
    if (!c->trace)
        return;
    for (uint32_t i = 0; i < ns; i++) {
        mv += segs[i].units * seg_unit(&segs[i]);
        hb += seg_hbytes(&segs[i]);
    }
    float kms = 0;
    if (cudaEventElapsedTime(&kms, c->ev_t0, c->ev_t1) != cudaSuccess) {
        (void)cudaGetLastError(); /* no hash launched: the events were never recorded */
        kms = -1;
    }
    fprintf(stderr, "strata cuda %s: %.1f MB moved, %.1f MB hashed: queued %.2f ms, copies done "
            "%.2f ms, digests down %.2f ms (hash kernel %.2f ms)\n", what, (double)mv / 1e6,
            (double)hb / 1e6, tq - t0, tc - t0, th - t0, (double)kms);
}

/* Wait for every stream a transfer used (after a failure: nothing may still touch its buffers),
 * keeping the failure's own detail (a sticky CUDA error would otherwise overwrite it). */
static int xfer_drain(cu_ctx *c, int rc)
{
    char d[512];
    snprintf(d, sizeof d, "%s", st_errdetail());
    cu_release(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    cu_release(cudaStreamSynchronize(c->xs2), "cudaStreamSynchronize");
    cu_release(cudaStreamSynchronize(c->hs), "cudaStreamSynchronize");
    return st_error_set(rc, "%s", d);
}

/* The end of a whole transfer: both transfer streams done, then (dg) the digests down and, with
 * STRATA_CUDA_TRACE, the phases printed. On failure every stream is drained first. */
static int xfer_finish(cu_ctx *c, const char *what, const seg *segs, uint32_t ns,
                       const uint64_t *first, uint64_t *dg, double t0, double tq)
{
    int rc = 0;
    CUG(cudaStreamSynchronize(c->stream));
    CUG(cudaStreamSynchronize(c->xs2));
    if (dg) {
        double tc = c->trace ? xt_now() : 0;
        if ((rc = hash_collect(c, segs, ns, first, dg)))
            goto fail;
        if (c->trace)
            xfer_trace(c, what, t0, tq, tc, xt_now(), segs, ns);
    }
    return 0;
fail:
    return xfer_drain(c, rc);
}

/* Device -> host: up to NSTAGE chunks queued ahead of the host, which copies out the staged ones
 * as they arrive; with dg, the device digests the state meanwhile on c->hs. */
static int xfer_save(cu_ctx *c, cu_state *s, const seg *segs, uint32_t ns, uint64_t *dg)
{
    xit it = {0, 0};
    xchunk q[NSTAGE], ch;
    uint64_t ni = 0, nd = 0, *first = NULL;
    int rc = 0;
    double t0 = c->trace ? xt_now() : 0, tq = 0;
    if (dg && (rc = hash_first(segs, ns, &first)))
        return rc;
    /* the state is final once the work queued so far on c->stream is done */
    CUG(cudaEventRecord(c->ev_go, c->stream));
    CUG(cudaStreamWaitEvent(c->xs2, c->ev_go, 0));
    if (dg) {
        CUG(cudaStreamWaitEvent(c->hs, c->ev_go, 0));
        if ((rc = hash_prepare(c, s, segs, ns, 1, first)) || (rc = hash_launch(c, 0, ns)) ||
            (rc = hash_finish(c, ns, first)))
            goto fail;
    }
    for (;;) {
        while (ni - nd < NSTAGE && xnext(segs, ns, &it, &ch)) {
            int slot = (int)(ni % NSTAGE);
            q[slot] = ch;
            if ((rc = dev_step(c, s, &segs[ch.si], &ch, slot, 1, xstream(c, ni))))
                goto fail;
            CUG(cudaEventRecord(c->ev[slot], xstream(c, ni)));
            ni++;
        }
        if (c->trace && it.si >= ns && tq == 0)
            tq = xt_now();
        if (nd == ni)
            break;
        int slot = (int)(nd % NSTAGE);
        if (staged(&segs[q[slot].si])) {
            CUG(cudaEventSynchronize(c->ev[slot]));
            host_step(c, segs, &q[slot], slot, 1);
        }
        nd++;
    }
    rc = xfer_finish(c, "save", segs, ns, first, dg, t0, tq);
    free(first);
    return rc;
fail:
    rc = xfer_drain(c, rc);
    free(first);
    return rc;
}

/* Host -> device: the host fills pinned buffer k (staged chunks) while buffers k-1.. are in
 * flight; direct chunks are queued without waiting. With dg, the device digests what arrived. */
static int xfer_load(cu_ctx *c, cu_state *s, const seg *segs, uint32_t ns, uint64_t *dg,
                     const st_image *img)
{
    xit it = {0, 0};
    xchunk ch;
    uint64_t k = 0, *first = NULL;
    int rc = 0;
    double t0 = c->trace ? xt_now() : 0, tq = 0;
    if (dg && (rc = hash_first(segs, ns, &first)))
        return rc;
    CUG(cudaEventRecord(c->ev_go, c->stream));
    CUG(cudaStreamWaitEvent(c->xs2, c->ev_go, 0));
    if (dg && (rc = hash_prepare(c, s, segs, ns, 0, first)))
        goto fail;
    while (xnext(segs, ns, &it, &ch)) {
        int slot = (int)(k % NSTAGE);
        const seg *g = &segs[ch.si];
        /* a gated image (a streamed store get): this chunk's bytes checked and in place first,
         * while the chunks queued before it are in flight (a host segment's too: cu_load and
         * hash_collect read it) */
        if (img && (rc = st_image_wait(img, g->host + ch.a * seg_unit(g), (ch.b - ch.a) * seg_unit(g))))
            goto fail;
        if (staged(g)) {
            /* the slot's pinned buffer is free once the chunk that used it last is on the device */
            if (k >= NSTAGE)
                CUG(cudaEventSynchronize(c->ev[slot]));
            host_step(c, segs, &ch, slot, 0);
        }
        if ((rc = dev_step(c, s, &segs[ch.si], &ch, slot, 0, xstream(c, k))))
            goto fail;
        CUG(cudaEventRecord(c->ev[slot], xstream(c, k)));
        k++;
    }
    if (dg) {
        /* the digests of what arrived, once both transfer streams are done: the kernel is bound
         * by the latency of a block's sequential chain (0.45 ms on the H200 for a paged 1 MiB
         * block, 0.33 ms for a linear one), not by bandwidth, so one
         * launch at the end leaves the same tail as launches spread over the copies would */
        CUG(cudaEventRecord(c->ev_go, c->xs2));
        CUG(cudaStreamWaitEvent(c->hs, c->ev_go, 0));
        CUG(cudaEventRecord(c->ev_go2, c->stream));
        CUG(cudaStreamWaitEvent(c->hs, c->ev_go2, 0));
        if ((rc = hash_launch(c, 0, ns)) || (rc = hash_finish(c, ns, first)))
            goto fail;
    }
    tq = c->trace ? xt_now() : 0;
    rc = xfer_finish(c, "load", segs, ns, first, dg, t0, tq);
    free(first);
    return rc;
fail:
    rc = xfer_drain(c, rc);
    free(first);
    return rc;
}

/* A K/V tensor's rows as a transfer segment. */
static int kv_seg(cu_ctx *c, uint32_t ti, uint64_t row0, uint64_t nrows, uint8_t *host, seg *g)
{
    const st_state_map *t = &c->tm[ti];
    memset(g, 0, sizeof *g);
    g->kind = SEG_KV;
    g->row0 = row0;
    g->units = nrows;
    g->host = host;
    g->koff = (uint64_t)t->slot * c->per_layer;
    switch (t->what) {
    case ST_SW_K: g->rb = (uint32_t)c->krow; break;
    case ST_SW_V: g->koff += c->off_v; g->rb = (uint32_t)c->krow; break;
    case ST_SW_KS: g->koff += c->off_ks; g->rb = (uint32_t)c->srow; break;
    case ST_SW_VS: g->koff += c->off_vs; g->rb = (uint32_t)c->srow; break;
    default:
        return st_error_set(ST_EINVAL, "cuda backend: tensor %u (%s) is not K/V", ti,
                            c->descs[ti].name);
    }
    if (row0 > c->n_ctx || nrows > c->n_ctx - row0)
        return st_error_set(ST_EINVAL, "cuda backend: K/V rows [%llu, +%llu) beyond %u",
                            (unsigned long long)row0, (unsigned long long)nrows, c->n_ctx);
    return 0;
}

static int cu_kv_read(void *bctx, void *stp, uint32_t ti, uint64_t row0, uint64_t nrows, void *dst)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    seg g;
    int rc;
    if (s->err)
        return s->err;
    if ((rc = kv_seg(c, ti, row0, nrows, (uint8_t *)dst, &g)) ||
        (rc = have_pages(c, s, row0, row0 + nrows, c->descs[ti].name)))
        return rc;
    return xfer_save(c, s, &g, 1, NULL);
}

static int cu_kv_write(void *bctx, void *stp, uint32_t ti, uint64_t row0, uint64_t nrows,
                       const void *src)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    seg g;
    int rc;
    if (s->err)
        return s->err;
    if ((rc = kv_seg(c, ti, row0, nrows, (uint8_t *)src, &g)) ||
        (rc = ensure_pages(c, s, row0, row0 + nrows)))
        return rc;
    return xfer_load(c, s, &g, 1, NULL, NULL);
}

static int cu_running_io(cu_ctx *c, cu_state *s, uint32_t ti, void *buf, uint64_t len, int write)
{
    const st_state_map *t = &c->tm[ti];
    if (s->err)
        return s->err;
    if (t->what == ST_SW_POS && len == 8) {
        if (!write) {
            memcpy(buf, &s->pos, 8);
            return 0;
        }
        int64_t p;
        memcpy(&p, buf, 8);
        if (p < 0 || (uint64_t)p > c->n_ctx)
            return st_error_set(ST_ECORRUPT, "cuda backend: position %lld outside 0..%u",
                                (long long)p, c->n_ctx);
        s->pos = p;
        return 0;
    }
    if ((t->what != ST_SW_SSM && t->what != ST_SW_CONV) || len != c->run_len[ti])
        return st_error_set(ST_EINVAL, "cuda backend: running %s of tensor %u (%s), %llu bytes",
                            write ? "write" : "read", ti, c->descs[ti].name,
                            (unsigned long long)len);
    seg g;
    memset(&g, 0, sizeof g);
    g.kind = SEG_F32;
    g.units = len / 4;
    g.dev = s->run + c->run_off[ti];
    g.host = (uint8_t *)buf;
    return write ? xfer_load(c, s, &g, 1, NULL, NULL) : xfer_save(c, s, &g, 1, NULL);
}

static int cu_running_read(void *bctx, void *st, uint32_t ti, void *dst, uint64_t len)
{
    return cu_running_io((cu_ctx *)bctx, (cu_state *)st, ti, dst, len, 0);
}

static int cu_running_write(void *bctx, void *st, uint32_t ti, const void *src, uint64_t len)
{
    return cu_running_io((cu_ctx *)bctx, (cu_state *)st, ti, (void *)src, len, 1);
}

/* The segments of the whole state in geometry order, against checkpoint ci of img. */
/* ---- the pinned image pool -------------------------------------------------------------------
 * Process-wide pinned host blocks (cudaHostAlloc, portable) for the large buffers of PARK images,
 * handed out through an st_image_allocator: save and load then DMA straight between the device
 * and the image, with no staging copy. A freed block returns to the pool for reuse (best fit, at
 * most twice the size asked). The pool holds at most PIN_POOL_CAP bytes: beyond it, unused blocks
 * are given back (cudaFreeHost) to make room, and when that is not enough the hook refuses and
 * the image uses ordinary memory (moved through the staging buffers). Blocks in use are never
 * freed: the pool lives as long as the process, so images may outlive every engine. */
#define PIN_POOL_CAP ((size_t)4 << 30)

typedef struct pin_blk {
    uint8_t *p;
    size_t len;
    int used;
} pin_blk;

static pthread_mutex_t pin_mu = PTHREAD_MUTEX_INITIALIZER;
static pin_blk *pin_tab;
static size_t pin_n, pin_capn, pin_bytes;

static void *pin_alloc(void *ctx, size_t len)
{
    (void)ctx;
    void *r = NULL;
    size_t best = SIZE_MAX;
    if (!len || len > PIN_POOL_CAP)
        return NULL;
    pthread_mutex_lock(&pin_mu);
    for (size_t i = 0; i < pin_n; i++)
        if (!pin_tab[i].used && pin_tab[i].len >= len && pin_tab[i].len / 2 <= len &&
            (best == SIZE_MAX || pin_tab[i].len < pin_tab[best].len))
            best = i;
    if (best != SIZE_MAX) {
        pin_tab[best].used = 1;
        r = pin_tab[best].p;
        goto done;
    }
    for (size_t i = 0; i < pin_n && pin_bytes + len > PIN_POOL_CAP;) {
        if (pin_tab[i].used) {
            i++;
            continue;
        }
        cu_release(cudaFreeHost(pin_tab[i].p), "cudaFreeHost (image pool)");
        pin_bytes -= pin_tab[i].len;
        pin_tab[i] = pin_tab[--pin_n];
    }
    if (pin_bytes + len > PIN_POOL_CAP)
        goto done;
    if (pin_n == pin_capn) {
        size_t nc = pin_capn ? pin_capn * 2 : 64;
        pin_blk *t = (pin_blk *)realloc(pin_tab, nc * sizeof *t);
        if (!t)
            goto done;
        pin_tab = t;
        pin_capn = nc;
    }
    if (cudaHostAlloc(&r, len, cudaHostAllocPortable) != cudaSuccess) {
        (void)cudaGetLastError();
        r = NULL;
        goto done;
    }
    pin_tab[pin_n].p = (uint8_t *)r;
    pin_tab[pin_n].len = len;
    pin_tab[pin_n].used = 1;
    pin_n++;
    pin_bytes += len;
done:
    pthread_mutex_unlock(&pin_mu);
    return r;
}

static void pin_free(void *ctx, void *p, size_t len)
{
    (void)ctx;
    (void)len;
    pthread_mutex_lock(&pin_mu);
    for (size_t i = 0; i < pin_n; i++)
        if (pin_tab[i].p == (uint8_t *)p) {
            pin_tab[i].used = 0;
            break;
        }
    pthread_mutex_unlock(&pin_mu);
}

/* Whether [p, p + n) lies in a pool block in use (an image's buffer). */
static int pin_holds(const void *p, uint64_t n)
{
    const uint8_t *q = (const uint8_t *)p;
    int r = 0;
    pthread_mutex_lock(&pin_mu);
    for (size_t i = 0; i < pin_n && !r; i++)
        r = pin_tab[i].used && q >= pin_tab[i].p && n <= pin_tab[i].len &&
            (uint64_t)(q - pin_tab[i].p) <= pin_tab[i].len - n;
    pthread_mutex_unlock(&pin_mu);
    return r;
}

static const st_image_allocator pin_allocator = {pin_alloc, pin_free, NULL};

static const st_image_allocator *cu_image_allocator(void *bctx)
{
    (void)bctx;
    return &pin_allocator;
}

static int state_segs(cu_ctx *c, cu_state *s, st_image *img, const st_image *cimg, uint32_t ci,
                      uint64_t n, uint32_t codec, int save, seg *segs)
{
    int rc;
    for (uint32_t ti = 0; ti < c->n_desc; ti++) {
        const st_state_map *t = &c->tm[ti];
        seg *g = &segs[ti];
        uint64_t len = 0;
        if (c->descs[ti].role == ST_ROLE_KV) {
            const void *p = save ? st_image_kv(img, ti, &len) : st_image_kv_const(cimg, ti, &len);
            if ((rc = kv_seg(c, ti, 0, n, (uint8_t *)p, g)))
                return rc;
            if (!p || len != n * g->rb)
                return st_error_set(save ? ST_EINVAL : ST_ECORRUPT, "cuda backend: K/V tensor %s:"
                                    " the image holds %llu bytes, expected %llu",
                                    c->descs[ti].name, (unsigned long long)len,
                                    (unsigned long long)(n * g->rb));
            g->direct = pin_holds(p, len);
            continue;
        }
        const void *p = save ? st_image_checkpoint_tensor(img, ci, ti, &len)
                             : st_image_checkpoint_tensor_const(cimg, ci, ti, &len);
        uint64_t want = t->what == ST_SW_POS ? 8 : c->run_len[ti] / 4 * (codec == ST_CODEC_FP32 ? 4 : 2);
        if (!p || len != want)
            return st_error_set(save ? ST_EINVAL : ST_ECORRUPT, "cuda backend: checkpoint %u "
                                "tensor %s: %llu bytes, expected %llu", ci, c->descs[ti].name,
                                (unsigned long long)len, (unsigned long long)want);
        memset(g, 0, sizeof *g);
        g->host = (uint8_t *)p;
        if (t->what == ST_SW_POS) {
            g->kind = SEG_HOST;
            g->units = 8;
            if (save)
                memcpy(g->host, &s->pos, 8);
            continue;
        }
        g->dev = s->run + c->run_off[ti];
        g->units = c->run_len[ti] / 4;
        if (codec == ST_CODEC_FP32) {
            g->kind = SEG_F32;
        } else {
            g->kind = SEG_BF16;
        }
        g->direct = pin_holds(p, len);
    }
    return 0;
}

static int cu_save(void *bctx, void *stp, st_image *img, uint32_t ci, uint64_t n,
                   uint64_t *digests)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    uint64_t pos;
    uint32_t codec;
    int rc;
    if (s->err)
        return s->err;
    if ((rc = st_image_checkpoint_info(img, ci, &pos, &codec)))
        return rc;
    if ((codec != ST_CODEC_FP32 && codec != ST_CODEC_BF16) || n != (uint64_t)s->pos ||
        pos != n || st_image_n_tokens(img) != n)
        return st_error_set(ST_EINVAL, "cuda backend: save of %llu tokens at %lld into a "
                            "checkpoint at %llu in codec %s", (unsigned long long)n,
                            (long long)s->pos, (unsigned long long)pos, st_codec_name(codec));
    if ((rc = have_pages(c, s, 0, n, "the arena")))
        return rc;
    seg *segs = (seg *)calloc(c->n_desc, sizeof *segs);
    if (!segs)
        return st_error_set(ENOMEM, "cuda backend: save");
    rc = state_segs(c, s, img, NULL, ci, n, codec, 1, segs);
    if (!rc)
        rc = xfer_save(c, s, segs, c->n_desc, digests);
    free(segs);
    return rc;
}

static int cu_load(void *bctx, void *stp, const st_image *img, uint32_t ci, uint64_t n,
                   uint64_t *digests)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    uint64_t pos;
    uint32_t codec;
    int rc;
    int64_t p = -1;
    if (s->err)
        return s->err;
    if ((rc = st_image_checkpoint_info(img, ci, &pos, &codec)))
        return rc;
    if ((codec != ST_CODEC_FP32 && codec != ST_CODEC_BF16) || n > c->n_ctx || pos != n)
        return st_error_set(ST_EINVAL, "cuda backend: load of %llu tokens from a checkpoint at "
                            "%llu in codec %s", (unsigned long long)n, (unsigned long long)pos,
                            st_codec_name(codec));
    if ((rc = ensure_pages(c, s, 0, n)))
        return rc;
    seg *segs = (seg *)calloc(c->n_desc, sizeof *segs);
    if (!segs)
        return st_error_set(ENOMEM, "cuda backend: load");
    rc = state_segs(c, s, NULL, img, ci, n, codec, 0, segs);
    /* the transfer first: from a gated image the position (the live checkpoint's last tensor)
     * arrives last, and xfer_load has waited for it; on a refusal the state is the caller's to
     * discard (a restore's fresh one) */
    if (!rc)
        rc = xfer_load(c, s, segs, c->n_desc, digests, img);
    for (uint32_t ti = 0; !rc && ti < c->n_desc; ti++)
        if (c->tm[ti].what == ST_SW_POS) {
            memcpy(&p, segs[ti].host, 8);
            if (p < 0 || (uint64_t)p != pos)
                rc = st_error_set(ST_ECORRUPT, "restore: live state at %llu holds position %lld",
                                  (unsigned long long)pos, (long long)p);
        }
    if (!rc)
        s->pos = p;
    free(segs);
    return rc;
}

/* ---- the forward pass ------------------------------------------------------------------------ */
/* BF16 -> FP16, saturated to the largest finite FP16 (NaN stays NaN): dst[r][k] = src[r][k]
 * for r < rows, k < cols, src with leading dimension lds, dst packed (cols). */
__global__ void k_bf16_f16(const bf16 *src, uint32_t lds, __half *dst, uint32_t cols, uint64_t n)
{
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint64_t r = i / cols, k = i - r * cols;
        float f = __bfloat162float(src[r * lds + k]);
        f = f > 65504.0f ? 65504.0f : f < -65504.0f ? -65504.0f : f;
        dst[i] = __float2half_rn(f);
    }
}

static int to_f16(cu_ctx *c, const bf16 *src, uint32_t lds, __half *dst, uint32_t rows,
                  uint32_t cols)
{
    uint64_t n = (uint64_t)rows * cols;
    uint64_t blocks = (n + 255) / 256;
    unsigned grid = (unsigned)(blocks < (uint64_t)c->n_sm * 16 ? blocks : (uint64_t)c->n_sm * 16);
    k_bf16_f16<<<grid ? grid : 1, 256, 0, c->stream>>>(src, lds, dst, cols, n);
    KCHECK("k_bf16_f16");
    return 0;
}

/* Y[T][ldy] (rows used) = W [rows][cols] times each X row, on FP16 tensor cores (invariant 7);
 * immutable: W is a model weight that may be kept converted in the arena. */
static int gemm_f16(cu_ctx *c, const bf16 *W, int immutable, uint32_t rows, uint32_t cols,
                    const bf16 *X, uint32_t ldx, uint32_t T, float *Y, uint32_t ldy)
{
    uint64_t n = (uint64_t)rows * cols;
    const __half *Wh = NULL;
    int rc;
    if (n > c->wmax || cols > c->cmax || T > c->T) /* before any work: the scratch's sizes */
        return st_error_set(ST_EINVAL, "cuda backend: a %u x %u product of %u inputs (at most %llu "
                            "weight elements, %u columns, %u inputs)", rows, cols, T,
                            (unsigned long long)c->wmax, c->cmax, c->T);
    if (immutable && c->wc.cap) {
        uint64_t off = 0;
        int r = st_wcache_lookup(&c->wc, W, rows, cols, n * 2, &off);
        if (r != ST_WCACHE_BYPASS) {
            __half *dst = (__half *)((uint8_t *)c->arena + off);
            if (r == ST_WCACHE_ADMIT && (rc = to_f16(c, W, cols, dst, rows, cols))) {
                st_wcache_drop_last(&c->wc);
                return rc;
            }
            Wh = dst;
        }
    }
    if (!Wh) {
        if ((rc = to_f16(c, W, cols, c->wtmp, rows, cols)))
            return rc;
        Wh = c->wtmp;
    }
    if ((rc = to_f16(c, X, ldx, c->xh, T, cols)))
        return rc;
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T,
                                     (int)cols, &one, Wh, CUDA_R_16F, (int)cols, c->xh, CUDA_R_16F,
                                     (int)cols, &zero, Y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return blas_fail(st, "cublasGemmEx (fp16)");
    return 0;
}

static int gemm(cu_ctx *c, const bf16 *W, uint32_t rows, uint32_t cols, const bf16 *X,
                uint32_t ldx, uint32_t T, float *Y, uint32_t ldy)
{
    if (c->fp16)
        return gemm_f16(c, W, 1, rows, cols, X, ldx, T, Y, ldy);
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasGemmEx(c->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T,
                                     (int)cols, &one, W, CUDA_R_16BF, (int)cols, X, CUDA_R_16BF,
                                     (int)ldx, &zero, Y, CUDA_R_32F, (int)ldy, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT);
    if (st != CUBLAS_STATUS_SUCCESS)
        return blas_fail(st, "cublasGemmEx");
    return 0;
}

template <int R>
static int scan_launch(cu_ctx *c, float *M, uint32_t T)
{
    size_t smem = ((2 * SC_TT + 1) * (size_t)R * 16 + SC_TT * SC_COLS + 2 * SC_TT + 2 * 8 * 16 * 2) * 4;
    dim3 grid((c->dv + SC_COLS - 1) / SC_COLS, c->H);
    k_dn_scan<R><<<grid, 256, smem, c->stream>>>(M, c->dk, c->dv, T, c->qkvc, c->C, c->H, c->ab,
                                                 c->o);
    KCHECK("k_dn_scan");
    return 0;
}

static int scan(cu_ctx *c, float *M, uint32_t T)
{
    uint32_t need = (c->dk + 15) / 16;
    if (need <= 1) return scan_launch<1>(c, M, T);
    if (need <= 2) return scan_launch<2>(c, M, T);
    if (need <= 4) return scan_launch<4>(c, M, T);
    if (need <= 8) return scan_launch<8>(c, M, T);
    if (need <= 12) return scan_launch<12>(c, M, T);
    if (need <= 16) return scan_launch<16>(c, M, T);
    if (need <= 20) return scan_launch<20>(c, M, T);
    if (need <= 24) return scan_launch<24>(c, M, T);
    if (need <= 28) return scan_launch<28>(c, M, T);
    return scan_launch<32>(c, M, T);
}

static int layer_deltanet(cu_ctx *c, cu_state *s, const cu_layer *L, uint32_t T)
{
    int rc;
    uint32_t C = c->C, H = c->H;
    float *ssm = (float *)(s->run + L->ssm_off), *conv = (float *)(s->run + L->conv_off);
    if ((rc = gemm(c, L->w_in, L->in_rows, c->E, c->xnb, c->E, T, c->mix, c->nmix)))
        return rc;
    k_conv<<<dim3(T, (C + 127) / 128), 128, 0, c->stream>>>(c->mix, c->nmix, C, L->conv_w, conv,
                                                             c->qkvc);
    KCHECK("k_conv");
    k_conv_state<<<(C + 127) / 128, 128, 0, c->stream>>>(c->mix, c->nmix, C, conv, T);
    KCHECK("k_conv_state");
    k_dn_prep<<<dim3(T, H), 128, 0, c->stream>>>(c->qkvc, C, H, c->dk, c->mix + C + c->hdv,
                                                 c->nmix, L->a_log, L->dt_bias, c->ab);
    KCHECK("k_dn_prep");
    if ((rc = scan(c, ssm, T)))
        return rc;
    k_dn_gate<<<dim3(T, H), 128, 0, c->stream>>>(c->o, c->mix + C, c->nmix, L->ssm_norm, H,
                                                 c->dv, c->hp->rms_eps, c->gin);
    KCHECK("k_dn_gate");
    return gemm(c, L->w_out, c->E, c->hdv, c->gin, c->hdv, T, c->out, c->E);
}

static int layer_attention(cu_ctx *c, cu_state *s, const cu_layer *L, uint32_t T, uint64_t pos0)
{
    int rc;
    if ((rc = gemm(c, L->w_in, L->in_rows, c->E, c->xnb, c->E, T, c->mix, c->nmix)))
        return rc;
    kv_geom g;
    g.pages = s->pages_d;
    g.ps = c->ps;
    g.krow = (uint32_t)c->krow;
    g.srow = (uint32_t)c->srow;
    g.i8 = c->kv_dtype == ST_DTYPE_I8;
    g.lay = (uint64_t)L->slot * c->per_layer;
    g.off_v = c->off_v;
    g.off_ks = c->off_ks;
    g.off_vs = c->off_vs;
    k_rope_q<<<dim3(T, c->nh), 64, 0, c->stream>>>(c->mix, c->nmix, c->hd, pos0, c->rope_freq);
    KCHECK("k_rope_q");
    k_kv_store<<<dim3(T, c->nkv), 128, 0, c->stream>>>(c->mix, c->nmix, c->qa, c->kva, c->hd, pos0,
                                                       c->rope_freq, g);
    KCHECK("k_kv_store");
    /* split the keys when the row tiles alone would not fill the GPU */
    uint32_t G = c->nh / c->nkv, nrows = T * G;
    int NI = nrows <= 4 ? 1 : nrows <= 8 ? 2 : 8;
    uint32_t BR = 4 * (uint32_t)NI, nrt = (nrows + BR - 1) / BR;
    uint64_t kmax = pos0 + T, KS = align_up(kmax, AT_BK);
    uint32_t target = 2 * (uint32_t)c->n_sm, base = nrt * c->nkv, nsplit = 1;
    if (base < target) {
        uint64_t want = (target + base - 1) / base;
        KS = align_up((kmax + want - 1) / want, AT_BK);
        nsplit = (uint32_t)((kmax + KS - 1) / KS);
    }
    if ((uint64_t)nsplit * c->nkv * nrows > c->att_cap_rows)
        return st_error_set(ST_EINVAL, "cuda backend: attention workspace: %u splits x %u rows",
                            nsplit, nrows);
    attn_args a;
    a.mix = c->mix;
    a.ldm = c->nmix;
    a.hd = c->hd;
    a.nkv = c->nkv;
    a.G = G;
    a.T = T;
    a.qa = c->qa;
    a.nsplit = nsplit;
    a.pos0 = pos0;
    a.KS = KS;
    a.scale = 1.0f / sqrtf((float)c->hd);
    a.g = g;
    a.out = c->gin;
    a.po = c->att_po;
    a.pm = c->att_pm;
    a.pl = c->att_pl;
    dim3 grid(nrt, nsplit, c->nkv);
    size_t smem = (size_t)(BR + AT_BK) * at_stride(c->hd) * 4;
    if (NI == 1)
        k_attn<1><<<grid, AT_THREADS, smem, c->stream>>>(a);
    else if (NI == 2)
        k_attn<2><<<grid, AT_THREADS, smem, c->stream>>>(a);
    else
        k_attn<8><<<grid, AT_THREADS, smem, c->stream>>>(a);
    KCHECK("k_attn");
    if (nsplit > 1) {
        k_attn_comb<<<dim3(nrows, c->nkv), 128, nsplit * 4, c->stream>>>(a);
        KCHECK("k_attn_comb");
    }
    return gemm(c, L->w_out, c->E, c->qa, c->gin, c->qa, T, c->out, c->E);
}

static int ffn(cu_ctx *c, const cu_layer *L, uint32_t T)
{
    int rc;
    uint32_t F = c->F;
    if ((rc = gemm(c, L->w_ffn_in, 2 * F, c->E, c->xnb, c->E, T, c->mix, 2 * F)))
        return rc;
    k_swiglu<<<dim3(T, (F + 255) / 256), 256, 0, c->stream>>>(c->mix, F, c->gin);
    KCHECK("k_swiglu");
    return gemm(c, L->w_ffn_down, c->E, F, c->gin, F, T, c->out, c->E);
}

/* The architecture's forward pass on the operation table (invariant 8). */
static int ops_forward(cu_ctx *c, cu_state *s, const uint32_t *tokens, uint32_t n, uint64_t pos0,
                       float *logits)
{
    ops_mem om = {c, s};
    st_fwd f;
    memset(&f, 0, sizeof f);
    f.m = &c->dm;
    f.ops = st_ops_cuda_get(c->oc);
    f.oc = c->oc;
    f.mem = &om;
    f.kv_view = ops_kv_view;
    f.rec = ops_rec;
    f.experts = c->xdev ? ops_experts : NULL;
    f.tokens = tokens;
    f.T = n;
    f.pos0 = pos0;
    f.logits = logits ? c->logits_d : NULL;
    int graph = c->graphs && n == 1, rc = 0;
    cudaError_t ce = cudaSuccess;
    uint64_t span = graph ? st_ops_cuda_att_span(c->oc, pos0) : 0;
    if (graph && c->gexec && c->g_run == s->run && c->g_logits == (logits != NULL) &&
        c->g_span == span) {
        /* the captured step serves this one: stage its token and position, replay */
        st_ops_cuda_stage(c->oc, tokens, n, pos0);
        rc = st_ops_cuda_error(c->oc);
        if (!rc && (ce = cudaGraphLaunch(c->gexec, c->stream)) != cudaSuccess)
            rc = cu_fail(ce, "cudaGraphLaunch");
        if (!rc)
            c->g_replay++;
    } else {
        if (graph) {
            c->g_run = NULL; /* valid again only once captured and instantiated */
            cudaError_t be = cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal);
            if (be != cudaSuccess)
                return cu_fail(be, "cudaStreamBeginCapture");
            st_ops_cuda_dynamic(c->oc, 1);
            st_ops_cuda_stage(c->oc, tokens, n, pos0);
        }
        c->m->arch->forward(&f, c->ws);
        rc = st_ops_cuda_error(c->oc);
        int xrc = st_xdev_error(c->xdev); /* cleared either way */
        if (!rc)
            rc = xrc;
        if (!rc && logits)
            ce = cudaMemcpyAsync(c->logits_h, c->logits_d, (size_t)c->V * 4,
                                 cudaMemcpyDeviceToHost, c->stream);
        if (graph) {
            st_ops_cuda_dynamic(c->oc, 0);
            cudaGraph_t g = NULL;
            cudaError_t ee = cudaStreamEndCapture(c->stream, &g);
            int grc = 0;
            if (!rc && ce == cudaSuccess)
                grc = ee != cudaSuccess ? cu_fail(ee, "cudaStreamEndCapture") : graph_run(c, g);
            if (g)
                cu_release(cudaGraphDestroy(g), "cudaGraphDestroy");
            if (grc) {
                /* the capture, its instantiation or its launch failed: nothing of the pass ran,
                 * so it runs directly, and so does every later step of this context */
                fprintf(stderr, "strata: cuda backend: decode graphs off after a failure: %s\n",
                        st_errdetail());
                cudaGetLastError();
                cudaStreamSynchronize(c->stream);
                c->graphs = 0;
                return ops_forward(c, s, tokens, n, pos0, logits);
            }
            if (!rc) {
                c->g_run = s->run;
                c->g_logits = logits != NULL;
                c->g_span = span;
            }
        }
    }
    cudaError_t cs = cudaStreamSynchronize(c->stream);
    if (!rc && (ce != cudaSuccess || cs != cudaSuccess))
        rc = cu_fail(ce != cudaSuccess ? ce : cs, "the forward pass");
    if (rc) {
        /* earlier layers may have advanced their recurrent state in place: the state is not
         * read again until a reset or a load replaces it */
        if (!graph || cs != cudaSuccess)
            s->err = rc;
        return rc;
    }
    if (logits)
        memcpy(logits, c->logits_h, (size_t)c->V * 4);
    s->pos = (int64_t)(pos0 + n);
    return 0;
}

static int cu_forward(void *bctx, void *stp, const uint32_t *tokens, uint32_t n, uint64_t pos0,
                      float *logits)
{
    cu_ctx *c = (cu_ctx *)bctx;
    cu_state *s = (cu_state *)stp;
    const st_model_hparams *hp = c->hp;
    int rc;
    if (s->err)
        return s->err;
    if ((uint64_t)s->pos != pos0)
        return st_error_set(ST_EINVAL, "cuda backend: reading at %llu, the state is at %lld",
                            (unsigned long long)pos0, (long long)s->pos);
    if (n == 0 || n > c->T || pos0 + n > c->n_ctx)
        return st_error_set(ST_EINVAL, "cuda backend: %u tokens at %llu (chunk %u, context %u)",
                            n, (unsigned long long)pos0, c->T, c->n_ctx);
    for (uint32_t t = 0; t < n; t++)
        if (tokens[t] >= hp->n_vocab)
            return st_error_set(ST_EINVAL, "cuda backend: token %u outside the vocabulary of %u",
                                tokens[t], hp->n_vocab);
    if ((rc = ensure_pages(c, s, pos0, pos0 + n)))
        return rc;
    if (c->ops)
        return ops_forward(c, s, tokens, n, pos0, logits);
    memcpy(c->tok_h, tokens, (size_t)n * 4);
    CU(cudaMemcpyAsync(c->tok_d, c->tok_h, (size_t)n * 4, cudaMemcpyHostToDevice, c->stream));
    k_embed<<<n, 128, 0, c->stream>>>(c->tok_d, c->tok_embd, c->E, c->x);
    KCHECK("k_embed");
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const cu_layer *L = &c->L[il];
        k_add_norm<<<n, 256, 0, c->stream>>>(c->x, c->out, il > 0, L->attn_norm, c->E,
                                             hp->rms_eps, c->xnb);
        KCHECK("k_add_norm");
        rc = L->kind == 'D' ? layer_deltanet(c, s, L, n) : layer_attention(c, s, L, n, pos0);
        if (rc)
            goto fail;
        k_add_norm<<<n, 256, 0, c->stream>>>(c->x, c->out, 1, L->ffn_norm, c->E, hp->rms_eps,
                                             c->xnb);
        KCHECK("k_add_norm");
        if ((rc = ffn(c, L, n)))
            goto fail;
    }
    if (logits) {
        size_t last = (size_t)(n - 1) * c->E;
        k_add_norm<<<1, 256, 0, c->stream>>>(c->x + last, c->out + last, 1, c->out_norm, c->E,
                                             hp->rms_eps, c->xnb);
        KCHECK("k_add_norm");
        if ((rc = gemm(c, c->w_head, c->V, c->E, c->xnb, c->E, 1, c->logits_d, c->V)))
            goto fail;
        CUG(cudaMemcpyAsync(c->logits_h, c->logits_d, (size_t)c->V * 4, cudaMemcpyDeviceToHost,
                            c->stream));
    }
    CUG(cudaStreamSynchronize(c->stream));
    if (logits)
        memcpy(logits, c->logits_h, (size_t)c->V * 4);
    s->pos = (int64_t)(pos0 + n);
    if (c->fp16)
        wcache_publish(c);
    return 0;
fail:
    cu_release(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    if (c->fp16)
        wcache_publish(c);
    return rc;
}

static void cu_wcache_get(void *bctx, st_engine_wcache *out)
{
    cu_ctx *c = (cu_ctx *)bctx;
    if (!c->wc_mu_ok)
        return;
    pthread_mutex_lock(&c->wc_mu);
    *out = c->wc_pub;
    pthread_mutex_unlock(&c->wc_mu);
}

static void cu_xcache_get(void *bctx, st_engine_xcache *out)
{
    st_xdev_stats(((cu_ctx *)bctx)->xdev, out);
}

static int cu_wcache_invalidate(void *bctx)
{
    cu_ctx *c = (cu_ctx *)bctx;
    if (!c->wc.cap)
        return 0;
    CU(cudaStreamSynchronize(c->stream)); /* no product still reads an entry */
    st_wcache_invalidate(&c->wc);
    wcache_publish(c);
    return 0;
}

/* Test access (st_engine_int.h): one product on the FP16 path. */
extern "C" int st_cuda_gemm_probe(st_engine *e, const void *w_dev, uint32_t rows, uint32_t cols,
                                  int immutable, const float *x, uint32_t T, float *y)
{
    if (!e || e->be != &st_backend_cuda || !e->bctx)
        return st_error_set(ST_EINVAL, "gemm probe: not a CUDA engine");
    cu_ctx *c = (cu_ctx *)e->bctx;
    if (!c->fp16)
        return st_error_set(ST_EINVAL, "gemm probe: the FP16 path is off (STRATA_BF16_TC)");
    if (!T || T > c->T || !cols || cols > c->E || !rows || rows > c->E || rows > c->nmix)
        return st_error_set(ST_EINVAL, "gemm probe: %u x %u for %u inputs (at most %u x %u, %u "
                            "inputs)", rows, cols, T, c->E, c->E, c->T);
    pthread_mutex_lock(&e->lock);
    int rc = 0;
    bf16 *xb = (bf16 *)c->xnb; /* [T][E] */
    float *yd = c->mix;        /* [T][nmix], nmix >= 2F >= ... : rows <= E fits as [T][rows] */
    bf16 *hx = (bf16 *)malloc((size_t)T * cols * sizeof *hx);
    if (!hx) {
        pthread_mutex_unlock(&e->lock);
        return st_error_set(ENOMEM, "gemm probe: %zu bytes", (size_t)T * cols * sizeof *hx);
    }
    for (uint64_t i = 0; i < (uint64_t)T * cols; i++)
        hx[i] = __float2bfloat16_rn(x[i]);
    CUG(cudaMemcpyAsync(xb, hx, (size_t)T * cols * sizeof *hx, cudaMemcpyHostToDevice, c->stream));
    if ((rc = gemm_f16(c, (const bf16 *)w_dev, immutable, rows, cols, xb, cols, T, yd, rows)))
        goto fail;
    CUG(cudaMemcpyAsync(y, yd, (size_t)T * rows * 4, cudaMemcpyDeviceToHost, c->stream));
    CUG(cudaStreamSynchronize(c->stream));
    wcache_publish(c);
    free(hx);
    pthread_mutex_unlock(&e->lock);
    return 0;
fail:
    cu_release(cudaStreamSynchronize(c->stream), "cudaStreamSynchronize");
    wcache_publish(c);
    free(hx);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

extern "C" const st_backend st_backend_cuda = {
    "cuda",
    cu_create,
    cu_destroy,
    cu_tensors,
    cu_state_new,
    cu_state_free,
    cu_state_reset,
    cu_forward,
    cu_running_read,
    cu_running_write,
    cu_kv_read,
    cu_kv_write,
    cu_save,
    cu_load,
    cu_image_allocator,
    NULL, /* load_adopt: the state is device memory; restores copy */
    NULL, /* adopt */
    cu_wcache_get,
    cu_wcache_invalidate,
    cu_xcache_get,
    1, /* load_waits: xfer_load waits for each chunk of a gated image */
};
