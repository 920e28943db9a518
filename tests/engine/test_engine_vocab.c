/*
 * test_engine_vocab.c - the GGUF BPE tokenizer (engine/st_vocab.c) against llama.cpp's own
 * vocabulary tests: models/ggml-vocab-{qwen2,qwen35,llama-bpe}.gguf with their .inp / .out from
 * the llama.cpp v0.4.0 source in tests/ref (extracted by vocab_files.sh into the directory given
 * as argv[1]), read as its tests/test-tokenizer-0.cpp reads them and tokenized as it tokenizes
 * (add_special and parse_special off): every case must match. The negative control runs the
 * llama-bpe cases with the qwen2 pre-tokenizer, which must fail. Then special tokens, the end-of-generation set, invalid UTF-8 and random bytes (this
 * test also runs under ASan + UBSan), the streaming decoder, the refusals, the model loader and
 * `strata tokenize` / `strata detokenize`.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <pthread.h>

#include "engine_test.h"

static const char *g_dir; /* the extracted files */

static char *slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "%s: cannot open (tests/ref installed? make deps)\n", path);
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = malloc((size_t)n + 1);
    if (b && fread(b, 1, (size_t)n, f) != (size_t)n) {
        free(b);
        b = NULL;
    }
    fclose(f);
    if (b)
        b[n] = 0;
    *len = (size_t)n;
    return b;
}

static st_vocab *open_named(const char *name)
{
    char p[1024];
    snprintf(p, sizeof p, "%s/ggml-vocab-%s.gguf", g_dir, name);
    st_vocab *v = NULL;
    int rc = st_vocab_open(p, &v);
    if (rc)
        fprintf(stderr, "%s: %s: %s\n", p, st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    return v;
}

static uint32_t *tokenize(const st_vocab *v, const char *s, size_t len, int add, int special,
                          size_t *n)
{
    assert_int_equal(st_vocab_tokenize(v, s, len, add, special, NULL, 0, n), 0);
    uint32_t *ids = malloc((*n + 1) * sizeof *ids);
    assert_non_null(ids);
    size_t m = 0;
    assert_int_equal(st_vocab_tokenize(v, s, len, add, special, ids, *n, &m), 0);
    assert_int_equal(m, *n);
    return ids;
}

/* The cases of NAME's .inp / .out run on vocabulary v; returns the count that differ. */
static size_t run_cases(const st_vocab *v, const char *name, size_t *n_cases)
{
    char p[1024];
    size_t il = 0, ol = 0;
    snprintf(p, sizeof p, "%s/ggml-vocab-%s.gguf.inp", g_dir, name);
    char *inp = slurp(p, &il);
    snprintf(p, sizeof p, "%s/ggml-vocab-%s.gguf.out", g_dir, name);
    char *out = slurp(p, &ol);
    assert_non_null(inp);
    assert_non_null(out);
    static const char sep[] = "\n__ggml_vocab_test__\n";
    size_t pos = 0, bad = 0, k = 0;
    char *line = out;
    while (pos < il) {
        const char *nx = memmem(inp + pos, il - pos, sep, sizeof sep - 1);
        size_t cl = nx ? (size_t)(nx - (inp + pos)) : il - pos;
        char *eol = strchr(line, '\n');
        assert_non_null(eol); /* as many lines of ids as cases */
        *eol = 0;
        size_t n = 0;
        uint32_t *ids = tokenize(v, inp + pos, cl, 0, 0, &n);
        /* the expected ids: the line stripped, split at single spaces */
        char *q = line;
        while (*q == ' ' || *q == '\t' || *q == '\r')
            q++;
        size_t want = 0, same = 1;
        while (*q) {
            char *e = NULL;
            unsigned long id = strtoul(q, &e, 10);
            if (want >= n || ids[want] != id)
                same = 0;
            want++;
            q = e;
            while (*q == ' ' || *q == '\r')
                q++;
        }
        if (!same || want != n) {
            bad++;
            if (bad <= 3)
                fprintf(stderr, "%s case %zu: '%.*s': %zu ids, %zu expected\n", name, k,
                        (int)(cl > 60 ? 60 : cl), inp + pos, n, want);
        }
        free(ids);
        line = eol + 1;
        k++;
        pos = nx ? (size_t)(nx - inp) + sizeof sep - 1 : il;
    }
    free(inp);
    free(out);
    *n_cases = k;
    return bad;
}

static void oracle(const char *name, size_t min_cases)
{
    st_vocab *v = open_named(name);
    size_t n = 0, bad = run_cases(v, name, &n);
    fprintf(stderr, "%s: %zu cases, %zu differ\n", name, n, bad);
    assert_true(n >= min_cases);
    assert_int_equal(bad, 0);
    st_vocab_free(v);
}

static void test_oracle_qwen2(void **st)
{
    (void)st;
    oracle("qwen2", 40);
}

static void test_oracle_qwen35(void **st)
{
    (void)st;
    oracle("qwen35", 40);
}

static void test_oracle_llama_bpe(void **st)
{
    (void)st;
    oracle("llama-bpe", 40);
}

/* A copy of NAME's vocabulary file with tokenizer.ggml.pre set to pre (in the scratch dir). */
static st_vocab *with_pre(const char *name, const char *pre, const char *dir)
{
    char p[1024], q[1024];
    snprintf(p, sizeof p, "%s/ggml-vocab-%s.gguf", g_dir, name);
    snprintf(q, sizeof q, "%s/%s-as-%s.gguf", dir, name, pre);
    st_gguf *g = NULL;
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_open(p, &g), 0);
    assert_int_equal(st_gguf_writer_new(&w, st_gguf_alignment(g)), 0);
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (strcmp(k, "general.alignment") && strcmp(k, "tokenizer.ggml.pre"))
            assert_int_equal(st_gguf_writer_copy_kv(w, g, i), 0);
    }
    assert_int_equal(st_gguf_writer_set_str(w, "tokenizer.ggml.pre", pre), 0);
    assert_int_equal(st_gguf_writer_write(w, q), 0);
    st_gguf_writer_free(w);
    st_gguf_close(g);
    st_vocab *v = NULL;
    int rc = st_vocab_open(q, &v);
    if (rc) {
        assert_null(v);
        return NULL;
    }
    return v;
}

/* The negative control: the comparison can fail. Only a vocabulary that tells the splitters
 * apart can: the llama-bpe cases with qwen2's splitter differ (digit runs, ignore_merges),
 * while the qwen2 cases with llama-bpe's and the qwen35 cases with qwen2's all come out the
 * same (Qwen2's vocabulary, which both files hold, has no multi-digit tokens, and its merges do
 * not join what qwen35's splitter keeps together and qwen2's splits at a combining mark). */
static void control(const char *name, const char *pre, const char *dir)
{
    size_t n = 0;
    st_vocab *v = with_pre(name, pre, dir);
    assert_non_null(v);
    size_t bad = run_cases(v, name, &n);
    fprintf(stderr, "negative control: %s cases with %s: %zu of %zu differ\n", name, pre, bad, n);
    assert_true(bad > 0);
    st_vocab_free(v);
}

static void test_wrong_pre_fails(void **st)
{
    (void)st;
    char dir[512];
    st_test_tmpdir(dir, sizeof dir, "vocab_wrong_pre");
    control("llama-bpe", "qwen2", dir);
}

static void test_refusals(void **st)
{
    (void)st;
    char dir[512];
    st_test_tmpdir(dir, sizeof dir, "vocab_refusals");
    assert_null(with_pre("qwen2", "gpt-4o", dir));
    char q[1024];
    snprintf(q, sizeof q, "%s/qwen2-as-gpt-4o.gguf", dir);
    st_vocab *v = NULL;
    assert_int_equal(st_vocab_open(q, &v), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "pre-tokenizer 'gpt-4o' is not supported"));
    /* another tokenizer model */
    st_gguf_writer *w = NULL;
    snprintf(q, sizeof q, "%s/spm.gguf", dir);
    assert_int_equal(st_gguf_writer_new(&w, 0), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "tokenizer.ggml.model", "llama"), 0);
    assert_int_equal(st_gguf_writer_write(w, q), 0);
    st_gguf_writer_free(w);
    assert_int_equal(st_vocab_open(q, &v), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "tokenizer model 'llama' is not supported"));
    assert_null(v);
}

static uint32_t find(const st_vocab *v, const char *s)
{
    return st_vocab_find(v, s, strlen(s));
}

static void test_special_tokens(void **st)
{
    (void)st;
    st_vocab *v = open_named("qwen2");
    uint32_t im_start = find(v, "<|im_start|>"), im_end = find(v, "<|im_end|>"),
             eot = find(v, "<|endoftext|>");
    assert_int_not_equal(im_start, UINT32_MAX);
    const char *s = "<|im_start|>user\nhi<|im_end|>";
    size_t n = 0, m = 0;
    uint32_t *a = tokenize(v, s, strlen(s), 0, 1, &n);
    uint32_t *b = tokenize(v, s, strlen(s), 0, 0, &m);
    assert_true(n >= 3);
    assert_int_equal(a[0], im_start);
    assert_int_equal(a[n - 1], im_end);
    for (size_t i = 0; i < m; i++)
        assert_true(b[i] != im_start && b[i] != im_end);
    /* Qwen stops on <|im_end|> and <|endoftext|>; neither is added (add_bos false) */
    assert_true(st_vocab_is_eog(v, im_end));
    assert_true(st_vocab_is_eog(v, eot));
    assert_false(st_vocab_is_eog(v, im_start));
    assert_false(st_vocab_add_bos(v));
    size_t k = 0;
    uint32_t *c = tokenize(v, s, strlen(s), 1, 1, &k);
    assert_int_equal(k, n);
    /* detokenize renders control tokens only when asked */
    char buf[256];
    size_t dl = 0;
    assert_int_equal(st_vocab_detokenize(v, a, n, 0, 1, buf, sizeof buf, &dl), 0);
    assert_int_equal(dl, strlen(s));
    assert_memory_equal(buf, s, dl);
    assert_int_equal(st_vocab_detokenize(v, a, n, 0, 0, buf, sizeof buf, &dl), 0);
    assert_int_equal(dl, strlen("user\nhi"));
    free(a);
    free(b);
    free(c);
    st_vocab_free(v);

    /* Llama 3 adds BOS; remove_special drops it again; <|eot_id|> ends generation */
    v = open_named("llama-bpe");
    uint32_t bos = st_vocab_special(v, ST_VOCAB_BOS);
    assert_int_equal(bos, 128000);
    assert_true(st_vocab_add_bos(v));
    a = tokenize(v, "Hello world", 11, 1, 0, &n);
    assert_int_equal(a[0], bos);
    assert_int_equal(st_vocab_detokenize(v, a, n, 1, 1, buf, sizeof buf, &dl), 0);
    assert_int_equal(dl, 11);
    assert_memory_equal(buf, "Hello world", 11);
    assert_true(st_vocab_is_eog(v, find(v, "<|eot_id|>")));
    assert_true(st_vocab_is_eog(v, find(v, "<|end_of_text|>")));
    /* clean_spaces: " ," loses its space, as llama_detokenize does */
    free(a);
    a = tokenize(v, "a , b", 5, 0, 0, &n);
    assert_int_equal(st_vocab_detokenize(v, a, n, 0, 0, buf, sizeof buf, &dl), 0);
    assert_int_equal(dl, 4);
    assert_memory_equal(buf, "a, b", 4);
    free(a);
    st_vocab_free(v);
}

/* A copy of NAME's vocabulary file with tokenizer.ggml.add_bos_token / add_eos_token set (in the
 * scratch dir). */
static st_vocab *with_add(const char *name, int add_bos, int add_eos, const char *dir)
{
    char p[1024], q[1024];
    snprintf(p, sizeof p, "%s/ggml-vocab-%s.gguf", g_dir, name);
    snprintf(q, sizeof q, "%s/%s-add-%d%d.gguf", dir, name, add_bos, add_eos);
    st_gguf *g = NULL;
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_open(p, &g), 0);
    assert_int_equal(st_gguf_writer_new(&w, st_gguf_alignment(g)), 0);
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++) {
        const char *k = st_gguf_kv_key(g, i);
        if (strcmp(k, "general.alignment") && strcmp(k, "tokenizer.ggml.add_bos_token") &&
            strcmp(k, "tokenizer.ggml.add_eos_token"))
            assert_int_equal(st_gguf_writer_copy_kv(w, g, i), 0);
    }
    assert_int_equal(st_gguf_writer_set_bool(w, "tokenizer.ggml.add_bos_token", add_bos), 0);
    assert_int_equal(st_gguf_writer_set_bool(w, "tokenizer.ggml.add_eos_token", add_eos), 0);
    assert_int_equal(st_gguf_writer_write(w, q), 0);
    st_gguf_writer_free(w);
    st_gguf_close(g);
    st_vocab *v = NULL;
    assert_int_equal(st_vocab_open(q, &v), 0);
    return v;
}

/* The add_bos_token / add_eos_token keys override the pre-tokenizer's defaults (llama-bpe adds
 * BOS, qwen2 nothing): with add_special the ids are framed by what they say, without it by
 * nothing; detokenize's remove_special takes the frame off again. */
static void test_add_special_keys(void **st)
{
    (void)st;
    char dir[512], buf[64];
    st_test_tmpdir(dir, sizeof dir, "vocab_add_keys");
    const char *s = "Hello world";
    size_t n0 = 0, n = 0, m = 0, dl = 0;
    st_vocab *plain = open_named("qwen2");
    uint32_t *base = tokenize(plain, s, strlen(s), 1, 0, &n0); /* qwen2: nothing added */
    st_vocab *v = with_add("qwen2", 1, 1, dir);
    assert_true(st_vocab_add_bos(v) && st_vocab_add_eos(v));
    uint32_t bos = st_vocab_special(v, ST_VOCAB_BOS), eos = st_vocab_special(v, ST_VOCAB_EOS);
    assert_int_not_equal(bos, UINT32_MAX);
    assert_int_not_equal(eos, UINT32_MAX);
    uint32_t *a = tokenize(v, s, strlen(s), 1, 0, &n);
    assert_int_equal(n, n0 + 2);
    assert_int_equal(a[0], bos);
    assert_memory_equal(a + 1, base, n0 * sizeof *base);
    assert_int_equal(a[n - 1], eos);
    uint32_t *b = tokenize(v, s, strlen(s), 0, 0, &m);
    assert_int_equal(m, n0);
    assert_memory_equal(b, base, n0 * sizeof *base);
    assert_int_equal(st_vocab_detokenize(v, a, n, 1, 1, buf, sizeof buf, &dl), 0);
    assert_int_equal(dl, strlen(s));
    assert_memory_equal(buf, s, dl);
    free(a);
    free(b);
    free(base);
    st_vocab_free(v);
    st_vocab_free(plain);
    /* llama-bpe told not to add BOS adds nothing */
    v = with_add("llama-bpe", 0, 0, dir);
    assert_false(st_vocab_add_bos(v));
    a = tokenize(v, s, strlen(s), 1, 0, &n);
    for (size_t i = 0; i < n; i++)
        assert_int_not_equal(a[i], st_vocab_special(v, ST_VOCAB_BOS));
    free(a);
    st_vocab_free(v);
}

/* GPT-2's byte alphabet both ways: the token of each byte's character (counted here the way the
 * table is defined) renders that byte. */
static void test_byte_alphabet(void **st)
{
    (void)st;
    st_vocab *v = open_named("llama-bpe");
    uint32_t n = 0;
    for (uint32_t b = 0; b < 256; b++) {
        int self = (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || b >= 0xae;
        uint32_t cp = self ? b : 256 + n++;
        char u[2] = {(char)cp, 0};
        size_t ul = 1;
        if (cp >= 0x80) {
            u[0] = (char)(0xc0 | (cp >> 6));
            u[1] = (char)(0x80 | (cp & 0x3f));
            ul = 2;
        }
        uint32_t id = st_vocab_find(v, u, ul);
        assert_int_not_equal(id, UINT32_MAX);
        char out[8];
        size_t k = 0;
        assert_int_equal(st_vocab_token_piece(v, id, 0, out, sizeof out, &k), 0);
        assert_int_equal(k, 1);
        assert_int_equal((uint8_t)out[0], b);
        /* and a byte string that is valid UTF-8 tokenizes to what renders it */
        if (b < 0x80) {
            size_t m = 0;
            uint32_t *ids = tokenize(v, (const char *)&(char){(char)b}, 1, 0, 0, &m);
            assert_int_equal(m, 1);
            assert_int_equal(ids[0], id);
            free(ids);
        }
    }
    assert_int_equal(n, 68);
    st_vocab_free(v);
}

/* One vocabulary, tokenized from two threads at once (st_engine.h: any number of threads), gives
 * each the ids one thread gets. */
typedef struct tok_job {
    const st_vocab *v;
    const char *s;
    size_t len, n;
    uint32_t *ids;
} tok_job;

static void *tok_thread(void *arg)
{
    tok_job *j = arg;
    if (st_vocab_tokenize(j->v, j->s, j->len, 1, 1, NULL, 0, &j->n) == 0 &&
        (j->ids = malloc((j->n + 1) * sizeof *j->ids)))
        st_vocab_tokenize(j->v, j->s, j->len, 1, 1, j->ids, j->n, &j->n);
    return NULL;
}

static void test_threads(void **st)
{
    (void)st;
    st_vocab *v = open_named("qwen35");
    const char *s = "<|im_start|>Déjà vu 12345 中文 🚀 re\xcc\x81sume\xcc\x81\n\tx\xff";
    tok_job j[2] = {{v, s, strlen(s), 0, NULL}, {v, s, strlen(s), 0, NULL}};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, tok_thread, &j[i]), 0);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    size_t n = 0;
    uint32_t *ids = tokenize(v, s, strlen(s), 1, 1, &n);
    for (int i = 0; i < 2; i++) {
        assert_non_null(j[i].ids);
        assert_int_equal(j[i].n, n);
        assert_memory_equal(j[i].ids, ids, n * sizeof *ids);
        free(j[i].ids);
    }
    free(ids);
    st_vocab_free(v);
}

static int same_ids(const st_vocab *v, const char *x, size_t xl, const char *y, size_t yl)
{
    size_t n = 0, m = 0;
    uint32_t *a = tokenize(v, x, xl, 0, 0, &n), *b = tokenize(v, y, yl, 0, 0, &m);
    int same = n == m && !memcmp(a, b, n * sizeof *a);
    free(a);
    free(b);
    return same;
}

/* Any bytes tokenize, as llama.cpp reads them; memory stays proportional to the text. */
static void test_invalid_utf8_and_random_bytes(void **st)
{
    (void)st;
    st_vocab *v = open_named("qwen2");
    /* a stray continuation byte, a lead byte alone, 0xFF: each U+FFFD */
    assert_true(same_ids(v, "a\x80" "b", 3, "a\xef\xbf\xbd" "b", 5));
    assert_true(same_ids(v, "\xe4\xb8" "x", 3, "\xef\xbf\xbd\xef\xbf\xbd" "x", 7));
    assert_true(same_ids(v, "\xff", 1, "\xef\xbf\xbd", 3));
    /* an overlong NUL reads as NUL; above U+10FFFF is one U+FFFD per byte */
    assert_true(same_ids(v, "\xc0\x80", 2, "\x00", 1));
    assert_true(same_ids(v, "\xf7\xbf\xbf\xbf", 4,
                         "\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd\xef\xbf\xbd", 12));
    size_t len = 1u << 18;
    char *r = malloc(len);
    assert_non_null(r);
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (size_t i = 0; i < len; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        r[i] = (char)(x >> 24);
    }
    size_t n = 0;
    uint32_t *ids = tokenize(v, r, len, 1, 1, &n);
    assert_true(n > 0 && n <= 6 * len + 2);
    for (size_t i = 0; i < n; i++)
        assert_true(ids[i] < st_vocab_n_tokens(v));
    /* a short buffer gets what fits and the full count */
    uint32_t few[4];
    size_t m = 0;
    assert_int_equal(st_vocab_tokenize(v, r, len, 1, 1, few, 4, &m), 0);
    assert_int_equal(m, n);
    assert_memory_equal(few, ids, sizeof few);
    free(ids);
    free(r);
    st_vocab_free(v);
}

static int utf8_complete(const char *s, size_t n)
{
    size_t i = 0;
    while (i < n) {
        unsigned char c = (unsigned char)s[i];
        size_t k = c < 0x80 ? 1 : (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
        if (i + k > n)
            return 0;
        i += k;
    }
    return 1;
}

/* The streaming decoder holds an incomplete UTF-8 sequence until the next token completes it;
 * what it writes, concatenated, is the detokenized text. */
static void test_stream_decoder(void **st)
{
    (void)st;
    st_vocab *v = open_named("qwen2");
    const char *s = "héllo 🚀 wörld 中文字 😶‍🌫️ ok";
    size_t n = 0, len = strlen(s);
    uint32_t *ids = tokenize(v, s, len, 0, 0, &n);
    char out[512], chunk[64];
    size_t at = 0, held = 0;
    st_vocab_stream sd = {0};
    for (size_t i = 0; i < n; i++) {
        size_t k = 0;
        assert_int_equal(st_vocab_stream_push(v, &sd, ids[i], 1, chunk, sizeof chunk, &k), 0);
        assert_true(utf8_complete(chunk, k));
        if (sd.n_held)
            held++;
        memcpy(out + at, chunk, k);
        at += k;
    }
    at += st_vocab_stream_flush(&sd, out + at, sizeof out - at);
    assert_true(held > 0); /* the emoji are split across tokens */
    assert_int_equal(at, len);
    assert_memory_equal(out, s, len);
    /* too small a buffer: refused, nothing changed */
    size_t k = 0;
    assert_int_equal(st_vocab_stream_push(v, &sd, ids[0], 1, chunk, 0, &k), ST_ETOOBIG);
    assert_true(k > 0);
    assert_int_equal(sd.n_held, 0);
    /* detokenize is the inverse of tokenize for byte-level BPE (qwen2 cleans no spaces) */
    size_t dl = 0;
    assert_int_equal(st_vocab_detokenize(v, ids, n, 0, 1, out, sizeof out, &dl), 0);
    assert_int_equal(dl, len);
    assert_memory_equal(out, s, len);
    free(ids);
    st_vocab_free(v);
}

/* The loader keeps a model's vocabulary: the seeded qwen3 file's (pre qwen2), none for
 * strata-hybrid's byte tokenizer. */
static void test_model_vocab(void **st)
{
    (void)st;
    char dir[512], p[1024];
    st_test_tmpdir(dir, sizeof dir, "vocab_model");
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("qwen3", "tiny", &hp), 0);
    snprintf(p, sizeof p, "%s/qwen3.gguf", dir);
    assert_int_equal(st_model_write_seeded(&hp, 1, "q", p), 0);
    st_model *m = NULL;
    assert_int_equal(st_model_load(p, &m), 0);
    const st_vocab *v = st_model_vocab(m);
    assert_non_null(v);
    assert_string_equal(st_vocab_pre_name(v), "qwen2");
    assert_int_equal(st_vocab_n_tokens(v), hp.n_vocab);
    st_model_free(m);
    et_model(p, sizeof p, dir, "hybrid.gguf", 1, NULL);
    assert_int_equal(st_model_load(p, &m), 0);
    assert_null(st_model_vocab(m));
    st_model_free(m);
}

/* strata tokenize / detokenize print what the library computes. */
static void test_cli(void **st)
{
    (void)st;
    char dir[512], cmd[4096], txt[1024], got[4096];
    st_test_tmpdir(dir, sizeof dir, "vocab_cli");
    const char *s = "<|im_start|>Hello 世界 123\n";
    snprintf(txt, sizeof txt, "%s/t.txt", dir);
    FILE *f = fopen(txt, "wb");
    assert_non_null(f);
    fputs(s, f);
    fclose(f);
    st_vocab *v = open_named("qwen2");
    size_t n = 0;
    uint32_t *ids = tokenize(v, s, strlen(s), 0, 1, &n);
    char want[4096];
    size_t wl = 0;
    for (size_t i = 0; i < n; i++)
        wl += (size_t)snprintf(want + wl, sizeof want - wl, i ? " %u" : "%u", ids[i]);
    snprintf(want + wl, sizeof want - wl, "\n");
    snprintf(cmd, sizeof cmd, "%s/strata tokenize -m %s/ggml-vocab-qwen2.gguf --parse-special "
             "--file %s", ST_BIN_DIR, g_dir, txt);
    FILE *pp = popen(cmd, "r");
    assert_non_null(pp);
    size_t gl = fread(got, 1, sizeof got - 1, pp);
    assert_int_equal(pclose(pp), 0);
    got[gl] = 0;
    assert_string_equal(got, want);
    /* TEXT on the command line, without --parse-special: the control token is text */
    const char *arg = "Hi 世界 42 <|im_start|>";
    free(ids);
    ids = tokenize(v, arg, strlen(arg), 0, 0, &n);
    wl = 0;
    for (size_t i = 0; i < n; i++)
        wl += (size_t)snprintf(want + wl, sizeof want - wl, i ? " %u" : "%u", ids[i]);
    snprintf(want + wl, sizeof want - wl, "\n");
    snprintf(cmd, sizeof cmd, "%s/strata tokenize -m %s/ggml-vocab-qwen2.gguf '%s'", ST_BIN_DIR,
             g_dir, arg);
    pp = popen(cmd, "r");
    assert_non_null(pp);
    gl = fread(got, 1, sizeof got - 1, pp);
    assert_int_equal(pclose(pp), 0);
    got[gl] = 0;
    assert_string_equal(got, want);
    free(ids);
    ids = tokenize(v, s, strlen(s), 0, 1, &n);
    /* detokenize: the exact text, no newline */
    int k = snprintf(cmd, sizeof cmd, "%s/strata detokenize -m %s/ggml-vocab-qwen2.gguf",
                     ST_BIN_DIR, g_dir);
    for (size_t i = 0; i < n; i++)
        k += snprintf(cmd + k, sizeof cmd - (size_t)k, " %u", ids[i]);
    pp = popen(cmd, "r");
    assert_non_null(pp);
    gl = fread(got, 1, sizeof got, pp);
    assert_int_equal(pclose(pp), 0);
    assert_int_equal(gl, strlen(s));
    assert_memory_equal(got, s, gl);
    /* a bad id is an error naming it */
    snprintf(cmd, sizeof cmd, "%s/strata detokenize -m %s/ggml-vocab-qwen2.gguf 7 999999999 "
             "2>&1", ST_BIN_DIR, g_dir);
    pp = popen(cmd, "r");
    gl = fread(got, 1, sizeof got - 1, pp);
    got[gl] = 0;
    assert_int_not_equal(pclose(pp), 0);
    assert_non_null(strstr(got, "token 999999999"));
    free(ids);
    st_vocab_free(v);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: test_engine_vocab DIR (vocab_files.sh's output)\n");
        return 2;
    }
    g_dir = argv[1];
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_oracle_qwen2),
        cmocka_unit_test(test_oracle_qwen35),
        cmocka_unit_test(test_oracle_llama_bpe),
        cmocka_unit_test(test_wrong_pre_fails),
        cmocka_unit_test(test_refusals),
        cmocka_unit_test(test_special_tokens),
        cmocka_unit_test(test_byte_alphabet),
        cmocka_unit_test(test_threads),
        cmocka_unit_test(test_invalid_utf8_and_random_bytes),
        cmocka_unit_test(test_stream_decoder),
        cmocka_unit_test(test_add_special_keys),
        cmocka_unit_test(test_model_vocab),
        cmocka_unit_test(test_cli),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
