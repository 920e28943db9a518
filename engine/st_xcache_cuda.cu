/*
 * st_xcache_cuda.cu - the routed-expert cache's device half (issue 14, section 3; docs/ENGINE.md,
 * "The routed-expert cache"): with st_engine_opts.expert_cache_bytes set, the routed experts of
 * a MoE model stay in host memory (the mapped GGUF) and each token's selected experts reach the
 * GPU through one bounded VRAM arena of whole expert records (st_xcache.c keeps which slot
 * holds which (layer, expert)), or, without the arena, through a compact buffer of one call's
 * records uploaded per token (the streaming path). The layer's products then read the records
 * where they are (st_fwd experts): the same bytes as the resident weights, so the same bits.
 *
 * Invariants:
 * 1. A record is the gate, up and down rows of one layer's expert, each part at a 256-byte
 *    aligned offset; every slot of the arena and of the compact buffer is record_bytes (the
 *    largest layer's record) long, so a slot serves any layer.
 * 2. Every upload goes host -> pinned staging (memcpy, a call's parts spread over the engine's
 *    threads) -> device on the copy stream; the compute stream waits for the call's uploads (load_ev) before the call's
 *    products. A staging buffer is filled again only after its previous copy finished (its
 *    event, waited for on the host).
 * 3. Slot reuse is fenced by compute-done events: each call records ring[call % XD_RING] on the
 *    compute stream before it queues anything, so that event completes once every product of
 *    the earlier calls has run. A slot (or the compact buffer) last used by call p is written
 *    again only after the copy stream waits for ring[(p + 1) % XD_RING] (recorded by call p + 1
 *    <= this call; a later record in that entry covers more, never less). Without the events
 *    (their creation failed) the compute stream is synchronised instead.
 * 4. The arena is optional: one that cannot be allocated, or one smaller than a call's k
 *    records (st_xcache_init), leaves the streaming path for every call, with a diagnostic. A
 *    failed upload into the arena empties the call's new slots (st_xcache_drop, so no key
 *    points at bytes that never arrived) and streams that call. A failure of the streaming
 *    path itself is the pass's error (sticky until st_xdev_error).
 * 5. STRATA_XCACHE_INJECT=alloc refuses the arena's allocation; =load:N fails the N-th upload
 *    into the arena; =slow queues a spin of about 100 us on the compute stream after each
 *    call's uploads, so that the host's next calls run far ahead of the products and the fences
 *    of invariant 3 are what keeps a slot from being written while it is read
 *    (tests/gpu/test_gpu_xcache.c).
 * 6. The figures are published under a mutex after each call, for st_engine_xcache_get from
 *    any thread.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cuda_runtime.h>

extern "C" {
#include "st_engine_int.h"
}

#define XD_RING 64
#define XD_ALIGN 256ull
#define XD_STREAM (-1) /* xd_cached: stream this call (invariant 4) */

typedef struct xd_job {
    const uint8_t *src;
    uint8_t *dst;
    uint64_t n;
} xd_job;

struct st_xdev {
    const st_model *m;
    st_pool *pool;
    cudaStream_t cs, xs; /* the compute stream (the backend's), the copy stream */
    uint32_t n_layers, X, k;
    uint64_t (*part)[3];  /* [n_layers]: the offsets of gate, up and down in a record */
    uint64_t (*psize)[3]; /* [n_layers]: their bytes (0: a layer without experts) */
    uint64_t rec;         /* record_bytes (invariant 1) */
    int cached;
    st_xcache map;
    uint8_t *arena, *compact;
    uint64_t *last;       /* [n_slots]: the call that last used the slot (0: none) */
    uint64_t compact_last;
    uint32_t *slots;      /* [k] */
    uint8_t *load;        /* [k] */
    uint32_t *ids, *stage_of; /* [k]: a call's experts to upload, their staging buffers */
    uint8_t **dst;        /* [k]: where they go */
    xd_job *jobs;         /* [3k]: the host copies of their parts */
    uint8_t **stage;      /* [n_stage] pinned records */
    cudaEvent_t *stage_ev;
    uint32_t n_stage, stage_next;
    cudaEvent_t ring[XD_RING];
    int ring_ok;
    cudaEvent_t load_ev;
    uint64_t call;
    uint64_t inject_load, n_loads; /* invariant 5 */
    int inject_slow;               /* invariant 5: a spin on the compute stream each call */
    int made;                      /* st_xdev_new succeeded (the summary at free) */
    uint32_t n_moe;                /* layers with routed experts */
    int err;
    uint64_t streamed, load_failures, bytes_uploaded;
    pthread_mutex_t mu;
    st_engine_xcache pub;
};

static int xd_fail(cudaError_t e, const char *what)
{
    return st_error_set(e == cudaErrorMemoryAllocation ? ENOMEM : ST_EIO,
                        "expert cache: %s: %s (%s)", what, cudaGetErrorName(e),
                        cudaGetErrorString(e));
}

static uint64_t xd_align(uint64_t v) { return (v + XD_ALIGN - 1) / XD_ALIGN * XD_ALIGN; }

static void xd_publish(st_xdev *x)
{
    st_engine_xcache p;
    memset(&p, 0, sizeof p);
    p.host = 1;
    p.cached = x->cached;
    p.slots = x->cached ? x->map.n_slots : 0;
    p.records = (uint64_t)x->n_moe * x->X;
    p.record_bytes = x->rec;
    p.arena_bytes = x->cached ? (uint64_t)x->map.n_slots * x->rec : 0;
    p.hits = x->map.hits;
    p.misses = x->map.misses;
    p.evictions = x->map.evictions;
    p.bytes_uploaded = x->bytes_uploaded;
    p.streamed = x->streamed;
    p.load_failures = x->load_failures;
    pthread_mutex_lock(&x->mu);
    x->pub = p;
    pthread_mutex_unlock(&x->mu);
}

/* Invariant 3: the copy stream waits until the products of call p (0: none) have run. */
static int xd_fence(st_xdev *x, uint64_t p)
{
    if (!p)
        return 0;
    cudaError_t e;
    if (x->ring_ok)
        e = cudaStreamWaitEvent(x->xs, x->ring[(p + 1) % XD_RING], 0);
    else
        e = cudaStreamSynchronize(x->cs);
    return e == cudaSuccess ? 0 : xd_fail(e, "the fence of a slot's reuse");
}

static void xd_copy_task(void *ctx, uint32_t i, uint32_t thread)
{
    (void)thread;
    const xd_job *j = (const xd_job *)ctx + i;
    memcpy(j->dst, j->src, j->n);
}

/* Experts e[0..n) of layer il (n <= k): host -> staging -> dst[i] on the copy stream
 * (invariant 2), the host copies of their 3n parts spread over the engine's threads. */
static int xd_upload(st_xdev *x, uint32_t il, const uint32_t *e, uint32_t n, uint8_t *const *dst)
{
    const st_layer *L = &x->m->layers[il];
    const st_wmat *w[3] = {&L->moe_gate, &L->moe_up, &L->moe_down};
    uint64_t end = x->part[il][2] + x->psize[il][2], total = 0;
    cudaError_t ce;
    for (uint32_t i = 0; i < n; i++) {
        uint32_t si = x->stage_next;
        x->stage_next = (si + 1) % x->n_stage; /* n_stage = 2k: distinct within a call */
        x->stage_of[i] = si;
        if ((ce = cudaEventSynchronize(x->stage_ev[si])) != cudaSuccess)
            return xd_fail(ce, "the staging buffer's previous copy");
        for (int p = 0; p < 3; p++) {
            xd_job *j = &x->jobs[3 * i + p];
            j->src = (const uint8_t *)w[p]->data + (uint64_t)e[i] * x->psize[il][p];
            j->dst = x->stage[si] + x->part[il][p];
            j->n = x->psize[il][p];
            total += j->n;
        }
    }
    st_pool_run(x->pool, 3 * n, xd_copy_task, x->jobs, total);
    for (uint32_t i = 0; i < n; i++) {
        uint32_t si = x->stage_of[i];
        if ((ce = cudaMemcpyAsync(dst[i], x->stage[si], end, cudaMemcpyHostToDevice, x->xs)) !=
                cudaSuccess ||
            (ce = cudaEventRecord(x->stage_ev[si], x->xs)) != cudaSuccess)
            return xd_fail(ce, "an expert's upload");
        x->bytes_uploaded += end;
    }
    return 0;
}

static void xd_views(const st_xdev *x, uint32_t il, const uint8_t *rec, st_wmat *v)
{
    const st_layer *L = &x->m->layers[il];
    const st_wmat *w[3] = {&L->moe_gate, &L->moe_up, &L->moe_down};
    uint32_t rows[3] = {L->moe_gate.rows / x->X, L->moe_up.rows / x->X, L->moe_down.rows / x->X};
    for (int p = 0; p < 3; p++) {
        v[p] = *w[p];
        v[p].data = rec + x->part[il][p];
        v[p].rows = rows[p];
    }
}

/* The compute stream waits for this call's uploads. */
static int xd_join(st_xdev *x)
{
    cudaError_t ce;
    if ((ce = cudaEventRecord(x->load_ev, x->xs)) != cudaSuccess ||
        (ce = cudaStreamWaitEvent(x->cs, x->load_ev, 0)) != cudaSuccess)
        return xd_fail(ce, "the wait for an expert's upload");
    return 0;
}

/* Invariant 4: a load into the arena failed; the call's new slots emptied. */
/* The call's new slots emptied (invariant 4): no key points at bytes that never arrived. */
static void xd_drop_new(st_xdev *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (x->load[i])
            st_xcache_drop(&x->map, x->slots[i]);
}

static void xd_unload(st_xdev *x, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        if (x->load[i])
            st_xcache_drop(&x->map, x->slots[i]);
    x->load_failures++;
}

static int xd_cached(st_xdev *x, uint32_t il, const uint32_t *sel, uint32_t n, st_wmat *views)
{
    int rc = st_xcache_map(&x->map, il, sel, n, x->slots, x->load);
    if (rc)
        return rc;
    uint64_t prev = 0;
    int any = 0;
    for (uint32_t i = 0; i < n; i++)
        if (x->load[i]) {
            any = 1;
            if (x->last[x->slots[i]] > prev)
                prev = x->last[x->slots[i]];
        }
    if (any) {
        if ((rc = xd_fence(x, prev))) {
            xd_drop_new(x, n);
            return rc;
        }
        uint32_t nl = 0;
        for (uint32_t i = 0; i < n; i++) {
            if (!x->load[i])
                continue;
            if (x->inject_load && ++x->n_loads == x->inject_load)
                rc = st_error_set(ST_EIO, "expert cache: injected failure of upload %llu",
                                  (unsigned long long)x->n_loads);
            x->ids[nl] = sel[i];
            x->dst[nl++] = x->arena + (uint64_t)x->slots[i] * x->rec;
        }
        if (!rc)
            rc = xd_upload(x, il, x->ids, nl, x->dst);
        if (rc) {
            fprintf(stderr, "strata: expert cache: layer %u: %s; this call is streamed\n", il,
                    st_errdetail());
            xd_unload(x, n);
            return XD_STREAM;
        }
        if ((rc = xd_join(x))) {
            xd_drop_new(x, n);
            return rc;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        x->last[x->slots[i]] = x->call;
        xd_views(x, il, x->arena + (uint64_t)x->slots[i] * x->rec, views + 3 * i);
    }
    return 0;
}

static int xd_stream(st_xdev *x, uint32_t il, const uint32_t *sel, uint32_t n, st_wmat *views)
{
    int rc = xd_fence(x, x->compact_last);
    for (uint32_t i = 0; i < n; i++)
        x->dst[i] = x->compact + (uint64_t)i * x->rec;
    if (!rc)
        rc = xd_upload(x, il, sel, n, x->dst);
    if (!rc)
        rc = xd_join(x);
    if (rc)
        return rc;
    x->compact_last = x->call;
    x->streamed++;
    for (uint32_t i = 0; i < n; i++)
        xd_views(x, il, x->compact + (uint64_t)i * x->rec, views + 3 * i);
    return 0;
}

/* Invariant 5 (STRATA_XCACHE_INJECT=slow): about 100 us of the compute stream's time. */
__global__ void xd_spin(long long cycles)
{
    long long t0 = clock64();
    while (clock64() - t0 < cycles) {
    }
}

extern "C" int st_xdev_experts(st_xdev *x, uint32_t il, const uint32_t *sel, uint32_t n,
                               st_wmat *views)
{
    if (x->err)
        return x->err;
    if (il >= x->n_layers || !x->psize[il][0] || n > x->k) {
        x->err = st_error_set(ST_EINVAL, "expert cache: layer %u, %u experts (top %u)", il, n,
                              x->k);
        return x->err;
    }
    for (uint32_t i = 0; i < n; i++)
        if (sel[i] >= x->X) {
            x->err = st_error_set(ST_EINVAL, "expert cache: layer %u: expert %u of %u", il,
                                  sel[i], x->X);
            return x->err;
        }
    x->call++;
    int rc = 0;
    if (x->ring_ok) {
        cudaError_t ce = cudaEventRecord(x->ring[x->call % XD_RING], x->cs);
        if (ce != cudaSuccess)
            rc = xd_fail(ce, "the compute-done event");
    }
    if (!rc && x->cached) {
        rc = xd_cached(x, il, sel, n, views);
        /* ST_EINVAL here: an expert twice in the selection (the ids and the layer were
         * checked above), as the routing gives for NaN logits: the compact buffer takes it,
         * as the resident weights would */
        if (rc == XD_STREAM || rc == ST_ETOOBIG || rc == ST_EINVAL)
            rc = xd_stream(x, il, sel, n, views);
    } else if (!rc) {
        rc = xd_stream(x, il, sel, n, views);
    }
    if (!rc && x->inject_slow)
        xd_spin<<<1, 1, 0, x->cs>>>(200000); /* the products lag the host's next calls */
    if (rc)
        x->err = rc;
    xd_publish(x);
    return rc;
}

extern "C" int st_xdev_error(st_xdev *x)
{
    if (!x)
        return 0;
    int rc = x->err;
    x->err = 0;
    return rc;
}

extern "C" void st_xdev_stats(st_xdev *x, st_engine_xcache *out)
{
    if (!x)
        return;
    pthread_mutex_lock(&x->mu);
    *out = x->pub;
    pthread_mutex_unlock(&x->mu);
}

extern "C" uint64_t st_xdev_device_bytes(const st_xdev *x)
{
    if (!x)
        return 0;
    return (uint64_t)x->k * x->rec + (x->cached ? (uint64_t)x->map.n_slots * x->rec : 0);
}

extern "C" void st_xdev_free(st_xdev *x)
{
    if (!x)
        return;
    if (x->xs)
        (void)cudaStreamSynchronize(x->xs);
    if (x->cs)
        (void)cudaStreamSynchronize(x->cs);
    if (x->made)
        fprintf(stderr, "strata: expert cache: %llu hits, %llu misses, %llu evictions, %.1f MiB "
                "uploaded, %llu calls streamed, %llu failed loads\n",
                (unsigned long long)x->map.hits, (unsigned long long)x->map.misses,
                (unsigned long long)x->map.evictions, (double)x->bytes_uploaded / 1048576.0,
                (unsigned long long)x->streamed, (unsigned long long)x->load_failures);
    for (uint32_t i = 0; x->stage && i < x->n_stage; i++) {
        if (x->stage[i])
            (void)cudaFreeHost(x->stage[i]);
        if (x->stage_ev && x->stage_ev[i])
            (void)cudaEventDestroy(x->stage_ev[i]);
    }
    for (int i = 0; x->ring_ok && i < XD_RING; i++)
        (void)cudaEventDestroy(x->ring[i]);
    if (x->load_ev)
        (void)cudaEventDestroy(x->load_ev);
    if (x->arena)
        (void)cudaFree(x->arena);
    if (x->compact)
        (void)cudaFree(x->compact);
    if (x->xs)
        (void)cudaStreamDestroy(x->xs);
    st_xcache_release(&x->map);
    free(x->stage);
    free(x->stage_ev);
    free(x->last);
    free(x->slots);
    free(x->load);
    free(x->ids);
    free(x->stage_of);
    free(x->dst);
    free(x->jobs);
    free(x->part);
    free(x->psize);
    pthread_mutex_destroy(&x->mu);
    free(x);
}

/* STRATA_XCACHE_INJECT (invariant 5): 1 to refuse the arena; *load_n the upload to fail;
 * *slow the spin each call. */
static int xd_inject(uint64_t *load_n, int *slow)
{
    const char *v = getenv("STRATA_XCACHE_INJECT");
    *load_n = 0;
    *slow = 0;
    if (!v || !*v)
        return 0;
    if (!strcmp(v, "alloc"))
        return 1;
    if (!strcmp(v, "slow")) {
        *slow = 1;
        return 0;
    }
    char *end = NULL;
    if (!strncmp(v, "load:", 5)) {
        unsigned long long n = strtoull(v + 5, &end, 10);
        if (end != v + 5 && !*end && n) {
            *load_n = n;
            return 0;
        }
    }
    fprintf(stderr, "strata: expert cache: STRATA_XCACHE_INJECT=%s: alloc, load:N (N >= 1) or "
            "slow; ignored\n", v);
    return 0;
}

extern "C" int st_xdev_new(const st_model *m, uint64_t arena_bytes, void *stream, st_pool *pool,
                           st_xdev **out)
{
    *out = NULL;
    const st_model_hparams *hp = &m->hp;
    if (!arena_bytes || !hp->n_expert)
        return 0;
    st_xdev *x = (st_xdev *)calloc(1, sizeof *x);
    if (!x)
        return st_error_set(ENOMEM, "expert cache");
    pthread_mutex_init(&x->mu, NULL);
    x->m = m;
    x->pool = pool;
    x->cs = (cudaStream_t)stream;
    x->n_layers = hp->n_layer;
    x->X = hp->n_expert;
    x->k = hp->n_expert_used;
    int rc = 0;
    cudaError_t ce;
    x->part = (uint64_t(*)[3])calloc(hp->n_layer ? hp->n_layer : 1, sizeof *x->part);
    x->psize = (uint64_t(*)[3])calloc(hp->n_layer ? hp->n_layer : 1, sizeof *x->psize);
    x->slots = (uint32_t *)calloc(x->k ? x->k : 1, sizeof *x->slots);
    x->load = (uint8_t *)calloc(x->k ? x->k : 1, 1);
    x->ids = (uint32_t *)calloc(x->k ? x->k : 1, sizeof *x->ids);
    x->stage_of = (uint32_t *)calloc(x->k ? x->k : 1, sizeof *x->stage_of);
    x->dst = (uint8_t **)calloc(x->k ? x->k : 1, sizeof *x->dst);
    x->jobs = (xd_job *)calloc(3 * (size_t)(x->k ? x->k : 1), sizeof *x->jobs);
    if (!x->part || !x->psize || !x->slots || !x->load || !x->ids || !x->stage_of || !x->dst ||
        !x->jobs) {
        st_xdev_free(x);
        return st_error_set(ENOMEM, "expert cache");
    }
    if (!x->k || x->k > x->X) {
        st_xdev_free(x);
        return st_error_set(ST_EINVAL, "expert cache: top %u of %u experts", x->k, x->X);
    }
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        const st_layer *L = &m->layers[il];
        const st_wmat *w[3] = {&L->moe_gate, &L->moe_up, &L->moe_down};
        if (!w[0]->data || !w[1]->data || !w[2]->data)
            continue;
        uint64_t off = 0;
        for (int p = 0; p < 3; p++) {
            if (w[p]->rows % x->X) {
                st_xdev_free(x);
                return st_error_set(ST_EINVAL, "expert cache: layer %u: %u rows for %u experts",
                                    il, w[p]->rows, x->X);
            }
            x->part[il][p] = off;
            x->psize[il][p] = (uint64_t)(w[p]->rows / x->X) * st_wmat_row_bytes(w[p]);
            off = xd_align(off + x->psize[il][p]);
        }
        if (off > x->rec)
            x->rec = off;
        x->n_moe++;
    }
    if (!x->rec) {
        st_xdev_free(x);
        return st_error_set(ST_EINVAL, "expert cache: the model's layers have no experts");
    }
    /* the compact buffer and the staging: always (the streaming path is the fallback) */
    x->n_stage = 2 * x->k;
    x->stage = (uint8_t **)calloc(x->n_stage, sizeof *x->stage);
    x->stage_ev = (cudaEvent_t *)calloc(x->n_stage, sizeof *x->stage_ev);
    if (!x->stage || !x->stage_ev) {
        st_xdev_free(x);
        return st_error_set(ENOMEM, "expert cache");
    }
    if ((ce = cudaStreamCreateWithFlags(&x->xs, cudaStreamNonBlocking)) != cudaSuccess ||
        (ce = cudaEventCreateWithFlags(&x->load_ev, cudaEventDisableTiming)) != cudaSuccess ||
        (ce = cudaMalloc((void **)&x->compact, (size_t)x->k * x->rec)) != cudaSuccess) {
        rc = xd_fail(ce, "the streaming path's buffer and stream");
        st_xdev_free(x);
        return rc;
    }
    for (uint32_t i = 0; i < x->n_stage; i++)
        if ((ce = cudaHostAlloc((void **)&x->stage[i], x->rec, cudaHostAllocDefault)) !=
                cudaSuccess ||
            (ce = cudaEventCreateWithFlags(&x->stage_ev[i], cudaEventDisableTiming)) !=
                cudaSuccess) {
            rc = xd_fail(ce, "the pinned staging");
            st_xdev_free(x);
            return rc;
        }
    x->ring_ok = 1;
    for (int i = 0; i < XD_RING; i++)
        if (cudaEventCreateWithFlags(&x->ring[i], cudaEventDisableTiming) != cudaSuccess) {
            (void)cudaGetLastError();
            for (int j = 0; j < i; j++)
                (void)cudaEventDestroy(x->ring[j]);
            x->ring_ok = 0; /* invariant 3: synchronise instead */
            fprintf(stderr, "strata: expert cache: no compute-done events; slot reuse "
                    "synchronises the stream\n");
            break;
        }
    /* the arena (invariant 4) */
    int refuse = xd_inject(&x->inject_load, &x->inject_slow);
    uint64_t all = (uint64_t)x->n_moe * x->X * x->rec; /* room for every record at most */
    if (st_xcache_init(&x->map, x->n_layers, x->X, x->rec, arena_bytes < all ? arena_bytes : all,
                       x->k)) {
        fprintf(stderr, "strata: expert cache: %s\n", st_errdetail());
    } else if (refuse || (ce = cudaMalloc((void **)&x->arena,
                                          (size_t)x->map.n_slots * x->rec)) != cudaSuccess) {
        if (!refuse)
            (void)cudaGetLastError();
        fprintf(stderr, "strata: expert cache: no arena of %.1f MiB (%s): the experts are "
                "streamed\n", (double)x->map.n_slots * (double)x->rec / 1048576.0,
                refuse ? "STRATA_XCACHE_INJECT=alloc" : cudaGetErrorString(ce));
        x->arena = NULL;
        st_xcache_release(&x->map);
    } else if (!(x->last = (uint64_t *)calloc(x->map.n_slots, sizeof *x->last))) {
        st_xdev_free(x);
        return st_error_set(ENOMEM, "expert cache");
    } else {
        x->cached = 1;
    }
    if (x->cached)
        fprintf(stderr, "strata: expert cache: %llu expert records of %.2f MiB in host memory, "
                "an arena of %u in VRAM (%.1f MiB, %.1f%%)\n",
                (unsigned long long)x->n_moe * x->X, (double)x->rec / 1048576.0,
                x->map.n_slots, (double)x->map.n_slots * (double)x->rec / 1048576.0,
                100.0 * x->map.n_slots / ((double)x->n_moe * x->X));
    else
        fprintf(stderr, "strata: expert cache: %llu expert records of %.2f MiB in host memory, "
                "streamed per token\n", (unsigned long long)x->n_moe * x->X,
                (double)x->rec / 1048576.0);
    x->made = 1;
    xd_publish(x);
    *out = x;
    return 0;
}
