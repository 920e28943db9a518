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

/* Inside read transaction txn: check that the manifest is still the one in mbuf (else
 * ST_CHANGED), then point each job at its chunk's stored bytes in the map (valid until the
 * transaction ends) and, with stage, give each framed chunk its place in the stage. */
static int fetch_resolve(st_store *st, MDB_txn *txn, const char *id, uint64_t version, const uint8_t *mbuf,
                         size_t mlen, const st_manifest *m, st_job *jobs, size_t n, uint8_t *stage)
{
    int rc;
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, id, version), kb}, v;
    rc = mdb_get(txn, st->dbi_versions, &k, &v);
    if (rc == MDB_NOTFOUND) {
        return st_error_set(ST_ENOTFOUND, "version %llu of session %s was deleted while it was read",
                            (unsigned long long)version, id);
    }
    if (!rc)
        rc = st_store__value_check(st, &v, "a manifest");
    if (rc)
        return rc;
    if (v.mv_size != mlen || memcmp(v.mv_data, mbuf, mlen))
        return ST_CHANGED;
    uint64_t off = 0;
    for (size_t i = 0; i < n; i++) {
        st_job *j = &jobs[i];
        const st_mchunk *c = &m->chunks[j->chunk];
        MDB_val ck = {ST_STORE_HASH_LEN, (void *)c->hash}, cv;
        rc = mdb_get(txn, st->dbi_chunks, &ck, &cv);
        if (rc == 0 && cv.mv_size != c->stored_len)
            rc = MDB_CORRUPTED;
        if (rc == 0 && (rc = st_store__value_check(st, &cv, "a chunk")))
            return rc;
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
            return rc;
        }
        j->src = cv.mv_data;
        j->staged = NULL;
        if (stage && c->stored_len < c->raw_len) {
            j->staged = stage + off;
            off += c->stored_len;
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
    if ((rc = st_store__rtxn(st, &txn)) || (rc = fetch_resolve(st, txn, id, version, mbuf, mlen, m, jobs, n, stage)))
        goto unlock;
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

/* A get up to the image with its tokens and checkpoints but none of their bytes: the manifest,
 * the geometry (one chunk of at most 4 MiB: every other length is checked against it before
 * anything is allocated for it) and the tokens, each copied out of its own read transaction
 * and checked after it ends (invariant 3). */
typedef struct get_ctx {
    uint8_t *mbuf;
    size_t mlen;
    uint64_t v;
    st_manifest m;
    st_job *jobs;
    st_image *img;
    char what[ST_STORE_ID_MAX + 64];
} get_ctx;

static void get_ctx_free(get_ctx *gc)
{
    st_image_free(gc->img);
    st_manifest_free(&gc->m);
    free(gc->mbuf);
    free(gc->jobs);
    memset(gc, 0, sizeof *gc);
}

static int get_prepare(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                       get_ctx *gc)
{
    uint8_t *geo = NULL;
    st_session_rec rec;
    st_geometry g;
    st_tensor_desc *gt = NULL;
    uint32_t *tokens = NULL;
    size_t nj = 0;
    memset(gc, 0, sizeof *gc);
    int rc = st_store__manifest_read(st, id, version, &gc->v, &gc->mbuf, &gc->mlen, &rec);
    if (rc)
        return rc;
    st_manifest *m = &gc->m;
    snprintf(gc->what, sizeof gc->what, "session %s version %llu", id, (unsigned long long)gc->v);
    const char *what = gc->what;
    if ((rc = st_manifest_parse(gc->mbuf, gc->mlen, what, m)))
        goto done;
    if (m->n_sec < 2 || m->sec[0].type != ST_MSEC_GEOMETRY || m->sec[0].n_chunks != 1 ||
        m->chunks[0].stored_len != m->chunks[0].raw_len || m->sec[1].type != ST_MSEC_TOKENS) {
        rc = st_error_set(ST_ECORRUPT, "%s: manifest does not start with a geometry and tokens", what);
        goto done;
    }
    gc->jobs = calloc(m->n_chunks ? m->n_chunks : 1, sizeof *gc->jobs);
    geo = malloc(m->chunks[0].raw_len);
    if (!gc->jobs || !geo) {
        rc = st_error_set(ENOMEM, "%s: no memory for %u chunk jobs (%zu bytes) and the %u-byte geometry", what,
                          m->n_chunks, (size_t)(m->n_chunks ? m->n_chunks : 1) * sizeof *gc->jobs,
                          m->chunks[0].raw_len);
        goto done;
    }
    st_store__jobs_for_section(m, 0, geo, gc->jobs, &nj);
    if ((rc = st_store__fetch(st, id, gc->v, gc->mbuf, gc->mlen, m, gc->jobs, nj)))
        goto done;
    if ((rc = st_geometry_decode(geo, m->chunks[0].raw_len, &g, &gt)))
        goto done;
    memcpy(g.arch, m->arch, ST_ARCH_NAME_MAX);
    if ((rc = st_store__manifest_layout_check(m, &g, what)))
        goto done;
    /* then the tokens (n_tokens <= n_ctx now), to build the image */
    if (!(tokens = malloc(m->sec[1].length ? m->sec[1].length : 1))) {
        rc = st_error_set(ENOMEM, "%s: no memory for %llu tokens (%llu bytes)", what, (unsigned long long)m->n_tokens,
                          (unsigned long long)m->sec[1].length);
        goto done;
    }
    nj = 0;
    st_store__jobs_for_section(m, 1, (uint8_t *)tokens, gc->jobs, &nj);
    if ((rc = st_store__fetch(st, id, gc->v, gc->mbuf, gc->mlen, m, gc->jobs, nj)))
        goto done;
    /* every K/V row and checkpoint tensor is one of the sections copied next (the layout
     * check), so nothing is zeroed first; an image whose copy fails is freed */
    if ((rc = st_image_create_with(&gc->img, &g, alloc)))
        goto done;
    if ((rc = st_image_tokens_set_unzeroed(gc->img, tokens, m->n_tokens)))
        goto done;
    for (uint32_t c = 0; c < m->n_ckpt; c++)
        if ((rc = st_image_checkpoint_add_unzeroed(gc->img, m->ckpt[c].position, m->ckpt[c].codec, NULL))) {
            rc = st_error_wrap(ST_ECORRUPT, "%s: checkpoint %u", what, c);
            goto done;
        }
    st_image_state_hash_set(gc->img, m->state_hash);
done:
    free(geo);
    free(gt);
    free(tokens);
    if (rc)
        get_ctx_free(gc);
    return rc;
}

/* Where section s (K/V or checkpoint) goes in the image, checked against its length. */
static int section_dst(get_ctx *gc, uint32_t s, uint8_t **base)
{
    const st_msection *sec = &gc->m.sec[s];
    uint64_t len = 0;
    *base = sec->type == ST_MSEC_KV     ? st_image_kv(gc->img, sec->index, &len)
            : sec->type == ST_MSEC_CKPT ? st_image_checkpoint_tensor(gc->img, sec->index, sec->tensor, &len)
                                        : NULL;
    if (!*base || len != sec->length)
        return st_error_set(*base ? ST_ECORRUPT : ENOMEM, "%s: section %u of %llu bytes does not fit the image",
                            gc->what, s, (unsigned long long)sec->length);
    return 0;
}

/* The logits section (when there is one) into the image. */
static int get_logits(st_store *st, const char *id, get_ctx *gc, uint32_t s)
{
    const st_msection *sec = &gc->m.sec[s];
    size_t nj = 0;
    float *logits = malloc(sec->length ? sec->length : 1);
    if (!logits)
        return st_error_set(ENOMEM, "%s: no memory for %llu bytes of logits", gc->what,
                            (unsigned long long)sec->length);
    st_store__jobs_for_section(&gc->m, s, (uint8_t *)logits, gc->jobs, &nj);
    int rc = st_store__fetch(st, id, gc->v, gc->mbuf, gc->mlen, &gc->m, gc->jobs, nj);
    if (!rc)
        rc = st_image_logits_set(gc->img, logits, st_image_geometry(gc->img)->n_vocab);
    free(logits);
    return rc;
}

/* Three read transactions: the geometry, the tokens, everything else; each copies out and ends
 * before its chunks are checked (invariant 3). A manifest replaced in between makes fetch
 * answer ST_CHANGED and the caller start over. */
static int get_once(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                    st_image **out)
{
    get_ctx gc;
    size_t nj = 0;
    float *logits = NULL;
    int rc = get_prepare(st, id, version, alloc, &gc);
    if (rc)
        return rc;
    const st_manifest *m = &gc.m;
    /* everything else, straight into the image */
    for (uint32_t s = 2; s < m->n_sec; s++) {
        const st_msection *sec = &m->sec[s];
        uint8_t *base = NULL;
        if (sec->type == ST_MSEC_LOGITS) {
            if (!(logits = malloc(sec->length ? sec->length : 1))) {
                rc = st_error_set(ENOMEM, "%s: no memory for %llu bytes of logits", gc.what,
                                  (unsigned long long)sec->length);
                goto done;
            }
            base = (uint8_t *)logits;
        } else if (sec->type != ST_MSEC_KV && sec->type != ST_MSEC_CKPT) {
            continue; /* FILE: only export reads it */
        } else if ((rc = section_dst(&gc, s, &base))) {
            goto done;
        }
        st_store__jobs_for_section(m, s, base, gc.jobs, &nj);
    }
    if ((rc = st_store__fetch(st, id, gc.v, gc.mbuf, gc.mlen, m, gc.jobs, nj)))
        goto done;
    if (logits && (rc = st_image_logits_set(gc.img, logits, st_image_geometry(gc.img)->n_vocab)))
        goto done;
    if ((rc = st_image_check(gc.img))) {
        rc = st_error_wrap(ST_ECORRUPT, "%s: the stored image is incomplete", gc.what);
        goto done;
    }
    *out = gc.img;
    gc.img = NULL;
done:
    free(logits);
    get_ctx_free(&gc);
    return rc;
}

/* ---- the streamed get: chunks copied while the caller reads the image ---------------------------
 * get_prepare (and the logits) as a get, then one more read transaction, held by the fill's own
 * thread (with the store's lock, invariant 4) while the store's threads copy each chunk out of
 * the map into the image, checking it as it is copied: a piece at a time, hashed from the copy
 * while it is in cache (a framed chunk: its stored bytes checked in the map, then decoded from
 * there). The jobs run in the order a restore reads: for each geometry tensor its K/V section or
 * its live-checkpoint section, then the other checkpoints. The image's gate (st_image_wait)
 * waits for the jobs a byte range overlaps (jobs sorted by destination, found by bisection). */
#define FILL_PIECE (256u << 10)

typedef struct fill_ref {
    const uint8_t *dst;
    uint64_t len;
    size_t item;
} fill_ref;

struct st_store_fill {
    st_store *st;
    get_ctx gc;
    char id[ST_STORE_ID_MAX + 1];
    size_t n;
    fill_ref *refs;  /* the jobs by destination */
    int sha;
    pthread_t tid;
    int thread_started;
    pthread_mutex_t mu; /* with cv: stream published, or the fill over */
    pthread_cond_t cv;
    st_stream *stream;  /* under mu once published; freed by st_store_stream_end */
    int over, rc;       /* under mu */
    char detail[512];
};

static int fill_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_store_fill *f = ctx;
    const st_job *j = &f->gc.jobs[i];
    const st_mchunk *c = &f->gc.m.chunks[j->chunk];
    const uint8_t *src = j->src;
    int framed = c->stored_len < c->raw_len, ok, rc = 0;
    st_sha256_ctx sh;
    st_checksum_state xs;
    memset(&xs, 0, sizeof xs);
    if (f->sha ? (rc = st_sha256_init(&sh)) : (rc = st_checksum_init(&xs)))
        return rc;
    for (uint64_t o = 0; o < c->stored_len; o += FILL_PIECE) {
        uint64_t k = c->stored_len - o < FILL_PIECE ? c->stored_len - o : FILL_PIECE;
        const uint8_t *h = src + o;
        if (!framed) {
            memcpy(j->dst + o, src + o, k);
            h = j->dst + o; /* the bytes handed over are the ones checked */
        }
        if (f->sha)
            st_sha256_update(&sh, h, k);
        else
            st_checksum_update(&xs, h, k);
    }
    if (f->sha) {
        uint8_t d[ST_STORE_HASH_LEN];
        rc = st_sha256_final(&sh, d);
        ok = !rc && !memcmp(d, c->hash, ST_STORE_HASH_LEN);
    } else {
        ok = st_checksum_final(&xs) == c->xxh;
        st_checksum_free(&xs);
    }
    char hex[2 * ST_STORE_HASH_LEN + 1];
    if (rc)
        return rc;
    if (!ok) {
        st_hex_encode(hex, c->hash, ST_STORE_HASH_LEN);
        return st_error_set(ST_ECORRUPT, "chunk %s of %s: %s mismatch (stored bytes damaged)", hex, f->gc.what,
                            f->sha ? "SHA-256" : "checksum");
    }
    if (framed) {
        if (!*fctx && !(*fctx = st_frame_ctx_new()))
            return st_error_set(ENOMEM, "no memory for a decompression context (for a chunk of %u bytes)",
                                c->raw_len);
        size_t out = 0;
        rc = st_frame_decode(*fctx, j->dst, c->raw_len, src, c->stored_len, &out);
        if (rc || out != c->raw_len) {
            st_hex_encode(hex, c->hash, ST_STORE_HASH_LEN);
            return st_error_set(ST_ECORRUPT, "chunk %s of %s: frame does not decode to %u bytes", hex, f->gc.what,
                                c->raw_len);
        }
    }
    return 0;
}

/* Publish the stream (waiters may now wait for its items). */
static void fill_publish(st_store_fill *f, st_stream *s)
{
    pthread_mutex_lock(&f->mu);
    f->stream = s;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* The fill's thread: the read transaction, the stream, every job waited for (helping), the
 * helpers joined (none reads the map any more), then the transaction ended. */
static void *fill_run(void *arg)
{
    st_store_fill *f = arg;
    st_store *st = f->st;
    MDB_txn *txn = NULL;
    st_stream *s = NULL;
    uint64_t bytes = 0;
    for (size_t i = 0; i < f->n; i++)
        bytes += f->gc.m.chunks[f->gc.jobs[i].chunk].stored_len;
    pthread_rwlock_rdlock(&st->lock);
    int rc = st_store__rtxn(st, &txn);
    if (!rc)
        rc = fetch_resolve(st, txn, f->id, f->gc.v, f->gc.mbuf, f->gc.mlen, &f->gc.m, f->gc.jobs, f->n, NULL);
    if (rc == ST_CHANGED)
        rc = st_error_set(ST_EBUSY, "%s changed while it was read", f->gc.what);
    if (!rc)
        rc = st_store__stream_start(bytes < ST_PAR_MIN_BYTES || st->fill_threads < 2 ? 0 : st->fill_threads - 1,
                                    f->n, fill_one, f, &s);
    if (!rc) {
        fill_publish(f, s);
        for (size_t i = 0; !rc && i < f->n; i++)
            rc = st_store__stream_wait(s, i);
        st_store__stream_join(s);
    }
    if (txn)
        mdb_txn_abort(txn);
    pthread_rwlock_unlock(&st->lock);
    if (rc)
        rc = st_store__edge(rc, "reading chunks");
    pthread_mutex_lock(&f->mu);
    f->over = 1;
    f->rc = rc;
    if (rc)
        snprintf(f->detail, sizeof f->detail, "%s", st_errdetail());
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return NULL;
}

static int fill_ref_cmp(const void *a, const void *b)
{
    const fill_ref *x = a, *y = b;
    return x->dst < y->dst ? -1 : x->dst > y->dst;
}

/* The image's gate: every job overlapping [p, p + len) done (p NULL: every job). */
static int fill_wait(void *ctx, const void *p, uint64_t len)
{
    st_store_fill *f = ctx;
    /* published before the gate was set (st_store_get_stream waits for it) */
    pthread_mutex_lock(&f->mu);
    st_stream *s = f->stream;
    pthread_mutex_unlock(&f->mu);
    int rc;
    if (!p) {
        for (size_t i = 0; i < f->n; i++)
            if ((rc = st_store__stream_wait_idle(s, i)))
                return rc;
        return 0;
    }
    const uint8_t *a = p, *b = a + len;
    size_t lo = 0, hi = f->n; /* the first job ending after a */
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (f->refs[mid].dst + f->refs[mid].len <= a)
            lo = mid + 1;
        else
            hi = mid;
    }
    for (size_t i = lo; i < f->n && f->refs[i].dst < b; i++)
        if ((rc = st_store__stream_wait_idle(s, f->refs[i].item)))
            return rc;
    return 0;
}

static void fill_free(st_store_fill *f)
{
    pthread_cond_destroy(&f->cv);
    pthread_mutex_destroy(&f->mu);
    free(f->refs);
    get_ctx_free(&f->gc);
    free(f);
}

int st_store_get_stream(st_store *st, const char *id, uint64_t version, const st_image_allocator *alloc,
                        st_image **out, st_store_fill **fill)
{
    if (!st || !out || !fill)
        return st_error_set(ST_EINVAL, "get: no store, out pointer or fill pointer");
    *out = NULL;
    *fill = NULL;
    st_store_fill *f = calloc(1, sizeof *f);
    if (!f)
        return st_error_set(ENOMEM, "get: no memory for a fill");
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    f->st = st;
    f->sha = st->opts.verify_sha256;
    int rc = ST_CHANGED;
    for (int i = 0; i < ST_GET_RETRIES && rc == ST_CHANGED; i++)
        rc = get_prepare(st, id, version, alloc, &f->gc);
    if (rc == ST_CHANGED)
        rc = st_error_set(ST_EBUSY, "get: session %s kept changing while it was read", id);
    if (rc) {
        fill_free(f);
        return rc;
    }
    snprintf(f->id, sizeof f->id, "%s", id);
    const st_manifest *m = &f->gc.m;
    const st_geometry *g = st_image_geometry(f->gc.img);
    uint32_t nt = g->n_tensors, live = m->n_ckpt - 1;
    uint32_t *kv_sec = calloc(nt ? nt : 1, sizeof *kv_sec), *ck_sec = calloc(nt ? nt : 1, sizeof *ck_sec);
    uint8_t *queued = calloc(m->n_sec, 1);
    f->refs = calloc(m->n_chunks ? m->n_chunks : 1, sizeof *f->refs);
    if (!kv_sec || !ck_sec || !queued || !f->refs) {
        rc = st_error_set(ENOMEM, "%s: no memory for the fill's order of %u chunks", f->gc.what, m->n_chunks);
        goto fail;
    }
    /* the logits now (small), then the order of a restore's reads (sections 0 and 1 are done) */
    for (uint32_t s = 2; s < m->n_sec; s++) {
        const st_msection *sec = &m->sec[s];
        if (sec->type == ST_MSEC_LOGITS && (rc = get_logits(st, id, &f->gc, s))) {
            if (rc == ST_CHANGED) /* deleted and put again in between: an internal code */
                rc = st_error_set(ST_EBUSY, "%s changed while it was read", f->gc.what);
            goto fail;
        }
        if (sec->type == ST_MSEC_KV)
            kv_sec[sec->index] = s;
        else if (sec->type == ST_MSEC_CKPT && sec->index == live)
            ck_sec[sec->tensor] = s;
        queued[s] = sec->type != ST_MSEC_KV && sec->type != ST_MSEC_CKPT;
    }
    if ((rc = st_image_check(f->gc.img))) {
        rc = st_error_wrap(ST_ECORRUPT, "%s: the stored image is incomplete", f->gc.what);
        goto fail;
    }
    /* first, tensor by tensor, its K/V section or its live checkpoint section; then every
     * section not queued yet (the other checkpoints) in manifest order */
    for (uint32_t k = 0; k < nt + m->n_sec; k++) {
        uint32_t s = k < nt ? (kv_sec[k] ? kv_sec[k] : ck_sec[k]) : k - nt;
        uint8_t *base = NULL;
        if (s < 2 || queued[s])
            continue;
        if ((rc = section_dst(&f->gc, s, &base)))
            goto fail;
        queued[s] = 1;
        size_t first = f->n;
        st_store__jobs_for_section(m, s, base, f->gc.jobs, &f->n);
        for (size_t i = first; i < f->n; i++)
            f->refs[i] = (fill_ref){f->gc.jobs[i].dst, m->chunks[f->gc.jobs[i].chunk].raw_len, i};
    }
    qsort(f->refs, f->n, sizeof *f->refs, fill_ref_cmp);
    if (pthread_create(&f->tid, NULL, fill_run, f)) {
        rc = st_error_set(EAGAIN, "%s: could not start the fill's thread", f->gc.what);
        goto fail;
    }
    f->thread_started = 1;
    /* the fill's thread holds the store's lock and its transaction before the caller goes on:
     * a restore then waits on CPU-bound copying only, never on the lock (which prefers a
     * queued writer) while it holds its engine */
    pthread_mutex_lock(&f->mu);
    while (!f->stream && !f->over)
        pthread_cond_wait(&f->cv, &f->mu);
    int started = f->stream != NULL;
    pthread_mutex_unlock(&f->mu);
    if (!started) {
        pthread_join(f->tid, NULL);
        f->thread_started = 0;
        rc = f->rc ? st_error_set(f->rc, "%s", f->detail) : st_error_set(ST_EIO, "%s: the fill did not start", f->gc.what);
        goto fail;
    }
    st_image_gate gate = {fill_wait, f};
    st_image_gate_set(f->gc.img, &gate);
    free(kv_sec);
    free(ck_sec);
    free(queued);
    *out = f->gc.img;
    *fill = f;
    return 0;
fail:
    free(kv_sec);
    free(ck_sec);
    free(queued);
    fill_free(f);
    return rc;
}

int st_store_stream_end(st_store_fill *f)
{
    if (!f)
        return 0;
    if (f->thread_started)
        pthread_join(f->tid, NULL);
    int rc = f->rc;
    char detail[512];
    snprintf(detail, sizeof detail, "%s", f->detail);
    st_store__stream_stop(f->stream);
    st_image_gate_set(f->gc.img, NULL);
    f->gc.img = NULL; /* the caller's */
    fill_free(f);
    return rc ? st_error_set(rc, "%s", detail) : 0;
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
