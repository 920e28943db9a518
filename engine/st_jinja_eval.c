/*
 * st_jinja_eval.c - chat templates: values and the evaluator (st_engine.h, "chat templates").
 *
 * Invariants:
 * 1. Semantics are @huggingface/jinja 0.5.11's, quirk for quirk where a chat template can see
 *    them: its printing (none prints nothing in a block, 1.0 prints "1.0", but "1" in tojson
 *    and in + / ~), its loose == and strict `in`, its tests (a mapping is not iterable), its
 *    filters by operand type, its dynamic scoping of macros, a loop body's scope shared by its
 *    iterations, a break or continue discarding what its iteration printed.
 * 2. Every value of a render lives in the render's arena, whose size is capped
 *    (max_memory); strings are capped at max_output bytes, loop iterations at max_iterations,
 *    macro nesting at max_depth; each excess is ST_ETOOBIG naming the bound.
 * 3. Errors leave through R->rc (with the message in R->err); break and continue travel the same
 *    way as JRC_BREAK / JRC_CONTINUE until the loop that owns them.
 */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_engine.h"
#include "st_jinja_int.h"

#define JRC_BREAK 100001
#define JRC_CONTINUE 100002
#define JSON_MAX_DEPTH 512

enum {
    V_UNDEF, V_NULL, V_BOOL, V_INT, V_FLOAT, V_STR, V_ARRAY, V_TUPLE, V_OBJECT, V_KWARGS,
    V_NS, V_FUNC,
};
static const char *const type_names[] = {
    "UndefinedValue", "NullValue", "BooleanValue", "IntegerValue", "FloatValue", "StringValue",
    "ArrayValue", "TupleValue", "ObjectValue", "KeywordArgumentsValue", "NamespaceValue",
    "FunctionValue",
};

typedef struct jv jv;
typedef struct jmap {
    const char **k;
    size_t *kn;
    jv **v;
    uint32_t n, cap;
    uint32_t *h; /* open addressing, index + 1; NULL while small */
    uint32_t hcap;
} jmap;

enum { FN_MACRO, FN_CALLER, FN_METHOD, FN_NAMESPACE, FN_RAISE, FN_RANGE, FN_STRFTIME };

typedef struct jenv jenv;
typedef struct jfn {
    int kind;
    const st_jnode *node; /* macro or call block */
    jenv *env;            /* the call block's defining scope */
    jv *self;             /* a method's object */
    const char *name;     /* a method's name */
    int uses_kwargs, uses_varargs;
} jfn;

struct jv {
    uint8_t t;
    union {
        int b;
        int64_t i;
        double f;
        struct {
            const char *s;
            size_t n;
        } s;
        struct {
            jv **v;
            uint32_t n;
        } a;
        jmap *m;
        jfn *fn;
    } u;
};

struct jenv {
    jenv *parent;
    jmap vars;
};

typedef struct {
    char *p;
    size_t n, cap;
} jbuf;

typedef struct {
    st_jarena arena;
    const st_jinja *t;
    st_jinja_limits lim;
    uint64_t iters;
    uint32_t depth;
    int rc;
    char err[400];
} R;

static jv V_UNDEF_ = {V_UNDEF, {0}}, V_NULL_ = {V_NULL, {0}}, V_TRUE_ = {V_BOOL, {.b = 1}},
          V_FALSE_ = {V_BOOL, {.b = 0}};
#define UNDEF (&V_UNDEF_)
#define NUL (&V_NULL_)
#define BOOL(x) ((x) ? &V_TRUE_ : &V_FALSE_)

/* ---- errors ------------------------------------------------------------------------------- */
static jv *fail(R *r, const st_jnode *at, int rc, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static jv *fail(R *r, const st_jnode *at, int rc, const char *fmt, ...)
{
    if (r->rc)
        return NULL;
    char msg[300];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (at) {
        uint32_t l, c;
        st_jinja_linecol(r->t->src, r->t->src_len, at->pos, &l, &c);
        snprintf(r->err, sizeof r->err, "line %u, column %u: %s", l, c, msg);
    } else {
        snprintf(r->err, sizeof r->err, "%s", msg);
    }
    r->rc = rc;
    return NULL;
}

static jv *oom(R *r)
{
    return fail(r, NULL, ST_ETOOBIG, "the render needs more than %zu bytes of memory (max_memory)",
                r->lim.max_memory);
}

static void *ralloc(R *r, size_t n)
{
    void *p = st_jarena_alloc(&r->arena, n);
    if (!p)
        oom(r);
    return p;
}

/* ---- buffers ------------------------------------------------------------------------------ */
static int buf_add(R *r, jbuf *b, const char *s, size_t n)
{
    if (r->rc)
        return r->rc;
    if (b->n + n > r->lim.max_output) {
        fail(r, NULL, ST_ETOOBIG, "output beyond %zu bytes (max_output)", r->lim.max_output);
        return r->rc;
    }
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 256;
        while (nc < b->n + n + 1)
            nc *= 2;
        char *np = realloc(b->p, nc);
        if (!np) {
            oom(r);
            return r->rc;
        }
        b->p = np;
        b->cap = nc;
    }
    if (n)
        memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
    return 0;
}

static int buf_str(R *r, jbuf *b, const char *s) { return buf_add(r, b, s, strlen(s)); }

/* ---- values ------------------------------------------------------------------------------- */
static jv *mk(R *r, uint8_t t)
{
    jv *v = ralloc(r, sizeof *v);
    if (v)
        v->t = t;
    return v;
}

static jv *mk_int(R *r, int64_t i)
{
    jv *v = mk(r, V_INT);
    if (v)
        v->u.i = i;
    return v;
}

static jv *mk_float(R *r, double f)
{
    jv *v = mk(r, V_FLOAT);
    if (v)
        v->u.f = f;
    return v;
}

static jv *mk_str(R *r, const char *s, size_t n)
{
    if (n > r->lim.max_output)
        return fail(r, NULL, ST_ETOOBIG, "a string beyond %zu bytes (max_output)",
                    r->lim.max_output);
    jv *v = mk(r, V_STR);
    if (v) {
        v->u.s.s = s;
        v->u.s.n = n;
    }
    return v;
}

static jv *mk_str_copy(R *r, const char *s, size_t n)
{
    if (n > r->lim.max_output)
        return mk_str(r, s, n);
    char *d = ralloc(r, n + 1);
    if (!d)
        return NULL;
    memcpy(d, s, n);
    return mk_str(r, d, n);
}

/* A string from a buffer, which is freed. */
static jv *mk_str_buf(R *r, jbuf *b)
{
    jv *v = r->rc ? NULL : mk_str_copy(r, b->p ? b->p : "", b->n);
    free(b->p);
    b->p = NULL;
    b->n = b->cap = 0;
    return v;
}

static jv *mk_arr(R *r, uint8_t t, uint32_t n)
{
    jv *v = mk(r, t);
    if (!v)
        return NULL;
    v->u.a.n = n;
    if (n && !(v->u.a.v = ralloc(r, n * sizeof(jv *))))
        return NULL;
    return v;
}

static jv *mk_map(R *r, uint8_t t)
{
    jv *v = mk(r, t);
    if (v && !(v->u.m = ralloc(r, sizeof(jmap))))
        return NULL;
    return v;
}

static uint32_t hash_key(const char *s, size_t n)
{
    uint32_t h = 2166136261u;
    for (size_t i = 0; i < n; i++)
        h = (h ^ (unsigned char)s[i]) * 16777619u;
    return h;
}

static int64_t map_find(const jmap *m, const char *k, size_t kn)
{
    if (m->h) {
        for (uint32_t i = hash_key(k, kn) & (m->hcap - 1);; i = (i + 1) & (m->hcap - 1)) {
            uint32_t e = m->h[i];
            if (!e)
                return -1;
            if (m->kn[e - 1] == kn && !memcmp(m->k[e - 1], k, kn))
                return e - 1;
        }
    }
    for (uint32_t i = 0; i < m->n; i++)
        if (m->kn[i] == kn && !memcmp(m->k[i], k, kn))
            return i;
    return -1;
}

static jv *map_get(const jmap *m, const char *k, size_t kn)
{
    int64_t i = map_find(m, k, kn);
    return i < 0 ? NULL : m->v[i];
}

static void map_hash_put(jmap *m, uint32_t idx)
{
    for (uint32_t i = hash_key(m->k[idx], m->kn[idx]) & (m->hcap - 1);;
         i = (i + 1) & (m->hcap - 1))
        if (!m->h[i]) {
            m->h[i] = idx + 1;
            return;
        }
}

/* Insert or replace (a replaced key keeps its place, as a JavaScript Map does). */
static int map_set(R *r, jmap *m, const char *k, size_t kn, jv *v)
{
    int64_t i = map_find(m, k, kn);
    if (i >= 0) {
        m->v[i] = v;
        return 0;
    }
    if (m->n == m->cap) {
        uint32_t nc = m->cap ? m->cap * 2 : 8;
        const char **nk = ralloc(r, nc * sizeof *nk);
        size_t *nn = ralloc(r, nc * sizeof *nn);
        jv **nv = ralloc(r, nc * sizeof *nv);
        if (!nk || !nn || !nv)
            return r->rc;
        if (m->n) {
            memcpy(nk, m->k, m->n * sizeof *nk);
            memcpy(nn, m->kn, m->n * sizeof *nn);
            memcpy(nv, m->v, m->n * sizeof *nv);
        }
        m->k = nk;
        m->kn = nn;
        m->v = nv;
        m->cap = nc;
    }
    m->k[m->n] = k;
    m->kn[m->n] = kn;
    m->v[m->n] = v;
    m->n++;
    if (m->n > 16 && (!m->h || m->n * 2 > m->hcap)) {
        uint32_t hc = 64;
        while (hc < m->n * 4)
            hc *= 2;
        uint32_t *h = ralloc(r, hc * sizeof *h);
        if (!h)
            return r->rc;
        m->h = h;
        m->hcap = hc;
        for (uint32_t j = 0; j < m->n; j++)
            map_hash_put(m, j);
    } else if (m->h) {
        map_hash_put(m, m->n - 1);
    }
    return 0;
}

static int is_map(const jv *v) { return v->t == V_OBJECT || v->t == V_KWARGS; }
static int is_container(const jv *v) { return is_map(v) || v->t == V_NS; }
static int is_arr(const jv *v) { return v->t == V_ARRAY || v->t == V_TUPLE; }
static int is_num(const jv *v) { return v->t == V_INT || v->t == V_FLOAT; }
static double num_of(const jv *v)
{
    return v->t == V_INT ? (double)v->u.i : v->t == V_FLOAT ? v->u.f : v->t == V_BOOL ? v->u.b : 0;
}

static int truthy(const jv *v)
{
    switch (v->t) {
    case V_BOOL: return v->u.b;
    case V_INT: return v->u.i != 0;
    case V_FLOAT: return v->u.f != 0 && !isnan(v->u.f);
    case V_STR: return v->u.s.n > 0;
    case V_ARRAY:
    case V_TUPLE: return v->u.a.n > 0;
    case V_OBJECT:
    case V_KWARGS: return v->u.m->n > 0;
    case V_NS:
    case V_FUNC: return 1;
    default: return 0;
    }
}

/* ---- numbers as JavaScript prints them ---------------------------------------------------- */
static void js_number(double d, char *out, size_t cap)
{
    if (isnan(d)) {
        snprintf(out, cap, "NaN");
        return;
    }
    if (isinf(d)) {
        snprintf(out, cap, d < 0 ? "-Infinity" : "Infinity");
        return;
    }
    if (d == 0) {
        snprintf(out, cap, "0");
        return;
    }
    char tmp[40];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(tmp, sizeof tmp, "%.*e", p - 1, d);
        if (strtod(tmp, NULL) == d)
            break;
    }
    /* tmp: [-]D[.DDD]e[+-]X */
    const char *q = tmp;
    int neg = *q == '-';
    if (neg)
        q++;
    char digits[24];
    int k = 0;
    for (; *q && *q != 'e'; q++)
        if (*q != '.')
            digits[k++] = *q;
    while (k > 1 && digits[k - 1] == '0')
        k--;
    digits[k] = 0;
    int e = atoi(q + 1);
    int n = e + 1;
    char *o = out;
    size_t left = cap;
#define PUT(...)                                                                                  \
    do {                                                                                          \
        int w_ = snprintf(o, left, __VA_ARGS__);                                                  \
        if (w_ > 0 && (size_t)w_ < left) {                                                        \
            o += w_;                                                                              \
            left -= (size_t)w_;                                                                   \
        }                                                                                         \
    } while (0)
    if (neg)
        PUT("-");
    if (k <= n && n <= 21) {
        PUT("%s", digits);
        for (int i = 0; i < n - k; i++)
            PUT("0");
    } else if (0 < n && n <= 21) {
        PUT("%.*s.%s", n, digits, digits + n);
    } else if (-6 < n && n <= 0) {
        PUT("0.");
        for (int i = 0; i < -n; i++)
            PUT("0");
        PUT("%s", digits);
    } else {
        PUT("%c", digits[0]);
        if (k > 1)
            PUT(".%s", digits + 1);
        PUT("e%c%d", n - 1 >= 0 ? '+' : '-', abs(n - 1));
    }
#undef PUT
}

/* An IntegerValue as JavaScript prints it: beyond 2^53 it is a double's shortest digits. */
static void int_str(int64_t i, char *out, size_t cap)
{
    if (i > (int64_t)1 << 53 || i < -((int64_t)1 << 53))
        js_number((double)i, out, cap);
    else
        snprintf(out, cap, "%lld", (long long)i);
}

/* FloatValue.toString: an integral value with ".0" (toFixed(1)), -0 as "-0.0". */
static void float_str(double d, char *out, size_t cap)
{
    if (d == 0 && signbit(d)) {
        snprintf(out, cap, "-0.0");
        return;
    }
    if (isfinite(d) && d == floor(d) && fabs(d) < 1e21) {
        /* toFixed(1): the double's exact decimal value, not the shortest round trip */
        snprintf(out, cap, "%.1f", d);
        return;
    }
    js_number(d, out, cap);
}

static size_t u8len(unsigned char c)
{
    return c < 0x80 ? 1 : c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc0 ? 2 : 1;
}

/* ---- JSON as @huggingface/jinja's toJSON writes it ------------------------------------------ */
typedef struct {
    int64_t indent; /* 0: none */
    int ensure_ascii, sort_keys;
    const char *item_sep, *key_sep;
    size_t item_sep_n, key_sep_n;
} jsonopt;

static int json_str_esc(R *r, jbuf *b, const char *s, size_t n, int ascii)
{
    static const char hex[] = "0123456789abcdef";
    if (buf_add(r, b, "\"", 1))
        return r->rc;
    size_t run = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        char esc[16];
        size_t en = 0;
        if (c == '"' || c == '\\') {
            esc[0] = '\\', esc[1] = (char)c, en = 2;
        } else if (c < 0x20) {
            esc[0] = '\\';
            switch (c) {
            case '\b': esc[1] = 'b', en = 2; break;
            case '\f': esc[1] = 'f', en = 2; break;
            case '\n': esc[1] = 'n', en = 2; break;
            case '\r': esc[1] = 'r', en = 2; break;
            case '\t': esc[1] = 't', en = 2; break;
            default:
                memcpy(esc + 1, "u00", 3);
                esc[4] = hex[c >> 4], esc[5] = hex[c & 15], en = 6;
            }
        } else if (ascii && c >= 0x7f) {
            uint32_t cp = c;
            size_t len = u8len(c);
            if (len > 1 && i + len <= n) {
                cp = c & (len == 4 ? 7 : len == 3 ? 15 : 31);
                for (size_t k = 1; k < len; k++)
                    cp = (cp << 6) | ((unsigned char)s[i + k] & 63);
            } else if (c >= 0x80) {
                len = 1;
                cp = 0xfffd;
            }
            uint32_t units[2] = {cp, 0};
            int nu = 1;
            if (cp >= 0x10000) {
                units[0] = 0xd800 + ((cp - 0x10000) >> 10);
                units[1] = 0xdc00 + ((cp - 0x10000) & 0x3ff);
                nu = 2;
            }
            if (run && buf_add(r, b, s + i - run, run))
                return r->rc;
            run = 0;
            for (int k = 0; k < nu; k++) {
                char u[8];
                snprintf(u, sizeof u, "\\u%04x", units[k]);
                if (buf_add(r, b, u, 6))
                    return r->rc;
            }
            i += len - 1;
            continue;
        }
        if (en) {
            if (run && buf_add(r, b, s + i - run, run))
                return r->rc;
            run = 0;
            if (buf_add(r, b, esc, en))
                return r->rc;
        } else {
            run++;
        }
    }
    if (run && buf_add(r, b, s + n - run, run))
        return r->rc;
    return buf_add(r, b, "\"", 1);
}

static int pad(R *r, jbuf *b, const jsonopt *o, int depth)
{
    if (buf_add(r, b, "\n", 1))
        return r->rc;
    for (int64_t i = 0; i < o->indent * depth; i++)
        if (buf_add(r, b, " ", 1))
            return r->rc;
    return 0;
}

static int key_cmp(const void *a, const void *b, void *m_)
{
    const jmap *m = m_;
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    size_t n = m->kn[x] < m->kn[y] ? m->kn[x] : m->kn[y];
    int c = memcmp(m->k[x], m->k[y], n);
    if (c)
        return c;
    return m->kn[x] < m->kn[y] ? -1 : m->kn[x] > m->kn[y];
}

static int to_json(R *r, jbuf *b, const jv *v, const jsonopt *o, int depth, int undef_null,
                   const st_jnode *at)
{
    if (r->rc)
        return r->rc;
    if (depth > JSON_MAX_DEPTH) {
        fail(r, at, ST_ETOOBIG, "a value nested deeper than %d", JSON_MAX_DEPTH);
        return r->rc;
    }
    char nb[48];
    switch (v->t) {
    case V_NULL: return buf_str(r, b, "null");
    case V_UNDEF: return buf_str(r, b, undef_null ? "null" : "undefined");
    case V_BOOL: return buf_str(r, b, v->u.b ? "true" : "false");
    case V_INT:
        int_str(v->u.i, nb, sizeof nb);
        return buf_str(r, b, nb);
    case V_FLOAT:
        if (!isfinite(v->u.f))
            return buf_str(r, b, "null");
        js_number(v->u.f, nb, sizeof nb);
        return buf_str(r, b, nb);
    case V_STR: return json_str_esc(r, b, v->u.s.s, v->u.s.n, o->ensure_ascii);
    case V_ARRAY: {
        if (buf_add(r, b, "[", 1))
            return r->rc;
        for (uint32_t i = 0; i < v->u.a.n; i++) {
            if (i && buf_add(r, b, o->item_sep, o->item_sep_n))
                return r->rc;
            if (o->indent && pad(r, b, o, depth + 1))
                return r->rc;
            if (to_json(r, b, v->u.a.v[i], o, depth + 1, undef_null, at))
                return r->rc;
        }
        if (o->indent && v->u.a.n && pad(r, b, o, depth))
            return r->rc;
        return buf_add(r, b, "]", 1);
    }
    case V_OBJECT:
    case V_NS: {
        const jmap *m = v->u.m;
        uint32_t *order = NULL;
        if (o->sort_keys && m->n) {
            order = ralloc(r, m->n * sizeof *order);
            if (!order)
                return r->rc;
            for (uint32_t i = 0; i < m->n; i++)
                order[i] = i;
            qsort_r(order, m->n, sizeof *order, key_cmp, (void *)m);
        }
        if (buf_add(r, b, "{", 1))
            return r->rc;
        for (uint32_t j = 0; j < m->n; j++) {
            uint32_t i = order ? order[j] : j;
            if (j && buf_add(r, b, o->item_sep, o->item_sep_n))
                return r->rc;
            if (o->indent && pad(r, b, o, depth + 1))
                return r->rc;
            if (json_str_esc(r, b, m->k[i], m->kn[i], o->ensure_ascii) ||
                buf_add(r, b, o->key_sep, o->key_sep_n) ||
                to_json(r, b, m->v[i], o, depth + 1, undef_null, at))
                return r->rc;
        }
        if (o->indent && m->n && pad(r, b, o, depth))
            return r->rc;
        return buf_add(r, b, "}", 1);
    }
    default:
        fail(r, at, ST_EINVAL, "Cannot convert to JSON: %s", type_names[v->t]);
        return r->rc;
    }
}

static void json_defaults(jsonopt *o)
{
    memset(o, 0, sizeof *o);
    o->item_sep = ", ", o->item_sep_n = 2;
    o->key_sep = ": ", o->key_sep_n = 2;
}

/* RuntimeValue.toString(): what a block prints. */
static int tpl_str(R *r, jbuf *b, const jv *v, const st_jnode *at)
{
    char nb[48];
    switch (v->t) {
    case V_UNDEF: return buf_str(r, b, "undefined");
    case V_NULL: return buf_str(r, b, "null");
    case V_BOOL: return buf_str(r, b, v->u.b ? "true" : "false");
    case V_INT:
        int_str(v->u.i, nb, sizeof nb);
        return buf_str(r, b, nb);
    case V_FLOAT:
        float_str(v->u.f, nb, sizeof nb);
        return buf_str(r, b, nb);
    case V_STR: return buf_add(r, b, v->u.s.s, v->u.s.n);
    case V_FUNC: {
        /* String(fn) is a function's JavaScript source: that of the reference's wrapper around
         * its globals (raise_exception, range, strftime_now) is known; others print "function" */
        int k = v->u.fn->kind;
        static const char wrapper[] =
            "(args, _scope) => {\n"
            "        const result = input(...args.map((x) => x.value)) ?? null;\n"
            "        return convertToRuntimeValues(result);\n"
            "      }";
        return buf_str(r, b, k == FN_RAISE || k == FN_RANGE || k == FN_STRFTIME ? wrapper
                                                                                : "function");
    }
    default: {
        jsonopt o;
        json_defaults(&o);
        return to_json(r, b, v, &o, 0, 0, at);
    }
    }
}

/* String(value.value) in JavaScript: what + and ~ concatenate, and join joins. */
static int raw_str(R *r, jbuf *b, const jv *v, const st_jnode *at)
{
    char nb[48];
    switch (v->t) {
    case V_FLOAT:
        js_number(v->u.f, nb, sizeof nb);
        return buf_str(r, b, nb);
    case V_ARRAY:
    case V_TUPLE:
        for (uint32_t i = 0; i < v->u.a.n; i++)
            if ((i && buf_add(r, b, ",", 1)) || tpl_str(r, b, v->u.a.v[i], at))
                return r->rc;
        return 0;
    case V_OBJECT:
    case V_KWARGS:
    case V_NS: return buf_str(r, b, "[object Map]");
    default: return tpl_str(r, b, v, at);
    }
}

static jv *str_of(R *r, const jv *v, int raw, const st_jnode *at)
{
    if (v->t == V_STR)
        return (jv *)v;
    jbuf b = {0};
    if (raw ? raw_str(r, &b, v, at) : tpl_str(r, &b, v, at)) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

/* ---- equality ----------------------------------------------------------------------------- */
static double js_to_number(const char *s, size_t n)
{
    size_t i = 0, k;
    while (i < n && (k = st_jinja_space_at(s + i, s + n)) > 0)
        i += k;
    while (n > i && (k = st_jinja_space_before(s + i, s + n)) > 0)
        n -= k;
    if (i == n)
        return 0;
    char tmp[128];
    if (n - i >= sizeof tmp)
        return NAN;
    memcpy(tmp, s + i, n - i);
    tmp[n - i] = 0;
    const char *t = tmp;
    if (!strcmp(t, "Infinity") || !strcmp(t, "+Infinity"))
        return INFINITY;
    if (!strcmp(t, "-Infinity"))
        return -INFINITY;
    for (const char *q = t; *q; q++)
        if (!strchr("0123456789+-.eExXabcdefABCDEFoObB", *q))
            return NAN;
    if (t[0] == '0' && (t[1] == 'x' || t[1] == 'X')) {
        char *end;
        double d = (double)strtoull(t + 2, &end, 16);
        return *end || !t[2] ? NAN : d;
    }
    for (const char *q = t; *q; q++)
        if (strchr("xXabcdfABCDFoObB", *q))
            return NAN;
    char *end;
    double d = strtod(t, &end);
    return *end ? NAN : d;
}

static int strict_eq(const jv *a, const jv *b)
{
    if ((is_num(a) && is_num(b)))
        return num_of(a) == num_of(b);
    if (a->t != b->t)
        return 0;
    switch (a->t) {
    case V_UNDEF:
    case V_NULL: return 1;
    case V_BOOL: return a->u.b == b->u.b;
    case V_STR: return a->u.s.n == b->u.s.n && !memcmp(a->u.s.s, b->u.s.s, a->u.s.n);
    default: return a == b;
    }
}

static int is_object_like(const jv *v) { return v->t >= V_ARRAY; }

/* JavaScript's == on the two values. */
static int loose_eq(R *r, const jv *a, const jv *b)
{
    int an = a->t == V_UNDEF || a->t == V_NULL, bn = b->t == V_UNDEF || b->t == V_NULL;
    if (an || bn)
        return an && bn;
    if (is_object_like(a) && is_object_like(b))
        return a == b;
    if (is_object_like(a) || is_object_like(b)) {
        const jv *o = is_object_like(a) ? a : b, *p = is_object_like(a) ? b : a;
        jv *s = str_of(r, o, 1, NULL);
        return s ? loose_eq(r, s, p) : 0;
    }
    if (a->t == b->t || (is_num(a) && is_num(b)))
        return strict_eq(a, b);
    /* primitives of different types compare as numbers */
    double x = a->t == V_STR ? js_to_number(a->u.s.s, a->u.s.n) : num_of(a);
    double y = b->t == V_STR ? js_to_number(b->u.s.s, b->u.s.n) : num_of(b);
    return x == y;
}

/* ---- UTF-8 helpers ------------------------------------------------------------------------ */

/* Code points of s: offsets into a fresh array of n + 1 entries. */
static size_t *cp_offsets(R *r, const char *s, size_t n, size_t *count)
{
    size_t c = 0;
    for (size_t i = 0; i < n; i += u8len((unsigned char)s[i]))
        c++;
    size_t *off = ralloc(r, (c + 1) * sizeof *off);
    if (!off)
        return NULL;
    size_t k = 0, i = 0;
    for (; i < n && k < c; i += u8len((unsigned char)s[i]))
        off[k++] = i;
    off[c] = n;
    *count = c;
    return off;
}

/* String.length: UTF-16 code units. */
static int64_t js_length(const char *s, size_t n)
{
    int64_t l = 0;
    for (size_t i = 0; i < n;) {
        size_t k = u8len((unsigned char)s[i]);
        l += k == 4 ? 2 : 1;
        i += k;
    }
    return l;
}

static jv *str_trim(R *r, const jv *v, int left, int right)
{
    const char *s = v->u.s.s;
    size_t a = 0, n = v->u.s.n, k;
    if (left)
        while (a < n && (k = st_jinja_space_at(s + a, s + n)) > 0)
            a += k;
    if (right)
        while (n > a && (k = st_jinja_space_before(s + a, s + n)) > 0)
            n -= k;
    return mk_str(r, s + a, n - a);
}

static jv *str_case(R *r, const jv *v, int upper, int title, int capital)
{
    char *d = ralloc(r, v->u.s.n + 1);
    if (!d)
        return NULL;
    const char *s = v->u.s.s;
    for (size_t i = 0; i < v->u.s.n; i++) {
        char c = s[i];
        int word_start = title && (c >= 'a' && c <= 'z') &&
                         (i == 0 || !((s[i - 1] >= 'a' && s[i - 1] <= 'z') ||
                                      (s[i - 1] >= 'A' && s[i - 1] <= 'Z') ||
                                      (s[i - 1] >= '0' && s[i - 1] <= '9') || s[i - 1] == '_'));
        if ((upper && !title && !capital) || word_start || (capital && i == 0)) {
            if (c >= 'a' && c <= 'z')
                c = (char)(c - 32);
        } else if (!upper && !title && !capital) {
            if (c >= 'A' && c <= 'Z')
                c = (char)(c + 32);
        }
        d[i] = c;
    }
    return mk_str(r, d, v->u.s.n);
}

static int str_starts(const jv *s, const jv *p)
{
    return p->u.s.n <= s->u.s.n && !memcmp(s->u.s.s, p->u.s.s, p->u.s.n);
}

static int str_ends(const jv *s, const jv *p)
{
    return p->u.s.n <= s->u.s.n &&
           !memcmp(s->u.s.s + s->u.s.n - p->u.s.n, p->u.s.s, p->u.s.n);
}

static const char *str_find(const char *h, size_t hn, const char *nd, size_t nn)
{
    if (nn == 0)
        return h;
    if (nn > hn)
        return NULL;
    for (size_t i = 0; i + nn <= hn; i++)
        if (h[i] == nd[0] && !memcmp(h + i, nd, nn))
            return h + i;
    return NULL;
}

/* ---- the evaluator ------------------------------------------------------------------------ */
static jv *ev(R *r, const st_jnode *x, jenv *env);
static int eval_block(R *r, st_jnode *const *body, uint32_t n, jenv *env, jbuf *out);

static jenv *env_new(R *r, jenv *parent)
{
    jenv *e = ralloc(r, sizeof *e);
    if (e)
        e->parent = parent;
    return e;
}

static jv *env_lookup(jenv *e, const char *k, size_t n)
{
    for (; e; e = e->parent) {
        jv *v = map_get(&e->vars, k, n);
        if (v)
            return v;
    }
    return UNDEF;
}

static int count_iter(R *r, const st_jnode *at, uint64_t n)
{
    r->iters += n;
    if (r->iters > r->lim.max_iterations) {
        fail(r, at, ST_ETOOBIG, "more than %llu loop iterations (max_iterations)",
             (unsigned long long)r->lim.max_iterations);
        return r->rc;
    }
    return 0;
}

typedef struct {
    jv **pos;
    uint32_t npos;
    jv *kw; /* V_KWARGS or NULL */
} jargs;

static int eval_args(R *r, st_jnode *const *list, uint32_t n, jenv *env, jargs *out)
{
    memset(out, 0, sizeof *out);
    uint32_t cap = 0;
    for (uint32_t i = 0; i < n; i++) {
        const st_jnode *a = list[i];
        if (a->kind == JN_KWARG || a->kind == JN_KWSPREAD)
            continue;
        jv *v = ev(r, a->kind == JN_SPREAD ? a->a : a, env);
        if (!v)
            return r->rc;
        uint32_t add = 1;
        if (a->kind == JN_SPREAD) {
            if (!is_arr(v)) {
                fail(r, a, ST_EINVAL, "Cannot unpack non-iterable type: %s", type_names[v->t]);
                return r->rc;
            }
            add = v->u.a.n;
        }
        if (out->npos + add > cap) {
            uint32_t nc = (out->npos + add) * 2;
            jv **np = ralloc(r, nc * sizeof *np);
            if (!np)
                return r->rc;
            if (out->npos)
                memcpy(np, out->pos, out->npos * sizeof *np);
            out->pos = np;
            cap = nc;
        }
        if (a->kind == JN_SPREAD)
            for (uint32_t k = 0; k < v->u.a.n; k++)
                out->pos[out->npos++] = v->u.a.v[k];
        else
            out->pos[out->npos++] = v;
    }
    for (uint32_t i = 0; i < n; i++) {
        const st_jnode *a = list[i];
        if (a->kind != JN_KWARG && a->kind != JN_KWSPREAD)
            continue;
        if (!out->kw && !(out->kw = mk_map(r, V_KWARGS)))
            return r->rc;
        jv *v = ev(r, a->a, env);
        if (!v)
            return r->rc;
        if (a->kind == JN_KWARG) {
            if (map_get(out->kw->u.m, a->s, a->n)) {
                fail(r, a, ST_EINVAL, "Got multiple values for keyword argument '%.*s'",
                     (int)a->n, a->s);
                return r->rc;
            }
            if (map_set(r, out->kw->u.m, a->s, a->n, v))
                return r->rc;
        } else {
            if (!is_map(v)) {
                fail(r, a, ST_EINVAL, "Argument after ** must be a mapping, not %s",
                     type_names[v->t]);
                return r->rc;
            }
            for (uint32_t k = 0; k < v->u.m->n; k++) {
                if (map_get(out->kw->u.m, v->u.m->k[k], v->u.m->kn[k])) {
                    fail(r, a, ST_EINVAL, "Got multiple values for keyword argument '%.*s'",
                         (int)v->u.m->kn[k], v->u.m->k[k]);
                    return r->rc;
                }
                if (map_set(r, out->kw->u.m, v->u.m->k[k], v->u.m->kn[k], v->u.m->v[k]))
                    return r->rc;
            }
        }
    }
    return 0;
}

static jv *kwarg(const jargs *a, const char *name)
{
    return a->kw ? map_get(a->kw->u.m, name, strlen(name)) : NULL;
}

static jv *arg_or(const jargs *a, uint32_t i, const char *name, jv *dflt)
{
    if (i < a->npos)
        return a->pos[i];
    jv *k = name ? kwarg(a, name) : NULL;
    return k ? k : dflt;
}

static jv *mk_method(R *r, jv *self, const char *name)
{
    jv *v = mk(r, V_FUNC);
    jfn *f = ralloc(r, sizeof *f);
    if (!v || !f)
        return NULL;
    f->kind = FN_METHOD;
    f->self = self;
    f->name = name;
    v->u.fn = f;
    return v;
}

static jv *pair(R *r, const char *k, size_t kn, jv *v)
{
    jv *p = mk_arr(r, V_ARRAY, 2);
    if (!p || !(p->u.a.v[0] = mk_str(r, k, kn)))
        return NULL;
    p->u.a.v[1] = v;
    return p;
}

static jv *map_items(R *r, const jv *o, int which /* 0 items 1 keys 2 values */)
{
    const jmap *m = o->u.m;
    jv *a = mk_arr(r, V_ARRAY, m->n);
    if (!a)
        return NULL;
    for (uint32_t i = 0; i < m->n; i++) {
        jv *e = which == 0 ? pair(r, m->k[i], m->kn[i], m->v[i])
                : which == 1 ? mk_str(r, m->k[i], m->kn[i])
                             : m->v[i];
        if (!e)
            return NULL;
        a->u.a.v[i] = e;
    }
    return a;
}

/* The builtins a value offers as attributes: a method, or a value (length). */
static jv *builtin_attr(R *r, jv *o, const char *k, size_t n)
{
    static const char *const str_m[] = {"upper", "lower", "strip", "title", "capitalize",
                                        "rstrip", "lstrip", "startswith", "endswith", "split",
                                        "replace", NULL};
    static const char *const obj_m[] = {"get", "items", "keys", "values", "dictsort", NULL};
    const char *const *names = NULL;
    if (o->t == V_STR) {
        if (n == 6 && !memcmp(k, "length", 6))
            return mk_int(r, js_length(o->u.s.s, o->u.s.n));
        names = str_m;
    } else if (is_map(o)) {
        names = obj_m;
    } else if (is_arr(o)) {
        if (n == 6 && !memcmp(k, "length", 6))
            return mk_int(r, o->u.a.n);
        return UNDEF;
    }
    if (!names)
        return UNDEF;
    for (int i = 0; names[i]; i++)
        if (strlen(names[i]) == n && !memcmp(names[i], k, n))
            return mk_method(r, o, names[i]);
    return UNDEF;
}

static int compare_values(R *r, const st_jnode *at, const jv *a, const jv *b, int case_sensitive)
{
    if (a->t == V_NULL && b->t == V_NULL)
        return 0;
    if (a->t == V_NULL || b->t == V_NULL || a->t == V_UNDEF || b->t == V_UNDEF) {
        if (a->t == b->t)
            return 0;
        fail(r, at, ST_EINVAL, "Cannot compare %s with %s", type_names[a->t], type_names[b->t]);
        return 0;
    }
    if ((is_num(a) || a->t == V_BOOL) && (is_num(b) || b->t == V_BOOL)) {
        double x = num_of(a), y = num_of(b);
        return x < y ? -1 : x > y;
    }
    if (a->t != b->t) {
        fail(r, at, ST_EINVAL, "Cannot compare different types: %s and %s", type_names[a->t],
             type_names[b->t]);
        return 0;
    }
    if (a->t != V_STR) {
        fail(r, at, ST_EINVAL, "Cannot compare type: %s", type_names[a->t]);
        return 0;
    }
    size_t n = a->u.s.n < b->u.s.n ? a->u.s.n : b->u.s.n;
    for (size_t i = 0; i < n; i++) {
        unsigned char x = (unsigned char)a->u.s.s[i], y = (unsigned char)b->u.s.s[i];
        if (!case_sensitive) {
            if (x >= 'A' && x <= 'Z')
                x = (unsigned char)(x + 32);
            if (y >= 'A' && y <= 'Z')
                y = (unsigned char)(y + 32);
        }
        if (x != y)
            return x < y ? -1 : 1;
    }
    return a->u.s.n < b->u.s.n ? -1 : a->u.s.n > b->u.s.n;
}

/* A stable merge sort (JavaScript's sort is stable) on keys[], permuting vals[] alike. */
typedef struct {
    R *r;
    const st_jnode *at;
    int case_sensitive, reverse;
} sortctx;

static void merge_sort(sortctx *c, jv **vals, jv **keys, jv **tv, jv **tk, uint32_t n)
{
    if (n < 2 || c->r->rc)
        return;
    uint32_t h = n / 2;
    merge_sort(c, vals, keys, tv, tk, h);
    merge_sort(c, vals + h, keys + h, tv, tk, n - h);
    uint32_t i = 0, j = h, o = 0;
    while (i < h && j < n) {
        int cmp = compare_values(c->r, c->at, keys[j], keys[i], c->case_sensitive);
        if (c->reverse)
            cmp = -cmp;
        if (cmp < 0)
            tv[o] = vals[j], tk[o++] = keys[j++];
        else
            tv[o] = vals[i], tk[o++] = keys[i++];
    }
    while (i < h)
        tv[o] = vals[i], tk[o++] = keys[i++];
    while (j < n)
        tv[o] = vals[j], tk[o++] = keys[j++];
    memcpy(vals, tv, n * sizeof *vals);
    memcpy(keys, tk, n * sizeof *keys);
}

static jv *sorted(R *r, const st_jnode *at, jv **vals, jv **keys, uint32_t n, int cs, int rev)
{
    jv *out = mk_arr(r, V_ARRAY, n);
    jv **k2 = n ? ralloc(r, n * sizeof *k2) : NULL;
    jv **tv = n ? ralloc(r, n * sizeof *tv) : NULL;
    jv **tk = n ? ralloc(r, n * sizeof *tk) : NULL;
    if (!out || (n && (!k2 || !tv || !tk)))
        return NULL;
    if (count_iter(r, at, n))
        return NULL;
    memcpy(out->u.a.v, vals, n * sizeof *vals);
    memcpy(k2, keys, n * sizeof *keys);
    sortctx c = {r, at, cs, rev};
    merge_sort(&c, out->u.a.v, k2, tv, tk, n);
    return r->rc ? NULL : out;
}

static jv *attr_path(R *r, jv *item, const char *path, size_t n)
{
    jv *v = item;
    size_t i = 0;
    for (;;) {
        size_t j = i;
        while (j < n && path[j] != '.')
            j++;
        if (is_container(v)) {
            jv *x = map_get(v->u.m, path + i, j - i);
            v = x ? x : UNDEF;
        } else if (is_arr(v)) {
            char tmp[24];
            size_t l = j - i < sizeof tmp - 1 ? j - i : sizeof tmp - 1;
            memcpy(tmp, path + i, l);
            tmp[l] = 0;
            char *end;
            long idx = strtol(tmp, &end, 10);
            if (end == tmp || idx < 0 || (uint64_t)idx >= v->u.a.n)
                return UNDEF;
            v = v->u.a.v[idx];
        } else {
            return UNDEF;
        }
        if (j >= n)
            return v;
        i = j + 1;
    }
}

static jv *js_replace(R *r, const jv *s, const jv *old, const jv *new_, int64_t count)
{
    if (count == 0)
        return (jv *)s;
    int64_t left = count < 0 ? INT64_MAX : count;
    jbuf b = {0};
    const char *p = s->u.s.s, *end = p + s->u.s.n;
    if (old->u.s.n == 0) {
        while (!r->rc) {
            if (left > 0) {
                left--;
                buf_add(r, &b, new_->u.s.s, new_->u.s.n);
            }
            if (p >= end)
                break;
            size_t k = u8len((unsigned char)*p);
            if (k > (size_t)(end - p))
                k = (size_t)(end - p);
            buf_add(r, &b, p, k);
            p += k;
        }
    } else {
        while (!r->rc && left > 0) {
            const char *q = str_find(p, (size_t)(end - p), old->u.s.s, old->u.s.n);
            if (!q)
                break;
            buf_add(r, &b, p, (size_t)(q - p));
            buf_add(r, &b, new_->u.s.s, new_->u.s.n);
            p = q + old->u.s.n;
            left--;
        }
        buf_add(r, &b, p, (size_t)(end - p));
    }
    if (r->rc) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

static jv *str_split(R *r, const st_jnode *at, jv *self, const jargs *a)
{
    jv *sep = a->npos > 0 ? a->pos[0] : NUL;
    if (sep->t != V_STR && sep->t != V_NULL)
        return fail(r, at, ST_EINVAL, "sep argument must be a string or null");
    jv *maxv = a->npos > 1 ? a->pos[1] : NULL;
    if (maxv && maxv->t != V_INT)
        return fail(r, at, ST_EINVAL, "maxsplit argument must be a number");
    int64_t maxsplit = maxv ? maxv->u.i : -1;
    jv **parts = NULL;
    uint32_t np = 0, cap = 0;
    const char *s = self->u.s.s, *end = s + self->u.s.n;
#define ADD_PART(ptr, len)                                                                       \
    do {                                                                                         \
        if (np == cap) {                                                                         \
            uint32_t nc_ = cap ? cap * 2 : 8;                                                    \
            jv **nv_ = ralloc(r, nc_ * sizeof *nv_);                                             \
            if (!nv_)                                                                            \
                return NULL;                                                                     \
            if (np)                                                                              \
                memcpy(nv_, parts, np * sizeof *nv_);                                            \
            parts = nv_;                                                                         \
            cap = nc_;                                                                           \
        }                                                                                        \
        if (!(parts[np++] = mk_str(r, (ptr), (len))))                                            \
            return NULL;                                                                         \
        if (count_iter(r, at, 1))                                                                \
            return NULL;                                                                         \
    } while (0)
    if (sep->t == V_NULL) {
        size_t k;
        while (s < end && (k = st_jinja_space_at(s, end)) > 0)
            s += k;
        while (s < end) {
            const char *w = s;
            while (s < end && !st_jinja_space_at(s, end))
                s += u8len((unsigned char)*s);
            if (s > end)
                s = end;
            if (maxsplit != -1 && np >= maxsplit) {
                ADD_PART(w, (size_t)(end - w));
                break;
            }
            ADD_PART(w, (size_t)(s - w));
            while (s < end && (k = st_jinja_space_at(s, end)) > 0)
                s += k;
        }
    } else {
        if (sep->u.s.n == 0)
            return fail(r, at, ST_EINVAL, "empty separator");
        for (;;) {
            const char *q = str_find(s, (size_t)(end - s), sep->u.s.s, sep->u.s.n);
            if (!q || (maxsplit != -1 && np >= maxsplit)) {
                ADD_PART(s, (size_t)(end - s));
                break;
            }
            ADD_PART(s, (size_t)(q - s));
            s = q + sep->u.s.n;
        }
    }
#undef ADD_PART
    jv *out = mk_arr(r, V_ARRAY, np);
    if (!out)
        return NULL;
    if (np)
        memcpy(out->u.a.v, parts, np * sizeof *parts);
    return out;
}

static jv *call_method(R *r, const st_jnode *at, jfn *f, const jargs *a)
{
    jv *self = f->self;
    const char *m = f->name;
    if (self->t == V_STR) {
        if (!strcmp(m, "upper"))
            return str_case(r, self, 1, 0, 0);
        if (!strcmp(m, "lower"))
            return str_case(r, self, 0, 0, 0);
        if (!strcmp(m, "title"))
            return str_case(r, self, 1, 1, 0);
        if (!strcmp(m, "capitalize"))
            return str_case(r, self, 1, 0, 1);
        /* strip / lstrip / rstrip take no characters: they trim whitespace, as the reference */
        if (!strcmp(m, "strip"))
            return str_trim(r, self, 1, 1);
        if (!strcmp(m, "lstrip"))
            return str_trim(r, self, 1, 0);
        if (!strcmp(m, "rstrip"))
            return str_trim(r, self, 0, 1);
        if (!strcmp(m, "startswith") || !strcmp(m, "endswith")) {
            int starts = m[0] == 's';
            if (a->npos == 0)
                return fail(r, at, ST_EINVAL, "%s() requires at least one argument", m);
            jv *p = a->pos[0];
            if (p->t == V_STR)
                return BOOL(starts ? str_starts(self, p) : str_ends(self, p));
            if (is_arr(p)) {
                for (uint32_t i = 0; i < p->u.a.n; i++) {
                    if (p->u.a.v[i]->t != V_STR)
                        return fail(r, at, ST_EINVAL, "%s() tuple elements must be strings", m);
                    if (starts ? str_starts(self, p->u.a.v[i]) : str_ends(self, p->u.a.v[i]))
                        return BOOL(1);
                }
                return BOOL(0);
            }
            return fail(r, at, ST_EINVAL, "%s() argument must be a string or tuple of strings",
                        m);
        }
        if (!strcmp(m, "split"))
            return str_split(r, at, self, a);
        if (!strcmp(m, "replace")) {
            uint32_t npos = a->npos;
            const jv *kw = a->kw;
            if (npos + (kw ? 1 : 0) < 2)
                return fail(r, at, ST_EINVAL, "replace() requires at least two arguments");
            if (npos < 2 || a->pos[0]->t != V_STR || a->pos[1]->t != V_STR)
                return fail(r, at, ST_EINVAL, "replace() arguments must be strings");
            jv *count = NUL;
            if (npos > 2)
                count = a->pos[2];
            else if (kw) {
                jv *c = map_get(kw->u.m, "count", 5);
                count = c ? c : NUL;
            }
            if (count->t != V_INT && count->t != V_NULL)
                return fail(r, at, ST_EINVAL, "replace() count argument must be a number or null");
            return js_replace(r, self, a->pos[0], a->pos[1],
                              count->t == V_INT ? count->u.i : -1);
        }
    } else if (is_map(self)) {
        if (!strcmp(m, "get")) {
            jv *k = a->npos > 0 ? a->pos[0] : UNDEF;
            if (k->t != V_STR)
                return fail(r, at, ST_EINVAL, "Object key must be a string: got %s",
                            type_names[k->t]);
            jv *v = map_get(self->u.m, k->u.s.s, k->u.s.n);
            if (v)
                return v;
            return a->npos > 1 ? a->pos[1] : NUL;
        }
        if (!strcmp(m, "items"))
            return map_items(r, self, 0);
        if (!strcmp(m, "keys"))
            return map_items(r, self, 1);
        if (!strcmp(m, "values"))
            return map_items(r, self, 2);
        if (!strcmp(m, "dictsort")) {
            jv *cs = arg_or(a, 0, "case_sensitive", BOOL(0));
            jv *by = arg_or(a, 1, "by", NULL);
            jv *rev = arg_or(a, 2, "reverse", BOOL(0));
            if (cs->t != V_BOOL)
                return fail(r, at, ST_EINVAL, "case_sensitive must be a boolean");
            int by_value = 0;
            if (by) {
                if (by->t != V_STR)
                    return fail(r, at, ST_EINVAL, "by must be a string");
                if (by->u.s.n == 5 && !memcmp(by->u.s.s, "value", 5))
                    by_value = 1;
                else if (!(by->u.s.n == 3 && !memcmp(by->u.s.s, "key", 3)))
                    return fail(r, at, ST_EINVAL, "by must be either 'key' or 'value'");
            }
            if (rev->t != V_BOOL)
                return fail(r, at, ST_EINVAL, "reverse must be a boolean");
            jv *items = map_items(r, self, 0);
            if (!items)
                return NULL;
            uint32_t n = items->u.a.n;
            jv **keys = n ? ralloc(r, n * sizeof *keys) : NULL;
            if (n && !keys)
                return NULL;
            for (uint32_t i = 0; i < n; i++)
                keys[i] = items->u.a.v[i]->u.a.v[by_value];
            return sorted(r, at, items->u.a.v, keys, n, cs->u.b, rev->u.b);
        }
    }
    return fail(r, at, ST_EINVAL, "unknown method %s", m);
}

/* ---- macros ------------------------------------------------------------------------------- */
static void find_special(const st_jnode *x, jfn *f, int depth)
{
    if (!x || depth > 400)
        return;
    if (x->kind == JN_IDENT) {
        if (x->n == 6 && !memcmp(x->s, "kwargs", 6))
            f->uses_kwargs = 1;
        if (x->n == 7 && !memcmp(x->s, "varargs", 7))
            f->uses_varargs = 1;
        return;
    }
    if (x->kind == JN_MEMBER && !x->flag) {
        find_special(x->a, f, depth + 1);
        return;
    }
    find_special(x->a, f, depth + 1);
    find_special(x->b, f, depth + 1);
    find_special(x->c, f, depth + 1);
    for (uint32_t i = 0; i < x->nlist; i++)
        find_special(x->list[i], f, depth + 1);
    if (x->kind != JN_MACRO && x->kind != JN_CALLBLK)
        for (uint32_t i = 0; i < x->nlist2; i++)
            find_special(x->list2[i], f, depth + 1);
}

static int param_named(st_jnode *const *params, uint32_t n, const char *name)
{
    for (uint32_t i = 0; i < n; i++)
        if (params[i]->n == strlen(name) && !memcmp(params[i]->s, name, params[i]->n))
            return 1;
    return 0;
}

static jv *mk_macro(R *r, int kind, const st_jnode *node, jenv *env)
{
    jv *v = mk(r, V_FUNC);
    jfn *f = ralloc(r, sizeof *f);
    if (!v || !f)
        return NULL;
    f->kind = kind;
    f->node = node;
    f->env = env;
    for (uint32_t i = 0; i < node->nlist; i++)
        find_special(node->list[i], f, 0);
    for (uint32_t i = 0; i < node->nlist2; i++)
        if (node->list2[i]->kind == JN_KWARG)
            find_special(node->list2[i]->a, f, 0);
    if (param_named(node->list2, node->nlist2, "kwargs"))
        f->uses_kwargs = 0;
    if (param_named(node->list2, node->nlist2, "varargs"))
        f->uses_varargs = 0;
    v->u.fn = f;
    return v;
}

static int bind_args(R *r, const st_jnode *at, jfn *f, st_jnode *const *params, uint32_t np,
                     const jargs *a, jenv *scope, const char *display)
{
    uint8_t *used = NULL;
    const jmap *kw = a->kw ? a->kw->u.m : NULL;
    if (kw && kw->n && !(used = ralloc(r, kw->n)))
        return r->rc;
    const st_jnode **pending = np ? ralloc(r, np * sizeof *pending) : NULL;
    if (np && !pending)
        return r->rc;
    uint32_t npend = 0;
    for (uint32_t i = 0; i < np; i++) {
        const st_jnode *p = params[i];
        jv *v = i < a->npos ? a->pos[i] : NULL;
        if (!v && kw) {
            int64_t k = map_find(kw, p->s, p->n);
            if (k >= 0 && !used[k]) {
                v = kw->v[k];
                used[k] = 1;
            }
        }
        if (!v && p->kind == JN_KWARG)
            pending[npend++] = p;
        if (map_set(r, &scope->vars, p->s, p->n, v ? v : UNDEF))
            return r->rc;
    }
    uint32_t left = 0, first = 0;
    for (uint32_t k = 0; kw && k < kw->n; k++)
        if (!used[k] && !left++)
            first = k;
    if (f->uses_kwargs) {
        jv *o = mk_map(r, V_OBJECT);
        if (!o)
            return r->rc;
        for (uint32_t k = 0; kw && k < kw->n; k++)
            if (!used[k] && map_set(r, o->u.m, kw->k[k], kw->kn[k], kw->v[k]))
                return r->rc;
        if (map_set(r, &scope->vars, "kwargs", 6, o))
            return r->rc;
    } else if (left) {
        fail(r, at, ST_EINVAL, "macro %s takes no keyword argument '%.*s'", display,
             (int)kw->kn[first], kw->k[first]);
        return r->rc;
    }
    if (f->uses_varargs) {
        uint32_t n = a->npos > np ? a->npos - np : 0;
        jv *va = mk_arr(r, V_ARRAY, n);
        if (!va)
            return r->rc;
        for (uint32_t i = 0; i < n; i++)
            va->u.a.v[i] = a->pos[np + i];
        if (map_set(r, &scope->vars, "varargs", 7, va))
            return r->rc;
    } else if (a->npos > np) {
        fail(r, at, ST_EINVAL, "macro %s takes not more than %u argument(s)", display, np);
        return r->rc;
    }
    for (uint32_t i = 0; i < npend; i++) {
        jv *v = ev(r, pending[i]->a, scope);
        if (!v || map_set(r, &scope->vars, pending[i]->s, pending[i]->n, v))
            return r->rc;
    }
    return 0;
}

/* range(start, stop, step = 1) as the reference's JavaScript runs it on numbers: an undefined
 * argument is an absent one, the loop adds step in doubles. */
static jv *js_range(R *r, const st_jnode *at, const jargs *a)
{
    const jv *p[3] = {UNDEF, UNDEF, UNDEF};
    for (uint32_t i = 0; i < a->npos && i < 3; i++) {
        p[i] = a->pos[i];
        if (p[i]->t != V_UNDEF && !is_num(p[i]) && p[i]->t != V_BOOL)
            return fail(r, at, ST_EINVAL, "range() arguments must be numbers, got %s",
                        type_names[p[i]->t]);
    }
    int have_start = p[0]->t != V_UNDEF;
    double start = num_of(p[0]), stop = num_of(p[1]), step = p[2]->t == V_UNDEF ? 1 : num_of(p[2]);
    if (p[1]->t == V_UNDEF) {
        stop = start;
        have_start = 1;
        start = 0;
        if (p[0]->t == V_UNDEF)
            stop = NAN;
    }
    if (step == 0 || isnan(step))
        return fail(r, at, ST_EINVAL, "range() step must not be zero");
    jv **items = NULL;
    uint32_t n = 0, cap = 0;
    for (double x = start; have_start && (step > 0 ? x < stop : x > stop); x += step) {
        if (count_iter(r, at, 1))
            return NULL;
        if (n == cap) {
            uint32_t nc = cap ? cap * 2 : 16;
            jv **ni = ralloc(r, nc * sizeof *ni);
            if (!ni)
                return NULL;
            if (n)
                memcpy(ni, items, n * sizeof *ni);
            items = ni;
            cap = nc;
        }
        /* the first item is start itself (true stays true), then sums */
        items[n] = n == 0 && p[1]->t != V_UNDEF && p[0]->t == V_BOOL ? (jv *)p[0]
                   : x == floor(x) && fabs(x) < 9007199254740992.0   ? mk_int(r, (int64_t)x)
                                                                     : mk_float(r, x);
        if (!items[n++])
            return NULL;
    }
    jv *out = mk_arr(r, V_ARRAY, n);
    if (out && n)
        memcpy(out->u.a.v, items, n * sizeof *items);
    return out;
}

static jv *js_strftime(R *r, const st_jnode *at, const jargs *a)
{
    static const char *const mon[] = {"January", "February", "March", "April", "May", "June",
                                      "July", "August", "September", "October", "November",
                                      "December"};
    if (a->npos < 1 || a->pos[0]->t != V_STR)
        return fail(r, at, ST_EINVAL, "strftime_now() needs a format string");
    const jv *f = a->pos[0];
    time_t now = time(NULL);
    struct tm tm;
    localtime_r(&now, &tm);
    jbuf b = {0};
    for (size_t i = 0; i < f->u.s.n && !r->rc; i++) {
        char c = f->u.s.s[i], t[16];
        if (c != '%' || i + 1 >= f->u.s.n || !strchr("YmdbBHM%", f->u.s.s[i + 1])) {
            buf_add(r, &b, &c, 1);
            continue;
        }
        switch (f->u.s.s[++i]) {
        case 'Y': snprintf(t, sizeof t, "%d", tm.tm_year + 1900); break;
        case 'm': snprintf(t, sizeof t, "%02d", tm.tm_mon + 1); break;
        case 'd': snprintf(t, sizeof t, "%02d", tm.tm_mday); break;
        case 'b': snprintf(t, sizeof t, "%.3s", mon[tm.tm_mon]); break;
        case 'B': snprintf(t, sizeof t, "%s", mon[tm.tm_mon]); break;
        case 'H': snprintf(t, sizeof t, "%02d", tm.tm_hour); break;
        case 'M': snprintf(t, sizeof t, "%02d", tm.tm_min); break;
        default: snprintf(t, sizeof t, "%%"); break;
        }
        buf_str(r, &b, t);
    }
    if (r->rc) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

static jv *call_fn(R *r, const st_jnode *at, jv *fv, const jargs *a, jenv *callenv)
{
    if (fv->t != V_FUNC)
        return fail(r, at, ST_EINVAL, "Cannot call something that is not a function: got %s",
                    type_names[fv->t]);
    jfn *f = fv->u.fn;
    switch (f->kind) {
    case FN_MACRO:
    case FN_CALLER: {
        if (r->depth >= r->lim.max_depth)
            return fail(r, at, ST_ETOOBIG, "macro calls nested deeper than %u (max_depth)",
                        r->lim.max_depth);
        jenv *scope = env_new(r, f->kind == FN_MACRO ? callenv : f->env);
        if (!scope)
            return NULL;
        char display[80];
        if (f->kind == FN_MACRO)
            snprintf(display, sizeof display, "'%.*s'", (int)(f->node->n > 60 ? 60 : f->node->n),
                     f->node->s);
        else
            snprintf(display, sizeof display, "None");
        if (bind_args(r, at, f, f->node->list2, f->node->nlist2, a, scope, display))
            return NULL;
        r->depth++;
        jbuf b = {0};
        eval_block(r, f->node->list, f->node->nlist, scope, &b);
        r->depth--;
        if (r->rc) {
            free(b.p);
            return NULL;
        }
        return mk_str_buf(r, &b);
    }
    case FN_METHOD: return call_method(r, at, f, a);
    case FN_NAMESPACE: {
        if (a->npos > 1)
            return fail(r, at, ST_EINVAL, "namespace expected at most 1 argument, got %u",
                        a->npos);
        jv *ns = mk_map(r, V_NS);
        if (!ns)
            return NULL;
        if (a->npos == 1) {
            jv *src = a->pos[0];
            if (is_map(src)) {
                for (uint32_t i = 0; i < src->u.m->n; i++)
                    if (map_set(r, ns->u.m, src->u.m->k[i], src->u.m->kn[i], src->u.m->v[i]))
                        return NULL;
            } else if (is_arr(src)) {
                for (uint32_t i = 0; i < src->u.a.n; i++) {
                    jv *p = src->u.a.v[i];
                    if (!is_arr(p) || p->u.a.n != 2)
                        return fail(r, at, ST_EINVAL, "namespace expected an object or an "
                                                      "iterable of [key, value] pairs");
                    if (p->u.a.v[0]->t != V_STR)
                        return fail(r, at, ST_EINVAL, "namespace keys must be strings");
                    if (map_set(r, ns->u.m, p->u.a.v[0]->u.s.s, p->u.a.v[0]->u.s.n,
                                p->u.a.v[1]))
                        return NULL;
                }
            } else {
                return fail(r, at, ST_EINVAL, "'%s' object is not iterable", type_names[src->t]);
            }
        }
        for (uint32_t i = 0; a->kw && i < a->kw->u.m->n; i++)
            if (map_set(r, ns->u.m, a->kw->u.m->k[i], a->kw->u.m->kn[i], a->kw->u.m->v[i]))
                return NULL;
        return ns;
    }
    case FN_RAISE: {
        jv *msg = a->npos ? a->pos[0] : a->kw ? a->kw : UNDEF;
        jv *s = str_of(r, msg, 1, at);
        if (!s)
            return NULL;
        fail(r, NULL, ST_EINVAL, "raise_exception: %.*s", (int)(s->u.s.n > 280 ? 280 : s->u.s.n),
             s->u.s.s);
        return NULL;
    }
    case FN_RANGE: return js_range(r, at, a);
    case FN_STRFTIME: return js_strftime(r, at, a);
    }
    return fail(r, at, ST_EINVAL, "bad function");
}

/* ---- tests -------------------------------------------------------------------------------- */
static int run_test(R *r, const st_jnode *at, const char *name, size_t n, const jv *v,
                    const jv *arg, int *out)
{
#define IS(s) (n == strlen(s) && !memcmp(name, s, n))
    if (IS("boolean")) *out = v->t == V_BOOL;
    else if (IS("callable")) *out = v->t == V_FUNC;
    else if (IS("odd") || IS("even")) {
        if (v->t != V_INT) {
            fail(r, at, ST_EINVAL, "cannot %.*s on %s", (int)n, name, type_names[v->t]);
            return r->rc;
        }
        *out = (v->u.i % 2 != 0) == IS("odd");
    } else if (IS("false")) *out = v->t == V_BOOL && !v->u.b;
    else if (IS("true")) *out = v->t == V_BOOL && v->u.b;
    else if (IS("none")) *out = v->t == V_NULL;
    else if (IS("string")) *out = v->t == V_STR;
    else if (IS("number")) *out = is_num(v);
    else if (IS("integer")) *out = v->t == V_INT;
    else if (IS("iterable")) *out = v->t == V_ARRAY || v->t == V_STR;
    else if (IS("mapping")) *out = is_map(v);
    else if (IS("sequence")) *out = is_arr(v) || is_map(v) || v->t == V_STR;
    else if (IS("lower") || IS("upper")) {
        *out = 0;
        if (v->t == V_STR) {
            jv *c = str_case(r, v, IS("upper"), 0, 0);
            if (!c)
                return r->rc;
            *out = !memcmp(c->u.s.s, v->u.s.s, v->u.s.n);
        }
    } else if (IS("defined")) *out = v->t != V_UNDEF;
    else if (IS("undefined")) *out = v->t == V_UNDEF;
    else if (IS("equalto") || IS("eq")) *out = strict_eq(v, arg ? arg : UNDEF);
    else {
        fail(r, at, ST_EINVAL, "Unknown test: %.*s", (int)n, name);
        return r->rc;
    }
    return 0;
#undef IS
}

/* ---- filters ------------------------------------------------------------------------------ */
static jv *js_parse_int(R *r, const jv *s, jv *dflt)
{
    const char *p = s->u.s.s, *end = p + s->u.s.n;
    size_t k;
    while (p < end && (k = st_jinja_space_at(p, end)) > 0)
        p += k;
    int neg = 0;
    if (p < end && (*p == '+' || *p == '-'))
        neg = *p++ == '-';
    const char *d = p;
    double v = 0;
    while (p < end && *p >= '0' && *p <= '9')
        v = v * 10 + (*p++ - '0');
    if (p == d)
        return dflt;
    if (v > 9.2e18)
        return fail(r, NULL, ST_EINVAL, "int: %.*s is beyond 64 bits", (int)s->u.s.n, s->u.s.s);
    return mk_int(r, neg ? -(int64_t)v : (int64_t)v);
}

static jv *js_parse_float(R *r, const jv *s, jv *dflt)
{
    const char *p = s->u.s.s, *end = p + s->u.s.n;
    size_t k;
    while (p < end && (k = st_jinja_space_at(p, end)) > 0)
        p += k;
    char tmp[128];
    size_t n = 0;
    const char *q = p;
    if (q < end && (*q == '+' || *q == '-'))
        q++;
    if ((size_t)(end - q) >= 8 && !memcmp(q, "Infinity", 8))
        return mk_float(r, p < end && *p == '-' ? -INFINITY : INFINITY);
    int digits = 0;
    while (q < end && *q >= '0' && *q <= '9')
        q++, digits++;
    if (q < end && *q == '.') {
        q++;
        while (q < end && *q >= '0' && *q <= '9')
            q++, digits++;
    }
    if (!digits)
        return dflt;
    if (q < end && (*q == 'e' || *q == 'E')) {
        const char *e = q + 1;
        if (e < end && (*e == '+' || *e == '-'))
            e++;
        if (e < end && *e >= '0' && *e <= '9') {
            while (e < end && *e >= '0' && *e <= '9')
                e++;
            q = e;
        }
    }
    n = (size_t)(q - p);
    if (n >= sizeof tmp)
        n = sizeof tmp - 1;
    memcpy(tmp, p, n);
    tmp[n] = 0;
    return mk_float(r, strtod(tmp, NULL));
}

static jv *indent_str(R *r, const jv *s, int64_t width, int first, int blank)
{
    jbuf b = {0};
    const char *p = s->u.s.s, *end = p + s->u.s.n;
    for (int line = 0; !r->rc; line++) {
        const char *nl = memchr(p, '\n', (size_t)(end - p));
        const char *le = nl ? nl : end;
        if (!((!first && line == 0) || (!blank && le == p)))
            for (int64_t i = 0; i < width && !r->rc; i++)
                buf_add(r, &b, " ", 1);
        buf_add(r, &b, p, (size_t)(le - p));
        if (!nl)
            break;
        buf_add(r, &b, "\n", 1);
        p = nl + 1;
    }
    if (r->rc) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

static jv *join_values(R *r, const st_jnode *at, const jv *arr, const char *sep, size_t sn)
{
    jbuf b = {0};
    for (uint32_t i = 0; i < arr->u.a.n && !r->rc; i++) {
        if (i)
            buf_add(r, &b, sep, sn);
        const jv *e = arr->u.a.v[i];
        if (e->t != V_NULL && e->t != V_UNDEF)
            raw_str(r, &b, e, at);
    }
    if (r->rc) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

static jv *tojson_value(R *r, const st_jnode *at, const jv *v, const jsonopt *o)
{
    jbuf b = {0};
    if (to_json(r, &b, v, o, 0, 1, at)) {
        free(b.p);
        return NULL;
    }
    return mk_str_buf(r, &b);
}

static jv *apply_filter(R *r, jv *v, const st_jnode *f, jenv *env)
{
    if (f->kind == JN_IDENT) {
        const char *n = f->s;
        size_t nn = f->n;
#define IS(s) (nn == strlen(s) && !memcmp(n, s, nn))
        if (IS("safe"))
            return v;
        if (IS("tojson")) {
            jsonopt o;
            json_defaults(&o);
            return tojson_value(r, f, v, &o);
        }
        if (v->t == V_ARRAY || v->t == V_TUPLE) {
            if (IS("list"))
                return v;
            if (IS("first"))
                return v->u.a.n ? v->u.a.v[0] : UNDEF;
            if (IS("last"))
                return v->u.a.n ? v->u.a.v[v->u.a.n - 1] : UNDEF;
            if (IS("length"))
                return mk_int(r, v->u.a.n);
            if (IS("reverse")) {
                jv *o = mk_arr(r, V_ARRAY, v->u.a.n);
                for (uint32_t i = 0; o && i < v->u.a.n; i++)
                    o->u.a.v[i] = v->u.a.v[v->u.a.n - 1 - i];
                return o;
            }
            if (IS("sort"))
                return sorted(r, f, v->u.a.v, v->u.a.v, v->u.a.n, 0, 0);
            if (IS("join"))
                return join_values(r, f, v, "", 0);
            if (IS("string")) {
                jbuf b = {0};
                jsonopt o;
                json_defaults(&o);
                if (to_json(r, &b, v, &o, 0, 0, f)) {
                    free(b.p);
                    return NULL;
                }
                return mk_str_buf(r, &b);
            }
            if (IS("unique")) {
                jv *o = mk_arr(r, V_ARRAY, v->u.a.n);
                if (!o)
                    return NULL;
                uint32_t k = 0;
                if (count_iter(r, f, v->u.a.n))
                    return NULL;
                for (uint32_t i = 0; i < v->u.a.n; i++) {
                    int seen = 0;
                    for (uint32_t j = 0; j < k && !seen; j++)
                        seen = strict_eq(o->u.a.v[j], v->u.a.v[i]);
                    if (!seen)
                        o->u.a.v[k++] = v->u.a.v[i];
                }
                o->u.a.n = k;
                return o;
            }
            return fail(r, f, ST_EINVAL, "Unknown ArrayValue filter: %.*s", (int)nn, n);
        }
        if (v->t == V_STR) {
            if (IS("length"))
                return mk_int(r, js_length(v->u.s.s, v->u.s.n));
            if (IS("upper"))
                return str_case(r, v, 1, 0, 0);
            if (IS("lower"))
                return str_case(r, v, 0, 0, 0);
            if (IS("title"))
                return str_case(r, v, 1, 1, 0);
            if (IS("capitalize"))
                return str_case(r, v, 1, 0, 1);
            if (IS("trim"))
                return str_trim(r, v, 1, 1);
            if (IS("indent"))
                return indent_str(r, v, 4, 0, 0);
            if (IS("join") || IS("string"))
                return v;
            if (IS("int"))
                return js_parse_int(r, v, mk_int(r, 0));
            if (IS("float"))
                return js_parse_float(r, v, mk_float(r, 0));
            return fail(r, f, ST_EINVAL, "Unknown StringValue filter: %.*s", (int)nn, n);
        }
        if (is_num(v)) {
            if (IS("abs"))
                return v->t == V_INT ? mk_int(r, v->u.i < 0 ? -v->u.i : v->u.i)
                                     : mk_float(r, fabs(v->u.f));
            if (IS("int"))
                return v->t == V_INT ? v : mk_int(r, (int64_t)floor(v->u.f));
            if (IS("float"))
                return mk_float(r, num_of(v));
            if (IS("string"))
                return str_of(r, v, 0, f);
            return fail(r, f, ST_EINVAL, "Unknown NumericValue filter: %.*s", (int)nn, n);
        }
        if (is_map(v)) {
            if (IS("items"))
                return map_items(r, v, 0);
            if (IS("length"))
                return mk_int(r, v->u.m->n);
            jv *m = builtin_attr(r, v, n, nn);
            if (m && m->t == V_FUNC) {
                jargs none = {0};
                return call_method(r, f, m->u.fn, &none);
            }
            if (m && m->t != V_UNDEF)
                return m;
            return r->rc ? NULL
                         : fail(r, f, ST_EINVAL, "Unknown ObjectValue filter: %.*s", (int)nn, n);
        }
        if (v->t == V_BOOL) {
            if (IS("bool"))
                return v;
            if (IS("int"))
                return mk_int(r, v->u.b);
            if (IS("float"))
                return mk_float(r, v->u.b);
            if (IS("string"))
                return mk_str(r, v->u.b ? "true" : "false", v->u.b ? 4 : 5);
            return fail(r, f, ST_EINVAL, "Unknown BooleanValue filter: %.*s", (int)nn, n);
        }
        return fail(r, f, ST_EINVAL, "Cannot apply filter \"%.*s\" to type: %s", (int)nn, n,
                    type_names[v->t]);
#undef IS
    }
    /* a call: name(arguments) */
    const st_jnode *callee = f->a;
    if (callee->kind != JN_IDENT)
        return fail(r, f, ST_EINVAL, "Unknown filter");
    const char *n = callee->s;
    size_t nn = callee->n;
#define IS(s) (nn == strlen(s) && !memcmp(n, s, nn))
    jargs a;
    if (IS("tojson")) {
        if (eval_args(r, f->list, f->nlist, env, &a))
            return NULL;
        jsonopt o;
        json_defaults(&o);
        jv *ind = kwarg(&a, "indent"), *asc = kwarg(&a, "ensure_ascii"),
           *sk = kwarg(&a, "sort_keys"), *sep = kwarg(&a, "separators");
        if (ind && ind->t != V_INT && ind->t != V_NULL)
            return fail(r, f, ST_EINVAL, "If set, indent must be a number");
        if (asc && asc->t != V_BOOL)
            return fail(r, f, ST_EINVAL, "If set, ensure_ascii must be a boolean");
        if (sk && sk->t != V_BOOL)
            return fail(r, f, ST_EINVAL, "If set, sort_keys must be a boolean");
        if (ind && ind->t == V_INT) {
            if (ind->u.i > 64 || ind->u.i < 0)
                return fail(r, f, ST_EINVAL, "tojson: indent %lld is beyond 0..64",
                            (long long)ind->u.i);
            o.indent = ind->u.i;
        }
        if (o.indent)
            o.item_sep = ",", o.item_sep_n = 1;
        o.ensure_ascii = asc && asc->u.b;
        o.sort_keys = sk && sk->u.b;
        if (sep && is_arr(sep)) {
            if (sep->u.a.n != 2 || sep->u.a.v[0]->t != V_STR || sep->u.a.v[1]->t != V_STR)
                return fail(r, f, ST_EINVAL, "separators must be a tuple of two strings");
            o.item_sep = sep->u.a.v[0]->u.s.s, o.item_sep_n = sep->u.a.v[0]->u.s.n;
            o.key_sep = sep->u.a.v[1]->u.s.s, o.key_sep_n = sep->u.a.v[1]->u.s.n;
        } else if (sep && sep->t != V_NULL) {
            return fail(r, f, ST_EINVAL, "If set, separators must be a tuple of two strings");
        }
        return tojson_value(r, f, v, &o);
    }
    if (IS("join")) {
        jv *arr = v;
        if (v->t == V_STR) {
            size_t c;
            size_t *off = cp_offsets(r, v->u.s.s, v->u.s.n, &c);
            if (!off || !(arr = mk_arr(r, V_ARRAY, (uint32_t)c)))
                return NULL;
            for (size_t i = 0; i < c; i++)
                if (!(arr->u.a.v[i] = mk_str(r, v->u.s.s + off[i], off[i + 1] - off[i])))
                    return NULL;
        } else if (!is_arr(v)) {
            return fail(r, f, ST_EINVAL, "Cannot apply filter \"join\" to type: %s",
                        type_names[v->t]);
        }
        if (eval_args(r, f->list, f->nlist, env, &a))
            return NULL;
        jv *sep = arg_or(&a, 0, "separator", NULL);
        if (sep && sep->t != V_STR)
            return fail(r, f, ST_EINVAL, "separator must be a string");
        return join_values(r, f, arr, sep ? sep->u.s.s : "", sep ? sep->u.s.n : 0);
    }
    if (IS("int") || IS("float")) {
        int is_int = IS("int");
        if (eval_args(r, f->list, f->nlist, env, &a))
            return NULL;
        jv *d = arg_or(&a, 0, "default", NULL);
        if (!d && !(d = is_int ? mk_int(r, 0) : mk_float(r, 0)))
            return NULL;
        if (v->t == V_STR)
            return is_int ? js_parse_int(r, v, d) : js_parse_float(r, v, d);
        if (is_num(v))
            return v;
        if (v->t == V_BOOL)
            return is_int ? mk_int(r, v->u.b) : mk_float(r, v->u.b);
        return fail(r, f, ST_EINVAL, "Cannot apply filter \"%.*s\" to type: %s", (int)nn, n,
                    type_names[v->t]);
    }
    if (IS("default")) {
        if (eval_args(r, f->list, f->nlist, env, &a))
            return NULL;
        jv *d = a.npos > 0 ? a.pos[0] : NULL;
        if (!d && !(d = mk_str(r, "", 0)))
            return NULL;
        jv *boolean = arg_or(&a, 1, "boolean", BOOL(0));
        if (boolean->t != V_BOOL)
            return fail(r, f, ST_EINVAL, "`default` filter flag must be a boolean");
        if (v->t == V_UNDEF || (boolean->u.b && !truthy(v)))
            return d;
        return v;
    }
    if (is_arr(v)) {
        if (IS("sort")) {
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            jv *rev = arg_or(&a, 0, "reverse", BOOL(0));
            jv *cs = arg_or(&a, 1, "case_sensitive", BOOL(0));
            jv *attr = arg_or(&a, 2, "attribute", NUL);
            if (rev->t != V_BOOL)
                return fail(r, f, ST_EINVAL, "reverse must be a boolean");
            if (cs->t != V_BOOL)
                return fail(r, f, ST_EINVAL, "case_sensitive must be a boolean");
            if (attr->t != V_STR && attr->t != V_INT && attr->t != V_NULL)
                return fail(r, f, ST_EINVAL, "attribute must be a string, integer, or null");
            uint32_t cnt = v->u.a.n;
            jv **keys = cnt ? ralloc(r, cnt * sizeof *keys) : NULL;
            if (cnt && !keys)
                return NULL;
            jv *path = attr->t == V_INT ? str_of(r, attr, 0, f) : attr;
            if (!path)
                return NULL;
            for (uint32_t i = 0; i < cnt; i++)
                keys[i] = attr->t == V_NULL ? v->u.a.v[i]
                                            : attr_path(r, v->u.a.v[i], path->u.s.s, path->u.s.n);
            return sorted(r, f, v->u.a.v, keys, cnt, cs->u.b, rev->u.b);
        }
        if (IS("selectattr") || IS("rejectattr") || IS("select") || IS("reject")) {
            int attr_form = n[nn - 4] == 'a', sel = n[0] == 's';
            if (attr_form)
                for (uint32_t i = 0; i < v->u.a.n; i++)
                    if (!is_container(v->u.a.v[i]))
                        return fail(r, f, ST_EINVAL,
                                    "`%.*s` can only be applied to array of objects", (int)nn, n);
            for (uint32_t i = 0; i < f->nlist; i++)
                if (f->list[i]->kind != JN_STR)
                    return fail(r, f, ST_EINVAL, "arguments of `%.*s` must be strings", (int)nn,
                                n);
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            uint32_t base = attr_form ? 1 : 0;
            if (attr_form && a.npos < 1)
                return fail(r, f, ST_EINVAL, "`%.*s` needs an attribute", (int)nn, n);
            jv *test = a.npos > base ? a.pos[base] : NULL;
            jv *targ = a.npos > base + 1 ? a.pos[base + 1] : NULL;
            jv *o = mk_arr(r, V_ARRAY, v->u.a.n);
            if (!o || count_iter(r, f, v->u.a.n))
                return NULL;
            uint32_t k = 0;
            for (uint32_t i = 0; i < v->u.a.n; i++) {
                jv *item = v->u.a.v[i];
                jv *x = attr_form ? map_get(item->u.m, a.pos[0]->u.s.s, a.pos[0]->u.s.n) : item;
                int res = 0;
                if (x) {
                    if (test) {
                        if (run_test(r, f, test->u.s.s, test->u.s.n, x, targ, &res))
                            return NULL;
                    } else {
                        res = truthy(x);
                    }
                }
                if (res == sel)
                    o->u.a.v[k++] = item;
            }
            o->u.a.n = k;
            return o;
        }
        if (IS("map")) {
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            jv *attr = kwarg(&a, "attribute");
            if (!attr)
                return fail(r, f, ST_EINVAL, "`map` expressions without `attribute` set are not "
                                             "currently supported.");
            if (attr->t != V_STR)
                return fail(r, f, ST_EINVAL, "attribute must be a string");
            jv *dflt = kwarg(&a, "default");
            jv *o = mk_arr(r, V_ARRAY, v->u.a.n);
            if (!o || count_iter(r, f, v->u.a.n))
                return NULL;
            for (uint32_t i = 0; i < v->u.a.n; i++) {
                if (!is_container(v->u.a.v[i]))
                    return fail(r, f, ST_EINVAL, "items in map must be an object");
                jv *x = attr_path(r, v->u.a.v[i], attr->u.s.s, attr->u.s.n);
                o->u.a.v[i] = x->t == V_UNDEF && dflt ? dflt : x;
            }
            return o;
        }
        return fail(r, f, ST_EINVAL, "Unknown ArrayValue filter: %.*s", (int)nn, n);
    }
    if (v->t == V_STR) {
        if (IS("indent")) {
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            jv *w = arg_or(&a, 0, "width", NULL);
            if (w && w->t != V_INT)
                return fail(r, f, ST_EINVAL, "width must be a number");
            int64_t width = w ? w->u.i : 4;
            if (width < 0 || width > 1024)
                return fail(r, f, ST_EINVAL, "indent: width %lld is beyond 0..1024",
                            (long long)width);
            jv *first = arg_or(&a, 1, "first", BOOL(0));
            jv *blank = arg_or(&a, 2, "blank", BOOL(0));
            return indent_str(r, v, width, truthy(first), truthy(blank));
        }
        if (IS("replace")) {
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            jv *kw = a.kw;
            if (!kw && !(kw = mk_map(r, V_KWARGS)))
                return NULL;
            jargs b = a;
            b.kw = kw;
            jfn m = {.kind = FN_METHOD, .self = v, .name = "replace"};
            return call_method(r, f, &m, &b);
        }
        return fail(r, f, ST_EINVAL, "Unknown StringValue filter: %.*s", (int)nn, n);
    }
    if (is_map(v)) {
        jv *m = builtin_attr(r, v, n, nn);
        if (m && m->t == V_FUNC) {
            if (eval_args(r, f->list, f->nlist, env, &a))
                return NULL;
            return call_method(r, f, m->u.fn, &a);
        }
        return r->rc ? NULL
                     : fail(r, f, ST_EINVAL, "Unknown ObjectValue filter: %.*s", (int)nn, n);
    }
    return fail(r, f, ST_EINVAL, "Cannot apply filter \"%.*s\" to type: %s", (int)nn, n,
                type_names[v->t]);
#undef IS
}

/* ---- expressions -------------------------------------------------------------------------- */
static jv *arith_int(R *r, const st_jnode *x, int op, int64_t a, int64_t b)
{
    int64_t res;
    switch (op) {
    case JOP_ADD:
        if (__builtin_add_overflow(a, b, &res))
            goto overflow;
        return mk_int(r, res);
    case JOP_SUB:
        if (__builtin_sub_overflow(a, b, &res))
            goto overflow;
        return mk_int(r, res);
    case JOP_MUL:
        if (__builtin_mul_overflow(a, b, &res))
            goto overflow;
        return mk_int(r, res);
    case JOP_FLOORDIV:
        if (b == 0)
            return fail(r, x, ST_EINVAL, "integer division by zero");
        return mk_int(r, (int64_t)floor((double)a / (double)b));
    case JOP_MOD:
        if (b == 0)
            return fail(r, x, ST_EINVAL, "integer modulo by zero");
        if (b == -1)
            return mk_int(r, 0);
        return mk_int(r, a % b);
    }
overflow:
    return fail(r, x, ST_EINVAL, "integer overflow");
}

static jv *binary(R *r, const st_jnode *x, jenv *env)
{
    jv *l = ev(r, x->a, env);
    if (!l)
        return NULL;
    if (x->op == JOP_AND)
        return truthy(l) ? ev(r, x->b, env) : l;
    if (x->op == JOP_OR)
        return truthy(l) ? l : ev(r, x->b, env);
    jv *rt = ev(r, x->b, env);
    if (!rt)
        return NULL;
    int op = x->op;
    if (op == JOP_EQ || op == JOP_NE) {
        int eq = loose_eq(r, l, rt);
        return r->rc ? NULL : BOOL(op == JOP_EQ ? eq : !eq);
    }
    static const char *const opname[] = {"", "and", "or", "not", "in", "not in", "==", "!=",
                                         "<", ">", "<=", ">=", "+", "-", "~", "*", "/", "//",
                                         "%", "**"};
    if (l->t == V_UNDEF || rt->t == V_UNDEF) {
        if (rt->t == V_UNDEF && (op == JOP_IN || op == JOP_NOTIN))
            return BOOL(op == JOP_NOTIN);
        return fail(r, x, ST_EINVAL, "Cannot perform operation %s on undefined values",
                    opname[op]);
    }
    if (l->t == V_NULL || rt->t == V_NULL)
        return fail(r, x, ST_EINVAL, "Cannot perform operation on null values");
    if (op == JOP_CONCAT) {
        jbuf b = {0};
        if (raw_str(r, &b, l, x) || raw_str(r, &b, rt, x)) {
            free(b.p);
            return NULL;
        }
        return mk_str_buf(r, &b);
    }
    if (op == JOP_POW && (is_num(l) || l->t == V_BOOL) && (is_num(rt) || rt->t == V_BOOL)) {
        double a = num_of(l), b = num_of(rt);
        if (a == 0 && b < 0)
            return fail(r, x, ST_EINVAL, "0.0 cannot be raised to a negative power");
        double res = pow(a, b);
        if (!isfinite(res))
            return fail(r, x, ST_EINVAL, "Exponentiation result is not a finite real number");
        if (l->t == V_FLOAT || rt->t == V_FLOAT || b < 0)
            return mk_float(r, res);
        if (fabs(res) > 9.2e18)
            return fail(r, x, ST_EINVAL, "integer overflow");
        return mk_int(r, (int64_t)res);
    }
    if (is_num(l) && is_num(rt)) {
        int fl = l->t == V_FLOAT || rt->t == V_FLOAT;
        double a = num_of(l), b = num_of(rt);
        switch (op) {
        case JOP_ADD:
        case JOP_SUB:
        case JOP_MUL:
        case JOP_FLOORDIV:
        case JOP_MOD:
            if (!fl)
                return arith_int(r, x, op, l->u.i, rt->u.i);
            return mk_float(r, op == JOP_ADD   ? a + b
                               : op == JOP_SUB ? a - b
                               : op == JOP_MUL ? a * b
                               : op == JOP_MOD ? fmod(a, b)
                                               : floor(a / b));
        case JOP_DIV: return mk_float(r, a / b);
        case JOP_LT: return BOOL(a < b);
        case JOP_GT: return BOOL(a > b);
        case JOP_LE: return BOOL(a <= b);
        case JOP_GE: return BOOL(a >= b);
        }
    } else if (is_arr(l) && is_arr(rt)) {
        if (op == JOP_ADD) {
            jv *o = mk_arr(r, V_ARRAY, l->u.a.n + rt->u.a.n);
            if (!o)
                return NULL;
            if (l->u.a.n)
                memcpy(o->u.a.v, l->u.a.v, l->u.a.n * sizeof(jv *));
            if (rt->u.a.n)
                memcpy(o->u.a.v + l->u.a.n, rt->u.a.v, rt->u.a.n * sizeof(jv *));
            return o;
        }
    } else if (is_arr(rt)) {
        if (op == JOP_IN || op == JOP_NOTIN) {
            int member = 0;
            for (uint32_t i = 0; i < rt->u.a.n && !member; i++)
                member = strict_eq(rt->u.a.v[i], l);
            return BOOL(op == JOP_IN ? member : !member);
        }
    }
    if ((l->t == V_STR || rt->t == V_STR) && op == JOP_ADD) {
        jbuf b = {0};
        if (raw_str(r, &b, l, x) || raw_str(r, &b, rt, x)) {
            free(b.p);
            return NULL;
        }
        return mk_str_buf(r, &b);
    }
    if (l->t == V_STR && rt->t == V_STR && (op == JOP_IN || op == JOP_NOTIN)) {
        int in = str_find(rt->u.s.s, rt->u.s.n, l->u.s.s, l->u.s.n) != NULL;
        return BOOL(op == JOP_IN ? in : !in);
    }
    if (l->t == V_STR && is_map(rt) && (op == JOP_IN || op == JOP_NOTIN)) {
        int in = map_get(rt->u.m, l->u.s.s, l->u.s.n) != NULL;
        return BOOL(op == JOP_IN ? in : !in);
    }
    return fail(r, x, ST_EINVAL, "Unknown operator \"%s\" between %s and %s", opname[op],
                type_names[l->t], type_names[rt->t]);
}

/* Python-style slice over n items, as the reference's slice(). */
static int64_t *slice_indices(R *r, int64_t len, const jv *s0, const jv *s1, const jv *s2,
                              uint32_t *count)
{
    int64_t step = s2->t == V_INT ? s2->u.i : 1;
    int64_t start, stop;
    if (step >= 0) { /* a step of 0 selects nothing, as the reference's loop runs */
        start = s0->t == V_INT ? s0->u.i : 0;
        stop = s1->t == V_INT ? s1->u.i : len;
        start = start < 0 ? (len + start > 0 ? len + start : 0) : (start < len ? start : len);
        stop = stop < 0 ? (len + stop > 0 ? len + stop : 0) : (stop < len ? stop : len);
    } else {
        start = s0->t == V_INT ? s0->u.i : len - 1;
        stop = s1->t == V_INT ? s1->u.i : -1;
        start = start < 0 ? (len + start > -1 ? len + start : -1)
                          : (start < len - 1 ? start : len - 1);
        stop = stop < -1 ? (len + stop > -1 ? len + stop : -1) : (stop < len - 1 ? stop : len - 1);
    }
    uint32_t n = 0;
    int64_t *idx = ralloc(r, (size_t)(len + 1) * sizeof *idx);
    if (!idx)
        return NULL;
    for (int64_t i = start; step && (step > 0 ? i < stop : i > stop); i += step)
        idx[n++] = i;
    *count = n;
    return idx;
}

static jv *member(R *r, const st_jnode *x, jenv *env)
{
    jv *o = ev(r, x->a, env);
    if (!o)
        return NULL;
    const st_jnode *p = x->b;
    jv *prop;
    if (x->flag && p->kind == JN_SLICE) {
        if (!is_arr(o) && o->t != V_STR)
            return fail(r, x, ST_EINVAL, "Slice object must be an array or string");
        jv *s[3];
        const st_jnode *sp[3] = {p->a, p->b, p->c};
        for (int i = 0; i < 3; i++) {
            s[i] = sp[i] ? ev(r, sp[i], env) : UNDEF;
            if (!s[i])
                return NULL;
            if (s[i]->t != V_INT && s[i]->t != V_UNDEF)
                return fail(r, x, ST_EINVAL, "Slice %s must be numeric or undefined",
                            i == 0 ? "start" : i == 1 ? "stop" : "step");
        }
        size_t cps = 0, *off = NULL;
        int64_t len = is_arr(o) ? o->u.a.n : 0;
        if (o->t == V_STR) {
            if (!(off = cp_offsets(r, o->u.s.s, o->u.s.n, &cps)))
                return NULL;
            len = (int64_t)cps;
        }
        uint32_t cnt;
        int64_t *idx = slice_indices(r, len, s[0], s[1], s[2], &cnt);
        if (!idx)
            return r->rc ? NULL : fail(r, x, ST_EINVAL, "bad slice");
        if (r->rc)
            return NULL;
        if (is_arr(o)) {
            jv *out = mk_arr(r, V_ARRAY, cnt);
            for (uint32_t i = 0; out && i < cnt; i++)
                out->u.a.v[i] = o->u.a.v[idx[i]];
            return out;
        }
        jbuf b = {0};
        for (uint32_t i = 0; i < cnt && !r->rc; i++)
            buf_add(r, &b, o->u.s.s + off[idx[i]], off[idx[i] + 1] - off[idx[i]]);
        if (r->rc) {
            free(b.p);
            return NULL;
        }
        return mk_str_buf(r, &b);
    }
    if (x->flag) {
        if (!(prop = ev(r, p, env)))
            return NULL;
    } else if (p->kind == JN_INT) {
        if (!(prop = mk_int(r, p->i)))
            return NULL;
    } else {
        if (!(prop = mk_str(r, p->s, p->n)))
            return NULL;
    }
    if (is_container(o)) {
        if (prop->t != V_STR)
            return fail(r, x, ST_EINVAL, "Cannot access property with non-string: got %s",
                        type_names[prop->t]);
        jv *v = map_get(o->u.m, prop->u.s.s, prop->u.s.n);
        if (v)
            return v;
        return o->t == V_NS ? UNDEF : builtin_attr(r, o, prop->u.s.s, prop->u.s.n);
    }
    if (is_arr(o) || o->t == V_STR) {
        if (prop->t == V_INT) {
            int64_t i = prop->u.i;
            if (is_arr(o)) {
                if (i < 0)
                    i += o->u.a.n;
                return i >= 0 && i < (int64_t)o->u.a.n ? o->u.a.v[i] : UNDEF;
            }
            size_t cps, *off = cp_offsets(r, o->u.s.s, o->u.s.n, &cps);
            if (!off)
                return NULL;
            if (i < 0)
                i += (int64_t)cps;
            if (i < 0 || i >= (int64_t)cps)
                return UNDEF;
            return mk_str(r, o->u.s.s + off[i], off[i + 1] - off[i]);
        }
        if (prop->t == V_STR)
            return builtin_attr(r, o, prop->u.s.s, prop->u.s.n);
        return fail(r, x, ST_EINVAL, "Cannot access property with non-string/non-number: got %s",
                    type_names[prop->t]);
    }
    if (prop->t != V_STR)
        return fail(r, x, ST_EINVAL, "Cannot access property with non-string: got %s",
                    type_names[prop->t]);
    return UNDEF;
}

static jv *ev(R *r, const st_jnode *x, jenv *env)
{
    if (r->rc)
        return NULL;
    if (!x)
        return UNDEF;
    switch (x->kind) {
    case JN_STR: return mk_str(r, x->s, x->n);
    case JN_INT: return mk_int(r, x->i);
    case JN_FLOAT: return mk_float(r, x->f);
    case JN_IDENT: return env_lookup(env, x->s, x->n);
    case JN_ARRAY:
    case JN_TUPLE: {
        jv *a = mk_arr(r, x->kind == JN_ARRAY ? V_ARRAY : V_TUPLE, x->nlist);
        for (uint32_t i = 0; a && i < x->nlist; i++)
            if (!(a->u.a.v[i] = ev(r, x->list[i], env)))
                return NULL;
        return a;
    }
    case JN_OBJECT: {
        jv *o = mk_map(r, V_OBJECT);
        for (uint32_t i = 0; o && i + 1 < x->nlist; i += 2) {
            jv *k = ev(r, x->list[i], env);
            if (!k)
                return NULL;
            if (k->t != V_STR)
                return fail(r, x->list[i], ST_EINVAL, "Object keys must be strings: got %s",
                            type_names[k->t]);
            jv *v = ev(r, x->list[i + 1], env);
            if (!v || map_set(r, o->u.m, k->u.s.s, k->u.s.n, v))
                return NULL;
        }
        return o;
    }
    case JN_MEMBER: return member(r, x, env);
    case JN_CALL: {
        jargs a;
        if (eval_args(r, x->list, x->nlist, env, &a))
            return NULL;
        if (a.kw) {
            jv **np = ralloc(r, (a.npos + 1) * sizeof *np);
            if (!np)
                return NULL;
            if (a.npos)
                memcpy(np, a.pos, a.npos * sizeof *np);
            a.pos = np;
        }
        jv *fn = ev(r, x->a, env);
        if (!fn)
            return NULL;
        /* functions of the reference take the keyword arguments as a last positional one;
         * only methods and macros read them by name here */
        if (fn->t == V_FUNC && a.kw && fn->u.fn->kind == FN_RAISE && !a.npos)
            a.pos[a.npos++] = a.kw;
        return call_fn(r, x, fn, &a, env);
    }
    case JN_BINARY: return binary(r, x, env);
    case JN_UNARY: {
        jv *v = ev(r, x->a, env);
        if (!v)
            return NULL;
        if (x->op == JOP_NOT)
            return BOOL(!truthy(v));
        if (v->t == V_INT || v->t == V_BOOL) {
            int64_t i = v->t == V_BOOL ? v->u.b : v->u.i;
            if (x->op == JOP_SUB && i == INT64_MIN)
                return fail(r, x, ST_EINVAL, "integer overflow");
            return mk_int(r, x->op == JOP_SUB ? -i : i);
        }
        if (v->t == V_FLOAT)
            return mk_float(r, x->op == JOP_SUB ? -v->u.f : v->u.f);
        return fail(r, x, ST_EINVAL, "Unknown operator \"%c\" for %s", x->op == JOP_SUB ? '-' : '+',
                    type_names[v->t]);
    }
    case JN_FILTER: {
        jv *v = ev(r, x->a, env);
        return v ? apply_filter(r, v, x->b, env) : NULL;
    }
    case JN_TEST: {
        jv *v = ev(r, x->a, env);
        int res;
        if (!v || run_test(r, x, x->s, x->n, v, NULL, &res))
            return NULL;
        return BOOL(x->flag ? !res : res);
    }
    case JN_SELECT: {
        jv *c = ev(r, x->b, env);
        if (!c)
            return NULL;
        return truthy(c) ? ev(r, x->a, env) : UNDEF;
    }
    case JN_TERNARY: {
        jv *c = ev(r, x->a, env);
        if (!c)
            return NULL;
        return ev(r, truthy(c) ? x->b : x->c, env);
    }
    case JN_KWARG:
    case JN_SPREAD:
    case JN_KWSPREAD:
    case JN_SLICE:
        return fail(r, x, ST_EINVAL, "unexpected argument form here");
    }
    return fail(r, x, ST_EINVAL, "a statement where an expression belongs");
}

/* ---- statements --------------------------------------------------------------------------- */
static int assign(R *r, const st_jnode *target, jv *v, jenv *env)
{
    if (target->kind == JN_IDENT)
        return map_set(r, &env->vars, target->s, target->n, v);
    if (target->kind == JN_TUPLE) {
        if (!is_arr(v)) {
            fail(r, target, ST_EINVAL, "Cannot unpack non-iterable type in set: %s",
                 type_names[v->t]);
            return r->rc;
        }
        if (v->u.a.n != target->nlist) {
            fail(r, target, ST_EINVAL, "Too %s items to unpack in set",
                 target->nlist > v->u.a.n ? "few" : "many");
            return r->rc;
        }
        for (uint32_t i = 0; i < target->nlist; i++) {
            if (target->list[i]->kind != JN_IDENT) {
                fail(r, target->list[i], ST_EINVAL, "Cannot unpack to non-identifier in set");
                return r->rc;
            }
            if (map_set(r, &env->vars, target->list[i]->s, target->list[i]->n, v->u.a.v[i]))
                return r->rc;
        }
        return 0;
    }
    if (target->kind == JN_MEMBER) {
        jv *o = ev(r, target->a, env);
        if (!o)
            return r->rc;
        if (o->t != V_NS) {
            fail(r, target, ST_EINVAL, "cannot assign attribute on non-namespace object");
            return r->rc;
        }
        if (target->flag || target->b->kind != JN_IDENT) {
            fail(r, target, ST_EINVAL, "Cannot assign to member with non-identifier property");
            return r->rc;
        }
        return map_set(r, o->u.m, target->b->s, target->b->n, v);
    }
    fail(r, target, ST_EINVAL, "Invalid LHS inside assignment expression");
    return r->rc;
}

static int bind_loopvar(R *r, const st_jnode *lv, jv *cur, jenv *scope)
{
    if (lv->kind == JN_IDENT)
        return map_set(r, &scope->vars, lv->s, lv->n, cur);
    if (cur->t != V_ARRAY) {
        fail(r, lv, ST_EINVAL, "Cannot unpack non-iterable type: %s", type_names[cur->t]);
        return r->rc;
    }
    if (cur->u.a.n != lv->nlist) {
        fail(r, lv, ST_EINVAL, "Too %s items to unpack", lv->nlist > cur->u.a.n ? "few" : "many");
        return r->rc;
    }
    for (uint32_t j = 0; j < lv->nlist; j++) {
        if (lv->list[j]->kind != JN_IDENT) {
            fail(r, lv->list[j], ST_EINVAL, "Cannot unpack non-identifier type");
            return r->rc;
        }
        if (map_set(r, &scope->vars, lv->list[j]->s, lv->list[j]->n, cur->u.a.v[j]))
            return r->rc;
    }
    return 0;
}

static int eval_for(R *r, const st_jnode *x, jenv *env, jbuf *out)
{
    jenv *scope = env_new(r, env);
    if (!scope)
        return r->rc;
    const st_jnode *test = NULL, *it = x->b;
    if (it->kind == JN_SELECT) {
        test = it->b;
        it = it->a;
    }
    jv *iter = ev(r, it, scope);
    if (!iter)
        return r->rc;
    if (is_map(iter)) {
        if (!(iter = map_items(r, iter, 1)))
            return r->rc;
    } else if (!is_arr(iter)) {
        fail(r, x, ST_EINVAL, "Expected iterable or object type in for loop: got %s",
             type_names[iter->t]);
        return r->rc;
    }
    uint32_t n = iter->u.a.n;
    jv **items = n ? ralloc(r, n * sizeof *items) : NULL;
    if (n && !items)
        return r->rc;
    uint32_t k = 0;
    for (uint32_t i = 0; i < n; i++) {
        jv *cur = iter->u.a.v[i];
        if (x->a->kind == JN_TUPLE && cur->t != V_ARRAY) {
            fail(r, x->a, ST_EINVAL, "Cannot unpack non-iterable type: %s", type_names[cur->t]);
            return r->rc;
        }
        if (x->a->kind == JN_TUPLE && cur->u.a.n != x->a->nlist) {
            fail(r, x->a, ST_EINVAL, "Too %s items to unpack",
                 x->a->nlist > cur->u.a.n ? "few" : "many");
            return r->rc;
        }
        if (test) {
            if (count_iter(r, x, 1))
                return r->rc;
            jenv *ls = env_new(r, scope);
            if (!ls || bind_loopvar(r, x->a, cur, ls))
                return r->rc;
            jv *t = ev(r, test, ls);
            if (!t)
                return r->rc;
            if (!truthy(t))
                continue;
        }
        items[k++] = cur;
    }
    int none = 1;
    for (uint32_t i = 0; i < k; i++) {
        if (count_iter(r, x, 1))
            return r->rc;
        jv *loop = mk_map(r, V_OBJECT);
        if (!loop)
            return r->rc;
        jmap *m = loop->u.m;
        if (map_set(r, m, "index", 5, mk_int(r, i + 1)) ||
            map_set(r, m, "index0", 6, mk_int(r, i)) ||
            map_set(r, m, "revindex", 8, mk_int(r, k - i)) ||
            map_set(r, m, "revindex0", 9, mk_int(r, k - i - 1)) ||
            map_set(r, m, "first", 5, BOOL(i == 0)) ||
            map_set(r, m, "last", 4, BOOL(i == k - 1)) ||
            map_set(r, m, "length", 6, mk_int(r, k)) ||
            map_set(r, m, "previtem", 8, i > 0 ? items[i - 1] : UNDEF) ||
            map_set(r, m, "nextitem", 8, i + 1 < k ? items[i + 1] : UNDEF) || r->rc)
            return r->rc;
        if (map_set(r, &scope->vars, "loop", 4, loop) || bind_loopvar(r, x->a, items[i], scope))
            return r->rc;
        size_t mark = out->n;
        eval_block(r, x->list, x->nlist, scope, out);
        if (r->rc == JRC_CONTINUE || r->rc == JRC_BREAK) {
            /* the iteration's output is lost with the control exception, as in the reference */
            int brk = r->rc == JRC_BREAK;
            r->rc = 0;
            r->err[0] = 0;
            out->n = mark;
            if (out->p)
                out->p[mark] = 0;
            if (brk)
                break;
            continue;
        }
        if (r->rc)
            return r->rc;
        none = 0;
    }
    if (none)
        eval_block(r, x->list2, x->nlist2, scope, out);
    return r->rc;
}

static int eval_stmt(R *r, const st_jnode *x, jenv *env, jbuf *out)
{
    switch (x->kind) {
    case JN_COMMENT: return 0;
    case JN_STR: return buf_add(r, out, x->s, x->n);
    case JN_IF: {
        jv *t = ev(r, x->a, env);
        if (!t)
            return r->rc;
        return truthy(t) ? eval_block(r, x->list, x->nlist, env, out)
                         : eval_block(r, x->list2, x->nlist2, env, out);
    }
    case JN_FOR: return eval_for(r, x, env, out);
    case JN_SET: {
        jv *v;
        if (x->b) {
            v = ev(r, x->b, env);
        } else {
            jbuf b = {0};
            if (eval_block(r, x->list, x->nlist, env, &b)) {
                free(b.p);
                return r->rc;
            }
            v = mk_str_buf(r, &b);
        }
        if (!v)
            return r->rc;
        return assign(r, x->a, v, env);
    }
    case JN_MACRO: {
        jv *m = mk_macro(r, FN_MACRO, x, NULL);
        return m ? map_set(r, &env->vars, x->s, x->n, m) : r->rc;
    }
    case JN_CALLBLK: {
        jv *caller = mk_macro(r, FN_CALLER, x, env);
        if (!caller)
            return r->rc;
        const st_jnode *call = x->a;
        jargs a;
        if (eval_args(r, call->list, call->nlist, env, &a))
            return r->rc;
        jv *fn = ev(r, call->a, env);
        if (!fn)
            return r->rc;
        jenv *ne = env_new(r, env);
        if (!ne || map_set(r, &ne->vars, "caller", 6, caller))
            return r->rc;
        jv *v = call_fn(r, call, fn, &a, ne);
        if (!v)
            return r->rc;
        if (v->t == V_NULL || v->t == V_UNDEF)
            return 0;
        return tpl_str(r, out, v, x);
    }
    case JN_FILTERBLK: {
        jbuf b = {0};
        if (eval_block(r, x->list, x->nlist, env, &b)) {
            free(b.p);
            return r->rc;
        }
        jv *s = mk_str_buf(r, &b);
        jv *v = s ? apply_filter(r, s, x->b, env) : NULL;
        if (!v)
            return r->rc;
        if (v->t == V_NULL || v->t == V_UNDEF)
            return 0;
        return tpl_str(r, out, v, x);
    }
    case JN_BREAK: return r->rc = JRC_BREAK;
    case JN_CONTINUE: return r->rc = JRC_CONTINUE;
    default: {
        jv *v = ev(r, x, env);
        if (!v)
            return r->rc;
        if (v->t == V_NULL || v->t == V_UNDEF)
            return 0;
        return tpl_str(r, out, v, x);
    }
    }
}

static int eval_block(R *r, st_jnode *const *body, uint32_t n, jenv *env, jbuf *out)
{
    for (uint32_t i = 0; i < n && !r->rc; i++)
        eval_stmt(r, body[i], env, out);
    return r->rc;
}

/* ---- values from JSON --------------------------------------------------------------------- */
static int is_array_index(const char *k, size_t n, uint32_t *idx)
{
    if (n == 0 || n > 10 || (n > 1 && k[0] == '0'))
        return 0;
    uint64_t v = 0;
    for (size_t i = 0; i < n; i++) {
        if (k[i] < '0' || k[i] > '9')
            return 0;
        v = v * 10 + (uint64_t)(k[i] - '0');
    }
    if (v >= 4294967295u)
        return 0;
    *idx = (uint32_t)v;
    return 1;
}

static jv *from_json(R *r, const json_t *j, int depth)
{
    if (depth > JSON_MAX_DEPTH)
        return fail(r, NULL, ST_ETOOBIG, "conversation nested deeper than %d", JSON_MAX_DEPTH);
    switch (json_typeof(j)) {
    case JSON_NULL: return NUL;
    case JSON_TRUE: return BOOL(1);
    case JSON_FALSE: return BOOL(0);
    case JSON_INTEGER: {
        /* JavaScript holds numbers as doubles: beyond 2^53 an integer is the nearest one */
        json_int_t v = json_integer_value(j);
        if (v > (json_int_t)1 << 53 || v < -((json_int_t)1 << 53)) {
            double d = (double)v;
            return d >= 9223372036854775808.0 ? mk_float(r, d) : mk_int(r, (int64_t)d);
        }
        return mk_int(r, v);
    }
    case JSON_REAL: {
        double d = json_real_value(j);
        /* JavaScript has one number type: an integral value is an IntegerValue */
        if (d == floor(d) && fabs(d) < 9007199254740992.0)
            return mk_int(r, (int64_t)d);
        return mk_float(r, d);
    }
    case JSON_STRING: return mk_str(r, json_string_value(j), json_string_length(j));
    case JSON_ARRAY: {
        size_t n = json_array_size(j);
        if (n > UINT32_MAX / 2)
            return fail(r, NULL, ST_ETOOBIG, "an array of %zu items", n);
        jv *a = mk_arr(r, V_ARRAY, (uint32_t)n);
        for (size_t i = 0; a && i < n; i++)
            if (!(a->u.a.v[i] = from_json(r, json_array_get(j, i), depth + 1)))
                return NULL;
        return a;
    }
    case JSON_OBJECT: {
        jv *o = mk_map(r, V_OBJECT);
        if (!o)
            return NULL;
        /* Object.entries order: array-index keys first, ascending, then insertion order */
        size_t n = json_object_size(j), k = 0;
        const char **keys = n ? ralloc(r, n * sizeof *keys) : NULL;
        size_t *lens = n ? ralloc(r, n * sizeof *lens) : NULL;
        uint32_t *idx = n ? ralloc(r, n * sizeof *idx) : NULL;
        uint8_t *isidx = n ? ralloc(r, n) : NULL;
        if (n && (!keys || !lens || !idx || !isidx))
            return NULL;
        const char *key;
        size_t kl;
        json_t *val;
        void *tmp;
        json_object_keylen_foreach_safe((json_t *)j, tmp, key, kl, val)
        {
            (void)val;
            keys[k] = key;
            lens[k] = kl;
            isidx[k] = (uint8_t)is_array_index(key, kl, &idx[k]);
            k++;
        }
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 0) {
                /* selection by ascending index: few such keys in practice */
                uint32_t last = 0;
                int have = 0;
                for (;;) {
                    int64_t best = -1;
                    for (size_t i = 0; i < k; i++)
                        if (isidx[i] && (!have || idx[i] > last) &&
                            (best < 0 || idx[i] < idx[best]))
                            best = (int64_t)i;
                    if (best < 0)
                        break;
                    have = 1;
                    last = idx[best];
                    jv *v = from_json(r, json_object_getn(j, keys[best], lens[best]), depth + 1);
                    if (!v || map_set(r, o->u.m, keys[best], lens[best], v))
                        return NULL;
                }
            } else {
                for (size_t i = 0; i < k; i++) {
                    if (isidx[i])
                        continue;
                    jv *v = from_json(r, json_object_getn(j, keys[i], lens[i]), depth + 1);
                    if (!v || map_set(r, o->u.m, keys[i], lens[i], v))
                        return NULL;
                }
            }
        }
        return o;
    }
    }
    return fail(r, NULL, ST_EINVAL, "unknown JSON type");
}

/* ---- entry -------------------------------------------------------------------------------- */
void st_jinja_limits_default(st_jinja_limits *l)
{
    l->max_iterations = 1000000;
    l->max_depth = 64;
    l->max_output = 16u << 20;
    l->max_memory = 256u << 20;
}

static jv *mk_global_fn(R *r, int kind)
{
    jv *v = mk(r, V_FUNC);
    jfn *f = ralloc(r, sizeof *f);
    if (!v || !f)
        return NULL;
    f->kind = kind;
    v->u.fn = f;
    return v;
}

int st_jinja_render(const st_jinja *t, const struct json_t *vars, const st_jinja_limits *lim,
                    char **out, size_t *out_len)
{
    *out = NULL;
    if (out_len)
        *out_len = 0;
    R *r = calloc(1, sizeof *r);
    if (!r)
        return st_error_set(ENOMEM, "chat template: out of memory");
    r->t = t;
    if (lim)
        r->lim = *lim;
    else
        st_jinja_limits_default(&r->lim);
    r->arena.cap = r->lim.max_memory;
    jbuf b = {0};
    jenv *g = env_new(r, NULL);
    if (g) {
        static const struct { const char *name; int kind; } fns[] = {
            {"namespace", FN_NAMESPACE}, {"raise_exception", FN_RAISE}, {"range", FN_RANGE},
            {"strftime_now", FN_STRFTIME},
        };
        static const struct { const char *name; jv *v; } consts[] = {
            {"false", &V_FALSE_}, {"true", &V_TRUE_}, {"none", &V_NULL_}, {"True", &V_TRUE_},
            {"False", &V_FALSE_}, {"None", &V_NULL_},
        };
        for (size_t i = 0; i < sizeof fns / sizeof fns[0] && !r->rc; i++) {
            jv *f = mk_global_fn(r, fns[i].kind);
            if (f)
                map_set(r, &g->vars, fns[i].name, strlen(fns[i].name), f);
        }
        for (size_t i = 0; i < sizeof consts / sizeof consts[0] && !r->rc; i++)
            map_set(r, &g->vars, consts[i].name, strlen(consts[i].name), consts[i].v);
    }
    if (!r->rc && vars) {
        if (!json_is_object(vars)) {
            fail(r, NULL, ST_EINVAL, "the variables must be a JSON object");
        } else {
            jv *o = from_json(r, vars, 0);
            for (uint32_t i = 0; o && i < o->u.m->n && !r->rc; i++) {
                if (map_get(&g->vars, o->u.m->k[i], o->u.m->kn[i])) {
                    fail(r, NULL, ST_EINVAL, "Variable already declared: %.*s",
                         (int)o->u.m->kn[i], o->u.m->k[i]);
                    break;
                }
                map_set(r, &g->vars, o->u.m->k[i], o->u.m->kn[i], o->u.m->v[i]);
            }
        }
    }
    if (!r->rc)
        eval_block(r, t->body, t->nbody, g, &b);
    if (r->rc == JRC_BREAK || r->rc == JRC_CONTINUE) {
        r->rc = 0;
        fail(r, NULL, ST_EINVAL, "break or continue outside a loop");
    }
    int rc = r->rc;
    if (rc) {
        st_error_set(rc, "%s", r->err);
        free(b.p);
    } else {
        if (!b.p && !(b.p = malloc(1))) {
            rc = st_error_set(ENOMEM, "chat template: out of memory");
        } else {
            if (!b.n)
                b.p[0] = 0;
            *out = b.p;
            if (out_len)
                *out_len = b.n;
        }
    }
    st_jarena_free(&r->arena);
    free(r);
    return rc;
}
