/*
 * test_gpu_dequant.c - rows widened to f32 on the GPU (engine/st_dequant_cuda.cu) against the
 * CPU's scalar dequantization (st_wtype_get(type)->dequant[0]), bit for bit, for every type of
 * st_wtype_table. The weights are seeded random bytes, every bit pattern of the levels and
 * sub-block scales (and for F32, F16 and BF16 of the values, NaNs included); only the f16 block
 * scales are made finite and nonzero, since the GPU's NaN arithmetic is its own. Rows of 2, 3 and
 * 300 blocks (the last wider than a CTA), row strides with and without padding, an output stride
 * with padding that must stay untouched; the rows taken consecutively from 0 and from 1 and through
 * a shuffled device index list with a repeat. Control: one byte of one row changed on the device
 * only makes exactly that row's outputs differ from the CPU's (and match the CPU's on the changed
 * bytes). Refusals: type 99, columns not a multiple of the block, short rows, a short output
 * stride, NULL operands. Label gpu: without a device it FAILS, it never skips.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <cuda_runtime.h>

#include "gpu_test.h"
#include "st_engine_int.h"
#include "st_wtype.h"

static uint32_t rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (uint32_t)(*s >> 16);
}

/* The byte offsets of the f16 scales in a block of `type` (none for the float types). */
static uint32_t f16_fields(uint32_t type, uint32_t off[2])
{
    switch (type) {
    case ST_GGML_Q4_1:
    case ST_GGML_Q5_1:
    case ST_GGML_Q4_K:
    case ST_GGML_Q5_K:
        off[0] = 0, off[1] = 2;
        return 2;
    case ST_GGML_Q2_K:
        off[0] = 80, off[1] = 82;
        return 2;
    case ST_GGML_Q3_K:
        off[0] = 108;
        return 1;
    case ST_GGML_Q6_K:
        off[0] = 208;
        return 1;
    case ST_GGML_Q4_0:
    case ST_GGML_Q5_0:
    case ST_GGML_Q8_0:
    case ST_GGML_IQ4_NL:
    case ST_GGML_IQ4_XS:
        off[0] = 0;
        return 1;
    default:
        return 0;
    }
}

/* rows rows of row_bytes random bytes, the f16 scales of every block made finite and nonzero. */
static void fill(const st_wtype *t, uint8_t *w, uint32_t rows, uint64_t rb, uint64_t nb, uint64_t *s)
{
    uint32_t off[2], nf = f16_fields(t->type, off);
    for (uint64_t i = 0; i < rows * rb; i++)
        w[i] = (uint8_t)rnd(s);
    for (uint32_t r = 0; r < rows; r++)
        for (uint64_t b = 0; b < nb; b++)
            for (uint32_t f = 0; f < nf; f++) {
                uint8_t *p = w + r * rb + b * t->bytes + off[f];
                uint16_t h = (uint16_t)(p[0] | p[1] << 8);
                if ((h & 0x7c00u) == 0x7c00u)
                    h &= 0xbfffu; /* exponent 31 -> 15 */
                if (!(h & 0x7fffu))
                    h |= 0x3c00u;
                p[0] = (uint8_t)h;
                p[1] = (uint8_t)(h >> 8);
            }
}

/* The CPU's rows src[0..n) of w into n rows of ldd floats, the padding left 0xff bytes. */
static float *cpu_rows(const st_wtype *t, const uint8_t *w, uint64_t rb, uint32_t cols, const uint32_t *src,
                       uint32_t n, uint64_t ldd)
{
    float *out = malloc((size_t)(n * ldd * 4));
    assert_non_null(out);
    memset(out, 0xff, (size_t)(n * ldd * 4));
    for (uint32_t i = 0; i < n; i++)
        t->dequant[0](w + src[i] * rb, out + i * ldd, cols);
    return out;
}

/* The GPU's rows (rows_d NULL: r0 ..) into n rows of ldd floats, the output first all 0xff. */
static float *gpu_rows(const st_wtype *t, const void *wd, uint64_t rb, uint32_t cols, const uint32_t *rows_d,
                       uint32_t r0, uint32_t n, uint64_t ldd)
{
    float *out = malloc((size_t)(n * ldd * 4)), *dd;
    assert_non_null(out);
    CU_OK(cudaMalloc((void **)&dd, (size_t)(n * ldd * 4)));
    CU_OK(cudaMemset(dd, 0xff, (size_t)(n * ldd * 4)));
    if (st_cuda_dequant_rows(t->type, wd, rb, cols, rows_d, r0, n, dd, ldd, NULL))
        fail_msg("st_cuda_dequant_rows %s: %s", t->name, st_errdetail());
    CU_OK(cudaDeviceSynchronize());
    CU_OK(cudaMemcpy(out, dd, (size_t)(n * ldd * 4), cudaMemcpyDeviceToHost));
    CU_OK(cudaFree(dd));
    return out;
}

/* How many of the n output rows differ anywhere (padding included); differs[i] says which. The
 * first difference is printed under the label what (none: NULL). */
static uint32_t diff_rows(const char *what, const float *want, const float *got, uint32_t n, uint64_t ldd,
                          uint8_t *differs)
{
    uint32_t bad = 0;
    for (uint32_t i = 0; i < n; i++) {
        differs[i] = memcmp(want + i * ldd, got + i * ldd, (size_t)(ldd * 4)) != 0;
        if (differs[i] && !bad++ && what) {
            uint64_t c = 0;
            uint32_t a, b;
            while (!memcmp(want + i * ldd + c, got + i * ldd + c, 4))
                c++;
            memcpy(&a, want + i * ldd + c, 4);
            memcpy(&b, got + i * ldd + c, 4);
            printf("%s: output row %u, column %llu: cpu 0x%08x (%g), gpu 0x%08x (%g)\n", what, i,
                   (unsigned long long)c, a, (double)want[i * ldd + c], b, (double)got[i * ldd + c]);
        }
    }
    return bad;
}

/* One type and shape: rows rows of nblk blocks (float types: nblk * 37 values), row_bytes padded
 * by pad bytes. */
static void check(const st_wtype *t, uint32_t rows, uint32_t nblk, uint32_t pad)
{
    uint32_t cols = t->block == 1 ? nblk * 37 : nblk * t->block;
    uint64_t nb = cols / t->block, rb = nb * t->bytes + pad, ldd = (uint64_t)cols + 5;
    uint64_t s = 0x9e3779b97f4a7c15ull ^ ((uint64_t)t->type << 32 | (uint64_t)rows << 16 | nblk);
    uint32_t n_idx = rows + 1, nmax = rows + 1, ctl = 1; /* ctl: the row the control changes */
    uint8_t *w = malloc((size_t)(rows * rb)), *wc = malloc((size_t)(rows * rb)), *differs = malloc(nmax);
    uint32_t *seq = malloc(nmax * 4), *idx = malloc(nmax * 4), *idx_d;
    void *wd;
    assert_true(w && wc && differs && seq && idx);
    fill(t, w, rows, rb, nb, &s);
    for (uint32_t i = 0; i < rows; i++)
        seq[i] = idx[i] = i;
    for (uint32_t i = rows - 1; i > 0; i--) {
        uint32_t j = rnd(&s) % (i + 1), x = idx[i];
        idx[i] = idx[j], idx[j] = x;
    }
    idx[rows] = idx[0];
    CU_OK(cudaMalloc(&wd, (size_t)(rows * rb)));
    CU_OK(cudaMalloc((void **)&idx_d, n_idx * 4));
    CU_OK(cudaMemcpy(wd, w, (size_t)(rows * rb), cudaMemcpyHostToDevice));
    CU_OK(cudaMemcpy(idx_d, idx, n_idx * 4, cudaMemcpyHostToDevice));
    char what[96];

    /* The three ways of naming rows, against the CPU. */
    struct { const char *name; const uint32_t *src, *rows_d; uint32_t r0, n; } v[3] = {
        {"rows 0..", seq, NULL, 0, rows},
        {"rows 1..", seq + 1, NULL, 1, rows - 1},
        {"index list", idx, idx_d, 0, n_idx},
    };
    for (int k = 0; k < 3; k++) {
        float *want = cpu_rows(t, w, rb, cols, v[k].src, v[k].n, ldd);
        float *got = gpu_rows(t, wd, rb, cols, v[k].rows_d, v[k].r0, v[k].n, ldd);
        snprintf(what, sizeof what, "%s %u x %u, %s", t->name, rows, cols, v[k].name);
        uint32_t bad = diff_rows(what, want, got, v[k].n, ldd, differs);
        if (bad)
            fail_msg("%s: %u of %u rows differ from the CPU's", what, bad, v[k].n);
        free(want), free(got);
    }

    /* Control: the low byte of the first f16 scale of row ctl's first block (of its first value
     * for the float types) changed on the device only. */
    uint32_t off[2];
    uint64_t at = ctl * rb + (f16_fields(t->type, off) ? off[0] : 0);
    memcpy(wc, w, (size_t)(rows * rb));
    wc[at] ^= 0x01;
    CU_OK(cudaMemcpy((uint8_t *)wd + at, wc + at, 1, cudaMemcpyHostToDevice));
    float *a = cpu_rows(t, w, rb, cols, &ctl, 1, ldd), *b = cpu_rows(t, wc, rb, cols, &ctl, 1, ldd);
    if (!memcmp(a, b, (size_t)(ldd * 4)))
        fail_msg("%s: the control's changed byte does not change row %u on the CPU", t->name, ctl);
    free(a), free(b);
    for (int k = 0; k < 3; k += 2) {
        float *want = cpu_rows(t, w, rb, cols, v[k].src, v[k].n, ldd);
        float *want_c = cpu_rows(t, wc, rb, cols, v[k].src, v[k].n, ldd);
        float *got = gpu_rows(t, wd, rb, cols, v[k].rows_d, v[k].r0, v[k].n, ldd);
        snprintf(what, sizeof what, "%s %u x %u, %s, row %u changed", t->name, rows, cols, v[k].name, ctl);
        uint32_t bad = diff_rows(what, want_c, got, v[k].n, ldd, differs);
        if (bad)
            fail_msg("%s: %u rows differ from the CPU's on the changed bytes", what, bad);
        diff_rows(NULL, want, got, v[k].n, ldd, differs);
        for (uint32_t i = 0; i < v[k].n; i++)
            if (differs[i] != (v[k].src[i] == ctl))
                fail_msg("%s: output row %u (row %u) %s the CPU's on the unchanged bytes", what, i,
                         v[k].src[i], differs[i] ? "differs from" : "still equals");
        free(want), free(want_c), free(got);
    }
    printf("%-6s %u x %6u (row bytes %llu): bit for bit; the changed row %u caught\n", t->name, rows,
           cols, (unsigned long long)rb, ctl);
    CU_OK(cudaFree(wd));
    CU_OK(cudaFree(idx_d));
    free(w), free(wc), free(differs), free(seq), free(idx);
}

static void test_every_type(void **state)
{
    (void)state;
    static const uint32_t shapes[][3] = {{5, 3, 0}, {4, 2, 3}, {3, 300, 1}}; /* rows, blocks, pad */
    uint32_t nt;
    const st_wtype *const *tab = st_wtype_table(&nt);
    for (uint32_t i = 0; i < nt; i++) {
        if (!st_cuda_dequant_supported(tab[i]->type))
            fail_msg("%s: st_cuda_dequant_supported says no", tab[i]->name);
        for (size_t k = 0; k < sizeof shapes / sizeof shapes[0]; k++)
            check(tab[i], shapes[k][0], shapes[k][1], shapes[k][2]);
    }
}

static void test_refusals(void **state)
{
    (void)state;
    void *d;
    float *f;
    CU_OK(cudaMalloc(&d, 4096));
    f = (float *)d;
    assert_int_equal(st_cuda_dequant_supported(99), 0);
    assert_int_equal(st_cuda_dequant_rows(99, d, 64, 32, NULL, 0, 1, f, 32, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q4_K, d, 144, 100, NULL, 0, 1, f, 100, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, d, 34, 0, NULL, 0, 1, f, 32, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, d, 33, 32, NULL, 0, 1, f, 32, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, d, 34, 32, NULL, 0, 2, f, 31, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, NULL, 34, 32, NULL, 0, 1, f, 32, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, d, 34, 32, NULL, 0, 1, NULL, 32, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_dequant_rows(ST_GGML_Q8_0, NULL, 34, 32, NULL, 0, 0, NULL, 32, NULL), 0);
    CU_OK(cudaFree(d));
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_every_type),
        cmocka_unit_test(test_refusals),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
