/*
 * st_vocab.c - the byte-level BPE tokenizer of a GGUF model (tokenizer.ggml.model = "gpt2") with
 * the pre-tokenizers qwen2, qwen35 and llama-bpe, as llama.cpp v0.4.0 applies them
 * (ARCHITECTURES.md §5, docs/MODELS.md "Tokenizer").
 *
 * Invariants:
 * 1. Every string the vocabulary knows lives in one arena and is named by an xid: ids
 *    [0, n_tokens) are the tokens in file order, the ids after them the texts that merges name
 *    but the vocabulary does not hold. text_map finds an xid by its text; token texts are unique
 *    (a file that repeats one is refused, as llama.cpp's loader asserts).
 * 2. A merge "left right" of rank r is (xid left, xid right) -> (r, xid left+right) in
 *    merge_map; the first of two equal pairs keeps its rank.
 * 3. The vocabulary is immutable after st_vocab_load; tokenizing allocates its own scratch,
 *    proportional to the text (at most a few words per byte), so one vocabulary serves any
 *    number of threads.
 * 4. With tokenizer.strata.normalizer = "nfc" each fragment between special tokens is
 *    normalized to NFC (ICU) after decoding, as the published Qwen tokenizers do; llama.cpp
 *    knows no such key and never normalizes, so a GGUF of its converter tokenizes as it does.
 * 5. Unicode categories come from ICU (libicu, Unicode 15.0 in Debian 12), the whitespace set
 *    is llama.cpp's 25 code points. Text is decoded as llama.cpp decodes it: a byte that does not
 *    start a complete sequence becomes U+FFFD and the next byte is read; overlong forms and
 *    surrogates are read as the code points they spell and re-encoded canonically.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <unicode/uchar.h>
#include <unicode/unorm2.h>

#include "st_engine.h"

#define F_NUM 0x01u
#define F_LET 0x02u
#define F_MARK 0x04u
#define F_WS 0x08u
#define F_ANY 0x10u /* inside the fragment (llama.cpp's flags are never 0 there) */

#define A_NORMAL ST_VOCAB_ATTR_NORMAL
#define A_UNKNOWN ST_VOCAB_ATTR_UNKNOWN
#define A_CONTROL ST_VOCAB_ATTR_CONTROL
#define A_USER ST_VOCAB_ATTR_USER_DEFINED
#define A_UNUSED ST_VOCAB_ATTR_UNUSED
#define A_BYTE ST_VOCAB_ATTR_BYTE

#define NONE UINT32_MAX

typedef struct span {
    uint32_t off, len;
} span;

typedef struct merge_ent {
    uint32_t l, r, rank, res; /* l == NONE: empty slot */
} merge_ent;

struct st_vocab {
    uint32_t n_tokens, n_x, x_cap;
    span *x;
    char *arena;
    size_t arena_len, arena_cap;
    uint8_t *attr;      /* per token */
    uint32_t *text_map; /* xid + 1, 0 empty */
    uint32_t text_mask;
    merge_ent *merge_map;
    uint32_t merge_mask, n_merges;
    uint32_t byte_xid[256]; /* the byte-level character of byte b, or NONE */
    uint32_t *special;      /* CONTROL / USER_DEFINED / UNKNOWN ids, longest text first */
    uint32_t n_special;
    uint32_t *eog; /* sorted */
    uint32_t n_eog;
    st_vocab_pre pre;
    char pre_name[32];
    int add_bos, add_eos, ignore_merges, clean_spaces;
    int nfc; /* tokenizer.strata.normalizer "nfc": the published tokenizer normalizes (Qwen) */
    uint32_t bos, eos, eot, eom, pad;
};

/* ---- Unicode ------------------------------------------------------------------------------- */

static int is_ws(uint32_t c)
{
    return (c >= 0x09 && c <= 0x0d) || c == 0x20 || c == 0x85 || c == 0xa0 || c == 0x1680 ||
           (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
           c == 0x205f || c == 0x3000;
}

static uint8_t cp_flags(uint32_t c)
{
    uint32_t m = U_GET_GC_MASK((UChar32)c);
    uint8_t f = F_ANY;
    if (m & U_GC_L_MASK)
        f |= F_LET;
    else if (m & U_GC_N_MASK)
        f |= F_NUM;
    else if (m & U_GC_M_MASK)
        f |= F_MARK;
    if (is_ws(c))
        f |= F_WS;
    return f;
}

/* One code point from s[*i..n), as llama.cpp's unicode_cpt_from_utf8 reads it; a byte that does
 * not start a complete sequence is U+FFFD and consumes one byte. A 4-byte form above U+10FFFF
 * (which llama.cpp v0.4.0 throws on while re-encoding) is treated the same way. */
static uint32_t utf8_next(const uint8_t *s, size_t n, size_t *i)
{
    size_t p = *i;
    uint8_t b = s[p];
    uint32_t c;
    size_t k;
    if (b < 0x80) {
        *i = p + 1;
        return b;
    }
    if ((b & 0xe0) == 0xc0) {
        k = 2;
        c = b & 0x1fu;
    } else if ((b & 0xf0) == 0xe0) {
        k = 3;
        c = b & 0x0fu;
    } else if ((b & 0xf8) == 0xf0) {
        k = 4;
        c = b & 0x07u;
    } else {
        *i = p + 1;
        return 0xfffd;
    }
    if (p + k > n) {
        *i = p + 1;
        return 0xfffd;
    }
    for (size_t j = 1; j < k; j++) {
        if ((s[p + j] & 0xc0) != 0x80) {
            *i = p + 1;
            return 0xfffd;
        }
        c = (c << 6) | (s[p + j] & 0x3fu);
    }
    if (c > 0x10ffff) {
        *i = p + 1;
        return 0xfffd;
    }
    *i = p + k;
    return c;
}

static size_t utf8_put(uint32_t c, uint8_t *d)
{
    if (c < 0x80) {
        d[0] = (uint8_t)c;
        return 1;
    }
    if (c < 0x800) {
        d[0] = (uint8_t)(0xc0 | (c >> 6));
        d[1] = (uint8_t)(0x80 | (c & 0x3f));
        return 2;
    }
    if (c < 0x10000) {
        d[0] = (uint8_t)(0xe0 | (c >> 12));
        d[1] = (uint8_t)(0x80 | ((c >> 6) & 0x3f));
        d[2] = (uint8_t)(0x80 | (c & 0x3f));
        return 3;
    }
    d[0] = (uint8_t)(0xf0 | (c >> 18));
    d[1] = (uint8_t)(0x80 | ((c >> 12) & 0x3f));
    d[2] = (uint8_t)(0x80 | ((c >> 6) & 0x3f));
    d[3] = (uint8_t)(0x80 | (c & 0x3f));
    return 4;
}

/* GPT-2's byte-level alphabet: the code point that stands for byte b. */
static int byte_printable(uint32_t b)
{
    return (b >= 0x21 && b <= 0x7e) || (b >= 0xa1 && b <= 0xac) || (b >= 0xae && b <= 0xff);
}

/* The 68 other bytes, in increasing order, stand for U+0100 + n: 0x00..0x20 (n 0..32),
 * 0x7F..0xA0 (n 33..66) and 0xAD (n 67). */
static uint32_t byte_cp(uint32_t b)
{
    if (byte_printable(b))
        return b;
    return 256 + (b <= 0x20 ? b : b <= 0xa0 ? 33 + (b - 0x7f) : 67);
}

/* The byte a byte-level code point stands for, or -1. */
static int cp_byte(uint32_t c)
{
    if (c < 256)
        return byte_printable(c) ? (int)c : -1;
    uint32_t n = c - 256;
    return n < 33 ? (int)n : n < 67 ? (int)(0x7f + n - 33) : n == 67 ? 0xad : -1;
}

/* ---- tables -------------------------------------------------------------------------------- */

static uint64_t hash_bytes(const void *p, size_t n)
{
    const uint8_t *s = p;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++)
        h = (h ^ s[i]) * 0x100000001b3ull;
    return h ^ (h >> 29);
}

static uint64_t hash_pair(uint32_t a, uint32_t b)
{
    uint64_t h = ((uint64_t)a << 32 | b) * 0x9e3779b97f4a7c15ull;
    return h ^ (h >> 31);
}

static const char *x_text(const st_vocab *v, uint32_t x)
{
    return v->arena + v->x[x].off;
}

static uint32_t text_find(const st_vocab *v, const void *s, size_t n)
{
    if (!v->text_map)
        return NONE;
    uint32_t i = (uint32_t)hash_bytes(s, n) & v->text_mask;
    for (;; i = (i + 1) & v->text_mask) {
        uint32_t e = v->text_map[i];
        if (!e)
            return NONE;
        if (v->x[e - 1].len == n && !memcmp(x_text(v, e - 1), s, n))
            return e - 1;
    }
}

static int text_grow(st_vocab *v)
{
    uint32_t cap = v->text_mask ? (v->text_mask + 1) * 2 : 1024;
    uint32_t *m = calloc(cap, sizeof *m);
    if (!m)
        return st_error_set(ENOMEM, "vocab: text table");
    for (uint32_t x = 0; x < v->n_x; x++) {
        uint32_t i = (uint32_t)hash_bytes(x_text(v, x), v->x[x].len) & (cap - 1);
        while (m[i])
            i = (i + 1) & (cap - 1);
        m[i] = x + 1;
    }
    free(v->text_map);
    v->text_map = m;
    v->text_mask = cap - 1;
    return 0;
}

/* Add a text as a new xid (the caller checked it is absent, except for tokens). */
static int x_add(st_vocab *v, const void *s, size_t n, uint32_t *out)
{
    if (n > UINT32_MAX / 2 || v->n_x == UINT32_MAX - 1)
        return st_error_set(ST_ETOOBIG, "vocab: text of %zu bytes", n);
    if (v->arena_len + n + 1 > v->arena_cap) {
        size_t cap = v->arena_cap ? v->arena_cap : 1 << 16;
        while (v->arena_len + n + 1 > cap)
            cap *= 2;
        if (cap > UINT32_MAX)
            return st_error_set(ST_ETOOBIG, "vocab: texts beyond 4 GiB");
        char *a = realloc(v->arena, cap);
        if (!a)
            return st_error_set(ENOMEM, "vocab: texts");
        v->arena = a;
        v->arena_cap = cap;
    }
    if (v->n_x == v->x_cap) {
        uint32_t cap = v->x_cap ? v->x_cap * 2 : 1024;
        span *x = realloc(v->x, (size_t)cap * sizeof *x);
        if (!x)
            return st_error_set(ENOMEM, "vocab: texts");
        v->x = x;
        v->x_cap = cap;
    }
    if ((uint64_t)(v->n_x + 1) * 2 > (uint64_t)v->text_mask + 1) {
        int rc = text_grow(v);
        if (rc)
            return rc;
    }
    memcpy(v->arena + v->arena_len, s, n);
    v->arena[v->arena_len + n] = 0;
    v->x[v->n_x] = (span){(uint32_t)v->arena_len, (uint32_t)n};
    v->arena_len += n + 1;
    uint32_t i = (uint32_t)hash_bytes(s, n) & v->text_mask;
    while (v->text_map[i])
        i = (i + 1) & v->text_mask;
    v->text_map[i] = v->n_x + 1;
    *out = v->n_x++;
    return 0;
}

static int x_intern(st_vocab *v, const void *s, size_t n, uint32_t *out)
{
    if ((*out = text_find(v, s, n)) != NONE)
        return 0;
    return x_add(v, s, n, out);
}

static const merge_ent *merge_find(const st_vocab *v, uint32_t l, uint32_t r)
{
    uint32_t i = (uint32_t)hash_pair(l, r) & v->merge_mask;
    for (;; i = (i + 1) & v->merge_mask) {
        const merge_ent *e = &v->merge_map[i];
        if (e->l == NONE)
            return NULL;
        if (e->l == l && e->r == r)
            return e;
    }
}

/* ---- loading ------------------------------------------------------------------------------- */

/* A cursor over a key's serialized array (st_gguf_kv_raw): checked reads. */
typedef struct arr_cur {
    const uint8_t *p;
    uint64_t len, off;
    const char *key;
} arr_cur;

static int arr_open(const st_gguf *g, const char *key, uint32_t want, arr_cur *c, uint64_t *n)
{
    int64_t ki = st_gguf_find(g, key);
    uint32_t et = 0;
    uint64_t cnt = 0;
    if (ki < 0)
        return ST_ENOTFOUND;
    if (st_gguf_kv_type(g, (uint64_t)ki, &et, &cnt) != ST_GGUF_ARRAY || et != want)
        return st_error_set(ST_ECORRUPT, "vocab: %s is not an array of %s", key,
                            st_gguf_kv_type_name(want));
    const void *val = NULL;
    uint64_t len = 0;
    int rc = st_gguf_kv_raw(g, (uint64_t)ki, &val, &len);
    if (rc)
        return rc;
    if (len < 12)
        return st_error_set(ST_ECORRUPT, "vocab: %s: array header truncated", key);
    *c = (arr_cur){val, len, 12, key};
    *n = cnt;
    return 0;
}

static int arr_str(arr_cur *c, uint64_t i, const char **s, uint64_t *n)
{
    if (c->len - c->off < 8)
        return st_error_set(ST_ECORRUPT, "vocab: %s[%llu]: length beyond the array", c->key,
                            (unsigned long long)i);
    uint64_t k = st_get64(c->p + c->off);
    if (k > c->len - c->off - 8)
        return st_error_set(ST_ECORRUPT, "vocab: %s[%llu]: %llu bytes beyond the array", c->key,
                            (unsigned long long)i, (unsigned long long)k);
    *s = (const char *)c->p + c->off + 8;
    *n = k;
    c->off += 8 + k;
    return 0;
}

/* An optional id key: kept when in range (llama.cpp keeps its default otherwise). */
static int get_id(const st_gguf *g, const char *key, uint32_t n_tokens, uint32_t *id)
{
    uint32_t v = 0;
    int rc = st_gguf_get_u32(g, key, &v);
    if (rc == ST_ENOTFOUND)
        return 0;
    if (rc)
        return rc;
    if (v < n_tokens)
        *id = v;
    return 0;
}

static int get_bool(const st_gguf *g, const char *key, int *out)
{
    int64_t ki = st_gguf_find(g, key);
    const void *val = NULL;
    uint64_t len = 0;
    if (ki < 0)
        return 0;
    if (st_gguf_kv_type(g, (uint64_t)ki, NULL, NULL) != ST_GGUF_BOOL)
        return st_error_set(ST_ECORRUPT, "vocab: %s is not a bool", key);
    int rc = st_gguf_kv_raw(g, (uint64_t)ki, &val, &len);
    if (rc)
        return rc;
    if (len != 1)
        return st_error_set(ST_ECORRUPT, "vocab: %s: %llu bytes for a bool", key,
                            (unsigned long long)len);
    *out = *(const uint8_t *)val != 0;
    return 0;
}

static const struct {
    const char *name;
    st_vocab_pre pre;
} k_pre[] = {
    {"qwen2", ST_VOCAB_PRE_QWEN2},     {"qwen35", ST_VOCAB_PRE_QWEN35},
    {"llama-bpe", ST_VOCAB_PRE_LLAMA3}, {"llama3", ST_VOCAB_PRE_LLAMA3},
    {"llama-v3", ST_VOCAB_PRE_LLAMA3},
};

/* Texts llama.cpp v0.4.0 makes CONTROL and puts in the end-of-generation set (the list of its
 * loader, of which Qwen and Llama 3 use the first few), and the FIM texts it makes CONTROL. */
static const char *const k_eog_texts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<\xef\xbd\x9c\x65nd\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>", "[e~[",
};
static const char *const k_fim_ctl[] = {"<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"};
/* FIM pad, repo, file separator: CONTROL and end-of-generation */
static const char *const k_fim_eog[] = {"<|fim_pad|>", "<|fim_repo|>", "<|repo_name|>",
                                        "<|file_sep|>"};

static int cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_size(const void *a, const void *b)
{
    size_t x = *(const size_t *)a, y = *(const size_t *)b;
    return x < y ? -1 : x > y;
}

static int cmp_special(const void *a, const void *b, void *ctx)
{
    const st_vocab *v = ctx;
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    if (v->x[x].len != v->x[y].len)
        return v->x[x].len > v->x[y].len ? -1 : 1;
    return x < y ? -1 : x > y;
}

static int eog_add(st_vocab *v, uint32_t id)
{
    for (uint32_t i = 0; i < v->n_eog; i++)
        if (v->eog[i] == id)
            return 0;
    uint32_t *e = realloc(v->eog, (v->n_eog + 1) * sizeof *e);
    if (!e)
        return st_error_set(ENOMEM, "vocab: end-of-generation set");
    v->eog = e;
    v->eog[v->n_eog++] = id;
    return 0;
}

static int load_merges(st_vocab *v, const st_gguf *g)
{
    arr_cur c;
    uint64_t n = 0;
    int rc = arr_open(g, "tokenizer.ggml.merges", ST_GGUF_STRING, &c, &n);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_EINVAL, "vocab: tokenizer.ggml.merges missing (a gpt2 "
                            "vocabulary needs its merges)");
    if (rc)
        return rc;
    if (n >= UINT32_MAX / 4)
        return st_error_set(ST_ETOOBIG, "vocab: %llu merges", (unsigned long long)n);
    uint32_t cap = 1024;
    while (cap < n * 2)
        cap *= 2;
    v->merge_map = malloc((size_t)cap * sizeof *v->merge_map);
    if (!v->merge_map)
        return st_error_set(ENOMEM, "vocab: merges");
    for (uint32_t i = 0; i < cap; i++)
        v->merge_map[i].l = NONE;
    v->merge_mask = cap - 1;
    char *buf = NULL;
    size_t buf_cap = 0;
    for (uint64_t i = 0; i < n; i++) {
        const char *s;
        uint64_t len;
        if ((rc = arr_str(&c, i, &s, &len)))
            break;
        /* "left right": split at the first space after position 0 */
        const char *sp = len > 1 ? memchr(s + 1, ' ', len - 1) : NULL;
        if (!sp)
            continue;
        size_t ll = (size_t)(sp - s), rl = len - ll - 1;
        uint32_t l, r, res;
        if ((rc = x_intern(v, s, ll, &l)) || (rc = x_intern(v, sp + 1, rl, &r)))
            break;
        if (ll + rl > buf_cap) {
            char *b = realloc(buf, ll + rl);
            if (!b) {
                rc = st_error_set(ENOMEM, "vocab: merges");
                break;
            }
            buf = b;
            buf_cap = ll + rl;
        }
        memcpy(buf, s, ll);
        memcpy(buf + ll, sp + 1, rl);
        if ((rc = x_intern(v, buf, ll + rl, &res)))
            break;
        uint32_t k = (uint32_t)hash_pair(l, r) & v->merge_mask;
        while (v->merge_map[k].l != NONE && !(v->merge_map[k].l == l && v->merge_map[k].r == r))
            k = (k + 1) & v->merge_mask;
        if (v->merge_map[k].l == NONE) {
            v->merge_map[k] = (merge_ent){l, r, (uint32_t)i, res};
            v->n_merges++;
        }
    }
    free(buf);
    return rc;
}

int st_vocab_load(const st_gguf *g, st_vocab **out)
{
    *out = NULL;
    const char *s;
    uint64_t n = 0, len = 0;
    int rc = st_gguf_get_str(g, "tokenizer.ggml.model", &s, &len);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_ENOTFOUND, "vocab: no tokenizer.ggml.model");
    if (rc)
        return rc;
    if (len != 4 || memcmp(s, "gpt2", 4))
        return st_error_set(ST_EINVAL, "vocab: tokenizer model '%.*s' is not supported (gpt2, "
                            "the byte-level BPE)", (int)(len > 64 ? 64 : len), s);
    st_vocab *v = calloc(1, sizeof *v);
    if (!v)
        return st_error_set(ENOMEM, "vocab");
    v->bos = v->eos = 11; /* llama.cpp's gpt2 defaults, kept where the file names none */
    v->eot = v->eom = v->pad = NONE;
    rc = st_gguf_get_str(g, "tokenizer.ggml.pre", &s, &len);
    if (rc == ST_ENOTFOUND) {
        rc = st_error_set(ST_EINVAL, "vocab: no tokenizer.ggml.pre (supported: qwen2, qwen35, "
                          "llama-bpe, llama3, llama-v3)");
        goto fail;
    }
    if (rc)
        goto fail;
    v->pre = ST_VOCAB_PRE_NONE;
    for (size_t i = 0; i < sizeof k_pre / sizeof k_pre[0]; i++)
        if (strlen(k_pre[i].name) == len && !memcmp(k_pre[i].name, s, len)) {
            v->pre = k_pre[i].pre;
            snprintf(v->pre_name, sizeof v->pre_name, "%s", k_pre[i].name);
        }
    if (v->pre == ST_VOCAB_PRE_NONE) {
        rc = st_error_set(ST_EINVAL, "vocab: pre-tokenizer '%.*s' is not supported (qwen2, "
                          "qwen35, llama-bpe, llama3, llama-v3)", (int)(len > 64 ? 64 : len), s);
        goto fail;
    }
    v->ignore_merges = v->clean_spaces = v->add_bos = v->pre == ST_VOCAB_PRE_LLAMA3;
    rc = st_gguf_get_str(g, "tokenizer.strata.normalizer", &s, &len);
    if (rc && rc != ST_ENOTFOUND)
        goto fail;
    if (!rc && !(len == 3 && !memcmp(s, "nfc", 3))) {
        rc = st_error_set(ST_EINVAL, "vocab: tokenizer.strata.normalizer '%.*s' is not supported "
                          "(nfc)", (int)(len > 64 ? 64 : len), s);
        goto fail;
    }
    v->nfc = !rc;

    arr_cur c;
    if ((rc = arr_open(g, "tokenizer.ggml.tokens", ST_GGUF_STRING, &c, &n))) {
        if (rc == ST_ENOTFOUND)
            rc = st_error_set(ST_EINVAL, "vocab: tokenizer.ggml.tokens missing");
        goto fail;
    }
    if (n == 0 || n >= UINT32_MAX / 4) {
        rc = st_error_set(ST_EINVAL, "vocab: %llu tokens", (unsigned long long)n);
        goto fail;
    }
    v->n_tokens = (uint32_t)n;
    if (!(v->attr = calloc(n, 1))) {
        rc = st_error_set(ENOMEM, "vocab: %llu tokens", (unsigned long long)n);
        goto fail;
    }
    for (uint32_t i = 0; i < v->n_tokens; i++) {
        char empty[32];
        if ((rc = arr_str(&c, i, &s, &len)))
            goto fail;
        if (len == 0) { /* llama.cpp names an empty token so */
            len = (uint64_t)snprintf(empty, sizeof empty, "[EMPTY_%u]", i);
            s = empty;
        }
        if (text_find(v, s, len) != NONE) {
            rc = st_error_set(ST_ECORRUPT, "vocab: token %u '%.*s' repeats token %u", i,
                              (int)(len > 64 ? 64 : len), s, text_find(v, s, len));
            goto fail;
        }
        uint32_t x;
        if ((rc = x_add(v, s, len, &x)))
            goto fail;
        v->attr[i] = A_NORMAL;
    }
    arr_cur tc;
    uint64_t nt = 0;
    rc = arr_open(g, "tokenizer.ggml.token_type", ST_GGUF_INT32, &tc, &nt);
    if (rc && rc != ST_ENOTFOUND)
        goto fail;
    if (!rc) {
        if (nt < n || tc.len - 12 < nt * 4) {
            rc = st_error_set(ST_ECORRUPT, "vocab: tokenizer.ggml.token_type has %llu of %u "
                              "types", (unsigned long long)nt, v->n_tokens);
            goto fail;
        }
        for (uint32_t i = 0; i < v->n_tokens; i++) {
            const uint8_t *p = tc.p + 12 + (size_t)i * 4;
            int32_t t = (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                                  (uint32_t)p[3] << 24);
            static const uint8_t map[7] = {0, A_NORMAL, A_UNKNOWN, A_CONTROL, A_USER, A_UNUSED,
                                           A_BYTE};
            v->attr[i] = t >= 0 && t < 7 ? map[t] : 0;
        }
    }
    rc = 0;
    if ((rc = load_merges(v, g)))
        goto fail;
    for (uint32_t b = 0; b < 256; b++) {
        uint8_t u[4];
        v->byte_xid[b] = text_find(v, u, utf8_put(byte_cp(b), u));
    }

    if ((rc = get_id(g, "tokenizer.ggml.bos_token_id", v->n_tokens, &v->bos)) ||
        (rc = get_id(g, "tokenizer.ggml.eos_token_id", v->n_tokens, &v->eos)) ||
        (rc = get_id(g, "tokenizer.ggml.eot_token_id", v->n_tokens, &v->eot)) ||
        (rc = get_id(g, "tokenizer.ggml.eom_token_id", v->n_tokens, &v->eom)) ||
        (rc = get_id(g, "tokenizer.ggml.padding_token_id", v->n_tokens, &v->pad)) ||
        (rc = get_bool(g, "tokenizer.ggml.add_bos_token", &v->add_bos)) ||
        (rc = get_bool(g, "tokenizer.ggml.add_eos_token", &v->add_eos)))
        goto fail;
    if (v->bos >= v->n_tokens)
        v->bos = NONE;
    if (v->eos >= v->n_tokens)
        v->eos = NONE;

    /* the texts llama.cpp forces to CONTROL, and the end-of-generation set it builds */
    for (size_t i = 0; i < sizeof k_fim_ctl / sizeof k_fim_ctl[0]; i++) {
        uint32_t x = text_find(v, k_fim_ctl[i], strlen(k_fim_ctl[i]));
        if (x < v->n_tokens)
            v->attr[x] |= A_CONTROL;
    }
    for (size_t i = 0; i < sizeof k_fim_eog / sizeof k_fim_eog[0]; i++) {
        uint32_t x = text_find(v, k_fim_eog[i], strlen(k_fim_eog[i]));
        if (x < v->n_tokens) {
            v->attr[x] |= A_CONTROL;
            if ((rc = eog_add(v, x)))
                goto fail;
        }
    }
    for (size_t i = 0; i < sizeof k_eog_texts / sizeof k_eog_texts[0]; i++) {
        uint32_t x = text_find(v, k_eog_texts[i], strlen(k_eog_texts[i]));
        if (x < v->n_tokens) {
            v->attr[x] |= A_CONTROL;
            if ((rc = eog_add(v, x)))
                goto fail;
            /* the eot id where the file names none: the lowest id of these texts */
            if (i < 9 && v->eot == NONE && st_gguf_find(g, "tokenizer.ggml.eot_token_id") < 0)
                v->eot = x;
        }
    }
    {
        uint32_t x = text_find(v, "<|eom_id|>", 10);
        if (x < v->n_tokens && v->eom == NONE)
            v->eom = x;
    }
    if ((v->eos != NONE && (rc = eog_add(v, v->eos))) ||
        (v->eot != NONE && (rc = eog_add(v, v->eot))) ||
        (v->eom != NONE && (rc = eog_add(v, v->eom))))
        goto fail;
    qsort(v->eog, v->n_eog, sizeof *v->eog, cmp_u32);

    for (uint32_t i = 0; i < v->n_tokens; i++)
        if (v->attr[i] & (A_CONTROL | A_USER | A_UNKNOWN))
            v->n_special++;
    if (v->n_special && !(v->special = malloc(v->n_special * sizeof *v->special))) {
        rc = st_error_set(ENOMEM, "vocab: special tokens");
        goto fail;
    }
    v->n_special = 0;
    for (uint32_t i = 0; i < v->n_tokens; i++)
        if (v->attr[i] & (A_CONTROL | A_USER | A_UNKNOWN))
            v->special[v->n_special++] = i;
    if (v->n_special) /* qsort_r takes no NULL base, even for 0 elements */
        qsort_r(v->special, v->n_special, sizeof *v->special, cmp_special, v);
    *out = v;
    return 0;
fail:
    st_vocab_free(v);
    return rc;
}

void st_vocab_free(st_vocab *v)
{
    if (!v)
        return;
    free(v->x);
    free(v->arena);
    free(v->attr);
    free(v->text_map);
    free(v->merge_map);
    free(v->special);
    free(v->eog);
    free(v);
}

/* ---- tokenizing ---------------------------------------------------------------------------- */

typedef struct sym {
    int32_t prev, next;
    uint32_t xid; /* NONE: a byte whose character the vocabulary lacks */
    uint32_t off, n; /* bytes of the word's byte-level text */
} sym;

typedef struct bigram {
    uint32_t rank;
    int32_t left, right;
    uint32_t size;
} bigram;

/* Scratch of one st_vocab_tokenize call; every buffer grows with the text and is freed at the
 * end. The output is counted past cap, never written past it. */
typedef struct tok_ctx {
    const st_vocab *v;
    uint32_t *ids;
    size_t cap, n;
    uint32_t *cp;
    uint8_t *fl;
    uint32_t *wl;
    size_t cp_cap;
    uint16_t *u16; /* NFC: the fragment in UTF-16, then normalized */
    size_t u16_cap;
    uint8_t *wb;  /* a word's UTF-8 */
    uint8_t *enc; /* its byte-level text */
    size_t w_cap, enc_cap;
    sym *s;
    bigram *h;
    size_t s_cap, h_cap, nh;
} tok_ctx;

static void emit(tok_ctx *t, uint32_t id)
{
    if (t->n < t->cap)
        t->ids[t->n] = id;
    t->n++;
}

static int grow(void **p, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap)
        return 0;
    size_t c = *cap ? *cap : 64;
    while (c < need)
        c *= 2;
    if (c > SIZE_MAX / elem / 2)
        return st_error_set(ST_ETOOBIG, "tokenize: %zu elements", need);
    void *q = realloc(*p, c * elem);
    if (!q)
        return st_error_set(ENOMEM, "tokenize: %zu elements", need);
    *p = q;
    *cap = c;
    return 0;
}

static int heap_less(const bigram *a, const bigram *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(tok_ctx *t, bigram b)
{
    size_t i = t->nh++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!heap_less(&b, &t->h[p]))
            break;
        t->h[i] = t->h[p];
        i = p;
    }
    t->h[i] = b;
}

static bigram heap_pop(tok_ctx *t)
{
    bigram top = t->h[0], last = t->h[--t->nh];
    size_t i = 0;
    for (;;) {
        size_t l = 2 * i + 1, m = i;
        const bigram *best = &last;
        if (l < t->nh && heap_less(&t->h[l], best)) {
            m = l;
            best = &t->h[l];
        }
        if (l + 1 < t->nh && heap_less(&t->h[l + 1], best))
            m = l + 1;
        if (m == i)
            break;
        t->h[i] = t->h[m];
        i = m;
    }
    if (t->nh)
        t->h[i] = last;
    return top;
}

static void add_bigram(tok_ctx *t, int32_t l, int32_t r)
{
    if (l < 0 || r < 0 || t->s[l].xid == NONE || t->s[r].xid == NONE)
        return;
    const merge_ent *m = merge_find(t->v, t->s[l].xid, t->s[r].xid);
    if (m)
        heap_push(t, (bigram){m->rank, l, r, t->s[l].n + t->s[r].n});
}

/* One pre-token (its UTF-8 in wb[0..n)): byte-level encode, BPE-merge, emit. */
static int bpe_word(tok_ctx *t, size_t n)
{
    const st_vocab *v = t->v;
    int rc;
    size_t en = 0;
    for (size_t i = 0; i < n; i++)
        en += utf8_put(byte_cp(t->wb[i]), t->enc + en);
    if (v->ignore_merges) {
        uint32_t x = text_find(v, t->enc, en);
        if (x < v->n_tokens) {
            emit(t, x);
            return 0;
        }
    }
    if ((rc = grow((void **)&t->s, &t->s_cap, n, sizeof *t->s)) ||
        (rc = grow((void **)&t->h, &t->h_cap, 3 * n + 1, sizeof *t->h)))
        return rc;
    size_t off = 0;
    for (size_t i = 0; i < n; i++) {
        uint32_t w = byte_cp(t->wb[i]) < 0x80 ? 1 : 2;
        t->s[i] = (sym){(int32_t)i - 1, i + 1 < n ? (int32_t)i + 1 : -1, v->byte_xid[t->wb[i]],
                        (uint32_t)off, w};
        off += w;
    }
    t->nh = 0;
    for (size_t i = 1; i < n; i++)
        add_bigram(t, (int32_t)i - 1, (int32_t)i);
    while (t->nh) {
        bigram b = heap_pop(t);
        sym *l = &t->s[b.left], *r = &t->s[b.right];
        if (!l->n || !r->n || l->next != b.right || l->n + r->n != b.size)
            continue; /* outdated: one side merged since */
        const merge_ent *m = merge_find(v, l->xid, r->xid);
        l->xid = m->res;
        l->n += r->n;
        r->n = 0;
        l->next = r->next;
        if (r->next >= 0)
            t->s[r->next].prev = b.left;
        add_bigram(t, l->prev, b.left);
        add_bigram(t, b.left, l->next);
    }
    for (int32_t i = 0; i >= 0 && (size_t)i < n; i = t->s[i].next) {
        const sym *y = &t->s[i];
        if (y->xid < v->n_tokens) {
            emit(t, y->xid);
            continue;
        }
        /* not a token: llama.cpp looks each byte of the text up as a one-byte token */
        for (uint32_t k = 0; k < y->n; k++) {
            uint32_t x = text_find(v, t->enc + y->off + k, 1);
            if (x < v->n_tokens)
                emit(t, x);
        }
    }
    return 0;
}

/* Pre-tokenize cp[0..n) into word lengths wl (returns the count): the GPT-4-style split of
 * ARCHITECTURES.md §5.4, as llama.cpp's hand-written splitters apply it. */
static size_t split(st_vocab_pre pre, const uint32_t *cp, const uint8_t *fl, size_t n,
                    uint32_t *wl)
{
    const uint8_t LET = pre == ST_VOCAB_PRE_QWEN35 ? (F_LET | F_MARK) : F_LET;
    const size_t dmax = pre == ST_VOCAB_PRE_LLAMA3 ? 3 : 1;
    size_t pos = 0, nw = 0;
#define FL(p) ((p) < n ? fl[p] : 0)
    while (pos < n) {
        uint32_t c = cp[pos];
        uint8_t f = fl[pos];
        size_t end = pos + 1;
        if (c == '\'' && pos + 1 < n) {
            uint32_t c1 = cp[pos + 1] | (cp[pos + 1] < 0x80 ? 0x20u : 0);
            uint32_t c2 = pos + 2 < n ? cp[pos + 2] | (cp[pos + 2] < 0x80 ? 0x20u : 0) : 0;
            if (c1 == 's' || c1 == 't' || c1 == 'm' || c1 == 'd') {
                end = pos + 2;
                goto word;
            }
            if ((c1 == 'r' && c2 == 'e') || (c1 == 'v' && c2 == 'e') || (c1 == 'l' && c2 == 'l')) {
                end = pos + 3;
                goto word;
            }
        }
        if (!(c == '\r' || c == '\n' || (f & F_NUM)) && ((f & LET) || (FL(pos + 1) & LET))) {
            end = pos + 1;
            while (FL(end) & LET)
                end++;
            goto word;
        }
        if (f & F_NUM) {
            end = pos + 1;
            while (end < n && (fl[end] & F_NUM) && end - pos < dmax)
                end++;
            goto word;
        }
        {
            uint8_t f2 = c == ' ' ? FL(pos + 1) : f;
            if (!(f2 & (F_WS | LET | F_NUM))) {
                end = pos + (c == ' ');
                while ((FL(end) & F_ANY) && !(FL(end) & (F_WS | LET | F_NUM)))
                    end++;
                while (end < n && (cp[end] == '\r' || cp[end] == '\n'))
                    end++;
                goto word;
            }
        }
        {
            size_t nws = 0, last_nl = 0;
            while (FL(pos + nws) & F_WS) {
                if (cp[pos + nws] == '\r' || cp[pos + nws] == '\n')
                    last_nl = pos + nws + 1;
                nws++;
            }
            if (last_nl)
                end = last_nl;
            else if (nws > 1 && pos + nws < n)
                end = pos + nws - 1;
            else if (nws > 0)
                end = pos + nws;
        }
    word:
        wl[nw++] = (uint32_t)(end - pos);
        pos = end;
    }
#undef FL
    return nw;
}

/* NFC of cp[0..*n) in place (the buffers grow as normalizing may lengthen it), through ICU in
 * UTF-16. Text below U+0300 is NFC already. */
static int nfc_fragment(tok_ctx *t, size_t *n)
{
    size_t i = 0, m = 0;
    while (i < *n && t->cp[i] < 0x300)
        i++;
    if (i == *n)
        return 0;
    int rc;
    if ((rc = grow((void **)&t->u16, &t->u16_cap, 2 * *n * 4 + 16, sizeof *t->u16)))
        return rc;
    for (i = 0; i < *n; i++) {
        uint32_t c = t->cp[i];
        if (c >= 0x10000) {
            t->u16[m++] = (uint16_t)(0xd800 + ((c - 0x10000) >> 10));
            t->u16[m++] = (uint16_t)(0xdc00 + ((c - 0x10000) & 0x3ff));
        } else {
            t->u16[m++] = (uint16_t)c;
        }
    }
    UErrorCode ue = U_ZERO_ERROR;
    const UNormalizer2 *nz = unorm2_getNFCInstance(&ue);
    size_t cap = t->u16_cap - m;
    if (U_FAILURE(ue) || cap > INT32_MAX || m > INT32_MAX)
        return st_error_set(ST_EINVAL, "tokenize: NFC: %s", u_errorName(ue));
    int32_t k = unorm2_normalize(nz, t->u16, (int32_t)m, t->u16 + m, (int32_t)cap, &ue);
    if (U_FAILURE(ue))
        return st_error_set(ST_ETOOBIG, "tokenize: NFC of %zu code points: %s", *n,
                            u_errorName(ue));
    if ((rc = grow((void **)&t->cp, &t->cp_cap, (size_t)k, sizeof *t->cp)))
        return rc;
    const uint16_t *u = t->u16 + m;
    size_t j = 0;
    for (int32_t p = 0; p < k; p++) {
        uint32_t c = u[p];
        if (c >= 0xd800 && c < 0xdc00 && p + 1 < k && u[p + 1] >= 0xdc00 && u[p + 1] < 0xe000)
            c = 0x10000 + ((c - 0xd800) << 10) + (u[++p] - 0xdc00);
        t->cp[j++] = c;
    }
    *n = j;
    return 0;
}

/* One fragment of raw text (no special token in it). */
static int tok_text(tok_ctx *t, const uint8_t *s, size_t len)
{
    int rc;
    if (!len)
        return 0;
    if ((rc = grow((void **)&t->cp, &t->cp_cap, len, sizeof *t->cp)))
        return rc;
    size_t cap = t->cp_cap;
    /* fl and wl are sized with cp */
    void *p = realloc(t->fl, cap);
    if (!p)
        return st_error_set(ENOMEM, "tokenize");
    t->fl = p;
    if (!(p = realloc(t->wl, cap * sizeof *t->wl)))
        return st_error_set(ENOMEM, "tokenize");
    t->wl = p;
    size_t n = 0;
    for (size_t i = 0; i < len;)
        t->cp[n++] = utf8_next(s, len, &i);
    if (t->v->nfc && (rc = nfc_fragment(t, &n)))
        return rc;
    if (t->cp_cap > cap) { /* NFC lengthened it */
        cap = t->cp_cap;
        if (!(p = realloc(t->fl, cap)))
            return st_error_set(ENOMEM, "tokenize");
        t->fl = p;
        if (!(p = realloc(t->wl, cap * sizeof *t->wl)))
            return st_error_set(ENOMEM, "tokenize");
        t->wl = p;
    }
    for (size_t i = 0; i < n; i++)
        t->fl[i] = cp_flags(t->cp[i]);
    size_t nw = split(t->v->pre, t->cp, t->fl, n, t->wl);
    size_t at = 0;
    for (size_t w = 0; w < nw; w++) {
        size_t k = t->wl[w], bn = 0;
        if ((rc = grow((void **)&t->wb, &t->w_cap, 4 * k, 1)) ||
            (rc = grow((void **)&t->enc, &t->enc_cap, 8 * k, 1)))
            return rc;
        for (size_t j = 0; j < k; j++)
            bn += utf8_put(t->cp[at + j], t->wb + bn);
        at += k;
        if ((rc = bpe_word(t, bn)))
            return rc;
    }
    return 0;
}

int st_vocab_tokenize(const st_vocab *v, const char *text, size_t len, int add_special,
                      int parse_special, uint32_t *ids, size_t cap, size_t *n_out)
{
    tok_ctx t = {.v = v, .ids = ids, .cap = ids ? cap : 0};
    const uint8_t *s = (const uint8_t *)text;
    uint8_t *taken = NULL;
    size_t *occ = NULL; /* matches of special tokens: (start, token index) pairs, by start */
    size_t n_occ = 0, occ_cap = 0;
    int rc = 0;
    *n_out = 0;
    if (add_special && v->add_bos) {
        if (v->bos == NONE)
            return st_error_set(ST_EINVAL, "tokenize: the vocabulary adds a BOS token but has "
                                "none");
        emit(&t, v->bos);
    }
    /* Special tokens are split out longest text first, each at its leftmost non-overlapping
     * occurrences in what earlier tokens left as text (llama.cpp's tokenizer_st_partition):
     * taken marks the bytes already given to a token, pick records where each one starts. */
    uint32_t *pick = NULL;
    if (v->n_special && len) {
        taken = calloc(len, 1);
        pick = malloc(len * sizeof *pick);
        if (!taken || !pick) {
            rc = st_error_set(ENOMEM, "tokenize: %zu bytes", len);
            goto done;
        }
        for (uint32_t k = 0; k < v->n_special; k++) {
            uint32_t id = v->special[k];
            if (!parse_special && (v->attr[id] & (A_CONTROL | A_UNKNOWN)))
                continue;
            const char *tx = x_text(v, id);
            size_t tl = v->x[id].len;
            const uint8_t *from = s;
            for (;;) {
                const uint8_t *m = memmem(from, len - (size_t)(from - s), tx, tl);
                if (!m)
                    break;
                size_t at = (size_t)(m - s), j = 0;
                while (j < tl && !taken[at + j])
                    j++;
                if (j < tl) { /* crosses a token taken before: look again past that byte */
                    from = m + 1;
                    continue;
                }
                memset(taken + at, 1, tl);
                if (n_occ == occ_cap && (rc = grow((void **)&occ, &occ_cap, n_occ + 1,
                                                   sizeof *occ)))
                    goto done;
                occ[n_occ++] = at;
                pick[at] = id;
                from = m + tl;
            }
        }
    }
    if (n_occ)
        qsort(occ, n_occ, sizeof *occ, cmp_size);
    size_t at = 0;
    for (size_t k = 0; k <= n_occ; k++) {
        size_t end = k < n_occ ? occ[k] : len;
        if ((rc = tok_text(&t, s + at, end - at)))
            goto done;
        if (k < n_occ) {
            emit(&t, pick[end]);
            at = end + v->x[pick[end]].len;
        }
    }
    if (add_special && v->add_eos) {
        if (v->eos == NONE) {
            rc = st_error_set(ST_EINVAL, "tokenize: the vocabulary adds an EOS token but has "
                              "none");
            goto done;
        }
        emit(&t, v->eos);
    }
    *n_out = t.n;
done:
    free(taken);
    free(pick);
    free(occ);
    free(t.cp);
    free(t.fl);
    free(t.wl);
    free(t.u16);
    free(t.wb);
    free(t.enc);
    free(t.s);
    free(t.h);
    return rc;
}

/* ---- detokenizing -------------------------------------------------------------------------- */

/* The bytes of token id (llama.cpp's token_to_piece, lstrip 0) into dst when they fit; *n is
 * their count either way. A NORMAL token's byte-level text maps back to bytes; a code point
 * outside the byte alphabet is written as llama.cpp writes it, "[UNK_BYTE_0x<hex>" + the token's
 * text + "]". */
static size_t piece(const st_vocab *v, uint32_t id, int special, char *dst, size_t cap)
{
    uint8_t a = v->attr[id];
    const char *tx = x_text(v, id);
    size_t tl = v->x[id].len, k = 0;
    if (!special && (a & (A_CONTROL | A_UNKNOWN)))
        return 0;
    if (a & (A_CONTROL | A_UNKNOWN | A_USER)) {
        if (tl <= cap)
            memcpy(dst, tx, tl);
        return tl;
    }
    if (!(a & (A_NORMAL | A_BYTE)))
        return 0;
    for (size_t i = 0; i < tl;) {
        uint32_t c = utf8_next((const uint8_t *)tx, tl, &i);
        int b = cp_byte(c);
        if (b >= 0) {
            if (k < cap)
                dst[k] = (char)b;
            k++;
            continue;
        }
        uint8_t u[4];
        char w[16];
        size_t un = utf8_put(c, u);
        size_t m = 0;
        const char *pre = "[UNK_BYTE_0x";
        for (size_t j = 0; pre[j]; j++, k++)
            if (k < cap)
                dst[k] = pre[j];
        for (size_t j = 0; j < un; j++)
            m += (size_t)snprintf(w + m, sizeof w - m, "%02x", u[j]);
        for (size_t j = 0; j < m; j++, k++)
            if (k < cap)
                dst[k] = w[j];
        for (size_t j = 0; j < tl; j++, k++)
            if (k < cap)
                dst[k] = tx[j];
        if (k < cap)
            dst[k] = ']';
        k++;
    }
    return k;
}

int st_vocab_token_piece(const st_vocab *v, uint32_t id, int special, char *dst, size_t cap,
                         size_t *n)
{
    *n = 0;
    if (id >= v->n_tokens)
        return st_error_set(ST_EINVAL, "detokenize: token %u beyond the vocabulary's %u", id,
                            v->n_tokens);
    *n = piece(v, id, special, dst, dst ? cap : 0);
    return 0;
}

/* llama.cpp's clean_spaces on the whole text (llama-bpe): " ?", " !", " .", " ," lose their
 * space, " ' " becomes "'", and " 's", " 'm", " 're", " 've" lose theirs. */
static size_t clean_spaces(char *t, size_t total)
{
    size_t n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) {
        char x = t[i];
        if (t[i - 1] == ' ' && (x == '?' || x == '!' || x == '.' || x == ','))
            n--;
        t[n++] = x;
    }
    total = n;
    n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) {
        char x = t[i];
        if (x == '\'' && i + 1 < total && t[i - 1] == ' ' && t[i + 1] == ' ') {
            n--;
            t[++i] = 0;
        }
        t[n++] = x;
    }
    total = n;
    n = total ? 1 : 0;
    for (size_t i = 1; i < total; i++) {
        char x = t[i];
        if (t[i - 1] == ' ' && x == '\'' && i + 1 < total) {
            char x1 = t[i + 1];
            if (x1 == 's' || x1 == 'm')
                n--;
            else if (x1 != 't' && x1 != 'd' && i + 2 < total &&
                     ((x1 == 'r' && t[i + 2] == 'e') || (x1 == 'v' && t[i + 2] == 'e')))
                n--;
        }
        t[n++] = x;
    }
    return n;
}

int st_vocab_detokenize(const st_vocab *v, const uint32_t *ids, size_t n, int remove_special,
                        int unparse_special, char *dst, size_t cap, size_t *n_out)
{
    *n_out = 0;
    if (remove_special && v->add_bos && n && ids[0] == v->bos) {
        ids++;
        n--;
    }
    if (remove_special && v->add_eos && n && ids[n - 1] == v->eos)
        n--;
    size_t total = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] >= v->n_tokens)
            return st_error_set(ST_EINVAL, "detokenize: token %u (at %zu) beyond the "
                                "vocabulary's %u", ids[i], i, v->n_tokens);
        total += piece(v, ids[i], unparse_special, NULL, 0);
    }
    char *t = malloc(total ? total : 1);
    if (!t)
        return st_error_set(ENOMEM, "detokenize: %zu bytes", total);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        k += piece(v, ids[i], unparse_special, t + k, total - k);
    if (v->clean_spaces)
        k = clean_spaces(t, k);
    if (dst)
        memcpy(dst, t, k < cap ? k : cap);
    free(t);
    *n_out = k;
    return 0;
}

/* Bytes at the end of b[0..n) that begin a UTF-8 sequence not yet complete. */
static size_t utf8_incomplete(const uint8_t *b, size_t n)
{
    for (size_t back = 1; back <= 3 && back <= n; back++) {
        uint8_t c = b[n - back];
        if ((c & 0xc0) == 0x80)
            continue; /* a continuation byte: look further back */
        size_t want = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : (c & 0xf8) == 0xf0 ? 4 : 1;
        return want > back ? back : 0;
    }
    return 0;
}

int st_vocab_stream_push(const st_vocab *v, st_vocab_stream *st, uint32_t id, int special,
                         char *dst, size_t cap, size_t *n)
{
    *n = 0;
    if (id >= v->n_tokens)
        return st_error_set(ST_EINVAL, "detokenize: token %u beyond the vocabulary's %u", id,
                            v->n_tokens);
    size_t pl = piece(v, id, special, NULL, 0), all = st->n_held + pl;
    if (all > cap) {
        *n = all;
        return st_error_set(ST_ETOOBIG, "detokenize: token %u needs %zu bytes, %zu given", id,
                            all, cap);
    }
    memcpy(dst, st->held, st->n_held);
    piece(v, id, special, dst + st->n_held, pl);
    size_t keep = utf8_incomplete((const uint8_t *)dst, all);
    memcpy(st->held, dst + all - keep, keep);
    st->n_held = (uint32_t)keep;
    *n = all - keep;
    return 0;
}

size_t st_vocab_stream_flush(st_vocab_stream *st, char *dst, size_t cap)
{
    size_t k = st->n_held;
    if (k > cap)
        return k;
    memcpy(dst, st->held, k);
    st->n_held = 0;
    return k;
}

/* ---- the rest of the API ------------------------------------------------------------------ */

int st_vocab_open(const char *path, st_vocab **out)
{
    st_gguf *g = NULL;
    *out = NULL;
    int rc = st_gguf_open(path, &g);
    if (!rc && (rc = st_vocab_load(g, out))) {
        rc = st_error_wrap(rc, "%s", path);
    }
    st_gguf_close(g);
    return rc;
}

uint32_t st_vocab_n_tokens(const st_vocab *v)
{
    return v->n_tokens;
}

const char *st_vocab_pre_name(const st_vocab *v)
{
    return v->pre_name;
}

st_vocab_pre st_vocab_pre_get(const st_vocab *v)
{
    return v->pre;
}

uint32_t st_vocab_special(const st_vocab *v, st_vocab_id which)
{
    switch (which) {
    case ST_VOCAB_BOS:
        return v->bos;
    case ST_VOCAB_EOS:
        return v->eos;
    case ST_VOCAB_EOT:
        return v->eot;
    case ST_VOCAB_EOM:
        return v->eom;
    case ST_VOCAB_PAD:
        return v->pad;
    }
    return UINT32_MAX;
}

int st_vocab_add_bos(const st_vocab *v)
{
    return v->add_bos;
}

int st_vocab_add_eos(const st_vocab *v)
{
    return v->add_eos;
}

int st_vocab_is_eog(const st_vocab *v, uint32_t id)
{
    return bsearch(&id, v->eog, v->n_eog, sizeof *v->eog, cmp_u32) != NULL;
}

uint32_t st_vocab_n_eog(const st_vocab *v, const uint32_t **ids)
{
    if (ids)
        *ids = v->eog;
    return v->n_eog;
}

unsigned st_vocab_token_attr(const st_vocab *v, uint32_t id)
{
    return id < v->n_tokens ? v->attr[id] : 0;
}

const char *st_vocab_token_text(const st_vocab *v, uint32_t id, size_t *len)
{
    if (id >= v->n_tokens) {
        *len = 0;
        return NULL;
    }
    *len = v->x[id].len;
    return x_text(v, id);
}

uint32_t st_vocab_find(const st_vocab *v, const char *text, size_t len)
{
    uint32_t x = text_find(v, text, len);
    return x < v->n_tokens ? x : UINT32_MAX;
}
