/*
 * st_state_layout.c - the geometry tensors every backend publishes (st_engine_int.h), made from
 * the memory spec alone: one definition, so that the CPU and CUDA backends cannot drift apart.
 * Also the sizes of the memory a spec describes.
 */
#include <stdio.h>
#include <string.h>

#include "st_engine_int.h"

uint64_t st_mem_kv_row_bytes(const st_mem_layer *ml, uint32_t kv_dtype)
{
    return (uint64_t)ml->kv_heads * ml->head_dim *
           (kv_dtype == ST_DTYPE_I8 ? 1 : kv_dtype == ST_DTYPE_F32 ? 4 : 2);
}

uint64_t st_mem_kv_scale_bytes(const st_mem_layer *ml, uint32_t kv_dtype)
{
    return kv_dtype == ST_DTYPE_I8 ? 4ull * ml->kv_heads : 0;
}

uint64_t st_mem_ssm_bytes(const st_mem_layer *ml)
{
    return 4ull * ml->ssm_heads * ml->ssm_dk * ml->ssm_dv;
}

uint64_t st_mem_conv_bytes(const st_mem_layer *ml)
{
    return 4ull * ml->conv_len * ml->conv_ch;
}

static void put(st_tensor_desc *d, st_state_map *mp, uint32_t layer, uint32_t slot, uint32_t what,
                const char *name, uint32_t role, uint32_t dtype, uint32_t ndim, uint64_t d0,
                uint64_t d1, uint64_t d2)
{
    memset(d, 0, sizeof *d);
    snprintf(d->name, sizeof d->name, "%s", name);
    d->role = role;
    d->dtype = dtype;
    d->ndim = ndim;
    d->shape[0] = d0;
    d->shape[1] = ndim > 1 ? d1 : 0;
    d->shape[2] = ndim > 2 ? d2 : 0;
    *mp = (st_state_map){layer, slot, what};
}

uint32_t st_state_layout(const st_mem_spec *ms, uint32_t n_ctx, uint32_t kv_dtype,
                         st_tensor_desc *descs, st_state_map *map)
{
    uint32_t n = 0;
    char nm[ST_TENSOR_NAME_MAX];
    for (uint32_t il = 0; il < ms->n_layer; il++) {
        const st_mem_layer *ml = &ms->layer[il];
        if (ml->kind == ST_MEM_REC) {
            snprintf(nm, sizeof nm, "blk.%u.ssm_state", il);
            put(&descs[n], &map[n], il, ml->slot, ST_SW_SSM, nm, ST_ROLE_RUNNING, ST_DTYPE_F32, 3,
                ml->ssm_heads, ml->ssm_dk, ml->ssm_dv);
            n++;
            snprintf(nm, sizeof nm, "blk.%u.conv_state", il);
            put(&descs[n], &map[n], il, ml->slot, ST_SW_CONV, nm, ST_ROLE_RUNNING, ST_DTYPE_F32, 2,
                ml->conv_len, ml->conv_ch, 0);
            n++;
            continue;
        }
        if (ml->kind != ST_MEM_KV)
            continue;
        static const char *const kv_names[4] = {"k", "v", "k_scale", "v_scale"};
        static const uint32_t kv_what[4] = {ST_SW_K, ST_SW_V, ST_SW_KS, ST_SW_VS};
        for (int k = 0; k < (kv_dtype == ST_DTYPE_I8 ? 4 : 2); k++) {
            snprintf(nm, sizeof nm, "blk.%u.%s", il, kv_names[k]);
            if (k < 2)
                put(&descs[n], &map[n], il, ml->slot, kv_what[k], nm, ST_ROLE_KV, kv_dtype, 3,
                    n_ctx, ml->kv_heads, ml->head_dim);
            else
                put(&descs[n], &map[n], il, ml->slot, kv_what[k], nm, ST_ROLE_KV, ST_DTYPE_F32, 2,
                    n_ctx, ml->kv_heads, 0);
            n++;
        }
    }
    put(&descs[n], &map[n], 0, 0, ST_SW_POS, "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    n++;
    return n;
}
