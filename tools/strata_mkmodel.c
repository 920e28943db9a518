/*
 * strata-mkmodel - write a GGUF with seeded weights, of any architecture the engine runs.
 *
 *   strata-mkmodel [--arch strata-hybrid|llama|qwen3|qwen35|qwen35moe|qwen3next] --preset NAME
 *                  [--seed S] [geometry flags] [--wtype TYPE] [--f32-twin] [--nextn N]
 *                  [--split-max-tensors N] [--vocab-from tokenizer.json] -o FILE
 *   strata-mkmodel --vocab-from tokenizer.json [--vocab-config F] [--pre NAME] -o FILE
 *
 * The weights come from a seeded generator: the model computes real state and restores exactly,
 * but the text it writes is not meaningful.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_engine.h"
#include "strata_vocab_json.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: strata-mkmodel [--arch A] --preset NAME [--seed S] [options] -o FILE\n"
            "       strata-mkmodel --vocab-from tokenizer.json [--vocab-config F] [--pre NAME]\n"
            "                      -o FILE   (a vocabulary-only GGUF)\n"
            "  --arch A          strata-hybrid (default), llama, qwen3, qwen35, qwen35moe,\n"
            "                    qwen3next\n"
            "  --preset NAME     strata-hybrid: tiny, small, bench\n"
            "                    llama: tiny, tiny-untied, tiny-q, llama-3.2-1b, llama-3.1-8b\n"
            "                    qwen3: tiny, tiny-untied, tiny-q, qwen3-0.6b, qwen3-8b\n"
            "                    qwen35: qwen35-tiny, qwen35-tiny-tied, qwen35-tiny-q, qwen35-small\n"
            "                    (key heads != value heads), qwen35-0.8b, qwen35-2b, qwen35-9b\n"
            "                    qwen35moe: qwen35moe-tiny, qwen35moe-tiny-q, qwen35moe-35b-a3b\n"
            "                    qwen3next: qwen3next-tiny, qwen3next-tiny-legacy, qwen3next-tiny-q,\n"
            "                    qwen3next-80b-a3b\n"
            "                    (tiny-q: every row a multiple of 256, for the K-quants)\n"
            "                    (the published shapes; fewer layers with --layers)\n"
            "  --ssm-groups N    DeltaNet key heads (the Qwen hybrids)\n"
            "  --tied 0|1        llama, qwen3: the LM head is token_embd (no output.weight)\n"
            "  --rope-freqs 0|1  llama: write rope_freqs.weight (Llama 3's factors)\n"
            "  --layers N        block count           --pattern P   layer pattern of D and A\n"
            "  --embd N          embedding width       --ffn N       feed-forward width\n"
            "  --heads N         attention heads       --kv-heads N  attention K/V heads\n"
            "  --head-dim N      attention head width  --ctx N       context length\n"
            "  --ssm-heads N     DeltaNet heads        --ssm-dk N    DeltaNet key width\n"
            "  --ssm-dv N        DeltaNet value width  --vocab N     vocabulary (>= 259)\n"
            "  --kv-dtype f16|i8 default K/V dtype     --wtype TYPE  weight type\n"
            "  --name NAME       general.name\n"
            "  --f32-twin        store the --wtype weights widened to F32 (the same values)\n"
            "  --nextn N         qwen35, qwen35moe, qwen3next: N trailing MTP blocks (default 0;\n"
            "                    block_count = layers + N, nextn_predict_layers = N; never run)\n"
            "  --split-max-tensors N  write a split model of at most N tensors per part\n"
            "                    (default: one file): FILE minus .gguf names the parts\n"
            "                    FILE-00001-of-0000K.gguf ... (llama.cpp's gguf-split layout)\n"
            "  --vocab-from F    the vocabulary of a Hugging Face tokenizer.json (byte-level BPE),\n"
            "                    converted as llama.cpp's convert_hf_to_gguf.py does (tokens,\n"
            "                    types, merges, pre, special ids, chat template); with --preset\n"
            "                    the model's vocabulary (--vocab becomes its size), without it a\n"
            "                    vocabulary-only file (default: the preset's seeded vocabulary)\n"
            "  --vocab-config F  its tokenizer_config.json (default: the one beside it, if any)\n"
            "  --pre NAME        the pre-tokenizer, qwen2 | qwen35 | llama-bpe (default: told\n"
            "                    from tokenizer.json's regex)\n"
            "TYPE: f32, f16, bf16 (written directly), or q8_0, q4_0, q4_1, q5_0, q5_1, q2_K,\n"
            "q3_K, q4_K, q5_K, q6_K, iq4_nl, iq4_xs (any case): the seeded f32 model quantized\n"
            "as `strata quantize` does.\n"
            "Seeded weights: the text such a model writes is not meaningful.\n"
            "  --help, -h        this text\n"
            "  --version         the version\n");
}

static void mk_log(void *ctx, const char *line)
{
    (void)ctx;
    fprintf(stderr, "strata-mkmodel: %s\n", line);
}

static int parse_u32(const char *flag, const char *v, uint32_t *out)
{
    char *end;
    errno = 0;
    unsigned long x = v ? strtoul(v, &end, 10) : 0;
    if (!v || errno || *end || end == v || x > UINT32_MAX) {
        fprintf(stderr, "strata-mkmodel: %s needs a number, got \"%s\"\n", flag, v ? v : "");
        return -1;
    }
    *out = (uint32_t)x;
    return 0;
}

/* tokenizer_config.json beside a tokenizer.json, when there is one. */
static int config_beside(const char *tok, char *dst, size_t cap)
{
    const char *sl = strrchr(tok, '/');
    snprintf(dst, cap, "%.*stokenizer_config.json", sl ? (int)(sl - tok + 1) : 0, tok);
    return access(dst, R_OK) == 0;
}

/* The GGUF at in with its tokenizer.* keys replaced by vw's: vw takes in's other keys and its
 * tensors (borrowed from the mapping until the write) and writes out atomically. */
static int with_vocab(const char *in, st_gguf_writer *vw, const char *out)
{
    st_gguf *g = NULL;
    int rc = st_gguf_open(in, &g);
    for (uint64_t i = 0; !rc && i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (strncmp(k, "tokenizer.", 10) && strcmp(k, "general.alignment"))
            rc = st_gguf_writer_copy_kv(vw, g, i);
    }
    for (uint64_t i = 0; !rc && i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        rc = st_gguf_writer_add_tensor(vw, t->name, t->type, t->n_dims, t->dims, t->data);
    }
    if (!rc)
        rc = st_gguf_writer_write(vw, out);
    st_gguf_close(g);
    return rc;
}

/* strata-mkmodel --vocab-from F [--vocab-config F] [--pre NAME] -o FILE: the vocabulary alone. */
static int vocab_only(int argc, char **argv)
{
    const char *from = NULL, *cfg = NULL, *pre = NULL, *out = NULL;
    char vcfg[4096], e[1024];
    for (int i = 1; i < argc; i += 2) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "strata-mkmodel: unknown or incomplete option %s\n", a);
            return 2;
        }
        if (!strcmp(a, "--vocab-from"))
            from = v;
        else if (!strcmp(a, "--vocab-config"))
            cfg = v;
        else if (!strcmp(a, "--pre"))
            pre = v;
        else if (!strcmp(a, "-o") || !strcmp(a, "--output"))
            out = v;
        else {
            fprintf(stderr, "strata-mkmodel: %s needs --preset (a vocabulary-only file takes "
                            "--vocab-from, --vocab-config, --pre, -o)\n", a);
            return 2;
        }
    }
    if (!out) {
        fprintf(stderr, "strata-mkmodel: -o FILE is required\n");
        return 2;
    }
    if (!cfg && config_beside(from, vcfg, sizeof vcfg))
        cfg = vcfg;
    st_gguf_writer *w = NULL;
    uint32_t n = 0;
    int rc = st_gguf_writer_new(&w, 0);
    if (!rc && strata_vocab_json(from, cfg, pre, w, &n, &pre, e, sizeof e)) {
        fprintf(stderr, "strata-mkmodel: --vocab-from: %s\n", e);
        st_gguf_writer_free(w);
        return 1;
    }
    /* llama.cpp loads a vocabulary-only file of an architecture it knows */
    if (!rc)
        rc = st_gguf_writer_set_str(w, "general.architecture",
                                    !strcmp(pre, "llama-bpe") ? "llama"
                                    : !strcmp(pre, "qwen35") ? "qwen35" : "qwen3");
    if (!rc)
        rc = st_gguf_writer_write(w, out);
    st_gguf_writer_free(w);
    if (rc) {
        fprintf(stderr, "strata-mkmodel: %s: %s\n", st_strerror(rc), st_errdetail());
        return 1;
    }
    fprintf(stderr, "strata-mkmodel: wrote %s: the vocabulary of %s, %u tokens\n", out, from, n);
    return 0;
}

int main(int argc, char **argv)
{
    const char *preset = NULL, *out = NULL, *name = NULL, *arch = NULL;
    const char *vocab_from = NULL, *vocab_cfg = NULL, *pre = NULL;
    int twin = 0;
    uint64_t seed = 1;
    uint32_t qtype = ST_GGML_F32; /* --wtype of a quantized type: quantize the f32 model */
    uint32_t split_max = 0;       /* --split-max-tensors: 0 writes one file */
    st_model_hparams hp;
    struct {
        const char *flag;
        uint32_t *dst;
    } nums[] = {
        {"--layers", &hp.n_layer},   {"--embd", &hp.n_embd},        {"--ffn", &hp.n_ff},
        {"--heads", &hp.n_head},     {"--kv-heads", &hp.n_head_kv}, {"--head-dim", &hp.head_dim},
        {"--ctx", &hp.n_ctx},        {"--ssm-heads", &hp.ssm_heads}, {"--ssm-dk", &hp.ssm_dk},
        {"--ssm-dv", &hp.ssm_dv},    {"--vocab", &hp.n_vocab},
        {"--ssm-groups", &hp.ssm_groups}, {"--tied", &hp.tied},      {"--rope-freqs", &hp.rope_freqs},
        {"--nextn", &hp.n_nextn},   {"--split-max-tensors", &split_max},
    };
    /* first pass: --help and --version, the architecture and the preset, so flags override it
     * wherever they stand */
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--version")) {
            printf("strata-mkmodel %s\n", st_version());
            return 0;
        }
        if (!strcmp(argv[i], "--preset") && i + 1 < argc)
            preset = argv[i + 1];
        if (!strcmp(argv[i], "--arch") && i + 1 < argc)
            arch = argv[i + 1];
        if (!strcmp(argv[i], "--vocab-from") && i + 1 < argc)
            vocab_from = argv[i + 1];
    }
    if (!preset && vocab_from)
        return vocab_only(argc, argv);
    if (!preset) {
        usage(stderr);
        return 2;
    }
    if (st_model_preset_arch(arch, preset, &hp)) {
        fprintf(stderr, "strata-mkmodel: %s\n", st_errdetail());
        return 2;
    }
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        int matched = 0;
        if (!strcmp(a, "--f32-twin")) {
            twin = 1;
            continue;
        }
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            usage(stdout);
            return 0;
        }
        for (size_t k = 0; k < sizeof nums / sizeof nums[0]; k++)
            if (!strcmp(a, nums[k].flag)) {
                if (parse_u32(a, v, nums[k].dst))
                    return 2;
                matched = 1;
            }
        if (matched) {
            i++;
            continue;
        }
        if (!v) {
            fprintf(stderr, "strata-mkmodel: unknown or incomplete option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (!strcmp(a, "--preset") || !strcmp(a, "--arch") || !strcmp(a, "--vocab-from")) {
        } else if (!strcmp(a, "--vocab-config")) {
            vocab_cfg = v;
        } else if (!strcmp(a, "--pre")) {
            pre = v;
        } else if (!strcmp(a, "-o") || !strcmp(a, "--output")) {
            out = v;
        } else if (!strcmp(a, "--name")) {
            name = v;
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            seed = strtoull(v, &end, 0);
            if (errno || *end || end == v) {
                fprintf(stderr, "strata-mkmodel: --seed needs a number\n");
                return 2;
            }
        } else if (!strcmp(a, "--pattern")) {
            if (strlen(v) >= ST_PATTERN_MAX) {
                fprintf(stderr, "strata-mkmodel: --pattern longer than %d\n", ST_PATTERN_MAX - 1);
                return 2;
            }
            snprintf(hp.pattern, sizeof hp.pattern, "%s", v);
        } else if (!strcmp(a, "--kv-dtype")) {
            if (!strcmp(v, "f16"))
                hp.kv_dtype = ST_DTYPE_F16;
            else if (!strcmp(v, "i8"))
                hp.kv_dtype = ST_DTYPE_I8;
            else {
                fprintf(stderr, "strata-mkmodel: --kv-dtype f16 or i8\n");
                return 2;
            }
        } else if (!strcmp(a, "--wtype")) {
            uint32_t t;
            if (st_quantize_type_parse(v, &t)) {
                fprintf(stderr, "strata-mkmodel: --wtype: %s\n", st_errdetail());
                return 2;
            }
            int direct = t == ST_GGML_F32 || t == ST_GGML_F16 || t == ST_GGML_BF16;
            hp.wtype = direct ? t : ST_GGML_F32;
            qtype = direct ? ST_GGML_F32 : t;
        } else {
            fprintf(stderr, "strata-mkmodel: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        i++;
    }
    if (!out) {
        fprintf(stderr, "strata-mkmodel: -o FILE is required\n");
        return 2;
    }
    char nm[128];
    if (!name) {
        snprintf(nm, sizeof nm, "%s %s (seed %llu)", arch ? arch : ST_ARCH, preset,
                 (unsigned long long)seed);
        name = nm;
    }
    if (twin && qtype != ST_GGML_F32) {
        fprintf(stderr, "strata-mkmodel: --f32-twin takes --wtype f32, f16 or bf16 (a quantized "
                        "type's twin is `strata quantize` then an F32 re-quantize)\n");
        return 2;
    }
    /* a quantized type: the seeded f32 model next to OUT, then quantized into OUT; a split
     * model: the whole file next to OUT, then split into its parts */
    char tmp[4096], whole[4096], prefix[4096];
    const char *dst = out, *qdst = out;
    if (split_max) {
        size_t ol = strlen(out);
        snprintf(prefix, sizeof prefix, "%.*s", (int)(ol > 5 && !strcmp(out + ol - 5, ".gguf")
                                                          ? ol - 5 : ol), out);
        snprintf(whole, sizeof whole, "%s.whole.%d", out, (int)getpid());
        dst = qdst = whole;
    }
    if (qtype != ST_GGML_F32) {
        snprintf(tmp, sizeof tmp, "%s.f32.%d", out, (int)getpid());
        dst = tmp;
    }
    /* --vocab-from: the seeded model of that vocabulary's size next to OUT, then its keys */
    char vtmp[4096], vcfg[4096], e[1024];
    const char *seeded = dst;
    st_gguf_writer *vw = NULL;
    if (vocab_from) {
        if (!vocab_cfg && config_beside(vocab_from, vcfg, sizeof vcfg))
            vocab_cfg = vcfg;
        if (st_gguf_writer_new(&vw, 0) ||
            strata_vocab_json(vocab_from, vocab_cfg, pre, vw, &hp.n_vocab, NULL, e, sizeof e)) {
            fprintf(stderr, "strata-mkmodel: --vocab-from: %s\n", vw ? e : st_errdetail());
            st_gguf_writer_free(vw);
            return 1;
        }
        snprintf(vtmp, sizeof vtmp, "%s.seeded.%d", out, (int)getpid());
        seeded = vtmp;
    }
    int rc = twin ? st_model_write_seeded_f32_twin(&hp, seed, name, seeded)
                  : st_model_write_seeded(&hp, seed, name, seeded);
    if (vocab_from) {
        if (!rc)
            rc = with_vocab(vtmp, vw, dst);
        st_sys_calls.unlink(vtmp);
        st_gguf_writer_free(vw);
    }
    if (!rc && qtype != ST_GGML_F32) {
        st_quantize_opts qo = {mk_log, NULL, 0};
        rc = st_gguf_quantize(tmp, qdst, qtype, &qo, NULL);
        st_sys_calls.unlink(tmp);
    }
    uint32_t parts = 1;
    if (!rc && split_max) {
        rc = st_gguf_split(whole, prefix, split_max, &parts);
        st_sys_calls.unlink(whole);
    }
    if (rc) {
        fprintf(stderr, "strata-mkmodel: %s: %s\n", st_strerror(rc), st_errdetail());
        return 1;
    }
    if (split_max)
        fprintf(stderr, "strata-mkmodel: %u parts %s-00001-of-%05u.gguf ...\n", parts, prefix,
                parts);
    fprintf(stderr,
            "strata-mkmodel: wrote %s: %s, %u layers \"%s\", %.2f M parameters, running state "
            "%llu B per checkpoint, K/V %llu B per token (seeded weights: not meaningful text)\n",
            out, preset, hp.n_layer, hp.pattern, (double)st_model_n_params(&hp) / 1e6,
            (unsigned long long)st_model_state_bytes(&hp),
            (unsigned long long)st_model_kv_bytes_per_token(&hp, hp.kv_dtype));
    return 0;
}
