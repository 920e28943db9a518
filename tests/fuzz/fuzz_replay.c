/*
 * fuzz_replay.c - runs every file of one fuzz target's corpus (tests/fuzz/corpus/<target>/, the
 * directory ST_FUZZ_CORPUS names) through the target's entry point, in the normal and the
 * sanitizer build. New crashers found by `make fuzz` belong in the corpus once fixed.
 */
#include <dirent.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "st_test_util.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void test_replay_corpus(void **state)
{
    const char *dir = ST_FUZZ_CORPUS;
    DIR *d = opendir(dir);
    struct dirent *e;
    int n = 0;
    (void)state;

    if (!d)
        fail_msg("corpus %s is missing", dir);
    while ((e = readdir(d)) != NULL) {
        char path[4096];
        struct stat st;
        unsigned char *buf;
        size_t len = 0;
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode))
            continue;
        buf = st_test_slurp(path, &len);
        if (!buf)
            fail_msg("cannot read %s", path);
        print_message("replay %s (%zu bytes)\n", e->d_name, len);
        LLVMFuzzerTestOneInput(buf, len);
        free(buf);
        n++;
    }
    closedir(d);
    assert_true(n >= 3); /* a corpus of seeds, not an empty or lost directory */
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_replay_corpus),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
