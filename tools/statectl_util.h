/*
 * statectl_util.h - what the file verbs (statectl.c) and the store verbs (statectl_store.c) of
 * statectl share: exit statuses, the verb named in messages, error and usage messages, --help.
 */
#ifndef STATECTL_UTIL_H
#define STATECTL_UTIL_H

#define EXIT_PROBLEM 1 /* a verification found a problem, or diff's inputs differ */
#define EXIT_USAGE 2
#define EXIT_ERROR 3

/* The verb being run, as messages name it ("statectl" before one is chosen). */
extern const char *statectl_verb;

/* "statectl VERB: <error>: <detail>" on stderr, from st_errdetail(); returns EXIT_ERROR. */
int statectl_fail(int rc);
/* "statectl VERB: " fmt (with arg) and a pointer to --help on stderr; returns EXIT_USAGE. */
int statectl_usage(const char *fmt, const char *arg);
/* 1 if an argument after argv[0] is --help or -h. */
int statectl_wants_help(int argc, char **argv);

#endif
