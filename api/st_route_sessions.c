/*
 * st_route_sessions.c - the routes of sessions: listings with cursor pagination (the store's
 * sessions and the conversations live only in the engine, in one id order), a session, its
 * versions, DELETE of a session (its live conversation too) or of a version, and SAVE, RESTORE
 * and PARK (the conversation manager's st_conv_save, st_conv_restore, st_conv_park).
 *
 * Invariants:
 * 1. A listing page costs O(limit) store records, never the whole store; "next" is null exactly
 *    on the last page (one more entry than the page is read).
 * 2. Disk-parked conversations (store ids ST_API_PARK_PREFIX...) are never listed as sessions:
 *    they show as the "live" part of their session.
 * 3. A DELETE holds the live conversation (st_conv_forget_begin) until the stored versions are
 *    gone, so that no request loads a version being deleted.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "st_api_int.h"
#include "st_prefix.h"
#include "st_store.h"

/* ---- store routes (workers) --------------------------------------------------------------- */

static void iso_time(uint64_t ns, char *dst, size_t cap)
{
    time_t t = (time_t)(ns / 1000000000u);
    struct tm tm;
    gmtime_r(&t, &tm);
    size_t n = strftime(dst, cap, "%Y-%m-%dT%H:%M:%S", &tm);
    snprintf(dst + n, cap - n, ".%03uZ", (unsigned)((ns / 1000000u) % 1000u));
}

static json_t *session_json(const st_session_info *si)
{
    char cr[40], up[40], fp[17];
    if (si->damaged)
        return json_pack("{s:s,s:b}", "id", si->id, "damaged", 1);
    iso_time(si->created_ns, cr, sizeof cr);
    iso_time(si->updated_ns, up, sizeof up);
    st_hex_encode(fp, si->model_fp, 8);
    json_t *labels = json_object();
    for (uint32_t i = 0; i < si->n_labels; i++)
        json_object_set_new(labels, si->labels[i].name, json_integer((json_int_t)si->labels[i].version));
    return json_pack("{s:s,s:I,s:I,s:s,s:s,s:s,s:o}", "id", si->id, "head", (json_int_t)si->head,
                     "versions", (json_int_t)si->n_versions, "created", cr, "updated", up, "model", fp,
                     "labels", labels);
}

static json_t *version_json(const st_version_info *vi)
{
    char cr[40];
    iso_time(vi->created_ns, cr, sizeof cr);
    json_t *codecs = json_array();
    for (uint32_t c = 0; c < 32; c++)
        if (vi->codecs & (1u << c))
            json_array_append_new(codecs, json_string((1u << c) == ST_VERSION_CODEC_OTHER ? "other" : st_codec_name(c)));
    return json_pack("{s:I,s:s,s:I,s:I,s:I,s:i,s:I,s:i,s:i,s:i,s:o,s:s,s:o,s:i}", "version", (json_int_t)vi->version,
                     "created", cr, "tokens", (json_int_t)vi->n_tokens, "logical_bytes",
                     (json_int_t)vi->logical_bytes, "stored_bytes", (json_int_t)vi->stored_bytes,
                     "checkpoints", (int)vi->n_checkpoints, "last_position",
                     (json_int_t)vi->last_position, "chunks", (int)vi->n_chunks, "compress",
                     (int)vi->compress, "file_version", (int)vi->file_version, "architecture",
                     vi->arch[0] ? json_string(vi->arch) : json_null(), "codec", st_codec_name(vi->codec),
                     "codecs", codecs, "framed_chunks", (int)vi->n_framed);
}

/* Where a session lives in the engine: a "live" object or JSON null. */
static json_t *live_json(st_api_server *s, const char *id)
{
    uint64_t tokens = 0, bytes = 0;
    const char *w = s->conv ? st_conv_where(s->conv, id, &tokens, &bytes) : NULL;
    if (w)
        return json_pack("{s:s,s:I,s:I}", "where", w, "tokens", (json_int_t)tokens, "bytes", (json_int_t)bytes);
    return json_null();
}

/* ---- listings: cursor pagination --------------------------------------------------------------
 * GET /v1/sessions and GET /v1/sessions/{id}/versions take ?limit=N (1..LIST_LIMIT_MAX, default
 * LIST_LIMIT_DEFAULT) and ?after=CURSOR, and answer a page plus "next": the cursor of the page's
 * last entry when more follow, else null. The store is read one page at a time
 * (st_store_list_page, st_store_versions_page): a page costs O(limit) records, never the whole
 * store. One more entry than the page is fetched, so "next" is null exactly on the last page. */
#define LIST_LIMIT_DEFAULT 100
#define LIST_LIMIT_MAX 1000

/* ?limit: 0 with *limit set, or the call's 400 and -1. */
static int query_limit(st_api_call *c, size_t *limit)
{
    char v[16];
    int q = st_api_query_get(st_http_req_query(c->req), "limit", v, sizeof v);
    *limit = LIST_LIMIT_DEFAULT;
    if (q == 0)
        return 0;
    size_t x = 0;
    int ok = q == 1 && v[0];
    for (const char *p = v; ok && *p; p++) {
        ok = *p >= '0' && *p <= '9' && x <= LIST_LIMIT_MAX;
        x = x * 10 + (size_t)(*p - '0');
    }
    if (!ok || x < 1 || x > LIST_LIMIT_MAX) {
        st_api_call_error(c, 400, "invalid_param", "limit must be a whole number from 1 to %d",
                          LIST_LIMIT_MAX);
        return -1;
    }
    *limit = x;
    return 0;
}

/* ?after for sessions: a session id (API syntax) into dst, or "" when absent. */
static int query_after_id(st_api_call *c, char *dst, size_t cap)
{
    int q = st_api_query_get(st_http_req_query(c->req), "after", dst, cap);
    if (q == 0) {
        dst[0] = '\0';
        return 0;
    }
    /* a position, not a session that must exist: any id the store can hold (a `next` may name a
     * session made with `statectl import --id`, whose ids the store allows more of) */
    if (q < 0 || !st_store_id_valid(dst)) {
        st_api_call_error(c, 400, "invalid_param",
                          "after must be a session id as the store keeps them (1 to %d characters "
                          "of A-Z a-z 0-9 . _ : + = -; percent-encode + and =)",
                          ST_STORE_ID_MAX);
        return -1;
    }
    return 0;
}

/* ?after for versions: a version number (0: before the first), 0 when absent. */
static int query_after_version(st_api_call *c, uint64_t *after)
{
    char v[24];
    int q = st_api_query_get(st_http_req_query(c->req), "after", v, sizeof v);
    *after = 0;
    if (q == 0)
        return 0;
    uint64_t x = 0;
    int ok = q == 1 && v[0] && strlen(v) <= 18;
    for (const char *p = v; ok && *p; p++) {
        ok = *p >= '0' && *p <= '9';
        x = x * 10 + (uint64_t)(*p - '0');
    }
    if (!ok) {
        st_api_call_error(c, 400, "invalid_param",
                          "after must be a version number (0 to 999999999999999999)");
        return -1;
    }
    *after = x;
    return 0;
}

/* A conversation live in the engine with no saved version. */
typedef struct live_only {
    const char *id; /* borrowed from the live array */
    json_t *entry;
} live_only;

static int cmp_live_only(const void *a, const void *b)
{
    return strcmp(((const live_only *)a)->id, ((const live_only *)b)->id);
}

static int cmp_info_id(const void *key, const void *elem)
{
    return strcmp((const char *)key, ((const st_session_info *)elem)->id);
}

/* st_conv_list_live's hook: each live conversation as {id, where, tokens, bytes} into arr. */
static void live_add(void *arr, const char *id, const char *where, uint64_t tokens, uint64_t bytes)
{
    json_array_append_new(arr, json_pack("{s:s,s:s,s:I,s:I}", "id", id, "where", where, "tokens",
                                         (json_int_t)tokens, "bytes", (json_int_t)bytes));
}

void st_api_h_sessions_list(st_api_call *c)
{
    st_api_server *s = c->srv;
    size_t limit;
    char after[ST_STORE_ID_MAX + 1];
    if (query_limit(c, &limit) || query_after_id(c, after, sizeof after))
        return;
    /* limit + 1 sessions visible to the API (disk-parked "park:" ones are skipped), read page by
     * page from `after` */
    size_t want = limit + 1, have = 0;
    int exhausted = 0;
    st_session_info *arr = malloc(want * sizeof *arr);
    char pos[ST_STORE_ID_MAX + 1];
    json_t *list = NULL, *live = NULL;
    live_only *lo = NULL;
    size_t n_lo = 0;
    if (!arr) {
        st_api_call_error(c, 503, "out_of_memory", "no memory for a page of %zu sessions", limit);
        return;
    }
    snprintf(pos, sizeof pos, "%s", after);
    while (have < want && !exhausted) {
        size_t got = 0;
        int rc = st_store_list_page(s->store, pos, arr + have, want - have, &got);
        if (rc) {
            st_api_call_fail(c, rc, "listing sessions");
            goto done;
        }
        exhausted = got < want - have;
        if (got)
            snprintf(pos, sizeof pos, "%s", arr[have + got - 1].id);
        for (size_t i = have, end = have + got; i < end; i++)
            if (strncmp(arr[i].id, ST_API_PARK_PREFIX, strlen(ST_API_PARK_PREFIX)) &&
                strncmp(arr[i].id, ST_PREFIX_ID_PREFIX, strlen(ST_PREFIX_ID_PREFIX)))
                arr[have++] = arr[i];
    }
    if (s->conv) {
        /* conversations that live only in the engine (never saved) take their place in id order:
         * those after `after`, and, unless the store ran out, before the last session read (past
         * it, limit + 1 entries precede them already) */
        live = json_array();
        st_conv_list_live(s->conv, live_add, live);
        lo = malloc((json_array_size(live) + 1) * sizeof *lo);
        if (!lo) {
            st_api_call_error(c, 503, "out_of_memory", "no memory for the live conversations");
            goto done;
        }
        size_t i;
        json_t *e;
        json_array_foreach(live, i, e) {
            const char *id = json_string_value(json_object_get(e, "id"));
            if (!id || strcmp(id, after) <= 0 || (have && bsearch(id, arr, have, sizeof *arr, cmp_info_id)))
                continue;
            if (!exhausted && strcmp(id, arr[have - 1].id) >= 0)
                continue;
            lo[n_lo++] = (live_only){id, e};
        }
        qsort(lo, n_lo, sizeof *lo, cmp_live_only);
    }
    list = json_array();
    size_t i = 0, j = 0, out = 0;
    const char *last = NULL;
    while (out < limit && (i < have || j < n_lo)) {
        if (j < n_lo && (i == have || strcmp(lo[j].id, arr[i].id) < 0)) {
            json_t *e = lo[j++].entry;
            const char *id = json_string_value(json_object_get(e, "id"));
            if (last && !strcmp(last, id))
                continue; /* in a slot and in the pool at once: listed once */
            json_array_append_new(list, json_pack("{s:s,s:i,s:i,s:{s:O,s:O,s:O}}", "id", id, "head", 0,
                                                  "versions", 0, "live", "where",
                                                  json_object_get(e, "where"), "tokens",
                                                  json_object_get(e, "tokens"), "bytes",
                                                  json_object_get(e, "bytes")));
            last = id;
            out++;
            continue;
        }
        json_t *o = session_json(&arr[i]);
        json_object_set_new(o, "live", live_json(s, arr[i].id));
        json_array_append_new(list, o);
        last = arr[i++].id;
        out++;
    }
    /* more follow when an entry is left over (a duplicate live id left over does not count) */
    int more = i < have;
    for (; !more && j < n_lo; j++)
        more = !last || strcmp(lo[j].id, last) != 0;
    c->reply = json_pack("{s:o,s:o}", "sessions", list, "next", more ? json_string(last) : json_null());
    list = NULL;
    c->status = 200;
done:
    json_decref(list);
    json_decref(live);
    free(lo);
    free(arr);
}

void st_api_h_session_get(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_session_info si;
    int rc = st_store_show(s->store, c->id, &si);
    json_t *live = live_json(s, c->id);
    if (rc == ST_ENOTFOUND && !json_is_null(live)) {
        c->reply = json_pack("{s:s,s:i,s:i,s:o}", "id", c->id, "head", 0, "versions", 0, "live", live);
        c->status = 200;
        return;
    }
    if (rc) {
        json_decref(live);
        st_api_call_fail(c, rc, "session");
        return;
    }
    c->reply = session_json(&si);
    json_object_set_new(c->reply, "live", live);
    c->status = 200;
}

void st_api_h_versions(st_api_call *c)
{
    size_t limit, n = 0;
    uint64_t after;
    if (query_limit(c, &limit) || query_after_version(c, &after))
        return;
    st_version_info *vi = malloc((limit + 1) * sizeof *vi);
    if (!vi) {
        st_api_call_error(c, 503, "out_of_memory", "no memory for a page of %zu versions", limit);
        return;
    }
    int rc = st_store_versions_page(c->srv->store, c->id, after, vi, limit + 1, &n);
    if (rc) {
        free(vi);
        st_api_call_fail(c, rc, "versions");
        return;
    }
    json_t *list = json_array();
    for (size_t i = 0; i < n && i < limit; i++)
        json_array_append_new(list, version_json(&vi[i]));
    json_t *next = n > limit ? json_integer((json_int_t)vi[limit - 1].version) : json_null();
    free(vi);
    c->reply = json_pack("{s:s,s:o,s:o}", "session", c->id, "versions", list, "next", next);
    c->status = 200;
}

/* {v}: a version number >= 1, or "latest" / "head" (0). */
int st_api_parse_version(st_api_call *c, const char *s, uint64_t *v)
{
    if (!strcmp(s, "latest") || !strcmp(s, "head")) {
        *v = 0;
        return 0;
    }
    uint64_t x = 0;
    if (!*s || strlen(s) > 18)
        goto bad;
    for (const char *p = s; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad;
        x = x * 10 + (uint64_t)(*p - '0');
    }
    if (!x)
        goto bad;
    *v = x;
    return 0;
bad:
    st_api_call_error(c, 400, "invalid_version", "version must be a number from 1, or \"latest\"");
    return -1;
}

void st_api_h_version_get(st_api_call *c)
{
    uint64_t v;
    if (st_api_parse_version(c, c->arg2, &v))
        return;
    st_version_info vi;
    int rc = st_store_version_info(c->srv->store, c->id, v, &vi);
    if (rc) {
        st_api_call_fail(c, rc, "version");
        return;
    }
    c->reply = version_json(&vi);
    json_object_set_new(c->reply, "session", json_string(c->id));
    c->status = 200;
}

void st_api_h_session_delete(st_api_call *c)
{
    st_api_server *s = c->srv;
    int live_found = 0;
    /* the live conversation is held (busy) until the versions are gone, so that a request waiting
     * for it cannot load the head version this DELETE is removing */
    st_conv_hold hold = {-1, NULL, NULL, NULL};
    if (s->conv) {
        int rc = st_conv_forget_begin(s->conv, c->id, &hold);
        if (rc) {
            st_api_call_fail(c, rc, "deleting the live conversation");
            return;
        }
        live_found = st_conv_hold_live(&hold);
    }
    st_session_info si;
    uint64_t versions = 0;
    int rc = st_store_show(s->store, c->id, &si);
    if (!rc) {
        versions = si.n_versions;
        rc = st_store_session_delete(s->store, c->id);
    }
    if (rc == ST_ENOTFOUND && live_found)
        rc = 0;
    if (rc)
        st_api_call_fail(c, rc, "deleting the session"); /* before forget_end replaces the detail */
    if (s->conv) {
        if (rc && rc != ST_ENOTFOUND) /* the versions are still there: keep the live one too */
            st_conv_forget_abort(s->conv, &hold);
        else
            st_conv_forget_end(s->conv, &hold);
    }
    if (rc)
        return;
    c->reply = json_pack("{s:s,s:b,s:I,s:b}", "session", c->id, "deleted", 1, "versions_deleted",
                         (json_int_t)versions, "live_deleted", live_found);
    c->status = 200;
}

void st_api_h_version_delete(st_api_call *c)
{
    uint64_t v;
    if (st_api_parse_version(c, c->arg2, &v))
        return;
    if (!v) {
        st_version_info vi;
        int rc = st_store_version_info(c->srv->store, c->id, 0, &vi);
        if (rc) {
            st_api_call_fail(c, rc, "version");
            return;
        }
        v = vi.version;
    }
    int rc = st_store_version_delete(c->srv->store, c->id, v);
    if (rc) {
        st_api_call_fail(c, rc, "deleting the version");
        return;
    }
    c->reply = json_pack("{s:s,s:I,s:b}", "session", c->id, "version", (json_int_t)v, "deleted", 1);
    c->status = 200;
}

/* ---- SAVE, RESTORE, PARK (the conversation manager) ------------------------------------------ */

void st_api_h_save(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    static const char *const keys[] = {"codec", "compress", "label", "expected_head", NULL};
    const char *codec_name = NULL, *label = NULL;
    uint64_t compress = (uint64_t)cfg->save_compress, expected = ST_STORE_HEAD_ANY;
    int have_expected = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "codec", &codec_name) ||
        st_api_json_opt_str(c, "label", &label) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL) ||
        st_api_json_opt_u64(c, "expected_head", UINT64_MAX >> 1, &expected, &have_expected))
        return;
    uint32_t codec = cfg->state_codec;
    if (codec_name) {
        st_codec_id id;
        if (st_codec_parse(codec_name, &id)) {
            st_api_call_error(c, 400, "invalid_field", "\"codec\" must be fp32, bf16 or f16");
            return;
        }
        codec = id;
    }
    if (label && (!st_store_id_valid(label) || strlen(label) >= ST_STORE_LABEL_MAX)) {
        st_api_call_error(c, 400, "invalid_field", "\"label\" must be 1..%d bytes of A-Z a-z 0-9 . _ : + = -",
                          ST_STORE_LABEL_MAX - 1);
        return;
    }
    if (have_expected && expected == 0)
        expected = ST_STORE_HEAD_NONE; /* 0: the session must not exist yet */
    st_conv_save_opts o = {.codec = codec, .compress = (int)compress, .label = label, .expected = expected};
    st_conv_save_info si;
    int rc = st_conv_save(cv, c->id, &o, &si);
    if (rc) {
        st_api_call_fail(c, rc, "save");
        return;
    }
    const st_put_stats *ps = &si.ps;
    c->reply = json_pack("{s:s,s:I,s:s,s:s,s:I,s:I,s:I,s:I,s:i,s:i,s:i,s:f,s:f,s:f}", "session", c->id,
                         "version", (json_int_t)si.version, "codec", st_codec_name(codec), "from", si.from,
                         "tokens", (json_int_t)si.tokens, "logical_bytes",
                         (json_int_t)ps->logical_bytes, "stored_bytes", (json_int_t)ps->stored_bytes,
                         "new_stored_bytes", (json_int_t)ps->new_bytes, "chunks", (int)ps->chunks,
                         "new_chunks", (int)ps->new_chunks, "pruned_versions", (int)ps->pruned,
                         "snapshot_ms", st_api_ms(si.snapshot_ms), "store_ms", st_api_ms(si.store_ms),
                         "ms", st_api_ms(si.ms));
    if (c->reply && si.tier) { /* --tier: what the shared tier did with it (docs/SCALE.md) */
        json_object_set_new(c->reply, "tier", json_string(si.tier));
        json_object_set_new(c->reply, "tier_version", json_integer((json_int_t)si.tier_version));
    }
    c->status = 201;
}

void st_api_h_restore(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    static const char *const keys[] = {"version", NULL};
    uint64_t version = 0;
    if (st_api_json_only(c, keys) || st_api_json_opt_u64(c, "version", UINT64_MAX >> 1, &version, NULL))
        return;
    st_conv_restore_info ri;
    int rc = st_conv_restore(cv, c->id, version, &ri);
    if (rc) {
        st_api_call_fail(c, rc, "restore");
        return;
    }
    c->reply = json_pack("{s:s,s:I,s:I,s:I,s:f}", "session", c->id, "version",
                         (json_int_t)ri.version, "tokens", (json_int_t)ri.tokens,
                         "logical_bytes", (json_int_t)ri.logical_bytes, "ms", st_api_ms(ri.ms));
    c->status = 200;
}

void st_api_h_park(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    static const char *const keys[] = {NULL};
    if (st_api_json_only(c, keys))
        return;
    st_conv_park_info pi;
    int rc = st_conv_park(cv, c->id, &pi);
    if (rc) {
        st_api_call_fail(c, rc, "park");
        return;
    }
    c->reply = json_pack("{s:s,s:s,s:I,s:I,s:b,s:f}", "session", c->id, "where", pi.where, "bytes",
                         (json_int_t)pi.bytes, "tokens", (json_int_t)pi.tokens, "already", pi.already,
                         "ms", pi.already ? 0.0 : st_api_ms(pi.ms));
    c->status = 200;
}
