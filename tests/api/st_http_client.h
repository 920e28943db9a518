/*
 * st_http_client.h - a small blocking HTTP/1.1 client over raw sockets for the API tests and
 * bench_api: it sends exactly the bytes it is given (hostile requests included) and reads one
 * response (status, headers, Content-Length body, or up to EOF). Also: starting and stopping a
 * real strata-server process on a free loopback port.
 */
#ifndef ST_HTTP_CLIENT_H
#define ST_HTTP_CLIENT_H

#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

typedef struct st_hc_resp {
    int status;        /* 0: no response (closed, timeout) */
    char head[16384];  /* status line and headers, NUL-terminated */
    unsigned char *body;
    size_t body_len;
} st_hc_resp;

static inline double st_hc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

static inline void st_hc_resp_free(st_hc_resp *r)
{
    free(r->body);
    r->body = NULL;
    r->body_len = 0;
}

/* Connect to 127.0.0.1:port from the loopback address src (any of 127/8, e.g. "127.0.0.2", so
 * that the server sees another client address; NULL: 127.0.0.1); recv/send timeouts of
 * timeout_ms. -1 on failure. */
static inline int st_hc_connect_from(uint16_t port, const char *src, int timeout_ms)
{
    int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    struct sockaddr_in a;
    if (src) {
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        if (inet_pton(AF_INET, src, &a.sin_addr) != 1 || bind(fd, (struct sockaddr *)&a, sizeof a)) {
            close(fd);
            return -1;
        }
    }
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons(port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    struct timeval tv = {timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&a, sizeof a) != 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* Connect to 127.0.0.1:port; recv/send timeouts of timeout_ms. -1 on failure. */
static inline int st_hc_connect(uint16_t port, int timeout_ms)
{
    return st_hc_connect_from(port, NULL, timeout_ms);
}

static inline int st_hc_send(int fd, const void *buf, size_t len)
{
    const char *p = buf;
    while (len) {
        ssize_t w = send(fd, p, len, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0)
            return -1;
        p += w;
        len -= (size_t)w;
    }
    return 0;
}

/* Value of header name in r->head (first), copied into dst; NULL when absent. */
static inline const char *st_hc_header(const st_hc_resp *r, const char *name, char *dst, size_t cap)
{
    size_t nl = strlen(name);
    const char *p = strstr(r->head, "\r\n");
    while (p && p[2]) {
        p += 2;
        if (!strncasecmp(p, name, nl) && p[nl] == ':') {
            const char *v = p + nl + 1;
            while (*v == ' ')
                v++;
            const char *e = strstr(v, "\r\n");
            size_t n = e ? (size_t)(e - v) : strlen(v);
            if (n >= cap)
                n = cap - 1;
            memcpy(dst, v, n);
            dst[n] = '\0';
            return dst;
        }
        p = strstr(p, "\r\n");
    }
    return NULL;
}

/* Read one response (a 100 Continue before it is skipped). 0, or -1 when none arrived. */
static inline int st_hc_read(int fd, st_hc_resp *r)
{
    memset(r->head, 0, sizeof r->head);
    r->status = 0;
    r->body = NULL;
    r->body_len = 0;
    size_t hn = 0;
    for (;;) {
        /* byte by byte up to the end of the head: simple, and never reads past it */
        char ch;
        ssize_t n = recv(fd, &ch, 1, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return -1;
        if (hn + 1 >= sizeof r->head)
            return -1;
        r->head[hn++] = ch;
        if (hn >= 4 && !memcmp(r->head + hn - 4, "\r\n\r\n", 4)) {
            if (!strncmp(r->head, "HTTP/1.1 100", 12)) {
                hn = 0;
                memset(r->head, 0, sizeof r->head);
                continue;
            }
            break;
        }
    }
    if (sscanf(r->head, "HTTP/1.%*d %d", &r->status) != 1)
        return -1;
    char v[64];
    if (st_hc_header(r, "Content-Length", v, sizeof v)) {
        size_t len = (size_t)strtoull(v, NULL, 10);
        r->body = malloc(len + 1);
        if (!r->body)
            return -1;
        size_t got = 0;
        while (got < len) {
            ssize_t n = recv(fd, r->body + got, len - got, 0);
            if (n < 0 && errno == EINTR)
                continue;
            if (n <= 0)
                return -1;
            got += (size_t)n;
        }
        r->body[len] = '\0';
        r->body_len = len;
        return 0;
    }
    size_t cap = 4096, len = 0;
    r->body = malloc(cap + 1);
    for (;;) {
        if (len == cap) {
            unsigned char *t = realloc(r->body, 2 * cap + 1);
            if (!t)
                return -1;
            r->body = t;
            cap *= 2;
        }
        ssize_t n = recv(fd, r->body + len, cap - len, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    r->body[len] = '\0';
    r->body_len = len;
    return 0;
}

/* A request line, Host, optional extra header lines ("Name: v\r\n..."), Content-Length when a
 * body is given, and the body; sent on fd. */
static inline int st_hc_send_req(int fd, const char *method, const char *path, const char *extra,
                                 const void *body, size_t body_len)
{
    char head[8192];
    int n = snprintf(head, sizeof head, "%s %s HTTP/1.1\r\nHost: 127.0.0.1\r\n%s", method, path,
                     extra ? extra : "");
    if (body || !strcmp(method, "POST") || !strcmp(method, "PUT"))
        n += snprintf(head + n, sizeof head - (size_t)n, "Content-Length: %zu\r\n", body_len);
    n += snprintf(head + n, sizeof head - (size_t)n, "\r\n");
    if (n >= (int)sizeof head)
        return -1;
    if (st_hc_send(fd, head, (size_t)n))
        return -1;
    return body_len ? st_hc_send(fd, body, body_len) : 0;
}

/* One request on a new connection, waiting at most timeout_ms for each send and receive. 0 when
 * a response was read. */
static inline int st_hc_request_ms(uint16_t port, int timeout_ms, const char *method, const char *path,
                                   const char *extra, const void *body, size_t body_len, st_hc_resp *r)
{
    memset(r, 0, sizeof *r);
    int fd = st_hc_connect(port, timeout_ms);
    if (fd < 0)
        return -1;
    int rc = st_hc_send_req(fd, method, path, extra, body, body_len);
    if (!rc)
        rc = st_hc_read(fd, r);
    close(fd);
    return rc;
}

/* st_hc_request_ms with 30 s: requests that the server answers at once. */
static inline int st_hc_request(uint16_t port, const char *method, const char *path, const char *extra,
                                const void *body, size_t body_len, st_hc_resp *r)
{
    return st_hc_request_ms(port, 30000, method, path, extra, body, body_len, r);
}

/* JSON body shortcut. */
static inline int st_hc_json(uint16_t port, const char *method, const char *path, const char *json,
                             st_hc_resp *r)
{
    return st_hc_request(port, method, path, NULL, json, json ? strlen(json) : 0, r);
}

/* Raw bytes on a new connection; reads one response. */
static inline int st_hc_raw(uint16_t port, const void *bytes, size_t len, st_hc_resp *r)
{
    memset(r, 0, sizeof *r);
    int fd = st_hc_connect(port, 30000);
    if (fd < 0)
        return -1;
    int rc = st_hc_send(fd, bytes, len);
    if (!rc)
        rc = st_hc_read(fd, r);
    close(fd);
    return rc;
}

/* ---- a strata-server process ---------------------------------------------------------------- */

/* Servers started and not yet stopped, so that a test that fails half-way can still reap them
 * (st_hc_server_kill_all in its teardown). */
#define ST_HC_SERVERS_MAX 32
static pid_t st_hc_live[ST_HC_SERVERS_MAX];

static inline void st_hc_live_set(pid_t old, pid_t now)
{
    for (int i = 0; i < ST_HC_SERVERS_MAX; i++)
        if (st_hc_live[i] == old) {
            st_hc_live[i] = now;
            return;
        }
}

static inline void st_hc_server_kill_all(void)
{
    for (int i = 0; i < ST_HC_SERVERS_MAX; i++)
        if (st_hc_live[i] > 0) {
            kill(st_hc_live[i], SIGKILL);
            waitpid(st_hc_live[i], NULL, 0);
            st_hc_live[i] = 0;
        }
}

typedef struct st_hc_server {
    pid_t pid;
    uint16_t port;
    char ready[4400];
    char log[4400];
} st_hc_server;

/* Start bin with args (NULL-terminated, without --port/--ready-file) on a free port; the server's
 * stderr goes to log_path. 0 when it is listening. */
static inline int st_hc_server_start(st_hc_server *s, const char *bin, const char *dir,
                                     const char *log_path, const char *const *args)
{
    memset(s, 0, sizeof *s);
    snprintf(s->ready, sizeof s->ready, "%s/ready.%d", dir, (int)getpid());
    snprintf(s->log, sizeof s->log, "%s", log_path);
    unlink(s->ready);
    const char *argv[64];
    int n = 0;
    argv[n++] = bin;
    for (const char *const *a = args; *a && n < 58; a++)
        argv[n++] = *a;
    argv[n++] = "--port";
    argv[n++] = "0";
    argv[n++] = "--ready-file";
    argv[n++] = s->ready;
    argv[n] = NULL;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid == 0) {
        FILE *f = freopen(log_path, "a", stderr);
        (void)f;
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    s->pid = pid;
    st_hc_live_set(0, pid);
    /* the ready file is the event; 60 s bound a server that never gets there (a sanitizer build
     * on a loaded machine starts in seconds, not in the 20 s this once was) */
    for (double end = st_hc_now_ms() + 60000; st_hc_now_ms() < end;) {
        FILE *f = fopen(s->ready, "r");
        if (f) {
            unsigned p = 0;
            int ok = fscanf(f, "%u", &p) == 1;
            fclose(f);
            if (ok && p) {
                s->port = (uint16_t)p;
                return 0;
            }
        }
        int st;
        if (waitpid(pid, &st, WNOHANG) == pid) {
            st_hc_live_set(pid, 0);
            s->pid = 0;
            return -1;
        }
        usleep(20000);
    }
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    st_hc_live_set(pid, 0);
    s->pid = 0;
    return -1;
}

/* Stop with sig (SIGTERM: graceful; SIGKILL: a crash); returns the exit status or -1. */
static inline int st_hc_server_stop(st_hc_server *s, int sig)
{
    if (!s->pid)
        return -1;
    kill(s->pid, sig);
    int st = 0;
    waitpid(s->pid, &st, 0);
    st_hc_live_set(s->pid, 0);
    s->pid = 0;
    unlink(s->ready);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

#endif
