/*
 * st_backend_cpu.c - the CPU backend: the CPU operations (st_ops_cpu.c) and a slot's memory in
 * host memory (st_mem_kv.c, st_mem_rec.c), published as geometry tensors; forward runs the
 * model's architecture (st_arch_int.h) on them.
 *
 * Invariants:
 * 1. A slot state is its memory modules, made from the model's memory spec, and the position
 *    (the number of tokens read). The geometry (st_state_layout, from the same spec) lists
 *    exactly their tensors, in layer order, then "pos".
 * 2. forward() checks the tokens and the position and reserves the K/V pages it needs before it
 *    changes anything, so an error or an allocation failure leaves the state as it was.
 * 3. Nothing here knows an architecture: the forward pass and its workspace are the
 *    architecture's, the arithmetic is the operations'.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_arch_int.h"
#include "st_wtype.h"

typedef struct cpu_ctx {
    const st_model *m;
    uint32_t T, n_ctx, page_size, kv_dtype;
    st_tensor_desc *descs;
    st_state_map *tm;
    uint32_t n_desc;
    st_ops_cpu *oc;
    void *ws; /* the architecture's workspace */
} cpu_ctx;

typedef struct cpu_state {
    int64_t pos;
    st_kvmem *kv;
    st_recmem *rec;
} cpu_state;

static void cpu_destroy(void *bctx)
{
    cpu_ctx *c = bctx;
    if (!c)
        return;
    free(c->descs);
    free(c->tm);
    st_ops_cpu_free(c->oc);
    c->m->arch->fwd_free(c->ws);
    free(c);
}

static int cpu_create(st_engine *e, void **out)
{
    *out = NULL;
    cpu_ctx *c = calloc(1, sizeof *c);
    int rc;
    if (!c)
        return st_error_set(ENOMEM, "cpu backend");
    const st_model *m = e->m;
    c->m = m;
    c->T = e->o.ubatch;
    c->n_ctx = e->o.n_ctx;
    c->page_size = e->o.page_size;
    c->kv_dtype = e->o.kv_dtype;
    c->descs = calloc(ST_STATE_LAYOUT_MAX(m->hp.n_layer), sizeof *c->descs);
    c->tm = calloc(ST_STATE_LAYOUT_MAX(m->hp.n_layer), sizeof *c->tm);
    if (!c->descs || !c->tm) {
        cpu_destroy(c);
        return st_error_set(ENOMEM, "cpu backend");
    }
    c->n_desc = st_state_layout(&m->mem, c->n_ctx, c->kv_dtype, c->descs, c->tm);
    /* the longest row of a weight with an integer path (st_qdot_get) */
    uint64_t qcols = 0;
    const st_gguf *g = st_model_gguf(m);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        if (st_qdot_get(t->type) && t->dims[0] > qcols)
            qcols = t->dims[0];
    }
    if ((rc = st_ops_cpu_new(&e->kern, e->pool, &m->mem, c->n_ctx, c->T, qcols, &c->oc)) ||
        (rc = m->arch->fwd_new(m, c->T, &c->ws))) {
        cpu_destroy(c);
        return rc;
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
static void cpu_state_free(void *bctx, void *stp)
{
    cpu_state *s = stp;
    if (!s)
        return;
    st_kvmem_free(s->kv);
    st_recmem_free(s->rec);
    free(s);
}

static int cpu_state_new(void *bctx, void **out)
{
    cpu_ctx *c = bctx;
    *out = NULL;
    cpu_state *s = calloc(1, sizeof *s);
    if (!s)
        return st_error_set(ENOMEM, "cpu backend: slot state");
    int rc = st_kvmem_new(&c->m->mem, c->n_ctx, c->page_size, c->kv_dtype, &s->kv);
    if (!rc)
        rc = st_recmem_new(&c->m->mem, &s->rec);
    if (rc) {
        cpu_state_free(c, s);
        return st_error_set(rc, "cpu backend: slot state");
    }
    *out = s;
    return 0;
}

static void cpu_state_reset(void *bctx, void *stp)
{
    cpu_state *s = stp;
    st_recmem_reset(s->rec);
    s->pos = 0;
}

/* The detail of a memory module's refusal, with the tensor it was about. */
static int named(const cpu_ctx *c, uint32_t ti, int rc)
{
    char d[256];
    snprintf(d, sizeof d, "%s", st_errdetail());
    return st_error_set(rc, "cpu backend: tensor %u (%s): %s", ti, c->descs[ti].name, d);
}

static int cpu_running_io(cpu_ctx *c, cpu_state *s, uint32_t ti, void *buf, uint64_t len,
                          int write)
{
    int rc;
    if (ti >= c->n_desc || c->descs[ti].role != ST_ROLE_RUNNING)
        return st_error_set(ST_EINVAL, "cpu backend: tensor %u is not running state", ti);
    const st_state_map *t = &c->tm[ti];
    if (t->what == ST_SW_POS) {
        int64_t p;
        if (len != 8)
            return st_error_set(ST_EINVAL, "cpu backend: position of %llu bytes",
                                (unsigned long long)len);
        if (!write) {
            memcpy(buf, &s->pos, 8);
            return 0;
        }
        memcpy(&p, buf, 8);
        if (p < 0 || (uint64_t)p > c->n_ctx)
            return st_error_set(ST_ECORRUPT, "cpu backend: position %lld outside 0..%u",
                                (long long)p, c->n_ctx);
        s->pos = p;
        return 0;
    }
    if ((rc = st_recmem_io(s->rec, t->slot, t->what, buf, len, write)))
        return named(c, ti, rc);
    return 0;
}

static int cpu_running_read(void *bctx, void *st, uint32_t ti, void *dst, uint64_t len)
{
    return cpu_running_io(bctx, st, ti, dst, len, 0);
}

static int cpu_running_write(void *bctx, void *st, uint32_t ti, const void *src, uint64_t len)
{
    return cpu_running_io(bctx, st, ti, (void *)src, len, 1);
}

static int cpu_kv_io(cpu_ctx *c, cpu_state *s, uint32_t ti, uint64_t row0, uint64_t nrows,
                     void *buf, int write)
{
    if (ti >= c->n_desc || c->descs[ti].role != ST_ROLE_KV)
        return st_error_set(ST_EINVAL, "cpu backend: tensor %u is not K/V", ti);
    int rc = st_kvmem_io(s->kv, c->tm[ti].slot, c->tm[ti].what, row0, nrows, buf, write);
    return rc ? named(c, ti, rc) : 0;
}

static int cpu_kv_read(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows, void *dst)
{
    return cpu_kv_io(bctx, st, ti, row0, nrows, dst, 0);
}

static int cpu_kv_write(void *bctx, void *st, uint32_t ti, uint64_t row0, uint64_t nrows,
                        const void *src)
{
    return cpu_kv_io(bctx, st, ti, row0, nrows, (void *)src, 1);
}

/* ---- the forward pass ------------------------------------------------------------------- */
static int cpu_forward(void *bctx, void *stp, const uint32_t *tokens, uint32_t n, uint64_t pos0,
                       float *logits)
{
    cpu_ctx *c = bctx;
    cpu_state *s = stp;
    const st_model *m = c->m;
    int rc;
    if ((uint64_t)s->pos != pos0)
        return st_error_set(ST_EINVAL, "cpu backend: reading at %llu, the state is at %lld",
                            (unsigned long long)pos0, (long long)s->pos);
    if (n == 0 || n > c->T || pos0 + n > c->n_ctx)
        return st_error_set(ST_EINVAL, "cpu backend: %u tokens at %llu (chunk %u, context %u)", n,
                            (unsigned long long)pos0, c->T, c->n_ctx);
    for (uint32_t t = 0; t < n; t++)
        if (tokens[t] >= m->hp.n_vocab)
            return st_error_set(ST_EINVAL, "cpu backend: token %u outside the vocabulary of %u",
                                tokens[t], m->hp.n_vocab);
    if ((rc = st_kvmem_reserve(s->kv, pos0, pos0 + n))) {
        char d[256];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_error_set(rc, "cpu backend: %s", d);
    }
    st_fwd f = {.m = m, .ops = &st_ops_cpu_table, .oc = c->oc, .kv = s->kv, .rec = s->rec,
                .tokens = tokens, .T = n, .pos0 = pos0, .logits = logits};
    m->arch->forward(&f, c->ws);
    s->pos = (int64_t)(pos0 + n);
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
