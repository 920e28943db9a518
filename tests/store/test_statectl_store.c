/*
 * test_statectl_store.c - the real statectl binary on real stores: every store verb, its help,
 * its text and --json output, its exit codes (0 ok, 1 check found a problem, 2 usage, 3 error),
 * byte-identical export after import, a damaged store found by check --read-data, backup and
 * restore, and migration of the golden schema-1 store, also through restore-backup of it.
 */
#include <fcntl.h>
#include <jansson.h>

#include "store_test.h"

#define CTL ST_BIN_DIR "/statectl"
#define GOLDEN ST_TEST_DATA "/golden/store-schema1"

static char dir[1024];
static char out[1 << 16];

static json_t *run_json(int want_rc, const char *fmt, const char *a, const char *b)
{
    char cmd[4096];
    snprintf(cmd, sizeof cmd, fmt, a, b);
    int rc = st_test_run(out, sizeof out, "(%s 2>/dev/null)", cmd);
    if (rc != want_rc)
        print_error("%s -> %d: %s\n", cmd, rc, out);
    assert_int_equal(rc, want_rc);
    json_error_t jerr;
    json_t *o = json_loads(out, 0, &jerr);
    if (!o)
        print_error("not JSON: %s\n", out);
    assert_non_null(o);
    return o;
}

static void test_help_and_usage(void **state)
{
    (void)state;
    static const char *verbs[] = {"ls", "show", "import", "export", "rm", "label", "gc",
                                  "check", "stat", "backup", "restore-backup", "migrate"};
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        assert_int_equal(st_test_run(out, sizeof out, CTL " %s --help", verbs[i]), 0);
        assert_non_null(strstr(out, "usage: statectl"));
        assert_int_equal(st_test_run(out, sizeof out, CTL " %s", verbs[i]), 2); /* missing arguments */
        assert_non_null(strstr(out, "statectl "));
    }
    assert_int_equal(st_test_run(out, sizeof out, CTL " --help"), 0);
    assert_non_null(strstr(out, "restore-backup BACKUP DEST"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s --frob", dir), 2);
    assert_non_null(strstr(out, "unknown option --frob"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s bad/id", dir), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s x --compress 42", dir), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s a x --format v9", dir), 2);
    /* not a store: an error, not a usage problem */
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s/none", dir), 3);
    assert_non_null(strstr(out, "statectl ls: not found: no store at"));
}

static void test_import_export_show(void **state)
{
    (void)state;
    char store[1200];
    snprintf(store, sizeof store, "%s/st", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s/conv.strata --tokens 700 --checkpoints 3", dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s/z.strata --tokens 500 --compress zstd --seed 9", dir),
                     0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/conv.strata", store, dir), 0);
    assert_non_null(strstr(out, "as conv@1"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/conv.strata --label base", store, dir), 0);
    assert_non_null(strstr(out, "as conv@2"));
    assert_non_null(strstr(out, "0 new"));
    json_t *o = run_json(0, CTL " import %s %s/z.strata --id zed --json", store, dir);
    assert_string_equal(json_string_value(json_object_get(o, "id")), "zed");
    assert_int_equal(json_integer_value(json_object_get(o, "version")), 1);
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/conv.strata --id 'a b'", store, dir), 2);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/missing.strata", store, dir), 3);

    /* export gives the imported bytes back, for a plain and a compressed file */
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s conv@1 %s/conv.out", store, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, "cmp %s/conv.strata %s/conv.out", dir, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s zed %s/z.out", store, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, "cmp %s/z.strata %s/z.out", dir, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s conv@base %s/v2.out --format v2", store, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " inspect %s/v2.out", dir), 0);
    assert_non_null(strstr(out, "session file v2"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s conv@7 %s/none.out", store, dir), 3);
    assert_non_null(strstr(out, "statectl export: not found: session conv has no version 7"));

    /* ls, show */
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s", store), 0);
    assert_non_null(strstr(out, "conv"));
    assert_non_null(strstr(out, "base=2"));
    o = run_json(0, CTL " ls %s --json%s", store, "");
    json_t *ss = json_object_get(o, "sessions");
    assert_int_equal(json_array_size(ss), 2);
    json_t *c = json_array_get(ss, 0);
    assert_string_equal(json_string_value(json_object_get(c, "id")), "conv");
    assert_int_equal(json_integer_value(json_object_get(c, "head")), 2);
    assert_int_equal(json_integer_value(json_object_get(c, "tokens")), 700);
    assert_int_equal(json_integer_value(json_object_get(json_object_get(c, "labels"), "base")), 2);
    json_decref(o);
    o = run_json(0, CTL " show %s conv@1 --json%s", store, "");
    json_t *v = json_object_get(o, "version");
    assert_int_equal(json_integer_value(json_object_get(v, "version")), 1);
    assert_int_equal(json_integer_value(json_object_get(v, "checkpoints")), 3);
    assert_int_equal(json_integer_value(json_object_get(v, "file_version")), 1);
    assert_string_equal(json_string_value(json_object_get(v, "codec")), "fp32");
    assert_string_equal(json_string_value(json_object_get(v, "codecs")), "fp32");
    json_decref(o);
    /* a bf16 file's version: its codec in show's JSON and both texts (the control: conv's fp32) */
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s/b.strata --tokens 300 --codec bf16 --seed 4", dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/b.strata --id bee", store, dir), 0);
    o = run_json(0, CTL " show %s bee@1 --json%s", store, "");
    v = json_object_get(o, "version");
    assert_string_equal(json_string_value(json_object_get(v, "codec")), "bf16");
    assert_string_equal(json_string_value(json_object_get(v, "codecs")), "bf16");
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s bee@1", store), 0);
    assert_non_null(strstr(out, "codec        bf16 (live checkpoint: bf16)"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s bee", store), 0);
    assert_non_null(strstr(out, " bf16 "));
    assert_null(strstr(out, " fp32 "));
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s conv", store), 0);
    assert_non_null(strstr(out, " fp32 "));
    assert_null(strstr(out, " bf16 "));
    assert_int_equal(st_test_run(out, sizeof out, CTL " rm %s bee", store), 0);
    o = run_json(0, CTL " show %s conv --json%s", store, "");
    assert_int_equal(json_array_size(json_object_get(o, "version_list")), 2);
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s conv", store), 0);
    assert_non_null(strstr(out, "versions     2"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " show %s conv@nolabel", store), 3);

    /* label, rm, gc, stat */
    assert_int_equal(st_test_run(out, sizeof out, CTL " label %s conv@1 keep", store), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " label %s conv keep --remove", store), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " label %s conv keep --remove", store), 3);
    assert_int_equal(st_test_run(out, sizeof out, CTL " rm %s conv@1", store), 0);
    assert_non_null(strstr(out, "removed conv@1"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " rm %s conv@1", store), 3);
    assert_int_equal(st_test_run(out, sizeof out, CTL " rm %s nope", store), 3);
    assert_non_null(strstr(out, "statectl rm: not found: no session nope"));
    o = run_json(0, CTL " gc %s --json%s", store, "");
    assert_true(json_is_integer(json_object_get(o, "chunks_freed")));
    json_decref(o);
    o = run_json(0, CTL " stat %s --json%s", store, "");
    assert_int_equal(json_integer_value(json_object_get(o, "sessions")), 2);
    assert_int_equal(json_integer_value(json_object_get(o, "versions")), 2);
    assert_int_equal(json_integer_value(json_object_get(o, "schema")), ST_STORE_SCHEMA);
    assert_true(json_integer_value(json_object_get(o, "stored_bytes")) > 0);
    /* the rm of conv@1 and bee freed pages: the free list and its longest run */
    json_int_t pf = json_integer_value(json_object_get(o, "pages_free"));
    json_int_t run = json_integer_value(json_object_get(o, "pages_free_run"));
    assert_true(pf > 0 && run >= 1 && run <= pf);
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " stat %s", store), 0);
    assert_non_null(strstr(out, "dedup"));
    char want[128];
    snprintf(want, sizeof want, " used, %lld of them free (longest run %lld), ", (long long)pf, (long long)run);
    assert_non_null(strstr(out, want));
    assert_int_equal(st_test_run(out, sizeof out, CTL " rm %s zed", store), 0);
    assert_non_null(strstr(out, "removed session zed (1 versions)"));
}

static void test_check_backup_restore(void **state)
{
    (void)state;
    char store[1200], bak[1200], res[1200], db[1300];
    snprintf(store, sizeof store, "%s/chk", dir);
    snprintf(bak, sizeof bak, "%s/chk.bak", dir);
    snprintf(res, sizeof res, "%s/chk.restored", dir);
    snprintf(db, sizeof db, "%s/data.mdb", store);
    assert_int_equal(st_test_run(out, sizeof out, CTL " synth %s/c.strata --tokens 900", dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " import %s %s/c.strata --id c", store, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " check %s --read-data", store), 0);
    assert_non_null(strstr(out, "\nok"));
    json_t *o = run_json(0, CTL " check %s --read-data --json%s", store, "");
    assert_true(json_is_true(json_object_get(o, "ok")));
    assert_true(json_integer_value(json_object_get(o, "chunks_read")) > 0);
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " backup %s %s", store, bak), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " backup %s %s", store, bak), 3); /* exists */
    assert_int_equal(st_test_run(out, sizeof out, CTL " restore-backup %s %s", bak, res), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s c %s/c.restored", res, dir), 0);
    assert_int_equal(st_test_run(out, sizeof out, "cmp %s/c.strata %s/c.restored", dir, dir), 0);

    /* damage one byte of a stored chunk: the structure check passes, the data check names it */
    st_image *img = NULL;
    char path[1300];
    snprintf(path, sizeof path, "%s/c.strata", dir);
    assert_int_equal(st_file_read(path, NULL, &img), 0);
    uint64_t len;
    const uint8_t *kv = st_image_kv_const(img, store_test_kv(img), &len);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(db, &flen);
    uint8_t *hit = memmem(file, flen, kv + 32768, 32768);
    assert_non_null(hit);
    int fd = open(db, O_RDWR);
    uint8_t b = (uint8_t)(hit[77] ^ 1);
    assert_int_equal(pwrite(fd, &b, 1, (off_t)(hit - file) + 77), 1);
    close(fd);
    free(file);
    char hex[65];
    uint8_t h[32];
    st_store_sha256(kv + 32768, 32768, h);
    st_store_hex(hex, h, 32);
    st_image_free(img);
    assert_int_equal(st_test_run(out, sizeof out, CTL " check %s", store), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " check %s --read-data", store), 1);
    assert_non_null(strstr(out, "PROBLEM corrupt-chunk session c version 1 chunk"));
    assert_non_null(strstr(out, hex));
    o = run_json(1, CTL " check %s --read-data --json%s", store, "");
    assert_true(json_is_false(json_object_get(o, "ok")));
    json_t *p = json_array_get(json_object_get(o, "problems"), 0);
    assert_string_equal(json_string_value(json_object_get(p, "chunk")), hex);
    assert_string_equal(json_string_value(json_object_get(p, "kind")), "corrupt-chunk");
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " export %s c %s/c.bad", store, dir), 3);
    assert_non_null(strstr(out, "corrupt data"));
    /* a damaged store cannot be backed up as if it were good, and nothing is left behind */
    snprintf(bak, sizeof bak, "%s/chk.bak2", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " backup %s %s", store, bak), 3);
    assert_non_null(strstr(out, "fails its check"));
    assert_int_equal(st_test_run(out, sizeof out, "test -e %s", bak), 1);
}

/* `check --read-data` of a store migrated or restored from the golden one: its 4 versions were
 * saved from synthetic images with a placeholder state hash (see test_store_schema.c), so each is
 * named as state-hash, and nothing else is found. */
static void assert_golden_checks(const char *store)
{
    assert_int_equal(st_test_run(out, sizeof out, CTL " check %s --read-data", store), 1);
    int n = 0;
    for (const char *p = out; (p = strstr(p, "PROBLEM ")); p++, n++)
        assert_int_equal(strncmp(p, "PROBLEM state-hash session ", 27), 0);
    assert_int_equal(n, 4);
    assert_non_null(strstr(out, "4 state hashes compared"));
    assert_non_null(strstr(out, "\n4 problems"));
}

static void test_migrate_golden(void **state)
{
    (void)state;
    char store[1200];
    snprintf(store, sizeof store, "%s/old", dir);
    assert_int_equal(st_test_run(out, sizeof out, "mkdir -p %s && cp %s/data.mdb %s/", store, GOLDEN, store), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s", store), 3);
    assert_non_null(strstr(out, "store schema 1 is older than this build's 2: run `statectl migrate"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " migrate %s --dry-run", store), 0);
    assert_non_null(strstr(out, "would migrate from schema 1 to 2"));
    assert_non_null(strstr(out, "refcounts-db"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s", store), 3);
    json_t *o = run_json(0, CTL " migrate %s --json%s", store, "");
    assert_int_equal(json_integer_value(json_object_get(o, "from")), 1);
    assert_int_equal(json_integer_value(json_object_get(o, "to")), 2);
    char want[1300];
    snprintf(want, sizeof want, "%s.schema1-backup", store);
    assert_string_equal(json_string_value(json_object_get(o, "backup")), want);
    json_decref(o);
    assert_golden_checks(store);
    assert_int_equal(st_test_run(out, sizeof out, CTL " ls %s", store), 0);
    assert_non_null(strstr(out, "alpha"));
    assert_int_equal(st_test_run(out, sizeof out, CTL " migrate %s", store), 0);
    assert_non_null(strstr(out, "nothing to do"));
    /* --no-backup on another copy */
    snprintf(store, sizeof store, "%s/old2", dir);
    assert_int_equal(st_test_run(out, sizeof out, "mkdir -p %s && cp %s/data.mdb %s/", store, GOLDEN, store), 0);
    assert_int_equal(st_test_run(out, sizeof out, CTL " migrate %s --no-backup", store), 0);
    assert_non_null(strstr(out, "no backup was taken"));
    assert_int_equal(st_test_run(out, sizeof out, "test -e %s.schema1-backup", store), 1);
}

/* SHA-256 of a file, in hex. */
static void sha_file(const char *path, char *hex)
{
    size_t len = 0;
    uint8_t *b = st_test_slurp(path, &len), h[ST_STORE_HASH_LEN];
    assert_non_null(b);
    assert_int_equal(st_store_sha256(b, len, h), 0);
    free(b);
    st_store_hex(hex, h, ST_STORE_HASH_LEN);
}

static void test_restore_old_backup(void **state)
{
    (void)state;
    char bak[1200], res[1200], path[1300], want[80], got[80];
    snprintf(bak, sizeof bak, "%s/old.bak", dir);
    snprintf(res, sizeof res, "%s/old.restored", dir);
    assert_int_equal(st_test_run(out, sizeof out, "mkdir -p %s && cp %s/data.mdb %s/", bak, GOLDEN, bak), 0);
    snprintf(path, sizeof path, "%s/data.mdb", bak);
    sha_file(path, want);
    assert_int_equal(st_test_run(out, sizeof out, CTL " restore-backup %s %s", bak, res), 0);
    assert_non_null(strstr(out, "(checked)"));
    assert_non_null(strstr(out, "migrated from schema 1 to 2"));
    assert_non_null(strstr(out, "step 1 -> 2 refcounts-db"));
    assert_non_null(strstr(out, "is unchanged (schema 1)"));
    sha_file(path, got);
    assert_string_equal(got, want); /* the backup is never written */
    assert_golden_checks(res);
    json_t *o = run_json(0, CTL " stat %s --json%s", res, "");
    assert_int_equal(json_integer_value(json_object_get(o, "schema")), ST_STORE_SCHEMA);
    json_decref(o);
    /* every version exports byte for byte what the golden store's EXPECTED records */
    FILE *f = fopen(GOLDEN "/EXPECTED", "r");
    assert_non_null(f);
    char line[512], id[200], sha[80];
    unsigned long long v;
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        if (line[0] == '#')
            continue;
        assert_int_equal(sscanf(line, "%199s %llu %79s", id, &v, sha), 3);
        assert_int_equal(st_test_run(out, sizeof out, CTL " export %s %s@%llu %s/old.out", res, id, v, dir), 0);
        snprintf(path, sizeof path, "%s/old.out", dir);
        sha_file(path, got);
        assert_string_equal(got, sha);
        n++;
    }
    fclose(f);
    assert_int_equal(n, 4);

    /* --json names the migration; a current backup reports none */
    snprintf(res, sizeof res, "%s/old.restored2", dir);
    o = run_json(0, CTL " restore-backup %s %s --json", bak, res);
    assert_string_equal(json_string_value(json_object_get(o, "dest")), res);
    assert_int_equal(json_integer_value(json_object_get(o, "schema")), 2);
    json_t *m = json_object_get(o, "migrated");
    assert_true(json_is_object(m));
    assert_int_equal(json_integer_value(json_object_get(m, "from")), 1);
    assert_int_equal(json_integer_value(json_object_get(m, "to")), 2);
    assert_true(json_integer_value(json_object_get(m, "records")) > 0);
    json_t *st0 = json_array_get(json_object_get(m, "steps"), 0);
    assert_string_equal(json_string_value(json_object_get(st0, "name")), "refcounts-db");
    json_decref(o);
    char bak2[1200];
    snprintf(bak2, sizeof bak2, "%s/new.bak", dir);
    assert_int_equal(st_test_run(out, sizeof out, CTL " backup %s %s", res, bak2), 0);
    snprintf(res, sizeof res, "%s/new.restored", dir);
    o = run_json(0, CTL " restore-backup %s %s --json", bak2, res);
    assert_true(json_is_null(json_object_get(o, "migrated")));
    json_decref(o);
    assert_int_equal(st_test_run(out, sizeof out, CTL " restore-backup %s %s/x y", bak2, dir), 2);
}

static void test_restore_refused(void **state)
{
    (void)state;
    char bak[1200], res[1200], path[1300];
    snprintf(res, sizeof res, "%s/refused.restored", dir);
    /* newer than this build */
    snprintf(bak, sizeof bak, "%s/newer.bak", dir);
    assert_int_equal(st_test_run(out, sizeof out, "mkdir -p %s && cp %s/data.mdb %s/", bak, GOLDEN, bak), 0);
    st_store *st = NULL;
    assert_int_equal(st_store__open_any(&st, bak, NULL, 0), 0);
    MDB_txn *txn = NULL;
    assert_int_equal(mdb_txn_begin(st->env, NULL, 0, &txn), 0);
    uint8_t b[4];
    st_put32(b, 3);
    MDB_val k = {strlen(ST_META_SCHEMA), ST_META_SCHEMA}, v = {4, b};
    assert_int_equal(mdb_put(txn, st->dbi_meta, &k, &v, 0), 0);
    assert_int_equal(mdb_txn_commit(txn), 0);
    st_store_close(st);
    assert_int_equal(st_test_run(out, sizeof out, CTL " restore-backup %s %s", bak, res), 3);
    assert_non_null(strstr(out, "statectl restore-backup: "));
    assert_non_null(strstr(out, "store schema 3 is newer than this build's 2"));
    assert_int_equal(st_test_run(out, sizeof out, "test -e %s", res), 1);

    /* a schema-1 backup with one damaged byte in a chunk: refused, nothing left behind */
    snprintf(bak, sizeof bak, "%s/damaged.bak", dir);
    assert_int_equal(st_test_run(out, sizeof out, "mkdir -p %s && cp %s/data.mdb %s/", bak, GOLDEN, bak), 0);
    st_store_opts ro = {.read_only = 1};
    assert_int_equal(st_store__open_any(&st, bak, &ro, MDB_RDONLY | MDB_NOLOCK), 0);
    assert_int_equal(mdb_txn_begin(st->env, NULL, MDB_RDONLY, &txn), 0);
    MDB_cursor *cur = NULL;
    assert_int_equal(mdb_cursor_open(txn, st->dbi_chunks, &cur), 0);
    uint8_t *val = NULL;
    size_t len = 0;
    for (int rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
        if (v.mv_size > len) {
            free(val);
            val = malloc(v.mv_size);
            memcpy(val, v.mv_data, v.mv_size);
            len = v.mv_size;
        }
    mdb_cursor_close(cur);
    mdb_txn_abort(txn);
    st_store_close(st);
    assert_true(len > 1024);
    snprintf(path, sizeof path, "%s/data.mdb", bak);
    size_t flen = 0;
    uint8_t *file = st_test_slurp(path, &flen);
    uint8_t *hit = memmem(file, flen, val + 8, len - 8);
    assert_non_null(hit);
    int fd = open(path, O_RDWR);
    uint8_t x = (uint8_t)(hit[100] ^ 1);
    assert_int_equal(pwrite(fd, &x, 1, (off_t)(hit - file) + 100), 1);
    close(fd);
    free(file);
    free(val);
    assert_int_equal(st_test_run(out, sizeof out, CTL " restore-backup %s %s", bak, res), 3);
    assert_non_null(strstr(out, "the restored copy (migrated from schema 1) fails its check"));
    assert_int_equal(st_test_run(out, sizeof out, "test -e %s", res), 1);
    assert_int_equal(st_test_run(out, sizeof out, "ls %s | grep -c refused.restored", dir), 1); /* no temp left */
}

int main(void)
{
    st_test_tmpdir(dir, sizeof dir, "test_statectl_store");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_help_and_usage),
        cmocka_unit_test(test_import_export_show),
        cmocka_unit_test(test_check_backup_restore),
        cmocka_unit_test(test_migrate_golden),
        cmocka_unit_test(test_restore_old_backup),
        cmocka_unit_test(test_restore_refused),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(dir);
    return rc;
}
