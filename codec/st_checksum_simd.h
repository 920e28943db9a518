/*
 * st_checksum_simd.h - XXH3-64 of xxhash.h compiled inline for AVX2 and AVX-512 (internal to
 * codec/, behind st_checksum's dispatch on st_codec_isa(); libxxhash is the scalar level).
 * Each function equals its libxxhash counterpart bit for bit (test_codec_checksum). A state is
 * libxxhash's XXH3_state_t, created and freed there: the header is the library's, so the
 * layout is the same.
 */
#ifndef ST_CHECKSUM_SIMD_H
#define ST_CHECKSUM_SIMD_H

#include <stddef.h>
#include <stdint.h>

uint64_t st_xxh3_avx2_64(const void *p, size_t n);
void st_xxh3_avx2_update(void *state, const void *p, size_t n);
uint64_t st_xxh3_avx512_64(const void *p, size_t n);
void st_xxh3_avx512_update(void *state, const void *p, size_t n);

#endif
