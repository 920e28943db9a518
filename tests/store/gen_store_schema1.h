/* gen_store_schema1.h - the generator of the golden schema-1 store (see gen_store_schema1.c). */
#ifndef GEN_STORE_SCHEMA1_H
#define GEN_STORE_SCHEMA1_H

/* Write golden_dir/data.mdb (a schema-1 store) and golden_dir/EXPECTED, working in scratch. */
int gen_store_schema1(const char *golden_dir, const char *scratch);

#endif
