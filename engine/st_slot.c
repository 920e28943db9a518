/*
 * st_slot.c - slots: a conversation live in the engine, its conversation cache of running-state
 * checkpoints, sampling, the state hash, and snapshot / restore to and from an st_image.
 *
 * Invariants:
 * 1. The backend state holds tokens[0..n_tokens): its position is n_tokens and its K/V rows
 *    [0, n_tokens) are those of these tokens. has_logits says logits are the last token's.
 * 2. The checkpoints ck[0..n_ck) have strictly increasing positions <= n_tokens and hold the
 *    running state after tokens[0..position): they lie on the branch the K/V arena holds. When
 *    the slot moves to another branch, every checkpoint past the point where it left is dropped.
 * 3. At most prompt_cache checkpoints are held; st_cache_victim chooses which one goes.
 * 4. A prompt is read in chunks whose ends are the multiples of ubatch, the end of a system
 *    prompt that gets a root checkpoint, and the prompt's end. A read that resumes at a
 *    checkpoint starts at one of these points, so it is cut exactly as a full read would be.
 * 5. Restore builds a complete backend state and checkpoint chain apart from the slot's, verifies
 *    them (positions, state hash), and only then swaps them in. It writes them into the engine's
 *    spares (the state and checkpoints the last restore replaced) when it has them: every byte a
 *    restored slot reads is written by the restore, so reused memory leaves nothing behind. After
 *    the swap the old ones become the spares (a state that failed to load is freed).
 *    st_slot_restore_adopt (an image its caller frees next) takes the image's fp32 blocks
 *    instead of copying them: the live state's (a backend with load_adopt: the CPU's) and each
 *    kept checkpoint's, when the block is the image's own. Their bytes are verified where they
 *    lie (the state hash over the live block; each checkpoint's position), and only at the swap
 *    are the blocks exchanged: the state and chain take the image's, the image gets the spares'
 *    in their place, so a refused restore changes neither the slot nor the image, and the
 *    spares stay within one slot's memory.
 * 6. The state hash (defined in statestore/st_image.h) covers the tokens, the K/V rows and the
 *    running state as the slot holds it after a restore: f32 tensors as the fp32 values widened
 *    from the stored codec. A snapshot hashes the state as stored (what a restore will widen); a
 *    restore hashes the fresh backend state (the bulk path: where each block arrived; else read
 *    back). Block digests run on the pool, so the value never depends on the thread count.
 * 7. A held checkpoint never changes after it is taken (or restored), so its bf16 block, once a
 *    snapshot has coded it, is kept (ck.bf16, a reference shared with the images holding it) and
 *    put by reference into every later bf16 snapshot instead of being coded again. It holds
 *    exactly the codes st_codec_bf16 gives for ck.blk: made by that encode, or taken from the bf16
 *    image a restore widened ck.blk from (bf16 -> f32 -> bf16 is the identity on every code the
 *    encode writes; a signalling-NaN code, which it never writes, would be kept as read). It goes
 *    with the checkpoint: dropped, cut, replaced by a restore, reset or freed (ck_free,
 *    ck_spare); the images referencing it keep it until they are freed.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

#define SCRATCH_BYTES (4u * 1024u * 1024u)

/* Running tensor ti of a checkpoint (NULL for K/V tensors). */
static uint8_t *ck_t(const st_engine *e, const st_slot_ckpt *ck, uint32_t ti)
{
    return st_engine_running_bytes(e, ti) ? ck->blk + e->ck_off[ti] : NULL;
}

static void ck_free(st_slot_ckpt *ck)
{
    st_image_block_unref(ck->bf16);
    ck->bf16 = NULL;
    st_image_buffer_free(ck->blk); /* it may have been an image's (st_slot_restore_adopt) */
    ck->blk = NULL;
}

/* A checkpoint's buffers to the engine's spares (kept for the next ck_alloc), or freed when
 * prompt_cache of them are kept already. */
static void ck_spare(st_engine *e, st_slot_ckpt *ck)
{
    st_image_block_unref(ck->bf16); /* the coded form of the values a spare will overwrite */
    ck->bf16 = NULL;
    if (!ck->blk)
        return;
    if (e->n_spare_ck < e->o.prompt_cache) {
        e->spare_ck[e->n_spare_ck++] = ck->blk;
        ck->blk = NULL;
        return;
    }
    ck_free(ck);
}

void st_slot_spares_free(st_engine *e)
{
    if (e->spare_st)
        e->be->state_free(e->bctx, e->spare_st);
    e->spare_st = NULL;
    while (e->n_spare_ck) {
        st_slot_ckpt ck = {.blk = e->spare_ck[--e->n_spare_ck]};
        ck_free(&ck);
    }
}

/* A checkpoint's block: a spare's (every running tensor is overwritten by its callers,
 * ckpt_take and load_ckpt, or the block goes to an image in exchange for the image's:
 * st_slot_restore_adopt), else a new one. */
static int ck_alloc(st_engine *e, st_slot_ckpt *ck)
{
    memset(ck, 0, sizeof *ck);
    if (e->n_spare_ck) {
        ck->blk = e->spare_ck[--e->n_spare_ck];
        return 0;
    }
    if (!(ck->blk = st_big_alloc(e->ck_bytes ? e->ck_bytes : 1)))
        return st_error_set(ENOMEM, "checkpoint: %llu bytes", (unsigned long long)e->ck_bytes);
    return 0;
}

static void chain_free(st_slot_ckpt *ck, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        ck_free(&ck[i]);
    free(ck);
}

/* A chain's checkpoints to the spares (the rest freed), and the chain. */
static void chain_spare(st_engine *e, st_slot_ckpt *ck, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++)
        ck_spare(e, &ck[i]);
    free(ck);
}

static void ck_remove(st_slot *s, uint32_t i)
{
    ck_free(&s->ck[i]);
    memmove(&s->ck[i], &s->ck[i + 1], (s->n_ck - i - 1) * sizeof *s->ck);
    s->n_ck--;
}

/* Drop every checkpoint deeper than pos. */
static void ck_cut(st_slot *s, uint64_t pos)
{
    while (s->n_ck && s->ck[s->n_ck - 1].e.position > pos)
        ck_remove(s, s->n_ck - 1);
}

int st_slot_new(st_engine *e, st_slot **out)
{
    *out = NULL;
    st_slot *s = calloc(1, sizeof *s);
    int rc;
    if (!s)
        return st_error_set(ENOMEM, "slot");
    s->e = e;
    s->tokens = malloc((size_t)e->o.n_ctx * sizeof *s->tokens);
    s->logits = malloc((size_t)e->m->hp.n_vocab * sizeof *s->logits);
    s->ck = calloc(e->o.prompt_cache + 1, sizeof *s->ck);
    if (!s->tokens || !s->logits || !s->ck) {
        st_slot_free(s);
        return st_error_set(ENOMEM, "slot");
    }
    if ((rc = e->be->state_new(e->bctx, &s->st))) {
        st_slot_free(s);
        return rc;
    }
    e->be->state_reset(e->bctx, s->st);
    *out = s;
    return 0;
}

void st_slot_free(st_slot *s)
{
    if (!s)
        return;
    if (s->st)
        s->e->be->state_free(s->e->bctx, s->st);
    if (s->ck)
        chain_free(s->ck, s->n_ck);
    free(s->tokens);
    free(s->logits);
    free(s);
}

static void reset_locked(st_slot *s)
{
    s->e->be->state_reset(s->e->bctx, s->st);
    s->n_tokens = 0;
    s->has_logits = 0;
    while (s->n_ck)
        ck_remove(s, s->n_ck - 1);
}

void st_slot_reset(st_slot *s)
{
    pthread_mutex_lock(&s->e->lock);
    reset_locked(s);
    pthread_mutex_unlock(&s->e->lock);
}

const st_geometry *st_slot_geometry(const st_slot *s)
{
    return &s->e->geom;
}

uint64_t st_slot_n_tokens(const st_slot *s) { return s->n_tokens; }
const uint32_t *st_slot_tokens(const st_slot *s) { return s->tokens; }
uint32_t st_slot_n_checkpoints(const st_slot *s) { return s->n_ck; }

uint64_t st_slot_checkpoint_pos(const st_slot *s, uint32_t i)
{
    return i < s->n_ck ? s->ck[i].e.position : UINT64_MAX;
}

const float *st_slot_logits(const st_slot *s, uint32_t *n)
{
    if (!s->has_logits) {
        if (n)
            *n = 0;
        return NULL;
    }
    if (n)
        *n = s->e->m->hp.n_vocab;
    return s->logits;
}

/* ---- conversation cache ------------------------------------------------------------------ */
static int ckpt_take(st_slot *s, uint64_t pos, int root)
{
    st_engine *e = s->e;
    int rc;
    if (e->o.prompt_cache == 0)
        return 0;
    for (uint32_t i = 0; i < s->n_ck; i++)
        if (s->ck[i].e.position == pos) {
            s->ck[i].e.root |= root;
            s->ck[i].e.last_used = ++s->tick;
            return 0;
        }
    st_slot_ckpt ck;
    if ((rc = ck_alloc(e, &ck)))
        return rc;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++)
        if (ck_t(e, &ck, ti) && (rc = e->be->running_read(e->bctx, s->st, ti, ck_t(e, &ck, ti),
                                                          st_engine_running_bytes(e, ti)))) {
            ck_spare(e, &ck);
            return rc;
        }
    ck.e.position = pos;
    ck.e.created = ck.e.last_used = ++s->tick;
    ck.e.root = root;
    uint32_t at = s->n_ck;
    while (at > 0 && s->ck[at - 1].e.position > pos)
        at--;
    memmove(&s->ck[at + 1], &s->ck[at], (s->n_ck - at) * sizeof *s->ck);
    s->ck[at] = ck;
    s->n_ck++;
    while (s->n_ck > e->o.prompt_cache) {
        st_cache_entry ents[65];
        for (uint32_t i = 0; i < s->n_ck; i++)
            ents[i] = s->ck[i].e;
        int64_t v = st_cache_victim(ents, s->n_ck, e->o.prompt_cache);
        if (v < 0)
            break;
        ck_remove(s, (uint32_t)v);
    }
    return 0;
}

/* Load checkpoint i into the live state and cut the conversation there. */
static int ckpt_mount(st_slot *s, uint32_t i)
{
    st_engine *e = s->e;
    int rc;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++)
        if (ck_t(e, &s->ck[i], ti) &&
            (rc = e->be->running_write(e->bctx, s->st, ti, ck_t(e, &s->ck[i], ti),
                                       st_engine_running_bytes(e, ti))))
            return rc;
    s->n_tokens = s->ck[i].e.position;
    s->has_logits = 0;
    s->ck[i].e.last_used = ++s->tick;
    ck_cut(s, s->n_tokens);
    return 0;
}

/* The geometry index of the position when it is the only running tensor (a model whose every
 * layer keeps K/V: llama, qwen3), else -1 (a recurrent state cannot be cut). */
static int64_t kv_only_pos(const st_engine *e)
{
    int64_t pos = -1;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++) {
        const st_tensor_desc *t = &e->geom.tensors[ti];
        if (t->role != ST_ROLE_RUNNING)
            continue;
        if (t->dtype != ST_DTYPE_I64 || strcmp(t->name, "pos") || pos >= 0)
            return -1;
        pos = ti;
    }
    return pos;
}

/* Cut a K/V-only conversation at pos <= n_tokens: K/V rows [0, pos) are those of tokens[0, pos)
 * and rows at or beyond the position are never read, so setting the position is the whole cut. */
static int kv_cut(st_slot *s, uint32_t ti, uint64_t pos)
{
    int64_t v = (int64_t)pos;
    int rc = s->e->be->running_write(s->e->bctx, s->st, ti, &v, sizeof v);
    if (rc)
        return rc;
    s->n_tokens = pos;
    s->has_logits = 0;
    ck_cut(s, pos);
    return 0;
}

/* ---- reading ------------------------------------------------------------------------------ */
static int read_range(st_slot *s, const uint32_t *tokens, uint64_t n, uint64_t system_len)
{
    st_engine *e = s->e;
    const st_engine_opts *o = &e->o;
    uint64_t ub = o->ubatch;
    int root_on = o->prompt_cache && o->prompt_cache_root && system_len >= o->prompt_cache_root &&
                  system_len <= n;
    uint64_t every = 0;
    if (o->prompt_cache && o->prompt_cache_every)
        every = ((uint64_t)o->prompt_cache_every + ub - 1) / ub * ub;
    uint64_t p = s->n_tokens;
    int rc;
    while (p < n) {
        if (s->cancel && s->cancel(s->cancel_arg))
            return st_error_set(ECANCELED, "eval: stopped by its caller after %llu of %llu tokens",
                                (unsigned long long)p, (unsigned long long)n);
        uint64_t end = (p / ub + 1) * ub;
        if (end > n)
            end = n;
        if (root_on && system_len > p && system_len < end)
            end = system_len;
        /* every chunk leaves the logits of its last token (one row of the head: cheap next to
         * the chunk), so the slot is whole at every chunk boundary, where a read may stop */
        rc = e->be->forward(e->bctx, s->st, tokens + p, (uint32_t)(end - p), p, s->logits);
        if (rc)
            return rc;
        memcpy(s->tokens + p, tokens + p, (end - p) * sizeof *tokens);
        s->n_tokens = p = end;
        s->has_logits = 1;
        if (root_on && p == system_len) {
            if ((rc = ckpt_take(s, p, 1)))
                return rc;
        } else if (every && p % every == 0 && p < n) {
            if ((rc = ckpt_take(s, p, 0)))
                return rc;
        }
    }
    s->has_logits = 1;
    return 0;
}

void st_slot_set_cancel(st_slot *s, st_cancel_fn fn, void *arg)
{
    s->cancel = fn;
    s->cancel_arg = fn ? arg : NULL;
}

int st_slot_eval(st_slot *s, const uint32_t *tokens, uint64_t n, uint64_t system_len,
                 st_eval_stats *stats)
{
    st_engine *e = s->e;
    st_eval_stats st = {0, 0, UINT64_MAX, 0};
    int rc = 0;
    if (n == 0 || n > e->o.n_ctx)
        return st_error_set(n ? ST_ETOOBIG : ST_EINVAL, "eval: %llu tokens (1..%u, the context)",
                            (unsigned long long)n, e->o.n_ctx);
    for (uint64_t i = 0; i < n; i++)
        if (tokens[i] >= e->m->hp.n_vocab)
            return st_error_set(ST_EINVAL, "eval: token %llu is %u, outside the vocabulary of %u",
                                (unsigned long long)i, tokens[i], e->m->hp.n_vocab);
    pthread_mutex_lock(&e->lock);
    uint64_t L = 0;
    while (L < s->n_tokens && L < n && s->tokens[L] == tokens[L])
        L++;
    int live_ok = L == s->n_tokens && (L < n || s->has_logits);
    if (!live_ok) {
        /* diverged (or nothing to read and no logits): mount the deepest checkpoint <= L that
         * leaves at least one token to read */
        uint64_t limit = L < n ? L : n - 1;
        st_cache_entry ents[65];
        for (uint32_t i = 0; i < s->n_ck; i++)
            ents[i] = s->ck[i].e;
        int64_t c = st_cache_mount_point(ents, s->n_ck, limit), kv_pos = kv_only_pos(e);
        if (kv_pos >= 0 && limit > 0) { /* pure attention: cut at any position */
            if ((rc = kv_cut(s, (uint32_t)kv_pos, limit)))
                goto fail;
            st.mounted_at = s->n_tokens;
        } else if (c >= 0) {
            if ((rc = ckpt_mount(s, (uint32_t)c)))
                goto fail;
            st.mounted_at = s->n_tokens;
        } else {
            reset_locked(s);
        }
    }
    st.reused = s->n_tokens;
    st.computed = n - s->n_tokens;
    if (s->n_tokens < n && (rc = read_range(s, tokens, n, system_len))) {
        if (rc == ECANCELED) { /* whole chunks read so far stay (st_engine.h) */
            st.computed = s->n_tokens - st.reused;
            st.checkpoints = s->n_ck;
            pthread_mutex_unlock(&e->lock);
            if (stats)
                *stats = st;
            return rc;
        }
        goto fail;
    }
    if ((rc = ckpt_take(s, n, 0)))
        goto fail;
    st.checkpoints = s->n_ck;
    pthread_mutex_unlock(&e->lock);
    if (stats)
        *stats = st;
    return 0;
fail:
    reset_locked(s);
    pthread_mutex_unlock(&e->lock);
    return rc;
}

int st_slot_decode(st_slot *s, uint32_t token)
{
    st_engine *e = s->e;
    if (s->n_tokens + 1 > e->o.n_ctx)
        return st_error_set(ST_ETOOBIG, "decode: the context of %u tokens is full", e->o.n_ctx);
    pthread_mutex_lock(&e->lock);
    int rc = e->be->forward(e->bctx, s->st, &token, 1, s->n_tokens, s->logits);
    if (!rc) {
        s->tokens[s->n_tokens++] = token;
        s->has_logits = 1;
    }
    pthread_mutex_unlock(&e->lock);
    return rc;
}

/* ---- sampling ------------------------------------------------------------------------------ */
static uint64_t mix64(uint64_t z)
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

int st_slot_sample(const st_slot *s, float temp, uint64_t seed, uint32_t *token)
{
    uint32_t V = s->e->m->hp.n_vocab;
    if (!s->has_logits)
        return st_error_set(ST_EINVAL, "sample: the slot holds no logits");
    const float *l = s->logits;
    uint32_t best = 0;
    float m = -INFINITY;
    for (uint32_t i = 0; i < V; i++)
        if (l[i] > m) {
            m = l[i];
            best = i;
        }
    if (!(temp > 0.0f) || !isfinite(temp) || !isfinite(m)) {
        *token = best;
        return 0;
    }
    double sum = 0.0;
    for (uint32_t i = 0; i < V; i++)
        if (l[i] == l[i])
            sum += exp(((double)l[i] - m) / temp);
    double u = (double)(mix64(mix64(seed) ^ s->n_tokens) >> 11) * 0x1p-53 * sum, acc = 0.0;
    for (uint32_t i = 0; i < V; i++) {
        if (l[i] != l[i])
            continue;
        acc += exp(((double)l[i] - m) / temp);
        if (acc > u) {
            *token = i;
            return 0;
        }
    }
    *token = best;
    return 0;
}

/* ---- state hash ------------------------------------------------------------------------------ */
#define HASH_STAGE ((uint64_t)16 << 20) /* bytes of backend state staged per parallel pass */

typedef struct hash_run {
    st_state_hash_task task;
    void *arg;
    uint64_t base;
} hash_run;

static void hash_pool_task(void *ctx, uint32_t task, uint32_t thread)
{
    (void)thread;
    const hash_run *r = (const hash_run *)ctx;
    r->task(r->arg, r->base + task);
}

/* The state hash's runner: the block digests on the engine's pool. */
static void hash_runner(void *run_arg, uint64_t n, st_state_hash_task task, void *arg)
{
    st_engine *e = (st_engine *)run_arg;
    hash_run r = {task, arg, 0};
    for (r.base = 0; r.base < n; r.base += (uint64_t)1 << 30) {
        uint64_t k = n - r.base < ((uint64_t)1 << 30) ? n - r.base : ((uint64_t)1 << 30);
        st_pool_run(e->pool, (uint32_t)k, hash_pool_task, &r, k * ST_STATE_HASH_BLOCK);
    }
}

/* The state hash of an image (what its restore must find), on the pool. */
static int image_hash(st_engine *e, const st_image *img, uint64_t *out)
{
    return st_image_state_hash_compute(img, hash_runner, e, out);
}

/* Bytes segment 1 + ti of the state hash covers for a backend state of n tokens. */
static uint64_t hash_seg_bytes(const st_engine *e, uint32_t ti, uint64_t n)
{
    const st_tensor_desc *d = &e->geom.tensors[ti];
    if (d->role == ST_ROLE_KV)
        return n * st_tensor_row_bytes(d);
    return st_engine_running_bytes(e, ti);
}

/* The state hash of a backend state holding tokens[0..n), its running state as a snapshot in
 * codec would record it (f32 tensors rounded through codec, then widened): see st_image.h. The
 * tensors are read into a staging buffer a group at a time and each group's block digests are
 * computed on the pool. */
static int state_hash(st_engine *e, void *bst, const uint32_t *tokens, uint64_t n, uint32_t codec,
                      uint64_t *out)
{
    const st_geometry *g = &e->geom;
    st_state_hash_seg *segs = NULL;
    uint64_t *dg = NULL, total, maxb = 0, cap, used = 0, d0;
    uint8_t *stage, *tmp = NULL;
    uint32_t first = 0;
    int rc = 0;
    size_t es = st_codec_elem_size(codec);
    if (!es)
        return st_error_set(ST_ECODEC, "state hash: codec %u", codec);
    total = st_state_hash_blocks(n * 4);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        uint64_t b = hash_seg_bytes(e, ti, n);
        total += st_state_hash_blocks(b);
        if (b > maxb)
            maxb = b;
    }
    cap = maxb > HASH_STAGE ? maxb : HASH_STAGE;
    cap = (cap + 63) & ~(uint64_t)63;
    if (e->hstage_cap < cap) {
        free(e->hstage);
        e->hstage_cap = 0;
        if (!(e->hstage = st_big_alloc((size_t)cap))) {
            rc = st_error_set(ENOMEM, "state hash: staging of %llu bytes", (unsigned long long)cap);
            goto done;
        }
        e->hstage_cap = cap;
    }
    stage = e->hstage;
    segs = calloc(g->n_tensors + 1, sizeof *segs);
    dg = malloc((size_t)(total ? total : 1) * sizeof *dg);
    if (codec != ST_CODEC_FP32)
        tmp = st_big_alloc((size_t)maxb);
    if (!segs || !dg || (codec != ST_CODEC_FP32 && !tmp)) {
        rc = st_error_set(ENOMEM, "state hash: staging");
        goto done;
    }
    segs[0] = (st_state_hash_seg){tokens, n * 4, -1};
    if ((rc = st_state_hash_digests(segs, 1, dg, hash_runner, e)))
        goto done;
    d0 = st_state_hash_blocks(n * 4);
    first = 1;
    for (uint32_t ti = 0; ti <= g->n_tensors; ti++) {
        uint64_t b = ti < g->n_tensors ? hash_seg_bytes(e, ti, n) : 0;
        int f32 = ti < g->n_tensors && g->tensors[ti].role != ST_ROLE_KV &&
                  g->tensors[ti].dtype == ST_DTYPE_F32;
        uint64_t held = f32 ? b / 4 * es : b; /* the bytes the stage holds for it */
        if (ti == g->n_tensors || used + held > cap) {
            /* hash the group staged so far: segments [first, 1 + ti) */
            if ((rc = st_state_hash_digests(segs + first, 1 + ti - first, dg + d0, hash_runner, e)))
                goto done;
            for (uint32_t k = first; k < 1 + ti; k++)
                d0 += st_state_hash_blocks(segs[k].bytes);
            first = 1 + ti;
            used = 0;
            if (ti == g->n_tensors)
                break;
        }
        st_state_hash_seg *sg = &segs[1 + ti];
        *sg = (st_state_hash_seg){stage + used, b, -1};
        if (g->tensors[ti].role == ST_ROLE_KV) {
            if (n && (rc = e->be->kv_read(e->bctx, bst, ti, 0, n, stage + used)))
                goto done;
        } else if (!f32 || codec == ST_CODEC_FP32) {
            if (b && (rc = e->be->running_read(e->bctx, bst, ti, stage + used, b)))
                goto done;
        } else {
            if ((rc = e->be->running_read(e->bctx, bst, ti, tmp, b)) ||
                (rc = st_codec_convert(codec, stage + used, ST_CODEC_FP32, tmp, (size_t)(b / 4),
                                       NULL, 0)))
                goto done;
            sg->widen = (int32_t)codec;
        }
        used += (held + 63) & ~(uint64_t)63;
    }
    *out = st_state_hash_combine(n, dg, total);
    if (!*out)
        rc = st_error_set(ENOMEM, "state hash: out of memory");
done:
    free(segs);
    free(dg);
    free(tmp);
    return rc;
}

/* The digests of a bulk transfer's state hash (st_backend.save / .load): *dg holds room for all of
 * a state of n tokens; the backend fills those of the geometry tensors (from *d0 on) while it
 * moves the state. */
static int bulk_digests(const st_engine *e, uint64_t n, uint64_t **dg, uint64_t *total,
                        uint64_t *d0)
{
    *d0 = st_state_hash_blocks(n * 4);
    *total = *d0;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++)
        *total += st_state_hash_blocks(hash_seg_bytes(e, ti, n));
    if (!(*dg = malloc((size_t)(*total ? *total : 1) * sizeof **dg)))
        return st_error_set(ENOMEM, "state hash: %llu digests", (unsigned long long)*total);
    return 0;
}

/* The tokens' digests on the pool, then the hash of a bulk transfer's digests. */
static int bulk_hash(st_engine *e, const uint32_t *tokens, uint64_t n, uint64_t *dg,
                     uint64_t total, uint64_t *out)
{
    st_state_hash_seg tg = {tokens, n * 4, -1};
    int rc = st_state_hash_digests(&tg, 1, dg, hash_runner, e);
    if (rc)
        return rc;
    if (!(*out = st_state_hash_combine(n, dg, total)))
        return st_error_set(ENOMEM, "state hash: out of memory");
    return 0;
}

/* A backend with bulk transfers (st_backend.save / .load) moves the whole state in one pass when
 * the live checkpoint is in one of these codecs. */
static int bulk_ok(uint32_t codec)
{
    return codec == ST_CODEC_FP32 || codec == ST_CODEC_BF16;
}

int st_slot_state_hash(const st_slot *s, uint32_t codec, uint64_t *out)
{
    pthread_mutex_lock(&s->e->lock);
    int rc = state_hash(s->e, s->st, s->tokens, s->n_tokens, codec, out);
    pthread_mutex_unlock(&s->e->lock);
    return rc;
}

/* ---- checkpoint copies ---------------------------------------------------------------------- */
#define CONV_BLOCK ((uint64_t)1 << 18) /* elements converted per task */

/* n elements of f32 state from src in codec scodec to dst in codec dcodec (one of them fp32). */
typedef struct conv_piece {
    void *dst;
    const void *src;
    uint32_t dcodec, scodec;
    uint64_t n;
} conv_piece;

typedef struct conv_run {
    const conv_piece *pc;
    const uint64_t *first; /* [np + 1]: each piece's first block */
    uint32_t np;
    int err;
} conv_run;

static void conv_task(void *ctx, uint32_t task, uint32_t thread)
{
    (void)thread;
    conv_run *r = ctx;
    uint32_t lo = 0, hi = r->np;
    while (hi - lo > 1) {
        uint32_t mid = lo + (hi - lo) / 2;
        if (r->first[mid] <= task)
            lo = mid;
        else
            hi = mid;
    }
    const conv_piece *c = &r->pc[lo];
    uint64_t e0 = (task - r->first[lo]) * CONV_BLOCK, k = c->n - e0 < CONV_BLOCK ? c->n - e0 : CONV_BLOCK;
    if (c->dcodec == ST_CODEC_BF16 && c->scodec == ST_CODEC_FP32) {
        /* a snapshot's checkpoint: streamed to the image, which is not read again soon */
        st_codec_bf16_encode_stream((uint16_t *)c->dst + e0, NULL, (const float *)c->src + e0,
                                    (size_t)k);
        return;
    }
    int rc = st_codec_convert(c->dcodec, (uint8_t *)c->dst + e0 * st_codec_elem_size(c->dcodec),
                              c->scodec, (const uint8_t *)c->src + e0 * st_codec_elem_size(c->scodec),
                              (size_t)k, NULL, 0);
    if (rc) {
        int none = 0;
        __atomic_compare_exchange_n(&r->err, &none, rc, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    }
}

/* The pieces, cut in blocks, on the engine's pool (a checkpoint is copied on every thread). */
static int pool_convert(st_engine *e, const conv_piece *pc, uint32_t np)
{
    uint64_t *first = malloc(((size_t)np + 1) * sizeof *first), total = 0, bytes = 0;
    if (!first)
        return st_error_set(ENOMEM, "checkpoint copy");
    for (uint32_t i = 0; i < np; i++) {
        first[i] = total;
        total += (pc[i].n + CONV_BLOCK - 1) / CONV_BLOCK;
        bytes += pc[i].n * 4;
    }
    first[np] = total;
    conv_run r = {pc, first, np, 0};
    if (total > UINT32_MAX)
        r.err = ST_ETOOBIG;
    else
        st_pool_run(e->pool, (uint32_t)total, conv_task, &r, bytes);
    free(first);
    if (r.err)
        return st_error_set(r.err, "checkpoint copy: %s", st_strerror(r.err));
    return 0;
}

/* ---- snapshot --------------------------------------------------------------------------------- */
/* A checkpoint the slot holds (fp32) into the image, stored in codec; in bf16 by reference to
 * its kept block, else coded (and the bf16 block kept: invariant 7). */
static int add_held_ckpt(st_engine *e, st_image *img, uint64_t pos, st_slot_ckpt *ck,
                         uint32_t codec)
{
    const st_geometry *g = &e->geom;
    uint32_t ci, np = 0;
    int rc;
    if (codec == ST_CODEC_BF16 && ck->bf16)
        return st_image_checkpoint_add_shared(img, pos, codec, ck->bf16, NULL);
    conv_piece *pc = calloc(g->n_tensors ? g->n_tensors : 1, sizeof *pc);
    if (!pc)
        return st_error_set(ENOMEM, "snapshot: checkpoint");
    if ((rc = st_image_checkpoint_add_unzeroed(img, pos, codec, &ci)))
        goto done;
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        const st_tensor_desc *d = &g->tensors[ti];
        uint64_t b = st_engine_running_bytes(e, ti), len = 0;
        if (!b)
            continue;
        void *dst = st_image_checkpoint_tensor(img, ci, ti, &len);
        if (!dst || len != st_tensor_stored_bytes(d, codec)) {
            rc = st_error_set(ST_EINVAL, "snapshot: checkpoint tensor %s: %llu bytes, expected "
                              "%llu", d->name, (unsigned long long)len,
                              (unsigned long long)st_tensor_stored_bytes(d, codec));
            goto done;
        }
        if (d->dtype == ST_DTYPE_F32)
            pc[np++] = (conv_piece){dst, ck_t(e, ck, ti), codec, ST_CODEC_FP32, b / 4};
        else
            memcpy(dst, ck_t(e, ck, ti), b);
    }
    rc = pool_convert(e, pc, np);
    if (!rc && codec == ST_CODEC_BF16)
        ck->bf16 = st_image_checkpoint_share(img, ci); /* NULL (no memory): coded next time */
done:
    free(pc);
    return rc;
}

/* The live state of bst into the image, stored in codec (backends without bulk transfers). */
static int add_live_ckpt(st_engine *e, st_image *img, uint64_t pos, void *bst, uint32_t codec,
                         void *scratch)
{
    uint32_t ci;
    int rc = st_image_checkpoint_add(img, pos, ST_CODEC_FP32, &ci);
    if (rc)
        return rc;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++) {
        uint64_t b = st_engine_running_bytes(e, ti), len = 0;
        if (!b)
            continue;
        void *dst = st_image_checkpoint_tensor(img, ci, ti, &len);
        if (!dst || len != b)
            return st_error_set(ST_EINVAL, "snapshot: checkpoint tensor %s: %llu bytes, expected "
                                "%llu", e->geom.tensors[ti].name, (unsigned long long)len,
                                (unsigned long long)b);
        if ((rc = e->be->running_read(e->bctx, bst, ti, dst, b)))
            return rc;
    }
    if (codec != ST_CODEC_FP32)
        return st_image_checkpoint_recode(img, ci, codec, scratch, SCRATCH_BYTES);
    return 0;
}

/* K/V rows [0, n) of every K/V tensor of the slot into the image (which holds n tokens), through
 * the backend's kv_read (the plain path). what names the caller in a detail. */
static int kv_rows_out(st_slot *s, st_image *img, uint64_t n, const char *what)
{
    st_engine *e = s->e;
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++) {
        if (e->geom.tensors[ti].role != ST_ROLE_KV)
            continue;
        uint64_t len = 0;
        void *dst = st_image_kv(img, ti, &len);
        if (len != n * st_tensor_row_bytes(&e->geom.tensors[ti]))
            return st_error_set(ST_EINVAL, "%s: K/V tensor %s: image holds %llu bytes", what,
                                e->geom.tensors[ti].name, (unsigned long long)len);
        int rc = e->be->kv_read(e->bctx, s->st, ti, 0, n, dst);
        if (rc)
            return rc;
    }
    return 0;
}

int st_slot_snapshot(st_slot *s, int mode, uint32_t codec, st_image **out)
{
    st_engine *e = s->e;
    st_image *img = NULL;
    void *scratch = NULL;
    uint64_t h = 0, *dg = NULL, nd = 0, d0 = 0;
    int rc;
    *out = NULL;
    if ((rc = st_codec_check(codec)))
        return rc;
    if (mode != ST_SNAPSHOT_SESSION && mode != ST_SNAPSHOT_PARK)
        return st_error_set(ST_EINVAL, "snapshot: mode %d", mode);
    pthread_mutex_lock(&e->lock);
    if (!s->has_logits || s->n_tokens == 0) {
        rc = st_error_set(ST_EINVAL, "snapshot: the slot holds no conversation");
        goto done;
    }
    if (!(scratch = malloc(SCRATCH_BYTES))) {
        rc = st_error_set(ENOMEM, "snapshot: scratch");
        goto done;
    }
    int bulk = e->be->save && bulk_ok(codec);
    /* the image of a bulk backend may live in memory the device moves directly (the CUDA
     * backend's pinned pool: a PARK image for as long as it is parked, a SAVE's until the caller
     * has written it and frees it); the bulk save writes every K/V row, so none is zeroed first */
    const st_image_allocator *ia = NULL;
    if (bulk && e->be->image_allocator)
        ia = e->be->image_allocator(e->bctx);
    if ((rc = st_image_create_with(&img, &e->geom, ia)) ||
        (rc = bulk ? st_image_tokens_set_unzeroed(img, s->tokens, s->n_tokens)
                   : st_image_tokens_set(img, s->tokens, s->n_tokens)))
        goto done;
    if (bulk && (rc = bulk_digests(e, s->n_tokens, &dg, &nd, &d0)))
        goto done;
    if (!bulk && (rc = kv_rows_out(s, img, s->n_tokens, "snapshot")))
        goto done;
    /* resume checkpoints: every earlier one (park) or the deepest earlier one (session) */
    uint32_t first = 0, end = 0;
    while (end < s->n_ck && s->ck[end].e.position < s->n_tokens)
        end++;
    if (mode == ST_SNAPSHOT_SESSION && end > 0)
        first = end - 1;
    for (uint32_t i = first; i < end; i++)
        if ((rc = add_held_ckpt(e, img, s->ck[i].e.position, &s->ck[i], codec)))
            goto done;
    if (bulk) {
        /* the live state in one pass of the backend, which writes every running tensor */
        uint32_t ci;
        if ((rc = st_image_checkpoint_add_unzeroed(img, s->n_tokens, codec, &ci)) ||
            (rc = e->be->save(e->bctx, s->st, img, ci, s->n_tokens, dg + d0)))
            goto done;
    } else if ((rc = add_live_ckpt(e, img, s->n_tokens, s->st, codec, scratch))) {
        goto done;
    }
    /* the hash of the state as stored (in codec) and as a restore will widen it: the bulk
     * path's tensor digests were computed by the backend from the state it copied out */
    if ((rc = st_image_logits_set(img, s->logits, e->m->hp.n_vocab)) ||
        (rc = bulk ? bulk_hash(e, s->tokens, s->n_tokens, dg, nd, &h) : image_hash(e, img, &h)))
        goto done;
    st_image_state_hash_set(img, h);
    if ((rc = st_image_check(img)))
        goto done;
    *out = img;
    img = NULL;
done:
    pthread_mutex_unlock(&e->lock);
    st_image_free(img);
    free(scratch);
    free(dg);
    return rc;
}

/* A prefix of the conversation (st_engine.h): tokens and K/V rows [0, p) and the running state
 * after them (a held checkpoint at p, the position alone for a K/V-only model, or the live state
 * at p == n_tokens), without logits, through the plain (non-bulk) path. */
int st_slot_snapshot_prefix(st_slot *s, uint64_t p, uint32_t codec, st_image **out)
{
    st_engine *e = s->e;
    st_image *img = NULL;
    void *scratch = NULL;
    uint64_t h = 0;
    int rc;
    *out = NULL;
    if ((rc = st_codec_check(codec)))
        return rc;
    pthread_mutex_lock(&e->lock);
    int64_t kv_pos = kv_only_pos(e), ck = -1;
    for (uint32_t i = 0; i < s->n_ck; i++)
        if (s->ck[i].e.position == p)
            ck = i;
    if (p == 0 || p > s->n_tokens) {
        rc = st_error_set(ST_EINVAL, "prefix snapshot: position %llu outside the %llu tokens held",
                          (unsigned long long)p, (unsigned long long)s->n_tokens);
        goto done;
    }
    if (ck < 0 && kv_pos < 0 && p != s->n_tokens) {
        rc = st_error_set(ST_ENOTFOUND, "prefix snapshot: no running state held at position %llu "
                          "(no checkpoint there)", (unsigned long long)p);
        goto done;
    }
    if (!(scratch = malloc(SCRATCH_BYTES))) {
        rc = st_error_set(ENOMEM, "prefix snapshot: scratch");
        goto done;
    }
    if ((rc = st_image_create(&img, &e->geom)) || (rc = st_image_tokens_set(img, s->tokens, p)))
        goto done;
    if ((rc = kv_rows_out(s, img, p, "prefix snapshot")))
        goto done;
    if (ck >= 0) {
        rc = add_held_ckpt(e, img, p, &s->ck[ck], codec);
    } else if (p == s->n_tokens) {
        rc = add_live_ckpt(e, img, p, s->st, codec, scratch);
    } else { /* K/V only: the running state is the position */
        uint32_t ci;
        uint64_t len = 0;
        int64_t v = (int64_t)p;
        if (!(rc = st_image_checkpoint_add(img, p, codec, &ci))) {
            void *dst = st_image_checkpoint_tensor(img, ci, (uint32_t)kv_pos, &len);
            if (!dst || len != sizeof v)
                rc = st_error_set(ST_EINVAL, "prefix snapshot: the position tensor holds %llu "
                                  "bytes", (unsigned long long)len);
            else
                memcpy(dst, &v, sizeof v);
        }
    }
    if (rc || (rc = image_hash(e, img, &h)))
        goto done;
    st_image_state_hash_set(img, h);
    if ((rc = st_image_check(img)))
        goto done;
    *out = img;
    img = NULL;
done:
    pthread_mutex_unlock(&e->lock);
    st_image_free(img);
    free(scratch);
    return rc;
}

/* ---- restore ---------------------------------------------------------------------------------- */
/* Checkpoint ci of img, widened to f32, into checkpoint ck's block, on the engine's pool; with
 * check_only, only the position tensor is checked (the block is taken as it is later:
 * st_slot_restore_adopt). */
static int load_ckpt(st_engine *e, const st_image *img, uint32_t ci, st_slot_ckpt *ck,
                     int check_only)
{
    uint64_t pos;
    uint32_t codec, np = 0;
    int rc = st_image_checkpoint_info(img, ci, &pos, &codec);
    if (rc)
        return rc;
    conv_piece *pc = calloc(e->geom.n_tensors ? e->geom.n_tensors : 1, sizeof *pc);
    if (!pc)
        return st_error_set(ENOMEM, "restore: checkpoint");
    for (uint32_t ti = 0; ti < e->geom.n_tensors; ti++) {
        const st_tensor_desc *d = &e->geom.tensors[ti];
        uint64_t b = st_engine_running_bytes(e, ti), len = 0;
        if (!b)
            continue;
        const void *src = st_image_checkpoint_tensor_const(img, ci, ti, &len);
        if (!src || len != st_tensor_stored_bytes(d, codec)) {
            rc = st_error_set(ST_ECORRUPT, "restore: checkpoint %u tensor %s: %llu bytes", ci,
                              d->name, (unsigned long long)len);
            goto done;
        }
        if (d->dtype == ST_DTYPE_F32) {
            if (!check_only)
                pc[np++] = (conv_piece){ck_t(e, ck, ti), src, ST_CODEC_FP32, codec, b / 4};
            continue;
        }
        if (!check_only)
            memcpy(ck_t(e, ck, ti), src, b);
        if (!strcmp(d->name, "pos")) {
            int64_t p;
            memcpy(&p, src, 8);
            if (p < 0 || (uint64_t)p != pos) {
                rc = st_error_set(ST_ECORRUPT, "restore: checkpoint %u at %llu holds position "
                                  "%lld", ci, (unsigned long long)pos, (long long)p);
                goto done;
            }
        }
    }
    rc = pool_convert(e, pc, np);
done:
    free(pc);
    return rc;
}

/* Checkpoint ci of img straight into a backend state: f32 tensors stored in another codec are
 * widened through one reused buffer, everything else is written from the image as it is. */
static int load_live(st_engine *e, const st_image *img, uint32_t ci, void *bst, void *scratch)
{
    uint64_t pos;
    uint32_t codec;
    uint8_t *tmp = NULL;
    int rc = st_image_checkpoint_info(img, ci, &pos, &codec);
    for (uint32_t ti = 0; !rc && ti < e->geom.n_tensors; ti++) {
        const st_tensor_desc *d = &e->geom.tensors[ti];
        uint64_t b = st_engine_running_bytes(e, ti), len = 0;
        if (!b)
            continue;
        const void *src = st_image_checkpoint_tensor_const(img, ci, ti, &len);
        if (!src || len != st_tensor_stored_bytes(d, codec)) {
            rc = st_error_set(ST_ECORRUPT, "restore: live state tensor %s: %llu bytes", d->name,
                              (unsigned long long)len);
            break;
        }
        if (d->dtype == ST_DTYPE_F32 && codec != ST_CODEC_FP32) {
            if (!tmp) {
                uint64_t maxb = 0;
                for (uint32_t i = 0; i < e->geom.n_tensors; i++)
                    if (st_engine_running_bytes(e, i) > maxb)
                        maxb = st_engine_running_bytes(e, i);
                if (!(tmp = st_big_alloc(maxb))) {
                    rc = st_error_set(ENOMEM, "restore: widening buffer");
                    break;
                }
            }
            if ((rc = st_codec_convert(ST_CODEC_FP32, tmp, codec, src, b / 4, scratch,
                                       SCRATCH_BYTES)))
                break;
            src = tmp;
        }
        if (!strcmp(d->name, "pos")) {
            int64_t p;
            memcpy(&p, src, 8);
            if (p < 0 || (uint64_t)p != pos) {
                rc = st_error_set(ST_ECORRUPT, "restore: live state at %llu holds position %lld",
                                  (unsigned long long)pos, (long long)p);
                break;
            }
        }
        rc = e->be->running_write(e->bctx, bst, ti, src, b);
    }
    free(tmp);
    return rc;
}

/* The refusal of a state made under another model (fp: the fingerprints, the engine's first),
 * naming the difference: the layer kinds (another architecture or layer pattern), another shape,
 * or, with the same layers and shapes, other weights or hyperparameters. */
static int model_mismatch(const st_engine *e, const st_geometry *g, const char *fp)
{
    char ours[256], theirs[256], d[1024];
    st_geometry_layer_kinds(&e->geom, ours, sizeof ours);
    st_geometry_layer_kinds(g, theirs, sizeof theirs);
    st_geometry same_fp = *g;
    memcpy(same_fp.model_fp, e->geom.model_fp, ST_FINGERPRINT_LEN);
    if (g->arch[0] && strcmp(g->arch, st_model_arch(e->m)))
        snprintf(d, sizeof d, "it is a %s state, this engine runs %s; its layers are %s, this engine's "
                 "%s model's %s", g->arch, st_model_arch(e->m), theirs, st_model_arch(e->m), ours);
    else if (strcmp(ours, theirs))
        snprintf(d, sizeof d, "its layers are %s, this engine's %s model's %s", theirs, st_model_arch(e->m),
                 ours);
    else if (st_geometry_compare(&e->geom, &same_fp))
        snprintf(d, sizeof d, "its layers are %s as this engine's %s model's, but %s", theirs,
                 st_model_arch(e->m), st_errdetail());
    else
        snprintf(d, sizeof d, "the same layers and shapes as this engine's %s model (%s), other weights "
                 "or hyperparameters", st_model_arch(e->m), ours);
    return st_error_set(ST_EMODEL, "restore: the state was made under another model: %s (%s; this "
                        "engine runs the first)", d, fp);
}

/* The restore (st_engine.h). mut: the same image when the caller lets the restore take its
 * fp32 checkpoint blocks (st_slot_restore_adopt), else NULL. */
static int restore(st_slot *s, const st_image *img, st_image *mut)
{
    st_engine *e = s->e;
    const st_backend *be = e->be;
    void *ns = NULL, *scratch = NULL;
    st_slot_ckpt *chain = NULL;
    uint32_t n_chain = 0;
    uint64_t h = 0, *dg = NULL, nd = 0, d0 = 0;
    uint8_t *take = NULL; /* take[i]: chain[i] takes the image's block at the swap */
    int rc, adopt_live = 0;
    const st_geometry *g = st_image_geometry(img);
    if ((rc = st_geometry_compare(&e->geom, g))) {
        if (rc != ST_EMODEL)
            return st_error_wrap(rc, "restore");
        char d[512];
        snprintf(d, sizeof d, "%s", st_errdetail());
        return model_mismatch(e, g, d);
    }
    if ((rc = st_image_check(img)))
        return rc;
    uint64_t n = st_image_n_tokens(img);
    const uint32_t *tokens = st_image_tokens(img);
    uint32_t nl = 0;
    const float *logits = st_image_logits(img, &nl);
    if (n == 0 || (nl && (!logits || nl != e->m->hp.n_vocab)))
        return st_error_set(ST_ECORRUPT, "restore: the image holds %llu tokens and %u logits "
                            "(need >= 1 and %u, or none for a prefix)", (unsigned long long)n, nl,
                            e->m->hp.n_vocab);
    for (uint64_t i = 0; i < n; i++)
        if (tokens[i] >= e->m->hp.n_vocab)
            return st_error_set(ST_ECORRUPT, "restore: token %llu is %u, outside the vocabulary",
                                (unsigned long long)i, tokens[i]);
    uint32_t nck = st_image_n_checkpoints(img);
    if (!(scratch = malloc(SCRATCH_BYTES)))
        return st_error_set(ENOMEM, "restore: scratch");
    pthread_mutex_lock(&e->lock);
    /* the state a restore replaced, kept by the engine, else a new one; either way every running
     * tensor, the position and K/V rows [0, n) are written below, and nothing beyond them is read
     * (rows past the position may hold another conversation's bytes: st_mem_kv.c) */
    if (e->spare_st) {
        ns = e->spare_st;
        e->spare_st = NULL;
    } else {
        if ((rc = be->state_new(e->bctx, &ns)))
            goto done;
        be->state_reset(e->bctx, ns);
    }
    uint64_t live_pos = 0;
    uint32_t live_codec = 0;
    st_image_checkpoint_info(img, nck - 1, &live_pos, &live_codec);
    int bulk = be->load && bulk_ok(live_codec);
    /* a gated image (st_image.h): the backend's load waits for each piece it reads, else
     * everything is here before anything is read */
    if (!(bulk && be->load_waits) && (rc = st_image_wait(img, NULL, 0)))
        goto done;
    if (bulk) {
        /* K/V and the live state in one pass of the backend, which puts the image's bytes on
         * the device unchanged and digests them there: the hash is verified over the bytes that
         * arrived. Adopting, the live state's bytes stay where the reader put them, in the block
         * the state takes at the swap, and are digested there. */
        if ((rc = bulk_digests(e, n, &dg, &nd, &d0)) ||
            (rc = mut && be->load_adopt
                      ? be->load_adopt(e->bctx, ns, img, nck - 1, n, dg + d0, &adopt_live)
                      : be->load(e->bctx, ns, img, nck - 1, n, dg + d0)) ||
            (rc = bulk_hash(e, tokens, n, dg, nd, &h)))
            goto done;
    }
    for (uint32_t ti = 0; !bulk && ti < g->n_tensors; ti++) {
        if (g->tensors[ti].role != ST_ROLE_KV)
            continue;
        uint64_t len = 0;
        const void *src = st_image_kv_const(img, ti, &len);
        if (len != n * st_tensor_row_bytes(&g->tensors[ti])) {
            rc = st_error_set(ST_ECORRUPT, "restore: K/V tensor %s holds %llu bytes",
                              g->tensors[ti].name, (unsigned long long)len);
            goto done;
        }
        if ((rc = be->kv_write(e->bctx, ns, ti, 0, n, src)))
            goto done;
    }
    if (!bulk && (rc = load_live(e, img, nck - 1, ns, scratch)))
        goto done;
    if ((rc = st_image_wait(img, NULL, 0))) /* the other checkpoints' bytes */
        goto done;
    /* resume checkpoints: the deepest prompt_cache of them */
    uint32_t keep = nck - 1, skip = 0;
    if (keep > e->o.prompt_cache) {
        skip = keep - e->o.prompt_cache;
        keep = e->o.prompt_cache;
    }
    chain = calloc(e->o.prompt_cache + 1, sizeof *chain);
    take = calloc(e->o.prompt_cache + 1, 1);
    if (!chain || !take) {
        rc = st_error_set(ENOMEM, "restore: checkpoints");
        goto done;
    }
    for (uint32_t i = 0; i < keep; i++) {
        uint64_t pos, len = 0;
        uint32_t codec;
        st_image_checkpoint_info(img, skip + i, &pos, &codec);
        if ((rc = ck_alloc(e, &chain[n_chain])))
            goto done;
        n_chain++;
        /* an fp32 block of the image's own, in the layout of the engine's blocks (the same
         * geometry, so the same st_checkpoint_layout): taken at the swap, the chain's block
         * given to the image for it. Only with a backend that adopts (the CPU's): another's
         * image buffers may be a pool of its own (the CUDA backend's pinned memory), not to be
         * held as checkpoints */
        take[i] = mut && be->load_adopt && codec == ST_CODEC_FP32 &&
                  st_image_checkpoint_exclusive(img, skip + i) &&
                  st_image_checkpoint_block(img, skip + i, &len) && len == e->ck_bytes;
        if ((rc = load_ckpt(e, img, skip + i, &chain[n_chain - 1], take[i])))
            goto done;
        chain[n_chain - 1].e.position = pos;
        if (codec == ST_CODEC_BF16) /* invariant 7; NULL (no memory): coded by the next PARK */
            chain[n_chain - 1].bf16 = st_image_checkpoint_share(img, skip + i);
    }
    if (!bulk && (rc = state_hash(e, ns, tokens, n, ST_CODEC_FP32, &h)))
        goto done;
    if (st_image_state_hash(img) == 0) {
        rc = st_error_set(ST_ECORRUPT, "restore: the image carries no state hash");
        goto done;
    }
    if (h != st_image_state_hash(img)) {
        rc = st_error_set(ST_ECORRUPT, "restore: state hash mismatch: recorded %016llx, the "
                          "restored state hashes to %016llx", (unsigned long long)st_image_state_hash(img),
                          (unsigned long long)h);
        goto done;
    }
    /* swap; the old state and checkpoints become the engine's spares. Adopting, the state and
     * the chain first take the image's blocks (checked above: fp32, the image's own, the
     * layout of theirs), giving it theirs: nothing here can fail */
    if (adopt_live)
        be->adopt(e->bctx, ns, mut, nck - 1);
    for (uint32_t i = 0; i < n_chain; i++)
        if (take[i]) {
            void *b = chain[i].blk;
            st_image_checkpoint_exchange(mut, skip + i, &b);
            chain[i].blk = b;
        }
    if (e->spare_st)
        be->state_free(e->bctx, s->st);
    else
        e->spare_st = s->st;
    s->st = ns;
    ns = NULL;
    chain_spare(e, s->ck, s->n_ck);
    s->ck = chain;
    s->n_ck = n_chain;
    chain = NULL;
    n_chain = 0;
    for (uint32_t i = 0; i < s->n_ck; i++)
        s->ck[i].e.created = s->ck[i].e.last_used = ++s->tick;
    memcpy(s->tokens, tokens, n * sizeof *tokens);
    s->n_tokens = n;
    if (nl)
        memcpy(s->logits, logits, (size_t)nl * sizeof *logits);
    s->has_logits = nl != 0; /* a prefix image (st_slot_snapshot_prefix) has none */
done:
    /* a state that failed to load is not kept (a backend may hold an error in it); checkpoint
     * buffers are plain memory, every byte of which their next use overwrites */
    if (ns)
        be->state_free(e->bctx, ns);
    if (chain)
        chain_spare(e, chain, n_chain);
    pthread_mutex_unlock(&e->lock);
    free(scratch);
    free(dg);
    free(take);
    return rc;
}

int st_slot_restore(st_slot *s, const st_image *img)
{
    return restore(s, img, NULL);
}

int st_slot_restore_adopt(st_slot *s, st_image *img)
{
    return restore(s, img, img);
}
