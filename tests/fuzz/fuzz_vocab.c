/*
 * fuzz_vocab.c - libFuzzer target for the GGUF BPE vocabulary (st_vocab_load) and its tokenizer:
 * the input is read as a GGUF file and, when its vocabulary loads, tokenized as text itself
 * (any bytes: the file's own bytes are mostly invalid UTF-8).
 *
 * Properties checked on every input:
 * 1. A refused vocabulary ends in a typed error with a detail, and no handle.
 * 2. Tokenizing (special tokens parsed or not, BOS / EOS added or not) succeeds with ids inside
 *    the vocabulary, at most 6 per input byte plus BOS and EOS, the same in a short buffer.
 * 3. Detokenizing those ids succeeds; the streaming decoder writes the same bytes where no
 *    spaces are cleaned (not llama-bpe), never more than what detokenize writes.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine.h"
#include "st_fuzz.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_gguf *g = NULL;
    if (st_gguf_open_mem(data, size, &g))
        return 0;
    st_vocab *v = NULL;
    int rc = st_vocab_load(g, &v);
    st_gguf_close(g); /* the vocabulary owns copies */
    if (rc) {
        st_fuzz_require(v == NULL, "a handle after an error");
        st_fuzz_require(st_fuzz_typed(rc), "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
        return 0;
    }
    const char *text = (const char *)data;
    for (int mode = 0; mode < 4; mode++) {
        int add = mode & 1, special = mode >> 1;
        size_t n = 0, m = 0;
        rc = st_vocab_tokenize(v, text, size, add, special, NULL, 0, &n);
        if (rc) { /* only a BOS / EOS the vocabulary adds but does not have */
            st_fuzz_require(add && rc == ST_EINVAL, "tokenize failed");
            continue;
        }
        st_fuzz_require(n <= 6 * size + 2, "more ids than the bound");
        uint32_t *ids = malloc((n + 1) * sizeof *ids);
        st_fuzz_require(ids != NULL, "out of memory");
        st_fuzz_require(st_vocab_tokenize(v, text, size, add, special, ids, n, &m) == 0 && m == n,
                        "a second tokenize differs");
        for (size_t i = 0; i < n; i++)
            st_fuzz_require(ids[i] < st_vocab_n_tokens(v), "an id beyond the vocabulary");
        size_t dl = 0;
        st_fuzz_require(st_vocab_detokenize(v, ids, n, 0, 1, NULL, 0, &dl) == 0, "detokenize");
        char *a = malloc(dl + 1), *b = malloc(dl + 8);
        st_fuzz_require(a && b, "out of memory");
        st_vocab_detokenize(v, ids, n, 0, 1, a, dl, &dl);
        st_vocab_stream sd = {0};
        size_t at = 0;
        for (size_t i = 0; i < n; i++) {
            size_t k = 0, need = 0;
            st_vocab_token_piece(v, ids[i], 1, NULL, 0, &need);
            char *chunk = malloc(need + 4);
            st_fuzz_require(chunk != NULL, "out of memory");
            st_fuzz_require(st_vocab_stream_push(v, &sd, ids[i], 1, chunk, need + 4, &k) == 0,
                            "a stream push");
            st_fuzz_require(at + k <= dl + 3 || st_vocab_pre_get(v) == ST_VOCAB_PRE_LLAMA3,
                            "the stream wrote more than the text");
            if (at + k <= dl + 8)
                memcpy(b + at, chunk, k);
            at += k;
            free(chunk);
        }
        char tail[4];
        at += st_vocab_stream_flush(&sd, tail, sizeof tail);
        if (st_vocab_pre_get(v) != ST_VOCAB_PRE_LLAMA3)
            st_fuzz_require(at == dl, "stream and detokenize differ in length");
        free(a);
        free(b);
        free(ids);
    }
    st_vocab_free(v);
    return 0;
}
