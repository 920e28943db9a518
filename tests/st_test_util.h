/*
 * st_test_util.h - small helpers shared by Strata's tests: a scratch directory per test program,
 * running a real command and capturing its output, reading whole files, finding a leftover temp
 * file of an atomic replacement.
 */
#ifndef ST_TEST_UTIL_H
#define ST_TEST_UTIL_H

#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* A fresh directory under $ST_TEST_TMP (or /tmp) named after the test; path in dst. */
static inline void st_test_tmpdir(char *dst, size_t cap, const char *name)
{
    const char *base = getenv("ST_TEST_TMP");
    if (!base || !*base)
        base = "/tmp";
    snprintf(dst, cap, "%s/%s.%d", base, name, (int)getpid());
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", dst, dst);
    if (system(cmd) != 0)
        abort();
}

static inline void st_test_rmdir(const char *dir)
{
    char cmd[8400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    if (system(cmd) != 0)
        abort();
}

/* Run a shell command line; stdout+stderr go to out (NUL-terminated, truncated at cap).
 * Returns the exit status, or -1 if it did not exit normally. */
static inline int st_test_run(char *out, size_t cap, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static inline int st_test_run(char *out, size_t cap, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    size_t len = strlen(cmd);
    snprintf(cmd + len, sizeof cmd - len, " 2>&1");
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    size_t n = 0;
    if (out && cap) {
        int c;
        while ((c = fgetc(p)) != EOF)
            if (n + 1 < cap)
                out[n++] = (char)c;
        out[n] = '\0';
    } else {
        while (fgetc(p) != EOF) {
        }
    }
    int st = pclose(p);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

/* Read a whole file into a malloc'd buffer. */
static inline unsigned char *st_test_slurp(const char *path, size_t *len)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    unsigned char *buf = malloc(n > 0 ? (size_t)n : 1);
    if (buf && fread(buf, 1, (size_t)n, f) != (size_t)n) {
        free(buf);
        buf = NULL;
    }
    fclose(f);
    if (buf)
        *len = (size_t)n;
    return buf;
}

static inline int st_test_spit(const char *path, const void *buf, size_t len)
{
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = fwrite(buf, 1, len, f);
    return fclose(f) == 0 && w == len ? 0 : -1;
}

/* The number of entries of dir other than . and .. (-1 when it cannot be opened). */
static inline int st_test_count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return -1;
    struct dirent *e;
    int n = 0;
    while ((e = readdir(d)))
        if (strcmp(e->d_name, ".") && strcmp(e->d_name, ".."))
            n++;
    closedir(d);
    return n;
}

/* 1 when path's directory holds an entry named "<name of path>.tmp.<anything>": a temp file or
 * directory that an atomic replacement of path (st_replace_tmp_name's name) left behind. */
static inline int st_test_has_temp(const char *path)
{
    char dir[4200], prefix[4200];
    const char *slash = strrchr(path, '/');
    if (slash)
        snprintf(dir, sizeof dir, "%.*s", (int)(slash - path) ? (int)(slash - path) : 1, path);
    else
        snprintf(dir, sizeof dir, ".");
    snprintf(prefix, sizeof prefix, "%s.tmp.", slash ? slash + 1 : path);
    DIR *d = opendir(dir);
    if (!d)
        return 0;
    struct dirent *e;
    int found = 0;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, prefix, strlen(prefix)))
            found = 1;
    closedir(d);
    return found;
}

#endif
