/*
 * test_gpu_qmv.c - the GPU's matrix-vector products (engine/st_qmv_cuda.cu) against the CPU's
 * dequantization (st_wtype.h) for all 15 weight types: seeded weights quantized on the CPU,
 * y = W x on the GPU against the double-precision sum over the CPU's dequantized rows, for
 * shapes from one block to 1,000 x 4,096, a row count that is not a multiple of the rows per
 * CTA, and for F32 / F16 / BF16 rows that are not whole 16-byte words (the decoder-driven
 * kernel instead of the wide one); the same bits on a second run. Several products in one launch
 * (st_cuda_qmv_n) give each product the bits it has alone. Controls: one changed byte of row 0's
 * weights moves row 0 out of the tolerance (and only row 0), for every type; an unknown type, a
 * column count that is not a multiple of the block, a misaligned operand and too many products
 * are refused. Label gpu: without a device it FAILS, it never skips.
 */
#include <math.h>
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


static float rnd(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return (float)((double)(*s % 2000001) / 1000000.0 - 1.0);
}

/* The offset of a quant (not scale) byte in a block of each type: F32's exponent, F16's and
 * BF16's high byte, the first byte of the quantized types' levels. */
static uint32_t quant_byte(uint32_t type)
{
    switch (type) {
    case ST_GGML_F32: return 3;
    case ST_GGML_F16: case ST_GGML_BF16: return 1;
    case ST_GGML_Q4_0: case ST_GGML_Q8_0: case ST_GGML_IQ4_NL: return 2;
    case ST_GGML_Q4_1: return 4;
    case ST_GGML_Q5_0: return 6;
    case ST_GGML_Q5_1: case ST_GGML_IQ4_XS: return 8;
    case ST_GGML_Q2_K: case ST_GGML_Q4_K: return 16;
    case ST_GGML_Q3_K: return 32;
    case ST_GGML_Q5_K: return 48;
    default: return 0; /* Q6_K: low nibbles first */
    }
}

static const uint32_t k_types[] = {
    ST_GGML_F32,  ST_GGML_F16,  ST_GGML_BF16, ST_GGML_Q4_0, ST_GGML_Q4_1,
    ST_GGML_Q5_0, ST_GGML_Q5_1, ST_GGML_Q8_0, ST_GGML_Q2_K, ST_GGML_Q3_K,
    ST_GGML_Q4_K, ST_GGML_Q5_K, ST_GGML_Q6_K, ST_GGML_IQ4_NL, ST_GGML_IQ4_XS,
};
#define N_TYPES (sizeof k_types / sizeof k_types[0])

/* rows of row 0 .. rows-1 that exceed the tolerance (bit r of the returned count's list) */
static uint32_t check(uint32_t type, uint32_t rows, uint32_t cols, int corrupt, uint32_t *bad_row0)
{
    const st_wtype *t = st_wtype_get(type);
    assert_non_null(t);
    uint64_t rb = (uint64_t)cols / t->block * t->bytes, s = 0x1234567ull + rows * 31 + cols + type;
    float *w = malloc((size_t)rows * cols * 4), *x = malloc((size_t)cols * 4), *deq = malloc((size_t)cols * 4);
    uint8_t *q = malloc((size_t)(rows * rb));
    float *y = malloc((size_t)rows * 4), *y2 = malloc((size_t)rows * 4);
    assert_true(w && x && deq && q && y && y2);
    for (uint64_t i = 0; i < (uint64_t)rows * cols; i++)
        w[i] = rnd(&s) * (1.0f + (float)(i % 7));
    for (uint32_t i = 0; i < cols; i++)
        x[i] = rnd(&s);
    for (uint32_t r = 0; r < rows; r++)
        t->quantize(w + (uint64_t)r * cols, q + r * rb, cols);
    void *qd, *xd, *yd;
    CU_OK(cudaMalloc(&qd, rows * rb));
    CU_OK(cudaMalloc(&xd, (size_t)cols * 4));
    CU_OK(cudaMalloc(&yd, (size_t)rows * 4));
    uint8_t *qg = malloc((size_t)(rows * rb));
    assert_non_null(qg);
    memcpy(qg, q, rows * rb);
    if (corrupt) /* a quant byte of row 0's first block (not a scale: the value must move) */
        qg[quant_byte(type)] ^= 0x77;
    CU_OK(cudaMemcpy(qd, qg, rows * rb, cudaMemcpyHostToDevice));
    CU_OK(cudaMemcpy(xd, x, (size_t)cols * 4, cudaMemcpyHostToDevice));
    if (st_cuda_qmv(type, qd, rows, cols, xd, yd, NULL))
        fail_msg("st_cuda_qmv: %s", st_errdetail());
    CU_OK(cudaMemcpy(y, yd, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    assert_int_equal(st_cuda_qmv(type, qd, rows, cols, xd, yd, NULL), 0);
    CU_OK(cudaMemcpy(y2, yd, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    assert_int_equal(memcmp(y, y2, (size_t)rows * 4), 0); /* the same bits again */
    uint32_t bad = 0;
    double worst = 0;
    *bad_row0 = 0;
    for (uint32_t r = 0; r < rows; r++) {
        t->dequant[0](q + r * rb, deq, cols);
        double ref = 0, mag = 0;
        for (uint32_t k = 0; k < cols; k++) {
            ref += (double)deq[k] * x[k];
            mag += fabs((double)deq[k] * x[k]);
        }
        double err = fabs((double)y[r] - ref), tol = 1e-5 * mag + 1e-6;
        if (err / (mag + 1e-30) > worst)
            worst = err / (mag + 1e-30);
        if (err > tol) {
            bad++;
            if (r == 0)
                *bad_row0 = 1;
        }
    }
    printf("%-5s %5u x %5u%s: max |gpu - cpu| / sum |w x| %.2e, %u rows out of tolerance\n", t->name,
           rows, cols, corrupt ? " (row 0 changed)" : "", worst, bad);
    CU_OK(cudaFree(qd));
    CU_OK(cudaFree(xd));
    CU_OK(cudaFree(yd));
    free(w), free(x), free(deq), free(q), free(qg), free(y), free(y2);
    return bad;
}

static void test_agree(void **state)
{
    (void)state;
    static const uint32_t shapes[][2] = {{1, 256}, {7, 512}, {33, 1024}, {1000, 4096}, {5, 2816}};
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        assert_int_equal(st_cuda_qmv_supported(k_types[ti]), 1);
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            uint32_t b0;
            uint32_t bad = check(k_types[ti], shapes[si][0], shapes[si][1], 0, &b0);
            if (bad)
                fail_msg("type %u, %u x %u: %u rows differ from the CPU's", k_types[ti],
                         shapes[si][0], shapes[si][1], bad);
        }
        if (st_wtype_get(k_types[ti])->block == 1) { /* rows not of whole 16-byte words */
            uint32_t b0, bad = check(k_types[ti], 3, 38, 0, &b0);
            if (bad)
                fail_msg("type %u, 3 x 38: %u rows differ from the CPU's", k_types[ti], bad);
        }
    }
}

/* Several products of one type over one x in one launch: each product's rows have the bits it
 * has alone, whatever launches beside it. */
static void test_multi(void **state)
{
    (void)state;
    static const uint32_t rows[] = {3, 64, 1, 129, 16, 250};
    const uint32_t n = sizeof rows / sizeof rows[0], cols = 1024;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        const st_wtype *t = st_wtype_get(k_types[ti]);
        uint64_t rb = (uint64_t)cols / t->block * t->bytes, s = 99 + ti, total = 0;
        for (uint32_t j = 0; j < n; j++)
            total += rows[j];
        float *w = malloc((size_t)total * cols * 4), *x = malloc((size_t)cols * 4);
        uint8_t *q = malloc((size_t)(total * rb + 16 * n));
        float *ya = malloc((size_t)total * 4), *yb = malloc((size_t)total * 4);
        assert_true(w && x && q && ya && yb);
        for (uint64_t i = 0; i < total * cols; i++)
            w[i] = rnd(&s);
        for (uint32_t i = 0; i < cols; i++)
            x[i] = rnd(&s);
        /* each product's rows at a 16-byte aligned offset of one allocation */
        uint64_t off[8], at = 0, r = 0;
        for (uint32_t j = 0; j < n; j++) {
            off[j] = at;
            for (uint32_t k = 0; k < rows[j]; k++, r++)
                t->quantize(w + r * cols, q + at + k * rb, cols);
            at = (at + rows[j] * rb + 15) / 16 * 16;
        }
        void *qd, *xd, *yd;
        CU_OK(cudaMalloc(&qd, at));
        CU_OK(cudaMalloc(&xd, (size_t)cols * 4));
        CU_OK(cudaMalloc(&yd, (size_t)total * 4));
        CU_OK(cudaMemcpy(qd, q, at, cudaMemcpyHostToDevice));
        CU_OK(cudaMemcpy(xd, x, (size_t)cols * 4, cudaMemcpyHostToDevice));
        st_cuda_qmv_job jobs[8];
        uint64_t yo = 0;
        for (uint32_t j = 0; j < n; j++) {
            jobs[j] = (st_cuda_qmv_job){(uint8_t *)qd + off[j], (float *)yd + yo, rows[j]};
            ST_OK(st_cuda_qmv(t->type, jobs[j].w, rows[j], cols, xd, jobs[j].y, NULL));
            yo += rows[j];
        }
        CU_OK(cudaMemcpy(ya, yd, (size_t)total * 4, cudaMemcpyDeviceToHost));
        CU_OK(cudaMemset(yd, 0, (size_t)total * 4));
        ST_OK(st_cuda_qmv_n(t->type, cols, jobs, n, xd, NULL));
        CU_OK(cudaMemcpy(yb, yd, (size_t)total * 4, cudaMemcpyDeviceToHost));
        if (memcmp(ya, yb, (size_t)total * 4))
            fail_msg("%s: %u products in one launch differ from the same products alone", t->name, n);
        printf("%-6s %u products in one launch: the bits of each alone\n", t->name, n);
        CU_OK(cudaFree(qd));
        CU_OK(cudaFree(xd));
        CU_OK(cudaFree(yd));
        free(w), free(x), free(q), free(ya), free(yb);
    }
}

static void test_controls(void **state)
{
    (void)state;
    for (size_t ti = 0; ti < N_TYPES; ti++) {
        uint32_t b0, cols = st_wtype_get(k_types[ti])->block == 1 ? 64 : 1024;
        uint32_t bad = check(k_types[ti], 9, cols, 1, &b0);
        if (!b0 || bad != 1)
            fail_msg("control, type %u: a changed byte of row 0 gave %u rows out of tolerance "
                     "(row 0 %s)", k_types[ti], bad, b0 ? "among them" : "not among them");
    }
    void *d;
    CU_OK(cudaMalloc(&d, 4096));
    assert_int_equal(st_cuda_qmv(24 /* ggml I8: no kernel */, d, 1, 256, d, d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv_supported(24 /* ggml I8: no kernel */), 0);
    assert_int_equal(st_cuda_qmv(ST_GGML_Q4_K, d, 1, 100, d, d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv(ST_GGML_Q8_0, d, 1, 32, (const float *)((char *)d + 4), d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv(ST_GGML_Q5_0, (char *)d + 2, 1, 32, d, d, NULL), ST_EINVAL);
    st_cuda_qmv_job jobs[ST_CUDA_QMV_JOBS + 1];
    for (uint32_t j = 0; j <= ST_CUDA_QMV_JOBS; j++)
        jobs[j] = (st_cuda_qmv_job){d, d, 1};
    assert_int_equal(st_cuda_qmv_n(ST_GGML_Q8_0, 32, jobs, ST_CUDA_QMV_JOBS + 1, d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv_n(ST_GGML_Q8_0, 32, jobs, 0, d, NULL), ST_EINVAL);
    jobs[3].rows = 0;
    assert_int_equal(st_cuda_qmv_n(ST_GGML_Q8_0, 32, jobs, 4, d, NULL), ST_EINVAL);
    CU_OK(cudaFree(d));
}

/* The integer form (Q8_0 weights, activations quantized by the CPU's integer path) against the
 * CPU's integer path on the same bytes: the block dots are exact integers on both sides, only
 * the order of the scaled sums differs. Control: one changed weight byte moves its row. */
static uint32_t check_i8(uint32_t wt, uint32_t rows, uint32_t cols, int corrupt, uint32_t *bad_row0)
{
    const st_wtype *t = st_wtype_get(wt);
    const st_qdot *qd = st_qdot_get(wt);
    assert_non_null(qd);
    uint64_t rb = (uint64_t)cols / t->block * t->bytes, xs = (uint64_t)cols / qd->block * qd->act_bytes;
    uint64_t s = 0xabcdefull + rows * 7 + cols;
    float *w = malloc((size_t)rows * cols * 4), *x = malloc((size_t)cols * 4), *deq = malloc((size_t)cols * 4);
    uint8_t *q = malloc((size_t)(rows * rb)), *xq = malloc((size_t)xs);
    float *y = malloc((size_t)rows * 4), *yref = malloc((size_t)rows * 4);
    assert_true(w && x && deq && q && xq && y && yref);
    for (uint64_t i = 0; i < (uint64_t)rows * cols; i++)
        w[i] = rnd(&s) * (1.0f + (float)(i % 5));
    for (uint32_t i = 0; i < cols; i++)
        x[i] = rnd(&s);
    for (uint32_t r = 0; r < rows; r++)
        t->quantize(w + (uint64_t)r * cols, q + r * rb, cols);
    qd->quantize(x, xq, cols);
    qd->mm[0](q, rb, xq, xs, cols / qd->block, yref, rows, rows, 1);
    if (corrupt)
        q[2] ^= 0x77;
    void *qdv, *xd, *yd;
    CU_OK(cudaMalloc(&qdv, rows * rb));
    CU_OK(cudaMalloc(&xd, xs));
    CU_OK(cudaMalloc(&yd, (size_t)rows * 4));
    CU_OK(cudaMemcpy(qdv, q, rows * rb, cudaMemcpyHostToDevice));
    CU_OK(cudaMemcpy(xd, xq, xs, cudaMemcpyHostToDevice));
    if (wt == ST_GGML_Q4_K) { /* the GPU's quantization: the CPU's bytes, exactly */
        float *xdev;
        uint8_t *back = malloc((size_t)xs);
        assert_non_null(back);
        CU_OK(cudaMalloc((void **)&xdev, (size_t)cols * 4));
        CU_OK(cudaMemcpy(xdev, x, (size_t)cols * 4, cudaMemcpyHostToDevice));
        CU_OK(cudaMemset(xd, 0xA5, xs));
        if (st_cuda_quant_q8_k(xdev, cols, xd, NULL))
            fail_msg("st_cuda_quant_q8_k: %s", st_errdetail());
        CU_OK(cudaMemcpy(back, xd, xs, cudaMemcpyDeviceToHost));
        if (memcmp(back, xq, (size_t)xs)) {
            uint64_t i = 0;
            while (back[i] == xq[i])
                i++;
            fail_msg("q8_k quantization, %u values: byte %llu is %u on the GPU, %u on the CPU",
                     cols, (unsigned long long)i, back[i], xq[i]);
        }
        CU_OK(cudaFree(xdev));
        free(back);
    }
    if (st_cuda_qmv_i8(wt, qdv, rows, cols, xd, yd, NULL))
        fail_msg("st_cuda_qmv_i8: %s", st_errdetail());
    CU_OK(cudaMemcpy(y, yd, (size_t)rows * 4, cudaMemcpyDeviceToHost));
    uint32_t bad = 0;
    double worst = 0;
    *bad_row0 = 0;
    for (uint32_t r = 0; r < rows; r++) {
        t->dequant[0](q + r * rb, deq, cols);
        double mag = 0;
        for (uint32_t k = 0; k < cols; k++)
            mag += fabs((double)deq[k] * x[k]);
        double err = fabs((double)y[r] - yref[r]);
        if (err / (mag + 1e-30) > worst)
            worst = err / (mag + 1e-30);
        if (err > 1e-5 * mag + 1e-6) {
            bad++;
            if (r == 0)
                *bad_row0 = 1;
        }
    }
    printf("%s int8 %5u x %5u%s: max |gpu - cpu integer path| / sum |w x| %.2e, %u rows out of "
           "tolerance\n", t->name, rows, cols, corrupt ? " (row 0 changed)" : "", worst, bad);
    CU_OK(cudaFree(qdv));
    CU_OK(cudaFree(xd));
    CU_OK(cudaFree(yd));
    free(w), free(x), free(deq), free(q), free(xq), free(y), free(yref);
    return bad;
}

static void test_integer(void **state)
{
    (void)state;
    static const uint32_t shapes[][2] = {{1, 32}, {7, 512}, {33, 1024}, {1000, 4096}, {5, 2816}};
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
        uint32_t b0, bad = check_i8(ST_GGML_Q8_0, shapes[si][0], shapes[si][1], 0, &b0);
        if (bad)
            fail_msg("q8_0 int8, %u x %u: %u rows differ from the CPU's integer path", shapes[si][0],
                     shapes[si][1], bad);
    }
    uint32_t b0, bad = check_i8(ST_GGML_Q8_0, 9, 1024, 1, &b0);
    if (!b0 || bad != 1)
        fail_msg("control: a changed byte of row 0 gave %u rows out of tolerance", bad);
    /* Q4_K on Q8_K activations (the forward pass's form with STRATA_CUDA_QMV_I8=1) */
    static const uint32_t k4[][2] = {{1, 256}, {7, 512}, {33, 1024}, {1000, 4096}, {5, 2816},
                                     {3, 8192}};
    for (size_t si = 0; si < sizeof k4 / sizeof k4[0]; si++) {
        bad = check_i8(ST_GGML_Q4_K, k4[si][0], k4[si][1], 0, &b0);
        if (bad)
            fail_msg("q4_k int8, %u x %u: %u rows differ from the CPU's integer path", k4[si][0],
                     k4[si][1], bad);
    }
    bad = check_i8(ST_GGML_Q4_K, 9, 1024, 1, &b0);
    if (!b0 || bad != 1)
        fail_msg("control (q4_k): a changed byte of row 0 gave %u rows out of tolerance", bad);
    assert_int_equal(st_cuda_qmv_i8(ST_GGML_Q6_K, (void *)16, 1, 256, (void *)16, (float *)16, NULL), ST_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_multi),
        cmocka_unit_test(test_controls),
        cmocka_unit_test(test_integer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
