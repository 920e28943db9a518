/*
 * st_arch_int.h - what an architecture is to the engine: a descriptor (st_arch) that reads its
 * hyperparameters, lists its tensors, says what memory each layer keeps, feeds the fingerprint,
 * and writes its seeded model.
 * One file per architecture under engine/arch/; st_model.c walks the descriptor and knows no
 * architecture. Nothing outside engine/ and tests/engine/ includes this header.
 */
#ifndef ST_ARCH_INT_H
#define ST_ARCH_INT_H

#include <stddef.h>
#include <stdint.h>

#include "st_engine_int.h"

/* ---- the tensor list ----------------------------------------------------------------------
 * One entry per GGUF tensor, in file order. The loader checks name, type and shape, then binds
 * the data to the field at `field` of the st_layer of `layer` (or of the st_model when layer is
 * -1): a matrix (st_wmat, in the mapping) or a vector (an owned f32 copy, float *). */
typedef enum st_tinit {
    ST_TI_EMB,     /* uniform [-1, 1) */
    ST_TI_ONES,    /* 1 */
    ST_TI_MAT,     /* uniform, scaled by sqrt(3 / fan-in) */
    ST_TI_MAT_OUT, /* as ST_TI_MAT, also by 1 / sqrt(2 n_layer): a residual branch's output */
    ST_TI_CONV,    /* uniform [-0.5, 0.5) */
    ST_TI_ALOG,    /* log(1 + 15 u), u uniform in [0, 1): a DeltaNet A_log */
    ST_TI_DTBIAS,  /* softplus^-1(dt), dt log-uniform in [1e-3, 1e-1] */
} st_tinit;

typedef struct st_tdesc {
    char name[64];
    uint32_t nd;
    uint64_t dims[2]; /* ne0 (cols / length), ne1 (rows) */
    int matrix;       /* stored in the weight type (st_wmat); else an f32 vector */
    int init;         /* st_tinit: how the seeded writer draws it */
    int32_t layer;    /* -1: a field of st_model */
    uint32_t field;   /* offsetof the st_wmat / float * it binds to */
} st_tdesc;

typedef struct st_tlist {
    st_tdesc *t;
    size_t n, cap;
    int err;
} st_tlist;

/* Append an entry (a failed allocation is remembered in l->err; st_tlist_done reports it). */
void st_tlist_add(st_tlist *l, int32_t layer, uint32_t field, int matrix, int init, uint64_t ne0,
                  uint64_t ne1, const char *fmt, ...) __attribute__((format(printf, 8, 9)));
/* 0, or ENOMEM (the list freed) when an add failed. */
int st_tlist_done(st_tlist *l);

/* ---- the fingerprint's inputs --------------------------------------------------------------
 * An architecture hashes its tag and its hyperparameters in a fixed order; st_model.c then adds
 * every listed tensor (name, type, dimensions, data). */
typedef struct st_fp st_fp;
void st_fp_bytes(st_fp *fp, const void *p, size_t n);
void st_fp_u32(st_fp *fp, uint32_t v); /* little-endian */
void st_fp_f32(st_fp *fp, float f);    /* its bits, little-endian */

/* ---- the descriptor ------------------------------------------------------------------------ */
typedef struct st_arch {
    const char *name; /* general.architecture */
    /* Fill hp with a named preset (ST_EINVAL naming the presets otherwise). */
    int (*preset)(const char *name, st_model_hparams *hp);
    /* Structural check of hyperparameters (ranges, divisibility, layer kinds). */
    int (*check)(const st_model_hparams *hp);
    /* Hyperparameters from the GGUF keys (checked). */
    int (*read)(const st_gguf *g, st_model_hparams *hp);
    /* The keys of a seeded model after general.* (architecture, name, description, seed). */
    int (*write_keys)(st_gguf_writer *w, const st_model_hparams *hp);
    /* The tensor list of this geometry. */
    int (*tensors)(const st_model_hparams *hp, st_tlist *l);
    /* What layer il keeps (slot not set: st_mem_spec_build counts). */
    void (*memory)(const st_model_hparams *hp, uint32_t il, st_mem_layer *ml);
    /* Tag and hyperparameters into the fingerprint. */
    void (*fingerprint)(const st_model_hparams *hp, st_fp *fp);
    /* After every tensor is bound: derived constant data, owned by the layers (st_model_free). */
    int (*prepare)(st_model *m);
} st_arch;

extern const st_arch st_arch_hybrid;

/* The architecture of that general.architecture name, or NULL. */
const st_arch *st_arch_find(const char *name, size_t len);

#endif /* ST_ARCH_INT_H */
