/*
 * st_cache_policy.c - which conversation-cache checkpoint to give up, as one pure function.
 *
 * The checkpoints a slot keeps form one prefix chain (its K/V arena holds one branch). The
 * chain's root - the checkpoint at the end of a system prompt, the deepest point the
 * conversations sharing that prompt have in common - is what makes a new conversation cheap, so
 * with room for two or more checkpoints it is pinned and the others rotate least-recently-used
 * (mounting through a checkpoint re-dates it). With room for one, pinning would leave no room
 * for anything else: nothing is pinned and the oldest goes first (plain FIFO).
 */
#include "st_engine.h"

static int older(const st_cache_entry *a, const st_cache_entry *b, int lru)
{
    if (lru && a->last_used != b->last_used)
        return a->last_used < b->last_used;
    if (a->created != b->created)
        return a->created < b->created;
    return a->position < b->position;
}

int64_t st_cache_victim(const st_cache_entry *e, size_t n, size_t k)
{
    if (n <= k || n == 0)
        return -1;
    int lru = k >= 2;
    int64_t pinned = -1, victim = -1;
    if (lru)
        for (size_t i = 0; i < n; i++)
            if (e[i].root && (pinned < 0 || e[i].position > e[pinned].position))
                pinned = (int64_t)i;
    for (size_t i = 0; i < n; i++) {
        if ((int64_t)i == pinned)
            continue;
        if (victim < 0 || older(&e[i], &e[victim], lru))
            victim = (int64_t)i;
    }
    return victim;
}

int64_t st_cache_mount_point(const st_cache_entry *e, size_t n, uint64_t pos)
{
    int64_t best = -1;
    for (size_t i = 0; i < n; i++)
        if (e[i].position <= pos && (best < 0 || e[i].position > e[best].position))
            best = (int64_t)i;
    return best;
}
