/*
 * bench_gpu_arch.c - the CUDA backend's operation table (engine/st_ops_cuda.cu) on seeded
 * models in the published shapes: prefill and decode of each, the decode's weight bytes per
 * second against the HBM copy rate measured here (bench_gpu.h: a 1 GiB device-to-device copy,
 * bytes read plus written per second, as bench_gpu_qmv), the decode with its steps launched directly
 * against CUDA graphs (STRATA_CUDA_GRAPHS=1), and the device memory the model takes against its
 * file's tensor bytes (the weights stay in their file types on the GPU).
 *
 *   bench_gpu_arch [--prompt N] [--decode N] [--dir DIR] [ARCH:PRESET:TYPE | FILE.gguf ...]
 *
 * A FILE.gguf is run as it is (bench/llama_cuda.sh runs llama.cpp on the same file).
 * Default models: qwen35:0.8b:q8_0 qwen35:0.8b:q4_K llama:llama-3.2-1b:q4_K. DIR (default
 * $TMPDIR or /tmp) gets the seeded f32 model and its quantized file, removed afterwards.
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
    fprintf(stderr, "bench_gpu_arch: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

static void cuda_ok(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_gpu_arch: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

static uint32_t greedy(const st_slot *s)
{
    return bench_greedy("bench_gpu_arch", s);
}

static void run(const char *spec, const char *dir, uint32_t n_prompt, uint32_t n_dec, double hbm)
{
    char arch[64], preset[64], tname[32];
    size_t sl = strlen(spec);
    int file = sl > 5 && !strcmp(spec + sl - 5, ".gguf");
    if (!file && sscanf(spec, "%63[^:]:%63[^:]:%31s", arch, preset, tname) != 3) {
        fprintf(stderr, "bench_gpu_arch: %s: ARCH:PRESET:TYPE\n", spec);
        exit(2);
    }
    uint32_t type = 0;
    int rc;
    char src[4200], path[4200];
    if (file) {
        snprintf(path, sizeof path, "%s", spec);
    } else {
        if ((rc = st_quantize_type_parse(tname, &type)))
            die(tname, rc);
        st_model_hparams hp;
        if ((rc = st_model_preset_arch(arch, preset, &hp)))
            die(spec, rc);
        hp.wtype = ST_GGML_F32;
        snprintf(src, sizeof src, "%s/bench_gpu_arch.f32.gguf", dir);
        snprintf(path, sizeof path, "%s/bench_gpu_arch.gguf", dir);
        double t0 = now_s();
        if ((rc = st_model_write_seeded(&hp, 1, "bench", src)))
            die("st_model_write_seeded", rc);
        st_quantize_stats qs;
        if ((rc = st_gguf_quantize(src, path, type, NULL, &qs)))
            die("st_gguf_quantize", rc);
        unlink(src);
        fprintf(stderr, "bench_gpu_arch: %s written and quantized in %.1f s\n", spec,
                now_s() - t0);
    }
    st_model *m = NULL;
    if ((rc = st_model_load(path, &m)))
        die("st_model_load", rc);
    /* the bytes a decode step reads: every tensor but the embedding table (one row of it),
     * which a tied head reads whole */
    const st_gguf *g = st_model_gguf(m);
    uint64_t file_bytes = 0, emb = 0;
    int tied = 1;
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        file_bytes += t->nbytes;
        if (!strcmp(t->name, "token_embd.weight"))
            emb = t->nbytes;
        if (!strcmp(t->name, "output.weight"))
            tied = 0;
    }
    uint64_t step_bytes = tied ? file_bytes : file_bytes - emb;
    size_t free0 = 0, free1 = 0, total = 0;
    cuda_ok(cudaMemGetInfo(&free0, &total), "cudaMemGetInfo");
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = "cuda";
    o.ubatch = 2048;
    o.n_ctx = n_prompt + n_dec + 64;
    o.prompt_cache = 0;
    st_engine *e = NULL;
    if ((rc = st_engine_new(m, &o, &e)))
        die("st_engine_new", rc);
    cuda_ok(cudaMemGetInfo(&free1, &total), "cudaMemGetInfo");
    st_slot *s = NULL;
    if ((rc = st_slot_new(e, &s)))
        die("st_slot_new", rc);
    uint32_t V = st_model_hparams_get(m)->n_vocab;
    uint32_t *tok = malloc((size_t)n_prompt * sizeof *tok);
    if (!tok)
        exit(1);
    for (uint32_t i = 0; i < n_prompt; i++)
        tok[i] = 1 + (uint32_t)(((uint64_t)i * 2654435761u) % (V - 1));
    /* a warm-up read, then the timed one in a fresh slot */
    if ((rc = st_slot_eval(s, tok, 64, 0, NULL)))
        die("warm-up", rc);
    st_slot_free(s);
    if ((rc = st_slot_new(e, &s)))
        die("st_slot_new", rc);
    double tp = now_s();
    if ((rc = st_slot_eval(s, tok, n_prompt, 0, NULL)))
        die("prefill", rc);
    tp = now_s() - tp;
    double td = now_s();
    for (uint32_t i = 0; i < n_dec; i++)
        if ((rc = st_slot_decode(s, greedy(s))))
            die("decode", rc);
    td = (now_s() - td) / n_dec;
    /* the same decode replayed as CUDA graphs, in an engine of its own */
    setenv("STRATA_CUDA_GRAPHS", "1", 1);
    st_engine *ed = NULL;
    st_slot *sd = NULL;
    if ((rc = st_engine_new(m, &o, &ed)) || (rc = st_slot_new(ed, &sd)) ||
        (rc = st_slot_eval(sd, tok, n_prompt, 0, NULL)))
        die("the graphs engine", rc);
    unsetenv("STRATA_CUDA_GRAPHS");
    double tdd = now_s();
    for (uint32_t i = 0; i < n_dec; i++)
        if ((rc = st_slot_decode(sd, greedy(sd))))
            die("decode", rc);
    tdd = (now_s() - tdd) / n_dec;
    st_slot_free(sd);
    st_engine_free(ed);
    double rate = (double)step_bytes / td;
    printf("| %s | %.1f MB | %.1f MB | %.0f tok/s | %.2f ms | %.2f ms | %.0f GB/s | %.3f |\n",
           spec, (double)file_bytes / 1e6, (double)(free0 - free1) / 1e6, n_prompt / tp,
           td * 1e3, tdd * 1e3, rate / 1e9, rate / hbm);
    fflush(stdout);
    free(tok);
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
    if (!file)
        unlink(path);
}

int main(int argc, char **argv)
{
    uint32_t n_prompt = 2048, n_dec = 64;
    const char *dir = getenv("TMPDIR") && *getenv("TMPDIR") ? getenv("TMPDIR") : "/tmp";
    const char *specs[32];
    int n = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--prompt") && i + 1 < argc)
            n_prompt = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--decode") && i + 1 < argc)
            n_dec = (uint32_t)strtoul(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (argv[i][0] != '-' && n < 32)
            specs[n++] = argv[i];
        else {
            fprintf(stderr, "usage: bench_gpu_arch [--prompt N] [--decode N] [--dir DIR] "
                            "[ARCH:PRESET:TYPE ...]\n");
            return 2;
        }
    }
    if (n_prompt < 64 || n_dec < 1) {
        fprintf(stderr, "bench_gpu_arch: --prompt >= 64, --decode >= 1\n");
        return 2;
    }
    if (!n) {
        specs[n++] = "qwen35:0.8b:q8_0";
        specs[n++] = "qwen35:0.8b:q4_K";
        specs[n++] = "llama:llama-3.2-1b:q4_K";
    }
    double hbm = bench_hbm_copy_rate();
    if (!(hbm > 0))
        return 1;
    printf("HBM copy rate: %.0f GB/s (read + written); prompt %u tokens, %u decodes\n\n",
           hbm / 1e9, n_prompt, n_dec);
    printf("| model | tensors | device memory | prefill | decode, direct | decode, graphs | "
           "weight bytes/s | x HBM |\n|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < n; i++)
        run(specs[i], dir, n_prompt, n_dec, hbm);
    return 0;
}
