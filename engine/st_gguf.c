/*
 * st_gguf.c - GGUF reader (mmap, every field checked) and writer (v3, atomic).
 *
 * Reader invariants, established by st_gguf_parse before a handle is returned:
 * 1. Every key and tensor name lies inside the buffer; keys are unique and non-empty, tensor
 *    names are unique, non-empty and NUL-free (a NUL-terminated copy is kept).
 * 2. Every value (arrays included, nested to ST_GGUF_NEST_MAX) lies inside the header region that
 *    was walked; counts were checked against the bytes that remain before anything was allocated.
 * 3. The alignment is general.alignment (a u32 power of two) or 32; the data section starts at
 *    the header end rounded up to it and lies inside the buffer.
 * 4. Every tensor has 1..4 dimensions >= 1 whose product does not overflow, a known ggml type
 *    whose block size divides ne[0], an offset that is a multiple of the alignment, and bytes
 *    [offset, offset + nbytes) inside the data section, not overlapping any other tensor.
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_engine.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" little-endian */
#define ST_GGUF_NEST_MAX 4

/* ---- ggml type table --------------------------------------------------------------------- */
typedef struct ggml_type_info {
    const char *name;
    uint32_t block;  /* elements per block (0: no such type) */
    uint32_t bytes;  /* bytes per block */
} ggml_type_info;

static const ggml_type_info k_types[] = {
    [0] = {"f32", 1, 4},        [1] = {"f16", 1, 2},         [2] = {"q4_0", 32, 18},
    [3] = {"q4_1", 32, 20},     [6] = {"q5_0", 32, 22},      [7] = {"q5_1", 32, 24},
    [8] = {"q8_0", 32, 34},     [9] = {"q8_1", 32, 36},      [10] = {"q2_K", 256, 84},
    [11] = {"q3_K", 256, 110},  [12] = {"q4_K", 256, 144},   [13] = {"q5_K", 256, 176},
    [14] = {"q6_K", 256, 210},  [15] = {"q8_K", 256, 292},   [16] = {"iq2_xxs", 256, 66},
    [17] = {"iq2_xs", 256, 74}, [18] = {"iq3_xxs", 256, 98}, [19] = {"iq1_s", 256, 50},
    [20] = {"iq4_nl", 32, 18},  [21] = {"iq3_s", 256, 110},  [22] = {"iq2_s", 256, 82},
    [23] = {"iq4_xs", 256, 136}, [24] = {"i8", 1, 1},        [25] = {"i16", 1, 2},
    [26] = {"i32", 1, 4},       [27] = {"i64", 1, 8},        [28] = {"f64", 1, 8},
    [29] = {"iq1_m", 256, 56},  [30] = {"bf16", 1, 2},       [34] = {"tq1_0", 256, 54},
    [35] = {"tq2_0", 256, 66},  [39] = {"mxfp4", 32, 17},
};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

static const ggml_type_info *type_info(uint32_t t)
{
    if (t >= N_TYPES || k_types[t].block == 0)
        return NULL;
    return &k_types[t];
}

const char *st_gguf_type_name(uint32_t t)
{
    const ggml_type_info *ti = type_info(t);
    return ti ? ti->name : "unknown";
}

static const char *const k_kv_names[] = {"u8",  "i8",     "u16",  "i16", "u32", "i32", "f32",
                                         "bool", "string", "array", "u64", "i64", "f64"};

const char *st_gguf_kv_type_name(uint32_t t)
{
    return t < sizeof k_kv_names / sizeof k_kv_names[0] ? k_kv_names[t] : "unknown";
}

/* Size of a fixed-size value type, 0 for string / array / unknown. */
static size_t kv_fixed_size(uint32_t t)
{
    switch (t) {
    case ST_GGUF_UINT8: case ST_GGUF_INT8: case ST_GGUF_BOOL: return 1;
    case ST_GGUF_UINT16: case ST_GGUF_INT16: return 2;
    case ST_GGUF_UINT32: case ST_GGUF_INT32: case ST_GGUF_FLOAT32: return 4;
    case ST_GGUF_UINT64: case ST_GGUF_INT64: case ST_GGUF_FLOAT64: return 8;
    default: return 0;
    }
}

/* ---- reader ---------------------------------------------------------------------------- */
typedef struct gguf_kv {
    const uint8_t *key;
    uint64_t key_len;
    uint32_t type;
    uint32_t elem_type; /* arrays */
    uint64_t count;     /* arrays */
    const uint8_t *val; /* value bytes (array: first element) */
    char *key_z;        /* NUL-terminated copy */
} gguf_kv;

struct st_gguf {
    const uint8_t *buf;
    size_t len;
    int mapped;
    uint32_t version;
    uint32_t alignment;
    uint64_t n_kv, n_tensors;
    gguf_kv *kv;
    st_gguf_tensor *tensors;
    uint64_t data_off;
    char *path;           /* st_gguf_open's path (NULL for a buffer) */
    struct st_gguf **part; /* a split model: parts 2..n_part, each mapped (split_open) */
    uint32_t n_part;      /* 1 unless split */
};

typedef struct cursor {
    const uint8_t *p;
    size_t off, len;
} cursor;

static int cur_need(cursor *c, uint64_t n, const char *what)
{
    if (n > c->len - c->off)
        return st_error_set(ST_ECORRUPT, "gguf: %s at offset %zu needs %llu bytes, %zu remain",
                            what, c->off, (unsigned long long)n, c->len - c->off);
    return 0;
}

static int cur_u32(cursor *c, uint32_t *v, const char *what)
{
    int rc = cur_need(c, 4, what);
    if (rc)
        return rc;
    memcpy(v, c->p + c->off, 4);
    c->off += 4;
    return 0;
}

static int cur_u64(cursor *c, uint64_t *v, const char *what)
{
    int rc = cur_need(c, 8, what);
    if (rc)
        return rc;
    memcpy(v, c->p + c->off, 8);
    c->off += 8;
    return 0;
}

static int cur_str(cursor *c, const uint8_t **s, uint64_t *n, const char *what)
{
    int rc = cur_u64(c, n, what);
    if (rc)
        return rc;
    if ((rc = cur_need(c, *n, what)))
        return rc;
    *s = c->p + c->off;
    c->off += (size_t)*n;
    return 0;
}

/* Skip one value of type t, checking it lies in the buffer. */
static int skip_value(cursor *c, uint32_t t, int depth, const char *key)
{
    size_t fs = kv_fixed_size(t);
    int rc;
    if (fs) {
        if ((rc = cur_need(c, fs, key)))
            return rc;
        c->off += fs;
        return 0;
    }
    if (t == ST_GGUF_STRING) {
        const uint8_t *s;
        uint64_t n;
        return cur_str(c, &s, &n, key);
    }
    if (t != ST_GGUF_ARRAY)
        return st_error_set(ST_ECORRUPT, "gguf: key \"%.64s\": unknown value type %u at offset %zu",
                            key, t, c->off);
    if (depth >= ST_GGUF_NEST_MAX)
        return st_error_set(ST_ECORRUPT, "gguf: key \"%.64s\": arrays nested deeper than %d", key,
                            ST_GGUF_NEST_MAX);
    uint32_t et;
    uint64_t cnt;
    rc = cur_u32(c, &et, key);
    if (!rc)
        rc = cur_u64(c, &cnt, key);
    if (rc)
        return rc;
    size_t efs = kv_fixed_size(et);
    if (efs) {
        if (cnt > (c->len - c->off) / efs)
            return st_error_set(ST_ECORRUPT, "gguf: key \"%.64s\": array of %llu %s exceeds the %zu "
                                "bytes that remain", key, (unsigned long long)cnt,
                                st_gguf_kv_type_name(et), c->len - c->off);
        c->off += (size_t)cnt * efs;
        return 0;
    }
    if (et != ST_GGUF_STRING && et != ST_GGUF_ARRAY)
        return st_error_set(ST_ECORRUPT, "gguf: key \"%.64s\": unknown array element type %u", key,
                            et);
    /* every string or array element takes at least 8 bytes */
    if (cnt > (c->len - c->off) / 8)
        return st_error_set(ST_ECORRUPT, "gguf: key \"%.64s\": array of %llu elements exceeds the "
                            "%zu bytes that remain", key, (unsigned long long)cnt, c->len - c->off);
    for (uint64_t i = 0; i < cnt; i++)
        if ((rc = skip_value(c, et, depth + 1, key)))
            return rc;
    return 0;
}

void st_gguf_close(st_gguf *g)
{
    if (!g)
        return;
    if (g->kv)
        for (uint64_t i = 0; i < g->n_kv; i++)
            free(g->kv[i].key_z);
    free(g->kv);
    if (g->tensors)
        for (uint64_t i = 0; i < g->n_tensors; i++)
            free((char *)g->tensors[i].name);
    free(g->tensors);
    if (g->part)
        for (uint32_t i = 0; i + 1 < g->n_part; i++)
            st_gguf_close(g->part[i]);
    free(g->part);
    free(g->path);
    if (g->mapped && g->buf)
        munmap((void *)g->buf, g->len);
    free(g);
}

static int cmp_off(const void *a, const void *b)
{
    const st_gguf_tensor *x = *(const st_gguf_tensor *const *)a;
    const st_gguf_tensor *y = *(const st_gguf_tensor *const *)b;
    return x->offset < y->offset ? -1 : x->offset > y->offset;
}

static int parse(st_gguf *g)
{
    cursor c = {g->buf, 0, g->len};
    uint32_t magic;
    int rc;
    const st_gguf_tensor **order = NULL;
    if (g->len < 4 || (memcpy(&magic, g->buf, 4), magic != GGUF_MAGIC))
        return st_error_set(ST_ENOTSTRATA, "gguf: bad magic (not a GGUF file)");
    c.off = 4;
    if ((rc = cur_u32(&c, &g->version, "header version")))
        return rc;
    if (g->version != 2 && g->version != 3) {
        if ((g->version & 0xffff) == 0 && g->version != 0)
            return st_error_set(ST_EVERSION, "gguf: big-endian file (version field 0x%08x) is not "
                                "supported", g->version);
        return st_error_set(ST_EVERSION, "gguf: version %u not supported (2 and 3 are)",
                            g->version);
    }
    if ((rc = cur_u64(&c, &g->n_tensors, "header tensor_count")) ||
        (rc = cur_u64(&c, &g->n_kv, "header metadata_kv_count")))
        return rc;
    /* each KV takes >= 8 (key length) + 1 (key) + 4 (type) + 1 bytes; each tensor >= 8+1+4+8+4+8 */
    if (g->n_kv > (c.len - c.off) / 14)
        return st_error_set(ST_ECORRUPT, "gguf: metadata_kv_count %llu exceeds what the %zu "
                            "remaining bytes can hold", (unsigned long long)g->n_kv,
                            c.len - c.off);
    if (g->n_tensors > (c.len - c.off) / 33)
        return st_error_set(ST_ECORRUPT, "gguf: tensor_count %llu exceeds what the %zu remaining "
                            "bytes can hold", (unsigned long long)g->n_tensors, c.len - c.off);
    g->kv = calloc(g->n_kv ? g->n_kv : 1, sizeof *g->kv);
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *g->tensors);
    if (!g->kv || !g->tensors)
        return st_error_set(ENOMEM, "gguf: allocating %llu keys and %llu tensors",
                            (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors);
    g->alignment = ST_GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        gguf_kv *kv = &g->kv[i];
        size_t at = c.off;
        if ((rc = cur_str(&c, &kv->key, &kv->key_len, "metadata key")))
            return rc;
        if (kv->key_len == 0 || kv->key_len > 65535 || memchr(kv->key, 0, kv->key_len))
            return st_error_set(ST_ECORRUPT, "gguf: metadata key %llu at offset %zu: empty, longer "
                                "than 65535 bytes or containing NUL", (unsigned long long)i, at);
        kv->key_z = strndup((const char *)kv->key, kv->key_len);
        if (!kv->key_z)
            return st_error_set(ENOMEM, "gguf: key copy");
        for (uint64_t j = 0; j < i; j++)
            if (g->kv[j].key_len == kv->key_len && !memcmp(g->kv[j].key, kv->key, kv->key_len))
                return st_error_set(ST_ECORRUPT, "gguf: duplicate metadata key \"%.64s\"",
                                    kv->key_z);
        if ((rc = cur_u32(&c, &kv->type, kv->key_z)))
            return rc;
        if (kv->type == ST_GGUF_ARRAY) {
            size_t save = c.off;
            if ((rc = cur_u32(&c, &kv->elem_type, kv->key_z)) ||
                (rc = cur_u64(&c, &kv->count, kv->key_z)))
                return rc;
            kv->val = c.p + c.off;
            c.off = save;
        } else {
            kv->val = c.p + c.off;
        }
        if ((rc = skip_value(&c, kv->type, 0, kv->key_z)))
            return rc;
        if (!strcmp(kv->key_z, "general.alignment")) {
            uint32_t a;
            if (kv->type != ST_GGUF_UINT32)
                return st_error_set(ST_ECORRUPT, "gguf: general.alignment has type %s, not u32",
                                    st_gguf_kv_type_name(kv->type));
            memcpy(&a, kv->val, 4);
            if (a == 0 || (a & (a - 1)) || a > (1u << 20))
                return st_error_set(ST_ECORRUPT, "gguf: general.alignment %u is not a power of two "
                                    "in 1..1048576", a);
            g->alignment = a;
        }
    }
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        st_gguf_tensor *t = &g->tensors[i];
        const uint8_t *name;
        uint64_t name_len;
        size_t at = c.off;
        if ((rc = cur_str(&c, &name, &name_len, "tensor name")))
            return rc;
        if (name_len == 0 || name_len > 255 || memchr(name, 0, name_len))
            return st_error_set(ST_ECORRUPT, "gguf: tensor %llu at offset %zu: name empty, longer "
                                "than 255 bytes or containing NUL", (unsigned long long)i, at);
        t->name = strndup((const char *)name, name_len);
        if (!t->name)
            return st_error_set(ENOMEM, "gguf: tensor name copy");
        if ((rc = cur_u32(&c, &t->n_dims, t->name)))
            return rc;
        if (t->n_dims < 1 || t->n_dims > ST_GGUF_MAX_DIMS)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": %u dimensions (1..%d)", t->name,
                                t->n_dims, ST_GGUF_MAX_DIMS);
        uint64_t ne = 1;
        for (uint32_t d = 0; d < t->n_dims; d++) {
            if ((rc = cur_u64(&c, &t->dims[d], t->name)))
                return rc;
            if (t->dims[d] == 0 || t->dims[d] > (uint64_t)INT64_MAX / ne)
                return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": dimension %u is %llu "
                                    "(zero or overflowing)", t->name, d,
                                    (unsigned long long)t->dims[d]);
            ne *= t->dims[d];
        }
        for (uint32_t d = t->n_dims; d < ST_GGUF_MAX_DIMS; d++)
            t->dims[d] = 1;
        if ((rc = cur_u32(&c, &t->type, t->name)) || (rc = cur_u64(&c, &t->offset, t->name)))
            return rc;
        const ggml_type_info *ti = type_info(t->type);
        if (!ti)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": unknown ggml type %u", t->name,
                                t->type);
        if (t->dims[0] % ti->block)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": ne[0] %llu is not a multiple "
                                "of the %s block size %u", t->name,
                                (unsigned long long)t->dims[0], ti->name, ti->block);
        if (ne / ti->block > (uint64_t)INT64_MAX / ti->bytes)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": byte size overflows", t->name);
        t->nbytes = ne / ti->block * ti->bytes;
        for (uint64_t j = 0; j < i; j++)
            if (!strcmp(g->tensors[j].name, t->name))
                return st_error_set(ST_ECORRUPT, "gguf: duplicate tensor name \"%.64s\"", t->name);
    }
    uint64_t data_off = ((uint64_t)c.off + g->alignment - 1) / g->alignment * g->alignment;
    if (g->n_tensors > 0 && data_off > g->len)
        return st_error_set(ST_ECORRUPT, "gguf: data section at %llu starts beyond the end of the "
                            "file (%zu bytes)", (unsigned long long)data_off, g->len);
    g->data_off = data_off;
    uint64_t data_len = data_off <= g->len ? g->len - data_off : 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        st_gguf_tensor *t = &g->tensors[i];
        if (t->offset % g->alignment)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": offset %llu is not a "
                                "multiple of the alignment %u", t->name,
                                (unsigned long long)t->offset, g->alignment);
        if (t->offset > data_len || t->nbytes > data_len - t->offset)
            return st_error_set(ST_ECORRUPT, "gguf: tensor \"%.64s\": bytes [%llu, +%llu) exceed the "
                                "data section of %llu bytes (file truncated?)", t->name,
                                (unsigned long long)t->offset, (unsigned long long)t->nbytes,
                                (unsigned long long)data_len);
        t->data = g->buf + data_off + t->offset;
    }
    if (g->n_tensors > 1) {
        order = malloc(g->n_tensors * sizeof *order);
        if (!order)
            return st_error_set(ENOMEM, "gguf: tensor order");
        for (uint64_t i = 0; i < g->n_tensors; i++)
            order[i] = &g->tensors[i];
        qsort(order, g->n_tensors, sizeof *order, cmp_off);
        for (uint64_t i = 1; i < g->n_tensors; i++)
            if (order[i - 1]->offset + order[i - 1]->nbytes > order[i]->offset) {
                rc = st_error_set(ST_ECORRUPT, "gguf: tensors \"%.64s\" and \"%.64s\" overlap",
                                  order[i - 1]->name, order[i]->name);
                free(order);
                return rc;
            }
        free(order);
    }
    return 0;
}

int st_gguf_open_mem(const void *buf, size_t len, st_gguf **out)
{
    *out = NULL;
    st_gguf *g = calloc(1, sizeof *g);
    if (!g)
        return st_error_set(ENOMEM, "gguf: handle");
    g->buf = buf;
    g->len = len;
    g->n_part = 1;
    int rc = parse(g);
    if (rc) {
        st_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

static int split_open(st_gguf *g, const char *path);

/* One file, mapped and parsed (a part of a split model stays a part). */
static int open_one(const char *path, st_gguf **out)
{
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return st_error_set(errno, "gguf: open %s", path);
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return st_error_set(e, "gguf: stat %s", path);
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return st_error_set(ST_EINVAL, "gguf: %s is not a regular file", path);
    }
    if (sb.st_size < 4) {
        close(fd);
        return st_error_set(ST_ENOTSTRATA, "gguf: %s: %lld bytes, too short for a GGUF header", path,
                            (long long)sb.st_size);
    }
    void *m = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (m == MAP_FAILED)
        return st_error_set(e, "gguf: mmap %s", path);
    st_gguf *g = calloc(1, sizeof *g);
    if (!g) {
        munmap(m, (size_t)sb.st_size);
        return st_error_set(ENOMEM, "gguf: handle");
    }
    g->buf = m;
    g->len = (size_t)sb.st_size;
    g->mapped = 1;
    g->n_part = 1;
    g->path = strdup(path);
    int rc = g->path ? parse(g) : st_error_set(ENOMEM, "gguf: path");
    if (rc) {
        st_error_wrap(rc, "%s", path);
        st_gguf_close(g);
        return rc;
    }
    *out = g;
    return 0;
}

int st_gguf_open(const char *path, st_gguf **out)
{
    int rc = open_one(path, out);
    if (!rc && (rc = split_open(*out, path))) {
        st_gguf_close(*out);
        *out = NULL;
    }
    return rc;
}

uint32_t st_gguf_version(const st_gguf *g) { return g->version; }
uint32_t st_gguf_alignment(const st_gguf *g) { return g->alignment; }
uint64_t st_gguf_n_kv(const st_gguf *g) { return g->n_kv; }
uint64_t st_gguf_n_tensors(const st_gguf *g) { return g->n_tensors; }

const char *st_gguf_kv_key(const st_gguf *g, uint64_t i)
{
    return i < g->n_kv ? g->kv[i].key_z : NULL;
}

uint32_t st_gguf_kv_type(const st_gguf *g, uint64_t i, uint32_t *elem_type, uint64_t *count)
{
    if (i >= g->n_kv)
        return UINT32_MAX;
    if (elem_type)
        *elem_type = g->kv[i].elem_type;
    if (count)
        *count = g->kv[i].count;
    return g->kv[i].type;
}

int64_t st_gguf_find(const st_gguf *g, const char *key)
{
    for (uint64_t i = 0; i < g->n_kv; i++)
        if (!strcmp(g->kv[i].key_z, key))
            return (int64_t)i;
    return -1;
}

static int get_int(const st_gguf *g, const char *key, uint64_t max, uint64_t *out)
{
    int64_t i = st_gguf_find(g, key);
    if (i < 0)
        return st_error_set(ST_ENOTFOUND, "gguf: key %s missing", key);
    const gguf_kv *kv = &g->kv[i];
    const uint8_t *p = kv->val;
    int64_t s = 0;
    uint64_t u = 0;
    int is_signed = 0;
    switch (kv->type) {
    case ST_GGUF_UINT8: u = p[0]; break;
    case ST_GGUF_INT8: s = (int8_t)p[0]; is_signed = 1; break;
    case ST_GGUF_UINT16: { uint16_t v; memcpy(&v, p, 2); u = v; break; }
    case ST_GGUF_INT16: { int16_t v; memcpy(&v, p, 2); s = v; is_signed = 1; break; }
    case ST_GGUF_UINT32: { uint32_t v; memcpy(&v, p, 4); u = v; break; }
    case ST_GGUF_INT32: { int32_t v; memcpy(&v, p, 4); s = v; is_signed = 1; break; }
    case ST_GGUF_UINT64: memcpy(&u, p, 8); break;
    case ST_GGUF_INT64: memcpy(&s, p, 8); is_signed = 1; break;
    default:
        return st_error_set(ST_ECORRUPT, "gguf: key %s has type %s, not an integer", key,
                            st_gguf_kv_type_name(kv->type));
    }
    if (is_signed) {
        if (s < 0)
            return st_error_set(ST_ECORRUPT, "gguf: key %s is negative (%lld)", key, (long long)s);
        u = (uint64_t)s;
    }
    if (u > max)
        return st_error_set(ST_ECORRUPT, "gguf: key %s value %llu out of range", key,
                            (unsigned long long)u);
    *out = u;
    return 0;
}

int st_gguf_get_u32(const st_gguf *g, const char *key, uint32_t *out)
{
    uint64_t v;
    int rc = get_int(g, key, UINT32_MAX, &v);
    if (!rc)
        *out = (uint32_t)v;
    return rc;
}

int st_gguf_get_u64(const st_gguf *g, const char *key, uint64_t *out)
{
    return get_int(g, key, UINT64_MAX, out);
}

int st_gguf_get_f32(const st_gguf *g, const char *key, float *out)
{
    int64_t i = st_gguf_find(g, key);
    if (i < 0)
        return st_error_set(ST_ENOTFOUND, "gguf: key %s missing", key);
    const gguf_kv *kv = &g->kv[i];
    if (kv->type == ST_GGUF_FLOAT32) {
        memcpy(out, kv->val, 4);
        return 0;
    }
    if (kv->type == ST_GGUF_FLOAT64) {
        double d;
        memcpy(&d, kv->val, 8);
        *out = (float)d;
        return 0;
    }
    return st_error_set(ST_ECORRUPT, "gguf: key %s has type %s, not a float", key,
                        st_gguf_kv_type_name(kv->type));
}

int st_gguf_get_str(const st_gguf *g, const char *key, const char **out, uint64_t *len)
{
    int64_t i = st_gguf_find(g, key);
    if (i < 0)
        return st_error_set(ST_ENOTFOUND, "gguf: key %s missing", key);
    const gguf_kv *kv = &g->kv[i];
    if (kv->type != ST_GGUF_STRING)
        return st_error_set(ST_ECORRUPT, "gguf: key %s has type %s, not a string", key,
                            st_gguf_kv_type_name(kv->type));
    memcpy(len, kv->val, 8);
    *out = (const char *)kv->val + 8;
    return 0;
}

const st_gguf_tensor *st_gguf_tensor_at(const st_gguf *g, uint64_t i)
{
    return i < g->n_tensors ? &g->tensors[i] : NULL;
}

const st_gguf_tensor *st_gguf_tensor_find(const st_gguf *g, const char *name)
{
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if (!strcmp(g->tensors[i].name, name))
            return &g->tensors[i];
    return NULL;
}

/* ---- split models (llama.cpp's gguf-split layout) ----------------------------------------
 * The first part, NAME-00001-of-0000N.gguf, holds every key and split.no 0, split.count N,
 * split.tensors.count T; part i (NAME-0000i-of-0000N.gguf, found by that name) holds split.no
 * i - 1, the same count and total, and its tensors; together the parts hold T tensors, each in
 * one part. A part's tensor entries are appended to the first part's table and point into that
 * part's mapping. llama.cpp checks split.no and the total; the counts of every part and a
 * part's general.architecture (where a part has one) are checked here as well. */
static int split_key(const st_gguf *g, const char *key, uint64_t max, uint64_t *v)
{
    int rc = get_int(g, key, max, v);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_ECORRUPT, "gguf: %s: key %s missing (a part of a split model)",
                            g->path, key);
    if (rc) {
        return st_error_wrap(rc, "gguf: %s", g->path);
    }
    return 0;
}

/* Whether a and b hold the same string key (both absent counts as the same). */
static int same_str(const st_gguf *a, const st_gguf *b, const char *key)
{
    const char *x = NULL, *y = NULL;
    uint64_t nx = 0, ny = 0;
    int ha = st_gguf_get_str(a, key, &x, &nx) == 0, hb = st_gguf_get_str(b, key, &y, &ny) == 0;
    return ha == hb && (!ha || (nx == ny && !memcmp(x, y, nx)));
}

static int split_part(st_gguf *g, uint32_t i, uint64_t count, uint64_t total, const char *pp)
{
    st_gguf *p = NULL;
    uint64_t no = 0, pc = 0, pt = 0;
    int rc = open_one(pp, &p);
    if (rc) {
        return st_error_wrap(rc, "gguf: split model %s: part %u of %llu missing or unreadable", g->path,
                             i + 1, (unsigned long long)count);
    }
    g->part[i - 1] = p;
    g->n_part = i + 1;
    if ((rc = split_key(p, "split.no", UINT16_MAX, &no)) ||
        (rc = split_key(p, "split.count", UINT16_MAX, &pc)) ||
        (rc = split_key(p, "split.tensors.count", INT32_MAX, &pt)))
        return rc;
    if (no != i)
        return st_error_set(ST_EINVAL, "gguf: split model %s: part %s has split.no %llu, expected "
                            "%u", g->path, pp, (unsigned long long)no, i);
    if (pc != count || pt != total)
        return st_error_set(ST_EINVAL, "gguf: split model %s: part %s says %llu parts and %llu "
                            "tensors, the first part %llu and %llu (a part of another model?)",
                            g->path, pp, (unsigned long long)pc, (unsigned long long)pt,
                            (unsigned long long)count, (unsigned long long)total);
    if (st_gguf_find(p, "general.architecture") >= 0 && !same_str(g, p, "general.architecture"))
        return st_error_set(ST_EINVAL, "gguf: split model %s: part %s has another "
                            "general.architecture (a part of another model)", g->path, pp);
    if (p->n_tensors > total - g->n_tensors)
        return st_error_set(ST_EINVAL, "gguf: split model %s: more tensors in parts 1..%u than "
                            "split.tensors.count %llu", g->path, i + 1,
                            (unsigned long long)total);
    st_gguf_tensor *nt = realloc(g->tensors, (size_t)(g->n_tensors + p->n_tensors + 1) *
                                                 sizeof *nt);
    if (!nt)
        return st_error_set(ENOMEM, "gguf: split model tensors");
    g->tensors = nt;
    for (uint64_t k = 0; k < p->n_tensors; k++) {
        const st_gguf_tensor *t = &p->tensors[k];
        for (uint64_t j = 0; j < g->n_tensors; j++)
            if (!strcmp(g->tensors[j].name, t->name))
                return st_error_set(ST_EINVAL, "gguf: split model %s: tensor %s is in part %u and "
                                    "in part %u", g->path, t->name, g->tensors[j].part + 1, i + 1);
        st_gguf_tensor *d = &g->tensors[g->n_tensors];
        *d = *t;
        d->part = i;
        if (!(d->name = strdup(t->name)))
            return st_error_set(ENOMEM, "gguf: tensor name copy");
        g->n_tensors++;
    }
    return 0;
}

static int split_open(st_gguf *g, const char *path)
{
    uint64_t count = 0, no = 0, total = 0;
    int rc = get_int(g, "split.count", UINT16_MAX, &count);
    if (rc == ST_ENOTFOUND)
        return 0;
    if (rc) {
        return st_error_wrap(rc, "gguf: %s", path);
    }
    if (count <= 1) /* one file, as llama.cpp reads it: the other split keys unread */
        return 0;
    if ((rc = split_key(g, "split.no", UINT16_MAX, &no)) ||
        (rc = split_key(g, "split.tensors.count", INT32_MAX, &total)))
        return rc;
    if (no != 0)
        return st_error_set(ST_EINVAL, "gguf: %s is part %llu of %llu of a split model: load it "
                            "from its first part (split.no 0, NAME-00001-of-%05llu.gguf)", path,
                            (unsigned long long)no + 1, (unsigned long long)count,
                            (unsigned long long)count);
    char suffix[40];
    snprintf(suffix, sizeof suffix, "-%05u-of-%05llu.gguf", 1u, (unsigned long long)count);
    size_t pl = strlen(path), sl = strlen(suffix);
    if (pl <= sl || strcmp(path + pl - sl, suffix))
        return st_error_set(ST_EINVAL, "gguf: %s: split.count %llu, but the name does not end in "
                            "%s (the other parts are found by name)", path,
                            (unsigned long long)count, suffix);
    if (g->n_tensors > total)
        return st_error_set(ST_EINVAL, "gguf: split model %s: more tensors in part 1 than "
                            "split.tensors.count %llu", path, (unsigned long long)total);
    if (!(g->part = calloc((size_t)count - 1, sizeof *g->part)))
        return st_error_set(ENOMEM, "gguf: split model parts");
    char *pp = malloc(pl + 1);
    if (!pp)
        return st_error_set(ENOMEM, "gguf: split model part path");
    for (uint32_t i = 1; i < count && !rc; i++) {
        memcpy(pp, path, pl - sl);
        snprintf(pp + pl - sl, sl + 1, "-%05u-of-%05llu.gguf", i + 1, (unsigned long long)count);
        rc = split_part(g, i, count, total, pp);
    }
    free(pp);
    if (!rc && g->n_tensors != total)
        rc = st_error_set(ST_EINVAL, "gguf: split model %s: %llu tensors in %llu parts, "
                          "split.tensors.count says %llu", path,
                          (unsigned long long)g->n_tensors, (unsigned long long)count,
                          (unsigned long long)total);
    return rc;
}

uint32_t st_gguf_n_parts(const st_gguf *g)
{
    return g->n_part;
}

const char *st_gguf_part_path(const st_gguf *g, uint32_t i)
{
    if (i == 0)
        return g->path;
    return i < g->n_part ? g->part[i - 1]->path : NULL;
}

uint64_t st_gguf_part_bytes(const st_gguf *g, uint32_t i)
{
    if (i == 0)
        return g->len;
    return i < g->n_part ? g->part[i - 1]->len : 0;
}

/* ---- writer ------------------------------------------------------------------------------ */
typedef struct wkv {
    char *key;
    uint32_t type;
    uint32_t elem_type;
    uint64_t count;
    uint8_t *val; /* fixed value, string bytes, or array elements */
    uint64_t val_len;
} wkv;

typedef struct wtensor {
    char *name;
    uint32_t type, n_dims;
    uint64_t dims[ST_GGUF_MAX_DIMS];
    uint64_t nbytes, offset;
    const void *data;
    st_gguf_fill_fn fill; /* with data NULL: produces the bytes at write time */
    void *fill_ctx;
    uint64_t fill_index;
} wtensor;

struct st_gguf_writer {
    uint32_t alignment;
    wkv *kv;
    size_t n_kv, cap_kv;
    wtensor *t;
    size_t n_t, cap_t;
    uint64_t data_len;
    int failed;
};

int st_gguf_writer_new(st_gguf_writer **out, uint32_t alignment)
{
    *out = NULL;
    if (alignment == 0)
        alignment = ST_GGUF_DEFAULT_ALIGNMENT;
    if (alignment & (alignment - 1))
        return st_error_set(ST_EINVAL, "gguf writer: alignment %u is not a power of two", alignment);
    st_gguf_writer *w = calloc(1, sizeof *w);
    if (!w)
        return st_error_set(ENOMEM, "gguf writer");
    w->alignment = alignment;
    *out = w;
    return st_gguf_writer_set_u32(w, "general.alignment", alignment);
}

void st_gguf_writer_free(st_gguf_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n_kv; i++) {
        free(w->kv[i].key);
        free(w->kv[i].val);
    }
    for (size_t i = 0; i < w->n_t; i++)
        free(w->t[i].name);
    free(w->kv);
    free(w->t);
    free(w);
}

static int w_fail(st_gguf_writer *w, int rc)
{
    w->failed = rc;
    return rc;
}

static int w_add(st_gguf_writer *w, const char *key, uint32_t type, uint32_t et, uint64_t count,
                 const void *val, uint64_t len)
{
    if (w->failed)
        return st_error_set(w->failed, "gguf writer: failed earlier");
    if (!key || !*key)
        return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: empty key"));
    for (size_t i = 0; i < w->n_kv; i++)
        if (!strcmp(w->kv[i].key, key))
            return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: duplicate key %s", key));
    if (w->n_kv == w->cap_kv) {
        size_t cap = w->cap_kv ? w->cap_kv * 2 : 16;
        wkv *n = realloc(w->kv, cap * sizeof *n);
        if (!n)
            return w_fail(w, st_error_set(ENOMEM, "gguf writer: keys"));
        w->kv = n;
        w->cap_kv = cap;
    }
    wkv *kv = &w->kv[w->n_kv];
    memset(kv, 0, sizeof *kv);
    kv->key = strdup(key);
    kv->val = malloc(len ? len : 1);
    if (!kv->key || !kv->val) {
        free(kv->key);
        free(kv->val);
        return w_fail(w, st_error_set(ENOMEM, "gguf writer: key %s", key));
    }
    if (len)
        memcpy(kv->val, val, len);
    kv->type = type;
    kv->elem_type = et;
    kv->count = count;
    kv->val_len = len;
    w->n_kv++;
    return 0;
}

int st_gguf_writer_set_str(st_gguf_writer *w, const char *key, const char *val)
{
    return w_add(w, key, ST_GGUF_STRING, 0, 0, val, strlen(val));
}
int st_gguf_writer_set_u32(st_gguf_writer *w, const char *key, uint32_t val)
{
    return w_add(w, key, ST_GGUF_UINT32, 0, 0, &val, 4);
}
int st_gguf_writer_set_u64(st_gguf_writer *w, const char *key, uint64_t val)
{
    return w_add(w, key, ST_GGUF_UINT64, 0, 0, &val, 8);
}
int st_gguf_writer_set_f32(st_gguf_writer *w, const char *key, float val)
{
    return w_add(w, key, ST_GGUF_FLOAT32, 0, 0, &val, 4);
}
int st_gguf_writer_set_bool(st_gguf_writer *w, const char *key, int val)
{
    uint8_t b = val ? 1 : 0;
    return w_add(w, key, ST_GGUF_BOOL, 0, 0, &b, 1);
}
int st_gguf_writer_set_arr(st_gguf_writer *w, const char *key, uint32_t elem_type,
                           const void *elems, uint64_t n)
{
    size_t es = kv_fixed_size(elem_type);
    if (!es || n > (UINT64_MAX / 2) / es)
        return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: key %s: array element type %u not "
                                      "supported", key, elem_type));
    return w_add(w, key, ST_GGUF_ARRAY, elem_type, n, elems, n * es);
}

int st_gguf_writer_set_str_arr(st_gguf_writer *w, const char *key, const char *const *strs,
                               uint64_t n)
{
    uint64_t len = 0;
    for (uint64_t i = 0; i < n; i++)
        len += 8 + strlen(strs[i]);
    uint8_t *buf = malloc(len ? len : 1), *p = buf;
    if (!buf)
        return w_fail(w, st_error_set(ENOMEM, "gguf writer: key %s", key));
    for (uint64_t i = 0; i < n; i++) {
        uint64_t sl = strlen(strs[i]);
        for (int b = 0; b < 8; b++)
            *p++ = (uint8_t)(sl >> (8 * b));
        memcpy(p, strs[i], sl);
        p += sl;
    }
    int rc = w_add(w, key, ST_GGUF_ARRAY, ST_GGUF_STRING, n, buf, len);
    free(buf);
    return rc;
}

int st_gguf_kv_raw(const st_gguf *g, uint64_t i, const void **val, uint64_t *len)
{
    if (i >= g->n_kv)
        return st_error_set(ST_EINVAL, "gguf: key index %llu of %llu", (unsigned long long)i,
                            (unsigned long long)g->n_kv);
    const gguf_kv *kv = &g->kv[i];
    /* an array's val points at its first element, after the u32 element type and u64 count */
    const uint8_t *start = kv->type == ST_GGUF_ARRAY ? kv->val - 12 : kv->val;
    cursor c = {g->buf, (size_t)(start - g->buf), g->len};
    int rc = skip_value(&c, kv->type, 0, kv->key_z);
    if (rc)
        return rc;
    *val = start;
    *len = c.off - (size_t)(start - g->buf);
    return 0;
}

int st_gguf_writer_copy_kv(st_gguf_writer *w, const st_gguf *g, uint64_t i)
{
    const void *v = NULL;
    uint64_t len = 0;
    int rc = st_gguf_kv_raw(g, i, &v, &len);
    if (rc)
        return w_fail(w, rc);
    const gguf_kv *kv = &g->kv[i];
    const uint8_t *p = v;
    if (kv->type == ST_GGUF_STRING)
        return w_add(w, kv->key_z, ST_GGUF_STRING, 0, 0, p + 8, len - 8);
    if (kv->type == ST_GGUF_ARRAY)
        return w_add(w, kv->key_z, ST_GGUF_ARRAY, kv->elem_type, kv->count, p + 12, len - 12);
    return w_add(w, kv->key_z, kv->type, 0, 0, p, len);
}

int st_gguf_writer_add_tensor_fill(st_gguf_writer *w, const char *name, uint32_t type,
                                   uint32_t n_dims, const uint64_t *dims, st_gguf_fill_fn fill,
                                   void *ctx, uint64_t index)
{
    if (!fill)
        return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: tensor %s: no fill function",
                                      name ? name : "(null)"));
    int rc = st_gguf_writer_add_tensor(w, name, type, n_dims, dims, NULL);
    if (rc)
        return rc;
    wtensor *t = &w->t[w->n_t - 1];
    t->fill = fill;
    t->fill_ctx = ctx;
    t->fill_index = index;
    return 0;
}

int st_gguf_writer_add_tensor(st_gguf_writer *w, const char *name, uint32_t type, uint32_t n_dims,
                              const uint64_t *dims, const void *data)
{
    if (w->failed)
        return st_error_set(w->failed, "gguf writer: failed earlier");
    const ggml_type_info *ti = type_info(type);
    if (!ti || n_dims < 1 || n_dims > ST_GGUF_MAX_DIMS || !name || !*name || strlen(name) > 255)
        return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: tensor %s: bad type, name or dims",
                                      name ? name : "(null)"));
    for (size_t i = 0; i < w->n_t; i++)
        if (!strcmp(w->t[i].name, name))
            return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: duplicate tensor %s", name));
    uint64_t ne = 1;
    for (uint32_t d = 0; d < n_dims; d++) {
        if (dims[d] == 0 || dims[d] > ((uint64_t)1 << 40) / ne)
            return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: tensor %s: dimension %u", name, d));
        ne *= dims[d];
    }
    if (dims[0] % ti->block)
        return w_fail(w, st_error_set(ST_EINVAL, "gguf writer: tensor %s: ne[0] not a multiple of "
                                      "the block", name));
    if (w->n_t == w->cap_t) {
        size_t cap = w->cap_t ? w->cap_t * 2 : 64;
        wtensor *n = realloc(w->t, cap * sizeof *n);
        if (!n)
            return w_fail(w, st_error_set(ENOMEM, "gguf writer: tensors"));
        w->t = n;
        w->cap_t = cap;
    }
    wtensor *t = &w->t[w->n_t];
    memset(t, 0, sizeof *t);
    t->name = strdup(name);
    if (!t->name)
        return w_fail(w, st_error_set(ENOMEM, "gguf writer: tensor %s", name));
    t->type = type;
    t->n_dims = n_dims;
    memcpy(t->dims, dims, n_dims * sizeof *dims);
    t->nbytes = ne / ti->block * ti->bytes;
    t->offset = w->data_len;
    t->data = data;
    w->data_len += (t->nbytes + w->alignment - 1) / w->alignment * w->alignment;
    w->n_t++;
    return 0;
}

/* Buffered writer over a file descriptor. */
typedef struct wbuf {
    int fd;
    uint8_t b[1 << 16];
    size_t n;
    uint64_t total;
    int err;
} wbuf;

static void wb_flush(wbuf *b)
{
    if (!b->err)
        b->err = st_sys_write_all(b->fd, b->b, b->n);
    b->n = 0;
}

static void wb_put(wbuf *b, const void *p, size_t n)
{
    const uint8_t *s = p;
    b->total += n;
    while (n && !b->err) {
        if (b->n == sizeof b->b)
            wb_flush(b);
        size_t k = sizeof b->b - b->n;
        if (k > n)
            k = n;
        memcpy(b->b + b->n, s, k);
        b->n += k;
        s += k;
        n -= k;
    }
}

static void wb_u32(wbuf *b, uint32_t v) { wb_put(b, &v, 4); }
static void wb_u64(wbuf *b, uint64_t v) { wb_put(b, &v, 8); }
static void wb_str(wbuf *b, const char *s, uint64_t n)
{
    wb_u64(b, n);
    wb_put(b, s, (size_t)n);
}

static void wb_pad(wbuf *b, uint32_t align)
{
    static const uint8_t zeros[64];
    while (b->total % align) {
        size_t k = align - b->total % align;
        wb_put(b, zeros, k > sizeof zeros ? sizeof zeros : k);
    }
}

int st_gguf_writer_write(st_gguf_writer *w, const char *path)
{
    if (w->failed)
        return st_error_set(w->failed, "gguf writer: failed earlier");
    st_replace a = {.fd = -1};
    wbuf *b = NULL;
    int rc = 0;
    b = calloc(1, sizeof *b);
    if (!b) {
        rc = st_error_set(ENOMEM, "gguf writer: buffer (%zu bytes)", sizeof *b);
        goto done;
    }
    if ((rc = st_replace_begin(&a, path, 0644))) {
        st_error_wrap(rc, "gguf writer");
        goto done;
    }
    b->fd = a.fd;
    wb_u32(b, GGUF_MAGIC);
    wb_u32(b, 3);
    wb_u64(b, w->n_t);
    wb_u64(b, w->n_kv);
    for (size_t i = 0; i < w->n_kv; i++) {
        const wkv *kv = &w->kv[i];
        wb_str(b, kv->key, strlen(kv->key));
        wb_u32(b, kv->type);
        if (kv->type == ST_GGUF_STRING) {
            wb_str(b, (const char *)kv->val, kv->val_len);
        } else if (kv->type == ST_GGUF_ARRAY) {
            wb_u32(b, kv->elem_type);
            wb_u64(b, kv->count);
            wb_put(b, kv->val, (size_t)kv->val_len);
        } else {
            wb_put(b, kv->val, (size_t)kv->val_len);
        }
    }
    for (size_t i = 0; i < w->n_t; i++) {
        const wtensor *t = &w->t[i];
        wb_str(b, t->name, strlen(t->name));
        wb_u32(b, t->n_dims);
        for (uint32_t d = 0; d < t->n_dims; d++)
            wb_u64(b, t->dims[d]);
        wb_u32(b, t->type);
        wb_u64(b, t->offset);
    }
    wb_pad(b, w->alignment);
    for (size_t i = 0; i < w->n_t && !b->err; i++) {
        const wtensor *t = &w->t[i];
        if (t->fill) {
            void *buf = malloc(t->nbytes ? (size_t)t->nbytes : 1);
            if (!buf) {
                rc = st_error_set(ENOMEM, "gguf writer: tensor %s: %llu bytes", t->name,
                                  (unsigned long long)t->nbytes);
                goto done;
            }
            if ((rc = t->fill(t->fill_ctx, t->fill_index, buf, t->nbytes))) {
                free(buf);
                goto done;
            }
            wb_put(b, buf, (size_t)t->nbytes);
            free(buf);
        } else {
            wb_put(b, t->data, (size_t)t->nbytes);
        }
        wb_pad(b, w->alignment);
    }
    wb_flush(b);
    if (b->err) {
        rc = st_error_set(b->err, "gguf writer: write %s: %s", a.tmp, strerror(b->err));
        goto done;
    }
    if ((rc = st_replace_commit(&a, path)))
        st_error_wrap(rc, "gguf writer");
done:
    st_replace_abort(&a); /* nothing left after a commit; the temp file after any other failure */
    if (rc)
        w->failed = rc;
    free(b);
    return rc;
}

/* ---- writing a split model ---------------------------------------------------------------- */
static int split_write_part(const st_gguf *g, uint32_t i, uint32_t np, uint32_t max_tensors,
                            const char *path)
{
    st_gguf_writer *w = NULL;
    int rc = st_gguf_writer_new(&w, g->alignment);
    for (uint64_t k = 0; !rc && i == 0 && k < g->n_kv; k++) {
        const char *key = g->kv[k].key_z;
        if (strcmp(key, "general.alignment") && strncmp(key, "split.", 6))
            rc = st_gguf_writer_copy_kv(w, g, k);
    }
    uint16_t no = (uint16_t)i, cnt = (uint16_t)np;
    int32_t total = (int32_t)g->n_tensors;
    if (!rc && !(rc = w_add(w, "split.no", ST_GGUF_UINT16, 0, 0, &no, 2)) &&
        !(rc = w_add(w, "split.count", ST_GGUF_UINT16, 0, 0, &cnt, 2)))
        rc = w_add(w, "split.tensors.count", ST_GGUF_INT32, 0, 0, &total, 4);
    uint64_t end = (uint64_t)(i + 1) * max_tensors;
    for (uint64_t k = (uint64_t)i * max_tensors; !rc && k < end && k < g->n_tensors; k++) {
        const st_gguf_tensor *t = &g->tensors[k];
        rc = st_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->dims, t->data);
    }
    if (!rc)
        rc = st_gguf_writer_write(w, path);
    st_gguf_writer_free(w);
    return rc;
}

int st_gguf_split(const char *in, const char *prefix, uint32_t max_tensors, uint32_t *n_parts)
{
    st_gguf *g = NULL;
    if (max_tensors < 1)
        return st_error_set(ST_EINVAL, "gguf split: at least one tensor per part");
    int rc = st_gguf_open(in, &g);
    if (rc)
        return rc;
    uint64_t np = g->n_tensors ? (g->n_tensors + max_tensors - 1) / max_tensors : 1;
    size_t len = strlen(prefix) + 32;
    char *path = malloc(len);
    if (np > UINT16_MAX || g->n_tensors > INT32_MAX)
        rc = st_error_set(ST_EINVAL, "gguf split: %llu tensors in %llu parts (at most %u parts)",
                          (unsigned long long)g->n_tensors, (unsigned long long)np, UINT16_MAX);
    else if (!path)
        rc = st_error_set(ENOMEM, "gguf split: path");
    /* the later parts first: a first part names a complete set */
    for (uint32_t j = 0; !rc && j < np; j++) {
        uint32_t i = (j + 1) % (uint32_t)np;
        snprintf(path, len, "%s-%05u-of-%05u.gguf", prefix, i + 1, (uint32_t)np);
        rc = split_write_part(g, i, (uint32_t)np, max_tensors, path);
    }
    if (!rc && n_parts)
        *n_parts = (uint32_t)np;
    free(path);
    st_gguf_close(g);
    return rc;
}
