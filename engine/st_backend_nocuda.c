/*
 * st_backend_nocuda.c - the "cuda" backend of a build without CUDA: it exists so that the
 * backend table and its callers are the same in every build, and refuses to start.
 */
#include "st_engine_int.h"

static int nocuda_create(st_engine *e, void **bctx)
{
    (void)e;
    *bctx = NULL;
    return st_error_set(ST_EINVAL, "engine: backend \"cuda\": built without CUDA");
}

const st_backend st_backend_cuda = {
    .name = "cuda",
    .create = nocuda_create,
};
