/*
 * st_store_contain.c - store work that reads every page of a possibly damaged data.mdb (check,
 * the server's start-up scan) run in a child process, so that a crash inside liblmdb on a page
 * the page walk did not catch ends the child, not the caller, and becomes a typed error.
 *
 * Invariants:
 * 1. The child opens its own read-only environment on the directory (an LMDB environment is
 *    never used across fork); the caller's handle, if any, is not touched by it.
 * 2. The child sends what it finds over a pipe as records (a type byte, a u32 length, the bytes)
 *    and last a result record; the caller reports each record as it arrives and trusts nothing
 *    more than the record lengths it bounds. A child that ends without its result record (a
 *    signal, an exit) is ST_ECORRUPT naming how it ended and the remedy.
 * 3. The child leaves through _exit: nothing the caller registered (atexit, stdio buffers it
 *    inherited) runs twice.
 */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

#define REC_MAX (64u << 10)
#define REC_PROBLEM 'P'
#define REC_DAMAGED 'D'
#define REC_RESULT 'R'

typedef struct rec_out {
    int fd;
    int err;
} rec_out;

static void rec_write(rec_out *o, uint8_t type, const void *a, size_t alen, const char *text)
{
    size_t tl = text ? strlen(text) : 0;
    if (alen + tl > REC_MAX - 5)
        tl = REC_MAX - 5 - alen;
    uint8_t *b = malloc(5 + alen + tl);
    if (!b) {
        o->err = 1;
        return;
    }
    b[0] = type;
    st_put32(b + 1, (uint32_t)(alen + tl));
    memcpy(b + 5, a, alen);
    memcpy(b + 5 + alen, text, tl);
    for (size_t off = 0, n = 5 + alen + tl; off < n && !o->err;) {
        ssize_t w = write(o->fd, b + off, n - off);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            o->err = 1;
        else
            off += (size_t)w;
    }
    free(b);
}

/* Read exactly n bytes; 1, 0 at a clean end before the first byte, -1 otherwise. */
static int read_full(int fd, void *dst, size_t n)
{
    uint8_t *p = dst;
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, p + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return got == 0 && r == 0 ? 0 : -1;
        got += (size_t)r;
    }
    return 1;
}

typedef struct result_rec {
    int32_t rc;
    st_check_result res;
    st_store_scan_stats scan;
} result_rec;

typedef struct problem_rec {
    uint32_t kind;
    uint64_t version, page;
    char chunk[2 * ST_STORE_HASH_LEN + 1];
    char session[ST_STORE_ID_MAX + 1];
} problem_rec;

typedef struct child_job {
    const char *dir;
    st_store_opts opts;
    int read_data;
    rec_out out;
} child_job;

static void child_report(void *arg, const st_check_problem *p)
{
    child_job *j = arg;
    problem_rec r;
    memset(&r, 0, sizeof r);
    r.kind = p->kind;
    r.version = p->version;
    r.page = p->page;
    snprintf(r.chunk, sizeof r.chunk, "%s", p->chunk);
    snprintf(r.session, sizeof r.session, "%s", p->session);
    rec_write(&j->out, REC_PROBLEM, &r, sizeof r, p->message);
}

static void child_damaged(void *arg, const char *id, const char *why)
{
    child_job *j = arg;
    char sid[ST_STORE_ID_MAX + 1];
    memset(sid, 0, sizeof sid);
    snprintf(sid, sizeof sid, "%s", id);
    rec_write(&j->out, REC_DAMAGED, sid, sizeof sid, why);
}

typedef int (*child_fn)(child_job *j, result_rec *res);

static int child_check(child_job *j, result_rec *res)
{
    st_store *st = NULL;
    int rc = st_store_open(&st, j->dir, &j->opts);
    if (!rc)
        rc = st_store_check(st, j->read_data, child_report, j, &res->res);
    st_store_close(st);
    return rc;
}

static int child_scan(child_job *j, result_rec *res)
{
    return st_store__scan(j->dir, &j->opts, child_damaged, j, &res->scan);
}

typedef struct parent_cb {
    void (*report)(void *arg, const st_check_problem *p);
    st_store_damaged_fn damaged;
    void *arg;
    uint64_t seen;
} parent_cb;

static int contained(const char *dir, const st_store_opts *opts, int read_data, child_fn fn, parent_cb *cb,
                     result_rec *out, const char *what)
{
    int pfd[2];
    memset(out, 0, sizeof *out);
    if (pipe2(pfd, O_CLOEXEC) != 0)
        return st_error_set(errno, "%s: pipe: %s", what, strerror(errno));
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0) {
        int e = errno;
        close(pfd[0]);
        close(pfd[1]);
        return st_error_set(e, "%s: fork: %s", what, strerror(e));
    }
    if (pid == 0) {
        close(pfd[0]);
        signal(SIGPIPE, SIG_IGN);
        child_job j = {.dir = dir, .read_data = read_data, .out = {pfd[1], 0}};
        if (opts)
            j.opts = *opts;
        j.opts.read_only = 1;
        j.opts.create = 0;
        result_rec r;
        memset(&r, 0, sizeof r);
        r.rc = fn(&j, &r);
        rec_write(&j.out, REC_RESULT, &r, sizeof r, r.rc ? st_errdetail() : "");
        _exit(j.out.err ? 3 : 0);
    }
    close(pfd[1]);
    int rc = 0, got_result = 0;
    char detail[600] = "";
    uint8_t *buf = malloc(REC_MAX + 1);
    if (!buf)
        rc = st_error_set(ENOMEM, "%s: no memory", what);
    for (;;) {
        uint8_t h[5];
        int r = read_full(pfd[0], h, sizeof h);
        if (r <= 0 || !buf)
            break;
        uint32_t len = st_get32(h + 1);
        if (len > REC_MAX || read_full(pfd[0], buf, len) != 1)
            break;
        buf[len] = '\0';
        if (h[0] == REC_PROBLEM && len >= sizeof(problem_rec)) {
            problem_rec pr;
            memcpy(&pr, buf, sizeof pr);
            pr.chunk[sizeof pr.chunk - 1] = pr.session[sizeof pr.session - 1] = '\0';
            st_check_problem p = {.kind = pr.kind, .session = pr.session, .version = pr.version,
                                  .message = (const char *)buf + sizeof pr, .page = pr.page};
            memcpy(p.chunk, pr.chunk, sizeof p.chunk);
            cb->seen++;
            if (cb->report)
                cb->report(cb->arg, &p);
        } else if (h[0] == REC_DAMAGED && len >= ST_STORE_ID_MAX + 1) {
            buf[ST_STORE_ID_MAX] = '\0';
            cb->seen++;
            if (cb->damaged)
                cb->damaged(cb->arg, (const char *)buf, (const char *)buf + ST_STORE_ID_MAX + 1);
        } else if (h[0] == REC_RESULT && len >= sizeof(result_rec)) {
            memcpy(out, buf, sizeof *out);
            snprintf(detail, sizeof detail, "%s", (const char *)buf + sizeof *out);
            got_result = 1;
        }
    }
    free(buf);
    close(pfd[0]);
    int status = 0;
    while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    if (rc)
        return rc;
    if (!got_result) {
        char how[64];
        if (WIFSIGNALED(status))
            snprintf(how, sizeof how, "died of signal %d (%s)", WTERMSIG(status), strsignal(WTERMSIG(status)));
        else
            snprintf(how, sizeof how, "exited with status %d", WEXITSTATUS(status));
        return st_error_set(ST_ECORRUPT, "%s of %s stopped: the process reading it %s after %llu findings, inside "
                            "liblmdb on a damaged page; the store is damaged: restore a backup with `statectl "
                            "restore-backup`", what, dir, how, (unsigned long long)cb->seen);
    }
    if (out->rc)
        return st_error_set(out->rc, "%s", detail);
    return 0;
}

int st_store_check_contained(const char *dir, const st_store_opts *opts, int read_data,
                             void (*report)(void *arg, const st_check_problem *p), void *arg, st_check_result *res)
{
    if (!dir)
        return st_error_set(ST_EINVAL, "check: no store directory");
    parent_cb cb = {.report = report, .arg = arg};
    result_rec r;
    int rc = contained(dir, opts, read_data, child_check, &cb, &r, "the check");
    if (!rc && res)
        *res = r.res;
    return rc;
}

int st_store_scan(const char *dir, const st_store_opts *opts, st_store_damaged_fn damaged, void *arg,
                  st_store_scan_stats *stats)
{
    if (!dir)
        return st_error_set(ST_EINVAL, "scan: no store directory");
    parent_cb cb = {.damaged = damaged, .arg = arg};
    result_rec r;
    int rc = contained(dir, opts, 0, child_scan, &cb, &r, "the start-up scan");
    if (!rc && stats)
        *stats = r.scan;
    return rc;
}
