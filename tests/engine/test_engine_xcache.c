/*
 * test_engine_xcache.c - the routed-expert cache's host half (engine/st_xcache.c), on any
 * machine: the arena's refusal when it holds fewer records than one token's experts, the
 * mapping of a call's experts to slots (hits first, misses into never-used slots in order, then
 * the least recently used), a call larger than the arena refused with nothing changed, bad ids
 * and repeats refused, a dropped slot mapped again, and over 20,000 random calls: the key and
 * slot maps inverse of each other, the figures adding up, and every eviction taking a key no
 * more recently used than any other resident key outside the call (an independent record of
 * each key's last use). And the option on the CPU backend: st_engine_opts.expert_cache_bytes is
 * ignored there (the same logits, every figure 0); its device half: tests/gpu/test_gpu_xcache.c.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine_test.h"
#include "st_engine_int.h"

static void test_init(void **state)
{
    (void)state;
    st_xcache c;
    /* 3 records of 1 MiB for a top-4 selection: refused, the caller streams */
    assert_int_equal(st_xcache_init(&c, 2, 8, 1 << 20, 3 << 20, 4), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "streamed"));
    assert_int_equal(st_xcache_init(&c, 0, 8, 1 << 20, 8 << 20, 2), ST_EINVAL);
    assert_int_equal(st_xcache_init(&c, 2, 8, 1 << 20, 8 << 20, 9), ST_EINVAL);
    /* more room than experts: one slot per expert */
    assert_int_equal(st_xcache_init(&c, 2, 8, 1 << 20, 64 << 20, 2), 0);
    assert_int_equal(c.n_slots, 16);
    st_xcache_release(&c);
    assert_int_equal(st_xcache_init(&c, 2, 8, 1 << 20, (4 << 20) + 5, 2), 0);
    assert_int_equal(c.n_slots, 4);
    st_xcache_release(&c);
}

static void map_ok(st_xcache *c, uint32_t layer, const uint32_t *e, uint32_t n,
                   const uint32_t *want_slots, const uint8_t *want_load)
{
    uint32_t slots[16];
    uint8_t load[16];
    assert_int_equal(st_xcache_map(c, layer, e, n, slots, load), 0);
    for (uint32_t i = 0; i < n; i++) {
        assert_int_equal(slots[i], want_slots[i]);
        assert_int_equal(load[i], want_load[i]);
    }
}

static void test_order(void **state)
{
    (void)state;
    st_xcache c;
    assert_int_equal(st_xcache_init(&c, 2, 8, 1000, 4000, 2), 0);
    map_ok(&c, 0, (uint32_t[]){1, 2}, 2, (uint32_t[]){0, 1}, (uint8_t[]){1, 1});
    map_ok(&c, 0, (uint32_t[]){2, 3}, 2, (uint32_t[]){1, 2}, (uint8_t[]){0, 1});
    map_ok(&c, 1, (uint32_t[]){1}, 1, (uint32_t[]){3}, (uint8_t[]){1});
    /* full: expert 1 of layer 0 (last used by call 1) goes, then the tie of slots 1 and 2 (call
     * 2) to the lower slot: expert 2 */
    map_ok(&c, 0, (uint32_t[]){4, 5}, 2, (uint32_t[]){0, 1}, (uint8_t[]){1, 1});
    assert_int_equal(c.slot[1], -1);
    assert_int_equal(c.slot[2], -1);
    assert_int_equal(c.slot[3], 2);
    assert_int_equal(c.slot[8 + 1], 3);
    /* a hit is never evicted by a miss of the same call */
    map_ok(&c, 0, (uint32_t[]){6, 3}, 2, (uint32_t[]){3, 2}, (uint8_t[]){1, 0});
    assert_int_equal(c.slot[8 + 1], -1);
    assert_int_equal(c.hits, 2);
    assert_int_equal(c.misses, 7);
    assert_int_equal(c.evictions, 3);
    assert_int_equal(c.bytes_uploaded, 7000);
    /* more experts than slots: refused, nothing changes */
    st_xcache before = c;
    int32_t map[16];
    memcpy(map, c.slot, sizeof map);
    uint32_t slots[8];
    uint8_t load[8];
    assert_int_equal(st_xcache_map(&c, 1, (uint32_t[]){0, 1, 2, 3, 4}, 5, slots, load),
                     ST_ETOOBIG);
    assert_memory_equal(map, c.slot, sizeof map);
    assert_int_equal(c.call, before.call);
    assert_int_equal(c.misses, before.misses);
    /* bad ids and repeats */
    assert_int_equal(st_xcache_map(&c, 2, (uint32_t[]){0}, 1, slots, load), ST_EINVAL);
    assert_int_equal(st_xcache_map(&c, 0, (uint32_t[]){8}, 1, slots, load), ST_EINVAL);
    assert_int_equal(st_xcache_map(&c, 0, (uint32_t[]){3, 3}, 2, slots, load), ST_EINVAL);
    assert_memory_equal(map, c.slot, sizeof map);
    /* a dropped slot (a failed upload) is empty: its expert misses again, into that slot */
    st_xcache_drop(&c, 2);
    assert_int_equal(c.slot[3], -1);
    map_ok(&c, 0, (uint32_t[]){3}, 1, (uint32_t[]){2}, (uint8_t[]){1});
    st_xcache_release(&c);
}

static void test_random(void **state)
{
    (void)state;
    enum { L = 3, X = 16, K = 4, SLOTS = 10, CALLS = 20000 };
    st_xcache c;
    assert_int_equal(st_xcache_init(&c, L, X, 64, SLOTS * 64, K), 0);
    uint64_t last[L * X] = {0}, now = 0, asked = 0;
    int resident[L * X] = {0};
    uint64_t x = 12345;
    for (int call = 0; call < CALLS; call++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        uint32_t layer = (uint32_t)(x % L), n = 1 + (uint32_t)((x >> 8) % (2 * K)), e[2 * K];
        for (uint32_t i = 0; i < n; i++) {
            uint32_t v;
            int dup;
            do {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                v = (uint32_t)(x % 7) * 2 + (uint32_t)(x >> 20) % 3; /* a skewed choice */
                v %= X;
                dup = 0;
                for (uint32_t j = 0; j < i; j++)
                    dup |= e[j] == v;
            } while (dup);
            e[i] = v;
        }
        uint32_t slots[2 * K];
        uint8_t load[2 * K];
        int rc = st_xcache_map(&c, layer, e, n, slots, load);
        if (n > SLOTS) {
            assert_int_equal(rc, ST_ETOOBIG);
            continue;
        }
        assert_int_equal(rc, 0);
        now++;
        asked += n;
        int in_call[L * X] = {0};
        for (uint32_t i = 0; i < n; i++)
            in_call[layer * X + e[i]] = 1;
        /* each key the call evicted was no more recent than any resident key it kept */
        for (uint32_t k = 0; k < L * X; k++) {
            if (!resident[k] || c.slot[k] >= 0)
                continue;
            for (uint32_t o = 0; o < L * X; o++)
                if (resident[o] && c.slot[o] >= 0 && !in_call[o])
                    assert_true(last[k] <= last[o]);
        }
        for (uint32_t i = 0; i < n; i++) {
            uint32_t k = layer * X + e[i];
            assert_int_equal(load[i], !resident[k]);
            assert_int_equal(c.slot[k], (int32_t)slots[i]);
            last[k] = now;
        }
        uint32_t count = 0;
        for (uint32_t k = 0; k < L * X; k++) {
            resident[k] = c.slot[k] >= 0;
            if (resident[k]) {
                count++;
                assert_int_equal(c.key[c.slot[k]], k);
            }
        }
        for (uint32_t s = 0; s < SLOTS; s++)
            if (c.key[s] != UINT32_MAX)
                assert_int_equal(c.slot[c.key[s]], (int32_t)s);
        assert_true(count <= SLOTS);
    }
    assert_int_equal(c.hits + c.misses, asked);
    assert_int_equal(c.bytes_uploaded, c.misses * 64);
    assert_true(c.evictions > 1000 && c.hits > 1000);
    st_xcache_release(&c);
}

/* The last logits of a prompt of 24 tokens on the CPU backend with an expert cache of `bytes`. */
static float *cpu_logits(const st_model *m, uint64_t bytes, st_engine_xcache *xc)
{
    st_engine_opts o;
    st_engine_opts_default(&o);
    o.backend = "cpu";
    o.n_threads = 2;
    o.ubatch = 8;
    o.n_ctx = 64;
    o.expert_cache_bytes = bytes;
    st_engine *e = NULL;
    assert_int_equal(st_engine_new(m, &o, &e), 0);
    assert_true(st_engine_opts_get(e)->expert_cache_bytes == bytes);
    st_slot *s = NULL;
    assert_int_equal(st_slot_new(e, &s), 0);
    uint32_t V = st_model_hparams_get(m)->n_vocab, t[24];
    for (uint32_t i = 0; i < 24; i++)
        t[i] = 1 + (i * 37) % (V - 1);
    assert_int_equal(st_slot_eval(s, t, 24, 0, NULL), 0);
    float *l = malloc((size_t)V * 4);
    assert_non_null(l);
    memcpy(l, st_slot_logits(s, NULL), (size_t)V * 4);
    memset(xc, 0xff, sizeof *xc);
    assert_int_equal(st_engine_xcache_get(e, xc), 0);
    st_slot_free(s);
    st_engine_free(e);
    return l;
}

static void test_cpu_ignores(void **state)
{
    (void)state;
    char dir[4096], path[4200];
    st_test_tmpdir(dir, sizeof dir, "engine_xcache");
    st_model_hparams hp;
    assert_int_equal(st_model_preset_arch("qwen35moe", "tiny", &hp), 0);
    snprintf(path, sizeof path, "%s/moe.gguf", dir);
    assert_int_equal(st_model_write_seeded(&hp, 3, "moe", path), 0);
    st_model *m = NULL;
    assert_int_equal(st_model_load(path, &m), 0);
    st_engine_xcache a, b, zero;
    memset(&zero, 0, sizeof zero);
    float *la = cpu_logits(m, 0, &a), *lb = cpu_logits(m, 1 << 20, &b);
    assert_memory_equal(la, lb, (size_t)hp.n_vocab * 4);
    assert_memory_equal(&a, &zero, sizeof zero);
    assert_memory_equal(&b, &zero, sizeof zero);
    assert_int_equal(st_engine_xcache_get(NULL, &a), ST_EINVAL);
    free(la);
    free(lb);
    st_model_free(m);
    st_test_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_init),
        cmocka_unit_test(test_order),
        cmocka_unit_test(test_random),
        cmocka_unit_test(test_cpu_ignores),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
