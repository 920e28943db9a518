/*
 * test_engine_cache_policy.c - the conversation-cache retention function: the root is never a
 * victim, the others rotate least-recently-used, mounting re-dates, K < 2 is plain FIFO.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include "st_engine.h"

static st_cache_entry ent(uint64_t pos, uint64_t created, uint64_t used, int root)
{
    st_cache_entry e = {pos, created, used, root};
    return e;
}

static st_cache_entry entt(uint64_t pos, uint64_t t, int root)
{
    return ent(pos, t, t, root);
}

/* Run a cache of capacity k over a sequence of inserts; return the positions left. */
static size_t insert(st_cache_entry *e, size_t n, size_t k, st_cache_entry add)
{
    e[n++] = add;
    int64_t v;
    while ((v = st_cache_victim(e, n, k)) >= 0) {
        for (size_t i = (size_t)v; i + 1 < n; i++)
            e[i] = e[i + 1];
        n--;
    }
    return n;
}

static int has(const st_cache_entry *e, size_t n, uint64_t pos)
{
    for (size_t i = 0; i < n; i++)
        if (e[i].position == pos)
            return 1;
    return 0;
}

static void test_no_victim_under_capacity(void **state)
{
    st_cache_entry e[3] = {ent(10, 1, 1, 0), ent(20, 2, 2, 0), ent(30, 3, 3, 0)};
    assert_int_equal(st_cache_victim(e, 3, 3), -1);
    assert_int_equal(st_cache_victim(e, 3, 6), -1);
    assert_int_equal(st_cache_victim(e, 0, 0), -1);
}

static void test_root_never_victim(void **state)
{
    /* the root is the oldest and least recently used, and still stays */
    st_cache_entry e[16];
    size_t n = 0;
    uint64_t tick = 0;
    n = insert(e, n, 3, entt(100, ++tick, 1));
    for (uint64_t p = 200; p <= 2000; p += 100) {
        n = insert(e, n, 3, entt(p, ++tick, 0));
        assert_true(n <= 3);
        assert_true(has(e, n, 100));
    }
    /* of two root-flagged entries only the deepest is pinned */
    st_cache_entry r[3] = {ent(50, 1, 1, 1), ent(100, 2, 2, 1), ent(300, 3, 3, 0)};
    assert_int_equal(st_cache_victim(r, 3, 2), 0);
}

static void test_lru_rotation(void **state)
{
    st_cache_entry e[4] = {ent(100, 1, 1, 1), ent(200, 2, 2, 0), ent(300, 3, 3, 0),
                           ent(400, 4, 4, 0)};
    /* least recently used non-root: 200 */
    assert_int_equal(st_cache_victim(e, 4, 3), 1);
    /* 200 used recently: now 300 goes */
    e[1].last_used = 10;
    assert_int_equal(st_cache_victim(e, 4, 3), 2);
    /* ties on last use: the older creation goes */
    st_cache_entry t[3] = {ent(10, 5, 7, 0), ent(20, 3, 7, 0), ent(30, 9, 9, 0)};
    assert_int_equal(st_cache_victim(t, 3, 2), 1);
}

static void test_mount_redates(void **state)
{
    st_cache_entry e[8];
    size_t n = 0;
    uint64_t tick = 0;
    n = insert(e, n, 3, entt(100, ++tick, 0));
    n = insert(e, n, 3, entt(200, ++tick, 0));
    n = insert(e, n, 3, entt(300, ++tick, 0));
    /* mount through 100: it is re-dated */
    int64_t m = st_cache_mount_point(e, n, 150);
    assert_true(m >= 0);
    assert_int_equal(e[m].position, 100);
    e[m].last_used = ++tick;
    n = insert(e, n, 3, entt(400, ++tick, 0));
    assert_true(has(e, n, 100));
    assert_false(has(e, n, 200));
    /* without the mount, 100 would have gone */
    st_cache_entry f[4] = {ent(100, 1, 1, 0), ent(200, 2, 2, 0), ent(300, 3, 3, 0)};
    n = insert(f, 3, 3, ent(400, 4, 4, 0));
    assert_false(has(f, n, 100));
    /* mount points */
    assert_int_equal(st_cache_mount_point(f, n, 50), -1);
    assert_int_equal(f[st_cache_mount_point(f, n, 399)].position, 300);
    assert_int_equal(f[st_cache_mount_point(f, n, 400)].position, 400);
}

static void test_k_below_two_is_fifo(void **state)
{
    /* K = 1: nothing pinned, first created goes first, whatever the last use */
    st_cache_entry e[2] = {ent(100, 1, 50, 1), ent(200, 2, 2, 0)};
    assert_int_equal(st_cache_victim(e, 2, 1), 0);
    st_cache_entry f[8];
    size_t n = 0;
    uint64_t tick = 0;
    for (uint64_t p = 100; p <= 500; p += 100) {
        n = insert(f, n, 1, entt(p, ++tick, p == 100));
        assert_int_equal(n, 1);
        assert_int_equal(f[0].position, p);
    }
    /* K = 0: everything goes */
    st_cache_entry g[2] = {ent(100, 1, 1, 1), ent(200, 2, 2, 0)};
    assert_int_equal(st_cache_victim(g, 2, 0), 0);
    assert_int_equal(st_cache_victim(g, 1, 0), 0);
    /* K = 2 pins the root */
    st_cache_entry h[3] = {ent(100, 1, 1, 1), ent(200, 2, 2, 0), ent(300, 3, 3, 0)};
    assert_int_equal(st_cache_victim(h, 3, 2), 1);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_no_victim_under_capacity),
        cmocka_unit_test(test_root_never_victim),
        cmocka_unit_test(test_lru_rotation),
        cmocka_unit_test(test_mount_redates),
        cmocka_unit_test(test_k_below_two_is_fifo),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
