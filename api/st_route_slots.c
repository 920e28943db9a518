/*
 * st_route_slots.c - llama.cpp's /slots: GET /slots lists the slots, POST /slots/{n}?action=
 * save|restore|erase saves slot n to a file of --slot-save-path, restores it from one, or empties
 * it (the conversation manager's st_conv_slot_action).
 *
 * Invariant: a file name is a plain name (filename_ok), never a path: nothing outside
 * --slot-save-path is read or written.
 */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "st_api_int.h"

void st_api_h_slots_list(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    uint32_t n = st_conv_n_slots(cv);
    st_conv_slot_info *si = malloc((n ? n : 1) * sizeof *si);
    if (!si) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    st_conv_slots_get(cv, si);
    json_t *a = json_array();
    for (uint32_t i = 0; i < n; i++)
        json_array_append_new(a, json_pack("{s:i,s:o,s:I,s:b,s:I}", "id", (int)i, "session",
                                           si[i].id[0] ? json_string(si[i].id) : json_null(), "n_tokens",
                                           (json_int_t)si[i].tokens, "is_processing", si[i].busy,
                                           "n_ctx", (json_int_t)st_conv_n_ctx(cv)));
    free(si);
    c->reply = a;
    c->status = 200;
}

static int filename_ok(const char *f)
{
    size_t n = strlen(f);
    if (!n || n > 128)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)f[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return 0;
    }
    return 1;
}

void st_api_h_slots_action(st_api_call *c)
{
    st_conv *cv = st_api_conv(c->srv);
    const st_api_config *cfg = st_api_cfg(c->srv);
    char action[16] = "";
    const char *q = st_http_req_query(c->req);
    /* the query is tiny and already bounded by the header limit */
    const char *a = q ? strstr(q, "action=") : NULL;
    if (a && (a == q || a[-1] == '&')) {
        size_t n = strcspn(a + 7, "&");
        if (n < sizeof action) {
            memcpy(action, a + 7, n);
            action[n] = '\0';
        }
    }
    if (strcmp(action, "save") && strcmp(action, "restore") && strcmp(action, "erase")) {
        st_api_call_error(c, 400, "invalid_param", "action must be save, restore or erase");
        return;
    }
    uint64_t n = 0;
    const char *p = c->arg2;
    if (!*p || strlen(p) > 6)
        goto bad_slot;
    for (; *p; p++) {
        if (*p < '0' || *p > '9')
            goto bad_slot;
        n = n * 10 + (uint64_t)(*p - '0');
    }
    if (n >= st_conv_n_slots(cv))
        goto bad_slot;
    static const char *const keys[] = {"filename", "compress", NULL};
    const char *fname = NULL;
    uint64_t compress = 0; /* save: the zstd level of the file's checkpoints (docs/API.md) */
    if (st_api_json_only(c, keys) || st_api_json_opt_str(c, "filename", &fname) ||
        st_api_json_opt_u64(c, "compress", 19, &compress, NULL))
        return;
    char path[PATH_MAX];
    if (strcmp(action, "erase")) {
        if (!cfg->slot_save_path) {
            st_api_call_error(c, 501, "not_configured", "start the server with --slot-save-path DIR");
            return;
        }
        if (!fname || !filename_ok(fname)) {
            st_api_call_error(c, 400, "invalid_filename",
                              "\"filename\" must be a plain file name (A-Z a-z 0-9 . _ -, not starting "
                              "with '.'), never a path");
            return;
        }
        if (snprintf(path, sizeof path, "%s/%s", cfg->slot_save_path, fname) >= (int)sizeof path) {
            st_api_call_error(c, 400, "invalid_filename", "path too long");
            return;
        }
    }
    int j = (int)n;
    int act = !strcmp(action, "erase") ? ST_CONV_SLOT_ERASE
              : !strcmp(action, "save") ? ST_CONV_SLOT_SAVE : ST_CONV_SLOT_RESTORE;
    st_conv_slot_result r;
    int rc = st_conv_slot_action(cv, (uint32_t)j, act, act == ST_CONV_SLOT_ERASE ? NULL : path,
                                 cfg->state_codec, (int)compress, &r);
    if (rc && r.refused) {
        st_api_call_error(c, 409, r.refused, "%s", st_errdetail());
        return;
    }
    if (rc) {
        st_api_call_fail(c, rc, action);
        return;
    }
    if (act == ST_CONV_SLOT_ERASE)
        c->reply = json_pack("{s:i,s:I}", "id_slot", j, "n_erased", (json_int_t)r.tokens);
    else if (act == ST_CONV_SLOT_SAVE)
        c->reply = json_pack("{s:i,s:s,s:I,s:I,s:{s:f}}", "id_slot", j, "filename", fname,
                             "n_saved", (json_int_t)r.tokens, "n_written",
                             (json_int_t)r.file_bytes, "timings", "save_ms", st_api_ms(r.ms));
    else
        c->reply = json_pack("{s:i,s:s,s:s,s:I,s:I,s:{s:f}}", "id_slot", j, "session", r.session,
                             "filename", fname, "n_restored", (json_int_t)r.tokens,
                             "n_read", (json_int_t)r.file_bytes, "timings", "restore_ms",
                             st_api_ms(r.ms));
    c->status = 200;
    return;
bad_slot:
    st_api_call_error(c, 404, "not_found", "no slot %s (slots are 0..%u)", c->arg2,
                      st_conv_n_slots(cv) - 1);
}
