/*
 * st_http.c - HTTP/1.1 server connections on libevent bufferevents, with every limit explicit.
 *
 * A connection moves through these states:
 *   HEAD     waiting for a request head. A new connection must send a complete head within
 *            head_timeout of being accepted; a kept-alive one may wait idle_timeout for the next
 *            request, then has head_timeout from its first byte. A timeout before any byte is a
 *            quiet close, after one it is 408. The head must end within max_header_bytes (431)
 *            and have at most max_headers lines (431).
 *   BODY     reading Content-Length bytes into the request's buffer, after the router accepted
 *            the head and its length; a pause longer than read_timeout, fewer than
 *            min_body_rate * body_rate_window bytes in any window (the first window is the grace
 *            period), or a body slower than body_timeout is 408.
 *   BUSY     the handler has the request (invariant 1 of st_api_int.h). The socket is still
 *            read, into the input buffer and at most BUSY_READ_MAX bytes of it, only so that the
 *            client's going away (EOF, a reset) is noticed while the request is in flight: the
 *            handler is told once (on_gone, invariant 5). Pipelined bytes wait there, unparsed;
 *            past BUSY_READ_MAX they wait in the kernel, and a close behind them goes unnoticed
 *            until the reply is written.
 *   WRITING  the reply is queued; when the output is empty the connection goes back to HEAD,
 *            or closes (Connection: close, an unread body, a refusal, shutdown).
 *   LINGER   after a refusal whose body was not read: our side is shut for writing and what the
 *            client still sends is read and dropped for a short while, so that it reads the
 *            reply instead of a reset.
 * Transfer-Encoding on a request is refused (411): a body is framed by Content-Length only, so
 * no request can be split two ways (no smuggling between a proxy and us).
 *
 * Connections that hold no request (HEAD and LINGER: idle, or a head still arriving) are
 * "idle" here and may be shed: closed to make room. Invariants:
 * 1. Each peer (an IPv4 address, or the /64 of an IPv6 address) holds at most
 *    max_connections_per_peer connections: a new one beyond sheds that peer's oldest idle
 *    connection, or is refused with 503 when it has none.
 * 2. At max_connections a new connection sheds one idle connection: the oldest of the peer
 *    that holds the most idle connections (so a peer with few is shed last: a flood from some
 *    addresses does not close a client from another). The listener is paused only while the
 *    cap is reached and no connection is idle, and resumes when one closes or becomes idle.
 * 3. Body bytes are charged as they arrive and released when their request ends. Their sum
 *    never exceeds body_budget, and bodies marked bulk (upload parts) never take more than
 *    bulk_budget of it, so that the rest stays for the bodies of other requests. A head whose
 *    Content-Length would not fit in what is free now is 503 before its body is read; a body
 *    that would overflow while it arrives is 503 then (clients retry on Retry-After).
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#include <event2/bufferevent.h>
#include <event2/listener.h>
#include <event2/util.h>

#include "st_api_int.h"

#define LINGER_MS 2000
/* the key of a peer: the family, then the IPv4 address or the first 8 bytes of an IPv6 one */
#define PEER_KEY 9
#define LINGER_MAX_BYTES (64u << 20)
/* input buffered while a request is with its handler (pipelined bytes) before reading pauses */
#define BUSY_READ_MAX (64u << 10)

typedef enum conn_state { C_HEAD, C_BODY, C_BUSY, C_WRITING, C_LINGER } conn_state;

typedef struct st_http_conn st_http_conn;
typedef struct st_http_peer st_http_peer;

struct st_http_peer {
    unsigned char key[PEER_KEY];
    uint32_t n_conns;                    /* connections open from this peer */
    uint32_t n_idle;                     /* of them idle (sheddable) */
    st_http_conn *idle_first, *idle_last;/* those, oldest first */
    st_http_peer *hnext;                 /* hash chain */
    st_http_peer *bprev, *bnext;         /* in h->by_idle[n_idle] while n_idle > 0 */
};

struct peer_list {
    st_http_peer *first, *last;
};

struct st_http_hdr {
    char *name;
    char *value;
};

struct st_http_req {
    st_http_conn *conn;
    char *head; /* the head bytes, NUL-terminated, split in place */
    unsigned method;
    const char *method_name;
    char *path, *query;
    int minor; /* HTTP/1.minor */
    struct st_http_hdr *hdr;
    uint32_t n_hdr;
    uint64_t content_length;
    uint64_t charged;    /* body bytes held, charged to the budget (invariant 3) */
    int bulk;            /* charged to bulk_budget too */
    int body_unread;     /* Content-Length bytes not read: the connection cannot be reused */
    int keep_alive;
    int routed;          /* on_head was called */
    int replied;
    int streaming;       /* a streamed reply was begun (st_http_stream_begin) */
    int chunked;         /* ... framed by chunks (HTTP/1.1) rather than by the close */
    int status;
    uint64_t bytes_out;
    double t_head;
    struct evbuffer *body;
    struct evbuffer *out_hdr;
    void *user;
    st_http_error_fn error_fn; /* the body of st_http_reply_error's replies (NULL: the layer's) */
};

struct st_http_conn {
    st_http *h;
    struct bufferevent *bev;
    struct event *timer;
    conn_state state;
    st_http_req *req;
    size_t scanned;      /* head bytes already searched for its end */
    int head_started;
    int close_after;
    int dead;            /* failed while BUSY: freed by the reply */
    int gone;            /* the client went away while BUSY: on_gone was called */
    int linger_needed;
    uint64_t lingered;
    uint64_t n_served;   /* replies written: 0 while the connection is new */
    double body_deadline;
    double last_data;    /* last body bytes */
    double win_end;      /* end of the body's current rate window */
    uint64_t win_bytes;  /* body bytes in that window */
    char peer[64];
    st_http_peer *from;
    int idle;            /* in from's idle list */
    st_http_conn *prev, *next;
    st_http_conn *iprev, *inext;
};

struct st_http {
    struct event_base *base;
    struct evconnlistener *lis;
    struct event *accept_retry;
    st_http_limits lim;
    st_http_cbs cbs;
    void *arg;
    uint32_t n_conns;
    uint32_t n_idle;
    uint32_t n_peers;
    uint64_t charged, charged_bulk; /* body bytes held (invariant 3) */
    uint64_t n_shed, n_peer_refused;
    int paused;   /* listener disabled: at the connection cap with no idle connection */
    int stopping;
    uint16_t port;
    st_http_conn *conns;
    st_http_peer **peers;   /* hash table of n_buckets chains */
    uint32_t n_buckets;
    uint64_t hash_seed;
    struct peer_list *by_idle; /* peers by their idle count, 1..max_connections_per_peer */
    uint32_t max_idle;         /* highest idle count of a peer */
};

static double now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

const char *st_http_reason(int status)
{
    switch (status) {
    case 100: return "Continue";
    case 200: return "OK";
    case 201: return "Created";
    case 204: return "No Content";
    case 400: return "Bad Request";
    case 401: return "Unauthorized";
    case 403: return "Forbidden";
    case 404: return "Not Found";
    case 405: return "Method Not Allowed";
    case 408: return "Request Timeout";
    case 409: return "Conflict";
    case 410: return "Gone";
    case 411: return "Length Required";
    case 413: return "Content Too Large";
    case 414: return "URI Too Long";
    case 415: return "Unsupported Media Type";
    case 417: return "Expectation Failed";
    case 422: return "Unprocessable Content";
    case 429: return "Too Many Requests";
    case 431: return "Request Header Fields Too Large";
    case 500: return "Internal Server Error";
    case 501: return "Not Implemented";
    case 503: return "Service Unavailable";
    case 505: return "HTTP Version Not Supported";
    case 507: return "Insufficient Storage";
    default: return "Unknown";
    }
}

/* Length of the well-formed UTF-8 sequence at p (n bytes left), or 0 (RFC 3629: no overlong
 * forms, no surrogates, nothing past U+10FFFF). */
static size_t utf8_seq(const unsigned char *p, size_t n)
{
    unsigned char c = p[0];
    size_t len;
    unsigned char lo = 0x80, hi = 0xbf; /* the range of the second byte */
    if (c < 0x80)
        return 1;
    if (c >= 0xc2 && c <= 0xdf)
        len = 2;
    else if (c >= 0xe0 && c <= 0xef) {
        len = 3;
        if (c == 0xe0)
            lo = 0xa0;
        else if (c == 0xed)
            hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
        len = 4;
        if (c == 0xf0)
            lo = 0x90;
        else if (c == 0xf4)
            hi = 0x8f;
    } else
        return 0;
    if (n < len || p[1] < lo || p[1] > hi)
        return 0;
    for (size_t i = 2; i < len; i++)
        if (p[i] < 0x80 || p[i] > 0xbf)
            return 0;
    return len;
}

/* s with every byte that is not part of well-formed UTF-8 written as the four characters \xNN:
 * JSON can carry it, and the message still shows what was sent. NULL when out of memory. */
char *st_http_utf8_escape(const char *s)
{
    const unsigned char *p = (const unsigned char *)s;
    size_t n = strlen(s), o = 0;
    char *out = malloc(4 * n + 1);
    if (!out)
        return NULL;
    for (size_t i = 0; i < n;) {
        size_t k = utf8_seq(p + i, n - i);
        if (k) {
            memcpy(out + o, p + i, k);
            o += k;
            i += k;
        } else {
            o += (size_t)sprintf(out + o, "\\x%02x", p[i]);
            i++;
        }
    }
    out[o] = '\0';
    return out;
}

char *st_http_error_body(const char *code, const char *message, size_t *len)
{
    char *m = st_http_utf8_escape(message ? message : "");
    json_t *o = m ? json_pack("{s:{s:s,s:s}}", "error", "code", code ? code : "error", "message", m)
                  : NULL;
    char *s = o ? json_dumps(o, JSON_COMPACT) : NULL;
    json_decref(o);
    free(m);
    if (!s) { /* no memory: a fixed body */
        s = strdup("{\"error\":{\"code\":\"internal\",\"message\":\"no memory for the error text\"}}");
        if (!s)
            return NULL;
    }
    *len = strlen(s);
    return s;
}

/* ---- requests ----------------------------------------------------------------------------- */

static void req_free(st_http *h, st_http_req *r)
{
    if (!r)
        return;
    if (h) { /* NULL: a request of st_http_head_parse, which has no connection */
        if (r->user && h->cbs.free_user)
            h->cbs.free_user(r->user, h->arg);
        h->charged -= r->charged;
        if (r->bulk)
            h->charged_bulk -= r->charged;
    }
    free(r->head);
    free(r->hdr);
    if (r->body)
        evbuffer_free(r->body);
    if (r->out_hdr)
        evbuffer_free(r->out_hdr);
    free(r);
}

static st_http_req *req_new(st_http_conn *c)
{
    st_http_req *r = calloc(1, sizeof *r);
    if (!r)
        return NULL;
    r->conn = c;
    r->minor = 1;
    r->method_name = "-";
    r->out_hdr = evbuffer_new();
    if (!r->out_hdr) {
        free(r);
        return NULL;
    }
    r->t_head = now_ms();
    return r;
}

unsigned st_http_req_method(const st_http_req *r) { return r->method; }
const char *st_http_req_method_name(const st_http_req *r) { return r->method_name; }
const char *st_http_req_path(const st_http_req *r) { return r->path ? r->path : "-"; }
const char *st_http_req_query(const st_http_req *r) { return r->query; }
struct evbuffer *st_http_req_body(st_http_req *r) { return r->body; }
uint64_t st_http_req_body_len(const st_http_req *r) { return r->body ? evbuffer_get_length(r->body) : 0; }
double st_http_req_elapsed_ms(const st_http_req *r) { return now_ms() - r->t_head; }
int st_http_req_status(const st_http_req *r) { return r->status; }
uint64_t st_http_req_bytes_out(const st_http_req *r) { return r->bytes_out; }
const char *st_http_req_peer(const st_http_req *r) { return r->conn->peer; }
void st_http_req_set_user(st_http_req *r, void *user) { r->user = user; }
void *st_http_req_user(const st_http_req *r) { return r->user; }
void st_http_req_set_bulk(st_http_req *r) { r->bulk = 1; }
void st_http_req_set_error_fn(st_http_req *r, st_http_error_fn fn) { r->error_fn = fn; }

const char *st_http_req_header(const st_http_req *r, const char *name)
{
    for (uint32_t i = 0; i < r->n_hdr; i++)
        if (!strcasecmp(r->hdr[i].name, name))
            return r->hdr[i].value;
    return NULL;
}

/* ---- peers and idle connections (invariants 1, 2) ------------------------------------------ */

static void peer_key(const struct sockaddr *sa, unsigned char key[PEER_KEY])
{
    static const unsigned char v4mapped[12] = {0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff};
    memset(key, 0, PEER_KEY);
    if (sa->sa_family == AF_INET) {
        key[0] = 4;
        memcpy(key + 1, &((const struct sockaddr_in *)sa)->sin_addr, 4);
    } else if (sa->sa_family == AF_INET6) {
        const unsigned char *a = ((const struct sockaddr_in6 *)sa)->sin6_addr.s6_addr;
        if (!memcmp(a, v4mapped, sizeof v4mapped)) {
            key[0] = 4;
            memcpy(key + 1, a + 12, 4);
        } else {
            key[0] = 6;
            memcpy(key + 1, a, 8); /* the /64: one host usually holds all of it */
        }
    }
}

static uint32_t peer_hash(const st_http *h, const unsigned char *key)
{
    uint64_t x = 0xcbf29ce484222325ull ^ h->hash_seed; /* FNV-1a, seeded per server */
    for (int i = 0; i < PEER_KEY; i++)
        x = (x ^ key[i]) * 0x100000001b3ull;
    return (uint32_t)(x ^ (x >> 32)) & (h->n_buckets - 1);
}

/* The peer of key, created when it has no connection yet; NULL when out of memory. */
static st_http_peer *peer_get(st_http *h, const unsigned char *key)
{
    uint32_t b = peer_hash(h, key);
    for (st_http_peer *p = h->peers[b]; p; p = p->hnext)
        if (!memcmp(p->key, key, PEER_KEY))
            return p;
    st_http_peer *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    memcpy(p->key, key, PEER_KEY);
    p->hnext = h->peers[b];
    h->peers[b] = p;
    h->n_peers++;
    return p;
}

/* Forget p once it has no connection left. */
static void peer_put(st_http *h, st_http_peer *p)
{
    if (p->n_conns)
        return;
    for (st_http_peer **pp = &h->peers[peer_hash(h, p->key)]; *pp; pp = &(*pp)->hnext)
        if (*pp == p) {
            *pp = p->hnext;
            break;
        }
    h->n_peers--;
    free(p);
}

static void by_idle_unlink(st_http *h, st_http_peer *p)
{
    struct peer_list *l = &h->by_idle[p->n_idle];
    if (p->bprev)
        p->bprev->bnext = p->bnext;
    else
        l->first = p->bnext;
    if (p->bnext)
        p->bnext->bprev = p->bprev;
    else
        l->last = p->bprev;
    p->bprev = p->bnext = NULL;
}

static void by_idle_append(st_http *h, st_http_peer *p)
{
    struct peer_list *l = &h->by_idle[p->n_idle];
    p->bnext = NULL;
    p->bprev = l->last;
    if (l->last)
        l->last->bnext = p;
    else
        l->first = p;
    l->last = p;
    if (p->n_idle > h->max_idle)
        h->max_idle = p->n_idle;
}

/* c holds no request now (HEAD or LINGER): it may be shed. */
static void idle_enter(st_http_conn *c)
{
    st_http *h = c->h;
    st_http_peer *p = c->from;
    if (c->idle)
        return;
    if (p->n_idle)
        by_idle_unlink(h, p);
    p->n_idle++;
    by_idle_append(h, p);
    c->inext = NULL;
    c->iprev = p->idle_last;
    if (p->idle_last)
        p->idle_last->inext = c;
    else
        p->idle_first = c;
    p->idle_last = c;
    c->idle = 1;
    h->n_idle++;
    if (h->paused && !h->stopping) { /* a new connection can shed this one */
        evconnlistener_enable(h->lis);
        h->paused = 0;
    }
}

static void idle_leave(st_http_conn *c)
{
    st_http *h = c->h;
    st_http_peer *p = c->from;
    if (!c->idle)
        return;
    if (c->iprev)
        c->iprev->inext = c->inext;
    else
        p->idle_first = c->inext;
    if (c->inext)
        c->inext->iprev = c->iprev;
    else
        p->idle_last = c->iprev;
    c->iprev = c->inext = NULL;
    by_idle_unlink(h, p);
    if (!h->by_idle[p->n_idle].first && h->max_idle == p->n_idle)
        h->max_idle--; /* p itself is at max_idle - 1 now */
    p->n_idle--;
    if (p->n_idle)
        by_idle_append(h, p);
    c->idle = 0;
    h->n_idle--;
    if (h->n_conns >= h->lim.max_connections && !h->n_idle && !h->paused) {
        /* at the cap with nothing to shed, new connections wait in the kernel's backlog */
        evconnlistener_disable(h->lis);
        h->paused = 1;
    }
}

/* The connection to shed for a new one: the oldest idle one of the peer with the most. */
static st_http_conn *shed_victim(const st_http *h)
{
    return h->max_idle ? h->by_idle[h->max_idle].first->idle_first : NULL;
}

/* ---- connections -------------------------------------------------------------------------- */

static void conn_arm(st_http_conn *c, double ms)
{
    if (ms < 1)
        ms = 1;
    struct timeval tv = {(time_t)(ms / 1000), (suseconds_t)((long)ms % 1000) * 1000};
    evtimer_add(c->timer, &tv);
}

static void conn_free(st_http_conn *c)
{
    st_http *h = c->h;
    idle_leave(c);
    c->from->n_conns--;
    peer_put(h, c->from);
    if (c->prev)
        c->prev->next = c->next;
    else
        h->conns = c->next;
    if (c->next)
        c->next->prev = c->prev;
    req_free(h, c->req);
    if (c->bev)
        bufferevent_free(c->bev);
    if (c->timer)
        event_free(c->timer);
    free(c);
    h->n_conns--;
    if (h->paused && !h->stopping && h->n_conns < h->lim.max_connections) {
        evconnlistener_enable(h->lis);
        h->paused = 0;
    }
}

static void conn_try_head(st_http_conn *c);

static void reply_done(st_http_conn *c)
{
    st_http *h = c->h;
    req_free(h, c->req);
    c->req = NULL;
    c->n_served++;
    if (c->close_after) {
        if (c->linger_needed) {
            int fd = (int)bufferevent_getfd(c->bev);
            if (fd >= 0)
                shutdown(fd, SHUT_WR);
            c->state = C_LINGER;
            c->lingered = 0;
            evbuffer_drain(bufferevent_get_input(c->bev),
                           evbuffer_get_length(bufferevent_get_input(c->bev)));
            bufferevent_enable(c->bev, EV_READ);
            conn_arm(c, LINGER_MS);
            idle_enter(c);
            return;
        }
        conn_free(c);
        return;
    }
    c->state = C_HEAD;
    c->scanned = 0;
    c->head_started = 0;
    bufferevent_setwatermark(c->bev, EV_READ, 0, 0);
    conn_arm(c, h->lim.idle_timeout_ms);
    bufferevent_enable(c->bev, EV_READ);
    idle_enter(c);
    if (evbuffer_get_length(bufferevent_get_input(c->bev)))
        conn_try_head(c);
}

static void write_cb(struct bufferevent *bev, void *arg)
{
    st_http_conn *c = arg;
    if (c->state == C_WRITING)
        reply_done(c);
}

/* Common head of every reply; the body follows, then reply_end. A streamed reply (r->streaming)
 * has no Content-Length: chunks on HTTP/1.1, the close on HTTP/1.0. */
static struct evbuffer *reply_begin(st_http_req *r, int status, const char *ctype, uint64_t len)
{
    st_http_conn *c = r->conn;
    st_http *h = c->h;
    r->replied = 1;
    r->status = status;
    int keep = r->keep_alive && !r->body_unread && !c->close_after && !h->stopping && status != 408 &&
               (!r->streaming || r->minor >= 1);
    c->close_after = !keep;
    if (r->body_unread)
        c->linger_needed = 1;
    struct evbuffer *out = bufferevent_get_output(c->bev);
    size_t before = evbuffer_get_length(out);
    if (r->streaming) {
        r->chunked = r->minor >= 1;
        evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\n%sCache-Control: no-store\r\n",
                            status, st_http_reason(status), ctype,
                            r->chunked ? "Transfer-Encoding: chunked\r\n" : "");
    } else {
        evbuffer_add_printf(out, "HTTP/1.1 %d %s\r\nContent-Type: %s\r\nContent-Length: %llu\r\n"
                                 "Cache-Control: no-store\r\n",
                            status, st_http_reason(status), ctype, (unsigned long long)len);
    }
    if (!keep)
        evbuffer_add_printf(out, "Connection: close\r\n");
    else if (r->minor == 0)
        evbuffer_add_printf(out, "Connection: keep-alive\r\n");
    evbuffer_add_buffer(out, r->out_hdr);
    evbuffer_add(out, "\r\n", 2);
    r->bytes_out = evbuffer_get_length(out) - before + len;
    return out;
}

static void reply_end(st_http_req *r)
{
    st_http_conn *c = r->conn;
    st_http *h = c->h;
    evtimer_del(c->timer);
    if (r->routed) {
        if (h->cbs.on_done)
            h->cbs.on_done(r, h->arg);
    } else if (h->cbs.on_refused) {
        h->cbs.on_refused(r->status, "", h->arg);
    }
    if (c->dead) {
        conn_free(c);
        return;
    }
    c->state = C_WRITING;
    idle_leave(c);
    bufferevent_disable(c->bev, EV_READ);
    bufferevent_enable(c->bev, EV_WRITE);
}

static int reply_check(st_http_req *r)
{
    if (r->replied) {
        fprintf(stderr, "strata-server: internal error: second reply to %s %s\n",
                r->method_name, st_http_req_path(r));
        return -1;
    }
    return 0;
}

/* A reply to a connection that is already gone: nothing is sent, the request is finished as if
 * it had been. Returns 1 then, else 0. */
static int reply_to_dead(st_http_req *r, int status)
{
    if (!r->conn->dead)
        return 0;
    r->replied = 1;
    r->status = status;
    reply_end(r);
    return 1;
}

void st_http_header_add(st_http_req *r, const char *name, const char *value)
{
    if (strpbrk(name, "\r\n:") || strpbrk(value, "\r\n"))
        return;
    evbuffer_add_printf(r->out_hdr, "%s: %s\r\n", name, value);
}

void st_http_reply_buf(st_http_req *r, int status, const char *ctype, const void *data, size_t len)
{
    if (reply_check(r))
        return;
    if (reply_to_dead(r, status))
        return;
    struct evbuffer *out = reply_begin(r, status, ctype, len);
    if (len)
        evbuffer_add(out, data, len);
    reply_end(r);
}

void st_http_reply_evbuf(st_http_req *r, int status, const char *ctype, struct evbuffer *body)
{
    if (reply_check(r))
        return;
    if (reply_to_dead(r, status))
        return;
    struct evbuffer *out = reply_begin(r, status, ctype, evbuffer_get_length(body));
    evbuffer_add_buffer(out, body);
    reply_end(r);
}

void st_http_reply_file(st_http_req *r, int status, const char *ctype, int fd, uint64_t len)
{
    if (reply_check(r)) {
        close(fd);
        return;
    }
    struct evbuffer_file_segment *seg = NULL;
    if (!r->conn->dead && len > 0) {
        seg = evbuffer_file_segment_new(fd, 0, (ev_off_t)len, EVBUF_FS_CLOSE_ON_FREE);
        if (!seg) {
            close(fd);
            st_http_reply_error(r, 500, "internal", "cannot stream the file");
            return;
        }
    } else {
        close(fd);
    }
    if (reply_to_dead(r, status))
        return;
    struct evbuffer *out = reply_begin(r, status, ctype, len);
    if (seg) {
        if (evbuffer_add_file_segment(out, seg, 0, (ev_off_t)len) != 0) {
            /* the head is queued already: the reply cannot change, the connection must go */
            r->conn->close_after = 1;
            r->conn->dead = 1;
        }
        evbuffer_file_segment_free(seg);
    }
    reply_end(r);
}

void st_http_reply_none(st_http_req *r, int status)
{
    if (reply_check(r))
        return;
    r->conn->close_after = 1;
    r->conn->dead = 1;
    r->replied = 1;
    r->status = status;
    reply_end(r); /* frees the connection: nothing was queued on it */
}

void st_http_stream_begin(st_http_req *r, int status, const char *ctype)
{
    if (reply_check(r))
        return;
    r->streaming = 1;
    if (r->conn->dead) {
        r->replied = 1;
        r->status = status;
        return;
    }
    reply_begin(r, status, ctype, 0);
    bufferevent_enable(r->conn->bev, EV_WRITE);
}

void st_http_stream_write(st_http_req *r, struct evbuffer *data)
{
    size_t n = evbuffer_get_length(data);
    if (!r->streaming || r->conn->dead || n == 0) {
        evbuffer_drain(data, n);
        return;
    }
    struct evbuffer *out = bufferevent_get_output(r->conn->bev);
    if (r->chunked)
        evbuffer_add_printf(out, "%zx\r\n", n);
    evbuffer_add_buffer(out, data);
    if (r->chunked)
        evbuffer_add(out, "\r\n", 2);
    r->bytes_out += n + (r->chunked ? 16 : 0);
}

void st_http_stream_end(st_http_req *r, int abort_status)
{
    st_http_conn *c = r->conn;
    if (!r->streaming)
        return;
    if (abort_status) { /* the client went away: the connection goes, nothing more is sent */
        c->close_after = 1;
        c->dead = 1;
        r->status = abort_status;
    }
    int dead = c->dead;
    struct evbuffer *out = dead ? NULL : bufferevent_get_output(c->bev);
    if (out && r->chunked)
        evbuffer_add(out, "0\r\n\r\n", 5);
    int empty = !out || evbuffer_get_length(out) == 0;
    reply_end(r); /* frees a dead connection */
    if (!dead && empty)
        reply_done(c); /* nothing left to write: no write callback will come */
}

void st_http_reply_json(st_http_req *r, int status, json_t *body)
{
    char *s = body ? json_dumps(body, ST_API_JSON_FLAGS) : NULL;
    json_decref(body);
    if (!s) {
        st_http_reply_error(r, 500, "internal", "reply not encodable");
        return;
    }
    size_t n = strlen(s);
    s[n] = '\n'; /* the NUL becomes a newline: easier on a terminal */
    st_http_reply_buf(r, status, "application/json", s, n + 1);
    free(s);
}

void st_http_reply_error(st_http_req *r, int status, const char *code, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    size_t len = 0;
    char *s = r->error_fn ? r->error_fn(status, code, msg, &len) : st_http_error_body(code, msg, &len);
    if (!s) {
        st_http_reply_buf(r, status, "application/json", "{}", 2);
        return;
    }
    char *t = realloc(s, len + 2);
    if (t) {
        s = t;
        s[len++] = '\n';
    }
    st_http_reply_buf(r, status, "application/json", s, len);
    free(s);
}

/* Refuse what arrives on c before or while its request is routed. */
static void conn_refuse(st_http_conn *c, int status, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void conn_refuse(st_http_conn *c, int status, const char *code, const char *fmt, ...)
{
    if (!c->req && !(c->req = req_new(c))) {
        conn_free(c);
        return;
    }
    st_http_req *r = c->req;
    r->keep_alive = 0;
    c->linger_needed = 1;
    c->close_after = 1;
    bufferevent_disable(c->bev, EV_READ);
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (status == 503)
        st_http_header_add(r, "Retry-After", "1");
    st_http_reply_error(r, status, code, "%s", msg);
}

/* ---- head parsing ------------------------------------------------------------------------- */

static int is_tchar(unsigned char ch)
{
    return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
           (ch && strchr("!#$%&'*+-.^_`|~", ch));
}

static int token_list_has(const char *v, const char *tok)
{
    size_t tl = strlen(tok);
    while (*v) {
        while (*v == ' ' || *v == '\t' || *v == ',')
            v++;
        const char *e = v;
        while (*e && *e != ',')
            e++;
        const char *t = e;
        while (t > v && (t[-1] == ' ' || t[-1] == '\t'))
            t--;
        if ((size_t)(t - v) == tl && !strncasecmp(v, tok, tl))
            return 1;
        v = e;
    }
    return 0;
}

static const struct {
    const char *name;
    unsigned m;
} methods[] = {{"GET", ST_HTTP_GET},   {"HEAD", ST_HTTP_HEAD},       {"POST", ST_HTTP_POST},
               {"PUT", ST_HTTP_PUT},   {"DELETE", ST_HTTP_DELETE},   {"OPTIONS", ST_HTTP_OPTIONS},
               {"PATCH", ST_HTTP_PATCH}};

/* Refuse a request head: set *code and the message, return the status. */
static int head_fail(const char **code, char *msg, size_t msg_cap, int status, const char *c,
                     const char *fmt, ...) __attribute__((format(printf, 6, 7)));
static int head_fail(const char **code, char *msg, size_t msg_cap, int status, const char *c,
                     const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, msg_cap, fmt, ap);
    va_end(ap);
    *code = c;
    return status;
}

/* Parse r->head (len bytes + NUL) in place. 0, or the status to refuse with (*code, msg). */
static int parse_head(st_http_req *r, size_t len, uint32_t max_headers, const char **code,
                      char *msg, size_t msg_cap)
{
    char *p = r->head, *end = r->head + len;
    if (memchr(p, '\0', len))
        return head_fail(code, msg, msg_cap, 400, "bad_request", "NUL byte in the request head");
    /* request line */
    char *nl = memchr(p, '\n', (size_t)(end - p));
    if (!nl)
        return head_fail(code, msg, msg_cap, 400, "bad_request", "no request line");
    *nl = '\0';
    if (nl > p && nl[-1] == '\r')
        nl[-1] = '\0';
    char *method = p, *sp1 = strchr(p, ' ');
    char *target = sp1 ? sp1 + 1 : NULL, *sp2 = target ? strchr(target, ' ') : NULL;
    char *version = sp2 ? sp2 + 1 : NULL;
    if (!sp1 || !sp2 || strchr(version, ' ') || sp1 == method || sp2 == target)
        return head_fail(code, msg, msg_cap, 400, "bad_request", "malformed request line");
    *sp1 = *sp2 = '\0';
    /* what was sent is quoted in the message (its bytes escaped where not UTF-8) */
    if (strlen(method) > 16)
        return head_fail(code, msg, msg_cap, 400, "bad_request", "malformed method \"%.16s...\"",
                         method);
    for (const char *q = method; *q; q++)
        if (!is_tchar((unsigned char)*q))
            return head_fail(code, msg, msg_cap, 400, "bad_request", "malformed method \"%s\"", method);
    r->method = ST_HTTP_OTHER;
    r->method_name = method;
    for (size_t i = 0; i < sizeof methods / sizeof methods[0]; i++)
        if (!strcmp(method, methods[i].name)) {
            r->method = methods[i].m;
            r->method_name = methods[i].name;
        }
    if (!strncmp(version, "HTTP/1.", 7) && (version[7] == '0' || version[7] == '1') && !version[8]) {
        r->minor = version[7] - '0';
    } else if (!strncmp(version, "HTTP/", 5) && version[5] >= '0' && version[5] <= '9' &&
               version[6] == '.' && version[7] >= '0' && version[7] <= '9' && !version[8]) {
        return head_fail(code, msg, msg_cap, 505, "http_version",
                         "HTTP version %s is not supported (1.0 and 1.1 are)", version + 5);
    } else {
        return head_fail(code, msg, msg_cap, 400, "bad_request",
                         "malformed HTTP version \"%.24s\" (HTTP/1.0 and HTTP/1.1 are served)", version);
    }
    if (target[0] != '/')
        return head_fail(code, msg, msg_cap, 400, "bad_request",
                         "the request target must be a path starting with '/'");
    for (const unsigned char *q = (const unsigned char *)target; *q; q++)
        if (*q < 0x21 || *q > 0x7e || *q == '#')
            return head_fail(code, msg, msg_cap, 400, "bad_request",
                             "invalid byte 0x%02x in the request target", *q);
    r->path = target;
    char *qm = strchr(target, '?');
    if (qm) {
        *qm = '\0';
        r->query = qm + 1;
    }
    /* header lines */
    p = nl + 1;
    uint32_t cap = 8;
    r->hdr = malloc(cap * sizeof *r->hdr);
    if (!r->hdr)
        return head_fail(code, msg, msg_cap, 500, "internal", "no memory");
    int have_cl = 0, have_host = 0, have_te = 0;
    while (p < end) {
        nl = memchr(p, '\n', (size_t)(end - p));
        if (!nl)
            break;
        *nl = '\0';
        if (nl > p && nl[-1] == '\r')
            nl[-1] = '\0';
        if (!*p) /* the empty line */
            break;
        if (*p == ' ' || *p == '\t')
            return head_fail(code, msg, msg_cap, 400, "bad_request",
                             "folded header lines are not accepted");
        char *colon = strchr(p, ':');
        if (!colon || colon == p)
            return head_fail(code, msg, msg_cap, 400, "bad_request", "malformed header line");
        *colon = '\0';
        for (const char *q = p; *q; q++)
            if (!is_tchar((unsigned char)*q))
                return head_fail(code, msg, msg_cap, 400, "bad_request", "malformed header name");
        char *v = colon + 1;
        while (*v == ' ' || *v == '\t')
            v++;
        char *ve = v + strlen(v);
        while (ve > v && (ve[-1] == ' ' || ve[-1] == '\t'))
            *--ve = '\0';
        for (const unsigned char *q = (const unsigned char *)v; *q; q++)
            if ((*q < 0x20 && *q != '\t') || *q == 0x7f)
                return head_fail(code, msg, msg_cap, 400, "bad_request",
                                 "control byte in header %s", p);
        if (r->n_hdr >= max_headers)
            return head_fail(code, msg, msg_cap, 431, "headers_too_large",
                             "more than %u header lines", max_headers);
        if (r->n_hdr == cap) {
            cap *= 2;
            struct st_http_hdr *t = realloc(r->hdr, cap * sizeof *t);
            if (!t)
                return head_fail(code, msg, msg_cap, 500, "internal", "no memory");
            r->hdr = t;
        }
        r->hdr[r->n_hdr].name = p;
        r->hdr[r->n_hdr].value = v;
        r->n_hdr++;
        if (!strcasecmp(p, "Content-Length")) {
            uint64_t n = 0;
            if (!*v)
                return head_fail(code, msg, msg_cap, 400, "bad_request", "empty Content-Length");
            for (const char *q = v; *q; q++) {
                if (*q < '0' || *q > '9')
                    return head_fail(code, msg, msg_cap, 400, "bad_request",
                                     "malformed Content-Length");
                if (n > (UINT64_C(1) << 60) / 10)
                    return head_fail(code, msg, msg_cap, 413, "body_too_large",
                                     "Content-Length beyond any limit");
                n = n * 10 + (uint64_t)(*q - '0');
            }
            if (have_cl && n != r->content_length)
                return head_fail(code, msg, msg_cap, 400, "bad_request",
                                 "conflicting Content-Length headers");
            have_cl = 1;
            r->content_length = n;
        } else if (!strcasecmp(p, "Transfer-Encoding")) {
            have_te = 1;
        } else if (!strcasecmp(p, "Host")) {
            if (have_host) /* RFC 9112, 3.2: which one names the target is undecidable */
                return head_fail(code, msg, msg_cap, 400, "bad_request", "more than one Host header");
            have_host = 1;
        }
        p = nl + 1;
    }
    if (have_te)
        return head_fail(code, msg, msg_cap, 411, "length_required",
                         "request bodies must be sent with Content-Length; "
                         "Transfer-Encoding is not accepted");
    if (r->minor == 1 && !have_host)
        return head_fail(code, msg, msg_cap, 400, "bad_request",
                         "HTTP/1.1 request without a Host header");
    const char *conn = st_http_req_header(r, "Connection");
    if (r->minor == 1)
        r->keep_alive = !(conn && token_list_has(conn, "close"));
    else
        r->keep_alive = conn && token_list_has(conn, "keep-alive");
    return 0;
}

int st_http_head_parse(const void *head, size_t len, uint32_t max_headers, st_http_req **out,
                       const char **code, char *msg, size_t msg_cap)
{
    *out = NULL;
    st_http_req *r = req_new(NULL);
    if (!r || !(r->head = malloc(len + 1))) {
        st_http_head_free(r);
        return head_fail(code, msg, msg_cap, 500, "internal", "no memory");
    }
    memcpy(r->head, head, len);
    r->head[len] = '\0';
    int st = parse_head(r, len, max_headers, code, msg, msg_cap);
    if (st) {
        st_http_head_free(r);
        return st;
    }
    *out = r;
    return 0;
}

void st_http_head_free(st_http_req *r) { req_free(NULL, r); }

/* ---- reading -------------------------------------------------------------------------------- */

/* Whether n more body bytes of r fit in the budgets (invariant 3). */
static int body_fits(const st_http *h, const st_http_req *r, uint64_t n)
{
    return h->charged + n <= h->lim.body_budget &&
           (!r->bulk || h->charged_bulk + n <= h->lim.bulk_budget);
}

static void body_busy(st_http_req *r, const char *when)
{
    st_http *h = r->conn->h;
    r->keep_alive = 0;
    st_http_header_add(r, "Retry-After", "1");
    st_http_reply_error(r, 503, "busy",
                        "request bodies %s would exceed %llu bytes (%s%llu held now); retry later", when,
                        (unsigned long long)(r->bulk ? h->lim.bulk_budget : h->lim.body_budget),
                        r->bulk ? "upload parts: " : "",
                        (unsigned long long)(r->bulk ? h->charged_bulk : h->charged));
}

/* The body's next deadline: a pause, the whole body, or the end of its rate window. */
static void body_arm(st_http_conn *c)
{
    double t = c->last_data + c->h->lim.read_timeout_ms;
    if (c->body_deadline < t)
        t = c->body_deadline;
    if (c->win_end < t)
        t = c->win_end;
    conn_arm(c, t - now_ms());
}

static void conn_try_body(st_http_conn *c)
{
    st_http *h = c->h;
    st_http_req *r = c->req;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    uint64_t have = evbuffer_get_length(r->body);
    uint64_t want = r->content_length - have;
    size_t avail = evbuffer_get_length(in);
    if (want && avail) {
        size_t n = avail < want ? avail : (size_t)want;
        if (!body_fits(h, r, n)) {
            body_busy(r, "being received");
            return;
        }
        evbuffer_remove_buffer(in, r->body, n);
        h->charged += n;
        if (r->bulk)
            h->charged_bulk += n;
        r->charged += n;
        c->win_bytes += n;
        c->last_data = now_ms();
        want -= n;
    }
    if (want) {
        body_arm(c);
        return;
    }
    r->body_unread = 0;
    evtimer_del(c->timer);
    c->state = C_BUSY;
    /* reading goes on, bounded, so that EOF or a reset reaches event_cb (on_gone) */
    bufferevent_setwatermark(c->bev, EV_READ, 0, BUSY_READ_MAX);
    bufferevent_enable(c->bev, EV_READ);
    h->cbs.on_request(r, h->arg);
}

static void conn_try_head(st_http_conn *c)
{
    st_http *h = c->h;
    struct evbuffer *in = bufferevent_get_input(c->bev);
    /* empty lines before a request line are allowed (RFC 9112, 2.2) */
    while (!c->head_started) {
        unsigned char ch;
        if (evbuffer_copyout(in, &ch, 1) != 1)
            return;
        if (ch != '\r' && ch != '\n')
            break;
        evbuffer_drain(in, 1);
    }
    size_t len = evbuffer_get_length(in);
    if (!len)
        return;
    if (!c->head_started) {
        c->head_started = 1;
        if (c->n_served) /* a new connection's deadline runs from its accept */
            conn_arm(c, h->lim.head_timeout_ms);
    }
    size_t lim = h->lim.max_header_bytes;
    size_t n = len < lim ? len : lim;
    const unsigned char *p = evbuffer_pullup(in, (ev_ssize_t)n);
    if (!p) {
        conn_refuse(c, 500, "internal", "no memory");
        return;
    }
    size_t endpos = 0;
    for (size_t i = c->scanned > 3 ? c->scanned - 3 : 0; i < n; i++) {
        if (p[i] != '\n')
            continue;
        if (i + 1 < n && p[i + 1] == '\n') {
            endpos = i + 2;
            break;
        }
        if (i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n') {
            endpos = i + 3;
            break;
        }
    }
    if (!endpos) {
        c->scanned = n;
        if (len >= lim)
            conn_refuse(c, 431, "headers_too_large",
                        "the request line and headers exceed %zu bytes", lim);
        return;
    }
    st_http_req *r = req_new(c);
    if (!r || !(r->head = malloc(endpos + 1))) {
        req_free(h, r);
        conn_refuse(c, 500, "internal", "no memory");
        return;
    }
    c->req = r;
    memcpy(r->head, p, endpos);
    r->head[endpos] = '\0';
    evbuffer_drain(in, endpos);
    r->t_head = now_ms();
    evtimer_del(c->timer);
    idle_leave(c);
    const char *code = "bad_request";
    char msg[256];
    int st = parse_head(r, endpos, h->lim.max_headers, &code, msg, sizeof msg);
    if (st) {
        conn_refuse(c, st, code, "%s", msg);
        return;
    }
    r->body_unread = r->content_length > 0;
    r->routed = 1;
    uint64_t body_max = 0;
    c->state = C_BODY; /* a reply from on_head comes from this state */
    bufferevent_disable(c->bev, EV_READ);
    if (h->cbs.on_head(r, &body_max, h->arg))
        return; /* replied */
    if (r->content_length > body_max) {
        r->keep_alive = 0;
        st_http_reply_error(r, 413, "body_too_large",
                            "request body of %llu bytes exceeds this route's limit of %llu",
                            (unsigned long long)r->content_length, (unsigned long long)body_max);
        return;
    }
    if (!body_fits(h, r, r->content_length)) {
        body_busy(r, "held now and this one");
        return;
    }
    if (!(r->body = evbuffer_new())) {
        r->keep_alive = 0;
        st_http_reply_error(r, 500, "internal", "no memory");
        return;
    }
    const char *expect = st_http_req_header(r, "Expect");
    if (expect && r->minor == 1) {
        if (strcasecmp(expect, "100-continue")) {
            r->keep_alive = 0;
            st_http_reply_error(r, 417, "expectation_failed", "only Expect: 100-continue is supported");
            return;
        }
        if (r->content_length > evbuffer_get_length(in))
            bufferevent_write(c->bev, "HTTP/1.1 100 Continue\r\n\r\n", 25);
    }
    double now = now_ms();
    c->body_deadline = now + h->lim.body_timeout_ms;
    c->last_data = now;
    c->win_end = now + h->lim.body_rate_window_ms;
    c->win_bytes = 0;
    bufferevent_enable(c->bev, EV_READ);
    conn_try_body(c);
}

static void read_cb(struct bufferevent *bev, void *arg)
{
    st_http_conn *c = arg;
    struct evbuffer *in = bufferevent_get_input(bev);
    switch (c->state) {
    case C_HEAD:
        conn_try_head(c);
        break;
    case C_BODY:
        conn_try_body(c);
        break;
    case C_LINGER:
        c->lingered += evbuffer_get_length(in);
        evbuffer_drain(in, evbuffer_get_length(in));
        if (c->lingered > LINGER_MAX_BYTES)
            conn_free(c);
        break;
    default:
        break; /* pipelined bytes wait */
    }
}

static void event_cb(struct bufferevent *bev, short what, void *arg)
{
    st_http_conn *c = arg;
    (void)bev;
    if (c->state == C_BUSY) {
        /* the handler owns the request (invariant 2). Either way the handler hears that the
         * client went away (invariant 5): EOF (a close, or a half-close: the two look alike
         * here) or a failed socket. A half-closed peer still gets a reply if the handler gives
         * one - every route but completions, which stop and send nothing (docs/API.md, "When
         * a client goes away"); a failed socket gets none. */
        if ((what & BEV_EVENT_EOF) && !(what & BEV_EVENT_ERROR)) {
            c->close_after = 1;
        } else {
            c->dead = 1;
            bufferevent_disable(c->bev, EV_READ | EV_WRITE);
        }
        if (!c->gone) {
            c->gone = 1;
            if (c->h->cbs.on_gone)
                c->h->cbs.on_gone(c->req, c->h->arg);
        }
        return;
    }
    conn_free(c);
}

static void timer_cb(evutil_socket_t fd, short what, void *arg)
{
    st_http_conn *c = arg;
    st_http *h = c->h;
    (void)fd;
    (void)what;
    switch (c->state) {
    case C_HEAD:
        if (!c->head_started)
            conn_free(c); /* idle keep-alive connection */
        else
            conn_refuse(c, 408, "request_timeout", "the request head did not arrive within %u ms",
                        h->lim.head_timeout_ms);
        break;
    case C_BODY: {
        double now = now_ms();
        char why[200];
        if (now >= c->body_deadline) {
            snprintf(why, sizeof why, "the request body did not arrive within %u ms",
                     h->lim.body_timeout_ms);
        } else if (now >= c->last_data + h->lim.read_timeout_ms) {
            snprintf(why, sizeof why, "the request body stalled: %u ms without data",
                     h->lim.read_timeout_ms);
        } else if (now >= c->win_end) {
            uint64_t need = ((uint64_t)h->lim.min_body_rate * h->lim.body_rate_window_ms + 999) / 1000;
            if (c->win_bytes >= need) {
                c->win_bytes = 0;
                c->win_end = now + h->lim.body_rate_window_ms;
                body_arm(c);
                break;
            }
            snprintf(why, sizeof why,
                     "the request body arrived too slowly: %llu bytes in %u ms, under the minimum of "
                     "%u bytes/s",
                     (unsigned long long)c->win_bytes, h->lim.body_rate_window_ms, h->lim.min_body_rate);
        } else {
            body_arm(c); /* woken early */
            break;
        }
        c->req->keep_alive = 0;
        st_http_reply_error(c->req, 408, "request_timeout", "%s", why);
        break;
    }
    case C_LINGER:
        conn_free(c);
        break;
    default:
        break;
    }
}

/* ---- listening ------------------------------------------------------------------------------ */

/* Refuse a connection before it has a bufferevent: a short 503 written at once (its socket
 * buffer is empty), what the client sent already read and dropped so that the close is not a
 * reset that could destroy the reply, then the close. Nothing here waits. */
static void accept_refuse(st_http *h, evutil_socket_t fd, const char *code, const char *msg)
{
    char head[256], drain[4096];
    size_t blen = 0;
    char *body = st_http_error_body(code, msg, &blen);
    int n = snprintf(head, sizeof head,
                     "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                     "Content-Length: %zu\r\nRetry-After: 1\r\nCache-Control: no-store\r\n"
                     "Connection: close\r\n\r\n",
                     body ? blen : 0);
    for (int i = 0; i < 16 && recv(fd, drain, sizeof drain, MSG_DONTWAIT) > 0; i++) {
    }
    struct iovec iov[2] = {{head, (size_t)n}, {body, body ? blen : 0}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    if (sendmsg(fd, &mh, MSG_DONTWAIT | MSG_NOSIGNAL) < 0) { /* best effort: the close says enough */
    }
    shutdown(fd, SHUT_WR);
    evutil_closesocket(fd);
    free(body);
    if (h->cbs.on_refused)
        h->cbs.on_refused(503, code, h->arg);
}

/* Close an idle connection to make room (invariants 1, 2). */
static void conn_shed(st_http_conn *c)
{
    c->h->n_shed++;
    conn_free(c);
}

static void accept_cb(struct evconnlistener *lis, evutil_socket_t fd, struct sockaddr *sa, int salen,
                      void *arg)
{
    st_http *h = arg;
    (void)lis;
    if (h->stopping) {
        evutil_closesocket(fd);
        return;
    }
    unsigned char key[PEER_KEY];
    peer_key(sa, key);
    st_http_peer *p = peer_get(h, key);
    if (!p) {
        evutil_closesocket(fd);
        return;
    }
    p->n_conns++; /* the new connection, counted first so that shedding cannot free p */
    if (p->n_conns > h->lim.max_connections_per_peer) {
        if (!p->idle_first) {
            char msg[160];
            p->n_conns--;
            h->n_peer_refused++;
            snprintf(msg, sizeof msg,
                     "this address has %u connections open, all with a request in progress "
                     "(the limit per address); retry later",
                     p->n_conns);
            peer_put(h, p);
            accept_refuse(h, fd, "too_many_connections", msg);
            return;
        }
        conn_shed(p->idle_first);
    }
    if (h->n_conns >= h->lim.max_connections) {
        st_http_conn *v = shed_victim(h);
        if (!v) { /* the listener is paused before this can happen (invariant 2) */
            p->n_conns--;
            peer_put(h, p);
            accept_refuse(h, fd, "busy", "every connection has a request in progress; retry later");
            return;
        }
        conn_shed(v);
    }
    st_http_conn *c = calloc(1, sizeof *c);
    if (!c) {
        p->n_conns--;
        peer_put(h, p);
        evutil_closesocket(fd);
        return;
    }
    c->h = h;
    c->from = p;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (!getnameinfo(sa, (socklen_t)salen, host, sizeof host, serv, sizeof serv,
                     NI_NUMERICHOST | NI_NUMERICSERV))
        snprintf(c->peer, sizeof c->peer, "%.46s:%.8s", host, serv);
    else
        snprintf(c->peer, sizeof c->peer, "?");
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    c->bev = bufferevent_socket_new(h->base, fd, BEV_OPT_CLOSE_ON_FREE);
    c->timer = evtimer_new(h->base, timer_cb, c);
    if (!c->bev || !c->timer) {
        if (c->bev)
            bufferevent_free(c->bev);
        else
            evutil_closesocket(fd);
        if (c->timer)
            event_free(c->timer);
        free(c);
        p->n_conns--;
        peer_put(h, p);
        return;
    }
    c->next = h->conns;
    if (h->conns)
        h->conns->prev = c;
    h->conns = c;
    h->n_conns++;
    struct timeval wtv = {h->lim.write_timeout_ms / 1000, (h->lim.write_timeout_ms % 1000) * 1000};
    bufferevent_set_timeouts(c->bev, NULL, &wtv);
    bufferevent_setcb(c->bev, read_cb, write_cb, event_cb, c);
    bufferevent_enable(c->bev, EV_READ);
    c->state = C_HEAD;
    idle_enter(c);
    conn_arm(c, h->lim.head_timeout_ms);
}

static void accept_retry_cb(evutil_socket_t fd, short what, void *arg)
{
    st_http *h = arg;
    (void)fd;
    (void)what;
    if (!h->stopping && !h->paused)
        evconnlistener_enable(h->lis);
}

static void accept_error_cb(struct evconnlistener *lis, void *arg)
{
    st_http *h = arg;
    int err = EVUTIL_SOCKET_ERROR();
    fprintf(stderr, "strata-server: accept: %s; pausing 200 ms\n", evutil_socket_error_to_string(err));
    evconnlistener_disable(lis);
    struct timeval tv = {0, 200000};
    evtimer_add(h->accept_retry, &tv);
}

int st_http_new(struct event_base *base, const char *host, uint16_t port,
                const st_http_limits *lim, const st_http_cbs *cbs, void *arg, st_http **out)
{
    *out = NULL;
    st_http *h = calloc(1, sizeof *h);
    struct addrinfo hints = {0}, *ai = NULL;
    int rc = 0;
    if (!h)
        return st_error_set(ENOMEM, "http: no memory");
    h->base = base;
    h->lim = *lim;
    h->cbs = *cbs;
    h->arg = arg;
    if (!h->lim.max_connections)
        h->lim.max_connections = 1;
    if (!h->lim.max_connections_per_peer || h->lim.max_connections_per_peer > h->lim.max_connections)
        h->lim.max_connections_per_peer = h->lim.max_connections;
    for (h->n_buckets = 64; h->n_buckets < h->lim.max_connections && h->n_buckets < (1u << 20);)
        h->n_buckets *= 2;
    h->peers = calloc(h->n_buckets, sizeof *h->peers);
    h->by_idle = calloc((size_t)h->lim.max_connections_per_peer + 1, sizeof *h->by_idle);
    if (!h->peers || !h->by_idle) {
        rc = st_error_set(ENOMEM, "http: no memory");
        goto fail;
    }
    evutil_secure_rng_get_bytes(&h->hash_seed, sizeof h->hash_seed);
    char ps[8];
    snprintf(ps, sizeof ps, "%u", (unsigned)port);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    int gai = getaddrinfo(host, ps, &hints, &ai);
    if (gai) {
        rc = st_error_set(ST_EINVAL, "http: cannot resolve listen address %s: %s", host,
                          gai_strerror(gai));
        goto fail;
    }
    h->lis = evconnlistener_new_bind(base, accept_cb, h,
                                     LEV_OPT_CLOSE_ON_FREE | LEV_OPT_REUSEABLE | LEV_OPT_CLOSE_ON_EXEC,
                                     512, ai->ai_addr, (int)ai->ai_addrlen);
    if (!h->lis) {
        int e = errno ? errno : EADDRINUSE;
        rc = st_error_set(e, "http: cannot listen on %s port %u: %s", host, (unsigned)port, strerror(e));
        goto fail;
    }
    evconnlistener_set_error_cb(h->lis, accept_error_cb);
    h->accept_retry = evtimer_new(base, accept_retry_cb, h);
    if (!h->accept_retry) {
        rc = st_error_set(ENOMEM, "http: no memory");
        goto fail;
    }
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(evconnlistener_get_fd(h->lis), (struct sockaddr *)&ss, &sl) == 0) {
        if (ss.ss_family == AF_INET)
            h->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
        else if (ss.ss_family == AF_INET6)
            h->port = ntohs(((struct sockaddr_in6 *)&ss)->sin6_port);
    }
    freeaddrinfo(ai);
    *out = h;
    return 0;
fail:
    if (ai)
        freeaddrinfo(ai);
    st_http_free(h);
    return rc;
}

void st_http_free(st_http *h)
{
    if (!h)
        return;
    h->stopping = 1;
    while (h->conns)
        conn_free(h->conns);
    if (h->lis)
        evconnlistener_free(h->lis);
    if (h->accept_retry)
        event_free(h->accept_retry);
    free(h->peers);
    free(h->by_idle);
    free(h);
}

uint16_t st_http_port(const st_http *h) { return h->port; }
uint32_t st_http_n_connections(const st_http *h) { return h->n_conns; }

void st_http_stats_get(const st_http *h, st_http_stats *out)
{
    out->connections = h->n_conns;
    out->idle = h->n_idle;
    out->peers = h->n_peers;
    out->body_bytes = h->charged;
    out->shed = h->n_shed;
    out->peer_refused = h->n_peer_refused;
}

void st_http_stop_accepting(st_http *h)
{
    h->stopping = 1;
    if (h->lis)
        evconnlistener_disable(h->lis);
}

uint32_t st_http_close_idle(st_http *h)
{
    uint32_t busy = 0;
    st_http_conn *c = h->conns;
    while (c) {
        st_http_conn *next = c->next;
        if (c->state == C_BUSY || c->state == C_WRITING)
            busy++;
        else
            conn_free(c);
        c = next;
    }
    return busy;
}
