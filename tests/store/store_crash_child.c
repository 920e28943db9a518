/*
 * store_crash_child - the process test_store_crash kills with SIGKILL at random moments.
 *
 *   store_crash_child STORE LOG SEED
 *
 * Works on STORE in an endless loop of puts (some compressed), deletions and gcs, and appends to
 * LOG one line per step with a single write(2) each:
 *   P id version sha      before a put (version: the number it will get; sha: SHA-256 of the
 *                         session file that exporting it must give)
 *   A id version sha      after the put returned 0 (acknowledged)
 *   D id version          before deleting a version;  d id version  after it returned 0
 * Exit status 2 on any error (the test then fails): the child is only ever killed.
 */
#include <fcntl.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_file.h"
#include "st_store.h"
#include "st_store_lmdb_int.h"

static uint64_t rng_state;

static uint64_t rnd(void)
{
    uint64_t x = (rng_state += 0x9E3779B97F4A7C15ull);
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

static int logfd = -1;

static void logline(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void logline(const char *fmt, ...)
{
    char line[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    if (n <= 0 || (size_t)n >= sizeof line || write(logfd, line, (size_t)n) != n)
        exit(2);
}

static void die(const char *what, int rc)
{
    fprintf(stderr, "store_crash_child: %s: %s: %s\n", what, st_strerror(rc), st_errdetail());
    exit(2);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: store_crash_child STORE LOG SEED\n");
        return 2;
    }
    rng_state = strtoull(argv[3], NULL, 10) * 7919u + 1;
    logfd = open(argv[2], O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (logfd < 0)
        return 2;
    st_store *st = NULL;
    st_store_opts o = {.create = 1, .keep_last = 1000, .threads = 1};
    int rc = st_store_open(&st, argv[1], &o);
    if (rc)
        die("open", rc);
    for (;;) {
        char id[16];
        snprintf(id, sizeof id, "c%u", (unsigned)(rnd() % 4));
        uint64_t r = rnd() % 100;
        st_session_info si;
        int have = st_store_show(st, id, &si);
        if (have && have != ST_ENOTFOUND)
            die("show", have);
        int trim = !have && si.n_versions > 6; /* keep the store small: trim long sessions */
        if (!trim && r < 75) {
            st_synth_opts so = {.seed = rnd(), .n_tokens = 50 + rnd() % 1200, .n_checkpoints = 1 + rnd() % 3,
                                .prefix_seed = 7, .prefix_len = rnd() % 700};
            st_image *img = NULL;
            if ((rc = st_image_synthesize(&so, &img)))
                die("synth", rc);
            uint8_t *bytes = NULL, h[ST_STORE_HASH_LEN];
            size_t len = 0;
            if ((rc = st_file_write_mem(img, NULL, &bytes, &len)))
                die("serialise", rc);
            st_store_sha256(bytes, len, h);
            free(bytes);
            char hex[2 * ST_STORE_HASH_LEN + 1];
            st_store_hex(hex, h, ST_STORE_HASH_LEN);
            uint64_t next = have ? 1 : si.next_version, v = 0;
            logline("P %s %llu %s\n", id, (unsigned long long)next, hex);
            st_put_opts po = {.compress = rnd() % 3 == 0 ? 1 : 0};
            if ((rc = st_store_put(st, id, img, have ? ST_STORE_HEAD_NONE : si.head, &po, &v)))
                die("put", rc);
            if (v != next)
                die("put gave an unexpected version", ST_EINVAL);
            logline("A %s %llu %s\n", id, (unsigned long long)v, hex);
            st_image_free(img);
        } else if (trim || r < 92) {
            if (have)
                continue;
            st_version_info *vs = NULL;
            size_t n = 0;
            if ((rc = st_store_versions(st, id, &vs, &n)))
                die("versions", rc);
            uint64_t v = vs[rnd() % n].version;
            free(vs);
            logline("D %s %llu\n", id, (unsigned long long)v);
            if ((rc = st_store_version_delete(st, id, v)))
                die("delete", rc);
            logline("d %s %llu\n", id, (unsigned long long)v);
        } else {
            if ((rc = st_store_gc(st, NULL)))
                die("gc", rc);
        }
    }
}
