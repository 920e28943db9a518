/*
 * strata - the command-line runner of the attached engine.
 *
 *   strata generate -m MODEL -p PROMPT -n N [options]
 *   strata info -m MODEL
 *   strata logits -m MODEL --tokens 1,2,3 [--tokens-file F] [--kv-dtype f16|f32|i8] -o FILE
 *   strata quantize IN OUT TYPE
 *   strata chat-template -m MODEL --conversation FILE.json
 *   strata tokenize -m MODEL [--parse-special] [--file F | TEXT]   (strata_tokenize.c)
 *   strata detokenize -m MODEL ID...
 *
 * stdout carries only the generated text (or token ids with --tokens); logs and timings go to
 * stderr. With --session-in the prompt continues the restored conversation (after a turn
 * separator); --session-out saves the conversation after generation.
 */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "st_engine.h"
#include "st_file.h"
#include "strata_tokenize.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: strata generate -m MODEL -p PROMPT -n N [options]\n"
            "       strata info -m MODEL   (a split model: its first part)\n"
            "       strata logits -m MODEL (--tokens 1,2,3 | --tokens-file F) -o FILE [options]\n"
            "       strata quantize IN OUT TYPE\n"
            "       strata chat-template -m MODEL --conversation FILE.json\n"
            "       strata tokenize -m MODEL [--parse-special] [--file F | TEXT]\n"
            "       strata detokenize -m MODEL ID...   (strata tokenize --help)\n"
            "       strata --version\n"
            "options of generate:\n"
            "  --temp T                 0 (default) is greedy\n"
            "  --seed S                 sampling seed (default 1)\n"
            "  --ignore-eos             keep generating after an end-of-generation token (the\n"
            "                           vocabulary's: EOS, <|im_end|>, <|eot_id|>, ...; strata-\n"
            "                           hybrid: its EOS)\n"
            "  --chat                   render PROMPT (and --system) as one user turn through the\n"
            "                           model's chat template (ChatML when it has none or it does\n"
            "                           not parse, said on stderr), with the generation prompt;\n"
            "                           models with a GGUF vocabulary only\n"
            "  --backend cpu|cuda       compute backend (default: $STRATA_BACKEND, else cuda when\n"
            "                           a GPU is present and runs the model: strata-hybrid with\n"
            "                           f32 / f16 / bf16 weights; else cpu)\n"
            "  --threads N              compute threads (default: all CPUs)\n"
            "  --ubatch N               prompt chunk in tokens (default 2048)\n"
            "  --expert-cache-mib N     cuda, MoE models: the routed experts in host memory with a\n"
            "                           VRAM arena of N MiB of them (below one token's experts:\n"
            "                           streamed per token; default 0: every expert in VRAM)\n"
            "  --ctx N                  context length (default: the model's)\n"
            "  --page-size N            K/V page size in tokens (default 256)\n"
            "  --kv-dtype f16|f32|i8    K/V dtype (default: the model's; f32: cpu backend only)\n"
            "  --system TEXT            a system prompt before PROMPT (--chat: a system turn)\n"
            "  --prompt-cache K         checkpoints kept (default 6)\n"
            "  --prompt-cache-every N   checkpoint every N prompt tokens\n"
            "  --prompt-cache-root N    checkpoint at the end of a system prompt >= N tokens\n"
            "  --session-in FILE        continue the conversation saved in FILE\n"
            "  --session-out FILE       save the conversation after generation\n"
            "  --session-state-codec fp32|bf16   running-state codec of the saved file\n"
            "  --dump-logits FILE       write the final logits (f32, little-endian)\n"
            "  --tokens                 print token ids instead of text\n"
            "text and tokens: a model with a GGUF vocabulary (tokenizer.ggml.model gpt2) uses its\n"
            "own tokenizer: BOS first on a new conversation where the vocabulary adds it, control\n"
            "tokens in PROMPT are text (with --chat the template's are tokens), and the text is\n"
            "printed as it is made (a UTF-8 sequence split across tokens held until complete);\n"
            "strata-hybrid uses its byte tokens (BOS, the bytes; a turn separator before a\n"
            "continued turn and between --system and PROMPT)\n"
            "  --scalar                 use the scalar kernels (same results, slower)\n"
            "  --quant-f32              quantized weights in f32 on their dequantized values (the\n"
            "                           logits of the file's F32 twin; default: $STRATA_QUANT_F32\n"
            "                           set and not 0, else the integer path: activations\n"
            "                           quantized as llama.cpp does, for Q8_0, Q4_K, Q6_K)\n"
            "logits: the logits after every input token (teacher forcing), little-endian f32,\n"
            "[n_tokens][n_vocab], into FILE; takes --backend, --threads, --ctx, --kv-dtype,\n"
            "--scalar, --quant-f32\n"
            "  --tokens LIST            token ids, separated by commas\n"
            "  --tokens-file F          token ids in a file, separated by commas or whitespace\n"
            "  -o FILE                  the output file\n");
}

static int num(const char *flag, const char *v, unsigned long long max, unsigned long long *out)
{
    char *end;
    errno = 0;
    unsigned long long x = v ? strtoull(v, &end, 0) : 0;
    if (!v || errno || *end || end == v || x > max) {
        fprintf(stderr, "strata: %s needs a number (<= %llu), got \"%s\"\n", flag, max,
                v ? v : "");
        return -1;
    }
    *out = x;
    return 0;
}

static int fail(const char *what, int rc)
{
    fprintf(stderr, "strata: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    return 1;
}

static void quantize_usage(FILE *f)
{
    fprintf(f,
            "usage: strata quantize IN OUT TYPE\n"
            "Re-quantizes the GGUF file IN into OUT (written atomically: OUT appears complete or\n"
            "not at all). TYPE is one of %s (any case).\n"
            "The tensors llama.cpp's llama-quantize quantizes (2-D and 3-D weights) become TYPE,\n"
            "with ggml's quantizer's bytes; norms, biases, 1-D tensors, ssm_conv1d and\n"
            "ffn_gate_inp stay as they are (F32). A row whose length the TYPE block does not\n"
            "divide falls back as llama.cpp does (Q4_K->Q5_0, Q5_K->Q5_1, Q6_K->Q8_0,\n"
            "Q2_K/Q3_K->Q4_0, IQ4_XS->IQ4_NL, else F16), and says so. Quantized inputs are\n"
            "dequantized first. Every key is copied; general.file_type and\n"
            "general.quantization_version are set. A split model (IN its first part,\n"
            "NAME-00001-of-0000N.gguf) is read whole and written as one file, without its\n"
            "split.* keys. Progress on stderr for files >= 64 MiB.\n",
            st_quantize_type_list());
}

static void quantize_log(void *ctx, const char *line)
{
    (void)ctx;
    fprintf(stderr, "strata quantize: %s\n", line);
}

static int cmd_quantize(int argc, char **argv)
{
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            quantize_usage(stdout);
            return 0;
        }
    if (argc != 5) {
        quantize_usage(stderr);
        return 2;
    }
    const char *in = argv[2], *out = argv[3];
    uint32_t type;
    if (st_quantize_type_parse(argv[4], &type)) {
        fprintf(stderr, "strata quantize: %s\n", st_errdetail());
        return 2;
    }
    struct stat sb;
    st_quantize_opts o = {quantize_log, NULL, 0};
    o.progress = stat(in, &sb) == 0 && sb.st_size >= (64ll << 20);
    st_quantize_stats qs;
    double t0 = now_s();
    int rc = st_gguf_quantize(in, out, type, &o, &qs);
    if (rc) {
        fprintf(stderr, "strata quantize: %s (%s not written)\n", st_errdetail(), out);
        return 1;
    }
    fprintf(stderr, "strata quantize: wrote %s: %llu tensors, %llu converted to %s (%llu by "
            "fallback), %llu copied; %.2f MiB -> %.2f MiB in %.2f s\n", out,
            (unsigned long long)qs.n_tensors, (unsigned long long)qs.n_quantized,
            st_gguf_type_name(type), (unsigned long long)qs.n_fallback,
            (unsigned long long)qs.n_copied, (double)qs.bytes_in / 1048576.0,
            (double)qs.bytes_out / 1048576.0, now_s() - t0);
    return 0;
}

static void chat_template_usage(FILE *f)
{
    fprintf(f,
            "usage: strata chat-template -m MODEL --conversation FILE.json\n"
            "Prints the prompt MODEL's chat template (tokenizer.chat_template) renders for the\n"
            "conversation in FILE: {\"messages\": [...], \"tools\": [...],\n"
            "\"add_generation_prompt\": true, \"enable_thinking\": false} (all but messages\n"
            "optional; every key becomes a template variable). bos_token and eos_token are the\n"
            "vocabulary's (tokenizer.ggml.bos_token_id / eos_token_id) unless FILE gives them.\n"
            "stdout carries the rendered prompt exactly, nothing else. A model without a template\n"
            "is rendered as ChatML, saying so on stderr; a template that does not parse is an\n"
            "error naming its line and column (exit 1).\n");
}

static int cmd_chat_template(int argc, char **argv)
{
    const char *model = NULL, *conv = NULL;
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            chat_template_usage(stdout);
            return 0;
        }
    }
    for (int i = 2; i < argc; i++) {
        if (i + 1 < argc && !strcmp(argv[i], "-m"))
            model = argv[++i];
        else if (i + 1 < argc && !strcmp(argv[i], "--conversation"))
            conv = argv[++i];
        else {
            fprintf(stderr, "strata chat-template: unknown or incomplete argument %s\n", argv[i]);
            chat_template_usage(stderr);
            return 2;
        }
    }
    if (!model || !conv) {
        chat_template_usage(stderr);
        return 2;
    }
    json_error_t je;
    json_t *c = json_load_file(conv, 0, &je);
    if (!c) {
        fprintf(stderr, "strata chat-template: %s: line %d, column %d: %s\n", conv, je.line,
                je.column, je.text);
        return 1;
    }
    st_gguf *g = NULL;
    st_chat_template *ct = NULL;
    char *out = NULL;
    size_t len = 0;
    int rc = st_gguf_open(model, &g);
    if (!rc) {
        rc = st_chat_template_load(g, &ct);
        if (rc == ST_ENOTFOUND) {
            fprintf(stderr, "strata chat-template: %s has no tokenizer.chat_template: ChatML\n",
                    model);
            rc = st_chat_template_chatml(g, &ct);
        }
    }
    if (!rc)
        rc = st_chat_template_render(ct, c, &out, &len);
    if (!rc && fwrite(out, 1, len, stdout) != len)
        rc = errno ? errno : EIO;
    if (rc)
        fprintf(stderr, "strata chat-template: %s: %s\n", st_strerror(rc), st_errdetail());
    free(out);
    st_chat_template_free(ct);
    st_gguf_close(g);
    json_decref(c);
    return rc ? 1 : 0;
}

/* The MTP blocks the engine skips: blk.n_layer .. blk.n_layer + n_nextn - 1, their tensors and
 * bytes (never read). */
static void info_mtp(const st_gguf *g, const st_model_hparams *hp)
{
    uint64_t n = 0, bytes = 0;
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        unsigned b;
        char dot;
        if (sscanf(t->name, "blk.%u%c", &b, &dot) == 2 && dot == '.' && b >= hp->n_layer &&
            b - hp->n_layer < hp->n_nextn) {
            n++;
            bytes += t->nbytes;
        }
    }
    if (hp->n_nextn)
        printf("mtp          %u blocks skipped (blk.%u..blk.%u: %llu tensors, %llu B not read)\n",
               hp->n_nextn, hp->n_layer, hp->n_layer + hp->n_nextn - 1, (unsigned long long)n,
               (unsigned long long)bytes);
    else
        printf("mtp          none\n");
}

static int cmd_info(const char *model)
{
    st_model *m = NULL;
    int rc = st_model_load(model, &m);
    if (rc)
        return fail("loading the model", rc);
    const st_model_hparams *hp = st_model_hparams_get(m);
    char fp[65];
    st_hex_encode(fp, st_model_fingerprint(m), ST_FINGERPRINT_LEN);
    printf("model        %s\n", model);
    printf("architecture %s\n", st_model_arch(m));
    printf("fingerprint  %s\n", fp);
    printf("layers       %u, pattern %s\n", hp->n_layer, hp->pattern);
    /* per layer in order: D (Gated DeltaNet, recurrent state) or A (attention, K/V) */
    uint32_t n_d = 0;
    printf("kinds        ");
    for (uint32_t il = 0; il < hp->n_layer; il++) {
        char k = st_model_layer_mixer(m, il);
        n_d += k == 'D';
        putchar(k);
    }
    printf(" (%u deltanet, %u attention)\n", n_d, hp->n_layer - n_d);
    /* tensor types: count and bytes of each, in ggml type order */
    const st_gguf *g = st_model_gguf(m);
    printf("types       ");
    for (uint32_t type = 0, first = 1; type < 64; type++) {
        uint64_t n = 0, bytes = 0;
        for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
            const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
            if (t->type == type) {
                n++;
                bytes += t->nbytes;
            }
        }
        if (n) {
            printf("%s %s %llu tensors %llu B", first ? "" : ",", st_gguf_type_name(type),
                   (unsigned long long)n, (unsigned long long)bytes);
            first = 0;
        }
    }
    printf("\n");
    printf("embedding    %u, feed-forward %u, vocab %u, context %u\n", hp->n_embd, hp->n_ff,
           hp->n_vocab, hp->n_ctx);
    printf("attention    %u heads, %u K/V heads, width %u, K/V %s\n", hp->n_head, hp->n_head_kv,
           hp->head_dim, st_dtype_name(hp->kv_dtype));
    printf("deltanet     %u heads, dk %u, dv %u, conv %u\n", hp->ssm_heads, hp->ssm_dk, hp->ssm_dv,
           hp->ssm_conv);
    printf("parameters   %.3f M\n", (double)st_model_n_params(hp) / 1e6);
    printf("state        %llu B per checkpoint, K/V %llu B per token\n",
           (unsigned long long)st_model_state_bytes(hp),
           (unsigned long long)st_model_kv_bytes_per_token(hp, hp->kv_dtype));
    static const uint32_t kv_dtypes[] = {ST_DTYPE_F16, ST_DTYPE_F32, ST_DTYPE_I8};
    printf("kv-per-token");
    for (size_t i = 0; i < sizeof kv_dtypes / sizeof kv_dtypes[0]; i++)
        printf("%s %s %llu B", i ? "," : "", st_dtype_name(kv_dtypes[i]),
               (unsigned long long)st_model_kv_bytes_per_token(hp, kv_dtypes[i]));
    printf(" (f32: cpu backend only)\n");
    info_mtp(g, hp);
    printf("parts        %u", st_gguf_n_parts(g));
    for (uint32_t p = 0; p < st_gguf_n_parts(g); p++) {
        uint64_t n = 0;
        for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++)
            n += st_gguf_tensor_at(g, i)->part == p;
        printf("%s %s %llu tensors %llu B", p ? "," : ":", st_gguf_part_path(g, p),
               (unsigned long long)n, (unsigned long long)st_gguf_part_bytes(g, p));
    }
    printf("\n");
    st_model_free(m);
    return 0;
}

/* Whether the CUDA backend runs this model (st_engine_cuda_check): the automatic backend choice
 * is the CPU for the others. An unreadable file answers yes, and loading it then reports what
 * is wrong. */
static int cuda_runs(const char *model)
{
    st_gguf *g = NULL;
    if (st_gguf_open(model, &g))
        return 1;
    int yes = st_engine_cuda_check(g) == 0;
    st_gguf_close(g);
    return yes;
}

/* Token ids separated by commas or whitespace; -1 (and a message) on anything else. */
static int parse_tokens(const char *src, const char *what, uint32_t **out, uint64_t *n)
{
    uint64_t cap = 0, k = 0;
    uint32_t *t = NULL;
    const char *p = src;
    for (;;) {
        while (*p == ',' || *p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
            p++;
        if (!*p)
            break;
        char *end;
        errno = 0;
        unsigned long long v = *p >= '0' && *p <= '9' ? strtoull(p, &end, 10) : 0;
        if (*p < '0' || *p > '9' || errno || v > UINT32_MAX ||
            (*end && *end != ',' && *end != ' ' && *end != '\t' && *end != '\n' && *end != '\r')) {
            fprintf(stderr, "strata: %s: token %llu is not a number (at \"%.16s\")\n", what,
                    (unsigned long long)k, p);
            free(t);
            return -1;
        }
        if (k == cap) {
            cap = cap ? cap * 2 : 256;
            uint32_t *nt = realloc(t, cap * sizeof *nt);
            if (!nt) {
                fprintf(stderr, "strata: out of memory\n");
                free(t);
                return -1;
            }
            t = nt;
        }
        t[k++] = (uint32_t)v;
        p = end;
    }
    if (!k) {
        fprintf(stderr, "strata: %s holds no token\n", what);
        free(t);
        return -1;
    }
    *out = t;
    *n = k;
    return 0;
}

/* A whole text file, NUL-terminated; NULL (and a message) if unreadable or holding a NUL. */
static char *read_text(const char *path)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t len = 0, cap = 0, got;
    if (!f) {
        fprintf(stderr, "strata: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    do {
        if (cap - len < 65536) {
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap + 1);
            if (!nb) {
                free(buf);
                fclose(f);
                fprintf(stderr, "strata: out of memory\n");
                return NULL;
            }
            buf = nb;
        }
        got = fread(buf + len, 1, cap - len, f);
        len += got;
    } while (got);
    if (ferror(f) || memchr(buf, '\0', len)) {
        fprintf(stderr, "strata: %s: %s\n", path, ferror(f) ? "read error" : "not a text file");
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    buf[len] = '\0';
    return buf;
}

/* strata logits: teacher forcing, one token at a time (the determinism rules make each token's
 * logits those of a batched read), the logits after each written as they come, into a temp file
 * that replaces FILE once all are written (st_replace):
 * [n_tokens][n_vocab] f32 in the host order, little-endian on the x86-64 and arm64 builds. */
static int cmd_logits(const char *model, const st_engine_opts *eo, const char *tok_list,
                      const char *tok_file, const char *out_path)
{
    uint32_t *toks = NULL;
    uint64_t n = 0;
    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    st_replace f = {.fd = -1}; /* the output, replaced atomically (common's st_replace) */
    int rc, ret = 1;
    if (!out_path || !tok_list == !tok_file) {
        fprintf(stderr, "strata: logits needs -o FILE and one of --tokens, --tokens-file\n");
        return 2;
    }
    if (tok_file) {
        char *text = read_text(tok_file);
        if (!text)
            return 2;
        rc = parse_tokens(text, tok_file, &toks, &n);
        free(text);
    } else {
        rc = parse_tokens(tok_list, "--tokens", &toks, &n);
    }
    if (rc)
        return 2;
    if ((rc = st_model_load(model, &m))) {
        ret = fail("loading the model", rc);
        goto done;
    }
    uint32_t nv = st_model_hparams_get(m)->n_vocab;
    for (uint64_t i = 0; i < n; i++)
        if (toks[i] >= nv) {
            fprintf(stderr, "strata: token %llu is %u, the vocabulary has %u\n",
                    (unsigned long long)i, toks[i], nv);
            ret = 2;
            goto done;
        }
    if ((rc = st_engine_new(m, eo, &e))) {
        ret = fail("starting the engine", rc);
        goto done;
    }
    if ((rc = st_slot_new(e, &s))) {
        ret = fail("creating a slot", rc);
        goto done;
    }
    if ((rc = st_replace_begin(&f, out_path, 0666))) {
        fprintf(stderr, "strata: %s: %s\n", out_path, st_errdetail());
        goto done;
    }
    for (uint64_t i = 0; i < n; i++) {
        rc = i ? st_slot_decode(s, toks[i]) : st_slot_eval(s, toks, 1, 0, NULL);
        if (rc) {
            ret = fail("reading the tokens", rc);
            goto done;
        }
        uint32_t nl = 0;
        const float *l = st_slot_logits(s, &nl);
        if ((rc = st_sys_write_all(f.fd, l, sizeof *l * nl))) {
            fprintf(stderr, "strata: writing %s: %s\n", out_path, strerror(rc));
            goto done;
        }
    }
    if ((rc = st_replace_commit(&f, out_path))) {
        fprintf(stderr, "strata: %s\n", st_errdetail());
        goto done;
    }
    fprintf(stderr, "strata: logits of %llu tokens x %u into %s\n", (unsigned long long)n, nv,
            out_path);
    ret = 0;
done:
    st_replace_abort(&f); /* nothing after a commit; the temp file after a failure */
    free(toks);
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
    return ret;
}

/* The ids of text[0..len) (no BOS / EOS) appended to *buf (grown as needed: *cap ids). */
static int vocab_append(const st_vocab *v, const char *text, size_t len, int parse_special,
                        uint32_t **buf, uint64_t *n, uint64_t *cap)
{
    size_t k = 0;
    int rc = st_vocab_tokenize(v, text, len, 0, parse_special, NULL, 0, &k);
    if (rc)
        return rc;
    if (*n + k > *cap) {
        uint32_t *nb = realloc(*buf, (*n + k) * sizeof *nb);
        if (!nb)
            return st_error_set(ENOMEM, "tokenizing: %zu ids", k);
        *buf = nb;
        *cap = *n + k;
    }
    rc = st_vocab_tokenize(v, text, len, 0, parse_special, *buf + *n, k, &k);
    *n += k;
    return rc;
}

/* {"role": role, "content": text} appended to msgs; 0, or -1 (and a message) when text is not
 * UTF-8 (JSON strings must be) or memory ran out. */
static int chat_message(json_t *msgs, const char *role, const char *flag, const char *text)
{
    json_t *c = json_string(text);
    if (!c) {
        fprintf(stderr, "strata: --chat: %s is not valid UTF-8\n", flag);
        return -1;
    }
    json_t *m = json_object();
    if (!m || json_object_set_new(m, "role", json_string(role)) ||
        json_object_set_new(m, "content", c) || json_array_append_new(msgs, m)) {
        fprintf(stderr, "strata: --chat: out of memory\n");
        return -1;
    }
    return 0;
}

/* --chat: the prompt the model's chat template renders for one user turn PROMPT (after a system
 * turn SYSTEM when given) with the generation prompt; ChatML when the model has no template or
 * its template does not parse, said on stderr. *out malloc'd, NUL-terminated. */
static int chat_render(const st_model *m, const char *model, const char *system,
                       const char *prompt, char **out, size_t *len)
{
    const st_gguf *g = st_model_gguf(m);
    st_chat_template *ct = NULL;
    int rc = st_chat_template_load(g, &ct);
    if (rc) {
        if (rc == ST_ENOTFOUND)
            fprintf(stderr, "strata: %s has no tokenizer.chat_template: ChatML\n", model);
        else
            fprintf(stderr, "strata: %s: %s: ChatML instead\n", model, st_errdetail());
        if ((rc = st_chat_template_chatml(g, &ct)))
            return fail("the ChatML template", rc);
    }
    json_t *conv = json_object(), *msgs = json_array();
    int ret = 1;
    if (!conv || !msgs || json_object_set(conv, "messages", msgs) ||
        json_object_set_new(conv, "add_generation_prompt", json_true())) {
        fprintf(stderr, "strata: --chat: out of memory\n");
        goto done;
    }
    if ((system && chat_message(msgs, "system", "--system", system)) ||
        chat_message(msgs, "user", "PROMPT", prompt))
        goto done;
    if ((rc = st_chat_template_render(ct, conv, out, len)))
        ret = fail("rendering the chat template", rc);
    else
        ret = 0;
done:
    json_decref(msgs);
    json_decref(conv);
    st_chat_template_free(ct);
    return ret;
}

/* The text of token tok as it is made: the streaming decoder's bytes (a UTF-8 sequence split
 * across tokens held until complete; control tokens print nothing), written and flushed. */
static int put_piece(const st_vocab *v, st_vocab_stream *ss, uint32_t tok, char **buf,
                     size_t *cap)
{
    size_t n = 0;
    int rc = st_vocab_stream_push(v, ss, tok, 0, *buf, *cap, &n);
    if (rc == ST_ETOOBIG) {
        char *nb = realloc(*buf, n);
        if (!nb) {
            fprintf(stderr, "strata: out of memory\n");
            return -1;
        }
        *buf = nb;
        *cap = n;
        rc = st_vocab_stream_push(v, ss, tok, 0, *buf, *cap, &n);
    }
    if (rc)
        return fail("detokenizing", rc);
    if (fwrite(*buf, 1, n, stdout) != n || fflush(stdout)) {
        fprintf(stderr, "strata: writing the text: %s\n", strerror(errno));
        return -1;
    }
    return 0;
}

int main(int argc, char **argv)
{
    const char *model = NULL, *prompt = NULL, *system = NULL, *sess_in = NULL, *sess_out = NULL;
    const char *dump = NULL, *tok_list = NULL, *tok_file = NULL, *out_path = NULL;
    unsigned long long n_gen = 16, seed = 1, v;
    float temp = 0.0f;
    int ignore_eos = 0, print_tokens = 0, chat = 0;
    st_codec_id codec = ST_CODEC_FP32;
    st_engine_opts eo;
    st_engine_opts_default(&eo);
    const char *qf = getenv("STRATA_QUANT_F32");
    eo.quant_f32 = qf && *qf && strcmp(qf, "0");
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help")) {
        usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        printf("strata %s\n", st_version());
        return 0;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "quantize"))
        return cmd_quantize(argc, argv);
    if (!strcmp(cmd, "chat-template"))
        return cmd_chat_template(argc, argv);
    if (!strcmp(cmd, "tokenize"))
        return strata_cmd_tokenize(argc, argv);
    if (!strcmp(cmd, "detokenize"))
        return strata_cmd_detokenize(argc, argv);
    if (strcmp(cmd, "generate") && strcmp(cmd, "info") && strcmp(cmd, "logits")) {
        fprintf(stderr, "strata: unknown command %s\n", cmd);
        usage(stderr);
        return 2;
    }
    for (int i = 2; i < argc; i++) {
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) {
            usage(stdout);
            return 0;
        }
    }
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i], *val = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--ignore-eos")) {
            ignore_eos = 1;
            continue;
        }
        if (!strcmp(a, "--chat") && !strcmp(cmd, "generate")) {
            chat = 1;
            continue;
        }
        if (!strcmp(a, "--tokens") && strcmp(cmd, "logits")) {
            print_tokens = 1;
            continue;
        }
        if (!strcmp(a, "--scalar")) {
            eo.force_scalar = 1;
            continue;
        }
        if (!strcmp(a, "--quant-f32")) {
            eo.quant_f32 = 1;
            continue;
        }
        if (!val) {
            fprintf(stderr, "strata: unknown or incomplete option %s\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            model = val;
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt"))
            prompt = val;
        else if (!strcmp(a, "--system"))
            system = val;
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-predict")) {
            if (num(a, val, 1u << 24, &n_gen))
                return 2;
        } else if (!strcmp(a, "--temp")) {
            char *end;
            temp = strtof(val, &end);
            if (*end || end == val || temp < 0.0f) {
                fprintf(stderr, "strata: --temp needs a number >= 0\n");
                return 2;
            }
        } else if (!strcmp(a, "--seed")) {
            if (num(a, val, UINT64_MAX, &seed))
                return 2;
        } else if (!strcmp(a, "--backend")) {
            if (strcmp(val, "cpu") && strcmp(val, "cuda")) {
                fprintf(stderr, "strata: --backend cpu or cuda\n");
                return 2;
            }
            eo.backend = val;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "-t")) {
            if (num(a, val, 1024, &v))
                return 2;
            eo.n_threads = (uint32_t)v;
        } else if (!strcmp(a, "--ubatch") || !strcmp(a, "-ub")) {
            if (num(a, val, 65536, &v) || v == 0)
                return 2;
            eo.ubatch = (uint32_t)v;
        } else if (!strcmp(a, "--expert-cache-mib")) {
            if (num(a, val, 1ull << 24, &v))
                return 2;
            eo.expert_cache_bytes = v << 20;
        } else if (!strcmp(a, "--ctx") || !strcmp(a, "-c")) {
            if (num(a, val, 1u << 24, &v))
                return 2;
            eo.n_ctx = (uint32_t)v;
        } else if (!strcmp(a, "--page-size")) {
            if (num(a, val, 65536, &v) || v == 0)
                return 2;
            eo.page_size = (uint32_t)v;
        } else if (!strcmp(a, "--kv-dtype")) {
            if (!strcmp(val, "f16"))
                eo.kv_dtype = ST_DTYPE_F16;
            else if (!strcmp(val, "i8"))
                eo.kv_dtype = ST_DTYPE_I8;
            else if (!strcmp(val, "f32"))
                eo.kv_dtype = ST_DTYPE_F32;
            else {
                fprintf(stderr, "strata: --kv-dtype f16, f32 or i8\n");
                return 2;
            }
        } else if (!strcmp(a, "--prompt-cache")) {
            if (num(a, val, 64, &v))
                return 2;
            eo.prompt_cache = (uint32_t)v;
        } else if (!strcmp(a, "--prompt-cache-every")) {
            if (num(a, val, 1u << 24, &v))
                return 2;
            eo.prompt_cache_every = (uint32_t)v;
        } else if (!strcmp(a, "--prompt-cache-root")) {
            if (num(a, val, 1u << 24, &v))
                return 2;
            eo.prompt_cache_root = (uint32_t)v;
        } else if (!strcmp(a, "--session-in"))
            sess_in = val;
        else if (!strcmp(a, "--session-out"))
            sess_out = val;
        else if (!strcmp(a, "--session-state-codec")) {
            if (st_codec_parse(val, &codec) || (codec != ST_CODEC_FP32 && codec != ST_CODEC_BF16)) {
                fprintf(stderr, "strata: --session-state-codec fp32 or bf16\n");
                return 2;
            }
        } else if (!strcmp(a, "--dump-logits"))
            dump = val;
        else if (!strcmp(a, "--tokens") && !strcmp(cmd, "logits"))
            tok_list = val;
        else if (!strcmp(a, "--tokens-file") && !strcmp(cmd, "logits"))
            tok_file = val;
        else if ((!strcmp(a, "-o") || !strcmp(a, "--output")) && !strcmp(cmd, "logits"))
            out_path = val;
        else {
            fprintf(stderr, "strata: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!model) {
        fprintf(stderr, "strata: -m MODEL is required\n");
        return 2;
    }
    if (!strcmp(cmd, "info"))
        return cmd_info(model);
    if (!prompt)
        prompt = "";
    if (!eo.backend) {
        const char *env = getenv("STRATA_BACKEND");
        /* f32 K/V (the reference comparisons' precision) is the CPU's alone */
        eo.backend = env && *env ? env
                     : st_codec_cuda_available() && eo.kv_dtype != ST_DTYPE_F32 &&
                               cuda_runs(model)
                           ? "cuda"
                           : "cpu";
    }
    if (!strcmp(cmd, "logits"))
        return cmd_logits(model, &eo, tok_list, tok_file, out_path);

    st_model *m = NULL;
    st_engine *e = NULL;
    st_slot *s = NULL;
    st_image *img = NULL;
    uint32_t *toks = NULL, *gen = NULL;
    st_vocab_stream ss = {{0}, 0};
    char *piece = NULL;
    size_t piece_cap = 0;
    int rc, ret = 1;
    double t0 = now_s();
    if ((rc = st_model_load(model, &m))) {
        ret = fail("loading the model", rc);
        goto done;
    }
    if ((rc = st_engine_new(m, &eo, &e))) {
        ret = fail("starting the engine", rc);
        goto done;
    }
    if ((rc = st_slot_new(e, &s))) {
        ret = fail("creating a slot", rc);
        goto done;
    }
    const st_engine_opts *o = st_engine_opts_get(e);
    double t_load = now_s() - t0;
    fprintf(stderr, "strata: model %s loaded in %.3f s (%s backend, %s, %u threads, ubatch %u, "
            "context %u)\n", model, t_load, o->backend, st_engine_isa(e), o->n_threads, o->ubatch,
            o->n_ctx);

    size_t sys_len = system ? strlen(system) : 0, p_len = strlen(prompt);
    uint64_t held = 0, system_end = 0;
    if (sess_in) {
        double tr = now_s();
        st_file_read_opts ro = {.alloc = st_engine_image_allocator(e)};
        if ((rc = st_file_read(sess_in, &ro, &img))) {
            ret = fail("reading the session", rc);
            goto done;
        }
        if ((rc = st_slot_restore_adopt(s, img))) {
            ret = fail("restoring the session", rc);
            goto done;
        }
        st_image_free(img);
        img = NULL;
        held = st_slot_n_tokens(s);
        fprintf(stderr, "strata: restored %s: %llu tokens in %.3f s\n", sess_in,
                (unsigned long long)held, now_s() - tr);
    }
    const st_vocab *voc = st_model_vocab(m);
    if (chat && !voc) {
        fprintf(stderr, "strata: --chat needs a model with a GGUF vocabulary (%s has byte "
                "tokens)\n", model);
        ret = 2;
        goto done;
    }
    /* the conversation: what is held, then for strata-hybrid's byte tokens BOS (new) or a turn
     * separator (continued), the system prompt and the prompt; with the model's vocabulary BOS
     * (new, where it adds one) and the ids of the system prompt and the prompt, or of the turn
     * its chat template renders */
    uint64_t cap = held + 2 + (voc ? 0 : sys_len + p_len);
    toks = malloc(cap * sizeof *toks);
    gen = malloc((n_gen ? n_gen : 1) * sizeof *gen);
    if (!toks || !gen) {
        fprintf(stderr, "strata: out of memory\n");
        goto done;
    }
    uint64_t n = 0;
    if (held)
        memcpy(toks, st_slot_tokens(s), held * sizeof *toks);
    n = held;
    if (!voc) {
        if (!held || sys_len || p_len)
            toks[n++] = held ? ST_TOKEN_SEP : ST_TOKEN_BOS;
        if (sys_len) {
            n += st_tokenize(system, sys_len, toks + n, sys_len);
            system_end = n;
            if (p_len)
                toks[n++] = ST_TOKEN_SEP;
        }
        n += st_tokenize(prompt, p_len, toks + n, p_len);
    } else {
        uint32_t bos = st_vocab_special(voc, ST_VOCAB_BOS);
        int added = !held && st_vocab_add_bos(voc) && bos < st_vocab_n_tokens(voc);
        if (added)
            toks[n++] = bos;
        if (chat) {
            char *text = NULL;
            size_t tl = 0;
            if (chat_render(m, model, system, prompt, &text, &tl))
                goto done;
            uint64_t at = n;
            rc = vocab_append(voc, text, tl, 1, &toks, &n, &cap);
            free(text);
            /* the template's own BOS (Llama 3's bos_token): one BOS in all and none in a
             * continued conversation, as llama.cpp's chat path strips it */
            if (!rc && (added || held) && n > at && toks[at] == bos) {
                memmove(toks + at, toks + at + 1, (n - at - 1) * sizeof *toks);
                n--;
            }
        } else {
            rc = sys_len ? vocab_append(voc, system, sys_len, 0, &toks, &n, &cap) : 0;
            system_end = sys_len ? n : 0;
            if (!rc)
                rc = vocab_append(voc, prompt, p_len, 0, &toks, &n, &cap);
        }
        if (rc) {
            ret = fail("tokenizing the prompt", rc);
            goto done;
        }
        if (!n) {
            fprintf(stderr, "strata: the prompt has no tokens (empty, and the vocabulary adds "
                    "no BOS)\n");
            ret = 2;
            goto done;
        }
    }
    double tp = now_s();
    st_eval_stats es = {0};
    if (n > held || !st_slot_logits(s, NULL)) {
        if ((rc = st_slot_eval(s, toks, n, system_end, &es))) {
            ret = fail("reading the prompt", rc);
            goto done;
        }
    }
    double t_prompt = now_s() - tp;
    double tg = now_s();
    uint64_t n_out = 0;
    for (uint64_t i = 0; i < n_gen; i++) {
        uint32_t tok;
        if ((rc = st_slot_sample(s, temp, seed, &tok))) {
            ret = fail("sampling", rc);
            goto done;
        }
        gen[n_out++] = tok;
        if (print_tokens) {
            printf("%s%u", n_out > 1 ? " " : "", tok);
        } else if (voc) {
            if (put_piece(voc, &ss, tok, &piece, &piece_cap))
                goto done;
        } else if (tok < 256) {
            char ch = (char)tok;
            fwrite(&ch, 1, 1, stdout);
            fflush(stdout);
        }
        if ((rc = st_slot_decode(s, tok))) {
            ret = fail("decoding", rc);
            goto done;
        }
        if (!ignore_eos && (voc ? st_vocab_is_eog(voc, tok) : tok == ST_TOKEN_EOS))
            break;
    }
    if (print_tokens)
        printf("\n");
    if (voc && !print_tokens) {
        char tail[4];
        size_t k = st_vocab_stream_flush(&ss, tail, sizeof tail);
        fwrite(tail, 1, k, stdout);
    }
    fflush(stdout);
    double t_gen = now_s() - tg;
    fprintf(stderr,
            "strata: prompt %llu tokens (%llu reused, %llu read) in %.3f s (%.1f tok/s); "
            "generated %llu tokens in %.3f s (%.1f tok/s)\n",
            (unsigned long long)(n - held), (unsigned long long)es.reused,
            (unsigned long long)es.computed, t_prompt,
            t_prompt > 0 ? (double)es.computed / t_prompt : 0.0, (unsigned long long)n_out, t_gen,
            t_gen > 0 ? (double)n_out / t_gen : 0.0);
    if (dump) {
        uint32_t nl = 0;
        const float *l = st_slot_logits(s, &nl);
        if ((rc = st_replace_file(dump, l, sizeof *l * nl))) {
            fprintf(stderr, "strata: --dump-logits: %s\n", st_errdetail());
            goto done;
        }
    }
    if (sess_out) {
        double ts = now_s();
        if ((rc = st_slot_snapshot(s, ST_SNAPSHOT_SESSION, codec, &img))) {
            ret = fail("snapshot", rc);
            goto done;
        }
        if ((rc = st_file_write(img, sess_out, NULL))) {
            ret = fail("writing the session", rc);
            goto done;
        }
        fprintf(stderr, "strata: saved %s: %llu tokens, %s running state, in %.3f s\n", sess_out,
                (unsigned long long)st_slot_n_tokens(s), st_codec_name(codec), now_s() - ts);
    }
    ret = 0;
done:
    st_image_free(img);
    free(toks);
    free(gen);
    free(piece);
    st_slot_free(s);
    st_engine_free(e);
    st_model_free(m);
    return ret;
}
