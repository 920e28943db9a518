#!/usr/bin/env bash
# `make bench`: every CPU benchmark of this build, each printing figures as ratios to limits
# measured in the same run. BENCH_ARGS passes extra options to each (e.g. BENCH_ARGS=--quick,
# which every one of them takes). Then bench_vs_llama.mjs: the engine side by side with llama.cpp
# (node-llama-cpp of tests/ref, installed by `make deps`) on the same seeded GGUF files; it takes
# --quick too (one run of each figure). The GPU benchmarks (bench_gpu_*) run on the GPU machine through
# bench/gpu.sh, which also builds and runs the gpu tests.
set -euo pipefail
build=${1:-build}
status=0
for b in "$build"/bench/bench_*; do
  [ -x "$b" ] || continue
  # bench_state takes a model file: a harness for profiles and A/B runs (docs/BENCHMARKS.md);
  # bench_vocab a vocabulary and a text: bench_vocab.mjs below gives them
  case "$(basename "$b")" in bench_gpu_*|bench_state|bench_vocab) continue ;; esac
  printf '\n===== %s\n' "$(basename "$b")"
  "$b" ${BENCH_ARGS:-} || { echo "$(basename "$b") failed" >&2; status=1; }
done
printf '\n===== bench_vs_llama\n'
node "$(dirname "$0")/bench_vs_llama.mjs" --build "$build" ${BENCH_ARGS:-} ||
  { echo "bench_vs_llama failed" >&2; status=1; }
printf '\n===== bench_vocab (one core)\n'
taskset -c 0 node "$(dirname "$0")/bench_vocab.mjs" --build "$build" ${BENCH_ARGS:-} ||
  { echo "bench_vocab failed" >&2; status=1; }
exit $status
