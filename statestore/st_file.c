/*
 * st_file.c - the session file: writer (v1 and v2), reader, inspect. Every write goes through
 * the common layer's call table and atomic replacement (st_common.h).
 * docs/FORMAT.md describes the bytes; this file implements exactly that and nothing more. The
 * sizes, codes, geometry encoding and structural rules it applies are the format module's
 * (st_format_int.h): the reader and inspect below share every rule of the walk.
 *
 * Invariants of the reader:
 * 1. Every length read from the input is compared with the bytes that remain (in the file, or in
 *    the section) before anything is allocated for it, with overflow-safe arithmetic.
 * 2. Allocation is bounded by about twice the file size plus the decoded sizes that compressed
 *    frames declare; a frame must declare exactly its tensor's stored size, and the declared total
 *    is capped (st_file_read_opts.max_decoded_bytes). A checkpoint is one allocation (its tensors
 *    aligned within it, st_store_int.h), never one per tensor, so no file shape multiplies this.
 * 3. Sections are consumed strictly in order; each one is hashed while it is read and its
 *    checksum compared before the next begins (or, for the sections of invariant 6, before any
 *    error is reported or the image returned). The geometry and a compressed checkpoint's frames
 *    are checksummed before they are parsed, and every frame header of a checkpoint is checked
 *    before its memory is allocated and its frames decoded. When an error that damage could explain
 *    (an unknown codec) is found inside a section, the rest of the section is hashed first and a
 *    checksum mismatch is reported instead, because that is what a damaged byte really is. Memory
 *    input is checksummed whole (every section) before parsing starts.
 * 4. The image under construction belongs to the reader until the last check passes; on any error
 *    it is freed and *out stays NULL.
 * 5. Speed without weakening 3: a file of at least ST_RD_ASYNC_MIN bytes is hashed on a helper
 *    thread while the reader thread reads the next piece (ST_RD_PIECE) into its place in the
 *    image. Pieces are hashed in the order they are read, into the section's own state, and the
 *    reader waits for the helper to finish a section's bytes before it computes the checksum
 *    itself, views bytes through its own buffer or frees anything; only the reader thread
 *    touches the file. The helper is stopped and joined before the image is freed.
 * 6. With the helper, a section whose payload goes into the image unparsed (the tokens, K/V
 *    rows, a checkpoint's tensors, the logits) does not wait for its check: its final checksum
 *    is queued behind its pieces, into a check slot of its own (at most ST_RD_FINS in use; when
 *    none is free the reader waits for the helper), and the reader begins the next section.
 *    Before the reader reports any error, returns the image or takes a slot, it waits for the
 *    helper and compares; the earliest section that differs is the error (a checksum mismatch
 *    naming it), whatever was found after it, so every file gets the error it got when each
 *    section was compared before the next began. Nothing read from such a section is used
 *    before the image is returned except a checkpoint's header fields, whose errors are
 *    likewise replaced by an earlier mismatch.
 *
 * Invariants of the writer:
 * 1. The output is a function of the image and the options only: no time, no uninitialised byte.
 * 2. Memory stays bounded: st_file_write streams through a 1 MiB buffer, and the frames of
 *    compressed checkpoint tensors held at once are within ST_Z_HELD_MAX bytes of frame bounds (or
 *    one frame, when a single one is larger); a section whose length is only known at its end (a
 *    compressed checkpoint) gets its header, length and checksum written afterwards, the checksum
 *    computed by reading the payload back in bounded pieces.
 * 3. A writer that failed stays failed: the temp file is removed and the target never touched.
 * 4. Speed without changing a byte: writeback of the temp file is started every ST_WB_CHUNK bytes
 *    (sync_file_range, a hint whose failure is ignored; the fsync at the end is what makes the file
 *    durable and what is checked), and a large piece of a section is hashed on a helper thread
 *    while the writer thread writes it. Only the writer thread touches the file, so the fault
 *    injection table sees the same calls in the same order.
 * 5. Compression without changing a byte: every checkpoint tensor is one frame compressed on its
 *    own (st_frame_encode, a function of its bytes, level and shuffle width), so which thread
 *    compresses it does not matter. A helper thread starts compressing the frames, in file order,
 *    when the write begins, while the writer thread writes the sections before the checkpoints;
 *    the writer thread, when the frame it needs next is not done, compresses the next unclaimed
 *    one itself rather than wait. Frames are written in file order by the writer thread alone,
 *    each freed once written; on any failure the helper finishes the frame in hand, is joined, and
 *    every frame is freed before the writer returns.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_file.h"
#include "st_format_int.h"
#include "st_store_int.h"

/* the sizes and codes of the format: st_format_int.h */
#define ST_IO_CHUNK (1u << 20)
#define ST_WB_CHUNK (4ull << 20) /* start writeback after this many new bytes */
#define ST_WB_ALIGN 4096ull /* writeback hints cover whole pages */
#define ST_HASH_ASYNC_MIN (4u << 20) /* hash pieces at least this large on a helper thread */
#define ST_Z_HELD_MAX (64ull << 20) /* frame buffers compressed ahead of the writer, at most */
#define ST_DECODED_DEFAULT (32ull << 30)
#define ST_RD_PIECE (512u << 10) /* a file is read in pieces of this size, hashed as they arrive */
#define ST_RD_ASYNC_MIN (8u << 20) /* files at least this large are hashed on a helper thread */
#define ST_RD_QUEUE 16u /* pieces read ahead of the helper at most */
#define ST_RD_FINS 32u  /* sections whose checksum the helper may still be finishing, at most */

/* A fuzzing build (FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION, tests/fuzz/) lets the reader go on
 * past checksum mismatches so the fuzzer reaches the structure checks behind them. Checksums are
 * still computed. Never defined in a normal build. */
#ifdef FUZZING_BUILD_MODE_UNSAFE_FOR_PRODUCTION
#define ST_SUM_OK(computed, recorded) ((void)(computed), (void)(recorded), 1)
#else
#define ST_SUM_OK(computed, recorded) ((computed) == (recorded))
#endif

const char *st_section_type_name(uint32_t type)
{
    switch (type) {
    case ST_SECTION_GEOMETRY: return "GEOMETRY";
    case ST_SECTION_TOKENS: return "TOKENS";
    case ST_SECTION_KV: return "KV";
    case ST_SECTION_CHECKPOINT: return "CHECKPOINT";
    case ST_SECTION_LOGITS: return "LOGITS";
    case ST_SECTION_ARCH: return "ARCH";
    default: return "unknown";
    }
}

/* "KV[3]", "TOKENS", "type 9" */
static void st_sec_label(char *out, size_t cap, uint32_t type, uint32_t index)
{
    if (type == ST_SECTION_KV || type == ST_SECTION_CHECKPOINT)
        snprintf(out, cap, "%s[%u]", st_section_type_name(type), index);
    else if (type >= ST_SECTION_GEOMETRY && type <= ST_SECTION_ARCH)
        snprintf(out, cap, "%s", st_section_type_name(type));
    else
        snprintf(out, cap, "type %u", type);
}

/* Bytes of a checkpoint's running tensors stored uncompressed in codec. */
/* Shuffle width of a stored tensor: the stored element size. */
static unsigned st_stored_elem_size(const st_tensor_desc *t, uint32_t codec)
{
    return (unsigned)(t->dtype == ST_DTYPE_F32 ? st_codec_elem_size(codec) : st_dtype_size(t->dtype));
}

/* ==== file I/O (writes and the atomic replacement: st_sys_calls, st_replace_*, common/) ======= */

static int st_pread_all(int fd, void *p, size_t n, uint64_t off)
{
    uint8_t *b = p;
    while (n > 0) {
        ssize_t r = pread(fd, b, n, (off_t)off);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return errno ? errno : EIO;
        }
        if (r == 0)
            return ST_ECORRUPT; /* the file shrank under us */
        b += r;
        n -= (size_t)r;
        off += (uint64_t)r;
    }
    return 0;
}

int st_file_replace(const char *path, const void *buf, size_t len)
{
    return st_replace_file(path, buf, len);
}

/* ==== writer ================================================================================== */

/* Where the bytes go. Memory: buf holds the whole file. File: buf holds the bytes after
 * `flushed` that are not written yet. off == flushed + len in both cases. */
typedef struct st_sink {
    int fd;
    uint8_t *buf;
    size_t len, cap;
    uint64_t flushed;
    uint64_t off;
    uint64_t wb_started; /* file: writeback was started for [0, wb_started) */
} st_sink;

/* Start writeback of the whole pages written since the last call, once there are ST_WB_CHUNK
 * bytes of them, so the disk works while later sections are produced. A hint only: errors
 * (EINVAL, ENOSYS on file systems without it) are ignored, and the fsync at the end writes
 * whatever is left, including pages that section and file header patches dirty again. */
static void st_sink_writeback(st_sink *s)
{
#ifdef SYNC_FILE_RANGE_WRITE
    if (s->fd < 0) /* a memory sink */
        return;
    uint64_t end = s->flushed & ~(ST_WB_ALIGN - 1);
    if (end - s->wb_started >= ST_WB_CHUNK) {
        (void)sync_file_range(s->fd, (off_t)s->wb_started, (off_t)(end - s->wb_started),
                              SYNC_FILE_RANGE_WRITE);
        s->wb_started = end;
    }
#else
    (void)s;
#endif
}

static int st_sink_flush(st_sink *s)
{
    int rc;
    if (s->fd < 0 || s->len == 0)
        return 0;
    rc = st_sys_write_all(s->fd, s->buf, s->len);
    if (rc)
        return st_error_set(rc, "writing the temp file: %s", strerror(rc));
    s->flushed += s->len;
    s->len = 0;
    st_sink_writeback(s);
    return 0;
}

static int st_sink_put(st_sink *s, const void *p, size_t n)
{
    int rc;
    if (n == 0)
        return 0;
    if (s->fd < 0) {
        if (n > s->cap - s->len) {
            size_t cap = s->cap ? s->cap : 4096;
            uint8_t *nb;
            while (cap - s->len < n) {
                if (cap > SIZE_MAX / 2)
                    return st_error_set(ENOMEM, "write: output too large for memory");
                cap *= 2;
            }
            nb = realloc(s->buf, cap);
            if (!nb)
                return st_error_set(ENOMEM, "write: out of memory for %zu bytes", cap);
            s->buf = nb;
            s->cap = cap;
        }
        memcpy(s->buf + s->len, p, n);
        s->len += n;
        s->off += n;
        return 0;
    }
    if (n > s->cap - s->len) {
        rc = st_sink_flush(s);
        if (rc)
            return rc;
    }
    if (n >= s->cap) {
        rc = st_sys_write_all(s->fd, p, n);
        if (rc)
            return st_error_set(rc, "writing the temp file: %s", strerror(rc));
        s->flushed += n;
        st_sink_writeback(s);
    } else {
        memcpy(s->buf + s->len, p, n);
        s->len += n;
    }
    s->off += n;
    return 0;
}

/* Overwrite bytes already emitted at [at, at+n). */
static int st_sink_patch(st_sink *s, const void *p, size_t n, uint64_t at)
{
    const uint8_t *b = p;
    if (s->fd < 0) {
        memcpy(s->buf + at, p, n);
        return 0;
    }
    if (at < s->flushed) {
        size_t k = (size_t)(s->flushed - at < n ? s->flushed - at : n);
        int rc = st_sys_pwrite_all(s->fd, b, k, at);
        if (rc)
            return st_error_set(rc, "writing the temp file: %s", strerror(rc));
        b += k;
        n -= k;
        at += k;
    }
    if (n)
        memcpy(s->buf + (at - s->flushed), b, n);
    return 0;
}

/* Read back emitted bytes [at, at+n) into dst. */
static int st_sink_readback(st_sink *s, void *dst, size_t n, uint64_t at)
{
    int rc;
    if (s->fd < 0) {
        memcpy(dst, s->buf + at, n);
        return 0;
    }
    rc = st_sink_flush(s);
    if (rc)
        return rc;
    rc = st_pread_all(s->fd, dst, n, at);
    if (rc)
        return st_error_set(rc > 0 ? rc : ST_EIO, "reading back the temp file failed");
    return 0;
}

/* One checkpoint tensor's frame (invariant 5): claimed and compressed by the writer thread or the
 * helper, written by the writer thread in file order, then freed. */
typedef struct st_zitem {
    uint32_t ci, ti;
    size_t cost;   /* the frame's bound: its buffer's size, held against ST_Z_HELD_MAX */
    int state;     /* ST_Z_QUEUED, ST_Z_CLAIMED, ST_Z_DONE */
    int rc;        /* with ST_Z_DONE: 0, or the error, detail in err */
    uint8_t *buf;  /* with ST_Z_DONE and rc 0: the frame, len bytes */
    size_t len;
    char err[480];
} st_zitem;

enum { ST_Z_QUEUED, ST_Z_CLAIMED, ST_Z_DONE };

/* The frames of every compressed checkpoint tensor, in file order. Items are claimed in order;
 * one more may be claimed while the buffers of claimed, unwritten items stay within
 * ST_Z_HELD_MAX (or none is held), so memory stays bounded whatever runs ahead. */
typedef struct st_zpool {
    const st_image *img;
    int level, shuffle;
    st_zitem *items;
    uint32_t n, next; /* items; the next to claim */
    uint64_t held;    /* bytes of buffers claimed and not yet written */
    int stop;
    int threaded;
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv; /* an item done, bytes released, or stop */
    st_frame_ctx *ctx[2]; /* [0] the writer thread's, [1] the helper's */
} st_zpool;

typedef struct st_writer {
    const st_image *img;
    st_sink *s;
    uint32_t version;
    int level;
    int shuffle;
    st_zpool *zp;
    uint32_t zi; /* the next item of zp to write */
    st_checksum_state h;
    int hashing;
    uint64_t sec_start;
    uint8_t sec_hdr[ST_SEC_HDR_LEN];
    void (*progress)(void *, uint64_t, uint64_t);
    void *progress_arg;
    uint64_t done, total, last_report;
} st_writer;

static void st_w_progress(st_writer *w, uint64_t n, int force)
{
    w->done += n;
    if (!w->progress)
        return;
    if (force || w->done - w->last_report >= (16u << 20)) {
        w->last_report = w->done;
        w->progress(w->progress_arg, w->done < w->total ? w->done : w->total, w->total);
    }
}

/* Begin a section. length is the payload length, or UINT64_MAX when only known at its end. */
static int st_w_sec_open(st_writer *w, uint32_t type, uint32_t index, uint64_t length)
{
    int rc;
    memset(w->sec_hdr, 0, sizeof w->sec_hdr);
    st_put32(w->sec_hdr + 0, type);
    st_put32(w->sec_hdr + 4, index);
    st_put64(w->sec_hdr + 8, length == UINT64_MAX ? 0 : length);
    w->sec_start = w->s->off;
    rc = st_sink_put(w->s, w->sec_hdr, ST_SEC_HDR_LEN);
    if (rc)
        return rc;
    w->hashing = length != UINT64_MAX;
    if (w->hashing) {
        rc = st_checksum_init(&w->h);
        if (rc)
            return st_error_set(rc, "write: out of memory");
        st_checksum_update(&w->h, w->sec_hdr, ST_SEC_HASHED);
    }
    return 0;
}

typedef struct st_hash_job {
    st_checksum_state *h;
    const uint8_t *p;
    size_t n;
} st_hash_job;

static void *st_hash_job_run(void *arg)
{
    st_hash_job *j = arg;
    st_checksum_update(j->h, j->p, j->n);
    return NULL;
}

static int st_w_data(st_writer *w, const void *p, uint64_t n, uint64_t raw)
{
    const uint8_t *b = p;
    while (n > 0) {
        /* pieces of ST_WB_CHUNK: a long run written straight from the image still starts
         * writeback every ST_WB_CHUNK bytes (st_sink_writeback runs after each write) */
        size_t k = n > ST_WB_CHUNK ? (size_t)ST_WB_CHUNK : (size_t)n;
        st_hash_job job = {&w->h, b, k};
        pthread_t th;
        int threaded = 0, rc;

        /* the helper owns w->h until joined; the bytes hashed are the caller's, read-only */
        if (w->hashing && k >= ST_HASH_ASYNC_MIN)
            threaded = pthread_create(&th, NULL, st_hash_job_run, &job) == 0;
        rc = st_sink_put(w->s, b, k);
        if (threaded)
            pthread_join(th, NULL);
        else if (w->hashing && !rc)
            st_checksum_update(&w->h, b, k);
        if (rc)
            return rc;
        b += k;
        n -= k;
        if (raw) {
            st_w_progress(w, k, 0);
        }
    }
    return 0;
}

static int st_w_sec_close(st_writer *w)
{
    uint64_t sum;
    int rc;

    if (!w->hashing) {
        /* length known now: hash header + payload read back in bounded pieces */
        uint64_t len = w->s->off - w->sec_start - ST_SEC_HDR_LEN, at = 0;
        uint8_t *chunk = malloc(ST_IO_CHUNK);
        if (!chunk)
            return st_error_set(ENOMEM, "write: out of memory");
        st_put64(w->sec_hdr + 8, len);
        rc = st_checksum_init(&w->h);
        if (rc) {
            free(chunk);
            return st_error_set(rc, "write: out of memory");
        }
        st_checksum_update(&w->h, w->sec_hdr, ST_SEC_HASHED);
        while (at < len) {
            size_t k = len - at > ST_IO_CHUNK ? ST_IO_CHUNK : (size_t)(len - at);
            rc = st_sink_readback(w->s, chunk, k, w->sec_start + ST_SEC_HDR_LEN + at);
            if (rc) {
                free(chunk);
                st_checksum_free(&w->h);
                return rc;
            }
            st_checksum_update(&w->h, chunk, k);
            at += k;
        }
        free(chunk);
    }
    sum = st_checksum_final(&w->h);
    st_checksum_free(&w->h);
    st_put64(w->sec_hdr + 24, sum);
    return st_sink_patch(w->s, w->sec_hdr, ST_SEC_HDR_LEN, w->sec_start);
}

static int st_w_geometry(st_writer *w)
{
    const st_geometry *g = &w->img->g;
    uint8_t fixed[ST_GEOM_FIXED], rec[ST_GEOM_REC];
    int rc;

    rc = st_w_sec_open(w, ST_SECTION_GEOMETRY, 0, st_fmt_geometry_len(g->n_tensors));
    if (rc)
        return rc;
    st_fmt_geometry_fixed_put(fixed, g);
    rc = st_w_data(w, fixed, sizeof fixed, 0);
    for (uint32_t i = 0; i < g->n_tensors && !rc; i++) {
        st_fmt_tensor_put(rec, &g->tensors[i]);
        rc = st_w_data(w, rec, sizeof rec, 0);
    }
    return rc ? rc : st_w_sec_close(w);
}

/* The optional ARCH section: the architecture name, zero-padded (the image keeps it so). */
static int st_w_arch(st_writer *w)
{
    int rc = st_w_sec_open(w, ST_SECTION_ARCH, 0, ST_ARCH_NAME_MAX);
    if (!rc)
        rc = st_w_data(w, w->img->g.arch, ST_ARCH_NAME_MAX, 0);
    return rc ? rc : st_w_sec_close(w);
}

/* ---- the checkpoint frames (invariant 5) ---- */

/* Compress item it with ctx (called without the lock: the item is the caller's once claimed). */
static void st_z_encode(const st_zpool *zp, st_frame_ctx *ctx, st_zitem *it)
{
    const st_ckpt *c = &zp->img->ckpt[it->ci];
    const st_tensor_desc *t = &zp->img->tensors[it->ti];
    uint64_t n = st_tensor_stored_bytes(t, c->codec);

    it->buf = malloc(it->cost);
    if (!it->buf) {
        it->rc = ENOMEM;
        snprintf(it->err, sizeof it->err, "write: out of memory for a %zu-byte frame", it->cost);
        return;
    }
    it->rc = st_frame_encode(ctx, it->buf, it->cost, c->data + st_ckpt_offset(zp->img, c->codec, it->ti),
                             (size_t)n, zp->shuffle ? st_stored_elem_size(t, c->codec) : 0,
                             zp->level, &it->len);
    if (it->rc)
        snprintf(it->err, sizeof it->err, "write: checkpoint %u tensor %u (\"%s\"): compression failed: %s",
                 it->ci, it->ti, t->name, st_errdetail());
}

/* With the lock held: the next item, claimed, if one may be claimed now; else NULL. */
static st_zitem *st_z_claim(st_zpool *zp)
{
    st_zitem *it;
    if (zp->stop || zp->next == zp->n)
        return NULL;
    it = &zp->items[zp->next];
    /* one item at least, however large; then more only within the budget (held may exceed it
     * by that one item, so it is compared before it is subtracted) */
    if (zp->held && (zp->held >= ST_Z_HELD_MAX || it->cost > ST_Z_HELD_MAX - zp->held))
        return NULL;
    zp->next++;
    zp->held += it->cost;
    it->state = ST_Z_CLAIMED;
    return it;
}

/* Compress the claimed item it and mark it done; the lock is held on entry and on return. */
static void st_z_work(st_zpool *zp, st_zitem *it, int who)
{
    if (zp->threaded)
        pthread_mutex_unlock(&zp->mu);
    st_z_encode(zp, zp->ctx[who], it);
    if (zp->threaded)
        pthread_mutex_lock(&zp->mu);
    it->state = ST_Z_DONE;
    if (zp->threaded)
        pthread_cond_broadcast(&zp->cv);
}

static void *st_z_helper_run(void *arg)
{
    st_zpool *zp = arg;
    pthread_mutex_lock(&zp->mu);
    while (!zp->stop && zp->next < zp->n) {
        st_zitem *it = st_z_claim(zp);
        if (it)
            st_z_work(zp, it, 1);
        else
            pthread_cond_wait(&zp->cv, &zp->mu);
    }
    pthread_mutex_unlock(&zp->mu);
    return NULL;
}

/* The items of every checkpoint of the image, each tensor's size checked, and the helper started
 * when there are two or more (none, and the writer thread compresses alone, when no thread or
 * compressor can be had: the same bytes either way). */
static int st_z_start(st_writer *w)
{
    const st_image *img = w->img;
    st_zpool *zp = calloc(1, sizeof *zp);
    uint32_t n = 0;

    if (!zp)
        return st_error_set(ENOMEM, "write: out of memory for the compressor");
    w->zp = zp;
    zp->img = img;
    zp->level = w->level;
    zp->shuffle = w->shuffle;
    for (uint32_t i = 0; i < img->g.n_tensors; i++)
        n += img->tensors[i].role == ST_ROLE_RUNNING;
    if (n && img->n_ckpt > UINT32_MAX / n)
        return st_error_set(ST_ETOOBIG, "write: too many checkpoint tensors");
    zp->items = calloc((size_t)n * img->n_ckpt + 1, sizeof *zp->items);
    zp->ctx[0] = st_frame_ctx_new();
    if (!zp->items || !zp->ctx[0])
        return st_error_set(ENOMEM, "write: out of memory for the compressor");
    for (uint32_t ci = 0; ci < img->n_ckpt; ci++)
        for (uint32_t i = 0; i < img->g.n_tensors; i++) {
            uint64_t bytes = st_tensor_stored_bytes(&img->tensors[i], img->ckpt[ci].codec);
            st_zitem *it = &zp->items[zp->n];
            if (img->tensors[i].role != ST_ROLE_RUNNING)
                continue;
            it->cost = bytes > SIZE_MAX / 2 ? 0 : st_frame_bound((size_t)bytes);
            if (it->cost == 0)
                return st_error_set(ST_ETOOBIG, "write: checkpoint %u tensor %u too large to compress", ci, i);
            it->ci = ci;
            it->ti = i;
            zp->n++;
        }
    if (zp->n < 2 || !(zp->ctx[1] = st_frame_ctx_new()))
        return 0;
    if (pthread_mutex_init(&zp->mu, NULL))
        return 0;
    if (pthread_cond_init(&zp->cv, NULL)) {
        pthread_mutex_destroy(&zp->mu);
        return 0;
    }
    zp->threaded = 1;
    if (pthread_create(&zp->th, NULL, st_z_helper_run, zp)) {
        zp->threaded = 0;
        pthread_cond_destroy(&zp->cv);
        pthread_mutex_destroy(&zp->mu);
    }
    return 0;
}

/* Item k's frame (k: the next to write), compressed by the writer thread itself when it is not
 * claimed yet or another may be claimed while waiting. */
static int st_z_take(st_zpool *zp, uint32_t k, const uint8_t **frame, size_t *len)
{
    st_zitem *want = &zp->items[k];
    if (zp->threaded)
        pthread_mutex_lock(&zp->mu);
    while (want->state != ST_Z_DONE) {
        st_zitem *it = st_z_claim(zp);
        if (it)
            st_z_work(zp, it, 0);
        else
            pthread_cond_wait(&zp->cv, &zp->mu); /* claimed by the helper, which will be done */
    }
    if (zp->threaded)
        pthread_mutex_unlock(&zp->mu);
    if (want->rc)
        return st_error_set(want->rc, "%s", want->err);
    *frame = want->buf;
    *len = want->len;
    return 0;
}

/* Item k written: its buffer freed and its bytes given back to the budget. */
static void st_z_release(st_zpool *zp, uint32_t k)
{
    st_zitem *it = &zp->items[k];
    free(it->buf);
    it->buf = NULL;
    if (zp->threaded)
        pthread_mutex_lock(&zp->mu);
    zp->held -= it->cost;
    if (zp->threaded) {
        pthread_cond_broadcast(&zp->cv);
        pthread_mutex_unlock(&zp->mu);
    }
}

/* The helper stopped (after the item it compresses) and joined, every buffer freed. */
static void st_z_free(st_zpool *zp)
{
    if (!zp)
        return;
    if (zp->threaded) {
        pthread_mutex_lock(&zp->mu);
        zp->stop = 1;
        pthread_cond_broadcast(&zp->cv);
        pthread_mutex_unlock(&zp->mu);
        pthread_join(zp->th, NULL);
        pthread_cond_destroy(&zp->cv);
        pthread_mutex_destroy(&zp->mu);
    }
    for (uint32_t k = 0; zp->items && k < zp->n; k++)
        free(zp->items[k].buf);
    free(zp->items);
    st_frame_ctx_free(zp->ctx[0]);
    st_frame_ctx_free(zp->ctx[1]);
    free(zp);
}

static int st_w_checkpoint(st_writer *w, uint32_t ci)
{
    const st_image *img = w->img;
    const st_ckpt *c = &img->ckpt[ci];
    uint8_t hdr[ST_CKPT_HDR];
    int compressed = w->level > 0;
    int rc;

    memset(hdr, 0, sizeof hdr);
    st_put64(hdr, c->position);
    if (w->version >= ST_FILE_VERSION_2) {
        st_put32(hdr + 8, c->codec);
        st_put32(hdr + 12, compressed ? ST_CFLAG_ZSTD | (w->shuffle ? ST_CFLAG_SHUFFLE : 0) : 0);
    }
    rc = st_w_sec_open(w, ST_SECTION_CHECKPOINT, ci,
                       compressed ? UINT64_MAX : ST_CKPT_HDR + st_fmt_ckpt_stored_total(&img->g, c->codec));
    if (rc)
        return rc;
    rc = st_w_data(w, hdr, sizeof hdr, 0);
    /* uncompressed, tensors that lie back to back in the block (no alignment padding between
     * them: the usual case) go out as one run, which st_w_data writes straight from the block
     * with its checksum computed meanwhile, instead of through the sink's buffer: the same bytes
     * in the same order */
    const uint8_t *run = NULL;
    uint64_t run_len = 0;
    for (uint32_t i = 0; i < img->g.n_tensors && !rc; i++) {
        const st_tensor_desc *t = &img->tensors[i];
        const uint8_t *src, *frame = NULL;
        uint64_t n;
        size_t flen = 0;
        uint8_t lenbuf[8];

        if (t->role != ST_ROLE_RUNNING)
            continue;
        n = st_tensor_stored_bytes(t, c->codec);
        src = c->data + st_ckpt_offset(img, c->codec, i);
        if (!compressed) {
            if (run && run + run_len == src) {
                run_len += n;
                continue;
            }
            if (run)
                rc = st_w_data(w, run, run_len, 1);
            run = src;
            run_len = n;
            continue;
        }
        rc = st_z_take(w->zp, w->zi, &frame, &flen);
        if (rc)
            return rc;
        st_put64(lenbuf, flen);
        rc = st_w_data(w, lenbuf, 8, 0);
        if (!rc)
            rc = st_w_data(w, frame, flen, 0);
        st_z_release(w->zp, w->zi++);
        st_w_progress(w, n, 0);
    }
    if (!rc && run)
        rc = st_w_data(w, run, run_len, 1);
    return rc ? rc : st_w_sec_close(w);
}

/* Decide the version; ST_ELOSSY / ST_EVERSION / ST_EINVAL for impossible requests. */
static int st_w_plan(const st_image *img, const st_file_write_opts *opts, uint32_t *version,
                     int *level, int *shuffle)
{
    uint32_t v = opts ? opts->version : 0;
    int rc = st_image_check(img);
    if (rc)
        return rc;
    *level = opts ? opts->compress : 0;
    *shuffle = opts ? opts->shuffle != 0 : 0;
    if (*level < 0 || *level > 19)
        return st_error_set(ST_EINVAL, "write: compression level %d is not 1..19", *level);
    if (v > ST_FILE_VERSION_MAX)
        return st_error_set(ST_EVERSION, "write: session file version %u; this build writes 1 and 2", v);
    if (v == 0) {
        v = *level ? ST_FILE_VERSION_2 : ST_FILE_VERSION_1;
        for (uint32_t c = 0; c < img->n_ckpt; c++)
            if (img->ckpt[c].codec != ST_CODEC_FP32)
                v = ST_FILE_VERSION_2;
    }
    if (v == ST_FILE_VERSION_1) {
        if (*level)
            return st_error_set(ST_ELOSSY, "write: format v1 cannot hold compressed checkpoints "
                                "(write v2, or do not compress)");
        for (uint32_t c = 0; c < img->n_ckpt; c++)
            if (img->ckpt[c].codec != ST_CODEC_FP32)
                return st_error_set(ST_ELOSSY, "write: checkpoint %u (position %llu) is %s: format v1 "
                                    "holds only fp32 checkpoints (re-code to fp32 or write v2)", c,
                                    (unsigned long long)img->ckpt[c].position,
                                    st_codec_name(img->ckpt[c].codec));
    }
    *version = v;
    return 0;
}

static int st_w_run(st_writer *w)
{
    const st_image *img = w->img;
    const st_geometry *g = &img->g;
    uint8_t hdr[ST_HDR_LEN];
    uint32_t n_sections = 2 + (g->arch[0] != 0) + img->n_ckpt + (img->n_logits ? 1 : 0);
    int rc;

    for (uint32_t i = 0; i < g->n_tensors; i++)
        n_sections += g->tensors[i].role == ST_ROLE_KV;
    memset(hdr, 0, sizeof hdr);
    /* the checkpoints' frames are compressed on the helper from the start, while the writer
     * writes the sections before them */
    rc = w->level ? st_z_start(w) : 0;
    if (!rc)
        rc = st_sink_put(w->s, hdr, sizeof hdr); /* the real header goes in at the end */
    if (!rc)
        rc = st_w_geometry(w);
    if (!rc && g->arch[0])
        rc = st_w_arch(w);
    if (!rc)
        rc = st_w_sec_open(w, ST_SECTION_TOKENS, 0, img->n_tokens * 4);
    if (!rc)
        rc = st_w_data(w, img->tokens, img->n_tokens * 4, 1);
    if (!rc)
        rc = st_w_sec_close(w);
    for (uint32_t i = 0; i < g->n_tensors && !rc; i++) {
        uint64_t len;
        if (g->tensors[i].role != ST_ROLE_KV)
            continue;
        len = img->n_tokens * st_tensor_row_bytes(&g->tensors[i]);
        rc = st_w_sec_open(w, ST_SECTION_KV, i, len);
        if (!rc)
            rc = st_w_data(w, img->kv[i], len, 1);
        if (!rc)
            rc = st_w_sec_close(w);
    }
    for (uint32_t c = 0; c < img->n_ckpt && !rc; c++)
        rc = st_w_checkpoint(w, c);
    if (!rc && img->n_logits) {
        rc = st_w_sec_open(w, ST_SECTION_LOGITS, 0, (uint64_t)img->n_logits * 4);
        if (!rc)
            rc = st_w_data(w, img->logits, (uint64_t)img->n_logits * 4, 1);
        if (!rc)
            rc = st_w_sec_close(w);
    }
    if (rc)
        return rc;
    memcpy(hdr, st_fmt_magic, sizeof st_fmt_magic);
    st_put32(hdr + 8, w->version);
    st_put32(hdr + 12, ST_HDR_LEN);
    st_put32(hdr + 16, 0);
    st_put32(hdr + 20, n_sections);
    st_put64(hdr + 24, w->s->off);
    st_put64(hdr + 32, img->state_hash);
    st_put64(hdr + 40, img->n_tokens);
    st_put64(hdr + 48, 0);
    st_put64(hdr + 56, st_checksum(hdr, 56));
    rc = st_sink_patch(w->s, hdr, sizeof hdr, 0);
    if (!rc)
        rc = st_sink_flush(w->s);
    if (!rc)
        st_w_progress(w, 0, 1);
    return rc;
}

static void st_w_init(st_writer *w, const st_image *img, st_sink *s, const st_file_write_opts *opts)
{
    memset(w, 0, sizeof *w);
    w->img = img;
    w->s = s;
    if (opts) {
        w->progress = opts->progress;
        w->progress_arg = opts->progress_arg;
    }
    w->total = st_image_bytes(img);
}

static void st_w_fini(st_writer *w)
{
    st_z_free(w->zp);
    st_checksum_free(&w->h);
}

int st_file_write_mem(const st_image *img, const st_file_write_opts *opts, uint8_t **out,
                      size_t *out_len)
{
    st_sink s = {.fd = -1};
    st_writer w;
    int rc;

    if (!out || !out_len)
        return st_error_set(ST_EINVAL, "write: NULL output");
    *out = NULL;
    *out_len = 0;
    st_w_init(&w, img, &s, opts);
    rc = st_w_plan(img, opts, &w.version, &w.level, &w.shuffle);
    if (!rc)
        rc = st_w_run(&w);
    st_w_fini(&w);
    if (rc) {
        free(s.buf);
        return rc;
    }
    *out = s.buf;
    *out_len = s.len;
    return 0;
}

int st_file_write(const st_image *img, const char *path, const st_file_write_opts *opts)
{
    st_sink s = {.fd = -1};
    st_writer w;
    st_replace a = {.fd = -1};
    int rc;

    st_w_init(&w, img, &s, opts);
    rc = st_w_plan(img, opts, &w.version, &w.level, &w.shuffle);
    if (rc)
        goto fail;
    rc = st_replace_begin(&a, path, 0666);
    if (rc)
        goto fail;
    s.fd = a.fd;
    s.cap = ST_IO_CHUNK;
    s.buf = malloc(s.cap);
    if (!s.buf) {
        rc = st_error_set(ENOMEM, "write %s: out of memory", path);
        goto fail;
    }
    rc = st_w_run(&w);
    if (rc) {
        char d[400];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_error_set(rc, "write %s: %s", path, d);
        goto fail;
    }
    st_w_fini(&w);
    free(s.buf);
    return st_replace_commit(&a, path);
fail:
    st_w_fini(&w);
    free(s.buf);
    st_replace_abort(&a);
    return rc;
}

/* ==== reader ================================================================================== */

typedef struct st_src {
    const uint8_t *mem; /* memory input, or NULL */
    int fd;             /* file input */
    uint64_t len;
} st_src;

static int st_src_read(const st_src *s, void *dst, size_t n, uint64_t off)
{
    int rc;
    if (s->mem) {
        memcpy(dst, s->mem + off, n);
        return 0;
    }
    rc = st_pread_all(s->fd, dst, n, off);
    if (rc == ST_ECORRUPT)
        return st_error_set(ST_ECORRUPT, "offset %llu: the file ended early (did it change while "
                            "being read?)", (unsigned long long)off);
    if (rc)
        return st_error_set(rc, "read at offset %llu: %s", (unsigned long long)off, strerror(rc));
    return 0;
}

/* The parsed file header. */
typedef struct st_hdr {
    uint32_t version;
    uint32_t n_sections;
    uint64_t file_len;
    uint64_t state_hash;
    uint64_t n_tokens;
} st_hdr;

static void st_insp_note(st_file_info *info, int rc);

/* A header check failed with rc (its detail recorded). The reader stops there; inspect (info
 * set) notes the problem and goes on, so that it can still show what the file holds. */
static int st_hdr_bad(st_file_info *info, int rc)
{
    if (!info)
        return rc;
    st_insp_note(info, rc);
    return 0;
}

/* Parse and check the file header. With info (inspect), only a header that cannot be read at all
 * (not Strata, an unknown version, shorter than 64 bytes) stops; other failed checks are noted in
 * info and n_sections is limited to what the file can hold. */
static int st_hdr_parse(const st_src *s, st_hdr *h, st_file_info *info)
{
    uint8_t b[ST_HDR_LEN];
    size_t have = s->len < ST_HDR_LEN ? (size_t)s->len : ST_HDR_LEN;
    uint64_t fit;
    uint32_t v;
    int rc;

    memset(h, 0, sizeof *h);
    rc = st_src_read(s, b, have, 0);
    if (rc)
        return rc;
    if (have < sizeof st_fmt_magic) {
        if (memcmp(b, st_fmt_magic, have) == 0)
            return st_error_set(ST_ECORRUPT, "header: the file is %zu bytes, a header needs %u "
                                "(truncated)", have, ST_HDR_LEN);
        return st_error_set(ST_ENOTSTRATA, "not a Strata file: %zu bytes without the magic \"STRATAsf\"",
                            have);
    }
    if (memcmp(b, st_fmt_magic, sizeof st_fmt_magic) != 0)
        return st_error_set(ST_ENOTSTRATA, "not a Strata file: the first 8 bytes are not \"STRATAsf\"");
    if (have < 12)
        return st_error_set(ST_ECORRUPT, "header: the file is %zu bytes, a header needs %u (truncated)",
                            have, ST_HDR_LEN);
    v = st_get32(b + 8);
    h->version = v;
    if (v != ST_FILE_VERSION_1 && v != ST_FILE_VERSION_2)
        return st_error_set(ST_EVERSION, "session file version %u; this build reads 1 and 2", v);
    if (have < ST_HDR_LEN)
        return st_error_set(ST_ECORRUPT, "header: the file is %zu bytes, a header needs %u (truncated)",
                            have, ST_HDR_LEN);
    h->n_sections = st_get32(b + 20);
    h->file_len = st_get64(b + 24);
    h->state_hash = st_get64(b + 32);
    h->n_tokens = st_get64(b + 40);
    if (!ST_SUM_OK(st_checksum(b, 56), st_get64(b + 56)) &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header at offset 0: checksum mismatch "
                                            "(recorded %016llx, computed %016llx)",
                                            (unsigned long long)st_get64(b + 56),
                                            (unsigned long long)st_checksum(b, 56)))))
        return rc;
    if (st_get32(b + 12) != ST_HDR_LEN &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header at offset 12: header_len %u, must be "
                                            "%u", st_get32(b + 12), ST_HDR_LEN))))
        return rc;
    if (st_get32(b + 16) != 0 &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header at offset 16: flags 0x%x, reserved "
                                            "bits must be 0", st_get32(b + 16)))))
        return rc;
    if (st_get64(b + 48) != 0 &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header at offset 48: reserved field is "
                                            "%llu, must be 0", (unsigned long long)st_get64(b + 48)))))
        return rc;
    if (h->file_len != s->len &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header: the file is %llu bytes but its "
                                            "header says %llu (%s)", (unsigned long long)s->len,
                                            (unsigned long long)h->file_len,
                                            s->len < h->file_len ? "truncated" : "extended"))))
        return rc;
    fit = (s->len - ST_HDR_LEN) / ST_SEC_HDR_LEN;
    if ((h->n_sections < 3 || h->n_sections > fit) &&
        (rc = st_hdr_bad(info, st_error_set(ST_ECORRUPT, "header at offset 20: %u sections cannot fit "
                                            "in %llu bytes (at least 3 are needed)", h->n_sections,
                                            (unsigned long long)s->len))))
        return rc;
    if (h->n_sections > fit)
        h->n_sections = (uint32_t)fit; /* inspect: walk what the file can hold */
    return 0;
}

/* One section being read. */
typedef struct st_sec {
    uint32_t type, index;
    uint64_t off;    /* of the section header */
    uint64_t length; /* of the payload */
    uint64_t checksum;
    uint64_t done;   /* payload bytes consumed (and hashed) */
    st_checksum_state *h; /* &own, or a check slot's state (invariant 6) */
    st_checksum_state own;
    struct st_rd_fin *fin; /* the check slot, or NULL */
} st_sec;

/* A section whose checksum the helper finishes (invariant 6): in use from st_sec_begin until
 * st_rd_collect has compared it. */
typedef struct st_rd_fin {
    st_checksum_state h;
    uint32_t type, index;
    uint64_t off, checksum, sum;
    int used;   /* 1: its section is being read; 2: its final checksum is queued or done */
} st_rd_fin;

typedef struct st_reader {
    st_src src;
    st_hdr hdr;
    st_fmt_walk walk; /* the structural rules' view of the file (st_format_int.h) */
    uint64_t off;
    st_image *img;
    uint64_t decoded, max_decoded;
    st_frame_ctx *fctx;
    uint8_t *tmp;
    size_t tmp_cap;
    void (*progress)(void *, uint64_t, uint64_t);
    void *progress_arg;
    const st_image_allocator *alloc; /* st_file_read_opts.alloc */
    struct st_rd_hasher *hasher;     /* file input of ST_RD_ASYNC_MIN bytes or more, else NULL */
    st_rd_fin fin[ST_RD_FINS];       /* the check slots (invariant 6; with the helper only) */
    st_rd_fin bad;                   /* the first section whose deferred check failed */
    int has_bad;
} st_reader;

/* The helper thread that hashes a file's pieces while the reader reads the next (invariant 5).
 * Jobs [tail, head) of the ring are queued; the helper owns their states until it has done them. */
typedef struct st_rd_hasher {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t work; /* reader -> helper: a job queued, or stop */
    pthread_cond_t done; /* helper -> reader: a job done */
    struct {
        st_checksum_state *h;
        const uint8_t *p;
        size_t n;
        st_rd_fin *fin; /* a final checksum to compute instead (invariant 6) */
    } q[ST_RD_QUEUE];
    uint32_t head, tail;
    int stop;
} st_rd_hasher;

static void *st_rd_hasher_run(void *arg)
{
    st_rd_hasher *hs = arg;
    pthread_mutex_lock(&hs->mu);
    for (;;) {
        while (hs->head == hs->tail && !hs->stop)
            pthread_cond_wait(&hs->work, &hs->mu);
        if (hs->head == hs->tail)
            break;
        uint32_t j = hs->tail % ST_RD_QUEUE;
        pthread_mutex_unlock(&hs->mu);
        if (hs->q[j].fin)
            hs->q[j].fin->sum = st_checksum_final(&hs->q[j].fin->h);
        else
            st_checksum_update(hs->q[j].h, hs->q[j].p, hs->q[j].n);
        pthread_mutex_lock(&hs->mu);
        hs->tail++;
        pthread_cond_signal(&hs->done);
    }
    pthread_mutex_unlock(&hs->mu);
    return NULL;
}

/* A helper for r, or none (hashing stays on the reader thread) when threads are short. */
static void st_rd_hasher_start(st_reader *r)
{
    st_rd_hasher *hs = calloc(1, sizeof *hs);
    if (!hs)
        return;
    if (pthread_mutex_init(&hs->mu, NULL)) {
        free(hs);
        return;
    }
    if (pthread_cond_init(&hs->work, NULL)) {
        pthread_mutex_destroy(&hs->mu);
        free(hs);
        return;
    }
    if (pthread_cond_init(&hs->done, NULL)) {
        pthread_cond_destroy(&hs->work);
        pthread_mutex_destroy(&hs->mu);
        free(hs);
        return;
    }
    if (pthread_create(&hs->th, NULL, st_rd_hasher_run, hs)) {
        pthread_cond_destroy(&hs->done);
        pthread_cond_destroy(&hs->work);
        pthread_mutex_destroy(&hs->mu);
        free(hs);
        return;
    }
    r->hasher = hs;
}

/* Queue a job: n bytes at p hashed into h, or fin's final checksum computed. */
static void st_rd_queue(st_rd_hasher *hs, st_checksum_state *h, const uint8_t *p, size_t n,
                        st_rd_fin *fin)
{
    pthread_mutex_lock(&hs->mu);
    while (hs->head - hs->tail == ST_RD_QUEUE)
        pthread_cond_wait(&hs->done, &hs->mu);
    uint32_t j = hs->head % ST_RD_QUEUE;
    hs->q[j].h = h;
    hs->q[j].p = p;
    hs->q[j].n = n;
    hs->q[j].fin = fin;
    hs->head++;
    pthread_cond_signal(&hs->work);
    pthread_mutex_unlock(&hs->mu);
}

/* Hash n bytes at p into h: queued for the helper (p must stay valid and unchanged until the
 * next st_rd_sync), else now. */
static void st_rd_hash(st_reader *r, st_checksum_state *h, const uint8_t *p, size_t n)
{
    if (!r->hasher) {
        st_checksum_update(h, p, n);
        return;
    }
    st_rd_queue(r->hasher, h, p, n, NULL);
}

/* Wait until every queued piece is hashed: the states are the reader's again. */
static void st_rd_sync(st_reader *r)
{
    st_rd_hasher *hs = r->hasher;
    if (!hs)
        return;
    pthread_mutex_lock(&hs->mu);
    while (hs->head != hs->tail)
        pthread_cond_wait(&hs->done, &hs->mu);
    pthread_mutex_unlock(&hs->mu);
}

/* After st_rd_sync: compare every section whose final checksum the helper computed, keep the
 * first that differs (in file order) and free their slots. */
static void st_rd_collect(st_reader *r)
{
    for (uint32_t i = 0; i < ST_RD_FINS; i++) {
        st_rd_fin *f = &r->fin[i];
        if (f->used != 2)
            continue;
        if (!ST_SUM_OK(f->sum, f->checksum) && (!r->has_bad || f->off < r->bad.off)) {
            r->bad = *f;
            r->has_bad = 1;
        }
        st_checksum_free(&f->h);
        f->used = 0;
    }
}

/* A free check slot for the section beginning now: when all are in use, wait for the helper
 * and compare theirs first. */
static st_rd_fin *st_rd_fin_take(st_reader *r)
{
    for (int pass = 0; pass < 2; pass++) {
        for (uint32_t i = 0; i < ST_RD_FINS; i++)
            if (!r->fin[i].used) {
                r->fin[i].used = 1;
                return &r->fin[i];
            }
        st_rd_sync(r);
        st_rd_collect(r);
    }
    return NULL; /* not reached: only the section being read keeps a slot at 1 */
}

/* Finish the queued pieces, stop the helper and join it. */
static void st_rd_hasher_stop(st_reader *r)
{
    st_rd_hasher *hs = r->hasher;
    if (!hs)
        return;
    pthread_mutex_lock(&hs->mu);
    hs->stop = 1;
    pthread_cond_signal(&hs->work);
    pthread_mutex_unlock(&hs->mu);
    pthread_join(hs->th, NULL);
    pthread_cond_destroy(&hs->done);
    pthread_cond_destroy(&hs->work);
    pthread_mutex_destroy(&hs->mu);
    free(hs);
    r->hasher = NULL;
}

static int st_sec_errv(int rc, const st_sec *sec, const char *fmt, va_list ap)
{
    char label[32], msg[400];
    st_sec_label(label, sizeof label, sec->type, sec->index);
    vsnprintf(msg, sizeof msg, fmt, ap);
    return st_error_set(rc, "section %s at offset %llu: %s", label, (unsigned long long)sec->off, msg);
}

__attribute__((format(printf, 3, 4))) static int st_sec_err(int rc, const st_sec *sec, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    rc = st_sec_errv(rc, sec, fmt, ap);
    va_end(ap);
    return rc;
}

/* Bytes of a payload available as a pointer: into the input (memory) or into r->tmp (file).
 * The caller has checked n against the section's remaining length. */
static int st_rd_view(st_reader *r, uint64_t at, size_t n, const uint8_t **p)
{
    int rc;
    if (r->src.mem) {
        *p = r->src.mem + at;
        return 0;
    }
    if (n > r->tmp_cap) {
        uint8_t *nb = realloc(r->tmp, n ? n : 1);
        if (!nb)
            return st_error_set(ENOMEM, "read: out of memory for %zu bytes", n);
        r->tmp = nb;
        r->tmp_cap = n;
    }
    rc = st_src_read(&r->src, r->tmp, n, at);
    if (rc)
        return rc;
    *p = r->tmp;
    return 0;
}

static int st_sec_need(st_sec *sec, uint64_t n, const char *what)
{
    if (n > sec->length - sec->done)
        return st_sec_err(ST_ECORRUPT, sec, "%s needs %llu bytes at payload offset %llu, only %llu "
                          "remain in the section", what, (unsigned long long)n,
                          (unsigned long long)sec->done, (unsigned long long)(sec->length - sec->done));
    return 0;
}

/* Consume n payload bytes as a pointer (hashed). */
static int st_sec_view(st_reader *r, st_sec *sec, size_t n, const uint8_t **p, const char *what)
{
    int rc = st_sec_need(sec, n, what);
    if (!rc)
        rc = st_rd_view(r, sec->off + ST_SEC_HDR_LEN + sec->done, n, p);
    if (rc)
        return rc;
    st_rd_sync(r);
    st_checksum_update(sec->h, *p, n);
    sec->done += n;
    return 0;
}

/* Consume n payload bytes into dst (hashed), in pieces that are hashed while the next is read
 * (invariant 5; dst stays unchanged until the section ends) and after which progress is reported. */
static int st_sec_read(st_reader *r, st_sec *sec, void *dst, uint64_t n, const char *what)
{
    uint8_t *d = dst;
    int rc = st_sec_need(sec, n, what);
    if (rc)
        return rc;
    while (n > 0) {
        size_t k = n > ST_RD_PIECE ? ST_RD_PIECE : (size_t)n;
        rc = st_src_read(&r->src, d, k, sec->off + ST_SEC_HDR_LEN + sec->done);
        if (rc)
            return rc;
        st_rd_hash(r, sec->h, d, k);
        sec->done += k;
        d += k;
        n -= k;
        if (r->progress)
            r->progress(r->progress_arg, sec->off + ST_SEC_HDR_LEN + sec->done, r->hdr.file_len);
    }
    return 0;
}

/* Hash what is left of the section; 1 when the checksum matches. */
static int st_sec_rest_ok(st_reader *r, st_sec *sec, int *ok)
{
    uint8_t *chunk = NULL;
    *ok = 0;
    st_rd_sync(r);
    if (!r->src.mem) {
        chunk = malloc(ST_IO_CHUNK);
        if (!chunk)
            return st_error_set(ENOMEM, "read: out of memory");
    }
    while (sec->done < sec->length) {
        uint64_t at = sec->off + ST_SEC_HDR_LEN + sec->done;
        size_t k = sec->length - sec->done > ST_IO_CHUNK ? ST_IO_CHUNK
                                                         : (size_t)(sec->length - sec->done);
        if (r->src.mem) {
            st_checksum_update(sec->h, r->src.mem + at, k);
        } else {
            int rc = st_src_read(&r->src, chunk, k, at);
            if (rc) {
                free(chunk);
                return rc;
            }
            st_checksum_update(sec->h, chunk, k);
        }
        sec->done += k;
    }
    free(chunk);
    *ok = ST_SUM_OK(st_checksum_final(sec->h), sec->checksum);
    return 0;
}

/* An error found inside a section that a damaged byte could explain: report the checksum
 * mismatch instead when there is one. The current detail is kept otherwise. */
static int st_sec_blame(st_reader *r, st_sec *sec, int rc)
{
    char d[512];
    int ok, rc2;
    snprintf(d, sizeof d, "%s", st_errdetail());
    rc2 = st_sec_rest_ok(r, sec, &ok);
    if (rc2)
        return rc2;
    if (!ok)
        return st_sec_err(ST_ECORRUPT, sec, "checksum mismatch");
    st_error_set(rc, "%s", d);
    return rc;
}

/* Begin section s of the walk: its header is read and checked against what st_fmt_expect says
 * must be there. */
static int st_sec_begin(st_reader *r, st_sec *sec, uint32_t s)
{
    uint8_t b[ST_SEC_HDR_LEN];
    uint64_t remain;
    uint32_t type, index;
    int rc;

    memset(sec, 0, sizeof *sec);
    sec->h = &sec->own;
    sec->off = r->off;
    remain = r->src.len - r->off;
    if (remain < ST_SEC_HDR_LEN) {
        /* name what was due there: the section a valid file would have */
        st_fmt_expect(&r->walk, s, ST_SECTION_CHECKPOINT, &sec->type, &sec->index);
        return st_sec_err(ST_ECORRUPT, sec, "the section header needs %u bytes, %llu remain",
                          ST_SEC_HDR_LEN, (unsigned long long)remain);
    }
    rc = st_src_read(&r->src, b, sizeof b, r->off);
    if (rc)
        return rc;
    st_fmt_expect(&r->walk, s, st_get32(b), &type, &index);
    sec->type = type;
    sec->index = index;
    if (st_get32(b) != type || st_get32(b + 4) != index) {
        char want[32], got[32];
        st_sec_label(want, sizeof want, type, index);
        st_sec_label(got, sizeof got, st_get32(b), st_get32(b + 4));
        return st_error_set(ST_ECORRUPT, "section at offset %llu: found %s where %s was expected",
                            (unsigned long long)r->off, got, want);
    }
    if (!st_fmt_sec_reserved_ok(b))
        return st_sec_err(ST_ECORRUPT, sec, "reserved header fields are 0x%x and 0x%x, must be 0",
                          st_get32(b + 16), st_get32(b + 20));
    sec->length = st_get64(b + 8);
    sec->checksum = st_get64(b + 24);
    if (sec->length > remain - ST_SEC_HDR_LEN)
        return st_sec_err(ST_ECORRUPT, sec, "length %llu exceeds the %llu bytes that remain",
                          (unsigned long long)sec->length,
                          (unsigned long long)(remain - ST_SEC_HDR_LEN));
    if (r->hasher) {
        sec->fin = st_rd_fin_take(r);
        if (r->has_bad) /* an earlier section is damaged: st_rd_run reports it */
            return ST_ECORRUPT;
        sec->h = &sec->fin->h;
        sec->fin->type = type;
        sec->fin->index = index;
        sec->fin->off = sec->off;
        sec->fin->checksum = sec->checksum;
    }
    rc = st_checksum_init(sec->h);
    if (rc)
        return st_error_set(rc, "read: out of memory");
    st_checksum_update(sec->h, b, ST_SEC_HASHED);
    return 0;
}

/* The section's checksum state freed, its check slot given back (the helper is done with it). */
static void st_rd_sec_release(st_sec *sec)
{
    st_checksum_free(sec->h);
    sec->h->impl = NULL;
    if (sec->fin)
        sec->fin->used = 0;
    sec->fin = NULL;
    sec->h = &sec->own;
}

static int st_sec_expect_len(st_sec *sec, uint64_t want, const char *what)
{
    if (sec->length != want)
        return st_sec_err(ST_ECORRUPT, sec, "length %llu, but %s need %llu", (unsigned long long)sec->length,
                          what, (unsigned long long)want);
    return 0;
}

static int st_sec_end(st_reader *r, st_sec *sec)
{
    uint64_t sum;
    if (sec->done != sec->length)
        return st_sec_err(ST_ECORRUPT, sec, "length %llu, but its content ends after %llu bytes",
                          (unsigned long long)sec->length, (unsigned long long)sec->done);
    st_rd_sync(r);
    sum = st_checksum_final(sec->h);
    st_rd_sec_release(sec);
    if (!ST_SUM_OK(sum, sec->checksum))
        return st_sec_err(ST_ECORRUPT, sec, "checksum mismatch (recorded %016llx, computed %016llx)",
                          (unsigned long long)sec->checksum, (unsigned long long)sum);
    r->off = sec->off + ST_SEC_HDR_LEN + sec->length;
    if (r->progress)
        r->progress(r->progress_arg, r->off, r->hdr.file_len);
    return 0;
}

/* st_sec_end for a section whose bytes go into the image unparsed: with the helper, its final
 * checksum is queued behind its pieces and the reader goes on (invariant 6). */
static int st_sec_end_later(st_reader *r, st_sec *sec)
{
    if (!sec->fin)
        return st_sec_end(r, sec);
    if (sec->done != sec->length)
        return st_sec_err(ST_ECORRUPT, sec, "length %llu, but its content ends after %llu bytes",
                          (unsigned long long)sec->length, (unsigned long long)sec->done);
    sec->fin->used = 2;
    st_rd_queue(r->hasher, NULL, NULL, 0, sec->fin);
    sec->fin = NULL;
    sec->h = &sec->own;
    r->off = sec->off + ST_SEC_HDR_LEN + sec->length;
    if (r->progress)
        r->progress(r->progress_arg, r->off, r->hdr.file_len);
    return 0;
}

static int st_rd_geometry(st_reader *r, st_sec *sec)
{
    st_geometry g;
    st_tensor_desc *t = NULL;
    const uint8_t *p;
    uint64_t sum;
    int rc;

    rc = st_sec_begin(r, sec, 0);
    if (rc)
        return rc;
    if (sec->length < ST_GEOM_FIXED ||
        sec->length > ST_GEOM_FIXED + (uint64_t)ST_GEOM_REC * ST_GEOMETRY_TENSORS_MAX)
        return st_sec_err(ST_ECORRUPT, sec, "length %llu is not a geometry of 0..%u tensors",
                          (unsigned long long)sec->length, ST_GEOMETRY_TENSORS_MAX);
    rc = st_sec_view(r, sec, (size_t)sec->length, &p, "the geometry");
    if (rc)
        return rc;
    /* checksum first: a damaged geometry is reported as damage, not as a strange geometry */
    sum = st_checksum_final(sec->h);
    if (!ST_SUM_OK(sum, sec->checksum))
        return st_sec_err(ST_ECORRUPT, sec, "checksum mismatch (recorded %016llx, computed %016llx)",
                          (unsigned long long)sec->checksum, (unsigned long long)sum);
    rc = st_fmt_geometry_decode(p, sec->length, &g, &t);
    if (rc) {
        char d[400];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_sec_err(rc, sec, "%s", d);
    }
    rc = st_image_create_with(&r->img, &g, r->alloc);
    free(t);
    if (rc)
        return rc;
    return st_sec_end(r, sec);
}

/* A name field read from a file: NUL-terminated, 1..31 bytes of a-z 0-9 . _ -, zero after the
 * NUL (one encoding per name). */
static int st_arch_field_check(const uint8_t p[ST_ARCH_NAME_MAX])
{
    size_t n = strnlen((const char *)p, ST_ARCH_NAME_MAX);
    int rc = st_arch_name_check((const char *)p, "architecture name");
    if (rc)
        return rc;
    if (n == 0)
        return st_error_set(ST_ECORRUPT, "architecture name: empty");
    for (size_t i = n; i < ST_ARCH_NAME_MAX; i++)
        if (p[i])
            return st_error_set(ST_ECORRUPT, "architecture name: padding byte %zu is not zero", i);
    return 0;
}

/* The optional ARCH section right after GEOMETRY; *n says whether it is there. Older files have
 * none: their architecture stays unknown (""). */
static int st_rd_arch(st_reader *r, st_sec *sec, uint32_t *n)
{
    uint8_t t[4], name[ST_ARCH_NAME_MAX];
    const uint8_t *p;
    int rc;

    *n = 0;
    if (r->src.len - r->off < ST_SEC_HDR_LEN)
        return 0; /* the next section's header names the shortage */
    if ((rc = st_src_read(&r->src, t, sizeof t, r->off)))
        return rc;
    if (st_get32(t) != ST_SECTION_ARCH)
        return 0;
    *n = 1;
    rc = st_sec_begin(r, sec, 1);
    if (!rc)
        rc = st_sec_expect_len(sec, ST_ARCH_NAME_MAX, "an architecture name");
    if (!rc)
        rc = st_sec_view(r, sec, ST_ARCH_NAME_MAX, &p, "the architecture name");
    if (!rc) {
        memcpy(name, p, sizeof name);
        rc = st_sec_end(r, sec); /* the checksum first: damage is reported as damage */
    }
    if (rc)
        return rc;
    if ((rc = st_arch_field_check(name))) {
        char d[200];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return st_sec_err(rc, sec, "%s", d);
    }
    memcpy(r->img->g.arch, name, sizeof name);
    return 0;
}

/* Append checkpoint (position, codec) to the image being read, with a zeroed block for its
 * tensors (zeroed so that alignment padding is zero, as in every image). */
/* A checkpoint block whose tensors the caller reads in whole (its gaps are zeroed), from the
 * image's allocation hook when it has one. */
static int st_rd_ckpt_block(st_image *img, uint64_t position, uint32_t codec, uint8_t **data)
{
    uint32_t ci;
    int rc = st_image_checkpoint_add_unzeroed(img, position, codec, &ci);
    if (rc)
        return rc;
    *data = img->ckpt[ci].data;
    return 0;
}

static int st_rd_checkpoint(st_reader *r, st_sec *sec, uint32_t ci)
{
    st_image *img = r->img;
    const st_geometry *g = &img->g;
    const uint8_t *p, *body = NULL;
    uint64_t position, body_len = 0, at = 0;
    uint32_t codec = ST_CODEC_FP32, cflags = 0;
    st_fmt_ckpt ck;
    int rc;

    rc = st_sec_view(r, sec, ST_CKPT_HDR, &p, "the checkpoint header");
    if (rc)
        return rc;
    rc = st_fmt_ckpt_parse(p, r->hdr.version, r->hdr.n_tokens, ci,
                           ci > 0 ? img->ckpt[ci - 1].position : 0, &ck);
    if (rc) {
        char d[200];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_sec_err(rc, sec, "%s", d);
        return rc == ST_ECODEC ? st_sec_blame(r, sec, ST_ECODEC) : rc;
    }
    position = ck.position;
    codec = ck.codec;
    cflags = ck.cflags;
    if (!(cflags & ST_CFLAG_ZSTD)) {
        uint8_t *data = NULL;
        rc = st_sec_expect_len(sec, ST_CKPT_HDR + st_fmt_ckpt_stored_total(g, codec), "its tensors");
        if (rc)
            return rc;
        /* the block is at most twice the section (alignment padding) */
        rc = st_rd_ckpt_block(img, position, codec, &data);
        for (uint32_t i = 0; i < g->n_tensors && !rc; i++) {
            const st_tensor_desc *t = &g->tensors[i];
            char what[96];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            snprintf(what, sizeof what, "tensor %u (\"%s\")", i, t->name);
            rc = st_sec_read(r, sec, data + st_ckpt_offset(img, codec, i),
                             st_tensor_stored_bytes(t, codec), what);
        }
        return rc;
    }

    /* Compressed. The frames are read whole (bounded by the section, so by the file) and the
     * checksum is compared before any of them is looked at: damage is reported as damage, and a
     * damaged file costs no decompressor. Then every frame header is checked (lengths that fill
     * the section, declared sizes equal to the tensors', shuffle widths as the flags say) and the
     * decoded total held to the cap before the block is allocated and the frames decoded. */
    {
        uint64_t sum;
        body_len = sec->length - sec->done;
        rc = st_sec_view(r, sec, (size_t)body_len, &body, "the frames");
        if (rc)
            return rc;
        sum = st_checksum_final(sec->h);
        if (!ST_SUM_OK(sum, sec->checksum))
            return st_sec_err(ST_ECORRUPT, sec, "checksum mismatch (recorded %016llx, computed %016llx)",
                              (unsigned long long)sec->checksum, (unsigned long long)sum);
    }
    for (uint32_t i = 0; i < g->n_tensors; i++) {
        const st_tensor_desc *t = &g->tensors[i];
        uint64_t n, flen, dsz;
        unsigned es, want_width;
        char what[96];

        if (t->role != ST_ROLE_RUNNING)
            continue;
        n = st_tensor_stored_bytes(t, codec);
        snprintf(what, sizeof what, "tensor %u (\"%s\")", i, t->name);
        if (body_len - at < 8)
            return st_sec_err(ST_ECORRUPT, sec, "%s: the frame length needs 8 bytes at payload offset "
                              "%llu, only %llu remain in the section", what,
                              (unsigned long long)(ST_CKPT_HDR + at), (unsigned long long)(body_len - at));
        flen = st_get64(body + at);
        if (flen > body_len - at - 8)
            return st_sec_err(ST_ECORRUPT, sec, "%s: a frame of %llu bytes at payload offset %llu, only "
                              "%llu remain in the section", what, (unsigned long long)flen,
                              (unsigned long long)(ST_CKPT_HDR + at + 8),
                              (unsigned long long)(body_len - at - 8));
        p = body + at + 8;
        rc = st_frame_decoded_size(p, (size_t)flen, &dsz);
        if (rc) {
            char d[300];
            snprintf(d, sizeof d, "%s", st_errdetail());
            return st_sec_err(rc, sec, "%s: bad frame at payload offset %llu: %s", what,
                              (unsigned long long)(ST_CKPT_HDR + at + 8), d);
        }
        if (dsz != n)
            return st_sec_err(ST_ECORRUPT, sec, "%s: frame declares %llu bytes, the tensor has %llu",
                              what, (unsigned long long)dsz, (unsigned long long)n);
        /* a valid frame header has its shuffle width at byte 5 (docs/CODECS.md) */
        es = st_stored_elem_size(t, codec);
        want_width = (cflags & ST_CFLAG_SHUFFLE) && es >= 2 ? es : 0;
        if (p[5] != want_width)
            return st_sec_err(ST_ECORRUPT, sec, "%s: frame shuffle width %u, the checkpoint flags "
                              "0x%x want %u", what, p[5], cflags, want_width);
        at += 8 + flen;
    }
    if (at != body_len)
        return st_sec_err(ST_ECORRUPT, sec, "%llu bytes follow the last frame",
                          (unsigned long long)(body_len - at));
    {
        uint64_t total = st_fmt_ckpt_stored_total(g, codec);
        if (total > r->max_decoded - r->decoded)
            return st_sec_err(ST_ETOOBIG, sec, "decompressed sizes exceed the limit of %llu bytes",
                              (unsigned long long)r->max_decoded);
        r->decoded += total;
    }
    {
        uint8_t *data = NULL;
        rc = st_rd_ckpt_block(img, position, codec, &data);
        if (rc)
            return rc;
        if (!r->fctx) {
            r->fctx = st_frame_ctx_new();
            if (!r->fctx)
                return st_error_set(ENOMEM, "read: out of memory for the decompressor");
        }
        at = 0;
        for (uint32_t i = 0; i < g->n_tensors; i++) {
            const st_tensor_desc *t = &g->tensors[i];
            uint64_t n, flen;
            size_t out_len;

            if (t->role != ST_ROLE_RUNNING)
                continue;
            n = st_tensor_stored_bytes(t, codec);
            flen = st_get64(body + at);
            p = body + at + 8;
            at += 8 + flen;
            rc = st_frame_decode(r->fctx, data + st_ckpt_offset(img, codec, i), (size_t)n, p,
                                 (size_t)flen, &out_len);
            if (!rc && out_len != n)
                rc = st_error_set(ST_ECORRUPT, "decoded %zu bytes", out_len);
            if (rc) {
                char d[300];
                snprintf(d, sizeof d, "%s", st_errdetail());
                return st_sec_err(rc, sec, "tensor %u (\"%s\"): frame does not decode: %s", i,
                                  t->name, d);
            }
        }
    }
    return 0;
}

/* Memory input only: walk the section headers and compare every checksum before anything is
 * parsed or allocated. Hashing memory costs far less than the copies that follow, and a damaged
 * buffer (an upload, a fuzzer's input) is refused without building half an image. */
static int st_rd_prepass(const st_reader *r)
{
    const uint8_t *m = r->src.mem;
    uint64_t off = ST_HDR_LEN, len = r->src.len;

    for (uint32_t s = 0; s < r->hdr.n_sections; s++) {
        st_sec sec = {.off = off};
        st_checksum_state cs = {0};
        uint64_t sum;
        int rc;

        if (len - off < ST_SEC_HDR_LEN)
            return st_error_set(ST_ECORRUPT, "section %u at offset %llu: the section header needs %u "
                                "bytes, %llu remain", s, (unsigned long long)off, ST_SEC_HDR_LEN,
                                (unsigned long long)(len - off));
        sec.type = st_get32(m + off);
        sec.index = st_get32(m + off + 4);
        sec.length = st_get64(m + off + 8);
        if (sec.length > len - off - ST_SEC_HDR_LEN)
            return st_sec_err(ST_ECORRUPT, &sec, "length %llu exceeds the %llu bytes that remain",
                              (unsigned long long)sec.length,
                              (unsigned long long)(len - off - ST_SEC_HDR_LEN));
        rc = st_checksum_init(&cs);
        if (rc)
            return st_error_set(rc, "read: out of memory");
        st_checksum_update(&cs, m + off, ST_SEC_HASHED);
        st_checksum_update(&cs, m + off + ST_SEC_HDR_LEN, (size_t)sec.length);
        sum = st_checksum_final(&cs);
        st_checksum_free(&cs);
        if (!ST_SUM_OK(sum, st_get64(m + off + 24)))
            return st_sec_err(ST_ECORRUPT, &sec, "checksum mismatch (recorded %016llx, computed %016llx)",
                              (unsigned long long)st_get64(m + off + 24), (unsigned long long)sum);
        off += ST_SEC_HDR_LEN + sec.length;
    }
    return 0;
}

static int st_rd_run(st_reader *r)
{
    st_sec sec = {0};
    st_image *img;
    uint32_t s, ci = 0, n_kv = 0, n_arch = 0;
    int rc;

    rc = st_hdr_parse(&r->src, &r->hdr, NULL);
    if (rc)
        return rc;
    if (r->src.mem) {
        rc = st_rd_prepass(r);
        if (rc)
            return rc;
    }
    r->off = ST_HDR_LEN;
    r->walk.n_sections = r->hdr.n_sections;
    rc = st_rd_geometry(r, &sec);
    if (!rc)
        rc = st_rd_arch(r, &sec, &n_arch);
    if (rc)
        goto done;
    img = r->img;
    r->walk.n_arch = n_arch;
    r->walk.g = &img->g;
    for (uint32_t i = 0; i < img->g.n_tensors; i++)
        n_kv += img->tensors[i].role == ST_ROLE_KV;
    r->walk.n_kv = n_kv;
    if (r->hdr.n_tokens > img->g.n_ctx) {
        rc = st_error_set(ST_ECORRUPT, "header at offset 40: %llu tokens exceed n_ctx %u",
                          (unsigned long long)r->hdr.n_tokens, img->g.n_ctx);
        goto done;
    }
    if (r->hdr.n_sections < st_fmt_min_sections(&img->g, n_arch)) {
        rc = st_error_set(ST_ECORRUPT, "header at offset 20: %u sections, but a geometry with %u K/V "
                          "tensors needs at least %u", r->hdr.n_sections, n_kv,
                          st_fmt_min_sections(&img->g, n_arch));
        goto done;
    }

    rc = st_sec_begin(r, &sec, 1 + n_arch);
    if (!rc)
        rc = st_sec_expect_len(&sec, st_fmt_tokens_len(r->hdr.n_tokens), "the header's tokens");
    if (!rc) {
        /* the image's token buffer and K/V rows are sized here, one section at a time */
        uint32_t *tok = malloc((size_t)(r->hdr.n_tokens ? r->hdr.n_tokens * 4 : 1));
        if (!tok) {
            rc = st_error_set(ENOMEM, "read: out of memory for %llu tokens",
                              (unsigned long long)r->hdr.n_tokens);
            goto done;
        }
        free(img->tokens);
        img->tokens = tok;
        img->n_tokens = r->hdr.n_tokens;
        for (uint32_t i = 0; i < img->g.n_tensors; i++) {
            free(img->kv[i]);
            img->kv[i] = NULL;
        }
        rc = st_sec_read(r, &sec, tok, r->hdr.n_tokens * 4, "the tokens");
    }
    if (!rc)
        rc = st_sec_end_later(r, &sec);
    s = 2 + n_arch;
    for (uint32_t i = 0; i < img->g.n_tensors && !rc; i++) {
        uint64_t len;
        if (img->tensors[i].role != ST_ROLE_KV)
            continue;
        len = st_fmt_kv_len(&img->g, i, img->n_tokens);
        rc = st_sec_begin(r, &sec, s++);
        if (!rc)
            rc = st_sec_expect_len(&sec, len, "its rows");
        if (!rc) {
            img->kv[i] = malloc((size_t)(len ? len : 1));
            if (!img->kv[i])
                rc = st_error_set(ENOMEM, "read: out of memory for %llu bytes", (unsigned long long)len);
        }
        if (!rc)
            rc = st_sec_read(r, &sec, img->kv[i], len, "the rows");
        if (!rc)
            rc = st_sec_end_later(r, &sec);
    }
    for (s = 2 + n_arch + n_kv; s < r->hdr.n_sections && !rc; s++) {
        r->walk.ci = ci;
        rc = st_sec_begin(r, &sec, s);
        if (rc)
            break;
        if (sec.type == ST_SECTION_LOGITS) {
            rc = st_sec_expect_len(&sec, st_fmt_logits_len(&img->g), "n_vocab logits");
            if (!rc) {
                img->logits = malloc((size_t)img->g.n_vocab * 4);
                if (!img->logits)
                    rc = st_error_set(ENOMEM, "read: out of memory for logits");
                else
                    img->n_logits = img->g.n_vocab;
            }
            if (!rc)
                rc = st_sec_read(r, &sec, img->logits, (uint64_t)img->g.n_vocab * 4, "the logits");
        } else {
            rc = st_rd_checkpoint(r, &sec, ci);
            ci++;
        }
        if (!rc)
            rc = st_sec_end_later(r, &sec);
    }
    if (rc)
        goto done;
    if (r->off != r->src.len) {
        rc = st_error_set(ST_ECORRUPT, "offset %llu: %llu bytes after the last section",
                          (unsigned long long)r->off, (unsigned long long)(r->src.len - r->off));
        goto done;
    }
    if (img->n_ckpt == 0 || img->ckpt[img->n_ckpt - 1].position != img->n_tokens) {
        rc = st_error_set(ST_ECORRUPT, "the last checkpoint is at position %llu, not at the %llu tokens",
                          img->n_ckpt ? (unsigned long long)img->ckpt[img->n_ckpt - 1].position : 0ull,
                          (unsigned long long)img->n_tokens);
        goto done;
    }
    img->state_hash = r->hdr.state_hash;
    rc = st_image_check(img);
    if (rc)
        rc = st_error_set(ST_ECORRUPT, "image check: %s", st_errdetail());
done:
    /* the checks the helper finished come first: the earliest damaged section is the error, as
     * if each had been compared before the next began (invariant 6) */
    st_rd_sync(r);
    st_rd_collect(r);
    if (r->has_bad) {
        st_sec b = {.type = r->bad.type, .index = r->bad.index, .off = r->bad.off};
        rc = st_sec_err(ST_ECORRUPT, &b, "checksum mismatch (recorded %016llx, computed %016llx)",
                        (unsigned long long)r->bad.checksum, (unsigned long long)r->bad.sum);
    }
    for (uint32_t i = 0; i < ST_RD_FINS; i++) {
        st_checksum_free(&r->fin[i].h);
        r->fin[i].used = 0;
    }
    st_checksum_free(&sec.own);
    return rc;
}

static int st_rd_main(st_src src, const st_file_read_opts *opts, st_image **out)
{
    st_reader r;
    int rc;

    memset(&r, 0, sizeof r);
    r.src = src;
    r.max_decoded = opts && opts->max_decoded_bytes ? opts->max_decoded_bytes : ST_DECODED_DEFAULT;
    if (opts) {
        r.progress = opts->progress;
        r.progress_arg = opts->progress_arg;
        r.alloc = opts->alloc;
    }
    if (!src.mem && src.len >= ST_RD_ASYNC_MIN)
        st_rd_hasher_start(&r);
    rc = st_rd_run(&r);
    st_rd_hasher_stop(&r);
    st_frame_ctx_free(r.fctx);
    free(r.tmp);
    if (rc) {
        st_image_free(r.img);
        return rc;
    }
    *out = r.img;
    return 0;
}

int st_file_read_mem(const void *buf, size_t len, const st_file_read_opts *opts, st_image **out)
{
    static const uint8_t empty[1];
    st_src src = {.mem = buf ? buf : empty, .fd = -1, .len = len};

    if (!out)
        return st_error_set(ST_EINVAL, "read: NULL output");
    *out = NULL;
    if (!buf && len)
        return st_error_set(ST_EINVAL, "read: NULL buffer");
    return st_rd_main(src, opts, out);
}

static int st_open_regular(const char *path, int *fd, uint64_t *len)
{
    struct stat stt;
    int e;

    *fd = -1;
    if (!path)
        return st_error_set(ST_EINVAL, "read: NULL path");
    /* O_NONBLOCK: opening a FIFO must not wait for a writer (it is refused below); reads of a
     * regular file ignore the flag */
    *fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (*fd < 0) {
        e = errno;
        return st_error_set(e, "%s: %s", path, strerror(e));
    }
    if (fstat(*fd, &stt) != 0) {
        e = errno;
        close(*fd);
        *fd = -1;
        return st_error_set(e, "%s: %s", path, strerror(e));
    }
    if (!S_ISREG(stt.st_mode)) {
        close(*fd);
        *fd = -1;
        if (S_ISDIR(stt.st_mode))
            return st_error_set(EISDIR, "%s: is a directory", path);
        return st_error_set(ST_EINVAL, "%s: not a regular file", path);
    }
    *len = (uint64_t)stt.st_size;
    return 0;
}

int st_file_read(const char *path, const st_file_read_opts *opts, st_image **out)
{
    st_src src = {.mem = NULL, .fd = -1};
    int rc;

    if (!out)
        return st_error_set(ST_EINVAL, "read: NULL output");
    *out = NULL;
    rc = st_open_regular(path, &src.fd, &src.len);
    if (rc)
        return rc;
    rc = st_rd_main(src, opts, out);
    close(src.fd);
    if (rc) {
        char d[400];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_error_set(rc, "%s: %s", path, d);
    }
    return rc;
}

/* ==== inspect ================================================================================= */

typedef struct st_insp {
    st_src src;
    st_file_info *info;
    uint8_t *chunk;
} st_insp;

/* Record the current detail as the first error (keeps an earlier one). */
static void st_insp_note(st_file_info *info, int rc)
{
    info->all_ok = 0;
    if (info->first_error)
        return;
    info->first_error = rc;
    snprintf(info->first_error_detail, sizeof info->first_error_detail, "%s", st_errdetail());
}

/* Structure checks of one section that need only its header and a few payload bytes.
 * Records problems in info; returns nothing: the walk goes on. */
static void st_insp_section(st_insp *in, st_file_section_info *si, uint32_t s, uint32_t n_sections,
                            uint32_t n_arch, uint32_t n_kv, uint32_t *ci, uint64_t *last_pos)
{
    st_file_info *info = in->info;
    const st_geometry *g = &info->geometry;
    int have_geom = g->tensors != NULL;
    st_sec sec = {.type = si->type, .index = si->index, .off = si->offset, .length = si->length};
    st_fmt_walk walk = {.n_sections = n_sections, .n_arch = n_arch, .n_kv = n_kv,
                        .g = have_geom ? g : NULL, .ci = *ci};
    uint32_t want_type, want_index;
    uint8_t b[ST_CKPT_HDR];
    st_fmt_ckpt ck;
    int rc;

    st_fmt_expect(&walk, s, si->type, &want_type, &want_index);
    if (want_index == UINT32_MAX)
        want_index = si->index; /* no geometry: any index */
    if (si->type != want_type || si->index != want_index) {
        char want[32], got[32];
        st_sec_label(want, sizeof want, want_type, want_index);
        st_sec_label(got, sizeof got, si->type, si->index);
        st_error_set(ST_ECORRUPT, "section at offset %llu: found %s where %s was expected",
                     (unsigned long long)si->offset, got, want);
        st_insp_note(info, ST_ECORRUPT);
    }
    if (si->type == ST_SECTION_ARCH && s == 1) {
        uint8_t nb[ST_ARCH_NAME_MAX];
        rc = si->length != ST_ARCH_NAME_MAX
                 ? st_error_set(ST_ECORRUPT, "length %llu, but an architecture name needs %u",
                                (unsigned long long)si->length, ST_ARCH_NAME_MAX)
                 : st_src_read(&in->src, nb, sizeof nb, si->offset + ST_SEC_HDR_LEN);
        if (!rc)
            rc = st_arch_field_check(nb);
        if (rc) {
            char d[200];
            snprintf(d, sizeof d, "%s", st_errdetail());
            st_sec_err(ST_ECORRUPT, &sec, "%s", d);
            st_insp_note(info, ST_ECORRUPT);
        } else if (si->checksum_ok)
            memcpy(info->geometry.arch, nb, sizeof nb);
    }
    if (si->type == ST_SECTION_TOKENS && si->length != st_fmt_tokens_len(info->n_tokens)) {
        st_sec_err(ST_ECORRUPT, &sec, "length %llu, but %llu tokens need %llu",
                   (unsigned long long)si->length, (unsigned long long)info->n_tokens,
                   (unsigned long long)st_fmt_tokens_len(info->n_tokens));
        st_insp_note(info, ST_ECORRUPT);
    }
    if (si->type == ST_SECTION_KV && have_geom && si->index < g->n_tensors &&
        g->tensors[si->index].role == ST_ROLE_KV &&
        si->length != st_fmt_kv_len(g, si->index, info->n_tokens)) {
        st_sec_err(ST_ECORRUPT, &sec, "length %llu does not match %llu tokens of its rows",
                   (unsigned long long)si->length, (unsigned long long)info->n_tokens);
        st_insp_note(info, ST_ECORRUPT);
    }
    if (si->type == ST_SECTION_LOGITS && si->length != st_fmt_logits_len(g)) {
        st_sec_err(ST_ECORRUPT, &sec, "length %llu, but n_vocab %u logits need %llu",
                   (unsigned long long)si->length, g->n_vocab, (unsigned long long)g->n_vocab * 4);
        st_insp_note(info, ST_ECORRUPT);
    }
    if (si->type != ST_SECTION_CHECKPOINT)
        return;
    (*ci)++;
    if (si->length < ST_CKPT_HDR) {
        st_sec_err(ST_ECORRUPT, &sec, "length %llu is shorter than a checkpoint header",
                   (unsigned long long)si->length);
        st_insp_note(info, ST_ECORRUPT);
        return;
    }
    if (st_src_read(&in->src, b, sizeof b, si->offset + ST_SEC_HDR_LEN) != 0) {
        st_insp_note(info, ST_ECORRUPT);
        return;
    }
    rc = st_fmt_ckpt_parse(b, info->version, info->n_tokens, *ci - 1, *last_pos, &ck);
    si->position = ck.position;
    si->codec = ck.codec;
    si->compressed = (ck.cflags & ST_CFLAG_ZSTD) != 0;
    if (rc) {
        char d[200];
        snprintf(d, sizeof d, "%s", st_errdetail());
        st_sec_err(rc, &sec, "%s", d);
        st_insp_note(info, rc);
        if (rc == ST_ECODEC)
            return; /* the lengths of an unknown codec are unknown */
    }
    *last_pos = si->position;
    if (!have_geom)
        return;
    if (!si->compressed) {
        uint64_t want = ST_CKPT_HDR + st_fmt_ckpt_stored_total(g, si->codec);
        if (si->length != want) {
            st_sec_err(ST_ECORRUPT, &sec, "length %llu, but its tensors need %llu",
                       (unsigned long long)si->length, (unsigned long long)want);
            st_insp_note(info, ST_ECORRUPT);
        }
        return;
    }
    /* compressed: the chain of frame lengths must fill the section exactly */
    {
        uint64_t at = ST_CKPT_HDR;
        for (uint32_t i = 0; i < g->n_tensors; i++) {
            uint8_t lb[8];
            uint64_t flen;
            if (g->tensors[i].role != ST_ROLE_RUNNING)
                continue;
            if (si->length - at < 8 ||
                st_src_read(&in->src, lb, 8, si->offset + ST_SEC_HDR_LEN + at) != 0 ||
                (flen = st_get64(lb)) > si->length - at - 8) {
                st_sec_err(ST_ECORRUPT, &sec, "tensor %u: frame does not fit in the section", i);
                st_insp_note(info, ST_ECORRUPT);
                return;
            }
            at += 8 + flen;
        }
        if (at != si->length) {
            st_sec_err(ST_ECORRUPT, &sec, "length %llu, but its frames end after %llu bytes",
                       (unsigned long long)si->length, (unsigned long long)at);
            st_insp_note(info, ST_ECORRUPT);
        }
    }
}

static int st_insp_run(st_insp *in)
{
    st_file_info *info = in->info;
    st_hdr h;
    uint64_t off = ST_HDR_LEN, last_pos = 0;
    uint32_t n_kv = 0, n_arch = 0, ci = 0;
    int rc;

    rc = st_hdr_parse(&in->src, &h, info);
    info->version = h.version;
    info->file_len = in->src.len;
    if (rc)
        return rc;
    info->state_hash = h.state_hash;
    info->n_tokens = h.n_tokens;
    /* n_sections <= (file size - 64) / 32: the array is under twice the file */
    info->sections = calloc(h.n_sections ? h.n_sections : 1, sizeof *info->sections);
    in->chunk = malloc(in->src.len < ST_IO_CHUNK ? (size_t)in->src.len : ST_IO_CHUNK);
    if (!info->sections || !in->chunk)
        return st_error_set(ENOMEM, "inspect: out of memory");

    for (uint32_t s = 0; s < h.n_sections; s++) {
        st_file_section_info *si = &info->sections[s];
        st_checksum_state cs = {0};
        uint8_t b[ST_SEC_HDR_LEN];
        uint64_t at = 0;

        if (in->src.len - off < ST_SEC_HDR_LEN) {
            rc = st_error_set(ST_ECORRUPT, "section %u at offset %llu: the section header needs %u "
                              "bytes, %llu remain", s, (unsigned long long)off, ST_SEC_HDR_LEN,
                              (unsigned long long)(in->src.len - off));
            goto done;
        }
        rc = st_src_read(&in->src, b, sizeof b, off);
        if (rc)
            goto done;
        si->type = st_get32(b);
        si->index = st_get32(b + 4);
        si->offset = off;
        si->length = st_get64(b + 8);
        si->checksum = st_get64(b + 24);
        if (si->length > in->src.len - off - ST_SEC_HDR_LEN) {
            st_sec sec = {.type = si->type, .index = si->index, .off = off};
            rc = st_sec_err(ST_ECORRUPT, &sec, "length %llu exceeds the %llu bytes that remain",
                            (unsigned long long)si->length,
                            (unsigned long long)(in->src.len - off - ST_SEC_HDR_LEN));
            goto done;
        }
        info->n_sections = s + 1;
        rc = st_checksum_init(&cs);
        if (rc) {
            rc = st_error_set(rc, "inspect: out of memory");
            goto done;
        }
        st_checksum_update(&cs, b, ST_SEC_HASHED);
        while (at < si->length) {
            size_t k = si->length - at > ST_IO_CHUNK ? ST_IO_CHUNK : (size_t)(si->length - at);
            rc = st_src_read(&in->src, in->chunk, k, off + ST_SEC_HDR_LEN + at);
            if (rc) {
                st_checksum_free(&cs);
                goto done;
            }
            st_checksum_update(&cs, in->chunk, k);
            at += k;
        }
        si->checksum_ok = st_checksum_final(&cs) == si->checksum;
        st_checksum_free(&cs);
        if (!si->checksum_ok) {
            st_sec sec = {.type = si->type, .index = si->index, .off = off};
            st_sec_err(ST_ECORRUPT, &sec, "checksum mismatch");
            st_insp_note(info, ST_ECORRUPT);
        }
        if (st_get32(b + 16) != 0 || st_get32(b + 20) != 0) {
            st_sec sec = {.type = si->type, .index = si->index, .off = off};
            st_sec_err(ST_ECORRUPT, &sec, "reserved header fields are not 0");
            st_insp_note(info, ST_ECORRUPT);
        }
        if (s == 0 && si->type == ST_SECTION_GEOMETRY && si->checksum_ok &&
            si->length <= ST_GEOM_FIXED + (uint64_t)ST_GEOM_REC * ST_GEOMETRY_TENSORS_MAX) {
            /* the payload is at most ~384 KiB: parse it whole */
            uint8_t *gp = malloc(si->length ? (size_t)si->length : 1);
            st_tensor_desc *t = NULL;
            if (!gp) {
                rc = st_error_set(ENOMEM, "inspect: out of memory");
                goto done;
            }
            rc = st_src_read(&in->src, gp, (size_t)si->length, off + ST_SEC_HDR_LEN);
            if (!rc)
                rc = st_fmt_geometry_decode(gp, si->length, &info->geometry, &t);
            free(gp);
            if (rc) {
                st_sec sec = {.type = si->type, .index = si->index, .off = off};
                char d[400];
                snprintf(d, sizeof d, "%s", st_errdetail());
                st_sec_err(ST_ECORRUPT, &sec, "%s", d);
                st_insp_note(info, ST_ECORRUPT);
                memset(&info->geometry, 0, sizeof info->geometry);
                rc = 0;
            } else {
                info->geometry.tensors = t;
                for (uint32_t i = 0; i < info->geometry.n_tensors; i++)
                    n_kv += t[i].role == ST_ROLE_KV;
                if (h.n_tokens > info->geometry.n_ctx) {
                    st_error_set(ST_ECORRUPT, "header at offset 40: %llu tokens exceed n_ctx %u",
                                 (unsigned long long)h.n_tokens, info->geometry.n_ctx);
                    st_insp_note(info, ST_ECORRUPT);
                }
            }
        }
        if (s == 1 && si->type == ST_SECTION_ARCH)
            n_arch = 1;
        st_insp_section(in, si, s, h.n_sections, n_arch, n_kv, &ci, &last_pos);
        off += ST_SEC_HDR_LEN + si->length;
    }
    if (off != in->src.len) {
        st_error_set(ST_ECORRUPT, "offset %llu: %llu bytes after the last section",
                     (unsigned long long)off, (unsigned long long)(in->src.len - off));
        st_insp_note(info, ST_ECORRUPT);
    }
    if (info->geometry.tensors && h.n_sections < st_fmt_min_sections(&info->geometry, n_arch)) {
        st_error_set(ST_ECORRUPT, "header at offset 20: %u sections, but a geometry with %u K/V "
                     "tensors needs at least %u", h.n_sections, n_kv,
                     st_fmt_min_sections(&info->geometry, n_arch));
        st_insp_note(info, ST_ECORRUPT);
    }
    if (info->geometry.tensors && (ci == 0 || last_pos != h.n_tokens)) {
        st_error_set(ST_ECORRUPT, "the last checkpoint is at position %llu, not at the %llu tokens",
                     (unsigned long long)last_pos, (unsigned long long)h.n_tokens);
        st_insp_note(info, ST_ECORRUPT);
    }
    if (!info->geometry.tensors && info->first_error == 0) {
        st_error_set(ST_ECORRUPT, "no readable geometry");
        st_insp_note(info, ST_ECORRUPT);
    }
    rc = 0;
done:
    return rc;
}

int st_file_inspect(const char *path, st_file_info *info)
{
    st_insp in;
    int rc;

    if (!info)
        return st_error_set(ST_EINVAL, "inspect: NULL info");
    memset(info, 0, sizeof *info);
    memset(&in, 0, sizeof in);
    in.info = info;
    in.src.fd = -1;
    rc = st_open_regular(path, &in.src.fd, &in.src.len); /* its errors name the path */
    if (!rc) {
        info->all_ok = 1;
        rc = st_insp_run(&in);
        close(in.src.fd);
        free(in.chunk);
        if (rc)
            st_error_set(rc, "%s: %s", path, st_errdetail());
    }
    if (rc) {
        info->all_ok = 0;
        if (!info->first_error) {
            info->first_error = rc;
            snprintf(info->first_error_detail, sizeof info->first_error_detail, "%s", st_errdetail());
        }
    }
    return rc;
}

void st_file_info_free(st_file_info *info)
{
    if (!info)
        return;
    free((void *)info->geometry.tensors);
    free(info->sections);
    memset(info, 0, sizeof *info);
}
