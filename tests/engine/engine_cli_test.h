/*
 * engine_cli_test.h - helpers for the tests that drive the real `strata` and `statectl` binaries
 * (test_engine_cli on the CPU, test_gpu_engine_cli on the GPU): a scratch directory, a shell
 * command expected to succeed or to fail, and reading a file of the scratch directory.
 * Include once per test program: it defines the program's g_dir and out buffers.
 */
#ifndef ENGINE_CLI_TEST_H
#define ENGINE_CLI_TEST_H

#include <stdarg.h>
#include <stdio.h>

#include "engine_test.h"

#define BIN ST_BIN_DIR

static char g_dir[4096];
static char out[65536];

/* Run a shell command (fmt...) with stdout+stderr in out; fail the test if it does not exit 0
 * (expect_ok) or if it does (!expect_ok). */
static void sh(int expect_ok, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sh(int expect_ok, const char *fmt, ...)
{
    char cmd[8192];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cmd, sizeof cmd, fmt, ap);
    va_end(ap);
    int rc = st_test_run(out, sizeof out, "( %s )", cmd);
    if (expect_ok && rc != 0)
        fail_msg("command failed (%d): %s\n%s", rc, cmd, out);
    if (!expect_ok && rc == 0)
        fail_msg("command succeeded but should not have: %s\n%s", cmd, out);
}

/* The bytes of g_dir/name (malloc'd); fails the test when it cannot be read. */
static unsigned char *slurp(const char *name, size_t *len)
{
    char p[4300];
    snprintf(p, sizeof p, "%s/%s", g_dir, name);
    unsigned char *b = st_test_slurp(p, len);
    if (!b)
        fail_msg("cannot read %s", p);
    return b;
}

#endif
