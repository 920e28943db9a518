/*
 * test_store_crash.c - crash safety. A child (store_crash_child) saves, deletes and collects in
 * a loop and is killed with SIGKILL at a random moment, again and again (argument: how many
 * kills; 50 in `make test`, 1,000 under the slow label). After every kill: the store opens,
 * check --read-data finds nothing, every version the child acknowledged exports byte-identical
 * to what it saved, the operation in flight is wholly present or wholly absent, and nothing
 * else is in the store.
 */
#include <signal.h>
#include <sys/wait.h>
#include <time.h>

#include "store_test.h"

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */

typedef struct entry {
    char id[16];
    uint64_t version;
    char sha[65];
} entry;

static entry model[4096];
static size_t n_model;

static entry *model_find(const char *id, uint64_t v)
{
    for (size_t i = 0; i < n_model; i++)
        if (model[i].version == v && !strcmp(model[i].id, id))
            return &model[i];
    return NULL;
}

static void model_add(const char *id, uint64_t v, const char *sha)
{
    assert_null(model_find(id, v));
    assert_true(n_model < sizeof model / sizeof model[0]);
    entry *e = &model[n_model++];
    snprintf(e->id, sizeof e->id, "%s", id);
    e->version = v;
    snprintf(e->sha, sizeof e->sha, "%s", sha);
}

static void model_del(const char *id, uint64_t v)
{
    entry *e = model_find(id, v);
    assert_non_null(e);
    *e = model[--n_model];
}

static void export_sha(st_store *st, const char *id, uint64_t v, char *hex)
{
    char out[1200];
    snprintf(out, sizeof out, "%s/export.tmp", base);
    int rc = st_store_export(st, id, v, out, NULL);
    if (rc)
        print_error("export %s@%llu: %s: %s\n", id, (unsigned long long)v, st_strerror(rc), st_errdetail());
    assert_int_equal(rc, 0);
    size_t len = 0;
    uint8_t *b = st_test_slurp(out, &len), h[ST_STORE_HASH_LEN];
    assert_non_null(b);
    st_store_sha256(b, len, h);
    free(b);
    st_store_hex(hex, h, ST_STORE_HASH_LEN);
}

static int in_store(st_store *st, const char *id, uint64_t v)
{
    st_version_info vi;
    int rc = st_store_version_info(st, id, v, &vi);
    assert_true(rc == 0 || rc == ST_ENOTFOUND);
    return rc == 0;
}

static void run(int kills)
{
    char dir[1200], logp[1200], seedbuf[32];
    snprintf(dir, sizeof dir, "%s/store", base);
    snprintf(logp, sizeof logp, "%s/log", base);
    FILE *log = NULL;
    long log_pos = 0;
    uint64_t acks = 0, inflight_present = 0, inflight_absent = 0;
    unsigned seed = (unsigned)time(NULL);
    const char *env_seed = getenv("ST_CRASH_SEED");
    if (env_seed)
        seed = (unsigned)strtoul(env_seed, NULL, 10);
    print_message("crash test: %d kills, seed %u (ST_CRASH_SEED to repeat)\n", kills, seed);
    srand(seed);
    int window = 60000; /* microseconds */
    for (int k = 0; k < kills; k++) {
        uint64_t acks_before = acks;
        snprintf(seedbuf, sizeof seedbuf, "%u", seed + (unsigned)k);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            execl(ST_STORE_CHILD, ST_STORE_CHILD, dir, logp, seedbuf, (char *)NULL);
            _exit(127);
        }
        /* mostly mid-run, sometimes while the child is still opening the store; the window
         * widens while kills land before any put completes (a slow or loaded machine) */
        useconds_t delay = (useconds_t)(rand() % 8 == 0 ? rand() % 3000 : 2000 + rand() % window);
        usleep(delay);
        kill(pid, SIGKILL);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL))
            fail_msg("kill %d: the child ended by itself (status %d): it failed", k, status);

        /* the log: acknowledged steps into the model, the last unacknowledged one in flight */
        if (!log)
            log = fopen(logp, "r");
        char line[256], pend_op = 0, pend_id[16] = "", pend_sha[65] = "";
        unsigned long long pend_v = 0;
        if (log) {
            fseek(log, log_pos, SEEK_SET);
            while (fgets(line, sizeof line, log)) {
                if (!strchr(line, '\n'))
                    break; /* never happens: each line is one write(2) */
                log_pos = ftell(log);
                char op, id[16], sha[65] = "";
                unsigned long long v;
                int f = sscanf(line, "%c %15s %llu %64s", &op, id, &v, sha);
                assert_true(f >= 3);
                if (op == 'P' || op == 'D') {
                    pend_op = op;
                    snprintf(pend_id, sizeof pend_id, "%s", id);
                    pend_v = v;
                    snprintf(pend_sha, sizeof pend_sha, "%s", sha);
                } else if (op == 'A') {
                    assert_int_equal(pend_op, 'P');
                    model_add(id, v, sha);
                    acks++;
                    pend_op = 0;
                } else if (op == 'd') {
                    assert_int_equal(pend_op, 'D');
                    model_del(id, v);
                    pend_op = 0;
                }
            }
        }

        st_store *st = NULL;
        /* create only while nothing was ever acknowledged (the child may die creating it) */
        st_store_opts o = {.create = acks == 0};
        int rc = st_store_open(&st, dir, &o);
        if (rc)
            print_error("kill %d: open: %s: %s\n", k, st_strerror(rc), st_errdetail());
        assert_int_equal(rc, 0);
        store_test_assert_clean(st);
        char hex[65];
        for (size_t i = 0; i < n_model; i++) {
            if (pend_op == 'D' && model[i].version == pend_v && !strcmp(model[i].id, pend_id))
                continue; /* being deleted: judged below */
            export_sha(st, model[i].id, model[i].version, hex);
            if (strcmp(hex, model[i].sha))
                fail_msg("kill %d: %s@%llu exports other bytes than were saved", k, model[i].id,
                         (unsigned long long)model[i].version);
        }
        if (pend_op == 'P') {
            if (in_store(st, pend_id, pend_v)) {
                export_sha(st, pend_id, pend_v, hex);
                assert_string_equal(hex, pend_sha); /* wholly present */
                model_add(pend_id, pend_v, pend_sha);
                inflight_present++;
            } else {
                inflight_absent++;
            }
        } else if (pend_op == 'D') {
            if (!in_store(st, pend_id, pend_v)) {
                model_del(pend_id, pend_v);
                inflight_present++;
            } else {
                entry *e = model_find(pend_id, pend_v);
                assert_non_null(e);
                export_sha(st, pend_id, pend_v, hex);
                assert_string_equal(hex, e->sha); /* wholly still there */
                inflight_absent++;
            }
        }
        /* nothing else is there */
        st_session_info *ss = NULL;
        size_t n = 0, total = 0;
        assert_int_equal(st_store_list(st, &ss, &n), 0);
        for (size_t i = 0; i < n; i++) {
            st_version_info *vs = NULL;
            size_t nv = 0;
            assert_int_equal(st_store_versions(st, ss[i].id, &vs, &nv), 0);
            for (size_t j = 0; j < nv; j++)
                if (!model_find(ss[i].id, vs[j].version))
                    fail_msg("kill %d: %s@%llu is in the store but was never saved", k, ss[i].id,
                             (unsigned long long)vs[j].version);
            total += nv;
            free(vs);
        }
        free(ss);
        assert_int_equal(total, n_model);
        st_store_close(st);
        if (acks == acks_before && window < 2000000)
            window *= 2;
        else if (acks > acks_before && window > 60000)
            window /= 2;
    }
    if (log)
        fclose(log);
    print_message("crash test: %llu acknowledged puts, in flight at a kill: %llu done, %llu not\n",
                  (unsigned long long)acks, (unsigned long long)inflight_present,
                  (unsigned long long)inflight_absent);
    assert_true(acks > 0); /* how many depends on the machine's speed; that some did is what matters */
}

static int kills = 50;

static void test_crash(void **state)
{
    (void)state;
    run(kills);
}

int main(int argc, char **argv)
{
    if (argc > 1)
        kills = atoi(argv[1]);
    st_test_tmpdir(base, sizeof base, "test_store_crash");
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_crash),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
