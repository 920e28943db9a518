/*
 * st_mem_rec.c - the recurrent memory of a slot (st_engine_int.h): per recurrent layer of the
 * memory spec, its matrix and its convolution history, f32, zero when the slot starts. They live
 * in one block laid out as the fp32 checkpoint block of the published geometry (per recurrent
 * layer in layer order its ssm then conv state, then the position's 8 bytes, which this module
 * does not use), so that a restore can take an image's block instead of copying it
 * (st_recmem_exchange). The block is released with st_image_buffer_free: it may be an image's.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

struct st_recmem {
    uint32_t n_layer;
    uint8_t *blk;                  /* the block, bytes long */
    uint64_t bytes;
    uint64_t *ssm_off, *conv_off;  /* per recurrent slot: offsets in the block */
    uint64_t *ssm_len, *conv_len;  /* their bytes */
};

void st_recmem_free(st_recmem *r)
{
    if (!r)
        return;
    st_image_buffer_free(r->blk);
    free(r->ssm_off);
    free(r->conv_off);
    free(r->ssm_len);
    free(r->conv_len);
    free(r);
}

int st_recmem_new(const st_mem_spec *ms, st_recmem **out)
{
    *out = NULL;
    st_recmem *r = calloc(1, sizeof *r);
    if (!r)
        return st_error_set(ENOMEM, "recurrent memory");
    uint32_t n = ms->n_rec ? ms->n_rec : 1;
    r->n_layer = ms->n_rec;
    r->ssm_off = calloc(n, sizeof *r->ssm_off);
    r->conv_off = calloc(n, sizeof *r->conv_off);
    r->ssm_len = calloc(n, sizeof *r->ssm_len);
    r->conv_len = calloc(n, sizeof *r->conv_len);
    if (!r->ssm_off || !r->conv_off || !r->ssm_len || !r->conv_len) {
        st_recmem_free(r);
        return st_error_set(ENOMEM, "recurrent memory");
    }
    uint64_t off = 0;
    for (uint32_t il = 0; il < ms->n_layer; il++) {
        const st_mem_layer *ml = &ms->layer[il];
        if (ml->kind != ST_MEM_REC)
            continue;
        r->ssm_len[ml->slot] = st_mem_ssm_bytes(ml);
        r->conv_len[ml->slot] = st_mem_conv_bytes(ml);
        r->ssm_off[ml->slot] = off;
        off += r->ssm_len[ml->slot];
        r->conv_off[ml->slot] = off;
        off += r->conv_len[ml->slot];
    }
    r->bytes = ((off + 7) & ~(uint64_t)7) + 8; /* the position, aligned to its 8 bytes */
    if (!(r->blk = st_big_alloc(r->bytes))) {
        st_recmem_free(r);
        return st_error_set(ENOMEM, "recurrent memory");
    }
    *out = r;
    return 0;
}

void st_recmem_reset(st_recmem *r)
{
    memset(r->blk, 0, r->bytes);
}

uint8_t *st_recmem_block(const st_recmem *r, uint64_t *len)
{
    if (len)
        *len = r->bytes;
    return r->blk;
}

void st_recmem_exchange(st_recmem *r, uint8_t **blk)
{
    uint8_t *mine = r->blk;
    r->blk = *blk;
    *blk = mine;
}

float *st_recmem_ssm(const st_recmem *r, uint32_t slot)
{
    return (float *)(void *)(r->blk + r->ssm_off[slot]);
}

float *st_recmem_conv(const st_recmem *r, uint32_t slot)
{
    return (float *)(void *)(r->blk + r->conv_off[slot]);
}

int st_recmem_io(st_recmem *r, uint32_t slot, uint32_t what, void *buf, uint64_t len, int write)
{
    uint8_t *p = NULL;
    uint64_t n = 0;
    if (slot < r->n_layer && what == ST_SW_SSM) {
        p = r->blk + r->ssm_off[slot];
        n = r->ssm_len[slot];
    } else if (slot < r->n_layer && what == ST_SW_CONV) {
        p = r->blk + r->conv_off[slot];
        n = r->conv_len[slot];
    }
    if (!p || len != n)
        return st_error_set(ST_EINVAL, "recurrent memory: layer %u, kind %u, %llu bytes", slot,
                            what, (unsigned long long)len);
    if (write)
        memcpy(p, buf, len);
    else
        memcpy(buf, p, len);
    return 0;
}
