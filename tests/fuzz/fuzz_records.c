/*
 * fuzz_records.c - libFuzzer target for the store's records as they come out of LMDB: the
 * session record (st_session_parse), the geometry record (st_geometry_decode), the manifest
 * (st_manifest_parse) and the versions key (st_vkey_parse). The first input byte picks the
 * record, the rest is its bytes. A manifest's trailer checksum is set over the bytes before it
 * is parsed, so that the fuzzer reaches the checks behind it (a wrong checksum is tested in
 * tests/store).
 *
 * Properties checked on every input:
 * 1. A refused record ends in a typed error with a detail.
 * 2. An accepted record is canonical: encoded again it is the input, byte for byte (a reader
 *    that accepted two spellings of one record would let damage pass as data).
 */
#include <errno.h>
#include <string.h>

#include "st_fuzz.h"
#include "st_store_lmdb_int.h"

static void refused(int rc)
{
    st_fuzz_require(st_fuzz_typed(rc), "an untyped error");
    st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
}

static void session(const uint8_t *p, size_t n)
{
    st_session_rec r;
    uint8_t back[ST_SESSION_REC_MAX];
    int rc = st_session_parse(p, n, "fuzz", &r);
    if (rc) {
        refused(rc);
        return;
    }
    st_fuzz_require(r.n_labels <= ST_STORE_LABELS_MAX, "too many labels");
    size_t len = st_session_encode(&r, back);
    st_fuzz_require(len == n && memcmp(back, p, n) == 0, "a session record is not canonical");
}

static void geometry(const uint8_t *p, size_t n)
{
    st_geometry g;
    st_tensor_desc *t = NULL;
    uint8_t *back = NULL;
    size_t len = 0;
    int rc = st_geometry_decode(p, n, &g, &t);
    if (rc) {
        st_fuzz_require(t == NULL, "tensors after an error");
        refused(rc);
        return;
    }
    st_fuzz_require(st_geometry_encode(&g, &back, &len) == 0, "an accepted geometry does not encode");
    st_fuzz_require(len == n && memcmp(back, p, n) == 0, "a geometry record is not canonical");
    free(back);
    free(t);
}

static void manifest(const uint8_t *p, size_t n)
{
    uint8_t *buf = malloc(n ? n : 1), *back = NULL;
    st_manifest m;
    size_t len = 0;
    st_fuzz_require(buf != NULL, "no memory");
    memcpy(buf, p, n);
    if (n >= ST_MANIFEST_HDR + ST_MANIFEST_TRAILER) {
        uint64_t sum = st_checksum(buf, n - ST_MANIFEST_TRAILER);
        for (int i = 0; i < 8; i++)
            buf[n - ST_MANIFEST_TRAILER + i] = (uint8_t)(sum >> (8 * i));
    }
    int rc = st_manifest_parse(buf, n, "fuzz", &m);
    if (rc) {
        st_fuzz_require(m.ckpt == NULL && m.sec == NULL && m.chunks == NULL, "arrays after an error");
        refused(rc);
        free(buf);
        return;
    }
    for (uint32_t i = 0; i < m.n_sec; i++)
        st_fuzz_require(m.sec[i].first <= m.n_chunks && m.sec[i].n_chunks <= m.n_chunks - m.sec[i].first,
                        "a section's chunks outside the table");
    st_fuzz_require(st_manifest_encode(&m, &back, &len) == 0, "an accepted manifest does not encode");
    st_fuzz_require(len == n && memcmp(back, buf, n) == 0, "a manifest is not canonical");
    free(back);
    st_manifest_free(&m);
    free(buf);
}

static void vkey(const uint8_t *p, size_t n)
{
    char id[ST_VKEY_MAX + 1];
    uint8_t back[ST_VKEY_MAX];
    uint64_t version = 0;
    int rc = st_vkey_parse(p, n, id, &version);
    if (rc) {
        refused(rc);
        return;
    }
    st_fuzz_require(st_store_id_valid(id), "a versions key of an invalid id");
    size_t len = st_vkey(back, id, version);
    st_fuzz_require(len == n && memcmp(back, p, n) == 0, "a versions key is not canonical");
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    if (size == 0)
        return 0;
    const uint8_t *p = data + 1;
    size_t n = size - 1;
    switch (data[0] & 3) {
    case 0: session(p, n); break;
    case 1: geometry(p, n); break;
    case 2: manifest(p, n); break;
    default: vkey(p, n); break;
    }
    return 0;
}
