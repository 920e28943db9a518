/*
 * bench_gpu_xcache.c - the routed-expert cache (st_engine_opts.expert_cache_bytes,
 * engine/st_xcache_cuda.cu) on a seeded qwen35moe in the Qwen3.5-35B-A3B shape (2048 wide, 256
 * experts of 512, top 8) with fewer layers: prefill and decode with every expert in VRAM, with
 * an arena of a quarter of the experts (the experts about 4x the arena), and streamed (an arena
 * below one token's records: each token's experts uploaded per layer); the decode's hit rate
 * and bytes uploaded per token, and the upload rate the streamed decode reaches against the
 * pinned host-to-device rate measured here (the limit of any path from host memory). The
 * greedy tokens of the three runs are compared (they must be the same).
 *
 *   bench_gpu_xcache [--layers N] [--type T] [--prompt N] [--decode N] [--arena-div D]
 *                    [--dir DIR]
 *
 * Defaults: 2 layers, q4_K, a prompt of 256 tokens, 64 decodes, arena = experts / 4. DIR
 * (default $TMPDIR or /tmp) gets the seeded f32 model and its quantized file, removed after.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench_gpu.h"
#include "st_engine.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static _Noreturn void die(const char *what, int rc)
{
    fprintf(stderr, "bench_gpu_xcache: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

/* The best of 5 copies of 256 MiB from pinned host memory to the device. */
static double pinned_h2d_rate(void)
{
    size_t n = (size_t)256 << 20;
    void *h = NULL, *d = NULL;
    if (cudaHostAlloc(&h, n, cudaHostAllocDefault) != cudaSuccess ||
        cudaMalloc(&d, n) != cudaSuccess) {
        fprintf(stderr, "bench_gpu_xcache: no buffers for the H2D rate\n");
        exit(1);
    }
    memset(h, 1, n);
    double best = 1e30;
    for (int i = 0; i < 6; i++) {
        double t = now_s();
        if (cudaMemcpy(d, h, n, cudaMemcpyHostToDevice) != cudaSuccess)
            exit(1);
        t = now_s() - t;
        if (i && t < best)
            best = t;
    }
    cudaFreeHost(h);
    cudaFree(d);
    return (double)n / best;
}

typedef struct result {
    double prefill_tps, decode_ms, hit, up_per_tok, up_rate;
    st_engine_xcache xc;
    uint32_t *toks;
} result;

static void run(const st_model *m, uint64_t bytes, uint32_t n_prompt, uint32_t n_dec,
                result *r)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = "cuda";
    o.ubatch = 512;
    o.n_ctx = n_prompt + n_dec + 64;
    o.prompt_cache = 0;
    o.expert_cache_bytes = bytes;
    st_engine *e = NULL;
    st_slot *s = NULL;
    int rc;
    if ((rc = st_engine_new(m, &o, &e)) || (rc = st_slot_new(e, &s)))
        die("st_engine_new", rc);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    uint32_t *tok = malloc((size_t)n_prompt * sizeof *tok);
    r->toks = malloc((size_t)n_dec * sizeof *r->toks);
    if (!tok || !r->toks)
        exit(1);
    for (uint32_t i = 0; i < n_prompt; i++)
        tok[i] = 1 + (uint32_t)(((uint64_t)i * 2654435761u) % (V - 1));
    double t = now_s();
    if ((rc = st_slot_eval(s, tok, n_prompt, 0, NULL)))
        die("prefill", rc);
    r->prefill_tps = n_prompt / (now_s() - t);
    st_engine_xcache a, b;
    st_engine_xcache_get(e, &a);
    t = now_s();
    for (uint32_t i = 0; i < n_dec; i++) {
        r->toks[i] = bench_greedy("bench_gpu_xcache", s);
        if ((rc = st_slot_decode(s, r->toks[i])))
            die("decode", rc);
    }
    double td = now_s() - t;
    st_engine_xcache_get(e, &b);
    r->decode_ms = td / n_dec * 1e3;
    uint64_t h = b.hits - a.hits, mi = b.misses - a.misses;
    r->hit = h + mi ? (double)h / (double)(h + mi) : 0.0;
    r->up_per_tok = (double)(b.bytes_uploaded - a.bytes_uploaded) / n_dec;
    r->up_rate = (double)(b.bytes_uploaded - a.bytes_uploaded) / td;
    r->xc = b;
    free(tok);
    st_slot_free(s);
    st_engine_free(e);
}

int main(int argc, char **argv)
{
    uint32_t layers = 2, n_prompt = 256, n_dec = 64, div = 4;
    const char *tname = "q4_K";
    const char *dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--layers") && i + 1 < argc)
            layers = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--type") && i + 1 < argc)
            tname = argv[++i];
        else if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            n_prompt = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--decode") && i + 1 < argc)
            n_dec = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--arena-div") && i + 1 < argc)
            div = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else {
            fprintf(stderr, "usage: bench_gpu_xcache [--layers N] [--type T] [--prompt N] "
                            "[--decode N] [--arena-div D] [--dir DIR]\n");
            return 2;
        }
    }
    if (!layers || layers > 40 || !n_prompt || !n_dec || !div) {
        fprintf(stderr, "bench_gpu_xcache: --layers 1..40, --prompt, --decode, --arena-div >= 1\n");
        return 2;
    }
    uint32_t type;
    int rc;
    if ((rc = st_quantize_type_parse(tname, &type)))
        die(tname, rc);
    st_model_hparams hp;
    if ((rc = st_model_preset_arch("qwen35moe", "35b-a3b", &hp)))
        die("preset", rc);
    hp.n_layer = layers;
    hp.wtype = ST_GGML_F32;
    char src[4200], path[4200];
    snprintf(src, sizeof src, "%s/bench_gpu_xcache.f32.gguf", dir);
    snprintf(path, sizeof path, "%s/bench_gpu_xcache.gguf", dir);
    double t0 = now_s();
    if ((rc = st_model_write_seeded(&hp, 1, "bench", src)))
        die("st_model_write_seeded", rc);
    st_quantize_stats qs;
    if ((rc = st_gguf_quantize(src, path, type, NULL, &qs)))
        die("st_gguf_quantize", rc);
    unlink(src);
    fprintf(stderr, "bench_gpu_xcache: qwen35moe 35b-a3b shape, %u layers, %s: written and "
            "quantized in %.1f s\n", layers, tname, now_s() - t0);
    st_model *m = NULL;
    if ((rc = st_model_load(path, &m)))
        die("st_model_load", rc);
    double h2d = pinned_h2d_rate();
    /* the record size from a streamed engine's figures, then the arena */
    result res[3];
    run(m, 1, n_prompt, n_dec, &res[2]);
    uint64_t rec = res[2].xc.record_bytes, recs = res[2].xc.records;
    uint64_t arena = recs / div * rec;
    run(m, 0, n_prompt, n_dec, &res[0]);
    run(m, arena, n_prompt, n_dec, &res[1]);
    printf("qwen35moe, the Qwen3.5-35B-A3B shape with %u layers, %s: %llu expert records of "
           "%.2f MiB (%.0f MiB); pinned H2D %.1f GB/s; prompt %u, %u decodes\n\n", layers,
           tname, (unsigned long long)recs, rec / 1048576.0, recs * (double)rec / 1048576.0,
           h2d / 1e9, n_prompt, n_dec);
    printf("| experts | arena | prefill tok/s | decode ms/token | decode x resident | decode hit "
           "rate | uploaded per token | upload rate x pinned H2D |\n|---|---|---|---|---|---|---|"
           "---|\n");
    const char *names[3] = {"all in VRAM", "cached", "streamed"};
    for (int i = 0; i < 3; i++) {
        const result *r = &res[i];
        char ar[64];
        snprintf(ar, sizeof ar, i == 1 ? "%u records, %.0f MiB (1/%u)" : "-",
                 r->xc.slots, r->xc.arena_bytes / 1048576.0, div);
        char hit[32];
        snprintf(hit, sizeof hit, i == 1 ? "%.1f%%" : "-", 100.0 * r->hit);
        printf("| %s | %s | %.0f | %.2f | %.2f | %s | %.1f MB | %.2f |\n", names[i], ar,
               r->prefill_tps, r->decode_ms, res[0].decode_ms / r->decode_ms, hit,
               r->up_per_tok / 1e6, r->up_rate / h2d);
    }
    int same = !memcmp(res[0].toks, res[1].toks, n_dec * sizeof *res[0].toks) &&
               !memcmp(res[0].toks, res[2].toks, n_dec * sizeof *res[0].toks);
    printf("\nthe greedy tokens of the three runs: %s\n", same ? "the same" : "DIFFERENT");
    for (int i = 0; i < 3; i++)
        free(res[i].toks);
    st_model_free(m);
    unlink(path);
    return same ? 0 : 1;
}
