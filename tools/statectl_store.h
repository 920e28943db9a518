/*
 * statectl_store.h - the store verbs of statectl (ls, show, import, export, rm, gc, check, stat,
 * backup, restore-backup, migrate), kept apart from the file verbs in statectl.c.
 */
#ifndef STATECTL_STORE_H
#define STATECTL_STORE_H

#include <stdio.h>

/* 1 if verb is a store verb. */
int statectl_store_is_verb(const char *verb);
/* Run a store verb: argv[0] is the verb. Returns the process exit status (see statectl --help). */
int statectl_store_main(int argc, char **argv);
/* Print the store verbs' lines of the top-level help to f. */
void statectl_store_usage_to(FILE *f);

#endif
