/*
 * statectl_store.c - the store verbs of statectl: ls, show, import, export, rm, label, gc, check,
 * stat, backup, restore-backup, migrate. Each parses its own arguments, opens the store (read-only
 * where it only reads), and prints text or, with --json, one JSON document on stdout. Progress
 * goes to stderr, and only when stderr is a terminal.
 *
 * Exit status: 0 success; 1 check found a problem; 2 usage error; 3 any other error.
 * Errors print "statectl VERB: <what went wrong>: <detail>" on stderr.
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "st_migrate.h"
#include "st_file.h"
#include "st_store.h"
#include "statectl_store.h"
#include "statectl_util.h"

static int progress_on;

static void progress(void *arg, const char *phase, uint64_t done, uint64_t total)
{
    (void)arg;
    if (!progress_on)
        return;
    if (total)
        fprintf(stderr, "\rstatectl %s: %-8s %3u%%   ", statectl_verb, phase, (unsigned)(done * 100 / total));
    else
        fprintf(stderr, "\rstatectl %s: %-8s %" PRIu64 "   ", statectl_verb, phase, done);
    if (total && done >= total)
        fputc('\n', stderr);
    fflush(stderr);
}

static void progress_end(void)
{
    if (progress_on)
        fputs("\r\033[K", stderr);
}

/* ---- formatting -------------------------------------------------------------------------------- */

static const char *bytes_str(char *buf, size_t cap, uint64_t b)
{
    static const char *unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)b;
    int u = 0;
    while (v >= 1024 && u < 4) {
        v /= 1024;
        u++;
    }
    if (u == 0)
        snprintf(buf, cap, "%" PRIu64 " B", b);
    else
        snprintf(buf, cap, "%.1f %s", v, unit[u]);
    return buf;
}

static const char *time_str(char *buf, size_t cap, uint64_t ns)
{
    time_t t = (time_t)(ns / 1000000000ull);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

static void print_json(json_t *o)
{
    json_dumpf(o, stdout, JSON_INDENT(2));
    fputc('\n', stdout);
    json_decref(o);
}

/* ---- arguments ----------------------------------------------------------------------------------- */

typedef struct args {
    const char *pos[4];
    int n_pos;
    int json, read_data, dry_run, no_backup, remove;
    const char *id, *label, *backup_dir, *format, *compress;
} args;

/* Flags a verb accepts, by name; values for the options that take one. */
static int parse(int argc, char **argv, const char *flags, int max_pos, args *a)
{
    memset(a, 0, sizeof *a);
    for (int i = 1; i < argc; i++) {
        const char *s = argv[i];
        if (s[0] != '-' || !s[1]) {
            if (a->n_pos >= max_pos)
                return statectl_usage("unexpected argument '%s'", s);
            a->pos[a->n_pos++] = s;
            continue;
        }
        char name[32];
        snprintf(name, sizeof name, "%s,", s);
        if (!strstr(flags, name))
            return statectl_usage("unknown option %s", s);
        const char **val = !strcmp(s, "--id") ? &a->id
                         : !strcmp(s, "--label") ? &a->label
                         : !strcmp(s, "--backup-dir") ? &a->backup_dir
                         : !strcmp(s, "--format") ? &a->format
                         : !strcmp(s, "--compress") ? &a->compress
                                                     : NULL;
        if (val) {
            if (i + 1 >= argc)
                return statectl_usage("%s needs a value", s);
            *val = argv[++i];
        } else if (!strcmp(s, "--json")) {
            a->json = 1;
        } else if (!strcmp(s, "--read-data")) {
            a->read_data = 1;
        } else if (!strcmp(s, "--dry-run")) {
            a->dry_run = 1;
        } else if (!strcmp(s, "--no-backup")) {
            a->no_backup = 1;
        } else if (!strcmp(s, "--remove")) {
            a->remove = 1;
        }
    }
    return 0;
}

/* parse, then exactly n positional arguments; needs says which when they are not. */
static int parse_n(int argc, char **argv, const char *flags, int n, const char *needs, args *a)
{
    int rc = parse(argc, argv, flags, n, a);
    if (rc)
        return rc;
    return a->n_pos != n ? statectl_usage("%s", needs) : 0;
}

/* Close the store (NULL is fine), end the progress line if asked, and turn rc into the exit
 * status: 0, or the error printed and EXIT_ERROR. */
static int store_done(st_store *st, int rc, int end_progress)
{
    st_store_close(st);
    if (end_progress)
        progress_end();
    return rc ? statectl_fail(rc) : 0;
}

/* A version named on the command line: ID, ID@VERSION or ID@LABEL. */
typedef struct ref {
    char id[ST_STORE_ID_MAX + 1];
    uint64_t v;          /* 0: the head (or a label, until resolved) */
    const char *label;   /* set for a label (resolved after opening) */
} ref;

/* ID, ID@VERSION or ID@LABEL; *label_out set for a label (resolved after opening). */
static int parse_ref_parts(const char *s, char *id, uint64_t *version, const char **label_out)
{
    const char *at = strrchr(s, '@');
    size_t n = at ? (size_t)(at - s) : strlen(s);
    *version = 0;
    *label_out = NULL;
    if (n == 0 || n > ST_STORE_ID_MAX)
        return statectl_usage("'%s' is not ID or ID@VERSION", s);
    memcpy(id, s, n);
    id[n] = '\0';
    if (!st_store_id_valid(id))
        return statectl_usage("invalid session id in '%s' (1..128 of A-Z a-z 0-9 . _ : + = -)", s);
    if (at) {
        char *end;
        errno = 0;
        unsigned long long v = strtoull(at + 1, &end, 10);
        if (at[1] >= '0' && at[1] <= '9' && !*end && !errno && v > 0)
            *version = v;
        else if (at[1])
            *label_out = at + 1;
        else
            return statectl_usage("'%s': nothing after @", s);
    }
    return 0;
}

static int parse_ref(const char *s, ref *r)
{
    return parse_ref_parts(s, r->id, &r->v, &r->label);
}

static int resolve_label(st_store *st, const char *id, const char *label, uint64_t *version)
{
    if (!label)
        return 0;
    st_session_info si;
    int rc = st_store_show(st, id, &si);
    if (rc)
        return rc;
    for (uint32_t i = 0; i < si.n_labels; i++)
        if (!strcmp(si.labels[i].name, label)) {
            *version = si.labels[i].version;
            return 0;
        }
    return st_error_set(ST_ENOTFOUND, "session %s has no version %s (neither a number nor a label)", id, label);
}

static int open_store(const char *dir, int read_only, int create, st_store **st)
{
    st_store_opts o = {.read_only = read_only, .create = create, .progress = progress};
    return st_store_open(st, dir, &o);
}

/* parse_n, then the ref in the second positional argument. */
static int parse_n_ref(int argc, char **argv, const char *flags, int n, const char *needs, args *a, ref *r)
{
    int rc = parse_n(argc, argv, flags, n, needs, a);
    return rc ? rc : parse_ref(a->pos[1], r);
}

/* Open the store in dir (existing) and resolve r's label to its version. */
static int open_ref(const char *dir, int read_only, ref *r, st_store **st)
{
    int rc = open_store(dir, read_only, 0, st);
    return rc ? rc : resolve_label(*st, r->id, r->label, &r->v);
}

static json_t *labels_json(const st_session_info *si)
{
    json_t *o = json_object();
    for (uint32_t i = 0; i < si->n_labels; i++)
        json_object_set_new(o, si->labels[i].name, json_integer((json_int_t)si->labels[i].version));
    return o;
}

/* A version's architecture as show prints it. */
static const char *arch_text(const char *arch)
{
    return arch[0] ? arch : "unknown (saved before store versions recorded it)";
}

static json_t *version_json(const st_version_info *v, const st_session_info *si)
{
    char t[32], sh[17];
    snprintf(sh, sizeof sh, "%016" PRIx64, v->state_hash);
    json_t *labels = json_array();
    for (uint32_t i = 0; si && i < si->n_labels; i++)
        if (si->labels[i].version == v->version)
            json_array_append_new(labels, json_string(si->labels[i].name));
    char codecs[64];
    st_version_codecs_text(v->codecs, codecs, sizeof codecs);
    return json_pack("{s:I,s:o,s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:s,s:s,s:s,s:I,s:I,s:b,s:o}", "version",
                     (json_int_t)v->version,
                     "architecture", v->arch[0] ? json_string(v->arch) : json_null(),
                     "created", time_str(t, sizeof t, v->created_ns), "tokens", (json_int_t)v->n_tokens,
                     "checkpoints", (json_int_t)v->n_checkpoints, "last_position", (json_int_t)v->last_position,
                     "logical_bytes", (json_int_t)v->logical_bytes, "stored_bytes", (json_int_t)v->stored_bytes,
                     "chunks", (json_int_t)v->n_chunks, "framed_chunks", (json_int_t)v->n_framed,
                     "state_hash", sh, "codec", st_codec_name(v->codec), "codecs", codecs, "compress",
                     (json_int_t)v->compress,
                     "file_version", (json_int_t)v->file_version, "file_verbatim", v->file_verbatim, "labels",
                     labels);
}

static json_t *session_json(const st_session_info *si)
{
    char fp[2 * ST_FINGERPRINT_LEN + 1], gd[2 * ST_STORE_HASH_LEN + 1], c[32], u[32];
    st_hex_encode(fp, si->model_fp, ST_FINGERPRINT_LEN);
    st_hex_encode(gd, si->geometry_digest, ST_STORE_HASH_LEN);
    return json_pack("{s:s,s:I,s:I,s:I,s:s,s:s,s:s,s:s,s:o}", "id", si->id, "head", (json_int_t)si->head, "versions",
                     (json_int_t)si->n_versions, "next_version", (json_int_t)si->next_version, "created",
                     time_str(c, sizeof c, si->created_ns), "updated", time_str(u, sizeof u, si->updated_ns),
                     "model_fingerprint", fp, "geometry_digest", gd, "labels", labels_json(si));
}

static void labels_text(char *dst, size_t cap, const st_session_info *si, uint64_t only)
{
    size_t n = 0;
    dst[0] = '\0';
    for (uint32_t i = 0; i < si->n_labels && n < cap; i++) {
        if (only && si->labels[i].version != only)
            continue;
        if (only)
            n += (size_t)snprintf(dst + n, cap - n, "%s%s", n ? "," : "", si->labels[i].name);
        else
            n += (size_t)snprintf(dst + n, cap - n, "%s%s=%" PRIu64, n ? "," : "", si->labels[i].name,
                                  si->labels[i].version);
    }
}

/* ---- ls ------------------------------------------------------------------------------------------ */

static const char ls_help[] =
    "usage: statectl ls STORE [--json]\n"
    "\n"
    "List the sessions of a store: head version, number of versions, tokens and bytes of the head,\n"
    "last update, labels. A session whose record does not decode is listed as DAMAGED.\n";

static int cmd_ls(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,", 1, "needs STORE", &a);
    if (rc)
        return rc;
    st_store *st = NULL;
    st_session_info *ss = NULL;
    size_t n = 0;
    if ((rc = open_store(a.pos[0], 1, 0, &st)) || (rc = st_store_list(st, &ss, &n))) {
        st_store_close(st);
        return statectl_fail(rc);
    }
    json_t *arr = a.json ? json_array() : NULL;
    if (!a.json)
        printf("%-24s %6s %8s %8s %10s  %-20s  %s\n", "ID", "HEAD", "VERSIONS", "TOKENS", "SIZE", "UPDATED", "LABELS");
    for (size_t i = 0; i < n && !rc; i++) {
        st_version_info vi;
        if (ss[i].damaged) {
            if (a.json)
                json_array_append_new(arr, json_pack("{s:s,s:b}", "id", ss[i].id, "damaged", 1));
            else
                printf("%-24s DAMAGED (its record does not decode: statectl check)\n", ss[i].id);
            continue;
        }
        if ((rc = st_store_version_info(st, ss[i].id, ss[i].head, &vi)))
            break;
        if (a.json) {
            json_t *o = session_json(&ss[i]);
            json_object_set_new(o, "tokens", json_integer((json_int_t)vi.n_tokens));
            json_object_set_new(o, "logical_bytes", json_integer((json_int_t)vi.logical_bytes));
            json_array_append_new(arr, o);
        } else {
            char sz[32], t[32], lb[256];
            labels_text(lb, sizeof lb, &ss[i], 0);
            printf("%-24s %6" PRIu64 " %8" PRIu64 " %8" PRIu64 " %10s  %-20s  %s\n", ss[i].id, ss[i].head,
                   ss[i].n_versions, vi.n_tokens, bytes_str(sz, sizeof sz, vi.logical_bytes),
                   time_str(t, sizeof t, ss[i].updated_ns), lb);
        }
    }
    free(ss);
    st_store_close(st);
    if (rc) {
        json_decref(arr);
        return statectl_fail(rc);
    }
    if (a.json)
        print_json(json_pack("{s:s,s:o}", "store", a.pos[0], "sessions", arr));
    return 0;
}

/* ---- show ---------------------------------------------------------------------------------------- */

static const char show_help[] =
    "usage: statectl show STORE ID[@VERSION|@LABEL] [--json]\n"
    "\n"
    "Show a session (its versions with their codecs, labels, model, the head's architecture) or one\n"
    "version of it (tokens, checkpoints, codecs, logical and stored bytes, chunks, state hash, the\n"
    "model's architecture, layer kinds, how export re-creates its file). Codecs: those of the\n"
    "checkpoints' running state (fp32, bf16, f16; \"fp32+bf16\" when they differ; K/V keeps its\n"
    "dtype). Architecture: qwen35, llama, ... as the version recorded it; \"unknown\" for a version\n"
    "saved before versions recorded it. Layer kinds: one letter per layer, D Gated DeltaNet (conv\n"
    "and SSM state), A attention (K/V).\n";

static int cmd_show(int argc, char **argv)
{
    args a;
    ref r;
    int rc = parse_n_ref(argc, argv, "--json,", 2, "needs STORE and ID[@VERSION]", &a, &r);
    if (rc)
        return rc;
    st_store *st = NULL;
    st_session_info si;
    st_version_info *vs = NULL;
    size_t n = 0;
    if ((rc = open_store(a.pos[0], 1, 0, &st)) || (rc = st_store_show(st, r.id, &si)) ||
        (rc = resolve_label(st, r.id, r.label, &r.v)))
        goto done;
    if (r.v) {
        st_version_info vi;
        if ((rc = st_store_version_info(st, r.id, r.v, &vi)))
            goto done;
        /* the layer kinds, from the version's geometry (read with its data, which is checked) */
        st_image *img = NULL;
        char kinds[4200];
        if (st_store_get(st, r.id, r.v, &img) == 0)
            st_geometry_layer_kinds(st_image_geometry(img), kinds, sizeof kinds);
        else
            snprintf(kinds, sizeof kinds, "not readable: %s", st_errdetail());
        st_image_free(img);
        if (a.json) {
            json_t *o = session_json(&si), *vj = version_json(&vi, &si);
            json_object_set_new(vj, "layers", json_string(kinds));
            json_object_set_new(o, "version", vj);
            print_json(o);
        } else {
            char t[32], s1[32], s2[32], lb[256];
            labels_text(lb, sizeof lb, &si, r.v);
            printf("session      %s\nversion      %" PRIu64 "%s%s%s\n", r.id, vi.version, vi.version == si.head ? " (head)" : "",
                   *lb ? " labels " : "", lb);
            printf("created      %s\n", time_str(t, sizeof t, vi.created_ns));
            printf("tokens       %" PRIu64 "\n", vi.n_tokens);
            char cs[64];
            st_version_codecs_text(vi.codecs, cs, sizeof cs);
            printf("checkpoints  %u (live at %" PRIu64 ")\n", vi.n_checkpoints, vi.last_position);
            printf("codec        %s (live checkpoint: %s)\n", cs, st_codec_name(vi.codec));
            printf("bytes        %s logical, %s stored in %u chunks", bytes_str(s1, sizeof s1, vi.logical_bytes),
                   bytes_str(s2, sizeof s2, vi.stored_bytes), vi.n_chunks);
            if (vi.compress)
                printf(" (zstd %u: %u framed)", vi.compress, vi.n_framed);
            printf("\n");
            printf("state hash   %016" PRIx64 "\n", vi.state_hash);
            printf("architecture %s\n", arch_text(vi.arch));
            printf("layers       %s\n", kinds);
            if (vi.file_verbatim)
                printf("export       the imported file's bytes (kept verbatim)\n");
            else if (vi.file_version)
                printf("export       session file v%u, as imported\n", vi.file_version);
            else
                printf("export       session file, automatic version\n");
        }
        goto done;
    }
    if ((rc = st_store_versions(st, r.id, &vs, &n)))
        goto done;
    if (a.json) {
        json_t *o = session_json(&si), *arr = json_array();
        for (size_t i = 0; i < n; i++)
            json_array_append_new(arr, version_json(&vs[i], &si));
        json_object_set_new(o, "version_list", arr);
        print_json(o);
    } else {
        char fp[2 * ST_FINGERPRINT_LEN + 1], t[32];
        st_hex_encode(fp, si.model_fp, ST_FINGERPRINT_LEN);
        const char *arch = "";
        for (size_t i = 0; i < n; i++)
            if (vs[i].version == si.head)
                arch = vs[i].arch;
        printf("session      %s\nmodel        %s\n", r.id, fp);
        printf("architecture %s\n", arch_text(arch));
        printf("head         %" PRIu64 "\nversions     %" PRIu64 "\n", si.head, si.n_versions);
        printf("created      %s\n", time_str(t, sizeof t, si.created_ns));
        printf("  %8s %8s %5s %-9s %10s %10s  %-20s  %s\n", "VERSION", "TOKENS", "CKPTS", "CODEC", "LOGICAL",
               "STORED", "CREATED", "LABELS");
        for (size_t i = 0; i < n; i++) {
            char s1[32], s2[32], lb[256], cs[64];
            labels_text(lb, sizeof lb, &si, vs[i].version);
            st_version_codecs_text(vs[i].codecs, cs, sizeof cs);
            printf("  %8" PRIu64 " %8" PRIu64 " %5u %-9s %10s %10s  %-20s  %s\n", vs[i].version, vs[i].n_tokens,
                   vs[i].n_checkpoints, cs, bytes_str(s1, sizeof s1, vs[i].logical_bytes),
                   bytes_str(s2, sizeof s2, vs[i].stored_bytes), time_str(t, sizeof t, vs[i].created_ns), lb);
        }
    }
done:
    free(vs);
    return store_done(st, rc, 0);
}

/* ---- import / export ------------------------------------------------------------------------------ */

static const char import_help[] =
    "usage: statectl import STORE FILE [--id ID] [--label NAME] [--compress LEVEL] [--json]\n"
    "\n"
    "Read and verify a session file and save it as a new version of session ID (default: the\n"
    "file's name without its extension). STORE is created when missing. Exporting the version\n"
    "gives back the same bytes. --compress stores chunks zstd-compressed (LEVEL 1..19).\n";

static int default_id(const char *path, char *id)
{
    const char *b = strrchr(path, '/');
    b = b ? b + 1 : path;
    size_t n = strlen(b);
    const char *dot = strrchr(b, '.');
    if (dot && dot != b)
        n = (size_t)(dot - b);
    if (n > ST_STORE_ID_MAX)
        n = ST_STORE_ID_MAX;
    for (size_t i = 0; i < n; i++) {
        char c = b[i];
        id[i] = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || strchr("._:+=-", c)
                    ? c
                    : '_';
    }
    id[n] = '\0';
    return n ? 0 : statectl_usage("cannot derive a session id from '%s': give --id", path);
}

static int cmd_import(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,--id,--label,--compress,", 2, "needs STORE and FILE", &a);
    if (rc)
        return rc;
    char id[ST_STORE_ID_MAX + 1];
    if (a.id) {
        if (!st_store_id_valid(a.id))
            return statectl_usage("invalid session id '%s' (1..128 of A-Z a-z 0-9 . _ : + = -)", a.id);
        snprintf(id, sizeof id, "%s", a.id);
    } else if ((rc = default_id(a.pos[1], id))) {
        return rc;
    }
    st_put_stats ps;
    st_put_opts po = {.label = a.label, .stats = &ps};
    if (a.compress) {
        char *end;
        long l = strtol(a.compress, &end, 10);
        if (*end || l < 1 || l > 19)
            return statectl_usage("compression level '%s' is not 1..19", a.compress);
        po.compress = (int)l;
    }
    st_store *st = NULL;
    uint64_t v = 0;
    if (!(rc = open_store(a.pos[0], 0, 1, &st)))
        rc = st_store_import(st, a.pos[1], id, &po, &v);
    if ((rc = store_done(st, rc, 1)))
        return rc;
    if (a.json) {
        print_json(json_pack("{s:s,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "id", id, "version", (json_int_t)v, "chunks",
                             (json_int_t)ps.chunks, "new_chunks", (json_int_t)ps.new_chunks, "logical_bytes",
                             (json_int_t)ps.logical_bytes, "stored_bytes", (json_int_t)ps.stored_bytes, "new_bytes",
                             (json_int_t)ps.new_bytes, "pruned", (json_int_t)ps.pruned));
    } else {
        char s1[32], s2[32];
        printf("imported %s as %s@%" PRIu64 ": %u chunks, %u new (%s written, %s logical)\n", a.pos[1], id, v, ps.chunks,
               ps.new_chunks, bytes_str(s1, sizeof s1, ps.new_bytes), bytes_str(s2, sizeof s2, ps.logical_bytes));
    }
    return 0;
}

static const char export_help[] =
    "usage: statectl export STORE ID[@VERSION|@LABEL] FILE [--format v1|v2] [--compress zstd[:LEVEL]]\n"
    "\n"
    "Write a version (default: the head) as a session file, atomically. Without options the file is\n"
    "re-created exactly as it was imported (same bytes), or with automatic options for a version\n"
    "saved by the server. Every chunk is verified on the way out.\n";

static int cmd_export(int argc, char **argv)
{
    args a;
    ref r;
    int rc = parse_n_ref(argc, argv, "--format,--compress,", 3, "needs STORE, ID[@VERSION] and FILE", &a, &r);
    if (rc)
        return rc;
    st_file_write_opts fo = {.shuffle = 1};
    int forced = 0;
    if (a.format) {
        forced = 1;
        if (!strcmp(a.format, "v1") || !strcmp(a.format, "1"))
            fo.version = 1;
        else if (!strcmp(a.format, "v2") || !strcmp(a.format, "2"))
            fo.version = 2;
        else
            return statectl_usage("unknown format '%s' (v1, v2)", a.format);
    }
    if (a.compress) {
        forced = 1;
        const char *c = a.compress;
        if (strncmp(c, "zstd", 4) || (c[4] && c[4] != ':'))
            return statectl_usage("unknown compression '%s' (zstd or zstd:LEVEL)", c);
        fo.compress = 3;
        if (c[4] == ':') {
            char *end;
            long l = strtol(c + 5, &end, 10);
            if (*end || l < 1 || l > 19)
                return statectl_usage("zstd level in '%s' is not 1..19", c);
            fo.compress = (int)l;
        }
    }
    st_store *st = NULL;
    if (!(rc = open_ref(a.pos[0], 1, &r, &st)))
        rc = st_store_export(st, r.id, r.v, a.pos[2], forced ? &fo : NULL);
    if ((rc = store_done(st, rc, 1)))
        return rc;
    printf("exported %s to %s\n", a.pos[1], a.pos[2]);
    return 0;
}

/* ---- rm, label, gc -------------------------------------------------------------------------------- */

static const char rm_help[] =
    "usage: statectl rm STORE ID[@VERSION|@LABEL]\n"
    "\n"
    "Delete one version (its labels go with it) or, without @VERSION, the whole session. Chunks\n"
    "no other version uses are freed (at once, or by gc for a store using deferred gc).\n";

static int cmd_rm(int argc, char **argv)
{
    args a;
    ref r;
    int rc = parse_n_ref(argc, argv, "", 2, "needs STORE and ID[@VERSION]", &a, &r);
    if (rc)
        return rc;
    st_store *st = NULL;
    st_session_info si;
    if (!(rc = open_ref(a.pos[0], 0, &r, &st)) &&
        !(rc = st_store_show(st, r.id, &si)))
        rc = r.v ? st_store_version_delete(st, r.id, r.v) : st_store_session_delete(st, r.id);
    if ((rc = store_done(st, rc, 0)))
        return rc;
    if (r.v)
        printf("removed %s@%" PRIu64 "\n", r.id, r.v);
    else
        printf("removed session %s (%" PRIu64 " versions)\n", r.id, si.n_versions);
    return 0;
}

static const char label_help[] =
    "usage: statectl label STORE ID[@VERSION] NAME [--remove]\n"
    "\n"
    "Point label NAME at a version (default: the head), moving it if it exists; labelled versions\n"
    "are kept by retention. --remove deletes the label.\n";

static int cmd_label(int argc, char **argv)
{
    args a;
    ref r;
    int rc = parse_n_ref(argc, argv, "--remove,", 3, "needs STORE, ID[@VERSION] and NAME", &a, &r);
    if (rc)
        return rc;
    st_store *st = NULL;
    if (!(rc = open_ref(a.pos[0], 0, &r, &st)))
        rc = a.remove ? st_store_label_remove(st, r.id, a.pos[2]) : st_store_label_set(st, r.id, a.pos[2], r.v);
    if ((rc = store_done(st, rc, 0)))
        return rc;
    if (a.remove)
        printf("removed label %s of %s\n", a.pos[2], r.id);
    else
        printf("labelled %s as %s\n", a.pos[1], a.pos[2]);
    return 0;
}

static const char gc_help[] =
    "usage: statectl gc STORE [--json]\n"
    "\n"
    "Free every chunk no version references any more. Safe while the server runs.\n";

static int cmd_gc(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,", 1, "needs STORE", &a);
    if (rc)
        return rc;
    st_store *st = NULL;
    st_gc_stats gs = {0, 0, 0};
    if (!(rc = open_store(a.pos[0], 0, 0, &st)))
        rc = st_store_gc(st, &gs);
    if ((rc = store_done(st, rc, 1)))
        return rc;
    if (a.json) {
        print_json(json_pack("{s:I,s:I,s:I}", "chunks_freed", (json_int_t)gs.chunks_freed, "bytes_freed",
                             (json_int_t)gs.bytes_freed, "orphans_freed", (json_int_t)gs.orphans_freed));
    } else {
        char b[32];
        printf("freed %" PRIu64 " chunks (%s)", gs.chunks_freed, bytes_str(b, sizeof b, gs.bytes_freed));
        if (gs.orphans_freed)
            printf(" and %" PRIu64 " orphan chunks", gs.orphans_freed);
        printf("\n");
    }
    return 0;
}

/* ---- check, stat ---------------------------------------------------------------------------------- */

static const char check_help[] =
    "usage: statectl check STORE [--read-data] [--json]\n"
    "\n"
    "Check a store in one consistent snapshot: first every page of data.mdb, read from the file (page\n"
    "headers and bounds, key order, overflow page counts inside the file; LMDB keeps no checksums and\n"
    "trusts them), then session records, manifests (structure, checksum, geometry), every chunk\n"
    "reference and reference count, chunks nothing counts. --read-data also re-hashes every chunk\n"
    "(SHA-256) and checks it against what the manifests recorded, then reassembles every version and\n"
    "checks its state hash (a version that fails can never be restored: PROBLEM state-hash). The\n"
    "check runs in a child process: a crash on a damaged page is reported as an error. A damaged\n"
    "store is repaired by restoring a backup (statectl restore-backup).\n"
    "Exit 0 when nothing is wrong, 1 when a problem was found (each named on stdout), 3 on error.\n";

static const char *kind_name(uint32_t k)
{
    static const char *names[] = {"?", "meta", "session", "manifest", "missing-chunk", "refcount", "orphan-chunk",
                                  "corrupt-chunk", "state-hash", "page"};
    return k < sizeof names / sizeof names[0] ? names[k] : "?";
}

typedef struct check_out {
    json_t *arr;
} check_out;

static void check_report(void *arg, const st_check_problem *p)
{
    check_out *c = arg;
    if (c->arr) {
        json_t *o = json_pack("{s:s,s:s}", "kind", kind_name(p->kind), "message", p->message);
        if (*p->session)
            json_object_set_new(o, "session", json_string(p->session));
        if (p->version)
            json_object_set_new(o, "version", json_integer((json_int_t)p->version));
        if (*p->chunk)
            json_object_set_new(o, "chunk", json_string(p->chunk));
        if (p->page)
            json_object_set_new(o, "page", json_integer((json_int_t)p->page));
        json_array_append_new(c->arr, o);
        return;
    }
    progress_end();
    printf("PROBLEM %s", kind_name(p->kind));
    if (*p->session)
        printf(" session %s", p->session);
    if (p->version)
        printf(" version %" PRIu64, p->version);
    if (*p->chunk)
        printf(" chunk %s", p->chunk);
    printf(": %s\n", p->message);
}

static int cmd_check(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,--read-data,", 1, "needs STORE", &a);
    if (rc)
        return rc;
    check_out c = {a.json ? json_array() : NULL};
    st_check_result res;
    memset(&res, 0, sizeof res);
    /* in a child process: a crash inside liblmdb on a damaged page becomes an error here */
    st_store_opts o = {.read_only = 1, .progress = progress};
    rc = st_store_check_contained(a.pos[0], &o, a.read_data, check_report, &c, &res);
    progress_end();
    if (rc) {
        json_decref(c.arr);
        return statectl_fail(rc);
    }
    if (a.json) {
        print_json(json_pack("{s:b,s:I,s:I,s:I,s:I,s:I,s:I,s:b,s:I,s:I,s:I,s:o}", "ok", res.problems == 0, "problem_count",
                             (json_int_t)res.problems, "sessions", (json_int_t)res.sessions, "versions",
                             (json_int_t)res.versions, "chunks", (json_int_t)res.chunks, "refcounts",
                             (json_int_t)res.refcounts, "zero_count_chunks", (json_int_t)res.zero_count_chunks,
                             "read_data", a.read_data, "chunks_read", (json_int_t)res.chunks_read, "bytes_read",
                             (json_int_t)res.bytes_read, "versions_hashed", (json_int_t)res.versions_hashed,
                             "problems", c.arr));
    } else {
        char b[32];
        printf("%s: %" PRIu64 " sessions, %" PRIu64 " versions, %" PRIu64 " chunks", a.pos[0], res.sessions,
               res.versions, res.chunks);
        if (a.read_data)
            printf(", %" PRIu64 " chunks read (%s), %" PRIu64 " state hashes compared", res.chunks_read,
                   bytes_str(b, sizeof b, res.bytes_read), res.versions_hashed);
        if (res.zero_count_chunks)
            printf(", %" PRIu64 " awaiting gc", res.zero_count_chunks);
        printf("\n%s\n", res.problems ? "PROBLEMS FOUND" : "ok");
        if (res.problems)
            printf("%" PRIu64 " problems\n", res.problems);
    }
    return res.problems ? EXIT_PROBLEM : 0;
}

static const char stat_help[] =
    "usage: statectl stat STORE [--json]\n"
    "\n"
    "Sessions, versions, logical bytes (images as saved) and stored bytes (distinct chunks), the\n"
    "dedup ratio, chunks awaiting gc, LMDB pages used and free (the longest run of free pages), map\n"
    "size and budget, file size.\n";

static int cmd_stat(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,", 1, "needs STORE", &a);
    if (rc)
        return rc;
    st_store *st = NULL;
    st_store_stats s;
    if (!(rc = open_store(a.pos[0], 1, 0, &st)))
        rc = st_store_stat(st, &s);
    if ((rc = store_done(st, rc, 0)))
        return rc;
    if (a.json) {
        print_json(json_pack("{s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:I,s:f,s:I,s:I,s:I,s:I,s:I,s:I,s:I}", "schema",
                             (json_int_t)s.schema, "keep_last", (json_int_t)s.keep_last, "sessions",
                             (json_int_t)s.sessions, "versions", (json_int_t)s.versions, "logical_bytes",
                             (json_int_t)s.logical_bytes, "referenced_bytes", (json_int_t)s.referenced_bytes,
                             "chunks", (json_int_t)s.chunks, "stored_bytes", (json_int_t)s.stored_bytes,
                             "zero_count_chunks", (json_int_t)s.zero_count_chunks, "zero_count_bytes",
                             (json_int_t)s.zero_count_bytes, "dedup_ratio", s.dedup_ratio, "page_size",
                             (json_int_t)s.page_size, "pages_used", (json_int_t)s.pages_used, "pages_free",
                             (json_int_t)s.pages_free, "pages_free_run", (json_int_t)s.pages_free_run,
                             "map_size", (json_int_t)s.map_size, "budget",
                             (json_int_t)s.budget, "file_bytes", (json_int_t)s.file_bytes));
        return 0;
    }
    char b1[32], b2[32], b3[32];
    printf("store        %s (schema %u, keep last %u)\n", a.pos[0], s.schema, s.keep_last);
    printf("sessions     %" PRIu64 "\nversions     %" PRIu64 "\n", s.sessions, s.versions);
    printf("logical      %s in all versions\n", bytes_str(b1, sizeof b1, s.logical_bytes));
    printf("stored       %s in %" PRIu64 " chunks (%s referenced, dedup %.2fx)\n",
           bytes_str(b1, sizeof b1, s.stored_bytes), s.chunks, bytes_str(b2, sizeof b2, s.referenced_bytes),
           s.dedup_ratio);
    if (s.zero_count_chunks)
        printf("awaiting gc  %" PRIu64 " chunks (%s)\n", s.zero_count_chunks,
               bytes_str(b1, sizeof b1, s.zero_count_bytes));
    printf("pages        %" PRIu64 " used, %" PRIu64 " of them free (longest run %" PRIu64 "), %u bytes each\n",
           s.pages_used, s.pages_free, s.pages_free_run, s.page_size);
    printf("file         %s; map %s of a %s budget\n", bytes_str(b1, sizeof b1, s.file_bytes),
           bytes_str(b2, sizeof b2, s.map_size), bytes_str(b3, sizeof b3, s.budget));
    return 0;
}

/* ---- backup, restore, migrate --------------------------------------------------------------------- */

static const char backup_help[] =
    "usage: statectl backup STORE DEST\n"
    "\n"
    "Hot backup: a compacted copy of one consistent snapshot (the store may be in use), written to\n"
    "a temporary directory next to DEST, opened and fully checked (--read-data), then renamed to\n"
    "DEST. DEST must not exist or be empty.\n";

static int cmd_backup(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "", 2, "needs STORE and DEST", &a);
    if (rc)
        return rc;
    st_store *st = NULL;
    if (!(rc = open_store(a.pos[0], 1, 0, &st)))
        rc = st_store_backup(st, a.pos[1]);
    if ((rc = store_done(st, rc, 1)))
        return rc;
    printf("backup of %s written to %s and checked\n", a.pos[0], a.pos[1]);
    return 0;
}

/* The schema steps from `from` to `to`: a JSON array, or lines of text on stdout. */
static json_t *steps_json(uint32_t from, uint32_t to)
{
    size_t n = 0;
    const st_schema_step *steps = st_schema_steps(&n);
    json_t *arr = json_array();
    for (size_t i = 0; i < n; i++)
        if (steps[i].from >= from && steps[i].from < to)
            json_array_append_new(arr, json_pack("{s:I,s:I,s:s,s:s}", "from", (json_int_t)steps[i].from, "to",
                                                 (json_int_t)steps[i].from + 1, "name", steps[i].name, "summary",
                                                 steps[i].summary));
    return arr;
}

static void steps_text(uint32_t from, uint32_t to)
{
    size_t n = 0;
    const st_schema_step *steps = st_schema_steps(&n);
    for (size_t i = 0; i < n; i++)
        if (steps[i].from >= from && steps[i].from < to)
            printf("  step %u -> %u %s: %s\n", steps[i].from, steps[i].from + 1, steps[i].name, steps[i].summary);
}

static const char restore_help[] =
    "usage: statectl restore-backup BACKUP DEST [--json]\n"
    "\n"
    "Check BACKUP fully, copy it into DEST (must not exist or be empty) through a temporary\n"
    "directory, check the copy, and only then rename it into place. A backup of an older store\n"
    "schema (made by an older build) is copied, migrated to this build's schema in the temporary\n"
    "directory (as `statectl migrate` would; BACKUP itself is never written), and the migrated copy\n"
    "is checked before it is renamed into place: on any failure DEST is untouched. A backup of a\n"
    "newer schema than this build knows is refused. --json: one document with \"migrated\" (null,\n"
    "or the schemas and steps).\n";

static int cmd_restore(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,", 2, "needs BACKUP and DEST", &a);
    if (rc)
        return rc;
    st_store_opts o = {.progress = progress};
    st_schema_migrate_report r;
    rc = st_schema_restore_backup(a.pos[0], a.pos[1], &o, &r);
    if ((rc = store_done(NULL, rc, 1)))
        return rc;
    if (a.json) {
        json_t *m = json_null();
        if (r.n_steps)
            m = json_pack("{s:I,s:I,s:I,s:o}", "from", (json_int_t)r.from, "to", (json_int_t)r.to, "records",
                          (json_int_t)r.items, "steps", steps_json(r.from, r.to));
        print_json(json_pack("{s:s,s:s,s:I,s:b,s:o}", "backup", a.pos[0], "dest", a.pos[1], "schema",
                             (json_int_t)r.to, "checked", 1, "migrated", m));
        return 0;
    }
    printf("restored %s into %s (checked)\n", a.pos[0], a.pos[1]);
    if (r.n_steps) {
        printf("migrated from schema %u to %u before it was checked and put in place:\n", r.from, r.to);
        steps_text(r.from, r.to);
        printf("%" PRIu64 " records moved; %s is unchanged (schema %u)\n", r.items, a.pos[0], r.from);
    }
    return 0;
}

static const char migrate_help[] =
    "usage: statectl migrate STORE [--dry-run] [--no-backup] [--backup-dir DIR] [--json]\n"
    "\n"
    "Upgrade a store of an older schema to this build's, one numbered step at a time. First a\n"
    "compacted backup of the old store is written to DIR (default STORE.schemaN-backup) and\n"
    "verified, unless --no-backup. A migration that stops (crash, full disk) is resumed by running\n"
    "it again. --dry-run lists the steps and what they would move, and changes nothing. A store of\n"
    "a newer schema than this build knows is refused.\n";

static int cmd_migrate(int argc, char **argv)
{
    args a;
    int rc = parse_n(argc, argv, "--json,--dry-run,--no-backup,--backup-dir,", 1, "needs STORE", &a);
    if (rc)
        return rc;
    st_schema_migrate_opts o = {.dry_run = a.dry_run, .no_backup = a.no_backup, .backup_dir = a.backup_dir,
                                .progress = progress};
    st_schema_migrate_report r;
    rc = st_schema_migrate(a.pos[0], &o, &r);
    if ((rc = store_done(NULL, rc, 1)))
        return rc;
    if (a.json) {
        json_t *o2 = json_pack("{s:s,s:I,s:I,s:b,s:I,s:o}", "store", a.pos[0], "from", (json_int_t)r.from, "to",
                               (json_int_t)r.to, "dry_run", a.dry_run, "records", (json_int_t)r.items, "steps",
                               steps_json(r.from, r.to));
        json_object_set_new(o2, "backup", r.backup_dir[0] ? json_string(r.backup_dir) : json_null());
        print_json(o2);
        return 0;
    }
    if (r.n_steps == 0) {
        printf("%s is at schema %u, this build's: nothing to do\n", a.pos[0], r.from);
        return 0;
    }
    printf("%s %s from schema %u to %u:\n", a.pos[0], a.dry_run ? "would migrate" : "migrated", r.from, r.to);
    steps_text(r.from, r.to);
    printf("%" PRIu64 " records %s\n", r.items, a.dry_run ? "to move" : "moved");
    if (r.backup_dir[0])
        printf("backup of the old store: %s\n", r.backup_dir);
    else if (!a.dry_run)
        printf("no backup was taken (--no-backup)\n");
    return 0;
}

/* ---- dispatch ----------------------------------------------------------------------------------- */

typedef struct verb_def {
    const char *name;
    int (*fn)(int argc, char **argv);
    const char *help;
    const char *line;
} verb_def;

static const verb_def verbs[] = {
    {"ls", cmd_ls, ls_help, "ls STORE [--json]                sessions: head, versions, size, labels"},
    {"show", cmd_show, show_help, "show STORE ID[@VERSION] [--json] a session's versions, or one version"},
    {"import", cmd_import, import_help, "import STORE FILE [--id ID]      save a session file as a new version"},
    {"export", cmd_export, export_help, "export STORE ID[@VERSION] FILE   write a version as a session file"},
    {"rm", cmd_rm, rm_help, "rm STORE ID[@VERSION]            delete a version or a whole session"},
    {"label", cmd_label, label_help, "label STORE ID[@VERSION] NAME    label a version (kept by retention)"},
    {"gc", cmd_gc, gc_help, "gc STORE                         free chunks nothing references"},
    {"check", cmd_check, check_help, "check STORE [--read-data]        verify structure, counts (and data)"},
    {"stat", cmd_stat, stat_help, "stat STORE [--json]              sizes, dedup ratio, pages, map"},
    {"backup", cmd_backup, backup_help, "backup STORE DEST                hot, compacted, checked backup"},
    {"restore-backup", cmd_restore, restore_help, "restore-backup BACKUP DEST       restore a backup (older schemas migrated), checked"},
    {"migrate", cmd_migrate, migrate_help, "migrate STORE [--dry-run]        upgrade an older store schema"},
};

int statectl_store_is_verb(const char *v)
{
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++)
        if (!strcmp(v, verbs[i].name))
            return 1;
    return 0;
}

void statectl_store_usage_to(FILE *f)
{
    fputs("\nStores (STORE is a directory):\n", f);
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++)
        fprintf(f, "  %s\n", verbs[i].line);
}

int statectl_store_main(int argc, char **argv)
{
    for (size_t i = 0; i < sizeof verbs / sizeof verbs[0]; i++) {
        if (strcmp(argv[0], verbs[i].name))
            continue;
        statectl_verb = verbs[i].name;
        if (statectl_wants_help(argc, argv)) {
            fputs(verbs[i].help, stdout);
            return 0;
        }
        progress_on = isatty(STDERR_FILENO);
        return verbs[i].fn(argc, argv);
    }
    fprintf(stderr, "statectl: unknown store verb '%s'\n", argv[0]);
    return EXIT_USAGE;
}
