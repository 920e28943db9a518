/*
 * bench_tier.c - moving a conversation between nodes through the shared tier (issue 15, section
 * 4; docs/SCALE.md), against the loopback Redis throughput measured in the same run.
 *
 * It starts a Redis Cluster of 3 masters and 3 replicas on loopback (Debian's redis-server, as
 * the tests do: tests/tier/redis_cluster.h), saves a conversation shaped like Qwen3.5-0.8B's
 * state (18 recurrent layers of 16 heads of 128 x 128 f32, 6 attention layers of 2 KiB of f16
 * K/V a token: 12,288 bytes a token, about 19 MB fixed) of --tokens tokens (default 32,768) into
 * node A's store, and measures:
 *  1. the limits: one client's SET and GET of values of 1 MiB - 64 B (the tier's piece size) to
 *     one master, back to back (MB/s), one at a time (the tier's client moves 4 pieces at a
 *     time, spread over the masters: st_tier_xfer.c invariant 5, so a ratio above 1 can be);
 *  2. push (st_tier_push: the session file, its pieces, the manifest, the head, WAIT for a
 *     replica) from A's store: MB/s of the session file and x the SET rate;
 *  3. pull (st_tier_pull: pieces read and checked, the file checked and read, st_store_put into
 *     node B's store, durably): MB/s and x the GET rate; and the local part alone (st_file_read_mem
 *     + st_store_put of the same bytes into a third store), so that the tier's part is the rest;
 *  4. a second conversation that shares its first half with the first: the bytes its push writes
 *     (the pieces the tier did not have) over its file's bytes.
 * Best of --runs (default 3) for 1-3. --quick: 8,192 tokens, one run. --dir DIR: scratch (default
 * ./bench-tier.tmp), removed at the end.
 */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../tests/tier/redis_cluster.h"
#include "st_file.h"
#include "st_store.h"

#define MB 1e6

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static _Noreturn void die(const char *what, int rc)
{
    fprintf(stderr, "bench_tier: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

static st_store *store(const char *dir, const char *name)
{
    char p[1200];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    st_store_opts o;
    memset(&o, 0, sizeof o);
    o.create = 1;
    st_store *st = NULL;
    int rc = st_store_open(&st, p, &o);
    if (rc)
        die("store", rc);
    return st;
}

static st_image *conversation(uint64_t seed, uint64_t tokens, uint64_t prefix_seed, uint64_t prefix)
{
    st_synth_opts o;
    memset(&o, 0, sizeof o);
    o.seed = seed;
    o.n_layers = 24;
    o.attn_every = 4;  /* 6 attention layers, 18 recurrent */
    o.heads = 16;
    o.head_dim = 128;  /* the recurrent state 16 x 128 x 128; K/V 4 x 128 f16 = Qwen3.5's 2 x 256 */
    o.kv_heads = 4;
    o.n_ctx = (uint32_t)tokens;
    o.n_tokens = tokens;
    o.n_checkpoints = 1;
    o.prefix_seed = prefix_seed;
    o.prefix_len = prefix;
    st_image *img = NULL;
    int rc = st_image_synthesize(&o, &img);
    if (rc)
        die("synthesize", rc);
    return img;
}

/* One client's SET (set 1) or GET of n values of len bytes on the master at port, back to back:
 * MB/s. Keys {bench}:i all in one slot, on that master. */
static double redis_rate(int port, int set, const uint8_t *val, size_t len, int n)
{
    struct timeval tv = {10, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        fprintf(stderr, "bench_tier: connect :%d failed\n", port);
        exit(1);
    }
    double t0 = now();
    for (int i = 0; i < n; i++) {
        char k[32];
        snprintf(k, sizeof k, "{bench}:%d", i);
        redisReply *r = set ? redisCommand(c, "SET %s %b", k, val, len) : redisCommand(c, "GET %s", k);
        if (!r || r->type == REDIS_REPLY_ERROR || (!set && (size_t)r->len != len)) {
            fprintf(stderr, "bench_tier: %s of %s failed: %s\n", set ? "SET" : "GET", k,
                    r && r->str ? r->str : c->errstr);
            exit(1);
        }
        freeReplyObject(r);
    }
    double s = now() - t0;
    redisFree(c);
    return (double)len * n / s / MB;
}

int main(int argc, char **argv)
{
    uint64_t tokens = 32768;
    int runs = 3;
    const char *dir = "bench-tier.tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            tokens = 8192;
            runs = 1;
        } else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
            tokens = strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--dir") && i + 1 < argc) {
            dir = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_tier [--quick] [--tokens N] [--runs N] [--dir DIR]\n");
            return 2;
        }
    }
    if (tokens < 1024 || runs < 1) {
        fprintf(stderr, "bench_tier: --tokens >= 1024, --runs >= 1\n");
        return 2;
    }
    char cmd[1300];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", dir, dir);
    if (system(cmd) != 0)
        return 1;
    char cdir[1000];
    snprintf(cdir, sizeof cdir, "%.900s/cluster", dir);
    rc_cluster rc;
    if (rc_start(&rc, cdir, 6, 1, 1)) {
        fprintf(stderr, "bench_tier: no Redis Cluster (make deps installs redis-server)\n");
        return 1;
    }
    char url[512];
    rc_url(&rc, 2, url, sizeof url);
    st_tier *t = NULL;
    int e = st_tier_open(&t, url, NULL);
    if (e)
        die("tier", e);
    printf("bench_tier: a Redis Cluster of 3 masters and 3 replicas on loopback; a Qwen3.5-0.8B-"
           "shaped conversation of %llu tokens; best of %d\n", (unsigned long long)tokens, runs);

    /* 1. the limits */
    size_t vl = ST_TIER_PIECE_MAX;
    uint8_t *val = malloc(vl);
    if (!val)
        return 1;
    for (size_t i = 0; i < vl; i++)
        val[i] = (uint8_t)(i * 2654435761u >> 13);
    int master = rc_master_of(&rc, st_tier_key_slot("{bench}:0", 9));
    int nv = 256;
    double set_r = 0, get_r = 0;
    for (int r = 0; r < runs; r++) {
        double s = redis_rate(rc.port[master], 1, val, vl, nv), g = redis_rate(rc.port[master], 0, val, vl, nv);
        set_r = s > set_r ? s : set_r;
        get_r = g > get_r ? g : get_r;
    }
    free(val);
    printf("limits: one client, values of %u bytes: SET %.0f MB/s, GET %.0f MB/s\n",
           (unsigned)vl, set_r, get_r);

    /* 2. push */
    st_store *a = store(dir, "a"), *b = store(dir, "b"), *c = store(dir, "c");
    st_image *img = conversation(1, tokens, 0, 0);
    if ((e = st_store_put(a, "conv", img, ST_STORE_HEAD_ANY, NULL, NULL)))
        die("put", e);
    double push_best = 1e30, pull_best = 1e30, local_best = 1e30;
    st_tier_xfer_stats xs;
    memset(&xs, 0, sizeof xs);
    uint64_t fbytes = 0;
    for (int r = 0; r < runs; r++) {
        char id[32];
        snprintf(id, sizeof id, "conv-%d", r);
        /* a fresh id and fresh bytes each run (another seed), so every piece is written */
        st_image *ir = conversation(100 + (uint64_t)r, tokens, 0, 0);
        if ((e = st_store_put(a, id, ir, ST_STORE_HEAD_ANY, NULL, NULL)))
            die("put", e);
        st_image_free(ir);
        double t0 = now();
        if ((e = st_tier_push(t, a, id, 0, 0, 1, 5000, &xs)))
            die("push", e);
        double t1 = now();
        st_tier_xfer_stats ps;
        if ((e = st_tier_pull(t, b, id, 0, 0, &ps)))
            die("pull", e);
        double t2 = now();
        fbytes = xs.bytes;
        push_best = t1 - t0 < push_best ? t1 - t0 : push_best;
        pull_best = t2 - t1 < pull_best ? t2 - t1 : pull_best;
        /* the local part alone: the same file read and put into store c */
        uint8_t *buf = NULL;
        size_t bl = 0;
        st_image *gi = NULL, *ri = NULL;
        if ((e = st_store_get(a, id, 0, &gi)))
            die("get", e);
        st_file_write_opts fo;
        memset(&fo, 0, sizeof fo);
        fo.version = 2;
        if ((e = st_file_write_mem(gi, &fo, &buf, &bl)))
            die("file", e);
        st_image_free(gi);
        double t3 = now();
        if ((e = st_file_read_mem(buf, bl, NULL, &ri)) ||
            (e = st_store_put(c, id, ri, ST_STORE_HEAD_ANY, NULL, NULL)))
            die("local", e);
        double t4 = now();
        local_best = t4 - t3 < local_best ? t4 - t3 : local_best;
        st_image_free(ri);
        free(buf);
    }
    double fmb = (double)fbytes / MB;
    printf("push (pieces + manifest + head + WAIT 1 replica): %.1f MB in %u pieces, %.3f s: %.0f "
           "MB/s, %.2fx the SET rate\n", fmb, xs.pieces, push_best, fmb / push_best,
           fmb / push_best / set_r);
    printf("pull into another node's store (read, checked, put durably): %.3f s: %.0f MB/s, %.2fx "
           "the GET rate\n", pull_best, fmb / pull_best, fmb / pull_best / get_r);
    printf("  of which the local part (st_file_read_mem + st_store_put): %.3f s; the tier's part "
           "%.3f s: %.0f MB/s, %.2fx the GET rate\n", local_best, pull_best - local_best,
           fmb / (pull_best - local_best), fmb / (pull_best - local_best) / get_r);

    /* 4. a conversation sharing its first half */
    st_image *half = conversation(2, tokens, 1, tokens / 2);
    if ((e = st_store_put(a, "conv-half", half, ST_STORE_HEAD_ANY, NULL, NULL)))
        die("put", e);
    st_tier_xfer_stats hs;
    if ((e = st_tier_push(t, a, "conv", 0, 0, 1, 5000, NULL)) ||
        (e = st_tier_push(t, a, "conv-half", 0, 0, 1, 5000, &hs)))
        die("push", e);
    printf("shared half: the second conversation's push wrote %.1f of %.1f MB (%u of %u pieces): "
           "%.2f of its bytes\n", (double)hs.new_bytes / MB, (double)hs.bytes / MB, hs.new_pieces,
           hs.pieces, (double)hs.new_bytes / (double)hs.bytes);
    st_image_free(img);
    st_image_free(half);
    st_store_close(a);
    st_store_close(b);
    st_store_close(c);
    st_tier_close(t);
    rc_stop(&rc);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    return system(cmd) != 0;
}
