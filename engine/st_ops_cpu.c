/*
 * st_ops_cpu.c - the CPU operations (st_ops_int.h) over the engine's thread pool and the kernels
 * of st_kernels.c.
 *
 * Invariants:
 * 1. Every operation splits its outputs into tasks; a task computes each of its outputs alone
 *    and in full, with the canonical reductions of st_kernels.c, so results depend on neither
 *    the number of threads nor the number of tokens of a call.
 * 2. The work estimate given to st_pool_run only decides whether other threads are woken; it
 *    never changes a result.
 * 3. Scratch is per thread (the thread index of a task), sized at creation for the memory spec
 *    and the context: attention's scores (qb queries x n_ctx keys) and the delta rule's 2 dv.
 * 4. The integer path (st_wtype.h, st_qdot_get): a matmul quantizes its input rows once per
 *    activation format its products need (at most qact_T tokens at a time, into the buffers
 *    sized at creation), before any product task runs; every task of every product reads those
 *    bytes, so they are shared and computed once.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "st_ops_int.h"
#include "st_wtype.h"

struct st_ops_cpu {
    const st_kern *k;
    st_pool *pool;
    uint32_t n_threads, n_ctx;
    uint32_t qb;    /* attention queries per task */
    float *scores;  /* per thread: qb x n_ctx */
    float *scratch; /* per thread: scratch_per_thread */
    uint32_t scratch_per_thread;
    uint8_t *qact[2];   /* per activation format (ST_QACT_* - 1): qact_T rows of qact_cols */
    uint32_t qact_T;
    uint64_t qact_cols;
    int wrong_qact; /* STRATA_TEST_WRONG_QACT=1: the negative control (st_qdot_wrong_scale) */
};

void st_ops_cpu_free(st_ops_cpu *oc)
{
    if (!oc)
        return;
    free(oc->scores);
    free(oc->scratch);
    free(oc->qact[0]);
    free(oc->qact[1]);
    free(oc);
}

int st_ops_cpu_new(const st_kern *kern, st_pool *pool, const st_mem_spec *ms, uint32_t n_ctx,
                   uint32_t max_T, uint64_t qact_cols, st_ops_cpu **out)
{
    *out = NULL;
    st_ops_cpu *oc = calloc(1, sizeof *oc);
    if (!oc)
        return st_error_set(ENOMEM, "cpu operations");
    oc->k = kern;
    oc->pool = pool;
    oc->n_threads = st_pool_size(pool);
    oc->n_ctx = n_ctx;
    uint64_t dv = 0;
    for (uint32_t il = 0; il < ms->n_layer; il++)
        if (ms->layer[il].kind == ST_MEM_REC && ms->layer[il].ssm_dv > dv)
            dv = ms->layer[il].ssm_dv;
    oc->qb = (1u << 22) / n_ctx;
    oc->qb = oc->qb < 1 ? 1 : oc->qb > 16 ? 16 : oc->qb;
    uint64_t spt = 2 * dv > oc->qb ? 2 * dv : oc->qb;
    oc->scratch_per_thread = (uint32_t)(spt ? spt : 1);
    oc->scores = st_big_alloc((uint64_t)oc->n_threads * oc->qb * n_ctx * sizeof(float));
    oc->scratch = st_big_alloc((uint64_t)oc->n_threads * oc->scratch_per_thread * sizeof(float));
    if (!oc->scores || !oc->scratch) {
        st_ops_cpu_free(oc);
        return st_error_set(ENOMEM, "cpu operations: scratch for a context of %u", n_ctx);
    }
    if (kern->qdot && qact_cols) {
        /* Q8_K is the larger format: 292 bytes per 256 values against Q8_0's 36 per 32 */
        const char *wq = getenv("STRATA_TEST_WRONG_QACT");
        oc->wrong_qact = wq && !strcmp(wq, "1");
        oc->qact_T = max_T ? max_T : 1;
        oc->qact_cols = qact_cols;
        uint64_t bytes = (uint64_t)oc->qact_T * ((qact_cols + 255) / 256 * 292);
        oc->qact[0] = st_big_alloc(bytes);
        oc->qact[1] = st_big_alloc(bytes);
        if (!oc->qact[0] || !oc->qact[1]) {
            uint32_t qt = oc->qact_T;
            st_ops_cpu_free(oc);
            return st_error_set(ENOMEM, "cpu operations: quantized activations of %u x %llu",
                                qt, (unsigned long long)qact_cols);
        }
    }
    *out = oc;
    return 0;
}

static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

/* y = x / sqrt(mean(x^2) + eps) * w */
static void rmsnorm(const st_kern *k, float *y, const float *x, const float *w, uint32_t n,
                    float eps)
{
    float ss = st_kern_dot(k, x, x, n);
    float sc = 1.0f / sqrtf(ss / (float)n + eps);
    for (uint32_t i = 0; i < n; i++)
        y[i] = x[i] * sc * w[i];
}

/* ---- get rows ------------------------------------------------------------------------------ */
typedef struct rows_job {
    const st_wmat *w;
    const uint32_t *rows;
    float *x;
    uint32_t ldx;
} rows_job;

static void rows_task(void *ctx, uint32_t t, uint32_t thread)
{
    rows_job *j = ctx;
    st_kern_row_f32(j->w, j->rows[t], j->x + (size_t)t * j->ldx);
}

static void cpu_get_rows(void *ocp, const st_wmat *w, const uint32_t *rows, uint32_t T, float *x,
                         uint32_t ldx)
{
    st_ops_cpu *oc = ocp;
    rows_job j = {w, rows, x, ldx};
    st_pool_run(oc->pool, T, rows_task, &j, (uint64_t)T * w->cols);
}

/* ---- matmul: products sharing one input, split into tasks of row blocks x token blocks ----- */
#define MM_RB 48
#define MM_TB 32
#define MM_MAX 8
typedef struct mm_job {
    const st_kern *k;
    const float *x;
    uint32_t ldx, T, n, ntb;
    const st_mm *mm;
    const uint8_t *xq[2];       /* the quantized rows per activation format, or NULL */
    size_t xqs[2];              /* their row strides in bytes */
    uint32_t first[MM_MAX + 1]; /* task index where product i starts */
} mm_job;

static void mm_task(void *ctx, uint32_t task, uint32_t thread)
{
    mm_job *j = ctx;
    uint32_t i = 0;
    while (task >= j->first[i + 1])
        i++;
    const st_wmat *w = j->mm[i].w;
    uint32_t local = task - j->first[i];
    uint32_t rb = local / j->ntb, tb = local % j->ntb;
    uint32_t r0 = rb * MM_RB, r1 = r0 + MM_RB, t0 = tb * MM_TB, t1 = t0 + MM_TB;
    if (r1 > w->rows)
        r1 = w->rows;
    if (t1 > j->T)
        t1 = j->T;
    const st_qdot *qd = j->k->qdot ? st_qdot_get(w->type) : NULL;
    if (qd) {
        size_t ws = st_wmat_row_bytes(w), xs = j->xqs[qd->act - 1];
        qd->mm[j->k->vec + j->k->v512]((const uint8_t *)w->data + (size_t)r0 * ws, ws,
                          j->xq[qd->act - 1] + (size_t)t0 * xs, xs, w->cols / qd->block,
                          j->mm[i].y + (size_t)t0 * j->mm[i].ldy + r0, j->mm[i].ldy, r1 - r0,
                          t1 - t0);
        return;
    }
    st_kern_matmul(j->k, w, j->x, j->ldx, j->mm[i].y, j->mm[i].ldy, r0, r1, t0, t1);
}

typedef struct qact_job {
    const st_qdot *qd;
    int wrong;
    const float *x;
    uint32_t ldx, cols;
    uint8_t *dst;
    size_t xs;
} qact_job;

static void qact_task(void *ctx, uint32_t t, uint32_t thread)
{
    qact_job *j = ctx;
    j->qd->quantize(j->x + (size_t)t * j->ldx, j->dst + (size_t)t * j->xs, j->cols);
    if (j->wrong)
        st_qdot_wrong_scale(j->qd, j->dst + (size_t)t * j->xs, j->cols);
}

/* Tokens [0, T) of x into the activation formats the products of mm need (invariant 4). */
static void mm_quantize(st_ops_cpu *oc, const float *x, uint32_t ldx, uint32_t T, mm_job *j)
{
    for (uint32_t i = 0; i < j->n; i++) {
        const st_qdot *qd = st_qdot_get(j->mm[i].w->type);
        if (!qd || j->xq[qd->act - 1])
            continue;
        uint32_t cols = j->mm[i].w->cols;
        qact_job q = {qd, oc->wrong_qact, x, ldx, cols, oc->qact[qd->act - 1],
                      (size_t)cols / qd->block * qd->act_bytes};
        st_pool_run(oc->pool, T, qact_task, &q, (uint64_t)T * cols);
        j->xq[qd->act - 1] = q.dst;
        j->xqs[qd->act - 1] = q.xs;
    }
}

static void cpu_matmul(void *ocp, const float *x, uint32_t ldx, uint32_t T, const st_mm *mm,
                       uint32_t n)
{
    st_ops_cpu *oc = ocp;
    /* the integer path quantizes at most qact_T tokens at a time: each output depends on its
     * own token only, so the split changes no result */
    uint32_t step = oc->qact_T ? oc->qact_T : T;
    for (uint32_t t = 0; t < T; t += step) {
        uint32_t tn = T - t < step ? T - t : step;
        const float *xt = x + (size_t)t * ldx;
        for (uint32_t b = 0; b < n; b += MM_MAX) {
            mm_job j = {oc->k, xt, ldx, tn, n - b < MM_MAX ? n - b : MM_MAX,
                        (tn + MM_TB - 1) / MM_TB, mm + b, {NULL, NULL}, {0, 0}, {0}};
            st_mm sub[MM_MAX];
            for (uint32_t i = 0; i < j.n; i++) {
                sub[i] = mm[b + i];
                sub[i].y += (size_t)t * sub[i].ldy;
            }
            j.mm = sub;
            if (oc->k->qdot && oc->qact_T)
                mm_quantize(oc, xt, ldx, tn, &j);
            uint64_t work = 0;
            for (uint32_t i = 0; i < j.n; i++) {
                j.first[i + 1] = j.first[i] + (j.mm[i].w->rows + MM_RB - 1) / MM_RB * j.ntb;
                work += 2ull * j.mm[i].w->rows * j.mm[i].w->cols * tn;
            }
            st_pool_run(oc->pool, j.first[j.n], mm_task, &j, work);
        }
    }
}

/* ---- norms and element-wise steps, per token ------------------------------------------------ */
typedef struct tok_job {
    const st_kern *k;
    float *x, *y;
    const float *a, *b, *w;
    uint32_t n, heads, hd, ld;
    float eps, scale;
} tok_job;

static void add_rmsnorm_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    float *x = j->x + (size_t)t * j->n;
    if (j->a) {
        const float *o = j->a + (size_t)t * j->n;
        for (uint32_t i = 0; i < j->n; i++)
            x[i] += o[i];
    }
    rmsnorm(j->k, j->y + (size_t)t * j->n, x, j->w, j->n, j->eps);
}

static void cpu_add_rmsnorm(void *ocp, float *x, const float *add, const float *w, uint32_t n,
                            float eps, float *y, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = x, .y = y, .a = add, .w = w, .n = n, .eps = eps};
    st_pool_run(oc->pool, T, add_rmsnorm_task, &j, 4ull * T * n);
}

static void rmsnorm_gated_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    for (uint32_t h = 0; h < j->heads; h++) {
        float *o = j->x + (size_t)t * j->heads * j->hd + (size_t)h * j->hd;
        const float *g = j->a + (size_t)t * j->heads * j->hd + (size_t)h * j->hd;
        rmsnorm(j->k, o, o, j->w, j->hd, j->eps);
        for (uint32_t i = 0; i < j->hd; i++)
            o[i] = o[i] * silu(g[i]);
    }
}

static void cpu_rmsnorm_gated(void *ocp, float *x, const float *z, const float *w, uint32_t heads,
                              uint32_t hd, float eps, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = x, .a = z, .w = w, .heads = heads, .hd = hd, .eps = eps};
    st_pool_run(oc->pool, T, rmsnorm_gated_task, &j, 20ull * T * heads * hd);
}

static void l2norm_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    for (uint32_t h = 0; h < j->heads; h++) {
        float *x = j->x + (size_t)t * j->ld + (size_t)h * j->hd;
        float nx = 1.0f / sqrtf(st_kern_dot(j->k, x, x, j->hd) + j->eps);
        for (uint32_t i = 0; i < j->hd; i++)
            x[i] = x[i] * nx * j->scale;
    }
}

static void cpu_l2norm(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd, float eps,
                       float scale, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = x, .heads = heads, .hd = hd, .ld = ld, .eps = eps,
                 .scale = scale};
    st_pool_run(oc->pool, T, l2norm_task, &j, 4ull * T * heads * hd);
}

static void swiglu_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    float *g = j->x + (size_t)t * j->n;
    const float *u = j->a + (size_t)t * j->n;
    for (uint32_t i = 0; i < j->n; i++)
        g[i] = silu(g[i]) * u[i];
}

static void cpu_swiglu(void *ocp, float *g, const float *u, uint32_t n, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = g, .a = u, .n = n};
    st_pool_run(oc->pool, T, swiglu_task, &j, 20ull * T * n);
}

static void dn_gates_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    float *a = j->x + (size_t)t * j->ld, *b = j->y + (size_t)t * j->ld;
    for (uint32_t h = 0; h < j->heads; h++) {
        float g = j->w[h] * softplus(a[h] + j->b[h]);
        a[h] = expf(g);
        b[h] = sigmoid(b[h]);
    }
}

static void cpu_dn_gates(void *ocp, float *a, float *b, uint32_t ld, const float *ssm_a,
                         const float *dt_bias, uint32_t H, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = a, .y = b, .w = ssm_a, .b = dt_bias, .heads = H, .ld = ld};
    st_pool_run(oc->pool, T, dn_gates_task, &j, 40ull * T * H);
}

/* ---- the short convolution: a block of 64 channels over every token ------------------------- */
#define CONV_CB 64
typedef struct conv_job {
    const st_kern *k;
    const float *x, *wT;
    float *y, *state;
    uint32_t C, T;
} conv_job;

static void conv_task(void *ctx, uint32_t task, uint32_t thread)
{
    conv_job *j = ctx;
    uint32_t c0 = task * CONV_CB, c1 = c0 + CONV_CB;
    if (c1 > j->C)
        c1 = j->C;
    st_kern_conv(j->k, j->x, j->C, j->y, j->C, j->state, j->C, j->wT, c0, c1, j->T);
    for (uint32_t t = 0; t < j->T; t++) {
        float *y = j->y + (size_t)t * j->C;
        for (uint32_t ch = c0; ch < c1; ch++)
            y[ch] = silu(y[ch]);
    }
}

static void cpu_short_conv(void *ocp, const float *x, float *y, uint32_t C, float *state,
                           const float *wT, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    conv_job j = {oc->k, x, wT, y, state, C, T};
    st_pool_run(oc->pool, (C + CONV_CB - 1) / CONV_CB, conv_task, &j, 20ull * T * C);
}

/* ---- the delta rule: one value head over every token of the call, in order. (Splitting a
 * head's columns across threads gives the same results but measured slower: threads writing
 * neighbouring columns share cache lines of the state.) -------------------------------------- */
typedef struct dn_job {
    st_ops_cpu *oc;
    const st_dn_args *a;
} dn_job;

static void dn_task(void *ctx, uint32_t h, uint32_t thread)
{
    dn_job *j = ctx;
    const st_dn_args *a = j->a;
    uint32_t kh = a->grouped ? h / (a->n_v_heads / a->n_k_heads) : h % a->n_k_heads;
    float *M = a->state + (size_t)h * a->dk * a->dv;
    float *scr = j->oc->scratch + (size_t)thread * j->oc->scratch_per_thread;
    st_kern_delta_scan(j->oc->k, M, a->dv, a->dk, a->dv, a->T, a->q + (size_t)kh * a->dk,
                       a->k + (size_t)kh * a->dk, a->v + (size_t)h * a->dv, a->ld, a->alpha + h,
                       a->beta + h, a->ld_g, a->out + (size_t)h * a->dv, a->ld_out, scr);
}

static void cpu_delta_rule(void *ocp, const st_dn_args *a)
{
    st_ops_cpu *oc = ocp;
    dn_job j = {oc, a};
    st_pool_run(oc->pool, a->n_v_heads, dn_task, &j, 6ull * a->T * a->n_v_heads * a->dk * a->dv);
}

/* ---- RoPE and the K/V store, per token --------------------------------------------------- */
typedef struct rope_job {
    float *x;
    uint32_t ld, heads, hd, n_rot;
    uint64_t pos0;
    const double *freq;
} rope_job;

/* The cosines and sines of token t's angles (pos0 + t) * freq[i], i < n_rot / 2, computed once
 * for all of its heads (angle, cosine and sine in double, then rounded to float). */
#define ROPE_MAX_PAIRS 2048 /* head_dim <= 4096 (the architectures' checks) */
static void rope_angles(const rope_job *j, uint32_t t, float *cs, float *sn)
{
    uint64_t pos = j->pos0 + t;
    for (uint32_t i = 0; i < j->n_rot / 2; i++) {
        double a = (double)pos * j->freq[i];
        cs[i] = (float)cos(a);
        sn[i] = (float)sin(a);
    }
}

static void rope_task(void *ctx, uint32_t t, uint32_t thread)
{
    rope_job *j = ctx;
    float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];
    rope_angles(j, t, cs, sn);
    for (uint32_t h = 0; h < j->heads; h++) {
        float *v = j->x + (size_t)t * j->ld + (size_t)h * j->hd;
        for (uint32_t i = 0; i < j->n_rot / 2; i++) {
            float x0 = v[2 * i], x1 = v[2 * i + 1];
            v[2 * i] = x0 * cs[i] - x1 * sn[i];
            v[2 * i + 1] = x0 * sn[i] + x1 * cs[i];
        }
    }
}

static void cpu_rope_norm(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                          uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    rope_job j = {x, ld, heads, hd, n_rot, pos0, freq};
    st_pool_run(oc->pool, T, rope_task, &j, 20ull * T * heads * n_rot);
}

static void rope_neox_task(void *ctx, uint32_t t, uint32_t thread)
{
    rope_job *j = ctx;
    float cs[ROPE_MAX_PAIRS], sn[ROPE_MAX_PAIRS];
    uint32_t half = j->n_rot / 2;
    rope_angles(j, t, cs, sn);
    for (uint32_t h = 0; h < j->heads; h++) {
        float *v = j->x + (size_t)t * j->ld + (size_t)h * j->hd;
        for (uint32_t i = 0; i < half; i++) {
            float x0 = v[i], x1 = v[i + half];
            v[i] = x0 * cs[i] - x1 * sn[i];
            v[i + half] = x0 * sn[i] + x1 * cs[i];
        }
    }
}

static void cpu_rope_neox(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                          uint32_t n_rot, uint64_t pos0, const double *freq, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    rope_job j = {x, ld, heads, hd, n_rot, pos0, freq};
    st_pool_run(oc->pool, T, rope_neox_task, &j, 20ull * T * heads * n_rot);
}

static void rmsnorm_heads_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    for (uint32_t h = 0; h < j->heads; h++) {
        float *x = j->x + (size_t)t * j->ld + (size_t)h * j->hd;
        rmsnorm(j->k, x, x, j->w, j->hd, j->eps);
    }
}

static void cpu_rmsnorm_heads(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                              const float *w, float eps, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = x, .w = w, .heads = heads, .hd = hd, .ld = ld, .eps = eps};
    st_pool_run(oc->pool, T, rmsnorm_heads_task, &j, 4ull * T * heads * hd);
}

static inline uint8_t *row_ptr(const st_kv_view *kv, uint8_t *const *pages, uint64_t row,
                               uint64_t rb)
{
    return pages[row / kv->page_size] + (row % kv->page_size) * rb;
}

static void quant_i8(int8_t *dst, float *scale, const float *x, uint32_t n)
{
    float amax = 0.0f;
    for (uint32_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > amax)
            amax = a;
    }
    if (!(amax > 0.0f) || !isfinite(amax)) {
        memset(dst, 0, n);
        *scale = 0.0f;
        return;
    }
    float inv = 127.0f / amax;
    for (uint32_t i = 0; i < n; i++) {
        long q = lrintf(x[i] * inv);
        dst[i] = (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
    }
    *scale = amax / 127.0f;
}

typedef struct store_job {
    const st_kv_view *kv;
    const float *k, *v;
    uint32_t ld;
    uint64_t pos0;
} store_job;

static void store_task(void *ctx, uint32_t t, uint32_t thread)
{
    store_job *j = ctx;
    const st_kv_view *kv = j->kv;
    uint32_t hd = kv->head_dim, nkv = kv->kv_heads;
    uint64_t pos = j->pos0 + t;
    const float *k = j->k + (size_t)t * j->ld, *v = j->v + (size_t)t * j->ld;
    uint8_t *kr = row_ptr(kv, kv->k, pos, kv->row), *vr = row_ptr(kv, kv->v, pos, kv->row);
    if (kv->dtype == ST_DTYPE_I8) {
        float *ks = (float *)row_ptr(kv, kv->ks, pos, kv->srow);
        float *vs = (float *)row_ptr(kv, kv->vs, pos, kv->srow);
        for (uint32_t h = 0; h < nkv; h++) {
            quant_i8((int8_t *)kr + (size_t)h * hd, &ks[h], k + (size_t)h * hd, hd);
            quant_i8((int8_t *)vr + (size_t)h * hd, &vs[h], v + (size_t)h * hd, hd);
        }
    } else if (kv->dtype == ST_DTYPE_F32) {
        memcpy(kr, k, (size_t)nkv * hd * sizeof *k);
        memcpy(vr, v, (size_t)nkv * hd * sizeof *v);
    } else {
        st_codec_f16_encode((uint16_t *)kr, k, (size_t)nkv * hd);
        st_codec_f16_encode((uint16_t *)vr, v, (size_t)nkv * hd);
    }
}

static void cpu_kv_store(void *ocp, const st_kv_view *kv, const float *k, const float *v,
                         uint32_t ld, uint64_t pos0, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    store_job j = {kv, k, v, ld, pos0};
    st_pool_run(oc->pool, T, store_task, &j, 10ull * T * kv->kv_heads * kv->head_dim);
}

/* ---- attention: one head for a block of up to qb consecutive queries: scores q K^T over the
 * keys the block needs (each one the canonical dot product), then per query the scaling, the
 * causal limit 0..pos0+t, softmax (max, exp, sum in key order) and the weighted sum of values
 * in key order. Queries are grouped only to share the loads of K and V rows. ------------------ */
typedef struct attn_job {
    st_ops_cpu *oc;
    const st_kv_view *kv;
    const float *q;
    float *out;
    uint32_t ldq, ldo, n_head, T;
    uint64_t pos0;
} attn_job;

static void attn_task(void *ctx, uint32_t task, uint32_t thread)
{
    attn_job *f = ctx;
    st_ops_cpu *c = f->oc;
    const st_kv_view *kv = f->kv;
    const st_kern *k = c->k;
    uint32_t hd = kv->head_dim, nh = f->n_head, nkv = kv->kv_heads;
    uint32_t kva = nkv * hd, ldq = f->ldq, ldo = f->ldo;
    uint32_t nqb = (f->T + c->qb - 1) / c->qb;
    uint32_t h = task / nqb, t0 = task % nqb * c->qb, g = h / (nh / nkv);
    uint32_t t1 = t0 + c->qb < f->T ? t0 + c->qb : f->T, nq = t1 - t0;
    uint32_t ps = kv->page_size;
    int i8 = kv->dtype == ST_DTYPE_I8;
    int f32 = kv->dtype == ST_DTYPE_F32;
    uint32_t type = i8 ? ST_GGML_I8 : f32 ? ST_GGML_F32 : ST_GGML_F16;
    uint64_t esz = i8 ? 1 : f32 ? 4 : 2;
    uint8_t *const *kp = kv->k, *const *vp = kv->v;
    const float *q = f->q + (size_t)t0 * ldq + (size_t)h * hd;
    uint32_t ldp = c->n_ctx;
    float *sc = c->scores + (size_t)thread * c->qb * ldp;
    uint64_t nk = f->pos0 + t1;
    for (uint64_t p0 = 0; p0 < nk; p0 += ps) {
        uint32_t rows = (uint32_t)(nk - p0 < ps ? nk - p0 : ps);
        st_wmat km = {kp[p0 / ps] + (size_t)g * hd * esz, type, rows, hd, kva};
        st_kern_matmul(k, &km, q, ldq, sc + p0, ldp, 0, rows, 0, nq);
    }
    float inv = 1.0f / sqrtf((float)hd);
    float *rs = c->scratch + (size_t)thread * c->scratch_per_thread;
    for (uint32_t i = 0; i < nq; i++) {
        float *row = sc + (size_t)i * ldp;
        uint64_t n = f->pos0 + t0 + i + 1;
        float m = -INFINITY;
        for (uint64_t j = 0; j < n; j++) {
            float s = row[j];
            if (i8)
                s = s * ((const float *)row_ptr(kv, kv->ks, j, kv->srow))[g];
            s *= inv;
            row[j] = s;
            if (s > m)
                m = s;
        }
        float sum = 0.0f;
        for (uint64_t j = 0; j < n; j++) {
            float p = expf(row[j] - m);
            row[j] = p;
            sum += p;
        }
        rs[i] = 1.0f / sum;
        float *out = f->out + (size_t)(t0 + i) * ldo + (size_t)h * hd;
        for (uint32_t d = 0; d < hd; d++)
            out[d] = 0.0f;
    }
    for (uint32_t i = 0; i < nq; i += 4) {
        uint32_t nb = nq - i < 4 ? nq - i : 4;
        uint64_t common = f->pos0 + t0 + i + 1;
        float *out = f->out + (size_t)(t0 + i) * ldo + (size_t)h * hd;
        const float *p = sc + (size_t)i * ldp;
        for (uint64_t p0 = 0; p0 < common; p0 += ps) {
            uint32_t j1 = (uint32_t)(common - p0 < ps ? common : p0 + ps);
            const uint8_t *v = vp[p0 / ps] + (size_t)g * hd * esz;
            const float *vs = i8 ? (const float *)kv->vs[p0 / ps] + g : NULL;
            st_kern_pv(k, out, ldo, p, ldp, nb, v, type, kva, vs, nkv, (uint32_t)p0, j1, hd);
        }
        /* the later queries of the group see a few more keys */
        for (uint32_t ii = 1; ii < nb; ii++)
            for (uint64_t j = common; j < common + ii; j++) {
                const uint8_t *v = row_ptr(kv, vp, j, kv->row) + (size_t)g * hd * esz;
                const float *vs = i8 ? (const float *)row_ptr(kv, kv->vs, j, kv->srow) + g : NULL;
                st_kern_pv(k, out + (size_t)ii * ldo, ldo, p + (size_t)ii * ldp, ldp, 1, v, type,
                           kva, vs, nkv, (uint32_t)j, (uint32_t)j + 1, hd);
            }
    }
    for (uint32_t i = 0; i < nq; i++) {
        float *out = f->out + (size_t)(t0 + i) * ldo + (size_t)h * hd;
        for (uint32_t d = 0; d < hd; d++)
            out[d] *= rs[i];
    }
}

static void cpu_attention(void *ocp, const st_kv_view *kv, const float *q, uint32_t ldq,
                          float *out, uint32_t ldo, uint32_t n_head, uint64_t pos0, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    attn_job j = {oc, kv, q, out, ldq, ldo, n_head, T, pos0};
    st_pool_run(oc->pool, (T + oc->qb - 1) / oc->qb * n_head, attn_task, &j,
                4ull * T * n_head * kv->head_dim * (pos0 + T));
}

/* ---- the Qwen hybrids' steps, per token ---------------------------------------------------- */
static void l2norm_max_task(void *ctx, uint32_t t, uint32_t thread)
{
    tok_job *j = ctx;
    for (uint32_t h = 0; h < j->heads; h++) {
        float *x = j->x + (size_t)t * j->ld + (size_t)h * j->hd;
        float n = sqrtf(st_kern_dot(j->k, x, x, j->hd));
        float nx = 1.0f / (n > j->eps ? n : j->eps);
        for (uint32_t i = 0; i < j->hd; i++)
            x[i] = x[i] * nx * j->scale;
    }
}

static void cpu_l2norm_max(void *ocp, float *x, uint32_t ld, uint32_t heads, uint32_t hd,
                           float eps, float scale, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    tok_job j = {.k = oc->k, .x = x, .heads = heads, .hd = hd, .ld = ld, .eps = eps,
                 .scale = scale};
    st_pool_run(oc->pool, T, l2norm_max_task, &j, 4ull * T * heads * hd);
}

typedef struct sgm_job {
    float *x;
    const float *g;
    uint32_t ldx, ldg, n;
} sgm_job;

static void sigmoid_mul_task(void *ctx, uint32_t t, uint32_t thread)
{
    sgm_job *j = ctx;
    float *x = j->x + (size_t)t * j->ldx;
    const float *g = j->g + (size_t)t * j->ldg;
    for (uint32_t i = 0; i < j->n; i++)
        x[i] = x[i] * sigmoid(g[i]);
}

static void cpu_sigmoid_mul(void *ocp, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                            uint32_t n, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    sgm_job j = {x, g, ldx, ldg, n};
    st_pool_run(oc->pool, T, sigmoid_mul_task, &j, 20ull * T * n);
}

typedef struct route_job {
    const float *logits;
    uint32_t X, k;
    uint32_t *sel;
    float *w;
} route_job;

static void route_task(void *ctx, uint32_t t, uint32_t thread)
{
    route_job *j = ctx;
    const float *l = j->logits + (size_t)t * j->X;
    uint32_t *sel = j->sel + (size_t)t * j->k;
    float *w = j->w + (size_t)t * j->k;
    float m = -INFINITY, sum = 0.0f;
    for (uint32_t e = 0; e < j->X; e++)
        if (l[e] > m)
            m = l[e];
    for (uint32_t e = 0; e < j->X; e++)
        sum += expf(l[e] - m);
    /* the k largest logits are the k largest p: selection by insertion, ties to the lower id */
    uint32_t n = 0;
    for (uint32_t e = 0; e < j->X; e++) {
        uint32_t i = n < j->k ? n++ : j->k;
        if (i == j->k && !(l[e] > l[sel[j->k - 1]]))
            continue;
        if (i == j->k)
            i = j->k - 1;
        while (i > 0 && l[e] > l[sel[i - 1]]) {
            sel[i] = sel[i - 1];
            i--;
        }
        sel[i] = e;
    }
    float ws = 0.0f;
    for (uint32_t i = 0; i < j->k; i++) {
        w[i] = expf(l[sel[i]] - m) / sum;
        ws += w[i];
    }
    if (ws < 6.103515625e-5f)
        ws = 6.103515625e-5f;
    for (uint32_t i = 0; i < j->k; i++)
        w[i] = w[i] / ws;
}

static void cpu_moe_route(void *ocp, const float *logits, uint32_t X, uint32_t k, uint32_t *sel,
                          float *w, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    route_job j = {logits, X, k, sel, w};
    st_pool_run(oc->pool, T, route_task, &j, 20ull * T * X);
}

typedef struct sadd_job {
    float *x;
    const float *y, *s;
    uint32_t ldx, ldy, lds, n, sig;
} sadd_job;

static void sadd_task(void *ctx, uint32_t t, uint32_t thread)
{
    sadd_job *j = ctx;
    float *x = j->x + (size_t)t * j->ldx;
    if (j->sig) {
        float g = sigmoid(j->s[(size_t)t * j->lds]);
        for (uint32_t i = 0; i < j->n; i++)
            x[i] = x[i] * g;
        return;
    }
    const float *y = j->y + (size_t)t * j->ldy;
    float s = j->s ? j->s[(size_t)t * j->lds] : 1.0f;
    for (uint32_t i = 0; i < j->n; i++)
        x[i] = x[i] + s * y[i];
}

static void cpu_scale_add(void *ocp, float *x, uint32_t ldx, const float *y, uint32_t ldy,
                          const float *s, uint32_t lds, uint32_t n, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    sadd_job j = {x, y, s, ldx, ldy, lds, n, 0};
    st_pool_run(oc->pool, T, sadd_task, &j, 2ull * T * n);
}

static void cpu_sigmoid_scale(void *ocp, float *x, uint32_t ldx, const float *g, uint32_t ldg,
                              uint32_t n, uint32_t T)
{
    st_ops_cpu *oc = ocp;
    sadd_job j = {x, NULL, g, ldx, 0, ldg, n, 1};
    st_pool_run(oc->pool, T, sadd_task, &j, 2ull * T * n);
}

/* ---- memory: the host's ----------------------------------------------------------------- */
static void *cpu_mem_alloc(void *ocp, size_t bytes)
{
    (void)ocp;
    return st_big_alloc(bytes ? bytes : 1);
}

static void cpu_mem_free(void *ocp, void *p)
{
    (void)ocp;
    free(p);
}

static void cpu_copy(void *ocp, void *dst, const void *src, size_t bytes)
{
    (void)ocp;
    if (bytes)
        memcpy(dst, src, bytes);
}

const st_ops st_ops_cpu_table = {
    .name = "cpu",
    .mem_alloc = cpu_mem_alloc,
    .mem_free = cpu_mem_free,
    .upload = cpu_copy,
    .download = cpu_copy,
    .get_rows = cpu_get_rows,
    .matmul = cpu_matmul,
    .add_rmsnorm = cpu_add_rmsnorm,
    .rmsnorm_gated = cpu_rmsnorm_gated,
    .l2norm = cpu_l2norm,
    .swiglu = cpu_swiglu,
    .short_conv = cpu_short_conv,
    .dn_gates = cpu_dn_gates,
    .delta_rule = cpu_delta_rule,
    .rope_norm = cpu_rope_norm,
    .rope_neox = cpu_rope_neox,
    .rmsnorm_heads = cpu_rmsnorm_heads,
    .kv_store = cpu_kv_store,
    .attention = cpu_attention,
    .l2norm_max = cpu_l2norm_max,
    .sigmoid_mul = cpu_sigmoid_mul,
    .moe_route = cpu_moe_route,
    .scale_add = cpu_scale_add,
    .sigmoid_scale = cpu_sigmoid_scale,
};
