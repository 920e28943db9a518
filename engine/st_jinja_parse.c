/*
 * st_jinja_parse.c - chat templates: preprocessing, lexer and parser (st_engine.h, "chat
 * templates"; the tree in st_jinja_int.h).
 *
 * Invariants:
 * 1. What is accepted, and how text and whitespace come out, follow @huggingface/jinja 0.5.11's
 *    Template: the template's one trailing newline is dropped, then lstrip_blocks
 *    (/^[ \t]*({[#%-])/gm -> $1) and trim_blocks (/([#%-]})\n/g -> $1) are applied to the raw
 *    text, then {% generation %} tags are removed; its lexer and its recursive-descent grammar
 *    are mirrored rule for rule.
 * 2. Every byte of the preprocessed text keeps the offset it had in the source, so errors name
 *    the line and column the author wrote.
 * 3. Nothing is allocated outside the template's arena; nesting is bounded (ST_JINJA_MAX_NEST),
 *    so no input recurses without bound.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine.h"
#include "st_jinja_int.h"

#define ST_JINJA_MAX_SRC (4u << 20)
#define ST_JINJA_MAX_NEST 200

/* ---- arena -------------------------------------------------------------------------------- */
struct st_jblk {
    st_jblk *next;
    size_t size, used;
    max_align_t data[];
};

void *st_jarena_alloc(st_jarena *a, size_t n)
{
    n = (n + sizeof(max_align_t) - 1) / sizeof(max_align_t) * sizeof(max_align_t);
    if (n == 0)
        n = sizeof(max_align_t);
    st_jblk *b = a->head;
    if (!b || b->size - b->used < n) {
        size_t size = n > 60000 ? n : 65536 - sizeof(st_jblk);
        if (a->cap && (a->used + size + sizeof(st_jblk) > a->cap || size > a->cap))
            return NULL;
        b = malloc(sizeof(st_jblk) + size);
        if (!b)
            return NULL;
        b->next = a->head;
        b->size = size;
        b->used = 0;
        a->head = b;
        a->used += size + sizeof(st_jblk);
    }
    void *p = (char *)b->data + b->used;
    b->used += n;
    memset(p, 0, n);
    return p;
}

void st_jarena_free(st_jarena *a)
{
    st_jblk *b = a->head;
    while (b) {
        st_jblk *next = b->next;
        free(b);
        b = next;
    }
    a->head = NULL;
    a->used = 0;
}

/* ---- JavaScript whitespace ---------------------------------------------------------------- */
static int js_space_cp(uint32_t c)
{
    return c == 9 || c == 10 || c == 11 || c == 12 || c == 13 || c == 32 || c == 0xa0 ||
           c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 ||
           c == 0x202f || c == 0x205f || c == 0x3000 || c == 0xfeff;
}

size_t st_jinja_space_at(const char *p, const char *end)
{
    const unsigned char *u = (const unsigned char *)p;
    if (p >= end)
        return 0;
    if (u[0] < 0x80)
        return js_space_cp(u[0]) ? 1 : 0;
    if ((u[0] & 0xe0) == 0xc0 && end - p >= 2 && (u[1] & 0xc0) == 0x80)
        return js_space_cp(((uint32_t)(u[0] & 0x1f) << 6) | (u[1] & 0x3f)) ? 2 : 0;
    if ((u[0] & 0xf0) == 0xe0 && end - p >= 3 && (u[1] & 0xc0) == 0x80 && (u[2] & 0xc0) == 0x80)
        return js_space_cp(((uint32_t)(u[0] & 0x0f) << 12) | ((uint32_t)(u[1] & 0x3f) << 6) |
                           (u[2] & 0x3f))
                   ? 3
                   : 0;
    return 0;
}

size_t st_jinja_space_before(const char *start, const char *p)
{
    for (size_t k = 1; k <= 3 && (size_t)(p - start) >= k; k++)
        if (st_jinja_space_at(p - k, p) == k)
            return k;
    return 0;
}

void st_jinja_linecol(const char *src, size_t len, size_t pos, uint32_t *line, uint32_t *col)
{
    uint32_t l = 1, c = 1;
    for (size_t i = 0; i < pos && i < len; i++) {
        if (src[i] == '\n') {
            l++;
            c = 1;
        } else {
            c++;
        }
    }
    *line = l;
    *col = c;
}

/* ---- preprocessing (invariant 1) ---------------------------------------------------------- */
typedef struct {
    char *s;
    uint32_t *pos; /* source offset of each byte */
    size_t n;
} ptext;

static int is_line_start(const char *s, size_t i)
{
    if (i == 0)
        return 1;
    unsigned char c = (unsigned char)s[i - 1];
    if (c == '\n' || c == '\r')
        return 1;
    /* U+2028 / U+2029 end lines for JavaScript's multiline ^ */
    return i >= 3 && (unsigned char)s[i - 3] == 0xe2 && (unsigned char)s[i - 2] == 0x80 &&
           (c == 0xa8 || c == 0xa9);
}

static int is_js_space(const char *s, size_t n, size_t i)
{
    return st_jinja_space_at(s + i, s + n) > 0;
}

/* One pass: drop bytes where keep[i] == 0. */
static void compact(ptext *t, const unsigned char *keep)
{
    size_t o = 0;
    for (size_t i = 0; i < t->n; i++)
        if (keep[i]) {
            t->s[o] = t->s[i];
            t->pos[o] = t->pos[i];
            o++;
        }
    t->n = o;
    t->s[o] = 0;
}

static int preprocess(const char *src, size_t len, ptext *t)
{
    t->s = malloc(len + 1);
    t->pos = malloc((len + 1) * sizeof(uint32_t));
    unsigned char *keep = malloc(len + 1);
    if (!t->s || !t->pos || !keep) {
        free(keep);
        return ENOMEM;
    }
    memcpy(t->s, src, len);
    for (size_t i = 0; i < len; i++)
        t->pos[i] = (uint32_t)i;
    t->n = len;
    if (t->n && t->s[t->n - 1] == '\n')
        t->n--;
    t->s[t->n] = 0;
    /* lstrip_blocks: spaces and tabs from a line start up to {# {% {- */
    memset(keep, 1, t->n + 1);
    for (size_t i = 0; i < t->n; i++) {
        if (!is_line_start(t->s, i))
            continue;
        size_t j = i;
        while (j < t->n && (t->s[j] == ' ' || t->s[j] == '\t'))
            j++;
        if (j > i && j + 1 < t->n && t->s[j] == '{' &&
            (t->s[j + 1] == '#' || t->s[j + 1] == '%' || t->s[j + 1] == '-'))
            memset(keep + i, 0, j - i);
    }
    compact(t, keep);
    /* trim_blocks: the newline after #} %} -} */
    memset(keep, 1, t->n + 1);
    for (size_t i = 0; i + 2 < t->n; i++) {
        if ((t->s[i] == '#' || t->s[i] == '%' || t->s[i] == '-') && t->s[i + 1] == '}' &&
            t->s[i + 2] == '\n') {
            keep[i + 2] = 0;
            i += 2;
        }
    }
    compact(t, keep);
    /* /(\s*){%(-?)\s*(?:end)?generation\s*(-?)%}(\s*)/gs -> (lstrip ? "" : before) +
     * (rstrip ? "" : after) */
    memset(keep, 1, t->n + 1);
    size_t floor = 0; /* a match never starts inside the previous one */
    for (size_t i = 0; i + 1 < t->n; i++) {
        if (t->s[i] != '{' || t->s[i + 1] != '%')
            continue;
        size_t j = i + 2;
        int lstrip = 0, rstrip = 0;
        if (j < t->n && t->s[j] == '-') {
            lstrip = 1;
            j++;
        }
        while (j < t->n && is_js_space(t->s, t->n, j))
            j += st_jinja_space_at(t->s + j, t->s + t->n);
        if (j + 3 <= t->n && !memcmp(t->s + j, "end", 3) && j + 13 <= t->n &&
            !memcmp(t->s + j + 3, "generation", 10))
            j += 13;
        else if (j + 10 <= t->n && !memcmp(t->s + j, "generation", 10))
            j += 10;
        else
            continue;
        while (j < t->n && is_js_space(t->s, t->n, j))
            j += st_jinja_space_at(t->s + j, t->s + t->n);
        if (j < t->n && t->s[j] == '-') {
            rstrip = 1;
            j++;
        }
        if (j + 2 > t->n || t->s[j] != '%' || t->s[j + 1] != '}')
            continue;
        j += 2;
        size_t b = i;
        size_t sb;
        while (b > floor && (sb = st_jinja_space_before(t->s + floor, t->s + b)) > 0)
            b -= sb;
        size_t e = j;
        while (e < t->n && is_js_space(t->s, t->n, e))
            e += st_jinja_space_at(t->s + e, t->s + t->n);
        if (lstrip)
            memset(keep + b, 0, i - b);
        memset(keep + i, 0, j - i);
        if (rstrip)
            memset(keep + j, 0, e - j);
        floor = e;
        i = e - 1;
    }
    compact(t, keep);
    free(keep);
    return 0;
}

/* ---- lexer -------------------------------------------------------------------------------- */
enum {
    JT_TEXT = 1, JT_NUM, JT_STR, JT_IDENT, JT_EQUALS, JT_LPAREN, JT_RPAREN, JT_OPEN_STMT,
    JT_CLOSE_STMT, JT_OPEN_EXPR, JT_CLOSE_EXPR, JT_LBRACKET, JT_RBRACKET, JT_LBRACE, JT_RBRACE,
    JT_COMMA, JT_DOT, JT_COLON, JT_PIPE, JT_ADD, JT_MUL, JT_POW, JT_CMP, JT_UNARY, JT_COMMENT,
};

typedef struct {
    uint8_t type;
    const char *v; /* in the arena (strings unescaped) or in the preprocessed text */
    size_t n;
    uint32_t pos;  /* source offset */
} jtok;

typedef struct {
    st_jinja *t;
    ptext p;
    jtok *tok;
    size_t ntok, captok;
    size_t cur; /* parser position */
    int depth;
    int rc;
    uint32_t err_pos;
    char err[256];
} jparse;

static int perr(jparse *P, uint32_t pos, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static int perr(jparse *P, uint32_t pos, const char *fmt, ...)
{
    if (P->rc)
        return P->rc;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(P->err, sizeof P->err, fmt, ap);
    va_end(ap);
    P->err_pos = pos;
    P->rc = ST_EINVAL;
    return P->rc;
}

static uint32_t srcpos(jparse *P, size_t i)
{
    if (i < P->p.n)
        return P->p.pos[i];
    return (uint32_t)P->t->src_len;
}

static int push_tok(jparse *P, uint8_t type, const char *v, size_t n, size_t at)
{
    if (P->ntok == P->captok) {
        size_t nc = P->captok ? P->captok * 2 : 256;
        jtok *nt = realloc(P->tok, nc * sizeof *nt);
        if (!nt)
            return P->rc = ENOMEM;
        P->tok = nt;
        P->captok = nc;
    }
    P->tok[P->ntok++] = (jtok){type, v, n, srcpos(P, at)};
    return 0;
}

static int is_digit(char c) { return c >= '0' && c <= '9'; }
static int is_word(char c)
{
    return is_digit(c) || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
}

static void put_utf8(char *d, size_t *o, uint32_t c)
{
    if (c < 0x80) {
        d[(*o)++] = (char)c;
    } else if (c < 0x800) {
        d[(*o)++] = (char)(0xc0 | (c >> 6));
        d[(*o)++] = (char)(0x80 | (c & 0x3f));
    } else if (c < 0x10000) {
        d[(*o)++] = (char)(0xe0 | (c >> 12));
        d[(*o)++] = (char)(0x80 | ((c >> 6) & 0x3f));
        d[(*o)++] = (char)(0x80 | (c & 0x3f));
    } else {
        d[(*o)++] = (char)(0xf0 | (c >> 18));
        d[(*o)++] = (char)(0x80 | ((c >> 12) & 0x3f));
        d[(*o)++] = (char)(0x80 | ((c >> 6) & 0x3f));
        d[(*o)++] = (char)(0x80 | (c & 0x3f));
    }
}

static int hexval(const char *s, size_t n, uint32_t *out)
{
    uint32_t v = 0;
    for (size_t i = 0; i < n; i++) {
        char c = s[i];
        v <<= 4;
        if (is_digit(c))
            v |= (uint32_t)(c - '0');
        else if (c >= 'a' && c <= 'f')
            v |= (uint32_t)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F')
            v |= (uint32_t)(c - 'A' + 10);
        else
            return -1;
    }
    *out = v;
    return 0;
}

/* A string literal from the character after its opening quote: its unescaped value. */
static int lex_string(jparse *P, size_t *cur, char q)
{
    const char *s = P->p.s;
    size_t n = P->p.n, i = *cur, start = *cur - 1;
    char *d = st_jarena_alloc(&P->t->arena, n - i + 1);
    size_t o = 0;
    if (!d)
        return P->rc = ENOMEM;
    for (;;) {
        if (i >= n)
            return perr(P, srcpos(P, start), "unterminated string literal");
        if (s[i] == q)
            break;
        if (s[i] == '\\') {
            i++;
            if (i >= n)
                return perr(P, srcpos(P, i - 1), "unexpected end of input after \\");
            char e = s[i++];
            if (e == 'x' || e == 'u') {
                size_t k = e == 'x' ? 2 : 4;
                uint32_t c;
                if (i + k > n || hexval(s + i, k, &c))
                    return perr(P, srcpos(P, i - 2), "invalid hexadecimal escape sequence");
                i += k;
                if (c >= 0xd800 && c <= 0xdbff && i + 6 <= n && s[i] == '\\' && s[i + 1] == 'u') {
                    uint32_t lo;
                    if (!hexval(s + i + 2, 4, &lo) && lo >= 0xdc00 && lo <= 0xdfff) {
                        c = 0x10000 + ((c - 0xd800) << 10) + (lo - 0xdc00);
                        i += 6;
                    }
                }
                if (c >= 0xd800 && c <= 0xdfff)
                    c = 0xfffd;
                put_utf8(d, &o, c);
                continue;
            }
            char u;
            switch (e) {
            case 'n': u = '\n'; break;
            case 't': u = '\t'; break;
            case 'r': u = '\r'; break;
            case 'b': u = '\b'; break;
            case 'f': u = '\f'; break;
            case 'v': u = '\v'; break;
            case '\'': u = '\''; break;
            case '"': u = '"'; break;
            case '\\': u = '\\'; break;
            default:
                return perr(P, srcpos(P, i - 2), "unexpected escaped character: %c", e);
            }
            d[o++] = u;
            continue;
        }
        d[o++] = s[i++];
        if (i >= n)
            return perr(P, srcpos(P, start), "unterminated string literal");
    }
    *cur = i + 1;
    return push_tok(P, JT_STR, d, o, start);
}

static void strip_trailing_ws(jparse *P)
{
    if (!P->ntok || P->tok[P->ntok - 1].type != JT_TEXT)
        return;
    jtok *t = &P->tok[P->ntok - 1];
    size_t k;
    while (t->n && (k = st_jinja_space_before(t->v, t->v + t->n)) > 0)
        t->n -= k;
    if (!t->n)
        P->ntok--;
}

static void skip_ws(jparse *P, size_t *cur)
{
    size_t k;
    while (*cur < P->p.n && (k = st_jinja_space_at(P->p.s + *cur, P->p.s + P->p.n)) > 0)
        *cur += k;
}

static int lex(jparse *P)
{
    static const struct { const char *seq; uint8_t type; } table[] = {
        {"{%", JT_OPEN_STMT}, {"%}", JT_CLOSE_STMT}, {"{{", JT_OPEN_EXPR}, {"}}", JT_CLOSE_EXPR},
        {"(", JT_LPAREN}, {")", JT_RPAREN}, {"{", JT_LBRACE}, {"}", JT_RBRACE},
        {"[", JT_LBRACKET}, {"]", JT_RBRACKET}, {",", JT_COMMA}, {".", JT_DOT},
        {":", JT_COLON}, {"|", JT_PIPE}, {"<=", JT_CMP}, {">=", JT_CMP}, {"==", JT_CMP},
        {"!=", JT_CMP}, {"<", JT_CMP}, {">", JT_CMP}, {"+", JT_ADD}, {"-", JT_ADD},
        {"~", JT_ADD}, {"**", JT_POW}, {"*", JT_MUL}, {"//", JT_MUL}, {"/", JT_MUL},
        {"%", JT_MUL}, {"=", JT_EQUALS},
    };
    const char *s = P->p.s;
    size_t n = P->p.n, cur = 0;
    int curly = 0;
    while (cur < n && !P->rc) {
        uint8_t last = P->ntok ? P->tok[P->ntok - 1].type : 0;
        if (!last || last == JT_CLOSE_STMT || last == JT_CLOSE_EXPR || last == JT_COMMENT) {
            size_t st = cur;
            while (cur < n &&
                   !(s[cur] == '{' && cur + 1 < n &&
                     (s[cur + 1] == '%' || s[cur + 1] == '{' || s[cur + 1] == '#')))
                cur++;
            if (cur > st) {
                push_tok(P, JT_TEXT, s + st, cur - st, st);
                continue;
            }
        }
        if (s[cur] == '{' && cur + 1 < n && s[cur + 1] == '#') {
            size_t st = cur;
            cur += 2;
            int strip_before = cur < n && s[cur] == '-';
            if (strip_before)
                cur++;
            size_t cs = cur;
            while (cur >= n || s[cur] != '#' || cur + 1 >= n || s[cur + 1] != '}') {
                if (cur + 2 >= n)
                    return perr(P, srcpos(P, st), "missing end of comment tag");
                cur++;
            }
            size_t ce = cur;
            int strip_after = ce > cs && s[ce - 1] == '-';
            if (strip_after)
                ce--;
            if (strip_before)
                strip_trailing_ws(P);
            push_tok(P, JT_COMMENT, s + cs, ce - cs, st);
            cur += 2;
            if (strip_after)
                skip_ws(P, &cur);
            continue;
        }
        if (cur + 3 <= n && !memcmp(s + cur, "{%-", 3)) {
            strip_trailing_ws(P);
            push_tok(P, JT_OPEN_STMT, s + cur, 2, cur);
            cur += 3;
            continue;
        }
        if (cur + 3 <= n && !memcmp(s + cur, "{{-", 3)) {
            strip_trailing_ws(P);
            push_tok(P, JT_OPEN_EXPR, s + cur, 2, cur);
            curly = 0;
            cur += 3;
            continue;
        }
        skip_ws(P, &cur);
        if (cur >= n)
            return perr(P, srcpos(P, cur), "unexpected end of input");
        if (cur + 3 <= n && !memcmp(s + cur, "-%}", 3)) {
            push_tok(P, JT_CLOSE_STMT, s + cur + 1, 2, cur);
            cur += 3;
            skip_ws(P, &cur);
            continue;
        }
        if (cur + 3 <= n && !memcmp(s + cur, "-}}", 3)) {
            push_tok(P, JT_CLOSE_EXPR, s + cur + 1, 2, cur);
            cur += 3;
            skip_ws(P, &cur);
            continue;
        }
        char c = s[cur];
        if (c == '-' || c == '+') {
            uint8_t lt = P->ntok ? P->tok[P->ntok - 1].type : 0;
            if (lt == JT_TEXT || !lt)
                return perr(P, srcpos(P, cur), "unexpected character: %c", c);
            if (lt != JT_IDENT && lt != JT_NUM && lt != JT_STR && lt != JT_RPAREN &&
                lt != JT_RBRACKET) {
                size_t st = cur++;
                while (cur < n && is_digit(s[cur]))
                    cur++;
                if (cur >= n)
                    return perr(P, srcpos(P, cur), "unexpected end of input");
                size_t digits = cur - st - 1;
                if (digits && s[cur] == '.' && cur + 1 < n && is_digit(s[cur + 1])) {
                    cur++;
                    while (cur < n && is_digit(s[cur]))
                        cur++;
                    if (cur >= n)
                        return perr(P, srcpos(P, cur), "unexpected end of input");
                }
                push_tok(P, digits ? JT_NUM : JT_UNARY, s + st, cur - st, st);
                continue;
            }
        }
        int matched = 0;
        for (size_t k = 0; k < sizeof table / sizeof table[0]; k++) {
            size_t L = strlen(table[k].seq);
            if (table[k].type == JT_CLOSE_EXPR && curly > 0)
                continue;
            if (cur + L <= n && !memcmp(s + cur, table[k].seq, L)) {
                push_tok(P, table[k].type, s + cur, L, cur);
                if (table[k].type == JT_OPEN_EXPR)
                    curly = 0;
                else if (table[k].type == JT_LBRACE)
                    curly++;
                else if (table[k].type == JT_RBRACE)
                    curly--;
                cur += L;
                matched = 1;
                break;
            }
        }
        if (matched)
            continue;
        if (c == '\'' || c == '"') {
            cur++;
            if (lex_string(P, &cur, c))
                return P->rc;
            continue;
        }
        if (is_digit(c)) {
            size_t st = cur;
            while (cur < n && is_digit(s[cur]))
                cur++;
            if (cur >= n)
                return perr(P, srcpos(P, cur), "unexpected end of input");
            uint8_t lt = P->ntok ? P->tok[P->ntok - 1].type : 0;
            if (lt != JT_DOT && s[cur] == '.' && cur + 1 < n && is_digit(s[cur + 1])) {
                cur++;
                while (cur < n && is_digit(s[cur]))
                    cur++;
                if (cur >= n)
                    return perr(P, srcpos(P, cur), "unexpected end of input");
            }
            push_tok(P, JT_NUM, s + st, cur - st, st);
            continue;
        }
        if (is_word(c)) {
            size_t st = cur;
            while (cur < n && is_word(s[cur]))
                cur++;
            if (cur >= n)
                return perr(P, srcpos(P, cur), "unexpected end of input");
            push_tok(P, JT_IDENT, s + st, cur - st, st);
            continue;
        }
        return perr(P, srcpos(P, cur), "unexpected character: %c", c);
    }
    return P->rc;
}

/* ---- parser ------------------------------------------------------------------------------- */
typedef struct {
    st_jnode **v;
    uint32_t n, cap;
} nlist;

static st_jnode *node(jparse *P, uint8_t kind, uint32_t pos)
{
    st_jnode *x = st_jarena_alloc(&P->t->arena, sizeof *x);
    if (!x) {
        P->rc = ENOMEM;
        return NULL;
    }
    x->kind = kind;
    x->pos = pos;
    return x;
}

static int nl_push(jparse *P, nlist *l, st_jnode *x)
{
    if (!x)
        return P->rc ? P->rc : (P->rc = ENOMEM);
    if (l->n == l->cap) {
        uint32_t nc = l->cap ? l->cap * 2 : 4;
        st_jnode **nv = st_jarena_alloc(&P->t->arena, nc * sizeof *nv);
        if (!nv)
            return P->rc = ENOMEM;
        if (l->n)
            memcpy(nv, l->v, l->n * sizeof *nv);
        l->v = nv;
        l->cap = nc;
    }
    l->v[l->n++] = x;
    return 0;
}

static const jtok *peek(jparse *P, size_t k)
{
    return P->cur + k < P->ntok ? &P->tok[P->cur + k] : NULL;
}

static uint32_t here(jparse *P)
{
    const jtok *t = peek(P, 0);
    return t ? t->pos : (uint32_t)P->t->src_len;
}

static int is_type(jparse *P, uint8_t type)
{
    const jtok *t = peek(P, 0);
    return t && t->type == type;
}

static int is_ident(jparse *P, size_t k, const char *name)
{
    const jtok *t = peek(P, k);
    return t && t->type == JT_IDENT && t->n == strlen(name) && !memcmp(t->v, name, t->n);
}

static int is_stmt(jparse *P, const char *a, const char *b, const char *c)
{
    const jtok *t = peek(P, 0);
    if (!t || t->type != JT_OPEN_STMT)
        return 0;
    return is_ident(P, 1, a) || (b && is_ident(P, 1, b)) || (c && is_ident(P, 1, c));
}

static const char *tok_name(uint8_t type)
{
    static const char *names[] = {
        "?", "text", "number", "string", "identifier", "'='", "'('", "')'", "'{%'", "'%}'",
        "'{{'", "'}}'", "'['", "']'", "'{'", "'}'", "','", "'.'", "':'", "'|'", "operator",
        "operator", "'**'", "comparison", "sign", "comment",
    };
    return type < sizeof names / sizeof names[0] ? names[type] : "?";
}

static int expect(jparse *P, uint8_t type, const char *what)
{
    const jtok *t = peek(P, 0);
    if (!t)
        return perr(P, here(P), "expected %s, got the end of the template", what);
    if (t->type != type)
        return perr(P, t->pos, "expected %s, got %s", what, tok_name(t->type));
    P->cur++;
    return 0;
}

static int expect_ident(jparse *P, const char *name)
{
    if (!is_ident(P, 0, name))
        return perr(P, here(P), "expected %s", name);
    P->cur++;
    return 0;
}

static st_jnode *parse_any(jparse *P);
static st_jnode *parse_expr(jparse *P);
static st_jnode *parse_primary(jparse *P);

static int enter(jparse *P)
{
    if (++P->depth > ST_JINJA_MAX_NEST)
        return perr(P, here(P), "nested deeper than %d", ST_JINJA_MAX_NEST);
    return 0;
}

/* Statements until one of the names (not consumed); the end of the template is an error. */
static int parse_body(jparse *P, nlist *l, const char *a, const char *b, const char *c,
                      const char *closer)
{
    while (!P->rc && !is_stmt(P, a, b, c)) {
        if (!peek(P, 0))
            return perr(P, here(P), "missing {%% %s %%}", closer);
        nl_push(P, l, parse_any(P));
    }
    return P->rc;
}

static void set_list(st_jnode *x, nlist *l) { x->list = l->v, x->nlist = l->n; }
static void set_list2(st_jnode *x, nlist *l) { x->list2 = l->v, x->nlist2 = l->n; }

static st_jnode *parse_seq(jparse *P, int primary)
{
    uint32_t pos = here(P);
    st_jnode *first = primary ? parse_primary(P) : parse_expr(P);
    if (!first || !is_type(P, JT_COMMA))
        return first;
    nlist l = {0};
    nl_push(P, &l, first);
    while (!P->rc) {
        P->cur++;
        nl_push(P, &l, primary ? parse_primary(P) : parse_expr(P));
        if (!is_type(P, JT_COMMA))
            break;
    }
    if (P->rc)
        return NULL;
    st_jnode *t = node(P, JN_TUPLE, pos);
    if (t)
        set_list(t, &l);
    return t;
}

/* mode 0: parameters, 1: call arguments */
static int parse_args(jparse *P, nlist *l, int call)
{
    if (expect(P, JT_LPAREN, "'(' opening the arguments"))
        return P->rc;
    int saw_kw = 0, saw_spread = 0;
    while (!P->rc && !is_type(P, JT_RPAREN)) {
        if (!peek(P, 0))
            return perr(P, here(P), "expected ')' closing the arguments");
        const jtok *t = peek(P, 0);
        int kwspread = t->type == JT_POW;
        int spread = t->type == JT_MUL && t->n == 1 && t->v[0] == '*';
        if (!call && (kwspread || spread))
            return perr(P, t->pos, "argument unpacking is not allowed in parameter declarations");
        if (kwspread) {
            P->cur++;
            st_jnode *x = node(P, JN_KWSPREAD, t->pos);
            if (x)
                x->a = parse_expr(P);
            nl_push(P, l, x);
            if (is_type(P, JT_COMMA))
                P->cur++;
            if (!is_type(P, JT_RPAREN))
                return perr(P, here(P), "`**` must be applied to the final argument");
            break;
        }
        st_jnode *arg;
        if (spread) {
            if (saw_spread)
                return perr(P, t->pos, "only one `*` argument unpacking is allowed");
            saw_spread = 1;
            P->cur++;
            arg = node(P, JN_SPREAD, t->pos);
            if (arg)
                arg->a = parse_expr(P);
        } else {
            arg = parse_expr(P);
            if (P->rc)
                return P->rc;
            if (is_type(P, JT_EQUALS)) {
                P->cur++;
                if (arg->kind != JN_IDENT)
                    return perr(P, arg->pos, "expected an identifier for a keyword argument");
                st_jnode *kw = node(P, JN_KWARG, arg->pos);
                if (!kw)
                    return P->rc;
                kw->s = arg->s;
                kw->n = arg->n;
                kw->a = parse_expr(P);
                arg = kw;
            }
            if (P->rc)
                return P->rc;
            if (!call) {
                if (arg->kind != JN_IDENT && arg->kind != JN_KWARG)
                    return perr(P, arg->pos, "expected an identifier for a parameter");
                for (uint32_t k = 0; k < l->n; k++)
                    if (l->v[k]->n == arg->n && !memcmp(l->v[k]->s, arg->s, arg->n))
                        return perr(P, arg->pos, "duplicate parameter name: %.*s",
                                    (int)arg->n, arg->s);
            }
            if (arg->kind == JN_KWARG)
                saw_kw = 1;
            else if (saw_kw)
                return perr(P, arg->pos, call ? "positional argument after keyword arguments"
                                              : "non-default parameter after a default one");
            else if (saw_spread)
                return perr(P, arg->pos, "positional argument after `*` unpacking");
        }
        nl_push(P, l, arg);
        if (is_type(P, JT_COMMA))
            P->cur++;
    }
    if (P->rc)
        return P->rc;
    return expect(P, JT_RPAREN, "')' closing the arguments");
}

static st_jnode *parse_call(jparse *P, st_jnode *callee);

static st_jnode *parse_member(jparse *P, st_jnode *obj)
{
    while (obj && !P->rc && (is_type(P, JT_DOT) || is_type(P, JT_LBRACKET))) {
        const jtok *op = peek(P, 0);
        P->cur++;
        st_jnode *m = node(P, JN_MEMBER, op->pos);
        if (!m)
            return NULL;
        m->a = obj;
        if (op->type == JT_LBRACKET) {
            m->flag = 1;
            st_jnode *parts[4] = {0};
            int np = 0, is_slice = 0;
            while (!P->rc && !is_type(P, JT_RBRACKET)) {
                if (!peek(P, 0)) {
                    perr(P, here(P), "expected ']'");
                    return NULL;
                }
                if (np >= 3) {
                    perr(P, here(P), "a slice has at most 3 parts");
                    return NULL;
                }
                if (is_type(P, JT_COLON)) {
                    parts[np++] = NULL;
                    P->cur++;
                    is_slice = 1;
                } else {
                    parts[np++] = parse_expr(P);
                    if (is_type(P, JT_COLON)) {
                        P->cur++;
                        is_slice = 1;
                    }
                }
            }
            if (P->rc)
                return NULL;
            if (np == 0) {
                perr(P, here(P), "expected at least one argument for a member or slice");
                return NULL;
            }
            if (is_slice) {
                st_jnode *sl = node(P, JN_SLICE, op->pos);
                if (!sl)
                    return NULL;
                sl->a = parts[0];
                sl->b = parts[1];
                sl->c = parts[2];
                m->b = sl;
            } else {
                m->b = parts[0];
            }
            if (expect(P, JT_RBRACKET, "']'"))
                return NULL;
        } else {
            m->b = parse_primary(P);
            if (!m->b)
                return NULL;
            if (m->b->kind != JN_IDENT && m->b->kind != JN_INT) {
                perr(P, m->b->pos, "expected an identifier or an integer after '.'");
                return NULL;
            }
        }
        obj = m;
    }
    return P->rc ? NULL : obj;
}

static st_jnode *parse_call(jparse *P, st_jnode *callee)
{
    if (enter(P))
        return NULL;
    st_jnode *c = node(P, JN_CALL, here(P));
    nlist l = {0};
    if (!c || parse_args(P, &l, 1))
        return NULL;
    c->a = callee;
    set_list(c, &l);
    st_jnode *x = parse_member(P, c);
    if (x && is_type(P, JT_LPAREN))
        x = parse_call(P, x);
    P->depth--;
    return x;
}

static st_jnode *parse_call_member(jparse *P)
{
    st_jnode *m = parse_member(P, parse_primary(P));
    if (m && is_type(P, JT_LPAREN))
        return parse_call(P, m);
    return m;
}

static st_jnode *parse_unary_sign(jparse *P)
{
    const jtok *t = peek(P, 0);
    if (t && (t->type == JT_UNARY || t->type == JT_ADD) && t->n == 1 &&
        (t->v[0] == '-' || t->v[0] == '+')) {
        P->cur++;
        if (enter(P))
            return NULL;
        st_jnode *u = node(P, JN_UNARY, t->pos);
        if (!u)
            return NULL;
        u->op = t->v[0] == '-' ? JOP_SUB : JOP_ADD;
        u->a = parse_unary_sign(P);
        P->depth--;
        return u->a ? u : NULL;
    }
    return parse_call_member(P);
}

static st_jnode *parse_filter(jparse *P)
{
    st_jnode *x = parse_unary_sign(P);
    while (x && !P->rc && is_type(P, JT_PIPE)) {
        uint32_t pos = here(P);
        P->cur++;
        st_jnode *f = parse_primary(P);
        if (!f)
            return NULL;
        if (f->kind != JN_IDENT) {
            perr(P, f->pos, "expected an identifier for the filter");
            return NULL;
        }
        if (is_type(P, JT_LPAREN))
            f = parse_call(P, f);
        st_jnode *fx = node(P, JN_FILTER, pos);
        if (!fx || !f)
            return NULL;
        fx->a = x;
        fx->b = f;
        x = fx;
    }
    return P->rc ? NULL : x;
}

static st_jnode *parse_test(jparse *P)
{
    st_jnode *x = parse_filter(P);
    while (x && !P->rc && is_ident(P, 0, "is")) {
        uint32_t pos = here(P);
        P->cur++;
        int neg = is_ident(P, 0, "not");
        if (neg)
            P->cur++;
        st_jnode *t = parse_primary(P);
        if (!t)
            return NULL;
        if (t->kind != JN_IDENT) {
            perr(P, t->pos, "expected an identifier for the test");
            return NULL;
        }
        st_jnode *tx = node(P, JN_TEST, pos);
        if (!tx)
            return NULL;
        tx->a = x;
        tx->s = t->s;
        tx->n = t->n;
        tx->flag = (uint8_t)neg;
        x = tx;
    }
    return P->rc ? NULL : x;
}

static st_jnode *binary(jparse *P, uint8_t op, uint32_t pos, st_jnode *a, st_jnode *b)
{
    if (!a || !b)
        return NULL;
    st_jnode *x = node(P, JN_BINARY, pos);
    if (!x)
        return NULL;
    x->op = op;
    x->a = a;
    x->b = b;
    return x;
}

static uint8_t op_of(const jtok *t)
{
    static const struct { const char *s; uint8_t op; } ops[] = {
        {"+", JOP_ADD}, {"-", JOP_SUB}, {"~", JOP_CONCAT}, {"*", JOP_MUL}, {"/", JOP_DIV},
        {"//", JOP_FLOORDIV}, {"%", JOP_MOD}, {"**", JOP_POW}, {"==", JOP_EQ}, {"!=", JOP_NE},
        {"<", JOP_LT}, {">", JOP_GT}, {"<=", JOP_LE}, {">=", JOP_GE},
    };
    for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++)
        if (strlen(ops[k].s) == t->n && !memcmp(ops[k].s, t->v, t->n))
            return ops[k].op;
    return 0;
}

static st_jnode *parse_power(jparse *P)
{
    st_jnode *x = parse_test(P);
    while (x && is_type(P, JT_POW)) {
        const jtok *t = &P->tok[P->cur++];
        x = binary(P, JOP_POW, t->pos, x, parse_test(P));
    }
    return x;
}

static st_jnode *parse_mul(jparse *P)
{
    st_jnode *x = parse_power(P);
    while (x && is_type(P, JT_MUL)) {
        const jtok *t = &P->tok[P->cur++];
        x = binary(P, op_of(t), t->pos, x, parse_power(P));
    }
    return x;
}

static st_jnode *parse_add(jparse *P)
{
    st_jnode *x = parse_mul(P);
    while (x && is_type(P, JT_ADD)) {
        const jtok *t = &P->tok[P->cur++];
        x = binary(P, op_of(t), t->pos, x, parse_mul(P));
    }
    return x;
}

static st_jnode *parse_cmp(jparse *P)
{
    st_jnode *x = parse_add(P);
    while (x && !P->rc) {
        uint8_t op;
        uint32_t pos = here(P);
        if (is_ident(P, 0, "not") && is_ident(P, 1, "in")) {
            op = JOP_NOTIN;
            P->cur += 2;
        } else if (is_ident(P, 0, "in")) {
            op = JOP_IN;
            P->cur++;
        } else if (is_type(P, JT_CMP)) {
            op = op_of(&P->tok[P->cur++]);
        } else {
            break;
        }
        x = binary(P, op, pos, x, parse_add(P));
    }
    return x;
}

static st_jnode *parse_not(jparse *P)
{
    if (is_ident(P, 0, "not")) {
        uint32_t pos = here(P);
        P->cur++;
        if (enter(P))
            return NULL;
        st_jnode *u = node(P, JN_UNARY, pos);
        if (!u)
            return NULL;
        u->op = JOP_NOT;
        u->a = parse_not(P);
        P->depth--;
        return u->a ? u : NULL;
    }
    return parse_cmp(P);
}

static st_jnode *parse_and(jparse *P)
{
    st_jnode *x = parse_not(P);
    while (x && is_ident(P, 0, "and")) {
        uint32_t pos = here(P);
        P->cur++;
        x = binary(P, JOP_AND, pos, x, parse_not(P));
    }
    return x;
}

static st_jnode *parse_or(jparse *P)
{
    st_jnode *x = parse_and(P);
    while (x && is_ident(P, 0, "or")) {
        uint32_t pos = here(P);
        P->cur++;
        x = binary(P, JOP_OR, pos, x, parse_and(P));
    }
    return x;
}

static st_jnode *parse_if_expr(jparse *P)
{
    st_jnode *a = parse_or(P);
    if (a && is_ident(P, 0, "if")) {
        uint32_t pos = here(P);
        P->cur++;
        st_jnode *test = parse_or(P);
        if (!test)
            return NULL;
        if (is_ident(P, 0, "else")) {
            P->cur++;
            st_jnode *t = node(P, JN_TERNARY, pos);
            if (!t)
                return NULL;
            t->a = test;
            t->b = a;
            t->c = parse_if_expr(P);
            return t->c ? t : NULL;
        }
        st_jnode *s = node(P, JN_SELECT, pos);
        if (!s)
            return NULL;
        s->a = a;
        s->b = test;
        return s;
    }
    return a;
}

static st_jnode *parse_expr(jparse *P)
{
    if (enter(P))
        return NULL;
    st_jnode *x = parse_if_expr(P);
    P->depth--;
    return P->rc ? NULL : x;
}

static st_jnode *parse_primary(jparse *P)
{
    const jtok *t = peek(P, 0);
    if (!t) {
        perr(P, here(P), "unexpected end of the template in an expression");
        return NULL;
    }
    P->cur++;
    switch (t->type) {
    case JT_NUM: {
        int is_float = memchr(t->v, '.', t->n) != NULL;
        char buf[64];
        st_jnode *x = node(P, is_float ? JN_FLOAT : JN_INT, t->pos);
        if (!x)
            return NULL;
        size_t k = t->n < sizeof buf - 1 ? t->n : sizeof buf - 1;
        memcpy(buf, t->v, k);
        buf[k] = 0;
        double d = strtod(buf, NULL);
        x->f = d;
        if (!is_float) {
            if (d > 9007199254740992.0 || d < -9007199254740992.0) {
                perr(P, t->pos, "integer literal beyond 2^53: %s", buf);
                return NULL;
            }
            x->i = (int64_t)d;
        }
        return x;
    }
    case JT_STR: {
        size_t total = t->n;
        size_t k = P->cur;
        while (k < P->ntok && P->tok[k].type == JT_STR)
            total += P->tok[k++].n;
        st_jnode *x = node(P, JN_STR, t->pos);
        char *d = st_jarena_alloc(&P->t->arena, total + 1);
        if (!x || !d) {
            P->rc = ENOMEM;
            return NULL;
        }
        size_t o = t->n;
        memcpy(d, t->v, t->n);
        while (P->cur < k) {
            memcpy(d + o, P->tok[P->cur].v, P->tok[P->cur].n);
            o += P->tok[P->cur++].n;
        }
        x->s = d;
        x->n = total;
        return x;
    }
    case JT_IDENT: {
        st_jnode *x = node(P, JN_IDENT, t->pos);
        if (x) {
            x->s = t->v;
            x->n = t->n;
        }
        return x;
    }
    case JT_LPAREN: {
        st_jnode *x = parse_seq(P, 0);
        if (!x || expect(P, JT_RPAREN, "')'"))
            return NULL;
        return x;
    }
    case JT_LBRACKET: {
        nlist l = {0};
        while (!P->rc && !is_type(P, JT_RBRACKET)) {
            if (!peek(P, 0)) {
                perr(P, here(P), "expected ']' closing the list");
                return NULL;
            }
            nl_push(P, &l, parse_expr(P));
            if (is_type(P, JT_COMMA))
                P->cur++;
        }
        if (P->rc)
            return NULL;
        P->cur++;
        st_jnode *x = node(P, JN_ARRAY, t->pos);
        if (x)
            set_list(x, &l);
        return x;
    }
    case JT_LBRACE: {
        nlist l = {0};
        while (!P->rc && !is_type(P, JT_RBRACE)) {
            if (!peek(P, 0)) {
                perr(P, here(P), "expected '}' closing the mapping");
                return NULL;
            }
            nl_push(P, &l, parse_expr(P));
            if (P->rc || expect(P, JT_COLON, "':' between a key and its value"))
                return NULL;
            nl_push(P, &l, parse_expr(P));
            if (is_type(P, JT_COMMA))
                P->cur++;
        }
        if (P->rc)
            return NULL;
        P->cur++;
        st_jnode *x = node(P, JN_OBJECT, t->pos);
        if (x)
            set_list(x, &l);
        return x;
    }
    default:
        perr(P, t->pos, "unexpected %s", tok_name(t->type));
        return NULL;
    }
}

static st_jnode *parse_if_stmt(jparse *P, uint32_t pos)
{
    st_jnode *x = node(P, JN_IF, pos);
    if (!x || enter(P))
        return NULL;
    x->a = parse_expr(P);
    if (!x->a || expect(P, JT_CLOSE_STMT, "'%}'"))
        return NULL;
    nlist body = {0}, alt = {0};
    if (parse_body(P, &body, "elif", "else", "endif", "endif"))
        return NULL;
    if (is_stmt(P, "elif", NULL, NULL)) {
        uint32_t p2 = here(P);
        P->cur += 2;
        nl_push(P, &alt, parse_if_stmt(P, p2));
    } else if (is_stmt(P, "else", NULL, NULL)) {
        P->cur += 2;
        if (expect(P, JT_CLOSE_STMT, "'%}'") || parse_body(P, &alt, "endif", NULL, NULL, "endif"))
            return NULL;
    }
    if (P->rc)
        return NULL;
    set_list(x, &body);
    set_list2(x, &alt);
    P->depth--;
    return x;
}

static int end_stmt(jparse *P, const char *name)
{
    if (expect(P, JT_OPEN_STMT, "'{%'") || expect_ident(P, name) ||
        expect(P, JT_CLOSE_STMT, "'%}'"))
        return P->rc;
    return 0;
}

static st_jnode *parse_stmt(jparse *P)
{
    uint32_t pos = here(P);
    if (expect(P, JT_OPEN_STMT, "'{%'"))
        return NULL;
    const jtok *t = peek(P, 0);
    if (!t || t->type != JT_IDENT) {
        perr(P, t ? t->pos : here(P), "expected a statement name");
        return NULL;
    }
    if (enter(P))
        return NULL;
    st_jnode *x = NULL;
    if (is_ident(P, 0, "set")) {
        P->cur++;
        x = node(P, JN_SET, pos);
        if (!x)
            return NULL;
        x->a = parse_seq(P, 0);
        if (!x->a)
            return NULL;
        if (is_type(P, JT_EQUALS)) {
            P->cur++;
            x->b = parse_seq(P, 0);
            if (!x->b)
                return NULL;
        } else {
            nlist body = {0};
            if (expect(P, JT_CLOSE_STMT, "'%}'") ||
                parse_body(P, &body, "endset", NULL, NULL, "endset") ||
                expect(P, JT_OPEN_STMT, "'{%'") || expect_ident(P, "endset"))
                return NULL;
            set_list(x, &body);
        }
        if (expect(P, JT_CLOSE_STMT, "'%}'"))
            return NULL;
    } else if (is_ident(P, 0, "if")) {
        P->cur++;
        x = parse_if_stmt(P, pos);
        if (!x || end_stmt(P, "endif"))
            return NULL;
    } else if (is_ident(P, 0, "macro")) {
        P->cur++;
        x = node(P, JN_MACRO, pos);
        if (!x)
            return NULL;
        st_jnode *name = parse_primary(P);
        if (!name)
            return NULL;
        if (name->kind != JN_IDENT) {
            perr(P, name->pos, "expected an identifier after macro");
            return NULL;
        }
        x->s = name->s;
        x->n = name->n;
        nlist params = {0}, body = {0};
        if (parse_args(P, &params, 0) || expect(P, JT_CLOSE_STMT, "'%}'") ||
            parse_body(P, &body, "endmacro", NULL, NULL, "endmacro") || end_stmt(P, "endmacro"))
            return NULL;
        set_list(x, &body);
        set_list2(x, &params);
    } else if (is_ident(P, 0, "for")) {
        P->cur++;
        x = node(P, JN_FOR, pos);
        if (!x)
            return NULL;
        x->a = parse_seq(P, 1);
        if (!x->a)
            return NULL;
        if (x->a->kind != JN_IDENT && x->a->kind != JN_TUPLE) {
            perr(P, x->a->pos, "expected an identifier or a tuple for the loop variable");
            return NULL;
        }
        if (!is_ident(P, 0, "in")) {
            perr(P, here(P), "expected `in` after the loop variable");
            return NULL;
        }
        P->cur++;
        x->b = parse_expr(P);
        nlist body = {0}, alt = {0};
        if (!x->b || expect(P, JT_CLOSE_STMT, "'%}'") ||
            parse_body(P, &body, "endfor", "else", NULL, "endfor"))
            return NULL;
        if (is_stmt(P, "else", NULL, NULL)) {
            P->cur += 2;
            if (expect(P, JT_CLOSE_STMT, "'%}'") ||
                parse_body(P, &alt, "endfor", NULL, NULL, "endfor"))
                return NULL;
        }
        if (end_stmt(P, "endfor"))
            return NULL;
        set_list(x, &body);
        set_list2(x, &alt);
    } else if (is_ident(P, 0, "call")) {
        P->cur++;
        x = node(P, JN_CALLBLK, pos);
        if (!x)
            return NULL;
        nlist params = {0}, body = {0}, args = {0};
        if (is_type(P, JT_LPAREN) && parse_args(P, &params, 0))
            return NULL;
        st_jnode *callee = parse_primary(P);
        if (!callee)
            return NULL;
        if (callee->kind != JN_IDENT) {
            perr(P, callee->pos, "expected an identifier after call");
            return NULL;
        }
        st_jnode *c = node(P, JN_CALL, callee->pos);
        if (!c || parse_args(P, &args, 1) || expect(P, JT_CLOSE_STMT, "'%}'") ||
            parse_body(P, &body, "endcall", NULL, NULL, "endcall") || end_stmt(P, "endcall"))
            return NULL;
        c->a = callee;
        set_list(c, &args);
        x->a = c;
        set_list(x, &body);
        set_list2(x, &params);
    } else if (is_ident(P, 0, "break") || is_ident(P, 0, "continue")) {
        x = node(P, is_ident(P, 0, "break") ? JN_BREAK : JN_CONTINUE, pos);
        P->cur++;
        if (!x || expect(P, JT_CLOSE_STMT, "'%}'"))
            return NULL;
    } else if (is_ident(P, 0, "filter")) {
        P->cur++;
        x = node(P, JN_FILTERBLK, pos);
        if (!x)
            return NULL;
        st_jnode *f = parse_primary(P);
        if (f && f->kind == JN_IDENT && is_type(P, JT_LPAREN))
            f = parse_call(P, f);
        nlist body = {0};
        if (!f || expect(P, JT_CLOSE_STMT, "'%}'") ||
            parse_body(P, &body, "endfilter", NULL, NULL, "endfilter") ||
            end_stmt(P, "endfilter"))
            return NULL;
        x->b = f;
        set_list(x, &body);
    } else {
        perr(P, t->pos, "unknown statement %.*s", (int)t->n, t->v);
        return NULL;
    }
    P->depth--;
    return x;
}

static st_jnode *parse_any(jparse *P)
{
    const jtok *t = peek(P, 0);
    switch (t->type) {
    case JT_COMMENT: {
        P->cur++;
        return node(P, JN_COMMENT, t->pos);
    }
    case JT_TEXT: {
        P->cur++;
        st_jnode *x = node(P, JN_STR, t->pos);
        if (x) {
            x->s = t->v;
            x->n = t->n;
        }
        return x;
    }
    case JT_OPEN_STMT:
        return parse_stmt(P);
    case JT_OPEN_EXPR: {
        P->cur++;
        st_jnode *x = parse_expr(P);
        if (!x || expect(P, JT_CLOSE_EXPR, "'}}'"))
            return NULL;
        return x;
    }
    default:
        perr(P, t->pos, "unexpected %s", tok_name(t->type));
        return NULL;
    }
}

void st_jinja_free(st_jinja *t)
{
    if (!t)
        return;
    st_jarena a = t->arena;
    free(t->src);
    free(t->pre);
    st_jarena_free(&a);
}

int st_jinja_parse(const char *src, size_t len, st_jinja **out, uint32_t *line, uint32_t *col)
{
    *out = NULL;
    if (line)
        *line = 0;
    if (col)
        *col = 0;
    if (len > ST_JINJA_MAX_SRC)
        return st_error_set(ST_ETOOBIG, "chat template of %zu bytes: the limit is %u", len,
                            ST_JINJA_MAX_SRC);
    st_jarena a = {0};
    st_jinja *t = st_jarena_alloc(&a, sizeof *t);
    if (!t)
        return st_error_set(ENOMEM, "chat template: out of memory");
    t->arena = a;
    t->src = malloc(len + 1);
    jparse P = {.t = t};
    if (!t->src) {
        st_jinja_free(t);
        return st_error_set(ENOMEM, "chat template: out of memory");
    }
    memcpy(t->src, src, len);
    t->src[len] = 0;
    t->src_len = len;
    int rc = preprocess(t->src, len, &P.p);
    if (!rc)
        rc = lex(&P);
    nlist body = {0};
    while (!rc && P.cur < P.ntok) {
        nl_push(&P, &body, parse_any(&P));
        rc = P.rc;
    }
    if (!rc) {
        t->body = body.v;
        t->nbody = body.n;
    }
    if (rc == ST_EINVAL) {
        uint32_t l, c;
        st_jinja_linecol(t->src, len, P.err_pos, &l, &c);
        if (line)
            *line = l;
        if (col)
            *col = c;
        st_error_set(rc, "line %u, column %u: %s", l, c, P.err);
    } else if (rc) {
        st_error_set(rc, "chat template: out of memory");
    }
    free(P.tok);
    free(P.p.pos);
    if (rc) {
        free(P.p.s);
        st_jinja_free(t);
        return rc;
    }
    t->pre = P.p.s; /* text and identifier nodes point into it */
    *out = t;
    return 0;
}
