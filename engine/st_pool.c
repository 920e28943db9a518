/*
 * st_pool.c - a fixed thread pool for data-parallel loops.
 *
 * Invariants:
 * 1. A run publishes (fn, ctx, n_tasks), resets the task counter and the count of workers still
 *    busy, then bumps the generation; each worker runs tasks taken from the shared counter until
 *    it passes n_tasks, then decrements the busy count. The caller runs tasks too and returns
 *    only when the busy count is zero, so no task of a run outlives it.
 * 2. Which thread runs which task varies from run to run; the kernels make every task's result
 *    independent of that (a task owns its outputs, never a part of a reduction).
 * 3. Waiting spins briefly, then sleeps on a condition variable, so an idle pool costs no CPU.
 */
#include <errno.h>
#include <sched.h>
#include <stdlib.h>

#include "st_engine_int.h"

#define SPIN_ROUNDS 4000 /* pause rounds before sleeping; every 64th yields the CPU */

struct st_pool {
    uint32_t n; /* threads including the caller */
    pthread_t *th;
    uint32_t n_started;
    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    atomic_uint gen;
    atomic_uint next;
    atomic_uint busy;
    atomic_int stop;
    st_task_fn fn;
    void *ctx;
    uint32_t n_tasks;
};

typedef struct worker_arg {
    st_pool *p;
    uint32_t id;
} worker_arg;

static inline void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void run_tasks(st_pool *p, uint32_t id)
{
    for (;;) {
        uint32_t i = atomic_fetch_add_explicit(&p->next, 1, memory_order_relaxed);
        if (i >= p->n_tasks)
            break;
        p->fn(p->ctx, i, id);
    }
}

static void *worker(void *arg)
{
    worker_arg *wa = arg;
    st_pool *p = wa->p;
    uint32_t id = wa->id;
    free(wa);
    unsigned seen = 0; /* the generation at creation: a run may start before this thread does */
    for (;;) {
        unsigned g;
        int spins = 0;
        while ((g = atomic_load_explicit(&p->gen, memory_order_acquire)) == seen &&
               !atomic_load(&p->stop)) {
            if (++spins < SPIN_ROUNDS) {
                if (spins % 64 == 0)
                    sched_yield();
                else
                    cpu_relax();
                continue;
            }
            pthread_mutex_lock(&p->mu);
            while (atomic_load_explicit(&p->gen, memory_order_acquire) == seen &&
                   !atomic_load(&p->stop))
                pthread_cond_wait(&p->cv_work, &p->mu);
            pthread_mutex_unlock(&p->mu);
        }
        if (atomic_load(&p->stop))
            break;
        seen = g;
        run_tasks(p, id);
        if (atomic_fetch_sub_explicit(&p->busy, 1, memory_order_acq_rel) == 1) {
            pthread_mutex_lock(&p->mu);
            pthread_cond_signal(&p->cv_done);
            pthread_mutex_unlock(&p->mu);
        }
    }
    return NULL;
}

void st_pool_free(st_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    atomic_store(&p->stop, 1);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < p->n_started; i++)
        pthread_join(p->th[i], NULL);
    pthread_cond_destroy(&p->cv_work);
    pthread_cond_destroy(&p->cv_done);
    pthread_mutex_destroy(&p->mu);
    free(p->th);
    free(p);
}

int st_pool_new(uint32_t n_threads, st_pool **out)
{
    *out = NULL;
    if (n_threads < 1)
        n_threads = 1;
    if (n_threads > 1024)
        return st_error_set(ST_EINVAL, "thread pool: %u threads (1..1024)", n_threads);
    st_pool *p = calloc(1, sizeof *p);
    if (!p)
        return st_error_set(ENOMEM, "thread pool");
    p->n = n_threads;
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->cv_work, NULL);
    pthread_cond_init(&p->cv_done, NULL);
    p->th = calloc(n_threads, sizeof *p->th);
    if (!p->th) {
        st_pool_free(p);
        return st_error_set(ENOMEM, "thread pool");
    }
    for (uint32_t i = 1; i < n_threads; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        int rc = wa ? 0 : ENOMEM;
        if (wa) {
            wa->p = p;
            wa->id = i;
            rc = pthread_create(&p->th[p->n_started], NULL, worker, wa);
            if (rc)
                free(wa);
        }
        if (rc) {
            st_pool_free(p);
            return st_error_set(rc, "thread pool: starting thread %u", i);
        }
        p->n_started++;
    }
    *out = p;
    return 0;
}

uint32_t st_pool_size(const st_pool *p)
{
    return p ? p->n : 1;
}

void st_pool_run(st_pool *p, uint32_t n_tasks, st_task_fn fn, void *ctx, uint64_t work)
{
    if (n_tasks == 0)
        return;
    if (!p || p->n == 1 || n_tasks == 1 || work < ST_POOL_MIN_WORK) {
        for (uint32_t i = 0; i < n_tasks; i++)
            fn(ctx, i, 0);
        return;
    }
    p->fn = fn;
    p->ctx = ctx;
    p->n_tasks = n_tasks;
    atomic_store_explicit(&p->next, 0, memory_order_relaxed);
    atomic_store_explicit(&p->busy, p->n - 1, memory_order_relaxed);
    pthread_mutex_lock(&p->mu);
    atomic_fetch_add_explicit(&p->gen, 1, memory_order_release);
    pthread_cond_broadcast(&p->cv_work);
    pthread_mutex_unlock(&p->mu);
    run_tasks(p, 0);
    int spins = 0;
    while (atomic_load_explicit(&p->busy, memory_order_acquire) != 0) {
        if (++spins < SPIN_ROUNDS) {
            if (spins % 64 == 0)
                sched_yield();
            else
                cpu_relax();
            continue;
        }
        pthread_mutex_lock(&p->mu);
        while (atomic_load_explicit(&p->busy, memory_order_acquire) != 0)
            pthread_cond_wait(&p->cv_done, &p->mu);
        pthread_mutex_unlock(&p->mu);
    }
}
