/*
 * st_xcache.c - the routed-expert cache's host half (issue 14, section 3; docs/ENGINE.md, "The
 * routed-expert cache"): which physical slot of a bounded arena holds which logical expert
 * record (the gate, up and down rows of one layer's expert), least recently used first out.
 * The device half (the arena, the pinned staging, the copy stream, the fences) is not built
 * yet; this file has no CUDA in it, so CI tests it on any machine (test_engine_xcache).
 *
 * Invariants:
 * 1. The arena holds n_slots = arena_bytes / record_bytes whole records; one smaller than one
 *    call's working set (k experts of a layer, for one token) is refused at init (ST_EINVAL),
 *    and the caller keeps the streaming path.
 * 2. A key (layer, expert) is in at most one slot, and a slot holds at most one key: slot[]
 *    and key[] are each other's inverse at every return.
 * 3. A call maps the distinct experts of one layer's selection: the hits first (each marked
 *    used by this call), then each miss takes the slot least recently used by an earlier call
 *    (never-used slots first, ties to the lower slot), evicting its key. So no slot is taken
 *    twice within a call, and a call of more experts than slots is refused (ST_ETOOBIG) with
 *    nothing changed: the caller streams that call.
 * 4. st_xcache_drop empties a slot whose upload failed, so that no key points at bytes that
 *    never arrived.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

#define XC_EMPTY UINT32_MAX

int st_xcache_init(st_xcache *c, uint32_t n_layers, uint32_t n_experts, uint64_t record_bytes,
                   uint64_t arena_bytes, uint32_t k)
{
    memset(c, 0, sizeof *c);
    if (!n_layers || !n_experts || !record_bytes || !k || k > n_experts)
        return st_error_set(ST_EINVAL, "expert cache: %u layers of %u experts, records of %llu "
                            "bytes, top %u", n_layers, n_experts,
                            (unsigned long long)record_bytes, k);
    uint64_t slots = arena_bytes / record_bytes, keys = (uint64_t)n_layers * n_experts;
    if (slots < k)
        return st_error_set(ST_EINVAL, "expert cache: %llu MiB hold %llu records of %.1f MiB, "
                            "fewer than one token's %u experts: the experts are streamed",
                            (unsigned long long)(arena_bytes >> 20), (unsigned long long)slots,
                            (double)record_bytes / 1048576.0, k);
    if (slots > keys)
        slots = keys; /* room for every expert of every layer */
    if (keys > INT32_MAX)
        return st_error_set(ST_EINVAL, "expert cache: %llu experts", (unsigned long long)keys);
    c->slot = malloc(keys * sizeof *c->slot);
    c->key = malloc(slots * sizeof *c->key);
    c->used = calloc(slots, sizeof *c->used);
    if (!c->slot || !c->key || !c->used) {
        st_xcache_release(c);
        return st_error_set(ENOMEM, "expert cache: the map of %llu experts",
                            (unsigned long long)keys);
    }
    for (uint64_t i = 0; i < keys; i++)
        c->slot[i] = -1;
    for (uint64_t i = 0; i < slots; i++)
        c->key[i] = XC_EMPTY;
    c->n_layers = n_layers;
    c->n_experts = n_experts;
    c->n_slots = (uint32_t)slots;
    c->record_bytes = record_bytes;
    return 0;
}

void st_xcache_release(st_xcache *c)
{
    free(c->slot);
    free(c->key);
    free(c->used);
    memset(c, 0, sizeof *c);
}

int st_xcache_map(st_xcache *c, uint32_t layer, const uint32_t *experts, uint32_t n,
                  uint32_t *slots, uint8_t *load)
{
    if (layer >= c->n_layers)
        return st_error_set(ST_EINVAL, "expert cache: layer %u of %u", layer, c->n_layers);
    for (uint32_t i = 0; i < n; i++) {
        if (experts[i] >= c->n_experts)
            return st_error_set(ST_EINVAL, "expert cache: expert %u of %u", experts[i],
                                c->n_experts);
        for (uint32_t j = 0; j < i; j++)
            if (experts[j] == experts[i])
                return st_error_set(ST_EINVAL, "expert cache: expert %u twice in one call",
                                    experts[i]);
    }
    if (n > c->n_slots)
        return st_error_set(ST_ETOOBIG, "expert cache: %u experts in one call, %u slots: this "
                            "call is streamed", n, c->n_slots);
    uint64_t now = ++c->call;
    int32_t *row = c->slot + (size_t)layer * c->n_experts;
    for (uint32_t i = 0; i < n; i++) {
        int32_t s = row[experts[i]];
        load[i] = s < 0;
        if (s >= 0) {
            slots[i] = (uint32_t)s;
            c->used[s] = now;
            c->hits++;
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        if (!load[i])
            continue;
        uint32_t v = 0;
        for (uint32_t s = 1; s < c->n_slots; s++)
            if (c->used[s] < c->used[v])
                v = s;
        /* invariant 3: at most n - 1 slots are this call's, and n <= n_slots */
        if (c->key[v] != XC_EMPTY) {
            c->slot[c->key[v]] = -1;
            c->evictions++;
        }
        c->key[v] = layer * c->n_experts + experts[i];
        row[experts[i]] = (int32_t)v;
        c->used[v] = now;
        slots[i] = v;
        c->misses++;
        c->bytes_uploaded += c->record_bytes;
    }
    return 0;
}

void st_xcache_drop(st_xcache *c, uint32_t slot)
{
    if (slot >= c->n_slots || c->key[slot] == XC_EMPTY)
        return;
    c->slot[c->key[slot]] = -1;
    c->key[slot] = XC_EMPTY;
    c->used[slot] = 0;
}
