static int filename_ok(const char *f)
{
    size_t n = strlen(f);
    if (!n || n > 128)
        return 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)f[i];
        int alnum = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9');
        if (!alnum && (i == 0 || (ch != '.' && ch != '_' && ch != '-')))
            return 0;
    }
    return 1;
}
