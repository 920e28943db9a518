/* strata_vocab_json.h - a Hugging Face tokenizer.json as GGUF vocabulary keys
 * (strata_vocab_json.c, for strata-mkmodel --vocab-from). */
#ifndef STRATA_VOCAB_JSON_H
#define STRATA_VOCAB_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "st_engine.h"

/* Set the tokenizer.* keys of tok_path (and of cfg_path, tokenizer_config.json, when not NULL)
 * on w; pre_override names the pre-tokenizer instead of telling it from the regex. *n_vocab gets
 * the token count, *pre_out (may be NULL) the pre-tokenizer written (static, or pre_override).
 * 0, or -1 with the reason in e. */
int strata_vocab_json(const char *tok_path, const char *cfg_path, const char *pre_override,
                      st_gguf_writer *w, uint32_t *n_vocab, const char **pre_out, char *e,
                      size_t ecap);

#endif
