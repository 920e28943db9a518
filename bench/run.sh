#!/usr/bin/env bash
# `make bench`: every CPU benchmark of this build, each printing figures as ratios to limits
# measured in the same run. BENCH_ARGS passes extra options to each (e.g. BENCH_ARGS=--quick,
# which every one of them takes). The GPU benchmarks (bench_gpu_*) run on the GPU machine through
# bench/gpu.sh, which also builds and runs the gpu tests.
set -euo pipefail
build=${1:-build}
status=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  case "$(basename "$b")" in bench_gpu_*) continue ;; esac
  printf '\n===== %s\n' "$(basename "$b")"
  "$b" ${BENCH_ARGS:-} || { echo "$(basename "$b") failed" >&2; status=1; }
done
exit $status
