/*
 * st_store_par.c - the store's thread pool: st_store__par_run spreads n items over the calling
 * thread and up to threads-1 helpers started for the call (no pool outlives a call), and the
 * state-hash runner built on it, used by get (copy-out, checking) and check; and the stream
 * (st_store__stream_*), the same pool left running while its caller consumes the items in order,
 * used by put to hash and frame chunk i+1.. while chunk i is written. Invariants:
 * 1. Every item in [0, n) is run exactly once unless an item fails; after the first failure no
 *    item is started, and that failure (code and thread-local detail) is the call's result.
 * 2. Every helper is joined before st_store__par_run (a stream: st_store__stream_stop) returns:
 *    nothing runs after it.
 * 3. A stream's item i is seen done (st_store__stream_wait returns 0) only after everything its
 *    function wrote is visible to the waiting thread (release store, acquire load of done[i]).
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

/* ---- the stream: items run ahead of a consumer that takes them in order ------------------------ */

struct st_stream {
    size_t n;
    int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx);
    void *ctx;
    atomic_size_t next;        /* the next item to claim */
    atomic_int failed, stop;
    atomic_uchar *done;        /* per item: its function returned 0 */
    pthread_mutex_t mu;        /* with cv: a consumer waiting for an item someone else runs */
    pthread_cond_t cv;
    int rc;                    /* under mu: the first failure */
    char detail[512];
    st_frame_ctx *fctx;        /* the consumer's, for the items it runs while it waits */
    pthread_t tid[16];
    unsigned started;
    size_t n_done;             /* under mu: items finished */
    double t_last;             /* under mu: when every item had finished (STRATA_STORE_TRACE) */
};

static double stream_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* Claim and run one item; 0 when there was none to claim (or the stream stopped). */
static int stream_one(st_stream *s, st_frame_ctx **fctx)
{
    if (atomic_load(&s->failed) || atomic_load(&s->stop))
        return 0;
    size_t i = atomic_fetch_add(&s->next, 1);
    if (i >= s->n)
        return 0;
    int rc = s->fn(s->ctx, i, fctx);
    pthread_mutex_lock(&s->mu);
    if (rc) {
        if (!s->rc) {
            s->rc = rc;
            snprintf(s->detail, sizeof s->detail, "%s", st_errdetail());
        }
        atomic_store(&s->failed, 1);
    } else {
        atomic_store_explicit(&s->done[i], 1, memory_order_release);
        if (++s->n_done == s->n)
            s->t_last = stream_ms();
    }
    pthread_cond_broadcast(&s->cv);
    pthread_mutex_unlock(&s->mu);
    return 1;
}

static void *stream_worker(void *arg)
{
    st_stream *s = arg;
    st_frame_ctx *fctx = NULL;
    while (stream_one(s, &fctx))
        ;
    st_frame_ctx_free(fctx);
    return NULL;
}

int st_store__stream_start(unsigned helpers, size_t n, int (*fn)(void *ctx, size_t i, st_frame_ctx **fctx),
                           void *ctx, st_stream **out)
{
    *out = NULL;
    st_stream *s = calloc(1, sizeof *s);
    atomic_uchar *done = calloc(n ? n : 1, sizeof *done);
    if (!s || !done) {
        free(s);
        free(done);
        return st_error_set(ENOMEM, "no memory for the stream of %zu chunks (%zu bytes)", n,
                            sizeof *s + n * sizeof *done);
    }
    s->n = n;
    s->fn = fn;
    s->ctx = ctx;
    s->done = done;
    atomic_init(&s->next, 0);
    atomic_init(&s->failed, 0);
    atomic_init(&s->stop, 0);
    for (size_t i = 0; i < n; i++)
        atomic_init(&s->done[i], 0);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv, NULL);
    if (helpers > 16)
        helpers = 16;
    if (helpers > n)
        helpers = (unsigned)n;
    for (unsigned t = 0; t < helpers; t++)
        if (pthread_create(&s->tid[s->started], NULL, stream_worker, s) == 0)
            s->started++;
    *out = s;
    return 0;
}

/* The stream's first failure, with its detail, as the caller's error. */
static int stream_failure(st_stream *s)
{
    pthread_mutex_lock(&s->mu);
    int rc = s->rc;
    char detail[512];
    snprintf(detail, sizeof detail, "%s", s->detail);
    pthread_mutex_unlock(&s->mu);
    return st_error_set(rc, "%s", detail);
}

int st_store__stream_wait(st_stream *s, size_t i)
{
    for (;;) {
        if (atomic_load_explicit(&s->done[i], memory_order_acquire))
            return 0;
        if (atomic_load(&s->failed))
            return stream_failure(s);
        if (stream_one(s, &s->fctx)) /* help while item i is being run */
            continue;
        pthread_mutex_lock(&s->mu);
        while (!atomic_load_explicit(&s->done[i], memory_order_acquire) && !atomic_load(&s->failed))
            pthread_cond_wait(&s->cv, &s->mu);
        pthread_mutex_unlock(&s->mu);
    }
}

int st_store__stream_wait_idle(st_stream *s, size_t i)
{
    if (atomic_load_explicit(&s->done[i], memory_order_acquire))
        return 0;
    pthread_mutex_lock(&s->mu);
    while (!atomic_load_explicit(&s->done[i], memory_order_acquire) && !atomic_load(&s->failed))
        pthread_cond_wait(&s->cv, &s->mu);
    pthread_mutex_unlock(&s->mu);
    return atomic_load_explicit(&s->done[i], memory_order_acquire) ? 0 : stream_failure(s);
}

void st_store__stream_join(st_stream *s)
{
    if (!s)
        return;
    atomic_store(&s->stop, 1);
    for (unsigned t = 0; t < s->started; t++)
        pthread_join(s->tid[t], NULL);
    s->started = 0;
}

double st_store__stream_stop(st_stream *s)
{
    if (!s)
        return 0;
    st_store__stream_join(s);
    double t_last = s->t_last;
    st_frame_ctx_free(s->fctx);
    pthread_cond_destroy(&s->cv);
    pthread_mutex_destroy(&s->mu);
    free(s->done);
    free(s);
    return t_last;
}
