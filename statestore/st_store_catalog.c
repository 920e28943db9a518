/*
 * st_store_catalog.c - the catalog: session records and versions inside a transaction (shared
 * with put through st_store_lmdb_int.h), listing, show, version info, deletion and labels.
 * Invariants (besides st_lmdb_store.c's):
 * 1. A session record's head is always a version present in the versions database: a delete
 *    moves the head in the transaction that removes the version, and removes the record with
 *    the last version.
 * 2. Listing walks only the sessions database and never enters a page a start-up scan found
 *    damaged (sessions_walk_ok).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_store_lmdb_int.h"

/* ---- sessions and versions inside a transaction -------------------------------------------------- */

int st_store__session_get(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, int *found)
{
    MDB_val k = {strlen(id), (void *)id}, v;
    int rc = mdb_get(txn, st->dbi_sessions, &k, &v);
    *found = 0;
    if (rc == MDB_NOTFOUND)
        return 0;
    if (rc)
        return rc;
    char what[ST_STORE_ID_MAX + 32];
    snprintf(what, sizeof what, "session %s: its record", id);
    if ((rc = st_store__value_check(st, &v, what)))
        return rc;
    rc = st_session_parse(v.mv_data, v.mv_size, id, rec);
    if (!rc)
        *found = 1;
    return rc;
}

int st_store__session_put(st_store *st, MDB_txn *txn, const char *id, const st_session_rec *rec)
{
    uint8_t b[ST_SESSION_REC_MAX];
    size_t n = st_session_encode(rec, b);
    MDB_val k = {strlen(id), (void *)id}, v = {n, b};
    return mdb_put(txn, st->dbi_sessions, &k, &v, 0);
}

/* Versions of session id present in txn, oldest first (malloc'd). */
static int session_versions(st_store *st, MDB_txn *txn, const char *id, uint64_t **out, size_t *n)
{
    MDB_cursor *cur = NULL;
    uint8_t kb[ST_VKEY_MAX];
    size_t idlen = strlen(id), cap = 0, cnt = 0;
    uint64_t *vs = NULL;
    *out = NULL;
    *n = 0;
    int rc = mdb_cursor_open(txn, st->dbi_versions, &cur);
    if (rc)
        return rc;
    MDB_val k = {st_vkey(kb, id, 0), kb}, v;
    for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); !rc; rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
        uint64_t ver;
        if (!st_vkey_of(k.mv_data, k.mv_size, id, idlen, &ver))
            break;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 16;
            uint64_t *nv = realloc(vs, cap * sizeof *nv);
            if (!nv) {
                rc = st_error_set(ENOMEM, "no memory listing the versions of session %s (%zu of them, %zu bytes)", id,
                                  cap, cap * sizeof *nv);
                goto done;
            }
            vs = nv;
        }
        vs[cnt++] = ver;
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
done:
    mdb_cursor_close(cur);
    if (rc) {
        free(vs);
        return rc;
    }
    *out = vs;
    *n = cnt;
    return 0;
}

/* Drop one reference to chunk hash; free the chunk at zero unless gc is deferred. */
static int chunk_unref(st_store *st, MDB_txn *txn, const uint8_t *hash, const char *what)
{
    MDB_val k = {ST_STORE_HASH_LEN, (void *)hash}, v;
    char hex[2 * ST_STORE_HASH_LEN + 1];
    int rc = mdb_get(txn, st->dbi_refcounts, &k, &v);
    if (rc == MDB_NOTFOUND || (!rc && (v.mv_size != 8 || st_get64(v.mv_data) == 0))) {
        st_hex_encode(hex, hash, ST_STORE_HASH_LEN);
        return st_error_set(ST_ECORRUPT, "%s: chunk %s has no positive reference count (run `statectl check`)",
                            what, hex);
    }
    if (rc)
        return rc;
    uint64_t cnt = st_get64(v.mv_data) - 1;
    if (cnt == 0 && !st->opts.gc_deferred) {
        /* LMDB frees as many overflow pages as the value's page header says: check it first */
        MDB_val cv;
        rc = mdb_get(txn, st->dbi_chunks, &k, &cv);
        if (rc == MDB_NOTFOUND)
            return mdb_del(txn, st->dbi_refcounts, &k, NULL); /* already gone: nothing to free */
        if (!rc)
            rc = st_store__value_check(st, &cv, what);
        if (!rc)
            rc = mdb_del(txn, st->dbi_refcounts, &k, NULL);
        if (!rc)
            rc = mdb_del(txn, st->dbi_chunks, &k, NULL);
        return rc;
    }
    uint8_t b[8];
    st_put64(b, cnt);
    MDB_val nv = {8, b};
    return mdb_put(txn, st->dbi_refcounts, &k, &nv, 0);
}

/* Delete version `version` of session id (its manifest and references) and update rec
 * (count, labels); the caller fixes the head and writes rec. */
static int version_delete_txn(st_store *st, MDB_txn *txn, const char *id, uint64_t version, st_session_rec *rec)
{
    uint8_t kb[ST_VKEY_MAX];
    char what[ST_STORE_ID_MAX + 64];
    MDB_val k = {st_vkey(kb, id, version), kb}, v;
    st_manifest m;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)version);
    int rc = mdb_get(txn, st->dbi_versions, &k, &v);
    if (rc == MDB_NOTFOUND)
        return st_error_set(ST_ENOTFOUND, "session %s has no version %llu", id, (unsigned long long)version);
    if (rc)
        return rc;
    if ((rc = st_store__value_check(st, &v, what)) || (rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m)))
        return rc;
    for (uint32_t i = 0; i < m.n_chunks && !rc; i++)
        rc = chunk_unref(st, txn, m.chunks[i].hash, what);
    st_manifest_free(&m);
    if (!rc)
        rc = mdb_del(txn, st->dbi_versions, &k, NULL);
    if (rc)
        return rc;
    rec->n_versions--;
    uint32_t w = 0;
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (rec->labels[i].version != version)
            rec->labels[w++] = rec->labels[i];
    rec->n_labels = w;
    return 0;
}

static int label_index(const st_session_rec *rec, const char *name)
{
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (!strcmp(rec->labels[i].name, name))
            return (int)i;
    return -1;
}

int st_store__label_apply(st_session_rec *rec, const char *id, const char *name, uint64_t version)
{
    int i = label_index(rec, name);
    if (i >= 0) {
        rec->labels[i].version = version;
        return 0;
    }
    if (rec->n_labels >= ST_STORE_LABELS_MAX)
        return st_error_set(ST_ETOOBIG, "session %s already has %u labels", id, ST_STORE_LABELS_MAX);
    snprintf(rec->labels[rec->n_labels].name, ST_STORE_LABEL_MAX, "%s", name);
    rec->labels[rec->n_labels].version = version;
    rec->n_labels++;
    return 0;
}

static int labelled(const st_session_rec *rec, uint64_t version)
{
    for (uint32_t i = 0; i < rec->n_labels; i++)
        if (rec->labels[i].version == version)
            return 1;
    return 0;
}

/* Retention: delete versions older than the newest keep that carry no label. */
int st_store__prune_txn(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec, uint32_t keep,
                     uint32_t *pruned)
{
    uint64_t *vs = NULL;
    size_t n = 0;
    *pruned = 0;
    if (keep == 0)
        return 0;
    int rc = session_versions(st, txn, id, &vs, &n);
    for (size_t i = 0; !rc && n > keep && i < n - keep; i++) {
        if (labelled(rec, vs[i]))
            continue;
        rc = version_delete_txn(st, txn, id, vs[i], rec);
        if (!rc)
            (*pruned)++;
    }
    free(vs);
    return rc;
}

/* ---- listing ------------------------------------------------------------------------------------ */

static void session_info_fill(st_session_info *si, const char *id, size_t idlen, const st_session_rec *r)
{
    memset(si, 0, sizeof *si);
    memcpy(si->id, id, idlen);
    si->id[idlen] = '\0';
    memcpy(si->model_fp, r->model_fp, ST_FINGERPRINT_LEN);
    memcpy(si->geometry_digest, r->geometry_digest, ST_STORE_HASH_LEN);
    si->head = r->head;
    si->n_versions = r->n_versions;
    si->next_version = r->next_version;
    si->created_ns = r->created_ns;
    si->updated_ns = r->updated_ns;
    si->n_labels = r->n_labels;
    memcpy(si->labels, r->labels, sizeof si->labels);
}

/* The session under the cursor (k, v) into si (marked damaged when its record does not decode);
 * ST_ECORRUPT for a key that is no session id. */
static int session_info_from(st_store *st, st_session_info *si, const MDB_val *k, const MDB_val *v)
{
    char id[ST_STORE_ID_MAX + 1];
    if (k->mv_size == 0 || k->mv_size > ST_STORE_ID_MAX)
        return st_error_set(ST_ECORRUPT, "sessions database holds a key of %zu bytes", k->mv_size);
    memcpy(id, k->mv_data, k->mv_size);
    id[k->mv_size] = '\0';
    st_session_rec rec;
    int rc = st_store__value_check(st, v, "a session record");
    if (!rc)
        rc = st_session_parse(v->mv_data, v->mv_size, id, &rec);
    if (!rc) {
        session_info_fill(si, id, k->mv_size, &rec);
    } else if (rc == ST_ECORRUPT) {
        /* one damaged record does not hide the others */
        memset(si, 0, sizeof *si);
        memcpy(si->id, id, k->mv_size + 1);
        si->damaged = 1;
        rc = 0;
    }
    return rc;
}

void st_store_damaged_dbs_set(st_store *st, uint32_t dbs)
{
    if (st)
        st->damaged_dbs = dbs;
}

/* A cursor over a sessions database with a damaged page could enter it (LMDB trusts pages). */
static int sessions_walk_ok(const st_store *st)
{
    if (st->damaged_dbs & ST_STORE_DB_SESSIONS)
        return st_error_set(ST_ECORRUPT, "store %s: the sessions database has a damaged page, so sessions cannot be "
                            "listed (`statectl check` names it; `statectl restore-backup` restores a backup)",
                            st->dir);
    return 0;
}

int st_store_list(st_store *st, st_session_info **out, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    st_session_info *arr = NULL;
    size_t cnt = 0, cap = 0;
    if (!st || !out || !n)
        return st_error_set(ST_EINVAL, "list: bad arguments");
    *out = NULL;
    *n = 0;
    pthread_rwlock_rdlock(&st->lock);
    int rc = sessions_walk_ok(st);
    if (!rc)
        rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = mdb_cursor_open(txn, st->dbi_sessions, &cur);
    MDB_val k, v;
    for (int op = MDB_FIRST; !rc; op = MDB_NEXT) {
        rc = mdb_cursor_get(cur, &k, &v, op);
        if (rc)
            break;
        if (cnt == cap) {
            cap = cap ? cap * 2 : 64;
            st_session_info *na = realloc(arr, cap * sizeof *na);
            if (!na) {
                rc = st_error_set(ENOMEM, "list: no memory for %zu sessions (%zu bytes)", cap, cap * sizeof *na);
                break;
            }
            arr = na;
        }
        if ((rc = session_info_from(st, &arr[cnt], &k, &v)))
            break;
        cnt++;
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc) {
        free(arr);
        return st_store__edge(rc, "listing sessions");
    }
    *out = arr;
    *n = cnt;
    return 0;
}

/* One read transaction; the cursor is placed with MDB_SET_RANGE on `after` (the first key >= it)
 * and steps over `after` itself, so only the page's records are read and parsed. */
int st_store_list_page(st_store *st, const char *after, st_session_info *out, size_t limit, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    size_t cnt = 0;
    if (!st || !n || (limit && !out))
        return st_error_set(ST_EINVAL, "list page: bad arguments");
    *n = 0;
    if (after && *after && !st_store_id_valid(after))
        return st_error_set(ST_EINVAL, "list page: `after` is not a valid session id");
    if (!limit)
        return 0;
    size_t alen = after ? strlen(after) : 0;
    pthread_rwlock_rdlock(&st->lock);
    int rc = sessions_walk_ok(st);
    if (!rc)
        rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = mdb_cursor_open(txn, st->dbi_sessions, &cur);
    MDB_val k = {alen, (void *)after}, v;
    if (!rc)
        rc = mdb_cursor_get(cur, &k, &v, alen ? MDB_SET_RANGE : MDB_FIRST);
    if (!rc && alen && k.mv_size == alen && !memcmp(k.mv_data, after, alen))
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    while (!rc) {
        if ((rc = session_info_from(st, &out[cnt], &k, &v)))
            break;
        if (++cnt == limit)
            break;
        rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
    }
    if (rc == MDB_NOTFOUND)
        rc = 0;
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return st_store__edge(rc, "listing sessions");
    *n = cnt;
    return 0;
}

int st_store_show(st_store *st, const char *id, st_session_info *out)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    int found = 0;
    if (!st || !out)
        return st_error_set(ST_EINVAL, "show: bad arguments");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "show: invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = st_store__session_get(st, txn, id, &rec, &found);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return st_store__edge(rc, "reading a session");
    if (!found)
        return st_error_set(ST_ENOTFOUND, "no session %s", id);
    session_info_fill(out, id, strlen(id), &rec);
    return 0;
}

static void version_info_fill(st_version_info *vi, const st_manifest *m)
{
    memset(vi, 0, sizeof *vi);
    vi->version = m->version;
    vi->created_ns = m->created_ns;
    vi->n_tokens = m->n_tokens;
    vi->state_hash = m->state_hash;
    vi->logical_bytes = m->logical_bytes;
    vi->stored_bytes = m->stored_bytes;
    vi->n_checkpoints = m->n_ckpt;
    vi->last_position = m->n_ckpt ? m->ckpt[m->n_ckpt - 1].position : 0;
    vi->n_chunks = m->n_chunks;
    vi->compress = m->compress;
    vi->file_version = m->file_version;
    vi->file_verbatim = (m->flags & ST_MANIFEST_VERBATIM) != 0;
    memcpy(vi->arch, m->arch, ST_ARCH_NAME_MAX);
    vi->codec = m->n_ckpt ? m->ckpt[m->n_ckpt - 1].codec : ST_CODEC_FP32;
    for (uint32_t c = 0; c < m->n_ckpt; c++)
        vi->codecs |= m->ckpt[c].codec < 31 ? 1u << m->ckpt[c].codec : ST_VERSION_CODEC_OTHER;
    for (uint32_t i = 0; i < m->n_chunks; i++)
        vi->n_framed += m->chunks[i].stored_len < m->chunks[i].raw_len;
}

void st_version_codecs_text(uint32_t codecs, char *out, size_t cap)
{
    size_t n = 0;
    if (!cap)
        return;
    out[0] = 0;
    for (uint32_t c = 0; c < 32; c++) {
        if (!(codecs & (1u << c)))
            continue;
        const char *name = (1u << c) == ST_VERSION_CODEC_OTHER ? "other" : st_codec_name(c);
        int w = snprintf(out + n, cap - n, "%s%s", n ? "+" : "", name);
        if (w < 0 || (size_t)w >= cap - n)
            return;
        n += (size_t)w;
    }
    if (!n)
        snprintf(out, cap, "none");
}

int st_store_versions(st_store *st, const char *id, st_version_info **out, size_t *n)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    uint64_t *vs = NULL;
    size_t nv = 0;
    st_version_info *arr = NULL;
    int found = 0;
    if (!st || !out || !n)
        return st_error_set(ST_EINVAL, "versions: bad arguments");
    *out = NULL;
    *n = 0;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "versions: invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = st_store__session_get(st, txn, id, &rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    if (!rc)
        rc = session_versions(st, txn, id, &vs, &nv);
    if (!rc && !(arr = calloc(nv ? nv : 1, sizeof *arr)))
        rc = st_error_set(ENOMEM, "versions: no memory for the %zu versions of session %s (%zu bytes)", nv, id,
                          (nv ? nv : 1) * sizeof *arr);
    for (size_t i = 0; i < nv && !rc; i++) {
        uint8_t kb[ST_VKEY_MAX];
        char what[ST_STORE_ID_MAX + 64];
        MDB_val k = {st_vkey(kb, id, vs[i]), kb}, v;
        st_manifest m;
        snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)vs[i]);
        rc = mdb_get(txn, st->dbi_versions, &k, &v);
        if (!rc)
            rc = st_store__value_check(st, &v, what);
        if (!rc)
            rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m);
        if (!rc) {
            version_info_fill(&arr[i], &m);
            st_manifest_free(&m);
        }
    }
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    free(vs);
    if (rc) {
        free(arr);
        return st_store__edge(rc, "listing versions");
    }
    *out = arr;
    *n = nv;
    return 0;
}

/* The versions key orders a session's versions by number (big-endian after the id and its 0x00),
 * so MDB_SET_RANGE on (id, after + 1) finds the page's first version without reading others. */
int st_store_versions_page(st_store *st, const char *id, uint64_t after, st_version_info *out,
                           size_t limit, size_t *n)
{
    MDB_txn *txn = NULL;
    MDB_cursor *cur = NULL;
    st_session_rec rec;
    int found = 0;
    size_t cnt = 0;
    if (!st || !n || (limit && !out))
        return st_error_set(ST_EINVAL, "versions page: bad arguments");
    *n = 0;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "versions page: invalid session id");
    size_t idlen = strlen(id);
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = st_store__session_get(st, txn, id, &rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    if (!rc && limit && after != UINT64_MAX)
        rc = mdb_cursor_open(txn, st->dbi_versions, &cur);
    if (!rc && cur) {
        uint8_t kb[ST_VKEY_MAX];
        MDB_val k = {st_vkey(kb, id, after + 1), kb}, v;
        for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE); !rc && cnt < limit;
             rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
            uint64_t ver;
            if (!st_vkey_of(k.mv_data, k.mv_size, id, idlen, &ver))
                break;
            char what[ST_STORE_ID_MAX + 64];
            snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)ver);
            st_manifest m;
            if ((rc = st_store__value_check(st, &v, what)) || (rc = st_manifest_parse(v.mv_data, v.mv_size, what, &m)))
                break;
            version_info_fill(&out[cnt++], &m);
            st_manifest_free(&m);
        }
        if (rc == MDB_NOTFOUND)
            rc = 0;
    }
    if (cur)
        mdb_cursor_close(cur);
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        return st_store__edge(rc, "listing versions");
    *n = cnt;
    return 0;
}

int st_store_version_info(st_store *st, const char *id, uint64_t version, st_version_info *out)
{
    uint8_t *mbuf = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    char what[ST_STORE_ID_MAX + 64];
    if (!st || !out)
        return st_error_set(ST_EINVAL, "version info: bad arguments");
    int rc = st_store__manifest_read(st, id, version, &v, &mbuf, &mlen, NULL);
    if (rc)
        return rc;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    rc = st_manifest_parse(mbuf, mlen, what, &m);
    if (!rc) {
        version_info_fill(out, &m);
        st_manifest_free(&m);
    }
    free(mbuf);
    return rc;
}

/* ---- deletion and labels --------------------------------------------------------------------------- */

typedef struct st_del_ctx {
    const char *id;
    uint64_t version; /* 0: the whole session */
    const char *label;
    int remove_label;
} st_del_ctx;

static int session_require(st_store *st, MDB_txn *txn, const char *id, st_session_rec *rec)
{
    int found = 0;
    int rc = st_store__session_get(st, txn, id, rec, &found);
    if (!rc && !found)
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
    return rc;
}

static int delete_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_del_ctx *c = arg;
    st_session_rec rec;
    uint64_t *vs = NULL;
    size_t n = 0;
    int rc = session_require(st, txn, c->id, &rec);
    if (rc)
        return rc;
    if (c->version) {
        if ((rc = version_delete_txn(st, txn, c->id, c->version, &rec)))
            return rc;
    } else {
        if ((rc = session_versions(st, txn, c->id, &vs, &n)))
            return rc;
        for (size_t i = 0; i < n && !rc; i++)
            rc = version_delete_txn(st, txn, c->id, vs[i], &rec);
        free(vs);
        vs = NULL;
        if (rc)
            return rc;
    }
    MDB_val k = {strlen(c->id), (void *)c->id};
    if ((rc = session_versions(st, txn, c->id, &vs, &n)))
        return rc;
    if (n == 0) {
        rc = mdb_del(txn, st->dbi_sessions, &k, NULL);
    } else {
        rec.head = vs[n - 1];
        rec.n_versions = n;
        rec.updated_ns = st_store_now_ns();
        rc = st_store__session_put(st, txn, c->id, &rec);
    }
    free(vs);
    return rc;
}

int st_store_version_delete(st_store *st, const char *id, uint64_t version)
{
    if (!st || !st_store_id_valid(id) || version == 0)
        return st_error_set(ST_EINVAL, "version delete: bad session id or version 0");
    st_del_ctx c = {.id = id, .version = version};
    return st_store__write(st, delete_fn, &c);
}

int st_store_session_delete(st_store *st, const char *id)
{
    if (!st || !st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "session delete: bad session id");
    st_del_ctx c = {.id = id};
    return st_store__write(st, delete_fn, &c);
}

static int label_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_del_ctx *c = arg;
    st_session_rec rec;
    int rc = session_require(st, txn, c->id, &rec);
    if (rc)
        return rc;
    if (c->remove_label) {
        int i = label_index(&rec, c->label);
        if (i < 0)
            return st_error_set(ST_ENOTFOUND, "session %s has no label \"%s\"", c->id, c->label);
        rec.labels[i] = rec.labels[rec.n_labels - 1];
        rec.n_labels--;
    } else {
        uint64_t v = c->version ? c->version : rec.head;
        uint8_t kb[ST_VKEY_MAX];
        MDB_val k = {st_vkey(kb, c->id, v), kb}, val;
        rc = mdb_get(txn, st->dbi_versions, &k, &val);
        if (rc == MDB_NOTFOUND)
            return st_error_set(ST_ENOTFOUND, "session %s has no version %llu", c->id, (unsigned long long)v);
        if (rc)
            return rc;
        if ((rc = st_store__label_apply(&rec, c->id, c->label, v)))
            return rc;
    }
    return st_store__session_put(st, txn, c->id, &rec);
}

int st_store_label_set(st_store *st, const char *id, const char *name, uint64_t version)
{
    if (!st || !st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "label set: bad session id");
    if (!st_store_id_valid(name) || strlen(name) >= ST_STORE_LABEL_MAX)
        return st_error_set(ST_EINVAL, "label set: a label is 1..%d bytes of A-Z a-z 0-9 . _ : + = -",
                            ST_STORE_LABEL_MAX - 1);
    st_del_ctx c = {.id = id, .version = version, .label = name};
    return st_store__write(st, label_fn, &c);
}

int st_store_label_remove(st_store *st, const char *id, const char *name)
{
    if (!st || !st_store_id_valid(id) || !name)
        return st_error_set(ST_EINVAL, "label remove: bad session id or name");
    st_del_ctx c = {.id = id, .label = name, .remove_label = 1};
    return st_store__write(st, label_fn, &c);
}
