/*
 * st_memguard.c - admit memory-hungry operations (parking, SAVE, RESTORE, uploads) only when
 * the available RAM covers them, and say plainly what was read. Part of the conversation
 * manager (st_conv.h).
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "st_conv.h"

static int read_meminfo(const char *path, uint64_t *avail)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return errno ? errno : EIO;
    char line[256];
    int rc = ENOENT;
    while (fgets(line, sizeof line, f)) {
        unsigned long long kib;
        if (sscanf(line, "MemAvailable: %llu kB", &kib) == 1) {
            *avail = (uint64_t)kib * 1024u;
            rc = 0;
            break;
        }
    }
    fclose(f);
    return rc;
}

int st_memguard_available(const st_memguard *g, uint64_t *avail, const char **source)
{
    if (g->meminfo_path) {
        int rc = read_meminfo(g->meminfo_path, avail);
        if (rc)
            return st_error_set(rc, "cannot read available RAM: %s has no readable MemAvailable (%s)",
                                g->meminfo_path, rc == ENOENT ? "no such line or file" : strerror(rc));
        *source = "MemAvailable";
        return 0;
    }
    int rc = read_meminfo("/proc/meminfo", avail);
    if (!rc) {
        *source = "MemAvailable";
        return 0;
    }
    long pages = sysconf(_SC_AVPHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    if (pages > 0 && psz > 0) {
        *avail = (uint64_t)pages * (uint64_t)psz;
        *source = "sysconf(_SC_AVPHYS_PAGES)";
        return 0;
    }
    return st_error_set(rc, "cannot read available RAM: /proc/meminfo has no MemAvailable (%s) and "
                            "sysconf(_SC_AVPHYS_PAGES) failed",
                        strerror(rc));
}

static double gib(uint64_t b) { return (double)b / (1024.0 * 1024.0 * 1024.0); }

int st_memguard_admit(const st_memguard *g, const char *what, uint64_t need)
{
    if (!g->enabled)
        return 0;
    uint64_t avail = 0;
    const char *src = "";
    int rc = st_memguard_available(g, &avail, &src);
    if (rc) {
        char d[600];
        snprintf(d, sizeof d, "%s", st_errdetail());
        if (g->refusals)
            (*g->refusals)++;
        return st_error_set(ST_ENOMEMGUARD,
                            "memory guard: %s of %.2f GiB refused: %s; start with --mem-guard off "
                            "to run without the guard",
                            what, gib(need), d);
    }
    uint64_t limit = need + g->reserve;
    if (limit > avail) {
        if (g->refusals)
            (*g->refusals)++;
        return st_error_set(ST_ENOMEMGUARD,
                            "memory guard: %s refused: needs %.2f GiB + %.2f GiB reserve: limit %.2f "
                            "GiB, available %.2f GiB (%s)",
                            what, gib(need), gib(g->reserve), gib(limit), gib(avail), src);
    }
    return 0;
}
