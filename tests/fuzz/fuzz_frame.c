/*
 * fuzz_frame.c - libFuzzer target for the frame decoder (st_frame_decoded_size, st_frame_decode),
 * which reads every compressed chunk of the store and every framed section of a session file.
 *
 * Properties checked on every input:
 * 1. A refused frame ends in a typed error with a detail; a frame that declares more than the
 *    buffer holds is ST_ETOOBIG before anything is decoded.
 * 2. An accepted frame decodes to exactly the size its header declares, and the decoded size
 *    agrees with st_frame_decoded_size.
 * 3. The decoded bytes encoded again (without shuffle and with the widths the format has) decode
 *    to the same bytes.
 */
#include <errno.h>
#include <string.h>

#include "st_fuzz.h"

#define FUZZ_FRAME_CAP (4u << 20) /* the decode buffer: declared sizes above it are ST_ETOOBIG */

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    static st_frame_ctx *ctx;
    static uint8_t *out, *enc, *again;
    if (!ctx) {
        ctx = st_frame_ctx_new();
        out = malloc(FUZZ_FRAME_CAP);
        again = malloc(FUZZ_FRAME_CAP);
        enc = malloc(st_frame_bound(FUZZ_FRAME_CAP));
        st_fuzz_require(ctx && out && again && enc, "no memory");
    }
    uint64_t declared = 0;
    size_t n = 0;
    int hdr = st_frame_decoded_size(data, size, &declared);
    int rc = st_frame_decode(ctx, out, FUZZ_FRAME_CAP, data, size, &n);
    if (hdr)
        st_fuzz_require(rc != 0, "a frame whose header is refused decodes");
    if (rc) {
        st_fuzz_require(st_fuzz_typed(rc) && rc != ST_EINVAL, "an untyped error");
        st_fuzz_require(st_errdetail()[0] != '\0', "an error without a detail");
        if (!hdr && declared > FUZZ_FRAME_CAP)
            st_fuzz_require(rc == ST_ETOOBIG, "an oversized frame is not ST_ETOOBIG");
        return 0;
    }
    st_fuzz_require(hdr == 0 && n == declared, "decoded size differs from the declared size");
    static const unsigned widths[] = {0, 2, 4, 8};
    for (size_t w = 0; w < sizeof widths / sizeof widths[0]; w++) {
        size_t elen = 0, n2 = 0;
        st_fuzz_require(st_frame_encode(ctx, enc, st_frame_bound(FUZZ_FRAME_CAP), out, n, widths[w], 1,
                                        &elen) == 0,
                        "decoded bytes do not encode");
        st_fuzz_require(st_frame_decode(ctx, again, FUZZ_FRAME_CAP, enc, elen, &n2) == 0 && n2 == n &&
                            memcmp(again, out, n) == 0,
                        "re-encoded bytes do not decode to themselves");
    }
    return 0;
}
