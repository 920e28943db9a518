/*
 * test_engine_arch_state.c - the architecture a state belongs to, and what MTP blocks cost, with
 * the real binaries on seeded models:
 * - every architecture: `strata info`, `statectl inspect` of the session file its engine saved
 *   (fp32 v1 and bf16 v2), the file read back, and `statectl show` of the version imported into
 *   a store and of its export agree on the architecture and the layer kinds;
 * - files and store versions written before the name was recorded (the golden files; a real
 *   model's file without its ARCH section) show "unknown" and still restore;
 * - a name that disagrees with the fingerprint (checksum recomputed) is refused on restore, a
 *   damaged one (checksum not recomputed) as damage, a malformed one on read; a state of another
 *   architecture is refused naming both;
 * - MTP blocks: with the model file dropped from the page cache, loading and generating leaves
 *   the MTP tensors' pages unread (mincore), a used tensor's pages are read (the control), and
 *   the state saved is byte for byte that of the same model without MTP blocks.
 */
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <cmocka.h>

#include "engine_cli_test.h"
#include "st_file.h"

static void path_of(char *dst, size_t cap, const char *name)
{
    snprintf(dst, cap, "%s/%s", g_dir, name);
}

static void want(const char *what, const char *s)
{
    if (!strstr(out, s))
        fail_msg("%s lacks \"%s\":\n%s", what, s, out);
}

static void put_file(const char *name, const void *b, size_t n)
{
    char p[4300];
    path_of(p, sizeof p, name);
    FILE *f = fopen(p, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
}

static uint64_t get64(const unsigned char *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static void put64(unsigned char *p, uint64_t v)
{
    memcpy(p, &v, 8);
}

/* Offset of the ARCH section's header in a session file (right after GEOMETRY). */
static size_t arch_at(const unsigned char *b)
{
    size_t at = 64 + 32 + (size_t)get64(b + 64 + 8);
    uint32_t type;
    memcpy(&type, b + at, 4);
    assert_int_equal(type, ST_SECTION_ARCH);
    return at;
}

/* The ARCH section's checksum recomputed over its header's first 24 bytes and its payload. */
static void arch_resum(unsigned char *b)
{
    size_t at = arch_at(b);
    unsigned char t[24 + ST_ARCH_NAME_MAX];
    memcpy(t, b + at, 24);
    memcpy(t + 24, b + at + 32, ST_ARCH_NAME_MAX);
    put64(b + at + 24, st_checksum(t, sizeof t));
}

/* ---- every architecture ---------------------------------------------------------------------- */
static void test_arch_everywhere(void **state)
{
    (void)state;
    static const char *const cases[][2] = {
        {"strata-hybrid", "tiny"},       {"llama", "tiny"},
        {"qwen3", "tiny"},               {"qwen35", "qwen35-tiny"},
        {"qwen35moe", "qwen35moe-tiny"}, {"qwen3next", "qwen3next-tiny"},
    };
    char line[128], kinds[128], p[4300];
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        const char *arch = cases[i][0], *preset = cases[i][1];
        sh(1, BIN "/strata-mkmodel --arch %s --preset %s --ctx 256 -o %s/m.gguf 2>/dev/null && "
                  BIN "/strata info -m %s/m.gguf", arch, preset, g_dir, g_dir);
        snprintf(line, sizeof line, "architecture %s\n", arch);
        want("strata info", line);
        const char *k = strstr(out, "kinds        ");
        assert_non_null(k);
        k += strlen("kinds        ");
        size_t kl = strcspn(k, "\n");
        snprintf(kinds, sizeof kinds, "layers       %.*s\n", (int)kl, k);
        char js1[96];
        snprintf(js1, sizeof js1, "\"architecture\": \"%s\"", arch);
        for (int bf16 = 0; bf16 < 2; bf16++) {
            sh(1, BIN "/strata generate -m %s/m.gguf -p 'state of %s' -n 4 --tokens --ignore-eos "
                      "--threads 1 --session-out %s/s.stsf%s > /dev/null && " BIN
                      "/statectl inspect %s/s.stsf", g_dir, arch, g_dir,
               bf16 ? " --session-state-codec bf16" : "", g_dir);
            want("statectl inspect", line);
            want("statectl inspect", kinds);
            want("statectl inspect", bf16 ? "session file v2" : "session file v1");
            sh(1, BIN "/statectl inspect %s/s.stsf --json", g_dir);
            char js[96];
            snprintf(js, sizeof js, "\"architecture\": \"%s\"", arch);
            want("statectl inspect --json", js);
            /* the file read back carries the name; the engine restores it */
            st_image *img = NULL;
            path_of(p, sizeof p, "s.stsf");
            assert_int_equal(st_file_read(p, NULL, &img), 0);
            assert_string_equal(st_image_geometry(img)->arch, arch);
            st_image_free(img);
            sh(1, BIN "/strata generate -m %s/m.gguf --session-in %s/s.stsf -p ' more' -n 2 "
                      "--tokens --ignore-eos --threads 1 > /dev/null", g_dir, g_dir);
        }
        /* the store: the version records it, show prints it, an export re-creates it */
        sh(1, "rm -rf %s/st && " BIN "/statectl import %s/st %s/s.stsf --id a > /dev/null && "
              BIN "/statectl show %s/st a@1", g_dir, g_dir, g_dir, g_dir);
        want("statectl show ID@1", line);
        want("statectl show ID@1", kinds);
        sh(1, BIN "/statectl show %s/st a@1 --json", g_dir);
        want("statectl show ID@1 --json", js1);
        sh(1, BIN "/statectl show %s/st a", g_dir);
        want("statectl show ID", line);
        sh(1, BIN "/statectl export %s/st a@1 %s/e.stsf --format v2 && " BIN
                  "/statectl inspect %s/e.stsf", g_dir, g_dir, g_dir);
        want("inspect of an export", line);
    }
}

/* ---- written before the name was recorded ---------------------------------------------------- */
static void test_old_files(void **state)
{
    (void)state;
    static const char *const golden[] = {"v1_small.stsf", "v2_small.stsf", "v2_raw.stsf"};
    for (size_t i = 0; i < sizeof golden / sizeof golden[0]; i++) {
        sh(1, BIN "/statectl inspect " ST_TEST_DATA "/golden/%s", golden[i]);
        want("inspect of a golden file",
             "architecture unknown (written before session files named it)\n");
        want("inspect of a golden file", "all checks ok\n");
        sh(1, BIN "/statectl inspect " ST_TEST_DATA "/golden/%s --json", golden[i]);
        want("inspect --json of a golden file", "\"architecture\": null");
    }
    /* a real model's file as an earlier build wrote it: the same file without its ARCH section */
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --ctx 256 -o %s/q.gguf "
              "2>/dev/null && " BIN "/strata generate -m %s/q.gguf -p 'old file' -n 4 --tokens "
              "--ignore-eos --threads 1 --session-out %s/new.stsf > /dev/null", g_dir, g_dir, g_dir);
    size_t n;
    unsigned char *b = slurp("new.stsf", &n);
    size_t at = arch_at(b), cut = 32 + ST_ARCH_NAME_MAX;
    memmove(b + at, b + at + cut, n - at - cut);
    n -= cut;
    uint32_t ns;
    memcpy(&ns, b + 20, 4);
    ns--;
    memcpy(b + 20, &ns, 4);
    put64(b + 24, n);
    put64(b + 56, st_checksum(b, 56));
    put_file("old.stsf", b, n);
    free(b);
    sh(1, BIN "/statectl inspect %s/old.stsf", g_dir);
    want("inspect of an old file", "architecture unknown (written before session files named it)\n");
    want("inspect of an old file", "all checks ok\n");
    /* a store version of it records no name: show says so, an export adds none */
    sh(1, "rm -rf %s/st && " BIN "/statectl import %s/st %s/old.stsf --id o > /dev/null && "
          BIN "/statectl show %s/st o@1", g_dir, g_dir, g_dir, g_dir);
    want("show of an old file's version",
         "architecture unknown (saved before store versions recorded it)\n");
    sh(1, BIN "/statectl show %s/st o", g_dir);
    want("show of an old file's session",
         "architecture unknown (saved before store versions recorded it)\n");
    sh(1, BIN "/statectl export %s/st o@1 %s/o.stsf --format v1 && cmp %s/o.stsf %s/old.stsf",
       g_dir, g_dir, g_dir, g_dir);
    sh(1, BIN "/strata generate -m %s/q.gguf --session-in %s/old.stsf -p ' more' -n 2 --tokens "
              "--ignore-eos --threads 1 > %s/old.out && " BIN "/strata generate -m %s/q.gguf "
              "--session-in %s/new.stsf -p ' more' -n 2 --tokens --ignore-eos --threads 1 > "
              "%s/new.out && cmp %s/old.out %s/new.out", g_dir, g_dir, g_dir, g_dir, g_dir,
       g_dir, g_dir, g_dir);
}

/* ---- a name that disagrees ------------------------------------------------------------------- */
static void test_tampered_name(void **state)
{
    (void)state;
    sh(1, BIN "/strata-mkmodel --arch qwen35 --preset qwen35-tiny --ctx 256 -o %s/q.gguf "
              "2>/dev/null && " BIN "/strata generate -m %s/q.gguf -p 'tamper' -n 4 --tokens "
              "--ignore-eos --threads 1 --session-out %s/s.stsf > /dev/null", g_dir, g_dir, g_dir);
    size_t n;
    unsigned char *b = slurp("s.stsf", &n);
    size_t name = arch_at(b) + 32;
    assert_string_equal((const char *)b + name, "qwen35");
    /* renamed, checksum recomputed: a well-formed file whose name lies about its fingerprint */
    memset(b + name, 0, ST_ARCH_NAME_MAX);
    memcpy(b + name, "llama", 5);
    arch_resum(b);
    put_file("lie.stsf", b, n);
    sh(1, BIN "/statectl inspect %s/lie.stsf", g_dir);
    want("inspect of the renamed file", "architecture llama\n");
    sh(0, BIN "/strata generate -m %s/q.gguf --session-in %s/lie.stsf -p ' more' -n 2 "
              "--threads 1", g_dir, g_dir);
    want("restore of the renamed file", "corrupt");
    want("restore of the renamed file",
         "architecture qwen35 vs llama under one model fingerprint: the name disagrees with the "
         "fingerprint");
    /* the same through the API: a typed error, nothing restored */
    {
        char p[4300];
        st_model *m = NULL;
        st_engine *e = NULL;
        st_slot *s = NULL;
        st_image *img = NULL;
        st_engine_opts o;
        st_engine_opts_default(&o);
        o.n_ctx = 256;
        o.n_threads = 1;
        path_of(p, sizeof p, "q.gguf");
        assert_int_equal(st_model_load(p, &m), 0);
        assert_int_equal(st_engine_new(m, &o, &e), 0);
        assert_int_equal(st_slot_new(e, &s), 0);
        path_of(p, sizeof p, "lie.stsf");
        assert_int_equal(st_file_read(p, NULL, &img), 0);
        assert_int_equal(st_slot_restore(s, img), ST_ECORRUPT);
        assert_int_equal(st_slot_n_tokens(s), 0);
        st_image_free(img);
        path_of(p, sizeof p, "s.stsf");
        assert_int_equal(st_file_read(p, NULL, &img), 0);
        assert_int_equal(st_slot_restore(s, img), 0); /* the control: the true name restores */
        st_image_free(img);
        st_slot_free(s);
        st_engine_free(e);
        st_model_free(m);
    }
    /* under another architecture: the refusal names both */
    sh(0, BIN "/strata-mkmodel --arch llama --preset tiny --ctx 256 -o %s/l.gguf 2>/dev/null && "
              BIN "/strata generate -m %s/l.gguf --session-in %s/s.stsf -p ' more' -n 2 "
              "--threads 1", g_dir, g_dir, g_dir);
    want("restore under llama", "model fingerprint mismatch");
    want("restore under llama", "it is a qwen35 state, this engine runs llama; its layers are DDDA");
    /* renamed without the checksum: damage */
    memcpy(b + name, "qwen3", 6);
    put_file("dmg.stsf", b, n);
    sh(0, BIN "/statectl inspect %s/dmg.stsf", g_dir);
    want("inspect of the damaged name", "checksum mismatch");
    sh(0, BIN "/strata generate -m %s/q.gguf --session-in %s/dmg.stsf -p ' more' -n 2 "
              "--threads 1", g_dir, g_dir);
    want("restore of the damaged name", "checksum mismatch");
    /* malformed names, checksum recomputed: refused on read, naming the field */
    static const char *const bad[] = {"Qwen35", "", "qwen 35"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        memset(b + name, 0, ST_ARCH_NAME_MAX);
        memcpy(b + name, bad[i], strlen(bad[i]));
        arch_resum(b);
        put_file("bad.stsf", b, n);
        st_image *img = NULL;
        char p[4300];
        path_of(p, sizeof p, "bad.stsf");
        assert_int_equal(st_file_read(p, NULL, &img), ST_ECORRUPT);
        assert_null(img);
        if (!strstr(st_errdetail(), "section ARCH") || !strstr(st_errdetail(), "architecture name"))
            fail_msg("\"%s\": %s", bad[i], st_errdetail());
        sh(0, BIN "/statectl inspect %s/bad.stsf", g_dir);
        want("inspect of a malformed name", "architecture name");
    }
    /* padding after the NUL must be zero (one encoding per name) */
    memset(b + name, 0, ST_ARCH_NAME_MAX);
    memcpy(b + name, "qwen35", 6);
    b[name + 20] = 'x';
    arch_resum(b);
    put_file("pad.stsf", b, n);
    {
        st_image *img = NULL;
        char p[4300];
        path_of(p, sizeof p, "pad.stsf");
        assert_int_equal(st_file_read(p, NULL, &img), ST_ECORRUPT);
        assert_non_null(strstr(st_errdetail(), "padding byte 20"));
    }
    free(b);
}

/* ---- MTP blocks ------------------------------------------------------------------------------- */
/* Pages of [off, off + len) of the file in the page cache, and the page count. */
static size_t resident(const char *path, uint64_t off, uint64_t len, size_t *pages)
{
    long ps = sysconf(_SC_PAGESIZE);
    uint64_t a = off / (uint64_t)ps * (uint64_t)ps, end = off + len;
    size_t np = (size_t)((end - a + (uint64_t)ps - 1) / (uint64_t)ps);
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    void *m = mmap(NULL, (size_t)(end - a), PROT_READ, MAP_SHARED, fd, (off_t)a);
    assert_true(m != MAP_FAILED);
    unsigned char *v = malloc(np);
    assert_non_null(v);
    assert_int_equal(mincore(m, (size_t)(end - a), v), 0);
    size_t r = 0;
    for (size_t i = 0; i < np; i++)
        r += v[i] & 1;
    free(v);
    munmap(m, (size_t)(end - a));
    close(fd);
    *pages = np;
    return r;
}

/* The file's clean pages out of the page cache. */
static void drop(const char *path)
{
    int fd = open(path, O_RDONLY);
    assert_true(fd >= 0);
    assert_int_equal(fdatasync(fd), 0);
    assert_int_equal(posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);
    close(fd);
}

/* The kernel's readahead window of the file's device (bytes): a page fault reads up to this
 * much around the page it needs, so pages that close behind the last tensor read may be read
 * without the engine touching them. 8 MiB when the device does not say. */
static uint64_t readahead_bytes(const char *path)
{
    struct stat sb;
    char p[128];
    unsigned long kb = 0;
    assert_int_equal(stat(path, &sb), 0);
    static const char *const where[] = {"/sys/dev/block/%u:%u/queue/read_ahead_kb",
                                        "/sys/dev/block/%u:%u/../queue/read_ahead_kb"};
    for (size_t i = 0; i < 2 && !kb; i++) {
        snprintf(p, sizeof p, where[i], major(sb.st_dev), minor(sb.st_dev));
        FILE *f = fopen(p, "r");
        if (f) {
            if (fscanf(f, "%lu", &kb) != 1)
                kb = 0;
            fclose(f);
        }
    }
    return (kb ? kb : 8192) * 1024ull;
}

static void test_mtp_pages_unread(void **state)
{
    (void)state;
    char p[4300];
    /* one layer and two MTP blocks with wide feed-forwards: the MTP tensors, written last, span
     * about 50 MiB, far more than any readahead window behind the model's last tensor */
    static const char shape[] = "--arch qwen35 --preset qwen35-tiny --layers 1 --pattern A "
                                "--embd 512 --heads 4 --kv-heads 2 --head-dim 128 --ffn 8192 "
                                "--wtype bf16 --ctx 256";
    sh(1, BIN "/strata-mkmodel %s --nextn 2 -o %s/mtp.gguf 2>/dev/null && " BIN
              "/strata-mkmodel %s -o %s/plain.gguf 2>/dev/null", shape, g_dir, shape, g_dir);
    path_of(p, sizeof p, "mtp.gguf");
    /* the tensors' file offsets, from the file read into memory (dropped from the cache below) */
    size_t flen;
    unsigned char *fb = slurp("mtp.gguf", &flen);
    st_gguf *g = NULL;
    assert_int_equal(st_gguf_open_mem(fb, flen, &g), 0);
    uint64_t mtp_lo = UINT64_MAX, mtp_hi = 0, used_off = 0, used_len = 0, file_len = 0;
    for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
        const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
        uint64_t off = (uint64_t)((const unsigned char *)t->data - fb);
        if (!strncmp(t->name, "blk.1.", 6) || !strncmp(t->name, "blk.2.", 6)) {
            mtp_lo = off < mtp_lo ? off : mtp_lo;
            mtp_hi = off + t->nbytes > mtp_hi ? off + t->nbytes : mtp_hi;
        }
        if (!strcmp(t->name, "blk.0.ffn_up.weight")) {
            used_off = off;
            used_len = t->nbytes;
        }
        file_len = off + t->nbytes > file_len ? off + t->nbytes : file_len;
    }
    st_gguf_close(g);
    free(fb);
    assert_true(used_len > 0 && mtp_hi > mtp_lo);
    assert_true(used_off + used_len <= mtp_lo); /* the MTP blocks come last */
    uint64_t margin = 2 * readahead_bytes(p);
    if (mtp_hi - mtp_lo < margin + (16ull << 20))
        fail_msg("the MTP tensors span %llu bytes, too few beyond a readahead margin of %llu: "
                 "make them wider", (unsigned long long)(mtp_hi - mtp_lo),
                 (unsigned long long)margin);
    size_t np, r;
    drop(p);
    r = resident(p, 0, file_len, &np);
    if (r)
        fail_msg("the model is still in the page cache after POSIX_FADV_DONTNEED: %zu of %zu "
                 "pages", r, np);
    sh(1, BIN "/strata generate -m %s -p 'multi-token prediction' -n 6 --tokens --ignore-eos "
              "--threads 1 --session-out %s/mtp.stsf > %s/mtp.out", p, g_dir, g_dir);
    size_t used = resident(p, used_off, used_len, &np);
    fprintf(stderr, "blk.0.ffn_up.weight (used): %zu of %zu pages resident\n", used, np);
    assert_int_equal(used, np); /* the control: the check sees a tensor that was read */
    size_t near = resident(p, mtp_lo, margin, &np);
    fprintf(stderr, "MTP tensors, first %llu MiB (readahead margin): %zu of %zu pages resident\n",
            (unsigned long long)(margin >> 20), near, np);
    r = resident(p, mtp_lo + margin, mtp_hi - mtp_lo - margin, &np);
    fprintf(stderr, "MTP tensors beyond the margin (%llu MiB): %zu of %zu pages resident\n",
            (unsigned long long)((mtp_hi - mtp_lo - margin) >> 20), r, np);
    assert_int_equal(r, 0);
    /* the negative control: read, those very pages show resident */
    sh(1, "cat %s > /dev/null", p);
    size_t all = resident(p, mtp_lo + margin, mtp_hi - mtp_lo - margin, &np);
    assert_int_equal(all, np);
    /* neither run nor saved: the same tokens and the same session file, byte for byte, as the
     * model without MTP blocks */
    sh(1, BIN "/strata generate -m %s/plain.gguf -p 'multi-token prediction' -n 6 --tokens "
              "--ignore-eos --threads 1 --session-out %s/plain.stsf > %s/plain.out && cmp "
              "%s/mtp.out %s/plain.out && cmp %s/mtp.stsf %s/plain.stsf", g_dir, g_dir, g_dir,
       g_dir, g_dir, g_dir, g_dir);
    sh(1, BIN "/statectl inspect %s/mtp.stsf", g_dir);
    want("inspect of the MTP model's state", "layers       A (0 deltanet, 1 attention)\n");
    sh(1, "rm -f %s/mtp.gguf %s/plain.gguf", g_dir, g_dir);
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(g_dir, sizeof g_dir, "test_engine_arch_state");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(g_dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_arch_everywhere),
        cmocka_unit_test(test_old_files),
        cmocka_unit_test(test_tampered_name),
        cmocka_unit_test(test_mtp_pages_unread),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
