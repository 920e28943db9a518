# embed.cmake: cmake -DIN=index.html -DOUT=st_web_page.c -P embed.cmake - the page as a C array
# (st_web_page, st_web_page_len), so that strata-server ships it in its binary.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" n)
math(EXPR len "${n} / 2")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," body "${hex}")
string(REGEX REPLACE "((0x[0-9a-f][0-9a-f],){16})" "\\1\n" body "${body}")
file(WRITE "${OUT}.tmp"
     "/* generated from api/web/index.html by api/web/embed.cmake: do not edit */\n"
     "#include <stddef.h>\n"
     "extern const unsigned char st_web_page[];\n"
     "extern const size_t st_web_page_len;\n"
     "const unsigned char st_web_page[] = {\n${body}0x00};\n"
     "const size_t st_web_page_len = ${len};\n")
file(RENAME "${OUT}.tmp" "${OUT}")
