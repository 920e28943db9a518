#!/usr/bin/env bash
# bench/llama_cuda.sh - issue 14 section 5: Strata's CUDA backend and llama.cpp's on the same
# GGUF files, side by side. llama.cpp is the v0.4.0 source that node-llama-cpp 3.21.1 ships as a
# git bundle (tests/ref/node_modules/node-llama-cpp/llama/gitRelease.bundle, installed by
# `make deps`), built here with CUDA; its llama-bench gives prefill and decode tokens/s, and
# bench_gpu_arch (bench/bench_gpu_arch.c) gives Strata's on the same file.
#
# On the GPU machine (../shared/device/README.md), carry [".debs",
# "tests/ref/node_modules/node-llama-cpp/llama/gitRelease.bundle",
# "tests/ref/node_modules/node-llama-cpp/llama/llama.cpp.info.json"] and run
#     bash .debs/setup.sh && bash bench/llama_cuda.sh
# Environment:
#   MODELS   ARCH:PRESET:TYPE list for strata-mkmodel (default: the issue's three models:
#            qwen35 qwen35-0.8b q8_0, qwen35 qwen35-0.8b q4_K, llama llama-3.2-1b q4_K)
#   PROMPT   prefill tokens (default 2048); DECODE: decode tokens (default 64)
#   BUILD_GPU  Strata's build (default build-gpu); LLAMA_BUILD: llama.cpp's (default /tmp/llama-cuda)
#   LLAMA_CUDA 1 (default) builds llama.cpp with CUDA for sm_90; 0 builds it for the CPU and
#            skips Strata's GPU run (a dry run of this script on a machine without a GPU)
#   OUT      where the logs go (default $LLAMA_BUILD/logs)
#   REUSE    1: a model file already in $LLAMA_BUILD is used as it is (made by an earlier run)
#   STATE_TOKENS  the conversation of the state figures (default 32768; 0: none): on the first
#            model, llama.cpp's state save and restore (bench/llama_state.c against libllama)
#            and Strata's PARK / RESTORE / SAVE (bench_gpu_engine --model) on the same shape
# Prints each side's own output, then the table of ratios (bench/llama_cuda_table.sh).
# Exit status 0 only when both sides ran on every model.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=tests/ref/node_modules/node-llama-cpp/llama/gitRelease.bundle
lb=${LLAMA_BUILD:-/tmp/llama-cuda}
sb=${BUILD_GPU:-build-gpu}
cuda=${LLAMA_CUDA:-1}
prompt=${PROMPT:-2048}
decode=${DECODE:-64}
models=${MODELS:-"qwen35:qwen35-0.8b:q8_0 qwen35:qwen35-0.8b:q4_K llama:llama-3.2-1b:q4_K"}
out=${OUT:-$lb/logs}
mkdir -p "$lb" "$out"
rm -f "$out"/*.md "$out/llama-state.txt" # the table reads this run's outputs only
status=0
if [ ! -f "$bundle" ]; then
  echo "llama_cuda.sh: $bundle is missing (make deps installs it; carry it to the GPU machine)" >&2
  exit 1
fi

# ---- Strata ----------------------------------------------------------------------------------
targets="strata-mkmodel"
[ "$cuda" = 1 ] && targets="$targets bench_gpu_arch"
if ! { cmake -S . -B "$sb" -G Ninja -DSTRATA_CUDA="$([ "$cuda" = 1 ] && echo ON || echo AUTO)" \
  -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=RelWithDebInfo &&
  cmake --build "$sb" -j "$(nproc)" --target $targets; } >"$out/strata-build.log" 2>&1; then
  echo "llama_cuda.sh: building Strata failed (see $out/strata-build.log)" >&2
  exit 1
fi

# ---- the models, made while llama.cpp builds (the quantizer is one thread per model) --------
declare -A made
for spec in $models; do
  IFS=: read -r arch preset wtype <<<"$spec"
  file="$lb/$arch-$preset-$wtype.gguf"
  made[$spec]=""
  [ "${REUSE:-0}" = 1 ] && [ -s "$file" ] && continue
  "$sb/tools/strata-mkmodel" --arch "$arch" --preset "$preset" --wtype "$wtype" -o "$file" \
    >"$out/mkmodel-$arch-$preset-$wtype.log" 2>&1 &
  made[$spec]=$!
done

# ---- llama.cpp from the bundle ----------------------------------------------------------------
if [ ! -d "$lb/src/.git" ]; then
  rm -rf "$lb/src"
  git clone -q "$bundle" "$lb/src" 2>"$out/llama-clone.log" || {
    echo "llama_cuda.sh: cloning the bundle failed (see $out/llama-clone.log)" >&2
    exit 1
  }
fi
echo "== llama.cpp $(git -C "$lb/src" log --oneline -1) ($(sed -n 's/.*"tag": *"\([^"]*\)".*/\1/p' \
  tests/ref/node_modules/node-llama-cpp/llama/llama.cpp.info.json)), CUDA $cuda"
flags=(-DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release)
if [ "$cuda" = 1 ]; then
  flags+=(-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
fi
t0=$(date +%s)
if ! { cmake -S "$lb/src" -B "$lb/build" "${flags[@]}" &&
  cmake --build "$lb/build" -j "$(nproc)" --target llama-bench; } >"$out/llama-build.log" 2>&1; then
  echo "llama_cuda.sh: building llama-bench failed (see $out/llama-build.log)" >&2
  tail -20 "$out/llama-build.log" >&2
  exit 1
fi
echo "llama-bench built in $(($(date +%s) - t0)) s"
state_tokens=${STATE_TOKENS:-32768}
if [ "$state_tokens" != 0 ]; then
  if ! cc -O2 -std=c11 -D_GNU_SOURCE -o "$lb/llama_state" bench/llama_state.c -I"$lb/src/include" \
    -I"$lb/src/ggml/include" -L"$lb/build/bin" -lllama -lggml -lggml-base -lm \
    -Wl,-rpath,"$lb/build/bin" >"$out/llama-state-build.log" 2>&1; then
    echo "llama_cuda.sh: building bench/llama_state.c failed (see $out/llama-state-build.log)" >&2
    status=1
    state_tokens=0
  fi
fi
[ "$cuda" = 1 ] && targets_state=bench_gpu_engine || targets_state=
if [ -n "$targets_state" ] && [ "$state_tokens" != 0 ] &&
  ! cmake --build "$sb" -j "$(nproc)" --target bench_gpu_engine >>"$out/strata-build.log" 2>&1; then
  echo "llama_cuda.sh: building bench_gpu_engine failed" >&2
  status=1
fi
first=1

# ---- the models, both sides ---------------------------------------------------------------
for spec in $models; do
  IFS=: read -r arch preset wtype <<<"$spec"
  file="$lb/$arch-$preset-$wtype.gguf"
  if [ -n "${made[$spec]}" ] && ! wait "${made[$spec]}"; then
    echo "llama_cuda.sh: strata-mkmodel $spec failed (see $out/mkmodel-$arch-$preset-$wtype.log)" >&2
    status=1
    continue
  fi
  echo
  echo "== $spec ($(du -h "$file" | cut -f1)): llama.cpp"
  ngl=()
  [ "$cuda" = 1 ] && ngl=(-ngl 99)
  if ! "$lb/build/bin/llama-bench" -m "$file" -p "$prompt" -n "$decode" "${ngl[@]}" -r 3 -o md \
    2>"$out/llama-bench-$arch-$preset-$wtype.log" | tee "$out/llama-bench-$arch-$preset-$wtype.md"; then
    echo "llama_cuda.sh: llama-bench on $spec failed (see $out/llama-bench-$arch-$preset-$wtype.log)" >&2
    status=1
  fi
  if [ "$cuda" = 1 ]; then
    echo "== $spec: Strata"
    if ! "$sb/bench/bench_gpu_arch" --prompt "$prompt" --decode "$decode" "$file" \
      2>"$out/strata-$arch-$preset-$wtype.log" | tee "$out/strata-$arch-$preset-$wtype.md"; then
      echo "llama_cuda.sh: bench_gpu_arch on $spec failed" >&2
      status=1
    fi
  fi
  if [ "$first" = 1 ] && [ "$state_tokens" != 0 ]; then
    echo "== $spec: state of a ${state_tokens}-token conversation, llama.cpp (llama_state_seq_*)"
    ngl_state=99
    [ "$cuda" = 1 ] || ngl_state=0
    if ! "$lb/llama_state" "$file" --tokens "$state_tokens" --ngl "$ngl_state" --file "$lb/state.bin" \
      2>"$out/llama-state-$arch-$preset-$wtype.log" | tee "$out/llama-state.txt"; then
      echo "llama_cuda.sh: llama_state on $spec failed (see $out/llama-state-$arch-$preset-$wtype.log)" >&2
      status=1
    fi
    if [ "$cuda" = 1 ]; then
      echo "== $spec: state of a ${state_tokens}-token conversation, Strata (bench_gpu_engine)"
      if ! "$sb/bench/bench_gpu_engine" --dir "$lb" --model "$spec" --tokens "$state_tokens" \
        2>"$out/strata-state-$arch-$preset-$wtype.log" | tee "$out/strata-state.md"; then
        echo "llama_cuda.sh: bench_gpu_engine on $spec failed" >&2
        status=1
      fi
    fi
  fi
  first=0
  rm -f "$file"
done

# ---- the table: each figure as a ratio to llama.cpp's on the same file ------------------------
echo
echo "== side by side (ratio: Strata / llama.cpp; decode from the graphs column, as llama.cpp uses graphs)"
echo "| model | llama.cpp prefill | Strata prefill | ratio | llama.cpp decode | Strata decode | ratio |"
echo "|---|---|---|---|---|---|---|"
for spec in $models; do
  IFS=: read -r arch preset wtype <<<"$spec"
  bash bench/llama_cuda_table.sh row "$spec" "$out/llama-bench-$arch-$preset-$wtype.md" \
    "$out/strata-$arch-$preset-$wtype.md"
done
if [ "$state_tokens" != 0 ] && [ -f "$out/llama-state.txt" ]; then
  echo
  echo "== state of a ${state_tokens}-token conversation (ratio: llama.cpp's time / Strata's)"
  bash bench/llama_cuda_table.sh state "$out/llama-state.txt" "$out/strata-state.md"
fi
exit $status
