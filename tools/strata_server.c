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
            "  --host ADDR                   address (default 127.0.0.1: loopback only)\n"
            "  --port N                      port (default 8080; 0: any free port)\n"
            "  --ready-file FILE             write the bound port there once listening (default none)\n"
            "  --api-key-file FILE           require 'Authorization: Bearer <key in FILE>' (default\n"
            "                                none: no authentication)\n"
            "Conversations (with --model; without it the engine routes answer 501):\n"
            "  --model FILE, -m FILE         GGUF model (default none)\n"
            "  --slots N                     live conversations, 1..1024 (default 4)\n"
            "  --conversation-cache-mib N    RAM for parked conversations (default 1024; 0: park to disk)\n"
            "  --slot-save-path DIR          directory of /slots/{id}?action=save|restore files\n"
            "                                (default none: those actions answer 501)\n"
            "  --backend cpu|cuda            compute backend (default: $STRATA_BACKEND, else cuda\n"
            "                                where a GPU is present and runs the model: strata-hybrid\n"
            "                                with f32 / f16 / bf16 weights; else cpu)\n"
            "  --threads N                   compute threads (default 0: every online CPU)\n"
            "  --ubatch N                    prompt chunk in tokens (default 2048)\n"
            "  --ctx N                       slot context in tokens (default 0: the model's)\n"
            "  --page-size N                 K/V tokens per page (default 256)\n"
            "  --kv-dtype f16|i8             K/V dtype (default: the model's)\n"
            "  --prompt-cache K              checkpoints kept per slot, 0..64 (default 6; 0: off)\n"
            "  --prompt-cache-every N        checkpoint every N prompt tokens (default 0: off)\n"
            "  --prompt-cache-root N         checkpoint after a system prompt >= N tokens (default 0: off)\n"
            "  --expert-cache-mib N          cuda, MoE models (default 0: every expert in VRAM): the\n"
            "                                routed experts in host memory, an arena of N MiB of them\n"
            "                                in VRAM, least recently used out; an arena below one\n"
            "                                token's experts streams them\n"
            "  --session-state-codec fp32|bf16|f16   running-state codec of SAVE (default fp32)\n"
            "  --save-compress LEVEL         zstd level 0..19 of stored chunks (default 0: raw)\n"
            "  --max-n-predict N             cap on n_predict (default 4096)\n"
            "  --busy-wait-ms N              a request for a session another request is using waits\n"
            "                                up to N ms for it, then 409 busy (default 30000; 0: 409 at\n"
            "                                once); waiting requests and those they wait for take at\n"
            "                                most --workers - 1 workers, beyond that 409 at once\n"
            "Store:\n"
            "  --store DIR                   the LMDB store, created when missing (required)\n"
            "  --keep-last N                 versions kept per session (default 0: the store's\n"
            "                                setting, 8 in a new store)\n"
            "  --spool-dir DIR               temporary upload/download files (default STORE/spool)\n"
            "Shared tier (several nodes; docs/SCALE.md):\n"
            "  --tier redis://HOST:PORT[,HOST:PORT...]   the seed nodes of a Redis Cluster (or one\n"
            "                                Redis): each SAVE is also sent there, and a\n"
            "                                conversation another node saved is fetched from it\n"
            "                                (default none)\n"
            "  --node-id ID                  this node's name in the tier (default: the host name)\n"
            "  --tier-ack replica|none       a SAVE waits until a replica has its tier writes\n"
            "                                (default replica)\n"
            "  --tier-pending-max N          conversations queued while the tier is down (default\n"
            "                                1024)\n"
            "  --tier-lease-ms N             the lease a request holds on its conversation, renewed\n"
            "                                every third of it; another node's request for it is\n"
            "                                refused (409) meanwhile (default 10000, at least 300)\n"
            "  --tier-ttl-s N                the tier forgets a conversation not saved for N s: its\n"
            "                                head, manifests and the pieces no newer one names\n"
            "                                (default 604800: 7 days; 0: never)\n"
            "Prefix index (docs/SCALE.md, \"The prefix index\"):\n"
            "  --prefix-index-mib N          keep up to N MiB of prompt points in the store (and\n"
            "                                the tier): a new conversation sharing a prompt's\n"
            "                                first tokens resumes there, after restarts and on\n"
            "                                other nodes (default 0: off); recurrent models then\n"
            "                                checkpoint every --ubatch tokens unless\n"
            "                                --prompt-cache-every is given\n"
            "  --prefix-max-entries N        points kept at most (default 4096)\n"
            "  --prefix-min-tokens N         the shallowest point recorded (default 256)\n"
            "Limits (every limit is at least 1; none is unlimited):\n"
            "  --workers N                   worker threads, 1..256 (default 8)\n"
            "  --max-connections N           open connections (default 256); at the cap a new one\n"
            "                                closes the oldest idle connection of the address\n"
            "                                holding the most idle ones\n"
            "  --max-connections-per-peer N  open connections per client address, IPv6 per /64\n"
            "                                (default 64); beyond, that address's oldest idle one\n"
            "                                is closed, or the new one refused -> 503\n"
            "  --max-header-bytes N          request line + headers, >= 256 (default 16384) -> 431\n"
            "  --max-headers N               header lines (default 64) -> 431\n"
            "  --max-json-kib N              JSON bodies of save/restore/park/commit/slots (default 64) -> 413\n"
            "  --max-completion-kib N        completion, apply-template bodies (default 4096) -> 413\n"
            "  --max-part-mib N              one upload part (default 16) -> 413\n"
            "  --max-upload-mib N            one whole upload (default 65536) -> 413\n"
            "  --body-budget-mib N           request body bytes held at once (default 256) -> 503;\n"
            "                                charged as they arrive; upload parts hold at most\n"
            "                                this minus --max-completion-kib\n"
            "  --head-timeout-ms N           a new connection's complete request head, and a later\n"
            "                                head from its first byte (default 10000) -> 408\n"
            "  --read-timeout-ms N           longest pause inside a body (default 30000) -> 408\n"
            "  --body-timeout-ms N           a whole body (default 600000) -> 408\n"
            "  --min-body-rate N             bytes/s a body must bring in every window (default 1024)\n"
            "                                -> 408\n"
            "  --body-rate-window-ms N       the window of --min-body-rate; the first one is the\n"
            "                                grace period (default 10000)\n"
            "  --write-timeout-ms N          longest pause while a reply is sent (default 60000)\n"
            "  --idle-timeout-ms N           idle keep-alive connection (default 60000)\n"
            "  --shutdown-timeout-ms N       in-flight work at SIGTERM/SIGINT (default 30000)\n"
            "  --upload-ttl-s N              drop uploads untouched this long (default 3600)\n"
            "  --store-stat-ms N             re-read the store's figures of /metrics (sizes, free\n"
            "                                map) this often (default 10000, at least 100)\n"
            "Memory guard:\n"
            "  --mem-guard on|off            admit park/SAVE/RESTORE by available RAM (default on)\n"
            "  --mem-reserve-mib N           RAM kept free besides an operation (default 256)\n"
            "  --meminfo FILE                read MemAvailable from FILE (default /proc/meminfo; tests)\n"
            "Other:\n"
            "  --log-requests                one line per request on stderr (default off)\n"
            "  --help, -h                    this text\n"
            "  --version                     the version\n"
            "Exit status: 0 after a graceful stop; 1 the server could not start or failed; 2 usage;\n"
            "3 a graceful stop could not write some live conversations (named on stderr).\n");
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
        if (!strcmp(a, "--version")) {
            printf("strata-server %s\n", st_version());
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
        if (!strcmp(a, "--backend")) {
            if (strcmp(v, "cpu") && strcmp(v, "cuda")) {
                fprintf(stderr, "strata-server: --backend needs cpu|cuda, got \"%s\"\n", v);
                return 2;
            }
            c.backend = v;
            continue;
        }
        if (!strcmp(a, "--meminfo")) { c.meminfo_path = v; continue; }
        if (!strcmp(a, "--tier")) { c.tier_url = v; continue; }
        if (!strcmp(a, "--node-id")) { c.node_id = v; continue; }
        if (!strcmp(a, "--tier-ack")) {
            if (strcmp(v, "replica") && strcmp(v, "none")) {
                fprintf(stderr, "strata-server: --tier-ack needs replica|none, got \"%s\"\n", v);
                return 2;
            }
            c.tier_replicas = !strcmp(v, "replica");
            continue;
        }
        if (!strcmp(a, "--mem-guard")) {
            if (strcmp(v, "on") && strcmp(v, "off")) {
                fprintf(stderr, "strata-server: --mem-guard needs on|off, got \"%s\"\n", v);
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
                fprintf(stderr, "strata-server: --kv-dtype needs f16|i8, got \"%s\"\n", v);
                return 2;
            }
            continue;
        }
        if (!strcmp(a, "--session-state-codec")) {
            st_codec_id id;
            if (st_codec_parse(v, &id)) {
                fprintf(stderr, "strata-server: --session-state-codec needs fp32|bf16|f16, got \"%s\"\n", v);
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
        NUM("--expert-cache-mib", 1ull << 24, c.expert_cache_bytes, MIB)
        NUM("--save-compress", 19, c.save_compress, 1)
        NUM("--max-n-predict", 1u << 24, c.max_n_predict, 1)
        NUM("--busy-wait-ms", U32, c.busy_wait_ms, 1)
        NUM("--keep-last", 1u << 20, c.keep_last, 1)
        NUM("--tier-pending-max", 1u << 20, c.tier_pending_max, 1)
        NUM("--tier-lease-ms", 3600000, c.tier_lease_ms, 1)
        NUM("--tier-ttl-s", 0x7fffffff, c.tier_ttl_s, 1)
        NUM("--prefix-index-mib", 1ull << 30, c.prefix_budget_bytes, MIB)
        NUM("--prefix-max-entries", 1u << 24, c.prefix_max_entries, 1)
        NUM("--prefix-min-tokens", 1u << 24, c.prefix_min_tokens, 1)
        NUM("--max-connections", 1u << 20, c.max_connections, 1)
        NUM("--max-connections-per-peer", 1u << 20, c.max_connections_per_peer, 1)
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
        NUM("--min-body-rate", U32, c.min_body_rate, 1)
        NUM("--body-rate-window-ms", U32, c.body_rate_window_ms, 1)
        NUM("--write-timeout-ms", U32, c.write_timeout_ms, 1)
        NUM("--idle-timeout-ms", U32, c.idle_timeout_ms, 1)
        NUM("--shutdown-timeout-ms", U32, c.shutdown_timeout_ms, 1)
        NUM("--upload-ttl-s", U32, c.upload_ttl_s, 1)
        NUM("--store-stat-ms", U32, c.store_stat_ms, 1)
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
    int rc = st_api_config_check(&c);
    if (rc) {
        fprintf(stderr, "strata-server: %s\n", st_errdetail());
        return 2;
    }
    st_api_server *s = NULL;
    rc = st_api_server_new(&c, &s);
    if (rc) {
        const char *d = st_errdetail();
        fprintf(stderr, "strata-server: %s\n", d && *d ? d : st_strerror(rc));
        return 1;
    }
    rc = st_api_server_run(s);
    int lost = st_api_server_lost(s) > 0;
    if (rc) {
        const char *d = st_errdetail();
        fprintf(stderr, "strata-server: %s\n", d && *d ? d : st_strerror(rc));
    }
    st_api_server_free(s);
    return lost ? 3 : rc ? 1 : 0;
}
