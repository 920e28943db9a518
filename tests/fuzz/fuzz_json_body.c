/*
 * fuzz_json_body.c - libFuzzer target for JSON request bodies as strata-server reads them: the
 * body parser every route with a JSON body runs (st_api_body_parse), then the typed field
 * readers the handlers check their fields with (st_api_json_only, st_api_json_opt_*), applied to
 * every field the body has. What a handler checks beyond them (a token id's range, a codec's
 * name) is tested by the integration tests, not here.
 *
 * Properties checked on every input:
 * 1. A refused body is 400 invalid_json with a message that a JSON error reply can carry
 *    (valid UTF-8), and leaves nothing to use as a body but what the call frees.
 * 2. An accepted body is empty (no body) or a JSON object.
 * 3. Each reader either accepts a field, with a value of its type and range, or refuses it with
 *    400 and a code and message a reply can carry; a field missing or null is accepted as absent.
 */
#include <string.h>

#include "st_api_int.h"
#include "st_fuzz.h"

static void call_reset(st_api_call *c)
{
    free(c->err_msg);
    json_decref(c->reply);
    c->err_msg = NULL;
    c->reply = NULL;
    c->status = 0;
    c->err_code[0] = '\0';
}

/* A refusal of c: status, code, and a message a JSON reply can carry. */
static void refused(st_api_call *c, int status)
{
    st_fuzz_require(c->status == status, "a refusal with another status");
    st_fuzz_require(c->err_code[0] != '\0', "a refusal without a code");
    json_t *m = c->err_msg ? json_string(c->err_msg) : NULL;
    st_fuzz_require(m != NULL, "an error message that is not valid UTF-8");
    json_decref(m);
    call_reset(c);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    st_api_call c;
    memset(&c, 0, sizeof c);
    if (st_api_body_parse(&c, (const char *)data, size)) {
        st_fuzz_require(!strcmp(c.err_code, "invalid_json"), "a refusal that is not invalid_json");
        refused(&c, 400);
        json_decref(c.body);
        return 0;
    }
    st_fuzz_require(size == 0 ? c.body == NULL : json_is_object(c.body), "an accepted body is no object");
    const char *key;
    json_t *v;
    json_object_foreach(c.body, key, v) {
        uint64_t u = 0;
        double d = 0;
        const char *s = NULL;
        int b = -1, given = 0;
        if (st_api_json_opt_u64(&c, key, UINT64_MAX >> 1, &u, &given) == 0)
            st_fuzz_require(json_is_null(v) ? !given
                                            : given && json_is_integer(v) && u == (uint64_t)json_integer_value(v),
                            "an integer field read wrong");
        else
            refused(&c, 400);
        if (st_api_json_opt_str(&c, key, &s) == 0)
            st_fuzz_require(json_is_null(v) ? s == NULL : s != NULL && s == json_string_value(v),
                            "a string field read wrong");
        else
            refused(&c, 400);
        if (st_api_json_opt_double(&c, key, &d, &given) == 0)
            st_fuzz_require(json_is_null(v) ? !given : given && json_is_number(v), "a number field read wrong");
        else
            refused(&c, 400);
        if (st_api_json_opt_bool(&c, key, &b) == 0)
            st_fuzz_require(json_is_null(v) ? b == -1 : json_is_boolean(v) && b == json_is_true(v),
                            "a boolean field read wrong");
        else
            refused(&c, 400);
        const char *const only[] = {key, NULL};
        st_fuzz_require(json_object_size(c.body) == 1 ? st_api_json_only(&c, only) == 0
                                                      : st_api_json_only(&c, only) != 0,
                        "unknown fields not refused");
        if (c.status)
            refused(&c, 400);
    }
    json_decref(c.body);
    return 0;
}
