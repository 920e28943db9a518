#!/usr/bin/env bash
# bench/gpu.sh - everything that needs the GPU machine, in one call: build with CUDA for sm_90,
# run the tests labelled `gpu`, run every GPU benchmark (bench_gpu_*), print a summary table.
#
# On the device (../shared/device/README.md): `../shared/device/pack-debs` once here, then the
# device tool with carry [".debs"] and the command
#     bash .debs/setup.sh && bash bench/gpu.sh
# Logs go to $OUT (the device tool brings them back), else to $BUILD_GPU/logs:
#   build.log (configure + build), tests.log (ctest -L gpu), bench.log (all GPU benchmarks),
#   summary.txt (what is printed last). Exit status: 0 only when the build, every gpu test and
#   every GPU benchmark succeeded.
# Environment: BUILD_GPU (default build-gpu), GPU_BENCH_ARGS (extra options for each benchmark),
# GPU_TEST_TIMEOUT (seconds per test, default 300). To spend less device time on one part:
# GPU_TARGETS (build only these targets, e.g. "test_gpu_engine strata bench_gpu_engine"),
# GPU_TESTS (a ctest -R regex among the gpu tests), GPU_BENCHES (a regex of bench_gpu_* names).
set -uo pipefail
cd "$(dirname "$0")/.."
build=${BUILD_GPU:-build-gpu}
out=${OUT:-$build/logs}
mkdir -p "$out"
summary=$out/summary.txt
: >"$summary"
status=0
t_start=$(date +%s)

say() { printf '%s\n' "$*" | tee -a "$summary"; }
elapsed() { echo $(($(date +%s) - t_start)); }

say "== bench/gpu.sh on $(hostname): $(nvidia-smi --query-gpu=name,driver_version,memory.total \
  --format=csv,noheader 2>/dev/null || echo 'no nvidia-smi'); nvcc $(nvcc --version 2>/dev/null |
  sed -n 's/.*release \([0-9.]*\).*/\1/p'); $(nproc) CPUs"

# ---- build: the whole tree, keep going past failures so that the GPU parts still get built ----
{
  cmake -S . -B "$build" -G Ninja -DSTRATA_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 &&
    if [ -n "${GPU_TARGETS:-}" ]; then
      # shellcheck disable=SC2086
      cmake --build "$build" -j "$(nproc)" --target $GPU_TARGETS -- -k 0
    else
      cmake --build "$build" -j "$(nproc)" -- -k 0
    fi
} >"$out/build.log" 2>&1
build_rc=$?
if [ $build_rc -ne 0 ]; then
  status=1
  say "build: FAILED (rc $build_rc); first errors:"
  grep -E 'error:|FAILED:|Error' "$out/build.log" | head -20 | tee -a "$summary"
else
  say "build: ok ($(elapsed) s)"
fi

# ---- tests labelled gpu ------------------------------------------------------------------------
if [ -f "$build/CTestTestfile.cmake" ]; then
  ctest --test-dir "$build" -L gpu ${GPU_TESTS:+-R "$GPU_TESTS"} --output-on-failure -V \
    --timeout "${GPU_TEST_TIMEOUT:-300}" >"$out/tests.log" 2>&1
  test_rc=$?
  [ $test_rc -eq 0 ] || status=1
  say ""
  say "tests (ctest -L gpu): $([ $test_rc -eq 0 ] && echo 'all passed' || echo "FAILED (rc $test_rc)")"
  say "$(printf '%-28s %-8s %10s' test result seconds)"
  sed -n 's/^ *[0-9]*\/[0-9]* Test *#[0-9]*: \([^ ]*\) \.*\** *\([A-Za-z*]*[A-Za-z]\).* \([0-9.]*\) sec$/\1 \2 \3/p' \
    "$out/tests.log" | while read -r name result secs; do
    say "$(printf '%-28s %-8s %10s' "$name" "$result" "$secs")"
  done
  grep -E '^(FAIL|\[  FAILED  \]|\[  ERROR   \]).*|test_[a-z_]*: FAIL' "$out/tests.log" | head -20 |
    tee -a "$summary"
  # figures the engine tests print (GPU logits against the CPU)
  grep -oE '(gpu-vs-cpu|across backends).*' "$out/tests.log" | tee -a "$summary"
else
  status=1
  say "tests: not run (no build)"
fi

# ---- GPU benchmarks ----------------------------------------------------------------------------
: >"$out/bench.log"
ran=0
for b in "$build"/bench/bench_gpu_*; do
  [ -x "$b" ] || continue
  name=$(basename "$b")
  [[ -z "${GPU_BENCHES:-}" || "$name" =~ $GPU_BENCHES ]] || continue
  ran=1
  say ""
  say "== $name ${GPU_BENCH_ARGS:-}"
  # shellcheck disable=SC2086
  "$b" ${GPU_BENCH_ARGS:-} >"$out/$name.tmp" 2>&1
  rc=$?
  cat "$out/$name.tmp" >>"$out/bench.log"
  tee -a "$summary" <"$out/$name.tmp"
  rm -f "$out/$name.tmp"
  if [ $rc -ne 0 ]; then
    status=1
    say "$name: FAILED (rc $rc)"
  fi
done
[ $ran -eq 1 ] || { status=1; say "benchmarks: none built"; }

say ""
say "bench/gpu.sh: $([ $status -eq 0 ] && echo ok || echo FAILED) in $(elapsed) s; logs in $out"
exit $status
