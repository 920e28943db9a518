/* strata_tokenize.h - `strata tokenize` and `strata detokenize` (strata_tokenize.c). */
#ifndef STRATA_TOKENIZE_H
#define STRATA_TOKENIZE_H

/* argv[1] is the command; the exit status is returned. */
int strata_cmd_tokenize(int argc, char **argv);
int strata_cmd_detokenize(int argc, char **argv);

#endif
