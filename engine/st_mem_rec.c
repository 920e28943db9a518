/*
 * st_mem_rec.c - the recurrent memory of a slot (st_engine_int.h): per recurrent layer of the
 * memory spec, its matrix and its convolution history, f32, zero when the slot starts.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine_int.h"

struct st_recmem {
    uint32_t n_layer;
    float **ssm, **conv;           /* per recurrent slot */
    uint64_t *ssm_len, *conv_len;  /* their bytes */
};

void st_recmem_free(st_recmem *r)
{
    if (!r)
        return;
    for (uint32_t i = 0; i < r->n_layer; i++) {
        if (r->ssm)
            free(r->ssm[i]);
        if (r->conv)
            free(r->conv[i]);
    }
    free(r->ssm);
    free(r->conv);
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
    r->ssm = calloc(n, sizeof *r->ssm);
    r->conv = calloc(n, sizeof *r->conv);
    r->ssm_len = calloc(n, sizeof *r->ssm_len);
    r->conv_len = calloc(n, sizeof *r->conv_len);
    int err = !r->ssm || !r->conv || !r->ssm_len || !r->conv_len;
    for (uint32_t il = 0; !err && il < ms->n_layer; il++) {
        const st_mem_layer *ml = &ms->layer[il];
        if (ml->kind != ST_MEM_REC)
            continue;
        r->ssm_len[ml->slot] = st_mem_ssm_bytes(ml);
        r->conv_len[ml->slot] = st_mem_conv_bytes(ml);
        r->ssm[ml->slot] = st_big_alloc(r->ssm_len[ml->slot]);
        r->conv[ml->slot] = st_big_alloc(r->conv_len[ml->slot]);
        if (!r->ssm[ml->slot] || !r->conv[ml->slot])
            err = 1;
    }
    if (err) {
        st_recmem_free(r);
        return st_error_set(ENOMEM, "recurrent memory");
    }
    *out = r;
    return 0;
}

void st_recmem_reset(st_recmem *r)
{
    for (uint32_t i = 0; i < r->n_layer; i++) {
        memset(r->ssm[i], 0, r->ssm_len[i]);
        memset(r->conv[i], 0, r->conv_len[i]);
    }
}

float *st_recmem_ssm(const st_recmem *r, uint32_t slot)
{
    return r->ssm[slot];
}

float *st_recmem_conv(const st_recmem *r, uint32_t slot)
{
    return r->conv[slot];
}

int st_recmem_io(st_recmem *r, uint32_t slot, uint32_t what, void *buf, uint64_t len, int write)
{
    float *p = NULL;
    uint64_t n = 0;
    if (slot < r->n_layer && what == ST_SW_SSM) {
        p = r->ssm[slot];
        n = r->ssm_len[slot];
    } else if (slot < r->n_layer && what == ST_SW_CONV) {
        p = r->conv[slot];
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
