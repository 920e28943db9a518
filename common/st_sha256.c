/*
 * st_sha256.c - SHA-256 over OpenSSL's EVP interface, the project's one wrapper of it.
 * Invariants: a context's EVP state is freed exactly once (final or free, whichever comes first;
 * both set ctx to NULL); a failed step is never reported as success.
 */
#include <openssl/evp.h>

#include "st_common.h"

int st_sha256_init(st_sha256_ctx *h)
{
    h->failed = 0;
    h->ctx = EVP_MD_CTX_new();
    if (!h->ctx || EVP_DigestInit_ex(h->ctx, EVP_sha256(), NULL) != 1) {
        st_sha256_free(h);
        return st_error_set(ST_EIO, "SHA-256: OpenSSL EVP_DigestInit_ex failed");
    }
    return 0;
}

void st_sha256_update(st_sha256_ctx *h, const void *p, size_t n)
{
    if (!h->failed && (!h->ctx || EVP_DigestUpdate(h->ctx, p, n) != 1))
        h->failed = 1;
}

int st_sha256_final(st_sha256_ctx *h, uint8_t out[ST_SHA256_LEN])
{
    unsigned len = 0;
    int ok = !h->failed && h->ctx && EVP_DigestFinal_ex(h->ctx, out, &len) == 1 && len == ST_SHA256_LEN;
    st_sha256_free(h);
    return ok ? 0 : st_error_set(ST_EIO, "SHA-256: OpenSSL EVP_DigestUpdate or EVP_DigestFinal_ex failed");
}

void st_sha256_free(st_sha256_ctx *h)
{
    if (!h)
        return;
    EVP_MD_CTX_free(h->ctx);
    h->ctx = NULL;
}

int st_sha256(const void *p, size_t n, uint8_t out[ST_SHA256_LEN])
{
    unsigned len = 0;
    if (!EVP_Digest(p, n, out, &len, EVP_sha256(), NULL) || len != ST_SHA256_LEN)
        return st_error_set(ST_EIO, "SHA-256: OpenSSL EVP_Digest failed");
    return 0;
}
