/*
 * fuzz_http_head.c - libFuzzer target for strata-server's request-head parser
 * (st_http_head_parse: the parser a connection runs once it holds a whole head). The input is
 * what a client sends; the head is cut where a connection cuts it (leading empty lines skipped,
 * through the first empty line, within the default 16 KiB), and inputs without one are dropped,
 * as a connection would wait for more or refuse with 431 before parsing.
 *
 * Properties checked on every head:
 * 1. A refused head gets a status a client can act on (400, 411, 413, 431, 505), with an error
 *    code and a message.
 * 2. An accepted head is what the router relies on: a method that is a token, a path that starts
 *    with '/' and holds only visible ASCII without '#' or '?', a query of the same bytes, a
 *    Content-Length of digits only, and no Transfer-Encoding.
 */
#include <string.h>

#include "st_api_int.h"
#include "st_fuzz.h"

#define FUZZ_HEAD_MAX (16u << 10) /* strata-server's default --max-header-bytes */
#define FUZZ_HEADERS_MAX 64       /* and --max-headers */

static int visible(const char *s)
{
    for (const unsigned char *q = (const unsigned char *)s; *q; q++)
        if (*q < 0x21 || *q > 0x7e || *q == '#')
            return 0;
    return 1;
}

static int token(const char *s)
{
    if (!*s)
        return 0;
    for (const unsigned char *q = (const unsigned char *)s; *q; q++)
        if (!strchr("!#$%&'*+-.^_`|~", *q) && !(*q >= '0' && *q <= '9') &&
            !(*q >= 'a' && *q <= 'z') && !(*q >= 'A' && *q <= 'Z'))
            return 0;
    return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t start = 0, end = 0;
    while (start < size && (data[start] == '\r' || data[start] == '\n'))
        start++;
    size_t n = size - start < FUZZ_HEAD_MAX ? size - start : FUZZ_HEAD_MAX;
    const uint8_t *p = data + start;
    for (size_t i = 0; i < n && !end; i++) {
        if (p[i] != '\n')
            continue;
        if (i + 1 < n && p[i + 1] == '\n')
            end = i + 2;
        else if (i + 2 < n && p[i + 1] == '\r' && p[i + 2] == '\n')
            end = i + 3;
    }
    if (!end)
        return 0;

    st_http_req *r = NULL;
    const char *code = NULL;
    char msg[256] = "";
    int st = st_http_head_parse(p, end, FUZZ_HEADERS_MAX, &r, &code, msg, sizeof msg);
    if (st) {
        st_fuzz_require(r == NULL, "a request after a refusal");
        st_fuzz_require(st == 400 || st == 411 || st == 413 || st == 431 || st == 505,
                        "a refusal with an unexpected status");
        st_fuzz_require(code && *code && msg[0], "a refusal without a code or a message");
        return 0;
    }
    st_fuzz_require(r != NULL, "no request");
    st_fuzz_require(token(st_http_req_method_name(r)), "a method that is not a token");
    const char *path = st_http_req_path(r), *query = st_http_req_query(r);
    st_fuzz_require(path[0] == '/' && visible(path) && !strchr(path, '?'), "a malformed path");
    st_fuzz_require(!query || visible(query), "a malformed query");
    const char *cl = st_http_req_header(r, "content-length");
    st_fuzz_require(!cl || (cl[0] && strspn(cl, "0123456789") == strlen(cl)), "a malformed Content-Length");
    st_fuzz_require(!st_http_req_header(r, "transfer-encoding"), "a Transfer-Encoding accepted");
    st_http_head_free(r);
    return 0;
}
