/*
 * llama_state.c - the peer's side of issue 14 section 5's state figures: llama.cpp saving and
 * restoring one conversation's state (libllama's llama_state_seq_* API, the engine's own
 * state of a sequence: its K/V cells and, for the hybrids, the recurrent state), timed on the
 * GGUF file Strata's bench_gpu_engine uses the shape of. Built and run by bench/llama_cuda.sh
 * against the llama.cpp it builds from node-llama-cpp's bundle; not part of Strata's build (it
 * links libllama, not Strata).
 *
 *   llama_state MODEL.gguf [--tokens N] [--ngl N] [--ubatch N] [--file PATH]
 *
 * Reads N (default 32,768) seeded token ids in chunks of --ubatch (default 2,048) with --ngl
 * layers on the GPU (default 99), then times, best of 3:
 *   get   llama_state_seq_get_data into a host buffer (the state to RAM: Strata's PARK)
 *   set   llama_state_seq_set_data from it (RAM to the state: Strata's RESTORE)
 *   save  llama_state_seq_save_file, then fsync of the file (Strata's SAVE is durable)
 *   load  llama_state_seq_load_file
 * and checks that a restored state decodes the next token to the same logits as the original.
 * Prints one line per figure: name, bytes, milliseconds, GB/s.
 */
#include <fcntl.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "llama.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void quiet(enum ggml_log_level level, const char *text, void *user)
{
    (void)user;
    if (level == GGML_LOG_LEVEL_ERROR)
        fputs(text, stderr);
}

/* The next token's logits after the state in ctx: one decode of token t at position pos. */
static int next_logits(struct llama_context *ctx, llama_token t, int32_t n_vocab, float *out)
{
    struct llama_batch b = llama_batch_get_one(&t, 1);
    if (llama_decode(ctx, b))
        return -1;
    const float *l = llama_get_logits_ith(ctx, -1);
    if (!l)
        return -1;
    memcpy(out, l, (size_t)n_vocab * sizeof *out);
    return 0;
}

int main(int argc, char **argv)
{
    const char *path = NULL, *file = "llama_state.bin";
    long tokens = 32768, ngl = 99, ubatch = 2048;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            tokens = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--ngl") && i + 1 < argc)
            ngl = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--ubatch") && i + 1 < argc)
            ubatch = strtol(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--file") && i + 1 < argc)
            file = argv[++i];
        else if (argv[i][0] != '-' && !path)
            path = argv[i];
        else {
            fprintf(stderr, "usage: llama_state MODEL.gguf [--tokens N] [--ngl N] [--ubatch N] "
                    "[--file PATH]\n");
            return 2;
        }
    }
    if (!path || tokens < 1 || ubatch < 1 || ngl < 0) {
        fprintf(stderr, "llama_state: a model file, --tokens >= 1, --ubatch >= 1, --ngl >= 0\n");
        return 2;
    }
    llama_log_set(quiet, NULL);
    llama_backend_init();
    struct llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = (int32_t)ngl;
    struct llama_model *model = llama_model_load_from_file(path, mp);
    if (!model) {
        fprintf(stderr, "llama_state: %s: llama.cpp could not load it\n", path);
        return 1;
    }
    struct llama_context_params cp = llama_context_default_params();
    cp.n_ctx = (uint32_t)tokens + 16;
    cp.n_batch = (uint32_t)ubatch;
    cp.n_ubatch = (uint32_t)ubatch;
    cp.n_seq_max = 1;
    struct llama_context *ctx = llama_init_from_model(model, cp);
    if (!ctx) {
        fprintf(stderr, "llama_state: no context of %ld tokens\n", tokens + 16);
        return 1;
    }
    const struct llama_vocab *vocab = llama_model_get_vocab(model);
    int32_t n_vocab = llama_vocab_n_tokens(vocab);
    llama_token *ids = malloc((size_t)tokens * sizeof *ids);
    float *la = malloc((size_t)n_vocab * sizeof *la), *lb = malloc((size_t)n_vocab * sizeof *lb);
    if (!ids || !la || !lb) {
        fprintf(stderr, "llama_state: out of memory\n");
        return 1;
    }
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (long i = 0; i < tokens; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        ids[i] = (llama_token)(s % (uint64_t)n_vocab);
    }
    double t0 = now_s();
    for (long i = 0; i < tokens; i += ubatch) {
        int32_t n = (int32_t)(tokens - i < ubatch ? tokens - i : ubatch);
        if (llama_decode(ctx, llama_batch_get_one(ids + i, n))) {
            fprintf(stderr, "llama_state: llama_decode failed at token %ld\n", i);
            return 1;
        }
    }
    llama_synchronize(ctx);
    printf("prefill %ld tokens %.1f ms\n", tokens, (now_s() - t0) * 1e3);

    size_t size = llama_state_seq_get_size(ctx, 0);
    uint8_t *buf = malloc(size);
    if (!buf) {
        fprintf(stderr, "llama_state: %zu bytes of state: out of memory\n", size);
        return 1;
    }
    double best_get = 1e30, best_set = 1e30, best_save = 1e30, best_load = 1e30;
    for (int r = 0; r < 3; r++) {
        double a = now_s();
        if (llama_state_seq_get_data(ctx, buf, size, 0) != size) {
            fprintf(stderr, "llama_state: llama_state_seq_get_data gave another size\n");
            return 1;
        }
        double b = now_s();
        if (b - a < best_get)
            best_get = b - a;
    }
    /* the restored state must continue as the original: logits of one more token, then the
     * state put back and the same token again */
    llama_token probe = ids[tokens - 1];
    if (next_logits(ctx, probe, n_vocab, la)) {
        fprintf(stderr, "llama_state: decode after the prompt failed\n");
        return 1;
    }
    for (int r = 0; r < 3; r++) {
        llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
        double a = now_s();
        if (!llama_state_seq_set_data(ctx, buf, size, 0)) {
            fprintf(stderr, "llama_state: llama_state_seq_set_data refused the state\n");
            return 1;
        }
        llama_synchronize(ctx);
        double b = now_s();
        if (b - a < best_set)
            best_set = b - a;
    }
    if (next_logits(ctx, probe, n_vocab, lb)) {
        fprintf(stderr, "llama_state: decode after the restore failed\n");
        return 1;
    }
    double worst = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        worst = fmax(worst, fabs((double)la[i] - lb[i]));
    printf("restored state: max |logit difference| %.3g on the next token\n", worst);
    llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
    if (!llama_state_seq_set_data(ctx, buf, size, 0)) {
        fprintf(stderr, "llama_state: llama_state_seq_set_data refused the state\n");
        return 1;
    }
    for (int r = 0; r < 3; r++) {
        double a = now_s();
        if (!llama_state_seq_save_file(ctx, file, 0, ids, (size_t)tokens)) {
            fprintf(stderr, "llama_state: llama_state_seq_save_file %s failed\n", file);
            unlink(file); /* no part-written state left behind */
            return 1;
        }
        int fd = open(file, O_RDONLY);
        if (fd < 0 || fsync(fd)) {
            fprintf(stderr, "llama_state: fsync of %s failed\n", file);
            unlink(file);
            return 1;
        }
        close(fd);
        double b = now_s();
        if (b - a < best_save)
            best_save = b - a;
    }
    for (int r = 0; r < 3; r++) {
        size_t n_out = 0;
        llama_memory_seq_rm(llama_get_memory(ctx), 0, -1, -1);
        double a = now_s();
        if (!llama_state_seq_load_file(ctx, file, 0, ids, (size_t)tokens, &n_out)) {
            fprintf(stderr, "llama_state: llama_state_seq_load_file %s failed\n", file);
            unlink(file);
            return 1;
        }
        llama_synchronize(ctx);
        double b = now_s();
        if (b - a < best_load)
            best_load = b - a;
    }
    unlink(file);
    printf("%-5s %14s %10s %10s\n", "op", "bytes", "ms", "GB/s");
    const char *names[4] = {"get", "set", "save", "load"};
    double t[4] = {best_get, best_set, best_save, best_load};
    for (int i = 0; i < 4; i++)
        printf("%-5s %14zu %10.2f %10.2f\n", names[i], size, t[i] * 1e3, (double)size / t[i] / 1e9);
    free(buf), free(ids), free(la), free(lb);
    llama_free(ctx);
    llama_model_free(model);
    llama_backend_free();
    return worst < 1e-3 ? 0 : 3;
}
