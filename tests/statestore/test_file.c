/*
 * test_file.c - session files: round trips (v1, v2, compressed or not, forced versions), ST_ELOSSY,
 * atomic and durable writes under injected failures, the reader's typed errors and their details,
 * inspect.
 */
#include <dirent.h>
#include <errno.h>
#include <malloc.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "st_file.h"
#include "st_store_int.h"
#include "st_test_image.h"
#include "st_test_util.h"

static const uint32_t all_fp32[3] = {ST_CODEC_FP32, ST_CODEC_FP32, ST_CODEC_FP32};
static const uint32_t mixed[3] = {ST_CODEC_F16, ST_CODEC_FP32, ST_CODEC_BF16};

static char tmpdir[1024];

static void put_u32(uint8_t *p, uint32_t v)
{
    memcpy(p, &v, 4);
}
static void put_u64(uint8_t *p, uint64_t v)
{
    memcpy(p, &v, 8);
}
static uint32_t get_u32(const uint8_t *p)
{
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}
static uint64_t get_u64(const uint8_t *p)
{
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* Re-seal a file after editing: section checksums and the header checksum recomputed, so a test
 * can build a structurally wrong file whose checksums are right. */
static void reseal(uint8_t *b, size_t len)
{
    uint64_t off = 64;
    uint32_t n = get_u32(b + 20);
    for (uint32_t s = 0; s < n && off + 32 <= len; s++) {
        uint64_t l = get_u64(b + off + 8);
        st_checksum_state cs;
        if (off + 32 + l > len)
            break;
        assert_int_equal(st_checksum_init(&cs), 0);
        st_checksum_update(&cs, b + off, 24);
        st_checksum_update(&cs, b + off + 32, l);
        put_u64(b + off + 24, st_checksum_final(&cs));
        st_checksum_free(&cs);
        off += 32 + l;
    }
    put_u64(b + 56, st_checksum(b, 56));
}

/* Offset of section s's header. */
static uint64_t section_off(const uint8_t *b, uint32_t s)
{
    uint64_t off = 64;
    for (uint32_t i = 0; i < s; i++)
        off += 32 + get_u64(b + off + 8);
    return off;
}

static int count_entries(const char *dir)
{
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    assert_non_null(d);
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0)
            n++;
    closedir(d);
    return n;
}

static void roundtrip(const st_image *img, const st_file_write_opts *o, uint32_t want_version)
{
    uint8_t *buf = NULL;
    size_t len = 0;
    st_image *back = NULL;

    assert_int_equal(st_file_write_mem(img, o, &buf, &len), 0);
    assert_true(len > 64);
    assert_memory_equal(buf, "STRATAsf", 8);
    assert_int_equal(get_u32(buf + 8), want_version);
    assert_int_equal(get_u64(buf + 24), len);
    assert_int_equal(st_file_read_mem(buf, len, NULL, &back), 0);
    assert_int_equal(st_test_image_equal(img, back), 0);
    st_image_free(back);

    /* the file writer produces the same bytes, and the file reader reads them */
    char path[1200];
    snprintf(path, sizeof path, "%s/rt.stsf", tmpdir);
    assert_int_equal(st_file_write(img, path, o), 0);
    size_t flen = 0;
    unsigned char *fb = st_test_slurp(path, &flen);
    assert_non_null(fb);
    assert_int_equal(flen, len);
    assert_memory_equal(fb, buf, len);
    free(fb);
    assert_int_equal(st_file_read(path, NULL, &back), 0);
    assert_int_equal(st_test_image_equal(img, back), 0);
    st_image_free(back);
    assert_int_equal(count_entries(tmpdir), 1); /* no temp left behind */
    unlink(path);
    free(buf);
}

static void test_roundtrips(void **state)
{
    st_image *a = NULL, *b = NULL, *m = NULL;
    st_file_write_opts o;
    (void)state;

    assert_int_equal(st_test_image_small(&a, 1, all_fp32), 0);
    assert_int_equal(st_test_image_small(&b, 2, mixed), 0);
    assert_int_equal(st_test_image_minimal(&m, 3), 0);

    roundtrip(a, NULL, 1);                       /* automatic: all fp32 -> v1 */
    roundtrip(m, NULL, 1);
    memset(&o, 0, sizeof o);
    roundtrip(b, &o, 2);                         /* automatic: bf16/f16 -> v2 */
    o.version = 2;
    roundtrip(a, &o, 2);                         /* v2 forced for fp32 */
    o.version = 1;
    roundtrip(a, &o, 1);
    o.version = 0;
    o.compress = 3;
    roundtrip(a, &o, 2);                         /* compression -> v2 */
    o.shuffle = 1;
    roundtrip(a, &o, 2);
    roundtrip(b, &o, 2);
    roundtrip(m, &o, 2);
    o.compress = 19;
    o.shuffle = 0;
    roundtrip(b, &o, 2);
    o.compress = 1;
    o.version = 2;
    o.shuffle = 1;
    roundtrip(b, &o, 2);

    /* a v1 read gives fp32 checkpoints */
    uint8_t *buf;
    size_t len = 0;
    st_image *back;
    uint32_t codec;
    assert_int_equal(st_file_write_mem(a, NULL, &buf, &len), 0);
    assert_int_equal(st_file_read_mem(buf, len, NULL, &back), 0);
    for (uint32_t c = 0; c < st_image_n_checkpoints(back); c++) {
        st_image_checkpoint_info(back, c, NULL, &codec);
        assert_int_equal(codec, ST_CODEC_FP32);
    }
    st_image_free(back);
    free(buf);

    /* no logits: no LOGITS section */
    assert_int_equal(st_image_logits_set(a, NULL, 0), 0);
    roundtrip(a, NULL, 1);
    st_image_free(a);
    st_image_free(b);
    st_image_free(m);
}

static void test_versions_lossy(void **state)
{
    st_image *b = NULL, *a = NULL;
    st_file_write_opts o = {0};
    uint8_t *buf = (uint8_t *)1;
    size_t len = 1;
    char path[1200];
    (void)state;

    assert_int_equal(st_test_image_small(&b, 2, mixed), 0);
    assert_int_equal(st_test_image_small(&a, 1, all_fp32), 0);
    o.version = 1;
    assert_int_equal(st_file_write_mem(b, &o, &buf, &len), ST_ELOSSY);
    assert_null(buf);
    assert_non_null(strstr(st_errdetail(), "checkpoint 0"));
    assert_non_null(strstr(st_errdetail(), "f16"));
    o.compress = 3;
    assert_int_equal(st_file_write_mem(a, &o, &buf, &len), ST_ELOSSY);
    assert_non_null(strstr(st_errdetail(), "compress"));
    o.compress = 0;
    o.version = 3;
    assert_int_equal(st_file_write_mem(a, &o, &buf, &len), ST_EVERSION);
    o.version = 0;
    o.compress = 20;
    assert_int_equal(st_file_write_mem(a, &o, &buf, &len), ST_EINVAL);
    o.compress = -1;
    assert_int_equal(st_file_write_mem(a, &o, &buf, &len), ST_EINVAL);

    /* ST_ELOSSY from st_file_write leaves no file */
    snprintf(path, sizeof path, "%s/lossy.stsf", tmpdir);
    o.version = 1;
    o.compress = 0;
    assert_int_equal(st_file_write(b, path, &o), ST_ELOSSY);
    assert_int_equal(count_entries(tmpdir), 0);

    /* incomplete images are refused */
    assert_int_equal(st_image_checkpoint_remove(a, 2), 0);
    assert_int_equal(st_file_write_mem(a, NULL, &buf, &len), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "last checkpoint"));
    st_image_free(a);
    st_image_free(b);
}

/* The writer is deterministic: its bytes depend on the image and the options only. glibc's
 * M_PERTURB fills every allocation with a different byte on each pass, so a byte the writer left
 * uninitialised (in its buffers or in the image's) would show as a difference. (Sanitizer builds
 * replace malloc and ignore M_PERTURB; the normal build runs this test too.) */
static void write_perturbed(const st_image *img, const st_file_write_opts *o, int perturb,
                            uint8_t **mem, size_t *mem_len, unsigned char **file, size_t *file_len)
{
    char path[1200];
    st_image *c = NULL;
    mallopt(M_PERTURB, perturb);
    assert_int_equal(st_image_clone(&c, img), 0);
    assert_int_equal(st_file_write_mem(c, o, mem, mem_len), 0);
    snprintf(path, sizeof path, "%s/det.stsf", tmpdir);
    assert_int_equal(st_file_write(c, path, o), 0);
    *file = st_test_slurp(path, file_len);
    assert_non_null(*file);
    unlink(path);
    st_image_free(c);
    mallopt(M_PERTURB, 0);
}

static void test_deterministic(void **state)
{
    const st_file_write_opts raw = {0}, v2 = {.version = 2}, z = {.compress = 3, .shuffle = 1};
    struct {
        const uint32_t *codecs;
        const st_file_write_opts *o;
        uint32_t version;
    } cases[] = {{all_fp32, &raw, 1}, {all_fp32, &v2, 2}, {mixed, &raw, 2}, {mixed, &z, 2}};
    (void)state;
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        st_image *a = NULL;
        uint8_t *m1, *m2;
        unsigned char *f1, *f2;
        size_t lm1, lm2, lf1, lf2;
        assert_int_equal(st_test_image_small(&a, 11, cases[k].codecs), 0);
        write_perturbed(a, cases[k].o, 0x5a, &m1, &lm1, &f1, &lf1);
        write_perturbed(a, cases[k].o, 0xa5, &m2, &lm2, &f2, &lf2);
        assert_int_equal(get_u32(m1 + 8), cases[k].version);
        assert_int_equal(lm1, lm2);
        assert_memory_equal(m1, m2, lm1);
        assert_int_equal(lf1, lm1);
        assert_memory_equal(f1, m1, lm1);
        assert_int_equal(lf2, lm1);
        assert_memory_equal(f2, m1, lm1);
        free(m1);
        free(m2);
        free(f1);
        free(f2);
        st_image_free(a);
    }
}

/* Images of several MiB: the file writer's buffer is flushed many times, tensors larger than it
 * are written past it, and compressed sections (frames of more than 1 MiB) are read back in
 * pieces and their headers patched into bytes already on disk. It must still produce exactly the
 * memory writer's bytes, and both readers must load them. */
static void test_large_roundtrips(void **state)
{
    st_synth_opts so = {.seed = 21, .n_layers = 4, .heads = 4, .head_dim = 256, .n_tokens = 3000,
                        .n_checkpoints = 3};
    st_image *img = NULL;
    st_file_write_opts o = {0};
    (void)state;

    assert_int_equal(st_image_synthesize(&so, &img), 0);
    assert_true(st_image_bytes(img) > (8u << 20));
    roundtrip(img, &o, 1);
    o.compress = 1;
    o.shuffle = 1;
    roundtrip(img, &o, 2);
    for (uint32_t c = 0; c < st_image_n_checkpoints(img); c++) {
        static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
        assert_int_equal(st_image_checkpoint_recode(img, c, c == 1 ? ST_CODEC_F16 : ST_CODEC_BF16,
                                                    scratch, sizeof scratch), 0);
    }
    roundtrip(img, &o, 2);
    o.compress = 0;
    roundtrip(img, &o, 2);
    st_image_free(img);
}

struct prog {
    uint64_t calls, last_done, total;
    int monotonic;
};
static void on_progress(void *arg, uint64_t done, uint64_t total)
{
    struct prog *p = arg;
    if (p->calls && done < p->last_done)
        p->monotonic = 0;
    p->calls++;
    p->last_done = done;
    p->total = total;
}

/* A file large enough to be hashed on the reader's helper thread while the next piece is read
 * (st_file.c, reader invariant 5), damaged at the first, a middle and the last byte of its last
 * checkpoint's payload and in a late K/V section: every damage is refused as the checksum
 * mismatch of that section, *out stays NULL, and the intact file still reads back equal. */
static void test_large_damage(void **state)
{
    st_synth_opts so = {.seed = 22, .n_layers = 4, .heads = 4, .head_dim = 256, .n_tokens = 3000,
                        .n_checkpoints = 3};
    st_image *img = NULL, *back = NULL;
    uint64_t ck_off = 0, ck_len = 0, kv_off = 0, kv_len = 0, off = 64;
    char path[1200];
    size_t len = 0;
    (void)state;

    assert_int_equal(st_image_synthesize(&so, &img), 0);
    snprintf(path, sizeof path, "%s/large-damage.stsf", tmpdir);
    assert_int_equal(st_file_write(img, path, NULL), 0);
    unsigned char *b = st_test_slurp(path, &len);
    assert_non_null(b);
    assert_true(len > (8u << 20)); /* ST_RD_ASYNC_MIN */
    for (uint32_t s = 0; s < get_u32(b + 20); s++) {
        uint32_t type = get_u32(b + off);
        if (type == ST_SECTION_CHECKPOINT) {
            ck_off = off;
            ck_len = get_u64(b + off + 8);
        } else if (type == ST_SECTION_KV) {
            kv_off = off;
            kv_len = get_u64(b + off + 8);
        }
        off += 32 + get_u64(b + off + 8);
    }
    assert_int_equal(off, len);
    assert_true(ck_len > (2u << 20) && kv_len > 0); /* pieces of ST_RD_PIECE */
    const uint64_t at[] = {ck_off + 32, ck_off + 32 + ck_len / 2 + 7, ck_off + 32 + ck_len - 1,
                           kv_off + 32 + kv_len - 1};
    for (size_t i = 0; i < sizeof at / sizeof at[0]; i++) {
        b[at[i]] ^= 0x10;
        assert_int_equal(st_file_replace(path, b, len), 0);
        back = (st_image *)b; /* must come back NULL */
        assert_int_equal(st_file_read(path, NULL, &back), ST_ECORRUPT);
        assert_null(back);
        assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
        assert_non_null(strstr(st_errdetail(), i < 3 ? "section CHECKPOINT[2]" : "section KV["));
        b[at[i]] ^= 0x10;
    }
    struct prog pr = {.monotonic = 1};
    st_file_read_opts ro = {.progress = on_progress, .progress_arg = &pr};
    assert_int_equal(st_file_replace(path, b, len), 0);
    assert_int_equal(st_file_read(path, &ro, &back), 0);
    assert_int_equal(st_test_image_equal(img, back), 0);
    assert_true(pr.monotonic);
    assert_int_equal(pr.last_done, len);
    st_image_free(back);
    unlink(path);
    free(b);
    st_image_free(img);
}

/* Write len bytes to path (not durable: a test's scratch file). */
static void put_file(const char *path, const uint8_t *b, size_t len)
{
    FILE *f = fopen(path, "wb");
    assert_non_null(f);
    assert_int_equal(fwrite(b, 1, len, f), len);
    assert_int_equal(fclose(f), 0);
}

/* The read of path fails as the checksum mismatch of the section at offset off. */
static void expect_mismatch_at(const char *path, uint64_t off)
{
    char want[64];
    st_image *back = (st_image *)path; /* must come back NULL */
    assert_int_equal(st_file_read(path, NULL, &back), ST_ECORRUPT);
    assert_null(back);
    snprintf(want, sizeof want, " at offset %llu: checksum mismatch", (unsigned long long)off);
    if (!strstr(st_errdetail(), want))
        fail_msg("want \"%s\" in: %s", want, st_errdetail());
}

/* The sections of a file read on the helper thread whose checks do not hold up the next
 * section (st_file.c, reader invariant 6), more of them than the reader's check slots: a
 * damaged byte in any one of them is that section's checksum mismatch; with a second damage in
 * a later section, or a later error of another kind (a reserved header field set, a checkpoint
 * position out of order), the earliest damaged section is still the error,
 * as when each section was compared before the next began; the intact file reads back equal. */
static void test_large_damage_order(void **state)
{
    st_synth_opts so = {.seed = 23, .n_layers = 6, .attn_every = 1, .heads = 4, .head_dim = 256,
                        .n_tokens = 1200, .n_checkpoints = 40};
    st_image *img = NULL, *back = NULL;
    uint64_t off = 64, secs[128];
    uint32_t n = 0, types[128] = {0};
    char path[1200];
    size_t len = 0;
    (void)state;

    assert_int_equal(st_image_synthesize(&so, &img), 0);
    snprintf(path, sizeof path, "%s/large-order.stsf", tmpdir);
    assert_int_equal(st_file_write(img, path, NULL), 0);
    uint8_t *b = st_test_slurp(path, &len);
    assert_non_null(b);
    assert_true(len > (8u << 20)); /* ST_RD_ASYNC_MIN */
    while (off < len) {
        assert_true(n < 128);
        types[n] = get_u32(b + off);
        secs[n++] = off;
        off += 32 + get_u64(b + off + 8);
    }
    assert_int_equal(off, len);
    assert_int_equal(types[1], ST_SECTION_TOKENS);
    assert_true(n - 1 > 32 + 2); /* more deferred sections than ST_RD_FINS */
    for (uint32_t i = 1; i < n; i++) {
        uint64_t at = (i + 1 < n ? secs[i + 1] : len) - 1; /* the payload's last byte */
        b[at] ^= 0x04;
        put_file(path, b, len);
        expect_mismatch_at(path, secs[i]);
        b[at] ^= 0x04;
    }
    /* two damaged sections: the first is named */
    b[secs[3] + 40] ^= 1;
    b[secs[n - 3] + 40] ^= 1;
    put_file(path, b, len);
    expect_mismatch_at(path, secs[3]);
    b[secs[n - 3] + 40] ^= 1;
    /* a later error of another kind: a reserved header field of a late section */
    put_u32(b + secs[n - 2] + 16, 1);
    put_file(path, b, len);
    expect_mismatch_at(path, secs[3]);
    put_u32(b + secs[n - 2] + 16, 0);
    /* ... a checkpoint position before its predecessor's (checkpoint 10, resealed) */
    b[secs[3] + 40] ^= 1;
    {
        uint32_t c = 0;
        while (c < n && !(types[c] == ST_SECTION_CHECKPOINT && get_u32(b + secs[c] + 4) == 10))
            c++;
        assert_true(c < n);
        b[secs[2] + 40] ^= 1; /* a damaged K/V section before it */
        put_u64(b + secs[c] + 32, 0);
        put_file(path, b, len);
        expect_mismatch_at(path, secs[2]);
        b[secs[2] + 40] ^= 1;
        reseal(b, len); /* the position error alone, without the damage before it */
        put_file(path, b, len);
        back = (st_image *)b;
        assert_int_equal(st_file_read(path, NULL, &back), ST_ECORRUPT);
        assert_null(back);
        assert_null(strstr(st_errdetail(), "checksum mismatch"));
        assert_non_null(strstr(st_errdetail(), "is not after checkpoint 9"));
    }
    free(b);
    /* the intact file */
    assert_int_equal(st_file_write(img, path, NULL), 0);
    assert_int_equal(st_file_read(path, NULL, &back), 0);
    assert_int_equal(st_test_image_equal(img, back), 0);
    st_image_free(back);
    unlink(path);
    st_image_free(img);
}

static void test_progress(void **state)
{
    st_image *a = NULL, *back = NULL;
    struct prog pw = {.monotonic = 1}, pr = {.monotonic = 1};
    st_file_write_opts o = {.compress = 3, .shuffle = 1, .progress = on_progress, .progress_arg = &pw};
    st_file_read_opts ro = {.progress = on_progress, .progress_arg = &pr};
    char path[1200];
    (void)state;

    assert_int_equal(st_test_image_small(&a, 5, mixed), 0);
    snprintf(path, sizeof path, "%s/prog.stsf", tmpdir);
    assert_int_equal(st_file_write(a, path, &o), 0);
    assert_true(pw.calls >= 1);
    assert_true(pw.monotonic);
    assert_int_equal(pw.last_done, pw.total);
    assert_int_equal(pw.total, st_image_bytes(a));
    assert_int_equal(st_file_read(path, &ro, &back), 0);
    assert_true(pr.calls >= 1);
    assert_true(pr.monotonic);
    assert_int_equal(pr.last_done, pr.total);
    struct stat stt;
    assert_int_equal(stat(path, &stt), 0);
    assert_int_equal(pr.total, (uint64_t)stt.st_size);
    unlink(path);
    st_image_free(a);
    st_image_free(back);
}

/* ---- fault injection ---------------------------------------------------------------------- */

static int fail_at, calls;
static ssize_t bad_write(int fd, const void *b, size_t n)
{
    if (++calls == fail_at) {
        errno = ENOSPC;
        return -1;
    }
    if (calls == fail_at + 1000) /* never */
        return 0;
    /* short writes exercise the retry loop */
    return write(fd, b, n > 7 ? n / 2 : n);
}
static ssize_t bad_pwrite(int fd, const void *b, size_t n, uint64_t off)
{
    if (++calls == fail_at) {
        errno = EIO;
        return -1;
    }
    return pwrite(fd, b, n, (off_t)off);
}
static int bad_fsync(int fd)
{
    if (++calls == fail_at) {
        errno = EIO;
        return -1;
    }
    return fsync(fd);
}
static int bad_rename(const char *a, const char *b)
{
    if (++calls == fail_at) {
        errno = EXDEV;
        return -1;
    }
    return rename(a, b);
}

static void check_untouched(const char *path)
{
    size_t len = 0;
    unsigned char *b = st_test_slurp(path, &len);
    assert_non_null(b);
    assert_int_equal(len, 3);
    assert_memory_equal(b, "OLD", 3);
    free(b);
    assert_int_equal(count_entries(tmpdir), 1); /* no temp file left */
}

static void test_atomic_write(void **state)
{
    st_image *a = NULL;
    char path[1200], dpath[1200];
    st_file_write_opts o = {.compress = 3, .shuffle = 1};
    int failures = 0;
    (void)state;

    assert_int_equal(st_test_image_small(&a, 9, mixed), 0);
    snprintf(path, sizeof path, "%s/target.stsf", tmpdir);
    assert_int_equal(st_test_spit(path, "OLD", 3), 0);

    /* fail the Nth write / pwrite / fsync / rename: the target stays, no temp is left */
    for (int which = 0; which < 4; which++) {
        for (fail_at = 1;; fail_at++) {
            int rc;
            calls = 0;
            st_sys_reset();
            if (which == 0)
                st_sys_calls.write = bad_write;
            else if (which == 1)
                st_sys_calls.pwrite = bad_pwrite;
            else if (which == 2)
                st_sys_calls.fsync = bad_fsync;
            else
                st_sys_calls.rename = bad_rename;
            rc = st_file_write(a, path, which == 3 ? NULL : &o);
            st_sys_reset();
            if (rc == 0) {
                /* ran out of calls to fail: the last success really wrote the file */
                st_image *back = NULL;
                assert_int_equal(st_file_read(path, NULL, &back), 0);
                assert_int_equal(st_test_image_equal(a, back), 0);
                st_image_free(back);
                assert_int_equal(st_test_spit(path, "OLD", 3), 0);
                break;
            }
            failures++;
            assert_true(rc > 0);
            if (which == 2 && fail_at == 2) {
                /* the fsync of the directory comes after the rename: its failure is reported,
                 * with the complete new file in place */
                st_image *back = NULL;
                assert_int_equal(rc, EIO);
                assert_int_equal(st_file_read(path, NULL, &back), 0);
                st_image_free(back);
                assert_int_equal(count_entries(tmpdir), 1);
                assert_int_equal(st_test_spit(path, "OLD", 3), 0);
                break;
            }
            check_untouched(path);
        }
    }
    assert_true(failures >= 5);

    /* st_file_replace under the same faults */
    for (fail_at = 1; fail_at <= 1; fail_at++) {
        calls = 0;
        st_sys_calls.write = bad_write;
        assert_int_equal(st_file_replace(path, "NEWDATA", 7), ENOSPC);
        st_sys_reset();
        check_untouched(path);
    }
    assert_int_equal(st_file_replace(path, "NEWDATA", 7), 0);
    size_t len = 0;
    unsigned char *b = st_test_slurp(path, &len);
    assert_int_equal(len, 7);
    assert_memory_equal(b, "NEWDATA", 7);
    free(b);
    unlink(path);

    /* a target that cannot be renamed over (a non-empty directory) */
    snprintf(dpath, sizeof dpath, "%s/adir", tmpdir);
    assert_int_equal(mkdir(dpath, 0755), 0);
    snprintf(path, sizeof path, "%s/adir/x", tmpdir);
    assert_int_equal(st_test_spit(path, "OLD", 3), 0);
    int rc = st_file_write(a, dpath, NULL);
    assert_true(rc == EISDIR || rc == ENOTEMPTY || rc == EEXIST);
    assert_int_equal(count_entries(tmpdir), 1);
    assert_int_equal(count_entries(dpath), 1);
    /* a directory that does not exist */
    snprintf(path, sizeof path, "%s/nope/x.stsf", tmpdir);
    assert_int_equal(st_file_write(a, path, NULL), ENOENT);
    assert_non_null(strstr(st_errdetail(), "nope"));
    /* trailing slash */
    snprintf(path, sizeof path, "%s/", tmpdir);
    assert_int_equal(st_file_write(a, path, NULL), EISDIR);
    st_test_rmdir(dpath);
    assert_int_equal(count_entries(tmpdir), 0);
    st_image_free(a);
}

/* ---- reader errors ------------------------------------------------------------------------- */

static void expect_read(const uint8_t *b, size_t len, int want, const char *detail)
{
    st_image *img = (st_image *)1;
    int rc = st_file_read_mem(b, len, NULL, &img);
    if (rc != want)
        fail_msg("read: %d (%s), expected %d; detail: %s", rc, st_strerror(rc), want, st_errdetail());
    assert_null(img);
    if (detail && !strstr(st_errdetail(), detail))
        fail_msg("detail \"%s\" lacks \"%s\"", st_errdetail(), detail);
}

static void test_reader_errors(void **state)
{
    st_image *a = NULL;
    uint8_t *buf, *c;
    size_t len = 0;
    (void)state;

    assert_int_equal(st_test_image_small(&a, 4, mixed), 0);
    st_file_write_opts o = {.compress = 3, .shuffle = 1};
    assert_int_equal(st_file_write_mem(a, &o, &buf, &len), 0);
    c = malloc(len + 64);

    expect_read(buf, 0, ST_ECORRUPT, "truncated");
    expect_read((const uint8_t *)"GIF89a", 6, ST_ENOTSTRATA, NULL);
    expect_read((const uint8_t *)"STRAT", 5, ST_ECORRUPT, NULL);
    memcpy(c, buf, len);
    c[0] = 'X';
    expect_read(c, len, ST_ENOTSTRATA, "not a Strata file");
    assert_string_equal(st_strerror(ST_ENOTSTRATA), "not a Strata file");

    /* a v3 file: ST_EVERSION naming it, even with everything else wrong */
    memcpy(c, buf, len);
    put_u32(c + 8, 3);
    expect_read(c, len, ST_EVERSION, "session file version 3; this build reads 1 and 2");
    expect_read(c, 12, ST_EVERSION, "version 3");
    memset(c + 12, 0xff, 52);
    expect_read(c, 64, ST_EVERSION, "version 3");
    memcpy(c, buf, len);
    put_u32(c + 8, 0);
    expect_read(c, len, ST_EVERSION, "version 0");

    /* header checks */
    memcpy(c, buf, len);
    c[40] ^= 1;
    expect_read(c, len, ST_ECORRUPT, "header at offset 0: checksum mismatch");
    expect_read(buf, len - 1, ST_ECORRUPT, "truncated");
    memcpy(c, buf, len);
    c[len] = 0;
    expect_read(c, len + 1, ST_ECORRUPT, "extended");
    memcpy(c, buf, len);
    put_u32(c + 16, 1);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "flags");
    memcpy(c, buf, len);
    put_u64(c + 48, 1);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "reserved");
    memcpy(c, buf, len);
    put_u32(c + 20, 1u << 30);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "sections cannot fit");
    memcpy(c, buf, len);
    put_u64(c + 40, 33); /* n_tokens beyond n_ctx */
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "exceed n_ctx");

    /* a section length beyond the file: named with its index and offset */
    uint64_t kv3 = section_off(buf, 3); /* GEOMETRY, TOKENS, KV[0], KV[3] */
    memcpy(c, buf, len);
    assert_int_equal(get_u32(c + kv3), ST_SECTION_KV);
    assert_int_equal(get_u32(c + kv3 + 4), 3);
    put_u64(c + kv3 + 8, 1ull << 40);
    reseal(c, len);
    char want[128];
    snprintf(want, sizeof want, "section KV[3] at offset %llu: length 1099511627776 exceeds the %llu "
             "bytes that remain", (unsigned long long)kv3, (unsigned long long)(len - kv3 - 32));
    expect_read(c, len, ST_ECORRUPT, want);

    /* a section checksum */
    memcpy(c, buf, len);
    c[kv3 + 40] ^= 0x10;
    snprintf(want, sizeof want, "section KV[3] at offset %llu: checksum mismatch", (unsigned long long)kv3);
    expect_read(c, len, ST_ECORRUPT, want);

    /* wrong section order */
    memcpy(c, buf, len);
    put_u32(c + kv3 + 4, 5);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "found KV[5] where KV[3] was expected");

    /* reserved section header fields */
    memcpy(c, buf, len);
    put_u32(c + kv3 + 20, 1);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "reserved");

    /* an unknown codec, correctly checksummed: ST_ECODEC; the same damage unsealed: checksum */
    uint64_t ck0 = section_off(buf, 4);
    assert_int_equal(get_u32(buf + ck0), ST_SECTION_CHECKPOINT);
    memcpy(c, buf, len);
    put_u32(c + ck0 + 32 + 8, 7);
    expect_read(c, len, ST_ECORRUPT, "checksum mismatch");
    reseal(c, len);
    expect_read(c, len, ST_ECODEC, "unknown codec 7");
    /* reserved checkpoint flag bits; shuffle without compression */
    memcpy(c, buf, len);
    put_u32(c + ck0 + 32 + 12, 0x7);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "reserved bits");
    /* positions */
    memcpy(c, buf, len);
    put_u64(c + ck0 + 32, 40);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "position 40 exceeds");
    uint64_t ck1 = section_off(buf, 5);
    memcpy(c, buf, len);
    put_u64(c + ck1 + 32, 3); /* equal to checkpoint 0's */
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "is not after checkpoint 0");

    /* a frame that declares more than its tensor */
    memcpy(c, buf, len);
    /* first frame of CHECKPOINT[0]: u64 length at +16 of the payload, frame header after it;
     * its decoded size is at frame byte 8 */
    put_u64(c + ck0 + 32 + 16 + 8 + 8, 1ull << 40);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "frame declares 1099511627776 bytes");
    /* a frame length beyond the section */
    memcpy(c, buf, len);
    put_u64(c + ck0 + 32 + 16, 1ull << 33);
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "remain in the section");
    /* a frame's shuffle width must be what the checkpoint's flags and the element size say:
     * the frame's own checksum covers the shuffled bytes, so a wrong width would decode without
     * complaint into wrong values */
    memcpy(c, buf, len);
    assert_int_equal(c[ck0 + 32 + 16 + 8 + 5], 2); /* f16 state: width 2 */
    c[ck0 + 32 + 16 + 8 + 5] = 4;
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "frame shuffle width 4");
    memcpy(c, buf, len);
    put_u32(c + ck0 + 32 + 12, 1); /* compressed, not shuffled: yet the frames are */
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "want 0");

    /* the decoded cap: ST_ETOOBIG */
    st_image *img = NULL;
    st_file_read_opts ro = {.max_decoded_bytes = 100};
    assert_int_equal(st_file_read_mem(buf, len, &ro, &img), ST_ETOOBIG);
    assert_null(img);
    assert_non_null(strstr(st_errdetail(), "limit of 100 bytes"));
    ro.max_decoded_bytes = 1u << 20;
    assert_int_equal(st_file_read_mem(buf, len, &ro, &img), 0);
    st_image_free(img);

    /* the geometry is checked (a K/V tensor not spanning n_ctx) */
    uint64_t g0 = 64;
    memcpy(c, buf, len);
    put_u64(c + g0 + 32 + 48 + 64, 31); /* tensor 0 shape[0] */
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "section GEOMETRY at offset 64");
    /* name padding */
    memcpy(c, buf, len);
    c[g0 + 32 + 48 + 40] = 'z';
    reseal(c, len);
    expect_read(c, len, ST_ECORRUPT, "padding");

    /* trailing bytes within file_len (an extra section) */
    memcpy(c, buf, len);
    memset(c + len, 0, 32);
    put_u64(c + 24, len + 32);
    reseal(c, len + 32);
    expect_read(c, len + 32, ST_ECORRUPT, "after the last section");

    /* the file reader: errors name the path; not a regular file */
    char path[1200];
    snprintf(path, sizeof path, "%s/bad.stsf", tmpdir);
    memcpy(c, buf, len);
    c[kv3 + 40] ^= 0x10;
    assert_int_equal(st_test_spit(path, c, len), 0);
    assert_int_equal(st_file_read(path, NULL, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), path));
    assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
    /* the file reader checks section by section: an unknown codec in a damaged section is
     * reported as the damage, in an intact one as ST_ECODEC; frames are checked too */
    memcpy(c, buf, len);
    put_u32(c + ck0 + 32 + 8, 7);
    assert_int_equal(st_test_spit(path, c, len), 0);
    assert_int_equal(st_file_read(path, NULL, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "CHECKPOINT[0]"));
    assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
    reseal(c, len);
    assert_int_equal(st_test_spit(path, c, len), 0);
    assert_int_equal(st_file_read(path, NULL, &img), ST_ECODEC);
    assert_non_null(strstr(st_errdetail(), "unknown codec 7"));
    memcpy(c, buf, len);
    put_u64(c + ck0 + 32 + 16 + 8 + 8, 1ull << 40);
    assert_int_equal(st_test_spit(path, c, len), 0);
    assert_int_equal(st_file_read(path, NULL, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "checksum mismatch"));
    reseal(c, len);
    assert_int_equal(st_test_spit(path, c, len), 0);
    assert_int_equal(st_file_read(path, NULL, &img), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "frame declares 1099511627776 bytes"));
    assert_int_equal(st_file_read(path, &ro, &img), ST_ECORRUPT);
    ro.max_decoded_bytes = 100;
    assert_int_equal(st_test_spit(path, buf, len), 0);
    assert_int_equal(st_file_read(path, &ro, &img), ST_ETOOBIG);
    assert_null(img);
    unlink(path);
    assert_int_equal(st_file_read(tmpdir, NULL, &img), EISDIR);
    assert_int_equal(st_file_read(path, NULL, &img), ENOENT);

    free(c);
    free(buf);
    st_image_free(a);
}

static void test_inspect(void **state)
{
    st_image *a = NULL;
    size_t len = 0;
    st_file_info info;
    char path[1200];
    (void)state;

    assert_int_equal(st_test_image_small(&a, 8, mixed), 0);
    st_file_write_opts o = {.compress = 3, .shuffle = 1};
    snprintf(path, sizeof path, "%s/insp.stsf", tmpdir);
    assert_int_equal(st_file_write(a, path, &o), 0);

    assert_int_equal(st_file_inspect(path, &info), 0);
    assert_true(info.all_ok);
    assert_int_equal(info.first_error, 0);
    assert_int_equal(info.version, 2);
    assert_int_equal(info.n_tokens, 11);
    assert_int_equal(info.state_hash, st_image_state_hash(a));
    assert_int_equal(st_geometry_compare(&info.geometry, st_image_geometry(a)), 0);
    assert_int_equal(info.n_sections, 2 + 2 + 3 + 1);
    assert_int_equal(info.sections[0].type, ST_SECTION_GEOMETRY);
    assert_int_equal(info.sections[0].offset, 64);
    assert_int_equal(info.sections[1].type, ST_SECTION_TOKENS);
    assert_int_equal(info.sections[1].length, 11 * 4);
    assert_int_equal(info.sections[3].type, ST_SECTION_KV);
    assert_int_equal(info.sections[3].index, 3);
    for (uint32_t c = 0; c < 3; c++) {
        st_file_section_info *s = &info.sections[4 + c];
        assert_int_equal(s->type, ST_SECTION_CHECKPOINT);
        assert_int_equal(s->index, c);
        assert_int_equal(s->codec, mixed[c]);
        assert_int_equal(s->compressed, 1);
    }
    assert_int_equal(info.sections[4].position, 3);
    assert_int_equal(info.sections[6].position, 11);
    assert_int_equal(info.sections[7].type, ST_SECTION_LOGITS);
    for (uint32_t s = 0; s < info.n_sections; s++)
        assert_true(info.sections[s].checksum_ok);
    uint64_t kv_off = info.sections[3].offset;
    uint64_t ck_off = info.sections[5].offset, ck_len = info.sections[5].length;
    st_file_info_free(&info);
    st_file_info_free(NULL);

    /* damage KV[3] and CHECKPOINT[1]: those two are bad, the rest ok, the walk completes */
    unsigned char *b = st_test_slurp(path, &len);
    b[kv_off + 33] ^= 0x40;
    b[ck_off + 32 + ck_len - 1] ^= 0x01;
    assert_int_equal(st_test_spit(path, b, len), 0);
    assert_int_equal(st_file_inspect(path, &info), 0);
    assert_false(info.all_ok);
    assert_int_equal(info.first_error, ST_ECORRUPT);
    assert_non_null(strstr(info.first_error_detail, "KV[3]"));
    assert_int_equal(info.n_sections, 8);
    for (uint32_t s = 0; s < info.n_sections; s++)
        assert_int_equal(info.sections[s].checksum_ok, s != 3 && s != 5);
    st_file_info_free(&info);

    /* v1: codec fp32, not compressed */
    assert_int_equal(st_file_write(a, path, &(st_file_write_opts){.version = 2}), 0);
    st_image *w = NULL;
    static unsigned char scratch[ST_CODEC_SCRATCH_MIN];
    assert_int_equal(st_image_clone(&w, a), 0);
    for (uint32_t c = 0; c < 3; c++)
        assert_int_equal(st_image_checkpoint_recode(w, c, ST_CODEC_FP32, scratch, sizeof scratch), 0);
    assert_int_equal(st_file_write(w, path, NULL), 0);
    assert_int_equal(st_file_inspect(path, &info), 0);
    assert_true(info.all_ok);
    assert_int_equal(info.version, 1);
    assert_int_equal(info.sections[5].codec, ST_CODEC_FP32);
    assert_int_equal(info.sections[5].compressed, 0);
    assert_int_equal(info.sections[5].position, 7);
    st_file_info_free(&info);

    /* a damaged header: noted, and the walk still shows every section */
    free(b);
    b = st_test_slurp(path, &len);
    b[32] ^= 1; /* state hash: only the header checksum fails */
    assert_int_equal(st_test_spit(path, b, len), 0);
    b[32] ^= 1;
    assert_int_equal(st_file_inspect(path, &info), 0);
    assert_false(info.all_ok);
    assert_int_equal(info.first_error, ST_ECORRUPT);
    assert_non_null(strstr(info.first_error_detail, "header at offset 0: checksum mismatch"));
    assert_int_equal(info.n_sections, 8);
    for (uint32_t s = 0; s < info.n_sections; s++)
        assert_true(info.sections[s].checksum_ok);
    assert_int_equal(info.geometry.n_tensors, 6);
    st_file_info_free(&info);

    /* truncated: the header says so, the walk shows the sections that are whole and stops with
     * an error naming the one that is not */
    assert_int_equal(st_test_spit(path, b, len - 10), 0);
    assert_int_equal(st_file_inspect(path, &info), ST_ECORRUPT);
    assert_false(info.all_ok);
    assert_int_equal(info.version, 1);
    assert_int_equal(info.n_tokens, 11);
    assert_non_null(strstr(info.first_error_detail, "truncated"));
    assert_int_equal(info.n_sections, 7);
    assert_non_null(strstr(st_errdetail(), "LOGITS"));
    st_file_info_free(&info);
    /* fix the header so the walk itself meets the short section */
    put_u64(b + 24, len - 10);
    put_u64(b + 56, st_checksum(b, 56));
    assert_int_equal(st_test_spit(path, b, len - 10), 0);
    assert_int_equal(st_file_inspect(path, &info), ST_ECORRUPT);
    assert_non_null(strstr(info.first_error_detail, "LOGITS"));
    assert_non_null(strstr(info.first_error_detail, "exceeds"));
    assert_int_equal(info.n_sections, 7); /* the ones walked */
    st_file_info_free(&info);

    /* not a Strata file; a version 3 file */
    assert_int_equal(st_test_spit(path, "hello world, this is not it", 27), 0);
    assert_int_equal(st_file_inspect(path, &info), ST_ENOTSTRATA);
    st_file_info_free(&info);
    put_u32(b + 8, 3);
    assert_int_equal(st_test_spit(path, b, len), 0);
    assert_int_equal(st_file_inspect(path, &info), ST_EVERSION);
    assert_int_equal(info.version, 3);
    st_file_info_free(&info);

    assert_string_equal(st_section_type_name(ST_SECTION_KV), "KV");
    assert_string_equal(st_section_type_name(ST_SECTION_CHECKPOINT), "CHECKPOINT");
    assert_string_equal(st_section_type_name(42), "unknown");

    unlink(path);
    free(b);
    st_image_free(w);
    st_image_free(a);
}

/* The reader's allocations stay a small multiple of the file, even for a file built to make many
 * small ones: 4096 one-byte running tensors in each of 64 checkpoints (one allocation per tensor
 * would cost some 16 times the file). Measured with glibc's mallinfo2; a sanitizer build replaces
 * malloc, and there the read only has to succeed. */
/* The ARCH section: written right after GEOMETRY when the image names its architecture, read
 * back into the geometry, shown by inspect; the file is the unnamed one with the section
 * inserted (nothing else changes); misplaced, repeated or malformed sections are refused. */
static void test_arch_section(void **state)
{
    static const uint32_t *const codecs[] = {all_fp32, mixed};
    (void)state;
    for (int k = 0; k < 3; k++) {
        st_image *a = NULL, *n = NULL, *back = NULL;
        st_file_write_opts o = {.compress = k == 2 ? 3 : 0, .shuffle = k == 2};
        if (k < 2)
            assert_int_equal(st_test_image_small(&a, 20 + (uint64_t)k, codecs[k]), 0);
        else
            assert_int_equal(st_test_image_minimal(&a, 22), 0);
        assert_int_equal(st_test_image_named(&n, a, "strata-hybrid"), 0);
        roundtrip(n, &o, k == 0 ? 1 : 2);
        uint8_t *ua, *na;
        size_t ul, nl;
        assert_int_equal(st_file_write_mem(a, &o, &ua, &ul), 0);
        assert_int_equal(st_file_write_mem(n, &o, &na, &nl), 0);
        /* the same bytes but for the section, the header's counts and checksum */
        uint64_t at = section_off(ua, 1);
        assert_int_equal(nl, ul + 64);
        assert_int_equal(get_u32(na + 20), get_u32(ua + 20) + 1);
        assert_int_equal(get_u64(na + 24), nl);
        assert_memory_equal(na + 32, ua + 32, 24);
        assert_memory_equal(na + 64, ua + 64, at - 64);
        assert_int_equal(get_u32(na + at), ST_SECTION_ARCH);
        assert_int_equal(get_u32(na + at + 4), 0);
        assert_int_equal(get_u64(na + at + 8), ST_ARCH_NAME_MAX);
        uint8_t want[ST_ARCH_NAME_MAX] = "strata-hybrid";
        assert_memory_equal(na + at + 32, want, ST_ARCH_NAME_MAX);
        assert_memory_equal(na + at + 64, ua + at, ul - at);
        /* the unnamed image reads back unnamed; the named one named */
        assert_int_equal(st_file_read_mem(ua, ul, NULL, &back), 0);
        assert_string_equal(st_image_geometry(back)->arch, "");
        st_image_free(back);
        assert_int_equal(st_file_read_mem(na, nl, NULL, &back), 0);
        assert_string_equal(st_image_geometry(back)->arch, "strata-hybrid");
        st_image_free(back);
        /* inspect names it, and lists the section */
        char path[1200];
        st_file_info info;
        snprintf(path, sizeof path, "%s/arch.stsf", tmpdir);
        assert_int_equal(st_file_replace(path, na, nl), 0);
        assert_int_equal(st_file_inspect(path, &info), 0);
        assert_true(info.all_ok);
        assert_string_equal(info.geometry.arch, "strata-hybrid");
        assert_int_equal(info.sections[1].type, ST_SECTION_ARCH);
        assert_string_equal(st_section_type_name(info.sections[1].type), "ARCH");
        st_file_info_free(&info);
        unlink(path);
        /* the section twice: the second stands where TOKENS belongs */
        uint8_t *d = malloc(nl + 64);
        assert_non_null(d);
        memcpy(d, na, at + 64);
        memcpy(d + at + 64, na + at, nl - at);
        put_u32(d + 20, get_u32(na + 20) + 1);
        put_u64(d + 24, nl + 64);
        reseal(d, nl + 64);
        assert_int_equal(st_file_read_mem(d, nl + 64, NULL, &back), ST_ECORRUPT);
        assert_non_null(strstr(st_errdetail(), "found ARCH where TOKENS was expected"));
        /* after TOKENS instead of before it */
        uint64_t tl = 32 + get_u64(ua + at + 8); /* the TOKENS section, whole */
        memcpy(d, na, nl);
        memcpy(d + at, na + at + 64, tl);
        memcpy(d + at + tl, na + at, 64);
        reseal(d, nl);
        assert_int_equal(st_file_read_mem(d, nl, NULL, &back), ST_ECORRUPT);
        /* another length, checksums right */
        memcpy(d, na, nl);
        put_u64(d + at + 8, 31);
        reseal(d, nl);
        assert_int_equal(st_file_read_mem(d, nl, NULL, &back), ST_ECORRUPT);
        assert_null(back);
        free(d);
        free(ua);
        free(na);
        st_image_free(a);
        st_image_free(n);
    }
    /* a name outside a-z 0-9 . _ - cannot be in an image */
    st_geometry g;
    st_tensor_desc t[ST_TEST_SMALL_TENSORS];
    st_image *x = NULL;
    st_test_geometry_small(&g, t);
    snprintf(g.arch, sizeof g.arch, "Qwen");
    assert_int_equal(st_image_create(&x, &g), ST_EGEOMETRY);
    memset(g.arch, 'a', sizeof g.arch);
    assert_int_equal(st_image_create(&x, &g), ST_EGEOMETRY);
    assert_null(x);
}

static void test_read_memory_bound(void **state)
{
    enum { NT = ST_GEOMETRY_TENSORS_MAX, NCTX = 64 };
    st_tensor_desc *t = calloc(NT, sizeof *t);
    st_geometry g = {.page_size = 1, .n_ctx = NCTX, .n_tensors = NT};
    st_image *img = NULL, *back = NULL;
    uint32_t tokens[NCTX - 1];
    uint8_t *buf;
    size_t len = 0;
    (void)state;

    assert_non_null(t);
    for (uint32_t i = 0; i < NT; i++) {
        snprintf(t[i].name, sizeof t[i].name, "t%u", i);
        t[i].role = ST_ROLE_RUNNING;
        t[i].dtype = ST_DTYPE_I8;
        t[i].ndim = 1;
        t[i].shape[0] = 1;
    }
    g.tensors = t;
    memset(tokens, 0, sizeof tokens);
    assert_int_equal(st_image_create(&img, &g), 0);
    assert_int_equal(st_image_tokens_set(img, tokens, NCTX - 1), 0);
    for (uint32_t c = 0; c < NCTX; c++)
        assert_int_equal(st_image_checkpoint_add(img, c, ST_CODEC_FP32, NULL), 0);
    assert_int_equal(st_file_write_mem(img, NULL, &buf, &len), 0);

    struct mallinfo2 before = mallinfo2();
    assert_int_equal(st_file_read_mem(buf, len, NULL, &back), 0);
    struct mallinfo2 after = mallinfo2();
#ifndef __SANITIZE_ADDRESS__
    size_t used = (after.uordblks + after.hblkhd) - (before.uordblks + before.hblkhd);
    if (used > 2 * len)
        fail_msg("reading a %zu-byte file holds %zu bytes of heap", len, used);
#else
    (void)before;
    (void)after;
#endif
    assert_int_equal(st_test_image_equal(img, back), 0);
    st_image_free(back);
    st_image_free(img);
    free(buf);
    free(t);
}

static int setup(void **state)
{
    (void)state;
    st_test_tmpdir(tmpdir, sizeof tmpdir, "test_file");
    return 0;
}

static int teardown(void **state)
{
    (void)state;
    st_test_rmdir(tmpdir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_roundtrips),    cmocka_unit_test(test_versions_lossy),
        cmocka_unit_test(test_deterministic), cmocka_unit_test(test_progress),
        cmocka_unit_test(test_large_damage),
        cmocka_unit_test(test_large_damage_order),
        cmocka_unit_test(test_atomic_write),  cmocka_unit_test(test_reader_errors),
        cmocka_unit_test(test_inspect),       cmocka_unit_test(test_large_roundtrips),
        cmocka_unit_test(test_read_memory_bound), cmocka_unit_test(test_arch_section),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
