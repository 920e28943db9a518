/*
 * st_api.h - strata-server: the REST API over the state store and the attached engine.
 *
 * One event loop (libevent) owns every connection: it parses requests under explicit limits,
 * authenticates them, routes them and writes replies. Everything that touches the disk, hashes,
 * runs a codec or computes runs on a pool of worker threads; a worker hands its result back to
 * the loop, which sends the reply. /healthz and /metrics are answered from the loop itself.
 * docs/API.md describes every route, body, status and error code.
 *
 * Threads: st_api_server_run() runs the loop on the calling thread until the server stops.
 * st_api_server_stop() may be called from any thread and from a signal handler context that
 * is not async (it is not async-signal-safe; strata-server installs its own signal events on the
 * loop instead, see st_api_config.handle_signals).
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_API_H
#define ST_API_H

#include <stddef.h>
#include <stdint.h>

#include "st_codec.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Session ids accepted by the API: ^[A-Za-z0-9][A-Za-z0-9._-]{0,ST_API_ID_MAX-1}$. Never a path:
 * no '/', no NUL, no "." or ".." (they cannot start with '.'). ST_API_ID_MAX leaves room for the
 * server's internal prefix of disk-parked conversations inside the store's 128-byte ids. */
#define ST_API_ID_MAX 120

/* 1 if id (len bytes, not necessarily NUL-terminated) is a valid session id, else 0. */
int st_api_id_valid(const char *id, size_t len);

/* What a server is started with. st_api_config_default() fills every field; zero in a limit
 * never means "unlimited". Strings are borrowed until st_api_server_free(). */
typedef struct st_api_config {
    const char *host;            /* address to listen on (default "127.0.0.1") */
    uint16_t port;               /* 0: any free port (see ready_file) */
    const char *store_dir;       /* required: the LMDB store directory (created when missing) */
    const char *model_path;      /* GGUF model; NULL: no engine (store routes only) */
    const char *api_key_file;    /* NULL: no authentication */
    const char *slot_save_path;  /* directory for /slots/{id}?action=save|restore; NULL: off */
    const char *spool_dir;       /* temporary files of uploads and downloads; NULL: STORE/spool */
    const char *ready_file;      /* written with the bound port once listening (tests) */
    const char *meminfo_path;    /* NULL: /proc/meminfo with the sysconf fallback; a file: read
                                    it instead, no fallback (tests) */

    uint32_t workers;            /* worker threads (default 8) */
    uint32_t slots;              /* live conversations (default 4) */
    uint64_t conversation_cache_bytes; /* RAM for parked images (default 1 GiB) */

    /* engine options (see st_engine_opts); 0 keeps the engine's default */
    uint32_t threads, ubatch, n_ctx, page_size;
    uint32_t kv_dtype;           /* UINT32_MAX: the model's */
    const char *backend;         /* "cpu" or "cuda"; NULL: $STRATA_BACKEND, else cuda where a GPU
                                  * is present and the model is strata-hybrid, else cpu (as
                                  * `strata generate`) */
    uint32_t prompt_cache, prompt_cache_every, prompt_cache_root;
    int prompt_cache_set;        /* 1: prompt_cache was given (0 is meaningful) */
    uint64_t expert_cache_bytes; /* CUDA, MoE models: 0 every expert in VRAM; else a VRAM arena
                                  * of this many bytes, the experts in host memory
                                  * (st_engine_opts.expert_cache_bytes) */
    uint32_t state_codec;        /* default running-state codec of SAVE (ST_CODEC_FP32) */
    int save_compress;           /* default zstd level of SAVE chunks (0: raw) */
    uint32_t keep_last;          /* store retention; 0 keeps the store's setting */
    uint32_t max_n_predict;      /* cap on n_predict (default 4096) */
    uint32_t busy_wait_ms;       /* a request for a session another request is using waits this
                                    long for it, then gets 409 busy (default 30000; 0: at once).
                                    Waiting requests plus those they wait for take at most
                                    workers - 1 workers (beyond: 409 at once). */

    /* HTTP limits */
    uint32_t max_connections;    /* default 256; at the cap a new connection sheds an idle one */
    uint32_t max_connections_per_peer; /* per client address (IPv6: per /64), default 64; more
                                    than max_connections counts as max_connections */
    uint32_t max_header_bytes;   /* request line + headers (default 16 KiB) */
    uint32_t max_headers;        /* header lines (default 64) */
    uint64_t max_json_body;      /* small JSON bodies: save, restore, park, commit (64 KiB) */
    uint64_t max_completion_body;/* POST /v1/completions (default 4 MiB) */
    uint64_t max_part_bytes;     /* one upload part (default 16 MiB) */
    uint64_t max_upload_bytes;   /* one whole upload (default 64 GiB) */
    uint64_t body_budget;        /* request body bytes held at once, all connections (256 MiB);
                                    upload parts together hold at most body_budget minus
                                    max_completion_body, so a completion body always fits */
    uint32_t head_timeout_ms;    /* a request head must arrive within this of a new connection's
                                    accept, or of its first byte later (default 10 s) */
    uint32_t read_timeout_ms;    /* longest pause inside a request body (default 30 s) */
    uint32_t body_timeout_ms;    /* a whole body must arrive within this (default 600 s) */
    uint32_t min_body_rate;      /* bytes/s a body must bring in every window (default 1024) */
    uint32_t body_rate_window_ms;/* the window of min_body_rate; the first is the grace period
                                    (default 10 s) */
    uint32_t write_timeout_ms;   /* longest pause while a reply is being sent (default 60 s) */
    uint32_t idle_timeout_ms;    /* keep-alive connection without a request (default 60 s) */
    uint32_t shutdown_timeout_ms;/* in-flight work given this long at SIGTERM (default 30 s) */
    uint32_t upload_ttl_s;       /* an upload untouched this long is dropped (default 3600) */
    uint32_t store_stat_ms;      /* the store's figures of /metrics (st_store_stat) and the upload
                                    expiry are re-read this often (default 10000, at least 100) */

    /* memory guard */
    int mem_guard;               /* 1 (default): admit parking, SAVE, RESTORE by available RAM */
    uint64_t mem_reserve_bytes;  /* kept free besides the operation (default 256 MiB) */

    /* the shared tier (issue 15; docs/SCALE.md) */
    const char *tier_url;        /* redis://HOST:PORT[,HOST:PORT...]; NULL: no tier */
    const char *node_id;         /* this node's name in the tier; NULL: the host name */
    uint32_t tier_replicas;      /* --tier-ack replica: 1 (default), none: 0 */
    uint32_t tier_pending_max;   /* conversations queued while the tier is down (default 1024) */
    uint32_t tier_lease_ms;      /* a conversation's lease while a request works on it (10000) */
    uint32_t tier_ttl_s;         /* the tier forgets a conversation not saved for this long
                                    (default 604800: 7 days; 0: never) */

    /* the prefix index (issue 15 section 2; docs/SCALE.md, "The prefix index") */
    uint64_t prefix_budget_bytes; /* logical bytes of the points kept; 0 (default): no index */
    uint32_t prefix_max_entries; /* points kept at most (default 4096) */
    uint32_t prefix_min_tokens;  /* the shallowest point recorded or looked up (default 256) */

    int handle_signals;          /* 1: SIGTERM / SIGINT stop the server gracefully (default 1) */
    int log_requests;            /* 1: one line per request on stderr */
} st_api_config;

void st_api_config_default(st_api_config *c);
/* 0 if c is usable: a store directory, workers and slots in range, every limit and timeout at
 * least 1 (headers: 256 bytes, JSON bodies: 16 bytes), the body budget holding one part plus one
 * completion body; else ST_EINVAL with a detail naming the flag. st_api_server_new() checks it too. */
int st_api_config_check(const st_api_config *c);

typedef struct st_api_server st_api_server;

/* Open the store, load the model (when given), bind the listening socket. The port actually
 * bound is st_api_server_port(). On failure *out is NULL and the detail says what failed. */
int st_api_server_new(const st_api_config *c, st_api_server **out);
/* Serve until stopped (signal or st_api_server_stop). Returns 0 after a graceful stop that wrote
 * every live conversation to the store. When the stop could not write some (a full disk: those
 * the store refuses whole are kept without their resume checkpoints, compressed, where that
 * fits), each is named on stderr and the error of the first is returned with a detail naming
 * them all; st_api_server_lost() counts them. Another error: the event loop failed. */
int st_api_server_run(st_api_server *s);
/* Live conversations the graceful stop of st_api_server_run could not write (0: none). */
unsigned st_api_server_lost(const st_api_server *s);
/* Ask the loop to stop: no new connections, in-flight work finishes (bounded by
 * shutdown_timeout_ms), then st_api_server_run returns. Thread-safe. */
void st_api_server_stop(st_api_server *s);
uint16_t st_api_server_port(const st_api_server *s);
void st_api_server_free(st_api_server *s); /* accepts NULL */

/* 1 if this build has the engine routes (completions, park, slots). */
int st_api_have_engine(void);

#ifdef __cplusplus
}
#endif
#endif /* ST_API_H */
