/*
 * st_common.h - the layer under every module: the error space, the file-system call table every
 * file write goes through, atomic file replacement, hex, little-endian loads and stores, SHA-256,
 * CPU features.
 *
 * Rules this module keeps (docs/COMMON.md):
 * 1. It depends on nothing of ours; every other module may use it (codec includes this header
 *    from st_codec.h, so everything that sees the error space sees this layer).
 * 2. Every call that writes, syncs, renames or removes a file goes through st_sys_calls, in this
 *    module and in every module above it, so one table of fault injection reaches every write.
 *    Production code never changes the table; tests replace an entry (st_sys_calls.fsync = f, or
 *    st_sys_set("fsync", f)) and put it back (st_sys_set(name, NULL), st_sys_reset()).
 * 3. A file is replaced atomically in one way: st_replace_begin / st_replace_commit (or the one-shot
 *    st_replace_file): temp file in the same directory, write, fsync, close, rename, fsync of the
 *    directory; every step's result is checked; on a failure before the rename the temp file is
 *    removed and the target is untouched.
 *
 * Errors: functions return int, 0 on success, a positive errno value for system errors, or a
 * negative ST_E* code. The ST_E* values are part of the project's contract and are never
 * renumbered. A function that fails may also record a detail string on the calling thread
 * ("section KV 3: length 4096 exceeds the 100 bytes that remain"); st_errdetail() returns it
 * until the next error recorded on that thread.
 */
#ifndef ST_COMMON_H
#define ST_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- errors ----------------------------------------------------------------------------- */

#define ST_ECORRUPT   (-4001) /* stored or received bytes fail a check (checksum, structure) */
#define ST_EVERSION   (-4002) /* a format or schema version this build does not know */
#define ST_EGEOMETRY  (-4003) /* state geometry does not match */
#define ST_ECODEC     (-4004) /* unknown codec id, or a conversion a codec cannot do */
#define ST_ETOOBIG    (-4005) /* a size beyond a configured or structural limit */
#define ST_ENOTFOUND  (-4006) /* no such session, version, section, tensor ... */
#define ST_ECONFLICT  (-4007) /* expected head version is not current */
#define ST_ENOTSTRATA (-4008) /* input is not a Strata file at all (bad magic) */
#define ST_EINVAL     (-4009) /* an invalid argument or request */
#define ST_EMODEL     (-4010) /* model fingerprint does not match */
#define ST_EFULL      (-4011) /* the store's map or the disk is full */
#define ST_ELOSSY     (-4012) /* the operation would lose information (e.g. v1 from bf16 state) */
#define ST_EBUSY      (-4013) /* resource in use, retry later */
#define ST_ENOMEMGUARD (-4014) /* the memory guard refused (not enough available RAM) */
#define ST_EIO        (-4015) /* an I/O step failed in a way errno does not describe */
#define ST_EDAMAGED   (-4016) /* a stored session the start-up scan found damaged (quarantined) */
#define ST_EFIRST     (-4001)
#define ST_ELAST      (-4016)

/* Text for any return code: 0, a positive errno or an ST_E* code. Never NULL. */
const char *st_strerror(int rc);

/* The detail of the last error recorded on this thread ("" when none). Valid until the next
 * st_error_set() on this thread. */
const char *st_errdetail(void);

/* Record a detail for rc on this thread and return rc, so that code can `return st_error_set(...)`.
 * printf-style; the text is truncated at 511 bytes. The arguments may include st_errdetail() (to
 * wrap a lower layer's detail). */
int st_error_set(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Wrap the detail a lower layer recorded: the detail becomes "<fmt...>: <the detail so far>" and
 * rc is returned, so `return st_error_wrap(rc, "loading %s", path);`. The ": " is written even when
 * the detail so far is empty. Truncated at 511 bytes like st_error_set. */
int st_error_wrap(int rc, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Clear this thread's detail. */
void st_error_clear(void);

/* ---- the file-system call table ---------------------------------------------------------
 * Every call below returns what the system call returns (-1 and errno on failure), with the
 * types made uniform (modes unsigned, offsets and lengths uint64_t). The table is one global;
 * it is read without locking, so a test changes it only while no other thread does file I/O. */
typedef struct st_sys {
    int (*open)(const char *path, int flags, unsigned mode);
    int (*close)(int fd);
    ssize_t (*write)(int fd, const void *buf, size_t n);
    ssize_t (*pwrite)(int fd, const void *buf, size_t n, uint64_t off);
    int (*fsync)(int fd);        /* of files and of directories */
    int (*fdatasync)(int fd);
    int (*ftruncate)(int fd, uint64_t len);
    int (*fallocate)(int fd, uint64_t off, uint64_t len); /* mode 0: allocate, may grow the file */
    int (*rename)(const char *from, const char *to);
    int (*unlink)(const char *path);
    int (*mkdir)(const char *path, unsigned mode);
    int (*rmdir)(const char *path);
} st_sys;

/* The table every file write goes through, and the real functions (never changed). */
extern st_sys st_sys_calls;
extern const st_sys st_sys_real;

/* SQLite's xSetSystemCall, over the same table: set the entry called name ("open", "write", ...)
 * to fn, or back to the real function when fn is NULL; ST_ENOTFOUND for a name the table lacks.
 * fn must have the entry's type (cast to st_sys_fn to pass it). */
typedef void (*st_sys_fn)(void);
int st_sys_set(const char *name, st_sys_fn fn);
/* The entry called name as it is now; NULL for a name the table lacks. */
st_sys_fn st_sys_get(const char *name);
/* The name after name in the table (the first when name is NULL); NULL after the last. */
const char *st_sys_next(const char *name);
/* Every entry back to the real function. */
void st_sys_reset(void);

/* Write all n bytes (EINTR retried, short writes continued) through st_sys_calls.write, or at
 * off through st_sys_calls.pwrite: 0, or the errno (EIO when a write returned 0). No detail. */
int st_sys_write_all(int fd, const void *buf, size_t n);
int st_sys_pwrite_all(int fd, const void *buf, size_t n, uint64_t off);

/* Open the directory dir and fsync it: 0 or the errno of the failing step (no detail). */
int st_sys_fsync_dir(const char *dir);

/* ---- atomic file replacement ----------------------------------------------------------------
 * st_replace_begin creates the temp file "<path>.tmp.<pid>.<n>" next to path (n counts this
 * process's temp files from 0; st_replace_tmp_name builds the same name, for a signal handler that
 * must remove it) with O_EXCL and the given mode; the caller writes the contents to a.fd through
 * st_sys_calls (st_sys_write_all); st_replace_commit fsyncs, closes and renames it over path and
 * fsyncs the directory. A failed begin or commit records a detail naming path and the step, and
 * leaves nothing to free. st_replace_abort removes the temp file; it may be called on a handle
 * that begin failed to fill or commit already freed, and does nothing there.
 * A commit that fails after the rename (the directory's fsync) returns the error with path
 * already replaced: the new contents are in place but not known to be durable. */
typedef struct st_replace {
    int fd;    /* the temp file, open O_RDWR; -1 when none */
    char *tmp; /* its name */
    char *dir; /* the directory of path */
} st_replace;

int st_replace_begin(st_replace *a, const char *path, unsigned mode);
int st_replace_commit(st_replace *a, const char *path);
void st_replace_abort(st_replace *a);
/* The whole file at once: begin, write len bytes of buf, commit (mode 0666 before the umask). */
int st_replace_file(const char *path, const void *buf, size_t len);
/* "<path>.tmp.<pid>.<n>" into dst; 0, or ST_EINVAL when it does not fit in cap (no detail). */
int st_replace_tmp_name(char *dst, size_t cap, const char *path, long pid, unsigned n);
/* The next temp name of this process for path (its pid, the next n of the count begin uses), for
 * a temp made otherwise (a directory replaced by rename); same errors. */
int st_replace_tmp_next(char *dst, size_t cap, const char *path);

/* ---- hex ------------------------------------------------------------------------------------ */

/* n bytes as 2n lowercase hex digits and a NUL: dst holds 2n + 1 bytes. */
void st_hex_encode(char *dst, const uint8_t *p, size_t n);
/* Exactly 2n hex digits (either case) of s into n bytes of dst: 0, or ST_EINVAL (no detail) at a
 * character that is not a hex digit, dst then partly written. s need not be NUL-terminated. */
int st_hex_decode(uint8_t *dst, const char *s, size_t n);

/* ---- little-endian loads and stores (any alignment, any host) ------------------------------- */

static inline void st_put16(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void st_put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void st_put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t st_get16(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t st_get32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static inline uint64_t st_get64(const uint8_t *p)
{
    return (uint64_t)st_get32(p) | (uint64_t)st_get32(p + 4) << 32;
}

/* ---- SHA-256 (OpenSSL EVP) -------------------------------------------------------------------- */

#define ST_SHA256_LEN 32

/* Incremental: init, update any number of times, final (which frees the state whether it
 * succeeds or not); st_sha256_free frees a state that will not be finished (NULL-safe, and safe
 * after final). A failing update is remembered and reported by final. Errors are ST_EIO with a
 * detail naming the OpenSSL step. */
typedef struct st_sha256_ctx {
    void *ctx; /* EVP_MD_CTX */
    int failed;
} st_sha256_ctx;
int st_sha256_init(st_sha256_ctx *h);
void st_sha256_update(st_sha256_ctx *h, const void *p, size_t n);
int st_sha256_final(st_sha256_ctx *h, uint8_t out[ST_SHA256_LEN]);
void st_sha256_free(st_sha256_ctx *h);
/* One shot. */
int st_sha256(const void *p, size_t n, uint8_t out[ST_SHA256_LEN]);

/* ---- CPU features ----------------------------------------------------------------------------
 * What this CPU and its OS support (a wide register set counts only when the OS saves it), read
 * once and cached; 0 off x86-64. */
#define ST_CPU_AVX2       (1u << 0)
#define ST_CPU_F16C       (1u << 1)
#define ST_CPU_FMA        (1u << 2)
#define ST_CPU_AVX512F    (1u << 3)
#define ST_CPU_AVX512BW   (1u << 4)
#define ST_CPU_AVX512VL   (1u << 5)
#define ST_CPU_AVX512DQ   (1u << 6)
#define ST_CPU_AVX512VNNI (1u << 7)
unsigned st_cpu_features(void);
/* Whether every feature in mask is present. */
static inline int st_cpu_has(unsigned mask)
{
    return (st_cpu_features() & mask) == mask;
}

#ifdef __cplusplus
}
#endif

#endif /* ST_COMMON_H */
