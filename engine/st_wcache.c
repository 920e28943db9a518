/*
 * st_wcache.c - the BF16 -> FP16 weight-conversion cache's host half: its configuration, parsed
 * strictly from the environment, and the bookkeeping of one owner's arena (which weight is
 * where). The device half (the arena's memory, the conversion kernel, the FP16 products) is in
 * st_backend_cuda.cu; this file has no CUDA in it, so CI tests it on any machine.
 *
 * Invariants:
 * 1. Configuration: STRATA_BF16_TC unset, "" or "0": the native path; "1": the FP16 tensor-core
 *    path on a card without native BF16; "2": on any CUDA card (for tests). The cache is on only
 *    for the exact STRATA_BF16_TC_CACHE=1; STRATA_BF16_TC_CACHE_MIB is decimal digits for
 *    1..65536 (default 256). Any other value of either turns the cache off with a diagnostic,
 *    and any other STRATA_BF16_TC turns the path off with one: a typo never enables anything.
 * 2. The arena never evicts: an entry, once admitted, keeps its bytes until
 *    st_wcache_invalidate, which drops every entry and starts admitting at offset 0 again (the
 *    owner keeps the memory). A miss that does not fit what is left (or the whole arena) is
 *    answered ST_WCACHE_BYPASS: the caller converts into its per-call scratch and nothing
 *    resident moves.
 * 3. Entries are keyed by (source address, rows, cols): one address read as two shapes is two
 *    entries. Only the owner's immutable weights are looked up (the backend's rule); the arena
 *    cannot tell a mutated buffer, which is why mutable buffers never come here.
 * 4. Offsets are multiples of ST_WCACHE_ALIGN, and an entry's bytes lie in [0, cap).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

/* "1".."65536" in plain decimal digits (no sign, spaces or suffix): the value, else 0. */
static uint32_t parse_mib(const char *s)
{
    uint64_t v = 0;
    size_t n = strlen(s);
    if (n == 0 || n > 5)
        return 0;
    for (size_t i = 0; i < n; i++) {
        if (s[i] < '0' || s[i] > '9')
            return 0;
        v = v * 10 + (uint64_t)(s[i] - '0');
    }
    return v >= 1 && v <= 65536 ? (uint32_t)v : 0;
}

static void diag_add(char *diag, size_t cap, const char *fmt, const char *v)
{
    size_t at = strlen(diag);
    if (at + 1 >= cap)
        return;
    char val[48];
    snprintf(val, sizeof val, "%.40s%s", v, strlen(v) > 40 ? "..." : "");
    snprintf(diag + at, cap - at, fmt, val);
}

void st_wcache_parse(const char *tc, const char *cache, const char *mib, st_wcache_cfg *cfg,
                     char *diag, size_t diag_cap)
{
    char own[512]; /* where the diagnostic goes when the caller wants none */
    memset(cfg, 0, sizeof *cfg);
    cfg->mib = ST_WCACHE_MIB_DEFAULT;
    if (!diag || !diag_cap) {
        diag = own;
        diag_cap = sizeof own;
    }
    diag[0] = 0;
    if (tc && *tc && strcmp(tc, "0")) {
        if (!strcmp(tc, "1"))
            cfg->mode = 1;
        else if (!strcmp(tc, "2"))
            cfg->mode = 2;
        else
            diag_add(diag, diag_cap, "STRATA_BF16_TC=\"%s\" is not 0, 1 or 2: the FP16 path "
                     "stays off; ", tc);
    }
    int cache_ok = 1;
    if (cache && *cache && strcmp(cache, "1")) {
        if (strcmp(cache, "0"))
            diag_add(diag, diag_cap, "STRATA_BF16_TC_CACHE=\"%s\" is not 1 (only the exact 1 "
                     "enables the cache): the cache stays off; ", cache);
        cache_ok = 0;
    }
    if (mib) {
        uint32_t v = parse_mib(mib);
        if (!v) {
            diag_add(diag, diag_cap, "STRATA_BF16_TC_CACHE_MIB=\"%s\" is not a whole number of "
                     "MiB in 1..65536: the cache stays off; ", mib);
            cache_ok = 0;
        } else {
            cfg->mib = v;
        }
    }
    cfg->cache = cache_ok && cache && !strcmp(cache, "1");
    size_t n = strlen(diag);
    if (n >= 2 && diag[n - 2] == ';')
        diag[n - 2] = 0;
}

void st_wcache_from_env(st_wcache_cfg *cfg, char *diag, size_t diag_cap)
{
    st_wcache_parse(getenv("STRATA_BF16_TC"), getenv("STRATA_BF16_TC_CACHE"),
                    getenv("STRATA_BF16_TC_CACHE_MIB"), cfg, diag, diag_cap);
}

void st_wcache_init(st_wcache *a, uint64_t cap)
{
    memset(a, 0, sizeof *a);
    a->cap = cap;
}

void st_wcache_release(st_wcache *a)
{
    free(a->ent);
    a->ent = NULL;
    a->n = a->n_cap = 0;
}

int st_wcache_lookup(st_wcache *a, const void *src, uint32_t rows, uint32_t cols,
                     uint64_t bytes, uint64_t *off)
{
    for (uint32_t i = 0; i < a->n; i++) {
        const st_wcache_entry *e = &a->ent[i];
        if (e->src == src && e->rows == rows && e->cols == cols) {
            a->hits++;
            *off = e->off;
            return ST_WCACHE_HIT;
        }
    }
    a->misses++;
    uint64_t at = (a->used + ST_WCACHE_ALIGN - 1) / ST_WCACHE_ALIGN * ST_WCACHE_ALIGN;
    if (bytes == 0 || bytes > a->cap || at > a->cap || bytes > a->cap - at) {
        a->bypassed++;
        return ST_WCACHE_BYPASS;
    }
    if (a->n == a->n_cap) {
        uint32_t nc = a->n_cap ? 2 * a->n_cap : 64;
        st_wcache_entry *ne = (st_wcache_entry *)realloc(a->ent, (size_t)nc * sizeof *ne);
        if (!ne) {
            a->bypassed++; /* no memory for the table: this product converts per call */
            return ST_WCACHE_BYPASS;
        }
        a->ent = ne;
        a->n_cap = nc;
    }
    a->ent[a->n++] = (st_wcache_entry){src, rows, cols, at, bytes};
    a->used = at + bytes;
    a->admitted_bytes += bytes;
    *off = at;
    return ST_WCACHE_ADMIT;
}

void st_wcache_drop_last(st_wcache *a)
{
    if (!a->n)
        return;
    a->n--;
    a->admitted_bytes -= a->ent[a->n].bytes;
    a->used = a->n ? a->ent[a->n - 1].off + a->ent[a->n - 1].bytes : 0;
}

void st_wcache_invalidate(st_wcache *a)
{
    a->n = 0;
    a->used = 0;
    a->invalidations++;
}
