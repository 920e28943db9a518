/*
 * test_image.c - the image API and the geometry helpers.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "st_file.h"
#include "st_test_image.h"

static void desc(st_tensor_desc *t, const char *name, uint32_t role, uint32_t dtype, uint32_t ndim,
                 uint64_t d0, uint64_t d1, uint64_t d2)
{
    memset(t, 0, sizeof *t);
    strcpy(t->name, name);
    t->role = role;
    t->dtype = dtype;
    t->ndim = ndim;
    t->shape[0] = d0;
    t->shape[1] = ndim > 1 ? d1 : 0;
    t->shape[2] = ndim > 2 ? d2 : 0;
}

/* page_size 4, n_ctx 32, n_vocab 16, seven tensors */
static void small_geometry(st_geometry *g, st_tensor_desc t[7])
{
    memset(g, 0, sizeof *g);
    for (int i = 0; i < ST_FINGERPRINT_LEN; i++)
        g->model_fp[i] = (uint8_t)(i * 37 + 1);
    g->page_size = 4;
    g->n_ctx = 32;
    g->n_vocab = 16;
    g->n_tensors = 7;
    desc(&t[0], "attn.0.k", ST_ROLE_KV, ST_DTYPE_F16, 3, 32, 2, 8);
    desc(&t[1], "ssm.0.state", ST_ROLE_RUNNING, ST_DTYPE_F32, 3, 2, 16, 16);
    desc(&t[2], "attn.0.v", ST_ROLE_KV, ST_DTYPE_F16, 3, 32, 2, 8);
    desc(&t[3], "ssm.0.conv", ST_ROLE_RUNNING, ST_DTYPE_F32, 2, 3, 32, 0);
    desc(&t[4], "attn.1.kq", ST_ROLE_KV, ST_DTYPE_I8, 2, 32, 16, 0);
    desc(&t[5], "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    desc(&t[6], "ssm.0.gate", ST_ROLE_RUNNING, ST_DTYPE_BF16, 1, 8, 0, 0);
    g->tensors = t;
}

static void test_dtype_helpers(void **state)
{
    (void)state;
    assert_string_equal(st_dtype_name(ST_DTYPE_F32), "f32");
    assert_string_equal(st_dtype_name(ST_DTYPE_BF16), "bf16");
    assert_string_equal(st_dtype_name(ST_DTYPE_I64), "i64");
    assert_string_equal(st_dtype_name(99), "unknown");
    assert_int_equal(st_dtype_size(ST_DTYPE_F32), 4);
    assert_int_equal(st_dtype_size(ST_DTYPE_F16), 2);
    assert_int_equal(st_dtype_size(ST_DTYPE_I8), 1);
    assert_int_equal(st_dtype_size(ST_DTYPE_I64), 8);
    assert_int_equal(st_dtype_size(ST_DTYPE_COUNT), 0);

    st_tensor_desc t = {.name = "x", .role = ST_ROLE_RUNNING, .dtype = ST_DTYPE_F32, .ndim = 3,
                        .shape = {2, 3, 5, 0}};
    assert_int_equal(st_tensor_elems(&t), 30);
    assert_int_equal(st_tensor_stored_bytes(&t, ST_CODEC_FP32), 120);
    assert_int_equal(st_tensor_stored_bytes(&t, ST_CODEC_BF16), 60);
    assert_int_equal(st_tensor_stored_bytes(&t, ST_CODEC_F16), 60);
    t.dtype = ST_DTYPE_I32; /* other dtypes stored unchanged whatever the codec */
    assert_int_equal(st_tensor_stored_bytes(&t, ST_CODEC_BF16), 120);
    t.dtype = ST_DTYPE_F16;
    assert_int_equal(st_tensor_row_bytes(&t), 30);
    t.ndim = 1;
    t.shape[1] = t.shape[2] = 0;
    assert_int_equal(st_tensor_row_bytes(&t), 2);
}

static void test_geometry_check(void **state)
{
    st_tensor_desc t[7];
    st_geometry g;
    (void)state;

    small_geometry(&g, t);
    assert_int_equal(st_geometry_check(&g), 0);

    small_geometry(&g, t);
    g.page_size = 0;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    g.n_ctx = 0;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);

    small_geometry(&g, t);
    strcpy(t[3].name, "attn.0.k"); /* duplicate of tensor 0 */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "already used"));

    small_geometry(&g, t);
    t[2].name[0] = '\0';
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[2].name[3] = '\n';
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "printable"));
    small_geometry(&g, t);
    memset(t[2].name, 'a', ST_TENSOR_NAME_MAX); /* no NUL within 48 */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);

    small_geometry(&g, t);
    t[1].role = 2;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[1].dtype = ST_DTYPE_COUNT;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[1].ndim = 0;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[1].ndim = 5;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[1].shape[1] = 0; /* used dim of 0 */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[5].shape[3] = 1; /* unused dim not 0 */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    small_geometry(&g, t);
    t[0].shape[0] = 31; /* K/V must span n_ctx */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "n_ctx"));

    small_geometry(&g, t);
    t[1].shape[0] = t[1].shape[1] = t[1].shape[2] = 1ull << 30; /* 2^90 elements */
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "overflow"));
    small_geometry(&g, t);
    t[1].shape[0] = 1ull << 62; /* fits in u64 elements, bytes overflow */
    t[1].ndim = 1;
    t[1].shape[1] = t[1].shape[2] = 0;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);

    small_geometry(&g, t);
    g.n_tensors = ST_GEOMETRY_TENSORS_MAX + 1;
    assert_int_equal(st_geometry_check(&g), ST_EGEOMETRY);

    /* no tensors at all is a valid (if useless) geometry */
    small_geometry(&g, t);
    g.n_tensors = 0;
    g.tensors = NULL;
    assert_int_equal(st_geometry_check(&g), 0);
    assert_int_equal(st_geometry_check(NULL), ST_EINVAL);
}

static void test_geometry_compare(void **state)
{
    st_tensor_desc ta[7], tb[7];
    st_geometry a, b;
    (void)state;

    small_geometry(&a, ta);
    small_geometry(&b, tb);
    assert_int_equal(st_geometry_compare(&a, &b), 0);

    b.page_size = 256;
    a.page_size = 1;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EGEOMETRY);
    assert_string_equal(st_errdetail(), "incompatible K/V geometry: page_size 1 vs 256");

    small_geometry(&a, ta);
    small_geometry(&b, tb);
    a.model_fp[0] = 0x3f;
    a.model_fp[1] = 0x2a;
    b.model_fp[0] = 0x9c;
    b.model_fp[1] = 0x1b;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EMODEL);
    assert_non_null(strstr(st_errdetail(), "model fingerprint 3f2a"));
    assert_non_null(strstr(st_errdetail(), " vs 9c1b"));

    small_geometry(&a, ta);
    small_geometry(&b, tb);
    tb[3].dtype = ST_DTYPE_BF16;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "ssm.0.conv"));
    assert_non_null(strstr(st_errdetail(), "f32 vs bf16"));

    small_geometry(&b, tb);
    tb[2].shape[2] = 16;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "[32,2,8] vs [32,2,16]"));

    small_geometry(&b, tb);
    b.n_tensors = 6;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "7 tensors vs 6"));

    small_geometry(&b, tb);
    b.n_ctx = 64;
    assert_int_equal(st_geometry_compare(&a, &b), ST_EGEOMETRY);
    assert_non_null(strstr(st_errdetail(), "n_ctx 32 vs 64"));
}

static void test_image_build(void **state)
{
    st_tensor_desc t[7];
    st_geometry g;
    st_image *img = NULL;
    uint32_t tokens[20];
    uint64_t len;
    (void)state;

    small_geometry(&g, t);
    t[1].name[20] = 'x'; /* garbage after the NUL: ignored and zeroed in the image's copy */
    assert_int_equal(st_image_create(&img, &g), 0);
    assert_int_equal(st_image_geometry(img)->tensors[1].name[20], 0);
    assert_ptr_not_equal(st_image_geometry(img)->tensors, t);
    memset(t, 0xee, sizeof t); /* the image keeps its own copy */
    small_geometry(&g, t);
    assert_int_equal(st_geometry_compare(st_image_geometry(img), &g), 0);

    assert_int_equal(st_image_n_tokens(img), 0);
    assert_int_equal(st_image_n_checkpoints(img), 0);
    assert_int_equal(st_image_kv_pages(img), 0);
    assert_non_null(st_image_kv(img, 0, &len));
    assert_int_equal(len, 0);
    assert_null(st_image_kv(img, 1, &len)); /* running tensor */
    assert_null(st_image_kv(img, 7, &len));
    assert_int_equal(st_image_check(img), ST_EINVAL); /* no checkpoint */

    for (uint32_t i = 0; i < 20; i++)
        tokens[i] = 1000 + i;
    assert_int_equal(st_image_tokens_set(img, tokens, 33), ST_EINVAL); /* > n_ctx */
    assert_int_equal(st_image_tokens_set(img, NULL, 3), ST_EINVAL);
    assert_int_equal(st_image_tokens_set(img, tokens, 10), 0);
    assert_int_equal(st_image_n_tokens(img), 10);
    assert_int_equal(st_image_tokens(img)[9], 1009);
    assert_int_equal(st_image_kv_pages(img), 3); /* page_size 4 */
    uint8_t *k = st_image_kv(img, 0, &len);
    assert_int_equal(len, 10 * 2 * 8 * 2);
    for (uint64_t i = 0; i < len; i++)
        assert_int_equal(k[i], 0); /* new rows are zero */
    for (uint64_t i = 0; i < len; i++)
        k[i] = (uint8_t)(i * 7 + 1);
    k = st_image_kv(img, 4, &len);
    assert_int_equal(len, 10 * 16);

    /* grow: old rows kept, new rows zero */
    assert_int_equal(st_image_tokens_set(img, tokens, 16), 0);
    k = st_image_kv(img, 0, &len);
    assert_int_equal(len, 16 * 32);
    for (uint64_t i = 0; i < 10 * 32; i++)
        assert_int_equal(k[i], (uint8_t)(i * 7 + 1));
    for (uint64_t i = 10 * 32; i < len; i++)
        assert_int_equal(k[i], 0);
    /* shrink: kept prefix */
    assert_int_equal(st_image_tokens_set(img, tokens, 4), 0);
    k = st_image_kv(img, 0, &len);
    assert_int_equal(len, 4 * 32);
    for (uint64_t i = 0; i < len; i++)
        assert_int_equal(k[i], (uint8_t)(i * 7 + 1));
    assert_int_equal(st_image_tokens_set(img, NULL, 0), 0);
    assert_int_equal(st_image_kv_pages(img), 0);
    assert_int_equal(st_image_tokens_set(img, tokens, 12), 0);

    /* checkpoints: strictly increasing, zeroed, sized by codec */
    uint32_t ci = 99;
    assert_int_equal(st_image_checkpoint_add(img, 4, ST_CODEC_FP32, &ci), 0);
    assert_int_equal(ci, 0);
    assert_int_equal(st_image_checkpoint_add(img, 4, ST_CODEC_FP32, &ci), ST_EINVAL);
    assert_int_equal(st_image_checkpoint_add(img, 3, ST_CODEC_FP32, &ci), ST_EINVAL);
    assert_int_equal(st_image_checkpoint_add(img, 33, ST_CODEC_FP32, &ci), ST_EINVAL);
    assert_int_equal(st_image_checkpoint_add(img, 8, 7, &ci), ST_ECODEC);
    assert_int_equal(st_image_checkpoint_add(img, 8, ST_CODEC_BF16, &ci), 0);
    assert_int_equal(ci, 1);
    assert_int_equal(st_image_n_checkpoints(img), 2);
    uint8_t *x = st_image_checkpoint_tensor(img, 1, 1, &len);
    assert_non_null(x);
    assert_int_equal(len, 512 * 2);
    for (uint64_t i = 0; i < len; i++)
        assert_int_equal(x[i], 0);
    assert_non_null(st_image_checkpoint_tensor(img, 1, 5, &len));
    assert_int_equal(len, 8); /* i64 unchanged */
    assert_non_null(st_image_checkpoint_tensor(img, 1, 6, &len));
    assert_int_equal(len, 16); /* bf16 dtype, 8 elements */
    assert_null(st_image_checkpoint_tensor(img, 1, 0, &len)); /* K/V */
    assert_null(st_image_checkpoint_tensor(img, 2, 1, &len));
    uint64_t pos;
    uint32_t codec;
    assert_int_equal(st_image_checkpoint_info(img, 1, &pos, &codec), 0);
    assert_int_equal(pos, 8);
    assert_int_equal(codec, ST_CODEC_BF16);
    assert_int_equal(st_image_checkpoint_info(img, 2, &pos, &codec), ST_ENOTFOUND);

    /* incomplete until the last checkpoint sits at n_tokens */
    assert_int_equal(st_image_check(img), ST_EINVAL);
    assert_int_equal(st_image_checkpoint_add(img, 12, ST_CODEC_F16, &ci), 0);
    assert_int_equal(st_image_check(img), 0);

    /* logits */
    float logits[16] = {1.5f};
    uint32_t nl;
    assert_int_equal(st_image_logits_set(img, logits, 15), ST_EINVAL);
    assert_null(st_image_logits(img, &nl));
    assert_int_equal(nl, 0);
    assert_int_equal(st_image_logits_set(img, logits, 16), 0);
    assert_true(st_image_logits(img, &nl)[0] == 1.5f);
    assert_int_equal(nl, 16);
    assert_int_equal(st_image_check(img), 0);

    st_image_state_hash_set(img, 0x1234);
    assert_int_equal(st_image_state_hash(img), 0x1234);

    uint64_t want = 12 * 4 + 16 * 4 + 12 * (32 + 32 + 16) + (2048 + 384 + 8 + 16) +
                    (1024 + 192 + 8 + 16) * 2;
    assert_int_equal(st_image_bytes(img), want);

    /* remove the middle checkpoint */
    assert_int_equal(st_image_checkpoint_remove(img, 1), 0);
    assert_int_equal(st_image_n_checkpoints(img), 2);
    assert_int_equal(st_image_checkpoint_info(img, 1, &pos, &codec), 0);
    assert_int_equal(pos, 12);
    assert_int_equal(codec, ST_CODEC_F16);
    assert_int_equal(st_image_checkpoint_remove(img, 2), ST_ENOTFOUND);
    assert_int_equal(st_image_check(img), 0);

    st_image_free(img);
    st_image_free(NULL);
}

static void test_image_clone(void **state)
{
    static const uint32_t codecs[3] = {ST_CODEC_F16, ST_CODEC_FP32, ST_CODEC_BF16};
    st_image *a = NULL, *b = NULL;
    (void)state;

    assert_int_equal(st_test_image_small(&a, 42, codecs), 0);
    assert_int_equal(st_image_check(a), 0);
    assert_int_equal(st_image_clone(&b, a), 0);
    assert_int_equal(st_test_image_equal(a, b), 0);
    /* deep: changing the clone leaves the original */
    uint64_t len;
    uint8_t *p = st_image_checkpoint_tensor(b, 2, 1, &len);
    p[0] ^= 1;
    assert_int_not_equal(st_test_image_equal(a, b), 0);
    st_image_free(a);
    st_image_free(b);
}

/* Shared checkpoint blocks: a reference put into another image shares the bytes; a write through
 * either image's mutable accessor gives that image a copy first, so every other holder keeps the
 * bytes it had; a block of another codec's size is refused and changes nothing; removing, recoding
 * or freeing an image drops only its reference (the last one frees: ASan / LSan). */
static void test_image_shared_block(void **state)
{
    static const uint32_t codecs[3] = {ST_CODEC_F16, ST_CODEC_FP32, ST_CODEC_BF16};
    static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
    st_image *a = NULL, *ref = NULL, *c = NULL, *d = NULL;
    uint64_t pos0, pos1, len;
    uint32_t codec0, codec1, ci = 99;
    (void)state;

    assert_int_equal(st_test_image_small(&a, 42, codecs), 0);
    assert_int_equal(st_test_image_small(&ref, 42, codecs), 0);
    assert_null(st_image_checkpoint_share(a, 3));
    st_image_block *b0 = st_image_checkpoint_share(a, 0), *b1 = st_image_checkpoint_share(a, 1);
    assert_non_null(b0);
    assert_non_null(b1);
    assert_int_equal(st_image_checkpoint_info(a, 0, &pos0, &codec0), 0);
    assert_int_equal(st_image_checkpoint_info(a, 1, &pos1, &codec1), 0);
    assert_int_equal(st_image_create(&c, st_image_geometry(a)), 0);
    assert_int_equal(st_image_tokens_set(c, st_image_tokens(a), st_image_n_tokens(a)), 0);
    /* an f16 block as an fp32 checkpoint: refused, nothing added */
    assert_int_equal(st_image_checkpoint_add_shared(c, pos0, ST_CODEC_FP32, b0, &ci), ST_EINVAL);
    assert_int_equal(st_image_n_checkpoints(c), 0);
    assert_int_equal(st_image_checkpoint_add_shared(c, pos0, codec0, b0, &ci), 0);
    assert_int_equal(ci, 0);
    assert_int_equal(st_image_checkpoint_add_shared(c, pos1, codec1, b1, &ci), 0);
    assert_ptr_equal(st_image_checkpoint_tensor_const(c, 0, 1, &len),
                     st_image_checkpoint_tensor_const(a, 0, 1, &len));
    /* written through c: c's own copy; a unchanged */
    uint8_t *p = st_image_checkpoint_tensor(c, 0, 1, &len);
    assert_non_null(p);
    assert_ptr_not_equal(p, st_image_checkpoint_tensor_const(a, 0, 1, &len));
    p[0] ^= 1;
    assert_int_equal(st_test_image_equal(a, ref), 0);
    /* written through a (b0 still referenced): a's own copy, and b0 keeps the old bytes */
    p = st_image_checkpoint_tensor(a, 0, 1, &len);
    p[0] ^= 1;
    assert_int_equal(st_image_create(&d, st_image_geometry(a)), 0);
    assert_int_equal(st_image_tokens_set(d, st_image_tokens(a), st_image_n_tokens(a)), 0);
    assert_int_equal(st_image_checkpoint_add_shared(d, pos0, codec0, b0, NULL), 0);
    assert_memory_equal(st_image_checkpoint_tensor_const(d, 0, 1, &len),
                        st_image_checkpoint_tensor_const(ref, 0, 1, &len), (size_t)len);
    assert_memory_not_equal(st_image_checkpoint_tensor_const(d, 0, 1, &len),
                            st_image_checkpoint_tensor_const(a, 0, 1, &len), (size_t)len);
    /* a recode and a removal drop the image's reference only; c still reads b1's bytes */
    assert_int_equal(st_image_checkpoint_recode(a, 1, ST_CODEC_BF16, scratch, sizeof scratch), 0);
    assert_int_equal(st_image_checkpoint_remove(d, 0), 0);
    st_image_block_unref(b0);
    st_image_block_unref(b1);
    st_image_block_unref(NULL);
    assert_memory_equal(st_image_checkpoint_tensor_const(c, 1, 1, &len),
                        st_image_checkpoint_tensor_const(ref, 1, 1, &len), (size_t)len);
    st_image_free(a);
    st_image_free(c);
    st_image_free(d);
    st_image_free(ref);
}

static void test_image_recode(void **state)
{
    static const uint32_t codecs[3] = {ST_CODEC_FP32, ST_CODEC_FP32, ST_CODEC_FP32};
    static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
    st_image *img = NULL;
    uint64_t len, len2;
    uint32_t codec;
    (void)state;

    assert_int_equal(st_test_image_small(&img, 7, codecs), 0);
    const float *f = st_image_checkpoint_tensor_const(img, 2, 1, &len);
    float *orig = malloc(len);
    memcpy(orig, f, len);
    const void *i64 = st_image_checkpoint_tensor_const(img, 2, 4, &len2);
    int64_t pos_val;
    memcpy(&pos_val, i64, 8);

    assert_int_equal(st_image_checkpoint_recode(img, 2, 9, scratch, sizeof scratch), ST_ECODEC);
    assert_int_equal(st_image_checkpoint_recode(img, 3, ST_CODEC_BF16, scratch, sizeof scratch),
                     ST_ENOTFOUND);
    assert_int_equal(st_image_checkpoint_recode(img, 2, ST_CODEC_BF16, scratch, sizeof scratch), 0);
    st_image_checkpoint_info(img, 2, NULL, &codec);
    assert_int_equal(codec, ST_CODEC_BF16);
    const uint16_t *h = st_image_checkpoint_tensor_const(img, 2, 1, &len2);
    assert_int_equal(len2, len / 2);
    uint16_t want[64];
    assert_int_equal(len, 64 * 4);
    st_codec_bf16_encode(want, orig, 64);
    assert_memory_equal(h, want, sizeof want);
    /* other dtypes unchanged */
    i64 = st_image_checkpoint_tensor_const(img, 2, 4, &len2);
    assert_int_equal(len2, 8);
    assert_memory_equal(i64, &pos_val, 8);

    /* widen back: exact for every bf16 value */
    assert_int_equal(st_image_checkpoint_recode(img, 2, ST_CODEC_FP32, scratch, sizeof scratch), 0);
    f = st_image_checkpoint_tensor_const(img, 2, 1, &len2);
    assert_int_equal(len2, len);
    float wide[64];
    st_codec_bf16_decode(wide, want, 64);
    assert_memory_equal(f, wide, sizeof wide);
    /* fp32 -> f16 needs no scratch; f16 -> bf16 goes through fp32 slices in the scratch, so a
     * scratch too small fails and leaves the checkpoint as it was */
    assert_int_equal(st_image_checkpoint_recode(img, 2, ST_CODEC_F16, scratch, 16), 0);
    const void *before = st_image_checkpoint_tensor_const(img, 2, 1, &len2);
    assert_int_equal(st_image_checkpoint_recode(img, 2, ST_CODEC_BF16, scratch, 16), ST_EINVAL);
    st_image_checkpoint_info(img, 2, NULL, &codec);
    assert_int_equal(codec, ST_CODEC_F16);
    assert_ptr_equal(st_image_checkpoint_tensor_const(img, 2, 1, &len2), before);
    assert_int_equal(st_image_checkpoint_recode(img, 2, ST_CODEC_BF16, scratch, sizeof scratch), 0);
    st_image_checkpoint_info(img, 2, NULL, &codec);
    assert_int_equal(codec, ST_CODEC_BF16);
    assert_int_equal(st_image_check(img), 0);
    free(orig);
    st_image_free(img);
}

/* Every checkpoint tensor is aligned to its stored element size, whatever the tensors before it,
 * in every codec and through recode, clone and a file round trip. */
static unsigned recode_calls;
static void recode_progress(void *arg, uint32_t done, uint32_t total)
{
    (void)arg;
    assert_int_equal(done, ++recode_calls);
    assert_true(done <= total);
}

/* st_image_recode keeps the state hash true across codecs when it verified before, and carries a
 * hash that did not verify unchanged (the store then refuses the image). */
static void test_image_recode_rehash(void **state)
{
    (void)state;
    st_synth_opts o = {.seed = 7, .n_tokens = 300, .n_checkpoints = 3};
    st_image *img = NULL, *bad = NULL;
    assert_int_equal(st_image_synthesize(&o, &img), 0);
    assert_int_equal(st_image_clone(&bad, img), 0);
    st_image_state_hash_set(bad, st_image_state_hash(img) ^ 1);
    uint64_t h0 = st_image_state_hash(img), h = 0, prev = h0;
    static const uint32_t chain[] = {ST_CODEC_BF16, ST_CODEC_F16, ST_CODEC_FP32, ST_CODEC_F16};
    for (unsigned i = 0; i < 4; i++) {
        recode_calls = 0;
        assert_int_equal(st_image_recode(img, chain[i], NULL, NULL, recode_progress, NULL), 0);
        assert_int_equal(recode_calls, 3);
        assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h), 0);
        assert_int_equal(st_image_state_hash(img), h);
        if (i == 0)
            assert_true(h != h0); /* fp32 -> bf16 rounds */
        if (i == 2)
            assert_int_equal(h, prev); /* f16 -> fp32 widens exactly */
        prev = h;
        assert_int_equal(st_image_recode(bad, chain[i], NULL, NULL, NULL, NULL), 0);
        assert_int_equal(st_image_state_hash(bad), h0 ^ 1);
    }
    assert_int_equal(st_image_recode(img, 99, NULL, NULL, NULL, NULL), ST_ECODEC);
    assert_int_equal(st_image_state_hash(img), h);
    st_image_free(img);
    st_image_free(bad);
}

static void test_checkpoint_alignment(void **state)
{
    static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
    st_tensor_desc t[5];
    st_geometry g;
    st_image *img = NULL, *c = NULL, *back = NULL;
    uint8_t *buf;
    size_t len = 0;
    (void)state;

    memset(&g, 0, sizeof g);
    g.page_size = 1;
    g.n_ctx = 4;
    g.n_tensors = 5;
    g.tensors = t;
    desc(&t[0], "a", ST_ROLE_RUNNING, ST_DTYPE_I8, 1, 3, 0, 0);
    desc(&t[1], "b", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 2, 0, 0);
    desc(&t[2], "c", ST_ROLE_RUNNING, ST_DTYPE_F32, 1, 5, 0, 0);
    desc(&t[3], "d", ST_ROLE_RUNNING, ST_DTYPE_I8, 1, 1, 0, 0);
    desc(&t[4], "e", ST_ROLE_RUNNING, ST_DTYPE_F32, 2, 3, 3, 0);
    assert_int_equal(st_image_create(&img, &g), 0);
    for (uint32_t codec = 0; codec < ST_CODEC_COUNT; codec++) {
        uint32_t ci;
        assert_int_equal(st_image_checkpoint_add(img, codec, codec, &ci), 0);
        for (uint32_t i = 0; i < 5; i++) {
            uint64_t n;
            uint8_t *p = st_image_checkpoint_tensor(img, ci, i, &n);
            size_t es = t[i].dtype == ST_DTYPE_F32 ? st_codec_elem_size(codec) : st_dtype_size(t[i].dtype);
            assert_non_null(p);
            assert_int_equal((uintptr_t)p % es, 0);
            assert_int_equal(n, st_tensor_stored_bytes(&t[i], codec));
            for (uint64_t k = 0; k < n; k++)
                p[k] = (uint8_t)(0x11 * (i + 1) + k);
        }
    }
    /* the tensors do not overlap: each still holds its own bytes */
    for (uint32_t ci = 0; ci < 3; ci++)
        for (uint32_t i = 0; i < 5; i++) {
            uint64_t n;
            const uint8_t *p = st_image_checkpoint_tensor_const(img, ci, i, &n);
            for (uint64_t k = 0; k < n; k++)
                assert_int_equal(p[k], (uint8_t)(0x11 * (i + 1) + k));
        }
    uint32_t tok[3] = {1, 2, 3};
    assert_int_equal(st_image_tokens_set(img, tok, 2), 0);
    assert_int_equal(st_image_check(img), 0);
    assert_int_equal(st_image_clone(&c, img), 0);
    assert_int_equal(st_test_image_equal(img, c), 0);
    /* recode moves every tensor; integer tensors keep their bytes */
    assert_int_equal(st_image_checkpoint_recode(c, 0, ST_CODEC_BF16, scratch, sizeof scratch), 0);
    for (uint32_t i = 0; i < 5; i++) {
        uint64_t n;
        const uint8_t *p = st_image_checkpoint_tensor_const(c, 0, i, &n);
        assert_int_equal((uintptr_t)p % (t[i].dtype == ST_DTYPE_F32 ? 2 : st_dtype_size(t[i].dtype)), 0);
        if (t[i].dtype != ST_DTYPE_F32)
            for (uint64_t k = 0; k < n; k++)
                assert_int_equal(p[k], (uint8_t)(0x11 * (i + 1) + k));
    }
    assert_int_equal(st_file_write_mem(c, NULL, &buf, &len), 0);
    assert_int_equal(st_file_read_mem(buf, len, NULL, &back), 0);
    assert_int_equal(st_test_image_equal(c, back), 0);
    free(buf);
    st_image_free(back);
    st_image_free(c);
    st_image_free(img);
}

static void test_image_minimal(void **state)
{
    st_image *img = NULL;
    (void)state;
    assert_int_equal(st_test_image_minimal(&img, 1), 0);
    assert_int_equal(st_image_check(img), 0);
    assert_int_equal(st_image_n_tokens(img), 0);
    assert_int_equal(st_image_bytes(img), 16);
    st_image_free(img);

    /* bad arguments */
    assert_int_equal(st_image_create(NULL, NULL), ST_EINVAL);
    st_image *x = (st_image *)1;
    assert_int_equal(st_image_create(&x, NULL), ST_EINVAL);
    assert_null(x);
    assert_int_equal(st_image_tokens_set(NULL, NULL, 0), ST_EINVAL);
    assert_int_equal(st_image_n_checkpoints(NULL), 0);
    assert_null(st_image_geometry(NULL));
}

/* The state hash as st_image.h defines it, recomputed here block by block: segments of tokens,
 * K/V rows and the live checkpoint widened to fp32, 1 MiB blocks, digests combined in order. */
static uint64_t ref_digests(uint64_t *dg, uint64_t k, const void *p, uint64_t bytes)
{
    for (uint64_t off = 0; off < bytes; off += ST_STATE_HASH_BLOCK) {
        uint64_t len = bytes - off < ST_STATE_HASH_BLOCK ? bytes - off : ST_STATE_HASH_BLOCK;
        dg[k++] = st_checksum((const uint8_t *)p + off, (size_t)len);
    }
    return k;
}

static void reverse_runner(void *run_arg, uint64_t n, st_state_hash_task task, void *arg)
{
    *(uint64_t *)run_arg += n;
    for (uint64_t i = n; i-- > 0;)
        task(arg, i);
}

static uint64_t ref_hash(const st_image *img)
{
    const st_geometry *g = st_image_geometry(img);
    uint64_t n = st_image_n_tokens(img), k = 0, dg[64], *all;
    uint32_t live = st_image_n_checkpoints(img) - 1, codec;
    assert_int_equal(st_image_checkpoint_info(img, live, NULL, &codec), 0);
    k = ref_digests(dg, k, st_image_tokens(img), n * 4);
    for (uint32_t ti = 0; ti < g->n_tensors; ti++) {
        uint64_t len = 0;
        if (g->tensors[ti].role == ST_ROLE_KV) {
            const void *p = st_image_kv_const(img, ti, &len);
            k = ref_digests(dg, k, p, len);
            continue;
        }
        const void *p = st_image_checkpoint_tensor_const(img, live, ti, &len);
        if (g->tensors[ti].dtype != ST_DTYPE_F32) {
            k = ref_digests(dg, k, p, len);
            continue;
        }
        uint64_t ne = st_tensor_elems(&g->tensors[ti]);
        float *w = malloc(ne * 4);
        assert_non_null(w);
        assert_int_equal(st_codec_convert(ST_CODEC_FP32, w, codec, p, ne, NULL, 0), 0);
        k = ref_digests(dg, k, w, ne * 4);
        free(w);
        assert_true(k < 60);
    }
    all = malloc((k + 2) * 8);
    assert_non_null(all);
    all[0] = n;
    all[1] = k;
    memcpy(all + 2, dg, k * 8);
    uint64_t h = st_checksum(all, (k + 2) * 8);
    free(all);
    return h ? h : 1;
}

static void test_state_hash(void **state)
{
    (void)state;
    st_geometry g;
    st_tensor_desc t[4];
    memset(&g, 0, sizeof g);
    g.page_size = 16;
    g.n_ctx = 64;
    g.n_vocab = 8;
    g.n_tensors = 4;
    /* K/V rows of 40000 bytes: 40 rows cross a block boundary; 300000 floats: 2 blocks widened */
    desc(&t[0], "k", ST_ROLE_KV, ST_DTYPE_I8, 2, 64, 40000, 0);
    desc(&t[1], "ssm", ST_ROLE_RUNNING, ST_DTYPE_F32, 1, 300000, 0, 0);
    desc(&t[2], "empty_kv", ST_ROLE_KV, ST_DTYPE_F16, 2, 64, 1, 0);
    desc(&t[3], "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    g.tensors = t;
    st_image *img = NULL;
    uint32_t toks[40], ci;
    for (uint32_t i = 0; i < 40; i++)
        toks[i] = i * 7 + 1;
    assert_int_equal(st_image_create(&img, &g), 0);
    assert_int_equal(st_image_tokens_set(img, toks, 40), 0);
    uint64_t len;
    uint8_t *kv = st_image_kv(img, 0, &len);
    for (uint64_t i = 0; i < len; i++)
        kv[i] = (uint8_t)(i * 131 + (i >> 13));
    assert_int_equal(st_image_checkpoint_add(img, 40, ST_CODEC_FP32, &ci), 0);
    float *f = st_image_checkpoint_tensor(img, ci, 1, &len);
    for (uint64_t i = 0; i < 300000; i++)
        f[i] = (float)((double)i * 1e-3 - 17.0) * (i % 3 ? 1.0f : -0.37f);
    int64_t pos = 40;
    memcpy(st_image_checkpoint_tensor(img, ci, 3, &len), &pos, 8);

    uint64_t h1 = 0, h2 = 0, calls = 0;
    assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h1), 0);
    assert_true(h1 == ref_hash(img));
    /* any order of the block digests gives the same value */
    assert_int_equal(st_image_state_hash_compute(img, reverse_runner, &calls, &h2), 0);
    assert_true(h2 == h1);
    assert_true(calls > 0);
    /* re-coded: the hash covers the values as they widen from the stored codec */
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    assert_non_null(scratch);
    uint32_t codecs[] = {ST_CODEC_BF16, ST_CODEC_F16, ST_CODEC_FP32};
    for (int i = 0; i < 3; i++) {
        assert_int_equal(st_image_checkpoint_recode(img, ci, codecs[i], scratch,
                                                    ST_CODEC_SCRATCH_MAX), 0);
        assert_int_equal(st_image_state_hash_compute(img, reverse_runner, &calls, &h2), 0);
        assert_true(h2 == ref_hash(img));
        if (i < 2)
            assert_true(h2 != h1); /* these values are not exact in bf16 / f16 */
    }
    free(scratch);
    /* zeroed running state or K/V hash differently */
    f = st_image_checkpoint_tensor(img, ci, 1, &len);
    memset(f, 0, len);
    assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h2), 0);
    assert_true(h2 != h1 && h2 == ref_hash(img));
    /* K/V buffers across the 2 MiB line (mapped, huge pages): rows kept, new rows zero after
     * a grow, a shrink and a grow again */
    uint32_t many[64];
    for (uint32_t i = 0; i < 64; i++)
        many[i] = i;
    uint8_t *copy = malloc(40 * 40000);
    assert_non_null(copy);
    memcpy(copy, st_image_kv(img, 0, &len), 40 * 40000);
    uint64_t sizes[] = {64, 10, 64};
    for (int k = 0; k < 3; k++) {
        assert_int_equal(st_image_tokens_set(img, many, sizes[k]), 0);
        kv = st_image_kv(img, 0, &len);
        assert_int_equal(len, sizes[k] * 40000);
        uint64_t keep = k == 0 ? 40 : 10;
        assert_memory_equal(kv, copy, (size_t)(keep < sizes[k] ? keep : sizes[k]) * 40000);
        for (uint64_t b = keep * 40000; b < len; b++)
            assert_int_equal(kv[b], 0);
        if (k == 0)
            memset(kv + 50 * 40000, 0x5a, 40000); /* beyond the shrink: zero again after it */
    }
    st_image *cl = NULL;
    assert_int_equal(st_image_clone(&cl, img), 0);
    assert_memory_equal(st_image_kv(cl, 0, &len), st_image_kv(img, 0, &len), len);
    st_image_free(cl);
    free(copy);
    /* an incomplete image has no state hash */
    st_image *e = NULL;
    assert_int_equal(st_image_create(&e, &g), 0);
    assert_int_equal(st_image_state_hash_compute(e, NULL, NULL, &h2), ST_EINVAL);
    st_image_free(e);
    st_image_free(img);
}

/* An allocation hook that counts: every buffer it makes must come back exactly once. */
typedef struct counting {
    int allocs, frees, refuse;
    void *live[16];
    size_t len[16];
} counting;

static void *count_alloc(void *ctx, size_t len)
{
    counting *c = ctx;
    if (c->refuse)
        return NULL;
    for (int i = 0; i < 16; i++)
        if (!c->live[i]) {
            c->live[i] = malloc(len);
            c->len[i] = len;
            c->allocs++;
            memset(c->live[i], 0xa5, len); /* not zero: the image must zero what it needs */
            return c->live[i];
        }
    return NULL;
}

static void count_free(void *ctx, void *p, size_t len)
{
    counting *c = ctx;
    for (int i = 0; i < 16; i++)
        if (c->live[i] == p) {
            assert_int_equal(c->len[i], len);
            free(p);
            c->live[i] = NULL;
            c->frees++;
            return;
        }
    fail_msg("freed a buffer the allocator did not make");
}

static void test_image_allocator(void **state)
{
    (void)state;
    st_geometry g;
    st_tensor_desc t[3];
    static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
    memset(&g, 0, sizeof g);
    g.page_size = 16;
    g.n_ctx = 96;
    g.n_vocab = 8;
    g.n_tensors = 3;
    desc(&t[0], "k", ST_ROLE_KV, ST_DTYPE_I8, 2, 96, 65536, 0); /* 40 rows: 2.5 MiB (4 MiB mapped) */
    desc(&t[1], "ssm", ST_ROLE_RUNNING, ST_DTYPE_F32, 1, 600000, 0, 0);
    desc(&t[2], "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    g.tensors = t;
    for (int refuse = 0; refuse < 2; refuse++) {
        counting cnt;
        memset(&cnt, 0, sizeof cnt);
        cnt.refuse = refuse;
        st_image_allocator a = {count_alloc, count_free, &cnt}, bad = {NULL, count_free, &cnt};
        st_image *img = NULL, *cl = NULL;
        uint32_t toks[96], ci = 0;
        uint64_t len = 0;
        for (uint32_t i = 0; i < 96; i++)
            toks[i] = i * 3 + 1;
        assert_int_equal(st_image_create_with(&img, &g, &bad), ST_EINVAL);
        assert_int_equal(st_image_create_with(&img, &g, &a), 0);
        assert_int_equal(st_image_tokens_set(img, toks, 40), 0);
        uint8_t *kv = st_image_kv(img, 0, &len);
        assert_int_equal(len, 40 * 65536);
        for (uint64_t i = 0; i < len; i++)
            assert_true(kv[i] == 0);
        for (uint64_t i = 0; i < len; i++)
            kv[i] = (uint8_t)(i * 7 + 3);
        assert_int_equal(st_image_checkpoint_add(img, 40, ST_CODEC_FP32, &ci), 0);
        float *f = st_image_checkpoint_tensor(img, ci, 1, &len);
        assert_int_equal(len, 600000 * 4);
        for (uint32_t i = 0; i < 600000; i++) {
            assert_true(f[i] == 0.0f);
            f[i] = (float)i;
        }
        assert_int_equal(cnt.allocs, refuse ? 0 : 2);
        assert_int_equal(st_image_clone(&cl, img), 0);
        assert_int_equal(cnt.allocs, refuse ? 0 : 2); /* clones use the default allocation */
        assert_memory_equal(st_image_kv(cl, 0, &len), st_image_kv(img, 0, NULL), 40 * 65536);
        /* growing moves K/V into a new hook buffer: old rows kept, new ones zero */
        assert_int_equal(st_image_tokens_set(img, toks, 96), 0);
        kv = st_image_kv(img, 0, &len);
        assert_int_equal(len, 96 * 65536);
        for (uint64_t i = 0; i < len; i++)
            assert_true(kv[i] == (i < 40 * 65536 ? (uint8_t)(i * 7 + 3) : 0));
        assert_int_equal(cnt.allocs, refuse ? 0 : 3);
        assert_int_equal(cnt.frees, refuse ? 0 : 1);
        /* recode to bf16 (1.2 MB: malloc'd) frees the hook block */
        assert_int_equal(st_image_checkpoint_recode(img, ci, ST_CODEC_BF16, scratch, sizeof scratch),
                         0);
        assert_int_equal(cnt.frees, refuse ? 0 : 2);
        const uint16_t *h = st_image_checkpoint_tensor_const(img, ci, 1, &len);
        assert_int_equal(len, 600000 * 2);
        assert_int_equal(h[1000], (uint16_t)0x447a); /* 1000.0f in bf16 */
        st_image_free(cl);
        st_image_free(img);
        assert_int_equal(cnt.allocs, cnt.frees);
        for (int i = 0; i < 16; i++)
            assert_null(cnt.live[i]);
    }
}

/* A session file read with an allocation hook (st_file_read_opts.alloc) takes its checkpoint
 * blocks of 2 MiB and more from the hook, in memory that held other bytes, and yields the image
 * read without one, byte for byte, uncompressed and compressed; a damaged file is refused and
 * every buffer the hook made comes back. */
static void test_file_read_allocator(void **state)
{
    (void)state;
    st_geometry g;
    st_tensor_desc t[3];
    memset(&g, 0, sizeof g);
    g.page_size = 16;
    g.n_ctx = 96;
    g.n_vocab = 8;
    g.n_tensors = 3;
    desc(&t[0], "k", ST_ROLE_KV, ST_DTYPE_F16, 2, 96, 64, 0);
    desc(&t[1], "ssm", ST_ROLE_RUNNING, ST_DTYPE_F32, 1, 600000, 0, 0);
    desc(&t[2], "pos", ST_ROLE_RUNNING, ST_DTYPE_I64, 1, 1, 0, 0);
    g.tensors = t;
    st_image *img = NULL;
    uint32_t toks[40], ci = 0;
    uint64_t len = 0;
    float logits[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    for (uint32_t i = 0; i < 40; i++)
        toks[i] = i * 3 + 1;
    assert_int_equal(st_image_create(&img, &g), 0);
    assert_int_equal(st_image_tokens_set(img, toks, 40), 0);
    uint8_t *kv = st_image_kv(img, 0, &len);
    for (uint64_t i = 0; i < len; i++)
        kv[i] = (uint8_t)(i * 7 + 3);
    for (uint64_t pos = 20; pos <= 40; pos += 20) {
        assert_int_equal(st_image_checkpoint_add(img, pos, ST_CODEC_FP32, &ci), 0);
        float *f = st_image_checkpoint_tensor(img, ci, 1, &len);
        for (uint32_t i = 0; i < 600000; i++)
            f[i] = (float)(i % 977) * 0.25f + (float)pos;
        int64_t p = (int64_t)pos;
        memcpy(st_image_checkpoint_tensor(img, ci, 2, &len), &p, 8);
    }
    assert_int_equal(st_image_logits_set(img, logits, 8), 0);
    st_image_state_hash_set(img, 0x1234567890abcdefull);
    for (int compress = 0; compress < 2; compress++) {
        st_file_write_opts wo = {.compress = compress};
        uint8_t *f0 = NULL, *f1 = NULL, *f2 = NULL;
        size_t l0 = 0, l1 = 0, l2 = 0;
        assert_int_equal(st_file_write_mem(img, &wo, &f0, &l0), 0);
        counting cnt;
        memset(&cnt, 0, sizeof cnt);
        st_image_allocator a = {count_alloc, count_free, &cnt};
        st_file_read_opts ro = {.alloc = &a};
        st_image *plain = NULL, *hooked = NULL;
        assert_int_equal(st_file_read_mem(f0, l0, NULL, &plain), 0);
        assert_int_equal(st_file_read_mem(f0, l0, &ro, &hooked), 0);
        assert_int_equal(cnt.allocs, 2); /* both checkpoint blocks (2.4 MB each) */
        assert_int_equal(st_file_write_mem(plain, &wo, &f1, &l1), 0);
        assert_int_equal(st_file_write_mem(hooked, &wo, &f2, &l2), 0);
        assert_int_equal(l0, l1);
        assert_int_equal(l1, l2);
        assert_memory_equal(f0, f2, l0);
        assert_memory_equal(f1, f2, l1);
        st_image_free(hooked);
        assert_int_equal(cnt.frees, 2);
        /* the negative control: a byte of the second checkpoint flipped (the first's block is
         * the hook's by then) */
        f0[l0 * 3 / 4] ^= 0x01;
        hooked = NULL;
        assert_int_equal(st_file_read_mem(f0, l0, &ro, &hooked), ST_ECORRUPT);
        assert_null(hooked);
        assert_int_equal(cnt.allocs, cnt.frees);
        for (int i = 0; i < 16; i++)
            assert_null(cnt.live[i]);
        st_image_free(plain);
        free(f0);
        free(f1);
        free(f2);
    }
    st_image_free(img);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_state_hash),
        cmocka_unit_test(test_dtype_helpers),   cmocka_unit_test(test_geometry_check),
        cmocka_unit_test(test_geometry_compare), cmocka_unit_test(test_image_build),
        cmocka_unit_test(test_image_clone),     cmocka_unit_test(test_image_recode), cmocka_unit_test(test_image_recode_rehash),
        cmocka_unit_test(test_checkpoint_alignment), cmocka_unit_test(test_image_minimal),
        cmocka_unit_test(test_image_allocator), cmocka_unit_test(test_file_read_allocator),
        cmocka_unit_test(test_image_shared_block),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
