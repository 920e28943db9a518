/*
 * st_layers.c - the layers architectures are composed of (st_arch_int.h): each a sequence of a
 * backend's operations (st_ops_int.h) on the caller's activations and the slot's memory. They
 * know shapes and weights, never an architecture's name or a backend's buffers.
 */
#include <math.h>

#include "st_arch_int.h"

void st_layer_embed(const st_fwd *f, const st_wmat *emb, float *x)
{
    f->ops->get_rows(f->oc, emb, f->tokens, f->T, x, f->m->hp.n_embd);
}

void st_layer_norm(const st_fwd *f, float *x, const float *add, const float *w, float *xn)
{
    f->ops->add_rmsnorm(f->oc, x, add, w, f->m->hp.n_embd, f->m->hp.rms_eps, xn, f->T);
}

void st_layer_swiglu(const st_fwd *f, const st_wmat *gate, const st_wmat *up, const st_wmat *down,
                     const float *xn, float *out, float *g, float *u)
{
    uint32_t E = f->m->hp.n_embd, F = gate->rows;
    const st_mm in[2] = {{gate, g, F}, {up, u, F}}, dn = {down, out, E};
    f->ops->matmul(f->oc, xn, E, f->T, in, 2);
    f->ops->swiglu(f->oc, g, u, F, f->T);
    f->ops->matmul(f->oc, g, F, f->T, &dn, 1);
}

void st_layer_gdn(const st_fwd *f, uint32_t il, const float *xn, float *out, const st_gdn_ws *ws)
{
    const st_layer *L = &f->m->layers[il];
    const st_mem_layer *ml = &f->m->mem.layer[il];
    const st_ops *op = f->ops;
    uint32_t H = ml->ssm_heads, dk = ml->ssm_dk, dv = ml->ssm_dv, C = ml->conv_ch;
    uint32_t E = f->m->hp.n_embd, T = f->T;
    const st_mm in[6] = {
        {&L->sq, ws->qkv, C},           {&L->sk, ws->qkv + (size_t)H * dk, C},
        {&L->sv, ws->qkv + 2 * (size_t)H * dk, C}, {&L->sgate, ws->z, H * dv},
        {&L->salpha, ws->ab, 2 * H},    {&L->sbeta, ws->ab + H, 2 * H},
    };
    op->matmul(f->oc, xn, E, T, in, 6);
    op->short_conv(f->oc, ws->qkv, ws->qkvc, C, st_recmem_conv(f->rec, ml->slot), L->conv_wT, T);
    op->l2norm(f->oc, ws->qkvc, C, H, dk, 1e-6f, 1.0f / sqrtf((float)dk), T);
    op->l2norm(f->oc, ws->qkvc + (size_t)H * dk, C, H, dk, 1e-6f, 1.0f, T);
    op->dn_gates(f->oc, ws->ab, ws->ab + H, 2 * H, L->ssm_a, L->dt_bias, H, T);
    const st_dn_args dn = {
        .state = st_recmem_ssm(f->rec, ml->slot),
        .q = ws->qkvc, .k = ws->qkvc + (size_t)H * dk, .v = ws->qkvc + 2 * (size_t)H * dk,
        .ld = C, .alpha = ws->ab, .beta = ws->ab + H, .ld_g = 2 * (size_t)H,
        .out = ws->o, .ld_out = (size_t)H * dv,
        .n_k_heads = H, .n_v_heads = H, .dk = dk, .dv = dv, .T = T,
    };
    op->delta_rule(f->oc, &dn);
    op->rmsnorm_gated(f->oc, ws->o, ws->z, L->ssm_norm, H, dv, f->m->hp.rms_eps, T);
    const st_mm o = {&L->sout, out, E};
    op->matmul(f->oc, ws->o, H * dv, T, &o, 1);
}

void st_layer_attention(const st_fwd *f, uint32_t il, const float *xn, float *out,
                        const st_attn_ws *ws)
{
    const st_layer *L = &f->m->layers[il];
    const st_mem_layer *ml = &f->m->mem.layer[il];
    const st_ops *op = f->ops;
    uint32_t hd = ml->head_dim, nkv = ml->kv_heads, nh = L->wq.rows / hd;
    uint32_t qa = nh * hd, kva = nkv * hd, ld = qa + 2 * kva;
    uint32_t E = f->m->hp.n_embd, T = f->T;
    st_kv_view kv;
    st_kvmem_view(f->kv, ml->slot, &kv);
    const st_mm in[3] = {{&L->wq, ws->qkv, ld}, {&L->wk, ws->qkv + qa, ld},
                         {&L->wv, ws->qkv + qa + kva, ld}};
    op->matmul(f->oc, xn, E, T, in, 3);
    if (L->q_norm) {
        op->rmsnorm_heads(f->oc, ws->qkv, ld, nh, hd, L->q_norm, f->m->hp.rms_eps, T);
        op->rmsnorm_heads(f->oc, ws->qkv + qa, ld, nkv, hd, L->k_norm, f->m->hp.rms_eps, T);
    }
    if (ws->neox) {
        op->rope_neox(f->oc, ws->qkv, ld, nh, hd, f->pos0, ws->rope_freq, T);
        op->rope_neox(f->oc, ws->qkv + qa, ld, nkv, hd, f->pos0, ws->rope_freq, T);
    } else {
        op->rope_norm(f->oc, ws->qkv, ld, nh, hd, f->pos0, ws->rope_freq, T);
        op->rope_norm(f->oc, ws->qkv + qa, ld, nkv, hd, f->pos0, ws->rope_freq, T);
    }
    op->kv_store(f->oc, &kv, ws->qkv + qa, ws->qkv + qa + kva, ld, f->pos0, T);
    op->attention(f->oc, &kv, ws->qkv, ld, ws->o, qa, nh, f->pos0, T);
    const st_mm o = {&L->wo, out, E};
    op->matmul(f->oc, ws->o, qa, T, &o, 1);
}

void st_layer_logits(const st_fwd *f, float *x, const float *add, const float *w,
                     const st_wmat *head, float *xn)
{
    uint32_t E = f->m->hp.n_embd;
    size_t last = (size_t)(f->T - 1) * E;
    f->ops->add_rmsnorm(f->oc, x + last, add + last, w, E, f->m->hp.rms_eps, xn, 1);
    const st_mm lm = {head, f->logits, head->rows};
    f->ops->matmul(f->oc, xn, E, 1, &lm, 1);
}
