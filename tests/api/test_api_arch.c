/*
 * test_api_arch.c - every architecture's state through strata-server, the real binary on
 * loopback, killed with SIGKILL: llama, qwen3, qwen35, qwen35moe and qwen3next (the seeded tiny
 * presets; the hybrids with key heads 2 != value heads 4). test_api_saves holds strata-hybrid
 * to the same matrix in more places.
 *
 * Per architecture (one store of references, one store killed and restarted):
 *   references (never killed): "plain" reads turns 0, 1, 2 and SAVEs (fp32) after turns 1 and 2;
 *     "ref-C" for the lossy codecs C reads turn 0, SAVEs in C, RESTOREs that version, reads turn
 *     1 and SAVEs (fp32): the uninterrupted run through the same rounding (see test_api_saves);
 *   server 1: "s-C" reads turn 0 and SAVEs in C (fp32, bf16, f16); "r" is PARKed to RAM and
 *     SAVEd in bf16 from there; the fp32 version is downloaded as session files v1 and v2; "k" is
 *     parked in RAM; kill -9;
 *   server 2: "k" is gone (a RAM park dies with the process); each "s-C" and "r" is RESTOREd in
 *     the new process and continued; the two downloaded files are uploaded as new sessions,
 *     restored and continued; "s-fp32" is PARKed to RAM and continued; "d" is left in its slot
 *     and written to the store as disk-parked by SIGTERM;
 *   server 3 (--conversation-cache-mib 0: a PARK goes to disk): "d" continues from its disk
 *     park; "x" is PARKed to disk and continues;
 *   the same with int8 K/V on llama and qwen35 (--kv-dtype i8), and on qwen35-tiny-q in Q4_K
 *     (the integer path of quantized weights);
 *   besides: the downloaded file continues in `strata generate --session-in` as in the server,
 *     and the file its --session-out writes continues in a server.
 * Every continuation's tokens equal the reference's, and its state is SAVEd: the state hash (the
 * tokens, K/V and running state: conv and SSM state of the DeltaNet layers) and the last logits
 * stored equal the reference's, bit for bit. Negative control: on the hybrids the three codecs'
 * states differ (llama and qwen3 keep K/V and a position only, which no codec touches: equal).
 *
 * Besides: a state never restores under another model, and the refusal names the difference
 * (a qwen35 session into a llama server: the layer kinds; into a qwen35 model with other
 * weights: same layers and shapes, another fingerprint); `statectl inspect` shows the layer
 * kinds of a session file and of a stored version; a long shared system prompt on qwen35 read
 * once, SAVEd, and several conversations resumed from it equal uninterrupted runs
 * (`test_api_arch shared N`: N tokens, 1,024 in make test, 16,384 in test_api_arch_16k, slow);
 * a server without --backend runs them on the CPU where no GPU is and on the GPU where one is,
 * and --backend cuda without a GPU is refused at start naming the missing device.
 */
#include <stdint.h>

#include "st_api_test.h"
#include "st_codec.h"
#include "st_store.h"

#define CTL ST_BIN_DIR "/statectl"
#define STRATA ST_BIN_DIR "/strata"
#define N_PREDICT 8

static st_at_env env = {.backend = "cpu"};
static const char *const prompts[] = {"Hello, Strata.", " And then?", " Once more."};
static const char *const codecs[] = {"fp32", "bf16", "f16"};

typedef struct arch_model {
    const char *arch, *preset;
    int hybrid; /* DeltaNet layers (f32 conv and SSM state) besides attention */
    char path[4200];
} arch_model;

static arch_model models[] = {
    {"llama", "tiny-untied", 0, ""},       {"qwen3", "tiny-untied", 0, ""},
    {"qwen35", "qwen35-tiny", 1, ""},      {"qwen35moe", "qwen35moe-tiny", 1, ""},
    {"qwen3next", "qwen3next-tiny", 1, ""},
};
#define N_MODELS (sizeof models / sizeof models[0])
static char other_qwen35[4200]; /* qwen35-tiny with other weights (--seed 7) */
/* qwen35-tiny-q in Q4_K (every matrix: rows of 256), on the integer path of the CPU backend */
static arch_model q4k = {"qwen35-q4k", "qwen35-tiny-q", 1, ""}; /* arch: the name of its stores */

static int setup(void **state)
{
    (void)state;
    if (st_at_setup(&env, "test_api_arch"))
        return -1;
    char out[4096];
    for (size_t i = 0; i < N_MODELS; i++) {
        snprintf(models[i].path, sizeof models[i].path, "%s/%s.gguf", env.dir, models[i].arch);
        if (st_test_run(out, sizeof out, ST_AT_MKMODEL " --arch %s --preset %s -o '%s'", models[i].arch,
                        models[i].preset, models[i].path)) {
            fprintf(stderr, "%s\n", out);
            return -1;
        }
    }
    snprintf(q4k.path, sizeof q4k.path, "%s/qwen35-q4k.gguf", env.dir);
    if (st_test_run(out, sizeof out, ST_AT_MKMODEL " --arch qwen35 --preset qwen35-tiny-q --wtype q4_K -o '%s'",
                    q4k.path)) {
        fprintf(stderr, "%s\n", out);
        return -1;
    }
    snprintf(other_qwen35, sizeof other_qwen35, "%s/qwen35-seed7.gguf", env.dir);
    return st_test_run(out, sizeof out, ST_AT_MKMODEL " --arch qwen35 --preset qwen35-tiny --seed 7 -o '%s'",
                       other_qwen35) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    return st_at_teardown(&env);
}

/* ---- helpers -------------------------------------------------------------------------------- */

static const char *const *g_extra; /* flags every server of the running matrix gets besides */

static int start(st_hc_server *s, const char *model, const char *store, const char *const *flags)
{
    snprintf(env.model, sizeof env.model, "%s", model);
    return st_at_server_start(s, &env, store, flags, g_extra);
}

static json_t *turn(uint16_t port, const char *id, int t, const char *want_found)
{
    json_t *o = st_at_complete(port, id, prompts[t], N_PREDICT, true);
    if (want_found)
        assert_string_equal(json_string_value(json_object_get(o, "found")), want_found);
    return o;
}

static void same_tokens(json_t *got, json_t *want)
{
    json_t *a = json_object_get(got, "tokens"), *b = json_object_get(want, "tokens");
    assert_true(json_is_array(a));
    assert_int_equal(json_array_size(a), N_PREDICT);
    if (!json_equal(a, b)) {
        char *x = json_dumps(a, JSON_COMPACT), *y = json_dumps(b, JSON_COMPACT);
        fail_msg("continuation %s differs from the reference %s", x, y);
    }
}

/* A turn that must continue as want did. */
static void turn_same(uint16_t port, const char *id, int t, const char *found, json_t *want)
{
    json_t *c = turn(port, id, t, found);
    same_tokens(c, want);
    json_decref(c);
}

/* SAVE id in codec (NULL: the server's); the new version's number. */
static uint64_t save(uint16_t port, const char *id, const char *codec)
{
    char path[128], body[64];
    snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
    snprintf(body, sizeof body, codec ? "{\"codec\":\"%s\"}" : "{}", codec);
    json_t *o = st_at_call(port, "POST", path, body, 201);
    if (codec)
        assert_string_equal(json_string_value(json_object_get(o, "codec")), codec);
    uint64_t v = (uint64_t)json_integer_value(json_object_get(o, "version"));
    json_decref(o);
    return v;
}

static void call_ok(uint16_t port, const char *id, const char *action, const char *body, int want)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/%s", id, action);
    json_decref(st_at_call(port, "POST", path, body, want));
}

static void park(uint16_t port, const char *id, const char *want_where)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/park", id);
    json_t *o = st_at_call(port, "POST", path, NULL, 200);
    assert_string_equal(json_string_value(json_object_get(o, "where")), want_where);
    json_decref(o);
}

static const char *where(uint16_t port, const char *id)
{
    static char w[16];
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s", id);
    json_t *o = st_at_call(port, "GET", path, NULL, 200);
    const char *s = json_string_value(json_object_get(json_object_get(o, "live"), "where"));
    snprintf(w, sizeof w, "%s", s ? s : "none");
    json_decref(o);
    return w;
}

/* What version v of id holds in DIR/store: its state hash and last logits (malloc'd). */
typedef struct stored {
    uint64_t hash;
    float *logits;
    uint32_t n_logits;
} stored;

static stored stored_get(const char *store, const char *id, uint64_t v)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", env.dir, store);
    st_store *st = NULL;
    st_image *img = NULL;
    assert_int_equal(st_store_open(&st, path, &(st_store_opts){.read_only = 1}), 0);
    assert_int_equal(st_store_get(st, id, v, &img), 0);
    st_store_close(st);
    stored r = {st_image_state_hash(img), NULL, 0};
    const float *l = st_image_logits(img, &r.n_logits);
    assert_non_null(l);
    assert_true(r.n_logits > 0);
    r.logits = malloc(r.n_logits * sizeof *l);
    assert_non_null(r.logits);
    memcpy(r.logits, l, r.n_logits * sizeof *l);
    st_image_free(img);
    assert_true(r.hash != 0);
    return r;
}

/* Version v of id in DIR/store holds the state and logits of want, bit for bit. */
static void same_stored(const char *store, const char *id, uint64_t v, const stored *want)
{
    stored got = stored_get(store, id, v);
    if (got.hash != want->hash)
        fail_msg("%s v%llu: state hash %016llx, the reference's %016llx", id, (unsigned long long)v,
                 (unsigned long long)got.hash, (unsigned long long)want->hash);
    assert_int_equal(got.n_logits, want->n_logits);
    if (memcmp(got.logits, want->logits, got.n_logits * sizeof *got.logits))
        fail_msg("%s v%llu: the last logits differ from the reference's", id, (unsigned long long)v);
    free(got.logits);
}

static void store_checks_clean(const char *store)
{
    char out[8192];
    int rc = st_test_run(out, sizeof out, CTL " check '%s/%s' --read-data", env.dir, store);
    if (rc)
        fprintf(stderr, "%s\n", out);
    assert_int_equal(rc, 0);
}

/* The session file of id@v in format fmt (v1, v2), malloc'd. */
static uint8_t *download(uint16_t port, const char *id, uint64_t v, const char *fmt, size_t *len)
{
    char path[256];
    snprintf(path, sizeof path, "/v1/sessions/%s/versions/%llu/file?format=%s", id, (unsigned long long)v, fmt);
    st_hc_resp r;
    assert_int_equal(st_hc_request(port, "GET", path, NULL, NULL, 0, &r), 0);
    assert_int_equal(r.status, 200);
    uint8_t *b = malloc(r.body_len);
    assert_non_null(b);
    memcpy(b, r.body, r.body_len);
    *len = r.body_len;
    st_hc_resp_free(&r);
    return b;
}

/* Upload a session file as one part and commit it as session id: the commit's reply (status want). */
static json_t *upload(uint16_t port, const char *id, const uint8_t *b, size_t len, int want)
{
    json_t *o = st_at_call(port, "POST", "/v1/uploads", "{}", 201);
    char path[256], body[128];
    snprintf(path, sizeof path, "/v1/uploads/%s/parts/1", json_string_value(json_object_get(o, "upload")));
    st_hc_resp r;
    assert_int_equal(st_hc_request(port, "PUT", path, NULL, b, len, &r), 0);
    assert_int_equal(r.status, 200);
    st_hc_resp_free(&r);
    snprintf(path, sizeof path, "/v1/uploads/%s/commit", json_string_value(json_object_get(o, "upload")));
    json_decref(o);
    snprintf(body, sizeof body, "{\"session\":\"%s\"}", id);
    return st_at_call(port, "POST", path, body, want);
}

/* The token ids of a reply as `strata generate --tokens` prints them: "1 2 3\n". */
static void tokens_line(char *dst, size_t cap, json_t *reply)
{
    json_t *a = json_object_get(reply, "tokens");
    size_t o = 0;
    dst[0] = '\0';
    for (size_t i = 0; i < json_array_size(a) && o < cap; i++)
        o += (size_t)snprintf(dst + o, cap - o, "%s%lld", i ? " " : "",
                              (long long)json_integer_value(json_array_get(a, i)));
    if (o < cap)
        snprintf(dst + o, cap - o, "\n");
}

/* The server's session file continues in `strata generate --session-in` as in the server (turn
 * 1: want1), and the file its --session-out writes continues in the server (turn 2: want2). */
static void cli_round(const arch_model *am, const uint8_t *file, size_t len, json_t *want1, json_t *want2)
{
    char in[4400], out_file[4400], out[8192], want[1024];
    snprintf(in, sizeof in, "%s/%s-server.stsf", env.dir, am->arch);
    snprintf(out_file, sizeof out_file, "%s/%s-cli.stsf", env.dir, am->arch);
    assert_int_equal(st_test_spit(in, file, len), 0);
    assert_int_equal(st_test_run(out, sizeof out, "(" STRATA " generate -m '%s' --backend cpu --threads 1 --temp 0 "
                                 "--ignore-eos --tokens -n %d -p '%s' --session-in '%s' --session-out '%s' "
                                 "2>/dev/null)", am->path, N_PREDICT, prompts[1], in, out_file), 0);
    tokens_line(want, sizeof want, want1);
    assert_string_equal(out, want);
    size_t n = 0;
    uint8_t *b = st_test_slurp(out_file, &n);
    assert_non_null(b);
    const char *const flags[] = {"--slots", "1", NULL};
    char store[64];
    snprintf(store, sizeof store, "cli-%s", am->arch);
    st_hc_server s;
    assert_int_equal(start(&s, am->path, store, flags), 0);
    json_decref(upload(s.port, "cli", b, n, 201));
    turn_same(s.port, "cli", 2, "store", want2);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    free(b);
}

/* ---- the matrix, per architecture ----------------------------------------------------------- */

static void matrix(const arch_model *am, const char *kv_dtype)
{
    char ref_store[64], store[64], id[32];
    const char *const extra[] = {"--kv-dtype", kv_dtype, NULL};
    g_extra = kv_dtype ? extra : NULL;
    snprintf(ref_store, sizeof ref_store, "ref-%s%s", am->arch, kv_dtype ? kv_dtype : "");
    snprintf(store, sizeof store, "m-%s%s", am->arch, kv_dtype ? kv_dtype : "");
    const char *const flags[] = {"--slots", "1", "--conversation-cache-mib", "64", NULL};
    const char *const to_disk[] = {"--slots", "1", "--conversation-cache-mib", "0", NULL};
    st_hc_server s;

    /* the references */
    assert_int_equal(start(&s, am->path, ref_store, flags), 0);
    json_t *plain[3], *ref1[3] = {NULL, NULL, NULL};
    plain[0] = turn(s.port, "plain", 0, "new");
    plain[1] = turn(s.port, "plain", 1, "slot");
    assert_int_equal(save(s.port, "plain", "fp32"), 1);
    plain[2] = turn(s.port, "plain", 2, "slot");
    assert_int_equal(save(s.port, "plain", "fp32"), 2);
    for (int c = 1; c < 3; c++) {
        snprintf(id, sizeof id, "ref-%s", codecs[c]);
        turn_same(s.port, id, 0, "new", plain[0]);
        assert_int_equal(save(s.port, id, codecs[c]), 1);
        call_ok(s.port, id, "restore", "{\"version\":1}", 200);
        ref1[c] = turn(s.port, id, 1, "slot");
        assert_int_equal(save(s.port, id, "fp32"), 2);
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    stored want1[3], want2 = stored_get(ref_store, "plain", 2);
    want1[0] = stored_get(ref_store, "plain", 1);
    want1[1] = stored_get(ref_store, "ref-bf16", 2);
    want1[2] = stored_get(ref_store, "ref-f16", 2);
    ref1[0] = json_incref(plain[1]);
    if (am->hybrid) /* negative control: the codecs' roundings reach the state compared */
        assert_true(want1[0].hash != want1[1].hash && want1[0].hash != want1[2].hash &&
                    want1[1].hash != want1[2].hash);
    else /* K/V only (kept in its dtype) and the position: no codec changes anything */
        assert_true(want1[0].hash == want1[1].hash && want1[0].hash == want1[2].hash);
    assert_true(want1[0].hash != want2.hash);

    /* server 1: SAVEs in every codec, from the slot and from a RAM park; files; kill -9 */
    assert_int_equal(start(&s, am->path, store, flags), 0);
    for (int c = 0; c < 3; c++) {
        snprintf(id, sizeof id, "s-%s", codecs[c]);
        turn_same(s.port, id, 0, "new", plain[0]);
        assert_int_equal(save(s.port, id, codecs[c]), 1);
    }
    turn_same(s.port, "r", 0, "new", plain[0]);
    park(s.port, "r", "ram");
    assert_int_equal(save(s.port, "r", "bf16"), 1);
    size_t len_v1 = 0, len_v2 = 0;
    uint8_t *file_v1 = download(s.port, "s-fp32", 1, "v1", &len_v1);
    uint8_t *file_v2 = download(s.port, "s-fp32", 1, "v2", &len_v2);
    turn_same(s.port, "k", 0, "new", plain[0]);
    park(s.port, "k", "ram");
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);

    /* server 2: restores in a new process; files; PARK to RAM; SIGTERM spills "d" */
    assert_int_equal(start(&s, am->path, store, flags), 0);
    json_decref(st_at_call(s.port, "GET", "/v1/sessions/k", NULL, 404)); /* never saved: gone */
    for (int c = 0; c < 3; c++) {
        snprintf(id, sizeof id, "s-%s", codecs[c]);
        call_ok(s.port, id, "restore", "{}", 200);
        turn_same(s.port, id, 1, "slot", ref1[c]);
        assert_int_equal(save(s.port, id, "fp32"), 2);
    }
    call_ok(s.port, "r", "restore", "{}", 200);
    turn_same(s.port, "r", 1, "slot", ref1[1]);
    assert_int_equal(save(s.port, "r", "fp32"), 2);
    json_decref(upload(s.port, "f1", file_v1, len_v1, 201));
    json_decref(upload(s.port, "f2", file_v2, len_v2, 201));
    if (!kv_dtype) /* the CLI with the model's K/V dtype */
        cli_round(am, file_v2, len_v2, plain[1], plain[2]);
    free(file_v1);
    free(file_v2);
    call_ok(s.port, "f1", "restore", "{}", 200);
    turn_same(s.port, "f1", 1, "slot", plain[1]);
    assert_int_equal(save(s.port, "f1", "fp32"), 2);
    turn_same(s.port, "f2", 1, "store", plain[1]); /* a completion restores the head itself */
    assert_int_equal(save(s.port, "f2", "fp32"), 2);
    park(s.port, "s-fp32", "ram");
    turn_same(s.port, "s-fp32", 2, "ram", plain[2]);
    assert_int_equal(save(s.port, "s-fp32", "fp32"), 3);
    turn_same(s.port, "d", 0, "new", plain[0]);
    turn_same(s.port, "d", 1, "slot", plain[1]);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    /* server 3: from the disk park written by the stop; a PARK straight to disk */
    assert_int_equal(start(&s, am->path, store, to_disk), 0);
    assert_string_equal(where(s.port, "d"), "disk");
    turn_same(s.port, "d", 2, "disk", plain[2]);
    assert_int_equal(save(s.port, "d", "fp32"), 1);
    turn_same(s.port, "x", 0, "new", plain[0]);
    turn_same(s.port, "x", 1, "slot", plain[1]);
    park(s.port, "x", "disk");
    turn_same(s.port, "x", 2, "disk", plain[2]);
    assert_int_equal(save(s.port, "x", "fp32"), 1);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    /* every continuation holds the reference's state and logits */
    for (int c = 0; c < 3; c++) {
        snprintf(id, sizeof id, "s-%s", codecs[c]);
        same_stored(store, id, 2, &want1[c]);
    }
    same_stored(store, "r", 2, &want1[1]);
    same_stored(store, "f1", 2, &want1[0]);
    same_stored(store, "f2", 2, &want1[0]);
    same_stored(store, "s-fp32", 3, &want2);
    same_stored(store, "d", 1, &want2);
    same_stored(store, "x", 1, &want2);
    store_checks_clean(ref_store);
    store_checks_clean(store);
    for (int i = 0; i < 3; i++) {
        json_decref(plain[i]);
        json_decref(ref1[i]);
        free(want1[i].logits);
    }
    free(want2.logits);
    g_extra = NULL;
}

static void test_llama(void **state)
{
    (void)state;
    matrix(&models[0], NULL);
}

static void test_qwen3(void **state)
{
    (void)state;
    matrix(&models[1], NULL);
}

static void test_qwen35(void **state)
{
    (void)state;
    matrix(&models[2], NULL);
}

static void test_qwen35moe(void **state)
{
    (void)state;
    matrix(&models[3], NULL);
}

static void test_qwen3next(void **state)
{
    (void)state;
    matrix(&models[4], NULL);
}

/* Quantized weights on the integer path (activations quantized as llama.cpp does): the same
 * restores, bit for bit */
static void test_qwen35_q4k(void **state)
{
    (void)state;
    matrix(&q4k, NULL);
}

/* int8 K/V (a scale per row and head) on an attention-only model and on a hybrid */
static void test_kv_i8(void **state)
{
    (void)state;
    matrix(&models[0], "i8");
    matrix(&models[2], "i8");
}

/* ---- another model -------------------------------------------------------------------------- */

/* A restore of id on the server at port is refused as made under another model, the message
 * naming want. */
static void refused(uint16_t port, const char *id, const char *want)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/restore", id);
    json_t *o = st_at_call(port, "POST", path, "{}", 409);
    json_t *e = json_object_get(o, "error");
    assert_string_equal(json_string_value(json_object_get(e, "code")), "model_mismatch");
    const char *msg = json_string_value(json_object_get(e, "message"));
    if (!strstr(msg, want))
        fail_msg("refusal \"%s\" does not say \"%s\"", msg, want);
    json_decref(o);
}

/* A qwen35 session never restores under llama, nor under qwen35 with other weights (the same
 * hyperparameters: the fingerprint covers the tensor data), and the refusal names the
 * difference; the server goes on serving (the session file is accepted as a version: it is
 * valid, only not for this model). The same file restores and continues under its own model. */
static void test_other_model(void **state)
{
    (void)state;
    const char *const flags[] = {"--slots", "1", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, models[2].path, "q35-own", flags), 0);
    json_decref(turn(s.port, "q", 0, "new"));
    assert_int_equal(save(s.port, "q", "bf16"), 1);
    size_t len = 0;
    uint8_t *file = download(s.port, "q", 1, "v2", &len);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, models[0].path, "q35-in-llama", flags), 0);
    json_decref(upload(s.port, "q", file, len, 201));
    refused(s.port, "q", "its layers are DDDA (3 deltanet, 1 attention), this engine's llama model's "
                         "AAA (0 deltanet, 3 attention)");
    json_decref(turn(s.port, "l", 0, "new")); /* and serves on */
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, other_qwen35, "q35-in-seed7", flags), 0);
    json_decref(upload(s.port, "q", file, len, 201));
    refused(s.port, "q", "the same layers and shapes as this engine's qwen35 model (DDDA (3 deltanet, "
                         "1 attention)), other weights or hyperparameters");
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, models[2].path, "q35-back", flags), 0);
    json_decref(upload(s.port, "q", file, len, 201));
    call_ok(s.port, "q", "restore", "{}", 200);
    json_decref(turn(s.port, "q", 1, "slot"));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    free(file);
}

/* ---- statectl inspect / show: the architecture and the layer kinds ------------------------------------------------- */

static void test_inspect_layers(void **state)
{
    (void)state;
    static const char *const kinds[N_MODELS] = {
        "AAA (0 deltanet, 3 attention)", "AAA (0 deltanet, 3 attention)", "DDDA (3 deltanet, 1 attention)",
        "DDDA (3 deltanet, 1 attention)", "DDDA (3 deltanet, 1 attention)",
    };
    const char *const flags[] = {"--slots", "1", NULL};
    for (size_t i = 0; i < N_MODELS; i++) {
        char store[64], file[4400], want[128], out[16384];
        snprintf(store, sizeof store, "inspect-%s", models[i].arch);
        st_hc_server s;
        assert_int_equal(start(&s, models[i].path, store, flags), 0);
        json_decref(turn(s.port, "i", 0, "new"));
        assert_int_equal(save(s.port, "i", NULL), 1);
        size_t len = 0;
        uint8_t *b = download(s.port, "i", 1, "v2", &len);
        json_t *v = st_at_call(s.port, "GET", "/v1/sessions/i/versions/1", NULL, 200);
        assert_string_equal(json_string_value(json_object_get(v, "architecture")), models[i].arch);
        json_decref(v);
        assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
        snprintf(file, sizeof file, "%s/%s.sess", env.dir, models[i].arch);
        assert_int_equal(st_test_spit(file, b, len), 0);
        free(b);
        snprintf(want, sizeof want, "\nlayers       %s\n", kinds[i]);
        assert_int_equal(st_test_run(out, sizeof out, CTL " inspect '%s'", file), 0);
        if (!strstr(out, want))
            fail_msg("statectl inspect of a %s file does not say \"%s\":\n%s", models[i].arch, kinds[i], out);
        assert_int_equal(st_test_run(out, sizeof out, CTL " inspect '%s' --json", file), 0);
        snprintf(want, sizeof want, "\"layers\": \"%s\"", kinds[i]);
        assert_non_null(strstr(out, want));
        assert_int_equal(st_test_run(out, sizeof out, CTL " show '%s/%s' i@1", env.dir, store), 0);
        snprintf(want, sizeof want, "\nlayers       %s\n", kinds[i]);
        if (!strstr(out, want))
            fail_msg("statectl show of a %s version does not say \"%s\":\n%s", models[i].arch, kinds[i], out);
        assert_int_equal(st_test_run(out, sizeof out, CTL " show '%s/%s' i@1 --json", env.dir, store), 0);
        snprintf(want, sizeof want, "\"layers\": \"%s\"", kinds[i]);
        assert_non_null(strstr(out, want));
        /* the architecture, beside the layer kinds, in the server's file and its store version */
        snprintf(want, sizeof want, "\narchitecture %s\n", models[i].arch);
        assert_int_equal(st_test_run(out, sizeof out, CTL " show '%s/%s' i@1", env.dir, store), 0);
        if (!strstr(out, want))
            fail_msg("statectl show of a %s version does not say \"%s\":\n%s", models[i].arch, want, out);
        assert_int_equal(st_test_run(out, sizeof out, CTL " inspect '%s'", file), 0);
        if (!strstr(out, want))
            fail_msg("statectl inspect of a %s file does not say \"%s\":\n%s", models[i].arch, want, out);
    }
}

/* ---- the backend a server picks ---------------------------------------------------------------- */

/* Without --backend (and $STRATA_BACKEND) a server runs every architecture on the GPU where one
 * is (st_codec_cuda_available), else on the CPU. */
static void test_default_backend(void **state)
{
    (void)state;
    unsetenv("STRATA_BACKEND");
    for (size_t i = 0; i < N_MODELS; i++) {
        char path[4400];
        snprintf(path, sizeof path, "%s/backend-%s", env.dir, models[i].arch);
        const char *args[] = {"--store", path, "--model", models[i].path, "--threads", "1", NULL};
        size_t before = 0;
        free(st_test_slurp(env.logpath, &before));
        st_hc_server s;
        assert_int_equal(st_hc_server_start(&s, ST_AT_SERVER, env.dir, env.logpath, args), 0);
        json_decref(turn(s.port, "b", 0, "new"));
        assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
        size_t len = 0;
        char *log = (char *)st_test_slurp(env.logpath, &len);
        assert_non_null(log);
        char *mine = strndup(log + before, len - before);
        free(log);
        const char *want = st_codec_cuda_available() ? "strata-server: engine on the cuda backend\n"
                                                     : "strata-server: engine on the cpu backend\n";
        if (!strstr(mine, want))
            fail_msg("a %s server without --backend (want \"%s\"):\n%s", models[i].arch, want,
                     mine);
        free(mine);
    }
    /* --backend cuda runs qwen35 on the operation table where a GPU is; without one (CI) it is
     * refused at start naming the missing device (or the build without CUDA) */
    char path[4400];
    snprintf(path, sizeof path, "%s/backend-cuda", env.dir);
    const char *args[] = {"--store", path, "--model", models[2].path, "--backend", "cuda", NULL};
    size_t before = 0, len = 0;
    free(st_test_slurp(env.logpath, &before));
    st_hc_server s;
    int started = st_hc_server_start(&s, ST_AT_SERVER, env.dir, env.logpath, args) == 0;
    if (started)
        assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    char *log = (char *)st_test_slurp(env.logpath, &len);
    assert_non_null(log);
    char *mine = strndup(log + before, len - before);
    free(log);
    if (started ? !strstr(mine, "engine on the cuda backend")
                : !strstr(mine, "cudaErrorNoDevice") && !strstr(mine, "no CUDA device") &&
                      !strstr(mine, "cudaErrorInsufficientDriver") &&
                      !strstr(mine, "built without CUDA"))
        fail_msg("a qwen35 server with --backend cuda:\n%s", mine);
    free(mine);
}

/* ---- a long shared system prompt on qwen35 ---------------------------------------------------- */

/* the bytes of the system prompt plus 2 (`test_api_arch shared N`); the model's vocabulary makes
 * it fewer tokens */
static unsigned shared_tokens = 1024;
#define N_SHARED_CONV 3

/* A completion of n tokens on session id with a system prompt (NULL: none); the reply. */
static json_t *complete_sys(uint16_t port, const char *id, const char *system, const char *prompt, int n)
{
    json_t *b = json_pack("{s:s,s:s,s:i,s:i,s:b}", "session", id, "prompt", prompt, "n_predict", n,
                          "temperature", 0, "ignore_eos", 1);
    if (system)
        json_object_set_new(b, "system", json_string(system));
    char *body = json_dumps(b, JSON_COMPACT);
    json_decref(b);
    json_t *o = st_at_call(port, "POST", "/v1/completions", body, 200);
    free(body);
    return o;
}

/* The system prompt is read once (with a root checkpoint at its end), the conversation SAVEd and
 * downloaded, the server killed; a new server takes the file as N_SHARED_CONV new sessions, each
 * continuing with its own prompt; every one equals (tokens, state hash, last logits) an
 * uninterrupted conversation of a third server that read the system prompt itself. */
static void test_shared_prompt(void **state)
{
    (void)state;
    static const char *const convs[N_SHARED_CONV] = {" First question?", " Second.", " A third one, longer."};
    unsigned n_sys = shared_tokens - 2; /* the system prompt, then the prompt " Hi" */
    char *sys = malloc(n_sys + 1), ctx[16], root[16], id[32];
    assert_non_null(sys);
    for (unsigned i = 0; i < n_sys; i++)
        sys[i] = (char)(' ' + (i * 7 + i / 95) % 95); /* printable ASCII: one token a byte */
    sys[n_sys] = '\0';
    snprintf(ctx, sizeof ctx, "%u", shared_tokens + 256);
    snprintf(root, sizeof root, "%u", 16u); /* a root checkpoint at the system prompt's end */
    const char *const flags[] = {"--slots", "1", "--ctx", ctx, "--prompt-cache-root", root, NULL};
    st_hc_server s;

    assert_int_equal(start(&s, models[2].path, "shared", flags), 0);
    json_t *o = complete_sys(s.port, "base", sys, " Hi", 1);
    json_int_t held = json_integer_value(json_object_get(o, "n_tokens")); /* prompt + 1 */
    assert_int_equal(json_integer_value(json_object_get(o, "n_prompt_tokens")) + 1, held);
    assert_true(held > 16);
    json_decref(o);
    assert_int_equal(save(s.port, "base", "fp32"), 1);
    size_t len = 0;
    uint8_t *file = download(s.port, "base", 1, "v2", &len);
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);

    json_t *got[N_SHARED_CONV];
    assert_int_equal(start(&s, models[2].path, "shared", flags), 0);
    for (int k = 0; k < N_SHARED_CONV; k++) {
        snprintf(id, sizeof id, "conv%d", k);
        json_decref(upload(s.port, id, file, len, 201));
        got[k] = complete_sys(s.port, id, NULL, convs[k], N_PREDICT);
        assert_string_equal(json_string_value(json_object_get(got[k], "found")), "store");
        /* only the conversation's own prompt was read */
        assert_int_equal(json_integer_value(json_object_get(json_object_get(got[k], "timings"),
                                                            "resumed_tokens")), held);
        assert_int_equal(save(s.port, id, "fp32"), 2);
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    free(file);

    assert_int_equal(start(&s, models[2].path, "shared-ref", flags), 0);
    for (int k = 0; k < N_SHARED_CONV; k++) {
        snprintf(id, sizeof id, "u%d", k);
        json_decref(complete_sys(s.port, id, sys, " Hi", 1));
        json_t *want = complete_sys(s.port, id, NULL, convs[k], N_PREDICT);
        same_tokens(got[k], want);
        json_decref(want);
        json_decref(got[k]);
        assert_int_equal(save(s.port, id, "fp32"), 1);
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    for (int k = 0; k < N_SHARED_CONV; k++) {
        char uid[32];
        snprintf(id, sizeof id, "conv%d", k);
        snprintf(uid, sizeof uid, "u%d", k);
        stored want = stored_get("shared-ref", uid, 1);
        same_stored("shared", id, 2, &want);
        free(want.logits);
    }
    /* negative control: the conversations differ from each other */
    stored a = stored_get("shared-ref", "u0", 1), b = stored_get("shared-ref", "u1", 1);
    assert_true(a.hash != b.hash);
    free(a.logits);
    free(b.logits);
    free(sys);
}

int main(int argc, char **argv)
{
    if (argc == 3 && !strcmp(argv[1], "shared")) { /* the long version alone */
        shared_tokens = (unsigned)strtoul(argv[2], NULL, 10);
        const struct CMUnitTest one[] = {cmocka_unit_test(test_shared_prompt)};
        return cmocka_run_group_tests(one, setup, teardown);
    }
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_shared_prompt),
        cmocka_unit_test(test_llama),     cmocka_unit_test(test_qwen3),
        cmocka_unit_test(test_qwen35),    cmocka_unit_test(test_qwen35moe),
        cmocka_unit_test(test_qwen3next), cmocka_unit_test(test_qwen35_q4k),
        cmocka_unit_test(test_kv_i8), cmocka_unit_test(test_other_model),
        cmocka_unit_test(test_inspect_layers), cmocka_unit_test(test_default_backend),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
