/*
 * fuzz_gguf.c - libFuzzer target for the GGUF reader (st_gguf_open_mem), which every model file
 * goes through before anything else reads it.
 *
 * Properties checked on every input:
 * 1. A refused input ends in a typed error with a detail, and no handle.
 * 2. An accepted input is consistent: every key has a name and is found under it (the first of
 *    its name), its typed getters either answer or refuse with a typed error; every tensor's
 *    data lies inside the input, its bytes within the input too, and it is found by its name.
 */
#include <errno.h>
#include <string.h>

#include "st_engine.h"
#include "st_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_gguf *g = NULL;
    int rc = st_gguf_open_mem(data, size, &g);
    if (rc != 0) {
        st_fuzz_require(g == NULL, "a handle after an error");
        st_fuzz_require(st_fuzz_typed(rc), "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
        return 0;
    }
    uint64_t n_kv = st_gguf_n_kv(g), n_t = st_gguf_n_tensors(g);
    st_fuzz_require(n_kv <= size && n_t <= size, "more keys or tensors than input bytes");
    for (uint64_t i = 0; i < n_kv; i++) {
        const char *key = st_gguf_kv_key(g, i);
        uint32_t elem = 0;
        uint64_t count = 0;
        st_fuzz_require(key != NULL, "a key without a name");
        int64_t at = st_gguf_find(g, key);
        st_fuzz_require(at >= 0 && (uint64_t)at <= i, "a key not found under its name");
        (void)st_gguf_kv_type(g, i, &elem, &count);
        uint32_t u32;
        uint64_t u64, len;
        float f;
        const char *s;
        int r1 = st_gguf_get_u32(g, key, &u32), r2 = st_gguf_get_u64(g, key, &u64);
        int r3 = st_gguf_get_f32(g, key, &f), r4 = st_gguf_get_str(g, key, &s, &len);
        st_fuzz_require((r1 == 0 || st_fuzz_typed(r1)) && (r2 == 0 || st_fuzz_typed(r2)) &&
                            (r3 == 0 || st_fuzz_typed(r3)) && (r4 == 0 || st_fuzz_typed(r4)),
                        "a getter's untyped error");
        if (r4 == 0)
            st_fuzz_require((const uint8_t *)s >= data && len <= size &&
                                (size_t)((const uint8_t *)s - data) <= size - len,
                            "a string outside the input");
    }
    for (uint64_t i = 0; i < n_t; i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        st_fuzz_require(t != NULL && t->name != NULL, "a tensor without a name");
        st_fuzz_require(t->n_dims >= 1 && t->n_dims <= ST_GGUF_MAX_DIMS, "a tensor's dimensions");
        const uint8_t *p = t->data;
        st_fuzz_require(p >= data && t->nbytes <= size && (size_t)(p - data) <= size - t->nbytes,
                        "tensor data outside the input");
        (void)st_checksum(p, t->nbytes); /* every byte is read: ASan sees any outside */
        const st_gguf_tensor *by_name = st_gguf_tensor_find(g, t->name);
        st_fuzz_require(by_name != NULL, "a tensor not found by its name");
    }
    st_gguf_close(g);
    return 0;
}
