/*
 * st_store_par.c - the store's thread pool: st_store__par_run spreads n items over the calling
 * thread and up to threads-1 helpers started for the call (no pool outlives a call), and the
 * state-hash runner built on it. Used by put (hashing, framing), get (copy-out, checking) and
 * check. Invariants:
 * 1. Every item in [0, n) is run exactly once unless an item fails; after the first failure no
 *    item is started, and that failure (code and thread-local detail) is the call's result.
 * 2. Every helper is joined before st_store__par_run returns: nothing runs after it.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>

#include "st_store_lmdb_int.h"

/* ---- parallel work ------------------------------------------------------------------------------
 * Items are taken from a shared counter by the calling thread and up to threads-1 helpers; the
 * first error wins and its detail (thread-local) is carried back to the caller. */

typedef struct st_par {
    size_t n;
    int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx);
    void *ctx;
    atomic_size_t next;
    atomic_int failed;
    pthread_mutex_t mu;
    int rc;
    char detail[512];
} st_par;

static void *par_worker(void *arg)
{
    st_par *p = arg;
    st_frame_ctx *fctx = NULL;
    for (;;) {
        if (atomic_load(&p->failed))
            break;
        size_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n)
            break;
        int rc = p->fn(p->ctx, i, &fctx);
        if (rc) {
            pthread_mutex_lock(&p->mu);
            if (!p->rc) {
                p->rc = rc;
                snprintf(p->detail, sizeof p->detail, "%s", st_errdetail());
            }
            pthread_mutex_unlock(&p->mu);
            atomic_store(&p->failed, 1);
            break;
        }
    }
    st_frame_ctx_free(fctx);
    return NULL;
}

int st_store__par_run(unsigned threads, size_t n, int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx), void *ctx)
{
    st_par p = {.n = n, .fn = fn, .ctx = ctx};
    pthread_t tid[16];
    unsigned started = 0;
    atomic_init(&p.next, 0);
    atomic_init(&p.failed, 0);
    pthread_mutex_init(&p.mu, NULL);
    if (threads > 16)
        threads = 16;
    if (threads > n)
        threads = (unsigned)n;
    for (unsigned t = 1; t < threads; t++)
        if (pthread_create(&tid[started], NULL, par_worker, &p) == 0)
            started++;
    par_worker(&p);
    for (unsigned t = 0; t < started; t++)
        pthread_join(tid[t], NULL);
    pthread_mutex_destroy(&p.mu);
    if (p.rc)
        return st_error_set(p.rc, "%s", p.detail);
    return 0;
}

typedef struct st_hash_par {
    st_state_hash_task task;
    void *arg;
} st_hash_par;

static int hash_par_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    const st_hash_par *h = ctx;
    h->task(h->arg, i);
    return 0;
}

void st_store__state_hash_runner(void *run_arg, uint64_t n, st_state_hash_task task, void *arg)
{
    st_hash_par h = {task, arg};
    st_store__par_run(*(const unsigned *)run_arg, (size_t)n, hash_par_one, &h);
}
