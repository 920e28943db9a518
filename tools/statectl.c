/*
 * statectl - Strata's offline tool. File verbs live here; store verbs in statectl_store.c.
 *
 * Exit status: 0 success; 1 a verification found a problem (verify, check) or the inputs differ
 * (diff); 2 usage error; 3 any other error (I/O, unreadable input, refused conversion).
 */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_migrate.h"
#include "st_file.h"
#include "statectl_store.h"
#include "statectl_util.h"

static void progress_end(void);

static int fail_rc(int rc)
{
    progress_end();
    return statectl_fail(rc);
}

/* ---- progress on a terminal ------------------------------------------------------------------
 * One line per phase, redrawn when the percentage changes; only when stderr is a terminal. */

static int progress_tty;
static int progress_open; /* a progress line is on the screen without its newline */

static void progress_cb(void *arg, const char *phase, uint64_t done, uint64_t total)
{
    static const char *last_phase;
    static unsigned last_pct = 101;
    unsigned pct;
    (void)arg;
    if (!progress_tty || !total)
        return;
    pct = (unsigned)((double)done * 100.0 / (double)total);
    if (phase == last_phase && pct == last_pct && done != total)
        return;
    last_phase = phase;
    last_pct = pct;
    fprintf(stderr, "\r%s: %-6s %3u%% (%" PRIu64 "/%" PRIu64 ")   ", statectl_verb, phase, pct, done,
            total);
    progress_open = done != total;
    if (done == total)
        fputc('\n', stderr);
}

/* End a progress line left open by work that stopped early, before an error message. */
static void progress_end(void)
{
    if (progress_open)
        fputc('\n', stderr);
    progress_open = 0;
}

/* The library's byte progress; arg is the phase name. */
static void progress_bytes(void *arg, uint64_t done, uint64_t total)
{
    progress_cb(arg, (const char *)arg, done, total);
}

/* ---- the temp file of an interrupted write ------------------------------------------------------
 * st_file_write writes "<OUT>.tmp.<pid>.<n>" (st_replace_tmp_name builds that name) and removes it
 * on every failure (docs/FORMAT.md, "Writing"); a signal that kills the process is no failure it
 * sees. convert and synth write one file per process, n 0, so on SIGINT, SIGTERM or SIGHUP that
 * name is removed before dying. */

static char interrupted_tmp[4200];

static void on_fatal_signal(int sig)
{
    if (interrupted_tmp[0])
        unlink(interrupted_tmp);
    signal(sig, SIG_DFL);
    raise(sig);
}

static void remove_temp_on_signal(const char *out)
{
    struct sigaction sa;
    if (st_replace_tmp_name(interrupted_tmp, sizeof interrupted_tmp, out, (long)getpid(), 0))
        interrupted_tmp[0] = '\0'; /* longer than PATH_MAX: no such temp file can exist */
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_fatal_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGHUP, &sa, NULL);
}

/* ---- formatting helpers ------------------------------------------------------------------------ */

static void shape_str(char *dst, size_t cap, const st_tensor_desc *t)
{
    size_t used = (size_t)snprintf(dst, cap, "[");
    for (uint32_t d = 0; d < t->ndim && used < cap; d++)
        used += (size_t)snprintf(dst + used, cap - used, "%s%" PRIu64, d ? ", " : "", t->shape[d]);
    if (used < cap)
        snprintf(dst + used, cap - used, "]");
}

static const char *role_name(uint32_t role)
{
    return role == ST_ROLE_RUNNING ? "running" : role == ST_ROLE_KV ? "kv" : "unknown";
}

/* ---- inspect --------------------------------------------------------------------------------- */

static const char inspect_help[] =
    "usage: statectl inspect FILE [--json]\n"
    "\n"
    "Show a session file: format and version, model fingerprint, the model's architecture (its\n"
    "ARCH section: qwen35, llama, ...; \"unknown\" for a file written before files named it), layer\n"
    "kinds (one letter per layer from the geometry: D Gated DeltaNet, conv and SSM state;\n"
    "A attention, K/V), geometry, tokens, every section\n"
    "with its offset, length and checksum (ok or BAD), and the checkpoints with position and codec.\n"
    "Reads the file with bounded memory. A damaged or truncated file is shown as far as it can be\n"
    "read, with the first problem (naming the section and offset) and where the walk stopped.\n"
    "Exit 0 when every check passes, 1 when the file is damaged (a checksum, a length, a truncation),\n"
    "3 when it cannot be read as a session file at all (not one, a version this build does not\n"
    "read, an I/O error); 2 for a usage error.\n";

/* What inspect could read: the header's fields once its 64 bytes are there, the geometry once its
 * section parsed. */
static int info_has_header(const st_file_info *in)
{
    return in->file_len >= 64;
}

static int info_has_geometry(const st_file_info *in)
{
    return in->geometry.tensors != NULL;
}

static json_t *info_json(const char *path, const st_file_info *in, const char *stopped)
{
    char fp[2 * ST_FINGERPRINT_LEN + 1];
    st_hex_encode(fp, in->geometry.model_fp, ST_FINGERPRINT_LEN);
    json_t *tensors = json_array();
    for (uint32_t i = 0; i < in->geometry.n_tensors; i++) {
        const st_tensor_desc *t = &in->geometry.tensors[i];
        json_t *shape = json_array();
        for (uint32_t d = 0; d < t->ndim; d++)
            json_array_append_new(shape, json_integer((json_int_t)t->shape[d]));
        json_array_append_new(tensors, json_pack("{s:s,s:s,s:s,s:o}", "name", t->name, "role",
                                                 role_name(t->role), "dtype",
                                                 st_dtype_name(t->dtype), "shape", shape));
    }
    json_t *sections = json_array(), *ckpts = json_array();
    for (uint32_t i = 0; i < in->n_sections; i++) {
        const st_file_section_info *s = &in->sections[i];
        char ck[17];
        snprintf(ck, sizeof ck, "%016" PRIx64, s->checksum);
        json_array_append_new(sections,
                              json_pack("{s:s,s:I,s:I,s:I,s:s,s:b}", "type",
                                        st_section_type_name(s->type), "index", (json_int_t)s->index,
                                        "offset", (json_int_t)s->offset, "length",
                                        (json_int_t)s->length, "checksum", ck, "checksum_ok",
                                        s->checksum_ok));
        if (s->type == ST_SECTION_CHECKPOINT)
            json_array_append_new(ckpts, json_pack("{s:I,s:I,s:s,s:b}", "index", (json_int_t)s->index,
                                                   "position", (json_int_t)s->position, "codec",
                                                   st_codec_name(s->codec), "compressed",
                                                   s->compressed != 0));
    }
    char sh[17];
    snprintf(sh, sizeof sh, "%016" PRIx64, in->state_hash);
    json_t *geometry = json_null();
    if (info_has_geometry(in)) {
        char kinds[4200];
        st_geometry_layer_kinds(&in->geometry, kinds, sizeof kinds);
        geometry = json_pack("{s:I,s:I,s:I,s:s,s:o}", "page_size", (json_int_t)in->geometry.page_size,
                             "n_ctx", (json_int_t)in->geometry.n_ctx, "n_vocab",
                             (json_int_t)in->geometry.n_vocab, "layers", kinds, "tensors", tensors);
    } else
        json_decref(tensors);
    int hdr = info_has_header(in), geo = info_has_geometry(in);
    json_t *o = json_pack("{s:s,s:I,s:I,s:o,s:o,s:o,s:o,s:o,s:o,s:o,s:b}", "file", path, "version",
                          (json_int_t)in->version, "size", (json_int_t)in->file_len,
                          "model_fingerprint", geo ? json_string(fp) : json_null(), "architecture",
                          in->geometry.arch[0] ? json_string(in->geometry.arch) : json_null(), "state_hash",
                          hdr ? json_string(sh) : json_null(), "tokens",
                          hdr ? json_integer((json_int_t)in->n_tokens) : json_null(), "geometry",
                          geometry, "sections", sections, "checkpoints", ckpts, "ok", in->all_ok);
    if (!in->all_ok && in->first_error)
        json_object_set_new(o, "error", json_sprintf("%s: %s", st_strerror(in->first_error),
                                                     in->first_error_detail));
    if (stopped[0])
        json_object_set_new(o, "stopped", json_string(stopped));
    return o;
}

static void info_text(const char *path, const st_file_info *in, const char *stopped)
{
    char fp[2 * ST_FINGERPRINT_LEN + 1], shape[96];
    st_hex_encode(fp, in->geometry.model_fp, ST_FINGERPRINT_LEN);
    printf("file         %s\n", path);
    printf("format       Strata session file v%u\n", in->version);
    printf("size         %" PRIu64 " bytes\n", in->file_len);
    if (info_has_geometry(in))
        printf("model        %s\n", fp);
    if (in->geometry.arch[0])
        printf("architecture %s\n", in->geometry.arch);
    else if (info_has_geometry(in))
        printf("architecture unknown (written before session files named it)\n");
    if (!info_has_header(in)) {
        printf("header       truncated\n");
    } else {
        printf("state hash   %016" PRIx64 "\n", in->state_hash);
        printf("tokens       %" PRIu64 "\n", in->n_tokens);
    }
    if (!info_has_geometry(in)) {
        if (info_has_header(in))
            printf("geometry     not readable\n");
    } else {
        char kinds[4200];
        st_geometry_layer_kinds(&in->geometry, kinds, sizeof kinds);
        printf("layers       %s\n", kinds);
        printf("geometry     page_size %u, n_ctx %u, n_vocab %u, %u tensors\n",
               in->geometry.page_size, in->geometry.n_ctx, in->geometry.n_vocab,
               in->geometry.n_tensors);
    }
    for (uint32_t i = 0; i < in->geometry.n_tensors && info_has_geometry(in); i++) {
        const st_tensor_desc *t = &in->geometry.tensors[i];
        shape_str(shape, sizeof shape, t);
        printf("  %-32s %-8s %-5s %s\n", t->name, role_name(t->role), st_dtype_name(t->dtype), shape);
    }
    if (in->n_sections) {
        printf("sections\n  %-3s %-11s %5s %12s %12s  %-16s  %s\n", "#", "type", "index", "offset",
               "length", "checksum", "ok");
        for (uint32_t i = 0; i < in->n_sections; i++) {
            const st_file_section_info *s = &in->sections[i];
            printf("  %-3u %-11s %5u %12" PRIu64 " %12" PRIu64 "  %016" PRIx64 "  %s\n", i,
                   st_section_type_name(s->type), s->index, s->offset, s->length, s->checksum,
                   s->checksum_ok ? "ok" : "BAD");
        }
        printf("checkpoints\n");
        for (uint32_t i = 0; i < in->n_sections; i++) {
            const st_file_section_info *s = &in->sections[i];
            if (s->type == ST_SECTION_CHECKPOINT)
                printf("  %-3u position %-10" PRIu64 " codec %s%s\n", s->index, s->position,
                       st_codec_name(s->codec), s->compressed ? ", zstd" : "");
        }
    }
    if (in->all_ok)
        printf("all checks ok\n");
    else
        printf("PROBLEM: %s%s%s\n", st_strerror(in->first_error ? in->first_error : ST_ECORRUPT),
               in->first_error_detail[0] ? ": " : "", in->first_error_detail);
    if (stopped[0])
        printf("stopped: %s\n", stopped);
}

static int cmd_inspect(int argc, char **argv)
{
    if (statectl_wants_help(argc, argv)) {
        fputs(inspect_help, stdout);
        return 0;
    }
    const char *path = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            as_json = 1;
        else if (argv[i][0] == '-')
            return statectl_usage("unknown option %s", argv[i]);
        else if (!path)
            path = argv[i];
        else
            return statectl_usage("unexpected argument %s", argv[i]);
    }
    if (!path)
        return statectl_usage("%smissing FILE", "");
    st_file_info info;
    memset(&info, 0, sizeof info);
    int rc = st_file_inspect(path, &info);
    /* not a session file this build can walk at all: no report, an error */
    if (rc > 0 || rc == ST_ENOTSTRATA || rc == ST_EVERSION || (rc && info.version == 0)) {
        st_file_info_free(&info);
        return fail_rc(rc);
    }
    /* the walk stopped early (a truncation, a section longer than the file): say where, unless
     * that is already the problem reported */
    char stopped[600] = "";
    if (rc && strcmp(st_errdetail(), info.first_error_detail) != 0)
        snprintf(stopped, sizeof stopped, "%s", st_errdetail());
    if (as_json) {
        json_t *o = info_json(path, &info, stopped);
        json_dumpf(o, stdout, JSON_INDENT(2));
        fputc('\n', stdout);
        json_decref(o);
    } else {
        info_text(path, &info, stopped);
    }
    int ok = info.all_ok && !rc;
    st_file_info_free(&info);
    return ok ? 0 : EXIT_PROBLEM;
}

/* ---- verify ---------------------------------------------------------------------------------- */

static const char verify_help[] =
    "usage: statectl verify FILE [--quiet]\n"
    "\n"
    "Load the file completely, checking every structure, length, reserved field and checksum.\n"
    "Exit 0 only when all checks pass; otherwise print what failed, naming the section and\n"
    "offset, and exit 1 (3 when the file cannot be opened or read; 2 for a usage error).\n"
    "Shows progress on a terminal; --quiet prints nothing when the file is ok.\n";

static int cmd_verify(int argc, char **argv)
{
    if (statectl_wants_help(argc, argv)) {
        fputs(verify_help, stdout);
        return 0;
    }
    const char *path = NULL;
    int quiet = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--quiet") || !strcmp(argv[i], "-q"))
            quiet = 1;
        else if (argv[i][0] == '-')
            return statectl_usage("unknown option %s", argv[i]);
        else if (!path)
            path = argv[i];
        else
            return statectl_usage("unexpected argument %s", argv[i]);
    }
    if (!path)
        return statectl_usage("%smissing FILE", "");
    st_image *img = NULL;
    st_file_read_opts ro = {.progress = progress_bytes, .progress_arg = (void *)"verify"};
    progress_tty = !quiet && isatty(STDERR_FILENO);
    int rc = st_file_read(path, &ro, &img);
    if (!rc)
        rc = st_image_check(img);
    if (rc) {
        const char *d = st_errdetail();
        progress_end();
        /* the detail names the file (st_file_read puts the path first) */
        fprintf(stderr, "statectl verify: %s%s%s\n", st_strerror(rc), *d ? ": " : "", d);
        st_image_free(img);
        return rc > 0 ? EXIT_ERROR : EXIT_PROBLEM;
    }
    if (!quiet)
        printf("%s: ok (%" PRIu64 " tokens, %u checkpoints)\n", path, st_image_n_tokens(img),
               st_image_n_checkpoints(img));
    st_image_free(img);
    return 0;
}

/* ---- convert --------------------------------------------------------------------------------- */

static const char convert_help[] =
    "usage: statectl convert IN OUT [--codec fp32|bf16|f16] [--format v1|v2]\n"
    "                               [--compress zstd[:LEVEL] | --no-compress]\n"
    "\n"
    "Rewrite a session file. --codec re-codes every checkpoint's float running state (K/V and\n"
    "integer state are never touched); --format forces the version (default: v1 when all state\n"
    "is fp32 and uncompressed, else v2); --compress frames checkpoint tensors with byte-shuffle +\n"
    "zstd (v2 only, LEVEL 1..19, default 3). Refuses to write v1 from state that is not fp32\n"
    "(widen with --codec fp32). IN is never modified; OUT is replaced atomically, and may be IN:\n"
    "on any failure or interruption OUT keeps its old content and no temporary file is left.\n"
    "Shows progress on a terminal. Exit 0 on success, 2 for a usage error, 3 when IN cannot be\n"
    "read or the conversion is refused or fails.\n";

static int cmd_convert(int argc, char **argv)
{
    if (statectl_wants_help(argc, argv)) {
        fputs(convert_help, stdout);
        return 0;
    }
    const char *in = NULL, *out = NULL;
    st_convert_opts o = {.codec = -1, .progress = progress_cb};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--codec") || !strcmp(a, "--format") || !strcmp(a, "--compress")) {
            if (i + 1 >= argc)
                return statectl_usage("%s needs a value", a);
            const char *v = argv[++i];
            if (!strcmp(a, "--codec")) {
                st_codec_id c;
                if (st_codec_parse(v, &c))
                    return statectl_usage("unknown codec '%s' (fp32, bf16, f16)", v);
                o.codec = (int)c;
            } else if (!strcmp(a, "--format")) {
                if (!strcmp(v, "v1") || !strcmp(v, "1"))
                    o.version = 1;
                else if (!strcmp(v, "v2") || !strcmp(v, "2"))
                    o.version = 2;
                else
                    return statectl_usage("unknown format '%s' (v1, v2)", v);
            } else {
                if (strncmp(v, "zstd", 4) || (v[4] && v[4] != ':'))
                    return statectl_usage("unknown compression '%s' (zstd or zstd:LEVEL)", v);
                o.compress = 3;
                if (v[4] == ':') {
                    char *end;
                    long lv = strtol(v + 5, &end, 10);
                    if (*end || lv < 1 || lv > 19)
                        return statectl_usage("zstd level '%s' is not 1..19", v + 5);
                    o.compress = (int)lv;
                }
            }
        } else if (!strcmp(a, "--no-compress")) {
            o.compress = 0;
        } else if (a[0] == '-' && a[1]) {
            return statectl_usage("unknown option %s", a);
        } else if (!in) {
            in = a;
        } else if (!out) {
            out = a;
        } else {
            return statectl_usage("unexpected argument %s", a);
        }
    }
    if (!in || !out)
        return statectl_usage("%sneeds IN and OUT", "");
    if (o.version == 1 && o.compress)
        return statectl_usage("%sformat v1 cannot be compressed", "");
    progress_tty = isatty(STDERR_FILENO);
    struct stat si, so;
    int have_in = stat(in, &si) == 0; /* before: OUT may be IN */
    remove_temp_on_signal(out);
    int rc = st_migrate_file_convert(in, out, &o);
    if (rc)
        return fail_rc(rc);
    if (have_in && !stat(out, &so))
        fprintf(stderr, "statectl convert: %s (%lld bytes) -> %s (%lld bytes)\n", in,
                (long long)si.st_size, out, (long long)so.st_size);
    return 0;
}

/* ---- diff ------------------------------------------------------------------------------------- */

static const char diff_help[] =
    "usage: statectl diff A B [--json]\n"
    "\n"
    "Compare two session files of the same model and geometry, tensor by tensor: for float data\n"
    "the max absolute and relative error, sign changes, values that became zero and values that\n"
    "became non-finite (the figures a lossy codec must report); other data byte by byte.\n"
    "Checkpoints are matched by position. Exit 0 when identical, 1 when they differ, 3 when they\n"
    "cannot be compared (another model or geometry: the message names the difference) or a file\n"
    "cannot be read; 2 for a usage error.\n";

static int cmd_diff(int argc, char **argv)
{
    if (statectl_wants_help(argc, argv)) {
        fputs(diff_help, stdout);
        return 0;
    }
    const char *pa = NULL, *pb = NULL;
    int as_json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--json"))
            as_json = 1;
        else if (argv[i][0] == '-')
            return statectl_usage("unknown option %s", argv[i]);
        else if (!pa)
            pa = argv[i];
        else if (!pb)
            pb = argv[i];
        else
            return statectl_usage("unexpected argument %s", argv[i]);
    }
    if (!pa || !pb)
        return statectl_usage("%sneeds two files", "");
    st_image *a = NULL, *b = NULL;
    st_diff d;
    memset(&d, 0, sizeof d);
    int rc = st_file_read(pa, NULL, &a);
    if (rc)
        return fail_rc(rc);
    rc = st_file_read(pb, NULL, &b);
    if (!rc)
        rc = st_migrate_diff(a, b, &d);
    st_image_free(a);
    st_image_free(b);
    if (rc)
        return fail_rc(rc);

    if (as_json) {
        json_t *arr = json_array();
        for (uint32_t i = 0; i < d.n_entries; i++) {
            const st_diff_entry *e = &d.entries[i];
            json_t *o = json_pack("{s:s,s:I,s:b}", "what", e->what, "n", (json_int_t)e->n,
                                  "float", e->float_compare);
            if (e->float_compare) {
                json_object_set_new(o, "max_abs", json_real(e->stat.max_abs));
                json_object_set_new(o, "max_rel", json_real(e->stat.max_rel));
                json_object_set_new(o, "sign_changes", json_integer((json_int_t)e->stat.sign_changes));
                json_object_set_new(o, "new_zeros", json_integer((json_int_t)e->stat.new_zeros));
                json_object_set_new(o, "new_nonfinite",
                                    json_integer((json_int_t)e->stat.new_nonfinite));
                json_object_set_new(o, "differ", json_integer((json_int_t)e->stat.differ));
            } else {
                json_object_set_new(o, "bytes_differ", json_integer((json_int_t)e->bytes_differ));
            }
            json_array_append_new(arr, o);
        }
        json_t *top = json_pack("{s:s,s:s,s:b,s:s,s:o}", "a", pa, "b", pb, "identical", d.identical,
                                "note", d.note, "entries", arr);
        json_dumpf(top, stdout, JSON_INDENT(2));
        fputc('\n', stdout);
        json_decref(top);
    } else {
        printf("%-40s %12s %12s %12s %8s %8s %8s %10s\n", "tensor", "n", "max_abs", "max_rel",
               "signs", "zeros", "nonfin", "differ");
        double worst_rel = 0;
        uint64_t signs = 0, zeros = 0, nonfin = 0;
        for (uint32_t i = 0; i < d.n_entries; i++) {
            const st_diff_entry *e = &d.entries[i];
            if (e->float_compare) {
                printf("%-40s %12" PRIu64 " %12.6g %11.4f%% %8" PRIu64 " %8" PRIu64 " %8" PRIu64
                       " %10" PRIu64 "\n",
                       e->what, e->n, e->stat.max_abs, e->stat.max_rel * 100.0,
                       e->stat.sign_changes, e->stat.new_zeros, e->stat.new_nonfinite,
                       e->stat.differ);
                if (e->stat.max_rel > worst_rel)
                    worst_rel = e->stat.max_rel;
                signs += e->stat.sign_changes;
                zeros += e->stat.new_zeros;
                nonfin += e->stat.new_nonfinite;
            } else {
                printf("%-40s %12" PRIu64 " %12s %12s %8s %8s %8s %10" PRIu64 " bytes\n", e->what,
                       e->n, "-", "-", "-", "-", "-", e->bytes_differ);
            }
        }
        if (d.note[0])
            printf("note: %s\n", d.note);
        printf("%s: largest relative error %.4f%%, %" PRIu64 " sign changes, %" PRIu64
               " new zeros, %" PRIu64 " new non-finite\n",
               d.identical ? "identical" : "differ", worst_rel * 100.0, signs, zeros, nonfin);
    }
    int same = d.identical;
    st_diff_free(&d);
    return same ? 0 : EXIT_PROBLEM;
}

/* ---- synth ------------------------------------------------------------------------------------ */

static const char synth_help[] =
    "usage: statectl synth OUT [--tokens N] [--layers N] [--head-dim N] [--heads N] [--ctx N]\n"
    "                          [--checkpoints N] [--codec fp32|bf16|f16] [--seed S]\n"
    "                          [--compress zstd[:LEVEL]]\n"
    "\n"
    "Write a synthetic session file: seeded state shaped like a hybrid model's (recurrent state,\n"
    "convolution history, f16 K/V every fourth layer), for demos, tests and benchmarks. No engine\n"
    "or model is involved; the same options always give the same bytes. --ctx defaults to 4096,\n"
    "or to --tokens when that is larger. Shows progress on a terminal. Exit 0 on success, 2 for a\n"
    "usage error, 3 when the file cannot be written.\n";

static int parse_u64(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || !*s || s[0] == '-')
        return -1;
    *out = v;
    return 0;
}

static int cmd_synth(int argc, char **argv)
{
    if (statectl_wants_help(argc, argv)) {
        fputs(synth_help, stdout);
        return 0;
    }
    st_synth_opts so = {.seed = 1};
    st_file_write_opts wo = {.shuffle = 1, .progress = progress_bytes, .progress_arg = (void *)"write"};
    const char *out = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (a[0] != '-') {
            if (out)
                return statectl_usage("unexpected argument %s", a);
            out = a;
            continue;
        }
        if (i + 1 >= argc)
            return statectl_usage("%s needs a value", a);
        const char *v = argv[++i];
        uint64_t n = 0;
        if (!strcmp(a, "--codec")) {
            st_codec_id c;
            if (st_codec_parse(v, &c))
                return statectl_usage("unknown codec '%s' (fp32, bf16, f16)", v);
            so.codec = c;
            continue;
        }
        if (!strcmp(a, "--compress")) {
            if (strncmp(v, "zstd", 4) || (v[4] && v[4] != ':'))
                return statectl_usage("unknown compression '%s' (zstd or zstd:LEVEL)", v);
            wo.compress = 3;
            if (v[4] == ':') {
                char *end;
                long lv = strtol(v + 5, &end, 10);
                if (end == v + 5 || *end || lv < 1 || lv > 19)
                    return statectl_usage("zstd level in '%s' is not 1..19", v);
                wo.compress = (int)lv;
            }
            continue;
        }
        if (parse_u64(v, &n) || n > UINT32_MAX)
            return statectl_usage("'%s' is not a valid number", v);
        if (!strcmp(a, "--tokens"))
            so.n_tokens = n;
        else if (!strcmp(a, "--layers"))
            so.n_layers = (uint32_t)n;
        else if (!strcmp(a, "--head-dim"))
            so.head_dim = (uint32_t)n;
        else if (!strcmp(a, "--heads"))
            so.heads = (uint32_t)n;
        else if (!strcmp(a, "--ctx"))
            so.n_ctx = (uint32_t)n;
        else if (!strcmp(a, "--checkpoints"))
            so.n_checkpoints = (uint32_t)n;
        else if (!strcmp(a, "--seed"))
            so.seed = n;
        else
            return statectl_usage("unknown option %s", a);
    }
    if (!out)
        return statectl_usage("%smissing OUT", "");
    if (so.n_tokens && !so.n_ctx && so.n_tokens > 4096)
        so.n_ctx = (uint32_t)so.n_tokens;
    progress_tty = isatty(STDERR_FILENO);
    st_image *img = NULL;
    int rc = st_image_synthesize(&so, &img);
    if (rc == ST_EINVAL) /* options that do not go together (more tokens than --ctx, ...) */
        return statectl_usage("%s", st_errdetail());
    remove_temp_on_signal(out);
    if (!rc)
        rc = st_file_write(img, out, &wo);
    if (rc) {
        st_image_free(img);
        return fail_rc(rc);
    }
    fprintf(stderr, "statectl synth: wrote %s (%" PRIu64 " tokens, %u checkpoints, %" PRIu64
                    " payload bytes)\n",
            out, st_image_n_tokens(img), st_image_n_checkpoints(img), st_image_bytes(img));
    st_image_free(img);
    return 0;
}

/* ---- main ------------------------------------------------------------------------------------- */

static void usage(FILE *f)
{
    fputs("usage: statectl VERB [ARGS] (statectl VERB --help for each verb)\n"
          "       statectl --version          the version (and the session-file versions it reads)\n"
          "\n"
          "Session files:\n"
          "  inspect FILE [--json]            format, architecture, layers, geometry, sections, checksums\n"
          "  verify FILE [--quiet]            exit 0 only if every check passes\n"
          "  convert IN OUT [--codec C] [--format v1|v2] [--compress zstd[:L]]\n"
          "  diff A B [--json]                per-tensor error figures between two files\n"
          "  synth OUT [options]              write a synthetic session file (demos, tests)\n",
          f);
    statectl_store_usage_to(f);
    fputs("\n"
          "Exit status: 0 success; 1 a check found a problem or the files differ; 2 usage error;\n"
          "3 any other error (unreadable input, I/O, refused conversion).\n",
          f);
}

int main(int argc, char **argv)
{
    if (argc < 2) {
        usage(stderr);
        return EXIT_USAGE;
    }
    const char *verb = argv[1];
    statectl_verb = verb;
    if (!strcmp(verb, "--help") || !strcmp(verb, "-h") || !strcmp(verb, "help")) {
        usage(stdout);
        return 0;
    }
    if (!strcmp(verb, "--version")) {
        printf("statectl %s (session files v1..v%d)\n", st_version(), ST_FILE_VERSION_MAX);
        return 0;
    }
    if (!strcmp(verb, "inspect"))
        return cmd_inspect(argc - 1, argv + 1);
    if (!strcmp(verb, "verify"))
        return cmd_verify(argc - 1, argv + 1);
    if (!strcmp(verb, "convert"))
        return cmd_convert(argc - 1, argv + 1);
    if (!strcmp(verb, "diff"))
        return cmd_diff(argc - 1, argv + 1);
    if (!strcmp(verb, "synth"))
        return cmd_synth(argc - 1, argv + 1);
    if (statectl_store_is_verb(verb))
        return statectl_store_main(argc - 1, argv + 1);
    statectl_verb = "statectl";
    fprintf(stderr, "statectl: unknown verb '%s'\n", verb);
    usage(stderr);
    return EXIT_USAGE;
}
