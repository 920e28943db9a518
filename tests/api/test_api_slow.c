/*
 * test_api_slow.c - clients that try to lock the others out, against the real strata-server on
 * the tiny model, with its default connection limits:
 *   - a flood of 1,000 connections that never send a byte and 200 that send a request head a
 *     byte at a time (slowloris), from 50 loopback addresses, each reopened as soon as the
 *     server closes it: /healthz probes from another address must all answer 200 meanwhile (their
 *     latencies are printed, p50 and p99: a figure, never a pass condition);
 *   - 64 uploads that each declare a 16 MiB part and trickle it: every one is admitted (its
 *     bytes are charged as they arrive, not as declared), completions all answer 200 meanwhile,
 *     and once the trickle stops each upload ends with 408 for falling under --min-body-rate.
 * The attackers bind their sockets to 127.0.0.2 and up (Linux routes all of 127/8 to loopback),
 * so that the server sees many client addresses and the probes come from one of their own.
 */
#include <poll.h>
#include <sys/resource.h>

#include "st_api_test.h"

static st_at_env env;

static int group_setup(void **state)
{
    (void)state;
    /* the flood needs some 1,300 descriptors here and the server a few hundred */
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < rl.rlim_max) {
        rl.rlim_cur = rl.rlim_max;
        setrlimit(RLIMIT_NOFILE, &rl);
    }
    return st_at_setup(&env, "test_api_slow");
}

static int group_teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

/* ---- the flood -------------------------------------------------------------------------------- */

#define FLOOD_IDLE 1000
#define FLOOD_SLOW 200
#define FLOOD_N (FLOOD_IDLE + FLOOD_SLOW)
#define FLOOD_PROBES 300 /* one every 10 ms: the flood goes on for 3 s and more meanwhile */

static const char slow_head[] = "GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: ";

typedef struct flood {
    uint16_t port;
    atomic_int running;
    atomic_int opened;  /* every connection was opened once */
    int fd[FLOOD_N];
    size_t sent[FLOOD_N]; /* slowloris: bytes of the head sent */
    long reopened;
} flood;

/* Connection i's address: the idle ones from 127.0.0.2..41 (25 each), the slow ones from
 * 127.0.0.42..51 (20 each); 127.0.0.1 is the probes'. */
static void flood_open(flood *f, int i)
{
    char src[32];
    snprintf(src, sizeof src, "127.0.0.%d", i < FLOOD_IDLE ? 2 + i / 25 : 42 + (i - FLOOD_IDLE) / 20);
    f->sent[i] = 0;
    f->fd[i] = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (f->fd[i] < 0)
        return;
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    inet_pton(AF_INET, src, &a.sin_addr);
    if (bind(f->fd[i], (struct sockaddr *)&a, sizeof a)) {
        close(f->fd[i]);
        f->fd[i] = -1;
        return;
    }
    a.sin_port = htons(f->port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(f->fd[i], (struct sockaddr *)&a, sizeof a) && errno != EINPROGRESS) {
        close(f->fd[i]);
        f->fd[i] = -1;
    }
}

/* The attackers: open everything, then, in rounds of 100 ms, reopen what the server closed (up
 * to FLOOD_REOPEN a round: 2,000 new connections a second) and feed each slowloris head one
 * byte. */
#define FLOOD_REOPEN 200
static void *flood_main(void *arg)
{
    flood *f = arg;
    static struct pollfd pf[FLOOD_N];
    for (int i = 0; i < FLOOD_N; i++)
        flood_open(f, i);
    atomic_store(&f->opened, 1);
    while (atomic_load(&f->running)) {
        double round_end = st_hc_now_ms() + 100;
        for (int i = 0; i < FLOOD_N; i++)
            pf[i] = (struct pollfd){f->fd[i], POLLIN, 0};
        poll(pf, FLOOD_N, 0);
        int reopen = FLOOD_REOPEN;
        for (int i = 0; i < FLOOD_N; i++) {
            char buf[512];
            if (f->fd[i] < 0 || (pf[i].revents & (POLLIN | POLLHUP | POLLERR))) {
                /* closed by the server (shed, or a 408 for a slow head): read what came, reopen */
                if (!reopen)
                    continue;
                if (f->fd[i] >= 0) {
                    ssize_t n = recv(f->fd[i], buf, sizeof buf, 0);
                    if (n > 0 || (n < 0 && errno == EAGAIN))
                        continue; /* a reply: the close follows */
                    close(f->fd[i]);
                }
                flood_open(f, i);
                f->reopened++;
                reopen--;
                continue;
            }
            if (i >= FLOOD_IDLE) {
                char ch = f->sent[i] < sizeof slow_head - 1 ? slow_head[f->sent[i]] : 'a';
                if (send(f->fd[i], &ch, 1, MSG_NOSIGNAL) == 1)
                    f->sent[i]++;
            }
        }
        double left = round_end - st_hc_now_ms();
        if (left > 0)
            usleep((useconds_t)(left * 1000));
    }
    for (int i = 0; i < FLOOD_N; i++)
        if (f->fd[i] >= 0)
            close(f->fd[i]);
    return NULL;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* 1,000 idle and 200 slowloris connections against --max-connections 256: every /healthz probe
 * from another address answers. Before the server shed idle connections, the flood held every
 * connection slot and probes waited in the kernel's backlog until they timed out. */
static void test_idle_and_slowloris_flood(void **state)
{
    (void)state;
    struct rlimit rl;
    if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur < FLOOD_N + 300) {
        fprintf(stderr, "flood skipped: %llu descriptors allowed (the hard limit), %d needed\n",
                (unsigned long long)rl.rlim_cur, FLOOD_N + 300);
        skip();
    }
    st_hc_server s;
    assert_int_equal(st_at_server_start(&s, &env, "flood", NULL, NULL), 0);
    static flood f;
    memset(&f, 0, sizeof f);
    f.port = s.port;
    atomic_store(&f.running, 1);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, flood_main, &f), 0);
    while (!atomic_load(&f.opened))
        usleep(1000);
    /* the flood is on once the server has shed what did not fit under its cap (60 s at most) */
    double shed = 0, t_end = st_hc_now_ms() + 60000;
    while ((shed = st_at_metric(s.port, "strata_http_connections_shed_total")) < FLOOD_N - 256 &&
           st_hc_now_ms() < t_end)
        usleep(10000);
    fprintf(stderr, "flood: %d connections opened, server shed %.0f so far\n", FLOOD_N, shed);
    assert_true(shed >= FLOOD_N - 256);
    static double ms[FLOOD_PROBES];
    int failed = 0;
    for (int i = 0; i < FLOOD_PROBES; i++) {
        st_hc_resp r;
        memset(&r, 0, sizeof r);
        double t0 = st_hc_now_ms();
        int fd = st_hc_connect(s.port, 20000); /* a generous timeout: the figure is printed */
        int rc = fd < 0 ? -1 : st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0);
        if (!rc)
            rc = st_hc_read(fd, &r);
        if (fd >= 0)
            close(fd);
        ms[i] = st_hc_now_ms() - t0;
        if (rc || r.status != 200) {
            failed++;
            fprintf(stderr, "probe %d: %s %d after %.1f ms\n", i, rc ? "no answer" : "status", r.status,
                    ms[i]);
        }
        st_hc_resp_free(&r);
        usleep(10000);
    }
    double shed_after = st_at_metric(s.port, "strata_http_connections_shed_total");
    atomic_store(&f.running, 0);
    pthread_join(th, NULL);
    qsort(ms, FLOOD_PROBES, sizeof ms[0], cmp_double);
    fprintf(stderr,
            "flood of %d idle + %d slowloris connections from 50 addresses, cap 256: %d /healthz "
            "probes, %d failed; latency p50 %.2f ms, p99 %.2f ms, max %.2f ms; the server shed %.0f "
            "connections during the probes, the attackers reopened %ld in all\n",
            FLOOD_IDLE, FLOOD_SLOW, FLOOD_PROBES, failed, ms[FLOOD_PROBES / 2],
            ms[FLOOD_PROBES * 99 / 100], ms[FLOOD_PROBES - 1], shed_after - shed, f.reopened);
    assert_int_equal(failed, 0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* ---- slow uploads ----------------------------------------------------------------------------- */

#define SLOW_UPLOADS 64
#define PART_BYTES (16u << 20)

typedef struct trickle {
    int fd[SLOW_UPLOADS];
    atomic_int running;
} trickle;

/* 32 bytes every 100 ms on each upload: some 5 times the --min-body-rate of the test. */
static void *trickle_main(void *arg)
{
    trickle *t = arg;
    char bytes[32];
    memset(bytes, 'x', sizeof bytes);
    while (atomic_load(&t->running)) {
        for (int i = 0; i < SLOW_UPLOADS; i++)
            if (send(t->fd[i], bytes, sizeof bytes, MSG_NOSIGNAL) != (ssize_t)sizeof bytes) {
                /* the server answered already (a 408 when this thread was late): the test reads it */
            }
        usleep(100000);
    }
    return NULL;
}

/* 64 uploads declaring 16 MiB parts (1 GiB, four times --body-budget-mib) trickle their bytes:
 * all are admitted, completions answer 200 meanwhile, and each upload ends with 408 once the
 * trickle stops. Before bodies were charged as they arrived, 16 such parts reserved the whole
 * budget: the 17th upload and every completion got 503 busy. */
static void test_slow_uploads(void **state)
{
    (void)state;
    st_hc_server s;
    static const char *const flags[] = {"--min-body-rate", "64", "--body-rate-window-ms", "3000", NULL};
    assert_int_equal(st_at_server_start(&s, &env, "uploads", flags, NULL), 0);
    static trickle t;
    memset(&t, 0, sizeof t);
    for (int i = 0; i < SLOW_UPLOADS; i++) {
        json_t *o = st_at_call(s.port, "POST", "/v1/uploads", "{}", 201);
        char src[32], head[512];
        snprintf(src, sizeof src, "127.0.0.%d", 2 + i / 16);
        t.fd[i] = st_hc_connect_from(s.port, src, 30000);
        assert_true(t.fd[i] >= 0);
        int n = snprintf(head, sizeof head,
                         "PUT /v1/uploads/%s/parts/1 HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n"
                         "Content-Length: %u\r\n\r\n",
                         json_string_value(json_object_get(o, "upload")), PART_BYTES);
        json_decref(o);
        assert_int_equal(st_hc_send(t.fd[i], head, (size_t)n), 0);
        /* the 100 Continue says the server admitted the part */
        char got[26] = {0};
        assert_int_equal(recv(t.fd[i], got, 25, MSG_WAITALL), 25);
        if (strcmp(got, "HTTP/1.1 100 Continue\r\n\r\n"))
            fprintf(stderr, "upload %d not admitted: %.25s\n", i, got);
        assert_string_equal(got, "HTTP/1.1 100 Continue\r\n\r\n");
    }
    atomic_store(&t.running, 1);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, trickle_main, &t), 0);
    double t0 = st_hc_now_ms();
    for (int i = 0; i < 16; i++) {
        char id[32];
        snprintf(id, sizeof id, "slow-%d", i);
        json_decref(st_at_complete(s.port, id, "the uploads trickle on", 8, true));
    }
    fprintf(stderr, "16 completions answered 200 in %.0f ms while %d uploads trickled\n",
            st_hc_now_ms() - t0, SLOW_UPLOADS);
    double held = st_at_metric(s.port, "strata_http_body_bytes");
    fprintf(stderr, "request body bytes held with %d uploads of %u bytes declared: %.0f\n", SLOW_UPLOADS,
            PART_BYTES, held);
    assert_true(held >= 0 && held < (double)SLOW_UPLOADS * PART_BYTES / 16);
    atomic_store(&t.running, 0);
    pthread_join(th, NULL);
    /* with the trickle stopped, each upload falls under the minimum rate in its next window */
    for (int i = 0; i < SLOW_UPLOADS; i++) {
        st_hc_resp r;
        assert_int_equal(st_hc_read(t.fd[i], &r), 0);
        if (r.status != 408 || !strstr((char *)r.body, "under the minimum of 64 bytes/s"))
            fprintf(stderr, "upload %d: %d %s\n", i, r.status, r.body ? (char *)r.body : "");
        assert_int_equal(r.status, 408);
        assert_non_null(strstr((char *)r.body, "\"request_timeout\""));
        assert_non_null(strstr((char *)r.body, "under the minimum of 64 bytes/s"));
        st_hc_resp_free(&r);
        close(t.fd[i]);
    }
    json_decref(st_at_complete(s.port, "slow-after", "and after", 4, true));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_idle_and_slowloris_flood),
        cmocka_unit_test(test_slow_uploads),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
