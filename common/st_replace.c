/*
 * st_replace.c - atomic file replacement, the one way the project replaces a file (STYLE.md 9):
 * temp file in the target's directory, write, fsync, close, rename, fsync of the directory.
 *
 * Invariants:
 * 1. The temp file's name is built in one place (st_replace_tmp_name): "<path>.tmp.<pid>.<n>",
 *    n this process's count of temp files, so two threads or two writers of one path never share
 *    one, and a signal handler can rebuild the name of the only one a process made (n 0).
 * 2. Every step's result is checked, the directory's fsync included; every write, fsync, close,
 *    rename and unlink goes through st_sys_calls, so fault injection reaches each step.
 * 3. A failure before the rename removes the temp file and leaves path untouched; after a
 *    failure the handle holds nothing (fd -1, names freed), so abort is always safe.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "st_common.h"

static atomic_uint st_tmp_counter;

int st_replace_tmp_name(char *dst, size_t cap, const char *path, long pid, unsigned n)
{
    int k = snprintf(dst, cap, "%s.tmp.%ld.%u", path, pid, n);
    return k < 0 || (size_t)k >= cap ? ST_EINVAL : 0;
}

int st_replace_tmp_next(char *dst, size_t cap, const char *path)
{
    return st_replace_tmp_name(dst, cap, path, (long)getpid(), atomic_fetch_add(&st_tmp_counter, 1));
}

static void st_replace_clear(st_replace *a)
{
    free(a->tmp);
    free(a->dir);
    a->tmp = a->dir = NULL;
    a->fd = -1;
}

void st_replace_abort(st_replace *a)
{
    if (a->fd >= 0) {
        st_sys_calls.close(a->fd);
        st_sys_calls.unlink(a->tmp);
    }
    st_replace_clear(a);
}

int st_replace_begin(st_replace *a, const char *path, unsigned mode)
{
    size_t plen, cap;
    const char *slash;

    a->tmp = NULL;
    a->dir = NULL;
    a->fd = -1;
    if (!path || !path[0])
        return st_error_set(ST_EINVAL, "write: empty path");
    plen = strlen(path);
    if (path[plen - 1] == '/')
        return st_error_set(EISDIR, "write %s: path names a directory", path);
    slash = strrchr(path, '/');
    if (!slash)
        a->dir = strdup(".");
    else if (slash == path)
        a->dir = strdup("/");
    else
        a->dir = strndup(path, (size_t)(slash - path));
    cap = plen + 48;
    a->tmp = malloc(cap);
    if (!a->dir || !a->tmp) {
        st_replace_clear(a);
        return st_error_set(ENOMEM, "write %s: out of memory (%zu bytes for the temp file's name)", path,
                            cap);
    }
    for (int tries = 0; tries < 100; tries++) {
        st_replace_tmp_next(a->tmp, cap, path);
        a->fd = st_sys_calls.open(a->tmp, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, mode);
        if (a->fd >= 0)
            return 0;
        if (errno != EEXIST && errno != EINTR)
            break;
    }
    int e = errno ? errno : EIO;
    st_error_set(e, "write %s: cannot create temp file %s: %s", path, a->tmp, strerror(e));
    st_replace_clear(a);
    return e;
}

int st_replace_commit(st_replace *a, const char *path)
{
    int rc = 0;

    if (a->fd < 0)
        return st_error_set(ST_EINVAL, "write %s: no temp file to commit", path);
    if (st_sys_calls.fsync(a->fd) != 0) {
        rc = errno ? errno : EIO;
        st_error_set(rc, "write %s: fsync of %s failed: %s", path, a->tmp, strerror(rc));
        st_replace_abort(a);
        return rc;
    }
    int fd = a->fd;
    a->fd = -1;
    if (st_sys_calls.close(fd) != 0) {
        rc = errno ? errno : EIO;
        st_sys_calls.unlink(a->tmp);
        st_error_set(rc, "write %s: close of %s failed: %s", path, a->tmp, strerror(rc));
        st_replace_clear(a);
        return rc;
    }
    if (st_sys_calls.rename(a->tmp, path) != 0) {
        rc = errno ? errno : EIO;
        st_sys_calls.unlink(a->tmp);
        st_error_set(rc, "write %s: rename from %s failed: %s", path, a->tmp, strerror(rc));
        st_replace_clear(a);
        return rc;
    }
    rc = st_sys_fsync_dir(a->dir);
    if (rc)
        st_error_set(rc, "write %s: fsync of directory %s failed: %s", path, a->dir, strerror(rc));
    st_replace_clear(a);
    return rc;
}

int st_replace_file(const char *path, const void *buf, size_t len)
{
    st_replace a;

    if (!buf && len)
        return st_error_set(ST_EINVAL, "replace %s: NULL buffer", path ? path : "(null)");
    int rc = st_replace_begin(&a, path, 0666);
    if (rc)
        return rc;
    rc = st_sys_write_all(a.fd, buf, len);
    if (rc) {
        st_error_set(rc, "write %s: writing %s failed: %s", path, a.tmp, strerror(rc));
        st_replace_abort(&a);
        return rc;
    }
    return st_replace_commit(&a, path);
}
