/*
 * st_schema.c - the store's numbered schema steps and the driver that runs them.
 *
 * Invariants:
 * 1. A step never changes meaning: a new layout gets a new step with the next number.
 * 2. Every step is a sequence of write transactions that each move whole records, and leaves
 *    the schema number to its last transaction; the meta key "migrating" is set by its first.
 *    A store interrupted anywhere is therefore either untouched, or marked and resumable: each
 *    step recognises the records it already moved.
 * 3. The backup (unless declined) is complete and verified before the first step writes.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "st_migrate.h"
#include "st_store_lmdb_int.h"


/* ---- the table of steps ------------------------------------------------------------------------- */

typedef struct st_step_impl {
    st_schema_step info;
    int (*run)(st_store *st, uint64_t *items);
    int (*count)(st_store *st, uint64_t *items);
} st_step_impl;

static const st_step_impl st_steps[] = {
    {{1, "refcounts-db", "move each chunk's reference count out of its value into the refcounts database"},
     step12_run, step12_count},
};
#define ST_N_STEPS (sizeof st_steps / sizeof st_steps[0])

const st_schema_step *st_schema_steps(size_t *n)
{
    static st_schema_step info[ST_N_STEPS];
    for (size_t i = 0; i < ST_N_STEPS; i++)
        info[i] = st_steps[i].info;
    *n = ST_N_STEPS;
    return info;
}

/* ---- the driver ------------------------------------------------------------------------------ */

static int default_backup_dir(const char *dir, uint32_t schema, char *dst, size_t cap)
{
    size_t n = strlen(dir);
    while (n > 1 && dir[n - 1] == '/')
        n--;
    for (int i = 1; i < 1000; i++) {
        int w = i == 1 ? snprintf(dst, cap, "%.*s.schema%u-backup", (int)n, dir, schema)
                       : snprintf(dst, cap, "%.*s.schema%u-backup-%d", (int)n, dir, schema, i);
        if (w < 0 || (size_t)w >= cap)
            return st_error_set(ST_EINVAL, "migrate: path too long: %s", dir);
        struct stat sb;
        if (stat(dst, &sb) != 0 && errno == ENOENT)
            return 0;
    }
    return st_error_set(ST_EINVAL, "migrate: no free name for a backup next to %s", dir);
}


/* st_schema_migrate; resume_hint ends the detail of a step that stopped. */
static int migrate_dir(const char *dir, const st_schema_migrate_opts *opts, st_schema_migrate_report *rep,
                       const char *resume_hint)
{
    st_schema_migrate_report r;
    st_store *st = NULL;
    memset(&r, 0, sizeof r);
    st_store_opts o = {0};
    int dry = opts && opts->dry_run;
    if (opts) {
        o.sys = opts->sys;
        o.progress = opts->progress;
        o.progress_arg = opts->progress_arg;
    }
    o.read_only = dry;
    int rc = st_store__open_any(&st, dir, &o, 0);
    if (rc)
        goto done;
    r.from = r.to = st->schema;
    if (st->schema > ST_STORE_SCHEMA) {
        rc = st_error_set(ST_EVERSION, "store schema %u is newer than this build's %u", st->schema, ST_STORE_SCHEMA);
        goto done;
    }
    if (st->schema == ST_STORE_SCHEMA)
        goto done; /* nothing to do */
    for (size_t i = 0; i < ST_N_STEPS; i++)
        if (st_steps[i].info.from >= st->schema && st_steps[i].info.from < ST_STORE_SCHEMA)
            r.n_steps++;
    if (r.n_steps != ST_STORE_SCHEMA - st->schema) {
        rc = st_error_set(ST_EVERSION, "store schema %u: this build has no steps from it to %u", st->schema,
                          ST_STORE_SCHEMA);
        goto done;
    }
    if (dry) {
        for (size_t i = 0; i < ST_N_STEPS && !rc; i++)
            if (st_steps[i].info.from >= st->schema)
                rc = st_steps[i].count(st, &r.items);
        r.to = ST_STORE_SCHEMA;
        goto done;
    }
    if (!(opts && opts->no_backup)) {
        if (opts && opts->backup_dir)
            snprintf(r.backup_dir, sizeof r.backup_dir, "%s", opts->backup_dir);
        else if ((rc = default_backup_dir(dir, st->schema, r.backup_dir, sizeof r.backup_dir)))
            goto done;
        st_store__progress(st, "backup", 0, 1);
        if ((rc = backup_old(st, r.backup_dir))) {
            r.backup_dir[0] = '\0';
            goto done;
        }
        st_store__progress(st, "backup", 1, 1);
    }
    for (size_t i = 0; i < ST_N_STEPS && !rc; i++) {
        if (st_steps[i].info.from != st->schema)
            continue;
        rc = st_steps[i].run(st, &r.items);
        if (rc) {
            char d[512];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(rc, "migrate: step %u -> %u (%s) stopped: %s%s", st->schema, st->schema + 1,
                              st_steps[i].info.name, d, resume_hint);
            break;
        }
        st->schema++;
        r.to = st->schema;
    }
done:
    st_store_close(st);
    if (rep)
        *rep = r;
    return rc;
}

int st_schema_migrate(const char *dir, const st_schema_migrate_opts *opts, st_schema_migrate_report *rep)
{
    return migrate_dir(dir, opts, rep, "; run `statectl migrate` again to resume");
}

/* ---- restoring an older backup ------------------------------------------------------------------ */

typedef struct st_restore_upgrade {
    const st_store_opts *opts;
    int ran;
    st_schema_migrate_report rep;
} st_restore_upgrade;

/* The copy in dir is a temporary directory of st_store_restore_backup_upgrade: the backup it
 * came from is never written and is the old-schema copy, so no second backup is taken, and a
 * step that stops is not resumed there (the copy is removed; the destination is untouched). */
static int restore_upgrade(void *arg, const char *dir, uint32_t schema)
{
    st_restore_upgrade *u = arg;
    st_schema_migrate_opts o = {.no_backup = 1};
    if (u->opts) {
        o.sys = u->opts->sys;
        o.progress = u->opts->progress;
        o.progress_arg = u->opts->progress_arg;
    }
    u->ran = 1;
    int rc = migrate_dir(dir, &o, &u->rep, "");
    if (!rc && (u->rep.from != schema || u->rep.to != ST_STORE_SCHEMA))
        rc = st_error_set(ST_EVERSION, "the copy went from schema %u to %u, not from %u to %u", u->rep.from,
                          u->rep.to, schema, ST_STORE_SCHEMA);
    return rc;
}

int st_schema_restore_backup(const char *backup_dir, const char *dest_dir, const st_store_opts *opts,
                             st_schema_migrate_report *rep)
{
    st_restore_upgrade u;
    memset(&u, 0, sizeof u);
    u.opts = opts;
    int rc = st_store_restore_backup_upgrade(backup_dir, dest_dir, opts, restore_upgrade, &u);
    if (!u.ran && !rc)
        u.rep.from = u.rep.to = ST_STORE_SCHEMA;
    if (rep)
        *rep = u.rep;
    return rc;
}
