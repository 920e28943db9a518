/*
 * st_store_records.c - the LMDB store's records: manifests, session records and versions keys
 * (docs/STORE.md gives the bytes). Pure functions over buffers.
 *
 * Invariants:
 * 1. A parser checks every count and length against the bytes present, with overflow-safe
 *    arithmetic, before it allocates or reads; reserved fields must be zero.
 * 2. An encoder writes every byte (no uninitialised padding), so equal inputs give equal bytes.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_store_int.h"
#include "st_store_lmdb_int.h"

/* The store's names for the common layer's hex and SHA-256 (st_common.h), kept for its callers. */
void st_store_hex(char *dst, const uint8_t *p, size_t n)
{
    st_hex_encode(dst, p, n);
}

int st_store_sha256(const void *p, size_t n, uint8_t out[ST_STORE_HASH_LEN])
{
    return st_sha256(p, n, out);
}

uint64_t st_store_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static int name_char_ok(char c)
{
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' ||
           c == '_' || c == ':' || c == '+' || c == '=' || c == '-';
}

/* 1..max-1 bytes of the id alphabet, NUL-terminated within max bytes. */
static int name_valid(const char *s, size_t max)
{
    if (!s || !*s)
        return 0;
    size_t n = 0;
    for (; s[n]; n++)
        if (n + 1 >= max || !name_char_ok(s[n]))
            return 0;
    return 1;
}

int st_store_id_valid(const char *id)
{
    return name_valid(id, ST_STORE_ID_MAX + 1);
}

/* ---- versions keys ---------------------------------------------------------------------------- */

size_t st_vkey(uint8_t *dst, const char *id, uint64_t version)
{
    size_t n = strlen(id);
    memcpy(dst, id, n);
    dst[n] = 0;
    for (int i = 0; i < 8; i++)
        dst[n + 1 + i] = (uint8_t)(version >> (56 - 8 * i));
    return n + 9;
}

int st_vkey_of(const void *key, size_t len, const char *id, size_t idlen, uint64_t *version)
{
    const uint8_t *k = key;
    if (len != idlen + 9 || memcmp(k, id, idlen) || k[idlen] != 0)
        return 0;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | k[idlen + 1 + i];
    *version = v;
    return 1;
}

int st_vkey_parse(const void *key, size_t len, char *id, uint64_t *version)
{
    const uint8_t *k = key;
    if (len < 10 || len > ST_VKEY_MAX || k[len - 9] != 0)
        return st_error_set(ST_ECORRUPT, "versions key of %zu bytes is not <id> 0 <u64 BE>", len);
    size_t n = len - 9;
    memcpy(id, k, n);
    id[n] = '\0';
    if (memchr(k, 0, n) || !st_store_id_valid(id)) /* a NUL inside would cut the id short */
        return st_error_set(ST_ECORRUPT, "versions key holds an invalid session id");
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = v << 8 | k[n + 1 + i];
    *version = v;
    return 0;
}

/* ---- session records ----------------------------------------------------------------------- */

size_t st_session_encode(const st_session_rec *r, uint8_t *dst)
{
    memset(dst, 0, ST_SESSION_HDR + r->n_labels * ST_SESSION_LABEL);
    st_put32(dst, ST_SESSION_MAGIC);
    st_put16(dst + 4, ST_SESSION_FORMAT);
    st_put16(dst + 6, (uint16_t)r->n_labels);
    memcpy(dst + 8, r->model_fp, ST_FINGERPRINT_LEN);
    memcpy(dst + 40, r->geometry_digest, ST_STORE_HASH_LEN);
    st_put64(dst + 72, r->head);
    st_put64(dst + 80, r->next_version);
    st_put64(dst + 88, r->n_versions);
    st_put64(dst + 96, r->created_ns);
    st_put64(dst + 104, r->updated_ns);
    for (uint32_t i = 0; i < r->n_labels; i++) {
        uint8_t *l = dst + ST_SESSION_HDR + i * ST_SESSION_LABEL;
        memcpy(l, r->labels[i].name, strlen(r->labels[i].name));
        st_put64(l + 32, r->labels[i].version);
    }
    return ST_SESSION_HDR + r->n_labels * ST_SESSION_LABEL;
}

int st_session_parse(const void *buf, size_t len, const char *id, st_session_rec *r)
{
    const uint8_t *p = buf;
    memset(r, 0, sizeof *r);
    if (len < ST_SESSION_HDR)
        return st_error_set(ST_ECORRUPT, "session %s: record of %zu bytes is shorter than its %u-byte header",
                            id, len, ST_SESSION_HDR);
    if (st_get32(p) != ST_SESSION_MAGIC)
        return st_error_set(ST_ECORRUPT, "session %s: record magic 0x%08x, expected 0x%08x", id,
                            st_get32(p), ST_SESSION_MAGIC);
    if (st_get16(p + 4) != ST_SESSION_FORMAT)
        return st_error_set(ST_EVERSION, "session %s: record format %u; this build reads %u", id,
                            st_get16(p + 4), ST_SESSION_FORMAT);
    uint32_t n = st_get16(p + 6);
    if (n > ST_STORE_LABELS_MAX || len != ST_SESSION_HDR + (size_t)n * ST_SESSION_LABEL)
        return st_error_set(ST_ECORRUPT, "session %s: %u labels do not fit a %zu-byte record", id, n, len);
    memcpy(r->model_fp, p + 8, ST_FINGERPRINT_LEN);
    memcpy(r->geometry_digest, p + 40, ST_STORE_HASH_LEN);
    r->head = st_get64(p + 72);
    r->next_version = st_get64(p + 80);
    r->n_versions = st_get64(p + 88);
    r->created_ns = st_get64(p + 96);
    r->updated_ns = st_get64(p + 104);
    if (r->head == 0 || r->n_versions == 0 || r->head >= r->next_version || r->n_versions > r->head)
        return st_error_set(ST_ECORRUPT, "session %s: head %llu, next %llu, %llu versions are inconsistent",
                            id, (unsigned long long)r->head, (unsigned long long)r->next_version,
                            (unsigned long long)r->n_versions);
    r->n_labels = n;
    for (uint32_t i = 0; i < n; i++) {
        const uint8_t *l = p + ST_SESSION_HDR + i * ST_SESSION_LABEL;
        memcpy(r->labels[i].name, l, ST_STORE_LABEL_MAX);
        if (memchr(l, 0, ST_STORE_LABEL_MAX) == NULL || !name_valid(r->labels[i].name, ST_STORE_LABEL_MAX))
            return st_error_set(ST_ECORRUPT, "session %s: label %u has an invalid name", id, i);
        for (size_t j = strlen(r->labels[i].name); j < ST_STORE_LABEL_MAX; j++)
            if (l[j])
                return st_error_set(ST_ECORRUPT, "session %s: label %u: non-zero padding", id, i);
        r->labels[i].version = st_get64(l + 32);
        if (r->labels[i].version == 0 || r->labels[i].version >= r->next_version)
            return st_error_set(ST_ECORRUPT, "session %s: label \"%s\" names version %llu (next is %llu)",
                                id, r->labels[i].name, (unsigned long long)r->labels[i].version,
                                (unsigned long long)r->next_version);
    }
    return 0;
}

/* ---- geometry record ------------------------------------------------------------------------- */

static int all_zero(const uint8_t *p, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (p[i])
            return 0;
    return 1;
}


/* st_geometry_encode and st_geometry_decode: st_format.c (one encoding with the session file's) */

/* ---- manifests ------------------------------------------------------------------------------- */

void st_manifest_free(st_manifest *m)
{
    if (!m)
        return;
    free(m->ckpt);
    free(m->sec);
    free(m->chunks);
    m->ckpt = NULL;
    m->sec = NULL;
    m->chunks = NULL;
}

static size_t manifest_len(size_t hdr, uint32_t n_ckpt, uint32_t n_sec, uint32_t n_chunks)
{
    return hdr + (size_t)n_ckpt * ST_MANIFEST_CKPT + (size_t)n_sec * ST_MANIFEST_SECTION +
           (size_t)n_chunks * ST_MANIFEST_CHUNK + ST_MANIFEST_TRAILER;
}

int st_manifest_encode(const st_manifest *m, uint8_t **out, size_t *out_len)
{
    size_t an = strnlen(m->arch, ST_ARCH_NAME_MAX);
    size_t hdr = an ? ST_MANIFEST_HDR_ARCH : ST_MANIFEST_HDR;
    size_t len = manifest_len(hdr, m->n_ckpt, m->n_sec, m->n_chunks);
    uint8_t *b = calloc(1, len);
    *out = NULL;
    if (!b)
        return st_error_set(ENOMEM, "manifest: no memory for %zu bytes", len);
    st_put32(b, ST_MANIFEST_MAGIC);
    st_put16(b + 4, an ? ST_MANIFEST_FORMAT_ARCH : ST_MANIFEST_FORMAT);
    st_put16(b + 6, (uint16_t)m->flags);
    st_put64(b + 8, m->version);
    st_put64(b + 16, m->created_ns);
    st_put64(b + 24, m->state_hash);
    st_put64(b + 32, m->n_tokens);
    st_put64(b + 40, m->logical_bytes);
    st_put64(b + 48, m->stored_bytes);
    st_put32(b + 56, m->n_ckpt);
    st_put32(b + 60, m->n_sec);
    st_put32(b + 64, m->n_chunks);
    st_put32(b + 68, m->file_version);
    st_put32(b + 72, (uint32_t)m->file_compress);
    st_put32(b + 76, (uint32_t)m->file_shuffle);
    st_put32(b + 80, m->compress);
    memcpy(b + ST_MANIFEST_HDR, m->arch, an); /* format 2: zero-padded */
    uint8_t *p = b + hdr;
    for (uint32_t i = 0; i < m->n_ckpt; i++, p += ST_MANIFEST_CKPT) {
        st_put64(p, m->ckpt[i].position);
        st_put32(p + 8, m->ckpt[i].codec);
    }
    for (uint32_t i = 0; i < m->n_sec; i++, p += ST_MANIFEST_SECTION) {
        st_put32(p, m->sec[i].type);
        st_put32(p + 4, m->sec[i].index);
        st_put32(p + 8, m->sec[i].tensor);
        st_put32(p + 12, m->sec[i].n_chunks);
        st_put64(p + 16, m->sec[i].length);
    }
    for (uint32_t i = 0; i < m->n_chunks; i++, p += ST_MANIFEST_CHUNK) {
        memcpy(p, m->chunks[i].hash, ST_STORE_HASH_LEN);
        st_put64(p + 32, m->chunks[i].xxh);
        st_put32(p + 40, m->chunks[i].raw_len);
        st_put32(p + 44, m->chunks[i].stored_len);
    }
    st_put64(p, st_checksum(b, len - ST_MANIFEST_TRAILER));
    *out = b;
    *out_len = len;
    return 0;
}

void st_manifest_patch(uint8_t *buf, size_t len, uint64_t version, uint64_t created_ns)
{
    st_put64(buf + 8, version);
    st_put64(buf + 16, created_ns);
    st_put64(buf + len - ST_MANIFEST_TRAILER, st_checksum(buf, len - ST_MANIFEST_TRAILER));
}

int st_manifest_parse(const void *buf, size_t len, const char *what, st_manifest *m)
{
    const uint8_t *b = buf;
    int rc = 0;
    memset(m, 0, sizeof *m);
    if (len < ST_MANIFEST_HDR + ST_MANIFEST_TRAILER)
        return st_error_set(ST_ECORRUPT, "%s: manifest of %zu bytes is shorter than its header", what, len);
    if (st_get32(b) != ST_MANIFEST_MAGIC)
        return st_error_set(ST_ECORRUPT, "%s: manifest magic 0x%08x, expected 0x%08x", what, st_get32(b),
                            ST_MANIFEST_MAGIC);
    uint32_t format = st_get16(b + 4);
    if (format != ST_MANIFEST_FORMAT && format != ST_MANIFEST_FORMAT_ARCH)
        return st_error_set(ST_EVERSION, "%s: manifest format %u; this build reads %u and %u", what,
                            format, ST_MANIFEST_FORMAT, ST_MANIFEST_FORMAT_ARCH);
    size_t hdr = format == ST_MANIFEST_FORMAT_ARCH ? ST_MANIFEST_HDR_ARCH : ST_MANIFEST_HDR;
    if (len < hdr + ST_MANIFEST_TRAILER)
        return st_error_set(ST_ECORRUPT, "%s: manifest of %zu bytes is shorter than its header", what, len);
    m->flags = st_get16(b + 6);
    m->version = st_get64(b + 8);
    m->created_ns = st_get64(b + 16);
    m->state_hash = st_get64(b + 24);
    m->n_tokens = st_get64(b + 32);
    m->logical_bytes = st_get64(b + 40);
    m->stored_bytes = st_get64(b + 48);
    m->n_ckpt = st_get32(b + 56);
    m->n_sec = st_get32(b + 60);
    m->n_chunks = st_get32(b + 64);
    m->file_version = st_get32(b + 68);
    m->file_compress = (int32_t)st_get32(b + 72);
    m->file_shuffle = (int32_t)st_get32(b + 76);
    m->compress = st_get32(b + 80);
    if ((m->flags & ~ST_MANIFEST_VERBATIM) || !all_zero(b + 84, 12))
        return st_error_set(ST_ECORRUPT, "%s: manifest has unknown flags 0x%x or reserved bytes set", what,
                            m->flags);
    if (m->n_ckpt > ST_MANIFEST_CKPTS_MAX || m->n_chunks > ST_MANIFEST_CHUNKS_MAX ||
        m->n_sec > ST_MANIFEST_CHUNKS_MAX + 2 * ST_MANIFEST_CKPTS_MAX)
        return st_error_set(ST_ECORRUPT, "%s: manifest counts (%u checkpoints, %u sections, %u chunks) exceed limits",
                            what, m->n_ckpt, m->n_sec, m->n_chunks);
    if (manifest_len(hdr, m->n_ckpt, m->n_sec, m->n_chunks) != len)
        return st_error_set(ST_ECORRUPT, "%s: manifest of %zu bytes does not hold %u checkpoints, %u sections, %u chunks",
                            what, len, m->n_ckpt, m->n_sec, m->n_chunks);
    uint64_t want = st_get64(b + len - ST_MANIFEST_TRAILER), got = st_checksum(b, len - ST_MANIFEST_TRAILER);
    if (want != got)
        return st_error_set(ST_ECORRUPT, "%s: manifest checksum 0x%016llx, recorded 0x%016llx", what,
                            (unsigned long long)got, (unsigned long long)want);
    if (m->file_version > ST_FILE_VERSION_MAX || m->file_compress < 0 || m->file_compress > 19 ||
        m->file_shuffle < 0 || m->file_shuffle > 1 || m->compress > 19)
        return st_error_set(ST_ECORRUPT, "%s: manifest file options (v%u, level %d, shuffle %d) or level %u invalid",
                            what, m->file_version, m->file_compress, m->file_shuffle, m->compress);
    if (format == ST_MANIFEST_FORMAT_ARCH) {
        const uint8_t *a = b + ST_MANIFEST_HDR;
        size_t an = strnlen((const char *)a, ST_ARCH_NAME_MAX);
        if (an == 0 || an == ST_ARCH_NAME_MAX || !all_zero(a + an, ST_ARCH_NAME_MAX - an) ||
            st_arch_name_check((const char *)a, "architecture name"))
            return st_error_set(ST_ECORRUPT, "%s: manifest architecture name is empty, unterminated, "
                                "not zero-padded or not of a-z 0-9 . _ -", what);
        memcpy(m->arch, a, ST_ARCH_NAME_MAX);
    }
    m->ckpt = calloc(m->n_ckpt ? m->n_ckpt : 1, sizeof *m->ckpt);
    m->sec = calloc(m->n_sec ? m->n_sec : 1, sizeof *m->sec);
    m->chunks = calloc(m->n_chunks ? m->n_chunks : 1, sizeof *m->chunks);
    if (!m->ckpt || !m->sec || !m->chunks) {
        rc = st_error_set(ENOMEM, "%s: no memory for a manifest of %u chunks", what, m->n_chunks);
        goto fail;
    }
    const uint8_t *p = b + hdr;
    for (uint32_t i = 0; i < m->n_ckpt; i++, p += ST_MANIFEST_CKPT) {
        m->ckpt[i].position = st_get64(p);
        m->ckpt[i].codec = st_get32(p + 8);
        if (st_get32(p + 12)) {
            rc = st_error_set(ST_ECORRUPT, "%s: manifest checkpoint %u: reserved bytes set", what, i);
            goto fail;
        }
    }
    const uint8_t *sp = p;
    const uint8_t *cp = p + (size_t)m->n_sec * ST_MANIFEST_SECTION;
    for (uint32_t i = 0; i < m->n_chunks; i++, cp += ST_MANIFEST_CHUNK) {
        st_mchunk *c = &m->chunks[i];
        memcpy(c->hash, cp, ST_STORE_HASH_LEN);
        c->xxh = st_get64(cp + 32);
        c->raw_len = st_get32(cp + 40);
        c->stored_len = st_get32(cp + 44);
        if (c->raw_len == 0 || c->raw_len > ST_STORE_CHUNK_MAX || c->stored_len == 0 || c->stored_len > c->raw_len) {
            rc = st_error_set(ST_ECORRUPT, "%s: manifest chunk %u: raw length %u, stored %u out of range", what,
                              i, c->raw_len, c->stored_len);
            goto fail;
        }
    }
    uint64_t next = 0, stored = 0;
    for (uint32_t i = 0; i < m->n_sec; i++, sp += ST_MANIFEST_SECTION) {
        st_msection *s = &m->sec[i];
        s->type = st_get32(sp);
        s->index = st_get32(sp + 4);
        s->tensor = st_get32(sp + 8);
        s->n_chunks = st_get32(sp + 12);
        s->length = st_get64(sp + 16);
        if (s->type < ST_MSEC_GEOMETRY || s->type > ST_MSEC_FILE || st_get64(sp + 24)) {
            rc = st_error_set(ST_ECORRUPT, "%s: manifest section %u: type %u unknown or reserved bytes set",
                              what, i, s->type);
            goto fail;
        }
        if (s->n_chunks > m->n_chunks - next) {
            rc = st_error_set(ST_ECORRUPT, "%s: manifest section %u: %u chunks exceed the table", what, i,
                              s->n_chunks);
            goto fail;
        }
        s->first = (uint32_t)next;
        uint64_t sum = 0;
        for (uint32_t j = 0; j < s->n_chunks; j++) {
            sum += m->chunks[s->first + j].raw_len;
            stored += m->chunks[s->first + j].stored_len;
        }
        if (sum != s->length) {
            rc = st_error_set(ST_ECORRUPT, "%s: manifest section %u: chunks hold %llu bytes, section %llu", what,
                              i, (unsigned long long)sum, (unsigned long long)s->length);
            goto fail;
        }
        next += s->n_chunks;
    }
    if (next != m->n_chunks || stored != m->stored_bytes) {
        rc = st_error_set(ST_ECORRUPT, "%s: manifest sections cover %llu of %u chunks, %llu of %llu stored bytes",
                          what, (unsigned long long)next, m->n_chunks, (unsigned long long)stored,
                          (unsigned long long)m->stored_bytes);
        goto fail;
    }
    return 0;
fail:
    st_manifest_free(m);
    return rc;
}
