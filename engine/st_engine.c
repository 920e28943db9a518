/*
 * st_engine.c - an engine: a model, a backend chosen from the table, its thread pool, the
 * options, and the geometry the backend publishes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_arch_int.h"
#include "st_engine_int.h"
#include "st_wtype.h"

static const st_backend *const k_backends[] = {&st_backend_cpu, &st_backend_cuda};

void st_engine_opts_default(st_engine_opts *o)
{
    memset(o, 0, sizeof *o);
    o->backend = NULL;
    o->n_threads = 0;
    o->ubatch = 2048;
    o->n_ctx = 0;
    o->page_size = 256;
    o->kv_dtype = UINT32_MAX;
    o->prompt_cache = 6;
    o->prompt_cache_every = 0;
    o->prompt_cache_root = 0;
    o->force_scalar = 0;
    o->no_avx512 = 0;
    o->quant_f32 = 0;
}

int st_engine_cuda_check(const st_gguf *g)
{
    const char *a = "";
    uint64_t n = 0;
    if (st_gguf_get_str(g, "general.architecture", &a, &n) || !st_arch_find(a, (size_t)n))
        return st_error_set(ST_EINVAL, "cuda backend: architecture %.*s is not supported (use "
                            "--backend cpu)", (int)(n > 64 ? 64 : n), a);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        if (!st_wtype_get(t->type))
            return st_error_set(ST_EINVAL, "cuda backend: tensor %s has type %s, which the "
                                "engine does not compute with", t->name,
                                st_gguf_type_name(t->type));
    }
    /* the shapes both GPU paths take (st_backend_cuda.cu cu_create, ops_setup; st_ops_cuda.cu):
     * attention heads of at most 256, the DeltaNet convolution of 4, value widths of at most
     * 1,024 (strata-hybrid's own pass: key widths of at most 512); a file whose keys do not
     * read is answered yes, and loading it reports what is wrong */
    const st_arch *arch = st_arch_find(a, (size_t)n);
    st_model_hparams hp;
    memset(&hp, 0, sizeof hp);
    if (arch->read(g, &hp))
        return 0;
    for (uint32_t il = 0; il < hp.n_layer; il++) {
        st_mem_layer ml;
        arch->memory(&hp, il, &ml);
        if (ml.kind == ST_MEM_KV && ml.head_dim > ST_CUDA_MAX_HEAD_DIM)
            return st_error_set(ST_EINVAL, "cuda backend: layer %u: attention head_dim %u (at "
                                "most %u; use --backend cpu)", il, ml.head_dim,
                                ST_CUDA_MAX_HEAD_DIM);
        if (ml.kind == ST_MEM_REC &&
            (ml.conv_len + 1 != ST_CUDA_CONV_KERNEL || ml.ssm_dv > ST_CUDA_MAX_SSM_DV ||
             (arch == &st_arch_hybrid && ml.ssm_dk > ST_CUDA_HYBRID_MAX_SSM_DK)))
            return st_error_set(ST_EINVAL, "cuda backend: layer %u: DeltaNet of %u x %u with a "
                                "convolution of %u (kernel %u, value width <= %u; use "
                                "--backend cpu)", il, ml.ssm_dk, ml.ssm_dv, ml.conv_len + 1,
                                ST_CUDA_CONV_KERNEL, ST_CUDA_MAX_SSM_DV);
    }
    return 0;
}

void st_engine_free(st_engine *e)
{
    if (!e)
        return;
    if (e->be && e->bctx) {
        st_slot_spares_free(e);
        e->be->destroy(e->bctx);
    }
    free(e->spare_ck);
    free(e->ck_off);
    st_pool_free(e->pool);
    free(e->hstage);
    pthread_mutex_destroy(&e->lock);
    free(e);
}

int st_engine_new(const st_model *m, const st_engine_opts *o, st_engine **out)
{
    *out = NULL;
    st_engine_opts d;
    if (!o) {
        st_engine_opts_default(&d);
        o = &d;
    }
    st_engine *e = calloc(1, sizeof *e);
    int rc;
    if (!e)
        return st_error_set(ENOMEM, "engine");
    pthread_mutex_init(&e->lock, NULL);
    e->m = m;
    e->o = *o;
    const char *bn = o->backend ? o->backend : "cpu";
    for (size_t i = 0; i < sizeof k_backends / sizeof k_backends[0]; i++)
        if (!strcmp(k_backends[i]->name, bn))
            e->be = k_backends[i];
    if (!e->be) {
        rc = st_error_set(ST_EINVAL, "engine: no backend \"%s\" (cpu, cuda)", bn);
        goto fail;
    }
    e->o.backend = e->be->name;
    if (e->o.n_threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        e->o.n_threads = n > 0 ? (uint32_t)n : 1;
    }
    if (e->o.ubatch == 0)
        e->o.ubatch = 2048;
    if (e->o.n_ctx == 0)
        e->o.n_ctx = m->hp.n_ctx;
    if (e->o.page_size == 0)
        e->o.page_size = 256;
    if (e->o.kv_dtype == UINT32_MAX)
        e->o.kv_dtype = m->hp.kv_dtype;
    if (e->o.ubatch > 65536 || e->o.n_ctx > (1u << 24) || e->o.page_size > 65536 ||
        e->o.n_threads > 1024 || e->o.prompt_cache > 64) {
        rc = st_error_set(ST_EINVAL, "engine: ubatch %u (<= 65536), context %u (<= %u), page size "
                          "%u (<= 65536), threads %u (<= 1024), prompt cache %u (<= 64)",
                          e->o.ubatch, e->o.n_ctx, 1u << 24, e->o.page_size, e->o.n_threads,
                          e->o.prompt_cache);
        goto fail;
    }
    if (e->o.kv_dtype != ST_DTYPE_F16 && e->o.kv_dtype != ST_DTYPE_I8 &&
        e->o.kv_dtype != ST_DTYPE_F32) {
        rc = st_error_set(ST_EINVAL, "engine: K/V dtype %s (f16, f32 or i8)",
                          st_dtype_name(e->o.kv_dtype));
        goto fail;
    }
    /* f32 K/V (the reference comparisons' precision) is computed by the CPU backend only */
    if (e->o.kv_dtype == ST_DTYPE_F32 && e->be != &st_backend_cpu) {
        rc = st_error_set(ST_EINVAL, "engine: K/V dtype f32 needs the cpu backend (the %s "
                          "backend keeps f16 or i8)", e->be->name);
        goto fail;
    }
    e->kern.vec = !o->force_scalar && st_kern_cpu_has_avx2();
    e->kern.qdot = !o->quant_f32;
    e->kern.v512 = e->kern.vec && !o->no_avx512 && st_kern_cpu_has_avx512vnni();
    if ((rc = st_pool_new(e->o.n_threads, &e->pool)))
        goto fail;
    if ((rc = e->be->create(e, &e->bctx)))
        goto fail;
    const st_tensor_desc *descs;
    uint32_t n;
    if ((rc = e->be->tensors(e->bctx, &descs, &n)))
        goto fail;
    memcpy(e->geom.model_fp, m->fp, ST_FINGERPRINT_LEN);
    snprintf(e->geom.arch, sizeof e->geom.arch, "%s", st_model_arch(m));
    e->geom.page_size = e->o.page_size;
    e->geom.n_ctx = e->o.n_ctx;
    e->geom.n_vocab = m->hp.n_vocab;
    e->geom.n_tensors = n;
    e->geom.tensors = descs;
    if ((rc = st_geometry_check(&e->geom)))
        goto fail;
    if (!(e->spare_ck = calloc(e->o.prompt_cache ? e->o.prompt_cache : 1, sizeof *e->spare_ck)) ||
        !(e->ck_off = calloc(n ? n : 1, sizeof *e->ck_off))) {
        rc = st_error_set(ENOMEM, "engine");
        goto fail;
    }
    e->ck_bytes = st_checkpoint_layout(descs, n, ST_CODEC_FP32, e->ck_off);
    *out = e;
    return 0;
fail:
    st_engine_free(e);
    return rc;
}

const st_engine_opts *st_engine_opts_get(const st_engine *e)
{
    return &e->o;
}

const st_image_allocator *st_engine_image_allocator(const st_engine *e)
{
    return e->be->image_allocator ? e->be->image_allocator(e->bctx) : NULL;
}

int st_engine_wcache_get(const st_engine *e, st_engine_wcache *out)
{
    if (!e || !out)
        return st_error_set(ST_EINVAL, "engine: wcache_get: NULL argument");
    memset(out, 0, sizeof *out);
    if (e->be->wcache_get) /* the backend's own copy under its own lock: never waits for a computation */
        e->be->wcache_get(e->bctx, out);
    return 0;
}

int st_engine_xcache_get(const st_engine *e, st_engine_xcache *out)
{
    if (!e || !out)
        return st_error_set(ST_EINVAL, "engine: xcache_get: NULL argument");
    memset(out, 0, sizeof *out);
    if (e->be->xcache_get) /* the backend's published copy: never waits for a computation */
        e->be->xcache_get(e->bctx, out);
    return 0;
}

int st_engine_wcache_invalidate(st_engine *e)
{
    if (!e)
        return st_error_set(ST_EINVAL, "engine: wcache_invalidate: NULL engine");
    if (!e->be->wcache_invalidate)
        return 0;
    pthread_mutex_lock(&e->lock);
    int rc = e->be->wcache_invalidate(e->bctx);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

const char *st_engine_isa(const st_engine *e)
{
    return e->kern.v512 ? "avx2+fma+avx512vnni" : e->kern.vec ? "avx2+fma" : "scalar";
}

uint64_t st_engine_running_bytes(const st_engine *e, uint32_t ti)
{
    const st_tensor_desc *d = &e->geom.tensors[ti];
    if (d->role != ST_ROLE_RUNNING)
        return 0;
    return st_tensor_elems(d) * st_dtype_size(d->dtype);
}
