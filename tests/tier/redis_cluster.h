/*
 * redis_cluster.h - real Redis servers on loopback for the tier's tests: a cluster of masters and
 * replicas made with `redis-cli --cluster create`, or one server without cluster mode. Debian's
 * redis-server and redis-cli (`make deps` installs them); a test that cannot start them fails.
 * Each server runs in the foreground as a child of the test, with no persistence, `noeviction`
 * and a node timeout of 1 s (so a failover takes a few seconds), and is killed with SIGKILL.
 */
#ifndef REDIS_CLUSTER_H
#define REDIS_CLUSTER_H

#include <errno.h>
#include <signal.h>
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "st_test_util.h"

extern char **environ;

#define RC_MAX 8

typedef struct rc_cluster {
    int n;
    int port[RC_MAX];
    pid_t pid[RC_MAX];
    char dir[1024];
} rc_cluster;

static inline void rc_sleep_ms(unsigned ms)
{
    struct timespec ts = {(time_t)(ms / 1000), (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static inline redisReply *rc_cmd(int port, const char *fmt, ...)
{
    struct timeval tv = {2, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return NULL;
    }
    va_list ap;
    va_start(ap, fmt);
    redisReply *r = redisvCommand(c, fmt, ap);
    va_end(ap);
    redisFree(c);
    return r;
}

/* Whether the server at port answers a command whose reply contains want. */
static inline int rc_reply_has(int port, const char *cmd, const char *want)
{
    redisReply *r = rc_cmd(port, cmd);
    int ok = r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS) && strstr(r->str, want);
    if (r)
        freeReplyObject(r);
    return ok;
}

static inline pid_t rc_spawn_server(const rc_cluster *rc, int port, int cluster)
{
    char sport[16], conf[1200], logf[1200], dir[1100];
    snprintf(sport, sizeof sport, "%d", port);
    snprintf(dir, sizeof dir, "%s/%d", rc->dir, port);
    snprintf(conf, sizeof conf, "%s/nodes.conf", dir);
    snprintf(logf, sizeof logf, "%s/redis.log", dir);
    char cmd[1200];
    snprintf(cmd, sizeof cmd, "mkdir -p '%s'", dir);
    if (system(cmd) != 0)
        return -1;
    const char *argv[] = {"redis-server", "--port", sport, "--bind", "127.0.0.1",
                          "--protected-mode", "no", "--save", "", "--appendonly", "no",
                          "--dir", dir, "--logfile", logf, "--maxmemory-policy", "noeviction",
                          "--cluster-enabled", cluster ? "yes" : "no",
                          cluster ? "--cluster-config-file" : NULL, conf,
                          "--cluster-node-timeout", "1000", NULL};
    pid_t pid = -1;
    if (posix_spawnp(&pid, "redis-server", NULL, NULL, (char *const *)argv, environ) != 0)
        return -1;
    return pid;
}

/* Waits until every server answers PING; 0, or -1 after 10 s. */
static inline int rc_wait_up(const rc_cluster *rc)
{
    for (int t = 0; t < 200; t++) {
        int up = 0;
        for (int i = 0; i < rc->n; i++)
            up += rc->pid[i] > 0 ? rc_reply_has(rc->port[i], "PING", "PONG") : 1;
        if (up == rc->n)
            return 0;
        rc_sleep_ms(50);
    }
    return -1;
}

static inline void rc_stop(rc_cluster *rc)
{
    for (int i = 0; i < rc->n; i++)
        if (rc->pid[i] > 0) {
            kill(rc->pid[i], SIGKILL);
            waitpid(rc->pid[i], NULL, 0);
            rc->pid[i] = -1;
        }
}

/* Kills server i with SIGKILL (a crash). */
static inline void rc_kill(rc_cluster *rc, int i)
{
    if (rc->pid[i] > 0) {
        kill(rc->pid[i], SIGKILL);
        waitpid(rc->pid[i], NULL, 0);
        rc->pid[i] = -1;
    }
}

/* n servers from a free base port under dir; cluster: masters = n / (replicas + 1), made with
 * redis-cli --cluster create. 0, or -1 with a line on stderr. */
static inline int rc_start(rc_cluster *rc, const char *dir, int n, int cluster, int replicas)
{
    memset(rc, 0, sizeof *rc);
    snprintf(rc->dir, sizeof rc->dir, "%s", dir);
    rc->n = n;
    for (int attempt = 0; attempt < 8; attempt++) {
        /* below the ephemeral range (32768 up, where the tests' own client connections wait
         * in TIME_WAIT), a node's cluster bus (its port + 10000) included */
        int base = 12000 + (int)(((unsigned)getpid() * 7919u + (unsigned)attempt * 131u) % 2600u) * 4;
        for (int i = 0; i < n; i++) {
            rc->port[i] = base + i;
            rc->pid[i] = rc_spawn_server(rc, rc->port[i], cluster);
            if (rc->pid[i] < 0) {
                fprintf(stderr, "redis_cluster.h: cannot start redis-server (make deps installs "
                        "it): %s\n", strerror(errno));
                rc_stop(rc);
                return -1;
            }
        }
        rc_sleep_ms(100);
        int alive = 1;
        for (int i = 0; i < n; i++)
            if (waitpid(rc->pid[i], NULL, WNOHANG) == rc->pid[i]) { /* its port was taken */
                char tail[1300];
                snprintf(tail, sizeof tail, "tail -2 '%s/%d/redis.log' >&2", rc->dir, rc->port[i]);
                if (system(tail) != 0)
                    fprintf(stderr, "redis_cluster.h: no log of :%d\n", rc->port[i]);
                rc->pid[i] = -1;
                alive = 0;
            }
        if (alive && rc_wait_up(rc) == 0)
            break;
        fprintf(stderr, "redis_cluster.h: servers from port %d: %s; trying other ports\n", base,
                alive ? "not answering within 10 s" : "one exited (its port taken?)");
        rc_stop(rc);
        if (attempt == 7) {
            fprintf(stderr, "redis_cluster.h: no free ports for %d servers\n", n);
            return -1;
        }
    }
    if (!cluster)
        return 0;
    char cmd[4096], out[8192];
    int len = snprintf(cmd, sizeof cmd, "redis-cli --cluster create");
    for (int i = 0; i < n; i++)
        len += snprintf(cmd + len, sizeof cmd - (size_t)len, " 127.0.0.1:%d", rc->port[i]);
    snprintf(cmd + len, sizeof cmd - (size_t)len, " --cluster-replicas %d --cluster-yes",
             replicas);
    if (st_test_run(out, sizeof out, "%s", cmd) != 0) {
        fprintf(stderr, "redis_cluster.h: %s:\n%s\n", cmd, out);
        rc_stop(rc);
        return -1;
    }
    /* every node sees the cluster whole, and every master has its replicas in sync */
    int masters = n / (replicas + 1);
    for (int t = 0; t < 400; t++) {
        int ok = 0, synced = 0;
        for (int i = 0; i < n; i++) {
            ok += rc_reply_has(rc->port[i], "CLUSTER INFO", "cluster_state:ok");
            char want[64];
            snprintf(want, sizeof want, "connected_slaves:%d", replicas);
            synced += rc_reply_has(rc->port[i], "INFO replication", want) &&
                      !rc_reply_has(rc->port[i], "INFO replication", "state=wait_bgsave");
        }
        if (ok == n && synced >= masters)
            return 0;
        rc_sleep_ms(50);
    }
    fprintf(stderr, "redis_cluster.h: the cluster did not become ok within 20 s\n");
    rc_stop(rc);
    return -1;
}

/* The index in rc of the master that serves slot (from CLUSTER SLOTS at any live node), -1. */
static inline int rc_master_of(const rc_cluster *rc, unsigned slot)
{
    for (int i = 0; i < rc->n; i++) {
        if (rc->pid[i] <= 0)
            continue;
        redisReply *r = rc_cmd(rc->port[i], "CLUSTER SLOTS");
        if (!r)
            continue;
        int found = -1;
        for (size_t k = 0; r->type == REDIS_REPLY_ARRAY && k < r->elements; k++) {
            redisReply *e = r->element[k];
            if ((unsigned long long)e->element[0]->integer <= slot &&
                slot <= (unsigned long long)e->element[1]->integer) {
                int port = (int)e->element[2]->element[1]->integer;
                for (int j = 0; j < rc->n; j++)
                    if (rc->port[j] == port)
                        found = j;
            }
        }
        freeReplyObject(r);
        return found;
    }
    return -1;
}

/* The node id of server i (CLUSTER MYID), in id (41 bytes). */
static inline int rc_node_id(const rc_cluster *rc, int i, char id[64])
{
    redisReply *r = rc_cmd(rc->port[i], "CLUSTER MYID");
    int ok = r && r->type == REDIS_REPLY_STRING && r->len < 64;
    if (ok)
        snprintf(id, 64, "%s", r->str);
    if (r)
        freeReplyObject(r);
    return ok ? 0 : -1;
}

/* "redis://127.0.0.1:P1,..." of the live servers (at most `seeds` of them; 0: all). */
static inline void rc_url(const rc_cluster *rc, int seeds, char *dst, size_t cap)
{
    int len = snprintf(dst, cap, "redis://");
    int k = 0;
    for (int i = 0; i < rc->n && (!seeds || k < seeds); i++)
        if (rc->pid[i] > 0)
            len += snprintf(dst + len, cap - (size_t)len, "%s127.0.0.1:%d", k++ ? "," : "",
                            rc->port[i]);
}

#endif /* REDIS_CLUSTER_H */
