/*
 * test_engine_cli_vocab.c - `strata generate` with the model's own tokenizer (a qwen35 model with
 * the published Qwen3 vocabulary and chat template, strata-mkmodel --vocab-from the npm
 * tokenizer.json of tests/ref, installed by `make deps`; without it the test fails saying so):
 * the prompt is what `strata tokenize` prints (the logits after it equal strata logits on those
 * ids; the control token parsed as a token must differ), --chat reads what `strata chat-template`
 * renders, tokenized with special tokens (without the system turn it must differ), the text is
 * what detokenize makes of the ids; on the seeded qwen35 vocabulary generation stops after the
 * first end-of-generation token unless --ignore-eos, and a model without a template is ChatML,
 * said on stderr; --chat on strata-hybrid is refused.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine_cli_test.h"

#define GEN BIN "/strata generate --threads 1 "

/* The ids of out (numbers separated by spaces), at most cap; their count. */
static size_t parse_ids(const char *s, uint32_t *ids, size_t cap)
{
    size_t n = 0;
    char *end;
    while (n < cap) {
        unsigned long v = strtoul(s, &end, 10);
        if (end == s)
            break;
        ids[n++] = (uint32_t)v;
        s = end;
    }
    return n;
}

/* Ids as "a,b,c" for strata logits --tokens. */
static void ids_csv(const uint32_t *ids, size_t n, char *dst, size_t cap)
{
    size_t k = 0;
    dst[0] = 0;
    for (size_t i = 0; i < n && k < cap; i++)
        k += (size_t)snprintf(dst + k, cap - k, i ? ",%u" : "%u", ids[i]);
}

/* The last row of strata logits on the ids strata tokenize printed (in out) equals name's
 * bytes (generate --dump-logits); returns whether they are equal. */
static int last_row_equal(const char *ids_out, const char *name, const char *tag)
{
    uint32_t ids[512];
    char csv[8192];
    size_t n = parse_ids(ids_out, ids, 512);
    assert_true(n > 0 && n < 512);
    ids_csv(ids, n, csv, sizeof csv);
    sh(1, BIN "/strata logits -m %s/v.gguf --threads 1 --tokens %s -o %s/%s.bin", g_dir, csv,
       g_dir, tag);
    char rows[64];
    snprintf(rows, sizeof rows, "%s.bin", tag);
    size_t nr, nd;
    unsigned char *r = slurp(rows, &nr), *d = slurp(name, &nd);
    assert_true(nr >= nd && nd > 0 && nr % nd == 0 && nr / nd == n);
    int eq = memcmp(r + nr - nd, d, nd) == 0;
    free(r);
    free(d);
    return eq;
}

static void test_prompt_tokens(void **state)
{
    (void)state;
    const char *p = "Hello 世界 <|im_start|> 12345";
    sh(1, GEN "-m %s/v.gguf -p '%s' -n 0 --dump-logits %s/p.bin 2>/dev/null", g_dir, p, g_dir);
    sh(1, BIN "/strata tokenize -m %s/v.gguf '%s'", g_dir, p);
    assert_true(last_row_equal(out, "p.bin", "pl"));
    /* the negative control: with the control token parsed the ids differ, and so do the logits */
    sh(1, BIN "/strata tokenize -m %s/v.gguf --parse-special '%s'", g_dir, p);
    assert_false(last_row_equal(out, "p.bin", "pn"));
}

static void test_chat(void **state)
{
    (void)state;
    sh(1, "printf '%%s' '{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"}, "
          "{\"role\": \"user\", \"content\": \"Hi 世界\"}], \"add_generation_prompt\": true}' "
          "> %s/c.json && printf '%%s' '{\"messages\": [{\"role\": \"user\", \"content\": "
          "\"Hi 世界\"}], \"add_generation_prompt\": true}' > %s/u.json", g_dir, g_dir);
    sh(1, GEN "-m %s/v.gguf --chat --system 'Be brief.' -p 'Hi 世界' -n 0 --dump-logits "
              "%s/c.bin 2>/dev/null", g_dir, g_dir);
    sh(1, BIN "/strata chat-template -m %s/v.gguf --conversation %s/c.json > %s/c.txt && "
              BIN "/strata tokenize -m %s/v.gguf --parse-special --file %s/c.txt",
       g_dir, g_dir, g_dir, g_dir, g_dir);
    assert_non_null(strstr(out, "151644")); /* <|im_start|> as a token */
    assert_true(last_row_equal(out, "c.bin", "cl"));
    /* the negative control: the conversation without its system turn */
    sh(1, BIN "/strata chat-template -m %s/v.gguf --conversation %s/u.json > %s/u.txt && "
              BIN "/strata tokenize -m %s/v.gguf --parse-special --file %s/u.txt",
       g_dir, g_dir, g_dir, g_dir, g_dir);
    assert_false(last_row_equal(out, "c.bin", "ul"));
}

/* The text printed is the detokenized ids (no control token rendered), UTF-8 split across
 * tokens included. */
static void test_text(void **state)
{
    (void)state;
    sh(1, GEN "-m %s/v.gguf -p 'Hello 世界' -n 24 --ignore-eos --tokens 2>/dev/null > %s/t.ids",
       g_dir, g_dir);
    sh(1, GEN "-m %s/v.gguf -p 'Hello 世界' -n 24 --ignore-eos 2>/dev/null > %s/t.txt", g_dir,
       g_dir);
    size_t ni, nt;
    char *ids_txt = (char *)slurp("t.ids", &ni), *txt = (char *)slurp("t.txt", &nt);
    char p[4300];
    snprintf(p, sizeof p, "%s/v.gguf", g_dir);
    st_vocab *v = NULL;
    assert_int_equal(st_vocab_open(p, &v), 0);
    ids_txt = realloc(ids_txt, ni + 1);
    ids_txt[ni] = 0;
    uint32_t ids[64];
    size_t n = parse_ids(ids_txt, ids, 64), want = 0;
    assert_int_equal(n, 24);
    assert_int_equal(st_vocab_detokenize(v, ids, n, 0, 0, NULL, 0, &want), 0);
    char *w = malloc(want + 1);
    assert_int_equal(st_vocab_detokenize(v, ids, n, 0, 0, w, want, &want), 0);
    assert_int_equal(nt, want);
    assert_memory_equal(txt, w, want);
    free(w);
    free(txt);
    free(ids_txt);
    st_vocab_free(v);
}

/* The seeded qwen35 vocabulary (512 tokens: <|endoftext|> and <|im_end|> end generation): with
 * prompt "w" greedy generation meets <|endoftext|> as its 25th token; generation stops right
 * after it, and --ignore-eos goes on. */
static void test_eog(void **state)
{
    (void)state;
    sh(1, GEN "-m %s/s.gguf -p w -n 40 --tokens --ignore-eos 2>/dev/null", g_dir);
    uint32_t all[64], cut[64];
    size_t na = parse_ids(out, all, 64);
    assert_int_equal(na, 40);
    sh(1, GEN "-m %s/s.gguf -p w -n 40 --tokens 2>/dev/null", g_dir);
    size_t nc = parse_ids(out, cut, 64);
    char p[4300];
    snprintf(p, sizeof p, "%s/s.gguf", g_dir);
    st_vocab *v = NULL;
    assert_int_equal(st_vocab_open(p, &v), 0);
    size_t first = na;
    for (size_t i = 0; i < na && first == na; i++)
        if (st_vocab_is_eog(v, all[i]))
            first = i;
    assert_int_equal(first, 24);
    assert_int_equal(all[first], st_vocab_find(v, "<|endoftext|>", 13));
    assert_int_equal(nc, first + 1);
    assert_memory_equal(cut, all, nc * sizeof *cut);
    st_vocab_free(v);
    /* no template in the seeded file: ChatML, said */
    sh(1, GEN "-m %s/s.gguf --chat -p w -n 2 --tokens", g_dir);
    assert_non_null(strstr(out, "has no tokenizer.chat_template: ChatML"));
}

static void test_refusals(void **state)
{
    (void)state;
    sh(0, GEN "-m %s/h.gguf --chat -p w -n 2", g_dir);
    assert_non_null(strstr(out, "--chat needs a model with a GGUF vocabulary"));
    sh(0, GEN "-m %s/s.gguf -n 2", g_dir);
    assert_non_null(strstr(out, "the prompt has no tokens"));
    sh(0, GEN "-m %s/v.gguf --chat -p $(printf 'bad\\377') -n 2", g_dir);
    assert_non_null(strstr(out, "PROMPT is not valid UTF-8"));
}

static int setup(void **state)
{
    (void)state;
    if (access(ST_QWEN3_TOKENIZER, R_OK)) {
        fprintf(stderr, "test_engine_cli_vocab: %s not found: tests/ref is not installed (run "
                "make deps)\n", ST_QWEN3_TOKENIZER);
        return -1;
    }
    st_test_tmpdir(g_dir, sizeof g_dir, "engine_cli_vocab");
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny-tied --vocab-from %s -o "
              "%s/v.gguf && " BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny -o "
              "%s/s.gguf && " BIN "/strata-mkmodel --preset tiny -o %s/h.gguf",
       ST_QWEN3_TOKENIZER, g_dir, g_dir, g_dir);
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_prompt_tokens), cmocka_unit_test(test_chat),
        cmocka_unit_test(test_text),          cmocka_unit_test(test_eog),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
