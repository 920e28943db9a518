/*
 * test_store.c - every operation of the LMDB store: put/get round trips, versions and heads,
 * conflicts, dedup of a shared prefix, retention and labels, deletion, gc (immediate, deferred,
 * alongside a reader), compression, import/export byte identity, geometry and model refusal,
 * map growth and a full budget, backup and restore, schema refusal, check and stat; a get into
 * buffers of an allocation hook.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <sys/stat.h>

#include "st_test_image.h"
#include "store_test.h"

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */
static int seq;

static void fresh_dir(char *dst, size_t cap)
{
    snprintf(dst, cap, "%s/s%d", base, ++seq);
}

static st_store *open_new(char *dir, size_t cap, const st_store_opts *o)
{
    st_store_opts d = {.create = 1};
    if (o)
        d = *o;
    d.create = 1;
    fresh_dir(dir, cap);
    st_store *st = NULL;
    int rc = st_store_open(&st, dir, &d);
    if (rc)
        print_error("open %s: %s: %s\n", dir, st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    return st;
}

static void test_open_close(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = NULL;
    fresh_dir(dir, sizeof dir);
    assert_int_equal(st_store_open(&st, dir, NULL), ST_ENOTFOUND);
    assert_null(st);
    st_store_opts ro = {.read_only = 1, .create = 1};
    assert_int_equal(st_store_open(&st, dir, &ro), ST_ENOTFOUND);
    st = open_new(dir, sizeof dir, NULL);
    assert_string_equal(st_store_dir(st), dir);
    assert_int_equal(st_store_keep_last(st), ST_STORE_KEEP_LAST_DEFAULT);
    st_store_close(st);
    uint32_t schema = 0;
    assert_int_equal(st_store_schema_version(dir, &schema), 0);
    assert_int_equal(schema, ST_STORE_SCHEMA);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    st_session_info *list = NULL;
    size_t n = 9;
    assert_int_equal(st_store_list(st, &list, &n), 0);
    assert_int_equal(n, 0);
    free(list);
    st_store_close(st);
    st_store_close(NULL);
    /* a plain file is not a store directory */
    char file[4300];
    snprintf(file, sizeof file, "%s/plain", base);
    assert_int_equal(st_test_spit(file, "x", 1), 0);
    assert_int_equal(st_store_open(&st, file, NULL), ST_EINVAL);
}

static void test_put_get_versions(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(1, 300, 0, 0), *b = store_test_image(2, 700, 0, 0);
    uint64_t v = 0;
    st_put_stats ps;
    st_put_opts po = {.stats = &ps};
    assert_int_equal(st_store_put(st, "conv-1", a, ST_STORE_HEAD_NONE, &po, &v), 0);
    assert_int_equal(v, 1);
    assert_int_equal(ps.version, 1);
    assert_int_equal(ps.logical_bytes, st_image_bytes(a));
    assert_int_equal(ps.new_chunks, ps.chunks - (ps.chunks - ps.new_chunks));
    assert_int_equal(st_store_put(st, "conv-1", b, 1, NULL, &v), 0);
    assert_int_equal(v, 2);
    store_test_assert_get(st, "conv-1", 1, a);
    store_test_assert_get(st, "conv-1", 2, b);
    store_test_assert_get(st, "conv-1", 0, b);

    st_session_info si;
    assert_int_equal(st_store_show(st, "conv-1", &si), 0);
    assert_string_equal(si.id, "conv-1");
    assert_int_equal(si.head, 2);
    assert_int_equal(si.n_versions, 2);
    assert_int_equal(si.next_version, 3);
    assert_memory_equal(si.model_fp, st_image_geometry(a)->model_fp, ST_FINGERPRINT_LEN);
    assert_true(si.updated_ns >= si.created_ns && si.created_ns > 0);

    st_version_info *vs = NULL;
    size_t n = 0;
    assert_int_equal(st_store_versions(st, "conv-1", &vs, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(vs[0].version, 1);
    assert_int_equal(vs[0].n_tokens, 300);
    assert_int_equal(vs[1].n_tokens, 700);
    assert_int_equal(vs[1].logical_bytes, st_image_bytes(b));
    assert_int_equal(vs[1].last_position, 700);
    assert_int_equal(vs[1].state_hash, st_image_state_hash(b));
    free(vs);
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, "conv-1", 0, &vi), 0);
    assert_int_equal(vi.version, 2);

    /* not found, invalid ids */
    st_image *x = NULL;
    assert_int_equal(st_store_get(st, "nope", 0, &x), ST_ENOTFOUND);
    assert_int_equal(st_store_get(st, "conv-1", 3, &x), ST_ENOTFOUND);
    assert_null(x);
    assert_int_equal(st_store_get(st, "bad@id", 0, &x), ST_EINVAL);
    assert_int_equal(st_store_put(st, "", a, 0, NULL, NULL), ST_EINVAL);
    assert_int_equal(st_store_put(st, "a/b", a, 0, NULL, NULL), ST_EINVAL);
    char longid[ST_STORE_ID_MAX + 2];
    memset(longid, 'x', sizeof longid - 1);
    longid[sizeof longid - 1] = '\0';
    assert_int_equal(st_store_put(st, longid, a, 0, NULL, NULL), ST_EINVAL);
    longid[ST_STORE_ID_MAX] = '\0';
    assert_int_equal(st_store_put(st, longid, a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_show(st, "nope", &si), ST_ENOTFOUND);

    st_session_info *list = NULL;
    assert_int_equal(st_store_list(st, &list, &n), 0);
    assert_int_equal(n, 2);
    assert_string_equal(list[0].id, "conv-1");
    free(list);
    store_test_assert_clean(st);

    /* survives reopen */
    st_store_close(st);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    store_test_assert_get(st, "conv-1", 1, a);
    st_store_close(st);
    st_store_opts ro = {.read_only = 1};
    assert_int_equal(st_store_open(&st, dir, &ro), 0);
    store_test_assert_get(st, "conv-1", 2, b);
    assert_int_equal(st_store_put(st, "conv-1", a, 0, NULL, NULL), ST_EINVAL);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

static void test_conflicts(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(3, 100, 0, 0);
    uint64_t v;
    assert_int_equal(st_store_put(st, "c", a, 5, NULL, &v), ST_ECONFLICT);
    assert_non_null(strstr(st_errdetail(), "does not exist"));
    assert_int_equal(st_store_put(st, "c", a, ST_STORE_HEAD_NONE, NULL, &v), 0);
    assert_int_equal(st_store_put(st, "c", a, ST_STORE_HEAD_NONE, NULL, &v), ST_ECONFLICT);
    assert_int_equal(st_store_put(st, "c", a, 1, NULL, &v), 0);
    assert_int_equal(v, 2);
    assert_int_equal(st_store_put(st, "c", a, 1, NULL, &v), ST_ECONFLICT);
    assert_non_null(strstr(st_errdetail(), "expected head 1, the head is 2"));
    assert_int_equal(st_store_put(st, "c", a, ST_STORE_HEAD_ANY, NULL, &v), 0);
    assert_int_equal(v, 3);
    st_session_info si;
    assert_int_equal(st_store_show(st, "c", &si), 0);
    assert_int_equal(si.n_versions, 3);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
}

/* Two images sharing a 10-page prefix store those pages once. */
static void test_dedup_prefix(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    const uint64_t page = 256, prefix = 10 * page;
    st_image *a = store_test_image(10, 3000, 77, prefix), *b = store_test_image(11, 3100, 77, prefix);
    st_put_stats sa, sb;
    st_put_opts pa = {.stats = &sa}, pb = {.stats = &sb};
    assert_int_equal(st_store_put(st, "a", a, 0, &pa, NULL), 0);
    assert_int_equal(st_store_put(st, "b", b, 0, &pb, NULL), 0);
    /* every K/V tensor's first 10 pages are shared */
    const st_geometry *g = st_image_geometry(a);
    uint32_t kv_tensors = 0;
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        if (g->tensors[ti].role != ST_ROLE_KV)
            continue;
        kv_tensors++;
        uint64_t row = st_tensor_row_bytes(&g->tensors[ti]), la, lb;
        assert_int_equal(row * page, 32768);
        const uint8_t *ka = st_image_kv_const(a, ti, &la), *kb = st_image_kv_const(b, ti, &lb);
        for (uint64_t p = 0; p < 10; p++) {
            assert_memory_equal(ka + p * row * page, kb + p * row * page, row * page);
            assert_int_equal(store_test_refcount(st, ka + p * row * page, row * page), 2);
        }
        /* page 10 differs: one reference each */
        assert_int_equal(store_test_refcount(st, ka + 10 * row * page, row * page), 1);
        assert_int_equal(store_test_refcount(st, kb + 10 * row * page, row * page), 1);
    }
    assert_true(kv_tensors >= 2);
    uint64_t shared = (uint64_t)kv_tensors * 10 * page * st_tensor_row_bytes(&g->tensors[store_test_kv(a)]);
    assert_true(sb.stored_bytes - sb.new_bytes >= shared);
    st_store_stats s;
    assert_int_equal(st_store_stat(st, &s), 0);
    assert_int_equal(s.chunks, sa.new_chunks + sb.new_chunks);
    assert_int_equal(s.stored_bytes, sa.new_bytes + sb.new_bytes);
    assert_int_equal(s.referenced_bytes, sa.stored_bytes + sb.stored_bytes);
    assert_true(s.dedup_ratio > 1.0);
    /* a second version of "a" with 100 more tokens writes only what changed */
    st_image *a2 = store_test_image(10, 3100, 77, prefix);
    st_put_stats s2;
    st_put_opts p2 = {.stats = &s2};
    assert_int_equal(st_store_put(st, "a", a2, 0, &p2, NULL), 0);
    assert_true(s2.new_bytes < s2.stored_bytes / 4);
    store_test_assert_get(st, "a", 0, a2);
    store_test_assert_get(st, "b", 0, b);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(a2);
    st_image_free(b);
}

static void test_retention_labels(void **state)
{
    (void)state;
    char dir[4200];
    st_store_opts o = {.keep_last = 3};
    st_store *st = open_new(dir, sizeof dir, &o);
    assert_int_equal(st_store_keep_last(st), 3);
    st_image *img[7];
    for (int i = 1; i <= 6; i++) {
        img[i] = store_test_image(100 + (uint64_t)i, 200 + 50 * (uint64_t)i, 5, 200);
        st_put_opts po = {.label = i == 1 ? "first" : NULL};
        assert_int_equal(st_store_put(st, "r", img[i], 0, &po, NULL), 0);
        if (i == 2)
            assert_int_equal(st_store_label_set(st, "r", "keep", 0), 0);
    }
    st_version_info *vs = NULL;
    size_t n = 0;
    assert_int_equal(st_store_versions(st, "r", &vs, &n), 0);
    assert_int_equal(n, 5); /* 1 and 2 labelled, 4 5 6 newest; 3 pruned */
    uint64_t want[] = {1, 2, 4, 5, 6};
    for (size_t i = 0; i < n; i++)
        assert_int_equal(vs[i].version, want[i]);
    free(vs);
    store_test_assert_get(st, "r", 2, img[2]);
    store_test_assert_get(st, "r", 1, img[1]);
    st_image *x = NULL;
    assert_int_equal(st_store_get(st, "r", 3, &x), ST_ENOTFOUND);

    st_session_info si;
    assert_int_equal(st_store_show(st, "r", &si), 0);
    assert_int_equal(si.n_labels, 2);
    /* move a label, remove one, errors */
    assert_int_equal(st_store_label_set(st, "r", "keep", 5), 0);
    assert_int_equal(st_store_label_remove(st, "r", "first"), 0);
    assert_int_equal(st_store_label_remove(st, "r", "first"), ST_ENOTFOUND);
    assert_int_equal(st_store_label_set(st, "r", "x", 3), ST_ENOTFOUND);
    assert_int_equal(st_store_label_set(st, "r", "bad label", 0), ST_EINVAL);
    assert_int_equal(st_store_label_set(st, "nope", "x", 0), ST_ENOTFOUND);
    for (int i = 0; i < ST_STORE_LABELS_MAX - 1; i++) {
        char name[16];
        snprintf(name, sizeof name, "l%d", i);
        assert_int_equal(st_store_label_set(st, "r", name, 6), 0);
    }
    assert_int_equal(st_store_label_set(st, "r", "onemore", 6), ST_ETOOBIG);
    assert_int_equal(st_store_show(st, "r", &si), 0);
    assert_int_equal(si.n_labels, ST_STORE_LABELS_MAX);
    /* now 1 and 2 are unlabelled: the next put prunes them */
    for (int i = 0; i < ST_STORE_LABELS_MAX - 1; i++) {
        char name[16];
        snprintf(name, sizeof name, "l%d", i);
        assert_int_equal(st_store_label_remove(st, "r", name), 0);
    }
    st_put_stats ps;
    st_put_opts po = {.stats = &ps};
    assert_int_equal(st_store_put(st, "r", img[1], 0, &po, NULL), 0);
    assert_int_equal(ps.version, 7);
    assert_int_equal(ps.pruned, 3); /* 1, 2, 4 */
    assert_int_equal(st_store_versions(st, "r", &vs, &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(vs[0].version, 5);
    free(vs);
    store_test_assert_clean(st);
    /* the setting persists; a new value replaces it */
    st_store_close(st);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    assert_int_equal(st_store_keep_last(st), 3);
    st_store_close(st);
    st_store_opts o2 = {.keep_last = 2};
    assert_int_equal(st_store_open(&st, dir, &o2), 0);
    st_store_close(st);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    assert_int_equal(st_store_keep_last(st), 2);
    st_store_close(st);
    for (int i = 1; i <= 6; i++)
        st_image_free(img[i]);
}

static void test_delete(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(20, 400, 0, 0), *b = store_test_image(21, 500, 0, 0);
    assert_int_equal(st_store_put(st, "d", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "d", b, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "e", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_version_delete(st, "d", 2), 0); /* the head */
    st_session_info si;
    assert_int_equal(st_store_show(st, "d", &si), 0);
    assert_int_equal(si.head, 1);
    assert_int_equal(si.n_versions, 1);
    assert_int_equal(si.next_version, 3); /* numbers are not reused */
    assert_int_equal(st_store_version_delete(st, "d", 2), ST_ENOTFOUND);
    assert_int_equal(st_store_version_delete(st, "zz", 1), ST_ENOTFOUND);
    store_test_assert_clean(st);
    uint64_t v;
    assert_int_equal(st_store_put(st, "d", b, 0, NULL, &v), 0);
    assert_int_equal(v, 3);
    /* deleting the only version deletes the session */
    assert_int_equal(st_store_version_delete(st, "e", 1), 0);
    assert_int_equal(st_store_show(st, "e", &si), ST_ENOTFOUND);
    store_test_assert_get(st, "d", 1, a); /* a's chunks survive e's deletion */
    assert_int_equal(st_store_session_delete(st, "d"), 0);
    assert_int_equal(st_store_session_delete(st, "d"), ST_ENOTFOUND);
    st_store_stats s;
    assert_int_equal(st_store_stat(st, &s), 0);
    assert_int_equal(s.sessions, 0);
    assert_int_equal(s.versions, 0);
    assert_int_equal(s.chunks, 0);
    assert_int_equal(s.stored_bytes, 0);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

typedef struct reader_arg {
    st_store *st;
    const st_image *want;
    /* shared by the main thread and both readers: atomics (TSan found a volatile stop and
     * plain counters racing) */
    atomic_int stop, gets, errors;
} reader_arg;

static void *reader(void *p)
{
    reader_arg *r = p;
    while (!atomic_load(&r->stop)) {
        st_image *img = NULL;
        int rc = st_store_get(r->st, "keep", 0, &img);
        if (rc || !store_test_equal(img, r->want))
            atomic_fetch_add(&r->errors, 1);
        st_image_free(img);
        st_image *gone = NULL;
        rc = st_store_get(r->st, "churn", 0, &gone);
        if (rc && rc != ST_ENOTFOUND)
            atomic_fetch_add(&r->errors, 1);
        st_image_free(gone);
        atomic_fetch_add(&r->gets, 1);
    }
    return NULL;
}

static void test_gc(void **state)
{
    (void)state;
    char dir[4200];
    st_store_opts o = {.gc_deferred = 1};
    st_store *st = open_new(dir, sizeof dir, &o);
    st_image *a = store_test_image(30, 900, 0, 0), *b = store_test_image(31, 900, 30, 512);
    assert_int_equal(st_store_put(st, "keep", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "churn", b, 0, NULL, NULL), 0);
    /* a reader's snapshot taken before the delete and gc keeps seeing the chunk */
    uint64_t len;
    const uint8_t *kv = st_image_kv_const(b, store_test_kv(b), &len);
    const size_t page = 32768;
    uint8_t h[ST_STORE_HASH_LEN];
    assert_int_equal(st_store_sha256(kv + 2 * page, page, h), 0);
    MDB_txn *old = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &old), 0);
    assert_int_equal(st_store_session_delete(st, "churn"), 0);
    st_store_stats s;
    assert_int_equal(st_store_stat(st, &s), 0);
    assert_true(s.zero_count_chunks > 0);
    assert_true(s.zero_count_bytes >= page);
    store_test_assert_clean(st); /* zero counts await gc: not a problem */
    st_gc_stats gs;
    assert_int_equal(st_store_gc(st, &gs), 0);
    assert_int_equal(gs.chunks_freed, s.zero_count_chunks);
    assert_int_equal(gs.bytes_freed, s.zero_count_bytes);
    MDB_val k = {ST_STORE_HASH_LEN, h}, v;
    assert_int_equal(mdb_get(old, st->dbi_chunks, &k, &v), 0);
    assert_int_equal(v.mv_size, page);
    assert_memory_equal(v.mv_data, kv + 2 * page, page);
    mdb_txn_abort(old);
    assert_int_equal(st_store_stat(st, &s), 0);
    assert_int_equal(s.zero_count_chunks, 0);
    store_test_assert_get(st, "keep", 0, a);
    store_test_assert_clean(st);
    assert_int_equal(st_store_gc(st, &gs), 0);
    assert_int_equal(gs.chunks_freed, 0);

    /* gc and deletes while other threads read */
    reader_arg ra = {.st = st, .want = a};
    pthread_t t[2];
    for (int i = 0; i < 2; i++)
        assert_int_equal(pthread_create(&t[i], NULL, reader, &ra), 0);
    for (int i = 0; i < 12; i++) {
        assert_int_equal(st_store_put(st, "churn", b, 0, NULL, NULL), 0);
        assert_int_equal(st_store_session_delete(st, "churn"), 0);
        assert_int_equal(st_store_gc(st, NULL), 0);
    }
    atomic_store(&ra.stop, 1);
    for (int i = 0; i < 2; i++)
        pthread_join(t[i], NULL);
    assert_int_equal(atomic_load(&ra.errors), 0);
    assert_true(atomic_load(&ra.gets) > 0);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

static void test_compression(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(40, 2000, 0, 0);
    st_put_stats s1, s2;
    st_put_opts p1 = {.stats = &s1}, p3 = {.compress = 3, .stats = &s2};
    assert_int_equal(st_store_put(st, "raw", a, 0, &p1, NULL), 0);
    assert_int_equal(st_store_put(st, "z", a, 0, &p3, NULL), 0);
    assert_int_equal(s1.stored_bytes, st_image_bytes(a) + (s1.stored_bytes - st_image_bytes(a)));
    assert_true(s2.stored_bytes < s1.stored_bytes);
    store_test_assert_get(st, "z", 0, a);
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, "z", 0, &vi), 0);
    assert_int_equal(vi.compress, 3);
    st_put_opts bad = {.compress = 20};
    assert_int_equal(st_store_put(st, "z", a, 0, &bad, NULL), ST_EINVAL);
    store_test_assert_clean(st);
    st_store_close(st);
    /* SHA-256 verification on read */
    st_store_opts o = {.verify_sha256 = 1};
    assert_int_equal(st_store_open(&st, dir, &o), 0);
    store_test_assert_get(st, "z", 0, a);
    store_test_assert_get(st, "raw", 0, a);
    st_store_close(st);
    st_image_free(a);
}

/* The codecs a version's manifest records, as st_version_info gives them on every path (list,
 * page, one version): the live checkpoint's, the set, the text; and the chunks stored framed. */
static void test_version_codecs(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    static const uint32_t cs[3][3] = {{ST_CODEC_FP32, ST_CODEC_FP32, ST_CODEC_FP32},
                                      {ST_CODEC_FP32, ST_CODEC_BF16, ST_CODEC_BF16},
                                      {ST_CODEC_BF16, ST_CODEC_BF16, ST_CODEC_F16}};
    static const uint32_t live[3] = {ST_CODEC_FP32, ST_CODEC_BF16, ST_CODEC_F16};
    static const uint32_t mask[3] = {1u << ST_CODEC_FP32, (1u << ST_CODEC_FP32) | (1u << ST_CODEC_BF16),
                                     (1u << ST_CODEC_BF16) | (1u << ST_CODEC_F16)};
    static const char *const text[3] = {"fp32", "fp32+bf16", "bf16+f16"};
    for (int i = 0; i < 3; i++) {
        st_image *img = NULL;
        uint64_t h = 0;
        assert_int_equal(st_test_image_small(&img, 500, cs[i]), 0);
        assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h), 0); /* its true hash */
        st_image_state_hash_set(img, h);
        assert_int_equal(st_store_put(st, "c", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
        st_image_free(img);
    }
    st_version_info *vs = NULL, page[3], one;
    size_t n = 0, np = 0;
    assert_int_equal(st_store_versions(st, "c", &vs, &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(st_store_versions_page(st, "c", 0, page, 3, &np), 0);
    assert_int_equal(np, 3);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(st_store_version_info(st, "c", (uint64_t)i + 1, &one), 0);
        const st_version_info *got[3] = {&vs[i], &page[i], &one};
        for (int k = 0; k < 3; k++) {
            char t[64];
            assert_int_equal(got[k]->codec, live[i]);
            assert_int_equal(got[k]->codecs, mask[i]);
            assert_int_equal(got[k]->n_framed, 0); /* raw */
            st_version_codecs_text(got[k]->codecs, t, sizeof t);
            assert_string_equal(t, text[i]);
        }
    }
    free(vs);
    /* the text's edges: none, a code beyond the known ones, truncation at a name's end */
    char t[64];
    st_version_codecs_text(0, t, sizeof t);
    assert_string_equal(t, "none");
    st_version_codecs_text(ST_VERSION_CODEC_OTHER | 1u, t, sizeof t);
    assert_string_equal(t, "fp32+other");
    st_version_codecs_text(3u, t, 5);
    assert_string_equal(t, "fp32");

    /* compression: the framed chunks are counted, the geometry record (never framed) is not */
    st_image *a = store_test_image(41, 2000, 0, 0);
    st_put_stats ps;
    st_put_opts p3 = {.compress = 3, .stats = &ps};
    assert_int_equal(st_store_put(st, "z", a, 0, &p3, NULL), 0);
    assert_int_equal(st_store_version_info(st, "z", 0, &one), 0);
    assert_int_equal(one.codec, ST_CODEC_FP32);
    assert_int_equal(one.compress, 3);
    assert_true(one.n_framed > 0 && one.n_framed < one.n_chunks);
    assert_true(one.stored_bytes < one.logical_bytes);
    st_image_free(a);
    store_test_assert_clean(st);
    st_store_close(st);
}

/* The longest run of free pages, recomputed from LMDB's free list with a bitmap over the file's
 * pages (the store sorts the page numbers instead). */
static uint64_t free_run_by_bitmap(st_store *st, uint64_t pages)
{
    uint8_t *free_pg = calloc(pages ? pages : 1, 1);
    assert_non_null(free_pg);
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    assert_int_equal(mdb_cursor_open(txn, 0, &cur), 0);
    for (int rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        const size_t *ids = v.mv_data;
        for (size_t i = 1; i <= ids[0]; i++) {
            assert_true(ids[i] < pages);
            free_pg[ids[i]] = 1;
        }
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    uint64_t best = 0, run = 0;
    for (uint64_t p = 0; p < pages; p++) {
        run = free_pg[p] ? run + 1 : 0;
        best = run > best ? run : best;
    }
    free(free_pg);
    return best;
}

/* The free map of stat: pages used, free and the longest free run, against LMDB's own free list
 * and the map, before and after deletes free pages. */
static void test_stat_free_map(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *imgs[4];
    for (int i = 0; i < 4; i++) {
        char id[8];
        snprintf(id, sizeof id, "f%d", i);
        imgs[i] = store_test_image(80 + (uint64_t)i, 600, 0, 0);
        assert_int_equal(st_store_put(st, id, imgs[i], 0, NULL, NULL), 0);
    }
    st_store_stats s0, s1;
    assert_int_equal(st_store_stat(st, &s0), 0);
    /* delete every other session: their pages go to the free list, in separate runs */
    assert_int_equal(st_store_session_delete(st, "f0"), 0);
    assert_int_equal(st_store_session_delete(st, "f2"), 0);
    assert_int_equal(st_store_stat(st, &s1), 0);
    const st_store_stats *ss[2] = {&s0, &s1};
    for (int i = 0; i < 2; i++) {
        const st_store_stats *s = ss[i];
        assert_true(s->page_size > 0);
        assert_true(s->pages_free <= s->pages_used);
        assert_true(s->pages_used <= s->map_size / s->page_size);
        assert_true(s->pages_free_run <= s->pages_free);
        assert_true(s->pages_free == 0 ? s->pages_free_run == 0 : s->pages_free_run >= 1);
    }
    assert_int_equal(s1.pages_free_run, free_run_by_bitmap(st, s1.pages_used));
    /* f0's and f2's chunks: about 2 x 600 rows x 128 bytes of K/V each */
    assert_true(s1.pages_free * s1.page_size >= 2 * 600 * 128);
    assert_true(s1.pages_free > s0.pages_free);
    assert_true(s1.pages_free_run > 1);
    store_test_assert_get(st, "f1", 0, imgs[1]);
    for (int i = 0; i < 4; i++)
        st_image_free(imgs[i]);
    st_store_close(st);
}

static void file_roundtrip(st_store *st, const st_image *img, const st_file_write_opts *fo, const char *name,
                           int expect_verbatim)
{
    char in[4300], out[4300];
    snprintf(in, sizeof in, "%s/%s.in", base, name);
    snprintf(out, sizeof out, "%s/%s.out", base, name);
    assert_int_equal(st_file_write(img, in, fo), 0);
    uint64_t v = 0;
    int rc = st_store_import(st, in, name, NULL, &v);
    if (rc)
        print_error("import: %s: %s\n", st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, name, v, &vi), 0);
    assert_int_equal(vi.file_verbatim, expect_verbatim);
    assert_int_equal(st_store_export(st, name, v, out, NULL), 0);
    size_t la, lb;
    uint8_t *a = st_test_slurp(in, &la), *b = st_test_slurp(out, &lb);
    assert_non_null(a);
    assert_non_null(b);
    assert_int_equal(la, lb);
    assert_memory_equal(a, b, la);
    free(a);
    free(b);
    store_test_assert_get(st, name, v, img);
}

static void test_import_export(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(50, 700, 0, 0);
    st_file_write_opts v1 = {.version = 1}, v2 = {.version = 2}, z3 = {.version = 2, .compress = 3, .shuffle = 1},
                       z3n = {.version = 2, .compress = 3}, z7 = {.version = 2, .compress = 7, .shuffle = 1};
    file_roundtrip(st, a, &v1, "f-v1", 0);
    file_roundtrip(st, a, &v2, "f-v2", 0);
    file_roundtrip(st, a, &z3, "f-z3", 0);
    file_roundtrip(st, a, &z3n, "f-z3n", 0);
    file_roundtrip(st, a, &z7, "f-z7", 1); /* a level import cannot guess: bytes kept */
    st_synth_opts so = {.seed = 51, .n_tokens = 300, .codec = ST_CODEC_BF16};
    st_image *bf = NULL;
    assert_int_equal(st_image_synthesize(&so, &bf), 0);
    file_roundtrip(st, bf, NULL, "f-bf16", 0);
    /* forced options on export */
    char out[4300];
    snprintf(out, sizeof out, "%s/forced.out", base);
    assert_int_equal(st_store_export(st, "f-v1", 0, out, &z3), 0);
    st_image *back = NULL;
    assert_int_equal(st_file_read(out, NULL, &back), 0);
    assert_true(store_test_equal(back, a));
    st_image_free(back);
    /* a put's version exports with automatic options */
    assert_int_equal(st_store_put(st, "p", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_export(st, "p", 0, out, NULL), 0);
    assert_int_equal(st_file_read(out, NULL, &back), 0);
    assert_true(store_test_equal(back, a));
    st_image_free(back);
    /* errors */
    assert_int_equal(st_store_import(st, "/nonexistent/file", "x", NULL, NULL), ST_ENOTFOUND);
    char junk[4300];
    snprintf(junk, sizeof junk, "%s/junk", base);
    assert_int_equal(st_test_spit(junk, "not a strata file at all, really", 32), 0);
    assert_int_equal(st_store_import(st, junk, "x", NULL, NULL), ST_ENOTSTRATA);
    assert_int_equal(st_store_export(st, "nope", 0, out, NULL), ST_ENOTFOUND);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(bf);
}

static void test_geometry_refused(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(60, 300, 0, 0);
    assert_int_equal(st_store_put(st, "g", a, 0, NULL, NULL), 0);
    st_synth_opts o = {.seed = 60, .n_tokens = 300, .page_size = 128};
    st_image *b = NULL;
    assert_int_equal(st_image_synthesize(&o, &b), 0);
    assert_int_equal(st_store_put(st, "g", b, 0, NULL, NULL), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "page_size"));
    /* another model */
    st_geometry g = *st_image_geometry(a);
    g.model_fp[0] ^= 1;
    st_image *c = NULL;
    assert_int_equal(st_image_create(&c, &g), 0);
    assert_int_equal(st_image_checkpoint_add(c, 0, ST_CODEC_FP32, NULL), 0);
    assert_int_equal(st_store_put(st, "g", c, 0, NULL, NULL), ST_EMODEL);
    /* an incomplete image is refused before anything is written */
    st_image *e = NULL;
    assert_int_equal(st_image_create(&e, &g), 0);
    assert_int_not_equal(st_store_put(st, "g2", e, 0, NULL, NULL), 0);
    assert_int_equal(st_store_show(st, "g2", &(st_session_info){0}), ST_ENOTFOUND);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
    st_image_free(c);
    st_image_free(e);
}

/* The architecture name travels with each version (its manifest), not with the session's
 * shared geometry record: a session saved before names were recorded takes named versions, each
 * version reads back with its own name, and an export writes it. */
static void test_arch_name(void **state)
{
    (void)state;
    char dir[1024];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(61, 300, 0, 0), *n = NULL, *back = NULL;
    assert_int_equal(st_test_image_named(&n, a, "qwen3next"), 0);
    assert_int_equal(st_store_put(st, "s", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "s", n, 0, NULL, NULL), 0);
    st_version_info *vs = NULL;
    size_t nv = 0;
    assert_int_equal(st_store_versions(st, "s", &vs, &nv), 0);
    assert_int_equal(nv, 2);
    assert_string_equal(vs[0].arch, "");
    assert_string_equal(vs[1].arch, "qwen3next");
    free(vs);
    assert_int_equal(st_store_get(st, "s", 1, &back), 0);
    assert_int_equal(st_test_image_equal(a, back), 0);
    st_image_free(back);
    assert_int_equal(st_store_get(st, "s", 2, &back), 0);
    assert_int_equal(st_test_image_equal(n, back), 0);
    st_image_free(back);
    uint8_t *f = NULL;
    size_t fl = 0;
    assert_int_equal(st_file_write_mem(n, NULL, &f, &fl), 0);
    char path[1200];
    snprintf(path, sizeof path, "%s.export", dir);
    assert_int_equal(st_store_export(st, "s", 2, path, NULL), 0);
    size_t el = 0;
    unsigned char *e = st_test_slurp(path, &el);
    assert_non_null(e);
    assert_int_equal(el, fl);
    assert_memory_equal(e, f, fl);
    free(e);
    free(f);
    unlink(path);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(n);
}

static void test_map_growth_and_budget(void **state)
{
    (void)state;
    char dir[4200];
    st_store_opts o = {.map_initial = 1u << 20, .budget = 256u << 20};
    st_store *st = open_new(dir, sizeof dir, &o);
    st_image *big = store_test_image(70, 4000, 0, 0), *small = store_test_image(71, 50, 0, 0);
    st_store_stats s0, s1;
    assert_int_equal(st_store_stat(st, &s0), 0);
    assert_int_equal(s0.map_size, 1u << 20);
    for (int i = 0; i < 4; i++) {
        int rc = st_store_put(st, "big", big, 0, NULL, NULL);
        if (rc)
            print_error("put: %s\n", st_errdetail());
        assert_int_equal(rc, 0);
    }
    assert_int_equal(st_store_put(st, "big2", small, 0, NULL, NULL), 0);
    assert_int_equal(st_store_stat(st, &s1), 0);
    assert_true(s1.map_size > s0.map_size);
    store_test_assert_get(st, "big", 0, big);
    store_test_assert_clean(st);
    st_store_close(st);

    /* a budget smaller than the image: ST_EFULL, and the store stays usable */
    st_store_opts tight = {.map_initial = 1u << 20, .budget = 1u << 20};
    st = open_new(dir, sizeof dir, &tight);
    assert_int_equal(st_store_put(st, "s", small, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), ST_EFULL);
    assert_non_null(strstr(st_errdetail(), "budget"));
    int rc = st_store_put(st, "s", small, 0, NULL, NULL);
    if (rc) {
        st_store_stats sx;
        st_store_stat(st, &sx);
        print_error("put: %s (map %llu used pages %llu free %llu)\n", st_errdetail(), (unsigned long long)sx.map_size,
                    (unsigned long long)sx.pages_used, (unsigned long long)sx.pages_free);
    }
    assert_int_equal(rc, 0);
    store_test_assert_get(st, "s", 0, small);
    st_image *x = NULL;
    assert_int_equal(st_store_get(st, "big", 0, &x), ST_ENOTFOUND);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(big);
    st_image_free(small);
}

static void test_backup_restore(void **state)
{
    (void)state;
    char dir[4200], bak[1200], dst[1200], full[4300];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(80, 1200, 0, 0), *b = store_test_image(81, 600, 80, 300);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "b", b, 0, NULL, NULL), 0);
    assert_int_equal(st_store_label_set(st, "a", "gold", 1), 0);
    snprintf(bak, sizeof bak, "%s/bak%d", base, seq);
    assert_int_equal(st_store_backup(st, bak), 0);
    /* the store keeps working after and the backup is a snapshot */
    assert_int_equal(st_store_put(st, "c", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_backup(st, bak), ST_EINVAL); /* exists, not empty */
    snprintf(full, sizeof full, "%s/data.mdb", bak);
    struct stat sb;
    assert_int_equal(stat(full, &sb), 0);
    snprintf(full, sizeof full, "%s/lock.mdb", bak);
    assert_int_not_equal(stat(full, &sb), 0); /* the backup holds data.mdb only */
    snprintf(dst, sizeof dst, "%s/restored%d", base, seq);
    assert_int_equal(mkdir(dst, 0755), 0); /* an empty directory is fine */
    assert_int_equal(st_store_restore_backup(bak, dst, NULL), 0);
    assert_int_equal(st_store_restore_backup(bak, dst, NULL), ST_EINVAL);
    assert_int_equal(st_store_restore_backup(dir, bak, NULL), ST_EINVAL);
    snprintf(full, sizeof full, "%s/none", base);
    assert_int_equal(st_store_restore_backup(full, dst, NULL), ST_ENOTFOUND);
    st_store *r = NULL;
    assert_int_equal(st_store_open(&r, dst, NULL), 0);
    store_test_assert_get(r, "a", 0, a);
    store_test_assert_get(r, "b", 0, b);
    st_session_info si;
    assert_int_equal(st_store_show(r, "c", &si), ST_ENOTFOUND);
    assert_int_equal(st_store_show(r, "a", &si), 0);
    assert_int_equal(si.n_labels, 1);
    store_test_assert_clean(r);
    st_store_close(r);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

static int set_schema_fn(st_store *st, MDB_txn *txn, void *arg)
{
    uint8_t b[4];
    st_put32(b, *(uint32_t *)arg);
    MDB_val k = {strlen(ST_META_SCHEMA), ST_META_SCHEMA}, v = {4, b};
    return mdb_put(txn, st->dbi_meta, &k, &v, 0);
}

static void test_schema_refused(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    uint32_t three = 3;
    assert_int_equal(st_store__write(st, set_schema_fn, &three), 0);
    st_store_close(st);
    assert_int_equal(st_store_open(&st, dir, NULL), ST_EVERSION);
    assert_string_equal(st_errdetail(), "store schema 3 is newer than this build's 2");
    assert_null(st);
    uint32_t schema;
    assert_int_equal(st_store_schema_version(dir, &schema), 0);
    assert_int_equal(schema, 3);
}

static void test_check_finds_damage(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(90, 600, 0, 0);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    /* an orphan chunk and a wrong count, written behind the store's back */
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    uint8_t h[ST_STORE_HASH_LEN], cnt[8];
    assert_int_equal(st_store_sha256("orphan", 6, h), 0);
    MDB_val k = {ST_STORE_HASH_LEN, h}, v = {6, "orphan"};
    assert_int_equal(mdb_put(txn, st->dbi_chunks, &k, &v, 0), 0);
    uint64_t len;
    const uint8_t *kv = st_image_kv_const(a, store_test_kv(a), &len);
    uint8_t h2[ST_STORE_HASH_LEN];
    assert_int_equal(st_store_sha256(kv, 32768, h2), 0);
    st_put64(cnt, 5);
    MDB_val k2 = {ST_STORE_HASH_LEN, h2}, v2 = {8, cnt};
    assert_int_equal(mdb_put(txn, st->dbi_refcounts, &k2, &v2, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 0, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 2);
    char hex[65], hex2[65];
    st_store_hex(hex, h, 32);
    st_store_hex(hex2, h2, 32);
    int orphan = 0, count = 0;
    for (int i = 0; i < pr.n; i++) {
        orphan |= pr.kind[i] == ST_CHECK_ORPHAN_CHUNK && !strcmp(pr.chunk[i], hex);
        count |= pr.kind[i] == ST_CHECK_REFCOUNT && !strcmp(pr.chunk[i], hex2) && !strcmp(pr.session[i], "a");
    }
    assert_true(orphan);
    assert_true(count);
    /* gc removes the orphan (no count, no manifest names it), not the chunk with a wrong count */
    st_gc_stats gs;
    assert_int_equal(st_store_gc(st, &gs), 0);
    assert_int_equal(gs.orphans_freed, 1);
    assert_int_equal(gs.chunks_freed, 0);
    assert_int_equal(gs.bytes_freed, 6);
    memset(&pr, 0, sizeof pr);
    assert_int_equal(st_store_check(st, 0, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_int_equal(pr.kind[0], ST_CHECK_REFCOUNT);
    store_test_assert_get(st, "a", 0, a);
    st_store_close(st);
    st_image_free(a);
}

/* The allocation hook of st_store_get_with: buffers handed out dirty (as a cache's are) and
 * counted. */
typedef struct count_hook {
    int allocs, frees;
} count_hook;

static void *hook_alloc(void *ctx, size_t len)
{
    void *p = malloc(len);
    if (p) {
        memset(p, 0xa5, len);
        ((count_hook *)ctx)->allocs++;
    }
    return p;
}

static void hook_free(void *ctx, void *p, size_t len)
{
    (void)len;
    ((count_hook *)ctx)->frees++;
    free(p);
}

/* st_store_get_with takes the image's large buffers (checkpoint blocks of 3 MiB here) from the
 * hook and leaves nothing of their old bytes: the image equals the one put and the one
 * st_store_get returns. Every hook buffer is released with the image, and with a damaged chunk
 * the get fails and has released them already. */
static void test_get_with_allocator(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_synth_opts so = {.seed = 7, .head_dim = 256, .n_tokens = 300, .n_checkpoints = 2};
    st_image *a = NULL, *got = NULL;
    assert_int_equal(st_image_synthesize(&so, &a), 0);
    assert_int_equal(st_store_put(st, "big", a, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    count_hook c = {0, 0};
    st_image_allocator al = {hook_alloc, hook_free, &c};
    assert_int_equal(st_store_get_with(st, "big", 0, &al, &got), 0);
    assert_true(c.allocs >= 2); /* the two checkpoints' blocks */
    assert_true(store_test_equal(got, a));
    st_image_free(got);
    assert_int_equal(c.frees, c.allocs);
    store_test_assert_get(st, "big", 0, a);
    /* every chunk damaged behind the store's back */
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_cursor_open(txn, st->dbi_chunks, &cur), 0);
    int n = 0;
    for (int rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        uint8_t *b = malloc(v.mv_size);
        assert_non_null(b);
        memcpy(b, v.mv_data, v.mv_size);
        b[v.mv_size / 2] ^= 1;
        MDB_val nv = {v.mv_size, b};
        assert_int_equal(mdb_cursor_put(cur, &k, &nv, MDB_CURRENT), 0);
        free(b);
        n++;
    }
    mdb_cursor_close(cur);
    assert_int_equal(mdb_txn_commit(txn), 0);
    assert_true(n > 2);
    c = (count_hook){0, 0};
    assert_int_equal(st_store_get_with(st, "big", 0, &al, &got), ST_ECORRUPT);
    assert_null(got);
    assert_int_equal(c.frees, c.allocs);
    st_store_close(st);
    st_image_free(a);
}

/* A streamed get of name: the gate is set, every K/V byte range read piece by piece (from the
 * last tensor's end back, so the waits come out of the fill's order) holds want's bytes once its
 * wait returns, and the whole image equals want once the fill ends. */
static void stream_check(st_store *st, const char *name, const st_image *want, const st_image_allocator *al)
{
    st_image *got = NULL;
    st_store_fill *fill = NULL;
    int rc = st_store_get_stream(st, name, 0, al, &got, &fill);
    if (rc)
        print_error("get_stream %s: %s: %s\n", name, st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    assert_true(st_image_gated(got));
    assert_int_equal(st_image_n_tokens(got), st_image_n_tokens(want));
    assert_int_equal(st_image_state_hash(got), st_image_state_hash(want));
    const st_geometry *g = st_image_geometry(got);
    for (uint32_t k = g->n_tensors; k-- > 0;) {
        if (g->tensors[k].role != ST_ROLE_KV)
            continue;
        uint64_t len = 0, wlen = 0;
        const uint8_t *p = st_image_kv_const(got, k, &len), *w = st_image_kv_const(want, k, &wlen);
        assert_int_equal(len, wlen);
        for (uint64_t o = len; o > 0;) {
            uint64_t piece = o < 7777 ? o : 7777;
            o -= piece;
            assert_int_equal(st_image_wait(got, p + o, piece), 0);
            assert_memory_equal(p + o, w + o, piece);
        }
    }
    assert_int_equal(st_image_wait(got, NULL, 0), 0);
    assert_int_equal(st_store_stream_end(fill), 0);
    assert_false(st_image_gated(got));
    assert_true(store_test_equal(got, want));
    st_image_free(got);
}

/* The streamed get (st_store_get_stream): the same image as a get, raw, framed, with SHA-256
 * checking and with an allocation hook, on one thread and on several; a damaged K/V chunk fails
 * the waits on it (naming the chunk), every later one and the end, and the image is still freed
 * cleanly; a missing session fails at once. */
static void test_get_stream(void **state)
{
    (void)state;
    char dir[4200];
    st_store_opts o4 = {.threads = 4};
    st_store *st = open_new(dir, sizeof dir, &o4);
    st_synth_opts so = {.seed = 11, .head_dim = 256, .n_tokens = 700, .n_checkpoints = 2};
    st_image *a = NULL;
    assert_int_equal(st_image_synthesize(&so, &a), 0);
    st_put_opts pz = {.compress = 3};
    assert_int_equal(st_store_put(st, "raw", a, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "z", a, ST_STORE_HEAD_NONE, &pz, NULL), 0);
    count_hook c = {0, 0};
    st_image_allocator al = {hook_alloc, hook_free, &c};
    stream_check(st, "raw", a, NULL);
    stream_check(st, "z", a, NULL);
    stream_check(st, "raw", a, &al);
    assert_true(c.allocs >= 2);
    assert_int_equal(c.frees, c.allocs);
    st_image *got = NULL;
    st_store_fill *fill = NULL;
    assert_int_equal(st_store_get_stream(st, "nobody", 0, NULL, &got, &fill), ST_ENOTFOUND);
    assert_null(got);
    assert_null(fill);
    assert_int_equal(st_store_stream_end(NULL), 0);
    st_store_close(st);
    st_store_opts one = {.threads = 1, .verify_sha256 = 1};
    assert_int_equal(st_store_open(&st, dir, &one), 0);
    stream_check(st, "raw", a, NULL);
    stream_check(st, "z", a, NULL);
    st_store_close(st);

    /* one K/V chunk damaged behind the store's back: bytes [32768, 65536) of the first K/V
     * tensor, its second page (a chunk of its own: K/V chunks are pages) */
    st_image *b = store_test_image(91, 600, 0, 0);
    st = open_new(dir, sizeof dir, &o4);
    assert_int_equal(st_store_put(st, "b", b, 0, NULL, NULL), 0);
    uint64_t len;
    uint32_t kv = store_test_kv(b);
    const uint8_t *kvb = st_image_kv_const(b, kv, &len);
    assert_true(len > 65536);
    uint8_t h[ST_STORE_HASH_LEN];
    assert_int_equal(st_store_sha256(kvb + 32768, 32768, h), 0);
    MDB_txn *txn = NULL;
    MDB_val k = {ST_STORE_HASH_LEN, h}, v;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_get(txn, st->dbi_chunks, &k, &v), 0);
    uint8_t *dam = malloc(v.mv_size);
    assert_non_null(dam);
    memcpy(dam, v.mv_data, v.mv_size);
    dam[100] ^= 0x40;
    MDB_val nv = {v.mv_size, dam};
    assert_int_equal(mdb_put(txn, st->dbi_chunks, &k, &nv, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    free(dam);
    assert_int_equal(st_store_get_stream(st, "b", 0, NULL, &got, &fill), 0);
    const uint8_t *p = st_image_kv_const(got, kv, &len);
    assert_int_equal(st_image_wait(got, p + 32768 + 5000, 10), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
    char hex[65];
    st_store_hex(hex, h, 32);
    assert_non_null(strstr(st_errdetail(), hex));
    assert_int_equal(st_image_wait(got, NULL, 0), ST_ECORRUPT);
    assert_int_equal(st_store_stream_end(fill), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
    st_image_free(got);
    /* the control: a get refuses the same damage */
    assert_int_equal(st_store_get(st, "b", 0, &got), ST_ECORRUPT);
    assert_null(got);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

/* The damage of test_get_stream in a compressed (framed) chunk: the zstd frame's bytes changed
 * behind the store's back, the frame still its stored length. The wait for the whole image fails
 * naming the chunk, and so does the end, with ST_ECORRUPT; a get refuses it too (the control). */
static void test_get_stream_framed_damage(void **state)
{
    (void)state;
    char dir[4200];
    st_store_opts o4 = {.threads = 4};
    st_store *st = open_new(dir, sizeof dir, &o4);
    st_image *b = store_test_image(93, 600, 0, 0);
    st_put_opts pz = {.compress = 3};
    assert_int_equal(st_store_put(st, "z", b, 0, &pz, NULL), 0);
    stream_check(st, "z", b, NULL); /* undamaged first */
    /* a chunk stored as a frame (a K/V page of 32 KiB compressed below it; chunks are keyed by
     * the SHA-256 of their stored bytes), its middle changed behind the store's back */
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_cursor_open(txn, st->dbi_chunks, &cur), 0);
    int found = 0, crc;
    uint8_t key[ST_STORE_HASH_LEN];
    for (crc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); crc == 0 && !found;
         crc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
        if (k.mv_size == ST_STORE_HASH_LEN && v.mv_size > 1024 && v.mv_size < 32768 &&
            !memcmp(v.mv_data, "STZ", 3)) { /* a frame (codec/st_frame.c's header) */
            memcpy(key, k.mv_data, sizeof key);
            found = 1;
        }
    mdb_cursor_close(cur);
    assert_true(found);
    k.mv_size = sizeof key;
    k.mv_data = key;
    assert_int_equal(mdb_get(txn, st->dbi_chunks, &k, &v), 0);
    uint8_t *dam = malloc(v.mv_size);
    assert_non_null(dam);
    memcpy(dam, v.mv_data, v.mv_size);
    for (size_t i = v.mv_size / 2; i < v.mv_size / 2 + 8; i++)
        dam[i] ^= 0x5a;
    MDB_val nv = {v.mv_size, dam};
    assert_int_equal(mdb_put(txn, st->dbi_chunks, &k, &nv, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    free(dam);
    st_image *got = NULL;
    st_store_fill *fill = NULL;
    assert_int_equal(st_store_get_stream(st, "z", 0, NULL, &got, &fill), 0);
    char hex[65];
    st_store_hex(hex, key, 32);
    assert_int_equal(st_image_wait(got, NULL, 0), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), hex));
    assert_int_equal(st_store_stream_end(fill), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "mismatch"));
    st_image_free(got);
    /* the control: a get refuses the same damage */
    assert_int_equal(st_store_get(st, "z", 0, &got), ST_ECORRUPT);
    assert_null(got);
    st_store_close(st);
    st_image_free(b);
}

/* Puts from the calling thread while a streamed get's fill runs, enough of them that the map
 * grows (a small map_initial): the fill's image is the stored one, every put is acknowledged and
 * reads back, and the map did grow. The fill holds its read transaction until it ends
 * (docs/STORE.md, "The streamed get"), and a growth waits for it instead of failing; nothing
 * here holds the fill open, so on a fast machine it may end before the first growth (the test
 * then shows only that puts started during a fill are safe). */
static void test_get_stream_with_writes(void **state)
{
    (void)state;
    char dir[4200];
    st_image *a = store_test_image(95, 3000, 0, 0);
    uint64_t bytes = st_image_bytes(a);
    st_store_opts o = {.threads = 2, .map_initial = 4 * bytes, .budget = 64 * bytes};
    st_store *st = open_new(dir, sizeof dir, &o);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    st_store_stats s0, s1;
    assert_int_equal(st_store_stat(st, &s0), 0);
    st_image *got = NULL;
    st_store_fill *fill = NULL;
    assert_int_equal(st_store_get_stream(st, "a", 0, NULL, &got, &fill), 0);
    st_image *w[8];
    for (int i = 0; i < 8; i++) {
        char id[16];
        snprintf(id, sizeof id, "w%d", i);
        w[i] = store_test_image(200 + (uint64_t)i, 3000, 0, 0);
        int rc = st_store_put(st, id, w[i], 0, NULL, NULL);
        if (rc)
            print_error("put %s during the fill: %s: %s\n", id, st_strerror(rc), st_errdetail());
        assert_int_equal(rc, 0);
    }
    assert_int_equal(st_image_wait(got, NULL, 0), 0);
    assert_int_equal(st_store_stream_end(fill), 0);
    assert_true(store_test_equal(got, a));
    st_image_free(got);
    assert_int_equal(st_store_stat(st, &s1), 0);
    assert_true(s1.map_size > s0.map_size);
    for (int i = 0; i < 8; i++) {
        char id[16];
        snprintf(id, sizeof id, "w%d", i);
        assert_int_equal(st_store_get(st, id, 0, &got), 0);
        assert_true(store_test_equal(got, w[i]));
        st_image_free(got);
        st_image_free(w[i]);
    }
    stream_check(st, "a", a, NULL);
    st_store_close(st);
    st_image_free(a);
}

/* A put never acknowledges a version whose recorded state hash is not its own: it could never be
 * restored (issue 10: bf16 SAVEs of parked conversations). Nothing is written, and the same
 * image with its true hash is then taken. */
static void test_put_refuses_wrong_state_hash(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(91, 600, 0, 0);
    uint64_t good = st_image_state_hash(a), h = 0;
    assert_int_equal(st_image_state_hash_compute(a, NULL, NULL, &h), 0);
    assert_true(good != 0 && good == h); /* synthetic images record their true hash */
    /* a checkpoint re-coded behind the hash's back: what the server's bf16 SAVE of a parked
     * conversation stored before st_image_recode */
    st_image *b = NULL;
    assert_int_equal(st_image_clone(&b, a), 0);
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    assert_non_null(scratch);
    for (uint32_t ci = 0; ci < st_image_n_checkpoints(b); ci++)
        assert_int_equal(st_image_checkpoint_recode(b, ci, ST_CODEC_BF16, scratch, ST_CODEC_SCRATCH_MAX), 0);
    free(scratch);
    assert_int_equal(st_store_put(st, "bad", b, 0, NULL, NULL), ST_ECORRUPT);
    char want[160];
    assert_int_equal(st_image_state_hash_compute(b, NULL, NULL, &h), 0);
    snprintf(want, sizeof want, "state hash mismatch: the image records %016llx, its content hashes to %016llx",
             (unsigned long long)good, (unsigned long long)h);
    assert_non_null(strstr(st_errdetail(), want));
    st_session_info si;
    assert_int_equal(st_store_show(st, "bad", &si), ST_ENOTFOUND);
    /* over an existing session: its head stays */
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "a", b, 0, NULL, NULL), ST_ECORRUPT);
    assert_int_equal(st_store_show(st, "a", &si), 0);
    assert_int_equal(si.head, 1);
    assert_int_equal(si.n_versions, 1);
    /* a large image takes the threaded hash: the same verdict */
    st_image *big = NULL;
    st_synth_opts so = {.seed = 92, .n_layers = 8, .heads = 16, .head_dim = 64, .n_tokens = 4000,
                        .n_checkpoints = 2};
    assert_int_equal(st_image_synthesize(&so, &big), 0);
    assert_true(st_image_bytes(big) > (4u << 20)); /* ST_PAR_MIN_BYTES */
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
    st_image_state_hash_set(big, st_image_state_hash(big) ^ 1);
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), ST_ECORRUPT);
    /* with its hash recomputed, the re-coded image is taken; no hash (0) is not checked */
    assert_int_equal(st_image_state_hash_compute(b, NULL, NULL, &h), 0);
    st_image_state_hash_set(b, h);
    assert_int_equal(st_store_put(st, "bad", b, 0, NULL, NULL), 0);
    st_image_state_hash_set(a, 0);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
    st_image_free(big);
}

/* check --read-data reassembles every version and names one whose state hash is wrong (one
 * stored by an older build, here written behind the store's back) as state-hash; the structure
 * pass alone does not see it. */
static void test_check_state_hash(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(93, 600, 0, 0), *b = store_test_image(94, 300, 0, 0);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "a", b, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "b", b, 0, NULL, NULL), 0);
    /* version 1 of "a": its manifest re-encoded with another state hash */
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    uint8_t key[ST_STORE_ID_MAX + 16];
    MDB_val k = {st_vkey(key, "a", 1), key}, v;
    assert_int_equal(mdb_get(txn, st->dbi_versions, &k, &v), 0);
    st_manifest m;
    assert_int_equal(st_manifest_parse(v.mv_data, v.mv_size, "a 1", &m), 0);
    uint64_t recorded = m.state_hash ^ 0x5a;
    m.state_hash = recorded;
    uint8_t *mb = NULL;
    size_t ml = 0;
    assert_int_equal(st_manifest_encode(&m, &mb, &ml), 0);
    st_manifest_free(&m);
    MDB_val nv = {ml, mb};
    assert_int_equal(mdb_put(txn, st->dbi_versions, &k, &nv, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    free(mb);
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 0, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 0);
    assert_int_equal(res.versions_hashed, 0);
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_int_equal(res.versions_hashed, 3);
    assert_int_equal(pr.kind[0], ST_CHECK_STATE_HASH);
    assert_string_equal(pr.session[0], "a");
    st_image *got = NULL;
    assert_int_equal(st_store_get(st, "a", 1, &got), 0); /* its bytes are intact */
    assert_int_equal(st_image_state_hash(got), recorded);
    st_image_free(got);
    /* a backup copies the content as it is: the copy's bytes check, the version stays named */
    char bak[4300];
    snprintf(bak, sizeof bak, "%s.bak", dir);
    assert_int_equal(st_store_backup(st, bak), 0);
    st_store_close(st);
    assert_int_equal(st_store_open(&st, bak, NULL), 0);
    memset(&pr, 0, sizeof pr);
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_int_equal(pr.kind[0], ST_CHECK_STATE_HASH);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

/* Overwrite the stored chunk under hash h with n bytes of val, behind the store's back. */
static void chunk_overwrite(st_store *st, const uint8_t *h, const void *val, size_t n)
{
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    MDB_val k = {ST_STORE_HASH_LEN, (void *)h}, v = {n, (void *)val};
    assert_int_equal(mdb_put(txn, st->dbi_chunks, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
}

static void test_put_repairs(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *a = store_test_image(91, 600, 0, 0);
    assert_int_equal(st_store_put(st, "a", a, 0, NULL, NULL), 0);
    uint64_t len;
    const uint8_t *kv = st_image_kv_const(a, store_test_kv(a), &len);
    uint8_t h[ST_STORE_HASH_LEN];
    assert_int_equal(st_store_sha256(kv, 32768, h), 0);
    /* a wrong length is always found and repaired */
    chunk_overwrite(st, h, kv, 100);
    st_put_stats ps;
    assert_int_equal(st_store_put(st, "a", a, ST_STORE_HEAD_ANY, &(st_put_opts){.stats = &ps}, NULL), 0);
    assert_int_equal(ps.repaired, 1);
    store_test_assert_get(st, "a", 0, a);
    store_test_assert_clean(st);
    /* flipped bytes of the right length: found within 16 puts */
    uint8_t *bad = malloc(32768);
    assert_non_null(bad);
    memcpy(bad, kv, 32768);
    bad[1000] ^= 0x40;
    chunk_overwrite(st, h, bad, 32768);
    uint32_t repaired = 0;
    for (int i = 0; i < 16 && !repaired; i++) {
        assert_int_equal(st_store_put(st, "a", a, ST_STORE_HEAD_ANY, &(st_put_opts){.stats = &ps}, NULL), 0);
        repaired += ps.repaired;
    }
    assert_int_equal(repaired, 1);
    store_test_assert_get(st, "a", 0, a);
    store_test_assert_clean(st);
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 0);
    free(bad);
    st_store_close(st);
    st_image_free(a);
}

/* Page through every session with page size limit from `from`: the concatenation of the pages
 * is want[0..n_want), every page but the last is full, and the last is short or followed by an
 * empty one. */
static void page_through(st_store *st, const char *from, size_t limit, const st_session_info *want,
                         size_t n_want)
{
    st_session_info *buf = calloc(limit ? limit : 1, sizeof *buf);
    assert_non_null(buf);
    char after[ST_STORE_ID_MAX + 1];
    snprintf(after, sizeof after, "%s", from);
    size_t seen = 0;
    for (int pages = 0;; pages++) {
        assert_true(pages <= (int)(n_want / limit) + 1);
        size_t n = 99;
        int rc = st_store_list_page(st, after, buf, limit, &n);
        if (rc)
            print_error("list page after '%s': %s: %s\n", after, st_strerror(rc), st_errdetail());
        assert_int_equal(rc, 0);
        assert_true(n <= limit);
        assert_true(seen + n <= n_want);
        for (size_t i = 0; i < n; i++) {
            assert_string_equal(buf[i].id, want[seen + i].id);
            assert_memory_equal(&buf[i], &want[seen + i], sizeof buf[i]);
        }
        seen += n;
        if (n < limit)
            break;
        snprintf(after, sizeof after, "%s", buf[n - 1].id);
    }
    assert_int_equal(seen, n_want);
    free(buf);
}

static void test_list_page(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *img = store_test_image(7, 300, 0, 0);
    /* ids whose bytewise order differs from a naive one: case, prefixes, punctuation, park: */
    static const char *const ids[] = {"b", "a", "ab", "ab-1", "ab.1", "aB", "B", "0", "09", "9",
                                      "park:x", "park-1", "parkZ", "z", "Z", "a_", "a=", "a+b",
                                      "m0", "m2", "m-", "x.y", "ab0", "c", "cc", "ccc", "c-c",
                                      "d", "e", "f", "g", "h", "i", "j", "k", "l", "n", "o", "p",
                                      "q", "r", "s", "t", "u", "v", "w", "y", "Q", "R", "S"};
    size_t n_ids = sizeof ids / sizeof ids[0];
    for (size_t i = 0; i < n_ids; i++)
        assert_int_equal(st_store_put(st, ids[i], img, ST_STORE_HEAD_NONE, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "m0", img, ST_STORE_HEAD_ANY, NULL, NULL), 0); /* head 2 */
    st_session_info *all = NULL;
    size_t n_all = 0;
    assert_int_equal(st_store_list(st, &all, &n_all), 0);
    assert_int_equal(n_all, n_ids);
    for (size_t i = 1; i < n_all; i++)
        assert_true(strcmp(all[i - 1].id, all[i].id) < 0);

    /* every session exactly once, in order, whatever the page size */
    static const size_t limits[] = {1, 2, 3, 7, 49, 50, 51, 1000};
    for (size_t l = 0; l < sizeof limits / sizeof limits[0]; l++) {
        page_through(st, "", limits[l], all, n_all);
        st_session_info one;
        size_t n = 0;
        assert_int_equal(st_store_list_page(st, NULL, &one, 1, &n), 0); /* NULL: the start */
        assert_int_equal(n, 1);
        assert_string_equal(one.id, all[0].id);
    }
    /* an id that is not in the store is a position: what sorts after it follows */
    static const char *const positions[] = {"aa", "ab-", "m1", "park", "park:", "park:y", "Y", "zz", "+",
                                            "ab", "park:x", "z"};
    for (size_t p = 0; p < sizeof positions / sizeof positions[0]; p++) {
        size_t k = 0;
        while (k < n_all && strcmp(all[k].id, positions[p]) <= 0)
            k++;
        page_through(st, positions[p], 4, all + k, n_all - k);
    }
    /* past the end: an empty page */
    st_session_info buf[4];
    size_t n = 99;
    assert_int_equal(st_store_list_page(st, all[n_all - 1].id, buf, 4, &n), 0);
    assert_int_equal(n, 0);
    n = 99;
    assert_int_equal(st_store_list_page(st, "zzzz", buf, 4, &n), 0);
    assert_int_equal(n, 0);
    /* limit 0 reads nothing; bad arguments are refused */
    n = 99;
    assert_int_equal(st_store_list_page(st, "a", NULL, 0, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(st_store_list_page(st, "a/b", buf, 4, &n), ST_EINVAL);
    assert_int_equal(st_store_list_page(st, "a b", buf, 4, &n), ST_EINVAL);
    char long_id[ST_STORE_ID_MAX + 2];
    memset(long_id, 'a', sizeof long_id - 1);
    long_id[sizeof long_id - 1] = '\0';
    assert_int_equal(st_store_list_page(st, long_id, buf, 4, &n), ST_EINVAL);
    assert_int_equal(st_store_list_page(st, "a", NULL, 4, &n), ST_EINVAL);
    assert_int_equal(st_store_list_page(st, "a", buf, 4, NULL), ST_EINVAL);
    /* a deleted session leaves its page, the session after it moves up */
    assert_int_equal(st_store_session_delete(st, "ab-1"), 0);
    n = 0;
    assert_int_equal(st_store_list_page(st, "ab", buf, 1, &n), 0);
    assert_int_equal(n, 1);
    assert_string_equal(buf[0].id, "ab.1");
    free(all);
    st_store_close(st);
    st_image_free(img);
}

static void test_versions_page(void **state)
{
    (void)state;
    char dir[4200];
    st_store *st = open_new(dir, sizeof dir, NULL);
    st_image *img = store_test_image(8, 300, 0, 0);
    /* "v0" and "v" share a prefix: the versions of one never appear in the other's pages */
    for (int i = 0; i < 6; i++)
        assert_int_equal(st_store_put(st, "v", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
    for (int i = 0; i < 3; i++) {
        assert_int_equal(st_store_put(st, "v0", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
        assert_int_equal(st_store_put(st, "u", img, ST_STORE_HEAD_ANY, NULL, NULL), 0);
    }
    assert_int_equal(st_store_version_delete(st, "v", 3), 0);
    st_version_info *all = NULL;
    size_t n_all = 0;
    assert_int_equal(st_store_versions(st, "v", &all, &n_all), 0);
    assert_int_equal(n_all, 5); /* 1 2 4 5 6 */
    for (size_t limit = 1; limit <= 6; limit++) {
        st_version_info buf[6];
        uint64_t after = 0;
        size_t seen = 0, n = 0;
        do {
            assert_int_equal(st_store_versions_page(st, "v", after, buf, limit, &n), 0);
            assert_true(n <= limit && seen + n <= n_all);
            for (size_t i = 0; i < n; i++)
                assert_memory_equal(&buf[i], &all[seen + i], sizeof buf[i]);
            seen += n;
            if (n)
                after = buf[n - 1].version;
        } while (n == limit);
        assert_int_equal(seen, n_all);
    }
    st_version_info buf[4];
    size_t n = 99;
    /* a missing version is a position; past the end is empty */
    assert_int_equal(st_store_versions_page(st, "v", 3, buf, 4, &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(buf[0].version, 4);
    assert_int_equal(buf[2].version, 6);
    assert_int_equal(st_store_versions_page(st, "v", 6, buf, 4, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(st_store_versions_page(st, "v", UINT64_MAX, buf, 4, &n), 0);
    assert_int_equal(n, 0);
    assert_int_equal(st_store_versions_page(st, "v0", 1, buf, 4, &n), 0);
    assert_int_equal(n, 2);
    assert_int_equal(buf[0].version, 2);
    assert_int_equal(buf[1].version, 3);
    assert_int_equal(st_store_versions_page(st, "w", 0, buf, 4, &n), ST_ENOTFOUND);
    assert_int_equal(st_store_versions_page(st, "a/b", 0, buf, 4, &n), ST_EINVAL);
    free(all);
    st_store_close(st);
    st_image_free(img);
}

int main(void)
{
    st_test_tmpdir(base, sizeof base, "test_store");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_open_close),
        cmocka_unit_test(test_put_get_versions),
        cmocka_unit_test(test_conflicts),
        cmocka_unit_test(test_dedup_prefix),
        cmocka_unit_test(test_retention_labels),
        cmocka_unit_test(test_delete),
        cmocka_unit_test(test_gc),
        cmocka_unit_test(test_compression),
        cmocka_unit_test(test_version_codecs),
        cmocka_unit_test(test_stat_free_map),
        cmocka_unit_test(test_import_export),
        cmocka_unit_test(test_geometry_refused),
        cmocka_unit_test(test_arch_name),
        cmocka_unit_test(test_map_growth_and_budget),
        cmocka_unit_test(test_backup_restore),
        cmocka_unit_test(test_schema_refused),
        cmocka_unit_test(test_check_finds_damage),
        cmocka_unit_test(test_put_refuses_wrong_state_hash),
        cmocka_unit_test(test_check_state_hash),
        cmocka_unit_test(test_put_repairs),
        cmocka_unit_test(test_list_page),
        cmocka_unit_test(test_versions_page),
        cmocka_unit_test(test_get_with_allocator),
        cmocka_unit_test(test_get_stream),
        cmocka_unit_test(test_get_stream_framed_damage),
        cmocka_unit_test(test_get_stream_with_writes),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
