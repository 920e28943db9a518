/*
 * st_route_files.c - session files over HTTP through the spool directory: the download of a
 * version as a session file (GET .../versions/{v}/file) and the resumable upload of one
 * (POST /v1/uploads, PUT .../parts/{n}, POST .../commit, DELETE).
 *
 * Invariants:
 * 1. No LMDB transaction outlives a store call, and no store call runs on the loop: a download
 *    is exported to a spool file by a worker first, then streamed from that file by the loop.
 * 2. Each upload is used by one request at a time (its busy flag, under s->uploads_mu); the list
 *    holds at most UPLOADS_MAX; one not touched for --upload-ttl-s is removed by housekeeping.
 * 3. Spool files are named <kind>-<pid>-<seq>.tmp ("up", "dl"): a restart removes those a dead
 *    process left (st_server.c, spool_clean).
 */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <unistd.h>

#include "st_api_int.h"
#include "st_file.h"
#include "st_store.h"

#define UPLOAD_ID_LEN 24

typedef struct st_upload {
    char id[UPLOAD_ID_LEN + 1];
    char path[PATH_MAX + 64];
    int fd;
    uint64_t size, prev_end; /* prev_end: size before the last part (for its retry) */
    uint32_t parts;
    double touched;
    int busy;
    struct st_upload *next;
} st_upload;

static void spool_path(st_api_server *s, const char *kind, char *dst, size_t cap)
{
    uint64_t n = ++s->seq;
    snprintf(dst, cap, "%s/%s-%d-%llu.tmp", s->spool, kind, (int)getpid(), (unsigned long long)n);
}

void st_api_h_version_file(st_api_call *c)
{
    st_api_server *s = c->srv;
    uint64_t v;
    if (st_api_parse_version(c, c->arg2, &v))
        return;
    char fmt[16] = "";
    int q = st_api_query_get(st_http_req_query(c->req), "format", fmt, sizeof fmt);
    st_file_write_opts fo = {0};
    const st_file_write_opts *fop = NULL;
    if (q < 0 || (q == 1 && strcmp(fmt, "v1") && strcmp(fmt, "v2") && strcmp(fmt, "auto"))) {
        st_api_call_error(c, 400, "invalid_param", "format must be v1, v2 or auto");
        return;
    }
    if (q == 1 && strcmp(fmt, "auto")) {
        fo.version = fmt[1] == '1' ? ST_FILE_VERSION_1 : ST_FILE_VERSION_2;
        fop = &fo;
    }
    st_version_info vi;
    int rc = st_store_version_info(s->store, c->id, v, &vi);
    if (rc) {
        st_api_call_fail(c, rc, "version");
        return;
    }
    if ((rc = st_memguard_admit(&s->guard, "download (export)", vi.logical_bytes))) {
        st_api_call_fail(c, rc, "download");
        return;
    }
    char path[PATH_MAX + 64];
    spool_path(s, "dl", path, sizeof path);
    double t0 = st_api_now_ms();
    if ((rc = st_store_export(s->store, c->id, vi.version, path, fop))) {
        st_sys_calls.unlink(path);
        st_api_call_fail(c, rc, "exporting the session file");
        return;
    }
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    struct stat sb;
    if (fd < 0 || fstat(fd, &sb) != 0) {
        rc = errno;
        if (fd >= 0)
            close(fd);
        st_sys_calls.unlink(path);
        st_api_call_error(c, 500, "internal", "reading the exported file: %s", strerror(rc));
        return;
    }
    st_sys_calls.unlink(path); /* the open descriptor keeps the bytes until the reply is sent */
    c->file_fd = fd;
    c->file_len = (uint64_t)sb.st_size;
    c->file_ctype = "application/octet-stream";
    c->status = 200;
    char disp[ST_API_ID_MAX + 80], num[32], ms[32];
    snprintf(disp, sizeof disp, "attachment; filename=\"%s-v%llu.stsf\"", c->id,
             (unsigned long long)vi.version);
    snprintf(num, sizeof num, "%llu", (unsigned long long)vi.version);
    snprintf(ms, sizeof ms, "%.3f", st_api_now_ms() - t0);
    /* headers are added on the loop: st_http_header_add is not thread-safe, but the request is
     * not touched by the loop while its job runs (invariant 1 of st_api_int.h) */
    st_http_header_add(c->req, "Content-Disposition", disp);
    st_http_header_add(c->req, "X-Strata-Version", num);
    st_http_header_add(c->req, "X-Strata-Export-Ms", ms);
    s->metrics.downloads++;
    s->metrics.download_bytes += (uint64_t)sb.st_size;
}

/* ---- uploads -------------------------------------------------------------------------------- */

#define UPLOADS_MAX 64

static st_upload *upload_find_locked(st_api_server *s, const char *id)
{
    for (st_upload *u = s->uploads; u; u = u->next)
        if (!strcmp(u->id, id))
            return u;
    return NULL;
}

static void upload_unlink_locked(st_api_server *s, st_upload *u)
{
    for (st_upload **pp = &s->uploads; *pp; pp = &(*pp)->next)
        if (*pp == u) {
            *pp = u->next;
            break;
        }
}

static void upload_destroy(st_upload *u)
{
    if (!u)
        return;
    if (u->fd >= 0)
        st_sys_calls.close(u->fd);
    st_sys_calls.unlink(u->path);
    free(u);
}

/* Take upload c->arg2 for this request (busy). NULL with the call's error set. */
static st_upload *upload_take(st_api_call *c)
{
    st_api_server *s = c->srv;
    pthread_mutex_lock(&s->uploads_mu);
    st_upload *u = upload_find_locked(s, c->arg2);
    if (u && u->busy) {
        pthread_mutex_unlock(&s->uploads_mu);
        st_api_call_error(c, 409, "busy", "upload %s is in use by another request", c->arg2);
        return NULL;
    }
    if (u)
        u->busy = 1;
    pthread_mutex_unlock(&s->uploads_mu);
    if (!u)
        st_api_call_error(c, 404, "not_found", "no upload %s", c->arg2);
    return u;
}

static void upload_give(st_api_server *s, st_upload *u)
{
    pthread_mutex_lock(&s->uploads_mu);
    u->busy = 0;
    u->touched = st_api_now_ms();
    pthread_mutex_unlock(&s->uploads_mu);
}

void st_api_h_upload_create(st_api_call *c)
{
    st_api_server *s = c->srv;
    static const char *const keys[] = {NULL};
    if (st_api_json_only(c, keys))
        return;
    st_upload *u = calloc(1, sizeof *u);
    unsigned char rnd[UPLOAD_ID_LEN / 2];
    if (!u) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    u->fd = -1;
    int rfd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (rfd < 0 || read(rfd, rnd, sizeof rnd) != (ssize_t)sizeof rnd) {
        if (rfd >= 0)
            close(rfd);
        free(u);
        st_api_call_error(c, 500, "internal", "no random bytes for an upload id");
        return;
    }
    close(rfd);
    st_hex_encode(u->id, rnd, sizeof rnd);
    snprintf(u->path, sizeof u->path, "%s/up-%s.tmp", s->spool, u->id);
    u->fd = st_sys_calls.open(u->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (u->fd < 0) {
        int e = errno;
        free(u);
        st_api_call_error(c, e == ENOSPC ? 507 : 500, e == ENOSPC ? "disk_full" : "internal",
                          "creating the upload file: %s", strerror(e));
        return;
    }
    u->touched = st_api_now_ms();
    pthread_mutex_lock(&s->uploads_mu);
    unsigned n = 0;
    for (st_upload *x = s->uploads; x; x = x->next)
        n++;
    if (n >= UPLOADS_MAX) {
        pthread_mutex_unlock(&s->uploads_mu);
        upload_destroy(u);
        st_api_call_error(c, 429, "too_many_uploads", "%d uploads are open; commit or delete one",
                          UPLOADS_MAX);
        return;
    }
    u->next = s->uploads;
    s->uploads = u;
    pthread_mutex_unlock(&s->uploads_mu);
    c->reply = json_pack("{s:s,s:i,s:I,s:I}", "upload", u->id, "next_part", 1, "max_part_bytes",
                         (json_int_t)s->cfg.max_part_bytes, "max_upload_bytes",
                         (json_int_t)s->cfg.max_upload_bytes);
    c->status = 201;
}

/* The body's segments written at off through the file-system call table (st_common.h: fault
 * injection reaches the spool): 0 or the errno. */
static int write_all_at(int fd, struct evbuffer *b, uint64_t off)
{
    size_t total = evbuffer_get_length(b);
    size_t done = 0;
    while (done < total) {
        struct evbuffer_iovec v[16];
        struct evbuffer_ptr ptr;
        evbuffer_ptr_set(b, &ptr, done, EVBUFFER_PTR_SET);
        int nv = evbuffer_peek(b, (ev_ssize_t)(total - done), &ptr, v, 16);
        if (nv <= 0)
            return EIO;
        for (int i = 0; i < nv && i < 16 && done < total; i++) {
            size_t n = v[i].iov_len < total - done ? v[i].iov_len : total - done;
            int rc = st_sys_pwrite_all(fd, v[i].iov_base, n, off + done);
            if (rc)
                return rc;
            done += n;
        }
    }
    return 0;
}

void st_api_h_upload_part(st_api_call *c)
{
    st_api_server *s = c->srv;
    uint64_t n = 0;
    const char *p = c->arg3;
    if (!*p || strlen(p) > 9)
        goto bad;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad;
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (!n)
        goto bad;
    st_upload *u = upload_take(c);
    if (!u)
        return;
    uint64_t off;
    int retry = 0;
    if (n == (uint64_t)u->parts + 1) {
        off = u->size;
    } else if (n == u->parts && u->parts > 0) {
        off = u->prev_end; /* the last part again (a retry): it replaces the previous one */
        retry = 1;
    } else {
        st_api_call_error(c, 409, "part_order", "parts go in order: expected part %u (or %u again)",
                          u->parts + 1, u->parts);
        upload_give(s, u);
        return;
    }
    struct evbuffer *b = st_http_req_body(c->req);
    uint64_t len = b ? evbuffer_get_length(b) : 0;
    if (off + len > s->cfg.max_upload_bytes) {
        st_api_call_error(c, 413, "upload_too_large", "the upload would exceed %llu bytes",
                          (unsigned long long)s->cfg.max_upload_bytes);
        upload_give(s, u);
        return;
    }
    int rc = len ? write_all_at(u->fd, b, off) : 0;
    if (!rc && st_sys_calls.ftruncate(u->fd, off + len) != 0)
        rc = errno;
    if (rc) {
        if (st_sys_calls.ftruncate(u->fd, u->size) != 0) { /* leave it as it was */
        }
        st_api_call_error(c, rc == ENOSPC ? 507 : 500, rc == ENOSPC ? "disk_full" : "internal",
                          "writing part %llu: %s", (unsigned long long)n, strerror(rc));
        upload_give(s, u);
        return;
    }
    if (!retry) {
        u->prev_end = u->size;
        u->parts++;
    }
    u->size = off + len;
    s->metrics.upload_bytes += len;
    c->reply = json_pack("{s:s,s:I,s:I,s:I,s:I}", "upload", u->id, "part", (json_int_t)n, "bytes",
                         (json_int_t)len, "size", (json_int_t)u->size, "next_part",
                         (json_int_t)u->parts + 1);
    c->status = 200;
    upload_give(s, u);
    return;
bad:
    st_api_call_error(c, 400, "invalid_param", "part numbers are integers from 1");
}

void st_api_h_upload_commit(st_api_call *c)
{
    st_api_server *s = c->srv;
    static const char *const keys[] = {"session", "label", "compress", NULL};
    const char *sid = NULL, *label = NULL;
    uint64_t compress = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "session", &sid) ||
        st_api_json_opt_str(c, "label", &label) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL))
        return;
    if (!sid || !st_api_id_valid(sid, strlen(sid))) {
        st_api_call_error(c, 400, "invalid_id", "\"session\" must be a session id (1 to %d characters "
                          "of A-Z a-z 0-9 . _ -, starting with a letter or digit)", ST_API_ID_MAX);
        return;
    }
    if (label && !st_store_id_valid(label)) {
        st_api_call_error(c, 400, "invalid_field", "\"label\" is not a valid label name");
        return;
    }
    st_upload *u = upload_take(c);
    if (!u)
        return;
    /* the import holds the file, its image and a re-encoding (to keep the exact bytes) */
    int rc = st_memguard_admit(&s->guard, "upload commit", 3 * u->size);
    if (rc) {
        st_api_call_fail(c, rc, "commit");
        upload_give(s, u);
        return;
    }
    double t0 = st_api_now_ms();
    st_put_stats ps;
    memset(&ps, 0, sizeof ps);
    st_put_opts po = {.compress = (int)compress, .label = label, .stats = &ps};
    uint64_t version = 0;
    /* st_store_import reads the whole file with st_file_read, checking every section and
     * checksum, before anything is written: a bad file never becomes a version */
    rc = st_store_import(s->store, u->path, sid, &po, &version);
    if (rc) {
        switch (rc) {
        case ST_ECORRUPT:
        case ST_ENOTSTRATA:
        case ST_EVERSION:
        case ST_ECODEC:
        case ST_EGEOMETRY:
            st_api_call_error(c, 422, "invalid_file", "the uploaded file is not a valid session file: %s",
                              st_errdetail()[0] ? st_errdetail() : st_strerror(rc));
            break;
        default:
            st_api_call_fail(c, rc, "commit");
        }
        upload_give(s, u);
        return;
    }
    uint64_t size = u->size;
    pthread_mutex_lock(&s->uploads_mu);
    upload_unlink_locked(s, u);
    pthread_mutex_unlock(&s->uploads_mu);
    upload_destroy(u);
    s->metrics.uploads++;
    s->metrics.conv.saves++;
    s->metrics.conv.save_logical_bytes += ps.logical_bytes;
    s->metrics.conv.save_new_bytes += ps.new_bytes;
    c->reply = json_pack("{s:s,s:I,s:I,s:I,s:I,s:f}", "session", sid, "version", (json_int_t)version,
                         "bytes", (json_int_t)size, "logical_bytes", (json_int_t)ps.logical_bytes,
                         "new_stored_bytes", (json_int_t)ps.new_bytes, "ms", st_api_ms(st_api_now_ms() - t0));
    c->status = 201;
}

void st_api_h_upload_delete(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_upload *u = upload_take(c);
    if (!u)
        return;
    pthread_mutex_lock(&s->uploads_mu);
    upload_unlink_locked(s, u);
    pthread_mutex_unlock(&s->uploads_mu);
    upload_destroy(u);
    c->reply = json_pack("{s:s,s:b}", "upload", c->arg2, "deleted", 1);
    c->status = 200;
}

void st_api_uploads_expire(st_api_server *s, double now, double ttl)
{
    st_upload *expired = NULL;
    pthread_mutex_lock(&s->uploads_mu);
    for (st_upload **pp = &s->uploads; *pp;) {
        st_upload *u = *pp;
        if (!u->busy && now - u->touched > ttl) {
            *pp = u->next;
            u->next = expired;
            expired = u;
        } else {
            pp = &u->next;
        }
    }
    pthread_mutex_unlock(&s->uploads_mu);
    while (expired) {
        st_upload *next = expired->next;
        upload_destroy(expired);
        expired = next;
    }
}

void st_api_uploads_free(st_api_server *s)
{
    while (s->uploads) {
        st_upload *u = s->uploads;
        s->uploads = u->next;
        upload_destroy(u);
    }
}
