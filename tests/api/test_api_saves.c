/*
 * test_api_saves.c - every acknowledged SAVE restores: strata-server with the tiny model, the real
 * binary on loopback, killed with SIGKILL.
 *
 * The matrix, once per codec (fp32, bf16, f16; one server per codec, started with
 * --session-state-codec CODEC and restarted across the phases):
 *   phase 1  s in the slot, r parked in RAM: SAVE both (from "slot", from "ram"); d parked in RAM;
 *            SIGTERM writes all three to the store as disk-parked;
 *   phase 2  SAVE d from "disk"; t in the slot, then auto-parked into RAM by another conversation
 *            taking the only slot, and SAVEd with the default codec from there (the case of
 *            --session-state-codec bf16 in issue 10); kill -9;
 *   phase 3  d continues from its disk park (fp32: the uninterrupted run); s, r, d are RESTOREd
 *            and continued; t exists only in the store and a completion continues from there;
 *            s is PARKed and continues from RAM; SIGTERM.
 * Every continuation is compared token for token with a run on a fresh server that was never
 * killed. What "the same" lossy save/restore means: a SAVE in a lossy codec rounds the live running
 * state (f32) once, round-to-nearest-even, to the codec; tokens and K/V are kept as they are; and a
 * continuation reads only the live state (the resume checkpoints serve a prompt that diverges,
 * which none here does). Rounding the slot's state (a SAVE from the slot) and rounding the fp32
 * park image (a SAVE from RAM or disk park) give the same values. So the reference for a codec is
 * one uninterrupted conversation that SAVEs in that codec once and RESTOREs that version before
 * its next turn, and every SAVE of the matrix must record the same state hash as the reference's
 * (read from the stores), whatever place it was taken from. Negative controls: the three codecs'
 * state hashes all differ (the comparison sees the rounding), and an image re-coded behind its
 * hash's back (what the bug stored) is refused by the store and by an upload commit.
 * Then `statectl check --read-data` finds every store clean.
 *
 * Besides: the size each place a conversation lives in reports (slot, RAM, disk, store) is that
 * of the one image (test_sizes_every_place); the 31-byte limit of a SAVE label (400 invalid_field naming it), and a graceful stop
 * on a full file system (a tmpfs of its own, mounted in a private mount namespace): the
 * conversations it could not write are named in the log and the exit status is 3; those it could
 * are continued after the restart.
 */
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <sys/mount.h>

#include "st_api_test.h"
#include "st_file.h"
#include "st_store.h"

#define CTL ST_BIN_DIR "/statectl"
#define N_PREDICT 12

static st_at_env env = {.backend = "cpu"};
static const char *const prompts[] = {"Hello, Strata.", " And then?", " Once more."};

static int setup(void **state)
{
    (void)state;
    return st_at_setup(&env, "test_api_saves");
}

static char full_mnt[4400]; /* the tmpfs of test_stop_full_disk while mounted */

static int teardown(void **state)
{
    (void)state;
    if (full_mnt[0])
        umount2(full_mnt, MNT_DETACH); /* a failed test left it mounted */
    return st_at_teardown(&env);
}

/* ---- helpers -------------------------------------------------------------------------------- */

static int start(st_hc_server *s, const char *store, const char *const *flags)
{
    return st_at_server_start(s, &env, store, flags, NULL);
}

static json_t *turn(uint16_t port, const char *id, int t, const char *want_found)
{
    json_t *o = st_at_complete(port, id, prompts[t], N_PREDICT, true);
    if (want_found)
        assert_string_equal(json_string_value(json_object_get(o, "found")), want_found);
    return o;
}

/* The generated tokens of a completion reply equal those of want. */
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

/* SAVE id with body; must answer 201 from place `from`. */
static void save(uint16_t port, const char *id, const char *body, const char *from, const char *codec)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
    json_t *o = st_at_call(port, "POST", path, body, 201);
    assert_string_equal(json_string_value(json_object_get(o, "from")), from);
    assert_string_equal(json_string_value(json_object_get(o, "codec")), codec);
    json_decref(o);
}

static void call_ok(uint16_t port, const char *id, const char *action, const char *body, int want)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/%s", id, action);
    json_decref(st_at_call(port, "POST", path, body, want));
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

/* The state hash version v of id records in the store DIR/store (opened beside the server). */
static uint64_t stored_hash(const char *store, const char *id, uint64_t v)
{
    char path[4400];
    snprintf(path, sizeof path, "%s/%s", env.dir, store);
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, path, &(st_store_opts){.read_only = 1}), 0);
    st_version_info vi;
    assert_int_equal(st_store_version_info(st, id, v, &vi), 0);
    st_store_close(st);
    assert_true(vi.state_hash != 0);
    return vi.state_hash;
}

static void store_checks_clean(const char *store)
{
    char out[8192];
    int rc = st_test_run(out, sizeof out, CTL " check '%s/%s' --read-data", env.dir, store);
    if (rc)
        fprintf(stderr, "%s\n", out);
    assert_int_equal(rc, 0);
}

/* ---- the matrix ------------------------------------------------------------------------------- */

static uint64_t codec_hash[3];

static void matrix(int ci, const char *codec)
{
    char flag_codec[16], body[64], store[32], ref_store[32];
    snprintf(flag_codec, sizeof flag_codec, "%s", codec);
    snprintf(body, sizeof body, "{\"codec\":\"%s\"}", codec);
    snprintf(store, sizeof store, "m-%s", codec);
    snprintf(ref_store, sizeof ref_store, "ref-%s", codec);
    const char *const flags[] = {"--slots", "1", "--conversation-cache-mib", "64", "--session-state-codec",
                                 flag_codec, NULL};
    st_hc_server s;

    /* the references: plain (never saved) and through one SAVE in codec + RESTORE */
    assert_int_equal(start(&s, ref_store, flags), 0);
    json_t *plain[2], *ref[3];
    plain[0] = turn(s.port, "plain", 0, "new");
    plain[1] = turn(s.port, "plain", 1, "slot");
    ref[0] = turn(s.port, "ref", 0, "new");
    same_tokens(ref[0], plain[0]);
    save(s.port, "ref", "{}", "slot", codec);
    call_ok(s.port, "ref", "restore", "{\"version\":1}", 200);
    ref[1] = turn(s.port, "ref", 1, "slot");
    ref[2] = turn(s.port, "ref", 2, "slot");
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    if (ci == 0)
        same_tokens(ref[1], plain[1]); /* fp32 restores exactly */
    uint64_t want = stored_hash(ref_store, "ref", 1);
    codec_hash[ci] = want;

    /* phase 1: s in the slot, r and d parked in RAM */
    assert_int_equal(start(&s, store, flags), 0);
    json_decref(turn(s.port, "d", 0, "new"));
    call_ok(s.port, "d", "park", NULL, 200);
    json_decref(turn(s.port, "r", 0, "new"));
    call_ok(s.port, "r", "park", NULL, 200);
    assert_string_equal(where(s.port, "r"), "ram");
    save(s.port, "r", body, "ram", codec);
    json_t *t0 = turn(s.port, "s", 0, "new");
    same_tokens(t0, ref[0]);
    json_decref(t0);
    save(s.port, "s", body, "slot", codec);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    /* phase 2: d from its disk park; t auto-parked, saved with the server's codec; kill -9 */
    assert_int_equal(start(&s, store, flags), 0);
    assert_string_equal(where(s.port, "d"), "disk");
    save(s.port, "d", body, "disk", codec);
    json_decref(turn(s.port, "t", 0, "new"));
    json_decref(turn(s.port, "other", 0, "new")); /* takes the slot: t is parked */
    assert_string_equal(where(s.port, "t"), "ram");
    save(s.port, "t", "{}", "ram", codec);
    assert_int_equal(st_hc_server_stop(&s, SIGKILL), -1);

    /* phase 3 */
    assert_int_equal(start(&s, store, flags), 0);
    assert_string_equal(where(s.port, "t"), "none"); /* RAM parks die with kill -9 */
    json_t *c = turn(s.port, "d", 1, "disk"); /* the fp32 park: the uninterrupted conversation */
    same_tokens(c, plain[1]);
    json_decref(c);
    static const char *const restored[] = {"s", "r", "d"};
    for (int i = 0; i < 3; i++) {
        call_ok(s.port, restored[i], "restore", "{}", 200);
        c = turn(s.port, restored[i], 1, "slot");
        same_tokens(c, ref[1]);
        json_decref(c);
    }
    c = turn(s.port, "t", 1, "store");
    same_tokens(c, ref[1]);
    json_decref(c);
    call_ok(s.port, "t", "park", NULL, 200);
    c = turn(s.port, "t", 2, "ram");
    same_tokens(c, ref[2]);
    json_decref(c);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    /* every SAVE recorded the reference's state: the same values, whatever the place */
    static const char *const saved[] = {"s", "r", "d", "t"};
    for (int i = 0; i < 4; i++)
        assert_int_equal(stored_hash(store, saved[i], 1), want);
    store_checks_clean(ref_store);
    store_checks_clean(store);
    for (int i = 0; i < 3; i++)
        json_decref(ref[i]);
    for (int i = 0; i < 2; i++)
        json_decref(plain[i]);
}

static void test_matrix_fp32(void **state)
{
    (void)state;
    matrix(0, "fp32");
}

static void test_matrix_bf16(void **state)
{
    (void)state;
    matrix(1, "bf16");
}

static void test_matrix_f16(void **state)
{
    (void)state;
    matrix(2, "f16");
    /* negative control: the codecs' states differ, so equal hashes above were not a given */
    assert_true(codec_hash[0] != codec_hash[1]);
    assert_true(codec_hash[0] != codec_hash[2]);
    assert_true(codec_hash[1] != codec_hash[2]);
}

/* An upload of a session file as one part, committed as session id: the commit's reply, which
 * must have status want. */
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

/* What the bug stored, the live checkpoint re-coded behind the state hash's back, is refused
 * where it would become a version: by the store the server writes to, and by an upload commit
 * (422 invalid_file naming the mismatch); the same file with its hash recomputed is taken,
 * restores and continues as the reference does. */
static void test_wrong_hash_refused(void **state)
{
    (void)state;
    char path[4400];
    snprintf(path, sizeof path, "%s/m-bf16", env.dir);
    st_store *st = NULL;
    st_image *img = NULL;
    assert_int_equal(st_store_open(&st, path, NULL), 0);
    assert_int_equal(st_store_get(st, "s", 1, &img), 0); /* s after turn 0, saved in bf16 */
    void *scratch = malloc(ST_CODEC_SCRATCH_MAX);
    assert_non_null(scratch);
    uint32_t n = st_image_n_checkpoints(img);
    assert_int_equal(st_image_checkpoint_recode(img, n - 1, ST_CODEC_F16, scratch, ST_CODEC_SCRATCH_MAX), 0);
    free(scratch);
    assert_int_equal(st_store_put(st, "s", img, 0, NULL, NULL), ST_ECORRUPT);
    st_store_close(st);

    uint8_t *file = NULL;
    size_t len = 0;
    assert_int_equal(st_file_write_mem(img, NULL, &file, &len), 0);
    st_hc_server s;
    const char *const flags[] = {"--slots", "1", NULL};
    assert_int_equal(start(&s, "upload-store", flags), 0);
    json_t *o = upload(s.port, "up", file, len, 422);
    json_t *e = json_object_get(o, "error");
    assert_string_equal(json_string_value(json_object_get(e, "code")), "invalid_file");
    assert_non_null(strstr(json_string_value(json_object_get(e, "message")), "state hash mismatch"));
    json_decref(o);
    free(file);
    /* with the hash of what it holds, it is a valid (f16) version */
    uint64_t h = 0;
    assert_int_equal(st_image_state_hash_compute(img, NULL, NULL, &h), 0);
    st_image_state_hash_set(img, h);
    assert_int_equal(st_file_write_mem(img, NULL, &file, &len), 0);
    json_decref(upload(s.port, "up", file, len, 201));
    call_ok(s.port, "up", "restore", "{}", 200);
    json_decref(turn(s.port, "up", 1, "slot"));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    free(file);
    st_image_free(img);
}

/* ---- SAVE's label limit ------------------------------------------------------------------------- */

static void test_label_limit(void **state)
{
    (void)state;
    st_hc_server s;
    assert_int_equal(start(&s, "label-store", NULL), 0);
    json_decref(turn(s.port, "l", 0, "new"));
    char body[128];
    snprintf(body, sizeof body, "{\"label\":\"%s\"}", "abcdefghijklmnopqrstuvwxyz012345"); /* 32 */
    json_t *o = st_at_call(s.port, "POST", "/v1/sessions/l/save", body, 400);
    assert_string_equal(json_string_value(json_object_get(json_object_get(o, "error"), "code")), "invalid_field");
    assert_non_null(strstr(json_string_value(json_object_get(json_object_get(o, "error"), "message")), "1..31"));
    json_decref(o);
    snprintf(body, sizeof body, "{\"label\":\"%s\"}", "abcdefghijklmnopqrstuvwxyz01234"); /* 31 */
    json_decref(st_at_call(s.port, "POST", "/v1/sessions/l/save", body, 201));
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

/* ---- a graceful stop on a full file system ---------------------------------------------------- */

/* This process (and the servers it starts) in a private mount namespace, with a tmpfs of mib MiB
 * mounted at dir: as root, or as anyone where user namespaces are allowed. -1 when neither. */
static int private_tmpfs(const char *dir, unsigned mib)
{
    if (unshare(CLONE_NEWNS) != 0) {
        char map[64];
        int uid = (int)getuid(), gid = (int)getgid();
        if (unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0)
            return -1;
        snprintf(map, sizeof map, "0 %d 1", uid);
        if (st_test_spit("/proc/self/setgroups", "deny", 4) || st_test_spit("/proc/self/uid_map", map, strlen(map)))
            return -1;
        snprintf(map, sizeof map, "0 %d 1", gid);
        if (st_test_spit("/proc/self/gid_map", map, strlen(map)))
            return -1;
    }
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) != 0 || (mkdir(dir, 0700) != 0 && errno != EEXIST))
        return -1;
    char opt[32];
    snprintf(opt, sizeof opt, "size=%um", mib);
    return mount("tmpfs", dir, "tmpfs", 0, opt);
}

/* Fill the file system of path with a file there until it is full, then free `room` bytes. */
static void fill(const char *path, size_t room)
{
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    assert_true(fd >= 0);
    static char block[65536];
    memset(block, 0x5a, sizeof block);
    off_t size = 0;
    for (size_t len = sizeof block; len >= 4096; len /= 2) {
        ssize_t k;
        while ((k = write(fd, block, len)) > 0)
            size += k;
        assert_int_equal(errno, ENOSPC);
    }
    assert_int_equal(ftruncate(fd, size > (off_t)room ? size - (off_t)room : 0), 0);
    close(fd);
}

static void test_stop_full_disk(void **state)
{
    (void)state;
    char *mnt = full_mnt, filler[4500], path[4500];
    snprintf(mnt, sizeof full_mnt, "%s/full", env.dir);
    if (private_tmpfs(mnt, 8) != 0) {
        mnt[0] = '\0';
        fprintf(stderr, "no tmpfs of our own (%s): skipped\n", strerror(errno));
        skip();
    }
    snprintf(filler, sizeof filler, "%s/filler", mnt);
    const char *const flags[] = {"--slots", "2", "--conversation-cache-mib", "64", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "ref-full", flags), 0);
    json_t *r0 = turn(s.port, "ref", 0, "new"), *ref = turn(s.port, "ref", 1, "slot");
    json_decref(r0);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    enum { N = 6 };
    char ids[N][8];
    assert_int_equal(start(&s, "full/store", flags), 0);
    for (int i = 0; i < N; i++) {
        snprintf(ids[i], sizeof ids[i], "c%d", i);
        json_decref(turn(s.port, ids[i], 0, "new")); /* c0..c3 parked in RAM, c4 and c5 in slots */
    }
    /* full, but for a little room: some conversations fit (when whole ones do not, kept smaller),
     * the others cannot */
    fill(filler, 200000);
    size_t before = 0;
    free(st_test_slurp(env.logpath, &before));
    /* the stop cannot write them all: it says so, by name, and exits 3 */
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 3);
    size_t len = 0;
    char *log = (char *)st_test_slurp(env.logpath, &len);
    assert_non_null(log);
    assert_true(len > before);
    char *stop = strndup(log + before, len - before);
    assert_non_null(stop);
    free(log);
    fprintf(stderr, "%s", stop);
    int lost[N], n_lost = 0;
    for (int i = 0; i < N; i++) {
        char want[128];
        snprintf(want, sizeof want, "stop: could not write %s to the store, it is lost: ", ids[i]);
        lost[i] = strstr(stop, want) != NULL;
        n_lost += lost[i];
    }
    assert_true(n_lost > 0);
    char want[128];
    snprintf(want, sizeof want, "stop: %d live conversations written to the store as parked, %d could not "
             "be written: ", N - n_lost, n_lost);
    assert_non_null(strstr(stop, want));
    free(stop);

    /* with room again: the ones written continue exactly, the ones named are gone */
    assert_int_equal(unlink(filler), 0);
    assert_int_equal(start(&s, "full/store", flags), 0);
    for (int i = 0; i < N; i++) {
        json_t *c = turn(s.port, ids[i], 1, lost[i] ? "new" : "disk");
        if (!lost[i])
            same_tokens(c, ref);
        json_decref(c);
    }
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
    json_decref(ref);
    snprintf(path, sizeof path, "full/store");
    store_checks_clean(path);
    assert_int_equal(umount2(mnt, MNT_DETACH), 0);
    mnt[0] = '\0';
}

/* ---- sizes in every place ------------------------------------------------------------------- */

/* The live {where, bytes} GET /v1/sessions/{id} gives, checked against the listing's entry. */
static uint64_t live_bytes(uint16_t port, const char *id, const char *want_where)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s", id);
    json_t *o = st_at_call(port, "GET", path, NULL, 200), *live = json_object_get(o, "live");
    assert_string_equal(json_string_value(json_object_get(live, "where")), want_where);
    uint64_t b = (uint64_t)json_integer_value(json_object_get(live, "bytes"));
    assert_true(b > 0);
    json_t *l = st_at_call(port, "GET", "/v1/sessions", NULL, 200), *e;
    size_t i;
    int seen = 0;
    json_array_foreach(json_object_get(l, "sessions"), i, e) {
        if (strcmp(json_string_value(json_object_get(e, "id")), id))
            continue;
        json_t *le = json_object_get(e, "live");
        assert_string_equal(json_string_value(json_object_get(le, "where")), want_where);
        assert_int_equal(json_integer_value(json_object_get(le, "bytes")), b);
        seen++;
    }
    assert_int_equal(seen, 1);
    json_decref(l);
    json_decref(o);
    return b;
}

/* PARK id out of its slot; the bytes the reply moved. */
static uint64_t park_bytes(uint16_t port, const char *id)
{
    char path[128];
    snprintf(path, sizeof path, "/v1/sessions/%s/park", id);
    json_t *o = st_at_call(port, "POST", path, NULL, 200);
    assert_false(json_is_true(json_object_get(o, "already")));
    uint64_t b = (uint64_t)json_integer_value(json_object_get(o, "bytes"));
    json_decref(o);
    return b;
}

/* SAVE id in codec; the reply's logical and stored bytes must be what the version then lists,
 * with that codec. Returns its logical bytes. */
static uint64_t save_listed(uint16_t port, const char *id, const char *codec, const char *from)
{
    char path[128], body[64];
    snprintf(path, sizeof path, "/v1/sessions/%s/save", id);
    snprintf(body, sizeof body, "{\"codec\":\"%s\"}", codec);
    json_t *o = st_at_call(port, "POST", path, body, 201);
    assert_string_equal(json_string_value(json_object_get(o, "from")), from);
    snprintf(path, sizeof path, "/v1/sessions/%s/versions/%lld", id,
             (long long)json_integer_value(json_object_get(o, "version")));
    json_t *v = st_at_call(port, "GET", path, NULL, 200);
    uint64_t lb = (uint64_t)json_integer_value(json_object_get(o, "logical_bytes"));
    assert_int_equal(json_integer_value(json_object_get(v, "logical_bytes")), lb);
    assert_int_equal(json_integer_value(json_object_get(v, "stored_bytes")),
                     json_integer_value(json_object_get(o, "stored_bytes")));
    assert_string_equal(json_string_value(json_object_get(v, "codec")), codec);
    json_t *cs = json_object_get(v, "codecs");
    assert_int_equal(json_array_size(cs), 1);
    assert_string_equal(json_string_value(json_array_get(cs, 0)), codec);
    json_decref(v);
    json_decref(o);
    return lb;
}

/* Each place a conversation lives in gives its size, and every one is the same image's: the
 * slot's is what its PARK then moves (a fresh conversation, one continued from RAM, a prompt read
 * with nothing generated, one restored from a version: the slot then holds the restored
 * checkpoints), the pool's in RAM and, after a
 * restart, on disk are the parked image's, an fp32 SAVE from the disk park stores exactly that
 * image, and a version lists the bytes its SAVE answered with the codec it was saved in (bf16:
 * smaller). */
static void test_sizes_every_place(void **state)
{
    (void)state;
    const char *const flags[] = {"--slots", "1", "--conversation-cache-mib", "64", NULL};
    st_hc_server s;
    assert_int_equal(start(&s, "sizes", flags), 0);
    json_decref(turn(s.port, "z", 0, "new"));
    uint64_t b = live_bytes(s.port, "z", "slot");
    assert_int_equal(park_bytes(s.port, "z"), b);
    assert_int_equal(live_bytes(s.port, "z", "ram"), b);
    json_decref(turn(s.port, "z", 1, "ram"));
    b = live_bytes(s.port, "z", "slot");
    assert_int_equal(park_bytes(s.port, "z"), b);
    assert_int_equal(live_bytes(s.port, "z", "ram"), b);
    /* a prompt read without generating: the slot's prompt-end checkpoint sits at its live position,
     * and its park image holds it once (the live state), not twice */
    json_decref(st_at_complete(s.port, "y", prompts[0], 0, true));
    uint64_t y = live_bytes(s.port, "y", "slot");
    assert_int_equal(park_bytes(s.port, "y"), y);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);

    assert_int_equal(start(&s, "sizes", flags), 0);
    assert_int_equal(live_bytes(s.port, "y", "disk"), y);
    assert_int_equal(live_bytes(s.port, "z", "disk"), b);
    assert_int_equal(save_listed(s.port, "z", "fp32", "disk"), b);
    assert_true(save_listed(s.port, "z", "bf16", "disk") < b);
    call_ok(s.port, "z", "restore", "{\"version\":1}", 200);
    uint64_t r = live_bytes(s.port, "z", "slot");
    assert_int_equal(park_bytes(s.port, "z"), r);
    assert_int_equal(live_bytes(s.port, "z", "ram"), r);
    assert_int_equal(st_hc_server_stop(&s, SIGTERM), 0);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_matrix_fp32), cmocka_unit_test(test_matrix_bf16),
        cmocka_unit_test(test_matrix_f16),  cmocka_unit_test(test_wrong_hash_refused),
        cmocka_unit_test(test_label_limit), cmocka_unit_test(test_stop_full_disk),
        cmocka_unit_test(test_sizes_every_place),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
