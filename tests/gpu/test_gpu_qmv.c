/*
 * test_gpu_qmv.c - the GPU's quantized matrix-vector products (engine/st_qmv_cuda.cu) against
 * the CPU's dequantization (st_wtype.h) for Q8_0, Q4_K and Q6_K: seeded weights quantized on the
 * CPU, y = W x on the GPU against the double-precision sum over the CPU's dequantized rows, for
 * shapes from one block to 1,000 x 4,096 and a row count that is not a multiple of the rows per
 * warp; the same bits on a second run. Controls: one changed byte of row 0's weights moves row 0
 * out of the tolerance (and only row 0); a type without a kernel and a column count that is not
 * a multiple of the block are refused. Label gpu: without a device it FAILS, it never skips.
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
        qg[type == ST_GGML_Q8_0 ? 2 : type == ST_GGML_Q4_K ? 16 : 0] ^= 0x77;
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
    static const uint32_t types[] = {ST_GGML_Q8_0, ST_GGML_Q4_K, ST_GGML_Q6_K};
    static const uint32_t shapes[][2] = {{1, 256}, {7, 512}, {33, 1024}, {1000, 4096}, {5, 2816}};
    for (size_t ti = 0; ti < 3; ti++)
        for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
            uint32_t b0;
            uint32_t bad = check(types[ti], shapes[si][0], shapes[si][1], 0, &b0);
            if (bad)
                fail_msg("type %u, %u x %u: %u rows differ from the CPU's", types[ti], shapes[si][0],
                         shapes[si][1], bad);
        }
}

static void test_controls(void **state)
{
    (void)state;
    static const uint32_t types[] = {ST_GGML_Q8_0, ST_GGML_Q4_K, ST_GGML_Q6_K};
    for (size_t ti = 0; ti < 3; ti++) {
        uint32_t b0;
        uint32_t bad = check(types[ti], 9, 1024, 1, &b0);
        if (!b0 || bad != 1)
            fail_msg("control, type %u: a changed byte of row 0 gave %u rows out of tolerance "
                     "(row 0 %s)", types[ti], bad, b0 ? "among them" : "not among them");
    }
    void *d;
    CU_OK(cudaMalloc(&d, 4096));
    assert_int_equal(st_cuda_qmv(ST_GGML_IQ4_XS, d, 1, 256, d, d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv_supported(ST_GGML_IQ4_XS), 0);
    assert_int_equal(st_cuda_qmv(ST_GGML_Q4_K, d, 1, 100, d, d, NULL), ST_EINVAL);
    assert_int_equal(st_cuda_qmv(ST_GGML_Q8_0, d, 1, 32, (const float *)((char *)d + 4), d, NULL), ST_EINVAL);
    CU_OK(cudaFree(d));
}

/* The integer form (Q8_0 weights, activations quantized by the CPU's integer path) against the
 * CPU's integer path on the same bytes: the block dots are exact integers on both sides, only
 * the order of the scaled sums differs. Control: one changed weight byte moves its row. */
static uint32_t check_i8(uint32_t rows, uint32_t cols, int corrupt, uint32_t *bad_row0)
{
    const st_wtype *t = st_wtype_get(ST_GGML_Q8_0);
    const st_qdot *qd = st_qdot_get(ST_GGML_Q8_0);
    assert_non_null(qd);
    uint64_t rb = (uint64_t)cols / 32 * t->bytes, xs = (uint64_t)cols / qd->block * qd->act_bytes;
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
    if (st_cuda_qmv_i8(ST_GGML_Q8_0, qdv, rows, cols, xd, yd, NULL))
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
    printf("q8_0 int8 %5u x %5u%s: max |gpu - cpu integer path| / sum |w x| %.2e, %u rows out of "
           "tolerance\n", rows, cols, corrupt ? " (row 0 changed)" : "", worst, bad);
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
        uint32_t b0, bad = check_i8(shapes[si][0], shapes[si][1], 0, &b0);
        if (bad)
            fail_msg("q8_0 int8, %u x %u: %u rows differ from the CPU's integer path", shapes[si][0],
                     shapes[si][1], bad);
    }
    uint32_t b0, bad = check_i8(9, 1024, 1, &b0);
    if (!b0 || bad != 1)
        fail_msg("control: a changed byte of row 0 gave %u rows out of tolerance", bad);
    assert_int_equal(st_cuda_qmv_i8(ST_GGML_Q4_K, (void *)16, 1, 256, (void *)16, (float *)16, NULL), ST_EINVAL);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_agree),
        cmocka_unit_test(test_controls),
        cmocka_unit_test(test_integer),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
