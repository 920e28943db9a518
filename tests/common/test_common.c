/*
 * test_common.c - common/: the error detail wrap, the file-system call table (set, get, next,
 * reset by name), atomic replacement under an injected failure of each step (the old file stays
 * and no temp file is left; a failing directory fsync is reported with the new file in place),
 * the temp name, the write loops' short writes and EINTR, hex, little-endian, SHA-256 against
 * FIPS 180-2's vectors, CPU features against the compiler's own checks.
 */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_common.h"
#include "st_test_util.h"

static char tmpdir[1024];

/* ---- errors ------------------------------------------------------------------------------- */

static void test_error_wrap(void **state)
{
    (void)state;
    assert_int_equal(st_error_set(ENOSPC, "fsync of %s failed", "x"), ENOSPC);
    assert_int_equal(st_error_wrap(ST_EFULL, "saving session %d", 7), ST_EFULL);
    assert_string_equal(st_errdetail(), "saving session 7: fsync of x failed");
    /* a wrap of a wrap, and a wrap whose arguments are the detail itself */
    st_error_wrap(ST_EIO, "outer");
    assert_string_equal(st_errdetail(), "outer: saving session 7: fsync of x failed");
    st_error_set(ST_EIO, "inner");
    st_error_wrap(ST_EIO, "[%s]", st_errdetail());
    assert_string_equal(st_errdetail(), "[inner]: inner");
    /* an empty detail still gets the separator (what the hand-written copies printed) */
    st_error_clear();
    st_error_wrap(ST_EIO, "what");
    assert_string_equal(st_errdetail(), "what: ");
    /* truncation at 511 bytes: of the detail part, and of an over-long prefix */
    char big[700];
    memset(big, 'd', sizeof big - 1);
    big[sizeof big - 1] = '\0';
    st_error_set(ST_EIO, "%s", big);
    st_error_wrap(ST_EIO, "p");
    assert_int_equal(strlen(st_errdetail()), 511);
    assert_memory_equal(st_errdetail(), "p: ddd", 6);
    st_error_set(ST_EIO, "tail");
    st_error_wrap(ST_EIO, "%s", big);
    assert_int_equal(strlen(st_errdetail()), 511);
    assert_null(strchr(st_errdetail(), ':'));
    assert_string_equal(st_strerror(ST_EFULL), "store or disk full");
    assert_string_equal(st_strerror(ENOSPC), strerror(ENOSPC));
}

/* ---- the call table ------------------------------------------------------------------------ */

static int calls, fail_at, fail_errno;

static int hit(void)
{
    if (++calls == fail_at) {
        errno = fail_errno;
        return 1;
    }
    return 0;
}

static int bad_open(const char *p, int flags, unsigned mode)
{
    if (hit())
        return -1;
    return st_sys_real.open(p, flags, mode);
}
static ssize_t bad_write(int fd, const void *b, size_t n)
{
    if (hit())
        return -1;
    return st_sys_real.write(fd, b, n);
}
static int bad_fsync(int fd)
{
    if (hit())
        return -1;
    return st_sys_real.fsync(fd);
}
static int bad_close(int fd)
{
    if (hit()) {
        st_sys_real.close(fd); /* close(2) frees the descriptor even when it reports an error */
        return -1;
    }
    return st_sys_real.close(fd);
}
static int bad_rename(const char *a, const char *b)
{
    if (hit())
        return -1;
    return st_sys_real.rename(a, b);
}

static void test_sys_table(void **state)
{
    (void)state;
    size_t n = 0;
    for (const char *name = st_sys_next(NULL); name; name = st_sys_next(name)) {
        assert_non_null(st_sys_get(name));
        n++;
    }
    assert_int_equal(n, sizeof(st_sys) / sizeof(st_sys_fn));
    assert_int_equal(st_sys_set("nonesuch", (st_sys_fn)bad_write), ST_ENOTFOUND);
    assert_null(st_sys_get("nonesuch"));
    assert_null(st_sys_next("nonesuch"));

    /* by name and by field are the same entry */
    assert_int_equal(st_sys_set("write", (st_sys_fn)bad_write), 0);
    assert_ptr_equal(st_sys_calls.write, bad_write);
    assert_ptr_equal(st_sys_get("write"), (st_sys_fn)bad_write);
    assert_int_equal(st_sys_set("write", NULL), 0);
    assert_ptr_equal(st_sys_calls.write, st_sys_real.write);
    st_sys_calls.fsync = bad_fsync;
    st_sys_calls.rename = bad_rename;
    st_sys_reset();
    assert_memory_equal(&st_sys_calls, &st_sys_real, sizeof(st_sys));
}

/* ---- atomic replacement ------------------------------------------------------------------- */

static void check_content(const char *path, const char *want)
{
    size_t len = 0;
    unsigned char *b = st_test_slurp(path, &len);
    assert_non_null(b);
    assert_int_equal(len, strlen(want));
    assert_memory_equal(b, want, len);
    free(b);
}

/* The streaming form: begin, two writes, commit. */
static int replace_streaming(const char *path)
{
    st_replace a;
    int rc = st_replace_begin(&a, path, 0644);
    if (rc)
        return rc;
    if ((rc = st_sys_write_all(a.fd, "NEW", 3)) || (rc = st_sys_write_all(a.fd, "DATA", 4))) {
        st_replace_abort(&a);
        return rc;
    }
    return st_replace_commit(&a, path);
}

typedef struct fault_case {
    const char *name; /* the entry failed */
    st_sys_fn fn;
    int err;
} fault_case;

static void test_replace_faults(void **state)
{
    (void)state;
    static const fault_case cases[] = {
        {"open", (st_sys_fn)bad_open, EACCES}, {"write", (st_sys_fn)bad_write, ENOSPC},
        {"write", (st_sys_fn)bad_write, EIO},  {"fsync", (st_sys_fn)bad_fsync, EIO},
        {"close", (st_sys_fn)bad_close, EIO},  {"rename", (st_sys_fn)bad_rename, EIO},
    };
    char path[1200];
    snprintf(path, sizeof path, "%s/target", tmpdir);

    for (int form = 0; form < 2; form++) {
        for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
            int failures = 0;
            for (fail_at = 1;; fail_at++) {
                assert_int_equal(st_test_spit(path, "OLD", 3), 0);
                calls = 0;
                fail_errno = cases[c].err;
                assert_int_equal(st_sys_set(cases[c].name, cases[c].fn), 0);
                int rc = form ? replace_streaming(path) : st_replace_file(path, "NEWDATA", 7);
                st_sys_reset();
                if (rc == 0) {
                    /* ran out of calls to fail: the last success really replaced the file */
                    check_content(path, "NEWDATA");
                    assert_int_equal(st_test_count_entries(tmpdir), 1);
                    break;
                }
                failures++;
                assert_int_equal(rc, cases[c].err);
                assert_non_null(strstr(st_errdetail(), path));
                if (!strcmp(cases[c].name, "fsync") && fail_at == 2) {
                    /* the directory's fsync comes after the rename: reported, new file in place */
                    assert_non_null(strstr(st_errdetail(), "fsync of directory"));
                    check_content(path, "NEWDATA");
                    assert_int_equal(st_test_count_entries(tmpdir), 1);
                    continue;
                }
                check_content(path, "OLD"); /* the old file intact */
                assert_int_equal(st_test_count_entries(tmpdir), 1); /* and no temp file behind */
            }
            /* the control: each injected call was reached (a table nobody calls through would
             * pass every check above without one failure) */
            assert_true(failures >= (strcmp(cases[c].name, "fsync") ? 1 : 2));
        }
    }
    unlink(path);

    /* bad arguments and a target that cannot be replaced */
    assert_int_equal(st_replace_file("", "x", 1), ST_EINVAL);
    assert_int_equal(st_replace_file(path, NULL, 1), ST_EINVAL);
    char dpath[1200], nested[1300];
    snprintf(dpath, sizeof dpath, "%s/adir", tmpdir);
    assert_int_equal(mkdir(dpath, 0755), 0);
    snprintf(nested, sizeof nested, "%s/x", dpath);
    assert_int_equal(st_test_spit(nested, "OLD", 3), 0);
    int rc = st_replace_file(dpath, "x", 1);
    assert_true(rc == EISDIR || rc == ENOTEMPTY || rc == EEXIST);
    assert_int_equal(st_test_count_entries(tmpdir), 1);
    assert_int_equal(st_test_count_entries(dpath), 1);
    snprintf(nested, sizeof nested, "%s/nope/x", tmpdir);
    assert_int_equal(st_replace_file(nested, "x", 1), ENOENT);
    assert_int_equal(st_test_run(NULL, 0, "rm -rf '%s'", dpath), 0);

    /* abort is safe on a handle begin did not fill and after commit */
    st_replace a;
    assert_int_equal(st_replace_begin(&a, "", 0644), ST_EINVAL);
    st_replace_abort(&a);
    assert_int_equal(st_replace_begin(&a, path, 0644), 0);
    assert_int_equal(st_replace_commit(&a, path), 0);
    st_replace_abort(&a);
    check_content(path, "");
    unlink(path);
}

static void test_replace_tmp_name(void **state)
{
    (void)state;
    char path[1200], want[1300], small[10];
    snprintf(path, sizeof path, "%s/named", tmpdir);
    /* the name begin uses is the one st_replace_tmp_name builds, for some n of this process */
    st_replace a;
    assert_int_equal(st_replace_begin(&a, path, 0600), 0);
    const char *tail = strrchr(a.tmp, '.');
    assert_non_null(tail);
    unsigned n = (unsigned)strtoul(tail + 1, NULL, 10);
    assert_int_equal(st_replace_tmp_name(want, sizeof want, path, (long)getpid(), n), 0);
    assert_string_equal(a.tmp, want);
    struct stat sb;
    assert_int_equal(stat(want, &sb), 0);
    assert_int_equal(sb.st_mode & 0777, 0600);
    st_replace_abort(&a);
    assert_int_not_equal(stat(want, &sb), 0);
    assert_int_equal(st_test_count_entries(tmpdir), 0);
    /* the next one counts on */
    assert_int_equal(st_replace_begin(&a, path, 0600), 0);
    assert_int_equal(st_replace_tmp_name(want, sizeof want, path, (long)getpid(), n + 1), 0);
    assert_string_equal(a.tmp, want);
    st_replace_abort(&a);
    /* st_replace_tmp_next takes the next n of the same count */
    assert_int_equal(st_replace_tmp_next(want, sizeof want, path), 0);
    char want2[1300];
    assert_int_equal(st_replace_tmp_name(want2, sizeof want2, path, (long)getpid(), n + 2), 0);
    assert_string_equal(want, want2);
    assert_int_equal(st_replace_tmp_next(small, sizeof small, path), ST_EINVAL);
    assert_int_equal(st_replace_tmp_name(small, sizeof small, "abc", 1, 0), ST_EINVAL);
    assert_int_equal(st_replace_tmp_name(small, sizeof small, "a", 1, 0), 0);
    assert_string_equal(small, "a.tmp.1.0");
}

/* ---- write loops -------------------------------------------------------------------------- */

static int eintr_left;
static ssize_t dribble_write(int fd, const void *b, size_t n)
{
    if (eintr_left > 0) {
        eintr_left--;
        errno = EINTR;
        return -1;
    }
    return st_sys_real.write(fd, b, n ? 1 : 0);
}
static ssize_t dribble_pwrite(int fd, const void *b, size_t n, uint64_t off)
{
    if (eintr_left > 0) {
        eintr_left--;
        errno = EINTR;
        return -1;
    }
    return st_sys_real.pwrite(fd, b, n > 2 ? 2 : n, off);
}
static ssize_t zero_write(int fd, const void *b, size_t n)
{
    return 0;
}

static void test_write_loops(void **state)
{
    (void)state;
    char path[1200];
    snprintf(path, sizeof path, "%s/loops", tmpdir);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    assert_true(fd >= 0);
    st_sys_calls.write = dribble_write;
    st_sys_calls.pwrite = dribble_pwrite;
    eintr_left = 2;
    assert_int_equal(st_sys_write_all(fd, "hello", 5), 0);
    eintr_left = 1;
    assert_int_equal(st_sys_pwrite_all(fd, "HEL", 3, 0), 0);
    st_sys_calls.write = zero_write;
    assert_int_equal(st_sys_write_all(fd, "x", 1), EIO);
    st_sys_reset();
    close(fd);
    check_content(path, "HELlo");
    unlink(path);
    assert_int_equal(st_sys_fsync_dir(tmpdir), 0);
    snprintf(path, sizeof path, "%s/nope", tmpdir);
    assert_int_equal(st_sys_fsync_dir(path), ENOENT);
}

/* ---- hex, little-endian, SHA-256, CPU ------------------------------------------------------- */

static void test_hex(void **state)
{
    (void)state;
    const uint8_t b[] = {0x00, 0x01, 0x7f, 0x80, 0xab, 0xff};
    char h[2 * sizeof b + 1];
    uint8_t back[sizeof b];
    st_hex_encode(h, b, sizeof b);
    assert_string_equal(h, "00017f80abff");
    assert_int_equal(st_hex_decode(back, h, sizeof b), 0);
    assert_memory_equal(back, b, sizeof b);
    assert_int_equal(st_hex_decode(back, "00017F80ABFF", sizeof b), 0);
    assert_memory_equal(back, b, sizeof b);
    st_hex_encode(h, b, 0);
    assert_string_equal(h, "");
    assert_int_equal(st_hex_decode(back, "0g", 1), ST_EINVAL);
    assert_int_equal(st_hex_decode(back, "g0", 1), ST_EINVAL);
    assert_int_equal(st_hex_decode(back, " a", 1), ST_EINVAL);
    assert_int_equal(st_hex_decode(back, "+a", 1), ST_EINVAL);
    assert_int_equal(st_hex_decode(back, "a", 1), ST_EINVAL); /* the NUL is no digit */
}

static void test_le(void **state)
{
    (void)state;
    uint8_t b[9] = {0};
    st_put16(b + 1, 0x1234);
    assert_memory_equal(b + 1, "\x34\x12", 2);
    assert_int_equal(st_get16(b + 1), 0x1234);
    st_put32(b + 1, 0x89abcdefu);
    assert_memory_equal(b + 1, "\xef\xcd\xab\x89", 4);
    assert_int_equal(st_get32(b + 1), 0x89abcdefu);
    st_put64(b + 1, 0x0123456789abcdefull);
    assert_memory_equal(b + 1, "\xef\xcd\xab\x89\x67\x45\x23\x01", 8);
    assert_true(st_get64(b + 1) == 0x0123456789abcdefull);
    assert_int_equal(b[0], 0);
}

static void test_sha256(void **state)
{
    (void)state;
    uint8_t d[ST_SHA256_LEN], e[ST_SHA256_LEN];
    char h[2 * ST_SHA256_LEN + 1];
    assert_int_equal(st_sha256("abc", 3, d), 0);
    st_hex_encode(h, d, sizeof d);
    assert_string_equal(h, "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    assert_int_equal(st_sha256("", 0, d), 0);
    st_hex_encode(h, d, sizeof d);
    assert_string_equal(h, "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    const char *m = "abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq";
    st_sha256_ctx c;
    assert_int_equal(st_sha256_init(&c), 0);
    for (size_t i = 0, len = strlen(m); i < len; i += 5)
        st_sha256_update(&c, m + i, len - i < 5 ? len - i : 5);
    assert_int_equal(st_sha256_final(&c, d), 0);
    assert_null(c.ctx);
    st_sha256_free(&c); /* after final: nothing left */
    assert_int_equal(st_sha256(m, strlen(m), e), 0);
    assert_memory_equal(d, e, sizeof d);
    st_hex_encode(h, d, sizeof d);
    assert_string_equal(h, "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    /* a state that is not finished is freed; a failed update is reported by final */
    assert_int_equal(st_sha256_init(&c), 0);
    st_sha256_update(&c, "x", 1);
    st_sha256_free(&c);
    st_sha256_free(NULL);
    assert_int_equal(st_sha256_init(&c), 0);
    c.failed = 1;
    assert_int_equal(st_sha256_final(&c, d), ST_EIO);
}

static void test_cpu(void **state)
{
    (void)state;
    unsigned f = st_cpu_features();
    assert_int_equal(st_cpu_features(), f); /* cached, stable */
#if defined(__x86_64__)
    __builtin_cpu_init();
    assert_int_equal(!!(f & ST_CPU_AVX2), !!__builtin_cpu_supports("avx2"));
    assert_int_equal(!!(f & ST_CPU_FMA), !!__builtin_cpu_supports("fma"));
    assert_int_equal(!!(f & ST_CPU_AVX512F), !!__builtin_cpu_supports("avx512f"));
    assert_int_equal(!!(f & ST_CPU_AVX512BW), !!__builtin_cpu_supports("avx512bw"));
    assert_int_equal(!!(f & ST_CPU_AVX512VL), !!__builtin_cpu_supports("avx512vl"));
    assert_int_equal(!!(f & ST_CPU_AVX512DQ), !!__builtin_cpu_supports("avx512dq"));
    assert_int_equal(!!(f & ST_CPU_AVX512VNNI), !!__builtin_cpu_supports("avx512vnni"));
    if (f & ST_CPU_F16C)
        assert_true(f & ST_CPU_AVX2);
    assert_int_equal(st_cpu_has(ST_CPU_AVX2 | ST_CPU_FMA), (f & (ST_CPU_AVX2 | ST_CPU_FMA)) == (ST_CPU_AVX2 | ST_CPU_FMA));
#else
    assert_int_equal(f, 0);
#endif
    assert_true(st_cpu_has(0));
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(tmpdir, sizeof tmpdir, "test_common");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_sys_reset();
    st_test_rmdir(tmpdir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_error_wrap),      cmocka_unit_test(test_sys_table),
        cmocka_unit_test(test_replace_faults),  cmocka_unit_test(test_replace_tmp_name),
        cmocka_unit_test(test_write_loops),     cmocka_unit_test(test_hex),
        cmocka_unit_test(test_le),              cmocka_unit_test(test_sha256),
        cmocka_unit_test(test_cpu),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
