/*
 * st_work.c - the worker pool: jobs run on worker threads, their completions on the loop.
 *
 * Invariants:
 * 1. A job is in exactly one place: the run queue, a worker's hands, the done queue, or with
 *    the loop running its done(); outstanding counts the jobs in any of them.
 * 2. Workers wake the loop with event_active() on one event (libevent's pthread support makes
 *    that safe from any thread); the loop drains the whole done queue each time, so a wake-up
 *    that coalesces several completions loses none.
 * 3. The pool never frees a job: its memory is the submitter's until done() ran on the loop, so
 *    a field of it that the loop writes while a worker runs the job (st_api_call's atomic
 *    cancelled flag) is valid for both as long as either needs it.
 */
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

#include "st_api_int.h"

struct st_work {
    struct event_base *base;
    struct event *wake;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    st_job *run_head, *run_tail;
    st_job *done_head, *done_tail;
    unsigned queued;
    _Atomic unsigned outstanding;
    int stop;
    unsigned n_threads;
    pthread_t *threads;
};

static void *worker_main(void *arg)
{
    st_work *w = arg;
    for (;;) {
        pthread_mutex_lock(&w->mu);
        while (!w->run_head && !w->stop)
            pthread_cond_wait(&w->cv, &w->mu);
        if (!w->run_head) {
            pthread_mutex_unlock(&w->mu);
            return NULL;
        }
        st_job *j = w->run_head;
        w->run_head = j->next;
        if (!w->run_head)
            w->run_tail = NULL;
        w->queued--;
        pthread_mutex_unlock(&w->mu);

        st_error_clear();
        j->run(j);

        pthread_mutex_lock(&w->mu);
        j->next = NULL;
        if (w->done_tail)
            w->done_tail->next = j;
        else
            w->done_head = j;
        w->done_tail = j;
        pthread_mutex_unlock(&w->mu);
        event_active(w->wake, EV_READ, 0);
    }
}

static void wake_cb(evutil_socket_t fd, short what, void *arg)
{
    st_work *w = arg;
    (void)fd;
    (void)what;
    pthread_mutex_lock(&w->mu);
    st_job *j = w->done_head;
    w->done_head = w->done_tail = NULL;
    pthread_mutex_unlock(&w->mu);
    while (j) {
        st_job *next = j->next;
        w->outstanding--;
        j->done(j);
        j = next;
    }
}

int st_work_new(struct event_base *base, unsigned n_threads, st_work **out)
{
    *out = NULL;
    st_work *w = calloc(1, sizeof *w);
    if (!w)
        return st_error_set(ENOMEM, "workers: no memory");
    w->base = base;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    w->wake = event_new(base, -1, 0, wake_cb, w);
    w->threads = calloc(n_threads ? n_threads : 1, sizeof *w->threads);
    if (!w->wake || !w->threads) {
        st_work_free(w);
        return st_error_set(ENOMEM, "workers: no memory");
    }
    for (unsigned i = 0; i < n_threads; i++) {
        int rc = pthread_create(&w->threads[i], NULL, worker_main, w);
        if (rc) {
            st_work_free(w);
            return st_error_set(rc, "workers: cannot start thread %u of %u", i + 1, n_threads);
        }
        w->n_threads++;
    }
    *out = w;
    return 0;
}

void st_work_submit(st_work *w, st_job *j)
{
    j->next = NULL;
    w->outstanding++;
    pthread_mutex_lock(&w->mu);
    if (w->run_tail)
        w->run_tail->next = j;
    else
        w->run_head = j;
    w->run_tail = j;
    w->queued++;
    pthread_cond_signal(&w->cv);
    pthread_mutex_unlock(&w->mu);
}

unsigned st_work_outstanding(const st_work *w) { return w->outstanding; }

unsigned st_work_queued(st_work *w)
{
    pthread_mutex_lock(&w->mu);
    unsigned n = w->queued;
    pthread_mutex_unlock(&w->mu);
    return n;
}

void st_work_free(st_work *w)
{
    if (!w)
        return;
    pthread_mutex_lock(&w->mu);
    w->stop = 1;
    pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    for (unsigned i = 0; i < w->n_threads; i++)
        pthread_join(w->threads[i], NULL);
    /* completions nobody will send: run their done() so that they free what they hold */
    wake_cb(-1, 0, w);
    if (w->wake)
        event_free(w->wake);
    free(w->threads);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}
