/*
 * bench_engine.c - the attached engine on CPU: prefill and decode tokens/s of the small and
 * bench presets, snapshot / restore of a bench-sized state, and the time to first token of a
 * new conversation sharing a long system prompt with and without the conversation cache.
 *
 *   bench_engine [--quick] [--threads N] [--dir DIR]
 *   bench_engine --model FILE --tokens-file F [--n-gen N] [--threads N] [--runs R] [--dir DIR]
 *                [--eval-runs E]
 *
 * Every figure is printed with a ratio to a limit measured in the same run: the machine's
 * memcpy bandwidth (decode streams the weights once per token) and its fused-multiply-add peak
 * on the same threads (prefill is arithmetic). Models are written with seeded weights into DIR
 * (default $TMPDIR or /tmp) and removed afterwards.
 *
 * With --model, the side of the comparison with llama.cpp (bench/bench_vs_llama.mjs, which sets
 * this against bench/bench_llama.mjs on the same file and tokens): prefill of the tokens, decode
 * of N greedy tokens, then PARK to RAM, a session file SAVE (durable) and LOAD (verified), and a
 * store SAVE and RESTORE (verified), fp32 and bf16, with the default conversation cache and with
 * it off, and the disk's own figures for the session file's bytes (one write + fsync + rename +
 * directory fsync, and the write alone); best of R for each (the prompt read and decoded E
 * times, default R: bench_vs_llama --state-only passes 1); one JSON line on stdout.
 */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <immintrin.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

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
    fprintf(stderr, "bench_engine: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(1);
}

/* ---- limits ------------------------------------------------------------------------------ */
static double memcpy_gbs(void)
{
    size_t n = 256u << 20;
    char *a = malloc(n), *b = malloc(n);
    if (!a || !b)
        die("memcpy buffers", ENOMEM);
    memset(a, 1, n);
    memset(b, 2, n);
    double best = 1e30;
    for (int i = 0; i < 4; i++) {
        double t = now_s();
        memcpy(b, a, n);
        t = now_s() - t;
        if (t < best)
            best = t;
    }
    volatile char sink = b[n / 2];
    (void)sink;
    free(a);
    free(b);
    return (double)n / best / 1e9;
}

__attribute__((target("avx2,fma"))) static void *fma_loop(void *arg)
{
    double *out = arg;
    __m256 m = _mm256_set1_ps(0.999999f), c = _mm256_set1_ps(1e-7f);
    __m256 a0 = _mm256_set1_ps(0.f), a1 = _mm256_set1_ps(1.f), a2 = _mm256_set1_ps(2.f),
           a3 = _mm256_set1_ps(3.f), a4 = _mm256_set1_ps(4.f), a5 = _mm256_set1_ps(5.f),
           a6 = _mm256_set1_ps(6.f), a7 = _mm256_set1_ps(7.f), a8 = _mm256_set1_ps(8.f),
           a9 = _mm256_set1_ps(9.f);
    const long iters = 20000000;
    double t = now_s();
    for (long it = 0; it < iters; it++) {
        a0 = _mm256_fmadd_ps(a0, m, c);
        a1 = _mm256_fmadd_ps(a1, m, c);
        a2 = _mm256_fmadd_ps(a2, m, c);
        a3 = _mm256_fmadd_ps(a3, m, c);
        a4 = _mm256_fmadd_ps(a4, m, c);
        a5 = _mm256_fmadd_ps(a5, m, c);
        a6 = _mm256_fmadd_ps(a6, m, c);
        a7 = _mm256_fmadd_ps(a7, m, c);
        a8 = _mm256_fmadd_ps(a8, m, c);
        a9 = _mm256_fmadd_ps(a9, m, c);
    }
    t = now_s() - t;
    __m256 s = _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)),
                             _mm256_add_ps(_mm256_add_ps(a4, a5), _mm256_add_ps(a6, a7)));
    s = _mm256_add_ps(s, _mm256_add_ps(a8, a9));
    float sink = _mm256_cvtss_f32(s);
    *out = (double)iters * 10 * 16 / t / 1e9 + (sink == 12345.0f ? 1e-30 : 0.0);
    return NULL;
}

/* FMA throughput of n threads running at once, GFLOP/s. */
static double fma_peak(uint32_t n)
{
    if (!st_cpu_has(ST_CPU_AVX2 | ST_CPU_FMA))
        return 0.0;
    pthread_t th[256];
    double r[256] = {0}, sum = 0;
    if (n > 256)
        n = 256;
    for (uint32_t i = 0; i < n; i++)
        pthread_create(&th[i], NULL, fma_loop, &r[i]);
    for (uint32_t i = 0; i < n; i++) {
        pthread_join(th[i], NULL);
        sum += r[i];
    }
    return sum;
}

/* ---- helpers ------------------------------------------------------------------------------- */
typedef struct rig {
    st_model *m;
    st_engine *e;
    st_slot *s;
} rig;

static void rig_open(rig *r, const char *path, const st_engine_opts *o)
{
    int rc;
    memset(r, 0, sizeof *r);
    if ((rc = st_model_load(path, &r->m)))
        die("load", rc);
    if ((rc = st_engine_new(r->m, o, &r->e)))
        die("engine", rc);
    if ((rc = st_slot_new(r->e, &r->s)))
        die("slot", rc);
}

static void rig_close(rig *r)
{
    st_slot_free(r->s);
    st_engine_free(r->e);
    st_model_free(r->m);
}

/* Deterministic pseudo-text tokens: BOS then bytes. */
static void text_tokens(uint32_t *t, uint64_t n, uint64_t seed)
{
    static const char words[] = "the state of a conversation is kept, saved, restored and "
                                "continued token for token; ";
    t[0] = ST_TOKEN_BOS;
    for (uint64_t i = 1; i < n; i++)
        t[i] = (uint8_t)words[(i * 7 + seed) % (sizeof words - 1)];
}

static double weight_flops_per_token(const st_model_hparams *hp)
{
    /* every matrix except the embedding table is read once per token: 2 flops per weight */
    return 2.0 * (double)(st_model_n_params(hp) - (uint64_t)hp->n_vocab * hp->n_embd);
}

static double weight_bytes(const st_model_hparams *hp)
{
    return (double)st_model_n_params(hp) * (hp->wtype == ST_GGML_F32 ? 4 : 2);
}

static void bench_preset(const char *preset, const char *dir, uint32_t threads, uint64_t n_prompt,
                         uint32_t n_gen, double peak, double mem_gbs, int snap)
{
    char path[4200];
    st_model_hparams hp;
    int rc;
    snprintf(path, sizeof path, "%s/bench-%s.gguf", dir, preset);
    if ((rc = st_model_preset(preset, &hp)))
        die("preset", rc);
    double t = now_s();
    if ((rc = st_model_write_seeded(&hp, 1, preset, path)))
        die("write model", rc);
    printf("engine %-5s model: %.1f M parameters, %s weights, written in %.2f s; running state "
           "%.1f MB per checkpoint, K/V %llu B per token\n",
           preset, (double)st_model_n_params(&hp) / 1e6, st_gguf_type_name(hp.wtype),
           now_s() - t, (double)st_model_state_bytes(&hp) / 1e6,
           (unsigned long long)st_model_kv_bytes_per_token(&hp, hp.kv_dtype));
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = threads;
    o.n_ctx = (uint32_t)(n_prompt + n_gen + 16);
    rig r;
    rig_open(&r, path, &o);
    uint32_t *tok = malloc((n_prompt + 1) * sizeof *tok);
    if (!tok)
        die("tokens", ENOMEM);
    text_tokens(tok, n_prompt, 3);
    t = now_s();
    if ((rc = st_slot_eval(r.s, tok, n_prompt, 0, NULL)))
        die("prefill", rc);
    double tp = now_s() - t;
    double pf = (double)n_prompt / tp;
    double wf = weight_flops_per_token(&hp);
    printf("engine %-5s prefill: %llu tokens in %.3f s = %.1f tok/s; weight arithmetic %.1f "
           "GFLOP/s = %.3f x FMA peak (%.1f GFLOP/s, %u threads)\n",
           preset, (unsigned long long)n_prompt, tp, pf, pf * wf / 1e9,
           peak > 0 ? pf * wf / 1e9 / peak : 0.0, peak, threads);
    t = now_s();
    for (uint32_t i = 0; i < n_gen; i++) {
        uint32_t next;
        if ((rc = st_slot_sample(r.s, 0.0f, 1, &next)) || (rc = st_slot_decode(r.s, next)))
            die("decode", rc);
    }
    double td = now_s() - t;
    double df = (double)n_gen / td;
    /* a decoded token reads every weight once and the running state twice, and writes it once */
    double touched = weight_bytes(&hp) + 3.0 * (double)st_model_state_bytes(&hp);
    printf("engine %-5s decode: %u tokens after %llu in %.3f s = %.1f tok/s; weights and running "
           "state touched at %.2f GB/s = %.3f x memcpy (%.2f GB/s)\n",
           preset, n_gen, (unsigned long long)n_prompt, td, df, df * touched / 1e9,
           df * touched / 1e9 / mem_gbs, mem_gbs);
    if (snap) {
        st_image *img = NULL;
        t = now_s();
        if ((rc = st_slot_snapshot(r.s, ST_SNAPSHOT_SESSION, ST_CODEC_FP32, &img)))
            die("snapshot", rc);
        double ts = now_s() - t;
        uint64_t bytes = st_image_bytes(img);
        rig r2;
        rig_open(&r2, path, &o);
        t = now_s();
        if ((rc = st_slot_restore(r2.s, img)))
            die("restore", rc);
        double tr = now_s() - t;
        printf("engine %-5s snapshot: %.1f MB image (%llu tokens, %u checkpoints) in %.3f s = "
               "%.2f GB/s = %.3f x memcpy; restore (verified) in %.3f s = %.2f GB/s = %.3f x "
               "memcpy\n",
               preset, (double)bytes / 1e6, (unsigned long long)st_image_n_tokens(img),
               st_image_n_checkpoints(img), ts, (double)bytes / ts / 1e9,
               (double)bytes / ts / 1e9 / mem_gbs, tr, (double)bytes / tr / 1e9,
               (double)bytes / tr / 1e9 / mem_gbs);
        st_image_free(img);
        rig_close(&r2);
    }
    free(tok);
    rig_close(&r);
    unlink(path);
}

/* Time to first token of a new conversation sharing a system prompt of n_sys tokens. */
static void bench_ttft(const char *dir, uint32_t threads, uint64_t n_sys)
{
    char path[4200];
    st_model_hparams hp;
    int rc;
    snprintf(path, sizeof path, "%s/bench-ttft.gguf", dir);
    if ((rc = st_model_preset("small", &hp)) || (rc = st_model_write_seeded(&hp, 1, "small", path)))
        die("model", rc);
    uint64_t n_user = 64;
    uint64_t n = n_sys + 1 + n_user;
    uint32_t *c1 = malloc(n * sizeof *c1), *c2 = malloc(n * sizeof *c2);
    if (!c1 || !c2)
        die("tokens", ENOMEM);
    text_tokens(c1, n_sys, 5);
    c1[n_sys] = ST_TOKEN_SEP;
    memcpy(c2, c1, (n_sys + 1) * sizeof *c1);
    for (uint64_t i = 0; i < n_user; i++) {
        c1[n_sys + 1 + i] = (uint32_t)('a' + i % 26);
        c2[n_sys + 1 + i] = (uint32_t)('A' + i % 26);
    }
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = threads;
    o.n_ctx = (uint32_t)(n + 64);
    o.prompt_cache_root = 2048;
    /* with the cache: the first conversation leaves the root checkpoint behind */
    rig r;
    rig_open(&r, path, &o);
    st_eval_stats es;
    uint32_t first_cached, first_full, tk;
    if ((rc = st_slot_eval(r.s, c1, n, n_sys, &es)))
        die("conversation 1", rc);
    for (int i = 0; i < 8; i++)
        if ((rc = st_slot_sample(r.s, 0.0f, 1, &tk)) || (rc = st_slot_decode(r.s, tk)))
            die("conversation 1 decode", rc);
    double t = now_s();
    if ((rc = st_slot_eval(r.s, c2, n, n_sys, &es)) ||
        (rc = st_slot_sample(r.s, 0.0f, 1, &first_cached)))
        die("conversation 2 (cache)", rc);
    double t_cache = now_s() - t;
    uint64_t mounted = es.mounted_at, computed = es.computed;
    rig_close(&r);
    /* without: the same conversation read in full */
    o.prompt_cache = 0;
    rig_open(&r, path, &o);
    t = now_s();
    if ((rc = st_slot_eval(r.s, c2, n, n_sys, &es)) ||
        (rc = st_slot_sample(r.s, 0.0f, 1, &first_full)))
        die("conversation 2 (full read)", rc);
    double t_full = now_s() - t;
    rig_close(&r);
    printf("engine small time to first token, %llu-token system prompt + %llu-token message: "
           "without cache %.3f s, with cache %.3f s (mounted the root at %llu, read %llu tokens) "
           "= %.1fx faster; first tokens %s\n",
           (unsigned long long)n_sys, (unsigned long long)n_user, t_full, t_cache,
           (unsigned long long)mounted, (unsigned long long)computed, t_full / t_cache,
           first_cached == first_full ? "identical" : "DIFFER");
    free(c1);
    free(c2);
    unlink(path);
    if (first_cached != first_full)
        exit(1);
}


/* ---- --model: the side of the comparison with llama.cpp ------------------------------------ */
static double rss_mb(const char *field)
{
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    double v = 0;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (!strncmp(line, field, n) && line[n] == ':')
            v = strtod(line + n + 1, NULL) / 1024.0;
    if (f)
        fclose(f);
    return v;
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
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

typedef struct side_fig {
    double ms;
    uint64_t bytes;
} side_fig;

static void fig_min(side_fig *f, double ms, uint64_t bytes)
{
    if (f->bytes == 0 || ms < f->ms)
        f->ms = ms;
    f->bytes = bytes;
}

static void fig_json(const char *name, const side_fig *f, int comma)
{
    printf("\"%s\":{\"bytes\":%llu,\"ms\":%.4f}%s", name, (unsigned long long)f->bytes, f->ms,
           comma ? "," : "");
}

/* Prefill and decode runs; the slot is left holding the last run's conversation. */
static void side_eval(rig *r, const uint32_t *tok, uint64_t n, uint32_t n_gen, int runs,
                      double *prefill_s, double *decode_s)
{
    int rc;
    *prefill_s = *decode_s = 1e30;
    for (int k = 0; k < runs; k++) {
        st_slot_reset(r->s);
        double t = now_s();
        if ((rc = st_slot_eval(r->s, tok, n, 0, NULL)))
            die("prefill", rc);
        t = now_s() - t;
        if (t < *prefill_s)
            *prefill_s = t;
        t = now_s();
        for (uint32_t i = 0; i < n_gen; i++) {
            uint32_t next;
            if ((rc = st_slot_sample(r->s, 0.0f, 1, &next)) || (rc = st_slot_decode(r->s, next)))
                die("decode", rc);
        }
        t = now_s() - t;
        if (t < *decode_s)
            *decode_s = t;
    }
}

/* What the disk allows for a session file's bytes: the same bytes written by one write() into a
 * new file with st_file_replace (temp file, fsync, rename, directory fsync: the durability of a
 * SAVE), and written into the page cache alone (no fsync: llama.cpp's saveStateToFile). */
static void disk_peer(const char *path, side_fig *durable, side_fig *cached)
{
    char peer[4300];
    FILE *f = fopen(path, "rb");
    struct stat sb;
    if (!f || fstat(fileno(f), &sb))
        die("disk peer: session file", errno);
    size_t n = (size_t)sb.st_size;
    uint8_t *buf = malloc(n ? n : 1);
    if (!buf || fread(buf, 1, n, f) != n)
        die("disk peer: read", errno ? errno : EIO);
    fclose(f);
    snprintf(peer, sizeof peer, "%s.peer", path);
    double t = now_s();
    int rc = st_file_replace(peer, buf, n);
    if (rc)
        die("disk peer: durable write", rc);
    fig_min(durable, (now_s() - t) * 1e3, n);
    unlink(peer);
    t = now_s();
    int fd = open(peer, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    size_t done = 0;
    while (fd >= 0 && done < n) {
        ssize_t w = write(fd, buf + done, n - done);
        if (w <= 0)
            break;
        done += (size_t)w;
    }
    if (fd < 0 || done != n || close(fd))
        die("disk peer: write", errno ? errno : EIO);
    fig_min(cached, (now_s() - t) * 1e3, n);
    unlink(peer);
    free(buf);
}

/* One durable session-file SAVE (snapshot + st_file_write with wo), its verified LOAD (read with
 * every section checked, then the restore), and the disk's own figures for the same bytes. */
static void side_file(rig *r, const char *path, uint32_t codec, const st_file_write_opts *wo,
                      side_fig *fsave, side_fig *fload, side_fig *pdur, side_fig *pwrite)
{
    st_image *img = NULL, *back = NULL;
    st_file_read_opts ro = {.alloc = st_engine_image_allocator(r->e)};
    struct stat sb;
    int rc;
    double t = now_s();
    if ((rc = st_slot_snapshot(r->s, ST_SNAPSHOT_SESSION, codec, &img)) ||
        (rc = st_file_write(img, path, wo)))
        die("session file save", rc);
    double ms = (now_s() - t) * 1e3;
    st_image_free(img);
    if (stat(path, &sb))
        die("session file", errno);
    fig_min(fsave, ms, (uint64_t)sb.st_size);
    t = now_s();
    if ((rc = st_file_read(path, &ro, &back)) || (rc = st_slot_restore_adopt(r->s, back)))
        die("session file load", rc);
    fig_min(fload, (now_s() - t) * 1e3, (uint64_t)sb.st_size);
    st_image_free(back);
    disk_peer(path, pdur, pwrite);
    unlink(path);
}

/* PARK / session file / store, SAVE and RESTORE, of the slot's conversation in one codec; in
 * bf16 also the session file with its checkpoints compressed (zstd level 1, byte-shuffled). */
static void side_state(rig *r, const char *dir, uint32_t codec, int runs, const char *tag)
{
    side_fig park = {0}, unpark = {0}, fsave = {0}, fload = {0}, ssave = {0}, sload = {0};
    side_fig pdur = {0}, pwrite = {0}, zsave = {0}, zload = {0}, zdur = {0}, zwrite = {0};
    const st_file_write_opts z1 = {.compress = 1, .shuffle = 1};
    uint64_t n_tok = st_slot_n_tokens(r->s);
    char path[4200], sdir[4200];
    int rc;
    snprintf(path, sizeof path, "%s/strata-session.stf", dir);
    for (int k = 0; k < runs; k++) {
        st_image *img = NULL, *back = NULL;
        double t = now_s();
        if ((rc = st_slot_snapshot(r->s, ST_SNAPSHOT_PARK, codec, &img)))
            die("park", rc);
        fig_min(&park, (now_s() - t) * 1e3, st_image_bytes(img));
        t = now_s();
        if ((rc = st_slot_restore(r->s, img)))
            die("restore from RAM", rc);
        fig_min(&unpark, (now_s() - t) * 1e3, st_image_bytes(img));
        st_image_free(img);
        img = NULL;
        side_file(r, path, codec, NULL, &fsave, &fload, &pdur, &pwrite);
        if (codec == ST_CODEC_BF16)
            side_file(r, path, codec, &z1, &zsave, &zload, &zdur, &zwrite);
        /* the store: a new one each run (a second put of the same state would store nothing) */
        snprintf(sdir, sizeof sdir, "%s/strata-store", dir);
        nftw(sdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        st_store *st = NULL;
        st_put_stats ps;
        if ((rc = st_store_open(&st, sdir, &(st_store_opts){.create = 1})))
            die("store open", rc);
        st_image_free(img);
        img = NULL;
        t = now_s();
        if ((rc = st_slot_snapshot(r->s, ST_SNAPSHOT_SESSION, codec, &img)) ||
            (rc = st_store_put(st, "bench", img, ST_STORE_HEAD_ANY,
                               &(st_put_opts){.stats = &ps}, NULL)))
            die("store save", rc);
        fig_min(&ssave, (now_s() - t) * 1e3, st_image_bytes(img));
        t = now_s();
        if ((rc = st_store_get_with(st, "bench", 0, st_engine_image_allocator(r->e), &back)) ||
            (rc = st_slot_restore_adopt(r->s, back)))
            die("store restore", rc);
        fig_min(&sload, (now_s() - t) * 1e3, st_image_bytes(back));
        st_image_free(back);
        st_image_free(img);
        st_store_close(st);
        nftw(sdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
        if (st_slot_n_tokens(r->s) != n_tok)
            die("restored conversation has another length", ST_ECORRUPT);
    }
    printf("\"%s\":{", tag);
    fig_json("park", &park, 1);
    fig_json("restore_ram", &unpark, 1);
    fig_json("file_save", &fsave, 1);
    fig_json("file_load", &fload, 1);
    fig_json("store_save", &ssave, 1);
    fig_json("store_load", &sload, 1);
    fig_json("disk_durable", &pdur, 1);
    fig_json("disk_write", &pwrite, codec == ST_CODEC_BF16);
    if (codec == ST_CODEC_BF16) {
        fig_json("file_save_z1", &zsave, 1);
        fig_json("file_load_z1", &zload, 1);
        fig_json("disk_durable_z1", &zdur, 1);
        fig_json("disk_write_z1", &zwrite, 0);
    }
    printf("}");
}

static int side_main(const char *model, const char *tokens_file, uint32_t n_gen, uint32_t threads,
                     int runs, int eval_runs, const char *dir)
{
    uint64_t n;
    uint32_t *tok = read_tokens(tokens_file, &n);
    double rss_base = rss_mb("VmRSS");
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.n_threads = threads;
    o.n_ctx = (uint32_t)(n + n_gen);
    rig r;
    rig_open(&r, model, &o);
    double tp, td;
    side_eval(&r, tok, n, n_gen, eval_runs, &tp, &td);
    printf("{\"engine\":\"strata\",\"threads\":%u,\"n_prompt\":%llu,\"n_gen\":%u,\"n_ctx\":%u,"
           "\"isa\":\"%s\",\"rss_base_mb\":%.1f,\"prefill_tps\":%.3f,\"decode_tps\":%.3f,"
           "\"rss_mb\":%.1f,",
           threads, (unsigned long long)n, n_gen, o.n_ctx, st_engine_isa(r.e), rss_base,
           (double)n / tp, (double)n_gen / td, rss_mb("VmRSS"));
    printf("\"checkpoints\":%u,", st_slot_n_checkpoints(r.s));
    side_state(&r, dir, ST_CODEC_FP32, runs, "fp32");
    printf(",");
    side_state(&r, dir, ST_CODEC_BF16, runs, "bf16");
    rig_close(&r);
    /* the same conversation with the conversation cache off: the slot keeps no checkpoint, so a
     * session image carries the live state alone */
    o.prompt_cache = 0;
    rig_open(&r, model, &o);
    side_eval(&r, tok, n, n_gen, 1, &tp, &td);
    printf(",\"cache_off\":{");
    side_state(&r, dir, ST_CODEC_FP32, runs, "fp32");
    printf(",");
    side_state(&r, dir, ST_CODEC_BF16, runs, "bf16");
    rig_close(&r);
    printf("},\"hwm_mb\":%.1f}\n", rss_mb("VmHWM"));
    free(tok);
    return 0;
}

int main(int argc, char **argv)
{
    int quick = 0, runs = 3, eval_runs = 0;
    uint32_t threads = 0, n_gen = 32;
    const char *model = NULL, *tokens_file = NULL;
    const char *dir = getenv("TMPDIR");
    if (!dir || !*dir)
        dir = "/tmp";
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quick"))
            quick = 1;
        else if (!strcmp(argv[i], "--threads") && i + 1 < argc)
            threads = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--dir") && i + 1 < argc)
            dir = argv[++i];
        else if (!strcmp(argv[i], "--model") && i + 1 < argc)
            model = argv[++i];
        else if (!strcmp(argv[i], "--tokens-file") && i + 1 < argc)
            tokens_file = argv[++i];
        else if (!strcmp(argv[i], "--n-gen") && i + 1 < argc)
            n_gen = (uint32_t)atoi(argv[++i]);
        else if (!strcmp(argv[i], "--runs") && i + 1 < argc)
            runs = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--eval-runs") && i + 1 < argc)
            eval_runs = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: bench_engine [--quick] [--threads N] [--dir DIR]\n"
                            "       bench_engine --model FILE --tokens-file F [--n-gen N (32)] "
                            "[--threads N] [--runs R (3)] [--dir DIR] [--eval-runs E (R)]\n");
            return 2;
        }
    }
    if (threads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        threads = n > 0 ? (uint32_t)n : 1;
    }
    if (model || tokens_file) {
        if (!eval_runs)
            eval_runs = runs;
        if (!model || !tokens_file || runs < 1 || n_gen < 1 || eval_runs < 1) {
            fprintf(stderr, "bench_engine: --model needs --tokens-file, --runs >= 1, --n-gen >= 1, "
                            "--eval-runs >= 1\n");
            return 2;
        }
        return side_main(model, tokens_file, n_gen, threads, runs, eval_runs, dir);
    }
    double mem = memcpy_gbs();
    double peak = fma_peak(threads);
    printf("engine limits: memcpy %.2f GB/s; FMA peak %.1f GFLOP/s on %u threads%s\n", mem, peak,
           threads, quick ? " (--quick: shorter prompts)" : "");
    bench_preset("small", dir, threads, quick ? 512 : 2048, quick ? 32 : 128, peak, mem, 0);
    bench_preset("bench", dir, threads, quick ? 256 : 1024, quick ? 8 : 32, peak, mem, 1);
    bench_ttft(dir, threads, quick ? 2048 : 16384);
    return 0;
}
