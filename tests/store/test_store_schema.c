/*
 * test_store_schema.c - store schema migration from the golden schema-1 store
 * (tests/data/golden/store-schema1/, regenerated only with ST_REGEN_GOLDEN=1): the old store is
 * refused with the migrate hint, a dry run changes nothing, migration backs up first and every
 * version then exports byte for byte what EXPECTED says; an interrupted migration resumes; a
 * newer schema is refused. restore-backup of a schema-1 backup (st_schema_restore_backup)
 * migrates the copy before putting it in place; a failed step, a damaged backup or a newer schema
 * leave the destination untouched.
 */
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <openssl/evp.h>

#include "gen_store_schema1.h"
#include "st_migrate.h"
#include "store_test.h"

#define GOLDEN ST_TEST_DATA "/golden/store-schema1"

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */

static void copy_golden(char *dst, size_t cap, const char *name)
{
    snprintf(dst, cap, "%s/%s", base, name);
    char out[64];
    assert_int_equal(st_test_run(out, sizeof out, "rm -rf '%s' && mkdir -p '%s' && cp '%s/data.mdb' '%s/'", dst, dst,
                                 GOLDEN, dst),
                     0);
}

static void sha_file(const char *path, char *hex)
{
    size_t len = 0;
    uint8_t *b = st_test_slurp(path, &len), h[ST_STORE_HASH_LEN];
    assert_non_null(b);
    assert_int_equal(st_store_sha256(b, len, h), 0);
    free(b);
    st_store_hex(hex, h, ST_STORE_HASH_LEN);
}

/* Every line of EXPECTED exports to the recorded bytes. */
static void assert_expected(st_store *st)
{
    FILE *f = fopen(GOLDEN "/EXPECTED", "r");
    assert_non_null(f);
    char line[512], id[200], want[80], got[80], out[1200];
    unsigned long long v;
    int n = 0;
    snprintf(out, sizeof out, "%s/export.out", base);
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#')
            continue;
        assert_int_equal(sscanf(line, "%199s %llu %79s", id, &v, want), 3);
        int rc = st_store_export(st, id, v, out, NULL);
        if (rc)
            print_error("export %s@%llu: %s\n", id, v, st_errdetail());
        assert_int_equal(rc, 0);
        sha_file(out, got);
        assert_string_equal(got, want);
        n++;
    }
    fclose(f);
    assert_int_equal(n, 4);
}

/* The golden store's versions were saved from synthetic images that recorded a placeholder state
 * hash (before st_image_synthesize recorded the true one), so none of them could ever be restored
 * by the engine: check with read_data must name each of its 4 versions as state-hash, and find
 * nothing else (the store's bytes and structure are intact). */
static void assert_golden_clean(st_store *st)
{
    store_test_problems pr;
    memset(&pr, 0, sizeof pr);
    st_check_result res;
    assert_int_equal(st_store_check(st, 1, store_test_report, &pr, &res), 0);
    assert_int_equal(res.problems, 4);
    assert_int_equal(pr.n, 4);
    for (int i = 0; i < pr.n; i++)
        assert_int_equal(pr.kind[i], ST_CHECK_STATE_HASH);
    assert_int_equal(res.versions_hashed, res.versions);
}

static void test_golden_migrates(void **state)
{
    (void)state;
    char dir[1200], msg[1400], before[80], after[80], path[1300];
    copy_golden(dir, sizeof dir, "golden");
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, NULL), ST_EVERSION);
    snprintf(msg, sizeof msg, "store schema 1 is older than this build's 2: run `statectl migrate %s`", dir);
    assert_string_equal(st_errdetail(), msg);
    uint32_t schema = 0;
    assert_int_equal(st_store_schema_version(dir, &schema), 0);
    assert_int_equal(schema, 1);

    size_t n = 0;
    const st_schema_step *steps = st_schema_steps(&n);
    assert_int_equal(n, 1);
    assert_int_equal(steps[0].from, 1);
    assert_string_equal(steps[0].name, "refcounts-db");

    /* a dry run reports and changes nothing */
    snprintf(path, sizeof path, "%s/data.mdb", dir);
    sha_file(path, before);
    st_schema_migrate_opts dry = {.dry_run = 1};
    st_schema_migrate_report rep;
    assert_int_equal(st_schema_migrate(dir, &dry, &rep), 0);
    assert_int_equal(rep.from, 1);
    assert_int_equal(rep.to, 2);
    assert_int_equal(rep.n_steps, 1);
    assert_true(rep.items > 0);
    assert_string_equal(rep.backup_dir, "");
    sha_file(path, after);
    assert_string_equal(before, after);

    /* the real thing, with its backup */
    assert_int_equal(st_schema_migrate(dir, NULL, &rep), 0);
    assert_int_equal(rep.to, 2);
    assert_int_equal(rep.n_steps, 1);
    snprintf(msg, sizeof msg, "%s.schema1-backup", dir);
    assert_string_equal(rep.backup_dir, msg);
    assert_int_equal(st_store_schema_version(rep.backup_dir, &schema), 0);
    assert_int_equal(schema, 1);
    assert_int_equal(st_store_open(&st, dir, NULL), 0);
    assert_golden_clean(st);
    assert_expected(st);
    st_session_info si;
    assert_int_equal(st_store_show(st, "alpha", &si), 0);
    assert_int_equal(si.head, 2);
    assert_int_equal(si.n_labels, 1);
    assert_string_equal(si.labels[0].name, "golden");
    /* the codecs of an old version come from what its manifest always recorded */
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, "alpha", 1, &vi), 0);
    assert_int_equal(vi.codec, ST_CODEC_FP32);
    assert_int_equal(vi.codecs, 1u << ST_CODEC_FP32);
    assert_string_equal(vi.arch, "");
    /* the migrated store takes new versions and shares chunks with the old ones */
    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "alpha", 1, &img), 0);
    /* its placeholder state hash (see assert_golden_clean) is refused by a put: nothing is
     * acknowledged that cannot restore; with its true hash it is taken */
    assert_int_equal(st_store_put(st, "delta", img, 0, NULL, NULL), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "state hash mismatch"));
    uint64_t h = 0;
    assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h), 0);
    st_image_state_hash_set(img, h);
    st_put_stats ps;
    st_put_opts po = {.stats = &ps};
    assert_int_equal(st_store_put(st, "delta", img, 0, &po, NULL), 0);
    assert_int_equal(ps.new_chunks, 0);
    assert_golden_clean(st);
    st_image_free(img);
    st_store_close(st);

    /* again: nothing to do, no backup */
    assert_int_equal(st_schema_migrate(dir, NULL, &rep), 0);
    assert_int_equal(rep.n_steps, 0);
    assert_int_equal(rep.from, 2);
    assert_string_equal(rep.backup_dir, "");

    /* the old schema again, its default backup name taken: the next free one is used */
    char out[64];
    assert_int_equal(st_test_run(out, sizeof out, "rm -rf '%s' && mkdir '%s' && cp '%s/data.mdb' '%s/'", dir, dir,
                                 GOLDEN, dir),
                     0);
    assert_int_equal(st_schema_migrate(dir, NULL, &rep), 0);
    snprintf(msg, sizeof msg, "%s.schema1-backup-2", dir);
    assert_string_equal(rep.backup_dir, msg);
}

/* Commit number fail_at fails (the transaction aborted): the step stops; a re-run finishes. */
static int commits, fail_at;
static int failing_commit(struct MDB_txn *txn)
{
    if (++commits == fail_at) {
        mdb_txn_abort(txn);
        return EIO;
    }
    return mdb_txn_commit(txn);
}

static void test_interrupted_migration(void **state)
{
    (void)state;
    /* commits: 1 marks the step, 2 moves the chunks, 3 sets the schema */
    for (fail_at = 1; fail_at <= 3; fail_at++) {
        char dir[1200], name[32];
        snprintf(name, sizeof name, "interrupted%d", fail_at);
        copy_golden(dir, sizeof dir, name);
        st_store_sys sys;
        st_store_sys_init(&sys);
        sys.txn_commit = failing_commit;
        commits = 0;
        st_schema_migrate_opts o = {.no_backup = 1, .sys = &sys};
        st_schema_migrate_report rep;
        assert_int_equal(st_schema_migrate(dir, &o, &rep), EIO);
        assert_non_null(strstr(st_errdetail(), "run `statectl migrate` again"));
        assert_string_equal(rep.backup_dir, "");
        st_store *st = NULL;
        assert_int_equal(st_store_open(&st, dir, NULL), ST_EVERSION);
        assert_int_equal(st_schema_migrate(dir, &(st_schema_migrate_opts){.no_backup = 1}, &rep), 0);
        assert_int_equal(rep.to, 2);
        assert_int_equal(st_store_open(&st, dir, NULL), 0);
        assert_golden_clean(st);
        assert_expected(st);
        st_store_close(st);
    }
}

static void test_backup_fault_and_newer(void **state)
{
    (void)state;
    char dir[1200], bdir[1300];
    copy_golden(dir, sizeof dir, "bfault");
    snprintf(bdir, sizeof bdir, "%s/explicit-backup", base);
    st_store_sys sys;
    st_store_sys_init(&sys);
    commits = 0;
    fail_at = 1;
    sys.txn_commit = failing_commit;
    /* the backup is complete before the first step, and kept when a step then fails */
    st_schema_migrate_opts o = {.backup_dir = bdir, .sys = &sys};
    st_schema_migrate_report rep;
    assert_int_equal(st_schema_migrate(dir, &o, &rep), EIO); /* the first step's commit fails */
    assert_string_equal(rep.backup_dir, bdir);
    uint32_t schema;
    assert_int_equal(st_store_schema_version(bdir, &schema), 0);
    assert_int_equal(schema, 1);
    char missing[1300];
    snprintf(missing, sizeof missing, "%s/none", base);
    assert_int_equal(st_schema_migrate(missing, NULL, &rep), ST_ENOTFOUND);

    /* newer than this build */
    char newer[1200];
    copy_golden(newer, sizeof newer, "newer");
    st_store *st = NULL;
    assert_int_equal(st_store__open_any(&st, newer, NULL, 0), 0);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    uint8_t b[4];
    st_put32(b, 3);
    MDB_val k = {strlen(ST_META_SCHEMA), ST_META_SCHEMA}, v = {4, b};
    assert_int_equal(mdb_put(txn, st->dbi_meta, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    st_store_close(st);
    assert_int_equal(st_schema_migrate(newer, NULL, &rep), ST_EVERSION);
    assert_string_equal(st_errdetail(), "store schema 3 is newer than this build's 2");
}

static int exists(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0;
}

static void assert_untouched(const char *dst)
{
    assert_false(exists(dst));
    assert_false(st_test_has_temp(dst));
}

/* Opened for writing behind the store's back (white-box), whatever its schema. */
static st_store *open_raw(const char *dir)
{
    st_store *st = NULL;
    assert_int_equal(st_store__open_any(&st, dir, NULL, 0), 0);
    return st;
}

static void set_schema(const char *dir, uint32_t schema)
{
    st_store *st = open_raw(dir);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    uint8_t b[4];
    st_put32(b, schema);
    MDB_val k = {strlen(ST_META_SCHEMA), ST_META_SCHEMA}, v = {4, b};
    assert_int_equal(mdb_put(txn, st->dbi_meta, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    st_store_close(st);
}

/* The largest chunk value of a schema-1 store (u64 count, then the stored bytes), malloc'd. */
static uint8_t *largest_chunk(const char *dir, uint8_t key[ST_STORE_HASH_LEN], size_t *len)
{
    st_store *st = NULL;
    st_store_opts ro = {.read_only = 1};
    assert_int_equal(st_store__open_any(&st, dir, &ro, MDB_RDONLY | MDB_NOLOCK), 0);
    assert_int_equal(st->schema, 1);
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    uint8_t *best = NULL;
    *len = 0;
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    assert_int_equal(mdb_cursor_open(txn, st->dbi_chunks, &cur), 0);
    for (int rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        if (v.mv_size <= *len)
            continue;
        free(best);
        best = malloc(v.mv_size);
        assert_non_null(best);
        memcpy(best, v.mv_data, v.mv_size);
        memcpy(key, k.mv_data, ST_STORE_HASH_LEN);
        *len = v.mv_size;
    }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    st_store_close(st);
    assert_true(*len > 1024);
    return best;
}

/* Replace a chunk's value in a schema-1 store (LMDB's structure stays sound). */
static void put_chunk(const char *dir, const uint8_t *key, const void *val, size_t len)
{
    st_store *st = open_raw(dir);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    MDB_val k = {ST_STORE_HASH_LEN, (void *)key}, v = {len, (void *)val};
    assert_int_equal(mdb_put(txn, st->dbi_chunks, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    st_store_close(st);
}

static void test_restore_old_backup(void **state)
{
    (void)state;
    char bak[1200], dst[1200], path[1300], before[80], after[80], out[64];
    copy_golden(bak, sizeof bak, "old-backup");
    snprintf(path, sizeof path, "%s/data.mdb", bak);
    sha_file(path, before);
    snprintf(dst, sizeof dst, "%s/restored-old", base);

    /* the store module alone restores only its own schema, and points at the migrating restore */
    assert_int_equal(st_store_restore_backup(bak, dst, NULL), ST_EVERSION);
    assert_non_null(strstr(st_errdetail(), "is of store schema 1, older than this build's 2"));
    assert_non_null(strstr(st_errdetail(), "statectl restore-backup"));
    assert_untouched(dst);

    st_schema_migrate_report rep;
    memset(&rep, 0xff, sizeof rep);
    int rc = st_schema_restore_backup(bak, dst, NULL, &rep);
    if (rc)
        print_error("restore: %s\n", st_errdetail());
    assert_int_equal(rc, 0);
    assert_int_equal(rep.from, 1);
    assert_int_equal(rep.to, 2);
    assert_int_equal(rep.n_steps, 1);
    assert_true(rep.items > 0);
    assert_string_equal(rep.backup_dir, "");
    /* the backup is read, never written; the restored directory holds data.mdb only */
    sha_file(path, after);
    assert_string_equal(before, after);
    snprintf(path, sizeof path, "%s/lock.mdb", bak);
    assert_false(exists(path));
    snprintf(path, sizeof path, "%s/lock.mdb", dst);
    assert_false(exists(path));
    uint32_t schema = 0;
    assert_int_equal(st_store_schema_version(dst, &schema), 0);
    assert_int_equal(schema, ST_STORE_SCHEMA);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dst, NULL), 0);
    assert_golden_clean(st);
    assert_expected(st);
    st_session_info si;
    assert_int_equal(st_store_show(st, "alpha", &si), 0);
    assert_int_equal(si.head, 2);
    assert_int_equal(si.n_labels, 1);
    assert_string_equal(si.labels[0].name, "golden");

    /* a backup of the migrated store restores through the same call, with nothing to migrate,
     * into an existing empty directory */
    char bak2[1200], dst2[1200];
    snprintf(bak2, sizeof bak2, "%s/new-backup", base);
    assert_int_equal(st_store_backup(st, bak2), 0);
    st_store_close(st);
    snprintf(dst2, sizeof dst2, "%s/restored-new", base);
    assert_int_equal(mkdir(dst2, 0755), 0);
    assert_int_equal(st_schema_restore_backup(bak2, dst2, NULL, &rep), 0);
    assert_int_equal(rep.from, 2);
    assert_int_equal(rep.to, 2);
    assert_int_equal(rep.n_steps, 0);
    assert_int_equal(rep.items, 0);
    assert_int_equal(st_store_open(&st, dst2, NULL), 0);
    assert_golden_clean(st);
    assert_expected(st);
    st_store_close(st);

    /* the destination must still be new or empty */
    assert_int_equal(st_schema_restore_backup(bak, dst, NULL, &rep), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "is not empty"));
    snprintf(path, sizeof path, "%s/none", base);
    assert_int_equal(st_schema_restore_backup(path, dst, NULL, &rep), ST_ENOTFOUND);
    assert_int_equal(st_test_run(out, sizeof out, "rm -rf '%s'", dst), 0);
}

static void test_restore_old_backup_step_fails(void **state)
{
    (void)state;
    char bak[1200], dst[1200];
    copy_golden(bak, sizeof bak, "old-backup-faults");
    snprintf(dst, sizeof dst, "%s/restored-faults", base);
    st_store_sys sys;
    st_store_sys_init(&sys);
    sys.txn_commit = failing_commit;
    st_store_opts o = {.sys = &sys};
    /* the copy's commits: 1 marks the step, 2 moves the chunks, 3 sets the schema */
    for (fail_at = 1; fail_at <= 3; fail_at++) {
        commits = 0;
        st_schema_migrate_report rep;
        assert_int_equal(st_schema_restore_backup(bak, dst, &o, &rep), EIO);
        assert_non_null(strstr(st_errdetail(), "migrating the restored copy from schema 1 to 2"));
        assert_non_null(strstr(st_errdetail(), "is untouched"));
        assert_null(strstr(st_errdetail(), "statectl migrate"));
        assert_untouched(dst);
    }
    fail_at = 0;
    st_schema_migrate_report rep;
    assert_int_equal(st_schema_restore_backup(bak, dst, &o, &rep), 0);
    assert_int_equal(rep.to, 2);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dst, NULL), 0);
    assert_golden_clean(st);
    assert_expected(st);
    st_store_close(st);
}

static void test_restore_bad_backups(void **state)
{
    (void)state;
    char bak[1200], dst[1200], path[1300];
    st_schema_migrate_report rep;
    snprintf(dst, sizeof dst, "%s/restored-bad", base);

    /* newer than this build: refused before anything is written */
    copy_golden(bak, sizeof bak, "newer-backup");
    set_schema(bak, 3);
    assert_int_equal(st_schema_restore_backup(bak, dst, NULL, &rep), ST_EVERSION);
    assert_string_equal(st_errdetail(), "the backup: store schema 3 is newer than this build's 2");
    assert_untouched(dst);
    assert_int_equal(st_store_restore_backup(bak, dst, NULL), ST_EVERSION);
    assert_string_equal(st_errdetail(), "the backup: store schema 3 is newer than this build's 2");
    assert_untouched(dst);

    /* one byte of a chunk's stored bytes damaged in the file: the migrated copy fails its
     * check, named by the chunk */
    uint8_t key[ST_STORE_HASH_LEN];
    size_t len = 0;
    copy_golden(bak, sizeof bak, "damaged-bytes");
    uint8_t *val = largest_chunk(bak, key, &len);
    snprintf(path, sizeof path, "%s/data.mdb", bak);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(path, &flen);
    assert_non_null(file);
    uint8_t *hit = memmem(file, flen, val + 8, len - 8);
    assert_non_null(hit);
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t b = (uint8_t)(hit[(len - 8) / 2] ^ 0x10);
    assert_int_equal(pwrite(fd, &b, 1, (off_t)(hit - file) + (off_t)(len - 8) / 2), 1);
    close(fd);
    free(file);
    char hex[2 * ST_STORE_HASH_LEN + 1];
    st_store_hex(hex, key, ST_STORE_HASH_LEN);
    assert_int_equal(st_schema_restore_backup(bak, dst, NULL, &rep), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "the restored copy (migrated from schema 1) fails its check"));
    assert_non_null(strstr(st_errdetail(), hex));
    assert_untouched(dst);

    /* a wrong count in a chunk's value: the reference count check refuses it; an empty existing
     * destination stays empty */
    copy_golden(bak, sizeof bak, "damaged-count");
    st_put64(val, st_get64(val) + 1);
    put_chunk(bak, key, val, len);
    assert_int_equal(mkdir(dst, 0755), 0);
    assert_int_equal(st_schema_restore_backup(bak, dst, NULL, &rep), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "fails its check"));
    char out[256];
    assert_int_equal(st_test_run(out, sizeof out, "ls -A '%s' | wc -l", dst), 0);
    assert_int_equal(atoi(out), 0);
    assert_int_equal(rmdir(dst), 0);
    assert_untouched(dst);

    /* a value shorter than its count: the step itself stops */
    copy_golden(bak, sizeof bak, "damaged-short");
    put_chunk(bak, key, val, 4);
    assert_int_equal(st_schema_restore_backup(bak, dst, NULL, &rep), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "less than its count"));
    assert_non_null(strstr(st_errdetail(), "is untouched"));
    assert_untouched(dst);
    free(val);
}

int main(void)
{
    st_test_tmpdir(base, sizeof base, "test_store_schema");
    const char *regen = getenv("ST_REGEN_GOLDEN");
    if (regen && !strcmp(regen, "1")) {
        int rc = gen_store_schema1(GOLDEN, base);
        fprintf(stderr, "regenerated %s: %s\n", GOLDEN, rc ? st_errdetail() : "ok");
        if (rc)
            return 1;
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_golden_migrates),
        cmocka_unit_test(test_interrupted_migration),
        cmocka_unit_test(test_backup_fault_and_newer),
        cmocka_unit_test(test_restore_old_backup),
        cmocka_unit_test(test_restore_old_backup_step_fails),
        cmocka_unit_test(test_restore_bad_backups),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
