/*
 * st_layers.c - the layers architectures are composed of (st_arch_int.h): each a sequence of a
 * backend's operations (st_ops_int.h) on the caller's activations and the slot's memory. They
 * know shapes and weights, never an architecture's name or a backend's buffers.
 */
#include <math.h>
#include <stdlib.h>

#include "st_arch_int.h"

static void host_kv_view(void *mem, uint32_t slot, st_kv_view *v)
{
    st_kvmem_view(((st_fwd_host *)mem)->kv, slot, v);
}

static float *host_rec(void *mem, uint32_t slot, int conv)
{
    st_recmem *r = ((st_fwd_host *)mem)->rec;
    return conv ? st_recmem_conv(r, slot) : st_recmem_ssm(r, slot);
}

void st_fwd_host_mem(st_fwd *f, st_fwd_host *hm, st_kvmem *kv, st_recmem *rec)
{
    hm->kv = kv;
    hm->rec = rec;
    f->mem = hm;
    f->kv_view = host_kv_view;
    f->rec = host_rec;
}

float *st_ws_floats(const st_ops *ops, void *oc, uint64_t n, int *err)
{
    float *p = ops->mem_alloc(oc, (size_t)(n ? n : 1) * sizeof(float));
    if (!p)
        *err = 1;
    return p;
}

double *st_ws_doubles(const st_ops *ops, void *oc, const double *src, uint64_t n, int *err)
{
    double *p = ops->mem_alloc(oc, (size_t)(n ? n : 1) * sizeof(double));
    if (!p)
        *err = 1;
    else if (n)
        ops->upload(oc, p, src, (size_t)n * sizeof(double));
    return p;
}

void st_ws_free(const st_ops *ops, void *oc, void *p)
{
    ops->mem_free(oc, p);
}

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
    if (f->ops->matmul_swiglu) {
        f->ops->matmul_swiglu(f->oc, xn, E, f->T, in);
    } else {
        f->ops->matmul(f->oc, xn, E, f->T, in, 2);
        f->ops->swiglu(f->oc, g, u, F, f->T);
    }
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
    op->short_conv(f->oc, ws->qkv, ws->qkvc, C, f->rec(f->mem, ml->slot, 1), L->conv_wT, T);
    op->l2norm(f->oc, ws->qkvc, C, H, dk, 1e-6f, 1.0f / sqrtf((float)dk), T);
    op->l2norm(f->oc, ws->qkvc + (size_t)H * dk, C, H, dk, 1e-6f, 1.0f, T);
    op->dn_gates(f->oc, ws->ab, ws->ab + H, 2 * H, L->ssm_a, L->dt_bias, H, T);
    const st_dn_args dn = {
        .state = f->rec(f->mem, ml->slot, 0),
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
    f->kv_view(f->mem, ml->slot, &kv);
    const st_mm in[3] = {{&L->wq, ws->qkv, ld}, {&L->wk, ws->qkv + qa, ld},
                         {&L->wv, ws->qkv + qa + kva, ld}};
    op->matmul(f->oc, xn, E, T, in, 3);
    if (L->q_norm) {
        op->rmsnorm_heads(f->oc, ws->qkv, ld, nh, hd, L->q_norm, f->m->hp.rms_eps, T);
        op->rmsnorm_heads(f->oc, ws->qkv + qa, ld, nkv, hd, L->k_norm, f->m->hp.rms_eps, T);
    }
    /* q's heads and k's heads are adjacent in a token's row: one rotation over nh + nkv heads */
    if (ws->neox)
        op->rope_neox(f->oc, ws->qkv, ld, nh + nkv, hd, hd, f->pos0, ws->rope_freq, T);
    else
        op->rope_norm(f->oc, ws->qkv, ld, nh + nkv, hd, hd, f->pos0, ws->rope_freq, T);
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

/* Rows [r0, r0 + n) of w as a matrix of its own. */
static st_wmat rows_of(const st_wmat *w, uint32_t r0, uint32_t n)
{
    st_wmat v = *w;
    v.data = (const uint8_t *)w->data + (size_t)r0 * st_wmat_row_bytes(w);
    v.rows = n;
    return v;
}

void st_layer_gated_attention(const st_fwd *f, uint32_t il, const float *xn, float *out,
                              const st_gattn_ws *ws)
{
    const st_layer *L = &f->m->layers[il];
    const st_mem_layer *ml = &f->m->mem.layer[il];
    const st_ops *op = f->ops;
    uint32_t hd = ml->head_dim, nkv = ml->kv_heads, nh = L->wq.rows / (2 * hd);
    uint32_t qa = nh * hd, kva = nkv * hd, E = f->m->hp.n_embd, T = f->T;
    float eps = f->m->hp.rms_eps;
    uint32_t n = 0;
    for (uint32_t h = 0; h < nh; h++) {
        ws->views[n] = rows_of(&L->wq, 2 * h * hd, hd);
        ws->mm[n] = (st_mm){&ws->views[n], ws->q + (size_t)h * hd, qa};
        n++;
        ws->views[n] = rows_of(&L->wq, 2 * h * hd + hd, hd);
        ws->mm[n] = (st_mm){&ws->views[n], ws->gate + (size_t)h * hd, qa};
        n++;
    }
    ws->mm[n++] = (st_mm){&L->wk, ws->kv, 2 * kva};
    ws->mm[n++] = (st_mm){&L->wv, ws->kv + kva, 2 * kva};
    op->matmul(f->oc, xn, E, T, ws->mm, n);
    op->rmsnorm_heads(f->oc, ws->q, qa, nh, hd, L->q_norm, eps, T);
    op->rmsnorm_heads(f->oc, ws->kv, 2 * kva, nkv, hd, L->k_norm, eps, T);
    /* partial RoPE: the first n_rot dimensions of every head */
    op->rope_neox(f->oc, ws->q, qa, nh, hd, ws->n_rot, f->pos0, ws->rope_freq, T);
    op->rope_neox(f->oc, ws->kv, 2 * kva, nkv, hd, ws->n_rot, f->pos0, ws->rope_freq, T);
    st_kv_view kv;
    f->kv_view(f->mem, ml->slot, &kv);
    op->kv_store(f->oc, &kv, ws->kv, ws->kv + kva, 2 * kva, f->pos0, T);
    op->attention(f->oc, &kv, ws->q, qa, ws->o, qa, nh, f->pos0, T);
    op->sigmoid_mul(f->oc, ws->o, qa, ws->gate, qa, qa, T);
    const st_mm o = {&L->wo, out, E};
    op->matmul(f->oc, ws->o, qa, T, &o, 1);
}

void st_layer_gdn_fused(const st_fwd *f, uint32_t il, const float *xn, float *out,
                        const st_gdnf_ws *ws)
{
    const st_layer *L = &f->m->layers[il];
    const st_mem_layer *ml = &f->m->mem.layer[il];
    const st_ops *op = f->ops;
    uint32_t Hv = ml->ssm_heads, Hk = ws->n_k_heads, dk = ml->ssm_dk, dv = ml->ssm_dv;
    uint32_t C = ml->conv_ch, R = Hv / Hk, kd = Hk * dk, vd = Hv * dv;
    uint32_t E = f->m->hp.n_embd, T = f->T;
    float eps = f->m->hp.rms_eps;
    uint32_t n = 0;
    if (L->sin.data) {
        /* per key head kh: q_kh, k_kh, then v and z of its value heads kh R .. kh R + R - 1 */
        uint32_t g = 2 * dk + 2 * R * dv;
        for (uint32_t kh = 0; kh < Hk; kh++) {
            ws->views[n] = rows_of(&L->sin, kh * g, dk);
            ws->mm[n] = (st_mm){&ws->views[n], ws->qkv + (size_t)kh * dk, C};
            n++;
            ws->views[n] = rows_of(&L->sin, kh * g + dk, dk);
            ws->mm[n] = (st_mm){&ws->views[n], ws->qkv + kd + (size_t)kh * dk, C};
            n++;
            ws->views[n] = rows_of(&L->sin, kh * g + 2 * dk, R * dv);
            ws->mm[n] = (st_mm){&ws->views[n], ws->qkv + 2 * kd + (size_t)kh * R * dv, C};
            n++;
            ws->views[n] = rows_of(&L->sin, kh * g + 2 * dk + R * dv, R * dv);
            ws->mm[n] = (st_mm){&ws->views[n], ws->z + (size_t)kh * R * dv, vd};
            n++;
        }
    } else {
        ws->mm[n++] = (st_mm){&L->sqkv, ws->qkv, C};
        ws->mm[n++] = (st_mm){&L->sgate, ws->z, vd};
    }
    if (L->sba.data) {
        /* per key head kh: beta of its R value heads, then their alpha */
        for (uint32_t kh = 0; kh < Hk; kh++) {
            ws->views[n] = rows_of(&L->sba, 2 * kh * R, R);
            ws->mm[n] = (st_mm){&ws->views[n], ws->ab + Hv + (size_t)kh * R, 2 * Hv};
            n++;
            ws->views[n] = rows_of(&L->sba, 2 * kh * R + R, R);
            ws->mm[n] = (st_mm){&ws->views[n], ws->ab + (size_t)kh * R, 2 * Hv};
            n++;
        }
    } else {
        ws->mm[n++] = (st_mm){&L->salpha, ws->ab, 2 * Hv};
        ws->mm[n++] = (st_mm){&L->sbeta, ws->ab + Hv, 2 * Hv};
    }
    op->matmul(f->oc, xn, E, T, ws->mm, n);
    op->short_conv(f->oc, ws->qkv, ws->qkvc, C, f->rec(f->mem, ml->slot, 1), L->conv_wT, T);
    op->l2norm_max(f->oc, ws->qkvc, C, Hk, dk, eps, 1.0f / sqrtf((float)dk), T);
    op->l2norm_max(f->oc, ws->qkvc + kd, C, Hk, dk, eps, 1.0f, T);
    op->dn_gates(f->oc, ws->ab, ws->ab + Hv, 2 * Hv, L->ssm_a, L->dt_bias, Hv, T);
    const st_dn_args dn = {
        .state = f->rec(f->mem, ml->slot, 0),
        .q = ws->qkvc, .k = ws->qkvc + kd, .v = ws->qkvc + 2 * (size_t)kd,
        .ld = C, .alpha = ws->ab, .beta = ws->ab + Hv, .ld_g = 2 * (size_t)Hv,
        .out = ws->o, .ld_out = vd,
        .n_k_heads = Hk, .n_v_heads = Hv, .dk = dk, .dv = dv, .T = T, .grouped = ws->grouped,
    };
    op->delta_rule(f->oc, &dn);
    op->rmsnorm_gated(f->oc, ws->o, ws->z, L->ssm_norm, Hv, dv, eps, T);
    const st_mm o = {&L->sout, out, E};
    op->matmul(f->oc, ws->o, vd, T, &o, 1);
}

void st_layer_moe(const st_fwd *f, uint32_t il, const float *xn, float *out, const st_moe_ws *ws)
{
    const st_layer *L = &f->m->layers[il];
    const st_ops *op = f->ops;
    uint32_t E = f->m->hp.n_embd, T = f->T, X = L->moe_router.rows, k = ws->k;
    uint32_t Fe = L->moe_gate.rows / X;
    const st_mm r[2] = {{&L->moe_router, ws->logits, X}, {&L->sh_router, ws->gs, 1}};
    op->matmul(f->oc, xn, E, T, r, 2);
    st_layer_swiglu(f, &L->sh_gate, &L->sh_up, &L->sh_down, xn, out, ws->g, ws->u);
    op->sigmoid_scale(f->oc, out, E, ws->gs, 1, E, T);
    op->moe_route(f->oc, ws->logits, X, k, ws->sel, ws->w, T);
    op->download(f->oc, ws->sel_h, ws->sel, (size_t)T * k * sizeof *ws->sel);
    for (uint32_t t = 0; t < T; t++) {
        const uint32_t *sel = ws->sel_h + (size_t)t * k;
        if (f->experts && f->experts(f->mem, il, sel, k, ws->xv))
            return;
        for (uint32_t j = 0; j < k; j++) {
            uint32_t e = sel[j];
            st_wmat g, u, d;
            if (f->experts) {
                g = ws->xv[3 * j];
                u = ws->xv[3 * j + 1];
                d = ws->xv[3 * j + 2];
            } else {
                g = rows_of(&L->moe_gate, e * Fe, Fe);
                u = rows_of(&L->moe_up, e * Fe, Fe);
                d = rows_of(&L->moe_down, e * E, E);
            }
            const st_mm in[2] = {{&g, ws->g, Fe}, {&u, ws->u, Fe}}, dn = {&d, ws->y, E};
            op->matmul(f->oc, xn + (size_t)t * E, E, 1, in, 2);
            op->swiglu(f->oc, ws->g, ws->u, Fe, 1);
            op->matmul(f->oc, ws->g, Fe, 1, &dn, 1);
            op->scale_add(f->oc, out + (size_t)t * E, E, ws->y, E, ws->w + (size_t)t * k + j, 1,
                          E, 1);
        }
    }
}
