/*
 * test_store_schema.c - store schema migration from the golden schema-1 store
 * (tests/data/golden/store-schema1/, regenerated only with ST_REGEN_GOLDEN=1): the old store is
 * refused with the migrate hint, a dry run changes nothing, migration backs up first and every
 * version then exports byte for byte what EXPECTED says; an interrupted migration resumes; a
 * newer schema is refused.
 */
#include <openssl/evp.h>

#include "gen_store_schema1.h"
#include "st_migrate.h"
#include "store_test.h"

#define GOLDEN ST_TEST_DATA "/golden/store-schema1"

static char base[1024];

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
    store_test_assert_clean(st);
    assert_expected(st);
    st_session_info si;
    assert_int_equal(st_store_show(st, "alpha", &si), 0);
    assert_int_equal(si.head, 2);
    assert_int_equal(si.n_labels, 1);
    assert_string_equal(si.labels[0].name, "golden");
    /* the migrated store takes new versions and shares chunks with the old ones */
    st_image *img = NULL;
    assert_int_equal(st_store_get(st, "alpha", 1, &img), 0);
    st_put_stats ps;
    st_put_opts po = {.stats = &ps};
    assert_int_equal(st_store_put(st, "delta", img, 0, &po, NULL), 0);
    assert_int_equal(ps.new_chunks, 0);
    store_test_assert_clean(st);
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
        store_test_assert_clean(st);
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
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
