/*
 * fuzz_upload.c - libFuzzer target for what an upload's commit does with the uploaded bytes
 * (POST /v1/uploads/{id}/commit runs st_store_import on the assembled file): the input is the
 * file, imported into a real LMDB store in a temporary directory ($ST_TEST_TMP, else $TMPDIR,
 * else /tmp) that the process keeps open across inputs.
 *
 * Properties checked on every input:
 * 1. A refused file ends in a typed error with a detail, and the store holds no trace of it:
 *    no session, no chunk (st_store_stat).
 * 2. An accepted file is a version that exports again, and (normal builds, whose reader checks
 *    every checksum) the export is the uploaded file byte for byte, as the API promises.
 * After an accepted input the session is deleted, which must leave the store empty again.
 */
#include <errno.h>
#include <ftw.h>
#include <string.h>
#include <unistd.h>

#include "st_fuzz.h"
#include "st_store.h"

static st_store *st;
static char dir[4096], in_path[4200], out_path[4200];

static int fuzz_upload_rm(const char *path, const struct stat *sb, int type, struct FTW *ftw)
{
    (void)sb;
    (void)type;
    (void)ftw;
    return remove(path);
}

/* At exit: the store is closed and the temporary directory removed. */
static void fuzz_upload_close(void)
{
    st_store_close(st);
    st = NULL;
    nftw(dir, fuzz_upload_rm, 16, FTW_DEPTH | FTW_PHYS);
}

static void fuzz_upload_open(void)
{
    const char *tmp = getenv("ST_TEST_TMP");
    if (!tmp || !*tmp)
        tmp = getenv("TMPDIR");
    if (!tmp || !*tmp)
        tmp = "/tmp";
    snprintf(dir, sizeof dir, "%s/fuzz_upload.XXXXXX", tmp);
    st_fuzz_require(mkdtemp(dir) != NULL, "a temporary directory");
    snprintf(in_path, sizeof in_path, "%s/upload", dir);
    snprintf(out_path, sizeof out_path, "%s/export", dir);
    char sdir[4200];
    snprintf(sdir, sizeof sdir, "%s/store", dir);
    st_store_opts o = {.create = 1, .budget = 1u << 30, .threads = 1};
    st_fuzz_require(st_store_open(&st, sdir, &o) == 0, "the store opens");
    atexit(fuzz_upload_close);
}

static void fuzz_upload_empty(void)
{
    st_store_stats s;
    st_fuzz_require(st_store_stat(st, &s) == 0, "stat");
    st_fuzz_require(s.sessions == 0 && s.versions == 0 && s.chunks == 0, "the store is not empty");
}

static void fuzz_upload_write(const char *path, const uint8_t *data, size_t size)
{
    FILE *f = fopen(path, "wb");
    st_fuzz_require(f && fwrite(data, 1, size, f) == size && fclose(f) == 0, "writing the upload");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (!st)
        fuzz_upload_open();
    fuzz_upload_write(in_path, data, size);
    st_put_opts po = {.compress = 0};
    uint64_t version = 0;
    int rc = st_store_import(st, in_path, "upload", &po, &version);
    if (rc) {
        st_fuzz_require(st_fuzz_typed(rc) && rc != ST_EINVAL, "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
        fuzz_upload_empty();
        return 0;
    }
    st_fuzz_require(version == 1, "the first version of a new session is not 1");
    st_fuzz_require(st_store_export(st, "upload", version, out_path, NULL) == 0,
                    "an imported version does not export");
#ifndef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
    size_t n = 0;
    FILE *f = fopen(out_path, "rb");
    uint8_t *back = malloc(size + 1);
    st_fuzz_require(f && back, "reading the export");
    n = fread(back, 1, size + 1, f);
    fclose(f);
    st_fuzz_require(n == size && memcmp(back, data, size) == 0, "the export differs from the upload");
    free(back);
#endif
    st_fuzz_require(st_store_session_delete(st, "upload") == 0, "deleting the imported session");
    fuzz_upload_empty();
    return 0;
}
