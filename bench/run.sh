#!/usr/bin/env bash
# `make bench`: every benchmark of this build, each printing figures as ratios to limits measured
# in the same run. BENCH_ARGS passes extra options (e.g. --quick) to each.
set -euo pipefail
build=${1:-build}
status=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  printf '\n===== %s\n' "$(basename "$b")"
  "$b" ${BENCH_ARGS:-} || { echo "$(basename "$b") failed" >&2; status=1; }
done
exit $status
