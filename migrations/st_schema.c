/*
 * st_schema.c - the store's numbered schema steps and the driver that runs them. The steps'
 * bodies, which rewrite LMDB records, live with the store (statestore/st_store_schema.c); this
 * file numbers and names them and drives them through the store's public schema API only
 * (st_store_open_schema, st_store_schema, st_store_schema_step, st_store_schema_backup in
 * st_store.h): it includes no private header of the store and touches no LMDB handle.
 *
 * Invariants:
 * 1. A step never changes meaning: a new layout gets a new step with the next number.
 * 2. (Kept by the steps' bodies in statestore/st_store_schema.c.)
 *    Every step is a sequence of write transactions that each move whole records, and leaves
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


/* ---- the table of steps ------------------------------------------------------------------------- */

/* Each step's body is the store's (st_store_schema_step with its `from`). */
typedef struct st_step_impl {
    st_schema_step info;
} st_step_impl;

static const st_step_impl st_steps[] = {
    {{1, "refcounts-db", "move each chunk's reference count out of its value into the refcounts database"}},
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
    int rc = st_store_open_schema(&st, dir, &o);
    if (rc)
        goto done;
    uint32_t schema = st_store_schema(st);
    r.from = r.to = schema;
    if (schema > ST_STORE_SCHEMA) {
        rc = st_error_set(ST_EVERSION, "store schema %u is newer than this build's %u", schema, ST_STORE_SCHEMA);
        goto done;
    }
    if (schema == ST_STORE_SCHEMA)
        goto done; /* nothing to do */
    for (size_t i = 0; i < ST_N_STEPS; i++)
        if (st_steps[i].info.from >= schema && st_steps[i].info.from < ST_STORE_SCHEMA)
            r.n_steps++;
    if (r.n_steps != ST_STORE_SCHEMA - schema) {
        rc = st_error_set(ST_EVERSION, "store schema %u: this build has no steps from it to %u", schema,
                          ST_STORE_SCHEMA);
        goto done;
    }
    if (dry) {
        for (size_t i = 0; i < ST_N_STEPS && !rc; i++)
            if (st_steps[i].info.from >= schema)
                rc = st_store_schema_step(st, st_steps[i].info.from, 1, &r.items);
        r.to = ST_STORE_SCHEMA;
        goto done;
    }
    if (!(opts && opts->no_backup)) {
        if (opts && opts->backup_dir)
            snprintf(r.backup_dir, sizeof r.backup_dir, "%s", opts->backup_dir);
        else if ((rc = default_backup_dir(dir, schema, r.backup_dir, sizeof r.backup_dir)))
            goto done;
        if (o.progress)
            o.progress(o.progress_arg, "backup", 0, 1);
        if ((rc = st_store_schema_backup(st, r.backup_dir))) {
            r.backup_dir[0] = '\0';
            goto done;
        }
        if (o.progress)
            o.progress(o.progress_arg, "backup", 1, 1);
    }
    for (size_t i = 0; i < ST_N_STEPS && !rc; i++) {
        if (st_steps[i].info.from != schema)
            continue;
        rc = st_store_schema_step(st, schema, 0, &r.items);
        if (rc) {
            char d[512];
            snprintf(d, sizeof d, "%s", st_errdetail());
            rc = st_error_set(rc, "migrate: step %u -> %u (%s) stopped: %s%s", schema, schema + 1,
                              st_steps[i].info.name, d, resume_hint);
            break;
        }
        schema = st_store_schema(st);
        r.to = schema;
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
