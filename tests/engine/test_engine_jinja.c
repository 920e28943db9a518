/*
 * test_engine_jinja.c - the chat-template interpreter's error paths and bounds (parse errors
 * with line and column, loop / recursion / output / memory bounds, raise_exception's message,
 * break outside a loop), a few renders whose bytes @huggingface/jinja 0.5.11 gave, and a model's
 * template from a GGUF (bos / eos from the vocabulary, a bad template at load, ChatML).
 * test_chat_template_ref compares whole real templates with the reference.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <jansson.h>

#include "st_engine.h"
#include "st_test_util.h"

/* Render src with vars (a JSON text, or NULL) under lim (NULL: defaults); returns the rc and,
 * on success, the output in *out (caller frees). */
static int render(const char *src, const char *vars, const st_jinja_limits *lim, char **out)
{
    st_jinja *t = NULL;
    *out = NULL;
    int rc = st_jinja_parse(src, strlen(src), &t, NULL, NULL);
    if (rc)
        return rc;
    json_t *v = NULL;
    if (vars) {
        json_error_t je;
        v = json_loads(vars, 0, &je);
        assert_non_null(v);
    }
    rc = st_jinja_render(t, v, lim, out, NULL);
    json_decref(v);
    st_jinja_free(t);
    return rc;
}

static void expect_render(const char *src, const char *vars, const char *want)
{
    char *out = NULL;
    int rc = render(src, vars, NULL, &out);
    if (rc)
        fail_msg("%s: %s: %s", src, st_strerror(rc), st_errdetail());
    assert_string_equal(out, want);
    free(out);
}

static void expect_parse_error(const char *src, uint32_t line, uint32_t col, const char *what)
{
    st_jinja *t = NULL;
    uint32_t l = 0, c = 0;
    int rc = st_jinja_parse(src, strlen(src), &t, &l, &c);
    assert_int_equal(rc, ST_EINVAL);
    assert_null(t);
    assert_int_equal(l, line);
    assert_int_equal(c, col);
    char want[128];
    snprintf(want, sizeof want, "line %u, column %u: ", line, col);
    assert_non_null(strstr(st_errdetail(), want));
    assert_non_null(strstr(st_errdetail(), what));
}

static void test_parse_errors(void **state)
{
    (void)state;
    expect_parse_error("Hello\n  {{ x + }}", 2, 10, "unexpected '}}'");
    expect_parse_error("{% if x %}\nyes\n", 3, 1, "missing {% endif %}");
    expect_parse_error("{%- for m in messages %}\n\t{{ m }}\n{%- endfo %}", 3, 5,
                       "unknown statement endfo");
    expect_parse_error("{{ 'abc }}", 1, 4, "unterminated string literal");
    expect_parse_error("a\nb {{ x ? y }}", 2, 8, "unexpected character: ?");
    expect_parse_error("{# never closed", 1, 1, "missing end of comment tag");
    expect_parse_error("{{ '\\q' }}", 1, 5, "unexpected escaped character: q");
    /* positions are the source's, before lstrip_blocks / trim_blocks removed anything */
    expect_parse_error("  {% if a %}\n   {% if %}{% endif %}{% endif %}", 2, 10, "unexpected '%}'");
    /* nesting is bounded, not a stack overflow */
    char deep[4096];
    size_t n = 0;
    n += (size_t)snprintf(deep + n, sizeof deep - n, "{{ ");
    for (int i = 0; i < 1000; i++)
        deep[n++] = '(';
    deep[n] = 0;
    st_jinja *t = NULL;
    assert_int_equal(st_jinja_parse(deep, n, &t, NULL, NULL), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "nested deeper than"));
}

static void test_bounds(void **state)
{
    (void)state;
    st_jinja_limits lim;
    char *out = NULL;

    st_jinja_limits_default(&lim);
    lim.max_iterations = 1000;
    assert_int_equal(render("{% for i in range(40) %}{% for j in range(40) %}x{% endfor %}"
                            "{% endfor %}", NULL, &lim, &out), ST_ETOOBIG);
    assert_non_null(strstr(st_errdetail(), "max_iterations"));
    assert_non_null(strstr(st_errdetail(), "line 1, column 25"));
    lim.max_iterations = 3280; /* range() items count too: (40 + 40) + 40 * (40 + 40) */
    assert_int_equal(render("{% for i in range(40) %}{% for j in range(40) %}x{% endfor %}"
                            "{% endfor %}", NULL, &lim, &out), 0);
    assert_int_equal(strlen(out), 1600);
    free(out);

    st_jinja_limits_default(&lim);
    lim.max_depth = 10;
    assert_int_equal(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", NULL, &lim,
                            &out), ST_ETOOBIG);
    assert_non_null(strstr(st_errdetail(), "max_depth"));
    assert_int_equal(render("{% macro f(n) %}{% if n < 9 %}{{ f(n + 1) }}{% endif %}{{ n }}"
                            "{% endmacro %}{{ f(0) }}", NULL, &lim, &out), 0);
    assert_string_equal(out, "9876543210");
    free(out);

    st_jinja_limits_default(&lim);
    lim.max_output = 100;
    assert_int_equal(render("{% for i in range(20) %}0123456789{% endfor %}", NULL, &lim, &out),
                     ST_ETOOBIG);
    assert_non_null(strstr(st_errdetail(), "max_output"));

    /* strings doubled in a namespace: memory, not output, runs out first */
    st_jinja_limits_default(&lim);
    lim.max_output = (size_t)1 << 40;
    lim.max_memory = 4u << 20;
    assert_int_equal(render("{% set ns = namespace(s='x') %}{% for i in range(40) %}"
                            "{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s | length }}", NULL,
                            &lim, &out), ST_ETOOBIG);
    assert_non_null(strstr(st_errdetail(), "max_memory"));

    /* a namespace that holds itself: tojson stops at a depth, no stack overflow */
    assert_int_equal(render("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns | tojson }}",
                            NULL, NULL, &out), ST_ETOOBIG);
    assert_non_null(strstr(st_errdetail(), "nested deeper"));
}

static void test_runtime_errors(void **state)
{
    (void)state;
    char *out = NULL;
    assert_int_equal(render("{%- if not messages %}{{- raise_exception('No messages provided.') }}"
                            "{%- endif %}", "{\"messages\": []}", NULL, &out), ST_EINVAL);
    assert_string_equal(st_errdetail(), "raise_exception: No messages provided.");
    assert_null(out);
    assert_int_equal(render("a\n{{ none + 1 }}", NULL, NULL, &out), ST_EINVAL);
    assert_string_equal(st_errdetail(),
                        "line 2, column 9: Cannot perform operation on null values");
    assert_int_equal(render("{{ x | trim }}", "{\"x\": 1}", NULL, &out), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "Unknown NumericValue filter: trim"));
    assert_int_equal(render("{{ x | trim }}", "{\"x\": [1]}", NULL, &out), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "Unknown ArrayValue filter: trim"));
    assert_int_equal(render("{% break %}", NULL, NULL, &out), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "break or continue outside a loop"));
    assert_int_equal(render("{{ x }}", "{\"none\": 1}", NULL, &out), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "Variable already declared: none"));
    assert_int_equal(render("{{ x }}", "[1]", NULL, &out), ST_EINVAL);
}

/* Outputs @huggingface/jinja 0.5.11 gives for the same templates and variables. */
static void test_reference_renders(void **state)
{
    (void)state;
    expect_render("{{ none }}|{{ true }}|{{ 1.0 }}|{{ 2.5 }}|{{ 4/2 }}|{{ [1, 2.0, none, \"a\"] }}"
                  "|{{ {\"a\": 1.0} | tojson }}",
                  NULL, "|true|1.0|2.5|2.0|[1, 2, null, \"a\"]|{\"a\": 1}");
    expect_render("{{ \"abc\"[::-1] }}|{{ \"x\" ~ 1.0 }}|{{ [1,2] ~ \"\" }}|{{ nope }}"
                  "|{{ \"\\u00e9\" | tojson(ensure_ascii=true) }}",
                  NULL, "cba|x1|1,2||\"\\u00e9\"");
    expect_render("{{ o | tojson }}", "{\"o\": {\"b\": 1, \"2\": \"two\", \"1\": \"one\"}}",
                  "{\"1\": \"one\", \"2\": \"two\", \"b\": 1}");
    expect_render("{{ {\"b\": [1, {\"c\": 2}], \"e\": []} | tojson(indent=2) }}", NULL,
                  "{\n  \"b\": [\n    1,\n    {\n      \"c\": 2\n    }\n  ],\n  \"e\": []\n}");
    expect_render("{% for i in a %}{{ loop.index }}{{ loop.revindex0 }}{{ loop.first }}"
                  "{{ loop.last }};{% else %}none{% endfor %}",
                  "{\"a\": [3, 1]}", "11truefalse;20falsetrue;");
    expect_render("{% for i in a %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}"
                  "{% if i == 3 %}{% break %}{% endif %}{% endfor %}",
                  "{\"a\": [2, 1, 3, 4]}", "2");
    expect_render("   {%- if true %}\n  x\n{% endif %}\n  {# c #}\ny\n", NULL, "  x\ny");
    expect_render("a  {%- if true -%}  b  {%- endif -%}  c {{- \" d \" -}} e {# x -#}   f", NULL,
                  "abc d e f");
    expect_render("{{ s.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}",
                  "{\"s\": \"<think>\\n r \\n</think>\\n\\nA\"}", "r");
    expect_render("{{ 0.1 + 0.2 }}|{{ 0.0000001 * 1.0 }}|{{ 100000000000000000000.0 }}"
                  "|{{ -0.0 }}|{{ 1 / 3 }}",
                  NULL, "0.30000000000000004|1e-7|100000000000000000000.0|-0.0|0.3333333333333333");
    expect_render("{{ \"\\u00a0Thanks\\u3000\" | trim }}|{{ x is iterable }}|{{ x is mapping }}",
                  "{\"x\": {\"a\": 1}}", "Thanks|false|true");
}

static char *write_model(const char *dir, const char *name, const char *tmpl)
{
    static char path[512];
    snprintf(path, sizeof path, "%s/%s.gguf", dir, name);
    st_gguf_writer *w = NULL;
    const char *toks[] = {"<|begin_of_text|>", "hello", "<|eot_id|>"};
    assert_int_equal(st_gguf_writer_new(&w, 0), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    assert_int_equal(st_gguf_writer_set_str_arr(w, "tokenizer.ggml.tokens", toks, 3), 0);
    assert_int_equal(st_gguf_writer_set_u32(w, "tokenizer.ggml.bos_token_id", 0), 0);
    assert_int_equal(st_gguf_writer_set_u32(w, "tokenizer.ggml.eos_token_id", 2), 0);
    if (tmpl)
        assert_int_equal(st_gguf_writer_set_str(w, "tokenizer.chat_template", tmpl), 0);
    assert_int_equal(st_gguf_writer_write(w, path), 0);
    st_gguf_writer_free(w);
    return path;
}

static void test_model_template(void **state)
{
    (void)state;
    char dir[512];
    st_test_tmpdir(dir, sizeof dir, "test_engine_jinja");
    json_error_t je;
    json_t *conv = json_loads("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                              "\"add_generation_prompt\": true}", 0, &je);
    assert_non_null(conv);
    st_gguf *g = NULL;
    st_chat_template *ct = NULL;
    char *out = NULL;

    const char *tmpl = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ eos_token }}"
                       "{% endfor %}";
    assert_int_equal(st_gguf_open(write_model(dir, "ok", tmpl), &g), 0);
    assert_int_equal(st_chat_template_load(g, &ct), 0);
    assert_int_equal(st_chat_template_render(ct, conv, &out, NULL), 0);
    assert_string_equal(out, "<|begin_of_text|>hi<|eot_id|>");
    free(out);
    /* the conversation's own bos_token wins */
    json_t *c2 = json_deep_copy(conv);
    json_object_set_new(c2, "bos_token", json_string("[BOS]"));
    assert_int_equal(st_chat_template_render(ct, c2, &out, NULL), 0);
    assert_string_equal(out, "[BOS]hi<|eot_id|>");
    free(out);
    json_decref(c2);
    st_chat_template_free(ct);
    st_gguf_close(g);

    assert_int_equal(st_gguf_open(write_model(dir, "bad", "{% for m in messages %}\n{{ m.x }"),
                                  &g), 0);
    assert_int_equal(st_chat_template_load(g, &ct), ST_EINVAL);
    assert_null(ct);
    assert_non_null(strstr(st_errdetail(), "tokenizer.chat_template: line 2, column 8"));
    /* the fallback */
    assert_int_equal(st_chat_template_chatml(g, &ct), 0);
    assert_int_equal(st_chat_template_render(ct, conv, &out, NULL), 0);
    assert_string_equal(out, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
    free(out);
    st_chat_template_free(ct);
    st_gguf_close(g);

    assert_int_equal(st_gguf_open(write_model(dir, "none", NULL), &g), 0);
    assert_int_equal(st_chat_template_load(g, &ct), ST_ENOTFOUND);
    st_gguf_close(g);
    json_decref(conv);
    st_test_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_parse_errors),
        cmocka_unit_test(test_bounds),
        cmocka_unit_test(test_runtime_errors),
        cmocka_unit_test(test_reference_renders),
        cmocka_unit_test(test_model_template),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
