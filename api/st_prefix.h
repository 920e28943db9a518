/*
 * st_prefix.h - the prefix index of strata-server (issue 15 section 2; docs/SCALE.md, "The prefix
 * index"): points of conversations at chunk boundaries, kept in the local store (and, with a
 * tier, in the shared tier), from which a new conversation that shares their tokens resumes
 * instead of reading its prompt from the start, on any node and after any restart. Internal to
 * api/; the conversation manager (st_conv.c) calls it. Plain C over the engine, the store and the
 * tier's node side; nothing here knows HTTP or JSON.
 *
 * A point is the state of a conversation after tokens[0..p) at a position p where every full read
 * of a prompt that begins with those tokens ends a chunk (st_slot.c, invariant 4): a multiple of
 * the engine's ubatch, or the end of a system prompt that gets a root checkpoint. So a
 * conversation resumed there reads the rest in the chunks a full read has, and its answer is
 * token for token the full read's. The key of a point is a chain of SHA-256 over the prompt's
 * page-aligned token blocks, begun from what makes the state (model fingerprint, geometry, the
 * backend and its instruction set, ubatch, page size) and closed with the tail tokens, p and the
 * root split below p: two prompts get one key exactly when a full read of each gives the same
 * state at p. A point is stored as session "pfx:" + the key's hex, version 1, a prefix image
 * (st_slot_snapshot_prefix) whose K/V pages share the store's chunks with every other image of
 * those tokens. Bounded by a budget of logical bytes and a count, least recently used out among
 * the entries not being read (pinned); the order after a restart is that of the entries' last
 * writes.
 *
 * Threads: every function may be called from any worker thread; one recorder thread of its own.
 */
#ifndef ST_PREFIX_H
#define ST_PREFIX_H

#include <stdint.h>

#include "st_engine.h"
#include "st_store.h"

struct st_tiernode;

#define ST_PREFIX_ID_PREFIX "pfx:" /* store ids of the index's points (not an API id) */

typedef struct st_prefix_opts {
    uint64_t budget_bytes;   /* logical bytes of the points kept (their images' payload) */
    uint32_t max_entries;    /* points kept at most */
    uint64_t min_tokens;     /* the shallowest point recorded or looked up */
    uint32_t codec;          /* running state of the points' images (ST_CODEC_FP32) */
    /* NULL, or 0 when an image of that many bytes may be made or read now (the server's memory
     * guard), else its error: the point is not recorded, or not used (a miss) */
    int (*admit)(void *arg, const char *what, uint64_t bytes);
    void *admit_arg;
} st_prefix_opts;
/* 4 GiB, 4096 points, 256 tokens, fp32. */
void st_prefix_opts_default(st_prefix_opts *o);

typedef struct st_prefix_stats {
    uint64_t entries, bytes;          /* gauges */
    uint64_t lookups, hits, hit_tokens, misses;
    uint64_t tier_hits;               /* hits whose point came from the tier */
    uint64_t records, record_bytes, evictions, errors;
    uint64_t queued;                  /* gauge: points snapshotted, waiting for the recorder */
    uint64_t dropped;                 /* points not recorded: the recorder's queue was full */
} st_prefix_stats;

typedef struct st_prefix st_prefix;
/* e: the engine whose state the points hold, g its slots' geometry (with the engine's options
 * they make the key's start); tier NULL: the local store only. Finds the points already in the
 * store. */
int st_prefix_new(const st_prefix_opts *o, st_engine *e, const st_geometry *g, st_store *store,
                  struct st_tiernode *tier, st_prefix **out);
void st_prefix_free(st_prefix *px); /* accepts NULL */

/* Slot s holds nothing: the deepest point among the prompt tokens[0..n) (system_len: the end of
 * its system prompt, 0 none) shares, at most n - 1 (a token is left to read), looked up in the
 * store and then in the tier, is restored into s; *at is its position (0: none found, s still
 * empty). A point that fails to load (damaged, another model) is dropped from the index and the
 * next shallower one tried. Never fails the request: errors are counted and give *at 0. */
void st_prefix_resume(st_prefix *px, st_slot *s, const uint32_t *tokens, uint64_t n,
                      uint64_t system_len, uint64_t *at);
/* After a completion read its prompt of n tokens (system_len as above) from `from` (0, or the
 * point it resumed at: positions below are a full read's) and the slot still holds those tokens:
 * record the deepest point of (from, n] the slot has a state for, and the system prompt's
 * (its root checkpoint, and the deepest ubatch multiple within it), unless the index holds them.
 * The slot is only read here (the points' images made); a background thread puts them into the
 * store and sends them to the tier when there is one (st_prefix.c invariant 5). Never fails the
 * request. */
void st_prefix_record(st_prefix *px, st_slot *s, uint64_t n, uint64_t system_len, uint64_t from);
void st_prefix_stats_get(st_prefix *px, st_prefix_stats *out);

#endif
