/*
 * bench_vocab - tokens per second of the GGUF BPE tokenizer (engine/st_vocab.c) on one thread:
 *
 *   bench_vocab --vocab FILE.gguf --text FILE [--runs N (default 5)] [--parse-special 0|1
 *               (default 1)]
 *
 * Tokenizes the whole text N times and prints the best run (bytes, ids, seconds, ids/s, MB/s)
 * as one line of JSON; bench/bench_vocab.mjs runs it beside llama.cpp's tokenizer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_engine.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv)
{
    const char *vpath = NULL, *tpath = NULL;
    int runs = 5, special = 1;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--vocab"))
            vpath = argv[i + 1];
        else if (!strcmp(argv[i], "--text"))
            tpath = argv[i + 1];
        else if (!strcmp(argv[i], "--runs"))
            runs = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "--parse-special"))
            special = atoi(argv[i + 1]);
    }
    if (!vpath || !tpath || runs < 1) {
        fprintf(stderr, "usage: bench_vocab --vocab FILE.gguf --text FILE [--runs N] "
                        "[--parse-special 0|1]\n");
        return 2;
    }
    FILE *f = fopen(tpath, "rb");
    if (!f) {
        perror(tpath);
        return 1;
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *text = malloc((size_t)len + 1);
    if (!text || fread(text, 1, (size_t)len, f) != (size_t)len) {
        fprintf(stderr, "%s: read error\n", tpath);
        return 1;
    }
    fclose(f);
    st_vocab *v = NULL;
    double t0 = now_s();
    int rc = st_vocab_open(vpath, &v);
    double t_load = now_s() - t0;
    if (rc) {
        fprintf(stderr, "bench_vocab: %s: %s\n", st_strerror(rc), st_errdetail());
        return 1;
    }
    size_t n = 0;
    st_vocab_tokenize(v, text, (size_t)len, 0, special, NULL, 0, &n);
    uint32_t *ids = malloc((n + 1) * sizeof *ids);
    double best = 1e30;
    for (int r = 0; r < runs; r++) {
        double a = now_s();
        st_vocab_tokenize(v, text, (size_t)len, 0, special, ids, n, &n);
        double b = now_s() - a;
        if (b < best)
            best = b;
    }
    printf("{\"bytes\": %ld, \"ids\": %zu, \"load_s\": %.4f, \"best_s\": %.4f, \"ids_per_s\": %.0f, "
           "\"mb_per_s\": %.2f}\n", len, n, t_load, best, (double)n / best,
           (double)len / best / 1e6);
    free(ids);
    free(text);
    st_vocab_free(v);
    return 0;
}
