/*
 * bench_store.c - the LMDB state store against the machine's own limits, measured in the same run.
 *
 *  1. Durable SAVE: st_store_put of a 1 GiB image (--size-mib) into a fresh store, synced commit,
 *     against writing the same payload bytes (the image's token, K/V, checkpoint and logits
 *     buffers, in order) to a plain file with write() and fsync(). "x write+fsync" = baseline
 *     time / put time. Best of --runs (default 3); baseline and put alternate so that a slow
 *     moment of the disk hits both. Also with zstd level 1, for information. And st_file_write of
 *     the same image to a session file (temp file, fsync, rename, directory fsync; every section
 *     XXH3-checksummed), against the same baseline, in the same alternation.
 *  2. GET from a warm store (the image was read once before timing): st_store_get, every chunk
 *     copied out and checked against its XXH3, against memcpy of the same payload parts into
 *     freshly allocated buffers of the same sizes (get must allocate its image too, and the
 *     allocator then treats both alike) and into buffers already faulted in (the stricter
 *     limit). Best of --runs.
 *  3. Dedup: --convs conversations (default 100) sharing a 4,096-token prefix, each with its own
 *     256..1,024 further tokens and its own checkpoints. "unique bytes" = the payload with the
 *     prefix counted once; the figure is the store's chunk bytes / unique bytes (and the data
 *     file / unique bytes, for information).
 *  4. Churn: --cycles save/delete cycles (default 1,000) of images from 0.3 to 9 MiB over 8
 *     sessions (keep last 2; every 10th cycle deletes a whole session); the figure is the size of
 *     data.mdb / the live data (bytes of the chunks the remaining versions reference).
 *
 * --quick: 256 MiB image, 20 conversations, 200 cycles. --dir DIR: where stores and files go
 * (default ./bench-store.tmp; give a directory on the disk you care about). Removed at the end.
 * --only save,dedup,churn picks sections (save includes get).
 *
 * Page faults: get fills a newly allocated image, so on a machine where a page fault is
 * expensive (virtual machines) GET time, and its memcpy limit, are mostly first-touch faults.
 * SAVE writes through LMDB's writable map into pages populated in one call (docs/STORE.md,
 * "Writing"), so it no longer depends on the allocator; the GLIBC_TUNABLES in effect is printed.
 * "data.mdb" sizes are the bytes the file occupies on disk (st_store_stats.file_bytes).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "st_file.h"
#include "st_store.h"

#define MIB (1024.0 * 1024.0)

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static _Noreturn void die(const char *what, int rc)
{
    fprintf(stderr, "bench_store: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

static void sh(const char *fmt, const char *a)
{
    char cmd[8600];
    int k = snprintf(cmd, sizeof cmd, fmt, a, a);
    if (k < 0 || (size_t)k >= sizeof cmd || system(cmd) != 0) {
        fprintf(stderr, "bench_store: `%s` failed\n", cmd);
        exit(1);
    }
}

/* ---- the image's payload as a list of buffers ----------------------------------------------------- */

typedef struct part {
    const void *p;
    size_t n;
} part;

static part *payload(const st_image *img, size_t *np, uint64_t *total)
{
    const st_geometry *g = st_image_geometry(img);
    size_t cap = 2 + g->n_tensors * (1 + st_image_n_checkpoints(img)), n = 0;
    part *ps = calloc(cap, sizeof *ps);
    *total = 0;
    ps[n++] = (part){st_image_tokens(img), st_image_n_tokens(img) * 4};
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        uint64_t len = 0;
        if (g->tensors[ti].role == ST_ROLE_KV) {
            const void *p = st_image_kv_const(img, ti, &len);
            ps[n++] = (part){p, len};
        }
    }
    for (uint32_t c = 0; c < st_image_n_checkpoints(img); c++)
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            uint64_t len = 0;
            if (g->tensors[ti].role == ST_ROLE_RUNNING) {
                const void *p = st_image_checkpoint_tensor_const(img, c, ti, &len);
                ps[n++] = (part){p, len};
            }
        }
    uint32_t nl = 0;
    const float *l = st_image_logits(img, &nl);
    ps[n++] = (part){l, (size_t)nl * 4};
    for (size_t i = 0; i < n; i++)
        *total += ps[i].n;
    *np = n;
    return ps;
}

static double write_fsync(const char *path, const part *ps, size_t np)
{
    double t0 = now();
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd < 0)
        die("open baseline file", errno);
    for (size_t i = 0; i < np; i++) {
        const char *p = ps[i].p;
        size_t n = ps[i].n;
        while (n) {
            ssize_t w = write(fd, p, n);
            if (w <= 0)
                die("write baseline file", errno);
            p += w;
            n -= (size_t)w;
        }
    }
    if (fsync(fd) != 0)
        die("fsync baseline file", errno);
    close(fd);
    double t = now() - t0;
    unlink(path);
    return t;
}

/* ---- 1 and 2: SAVE and GET of one big image ------------------------------------------------------- */

static void bench_save_get(const char *dir, uint64_t size_mib, int runs)
{
    /* 16 K/V tensors of 2 KiB rows: size_mib MiB of K/V is size_mib * 32 tokens; 24 recurrent
     * layers of 8 x 128 x 128 f32 (12 MiB per checkpoint), 2 checkpoints */
    uint32_t n_tok = (uint32_t)(size_mib * 32);
    st_synth_opts so = {.seed = 1, .n_layers = 32, .attn_every = 4, .heads = 8, .head_dim = 128, .kv_heads = 8,
                        .n_ctx = n_tok, .page_size = 256, .n_vocab = 32000, .n_tokens = n_tok, .n_checkpoints = 2};
    st_image *img = NULL;
    printf("building a synthetic image of %u tokens ...\n", n_tok);
    fflush(stdout);
    int rc = st_image_synthesize(&so, &img);
    if (rc)
        die("synthesize", rc);
    st_image *img2 = NULL; /* another conversation of that size, for a store that holds one */
    so.seed = 2;
    if ((rc = st_image_synthesize(&so, &img2)))
        die("synthesize", rc);
    size_t np;
    uint64_t total;
    part *ps = payload(img, &np, &total);
    char path[4200], sdir[4200];
    snprintf(path, sizeof path, "%s/baseline.bin", dir);
    char fpath[4200];
    snprintf(fpath, sizeof fpath, "%s/session.stf", dir);
    double best_base = 1e30, best_put = 1e30, best_put2 = 1e30, best_put_z = 1e30, best_file = 1e30;
    uint64_t stored_z = 0;
    for (int r = 0; r < runs; r++) {
        double tb = write_fsync(path, ps, np);
        if (tb < best_base)
            best_base = tb;
        for (int z = 0; z < 2; z++) {
            snprintf(sdir, sizeof sdir, "%s/save%d", dir, z);
            sh("rm -rf '%s' && mkdir -p '%s'", sdir);
            st_store *st = NULL;
            if ((rc = st_store_open(&st, sdir, &(st_store_opts){.create = 1})))
                die("open", rc);
            st_put_stats ps2;
            st_put_opts po = {.compress = z, .stats = &ps2};
            double t0 = now();
            if ((rc = st_store_put(st, "big", img, 0, &po, NULL)))
                die("put", rc);
            double t = now() - t0;
            if (z == 0 && t < best_put)
                best_put = t;
            if (z == 0) {
                t0 = now();
                if ((rc = st_store_put(st, "second", img2, 0, &po, NULL)))
                    die("put", rc);
                t = now() - t0;
                if (t < best_put2)
                    best_put2 = t;
            }
            if (z == 1 && t < best_put_z) {
                best_put_z = t;
                stored_z = ps2.stored_bytes;
            }
            st_store_close(st);
        }
        double t0 = now();
        if ((rc = st_file_write(img, fpath, NULL)))
            die("file write", rc);
        double tf = now() - t0;
        if (tf < best_file)
            best_file = tf;
        unlink(fpath);
    }
    printf("\n1. Durable SAVE of a %.0f MiB image (payload %.1f MiB), best of %d\n", (double)total / MIB,
           (double)total / MIB, runs);
    printf("%-34s %9s %9s %14s\n", "", "seconds", "MB/s", "x write+fsync");
    printf("%-34s %9.3f %9.0f %14s\n", "write+fsync of the payload (limit)", best_base, total / best_base / 1e6, "1.00");
    printf("%-34s %9.3f %9.0f %14.2f\n", "st_store_put, raw chunks", best_put, total / best_put / 1e6,
           best_base / best_put);
    printf("%-34s %9.3f %9.0f %14.2f\n", "st_store_put, a second conversation", best_put2, total / best_put2 / 1e6,
           best_base / best_put2);
    printf("%-34s %9.3f %9.0f %14.2f   (stored %.1f MiB, ratio %.3f)\n", "st_store_put, zstd level 1", best_put_z,
           total / best_put_z / 1e6, best_base / best_put_z, (double)stored_z / MIB, (double)total / (double)stored_z);
    printf("%-34s %9.3f %9.0f %14.2f\n", "st_file_write, session file", best_file, total / best_file / 1e6,
           best_base / best_file);

    /* GET from the warm raw store */
    snprintf(sdir, sizeof sdir, "%s/save0", dir);
    st_store *st = NULL;
    if ((rc = st_store_open(&st, sdir, NULL)))
        die("open", rc);
    st_image *got = NULL;
    if ((rc = st_store_get(st, "big", 0, &got)))
        die("get", rc);
    st_image_free(got);
    double best_get = 1e30, best_cpy_fresh = 1e30, best_cpy_warm = 1e30;
    /* the limits: copies of the same parts into buffers of the same sizes, freshly allocated
     * (as get's image is, so the allocator treats both alike) and already faulted in */
    uint8_t **warm = calloc(np, sizeof *warm), **fresh = calloc(np, sizeof *fresh);
    for (size_t i = 0; i < np; i++) {
        warm[i] = malloc(ps[i].n ? ps[i].n : 1);
        memset(warm[i], 1, ps[i].n);
    }
    for (int r = 0; r < runs; r++) {
        double t0 = now();
        for (size_t i = 0; i < np; i++) {
            fresh[i] = malloc(ps[i].n ? ps[i].n : 1);
            memcpy(fresh[i], ps[i].p, ps[i].n);
        }
        double t1 = now();
        for (size_t i = 0; i < np; i++)
            memcpy(warm[i], ps[i].p, ps[i].n);
        double t2 = now();
        for (size_t i = 0; i < np; i++)
            free(fresh[i]);
        double t3 = now();
        if ((rc = st_store_get(st, "big", 0, &got)))
            die("get", rc);
        double t4 = now();
        st_image_free(got);
        if (t1 - t0 < best_cpy_fresh)
            best_cpy_fresh = t1 - t0;
        if (t2 - t1 < best_cpy_warm)
            best_cpy_warm = t2 - t1;
        if (t4 - t3 < best_get)
            best_get = t4 - t3;
    }
    for (size_t i = 0; i < np; i++)
        free(warm[i]);
    free(fresh);
    free(warm);
    st_store_close(st);
    printf("\n2. GET of it from a warm store, best of %d\n", runs);
    printf("%-34s %9s %9s %14s %14s\n", "", "seconds", "MB/s", "x memcpy", "x memcpy warm");
    printf("%-34s %9.3f %9.0f %14s %14.2f\n", "memcpy into new buffers (limit)", best_cpy_fresh,
           total / best_cpy_fresh / 1e6, "1.00", best_cpy_warm / best_cpy_fresh);
    printf("%-34s %9.3f %9.0f %14.2f %14s\n", "memcpy into faulted-in buffers", best_cpy_warm,
           total / best_cpy_warm / 1e6, best_cpy_fresh / best_cpy_warm, "1.00");
    printf("%-34s %9.3f %9.0f %14.2f %14.2f\n", "st_store_get (XXH3-checked)", best_get, total / best_get / 1e6,
           best_cpy_fresh / best_get, best_cpy_warm / best_get);
    free(ps);
    st_image_free(img);
    st_image_free(img2);
    snprintf(sdir, sizeof sdir, "%s/save0", dir);
    sh("rm -rf '%s' '%s'", sdir);
    snprintf(sdir, sizeof sdir, "%s/save1", dir);
    sh("rm -rf '%s' '%s'", sdir);
}

/* ---- 3: dedup of a shared prefix ------------------------------------------------------------------ */

static st_synth_opts conv_opts(uint64_t seed, uint64_t n_tokens, uint64_t prefix)
{
    st_synth_opts so = {.seed = seed, .n_layers = 8, .attn_every = 4, .heads = 4, .head_dim = 64, .kv_heads = 8,
                        .n_ctx = 8192, .page_size = 256, .n_vocab = 32000, .n_tokens = n_tokens,
                        .n_checkpoints = 2, .prefix_seed = 4242, .prefix_len = prefix};
    return so;
}

static void bench_dedup(const char *dir, int convs)
{
    char sdir[4200];
    snprintf(sdir, sizeof sdir, "%s/dedup", dir);
    sh("rm -rf '%s' && mkdir -p '%s'", sdir);
    st_store *st = NULL;
    int rc = st_store_open(&st, sdir, &(st_store_opts){.create = 1});
    if (rc)
        die("open", rc);
    const uint64_t prefix = 4096;
    uint64_t logical = 0, prefix_bytes = 0;
    srand(7);
    for (int i = 0; i < convs; i++) {
        st_synth_opts so = conv_opts(1000 + (uint64_t)i, prefix + 256 + (uint64_t)(rand() % 769), prefix);
        so.n_checkpoints = 1; /* the live state, past the prefix: every conversation's own */
        st_image *img = NULL;
        if ((rc = st_image_synthesize(&so, &img)))
            die("synthesize", rc);
        if (i == 0) {
            const st_geometry *g = st_image_geometry(img);
            prefix_bytes = prefix * 4;
            for (uint32_t ti = 0; ti < g->n_tensors; ti++)
                if (g->tensors[ti].role == ST_ROLE_KV)
                    prefix_bytes += prefix * st_tensor_row_bytes(&g->tensors[ti]);
        }
        logical += st_image_bytes(img);
        char id[32];
        snprintf(id, sizeof id, "conv-%03d", i);
        if ((rc = st_store_put(st, id, img, 0, NULL, NULL)))
            die("put", rc);
        st_image_free(img);
    }
    st_store_stats s;
    if ((rc = st_store_stat(st, &s)))
        die("stat", rc);
    st_store_close(st);
    uint64_t unique = logical - (uint64_t)(convs - 1) * prefix_bytes;
    printf("\n3. %d conversations sharing a 4,096-token prefix (%.1f MiB of K/V and tokens), each 256..1,024 more\n",
           convs, (double)prefix_bytes / MIB);
    printf("%-34s %12s %14s\n", "", "MiB", "x unique");
    printf("%-34s %12.1f %14s\n", "logical (every image in full)", (double)logical / MIB, "");
    printf("%-34s %12.1f %14s\n", "unique (prefix once; the limit)", (double)unique / MIB, "1.000");
    printf("%-34s %12.1f %14.3f\n", "stored chunk bytes", (double)s.stored_bytes / MIB,
           (double)s.stored_bytes / (double)unique);
    printf("%-34s %12.1f %14.3f   (LMDB pages in use: %.1f MiB)\n", "data.mdb", (double)s.file_bytes / MIB,
           (double)s.file_bytes / (double)unique, (double)s.pages_used * s.page_size / MIB);
    sh("rm -rf '%s' '%s'", sdir);
}

/* ---- 4: churn --------------------------------------------------------------------------------- */

static void bench_churn(const char *dir, int cycles)
{
    char sdir[4200];
    snprintf(sdir, sizeof sdir, "%s/churn", dir);
    sh("rm -rf '%s' && mkdir -p '%s'", sdir);
    st_store *st = NULL;
    int rc = st_store_open(&st, sdir, &(st_store_opts){.create = 1, .keep_last = 2});
    if (rc)
        die("open", rc);
    srand(11);
    uint64_t written = 0, max_file = 0;
    double t0 = now();
    for (int c = 0; c < cycles; c++) {
        char id[16];
        snprintf(id, sizeof id, "s%d", rand() % 8);
        if (c % 10 == 9) {
            rc = st_store_session_delete(st, id);
            if (rc && rc != ST_ENOTFOUND)
                die("delete", rc);
            continue;
        }
        uint64_t n = 64 + (uint64_t)(rand() % 1985);
        st_synth_opts so = {.seed = (uint64_t)c * 31 + 5, .n_layers = 8, .attn_every = 4, .heads = 2, .head_dim = 64,
                            .kv_heads = 4, .n_ctx = 4096, .page_size = 256, .n_vocab = 32000, .n_tokens = n,
                            .n_checkpoints = 1 + (uint32_t)(rand() % 2), .prefix_seed = 99,
                            .prefix_len = (uint64_t)(rand() % 2) * n / 2};
        st_image *img = NULL;
        if ((rc = st_image_synthesize(&so, &img)))
            die("synthesize", rc);
        written += st_image_bytes(img);
        if ((rc = st_store_put(st, id, img, 0, NULL, NULL)))
            die("put", rc);
        st_image_free(img);
        if (c % 50 == 0) {
            st_store_stats s;
            if (!st_store_stat(st, &s) && s.file_bytes > max_file)
                max_file = s.file_bytes;
        }
    }
    double t = now() - t0;
    st_store_stats s;
    if ((rc = st_store_stat(st, &s)))
        die("stat", rc);
    st_check_result res;
    if ((rc = st_store_check(st, 0, NULL, NULL, &res)) || res.problems)
        die("check after churn", rc ? rc : ST_ECORRUPT);
    st_store_close(st);
    printf("\n4. %d save/delete cycles, images of 0.3..9 MiB over 8 sessions (keep last 2), %.1f s, %.0f MiB saved\n",
           cycles, t, (double)written / MIB);
    printf("%-34s %12s %14s\n", "", "MiB", "x live");
    printf("%-34s %12.1f %14s\n", "live data (chunks referenced)", (double)s.stored_bytes / MIB, "1.000");
    printf("%-34s %12.1f %14.3f\n", "data.mdb at the end", (double)s.file_bytes / MIB,
           (double)s.file_bytes / (double)s.stored_bytes);
    printf("%-34s %12.1f %14s   (%llu pages free for reuse)\n", "data.mdb, largest seen", (double)max_file / MIB, "",
           (unsigned long long)s.pages_free);
    sh("rm -rf '%s' '%s'", sdir);
}

int main(int argc, char **argv)
{
    uint64_t size_mib = 1024;
    int runs = 3, convs = 100, cycles = 1000;
    const char *dir = "bench-store.tmp", *only = "save,dedup,churn";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick")) {
            size_mib = 256;
            convs = 20;
            cycles = 200;
        } else if (!strcmp(argv[i], "--size-mib") && i + 1 < argc) {
            size_mib = strtoull(argv[++i], NULL, 10);
        } else if (!strcmp(argv[i], "--runs") && i + 1 < argc) {
            runs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--convs") && i + 1 < argc) {
            convs = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--cycles") && i + 1 < argc) {
            cycles = atoi(argv[++i]);
        } else if (!strcmp(argv[i], "--dir") && i + 1 < argc) {
            dir = argv[++i];
        } else if (!strcmp(argv[i], "--only") && i + 1 < argc) {
            only = argv[++i];
        } else {
            fprintf(stderr, "usage: bench_store [--quick] [--size-mib N] [--runs N] [--convs N] [--cycles N] [--dir DIR]\n"
                            "                   [--only save,dedup,churn]\n");
            return 2;
        }
    }
    if (size_mib < 16 || runs < 1 || convs < 2 || cycles < 10) {
        fprintf(stderr, "bench_store: --size-mib >= 16, --runs >= 1, --convs >= 2, --cycles >= 10\n");
        return 2;
    }
    sh("rm -rf '%s' && mkdir -p '%s'", dir);
    const char *tun = getenv("GLIBC_TUNABLES");
    printf("bench_store: stores under %s; %ld CPUs; GLIBC_TUNABLES=%s\n", dir, sysconf(_SC_NPROCESSORS_ONLN),
           tun ? tun : "(unset)");
    if (strstr(only, "save"))
        bench_save_get(dir, size_mib, runs);
    if (strstr(only, "dedup"))
        bench_dedup(dir, convs);
    if (strstr(only, "churn"))
        bench_churn(dir, cycles);
    sh("rm -rf '%s' '%s'", dir);
    return 0;
}
