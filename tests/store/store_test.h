/*
 * store_test.h - helpers shared by the LMDB store's tests: synthetic images, image equality,
 * a report collector for check, reading the store's internals (white-box).
 */
#ifndef STORE_TEST_H
#define STORE_TEST_H

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <string.h>

#include "st_file.h"
#include "st_store.h"
#include "st_store_lmdb_int.h"
#include "st_test_util.h"

/* A synthetic image: page_size 256 tokens, K/V rows of 128 bytes (32 KiB pages: one chunk each). */
static inline st_image *store_test_image(uint64_t seed, uint64_t n_tokens, uint64_t prefix_seed,
                                         uint64_t prefix_len)
{
    st_synth_opts o = {.seed = seed, .n_tokens = n_tokens, .n_checkpoints = 2,
                       .prefix_seed = prefix_seed, .prefix_len = prefix_len};
    st_image *img = NULL;
    assert_int_equal(st_image_synthesize(&o, &img), 0);
    return img;
}

/* Index of the first K/V tensor of img. */
static inline uint32_t store_test_kv(const st_image *img)
{
    const st_geometry *g = st_image_geometry(img);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++)
        if (g->tensors[ti].role == ST_ROLE_KV)
            return ti;
    fail_msg("no K/V tensor");
    return 0;
}

/* The bytes of img as a v2 session file (a complete, deterministic serialisation). */
static inline uint8_t *store_test_bytes(const st_image *img, size_t *len)
{
    st_file_write_opts fo = {.version = 2};
    uint8_t *b = NULL;
    assert_int_equal(st_file_write_mem(img, &fo, &b, len), 0);
    return b;
}

static inline int store_test_equal(const st_image *a, const st_image *b)
{
    size_t la, lb;
    uint8_t *ba = store_test_bytes(a, &la), *bb = store_test_bytes(b, &lb);
    int eq = la == lb && !memcmp(ba, bb, la);
    free(ba);
    free(bb);
    return eq;
}

/* Get id@version and compare with want. */
static inline void store_test_assert_get(st_store *st, const char *id, uint64_t version, const st_image *want)
{
    st_image *got = NULL;
    int rc = st_store_get(st, id, version, &got);
    if (rc)
        print_error("get %s@%llu: %s: %s\n", id, (unsigned long long)version, st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    assert_true(store_test_equal(got, want));
    st_image_free(got);
}

typedef struct store_test_problems {
    int n;
    uint32_t kind[32];
    char chunk[32][2 * ST_STORE_HASH_LEN + 1];
    char session[32][ST_STORE_ID_MAX + 1];
    int verbose;
} store_test_problems;

static inline void store_test_report(void *arg, const st_check_problem *p)
{
    store_test_problems *c = arg;
    if (c->verbose)
        print_error("check: kind %u session %s v%llu chunk %s: %s\n", p->kind, p->session,
                    (unsigned long long)p->version, p->chunk, p->message);
    if (c->n < 32) {
        c->kind[c->n] = p->kind;
        snprintf(c->chunk[c->n], sizeof c->chunk[0], "%s", p->chunk);
        snprintf(c->session[c->n], sizeof c->session[0], "%s", p->session);
    }
    c->n++;
}

/* check (with read_data) must find nothing. */
static inline void store_test_assert_clean(st_store *st)
{
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    pr.verbose = 1;
    st_check_result res;
    int rc = st_store_check(st, 1, store_test_report, &pr, &res);
    if (rc)
        print_error("check: %s: %s\n", st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    assert_int_equal(res.problems, 0);
    assert_int_equal(pr.n, 0);
}

/* The reference count of the chunk whose stored bytes are p[0..n) (0 if absent). */
static inline uint64_t store_test_refcount(st_store *st, const void *p, size_t n)
{
    uint8_t h[ST_STORE_HASH_LEN];
    assert_int_equal(st_store_sha256(p, n, h), 0);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    MDB_val k = {ST_STORE_HASH_LEN, h}, v;
    uint64_t cnt = 0;
    if (mdb_get(txn, st->dbi_refcounts, &k, &v) == 0 && v.mv_size == 8)
        cnt = st_get64(v.mv_data);
    mdb_txn_abort(txn);
    return cnt;
}

#endif
