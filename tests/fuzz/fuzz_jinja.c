/*
 * fuzz_jinja.c - libFuzzer target for the chat-template interpreter (st_jinja_parse, then
 * st_jinja_render with a fixed conversation), which runs whatever template a model file carries.
 *
 * Properties checked on every input:
 * 1. A template refused by the parser ends in ST_EINVAL (or ST_ETOOBIG) with a detail naming its
 *    line and column, and no handle.
 * 2. A render either succeeds with a NUL-terminated output within max_output, or ends in a
 *    typed error with a detail; the bounds hold (small ones here, so loops and recursion end).
 */
#include <errno.h>
#include <jansson.h>
#include <stdlib.h>
#include <string.h>

#include "st_engine.h"
#include "st_fuzz.h"

static const char conversation[] =
    "{\"messages\": [{\"role\": \"system\", \"content\": \"Be brief.\"},"
    " {\"role\": \"user\", \"content\": \"Hi \\u00e9 \\ud83d\\ude42\"},"
    " {\"role\": \"assistant\", \"content\": \"<think>\\nr\\n</think>\\n\\nHello\","
    "  \"tool_calls\": [{\"type\": \"function\", \"function\": {\"name\": \"f\","
    "   \"arguments\": {\"a\": 1, \"b\": [2.5, null, true]}}}]},"
    " {\"role\": \"tool\", \"content\": \"ok\"}],"
    " \"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}],"
    " \"add_generation_prompt\": true, \"enable_thinking\": false,"
    " \"bos_token\": \"<s>\", \"eos_token\": \"</s>\"}";

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_jinja *t = NULL;
    uint32_t line = 0, col = 0;
    int rc = st_jinja_parse((const char *)data, size, &t, &line, &col);
    if (rc != 0) {
        st_fuzz_require(t == NULL, "a handle after an error");
        st_fuzz_require(rc == ST_EINVAL || rc == ST_ETOOBIG || rc == ENOMEM, "an untyped error");
        st_fuzz_require(rc != ST_EINVAL || (line >= 1 && col >= 1 &&
                                            strstr(st_errdetail(), "line ") != NULL),
                        "a syntax error without its line and column");
        return 0;
    }
    json_error_t je;
    json_t *vars = json_loads(conversation, 0, &je);
    st_fuzz_require(vars != NULL, "the conversation does not parse");
    st_jinja_limits lim;
    st_jinja_limits_default(&lim);
    lim.max_iterations = 20000;
    lim.max_depth = 16;
    lim.max_output = 1 << 16;
    lim.max_memory = 32u << 20;
    char *out = NULL;
    size_t len = 0;
    rc = st_jinja_render(t, vars, &lim, &out, &len);
    if (rc == 0) {
        st_fuzz_require(out != NULL && out[len] == '\0' && len <= lim.max_output,
                        "an output beyond its bound or unterminated");
    } else {
        st_fuzz_require(out == NULL, "an output after an error");
        st_fuzz_require(st_fuzz_typed(rc), "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
    }
    free(out);
    json_decref(vars);
    st_jinja_free(t);
    return 0;
}
