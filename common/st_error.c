/*
 * st_error.c - the project's error space: texts for every code and a per-thread detail string.
 * Invariant: the detail is written only through a local buffer, so any argument may be
 * st_errdetail() itself (a wrap of a lower layer's detail); it is always NUL-terminated.
 */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "st_common.h"

static _Thread_local char st_detail[512];

static const char *const st_error_text[] = {
    [-(ST_ECORRUPT) - 4001] = "corrupt data",
    [-(ST_EVERSION) - 4001] = "unsupported version",
    [-(ST_EGEOMETRY) - 4001] = "incompatible state geometry",
    [-(ST_ECODEC) - 4001] = "unknown or unsupported codec",
    [-(ST_ETOOBIG) - 4001] = "size exceeds a limit",
    [-(ST_ENOTFOUND) - 4001] = "not found",
    [-(ST_ECONFLICT) - 4001] = "version conflict",
    [-(ST_ENOTSTRATA) - 4001] = "not a Strata file",
    [-(ST_EINVAL) - 4001] = "invalid argument",
    [-(ST_EMODEL) - 4001] = "model fingerprint mismatch",
    [-(ST_EFULL) - 4001] = "store or disk full",
    [-(ST_ELOSSY) - 4001] = "operation would lose information",
    [-(ST_EBUSY) - 4001] = "resource busy",
    [-(ST_ENOMEMGUARD) - 4001] = "refused by the memory guard",
    [-(ST_EIO) - 4001] = "input/output error",
    [-(ST_EDAMAGED) - 4001] = "session damaged in the store (quarantined)",
};

const char *st_strerror(int rc)
{
    if (rc == 0)
        return "success";
    if (rc > 0)
        return strerror(rc);
    if (rc <= ST_EFIRST && rc >= ST_ELAST) {
        const char *s = st_error_text[-rc - 4001];
        if (s)
            return s;
    }
    return "unknown error";
}

const char *st_errdetail(void)
{
    return st_detail;
}

int st_error_set(int rc, const char *fmt, ...)
{
    char buf[sizeof st_detail];
    va_list ap;
    /* through a local buffer: callers may pass st_errdetail() itself as an argument, to wrap the
     * detail of a lower layer, and vsnprintf into the buffer it reads from is undefined */
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    memcpy(st_detail, buf, strlen(buf) + 1);
    return rc;
}

int st_error_wrap(int rc, const char *fmt, ...)
{
    char buf[sizeof st_detail];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    size_t k = n < 0 ? 0 : (size_t)n < sizeof buf ? (size_t)n : sizeof buf - 1;
    /* ": " and the detail so far, truncated like the rest (st_detail is not changed before this) */
    for (const char *t = ": "; *t && k + 1 < sizeof buf; t++)
        buf[k++] = *t;
    for (const char *t = st_detail; *t && k + 1 < sizeof buf; t++)
        buf[k++] = *t;
    buf[k] = '\0';
    memcpy(st_detail, buf, k + 1);
    return rc;
}

void st_error_clear(void)
{
    st_detail[0] = '\0';
}
