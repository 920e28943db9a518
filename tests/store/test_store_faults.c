/*
 * test_store_faults.c - the store under injected faults (st_store_sys): the Nth commit fails
 * with ENOSPC or EIO, either before anything is written (transaction aborted) or after it was
 * (committed, then reported failed); map growth fails; the disk reports no free space; backup
 * and restore writes, fsyncs and renames fail. Each failure is an error to the caller, the store
 * stays usable, check passes, and its contents are exactly those of a fault-free run that
 * stopped before (or, for a committed write, after) the failing operation.
 */
#include <sys/mman.h>
#include <sys/stat.h>

#include "store_test.h"

static char base[512]; /* short of the 1024-byte paths made from it, so no snprintf can truncate */
static int seq;

/* ---- the fault table ---------------------------------------------------------------------------- */

static struct {
    int commits, commit_fail_at, commit_after, commit_err;
    int maps, map_fail_at, map_err;
    int writes, write_fail_at, write_err;
    int fsyncs, fsync_fail_at, fsync_err;
    int renames, rename_fail_at;
    int no_disk;
    int populates, populate_fail;
    int reserves, reserve_err;       /* reserve fails with this errno (0: works) */
    int pwrites, pwrite_fail_at, pwrite_err;
} F;

static int f_commit(struct MDB_txn *txn)
{
    if (++F.commits == F.commit_fail_at) {
        if (F.commit_after) {
            int rc = mdb_txn_commit(txn);
            return rc ? rc : F.commit_err;
        }
        mdb_txn_abort(txn);
        return F.commit_err;
    }
    return mdb_txn_commit(txn);
}

static int f_mapsize(struct MDB_env *env, size_t size)
{
    if (++F.maps == F.map_fail_at)
        return F.map_err;
    return mdb_env_set_mapsize(env, size);
}

static ssize_t f_write(int fd, const void *buf, size_t n)
{
    if (++F.writes == F.write_fail_at) {
        errno = F.write_err;
        return -1;
    }
    return write(fd, buf, n);
}

static int f_fsync(int fd)
{
    if (++F.fsyncs == F.fsync_fail_at) {
        errno = F.fsync_err;
        return -1;
    }
    return fsync(fd);
}

static int f_rename(const char *a, const char *b)
{
    if (++F.renames == F.rename_fail_at) {
        errno = EIO;
        return -1;
    }
    return rename(a, b);
}

static int f_disk_free(const char *path, uint64_t *bytes)
{
    (void)path;
    *bytes = F.no_disk ? 0 : (64ull << 30);
    return 0;
}

static int (*real_populate)(void *addr, size_t len);

static int f_populate(void *addr, size_t len)
{
    F.populates++;
    if (F.populate_fail) {
        errno = EFAULT;
        return -1;
    }
    return real_populate(addr, len);
}

static int (*real_reserve)(int fd, uint64_t off, uint64_t len);

static int f_reserve(int fd, uint64_t off, uint64_t len)
{
    F.reserves++;
    if (F.reserve_err) {
        errno = F.reserve_err;
        return -1;
    }
    return real_reserve(fd, off, len);
}

static ssize_t (*real_pwrite)(int fd, const void *buf, size_t n, uint64_t off);

static ssize_t f_pwrite(int fd, const void *buf, size_t n, uint64_t off)
{
    if (++F.pwrites == F.pwrite_fail_at) {
        errno = F.pwrite_err;
        return -1;
    }
    /* short writes, as a kernel may give: the store must loop */
    return real_pwrite(fd, buf, n > 100000 ? n / 2 : n, off);
}

static st_store_sys fault_sys(void)
{
    st_store_sys s;
    st_store_sys_init(&s);
    real_populate = s.populate;
    s.populate = f_populate;
    real_reserve = s.reserve;
    s.reserve = f_reserve;
    real_pwrite = s.pwrite;
    s.pwrite = f_pwrite;
    s.txn_commit = f_commit;
    s.set_mapsize = f_mapsize;
    s.write = f_write;
    s.fsync = f_fsync;
    s.rename = f_rename;
    s.disk_free = f_disk_free;
    return s;
}

static st_store *open_fresh(char *dir, size_t cap, const st_store_sys *sys, uint64_t map_initial, uint64_t budget)
{
    snprintf(dir, cap, "%s/f%d", base, ++seq);
    st_store_opts o = {.create = 1, .keep_last = 3, .sys = sys, .map_initial = map_initial, .budget = budget};
    st_store *st = NULL;
    int rc = st_store_open(&st, dir, &o);
    if (rc)
        print_error("open: %s\n", st_errdetail());
    assert_int_equal(rc, 0);
    return st;
}

/* ---- a script of operations and a dump of what a store holds ------------------------------------- */

static st_image *imgs[4];

#define N_OPS 10

static int run_op(st_store *st, int i)
{
    switch (i) {
    case 0: return st_store_put(st, "s1", imgs[0], 0, NULL, NULL);
    case 1: return st_store_put(st, "s1", imgs[1], 1, NULL, NULL);
    case 2: return st_store_label_set(st, "s1", "pin", 1);
    case 3: return st_store_put(st, "s2", imgs[2], ST_STORE_HEAD_NONE, &(st_put_opts){.compress = 1}, NULL);
    case 4: return st_store_version_delete(st, "s1", 2);
    case 5: return st_store_put(st, "s1", imgs[3], 0, &(st_put_opts){.label = "top"}, NULL);
    case 6: return st_store_put(st, "s1", imgs[2], 0, NULL, NULL); /* prunes nothing: 1 pinned */
    case 7: return st_store_put(st, "s1", imgs[0], 0, NULL, NULL); /* prunes version 3 */
    case 8: return st_store_session_delete(st, "s2");
    case 9: return st_store_gc(st, NULL);
    }
    return -1;
}

/* Everything a store holds, as text, plus the bytes of every version compared by the caller. */
static char *dump(st_store *st)
{
    size_t cap = 1 << 16, len = 0;
    char *out = malloc(cap);
    assert_non_null(out);
    out[0] = '\0';
    st_session_info *ss = NULL;
    size_t n = 0;
    assert_int_equal(st_store_list(st, &ss, &n), 0);
    for (size_t i = 0; i < n; i++) {
        len += (size_t)snprintf(out + len, cap - len, "%s head %llu n %llu next %llu labels", ss[i].id,
                                (unsigned long long)ss[i].head, (unsigned long long)ss[i].n_versions,
                                (unsigned long long)ss[i].next_version);
        for (uint32_t l = 0; l < ss[i].n_labels; l++)
            len += (size_t)snprintf(out + len, cap - len, " %s=%llu", ss[i].labels[l].name,
                                    (unsigned long long)ss[i].labels[l].version);
        st_version_info *vs = NULL;
        size_t nv = 0;
        assert_int_equal(st_store_versions(st, ss[i].id, &vs, &nv), 0);
        for (size_t v = 0; v < nv; v++) {
            st_image *img = NULL;
            assert_int_equal(st_store_get(st, ss[i].id, vs[v].version, &img), 0);
            size_t bl;
            uint8_t *b = store_test_bytes(img, &bl), h[32];
            char hex[65];
            st_store_sha256(b, bl, h);
            st_store_hex(hex, h, 8);
            free(b);
            st_image_free(img);
            len += (size_t)snprintf(out + len, cap - len, "\n  v%llu %llu tokens %s", (unsigned long long)vs[v].version,
                                    (unsigned long long)vs[v].n_tokens, hex);
        }
        free(vs);
        len += (size_t)snprintf(out + len, cap - len, "\n");
    }
    free(ss);
    st_store_stats s;
    assert_int_equal(st_store_stat(st, &s), 0);
    snprintf(out + len, cap - len, "chunks %llu bytes %llu zero %llu\n", (unsigned long long)s.chunks,
             (unsigned long long)s.stored_bytes, (unsigned long long)s.zero_count_chunks);
    return out;
}

/* The dump of a fault-free store after ops [0, upto). */
static char *reference(int upto)
{
    char dir[1200];
    st_store *st = open_fresh(dir, sizeof dir, NULL, 0, 0);
    for (int i = 0; i < upto; i++)
        assert_int_equal(run_op(st, i), 0);
    char *d = dump(st);
    st_store_close(st);
    st_test_rmdir(dir);
    return d;
}

static void commit_faults(int after, int err, int want_rc)
{
    char *ref[N_OPS + 1];
    for (int i = 0; i <= N_OPS; i++)
        ref[i] = reference(i);
    st_store_sys sys = fault_sys();
    for (int op = 0; op < N_OPS; op++) {
        char dir[1200];
        memset(&F, 0, sizeof F);
        st_store *st = open_fresh(dir, sizeof dir, &sys, 0, 0);
        for (int i = 0; i < op; i++)
            assert_int_equal(run_op(st, i), 0);
        F.commit_fail_at = F.commits + 1;
        F.commit_after = after;
        F.commit_err = err;
        int rc = run_op(st, op);
        assert_int_equal(rc, want_rc);
        assert_true(*st_errdetail());
        store_test_assert_clean(st);
        char *d = dump(st);
        /* a write that was committed before its failure was reported is wholly there */
        const char *want = after ? ref[op + 1] : ref[op];
        if (strcmp(d, want))
            print_error("op %d after %d:\n%s\nwant:\n%s\n", op, after, d, want);
        assert_string_equal(d, want);
        free(d);
        /* usable: the rest of the script runs (retried once when the failed one did not happen) */
        if (!after)
            assert_int_equal(run_op(st, op), 0);
        for (int i = op + 1; i < N_OPS; i++)
            assert_int_equal(run_op(st, i), 0);
        store_test_assert_clean(st);
        d = dump(st);
        assert_string_equal(d, ref[N_OPS]);
        free(d);
        st_store_close(st);
        st_test_rmdir(dir);
    }
    for (int i = 0; i <= N_OPS; i++)
        free(ref[i]);
}

static void test_commit_enospc_before(void **state)
{
    (void)state;
    commit_faults(0, ENOSPC, ST_EFULL);
}

static void test_commit_eio_before(void **state)
{
    (void)state;
    commit_faults(0, EIO, EIO);
}

static void test_commit_eio_after(void **state)
{
    (void)state;
    commit_faults(1, EIO, EIO);
}

static void test_map_growth_fails(void **state)
{
    (void)state;
    char dir[1200];
    st_store_sys sys = fault_sys();
    memset(&F, 0, sizeof F);
    st_store *st = open_fresh(dir, sizeof dir, &sys, 1u << 20, 256u << 20);
    st_image *big = store_test_image(9, 4000, 0, 0);
    for (int pass = 0; pass < 2; pass++) {
        F.map_fail_at = F.maps + 1;
        F.map_err = pass ? EIO : ENOSPC;
        assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), pass ? EIO : ST_EFULL);
        assert_int_equal(st_store_put(st, "small", imgs[0], 0, NULL, NULL), 0);
        store_test_assert_clean(st);
    }
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0); /* grows now */
    store_test_assert_get(st, "big", 0, big);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(big);

    /* a disk with no free space: the default budget is the data file itself */
    memset(&F, 0, sizeof F);
    F.no_disk = 1;
    st = open_fresh(dir, sizeof dir, &sys, 0, 0);
    big = store_test_image(9, 4000, 0, 0);
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), ST_EFULL);
    assert_non_null(strstr(st_errdetail(), "budget"));
    assert_int_equal(st_store_put(st, "small", imgs[3], 0, NULL, NULL), 0);
    store_test_assert_clean(st);
    F.no_disk = 0; /* space freed elsewhere becomes usable at the next growth */
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(big);
}

/* The disk cannot back the pages a big put needs (populating them fails with EFAULT, where a
 * write into the map would be a SIGBUS): ST_EFULL, nothing written, the store usable. */
static void test_populate_fails(void **state)
{
    (void)state;
    char dir[1200];
    st_store_sys sys = fault_sys();
    memset(&F, 0, sizeof F);
    st_store *st = open_fresh(dir, sizeof dir, &sys, 64u << 20, 0);
    /* 16 attention layers: 4 KiB of K/V per token, 16 MiB (populating starts at 4 MiB) */
    st_synth_opts so = {.seed = 9, .n_tokens = 4000, .n_checkpoints = 2, .n_layers = 16, .attn_every = 1};
    st_image *big = NULL;
    assert_int_equal(st_image_synthesize(&so, &big), 0);
    assert_true(st_image_bytes(big) > (8u << 20));
    assert_int_equal(st_store_put(st, "small", imgs[0], 0, NULL, NULL), 0);
    /* a file system without fallocate: the put populates the map range instead */
    F.reserve_err = EOPNOTSUPP;
    F.populate_fail = 1;
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), ST_EFULL);
    assert_true(F.populates > 0);
    assert_true(F.reserves > 0);
    assert_int_equal(st_store_show(st, "big", &(st_session_info){0}), ST_ENOTFOUND);
    store_test_assert_clean(st);
    F.populate_fail = 0;
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
    store_test_assert_get(st, "big", 0, big);
    store_test_assert_get(st, "small", 0, imgs[0]);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(big);
}

/* A commit that fails with MDB_PANIC makes the store reopen its environment (env_reopen) and run
 * the put again; the new map may sit at another address (another mapping made meanwhile moves it),
 * and the put's pwrites must follow it: the version it acknowledges reads back, byte for byte. */
static int perturb_pages;

static int panic_commit(struct MDB_txn *txn)
{
    if (++F.commits == F.commit_fail_at) {
        mdb_txn_abort(txn);
        if (perturb_pages) /* memory mapped meanwhile, as another thread's malloc would */
            assert_true(mmap(NULL, (size_t)perturb_pages << 12, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                             0) != MAP_FAILED);
        return MDB_PANIC;
    }
    return mdb_txn_commit(txn);
}

static void test_panic_reopen_then_put(void **state)
{
    (void)state;
    for (perturb_pages = 0; perturb_pages <= 2; perturb_pages++) {
        char dir[1200];
        st_store_sys sys = fault_sys();
        sys.txn_commit = panic_commit;
        memset(&F, 0, sizeof F);
        st_store *st = open_fresh(dir, sizeof dir, &sys, 64u << 20, 0);
        st_synth_opts so = {.seed = 13, .n_tokens = 4000, .n_checkpoints = 2, .n_layers = 16, .attn_every = 1};
        st_image *big = NULL;
        assert_int_equal(st_image_synthesize(&so, &big), 0);
        assert_int_equal(st_store_put(st, "small", imgs[0], 0, NULL, NULL), 0);
        F.commit_fail_at = F.commits + 1; /* the next commit: MDB_PANIC, reopen, run again */
        F.pwrites = 0;
        assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
        assert_true(F.pwrites > 0);
        store_test_assert_get(st, "big", 0, big);
        store_test_assert_get(st, "small", 0, imgs[0]);
        store_test_assert_clean(st);
        st_store_close(st);
        st_image_free(big);
    }
}

/* The reserved path: fallocate says the disk is full (ST_EFULL, nothing changed); a chunk's
 * pwrite fails with ENOSPC (ST_EFULL) or EIO (ST_EIO) partway through the put (the transaction
 * is dropped: the store is clean and holds what it held); then the same puts succeed, with short
 * pwrites all along, and read back. */
static void test_reserve_and_pwrite_fail(void **state)
{
    (void)state;
    char dir[1200];
    st_store_sys sys = fault_sys();
    memset(&F, 0, sizeof F);
    st_store *st = open_fresh(dir, sizeof dir, &sys, 64u << 20, 0);
    st_synth_opts so = {.seed = 11, .n_tokens = 4000, .n_checkpoints = 2, .n_layers = 16, .attn_every = 1};
    st_image *big = NULL;
    assert_int_equal(st_image_synthesize(&so, &big), 0);
    assert_int_equal(st_store_put(st, "small", imgs[0], 0, NULL, NULL), 0);
    F.reserve_err = ENOSPC;
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), ST_EFULL);
    assert_true(strstr(st_errdetail(), "cannot take") != NULL);
    assert_int_equal(F.populates, 0);
    assert_int_equal(st_store_show(st, "big", &(st_session_info){0}), ST_ENOTFOUND);
    store_test_assert_clean(st);
    F.reserve_err = 0;
    const int errs[] = {ENOSPC, EIO};
    const int want[] = {ST_EFULL, ST_EIO};
    for (int k = 0; k < 2; k++) {
        F.pwrites = 0;
        F.pwrite_fail_at = 3;
        F.pwrite_err = errs[k];
        assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), want[k]);
        assert_true(F.pwrites >= 3);
        assert_int_equal(st_store_show(st, "big", &(st_session_info){0}), ST_ENOTFOUND);
        store_test_assert_clean(st);
        store_test_assert_get(st, "small", 0, imgs[0]);
    }
    F.pwrite_fail_at = 0;
    F.pwrites = 0;
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
    assert_true(F.pwrites > 0); /* the reserved path was taken */
    store_test_assert_get(st, "big", 0, big);
    store_test_assert_get(st, "small", 0, imgs[0]);
    store_test_assert_clean(st);
    st_store_close(st);
    /* and after a reopen */
    st_store_opts o = {.sys = &sys};
    assert_int_equal(st_store_open(&st, dir, &o), 0);
    store_test_assert_get(st, "big", 0, big);
    store_test_assert_clean(st);
    st_store_close(st);
    st_image_free(big);
}

/* A store opened with the default table (no st_store_sys of its own) writes through common's
 * one table: a pwrite failed there (st_sys_set, as any other module's test injects) reaches the
 * store's reserved put, which answers ST_EIO and keeps what it held. */
static int common_pwrites;
static ssize_t common_pwrite_fail(int fd, const void *buf, size_t n, uint64_t off)
{
    (void)fd, (void)buf, (void)n, (void)off;
    common_pwrites++;
    errno = EIO;
    return -1;
}

static void test_common_table_reaches_store(void **state)
{
    (void)state;
    char dir[1200];
    st_store *st = open_fresh(dir, sizeof dir, NULL, 64u << 20, 0);
    st_synth_opts so = {.seed = 12, .n_tokens = 4000, .n_checkpoints = 2, .n_layers = 16, .attn_every = 1};
    st_image *big = NULL;
    assert_int_equal(st_image_synthesize(&so, &big), 0);
    assert_int_equal(st_store_put(st, "small", imgs[0], 0, NULL, NULL), 0);
    common_pwrites = 0;
    assert_int_equal(st_sys_set("pwrite", (st_sys_fn)common_pwrite_fail), 0);
    int rc = st_store_put(st, "big", big, 0, NULL, NULL);
    st_sys_reset();
    assert_int_equal(rc, ST_EIO);
    assert_true(common_pwrites > 0);
    assert_int_equal(st_store_show(st, "big", &(st_session_info){0}), ST_ENOTFOUND);
    store_test_assert_clean(st);
    store_test_assert_get(st, "small", 0, imgs[0]);
    assert_int_equal(st_store_put(st, "big", big, 0, NULL, NULL), 0);
    store_test_assert_get(st, "big", 0, big);
    st_store_close(st);
    st_image_free(big);
}

static int exists(const char *p)
{
    struct stat sb;
    return stat(p, &sb) == 0;
}

static void test_backup_restore_faults(void **state)
{
    (void)state;
    char dir[1200], bak[1300], dst[1300];
    st_store_sys sys = fault_sys();
    memset(&F, 0, sizeof F);
    st_store *st = open_fresh(dir, sizeof dir, &sys, 0, 0);
    for (int i = 0; i < 4; i++)
        assert_int_equal(run_op(st, i), 0);
    snprintf(bak, sizeof bak, "%s/bak", base);
    /* a copy write fails (disk full, I/O error), the copy's fsync fails, the rename fails */
    const int want_rc[] = {ST_EFULL, EIO, EIO, EIO};
    for (int c = 0; c < 4; c++) {
        memset(&F, 0, sizeof F);
        if (c == 0 || c == 1) {
            F.write_fail_at = 1 + c;
            F.write_err = c == 0 ? ENOSPC : EIO;
        } else if (c == 2) {
            F.fsync_fail_at = 1;
            F.fsync_err = EIO;
        } else {
            F.rename_fail_at = 1;
        }
        assert_int_equal(st_store_backup(st, bak), want_rc[c]);
        assert_true(*st_errdetail());
        assert_false(exists(bak));
        assert_false(st_test_has_temp(bak));
        assert_int_equal(st_store_put(st, "w", imgs[3], 0, NULL, NULL), 0); /* the store keeps working */
        store_test_assert_clean(st);
    }
    memset(&F, 0, sizeof F);
    assert_int_equal(st_store_backup(st, bak), 0);
    char *want = dump(st);

    /* restore: a write, an fsync, a rename fail; nothing is left at the destination */
    snprintf(dst, sizeof dst, "%s/restored", base);
    st_store_opts ro = {.sys = &sys};
    for (int c = 0; c < 3; c++) {
        memset(&F, 0, sizeof F);
        if (c == 0) {
            F.write_fail_at = 2;
            F.write_err = ENOSPC;
        } else if (c == 1) {
            F.fsync_fail_at = 1;
            F.fsync_err = EIO;
        } else {
            F.rename_fail_at = 1;
        }
        assert_int_equal(st_store_restore_backup(bak, dst, &ro), c == 0 ? ST_EFULL : EIO);
        assert_false(exists(dst));
        assert_false(st_test_has_temp(dst));
    }
    memset(&F, 0, sizeof F);
    assert_int_equal(st_store_restore_backup(bak, dst, &ro), 0);
    st_store *r = NULL;
    assert_int_equal(st_store_open(&r, dst, NULL), 0);
    char *got = dump(r);
    assert_string_equal(got, want);
    free(got);
    free(want);
    store_test_assert_clean(r);
    st_store_close(r);
    st_store_close(st);
}

static void test_create_fails(void **state)
{
    (void)state;
    char dir[1200];
    st_store_sys sys = fault_sys();
    memset(&F, 0, sizeof F);
    F.commit_fail_at = 1;
    F.commit_err = ENOSPC;
    snprintf(dir, sizeof dir, "%s/create", base);
    st_store_opts o = {.create = 1, .sys = &sys};
    st_store *st = NULL;
    assert_int_equal(st_store_open(&st, dir, &o), ST_EFULL);
    assert_null(st);
    /* the empty environment left behind becomes a store on the next try */
    memset(&F, 0, sizeof F);
    assert_int_equal(st_store_open(&st, dir, &o), 0);
    store_test_assert_clean(st);
    st_store_close(st);
}

int main(void)
{
    st_test_tmpdir(base, sizeof base, "test_store_faults");
    imgs[0] = store_test_image(1, 300, 0, 0);
    imgs[1] = store_test_image(1, 700, 0, 0);
    imgs[2] = store_test_image(2, 500, 1, 256);
    imgs[3] = store_test_image(3, 100, 0, 0);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_commit_enospc_before),
        cmocka_unit_test(test_commit_eio_before),
        cmocka_unit_test(test_commit_eio_after),
        cmocka_unit_test(test_map_growth_fails),
        cmocka_unit_test(test_populate_fails),
        cmocka_unit_test(test_reserve_and_pwrite_fail),
        cmocka_unit_test(test_common_table_reaches_store),
        cmocka_unit_test(test_panic_reopen_then_put),
        cmocka_unit_test(test_backup_restore_faults),
        cmocka_unit_test(test_create_fails),
    };
    int rc = cmocka_run_group_tests(tests, NULL, NULL);
    for (int i = 0; i < 4; i++)
        st_image_free(imgs[i]);
    if (rc == 0)
        st_test_rmdir(base);
    return rc;
}
