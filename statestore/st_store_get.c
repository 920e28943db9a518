/*
 * st_store_get.c - the get path: a version's manifest is read, then its chunks are copied out of
 * read transactions (fetch: geometry first, then tokens, then everything else straight into the
 * image), each transaction ended before its chunks are checked (XXH3 or SHA-256) and decoded
 * (st_lmdb_store.c invariant 3). Export (st_store_export.c) reads through manifest_read and
 * fetch. Invariants:
 * 1. Every length the manifest gives is checked against the geometry before anything is
 *    allocated for it (st_store__manifest_layout_check).
 * 2. A manifest replaced between two reads is ST_CHANGED, never a mixed image: the caller
 *    starts over (at most ST_GET_RETRIES times).
 */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_store_lmdb_int.h"

/* ---- get -------------------------------------------------------------------------------------- */

/* A session record's head version that the versions database lacks: damage, not a deletion (a
 * delete moves the head in the transaction that removes the version). */
static int head_missing(const char *id, uint64_t head)
{
    return st_error_set(ST_ECORRUPT, "session %s records head version %llu, which the store lacks (store damaged: "
                        "`statectl check` names what; `statectl restore-backup` restores a backup)", id,
                        (unsigned long long)head);
}

/* One read: copy the session record and version's manifest out of a read transaction. */
int st_store__manifest_read(st_store *st, const char *id, uint64_t version, uint64_t *resolved, uint8_t **mbuf,
                         size_t *mlen, st_session_rec *rec_out)
{
    MDB_txn *txn = NULL;
    st_session_rec rec;
    int found = 0;
    *mbuf = NULL;
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "invalid session id");
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (rc)
        goto done;
    if ((rc = st_store__session_get(st, txn, id, &rec, &found)))
        goto done;
    if (!found) {
        rc = st_error_set(ST_ENOTFOUND, "no session %s", id);
        goto done;
    }
    uint64_t v = version ? version : rec.head;
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, id, v), kb}, val;
    rc = mdb_get(txn, st->dbi_versions, &k, &val);
    if (rc == MDB_NOTFOUND) {
        rc = v == rec.head ? head_missing(id, v)
                           : st_error_set(ST_ENOTFOUND, "session %s has no version %llu", id, (unsigned long long)v);
        goto done;
    }
    if (rc)
        goto done;
    char what[ST_STORE_ID_MAX + 64];
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    if ((rc = st_store__value_check(st, &val, what)))
        goto done;
    *mbuf = malloc(val.mv_size);
    if (!*mbuf) {
        rc = st_error_set(ENOMEM, "no memory for a manifest of %zu bytes", val.mv_size);
        goto done;
    }
    memcpy(*mbuf, val.mv_data, val.mv_size);
    *mlen = val.mv_size;
    *resolved = v;
    if (rec_out)
        *rec_out = rec;
done:
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    rc = st_store__edge(rc, "reading a manifest");
    return rc;
}

typedef struct st_fetch {
    st_store *st;
    const st_manifest *m;
    st_job *jobs;
    size_t n;
    const char *id;
    uint64_t version;
    int sha;
} st_fetch;

/* Copy one job's stored bytes out of the map. Runs on helper threads while the thread that owns
 * the read transaction keeps it open (the snapshot's pages stay mapped and unchanged until it
 * ends); the helpers never touch the transaction itself. */
static int fetch_copy_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    const st_fetch *f = ctx;
    const st_job *j = &f->jobs[i];
    memcpy(j->staged ? j->staged : j->dst, j->src, f->m->chunks[j->chunk].stored_len);
    return 0;
}

static int fetch_verify_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_fetch *f = ctx;
    const st_job *j = &f->jobs[i];
    const st_mchunk *c = &f->m->chunks[j->chunk];
    const uint8_t *stored = j->staged ? j->staged : j->dst;
    int ok;
    if (f->sha) {
        uint8_t h[ST_STORE_HASH_LEN];
        int rc = st_sha256(stored, c->stored_len, h);
        if (rc)
            return rc;
        ok = !memcmp(h, c->hash, ST_STORE_HASH_LEN);
    } else {
        ok = st_checksum(stored, c->stored_len) == c->xxh;
    }
    char hex[2 * ST_STORE_HASH_LEN + 1];
    if (!ok) {
        st_hex_encode(hex, c->hash, ST_STORE_HASH_LEN);
        return st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: %s mismatch (stored bytes damaged)",
                            hex, f->id, (unsigned long long)f->version, f->sha ? "SHA-256" : "checksum");
    }
    if (j->staged) {
        if (!*fctx && !(*fctx = st_frame_ctx_new()))
            return st_error_set(ENOMEM, "no memory for a decompression context (for a chunk of %u bytes)",
                                c->raw_len);
        size_t out = 0;
        int rc = st_frame_decode(*fctx, j->dst, c->raw_len, j->staged, c->stored_len, &out);
        if (rc || out != c->raw_len) {
            st_hex_encode(hex, c->hash, ST_STORE_HASH_LEN);
            return st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: frame does not decode to %u bytes",
                                hex, f->id, (unsigned long long)f->version, c->raw_len);
        }
    }
    return 0;
}

/* Copy the jobs' chunks out of one read transaction (after checking the manifest is still the
 * one in mbuf), end it, then check and decode them (invariant 3). */
int st_store__fetch(st_store *st, const char *id, uint64_t version, const uint8_t *mbuf, size_t mlen,
                 const st_manifest *m, st_job *jobs, size_t n)
{
    MDB_txn *txn = NULL;
    uint8_t *stage = NULL;
    uint64_t stage_len = 0, bytes = 0;
    int rc = 0;
    for (size_t i = 0; i < n; i++) {
        const st_mchunk *c = &m->chunks[jobs[i].chunk];
        if (c->stored_len < c->raw_len)
            stage_len += c->stored_len;
        bytes += c->stored_len;
    }
    if (stage_len && !(stage = malloc(stage_len)))
        return st_error_set(ENOMEM, "no memory to stage %llu compressed bytes", (unsigned long long)stage_len);
    pthread_rwlock_rdlock(&st->lock);
    if ((rc = st_store__rtxn(st, &txn)))
        goto unlock;
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, id, version), kb}, v;
    rc = mdb_get(txn, st->dbi_versions, &k, &v);
    if (rc == MDB_NOTFOUND) {
        rc = st_error_set(ST_ENOTFOUND, "version %llu of session %s was deleted while it was read",
                          (unsigned long long)version, id);
        goto unlock;
    }
    if (!rc)
        rc = st_store__value_check(st, &v, "a manifest");
    if (rc)
        goto unlock;
    if (v.mv_size != mlen || memcmp(v.mv_data, mbuf, mlen)) {
        rc = ST_CHANGED;
        goto unlock;
    }
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        st_job *j = &jobs[i];
        const st_mchunk *c = &m->chunks[j->chunk];
        MDB_val ck = {ST_STORE_HASH_LEN, (void *)c->hash}, cv;
        rc = mdb_get(txn, st->dbi_chunks, &ck, &cv);
        if (rc == 0 && cv.mv_size != c->stored_len)
            rc = MDB_CORRUPTED;
        if (rc == 0 && (rc = st_store__value_check(st, &cv, "a chunk")))
            goto unlock;
        if (rc) {
            char hex[2 * ST_STORE_HASH_LEN + 1];
            st_hex_encode(hex, c->hash, ST_STORE_HASH_LEN);
            rc = rc == MDB_NOTFOUND
                     ? st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu is missing from the store", hex,
                                    id, (unsigned long long)version)
                     : rc == MDB_CORRUPTED
                           ? st_error_set(ST_ECORRUPT, "chunk %s of session %s version %llu: %zu bytes stored, %u expected",
                                          hex, id, (unsigned long long)version, cv.mv_size, c->stored_len)
                           : rc;
            goto unlock;
        }
        j->src = cv.mv_data;
        j->staged = NULL;
        if (c->stored_len < c->raw_len) {
            j->staged = stage + off;
            off += c->stored_len;
        }
    }
    {
        /* the copy itself: first touches of a new image's pages are much of a get's cost, and
         * page faults on several threads proceed in parallel */
        st_fetch cf = {st, m, jobs, n, id, version, 0};
        rc = st_store__par_run(bytes < ST_PAR_MIN_BYTES ? 1 : st->threads, n, fetch_copy_one, &cf);
    }
unlock:
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (!rc) {
        st_fetch f = {st, m, jobs, n, id, version, st->opts.verify_sha256};
        unsigned threads = bytes < ST_PAR_MIN_BYTES ? 1 : st->threads;
        rc = st_store__par_run(threads, n, fetch_verify_one, &f);
    } else {
        rc = st_store__edge(rc, "reading chunks");
    }
    free(stage);
    return rc;
}

/* Check that the manifest's sections are exactly what an image of geometry g needs. */
int st_store__manifest_layout_check(const st_manifest *m, const st_geometry *g, const char *what)
{
    uint32_t s = 0;
#define EXPECT(cond, ...)                                                                                  \
    do {                                                                                                   \
        if (!(cond))                                                                                       \
            return st_error_set(ST_ECORRUPT, __VA_ARGS__);                                                 \
    } while (0)
    EXPECT(m->n_tokens <= g->n_ctx, "%s: %llu tokens exceed n_ctx %u", what, (unsigned long long)m->n_tokens,
           g->n_ctx);
    EXPECT(m->n_sec >= 2 && m->sec[0].type == ST_MSEC_GEOMETRY && m->sec[0].n_chunks == 1 &&
               m->sec[1].type == ST_MSEC_TOKENS && m->sec[1].length == m->n_tokens * 4,
           "%s: manifest does not start with the geometry and %llu tokens", what, (unsigned long long)m->n_tokens);
    s = 2;
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        const st_tensor_desc *t = &g->tensors[ti];
        if (t->role != ST_ROLE_KV)
            continue;
        EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_KV && m->sec[s].index == ti &&
                   m->sec[s].length == m->n_tokens * st_tensor_row_bytes(t),
               "%s: manifest section %u is not K/V tensor %u (\"%s\") of %llu tokens", what, s, ti, t->name,
               (unsigned long long)m->n_tokens);
        s++;
    }
    for (uint32_t c = 0; c < m->n_ckpt; c++) {
        EXPECT(st_codec_check(m->ckpt[c].codec) == 0, "%s: checkpoint %u has unknown codec %u", what, c,
               m->ckpt[c].codec);
        for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
            const st_tensor_desc *t = &g->tensors[ti];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_CKPT && m->sec[s].index == c &&
                       m->sec[s].tensor == ti && m->sec[s].length == st_tensor_stored_bytes(t, m->ckpt[c].codec),
                   "%s: manifest section %u is not checkpoint %u tensor %u (\"%s\")", what, s, c, ti, t->name);
            s++;
        }
    }
    if (s < m->n_sec && m->sec[s].type == ST_MSEC_LOGITS) {
        EXPECT(g->n_vocab && m->sec[s].length == (uint64_t)g->n_vocab * 4, "%s: logits section of %llu bytes",
               what, (unsigned long long)m->sec[s].length);
        s++;
    }
    if (m->flags & ST_MANIFEST_VERBATIM) {
        EXPECT(s < m->n_sec && m->sec[s].type == ST_MSEC_FILE, "%s: manifest lacks its file section", what);
        s++;
    }
    EXPECT(s == m->n_sec, "%s: manifest has %u sections, the geometry explains %u", what, m->n_sec, s);
#undef EXPECT
    return 0;
}

int st_store__jobs_for_section(const st_manifest *m, uint32_t s, uint8_t *base, st_job *jobs, size_t *n)
{
    const st_msection *sec = &m->sec[s];
    uint64_t off = 0;
    for (uint32_t j = 0; j < sec->n_chunks; j++) {
        jobs[*n].chunk = sec->first + j;
        jobs[*n].dst = base + off;
        jobs[*n].staged = NULL;
        off += m->chunks[sec->first + j].raw_len;
        (*n)++;
    }
    return 0;
}

/* Three read transactions: the geometry, the tokens, everything else; each copies out and ends
 * before its chunks are checked (invariant 3). A manifest replaced in between makes fetch
 * answer ST_CHANGED and the caller start over. */
static int get_once(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                    st_image **out)
{
    uint8_t *mbuf = NULL, *geo = NULL;
    size_t mlen = 0;
    uint64_t v = 0;
    st_manifest m;
    st_session_rec rec;
    st_geometry g;
    st_tensor_desc *gt = NULL;
    uint32_t *tokens = NULL;
    float *logits = NULL;
    st_job *jobs = NULL;
    st_image *img = NULL;
    char what[ST_STORE_ID_MAX + 64];
    size_t nj = 0;
    memset(&m, 0, sizeof m);
    int rc = st_store__manifest_read(st, id, version, &v, &mbuf, &mlen, &rec);
    if (rc)
        return rc;
    snprintf(what, sizeof what, "session %s version %llu", id, (unsigned long long)v);
    if ((rc = st_manifest_parse(mbuf, mlen, what, &m)))
        goto done;
    if (m.n_sec < 2 || m.sec[0].type != ST_MSEC_GEOMETRY || m.sec[0].n_chunks != 1 ||
        m.chunks[0].stored_len != m.chunks[0].raw_len || m.sec[1].type != ST_MSEC_TOKENS) {
        rc = st_error_set(ST_ECORRUPT, "%s: manifest does not start with a geometry and tokens", what);
        goto done;
    }
    jobs = calloc(m.n_chunks ? m.n_chunks : 1, sizeof *jobs);
    geo = malloc(m.chunks[0].raw_len);
    if (!jobs || !geo) {
        rc = st_error_set(ENOMEM, "%s: no memory for %u chunk jobs (%zu bytes) and the %u-byte geometry", what,
                          m.n_chunks, (size_t)(m.n_chunks ? m.n_chunks : 1) * sizeof *jobs, m.chunks[0].raw_len);
        goto done;
    }
    /* First the geometry (one chunk of at most 4 MiB): every other length is checked against it
     * before anything is allocated for it. */
    st_store__jobs_for_section(&m, 0, geo, jobs, &nj);
    if ((rc = st_store__fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    if ((rc = st_geometry_decode(geo, m.chunks[0].raw_len, &g, &gt)))
        goto done;
    memcpy(g.arch, m.arch, ST_ARCH_NAME_MAX);
    if ((rc = st_store__manifest_layout_check(&m, &g, what)))
        goto done;
    /* Then the tokens (n_tokens <= n_ctx now), to build the image. */
    if (!(tokens = malloc(m.sec[1].length ? m.sec[1].length : 1))) {
        rc = st_error_set(ENOMEM, "%s: no memory for %llu tokens (%llu bytes)", what, (unsigned long long)m.n_tokens,
                          (unsigned long long)m.sec[1].length);
        goto done;
    }
    nj = 0;
    st_store__jobs_for_section(&m, 1, (uint8_t *)tokens, jobs, &nj);
    if ((rc = st_store__fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    /* every K/V row and checkpoint tensor is one of the sections copied below (the layout
     * check), so nothing is zeroed first; an image whose copy fails is freed */
    if ((rc = st_image_create_with(&img, &g, alloc)))
        goto done;
    if ((rc = st_image_tokens_set_unzeroed(img, tokens, m.n_tokens)))
        goto done;
    for (uint32_t c = 0; c < m.n_ckpt; c++)
        if ((rc = st_image_checkpoint_add_unzeroed(img, m.ckpt[c].position, m.ckpt[c].codec, NULL))) {
            rc = st_error_wrap(ST_ECORRUPT, "%s: checkpoint %u", what, c);
            goto done;
        }
    /* Last, everything else, straight into the image. */
    nj = 0;
    for (uint32_t s = 2; s < m.n_sec; s++) {
        const st_msection *sec = &m.sec[s];
        uint8_t *base = NULL;
        uint64_t len = 0;
        if (sec->type == ST_MSEC_KV) {
            base = st_image_kv(img, sec->index, &len);
        } else if (sec->type == ST_MSEC_CKPT) {
            base = st_image_checkpoint_tensor(img, sec->index, sec->tensor, &len);
        } else if (sec->type == ST_MSEC_LOGITS) {
            logits = malloc(sec->length);
            base = (uint8_t *)logits;
            len = sec->length;
        } else {
            continue; /* FILE: only export reads it */
        }
        if (!base || len != sec->length) {
            rc = st_error_set(base ? ST_ECORRUPT : ENOMEM, "%s: section %u of %llu bytes does not fit the image", what,
                              s, (unsigned long long)sec->length);
            goto done;
        }
        st_store__jobs_for_section(&m, s, base, jobs, &nj);
    }
    if ((rc = st_store__fetch(st, id, v, mbuf, mlen, &m, jobs, nj)))
        goto done;
    if (logits && (rc = st_image_logits_set(img, logits, g.n_vocab)))
        goto done;
    st_image_state_hash_set(img, m.state_hash);
    if ((rc = st_image_check(img))) {
        rc = st_error_wrap(ST_ECORRUPT, "%s: the stored image is incomplete", what);
        goto done;
    }
    *out = img;
    img = NULL;
done:
    st_image_free(img);
    st_manifest_free(&m);
    free(mbuf);
    free(geo);
    free(gt);
    free(tokens);
    free(logits);
    free(jobs);
    return rc;
}

int st_store_get(st_store *st, const char *id, uint64_t version, st_image **out)
{
    return st_store_get_with(st, id, version, NULL, out);
}

int st_store_get_with(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                      st_image **out)
{
    if (!st || !out)
        return st_error_set(ST_EINVAL, "get: no store or out pointer");
    *out = NULL;
    for (int i = 0; i < ST_GET_RETRIES; i++) {
        int rc = get_once(st, id, version, alloc, out);
        if (rc != ST_CHANGED)
            return rc;
    }
    return st_error_set(ST_EBUSY, "get: session %s kept changing while it was read", id);
}
