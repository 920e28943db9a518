/*
 * st_store_put.c - the put path: an image is cut into chunks on natural boundaries (plan_cut),
 * each chunk framed and hashed by the store's threads (prepare_one, on a stream of st_store_par.c)
 * while one write transaction (put_fn) takes them in order: it inserts each new chunk as soon as
 * it is hashed (so chunk i is written while chunks i+1.. are hashed), counts every reference,
 * adds the manifest, applies retention and writes the session record. Import
 * (st_store_export.c) puts through put_ex. The rules are those of st_lmdb_store.c (invariants
 * 1, 5, 6; of its invariant 2, only the cut stays outside the transaction: the hashing and the
 * state-hash check overlap the writes, so the write lock is held while the last chunks are
 * hashed); besides:
 * 1. put_fn has no effect outside its transaction: st_store__write may run it several times (a
 *    second run finds every chunk hashed).
 * 2. How new chunk bytes reach the file (pwrite or a copy into the map) is the fast path's
 *    (st_store_direct.c); this file only asks it.
 * 3. No chunk is inserted before the session's geometry (chunk 0) was compared, and nothing
 *    commits unless the state-hash check passed: a mismatch or a failed hashing aborts the
 *    transaction (the bytes pwritten into pages it took are free pages again).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_store_lmdb_int.h"

/* ---- cutting an image into chunks --------------------------------------------------------------- */

static void plan_free(st_plan *p)
{
    if (!p)
        return;
    if (p->pieces)
        for (uint32_t i = 0; i < p->m.n_chunks; i++)
            free(p->pieces[i].framed);
    free(p->pieces);
    st_manifest_free(&p->m);
    memset(p, 0, sizeof *p);
}

static int plan_section(st_plan *p, uint32_t type, uint32_t index, uint32_t tensor, const uint8_t *src,
                        uint64_t len, uint64_t unit, uint32_t elem)
{
    if (p->m.n_sec == p->cap_sec) {
        uint32_t cap = p->cap_sec ? p->cap_sec * 2 : 16;
        st_msection *s = realloc(p->m.sec, cap * sizeof *s);
        if (!s)
            return st_error_set(ENOMEM, "put: no memory for the manifest's table of %u sections (%zu bytes)", cap,
                                (size_t)cap * sizeof *s);
        p->m.sec = s;
        p->cap_sec = cap;
    }
    st_msection *sec = &p->m.sec[p->m.n_sec++];
    memset(sec, 0, sizeof *sec);
    sec->type = type;
    sec->index = index;
    sec->tensor = tensor;
    sec->length = len;
    sec->first = p->m.n_chunks;
    if (unit == 0 || unit > len)
        unit = len;
    for (uint64_t off = 0; off < len; off += unit) {
        uint64_t ulen = len - off < unit ? len - off : unit;
        for (uint64_t o = 0; o < ulen; o += ST_STORE_CHUNK_MAX) {
            uint64_t plen = ulen - o < ST_STORE_CHUNK_MAX ? ulen - o : ST_STORE_CHUNK_MAX;
            if (p->m.n_chunks == p->cap_chunks) {
                uint32_t cap = p->cap_chunks ? p->cap_chunks * 2 : 64;
                if (cap > ST_MANIFEST_CHUNKS_MAX)
                    return st_error_set(ST_ETOOBIG, "put: the image needs more than %u chunks",
                                        ST_MANIFEST_CHUNKS_MAX);
                st_piece *np = realloc(p->pieces, cap * sizeof *np);
                if (!np)
                    return st_error_set(ENOMEM, "put: no memory for the plan of %u chunks (%zu bytes)", cap,
                                        (size_t)cap * sizeof *np);
                p->pieces = np;
                p->cap_chunks = cap;
            }
            st_piece *pc = &p->pieces[p->m.n_chunks++];
            memset(pc, 0, sizeof *pc);
            pc->src = src + off + o;
            pc->raw_len = (uint32_t)plen;
            pc->elem = elem;
            sec->n_chunks++;
        }
    }
    return 0;
}

/* Bytes of one group of pages: whole pages, grouped until they reach ST_STORE_CHUNK_MIN, so
 * page boundaries (and shared prefixes) fall on chunk boundaries whatever the row size. */
static uint64_t page_unit(uint32_t page_size, uint64_t row_bytes)
{
    if (row_bytes == 0)
        return 0;
    if (page_size > UINT64_MAX / row_bytes / 64)
        return UINT64_MAX;
    uint64_t page = (uint64_t)page_size * row_bytes;
    uint64_t g = page >= ST_STORE_CHUNK_MIN ? 1 : (ST_STORE_CHUNK_MIN + page - 1) / page;
    return g * page;
}

/* Cut img (geometry record geo) into sections and chunk pieces; file (optional) adds a FILE
 * section with those bytes. */
static int plan_cut(st_plan *p, const st_image *img, const uint8_t *geo, size_t geo_len, const uint8_t *file,
                    size_t file_len)
{
    const st_geometry *g = st_image_geometry(img);
    uint64_t n_tokens = st_image_n_tokens(img);
    int rc = plan_section(p, ST_MSEC_GEOMETRY, 0, 0, geo, geo_len, 0, 0);
    if (rc)
        return rc;
    p->pieces[p->m.n_chunks - 1].no_compress = 1;
    rc = plan_section(p, ST_MSEC_TOKENS, 0, 0, (const uint8_t *)st_image_tokens(img), n_tokens * 4,
                      page_unit(g->page_size, 4), 4);
    for (uint32_t ti = 0; ti < g->n_tensors && !rc; ti++) {
        const st_tensor_desc *t = &g->tensors[ti];
        if (t->role != ST_ROLE_KV)
            continue;
        uint64_t len = 0;
        const uint8_t *kv = st_image_kv_const(img, ti, &len);
        rc = plan_section(p, ST_MSEC_KV, ti, 0, kv, len, page_unit(g->page_size, st_tensor_row_bytes(t)),
                          (uint32_t)st_dtype_size(t->dtype));
    }
    memcpy(p->m.arch, g->arch, ST_ARCH_NAME_MAX); /* the manifest, not the shared geometry record */
    uint32_t n_ckpt = st_image_n_checkpoints(img);
    p->m.ckpt = calloc(n_ckpt ? n_ckpt : 1, sizeof *p->m.ckpt);
    if (!rc && !p->m.ckpt)
        rc = st_error_set(ENOMEM, "put: no memory for the manifest's %u checkpoints (%zu bytes)", n_ckpt,
                          (size_t)(n_ckpt ? n_ckpt : 1) * sizeof *p->m.ckpt);
    for (uint32_t c = 0; c < n_ckpt && !rc; c++) {
        st_mckpt *mc = &p->m.ckpt[p->m.n_ckpt++];
        rc = st_image_checkpoint_info(img, c, &mc->position, &mc->codec);
        for (uint32_t ti = 0; ti < g->n_tensors && !rc; ti++) {
            const st_tensor_desc *t = &g->tensors[ti];
            if (t->role != ST_ROLE_RUNNING)
                continue;
            uint64_t len = 0, elems = st_tensor_elems(t);
            const uint8_t *x = st_image_checkpoint_tensor_const(img, c, ti, &len);
            rc = plan_section(p, ST_MSEC_CKPT, c, ti, x, len, len, (uint32_t)(elems ? len / elems : 0));
        }
    }
    uint32_t n_logits = 0;
    const float *logits = st_image_logits(img, &n_logits);
    if (!rc && n_logits)
        rc = plan_section(p, ST_MSEC_LOGITS, 0, 0, (const uint8_t *)logits, (uint64_t)n_logits * 4, 0, 4);
    if (!rc && file) {
        rc = plan_section(p, ST_MSEC_FILE, 0, 0, file, file_len, ST_STORE_CHUNK_MAX, 0);
        p->m.flags |= ST_MANIFEST_VERBATIM;
    }
    return rc;
}

static int prepare_one(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_plan *p = ctx;
    st_piece *pc = &p->pieces[i];
    pc->stored = pc->src;
    pc->stored_len = pc->raw_len;
    if (p->compress && !pc->no_compress) {
        if (!*fctx && !(*fctx = st_frame_ctx_new()))
            return st_error_set(ENOMEM, "put: no memory for a compression context (to frame a chunk of %u bytes)",
                                pc->raw_len);
        size_t cap = st_frame_bound(pc->raw_len), flen = 0;
        uint8_t *buf = malloc(cap);
        if (!buf)
            return st_error_set(ENOMEM, "put: no memory for %zu bytes to compress a chunk of %u bytes", cap,
                                pc->raw_len);
        unsigned elem = pc->elem == 2 || pc->elem == 4 || pc->elem == 8 ? pc->elem : 0;
        int rc = st_frame_encode(*fctx, buf, cap, pc->src, pc->raw_len, elem, p->compress, &flen);
        if (rc) {
            free(buf);
            return rc;
        }
        if (flen < pc->raw_len) {
            pc->framed = buf;
            pc->stored = buf;
            pc->stored_len = (uint32_t)flen;
        } else {
            free(buf);
        }
    }
    int rc = st_sha256(pc->stored, pc->stored_len, pc->hash);
    if (rc)
        return rc;
    pc->xxh = st_checksum(pc->stored, pc->stored_len);
    st_mchunk *c = &p->m.chunks[i];
    memcpy(c->hash, pc->hash, ST_STORE_HASH_LEN);
    c->xxh = pc->xxh;
    c->raw_len = pc->raw_len;
    c->stored_len = pc->stored_len;
    return 0;
}

/* ---- put ------------------------------------------------------------------------------------------- */

/* Monotonic milliseconds, for STRATA_STORE_TRACE. */
static double trace_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e3 + (double)ts.tv_nsec / 1e6;
}

/* The session holds another geometry: name the first difference. */
static int geometry_mismatch(st_store *st, MDB_txn *txn, const char *id, const st_session_rec *rec,
                             const st_image *img)
{
    MDB_val k = {ST_STORE_HASH_LEN, (void *)rec->geometry_digest}, v;
    st_geometry g;
    st_tensor_desc *t = NULL;
    int rc = mdb_get(txn, st->dbi_chunks, &k, &v);
    if (!rc)
        rc = st_store__value_check(st, &v, "the session's geometry");
    if (!rc)
        rc = st_geometry_decode(v.mv_data, v.mv_size, &g, &t);
    if (rc)
        return st_error_set(ST_EGEOMETRY, "session %s was saved with another geometry (its record is unreadable)", id);
    rc = st_geometry_compare(&g, st_image_geometry(img));
    free(t);
    if (rc)
        return st_error_wrap(rc, "session %s", id);
    return st_error_set(ST_EGEOMETRY, "session %s was saved with another geometry", id);
}

static int put_body(st_store *st, MDB_txn *txn, st_put_ctx *c, st_direct *dp)
{
    st_plan *p = c->plan;
    st_session_rec rec;
    int found = 0;
    memset(&c->stats, 0, sizeof c->stats);
    double tw = trace_ms();
    int rc = st_store__stream_wait(c->hashing, 1); /* the geometry record: the session's digest */
    c->t_wait += trace_ms() - tw;
    if (rc)
        return rc;
    memcpy(c->digest, p->pieces[0].hash, ST_STORE_HASH_LEN);
    rc = st_store__session_get(st, txn, c->id, &rec, &found);
    if (rc)
        return rc;
    if (c->expected == ST_STORE_HEAD_NONE && found)
        return st_error_set(ST_ECONFLICT, "session %s exists (head %llu) but a new session was expected", c->id,
                            (unsigned long long)rec.head);
    if (c->expected != ST_STORE_HEAD_ANY && c->expected != ST_STORE_HEAD_NONE) {
        if (!found)
            return st_error_set(ST_ECONFLICT, "session %s does not exist (expected head %llu)", c->id,
                                (unsigned long long)c->expected);
        if (rec.head != c->expected)
            return st_error_set(ST_ECONFLICT, "session %s: expected head %llu, the head is %llu", c->id,
                                (unsigned long long)c->expected, (unsigned long long)rec.head);
    }
    uint64_t now = st_store_now_ns();
    if (found) {
        if (memcmp(rec.geometry_digest, c->digest, ST_STORE_HASH_LEN))
            return geometry_mismatch(st, txn, c->id, &rec, c->img);
    } else {
        memset(&rec, 0, sizeof rec);
        memcpy(rec.model_fp, st_image_geometry(c->img)->model_fp, ST_FINGERPRINT_LEN);
        memcpy(rec.geometry_digest, c->digest, ST_STORE_HASH_LEN);
        rec.next_version = 1;
        rec.created_ns = now;
    }
    uint64_t version = rec.next_version;
    c->attempts++;
    c->t_fn = trace_ms();
    st_direct *d = dp;
    if ((rc = st_store__direct_begin(st, txn, p, d)))
        return rc;
    c->t_pop = trace_ms();
    c->direct = d->on;
    uint32_t tick = st->verify_tick++;

    for (uint32_t i = 0; i < p->m.n_chunks; i++) {
        const st_piece *pc = &p->pieces[i];
        tw = trace_ms();
        rc = st_store__stream_wait(c->hashing, (size_t)i + 1);
        c->t_wait += trace_ms() - tw;
        if (rc)
            return rc;
        MDB_val k = {ST_STORE_HASH_LEN, (void *)pc->hash}, v;
        rc = st_store__direct_insert(st, txn, d, pc, &v);
        if (rc == 0) {
            c->stats.new_chunks++;
            c->stats.new_bytes += pc->stored_len;
        } else if (rc == MDB_KEYEXIST) {
            /* The chunk is stored: its length is compared always, its bytes (a compare with the
             * fresh bytes, cheaper than a rehash) when its first hash byte plus the put's tick is
             * a multiple of ST_VERIFY_EVERY - about one existing chunk in 16 per put, and each
             * chunk at least once in 16 successive puts of the process. A damaged one is repaired
             * in this transaction with the fresh bytes, which hash to the key. */
            if ((rc = st_store__value_check(st, &v, "put: a stored chunk")))
                return rc;
            if (v.mv_size != pc->stored_len || ((pc->hash[0] + tick) % ST_VERIFY_EVERY == 0 &&
                                                memcmp(v.mv_data, pc->stored, pc->stored_len))) {
                MDB_val rv = {pc->stored_len, NULL};
                if ((rc = mdb_put(txn, st->dbi_chunks, &k, &rv, MDB_RESERVE)))
                    return rc;
                memcpy(rv.mv_data, pc->stored, pc->stored_len);
                c->stats.repaired++;
            }
        } else {
            return rc;
        }
        uint64_t cnt = 0;
        rc = mdb_get(txn, st->dbi_refcounts, &k, &v);
        if (rc == 0 && v.mv_size == 8)
            cnt = st_get64(v.mv_data);
        else if (rc != MDB_NOTFOUND && rc != 0)
            return rc;
        uint8_t b[8];
        st_put64(b, cnt + 1);
        MDB_val cv = {8, b};
        if ((rc = mdb_put(txn, st->dbi_refcounts, &k, &cv, 0)))
            return rc;
    }
    /* every chunk is hashed now, and the state hash must have been checked before anything
     * commits: then the manifest (once; a second run patches it again) */
    tw = trace_ms();
    rc = st_store__stream_wait(c->hashing, 0);
    c->t_wait += trace_ms() - tw;
    if (rc)
        return rc;
    if (!c->mbuf) {
        for (uint32_t i = 0; i < p->m.n_chunks; i++)
            p->m.stored_bytes += p->pieces[i].stored_len;
        if ((rc = st_manifest_encode(&p->m, &c->mbuf, &c->mlen)))
            return rc;
    }
    st_manifest_patch(c->mbuf, c->mlen, version, now);
    uint8_t kb[ST_VKEY_MAX];
    MDB_val k = {st_vkey(kb, c->id, version), kb}, v = {c->mlen, c->mbuf};
    rc = mdb_put(txn, st->dbi_versions, &k, &v, MDB_NOOVERWRITE);
    if (rc == MDB_KEYEXIST)
        return st_error_set(ST_ECORRUPT, "session %s: version %llu exists already but the session's next version "
                            "says it is new", c->id, (unsigned long long)version);
    if (rc)
        return rc;
    rec.head = version;
    rec.next_version = version + 1;
    rec.n_versions++;
    rec.updated_ns = now;
    if (c->label && (rc = st_store__label_apply(&rec, c->id, c->label, version)))
        return rc;
    if ((rc = st_store__prune_txn(st, txn, c->id, &rec, st->keep_last, &c->stats.pruned)))
        return rc;
    if ((rc = st_store__session_put(st, txn, c->id, &rec)))
        return rc;
    c->t_ins = trace_ms();
    c->stats.version = version;
    c->stats.chunks = p->m.n_chunks;
    c->stats.logical_bytes = p->m.logical_bytes;
    c->stats.stored_bytes = p->m.stored_bytes;
    return 0;
}

/* One run of the put's transaction: the body, then (on every path) the end of the fast path's
 * writes, which must all have landed before the transaction commits or aborts. */
static int put_fn(st_store *st, MDB_txn *txn, void *arg)
{
    st_put_ctx *c = arg;
    st_direct d;
    memset(&d, 0, sizeof d);
    int rc = put_body(st, txn, c, &d);
    double t = trace_ms();
    rc = st_store__direct_end(st, &d, rc);
    c->t_drain = trace_ms() - t;
    c->t_pwrite = d.pwrite_ms;
    return rc;
}

/* A version is only kept when a restore of it can succeed: the state hash the image records
 * (nonzero) must be the hash of its own tokens, K/V and live checkpoint (st_store.h, "the state
 * hash"), or the version would be acknowledged and never restore (put_fn waits for this check
 * before it adds the manifest: a mismatch aborts the transaction). */
static int put_state_hash_check(const st_image *img, const char *id)
{
    uint64_t want = st_image_state_hash(img), got = 0;
    if (want == 0)
        return 0;
    int rc = st_image_state_hash_compute(img, NULL, NULL, &got);
    if (rc)
        return rc;
    if (got != want)
        return st_error_set(ST_ECORRUPT, "put %s: state hash mismatch: the image records %016llx, "
                            "its content hashes to %016llx (a restore would fail): nothing was "
                            "written", id, (unsigned long long)want, (unsigned long long)got);
    return 0;
}

/* The items of a put's stream: 0 checks the state hash (on one thread, beside the hashing of
 * the chunks), i > 0 hashes and frames chunk i - 1. */
static int put_item(void *ctx, size_t i, st_frame_ctx **fctx)
{
    st_put_ctx *c = ctx;
    if (i > 0)
        return prepare_one(c->plan, i - 1, fctx);
    double t = trace_ms();
    int rc = put_state_hash_check(c->img, c->id);
    c->t_state = trace_ms() - t;
    return rc;
}

int st_store__put_ex(st_store *st, const char *id, const st_image *img, uint64_t expected, const st_put_opts *opts,
                  const st_file_as *fa, uint64_t *version)
{
    st_plan plan;
    uint8_t *geo = NULL;
    size_t geo_len = 0;
    st_put_ctx c;
    int rc;
    memset(&plan, 0, sizeof plan);
    memset(&c, 0, sizeof c);
    if (!st || !img)
        return st_error_set(ST_EINVAL, "put: no store or image");
    if (!st_store_id_valid(id))
        return st_error_set(ST_EINVAL, "put: invalid session id (1..%d bytes of A-Z a-z 0-9 . _ : + = -)",
                            ST_STORE_ID_MAX);
    if (opts && opts->label && !st_store_id_valid(opts->label))
        return st_error_set(ST_EINVAL, "put: invalid label name");
    if (opts && opts->label && strlen(opts->label) >= ST_STORE_LABEL_MAX)
        return st_error_set(ST_EINVAL, "put: label longer than %d bytes", ST_STORE_LABEL_MAX - 1);
    if (opts && (opts->compress < 0 || opts->compress > 19))
        return st_error_set(ST_EINVAL, "put: compression level %d is not 0..19", opts->compress);
    if ((rc = st_image_check(img)))
        return rc;
    if ((rc = st_geometry_encode(st_image_geometry(img), &geo, &geo_len)))
        return rc;
    plan.compress = opts ? opts->compress : 0;
    rc = plan_cut(&plan, img, geo, geo_len, fa ? fa->verbatim : NULL, fa ? fa->verbatim_len : 0);
    if (!rc) {
        plan.m.chunks = calloc(plan.m.n_chunks ? plan.m.n_chunks : 1, sizeof *plan.m.chunks);
        if (!plan.m.chunks)
            rc = st_error_set(ENOMEM, "put: no memory for the manifest's table of %u chunks (%zu bytes)",
                              plan.m.n_chunks, (size_t)plan.m.n_chunks * sizeof *plan.m.chunks);
    }
    if (rc)
        goto done;
    /* From here the state hash is checked and the chunks hashed and framed on the store's
     * threads while this thread writes them in order (put_fn waits for each). */
    double t0 = trace_ms();
    uint64_t total = st_image_bytes(img);
    unsigned threads = total < ST_PAR_MIN_BYTES ? 1 : st->threads;
    plan.m.state_hash = st_image_state_hash(img);
    plan.m.n_tokens = st_image_n_tokens(img);
    plan.m.logical_bytes = total;
    plan.m.compress = (uint32_t)plan.compress;
    if (fa) {
        plan.m.file_version = fa->version;
        plan.m.file_compress = fa->compress;
        plan.m.file_shuffle = fa->shuffle;
    }
    c.id = id;
    c.plan = &plan;
    c.img = img;
    c.expected = expected;
    c.label = opts ? opts->label : NULL;
    if (!(rc = st_store__stream_start(threads > 1 ? threads : 0, (size_t)plan.m.n_chunks + 1, put_item, &c,
                                      &c.hashing)))
        rc = st_store__write(st, put_fn, &c);
    double t_hashed = st_store__stream_stop(c.hashing);
    c.hashing = NULL;
    if (rc)
        goto done;
    if (getenv("STRATA_STORE_TRACE") && *getenv("STRATA_STORE_TRACE"))
        fprintf(stderr, "strata store put %s: %.1f MB in %u chunks (%u new): state hash %.1f ms, "
                "chunks hashed and framed at %.1f ms, reserve %.1f ms, inserts %.1f ms (%.1f ms of "
                "them waiting for hashes), the writer's last pwrite %.1f ms later (%.1f ms in pwrite), commit %.1f ms, put "
                "%.1f ms (%d attempt%s; %s)\n", id,
                (double)total / 1e6, plan.m.n_chunks, c.stats.new_chunks, c.t_state,
                t_hashed > 0 ? t_hashed - t0 : 0.0, c.t_pop - c.t_fn, c.t_ins - c.t_pop, c.t_wait,
                c.t_drain, c.t_pwrite, trace_ms() - c.t_ins - c.t_drain, trace_ms() - t0, c.attempts, c.attempts == 1 ? "" : "s",
                c.direct ? "fast path: pwrite" : st->direct ? "fast path: copied" : "plain mdb_put");
    if (version)
        *version = c.stats.version;
    if (opts && opts->stats)
        *opts->stats = c.stats;
done:
    st_store__stream_stop(c.hashing);
    free(c.mbuf);
    free(geo);
    plan_free(&plan);
    return rc;
}

int st_store_put(st_store *st, const char *id, const st_image *img, uint64_t expected_head,
                 const st_put_opts *opts, uint64_t *version)
{
    return st_store__put_ex(st, id, img, expected_head, opts, NULL, version);
}
