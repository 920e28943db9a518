/*
 * st_sys.c - the file-system call table (SQLite's aSyscall[] in one typed struct) and the loops
 * every writer needs over it.
 *
 * Invariants:
 * 1. st_sys_real holds the system's functions and never changes; st_sys_calls starts equal to it
 *    and differs only while a test has replaced entries.
 * 2. st_sys_names lists every entry of st_sys exactly once, by its field name, so set, get and
 *    next reach every entry and nothing else (a test checks the count against sizeof(st_sys)).
 * 3. The loops here call only through st_sys_calls, never the system directly: what a test
 *    injects there is what the writer sees.
 */
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_common.h"

static int sys_open(const char *path, int flags, unsigned mode)
{
    return open(path, flags, (mode_t)mode);
}

static ssize_t sys_pwrite(int fd, const void *buf, size_t n, uint64_t off)
{
    return pwrite(fd, buf, n, (off_t)off);
}

static int sys_ftruncate(int fd, uint64_t len)
{
    return ftruncate(fd, (off_t)len);
}

static int sys_fallocate(int fd, uint64_t off, uint64_t len)
{
    return fallocate(fd, 0, (off_t)off, (off_t)len);
}

static int sys_mkdir(const char *path, unsigned mode)
{
    return mkdir(path, (mode_t)mode);
}

/* The real calls, once: st_sys_real keeps them, st_sys_calls starts as them (tests replace entries) */
#define ST_SYS_REAL_CALLS                                                                          \
    {                                                                                              \
        .open = sys_open, .close = close, .write = write, .pwrite = sys_pwrite, .fsync = fsync,    \
        .fdatasync = fdatasync, .ftruncate = sys_ftruncate, .fallocate = sys_fallocate,            \
        .rename = rename, .unlink = unlink, .mkdir = sys_mkdir, .rmdir = rmdir,                    \
    }

const st_sys st_sys_real = ST_SYS_REAL_CALLS;
st_sys st_sys_calls = ST_SYS_REAL_CALLS;

#define ST_SYS_ENTRY(f) {#f, offsetof(st_sys, f)}
static const struct {
    const char *name;
    size_t off;
} st_sys_names[] = {
    ST_SYS_ENTRY(open),      ST_SYS_ENTRY(close),     ST_SYS_ENTRY(write),  ST_SYS_ENTRY(pwrite),
    ST_SYS_ENTRY(fsync),     ST_SYS_ENTRY(fdatasync), ST_SYS_ENTRY(ftruncate),
    ST_SYS_ENTRY(fallocate), ST_SYS_ENTRY(rename),    ST_SYS_ENTRY(unlink), ST_SYS_ENTRY(mkdir),
    ST_SYS_ENTRY(rmdir),
};
#define ST_SYS_N (sizeof st_sys_names / sizeof st_sys_names[0])
_Static_assert(ST_SYS_N * sizeof(st_sys_fn) == sizeof(st_sys), "st_sys_names lists every entry");

static int st_sys_find(const char *name)
{
    for (size_t i = 0; name && i < ST_SYS_N; i++)
        if (!strcmp(st_sys_names[i].name, name))
            return (int)i;
    return -1;
}

/* The entry at off of table t, as a generic function pointer (every entry is one). */
static st_sys_fn *st_sys_slot(st_sys *t, size_t off)
{
    return (st_sys_fn *)(void *)((char *)t + off);
}

int st_sys_set(const char *name, st_sys_fn fn)
{
    int i = st_sys_find(name);
    if (i < 0)
        return ST_ENOTFOUND;
    size_t off = st_sys_names[i].off;
    if (!fn)
        fn = *st_sys_slot((st_sys *)&st_sys_real, off);
    *st_sys_slot(&st_sys_calls, off) = fn;
    return 0;
}

st_sys_fn st_sys_get(const char *name)
{
    int i = st_sys_find(name);
    return i < 0 ? NULL : *st_sys_slot(&st_sys_calls, st_sys_names[i].off);
}

const char *st_sys_next(const char *name)
{
    if (!name)
        return st_sys_names[0].name;
    int i = st_sys_find(name);
    return i < 0 || (size_t)i + 1 >= ST_SYS_N ? NULL : st_sys_names[i + 1].name;
}

void st_sys_reset(void)
{
    st_sys_calls = st_sys_real;
}

int st_sys_write_all(int fd, const void *buf, size_t n)
{
    const uint8_t *b = buf;
    while (n > 0) {
        ssize_t w = st_sys_calls.write(fd, b, n);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno ? errno : EIO;
        }
        if (w == 0)
            return EIO;
        b += w;
        n -= (size_t)w;
    }
    return 0;
}

int st_sys_pwrite_all(int fd, const void *buf, size_t n, uint64_t off)
{
    const uint8_t *b = buf;
    while (n > 0) {
        ssize_t w = st_sys_calls.pwrite(fd, b, n, off);
        if (w < 0) {
            if (errno == EINTR)
                continue;
            return errno ? errno : EIO;
        }
        if (w == 0)
            return EIO;
        b += w;
        n -= (size_t)w;
        off += (uint64_t)w;
    }
    return 0;
}

int st_sys_fsync_dir(const char *dir)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return errno ? errno : EIO;
    int rc = st_sys_calls.fsync(fd) != 0 ? (errno ? errno : EIO) : 0;
    close(fd);
    return rc;
}
