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
 * 4. The bulk transfers (save, load) check every length and the pages before any task runs; the
 *    tasks, one per state hash block on the engine's pool, copy (or code) their block and digest
 *    it at its destination while it is in cache (a save in bf16: the widened values the encode
 *    leaves on the stack, its codes streamed to the image): one pass over the state, on every
 *    thread.
 * 5. The running state lives in one block in the fp32 checkpoint layout (st_mem_rec.c). A
 *    load_adopt of an fp32 checkpoint whose block is the image's own and laid out as the state's
 *    (cpu_adoptable, checked tensor by tensor) copies only the K/V rows: the running tensors are
 *    digested in the image's block, which adopt exchanges with the state's after the caller's
 *    check.
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
    st_pool *pool;
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
    c->m->arch->fwd_free(c->ws); /* before the operations' context it was allocated through */
    st_ops_cpu_free(c->oc);
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
    c->pool = e->pool;
    c->descs = calloc(ST_STATE_LAYOUT_MAX(m->hp.n_layer), sizeof *c->descs);
    c->tm = calloc(ST_STATE_LAYOUT_MAX(m->hp.n_layer), sizeof *c->tm);
    if (!c->descs || !c->tm) {
        cpu_destroy(c);
        return st_error_set(ENOMEM, "cpu backend");
    }
    c->n_desc = st_state_layout(&m->mem, c->n_ctx, c->kv_dtype, c->descs, c->tm);
    uint64_t block = 0;
    for (uint32_t ti = 0; ti < c->n_desc; ti++)
        if (c->descs[ti].role == ST_ROLE_RUNNING)
            block += st_tensor_stored_bytes(&c->descs[ti], ST_CODEC_FP32) + 64;
    block = (block + ((uint64_t)2 << 20) - 1) & ~(((uint64_t)2 << 20) - 1);
    st_image_cache_reserve((size_t)(2 * block));
    /* the longest row of a weight with an integer path (st_qdot_get) */
    uint64_t qcols = 0;
    const st_gguf *g = st_model_gguf(m);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        if (st_qdot_get(t->type) && t->dims[0] > qcols)
            qcols = t->dims[0];
    }
    if ((rc = st_ops_cpu_new(&e->kern, e->pool, &m->mem, c->n_ctx, c->T, qcols, &c->oc)) ||
        (rc = m->arch->fwd_new(m, &st_ops_cpu_table, c->oc, c->T, &c->ws))) {
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
    return st_error_wrap(rc, "cpu backend: tensor %u (%s)", ti, c->descs[ti].name);
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

/* ---- bulk transfers (st_backend.save / .load) -------------------------------------------- */
#define WIDEN_SLICE 4096u /* bf16 elements coded per digest update, widened on the stack */

typedef struct bulk_job {
    cpu_ctx *c;
    cpu_state *s;
    uint8_t **img;      /* per tensor: its bytes in the image (K/V rows, or the checkpoint's) */
    uint64_t *bytes;    /* per tensor: bytes hashed (fp32 bytes for a coded f32 tensor) */
    uint64_t *first;    /* [n_desc + 1]: each tensor's first block */
    uint32_t codec;
    int load;
    int adopt;          /* load: the running tensors stay in the image, digested there */
    uint64_t *digests;
    int err;            /* first error of a task (atomics) */
} bulk_job;

static void bulk_task(void *ctx, uint32_t task, uint32_t thread)
{
    (void)thread;
    bulk_job *j = ctx;
    const cpu_ctx *c = j->c;
    uint32_t lo = 0, hi = c->n_desc;
    int rc = 0;
    /* the last tensor whose first block is <= task: it holds this block (an empty one never) */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (j->first[mid] <= task)
            lo = mid;
        else
            hi = mid;
    }
    uint32_t ti = lo;
    const st_state_map *t = &c->tm[ti];
    uint64_t off = (task - j->first[ti]) * ST_STATE_HASH_BLOCK;
    uint64_t len = j->bytes[ti] - off < ST_STATE_HASH_BLOCK ? j->bytes[ti] - off
                                                             : ST_STATE_HASH_BLOCK;
    uint64_t *dg = &j->digests[task];
    if (t->what == ST_SW_POS) {
        *dg = st_checksum(j->img[ti], 8); /* checked (load) or written (save) by cpu_bulk */
    } else if (c->descs[ti].role == ST_ROLE_KV) {
        st_checksum_state cs = {0};
        if (!(rc = st_checksum_init(&cs)))
            rc = st_kvmem_copy(j->s->kv, t->slot, t->what, off, len, j->img[ti] + off, j->load,
                               &cs);
        *dg = st_checksum_final(&cs);
        st_checksum_free(&cs);
    } else {
        uint8_t *live = (uint8_t *)(t->what == ST_SW_SSM ? st_recmem_ssm(j->s->rec, t->slot)
                                                         : st_recmem_conv(j->s->rec, t->slot));
        live += off;
        if (j->adopt) {
            *dg = st_checksum(j->img[ti] + off, (size_t)len); /* the block the state takes */
        } else if (j->codec == ST_CODEC_FP32) {
            if (j->load)
                memcpy(live, j->img[ti] + off, len);
            else
                memcpy(j->img[ti] + off, live, len);
            *dg = st_checksum(j->load ? live : j->img[ti] + off, (size_t)len);
        } else {
            uint8_t *coded = j->img[ti] + off / 4 * st_codec_elem_size(j->codec);
            if (j->load) {
                /* widened straight into the state, digested there */
                rc = st_codec_convert(ST_CODEC_FP32, live, j->codec, coded, (size_t)(len / 4),
                                      NULL, 0);
                *dg = st_checksum(live, (size_t)len);
            } else {
                /* coded into the image (streaming stores: a snapshot's bytes are not read
                 * soon), digested as a restore will widen it from the widened values the
                 * encode leaves on the stack: one pass over the live state */
                st_checksum_state cs = {0};
                float buf[WIDEN_SLICE];
                if (!(rc = st_checksum_init(&cs))) {
                    for (uint64_t i = 0; i < len / 4; i += WIDEN_SLICE) {
                        uint64_t k = len / 4 - i < WIDEN_SLICE ? len / 4 - i : WIDEN_SLICE;
                        st_codec_bf16_encode_stream((uint16_t *)(void *)(coded + 2 * i), buf,
                                                    (const float *)(const void *)(live + 4 * i),
                                                    (size_t)k);
                        st_checksum_update(&cs, buf, (size_t)k * 4);
                    }
                }
                *dg = st_checksum_final(&cs);
                st_checksum_free(&cs);
            }
        }
    }
    if (rc) {
        int none = 0;
        __atomic_compare_exchange_n(&j->err, &none, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* Whether state s can take checkpoint ci of img as it is: fp32, the image's own block, and every
 * running tensor at the offset the state's block holds it (st_mem_rec.c). */
static int cpu_adoptable(const cpu_ctx *c, const cpu_state *s, const st_image *img, uint32_t ci)
{
    uint64_t pos, ilen = 0, slen = 0;
    uint32_t codec;
    if (st_image_checkpoint_info(img, ci, &pos, &codec) || codec != ST_CODEC_FP32 ||
        !st_image_checkpoint_exclusive(img, ci))
        return 0;
    const uint8_t *ib = st_image_checkpoint_block(img, ci, &ilen);
    const uint8_t *sb = st_recmem_block(s->rec, &slen);
    if (!ib || ilen != slen)
        return 0;
    for (uint32_t ti = 0; ti < c->n_desc; ti++) {
        const st_state_map *t = &c->tm[ti];
        if (c->descs[ti].role != ST_ROLE_RUNNING || t->what == ST_SW_POS)
            continue;
        const uint8_t *ip = st_image_checkpoint_tensor_const(img, ci, ti, NULL);
        const uint8_t *sp = (const uint8_t *)(t->what == ST_SW_SSM ? st_recmem_ssm(s->rec, t->slot)
                                                                   : st_recmem_conv(s->rec, t->slot));
        if (!ip || ip - ib != sp - sb)
            return 0;
    }
    return 1;
}

/* Both directions: check the image against the state's tensors, then run the blocks (adopt:
 * a load whose running tensors stay in the image, cpu_adoptable). */
static int cpu_bulk(cpu_ctx *c, cpu_state *s, st_image *img, const st_image *cimg, uint32_t ci,
                    uint64_t n, uint64_t *digests, int adopt)
{
    int load = img == NULL;
    const st_image *im = load ? cimg : img;
    uint64_t pos;
    uint32_t codec;
    int rc = st_image_checkpoint_info(im, ci, &pos, &codec);
    if (rc)
        return rc;
    if ((codec != ST_CODEC_FP32 && codec != ST_CODEC_BF16) || n > c->n_ctx || pos != n ||
        st_image_n_tokens(im) != n || (!load && (uint64_t)s->pos != n))
        return st_error_set(ST_EINVAL, "cpu backend: %s of %llu tokens (state at %lld) with a "
                            "checkpoint at %llu in codec %s", load ? "load" : "save",
                            (unsigned long long)n, (long long)s->pos, (unsigned long long)pos,
                            st_codec_name(codec));
    int bad = load ? ST_ECORRUPT : ST_EINVAL;
    bulk_job j = {c, s, NULL, NULL, NULL, codec, load, load && adopt, digests, 0};
    j.img = calloc(c->n_desc, sizeof *j.img);
    j.bytes = calloc(c->n_desc, sizeof *j.bytes);
    j.first = calloc(c->n_desc + 1, sizeof *j.first);
    if (!j.img || !j.bytes || !j.first) {
        rc = st_error_set(ENOMEM, "cpu backend: bulk transfer");
        goto done;
    }
    if (load && (rc = st_kvmem_reserve(s->kv, 0, n)))
        goto done;
    uint64_t total = 0, moved = 0;
    uint32_t pos_ti = UINT32_MAX;
    for (uint32_t ti = 0; ti < c->n_desc; ti++) {
        const st_tensor_desc *d = &c->descs[ti];
        uint64_t len = 0, want;
        if (d->role == ST_ROLE_KV) {
            j.img[ti] = load ? (uint8_t *)st_image_kv_const(cimg, ti, &len)
                             : (uint8_t *)st_image_kv(img, ti, &len);
            want = n * st_tensor_row_bytes(d);
            j.bytes[ti] = want;
        } else {
            j.img[ti] = load ? (uint8_t *)st_image_checkpoint_tensor_const(cimg, ci, ti, &len)
                             : (uint8_t *)st_image_checkpoint_tensor(img, ci, ti, &len);
            want = st_tensor_stored_bytes(d, codec);
            if (c->tm[ti].what == ST_SW_POS)
                pos_ti = ti;
            j.bytes[ti] = c->tm[ti].what == ST_SW_POS ? 8 : st_tensor_elems(d) * 4;
        }
        if ((want && !j.img[ti]) || len != want) {
            rc = st_error_set(bad, "cpu backend: %s tensor %s: %llu bytes in the image, expected "
                              "%llu", d->role == ST_ROLE_KV ? "K/V" : "live state", d->name,
                              (unsigned long long)len, (unsigned long long)want);
            goto done;
        }
        j.first[ti] = total;
        total += st_state_hash_blocks(j.bytes[ti]);
        moved += want;
    }
    j.first[c->n_desc] = total;
    if (total > UINT32_MAX) {
        rc = st_error_set(ST_ETOOBIG, "cpu backend: %llu blocks", (unsigned long long)total);
        goto done;
    }
    int64_t p = s->pos;
    if (pos_ti == UINT32_MAX) {
        rc = st_error_set(ST_EINVAL, "cpu backend: no position tensor");
        goto done;
    }
    if (load) {
        memcpy(&p, j.img[pos_ti], 8);
        if (p < 0 || (uint64_t)p != pos) {
            rc = st_error_set(ST_ECORRUPT, "restore: live state at %llu holds position %lld",
                              (unsigned long long)pos, (long long)p);
            goto done;
        }
    } else {
        memcpy(j.img[pos_ti], &p, 8);
    }
    st_pool_run(c->pool, (uint32_t)total, bulk_task, &j, moved);
    if (j.err) {
        rc = st_error_set(j.err, "cpu backend: %s: %s", load ? "load" : "save",
                          j.err == ST_EINVAL ? "a K/V page is missing" : st_strerror(j.err));
        goto done;
    }
    if (load)
        s->pos = p;
done:
    free(j.img);
    free(j.bytes);
    free(j.first);
    return rc;
}

/* Snapshot images use the image buffer cache (st_mem.c); cpu_create raises its ceiling to two
 * fp32 checkpoint blocks of this model (a session image's live state and resume checkpoint). */
static const st_image_allocator *cpu_image_allocator(void *bctx)
{
    (void)bctx;
    return st_image_cache_hook();
}

static int cpu_save(void *bctx, void *st, st_image *img, uint32_t ci, uint64_t n,
                    uint64_t *digests)
{
    return cpu_bulk(bctx, st, img, NULL, ci, n, digests, 0);
}

static int cpu_load(void *bctx, void *st, const st_image *img, uint32_t ci, uint64_t n,
                    uint64_t *digests)
{
    return cpu_bulk(bctx, st, NULL, img, ci, n, digests, 0);
}

static int cpu_load_adopt(void *bctx, void *st, const st_image *img, uint32_t ci, uint64_t n,
                          uint64_t *digests, int *adopt)
{
    *adopt = cpu_adoptable(bctx, st, img, ci);
    return cpu_bulk(bctx, st, NULL, img, ci, n, digests, *adopt);
}

/* The state takes the image's block; the position was set by the load. */
static void cpu_adopt(void *bctx, void *st, st_image *img, uint32_t ci)
{
    (void)bctx;
    cpu_state *s = st;
    uint8_t *b = st_recmem_block(s->rec, NULL);
    void *x = b;
    st_image_checkpoint_exchange(img, ci, &x); /* cpu_adoptable: exclusive, same size */
    b = x;
    st_recmem_exchange(s->rec, &b);
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
        return st_error_wrap(rc, "cpu backend");
    }
    st_fwd f = {.m = m, .ops = &st_ops_cpu_table, .oc = c->oc, .tokens = tokens, .T = n,
                .pos0 = pos0, .logits = logits};
    st_fwd_host hm;
    st_fwd_host_mem(&f, &hm, s->kv, s->rec);
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
    .save = cpu_save,
    .load = cpu_load,
    .image_allocator = cpu_image_allocator,
    .load_adopt = cpu_load_adopt,
    .adopt = cpu_adopt,
};
