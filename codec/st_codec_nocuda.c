/*
 * st_codec_nocuda.c - the GPU codec API in a build without CUDA (compiled only when
 * STRATA_HAVE_CUDA is OFF; st_codec_cuda.cu replaces it otherwise), so callers link either way.
 */
#include "st_codec.h"

int st_codec_cuda_available(void)
{
    st_error_set(ST_EINVAL, "codec cuda: built without CUDA");
    return 0;
}

int st_codec_cuda_convert(uint32_t dst_id, void *dst_dev, uint32_t src_id, const void *src_dev,
                          size_t n, void *stream)
{
    return st_error_set(ST_EINVAL, "codec cuda convert %s -> %s: built without CUDA",
                        st_codec_name(src_id), st_codec_name(dst_id));
}

int st_codec_cuda_sync(void *stream)
{
    return st_error_set(ST_EINVAL, "codec cuda sync: built without CUDA");
}

int st_codec_cuda_checksum_blocks(const void *src_dev, uint64_t bytes, uint64_t block,
                                  uint64_t *digests_dev, void *stream)
{
    return st_error_set(ST_EINVAL, "codec cuda checksum: built without CUDA");
}
