/*
 * bench_state.c - the state paths alone, repeated on one conversation: PARK to RAM + RESTORE,
 * session file SAVE (durable) + LOAD (verified), in fp32 and bf16, for profiling (`perf record
 * -g`) and for A/B runs of two trees (the same source builds against either; docs/BENCHMARKS.md).
 *
 *   bench_state --model FILE --tokens-file F [--n-gen N (32)] [--threads N (2)] [--runs R (10)]
 *               [--dir DIR ($TMPDIR or /tmp)] [--cache-off] [--only park|file|load|store]
 *               [--codec fp32|bf16 (both)] [--compress L (0: none)]
 *
 * The prompt is read once and N tokens decoded (the conversation of bench_engine --model); then
 * each path runs R times; best and median of each in ms, one line per path. --compress L: the
 * session file's checkpoints as shuffled zstd frames of level L (st_file_write_opts.compress),
 * to weigh their size against their SAVE cost. --only load: the file written once, then R LOADs
 * alone (a profile of the read and the restore). --only store: the conversation put once into a
 * new store in DIR, then R store RESTOREs alone (st_store_get + the verified restore).
 */
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "st_engine.h"
#include "st_file.h"
#include "st_store.h"

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "bench_state: %s: %s (%s)\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

static int cmp_d(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static void report(const char *name, double *ms, int runs, uint64_t bytes)
{
    qsort(ms, (size_t)runs, sizeof *ms, cmp_d);
    printf("  %-34s %7.1f MB  best %7.2f ms  median %7.2f ms  %6.0f MB/s\n", name,
           (double)bytes / 1e6, ms[0], ms[runs / 2], (double)bytes / 1e3 / ms[0]);
}

static uint32_t *read_tokens(const char *path, uint64_t *n)
{
    FILE *f = fopen(path, "r");
    if (!f)
        die(path, errno);
    uint64_t cap = 1024, k = 0;
    uint32_t *t = malloc(cap * sizeof *t);
    unsigned long v;
    int c;
    while (t && (c = fscanf(f, "%lu", &v)) != EOF) {
        if (c != 1) {
            if (fgetc(f) == EOF)
                break;
            continue;
        }
        if (k == cap && !(t = realloc(t, (cap *= 2) * sizeof *t)))
            break;
        t[k++] = (uint32_t)v;
    }
    fclose(f);
    if (!t || !k)
        die("tokens file: no tokens", ST_EINVAL);
    *n = k;
    return t;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static void paths(st_slot *s, const st_file_read_opts *ro, const st_file_write_opts *wo,
                  uint32_t codec, int runs, const char *dir, const char *only)
{
    double *a = calloc((size_t)runs, sizeof *a), *b = calloc((size_t)runs, sizeof *b);
    char path[4200];
    uint64_t pb = 0, fb = 0;
    int rc;
    const char *cn = st_codec_name(codec);
    char name[96];
    snprintf(path, sizeof path, "%s/bench-state-%ld.stf", dir, (long)getpid());
    if (!a || !b)
        die("runs", ENOMEM);
    if (!only || !strcmp(only, "park")) {
        for (int k = 0; k < runs; k++) {
            st_image *img = NULL;
            double t = now_ms();
            if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_PARK, codec, &img)))
                die("park", rc);
            a[k] = now_ms() - t;
            pb = st_image_bytes(img);
            t = now_ms();
            if ((rc = st_slot_restore(s, img)))
                die("restore", rc);
            b[k] = now_ms() - t;
            st_image_free(img);
        }
        snprintf(name, sizeof name, "PARK to RAM %s", cn);
        report(name, a, runs, pb);
        snprintf(name, sizeof name, "RESTORE from RAM %s (verified)", cn);
        report(name, b, runs, pb);
    }
    if (!only || !strcmp(only, "file")) {
        for (int k = 0; k < runs; k++) {
            st_image *img = NULL, *back = NULL;
            double t = now_ms();
            if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, codec, &img)) ||
                (rc = st_file_write(img, path, wo)))
                die("save", rc);
            a[k] = now_ms() - t;
            st_image_free(img);
            struct stat sb;
            if (stat(path, &sb))
                die("stat", errno);
            fb = (uint64_t)sb.st_size;
            t = now_ms();
            if ((rc = st_file_read(path, ro, &back)) || (rc = st_slot_restore_adopt(s, back)))
                die("load", rc);
            b[k] = now_ms() - t;
            st_image_free(back);
            unlink(path);
        }
        snprintf(name, sizeof name, "session SAVE %s%s (durable)", cn, wo ? " zstd" : "");
        report(name, a, runs, fb);
        snprintf(name, sizeof name, "session LOAD %s%s (verified)", cn, wo ? " zstd" : "");
        report(name, b, runs, fb);
    }
    if (only && !strcmp(only, "load")) {
        /* the file written once, then LOADs alone (for a profile of the read and restore) */
        st_image *img = NULL;
        struct stat sb;
        if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, codec, &img)) ||
            (rc = st_file_write(img, path, wo)))
            die("save", rc);
        st_image_free(img);
        if (stat(path, &sb))
            die("stat", errno);
        for (int k = 0; k < runs; k++) {
            st_image *back = NULL;
            double t = now_ms();
            if ((rc = st_file_read(path, ro, &back)) || (rc = st_slot_restore_adopt(s, back)))
                die("load", rc);
            b[k] = now_ms() - t;
            st_image_free(back);
        }
        unlink(path);
        snprintf(name, sizeof name, "session LOAD %s%s (verified)", cn, wo ? " zstd" : "");
        report(name, b, runs, (uint64_t)sb.st_size);
    }
    if (only && !strcmp(only, "store")) {
        /* the conversation put once, then store RESTOREs alone */
        char sdir[4200];
        st_store *st = NULL;
        st_image *img = NULL;
        snprintf(sdir, sizeof sdir, "%s/bench-state-store-%ld", dir, (long)getpid());
        if ((rc = st_store_open(&st, sdir, &(st_store_opts){.create = 1})) ||
            (rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, codec, &img)) ||
            (rc = st_store_put(st, "bench", img, ST_STORE_HEAD_ANY, NULL, NULL)))
            die("store save", rc);
        pb = st_image_bytes(img);
        st_image_free(img);
        for (int k = 0; k < runs; k++) {
            st_image *back = NULL;
            double t = now_ms();
            if ((rc = st_store_get_with(st, "bench", 0, ro->alloc, &back)) ||
                (rc = st_slot_restore_adopt(s, back)))
                die("store restore", rc);
            b[k] = now_ms() - t;
            st_image_free(back);
        }
        st_store_close(st);
        nftw(sdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        snprintf(name, sizeof name, "store RESTORE %s (verified)", cn);
        report(name, b, runs, pb);
    }
    free(a);
    free(b);
}

int main(int argc, char **argv)
{
    const char *model = NULL, *tokens_file = NULL, *only = NULL, *codec = NULL;
    const char *dir = getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    uint32_t n_gen = 32, threads = 2;
    int runs = 10, cache_off = 0, level = 0, rc;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--tokens-file") && i + 1 < argc)
            tokens_file = argv[++i];
        else if (!strcmp(argv[i], "--n-gen") && i + 1 < argc)
            n_gen = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--only") && i + 1 < argc)
            only = argv[++i];
        else if (!strcmp(argv[i], "--compress") && i + 1 < argc)
            level = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--codec") && i + 1 < argc)
            codec = argv[++i];
        else if (!strcmp(argv[i], "--cache-off"))
            cache_off = 1;
        else {
            fprintf(stderr, "usage: bench_state --model FILE --tokens-file F [--n-gen N (32)] "
                            "[--threads N (2)] [--runs R (10)] [--dir DIR] [--cache-off] "
                            "[--only park|file|load|store] [--codec fp32|bf16] [--compress L]\n");
            return 2;
        }
    }
    if (!model || !tokens_file || runs < 1 || threads < 1 ||
        (only && strcmp(only, "park") && strcmp(only, "file") && strcmp(only, "load") &&
         strcmp(only, "store")) ||
        (codec && strcmp(codec, "fp32") && strcmp(codec, "bf16")) || level < 0 || level > 19) {
        fprintf(stderr, "bench_state: --model and --tokens-file needed, --runs >= 1, --only "
                        "park|file|load|store, --codec fp32|bf16, --compress 0..19\n");
        return 2;
    }
    uint64_t n;
    uint32_t *tok = read_tokens(tokens_file, &n);
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = threads;
    o.n_ctx = (uint32_t)(n + n_gen);
    if (cache_off)
        o.prompt_cache = 0;
    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    if ((rc = st_model_load(model, &m)) || (rc = st_engine_new(m, &o, &e)) ||
        (rc = st_slot_new(e, &s)))
        die("open", rc);
    if ((rc = st_slot_eval(s, tok, n, 0, NULL)))
        die("prefill", rc);
    for (uint32_t i = 0; i < n_gen; i++) {
        uint32_t next;
        if ((rc = st_slot_sample(s, 0.0f, 1, &next)) || (rc = st_slot_decode(s, next)))
            die("decode", rc);
    }
    printf("bench_state: %llu tokens, %u checkpoints, %u threads, %d runs%s\n",
           (unsigned long long)st_slot_n_tokens(s), st_slot_n_checkpoints(s), threads, runs,
           cache_off ? ", conversation cache off" : "");
    /* a LOAD (and a store RESTORE) reads into the engine's image buffers and the restore takes
     * them (st_slot_restore_adopt), as the server's do */
    st_file_read_opts ro = {.alloc = st_engine_image_allocator(e)};
    st_file_write_opts wopts = {.compress = level, .shuffle = 1}, *wo = level ? &wopts : NULL;
    if (!codec || !strcmp(codec, "fp32"))
        paths(s, &ro, wo, ST_CODEC_FP32, runs, dir, only);
    if (!codec || !strcmp(codec, "bf16"))
        paths(s, &ro, wo, ST_CODEC_BF16, runs, dir, only);
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
    free(tok);
    return 0;
}
