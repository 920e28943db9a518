/*
 * strata-server - the REST API over a Strata store and, with --model, the attached engine.
 * docs/API.md describes the routes; `strata-server --help` the options.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_api.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: strata-server --store DIR [--model FILE] [options]\n"
            "Listening:\n"
            "  --host ADDR                   address (default 127.0.0.1)\n"
            "  --port N                      port (default 8080; 0: any free port)\n"
            "  --ready-file FILE             write the bound port there once listening\n"
            "  --api-key-file FILE           require 'Authorization: Bearer <key in FILE>'\n"
            "Conversations (with --model):\n"
            "  --slots N                     live conversations (default 4)\n"
            "  --conversation-cache-mib N    RAM for parked conversations (default 1024)\n"
            "  --slot-save-path DIR          directory of /slots/{id}?action=save|restore files\n"
            "  --threads N  --ubatch N  --ctx N  --page-size N  --kv-dtype f16|i8\n"
            "  --prompt-cache K  --prompt-cache-every N  --prompt-cache-root N\n"
            "  --session-state-codec fp32|bf16   running-state codec of SAVE (default fp32)\n"
            "  --save-compress LEVEL         zstd level of stored chunks (default 0: raw)\n"
            "  --max-n-predict N             cap on n_predict (default 4096)\n"
            "Store:\n"
            "  --keep-last N                 versions kept per session\n"
            "  --spool-dir DIR               temporary files (default STORE/spool)\n"
            "Limits:\n"
            "  --workers N                   worker threads (default 8)\n"
            "  --max-connections N           (default 256)\n"
            "  --max-header-bytes N          request line + headers (default 16384)\n"
            "  --max-headers N               header lines (default 64)\n"
            "  --max-json-kib N              JSON bodies of save/restore/park/commit (default 64)\n"
            "  --max-completion-kib N        completion bodies (default 4096)\n"
            "  --max-part-mib N              one upload part (default 16)\n"
            "  --max-upload-mib N            one whole upload (default 65536)\n"
            "  --body-budget-mib N           request bodies buffered at once (default 256)\n"
            "  --head-timeout-ms N  --read-timeout-ms N  --body-timeout-ms N\n"
            "  --write-timeout-ms N  --idle-timeout-ms N  --shutdown-timeout-ms N\n"
            "  --upload-ttl-s N              drop uploads untouched this long (default 3600)\n"
            "Memory guard:\n"
            "  --mem-guard on|off            admit park/SAVE/RESTORE by available RAM (default on)\n"
            "  --mem-reserve-mib N           RAM kept free besides an operation (default 256)\n"
            "  --meminfo FILE                read MemAvailable from FILE (tests)\n"
            "Other:\n"
            "  --log-requests                one line per request on stderr\n"
            "  --help\n");
}

static int num(const char *flag, const char *v, unsigned long long max, unsigned long long *out)
{
    char *end;
    errno = 0;
    unsigned long long x = v ? strtoull(v, &end, 10) : 0;
    if (!v || errno || *end || end == v || x > max) {
        fprintf(stderr, "strata-server: %s needs a number up to %llu, got \"%s\"\n", flag, max,
                v ? v : "");
        return -1;
    }
    *out = x;
    return 0;
}

int main(int argc, char **argv)
{
    st_api_config c;
    st_api_config_default(&c);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--log-requests")) {
            c.log_requests = 1;
            continue;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "strata-server: %s needs a value (or is unknown)\n", a);
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        unsigned long long x = 0;
        const unsigned long long U32 = 0xffffffffull, MIB = 1ull << 20;
#define NUM(flag, max, dst, scale)                                                                 \
    if (!strcmp(a, flag)) {                                                                        \
        if (num(a, v, max, &x))                                                                    \
            return 2;                                                                              \
        dst = x * (scale);                                                                         \
        continue;                                                                                  \
    }
        if (!strcmp(a, "--host")) { c.host = v; continue; }
        if (!strcmp(a, "--store")) { c.store_dir = v; continue; }
        if (!strcmp(a, "--model") || !strcmp(a, "-m")) { c.model_path = v; continue; }
        if (!strcmp(a, "--api-key-file")) { c.api_key_file = v; continue; }
        if (!strcmp(a, "--slot-save-path")) { c.slot_save_path = v; continue; }
        if (!strcmp(a, "--spool-dir")) { c.spool_dir = v; continue; }
        if (!strcmp(a, "--ready-file")) { c.ready_file = v; continue; }
        if (!strcmp(a, "--meminfo")) { c.meminfo_path = v; continue; }
        if (!strcmp(a, "--mem-guard")) {
            if (strcmp(v, "on") && strcmp(v, "off")) {
                fprintf(stderr, "strata-server: --mem-guard on|off\n");
                return 2;
            }
            c.mem_guard = !strcmp(v, "on");
            continue;
        }
        if (!strcmp(a, "--kv-dtype")) {
            if (!strcmp(v, "f16"))
                c.kv_dtype = 1; /* ST_DTYPE_F16 */
            else if (!strcmp(v, "i8"))
                c.kv_dtype = 3; /* ST_DTYPE_I8 */
            else {
                fprintf(stderr, "strata-server: --kv-dtype f16|i8\n");
                return 2;
            }
            continue;
        }
        if (!strcmp(a, "--session-state-codec")) {
            st_codec_id id;
            if (st_codec_parse(v, &id) || (id != ST_CODEC_FP32 && id != ST_CODEC_BF16)) {
                fprintf(stderr, "strata-server: --session-state-codec fp32|bf16\n");
                return 2;
            }
            c.state_codec = id;
            continue;
        }
        if (!strcmp(a, "--prompt-cache")) {
            if (num(a, v, 64, &x))
                return 2;
            c.prompt_cache = (uint32_t)x;
            c.prompt_cache_set = 1;
            continue;
        }
        NUM("--port", 65535, c.port, 1)
        NUM("--slots", 1024, c.slots, 1)
        NUM("--workers", 256, c.workers, 1)
        NUM("--conversation-cache-mib", 1ull << 24, c.conversation_cache_bytes, MIB)
        NUM("--threads", 1024, c.threads, 1)
        NUM("--ubatch", 1u << 20, c.ubatch, 1)
        NUM("--ctx", U32, c.n_ctx, 1)
        NUM("--page-size", 1u << 20, c.page_size, 1)
        NUM("--prompt-cache-every", 1u << 24, c.prompt_cache_every, 1)
        NUM("--prompt-cache-root", 1u << 24, c.prompt_cache_root, 1)
        NUM("--save-compress", 19, c.save_compress, 1)
        NUM("--max-n-predict", 1u << 24, c.max_n_predict, 1)
        NUM("--keep-last", 1u << 20, c.keep_last, 1)
        NUM("--max-connections", 1u << 20, c.max_connections, 1)
        NUM("--max-header-bytes", 1u << 20, c.max_header_bytes, 1)
        NUM("--max-headers", 4096, c.max_headers, 1)
        NUM("--max-json-kib", 1u << 20, c.max_json_body, 1024)
        NUM("--max-completion-kib", 1u << 20, c.max_completion_body, 1024)
        NUM("--max-part-mib", 4096, c.max_part_bytes, MIB)
        NUM("--max-upload-mib", 1ull << 30, c.max_upload_bytes, MIB)
        NUM("--body-budget-mib", 1ull << 20, c.body_budget, MIB)
        NUM("--head-timeout-ms", U32, c.head_timeout_ms, 1)
        NUM("--read-timeout-ms", U32, c.read_timeout_ms, 1)
        NUM("--body-timeout-ms", U32, c.body_timeout_ms, 1)
        NUM("--write-timeout-ms", U32, c.write_timeout_ms, 1)
        NUM("--idle-timeout-ms", U32, c.idle_timeout_ms, 1)
        NUM("--shutdown-timeout-ms", U32, c.shutdown_timeout_ms, 1)
        NUM("--upload-ttl-s", U32, c.upload_ttl_s, 1)
        NUM("--mem-reserve-mib", 1ull << 24, c.mem_reserve_bytes, MIB)
#undef NUM
        fprintf(stderr, "strata-server: unknown option %s\n", a);
        usage(stderr);
        return 2;
    }
    if (!c.store_dir) {
        fprintf(stderr, "strata-server: --store DIR is required\n");
        usage(stderr);
        return 2;
    }
    st_api_server *s = NULL;
    int rc = st_api_server_new(&c, &s);
    if (rc) {
        const char *d = st_errdetail();
        fprintf(stderr, "strata-server: %s\n", d && *d ? d : st_strerror(rc));
        return 1;
    }
    rc = st_api_server_run(s);
    if (rc) {
        const char *d = st_errdetail();
        fprintf(stderr, "strata-server: %s\n", d && *d ? d : st_strerror(rc));
    }
    st_api_server_free(s);
    return rc ? 1 : 0;
}
