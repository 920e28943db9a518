/*
 * st_image.c - geometry and dtype helpers, and the in-memory state image.
 *
 * The image's invariants are listed in st_store_int.h. Every mutating function either succeeds
 * completely or leaves the image as it was (allocations happen before anything is replaced).
 * Buffers of 2 MiB and more (K/V tensors, checkpoint blocks) are mapped by st_alloc straight
 * from the kernel, aligned to 2 MiB and offered for transparent huge pages: first-touching fresh
 * memory page by page costs about 20 us per 4 KiB on a virtual machine, which dominated snapshot
 * and restore. A fresh mapping is zero, so they need no zero-fill either (the kernel clears each
 * huge page once, when it is first touched). A registry (address -> length) tells st_buf_free
 * whether a buffer is such a mapping (munmap) or came from malloc (free(), e.g. the session-file
 * reader's buffers); every image buffer is released through st_buf_free. An image made with
 * st_image_create_with takes its large buffers from the allocation hook first (falling back to
 * a mapping when the hook refuses); the registry records that hook's free per buffer.
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "st_image.h"
#include "st_store_int.h"

/* ---- dtypes and sizes ---------------------------------------------------------------------- */

static const char *const st_dtype_names[ST_DTYPE_COUNT] = {"f32", "f16", "bf16", "i8", "i32", "i64"};
static const uint8_t st_dtype_sizes[ST_DTYPE_COUNT] = {4, 2, 2, 1, 4, 8};

const char *st_dtype_name(uint32_t dtype)
{
    return dtype < ST_DTYPE_COUNT ? st_dtype_names[dtype] : "unknown";
}

size_t st_dtype_size(uint32_t dtype)
{
    return dtype < ST_DTYPE_COUNT ? st_dtype_sizes[dtype] : 0;
}

uint64_t st_mul_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    if (__builtin_mul_overflow(a, b, &r))
        return UINT64_MAX;
    return r;
}

static uint64_t st_add_sat(uint64_t a, uint64_t b)
{
    uint64_t r;
    if (__builtin_add_overflow(a, b, &r))
        return UINT64_MAX;
    return r;
}

uint64_t st_tensor_elems(const st_tensor_desc *t)
{
    uint64_t n = 1;
    if (!t || t->ndim < 1 || t->ndim > ST_TENSOR_NDIM_MAX)
        return 0;
    for (uint32_t d = 0; d < t->ndim; d++)
        n = st_mul_sat(n, t->shape[d]);
    return n;
}

uint64_t st_tensor_row_bytes(const st_tensor_desc *t)
{
    uint64_t n;
    if (!t || t->ndim < 1 || t->ndim > ST_TENSOR_NDIM_MAX)
        return 0;
    n = st_dtype_size(t->dtype);
    for (uint32_t d = 1; d < t->ndim; d++)
        n = st_mul_sat(n, t->shape[d]);
    return n;
}

uint64_t st_tensor_stored_bytes(const st_tensor_desc *t, uint32_t codec)
{
    size_t es;
    if (!t)
        return 0;
    es = t->dtype == ST_DTYPE_F32 ? st_codec_elem_size(codec) : st_dtype_size(t->dtype);
    return st_mul_sat(st_tensor_elems(t), es);
}

/* ---- geometry ------------------------------------------------------------------------------ */

static int st_name_valid(const char *name, size_t *len)
{
    size_t n = 0;
    while (n < ST_TENSOR_NAME_MAX && name[n] != '\0') {
        if ((unsigned char)name[n] < 0x20 || (unsigned char)name[n] > 0x7e) {
            *len = n;
            return 0;
        }
        n++;
    }
    *len = n;
    return n > 0 && n < ST_TENSOR_NAME_MAX;
}

int st_arch_name_check(const char name[ST_ARCH_NAME_MAX], const char *what)
{
    size_t n = strnlen(name, ST_ARCH_NAME_MAX);
    if (n == ST_ARCH_NAME_MAX)
        return st_error_set(ST_ECORRUPT, "%s: not NUL-terminated within %d bytes", what,
                            ST_ARCH_NAME_MAX);
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '.' || c == '_' || c == '-'))
            return st_error_set(ST_ECORRUPT, "%s: byte %zu (0x%02x) is not one of a-z 0-9 . _ -",
                                what, i, (unsigned char)c);
    }
    return 0;
}

int st_geometry_check(const st_geometry *g)
{
    uint64_t total = 0;

    if (!g)
        return st_error_set(ST_EINVAL, "geometry: NULL");
    if (g->page_size < 1)
        return st_error_set(ST_EGEOMETRY, "geometry: page_size is 0");
    if (g->n_ctx < 1)
        return st_error_set(ST_EGEOMETRY, "geometry: n_ctx is 0");
    if (g->n_tensors > ST_GEOMETRY_TENSORS_MAX)
        return st_error_set(ST_EGEOMETRY, "geometry: %u tensors exceed the limit of %u", g->n_tensors,
                            ST_GEOMETRY_TENSORS_MAX);
    if (g->n_tensors > 0 && !g->tensors)
        return st_error_set(ST_EINVAL, "geometry: %u tensors but no tensor array", g->n_tensors);
    total = st_mul_sat(g->n_ctx, 4) + st_mul_sat(g->n_vocab, 4);
    int rc = st_arch_name_check(g->arch, "geometry: architecture name");
    if (rc)
        return st_error_set(ST_EGEOMETRY, "%s", st_errdetail());

    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *t = &g->tensors[i];
        size_t len;
        uint64_t bytes;

        if (!st_name_valid(t->name, &len)) {
            if (len == 0 && t->name[0] == '\0')
                return st_error_set(ST_EGEOMETRY, "geometry: tensor %u: empty name", i);
            if (len == ST_TENSOR_NAME_MAX)
                return st_error_set(ST_EGEOMETRY, "geometry: tensor %u: name not NUL-terminated "
                                    "within %d bytes", i, ST_TENSOR_NAME_MAX);
            return st_error_set(ST_EGEOMETRY, "geometry: tensor %u: name byte %zu (0x%02x) is not "
                                "printable ASCII", i, len, (unsigned char)t->name[len]);
        }
        for (uint32_t j = 0; j < i; j++)
            if (strcmp(g->tensors[j].name, t->name) == 0)
                return st_error_set(ST_EGEOMETRY, "geometry: tensor %u: name \"%s\" already used by "
                                    "tensor %u", i, t->name, j);
        if (t->role != ST_ROLE_RUNNING && t->role != ST_ROLE_KV)
            return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): unknown role %u", i,
                                t->name, t->role);
        if (t->dtype >= ST_DTYPE_COUNT)
            return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): unknown dtype %u", i,
                                t->name, t->dtype);
        if (t->ndim < 1 || t->ndim > ST_TENSOR_NDIM_MAX)
            return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): ndim %u is not 1..%d", i,
                                t->name, t->ndim, ST_TENSOR_NDIM_MAX);
        for (uint32_t d = 0; d < ST_TENSOR_NDIM_MAX; d++) {
            if (d < t->ndim && t->shape[d] < 1)
                return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): shape[%u] is 0", i,
                                    t->name, d);
            if (d >= t->ndim && t->shape[d] != 0)
                return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): unused shape[%u] is "
                                    "%llu, must be 0", i, t->name, d, (unsigned long long)t->shape[d]);
        }
        if (t->role == ST_ROLE_KV) {
            if (t->shape[0] != g->n_ctx)
                return st_error_set(ST_EGEOMETRY, "geometry: K/V tensor %u (\"%s\"): shape[0] %llu is "
                                    "not n_ctx %u", i, t->name, (unsigned long long)t->shape[0],
                                    g->n_ctx);
            bytes = st_mul_sat(st_tensor_row_bytes(t), g->n_ctx);
        } else {
            /* the widest form a checkpoint may hold: fp32 for f32 tensors */
            bytes = st_mul_sat(st_tensor_elems(t), st_dtype_size(t->dtype));
        }
        if (bytes > ST_BYTES_MAX)
            return st_error_set(ST_EGEOMETRY, "geometry: tensor %u (\"%s\"): size overflows", i,
                                t->name);
        total += bytes;
        if (total > ST_BYTES_MAX)
            return st_error_set(ST_EGEOMETRY, "geometry: total size overflows at tensor %u (\"%s\")",
                                i, t->name);
    }
    return 0;
}

static void st_fp_hex(char *out, const uint8_t *fp)
{
    st_hex_encode(out, fp, 4);
    strcpy(out + 8, "...");
}

void st_geometry_layer_kinds(const st_geometry *g, char *out, size_t cap)
{
    enum { MAX_LAYERS = ST_GEOMETRY_TENSORS_MAX };
    static const char *const rec[] = {"ssm_state", "conv_state"};
    static const char *const att[] = {"k", "v", "k_scale", "v_scale"};
    uint8_t kind[MAX_LAYERS] = {0}; /* bit 0: recurrent tensors, bit 1: K/V tensors */
    uint32_t n_layers = 0;
    if (!cap)
        return;
    for (uint32_t i = 0; g && i < g->n_tensors; i++) {
        const char *name = g->tensors[i].name;
        char *end;
        if (strncmp(name, "blk.", 4) || name[4] < '0' || name[4] > '9')
            continue;
        unsigned long l = strtoul(name + 4, &end, 10);
        if (*end != '.' || l >= MAX_LAYERS)
            continue;
        for (size_t j = 0; j < sizeof rec / sizeof *rec; j++)
            if (!strcmp(end + 1, rec[j]))
                kind[l] |= 1;
        for (size_t j = 0; j < sizeof att / sizeof *att; j++)
            if (!strcmp(end + 1, att[j]))
                kind[l] |= 2;
        if (l + 1 > n_layers)
            n_layers = (uint32_t)l + 1;
    }
    if (!n_layers) {
        snprintf(out, cap, "none");
        return;
    }
    uint32_t n_d = 0, n_a = 0, n_x = 0;
    size_t o = 0;
    for (uint32_t l = 0; l < n_layers; l++) {
        char c = kind[l] == 1 ? 'D' : kind[l] == 2 ? 'A' : '?';
        n_d += c == 'D';
        n_a += c == 'A';
        n_x += c == '?';
        if (o + 1 < cap)
            out[o++] = c;
    }
    out[o] = '\0';
    char tail[96];
    int k = snprintf(tail, sizeof tail, " (%u deltanet, %u attention", n_d, n_a);
    if (n_x)
        k += snprintf(tail + k, sizeof tail - (size_t)k, ", %u other", n_x);
    snprintf(tail + k, sizeof tail - (size_t)k, ")");
    snprintf(out + o, cap - o, "%s", tail);
}

static void st_shape_str(char *out, size_t cap, const st_tensor_desc *t)
{
    size_t o = 0;
    o += (size_t)snprintf(out + o, cap - o, "[");
    for (uint32_t d = 0; d < t->ndim && d < ST_TENSOR_NDIM_MAX && o < cap; d++)
        o += (size_t)snprintf(out + o, cap - o, "%s%llu", d ? "," : "",
                              (unsigned long long)t->shape[d]);
    if (o < cap)
        snprintf(out + o, cap - o, "]");
}

int st_geometry_compare(const st_geometry *a, const st_geometry *b)
{
    if (!a || !b)
        return st_error_set(ST_EINVAL, "geometry compare: NULL geometry");
    if (memcmp(a->model_fp, b->model_fp, ST_FINGERPRINT_LEN) != 0) {
        char ha[16], hb[16];
        st_fp_hex(ha, a->model_fp);
        st_fp_hex(hb, b->model_fp);
        return st_error_set(ST_EMODEL, "model fingerprint %s vs %s", ha, hb);
    }
    if (a->arch[0] && b->arch[0] && strncmp(a->arch, b->arch, ST_ARCH_NAME_MAX) != 0)
        return st_error_set(ST_ECORRUPT, "architecture %.31s vs %.31s under one model fingerprint: "
                            "the name disagrees with the fingerprint", a->arch, b->arch);
    if (a->page_size != b->page_size)
        return st_error_set(ST_EGEOMETRY, "incompatible K/V geometry: page_size %u vs %u",
                            a->page_size, b->page_size);
    if (a->n_ctx != b->n_ctx)
        return st_error_set(ST_EGEOMETRY, "incompatible K/V geometry: n_ctx %u vs %u", a->n_ctx,
                            b->n_ctx);
    if (a->n_vocab != b->n_vocab)
        return st_error_set(ST_EGEOMETRY, "incompatible geometry: n_vocab %u vs %u", a->n_vocab,
                            b->n_vocab);
    for (uint32_t i = 0; i < a->n_tensors && i < b->n_tensors; i++) {
        const st_tensor_desc *x = &a->tensors[i], *y = &b->tensors[i];
        const char *what = x->role == ST_ROLE_KV ? "K/V" : "state";
        if (strncmp(x->name, y->name, ST_TENSOR_NAME_MAX) != 0)
            return st_error_set(ST_EGEOMETRY, "incompatible %s geometry: tensor %u name \"%.47s\" vs "
                                "\"%.47s\"", what, i, x->name, y->name);
        if (x->role != y->role)
            return st_error_set(ST_EGEOMETRY, "incompatible %s geometry: tensor %u (\"%.47s\") role "
                                "%s vs %s", what, i, x->name,
                                x->role == ST_ROLE_KV ? "kv" : "running",
                                y->role == ST_ROLE_KV ? "kv" : "running");
        if (x->dtype != y->dtype)
            return st_error_set(ST_EGEOMETRY, "incompatible %s geometry: tensor %u (\"%.47s\") dtype "
                                "%s vs %s", what, i, x->name, st_dtype_name(x->dtype),
                                st_dtype_name(y->dtype));
        if (x->ndim != y->ndim || memcmp(x->shape, y->shape, sizeof x->shape) != 0) {
            char sa[96], sb[96];
            st_shape_str(sa, sizeof sa, x);
            st_shape_str(sb, sizeof sb, y);
            return st_error_set(ST_EGEOMETRY, "incompatible %s geometry: tensor %u (\"%.47s\") shape "
                                "%s vs %s", what, i, x->name, sa, sb);
        }
    }
    if (a->n_tensors != b->n_tensors)
        return st_error_set(ST_EGEOMETRY, "incompatible geometry: %u tensors vs %u", a->n_tensors,
                            b->n_tensors);
    return 0;
}

/* ---- image --------------------------------------------------------------------------------- */

#define ST_HUGE_PAGE ((uint64_t)2 << 20)

/* The registry of mapped buffers: open addressing, linear probing, tombstones. */
#define ST_REG_EMPTY ((uintptr_t)0)
#define ST_REG_TOMB ((uintptr_t)1)
typedef struct st_reg_ent {
    uintptr_t p;
    size_t len;
    /* NULL: a mapping of st_alloc (munmap); else the allocator hook that made the buffer */
    void (*free)(void *ctx, void *p, size_t len);
    void *ctx;
} st_reg_ent;
static pthread_mutex_t st_reg_mu = PTHREAD_MUTEX_INITIALIZER;
static st_reg_ent *st_reg_tab;
static size_t st_reg_cap, st_reg_used; /* used: live entries and tombstones */

static size_t st_reg_slot(uintptr_t p, size_t cap)
{
    uint64_t h = (uint64_t)(p >> 21) * 0x9e3779b97f4a7c15ull;
    return (size_t)(h >> 20) & (cap - 1);
}

/* Find p's slot (or NULL); the caller holds the lock. */
static st_reg_ent *st_reg_find(uintptr_t p)
{
    if (!st_reg_cap)
        return NULL;
    for (size_t i = st_reg_slot(p, st_reg_cap);; i = (i + 1) & (st_reg_cap - 1)) {
        if (st_reg_tab[i].p == p)
            return &st_reg_tab[i];
        if (st_reg_tab[i].p == ST_REG_EMPTY)
            return NULL;
    }
}

static int st_reg_put(void *ptr, size_t len, const st_image_allocator *a)
{
    uintptr_t p = (uintptr_t)ptr;
    int rc = 0;
    pthread_mutex_lock(&st_reg_mu);
    if ((st_reg_used + 1) * 2 > st_reg_cap) {
        size_t live = 0, cap = 64;
        for (size_t i = 0; i < st_reg_cap; i++)
            live += st_reg_tab[i].p > ST_REG_TOMB;
        while ((live + 1) * 4 > cap)
            cap *= 2;
        st_reg_ent *t = calloc(cap, sizeof *t);
        if (!t) {
            rc = ENOMEM;
            goto done;
        }
        for (size_t i = 0; i < st_reg_cap; i++) {
            if (st_reg_tab[i].p <= ST_REG_TOMB)
                continue;
            size_t j = st_reg_slot(st_reg_tab[i].p, cap);
            while (t[j].p != ST_REG_EMPTY)
                j = (j + 1) & (cap - 1);
            t[j] = st_reg_tab[i];
        }
        free(st_reg_tab);
        st_reg_tab = t;
        st_reg_cap = cap;
        st_reg_used = live;
    }
    size_t i = st_reg_slot(p, st_reg_cap);
    while (st_reg_tab[i].p > ST_REG_TOMB)
        i = (i + 1) & (st_reg_cap - 1);
    if (st_reg_tab[i].p == ST_REG_EMPTY)
        st_reg_used++;
    st_reg_tab[i].p = p;
    st_reg_tab[i].len = len;
    st_reg_tab[i].free = a ? a->free : NULL;
    st_reg_tab[i].ctx = a ? a->ctx : NULL;
done:
    pthread_mutex_unlock(&st_reg_mu);
    return rc;
}

/* Length of the mapping at p (0: not a mapped buffer); with take, it leaves the registry and
 * *ent receives its entry. */
static size_t st_reg_take(const void *ptr, int take, st_reg_ent *ent)
{
    size_t len = 0;
    pthread_mutex_lock(&st_reg_mu);
    st_reg_ent *e = st_reg_find((uintptr_t)ptr);
    if (e) {
        len = e->len;
        if (ent)
            *ent = *e;
        if (take)
            e->p = ST_REG_TOMB;
    }
    pthread_mutex_unlock(&st_reg_mu);
    return len;
}

static size_t st_reg_len(const void *ptr, int take)
{
    return st_reg_take(ptr, take, NULL);
}

/* n bytes (at least 1), zeroed when zero is set (mapped buffers always are); see the file
 * comment for sizes >= 2 MiB. Release with st_buf_free. */
static uint8_t *st_alloc(const st_image *img, uint64_t n, int zero, int *zeroed)
{
    if (zeroed)
        *zeroed = 0;
    if (n > SIZE_MAX / 2)
        return NULL;
    if (n < ST_HUGE_PAGE)
        return zero ? calloc(n ? (size_t)n : 1, 1) : malloc(n ? (size_t)n : 1);
    size_t r = (size_t)((n + ST_HUGE_PAGE - 1) & ~(ST_HUGE_PAGE - 1));
    if (img && img->has_alloc) {
        /* the hook may refuse (NULL): the buffer is then mapped as usual */
        uint8_t *h = (uint8_t *)img->alloc.alloc(img->alloc.ctx, r);
        if (h) {
            if (st_reg_put(h, r, &img->alloc)) {
                img->alloc.free(img->alloc.ctx, h, r);
                return NULL;
            }
            if (zero)
                memset(h, 0, r);
            return h;
        }
    }
    size_t span = r + (size_t)ST_HUGE_PAGE;
    uint8_t *m = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED)
        return NULL;
    uint8_t *a = (uint8_t *)(((uintptr_t)m + ST_HUGE_PAGE - 1) & ~(uintptr_t)(ST_HUGE_PAGE - 1));
    if (a > m)
        munmap(m, (size_t)(a - m));
    if (m + span > a + r)
        munmap(a + r, (size_t)(m + span - (a + r)));
#ifdef MADV_HUGEPAGE
    madvise(a, r, MADV_HUGEPAGE); /* advice only: without huge pages the memory still works */
#endif
    if (st_reg_put(a, r, NULL)) {
        munmap(a, r);
        return NULL;
    }
    if (zeroed)
        *zeroed = 1;
    return a;
}

/* Release an image buffer, mapped or malloc'd; accepts NULL. */
static void st_buf_free(void *p)
{
    st_reg_ent e;
    if (!p)
        return;
    size_t len = st_reg_take(p, 1, &e);
    if (len && e.free)
        e.free(e.ctx, p, len);
    else if (len)
        munmap(p, len);
    else
        free(p);
}

/* ---- shared checkpoint blocks (st_image.h) ---- */
struct st_image_block {
    uint8_t *data; /* an image buffer, released through st_buf_free with the last reference */
    uint64_t len;
    uint32_t refs;
};
static pthread_mutex_t st_share_mu = PTHREAD_MUTEX_INITIALIZER; /* marking a block shared */

void st_image_block_unref(st_image_block *b)
{
    if (!b || __atomic_sub_fetch(&b->refs, 1, __ATOMIC_ACQ_REL) != 0)
        return;
    st_buf_free(b->data);
    free(b);
}

/* A checkpoint's block released: the image's reference, or the buffer it owns. */
static void st_ckpt_release(st_ckpt *c)
{
    if (c->shared)
        st_image_block_unref(c->shared);
    else
        st_buf_free(c->data);
    c->data = NULL;
    c->shared = NULL;
}

st_image_block *st_image_checkpoint_share(const st_image *img, uint32_t ci)
{
    if (!img || ci >= img->n_ckpt)
        return NULL;
    st_ckpt *c = &img->ckpt[ci]; /* the bytes stay; only who references them is recorded */
    pthread_mutex_lock(&st_share_mu);
    if (!c->shared) {
        st_image_block *b = malloc(sizeof *b);
        if (!b) {
            pthread_mutex_unlock(&st_share_mu);
            return NULL;
        }
        *b = (st_image_block){c->data, img->ckpt_bytes[c->codec], 1};
        c->shared = b;
    }
    __atomic_add_fetch(&c->shared->refs, 1, __ATOMIC_RELAXED);
    st_image_block *b = c->shared;
    pthread_mutex_unlock(&st_share_mu);
    return b;
}

/* Before a checkpoint's bytes are written in place: a block other holders reference is
 * replaced by a private copy (0, or ENOMEM with the image unchanged). */
static int st_ckpt_own(st_image *img, st_ckpt *c)
{
    if (!c->shared)
        return 0;
    pthread_mutex_lock(&st_share_mu);
    st_image_block *b = c->shared;
    if (__atomic_load_n(&b->refs, __ATOMIC_ACQUIRE) == 1) {
        /* the last holder: the buffer is the image's own again */
        c->shared = NULL;
        pthread_mutex_unlock(&st_share_mu);
        free(b);
        return 0;
    }
    pthread_mutex_unlock(&st_share_mu);
    uint8_t *nd = st_alloc(img, b->len, 0, NULL);
    if (!nd)
        return ENOMEM;
    memcpy(nd, b->data, (size_t)b->len);
    c->data = nd;
    c->shared = NULL;
    st_image_block_unref(b);
    return 0;
}

/* Lay out a checkpoint block for each codec: running tensors in geometry order, each aligned to
 * its stored element size. The geometry was checked, so no sum here can overflow. */
uint64_t st_checkpoint_layout(const st_tensor_desc *tensors, uint32_t n, uint32_t codec,
                              uint64_t *off)
{
    uint64_t at = 0;
    for (uint32_t i = 0; i < n; i++) {
        const st_tensor_desc *t = &tensors[i];
        uint64_t es;
        off[i] = 0;
        if (t->role != ST_ROLE_RUNNING)
            continue;
        es = t->dtype == ST_DTYPE_F32 ? st_codec_elem_size(codec) : st_dtype_size(t->dtype);
        at = (at + es - 1) / es * es;
        off[i] = at;
        at += st_tensor_stored_bytes(t, codec);
    }
    return at;
}

static void st_ckpt_layout(st_image *img)
{
    for (uint32_t codec = 0; codec < ST_CODEC_COUNT; codec++)
        img->ckpt_bytes[codec] = st_checkpoint_layout(
            img->tensors, img->g.n_tensors, codec, &img->ckpt_off[(size_t)codec * img->g.n_tensors]);
}

void st_image_free(st_image *img)
{
    if (!img)
        return;
    for (uint32_t c = 0; c < img->n_ckpt; c++)
        st_ckpt_release(&img->ckpt[c]);
    free(img->ckpt);
    free(img->ckpt_off);
    if (img->kv)
        for (uint32_t i = 0; i < img->g.n_tensors; i++)
            st_buf_free(img->kv[i]);
    free(img->kv);
    free(img->tokens);
    free(img->logits);
    free(img->tensors);
    free(img);
}

int st_image_create(st_image **out, const st_geometry *g)
{
    return st_image_create_with(out, g, NULL);
}

int st_image_create_with(st_image **out, const st_geometry *g, const st_image_allocator *a)
{
    st_image *img = NULL;
    int rc;

    if (!out)
        return st_error_set(ST_EINVAL, "image create: NULL output");
    *out = NULL;
    rc = st_geometry_check(g);
    if (rc)
        return rc;
    img = calloc(1, sizeof *img);
    if (!img)
        goto nomem;
    img->g = *g;
    /* canonical: zero after the NUL, as tensor names below */
    size_t an = strlen(img->g.arch);
    memset(img->g.arch + an, 0, ST_ARCH_NAME_MAX - an);
    if (a) {
        if (!a->alloc || !a->free) {
            free(img);
            return st_error_set(ST_EINVAL, "image create: allocator without alloc or free");
        }
        img->alloc = *a;
        img->has_alloc = 1;
    }
    img->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *img->tensors);
    img->kv = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *img->kv);
    img->ckpt_off = calloc((size_t)ST_CODEC_COUNT * (g->n_tensors ? g->n_tensors : 1),
                           sizeof *img->ckpt_off);
    img->tokens = malloc(sizeof(uint32_t));
    if (!img->tensors || !img->kv || !img->ckpt_off || !img->tokens)
        goto nomem;
    if (g->n_tensors)
        memcpy(img->tensors, g->tensors, g->n_tensors * sizeof *img->tensors);
    img->g.tensors = img->tensors;
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        /* canonical names: everything after the NUL is zero, so images compare and write
         * deterministically whatever the caller left there */
        size_t len = strlen(img->tensors[i].name);
        memset(img->tensors[i].name + len, 0, ST_TENSOR_NAME_MAX - len);
        if (img->tensors[i].role == ST_ROLE_KV) {
            img->kv[i] = malloc(1);
            if (!img->kv[i])
                goto nomem;
        }
    }
    st_ckpt_layout(img);
    *out = img;
    return 0;
nomem:
    st_image_free(img);
    return st_error_set(ENOMEM, "image create: out of memory");
}

void st_image_gate_set(st_image *img, const st_image_gate *gate)
{
    if (!img)
        return;
    if (gate)
        img->gate = *gate;
    else
        memset(&img->gate, 0, sizeof img->gate);
}

int st_image_wait(const st_image *img, const void *p, uint64_t len)
{
    if (!img || !img->gate.wait)
        return 0;
    return img->gate.wait(img->gate.ctx, p, len);
}

int st_image_gated(const st_image *img)
{
    return img && img->gate.wait;
}

const st_geometry *st_image_geometry(const st_image *img)
{
    return img ? &img->g : NULL;
}

uint64_t st_image_n_tokens(const st_image *img)
{
    return img ? img->n_tokens : 0;
}

const uint32_t *st_image_tokens(const st_image *img)
{
    return img ? img->tokens : NULL;
}

/* st_image_tokens_set; zero_new 0 leaves new K/V rows unset (the caller overwrites them). */
static int st_tokens_set(st_image *img, const uint32_t *tokens, uint64_t n, int zero_new)
{
    uint64_t old;
    uint8_t *fresh = NULL; /* fresh[ti]: kv[ti] is a new mapping, zero past the old rows */

    if (!img)
        return st_error_set(ST_EINVAL, "tokens set: NULL image");
    if (n > img->g.n_ctx)
        return st_error_set(ST_EINVAL, "tokens set: %llu tokens exceed n_ctx %u",
                            (unsigned long long)n, img->g.n_ctx);
    if (n > 0 && !tokens)
        return st_error_set(ST_EINVAL, "tokens set: %llu tokens but no array", (unsigned long long)n);
    old = img->n_tokens;
    /* Phase 1: grow every buffer that must grow. A buffer grown before a later failure is only
     * larger than needed, which the invariants allow, so the image stays as it was. */
    if (n > old) {
        uint32_t *t = realloc(img->tokens, (size_t)n * sizeof *t);
        if (!t)
            return st_error_set(ENOMEM, "tokens set: out of memory for %llu tokens",
                                (unsigned long long)n);
        img->tokens = t;
        if (zero_new) /* without it every new row is zeroed, which is only slower */
            fresh = calloc(img->g.n_tensors ? img->g.n_tensors : 1, 1);
        for (uint32_t i = 0; i < img->g.n_tensors; i++) {
            uint8_t *k;
            int zeroed = 0;
            if (img->tensors[i].role != ST_ROLE_KV)
                continue;
            uint64_t row = st_tensor_row_bytes(&img->tensors[i]);
            size_t have = st_reg_len(img->kv[i], 0);
            if (have >= n * row)
                continue; /* a mapped buffer kept from a larger size still holds them */
            if (n * row < ST_HUGE_PAGE && !have) {
                k = realloc(img->kv[i], (size_t)(n * row));
            } else if ((k = st_alloc(img, n * row, 0, &zeroed)) != NULL) {
                if (old)
                    memcpy(k, img->kv[i], (size_t)(old * row));
                st_buf_free(img->kv[i]);
                if (fresh)
                    fresh[i] = (uint8_t)zeroed;
            }
            if (!k) {
                free(fresh);
                return st_error_set(ENOMEM, "tokens set: out of memory for K/V tensor %u", i);
            }
            img->kv[i] = k;
        }
    }
    /* Phase 2: nothing can fail any more. */
    for (uint32_t i = 0; i < img->g.n_tensors; i++) {
        uint64_t row;
        if (img->tensors[i].role != ST_ROLE_KV)
            continue;
        row = st_tensor_row_bytes(&img->tensors[i]);
        if (n > old) {
            if (zero_new && !(fresh && fresh[i]))
                memset(img->kv[i] + old * row, 0, (size_t)((n - old) * row));
        } else if (n < old && n > 0 && !st_reg_len(img->kv[i], 0)) {
            /* a mapped buffer keeps its size: rows beyond n_tokens are never read */
            uint8_t *k = realloc(img->kv[i], (size_t)(n * row));
            if (k)
                img->kv[i] = k;
        }
    }
    free(fresh);
    if (n > 0)
        memcpy(img->tokens, tokens, (size_t)n * sizeof *tokens);
    img->n_tokens = n;
    return 0;
}

int st_image_tokens_set(st_image *img, const uint32_t *tokens, uint64_t n)
{
    return st_tokens_set(img, tokens, n, 1);
}

int st_image_tokens_set_unzeroed(st_image *img, const uint32_t *tokens, uint64_t n)
{
    return st_tokens_set(img, tokens, n, 0);
}

void *st_image_kv(st_image *img, uint32_t ti, uint64_t *len)
{
    return (void *)st_image_kv_const(img, ti, len);
}

const void *st_image_kv_const(const st_image *img, uint32_t ti, uint64_t *len)
{
    if (len)
        *len = 0;
    if (!img || ti >= img->g.n_tensors || img->tensors[ti].role != ST_ROLE_KV)
        return NULL;
    if (len)
        *len = img->n_tokens * st_tensor_row_bytes(&img->tensors[ti]);
    return img->kv[ti];
}

uint64_t st_image_kv_pages(const st_image *img)
{
    if (!img)
        return 0;
    return (img->n_tokens + img->g.page_size - 1) / img->g.page_size;
}

int st_image_ckpt_append_empty(st_image *img, uint64_t position, uint32_t codec, uint32_t *index)
{
    int rc;
    st_ckpt *c;

    if (!img)
        return st_error_set(ST_EINVAL, "checkpoint add: NULL image");
    rc = st_codec_check(codec);
    if (rc)
        return rc;
    if (position > img->g.n_ctx)
        return st_error_set(ST_EINVAL, "checkpoint add: position %llu exceeds n_ctx %u",
                            (unsigned long long)position, img->g.n_ctx);
    if (img->n_ckpt > 0 && position <= img->ckpt[img->n_ckpt - 1].position)
        return st_error_set(ST_EINVAL, "checkpoint add: position %llu is not after the last "
                            "checkpoint's %llu", (unsigned long long)position,
                            (unsigned long long)img->ckpt[img->n_ckpt - 1].position);
    if (img->n_ckpt >= UINT32_MAX - ST_GEOMETRY_TENSORS_MAX - 8)
        return st_error_set(ST_ETOOBIG, "checkpoint add: too many checkpoints");
    if (img->n_ckpt == img->cap_ckpt) {
        uint32_t cap = img->cap_ckpt ? img->cap_ckpt * 2 : 4;
        st_ckpt *nc = realloc(img->ckpt, (size_t)cap * sizeof *nc);
        if (!nc)
            return st_error_set(ENOMEM, "checkpoint add: out of memory");
        img->ckpt = nc;
        img->cap_ckpt = cap;
    }
    c = &img->ckpt[img->n_ckpt];
    c->position = position;
    c->codec = codec;
    c->data = NULL;
    c->shared = NULL;
    if (index)
        *index = img->n_ckpt;
    img->n_ckpt++;
    return 0;
}

/* Zero the bytes of a checkpoint block in codec that no running tensor covers (the padding
 * between tensors and after the last; a block without tensors holds one zero byte). */
static void st_ckpt_zero_gaps(const st_image *img, uint32_t codec, uint8_t *d)
{
    uint64_t end = 0;
    for (uint32_t i = 0; i < img->g.n_tensors; i++) {
        const st_tensor_desc *t = &img->tensors[i];
        if (t->role != ST_ROLE_RUNNING)
            continue;
        memset(d + end, 0, (size_t)(st_ckpt_offset(img, codec, i) - end));
        end = st_ckpt_offset(img, codec, i) + st_tensor_stored_bytes(t, codec);
    }
    if (img->ckpt_bytes[codec] > end)
        memset(d + end, 0, (size_t)(img->ckpt_bytes[codec] - end));
    else if (end == 0)
        d[0] = 0;
}

static int st_ckpt_add(st_image *img, uint64_t position, uint32_t codec, uint32_t *index, int zero)
{
    uint32_t ci = 0;
    int rc = st_image_ckpt_append_empty(img, position, codec, &ci);
    if (rc)
        return rc;
    img->ckpt[ci].data = st_alloc(img, img->ckpt_bytes[codec], zero, NULL);
    if (!img->ckpt[ci].data) {
        img->n_ckpt--;
        return st_error_set(ENOMEM, "checkpoint add: out of memory for %llu bytes",
                            (unsigned long long)img->ckpt_bytes[codec]);
    }
    if (!zero)
        st_ckpt_zero_gaps(img, codec, img->ckpt[ci].data);
    if (index)
        *index = ci;
    return 0;
}

int st_image_checkpoint_add(st_image *img, uint64_t position, uint32_t codec, uint32_t *index)
{
    return st_ckpt_add(img, position, codec, index, 1);
}

int st_image_checkpoint_add_unzeroed(st_image *img, uint64_t position, uint32_t codec,
                                     uint32_t *index)
{
    return st_ckpt_add(img, position, codec, index, 0);
}

int st_image_checkpoint_add_shared(st_image *img, uint64_t position, uint32_t codec,
                                   st_image_block *b, uint32_t *index)
{
    uint32_t ci = 0;
    int rc;
    if (!img || !b)
        return st_error_set(ST_EINVAL, "checkpoint add: NULL argument");
    if ((rc = st_codec_check(codec)))
        return rc;
    if (b->len != img->ckpt_bytes[codec])
        return st_error_set(ST_EINVAL, "checkpoint add: a shared block of %llu bytes, a %s "
                            "checkpoint holds %llu", (unsigned long long)b->len,
                            st_codec_name(codec), (unsigned long long)img->ckpt_bytes[codec]);
    if ((rc = st_image_ckpt_append_empty(img, position, codec, &ci)))
        return rc;
    __atomic_add_fetch(&b->refs, 1, __ATOMIC_RELAXED);
    img->ckpt[ci].data = b->data;
    img->ckpt[ci].shared = b;
    if (index)
        *index = ci;
    return 0;
}

const void *st_image_checkpoint_block(const st_image *img, uint32_t ci, uint64_t *len)
{
    if (len)
        *len = 0;
    if (!img || ci >= img->n_ckpt)
        return NULL;
    if (len)
        *len = img->ckpt_bytes[img->ckpt[ci].codec];
    return img->ckpt[ci].data;
}

int st_image_checkpoint_exclusive(const st_image *img, uint32_t ci)
{
    if (!img || ci >= img->n_ckpt)
        return 0;
    pthread_mutex_lock(&st_share_mu);
    int own = img->ckpt[ci].shared == NULL;
    pthread_mutex_unlock(&st_share_mu);
    return own;
}

int st_image_checkpoint_exchange(st_image *img, uint32_t ci, void **block)
{
    if (!img || !block || !*block || ci >= img->n_ckpt)
        return st_error_set(ST_EINVAL, "checkpoint exchange: no checkpoint %u or no block", ci);
    pthread_mutex_lock(&st_share_mu);
    st_ckpt *c = &img->ckpt[ci];
    if (c->shared) {
        pthread_mutex_unlock(&st_share_mu);
        return st_error_set(ST_EINVAL, "checkpoint exchange: checkpoint %u's block is shared", ci);
    }
    void *mine = c->data;
    c->data = *block;
    *block = mine;
    pthread_mutex_unlock(&st_share_mu);
    return 0;
}

void st_image_buffer_free(void *p)
{
    st_buf_free(p);
}

uint32_t st_image_n_checkpoints(const st_image *img)
{
    return img ? img->n_ckpt : 0;
}

int st_image_checkpoint_info(const st_image *img, uint32_t ci, uint64_t *position, uint32_t *codec)
{
    if (!img || ci >= img->n_ckpt)
        return st_error_set(ST_ENOTFOUND, "checkpoint %u: no such checkpoint (%u in the image)", ci,
                            img ? img->n_ckpt : 0);
    if (position)
        *position = img->ckpt[ci].position;
    if (codec)
        *codec = img->ckpt[ci].codec;
    return 0;
}

void *st_image_checkpoint_tensor(st_image *img, uint32_t ci, uint32_t ti, uint64_t *len)
{
    if (img && ci < img->n_ckpt && st_ckpt_own(img, &img->ckpt[ci])) {
        if (len)
            *len = 0;
        return NULL;
    }
    return (void *)st_image_checkpoint_tensor_const(img, ci, ti, len);
}

const void *st_image_checkpoint_tensor_const(const st_image *img, uint32_t ci, uint32_t ti,
                                             uint64_t *len)
{
    if (len)
        *len = 0;
    if (!img || ci >= img->n_ckpt || ti >= img->g.n_tensors ||
        img->tensors[ti].role != ST_ROLE_RUNNING)
        return NULL;
    if (len)
        *len = st_tensor_stored_bytes(&img->tensors[ti], img->ckpt[ci].codec);
    return img->ckpt[ci].data + st_ckpt_offset(img, img->ckpt[ci].codec, ti);
}

int st_image_checkpoint_recode(st_image *img, uint32_t ci, uint32_t codec, void *scratch,
                               size_t scratch_cap)
{
    uint8_t *nd;
    st_ckpt *c;
    int rc;

    if (!img || ci >= img->n_ckpt)
        return st_error_set(ST_ENOTFOUND, "checkpoint %u: no such checkpoint", ci);
    rc = st_codec_check(codec);
    if (rc)
        return rc;
    c = &img->ckpt[ci];
    if (c->codec == codec)
        return 0;
    /* every tensor is written below; only the padding between them must be zeroed */
    nd = st_alloc(img, img->ckpt_bytes[codec], 0, NULL);
    if (!nd)
        return st_error_set(ENOMEM, "checkpoint %u recode: out of memory for %llu bytes", ci,
                            (unsigned long long)img->ckpt_bytes[codec]);
    st_ckpt_zero_gaps(img, codec, nd);
    for (uint32_t i = 0; i < img->g.n_tensors; i++) {
        const st_tensor_desc *t = &img->tensors[i];
        uint8_t *dst;
        const uint8_t *src;
        if (t->role != ST_ROLE_RUNNING)
            continue;
        dst = nd + st_ckpt_offset(img, codec, i);
        src = c->data + st_ckpt_offset(img, c->codec, i);
        if (t->dtype != ST_DTYPE_F32) { /* other dtypes are stored unchanged */
            memcpy(dst, src, (size_t)st_tensor_stored_bytes(t, codec));
            continue;
        }
        rc = st_codec_convert(codec, dst, c->codec, src, (size_t)st_tensor_elems(t), scratch,
                              scratch_cap);
        if (rc) {
            st_error_wrap(rc, "checkpoint %u recode %s -> %s: tensor %u (\"%s\")", ci, st_codec_name(c->codec),
                          st_codec_name(codec), i, t->name);
            st_buf_free(nd);
            return rc;
        }
    }
    /* every conversion succeeded: the new block replaces the old one */
    st_ckpt_release(c);
    c->data = nd;
    c->codec = codec;
    return 0;
}

int st_image_checkpoint_remove(st_image *img, uint32_t ci)
{
    if (!img || ci >= img->n_ckpt)
        return st_error_set(ST_ENOTFOUND, "checkpoint %u: no such checkpoint", ci);
    st_ckpt_release(&img->ckpt[ci]);
    memmove(&img->ckpt[ci], &img->ckpt[ci + 1], (img->n_ckpt - ci - 1) * sizeof *img->ckpt);
    img->n_ckpt--;
    return 0;
}

int st_image_logits_set(st_image *img, const float *logits, uint32_t n)
{
    float *l;

    if (!img)
        return st_error_set(ST_EINVAL, "logits set: NULL image");
    if (n == 0) {
        free(img->logits);
        img->logits = NULL;
        img->n_logits = 0;
        return 0;
    }
    if (n != img->g.n_vocab)
        return st_error_set(ST_EINVAL, "logits set: %u logits but n_vocab is %u", n, img->g.n_vocab);
    if (!logits)
        return st_error_set(ST_EINVAL, "logits set: NULL array");
    l = malloc((size_t)n * sizeof *l);
    if (!l)
        return st_error_set(ENOMEM, "logits set: out of memory");
    memcpy(l, logits, (size_t)n * sizeof *l);
    free(img->logits);
    img->logits = l;
    img->n_logits = n;
    return 0;
}

const float *st_image_logits(const st_image *img, uint32_t *n)
{
    if (n)
        *n = img ? img->n_logits : 0;
    return img ? img->logits : NULL;
}

void st_image_state_hash_set(st_image *img, uint64_t h)
{
    if (img)
        img->state_hash = h;
}

uint64_t st_image_state_hash(const st_image *img)
{
    return img ? img->state_hash : 0;
}

int st_image_check(const st_image *img)
{
    if (!img)
        return st_error_set(ST_EINVAL, "image check: NULL image");
    if (img->n_ckpt == 0)
        return st_error_set(ST_EINVAL, "image incomplete: no checkpoint");
    for (uint32_t c = 0; c < img->n_ckpt; c++) {
        int rc = st_codec_check(img->ckpt[c].codec);
        if (rc)
            return st_error_set(rc, "image: checkpoint %u has unknown codec %u", c, img->ckpt[c].codec);
        if (c > 0 && img->ckpt[c].position <= img->ckpt[c - 1].position)
            return st_error_set(ST_EINVAL, "image: checkpoint %u position %llu is not after "
                                "checkpoint %u's %llu", c, (unsigned long long)img->ckpt[c].position,
                                c - 1, (unsigned long long)img->ckpt[c - 1].position);
        if (img->ckpt[c].position > img->n_tokens)
            return st_error_set(ST_EINVAL, "image: checkpoint %u position %llu exceeds %llu tokens", c,
                                (unsigned long long)img->ckpt[c].position,
                                (unsigned long long)img->n_tokens);
    }
    if (img->ckpt[img->n_ckpt - 1].position != img->n_tokens)
        return st_error_set(ST_EINVAL, "image incomplete: the last checkpoint is at position %llu, "
                            "not at the %llu tokens", (unsigned long long)img->ckpt[img->n_ckpt - 1].position,
                            (unsigned long long)img->n_tokens);
    if (img->n_logits != 0 && img->n_logits != img->g.n_vocab)
        return st_error_set(ST_EINVAL, "image: %u logits but n_vocab is %u", img->n_logits,
                            img->g.n_vocab);
    return 0;
}

uint64_t st_image_bytes(const st_image *img)
{
    uint64_t total;

    if (!img)
        return 0;
    total = img->n_tokens * 4 + (uint64_t)img->n_logits * 4;
    for (uint32_t i = 0; i < img->g.n_tensors; i++) {
        const st_tensor_desc *t = &img->tensors[i];
        if (t->role == ST_ROLE_KV) {
            total = st_add_sat(total, st_mul_sat(img->n_tokens, st_tensor_row_bytes(t)));
            continue;
        }
        for (uint32_t c = 0; c < img->n_ckpt; c++)
            total = st_add_sat(total, st_tensor_stored_bytes(t, img->ckpt[c].codec));
    }
    return total;
}

int st_image_clone(st_image **out, const st_image *img)
{
    st_image *c = NULL;
    int rc;

    if (!out || !img)
        return st_error_set(ST_EINVAL, "image clone: NULL argument");
    *out = NULL;
    if ((rc = st_image_wait(img, NULL, 0)))
        return rc;
    rc = st_image_create(&c, &img->g);
    if (rc)
        return rc;
    rc = st_tokens_set(c, img->tokens, img->n_tokens, 0); /* every row is copied below */
    if (rc)
        goto fail;
    for (uint32_t i = 0; i < img->g.n_tensors; i++)
        if (img->tensors[i].role == ST_ROLE_KV && img->n_tokens)
            memcpy(c->kv[i], img->kv[i],
                   (size_t)(img->n_tokens * st_tensor_row_bytes(&img->tensors[i])));
    for (uint32_t k = 0; k < img->n_ckpt; k++) {
        uint32_t ci = 0;
        rc = st_ckpt_add(c, img->ckpt[k].position, img->ckpt[k].codec, &ci, 0);
        if (rc)
            goto fail;
        memcpy(c->ckpt[ci].data, img->ckpt[k].data, (size_t)img->ckpt_bytes[img->ckpt[k].codec]);
    }
    rc = st_image_logits_set(c, img->logits, img->n_logits);
    if (rc)
        goto fail;
    c->state_hash = img->state_hash;
    *out = c;
    return 0;
fail:
    st_image_free(c);
    return rc;
}

/* ---- the state hash (st_image.h) -------------------------------------------------------------- */

#define ST_WIDEN_SLICE 4096u /* fp32 elements widened at a time, on the stack */

uint64_t st_state_hash_blocks(uint64_t bytes)
{
    return (bytes + ST_STATE_HASH_BLOCK - 1) / ST_STATE_HASH_BLOCK;
}

typedef struct st_hash_job {
    const st_state_hash_seg *segs;
    uint32_t n_segs;
    const uint64_t *first; /* [n_segs + 1]: index of each segment's first digest */
    uint64_t *digests;
    int err;               /* first error of a task (written with atomics) */
} st_hash_job;

static void st_hash_block(void *arg, uint64_t i)
{
    st_hash_job *j = arg;
    uint32_t lo = 0, hi = j->n_segs;
    /* the last segment with first[lo] <= i: it holds digest i (an empty one never does) */
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (j->first[mid] <= i)
            lo = mid;
        else
            hi = mid;
    }
    const st_state_hash_seg *g = &j->segs[lo];
    uint64_t off = (i - j->first[lo]) * ST_STATE_HASH_BLOCK;
    uint64_t len = g->bytes - off < ST_STATE_HASH_BLOCK ? g->bytes - off : ST_STATE_HASH_BLOCK;
    if (g->widen < 0 || g->widen == ST_CODEC_FP32) {
        j->digests[i] = st_checksum((const uint8_t *)g->data + off, (size_t)len);
        return;
    }
    /* widened: elements [off / 4, (off + len) / 4) of the codec's array, hashed as fp32 */
    st_checksum_state cs = {0};
    float buf[ST_WIDEN_SLICE];
    size_t es = st_codec_elem_size((uint32_t)g->widen);
    const uint8_t *src = (const uint8_t *)g->data + off / 4 * es;
    uint64_t ne = len / 4;
    if (st_checksum_init(&cs)) {
        __atomic_store_n(&j->err, ENOMEM, __ATOMIC_RELAXED);
        return;
    }
    for (uint64_t e = 0; e < ne; e += ST_WIDEN_SLICE) {
        size_t k = ne - e < ST_WIDEN_SLICE ? (size_t)(ne - e) : ST_WIDEN_SLICE;
        st_codec_convert(ST_CODEC_FP32, buf, (uint32_t)g->widen, src + e * es, k, NULL, 0);
        st_checksum_update(&cs, buf, k * sizeof *buf);
    }
    j->digests[i] = st_checksum_final(&cs);
    st_checksum_free(&cs);
}

int st_state_hash_digests(const st_state_hash_seg *segs, uint32_t n_segs, uint64_t *digests,
                          st_state_hash_runner run, void *run_arg)
{
    st_hash_job j = {segs, n_segs, NULL, digests, 0};
    uint64_t *first = NULL, total = 0;
    if (n_segs == 0)
        return 0;
    if (!segs || !digests)
        return st_error_set(ST_EINVAL, "state hash: NULL segments or digests");
    first = malloc(((size_t)n_segs + 1) * sizeof *first);
    if (!first)
        return st_error_set(ENOMEM, "state hash: out of memory");
    for (uint32_t s = 0; s < n_segs; s++) {
        int32_t w = segs[s].widen;
        if (w >= 0 && (st_codec_check((uint32_t)w) || segs[s].bytes % 4)) {
            free(first);
            return st_error_set(ST_ECODEC, "state hash: segment %u widened from codec %d over "
                                "%llu bytes", s, (int)w, (unsigned long long)segs[s].bytes);
        }
        if (segs[s].bytes && !segs[s].data) {
            free(first);
            return st_error_set(ST_EINVAL, "state hash: segment %u has no data", s);
        }
        first[s] = total;
        total += st_state_hash_blocks(segs[s].bytes);
    }
    first[n_segs] = total;
    j.first = first;
    if (run)
        run(run_arg, total, st_hash_block, &j);
    else
        for (uint64_t i = 0; i < total; i++)
            st_hash_block(&j, i);
    free(first);
    if (j.err)
        return st_error_set(j.err, "state hash: out of memory for a block's state");
    return 0;
}

uint64_t st_state_hash_combine(uint64_t n_tokens, const uint64_t *digests, uint64_t n_digests)
{
    st_checksum_state cs = {0};
    uint64_t head[2] = {n_tokens, n_digests}, h;
    if (st_checksum_init(&cs)) {
        /* no memory for a streaming state: hash the same bytes laid out in one buffer */
        uint64_t *all = malloc((size_t)(n_digests + 2) * sizeof *all);
        if (!all)
            return 0; /* never a valid hash: the caller reports it */
        memcpy(all, head, sizeof head);
        if (n_digests)
            memcpy(all + 2, digests, (size_t)n_digests * sizeof *all);
        h = st_checksum(all, (size_t)(n_digests + 2) * sizeof *all);
        free(all);
        return h ? h : 1;
    }
    st_checksum_update(&cs, head, sizeof head);
    if (n_digests)
        st_checksum_update(&cs, digests, (size_t)n_digests * sizeof *digests);
    h = st_checksum_final(&cs);
    st_checksum_free(&cs);
    return h ? h : 1;
}

int st_image_state_hash_compute(const st_image *img, st_state_hash_runner run, void *run_arg,
                                uint64_t *out)
{
    st_state_hash_seg *segs = NULL;
    uint64_t *dg = NULL, total = 0, h;
    int rc;

    if (!out)
        return st_error_set(ST_EINVAL, "state hash: NULL output");
    *out = 0;
    if ((rc = st_image_check(img)))
        return rc;
    const st_ckpt *live = &img->ckpt[img->n_ckpt - 1];
    uint32_t ns = img->g.n_tensors + 1;
    segs = calloc(ns, sizeof *segs);
    if (!segs)
        return st_error_set(ENOMEM, "state hash: out of memory");
    segs[0].data = img->tokens;
    segs[0].bytes = img->n_tokens * 4;
    segs[0].widen = -1;
    for (uint32_t i = 0; i < img->g.n_tensors; i++) {
        const st_tensor_desc *t = &img->tensors[i];
        st_state_hash_seg *g = &segs[i + 1];
        g->widen = -1;
        if (t->role == ST_ROLE_KV) {
            g->data = img->kv[i];
            g->bytes = img->n_tokens * st_tensor_row_bytes(t);
            continue;
        }
        g->data = live->data + st_ckpt_offset(img, live->codec, i);
        if (t->dtype == ST_DTYPE_F32) {
            g->bytes = st_tensor_elems(t) * 4;
            g->widen = (int32_t)live->codec;
        } else {
            g->bytes = st_tensor_stored_bytes(t, live->codec);
        }
    }
    for (uint32_t s = 0; s < ns; s++)
        total += st_state_hash_blocks(segs[s].bytes);
    if (!(dg = malloc((size_t)(total ? total : 1) * sizeof *dg))) {
        rc = st_error_set(ENOMEM, "state hash: out of memory for %llu digests",
                          (unsigned long long)total);
        goto done;
    }
    if ((rc = st_state_hash_digests(segs, ns, dg, run, run_arg)))
        goto done;
    if (!(h = st_state_hash_combine(img->n_tokens, dg, total))) {
        rc = st_error_set(ENOMEM, "state hash: out of memory");
        goto done;
    }
    *out = h;
done:
    free(segs);
    free(dg);
    return rc;
}

int st_image_recode(st_image *img, uint32_t codec, st_state_hash_runner run, void *run_arg,
                    void (*progress)(void *arg, uint32_t done, uint32_t total), void *progress_arg)
{
    if (!img)
        return st_error_set(ST_EINVAL, "recode: no image");
    int rc = st_codec_check(codec);
    if (rc)
        return rc;
    uint32_t n = img->n_ckpt;
    uint64_t h = 0;
    int rehash = 0;
    /* the hash covers the live checkpoint's values as they widen: only its re-code changes it */
    if (n > 0 && img->state_hash != 0 && img->ckpt[n - 1].codec != codec &&
        !st_image_state_hash_compute(img, run, run_arg, &h))
        rehash = h == img->state_hash;
    st_error_clear();
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    if (!scratch)
        return st_error_set(ENOMEM, "recode: no memory for the %u-byte scratch",
                            (unsigned)ST_CODEC_SCRATCH_MAX);
    for (uint32_t ci = 0; ci < n && !rc; ci++) {
        rc = st_image_checkpoint_recode(img, ci, codec, scratch, ST_CODEC_SCRATCH_MAX);
        if (!rc && progress)
            progress(progress_arg, ci + 1, n);
    }
    free(scratch);
    if (!rc && rehash && !(rc = st_image_state_hash_compute(img, run, run_arg, &h)))
        img->state_hash = h;
    return rc;
}
