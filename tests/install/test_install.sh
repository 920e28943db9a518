#!/bin/sh
# test_install.sh - `make install` as a distribution runs it: the build installed with
# `cmake --install BUILD --prefix /usr --component runtime|dev` into DESTDIR=TMP/root, then a
# program built against the installed headers and `pkg-config strata` only (PKG_CONFIG_PATH and
# PKG_CONFIG_SYSROOT_DIR into TMP/root), linked with libstrata.so and with libstrata.a, and run.
#
#   test_install.sh BUILD TMP LIBDIR VERSION CC [EXTRA_CFLAGS]
# LIBDIR: CMAKE_INSTALL_LIBDIR of BUILD (lib, or lib/x86_64-linux-gnu); EXTRA_CFLAGS: the
# sanitizer flags of a sanitized build (its libraries need their runtime in the program).
# Checks: every program and library at its place, the soname, strata.pc's version and prefix
# (/usr, DESTDIR never written into it), each program's --version from the installed tree, the
# client's two links (libstrata.so.MAJOR needed by one, by the other not) and their runs.
set -eu
build=$1 tmp=$2 libdir=$3 version=$4 cc=$5 extra=${6:-}
here=$(cd "$(dirname "$0")" && pwd)
root=$tmp/root
fail() { echo "test_install: $*" >&2; exit 1; }

rm -rf "$tmp"
mkdir -p "$tmp"
for comp in runtime dev; do
  DESTDIR=$root cmake --install "$build" --prefix /usr --component $comp >"$tmp/install-$comp.log" 2>&1 ||
    { cat "$tmp/install-$comp.log" >&2; fail "cmake --install --component $comp failed"; }
done
# nothing outside the prefix
[ "$(ls "$root")" = usr ] || fail "installed outside /usr: $(ls "$root")"

major=${version%%.*}
lib=$root/usr/$libdir
for f in usr/bin/strata-server usr/bin/statectl usr/bin/strata usr/bin/strata-mkmodel \
         usr/$libdir/libstrata.a usr/$libdir/libstrata.so.$version usr/$libdir/pkgconfig/strata.pc \
         usr/include/strata/st_version.h usr/include/strata/st_codec.h; do
  [ -e "$root/$f" ] || fail "$f not installed"
done
[ "$(readlink "$lib/libstrata.so.$major")" = libstrata.so.$version ] || fail "libstrata.so.$major is not a link to libstrata.so.$version"
[ "$(readlink "$lib/libstrata.so")" = libstrata.so.$major ] || fail "libstrata.so is not a link to libstrata.so.$major"
soname=$(readelf -d "$lib/libstrata.so.$version" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
[ "$soname" = libstrata.so.$major ] || fail "soname '$soname', not libstrata.so.$major"

for p in strata-server statectl strata strata-mkmodel; do
  out=$("$root/usr/bin/$p" --version) || fail "installed $p --version failed"
  case "$out" in "$p $version"|"$p $version "*) ;; *) fail "installed $p --version printed '$out'" ;; esac
done

# strata.pc: found through PKG_CONFIG_PATH, its paths under the sysroot
export PKG_CONFIG_PATH=$lib/pkgconfig PKG_CONFIG_SYSROOT_DIR=$root
grep -qx 'prefix=/usr' "$lib/pkgconfig/strata.pc" || fail "strata.pc: prefix is not /usr: $(grep prefix= "$lib/pkgconfig/strata.pc")"
[ "$(pkg-config --modversion strata)" = "$version" ] || fail "pkg-config --modversion strata: $(pkg-config --modversion strata)"
cflags=$(pkg-config --cflags strata) || fail "pkg-config --cflags strata failed"
libs=$(pkg-config --libs strata) || fail "pkg-config --libs strata failed"
slibs=$(pkg-config --static --libs strata) || fail "pkg-config --static --libs strata failed"
# The sysroot prefixes every -L, also those of libraries outside the root (the CUDA toolkit's in
# Libs.private): the linker gets those real directories through LIBRARY_PATH.
for d in $(PKG_CONFIG_SYSROOT_DIR= pkg-config --static --libs-only-L strata); do
  d=${d#-L}
  case "$d" in /usr/$libdir|/usr/lib*) ;; *) LIBRARY_PATH=$d${LIBRARY_PATH:+:$LIBRARY_PATH} ;; esac
done
export LIBRARY_PATH=${LIBRARY_PATH:-}

# the client: every installed header included
: >"$tmp/st_install_all.h"
for h in "$root"/usr/include/strata/*.h; do
  echo "#include \"${h##*/}\"" >>"$tmp/st_install_all.h"
done
compile() { # OUT LIBS...
  out=$1; shift
  # shellcheck disable=SC2086
  $cc -std=c11 -Wall -Wextra -Werror $extra $cflags -I"$tmp" -o "$out" "$here/st_install_client.c" "$@" \
    >"$out.log" 2>&1 || { cat "$out.log" >&2; fail "building $out failed: $cc ... $cflags $*"; }
}
# shellcheck disable=SC2086
compile "$tmp/client-shared" $libs
# the static link: libstrata.a by name, everything else as pkg-config --static gives it
# shellcheck disable=SC2086
compile "$tmp/client-static" $(echo " $slibs " | sed 's/ -lstrata / -l:libstrata.a /')

readelf -d "$tmp/client-shared" | grep -q "NEEDED.*\[libstrata.so.$major\]" || fail "client-shared does not need libstrata.so.$major"
! readelf -d "$tmp/client-static" | grep -q "NEEDED.*libstrata" || fail "client-static needs libstrata.so"
out=$(LD_LIBRARY_PATH=$lib "$tmp/client-shared" "$tmp/store-shared") || fail "client-shared failed"
[ "$out" = "ok $version" ] || fail "client-shared printed '$out'"
out=$("$tmp/client-static" "$tmp/store-static") || fail "client-static failed"
[ "$out" = "ok $version" ] || fail "client-static printed '$out'"
echo "test_install: ok ($(ls "$root"/usr/include/strata | wc -l) headers, libstrata.so.$version, strata.pc $version)"
