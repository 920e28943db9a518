/*
 * st_api_test.h - helpers shared by the strata-server tests (test_api_http.c, test_api_engine.c):
 * N concurrent client threads with a /healthz poller running beside them.
 */
#ifndef ST_API_TEST_H
#define ST_API_TEST_H

#include <pthread.h>
#include <stdatomic.h>

#include "st_http_client.h"

/* One client thread: its index, and its failures with the last reason. */
typedef struct st_at_client {
    int i, failures;
    char why[256];
} st_at_client;

/* A thread asking GET /healthz every 5 ms while `running`: answers that were 200, others, and
 * the slowest answer. */
typedef struct st_at_poller {
    uint16_t port;
    atomic_int running;
    int ok, failed;
    double worst_ms;
} st_at_poller;

static inline void *st_at_poller_main(void *arg)
{
    st_at_poller *p = arg;
    while (atomic_load(&p->running)) {
        st_hc_resp r;
        double t0 = st_hc_now_ms();
        if (st_hc_request(p->port, "GET", "/healthz", NULL, NULL, 0, &r) || r.status != 200)
            p->failed++;
        else
            p->ok++;
        double ms = st_hc_now_ms() - t0;
        if (ms > p->worst_ms)
            p->worst_ms = ms;
        st_hc_resp_free(&r);
        usleep(5000);
    }
    return NULL;
}

/* Run n clients (cl[0..n-1], fn(&cl[i])) at once against port with a poller beside them; every
 * client's failure is printed. Returns the failures summed over the clients, or -1 when a thread
 * could not be started. *pol is filled in. */
static inline int st_at_run_clients(uint16_t port, int n, void *(*fn)(void *), st_at_client *cl,
                                    st_at_poller *pol)
{
    pthread_t th[n], pt;
    memset(pol, 0, sizeof *pol);
    pol->port = port;
    atomic_store(&pol->running, 1);
    if (pthread_create(&pt, NULL, st_at_poller_main, pol))
        return -1;
    int started = 0, failures = 0;
    for (int i = 0; i < n; i++, started++) {
        memset(&cl[i], 0, sizeof cl[i]);
        cl[i].i = i;
        if (pthread_create(&th[i], NULL, fn, &cl[i]))
            break;
    }
    for (int i = 0; i < started; i++) {
        pthread_join(th[i], NULL);
        if (cl[i].failures)
            fprintf(stderr, "client %d: %s\n", i, cl[i].why);
        failures += cl[i].failures;
    }
    atomic_store(&pol->running, 0);
    pthread_join(pt, NULL);
    fprintf(stderr, "%d clients: /healthz answered %d times during the load (worst %.1f ms)\n", n,
            pol->ok, pol->worst_ms);
    return started == n ? failures : -1;
}

#endif /* ST_API_TEST_H */
