/*
 * st_tier_xfer.c - a saved version between the local store and the shared tier (st_store.h,
 * "a version between the local store and the tier"; docs/SCALE.md).
 *
 * Invariants:
 * 1. The wire form of a version is its session file (st_file.h), version 2, uncompressed, so
 *    that the tier holds the one format the project writes for a conversation, and identical
 *    state (a shared system prompt's K/V pages) is identical bytes. The file is cut into pieces
 *    at content-defined boundaries (a gear hash over the bytes: a cut where its low
 *    TX_MASK_BITS bits are zero, no piece shorter than TX_PIECE_MIN unless it ends the file, none
 *    longer than ST_TIER_PIECE_MAX), so that the same run of bytes cuts the same way wherever it
 *    sits in a file and two conversations sharing a prefix share its pieces in the tier. Each
 *    piece is a tier chunk under its SHA-256, written only if absent.
 * 2. The tier manifest (little-endian; TX_MAN_HDR bytes of header, TX_MAN_ENT per piece, an
 *    8-byte trailer):
 *      0  u32 magic "STTM"         4  u16 format 1      6  u16 flags 0
 *      8  u64 file bytes          16  u64 XXH3-64 of the file (st_checksum), 24 bytes 0
 *     48  u32 pieces              52  u32 0
 *     then per piece: 32 bytes SHA-256, u32 length; then the first 8 bytes of the SHA-256 of
 *     everything before it.
 *    A reader checks every field, bound and sum before it allocates anything by them (the file
 *    at most the caller's max_bytes), every piece against its hash as it arrives, and the file
 *    against the manifest's hash before reading it as a session file (which checks it again).
 * 3. Push order: the pieces, then the manifest under a tier version (immutable), then the head
 *    moved to that version by compare-and-set from the version the caller extends. A reader
 *    follows the head only, so it never sees a version whose pieces or manifest are not all
 *    written. A manifest left by a pusher that failed before its compare-and-set (a tier version
 *    the head never reached) is skipped: the next push takes the next free version number
 *    (tier versions grow but need not be consecutive). With replicas > 0 the push returns only
 *    after st_tier_sync confirmed every write on that many replicas.
 * 4. Pull puts the version into the local store with st_store_put (one transaction): on any
 *    error the local store is unchanged.
 * 5. Pieces move TX_PAR at a time: the cuts are found first (one pass), then the store's thread
 *    pool (st_store__par_run: TX_PAR threads, each taking the next piece) moves them, so that
 *    several pieces are in flight on the tier client's connections (pipelined: st_tier.c
 *    invariant 5) and their SHA-256 runs on several cores. The first failure stops the rest
 *    from starting; its code and detail are the call's. The manifest lists the pieces in file
 *    order whatever order they went in.
 */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "st_codec.h"
#include "st_file.h"
#include "st_store.h"
#include "st_store_lmdb_int.h" /* st_store__par_run */

#define TX_MAN_MAGIC 0x4d545453u /* "STTM" */
#define TX_MAN_FORMAT 1u
#define TX_MAN_HDR 56u
#define TX_MAN_ENT 36u
#define TX_MAN_TRAILER 8u
#define TX_PIECE_MIN (64u << 10)
#define TX_MASK_BITS 17 /* pieces of about 64 KiB + 128 KiB on average */
#define TX_SKIP_MAX 64  /* tier versions past orphaned manifests tried by one push */
#define TX_PAR 4        /* pieces in flight at once (invariant 5) */

/* ---- content-defined cuts (invariant 1) ---------------------------------------------------- */
static uint64_t g_gear[256];
static pthread_once_t g_gear_once = PTHREAD_ONCE_INIT;

static void gear_init(void)
{
    uint64_t x = 0x5354524154412d47ull; /* a fixed seed: the same cuts on every node */
    for (int i = 0; i < 256; i++) {
        x += 0x9e3779b97f4a7c15ull; /* splitmix64 */
        uint64_t z = x;
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        g_gear[i] = z ^ (z >> 31);
    }
}

/* The length of the piece that starts at p (n bytes left). */
static size_t cut_len(const uint8_t *p, size_t n)
{
    if (n <= TX_PIECE_MIN)
        return n;
    size_t lim = n < ST_TIER_PIECE_MAX ? n : ST_TIER_PIECE_MAX;
    const uint64_t mask = (1ull << TX_MASK_BITS) - 1;
    uint64_t h = 0;
    /* the hash of a byte is shifted out after 64 more: start 64 before the first allowed cut */
    for (size_t i = TX_PIECE_MIN - 64; i < lim; i++) {
        h = (h << 1) + g_gear[p[i]];
        if (i + 1 >= TX_PIECE_MIN && !(h & mask))
            return i + 1;
    }
    return lim;
}

/* ---- push ----------------------------------------------------------------------------------- */
typedef struct push_ctx {
    st_tier *t;
    const uint8_t *file;
    const size_t *off; /* piece i starts at off[i], ends at off[i + 1] */
    uint8_t *man;
    _Atomic uint32_t new_pieces;
    _Atomic uint64_t new_bytes;
} push_ctx;

/* Piece i of a push (invariant 5, on st_store__par_run). */
static int push_piece(void *arg, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    push_ctx *c = arg;
    uint8_t *e = c->man + TX_MAN_HDR + i * TX_MAN_ENT;
    size_t len = c->off[i + 1] - c->off[i];
    int written = 0;
    int rc = st_sha256(c->file + c->off[i], len, e);
    if (!rc)
        rc = st_tier_chunk_put(c->t, e, c->file + c->off[i], len, &written);
    if (rc)
        return rc;
    st_put32(e + 32, (uint32_t)len);
    if (written) {
        atomic_fetch_add(&c->new_pieces, 1);
        atomic_fetch_add(&c->new_bytes, (uint64_t)len);
    }
    return 0;
}

int st_tier_push(st_tier *t, st_store *st, const char *id, uint64_t version, uint64_t expect,
                 uint32_t replicas, uint32_t wait_ms, st_tier_xfer_stats *out)
{
    if (!t || !st || !id)
        return st_error_set(ST_EINVAL, "tier push: NULL argument");
    pthread_once(&g_gear_once, gear_init);
    st_tier_xfer_stats s;
    memset(&s, 0, sizeof s);
    st_image *img = NULL;
    uint8_t *file = NULL, *man = NULL;
    size_t *offs = NULL;
    size_t flen = 0, np = 0, cap = 0;
    int rc = st_store_get(st, id, version, &img);
    if (rc)
        return rc;
    st_file_write_opts fo;
    memset(&fo, 0, sizeof fo);
    fo.version = 2;
    rc = st_file_write_mem(img, &fo, &file, &flen);
    st_image_free(img);
    if (rc)
        return rc;
    s.bytes = flen;
    /* the cuts (invariant 1), then the pieces (invariant 5), their entries in the manifest */
    for (size_t o = 0; o < flen;) {
        if (np + 1 >= cap) {
            size_t nc = cap ? 2 * cap : 64;
            size_t *no = realloc(offs, nc * sizeof *offs);
            if (!no) {
                rc = st_error_set(ENOMEM, "tier push: %s: the cuts of %zu pieces", id, nc);
                goto out;
            }
            offs = no;
            cap = nc;
        }
        offs[np++] = o;
        o += cut_len(file + o, flen - o);
    }
    if (!offs && !(offs = malloc(sizeof *offs))) {
        rc = st_error_set(ENOMEM, "tier push: %s: the cuts", id);
        goto out;
    }
    offs[np] = flen;
    if (!(man = malloc(TX_MAN_HDR + np * TX_MAN_ENT + TX_MAN_TRAILER))) {
        rc = st_error_set(ENOMEM, "tier push: %s: the manifest of %zu pieces", id, np);
        goto out;
    }
    push_ctx pc = {.t = t, .file = file, .off = offs, .man = man};
    if ((rc = st_store__par_run(TX_PAR, np, push_piece, &pc)))
        goto out;
    s.new_pieces = atomic_load(&pc.new_pieces);
    s.new_bytes = atomic_load(&pc.new_bytes);
    s.pieces = (uint32_t)np;
    st_put32(man, TX_MAN_MAGIC);
    st_put16(man + 4, TX_MAN_FORMAT);
    st_put16(man + 6, 0);
    st_put64(man + 8, flen);
    st_put64(man + 16, st_checksum(file, flen)); /* the pieces are SHA-256'd already */
    memset(man + 24, 0, 24);
    st_put32(man + 48, (uint32_t)np);
    st_put32(man + 52, 0);
    size_t mlen = TX_MAN_HDR + np * TX_MAN_ENT;
    uint8_t dig[ST_SHA256_LEN];
    if ((rc = st_sha256(man, mlen, dig)))
        goto out;
    memcpy(man + mlen, dig, TX_MAN_TRAILER);
    mlen += TX_MAN_TRAILER;
    /* the manifest under the next free version, then the head (invariant 3) */
    uint64_t head = 0;
    if ((rc = st_tier_head_get(t, id, &head)))
        goto out;
    if (expect != ST_TIER_HEAD_CURRENT && expect != head) {
        rc = st_error_set(ST_ECONFLICT, "tier push: %s: the tier's head is version %llu, not %llu "
                          "(another node saved it since)", id, (unsigned long long)head,
                          (unsigned long long)expect);
        goto out;
    }
    uint64_t tv = head + 1;
    for (int k = 0;; k++, tv++) {
        rc = st_tier_manifest_put(t, id, tv, man, mlen);
        if (rc != ST_ECONFLICT)
            break;
        if (k + 1 >= TX_SKIP_MAX) {
            rc = st_error_set(ST_ECONFLICT, "tier push: %s: versions %llu to %llu all hold other "
                              "manifests", id, (unsigned long long)(head + 1),
                              (unsigned long long)tv);
            break;
        }
    }
    if (rc)
        goto out;
    uint64_t cur = 0;
    if ((rc = st_tier_head_cas(t, id, head, tv, &cur))) {
        if (rc == ST_ECONFLICT)
            rc = st_error_set(ST_ECONFLICT, "tier push: %s: the tier's head moved from %llu to %llu "
                              "during the push (another node saved it)", id,
                              (unsigned long long)head, (unsigned long long)cur);
        goto out;
    }
    s.tier_version = tv;
    rc = replicas ? st_tier_sync(t, replicas, wait_ms) : 0;
    if (out)
        *out = s; /* with a failed sync too: the head is at tv, unconfirmed */
out:
    free(file);
    free(offs);
    free(man);
    return rc;
}

/* ---- pull ----------------------------------------------------------------------------------- */
typedef struct pull_ctx {
    st_tier *t;
    const char *id;
    uint64_t tv, np;
    uint8_t *file;
    const size_t *off;
    const uint8_t *man;
} pull_ctx;

/* Piece i of a pull (invariant 5, on st_store__par_run). */
static int pull_piece(void *arg, size_t i, st_frame_ctx **fctx)
{
    (void)fctx;
    pull_ctx *c = arg;
    const uint8_t *e = c->man + TX_MAN_HDR + i * TX_MAN_ENT;
    size_t len = c->off[i + 1] - c->off[i], n = 0;
    /* straight into the file, checked there against e's SHA-256 */
    int rc = st_tier_chunk_get_into(c->t, e, c->file + c->off[i], len, &n);
    if (rc == ST_ENOTFOUND)
        return st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: piece %zu of %llu is "
                            "missing from the tier", c->id, (unsigned long long)c->tv, i,
                            (unsigned long long)c->np);
    if (rc)
        return rc;
    if (n != len)
        return st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: piece %zu has %zu bytes, "
                            "the manifest says %zu", c->id, (unsigned long long)c->tv, i, n, len);
    return 0;
}

int st_tier_pull(st_tier *t, st_store *st, const char *id, uint64_t version, uint64_t max_bytes,
                 st_tier_xfer_stats *out)
{
    if (!t || !st || !id)
        return st_error_set(ST_EINVAL, "tier pull: NULL argument");
    if (!max_bytes)
        max_bytes = 32ull << 30;
    st_tier_xfer_stats s;
    memset(&s, 0, sizeof s);
    uint8_t *man = NULL, *file = NULL;
    size_t mlen = 0, *offs = NULL;
    st_image *img = NULL;
    int rc = 0;
    uint64_t tv = version;
    if (!tv) {
        if ((rc = st_tier_head_get(t, id, &tv)))
            return rc;
        if (!tv)
            return st_error_set(ST_ENOTFOUND, "tier pull: %s: no version in the tier", id);
    }
    /* the largest manifest a file of max_bytes can have: a piece per TX_PIECE_MIN bytes, the
     * last one shorter */
    uint64_t most = TX_MAN_HDR + (max_bytes / TX_PIECE_MIN + 1) * TX_MAN_ENT + TX_MAN_TRAILER;
    rc = st_tier_manifest_get(t, id, tv, most > SIZE_MAX ? SIZE_MAX : (size_t)most, (void **)&man,
                              &mlen);
    if (rc == ST_ENOTFOUND)
        rc = st_error_set(ST_ENOTFOUND, "tier pull: %s: no manifest for tier version %llu", id,
                          (unsigned long long)tv);
    if (rc)
        return rc;
    /* invariant 2: every field checked before anything is allocated by it */
    uint8_t dig[ST_SHA256_LEN];
    uint64_t flen = 0, np = 0;
    if (mlen < TX_MAN_HDR + TX_MAN_TRAILER || st_get32(man) != TX_MAN_MAGIC) {
        rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: not a tier manifest (%zu "
                          "bytes)", id, (unsigned long long)tv, mlen);
        goto out;
    }
    if ((rc = st_sha256(man, mlen - TX_MAN_TRAILER, dig)))
        goto out;
    if (memcmp(dig, man + mlen - TX_MAN_TRAILER, TX_MAN_TRAILER)) {
        rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: the manifest's trailer does "
                          "not match its bytes", id, (unsigned long long)tv);
        goto out;
    }
    flen = st_get64(man + 8);
    np = st_get32(man + 48);
    if (st_get16(man + 4) != TX_MAN_FORMAT) {
        rc = st_error_set(ST_EVERSION, "tier pull: %s version %llu: manifest format %u (this build "
                          "reads %u)", id, (unsigned long long)tv, st_get16(man + 4), TX_MAN_FORMAT);
        goto out;
    }
    if (mlen != TX_MAN_HDR + np * TX_MAN_ENT + TX_MAN_TRAILER) {
        rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: %llu pieces need a manifest "
                          "of %llu bytes, it has %zu", id, (unsigned long long)tv,
                          (unsigned long long)np,
                          (unsigned long long)(TX_MAN_HDR + np * TX_MAN_ENT + TX_MAN_TRAILER), mlen);
        goto out;
    }
    if (flen > max_bytes || flen > SIZE_MAX) {
        rc = st_error_set(ST_ETOOBIG, "tier pull: %s version %llu: a file of %llu bytes (at most "
                          "%llu)", id, (unsigned long long)tv, (unsigned long long)flen,
                          (unsigned long long)max_bytes);
        goto out;
    }
    uint64_t sum = 0;
    for (uint64_t i = 0; i < np; i++) {
        uint32_t len = st_get32(man + TX_MAN_HDR + i * TX_MAN_ENT + 32);
        if (!len || len > ST_TIER_PIECE_MAX) {
            rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: piece %llu claims %u bytes "
                              "(1 to %u)", id, (unsigned long long)tv, (unsigned long long)i, len,
                              ST_TIER_PIECE_MAX);
            goto out;
        }
        sum += len;
    }
    if (sum != flen) {
        rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: the pieces add up to %llu "
                          "bytes, the manifest says %llu", id, (unsigned long long)tv,
                          (unsigned long long)sum, (unsigned long long)flen);
        goto out;
    }
    if (!(file = malloc(flen ? (size_t)flen : 1))) {
        rc = st_error_set(ENOMEM, "tier pull: %s: %llu bytes", id, (unsigned long long)flen);
        goto out;
    }
    if (!(offs = malloc((size_t)(np + 1) * sizeof *offs))) {
        rc = st_error_set(ENOMEM, "tier pull: %s: %llu pieces", id, (unsigned long long)np);
        goto out;
    }
    offs[0] = 0;
    for (uint64_t i = 0; i < np; i++)
        offs[i + 1] = offs[i] + st_get32(man + TX_MAN_HDR + i * TX_MAN_ENT + 32);
    pull_ctx pc = {.t = t, .id = id, .tv = tv, .np = np, .file = file, .off = offs, .man = man};
    if ((rc = st_store__par_run(TX_PAR, (size_t)np, pull_piece, &pc)))
        goto out;
    if (st_checksum(file, (size_t)flen) != st_get64(man + 16)) {
        rc = st_error_set(ST_ECORRUPT, "tier pull: %s version %llu: the file does not hash to the "
                          "manifest's XXH3-64", id, (unsigned long long)tv);
        goto out;
    }
    s.bytes = flen;
    s.pieces = (uint32_t)np;
    s.tier_version = tv;
    if ((rc = st_file_read_mem(file, (size_t)flen, NULL, &img)))
        goto out;
    free(file);
    file = NULL;
    rc = st_store_put(st, id, img, ST_STORE_HEAD_ANY, NULL, &s.local_version);
    if (!rc && out)
        *out = s;
out:
    st_image_free(img);
    free(file);
    free(offs);
    free(man);
    return rc;
}
