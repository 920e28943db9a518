/*
 * fuzz_json_body.c - libFuzzer target for JSON request bodies as strata-server reads them: the
 * body parser every route with a JSON body runs (st_api_body_parse), then the typed field
 * readers the handlers check their fields with (st_api_json_only, st_api_json_opt_*), applied to
 * every field the body has. What a handler checks beyond them (a token id's range, a codec's
 * name) is tested by the integration tests, not here.
 *
 * Properties checked on every input:
 * 1. A refused body is 400 invalid_json, and its error reply is JSON that carries the code and
 *    the message (jansson quotes the input near the error, cut anywhere in a UTF-8 sequence:
 *    the reply escapes such bytes).
 * 2. An accepted body is empty (no body) or a JSON object.
 * 3. Each reader either accepts a field, with a value of its type and range, or refuses it with
 *    400 and an error reply of the same kind; a field missing or null is accepted as absent.
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

/* A refusal of c: status, code, and an error reply (st_http_error_body, as the server sends it)
 * that is JSON carrying the message. */
static void refused(st_api_call *c, int status)
{
    st_fuzz_require(c->status == status, "a refusal with another status");
    st_fuzz_require(c->err_code[0] != '\0' && c->err_msg, "a refusal without a code or a message");
    size_t len = 0;
    char *body = st_http_error_body(c->err_code, c->err_msg, &len);
    json_error_t e;
    json_t *o = body ? json_loadb(body, len, 0, &e) : NULL;
    json_t *err = json_object_get(o, "error");
    st_fuzz_require(o && !strcmp(json_string_value(json_object_get(err, "code")), c->err_code) &&
                        json_string_value(json_object_get(err, "message")),
                    "an error reply that does not carry the refusal");
    json_decref(o);
    free(body);
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
