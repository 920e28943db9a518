/*
 * bench_api - strata-server over loopback: SAVE / PARK / RESTORE latency and throughput for small
 * and large conversations under concurrent clients, one large conversation at a time (a SAVE
 * alone on the server and the disk: issue 13's section 6 figure), and /healthz latency while
 * large SAVEs run.
 *
 *   bench_api [--quick] [--keep DIR]
 *
 * It starts the strata-server and strata-mkmodel found next to it (BUILD/tools), in a scratch
 * directory (under $TMPDIR or /tmp). Small conversations run on the `tiny` model (~20 KB images),
 * large ones on the `bench` model (~118 MB of running state per checkpoint: ~240 MB per SAVE).
 * Throughputs are printed as ratios to limits measured in the same run on the same file system:
 * write+fsync for SAVE (it must reach the disk), memcpy for PARK (RAM) and RESTORE.
 */
#include <libgen.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../tests/api/st_http_client.h"

static char bindir[PATH_MAX];
static char work[PATH_MAX];
static int quick;

/* ---- limits measured here ------------------------------------------------------------------ */

static double memcpy_gbs(size_t bytes)
{
    char *a = malloc(bytes), *b = malloc(bytes);
    if (!a || !b)
        return 0;
    memset(a, 1, bytes);
    memset(b, 2, bytes);
    double best = 1e30;
    for (int i = 0; i < 5; i++) {
        double t0 = st_hc_now_ms();
        memcpy(b, a, bytes);
        double ms = st_hc_now_ms() - t0;
        if (ms < best)
            best = ms;
        a[i] = b[bytes - 1 - (size_t)i]; /* keep the copies observable */
    }
    free(a);
    free(b);
    return (double)bytes / (best / 1e3) / 1e9;
}

static double write_fsync_gbs(size_t bytes)
{
    char path[PATH_MAX + 16];
    snprintf(path, sizeof path, "%s/fsync-probe", work);
    size_t chunk = 4u << 20;
    char *buf = malloc(chunk);
    if (!buf)
        return 0;
    for (size_t i = 0; i < chunk; i++)
        buf[i] = (char)(i * 2654435761u >> 13);
    double best = 1e30;
    for (int rep = 0; rep < 2; rep++) {
        FILE *f = fopen(path, "wb");
        if (!f)
            break;
        double t0 = st_hc_now_ms();
        for (size_t done = 0; done < bytes; done += chunk)
            if (fwrite(buf, 1, chunk, f) != chunk)
                break;
        fflush(f);
        fsync(fileno(f));
        fclose(f);
        double ms = st_hc_now_ms() - t0;
        if (ms < best)
            best = ms;
        unlink(path);
    }
    free(buf);
    return (double)bytes / (best / 1e3) / 1e9;
}

/* ---- the server ---------------------------------------------------------------------------- */

static int server_start(st_hc_server *s, const char *model, const char *store, const char *slots,
                        const char *extra1, const char *extra2)
{
    char bin[PATH_MAX + 32], logp[PATH_MAX + 32];
    snprintf(bin, sizeof bin, "%s/strata-server", bindir);
    snprintf(logp, sizeof logp, "%s/server.log", work);
    const char *args[20];
    int n = 0;
    args[n++] = "--store";
    args[n++] = store;
    args[n++] = "--model";
    args[n++] = model;
    args[n++] = "--slots";
    args[n++] = slots;
    args[n++] = "--workers";
    args[n++] = "8";
    if (extra1)
        args[n++] = extra1;
    if (extra2)
        args[n++] = extra2;
    args[n] = NULL;
    return st_hc_server_start(s, bin, work, logp, args);
}

static int make_model(const char *preset, char *path, size_t cap)
{
    snprintf(path, cap, "%s/%s.gguf", work, preset);
    struct stat sb;
    if (stat(path, &sb) == 0)
        return 0;
    char cmd[3 * PATH_MAX];
    snprintf(cmd, sizeof cmd, "'%s/strata-mkmodel' --preset %s -o '%s' >/dev/null 2>&1", bindir, preset, path);
    return system(cmd) == 0 ? 0 : -1;
}

/* A number after "key": in a JSON reply (these replies are flat enough for that). */
static double jnum(const st_hc_resp *r, const char *key)
{
    char k[64];
    snprintf(k, sizeof k, "\"%s\":", key);
    const char *p = r->body ? strstr((const char *)r->body, k) : NULL;
    return p ? strtod(p + strlen(k), NULL) : -1;
}

/* ---- measurements ------------------------------------------------------------------------------ */

enum { OP_SAVE, OP_PARK, OP_RESTORE, OP_N };
static const char *op_name[OP_N] = {"SAVE", "PARK", "RESTORE"};

typedef struct series {
    pthread_mutex_t mu;
    double *ms;
    size_t n, cap;
    double bytes;
    double server_ms, snapshot_ms, store_ms; /* sums of what the replies say (SAVE) */
    double wall_first, wall_last;
} series;

static void series_add(series *s, double t0, double ms, double bytes)
{
    pthread_mutex_lock(&s->mu);
    if (s->n == s->cap) {
        s->cap = s->cap ? 2 * s->cap : 256;
        s->ms = realloc(s->ms, s->cap * sizeof *s->ms);
    }
    s->ms[s->n++] = ms;
    s->bytes += bytes;
    if (!s->wall_first || t0 < s->wall_first)
        s->wall_first = t0;
    if (t0 + ms > s->wall_last)
        s->wall_last = t0 + ms;
    pthread_mutex_unlock(&s->mu);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(series *s, double p)
{
    if (!s->n)
        return 0;
    qsort(s->ms, s->n, sizeof *s->ms, cmp_d);
    size_t i = (size_t)(p / 100.0 * (double)(s->n - 1) + 0.5);
    return s->ms[i < s->n ? i : s->n - 1];
}

typedef struct phase {
    uint16_t port;
    int clients, rounds;
    const char *prefix;
    int prompt_chars;
    int salt;           /* varies the prompts (so another phase's conversations share no chunks) */
    int inited;
    series op[OP_N];
    _Atomic int failures;
    _Atomic int saving; /* SAVEs in flight */
} phase;

typedef struct worker {
    phase *ph;
    int i;
} worker;

/* POST, retrying while every slot is busy (409 busy). */
static int post(uint16_t port, const char *path, const char *body, st_hc_resp *r)
{
    for (int a = 0; a < 100000; a++) {
        if (st_hc_json(port, "POST", path, body, r))
            return -1;
        if (!(r->status == 409 && strstr((char *)r->body, "\"busy\"")))
            return 0;
        st_hc_resp_free(r);
        usleep(1000);
    }
    return -1;
}

static void *worker_main(void *arg)
{
    worker *w = arg;
    phase *ph = w->ph;
    char id[32], path[128];
    snprintf(id, sizeof id, "%s-%d", ph->prefix, w->i);
    char *body = malloc((size_t)ph->prompt_chars + 256);
    int n = sprintf(body, "{\"session\":\"%s\",\"n_predict\":4,\"prompt\":\"", id);
    for (int k = 0; k < ph->prompt_chars; k++)
        body[n++] = (char)('a' + (k * 7 + w->i + ph->salt * 3) % 26);
    strcpy(body + n, "\"}");
    st_hc_resp r;
    if (post(ph->port, "/v1/completions", body, &r) || r.status != 200) {
        fprintf(stderr, "bench_api: completion for %s: %d %.200s\n", id, r.status, r.body ? (char *)r.body : "");
        ph->failures++;
        st_hc_resp_free(&r);
        free(body);
        return NULL;
    }
    st_hc_resp_free(&r);
    free(body);
    static const char *const suffix[OP_N] = {"save", "park", "restore"};
    for (int round = 0; round < ph->rounds; round++) {
        for (int op = 0; op < OP_N; op++) {
            snprintf(path, sizeof path, "/v1/sessions/%s/%s", id, suffix[op]);
            if (op == OP_SAVE)
                ph->saving++;
            double t0 = st_hc_now_ms();
            int rc = post(ph->port, path, "{}", &r);
            double ms = st_hc_now_ms() - t0;
            if (op == OP_SAVE)
                ph->saving--;
            if (rc || r.status >= 300) {
                fprintf(stderr, "bench_api: %s %s: %d %.200s\n", op_name[op], id, r.status,
                        r.body ? (char *)r.body : "");
                ph->failures++;
                st_hc_resp_free(&r);
                return NULL;
            }
            double bytes = jnum(&r, op == OP_PARK ? "bytes" : "logical_bytes");
            series_add(&ph->op[op], t0, ms, bytes > 0 ? bytes : 0);
            pthread_mutex_lock(&ph->op[op].mu);
            ph->op[op].server_ms += jnum(&r, "ms");
            if (op == OP_SAVE) {
                ph->op[op].snapshot_ms += jnum(&r, "snapshot_ms");
                ph->op[op].store_ms += jnum(&r, "store_ms");
            }
            pthread_mutex_unlock(&ph->op[op].mu);
            st_hc_resp_free(&r);
        }
    }
    return NULL;
}

typedef struct poller {
    uint16_t port;
    phase *ph;
    _Atomic int run;
    series all, during_save;
    int failed;
} poller;

static void *poller_main(void *arg)
{
    poller *p = arg;
    int fd = st_hc_connect(p->port, 30000);
    while (p->run) {
        int saving = p->ph ? p->ph->saving > 0 : 0;
        double t0 = st_hc_now_ms();
        st_hc_resp r;
        if (fd < 0 || st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0) || st_hc_read(fd, &r) ||
            r.status != 200) {
            p->failed++;
            if (fd >= 0)
                close(fd);
            fd = st_hc_connect(p->port, 30000);
            continue;
        }
        double ms = st_hc_now_ms() - t0;
        st_hc_resp_free(&r);
        series_add(&p->all, t0, ms, 0);
        if (saving && p->ph->saving > 0)
            series_add(&p->during_save, t0, ms, 0);
        usleep(1000);
    }
    if (fd >= 0)
        close(fd);
    return NULL;
}

static void run_phase(phase *ph, poller *pol)
{
    pthread_t th[64], pt;
    worker w[64];
    if (!ph->inited)
        for (int i = 0; i < OP_N; i++)
            pthread_mutex_init(&ph->op[i].mu, NULL);
    ph->inited = 1;
    if (pol) {
        pol->ph = ph;
        pol->run = 1;
        pthread_create(&pt, NULL, poller_main, pol);
    }
    for (int i = 0; i < ph->clients; i++) {
        w[i].ph = ph;
        w[i].i = i;
        pthread_create(&th[i], NULL, worker_main, &w[i]);
    }
    for (int i = 0; i < ph->clients; i++)
        pthread_join(th[i], NULL);
    if (pol) {
        pol->run = 0;
        pthread_join(pt, NULL);
    }
}

static void report(phase *ph, double fsync_gbs, double memcpy_gbs_v)
{
    for (int op = 0; op < OP_N; op++) {
        series *s = &ph->op[op];
        if (!s->n)
            continue;
        double mean_bytes = s->bytes / (double)s->n;
        double sum_ms = 0;
        for (size_t i = 0; i < s->n; i++)
            sum_ms += s->ms[i];
        double wall = (s->wall_last - s->wall_first) / 1e3;
        double per_op_gbs = mean_bytes / (sum_ms / (double)s->n / 1e3) / 1e9;
        double limit = op == OP_SAVE ? fsync_gbs : memcpy_gbs_v;
        printf("  %-8s n=%-4zu p50 %9.2f ms  p99 %9.2f ms  %8.1f ops/s  image %9.1f KB  "
               "%6.3f GB/s per op = %.3fx %s\n",
               op_name[op], s->n, pct(s, 50), pct(s, 99), wall > 0 ? (double)s->n / wall : 0,
               mean_bytes / 1e3, per_op_gbs, limit > 0 ? per_op_gbs / limit : 0,
               op == OP_SAVE ? "write+fsync" : "memcpy");
        double cn = (double)s->n;
        if (op == OP_SAVE)
            printf("           mean %.2f ms at the client = %.2f ms in the handler (engine snapshot %.2f + "
                   "store put %.2f) + %.2f ms HTTP, queueing and waiting for a slot\n",
                   sum_ms / cn, s->server_ms / cn, s->snapshot_ms / cn, s->store_ms / cn,
                   (sum_ms - s->server_ms) / cn);
        else
            printf("           mean %.2f ms at the client = %.2f ms in the handler + %.2f ms HTTP, "
                   "queueing and waiting for a slot\n",
                   sum_ms / cn, s->server_ms / cn, (sum_ms - s->server_ms) / cn);
    }
}

int main(int argc, char **argv)
{
    const char *keep = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--keep") && i + 1 < argc)
            keep = argv[++i];
        else {
            fprintf(stderr, "usage: bench_api [--quick] [--keep DIR]\n");
            return 2;
        }
    }
    char self[PATH_MAX];
    snprintf(self, sizeof self, "%s", argv[0]);
    snprintf(bindir, sizeof bindir, "%s/../tools", dirname(self));
    if (keep) {
        snprintf(work, sizeof work, "%s", keep);
        mkdir(work, 0700);
    } else {
        const char *t = getenv("TMPDIR");
        snprintf(work, sizeof work, "%s/bench_api.XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(work)) {
            perror("bench_api: mkdtemp");
            return 1;
        }
    }
    char tiny[PATH_MAX + 32], big[PATH_MAX + 32], store[PATH_MAX + 32];
    if (make_model("tiny", tiny, sizeof tiny)) {
        fprintf(stderr, "bench_api: cannot make the tiny model with %s/strata-mkmodel\n", bindir);
        return 1;
    }
    int status = 0;
    double mc = memcpy_gbs(256u << 20), fs = write_fsync_gbs(quick ? (64u << 20) : (256u << 20));
    printf("bench_api: strata-server on loopback, %ld CPUs; limits in this run: memcpy %.2f GB/s, "
           "write+fsync %.2f GB/s (%s)\n", sysconf(_SC_NPROCESSORS_ONLN), mc, fs, work);

    /* idle /healthz */
    st_hc_server s;
    snprintf(store, sizeof store, "%s/store-small", work);
    if (server_start(&s, tiny, store, quick ? "4" : "8", NULL, NULL)) {
        fprintf(stderr, "bench_api: strata-server did not start (see %s/server.log)\n", work);
        return 1;
    }
    poller idle;
    memset(&idle, 0, sizeof idle);
    pthread_mutex_init(&idle.all.mu, NULL);
    pthread_mutex_init(&idle.during_save.mu, NULL);
    {
        int fd = st_hc_connect(s.port, 30000);
        for (int i = 0; i < (quick ? 300 : 2000); i++) {
            st_hc_resp r;
            double t0 = st_hc_now_ms();
            if (st_hc_send_req(fd, "GET", "/healthz", NULL, NULL, 0) || st_hc_read(fd, &r))
                break;
            series_add(&idle.all, t0, st_hc_now_ms() - t0, 0);
            st_hc_resp_free(&r);
        }
        close(fd);
    }
    printf("/healthz idle (keep-alive, sequential): n=%zu p50 %.3f ms p99 %.3f ms\n", idle.all.n,
           pct(&idle.all, 50), pct(&idle.all, 99));

    /* small conversations */
    phase small;
    memset(&small, 0, sizeof small);
    small.port = s.port;
    small.clients = quick ? 4 : 8;
    small.rounds = quick ? 5 : 25;
    small.prefix = "small";
    small.prompt_chars = 200;
    run_phase(&small, NULL);
    printf("small conversations (tiny model), %d clients x %d rounds of SAVE, PARK, RESTORE:\n",
           small.clients, small.rounds);
    report(&small, fs, mc);
    if (small.failures)
        status = 1;
    st_hc_server_stop(&s, SIGTERM);

    /* large conversations */
    if (make_model("bench", big, sizeof big)) {
        fprintf(stderr, "bench_api: cannot make the bench model\n");
        return 1;
    }
    snprintf(store, sizeof store, "%s/store-large", work);
    if (server_start(&s, big, store, "2", "--prompt-cache", "1")) {
        fprintf(stderr, "bench_api: strata-server did not start (see %s/server.log)\n", work);
        return 1;
    }
    phase large;
    memset(&large, 0, sizeof large);
    large.port = s.port;
    large.clients = 2;
    large.rounds = quick ? 1 : 3;
    large.prefix = "large";
    large.prompt_chars = quick ? 100 : 300;
    poller pol;
    memset(&pol, 0, sizeof pol);
    pol.port = s.port;
    pthread_mutex_init(&pol.all.mu, NULL);
    pthread_mutex_init(&pol.during_save.mu, NULL);
    run_phase(&large, &pol);
    printf("large conversations (bench model), %d clients x %d rounds of SAVE, PARK, RESTORE:\n",
           large.clients, large.rounds);
    report(&large, fs, mc);
    double p99 = pct(&pol.during_save, 99);
    double mx = pol.during_save.n ? pol.during_save.ms[pol.during_save.n - 1] : 0;
    printf("/healthz while large SAVEs run: n=%zu p50 %.3f ms p99 %.3f ms max %.3f ms (target p99 < 10 "
           "ms: %s); over the whole large phase: n=%zu p99 %.3f ms; failed %d\n",
           pol.during_save.n, pct(&pol.during_save, 50), p99, mx, p99 < 10 ? "met" : "MISSED",
           pol.all.n, pct(&pol.all, 99), pol.failed);
    if (large.failures || pol.failed)
        status = 1;
    st_hc_server_stop(&s, SIGTERM);

    /* one large conversation at a time, on a server and store of its own: each SAVE has the
     * disk to itself (the two clients above share it) and writes new chunks */
    snprintf(store, sizeof store, "%s/store-alone", work);
    if (server_start(&s, big, store, "2", "--prompt-cache", "1")) {
        fprintf(stderr, "bench_api: strata-server did not start (see %s/server.log)\n", work);
        return 1;
    }
    static const char *const alone_names[] = {"alone-a", "alone-b", "alone-c", "alone-d", "alone-e"};
    int n_alone = quick ? 3 : 5;
    phase alone;
    memset(&alone, 0, sizeof alone);
    alone.port = s.port;
    alone.clients = 1;
    alone.rounds = 1;
    alone.prompt_chars = large.prompt_chars;
    for (int k = 0; k < n_alone; k++) {
        alone.prefix = alone_names[k];
        alone.salt = k + 1;
        run_phase(&alone, NULL);
    }
    printf("one large conversation at a time (bench model), %d conversations x 1 round of SAVE, PARK, "
           "RESTORE:\n", n_alone);
    report(&alone, fs, mc);
    if (alone.failures)
        status = 1;
    st_hc_server_stop(&s, SIGTERM);
    if (!keep) {
        char cmd[PATH_MAX + 16];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", work);
        if (system(cmd)) {
        }
    }
    return status;
}
