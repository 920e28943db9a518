/*
 * test_store_damage.c - single-byte flips of a store's data.mdb at seeded random offsets, each on a
 * fresh copy of the store (LMDB 0.9 has no page checksums). For every flip the real statectl runs
 * `check --read-data`, an export (a restore into a file) of every version of every session, `ls`,
 * `stat`, then a write that frees pages (`rm` of a version, `gc`), each as its own process under a
 * deadline.
 * The server's start-up scan (st_store_scan, in its own child process) runs on each copy too.
 * Asserted: no process dies of a signal or runs past its deadline, data.mdb never grows past the
 * map size it had, an export either returns the original bytes or fails with an error, the scan
 * answers 0 or ST_ECORRUPT without its child crashing, and when any export's result differs from
 * the undamaged store's, check reported damage.
 * Usage: test_store_damage [FLIPS [SEED [ONLY]]] (40 flips in `make test`, 1,200 with the label
 * slow); ONLY runs that one flip and keeps its damaged copy (the path is printed) to look at.
 * ST_STATECTL=PATH runs another build's statectl (an older one, to compare).
 * A third of the flips fall in branch, leaf and meta pages and a sixth in overflow page headers
 * (the rest anywhere in the pages in use), so that a few hundred reach every kind of page.
 */
#include <fcntl.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include "store_test.h"

#if defined(__SANITIZE_ADDRESS__)
#define ST_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define ST_TEST_ASAN 1
#endif
#endif
#ifndef ST_TEST_ASAN
#define ST_TEST_ASAN 0
#endif

#define CTL_BUILT ST_BIN_DIR "/statectl"
static const char *ctl = CTL_BUILT; /* ST_STATECTL overrides: another build's statectl */
#define DEADLINE_S 60
#define N_SESS 4

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */
static unsigned n_flips = 40;
static uint64_t seed = 20261201;
static long only = -1;

static const char *const sess[N_SESS] = {"alpha", "beta", "gamma", "delta"};
static uint64_t n_ver[N_SESS];

typedef struct ref_out {
    uint8_t *bytes;
    size_t len;
} ref_out;
static ref_out ref[N_SESS][4];

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

typedef struct run_res {
    int signal;   /* the signal that ended it (SIGALRM: past its deadline), else 0 */
    int code;     /* exit status */
    char err[512];
} run_res;

/* Run statectl with args (NULL-terminated) under a deadline (alarm survives exec) and a bound on
 * its address space; stdout and stderr go to log. */
static run_res run_ctl(const char *log, const char *const *args)
{
    run_res r = {0, 0, ""};
    const char *argv[16];
    size_t n = 0;
    argv[n++] = ctl;
    for (; args[n - 1] && n < 15; n++)
        argv[n] = args[n - 1];
    argv[n] = NULL;
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd >= 0) {
            dup2(fd, 1);
            dup2(fd, 2);
        }
#if !ST_TEST_ASAN
        /* bounded memory: a runaway allocation fails instead of growing (ASan's shadow needs
         * terabytes of address space, so a sanitized build relies on ASan's own limits) */
        struct rlimit as = {8ull << 30, 8ull << 30};
        setrlimit(RLIMIT_AS, &as);
#endif
        alarm(DEADLINE_S);
        execv(ctl, (char *const *)argv);
        _exit(127);
    }
    int st = 0;
    assert_int_equal(waitpid(pid, &st, 0), pid);
    if (WIFSIGNALED(st))
        r.signal = WTERMSIG(st);
    else
        r.code = WEXITSTATUS(st);
    size_t len = 0;
    uint8_t *txt = st_test_slurp(log, &len);
    if (txt) {
        snprintf(r.err, sizeof r.err, "%.*s", (int)(len < sizeof r.err - 1 ? len : sizeof r.err - 1), (char *)txt);
        free(txt);
    }
    return r;
}

static void make_store(const char *dir)
{
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &(st_store_opts){.create = 1}), 0);
    for (int s = 0; s < N_SESS; s++) {
        st_put_opts po = {.compress = s == 2 ? 3 : 0};
        n_ver[s] = 3;
        for (uint64_t v = 1; v <= n_ver[s]; v++) {
            /* beta shares alpha's prefix; each version is longer than the one before */
            st_image *img = store_test_image(100 * (uint64_t)s + v, 200 + 150 * v, s == 1 ? 1 : 0, s == 1 ? 150 : 0);
            assert_int_equal(st_store_put(st, sess[s], img, ST_STORE_HEAD_ANY, &po, NULL), 0);
            st_image_free(img);
        }
    }
    /* a deleted version and a gc leave pages on the free list */
    assert_int_equal(st_store_version_delete(st, "delta", 1), 0);
    assert_int_equal(st_store_gc(st, NULL), 0);
    st_store_close(st);
}

static int ver_exists(int s, uint64_t v) { return !(s == 3 && v == 1); }

/* Copy data.mdb (sparse: only the bytes in use are read) into a fresh directory. */
static void copy_store(const char *from_db, const char *to_dir, const uint8_t *used, size_t used_len,
                       uint64_t apparent)
{
    char path[1300];
    st_test_rmdir(to_dir);
    assert_int_equal(mkdir(to_dir, 0755), 0);
    snprintf(path, sizeof path, "%s/data.mdb", to_dir);
    (void)from_db;
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    assert_true(fd >= 0);
    assert_int_equal(pwrite(fd, used, used_len, 0), (ssize_t)used_len);
    assert_int_equal(ftruncate(fd, (off_t)apparent), 0);
    assert_int_equal(close(fd), 0);
}

static uint64_t file_size(const char *path)
{
    struct stat sb;
    return stat(path, &sb) == 0 ? (uint64_t)sb.st_size : 0;
}

/* Export session s version v of the store in dir: 0 with *bytes, or the failure. */
static run_res export_one(const char *dir, int s, uint64_t v, uint8_t **bytes, size_t *len)
{
    char spec[64], out[1300], log[1300];
    snprintf(spec, sizeof spec, "%s@%llu", sess[s], (unsigned long long)v);
    snprintf(out, sizeof out, "%s/export.stsf", base);
    snprintf(log, sizeof log, "%s/export.log", base);
    unlink(out);
    run_res r = run_ctl(log, (const char *const[]){"export", dir, spec, out, NULL});
    *bytes = NULL;
    *len = 0;
    if (!r.signal && r.code == 0)
        *bytes = st_test_slurp(out, len);
    return r;
}

typedef struct page_kinds {
    uint64_t *tree, *ovh;     /* pages of branch, leaf or meta kind; first pages of overflow runs */
    size_t n_tree, n_ovh;
} page_kinds;

static void scan_damaged(void *arg, const char *id, const char *why)
{
    (void)id;
    (void)why;
    (*(unsigned *)arg)++;
}

static void classify(const uint8_t *f, size_t used, uint32_t psize, page_kinds *k)
{
    size_t np = used / psize;
    k->tree = calloc(np, sizeof *k->tree);
    k->ovh = calloc(np, sizeof *k->ovh);
    assert_true(k->tree && k->ovh);
    for (size_t p = 0; p < np;) {
        const uint8_t *h = f + p * psize;
        uint16_t fl = st_get16(h + 10);
        if (fl == 0x04 && st_get64(h) == p && st_get32(h + 12) >= 1) {
            k->ovh[k->n_ovh++] = p;
            p += st_get32(h + 12);
            continue;
        }
        if ((fl == 0x01 || fl == 0x02 || fl == 0x08) && st_get64(h) == p)
            k->tree[k->n_tree++] = p;
        p++;
    }
}

static void test_flips(void **state)
{
    (void)state;
    char orig[1200], orig_db[1300], work[1200], work_db[1300], log[1300], spec[64];
    snprintf(orig, sizeof orig, "%s/orig", base);
    snprintf(orig_db, sizeof orig_db, "%s/data.mdb", orig);
    snprintf(work, sizeof work, "%s/work", base);
    snprintf(work_db, sizeof work_db, "%s/data.mdb", work);
    snprintf(log, sizeof log, "%s/check.log", base);
    make_store(orig);

    /* the undamaged store: what every export returns */
    for (int s = 0; s < N_SESS; s++)
        for (uint64_t v = 1; v <= n_ver[s]; v++) {
            if (!ver_exists(s, v))
                continue;
            run_res r = export_one(orig, s, v, &ref[s][v].bytes, &ref[s][v].len);
            assert_int_equal(r.signal, 0);
            assert_int_equal(r.code, 0);
            assert_non_null(ref[s][v].bytes);
        }
    run_res c0 = run_ctl(log, (const char *const[]){"check", orig, "--read-data", NULL});
    if (c0.code)
        print_error("undamaged store: %s\n", c0.err);
    assert_int_equal(c0.code, 0);

    /* the pages in use (the last page from the newest meta) and their kinds */
    size_t flen = 0;
    uint8_t *file = st_test_slurp(orig_db, &flen);
    assert_non_null(file);
    uint64_t apparent = file_size(orig_db);
    uint32_t psize = st_get32(file + 16 + 24);
    uint64_t tx0 = st_get64(file + 16 + 128), tx1 = st_get64(file + psize + 16 + 128);
    uint64_t last = st_get64(file + (tx1 > tx0 ? psize : 0) + 16 + 120);
    size_t used = (size_t)(last + 1) * psize;
    assert_true(used <= flen);
    page_kinds pk = {0};
    classify(file, used, psize, &pk);
    assert_true(pk.n_tree >= 8 && pk.n_ovh >= 8);
    print_message("store: %zu pages of %u bytes, %zu tree or meta pages, %zu overflow runs\n", used / psize, psize,
                  pk.n_tree, pk.n_ovh);

    unsigned crashes = 0, hangs = 0, grown = 0, wrong = 0, unreported = 0, changed = 0, reported = 0, wrong_scan = 0;
    uint64_t rs = seed;
    for (unsigned i = 0; i < n_flips; i++) {
        uint64_t pick = rng_next(&rs) % 6, off;
        if (pick < 2)
            off = pk.tree[rng_next(&rs) % pk.n_tree] * psize + rng_next(&rs) % psize;
        else if (pick == 2)
            off = pk.ovh[rng_next(&rs) % pk.n_ovh] * psize + rng_next(&rs) % 16;
        else
            off = rng_next(&rs) % used;
        uint8_t x = (uint8_t)(rng_next(&rs) % 255 + 1);
        if (only >= 0 && i != (unsigned long)only)
            continue;
        file[off] ^= x;
        copy_store(orig_db, work, file, used, apparent);
        file[off] ^= x;

        char what[128];
        snprintf(what, sizeof what, "flip %u: byte %llu (page %llu + %llu) ^ 0x%02x", i, (unsigned long long)off,
                 (unsigned long long)(off / psize), (unsigned long long)(off % psize), x);
        run_res c = run_ctl(log, (const char *const[]){"check", work, "--read-data", NULL});
        int check_damage = !c.signal && c.code != 0;
        if (c.signal) {
            print_error("%s: check died of signal %d: %s\n", what, c.signal, c.err);
            c.signal == SIGALRM ? hangs++ : crashes++;
        }
        int any_changed = 0;
        for (int s = 0; s < N_SESS; s++)
            for (uint64_t v = 1; v <= n_ver[s]; v++) {
                if (!ver_exists(s, v))
                    continue;
                uint8_t *b = NULL;
                size_t bl = 0;
                run_res e = export_one(work, s, v, &b, &bl);
                if (e.signal) {
                    print_error("%s: export %s@%llu died of signal %d: %s\n", what, sess[s], (unsigned long long)v,
                                e.signal, e.err);
                    e.signal == SIGALRM ? hangs++ : crashes++;
                    any_changed = 1;
                } else if (e.code == 0) {
                    if (!b || bl != ref[s][v].len || memcmp(b, ref[s][v].bytes, bl)) {
                        print_error("%s: export %s@%llu returned other bytes\n", what, sess[s], (unsigned long long)v);
                        wrong++;
                        any_changed = 1;
                    }
                } else {
                    any_changed = 1;
                }
                free(b);
            }
        if (any_changed) {
            changed++;
            if (check_damage) {
                reported++;
            } else {
                unreported++;
                print_error("%s: an export changed but check said: %s\n", what, c.err);
            }
        }
        /* the server's start-up scan: damage is a session's or the store's, never a crash */
        unsigned n_damaged = 0;
        st_store_scan_stats ss;
        int src = st_store_scan(work, NULL, scan_damaged, &n_damaged, &ss);
        if (src && src != ST_ECORRUPT) {
            print_error("%s: scan answered %s: %s\n", what, st_strerror(src), st_errdetail());
            wrong_scan++;
        } else if (src && strstr(st_errdetail(), "stopped: the process reading it")) {
            print_error("%s: the scan's child crashed: %s\n", what, st_errdetail());
            crashes++;
        }
        /* the listings, then a write that frees pages (a version's chunks and manifest), then gc */
        snprintf(spec, sizeof spec, "alpha@1");
        const char *const *writes[] = {(const char *const[]){"ls", work, NULL},
                                       (const char *const[]){"stat", work, NULL},
                                       (const char *const[]){"rm", work, spec, NULL},
                                       (const char *const[]){"gc", work, NULL}};
        for (int w = 0; w < 4; w++) {
            run_res r = run_ctl(log, writes[w]);
            if (r.signal) {
                print_error("%s: %s died of signal %d: %s\n", what, writes[w][0], r.signal, r.err);
                r.signal == SIGALRM ? hangs++ : crashes++;
            }
        }
        if (only >= 0) {
            print_message("%s: the damaged copy is %s.keep (check said: %s)\n", what, work, c.err);
            char keep[1300];
            snprintf(keep, sizeof keep, "%s.keep", work);
            st_test_rmdir(keep);
            copy_store(orig_db, keep, file, used, apparent);
            int fd = open(strcat(keep, "/data.mdb"), O_RDWR);
            assert_true(fd >= 0);
            uint8_t b = file[off] ^ x;
            assert_int_equal(pwrite(fd, &b, 1, (off_t)off), 1);
            close(fd);
        }
        if (file_size(work_db) > apparent) {
            print_error("%s: data.mdb grew from %llu to %llu bytes\n", what, (unsigned long long)apparent,
                        (unsigned long long)file_size(work_db));
            grown++;
        }
    }
    print_message("%u flips (seed %llu): %u changed an export, %u of them reported by check; crashes %u, hangs %u, "
                  "growth %u, wrong bytes %u, unreported %u\n", n_flips, (unsigned long long)seed, changed, reported,
                  crashes, hangs, grown, wrong, unreported);
    assert_int_equal(crashes, 0);
    assert_int_equal(hangs, 0);
    assert_int_equal(grown, 0);
    assert_int_equal(wrong, 0);
    assert_int_equal(unreported, 0);
    assert_int_equal(wrong_scan, 0);
    free(pk.tree);
    free(pk.ovh);
    free(file);
    for (int s = 0; s < N_SESS; s++)
        for (int v = 0; v < 4; v++)
            free(ref[s][v].bytes);
    st_test_rmdir(work);
    st_test_rmdir(orig);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        n_flips = (unsigned)strtoul(argv[1], NULL, 10);
    if (argc > 2)
        seed = strtoull(argv[2], NULL, 10);
    if (argc > 3)
        only = strtol(argv[3], NULL, 10);
    if (getenv("ST_STATECTL") && *getenv("ST_STATECTL"))
        ctl = getenv("ST_STATECTL");
    st_test_tmpdir(base, sizeof base, "store_damage");
    const struct CMUnitTest tests[] = {cmocka_unit_test(test_flips)};
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (only < 0)
        st_test_rmdir(base);
    return rc;
}
