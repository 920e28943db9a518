/*
 * st_mem_kv.c - the paged K/V memory of a slot (st_engine_int.h): per K/V layer of the memory
 * spec, K and V pages (and for int8 the pages of their scales).
 *
 * Invariants:
 * 1. Page p of every table holds rows [p * page_size, (p + 1) * page_size); a page is allocated
 *    zeroed when a row in it is first reserved or written, and lives until the module is freed.
 * 2. Every access is checked against n_ctx rows; nothing else is assumed about the rows (rows
 *    beyond a slot's position may hold bytes of an abandoned branch).
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

enum { KV_K, KV_V, KV_KS, KV_VS, KV_TABLES };

typedef struct kv_layer {
    uint8_t **tab[KV_TABLES]; /* scale tables NULL unless i8 */
    uint64_t rb[KV_TABLES];   /* bytes of a row of each */
    uint32_t kv_heads, head_dim;
} kv_layer;

struct st_kvmem {
    uint32_t n_ctx, page_size, n_pages, dtype, n_layer;
    kv_layer *l; /* per K/V slot */
};

void st_kvmem_free(st_kvmem *kv)
{
    if (!kv)
        return;
    for (uint32_t a = 0; kv->l && a < kv->n_layer; a++)
        for (int t = 0; t < KV_TABLES; t++) {
            uint8_t **pp = kv->l[a].tab[t];
            if (!pp)
                continue;
            for (uint32_t p = 0; p < kv->n_pages; p++)
                free(pp[p]);
            free(pp);
        }
    free(kv->l);
    free(kv);
}

int st_kvmem_new(const st_mem_spec *ms, uint32_t n_ctx, uint32_t page_size, uint32_t kv_dtype,
                 st_kvmem **out)
{
    *out = NULL;
    st_kvmem *kv = calloc(1, sizeof *kv);
    if (!kv)
        return st_error_set(ENOMEM, "K/V memory");
    kv->n_ctx = n_ctx;
    kv->page_size = page_size;
    kv->n_pages = (n_ctx + page_size - 1) / page_size;
    kv->dtype = kv_dtype;
    kv->n_layer = ms->n_kv;
    kv->l = calloc(ms->n_kv ? ms->n_kv : 1, sizeof *kv->l);
    int err = !kv->l;
    for (uint32_t il = 0; !err && il < ms->n_layer; il++) {
        const st_mem_layer *ml = &ms->layer[il];
        if (ml->kind != ST_MEM_KV)
            continue;
        kv_layer *L = &kv->l[ml->slot];
        L->kv_heads = ml->kv_heads;
        L->head_dim = ml->head_dim;
        L->rb[KV_K] = L->rb[KV_V] = st_mem_kv_row_bytes(ml, kv_dtype);
        L->rb[KV_KS] = L->rb[KV_VS] = st_mem_kv_scale_bytes(ml, kv_dtype);
        for (int t = 0; t < (kv_dtype == ST_DTYPE_I8 ? KV_TABLES : KV_KS); t++)
            if (!(L->tab[t] = calloc(kv->n_pages ? kv->n_pages : 1, sizeof *L->tab[t])))
                err = 1;
    }
    if (err) {
        st_kvmem_free(kv);
        return st_error_set(ENOMEM, "K/V memory");
    }
    *out = kv;
    return 0;
}

int st_kvmem_reserve(st_kvmem *kv, uint64_t r0, uint64_t r1)
{
    if (r1 <= r0)
        return 0;
    uint64_t p0 = r0 / kv->page_size, p1 = (r1 - 1) / kv->page_size;
    for (uint32_t a = 0; a < kv->n_layer; a++)
        for (uint64_t p = p0; p <= p1; p++)
            for (int t = 0; t < KV_TABLES; t++) {
                uint8_t **pp = kv->l[a].tab[t];
                if (!pp || pp[p])
                    continue;
                if (!(pp[p] = calloc(kv->page_size, kv->l[a].rb[t])))
                    return st_error_set(ENOMEM, "K/V page %llu", (unsigned long long)p);
            }
    return 0;
}

void st_kvmem_view(const st_kvmem *kv, uint32_t slot, st_kv_view *v)
{
    const kv_layer *L = &kv->l[slot];
    v->k = L->tab[KV_K];
    v->v = L->tab[KV_V];
    v->ks = L->tab[KV_KS];
    v->vs = L->tab[KV_VS];
    v->page_size = kv->page_size;
    v->dtype = kv->dtype;
    v->kv_heads = L->kv_heads;
    v->head_dim = L->head_dim;
    v->row = L->rb[KV_K];
    v->srow = L->rb[KV_KS];
}

/* The K/V tensor index of a state tensor kind, or -1 when the kind is not K/V. */
static int kv_kind(uint32_t what)
{
    switch (what) {
    case ST_SW_K: return KV_K;
    case ST_SW_V: return KV_V;
    case ST_SW_KS: return KV_KS;
    case ST_SW_VS: return KV_VS;
    default: return -1;
    }
}

int st_kvmem_io(st_kvmem *kv, uint32_t slot, uint32_t what, uint64_t row0, uint64_t nrows,
                void *buf, int write)
{
    int t = kv_kind(what);
    if (t < 0)
        return st_error_set(ST_EINVAL, "K/V memory: tensor kind %u is not K/V", what);
    if (slot >= kv->n_layer || !kv->l[slot].tab[t])
        return st_error_set(ST_EINVAL, "K/V memory: no such tensor (layer %u, kind %u)", slot,
                            what);
    if (row0 > kv->n_ctx || nrows > kv->n_ctx - row0)
        return st_error_set(ST_EINVAL, "K/V rows [%llu, +%llu) beyond %u",
                            (unsigned long long)row0, (unsigned long long)nrows, kv->n_ctx);
    uint8_t **pages = kv->l[slot].tab[t];
    uint64_t rb = kv->l[slot].rb[t];
    uint8_t *b = buf;
    uint64_t r = row0, end = row0 + nrows;
    while (r < end) {
        uint64_t p = r / kv->page_size, in = r % kv->page_size;
        uint64_t k = kv->page_size - in;
        if (k > end - r)
            k = end - r;
        if (!pages[p]) {
            if (!write)
                return st_error_set(ST_EINVAL, "K/V page %llu never written",
                                    (unsigned long long)p);
            if (!(pages[p] = calloc(kv->page_size, rb)))
                return st_error_set(ENOMEM, "K/V page");
        }
        if (write)
            memcpy(pages[p] + in * rb, b, k * rb);
        else
            memcpy(b, pages[p] + in * rb, k * rb);
        b += k * rb;
        r += k;
    }
    return 0;
}

int st_kvmem_copy(st_kvmem *kv, uint32_t slot, uint32_t what, uint64_t off, uint64_t len,
                  void *buf, int write, st_checksum_state *cs)
{
    /* runs on the engine's pool: the caller reports the code (errors are per thread) */
    int t = kv_kind(what);
    if (t < 0)
        return ST_EINVAL;
    if (slot >= kv->n_layer || !kv->l[slot].tab[t])
        return ST_EINVAL;
    uint8_t **pages = kv->l[slot].tab[t];
    uint64_t pb = (uint64_t)kv->page_size * kv->l[slot].rb[t];
    if (off > (uint64_t)kv->n_ctx * kv->l[slot].rb[t] ||
        len > (uint64_t)kv->n_ctx * kv->l[slot].rb[t] - off)
        return ST_EINVAL;
    uint8_t *b = buf;
    while (len) {
        uint64_t p = off / pb, in = off % pb, k = pb - in < len ? pb - in : len;
        if (!pages[p])
            return ST_EINVAL;
        uint8_t *dst = write ? pages[p] + in : b;
        memcpy(dst, write ? b : pages[p] + in, k);
        if (cs)
            st_checksum_update(cs, dst, k);
        b += k;
        off += k;
        len -= k;
    }
    return 0;
}
