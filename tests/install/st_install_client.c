/*
 * st_install_client.c - the program test_install.sh builds against an installed Strata (its
 * headers and `pkg-config strata`), once linked with libstrata.so and once with libstrata.a.
 *
 * It includes every public header (st_install_all.h, which the test writes with one #include
 * for each header in the installed include directory), checks that the library it runs with is the version its headers name, and
 * calls into the codec, the store (LMDB), the engine and the server's configuration, so that a
 * static link needs what strata.pc's Requires.private and Libs.private give.
 * Exit 0 and "ok VERSION" on stdout; 1 with a line on stderr otherwise.
 */
#include <stdio.h>
#include <string.h>

#include "st_install_all.h"

int main(int argc, char **argv)
{
    if (argc != 2) {
        fprintf(stderr, "usage: st_install_client STORE_DIR\n");
        return 1;
    }
    if (strcmp(st_version(), ST_VERSION_STRING) || st_version_number() != ST_VERSION_NUMBER) {
        fprintf(stderr, "library %s, headers %s\n", st_version(), ST_VERSION_STRING);
        return 1;
    }
    /* XXH3-64 of "" (seed 0), xxhash's published value */
    if (st_checksum("", 0) != 0x2d06800538d394c2ull) {
        fprintf(stderr, "st_checksum(\"\") = %016llx\n", (unsigned long long)st_checksum("", 0));
        return 1;
    }
    if (strcmp(st_strerror(ST_ECORRUPT), "corrupt data")) {
        fprintf(stderr, "st_strerror(ST_ECORRUPT) = %s\n", st_strerror(ST_ECORRUPT));
        return 1;
    }
    st_store_opts so;
    memset(&so, 0, sizeof so);
    so.create = 1;
    st_store *st = NULL;
    int rc = st_store_open(&st, argv[1], &so);
    if (rc) {
        fprintf(stderr, "st_store_open %s: %s: %s\n", argv[1], st_strerror(rc), st_errdetail());
        return 1;
    }
    st_store_close(st);
    st_engine_opts eo;
    st_engine_opts_default(&eo);
    st_api_config ac;
    st_api_config_default(&ac);
    printf("ok %s\n", st_version());
    return 0;
}
