/*
 * test_store_direct.c - the put's fast path (statestore/st_store_direct.c) and the plain mdb_put
 * it falls back to. Real LMDB stores, real images:
 *   - on this host (liblmdb 0.9, Linux) the probe at open turns the fast path on, and its puts
 *     write large chunks with pwrite;
 *   - STRATA_STORE_PLAIN_PUT forces the plain path: no pwrite, no populate, the reason in
 *     st_store_stat's put_path; puts, gets and check of the same images work and both stores
 *     hold exactly the same chunk and count records, byte for byte;
 *   - st_store__direct_check refuses another liblmdb version, another page size, and meta
 *     pages whose layout is not the one the fast path assumes (and accepts the real ones).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"
#include "st_test_image.h"
#include "st_test_util.h"

static int pwrites, populates;
static ssize_t (*real_pwrite)(int fd, const void *buf, size_t n, uint64_t off);
static int (*real_populate)(void *addr, size_t len);

static ssize_t count_pwrite(int fd, const void *buf, size_t n, uint64_t off)
{
    pwrites++;
    return real_pwrite(fd, buf, n, off);
}

static int count_populate(void *addr, size_t len)
{
    populates++;
    return real_populate(addr, len);
}

static st_store *open_store(const char *dir, st_store_sys *sys, int plain)
{
    st_store_sys_init(sys);
    real_pwrite = sys->pwrite;
    real_populate = sys->populate;
    sys->pwrite = count_pwrite;
    sys->populate = count_populate;
    if (plain)
        setenv("STRATA_STORE_PLAIN_PUT", "1", 1);
    else
        unsetenv("STRATA_STORE_PLAIN_PUT");
    st_store_opts o = {.create = 1, .sys = sys, .budget = 1ull << 30};
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &o), 0);
    unsetenv("STRATA_STORE_PLAIN_PUT");
    return st;
}

/* The images both stores get: two synthetic ones of 32 KiB K/V pages (chunks pwrite takes) that
 * share a prefix, one of them again compressed, and the small test image (inline chunks). */
typedef struct images {
    st_image *a, *b, *small;
} images;

static void images_make(images *im)
{
    st_synth_opts oa = {.seed = 5, .n_tokens = 3000, .n_checkpoints = 2, .n_layers = 8, .attn_every = 2};
    st_synth_opts ob = oa;
    ob.seed = 6;
    ob.prefix_seed = 5;
    ob.prefix_len = 2048;
    const uint32_t codecs[3] = {ST_CODEC_FP32, ST_CODEC_BF16, ST_CODEC_F16};
    assert_int_equal(st_image_synthesize(&oa, &im->a), 0);
    assert_int_equal(st_image_synthesize(&ob, &im->b), 0);
    assert_int_equal(st_test_image_small(&im->small, 7, codecs), 0);
    uint64_t h = 0; /* the frozen builder's hash is not the state hash a put checks */
    assert_int_equal(st_image_state_hash_compute(im->small, NULL, NULL, &h), 0);
    st_image_state_hash_set(im->small, h);
}

static void images_free(images *im)
{
    st_image_free(im->a);
    st_image_free(im->b);
    st_image_free(im->small);
}

static void put_all(st_store *st, const images *im)
{
    st_put_opts z = {.compress = 3};
    assert_int_equal(st_store_put(st, "a", im->a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "b", im->b, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "a", im->a, 0, NULL, NULL), 0); /* every chunk exists */
    assert_int_equal(st_store_put(st, "bz", im->b, 0, &z, NULL), 0);
    assert_int_equal(st_store_put(st, "small", im->small, 0, NULL, NULL), 0);
}

static void get_equal(st_store *st, const char *id, const st_image *want)
{
    st_image *got = NULL;
    assert_int_equal(st_store_get(st, id, 0, &got), 0);
    assert_int_equal(st_test_image_equal(got, want), 0);
    st_image_free(got);
}

static void check_clean(st_store *st)
{
    st_check_result r;
    memset(&r, 0, sizeof r);
    assert_int_equal(st_store_check(st, 1, NULL, NULL, &r), 0);
    assert_int_equal(r.problems, 0);
    assert_true(r.chunks > 0);
}

/* Every record of database dbi of two stores, compared key by key and byte by byte. */
static void db_equal(st_store *x, MDB_dbi dx, st_store *y, MDB_dbi dy, const char *name)
{
    MDB_txn *tx = NULL, *ty = NULL;
    MDB_cursor *cx = NULL, *cy = NULL;
    assert_int_equal(mdb_txn_begin(x->env, NULL, MDB_RDONLY, &tx), 0);
    assert_int_equal(mdb_txn_begin(y->env, NULL, MDB_RDONLY, &ty), 0);
    assert_int_equal(mdb_cursor_open(tx, dx, &cx), 0);
    assert_int_equal(mdb_cursor_open(ty, dy, &cy), 0);
    MDB_val kx, vx, ky, vy;
    size_t n = 0;
    for (int op = MDB_FIRST;; op = MDB_NEXT) {
        int rx = mdb_cursor_get(cx, &kx, &vx, op), ry = mdb_cursor_get(cy, &ky, &vy, op);
        if (rx != ry)
            fail_msg("%s: one store has %zu records, the other more", name, n);
        if (rx == MDB_NOTFOUND)
            break;
        assert_int_equal(rx, 0);
        if (kx.mv_size != ky.mv_size || memcmp(kx.mv_data, ky.mv_data, kx.mv_size) || vx.mv_size != vy.mv_size ||
            memcmp(vx.mv_data, vy.mv_data, vx.mv_size))
            fail_msg("%s: record %zu differs between the fast and the plain store", name, n);
        n++;
    }
    assert_true(n > 0);
    mdb_cursor_close(cx);
    mdb_cursor_close(cy);
    mdb_txn_abort(tx);
    mdb_txn_abort(ty);
}

static void test_fast_and_plain_store_the_same(void **state)
{
    (void)state;
    char dir[1024], dfast[1100], dplain[1100];
    st_test_tmpdir(dir, sizeof dir, "test_store_direct");
    snprintf(dfast, sizeof dfast, "%s/fast", dir);
    snprintf(dplain, sizeof dplain, "%s/plain", dir);
    images im;
    images_make(&im);
    st_store_sys sf, sp;
    int on = -1;

    st_store *fast = open_store(dfast, &sf, 0);
    const char *why = st_store__direct_status(fast, &on);
    if (!on) /* a host where an assumption fails: the plain path is all there is to test */
        print_message("fast path off on this host: %s\n", why);
    pwrites = populates = 0;
    put_all(fast, &im);
    if (on)
        assert_true(pwrites > 0); /* the fast path did write chunks itself */
    st_store_stats s;
    assert_int_equal(st_store_stat(fast, &s), 0);
    assert_string_equal(s.put_path, on ? "fast path" : s.put_path);

    st_store *plain = open_store(dplain, &sp, 1);
    why = st_store__direct_status(plain, &on);
    assert_int_equal(on, 0);
    assert_non_null(strstr(why, "STRATA_STORE_PLAIN_PUT"));
    assert_int_equal(st_store_stat(plain, &s), 0);
    assert_int_equal(strncmp(s.put_path, "plain mdb_put: ", 15), 0);
    assert_non_null(strstr(s.put_path, "STRATA_STORE_PLAIN_PUT"));
    pwrites = populates = 0;
    put_all(plain, &im);
    assert_int_equal(pwrites, 0);
    assert_int_equal(populates, 0);

    for (int k = 0; k < 2; k++) {
        st_store *st = k ? plain : fast;
        get_equal(st, "a", im.a);
        get_equal(st, "b", im.b);
        get_equal(st, "bz", im.b);
        get_equal(st, "small", im.small);
        check_clean(st);
    }
    db_equal(fast, fast->dbi_chunks, plain, plain->dbi_chunks, "chunks");
    db_equal(fast, fast->dbi_refcounts, plain, plain->dbi_refcounts, "refcounts");

    /* each reopens the other's store: the bytes do not depend on the path that wrote them */
    st_store_close(fast);
    st_store_close(plain);
    fast = open_store(dplain, &sf, 0);
    plain = open_store(dfast, &sp, 1);
    assert_int_equal(st_store_put(fast, "c", im.b, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(plain, "c", im.b, 0, NULL, NULL), 0);
    get_equal(fast, "a", im.a);
    get_equal(plain, "c", im.b);
    check_clean(fast);
    check_clean(plain);
    st_store_close(fast);
    st_store_close(plain);
    images_free(&im);
    st_test_rmdir(dir);
}

/* The two meta pages of a real store, as the probe reads them. */
static void real_metas(uint8_t m0[ST_DIRECT_PROBE_BYTES], uint8_t m1[ST_DIRECT_PROBE_BYTES], uint32_t *psize)
{
    char dir[1024], path[1100];
    st_store_sys sys;
    st_test_tmpdir(dir, sizeof dir, "test_store_direct_meta");
    st_store *st = open_store(dir, &sys, 0);
    MDB_stat ms;
    assert_int_equal(mdb_env_stat(st->env, &ms), 0);
    *psize = ms.ms_psize;
    st_store_close(st);
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    size_t len = 0;
    uint8_t *f = st_test_slurp(path, &len);
    assert_non_null(f);
    assert_true(len >= 2 * (size_t)*psize);
    memcpy(m0, f, ST_DIRECT_PROBE_BYTES);
    memcpy(m1, f + *psize, ST_DIRECT_PROBE_BYTES);
    free(f);
    st_test_rmdir(dir);
}

static void test_check_refuses_what_it_does_not_know(void **state)
{
    (void)state;
    uint8_t m0[ST_DIRECT_PROBE_BYTES], m1[ST_DIRECT_PROBE_BYTES], x[ST_DIRECT_PROBE_BYTES];
    uint32_t psize = 0;
    char why[256];
    long os = sysconf(_SC_PAGESIZE);
    real_metas(m0, m1, &psize);
    int major = 0, minor = 0;
    mdb_version(&major, &minor, NULL);
    if (major == 0 && minor == 9) {
        assert_int_equal(st_store__direct_check(0, 9, psize, os, m0, m1, sizeof m0, why, sizeof why), 1);
        assert_string_equal(why, "");
    }
    /* other releases of liblmdb */
    assert_int_equal(st_store__direct_check(0, 10, psize, os, m0, m1, sizeof m0, why, sizeof why), 0);
    assert_non_null(strstr(why, "liblmdb is 0.10"));
    assert_int_equal(st_store__direct_check(1, 0, psize, os, m0, m1, sizeof m0, why, sizeof why), 0);
    assert_non_null(strstr(why, "liblmdb is 1.0"));
    /* page sizes */
    assert_int_equal(st_store__direct_check(0, 9, 2048, os, m0, m1, sizeof m0, why, sizeof why), 0);
    assert_non_null(strstr(why, "page size 2048"));
    assert_int_equal(st_store__direct_check(0, 9, psize * 2, os, m0, m1, sizeof m0, why, sizeof why), 0);
    assert_non_null(strstr(why, "records page size"));
    /* the layout probe: each field of the meta page it relies on, damaged in turn */
    static const struct {
        size_t off;
        const char *why;
    } fields[] = {{0, "page number"}, {10, "no P_META"}, {16, "magic"}, {20, "data version"}, {40, "page size"}};
    for (size_t i = 0; i < sizeof fields / sizeof fields[0]; i++) {
        memcpy(x, m0, sizeof x);
        x[fields[i].off] ^= fields[i].off == 10 ? 0x08 : 0x01;
        assert_int_equal(st_store__direct_check(0, 9, psize, os, x, m1, sizeof x, why, sizeof why), 0);
        assert_non_null(strstr(why, fields[i].why));
        memcpy(x, m1, sizeof x);
        x[fields[i].off] ^= fields[i].off == 10 ? 0x08 : 0x01;
        assert_int_equal(st_store__direct_check(0, 9, psize, os, m0, x, sizeof x, why, sizeof why), 0);
        assert_non_null(strstr(why, "meta page 1"));
    }
    assert_int_equal(st_store__direct_check(0, 9, psize, os, m1, m0, sizeof m0, why, sizeof why), 0);
    assert_int_equal(st_store__direct_check(0, 9, psize, os, NULL, m1, sizeof m0, why, sizeof why), 0);
    assert_non_null(strstr(why, "could not be read"));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_fast_and_plain_store_the_same),
        cmocka_unit_test(test_check_refuses_what_it_does_not_know),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
