/*
 * test_store_corrupt.c - corruption at rest: bytes flipped inside a stored chunk (found by its
 * contents in data.mdb) are named by `check --read-data` and make get/export fail with
 * ST_ECORRUPT naming the chunk and the session, never return wrong bytes; the structural check
 * alone does not read data; a damaged manifest is caught by its checksum; other sessions stay
 * readable; a value LMDB rewrote in place in its overflow pages is not damage.
 */
#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>

#include "store_test.h"

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */

static uint8_t *find_once(uint8_t *hay, size_t hay_len, const void *needle, size_t n)
{
    uint8_t *hit = memmem(hay, hay_len, needle, n);
    assert_non_null(hit);
    assert_null(memmem(hit + 1, hay_len - (size_t)(hit + 1 - hay), needle, n));
    return hit;
}

static void flip_in_file(const char *path, size_t off)
{
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b;
    assert_int_equal(pread(fd, &b, 1, (off_t)off), 1);
    b ^= 0x5a;
    assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
    assert_int_equal(close(fd), 0);
}

static void test_flipped_chunk(void **state)
{
    (void)state;
    char dir[1200], db[1300], out[1300];
    snprintf(dir, sizeof dir, "%s/chunk", base);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    snprintf(out, sizeof out, "%s/victim.out", base);
    st_image *a = store_test_image(1, 600, 0, 0), *b = store_test_image(2, 900, 0, 0);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.create = 1}), 0);
    assert_int_equal(st_store_put(st, "victim", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "other", b, 0, NULL, NULL), 0);
    st_store_close(st);

    /* page 1 of a's first K/V tensor is one 32 KiB chunk: find its bytes and damage one */
    uint64_t len;
    const uint8_t *kv = st_image_kv_const(a, store_test_kv(a), &len);
    const size_t page = 32768;
    uint8_t h[ST_STORE_HASH_LEN];
    char hex[2 * ST_STORE_HASH_LEN + 1];
    assert_int_equal(st_store_sha256(kv + page, page, h), 0);
    st_store_hex(hex, h, ST_STORE_HASH_LEN);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    assert_non_null(file);
    uint8_t *hit = find_once(file, flen, kv + page, page);
    flip_in_file(db, (size_t)(hit - file) + 1000);
    free(file);

    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    store_test_problems pr;
    st_check_result res;
    memset(&pr, 0, sizeof pr);
    assert_int_equal(st_store_check(st, 0, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 0); /* the structure is intact; only the data pass reads bytes */
    memset(&pr, 0, sizeof pr);
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_int_equal(pr.kind[0], ST_CHECK_CORRUPT_CHUNK);
    assert_string_equal(pr.chunk[0], hex);
    assert_string_equal(pr.session[0], "victim");
    assert_true(res.chunks_read > 0 && res.chunks_read == res.chunks);

    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "victim", 0, &img), ST_ECORRUPT);
    assert_null(img);
    char want[128];
    snprintf(want, sizeof want, "chunk %.16s", hex);
    assert_non_null(strstr(st_errdetail(), want));
    assert_non_null(strstr(st_errdetail(), "session victim version 1"));
    assert_int_equal(st_store_export(st, "victim", 0, out, NULL), ST_ECORRUPT);
    assert_int_not_equal(access(out, F_OK), 0);
    store_test_assert_get(st, "other", 0, b);
    st_store_close(st);

    /* SHA-256 verification finds it too */
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.verify_sha256 = 1}), 0);
    assert_int_equal(st_store_get(st, "victim", 0, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "SHA-256"));
    /* a new put of the intact image does not "heal" by trusting the damaged copy silently:
     * the chunk is found by its key and the damage stays visible to check */
    assert_int_equal(st_store_put(st, "again", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_get(st, "again", 0, &img), ST_ECORRUPT);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

static void test_flipped_compressed_chunk(void **state)
{
    (void)state;
    char dir[1200], db[1300];
    snprintf(dir, sizeof dir, "%s/framed", base);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    st_image *a = store_test_image(3, 2000, 0, 0);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.create = 1}), 0);
    assert_int_equal(st_store_put(st, "z", a, 0, &(st_put_opts){.compress = 3}, NULL), 0);
    /* the manifest's last K/V chunk: locate its stored bytes through the store itself */
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, "z", 0, &vi), 0);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, "z", 1), kb}, v;
    assert_int_equal(mdb_get(txn, st->dbi_versions, &k, &v), 0);
    st_manifest m;
    assert_int_equal(st_manifest_parse(v.mv_data, v.mv_size, "z", &m), 0);
    uint32_t pick = UINT32_MAX;
    for (uint32_t i = 0; i < m.n_chunks; i++)
        if (m.chunks[i].stored_len < m.chunks[i].raw_len && m.chunks[i].stored_len > 4096)
            pick = i;
    assert_true(pick != UINT32_MAX);
    MDB_val ck = {ST_STORE_HASH_LEN, m.chunks[pick].hash}, cv;
    assert_int_equal(mdb_get(txn, st->dbi_chunks, &ck, &cv), 0);
    size_t n = cv.mv_size;
    uint8_t *copy = malloc(n);
    memcpy(copy, cv.mv_data, n);
    char hex[65];
    st_store_hex(hex, m.chunks[pick].hash, 32);
    st_manifest_free(&m);
    mdb_txn_abort(txn);
    st_store_close(st);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    uint8_t *hit = find_once(file, flen, copy, n);
    flip_in_file(db, (size_t)(hit - file) + n / 2);
    free(file);
    free(copy);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "z", 0, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "session z"));
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_string_equal(pr.chunk[0], hex);
    st_store_close(st);
    st_image_free(a);
}

static void test_flipped_manifest(void **state)
{
    (void)state;
    char dir[1200], db[1300];
    snprintf(dir, sizeof dir, "%s/manifest", base);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    st_image *a = store_test_image(4, 600, 0, 0), *b = store_test_image(5, 900, 0, 0);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.create = 1}), 0);
    assert_int_equal(st_store_put(st, "m1", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "m2", b, 0, NULL, NULL), 0);
    st_store_close(st);
    /* m2's manifest: magic "STMF", version 1, and 900 tokens at offset 32 */
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    uint8_t pat[40];
    memset(pat, 0, sizeof pat);
    memcpy(pat, "STMF", 4);
    st_put16(pat + 4, ST_MANIFEST_FORMAT);
    size_t found = 0;
    for (uint8_t *p = file; (p = memmem(p, flen - (size_t)(p - file), pat, 6)); p++) {
        if ((size_t)(p - file) + 40 <= flen && st_get64(p + 32) == 900) {
            found = (size_t)(p - file);
            break;
        }
    }
    assert_true(found > 0);
    free(file);
    flip_in_file(db, found + 24); /* the state hash */
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "m2", 0, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "session m2 version 1: manifest checksum"));
    store_test_assert_get(st, "m1", 0, a);
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 0, store_test_report, &pr, &res), 0);
    assert_true(res.problems >= 1);
    assert_int_equal(pr.kind[0], ST_CHECK_MANIFEST);
    assert_string_equal(pr.session[0], "m2");
    /* deleting the damaged version is refused (its references cannot be known) */
    assert_int_equal(st_store_version_delete(st, "m2", 1), ST_ECORRUPT);
    st_store_close(st);
    st_image_free(a);
    st_image_free(b);
}

/* A flipped page-count byte in the header of a chunk's overflow pages: LMDB trusts the count when
 * it frees the pages, so deleting the version listed 16 million pages and grew the map (a RESTORE
 * that never answered). check names the page, get and delete refuse with ST_ECORRUPT, the file does
 * not grow, the other session stays readable. */
static void test_overflow_count(void **state)
{
    (void)state;
    char dir[1200], db[1300];
    snprintf(dir, sizeof dir, "%s/ovcount", base);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    st_image *a = store_test_image(6, 700, 0, 0), *b = store_test_image(7, 500, 0, 0);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.create = 1}), 0);
    assert_int_equal(st_store_put(st, "victim", a, 0, NULL, NULL), 0);
    assert_int_equal(st_store_put(st, "other", b, 0, NULL, NULL), 0);
    /* the file offset of a K/V chunk's overflow page header (its value starts 16 bytes in) */
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, "victim", 1), kb}, v;
    assert_int_equal(mdb_get(txn, st->dbi_versions, &k, &v), 0);
    st_manifest m;
    assert_int_equal(st_manifest_parse(v.mv_data, v.mv_size, "victim", &m), 0);
    uint32_t pick = UINT32_MAX;
    for (uint32_t i = 0; i < m.n_chunks && pick == UINT32_MAX; i++)
        if (m.chunks[i].stored_len > 16384)
            pick = i;
    assert_true(pick != UINT32_MAX);
    MDB_val ck = {ST_STORE_HASH_LEN, m.chunks[pick].hash}, cv;
    assert_int_equal(mdb_get(txn, st->dbi_chunks, &ck, &cv), 0);
    MDB_stat ms;
    assert_int_equal(mdb_env_stat(st->env, &ms), 0);
    size_t n = cv.mv_size;
    uint8_t *copy = malloc(n);
    assert_non_null(copy);
    memcpy(copy, cv.mv_data, n);
    st_manifest_free(&m);
    mdb_txn_abort(txn);
    st_store_close(st);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    size_t hdr = (size_t)(find_once(file, flen, copy, n) - file) - 16;
    assert_int_equal(hdr % ms.ms_psize, 0);
    free(file);
    free(copy);
    flip_in_file(db, hdr + 15); /* the count's high byte: 0x5a << 24 more pages */
    struct stat sb0, sb1;
    assert_int_equal(stat(db, &sb0), 0);

    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    store_test_problems pr;
    st_check_result res;
    memset(&pr, 0, sizeof pr);
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 1);
    assert_int_equal(pr.kind[0], ST_CHECK_PAGE);
    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "victim", 0, &img), ST_ECORRUPT);
    assert_null(img);
    char want[64];
    snprintf(want, sizeof want, "overflow page %zu", hdr / ms.ms_psize);
    assert_non_null(strstr(st_errdetail(), want));
    assert_non_null(strstr(st_errdetail(), "statectl restore-backup"));
    assert_int_equal(st_store_version_delete(st, "victim", 1), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), want));
    assert_int_equal(st_store_session_delete(st, "victim"), ST_ECORRUPT);
    store_test_assert_get(st, "other", 0, b);
    st_store_close(st);
    assert_int_equal(stat(db, &sb1), 0);
    assert_true(sb1.st_size <= sb0.st_size);
    st_image_free(a);
    st_image_free(b);
}

static void count_problem(void *arg, const st_page_problem *p)
{
    ++*(int *)arg;
    fprintf(stderr, "unexpected page problem: %s: page %llu: %s\n", p->db, (unsigned long long)p->pgno,
            p->message);
}

/* LMDB rewrites a value in place in overflow pages of the same transaction when they are large
 * enough and never shrinks them (mdb_cursor_put): a 100-byte value may sit in an overflow page, a
 * 5,000-byte one on the 5 pages a 20,000-byte one had. The free list does this to itself (its
 * saves shrink in a loop), so the walker met it on a store after a crash test; it is not damage. */
static void quiet_problem(void *arg, const st_page_problem *p)
{
    (void)arg;
    (void)p;
}

static void test_overflow_rewritten(void **state)
{
    (void)state;
    char dir[1200], db[1300];
    snprintf(dir, sizeof dir, "%s/ovrewrite", base);
    snprintf(db, sizeof db, "%s/data.mdb", dir);
    assert_int_equal(mkdir(dir, 0700), 0);
    MDB_env *env = NULL;
    MDB_txn *txn = NULL;
    MDB_dbi dbi;
    assert_int_equal(mdb_env_create(&env), 0);
    assert_int_equal(mdb_env_set_maxdbs(env, 2), 0);
    assert_int_equal(mdb_env_open(env, dir, 0, 0600), 0);
    assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
    assert_int_equal(mdb_dbi_open(txn, "t", MDB_CREATE, &dbi), 0);
    static uint8_t big[20002];
    uint32_t x = 2463534242u; /* xorshift: no period a search could land in */
    for (size_t i = 0; i < sizeof big; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        big[i] = (uint8_t)x;
    }
    struct { const char *key; size_t first, then; } rw[] = {{"a", 5000, 100}, {"b", 20000, 5000}, {"c", 3000, 2100}};
    for (size_t i = 0; i < sizeof rw / sizeof rw[0]; i++) {
        MDB_val k = {1, (void *)rw[i].key}, v = {rw[i].first, big + i}; /* a pattern per key */
        assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
        v.mv_size = rw[i].then;
        assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
    }
    assert_int_equal(mdb_txn_commit(txn), 0);
    mdb_env_close(env);

    int problems = 0;
    st_page_stats stats;
    assert_int_equal(st_store__pages_check(db, 0, 0, count_problem, &problems, &stats), 0);
    assert_int_equal(problems, 0);
    assert_int_equal(stats.problems, 0);

    /* negative control: the run shorter than its value is still damage */
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    size_t hdr = (size_t)(find_once(file, flen, big + 1, 5000) - file) - 16;
    assert_int_equal(hdr % stats.psize, 0);
    free(file);
    int fd = open(db, O_RDWR);
    assert_true(fd >= 0);
    uint32_t one = 1; /* the 5,000-byte value needs 2 pages of 4,096 */
    assert_int_equal(pwrite(fd, &one, 4, (off_t)hdr + 12), 4);
    assert_int_equal(close(fd), 0);
    assert_int_equal(st_store__pages_check(db, 0, 0, quiet_problem, NULL, &stats), 0);
    assert_true(stats.problems >= 1);
}

int main(void)
{
    st_test_tmpdir(base, sizeof base, "test_store_corrupt");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_flipped_chunk),
        cmocka_unit_test(test_flipped_compressed_chunk),
        cmocka_unit_test(test_flipped_manifest),
        cmocka_unit_test(test_overflow_count),
        cmocka_unit_test(test_overflow_rewritten),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
