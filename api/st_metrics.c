/*
 * st_metrics.c - counters and latency histograms, rendered in Prometheus' text format.
 * Per-route figures are touched by the loop thread only; the rest are atomics any thread adds to.
 */
#include <stdio.h>
#include <string.h>

#include "st_api_int.h"
#include "st_prefix.h"
#include "st_tiernode.h"

const double st_metrics_bucket_ms[ST_METRICS_BUCKETS] = {0.5, 1,   2.5,  5,    10,   25,   50,  100,
                                                         250, 500, 1000, 2500, 5000, 10000, 30000};

void st_metrics_init(st_metrics *m)
{
    memset(m, 0, sizeof *m);
    pthread_mutex_init(&m->store_mu, NULL);
}

void st_metrics_store_set(st_metrics *m, const st_store_stats *ss)
{
    pthread_mutex_lock(&m->store_mu);
    m->store = *ss;
    m->store_ok = 1;
    pthread_mutex_unlock(&m->store_mu);
}

int st_metrics_route(st_metrics *m, const char *name)
{
    for (uint32_t i = 0; i < m->n_routes; i++)
        if (!strcmp(m->route_name[i], name))
            return (int)i;
    if (m->n_routes >= ST_METRICS_ROUTES_MAX)
        return (int)ST_METRICS_ROUTES_MAX - 1;
    m->route_name[m->n_routes] = name;
    return (int)m->n_routes++;
}

void st_metrics_request(st_metrics *m, int route, int status, double ms)
{
    if (route < 0 || (uint32_t)route >= m->n_routes)
        return;
    int cls = status / 100;
    if (cls >= 1 && cls <= 5)
        m->req_by_class[route][cls]++;
    for (int b = 0; b < ST_METRICS_BUCKETS; b++)
        if (ms <= st_metrics_bucket_ms[b])
            m->lat_bucket[route][b]++;
    m->lat_count[route]++;
    m->lat_sum[route] += ms / 1000.0;
}

void st_metrics_refused(st_metrics *m, int status)
{
    int cls = status / 100;
    if (cls >= 1 && cls <= 5)
        m->refused[cls]++;
}

#define U(x) ((unsigned long long)(x))

static void counter(struct evbuffer *o, const char *name, const char *help, uint64_t v)
{
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s counter\n%s %llu\n", name, help, name, name, U(v));
}

static void gauge(struct evbuffer *o, const char *name, const char *help, double v)
{
    evbuffer_add_printf(o, "# HELP %s %s\n# TYPE %s gauge\n%s %.17g\n", name, help, name, name, v);
}

/* The store's figures and its free map (docs/API.md, "GET /metrics"): the map's pages are those
 * that hold data, those on LMDB's free list, and the part of the map beyond the data file's last
 * page, so strata_store_used_bytes + _free_bytes + _unallocated_bytes = strata_store_map_bytes. */
static void store_render(struct evbuffer *o, const st_store_stats *ss)
{
    uint64_t ps = ss->page_size, map_pages = ps ? ss->map_size / ps : 0;
    uint64_t used = ss->pages_used > ss->pages_free ? ss->pages_used - ss->pages_free : 0;
    uint64_t tail = map_pages > ss->pages_used ? map_pages - ss->pages_used : 0;
    gauge(o, "strata_store_sessions", "Sessions in the store (disk-parked conversations included).",
          (double)ss->sessions);
    gauge(o, "strata_store_versions", "Versions in the store.", (double)ss->versions);
    gauge(o, "strata_store_logical_bytes", "Image bytes of every version.", (double)ss->logical_bytes);
    gauge(o, "strata_store_stored_bytes", "Bytes of the distinct chunks stored.", (double)ss->stored_bytes);
    gauge(o, "strata_store_dedup_ratio", "Referenced chunk bytes / distinct chunk bytes.", ss->dedup_ratio);
    gauge(o, "strata_store_page_bytes", "Bytes of one page of the store's map.", (double)ps);
    gauge(o, "strata_store_map_bytes", "Size of the store's map (what data.mdb may grow to now).",
          (double)ss->map_size);
    gauge(o, "strata_store_used_bytes", "Map pages that hold data.", (double)(used * ps));
    gauge(o, "strata_store_free_bytes", "Map pages on LMDB's free list, reused by later writes.",
          (double)(ss->pages_free * ps));
    gauge(o, "strata_store_unallocated_bytes", "Map beyond the data file's last page.", (double)(tail * ps));
    gauge(o, "strata_store_free_run_bytes", "The longest run of consecutive free pages.",
          (double)(ss->pages_free_run * ps));
    gauge(o, "strata_store_reclaimable_bytes", "Bytes of chunks no version references, freed by a gc.",
          (double)ss->zero_count_bytes);
    gauge(o, "strata_store_file_bytes", "Bytes data.mdb occupies on disk.", (double)ss->file_bytes);
    gauge(o, "strata_store_budget_bytes", "Most bytes the map may grow to.", (double)ss->budget);
}

void st_metrics_render(st_metrics *m, struct evbuffer *o, const st_http_stats *http,
                       uint32_t work_outstanding, uint32_t work_queued, const st_engine_wcache *wc,
                       const st_engine_xcache *xc)
{
    evbuffer_add_printf(o, "# HELP strata_http_requests_total Requests answered, by route and "
                           "status class.\n# TYPE strata_http_requests_total counter\n");
    for (uint32_t r = 0; r < m->n_routes; r++)
        for (int c = 1; c <= 5; c++)
            if (m->req_by_class[r][c])
                evbuffer_add_printf(o, "strata_http_requests_total{route=\"%s\",code=\"%dxx\"} %llu\n",
                                    m->route_name[r], c, U(m->req_by_class[r][c]));
    for (int c = 1; c <= 5; c++)
        if (m->refused[c])
            evbuffer_add_printf(o, "strata_http_requests_total{route=\"(refused)\",code=\"%dxx\"} %llu\n",
                                c, U(m->refused[c]));
    evbuffer_add_printf(o, "# HELP strata_http_request_duration_seconds Time from a complete "
                           "request to its reply, by route.\n"
                           "# TYPE strata_http_request_duration_seconds histogram\n");
    for (uint32_t r = 0; r < m->n_routes; r++) {
        if (!m->lat_count[r])
            continue;
        for (int b = 0; b < ST_METRICS_BUCKETS; b++)
            evbuffer_add_printf(o, "strata_http_request_duration_seconds_bucket{route=\"%s\",le=\"%g\"} %llu\n",
                                m->route_name[r], st_metrics_bucket_ms[b] / 1000.0, U(m->lat_bucket[r][b]));
        evbuffer_add_printf(o, "strata_http_request_duration_seconds_bucket{route=\"%s\",le=\"+Inf\"} %llu\n",
                            m->route_name[r], U(m->lat_count[r]));
        evbuffer_add_printf(o, "strata_http_request_duration_seconds_sum{route=\"%s\"} %.6f\n",
                            m->route_name[r], m->lat_sum[r]);
        evbuffer_add_printf(o, "strata_http_request_duration_seconds_count{route=\"%s\"} %llu\n",
                            m->route_name[r], U(m->lat_count[r]));
    }
    gauge(o, "strata_http_connections", "Open client connections.", http->connections);
    gauge(o, "strata_http_connections_idle",
          "Open connections without a request in progress (idle, or a head arriving).", http->idle);
    gauge(o, "strata_http_peers", "Client addresses with open connections.", http->peers);
    gauge(o, "strata_http_body_bytes", "Request body bytes held now.", (double)http->body_bytes);
    counter(o, "strata_http_connections_shed_total",
            "Idle connections closed to make room (connection cap or per-address limit).", http->shed);
    counter(o, "strata_http_connections_refused_total",
            "New connections refused with 503: every connection of their address was busy.",
            http->peer_refused);
    gauge(o, "strata_worker_jobs", "Jobs submitted to workers and not yet answered.", work_outstanding);
    gauge(o, "strata_worker_queue", "Jobs waiting for a worker.", work_queued);
    /* the CUDA backend's BF16 -> FP16 weight-conversion cache (0 everywhere when it is off) */
    gauge(o, "strata_wcache_fp16", "1: BF16 weights' products run on FP16 tensor cores "
          "(STRATA_BF16_TC).", wc->fp16);
    gauge(o, "strata_wcache_arena_bytes", "Device bytes held by the weight-conversion arena.",
          (double)wc->arena_bytes);
    gauge(o, "strata_wcache_used_bytes", "Bytes of the arena its entries span.", (double)wc->used_bytes);
    gauge(o, "strata_wcache_entries", "Converted weights resident in the arena.", (double)wc->entries);
    counter(o, "strata_wcache_hits_total", "Products whose weight was found converted.", wc->hits);
    counter(o, "strata_wcache_misses_total", "Products whose weight was not in the arena.", wc->misses);
    counter(o, "strata_wcache_bypassed_total",
            "Misses converted per call: no room in the arena (nothing is evicted).", wc->bypassed);
    counter(o, "strata_wcache_invalidations_total", "Times the arena was emptied.", wc->invalidations);
    /* the CUDA backend's routed-expert cache (--expert-cache-mib; 0 everywhere when it is off) */
    gauge(o, "strata_xcache_host", "1: the routed experts stay in host memory (--expert-cache-mib).",
          xc->host);
    gauge(o, "strata_xcache_arena_bytes", "Device bytes of the routed-expert arena (0: streamed).",
          (double)xc->arena_bytes);
    gauge(o, "strata_xcache_slots", "Expert records the arena holds.", xc->slots);
    gauge(o, "strata_xcache_record_bytes", "Bytes of one expert record (gate, up and down).",
          (double)xc->record_bytes);
    counter(o, "strata_xcache_hits_total", "Selected experts found in the arena.", xc->hits);
    counter(o, "strata_xcache_misses_total", "Selected experts loaded into the arena.", xc->misses);
    counter(o, "strata_xcache_evictions_total", "Records evicted from the arena (least recently "
            "used).", xc->evictions);
    counter(o, "strata_xcache_uploaded_bytes_total", "Expert bytes copied host to device (arena and "
            "streamed).", xc->bytes_uploaded);
    counter(o, "strata_xcache_streamed_total", "One token's experts of one layer uploaded to the "
            "compact buffer instead of the arena.", xc->streamed);
    counter(o, "strata_xcache_load_failures_total", "Uploads into the arena that failed (that call "
            "streamed).", xc->load_failures);

    counter(o, "strata_saves_total", "Conversations saved to the store (SAVE, uploads).", m->conv.saves);
    counter(o, "strata_saved_bytes_total", "Image bytes saved (logical).", m->conv.save_logical_bytes);
    counter(o, "strata_saved_new_stored_bytes_total",
            "Bytes the saves added to the store (new chunks, as stored).", m->conv.save_new_bytes);
    counter(o, "strata_restores_total", "Conversations restored from the store.", m->conv.restores);
    counter(o, "strata_restored_bytes_total", "Image bytes restored (logical).", m->conv.restore_bytes);
    counter(o, "strata_downloads_total", "Session files downloaded.", m->downloads);
    counter(o, "strata_download_bytes_total", "Session file bytes downloaded.", m->download_bytes);
    counter(o, "strata_uploads_total", "Uploads committed as versions.", m->uploads);
    counter(o, "strata_upload_bytes_total", "Upload bytes received.", m->upload_bytes);

    evbuffer_add_printf(o, "# HELP strata_parks_total Conversations parked, by where they went.\n"
                           "# TYPE strata_parks_total counter\n"
                           "strata_parks_total{where=\"ram\"} %llu\nstrata_parks_total{where=\"disk\"} %llu\n",
                        U(m->conv.parks_ram), U(m->conv.parks_disk));
    counter(o, "strata_park_spills_total", "Parked images spilled from RAM to the store.", m->conv.park_spills);
    counter(o, "strata_park_unspills_total", "Spilled images brought back into a slot.", m->conv.park_unspills);
    counter(o, "strata_stale_refused_total", "SAVEs and PARKs refused (409) because another "
            "node held or saved the conversation since this node's copy was made (the copy "
            "dropped).", m->conv.stale_refused);
    counter(o, "strata_park_dropped_stale_total", "Parked images dropped at a spill: another node "
            "held the conversation since.", m->conv.park_dropped_stale);
    gauge(o, "strata_park_pool_bytes", "Bytes of parked images held in RAM.", (double)m->conv.pool_ram_bytes);
    gauge(o, "strata_park_pool_limit_bytes", "Ceiling of the RAM park pool (--conversation-cache-mib).",
          (double)m->conv.pool_limit_bytes);
    evbuffer_add_printf(o, "# HELP strata_park_pool_entries Parked conversations, by where they are.\n"
                           "# TYPE strata_park_pool_entries gauge\n"
                           "strata_park_pool_entries{where=\"ram\"} %llu\n"
                           "strata_park_pool_entries{where=\"disk\"} %llu\n",
                        U(m->conv.pool_ram_entries), U(m->conv.pool_disk_entries));
    gauge(o, "strata_sessions_damaged", "Sessions the start-up scan found damaged in the store and quarantined "
          "(listed by /healthz).", (double)m->sessions_damaged);
    gauge(o, "strata_slots", "Engine slots.", (double)m->conv.slots_total);
    gauge(o, "strata_slots_bound", "Slots holding a conversation.", (double)m->conv.slots_bound);
    gauge(o, "strata_slots_busy", "Slots computing or being saved now.", (double)m->conv.slots_busy);
    gauge(o, "strata_busy_waiting_requests",
          "Requests waiting for a session another request is using (--busy-wait-ms).",
          (double)m->conv.busy_waiting);
    counter(o, "strata_busy_wait_timeouts_total",
            "Requests answered 409 busy after waiting --busy-wait-ms for their session.",
            m->conv.busy_wait_timeouts);
    counter(o, "strata_busy_wait_queue_full_total",
            "Requests answered 409 busy at once because workers - 1 requests already waited.",
            m->conv.busy_wait_full);
    counter(o, "strata_completions_cancelled_total",
            "Completions stopped (or never started) because their client went away.",
            m->conv.completions_cancelled);

    evbuffer_add_printf(o, "# HELP strata_conversation_lookups_total Where a request found its "
                           "conversation.\n# TYPE strata_conversation_lookups_total counter\n"
                           "strata_conversation_lookups_total{found=\"slot\"} %llu\n"
                           "strata_conversation_lookups_total{found=\"ram\"} %llu\n"
                           "strata_conversation_lookups_total{found=\"disk\"} %llu\n"
                           "strata_conversation_lookups_total{found=\"store\"} %llu\n"
                           "strata_conversation_lookups_total{found=\"new\"} %llu\n",
                        U(m->conv.conv_hits_slot), U(m->conv.conv_hits_ram), U(m->conv.conv_hits_disk),
                        U(m->conv.conv_hits_store), U(m->conv.conv_new));
    counter(o, "strata_prompt_tokens_reused_total",
            "Prompt tokens served from held state or a cache checkpoint (cache hits).", m->conv.prompt_reused);
    counter(o, "strata_prompt_tokens_computed_total", "Prompt tokens read by the model.", m->conv.prompt_computed);
    counter(o, "strata_generated_tokens_total", "Tokens generated.", m->conv.tokens_generated);
    counter(o, "strata_memory_guard_refusals_total", "Operations the memory guard refused.",
            m->conv.memguard_refusals);
    if (m->tier) { /* --tier (docs/SCALE.md) */
        st_tiernode_stats ts;
        st_tiernode_stats_get(m->tier, &ts);
        gauge(o, "strata_tier_up", "1 when the last call to the shared tier succeeded.", ts.up);
        gauge(o, "strata_tier_pending", "Conversations whose newest SAVE waits for the tier.",
              (double)ts.pending);
        gauge(o, "strata_tier_pending_max", "Conversations the tier's queue holds at most.",
              (double)ts.pending_max);
        counter(o, "strata_tier_pushes_total", "SAVEs the tier confirmed (at once or from the "
                "queue).", ts.pushes);
        counter(o, "strata_tier_pushed_bytes_total", "Session-file bytes of those SAVEs.",
                ts.pushed_bytes);
        counter(o, "strata_tier_pushed_new_bytes_total", "Bytes of the pieces the tier did not "
                "have.", ts.pushed_new_bytes);
        counter(o, "strata_tier_sent_from_queue_total", "Queued SAVEs sent once the tier "
                "returned.", ts.sent_from_queue);
        counter(o, "strata_tier_pulls_total", "Conversations fetched from the tier (saved on "
                "another node).", ts.pulls);
        counter(o, "strata_tier_pulled_bytes_total", "Session-file bytes fetched.", ts.pulled_bytes);
        counter(o, "strata_tier_conflicts_total", "SAVEs the tier refused: another node had saved "
                "the conversation since.", ts.conflicts);
        counter(o, "strata_tier_unqueued_total", "SAVEs kept local only: the tier down and its "
                "queue full.", ts.unqueued);
        counter(o, "strata_tier_errors_total", "Tier calls that failed otherwise (logged).",
                ts.errors);
        gauge(o, "strata_tier_leases_held", "Conversations this node's requests hold the lease "
              "of now.", (double)ts.leases_held);
        counter(o, "strata_tier_leases_taken_total", "Leases taken from the tier.", ts.leases_taken);
        counter(o, "strata_tier_leases_refused_total", "Requests refused (409): another node held "
                "the conversation's lease.", ts.leases_refused);
        counter(o, "strata_tier_leases_lost_total", "Leases whose renewal the tier refused (the "
                "live copy dropped).", ts.leases_lost);
        counter(o, "strata_tier_handovers_total", "Conversations taken after another node had "
                "held them (this node's older copy dropped).", ts.handovers);
        counter(o, "strata_tier_leases_retaken_total", "Leases that expired while no other node "
                "took them (a pause longer than their TTL), taken again by the renewal.",
                ts.leases_retaken);
        gauge(o, "strata_tier_lease_orphans", "Lease takes that got no reply, waiting to be "
              "released under their token once the tier answers.", (double)ts.orphans);
        counter(o, "strata_tier_lease_orphans_released_total", "Leases such takes had taken, "
                "released once the tier answered.", ts.orphans_released);
        counter(o, "strata_tier_adopted_total", "Tier heads taken as this node's own SAVE (it held "
                "the conversation last, before a restart): no pull, its copy kept.", ts.adopted);
        counter(o, "strata_tier_park_pushes_total", "Parked images spilled at the RAM ceiling "
                "that the tier holds too.", ts.park_pushes);
        counter(o, "strata_tier_park_pushed_bytes_total", "Session-file bytes of those parks.",
                ts.park_pushed_bytes);
        counter(o, "strata_tier_park_pulls_total", "Parks of other nodes fetched from the tier "
                "and continued here.", ts.park_pulls);
        counter(o, "strata_tier_park_pulled_bytes_total", "Session-file bytes of those parks.",
                ts.park_pulled_bytes);
        counter(o, "strata_tier_park_errors_total", "Parks the tier did not take or give "
                "(logged; the park stays local, the conversation continues from its SAVE).",
                ts.park_errors);
    }
    st_prefix_stats px;
    if (m->manager && st_conv_prefix_stats(m->manager, &px)) { /* --prefix-index-mib (docs/SCALE.md) */
        gauge(o, "strata_prefix_entries", "Points the prefix index holds.", (double)px.entries);
        gauge(o, "strata_prefix_bytes", "Logical bytes of those points' images.", (double)px.bytes);
        counter(o, "strata_prefix_lookups_total", "Conversations holding nothing that looked in "
                "the prefix index.", px.lookups);
        counter(o, "strata_prefix_hits_total", "Of those, resumed from a point.", px.hits);
        counter(o, "strata_prefix_hit_tokens_total", "Prompt tokens those resumes did not read.",
                px.hit_tokens);
        counter(o, "strata_prefix_tier_hits_total", "Resumes whose point came from the shared "
                "tier.", px.tier_hits);
        counter(o, "strata_prefix_records_total", "Points recorded.", px.records);
        counter(o, "strata_prefix_record_bytes_total", "Logical bytes of those points.",
                px.record_bytes);
        counter(o, "strata_prefix_evictions_total", "Points deleted to fit the budget.",
                px.evictions);
        counter(o, "strata_prefix_errors_total", "Index operations that failed (logged).",
                px.errors);
        gauge(o, "strata_prefix_record_queue", "Points snapshotted and waiting for the recorder "
              "(put into the store and sent to the tier in the background).", (double)px.queued);
        counter(o, "strata_prefix_records_dropped_total", "Points not recorded: the recorder's "
                "queue was full.", px.dropped);
    }
    pthread_mutex_lock(&m->store_mu);
    st_store_stats ss = m->store;
    int ok = m->store_ok;
    pthread_mutex_unlock(&m->store_mu);
    if (ok)
        store_render(o, &ss);
}
