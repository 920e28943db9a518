#!/bin/sh
# test_version.sh - every program prints the project's one version (project(strata VERSION) in
# CMakeLists.txt) for --version: "NAME VERSION" first on stdout, exit 0, and names --version in
# its --help.
#   test_version.sh BIN_DIR VERSION PROGRAM...
set -u
bin=$1 version=$2
shift 2
bad=0
for p in "$@"; do
  out=$("$bin/$p" --version 2>"$bin/../tests/tmp/version-$p.err"); rc=$?
  first=$(printf '%s\n' "$out" | head -n 1)
  case "$rc:$first" in
    "0:$p $version"|"0:$p $version "*) echo "$p: $first" ;;
    *) echo "test_version: $p --version: exit $rc, printed '$first' (want '$p $version')" >&2
       cat "$bin/../tests/tmp/version-$p.err" >&2; bad=1 ;;
  esac
  "$bin/$p" --help 2>&1 | grep -q -- '--version' ||
    { echo "test_version: $p --help does not name --version" >&2; bad=1; }
done
exit $bad
