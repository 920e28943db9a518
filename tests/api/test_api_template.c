/*
 * test_api_template.c - POST /apply-template (llama.cpp's: a chat request's messages in,
 * {"prompt": ...} out) on the real strata-server on loopback: the model's own chat template,
 * parsed at load; ChatML, saying so, for a model without one and for one whose template does not
 * parse (the log names its line and column); a template error is 500 with the detail, and the
 * server keeps serving; a body without messages is 400; a long conversation fits (the limit is
 * --max-completion-kib's).
 */
#include <stdlib.h>
#include <string.h>

#include "st_api_test.h"
#include "st_engine.h"

static st_at_env env = {.backend = "cpu"};

/* A ChatML template with a thinking switch, as Qwen3's, and a raise_exception. */
static const char qwen_like[] =
    "{%- for m in messages -%}\n"
    "{%- if m.role == 'bad' %}{{ raise_exception('no role bad') }}{% endif -%}\n"
    "{{- '<|im_start|>' + m.role + '\\n' + m.content | trim + '<|im_end|>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}\n"
    "{%- if enable_thinking is defined and not enable_thinking -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}{%- endif -%}{%- endif -%}";

/* The tiny model with tokenizer.chat_template = tmpl, at path. */
static void with_template(const char *path, const char *tmpl)
{
    st_gguf *g;
    st_gguf_writer *w;
    assert_int_equal(st_gguf_open(env.model, &g), 0);
    assert_int_equal(st_gguf_writer_new(&w, 0), 0);
    for (uint64_t i = 0; i < st_gguf_n_kv(g); i++)
        if (strcmp(st_gguf_kv_key(g, i), "general.alignment"))
            assert_int_equal(st_gguf_writer_copy_kv(w, g, i), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "tokenizer.chat_template", tmpl), 0);
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        assert_int_equal(
            st_gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->dims, t->data), 0);
    }
    assert_int_equal(st_gguf_writer_write(w, path), 0);
    st_gguf_writer_free(w);
    st_gguf_close(g);
}

/* A server on model with its log in DIR/log. */
static void start(st_hc_server *s, st_at_env *e, const char *model, const char *store,
                  const char *log)
{
    *e = env;
    int n = snprintf(e->model, sizeof e->model, "%s", model);
    assert_true(n > 0 && (size_t)n < sizeof e->model);
    n = snprintf(e->logpath, sizeof e->logpath, "%s/%s", env.dir, log);
    assert_true(n > 0 && (size_t)n < sizeof e->logpath);
    assert_int_equal(st_at_server_start(s, e, store, NULL, NULL), 0);
}

static void prompt_is(uint16_t port, const char *body, const char *want)
{
    json_t *o = st_at_call(port, "POST", "/apply-template", body, 200);
    assert_string_equal(json_string_value(json_object_get(o, "prompt")), want);
    assert_int_equal(json_object_size(o), 1);
    json_decref(o);
}

static int log_has(const st_at_env *e, const char *what)
{
    size_t n = 0, w = strlen(what);
    unsigned char *b = st_test_slurp(e->logpath, &n); /* not NUL-terminated */
    int has = 0;
    for (size_t i = 0; b && !has && i + w <= n; i++)
        has = !memcmp(b + i, what, w);
    free(b);
    return has;
}

static const char two_turns[] =
    "{\"messages\":[{\"role\":\"system\",\"content\":\"Be brief.\"},"
    "{\"role\":\"user\",\"content\":\" Hi \"}]";

static void test_model_template(void **state)
{
    (void)state;
    char model[4400], body[512];
    snprintf(model, sizeof model, "%s/qwen-like.gguf", env.dir);
    with_template(model, qwen_like);
    st_hc_server s;
    st_at_env e;
    start(&s, &e, model, "store-own", "own.log");
    /* add_generation_prompt is true by default, as in llama.cpp */
    snprintf(body, sizeof body, "%s}", two_turns);
    prompt_is(s.port, body,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n");
    snprintf(body, sizeof body, "%s,\"add_generation_prompt\":false}", two_turns);
    prompt_is(s.port, body,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n");
    snprintf(body, sizeof body, "%s,\"chat_template_kwargs\":{\"enable_thinking\":false}}",
             two_turns);
    prompt_is(s.port, body,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\n");
    snprintf(body, sizeof body, "%s,\"enable_thinking\":false}", two_turns);
    prompt_is(s.port, body,
              "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
              "<|im_start|>assistant\n<think>\n\n</think>\n\n");
    /* a template error: 500 with the detail; the server keeps serving */
    json_t *o = st_at_call(s.port, "POST", "/apply-template",
                           "{\"messages\":[{\"role\":\"bad\",\"content\":\"x\"}]}", 500);
    json_t *err = json_object_get(o, "error");
    assert_string_equal(json_string_value(json_object_get(err, "code")), "template_error");
    assert_non_null(strstr(json_string_value(json_object_get(err, "message")), "no role bad"));
    json_decref(o);
    /* bad bodies */
    json_decref(st_at_call(s.port, "POST", "/apply-template", "{\"prompt\":\"x\"}", 400));
    json_decref(st_at_call(s.port, "POST", "/apply-template",
                           "{\"messages\":[],\"chat_template_kwargs\":1}", 400));
    prompt_is(s.port, "{\"messages\":[],\"add_generation_prompt\":false}", "");
    /* a long conversation: the body limit is --max-completion-kib's, not --max-json-kib's */
    size_t big = 100000;
    char *long_body = malloc(big + 128), *want = malloc(big + 128);
    assert_non_null(long_body);
    assert_non_null(want);
    int n = snprintf(long_body, big + 128, "{\"messages\":[{\"role\":\"user\",\"content\":\"");
    memset(long_body + n, 'a', big);
    snprintf(long_body + n + big, 128 - (size_t)n, "\"}],\"add_generation_prompt\":false}");
    n = snprintf(want, big + 128, "<|im_start|>user\n");
    memset(want + n, 'a', big);
    snprintf(want + n + big, 128 - (size_t)n, "<|im_end|>\n");
    prompt_is(s.port, long_body, want);
    free(long_body);
    free(want);
    assert_false(log_has(&e, "ChatML"));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static const char chatml_two_turns[] =
    "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n Hi <|im_end|>\n"
    "<|im_start|>assistant\n";

static void test_no_template_chatml(void **state)
{
    (void)state;
    char body[512];
    st_hc_server s;
    st_at_env e;
    start(&s, &e, env.model, "store-none", "none.log");
    snprintf(body, sizeof body, "%s}", two_turns);
    prompt_is(s.port, body, chatml_two_turns);
    assert_true(
        log_has(&e, "the model has no tokenizer.chat_template: the chat template is ChatML"));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static void test_bad_template_chatml(void **state)
{
    (void)state;
    char model[4400], body[512];
    snprintf(model, sizeof model, "%s/bad.gguf", env.dir);
    with_template(model, "{% for m in messages %}\n  {{ m.content }\n{% endfor %}");
    st_hc_server s;
    st_at_env e;
    start(&s, &e, model, "store-bad", "bad.log");
    snprintf(body, sizeof body, "%s}", two_turns);
    prompt_is(s.port, body, chatml_two_turns);
    assert_true(log_has(&e, "tokenizer.chat_template: line 2, column"));
    assert_true(log_has(&e, "the chat template is ChatML"));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

static int setup(void **state)
{
    (void)state;
    return st_at_setup(&env, "test_api_template");
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_model_template),
        cmocka_unit_test(test_no_template_chatml),
        cmocka_unit_test(test_bad_template_chatml),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
