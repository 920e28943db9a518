/*
 * st_conv.h - the conversation manager of strata-server: the engine's slots, the park pool (in
 * RAM and spilled to the store) and its memory guard, and where each conversation lives. A plain
 * C API over the engine and the store: nothing here knows HTTP, JSON or the server (the route
 * handlers, api/st_route_*.c and st_openai.c, turn requests into these calls and results into
 * replies). Internal to api/; tests may include it.
 *
 * Dependencies point down: handlers -> this module -> engine, store. The module calls nothing of
 * the server; what it needs of it (the quarantine of damaged sessions) comes as a callback.
 *
 * Threads: every function may be called from any worker thread (st_conv.c, invariants 1-8);
 * st_conv_new, st_conv_free and st_conv_persist_all run alone.
 *
 * Errors: see st_codec.h. Every function that fails records a detail (st_errdetail()).
 */
#ifndef ST_CONV_H
#define ST_CONV_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "st_api.h"
#include "st_engine.h"
#include "st_store.h"

/* ---- memory guard (st_memguard.c) ---------------------------------------------------------- */
typedef struct st_memguard {
    int enabled;
    uint64_t reserve;
    const char *meminfo_path; /* NULL: /proc/meminfo, then sysconf(_SC_AVPHYS_PAGES) */
    _Atomic uint64_t *refusals;
} st_memguard;
/* Available RAM in *avail and where it was read in *source ("MemAvailable", "sysconf").
 * errno-style error when it cannot be read, with a detail naming what was tried. */
int st_memguard_available(const st_memguard *g, uint64_t *avail, const char **source);
/* 0 if need bytes (plus the reserve) fit in the available RAM; ST_ENOMEMGUARD with a detail
 * "memory guard: SAVE needs 1.2 GiB + 0.25 GiB reserve: limit 1.4 GiB, available 0.9 GiB
 * (MemAvailable)", or when RAM cannot be read, a detail saying so. what names the operation. */
int st_memguard_admit(const st_memguard *g, const char *what, uint64_t need);

/* ---- the manager's counters and gauges (any thread; the server's /metrics renders them) ------ */
typedef struct st_conv_counters {
    _Atomic uint64_t saves, save_logical_bytes, save_new_bytes, save_stored_bytes;
    _Atomic uint64_t restores, restore_bytes;
    _Atomic uint64_t parks_ram, parks_disk, park_spills, park_unspills, park_bytes;
    _Atomic uint64_t park_dropped_stale; /* parked copies dropped: another node held it since */
    _Atomic uint64_t stale_refused; /* SAVEs, PARKs refused: another node held or saved it since */
    _Atomic uint64_t conv_hits_slot, conv_hits_ram, conv_hits_disk, conv_hits_store, conv_new;
    _Atomic uint64_t prompt_reused, prompt_computed, tokens_generated;
    _Atomic uint64_t memguard_refusals;
    _Atomic uint64_t busy_wait_timeouts, busy_wait_full; /* 409 busy after waiting; queue full */
    _Atomic uint64_t completions_cancelled; /* stopped because the client went away */
    _Atomic uint64_t pool_ram_bytes, pool_ram_entries, pool_disk_entries, pool_limit_bytes;
    _Atomic uint64_t slots_total, slots_bound, slots_busy;
    _Atomic uint64_t busy_waiting; /* requests waiting for a busy session */
} st_conv_counters;

/* Prefix of the store ids of disk-parked conversations (not a valid API id character). */
#define ST_API_PARK_PREFIX "park:"

/* ---- life cycle ------------------------------------------------------------------------------ */
typedef struct st_conv st_conv;
typedef struct st_conv_env {
    const st_api_config *cfg;  /* model, engine options, slots, workers, busy_wait_ms, cache */
    st_store *store;
    st_conv_counters *m;
    const st_memguard *guard;
    /* 0, or ST_EDAMAGED with a detail when session id is quarantined (its keys may lie in a
     * damaged page: nothing may read or write them). Any thread. */
    int (*damaged)(void *arg, const char *id);
    void *damaged_arg;
    /* NULL, or the shared tier (st_tiernode.h): SAVEs are sent to it, and a conversation this
     * node holds nowhere is looked for in it */
    struct st_tiernode *tier;
} st_conv_env;
/* Loads the model and the engine, makes the slots, and finds the disk-parked conversations in
 * the store (invariant 4). env and what it points to must outlive the manager. */
int st_conv_new(const st_conv_env *env, st_conv **out);
void st_conv_free(st_conv *cv);
/* At shutdown: write every live conversation (slots, RAM-parked) to the store as disk-parked;
 * one the store refuses as it is is kept smaller where it can be (live checkpoint only,
 * compressed). Each that could not be written is named on stderr and counted in *lost; 0 when
 * none, else the first one's error with a detail naming them all. */
int st_conv_persist_all(st_conv *cv, unsigned *lost);

/* 1 if id (len bytes) is a session id the API accepts (the rule st_api.h states). */
int st_conv_id_valid(const char *id, size_t len);
/* CLOCK_MONOTONIC in milliseconds. */
double st_conv_now_ms(void);
/* Random hex digits into dst (up to 24, as many as fit in cap with the NUL), from /dev/urandom;
 * zeros if it cannot be read. The ids of the native and the OpenAI routes. */
void st_conv_random_hex(char *dst, size_t cap);

/* ---- the model ------------------------------------------------------------------------------- */
/* text in the model's tokens (bos: BOS first where the vocabulary adds one, always for the byte
 * tokenizer; parse_special: special tokens' texts become those tokens); *out malloc'd. */
int st_conv_tokenize(st_conv *cv, const char *text, size_t len, int bos, int parse_special,
                     uint32_t **out, uint64_t *n);
const st_vocab *st_conv_vocab(st_conv *cv); /* NULL: the byte tokenizer (strata-hybrid) */
const st_chat_template *st_conv_chat(st_conv *cv);
uint32_t st_conv_n_ctx(st_conv *cv);
uint32_t st_conv_n_vocab(st_conv *cv);
const char *st_conv_model_name(st_conv *cv); /* general.name, else the file's name */
/* The prefix index's figures (st_prefix.h) into *out: 1, or 0 when the index is off. */
struct st_prefix_stats;
int st_conv_prefix_stats(st_conv *cv, struct st_prefix_stats *out);
/* The engine's weight-conversion cache figures (st_engine_wcache_get: never waits for the
 * engine's computation, so the loop may call it). */
void st_conv_wcache(st_conv *cv, st_engine_wcache *out);
/* The routed-expert cache's figures (st_engine_xcache_get; likewise never waits). */
void st_conv_xcache(st_conv *cv, st_engine_xcache *out);

/* ---- generation: the one path of every completion, native or OpenAI --------------------------
 * st_conv_generate takes the session's conversation (slot, park pool or store; a new id when
 * g->session is NULL), makes it hold the prompt (the longest prefix it holds reused:
 * st_slot_eval), then generates up to n_predict tokens, handing each to g->token. The prompt is
 * either g->whole, the whole conversation (the OpenAI routes: a stateless client resends its
 * history), or what g->build makes from the tokens held (the native route appends). g->whole is
 * read with the held tokens in place of its own where both spell the same bytes from where they
 * first differ (a previous answer re-tokenized otherwise than generated: spliced counts them).
 * Without a session a new id is made ("c-" + 16 hex digits; with anon_reuse "oa-" + 16), and with
 * anon_reuse the conversation held that shares the longest prefix with whole, at least half of
 * what it holds, is used: an "oa-" one in an idle slot or the park pool is continued, or a store
 * head of the store index is copied into the new one (found "store").
 * Returns 0 with the outputs set; ST_CONV_EHOOK when build or token failed (the hook recorded
 * its own error); ECANCELED when *g->cancel was set (the client went away: counted in
 * completions_cancelled; the conversation keeps what was read and generated, invariant 7); any
 * other error with a detail, g->what naming the step ("completion", "generating", ...), and
 * g->code set ("invalid_field", "context_full") when the request itself is refused. */
#define ST_CONV_ANON_PREFIX "oa-" /* ids made for OpenAI requests without a session */
#define ST_CONV_EHOOK (-1)
typedef struct st_conv_gen {
    const char *session;
    const uint32_t *whole;
    uint64_t n_whole;
    uint64_t system_end; /* with whole: where its system prompt ends (0: none) */
    int anon_reuse;
    /* the tokens to read (*toks malloc'd) from those held: 0, or -1 (its error recorded) */
    int (*build)(void *arg, const uint32_t *held, uint64_t n_held, uint32_t **toks, uint64_t *n,
                 uint64_t *system_end);
    /* each generated token, eog: it ends generation; 0 go on, 1 stop here (finish "stop"), -1
     * error (its error recorded) */
    int (*token)(void *arg, uint32_t tok, int eog);
    void *arg;
    uint64_t n_predict, seed;
    st_sample_params sp;
    int ignore_eos;
    const _Atomic int *cancel; /* set by another thread when the client went away; NULL: never */
    /* out */
    char id[ST_API_ID_MAX + 1];
    const char *found;  /* "slot", "ram", "disk", "store", "tier", "index" (the prefix index:
                         * resumed at `resumed`), "new" */
    const char *stop;   /* "length", "eos", "stop" */
    uint64_t n_held, n_prompt, n_tokens, n_gen, resumed, computed;
    uint64_t spliced;   /* held tokens read in place of the prompt's own (g->whole: see above) */
    double prompt_ms, decode_ms;
    double search_ms;   /* the prefix search of a request without a session */
    double record_ms;   /* copying the prefix index's points out of the slot (0: none) */
    const char *what;   /* on an error: the step that failed */
    const char *code;   /* on a refusal of the request itself: its code, else NULL */
} st_conv_gen;
int st_conv_generate(st_conv *cv, st_conv_gen *g);

/* ---- SAVE, RESTORE, PARK of a session ----------------------------------------------------------
 * Each waits while the session is in use by another request, up to --busy-wait-ms and with at
 * most workers - 1 waiting (st_conv.c, invariant 6), then fails ST_EBUSY. */
typedef struct st_conv_save_opts {
    uint32_t codec;     /* of the stored image */
    int compress;       /* zstd level of its chunks (0: none) */
    const char *label;  /* NULL: none */
    uint64_t expected;  /* ST_STORE_HEAD_ANY, ST_STORE_HEAD_NONE or the head version expected */
} st_conv_save_opts;
typedef struct st_conv_save_info {
    uint64_t version, tokens;
    const char *from;   /* "slot", "ram", "disk" */
    const char *tier;   /* NULL without a tier; else st_tier_outcome_name of what it did */
    uint64_t tier_version; /* the tier's version when sent */
    st_put_stats ps;
    double snapshot_ms, store_ms, ms;
} st_conv_save_info;
/* The live conversation of id (a slot or the park pool) stored as a new version of session id. */
int st_conv_save(st_conv *cv, const char *id, const st_conv_save_opts *o, st_conv_save_info *out);

typedef struct st_conv_restore_info {
    uint64_t version, tokens, logical_bytes;
    double ms;
} st_conv_restore_info;
/* Version version (0: the head) of session id becomes its live conversation, in a slot; what was
 * parked of it is dropped. On failure the live conversation is as it was. */
int st_conv_restore(st_conv *cv, const char *id, uint64_t version, st_conv_restore_info *out);

typedef struct st_conv_park_info {
    const char *where;  /* "ram" or "disk" */
    uint64_t bytes, tokens;
    int already;        /* it was parked before this call */
    double ms;
} st_conv_park_info;
/* The conversation of id leaves its slot for the park pool (or says where it is parked). */
int st_conv_park(st_conv *cv, const char *id, st_conv_park_info *out);

/* ---- llama.cpp's /slots ------------------------------------------------------------------------ */
typedef struct st_conv_slot_info {
    char id[ST_API_ID_MAX + 1]; /* "" when not bound to a session */
    uint64_t tokens;
    int busy;
} st_conv_slot_info;
uint32_t st_conv_n_slots(st_conv *cv);
/* A snapshot of every slot into arr[0..st_conv_n_slots). */
void st_conv_slots_get(st_conv *cv, st_conv_slot_info *arr);
enum { ST_CONV_SLOT_ERASE, ST_CONV_SLOT_SAVE, ST_CONV_SLOT_RESTORE };
typedef struct st_conv_slot_result {
    uint64_t tokens;       /* erased, saved or restored */
    uint64_t file_bytes;   /* written or read */
    char session[ST_API_ID_MAX + 1]; /* restore: the session the slot holds now */
    double ms;
    /* on ST_EBUSY or ST_EINVAL: "busy" (the slot is in use) or "slot_empty" (nothing to save) */
    const char *refused;
} st_conv_slot_result;
/* Erase slot j, save it to the session file path (codec, zstd level compress), or restore it
 * from that file (a slot without a session gets a new "c-" id). j < st_conv_n_slots. */
int st_conv_slot_action(st_conv *cv, uint32_t j, int action, const char *path, uint32_t codec,
                        int compress, st_conv_slot_result *r);

/* ---- where conversations live --------------------------------------------------------------- */
/* Where a session lives now: "slot", "ram", "disk" or NULL; when live, *tokens and *bytes (those
 * of its fp32 park image: in the pool, spilled, or the one PARK would make of its slot). */
const char *st_conv_where(st_conv *cv, const char *id, uint64_t *tokens, uint64_t *bytes);
/* Every live conversation, slots first then the pool, handed to fn (under the manager's lock:
 * fn must not call the manager). */
void st_conv_list_live(st_conv *cv,
                       void (*fn)(void *arg, const char *id, const char *where, uint64_t tokens,
                                  uint64_t bytes),
                       void *arg);
/* DELETE of a session's live state (slot, pool, spilled image), in two steps so that no request
 * finds the conversation while its stored versions are being deleted. begin waits while the
 * session is in use, like the calls above (ST_EBUSY after --busy-wait-ms), then holds it busy in
 * *h: its slot or park entry, or, when it is not live (st_conv_hold_live(h) is 0), the id itself,
 * so that requests for it wait instead of loading a version being deleted. *h and id must stay
 * valid until end. end drops what begin held and lets requests waiting for the id start afresh;
 * abort releases the hold and keeps the conversation. One of them follows every successful
 * begin. */
typedef struct st_conv_hold {
    int slot;    /* slot index, or -1 */
    void *entry; /* park entry, or NULL */
    const char *id;            /* not live: the id is held by name (requests for it wait) */
    struct st_conv_hold *next; /* in the st_conv's list of ids held by name */
} st_conv_hold;
#define st_conv_hold_live(h) ((h)->slot >= 0 || (h)->entry != NULL)
int st_conv_forget_begin(st_conv *cv, const char *id, st_conv_hold *h);
void st_conv_forget_end(st_conv *cv, st_conv_hold *h);
/* Release a hold without dropping anything (the store's delete failed: the conversation stays). */
void st_conv_forget_abort(st_conv *cv, st_conv_hold *h);

#endif /* ST_CONV_H */
