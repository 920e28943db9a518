/*
 * st_hex.c - bytes to lowercase hex and back, the one hex printer and parser of the project.
 * Invariant: encode writes exactly 2n digits and a NUL; decode reads exactly 2n characters and
 * accepts nothing but hex digits (no sign, no space, no "0x").
 */
#include "st_common.h"

void st_hex_encode(char *dst, const uint8_t *p, size_t n)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        dst[2 * i] = digits[p[i] >> 4];
        dst[2 * i + 1] = digits[p[i] & 15];
    }
    dst[2 * n] = '\0';
}

static int st_hex_digit(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int st_hex_decode(uint8_t *dst, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i++) {
        int hi = st_hex_digit(s[2 * i]);
        if (hi < 0)
            return ST_EINVAL;
        int lo = st_hex_digit(s[2 * i + 1]);
        if (lo < 0)
            return ST_EINVAL;
        dst[i] = (uint8_t)(hi << 4 | lo);
    }
    return 0;
}
