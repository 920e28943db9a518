#!/bin/sh
# test_no_cmocka.sh - cmocka is needed only when the tests are built: with pkg-config unable to
# find cmocka (a pkg-config directory holding every system .pc file but cmocka.pc), the tree
# configures with -DSTRATA_BUILD_TESTS=OFF, and with the tests on it is refused naming cmocka.
# Configuring only: docs/PACKAGING.md gives the full build without cmocka.
#   test_no_cmocka.sh SOURCE_DIR TMP
set -eu
src=$1 tmp=$2
fail() { echo "test_no_cmocka: $*" >&2; exit 1; }
rm -rf "$tmp"
mkdir -p "$tmp/pc"
for d in $(pkg-config --variable pc_path pkg-config | tr : ' '); do
  [ -d "$d" ] || continue
  for f in "$d"/*.pc; do
    [ -e "$f" ] && [ "${f##*/}" != cmocka.pc ] && [ ! -e "$tmp/pc/${f##*/}" ] && ln -s "$f" "$tmp/pc/"
  done
done
export PKG_CONFIG_LIBDIR=$tmp/pc PKG_CONFIG_PATH=
! pkg-config --exists cmocka || fail "cmocka still found"
cmake -S "$src" -B "$tmp/off" -DSTRATA_BUILD_TESTS=OFF -DSTRATA_CUDA=OFF >"$tmp/off.log" 2>&1 ||
  { cat "$tmp/off.log" >&2; fail "STRATA_BUILD_TESTS=OFF did not configure without cmocka"; }
grep -q 'tests OFF' "$tmp/off.log" || fail "no 'tests OFF' in the configure output"
[ ! -e "$tmp/off/tests" ] || fail "tests/ configured with STRATA_BUILD_TESTS=OFF"
if cmake -S "$src" -B "$tmp/on" -DSTRATA_BUILD_TESTS=ON -DSTRATA_CUDA=OFF >"$tmp/on.log" 2>&1; then
  fail "STRATA_BUILD_TESTS=ON configured without cmocka"
fi
grep -q cmocka "$tmp/on.log" || { cat "$tmp/on.log" >&2; fail "the refusal does not name cmocka"; }
echo "test_no_cmocka: ok (OFF configures without cmocka; ON is refused naming it)"
