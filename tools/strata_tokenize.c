/*
 * strata_tokenize.c - the model's tokenizer on the command line:
 *
 *   strata tokenize -m MODEL [--parse-special] [--file F | TEXT]   ids, separated by spaces
 *   strata detokenize -m MODEL ID...                               the text, byte for byte
 *
 * Only the vocabulary is read (no weights): a model of the byte-level BPE (tokenizer.ggml.model
 * "gpt2"), llama.cpp's vocab-only files, or strata-hybrid's byte tokenizer. BOS (and EOS) are
 * added where the vocabulary says so (tokenizer.ggml.add_bos_token; llama-bpe's default is on),
 * as llama.cpp's llama-tokenize adds them by default; detokenize renders special tokens.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine.h"
#include "strata_tokenize.h"

static void tok_usage(FILE *f)
{
    fprintf(f, "usage: strata tokenize -m MODEL [--parse-special] [--file F | TEXT]\n"
               "       strata detokenize -m MODEL ID...\n"
               "tokenize prints the token ids of TEXT (or of the bytes of file F), separated by\n"
               "spaces, with BOS first when the vocabulary adds one (add_bos_token: Llama 3\n"
               "yes, Qwen no) and then EOS when it adds that too, as llama.cpp's\n"
               "llama-tokenize does by default; detokenize prints the text of the ids, special\n"
               "tokens included, exactly (no newline added). Only the model's vocabulary is read.\n"
               "  --parse-special          control tokens written in the text (<|im_start|>,\n"
               "                           <|eot_id|>, ...) become those tokens (default: they\n"
               "                           are text; user-defined tokens such as <think> always\n"
               "                           become tokens)\n");
}

static int tok_fail(const char *what, int rc)
{
    fprintf(stderr, "strata: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    return 1;
}

/* The vocabulary of path, or *bytes = 1 for strata-hybrid's byte tokenizer. */
static int open_vocab(const char *path, st_vocab **v, int *bytes)
{
    st_gguf *g = NULL;
    const char *s;
    uint64_t len;
    *v = NULL;
    *bytes = 0;
    int rc = st_gguf_open(path, &g);
    if (rc)
        return tok_fail(path, rc);
    rc = st_gguf_get_str(g, "tokenizer.ggml.model", &s, &len);
    if (!rc && len == 12 && !memcmp(s, "strata-bytes", 12))
        *bytes = 1;
    else if ((rc = st_vocab_load(g, v))) {
        st_gguf_close(g);
        return tok_fail(path, rc);
    }
    st_gguf_close(g);
    return 0;
}

static char *read_all(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    char *buf = NULL;
    size_t cap = 0, got;
    *len = 0;
    if (!f) {
        fprintf(stderr, "strata: %s: %s\n", path, strerror(errno));
        return NULL;
    }
    do {
        if (cap - *len < 65536) {
            cap = cap ? cap * 2 : 65536;
            char *nb = realloc(buf, cap);
            if (!nb) {
                fprintf(stderr, "strata: %s: out of memory\n", path);
                free(buf);
                fclose(f);
                return NULL;
            }
            buf = nb;
        }
        got = fread(buf + *len, 1, cap - *len, f);
        *len += got;
    } while (got);
    if (ferror(f)) {
        fprintf(stderr, "strata: %s: read error\n", path);
        free(buf);
        buf = NULL;
    }
    fclose(f);
    return buf;
}

int strata_cmd_tokenize(int argc, char **argv)
{
    const char *model = NULL, *file = NULL, *text = NULL;
    int parse_special = 0, bytes = 0, ret = 1;
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            tok_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--parse-special")) {
            parse_special = 1;
        } else if ((!strcmp(a, "-m") || !strcmp(a, "--file")) && i + 1 < argc) {
            *(a[1] == 'm' ? &model : &file) = argv[++i];
        } else if (!strcmp(a, "--") && i + 2 == argc) {
            text = argv[++i];
        } else if (a[0] != '-' && !text) {
            text = a;
        } else {
            fprintf(stderr, "strata: tokenize: unexpected argument %s\n", a);
            tok_usage(stderr);
            return 2;
        }
    }
    if (!model || !!file == !!text) {
        fprintf(stderr, "strata: tokenize: needs -m MODEL and one of --file F or TEXT\n");
        tok_usage(stderr);
        return 2;
    }
    st_vocab *v = NULL;
    char *buf = NULL;
    uint32_t *ids = NULL;
    size_t len = 0, n = 0;
    if (open_vocab(model, &v, &bytes))
        return 1;
    if (file) {
        if (!(buf = read_all(file, &len)))
            goto done;
        text = buf;
    } else {
        len = strlen(text);
    }
    if (bytes) {
        n = len;
        ids = malloc((n ? n : 1) * sizeof *ids);
        if (!ids) {
            fprintf(stderr, "strata: tokenize: out of memory\n");
            goto done;
        }
        st_tokenize(text, len, ids, n);
    } else {
        /* llama-tokenize: common_tokenize(vocab, prompt, add_bos, parse_special), add_bos the
         * vocabulary's, passed as add_special (so EOS too where the vocabulary adds it) */
        int add = st_vocab_add_bos(v);
        int rc = st_vocab_tokenize(v, text, len, add, parse_special, NULL, 0, &n);
        if (!rc && !(ids = malloc((n ? n : 1) * sizeof *ids)))
            rc = ENOMEM;
        if (!rc)
            rc = st_vocab_tokenize(v, text, len, add, parse_special, ids, n, &n);
        if (rc) {
            tok_fail("tokenize", rc);
            goto done;
        }
    }
    for (size_t i = 0; i < n; i++)
        printf(i ? " %u" : "%u", ids[i]);
    printf("\n");
    ret = fflush(stdout) ? 1 : 0;
done:
    free(ids);
    free(buf);
    st_vocab_free(v);
    return ret;
}

int strata_cmd_detokenize(int argc, char **argv)
{
    const char *model = NULL;
    int bytes = 0, ret = 1;
    uint32_t *ids = calloc((size_t)argc, sizeof *ids);
    size_t n = 0;
    if (!ids) {
        fprintf(stderr, "strata: detokenize: out of memory\n");
        return 1;
    }
    for (int i = 2; i < argc; i++) {
        const char *a = argv[i];
        char *end = NULL;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            tok_usage(stdout);
            free(ids);
            return 0;
        }
        if (!strcmp(a, "-m") && i + 1 < argc) {
            model = argv[++i];
            continue;
        }
        errno = 0;
        unsigned long long x = a[0] >= '0' && a[0] <= '9' ? strtoull(a, &end, 10) : 0;
        if (!end || *end || errno || x > UINT32_MAX) {
            fprintf(stderr, "strata: detokenize: %s is not a token id\n", a);
            tok_usage(stderr);
            free(ids);
            return 2;
        }
        ids[n++] = (uint32_t)x;
    }
    if (!model) {
        fprintf(stderr, "strata: detokenize: needs -m MODEL\n");
        tok_usage(stderr);
        free(ids);
        return 2;
    }
    st_vocab *v = NULL;
    char *out = NULL;
    size_t len = 0;
    if (open_vocab(model, &v, &bytes))
        goto done;
    if (bytes) {
        len = st_detokenize(ids, n, NULL, 0);
        if (!(out = malloc(len ? len : 1)))
            goto oom;
        st_detokenize(ids, n, out, len);
    } else {
        int rc = st_vocab_detokenize(v, ids, n, 0, 1, NULL, 0, &len);
        if (rc) {
            tok_fail("detokenize", rc);
            goto done;
        }
        if (!(out = malloc(len ? len : 1)))
            goto oom;
        st_vocab_detokenize(v, ids, n, 0, 1, out, len, &len);
    }
    ret = fwrite(out, 1, len, stdout) != len || fflush(stdout) ? 1 : 0;
    goto done;
oom:
    fprintf(stderr, "strata: detokenize: out of memory\n");
done:
    free(out);
    free(ids);
    st_vocab_free(v);
    return ret;
}
