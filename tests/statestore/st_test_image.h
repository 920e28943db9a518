/*
 * st_test_image.h - deterministic images for statestore tests, golden files and the fuzz corpus.
 *
 * The builders below are frozen: the golden files in tests/data/golden/ are their output, and a
 * test asserts the writer reproduces those files byte for byte. Never change what a builder
 * produces; add a new builder (and a new golden file) instead.
 */
#ifndef ST_TEST_IMAGE_H
#define ST_TEST_IMAGE_H

#include <stdint.h>

#include "st_image.h"

/* splitmix64: the project's test PRNG (frozen). */
uint64_t st_test_rand(uint64_t *state);

/* Fill n fp32 values with mixed magnitudes (2^-30..2^30, both signs) and, every few values,
 * a special: +-Inf, NaN, -0, a subnormal, FLT_MAX, FLT_MIN. */
void st_test_fill_f32(float *dst, uint64_t n, uint64_t *state);
/* bf16 / f16 bit patterns of the same mix. */
void st_test_fill_bf16(uint16_t *dst, uint64_t n, uint64_t *state);
void st_test_fill_f16(uint16_t *dst, uint64_t n, uint64_t *state);
void st_test_fill_bytes(void *dst, uint64_t n, uint64_t *state);

/* The "small" geometry: page_size 4, n_ctx 16, n_vocab 8, six tensors:
 *   0 attn.0.kv   K/V     f16  [16,2,4]      3 attn.1.kq  K/V     i8   [16,8]
 *   1 ssm.0.state running f32  [2,4,8]       4 pos        running i64  [1]
 *   2 ssm.0.conv  running f32  [3,8]         5 ssm.0.gate running bf16 [4] */
#define ST_TEST_SMALL_TENSORS 6
void st_test_geometry_small(st_geometry *g, st_tensor_desc tensors[ST_TEST_SMALL_TENSORS]);

/* Image of the small geometry with 11 tokens and checkpoints at 3, 7 and 11 in the codecs given
 * (codecs[3]); tensors filled from seed, logits set, state hash set. A file of it is ~2.5 KiB. */
int st_test_image_small(st_image **out, uint64_t seed, const uint32_t codecs[3]);

/* A minimal image: one running f32 tensor, no K/V, 0 tokens, one checkpoint at 0, no logits. */
int st_test_image_minimal(st_image **out, uint64_t seed);

/* A copy of src whose geometry names the architecture arch (written with an ARCH section). */
int st_test_image_named(st_image **out, const st_image *src, const char *arch);

/* 0 when a and b hold the same geometry (the architecture name included), tokens, K/V, checkpoints (positions, codecs, bytes),
 * logits and state hash; otherwise -1 with the first difference printed on stderr. */
int st_test_image_equal(const st_image *a, const st_image *b);

#endif
