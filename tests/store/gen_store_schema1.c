/*
 * gen_store_schema1.c - makes the golden schema-1 store in tests/data/golden/store-schema1/.
 * Run only when ST_REGEN_GOLDEN=1 (test_store_schema calls it first then); the golden files are
 * committed and must otherwise never change, because old stores must keep migrating forever.
 *
 * How: save a few small synthetic sessions (shared prefixes, two versions, a label, a compressed
 * version, an imported file kept verbatim) with this build's store, note the SHA-256 of every
 * version's export in EXPECTED, then rewrite the store the way schema 1 laid it out - each
 * chunk's value is its reference count (u64 LE) followed by its stored bytes, there is no
 * refcounts database, and meta "schema" is 1 - and copy it, compacted, into the golden directory.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "gen_store_schema1.h"
#include "st_store_lmdb_int.h"
#include "st_test_util.h"

static st_image *tiny(uint64_t seed, uint64_t n_tokens, uint64_t prefix_seed, uint64_t prefix_len)
{
    st_synth_opts o = {.seed = seed, .n_layers = 4, .heads = 2, .head_dim = 16, .kv_heads = 1, .n_ctx = 256,
                       .page_size = 16, .n_vocab = 64, .n_tokens = n_tokens, .n_checkpoints = 2,
                       .prefix_seed = prefix_seed, .prefix_len = prefix_len};
    st_image *img = NULL;
    return st_image_synthesize(&o, &img) == 0 ? img : NULL;
}

static int downgrade_fn(st_store *st, MDB_txn *txn, void *arg)
{
    (void)arg;
    MDB_cursor *cur = NULL;
    MDB_val k, v;
    int rc = mdb_cursor_open(txn, st->dbi_refcounts, &cur);
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        if ((rc = mdb_cursor_get(cur, &k, &v, op)))
            break;
        MDB_val cv;
        if ((rc = mdb_get(txn, st->dbi_chunks, &k, &cv)))
            break;
        uint8_t *b = malloc(cv.mv_size + 8);
        if (!b)
            return ENOMEM;
        memcpy(b, v.mv_data, 8);
        memcpy(b + 8, cv.mv_data, cv.mv_size);
        MDB_val nv = {cv.mv_size + 8, b};
        rc = mdb_put(txn, st->dbi_chunks, &k, &nv, 0);
        free(b);
    }
    mdb_cursor_close(cur);
    if (rc != MDB_NOTFOUND)
        return rc;
    if ((rc = mdb_drop(txn, st->dbi_refcounts, 1)))
        return rc;
    uint8_t one[4];
    st_put32(one, 1);
    MDB_val sk = {strlen(ST_META_SCHEMA), ST_META_SCHEMA}, sv = {4, one};
    return mdb_put(txn, st->dbi_meta, &sk, &sv, 0);
}

int gen_store_schema1(const char *golden_dir, const char *scratch)
{
    char work[1024], path[4300], expected[4300];
    st_store *st = NULL;
    st_image *img[4] = {NULL, NULL, NULL, NULL};
    FILE *ex = NULL;
    int rc = 0;
    if (snprintf(work, sizeof work, "%s/gen-schema1", scratch) >= (int)sizeof work)
        return ST_EINVAL;
    st_test_rmdir(work);
    st_store_opts o = {.create = 1};
    if ((rc = st_store_open(&st, work, &o)))
        goto done;
    img[0] = tiny(1, 40, 9, 32);
    img[1] = tiny(1, 56, 9, 32);
    img[2] = tiny(2, 48, 9, 32);
    img[3] = tiny(3, 20, 0, 0);
    if (!img[0] || !img[1] || !img[2] || !img[3]) {
        rc = ENOMEM;
        goto done;
    }
    st_put_opts z = {.compress = 3}, lab = {.label = "golden"};
    if ((rc = st_store_put(st, "alpha", img[0], 0, &lab, NULL)) || (rc = st_store_put(st, "alpha", img[1], 0, NULL, NULL)) ||
        (rc = st_store_put(st, "beta", img[2], 0, &z, NULL)))
        goto done;
    snprintf(path, sizeof path, "%s/gamma.v2z7", scratch);
    st_file_write_opts fo = {.version = 2, .compress = 7, .shuffle = 1}; /* kept verbatim on import */
    if ((rc = st_file_write(img[3], path, &fo)) || (rc = st_store_import(st, path, "gamma", NULL, NULL)))
        goto done;

    /* EXPECTED: id version sha256-of-export */
    snprintf(expected, sizeof expected, "%s/EXPECTED", golden_dir);
    mkdir(golden_dir, 0755);
    if (!(ex = fopen(expected, "w"))) {
        rc = errno;
        goto done;
    }
    fprintf(ex, "# session version sha256-of-`statectl export` (golden schema-1 store; see gen_store_schema1.c)\n");
    const char *ids[] = {"alpha", "alpha", "beta", "gamma"};
    const uint64_t vers[] = {1, 2, 1, 1};
    for (int i = 0; i < 4; i++) {
        snprintf(path, sizeof path, "%s/export.tmp", scratch);
        size_t len = 0;
        uint8_t *b = NULL, h[ST_STORE_HASH_LEN];
        char hex[2 * ST_STORE_HASH_LEN + 1];
        if ((rc = st_store_export(st, ids[i], vers[i], path, NULL)))
            goto done;
        if (!(b = st_test_slurp(path, &len))) {
            rc = EIO;
            goto done;
        }
        st_store_sha256(b, len, h);
        free(b);
        st_store_hex(hex, h, ST_STORE_HASH_LEN);
        fprintf(ex, "%s %llu %s\n", ids[i], (unsigned long long)vers[i], hex);
    }
    if (fclose(ex) != 0) {
        ex = NULL;
        rc = EIO;
        goto done;
    }
    ex = NULL;
    if ((rc = st_store__write(st, downgrade_fn, NULL)))
        goto done;
    st_store_close(st);
    st = NULL;
    /* copy it compacted into the golden directory */
    if ((rc = st_store__open_any(&st, work, NULL, 0)))
        goto done;
    snprintf(path, sizeof path, "%s/data.mdb", golden_dir);
    unlink(path);
    rc = st_store__copy_env(st, golden_dir);
done:
    if (ex)
        fclose(ex);
    st_store_close(st);
    for (int i = 0; i < 4; i++)
        st_image_free(img[i]);
    st_test_rmdir(work);
    return rc;
}
