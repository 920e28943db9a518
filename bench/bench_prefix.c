/*
 * bench_prefix - time to first token of a new chat on node B that shares a long system prompt
 * first read on node A, with the prefix index (the point fetched from the shared tier) against a
 * full read of the same request on a node without the index, measured in the same run (issue 15
 * section 4; docs/BENCHMARKS.md, "The prefix index").
 *
 *   bench_prefix [--quick] [--tokens N] [--preset NAME] [--runs N] [--dir DIR]
 *
 * It starts a Redis Cluster of 3 masters and 3 replicas (Debian's redis-server) and three
 * strata-server processes (found next to it: BUILD/tools) on loopback: A and B with --tier and
 * --prefix-index-mib, R with neither. The model is strata-mkmodel's preset (default `small`, the
 * byte tokenizer: a system prompt of N bytes is N tokens) with a context of N + 2048. Each run:
 * A reads a new system prompt of N tokens and a question (its point copied out of the slot; the
 * recorder then stores it and sends it to the tier, awaited and timed); R answers another question after that system prompt by a full read; B answers the same
 * request from the index. The first token is the reply (n_predict 1), so TTFT is the request's
 * wall time on the client. B's tokens must be R's (the run fails otherwise). Then A's and R's
 * conversations are PARKed; every node's RAM ceiling is 0, so a PARK spills: to A's store and
 * the tier (st_conv.c invariant 11), to R's store alone; the two times side by side.
 */
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../tests/api/st_http_client.h"
#include "../tests/tier/redis_cluster.h"

static char bindir[PATH_MAX];
static double g_record_ms; /* the last reply's timings.record_ms */
static char work[PATH_MAX];

static _Noreturn void die(const char *what)
{
    fprintf(stderr, "bench_prefix: %s\n", what);
    exit(1);
}

static int start(st_hc_server *s, const char *model, const char *store, const char *ctx,
                 const char *url, const char *node)
{
    char bin[PATH_MAX + 32], logp[PATH_MAX + 32], sp[PATH_MAX + 64];
    snprintf(bin, sizeof bin, "%s/strata-server", bindir);
    snprintf(logp, sizeof logp, "%s/server.log", work);
    snprintf(sp, sizeof sp, "%s/%s", work, store);
    const char *args[32];
    int n = 0;
    const char *base[] = {"--store", sp, "--model", model, "--ctx", ctx, "--slots", "2",
                          "--prompt-cache-root", "1024", "--backend", "cpu",
                          "--conversation-cache-mib", "0"}; /* a PARK spills at once */
    for (size_t i = 0; i < sizeof base / sizeof *base; i++)
        args[n++] = base[i];
    if (url) {
        const char *more[] = {"--tier", url, "--node-id", node, "--prefix-index-mib", "4096"};
        for (size_t i = 0; i < sizeof more / sizeof *more; i++)
            args[n++] = more[i];
    }
    args[n] = NULL;
    return st_hc_server_start(s, bin, work, logp, (const char *const *)args);
}

/* A completion of one token for a new session: system (n bytes of it) and a question. The
 * request's wall time in *ms; the reply's found, resumed tokens and token into the outputs. */
static void ask(uint16_t port, const char *session, const char *sys, const char *q, double *ms,
                char *found, size_t fcap, long long *resumed, long long *token)
{
    size_t cap = strlen(sys) + 512;
    char *body = malloc(cap);
    if (!body)
        die("no memory");
    snprintf(body, cap,
             "{\"session\":\"%s\",\"system\":\"%s\",\"prompt\":\"%s\",\"n_predict\":1,"
             "\"temperature\":0,\"ignore_eos\":true}",
             session, sys, q);
    st_hc_resp r;
    double t0 = st_hc_now_ms();
    if (st_hc_json(port, "POST", "/v1/completions", body, &r) || r.status != 200) {
        fprintf(stderr, "bench_prefix: %s: %d %s\n", session, r.status, r.body ? (char *)r.body : "");
        die("a completion failed");
    }
    *ms = st_hc_now_ms() - t0;
    const char *b = (const char *)r.body, *f = strstr(b, "\"found\":\""), *rt = strstr(b, "\"resumed_tokens\":"),
               *tk = strstr(b, "\"tokens\":[");
    found[0] = '\0';
    if (f)
        sscanf(f + 9, "%31[^\"]", found);
    (void)fcap;
    const char *rm = strstr(b, "\"record_ms\":");
    g_record_ms = rm ? atof(rm + 12) : -1;
    *resumed = rt ? atoll(rt + 17) : -1;
    *token = tk ? atoll(tk + 10) : -1;
    st_hc_resp_free(&r);
    free(body);
}

/* PARK of session on port (its RAM ceiling 0: spilled to the store, and with --tier to the
 * tier): the request's wall time; *bytes the image's. */
static double park(uint16_t port, const char *session, long long *bytes)
{
    char path[96];
    snprintf(path, sizeof path, "/v1/sessions/%s/park", session);
    st_hc_resp r;
    double t0 = st_hc_now_ms();
    if (st_hc_json(port, "POST", path, "{}", &r) || r.status != 200) {
        fprintf(stderr, "bench_prefix: PARK %s: %d %s\n", session, r.status,
                r.body ? (char *)r.body : "");
        die("a PARK failed");
    }
    double ms = st_hc_now_ms() - t0;
    const char *b = strstr((const char *)r.body, "\"bytes\":");
    *bytes = b ? atoll(b + 8) : -1;
    if (!strstr((const char *)r.body, "\"where\":\"disk\""))
        die("a PARK did not spill to the store");
    st_hc_resp_free(&r);
    return ms;
}

/* A counter of node port's /metrics (-1 when absent). */
static double metric(uint16_t port, const char *name)
{
    st_hc_resp r;
    if (st_hc_request(port, "GET", "/metrics", NULL, NULL, 0, &r) || r.status != 200)
        die("GET /metrics failed");
    char k[160];
    snprintf(k, sizeof k, "\n%s ", name);
    const char *g = strstr((const char *)r.body, k);
    double v = g ? atof(g + strlen(k)) : -1;
    st_hc_resp_free(&r);
    return v;
}

/* Waits until node port's recorder has put every point it queued (its gauge
 * strata_prefix_record_queue reads 0); the milliseconds waited. */
static double await_recorded(uint16_t port)
{
    double t0 = st_hc_now_ms();
    for (;;) {
        st_hc_resp r;
        if (st_hc_request(port, "GET", "/metrics", NULL, NULL, 0, &r) || r.status != 200)
            die("GET /metrics failed");
        const char *g = strstr((const char *)r.body, "\nstrata_prefix_record_queue ");
        int idle = g && atof(g + 29) == 0.0;
        st_hc_resp_free(&r);
        if (!g)
            die("no strata_prefix_record_queue in /metrics");
        if (idle)
            return st_hc_now_ms() - t0;
        if (st_hc_now_ms() - t0 > 600000)
            die("the recorder did not finish in 10 minutes");
        usleep(2000);
    }
}

int main(int argc, char **argv)
{
    long tokens = 16384;
    int runs = 2;
    const char *preset = "small", *dir = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            tokens = 4096;
            runs = 1;
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            tokens = atol(argv[++i]);
        } else if (!strcmp(argv[i], "--preset") && i + 1 < argc) {
            preset = argv[++i];
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--dir") && i + 1 < argc) {
            dir = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_prefix [--quick] [--tokens N] [--preset NAME] [--runs N] "
                            "[--dir DIR]\n");
            return 2;
        }
    }
    if (tokens < 2048 || tokens > 1000000 || runs < 1)
        die("--tokens 2048..1000000, --runs >= 1");
    char self[PATH_MAX];
    snprintf(self, sizeof self, "%s", argv[0]);
    char *slash = strrchr(self, '/');
    snprintf(bindir, sizeof bindir, "%.*s/../tools", slash ? (int)(slash - self) : 1, slash ? self : ".");
    if (dir)
        snprintf(work, sizeof work, "%s", dir);
    else
        snprintf(work, sizeof work, "%s/bench_prefix.%d", getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp",
                 (int)getpid());
    mkdir(work, 0755);
    char model[PATH_MAX + 32], cmd[3 * PATH_MAX], ctx[32], cdir[1000];
    snprintf(model, sizeof model, "%s/%s.gguf", work, preset);
    snprintf(ctx, sizeof ctx, "%ld", tokens + 2048);
    snprintf(cmd, sizeof cmd, "'%s/strata-mkmodel' --preset %s --ctx %s -o '%s' >/dev/null 2>&1", bindir,
             preset, ctx, model);
    if (system(cmd))
        die("strata-mkmodel failed");
    snprintf(cdir, sizeof cdir, "%.900s/cluster", work); /* rc_cluster keeps 1024 bytes */
    rc_cluster rc;
    if (rc_start(&rc, cdir, 6, 1, 1))
        die("the Redis Cluster did not start");
    char url[512];
    rc_url(&rc, 2, url, sizeof url);
    st_hc_server a, b, r;
    if (start(&a, model, "store-a", ctx, url, "node-a") || start(&b, model, "store-b", ctx, url, "node-b") ||
        start(&r, model, "store-r", ctx, NULL, NULL))
        die("strata-server did not start");
    printf("bench_prefix: model %s, system prompt %ld tokens, %d run(s); loopback cluster 3+3\n", preset,
           tokens, runs);
    char *sys = malloc((size_t)tokens + 1);
    if (!sys)
        die("no memory");
    double sum_full = 0, sum_idx = 0, sum_rec = 0, sum_land = 0, sum_copy = 0, sum_pk_a = 0, sum_pk_r = 0;
    int failures = 0;
    for (int run = 0; run < runs; run++) {
        for (long i = 0; i < tokens; i++) /* a new system prompt each run: no point is shared */
            sys[i] = (char)('a' + (i * 7 + run * 13 + i / 97) % 26);
        sys[0] = (char)('A' + run % 26);
        sys[tokens - 1] = '.';
        sys[tokens] = '\0';
        char sa[32], sb[32], srr[32], found[32];
        snprintf(sa, sizeof sa, "a%d", run);
        snprintf(sb, sizeof sb, "b%d", run);
        snprintf(srr, sizeof srr, "r%d", run);
        double ms_a, ms_r, ms_b;
        long long res_a, res_r, res_b, tok_a, tok_r, tok_b;
        ask(a.port, sa, sys, "What did the first user ask?", &ms_a, found, sizeof found, &res_a, &tok_a);
        double rec_a = g_record_ms, ms_land = await_recorded(a.port); /* in A's store and the tier */
        ask(r.port, srr, sys, "And what does the second ask?", &ms_r, found, sizeof found, &res_r, &tok_r);
        ask(b.port, sb, sys, "And what does the second ask?", &ms_b, found, sizeof found, &res_b, &tok_b);
        int ok = !strcmp(found, "index") && tok_b == tok_r;
        failures += !ok;
        printf("run %d: A (first read, point copied in %.1f ms) %.0f ms, the point stored and sent %.0f "
               "ms after A's answer; R full read %.0f ms; B from the "
               "index %.0f ms (found %s, %lld tokens resumed) = %.3fx the full read's TTFT, %.1fx faster; "
               "first token %s\n",
               run + 1, rec_a, ms_a, ms_land, ms_r, ms_b, found, res_b, ms_b / ms_r, ms_r / ms_b,
               tok_b == tok_r ? "the full read's" : "DIFFERENT");
        /* PARK at the RAM ceiling: A's conversation spills to its store and the tier, R's to
         * its store only */
        long long by_a = 0, by_r = 0;
        double pk_a = park(a.port, sa, &by_a), pk_r = park(r.port, srr, &by_r);
        printf("run %d: PARK of the %lld-byte image: A (store + tier) %.0f ms, R (store) %.0f ms: "
               "%.2fx; the tier's part %.0f ms\n", run + 1, by_a, pk_a, pk_r, pk_a / pk_r,
               pk_a - pk_r);
        sum_pk_a += pk_a;
        sum_pk_r += pk_r;
        sum_full += ms_r;
        sum_idx += ms_b;
        sum_rec += ms_a - ms_r;
        sum_land += ms_land;
        sum_copy += rec_a;
    }
    printf("TTFT with the index %.0f ms vs full read %.0f ms: %.3fx (%.1fx faster); recording on A: "
           "the copy %.1f ms on its worker = %.4fx of A's request (A %.0f ms over R's full read, "
           "noise), the point stored and sent in the background %.0f ms after A's answer\n",
           sum_idx / runs, sum_full / runs, sum_idx / sum_full, sum_full / sum_idx, sum_copy / runs,
           sum_copy / (sum_full + sum_rec), sum_rec / runs, sum_land / runs);
    printf("PARK at the RAM ceiling: %.0f ms with the tier vs %.0f ms to the store alone: %.2fx "
           "(%.0f parks pushed to the tier)\n", sum_pk_a / runs, sum_pk_r / runs,
           sum_pk_a / sum_pk_r, metric(a.port, "strata_tier_park_pushes_total"));
    if (metric(a.port, "strata_tier_park_pushes_total") != runs)
        die("A did not push every PARK to the tier");
    free(sys);
    st_hc_server_stop(&a, SIGTERM);
    st_hc_server_stop(&b, SIGTERM);
    st_hc_server_stop(&r, SIGTERM);
    rc_stop(&rc);
    if (!dir) {
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", work);
        if (system(cmd))
            fprintf(stderr, "bench_prefix: could not remove %s\n", work);
    }
    return failures ? 1 : 0;
}
