/*
 * st_route_metrics.c - the routes answered from memory on the loop: GET /healthz (liveness, the
 * slots, the park pool, the quarantined sessions) and GET /metrics (Prometheus text, st_metrics.c).
 * Invariant: they read counters and gauges only; nothing here blocks the loop.
 */
#include <string.h>

#include "st_api_int.h"

/* ---- routes answered on the loop ---------------------------------------------------------- */

void st_api_h_healthz(st_api_call *c)
{
    st_api_server *s = c->srv;
    st_metrics *m = &s->metrics;
    c->status = s->stopping ? 503 : 200;
    c->reply = json_pack("{s:s,s:f,s:b,s:i,s:i,s:{s:i,s:i,s:i},s:{s:I,s:I,s:I}}", "status",
                         s->stopping ? "stopping" : "ok", "uptime_s",
                         st_api_ms(st_api_now_ms() - s->t_start) / 1000.0, "engine", s->conv != NULL,
                         "connections", (int)st_http_n_connections(s->http), "jobs",
                         (int)st_work_outstanding(s->work), "slots", "total", (int)m->conv.slots_total,
                         "bound", (int)m->conv.slots_bound, "busy", (int)m->conv.slots_busy, "park_pool",
                         "ram_bytes", (json_int_t)m->conv.pool_ram_bytes, "ram_entries",
                         (json_int_t)m->conv.pool_ram_entries, "disk_entries",
                         (json_int_t)m->conv.pool_disk_entries);
    json_t *dmg = json_array();
    for (size_t i = 0; i < s->n_damaged; i++)
        json_array_append_new(dmg, json_pack("{s:s,s:s}", "id", s->damaged[i].id, "why", s->damaged[i].why));
    json_object_set_new(c->reply, "damaged_sessions", dmg);
    if (s->stopping) { /* a 503 goes out as an error body */
        st_api_call_error(c, 503, "stopping", "the server is shutting down");
    }
}

void st_api_h_metrics(st_api_call *c)
{
    st_api_server *s = c->srv;
    c->text = evbuffer_new();
    if (!c->text) {
        st_api_call_error(c, 503, "out_of_memory", "no memory");
        return;
    }
    c->file_ctype = "text/plain; version=0.0.4; charset=utf-8";
    c->status = 200;
    st_http_stats hs;
    st_http_stats_get(s->http, &hs);
    st_engine_wcache wc;
    memset(&wc, 0, sizeof wc);
    st_engine_xcache xc;
    memset(&xc, 0, sizeof xc);
    if (s->conv) {
        st_conv_wcache(s->conv, &wc);
        st_conv_xcache(s->conv, &xc);
    }
    st_metrics_render(&s->metrics, c->text, &hs, st_work_outstanding(s->work), st_work_queued(s->work),
                      &wc, &xc);
}
