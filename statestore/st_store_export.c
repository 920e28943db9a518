/*
 * st_store_export.c - session files in and out of the store: export writes a version as a
 * session file (the imported bytes themselves when the version kept them, else the image
 * through st_file_write), import reads a session file and puts it, keeping the file's bytes
 * when no writer option reproduces them. Invariants:
 * 1. Export of an imported version gives back the imported file byte for byte.
 * 2. Import changes the store only through put_ex (one write transaction).
 */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_store_lmdb_int.h"

/* ---- export and import ----------------------------------------------------------------------- */

static int export_verbatim(st_store *st, const char *id, uint64_t v, const uint8_t *mbuf, size_t mlen,
                           const st_manifest *m, const char *path)
{
    const st_msection *sec = &m->sec[m->n_sec - 1];
    st_job *jobs = calloc(sec->n_chunks ? sec->n_chunks : 1, sizeof *jobs);
    uint8_t *buf = malloc(sec->length ? sec->length : 1);
    size_t nj = 0;
    int rc = 0;
    if (!jobs || !buf) {
        rc = st_error_set(ENOMEM, "export: no memory for %llu bytes", (unsigned long long)sec->length);
        goto done;
    }
    st_store__jobs_for_section(m, m->n_sec - 1, buf, jobs, &nj);
    st_store__progress(st, "read", 0, sec->length);
    if ((rc = st_store__fetch(st, id, v, mbuf, mlen, m, jobs, nj)))
        goto done;
    st_store__progress(st, "read", sec->length, sec->length);
    rc = st_file_replace(path, buf, sec->length);
done:
    free(jobs);
    free(buf);
    return rc;
}

static void export_progress(void *arg, uint64_t done, uint64_t total)
{
    st_store__progress(arg, "write", done, total);
}

int st_store_export(st_store *st, const char *id, uint64_t version, const char *path,
                    const st_file_write_opts *fopts)
{
    uint8_t *mbuf = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    st_image *img = NULL;
    char what[ST_STORE_ID_MAX + 64];
    memset(&m, 0, sizeof m);
    if (!st || !path)
        return st_error_set(ST_EINVAL, "export: no store or path");
    for (int attempt = 0;; attempt++) {
        int rc = st_store__manifest_read(st, id, version, &v, &mbuf, &mlen, NULL);
        if (rc)
            return rc;
        snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
        rc = st_manifest_parse(mbuf, mlen, what, &m);
        if (!rc && !fopts && (m.flags & ST_MANIFEST_VERBATIM)) {
            if (m.sec[m.n_sec - 1].type != ST_MSEC_FILE)
                rc = st_error_set(ST_ECORRUPT, "%s: manifest lacks its file section", what);
            else
                rc = export_verbatim(st, id, v, mbuf, mlen, &m, path);
        } else if (!rc) {
            st_file_write_opts fo = {.version = m.file_version, .compress = m.file_compress,
                                     .shuffle = m.file_shuffle};
            if (fopts)
                fo = *fopts;
            if (!fo.progress && st->opts.progress) {
                fo.progress = export_progress;
                fo.progress_arg = st;
            }
            rc = st_store_get(st, id, v, &img);
            if (!rc)
                rc = st_file_write(img, path, &fo);
            st_image_free(img);
            img = NULL;
        }
        st_manifest_free(&m);
        free(mbuf);
        mbuf = NULL;
        if (rc != ST_CHANGED)
            return rc;
        if (attempt + 1 >= ST_GET_RETRIES)
            return st_error_set(ST_EBUSY, "export: session %s kept changing while it was read", id);
    }
}

static int read_whole(const char *path, uint8_t **out, size_t *out_len)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    uint8_t *buf = NULL;
    struct stat sb;
    int rc = 0;
    *out = NULL;
    if (fd < 0)
        return st_error_set(errno == ENOENT ? ST_ENOTFOUND : errno, "import: %s: %s", path, strerror(errno));
    if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
        rc = st_error_set(ST_EINVAL, "import: %s is not a regular file", path);
        goto done;
    }
    size_t len = (size_t)sb.st_size;
    if (!(buf = malloc(len ? len : 1))) {
        rc = st_error_set(ENOMEM, "import: no memory for the %zu bytes of %s", len, path);
        goto done;
    }
    for (size_t off = 0; off < len;) {
        ssize_t r = read(fd, buf + off, len - off);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            rc = st_error_set(r < 0 ? errno : ST_EIO, "import: reading %s: %s", path,
                              r < 0 ? strerror(errno) : "file shrank while read");
            goto done;
        }
        off += (size_t)r;
    }
    *out = buf;
    *out_len = len;
    buf = NULL;
done:
    free(buf);
    close(fd);
    return rc;
}

int st_store_import(st_store *st, const char *path, const char *id, const st_put_opts *opts, uint64_t *version)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    st_image *img = NULL;
    st_file_info info;
    st_file_as fa;
    memset(&info, 0, sizeof info);
    memset(&fa, 0, sizeof fa);
    if (!st || !path)
        return st_error_set(ST_EINVAL, "import: no store or path");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "import: invalid session id (1..%d bytes of A-Z a-z 0-9 . _ : + = -)",
                            ST_STORE_ID_MAX);
    st_store__progress(st, "read", 0, 1);
    int rc = read_whole(path, &buf, &len);
    if (!rc)
        rc = st_file_read_mem(buf, len, NULL, &img);
    if (!rc)
        rc = st_file_inspect(path, &info);
    if (rc)
        goto done;
    st_store__progress(st, "read", 1, 1);
    /* Find the writer options that give these very bytes back; else keep the bytes too. */
    int compressed = 0;
    for (uint32_t i = 0; i < info.n_sections; i++)
        compressed |= info.sections[i].compressed != 0;
    st_file_write_opts cand[3];
    int n_cand = 0;
    memset(cand, 0, sizeof cand);
    if (!compressed) {
        cand[n_cand++] = (st_file_write_opts){.version = info.version};
    } else {
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = ST_FRAME_LEVEL_DEFAULT, .shuffle = 1};
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = ST_FRAME_LEVEL_DEFAULT};
        cand[n_cand++] = (st_file_write_opts){.version = info.version, .compress = 1, .shuffle = 1};
    }
    int exact = 0;
    for (int i = 0; i < n_cand && !exact; i++) {
        uint8_t *re = NULL;
        size_t re_len = 0;
        if (st_file_write_mem(img, &cand[i], &re, &re_len) == 0)
            exact = re_len == len && !memcmp(re, buf, len);
        free(re);
        if (exact) {
            fa.version = cand[i].version;
            fa.compress = cand[i].compress;
            fa.shuffle = cand[i].shuffle;
        }
    }
    if (!exact) {
        fa.version = info.version;
        fa.verbatim = buf;
        fa.verbatim_len = len;
    } else {
        free(buf);
        buf = NULL;
    }
    st_store__progress(st, "store", 0, 1);
    rc = st_store__put_ex(st, id, img, ST_STORE_HEAD_ANY, opts, &fa, version);
    if (!rc)
        st_store__progress(st, "store", 1, 1);
done:
    st_file_info_free(&info);
    st_image_free(img);
    free(buf);
    return rc;
}
