/*
 * st_tokenizer.c - the byte-level tokenizer: ids 0..255 are the bytes themselves, 256..258 are
 * BOS, EOS and the turn separator. Every byte string encodes and decodes exactly.
 */
#include "st_engine.h"

size_t st_tokenize(const char *text, size_t len, uint32_t *ids, size_t cap)
{
    for (size_t i = 0; i < len && i < cap; i++)
        ids[i] = (uint8_t)text[i];
    return len;
}

size_t st_detokenize(const uint32_t *ids, size_t n, char *dst, size_t cap)
{
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (ids[i] > 255)
            continue;
        if (k < cap)
            dst[k] = (char)ids[i];
        k++;
    }
    return k;
}
