/*
 * test_engine_gguf.c - the GGUF reader and writer: a round trip of every value type, and
 * truncated, hostile and randomly damaged files, which must give typed errors and never read
 * outside the buffer (this test also runs under ASan + UBSan); the writer's file replacement
 * under failures injected through common's file-system call table.
 */
#include <dirent.h>
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "engine_test.h"

/* ---- a byte builder for hand-made files ------------------------------------------------ */
typedef struct bb {
    uint8_t *p;
    size_t n, cap;
} bb;

static void bb_put(bb *b, const void *s, size_t n)
{
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        assert_non_null(b->p);
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
}
static void bb_u32(bb *b, uint32_t v) { bb_put(b, &v, 4); }
static void bb_u64(bb *b, uint64_t v) { bb_put(b, &v, 8); }
static void bb_str(bb *b, const char *s)
{
    bb_u64(b, strlen(s));
    bb_put(b, s, strlen(s));
}
static void bb_pad(bb *b, size_t a)
{
    static const uint8_t z[64];
    while (b->n % a)
        bb_put(b, z, 1);
}

/* Open a private copy of exactly len bytes, so ASan sees any read past the end. */
static int open_copy(const uint8_t *p, size_t len, st_gguf **g)
{
    uint8_t *c = malloc(len ? len : 1);
    assert_non_null(c);
    memcpy(c, p, len);
    int rc = st_gguf_open_mem(c, len, g);
    if (rc == 0) {
        /* every tensor lies inside the buffer */
        for (uint64_t i = 0; i < st_gguf_n_tensors(*g); i++) {
            const st_gguf_tensor *t = st_gguf_tensor_at(*g, i);
            assert_true((const uint8_t *)t->data >= c);
            assert_true((const uint8_t *)t->data + t->nbytes <= c + len);
        }
        st_gguf_close(*g);
        *g = NULL;
    }
    free(c);
    return rc;
}

/* A well-formed file: 2 KVs (u32, string array), 2 tensors (f32 [4,2], f16 [8]). Field
 * offsets are recorded for the hostile variants. */
typedef struct spec {
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    uint64_t str_len_override; /* 0: real */
    uint32_t kv_type;          /* type of the first key */
    uint64_t arr_count;        /* element count of the string array (real: 2) */
    uint32_t align_type;       /* type of general.alignment (u32) */
    uint32_t align;            /* its value */
    uint32_t t0_ndims;
    uint64_t t0_dim0;
    uint32_t t0_type;
    uint64_t t1_offset;
    int dup_key;
    int dup_tensor;
    size_t data_pad; /* extra data bytes */
} spec;

static void spec_default(spec *s)
{
    memset(s, 0, sizeof *s);
    s->magic = 0x46554747u;
    s->version = 3;
    s->n_tensors = 2;
    s->n_kv = 3;
    s->kv_type = ST_GGUF_UINT32;
    s->arr_count = 2;
    s->align_type = ST_GGUF_UINT32;
    s->align = 32;
    s->t0_ndims = 2;
    s->t0_dim0 = 4;
    s->t0_type = ST_GGML_F32;
    s->t1_offset = 32;
}

static void build(const spec *s, bb *b)
{
    memset(b, 0, sizeof *b);
    bb_u32(b, s->magic);
    bb_u32(b, s->version);
    bb_u64(b, s->n_tensors);
    bb_u64(b, s->n_kv);
    /* kv 0 */
    if (s->str_len_override) {
        bb_u64(b, s->str_len_override);
        bb_put(b, "test.value", 10);
    } else {
        bb_str(b, "test.value");
    }
    bb_u32(b, s->kv_type);
    bb_u32(b, 7);
    /* kv 1: array of 2 strings */
    bb_str(b, s->dup_key ? "test.value" : "test.names");
    bb_u32(b, ST_GGUF_ARRAY);
    bb_u32(b, ST_GGUF_STRING);
    bb_u64(b, s->arr_count);
    bb_str(b, "alpha");
    bb_str(b, "beta");
    /* kv 2 */
    bb_str(b, "general.alignment");
    bb_u32(b, s->align_type);
    bb_u32(b, s->align);
    /* tensors */
    bb_str(b, "t0");
    bb_u32(b, s->t0_ndims);
    bb_u64(b, s->t0_dim0);
    bb_u64(b, 2);
    for (uint32_t d = 2; d < s->t0_ndims && d < 8; d++)
        bb_u64(b, 1);
    bb_u32(b, s->t0_type);
    bb_u64(b, 0);
    bb_str(b, s->dup_tensor ? "t0" : "t1");
    bb_u32(b, 1);
    bb_u64(b, 8);
    bb_u32(b, ST_GGML_F16);
    bb_u64(b, s->t1_offset);
    uint32_t a = s->align && !(s->align & (s->align - 1)) && s->align <= 64 ? s->align : 32;
    bb_pad(b, a);
    float f[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    bb_put(b, f, 32);
    uint16_t h[8] = {0x3c00, 0x4000, 0, 0, 0, 0, 0, 0x3c00};
    bb_put(b, h, 16);
    for (size_t i = 0; i < s->data_pad; i++)
        bb_put(b, "", 1);
}

static int try_spec(const spec *s)
{
    bb b;
    build(s, &b);
    st_gguf *g = NULL;
    int rc = open_copy(b.p, b.n, &g);
    free(b.p);
    return rc;
}

static void test_handmade_ok(void **state)
{
    spec s;
    spec_default(&s);
    bb b;
    build(&s, &b);
    st_gguf *g = NULL;
    assert_int_equal(st_gguf_open_mem(b.p, b.n, &g), 0);
    assert_int_equal(st_gguf_version(g), 3);
    assert_int_equal(st_gguf_alignment(g), 32);
    uint32_t v = 0;
    assert_int_equal(st_gguf_get_u32(g, "test.value", &v), 0);
    assert_int_equal(v, 7);
    uint32_t et = 0;
    uint64_t cnt = 0;
    int64_t i = st_gguf_find(g, "test.names");
    assert_true(i >= 0);
    assert_int_equal(st_gguf_kv_type(g, (uint64_t)i, &et, &cnt), ST_GGUF_ARRAY);
    assert_int_equal(et, ST_GGUF_STRING);
    assert_int_equal(cnt, 2);
    const char *str;
    uint64_t len;
    assert_int_equal(st_gguf_get_str(g, "test.names", &str, &len), ST_ECORRUPT);
    assert_int_equal(st_gguf_get_u32(g, "nope", &v), ST_ENOTFOUND);
    const st_gguf_tensor *t1 = st_gguf_tensor_find(g, "t1");
    assert_non_null(t1);
    assert_int_equal(t1->nbytes, 16);
    assert_int_equal(((const uint16_t *)t1->data)[0], 0x3c00);
    st_gguf_close(g);
    free(b.p);
}

static void test_hostile(void **state)
{
    spec s;
#define EXPECT(field_stmt, code)                                                                \
    do {                                                                                        \
        spec_default(&s);                                                                       \
        field_stmt;                                                                             \
        int rc_ = try_spec(&s);                                                                 \
        if (rc_ != (code))                                                                      \
            fail_msg("%s: got %d (%s), expected %d", #field_stmt, rc_, st_errdetail(), code);   \
        assert_true(strlen(st_errdetail()) > 0);                                                \
    } while (0)
    EXPECT(s.magic = 0x12345678u, ST_ENOTSTRATA);
    EXPECT(s.version = 1, ST_EVERSION);
    EXPECT(s.version = 0x03000000u, ST_EVERSION);
    EXPECT(s.version = 4, ST_EVERSION);
    EXPECT(s.n_kv = UINT64_MAX, ST_ECORRUPT);
    EXPECT(s.n_kv = 1ull << 40, ST_ECORRUPT);
    EXPECT(s.n_tensors = UINT64_MAX / 2, ST_ECORRUPT);
    EXPECT(s.n_tensors = 3, ST_ECORRUPT);
    EXPECT(s.str_len_override = UINT64_MAX, ST_ECORRUPT);
    EXPECT(s.str_len_override = 1ull << 33, ST_ECORRUPT);
    EXPECT(s.kv_type = 13, ST_ECORRUPT);
    EXPECT(s.kv_type = 0xffffffffu, ST_ECORRUPT);
    EXPECT(s.arr_count = UINT64_MAX, ST_ECORRUPT);
    EXPECT(s.arr_count = 1000, ST_ECORRUPT);
    EXPECT(s.align_type = ST_GGUF_UINT64, ST_ECORRUPT);
    EXPECT(s.align = 0, ST_ECORRUPT);
    EXPECT(s.align = 48, ST_ECORRUPT);
    EXPECT(s.t0_ndims = 0, ST_ECORRUPT);
    EXPECT(s.t0_ndims = 5, ST_ECORRUPT);
    EXPECT(s.t0_dim0 = 0, ST_ECORRUPT);
    EXPECT(s.t0_dim0 = 1ull << 62, ST_ECORRUPT);
    EXPECT(s.t0_dim0 = 1000, ST_ECORRUPT);  /* data beyond the file */
    EXPECT(s.t0_type = 4, ST_ECORRUPT);     /* removed ggml type */
    EXPECT(s.t0_type = 999, ST_ECORRUPT);
    EXPECT(s.t0_type = 2, ST_ECORRUPT);     /* q4_0: ne0 4 is not a multiple of 32 */
    EXPECT(s.t1_offset = 16, ST_ECORRUPT);  /* misaligned */
    EXPECT(s.t1_offset = 0, ST_ECORRUPT);   /* overlaps t0 */
    EXPECT(s.t1_offset = UINT64_MAX - 31, ST_ECORRUPT);
    EXPECT(s.t1_offset = 64, ST_ECORRUPT);  /* past the end */
    EXPECT(s.dup_key = 1, ST_ECORRUPT);
    EXPECT(s.dup_tensor = 1, ST_ECORRUPT);
    /* a larger alignment is honoured */
    spec_default(&s);
    s.align = 64;
    s.t1_offset = 64;
    s.data_pad = 64;
    assert_int_equal(try_spec(&s), 0);
#undef EXPECT
}

static void test_nested_arrays(void **state)
{
    /* an array of arrays of u8, nested deeper than the limit */
    bb b = {0};
    bb_u32(&b, 0x46554747u);
    bb_u32(&b, 3);
    bb_u64(&b, 0);
    bb_u64(&b, 1);
    bb_str(&b, "deep");
    bb_u32(&b, ST_GGUF_ARRAY);
    for (int i = 0; i < 6; i++) {
        bb_u32(&b, ST_GGUF_ARRAY);
        bb_u64(&b, 1);
    }
    bb_u32(&b, ST_GGUF_UINT8);
    bb_u64(&b, 1);
    bb_put(&b, "x", 1);
    st_gguf *g = NULL;
    assert_int_equal(open_copy(b.p, b.n, &g), ST_ECORRUPT);
    free(b.p);
}

static void test_writer_roundtrip(void **state)
{
    char dir[4096], path[4200];
    st_test_tmpdir(dir, sizeof dir, "gguf_rt");
    snprintf(path, sizeof path, "%s/rt.gguf", dir);
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_writer_new(&w, 64), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", "test"), 0);
    assert_int_equal(st_gguf_writer_set_u32(w, "a.u32", 42), 0);
    assert_int_equal(st_gguf_writer_set_u64(w, "a.u64", 1ull << 40), 0);
    assert_int_equal(st_gguf_writer_set_f32(w, "a.f32", 0.5f), 0);
    assert_int_equal(st_gguf_writer_set_bool(w, "a.bool", 1), 0);
    int32_t arr[3] = {-1, 2, 3};
    assert_int_equal(st_gguf_writer_set_arr(w, "a.arr", ST_GGUF_INT32, arr, 3), 0);
    assert_int_equal(st_gguf_writer_set_u32(w, "a.u32", 1), ST_EINVAL); /* duplicate */
    assert_int_equal(st_gguf_writer_set_u32(w, "b", 1), ST_EINVAL);     /* failed writer stays so */
    st_gguf_writer_free(w);

    assert_int_equal(st_gguf_writer_new(&w, 64), 0);
    assert_int_equal(st_gguf_writer_set_u32(w, "a.u32", 42), 0);
    assert_int_equal(st_gguf_writer_set_u64(w, "a.u64", 1ull << 40), 0);
    assert_int_equal(st_gguf_writer_set_f32(w, "a.f32", 0.5f), 0);
    float f[15];
    for (int i = 0; i < 15; i++)
        f[i] = (float)i;
    uint16_t h[6] = {1, 2, 3, 4, 5, 6};
    uint64_t d0[2] = {5, 3}, d1[3] = {2, 1, 3};
    assert_int_equal(st_gguf_writer_add_tensor(w, "x", ST_GGML_F32, 2, d0, f), 0);
    assert_int_equal(st_gguf_writer_add_tensor(w, "y", ST_GGML_F16, 3, d1, h), 0);
    assert_int_equal(st_gguf_writer_write(w, path), 0);
    st_gguf_writer_free(w);

    st_gguf *g = NULL;
    assert_int_equal(st_gguf_open(path, &g), 0);
    assert_int_equal(st_gguf_alignment(g), 64);
    uint32_t u = 0;
    uint64_t u64 = 0;
    float fv = 0;
    assert_int_equal(st_gguf_get_u32(g, "a.u32", &u), 0);
    assert_int_equal(u, 42);
    assert_int_equal(st_gguf_get_u64(g, "a.u64", &u64), 0);
    assert_int_equal(u64, 1ull << 40);
    assert_int_equal(st_gguf_get_u32(g, "a.u64", &u), ST_ECORRUPT); /* out of range */
    assert_int_equal(st_gguf_get_f32(g, "a.f32", &fv), 0);
    assert_true(fv == 0.5f);
    const st_gguf_tensor *x = st_gguf_tensor_find(g, "x"), *y = st_gguf_tensor_find(g, "y");
    assert_non_null(x);
    assert_non_null(y);
    assert_int_equal(x->offset % 64, 0);
    assert_int_equal(y->offset % 64, 0);
    assert_memory_equal(x->data, f, sizeof f);
    assert_memory_equal(y->data, h, sizeof h);
    assert_int_equal(y->n_dims, 3);
    assert_int_equal(y->dims[2], 3);
    st_gguf_close(g);
    st_test_rmdir(dir);
}

/* ---- the writer under injected failures ----------------------------------------------------- */
static int fault_calls, fault_at;
static ssize_t fault_write(int fd, const void *b, size_t n)
{
    if (++fault_calls == fault_at) {
        errno = ENOSPC;
        return -1;
    }
    return st_sys_real.write(fd, b, n);
}
static int fault_fsync(int fd)
{
    if (++fault_calls == fault_at) {
        errno = EIO;
        return -1;
    }
    return st_sys_real.fsync(fd);
}
static int fault_rename(const char *a, const char *b)
{
    if (++fault_calls == fault_at) {
        errno = EXDEV;
        return -1;
    }
    return st_sys_real.rename(a, b);
}

static char fault_detail[512];
static int write_small(const char *path)
{
    st_gguf_writer *w = NULL;
    static float f[4096];
    uint64_t d0[1] = {4096};
    assert_int_equal(st_gguf_writer_new(&w, 64), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", "test"), 0);
    assert_int_equal(st_gguf_writer_add_tensor(w, "x", ST_GGML_F32, 1, d0, f), 0);
    int rc = st_gguf_writer_write(w, path);
    snprintf(fault_detail, sizeof fault_detail, "%s", st_errdetail());
    if (rc) /* a failed writer stays failed */
        assert_int_equal(st_gguf_writer_write(w, path), rc);
    st_gguf_writer_free(w);
    return rc;
}

/* A failing write, fsync or rename leaves the old file and no temp file; the directory's fsync,
 * after the rename, is checked too: its failure is reported with the new file in place. */
static void test_writer_faults(void **state)
{
    char dir[4096], path[4200];
    st_test_tmpdir(dir, sizeof dir, "gguf_faults");
    snprintf(path, sizeof path, "%s/m.gguf", dir);
    for (int which = 0; which < 3; which++) {
        int failures = 0;
        for (fault_at = 1;; fault_at++) {
            assert_int_equal(st_test_spit(path, "OLD", 3), 0);
            fault_calls = 0;
            if (which == 0)
                st_sys_calls.write = fault_write;
            else if (which == 1)
                st_sys_calls.fsync = fault_fsync;
            else
                st_sys_calls.rename = fault_rename;
            int rc = write_small(path);
            st_sys_reset();
            size_t len = 0;
            uint8_t *b = st_test_slurp(path, &len);
            assert_non_null(b);
            assert_int_equal(st_test_count_entries(dir), 1); /* never a temp file behind */
            if (rc == 0) {
                assert_true(len > 4096 * 4);
                free(b);
                break;
            }
            failures++;
            assert_true(rc > 0);
            assert_non_null(strstr(fault_detail, "gguf writer"));
            assert_non_null(strstr(fault_detail, path));
            if (which == 1 && fault_at == 2) {
                /* the directory's fsync failed: reported, the new file already in place */
                assert_non_null(strstr(fault_detail, "fsync of directory"));
                assert_true(len > 4096 * 4);
            } else {
                assert_int_equal(len, 3);
                assert_memory_equal(b, "OLD", 3);
            }
            free(b);
        }
        assert_true(failures >= (which == 1 ? 2 : 1)); /* each injected call was reached */
    }
    st_test_rmdir(dir);
}

/* Every prefix of a real model file is refused; a random damage never crashes. */
static void test_truncated_and_damaged(void **state)
{
    char dir[4096], path[4200];
    st_test_tmpdir(dir, sizeof dir, "gguf_trunc");
    et_model(path, sizeof path, dir, "tiny.gguf", 1, NULL);
    size_t len = 0;
    uint8_t *buf = st_test_slurp(path, &len);
    assert_non_null(buf);
    st_gguf *g = NULL;
    assert_int_equal(open_copy(buf, len, &g), 0);
    /* the header region: every prefix; then the data: a stride */
    assert_int_equal(st_gguf_open_mem(buf, len, &g), 0);
    const st_gguf_tensor *first = st_gguf_tensor_at(g, 0);
    size_t data_off = (size_t)((const uint8_t *)first->data - buf);
    st_gguf_close(g);
    for (size_t n = 0; n < len; n += n < data_off + 64 ? 1 : 4099) {
        int rc = open_copy(buf, n, &g);
        if (rc == 0)
            fail_msg("prefix of %zu of %zu bytes was accepted", n, len);
        assert_true(rc == ST_ECORRUPT || rc == ST_ENOTSTRATA);
    }
    assert_int_equal(open_copy(buf, len - 1, &g), ST_ECORRUPT);
    /* random damage in the header: flip 1..4 bytes */
    uint64_t rng = 12345;
    uint8_t *c = malloc(len);
    assert_non_null(c);
    memcpy(c, buf, len);
    for (int it = 0; it < 2000; it++) {
        int flips = 1 + it % 4;
        size_t at[4];
        uint8_t old[4];
        for (int k = 0; k < flips; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            at[k] = (size_t)((rng >> 33) % data_off);
            old[k] = c[at[k]];
            c[at[k]] ^= (uint8_t)(1u << ((rng >> 20) & 7));
        }
        int rc = st_gguf_open_mem(c, len, &g);
        assert_true(rc == 0 || rc == ST_ECORRUPT || rc == ST_ENOTSTRATA || rc == ST_EVERSION);
        if (rc == 0) {
            for (uint64_t i = 0; i < st_gguf_n_tensors(g); i++) {
                const st_gguf_tensor *t = st_gguf_tensor_at(g, i);
                assert_true((const uint8_t *)t->data >= c);
                assert_true((const uint8_t *)t->data + t->nbytes <= c + len);
            }
            st_gguf_close(g);
        }
        for (int k = flips - 1; k >= 0; k--)
            c[at[k]] = old[k];
    }
    free(c);
    free(buf);
    st_test_rmdir(dir);
}

static void test_model_refusals(void **state)
{
    char dir[4096], path[4200];
    st_test_tmpdir(dir, sizeof dir, "gguf_model");
    st_model *m = NULL;
    /* another architecture */
    snprintf(path, sizeof path, "%s/llama.gguf", dir);
    st_gguf_writer *w = NULL;
    assert_int_equal(st_gguf_writer_new(&w, 0), 0);
    assert_int_equal(st_gguf_writer_set_str(w, "general.architecture", "llama"), 0);
    assert_int_equal(st_gguf_writer_write(w, path), 0);
    st_gguf_writer_free(w);
    assert_int_equal(st_model_load(path, &m), ST_EINVAL);
    assert_non_null(strstr(st_errdetail(), "llama"));
    assert_null(m);
    /* a truncated model */
    char tiny[4200];
    et_model(tiny, sizeof tiny, dir, "tiny.gguf", 1, NULL);
    size_t len = 0;
    uint8_t *buf = st_test_slurp(tiny, &len);
    assert_non_null(buf);
    snprintf(path, sizeof path, "%s/cut.gguf", dir);
    assert_int_equal(st_test_spit(path, buf, len / 2), 0);
    assert_int_equal(st_model_load(path, &m), ST_ECORRUPT);
    assert_non_null(strstr(st_errdetail(), "cut.gguf"));
    /* not a GGUF file at all */
    assert_int_equal(st_test_spit(path, "hello, world", 12), 0);
    assert_int_equal(st_model_load(path, &m), ST_ENOTSTRATA);
    assert_int_equal(st_model_load("/nonexistent/x.gguf", &m), ENOENT);
    free(buf);
    st_test_rmdir(dir);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_handmade_ok),
        cmocka_unit_test(test_hostile),
        cmocka_unit_test(test_nested_arrays),
        cmocka_unit_test(test_writer_roundtrip),
        cmocka_unit_test(test_writer_faults),
        cmocka_unit_test(test_truncated_and_damaged),
        cmocka_unit_test(test_model_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
