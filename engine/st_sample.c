/*
 * st_sample.c - sampling with top-k, top-p and min-p (st_slot_sample_with, st_engine.h) on the
 * logits a slot holds. The filters choose which tokens may be drawn; the draw itself is
 * st_slot_sample's: a softmax at the temperature accumulated in id order against one uniform
 * number keyed by (seed, position), so with no filter the two pick the same token.
 */
#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "st_engine.h"

static uint64_t mix64(uint64_t z) /* st_slot.c's generator */
{
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static _Thread_local const float *tl_logits; /* the comparison's logits (qsort has no context) */

static int by_logit(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    float lx = tl_logits[x], ly = tl_logits[y];
    if (lx != ly)
        return lx > ly ? -1 : 1;
    return x < y ? -1 : x > y;
}

int st_slot_sample_with(const st_slot *s, const st_sample_params *p, uint64_t seed,
                        uint32_t *token)
{
    if (!(p->top_p > 0.0f && p->top_p <= 1.0f))
        return st_error_set(ST_EINVAL, "sample: top_p must be in (0, 1]");
    if (!(p->min_p >= 0.0f && p->min_p <= 1.0f))
        return st_error_set(ST_EINVAL, "sample: min_p must be in [0, 1]");
    uint32_t V = 0;
    const float *l = st_slot_logits(s, &V);
    int filtered = p->top_k > 0 || p->top_p < 1.0f || p->min_p > 0.0f;
    if (!l || !filtered || !(p->temp > 0.0f) || !isfinite(p->temp))
        return st_slot_sample(s, p->temp, seed, token); /* the filters always keep the best */
    uint32_t *idx = malloc((size_t)V * sizeof *idx);
    unsigned char *keep = calloc(V, 1);
    if (!idx || !keep) {
        free(idx);
        free(keep);
        return st_error_set(ENOMEM, "sample: no memory");
    }
    uint32_t n = 0;
    for (uint32_t i = 0; i < V; i++)
        if (isfinite(l[i]))
            idx[n++] = i;
    if (n == 0) {
        free(idx);
        free(keep);
        return st_slot_sample(s, p->temp, seed, token);
    }
    tl_logits = l;
    qsort(idx, n, sizeof *idx, by_logit);
    double m = l[idx[0]];
    uint32_t k = p->top_k > 0 && p->top_k < n ? p->top_k : n;
    if (p->top_p < 1.0f) {
        double z = 0.0, acc = 0.0;
        for (uint32_t i = 0; i < k; i++)
            z += exp((double)l[idx[i]] - m);
        uint32_t cut = k;
        for (uint32_t i = 0; i < k; i++) {
            acc += exp((double)l[idx[i]] - m) / z;
            if (acc >= p->top_p) {
                cut = i + 1;
                break;
            }
        }
        k = cut;
    }
    if (p->min_p > 0.0f) { /* p(x) >= min_p * p(best), i.e. exp(l - m) >= min_p */
        uint32_t cut = 1;
        while (cut < k && exp((double)l[idx[cut]] - m) >= p->min_p)
            cut++;
        k = cut;
    }
    for (uint32_t i = 0; i < k; i++)
        keep[idx[i]] = 1;
    *token = idx[0];
    double sum = 0.0;
    for (uint32_t i = 0; i < V; i++)
        if (keep[i])
            sum += exp(((double)l[i] - m) / p->temp);
    double u = (double)(mix64(mix64(seed) ^ st_slot_n_tokens(s)) >> 11) * 0x1p-53 * sum, acc = 0.0;
    for (uint32_t i = 0; i < V; i++) {
        if (!keep[i])
            continue;
        acc += exp(((double)l[i] - m) / p->temp);
        if (acc > u) {
            *token = i;
            break;
        }
    }
    free(idx);
    free(keep);
    return 0;
}
