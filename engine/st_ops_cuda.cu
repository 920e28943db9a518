/*
 * st_ops_cuda.cu - the operation table (st_ops_int.h) on one GPU: every architecture's forward
 * pass (engine/arch/) runs on it unchanged, over device memory. The CUDA backend
 * (st_backend_cuda.cu) gives it a copy of the model whose weights are in their file types in
 * device memory, its K/V page blocks and its running buffers.
 *
 * Invariants:
 * 1. Every buffer an operation takes is device memory on the context's stream, except the
 *    token ids of get_rows and the st_mm / st_kv_view / st_dn_args structs (host). Operations
 *    only queue work; upload and download wait for their bytes. The forward pass therefore
 *    runs without a synchronisation except where the MoE layer downloads its selection.
 * 2. Products: a weight read for one token is the matrix-vector product of st_qmv_cuda.cu
 *    (every type has a kernel), dequantized in registers, when it is unstrided and it and x are
 *    16-byte aligned. By default (STRATA_CUDA_PREFILL unset or f16, read at st_ops_cuda_new), a
 *    product of several tokens of a weight that is not F32 runs on the tensor cores: the
 *    activations rounded to f16 once per matmul call (the products of one call share them), the
 *    weight's rows rounded to f16 a tile at a time (st_cuda_dequant_rows_h; F16 weights read in
 *    place), cuBLAS GemmEx with f16 inputs and f32 sums (the handle in its default math mode for
 *    that call only, atomics disallowed, a fixed workspace). With STRATA_CUDA_PREFILL=f32, and
 *    for a one-token product the matrix-vector kernels do not take, the rows are widened
 *    to f32 (st_cuda_dequant_rows, the CPU's exact values) into the scratch tile and multiplied
 *    by cuBLAS SGEMM (FP32, CUBLAS_PEDANTIC_MATH: no TF32). F32 weights go to SGEMM directly
 *    either way. Both use the one 64 MiB scratch tile (the f16 path: 16 MiB of weight, 48 MiB
 *    of activations, tokens taken in groups that fit).
 * 3. Determinism: every kernel gives each output to one thread, warp or block with fixed
 *    reduction orders and no atomics; attention splits the keys by a count fixed by the call's
 *    shape (tokens, heads, position; for one token the context length, the heads and the
 *    GPU's SM count, invariant 8) and adds the splits in order. The same inputs read in the
 *    same chunks give the same bits. The short convolution does the CPU's scalar operations in
 *    the CPU's order (st_kernels.c conv_scalar; from 16 tokens a thread per output, the same
 *    sums), and so does the delta rule for key widths other than 16, 32, 64, 128 and 256
 *    (delta_cols_scalar); its split form for those
 *    (k_delta_split) and the rest agree with the CPU within float rounding
 *    (tests/gpu/test_gpu_arch.c).
 * 4. The first failure (a launch, cuBLAS, a size beyond what the context was made for) is kept
 *    in the context; every later operation returns at once, and st_ops_cuda_error reports and
 *    clears it. The backend checks it after each forward pass.
 * 5. Nothing but upload and download waits for the stream or allocates, so a forward pass
 *    without them (every architecture but the MoE ones) can be captured into a CUDA graph
 *    (st_backend_cuda.cu invariant 8): get_rows stages its ids in pinned memory, which the
 *    graph's copy reads when it runs.
 * 6. For a single token, consecutive products of one matmul call that take the matrix-vector
 *    kernels with the same type and column count (q, k and v; gate and up; the layers' per-head
 *    views of a fused projection) are one launch (st_cuda_qmv_n, at most ST_CUDA_QMV_JOBS
 *    products). A row's result does not depend on the products beside it, so the bits are those
 *    of the separate products, whichever were grouped.
 * 7. STRATA_CUDA_OPS_PROFILE=1 (st_ops_cuda_new): every operation, and every product inside
 *    matmul by its path, waits for the stream before and after itself and adds its wall time to
 *    its row of a table printed to stderr when the context is freed: where a forward pass's
 *    time goes, launches included (the waits make the whole pass slower). =2: the same rows
 *    timed by events recorded on the stream around each operation, without waits (the GPU's
 *    time from an operation's first kernel to its last, gaps between its kernels included);
 *    the times are read between operations when the events run low. Either way one-token
 *    passes (decode) and the others (prefill) have tables of their own, told apart by the
 *    pass's get_rows.
 * 8. The dynamic mode (st_ops_cuda_dynamic; the backend's reusable decode graphs): get_rows
 *    also copies the position staged by st_ops_cuda_stage into device memory, and RoPE, the K/V
 *    store and attention read it there instead of their pos0 argument, so that one captured
 *    pass serves every position of a span. Attention of one token splits the keys into runs of
 *    a fixed count in both modes, set by the span of its position (st_ops_cuda_att_span: the
 *    power of two from OC_ATT_SPAN0 up that holds the keys, at most the context), the head
 *    count and the SM count (about 8 blocks per SM over the heads, at least OC_ATT_KS keys, no
 *    more splits than the partials' buffer holds); the dynamic mode launches the span's splits,
 *    those beyond the position empty (the merge passes over them exactly), so its bits are
 *    those of the direct launches, and a graph captured at one position serves its span (the
 *    backend captures again in the next one).
 * 9. Attention of several tokens in the f16 mode (invariant 2's default) over f16 K/V whose
 *    head_dim is a multiple of 16 runs on the tensor cores (k_attn_tc: tiles of 64 queries and
 *    64 keys, the queries and the softmax weights rounded to f16, scores, softmax and sums in
 *    f32, one pass over the keys with an online softmax, no splits). Otherwise (f32 mode, i8
 *    K/V, other widths) attention of several tokens is k_attn on the CUDA cores in f32.
 * 10. Attention of one token over f16 K/V (head_dim 8 x 2^k, 1, 2, 4 or 8 query heads per K/V
 *    head) is k_attn_dec in f32 in either mode: a block per (K/V head, split) reads each key once
 *    for the heads that share it, 16 bytes a lane; the splits are set as invariant 8 says, by
 *    the span and the K/V heads (about 4 blocks per SM, at least OC_ATT_KS keys, at least
 *    STRATA_CUDA_ATT_KEYS where set, no more than the partials hold); k_attn_merge adds them.
 *    STRATA_CUDA_ATT_DEC=0 keeps one-token attention on k_attn (for measurements). i8 K/V and
 *    other shapes take k_attn.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cublas_v2.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <mma.h>

extern "C" {
#include "st_ops_int.h"
#include "st_wtype.h"
}
#include "st_launch_cuda.cuh"
#include "st_reduce_cuda.cuh"

#define OC_BLAS_WS ((size_t)32 << 20)
#define OC_XQ_BYTES ((size_t)1 << 20) /* Q8_K activations of rows up to 917,504 values */
#define OC_DEQ_FLOATS ((size_t)16 << 20) /* the f32 tile of a widened weight: 64 MiB */
/* the f16 products (invariant 2) split the same 64 MiB: a weight tile of 16 MiB, then the
 * activations of up to 48 MiB */
#define OC_WH_HALVES ((size_t)8 << 20)
#define OC_XH_HALVES (OC_DEQ_FLOATS * 2 - OC_WH_HALVES)
#define OC_ATT_WARPS 8
#define OC_ATT_KS 32 /* keys per split of a one-token pass, at least (invariant 8) */
#define OC_ATT_SPAN0 256 /* the shortest span of a one-token pass (st_ops_cuda_att_span) */
#define OC_MAX_HD ST_CUDA_MAX_HEAD_DIM /* attention's head_dim: 8 elements per lane */

/* the profile's rows (invariant 7): the operations in table order, then the product paths */
enum {
    PR_GET_ROWS, PR_MATMUL, PR_ADD_RMSNORM, PR_RMSNORM_GATED, PR_L2NORM, PR_SWIGLU,
    PR_SHORT_CONV, PR_DN_GATES, PR_DELTA_RULE, PR_ROPE_NORM, PR_ROPE_NEOX, PR_RMSNORM_HEADS,
    PR_KV_STORE, PR_ATTENTION, PR_L2NORM_MAX, PR_SIGMOID_MUL, PR_MOE_ROUTE, PR_SCALE_ADD,
    PR_SIGMOID_SCALE, PR_QMV, PR_SGEMM, PR_DEQUANT_SGEMM, PR_GEMM16, PR_N
};
static const char *const k_prof_names[PR_N] = {
    "get_rows", "matmul (all)", "add_rmsnorm", "rmsnorm_gated", "l2norm", "swiglu",
    "short_conv", "dn_gates", "delta_rule", "rope_norm", "rope_neox", "rmsnorm_heads",
    "kv_store", "attention", "l2norm_max", "sigmoid_mul", "moe_route", "scale_add",
    "sigmoid_scale", "  product: qmv", "  product: sgemm f32", "  product: widen + sgemm",
    "  product: f16 tiles + gemm"};

#define PROF_EV 8192 /* events of the event-timed profile between two reads of their times */

typedef struct prof_span {
    int row, dec, e0, e1;
} prof_span;

struct st_ops_cuda {
    int prof;                  /* invariant 7: 0 off, 1 waits, 2 events */
    int prof_dec;              /* the pass being read is of one token (its get_rows said so) */
    double prof_s[2][PR_N], prof_t0[2];
    uint64_t prof_n[2][PR_N], prof_passes[2];
    cudaEvent_t *prof_ev;      /* PROF_EV events (profile 2) */
    prof_span *prof_span;      /* PROF_EV / 2 spans waiting for their times */
    int prof_used, prof_spans, prof_e0[2];
    cudaStream_t stream;
    cublasHandle_t blas;
    void *blas_ws;
    int err;
    uint32_t max_T, n_ctx, max_hd;
    int n_sm;
    uint32_t *tok_d;  /* get_rows' ids: max_T */
    uint32_t *tok_h;  /* their pinned staging (invariant 5) */
    uint64_t *pos_d;  /* the pass's position, read by the kernels in the dynamic mode (inv. 8) */
    uint64_t *pos_h;  /* its pinned staging */
    int dyn;          /* invariant 8 */
    float *deq;       /* a widened weight tile: OC_DEQ_FLOATS; or the f16 tiles (invariant 2) */
    int gemm16;       /* products and attention of several tokens on f16 tensor cores (2, 9) */
    const float *xh_src; /* the activations the f16 tile holds now (NULL: none), ... */
    uint32_t xh_ldx, xh_cols, xh_T; /* ... their layout: valid within one matmul call */
    float *att_part;  /* attention's split partials: att_cap x (max_hd + 2) */
    uint64_t att_cap;
    size_t dn_smem_max; /* the delta rule's shared memory limit */
    int att_dec;        /* one-token attention on k_attn_dec (invariant 10; STRATA_CUDA_ATT_DEC) */
    int qmv_pair;       /* gate, up and swiglu of one token in one launch (STRATA_CUDA_QMV_PAIR) */
    int qmv_i8;         /* Q4_K one-token products on int8 activations (STRATA_CUDA_QMV_I8) */
    uint8_t *xq;        /* with qmv_i8: the Q8_K activations, OC_XQ_BYTES */
    uint64_t att_keys;  /* its keys per split at least (STRATA_CUDA_ATT_KEYS; 0: the rule's) */
};

/* ---- errors (invariant 4) ------------------------------------------------------------------ */
static void oc_fail(st_ops_cuda *oc, int rc)
{
    if (!oc->err)
        oc->err = rc;
}

static int oc_cuda(st_ops_cuda *oc, cudaError_t e, const char *what)
{
    if (e == cudaSuccess)
        return 0;
    cudaGetLastError(); /* the runtime's last error, so that it blames no later call */
    if (!oc->err)
        oc->err = st_error_set(e == cudaErrorMemoryAllocation ? ENOMEM : ST_EIO,
                               "cuda operations: %s: %s (%s)", what, cudaGetErrorName(e),
                               cudaGetErrorString(e));
    return oc->err;
}

#define LAUNCHED(oc, name) oc_cuda((oc), cudaGetLastError(), "launch of " name)

static double prof_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Profile 2: the recorded spans' GPU times added to their rows, the events free again. */
static void prof_flush(st_ops_cuda *oc)
{
    if (!oc->prof_used)
        return;
    cudaEventSynchronize(oc->prof_ev[oc->prof_used - 1]);
    for (int i = 0; i < oc->prof_spans; i++) {
        const prof_span *sp = &oc->prof_span[i];
        float ms = 0.0f;
        if (cudaEventElapsedTime(&ms, oc->prof_ev[sp->e0], oc->prof_ev[sp->e1]) == cudaSuccess) {
            oc->prof_s[sp->dec][sp->row] += ms * 1e-3;
            oc->prof_n[sp->dec][sp->row]++;
        }
    }
    cudaGetLastError();
    oc->prof_used = oc->prof_spans = 0;
}

/* level 0: an operation, 1: a product inside matmul */
static void prof_begin(st_ops_cuda *oc, int level)
{
    if (oc->prof == 2) {
        /* read the times only between operations (no span open); a product that finds no
         * room left is not timed (its operation is) */
        if (level == 0 && oc->prof_used + PROF_EV / 4 > PROF_EV)
            prof_flush(oc);
        if (oc->prof_used + 3 > PROF_EV) { /* the open operation's end keeps its event */
            oc->prof_e0[level] = -1;
            return;
        }
        oc->prof_e0[level] = oc->prof_used;
        cudaEventRecord(oc->prof_ev[oc->prof_used++], oc->stream);
        return;
    }
    cudaStreamSynchronize(oc->stream);
    oc->prof_t0[level] = prof_now();
}

static void prof_end(st_ops_cuda *oc, int level, int row)
{
    if (oc->prof == 2) {
        if (oc->prof_e0[level] < 0)
            return;
        int e1 = oc->prof_used++;
        cudaEventRecord(oc->prof_ev[e1], oc->stream);
        oc->prof_span[oc->prof_spans++] = (prof_span){row, oc->prof_dec, oc->prof_e0[level], e1};
        return;
    }
    cudaStreamSynchronize(oc->stream);
    oc->prof_s[oc->prof_dec][row] += prof_now() - oc->prof_t0[level];
    oc->prof_n[oc->prof_dec][row]++;
}

int st_ops_cuda_error(st_ops_cuda *oc)
{
    int rc = oc->err;
    oc->err = 0;
    return rc;
}

/* ---- helpers ------------------------------------------------------------------------------- */
__device__ __forceinline__ float oc_silu(float x) { return x / (1.0f + expf(-x)); }
__device__ __forceinline__ float oc_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
__device__ __forceinline__ float oc_softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* The dynamic mode's position for a kernel (invariant 8), else NULL: the argument counts. */
#define POSP(oc) ((oc)->dyn ? (const uint64_t *)(oc)->pos_d : (const uint64_t *)NULL)

static unsigned blocks_for(uint64_t n, unsigned per)
{
    uint64_t b = (n + per - 1) / per;
    return (unsigned)(b < 65535u * 16u ? (b ? b : 1) : 65535u * 16u);
}

/* ---- memory ---------------------------------------------------------------------------------- */
static void *oc_mem_alloc(void *ocp, size_t bytes)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    if (cudaMemsetAsync(p, 0, bytes ? bytes : 1, oc->stream) != cudaSuccess ||
        cudaStreamSynchronize(oc->stream) != cudaSuccess) {
        cudaGetLastError();
        cudaFree(p);
        return NULL;
    }
    return p;
}

static void oc_mem_free(void *ocp, void *p)
{
    (void)ocp;
    if (p)
        cudaFree(p);
}

static void oc_copy(st_ops_cuda *oc, void *dst, const void *src, size_t bytes, cudaMemcpyKind k)
{
    if (oc->err || !bytes)
        return;
    if (!oc_cuda(oc, cudaMemcpyAsync(dst, src, bytes, k, oc->stream), "cudaMemcpyAsync"))
        oc_cuda(oc, cudaStreamSynchronize(oc->stream), "cudaStreamSynchronize");
}

static void oc_upload(void *ocp, void *dst, const void *src, size_t bytes)
{
    oc_copy((st_ops_cuda *)ocp, dst, src, bytes, cudaMemcpyHostToDevice);
}

static void oc_download(void *ocp, void *dst, const void *src, size_t bytes)
{
    oc_copy((st_ops_cuda *)ocp, dst, src, bytes, cudaMemcpyDeviceToHost);
}

/* ---- rows and products (invariant 2) ------------------------------------------------------- */
static void oc_get_rows(void *ocp, const st_wmat *w, const uint32_t *rows, uint32_t T, float *x,
                        uint32_t ldx)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->prof) { /* a pass begins with its rows: the profile's rows of its kind */
        oc->prof_dec = T == 1;
        oc->prof_passes[oc->prof_dec]++;
    }
    if (oc->err)
        return;
    if (T > oc->max_T)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: %u rows (at most %u)", T,
                                        oc->max_T));
    /* through pinned memory, which a captured copy reads when the graph runs; the stream is
     * idle between forward passes, so no earlier copy still reads it */
    memcpy(oc->tok_h, rows, (size_t)T * 4);
    if (oc_cuda(oc, cudaMemcpyAsync(oc->tok_d, oc->tok_h, (size_t)T * 4, cudaMemcpyHostToDevice,
                                    oc->stream), "cudaMemcpyAsync (row ids)"))
        return;
    if (oc->dyn && oc_cuda(oc, cudaMemcpyAsync(oc->pos_d, oc->pos_h, sizeof *oc->pos_d,
                                               cudaMemcpyHostToDevice, oc->stream),
                           "cudaMemcpyAsync (position)"))
        return;
    int rc = st_cuda_dequant_rows(w->type, w->data, st_wmat_row_bytes(w), w->cols, oc->tok_d, 0,
                                  T, x, ldx, oc->stream);
    if (rc)
        oc_fail(oc, rc);
}

static int oc_sgemm(st_ops_cuda *oc, const float *W, uint32_t rows, uint32_t cols, uint32_t ldw,
                    const float *x, uint32_t ldx, uint32_t T, float *y, uint32_t ldy)
{
    const float one = 1.0f, zero = 0.0f;
    /* y (column-major rows x T, ldy) = W^T' x: W row-major is column-major cols x rows */
    cublasStatus_t st = cublasSgemm(oc->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T,
                                    (int)cols, &one, W, (int)ldw, x, (int)ldx, &zero, y, (int)ldy);
    if (st != CUBLAS_STATUS_SUCCESS) {
        oc_fail(oc, st_error_set(st == CUBLAS_STATUS_ALLOC_FAILED ? ENOMEM : ST_EIO,
                                 "cuda operations: cublasSgemm %u x %u x %u: %s", rows, cols, T,
                                 cublasGetStatusName(st)));
        return oc->err;
    }
    return 0;
}

/* Activations (T rows of cols, ldx apart) rounded to f16, packed (cols apart): a block row per
 * token, its threads over the columns. */
__global__ void k_to_half(const float *x, uint32_t ldx, uint32_t cols, uint32_t T, __half *y)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    for (uint32_t t = blockIdx.y; t < T; t += gridDim.y)
        for (uint32_t c = blockIdx.x * blockDim.x + threadIdx.x; c < cols;
             c += gridDim.x * blockDim.x)
            y[(size_t)t * cols + c] = __float2half_rn(x[(size_t)t * ldx + c]);
}

/* y (f32, rows x T, ldy) = W x on the tensor cores: W f16 row-major (ldw), x f16 packed (cols
 * apart), products in f16, sums in f32 (CUBLAS_COMPUTE_32F). The handle's pedantic mode keeps
 * SGEMM on FP32 (no TF32); for this call it takes the default mode, which lets cuBLAS use the
 * tensor cores. */
static int oc_gemm16(st_ops_cuda *oc, const void *W, uint32_t rows, uint32_t cols, uint32_t ldw,
                     const __half *x, uint32_t T, float *y, uint32_t ldy)
{
    const float one = 1.0f, zero = 0.0f;
    cublasStatus_t st = cublasSetMathMode(oc->blas, CUBLAS_DEFAULT_MATH);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = cublasGemmEx(oc->blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T, (int)cols, &one,
                          W, CUDA_R_16F, (int)ldw, x, CUDA_R_16F, (int)cols, &zero, y, CUDA_R_32F,
                          (int)ldy, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    cublasStatus_t st2 = cublasSetMathMode(oc->blas, CUBLAS_PEDANTIC_MATH);
    if (st == CUBLAS_STATUS_SUCCESS)
        st = st2;
    if (st != CUBLAS_STATUS_SUCCESS) {
        oc_fail(oc, st_error_set(st == CUBLAS_STATUS_ALLOC_FAILED ? ENOMEM : ST_EIO,
                                 "cuda operations: cublasGemmEx (f16) %u x %u x %u: %s", rows,
                                 cols, T, cublasGetStatusName(st)));
        return oc->err;
    }
    return 0;
}

/* A product of several tokens on the tensor cores (invariant 2): the activations rounded to f16
 * once per matmul call and token group, the weight rounded to f16 a row tile at a time (F16
 * weights read in place), then oc_gemm16. */
static void oc_product16(st_ops_cuda *oc, const st_mm *p, const float *x, uint32_t ldx,
                         uint32_t T)
{
    const st_wmat *w = p->w;
    uint32_t rows = w->rows, cols = w->cols;
    __half *wh = (__half *)oc->deq, *xh = wh + OC_WH_HALVES;
    uint32_t tg = (uint32_t)(OC_XH_HALVES / cols < T ? OC_XH_HALVES / cols : T);
    uint32_t tile = (uint32_t)(OC_WH_HALVES / cols);
    if (!tg || !tile)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: rows of %u columns", cols));
    if (oc->prof)
        prof_begin(oc, 1);
    uint64_t rb = st_wmat_row_bytes(w);
    for (uint32_t t0 = 0; t0 < T && !oc->err; t0 += tg) {
        uint32_t nt = T - t0 < tg ? T - t0 : tg;
        const float *xs = x + (size_t)t0 * ldx;
        if (oc->xh_src != xs || oc->xh_ldx != ldx || oc->xh_cols != cols || oc->xh_T != nt) {
            dim3 grid((cols + 255) / 256, nt < 65535u ? nt : 65535u);
            (void)st_launch(k_to_half, grid, 256, 0, oc->stream, xs, ldx, cols, nt, xh);
            if (LAUNCHED(oc, "k_to_half"))
                return;
            oc->xh_src = xs;
            oc->xh_ldx = ldx;
            oc->xh_cols = cols;
            oc->xh_T = nt;
        }
        float *ys = p->y + (size_t)t0 * p->ldy;
        if (w->type == ST_GGML_F16) {
            oc_gemm16(oc, w->data, rows, cols, cols, xh, nt, ys, p->ldy);
            continue;
        }
        for (uint32_t r0 = 0; r0 < rows; r0 += tile) {
            uint32_t nr = rows - r0 < tile ? rows - r0 : tile;
            int rc = st_cuda_dequant_rows_h(w->type, w->data, rb, cols, NULL, r0, nr, wh, cols,
                                            oc->stream);
            if (rc)
                return oc_fail(oc, rc);
            if (oc_gemm16(oc, wh, nr, cols, cols, xh, nt, ys + r0, p->ldy))
                return;
        }
    }
    if (oc->prof)
        prof_end(oc, 1, PR_GEMM16);
}

/* Whether product p of one token takes the matrix-vector kernels (invariant 2). */
static int qmv_ok(const st_mm *p, const float *x)
{
    const st_wmat *w = p->w;
    return st_cuda_qmv_supported(w->type) && (!w->stride || w->stride == w->cols) &&
           ((uintptr_t)x & 15) == 0 && ((uintptr_t)w->data & 15) == 0;
}

/* Whether weight a's one-token products take the integer form (STRATA_CUDA_QMV_I8=1: Q4_K;
 * st_qmv_cuda.cu invariant 7). */
static int qmv_i8_ok(const st_ops_cuda *oc, const st_wmat *a)
{
    return oc->qmv_i8 && oc->xq && a->type == ST_GGML_Q4_K && a->cols % 256 == 0 &&
           (size_t)a->cols / 256 * 292 <= OC_XQ_BYTES;
}

static void oc_product(st_ops_cuda *oc, const st_mm *p, const float *x, uint32_t ldx, uint32_t T)
{
    const st_wmat *w = p->w;
    uint32_t rows = w->rows, cols = w->cols;
    if (w->stride && w->stride != cols)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: a strided weight"));
    if (T > 1 && oc->gemm16 && w->type != ST_GGML_F32)
        return oc_product16(oc, p, x, ldx, T);
    if (oc->prof)
        prof_begin(oc, 1);
    if (w->type == ST_GGML_F32) {
        oc_sgemm(oc, (const float *)w->data, rows, cols, cols, x, ldx, T, p->y, p->ldy);
        if (oc->prof)
            prof_end(oc, 1, PR_SGEMM);
        return;
    }
    uint64_t rb = st_wmat_row_bytes(w);
    oc->xh_src = NULL; /* the f32 tile overwrites the f16 activations */
    uint32_t tile = (uint32_t)(OC_DEQ_FLOATS / cols);
    if (tile == 0)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: rows of %u columns", cols));
    for (uint32_t r0 = 0; r0 < rows; r0 += tile) {
        uint32_t nr = rows - r0 < tile ? rows - r0 : tile;
        int rc = st_cuda_dequant_rows(w->type, w->data, rb, cols, NULL, r0, nr, oc->deq, cols,
                                      oc->stream);
        if (rc)
            return oc_fail(oc, rc);
        if (oc_sgemm(oc, oc->deq, nr, cols, cols, x, ldx, T, p->y + r0, p->ldy))
            return;
    }
    if (oc->prof)
        prof_end(oc, 1, PR_DEQUANT_SGEMM);
}

/* Invariant 6: for one token, the products from mm[i] of the same type and column count that
 * take the matrix-vector kernels, up to ST_CUDA_QMV_JOBS of them, in one launch; returns how
 * many it took (0: mm[i] does not take those kernels). */
static uint32_t oc_qmv_run(st_ops_cuda *oc, const float *x, const st_mm *mm, uint32_t i, uint32_t n)
{
    st_cuda_qmv_job jobs[ST_CUDA_QMV_JOBS];
    const st_wmat *a = mm[i].w;
    uint32_t k = 0;
    while (i + k < n && k < ST_CUDA_QMV_JOBS && qmv_ok(&mm[i + k], x) &&
           mm[i + k].w->type == a->type && mm[i + k].w->cols == a->cols) {
        jobs[k] = (st_cuda_qmv_job){mm[i + k].w->data, mm[i + k].y, mm[i + k].w->rows};
        k++;
    }
    if (!k)
        return 0;
    if (oc->prof)
        prof_begin(oc, 1);
    int rc;
    if (qmv_i8_ok(oc, a)) {
        if (!(rc = st_cuda_quant_q8_k(x, a->cols, oc->xq, oc->stream)))
            rc = st_cuda_qmv_n_i8(a->type, a->cols, jobs, k, oc->xq, oc->stream);
    } else {
        rc = st_cuda_qmv_n(a->type, a->cols, jobs, k, x, oc->stream);
    }
    if (rc)
        oc_fail(oc, rc);
    if (oc->prof)
        prof_end(oc, 1, PR_QMV);
    return k;
}

static void oc_matmul(void *ocp, const float *x, uint32_t ldx, uint32_t T, const st_mm *mm,
                      uint32_t n)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    oc->xh_src = NULL; /* x holds new values: the f16 copy of another call is stale */
    for (uint32_t i = 0; i < n && !oc->err;) {
        uint32_t k = T == 1 ? oc_qmv_run(oc, x, mm, i, n) : 0;
        if (!k) {
            oc_product(oc, &mm[i], x, ldx, T);
            k = 1;
        }
        i += k;
    }
}

/* ---- norms and element-wise steps ------------------------------------------------------------ */
/* Per token (block): x += add, y = x / sqrt(mean(x^2) + eps) * w. */
__global__ void k_add_rmsnorm(float *x, const float *add, const float *w, uint32_t n, float eps,
                              float *y)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    float *xt = x + (size_t)blockIdx.x * n;
    float *yt = y + (size_t)blockIdx.x * n;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
        float v = xt[i];
        if (add)
            v = v + add[(size_t)blockIdx.x * n + i];
        xt[i] = v;
        ss = __fmaf_rn(v, v, ss);
    }
    __shared__ float sh[32];
    ss = st_block_sum(ss, sh);
    float sc = 1.0f / sqrtf(ss / (float)n + eps);
    for (uint32_t i = threadIdx.x; i < n; i += blockDim.x)
        yt[i] = xt[i] * sc * w[i];
}

static void oc_add_rmsnorm(void *ocp, float *x, const float *add, const float *w, uint32_t n,
                           float eps, float *y, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->err)
        return;
    (void)st_launch(k_add_rmsnorm, T, 256, 0, oc->stream, x, add, w, n, eps, y);
    LAUNCHED(oc, "k_add_rmsnorm");
}

/* Per (token, head) block over hd values at x + t * ld + h * hd. mode 0: RMSNorm with w; 1:
 * RMSNorm with w, times silu(z) (z laid out as x); 2: x * (1 / sqrt(sum + eps)) * scale; 3:
 * x * (1 / max(sqrt(sum), eps)) * scale. */
__global__ void k_head_norm(float *x, uint32_t ld, uint32_t hd, const float *w, const float *z,
                            float eps, float scale, int mode)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    float *v = x + (size_t)blockIdx.x * ld + (size_t)blockIdx.y * hd;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
        ss = __fmaf_rn(v[i], v[i], ss);
    __shared__ float sh[32];
    ss = st_block_sum(ss, sh);
    if (mode <= 1) {
        float sc = 1.0f / sqrtf(ss / (float)hd + eps);
        const float *g = z ? z + (size_t)blockIdx.x * ld + (size_t)blockIdx.y * hd : NULL;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x) {
            float o = v[i] * sc * w[i];
            v[i] = mode == 1 ? o * oc_silu(g[i]) : o;
        }
    } else {
        float n = sqrtf(mode == 2 ? ss + eps : ss);
        float nx = mode == 2 ? 1.0f / n : 1.0f / (n > eps ? n : eps);
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
            v[i] = v[i] * nx * scale;
    }
}

static void head_norm(st_ops_cuda *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                      const float *w, const float *z, float eps, float scale, int mode, uint32_t T)
{
    if (oc->err || !T || !heads)
        return;
    unsigned th = hd >= 128 ? 128 : 32;
    (void)st_launch(k_head_norm, dim3(T, heads), th, 0, oc->stream, x, ld, hd, w, z, eps, scale,
                    mode);
    LAUNCHED(oc, "k_head_norm");
}

static void oc_rmsnorm_gated(void *ocp, float *x, const float *z, const float *w, uint32_t heads,
                             uint32_t hd, float eps, uint32_t T)
{
    head_norm((st_ops_cuda *)ocp, x, heads * hd, heads, hd, w, z, eps, 1.0f, 1, T);
}

static void oc_l2norm(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd, float eps,
                      float scale, uint32_t T)
{
    head_norm((st_ops_cuda *)ocp, x, ld, heads, hd, NULL, NULL, eps, scale, 2, T);
}

static void oc_l2norm_max(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                          float eps, float scale, uint32_t T)
{
    head_norm((st_ops_cuda *)ocp, x, ld, heads, hd, NULL, NULL, eps, scale, 3, T);
}

static void oc_rmsnorm_heads(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                             const float *w, float eps, uint32_t T)
{
    head_norm((st_ops_cuda *)ocp, x, ld, heads, hd, w, NULL, eps, 1.0f, 0, T);
}

/* Element-wise over T rows of n: op 0 swiglu (x = silu(x) * y), 1 sigmoid_mul (x *= sigmoid(y)),
 * 2 scale_add (x += s * y, s per row or 1), 3 sigmoid_scale (x *= sigmoid(s per row)). */
__global__ void k_elem(float *x, uint32_t ldx, const float *y, uint32_t ldy, const float *s,
                       uint32_t lds, uint32_t n, uint32_t T, int op)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint64_t total = (uint64_t)n * T;
    for (uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (uint64_t)gridDim.x * blockDim.x) {
        uint32_t t = (uint32_t)(i / n), c = (uint32_t)(i % n);
        float *xv = x + (size_t)t * ldx + c;
        switch (op) {
        case 0: *xv = oc_silu(*xv) * y[(size_t)t * ldy + c]; break;
        case 1: *xv = *xv * oc_sigmoid(y[(size_t)t * ldy + c]); break;
        case 2: *xv = *xv + (s ? s[(size_t)t * lds] : 1.0f) * y[(size_t)t * ldy + c]; break;
        default: *xv = *xv * oc_sigmoid(s[(size_t)t * lds]); break;
        }
    }
}

static void elem(st_ops_cuda *oc, float *x, uint32_t ldx, const float *y, uint32_t ldy,
                 const float *s, uint32_t lds, uint32_t n, uint32_t T, int op)
{
    if (oc->err || !n || !T)
        return;
    (void)st_launch(k_elem, blocks_for((uint64_t)n * T, 256), 256, 0, oc->stream, x, ldx, y, ldy, s,
                    lds, n, T, op);
    LAUNCHED(oc, "k_elem");
}

static void oc_swiglu(void *ocp, float *g, const float *u, uint32_t n, uint32_t T)
{
    elem((st_ops_cuda *)ocp, g, n, u, n, NULL, 0, n, T, 0);
}

/* One token's gate and up products with their swiglu in one launch where both take the paired
 * kernel (st_qmv_cuda.cu invariant 6: the same bits); otherwise the two products and swiglu. */
static void oc_matmul_swiglu(void *ocp, const float *x, uint32_t ldx, uint32_t T, const st_mm *mm)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    const st_wmat *g = mm[0].w, *u = mm[1].w;
    if (T == 1 && oc->qmv_pair && qmv_ok(&mm[0], x) && qmv_ok(&mm[1], x) &&
        g->type == u->type && g->rows == u->rows && g->cols == u->cols &&
        st_cuda_qmv_swiglu_supported(g->type)) {
        if (oc->err)
            return;
        oc->xh_src = NULL;
        if (oc->prof)
            prof_begin(oc, 1);
        int rc;
        if (qmv_i8_ok(oc, g)) {
            if (!(rc = st_cuda_quant_q8_k(x, g->cols, oc->xq, oc->stream)))
                rc = st_cuda_qmv_swiglu_i8(g->type, g->rows, g->cols, g->data, u->data, oc->xq,
                                           mm[0].y, oc->stream);
        } else {
            rc = st_cuda_qmv_swiglu(g->type, g->rows, g->cols, g->data, u->data, x, mm[0].y,
                                    oc->stream);
        }
        if (rc)
            oc_fail(oc, rc);
        if (oc->prof)
            prof_end(oc, 1, PR_QMV);
        return;
    }
    oc_matmul(oc, x, ldx, T, mm, 2);
    oc_swiglu(oc, mm[0].y, mm[1].y, g->rows, T);
}

static void oc_sigmoid_mul(void *ocp, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                           uint32_t n, uint32_t T)
{
    elem((st_ops_cuda *)ocp, x, ldx, g, ldg, NULL, 0, n, T, 1);
}

static void oc_scale_add(void *ocp, float *x, uint32_t ldx, const float *y, uint32_t ldy,
                         const float *s, uint32_t lds, uint32_t n, uint32_t T)
{
    elem((st_ops_cuda *)ocp, x, ldx, y, ldy, s, lds, n, T, 2);
}

static void oc_sigmoid_scale(void *ocp, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                             uint32_t n, uint32_t T)
{
    elem((st_ops_cuda *)ocp, x, ldx, NULL, 0, g, ldg, n, T, 3);
}

/* ---- the Gated DeltaNet steps ----------------------------------------------------------------- */
/* One thread per channel over every token: the CPU's conv_scalar, then SiLU. */
__global__ void k_short_conv(const float *x, float *y, uint32_t C, float *st, const float *wT,
                             uint32_t T)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    float h0 = st[c], h1 = st[C + c], h2 = st[2 * (size_t)C + c];
    float w0 = wT[c], w1 = wT[C + c], w2 = wT[2 * (size_t)C + c], w3 = wT[3 * (size_t)C + c];
    for (uint32_t t = 0; t < T; t++) {
        float xt = x[(size_t)t * C + c];
        float acc = __fmaf_rn(w0, h0, 0.0f);
        acc = __fmaf_rn(w1, h1, acc);
        acc = __fmaf_rn(w2, h2, acc);
        acc = __fmaf_rn(w3, xt, acc);
        y[(size_t)t * C + c] = oc_silu(acc);
        h0 = h1;
        h1 = h2;
        h2 = xt;
    }
    st[c] = h0;
    st[C + c] = h1;
    st[2 * (size_t)C + c] = h2;
}

/* The same outputs for many tokens, a thread per (token, channel): the history of token t is
 * x[t - 3 .. t - 1], reaching into the state for t < 3; the sums in k_short_conv's order, so
 * the same bits. The state is left as it was; k_short_conv_tail moves it on. */
__global__ void k_short_conv_par(const float *x, float *y, uint32_t C, const float *st,
                                 const float *wT, uint32_t T)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (uint64_t)T * C)
        return;
    uint32_t t = (uint32_t)(i / C), c = (uint32_t)(i % C);
    float h[3];
#pragma unroll
    for (uint32_t k = 0; k < 3; k++) { /* element t + k of [state 0..2, x 0..T-1] */
        uint32_t e = t + k;
        h[k] = e < 3 ? st[(size_t)e * C + c] : x[(size_t)(e - 3) * C + c];
    }
    float acc = __fmaf_rn(wT[c], h[0], 0.0f);
    acc = __fmaf_rn(wT[C + c], h[1], acc);
    acc = __fmaf_rn(wT[2 * (size_t)C + c], h[2], acc);
    acc = __fmaf_rn(wT[3 * (size_t)C + c], x[(size_t)t * C + c], acc);
    y[(size_t)t * C + c] = oc_silu(acc);
}

/* The state after T tokens: elements T .. T + 2 of [state 0..2, x 0..T-1], in place (ascending:
 * each reads an element at or after the one it writes). */
__global__ void k_short_conv_tail(const float *x, uint32_t C, float *st, uint32_t T)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint32_t c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C)
        return;
    for (uint32_t k = 0; k < 3; k++) {
        uint32_t e = T + k;
        st[(size_t)k * C + c] = e < 3 ? st[(size_t)e * C + c] : x[(size_t)(e - 3) * C + c];
    }
}

#define OC_CONV_PAR_T 16 /* from this many tokens the convolution is a thread per output */

static void oc_short_conv(void *ocp, const float *x, float *y, uint32_t C, float *state,
                          const float *wT, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->err || !C || !T)
        return;
    if (T < OC_CONV_PAR_T) {
        (void)st_launch(k_short_conv, (C + 127) / 128, 128, 0, oc->stream, x, y, C, state, wT, T);
        LAUNCHED(oc, "k_short_conv");
        return;
    }
    (void)st_launch(k_short_conv_par, blocks_for((uint64_t)T * C, 256), 256, 0, oc->stream, x, y,
                    C, (const float *)state, wT, T);
    if (LAUNCHED(oc, "k_short_conv_par"))
        return;
    (void)st_launch(k_short_conv_tail, (C + 127) / 128, 128, 0, oc->stream, x, C, state, T);
    LAUNCHED(oc, "k_short_conv_tail");
}

__global__ void k_dn_gates(float *a, float *b, uint32_t ld, const float *ssm_a,
                           const float *dt_bias, uint32_t H, uint32_t T)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (uint64_t)H * T)
        return;
    uint32_t t = (uint32_t)(i / H), h = (uint32_t)(i % H);
    float *av = a + (size_t)t * ld + h, *bv = b + (size_t)t * ld + h;
    float g = ssm_a[h] * oc_softplus(*av + dt_bias[h]);
    *av = expf(g);
    *bv = oc_sigmoid(*bv);
}

static void oc_dn_gates(void *ocp, float *a, float *b, uint32_t ld, const float *ssm_a,
                        const float *dt_bias, uint32_t H, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->err || !H || !T)
        return;
    (void)st_launch(k_dn_gates, blocks_for((uint64_t)H * T, 128), 128, 0, oc->stream, a, b, ld,
                    ssm_a, dt_bias, H, T);
    LAUNCHED(oc, "k_dn_gates");
}

/* The delta rule: one block per value head, one thread per value column j (blockDim >= dv),
 * the head's matrix M [dk][dv] (S transposed) in shared memory with the token's q and k (SM
 * false: a head too large for it is updated in place in the state, in global memory). Thread
 * j does the CPU's delta_cols_scalar for its column, in its order: u from the previous token's
 * pass, d = b (v - a u), then over i: M = fma(k_i, d, a M), o = fma(M, q_i, o), u = fma(M,
 * k'_i, u) with the next token's k. */
/* Both forms of the delta rule step to token t alike: q_t into qs and k_t (held in kn) into ks,
 * then k_{t+1} into kn where there is one; every thread of the block takes part, and the
 * barriers keep the previous token's readers ahead of the writes. */
__device__ __forceinline__ void dn_stage(const st_dn_args &a, uint32_t t, uint32_t kh, uint32_t dk,
                                         float *qs, float *ks, float *kn)
{
    __syncthreads();
    const float *qt = a.q + (size_t)t * a.ld + (size_t)kh * dk;
    for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x) {
        qs[i] = qt[i];
        ks[i] = kn[i];
    }
    __syncthreads();
    if (t + 1 < a.T)
        for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x)
            kn[i] = a.k[(size_t)(t + 1) * a.ld + (size_t)kh * dk + i];
    __syncthreads();
}

template <bool SM>
__global__ void k_delta_rule(st_dn_args a)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    extern __shared__ float sm[];
    uint32_t dk = a.dk, dv = a.dv, h = blockIdx.x, j = threadIdx.x;
    uint32_t kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
    float *S = a.state + (size_t)h * dk * dv;
    float *M = SM ? sm : S, *qs = SM ? sm + (size_t)dk * dv : sm, *ks = qs + dk, *kn = ks + dk;
    if (SM)
        for (uint32_t i = threadIdx.x; i < dk * dv; i += blockDim.x)
            M[i] = S[i];
    for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x)
        kn[i] = a.k[(size_t)kh * dk + i];
    __syncthreads();
    float u = 0.0f;
    if (j < dv)
        for (uint32_t i = 0; i < dk; i++)
            u = __fmaf_rn(M[(size_t)i * dv + j], kn[i], u);
    for (uint32_t t = 0; t < a.T; t++) {
        dn_stage(a, t, kh, dk, qs, ks, kn);
        int more = t + 1 < a.T;
        if (j < dv) {
            float al = a.alpha[(size_t)t * a.ld_g + h], be = a.beta[(size_t)t * a.ld_g + h];
            float d = be * (a.v[(size_t)t * a.ld + (size_t)h * dv + j] - al * u);
            float o = 0.0f;
            u = 0.0f;
            for (uint32_t i = 0; i < dk; i++) {
                float *m = &M[(size_t)i * dv + j];
                float mv = __fmaf_rn(ks[i], d, al * *m);
                *m = mv;
                o = __fmaf_rn(mv, qs[i], o);
                if (more)
                    u = __fmaf_rn(mv, kn[i], u);
            }
            a.out[(size_t)t * a.ld_out + (size_t)h * dv + j] = o;
        }
    }
    __syncthreads();
    if (SM)
        for (uint32_t i = threadIdx.x; i < dk * dv; i += blockDim.x)
            S[i] = M[i];
}

/* The delta rule with a head's rows split over DS_P warps: a block per (value head, 32
 * columns), warp p holding rows [p R, p R + R) of its lane's column in registers for every token
 * of the call; u, o and the next u are sums of the warps' parts, added in warp order through
 * shared memory (two buffers by token parity: one barrier a token). The tokens' q and k rows, v
 * columns and gates come into shared memory DS_TC(R) tokens at a time, so no step waits for a load.
 * The order is not the CPU's (agreement within float rounding); dk = DS_P R. */
#define DS_P 8
/* tokens staged per chunk: their q and k rows, v columns and gates in shared memory at once, so
 * that a token's step waits for no load (with the sums' buffers at most about 41 KB) */
#define DS_TC(R) ((R) <= 16 ? 32 : 16)
template <int R>
__global__ void __launch_bounds__(32 * DS_P) k_delta_split(st_dn_args a)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    constexpr uint32_t TC = DS_TC(R), DK = DS_P * R;
    __shared__ float Qc[TC][DK], Kc[TC + 1][DK], Vc[TC][32], Ac[TC], Bc[TC];
    __shared__ float red[2][2][DS_P][32]; /* [token parity][o, u'] */
    const uint32_t dk = DK, dv = a.dv, h = blockIdx.x;
    const uint32_t lane = threadIdx.x & 31, p = threadIdx.x >> 5, j = blockIdx.y * 32 + lane;
    const bool live = j < dv;
    uint32_t kh = a.grouped ? h / (a.n_v_heads / a.n_k_heads) : h % a.n_k_heads;
    float *S = a.state + (size_t)h * dk * dv;
    float m[R];
#pragma unroll
    for (int r = 0; r < R; r++)
        m[r] = live ? S[(size_t)(p * R + r) * dv + j] : 0.0f;
    for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x)
        Kc[0][i] = a.k[(size_t)kh * dk + i];
    __syncthreads();
    float u = 0.0f;
#pragma unroll
    for (int r = 0; r < R; r++)
        u = __fmaf_rn(m[r], Kc[0][p * R + r], u);
    red[1][1][p][lane] = u;
    __syncthreads();
    u = 0.0f;
    for (int k = 0; k < DS_P; k++)
        u += red[1][1][k][lane];
    for (uint32_t c0 = 0; c0 < a.T; c0 += TC) {
        const uint32_t n = a.T - c0 < TC ? a.T - c0 : TC;
        __syncthreads(); /* the last chunk's rows are read */
        for (uint32_t i = threadIdx.x; i < n * dk; i += blockDim.x) {
            uint32_t t = c0 + i / dk, e = i % dk;
            Qc[i / dk][e] = a.q[(size_t)t * a.ld + (size_t)kh * dk + e];
            Kc[i / dk][e] = a.k[(size_t)t * a.ld + (size_t)kh * dk + e];
        }
        if (c0 + n < a.T) /* the key after the chunk: the next step's u */
            for (uint32_t i = threadIdx.x; i < dk; i += blockDim.x)
                Kc[n][i] = a.k[(size_t)(c0 + n) * a.ld + (size_t)kh * dk + i];
        for (uint32_t i = threadIdx.x; i < n * 32; i += blockDim.x) {
            uint32_t t = c0 + i / 32, jj = blockIdx.y * 32 + i % 32;
            Vc[i / 32][i % 32] = jj < dv ? a.v[(size_t)t * a.ld + (size_t)h * dv + jj] : 0.0f;
        }
        for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
            Ac[i] = a.alpha[(size_t)(c0 + i) * a.ld_g + h];
            Bc[i] = a.beta[(size_t)(c0 + i) * a.ld_g + h];
        }
        __syncthreads();
        for (uint32_t i = 0; i < n; i++) {
            const uint32_t t = c0 + i, par = t & 1;
            float al = Ac[i], be = Bc[i];
            float d = be * (Vc[i][lane] - al * u);
            float o = 0.0f, un = 0.0f;
#pragma unroll
            for (int r = 0; r < R; r++) {
                uint32_t e = p * R + r;
                float mv = __fmaf_rn(Kc[i][e], d, al * m[r]);
                m[r] = mv;
                o = __fmaf_rn(mv, Qc[i][e], o);
                un = __fmaf_rn(mv, Kc[i + 1][e], un);
            }
            red[par][0][p][lane] = o;
            red[par][1][p][lane] = un;
            __syncthreads(); /* a buffer is written again two steps on, past the next barrier */
            if (p == 0 && live) {
                float O = 0.0f;
                for (int k = 0; k < DS_P; k++)
                    O += red[par][0][k][lane];
                a.out[(size_t)t * a.ld_out + (size_t)h * dv + j] = O;
            }
            u = 0.0f;
            for (int k = 0; k < DS_P; k++)
                u += red[par][1][k][lane];
        }
    }
    if (live)
#pragma unroll
        for (int r = 0; r < R; r++)
            S[(size_t)(p * R + r) * dv + j] = m[r];
}

template <int R>
static void delta_split(st_ops_cuda *oc, const st_dn_args *a)
{
    (void)st_launch(k_delta_split<R>, dim3(a->n_v_heads, (a->dv + 31) / 32), 32 * DS_P, 0,
                    oc->stream, *a);
}

static void oc_delta_rule(void *ocp, const st_dn_args *a)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->err || !a->T || !a->n_v_heads)
        return;
    size_t vecs = 3 * (size_t)a->dk * sizeof(float);
    size_t smem = (size_t)a->dk * a->dv * sizeof(float) + vecs;
    if (vecs > oc->dn_smem_max || a->dv > ST_CUDA_MAX_SSM_DV)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: a DeltaNet head of %u x %u "
                                        "(at most %u columns)", a->dk, a->dv,
                                        ST_CUDA_MAX_SSM_DV));
    unsigned th = (a->dv + 31) / 32 * 32;
    switch (a->dk) {
    case 2 * DS_P: delta_split<2>(oc, a); LAUNCHED(oc, "k_delta_split"); return;
    case 4 * DS_P: delta_split<4>(oc, a); LAUNCHED(oc, "k_delta_split"); return;
    case 8 * DS_P: delta_split<8>(oc, a); LAUNCHED(oc, "k_delta_split"); return;
    case 16 * DS_P: delta_split<16>(oc, a); LAUNCHED(oc, "k_delta_split"); return;
    case 32 * DS_P: delta_split<32>(oc, a); LAUNCHED(oc, "k_delta_split"); return;
    default: break;
    }
    if (smem <= oc->dn_smem_max)
        (void)st_launch(k_delta_rule<true>, a->n_v_heads, th, smem, oc->stream, *a);
    else
        (void)st_launch(k_delta_rule<false>, a->n_v_heads, th, vecs, oc->stream, *a);
    LAUNCHED(oc, "k_delta_rule");
}

/* ---- RoPE ------------------------------------------------------------------------------------- */
/* Per (token, head) block, a thread per pair: angle, cosine and sine in double, rounded to
 * float, as the CPU's rope_angles. neox: pairs (i, i + n_rot / 2); else (2i, 2i + 1). */
__global__ void k_rope(float *x, uint32_t ld, uint32_t hd, uint32_t n_rot, uint64_t pos0,
                       const uint64_t *posp, const double *freq, int neox)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    if (posp)
        pos0 = *posp;
    float *v = x + (size_t)blockIdx.x * ld + (size_t)blockIdx.y * hd;
    uint32_t half = n_rot / 2;
    for (uint32_t i = threadIdx.x; i < half; i += blockDim.x) {
        double an = (double)(pos0 + blockIdx.x) * freq[i];
        float cs = (float)cos(an), sn = (float)sin(an);
        uint32_t i0 = neox ? i : 2 * i, i1 = neox ? i + half : 2 * i + 1;
        float x0 = v[i0], x1 = v[i1];
        v[i0] = x0 * cs - x1 * sn;
        v[i1] = x0 * sn + x1 * cs;
    }
}

static void rope(st_ops_cuda *oc, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                 uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T, int neox)
{
    if (oc->err || !T || !heads || n_rot < 2)
        return;
    (void)st_launch(k_rope, dim3(T, heads), 64, 0, oc->stream, x, ld, hd, n_rot, pos0, POSP(oc),
                    freq, neox);
    LAUNCHED(oc, "k_rope");
}

static void oc_rope_norm(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                         uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T)
{
    rope((st_ops_cuda *)ocp, x, ld, heads, hd, n_rot, pos0, freq, T, 0);
}

static void oc_rope_neox(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                         uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T)
{
    rope((st_ops_cuda *)ocp, x, ld, heads, hd, n_rot, pos0, freq, T, 1);
}

/* ---- the paged K/V ------------------------------------------------------------------------------ */
typedef struct oc_kv {
    uint8_t *const *blocks;
    uint64_t off_k, off_v, off_ks, off_vs, row, srow;
    uint32_t ps, hd, nkv, i8;
} oc_kv;

static int kv_of(st_ops_cuda *oc, const st_kv_view *v, oc_kv *g)
{
    if (!v->blocks || (v->dtype != ST_DTYPE_F16 && v->dtype != ST_DTYPE_I8) ||
        v->head_dim > oc->max_hd) {
        oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: a K/V view the CUDA backend did "
                                 "not make (dtype %u, head_dim %u)", v->dtype, v->head_dim));
        return oc->err;
    }
    g->blocks = v->blocks;
    g->off_k = v->off_k;
    g->off_v = v->off_v;
    g->off_ks = v->off_ks;
    g->off_vs = v->off_vs;
    g->row = v->row;
    g->srow = v->srow;
    g->ps = v->page_size;
    g->hd = v->head_dim;
    g->nkv = v->kv_heads;
    g->i8 = v->dtype == ST_DTYPE_I8;
    return 0;
}

__device__ __forceinline__ uint8_t *kv_at(const oc_kv &g, uint64_t off, uint64_t rb, uint64_t r)
{
    return g.blocks[r / g.ps] + off + (r % g.ps) * rb;
}

/* Per (token, K/V head) block of 128 threads: the K and V rows of head h into row pos0 + t, f16
 * (round to nearest even), or i8 with amax / 127 scales as the CPU's quant_i8. */
__global__ void k_kv_store(oc_kv g, const float *k, const float *v, uint32_t ld, uint64_t pos0,
                           const uint64_t *posp)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    if (posp)
        pos0 = *posp;
    __shared__ float sh[32];
    uint32_t t = blockIdx.x, h = blockIdx.y, hd = g.hd;
    uint64_t r = pos0 + t;
    for (int which = 0; which < 2; which++) {
        const float *src = (which ? v : k) + (size_t)t * ld + (size_t)h * hd;
        uint8_t *row = kv_at(g, which ? g.off_v : g.off_k, g.row, r);
        if (!g.i8) {
            __half *dst = (__half *)row + (size_t)h * hd;
            for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
                dst[i] = __float2half_rn(src[i]);
            continue;
        }
        float am = 0.0f;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
            am = fmaxf(am, fabsf(src[i]));
        am = st_block_max(am, sh);
        int8_t *dst = (int8_t *)row + (size_t)h * hd;
        float *sc = (float *)kv_at(g, which ? g.off_vs : g.off_ks, g.srow, r) + h;
        if (!(am > 0.0f) || !isfinite(am)) {
            for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x)
                dst[i] = 0;
            if (threadIdx.x == 0)
                *sc = 0.0f;
            continue;
        }
        float inv = 127.0f / am;
        for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x) {
            int q = __float2int_rn(src[i] * inv);
            dst[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
        }
        if (threadIdx.x == 0)
            *sc = am / 127.0f;
    }
}

static void oc_kv_store(void *ocp, const st_kv_view *kv, const float *k, const float *v,
                        uint32_t ld, uint64_t pos0, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    oc_kv g;
    if (oc->err || !T || kv_of(oc, kv, &g))
        return;
    (void)st_launch(k_kv_store, dim3(T, g.nkv), 128, 0, oc->stream, g, k, v, ld, pos0, POSP(oc));
    LAUNCHED(oc, "k_kv_store");
}

/* Attention, one block of OC_ATT_WARPS warps per (query token, head, key split). Warp w takes
 * keys j0 + w, j0 + w + OC_ATT_WARPS, ... of the split's range, each lane hd / 32 elements of
 * the head; an online softmax per warp (running max, sum and weighted values), then the warps
 * merged in warp order. One split: the output; several: the unnormalised partial sums, merged
 * by k_attn_merge in split order. */
typedef struct oc_attn {
    oc_kv g;
    const float *q;
    float *out, *part;
    uint32_t ldq, ldo, n_head, ks, nsplit;
    uint64_t pos0;
    const uint64_t *posp; /* the dynamic mode's position (invariant 8), else NULL */
    float scale;
} oc_attn;

__device__ __forceinline__ float kv_val(const oc_kv &g, const uint8_t *row, uint32_t i)
{
    return g.i8 ? (float)((const int8_t *)row)[i] : __half2float(((const __half *)row)[i]);
}

/* A K/V row's page and offset in 32-bit arithmetic (positions are below n_ctx, a uint32). */
__device__ __forceinline__ const uint8_t *kv_row(const oc_kv &g, uint64_t off, uint64_t rb,
                                                 uint32_t page, uint32_t in)
{
    return g.blocks[page] + off + (uint64_t)in * rb;
}

/* PER = ceil(head_dim / 32) elements per lane, a constant so that the query and the sums stay
 * in registers. A key's V elements are loaded with its K elements, before the dot product's
 * reduction, so that the two loads are in flight together; the arithmetic is the same. */
template <int PER>
__global__ void __launch_bounds__(32 * OC_ATT_WARPS) k_attn(oc_attn a)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    const oc_kv &g = a.g;
    uint32_t t = blockIdx.x, h = blockIdx.y, s = blockIdx.z;
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5, hd = g.hd;
    uint32_t kvh = h / (a.n_head / g.nkv);
    const uint32_t per = PER;
    uint64_t n = (a.posp ? *a.posp : a.pos0) + t + 1, j0 = (uint64_t)s * a.ks, j1 = j0 + a.ks < n ? j0 + a.ks : n;
    const float *q = a.q + (size_t)t * a.ldq + (size_t)h * hd;
    const size_t hoff = (size_t)kvh * hd * (g.i8 ? 1 : 2);
    float qv[PER], acc[PER], vv[PER];
#pragma unroll
    for (uint32_t e = 0; e < PER; e++) {
        uint32_t i = lane + 32 * e;
        qv[e] = i < hd ? q[i] : 0.0f;
        acc[e] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (uint64_t j = j0 + w; j < j1; j += OC_ATT_WARPS) {
        uint32_t page = (uint32_t)j / g.ps, in = (uint32_t)j % g.ps;
        const uint8_t *kr = kv_row(g, g.off_k, g.row, page, in) + hoff;
        const uint8_t *vr = kv_row(g, g.off_v, g.row, page, in) + hoff;
        float d = 0.0f;
#pragma unroll
        for (uint32_t e = 0; e < PER; e++) {
            uint32_t i = lane + 32 * e;
            vv[e] = i < hd ? kv_val(g, vr, i) : 0.0f;
            if (i < hd)
                d = __fmaf_rn(qv[e], kv_val(g, kr, i), d);
        }
        d = st_warp_sum(d);
        if (g.i8)
            d = d * ((const float *)kv_row(g, g.off_ks, g.srow, page, in))[kvh];
        float sc = d * a.scale;
        float mn = fmaxf(m, sc);
        float corr = expf(m - mn), p = expf(sc - mn);
        l = __fmaf_rn(l, corr, p);
        float vsc = g.i8 ? ((const float *)kv_row(g, g.off_vs, g.srow, page, in))[kvh] : 1.0f;
        float pv = p * vsc;
#pragma unroll
        for (uint32_t e = 0; e < PER; e++) {
            uint32_t i = lane + 32 * e;
            if (i < hd)
                acc[e] = __fmaf_rn(acc[e], corr, pv * vv[e]);
        }
        m = mn;
    }
    __shared__ float sm_m[OC_ATT_WARPS], sm_l[OC_ATT_WARPS];
    __shared__ float sm_o[OC_ATT_WARPS][OC_MAX_HD];
    if (lane == 0) {
        sm_m[w] = m;
        sm_l[w] = l;
    }
#pragma unroll
    for (uint32_t e = 0; e < per; e++) {
        uint32_t i = lane + 32 * e;
        if (i < hd)
            sm_o[w][i] = acc[e];
    }
    __syncthreads();
    float M = -INFINITY;
    for (int k = 0; k < OC_ATT_WARPS; k++)
        M = fmaxf(M, sm_m[k]);
    float L = 0.0f;
    for (int k = 0; k < OC_ATT_WARPS; k++)
        if (sm_m[k] != -INFINITY)
            L = __fmaf_rn(sm_l[k], expf(sm_m[k] - M), L);
    for (uint32_t i = threadIdx.x; i < hd; i += blockDim.x) {
        float o = 0.0f;
        for (int k = 0; k < OC_ATT_WARPS; k++)
            if (sm_m[k] != -INFINITY)
                o = __fmaf_rn(sm_o[k][i], expf(sm_m[k] - M), o);
        if (a.nsplit == 1) {
            a.out[(size_t)t * a.ldo + (size_t)h * hd + i] = o / L;
        } else {
            size_t base = (((size_t)t * a.n_head + h) * a.nsplit + s) * (hd + 2);
            a.part[base + 2 + i] = o;
            if (i == 0) {
                a.part[base] = M;
                a.part[base + 1] = L;
            }
        }
    }
}

/* The splits of a (token, head) merged: a block of 4 x hd' threads (hd' the head_dim rounded up
 * to a warp), dynamic shared memory of nsplit + 4 hd + 32 floats. The largest split maximum M;
 * the weights w_s = exp(M_s - M) of the splits that hold keys (an empty split, M_s = -inf, is
 * passed over: its sums were never written); L = sum of l_s w_s, each thread's splits in order,
 * then st_block_sum; output element i: thread group g (0..3) adds o_s[i] w_s over the splits
 * s = g, g + 4, ... in order, and the four groups are added in group order. Every order is fixed
 * by the head_dim alone, and a split's absence adds nothing (sums start at -0), so one split that
 * holds keys among empty ones gives o / l of that split exactly, as a single split's own output
 * does (invariant 8). */
__global__ void k_attn_merge(oc_attn a)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    extern __shared__ float msh[];
    uint32_t t = blockIdx.x, h = blockIdx.y, hd = a.g.hd, ns = a.nsplit, nt = blockDim.x;
    uint32_t hdr = nt / 4, grp = threadIdx.x / hdr, i = threadIdx.x % hdr;
    float *wt = msh, *red = msh + ns, *bsh = red + 4 * hd;
    const float *base = a.part + ((size_t)t * a.n_head + h) * ns * (hd + 2);
    float mx = -INFINITY;
    for (uint32_t s = threadIdx.x; s < ns; s += nt) {
        float ms = base[(size_t)s * (hd + 2)];
        wt[s] = ms;
        mx = fmaxf(mx, ms);
    }
    float M = st_block_max(mx, bsh); /* its barriers publish wt */
    float lv = -0.0f;
    for (uint32_t s = threadIdx.x; s < ns; s += nt) {
        float ms = wt[s];
        if (ms != -INFINITY)
            lv = __fmaf_rn(base[(size_t)s * (hd + 2) + 1], expf(ms - M), lv);
    }
    __syncthreads(); /* every thread has read its wt[s] before they become weights */
    for (uint32_t s = threadIdx.x; s < ns; s += nt) {
        float ms = wt[s];
        wt[s] = ms != -INFINITY ? expf(ms - M) : -1.0f; /* -1: an empty split */
    }
    float L = st_block_sum(lv, bsh); /* and its barriers publish the weights */
    if (i < hd) {
        float o = -0.0f;
#pragma unroll 4
        for (uint32_t s = grp; s < ns; s += 4) {
            float w = wt[s];
            if (w >= 0.0f)
                o = __fmaf_rn(base[(size_t)s * (hd + 2) + 2 + i], w, o);
        }
        red[grp * hd + i] = o;
    }
    __syncthreads();
    if (grp == 0 && i < hd) {
        float o = ((red[i] + red[hd + i]) + red[2 * hd + i]) + red[3 * hd + i];
        a.out[(size_t)t * a.ldo + (size_t)h * hd + i] = o / L;
    }
}

static void attn_merge_launch(st_ops_cuda *oc, const oc_attn &a, uint32_t T)
{
    uint32_t hdr = (a.g.hd + 31) / 32 * 32;
    size_t smem = ((size_t)a.nsplit + 4 * a.g.hd + 32) * sizeof(float);
    (void)st_launch(k_attn_merge, dim3(T, a.n_head), 4 * hdr, smem, oc->stream, a);
}

/* ---- attention of one token over f16 K/V (invariant 10) ------------------------------------------ */
/* One block of OC_DA_WARPS warps per (K/V head, key split), for the G query heads that share the
 * K/V head: the keys are read once for all of them. A key's row of head_dim f16 values is read
 * by C = head_dim / 8 lanes, 16 bytes each (a warp takes 32 / C keys at once, the block
 * OC_DA_WARPS times as many); the split's keys go by in tiles of OC_DA_KT:
 * 1. the rows' addresses of the tile in shared memory;
 * 2. the scores: each lane the dot product of its 8 elements with the G queries' (in element
 *    order), then the C lanes added by a shuffle tree (offsets C/2 .. 1); scaled, to shared
 *    memory;
 * 3. per head (warp w the heads w, w + OC_DA_WARPS, ...): the tile's maximum, the new running
 *    maximum m, the weights exp(s - m) in place and their sum (the lanes in key order, then
 *    st_warp_sum); the running sum l = l corr + sum, corr = exp(m_old - m);
 * 4. the values: each thread's accumulators (G x 8 elements) rescaled by corr, then the weighted
 *    V elements of its keys added in key order.
 * At the end the threads of one element slot are added: in the warp by a shuffle tree over the
 * key lanes (offsets 16 .. C), then the warps in warp order. One split: the output o / l; several:
 * M, L and o into the partials for k_attn_merge. Every order is fixed by the head_dim, G and the
 * split's key count, never by timing: the same bits run after run. */
#define OC_DA_WARPS 4
#define OC_DA_KT 256

__device__ __forceinline__ float h2f_lo(uint32_t w)
{
    __half_raw r;
    r.x = (unsigned short)(w & 0xffffu);
    return __half2float(__half(r));
}

__device__ __forceinline__ float h2f_hi(uint32_t w)
{
    __half_raw r;
    r.x = (unsigned short)(w >> 16);
    return __half2float(__half(r));
}

__device__ __forceinline__ void h8_to_f(uint4 v, float *f)
{
    const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int k = 0; k < 4; k++) {
        f[2 * k] = h2f_lo(w[k]);
        f[2 * k + 1] = h2f_hi(w[k]);
    }
}

template <int G>
__global__ void __launch_bounds__(32 * OC_DA_WARPS) k_attn_dec(oc_attn a)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    const oc_kv &g = a.g;
    uint32_t kvh = blockIdx.y, s = blockIdx.z, hd = g.hd, h0 = kvh * G;
    uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5, C = hd / 8;
    uint32_t kpw = 32 / C, KP = OC_DA_WARPS * kpw, slot = w * kpw + lane / C, c = lane % C;
    uint64_t n = (a.posp ? *a.posp : a.pos0) + 1, j0 = (uint64_t)s * a.ks;
    uint64_t j1 = j0 + a.ks < n ? j0 + a.ks : n;
    size_t pstride = (size_t)a.nsplit * (hd + 2);
    if (j0 >= n) { /* an empty split (the dynamic mode's span past the position) */
        if (threadIdx.x < G)
            a.part[(size_t)(h0 + threadIdx.x) * pstride + (size_t)s * (hd + 2)] = -INFINITY;
        return;
    }
    __shared__ const uint8_t *rows[OC_DA_KT];
    __shared__ float sc[G][OC_DA_KT];
    __shared__ float s_m[G], s_l[G], s_corr[G];
    __shared__ float red[OC_DA_WARPS][G * OC_MAX_HD];
    const size_t hoff = (size_t)kvh * hd * 2 + 16 * c;
    float q[G][8], acc[G][8];
#pragma unroll
    for (int k = 0; k < G; k++) {
        const float *qk = a.q + (size_t)(h0 + k) * hd + 8 * c;
#pragma unroll
        for (int e = 0; e < 8; e++) {
            q[k][e] = qk[e];
            acc[k][e] = 0.0f;
        }
    }
    if (threadIdx.x < G) {
        s_m[threadIdx.x] = -INFINITY;
        s_l[threadIdx.x] = 0.0f;
    }
    for (uint64_t t0 = j0; t0 < j1; t0 += OC_DA_KT) {
        uint32_t nt = j1 - t0 < OC_DA_KT ? (uint32_t)(j1 - t0) : OC_DA_KT;
        for (uint32_t i = threadIdx.x; i < nt; i += blockDim.x) {
            uint32_t j = (uint32_t)(t0 + i);
            rows[i] = g.blocks[j / g.ps] + (uint64_t)(j % g.ps) * g.row;
        }
        __syncthreads();
        for (uint32_t ib = 0; ib < nt; ib += 4 * KP) {
            uint4 kr[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                uint32_t i = ib + slot + u * KP;
                kr[u] = i < nt ? *(const uint4 *)(rows[i] + g.off_k + hoff) : make_uint4(0, 0, 0, 0);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                uint32_t i = ib + slot + u * KP;
                float kf[8];
                h8_to_f(kr[u], kf);
#pragma unroll
                for (int k = 0; k < G; k++) {
                    float d = q[k][0] * kf[0];
#pragma unroll
                    for (int e = 1; e < 8; e++)
                        d = __fmaf_rn(q[k][e], kf[e], d);
                    for (uint32_t o = C / 2; o > 0; o >>= 1)
                        d += __shfl_xor_sync(0xffffffffu, d, o);
                    if (c == 0 && i < nt)
                        sc[k][i] = d * a.scale;
                }
            }
        }
        __syncthreads();
        for (uint32_t k = w; k < G; k += OC_DA_WARPS) {
            float mx = -INFINITY;
            for (uint32_t i = lane; i < nt; i += 32)
                mx = fmaxf(mx, sc[k][i]);
            mx = st_warp_max(mx);
            float mo = s_m[k], mn = fmaxf(mo, mx), sum = 0.0f;
            for (uint32_t i = lane; i < nt; i += 32) {
                float p = expf(sc[k][i] - mn);
                sc[k][i] = p;
                sum += p;
            }
            sum = st_warp_sum(sum);
            if (lane == 0) {
                float corr = expf(mo - mn);
                s_corr[k] = corr;
                s_l[k] = __fmaf_rn(s_l[k], corr, sum);
                s_m[k] = mn;
            }
        }
        __syncthreads();
#pragma unroll
        for (int k = 0; k < G; k++) {
            float corr = s_corr[k];
#pragma unroll
            for (int e = 0; e < 8; e++)
                acc[k][e] *= corr;
        }
        for (uint32_t ib = 0; ib < nt; ib += 4 * KP) {
            uint4 vr[4];
#pragma unroll
            for (int u = 0; u < 4; u++) {
                uint32_t i = ib + slot + u * KP;
                if (i < nt)
                    vr[u] = *(const uint4 *)(rows[i] + g.off_v + hoff);
            }
#pragma unroll
            for (int u = 0; u < 4; u++) {
                uint32_t i = ib + slot + u * KP;
                if (i < nt) {
                    float vf[8];
                    h8_to_f(vr[u], vf);
#pragma unroll
                    for (int k = 0; k < G; k++) {
                        float p = sc[k][i];
#pragma unroll
                        for (int e = 0; e < 8; e++)
                            acc[k][e] = __fmaf_rn(p, vf[e], acc[k][e]);
                    }
                }
            }
        }
        __syncthreads(); /* the tile's rows and weights are read before the next tile's */
    }
#pragma unroll
    for (int k = 0; k < G; k++)
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float v = acc[k][e];
            for (uint32_t o = 16; o >= C; o >>= 1)
                v += __shfl_xor_sync(0xffffffffu, v, o);
            acc[k][e] = v;
        }
    if (lane < C)
#pragma unroll
        for (int k = 0; k < G; k++)
#pragma unroll
            for (int e = 0; e < 8; e++)
                red[w][k * hd + 8 * c + e] = acc[k][e];
    __syncthreads();
    for (uint32_t x = threadIdx.x; x < G * hd; x += blockDim.x) {
        uint32_t k = x / hd, i = x % hd;
        float o = red[0][x];
        for (int v = 1; v < OC_DA_WARPS; v++)
            o += red[v][x];
        if (a.nsplit == 1) {
            a.out[(size_t)(h0 + k) * hd + i] = o / s_l[k];
        } else {
            float *pp = a.part + (size_t)(h0 + k) * pstride + (size_t)s * (hd + 2);
            pp[2 + i] = o;
            if (i == 0) {
                pp[0] = s_m[k];
                pp[1] = s_l[k];
            }
        }
    }
}

/* One-token attention on k_attn_dec (invariant 10): f16 K/V in 16-byte pieces, head_dim 8 x 2^k
 * up to OC_MAX_HD, 1, 2, 4 or 8 query heads per K/V head, and not turned off
 * (STRATA_CUDA_ATT_DEC=0) */
static int attn_dec_fits(const st_ops_cuda *oc, const oc_kv *g, uint32_t G)
{
    uint32_t C = g->hd / 8;
    return oc->att_dec && !g->i8 && g->hd % 8 == 0 && g->hd <= OC_MAX_HD && (C & (C - 1)) == 0 &&
           g->off_k % 16 == 0 && g->off_v % 16 == 0 && g->row % 16 == 0 &&
           (G == 1 || G == 2 || G == 4 || G == 8);
}

/* ---- attention of several tokens on f16 tensor cores (invariant 9) ------------------------------ */
/* One block of OC_TC_WARPS warps per (tile of OC_TC_Q query tokens, head); warp w owns query
 * rows 16 w .. 16 w + 15 of the tile. The keys go by in tiles of OC_TC_K rows staged in shared
 * memory as they are in the pages (f16); per key tile each warp computes its scores S = Q K^T
 * (WMMA 16x16x16, f16 inputs, f32 sums), the online softmax in f32 (two lanes per row: the
 * running max, the sum of the f16-rounded weights), the weights P rounded to f16 and the output
 * O += P V (the accumulator in shared memory, rescaled by the row's correction first). Keys
 * beyond a row's position are masked; query rows past T are zero and never written. */
#define OC_TC_Q 64
#define OC_TC_K 64
#define OC_TC_WARPS (OC_TC_Q / 16)
#define OC_TC_LDS (OC_TC_K + 4) /* the scores' row stride (floats) */
#define OC_TC_LDP (OC_TC_K + 8) /* the weights' row stride (halves) */

/* k_attn_tc's shared memory, in bytes from its start: the regions in order (Q, K and V tiles
 * of f16 rows of hd + 8, the warps' scores in f32, their weights in f16, the outputs in f32 rows
 * of hd + 4) and the end. The kernel carves its pointers from these offsets and the launch
 * asks for .end bytes, so the two cannot disagree. */
typedef struct attn_tc_layout {
    size_t q, k, v, s, p, o, end;
} attn_tc_layout;

__host__ __device__ __forceinline__ attn_tc_layout attn_tc_at(uint32_t hd)
{
    attn_tc_layout L;
    size_t ldh = hd + 8, ldo = hd + 4;
    L.q = 0;
    L.k = L.q + (size_t)OC_TC_Q * ldh * 2;
    L.v = L.k + (size_t)OC_TC_K * ldh * 2;
    L.s = L.v + (size_t)OC_TC_K * ldh * 2;
    L.p = L.s + (size_t)OC_TC_WARPS * 16 * OC_TC_LDS * 4;
    L.o = L.p + (size_t)OC_TC_WARPS * 16 * OC_TC_LDP * 2;
    L.end = L.o + (size_t)OC_TC_Q * ldo * 4;
    return L;
}

static size_t attn_tc_smem(uint32_t hd)
{
    return attn_tc_at(hd).end;
}

/* f16 K/V in rows of 16-byte pieces, head_dim a multiple of 16 and the shared memory at hand */
static int attn_tc_fits(const st_ops_cuda *oc, const oc_kv *g)
{
    return !g->i8 && g->hd % 16 == 0 && g->off_k % 16 == 0 && g->off_v % 16 == 0 &&
           g->row % 16 == 0 && attn_tc_smem(g->hd) <= oc->dn_smem_max;
}

__global__ void __launch_bounds__(32 * OC_TC_WARPS) k_attn_tc(oc_attn a, uint32_t T)
{
    using namespace nvcuda;
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    extern __shared__ __align__(128) unsigned char tc_sm[];
    const oc_kv &g = a.g;
    const uint32_t hd = g.hd, ldh = hd + 8, ldo = hd + 4, h = blockIdx.y;
    const uint32_t t0 = blockIdx.x * OC_TC_Q, kvh = h / (a.n_head / g.nkv);
    const uint32_t lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    const attn_tc_layout L = attn_tc_at(hd);
    __half *Qs = (__half *)(tc_sm + L.q), *Ks = (__half *)(tc_sm + L.k), *Vs = (__half *)(tc_sm + L.v);
    float *Ss = (float *)(tc_sm + L.s) + (size_t)w * 16 * OC_TC_LDS;
    __half *Ps = (__half *)(tc_sm + L.p) + (size_t)w * 16 * OC_TC_LDP;
    float *Os = (float *)(tc_sm + L.o);
    const uint64_t pos = a.posp ? *a.posp : a.pos0;
    const uint32_t tend = t0 + OC_TC_Q < T ? t0 + OC_TC_Q : T;
    const uint64_t nk = pos + tend; /* the keys any row of the tile sees */
    for (uint32_t i = threadIdx.x; i < OC_TC_Q * hd; i += blockDim.x) {
        uint32_t r = i / hd, c = i % hd;
        float v = t0 + r < T ? a.q[(size_t)(t0 + r) * a.ldq + (size_t)h * hd + c] : 0.0f;
        Qs[r * ldh + c] = __float2half_rn(v);
        Os[r * ldo + c] = 0.0f;
    }
    const uint32_t rl = lane >> 1, half_ = lane & 1, row = w * 16 + rl;
    const int valid = t0 + row < T;
    const uint64_t qp = pos + t0 + row;            /* the row's position: keys 0..qp */
    const uint64_t wlast = pos + t0 + w * 16 + 15; /* the warp's last row's position */
    const size_t hoff = (size_t)kvh * hd * 2;
    const uint32_t vec = hd / 8; /* 16-byte pieces of a K or V row */
    float m = -INFINITY, l = 0.0f;
    for (uint64_t j0 = 0; j0 < nk; j0 += OC_TC_K) {
        __syncthreads(); /* the previous tile's K and V are no longer read */
        for (uint32_t i = threadIdx.x; i < OC_TC_K * vec; i += blockDim.x) {
            uint32_t r = i / vec, c = i % vec;
            uint64_t j = j0 + r;
            uint4 kv4 = make_uint4(0, 0, 0, 0), vv4 = make_uint4(0, 0, 0, 0);
            if (j < nk) {
                uint32_t page = (uint32_t)j / g.ps, in = (uint32_t)j % g.ps;
                kv4 = ((const uint4 *)(kv_row(g, g.off_k, g.row, page, in) + hoff))[c];
                vv4 = ((const uint4 *)(kv_row(g, g.off_v, g.row, page, in) + hoff))[c];
            }
            ((uint4 *)(Ks + r * ldh))[c] = kv4;
            ((uint4 *)(Vs + r * ldh))[c] = vv4;
        }
        __syncthreads();
        if (j0 > wlast)
            continue; /* every key of the tile is past every row of this warp */
        for (uint32_t n = 0; n < OC_TC_K / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> s;
            wmma::fill_fragment(s, 0.0f);
            for (uint32_t k = 0; k < hd / 16; k++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> qa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> kb;
                wmma::load_matrix_sync(qa, Qs + (size_t)w * 16 * ldh + k * 16, ldh);
                wmma::load_matrix_sync(kb, Ks + (size_t)n * 16 * ldh + k * 16, ldh);
                wmma::mma_sync(s, qa, kb, s);
            }
            wmma::store_matrix_sync(Ss + n * 16, s, OC_TC_LDS, wmma::mem_row_major);
        }
        __syncwarp();
        /* the online softmax: lanes 2 r and 2 r + 1 share row r, 32 keys each */
        const float *sr = Ss + rl * OC_TC_LDS + half_ * (OC_TC_K / 2);
        __half *pr = Ps + rl * OC_TC_LDP + half_ * (OC_TC_K / 2);
        float mx = -INFINITY;
        for (uint32_t c = 0; c < OC_TC_K / 2; c++) {
            uint64_t j = j0 + half_ * (OC_TC_K / 2) + c;
            if (valid && j <= qp)
                mx = fmaxf(mx, sr[c] * a.scale);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        float mn = fmaxf(m, mx), corr = mn == -INFINITY ? 1.0f : expf(m - mn), sum = 0.0f;
        for (uint32_t c = 0; c < OC_TC_K / 2; c++) {
            uint64_t j = j0 + half_ * (OC_TC_K / 2) + c;
            __half p = __float2half_rn(valid && j <= qp ? expf(sr[c] * a.scale - mn) : 0.0f);
            pr[c] = p;
            sum += __half2float(p);
        }
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        l = __fmaf_rn(l, corr, sum);
        m = mn;
        float *orow = Os + (size_t)row * ldo;
        for (uint32_t c = half_ * (hd / 2); c < (half_ + 1) * (hd / 2); c++)
            orow[c] *= corr;
        __syncwarp();
        for (uint32_t n = 0; n < hd / 16; n++) {
            wmma::fragment<wmma::accumulator, 16, 16, 16, float> o;
            wmma::load_matrix_sync(o, Os + (size_t)w * 16 * ldo + n * 16, ldo, wmma::mem_row_major);
            for (uint32_t k = 0; k < OC_TC_K / 16; k++) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> pa;
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::row_major> vb;
                wmma::load_matrix_sync(pa, Ps + k * 16, OC_TC_LDP);
                wmma::load_matrix_sync(vb, Vs + (size_t)k * 16 * ldh + n * 16, ldh);
                wmma::mma_sync(o, pa, vb, o);
            }
            wmma::store_matrix_sync(Os + (size_t)w * 16 * ldo + n * 16, o, ldo, wmma::mem_row_major);
        }
        __syncwarp();
    }
    if (!valid)
        return;
    const float *orow = Os + (size_t)row * ldo;
    float *dst = a.out + (size_t)(t0 + row) * a.ldo + (size_t)h * hd;
    for (uint32_t c = half_ * (hd / 2); c < (half_ + 1) * (hd / 2); c++)
        dst[c] = orow[c] / l;
}

/* The attention launches of this process by kernel (st_ops_int.h). */
static uint64_t g_att_runs[ST_CUDA_ATT_N];

void st_ops_cuda_attention_runs(uint64_t out[ST_CUDA_ATT_N])
{
    for (int i = 0; i < ST_CUDA_ATT_N; i++)
        out[i] = __atomic_load_n(&g_att_runs[i], __ATOMIC_RELAXED);
}

uint64_t st_ops_cuda_att_span(const st_ops_cuda *oc, uint64_t pos)
{
    uint64_t span = OC_ATT_SPAN0;
    while (span < pos + 1 && span < oc->n_ctx)
        span *= 2;
    return span < oc->n_ctx ? span : oc->n_ctx;
}

/* Keys per split of a one-token pass over a span (invariant 8): enough splits to give the GPU
 * about 8 blocks per SM over all the heads, no more than the partials' buffer holds (at least 2
 * per head: the caller checked), at least OC_ATT_KS keys each. */
static uint64_t att_keys_per_split(const st_ops_cuda *oc, uint64_t span, uint32_t n_head)
{
    uint64_t most = oc->att_cap / n_head, want = ((uint64_t)oc->n_sm + n_head - 1) / n_head * 8;
    uint64_t S = want < most ? want : most, ks = (span + S - 1) / S;
    return ks < OC_ATT_KS ? OC_ATT_KS : ks;
}

static void oc_attention(void *ocp, const st_kv_view *kv, const float *q, uint32_t ldq,
                         float *out, uint32_t ldo, uint32_t n_head, uint64_t pos0, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    oc_attn a = {}; /* every field set below; zeroed for gcc -O3 -Wmaybe-uninitialized */
    if (oc->err || !T || kv_of(oc, kv, &a.g))
        return;
    if (!n_head || !a.g.nkv || n_head % a.g.nkv)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: %u query heads over %u K/V "
                                        "heads", n_head, a.g.nkv));
    if (pos0 + T > oc->n_ctx) /* the splits and the partials are sized by the context */
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: attention over %llu keys "
                                        "(the context is %u)", (unsigned long long)(pos0 + T),
                                        oc->n_ctx));
    a.posp = POSP(oc);
    a.q = q;
    a.out = out;
    a.part = oc->att_part;
    a.ldq = ldq;
    a.ldo = ldo;
    a.n_head = n_head;
    a.pos0 = pos0;
    a.scale = 1.0f / sqrtf((float)a.g.hd);
    if (T > 1 && oc->gemm16 && attn_tc_fits(oc, &a.g)) { /* invariant 9 */
        a.ks = 0;
        a.nsplit = 1;
        (void)st_launch(k_attn_tc, dim3((T + OC_TC_Q - 1) / OC_TC_Q, n_head), 32 * OC_TC_WARPS,
                        attn_tc_smem(a.g.hd), oc->stream, a, T);
        if (!LAUNCHED(oc, "k_attn_tc"))
            __atomic_add_fetch(&g_att_runs[ST_CUDA_ATT_TC], 1, __ATOMIC_RELAXED);
        return;
    }
    uint64_t nk = pos0 + T, base = (uint64_t)T * n_head, target = 8ull * (uint64_t)oc->n_sm;
    uint32_t nsplit = 1, G = n_head / a.g.nkv;
    if (T == 1 && oc->att_cap / n_head >= 2 && attn_dec_fits(oc, &a.g, G)) { /* invariant 10 */
        uint64_t span = st_ops_cuda_att_span(oc, pos0), most = oc->att_cap / n_head;
        uint64_t S = (4ull * (uint64_t)oc->n_sm + a.g.nkv - 1) / a.g.nkv;
        S = S < most ? S : most;
        uint64_t ks = (span + S - 1) / S, keys = oc->dyn ? span : nk;
        ks = ks < OC_ATT_KS ? OC_ATT_KS : ks;
        ks = ks < oc->att_keys ? oc->att_keys : ks;
        a.ks = (uint32_t)ks;
        a.nsplit = nsplit = (uint32_t)((keys + ks - 1) / ks);
        if (oc->dyn && nsplit < 2)
            a.nsplit = nsplit = 2; /* through the merge, as a longer span would be */
        dim3 grid(1, a.g.nkv, nsplit);
        switch (G) {
        case 1: (void)st_launch(k_attn_dec<1>, grid, 32 * OC_DA_WARPS, 0, oc->stream, a); break;
        case 2: (void)st_launch(k_attn_dec<2>, grid, 32 * OC_DA_WARPS, 0, oc->stream, a); break;
        case 4: (void)st_launch(k_attn_dec<4>, grid, 32 * OC_DA_WARPS, 0, oc->stream, a); break;
        default: (void)st_launch(k_attn_dec<8>, grid, 32 * OC_DA_WARPS, 0, oc->stream, a); break;
        }
        if (LAUNCHED(oc, "k_attn_dec"))
            return;
        __atomic_add_fetch(&g_att_runs[ST_CUDA_ATT_DEC], 1, __ATOMIC_RELAXED);
        if (nsplit > 1) {
            attn_merge_launch(oc, a, 1);
            LAUNCHED(oc, "k_attn_merge");
        }
        return;
    }
    if (T == 1) {
        /* one token (invariant 8): splits of a fixed key count, set by the position's span
         * (st_ops_cuda_att_span) and the heads; the dynamic mode launches the span's splits
         * (those past the position are empty and the merge passes over them), so both give the
         * same bits at every position of the span */
        if (oc->att_cap / n_head < 2)
            return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: attention of %u heads "
                                            "(at most %llu)", n_head,
                                            (unsigned long long)(oc->att_cap / 2)));
        uint64_t span = st_ops_cuda_att_span(oc, pos0), ks = att_keys_per_split(oc, span, n_head);
        uint64_t keys = oc->dyn ? span : nk;
        a.ks = (uint32_t)ks;
        nsplit = (uint32_t)((keys + ks - 1) / ks);
        if (oc->dyn && nsplit < 2)
            nsplit = 2; /* through the merge, as a longer span would be */
    } else {
        /* split the keys when the (token, head) blocks alone would not fill the GPU */
        if (base < target) {
            uint64_t want = (target + base - 1) / base, most = (nk + 31) / 32;
            nsplit = (uint32_t)(want < most ? want : most);
            if (nsplit < 1)
                nsplit = 1;
        }
        if (base * nsplit > oc->att_cap)
            nsplit = 1;
        a.ks = (uint32_t)((nk + nsplit - 1) / nsplit);
    }
    a.nsplit = nsplit;
    dim3 grid(T, n_head, nsplit);
    switch ((a.g.hd + 31) / 32) { /* <= 8: head_dim <= OC_MAX_HD (kv_of) */
    case 1: (void)st_launch(k_attn<1>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 2: (void)st_launch(k_attn<2>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 3: (void)st_launch(k_attn<3>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 4: (void)st_launch(k_attn<4>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 5: (void)st_launch(k_attn<5>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 6: (void)st_launch(k_attn<6>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    case 7: (void)st_launch(k_attn<7>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    default: (void)st_launch(k_attn<8>, grid, 32 * OC_ATT_WARPS, 0, oc->stream, a); break;
    }
    if (LAUNCHED(oc, "k_attn"))
        return;
    __atomic_add_fetch(&g_att_runs[ST_CUDA_ATT_CORE], 1, __ATOMIC_RELAXED);
    if (nsplit == 1)
        return;
    attn_merge_launch(oc, a, T);
    LAUNCHED(oc, "k_attn_merge");
}

/* ---- MoE routing -------------------------------------------------------------------------------- */
/* One thread per token, as the CPU's route_task: max and sum of exp in expert order, the k
 * largest logits (ties: the lower expert first) in decreasing order, their probabilities
 * renormalised by max(their sum, 2^-14). */
__global__ void k_moe_route(const float *logits, uint32_t X, uint32_t k, uint32_t *sel, float *w,
                            uint32_t T)
{
    st_pdl_begin(); /* st_launch_cuda.cuh rule 1 */
    uint32_t t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= T)
        return;
    const float *l = logits + (size_t)t * X;
    uint32_t *st = sel + (size_t)t * k;
    float *wt = w + (size_t)t * k;
    float m = -INFINITY, sum = 0.0f;
    for (uint32_t e = 0; e < X; e++)
        if (l[e] > m)
            m = l[e];
    for (uint32_t e = 0; e < X; e++)
        sum += expf(l[e] - m);
    float pl = INFINITY;
    uint32_t pe = 0;
    for (uint32_t r = 0; r < k; r++) {
        /* the best below (pl, pe) in the order (logit decreasing, expert increasing) */
        float bl = -INFINITY;
        uint32_t be = X;
        for (uint32_t e = 0; e < X; e++) {
            float v = l[e];
            int below = r == 0 || v < pl || (v == pl && e > pe);
            if (below && (be == X || v > bl)) {
                bl = v;
                be = e;
            }
        }
        if (be == X)
            be = 0;
        st[r] = be;
        pl = bl;
        pe = be;
    }
    float ws = 0.0f;
    for (uint32_t r = 0; r < k; r++) {
        wt[r] = expf(l[st[r]] - m) / sum;
        ws += wt[r];
    }
    if (ws < 6.103515625e-5f)
        ws = 6.103515625e-5f;
    for (uint32_t r = 0; r < k; r++)
        wt[r] = wt[r] / ws;
}

static void oc_moe_route(void *ocp, const float *logits, uint32_t X, uint32_t k, uint32_t *sel,
                         float *w, uint32_t T)
{
    st_ops_cuda *oc = (st_ops_cuda *)ocp;
    if (oc->err || !T)
        return;
    if (k == 0 || k > X)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: top %u of %u experts", k, X));
    (void)st_launch(k_moe_route, (T + 31) / 32, 32, 0, oc->stream, logits, X, k, sel, w, T);
    LAUNCHED(oc, "k_moe_route");
}

/* ---- the table and its context -------------------------------------------------------------------- */
extern "C" const st_ops st_ops_cuda_table = {
    .name = "cuda",
    .mem_alloc = oc_mem_alloc,
    .mem_free = oc_mem_free,
    .upload = oc_upload,
    .download = oc_download,
    .get_rows = oc_get_rows,
    .matmul = oc_matmul,
    .add_rmsnorm = oc_add_rmsnorm,
    .rmsnorm_gated = oc_rmsnorm_gated,
    .l2norm = oc_l2norm,
    .swiglu = oc_swiglu,
    .matmul_swiglu = oc_matmul_swiglu,
    .short_conv = oc_short_conv,
    .dn_gates = oc_dn_gates,
    .delta_rule = oc_delta_rule,
    .rope_norm = oc_rope_norm,
    .rope_neox = oc_rope_neox,
    .rmsnorm_heads = oc_rmsnorm_heads,
    .kv_store = oc_kv_store,
    .attention = oc_attention,
    .l2norm_max = oc_l2norm_max,
    .sigmoid_mul = oc_sigmoid_mul,
    .moe_route = oc_moe_route,
    .scale_add = oc_scale_add,
    .sigmoid_scale = oc_sigmoid_scale,
};

/* The profiled table (invariant 7): each entry the operation between two waits. */
template <typename Sig, Sig F, int Row> struct prof_wrap;
template <typename... A, void (*F)(void *, A...), int Row>
struct prof_wrap<void (*)(void *, A...), F, Row> {
    static void call(void *ocp, A... a)
    {
        st_ops_cuda *oc = (st_ops_cuda *)ocp;
        prof_begin(oc, 0);
        F(ocp, a...);
        prof_end(oc, 0, Row);
    }
};
#define PW(f, row) prof_wrap<decltype(&f), &f, row>::call

extern "C" const st_ops st_ops_cuda_prof_table = {
    .name = "cuda (profiled)",
    .mem_alloc = oc_mem_alloc,
    .mem_free = oc_mem_free,
    .upload = oc_upload,
    .download = oc_download,
    .get_rows = PW(oc_get_rows, PR_GET_ROWS),
    .matmul = PW(oc_matmul, PR_MATMUL),
    .add_rmsnorm = PW(oc_add_rmsnorm, PR_ADD_RMSNORM),
    .rmsnorm_gated = PW(oc_rmsnorm_gated, PR_RMSNORM_GATED),
    .l2norm = PW(oc_l2norm, PR_L2NORM),
    .swiglu = PW(oc_swiglu, PR_SWIGLU),
    .matmul_swiglu = PW(oc_matmul_swiglu, PR_MATMUL),
    .short_conv = PW(oc_short_conv, PR_SHORT_CONV),
    .dn_gates = PW(oc_dn_gates, PR_DN_GATES),
    .delta_rule = PW(oc_delta_rule, PR_DELTA_RULE),
    .rope_norm = PW(oc_rope_norm, PR_ROPE_NORM),
    .rope_neox = PW(oc_rope_neox, PR_ROPE_NEOX),
    .rmsnorm_heads = PW(oc_rmsnorm_heads, PR_RMSNORM_HEADS),
    .kv_store = PW(oc_kv_store, PR_KV_STORE),
    .attention = PW(oc_attention, PR_ATTENTION),
    .l2norm_max = PW(oc_l2norm_max, PR_L2NORM_MAX),
    .sigmoid_mul = PW(oc_sigmoid_mul, PR_SIGMOID_MUL),
    .moe_route = PW(oc_moe_route, PR_MOE_ROUTE),
    .scale_add = PW(oc_scale_add, PR_SCALE_ADD),
    .sigmoid_scale = PW(oc_sigmoid_scale, PR_SIGMOID_SCALE),
};

void st_ops_cuda_dynamic(st_ops_cuda *oc, int on)
{
    oc->dyn = on;
}

void st_ops_cuda_stage(st_ops_cuda *oc, const uint32_t *tokens, uint32_t T, uint64_t pos0)
{
    if (T > oc->max_T)
        return oc_fail(oc, st_error_set(ST_EINVAL, "cuda operations: %u rows (at most %u)", T,
                                        oc->max_T));
    memcpy(oc->tok_h, tokens, (size_t)T * 4);
    *oc->pos_h = pos0;
}

const st_ops *st_ops_cuda_get(const st_ops_cuda *oc)
{
    return oc->prof ? &st_ops_cuda_prof_table : &st_ops_cuda_table;
}

void st_ops_cuda_free(st_ops_cuda *oc)
{
    if (!oc)
        return;
    if (oc->prof) {
        prof_flush(oc);
        static const char *const kind[2] = {"passes of several tokens (prefill)",
                                            "passes of one token (decode)"};
        for (int d = 1; d >= 0; d--) {
            double all = 0.0;
            uint64_t calls = 0;
            for (int i = 0; i < PR_QMV; i++) {
                all += oc->prof_s[d][i];
                calls += oc->prof_n[d][i];
            }
            if (!oc->prof_passes[d])
                continue;
            double per = (double)oc->prof_passes[d];
            fprintf(stderr, "strata: cuda operations profile (STRATA_CUDA_OPS_PROFILE=%d, %s): %s: "
                    "%llu passes, %.1f operations and %.1f us in operations per pass\n%-24s %10s %12s "
                    "%10s %10s %7s\n", oc->prof, oc->prof == 2 ? "GPU time between events"
                    : "wall time between waits", kind[d], (unsigned long long)oc->prof_passes[d],
                    (double)calls / per, all * 1e6 / per, "operation", "calls", "total ms",
                    "us/call", "us/pass", "share");
            for (int i = 0; i < PR_N; i++)
                if (oc->prof_n[d][i])
                    fprintf(stderr, "%-24s %10llu %12.2f %10.2f %10.1f %6.1f%%\n", k_prof_names[i],
                            (unsigned long long)oc->prof_n[d][i], oc->prof_s[d][i] * 1e3,
                            oc->prof_s[d][i] * 1e6 / (double)oc->prof_n[d][i],
                            oc->prof_s[d][i] * 1e6 / per,
                            all > 0 ? 100.0 * oc->prof_s[d][i] / all : 0.0);
        }
        if (oc->prof_ev)
            for (int i = 0; i < PROF_EV; i++)
                if (oc->prof_ev[i])
                    cudaEventDestroy(oc->prof_ev[i]);
        free(oc->prof_ev);
        free(oc->prof_span);
    }
    if (oc->stream)
        cudaStreamSynchronize(oc->stream);
    if (oc->blas)
        cublasDestroy(oc->blas);
    cudaFree(oc->blas_ws);
    cudaFree(oc->tok_d);
    cudaFreeHost(oc->tok_h);
    cudaFree(oc->pos_d);
    cudaFreeHost(oc->pos_h);
    cudaFree(oc->deq);
    cudaFree(oc->att_part);
    cudaFree(oc->xq);
    free(oc);
}

int st_ops_cuda_new(void *stream, uint32_t max_T, uint32_t n_ctx, uint32_t max_head_dim,
                    st_ops_cuda **out)
{
    *out = NULL;
    if (max_head_dim > OC_MAX_HD)
        return st_error_set(ST_EINVAL, "cuda operations: head_dim %u (at most %u)", max_head_dim,
                            OC_MAX_HD);
    st_ops_cuda *oc = (st_ops_cuda *)calloc(1, sizeof *oc);
    if (!oc)
        return st_error_set(ENOMEM, "cuda operations");
    oc->stream = (cudaStream_t)stream;
    st_cuda_pdl_configure();
    const char *pv = getenv("STRATA_CUDA_OPS_PROFILE");
    oc->prof = pv && !strcmp(pv, "1") ? 1 : pv && !strcmp(pv, "2") ? 2 : 0;
    if (pv && *pv && !oc->prof && strcmp(pv, "0"))
        fprintf(stderr, "strata: cuda operations: STRATA_CUDA_OPS_PROFILE=%s: 0, 1 or 2; the "
                "profile stays off\n", pv);
    if (oc->prof == 2) {
        oc->prof_ev = (cudaEvent_t *)calloc(PROF_EV, sizeof *oc->prof_ev);
        oc->prof_span = (prof_span *)calloc(PROF_EV / 2, sizeof *oc->prof_span);
        for (int i = 0; oc->prof_ev && i < PROF_EV; i++)
            if (cudaEventCreate(&oc->prof_ev[i]) != cudaSuccess)
                oc->prof_ev[i] = NULL;
        int ok = oc->prof_ev && oc->prof_span;
        for (int i = 0; ok && i < PROF_EV; i++)
            ok = oc->prof_ev[i] != NULL;
        cudaGetLastError();
        if (!ok) {
            fprintf(stderr, "strata: cuda operations: STRATA_CUDA_OPS_PROFILE=2: no events; the "
                    "profile stays off\n");
            if (oc->prof_ev)
                for (int i = 0; i < PROF_EV; i++)
                    if (oc->prof_ev[i])
                        cudaEventDestroy(oc->prof_ev[i]);
            free(oc->prof_ev);
            free(oc->prof_span);
            oc->prof_ev = NULL;
            oc->prof_span = NULL;
            oc->prof = 0;
        }
    }
    const char *gv = getenv("STRATA_CUDA_PREFILL");
    oc->gemm16 = !(gv && !strcmp(gv, "f32"));
    if (gv && *gv && strcmp(gv, "f32") && strcmp(gv, "f16"))
        fprintf(stderr, "strata: cuda operations: STRATA_CUDA_PREFILL=%s: f16 or f32; the "
                "prompt's products and attention stay on the f16 tensor cores\n", gv);
    const char *dv = getenv("STRATA_CUDA_ATT_DEC");
    oc->att_dec = !(dv && !strcmp(dv, "0"));
    if (dv && *dv && strcmp(dv, "0") && strcmp(dv, "1"))
        fprintf(stderr, "strata: cuda operations: STRATA_CUDA_ATT_DEC=%s: 0 or 1; one-token "
                "attention stays on k_attn_dec\n", dv);
    const char *qp = getenv("STRATA_CUDA_QMV_PAIR");
    oc->qmv_pair = !(qp && !strcmp(qp, "0"));
    if (qp && *qp && strcmp(qp, "0") && strcmp(qp, "1"))
        fprintf(stderr, "strata: cuda operations: STRATA_CUDA_QMV_PAIR=%s: 0 or 1; the paired "
                "products stay on\n", qp);
    const char *qi = getenv("STRATA_CUDA_QMV_I8");
    oc->qmv_i8 = qi && !strcmp(qi, "1");
    if (qi && *qi && strcmp(qi, "0") && strcmp(qi, "1"))
        fprintf(stderr, "strata: cuda operations: STRATA_CUDA_QMV_I8=%s: 0 or 1; the Q4_K "
                "products stay on f32 activations\n", qi);
    const char *kv = getenv("STRATA_CUDA_ATT_KEYS");
    if (kv && *kv) {
        char *end;
        errno = 0;
        unsigned long long x = strtoull(kv, &end, 10);
        if (errno || *end || x < 1 || x > (1ull << 31))
            fprintf(stderr, "strata: cuda operations: STRATA_CUDA_ATT_KEYS=%s: a key count from "
                    "1 to 2^31; ignored\n", kv);
        else
            oc->att_keys = x;
    }
    oc->max_T = max_T ? max_T : 1;
    oc->n_ctx = n_ctx;
    oc->max_hd = max_head_dim ? max_head_dim : 1;
    int dev = 0, smem = 0;
    int rc = 0;
    cublasStatus_t bs;
    if ((rc = oc_cuda(oc, cudaGetDevice(&dev), "cudaGetDevice")) ||
        (rc = oc_cuda(oc, cudaDeviceGetAttribute(&oc->n_sm, cudaDevAttrMultiProcessorCount, dev),
                      "cudaDeviceGetAttribute")) ||
        (rc = oc_cuda(oc, cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                 dev), "cudaDeviceGetAttribute")))
        goto fail;
    oc->dn_smem_max = (size_t)smem;
    if ((rc = oc_cuda(oc, cudaFuncSetAttribute(k_delta_rule<true>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                      "cudaFuncSetAttribute (delta rule)")) ||
        (rc = oc_cuda(oc, cudaFuncSetAttribute(k_delta_rule<false>,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                      "cudaFuncSetAttribute (delta rule)")) ||
        (rc = oc_cuda(oc, cudaFuncSetAttribute(k_attn_tc,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize, smem),
                      "cudaFuncSetAttribute (attention)")))
        goto fail;
    bs = cublasCreate(&oc->blas);
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasSetStream(oc->blas, oc->stream);
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasSetAtomicsMode(oc->blas, CUBLAS_ATOMICS_NOT_ALLOWED);
    if (bs == CUBLAS_STATUS_SUCCESS)
        bs = cublasSetMathMode(oc->blas, CUBLAS_PEDANTIC_MATH);
    if (bs == CUBLAS_STATUS_SUCCESS) {
        if ((rc = oc_cuda(oc, cudaMalloc(&oc->blas_ws, OC_BLAS_WS), "cudaMalloc (cublas)")))
            goto fail;
        bs = cublasSetWorkspace(oc->blas, oc->blas_ws, OC_BLAS_WS);
    }
    if (bs != CUBLAS_STATUS_SUCCESS) {
        rc = st_error_set(bs == CUBLAS_STATUS_ALLOC_FAILED ? ENOMEM : ST_EIO,
                          "cuda operations: cublas setup: %s", cublasGetStatusName(bs));
        goto fail;
    }
    oc->att_cap = 16ull * (uint64_t)oc->n_sm;
    if ((rc = oc_cuda(oc, cudaMalloc((void **)&oc->tok_d, (size_t)oc->max_T * 4),
                      "cudaMalloc (row ids)")) ||
        (rc = oc_cuda(oc, cudaHostAlloc((void **)&oc->tok_h, (size_t)oc->max_T * 4,
                                        cudaHostAllocDefault), "cudaHostAlloc (row ids)")) ||
        (rc = oc_cuda(oc, cudaMalloc((void **)&oc->pos_d, sizeof *oc->pos_d),
                      "cudaMalloc (position)")) ||
        (rc = oc_cuda(oc, cudaHostAlloc((void **)&oc->pos_h, sizeof *oc->pos_h,
                                        cudaHostAllocDefault), "cudaHostAlloc (position)")) ||
        (rc = oc_cuda(oc, cudaMalloc((void **)&oc->deq, OC_DEQ_FLOATS * sizeof(float)),
                      "cudaMalloc (weight tile)")) ||
        (rc = oc_cuda(oc, cudaMalloc((void **)&oc->att_part,
                                     oc->att_cap * (oc->max_hd + 2) * sizeof(float)),
                      "cudaMalloc (attention)")) ||
        (oc->qmv_i8 &&
         (rc = oc_cuda(oc, cudaMalloc((void **)&oc->xq, OC_XQ_BYTES), "cudaMalloc (Q8_K x)"))))
        goto fail;
    oc->err = 0;
    *out = oc;
    return 0;
fail:
    st_ops_cuda_free(oc);
    return rc;
}
