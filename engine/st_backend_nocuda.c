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

int st_cuda_gemm_probe(st_engine *e, const void *w_dev, uint32_t rows, uint32_t cols, int immutable,
                       const float *x, uint32_t T, float *y)
{
    (void)e, (void)w_dev, (void)rows, (void)cols, (void)immutable, (void)x, (void)T, (void)y;
    return st_error_set(ST_EINVAL, "gemm probe: built without CUDA");
}

int st_cuda_pdl_flag = 0;

int st_cuda_pdl_configure(void)
{
    return 0;
}

int st_cuda_qmv_supported(uint32_t wtype)
{
    (void)wtype;
    return 0;
}

int st_cuda_qmv(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols, const float *x, float *y,
                void *stream)
{
    (void)wtype, (void)w, (void)rows, (void)cols, (void)x, (void)y, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_qmv_n(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs, uint32_t n,
                  const float *x, void *stream)
{
    (void)wtype, (void)cols, (void)jobs, (void)n, (void)x, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_qmv_swiglu_supported(uint32_t wtype)
{
    (void)wtype;
    return 0;
}

uint64_t st_cuda_qmv_swiglu_runs(void)
{
    return 0;
}

int st_cuda_qmv_swiglu(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                       const void *up, const float *x, float *y, void *stream)
{
    (void)wtype, (void)rows, (void)cols, (void)gate, (void)up, (void)x, (void)y, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_qmv_i8(uint32_t wtype, const void *w, uint32_t rows, uint32_t cols, const void *xq, float *y,
                   void *stream)
{
    (void)wtype, (void)w, (void)rows, (void)cols, (void)xq, (void)y, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_quant_q8_k(const float *x, uint32_t cols, void *xq, void *stream)
{
    (void)x, (void)cols, (void)xq, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_qmv_n_i8(uint32_t wtype, uint32_t cols, const st_cuda_qmv_job *jobs, uint32_t n,
                     const void *xq, void *stream)
{
    (void)wtype, (void)cols, (void)jobs, (void)n, (void)xq, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_qmv_swiglu_i8(uint32_t wtype, uint32_t rows, uint32_t cols, const void *gate,
                          const void *up, const void *xq, float *y, void *stream)
{
    (void)wtype, (void)rows, (void)cols, (void)gate, (void)up, (void)xq, (void)y, (void)stream;
    return st_error_set(ST_EINVAL, "cuda qmv: built without CUDA");
}

int st_cuda_dequant_supported(uint32_t type)
{
    (void)type;
    return 0;
}

int st_cuda_dequant_rows(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                         const uint32_t *rows, uint32_t r0, uint32_t n, float *dst, uint64_t ldd,
                         void *stream)
{
    (void)type, (void)w, (void)row_bytes, (void)cols, (void)rows, (void)r0, (void)n, (void)dst;
    (void)ldd, (void)stream;
    return st_error_set(ST_EINVAL, "cuda dequant: built without CUDA");
}

int st_cuda_dequant_rows_h(uint32_t type, const void *w, uint64_t row_bytes, uint32_t cols,
                           const uint32_t *rows, uint32_t r0, uint32_t n, void *dst, uint64_t ldd,
                           void *stream)
{
    (void)type, (void)w, (void)row_bytes, (void)cols, (void)rows, (void)r0, (void)n, (void)dst;
    (void)ldd, (void)stream;
    return st_error_set(ST_EINVAL, "cuda dequant: built without CUDA");
}
