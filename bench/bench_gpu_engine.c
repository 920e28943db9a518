/*
 * bench_gpu_engine.c - the engine's CUDA backend on the bench preset (24 DeltaNet layers of
 * 6 x 448 x 448, 8 attention layers of 2 K/V heads x 240 in f16: 117.9 MB of running state,
 * 15,360 B of K/V per token):
 * - prefill of N tokens (default 32,768) and decode tokens/s;
 * - PARK (st_slot_snapshot, park image in RAM) and RESTORE (st_slot_restore into another slot)
 *   of that conversation, bf16 and fp32 running state, as the bytes that cross PCIe per second
 *   against the pinned host<->device bandwidth measured here (both include the state hash, which
 *   the GPU computes; STRATA_CUDA_TRACE=1 prints each transfer's phases);
 * - SAVE to a session file (snapshot + st_file_write: temp file, fsync, rename) and to the state
 *   store (snapshot + st_store_put into a fresh LMDB store, durable commit), each against the
 *   disk's write+fsync measured here with the same number of bytes; LOAD (read + restore) and
 *   RESTORE from the store (st_store_get_with the engine's image allocator + st_slot_restore_adopt,
 *   each phase's time printed) and streamed (st_store_get_stream: the server's RESTORE), against
 *   the pinned host->device rate;
 * - the time to first token of a new conversation sharing a 16,384-token system prompt, with the
 *   conversation cache (root checkpoint mounted) and without (full read); their first tokens are
 *   compared (the chunks are cut at the same places, so they must be identical).
 *
 *   bench_gpu_engine [--tokens N] [--system N] [--dir DIR] [--model ARCH:PRESET:TYPE]
 *
 * --model: another seeded model instead of the bench preset, e.g. qwen35:0.8b:q8_0 (issue 14
 * section 4: a Qwen3.5-shaped conversation; quantized types are the f32 model quantized by
 * st_gguf_quantize), run on the operation table (docs/ENGINE.md).
 *
 * DIR (default $TMPDIR or /tmp) gets the model and the session file, removed afterwards.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>

#include "bench_gpu.h"
#include "st_engine.h"
#include "st_file.h"
#include "st_store.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static _Noreturn void die(const char *what, int rc)
{
    fprintf(stderr, "bench_gpu_engine: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

static void cuda_ok(cudaError_t e, const char *what)
{
    if (e != cudaSuccess) {
        fprintf(stderr, "bench_gpu_engine: %s: %s\n", what, cudaGetErrorString(e));
        exit(1);
    }
}

/* ---- limits ------------------------------------------------------------------------------ */
static void pinned_gbs(double *h2d, double *d2h)
{
    size_t n = (size_t)256 << 20;
    void *h = NULL, *d = NULL;
    cuda_ok(cudaHostAlloc(&h, n, cudaHostAllocDefault), "cudaHostAlloc");
    cuda_ok(cudaMalloc(&d, n), "cudaMalloc");
    memset(h, 1, n);
    double bu = 1e30, bd = 1e30;
    for (int i = 0; i < 5; i++) {
        double t = now_s();
        cuda_ok(cudaMemcpy(d, h, n, cudaMemcpyHostToDevice), "cudaMemcpy");
        t = now_s() - t;
        bu = t < bu ? t : bu;
        t = now_s();
        cuda_ok(cudaMemcpy(h, d, n, cudaMemcpyDeviceToHost), "cudaMemcpy");
        t = now_s() - t;
        bd = t < bd ? t : bd;
    }
    *h2d = (double)n / bu / 1e9;
    *d2h = (double)n / bd / 1e9;
    cuda_ok(cudaFreeHost(h), "cudaFreeHost");
    cuda_ok(cudaFree(d), "cudaFree");
}

/* write + fsync of bytes in 8 MiB writes to a new file in dir (best of 2). */
static double disk_gbs(const char *dir, uint64_t bytes)
{
    char path[4200];
    snprintf(path, sizeof path, "%s/bench-disk.tmp", dir);
    size_t blk = (size_t)8 << 20;
    unsigned char *b = malloc(blk);
    if (!b)
        die("disk buffer", ENOMEM);
    memset(b, 0x5a, blk);
    double best = 1e30;
    for (int r = 0; r < 2; r++) {
        unlink(path);
        double t = now_s();
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            die(path, errno);
        for (uint64_t done = 0; done < bytes;) {
            size_t k = bytes - done < blk ? (size_t)(bytes - done) : blk;
            ssize_t w = write(fd, b, k);
            if (w <= 0)
                die("write", errno);
            done += (uint64_t)w;
        }
        if (fsync(fd) || close(fd))
            die("fsync", errno);
        t = now_s() - t;
        best = t < best ? t : best;
    }
    unlink(path);
    free(b);
    return (double)bytes / best / 1e9;
}

/* ---- engine ------------------------------------------------------------------------------- */
static st_engine *engine(const st_model *m, uint32_t prompt_cache, uint32_t root)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = "cuda";
    o.ubatch = 2048;
    o.prompt_cache = prompt_cache;
    o.prompt_cache_root = root;
    st_engine *e = NULL;
    int rc = st_engine_new(m, &o, &e);
    if (rc)
        die("engine", rc);
    return e;
}

static void fill(uint32_t *t, uint64_t from, uint64_t n, uint64_t seed)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (uint64_t i = from; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t[i] = 32 + (uint32_t)(x % 95);
    }
}

static uint32_t greedy(const st_slot *s)
{
    return bench_greedy("bench_gpu_engine", s);
}

/* Best of 3 park snapshots and restores; also the first of each (the first PARK fills the CUDA
 * backend's pinned image pool: cudaHostAlloc of the image's buffers). */
static void park_restore(st_slot *s, st_slot *r, uint32_t codec, uint64_t pcie, double d2h,
                         double h2d)
{
    double tp = 1e30, tr = 1e30, tp1 = 0, tr1 = 0;
    uint64_t img_bytes = 0;
    int rc;
    for (int i = 0; i < 3; i++) {
        st_image *img = NULL;
        double t = now_s();
        if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_PARK, codec, &img)))
            die("park", rc);
        t = now_s() - t;
        tp = t < tp ? t : tp;
        tp1 = i == 0 ? t : tp1;
        img_bytes = st_image_bytes(img);
        t = now_s();
        if ((rc = st_slot_restore(r, img)))
            die("restore", rc);
        t = now_s() - t;
        tr = t < tr ? t : tr;
        tr1 = i == 0 ? t : tr1;
        st_image_free(img);
    }
    double gp = (double)pcie / tp / 1e9, gr = (double)pcie / tr / 1e9;
    printf("| PARK to RAM (%s state)      | %7.1f ms | %6.1f GB/s | pinned D2H %5.1f GB/s | %5.2fx "
           "|\n", st_codec_name(codec), tp * 1e3, gp, d2h, gp / d2h);
    printf("| RESTORE from RAM (%s state) | %7.1f ms | %6.1f GB/s | pinned H2D %5.1f GB/s | %5.2fx "
           "|\n", st_codec_name(codec), tr * 1e3, gr, h2d, gr / h2d);
    printf("|   (%.1f MB cross PCIe each way; the image holds %.1f MB; first PARK %.1f ms, first "
           "RESTORE %.1f ms)\n", (double)pcie / 1e6, (double)img_bytes / 1e6, tp1 * 1e3,
           tr1 * 1e3);
}

int main(int argc, char **argv)
{
    uint64_t n_tok = 32768, n_sys = 16384;
    const char *spec = NULL;
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--tokens") && i + 1 < argc)
            n_tok = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--system") && i + 1 < argc)
            n_sys = strtoull(argv[++i], NULL, 0);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            spec = argv[++i];
        else {
            fprintf(stderr, "usage: bench_gpu_engine [--tokens N] [--system N] [--dir DIR] "
                            "[--model ARCH:PRESET:TYPE]\n");
            return 2;
        }
    }
    if (n_tok < 64 || n_sys < 2048 || n_sys % 2048) {
        fprintf(stderr, "bench_gpu_engine: --tokens >= 64, --system a multiple of 2048\n");
        return 2;
    }
    int rc;
    struct cudaDeviceProp prop;
    cuda_ok(cudaGetDeviceProperties(&prop, 0), "cudaGetDeviceProperties");
    double h2d, d2h;
    pinned_gbs(&h2d, &d2h);

    st_model_hparams hp;
    char arch[64] = "", preset[64] = "bench", tname[32] = "";
    uint32_t qtype = 0;
    if (spec && (sscanf(spec, "%63[^:]:%63[^:]:%31s", arch, preset, tname) != 3 ||
                 st_quantize_type_parse(tname, &qtype))) {
        fprintf(stderr, "bench_gpu_engine: --model %s: ARCH:PRESET:TYPE\n", spec);
        return 2;
    }
    if ((rc = spec ? st_model_preset_arch(arch, preset, &hp) : st_model_preset("bench", &hp)))
        die("preset", rc);
    int quant = spec && qtype != ST_GGML_F32 && qtype != ST_GGML_F16 && qtype != ST_GGML_BF16;
    if (spec)
        hp.wtype = quant ? ST_GGML_F32 : qtype;
    char path[4200], sess[4200], src[4200];
    snprintf(path, sizeof path, "%s/bench-gpu.gguf", dir);
    snprintf(src, sizeof src, "%s/bench-gpu.f32.gguf", dir);
    snprintf(sess, sizeof sess, "%s/bench-gpu.stsf", dir);
    double t = now_s();
    if ((rc = st_model_write_seeded(&hp, 1, "bench", quant ? src : path)))
        die("writing the model", rc);
    if (quant) {
        st_quantize_stats qs;
        if ((rc = st_gguf_quantize(src, path, qtype, NULL, &qs)))
            die("quantizing the model", rc);
        unlink(src);
    }
    st_model *m = NULL;
    if ((rc = st_model_load(path, &m)))
        die("loading the model", rc);
    st_engine *e = engine(m, 0, 0);
    st_slot *s = NULL, *r = NULL;
    if ((rc = st_slot_new(e, &s)) || (rc = st_slot_new(e, &r)))
        die("slot", rc);
    double t_setup = now_s() - t;
    uint64_t state_b = st_model_state_bytes(&hp), kv_tok = st_model_kv_bytes_per_token(&hp, hp.kv_dtype);

    printf("== bench_gpu_engine on %s: %s (%.1f M parameters, %.1f MB running state, "
           "%llu B K/V per token), model written and loaded in %.1f s\n", prop.name,
           spec ? spec : "bench preset",
           (double)st_model_n_params(&hp) / 1e6, (double)state_b / 1e6,
           (unsigned long long)kv_tok, t_setup);
    printf("limits measured now: pinned host->device %.1f GB/s, device->host %.1f GB/s (256 MiB, "
           "best of 5)\n", h2d, d2h);
    printf("| figure | time | rate | limit | ratio |\n|---|---|---|---|---|\n");

    /* prefill and decode */
    uint32_t *toks = malloc((n_tok + 64) * sizeof *toks);
    if (!toks)
        die("tokens", ENOMEM);
    toks[0] = ST_TOKEN_BOS;
    fill(toks, 1, n_tok, 1);
    {
        /* a short context first: what does not grow with the context. A throwaway read and a
         * few decodes before it load the kernels and let cuBLAS pick its algorithms. */
        uint64_t ns = n_tok < 2048 ? n_tok : 2048;
        if ((rc = st_slot_eval(r, toks, ns, 0, NULL)))
            die("warm-up", rc);
        for (int i = 0; i < 4; i++)
            if ((rc = st_slot_decode(r, greedy(r))))
                die("warm-up", rc);
        st_slot_reset(r);
        t = now_s();
        if ((rc = st_slot_eval(r, toks, ns, 0, NULL)))
            die("prefill", rc);
        double tps = now_s() - t;
        t = now_s();
        for (int i = 0; i < 32; i++)
            if ((rc = st_slot_decode(r, greedy(r))))
                die("decode", rc);
        double tds = now_s() - t;
        printf("| prefill %llu tokens | %.3f s | %.0f tok/s | | |\n", (unsigned long long)ns,
               tps, (double)ns / tps);
        printf("| decode 32 tokens at %llu | %.2f ms/token | %.0f tok/s | | |\n",
               (unsigned long long)ns, tds / 32 * 1e3, 32 / tds);
        st_slot_reset(r);
    }
    t = now_s();
    if ((rc = st_slot_eval(s, toks, n_tok, 0, NULL)))
        die("prefill", rc);
    double tp = now_s() - t;
    printf("| prefill %llu tokens (ubatch 2048) | %.3f s | %.0f tok/s | | |\n",
           (unsigned long long)n_tok, tp, (double)n_tok / tp);
    t = now_s();
    for (int i = 0; i < 64; i++)
        if ((rc = st_slot_decode(s, greedy(s))))
            die("decode", rc);
    double td = now_s() - t;
    printf("| decode 64 tokens at %llu | %.1f ms/token | %.0f tok/s | | |\n",
           (unsigned long long)n_tok, td / 64 * 1e3, 64 / td);
    uint64_t n = st_slot_n_tokens(s);

    /* park and restore */
    park_restore(s, r, ST_CODEC_BF16, n * kv_tok + state_b / 2, d2h, h2d);
    park_restore(s, r, ST_CODEC_FP32, n * kv_tok + state_b, d2h, h2d);
    {
        /* what making the image alone costs (statestore allocates and zeroes its buffers) */
        st_image *img = NULL;
        uint32_t ci;
        t = now_s();
        if ((rc = st_image_create(&img, st_slot_geometry(s))) ||
            (rc = st_image_tokens_set(img, st_slot_tokens(s), n)) ||
            (rc = st_image_checkpoint_add(img, n, ST_CODEC_BF16, &ci)))
            die("image", rc);
        printf("|   of which making an empty image of that size: %.1f ms\n", (now_s() - t) * 1e3);
        st_image_free(img);
    }

    /* save to a session file, load it */
    {
        st_image *img = NULL;
        double ts = 1e30, tl = 1e30;
        for (int i = 0; i < 2; i++) {
            t = now_s();
            if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &img)) ||
                (rc = st_file_write(img, sess, NULL)))
                die("save", rc);
            t = now_s() - t;
            ts = t < ts ? t : ts;
            st_image_free(img);
            img = NULL;
            t = now_s();
            if ((rc = st_file_read(sess, NULL, &img)) || (rc = st_slot_restore(r, img)))
                die("load", rc);
            t = now_s() - t;
            tl = t < tl ? t : tl;
            st_image_free(img);
            img = NULL;
        }
        FILE *f = fopen(sess, "rb");
        long fsz = 0;
        if (!f || fseek(f, 0, SEEK_END) || (fsz = ftell(f)) <= 0)
            die("session file size", errno);
        fclose(f);
        double disk = disk_gbs(dir, (uint64_t)fsz);
        double gs = (double)fsz / ts / 1e9;
        printf("| SAVE session file (bf16 state) | %7.1f ms | %6.2f GB/s | write+fsync %5.2f GB/s | "
               "%5.2fx | %.1f MB |\n", ts * 1e3, gs, disk, gs / disk, (double)fsz / 1e6);
        printf("| LOAD session file (read + verified restore) | %7.1f ms | %6.2f GB/s | | |\n",
               tl * 1e3, (double)fsz / tl / 1e9);
        unlink(sess);
    }
    /* save to the state store (LMDB, durable commit), restore from it: a fresh store each time,
     * so that no chunk is shared with an earlier put */
    {
        char sdir[4300], cmd[8800];
        double ts = 1e30, tl = 1e30, tg = 0, tr = 0, tsr = 1e30;
        uint64_t stored = 0;
        const st_image_allocator *ia = st_engine_image_allocator(e);
        for (int i = 0; i < 3; i++) {
            snprintf(sdir, sizeof sdir, "%s/bench-gpu-store", dir);
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", sdir);
            if (system(cmd) != 0)
                die("removing the store", EIO);
            st_store *st = NULL;
            st_store_opts so;
            memset(&so, 0, sizeof so);
            so.create = 1;
            if ((rc = st_store_open(&st, sdir, &so)))
                die("store open", rc);
            st_image *img = NULL;
            st_put_stats ps;
            st_put_opts po;
            memset(&po, 0, sizeof po);
            po.stats = &ps;
            t = now_s();
            if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, ST_CODEC_BF16, &img)) ||
                (rc = st_store_put(st, "bench", img, ST_STORE_HEAD_ANY, &po, NULL)))
                die("save to the store", rc);
            t = now_s() - t;
            ts = t < ts ? t : ts;
            stored = ps.stored_bytes;
            st_image_free(img);
            img = NULL;
            /* as the server's RESTORE: the image in the engine's own buffers (the CUDA
             * backend's pinned pool), restored by adoption */
            t = now_s();
            if ((rc = st_store_get_with(st, "bench", 0, ia, &img)))
                die("restore from the store", rc);
            double t1 = now_s();
            if ((rc = st_slot_restore_adopt(r, img)))
                die("restore from the store", rc);
            double t2 = now_s();
            if (t2 - t < tl) {
                tl = t2 - t;
                tg = t1 - t;
                tr = t2 - t1;
            }
            st_image_free(img);
            img = NULL;
            /* streamed (the server's RESTORE since session 16): the restore moves each chunk to
             * the device once the store has copied and checked it */
            st_store_fill *fill = NULL;
            t = now_s();
            if ((rc = st_store_get_stream(st, "bench", 0, ia, &img, &fill)) ||
                (rc = st_slot_restore_adopt(r, img)) || (rc = st_store_stream_end(fill)))
                die("streamed restore from the store", rc);
            t = now_s() - t;
            tsr = t < tsr ? t : tsr;
            st_image_free(img);
            st_store_close(st);
        }
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", sdir);
        if (system(cmd) != 0)
            die("removing the store", EIO);
        double disk = disk_gbs(dir, stored);
        double gs = (double)stored / ts / 1e9;
        printf("| SAVE to the store (bf16 state, LMDB, durable) | %7.1f ms | %6.2f GB/s | "
               "write+fsync %5.2f GB/s | %5.2fx | %.1f MB stored |\n", ts * 1e3, gs, disk,
               gs / disk, (double)stored / 1e6);
        double gl = (double)stored / tl / 1e9;
        printf("| RESTORE from the store (get, checked + verified restore) | %7.1f ms | %6.2f GB/s "
               "| pinned H2D %5.1f GB/s | %5.2fx |\n", tl * 1e3, gl, h2d, gl / h2d);
        printf("|   (of which st_store_get_with %.1f ms, st_slot_restore_adopt %.1f ms; best of 3)\n",
               tg * 1e3, tr * 1e3);
        double gsr = (double)stored / tsr / 1e9;
        printf("| RESTORE from the store, streamed (st_store_get_stream, chunks to the GPU as they are "
               "checked) | %7.1f ms | %6.2f GB/s | pinned H2D %5.1f GB/s | %5.2fx |\n", tsr * 1e3, gsr,
               h2d, gsr / h2d);
    }
    st_slot_free(s);
    st_slot_free(r);
    st_engine_free(e);

    /* time to first token of a new chat sharing an n_sys-token system prompt */
    {
        uint64_t nu = 64, nt = n_sys + 1 + nu;
        uint32_t *c1 = malloc(nt * sizeof *c1), *c2 = malloc(nt * sizeof *c2);
        if (!c1 || !c2)
            die("tokens", ENOMEM);
        c1[0] = ST_TOKEN_BOS;
        fill(c1, 1, n_sys, 7);
        memcpy(c2, c1, n_sys * sizeof *c1);
        c1[n_sys] = c2[n_sys] = ST_TOKEN_SEP;
        fill(c1, n_sys + 1, nt, 8);
        fill(c2, n_sys + 1, nt, 9);
        st_engine *ec = engine(m, 6, 2048), *e0 = engine(m, 0, 0);
        st_slot *a = NULL, *b = NULL;
        if ((rc = st_slot_new(ec, &a)) || (rc = st_slot_new(e0, &b)))
            die("slot", rc);
        st_eval_stats es;
        if ((rc = st_slot_eval(a, c1, nt, n_sys, &es)))
            die("first chat", rc);
        greedy(a);
        t = now_s();
        if ((rc = st_slot_eval(a, c2, nt, n_sys, &es)))
            die("second chat", rc);
        uint32_t f_cache = greedy(a);
        double t_cache = now_s() - t;
        uint64_t mounted = es.mounted_at, read = es.computed;
        t = now_s();
        if ((rc = st_slot_eval(b, c2, nt, n_sys, &es)))
            die("second chat without the cache", rc);
        uint32_t f_full = greedy(b);
        double t_full = now_s() - t;
        printf("| first token, new chat, %llu-token system prompt: conversation cache | %.1f ms | "
               "root mounted at %llu, %llu tokens read | without the cache: %.1f ms | %.1fx | "
               "first tokens %s |\n", (unsigned long long)n_sys, t_cache * 1e3,
               (unsigned long long)mounted, (unsigned long long)read, t_full * 1e3,
               t_full / t_cache, f_cache == f_full ? "identical" : "DIFFER");
        st_slot_free(a);
        st_slot_free(b);
        st_engine_free(ec);
        st_engine_free(e0);
        free(c1);
        free(c2);
        if (f_cache != f_full || mounted != n_sys) {
            fprintf(stderr, "bench_gpu_engine: the cached first token differs or the root was "
                    "not mounted\n");
            return 1;
        }
    }
    free(toks);
    st_model_free(m);
    unlink(path);
    return 0;
}
