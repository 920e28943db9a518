/*
 * st_synth.c - deterministic synthetic images for demos, tests and benchmarks.
 *
 * Every row of K/V and every checkpoint tensor is generated from (seed, tensor, row/position)
 * alone, so two images made with the same prefix_seed share their first prefix_len tokens, K/V
 * rows and the checkpoints that sit inside the prefix byte for byte, whatever else differs.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_image.h"

static uint64_t mix(uint64_t x)
{
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

/* Smooth noise with magnitude scale: an AR(1) walk driven by uniform noise. */
static void fill_f32(float *dst, uint64_t n, uint64_t key, float scale)
{
    uint64_t s = mix(key);
    float v = 0.0f;
    for (uint64_t i = 0; i < n; i++) {
        s = mix(s);
        float u = (float)(int64_t)(s >> 11) * (1.0f / 9007199254740992.0f) * 2.0f - 1.0f;
        v = 0.95f * v + 0.3f * u;
        dst[i] = v * scale;
    }
}

static void fill_f16(uint16_t *dst, uint64_t n, uint64_t key, float scale)
{
    float tmp[256];
    for (uint64_t off = 0; off < n; off += 256) {
        size_t m = (size_t)(n - off < 256 ? n - off : 256);
        fill_f32(tmp, m, key ^ mix(off), scale);
        st_codec_f16_encode(dst + off, tmp, m);
    }
}

static float tensor_scale(uint32_t ti)
{
    static const float scales[] = {1.0f, 0.01f, 30.0f, 0.2f, 3.0f};
    return scales[ti % 5];
}

int st_image_synthesize(const st_synth_opts *o, st_image **out)
{
    st_synth_opts d = *o;
    if (!d.n_layers) d.n_layers = 4;
    if (!d.attn_every) d.attn_every = 4;
    if (!d.heads) d.heads = 4;
    if (!d.head_dim) d.head_dim = 32;
    if (!d.kv_heads) d.kv_heads = 2;
    if (!d.n_ctx) d.n_ctx = 4096;
    if (!d.page_size) d.page_size = 256;
    if (!d.n_vocab) d.n_vocab = 260;
    if (!d.n_tokens) d.n_tokens = 300;
    if (!d.n_checkpoints) d.n_checkpoints = 2;
    *out = NULL;
    if (d.n_tokens > d.n_ctx)
        return st_error_set(ST_EINVAL, "synth: %llu tokens exceed n_ctx %u",
                            (unsigned long long)d.n_tokens, d.n_ctx);
    if (d.n_checkpoints > d.n_tokens)
        return st_error_set(ST_EINVAL, "synth: %u checkpoints need at least as many tokens",
                            d.n_checkpoints);
    if (d.n_layers > 1000)
        return st_error_set(ST_EINVAL, "synth: %u layers is too many (max 1000)", d.n_layers);
    int rc = st_codec_check(d.codec);
    if (rc)
        return rc;

    uint32_t nt = 0, cap = 2 * d.n_layers + 1;
    st_tensor_desc *t = calloc(cap, sizeof *t);
    uint32_t *tokens = NULL;
    float *tmp = NULL;
    st_image *img = NULL;
    if (!t)
        return st_error_set(ENOMEM, "synth: no memory");
    for (uint32_t l = 0; l < d.n_layers; l++) {
        if ((l + 1) % d.attn_every == 0) {
            for (int kv = 0; kv < 2; kv++) {
                st_tensor_desc *x = &t[nt++];
                snprintf(x->name, sizeof x->name, "blk.%u.%s", l, kv ? "v" : "k");
                x->role = ST_ROLE_KV;
                x->dtype = ST_DTYPE_F16;
                x->ndim = 3;
                x->shape[0] = d.n_ctx;
                x->shape[1] = d.kv_heads;
                x->shape[2] = d.head_dim;
            }
        } else {
            st_tensor_desc *x = &t[nt++];
            snprintf(x->name, sizeof x->name, "blk.%u.ssm_state", l);
            x->role = ST_ROLE_RUNNING;
            x->dtype = ST_DTYPE_F32;
            x->ndim = 3;
            x->shape[0] = d.heads;
            x->shape[1] = d.head_dim;
            x->shape[2] = d.head_dim;
            x = &t[nt++];
            snprintf(x->name, sizeof x->name, "blk.%u.conv_state", l);
            x->role = ST_ROLE_RUNNING;
            x->dtype = ST_DTYPE_F32;
            x->ndim = 2;
            x->shape[0] = 3;
            x->shape[1] = 3ull * d.heads * d.head_dim;
        }
    }
    st_tensor_desc *pos = &t[nt++];
    snprintf(pos->name, sizeof pos->name, "pos");
    pos->role = ST_ROLE_RUNNING;
    pos->dtype = ST_DTYPE_I64;
    pos->ndim = 1;
    pos->shape[0] = 1;

    st_geometry g = {.page_size = d.page_size, .n_ctx = d.n_ctx, .n_vocab = d.n_vocab,
                     .n_tensors = nt, .tensors = t};
    for (int i = 0; i < ST_FINGERPRINT_LEN; i++)
        g.model_fp[i] = (uint8_t)(mix(0x5eed0000u + (uint64_t)i) >> 56);
    if ((rc = st_image_create(&img, &g)))
        goto fail;

    tokens = malloc(d.n_tokens * sizeof *tokens);
    tmp = malloc(d.n_vocab * sizeof *tmp);
    if (!tokens || !tmp) {
        rc = st_error_set(ENOMEM, "synth: no memory for %llu tokens", (unsigned long long)d.n_tokens);
        goto fail;
    }
    for (uint64_t i = 0; i < d.n_tokens; i++) {
        uint64_t s = i < d.prefix_len ? d.prefix_seed : d.seed;
        tokens[i] = (uint32_t)(mix(s * 1000003u + i) % 256);
    }
    if ((rc = st_image_tokens_set(img, tokens, d.n_tokens)))
        goto fail;

    for (uint32_t ti = 0; ti < nt; ti++) {
        if (t[ti].role != ST_ROLE_KV)
            continue;
        uint64_t len;
        uint8_t *kv = st_image_kv(img, ti, &len);
        uint64_t row = st_tensor_row_bytes(&t[ti]);
        for (uint64_t r = 0; r < d.n_tokens; r++) {
            uint64_t s = r < d.prefix_len ? d.prefix_seed : d.seed;
            fill_f16((uint16_t *)(kv + r * row), row / 2, mix(s ^ mix(ti * 7919u + r)),
                     tensor_scale(ti));
        }
    }

    for (uint32_t c = 0; c < d.n_checkpoints; c++) {
        uint64_t p = d.n_tokens * (c + 1) / d.n_checkpoints;
        uint32_t ci;
        if ((rc = st_image_checkpoint_add(img, p, ST_CODEC_FP32, &ci)))
            goto fail;
        uint64_t s = p <= d.prefix_len ? d.prefix_seed : d.seed;
        for (uint32_t ti = 0; ti < nt; ti++) {
            if (t[ti].role != ST_ROLE_RUNNING)
                continue;
            uint64_t len;
            void *x = st_image_checkpoint_tensor(img, ci, ti, &len);
            if (t[ti].dtype == ST_DTYPE_I64) {
                int64_t v = (int64_t)p;
                memcpy(x, &v, sizeof v);
            } else {
                fill_f32(x, len / 4, mix(s ^ mix(ti * 104729u + p)), tensor_scale(ti));
            }
        }
    }
    if (d.codec != ST_CODEC_FP32) {
        void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
        if (!scratch) {
            rc = st_error_set(ENOMEM, "synth: no memory for scratch");
            goto fail;
        }
        for (uint32_t c = 0; c < d.n_checkpoints && !rc; c++)
            rc = st_image_checkpoint_recode(img, c, d.codec, scratch, ST_CODEC_SCRATCH_MAX);
        free(scratch);
        if (rc)
            goto fail;
    }
    fill_f32(tmp, d.n_vocab, mix(d.seed ^ 0x10517u), 5.0f);
    if ((rc = st_image_logits_set(img, tmp, d.n_vocab)))
        goto fail;
    /* the state hash a restore of this image finds: stores refuse images whose hash is wrong */
    uint64_t h = 0;
    if ((rc = st_image_state_hash_compute(img, NULL, NULL, &h)))
        goto fail;
    st_image_state_hash_set(img, h);
    free(t);
    free(tokens);
    free(tmp);
    *out = img;
    return 0;
fail:
    st_image_free(img);
    free(t);
    free(tokens);
    free(tmp);
    return rc;
}
