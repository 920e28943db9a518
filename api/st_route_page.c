/*
 * st_route_page.c - GET /: the web page (api/web/index.html, embedded at build time as
 * st_web_page), answered on the loop from the embedded bytes (referenced, never copied).
 */
#include "st_api_int.h"

/* The web page (api/web/index.html, embedded at build time), without credentials: it holds no
 * data and asks for the key. */
extern const unsigned char st_web_page[];
extern const size_t st_web_page_len;

void st_api_h_page(st_api_call *c)
{
    c->text = evbuffer_new();
    if (!c->text || evbuffer_add_reference(c->text, st_web_page, st_web_page_len, NULL, NULL)) {
        if (c->text)
            evbuffer_free(c->text);
        c->text = NULL;
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    c->file_ctype = "text/html; charset=utf-8";
    c->status = 200;
}
