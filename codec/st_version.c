/*
 * st_version.c - the library's version at run time (st_codec.h): the numbers of the generated
 * st_version.h this library was built with, so that a program can compare them with the headers
 * it was compiled against.
 */
#include "st_codec.h"

const char *st_version(void) { return ST_VERSION_STRING; }

unsigned st_version_number(void) { return ST_VERSION_NUMBER; }
