/*
 * statectl_util.c - helpers shared by statectl's file verbs and store verbs (statectl_util.h).
 */
#include <stdio.h>
#include <string.h>

#include "st_codec.h"
#include "statectl_util.h"

const char *statectl_verb = "statectl";

int statectl_fail(int rc)
{
    const char *d = st_errdetail();
    fprintf(stderr, "statectl %s: %s%s%s\n", statectl_verb, st_strerror(rc), *d ? ": " : "", d);
    return EXIT_ERROR;
}

int statectl_usage(const char *fmt, const char *arg)
{
    fprintf(stderr, "statectl %s: ", statectl_verb);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(see `statectl %s --help`)\n", statectl_verb);
    return EXIT_USAGE;
}

int statectl_wants_help(int argc, char **argv)
{
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h"))
            return 1;
    return 0;
}
