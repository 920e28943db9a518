/*
 * st_backend_cpu.c - the CPU backend: the strata-hybrid forward pass over a thread pool, the
 * paged K/V arena and the running state of a slot, published as geometry tensors.
 *
 * Invariants:
 * 1. A slot state holds, per DeltaNet layer, the recurrent matrix (ssm_state, [heads][dk][dv],
 *    the transpose of S in the paper's notation) and the last ssm_conv - 1 convolution inputs
 *    (conv_state, [3][channels], oldest first); per attention layer, K and V pages of page_size
 *    rows ([n_head_kv][head_dim] each, f16 or i8) and for i8 a page of f32 scales per row and
 *    head; and the position: the number of tokens read.
 * 2. The geometry lists exactly these buffers, in layer order, then "pos". Rows at or beyond the
 *    position are never read (they may hold bytes of an abandoned branch).
 * 3. Every parallel step splits its outputs into tasks; a task computes each of its outputs
 *    alone and in full, with the canonical reductions of st_kernels.c, so results depend on
 *    neither the number of threads nor the size of the chunk a token is read in: a token's
 *    outputs are computed the same way whether it is read alone or with 2,047 others.
 * 4. forward() allocates the pages it needs before it changes anything, so an allocation
 *    failure leaves the state as it was.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"


typedef struct cpu_ctx {
    st_engine *e;
    const st_model *m;
    const st_model_hparams *hp;
    uint32_t T, n_ctx, page_size, n_pages, kv_dtype, n_threads;
    uint32_t C;             /* DeltaNet conv channels */
    uint32_t n_dn, n_attn;
    uint64_t krow, srow;    /* bytes of one K (or V) row, of one scale row */
    st_tensor_desc *descs;
    st_state_map *tm;
    uint32_t n_desc;
    double *rope_freq;
    /* workspace */
    float *x, *xn, *out, *qkv, *qkvc, *gate, *o, *ab, *logit_in;
    uint32_t qb;    /* attention queries per task */
    float *scores;  /* per thread: qb x n_ctx */
    float *scratch; /* per thread: scratch_per_thread */
    uint32_t scratch_per_thread;
} cpu_ctx;

typedef struct cpu_state {
    int64_t pos;
    float **ssm, **conv;
    uint8_t ***kp, ***vp, ***ksp, ***vsp; /* [attn layer][page] */
} cpu_state;

static void cpu_destroy(void *bctx)
{
    cpu_ctx *c = bctx;
    if (!c)
        return;
    free(c->descs);
    free(c->tm);
    free(c->rope_freq);
    free(c->x);
    free(c->xn);
    free(c->out);
    free(c->qkv);
    free(c->qkvc);
    free(c->gate);
    free(c->o);
    free(c->ab);
    free(c->logit_in);
    free(c->scores);
    free(c->scratch);
    free(c);
}

static float *falloc(uint64_t n, int *err)
{
    float *p = st_big_alloc((n ? n : 1) * sizeof(float));
    if (!p)
        *err = 1;
    return p;
}

static uint64_t max3(uint64_t a, uint64_t b, uint64_t c)
{
    uint64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int cpu_create(st_engine *e, void **out)
{
    *out = NULL;
    cpu_ctx *c = calloc(1, sizeof *c);
    if (!c)
        return st_error_set(ENOMEM, "cpu backend");
    const st_model_hparams *hp = &e->m->hp;
    c->e = e;
    c->m = e->m;
    c->hp = hp;
    c->T = e->o.ubatch;
    c->n_ctx = e->o.n_ctx;
    c->page_size = e->o.page_size;
    c->n_pages = (c->n_ctx + c->page_size - 1) / c->page_size;
    c->kv_dtype = e->o.kv_dtype;
    c->n_threads = st_pool_size(e->pool);
    c->C = hp->ssm_heads * (2 * hp->ssm_dk + hp->ssm_dv);
    c->descs = calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->descs);
    c->tm = calloc(ST_STATE_LAYOUT_MAX(hp->n_layer), sizeof *c->tm);
    c->rope_freq = calloc(hp->head_dim / 2 + 1, sizeof *c->rope_freq);
    if (!c->descs || !c->tm || !c->rope_freq) {
        cpu_destroy(c);
        return st_error_set(ENOMEM, "cpu backend");
    }
    uint64_t esz = c->kv_dtype == ST_DTYPE_I8 ? 1 : 2;
    c->krow = (uint64_t)hp->n_head_kv * hp->head_dim * esz;
    c->srow = (uint64_t)hp->n_head_kv * 4;
    c->n_desc = st_state_layout(&e->m->mem, c->n_ctx, c->kv_dtype, c->descs, c->tm);
    c->n_dn = e->m->mem.n_rec;
    c->n_attn = e->m->mem.n_kv;
    for (uint32_t i = 0; i < hp->head_dim / 2; i++)
        c->rope_freq[i] = pow((double)hp->rope_base, -(double)(2 * i) / (double)hp->head_dim);

    uint64_t T = c->T, E = hp->n_embd, F = hp->n_ff;
    uint64_t qa = (uint64_t)hp->n_head * hp->head_dim, kva = (uint64_t)hp->n_head_kv * hp->head_dim;
    uint64_t hdv = (uint64_t)hp->ssm_heads * hp->ssm_dv;
    int err = 0;
    c->x = falloc(T * E, &err);
    c->xn = falloc(T * E, &err);
    c->out = falloc(T * E, &err);
    c->qkv = falloc(T * max3(c->n_dn ? c->C : 0, c->n_attn ? qa + 2 * kva : 0, 1), &err);
    c->qkvc = falloc(c->n_dn ? T * c->C : 1, &err);
    c->gate = falloc(T * max3(c->n_dn ? hdv : 0, F, 1), &err);
    c->o = falloc(T * max3(c->n_dn ? hdv : 0, c->n_attn ? qa : 0, F), &err);
    c->ab = falloc(T * 2 * (uint64_t)(hp->ssm_heads ? hp->ssm_heads : 1), &err);
    c->logit_in = falloc(E, &err);
    c->qb = (1u << 22) / c->n_ctx;
    c->qb = c->qb < 1 ? 1 : c->qb > 16 ? 16 : c->qb;
    c->scores = falloc((uint64_t)c->n_threads * c->qb * c->n_ctx, &err);
    c->scratch_per_thread = (uint32_t)max3(2 * (uint64_t)hp->ssm_dv, c->qb, 1);
    c->scratch = falloc((uint64_t)c->n_threads * c->scratch_per_thread, &err);
    if (err) {
        cpu_destroy(c);
        return st_error_set(ENOMEM, "cpu backend: workspace for a chunk of %u tokens", c->T);
    }
    *out = c;
    return 0;
}

static int cpu_tensors(void *bctx, const st_tensor_desc **descs, uint32_t *n)
{
    cpu_ctx *c = bctx;
    *descs = c->descs;
    *n = c->n_desc;
    return 0;
}

/* ---- state --------------------------------------------------------------------------- */
static void free_pages(cpu_ctx *c, uint8_t ***pp)
{
    if (!pp)
        return;
    for (uint32_t a = 0; a < c->n_attn; a++) {
        if (!pp[a])
            continue;
        for (uint32_t p = 0; p < c->n_pages; p++)
            free(pp[a][p]);
        free(pp[a]);
    }
    free(pp);
}

static void cpu_state_free(void *bctx, void *stp)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    if (!s)
        return;
    if (s->ssm)
        for (uint32_t i = 0; i < c->n_dn; i++)
            free(s->ssm[i]);
    if (s->conv)
        for (uint32_t i = 0; i < c->n_dn; i++)
            free(s->conv[i]);
    free(s->ssm);
    free(s->conv);
    free_pages(c, s->kp);
    free_pages(c, s->vp);
    free_pages(c, s->ksp);
    free_pages(c, s->vsp);
    free(s);
}

static uint8_t ***alloc_table(cpu_ctx *c, int *err)
{
    uint8_t ***pp = calloc(c->n_attn ? c->n_attn : 1, sizeof *pp);
    if (!pp) {
        *err = 1;
        return NULL;
    }
    for (uint32_t a = 0; a < c->n_attn; a++)
        if (!(pp[a] = calloc(c->n_pages, sizeof **pp)))
            *err = 1;
    return pp;
}

static int cpu_state_new(void *bctx, void **out)
{
    cpu_ctx *c = bctx;
    const st_model_hparams *hp = c->hp;
    int err = 0;
    *out = NULL;
    cpu_state *s = calloc(1, sizeof *s);
    if (!s)
        return st_error_set(ENOMEM, "cpu backend: slot state");
    s->ssm = calloc(c->n_dn ? c->n_dn : 1, sizeof *s->ssm);
    s->conv = calloc(c->n_dn ? c->n_dn : 1, sizeof *s->conv);
    if (!s->ssm || !s->conv)
        err = 1;
    for (uint32_t i = 0; !err && i < c->n_dn; i++) {
        s->ssm[i] = st_big_alloc((size_t)hp->ssm_heads * hp->ssm_dk * hp->ssm_dv * sizeof(float));
        s->conv[i] = st_big_alloc((size_t)(hp->ssm_conv - 1) * c->C * sizeof(float));
        if (!s->ssm[i] || !s->conv[i])
            err = 1;
    }
    s->kp = alloc_table(c, &err);
    s->vp = alloc_table(c, &err);
    if (c->kv_dtype == ST_DTYPE_I8) {
        s->ksp = alloc_table(c, &err);
        s->vsp = alloc_table(c, &err);
    }
    if (err) {
        cpu_state_free(c, s);
        return st_error_set(ENOMEM, "cpu backend: slot state");
    }
    *out = s;
    return 0;
}

static void cpu_state_reset(void *bctx, void *stp)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    const st_model_hparams *hp = c->hp;
    for (uint32_t i = 0; i < c->n_dn; i++) {
        memset(s->ssm[i], 0, (size_t)hp->ssm_heads * hp->ssm_dk * hp->ssm_dv * sizeof(float));
        memset(s->conv[i], 0, (size_t)(hp->ssm_conv - 1) * c->C * sizeof(float));
    }
    s->pos = 0;
}

/* Make sure pages covering rows [r0, r1) exist. */
static int ensure_pages(cpu_ctx *c, cpu_state *s, uint64_t r0, uint64_t r1)
{
    if (r1 <= r0)
        return 0;
    uint64_t p0 = r0 / c->page_size, p1 = (r1 - 1) / c->page_size;
    for (uint32_t a = 0; a < c->n_attn; a++)
        for (uint64_t p = p0; p <= p1; p++) {
            uint8_t ***tabs[4] = {s->kp, s->vp, s->ksp, s->vsp};
            uint64_t rb[4] = {c->krow, c->krow, c->srow, c->srow};
            for (int t = 0; t < 4; t++) {
                if (!tabs[t] || tabs[t][a][p])
                    continue;
                tabs[t][a][p] = calloc(c->page_size, rb[t]);
                if (!tabs[t][a][p])
                    return st_error_set(ENOMEM, "cpu backend: K/V page %llu",
                                        (unsigned long long)p);
            }
        }
    return 0;
}

static inline uint8_t *row_ptr(cpu_ctx *c, uint8_t **pages, uint64_t row, uint64_t rb)
{
    return pages[row / c->page_size] + (row % c->page_size) * rb;
}

static int cpu_running_read(void *bctx, void *stp, uint32_t ti, void *dst, uint64_t len)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    const st_model_hparams *hp = c->hp;
    const st_state_map *t = &c->tm[ti];
    switch (t->what) {
    case ST_SW_SSM:
        if (len != 4ull * hp->ssm_heads * hp->ssm_dk * hp->ssm_dv)
            break;
        memcpy(dst, s->ssm[t->slot], len);
        return 0;
    case ST_SW_CONV:
        if (len != 4ull * (hp->ssm_conv - 1) * c->C)
            break;
        memcpy(dst, s->conv[t->slot], len);
        return 0;
    case ST_SW_POS:
        if (len != 8)
            break;
        memcpy(dst, &s->pos, 8);
        return 0;
    default:
        break;
    }
    return st_error_set(ST_EINVAL, "cpu backend: running read of tensor %u (%s), %llu bytes", ti,
                        c->descs[ti].name, (unsigned long long)len);
}

static int cpu_running_write(void *bctx, void *stp, uint32_t ti, const void *src, uint64_t len)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    const st_model_hparams *hp = c->hp;
    const st_state_map *t = &c->tm[ti];
    switch (t->what) {
    case ST_SW_SSM:
        if (len != 4ull * hp->ssm_heads * hp->ssm_dk * hp->ssm_dv)
            break;
        memcpy(s->ssm[t->slot], src, len);
        return 0;
    case ST_SW_CONV:
        if (len != 4ull * (hp->ssm_conv - 1) * c->C)
            break;
        memcpy(s->conv[t->slot], src, len);
        return 0;
    case ST_SW_POS: {
        int64_t p;
        if (len != 8)
            break;
        memcpy(&p, src, 8);
        if (p < 0 || (uint64_t)p > c->n_ctx)
            return st_error_set(ST_ECORRUPT, "cpu backend: position %lld outside 0..%u",
                                (long long)p, c->n_ctx);
        s->pos = p;
        return 0;
    }
    default:
        break;
    }
    return st_error_set(ST_EINVAL, "cpu backend: running write of tensor %u (%s), %llu bytes", ti,
                        c->descs[ti].name, (unsigned long long)len);
}

static int kv_io(cpu_ctx *c, cpu_state *s, uint32_t ti, uint64_t row0, uint64_t nrows, void *buf,
                 int write)
{
    const st_state_map *t = &c->tm[ti];
    uint8_t ***tab;
    uint64_t rb;
    switch (t->what) {
    case ST_SW_K: tab = s->kp; rb = c->krow; break;
    case ST_SW_V: tab = s->vp; rb = c->krow; break;
    case ST_SW_KS: tab = s->ksp; rb = c->srow; break;
    case ST_SW_VS: tab = s->vsp; rb = c->srow; break;
    default:
        return st_error_set(ST_EINVAL, "cpu backend: tensor %u (%s) is not K/V", ti,
                            c->descs[ti].name);
    }
    if (row0 > c->n_ctx || nrows > c->n_ctx - row0)
        return st_error_set(ST_EINVAL, "cpu backend: K/V rows [%llu, +%llu) beyond %u",
                            (unsigned long long)row0, (unsigned long long)nrows, c->n_ctx);
    uint8_t **pages = tab[t->slot];
    uint8_t *b = buf;
    uint64_t r = row0, end = row0 + nrows;
    while (r < end) {
        uint64_t p = r / c->page_size, in = r % c->page_size;
        uint64_t k = c->page_size - in;
        if (k > end - r)
            k = end - r;
        if (!pages[p]) {
            if (!write)
                return st_error_set(ST_EINVAL, "cpu backend: K/V page %llu of %s never written",
                                    (unsigned long long)p, c->descs[ti].name);
            if (!(pages[p] = calloc(c->page_size, rb)))
                return st_error_set(ENOMEM, "cpu backend: K/V page");
        }
        if (write)
            memcpy(pages[p] + in * rb, b, k * rb);
        else
            memcpy(b, pages[p] + in * rb, k * rb);
        b += k * rb;
        r += k;
    }
    return 0;
}

static int cpu_kv_read(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows, void *dst)
{
    return kv_io(bctx, st, ti, row0, nrows, dst, 0);
}

static int cpu_kv_write(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows,
                        const void *src)
{
    return kv_io(bctx, st, ti, row0, nrows, (void *)src, 1);
}

/* ---- the forward pass ------------------------------------------------------------------- */
typedef struct fwd {
    cpu_ctx *c;
    cpu_state *s;
    const st_layer *L;
    const uint32_t *tokens;
    uint32_t T;
    uint64_t pos0;
    const float *norm_w; /* add_norm */
    int add;             /* add_norm: x += out first */
} fwd;

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

/* Several matrix products sharing one input, split into tasks of row blocks x token blocks. */
#define MM_RB 48
#define MM_TB 32
#define MM_MAX 6
typedef struct mm_multi {
    const st_kern *k;
    const float *x;
    uint32_t ldx, T, n;
    const st_wmat *w[MM_MAX];
    float *y[MM_MAX];
    uint32_t ldy[MM_MAX];
    uint32_t first[MM_MAX + 1]; /* task index where product i starts */
    uint32_t ntb;
} mm_multi;

static void mm_task(void *ctx, uint32_t task, uint32_t thread)
{
    mm_multi *j = ctx;
    uint32_t i = 0;
    while (task >= j->first[i + 1])
        i++;
    uint32_t local = task - j->first[i];
    uint32_t rb = local / j->ntb, tb = local % j->ntb;
    uint32_t r0 = rb * MM_RB, r1 = r0 + MM_RB, t0 = tb * MM_TB, t1 = t0 + MM_TB;
    if (r1 > j->w[i]->rows)
        r1 = j->w[i]->rows;
    if (t1 > j->T)
        t1 = j->T;
    st_kern_matmul(j->k, j->w[i], j->x, j->ldx, j->y[i], j->ldy[i], r0, r1, t0, t1);
}

static void mm_add(mm_multi *j, const st_wmat *w, float *y, uint32_t ldy)
{
    j->w[j->n] = w;
    j->y[j->n] = y;
    j->ldy[j->n] = ldy;
    j->n++;
}

static void mm_run(cpu_ctx *c, mm_multi *j)
{
    j->ntb = (j->T + MM_TB - 1) / MM_TB;
    j->first[0] = 0;
    uint64_t work = 0;
    for (uint32_t i = 0; i < j->n; i++) {
        j->first[i + 1] = j->first[i] + (j->w[i]->rows + MM_RB - 1) / MM_RB * j->ntb;
        work += 2ull * j->w[i]->rows * j->w[i]->cols * j->T;
    }
    st_pool_run(c->e->pool, j->first[j->n], mm_task, j, work);
}

static void mm_init(mm_multi *j, const st_kern *k, const float *x, uint32_t ldx, uint32_t T)
{
    memset(j, 0, sizeof *j);
    j->k = k;
    j->x = x;
    j->ldx = ldx;
    j->T = T;
}

/* Per token: x = embedding row. */
static void embed_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    const st_model *m = f->c->m;
    st_kern_row_f32(&m->tok_embd, f->tokens[t], f->c->x + (size_t)t * m->hp.n_embd);
}

/* Per token: optionally x += out, then xn = rmsnorm(x) * w. */
static void add_norm_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    uint32_t E = c->hp->n_embd;
    float *x = c->x + (size_t)t * E;
    if (f->add) {
        const float *o = c->out + (size_t)t * E;
        for (uint32_t i = 0; i < E; i++)
            x[i] += o[i];
    }
    rmsnorm(&c->e->kern, c->xn + (size_t)t * E, x, f->norm_w, E, c->hp->rms_eps);
}

/* DeltaNet: causal depthwise convolution + SiLU over a block of 64 channels, all tokens. */
#define CONV_CB 64
static void conv_task(void *ctx, uint32_t task, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    uint32_t C = c->C, T = f->T;
    uint32_t c0 = task * CONV_CB, c1 = c0 + CONV_CB;
    if (c1 > C)
        c1 = C;
    uint32_t dn = c->m->mem.layer[f->L - c->m->layers].slot;
    st_kern_conv(&c->e->kern, c->qkv, C, c->qkvc, C, f->s->conv[dn], C, f->L->conv_wT, c0, c1, T);
    for (uint32_t t = 0; t < T; t++) {
        float *y = c->qkvc + (size_t)t * C;
        for (uint32_t ch = c0; ch < c1; ch++)
            y[ch] = silu(y[ch]);
    }
}

/* DeltaNet, per token: L2-normalise q and k per head (q also by 1/sqrt(dk)); decay and write
 * strength per head. */
static void dn_prep_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    const st_kern *k = &c->e->kern;
    uint32_t H = hp->ssm_heads, dk = hp->ssm_dk;
    float *row = c->qkvc + (size_t)t * c->C;
    float qs = 1.0f / sqrtf((float)dk);
    for (uint32_t h = 0; h < H; h++) {
        float *q = row + (size_t)h * dk, *kk = row + (size_t)H * dk + (size_t)h * dk;
        float nq = 1.0f / sqrtf(st_kern_dot(k, q, q, dk) + 1e-6f);
        float nk = 1.0f / sqrtf(st_kern_dot(k, kk, kk, dk) + 1e-6f);
        for (uint32_t i = 0; i < dk; i++) {
            q[i] = q[i] * nq * qs;
            kk[i] = kk[i] * nk;
        }
        float *ab = c->ab + (size_t)t * 2 * H;
        float g = f->L->ssm_a[h] * softplus(ab[h] + f->L->dt_bias[h]);
        ab[h] = expf(g);
        ab[H + h] = sigmoid(ab[H + h]);
    }
}

/* DeltaNet recurrence, one head over every token of the chunk in order. (Splitting a head's
 * columns across threads gives the same results but measured slower: threads writing
 * neighbouring columns share cache lines of the state.) */
static void dn_scan_task(void *ctx, uint32_t task, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    uint32_t H = hp->ssm_heads, dk = hp->ssm_dk, dv = hp->ssm_dv;
    uint32_t h = task;
    float *M = f->s->ssm[c->m->mem.layer[f->L - c->m->layers].slot] + (size_t)h * dk * dv;
    float *scr = c->scratch + (size_t)thread * c->scratch_per_thread;
    const float *row = c->qkvc;
    st_kern_delta_scan(&c->e->kern, M, dv, dk, dv, f->T, row + (size_t)h * dk,
                       row + (size_t)H * dk + (size_t)h * dk, row + 2 * (size_t)H * dk + (size_t)h * dv,
                       c->C, c->ab + h, c->ab + H + h, 2 * (size_t)H, c->o + (size_t)h * dv,
                       (size_t)H * dv, scr);
}

/* DeltaNet output, per token: o_h = rmsnorm(o_h) * ssm_norm * silu(gate_h). */
static void dn_gate_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    uint32_t H = hp->ssm_heads, dv = hp->ssm_dv;
    for (uint32_t h = 0; h < H; h++) {
        float *o = c->o + (size_t)t * H * dv + (size_t)h * dv;
        const float *g = c->gate + (size_t)t * H * dv + (size_t)h * dv;
        rmsnorm(&c->e->kern, o, o, f->L->ssm_norm, dv, hp->rms_eps);
        for (uint32_t i = 0; i < dv; i++)
            o[i] = o[i] * silu(g[i]);
    }
}

static void rope(float *v, uint32_t hd, uint64_t pos, const double *freq)
{
    for (uint32_t i = 0; i < hd / 2; i++) {
        double a = (double)pos * freq[i];
        float cs = (float)cos(a), sn = (float)sin(a);
        float x0 = v[2 * i], x1 = v[2 * i + 1];
        v[2 * i] = x0 * cs - x1 * sn;
        v[2 * i + 1] = x0 * sn + x1 * cs;
    }
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

/* Attention, per token: RoPE on q and k, then K and V into the arena at pos0 + t. */
static void attn_store_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    uint32_t hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    uint32_t qa = nh * hd, kva = nkv * hd;
    uint64_t pos = f->pos0 + t;
    float *q = c->qkv + (size_t)t * (qa + 2 * kva), *k = q + qa, *v = k + kva;
    for (uint32_t h = 0; h < nh; h++)
        rope(q + (size_t)h * hd, hd, pos, c->rope_freq);
    for (uint32_t h = 0; h < nkv; h++)
        rope(k + (size_t)h * hd, hd, pos, c->rope_freq);
    uint32_t a = c->m->mem.layer[f->L - c->m->layers].slot;
    uint8_t *kr = row_ptr(c, f->s->kp[a], pos, c->krow);
    uint8_t *vr = row_ptr(c, f->s->vp[a], pos, c->krow);
    if (c->kv_dtype == ST_DTYPE_I8) {
        float *ks = (float *)row_ptr(c, f->s->ksp[a], pos, c->srow);
        float *vs = (float *)row_ptr(c, f->s->vsp[a], pos, c->srow);
        for (uint32_t h = 0; h < nkv; h++) {
            quant_i8((int8_t *)kr + (size_t)h * hd, &ks[h], k + (size_t)h * hd, hd);
            quant_i8((int8_t *)vr + (size_t)h * hd, &vs[h], v + (size_t)h * hd, hd);
        }
    } else {
        st_codec_f16_encode((uint16_t *)kr, k, kva);
        st_codec_f16_encode((uint16_t *)vr, v, kva);
    }
}

/* Attention, one head for a block of up to qb consecutive queries: scores q K^T over the keys
 * the block needs (each one the canonical dot product), then per query the scaling, the causal
 * limit 0..pos0+t, softmax (max, exp, sum in key order) and the weighted sum of values in key
 * order. Queries are grouped only to share the loads of K and V rows. */
static void attn_task(void *ctx, uint32_t task, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    const st_kern *k = &c->e->kern;
    uint32_t hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    uint32_t qa = nh * hd, kva = nkv * hd, ldq = qa + 2 * kva;
    uint32_t nqb = (f->T + c->qb - 1) / c->qb;
    uint32_t h = task / nqb, t0 = task % nqb * c->qb, g = h / (nh / nkv);
    uint32_t t1 = t0 + c->qb < f->T ? t0 + c->qb : f->T, nq = t1 - t0;
    uint32_t a = c->m->mem.layer[f->L - c->m->layers].slot, ps = c->page_size;
    int i8 = c->kv_dtype == ST_DTYPE_I8;
    uint32_t type = i8 ? ST_GGML_I8 : ST_GGML_F16;
    uint64_t esz = i8 ? 1 : 2;
    uint8_t **kp = f->s->kp[a], **vp = f->s->vp[a];
    const float *q = c->qkv + (size_t)t0 * ldq + (size_t)h * hd;
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
                s = s * ((const float *)row_ptr(c, f->s->ksp[a], j, c->srow))[g];
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
        float *out = c->o + (size_t)(t0 + i) * qa + (size_t)h * hd;
        for (uint32_t d = 0; d < hd; d++)
            out[d] = 0.0f;
    }
    for (uint32_t i = 0; i < nq; i += 4) {
        uint32_t nb = nq - i < 4 ? nq - i : 4;
        uint64_t common = f->pos0 + t0 + i + 1;
        float *out = c->o + (size_t)(t0 + i) * qa + (size_t)h * hd;
        const float *p = sc + (size_t)i * ldp;
        for (uint64_t p0 = 0; p0 < common; p0 += ps) {
            uint32_t j1 = (uint32_t)(common - p0 < ps ? common : p0 + ps);
            const uint8_t *v = vp[p0 / ps] + (size_t)g * hd * esz;
            const float *vs = i8 ? (const float *)f->s->vsp[a][p0 / ps] + g : NULL;
            st_kern_pv(k, out, qa, p, ldp, nb, v, type, kva, vs, nkv, (uint32_t)p0, j1, hd);
        }
        /* the later queries of the group see a few more keys */
        for (uint32_t ii = 1; ii < nb; ii++)
            for (uint64_t j = common; j < common + ii; j++) {
                const uint8_t *v = row_ptr(c, vp, j, c->krow) + (size_t)g * hd * esz;
                const float *vs =
                    i8 ? (const float *)row_ptr(c, f->s->vsp[a], j, c->srow) + g : NULL;
                st_kern_pv(k, out + (size_t)ii * qa, qa, p + (size_t)ii * ldp, ldp, 1, v, type,
                           kva, vs, nkv, (uint32_t)j, (uint32_t)j + 1, hd);
            }
    }
    for (uint32_t i = 0; i < nq; i++) {
        float *out = c->o + (size_t)(t0 + i) * qa + (size_t)h * hd;
        for (uint32_t d = 0; d < hd; d++)
            out[d] *= rs[i];
    }
}

/* Feed-forward, per token: gate = silu(gate) * up. */
static void swiglu_task(void *ctx, uint32_t t, uint32_t thread)
{
    fwd *f = ctx;
    cpu_ctx *c = f->c;
    uint32_t F = c->hp->n_ff;
    float *g = c->gate + (size_t)t * F;
    const float *u = c->o + (size_t)t * F;
    for (uint32_t i = 0; i < F; i++)
        g[i] = silu(g[i]) * u[i];
}

static void layer_deltanet(fwd *f)
{
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    const st_layer *L = f->L;
    uint32_t H = hp->ssm_heads, dk = hp->ssm_dk, E = hp->n_embd, T = f->T;
    mm_multi j;
    mm_init(&j, &c->e->kern, c->xn, E, T);
    mm_add(&j, &L->sq, c->qkv, c->C);
    mm_add(&j, &L->sk, c->qkv + (size_t)H * dk, c->C);
    mm_add(&j, &L->sv, c->qkv + 2 * (size_t)H * dk, c->C);
    mm_add(&j, &L->sgate, c->gate, H * hp->ssm_dv);
    mm_add(&j, &L->salpha, c->ab, 2 * H);
    mm_add(&j, &L->sbeta, c->ab + H, 2 * H);
    mm_run(c, &j);
    st_pool_run(c->e->pool, (c->C + CONV_CB - 1) / CONV_CB, conv_task, f, 20ull * T * c->C);
    st_pool_run(c->e->pool, T, dn_prep_task, f, 8ull * T * c->C);
    st_pool_run(c->e->pool, H, dn_scan_task, f,
                6ull * T * H * dk * hp->ssm_dv);
    st_pool_run(c->e->pool, T, dn_gate_task, f, 20ull * T * H * hp->ssm_dv);
    mm_init(&j, &c->e->kern, c->o, H * hp->ssm_dv, T);
    mm_add(&j, &L->sout, c->out, E);
    mm_run(c, &j);
}

static void layer_attention(fwd *f)
{
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    const st_layer *L = f->L;
    uint32_t E = hp->n_embd, T = f->T;
    uint32_t qa = hp->n_head * hp->head_dim, kva = hp->n_head_kv * hp->head_dim;
    mm_multi j;
    mm_init(&j, &c->e->kern, c->xn, E, T);
    mm_add(&j, &L->wq, c->qkv, qa + 2 * kva);
    mm_add(&j, &L->wk, c->qkv + qa, qa + 2 * kva);
    mm_add(&j, &L->wv, c->qkv + qa + kva, qa + 2 * kva);
    mm_run(c, &j);
    st_pool_run(c->e->pool, T, attn_store_task, f, 20ull * T * (qa + 2 * kva));
    st_pool_run(c->e->pool, (T + c->qb - 1) / c->qb * hp->n_head, attn_task, f,
                4ull * T * qa * (f->pos0 + T));
    mm_init(&j, &c->e->kern, c->o, qa, T);
    mm_add(&j, &L->wo, c->out, E);
    mm_run(c, &j);
}

static void ffn(fwd *f)
{
    cpu_ctx *c = f->c;
    const st_model_hparams *hp = c->hp;
    const st_layer *L = f->L;
    uint32_t E = hp->n_embd, F = hp->n_ff, T = f->T;
    mm_multi j;
    mm_init(&j, &c->e->kern, c->xn, E, T);
    mm_add(&j, &L->ffn_gate, c->gate, F);
    mm_add(&j, &L->ffn_up, c->o, F);
    mm_run(c, &j);
    st_pool_run(c->e->pool, T, swiglu_task, f, 20ull * T * F);
    mm_init(&j, &c->e->kern, c->gate, F, T);
    mm_add(&j, &L->ffn_down, c->out, E);
    mm_run(c, &j);
}

static int cpu_forward(void *bctx, void *stp, const uint32_t *tokens, uint32_t n, uint64_t pos0,
                       float *logits)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    const st_model *m = c->m;
    const st_model_hparams *hp = c->hp;
    int rc;
    if ((uint64_t)s->pos != pos0)
        return st_error_set(ST_EINVAL, "cpu backend: reading at %llu, the state is at %lld",
                            (unsigned long long)pos0, (long long)s->pos);
    if (n == 0 || n > c->T || pos0 + n > c->n_ctx)
        return st_error_set(ST_EINVAL, "cpu backend: %u tokens at %llu (chunk %u, context %u)", n,
                            (unsigned long long)pos0, c->T, c->n_ctx);
    for (uint32_t t = 0; t < n; t++)
        if (tokens[t] >= hp->n_vocab)
            return st_error_set(ST_EINVAL, "cpu backend: token %u outside the vocabulary of %u",
                                tokens[t], hp->n_vocab);
    if ((rc = ensure_pages(c, s, pos0, pos0 + n)))
        return rc;
    fwd f = {.c = c, .s = s, .tokens = tokens, .T = n, .pos0 = pos0};
    st_pool_run(c->e->pool, n, embed_task, &f, (uint64_t)n * hp->n_embd);
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        f.L = &m->layers[il];
        f.norm_w = f.L->attn_norm;
        f.add = il > 0;
        st_pool_run(c->e->pool, n, add_norm_task, &f, 4ull * n * hp->n_embd);
        if (f.L->kind == 'D')
            layer_deltanet(&f);
        else
            layer_attention(&f);
        f.norm_w = f.L->ffn_norm;
        f.add = 1;
        st_pool_run(c->e->pool, n, add_norm_task, &f, 4ull * n * hp->n_embd);
        ffn(&f);
    }
    s->pos = (int64_t)(pos0 + n);
    if (logits) {
        uint32_t E = hp->n_embd;
        float *x = c->x + (size_t)(n - 1) * E;
        const float *o = c->out + (size_t)(n - 1) * E;
        for (uint32_t i = 0; i < E; i++)
            x[i] += o[i];
        rmsnorm(&c->e->kern, c->logit_in, x, m->output_norm, E, hp->rms_eps);
        mm_multi j;
        mm_init(&j, &c->e->kern, c->logit_in, E, 1);
        mm_add(&j, &m->output, logits, hp->n_vocab);
        mm_run(c, &j);
    }
    return 0;
}

const st_backend st_backend_cpu = {
    .name = "cpu",
    .create = cpu_create,
    .destroy = cpu_destroy,
    .tensors = cpu_tensors,
    .state_new = cpu_state_new,
    .state_free = cpu_state_free,
    .state_reset = cpu_state_reset,
    .forward = cpu_forward,
    .running_read = cpu_running_read,
    .running_write = cpu_running_write,
    .kv_read = cpu_kv_read,
    .kv_write = cpu_kv_write,
};
